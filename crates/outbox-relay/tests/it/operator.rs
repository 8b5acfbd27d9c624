//! Operator commands through the binary, on the embedded SQLite store (the store-level
//! behaviour is covered for PostgreSQL and SQLite by the conformance suite), and what
//! `stats` says of scheduled events on each store.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use outbox_testkit::eventually;

const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

fn relay(dir: &Path, args: &[&str]) -> Output {
    let out = relay_whatever(dir, args);
    assert!(
        out.status.success(),
        "outbox-relay {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The relay run with `args`, whatever its exit code.
fn relay_whatever(dir: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .current_dir(dir)
        .env_remove("DATABASE_URL")
        .output()
        .unwrap()
}

/// `run --drain`, whatever its exit code.
fn drain(dir: &Path) -> Output {
    relay_whatever(dir, &["run", "--drain"])
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .count()
}

#[tokio::test]
async fn dead_letters_can_be_listed_retried_and_purged_and_retained_events_replayed_and_pruned() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(
        d.join("outbox-relay.toml"),
        r#"
database_url = "sqlite:o.db"
retain_delivered = true
http_addr = ""
[retry]
base_delay = "10ms"
max_delay = "20ms"
max_attempts = 2
[sinks.out]
uri = "file:out.jsonl"
[[routes]]
destinations = "orders"
sink = "out"
"#,
    )
    .unwrap();
    for key in ["a", "b", "c"] {
        relay(d, &["send", "--destination", "orders", "--key", key, "{}"]);
    }
    relay(d, &["send", "--destination", "nowhere", "{}"]);

    // The unrouted event fails twice, then is dead-lettered.
    let listed = eventually(
        "the unrouted event in the dead letters",
        Duration::from_secs(30),
        || {
            // Exit 1 while the event waits to retry, and on the run that dead-letters it.
            assert_eq!(drain(d).status.code(), Some(1));
            let out = stdout(&relay(d, &["dead", "list", "--json"]));
            async move { (!out.is_empty()).then_some(out) }
        },
    )
    .await;
    assert_eq!(lines(&d.join("out.jsonl")), 3);
    let dead: serde_json::Value = serde_json::from_str(listed.lines().next().unwrap()).unwrap();
    assert_eq!(dead["destination"], "nowhere");
    // A full page says how to go on (it stopped at the limit, silently).
    let page = relay(d, &["dead", "list", "--limit", "1"]);
    let said = String::from_utf8_lossy(&page.stderr);
    assert!(
        said.contains(&format!("add --after {}", dead["sequence_id"])),
        "{said}"
    );
    assert_eq!(dead["attempts"], 2);
    assert!(dead["last_error"]
        .as_str()
        .unwrap()
        .contains("no route matches destination"));

    let stats: serde_json::Value =
        serde_json::from_slice(&relay(d, &["stats", "--json"]).stdout).unwrap();
    let by: Vec<(String, u64, u64)> = stats["destinations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["destination"].as_str().unwrap().into(),
                x["pending"].as_u64().unwrap(),
                x["dead"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        by,
        vec![("nowhere".into(), 0, 1)],
        "delivered rows are retained, not pending"
    );

    assert!(stdout(&relay(d, &["dead", "retry", "--destination", "nowhere"])).contains("moved 1"));
    // The same id again (a script that retried twice), and an id that names nothing: each
    // was "moved 0" with exit 0, the operator told all was well.
    let id = dead["sequence_id"].to_string();
    for command in [
        ["dead", "retry", "--id", &id],
        ["dead", "purge", "--id", "999999"],
    ] {
        let out = relay_whatever(d, &command);
        let said = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{command:?}: {said}");
        assert!(
            said.contains("1 of the ids given named no dead letter"),
            "{said}"
        );
    }
    let stats: serde_json::Value =
        serde_json::from_slice(&relay(d, &["stats", "--json"]).stdout).unwrap();
    assert_eq!(
        stats["backlog"]["pending"], 1,
        "the retried event is pending again"
    );
    assert!(stdout(&relay(d, &["dead", "purge", "--all"])).contains("deleted 0"));

    // Replay publishes the retained events again, with their original ids.
    let replayed = relay(d, &["replay", "--since", "1h"]);
    assert!(String::from_utf8_lossy(&replayed.stderr).contains("replaying: 3/3 (100%)"));
    // And what it did, which only the progress line told.
    assert!(stdout(&replayed).contains("queued 3 delivered events to go out again"));
    // The event moved back from the dead letters still has no route: left retrying, exit 1.
    assert_eq!(drain(d).status.code(), Some(1));
    let out = std::fs::read_to_string(d.join("out.jsonl")).unwrap();
    let ids: Vec<String> = out
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["event_id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(ids.len(), 6);
    assert_eq!(ids[..3], ids[3..], "the same events, in the same order");

    // Prune the delivered rows; a dry run first.
    assert!(stdout(&relay(
        d,
        &["prune", "--delivered-older-than", "0s", "--dry-run"]
    ))
    .contains("would delete 3 delivered rows"));
    let pruned = relay(
        d,
        &["prune", "--delivered-older-than", "0s", "--batch-size", "2"],
    );
    assert!(String::from_utf8_lossy(&pruned.stderr).contains("pruning delivered rows: 3/3 (100%)"));
    assert!(stdout(&relay(
        d,
        &["prune", "--delivered-older-than", "0s", "--dry-run"]
    ))
    .contains("would delete 0 delivered rows"));
}

/// `replay` goes by pages of 1,000, and on a mapped table (here MariaDB's native one) each
/// page picks its rows, then updates them. It stopped at the first page that updated
/// nothing: a page pruned between its pick and its update (the prune committed while the
/// update waited on its locks) ended the replay, and every later row was left delivered
/// while `replay` exited 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_goes_on_past_a_page_pruned_under_it() {
    use mysql_async::prelude::Queryable;
    let url = outbox_testkit::fresh_mysql_database().await;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    relay(d, &["migrate", "--database-url", &url]);
    let pool = mysql_async::Pool::new(url.as_str());
    let mut conn = pool.get_conn().await.unwrap();
    conn.query_drop("SET SESSION max_recursive_iterations = 2000")
        .await
        .unwrap();
    conn.query_drop(
        "INSERT INTO outbox (destination, event_type, payload, delivered_at)
         WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1001)
         SELECT 'd', 't', '{}', UTC_TIMESTAMP(6) FROM n",
    )
    .await
    .unwrap();
    // A prune of the first page, not yet committed.
    let mut prune = pool.get_conn().await.unwrap();
    prune.query_drop("BEGIN").await.unwrap();
    prune
        .query_drop("DELETE FROM outbox WHERE sequence_id <= 1000")
        .await
        .unwrap();
    let replay = {
        let (url, d) = (url.clone(), d.to_path_buf());
        std::thread::spawn(move || {
            Command::new(BIN)
                .args(["replay", "--since", "1h", "--database-url", &url])
                .env("OUTBOX_RELAY_RETAIN_DELIVERED", "true")
                .current_dir(d)
                .output()
                .unwrap()
        })
    };
    eventually(
        "the replay's update to wait",
        Duration::from_secs(30),
        || {
            let pool = pool.clone();
            async move {
                let mut conn = pool.get_conn().await.ok()?;
                let waiting: Option<i64> = conn
                    .query_first(
                        "SELECT count(*) FROM information_schema.PROCESSLIST
                      WHERE ID <> CONNECTION_ID() AND INFO LIKE 'UPDATE%'",
                    )
                    .await
                    .ok()?;
                (waiting == Some(1)).then_some(())
            }
        },
    )
    .await;
    prune.query_drop("COMMIT").await.unwrap();
    let out = replay.join().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pending: Option<i64> = conn
        .query_first("SELECT count(*) FROM outbox WHERE delivered_at IS NULL")
        .await
        .unwrap();
    assert_eq!(
        pending,
        Some(1),
        "the row after the pruned page is replayed"
    );
}

/// `dead retry` of many dead letters in one statement: 1.2 million outlasted PostgreSQL's
/// statement timeout (nothing moved) and, on SQLite, held the application's writers out for
/// half a minute, without a word of progress. It now moves a page of ids at a time, each in
/// its own statement, saying how far it is.
#[test]
fn dead_retry_of_many_moves_them_a_page_at_a_time_with_progress() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    relay(d, &["migrate"]);
    let db = rusqlite::Connection::open(d.join("outbox.db")).unwrap();
    db.execute_batch(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2500)
         INSERT INTO outbox_dead_letters (sequence_id, event_id, destination, event_type,
             payload, created_at, attempts, last_error, dead_at)
         SELECT i, lower(hex(randomblob(16))), CASE WHEN i % 2 = 0 THEN 'even' ELSE 'odd' END,
                'T', '{}', 0, 3, 'broker down', 0
           FROM n;",
    )
    .unwrap();
    drop(db);
    let out = relay(d, &["dead", "retry", "--destination", "even"]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(stdout(&out).contains("1250"), "{}", stdout(&out));
    assert!(
        err.contains("retrying dead letters: 1250/1250 (100%)"),
        "{err}"
    );
    let out = relay(d, &["dead", "retry", "--all"]);
    assert!(stdout(&out).contains("1250"), "{}", stdout(&out));
    let db = rusqlite::Connection::open(d.join("outbox.db")).unwrap();
    let (pending, dead): (i64, i64) = db
        .query_row(
            "SELECT (SELECT count(*) FROM outbox), (SELECT count(*) FROM outbox_dead_letters)",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!((pending, dead), (2500, 0));
}

/// An event written ten minutes ago for tomorrow has not waited to go out yet: the oldest
/// pending age counted it from its insert, and the shipped `OutboxOldestPendingEventTooOld`
/// alert (over 5 minutes) fired on any event scheduled further ahead. A due event beside it
/// sets the age; a failed one counts from its creation. Each store, through `stats --json`.
async fn a_scheduled_event_does_not_age_the_backlog(url: &str, schedule: &str) {
    let dir = tempfile::tempdir().unwrap();
    let stats = || {
        let out = relay(dir.path(), &["stats", "--json", "--database-url", url]);
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let ages = [
            json["backlog"]["oldest_pending_age_seconds"].as_f64(),
            json["destinations"][0]["oldest_pending_age_seconds"].as_f64(),
        ];
        (json["backlog"]["pending"].as_u64(), ages)
    };
    relay(dir.path(), &["migrate", "--database-url", url]);
    let send = |key: &str| {
        let args = [
            "send",
            "--database-url",
            url,
            "--destination",
            "d",
            "--key",
            key,
        ];
        relay(dir.path(), &[&args[..], &["--type", "t", "{}"]].concat());
    };
    // The scheduled row, by each store's own SQL; then the due one.
    send("k");
    execute(url, schedule).await;
    let (pending, ages) = stats();
    assert_eq!(pending, Some(1));
    assert_eq!(ages, [None, None], "a scheduled event has not waited yet");
    send("k2");
    let (pending, ages) = stats();
    assert_eq!(pending, Some(2));
    for age in ages {
        let age = age.expect("the due event's age");
        assert!(
            age < 60.0,
            "the due event set the age, not the scheduled one: {age}"
        );
    }
}

async fn execute(url: &str, statement: &str) {
    if url.starts_with("postgres") {
        crate::support::pg(url)
            .await
            .batch_execute(statement)
            .await
            .unwrap();
    } else if url.starts_with("mysql") {
        use mysql_async::prelude::Queryable;
        let mut conn = mysql_async::Conn::from_url(url).await.unwrap();
        conn.query_drop(statement).await.unwrap();
    } else {
        let path = url.strip_prefix("sqlite:").unwrap();
        rusqlite::Connection::open(path)
            .unwrap()
            .execute_batch(statement)
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_event_does_not_age_a_postgres_backlog() {
    let url = outbox_testkit::fresh_pg_database().await;
    a_scheduled_event_does_not_age_the_backlog(
        &url,
        "UPDATE outbox SET created_at = now() - interval '10 minutes',
                            available_at = now() + interval '1 day'",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_event_does_not_age_a_mariadb_backlog() {
    let url = outbox_testkit::fresh_mysql_database().await;
    a_scheduled_event_does_not_age_the_backlog(
        &url,
        "UPDATE outbox SET created_at = UTC_TIMESTAMP(6) - INTERVAL 10 MINUTE,
                            available_at = UTC_TIMESTAMP(6) + INTERVAL 1 DAY",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_event_does_not_age_a_sqlite_backlog() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("outbox.db").display());
    a_scheduled_event_does_not_age_the_backlog(
        &url,
        "UPDATE outbox SET created_at = created_at - 600000,
                            available_at = created_at + 86400000",
    )
    .await;
}
