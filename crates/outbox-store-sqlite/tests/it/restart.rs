//! A relay that crashed and starts again under the same `--node-id`.

use std::time::Duration;

use outbox_core::store::{ClaimRequest, NodeRegistry, Registration};
use outbox_core::{NodeId, OutboxStore};
use outbox_store_sqlite::SqliteStore;
use outbox_testkit::conformance::{keyed_event as event, payloads};

/// The claim lets a node's own leased rows pass (its engine holds them in order), so the
/// rows a crashed process leased under the same node id neither blocked its keys' later
/// rows nor could be claimed until their lease ran out (30 s): the later rows went first.
/// Registering anew gives the dead process's leases back.
#[tokio::test]
async fn a_node_started_again_under_its_id_claims_its_dead_leases_first() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("outbox.db"), false).unwrap();
    store.migrate().await.unwrap();
    store
        .insert(vec![event("k", 0), event("k", 1)])
        .await
        .unwrap();
    let node = NodeId("n1".into());
    let ttl = Duration::from_secs(10);
    let claim = |limit| ClaimRequest::new(node.clone(), limit, Duration::from_secs(30));
    assert!(matches!(
        store.register(node.clone(), ttl).await.unwrap(),
        Registration::Registered(_)
    ));
    assert_eq!(payloads(&store.claim(claim(1)).await.unwrap()), ["0"]);
    // The process dies (kill -9); its node row runs out.
    store
        .batch_execute("UPDATE outbox_nodes SET expiry = 0 WHERE id = 'n1'")
        .await
        .unwrap();
    assert!(matches!(
        store.register(node.clone(), ttl).await.unwrap(),
        Registration::Registered(_)
    ));
    assert_eq!(
        payloads(&store.claim(claim(100)).await.unwrap()),
        ["0", "1"]
    );
}

/// The database file removed and made again under a running relay (an application that
/// recreated its database): the relay's connection kept the old file, its claims found
/// nothing, and its ping (so `/readyz`) said all was well while no new event went out.
#[tokio::test]
async fn a_database_file_replaced_under_the_relay_fails_its_ping_naming_it() {
    use outbox_core::OutboxStore;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("outbox.db");
    let running = outbox_store_sqlite::SqliteStore::open(&path, false).unwrap();
    running.migrate().await.unwrap();
    running.ping().await.expect("the file it opened");
    for suffix in ["", "-wal", "-shm"] {
        let file = dir.path().join(format!("outbox.db{suffix}"));
        if file.exists() {
            std::fs::rename(&file, dir.path().join(format!("old.db{suffix}"))).unwrap();
        }
    }
    let again = outbox_store_sqlite::SqliteStore::open(&path, false).unwrap();
    again.migrate().await.unwrap();
    let err = running.ping().await.expect_err("another file at its path");
    assert!(err.to_string().contains("replaced"), "{err}");
    again.ping().await.expect("the new file's own store");
}

/// The same through a symbolic link re-pointed to another database (an atomic deploy):
/// SQLite resolves the link, so the file it names was not replaced.
#[tokio::test]
async fn a_database_link_pointed_elsewhere_fails_the_ping_too() {
    use outbox_core::OutboxStore;
    let dir = tempfile::tempdir().unwrap();
    let (first, second) = (dir.path().join("a.db"), dir.path().join("b.db"));
    let link = dir.path().join("outbox.db");
    std::os::unix::fs::symlink(&first, &link).unwrap();
    let running = outbox_store_sqlite::SqliteStore::open(&link, false).unwrap();
    running.migrate().await.unwrap();
    running.ping().await.expect("the file it opened");
    outbox_store_sqlite::SqliteStore::open(&second, false)
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let moved = dir.path().join("outbox.db.new");
    std::os::unix::fs::symlink(&second, &moved).unwrap();
    std::fs::rename(&moved, &link).unwrap();
    let err = running
        .ping()
        .await
        .expect_err("the link names another file");
    assert!(err.to_string().contains("replaced"), "{err}");
}

