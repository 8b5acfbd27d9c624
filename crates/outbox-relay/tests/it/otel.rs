//! OpenTelemetry: trace context from the outbox row to the broker message, and the relay's
//! own spans over OTLP. The collector is `outbox_testkit::otlp::OtlpReceiver`, a receiver
//! we wrote because no OpenTelemetry collector runs here: it checks what a real collector's
//! HTTP endpoint expects (`POST /v1/traces`, `application/x-protobuf`, an
//! `ExportTraceServiceRequest`). PostgreSQL is the shared test server; NATS is a private
//! nats-server with JetStream.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_testkit::nats::{stream, PrivateNats};
use outbox_testkit::otlp::{attribute, hex, OtlpReceiver, ReceivedSpan};
use outbox_testkit::{eventually, fresh_pg_database, wait_for_count};

use crate::support;

use crate::support::{pg, threads, RelayProcess, BIN};

/// The spec's example, and a second trace.
const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const STATE: &str = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE";
const OTHER: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
const MALFORMED: &str = "00-0af7651916cd43dd8448eb211c80319c-zzzz-01";

fn migrate(url: &str) {
    let out = std::process::Command::new(BIN)
        .args(["migrate"])
        .env("DATABASE_URL", url)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Inserts one event per (key, headers) the way an application does it, and returns
/// key → event id.
async fn insert(
    url: &str,
    destination: &str,
    rows: &[(&str, Option<&str>, Option<&str>)],
) -> BTreeMap<String, String> {
    let client = pg(url).await;
    let mut ids = BTreeMap::new();
    for (key, traceparent, tracestate) in rows {
        // What an application writes in its own transaction (README, "Trace context").
        let row = client
            .query_one(
                "INSERT INTO outbox (destination, partition_key, event_type, payload, headers)
                 VALUES ($1, $2, 'order.created', '{\"n\":1}',
                         jsonb_strip_nulls(jsonb_build_object('traceparent', $3::text,
                                                              'tracestate', $4::text,
                                                              'tenant', 'acme')))
                 RETURNING event_id::text",
                &[&destination, key, traceparent, tracestate],
            )
            .await
            .unwrap();
        ids.insert(key.to_string(), row.get(0));
    }
    ids
}

/// Listening TCP sockets the process holds: its socket inodes that /proc/net/tcp{,6} list in
/// state 0A (LISTEN).
fn listening_sockets(pid: &str) -> usize {
    let mine: BTreeSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|target| {
            let t = target.to_string_lossy().to_string();
            t.strip_prefix("socket:[")?
                .strip_suffix(']')
                .map(String::from)
        })
        .collect();
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .flat_map(|table| {
            table
                .lines()
                .skip(1)
                .filter_map(|line| {
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    (fields.get(3) == Some(&"0A")).then(|| fields.get(9).map(|s| s.to_string()))?
                })
                .collect::<Vec<_>>()
        })
        .filter(|inode| mine.contains(inode))
        .count()
}

const BATCH_THREAD: &str = "OpenTelemetry.T"; // "OpenTelemetry.Traces.BatchProcessor", cut

