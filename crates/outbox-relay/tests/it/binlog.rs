//! The relay binary with `--capture binlog` (issue 35) against the real MariaDB 10.11:
//! `migrate` and its `--print`, `check`, rows adopted from before the first start, commit
//! order per key with rolled-back transactions left out, kill -9 and SIGTERM mid-stream,
//! `run --drain`, a standby that takes over from a SIGSTOP'd reader, the database's
//! connections cut and a broker outage mid-stream, a purged position, and the settings it
//! refuses.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mysql_async::prelude::Queryable;
use outbox_testkit::{eventually, eventually_explained};

use crate::support::{
    await_dead_again_or_published, http_addr, http_get, metric_value, nats_behind_a_proxy,
    read_lines, relay, relay_ok, text, wait_for_lines, RelayProcess, RETRY_AN_OUTAGE,
};

/// The log line of a relay that reads the binary log.
const READING: &str = "reading the binary log";

/// A fresh database migrated with `--capture binlog`, and a directory for the relays' logs
/// and sink files.
struct BinlogDb {
    url: String,
    dir: tempfile::TempDir,
    pool: mysql_async::Pool,
}

impl BinlogDb {
    async fn new() -> BinlogDb {
        Self::at(&outbox_testkit::fresh_mysql_database().await, &[]).await
    }

