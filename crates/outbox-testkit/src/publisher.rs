//! The publisher conformance suite. Each broker's test implements [`BrokerHarness`] over a
//! real server and stamps the tests out with
//! [`publisher_conformance!`](crate::publisher_conformance).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::future::BoxFuture;
use outbox_core::{Disposition, Event, Headers, NewEvent, NodeId, Payload, Publisher, RetryPolicy};
use outbox_engine::{EngineConfig, WakeMode};
use outbox_publishers::{Routed, Router, Sink};

use crate::eventually;

/// A message as a consumer read it from the broker.
#[derive(Clone, Debug)]
pub struct Received {
    pub event_id: String,
    /// The ordering key, where the broker's message carries it.
    pub ordering_key: Option<String>,
    pub payload: Vec<u8>,
    /// The W3C trace context headers the consumer sees, under the broker's convention.
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
    /// Every header (or property, or field) the consumer sees, with the content type under
    /// `content-type` where the protocol has one; for the CloudEvents checks.
    pub headers: Vec<(String, String)>,
}

impl Received {
    /// The header `name`, compared without case (HTTP and NATS header names have none).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

pub trait BrokerHarness: Send + Sync {
    /// The sink under test.
    fn sink(&self) -> Arc<dyn Sink>;
    /// The target (subject, topic, queue, stream, URL, channel) this test publishes to.
    fn target(&self) -> String;
    /// Everything the target holds so far, in the broker's order.
    fn received(&self) -> BoxFuture<'_, Vec<Received>>;
    /// Whether the broker itself drops a second copy of an event id.
    fn broker_dedupes(&self) -> bool;
    /// A payload size the sink or broker refuses.
    fn oversized_bytes(&self) -> usize;
    /// Stops the broker (kill), then [`BrokerHarness::start_broker`] brings it back.
    fn stop_broker(&self) -> BoxFuture<'_, ()>;
    fn start_broker(&self) -> BoxFuture<'_, ()>;
}

/// Stamps out the suite. A second constructor, when given, builds the harness for the
/// restart test (for brokers too slow to start one per test, whose other tests share one).
#[macro_export]
macro_rules! publisher_conformance {
    ($new_harness:path) => {
        $crate::publisher_conformance!($new_harness, restart: $new_harness);
    };
    ($new_harness:path, restart: $restartable:path) => {
        $crate::publisher_conformance!(@tests $new_harness;
            delivers_every_event_in_order_per_key,
            redelivery_carries_the_same_event_id,
            trace_context_arrives,
            cloudevents_arrive,
            oversized_messages_fail_permanently,
            long_names_are_delivered_or_refused_for_good);
        $crate::publisher_conformance!(@tests $restartable; broker_restart_mid_stream_loses_nothing);
    };
    (@tests $new_harness:path; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $crate::install_crypto();
                let harness = $new_harness().await;
                $crate::publisher::$name(&harness).await;
            }
        )*
    };
}

pub fn event(seq: i64, key: &str, payload: Vec<u8>) -> Arc<Event> {
    Arc::new(Event {
        sequence_id: seq,
        event_id: uuid::Uuid::new_v4(),
        destination: "orders".into(),
        partition_key: Some(key.into()),
        event_type: "order.created".into(),
        payload: Payload::Bytes(payload),
        headers: Headers::from([("trace-id".to_string(), format!("t{seq}"))]),
        mutation_id: Some(format!("m{seq}")),
        rejected: false,
        attempts: 0,
        max_attempts: None,
        created_at: SystemTime::now(),
    })
}

fn routed(h: &dyn BrokerHarness, events: &[Arc<Event>]) -> Vec<Routed> {
    events
        .iter()
        .map(|e| Routed {
            cloudevents: None,
            event: e.clone(),
            target: h.target(),
        })
        .collect()
}

