//! Upgrades from the past: every schema in `tests/fixtures/schemas/` (see its README, which
//! says how to add one with each schema change) is loaded into a fresh database on
//! PostgreSQL, MariaDB and SQLite, with rows pending, retrying, leased by a relay that died,
//! and dead. Today's relay refuses it until `migrate` runs; after `migrate`, `run --drain`
//! relays every live row once, in each key's order, and the dead stay dead.

use crate::support;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Output;
use std::time::Duration;

use crate::support::{pg, read_lines, relay, text, RelayProcess};

/// Past schemas, oldest first: directories of `tests/fixtures/schemas/`.
const FIXTURES: &[&str] = &["first-wave"];
/// The past MySQL/MariaDB schemas: those of [`FIXTURES`], then the ones saved for MySQL
/// alone (a directory with `mysql.sql` only).
const MYSQL_FIXTURES: &[&str] = &["first-wave", "mysql-v2"];

fn fixture(name: &str, file: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/schemas")
        .join(name)
        .join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The rows written on the old schema: per key, live events `i` = 0, 1, 2, ... in order;
/// the first of key `a` is retrying (attempts, an error, due again), the first of key `b`
/// is leased by a relay that died (its lease expired), and one event of key `c` is dead.
/// Keys `a`..`e`, 4 live events each: 20 live, 1 dead.
const KEYS: [&str; 5] = ["a", "b", "c", "d", "e"];
const PER_KEY: i64 = 4;

enum State {
    Pending,
    Retrying,
    Leased,
}

fn state_of(key: &str, i: i64) -> State {
    match (key, i) {
        ("a", 0) => State::Retrying,
        ("b", 0) => State::Leased,
        _ => State::Pending,
    }
}

/// `run --drain` to a file sink; the run's output and the events written, as (key, i).
fn drain(dir: &Path, url: &str) -> (Output, Vec<(String, i64)>) {
    let out = dir.join("events.jsonl");
    let sink = format!("file:{}", out.display());
    let run = relay(
        dir,
        &[
            "run",
            "--drain",
            "--database-url",
            url,
            "--sink",
            &sink,
            "--http-addr",
            "",
        ],
    );
    let events = read_lines(&out)
        .iter()
        .map(|l| {
            (
                l["payload"]["k"].as_str().unwrap().to_string(),
                l["payload"]["i"].as_i64().unwrap(),
            )
        })
        .collect();
    (run, events)
}

/// Every live event once, each key's in order.
fn assert_all_in_order(events: &[(String, i64)]) {
    let mut by_key: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for (k, i) in events {
        by_key.entry(k).or_default().push(*i);
    }
    for key in KEYS {
        assert_eq!(
            by_key.get(key).map(Vec::as_slice),
            Some(&(0..PER_KEY).collect::<Vec<_>>()[..]),
            "key {key}'s events, in delivery order: {events:?}"
        );
    }
    assert_eq!(events.len(), KEYS.len() * PER_KEY as usize, "{events:?}");
}

fn assert_refused_older(run: &Output) {
    let err = text(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{err}");
    assert!(
        (err.contains("unversioned schema") || err.contains("schema is version"))
            && err.contains("run `outbox-relay migrate`"),
        "{err}"
    );
}

/// `check` fails on the older schema as the other commands do, with exit 2 (a schema to
/// migrate, not a runtime failure: it exited 1).
fn assert_check_refuses_older(dir: &Path, url: &str) {
    let check = relay(dir, &["check", "--database-url", url]);
    let out = text(&check.stdout);
    assert_eq!(check.status.code(), Some(2), "{out}");
    assert!(
        out.contains("unversioned schema") || out.contains("schema is version"),
        "{out}"
    );
}

/// `migrate`, then `check` reports the version this relay needs.
fn migrate_and_check(dir: &Path, url: &str) {
    let migrate = relay(dir, &["migrate", "--database-url", url]);
    assert!(migrate.status.success(), "{}", text(&migrate.stderr));
    let check = relay(dir, &["check", "--database-url", url]);
    let out = text(&check.stdout);
    assert!(out.contains("ok: outbox schema at version"), "{out}");
}

/// The dead letters `dead list` shows: (last error, attempts).
fn dead_letters(dir: &Path, url: &str) -> Vec<(String, i64)> {
    let list = relay(dir, &["dead", "list", "--json", "--database-url", url]);
    assert!(list.status.success(), "{}", text(&list.stderr));
    text(&list.stdout)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["last_error"].as_str().unwrap().to_string(),
                v["attempts"].as_i64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_schemas_from_the_past_upgrade_with_nothing_lost_or_reordered() {
    for name in FIXTURES {
        let url = outbox_testkit::fresh_pg_database().await;
        let client = pg(&url).await;
        client
            .batch_execute(&fixture(name, "postgres.sql"))
            .await
            .unwrap();
        for i in 0..PER_KEY {
            for key in KEYS {
                let extra = match state_of(key, i) {
                    State::Pending => "",
                    State::Retrying => {
                        ", attempts = 2, last_error = 'broker down', available_at = now() - interval '1 second'"
                    }
                    State::Leased => {
                        ", locked_by = 'gone', locked_until = now() - interval '1 minute'"
                    }
                };
                client
                    .batch_execute(&format!(
                        "INSERT INTO outbox (destination, partition_key, event_type, payload)
                             VALUES ('orders', '{key}', 'Placed', '{{\"k\": \"{key}\", \"i\": {i}}}');
                         UPDATE outbox SET payload = payload{extra}
                             WHERE sequence_id = currval(pg_get_serial_sequence('outbox', 'sequence_id'));"
                    ))
                    .await
                    .unwrap();
            }
        }
        client
            .batch_execute(
                "INSERT INTO outbox_dead_letters (sequence_id, event_id, destination, partition_key,
                     event_type, payload, created_at, attempts, last_error)
                 VALUES (1000000, gen_random_uuid(), 'orders', 'c', 'Placed',
                     '{\"k\": \"c\", \"dead\": true}', now(), 5, 'rejected')",
            )
            .await
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (run, events) = drain(dir.path(), &url);
        assert_refused_older(&run);
        assert_check_refuses_older(dir.path(), &url);
        assert!(events.is_empty(), "{events:?}");
        migrate_and_check(dir.path(), &url);
        let (run, events) = drain(dir.path(), &url);
        assert!(run.status.success(), "{name}: {}", text(&run.stderr));
        assert_all_in_order(&events);
        assert_eq!(
            dead_letters(dir.path(), &url),
            [("rejected".to_string(), 5)]
        );
        // The obsolete blocking index is gone, the new ones are there and valid.
        let row = client
            .query_one(
                "SELECT to_regclass('outbox_blocking_idx') IS NULL,
                        (SELECT count(*) FROM pg_index WHERE indrelid = 'outbox'::regclass AND indisvalid)",
                &[],
            )
            .await
            .unwrap();
        assert!(
            row.get::<_, bool>(0),
            "{name}: the old blocking index is dropped"
        );
        assert_eq!(
            row.get::<_, i64>(1),
            5,
            "{name}: pkey, event_id, pending, key blockers, scheduled"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_schemas_from_the_past_upgrade_with_nothing_lost_or_reordered() {
    use mysql_async::prelude::Queryable;
    for name in MYSQL_FIXTURES {
        let url = outbox_testkit::fresh_mysql_database().await;
        let mut conn = mysql_async::Conn::from_url(url.as_str()).await.unwrap();
        conn.query_drop(fixture(name, "mysql.sql")).await.unwrap();
        for i in 0..PER_KEY {
            for key in KEYS {
                let extra = match state_of(key, i) {
                    State::Pending => "",
                    State::Retrying => {
                        ", attempts = 2, last_error = 'broker down', available_at = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND"
                    }
                    State::Leased => {
                        ", locked_by = 'gone', locked_until = UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE"
                    }
                };
                conn.query_drop(format!(
                    "INSERT INTO outbox (destination, partition_key, event_type, payload)
                         VALUES ('orders', '{key}', 'Placed', '{{\"k\": \"{key}\", \"i\": {i}}}')"
                ))
                .await
                .unwrap();
                conn.query_drop(format!(
                    "UPDATE outbox SET payload = payload{extra} WHERE sequence_id = LAST_INSERT_ID()"
                ))
                .await
                .unwrap();
            }
        }
        // The native MySQL table marks its dead rows in place.
        conn.query_drop(
            "INSERT INTO outbox (destination, partition_key, event_type, payload, attempts,
                 last_error, dead_at)
             VALUES ('orders', 'c', 'Placed', '{\"k\": \"c\", \"dead\": true}', 5, 'rejected',
                 UTC_TIMESTAMP(6))",
        )
        .await
        .unwrap();
        conn.disconnect().await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (run, events) = drain(dir.path(), &url);
        assert_refused_older(&run);
        assert_check_refuses_older(dir.path(), &url);
        assert!(events.is_empty(), "{events:?}");
        migrate_and_check(dir.path(), &url);
        // Step 3: the pending index carries the claim's other conditions, so a claim
        // passes rows scheduled for later in the index alone.
        let mut conn = mysql_async::Conn::from_url(url.as_str()).await.unwrap();
        let columns: Vec<String> = conn
            .query(
                "SELECT COLUMN_NAME FROM information_schema.STATISTICS
                  WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'outbox'
                    AND INDEX_NAME = 'outbox_pending' ORDER BY SEQ_IN_INDEX",
            )
            .await
            .unwrap();
        conn.disconnect().await.unwrap();
        assert_eq!(
            columns.join(", "),
            outbox_layout::sql::MYSQL_PENDING_INDEX_COLUMNS,
            "{name}"
        );
        let (run, events) = drain(dir.path(), &url);
        assert!(run.status.success(), "{name}: {}", text(&run.stderr));
        assert_all_in_order(&events);
        assert_eq!(
            dead_letters(dir.path(), &url),
            [("rejected".to_string(), 5)]
        );
    }
}

/// Rows a session east of UTC wrote before schema step 2 took its local time as their
/// `available_at`: two hours ahead at +02:00. Rows written after the step take UTC, so a
/// key's next event went out at once and the earlier one two hours later (a drain exited 0
/// without it). The step brings such rows, which took both defaults, back to now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_rows_written_east_of_utc_before_the_upgrade_keep_their_place() {
    use mysql_async::prelude::Queryable;
    let url = outbox_testkit::fresh_mysql_database().await;
    let mut conn = mysql_async::Conn::from_url(url.as_str()).await.unwrap();
    conn.query_drop(fixture(FIXTURES[FIXTURES.len() - 1], "mysql.sql"))
        .await
        .unwrap();
    let insert = |i: i64| {
        format!(
            "INSERT INTO outbox (destination, partition_key, event_type, payload)
                 VALUES ('orders', 'a', 'Placed', '{{\"k\": \"a\", \"i\": {i}}}')"
        )
    };
    conn.query_drop("SET time_zone = '+02:00'").await.unwrap();
    conn.query_drop(insert(0)).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    migrate_and_check(dir.path(), &url);
    conn.query_drop(insert(1)).await.unwrap();
    conn.disconnect().await.unwrap();
    let (run, events) = drain(dir.path(), &url);
    assert!(run.status.success(), "{}", text(&run.stderr));
    assert_eq!(events, [("a".to_string(), 0), ("a".to_string(), 1)]);
}

/// Step 2's ALTERs wait for the table's metadata lock, behind any open transaction that
/// read the table (a `mysqldump --single-transaction`), and the application's inserts queue
/// behind them. MariaDB's default wait is a day: the step now gives up after 5 s, saying to
/// run `migrate` again, and does once the transaction is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_step_2_gives_way_to_a_transaction_holding_the_table() {
    use mysql_async::prelude::Queryable;
    let url = outbox_testkit::fresh_mysql_database().await;
    let mut reader = mysql_async::Conn::from_url(url.as_str()).await.unwrap();
    reader
        .query_drop(fixture(FIXTURES[FIXTURES.len() - 1], "mysql.sql"))
        .await
        .unwrap();
    reader.query_drop("START TRANSACTION").await.unwrap();
    let _: Vec<u64> = reader
        .query("SELECT sequence_id FROM outbox LIMIT 1")
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut migrate = std::process::Command::new(support::BIN)
        .args(["migrate", "--database-url", &url])
        .current_dir(dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = migrate.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > Duration::from_secs(60) {
            migrate.kill().unwrap();
            break None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let output = migrate.wait_with_output().unwrap();
    let status = status.expect("migrate still waits for the metadata lock after 60 s");
    assert!(!status.success());
    let err = text(&output.stderr);
    assert!(
        err.contains("step 2") && err.contains("run `outbox-relay migrate` again once it ends"),
        "{err}"
    );
    reader.query_drop("COMMIT").await.unwrap();
    reader.disconnect().await.unwrap();
    migrate_and_check(dir.path(), &url);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_schemas_from_the_past_upgrade_with_nothing_lost_or_reordered() {
    for name in FIXTURES {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("outbox.db");
        let url = format!("sqlite:{}", db.display());
        {
            let conn = rusqlite::Connection::open(&db).unwrap();
            conn.execute_batch(&fixture(name, "sqlite.sql")).unwrap();
            let now = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)";
            for i in 0..PER_KEY {
                for key in KEYS {
                    let extra = match state_of(key, i) {
                        State::Pending => String::new(),
                        State::Retrying => format!(
                            ", attempts = 2, last_error = 'broker down', available_at = {now} - 1000"
                        ),
                        State::Leased => {
                            format!(", locked_by = 'gone', locked_until = {now} - 60000")
                        }
                    };
                    conn.execute_batch(&format!(
                        "INSERT INTO outbox (destination, partition_key, event_type, payload)
                             VALUES ('orders', '{key}', 'Placed', '{{\"k\": \"{key}\", \"i\": {i}}}');
                         UPDATE outbox SET payload = payload{extra} WHERE sequence_id = last_insert_rowid();"
                    ))
                    .unwrap();
                }
            }
            conn.execute_batch(&format!(
                "INSERT INTO outbox_dead_letters (sequence_id, event_id, destination, partition_key,
                     event_type, payload, created_at, attempts, last_error, dead_at)
                 VALUES (1000000, 'b7d4c1c2-3f4e-4a5b-8c6d-7e8f9a0b1c2d', 'orders', 'c', 'Placed',
                     '{{\"k\": \"c\", \"dead\": true}}', {now}, 5, 'rejected', {now})"
            ))
            .unwrap();
        }
        // SQLite is the embedded default: `run` migrates it itself, so the check comes first.
        let check = relay(dir.path(), &["check", "--database-url", &url]);
        let out = text(&check.stdout);
        assert!(
            out.contains("problem:") && out.contains("unversioned schema"),
            "{name}: {out}"
        );
        migrate_and_check(dir.path(), &url);
        let (run, events) = drain(dir.path(), &url);
        assert!(run.status.success(), "{name}: {}", text(&run.stderr));
        assert_all_in_order(&events);
        assert_eq!(
            dead_letters(dir.path(), &url),
            [("rejected".to_string(), 5)]
        );
    }
}

/// A schema a newer relay migrated, with a step this relay's statements cannot run on, is
/// refused by `run` (exit 2, naming the upgrade) and reported by `check`; one whose later
/// steps leave this relay working is run on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_schema_is_refused_unless_this_relay_can_run_on_it() {
    let url = support::migrated_pg_database().await;
    let client = pg(&url).await;
    let latest: i32 = client
        .query_one(
            "SELECT version FROM outbox_versions WHERE component = 'outbox'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let dir = tempfile::tempdir().unwrap();
    client
        .execute(
            "UPDATE outbox_versions SET version = $1 + 1, readable_from = $1 + 1",
            &[&latest],
        )
        .await
        .unwrap();
    let (run, _) = drain(dir.path(), &url);
    let err = text(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!(
            "version {}, newer than this relay knows",
            latest + 1
        )) && err.contains("upgrade this relay"),
        "{err}"
    );
    let check = relay(dir.path(), &["check", "--database-url", &url]);
    assert!(!check.status.success());
    assert!(text(&check.stdout).contains("upgrade this relay"));
    // `migrate` of this older relay does not put its own objects back over the newer ones.
    let migrate = relay(dir.path(), &["migrate", "--database-url", &url]);
    assert_eq!(migrate.status.code(), Some(2), "{}", text(&migrate.stderr));

    client
        .execute("UPDATE outbox_versions SET readable_from = 1", &[])
        .await
        .unwrap();
    client
        .batch_execute(
            "INSERT INTO outbox (destination, partition_key, event_type, payload)
             VALUES ('orders', 'a', 'Placed', '{\"k\": \"a\", \"i\": 0}')",
        )
        .await
        .unwrap();
    let (run, events) = drain(dir.path(), &url);
    assert!(run.status.success(), "{}", text(&run.stderr));
    assert_eq!(events, [("a".to_string(), 0)]);
}

/// The index steps are online: while `migrate` builds an index (waiting, as `CREATE INDEX
/// CONCURRENTLY` does, for a transaction that wrote to the outbox before it began),
/// applications go on inserting. A plain `CREATE INDEX` would queue for its lock behind that
/// transaction, and every insert would queue behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_builds_indexes_while_applications_insert() {
    let url = outbox_testkit::fresh_pg_database().await;
    let admin = pg(&url).await;
    admin
        .batch_execute(&fixture("first-wave", "postgres.sql"))
        .await
        .unwrap();
    let open = pg(&url).await;
    open.batch_execute(
        "BEGIN; INSERT INTO outbox (destination, partition_key, event_type, payload)
                VALUES ('orders', 'a', 'Placed', '{\"k\": \"a\", \"i\": 0}')",
    )
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut migrate = RelayProcess::spawn(
        dir.path(),
        "migrate",
        &["migrate", "--database-url", &url],
        &[],
    );
    // The index build waits for the open transaction.
    outbox_testkit::eventually(
        "migrate to wait in its index build",
        Duration::from_secs(60),
        || {
            let admin = &admin;
            async move {
                let row = admin
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity
                     WHERE datname = current_database() AND query ILIKE 'CREATE INDEX%'
                       AND wait_event_type = 'Lock'",
                        &[],
                    )
                    .await
                    .unwrap();
                (row.get::<_, i64>(0) > 0).then_some(())
            }
        },
    )
    .await;
    // Meanwhile an application inserts, without waiting for the build.
    let writer = pg(&url).await;
    writer
        .batch_execute(
            "SET statement_timeout = '30s';
             INSERT INTO outbox (destination, partition_key, event_type, payload)
                VALUES ('orders', 'a', 'Placed', '{\"k\": \"a\", \"i\": 1}')",
        )
        .await
        .expect("an insert during the index build goes through");
    open.batch_execute("COMMIT").await.unwrap();
    let status = migrate.wait_exit_within(Duration::from_secs(120)).await;
    assert!(status.success(), "{}", migrate.logs());
    let (run, events) = drain(dir.path(), &url);
    assert!(run.status.success(), "{}", text(&run.stderr));
    assert_eq!(events, [("a".to_string(), 0), ("a".to_string(), 1)]);
}

