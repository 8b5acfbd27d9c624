//! The bad inputs of docs/bad-inputs.md that no other test covers, given to the binary
//! against real servers: rows a careless writer leaves (headers that are no JSON object, a
//! payload cut short, NUL bytes, odd destinations, header text a broker cannot carry), an
//! outbox truncated under a running relay, two relays on one SQLite file, hosts that do not
//! answer and TLS modes that cannot work. Each checks what the table promises: the message
//! names the problem and the fix, the exit code, and the other rows keep flowing.

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use outbox_testkit::{eventually_explained, fresh_pg_database, query_count, wait_for_count};

#[cfg(feature = "nats")]
use crate::support::{nats_stream, stream_len};
use crate::support::{pg, read_lines, relay, text, wait_for_lines, OwnPostgres, RelayProcess};

/// A migrated SQLite outbox in `dir`; its URL.
fn sqlite_outbox(dir: &Path) -> String {
    let url = format!("sqlite:{}", dir.join("outbox.db").display());
    let migrated = relay(dir, &["migrate", "--database-url", &url]);
    assert!(migrated.status.success(), "{}", text(&migrated.stderr));
    url
}

/// A fresh PostgreSQL database, migrated (by a relay working in `dir`), with `rows` run in
/// it: its URL.
async fn migrated_pg_with(dir: &Path, rows: &str) -> String {
    let url = fresh_pg_database().await;
    assert!(relay(dir, &["migrate", "--database-url", &url])
        .status
        .success());
    pg(&url).await.batch_execute(rows).await.unwrap();
    url
}

fn sqlite(dir: &Path) -> rusqlite::Connection {
    rusqlite::Connection::open(dir.join("outbox.db")).unwrap()
}

/// `run --drain` to a file sink in `dir`; the output and the lines written.
fn drain_to_file(dir: &Path, url: &str, extra: &[&str]) -> (Output, Vec<serde_json::Value>) {
    let out = dir.join("events.jsonl");
    let sink = format!("file:{}", out.display());
    let mut args = vec![
        "run",
        "--drain",
        "--database-url",
        url,
        "--sink",
        &sink,
        "--http-addr",
        "",
    ];
    args.extend_from_slice(extra);
    let run = relay(dir, &args);
    (run, read_lines(&out))
}