    /// The database `url`, migrated with `--capture binlog` and `extra` flags.
    async fn at(url: &str, extra: &[&str]) -> BinlogDb {
        let dir = tempfile::Builder::new()
            .prefix("outbox-binlog-")
            .tempdir()
            .unwrap();
        let mut args = vec!["migrate", "--capture", "binlog", "--database-url", url];
        args.extend(extra);
        let migrated = relay(dir.path(), &args);
        assert!(migrated.status.success(), "{}", text(&migrated.stderr));
        let pool = mysql_async::Pool::new(mysql_async::Opts::from_url(url).unwrap());
        BinlogDb {
            url: url.to_string(),
            dir,
            pool,
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The count a `SELECT count(*) …` statement gives.
    async fn count_where(&self, statement: &str) -> i64 {
        let mut conn = self.pool.get_conn().await.unwrap();
        conn.query_first(statement).await.unwrap().unwrap()
    }

    async fn count(&self, table: &str) -> i64 {
        let mut conn = self.pool.get_conn().await.unwrap();
        conn.query_first(format!("SELECT count(*) FROM {table}"))
            .await
            .unwrap()
            .unwrap()
    }

    /// Closes the server's current binary log and starts the next (`FLUSH BINARY LOGS`).
    async fn rotate_log(&self) {
        let mut conn = self.pool.get_conn().await.unwrap();
        conn.query_drop("FLUSH BINARY LOGS").await.unwrap();
    }

    /// One transaction inserting `n` events of each key in `keys`, each carrying its
    /// per-key number from `from` on (`"n"`), and `commit` or not.
    async fn write(&self, keys: &[&str], from: i64, n: i64, commit: bool) {
        let mut conn = self.pool.get_conn().await.unwrap();
        let mut tx = conn
            .start_transaction(mysql_async::TxOpts::default())
            .await
            .unwrap();
        for i in from..from + n {
            for key in keys {
                tx.exec_drop(
                    "INSERT INTO outbox (destination, partition_key, event_type, payload)
                     VALUES ('orders', ?, 'T', JSON_OBJECT('n', ?))",
                    (key, i),
                )
                .await
                .unwrap();
            }
        }
        if commit {
            tx.commit().await.unwrap();
        } else {
            tx.rollback().await.unwrap();
        }
    }

    /// `run --capture binlog` to the file `out`, as node `name`, with `extra` flags.
    fn spawn(&self, name: &str, out: &str, extra: &[&str]) -> RelayProcess {
        self.spawn_at(&self.url, name, out, extra)
    }

    /// [`BinlogDb::spawn`] reading the database at `url` (another server's).
    fn spawn_at(&self, url: &str, name: &str, out: &str, extra: &[&str]) -> RelayProcess {
        let sink = format!("file:{}", self.path(out).display());
        let mut args = vec![
            "run",
            "--capture",
            "binlog",
            "--database-url",
            url,
            "--sink",
            &sink,
            "--node-id",
            name,
            "--shutdown-timeout",
            "5s",
        ];
        // No HTTP endpoints unless `extra` asks for them.
        if !extra.contains(&"--http-addr") {
            args.extend(["--http-addr", ""]);
        }
        args.extend(extra);
        RelayProcess::spawn(
            self.dir.path(),
            name,
            &args,
            &[("OUTBOX_RELAY_LOG_LEVEL", "info,outbox_binlog=debug")],
        )
    }

    /// `relay-1` reading and delivering events 0-9 of `a` to `out-1.jsonl`, and `relay-2`
    /// waiting as its standby.
    async fn active_delivering_and_a_standby(&self) -> (RelayProcess, RelayProcess) {
        let active = self.reading("relay-1", "out-1.jsonl").await;
        let standby = self.spawn("relay-2", "out-2.jsonl", &[]);
        standby
            .wait_for_log(
                "the second relay waiting",
                Duration::from_secs(30),
                "standby",
            )
            .await;
        self.write(&["a"], 0, 10, true).await;
        wait_for_lines(
            "the active relay delivering",
            &self.path("out-1.jsonl"),
            Duration::from_secs(30),
            |n| n >= 10,
        )
        .await;
        (active, standby)
    }

    /// Event 10 of `a`, not due for a few seconds: the relay parks it.
    async fn write_a_not_yet_due(&self) {
        let mut conn = self.pool.get_conn().await.unwrap();
        conn.query_drop(
            "INSERT INTO outbox (destination, partition_key, event_type, payload, available_at)
             VALUES ('orders', 'a', 'T', JSON_OBJECT('n', 10), NOW(6) + INTERVAL 5 SECOND)",
        )
        .await
        .unwrap();
    }

    /// With `active` paused: events 11-19 of `a` written, and the standby taking over and
    /// delivering the rest of `a`, every event first delivered in order.
    async fn standby_delivers_the_rest(&self, mut active: RelayProcess, mut standby: RelayProcess) {
        self.write(&["a"], 11, 9, true).await;
        standby
            .wait_for_log("the standby reading", Duration::from_secs(60), READING)
            .await;
        let files = [self.path("out-1.jsonl"), self.path("out-2.jsonl")];
        eventually_explained(
            "the standby delivered the rest",
            Duration::from_secs(30),
            || standby.logs(),
            || async {
                (first_deliveries(&files).0.get("a").map_or(0, Vec::len) >= 20).then_some(())
            },
        )
        .await;
        assert_every_key_in_order(&first_deliveries(&files).0, &["a"], 20);
        active.signal("-CONT");
        active.kill9();
        assert!(standby.terminate().await.success(), "{}", standby.logs());
    }

    async fn reading(&self, name: &str, out: &str) -> RelayProcess {
        self.reading_with(name, out, &[]).await
    }

    /// [`BinlogDb::reading`] with `extra` flags.
    async fn reading_with(&self, name: &str, out: &str, extra: &[&str]) -> RelayProcess {
        let relay = self.spawn(name, out, extra);
        relay
            .wait_for_log("the relay reading", Duration::from_secs(60), READING)
            .await;
        relay
    }
}

/// Each key's numbers in the order of their first delivery, across `files`, and how many
/// lines there were.
fn first_deliveries(files: &[PathBuf]) -> (HashMap<String, Vec<i64>>, usize) {
    let mut seen = std::collections::HashSet::new();
    let mut by_key: HashMap<String, Vec<i64>> = HashMap::new();
    let mut lines = 0;
    for file in files {
        for line in read_lines(file) {
            lines += 1;
            let id = line["event_id"].as_str().unwrap().to_string();
            if !seen.insert(id) {
                continue;
            }
            let key = line["partition_key"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let n = line["payload"]["n"].as_i64().unwrap();
            by_key.entry(key).or_default().push(n);
        }
    }
    (by_key, lines)
}

fn assert_every_key_in_order(by_key: &HashMap<String, Vec<i64>>, keys: &[&str], per_key: i64) {
    for key in keys {
        let got = by_key.get(*key).cloned().unwrap_or_default();
        let want: Vec<i64> = (0..per_key).collect();
        assert_eq!(
            got, want,
            "key {key}: first deliveries in commit order, none lost"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_print_states_the_servers_needs_and_the_replication_grants() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let dir = tempfile::tempdir().unwrap();
    let printed = relay(
        dir.path(),
        &[
            "migrate",
            "--capture",
            "binlog",
            "--print",
            "--database-url",
            &url,
        ],
    );
    assert!(printed.status.success(), "{}", text(&printed.stderr));
    let out = text(&printed.stdout);
    for needed in [
        "binlog_format = ROW",
        "binlog_row_image = FULL",
        "ENGINE=BLACKHOLE",
        "GRANT REPLICATION SLAVE, REPLICATION CLIENT ON *.*",
        "outbox_parked` (",
        "outbox_binlog",
    ] {
        assert!(out.contains(needed), "{needed} missing from:\n{out}");
    }
}

/// The columns of the parked table's index of waiting keys, in order (none: no index).
async fn keys_index(db: &BinlogDb) -> Vec<String> {
    let mut conn = db.pool.get_conn().await.unwrap();
    conn.query(
        "SELECT COLUMN_NAME FROM information_schema.STATISTICS
          WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'outbox_parked'
            AND INDEX_NAME = 'outbox_parked_keys'
          ORDER BY SEQ_IN_INDEX",
    )
    .await
    .unwrap()
}

/// `migrate` makes the parked table with its index of waiting keys (which keys still wait
/// is one probe per key, not a read of the whole table per settle), and adds it to a
/// parked table made before it; until then `check` says what it costs and to migrate, and
/// `run` still relays, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_gives_the_parked_table_its_index_of_waiting_keys() {
    let db = BinlogDb::new().await;
    assert_eq!(
        keys_index(&db).await,
        ["key_hash", "delivered_at", "dead_at"]
    );
    let check = ["check", "--capture", "binlog", "--database-url", &db.url];
    let checked = relay(db.dir.path(), &check);
    assert!(
        !text(&checked.stdout).contains("waiting keys"),
        "{}",
        text(&checked.stdout)
    );

    // As an earlier version made it.
    let mut conn = db.pool.get_conn().await.unwrap();
    conn.query_drop(
        "ALTER TABLE outbox_parked DROP INDEX outbox_parked_keys, DROP COLUMN key_hash",
    )
    .await
    .unwrap();
    assert!(keys_index(&db).await.is_empty());
    let checked = relay(db.dir.path(), &check);
    let said = text(&checked.stdout);
    assert!(
        said.contains("outbox_parked_keys") && said.contains("migrate --capture binlog"),
        "{said}"
    );
    db.write(&["a", "A", "a "], 0, 20, true).await;
    let mut drain = db.spawn("relay-1", "out.jsonl", &["--drain"]);
    let status = drain.wait_exit_within(Duration::from_secs(60)).await;
    assert!(status.success(), "{}", drain.logs());
    let (by_key, _) = first_deliveries(&[db.path("out.jsonl")]);
    assert_every_key_in_order(&by_key, &["a", "A", "a "], 20);

    // Twice: the second `migrate` finds the index and leaves it as it is.
    for _ in 0..2 {
        relay_ok(
            db.dir.path(),
            &["migrate", "--capture", "binlog", "--database-url", &db.url],
        );
        assert_eq!(
            keys_index(&db).await,
            ["key_hash", "delivered_at", "dead_at"]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_passes_on_a_server_ready_for_binlog_capture() {
    let db = BinlogDb::new().await;
    let checked = relay_ok(
        db.dir.path(),
        &["check", "--capture", "binlog", "--database-url", &db.url],
    );
    // The test server logs no column names: advised, not refused.
    assert!(
        checked.contains("binlog_row_metadata = 'FULL'"),
        "{checked}"
    );
    // It writes InnoDB's log once a second (innodb_flush_log_at_trx_commit = 0), for
    // speed: the advice says a crash of its process is enough to lose what was delivered,
    // where it spoke of the host's alone.
    assert!(
        checked
            .contains("innodb_flush_log_at_trx_commit is 0: a crash of the server's process alone"),
        "{checked}"
    );
}

/// A server keeps one binary log reader per server id. `check` names another outbox's
/// relay reading under the id this one is given, and passes beside this outbox's own relay
/// (registered under its outbox's name). Unchecked, the two relays ended each other's
/// session every second, and a replica's replication flapped with a relay's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_another_reader_registered_under_the_relays_server_id() {
    let (one, two) = (BinlogDb::new().await, BinlogDb::new().await);
    let id = (uuid::Uuid::new_v4().as_u128() % 1_000_000 + 1_000).to_string();
    let mut reading = one
        .reading_with("relay-1", "out.jsonl", &["--binlog-server-id", &id])
        .await;
    let check = |db: &BinlogDb| {
        let checked = relay(
            db.dir.path(),
            &[
                "check",
                "--capture",
                "binlog",
                "--binlog-server-id",
                &id,
                "--database-url",
                &db.url,
            ],
        );
        let said = format!("{}{}", text(&checked.stdout), text(&checked.stderr));
        (checked.status.success(), said)
    };
    let (passed, said) = check(&two);
    assert!(!passed, "{said}");
    assert!(
        said.contains(&format!(
            "reads this server's binary log as server id {id} too"
        )) && said.contains(".outbox)")
            && said.contains("binlog_server_id"),
        "{said}"
    );
    let (passed, said) = check(&one);
    assert!(passed, "its own relay is no other reader: {said}");
    assert!(reading.terminate().await.success(), "{}", reading.logs());
}

/// Rows written before the first start are adopted; then kill -9 and SIGTERM mid-stream,
/// with rolled-back transactions and binary log rotations (`FLUSH BINARY LOGS`, while a
/// relay reads and while none runs) in between: every committed event arrives, first
/// deliveries in commit order per key, and nothing rolled back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_and_sigterm_mid_stream_lose_nothing_and_keep_each_keys_commit_order() {
    let db = BinlogDb::new().await;
    let keys = ["a", "b", "c"];
    db.write(&keys, 0, 20, true).await;
    let mut first = db.reading("relay-1", "out-1.jsonl").await;
    let mut next = 20;
    for round in 0..5 {
        db.write(&keys, next, 20, true).await;
        db.write(&["a"], 1_000, 5, false).await;
        if round % 2 == 0 {
            db.rotate_log().await;
        }
        next += 20;
    }
    wait_for_lines(
        "the first relay delivering",
        &db.path("out-1.jsonl"),
        Duration::from_secs(30),
        |n| n >= 30,
    )
    .await;
    first.kill9();
    db.write(&keys, next, 20, true).await;
    db.rotate_log().await;
    next += 20;
    let mut second = db.reading("relay-2", "out-2.jsonl").await;
    db.write(&keys, next, 20, true).await;
    next += 20;
    wait_for_lines(
        "the second relay delivering",
        &db.path("out-2.jsonl"),
        Duration::from_secs(30),
        |n| n >= 10,
    )
    .await;
    assert!(second.terminate().await.success(), "{}", second.logs());
    db.write(&keys, next, 20, true).await;
    next += 20;
    let mut third = db.reading("relay-3", "out-3.jsonl").await;
    let files = [
        db.path("out-1.jsonl"),
        db.path("out-2.jsonl"),
        db.path("out-3.jsonl"),
    ];
    let total = keys.len() * next as usize;
    eventually(
        "every committed event delivered",
        Duration::from_secs(60),
        || async {
            let got: usize = first_deliveries(&files).0.values().map(Vec::len).sum();
            (got >= total).then_some(())
        },
    )
    .await;
    let (by_key, lines) = first_deliveries(&files);
    assert_every_key_in_order(&by_key, &keys, next);
    assert!(
        by_key["a"].iter().all(|n| *n < 1_000),
        "a rolled-back event was relayed"
    );
    assert!(lines >= total, "{lines} lines for {total} events");
    assert!(third.terminate().await.success(), "{}", third.logs());
    assert_eq!(db.count("outbox").await, 0, "delivered rows are deleted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_drain_relays_what_was_committed_before_it_and_exits_0() {
    let db = BinlogDb::new().await;
    // A first run stores a position; what is written after it is read from the log.
    let mut started = db.reading("relay-1", "out.jsonl").await;
    assert!(started.terminate().await.success(), "{}", started.logs());
    db.write(&["a", "b"], 0, 50, true).await;
    let mut drain = db.spawn("relay-2", "out.jsonl", &["--drain"]);
    let status = drain.wait_exit_within(Duration::from_secs(60)).await;
    assert!(status.success(), "{}", drain.logs());
    let (by_key, _) = first_deliveries(&[db.path("out.jsonl")]);
    assert_every_key_in_order(&by_key, &["a", "b"], 50);
}

/// An outbox whose event id is MariaDB's own `UUID` type: the log carries its 16 bytes, read
/// as text they were no UUID, and every event was dead-lettered though `check` passed and
/// polling relayed the table. The event id goes out as the table shows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_id_of_mariadbs_uuid_type_goes_out_as_the_table_shows_it() {
    use mysql_async::prelude::Queryable;
    let db = BinlogDb::new().await;
    let mut conn = db.pool.get_conn().await.unwrap();
    conn.query_drop("ALTER TABLE outbox MODIFY event_id uuid NOT NULL DEFAULT uuid()")
        .await
        .unwrap();
    let mut started = db.reading("relay-1", "out.jsonl").await;
    assert!(started.terminate().await.success(), "{}", started.logs());
    let ids = [
        "00112233-4455-6677-8899-aabbccddeeff",
        "00112233-4455-1677-8899-aabbccddeeff",
    ];
    for id in ids {
        conn.exec_drop(
            "INSERT INTO outbox (event_id, destination, partition_key, event_type, payload)
             VALUES (?, 'orders', 'k', 'T', JSON_OBJECT())",
            (id,),
        )
        .await
        .unwrap();
    }
    drop(conn);
    let mut drain = db.spawn("relay-2", "out.jsonl", &["--drain"]);
    let status = drain.wait_exit_within(Duration::from_secs(60)).await;
    assert!(status.success(), "{}", drain.logs());
    let sent: Vec<String> = read_lines(&db.path("out.jsonl"))
        .iter()
        .map(|line| line["event_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(sent, ids);
    assert_eq!(db.count("outbox_parked").await, 0, "nothing dead-lettered");
}

/// A column the relay reads rows by, renamed while it runs: the reader described the table
/// again and read the column's value as NULL, so the next event went out without its payload
/// and key and its row was deleted (a renamed state column of a seed's table made every row
/// read as delivered, and nothing was said). The row waits, the reason is said, and once
/// the column has its name back the event goes out whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_renamed_while_the_relay_runs_holds_its_rows_and_says_so() {
    let db = BinlogDb::new().await;
    let relay = db.reading("relay-1", "out.jsonl").await;
    db.write(&["a"], 0, 1, true).await;
    wait_for_lines(
        "the first event",
        &db.path("out.jsonl"),
        Duration::from_secs(30),
        |n| n >= 1,
    )
    .await;
    let mut conn = db.pool.get_conn().await.unwrap();
    conn.query_drop("ALTER TABLE outbox CHANGE payload data json NULL")
        .await
        .unwrap();
    conn.query_drop(
        "INSERT INTO outbox (destination, partition_key, event_type, data)
         VALUES ('orders', 'a', 'T', JSON_OBJECT('n', 1))",
    )
    .await
    .unwrap();
    relay
        .wait_for_log(
            "the relay saying why it stopped reading",
            Duration::from_secs(30),
            "has no column payload now",
        )
        .await;
    assert_eq!(
        read_lines(&db.path("out.jsonl")).len(),
        1,
        "nothing more went out"
    );
    assert_eq!(db.count("outbox").await, 1, "the row waits");

    conn.query_drop("ALTER TABLE outbox CHANGE data payload json NULL")
        .await
        .unwrap();
    wait_for_lines(
        "the held event once the column is back",
        &db.path("out.jsonl"),
        Duration::from_secs(30),
        |n| n >= 2,
    )
    .await;
    let sent = read_lines(&db.path("out.jsonl"));
    assert_eq!(sent[1]["payload"]["n"], 1, "{}", sent[1]);
    assert_eq!(sent[1]["partition_key"], "a", "{}", sent[1]);
}

/// A database whose name is no identifier (`shop-db`, quoted wherever it is named): `migrate`
/// and `check` passed, and every `run --capture binlog` was refused ("invalid mapping
/// schema"), the database name having been put in the outbox's mapping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_named_with_a_dash_is_captured() {
    use mysql_async::prelude::Queryable;
    let admin = std::env::var("OUTBOX_TEST_MYSQL_URL").unwrap();
    let name = format!(
        "shop-db-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let mut conn = mysql_async::Conn::from_url(admin.as_str()).await.unwrap();
    conn.query_drop(format!("CREATE DATABASE `{name}`"))
        .await
        .unwrap();
    conn.disconnect().await.unwrap();
    let db = BinlogDb::at(&outbox_testkit::with_database(&admin, &name), &[]).await;
    let mut started = db.reading("relay-1", "out.jsonl").await;
    assert!(started.terminate().await.success(), "{}", started.logs());
    db.write(&["a", "b"], 0, 20, true).await;
    let mut drain = db.spawn("relay-2", "out.jsonl", &["--drain"]);
    let status = drain.wait_exit_within(Duration::from_secs(60)).await;
    assert!(status.success(), "{}", drain.logs());
    let (by_key, _) = first_deliveries(&[db.path("out.jsonl")]);
    assert_every_key_in_order(&by_key, &["a", "b"], 20);
    assert_eq!(db.count("outbox").await, 0, "delivered rows are deleted");
}

/// A role without REPLICATION CLIENT, once a position is stored (a first run as an admin,
/// then the deployment's own role): `check` and `run` name the grant, and `run` stops as for
/// the server's other blocking problems (exit 1: a supervisor's restart finds the grant once
/// made). The failed `SHOW BINARY LOGS` was taken for an unreachable database: `check`
/// advised checking the URL's host and port, and `run` waited for the database for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_without_replication_client_is_told_the_grant_not_to_wait_for_the_database() {
    let db = BinlogDb::new().await;
    let mut first = db.reading("relay-1", "out.jsonl").await;
    assert!(first.terminate().await.success(), "{}", first.logs());
    let opts = mysql_async::Opts::from_url(&db.url).unwrap();
    let database = opts.db_name().unwrap().to_string();
    let user = format!(
        "outbox_norc_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let mut admin = db.pool.get_conn().await.unwrap();
    admin
        .query_drop(format!(
            "CREATE USER '{user}'@'127.0.0.1' IDENTIFIED BY 'p';
             GRANT REPLICATION SLAVE ON *.* TO '{user}'@'127.0.0.1';
             GRANT SELECT, INSERT, UPDATE, DELETE ON `{database}`.* TO '{user}'@'127.0.0.1';"
        ))
        .await
        .unwrap();
    let as_user = format!(
        "mysql://{user}:p@{}:{}/{database}",
        opts.ip_or_hostname(),
        opts.tcp_port()
    );
    let names_the_grant = |said: &str| {
        said.contains("GRANT REPLICATION CLIENT ON *.*")
            && !said.contains("check that the database is running")
    };
    let checked = relay(
        db.dir.path(),
        &["check", "--capture", "binlog", "--database-url", &as_user],
    );
    let said = format!("{}{}", text(&checked.stdout), text(&checked.stderr));
    assert!(!checked.status.success(), "{said}");
    assert!(names_the_grant(&said), "{said}");
    let mut refused = db.spawn_at(&as_user, "relay-2", "out.jsonl", &[]);
    let status = refused.wait_exit_within(Duration::from_secs(30)).await;
    let logs = refused.logs();
    assert_eq!(status.code(), Some(1), "{logs}");
    assert!(names_the_grant(&logs), "{logs}");
    // One line, not line breaks printed as a literal `\n`.
    assert!(
        logs.contains("the database is not ready: the role lacks") && !logs.contains("\\n"),
        "{logs}"
    );
    admin
        .query_drop(format!("DROP USER '{user}'@'127.0.0.1'"))
        .await
        .unwrap();
}

/// A park refused for a grant revoked on the parked table stopped the relay: restarted by a
/// supervisor, it read the same rows again and stopped again, its position never stored. It
/// now holds back the refused row's key only, as any refusal, until the grant is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_park_refused_for_a_revoked_grant_holds_back_only_its_key() {
    let db = BinlogDb::new().await;
    let user = format!(
        "outbox_nopark_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let printed = relay(
        db.dir.path(),
        &[
            "migrate",
            "--capture",
            "binlog",
            "--print",
            "--role",
            "relay_x",
            "--database-url",
            &db.url,
        ],
    );
    assert!(printed.status.success(), "{}", text(&printed.stderr));
    let grants: String = text(&printed.stdout)
        .lines()
        .filter(|l| l.starts_with("GRANT "))
        .map(|l| l.replace("'relay_x'@'%'", &format!("'{user}'@'127.0.0.1'")) + "\n")
        .collect();
    let mut admin = db.pool.get_conn().await.unwrap();
    admin
        .query_drop(format!(
            "CREATE USER '{user}'@'127.0.0.1' IDENTIFIED BY 'p'; {grants}"
        ))
        .await
        .unwrap();
    let opts = mysql_async::Opts::from_url(&db.url).unwrap();
    let database = opts.db_name().unwrap().to_string();
    let as_user = format!(
        "mysql://{user}:p@{}:{}/{database}",
        opts.ip_or_hostname(),
        opts.tcp_port()
    );
    let mut reader = db.spawn_at(&as_user, "relay-1", "out.jsonl", &[]);
    reader
        .wait_for_log("the relay reading", Duration::from_secs(60), READING)
        .await;
    let parked_grant = format!("INSERT ON `{database}`.`outbox_parked`");
    admin
        .query_drop(format!("REVOKE {parked_grant} FROM '{user}'@'127.0.0.1'"))
        .await
        .unwrap();
    db.write_a_not_yet_due().await;
    reader
        .wait_for_log(
            "the refused park",
            Duration::from_secs(60),
            "the database refused to park this row",
        )
        .await;
    db.write(&["b"], 0, 1, true).await;
    let files = [db.path("out.jsonl")];
    eventually_explained(
        "key b delivered while the relay runs on",
        Duration::from_secs(30),
        || reader.logs(),
        || async { first_deliveries(&files).0.contains_key("b").then_some(()) },
    )
    .await;
    admin
        .query_drop(format!("GRANT {parked_grant} TO '{user}'@'127.0.0.1'"))
        .await
        .unwrap();
    eventually_explained(
        "the refused row delivered once the grant is back",
        Duration::from_secs(90),
        || reader.logs(),
        || async { first_deliveries(&files).0.contains_key("a").then_some(()) },
    )
    .await;
    assert!(reader.terminate().await.success(), "{}", reader.logs());
    admin
        .query_drop(format!("DROP USER '{user}'@'127.0.0.1'"))
        .await
        .unwrap();
}

/// A row written with `sql_log_bin = 0` never reaches the binary log, so capture never
/// brings it (the README says so). It waited for good while the backlog gauge and its age
/// said nothing was pending; they now count the rows still in the outbox table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_the_log_never_carries_shows_in_the_backlog() {
    let db = BinlogDb::new().await;
    let relay = db
        .reading_with(
            "relay-1",
            "out.jsonl",
            &["--http-addr", "127.0.0.1:0", "--log-format", "json"],
        )
        .await;
    let addr = http_addr(&relay).await;
    let mut conn = db.pool.get_conn().await.unwrap();
    conn.query_drop(
        "SET SESSION sql_log_bin = 0;
         INSERT INTO outbox (destination, partition_key, event_type, payload)
              VALUES ('orders', 'unlogged', 'T', JSON_OBJECT('n', 1));
         SET SESSION sql_log_bin = 1;",
    )
    .await
    .unwrap();
    eventually_explained(
        "the unlogged row in the backlog gauge",
        Duration::from_secs(30),
        || relay.logs(),
        || async {
            let (_, metrics) = http_get(&addr, "/metrics").await?;
            let pending = metric_value(&metrics, "outbox_backlog_events")?;
            (pending >= 1.0).then_some(())
        },
    )
    .await;
}

/// A drain started beside a running relay waits as its standby and delivers nothing: it
/// says why at once, and its exit says so again. Before, the exit said only that a row was
/// left, "leased by another node, or scheduled for later", a row it made up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_beside_a_running_relay_says_it_waits_as_its_standby() {
    let db = BinlogDb::new().await;
    let mut active = db.reading("relay-1", "out-1.jsonl").await;
    let flags = crate::support::STANDBY_DRAIN_FLAGS;
    let mut drain = db.spawn("relay-2", "out-2.jsonl", &flags);
    crate::support::assert_the_drain_says_it_waited_as_a_standby(&mut drain).await;
    assert!(active.terminate().await.success(), "{}", active.logs());
}

/// A polling relay and a binlog capture relay of one outbox: each way's lock kept only its
/// own relays apart, so both ran, and nearly every event went out twice (49 of 50 in a
/// check). Whichever way comes second now takes no event while the other runs, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_polling_relay_and_a_capture_relay_of_one_outbox_never_relay_together() {
    let db = BinlogDb::new().await;
    let polling = |name: &str, out: &str| {
        crate::support::polling_to_a_file(db.dir.path(), &db.url, name, &db.path(out), &[])
    };
    let said = "would relay the outbox";
    let mut capture = db.reading("capture-1", "capture-1.jsonl").await;
    let mut poller = polling("polling-1", "polling-1.jsonl");
    poller
        .wait_for_log("the polling relay refused", Duration::from_secs(30), said)
        .await;
    db.write(&["a", "b"], 0, 10, true).await;
    wait_for_lines(
        "the capture relay delivering",
        &db.path("capture-1.jsonl"),
        Duration::from_secs(30),
        |n| n >= 20,
    )
    .await;
    assert!(read_lines(&db.path("polling-1.jsonl")).is_empty());
    assert!(capture.terminate().await.success(), "{}", capture.logs());
    assert!(poller.terminate().await.success(), "{}", poller.logs());

    // The other way round: the polling relay active, a capture relay started beside it.
    let mut poller = polling("polling-2", "polling-2.jsonl");
    poller
        .wait_for_log(
            "the polling relay active",
            Duration::from_secs(30),
            "the table's active relay",
        )
        .await;
    let mut capture = db.spawn("capture-2", "capture-2.jsonl", &[]);
    capture
        .wait_for_log("the capture relay refused", Duration::from_secs(30), said)
        .await;
    db.write(&["c"], 0, 10, true).await;
    wait_for_lines(
        "the polling relay delivering",
        &db.path("polling-2.jsonl"),
        Duration::from_secs(30),
        |n| n >= 10,
    )
    .await;
    assert!(read_lines(&db.path("capture-2.jsonl")).is_empty());
    assert!(capture.terminate().await.success(), "{}", capture.logs());
    assert!(poller.terminate().await.success(), "{}", poller.logs());
}

/// A first start by `--drain` adopts the rows already in a mapped table: one that is no
/// event (its message no JSON) is adopted as a dead letter, which the drain did not count,
/// so it exited 0 as if everything committed before it had been delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_that_adopts_a_row_as_a_dead_letter_says_so_and_exits_1() {
    let layout = ["--layout", "mysql-outbox-events"];
    let db = BinlogDb::at(&outbox_testkit::fresh_mysql_database().await, &layout).await;
    let mut conn = db.pool.get_conn().await.unwrap();
    conn.query_drop(
        "INSERT INTO outbox_events (type, message, isConsumed, createdAt, updatedAt)
         VALUES (1, '{\"n\": 0}', 0, UTC_TIMESTAMP(), UTC_TIMESTAMP()),
                (1, 'not json', 0, UTC_TIMESTAMP(), UTC_TIMESTAMP())",
    )
    .await
    .unwrap();
    let mut drain = db.spawn(
        "relay-1",
        "out.jsonl",
        &[&["--drain"][..], &layout].concat(),
    );
    let status = drain.wait_exit_within(Duration::from_secs(60)).await;
    assert_eq!(status.code(), Some(1), "{}", drain.logs());
    assert!(drain.logs().contains("dead"), "{}", drain.logs());
    assert_eq!(read_lines(&db.path("out.jsonl")).len(), 1);
}

/// A fresh database whose outbox is a BLACKHOLE table (`blackhole_ddl`), the engine
/// installed where it is a plugin, and a connection to it.
async fn blackhole_outbox() -> (String, mysql_async::Conn) {
    let url = outbox_testkit::fresh_mysql_database().await;
    let pool = mysql_async::Pool::new(mysql_async::Opts::from_url(&url).unwrap());
    let mut conn = pool.get_conn().await.unwrap();
    if outbox_binlog::blackhole_problem(&url)
        .await
        .unwrap()
        .is_some()
    {
        // Debian's MariaDB ships the engine as a plugin.
        conn.query_drop("INSTALL SONAME 'ha_blackhole'")
            .await
            .unwrap();
    }
    conn.query_drop(outbox_binlog::blackhole_ddl("outbox"))
        .await
        .unwrap();
    (url, conn)
}

/// `dead retry` of a BLACKHOLE row binlog capture could not decode (headers that are no
/// JSON object): its dead letter held an empty type and no payload, and the retry published
/// that under the event's id, so consumers deduplicating by id would drop the event once
/// written again, fixed. It is found undecodable again and stays dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_dead_letter_of_an_undecodable_row_is_not_published() {
    let (url, mut conn) = blackhole_outbox().await;
    let db = BinlogDb::at(&url, &[]).await;
    let relay = db.reading("relay-1", "out.jsonl").await;
    conn.query_drop(
        "INSERT INTO outbox (destination, partition_key, event_type, payload, headers)
              VALUES ('orders', 'odd', 'T', JSON_OBJECT('n', 1), '[1]');
         INSERT INTO outbox (destination, partition_key, event_type, payload)
              VALUES ('orders', 'a', 'T', JSON_OBJECT('n', 2));",
    )
    .await
    .unwrap();
    wait_for_lines(
        "the decodable event",
        &db.path("out.jsonl"),
        Duration::from_secs(30),
        |n| n >= 1,
    )
    .await;
    let dead = "SELECT count(*) FROM outbox_parked WHERE dead_at IS NOT NULL";
    eventually_explained(
        "the undecodable row dead-lettered",
        Duration::from_secs(30),
        || relay.logs(),
        || async { (db.count_where(dead).await == 1).then_some(()) },
    )
    .await;
    let retried = relay_ok(
        db.dir.path(),
        &[
            "dead",
            "retry",
            "--all",
            "--capture",
            "binlog",
            "--database-url",
            &url,
        ],
    );
    assert!(retried.contains("moved 1"), "{retried}");
    let said_again = "SELECT count(*) FROM outbox_parked
                       WHERE dead_at IS NOT NULL
                         AND last_error LIKE '%keeps what could be read of an event%'";
    await_dead_again_or_published(&relay, &db.path("out.jsonl"), 1, || async {
        db.count_where(said_again).await == 1
    })
    .await;
    let sent = read_lines(&db.path("out.jsonl"));
    assert_eq!(sent.len(), 1, "only the decodable event: {sent:?}");
}