/// A migration interrupted in an index build (here: a build that failed, which leaves its
/// index INVALID as a killed one does) is finished by running `migrate` again: the steps
/// recorded before it are not run again, the invalid index is built again, and the version
/// moves on only then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_migration_is_finished_by_migrate_again() {
    let url = outbox_testkit::fresh_pg_database().await;
    let client = pg(&url).await;
    client
        .batch_execute(&fixture("first-wave", "postgres.sql"))
        .await
        .unwrap();
    client
        .batch_execute(
            "INSERT INTO outbox (destination, event_type, payload)
                 VALUES ('orders', 'Placed', '{\"k\": \"orders\", \"i\": 0}'),
                        ('orders', 'Placed', '{\"k\": \"orders\", \"i\": 1}');
             CREATE TABLE outbox_versions (component text PRIMARY KEY, version integer NOT NULL,
                 readable_from integer NOT NULL, migrated_at timestamptz NOT NULL DEFAULT now());
             INSERT INTO outbox_versions (component, version, readable_from) VALUES ('outbox', 2, 1);",
        )
        .await
        .unwrap();
    // The build of step 3's index fails half-way (the duplicates), leaving it INVALID.
    client
        .batch_execute(
            "CREATE UNIQUE INDEX CONCURRENTLY outbox_key_blockers_idx ON outbox (destination)",
        )
        .await
        .unwrap_err();
    let dir = tempfile::tempdir().unwrap();
    let check = relay(dir.path(), &["check", "--database-url", &url]);
    assert!(
        text(&check.stdout).contains("version 2, and this relay needs version"),
        "{}",
        text(&check.stdout)
    );
    migrate_and_check(dir.path(), &url);
    let row = client
        .query_one(
            "SELECT i.indisvalid, pg_get_indexdef(i.indexrelid)
             FROM pg_index i WHERE i.indexrelid = 'outbox_key_blockers_idx'::regclass",
            &[],
        )
        .await
        .unwrap();
    assert!(row.get::<_, bool>(0), "the index is valid");
    let definition: String = row.get(1);
    assert!(definition.contains("hashtextextended"), "{definition}");
    let (run, events) = drain(dir.path(), &url);
    assert!(run.status.success(), "{}", text(&run.stderr));
    assert_eq!(
        events,
        [("orders".to_string(), 0), ("orders".to_string(), 1)]
    );
}