/// The dead letters as `dead list --json` shows them.
fn dead_letters(dir: &Path, url: &str) -> Vec<serde_json::Value> {
    let list = relay(dir, &["dead", "list", "--json", "--database-url", url]);
    assert!(list.status.success(), "{}", text(&list.stderr));
    text(&list.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A drain that delivered everything else: exit 1, the dead letters counted (a cron job
/// learns that events need an operator).
#[track_caller]
fn dead_lettered_drain(run: &Output, dead: usize) {
    let stderr = text(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("{dead} events were dead-lettered")),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

fn dead_reason(dead: &[serde_json::Value], event_type: &str) -> String {
    dead.iter()
        .find(|d| d["event_type"] == event_type)
        .unwrap_or_else(|| panic!("{event_type} is dead-lettered: {dead:?}"))["last_error"]
        .as_str()
        .unwrap()
        .to_string()
}

// ---- Rows ----

/// Ids the application gave itself, below the sequence's (zero, negative): every claim
/// scanned from zero, so a negative id was never claimed, and its key's later row went out
/// before it. Each store relays them in id order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_with_ids_of_zero_or_below_are_relayed_in_id_order() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let pg_url = migrated_pg_with(
        d,
        r#"INSERT INTO outbox (sequence_id, destination, partition_key, event_type, payload)
               VALUES (-5, 'orders', 'k', 't', '{"n":1}'), (0, 'orders', 'k', 't', '{"n":2}'),
                      (7, 'orders', 'k', 't', '{"n":3}')"#,
    )
    .await;
    let sqlite_url = sqlite_outbox(d);
    sqlite(d)
        .execute_batch(
            r#"INSERT INTO outbox (sequence_id, destination, partition_key, event_type, payload)
               VALUES (-5, 'orders', 'k', 't', '{"n":1}'), (0, 'orders', 'k', 't', '{"n":2}'),
                      (7, 'orders', 'k', 't', '{"n":3}');"#,
        )
        .unwrap();
    for url in [pg_url, sqlite_url] {
        std::fs::remove_file(d.join("events.jsonl")).ok();
        let (run, lines) = drain_to_file(d, &url, &[]);
        assert!(run.status.success(), "{url}: {}", text(&run.stderr));
        let order: Vec<i64> = lines
            .iter()
            .map(|l| l["payload"]["n"].as_i64().unwrap())
            .collect();
        assert_eq!(order, [1, 2, 3], "{url}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_headers_and_truncated_payloads_are_dead_lettered_with_the_reason_and_other_rows_flow(
) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let url = sqlite_outbox(d);
    // PostgreSQL's jsonb refuses text that is no JSON at insert; SQLite stores whatever the
    // application wrote. Each bad row has a key of its own after a good one of the same key.
    sqlite(d)
        .execute_batch(
            r#"INSERT INTO outbox (destination, partition_key, event_type, payload, headers) VALUES
                 ('orders', 'a', 'good', '{"n":1}', '{}'),
                 ('orders', 'a', 'headers-array', '{}', '["not","an object"]'),
                 ('orders', 'b', 'headers-not-json', '{}', '{trace: 1'),
                 ('orders', 'c', 'payload-cut-short', '{"order_id": 10', '{}'),
                 ('orders', 'd', 'headers-with-numbers', '{}', '{"trace":"t1","retries":3}'),
                 ('orders', 'a', 'good', '{"n":2}', '{}');"#,
        )
        .unwrap();
    let (run, lines) = drain_to_file(d, &url, &[]);
    dead_lettered_drain(&run, 3);
    let types: Vec<&str> = lines
        .iter()
        .map(|l| l["event_type"].as_str().unwrap())
        .collect();
    assert_eq!(types, ["good", "headers-with-numbers", "good"], "{lines:?}");
    // A header value that is not a string keeps its JSON text.
    assert_eq!(lines[1]["headers"]["retries"], "3");

    let dead = dead_letters(d, &url);
    assert_eq!(dead.len(), 3, "{dead:?}");
    assert!(
        dead_reason(&dead, "headers-array").contains("headers must be a JSON object"),
        "{dead:?}"
    );
    assert!(
        dead_reason(&dead, "headers-not-json").contains("headers are not valid JSON"),
        "{dead:?}"
    );
    assert!(
        dead_reason(&dead, "payload-cut-short").contains("payload is not valid JSON"),
        "{dead:?}"
    );
    // A dead letter waits for `dead retry` once its row is fixed, not for a retry timer.
    assert!(dead.iter().all(|d| d["attempts"] == 0), "{dead:?}");
}

/// Header values that are numbers keep their JSON text exactly: read through `f64`, an id
/// past 2^53 went out changed, a 30-digit one in exponent form, and one past `f64`'s range
/// (which `jsonb` stores) was dead-lettered as "not valid JSON".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_numbers_are_published_as_the_database_stored_them() {
    let headers = r#"{"id": 9007199254740993, "price": 1.50,
        "order": 123456789012345678901234567890, "huge": 1e400,
        "nested": {"n": 9007199254740993, "s": "a b"}}"#;
    let row = format!(
        "INSERT INTO outbox (destination, partition_key, event_type, payload, headers)
         VALUES ('orders', 'k', 't', '{{}}', '{headers}')"
    );
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let pg_url = migrated_pg_with(d, &row).await;
    let (run, lines) = drain_to_file(d, &pg_url, &[]);
    assert!(run.status.success(), "{}", text(&run.stderr));
    assert_eq!(lines.len(), 1, "{lines:?}");
    let headers = &lines[0]["headers"];
    assert_eq!(headers["id"], "9007199254740993", "{headers}");
    assert_eq!(headers["price"], "1.50", "{headers}");
    assert_eq!(headers["order"], "123456789012345678901234567890");
    assert!(headers["huge"].as_str().unwrap().len() > 400, "{headers}");
    assert_eq!(headers["nested"], r#"{"n":9007199254740993,"s":"a b"}"#);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nul_bytes_are_refused_by_postgresql_and_carried_escaped_from_sqlite() {
    // PostgreSQL: neither text nor jsonb holds a NUL, so the application's insert fails and
    // nothing reaches the outbox.
    let pg_url = fresh_pg_database().await;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let migrated = relay(d, &["migrate", "--database-url", &pg_url]);
    assert!(migrated.status.success(), "{}", text(&migrated.stderr));
    let client = pg(&pg_url).await;
    let in_text = client
        .execute(
            "INSERT INTO outbox (destination, event_type, payload) VALUES ($1, 't', '{}')",
            &[&"ord\0ers"],
        )
        .await
        .unwrap_err();
    assert!(
        in_text
            .as_db_error()
            .is_some_and(|e| e.message().contains("0x00")),
        "{in_text:?}"
    );
    let in_json = client
        .batch_execute(
            r#"INSERT INTO outbox (destination, event_type, payload) VALUES ('d', 't', '{"a":"\u0000"}')"#,
        )
        .await
        .unwrap_err();
    assert!(
        in_json
            .as_db_error()
            .is_some_and(|e| e.message().contains("Unicode escape")),
        "{in_json:?}"
    );

    // SQLite stores NULs: in text they are carried (escaped in the JSON line), and a raw NUL
    // inside a JSON string makes the payload invalid JSON, dead-lettered with the reason.
    let url = sqlite_outbox(d);
    sqlite(d)
        .execute_batch(
            r#"INSERT INTO outbox (destination, partition_key, event_type, payload) VALUES
                 ('ord' || char(0) || 'ers', 'k' || char(0), 'nul-in-text', '{"a":"\u0000"}'),
                 ('orders', 'k2', 'raw-nul-in-json', '{"a":"' || char(0) || '"}'),
                 ('orders', 'k2', 'after', '{}');"#,
        )
        .unwrap();
    let (run, lines) = drain_to_file(d, &url, &[]);
    dead_lettered_drain(&run, 1);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0]["destination"], "ord\0ers");
    assert_eq!(lines[0]["partition_key"], "k\0");
    assert_eq!(lines[0]["payload"]["a"], "\0");
    assert_eq!(lines[1]["event_type"], "after");
    let dead = dead_letters(d, &url);
    assert!(
        dead_reason(&dead, "raw-nul-in-json").contains("payload is not valid JSON"),
        "{dead:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_destination_characters_reach_the_file_sink_verbatim() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let url = sqlite_outbox(d);
    let odd = [
        "orders created",
        "orders.*.>",
        "../../etc/passwd",
        "commandes-été-✓",
        "quote\"back\\slash",
        "tab\there",
        "line\nbreak",
        "",
    ];
    let conn = sqlite(d);
    for destination in odd {
        conn.execute(
            "INSERT INTO outbox (destination, event_type, payload) VALUES (?1, 't', '{}')",
            [destination],
        )
        .unwrap();
    }
    let (run, lines) = drain_to_file(d, &url, &[]);
    assert_eq!(run.status.code(), Some(0), "{}", text(&run.stderr));
    let delivered: Vec<&str> = lines
        .iter()
        .map(|l| l["destination"].as_str().unwrap())
        .collect();
    assert_eq!(delivered, odd);
}

#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_that_is_no_nats_subject_is_dead_lettered_at_once_naming_the_fix() {
    let (js, prefix) = nats_stream().await;
    let nats = std::env::var("OUTBOX_TEST_NATS_URL").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let url = sqlite_outbox(d);
    let conn = sqlite(d);
    for destination in [
        format!("{prefix}.orders created"),
        format!("{prefix}.orders"),
    ] {
        conn.execute(
            "INSERT INTO outbox (destination, partition_key, event_type, payload)
             VALUES (?1, 'k', 't', '{}')",
            [destination],
        )
        .unwrap();
    }
    // Short retries, so a retried failure ends the drain quickly too.
    let run = relay(
        d,
        &[
            "run",
            "--drain",
            "--database-url",
            &url,
            "--sink",
            &nats,
            "--http-addr",
            "",
            "--retry-base-delay",
            "10ms",
            "--retry-max-delay",
            "50ms",
        ],
    );
    assert!(
        !text(&run.stderr).contains("panicked"),
        "{}",
        text(&run.stderr)
    );
    assert_eq!(stream_len(&js, &prefix).await, 1, "the key flows on");
    let dead = dead_letters(d, &url);
    assert_eq!(dead.len(), 1, "{dead:?}");
    let reason = dead[0]["last_error"].as_str().unwrap();
    assert_eq!(
        dead[0]["attempts"], 1,
        "a subject is refused for good: {reason}"
    );
    assert!(
        reason.contains("subject") && reason.contains("[[routes]]"),
        "names the problem and the fix: {reason}"
    );
}

