//! End-to-end tests of the `outbox-relay` binary against real PostgreSQL and SQLite.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_testkit::{eventually, fresh_pg_database, query_count, wait_for_count};
use uuid::Uuid;

use crate::support::{http_addr, pg, read_lines, wait_for_lines, RelayProcess, BIN};

/// `outbox-relay run` with JSON logs and no HTTP server, against `database_url`.
fn start_relay(dir: &Path, name: &str, database_url: &str, args: &[&str]) -> RelayProcess {
    let mut all = vec!["run", "--http-addr", "", "--log-format", "json"];
    all.extend_from_slice(args);
    RelayProcess::spawn(dir, name, &all, &[("DATABASE_URL", database_url)])
}

/// `run --drain` to a file: its output, and how many events the file got.
fn drain_to_a_file(database_url: &str) -> (std::process::Output, usize) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("events.jsonl");
    let sink = format!("file:{}", out.display());
    let run = relay_cmd(
        database_url,
        &["run", "--drain", "--http-addr", "", "--sink", &sink],
    );
    (run, read_lines(&out).len())
}

fn relay_cmd(database_url: &str, args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(args)
        .env("DATABASE_URL", database_url)
        .output()
        .expect("run outbox-relay")
}

#[derive(Clone, Debug)]
struct Committed {
    key: String,
    sequence_id: i64,
}

/// Checks a delivery log: every committed event present, no rolled-back one, per key the
/// first deliveries in sequence order. Returns the number of duplicates.
fn verify_deliveries(
    lines: &[serde_json::Value],
    committed: &HashMap<String, Committed>,
    rolled_back: &HashSet<String>,
) -> usize {
    let mut seen = HashSet::new();
    let mut duplicates = 0;
    let mut last_by_key: HashMap<String, i64> = HashMap::new();
    for line in lines {
        let id = line["event_id"].as_str().unwrap().to_string();
        assert!(
            !rolled_back.contains(&id),
            "rolled-back event {id} was published"
        );
        let Some(c) = committed.get(&id) else {
            panic!("unknown event {id} was published")
        };
        assert_eq!(line["sequence_id"].as_i64().unwrap(), c.sequence_id);
        if !seen.insert(id) {
            duplicates += 1;
            continue;
        }
        if let Some(prev) = last_by_key.insert(c.key.clone(), c.sequence_id) {
            assert!(
                prev < c.sequence_id,
                "key {} delivered {} before {}",
                c.key,
                prev,
                c.sequence_id
            );
        }
    }
    let missing: Vec<_> = committed.keys().filter(|id| !seen.contains(*id)).collect();
    assert!(
        missing.is_empty(),
        "{} committed events never delivered, e.g. {:?}",
        missing.len(),
        missing.first()
    );
    duplicates
}

