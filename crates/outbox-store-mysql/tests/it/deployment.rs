//! Deployment faults at the store, against real MariaDB: a database that stops answering.

use std::time::Duration;

use outbox_store_mysql::MySqlStore;
use outbox_testkit::FaultProxy;

use crate::native_store;

/// A statement on a connection the network silently dropped waited for good: the claim
/// never ended, and the relay never claimed again while `/readyz` alone said so. Each
/// operation is now bounded, as PostgreSQL's are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_on_a_blackholed_connection_ends_with_a_retryable_error() {
    let url = outbox_testkit::fresh_mysql_database().await;
    native_store(&url, None).migrate().await.unwrap();
    let (proxy, proxied) = FaultProxy::start_for_url(&url).await.unwrap();
    let store: MySqlStore = native_store(&proxied, Some(Duration::from_secs(1)));
    outbox_testkit::conformance::a_claim_through_a_blackhole_fails_retryably(&store, &proxy).await;
}