/// A destination naming JetStream's API would be a call made with the relay's credentials
/// (here: delete the stream): it is dead-lettered at once with the fix, and the stream stays.
#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_addressing_the_jetstream_api_is_dead_lettered_and_not_called() {
    let (js, stream) = nats_stream().await;
    let nats = std::env::var("OUTBOX_TEST_NATS_URL").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let url = sqlite_outbox(d);
    let conn = sqlite(d);
    for (key, destination) in [
        ("a", format!("$JS.API.STREAM.DELETE.{stream}")),
        ("b", format!("{stream}.orders")),
    ] {
        conn.execute(
            "INSERT INTO outbox (destination, partition_key, event_type, payload)
             VALUES (?1, ?2, 't', '{}')",
            [destination.as_str(), key],
        )
        .unwrap();
    }
    let run = relay(
        d,
        &[
            "run",
            "--drain",
            "--database-url",
            &url,
            "--sink",
            &nats,
            "--http-addr",
            "",
        ],
    );
    dead_lettered_drain(&run, 1);
    assert_eq!(
        stream_len(&js, &stream).await,
        1,
        "the stream is still there"
    );
    let dead = dead_letters(d, &url);
    assert_eq!(dead.len(), 1, "{dead:?}");
    let reason = dead[0]["last_error"].as_str().unwrap();
    assert_eq!(dead[0]["attempts"], 1, "refused for good: {reason}");
    assert!(
        reason.contains("JetStream API") && reason.contains("[[routes]]"),
        "names the problem and the fix: {reason}"
    );
}