/// The table-less form through the binary, as the README tells it: the outbox created
/// with `blackhole_ddl`, then `migrate --capture binlog`, `check` and `run`. The parked
/// table keeps its rows whatever the outbox's engine (one made `LIKE` a BLACKHOLE outbox
/// stored no retry, and lacked the native columns, so `run` refused to start), and a parked
/// table that stores nothing is refused with the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_less_form_runs_through_the_binary_and_its_parked_table_keeps_rows() {
    let (url, mut conn) = blackhole_outbox().await;
    let db = BinlogDb::at(&url, &[]).await;
    let engine: String = conn
        .query_first(
            "SELECT ENGINE FROM information_schema.TABLES
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'outbox_parked'",
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(engine, "InnoDB", "the parked table stores its rows");
    let check = [
        "check",
        "--capture",
        "binlog",
        "--database-url",
        url.as_str(),
    ];
    relay_ok(db.dir.path(), &check);

    let mut started = db.reading("relay-1", "out.jsonl").await;
    assert!(started.terminate().await.success(), "{}", started.logs());
    db.write(&["a", "b"], 0, 20, true).await;
    db.write(&["a"], 20, 5, false).await;
    let mut drain = db.spawn("relay-2", "out.jsonl", &["--drain"]);
    let status = drain.wait_exit_within(Duration::from_secs(60)).await;
    assert!(status.success(), "{}", drain.logs());
    let (by_key, lines) = first_deliveries(&[db.path("out.jsonl")]);
    assert_every_key_in_order(&by_key, &["a", "b"], 20);
    assert_eq!(lines, 40, "nothing rolled back, nothing twice");
    // `stats` counts what the parked table holds; the outbox table holds nothing to count.
    let stats = [
        "stats",
        "--capture",
        "binlog",
        "--database-url",
        url.as_str(),
    ];
    relay_ok(db.dir.path(), &stats);

    // As an earlier version made it `LIKE` the outbox (a BLACKHOLE table has no generated
    // column, so it has no index of waiting keys either): `migrate` leaves it as it is,
    // and `check` says how to make it again.
    conn.query_drop(
        "ALTER TABLE outbox_parked DROP INDEX outbox_parked_keys, DROP COLUMN key_hash, \
         ENGINE=BLACKHOLE",
    )
    .await
    .unwrap();
    relay_ok(
        db.dir.path(),
        &["migrate", "--capture", "binlog", "--database-url", &url],
    );
    let checked = relay(db.dir.path(), &check);
    let said = format!("{}{}", text(&checked.stdout), text(&checked.stderr));
    assert!(!checked.status.success(), "{said}");
    assert!(
        said.contains("outbox_parked") && said.contains("BLACKHOLE") && said.contains("migrate"),
        "{said}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_from_a_sigstopped_reader_after_its_lease() {
    let db = BinlogDb::new().await;
    let (active, standby) = db.active_delivering_and_a_standby().await;
    // An event of `a` not due for a few seconds: the active relay parks it, and claims
    // from the parked table, under that table's own lock.
    db.write_a_not_yet_due().await;
    eventually_explained(
        "the active relay holding the parked table's lock",
        Duration::from_secs(30),
        || active.logs(),
        || {
            let pool = db.pool.clone();
            async move {
                let mut conn = pool.get_conn().await.ok()?;
                let holder: Option<u64> = conn
                    .query_first(
                        "SELECT IS_USED_LOCK(LEFT(CONCAT('outbox-relay ', DATABASE(), '.outbox_parked'), 64))",
                    )
                    .await
                    .ok()??;
                holder.map(|_| ())
            }
        },
    )
    .await;
    // The park committed (a relay paused inside it is the next test's).
    eventually(
        "the active relay parked the event",
        Duration::from_secs(30),
        || async { (db.count("outbox_parked").await == 1).then_some(()) },
    )
    .await;
    // Paused, it keeps that lock's session (the server ends an idle one after
    // `wait_timeout`, 8 hours): the standby, once it reads, ends it to claim the parked
    // event, and the events of `a` behind it.
    active.signal("-STOP");
    db.standby_delivers_the_rest(active, standby).await;
}

/// The park is fenced on the seat under a shared lock of the position's row, which the
/// standby's fencing write waits for. A reader paused inside a park would hold that lock for
/// the server's `wait_timeout` (8 hours by default), and no standby took over meanwhile: the
/// server ends the relay's idle transaction after its bound instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_from_a_reader_sigstopped_inside_a_park() {
    let db = BinlogDb::new().await;
    let (active, standby) = db.active_delivering_and_a_standby().await;
    // With the parked table locked, the park of an event not due yet waits inside its
    // transaction, the position's row already read under a shared lock.
    let mut locker = db.pool.get_conn().await.unwrap();
    locker
        .query_drop("LOCK TABLES outbox_parked WRITE")
        .await
        .unwrap();
    db.write_a_not_yet_due().await;
    eventually_explained(
        "the active relay's park waiting for the parked table",
        Duration::from_secs(30),
        || active.logs(),
        || {
            let pool = db.pool.clone();
            async move {
                let mut conn = pool.get_conn().await.ok()?;
                let waiting: Option<i64> = conn
                    .query_first(
                        "SELECT count(*) FROM information_schema.PROCESSLIST
                          WHERE DB = DATABASE() AND INFO LIKE 'INSERT INTO%outbox_parked%'",
                    )
                    .await
                    .ok()?;
                (waiting? > 0).then_some(())
            }
        },
    )
    .await;
    // Paused there: once the table is unlocked, the park's insert goes through and its
    // transaction waits for a relay that sends nothing more.
    active.signal("-STOP");
    locker.query_drop("UNLOCK TABLES").await.unwrap();
    drop(locker);
    db.standby_delivers_the_rest(active, standby).await;
}

