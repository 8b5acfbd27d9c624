//! The file sink acks only what is on disk at its path: a removed or rotated file is
//! reopened, a removed directory holds the events in the outbox and turns /readyz 503.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use outbox_testkit::{eventually, eventually_explained, fresh_pg_database, query_count};

use crate::support;

use crate::support::{http_addr, http_get, pg, read_lines, RelayProcess, BIN};

async fn readyz_becomes(addr: &str, status: u16) -> String {
    eventually(
        &format!("/readyz to answer {status}"),
        Duration::from_secs(30),
        || async move {
            http_get(addr, "/readyz")
                .await
                .filter(|(s, _)| *s == status)
        },
    )
    .await
    .1
}

/// `migrate` of the PostgreSQL database at `url`.
fn migrate_pg(url: &str) {
    let migrate = std::process::Command::new(BIN)
        .arg("migrate")
        .env("DATABASE_URL", url)
        .output()
        .unwrap();
    assert!(migrate.status.success(), "{migrate:?}");
}

async fn insert(client: &tokio_postgres::Client, from: i32, to: i32) {
    client
        .execute(
            "INSERT INTO outbox (destination, partition_key, event_type, payload)
             SELECT 'orders', 'k' || (i % 3), 'created', jsonb_build_object('i', i)
             FROM generate_series($1::int, $2::int) AS i",
            &[&from, &to],
        )
        .await
        .unwrap();
}

/// The payload numbers `i` of the events in the file at `path`.
fn numbers_in(path: &Path) -> Vec<i64> {
    let mut numbers: Vec<i64> = read_lines(path)
        .iter()
        .map(|l| l["payload"]["i"].as_i64().unwrap())
        .collect();
    numbers.sort();
    numbers
}