#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_text_nats_cannot_carry_dead_letters_its_event_and_never_crashes_the_relay() {
    let (js, prefix) = nats_stream().await;
    let nats = std::env::var("OUTBOX_TEST_NATS_URL").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let url = sqlite_outbox(d);
    let destination = format!("{prefix}.orders");
    let rows = [
        ("a", "good", r#"{"trace":"1"}"#),
        ("b", "space-in-header-name", r#"{"trace id":"1"}"#),
        ("c", "colon-in-header-name", r#"{"a:b":"1"}"#),
        ("d", "line-break-in-header-value", r#"{"trace":"1\r\n2"}"#),
        ("e\nf", "line-break-in-key", "{}"),
        ("g", "line-break\nin-type", "{}"),
        ("a", "good", "{}"),
    ];
    let conn = sqlite(d);
    for (key, event_type, headers) in rows {
        conn.execute(
            "INSERT INTO outbox (destination, partition_key, event_type, payload, headers)
             VALUES (?1, ?2, ?3, '{}', ?4)",
            [destination.as_str(), key, event_type, headers],
        )
        .unwrap();
    }
    let run = relay(
        d,
        &[
            "run",
            "--drain",
            "--database-url",
            &url,
            "--sink",
            &nats,
            "--http-addr",
            "",
        ],
    );
    assert!(
        !text(&run.stderr).contains("panicked"),
        "{}",
        text(&run.stderr)
    );
    dead_lettered_drain(&run, 5);
    assert_eq!(stream_len(&js, &prefix).await, 2, "the good events flow");
    let dead = dead_letters(d, &url);
    assert_eq!(dead.len(), 5, "{dead:?}");
    for d in &dead {
        let reason = d["last_error"].as_str().unwrap();
        assert!(
            reason.contains("NATS") && reason.contains("header"),
            "names what NATS cannot carry: {reason}"
        );
    }
}

// ---- The table under a running relay ----

/// A relay over a newly migrated PostgreSQL outbox at `url` (in `dir`), run with `extra`,
/// that writes the events of destination `good` to the file it returns, and the others to
/// the sink `rest`.
fn relay_good_to_a_file_and_the_rest_to(
    dir: &Path,
    url: &str,
    rest: &str,
    extra: &[&str],
) -> (RelayProcess, std::path::PathBuf) {
    assert!(relay(dir, &["migrate", "--database-url", url])
        .status
        .success());
    let out = dir.join("events.jsonl");
    std::fs::write(
        dir.join("relay.toml"),
        format!(
            "[sinks.file]\nuri = \"file:{}\"\n[sinks.rest]\nuri = \"{rest}\"\n\
             [[routes]]\ndestinations = \"good\"\nsink = \"file\"\n\
             [[routes]]\ndestinations = \"*\"\nsink = \"rest\"\n",
            out.display()
        ),
    )
    .unwrap();
    let mut args = vec![
        "--config",
        "relay.toml",
        "run",
        "--http-addr",
        "",
        "--log-format",
        "json",
    ];
    args.extend_from_slice(extra);
    let process = RelayProcess::spawn(dir, "relay", &args, &[("DATABASE_URL", url)]);
    (process, out)
}

#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncating_the_outbox_under_a_running_relay_loses_nothing_written_after_it() {
    let url = fresh_pg_database().await;
    let nats = std::env::var("OUTBOX_TEST_NATS_URL")
        .expect("OUTBOX_TEST_NATS_URL is not set: source /tmp/servers.env");
    let dir = tempfile::tempdir().unwrap();
    // Events for a subject no stream captures wait to retry when the table is truncated.
    let (mut relay_process, out) =
        relay_good_to_a_file_and_the_rest_to(dir.path(), &url, &nats, &[]);
    let client = pg(&url).await;
    write_five(&client, "nostream", 0).await;
    eventually_explained(
        "the events to wait for a retry",
        Duration::from_secs(30),
        || relay_process.logs(),
        || async {
            let retrying = query_count(
                &client,
                "SELECT count(*) FROM outbox WHERE attempts > 0",
                &[],
            )
            .await
            .unwrap();
            (retrying == 5).then_some(())
        },
    )
    .await;
    // RESTART IDENTITY: the new rows reuse the sequence ids of the ones waiting to retry.
    client
        .batch_execute("TRUNCATE outbox RESTART IDENTITY")
        .await
        .unwrap();
    write_five(&client, "good", 100).await;
    the_rows_written_after_the_truncate_are_delivered(&out, &client).await;
    assert!(relay_process.is_running());
    assert!(relay_process.terminate().await.success());
}

/// Writes 5 events for `destination`, keys `k1` to `k5`, payloads `offset` + 1 to + 5.
async fn write_five(client: &tokio_postgres::Client, destination: &str, offset: i32) {
    client
        .execute(
            "INSERT INTO outbox (destination, partition_key, event_type, payload)
             SELECT $1, 'k' || i, 't', to_jsonb($2 + i) FROM generate_series(1, 5) i",
            &[&destination, &offset],
        )
        .await
        .unwrap();
}

/// The 5 rows of destination `good` written after the TRUNCATE (payloads 101 to 105) are in
/// `out`, and acked: none is left behind.
async fn the_rows_written_after_the_truncate_are_delivered(
    out: &Path,
    client: &tokio_postgres::Client,
) {
    wait_for_lines(
        "the events written after the TRUNCATE",
        out,
        Duration::from_secs(60),
        |n| n >= 5,
    )
    .await;
    let lines = read_lines(out);
    let mut payloads: Vec<i64> = lines
        .iter()
        .map(|l| l["payload"].as_i64().unwrap())
        .collect();
    payloads.sort_unstable();
    assert_eq!(payloads, [101, 102, 103, 104, 105], "{lines:?}");
    let outbox = "SELECT count(*) FROM outbox";
    wait_for_count(
        "the new rows acked",
        client,
        outbox,
        0,
        Duration::from_secs(30),
    )
    .await;
}

/// A webhook that reads each request, reports its body, and answers 200 only once `open`
/// says so: the events it was sent stay in flight (published, not acked) until then.
async fn gated_webhook(
    open: tokio::sync::watch::Receiver<bool>,
) -> (String, tokio::sync::mpsc::UnboundedReceiver<Vec<u8>>) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (received, bodies) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let mut open = open.clone();
            let received = received.clone();
            tokio::spawn(async move {
                let Some((_, body)) = crate::support::read_http_request(&mut socket).await else {
                    return;
                };
                let _ = received.send(body);
                if open.wait_for(|open| *open).await.is_ok() {
                    let answer =
                        "HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
                    let _ = socket.write_all(answer.as_bytes()).await;
                    let _ = socket.shutdown().await;
                }
            });
        }
    });
    (format!("http://{addr}/{{destination}}"), bodies)
}