async fn wait_for(h: &dyn BrokerHarness, distinct: usize) -> Vec<Received> {
    eventually(
        &format!("{distinct} distinct messages at the broker"),
        Duration::from_secs(30),
        || async {
            let got = h.received().await;
            let ids: HashSet<&str> = got.iter().map(|r| r.event_id.as_str()).collect();
            (ids.len() >= distinct).then_some(got)
        },
    )
    .await
}

pub async fn delivers_every_event_in_order_per_key(h: &dyn BrokerHarness) {
    let sink = h.sink();
    let keys = 10;
    let rounds = 30;
    let mut sent = Vec::new();
    // Like the engine: each batch carries at most one event per key.
    for round in 0..rounds {
        let batch: Vec<_> = (0..keys)
            .map(|k| {
                let seq = (round * keys + k) as i64;
                event(
                    seq,
                    &format!("key-{k}"),
                    format!("{{\"round\":{round},\"key\":{k}}}").into_bytes(),
                )
            })
            .collect();
        let outcomes = sink.send(routed(h, &batch)).await;
        assert_eq!(outcomes.len(), batch.len());
        for o in &outcomes {
            assert!(o.is_ok(), "publish failed: {o:?}");
        }
        sent.extend(batch);
    }
    let received = wait_for(h, sent.len()).await;
    assert_eq!(
        received.len(),
        sent.len(),
        "no duplicates when nothing failed"
    );
    let by_id: HashMap<String, &Arc<Event>> =
        sent.iter().map(|e| (e.event_id.to_string(), e)).collect();
    let mut last: HashMap<String, i64> = HashMap::new();
    for r in &received {
        let e = by_id
            .get(&r.event_id)
            .unwrap_or_else(|| panic!("unknown event id {}", r.event_id));
        assert_eq!(
            r.payload,
            e.payload.as_bytes(),
            "payload arrives byte for byte"
        );
        if let Some(key) = &r.ordering_key {
            assert_eq!(
                key,
                e.ordering_key(),
                "the message carries its ordering key"
            );
        }
        if let Some(prev) = last.insert(e.ordering_key().to_string(), e.sequence_id) {
            assert!(
                prev < e.sequence_id,
                "key {} arrived out of order",
                e.ordering_key()
            );
        }
    }
}

/// The relay died after publishing a batch but before its ack, so it publishes the same
/// events again: every copy must carry the event's own id, the one consumers drop repeats by.
///
/// How many copies a consumer then reads depends on the broker, as each sink documents it:
/// - a broker that drops a repeated id itself ([`BrokerHarness::broker_dedupes`]: JetStream's
///   duplicate window on `Nats-Msg-Id`, the Redis sink's per-event key, SQS and SNS FIFO's
///   `MessageDeduplicationId`) keeps exactly one copy: both sends fall well inside its window
///   (2 minutes at the least), so a second copy is the broker failing to dedupe;
/// - every other broker (Kafka, RabbitMQ, webhooks, this suite's Ably stand-in, Kinesis,
///   EventBridge) stores what it is sent, so exactly two copies arrive, each with the same id.
///
/// A sink that stamped a fresh id on each send fails either way: its ids match no event.
pub async fn redelivery_carries_the_same_event_id(h: &dyn BrokerHarness) {
    let sink = h.sink();
    let batch: Vec<_> = (0..5)
        .map(|i| event(i, &format!("k{i}"), b"{}".to_vec()))
        .collect();
    assert!(sink.send(routed(h, &batch)).await.iter().all(|o| o.is_ok()));
    // The relay died before its ack: the same rows are claimed and published again.
    assert!(sink.send(routed(h, &batch)).await.iter().all(|o| o.is_ok()));
    // Sent last, so that where the broker keeps order a stray extra copy is already in
    // when the sentinel is.
    let sentinel = event(99, "sentinel", b"{}".to_vec());
    assert!(sink.send(routed(h, std::slice::from_ref(&sentinel))).await[0].is_ok());
    let copies = if h.broker_dedupes() { 1 } else { 2 };
    let expected = batch.len() * copies + 1;
    // Waits for as many messages as should arrive, not for particular ids: a sink that
    // loses the ids then fails on the counts below, naming what arrived.
    let received = eventually(
        &format!("{expected} messages at the broker"),
        Duration::from_secs(30),
        || async {
            let got = h.received().await;
            (got.len() >= expected).then_some(got)
        },
    )
    .await;
    let mut arrived: HashMap<&str, usize> = HashMap::new();
    for r in &received {
        *arrived.entry(r.event_id.as_str()).or_default() += 1;
    }
    for e in &batch {
        let id = e.event_id.to_string();
        assert_eq!(
            arrived.get(id.as_str()).copied().unwrap_or(0),
            copies,
            "event {} (id {id}): {copies} cop{} with its own id, as the broker {}; arrived: {arrived:?}",
            e.sequence_id,
            if copies == 1 { "y" } else { "ies" },
            if h.broker_dedupes() {
                "drops repeats"
            } else {
                "keeps every send"
            },
        );
    }
    let sentinel_id = sentinel.event_id.to_string();
    assert_eq!(
        arrived.get(sentinel_id.as_str()).copied(),
        Some(1),
        "the sentinel, sent once, arrives once; arrived: {arrived:?}"
    );
    assert_eq!(
        received.len(),
        expected,
        "nothing arrives but the events' copies and the sentinel; arrived: {arrived:?}"
    );
}