/// Waits until the file at `path` holds exactly the events `from..=to` and the outbox is
/// empty (every event acked).
async fn delivered_to_path(
    relay: &RelayProcess,
    client: &tokio_postgres::Client,
    path: &Path,
    from: i64,
    to: i64,
) {
    let expected: Vec<i64> = (from..=to).collect();
    eventually_explained(
        &format!(
            "events {from}..={to} in {} and an empty outbox",
            path.display()
        ),
        Duration::from_secs(30),
        || relay.logs(),
        || {
            let numbers = numbers_in(path);
            let expected = expected.clone();
            async move {
                let left = query_count(client, "SELECT count(*) FROM outbox", &[])
                    .await
                    .unwrap();
                (numbers == expected && left == 0).then_some(())
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_acked_only_into_the_file_at_the_path_after_removal_rotation_or_a_lost_directory(
) {
    let url = fresh_pg_database().await;
    let root = tempfile::tempdir().unwrap();
    let out_dir = root.path().join("out");
    std::fs::create_dir(&out_dir).unwrap();
    let path = out_dir.join("ev.jsonl");
    migrate_pg(&url);
    let sink = format!("file:{}", path.display());
    let relay = RelayProcess::spawn(
        root.path(),
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
    let client = pg(&url).await;
    let addr = http_addr(&relay).await;

    insert(&client, 1, 10).await;
    delivered_to_path(&relay, &client, &path, 1, 10).await;
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the sink file is private to the relay's user");

    // Removed: the next events go into a new file at the path.
    std::fs::remove_file(&path).unwrap();
    insert(&client, 11, 20).await;
    delivered_to_path(&relay, &client, &path, 11, 20).await;

    // Rotated as logrotate does: renamed, and an empty file created at the path.
    let rotated = out_dir.join("ev.jsonl.1");
    std::fs::rename(&path, &rotated).unwrap();
    std::fs::File::create(&path).unwrap();
    insert(&client, 21, 30).await;
    delivered_to_path(&relay, &client, &path, 21, 30).await;
    assert_eq!(numbers_in(&rotated), (11..=20).collect::<Vec<_>>());

    // The directory removed: nothing is acked, /readyz names the directory.
    std::fs::remove_dir_all(&out_dir).unwrap();
    insert(&client, 31, 40).await;
    let body = readyz_becomes(&addr, 503).await;
    assert!(
        body.contains(&format!("mkdir -p {}", out_dir.display())),
        "{body}"
    );
    eventually_explained(
        "the first event of each of the 3 keys to have failed",
        Duration::from_secs(30),
        || relay.logs(),
        || async {
            let row = client
                .query_one(
                    "SELECT count(*), count(DISTINCT partition_key) FILTER (WHERE attempts > 0)
                     FROM outbox",
                    &[],
                )
                .await
                .unwrap();
            let (left, failed): (i64, i64) = (row.get(0), row.get(1));
            assert_eq!(left, 10, "nothing is acked while the directory is missing");
            // Per-key order: the events behind each key's first wait for it.
            (failed == 3).then_some(())
        },
    )
    .await;
    assert!(!out_dir.exists(), "the sink does not create the directory");

    // The directory back: everything arrives, /readyz recovers.
    std::fs::create_dir(&out_dir).unwrap();
    delivered_to_path(&relay, &client, &path, 31, 40).await;
    readyz_becomes(&addr, 200).await;
}

/// `/dev/null` and a FIFO are no regular files: `fdatasync` on a character device fails
/// with EINVAL, so a sink to `/dev/null` failed every batch and retried for good, while
/// `check` called it reachable. Each is written without one now, and a drain to either ends
/// with every event acked.
#[tokio::test]
async fn a_sink_path_that_is_no_regular_file_is_written_without_fsync() {
    let url = support::migrated_pg_database().await;
    let root = tempfile::tempdir().unwrap();
    let client = pg(&url).await;
    let drain = |sink: &str| {
        support::relay(
            root.path(),
            &[
                "run",
                "--drain",
                "--database-url",
                &url,
                "--sink",
                sink,
                "--http-addr",
                "",
                "--max-attempts",
                "3",
                "--retry-base-delay",
                "10ms",
            ],
        )
    };
    let check = support::relay(
        root.path(),
        &["check", "--database-url", &url, "--sink", "file:/dev/null"],
    );
    assert!(check.status.success(), "{}", support::text(&check.stderr));

    insert(&client, 1, 5).await;
    let drained = drain("file:/dev/null");
    assert!(
        drained.status.success(),
        "{}",
        support::text(&drained.stderr)
    );
    let left = query_count(&client, "SELECT count(*) FROM outbox", &[]).await;
    assert_eq!(left.unwrap(), 0, "every event acked, none dead");
    let dead = query_count(&client, "SELECT count(*) FROM outbox_dead_letters", &[]).await;
    assert_eq!(dead.unwrap(), 0);

    // A FIFO: what its reader gets is what was acked.
    let fifo = root.path().join("events.fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    // The consumer has it open before the relay starts: the relay writes a FIFO only while
    // a process reads it. (Opened for writing too, so that its reads wait for lines rather
    // than end while no writer has it open.)
    let pipe = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&fifo)
        .unwrap();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        let pipe = std::io::BufReader::new(pipe);
        pipe.lines().take(5).map(Result::unwrap).collect::<Vec<_>>()
    });
    insert(&client, 6, 10).await;
    let drained = drain(&format!("file:{}", fifo.display()));
    assert!(
        drained.status.success(),
        "{}",
        support::text(&drained.stderr)
    );
    let lines = reader.join().unwrap();
    let mut numbers: Vec<i64> = lines
        .iter()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["payload"]["i"]
                .as_i64()
                .unwrap()
        })
        .collect();
    numbers.sort();
    assert_eq!(numbers, (6..=10).collect::<Vec<_>>());
}

/// The sink file reaching the process's file-size limit (`ulimit -f`, systemd's
/// `LimitFSIZE`): SIGXFSZ ended the relay without a word at the write that crossed it, its
/// node left registered and the file torn, and again at every restart. It runs on, saying
/// the limit and the fix; the events wait in the outbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_file_at_the_file_size_limit_is_said_and_the_relay_runs_on() {
    let url = fresh_pg_database().await;
    let root = tempfile::tempdir().unwrap();
    let path = root.path().join("ev.jsonl");
    migrate_pg(&url);
    let client = pg(&url).await;
    // About 400 KB of lines, past a limit of 64 KiB.
    insert(&client, 1, 2000).await;
    let sink = format!("file:{}", path.display());
    let limited = ["-c", "ulimit -f 128; exec \"$0\" \"$@\"", BIN];
    let args = [
        &limited[..],
        &support::run_args(&url, &sink, &["--http-addr", ""]),
    ]
    .concat();
    let mut relay = RelayProcess::spawn_build("sh", root.path(), "relay", &args, &[]);
    relay
        .wait_for_log(
            "the relay saying the limit",
            Duration::from_secs(60),
            "file-size limit (ulimit -f",
        )
        .await;
    let status = relay.terminate().await;
    assert!(
        status.success(),
        "it ran on to its stop: {status:?}\n{}",
        relay.logs()
    );
    let left = query_count(&client, "SELECT count(*) FROM outbox", &[])
        .await
        .unwrap();
    assert!(left > 0, "the events past the limit wait in the outbox");
}