/// `TRUNCATE … RESTART IDENTITY` while events are in flight: the new rows take the old
/// rows' sequence ids, and the old events' acks, which named rows by sequence id alone,
/// deleted the new rows unsent. An ack (and every settle) now names the row by its
/// sequence id and its event id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncating_the_outbox_while_events_are_in_flight_keeps_the_rows_that_take_their_ids() {
    truncate_under_events_in_flight(&[]).await;
}

/// The same, unordered: an unordered claim leaves out no id the node holds, so it handed the
/// new rows out under the held ids (the engine drops them as held, and they go out once
/// their lease runs out), and the held events' acks were checked against the new rows'
/// event ids, and deleted them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncating_the_outbox_while_unordered_events_are_in_flight_keeps_the_rows_that_take_their_ids(
) {
    truncate_under_events_in_flight(&[
        "--ordering",
        "none",
        "--lease",
        "20s",
        "--publish-timeout",
        "16s",
    ])
    .await;
}

/// Five events held in flight by a webhook; the outbox truncated with RESTART IDENTITY and
/// five rows written for the file sink; the webhook answers: the five rows are delivered.
async fn truncate_under_events_in_flight(extra: &[&str]) {
    let url = fresh_pg_database().await;
    let dir = tempfile::tempdir().unwrap();
    let (open_tx, open) = tokio::sync::watch::channel(false);
    let (hook, mut bodies) = gated_webhook(open).await;
    let (mut relay_process, out) =
        relay_good_to_a_file_and_the_rest_to(dir.path(), &url, &hook, extra);
    let client = pg(&url).await;
    write_five(&client, "held", 0).await;
    for _ in 0..5 {
        tokio::time::timeout(Duration::from_secs(30), bodies.recv())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "the webhook did not get the 5 events: {}",
                    relay_process.logs()
                )
            })
            .unwrap();
    }
    // Published and unanswered: in flight. The new rows take sequence ids 1 to 5 again.
    client
        .batch_execute("TRUNCATE outbox RESTART IDENTITY")
        .await
        .unwrap();
    write_five(&client, "good", 100).await;
    if extra.contains(&"none") {
        // Handed out under the held ids before the held events are answered.
        let leased = "SELECT count(*) FROM outbox WHERE locked_until IS NOT NULL";
        wait_for_count(
            "the new rows leased",
            &client,
            leased,
            5,
            Duration::from_secs(30),
        )
        .await;
    }
    open_tx.send(true).unwrap();
    the_rows_written_after_the_truncate_are_delivered(&out, &client).await;
    assert!(relay_process.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_on_one_sqlite_file_deliver_each_event_once_in_key_order() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let url = sqlite_outbox(d);
    let start = |name: &str| {
        let sink = format!("file:{}", d.join(format!("{name}.jsonl")).display());
        RelayProcess::spawn(
            d,
            name,
            &[
                "run",
                "--database-url",
                &url,
                "--sink",
                &sink,
                "--http-addr",
                "",
            ],
            &[],
        )
    };
    let mut relays = [start("first"), start("second")];
    // Both relays are up before the events arrive, so they compete for every batch.
    for r in &relays {
        r.wait_for_log(
            "the relay to register",
            Duration::from_secs(30),
            "registered in the nodes table",
        )
        .await;
    }
    let conn = sqlite(d);
    for batch in 0..20 {
        conn.execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 20)
             INSERT INTO outbox (destination, partition_key, event_type, payload)
             SELECT 'orders', 'k' || (i % 10), 't', json_object('batch', ?1, 'i', i) FROM n",
            [batch],
        )
        .unwrap();
    }
    let delivered = || {
        let mut all = read_lines(&d.join("first.jsonl"));
        all.extend(read_lines(&d.join("second.jsonl")));
        all
    };
    eventually_explained(
        "400 events between the two relays",
        Duration::from_secs(60),
        || {
            relays
                .iter()
                .map(|r| r.logs())
                .collect::<Vec<_>>()
                .join("\n")
        },
        || {
            let n = delivered().len();
            async move { (n >= 400).then_some(()) }
        },
    )
    .await;
    for r in &mut relays {
        assert!(r.is_running());
        assert!(r.terminate().await.success(), "{}", r.logs());
        assert!(!r.logs().contains("database is locked"), "{}", r.logs());
    }
    let all = delivered();
    let ids: std::collections::HashSet<_> = all.iter().map(|l| l["event_id"].clone()).collect();
    assert_eq!((all.len(), ids.len()), (400, 400), "each event once");
    for name in ["first", "second"] {
        let mut last = std::collections::HashMap::new();
        for l in read_lines(&d.join(format!("{name}.jsonl"))) {
            let seq = l["sequence_id"].as_i64().unwrap();
            let key = l["partition_key"].as_str().unwrap().to_string();
            if let Some(prev) = last.insert(key, seq) {
                assert!(prev < seq, "{name}: per-key order");
            }
        }
    }
    let pending: i64 = conn
        .query_row(
            "SELECT count(*) FROM outbox WHERE delivered_at IS NULL",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(pending, 0);
}

