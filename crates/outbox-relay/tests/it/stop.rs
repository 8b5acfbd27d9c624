//! How the relay stops, and what it says when it cannot do its work (issue 14, items 7-11):
//! SIGTERM ends it within `shutdown_timeout` whatever its broker or database does, `run
//! --drain` exits 0 only when nothing it could deliver is left, and a database that stops
//! answering or a privilege taken away shows in the logs, the metrics and `/readyz`.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use outbox_testkit::{eventually_explained, fresh_pg_database, FaultProxy};

use crate::support::{
    http_addr, http_get, metric_value, pg, read_lines, readyz, relay, RelayProcess, BIN,
};

/// A migrated SQLite outbox in `dir` holding `events` events over 50 keys; its URL.
fn sqlite_outbox(dir: &Path, events: u32) -> String {
    let db = dir.join("outbox.db");
    let url = format!("sqlite:{}", db.display());
    let migrated = relay(dir, &["migrate", "--database-url", &url]);
    assert!(
        migrated.status.success(),
        "{}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    let conn = rusqlite::Connection::open(&db).unwrap();
    conn.execute(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
         INSERT INTO outbox (destination, partition_key, event_type, payload)
         SELECT 'orders', 'k' || (i % 50), 't', json_object('i', i) FROM n",
        [events],
    )
    .unwrap();
    url
}

fn sqlite_pending(dir: &Path) -> i64 {
    rusqlite::Connection::open(dir.join("outbox.db"))
        .unwrap()
        .query_row(
            "SELECT count(*) FROM outbox WHERE delivered_at IS NULL",
            [],
            |r| r.get(0),
        )
        .unwrap()
}

/// A TCP listener on 127.0.0.1 that accepts connections and never says a word.
async fn silent_listener() -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    (format!("nats://{addr}"), task)
}

