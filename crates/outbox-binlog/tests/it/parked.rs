//! The parked table's index of waiting keys against the real MariaDB 10.11: which keys still
//! wait there, byte for byte, by one probe per key that stops at the key's first row (not a
//! read of the whole table per settle, which made an adopted backlog drain in quadratic
//! time), the same answer from the scan a table without the index gets, and the upgrade
//! that adds the index to a table made before it.

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Opts};
use outbox_binlog::parked::{keys_indexed, still_parked};
use outbox_binlog::{parked_ddl, parked_index_problem, upgrade_parked};

const PARKED: &str = "outbox_parked";

/// A fresh database with the parked table as `migrate` makes it, and a connection to it.
async fn database() -> (String, String, Conn) {
    let url = outbox_testkit::fresh_mysql_database().await;
    let database = Opts::from_url(&url).unwrap().db_name().unwrap().to_string();
    let mut conn = Conn::new(Opts::from_url(&url).unwrap()).await.unwrap();
    conn.query_drop(parked_ddl(&database, PARKED))
        .await
        .unwrap();
    (url, database, conn)
}

/// Parks a row of `key` (`None`: the destination `d` is the key) in the state `state`.
async fn park(conn: &mut Conn, key: Option<&str>, destination: &str, state: &str) {
    let (delivered, dead) = match state {
        "waiting" => ("NULL", "NULL"),
        "delivered" => ("NOW(6)", "NULL"),
        "dead" => ("NULL", "NOW(6)"),
        other => panic!("{other}"),
    };
    conn.exec_drop(
        format!(
            "INSERT INTO {PARKED} (destination, partition_key, event_type, payload, delivered_at, dead_at)
             VALUES (?, ?, 'T', JSON_OBJECT(), {delivered}, {dead})"
        ),
        (destination, key),
    )
    .await
    .unwrap();
}

/// The rows this session's statements read so far, by index or by scan.
async fn rows_read(conn: &mut Conn) -> u64 {
    let status: Vec<(String, u64)> = conn
        .query(
            "SHOW SESSION STATUS
              WHERE Variable_name IN ('Handler_read_next', 'Handler_read_rnd_next')",
        )
        .await
        .unwrap();
    status.iter().map(|(_, n)| n).sum()
}

fn strings(keys: &[&str]) -> Vec<String> {
    keys.iter().map(|k| k.to_string()).collect()
}

fn sorted(set: std::collections::HashSet<String>) -> Vec<String> {
    let mut keys: Vec<String> = set.into_iter().collect();
    keys.sort();
    keys
}

/// The keys with an undelivered, un-dead row, compared byte for byte: `a`, `A` and `a `
/// are one value under the table's collation, and three keys here; a key whose
/// hash another's shares (`plumless` and `buckeroo`, one CRC32) is told apart by its bytes;
/// a row without a partition key waits under its destination. The scan of a table without
/// the index gives the same answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_keys_still_parked_are_those_with_waiting_rows_byte_for_byte() {
    let (_url, _database, mut conn) = database().await;
    park(&mut conn, Some("a"), "orders", "waiting").await;
    park(&mut conn, Some("A"), "orders", "delivered").await;
    park(&mut conn, Some("a "), "orders", "dead").await;
    park(&mut conn, Some("A "), "orders", "waiting").await;
    park(&mut conn, Some("b"), "orders", "delivered").await;
    park(&mut conn, Some("b"), "orders", "waiting").await;
    park(&mut conn, Some("b"), "orders", "dead").await;
    park(&mut conn, Some("plumless"), "orders", "waiting").await;
    park(&mut conn, Some("buckeroo"), "orders", "delivered").await;
    park(&mut conn, None, "invoices", "waiting").await;
    park(&mut conn, Some("é"), "orders", "waiting").await;
    park(&mut conn, Some("e"), "orders", "delivered").await;
    let long = "k".repeat(254);
    park(&mut conn, Some(&format!("{long}1")), "orders", "waiting").await;
    let asked = strings(&[
        "a",
        "A",
        "a ",
        "A ",
        "b",
        "plumless",
        "buckeroo",
        "invoices",
        "orders",
        "é",
        "e",
        "É",
        &format!("{long}1"),
        &format!("{long}2"),
        "nothing",
    ]);
    let expected = strings(&[
        "A ",
        "a",
        "b",
        "invoices",
        "plumless",
        "é",
        &format!("{long}1"),
    ]);
    let mut expected_sorted = expected.clone();
    expected_sorted.sort();
    let probed = still_parked(&mut conn, PARKED, true, &asked).await.unwrap();
    assert_eq!(sorted(probed), expected_sorted);
    let scanned = still_parked(&mut conn, PARKED, false, &asked)
        .await
        .unwrap();
    assert_eq!(sorted(scanned), expected_sorted);
    // More keys than one statement probes, each asked once.
    let mut many = asked.clone();
    many.extend((0..150).map(|i| format!("many-{i}")));
    for i in (0..150).step_by(3) {
        park(&mut conn, Some(&format!("many-{i}")), "orders", "waiting").await;
    }
    let mut expected_many = expected_sorted.clone();
    expected_many.extend((0..150).step_by(3).map(|i| format!("many-{i}")));
    expected_many.sort();
    let probed = still_parked(&mut conn, PARKED, true, &many).await.unwrap();
    assert_eq!(sorted(probed), expected_many);
}