// ---- Hosts and TLS ----

#[test]
fn unreachable_hosts_are_named_with_the_fix_and_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    for url in [
        "postgres://relay:hunter2@no-such-host.invalid/app",
        "mysql://root:hunter2@127.0.0.1:1/app",
    ] {
        let run = relay(
            dir.path(),
            &["run", "--drain", "--database-url", url, "--http-addr", ""],
        );
        let stderr = text(&run.stderr);
        assert_eq!(run.status.code(), Some(1), "{url}: {stderr}");
        assert!(
            stderr.contains("cannot connect") || stderr.contains("cannot use"),
            "{stderr}"
        );
        assert!(
            stderr.contains("host, port and credentials"),
            "the fix: {stderr}"
        );
        assert!(!stderr.contains("hunter2"), "{stderr}");
    }
}

/// A role the server will not let log in (no LOGIN; a rotated password and a pg_hba.conf
/// line are refused with the same codes) was told to "fix the configuration value named in
/// the message", which named none. The fix now names what the server can refuse a login for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_the_server_refuses_is_told_what_refuses_it() {
    let dir = tempfile::tempdir().unwrap();
    let url = fresh_pg_database().await;
    let database = url.rsplit('/').next().unwrap().to_string();
    let role = format!("nologin_{}", &database[2..14]);
    pg(&url)
        .await
        .batch_execute(&format!("CREATE ROLE {role} NOLOGIN"))
        .await
        .unwrap();
    let as_role = url.replacen("postgres@", &format!("{role}@"), 1);
    let run = relay(
        dir.path(),
        &[
            "run",
            "--drain",
            "--database-url",
            &as_role,
            "--http-addr",
            "",
        ],
    );
    let stderr = text(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("is not permitted to log in"), "{stderr}");
    assert!(stderr.contains("ALTER ROLE <role> LOGIN"), "{stderr}");
}

