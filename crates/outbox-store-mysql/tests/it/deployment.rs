//! Deployment faults at the store, against real MariaDB: a database that stops answering.

use std::time::Duration;

use outbox_core::store::ClaimRequest;
use outbox_core::{NodeId, OutboxStore, StoreErrorKind};
use outbox_layout::Mapping;
use outbox_store_mysql::{MySqlOptions, MySqlStore};
use outbox_testkit::{eventually, FaultProxy};

/// A statement on a connection the network silently dropped waited for good: the claim
/// never ended, and the relay never claimed again while `/readyz` alone said so. Each
/// operation is now bounded, as PostgreSQL's are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_on_a_blackholed_connection_ends_with_a_retryable_error() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let options = |url: &str| MySqlOptions {
        url: url.into(),
        mapping: Mapping::native_mysql(None, "outbox", false),
        layout: "native".into(),
        max_attempts: 10,
        pool_size: 2,
        nodes_table: None,
        operation_timeout: Some(Duration::from_secs(1)),
    };
    MySqlStore::new(options(&url))
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let (proxy, proxied) = FaultProxy::start_for_url(&url).await.unwrap();
    let store = MySqlStore::new(options(&proxied)).unwrap();
    store.ping().await.unwrap();

    proxy.blackhole();
    let claim = store.claim(ClaimRequest::new(
        NodeId::random(),
        10,
        Duration::from_secs(30),
    ));
    // Only a guard against hanging forever (what happened before the operation bound).
    let outcome = tokio::time::timeout(Duration::from_secs(60), claim)
        .await
        .expect("a claim on a dead connection must end");
    let error = outcome.expect_err("nothing can be claimed through a blackhole");
    assert_eq!(
        error.kind(),
        StoreErrorKind::Connection,
        "{}",
        error.report()
    );
    assert!(error.is_retryable());

    proxy.heal();
    eventually("the store to answer again", Duration::from_secs(60), || {
        let store = store.clone();
        async move { store.ping().await.ok() }
    })
    .await;
}