/// Rolling upgrades of an ordered PostgreSQL cluster. The older node is simulated by its row
/// in the nodes table, as a node of that protocol would write it (one build of the relay
/// here: a second, older build is too costly to compile in this suite). A node one protocol
/// behind (a relay from before protocol versions, which leaves the column NULL) shares the
/// partitions; a node older than `OLDEST_PEER_PROTOCOL` makes this one wait, saying why in
/// its log and on `/readyz`, until it is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_node_shares_with_an_adjacent_protocol_and_waits_out_an_older_one() {
    use outbox_core::migration::{CLUSTER_PROTOCOL, OLDEST_PEER_PROTOCOL};
    let url = support::migrated_pg_database().await;
    let client = pg(&url).await;
    let dir = tempfile::tempdir().unwrap();
    let sink = format!("file:{}", dir.path().join("events.jsonl").display());
    let args = [
        "run",
        "--http-addr",
        "127.0.0.1:0",
        "--log-format",
        "json",
        "--sink",
        &sink,
        "--node-id",
        "new-node",
    ];

    // Adjacent: a relay from before protocol versions. They share the 64 partitions.
    client
        .batch_execute(
            "INSERT INTO outbox_nodes (id, expiry) VALUES ('adjacent-node', (now() AT TIME ZONE 'UTC') + interval '1 hour')",
        )
        .await
        .unwrap();
    let mut relay = RelayProcess::spawn(dir.path(), "adjacent", &args, &[("DATABASE_URL", &url)]);
    let addr = support::http_addr(&relay).await;
    support::readyz(&relay, &addr, 200, "", Duration::from_secs(60)).await;
    let owned = outbox_testkit::eventually_explained(
        "the new node to take its share of the partitions",
        Duration::from_secs(60),
        || relay.logs(),
        || {
            let addr = addr.clone();
            async move {
                let (_, text) = support::http_get(&addr, "/metrics").await?;
                support::metric_value(&text, "outbox_owned_partitions").filter(|v| *v == 32.0)
            }
        },
    )
    .await;
    assert_eq!(owned, 32.0);
    let row = client
        .query_one(
            "SELECT protocol FROM outbox_nodes WHERE id = 'new-node'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, Option<i32>>(0), Some(CLUSTER_PROTOCOL as i32));
    assert!(relay.terminate().await.success(), "{}", relay.logs());

    // Older than this build shares with: the new node waits until it is gone.
    let behind = OLDEST_PEER_PROTOCOL as i32 - 1;
    client
        .execute(
            "UPDATE outbox_nodes SET protocol = $1 WHERE id = 'adjacent-node'",
            &[&behind],
        )
        .await
        .unwrap();
    client
        .batch_execute(
            "INSERT INTO outbox (destination, partition_key, event_type, payload)
             SELECT 'orders', 'k' || (i % 5), 'Placed', jsonb_build_object('k', 'k' || (i % 5), 'i', i)
               FROM generate_series(0, 19) i",
        )
        .await
        .unwrap();
    let mut relay = RelayProcess::spawn(dir.path(), "waiting", &args, &[("DATABASE_URL", &url)]);
    let addr = support::http_addr(&relay).await;
    let body = support::readyz(
        &relay,
        &addr,
        503,
        "adjacent-node (protocol",
        Duration::from_secs(60),
    )
    .await;
    assert!(body.contains("older cluster protocol"), "{body}");
    relay
        .wait_for_log(
            "the reason in the log",
            Duration::from_secs(30),
            "waiting for nodes of an older cluster protocol to leave",
        )
        .await;
    // The older node is gone (stopped, or upgraded under another id): the new node starts.
    client
        .batch_execute("DELETE FROM outbox_nodes WHERE id = 'adjacent-node'")
        .await
        .unwrap();
    support::readyz(&relay, &addr, 200, "", Duration::from_secs(60)).await;
    support::wait_for_lines(
        "every event",
        &dir.path().join("events.jsonl"),
        Duration::from_secs(60),
        |n| n >= 20,
    )
    .await;
    assert!(relay.terminate().await.success(), "{}", relay.logs());
    let mut by_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for line in read_lines(&dir.path().join("events.jsonl")) {
        by_key
            .entry(line["payload"]["k"].as_str().unwrap().to_string())
            .or_default()
            .push(line["payload"]["i"].as_i64().unwrap());
    }
    for (key, seen) in &by_key {
        let mut sorted = seen.clone();
        sorted.sort();
        assert_eq!(seen, &sorted, "key {key} in order");
    }
    assert_eq!(by_key.values().map(Vec::len).sum::<usize>(), 20);
}