/// A `traceparent` and `tracestate` written with an event arrive where the broker's consumers
/// look for them (headers, properties, fields); a malformed `traceparent` is delivered as
/// written or not at all, never as something else, and does not fail the publish.
pub async fn trace_context_arrives(h: &dyn BrokerHarness) {
    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    const OTHER: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
    const STATE: &str = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE";
    const MALFORMED: &str = "00-not-a-trace-01";
    let with = |seq: i64, headers: &[(&str, &str)]| {
        let mut e = (*event(seq, &format!("trace-{seq}"), b"{}".to_vec())).clone();
        for (k, v) in headers {
            e.headers.insert(k.to_string(), v.to_string());
        }
        Arc::new(e)
    };
    let batch = vec![
        with(1, &[("traceparent", PARENT), ("tracestate", STATE)]),
        with(2, &[("traceparent", OTHER)]),
        with(3, &[("traceparent", MALFORMED)]),
        with(4, &[]),
    ];
    let outcomes = h.sink().send(routed(h, &batch)).await;
    assert!(outcomes.iter().all(|o| o.is_ok()), "{outcomes:?}");
    let received = wait_for(h, batch.len()).await;
    let of = |e: &Arc<Event>| {
        received
            .iter()
            .find(|r| r.event_id == e.event_id.to_string())
            .unwrap_or_else(|| panic!("event {} arrived", e.sequence_id))
            .clone()
    };
    let first = of(&batch[0]);
    assert_eq!(first.traceparent.as_deref(), Some(PARENT));
    assert_eq!(first.tracestate.as_deref(), Some(STATE));
    let second = of(&batch[1]);
    assert_eq!(second.traceparent.as_deref(), Some(OTHER));
    assert_eq!(second.tracestate, None);
    let malformed = of(&batch[2]);
    assert!(
        malformed.traceparent.is_none() || malformed.traceparent.as_deref() == Some(MALFORMED),
        "a malformed traceparent is passed on as written or not at all: {:?}",
        malformed.traceparent
    );
    let none = of(&batch[3]);
    assert_eq!((none.traceparent, none.tracestate), (None, None));
}