#[test]
fn a_bad_sslmode_is_a_configuration_error_naming_the_modes() {
    let dir = tempfile::tempdir().unwrap();
    let url = "postgres://relay@127.0.0.1:1/app?sslmode=always";
    let run = relay(
        dir.path(),
        &["run", "--drain", "--database-url", url, "--http-addr", ""],
    );
    let stderr = text(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("invalid sslmode \"always\"")
            && stderr.contains("use disable, prefer, require, verify-ca or verify-full"),
        "{stderr}"
    );
}

/// The fix part of a `check` problem line: the text after "(fix: ".
fn fix_of(report: &str) -> &str {
    report.split("(fix: ").nth(1).unwrap_or_default()
}

#[test]
fn sslmode_require_against_a_server_without_tls_is_told_about_tls_and_prefer_falls_back() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let server = OwnPostgres::init();
    server.start("-c ssl=off");
    let check = relay(d, &["check", "--database-url", &server.url("require")]);
    let report = text(&check.stdout);
    assert_eq!(
        check.status.code(),
        Some(1),
        "{report}{}",
        text(&check.stderr)
    );
    assert!(
        report.contains("TLS handshake"),
        "names the problem: {report}"
    );
    assert!(
        fix_of(&report).contains("require needs a server with ssl = on"),
        "names the fix: {report}"
    );
    let migrated = relay(d, &["migrate", "--database-url", &server.url("prefer")]);
    assert!(migrated.status.success(), "{}", text(&migrated.stderr));
}