/// A private nats-server with a stream over `otel.>`, and every message published on it.
struct Nats {
    _server: PrivateNats,
    url: String,
    messages: Arc<Mutex<Vec<async_nats::Message>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Nats {
    async fn start() -> Nats {
        let server = PrivateNats::with_stream(stream("OTEL", &["otel.>"])).await;
        let url = server.url.clone();
        let client = server.client.clone();
        let mut subscriber = client.subscribe("otel.>").await.unwrap();
        client.flush().await.unwrap();
        let messages = Arc::new(Mutex::new(Vec::new()));
        let sink = messages.clone();
        let task = tokio::spawn(async move {
            use futures::StreamExt;
            let _client = client;
            while let Some(message) = subscriber.next().await {
                sink.lock().unwrap().push(message);
            }
        });
        Nats {
            _server: server,
            url,
            messages,
            task,
        }
    }

    async fn wait_for(&self, n: usize) -> Vec<async_nats::Message> {
        eventually(
            &format!("{n} messages on NATS"),
            Duration::from_secs(30),
            || {
                let got = self.messages.lock().unwrap().clone();
                async move { (got.len() >= n).then_some(got) }
            },
        )
        .await
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn header(message: &async_nats::Message, name: &str) -> Option<String> {
    message
        .headers
        .as_ref()?
        .get(name)
        .map(|v| v.as_str().to_string())
}

fn start_relay(dir: &Path, url: &str, sink: &str, env: &[(&str, &str)]) -> RelayProcess {
    let mut all = vec![("DATABASE_URL", url)];
    all.extend_from_slice(env);
    RelayProcess::spawn(
        dir,
        "relay",
        &[
            "run",
            "--sink",
            sink,
            "--http-addr",
            "",
            "--log-format",
            "json",
        ],
        &all,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_context_reaches_nats_and_the_relays_spans_link_to_it() {
    outbox_testkit::install_crypto();
    let collector = OtlpReceiver::start().await;
    let nats = Nats::start().await;
    let url = fresh_pg_database().await;
    migrate(&url);
    let ids = insert(
        &url,
        "otel.orders",
        &[
            ("with-state", Some(PARENT), Some(STATE)),
            ("plain", Some(OTHER), None),
            ("malformed", Some(MALFORMED), None),
            ("none", None, None),
        ],
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let endpoint = collector.endpoint();
    let mut relay = start_relay(
        dir.path(),
        &url,
        &nats.url,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            // Nothing leaves before shutdown unless the queue fills: the spans the test sees
            // are those the shutdown flushed.
            ("OTEL_BSP_SCHEDULE_DELAY", "3600000"),
            ("OTEL_SERVICE_NAME", "relay-under-test"),
        ],
    );

    the_consumer_sees_the_context_each_row_carried(&nats, &relay).await;
    the_ack_is_recorded_before_the_shutdown_flushes_the_spans(&url, &collector, &mut relay).await;
    let spans = what_the_exporter_sent_is_what_a_collector_takes(&collector);
    publish_spans_follow_the_conventions_with_a_link_per_trace(&spans, &ids);
    claim_and_ack_spans_count_every_event(&spans);

    let logs = relay.logs();
    assert_eq!(
        logs.matches("traceparent is malformed").count(),
        1,
        "the malformed value is reported once:\n{logs}"
    );
}

/// The consumer sees the context the row carried, under the W3C names.
async fn the_consumer_sees_the_context_each_row_carried(nats: &Nats, relay: &RelayProcess) {
    let messages = nats.wait_for(4).await;
    let by_key: BTreeMap<String, &async_nats::Message> = messages
        .iter()
        .map(|m| (header(m, "Outbox-Partition-Key").unwrap(), m))
        .collect();
    assert_eq!(
        header(by_key["with-state"], "traceparent").as_deref(),
        Some(PARENT)
    );
    assert_eq!(
        header(by_key["with-state"], "tracestate").as_deref(),
        Some(STATE)
    );
    assert_eq!(
        header(by_key["plain"], "traceparent").as_deref(),
        Some(OTHER)
    );
    assert_eq!(header(by_key["plain"], "tracestate"), None);
    assert_eq!(header(by_key["none"], "traceparent"), None);
    // A malformed one: delivered with its headers as written, but no trace context.
    assert_eq!(
        header(by_key["malformed"], "traceparent").as_deref(),
        Some(MALFORMED)
    );
    for m in by_key.values() {
        assert_eq!(
            header(m, "tenant").as_deref(),
            Some("acme"),
            "other headers still arrive"
        );
    }
    assert!(
        threads(&relay.pid()).iter().any(|t| t == BATCH_THREAD),
        "the exporter runs: {:?}",
        threads(&relay.pid())
    );
}

/// The ack of the batch is recorded before the shutdown flushes the spans.
async fn the_ack_is_recorded_before_the_shutdown_flushes_the_spans(
    url: &str,
    collector: &OtlpReceiver,
    relay: &mut RelayProcess,
) {
    let client = pg(url).await;
    wait_for_count(
        "the outbox to empty",
        &client,
        "SELECT count(*) FROM outbox",
        0,
        Duration::from_secs(30),
    )
    .await;
    assert!(
        collector.received().is_empty(),
        "the schedule delay holds spans back"
    );
    let status = relay.terminate().await;
    assert!(status.success(), "{status:?}\n{}", relay.logs());
}

/// What the exporter sent is what a collector takes.
fn what_the_exporter_sent_is_what_a_collector_takes(collector: &OtlpReceiver) -> Vec<ReceivedSpan> {
    let received = collector.received();
    assert!(!received.is_empty(), "spans were flushed at shutdown");
    for r in &received {
        assert_eq!((r.method.as_str(), r.path.as_str()), ("POST", "/v1/traces"));
        assert_eq!(r.content_type.as_deref(), Some("application/x-protobuf"));
        assert!(r.body.is_ok(), "protobuf body: {:?}", r.body);
    }
    let spans = collector.spans();
    let names: BTreeSet<&str> = spans.iter().map(ReceivedSpan::name).collect();
    for expected in ["claim outbox", "publish otel.orders", "ack outbox"] {
        assert!(names.contains(expected), "{expected} in {names:?}");
    }
    assert!(spans
        .iter()
        .all(|s| s.service.as_deref() == Some("relay-under-test")));

    spans
}

/// Publish spans: the messaging conventions, and a link per producing trace.
fn publish_spans_follow_the_conventions_with_a_link_per_trace(
    spans: &[ReceivedSpan],
    ids: &BTreeMap<String, String>,
) {
    let publishes: Vec<&ReceivedSpan> = spans
        .iter()
        .filter(|s| s.name() == "publish otel.orders")
        .collect();
    let mut linked = BTreeMap::new();
    let mut published = 0;
    for span in &publishes {
        assert_eq!(span.attribute("messaging.system").as_deref(), Some("nats"));
        assert_eq!(
            span.attribute("messaging.destination.name").as_deref(),
            Some("otel.orders")
        );
        assert_eq!(
            span.attribute("messaging.operation.type").as_deref(),
            Some("send")
        );
        assert_eq!(span.span.kind, 4, "SPAN_KIND_PRODUCER");
        published += span
            .attribute("messaging.batch.message_count")
            .unwrap()
            .parse::<usize>()
            .unwrap();
        for link in &span.span.links {
            let traceparent = format!(
                "00-{}-{}-{:02x}",
                hex(&link.trace_id),
                hex(&link.span_id),
                link.flags & 0xff
            );
            let id = attribute(&link.attributes, "messaging.message.id").unwrap();
            linked.insert(id, (traceparent, link.trace_state.clone()));
        }
    }
    assert_eq!(
        published, 4,
        "every event is counted in a publish span once"
    );
    let expected = BTreeMap::from([
        (
            ids["with-state"].clone(),
            (PARENT.to_string(), STATE.to_string()),
        ),
        (ids["plain"].clone(), (OTHER.to_string(), String::new())),
    ]);
    assert_eq!(
        linked, expected,
        "one link per valid traceparent, none for the others"
    );
}

/// Claim and ack spans count every event once.
fn claim_and_ack_spans_count_every_event(spans: &[ReceivedSpan]) {
    let claimed: usize = spans
        .iter()
        .filter(|s| s.name() == "claim outbox")
        .map(|s| {
            assert_eq!(
                s.attribute("messaging.operation.type").as_deref(),
                Some("receive")
            );
            s.attribute("messaging.batch.message_count")
                .unwrap()
                .parse::<usize>()
                .unwrap()
        })
        .sum();
    assert_eq!(claimed, 4);
    let acked: usize = spans
        .iter()
        .filter(|s| s.name() == "ack outbox")
        .map(|s| {
            assert_eq!(
                s.attribute("messaging.operation.type").as_deref(),
                Some("settle")
            );
            s.attribute("messaging.batch.message_count")
                .unwrap()
                .parse::<usize>()
                .unwrap()
        })
        .sum();
    assert_eq!(acked, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_otel_variables_nothing_is_exported_and_nothing_listens() {
    assert!(
        std::env::vars().all(|(k, _)| !k.starts_with("OTEL_")),
        "this test needs an environment without OTEL_* variables"
    );
    let url = fresh_pg_database().await;
    migrate(&url);
    insert(
        &url,
        "orders",
        &[
            ("k", Some(PARENT), Some(STATE)),
            ("bad", Some(MALFORMED), None),
            ("bad-too", Some("x"), None),
        ],
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("events.jsonl");
    let mut relay = start_relay(dir.path(), &url, &format!("file:{}", out.display()), &[]);
    support::wait_for_lines("the events", &out, Duration::from_secs(30), |n| n >= 3).await;
    let lines = support::read_lines(&out);
    let line = |key: &str| {
        lines
            .iter()
            .find(|l| l["partition_key"] == key)
            .unwrap()
            .clone()
    };
    assert_eq!(
        line("k")["headers"]["traceparent"],
        PARENT,
        "the file sink keeps the headers"
    );
    assert_eq!(
        line("bad")["headers"]["traceparent"],
        MALFORMED,
        "delivered as written"
    );
    // Reported once, with export off too.
    let logs = relay.logs();
    assert_eq!(
        logs.matches("traceparent is malformed").count(),
        1,
        "{logs}"
    );
    let pid = relay.pid();
    let names = threads(&pid);
    assert!(
        !names.iter().any(|t| t == BATCH_THREAD),
        "no exporter thread: {names:?}"
    );
    assert_eq!(listening_sockets(&pid), 0, "the relay listens on nothing");
    let status = relay.terminate().await;
    assert!(status.success());
    assert!(!relay.logs().contains("OTLP"), "{}", relay.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_never_answers_does_not_hold_up_the_shutdown() {
    // Accepts connections and never answers them.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", silent.local_addr().unwrap());
    let held = tokio::spawn(async move {
        let mut connections = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            connections.push(socket);
        }
    });
    let url = fresh_pg_database().await;
    migrate(&url);
    insert(&url, "orders", &[("k", Some(PARENT), None)]).await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("events.jsonl");
    let mut relay = RelayProcess::spawn(
        dir.path(),
        "relay",
        &[
            "run",
            "--sink",
            &format!("file:{}", out.display()),
            "--http-addr",
            "",
            "--log-format",
            "json",
            "--shutdown-timeout",
            "3s",
        ],
        &[
            ("DATABASE_URL", url.as_str()),
            (
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                &format!("{endpoint}/v1/traces"),
            ),
            ("OTEL_BSP_SCHEDULE_DELAY", "3600000"),
        ],
    );
    support::wait_for_lines("the event", &out, Duration::from_secs(30), |n| n >= 1).await;
    // Exit 0 means the relay's own bounded shutdown ended it, not the backstop (exit 1, two
    // seconds after the shutdown timeout).
    let status = relay.terminate().await;
    assert!(status.success(), "{status:?}\n{}", relay.logs());
    assert!(
        relay.logs().contains("did not take the last spans in time")
            || relay.logs().contains("could not export the last spans"),
        "{}",
        relay.logs()
    );
    held.abort();
}

/// `run` to stdout on a SQLite file in `dir`, with `extra` flags and `env`.
fn run_on_sqlite(
    dir: &std::path::Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> std::process::Output {
    std::process::Command::new(BIN)
        .args(["run", "--sink", "stdout", "--http-addr", ""])
        .args(extra)
        .current_dir(dir)
        .env(
            "DATABASE_URL",
            format!("sqlite:{}", dir.join("o.db").display()),
        )
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

/// `10s` is not milliseconds: the timeout was taken for the default, without a word.
#[test]
fn an_export_timeout_that_is_no_number_of_milliseconds_is_refused_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_on_sqlite(
        dir.path(),
        &["--drain"],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "10s"),
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("OTEL_EXPORTER_OTLP_TIMEOUT=10s") && stderr.contains("10000"),
        "{stderr}"
    );
}

#[test]
fn a_grpc_protocol_is_refused_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_on_sqlite(
        dir.path(),
        &[],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("set it to http/protobuf"), "{stderr}");
}

/// An endpoint that is no URL, and a header entry no request can carry, are refused naming
/// the variable (exit 2), the endpoint's password and the header's value unshown: the first
/// failed every export as a "network error", the second was dropped without a word and the
/// spans went without it.
#[test]
fn an_endpoint_or_header_the_exporter_cannot_use_is_refused_naming_the_variable() {
    let dir = tempfile::tempdir().unwrap();
    for (endpoint, headers, said) in [
        (
            "http://otel:s3cr3t@127.0.0.1:notaport",
            "",
            "OTEL_EXPORTER_OTLP_ENDPOINT=http://otel:***@127.0.0.1:notaport is no URL",
        ),
        (
            "http://127.0.0.1:4318",
            "x api key=s3cr3t",
            "OTEL_EXPORTER_OTLP_HEADERS: the entry \"x api key\"",
        ),
    ] {
        let out = run_on_sqlite(
            dir.path(),
            &[],
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
                ("OTEL_EXPORTER_OTLP_HEADERS", headers),
            ],
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(said), "{stderr}");
        assert!(!stderr.contains("s3cr3t"), "{stderr}");
    }
}

/// At `--log-level debug`, the exporter's own lines quoted its endpoint's URL, password and
/// all, when an export failed.
#[test]
fn the_exporters_debug_lines_do_not_show_the_endpoints_password() {
    let dir = tempfile::tempdir().unwrap();
    let relay = |args: &[&str], format: &str| {
        std::process::Command::new(BIN)
            .args(["--log-level", "debug", "--log-format", format])
            .args(args)
            .current_dir(dir.path())
            .env(
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                "http://otel:s3cr3t@127.0.0.1:1",
            )
            .output()
            .unwrap()
    };
    for format in ["text", "json"] {
        assert!(relay(&["send", "--destination", "d", "{}"], format)
            .status
            .success());
        let out = relay(
            &[
                "run",
                "--drain",
                "--sink",
                "file:/dev/null",
                "--http-addr",
                "",
            ],
            format,
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert!(stderr.contains("otel:***@"), "{format}: {stderr}");
        assert!(!stderr.contains("s3cr3t"), "{format}: {stderr}");
    }
}