/// A route with `cloudevents` delivers CloudEvents 1.0 that the PyPI `cloudevents` SDK (a
/// consumer library, run from the venv `scripts/servers.sh` makes) reads back with the
/// right attributes and data: binary mode where the sink has a binding, structured mode on
/// every sink; binary mode on a sink without a binding is refused when the router is built.
pub async fn cloudevents_arrive(h: &dyn BrokerHarness) {
    use outbox_publishers::cloudevents::{Binding, CloudEvents, ContentMode};
    use outbox_publishers::{Route, Template};
    let sink = h.sink();
    let binding = sink.cloudevents_binding();
    let router = |mode| {
        let route = Route::new("*", "s", Template::parse(&h.target()).expect("a target"))
            .expect("a route")
            .with_cloudevents(CloudEvents {
                mode,
                source: Template::parse("/shop/{destination}").expect("a template"),
            });
        Router::new(vec![("s".to_string(), sink.clone())], vec![route])
    };
    let mut modes = vec![ContentMode::Structured];
    match binding {
        Some(_) => modes.push(ContentMode::Binary),
        None => {
            let refused = router(ContentMode::Binary)
                .err()
                .expect("binary mode is refused");
            assert!(refused.contains("structured"), "{refused}");
        }
    }
    for (n, mode) in modes.into_iter().enumerate() {
        let seq = 10 * n as i64;
        let mut e = (*event(seq, "customer 7", br#"{"total": 12.5}"#.to_vec())).clone();
        e.payload = Payload::from_json_text(r#"{"total": 12.5}"#.into()).expect("JSON");
        let e = Arc::new(e);
        let router = router(mode).expect("the router");
        let outcomes = router.publish(vec![e.clone()]).await;
        assert!(outcomes.iter().all(|o| o.is_ok()), "{mode:?}: {outcomes:?}");
        let id = e.event_id.to_string();
        let received = eventually(
            &format!("the {mode:?} CloudEvent at the broker"),
            Duration::from_secs(30),
            || async { h.received().await.into_iter().find(|r| r.event_id == id) },
        )
        .await;
        let read = crate::cloudevents_sdk::read(binding, mode, &received);
        assert_eq!(read["specversion"], "1.0", "{mode:?}: {read}");
        assert_eq!(read["id"], id.as_str(), "{mode:?}: {read}");
        assert_eq!(read["source"], "/shop/orders", "{mode:?}: {read}");
        assert_eq!(read["type"], "order.created", "{mode:?}: {read}");
        assert_eq!(read["subject"], "customer 7", "{mode:?}: {read}");
        assert_eq!(read["partitionkey"], "customer 7", "{mode:?}: {read}");
        assert_eq!(
            read["datacontenttype"], "application/json",
            "{mode:?}: {read}"
        );
        let time = outbox_core::time::rfc3339_micros(e.created_at).expect("a time");
        assert_eq!(
            read["time"].as_str().map(|t| t.replace("+00:00", "Z")),
            Some(time),
            "{mode:?}: {read}"
        );
        if mode == ContentMode::Binary && binding == Some(Binding::Kafka) {
            // The SDK also takes `partitionkey` from the record key: check the header itself.
            assert_eq!(received.header("ce_partitionkey"), Some("customer 7"));
        }
        assert_eq!(
            read["data"],
            serde_json::json!({"total": 12.5}),
            "{mode:?}: {read}"
        );
    }
}

pub async fn oversized_messages_fail_permanently(h: &dyn BrokerHarness) {
    let router = Router::single("under-test", h.sink());
    // Some brokers close the channel or connection on a refusal, under the messages sent
    // behind the refused one. The first round meets the broker's refusal; a sink that learns
    // the broker's limit from it has the later ones refused by the router, as its own.
    let routed = |id: i64, key: &str, payload: Vec<u8>| {
        let mut routed = (*event(id, key, payload)).clone();
        routed.destination = h.target();
        Arc::new(routed)
    };
    for round in 0..3 {
        let mut batch = vec![routed(round * 100, "big", vec![b'x'; h.oversized_bytes()])];
        for n in 1..=10 {
            batch.push(routed(round * 100 + n, "small", b"{}".to_vec()));
        }
        let outcomes = router.publish(batch).await;
        let err = outcomes[0]
            .as_ref()
            .expect_err("the oversized message must fail");
        assert_eq!(err.disposition(), Disposition::Permanent, "{err}");
        for (n, outcome) in outcomes.iter().enumerate().skip(1) {
            assert!(
                outcome.is_ok(),
                "round {round}: other events are not affected, but #{n}: {outcome:?}"
            );
        }
    }
}

/// An event whose type, key and header name are 300 bytes long (a `TEXT` column, a key
/// template over long values): delivered, or refused for good on its own; never a panic
/// (AMQP's short strings panicked lapin's conversion, which crashed the relay at every
/// restart), and the other events of the batch are delivered.
pub async fn long_names_are_delivered_or_refused_for_good(h: &dyn BrokerHarness) {
    let router = Router::single("under-test", h.sink());
    let long = "é".repeat(150);
    let mut odd = (*event(1, &long, b"{}".to_vec())).clone();
    odd.destination = h.target();
    odd.event_type = long.clone();
    odd.headers
        .insert(format!("x-{}", "h".repeat(298)), "v".into());
    let mut plain = (*event(2, "plain", b"{}".to_vec())).clone();
    plain.destination = h.target();
    let outcomes = router.publish(vec![Arc::new(odd), Arc::new(plain)]).await;
    if let Err(e) = &outcomes[0] {
        assert_eq!(e.disposition(), Disposition::Permanent, "{e}");
    }
    assert!(
        outcomes[1].is_ok(),
        "other events are not affected: {:?}",
        outcomes[1]
    );
}

/// Waits until the store's backlog meets `condition`.
async fn backlog_until(
    store: &Arc<outbox_store_sqlite::SqliteStore>,
    what: &str,
    limit: Duration,
    condition: fn(&outbox_core::store::Backlog) -> bool,
) {
    eventually(what, limit, || {
        let store = store.clone();
        async move {
            let b = outbox_core::OutboxStore::backlog(&*store).await.unwrap();
            condition(&b).then_some(())
        }
    })
    .await
}

pub async fn broker_restart_mid_stream_loses_nothing(h: &dyn BrokerHarness) {
    let dir = tempfile::tempdir().unwrap();
    let store =
        Arc::new(outbox_store_sqlite::SqliteStore::open(dir.path().join("o.db"), false).unwrap());
    store.migrate().await.unwrap();
    let insert = |from: usize| {
        let store = store.clone();
        let target = h.target();
        async move {
            let events = (from..from + 100)
                .map(|i| NewEvent {
                    destination: target.clone(),
                    partition_key: Some(format!("k{}", i % 7)),
                    event_type: "t".into(),
                    payload: Some(format!("{{\"i\":{i}}}")),
                    ..NewEvent::default()
                })
                .collect();
            outbox_core::OutboxStore::insert(&*store, events)
                .await
                .unwrap();
        }
    };
    let mut config = EngineConfig::new(NodeId::random());
    config.wake = WakeMode::Notify;
    config.settings.poll_interval = Duration::from_millis(50);
    config.settings.publish_timeout = Duration::from_secs(5);
    config.settings.retry = RetryPolicy {
        base_delay: Duration::from_millis(50),
        max_delay: Duration::from_millis(500),
        max_attempts: 10_000,
        max_attempts_by_type: HashMap::new(),
    };
    let router: Arc<dyn Publisher> = Arc::new(Router::single("under-test", h.sink()));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let engine = tokio::spawn(outbox_engine::run(
        store.clone(),
        router,
        config,
        async move {
            let _ = stopped.await;
        },
    ));
    insert(0).await;
    wait_for(h, 100).await;
    h.stop_broker().await;
    insert(100).await;
    // Give the engine time to hit the dead broker and back off.
    backlog_until(
        &store,
        "publishes to fail while the broker is down",
        Duration::from_secs(30),
        |b| b.retrying > 0,
    )
    .await;
    h.start_broker().await;
    backlog_until(
        &store,
        "the backlog to drain after the restart",
        Duration::from_secs(60),
        |b| b.pending == 0,
    )
    .await;
    stop.send(()).unwrap();
    let summary = engine.await.unwrap().unwrap();
    assert_eq!(summary.dead_lettered, 0);
    let received = wait_for(h, 200).await;
    let ids: HashSet<&str> = received.iter().map(|r| r.event_id.as_str()).collect();
    assert_eq!(ids.len(), 200);
}