#[test]
fn settings_binlog_capture_cannot_apply_are_refused_with_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    for (args, said) in [
        (
            vec![
                "check",
                "--capture",
                "binlog",
                "--database-url",
                "postgres://h/db",
            ],
            "mysql://",
        ),
        (
            vec![
                "check",
                "--binlog-server-id",
                "7",
                "--database-url",
                "mysql://h/db",
            ],
            "--capture binlog",
        ),
        (
            vec![
                "check",
                "--capture",
                "binlog",
                "--layout",
                "mysql-outbox-events",
                "--retain-delivered",
                "--database-url",
                "mysql://h/db",
            ],
            "retain",
        ),
    ] {
        let out = relay(dir.path(), &args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(
            text(&out.stderr).contains(said),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
}

/// The stored position's log is gone (purged while the relay was off; here a file before
/// the server's first, since purging the shared server's logs would pull them from under
/// other tests): `check` fails and `run` refuses to start, each saying how to recover, and
/// nothing is skipped.
/// Forgetting the position, as they say, adopts the rows still in the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purged_position_is_refused_and_forgetting_it_adopts_the_rows_still_in_the_table() {
    let db = BinlogDb::new().await;
    let mut first = db.reading("relay-1", "out.jsonl").await;
    assert!(first.terminate().await.success(), "{}", first.logs());
    db.write(&["a"], 0, 5, true).await;
    let mut conn = db.pool.get_conn().await.unwrap();
    conn.query_drop(
        "UPDATE outbox_binlog SET log_file = CONCAT(SUBSTRING_INDEX(log_file, '.', 1), '.000000')",
    )
    .await
    .unwrap();
    let (said, logs) = check_and_run_refuse(&db, &db.url, |t| t.contains("purged")).await;
    let forget = advised_forget(&said);
    assert!(logs.contains(&forget), "{logs}");
    assert!(
        read_lines(&db.path("out.jsonl")).is_empty(),
        "nothing skipped to"
    );
    // The advised statement forgets the position and keeps the seat's epoch: a row deleted
    // and made again started it over, where a paused ex-reader's epoch could pass again.
    async fn epoch(conn: &mut mysql_async::Conn) -> Option<i64> {
        conn.query_first("SELECT epoch FROM outbox_binlog")
            .await
            .unwrap()
    }
    let before = epoch(&mut conn).await.expect("the seat's row");
    conn.query_drop(&forget).await.unwrap();
    assert_eq!(
        epoch(&mut conn).await,
        Some(before),
        "{forget} keeps the epoch"
    );
    let mut again = db.reading("relay-3", "out.jsonl").await;
    wait_for_lines(
        "the adopted rows delivered",
        &db.path("out.jsonl"),
        Duration::from_secs(30),
        |n| n >= 5,
    )
    .await;
    assert_every_key_in_order(&first_deliveries(&[db.path("out.jsonl")]).0, &["a"], 5);
    assert!(
        epoch(&mut conn).await > Some(before),
        "the relay took the seat at a later epoch"
    );
    assert!(again.terminate().await.success(), "{}", again.logs());
}

/// A stored position in a binary log this server never had, of a number above its newest
/// (after RESET MASTER, a renamed log basename, a restored server): `check` compared file
/// numbers with the oldest only, found none of it wrong and passed, and `run` tried to read
/// from it every second for good. Both refuse it now, naming it, with the recovery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_position_in_a_log_the_server_does_not_have_is_refused_by_check_and_run() {
    let db = BinlogDb::new().await;
    let mut first = db.reading("relay-1", "out.jsonl").await;
    assert!(first.terminate().await.success(), "{}", first.logs());
    let mut conn = db.pool.get_conn().await.unwrap();
    conn.query_drop(
        "UPDATE outbox_binlog SET log_file = CONCAT(SUBSTRING_INDEX(log_file, '.', 1), '.999999')",
    )
    .await
    .unwrap();
    let names_it = |said: &str| {
        said.contains(".999999")
            && said.contains("not in this server's binary logs")
            && said.contains("forget the position")
    };
    check_and_run_refuse(&db, &db.url, names_it).await;
}