/// An application holding SQLite's write lock makes the relay's writes wait (up to its
/// busy timeout, 10 s), and its ping queued behind them on the one connection: `/readyz`
/// said the database did not answer within 3 s while it was readable, only locked. The
/// ping has a connection of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ping_answers_while_the_relays_write_waits_for_the_applications_lock() {
    use outbox_core::store::LeaseHolder;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("outbox.db");
    let store = SqliteStore::open(&path, false).unwrap();
    store.migrate().await.unwrap();
    store.insert(vec![event("k", 0)]).await.unwrap();
    let node = NodeId("n1".into());
    let claimed = store
        .claim(ClaimRequest::new(node.clone(), 10, Duration::from_secs(30)))
        .await
        .unwrap();
    let application = rusqlite::Connection::open(&path).unwrap();
    application.execute_batch("BEGIN IMMEDIATE").unwrap();
    // The relay's ack waits for the application's lock for as long as this test holds it.
    let ack = tokio::spawn({
        let store = store.clone();
        let ids = vec![claimed[0].sequence_id()];
        async move { store.ack(LeaseHolder::unfenced(node), ids).await }
    });
    // Pings for the next 4 s (the lock's hold, a fault's length, not a wait for a state):
    // once the ack holds the connection, a ping on it waited as long as the ack did.
    let until = tokio::time::Instant::now() + Duration::from_secs(4);
    while tokio::time::Instant::now() < until {
        tokio::time::timeout(Duration::from_secs(3), store.ping())
            .await
            .expect("the ping waited behind the relay's own write")
            .expect("the database is readable");
    }
    application.execute_batch("COMMIT").unwrap();
    assert_eq!(ack.await.unwrap().unwrap(), 1);
}

/// A newer relay migrating the file while this one waits for SQLite's write lock (two
/// relays of different builds started together: a rolling upgrade). The version was read
/// before the lock, so this relay recorded its older version over the newer one's and ran
/// on a schema it must refuse. It now reads the version under the lock, and refuses it.
#[tokio::test]
async fn a_newer_schema_migrated_while_waiting_for_the_lock_is_refused_not_lowered() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("outbox.db");
    let newer = rusqlite::Connection::open(&path).unwrap();
    // The version table exists (as after an earlier run's open), empty: this relay's read
    // finds no version, and only the step's write waits for the lock.
    newer
        .execute_batch(
            "PRAGMA journal_mode = WAL;
             CREATE TABLE outbox_versions (component TEXT PRIMARY KEY,
                 version INTEGER NOT NULL, readable_from INTEGER NOT NULL,
                 migrated_at INTEGER NOT NULL DEFAULT 0);",
        )
        .unwrap();
    newer.execute_batch("BEGIN IMMEDIATE").unwrap();
    let store = SqliteStore::open(&path, false).unwrap();
    let migrating = tokio::spawn(async move { store.migrate().await });
    // Time for the migration to read the version and wait for the write lock (its busy
    // timeout is 10 s); nothing tells when it waits. Should it read later, it reads the
    // newer version and passes the same way.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!migrating.is_finished(), "migrate went ahead of the lock");
    newer
        .execute_batch(
            "INSERT INTO outbox_versions (component, version, readable_from)
                 VALUES ('outbox', 2, 2);
             COMMIT;",
        )
        .unwrap();
    let migrated = migrating.await.unwrap();
    let err = migrated.expect_err("a schema only relays of version 2 on may run on");
    assert_eq!(
        err.kind(),
        outbox_core::StoreErrorKind::SchemaVersion,
        "{}",
        err.report()
    );
    let recorded: (i64, i64) = newer
        .query_row(
            "SELECT version, readable_from FROM outbox_versions WHERE component = 'outbox'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(recorded, (2, 2), "the newer relay's version was lowered");
}

/// Every start and operator command on SQLite migrates; on a file at this relay's version
/// that takes no write lock, so an application's long write transaction holds none of them
/// up.
#[tokio::test]
async fn migrating_a_current_file_waits_for_no_writer() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("outbox.db");
    SqliteStore::open(&path, false)
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let writer = rusqlite::Connection::open(&path).unwrap();
    writer.execute_batch("BEGIN IMMEDIATE").unwrap();
    let store = SqliteStore::open(&path, false).unwrap();
    let migrated = tokio::time::timeout(Duration::from_secs(5), store.migrate())
        .await
        .expect("migrate waited for the writer's lock");
    migrated.unwrap();
    writer.execute_batch("COMMIT").unwrap();
}
