//! The binary with a config file of several sinks and routes, against a real nats-server (and
//! RabbitMQ, for what its returns log).

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use outbox_testkit::eventually;
use outbox_testkit::nats::{stream, PrivateNats};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::{RelayProcess, BIN};

fn relay(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(args)
        .current_dir(dir)
        .env_remove("DATABASE_URL")
        .output()
        .unwrap()
}

/// GET on the relay's HTTP server; (status, body).
async fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    Some((
        status,
        response
            .split("\r\n\r\n")
            .nth(1)
            .unwrap_or_default()
            .to_string(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_send_each_destination_to_its_sink_and_readyz_follows_the_broker() {
    outbox_testkit::install_crypto();
    let nats = PrivateNats::with_stream(stream("EVENTS", &["events.>"])).await;
    let dir = tempfile::tempdir().unwrap();
    let audit = dir.path().join("audit.jsonl");
    write_routes_to_nats_and_a_file(dir.path(), &nats.url, &audit);
    send_to_routed_and_unrouted_destinations(dir.path());
    let log = dir.path().join("relay.log");
    let mut relay_process = RelayProcess::spawn(dir.path(), "relay", &["run"], &[]);

    each_routed_event_reaches_its_sink(&nats.js, &audit).await;
    the_unrouted_destination_is_retried_then_dead_lettered(&dir.path().join("o.db")).await;
    let addr = readyz_follows_the_broker(&log, &nats).await;
    the_counters_move_once_the_settles_commit(&addr).await;

    let status = relay_process.terminate().await;
    assert!(status.success());
}

/// Sinks `nats` and `audit` (a file), routes `orders.*` to NATS under `events.`, `audit` to
/// the file, and nothing for other destinations.
fn write_routes_to_nats_and_a_file(dir: &Path, nats_url: &str, audit: &Path) {
    std::fs::write(
        dir.join("outbox-relay.toml"),
        format!(
            r#"
database_url = "sqlite:{db}"
http_addr = "127.0.0.1:0"
log_format = "json"
[retry]
base_delay = "50ms"
max_delay = "100ms"
max_attempts = 3

[sinks.nats]
uri = "{nats_url}"

[sinks.audit]
uri = "file:{audit}"

[[routes]]
destinations = "orders.*"
sink = "nats"
target = "events.{{destination}}"

[[routes]]
destinations = "audit"
sink = "audit"
"#,
            db = dir.join("o.db").display(),
            audit = audit.display(),
        ),
    )
    .unwrap();
}

fn send_to_routed_and_unrouted_destinations(dir: &Path) {
    for (destination, key) in [
        ("orders.eu", "c1"),
        ("orders.eu", "c2"),
        ("orders.us", "c1"),
        ("audit", "a"),
        ("invoices", "i"),
    ] {
        let out = relay(
            dir,
            &[
                "send",
                "--destination",
                destination,
                "--key",
                key,
                "{\"ok\":true}",
            ],
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

async fn each_routed_event_reaches_its_sink(js: &async_nats::jetstream::Context, audit: &Path) {
    let mut stream = js.get_stream("EVENTS").await.unwrap();
    eventually(
        "three order events in JetStream",
        Duration::from_secs(30),
        || {
            let n = futures::executor::block_on(stream.info())
                .map(|i| i.state.messages)
                .unwrap_or(0);
            async move { (n == 3).then_some(()) }
        },
    )
    .await;
    let subjects: Vec<String> =
        futures::future::join_all((1..=3).map(|seq| stream.get_raw_message(seq)))
            .await
            .into_iter()
            .map(|m| m.unwrap().subject.to_string())
            .collect();
    assert_eq!(
        subjects.iter().filter(|s| *s == "events.orders.eu").count(),
        2
    );
    assert_eq!(
        subjects.iter().filter(|s| *s == "events.orders.us").count(),
        1
    );
    eventually(
        "the audit event in its file",
        Duration::from_secs(30),
        || {
            let n = std::fs::read_to_string(audit)
                .unwrap_or_default()
                .lines()
                .count();
            async move { (n == 1).then_some(()) }
        },
    )
    .await;
}

/// The unrouted destination is retried, then dead-lettered with the reason.
async fn the_unrouted_destination_is_retried_then_dead_lettered(db: &Path) {
    let dead = eventually("the unrouted event to be dead-lettered", Duration::from_secs(30), || {
        let conn = rusqlite::Connection::open(db).unwrap();
        let row: Option<(i64, String)> = conn
            .query_row("SELECT attempts, last_error FROM outbox_dead_letters WHERE destination = 'invoices'", [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .ok();
        async move { row }
    })
    .await;
    assert_eq!(dead.0, 3, "max_attempts");
    assert!(
        dead.1.contains("no route matches destination \"invoices\""),
        "{}",
        dead.1
    );
}

/// /readyz follows the broker.
async fn readyz_follows_the_broker(log: &Path, nats: &PrivateNats) -> String {
    let addr = eventually(
        "the HTTP address in the log",
        Duration::from_secs(10),
        || {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let addr = text
                .lines()
                .find(|l| l.contains("HTTP endpoints"))
                .and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .and_then(|v| v["addr"].as_str().map(String::from));
            async move { addr }
        },
    )
    .await;
    assert_eq!(get(&addr, "/readyz").await.unwrap().0, 200);
    nats.stop();
    let (_, body) = eventually(
        "/readyz to report the broker down",
        Duration::from_secs(30),
        || {
            let addr = addr.clone();
            async move { get(&addr, "/readyz").await.filter(|(s, _)| *s == 503) }
        },
    )
    .await;
    assert!(
        body.contains(&format!("nats://127.0.0.1:{}", nats.port)),
        "{body}"
    );
    nats.resume();
    eventually("/readyz to recover", Duration::from_secs(30), || {
        let addr = addr.clone();
        async move { get(&addr, "/readyz").await.filter(|(s, _)| *s == 200) }
    })
    .await;
    addr
}

/// The counters move when the settle statements commit, after the sinks received.
async fn the_counters_move_once_the_settles_commit(addr: &str) {
    let published = "outbox_events_published_total{destination=\"orders.eu\"} 2";
    let dead = "outbox_events_dead_lettered_total{destination=\"invoices\"} 1";
    eventually("the counters in /metrics", Duration::from_secs(30), || {
        let addr = addr.to_string();
        async move {
            let metrics = get(&addr, "/metrics").await?.1;
            (metrics.contains(published) && metrics.contains(dead)).then_some(())
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_while_publishing_to_jetstream_leaves_no_duplicate_in_the_stream() {
    outbox_testkit::install_crypto();
    let nats = PrivateNats::with_stream(stream("ORDERS", &["orders"])).await;
    let (nats_url, js) = (nats.url.clone(), nats.js.clone());
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("o.db");
    let url = format!("sqlite:{}", db.display());
    assert!(relay(dir.path(), &["migrate", "--database-url", &url])
        .status
        .success());

    // A writer commits 2,000 events over 20 keys while the relay runs.
    let total = 2_000;
    let writer = {
        let db = db.clone();
        tokio::task::spawn_blocking(move || {
            let mut conn = rusqlite::Connection::open(&db).unwrap();
            conn.busy_timeout(Duration::from_secs(10)).unwrap();
            for chunk in 0..(total / 50) {
                let tx = conn.transaction().unwrap();
                for i in chunk * 50..(chunk + 1) * 50 {
                    tx.execute(
                        "INSERT INTO outbox (event_id, destination, partition_key, event_type, payload) VALUES (?1, 'orders', ?2, 't', ?3)",
                        rusqlite::params![uuid::Uuid::new_v4().to_string(), format!("k{}", i % 20), format!("{{\"i\":{i}}}")],
                    )
                    .unwrap();
                }
                tx.commit().unwrap();
            }
        })
    };
    let start = |name: &str| {
        let args = [
            "run",
            "--database-url",
            &url,
            "--sink",
            &nats_url,
            "--lease",
            "1s",
            "--publish-timeout",
            "700ms",
            "--batch-size",
            "100",
            "--http-addr",
            "",
        ];
        RelayProcess::spawn(dir.path(), name, &args, &[])
    };
    let count = |js: async_nats::jetstream::Context| async move {
        let mut stream = js.get_stream("ORDERS").await.unwrap();
        stream.info().await.map(|i| i.state.messages).unwrap_or(0)
    };
    let mut first = start("first");
    eventually(
        "the first relay to publish",
        Duration::from_secs(30),
        || {
            let js = js.clone();
            async move { (count(js).await >= 300).then_some(()) }
        },
    )
    .await;
    first.kill9(); // mid-stream
    let _second = start("second");
    writer.await.unwrap();
    eventually("every event in the stream", Duration::from_secs(60), || {
        let js = js.clone();
        let db = db.clone();
        async move {
            let left: i64 = rusqlite::Connection::open(&db)
                .unwrap()
                .query_row("SELECT count(*) FROM outbox", [], |r| r.get(0))
                .unwrap();
            (left == 0 && count(js).await >= total as u64).then_some(())
        }
    })
    .await;
    assert_eq!(
        count(js.clone()).await,
        total as u64,
        "JetStream dropped every redelivered copy"
    );
    // First deliveries per key are in sequence order: the payload's i grows per key.
    let stream = js.get_stream("ORDERS").await.unwrap();
    let mut last: std::collections::HashMap<String, i64> = Default::default();
    for seq in 1..=total as u64 {
        let m = stream.get_raw_message(seq).await.unwrap();
        let key = m
            .headers
            .get("Outbox-Partition-Key")
            .unwrap()
            .as_str()
            .to_string();
        let i = serde_json::from_slice::<serde_json::Value>(&m.payload).unwrap()["i"]
            .as_i64()
            .unwrap();
        if let Some(prev) = last.insert(key.clone(), i) {
            assert!(prev < i, "key {key}: {prev} then {i}");
        }
    }
}

/// A webhook receiver that takes minutes to answer holds back no event of another sink:
/// a batch's outcomes come back together, and the file's events used to wait in one with
/// the webhook's (their key's next event with them), until the webhook timed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_receiver_holds_back_no_event_of_another_sink() {
    let receiver = outbox_testkit::SlowWebhook::start(Duration::from_secs(600))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let audit = dir.path().join("audit.jsonl");
    // Timeouts past the test's patience: before the fix, nothing but the webhook's answer
    // could free the file's key.
    std::fs::write(
        dir.path().join("outbox-relay.toml"),
        format!(
            r#"
database_url = "sqlite:{db}"
http_addr = "127.0.0.1:0"
log_format = "json"
lease = "300s"
publish_timeout = "280s"
shutdown_timeout = "1s"

[sinks.hook]
uri = "http://{addr}/events"
timeout = "180s"

[sinks.audit]
uri = "file:{audit}"

[[routes]]
destinations = "slow"
sink = "hook"

[[routes]]
destinations = "audit"
sink = "audit"
"#,
            db = dir.path().join("o.db").display(),
            addr = receiver.addr,
            audit = audit.display(),
        ),
    )
    .unwrap();
    let mut destinations = vec!["slow"];
    destinations.extend(["audit"; 20]);
    for destination in destinations {
        let out = relay(
            dir.path(),
            &["send", "--destination", destination, "{\"ok\":true}"],
        );
        assert!(out.status.success(), "{out:?}");
    }
    let mut relay_process = RelayProcess::spawn(dir.path(), "relay", &["run"], &[]);
    eventually(
        "the 20 audit events in their file while the webhook holds its one",
        Duration::from_secs(60),
        || {
            let lines = std::fs::read_to_string(&audit)
                .map(|text| text.lines().count())
                .unwrap_or(0);
            let waiting = receiver.waiting();
            async move { (lines == 20 && waiting == 1).then_some(()) }
        },
    )
    .await;
    relay_process.terminate().await;
}

/// A message RabbitMQ returned (no queue for its routing key): the AMQP client logged it at
/// WARN with its body and headers as byte lists, so an `authorization` header or a card
/// number reached the log at the default level. The sink's own error names the failure
/// without them.
#[test]
fn a_message_rabbitmq_returns_is_not_logged_with_its_body_or_headers() {
    let Ok(amqp) = std::env::var("OUTBOX_TEST_AMQP_URL") else {
        panic!("OUTBOX_TEST_AMQP_URL is not set: run the tests through scripts/test.sh");
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let queue = format!("no-such-queue-{}", uuid::Uuid::new_v4().simple());
    std::fs::write(
        d.join("outbox-relay.toml"),
        format!(
            "http_addr = \"\"\n[retry]\nbase_delay = \"10ms\"\nmax_attempts = 2\n\
             [sinks.rabbit]\nuri = \"{amqp}\"\n\
             [[routes]]\ndestinations = \"*\"\nsink = \"rabbit\"\ntarget = \"{queue}\"\n"
        ),
    )
    .unwrap();
    assert!(relay(d, &["migrate"]).status.success());
    let sent = relay(
        d,
        &[
            "send",
            "--destination",
            "payments",
            "--type",
            "card.charged",
            "--header",
            "authorization=Bearer s3cr3t-token",
            r#"{"card":"4111111111111111"}"#,
        ],
    );
    assert!(sent.status.success(), "{sent:?}");
    let out = relay(d, &["run", "--drain"]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("unroutable (NO_ROUTE)"), "{log}");
    // The secret and the card number as text, and as the byte lists the client printed.
    let bytes = |text: &str| {
        let listed: Vec<String> = text.bytes().map(|b| b.to_string()).collect();
        listed.join(", ")
    };
    for secret in ["s3cr3t-token", "4111111111111111"] {
        assert!(!log.contains(secret), "{secret} in {log}");
        assert!(!log.contains(&bytes(secret)), "{secret} as bytes in {log}");
    }
}

/// Waits until the `/metrics` of `relay` (at `addr`) satisfies `done`.
async fn until_metrics(relay: &RelayProcess, addr: &str, what: &str, done: impl Fn(&str) -> bool) {
    let done = &done;
    outbox_testkit::eventually_explained(
        what,
        Duration::from_secs(60),
        || relay.logs(),
        || {
            let addr = addr.to_string();
            async move { done(&get(&addr, "/metrics").await?.1).then_some(()) }
        },
    )
    .await;
}

/// A config file in `dir` for the SQLite store `o.db` with the HTTP endpoints and JSON logs,
/// quick retries (`retry`: more top-level settings, then a `[retry]` table's), one sink
/// (`sink`: its settings) and a route of every destination to it (`route`: more of its
/// settings).
fn write_one_sink(dir: &Path, retry: &str, sink: &str, route: &str) {
    std::fs::write(
        dir.join("outbox-relay.toml"),
        format!(
            "database_url = \"sqlite:o.db\"\nhttp_addr = \"127.0.0.1:0\"\nlog_format = \"json\"\n\
             {retry}\nbase_delay = \"20ms\"\nmax_delay = \"100ms\"\n\
             [sinks.one]\n{sink}[[routes]]\ndestinations = \"*\"\nsink = \"one\"\n{route}"
        ),
    )
    .unwrap();
}

/// A broker away for longer than the retries last: the events wait, spending none of their
/// attempts while it confirms nothing, and all go out once it is back. Every failure counted
/// before, so an outage longer than the retries (about an hour at the defaults; here two
/// attempts 20-100 ms apart) dead-lettered every event that would have gone out after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_longer_than_the_retries_dead_letters_nothing() {
    outage_longer_than_the_retries(["k0", "k1", "k2", "k3", "k4"], 40.0).await;
}

/// The same outage, on an outbox whose events share one key: only its head goes out, so one
/// event fails alone, which is no evidence against the broker by itself (a receiver may
/// refuse that event alone). The sink's health check, failing too, is: the head spends none
/// of its attempts either. It was dead-lettered at its two, and the next became the head.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_of_an_outbox_of_one_key_dead_letters_nothing() {
    outage_longer_than_the_retries(["k"; 5], 10.0).await;
}

/// Sends the first of `keys`' events and sees it delivered, cuts the broker, sends the rest,
/// waits for `retries` (each at least a second: a publish's timeout), heals: every event must
/// arrive, none dead-lettered.
async fn outage_longer_than_the_retries(keys: [&str; 5], retries: f64) {
    outbox_testkit::install_crypto();
    let (_nats, deliveries, proxy, broker_url) = crate::support::nats_behind_a_proxy().await;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_one_sink(
        d,
        "publish_timeout = \"1s\"\n[retry]\nmax_attempts = 2",
        &format!("uri = \"{broker_url}\"\n"),
        "target = \"orders\"\n",
    );
    let send = |key: &str| {
        let out = relay(d, &["send", "--destination", "orders", "--key", key, "{}"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    send(keys[0]);
    let mut relay_process = RelayProcess::spawn(d, "relay", &["run"], &[]);
    let addr = crate::support::http_addr(&relay_process).await;
    let delivered = |n: usize| {
        let (deliveries, relay_process) = (&deliveries, &relay_process);
        outbox_testkit::eventually_explained(
            "the events delivered",
            Duration::from_secs(60),
            move || relay_process.logs(),
            move || {
                let done = deliveries.len() >= n;
                async move { done.then_some(()) }
            },
        )
    };
    delivered(1).await;

    let handle = proxy.handle();
    handle.cut();
    for key in &keys[1..] {
        send(key);
    }
    // Five times the events' attempts: ten an event, or ten of the one key's head.
    until_metrics(
        &relay_process,
        &addr,
        "the events retried past their attempts",
        |m| {
            crate::support::metric_value(m, "outbox_events_retried_total")
                .is_some_and(|n| n >= retries)
        },
    )
    .await;
    handle.heal();
    delivered(5).await;
    let metrics = get(&addr, "/metrics").await.unwrap().1;
    assert!(
        !metrics.contains("outbox_events_dead_lettered_total{"),
        "{metrics}"
    );
    assert!(
        relay_process
            .logs()
            .contains("spending none of the events' attempts"),
        "{}",
        relay_process.logs()
    );
    let status = relay_process.terminate().await;
    assert!(status.success(), "{status:?}");
    let dead = relay(d, &["dead", "list", "--json"]);
    assert!(dead.status.success());
    assert!(
        dead.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&dead.stdout)
    );
}

/// A receiver that answers 503 to one event alone, on an otherwise quiet relay: the only
/// failures its group sees are that event's, which is no evidence against the receiver, so
/// each counts and the event is dead-lettered at its attempts. Any streak spared it, and it
/// was retried for good, `/readyz` calling the receiver down. The event knocks the receiver
/// over for a moment (its gateway answering 502): the health check that decides runs just
/// before the retry, when it is back. Run right after the failure, it failed, and the event
/// was spared for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_a_receiver_alone_refuses_is_dead_lettered_on_a_quiet_relay() {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let receiver = listener.local_addr().unwrap();
    // The poison knocks the receiver over: its gateway answers 502 for a moment after.
    let knocked_over = Arc::new(std::sync::Mutex::new(None::<std::time::Instant>));
    let checked_while_down = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let checks_seen = checked_while_down.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let (knocked_over, checked_while_down) = (knocked_over.clone(), checks_seen.clone());
            tokio::spawn(async move {
                let Some((_, body)) = crate::support::read_http_request(&mut socket).await else {
                    return;
                };
                let restarting = knocked_over
                    .lock()
                    .unwrap()
                    .is_some_and(|at| at.elapsed() < Duration::from_millis(8));
                if restarting {
                    checked_while_down.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                let status = match String::from_utf8_lossy(&body).contains("poison") {
                    _ if restarting => "502 Bad Gateway",
                    true => {
                        *knocked_over.lock().unwrap() = Some(std::time::Instant::now());
                        "503 Service Unavailable"
                    }
                    false => "204 No Content",
                };
                let answer =
                    format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                let _ = socket.write_all(answer.as_bytes()).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_one_sink(
        d,
        "[retry]\nmax_attempts = 3",
        &format!("uri = \"http://{receiver}/hook\"\n"),
        "",
    );
    for (key, payload) in [("a", r#"{"ok": true}"#), ("b", r#"{"poison": true}"#)] {
        let out = relay(
            d,
            &["send", "--destination", "orders", "--key", key, payload],
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut relay_process = RelayProcess::spawn(d, "relay", &["run"], &[]);
    let addr = crate::support::http_addr(&relay_process).await;
    until_metrics(
        &relay_process,
        &addr,
        "the refused event dead-lettered",
        |m| m.contains("outbox_events_dead_lettered_total{destination=\"orders\"} 1"),
    )
    .await;
    let status = relay_process.terminate().await;
    assert!(status.success(), "{status:?}");
    let dead = relay(d, &["dead", "list", "--json"]);
    let listed = String::from_utf8_lossy(&dead.stdout);
    assert!(listed.contains("\"attempts\":3"), "{listed}");
    // The retries come at least 10 ms after a failure (half the 20 ms base delay).
    assert_eq!(
        checked_while_down.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "a request reached the receiver while the poison had it down"
    );
}