/// A position stored on another server (a failover) whose GTID state this server's log
/// does not continue (their histories diverged): `run` refuses it, and `check` says so too.
/// `check` passed it before, then `run` stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gtid_state_the_servers_log_does_not_continue_fails_the_check_as_it_stops_run() {
    let db = BinlogDb::new().await;
    let mut first = db.reading("relay-1", "out.jsonl").await;
    assert!(first.terminate().await.success(), "{}", first.logs());
    let mut conn = db.pool.get_conn().await.unwrap();
    // This server's last GTID, as another server (id 99) would have written it.
    let position: String = conn
        .query_first("SELECT @@gtid_binlog_pos")
        .await
        .unwrap()
        .unwrap();
    let last = position.split(',').next().unwrap();
    let (domain, sequence) = (
        last.split('-').next().unwrap(),
        last.rsplit('-').next().unwrap(),
    );
    let diverged = format!("{domain}-99-{sequence}");
    conn.exec_drop(
        "UPDATE outbox_binlog SET server_id = server_id + 1000, gtid = ?",
        (&diverged,),
    )
    .await
    .unwrap();
    let names_it =
        |said: &str| said.contains("does not continue after GTID") && said.contains(&diverged);
    check_and_run_refuse(&db, &db.url, names_it).await;
}

/// The table-less form: a BLACKHOLE outbox stores nothing, so the events committed after a
/// purged position are in no table to adopt. `check` and `run` refuse the position as for
/// the native table, and say the events are lost, with the ways back (a server whose logs
/// still have them, or the application's records); they said the events were "not lost"
/// and would be adopted from the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purged_position_of_a_blackhole_outbox_is_refused_saying_its_events_are_lost() {
    let (url, mut conn) = blackhole_outbox().await;
    let db = BinlogDb::at(&url, &[]).await;
    let mut first = db.reading("relay-1", "out.jsonl").await;
    assert!(first.terminate().await.success(), "{}", first.logs());
    db.write(&["a"], 0, 5, true).await;
    conn.query_drop(
        "UPDATE outbox_binlog SET log_file = CONCAT(SUBSTRING_INDEX(log_file, '.', 1), '.000000')",
    )
    .await
    .unwrap();
    let says_lost = |said: &str| {
        said.contains("purged")
            && said.contains("BLACKHOLE")
            && said.contains("they are lost")
            && said.contains("replica")
            && !said.contains("not lost")
            && !said.contains("adopts the rows")
            && !said.contains("by polling")
    };
    check_and_run_refuse(&db, &url, says_lost).await;
}

/// `check` of the database at `url` fails, and a relay's start there exits non-zero, both
/// saying what `says_it` looks for.
async fn check_and_run_refuse(
    db: &BinlogDb,
    url: &str,
    says_it: impl Fn(&str) -> bool,
) -> (String, String) {
    let checked = relay(
        db.dir.path(),
        &["check", "--capture", "binlog", "--database-url", url],
    );
    let said = format!("{}{}", text(&checked.stdout), text(&checked.stderr));
    assert!(!checked.status.success(), "{said}");
    assert!(says_it(&said), "{said}");
    let mut refused = db.spawn("relay-2", "out.jsonl", &[]);
    let status = refused.wait_exit_within(Duration::from_secs(30)).await;
    let logs = refused.logs();
    assert!(!status.success(), "{logs}");
    assert!(says_it(&logs), "{logs}");
    (said, logs)
}

/// The statement a refusal advises to forget the stored position (`forget the position
/// (…)`), as it says it.
fn advised_forget(said: &str) -> String {
    let (_, from) = said
        .split_once("forget the position (")
        .unwrap_or_else(|| panic!("no statement to forget the position: {said}"));
    let end = from.find("')").expect("the statement's end") + 1;
    from[..end].to_string()
}