#[test]
fn sslmode_disable_against_a_server_requiring_tls_is_told_to_use_require() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let server = OwnPostgres::init();
    let certs = outbox_testkit::server::test_certs();
    let read = |name: &str| std::fs::read(certs.path().join(name)).unwrap();
    let cert = server.write("server.pem", &read("server.pem"), 0o644);
    let key = server.write("server.key", &read("server.key"), 0o600);
    let hba = server.write(
        "pg_hba.conf",
        b"local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
        0o644,
    );
    server.start(&format!(
        "-c ssl=on -c ssl_cert_file={cert} -c ssl_key_file={key} -c hba_file={hba}"
    ));
    let migrated = relay(d, &["migrate", "--database-url", &server.url("require")]);
    assert!(migrated.status.success(), "{}", text(&migrated.stderr));
    let check = relay(d, &["check", "--database-url", &server.url("disable")]);
    let report = text(&check.stdout);
    // The URL's to fix: exit 2, as `run` exits.
    assert_eq!(
        check.status.code(),
        Some(2),
        "{report}{}",
        text(&check.stderr)
    );
    assert!(
        report.contains("no encryption"),
        "names the problem: {report}"
    );
    assert!(
        fix_of(&report).contains("sslmode=require"),
        "names the fix: {report}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_sqlite_file_stops_the_relay_with_the_recovery_fix_instead_of_resending_forever()
{
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let url = sqlite_outbox(d);
    let conn = sqlite(d);
    let payload = format!("{{\"x\": \"{}\"}}", "y".repeat(500));
    for i in 0..300 {
        conn.execute(
            "INSERT INTO outbox (destination, partition_key, event_type, payload)
             VALUES ('d', ?1, 't', ?2)",
            [format!("k{}", i % 10), payload.clone()],
        )
        .unwrap();
    }
    conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)")
        .unwrap();
    drop(conn);
    // Overwrite part of every third page past the first ten, as a failing disk might.
    let file = d.join("outbox.db");
    let mut bytes = std::fs::read(&file).unwrap();
    let pages = bytes.len() / 4096;
    for page in (10..pages.saturating_sub(2)).step_by(3) {
        bytes[page * 4096 + 100..page * 4096 + 300].fill(0xA5);
    }
    std::fs::write(&file, bytes).unwrap();
    let sink = format!("file:{}", d.join("events.jsonl").display());
    let mut relay = RelayProcess::spawn(
        d,
        "corrupt",
        &[
            "run",
            "--drain",
            "--database-url",
            &url,
            "--sink",
            &sink,
            "--http-addr",
            "",
        ],
        &[],
    );
    let status = relay.wait_exit().await;
    let logs = relay.logs();
    assert_eq!(status.code(), Some(1), "{logs}");
    assert!(
        logs.contains("malformed") && logs.contains(".recover"),
        "names the damage and the fix: {logs}"
    );
}
