//! Every pooled connection keeps the store's session settings, including after it went back
//! to the pool (which resets it).

use mysql_async::prelude::Queryable;
use mysql_async::{Opts, OptsBuilder, Pool};
use outbox_layout::sql::{MYSQL_IDLE_SESSION, MYSQL_LOCK_WAIT};

fn pool(url: &str) -> Pool {
    let opts: Opts =
        outbox_store_mysql::session_settings(OptsBuilder::from_opts(Opts::from_url(url).unwrap()))
            .pool_opts(outbox_store_mysql::pool_opts(2).unwrap())
            .into();
    Pool::new(opts)
}

/// A relay paused inside a transaction (SIGSTOP, a frozen VM) would keep its row locks for
/// the server's `wait_timeout`, 8 hours by default, and a standby taking over would wait on
/// them: the server ends a session of the relay idle past its bound, rolling it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_its_relay_left_idle_is_rolled_back_after_the_idle_bound() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let pool = pool(&url);
    let mut paused = pool.get_conn().await.unwrap();
    paused
        .query_drop("CREATE TABLE seat (id int PRIMARY KEY, epoch int NOT NULL)")
        .await
        .unwrap();
    paused
        .query_drop("INSERT INTO seat VALUES (1, 0)")
        .await
        .unwrap();
    paused.query_drop("BEGIN").await.unwrap();
    paused
        .query_drop("SELECT epoch FROM seat WHERE id = 1 LOCK IN SHARE MODE")
        .await
        .unwrap();
    // The standby's fencing write waits for that shared lock far longer than the bound, and
    // gets it once the server ends the idle session.
    let mut standby = mysql_async::Conn::new(Opts::from_url(&url).unwrap())
        .await
        .unwrap();
    standby
        .query_drop(format!(
            "SET SESSION innodb_lock_wait_timeout = {}",
            MYSQL_IDLE_SESSION.as_secs() * 4
        ))
        .await
        .unwrap();
    let fenced = standby
        .query_drop("UPDATE seat SET epoch = epoch + 1 WHERE id = 1")
        .await;
    assert!(fenced.is_ok(), "{fenced:?}");
    assert!(
        paused.query_drop("COMMIT").await.is_err(),
        "the idle session was ended"
    );
    drop(paused);
    pool.disconnect().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_back_from_the_pool_keeps_utc_read_committed_and_the_idle_and_lock_bounds() {
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
        let (id, zone, isolation, idle, marker): (u64, String, String, u64, Option<i64>) = conn
            .query_first(
                "SELECT CONNECTION_ID(), @@session.time_zone, @@session.tx_isolation, \
                 @@session.wait_timeout, @relay_test_marker",
            )
            .await
            .unwrap()
            .unwrap();
        let lock_waits: (u64, u64) = conn
            .query_first("SELECT @@session.innodb_lock_wait_timeout, @@session.lock_wait_timeout")
            .await
            .unwrap()
            .unwrap();
        let bound = MYSQL_LOCK_WAIT.as_secs();
        assert_eq!(lock_waits, (bound, bound), "use {use_}");
        ids.insert(id);
        assert_eq!(zone, "+00:00", "use {use_}");
        assert_eq!(isolation, "READ-COMMITTED", "use {use_}");
        assert_eq!(idle, MYSQL_IDLE_SESSION.as_secs(), "use {use_}");
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

/// An ack deletes claimed rows without waiting for an application's transaction still
/// inserting the next row (the store's sessions are READ COMMITTED; the multi-table
/// `DELETE o FROM` form read the row after the last one it deleted, and waited on it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_does_not_wait_for_an_insert_in_flight() {
    use outbox_layout::{sql::Sql, Dialect, Mapping};
    let url = outbox_testkit::fresh_mysql_database().await;
    let sql = Sql::new(Mapping::native_mysql(None, "outbox", false), Dialect::MySql).unwrap();
    let insert = "INSERT INTO outbox (sequence_id, destination, event_type, payload, locked_by) \
                  VALUES (?, 'd', 't', '{}', 'node-a')";
    let opts: Opts =
        outbox_store_mysql::session_settings(OptsBuilder::from_opts(Opts::from_url(&url).unwrap()))
            .pool_opts(outbox_store_mysql::pool_opts(2).unwrap())
            .into();
    let pool = Pool::new(opts);
    let mut relay = pool.get_conn().await.unwrap();
    relay.query_drop(sql.ddl().unwrap()).await.unwrap();
    for id in 1..=3 {
        relay.exec_drop(insert, (id,)).await.unwrap();
    }
    let mut app = mysql_async::Conn::new(Opts::from_url(&url).unwrap())
        .await
        .unwrap();
    app.query_drop("BEGIN").await.unwrap();
    app.exec_drop(insert, (4,)).await.unwrap();
    relay
        .query_drop("SET SESSION innodb_lock_wait_timeout = 1")
        .await
        .unwrap();
    let acked = relay
        .query_drop(sql.ack("IN (1, 2, 3)", 3, "'node-a'"))
        .await;
    assert!(acked.is_ok(), "{acked:?}");
    assert_eq!(relay.affected_rows(), 3);
    app.query_drop("ROLLBACK").await.unwrap();
    drop(relay);
    pool.disconnect().await.unwrap();
}