/// Writers, one per key, each committing its events one after another (so per key, commit
/// order is the order written), every event's id recorded with its key and number.
struct KeyWriters {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Vec<(String, i64)>>>,
}

impl KeyWriters {
    fn start(url: &str, keys: &[&str]) -> KeyWriters {
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = keys
            .iter()
            .map(|key| {
                let (url, key, stop) = (url.to_string(), key.to_string(), stop.clone());
                tokio::spawn(async move {
                    let mut conn = None;
                    let mut written = Vec::new();
                    let mut n = 0;
                    while !stop.load(Ordering::SeqCst) {
                        // A connection lost (the server restarted) is made again.
                        if conn.is_none() {
                            conn = mysql_async::Conn::from_url(url.as_str()).await.ok();
                        }
                        if let Some(c) = &mut conn {
                            let id = uuid::Uuid::new_v4().to_string();
                            let wrote = c
                                .exec_drop(
                                    "INSERT INTO outbox (event_id, destination, partition_key, event_type, payload)
                                     VALUES (?, 'orders', ?, 'T', JSON_OBJECT('n', ?))",
                                    (&id, &key, n),
                                )
                                .await;
                            match wrote {
                                Ok(()) => {
                                    written.push((id, n));
                                    n += 1;
                                }
                                Err(_) => conn = None,
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    written
                })
            })
            .collect();
        KeyWriters { stop, tasks }
    }

    /// Stops them: each key's event ids, in the order committed.
    async fn stop(self) -> Vec<Vec<String>> {
        self.stop.store(true, Ordering::SeqCst);
        let mut keys = Vec::new();
        for task in self.tasks {
            keys.push(task.await.unwrap().into_iter().map(|(id, _)| id).collect());
        }
        keys
    }
}

/// The database's connections cut (as a restart cuts them: the binlog stream, the seat's
/// lock and the pool) and then the broker away, each for seconds, while writers go on:
/// every committed event arrives, each key's first deliveries in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_cut_and_a_broker_outage_mid_stream_lose_nothing_and_keep_order() {
    let (_nats, deliveries, broker, broker_url) = nats_behind_a_proxy().await;
    let db = BinlogDb::new().await;
    let (database, proxied_db) = outbox_testkit::FaultProxy::start_for_url(&db.url)
        .await
        .unwrap();
    let mut args = vec![
        "run",
        "--capture",
        "binlog",
        "--database-url",
        &proxied_db,
        "--sink",
        &broker_url,
        "--http-addr",
        "",
        "--shutdown-timeout",
        "5s",
    ];
    args.extend(RETRY_AN_OUTAGE);
    let mut relay = RelayProcess::spawn(
        db.dir.path(),
        "relay",
        &args,
        &[("OUTBOX_RELAY_LOG_LEVEL", "info,outbox_binlog=debug")],
    );
    relay
        .wait_for_log("the relay reading", Duration::from_secs(60), READING)
        .await;
    let keys = ["a", "b", "c"];
    let writers = KeyWriters::start(&db.url, &keys);
    let more = |n: usize| {
        let target = deliveries.len() + n;
        let deliveries = &deliveries;
        eventually("more deliveries", Duration::from_secs(60), move || {
            let done = deliveries.len() >= target;
            async move { done.then_some(()) }
        })
    };
    more(50).await;
    database.handle().cut();
    // The cut's length, not a synchronisation: the writers go on meanwhile.
    tokio::time::sleep(Duration::from_secs(2)).await;
    database.handle().heal();
    more(50).await;
    broker.handle().cut();
    tokio::time::sleep(Duration::from_secs(3)).await;
    broker.handle().heal();
    more(50).await;
    let committed = writers.stop().await;
    let total: usize = committed.iter().map(Vec::len).sum();
    eventually_explained(
        "every committed event delivered",
        Duration::from_secs(60),
        || relay.logs(),
        || {
            let seen: HashSet<String> = deliveries.snapshot().into_iter().map(|d| d.id).collect();
            let done = committed.iter().flatten().all(|id| seen.contains(id));
            async move { done.then_some(()) }
        },
    )
    .await;
    // Each key's first deliveries follow its commit order.
    let mut first: Vec<String> = Vec::new();
    let mut seen = HashSet::new();
    for delivery in deliveries.snapshot() {
        if seen.insert(delivery.id.clone()) {
            first.push(delivery.id);
        }
    }
    for (key, ids) in committed.iter().enumerate() {
        let number: HashMap<&String, usize> =
            ids.iter().enumerate().map(|(n, id)| (id, n)).collect();
        let order: Vec<usize> = first
            .iter()
            .filter_map(|id| number.get(id).copied())
            .collect();
        if let Some(at) = order.windows(2).position(|w| w[0] > w[1]) {
            let around = &order[at.saturating_sub(3)..(at + 5).min(order.len())];
            let (before, after) = (&ids[order[at]], &ids[order[at + 1]]);
            let logs = relay.logs();
            let mentions: Vec<&str> = logs
                .lines()
                .filter(|l| {
                    l.contains(before.as_str())
                        || l.contains(after.as_str())
                        || l.contains("flow from the log again")
                        || l.contains("settled parked")
                })
                .collect();
            panic!(
                "key {key}: first deliveries out of commit order at {at}: {around:?}; \
                 {before} (n {}) and {after} (n {}) in the logs:\n{}",
                order[at],
                order[at + 1],
                mentions.join("\n")
            );
        }
    }
    eprintln!("{total} committed, {} delivered", deliveries.len());
    assert!(relay.terminate().await.success(), "{}", relay.logs());
}

/// The MySQL seed's `outbox_events` (layout `mysql-outbox-events`: no event id column, a
/// `tinyint unsigned` type as destination and key, an `isConsumed` flag) captured from the
/// log: rows from before the first start are adopted (a message that is not JSON as a dead
/// letter), later ones read from the log; each event carries the id polling would give its
/// row; a row inserted consumed is no event; and every delivered row is marked consumed,
/// not deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mysql_seeds_table_is_captured_with_pollings_event_ids_and_marked_consumed() {
    let layout = ["--layout", "mysql-outbox-events"];
    let db = BinlogDb::at(&outbox_testkit::fresh_mysql_database().await, &layout).await;
    let url = db.url.clone();
    let check = [
        &["check", "--capture", "binlog", "--database-url", &url][..],
        &layout,
    ]
    .concat();
    let checked = relay(db.dir.path(), &check);
    assert!(checked.status.success(), "{}", text(&checked.stderr));
    let pool = mysql_async::Pool::new(mysql_async::Opts::from_url(&url).unwrap());
    let mut conn = pool.get_conn().await.unwrap();
    let insert = |kind: u8, n: i64, consumed: bool| {
        format!(
            "INSERT INTO outbox_events (type, message, isConsumed, createdAt, updatedAt)
             VALUES ({kind}, '{{\"n\": {n}}}', {}, UTC_TIMESTAMP(), UTC_TIMESTAMP())",
            u8::from(consumed)
        )
    };
    // Before the first start: two events, one consumed row, one message that is no JSON.
    for statement in [
        insert(1, 0, false),
        insert(1, 1, false),
        insert(1, 99, true),
        "INSERT INTO outbox_events (type, message, isConsumed, createdAt, updatedAt)
         VALUES (1, 'not json', 0, UTC_TIMESTAMP(), UTC_TIMESTAMP())"
            .into(),
    ] {
        conn.query_drop(statement).await.unwrap();
    }
    let out = db.path("out.jsonl");
    let mut relay_process = db.reading_with("relay", "out.jsonl", &layout).await;
    // From the log: one transaction of two types, a consumed row, and a type past 127
    // (a `tinyint unsigned` the log carries as a byte).
    let mut tx = conn
        .start_transaction(mysql_async::TxOpts::default())
        .await
        .unwrap();
    for statement in [
        insert(1, 2, false),
        insert(2, 0, false),
        insert(2, 99, true),
        insert(200, 0, false),
        "INSERT INTO outbox_events (type, message, isConsumed, createdAt, updatedAt)
         VALUES (3, 'logged, not json', 0, UTC_TIMESTAMP(), UTC_TIMESTAMP())"
            .into(),
    ] {
        tx.query_drop(statement).await.unwrap();
    }
    tx.commit().await.unwrap();
    conn.query_drop(insert(1, 3, false)).await.unwrap();
    wait_for_lines(
        "the relay delivering six events",
        &out,
        Duration::from_secs(60),
        |n| n >= 6,
    )
    .await;
    let (by_key, _) = first_deliveries(std::slice::from_ref(&out));
    assert_eq!(by_key.get("1"), Some(&vec![0, 1, 2, 3]), "{by_key:?}");
    assert_eq!(by_key.get("2"), Some(&vec![0]), "{by_key:?}");
    assert_eq!(by_key.get("200"), Some(&vec![0]), "{by_key:?}");
    // The ids polling gives the rows (a name-based UUID of the table and row id).
    let ids: Vec<(u64, i64)> = conn
        .query("SELECT id, CAST(JSON_VALUE(message, '$.n') AS SIGNED) FROM outbox_events WHERE type = 1 AND JSON_VALID(message) AND message NOT LIKE '%99%' ORDER BY id")
        .await
        .unwrap();
    let mapping = outbox_layout::Mapping::mysql_outbox_events(None, "outbox_events");
    for line in read_lines(&out) {
        if line["destination"] != "1" {
            continue;
        }
        let n = line["payload"]["n"].as_i64().unwrap();
        let (id, _) = ids.iter().find(|(_, m)| *m == n).unwrap();
        let want = outbox_layout::memory::derived_event_id(&mapping, &id.to_string());
        assert_eq!(line["event_id"], want.to_string(), "{line}");
    }
    eventually(
        "every row delivered or dead marked consumed",
        Duration::from_secs(30),
        || {
            let pool = pool.clone();
            async move {
                let mut conn = pool.get_conn().await.unwrap();
                let unconsumed: Option<i64> = conn
                    .query_first("SELECT count(*) FROM outbox_events WHERE isConsumed = 0")
                    .await
                    .unwrap();
                (unconsumed == Some(0)).then_some(())
            }
        },
    )
    .await;
    let dead: Vec<(String, String, Option<String>)> = conn
        .query(
            "SELECT destination, last_error, CAST(payload AS CHAR) FROM outbox_events_parked
              WHERE dead_at IS NOT NULL ORDER BY sequence_id",
        )
        .await
        .unwrap();
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert!(dead[0].1.contains("not JSON"), "{dead:?}");
    // The one read from the log keeps its message, as a JSON string of its text: its
    // dead letter was made of its image alone, its message lost.
    assert_eq!(dead[1].0, "3", "{dead:?}");
    assert_eq!(
        dead[1].2.as_deref(),
        Some("\"logged, not json\""),
        "{dead:?}"
    );
    assert!(
        !read_lines(&out)
            .iter()
            .any(|line| line["payload"]["n"] == 99),
        "a row inserted consumed is no event"
    );
    assert!(
        relay_process.terminate().await.success(),
        "{}",
        relay_process.logs()
    );
}

/// A failover to a promoted replica: two private MariaDB servers (ids 1 and 2), the second
/// replicating the first by GTID with its own binary log (`log_slave_updates`). The relay
/// reads the primary and stops; more events are written; the replica catches up and is
/// promoted, the primary is gone. Pointed at the promoted server, whose files and offsets
/// are its own, the relay goes on after the GTID state it stored with its position: the
/// missing events arrive, none twice, and later ones follow in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failover_the_relay_goes_on_at_the_promoted_replica_after_its_gtid() {
    let (primary, mut to_primary) = private_mariadb("1").await;
    let (replica, mut to_replica) = private_mariadb("2").await;
    to_replica
        .query_drop(format!(
            "CHANGE MASTER TO MASTER_HOST = '127.0.0.1', MASTER_PORT = {}, MASTER_USER = 'root',
             MASTER_USE_GTID = slave_pos; START SLAVE",
            primary.port
        ))
        .await
        .unwrap();
    to_primary.query_drop("CREATE DATABASE shop").await.unwrap();
    let db = BinlogDb::at(&shop(&primary), &[]).await;
    let out = db.path("out.jsonl");
    let mut first = db.reading("relay-1", "out.jsonl").await;
    db.write(&["a"], 0, 10, true).await;
    wait_for_lines("ten events", &out, Duration::from_secs(30), |n| n >= 10).await;
    assert!(first.terminate().await.success(), "{}", first.logs());
    db.write(&["a"], 10, 10, true).await;
    // The replica has everything, then is promoted; the primary is gone.
    let state: String = to_primary
        .query_first("SELECT @@gtid_binlog_pos")
        .await
        .unwrap()
        .unwrap();
    let waited: Option<i64> = to_replica
        .exec_first("SELECT MASTER_GTID_WAIT(?, 60)", (&state,))
        .await
        .unwrap();
    assert_eq!(waited, Some(0), "the replica caught up with {state}");
    to_replica
        .query_drop("STOP SLAVE; RESET SLAVE ALL")
        .await
        .unwrap();
    drop(to_primary);
    drop(primary);
    let promoted = shop(&replica);
    let mut second = db.spawn_at(&promoted, "relay-2", "out.jsonl", &[]);
    second
        .wait_for_log("the relay reading", Duration::from_secs(60), READING)
        .await;
    wait_for_lines("twenty events", &out, Duration::from_secs(30), |n| n >= 20).await;
    let mut to_promoted = mysql_async::Conn::from_url(promoted.as_str())
        .await
        .unwrap();
    for n in 20..25 {
        to_promoted
            .exec_drop(
                "INSERT INTO outbox (destination, partition_key, event_type, payload)
                 VALUES ('orders', 'a', 'T', JSON_OBJECT('n', ?))",
                (n,),
            )
            .await
            .unwrap();
    }
    wait_for_lines("twenty-five events", &out, Duration::from_secs(30), |n| {
        n >= 25
    })
    .await;
    let (by_key, lines) = first_deliveries(std::slice::from_ref(&out));
    assert_every_key_in_order(&by_key, &["a"], 25);
    assert_eq!(
        lines, 25,
        "nothing delivered twice: the relay went on where it stopped"
    );
    assert!(
        second.logs().contains("going on after its GTID state"),
        "{}",
        second.logs()
    );
    assert!(second.terminate().await.success(), "{}", second.logs());
}