/// A key with thousands of waiting rows, and thousands of other rows in the table, costs
/// one index probe: the statement reads no row past the first of each key it asks for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_key_asked_costs_one_index_probe_however_many_rows_wait() {
    let (_url, _database, mut conn) = database().await;
    conn.query_drop(format!(
        "INSERT INTO {PARKED} (destination, partition_key, event_type, payload)
         SELECT 'orders', CONCAT('k', seq % 10), 'T', JSON_OBJECT() FROM seq_1_to_20000"
    ))
    .await
    .unwrap();
    conn.query_drop(format!("ANALYZE TABLE {PARKED}"))
        .await
        .unwrap();
    let asked = strings(&["k1", "k2", "k3", "absent"]);
    let before = rows_read(&mut conn).await;
    let still = still_parked(&mut conn, PARKED, true, &asked).await.unwrap();
    let read = rows_read(&mut conn).await - before;
    assert_eq!(sorted(still), strings(&["k1", "k2", "k3"]));
    // A probe that finds its key reads no row after it (0 here), one that does not, none.
    assert!(read < asked.len() as u64, "the probes read {read} rows");
    let before = rows_read(&mut conn).await;
    still_parked(&mut conn, PARKED, false, &asked)
        .await
        .unwrap();
    let scanned = rows_read(&mut conn).await - before;
    assert!(scanned >= 20_000, "the scan read {scanned} rows");
}

/// A claim of the parked table reads the keys still waiting once, not once per candidate
/// row: MariaDB made `key NOT IN (SELECT key … WHERE available_at > now)` a DEPENDENT
/// SUBQUERY, 5 s a claim over 25,000 parked rows, past the statement's bound, and nothing
/// was delivered. Counted in rows read, not timed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_reads_the_waiting_keys_once_however_many_rows_are_parked() {
    let (_url, _database, mut conn) = database().await;
    conn.query_drop(format!(
        "INSERT INTO {PARKED} (destination, partition_key, event_type, payload)
         SELECT 'orders', CONCAT('k', seq % 50), 'T', JSON_OBJECT() FROM seq_1_to_20000;
         UPDATE {PARKED} SET available_at = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR, attempts = 1
          WHERE sequence_id % 1000 = 0"
    ))
    .await
    .unwrap();
    let sql = outbox_layout::sql::Sql::new(
        outbox_layout::Mapping {
            waiting_rows_block_their_key: true,
            ..outbox_layout::Mapping::native_mysql(None, PARKED, false)
        },
        outbox_layout::Dialect::MySql,
    )
    .unwrap();
    let claim = sql.claim_select(&sql.claimable(), "200", true);
    let before = rows_read(&mut conn).await;
    let claimed: Vec<mysql_async::Row> = conn.query(&claim).await.unwrap();
    let read = rows_read(&mut conn).await - before;
    // 200 rows of the keys that do not wait (k0 and k… of each thousandth row wait).
    assert_eq!(claimed.len(), 200);
    // One read of the table for the waiting keys, one for the claim: tens of thousands,
    // not millions.
    assert!(read < 100_000, "the claim read {read} rows");
}

/// A parked table made before the index (as the native table's columns only) has neither
/// the key hash nor its index: `check` says so, and `upgrade_parked` (run by every
/// `migrate`) adds both, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upgrade_adds_the_index_to_a_parked_table_made_before_it() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let database = Opts::from_url(&url).unwrap().db_name().unwrap().to_string();
    let mut conn = Conn::new(Opts::from_url(&url).unwrap()).await.unwrap();
    let before = outbox_layout::sql::native_mysql_ddl(&outbox_layout::Mapping::native_mysql(
        None, PARKED, false,
    ));
    conn.query_drop(before).await.unwrap();
    park(&mut conn, Some("a"), "orders", "waiting").await;
    assert!(!keys_indexed(&mut conn, PARKED).await.unwrap());
    let problem = parked_index_problem(&url, &database, PARKED)
        .await
        .unwrap()
        .expect("the missing index is a problem");
    assert!(problem.is_degraded(), "{problem:?}");
    assert!(
        problem.fix.contains("migrate --capture binlog"),
        "{problem:?}"
    );

    // Two nodes starting with `--auto-migrate` upgrade at once: the one that finds the
    // column or index added meanwhile failed ("Duplicate column name") and exited.
    let (a, b) = tokio::join!(
        upgrade_parked(&url, &database, PARKED),
        upgrade_parked(&url, &database, PARKED)
    );
    a.unwrap();
    b.unwrap();
    upgrade_parked(&url, &database, PARKED).await.unwrap();
    let index: Vec<(String, u64, String)> = conn
        .exec(
            "SELECT INDEX_NAME, SEQ_IN_INDEX, COLUMN_NAME FROM information_schema.STATISTICS
              WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ? AND INDEX_NAME = ?
              ORDER BY SEQ_IN_INDEX",
            (&database, PARKED, format!("{PARKED}_keys")),
        )
        .await
        .unwrap();
    let columns: Vec<&str> = index.iter().map(|(_, _, c)| c.as_str()).collect();
    assert_eq!(columns, ["key_hash", "delivered_at", "dead_at"]);
    assert!(keys_indexed(&mut conn, PARKED).await.unwrap());
    assert!(keys_indexed(&mut conn, &format!("{database}.{PARKED}"))
        .await
        .unwrap());
    assert_eq!(
        parked_index_problem(&url, &database, PARKED).await.unwrap(),
        None
    );
    // The rows parked before have their hash.
    let still = still_parked(&mut conn, PARKED, true, &strings(&["a", "A"]))
        .await
        .unwrap();
    assert_eq!(sorted(still), ["a"]);
}