/// A port nobody listens on.
fn refusing_port() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    format!("nats://127.0.0.1:{port}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_the_relay_within_its_shutdown_timeout_while_nats_is_unreachable() {
    let (silent, listener) = silent_listener().await;
    for (case, broker) in [("refused", refusing_port()), ("silent", silent)] {
        let dir = tempfile::tempdir().unwrap();
        let url = sqlite_outbox(dir.path(), 20);
        let mut relay = RelayProcess::spawn(
            dir.path(),
            case,
            &[
                "run",
                "--database-url",
                &url,
                "--sink",
                &broker,
                "--shutdown-timeout",
                "3s",
                "--http-addr",
                "",
                "--log-format",
                "json",
            ],
            &[],
        );
        // It is trying to publish (and failing) before it is told to stop.
        relay
            .wait_for_log(
                "a publish attempt",
                Duration::from_secs(30),
                "publish failed",
            )
            .await;
        // `terminate` waits up to 30 s: ten times the shutdown timeout, not a speed test.
        let status = relay.terminate().await;
        let logs = relay.logs();
        assert_eq!(status.code(), Some(0), "{case}: {logs}");
        assert!(logs.contains("outbox-relay stopped"), "{case}: {logs}");
        assert_eq!(sqlite_pending(dir.path()), 20, "{case}: nothing was acked");
    }
    listener.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_exits_1_naming_what_is_left_when_the_sink_cannot_write() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_outbox(dir.path(), 3);
    let full = relay(
        dir.path(),
        &[
            "run",
            "--drain",
            "--database-url",
            &url,
            "--sink",
            "file:/dev/full",
            "--http-addr",
            "",
        ],
    );
    let stderr = String::from_utf8_lossy(&full.stderr);
    assert_eq!(full.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("drain incomplete") && stderr.contains("3 events left undelivered"),
        "{stderr}"
    );
    assert!(
        stderr.contains("No space left on device"),
        "names the cause: {stderr}"
    );
    assert_eq!(sqlite_pending(dir.path()), 3);

    // The same outbox drained to a working sink, once the backoff the failure recorded has
    // passed: exit 0, nothing left.
    eventually_explained(
        "the retries to come due",
        Duration::from_secs(30),
        String::new,
        || {
            let due: i64 = rusqlite::Connection::open(dir.path().join("outbox.db"))
                .unwrap()
                .query_row(
                    "SELECT count(*) FROM outbox WHERE available_at >
                       CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)",
                    [],
                    |r| r.get(0),
                )
                .unwrap();
            async move { (due == 0).then_some(()) }
        },
    )
    .await;
    let out = dir.path().join("events.jsonl");
    let ok = relay(
        dir.path(),
        &[
            "run",
            "--drain",
            "--database-url",
            &url,
            "--sink",
            &format!("file:{}", out.display()),
            "--http-addr",
            "",
        ],
    );
    let stderr = String::from_utf8_lossy(&ok.stderr);
    assert_eq!(ok.status.code(), Some(0), "{stderr}");
    assert_eq!(sqlite_pending(dir.path()), 0);
    assert_eq!(read_lines(&out).len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_after_a_drain_killed_mid_way_delivers_everything_or_fails() {
    let dir = tempfile::tempdir().unwrap();
    let total = 30_000;
    let url = sqlite_outbox(dir.path(), total);
    let out = dir.path().join("events.jsonl");
    let sink = format!("file:{}", out.display());
    let args = |extra: &'static [&'static str]| {
        let mut args = vec![
            "run",
            "--drain",
            "--database-url",
            &url,
            "--sink",
            &sink,
            "--http-addr",
            "",
            "--batch-size",
            "100",
            "--lease",
            "4s",
            "--publish-timeout",
            "2s",
        ];
        args.extend_from_slice(extra);
        args.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let first_args = args(&[]);
    let first_args: Vec<&str> = first_args.iter().map(String::as_str).collect();
    let mut first = RelayProcess::spawn(dir.path(), "first", &first_args, &[]);
    eventually_explained(
        "the first drain to deliver some events",
        Duration::from_secs(60),
        || first.logs(),
        || {
            let n = read_lines(&out).len();
            async move { (n > 0).then_some(()) }
        },
    )
    .await;
    // Between one batch's marks and the next claim the drain holds no lease, so it is
    // frozen until it is seen holding some, and only then killed.
    let held_rows = || -> i64 {
        rusqlite::Connection::open(dir.path().join("outbox.db"))
            .unwrap()
            .query_row(
                "SELECT count(*) FROM outbox WHERE delivered_at IS NULL AND locked_by IS NOT NULL",
                [],
                |r| r.get(0),
            )
            .unwrap()
    };
    eventually_explained(
        "the first drain to be frozen holding leases with rows still to deliver",
        Duration::from_secs(60),
        || first.logs(),
        || {
            first.signal("-STOP");
            let pending = sqlite_pending(dir.path());
            assert!(pending > 0, "the first drain finished before it was killed");
            let holding = held_rows() > 0;
            if !holding {
                first.signal("-CONT");
            }
            async move { holding.then_some(()) }
        },
    )
    .await;
    first.kill9();
    let held = held_rows();
    assert!(
        held > 0 && sqlite_pending(dir.path()) > 0,
        "killed mid-drain, with rows under its leases (held {held})"
    );

    let second_args = args(&[]);
    let second_args: Vec<&str> = second_args.iter().map(String::as_str).collect();
    let second = relay(dir.path(), &second_args);
    let stderr = String::from_utf8_lossy(&second.stderr);
    let pending = sqlite_pending(dir.path());
    assert_eq!(
        pending, 0,
        "the dead drain's leases ran out and were claimed: {stderr}"
    );
    assert!(second.status.success(), "{stderr}");
    let delivered: std::collections::HashSet<i64> = read_lines(&out)
        .iter()
        .map(|l| l["sequence_id"].as_i64().unwrap())
        .collect();
    assert_eq!(
        delivered.len(),
        total as usize,
        "every event is in the file"
    );
}

/// `outbox-relay run` against PostgreSQL with JSON logs, HTTP on a free port and a file sink.
fn pg_relay(dir: &Path, name: &str, url: &str, extra: &[&str]) -> RelayProcess {
    let sink = format!("file:{}", dir.join("events.jsonl").display());
    let mut args = vec![
        "run",
        "--http-addr",
        "127.0.0.1:0",
        "--log-format",
        "json",
        "--sink",
        &sink,
    ];
    args.extend_from_slice(extra);
    RelayProcess::spawn(dir, name, &args, &[("DATABASE_URL", url)])
}

/// A fresh PostgreSQL database, migrated by the relay.
async fn migrated_pg_database() -> String {
    let url = fresh_pg_database().await;
    let migrated = Command::new(BIN)
        .args(["migrate"])
        .env("DATABASE_URL", &url)
        .output()
        .unwrap();
    assert!(migrated.status.success());
    url
}

/// Waits for a metric in `/metrics` to satisfy `ok`.
async fn metric(relay: &RelayProcess, addr: &str, name: &str, ok: impl Fn(f64) -> bool) {
    eventually_explained(
        &format!("metric {name}"),
        Duration::from_secs(60),
        || relay.logs(),
        || {
            let addr = addr.to_string();
            let ok = &ok;
            async move {
                let (_, text) = http_get(&addr, "/metrics").await?;
                metric_value(&text, name).filter(|v| ok(*v)).map(|_| ())
            }
        },
    )
    .await
}

async fn error_logged(relay: &RelayProcess, needle: &str) -> String {
    eventually_explained(
        &format!("an error-level log line naming {needle:?}"),
        Duration::from_secs(60),
        || relay.logs(),
        || {
            let line = relay
                .logs()
                .lines()
                .find(|l| l.contains("\"level\":\"ERROR\"") && l.contains(needle))
                .map(String::from);
            async move { line }
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_database_shows_in_the_logs_the_metrics_and_readyz_and_sigterm_still_ends_the_relay(
) {
    let url = migrated_pg_database().await;
    let (proxy, proxied) = FaultProxy::start_for_url(&url).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut relay = pg_relay(
        dir.path(),
        "blackholed",
        &proxied,
        &["--shutdown-timeout", "5s"],
    );
    let addr = http_addr(&relay).await;
    readyz(&relay, &addr, 200, "", Duration::from_secs(60)).await;
    metric(&relay, &addr, "outbox_owned_partitions", |v| v == 64.0).await;

    proxy.blackhole();
    // Within the bounds docs/operations.md states; the test's own deadlines are generous.
    let body = readyz(&relay, &addr, 503, "", Duration::from_secs(60)).await;
    assert!(body.contains("database"), "{body}");
    // It names the operation the database does not answer.
    readyz(
        &relay,
        &addr,
        503,
        "no answer from the database for",
        Duration::from_secs(60),
    )
    .await;
    let line = error_logged(&relay, "no answer from the database").await;
    assert!(line.contains("blackholed"), "{line}");
    metric(&relay, &addr, "outbox_owned_partitions", |v| v == 0.0).await;
    metric(&relay, &addr, "outbox_health_problems", |v| v >= 1.0).await;

    // Stopping while the database is still silent ends within the shutdown timeout.
    let status = relay.terminate().await;
    let logs = relay.logs();
    assert_eq!(status.code(), Some(0), "{logs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_update_on_the_partitions_table_shows_in_the_logs_the_metrics_and_readyz() {
    let url = fresh_pg_database().await;
    let client = pg(&url).await;
    let env = [("DATABASE_URL", url.as_str())];
    let run = |args: &[&str]| {
        let mut c = Command::new(BIN);
        c.args(args);
        for (k, v) in env {
            c.env(k, v);
        }
        c.output().unwrap()
    };
    assert!(run(&["migrate"]).status.success());
    let printed = run(&["migrate", "--print", "--role", "relay_min"]);
    let printed = String::from_utf8(printed.stdout).unwrap();
    let role = format!("relay_{}", uuid::Uuid::new_v4().simple());
    client
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN; {}",
            printed.replace("\"relay_min\"", &role)
        ))
        .await
        .unwrap();
    let role_url = url.replacen("postgres@", &format!("{role}@"), 1);
    let dir = tempfile::tempdir().unwrap();
    let mut relay = pg_relay(dir.path(), "revoked", &role_url, &[]);
    let addr = http_addr(&relay).await;
    readyz(&relay, &addr, 200, "", Duration::from_secs(60)).await;
    metric(&relay, &addr, "outbox_owned_partitions", |v| v == 64.0).await;

    client
        .batch_execute(&format!("REVOKE UPDATE ON outbox_partitions FROM {role}"))
        .await
        .unwrap();
    let body = readyz(
        &relay,
        &addr,
        503,
        "partition leases",
        Duration::from_secs(60),
    )
    .await;
    assert!(body.contains("permission denied"), "{body}");
    assert!(body.contains("migrate --print"), "names the fix: {body}");
    let line = error_logged(&relay, "outbox_partitions").await;
    assert!(line.contains("grant"), "{line}");
    metric(&relay, &addr, "outbox_owned_partitions", |v| v == 0.0).await;
    let body = readyz(&relay, &addr, 503, "", Duration::from_secs(60)).await;
    assert!(body.contains("holds none of the 64 partitions"), "{body}");

    // Restored, the node takes its partitions again and turns ready.
    client
        .batch_execute(&format!("GRANT UPDATE ON outbox_partitions TO {role}"))
        .await
        .unwrap();
    readyz(&relay, &addr, 200, "", Duration::from_secs(60)).await;
    metric(&relay, &addr, "outbox_owned_partitions", |v| v == 64.0).await;
    let status = relay.terminate().await;
    assert_eq!(status.code(), Some(0), "{}", relay.logs());
}

/// A smart shutdown (`pg_ctl stop -m smart`) refuses new connections, then waits for every
/// client session to end on its own: the relay's pooled connections and its LISTEN session
/// held it for good. The relay now lets them go while the server refuses a probe, and
/// reconnects once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_smart_shutdown_of_postgresql_is_not_held_by_a_polling_relay() {
    let dir = tempfile::tempdir().unwrap();
    // Never the shared server: this one is stopped.
    let server = crate::support::OwnPostgres::init();
    server.start("");
    let url = server.url("disable");
    let migrated = relay(dir.path(), &["migrate", "--database-url", &url]);
    assert!(
        migrated.status.success(),
        "{}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    let mut relay = pg_relay(dir.path(), "relay", &url, &[]);
    let out = dir.path().join("events.jsonl");
    let insert = |n: i32| {
        let url = url.clone();
        async move {
            pg(&url)
                .await
                .execute(
                    "INSERT INTO outbox (destination, partition_key, event_type, payload)
                     VALUES ('orders', 'k', 'Inserted', jsonb_build_object('n', $1::int))",
                    &[&n],
                )
                .await
                .unwrap();
        }
    };
    insert(1).await;
    wait_for_delivered(&relay, &out, 1).await;
    server.assert_a_smart_shutdown_is_not_held(&relay);
    server.resume_and_await(&relay).await;
    // Its LISTEN session begins again.
    eventually_explained(
        "a LISTEN session",
        Duration::from_secs(60),
        || relay.logs(),
        || {
            let url = url.clone();
            async move {
                let listening: i64 = pg(&url)
                    .await
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN %'",
                        &[],
                    )
                    .await
                    .ok()?
                    .get(0);
                (listening > 0).then_some(())
            }
        },
    )
    .await;
    insert(2).await;
    wait_for_delivered(&relay, &out, 2).await;
    let status = relay.terminate().await;
    assert_eq!(status.code(), Some(0), "{}", relay.logs());
}

/// Waits until `out` holds `n` deliveries.
async fn wait_for_delivered(relay: &RelayProcess, out: &Path, n: usize) {
    eventually_explained(
        &format!("{n} delivered"),
        Duration::from_secs(60),
        || relay.logs(),
        || {
            let done = read_lines(out).len() >= n;
            async move { done.then_some(()) }
        },
    )
    .await;
}

/// An idle relay whose sink is down: `/readyz` said so, but only its own look did; the log
/// had no "relay unhealthy" line and `outbox_health_problems` stayed 0, as if all were well.
/// The health watcher now looks at the database and the sink itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_found_down_shows_in_the_log_and_the_metrics_as_in_readyz() {
    let url = migrated_pg_database().await;
    let dir = tempfile::tempdir().unwrap();
    let sink = format!(
        "http://127.0.0.1:{}/hook",
        outbox_testkit::server::free_port()
    );
    let relay = RelayProcess::spawn(
        dir.path(),
        "sink-down",
        &[
            "run",
            "--http-addr",
            "127.0.0.1:0",
            "--log-format",
            "json",
            "--sink",
            &sink,
        ],
        &[("DATABASE_URL", url.as_str())],
    );
    let addr = http_addr(&relay).await;
    let line = error_logged(&relay, "relay unhealthy").await;
    assert!(line.contains("\"check\":\"sink\""), "{line}");
    metric(&relay, &addr, "outbox_health_problems", |v| v >= 1.0).await;
    let body = readyz(&relay, &addr, 503, "", Duration::from_secs(60)).await;
    assert!(body.contains("not ready"), "{body}");
}