/// `RESET MASTER` while the relay was off (or a server rebuilt or restored with the same
/// server id): the log starts again under the same file names, and once it has grown past
/// the stored place the file and offset are there again, in another history. The relay read
/// on from there, skipping what lay before (here: the events written after the reset). The
/// server's GTID state at the place, not the one stored with it, says so: `check` fails and
/// `run` refuses to start, each naming the reset with the recovery, and nothing is
/// delivered. (A reader starting there refuses it too, as a purged place.) On a server of its own: a reset
/// of the shared server's log would pull it from under other tests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_reset_and_grown_past_the_stored_place_is_refused_not_read_from() {
    let (server, mut admin) = private_mariadb("1").await;
    admin.query_drop("CREATE DATABASE shop").await.unwrap();
    let db = BinlogDb::at(&shop(&server), &[]).await;
    let out = db.path("out.jsonl");
    let mut first = db.reading("relay-1", "out.jsonl").await;
    db.write(&["a"], 0, 10, true).await;
    wait_for_lines("ten events", &out, Duration::from_secs(30), |n| n >= 10).await;
    assert!(first.terminate().await.success(), "{}", first.logs());
    let (file, offset, gtid): (String, u64, Option<String>) = admin
        .query_first("SELECT log_file, log_offset, gtid FROM shop.outbox_binlog")
        .await
        .unwrap()
        .expect("a stored place");
    assert!(gtid.is_some(), "stored with its GTID state");
    admin.query_drop("RESET MASTER").await.unwrap();
    // Written after the reset, until the log is at the stored file and past its offset, one
    // transaction at a time; then the stored place is made the boundary the log reached (a
    // place that falls on one of the new log's events, as any may).
    let mut n = 10;
    let reached = loop {
        let (now_file, now_offset): (String, u64) = admin
            .query_first("SHOW MASTER STATUS")
            .await
            .unwrap()
            .map(|row: mysql_async::Row| (row.get(0).unwrap(), row.get(1).unwrap()))
            .unwrap();
        if now_file < file {
            admin.query_drop("FLUSH BINARY LOGS").await.unwrap();
        } else if now_offset < offset {
            db.write(&["b"], n, 1, true).await;
            n += 1;
        } else {
            assert_eq!(now_file, file);
            break now_offset;
        }
    };
    admin
        .exec_drop("UPDATE shop.outbox_binlog SET log_offset = ?", (reached,))
        .await
        .unwrap();
    let reset = "the log was reset (RESET MASTER)";
    check_and_run_refuse(&db, &db.url, |t| t.contains(reset)).await;
    assert_eq!(
        read_lines(&out).len(),
        10,
        "nothing read from the other history"
    );
}

/// A private MariaDB of its own (`servers.sh`) with server id `id`, and a connection to it.
async fn private_mariadb(id: &str) -> (outbox_testkit::server::ScriptedServer, mysql_async::Conn) {
    let server = outbox_testkit::server::ScriptedServer::start_with(
        "mariadb",
        "OUTBOX_TEST_MARIADB_PORT",
        &[("MARIADB_SERVER_ID", id)],
    );
    let admin = format!("mysql://root@127.0.0.1:{}/mysql", server.port);
    let conn = mysql_async::Conn::from_url(admin.as_str()).await.unwrap();
    (server, conn)
}

/// The URL of the database `shop` on `server`.
fn shop(server: &outbox_testkit::server::ScriptedServer) -> String {
    format!("mysql://root@127.0.0.1:{}/shop", server.port)
}

