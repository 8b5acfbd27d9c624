//! Every pooled connection keeps the store's session settings, including after it went back
//! to the pool (which resets it).

use mysql_async::prelude::Queryable;
use mysql_async::{Opts, OptsBuilder, Pool};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_back_from_the_pool_keeps_utc_and_read_committed() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let opts: Opts =
        outbox_store_mysql::session_settings(OptsBuilder::from_opts(Opts::from_url(&url).unwrap()))
            .pool_opts(outbox_store_mysql::pool_opts(2).unwrap())
            .into();
    let pool = Pool::new(opts);
    // A connection goes back to the pool from a task of its own, after its drop: some uses
    // may find none back yet, and open one. Many sequential uses all but one of which open
    // their own are a pool that keeps nothing (every claim and ack logging in anew).
    let uses = 20;
    let mut ids = std::collections::BTreeSet::new();
    for use_ in 0..uses {
        let mut conn = pool.get_conn().await.unwrap();
        let (id, zone, isolation, marker): (u64, String, String, Option<i64>) = conn
            .query_first(
                "SELECT CONNECTION_ID(), @@session.time_zone, @@session.tx_isolation, \
                 @relay_test_marker",
            )
            .await
            .unwrap()
            .unwrap();
        ids.insert(id);
        assert_eq!(zone, "+00:00", "use {use_}");
        assert_eq!(isolation, "READ-COMMITTED", "use {use_}");
        // A user variable does not survive the reset: a kept connection was reset.
        assert_eq!(marker, None, "use {use_}");
        conn.query_drop("SET @relay_test_marker = 1").await.unwrap();
    }
    assert!(
        ids.len() < uses / 2,
        "{} connections for {uses} sequential uses: the pool keeps none",
        ids.len()
    );
    pool.disconnect().await.unwrap();
}