/// WAL capture's objects (publication, parked and adopted tables, emit function) are the
/// `wal` component of the version table: recorded by `migrate --capture wal`, judged by
/// `check` and `run` like the outbox's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_capture_objects_are_a_versioned_component() {
    let url = outbox_testkit::fresh_pg_database().await;
    let client = pg(&url).await;
    let dir = tempfile::tempdir().unwrap();
    let wal = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend_from_slice(&["--capture", "wal", "--database-url", &url]);
        relay(dir.path(), &all)
    };
    let migrate = wal(&["migrate"]);
    assert!(migrate.status.success(), "{}", text(&migrate.stderr));
    let version: i32 = client
        .query_one(
            "SELECT version FROM outbox_versions WHERE component = 'wal'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(version, 4);
    let check = text(&wal(&["check"]).stdout);
    assert!(check.contains("ok: wal schema at version 4"), "{check}");
    // At version 1: the adopted table without the publication's version, the parked
    // table without its index of waiting keys, no confirm marks.
    client
        .batch_execute(
            "ALTER TABLE outbox_adopted DROP COLUMN publication_version;
             DROP INDEX outbox_parked_keys_idx;
             DROP TABLE outbox_confirm_marks;
             UPDATE outbox_versions SET version = 1 WHERE component = 'wal'",
        )
        .await
        .unwrap();
    let checked = wal(&["check"]);
    let said = format!("{}{}", text(&checked.stdout), text(&checked.stderr));
    assert!(!checked.status.success(), "{said}");
    assert!(
        said.contains("wal schema is version 1") && said.contains("migrate"),
        "{said}"
    );
    let printed = text(&wal(&["migrate", "--print"]).stdout);
    assert!(printed.contains("-- wal schema step 2:"), "{printed}");
    assert!(printed.contains("-- wal schema step 3:"), "{printed}");
    assert!(printed.contains("-- wal schema step 4:"), "{printed}");
    assert!(!printed.contains("-- wal schema step 1:"), "{printed}");
    assert!(wal(&["migrate"]).status.success());
    let check = text(&wal(&["check"]).stdout);
    assert!(check.contains("ok: wal schema at version 4"), "{check}");
    client
        .execute("SELECT publication_version FROM outbox_adopted", &[])
        .await
        .unwrap();
    client
        .execute("SELECT slot, up_to FROM outbox_confirm_marks", &[])
        .await
        .unwrap();
    let indexed: bool = client
        .query_one(
            "SELECT EXISTS (SELECT FROM pg_indexes WHERE indexname = 'outbox_parked_keys_idx')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        indexed,
        "step 3 builds the parked table's index of waiting keys"
    );
    // The parked table without a recorded version: a capture set up before versions.
    client
        .batch_execute("DELETE FROM outbox_versions WHERE component = 'wal'")
        .await
        .unwrap();
    let check = text(&wal(&["check"]).stdout);
    assert!(
        check.contains("the wal schema is an unversioned schema"),
        "{check}"
    );
    let printed = text(&wal(&["migrate", "--print"]).stdout);
    assert!(printed.contains("-- wal schema step 1:"), "{printed}");
    assert!(!printed.contains("-- outbox schema step"), "{printed}");
    assert!(wal(&["migrate"]).status.success());
    let check = text(&wal(&["check"]).stdout);
    assert!(check.contains("ok: wal schema at version 4"), "{check}");
}
