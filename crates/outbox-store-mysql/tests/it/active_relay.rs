//! The table's active relay: one store claims at a time, and one that steps down (binlog
//! capture's parked table, when its reader loses the seat) lets another take the table at
//! once, while its process lives on.

use std::time::Duration;

use outbox_core::store::ClaimRequest;
use outbox_core::{NodeId, OutboxStore};
use outbox_store_mysql::MySqlStore;
use outbox_testkit::conformance::keyed_event;
use outbox_testkit::eventually;

fn store(url: &str) -> MySqlStore {
    crate::native_store(url, None)
}

fn claim_by(node: &str) -> ClaimRequest {
    ClaimRequest::new(NodeId(node.into()), 100, Duration::from_secs(30))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_steps_down_lets_another_take_the_table() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let first = store(&url);
    first.migrate().await.unwrap();
    let second = store(&url);
    first.insert(vec![keyed_event("k", 0)]).await.unwrap();
    assert_eq!(first.claim(claim_by("first")).await.unwrap().len(), 1);
    first
        .release(NodeId("first".into()), vec![1])
        .await
        .unwrap();
    assert!(
        second.claim(claim_by("second")).await.unwrap().is_empty(),
        "the first store is the table's active relay"
    );
    first.step_down().await;
    eventually(
        "the second store claims",
        Duration::from_secs(10),
        || async {
            let claimed = second.claim(claim_by("second")).await.unwrap();
            (!claimed.is_empty()).then_some(())
        },
    )
    .await;
}

/// The lock's connection sits idle between the checks that prove it alive, so it keeps the
/// server's `wait_timeout`: under the idle bound of the store's other sessions, an active
/// relay with nothing to do would lose the table every few seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_active_relays_lock_outlives_the_idle_bound_of_its_other_sessions() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let first = store(&url);
    first.migrate().await.unwrap();
    first.insert(vec![keyed_event("k", 0)]).await.unwrap();
    assert_eq!(first.claim(claim_by("first")).await.unwrap().len(), 1);
    // Idle, by design, for longer than the bound.
    tokio::time::sleep(outbox_layout::sql::MYSQL_IDLE_SESSION + Duration::from_secs(3)).await;
    assert!(first.is_active().await, "the lock's connection was ended");
}
