//! Every pooled connection keeps the store's session settings, including after it went back
//! to the pool (which resets it).

use mysql_async::prelude::Queryable;
use mysql_async::{Opts, OptsBuilder, Pool, PoolConstraints, PoolOpts};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_back_from_the_pool_keeps_utc_and_read_committed() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let one = PoolConstraints::new(0, 1).unwrap();
    let opts: Opts =
        outbox_store_mysql::session_settings(OptsBuilder::from_opts(Opts::from_url(&url).unwrap()))
            .pool_opts(PoolOpts::default().with_constraints(one))
            .into();
    let pool = Pool::new(opts);
    for use_ in ["new", "returned and reset"] {
        let mut conn = pool.get_conn().await.unwrap();
        let (zone, isolation): (String, String) = conn
            .query_first("SELECT @@session.time_zone, @@session.tx_isolation")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(zone, "+00:00", "a {use_} connection");
        // A user variable does not survive the reset: the second use is a reset connection.
        let marker: Option<i64> = conn
            .query_first("SELECT @relay_test_marker")
            .await
            .unwrap()
            .flatten();
        assert_eq!(marker, None, "a {use_} connection");
        conn.query_drop("SET @relay_test_marker = 1").await.unwrap();
        assert_eq!(isolation, "READ-COMMITTED", "a {use_} connection");
    }
    pool.disconnect().await.unwrap();
}