/// A custom mapping captured from the log, with what the log carries in forms of its own: an
/// ENUM status (its number in the log) whose pending value the mapping spells in another
/// case (MySQL compares case-insensitively, as polling's SQL does), a TIMESTAMP `created_at`
/// (seconds in the log), and NULL in the key and type columns (polling's fallbacks: the
/// destination). A key too long for the parked table is adopted as a dead letter that says
/// so, and a row inserted in another state is no event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_mapping_is_captured_with_its_enum_state_timestamps_and_fallbacks() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let dir = tempfile::tempdir().unwrap();
    let pool = mysql_async::Pool::new(mysql_async::Opts::from_url(&url).unwrap());
    let mut conn = pool.get_conn().await.unwrap();
    conn.query_drop(
        "SET time_zone = '+00:00';
         CREATE TABLE app_events (
           id bigint unsigned AUTO_INCREMENT PRIMARY KEY,
           status enum('NEW', 'SENT', 'FAILED') NOT NULL DEFAULT 'NEW',
           topic varchar(500) NOT NULL,
           k varchar(500) NULL,
           kind varchar(100) NULL,
           body json NULL,
           created timestamp(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6))",
    )
    .await
    .unwrap();
    std::fs::write(
        dir.path().join("outbox-relay.toml"),
        r#"[mapping]
table = "app_events"
id = "id"
destination = "topic"
key = "k"
event_type = "kind"
payload = "body"
created_at = "created"
on_success = "mark"
state = { kind = "status", column = "status", pending = "new", delivered = "SENT", dead = "FAILED" }
"#,
    )
    .unwrap();
    let with = |args: &[&str]| {
        let mut all = vec!["--config", "outbox-relay.toml"];
        all.extend_from_slice(args);
        all.extend([
            "--layout",
            "custom",
            "--capture",
            "binlog",
            "--database-url",
        ]);
        all.push(&url);
        all.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let migrate = with(&["migrate"]);
    let migrate: Vec<&str> = migrate.iter().map(String::as_str).collect();
    let migrated = relay(dir.path(), &migrate);
    assert!(migrated.status.success(), "{}", text(&migrated.stderr));
    // Before the first start: one event with NULL key and type, one key too long to park.
    conn.query_drop(format!(
        "INSERT INTO app_events (topic, body) VALUES ('billing', JSON_OBJECT('n', 0));
         INSERT INTO app_events (topic, k, body) VALUES ('billing', '{}', JSON_OBJECT('n', 99))",
        "x".repeat(300)
    ))
    .await
    .unwrap();
    let out = dir.path().join("out.jsonl");
    let sink = format!("file:{}", out.display());
    let run = with(&["run", "--sink", &sink, "--http-addr", ""]);
    let run: Vec<&str> = run.iter().map(String::as_str).collect();
    let mut relay_process = RelayProcess::spawn(
        dir.path(),
        "relay",
        &run,
        &[("OUTBOX_RELAY_LOG_LEVEL", "info,outbox_binlog=debug")],
    );
    relay_process
        .wait_for_log("the relay reading", Duration::from_secs(60), READING)
        .await;
    conn.query_drop(
        "INSERT INTO app_events (topic, k, kind, body, created)
           VALUES ('billing', 'acct', 'paid', JSON_OBJECT('n', 1), '2024-12-02 00:40:00.5');
         INSERT INTO app_events (topic, status, body) VALUES ('billing', 'SENT', JSON_OBJECT('n', 98))",
    )
    .await
    .unwrap();
    wait_for_lines("two events", &out, Duration::from_secs(60), |n| n >= 2).await;
    let lines = read_lines(&out);
    let by_n = |n: i64| {
        lines
            .iter()
            .find(|line| line["payload"]["n"] == n)
            .unwrap_or_else(|| panic!("no event {n} in {lines:?}"))
    };
    let adopted = by_n(0);
    assert_eq!(adopted["event_type"], "billing", "{adopted}");
    assert_eq!(adopted["partition_key"], "billing", "{adopted}");
    let read = by_n(1);
    assert_eq!(read["event_type"], "paid", "{read}");
    assert_eq!(read["partition_key"], "acct", "{read}");
    assert_eq!(read["created_at"], "2024-12-02T00:40:00.500000Z", "{read}");
    // Every row is marked once its event is settled (delivered, or dead).
    let marked = [0, 99, 1, 98].map(|n| (n, "SENT".to_string())).to_vec();
    eventually("every row marked SENT", Duration::from_secs(30), || {
        let pool = pool.clone();
        let marked = marked.clone();
        async move {
            let mut conn = pool.get_conn().await.unwrap();
            let statuses: Vec<(i64, String)> = conn
                .query(
                    "SELECT CAST(JSON_VALUE(body, '$.n') AS SIGNED), CAST(status AS CHAR)
                           FROM app_events ORDER BY id",
                )
                .await
                .unwrap();
            (statuses == marked).then_some(())
        }
    })
    .await;
    let dead: Option<String> = conn
        .query_first("SELECT last_error FROM app_events_parked WHERE dead_at IS NOT NULL")
        .await
        .unwrap();
    assert!(
        dead.as_deref()
            .is_some_and(|e| e.contains("partition key is longer")),
        "{dead:?}"
    );
    assert_eq!(
        lines.len(),
        2,
        "no event for a row inserted SENT: {lines:?}"
    );
    assert!(
        relay_process.terminate().await.success(),
        "{}",
        relay_process.logs()
    );
}

/// A MariaDB restart mid-stream (a private server, stopped cleanly and started again on its
/// data): the binlog stream, the seat's lock and every pooled connection are lost while
/// writers go on (they reconnect); the relay reads again from its stored position. Every
/// committed event arrives, each key's first deliveries in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mariadb_restart_mid_stream_loses_nothing_and_keeps_each_keys_commit_order() {
    let (server, mut conn) = private_mariadb("1").await;
    conn.query_drop("CREATE DATABASE shop").await.unwrap();
    drop(conn);
    let db = BinlogDb::at(&shop(&server), &[]).await;
    let url = db.url.clone();
    let out = db.path("out.jsonl");
    let mut relay_process = db.spawn("relay", "out.jsonl", &RETRY_AN_OUTAGE);
    relay_process
        .wait_for_log("the relay reading", Duration::from_secs(60), READING)
        .await;
    let keys = ["a", "b", "c"];
    let writers = KeyWriters::start(&url, &keys);
    let lines = || read_lines(&out).len();
    let more = |n: usize| {
        let target = lines() + n;
        wait_for_lines("more deliveries", &out, Duration::from_secs(60), move |l| {
            l >= target
        })
    };
    more(50).await;
    server.script("restart-mariadb");
    more(50).await;
    let committed = writers.stop().await;
    let files = [out.clone()];
    eventually_explained(
        "every committed event delivered",
        Duration::from_secs(60),
        || relay_process.logs(),
        || {
            let seen: HashSet<String> = read_lines(&files[0])
                .iter()
                .filter_map(|line| line["event_id"].as_str().map(str::to_string))
                .collect();
            let done = committed.iter().flatten().all(|id| seen.contains(id));
            async move { done.then_some(()) }
        },
    )
    .await;
    let mut first = Vec::new();
    let mut seen = HashSet::new();
    for line in read_lines(&out) {
        let id = line["event_id"].as_str().unwrap().to_string();
        if seen.insert(id.clone()) {
            first.push(id);
        }
    }
    for (key, ids) in keys.iter().zip(&committed) {
        let number: HashMap<&String, usize> =
            ids.iter().enumerate().map(|(n, id)| (id, n)).collect();
        let order: Vec<usize> = first
            .iter()
            .filter_map(|id| number.get(id).copied())
            .collect();
        assert!(
            order.windows(2).all(|w| w[0] < w[1]),
            "key {key}: first deliveries out of commit order: {order:?}"
        );
    }
    assert!(
        relay_process
            .logs()
            .contains("binlog capture is not reading"),
        "the restart was noticed: {}",
        relay_process.logs()
    );
    // The log written before the restart ends with a stop event, not a rotate: only the
    // server's artificial rotate names the next file. The position stored since names it.
    eventually_explained(
        "the stored position in the server's current log",
        Duration::from_secs(60),
        || relay_process.logs(),
        || {
            let pool = db.pool.clone();
            async move {
                let mut conn = pool.get_conn().await.ok()?;
                let current: mysql_async::Row =
                    conn.query_first("SHOW MASTER STATUS").await.ok()??;
                let current: String = current.get(0)?;
                let stored: String = conn
                    .query_first("SELECT log_file FROM outbox_binlog")
                    .await
                    .ok()??;
                (stored == current).then_some(())
            }
        },
    )
    .await;
    assert!(
        relay_process.terminate().await.success(),
        "{}",
        relay_process.logs()
    );
    // A relay started again reads on from that position.
    db.write(&["after"], 0, 3, true).await;
    let mut again = db.spawn("relay-again", "out.jsonl", &RETRY_AN_OUTAGE);
    eventually_explained(
        "the events written after the first relay stopped",
        Duration::from_secs(60),
        || again.logs(),
        || {
            let after = read_lines(&out)
                .iter()
                .filter(|line| line["partition_key"] == "after")
                .count();
            async move { (after >= 3).then_some(()) }
        },
    )
    .await;
    assert!(again.terminate().await.success(), "{}", again.logs());
}

/// `outbox_binlog_lag_seconds` says how far behind the reader reads, not how old the last
/// row was: a row written with a `created_at` five minutes back (a backfill, a clock behind)
/// and delivered at once leaves the idle, caught-up relay at ~0. It was set from the last
/// row's `created_at` and only when a row was read, so an idle relay said 300 for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lag_in_seconds_of_a_caught_up_relay_comes_back_to_zero() {
    let db = BinlogDb::new().await;
    let sink = format!("file:{}", db.path("out.jsonl").display());
    let relay = RelayProcess::spawn(
        db.dir.path(),
        "relay-1",
        &[
            "run",
            "--capture",
            "binlog",
            "--database-url",
            &db.url,
            "--sink",
            &sink,
            "--node-id",
            "relay-1",
            "--http-addr",
            "127.0.0.1:0",
            "--log-format",
            "json",
            "--shutdown-timeout",
            "5s",
        ],
        &[("OUTBOX_RELAY_LOG_LEVEL", "info,outbox_binlog=debug")],
    );
    relay
        .wait_for_log("the relay reading", Duration::from_secs(60), READING)
        .await;
    let addr = crate::support::http_addr(&relay).await;
    let mut conn = db.pool.get_conn().await.unwrap();
    conn.query_drop(
        "INSERT INTO outbox (destination, partition_key, event_type, payload, created_at)
         VALUES ('orders', 'a', 'T', JSON_OBJECT('n', 0),
                 UTC_TIMESTAMP(6) - INTERVAL 300 SECOND)",
    )
    .await
    .unwrap();
    wait_for_lines(
        "the row delivered",
        &db.path("out.jsonl"),
        Duration::from_secs(30),
        |n| n >= 1,
    )
    .await;
    let lag = eventually_explained(
        "outbox_binlog_lag_seconds below 60 on the idle relay's /metrics",
        Duration::from_secs(30),
        || relay.logs(),
        || {
            let addr = addr.clone();
            async move {
                let (_, body) = crate::support::http_get(&addr, "/metrics").await?;
                crate::support::metric_value(&body, "outbox_binlog_lag_seconds")
                    .filter(|lag| *lag < 60.0)
            }
        },
    )
    .await;
    assert!(lag >= 0.0, "{lag}");
    let mut relay = relay;
    assert!(relay.terminate().await.success(), "{}", relay.logs());
}