/// Writer `w` owns keys `w-0..w-9` and commits transactions of 1-4 events one after another,
/// rolling back every fifth.
async fn writer(
    url: String,
    w: usize,
    transactions: usize,
    committed: Arc<Mutex<HashMap<String, Committed>>>,
    rolled_back: Arc<Mutex<HashSet<String>>>,
    progress: Arc<AtomicUsize>,
) {
    let mut client = pg(&url).await;
    let mut rng = fastrand::Rng::with_seed(w as u64);
    for t in 0..transactions {
        let tx = client.transaction().await.unwrap();
        let mut rows = Vec::new();
        for _ in 0..rng.usize(1..=4) {
            let id = Uuid::new_v4();
            let key = format!("{w}-{}", rng.usize(0..10));
            let row = tx
                .query_one(
                    "INSERT INTO outbox (event_id, destination, partition_key, event_type, payload)
                     VALUES ($1, 'orders', $2, 'created', jsonb_build_object('w', $3::int, 't', $4::int))
                     RETURNING sequence_id",
                    &[&id, &key, &(w as i32), &(t as i32)],
                )
                .await
                .unwrap();
            rows.push((
                id.to_string(),
                Committed {
                    key,
                    sequence_id: row.get(0),
                },
            ));
        }
        if t % 5 == 4 {
            tx.rollback().await.unwrap();
            rolled_back
                .lock()
                .unwrap()
                .extend(rows.into_iter().map(|(id, _)| id));
        } else {
            tx.commit().await.unwrap();
            committed.lock().unwrap().extend(rows);
        }
        progress.fetch_add(1, Ordering::Relaxed);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_stream_loses_nothing_and_keeps_per_key_order() {
    let url = fresh_pg_database().await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("events.jsonl");
    let sink = format!("file:{}", out.display());
    assert!(relay_cmd(&url, &["migrate"]).status.success());
    let args = [
        "--sink",
        &sink,
        "--lease",
        "1s",
        "--publish-timeout",
        "700ms",
        "--batch-size",
        "50",
        "--poll-interval",
        "200ms",
    ];
    let mut first = start_relay(dir.path(), "first", &url, &args);

    let committed = Arc::new(Mutex::new(HashMap::new()));
    let rolled_back = Arc::new(Mutex::new(HashSet::new()));
    let progress = Arc::new(AtomicUsize::new(0));
    let (writers, per_writer) = (4, 150);
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            tokio::spawn(writer(
                url.clone(),
                w,
                per_writer,
                committed.clone(),
                rolled_back.clone(),
                progress.clone(),
            ))
        })
        .collect();

    // Crash the first relay once it has published part of the stream.
    wait_for_lines(
        "the first relay to publish",
        &out,
        Duration::from_secs(30),
        |n| n >= 100,
    )
    .await;
    first.kill9();
    let mut second = start_relay(dir.path(), "second", &url, &args);
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(progress.load(Ordering::Relaxed), writers * per_writer);
    let committed = committed.lock().unwrap().clone();
    let rolled_back = rolled_back.lock().unwrap().clone();
    eventually(
        "every committed event to be delivered",
        Duration::from_secs(60),
        || {
            let delivered: HashSet<String> = read_lines(&out)
                .iter()
                .map(|l| l["event_id"].as_str().unwrap().to_string())
                .collect();
            let done = committed.keys().all(|id| delivered.contains(id));
            async move { done.then_some(()) }
        },
    )
    .await;
    // A row the killed relay published but never acked is in the file already; the second
    // relay acks it once it takes the row over (after the killed relay's lease).
    let client = pg(&url).await;
    wait_for_count(
        "every row acked",
        &client,
        "SELECT count(*) FROM outbox",
        0,
        Duration::from_secs(60),
    )
    .await;

    let status = second.terminate().await;
    assert!(
        status.success(),
        "exit status {status:?}; logs:\n{}",
        second.logs()
    );
    let duplicates = verify_deliveries(&read_lines(&out), &committed, &rolled_back);
    eprintln!(
        "{} events, {} duplicates after kill -9",
        committed.len(),
        duplicates
    );

    let nodes = query_count(&client, "SELECT count(*) FROM outbox_nodes", &[])
        .await
        .unwrap();
    assert!(
        nodes <= 1,
        "only the killed node's row may remain until it expires"
    );
    assert!(
        second.logs().contains("deregistered"),
        "graceful shutdown deregisters"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_releases_leases_and_exits_zero() {
    let url = fresh_pg_database().await;
    let dir = tempfile::tempdir().unwrap();
    let client = pg(&url).await;
    assert!(relay_cmd(&url, &["migrate"]).status.success());
    client
        .batch_execute(
            "INSERT INTO outbox (destination, partition_key, event_type, payload)
             SELECT 'orders', 'k' || (i % 20), 'created', jsonb_build_object('i', i) FROM generate_series(1, 3000) i",
        )
        .await
        .unwrap();
    // A slow sink: a FIFO nobody reads would block forever; use a file and stop mid-drain.
    let out = dir.path().join("events.jsonl");
    let sink = format!("file:{}", out.display());
    let mut relay = start_relay(
        dir.path(),
        "relay",
        &url,
        &["--sink", &sink, "--batch-size", "100", "--lease", "1h"],
    );
    wait_for_lines("publishing to start", &out, Duration::from_secs(30), |n| {
        n > 0
    })
    .await;
    let status = relay.terminate().await;
    assert!(status.success(), "{}", relay.logs());
    let leased = query_count(
        &client,
        "SELECT count(*) FROM outbox WHERE locked_by IS NOT NULL",
        &[],
    )
    .await
    .unwrap();
    assert_eq!(
        leased, 0,
        "a graceful stop releases every lease (the lease here is 1h)"
    );
    let nodes = query_count(&client, "SELECT count(*) FROM outbox_nodes", &[])
        .await
        .unwrap();
    assert_eq!(nodes, 0, "a graceful stop deregisters");
    // A new relay picks the rest up at once and delivers everything exactly once overall
    // (nothing was lost or left leased).
    let status = relay_cmd(
        &url,
        &["run", "--drain", "--http-addr", "", "--sink", &sink],
    );
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let ids: Vec<String> = read_lines(&out)
        .iter()
        .map(|l| l["event_id"].as_str().unwrap().to_string())
        .collect();
    let unique: HashSet<_> = ids.iter().collect();
    assert_eq!(unique.len(), 3000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_wakes_the_relay_and_survives_a_killed_listen_connection() {
    let url = fresh_pg_database().await;
    let dir = tempfile::tempdir().unwrap();
    let client = pg(&url).await;
    assert!(relay_cmd(&url, &["migrate"]).status.success());
    let out = dir.path().join("events.jsonl");
    let sink = format!("file:{}", out.display());
    // The safety poll is an hour away: only NOTIFY can deliver these promptly.
    let mut relay = start_relay(
        dir.path(),
        "relay",
        &url,
        &["--sink", &sink, "--poll-interval", "1h"],
    );
    let insert = "INSERT INTO outbox (destination, event_type, payload) VALUES ('d', 't', '1')";
    let listening = "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN%' AND datname = current_database()";
    eventually("the relay to LISTEN", Duration::from_secs(30), || {
        let client = &client;
        async move {
            (client
                .query_one(listening, &[])
                .await
                .unwrap()
                .get::<_, i64>(0)
                == 1)
                .then_some(())
        }
    })
    .await;
    client.batch_execute(insert).await.unwrap();
    wait_for_lines(
        "a NOTIFY-driven delivery",
        &out,
        Duration::from_secs(20),
        |n| n == 1,
    )
    .await;
    // Kill the LISTEN connection; insert while the relay reconnects.
    client
        .batch_execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE 'LISTEN%' AND datname = current_database()")
        .await
        .unwrap();
    client.batch_execute(insert).await.unwrap();
    wait_for_lines(
        "delivery after the LISTEN connection came back",
        &out,
        Duration::from_secs(20),
        |n| n == 2,
    )
    .await;
    assert!(
        relay.logs().contains("LISTEN connection lost"),
        "{}",
        relay.logs()
    );
    assert!(relay.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_rate_polling_and_the_safety_poll_work_without_the_trigger() {
    let url = fresh_pg_database().await;
    let dir = tempfile::tempdir().unwrap();
    let client = pg(&url).await;
    assert!(relay_cmd(&url, &["migrate"]).status.success());
    client
        .batch_execute("DROP TRIGGER outbox_trigger ON outbox")
        .await
        .unwrap();
    for (name, extra) in [("fixed", vec!["--poll-fixed-rate"]), ("safety", vec![])] {
        let out = dir.path().join(format!("{name}.jsonl"));
        let sink = format!("file:{}", out.display());
        let mut args = vec!["--sink", sink.as_str(), "--poll-interval", "100ms"];
        args.extend(extra);
        let mut relay = start_relay(dir.path(), name, &url, &args);
        client
            .batch_execute(
                "INSERT INTO outbox (destination, event_type, payload) VALUES ('d', 't', '1')",
            )
            .await
            .unwrap();
        wait_for_lines(
            "a poll-driven delivery",
            &out,
            Duration::from_secs(20),
            |n| n == 1,
        )
        .await;
        assert!(relay.terminate().await.success());
        if name == "safety" {
            assert!(
                relay.logs().contains("trigger"),
                "the missing trigger is reported: {}",
                relay.logs()
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_privileged_role_from_migrate_print_is_enough() {
    let url = fresh_pg_database().await;
    let client = pg(&url).await;
    assert!(relay_cmd(&url, &["migrate"]).status.success());
    let printed = relay_cmd(&url, &["migrate", "--print", "--role", "relay_min"]);
    let printed = String::from_utf8(printed.stdout).unwrap();
    assert!(printed.contains("ON \"public\".\"outbox\" TO"), "{printed}");
    // Applied whole, as `psql -f` would (the DDL again is a no-op).
    let role = format!("relay_{}", Uuid::new_v4().simple());
    client
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN; {}",
            printed.replace("\"relay_min\"", &role)
        ))
        .await
        .unwrap();
    client
        .batch_execute(
            "INSERT INTO outbox (destination, event_type, payload) SELECT 'd', 't', to_jsonb(i) FROM generate_series(1, 50) i;
             INSERT INTO outbox (destination, event_type, payload, headers) VALUES ('d', 't', '1', '[1]');",
        )
        .await
        .unwrap();
    let role_url = url.replacen("postgres@", &format!("{role}@"), 1);
    let check = relay_cmd(&role_url, &["check"]);
    let text = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "{text}");
    let (run, delivered) = drain_to_a_file(&role_url);
    // The drain dead-lettered the undecodable row, so it reports failure (exit 1).
    let log = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{log}");
    assert!(log.contains("1 events were dead-lettered"), "{log}");
    assert_eq!(delivered, 50);
    assert!(
        !log.contains("scan the pending rows from the start"),
        "the granted role can use the scan floor: {log}"
    );
    let dead = query_count(&client, "SELECT count(*) FROM outbox_dead_letters", &[])
        .await
        .unwrap();
    assert_eq!(
        dead, 1,
        "the undecodable row was dead-lettered by the minimal role"
    );

    // Without DELETE, `check` names the privilege and the fix, and `run` refuses to start.
    client
        .batch_execute(&format!("REVOKE DELETE ON outbox FROM {role}"))
        .await
        .unwrap();
    let check = relay_cmd(&role_url, &["check"]);
    let text = String::from_utf8_lossy(&check.stdout);
    assert!(!check.status.success());
    assert!(
        text.contains("lacks DELETE on public.outbox") && text.contains("GRANT DELETE"),
        "{text}"
    );
    let run = relay_cmd(&role_url, &["run", "--drain", "--http-addr", ""]);
    assert!(!run.status.success());
    assert!(String::from_utf8_lossy(&run.stderr).contains("GRANT DELETE"));
}

/// `migrate --grant-to ROLE`, run as the tables' owner (a Kubernetes Job's own role), gives
/// the relays' role what it needs: it checks and drains. Without it, the tables the owner
/// made were out of the relays' reach, and they exited on the privilege for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_grants_the_relays_role_what_it_needs() {
    let url = fresh_pg_database().await;
    let client = pg(&url).await;
    let role = format!("relay_{}", Uuid::new_v4().simple());
    client
        .batch_execute(&format!("CREATE ROLE {role} LOGIN"))
        .await
        .unwrap();
    let role_url = url.replacen("postgres@", &format!("{role}@"), 1);
    assert!(relay_cmd(&url, &["migrate"]).status.success());
    let check = relay_cmd(&role_url, &["check"]);
    assert!(!check.status.success(), "no grants yet");

    let migrated = relay_cmd(&url, &["migrate", "--grant-to", &role]);
    let said = String::from_utf8_lossy(&migrated.stdout);
    assert!(migrated.status.success(), "{said}{migrated:?}");
    assert!(
        said.contains(&format!("granted: what the relay needs, to {role}")),
        "{said}"
    );
    let sent = relay_cmd(&url, &["send", "--destination", "d", "{}"]);
    assert!(sent.status.success(), "{sent:?}");
    let check = relay_cmd(&role_url, &["check"]);
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );
    let (run, delivered) = drain_to_a_file(&role_url);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(delivered, 1);

    // A role that does not exist: the migration applies, the grant fails, naming it.
    let missing = relay_cmd(&url, &["migrate", "--grant-to", "no_such_role"]);
    assert_eq!(missing.status.code(), Some(1));
    let said = String::from_utf8_lossy(&missing.stderr);
    assert!(
        said.contains("granting no_such_role failed") && said.contains("must exist"),
        "{said}"
    );
    // A name that is no identifier: refused before anything runs.
    let bad = relay_cmd(
        &url,
        &["migrate", "--grant-to", "x\"; DROP TABLE outbox; --"],
    );
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    client.batch_execute("SELECT 1 FROM outbox").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_tables_fail_with_the_fix_and_auto_migrate_creates_them() {
    let url = fresh_pg_database().await;
    let run = relay_cmd(&url, &["run", "--drain", "--http-addr", ""]);
    // `migrate` is the fix, not a restart: exit 2, on which systemd does not restart.
    assert_eq!(run.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        stderr.contains("does not exist") && stderr.contains("outbox-relay migrate"),
        "{stderr}"
    );
    let run = relay_cmd(
        &url,
        &["run", "--drain", "--auto-migrate", "--http-addr", ""],
    );
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        relay_cmd(&url, &["migrate"]).status.success(),
        "migrate is idempotent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retain_delivered_marks_rows_instead_of_deleting() {
    let url = fresh_pg_database().await;
    let client = pg(&url).await;
    assert!(relay_cmd(&url, &["migrate"]).status.success());
    let send = relay_cmd(
        &url,
        &[
            "send",
            "--destination",
            "d",
            "--key",
            "k",
            "--header",
            "trace=1",
            "{\"a\":1}",
        ],
    );
    assert!(
        send.status.success(),
        "{}",
        String::from_utf8_lossy(&send.stderr)
    );
    let run = relay_cmd(
        &url,
        &["run", "--drain", "--retain-delivered", "--http-addr", ""],
    );
    assert!(run.status.success());
    let line: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(line["headers"]["trace"], "1");
    assert_eq!(line["partition_key"], "k");
    let row = client
        .query_one(
            "SELECT delivered_at IS NOT NULL, locked_by IS NULL FROM outbox",
            &[],
        )
        .await
        .unwrap();
    assert!(row.get::<_, bool>(0) && row.get::<_, bool>(1));
    let again = relay_cmd(
        &url,
        &["run", "--drain", "--retain-delivered", "--http-addr", ""],
    );
    assert!(again.stdout.is_empty(), "delivered rows are not sent again");
}

#[test]
fn errors_name_the_problem_and_never_show_secrets() {
    let bad = relay_cmd(
        "postgres://postgres:hunter2@127.0.0.1:1/nowhere",
        &["run", "--drain", "--http-addr", ""],
    );
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(bad.status.code(), Some(1));
    assert!(
        stderr.contains("cannot use postgres://postgres:***@127.0.0.1:1/nowhere"),
        "{stderr}"
    );
    assert!(!stderr.contains("hunter2"), "{stderr}");

    let bad = relay_cmd("sqlite:x.db", &["run", "--batch-size", "0"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("batch_size must be between"));

    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite:{}", dir.path().join("o.db").display());
    let bad = relay_cmd(
        &db,
        &[
            "run",
            "--drain",
            "--http-addr",
            "",
            "--sink",
            "carrier-pigeon://x",
        ],
    );
    assert!(String::from_utf8_lossy(&bad.stderr).contains("use stdout, file:PATH, nats://"));
    let bad = relay_cmd(&db, &["send", "--destination", "d", "{not json"]);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not valid JSON"));
}

/// `worker_threads` sizes the runtime that runs the relay's tasks, one worker by default: the
/// start-up line reports the runtime's own count.
#[tokio::test]
async fn worker_threads_sets_how_many_threads_run_the_relay() {
    for (flag, workers) in [(None, 1), (Some("3"), 3)] {
        let dir = tempfile::tempdir().unwrap();
        let mut args = vec!["run", "--http-addr", "127.0.0.1:0", "--log-format", "json"];
        if let Some(n) = flag {
            args.extend(["--worker-threads", n]);
        }
        let mut relay = RelayProcess::spawn(dir.path(), "relay", &args, &[]);
        http_addr(&relay).await;
        let logs = relay.logs();
        let starting: serde_json::Value = logs
            .lines()
            .find(|l| l.contains("outbox-relay starting"))
            .and_then(|l| serde_json::from_str(l).ok())
            .unwrap_or_else(|| panic!("no start-up line: {logs}"));
        assert_eq!(starting["worker_threads"], workers, "{flag:?}: {starting}");
        assert!(relay.terminate().await.success());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_config_sqlite_relays_events_sent_from_another_process() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run.stdout");
    let err = dir.path().join("run.stderr");
    let mut relay = Command::new(BIN)
        .args(["run", "--http-addr", "127.0.0.1:0"])
        .env_remove("DATABASE_URL")
        .current_dir(dir.path())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    for i in 0..20 {
        let sent = Command::new(BIN)
            .args([
                "send",
                "--destination",
                "greetings",
                "--key",
                &format!("k{}", i % 3),
                &format!("{{\"i\":{i}}}"),
            ])
            .env_remove("DATABASE_URL")
            .current_dir(dir.path())
            .output()
            .unwrap();
        assert!(
            sent.status.success(),
            "{}",
            String::from_utf8_lossy(&sent.stderr)
        );
    }
    assert!(dir.path().join("outbox.db").exists());
    // On failure the relay's log says why.
    let relay_log = || std::fs::read_to_string(&err).unwrap_or_default();
    let lines = outbox_testkit::eventually_explained(
        "all 20 events on stdout",
        Duration::from_secs(30),
        relay_log,
        || {
            let lines = read_lines(&out);
            assert!(lines.len() <= 20, "more than 20 events: {lines:?}");
            if let Some(status) = relay.try_wait().unwrap() {
                panic!(
                    "the relay exited ({status}) after {} events:\n{}",
                    lines.len(),
                    relay_log()
                );
            }
            async move { (lines.len() == 20).then_some(lines) }
        },
    )
    .await;
    let mut last: HashMap<String, i64> = HashMap::new();
    for l in &lines {
        let seq = l["sequence_id"].as_i64().unwrap();
        if let Some(prev) = last.insert(l["partition_key"].as_str().unwrap().into(), seq) {
            assert!(prev < seq);
        }
    }
    Command::new("kill")
        .args(["-TERM", &relay.id().to_string()])
        .status()
        .unwrap();
    let status = eventually("exit", Duration::from_secs(30), || {
        let s = relay.try_wait().unwrap();
        async move { s }
    })
    .await;
    assert!(status.success());
}

/// `verify-ca` verifies the chain but not the host name, `verify-full` both: reached under a
/// name its certificate does not carry (`hostaddr` gives the address), the server passes the
/// first and fails the second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_ca_checks_the_chain_but_not_the_host_name() {
    let url = fresh_pg_database().await;
    let ca = std::env::var("OUTBOX_TEST_PG_CA").expect("OUTBOX_TEST_PG_CA from scripts/servers.sh");
    assert!(relay_cmd(&url, &["migrate"]).status.success());
    let renamed = url.replacen("@127.0.0.1:", "@db.invalid:", 1);
    assert_ne!(renamed, url, "the test database URL names 127.0.0.1: {url}");
    let check = |sslmode: &str| {
        let url = format!("{renamed}?hostaddr=127.0.0.1&sslmode={sslmode}");
        relay_cmd(&url, &["check", "--database-ca-file", &ca])
    };
    let chain_only = check("verify-ca");
    assert!(
        chain_only.status.success(),
        "{}{}",
        String::from_utf8_lossy(&chain_only.stdout),
        String::from_utf8_lossy(&chain_only.stderr)
    );
    let full = check("verify-full");
    let report = String::from_utf8_lossy(&full.stdout);
    assert!(
        !full.status.success() && report.contains("not valid for name"),
        "the name is not the certificate's: {report}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_tls_is_verified_against_the_configured_ca() {
    let url = fresh_pg_database().await;
    let ca = std::env::var("OUTBOX_TEST_PG_CA").expect("OUTBOX_TEST_PG_CA from scripts/servers.sh");
    let client = pg(&url).await;
    assert!(relay_cmd(&url, &["migrate"]).status.success());
    let tls_url = format!("{url}?sslmode=verify-full&application_name=outbox_tls_test");

    // Without the test CA the server's certificate is not trusted, and the error says so.
    let untrusted = relay_cmd(&tls_url, &["check"]);
    assert!(!untrusted.status.success());
    let text = String::from_utf8_lossy(&untrusted.stdout);
    assert!(
        text.contains("cannot connect") && text.to_lowercase().contains("certificate"),
        "{text}"
    );

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("events.jsonl");
    let sink = format!("file:{}", out.display());
    let mut relay = start_relay(
        dir.path(),
        "tls",
        &tls_url,
        &["--database-ca-file", &ca, "--sink", &sink],
    );
    client
        .batch_execute(
            "INSERT INTO outbox (destination, event_type, payload) VALUES ('d', 't', '1')",
        )
        .await
        .unwrap();
    wait_for_lines("delivery over TLS", &out, Duration::from_secs(20), |n| {
        n == 1
    })
    .await;
    let row = client
        .query_one(
            "SELECT count(*), bool_and(s.ssl) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
              WHERE a.application_name = 'outbox_tls_test'",
            &[],
        )
        .await
        .unwrap();
    assert!(
        row.get::<_, i64>(0) > 0,
        "the relay's connections are visible"
    );
    assert_eq!(
        row.get::<_, Option<bool>>(1),
        Some(true),
        "every relay connection uses TLS"
    );
    assert!(relay.terminate().await.success());
}

/// A password holding an unescaped `?` (tokio-postgres reads it as the password's): the
/// relay split the URL at that `?`, lost the real query's `sslmode`, and connected as
/// `prefer`, in plaintext to a server that declines TLS, while `check` said ok. Here
/// `verify-full` must check the certificate: refused without the CA, accepted with it.
/// (Before, both ended in "invalid value for option sslmode".) The test server trusts
/// local connections, so the password is never checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sslmode_of_a_url_whose_password_holds_a_question_mark_is_kept() {
    let url = fresh_pg_database().await;
    let ca = std::env::var("OUTBOX_TEST_PG_CA").expect("OUTBOX_TEST_PG_CA from scripts/servers.sh");
    assert!(relay_cmd(&url, &["migrate"]).status.success());
    let with_password = url.replacen("postgres@", "postgres:Pw?x12@", 1);
    assert_ne!(with_password, url, "the test URL names the postgres user");
    let tls_url = format!("{with_password}?sslmode=verify-full");
    let untrusted = relay_cmd(&tls_url, &["check"]);
    let text = String::from_utf8_lossy(&untrusted.stdout).to_string()
        + &String::from_utf8_lossy(&untrusted.stderr);
    assert!(!untrusted.status.success(), "{text}");
    assert!(text.to_lowercase().contains("certificate"), "{text}");
    let trusted = relay_cmd(&tls_url, &["check", "--database-ca-file", &ca]);
    let text = String::from_utf8_lossy(&trusted.stdout).to_string()
        + &String::from_utf8_lossy(&trusted.stderr);
    assert!(trusted.status.success(), "{text}");
    assert!(
        !text.contains("Pw?x12"),
        "the password is not shown: {text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restart_mid_run_loses_nothing() {
    // A server of this test's own, so restarting it disturbs no other test.
    let server = outbox_testkit::server::ScriptedServer::start("postgres", "OUTBOX_TEST_PG_PORT");
    let url = format!("postgres://postgres@127.0.0.1:{}/postgres", server.port);
    let dir = tempfile::tempdir().unwrap();
    assert!(relay_cmd(&url, &["migrate"]).status.success());
    let out = dir.path().join("events.jsonl");
    let sink = format!("file:{}", out.display());
    let mut relay = start_relay(
        dir.path(),
        "relay",
        &url,
        &["--sink", &sink, "--poll-interval", "300ms"],
    );
    let insert = |from: i32| {
        let url = url.clone();
        async move {
            pg(&url)
                .await
                .batch_execute(&format!(
                    "INSERT INTO outbox (destination, partition_key, event_type, payload)
                     SELECT 'd', 'k' || (i % 7), 't', to_jsonb(i) FROM generate_series({from}, {from} + 99) i"
                ))
                .await
                .unwrap()
        }
    };
    insert(1).await;
    wait_for_lines("the first events", &out, Duration::from_secs(30), |n| n > 0).await;
    server.script("restart-postgres");
    insert(101).await;
    let lines = eventually(
        "all 200 events after the restart",
        Duration::from_secs(60),
        || {
            let lines = read_lines(&out);
            let unique: HashSet<String> = lines
                .iter()
                .map(|l| l["event_id"].as_str().unwrap().to_string())
                .collect();
            async move { (unique.len() == 200).then_some(lines) }
        },
    )
    .await;
    let mut last: HashMap<String, i64> = HashMap::new();
    let mut seen = HashSet::new();
    for l in &lines {
        if !seen.insert(l["event_id"].as_str().unwrap().to_string()) {
            continue;
        }
        let seq = l["sequence_id"].as_i64().unwrap();
        if let Some(prev) = last.insert(l["partition_key"].as_str().unwrap().into(), seq) {
            assert!(prev < seq, "order broke across the restart");
        }
    }
    assert!(relay.terminate().await.success(), "{}", relay.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gated_wakeup_notifies_only_a_waiting_relay_and_loses_nothing_under_concurrent_writers() {
    let url = fresh_pg_database().await;
    let dir = tempfile::tempdir().unwrap();
    let client = pg(&url).await;
    assert!(relay_cmd(&url, &["migrate", "--wakeup", "gated"])
        .status
        .success());
    let body: String = client
        .query_one(
            "SELECT prosrc FROM pg_proc WHERE proname = 'outbox_notify'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(body.contains("pg_try_advisory_xact_lock_shared"), "{body}");
    let out = dir.path().join("events.jsonl");
    let sink = format!("file:{}", out.display());
    // The safety poll is an hour away: only the gate's NOTIFY or its own polling delivers.
    let mut relay = start_relay(
        dir.path(),
        "relay",
        &url,
        &[
            "--sink",
            &sink,
            "--poll-interval",
            "1h",
            "--wakeup",
            "gated",
        ],
    );
    let waiting = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND mode = 'ExclusiveLock'";
    eventually(
        "the waiting relay to hold the gate",
        Duration::from_secs(30),
        || {
            let client = &client;
            async move {
                (client
                    .query_one(waiting, &[])
                    .await
                    .unwrap()
                    .get::<_, i64>(0)
                    == 1)
                    .then_some(())
            }
        },
    )
    .await;
    client
        .batch_execute(
            "INSERT INTO outbox (destination, event_type, payload) VALUES ('d', 't', '1')",
        )
        .await
        .unwrap();
    wait_for_lines(
        "a gated NOTIFY delivery",
        &out,
        Duration::from_secs(20),
        |n| n == 1,
    )
    .await;
    // Four writers at once, 250 single-row transactions each.
    let mut writers = Vec::new();
    for w in 0..4 {
        let client = pg(&url).await;
        writers.push(tokio::spawn(async move {
            for i in 0..250 {
                client
                    .execute(
                        "INSERT INTO outbox (destination, partition_key, event_type, payload) VALUES ('d', $1, 't', '1')",
                        &[&format!("w{w}-{}", i % 10)],
                    )
                    .await
                    .unwrap();
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    wait_for_lines(
        "every event delivered",
        &out,
        Duration::from_secs(30),
        |n| n == 1001,
    )
    .await;
    assert!(relay.terminate().await.success());
}

/// A webhook that answers every request with the status `status` holds, and counts them.
async fn webhook_answering(
    status: Arc<std::sync::atomic::AtomicU16>,
) -> (String, Arc<AtomicUsize>) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(AtomicUsize::new(0));
    let counted = requests.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let status = status.clone();
            let counted = counted.clone();
            tokio::spawn(async move {
                crate::support::read_http_request(&mut socket).await;
                counted.fetch_add(1, Ordering::SeqCst);
                let code = status.load(Ordering::SeqCst);
                let answer =
                    format!("HTTP/1.1 {code} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                let _ = socket.write_all(answer.as_bytes()).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    (format!("http://{addr}/{{destination}}"), requests)
}

/// A sink that refuses every publish while it answers its health check (a webhook
/// answering 503 to every event, as a revoked permission or a deleted stream does):
/// `/readyz` stayed 200 while nothing was delivered, the retries' WARN lines the only sign.
/// Every publish failing for the grace (30 s) is trouble, naming the sink's error, until
/// one succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_fails_while_every_publish_fails_and_recovers_when_one_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let status = Arc::new(std::sync::atomic::AtomicU16::new(503));
    let (sink, requests) = webhook_answering(status.clone()).await;
    let url = format!("sqlite:{}", dir.path().join("o.db").display());
    let mut relay = RelayProcess::spawn(
        dir.path(),
        "relay",
        &[
            "run",
            "--sink",
            &sink,
            "--http-addr",
            "127.0.0.1:0",
            "--log-format",
            "json",
            "--retry-base-delay",
            "100ms",
            "--retry-max-delay",
            "1s",
            "--max-attempts",
            "1000",
        ],
        &[("DATABASE_URL", &url)],
    );
    let addr = http_addr(&relay).await;
    let sent = relay_cmd(&url, &["send", "--destination", "orders", "{}"]);
    assert!(
        sent.status.success(),
        "{}",
        String::from_utf8_lossy(&sent.stderr)
    );
    eventually(
        "the webhook refusing the event",
        Duration::from_secs(30),
        || {
            let n = requests.load(Ordering::SeqCst);
            async move { (n >= 1).then_some(()) }
        },
    )
    .await;
    let body = crate::support::readyz(
        &relay,
        &addr,
        503,
        "publish: failing for",
        Duration::from_secs(90),
    )
    .await;
    assert!(body.contains("503"), "{body}");
    status.store(200, Ordering::SeqCst);
    crate::support::readyz(&relay, &addr, 200, "", Duration::from_secs(30)).await;
    relay.terminate().await;
}

/// One sink failing every publish beside one that works: `/readyz` fails for the broken
/// one, naming its destination, though the other confirms events all along. Any confirmed
/// event cleared the check, so a relay whose second sink refused everything stayed ready
/// for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_names_a_failing_sink_beside_one_that_works() {
    let dir = tempfile::tempdir().unwrap();
    let broken_status = Arc::new(std::sync::atomic::AtomicU16::new(503));
    let (broken, broken_requests) = webhook_answering(broken_status.clone()).await;
    let (fine, fine_requests) =
        webhook_answering(Arc::new(std::sync::atomic::AtomicU16::new(200))).await;
    let url = format!("sqlite:{}", dir.path().join("o.db").display());
    std::fs::write(
        dir.path().join("outbox-relay.toml"),
        format!(
            r#"
http_addr = "127.0.0.1:0"
log_format = "json"
[retry]
base_delay = "100ms"
max_delay = "1s"
max_attempts = 1000

[sinks.broken]
uri = "{broken}"

[sinks.fine]
uri = "{fine}"

[[routes]]
destinations = "broken"
sink = "broken"

[[routes]]
destinations = "fine"
sink = "fine"
"#
        ),
    )
    .unwrap();
    let mut relay = RelayProcess::spawn(dir.path(), "relay", &["run"], &[("DATABASE_URL", &url)]);
    let addr = http_addr(&relay).await;
    let sent = relay_cmd(&url, &["send", "--destination", "broken", "{}"]);
    assert!(sent.status.success(), "{sent:?}");
    // The working sink confirms an event every half second throughout.
    let sending = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sender = {
        let (sending, url) = (sending.clone(), url.clone());
        std::thread::spawn(move || {
            while sending.load(Ordering::SeqCst) {
                let sent = relay_cmd(&url, &["send", "--destination", "fine", "{}"]);
                assert!(sent.status.success(), "{sent:?}");
                std::thread::sleep(Duration::from_millis(500));
            }
        })
    };
    let body = crate::support::readyz(
        &relay,
        &addr,
        503,
        "publish: failing for",
        Duration::from_secs(90),
    )
    .await;
    assert!(body.contains("broken") && body.contains("503"), "{body}");
    assert!(broken_requests.load(Ordering::SeqCst) >= 2, "retried");
    assert!(
        fine_requests.load(Ordering::SeqCst) >= 10,
        "the other sink worked"
    );
    broken_status.store(200, Ordering::SeqCst);
    crate::support::readyz(&relay, &addr, 200, "", Duration::from_secs(30)).await;
    sending.store(false, Ordering::SeqCst);
    sender.join().unwrap();
    relay.terminate().await;
}
