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

/// `store` takes the table (a claim makes it the active relay) and leaves its one event
/// pending, for the next active relay.
async fn becomes_active_with_an_event(store: &MySqlStore) {
    store.insert(vec![keyed_event("k", 0)]).await.unwrap();
    assert_eq!(store.claim(claim_by("first")).await.unwrap().len(), 1);
    store
        .release(NodeId("first".into()), vec![1])
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_steps_down_lets_another_take_the_table() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let first = store(&url);
    first.migrate().await.unwrap();
    let second = store(&url);
    becomes_active_with_an_event(&first).await;
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

/// The active relay's host is gone (its connections blackholed: no FIN, no RST): the server
/// kept its session, and the lock with it, until `wait_timeout` (8 hours by default), and
/// the standby relayed nothing meanwhile. A live holder pings its lock's session every
/// `LOCK_KEEPALIVE`, so a standby now ends a session idle past `LOCK_STALE_AFTER` and takes
/// the table; a live holder's, checked for longer than that, it leaves alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_the_table_from_a_silent_holder_but_not_from_a_live_one() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let (proxy, proxied) = outbox_testkit::FaultProxy::start_for_url(&url)
        .await
        .unwrap();
    // Over TCP through the proxy: on a local server the driver would move to its socket.
    let first = crate::native_store(
        &format!("{proxied}?prefer_socket=false"),
        Some(Duration::from_secs(5)),
    );
    first.migrate().await.unwrap();
    let second = store(&url);
    becomes_active_with_an_event(&first).await;
    // Past the stale bound, a live holder keeps the table.
    let live_until = std::time::Instant::now()
        + outbox_store_mysql::LOCK_STALE_AFTER
        + outbox_store_mysql::LOCK_KEEPALIVE * 2;
    while std::time::Instant::now() < live_until {
        assert!(
            second.claim(claim_by("second")).await.unwrap().is_empty(),
            "the live first store is the table's active relay"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    proxy.blackhole();
    eventually(
        "the second store claims",
        outbox_store_mysql::LOCK_STALE_AFTER * 4,
        || async {
            let claimed = second.claim(claim_by("second")).await.unwrap();
            (!claimed.is_empty()).then_some(())
        },
    )
    .await;
    // The silent holder's own ping gives up within the operation timeout.
    eventually(
        "the silent holder finds its lock gone",
        Duration::from_secs(5) + outbox_store_mysql::LOCK_KEEPALIVE * 2,
        || async { (!first.is_active().await).then_some(()) },
    )
    .await;
}

/// The active relay whose lock's session ended (`KILL CONNECTION`) publishes nothing more of
/// what it held ([`MappedStore::keep_active`]).
///
/// [`MappedStore::keep_active`]: outbox_layout::store::MappedStore::keep_active
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_table_lock_ended_publishes_nothing_more_of_what_it_held() {
    use futures::FutureExt;
    use mysql_async::prelude::Queryable;

    let url = outbox_testkit::fresh_mysql_database().await;
    let relay = store(&url);
    relay.migrate().await.unwrap();
    let database = url.rsplit('/').next().unwrap().to_string();
    let name = outbox_core::ident::server_lock_name("outbox-relay ", &format!("{database}.outbox"));
    let take_over = async move {
        let pool = mysql_async::Pool::new(url.as_str());
        let mut admin = pool.get_conn().await.unwrap();
        let holder: u64 = admin
            .exec_first("SELECT IS_USED_LOCK(?)", (&name,))
            .await
            .unwrap()
            .expect("the relay holds the table's lock");
        let mut other = pool.get_conn().await.unwrap();
        let other_id = other.id();
        let taking = tokio::spawn(async move {
            let got: Option<i64> = other
                .exec_first("SELECT GET_LOCK(?, 60)", (&name,))
                .await
                .unwrap();
            assert_eq!(got, Some(1));
            // Held for the rest of the test.
            std::mem::forget(other);
        });
        eventually(
            "the other relay waits for the lock",
            Duration::from_secs(20),
            || async {
                let mut conn = pool.get_conn().await.unwrap();
                let state: Option<Option<String>> = conn
                    .exec_first(
                        "SELECT STATE FROM information_schema.PROCESSLIST WHERE ID = ?",
                        (other_id,),
                    )
                    .await
                    .unwrap();
                state.flatten().filter(|s| s.contains("lock")).map(|_| ())
            },
        )
        .await;
        admin
            .query_drop(format!("KILL CONNECTION {holder}"))
            .await
            .unwrap();
        taking.await.unwrap();
    };
    outbox_testkit::active_relay::a_relay_whose_table_lock_ended_publishes_nothing_more_of_what_it_held(
        std::sync::Arc::new(relay.clone()),
        |ownership| {
            relay
                .keep_active(ownership, Duration::from_secs(30), outbox_core::Health::new())
                .boxed()
        },
        take_over.boxed(),
    )
    .await;
}

/// A switchover demotes the primary (sets `read_only`) and moves the writers elsewhere: the
/// active relay's lock session, left on the old primary, kept answering its pings, so the
/// relay stayed active there while a standby on the new primary took the same lock freely.
/// The lock is now let go once its server turns read-only, and not taken on a read-only
/// server. `read_only` is server-wide: this test runs alone (`.config/nextest.toml`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_on_a_server_turned_read_only_is_let_go_and_not_taken_again() {
    use mysql_async::prelude::Queryable;
    let url = outbox_testkit::fresh_mysql_database().await;
    let first = store(&url);
    first.migrate().await.unwrap();
    becomes_active_with_an_event(&first).await;
    let mut admin = mysql_async::Conn::from_url(url.as_str()).await.unwrap();
    // The lock's holder, as the server sees it (the store names it after the table).
    let holder = "SELECT IS_USED_LOCK(CONCAT('outbox-relay ', DATABASE(), '.outbox'))";
    let held = async |admin: &mut mysql_async::Conn| -> bool {
        let holder: Result<Option<Option<u64>>, _> = admin.query_first(holder).await;
        !matches!(holder, Ok(Some(None)))
    };
    assert!(
        held(&mut admin).await,
        "the first store holds the table's lock"
    );
    admin.query_drop("SET GLOBAL read_only = 1").await.unwrap();
    let outcome = async {
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        while held(&mut admin).await || first.is_active().await {
            if std::time::Instant::now() > deadline {
                return Err("the lock is still held on the read-only server".to_string());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        match store(&url).claim(claim_by("second")).await {
            Ok(claimed) => Err(format!(
                "a store took the lock on the read-only server and claimed {}",
                claimed.len()
            )),
            Err(e)
                if e.to_string()
                    .contains("point the relay's URL at the primary") =>
            {
                Ok(())
            }
            Err(e) => Err(format!("refused without naming the fix: {e}")),
        }
    }
    .await;
    admin.query_drop("SET GLOBAL read_only = 0").await.unwrap();
    outcome.unwrap();
}

/// A server whose `wait_timeout` is shorter than the lock's keepalive (1 s here, on a
/// server of the test's own): the lock's session took the server's bound as its own, the
/// server ended it between pings, and the relay lost the table and reaped its own rows in
/// flight, sent again. The lock's session keeps at least a minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_active_relays_lock_outlives_a_server_wait_timeout_shorter_than_its_keepalive() {
    use mysql_async::prelude::Queryable;
    let server = outbox_testkit::server::ScriptedServer::start_with(
        "mariadb",
        "OUTBOX_TEST_MARIADB_PORT",
        &[("MARIADB_SERVER_ID", "11")],
    );
    let root = format!("mysql://root@127.0.0.1:{}/mysql", server.port);
    let mut admin = mysql_async::Conn::from_url(root.as_str()).await.unwrap();
    admin
        .query_drop("CREATE DATABASE shop; SET GLOBAL wait_timeout = 1")
        .await
        .unwrap();
    let first = store(&format!("mysql://root@127.0.0.1:{}/shop", server.port));
    first.migrate().await.unwrap();
    first.insert(vec![keyed_event("k", 0)]).await.unwrap();
    assert_eq!(first.claim(claim_by("first")).await.unwrap().len(), 1);
    // Idle, by design, for longer than the server's bound.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(first.is_active().await, "the lock's connection was ended");
}

/// A standby tries for the table's lock every second, on a connection of its own: one it
/// dropped without a word when the lock was taken, so the server logged an "Aborted
/// connection" warning and counted an aborted client each time, 86,000 a day per standby,
/// on a counter DBAs alert on. It now says goodbye. The server's log names the user of each
/// aborted connection; the standby runs as a user of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_ends_each_connection_it_tried_the_lock_on_cleanly() {
    use mysql_async::prelude::Queryable;
    let log = std::env::var("OUTBOX_TEST_MARIADB_LOG")
        .expect("OUTBOX_TEST_MARIADB_LOG: the test server's error log (scripts/servers.sh)");
    let url = outbox_testkit::fresh_mysql_database().await;
    let first = store(&url);
    first.migrate().await.unwrap();
    becomes_active_with_an_event(&first).await;
    let mut admin = mysql_async::Conn::from_url(url.as_str()).await.unwrap();
    let db: String = admin
        .query_first("SELECT DATABASE()")
        .await
        .unwrap()
        .unwrap();
    let user = format!("standby_{}", &db[db.len() - 8..]);
    admin
        .query_drop(format!(
            "SET GLOBAL userstat = 1;
             CREATE USER '{user}'@'%' IDENTIFIED BY 'pw';
             GRANT ALL ON `{db}`.* TO '{user}'@'%'"
        ))
        .await
        .unwrap();
    let standby = store(&url.replacen("root@", &format!("{user}:pw@"), 1));
    // Each try opens a connection: the pool's two, and three tries past them.
    let connections = format!(
        "SELECT CAST(TOTAL_CONNECTIONS AS SIGNED)
           FROM information_schema.USER_STATISTICS WHERE USER = '{user}'"
    );
    eventually(
        "the standby to try for the lock three times",
        Duration::from_secs(30),
        || {
            let (standby, connections, url) = (&standby, &connections, &url);
            async move {
                assert!(standby.claim(claim_by("standby")).await.unwrap().is_empty());
                let mut admin = mysql_async::Conn::from_url(url.as_str()).await.unwrap();
                let made: Option<i64> = admin.query_first(connections).await.unwrap();
                admin.disconnect().await.unwrap();
                made.filter(|n| *n >= 5)
            }
        },
    )
    .await;
    let aborted: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .filter(|l| l.contains("Aborted connection") && l.contains(&format!("user: '{user}'")))
        .map(str::to_string)
        .collect();
    assert!(aborted.is_empty(), "{aborted:#?}");
}
