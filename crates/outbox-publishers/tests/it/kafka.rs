//! The publisher conformance suite against librdkafka's mock cluster: three in-process
//! brokers that speak the real Kafka protocol (no Kafka broker is packaged for Debian).
//! The `tansu` module below repeats the basic checks against Tansu when it is installed.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_publishers::{Sink, SinkConfig};
use outbox_testkit::publisher::{BrokerHarness, Received};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use rdkafka::ClientConfig;

/// The mock cluster's handle holds a raw pointer, so Rust cannot see that librdkafka's mock
/// API is thread-safe (each call takes the cluster's lock). Tests only call it through
/// `&self`, from any thread.
struct Cluster(MockCluster<'static, DefaultProducerContext>);
#[allow(unsafe_code)] // a test's mock broker (above); the only other unsafe is WAL capture's SO_RCVLOWAT
unsafe impl Send for Cluster {}
#[allow(unsafe_code)]
unsafe impl Sync for Cluster {}

const BROKERS: i32 = 3;

struct KafkaHarness {
    cluster: Option<Cluster>,
    sink: Arc<dyn Sink>,
    topic: String,
    consumer: StreamConsumer,
    received: Mutex<Vec<Received>>,
}

async fn new_harness() -> KafkaHarness {
    let cluster = MockCluster::new(BROKERS).unwrap();
    let topic = format!("orders-{}", uuid::Uuid::new_v4().simple());
    cluster.create_topic(&topic, 3, 3).unwrap();
    let servers = cluster.bootstrap_servers();
    harness_for(servers, topic, Some(Cluster(cluster))).await
}

async fn harness_for(servers: String, topic: String, cluster: Option<Cluster>) -> KafkaHarness {
    let config: SinkConfig = serde_json::from_value(serde_json::json!({
        "uri": format!("kafka://{servers}"),
        "timeout": "5s",
    }))
    .unwrap();
    let sink = outbox_publishers::build_sink("kafka", &config)
        .await
        .unwrap();
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &servers)
        .set("group.id", format!("g-{topic}"))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    consumer.subscribe(&[&topic]).unwrap();
    KafkaHarness {
        cluster,
        sink,
        topic,
        consumer,
        received: Mutex::default(),
    }
}

impl BrokerHarness for KafkaHarness {
    fn sink(&self) -> Arc<dyn Sink> {
        self.sink.clone()
    }

    fn target(&self) -> String {
        self.topic.clone()
    }

    fn received(&self) -> BoxFuture<'_, Vec<Received>> {
        async move {
            while let Ok(Ok(message)) =
                tokio::time::timeout(Duration::from_millis(300), self.consumer.recv()).await
            {
                let header = |name: &str| {
                    message.headers().and_then(|h| {
                        h.iter()
                            .find(|x| x.key == name)
                            .and_then(|x| x.value)
                            .map(|v| String::from_utf8_lossy(v).to_string())
                    })
                };
                self.received.lock().unwrap().push(Received {
                    event_id: header("outbox-event-id").unwrap_or_default(),
                    ordering_key: message
                        .key()
                        .map(|k| String::from_utf8_lossy(k).to_string()),
                    payload: message.payload().unwrap_or_default().to_vec(),
                    traceparent: header("traceparent"),
                    tracestate: header("tracestate"),
                    headers: message
                        .headers()
                        .map(|h| {
                            h.iter()
                                .map(|x| {
                                    let value = x.value.unwrap_or_default();
                                    (
                                        x.key.to_string(),
                                        String::from_utf8_lossy(value).to_string(),
                                    )
                                })
                                .collect()
                        })
                        .unwrap_or_default(),
                });
            }
            self.received.lock().unwrap().clone()
        }
        .boxed()
    }

    fn broker_dedupes(&self) -> bool {
        false // consumers de-duplicate on the outbox-event-id header
    }

    fn oversized_bytes(&self) -> usize {
        2 * 1024 * 1024 // above the producer's 1 MB message.max.bytes
    }

    fn stop_broker(&self) -> BoxFuture<'_, ()> {
        async move {
            let cluster = self
                .cluster
                .as_ref()
                .expect("restart tests use the mock cluster");
            for id in 1..=BROKERS {
                cluster.0.broker_down(id).unwrap();
            }
        }
        .boxed()
    }

    fn start_broker(&self) -> BoxFuture<'_, ()> {
        async move {
            let cluster = self
                .cluster
                .as_ref()
                .expect("restart tests use the mock cluster");
            for id in 1..=BROKERS {
                cluster.0.broker_up(id).unwrap();
            }
        }
        .boxed()
    }
}

outbox_testkit::publisher_conformance!(new_harness);

/// A produce the broker refuses as the record's own (an invalid topic name, a topic's
/// policy) was retried as a broker that is down, its key held for an hour.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_the_broker_refuses_as_its_own_fails_permanently() {
    use rdkafka::types::RDKafkaApiKey;
    use rdkafka::types::RDKafkaRespErr;
    let h = new_harness().await;
    let cluster = &h.cluster.as_ref().unwrap().0;
    cluster.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_POLICY_VIOLATION],
    );
    let e = outbox_testkit::publisher::event(5, "customer-5", b"{}".to_vec());
    let routed = outbox_publishers::Routed {
        cloudevents: None,
        event: e,
        target: h.topic.clone(),
    };
    let outcome = h.sink.send(vec![routed]).await.remove(0);
    let err = outcome.expect_err("refused");
    assert_eq!(
        err.disposition(),
        outbox_core::Disposition::Permanent,
        "{err}"
    );
}

/// The broker refuses a record batch over its topic's `max.message.bytes` whole, failing
/// every record in it however small (librdkafka does not split it). Retried as they were,
/// the records came back together and were refused together to their attempt limit: small
/// events of other keys dead-lettered with the one too large. Each is sent again alone:
/// the small ones are delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_small_records_of_a_batch_refused_as_too_large_are_delivered_alone() {
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    let h = new_harness().await;
    let cluster = &h.cluster.as_ref().unwrap().0;
    // One produce request refused; three partitions' requests at most carry the batch.
    cluster.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE],
    );
    let batch = (1..=6)
        .map(|i| outbox_publishers::Routed {
            cloudevents: None,
            event: outbox_testkit::publisher::event(i, &format!("customer-{i}"), b"{}".to_vec()),
            target: h.topic.clone(),
        })
        .collect();
    let outcomes = h.sink.send(batch).await;
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    let expected: std::collections::BTreeSet<String> =
        (1..=6).map(|i| format!("customer-{i}")).collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let keys: std::collections::BTreeSet<String> = h
            .received()
            .await
            .into_iter()
            .filter_map(|r| r.ordering_key)
            .collect();
        if keys == expected {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "received {keys:?}");
    }
}

/// A record the broker refuses as too large when it is alone in its batch is too large by
/// itself: dead-lettered at once, the error naming the settings to mend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_refused_as_too_large_alone_is_too_large_naming_the_settings() {
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    let h = new_harness().await;
    let cluster = &h.cluster.as_ref().unwrap().0;
    cluster.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE; 2],
    );
    let routed = outbox_publishers::Routed {
        cloudevents: None,
        event: outbox_testkit::publisher::event(6, "customer-6", b"{}".to_vec()),
        target: h.topic.clone(),
    };
    let err = h
        .sink
        .send(vec![routed])
        .await
        .remove(0)
        .expect_err("refused");
    assert_eq!(err.kind(), outbox_core::PublishErrorKind::TooLarge, "{err}");
    assert!(
        err.to_string().contains("sent alone") && err.to_string().contains("max.message.bytes"),
        "{err}"
    );
}

/// A record to a topic that does not exist (and a cluster that creates none) timed out
/// before librdkafka called the topic missing (30 s against the 10 s timeout): retried as
/// a broker that is down, for good, never named. It is a missing target, named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_that_does_not_exist_is_named_missing() {
    let cluster = MockCluster::new(1).unwrap();
    let config: SinkConfig = serde_json::from_value(serde_json::json!({
        "uri": format!("kafka://{}", cluster.bootstrap_servers()),
        "timeout": "4s",
        "kafka": {"allow.auto.create.topics": "false"},
    }))
    .unwrap();
    let sink = outbox_publishers::build_sink("kafka", &config)
        .await
        .unwrap();
    let topic = format!("nosuchtopic-{}", uuid::Uuid::new_v4().simple());
    let err = sink
        .send(vec![outbox_publishers::Routed {
            cloudevents: None,
            event: outbox_testkit::publisher::event(1, "k", b"{}".to_vec()),
            target: topic.clone(),
        }])
        .await
        .remove(0)
        .expect_err("no such topic");
    assert_eq!(
        err.kind(),
        outbox_core::PublishErrorKind::MissingTarget,
        "{err}"
    );
    assert!(err.to_string().contains(&topic), "{err}");
}

/// The broker answers the idempotent producer with an out-of-order sequence, which
/// librdkafka makes a fatal error: the producer then failed every record for good
/// (`__FATAL`, retried as unavailable), each event went to its attempt limit and was
/// dead-lettered, and `/readyz` stayed green, until a restart. The sink makes a new producer,
/// and the next batch is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_producer_error_gives_way_to_a_new_producer() {
    use outbox_publishers::Routed;
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    let h = new_harness().await;
    let cluster = &h.cluster.as_ref().unwrap().0;
    let routed = |id: i64| Routed {
        cloudevents: None,
        event: outbox_testkit::publisher::event(id, "k", b"{}".to_vec()),
        target: h.topic.clone(),
    };
    assert!(h.sink.send(vec![routed(1)]).await[0].is_ok());
    cluster.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER; 1],
    );
    let failed = h.sink.send(vec![routed(2)]).await.remove(0);
    assert!(failed.is_err(), "the broker's refusal: {failed:?}");
    let mut again = Err(outbox_core::PublishError::new(
        outbox_core::PublishErrorKind::Unavailable,
        "not sent yet",
    ));
    for _ in 0..5 {
        again = h.sink.send(vec![routed(2)]).await.remove(0);
        if again.is_ok() {
            break;
        }
    }
    assert!(
        again.is_ok(),
        "still failing after a fatal error: {again:?}"
    );
    assert!(h.sink.health().await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_carry_the_key_and_event_headers() {
    let h = new_harness().await;
    let mut forged = (*outbox_testkit::publisher::event(4, "customer-4", b"{}".to_vec())).clone();
    // An event's own header of the relay's id stamp's name: Kafka kept both, and consumers
    // read the last, the forged one.
    forged
        .headers
        .insert("outbox-event-id".into(), "forged".into());
    let e = std::sync::Arc::new(forged);
    let routed = outbox_publishers::Routed {
        cloudevents: None,
        event: e.clone(),
        target: h.topic.clone(),
    };
    assert!(h.sink.send(vec![routed]).await[0].is_ok());
    let message = tokio::time::timeout(Duration::from_secs(20), h.consumer.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(message.key(), Some(&b"customer-4"[..]));
    let headers: Vec<(String, String)> = message
        .headers()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x.key.to_string(),
                String::from_utf8_lossy(x.value.unwrap()).to_string(),
            )
        })
        .collect();
    let ids: Vec<&String> = headers
        .iter()
        .filter(|(k, _)| k == "outbox-event-id")
        .map(|(_, v)| v)
        .collect();
    assert_eq!(ids, [&e.event_id.to_string()], "{headers:?}");
    for (k, v) in [
        ("outbox-event-id", e.event_id.to_string()),
        ("outbox-event-type", "order.created".to_string()),
        ("outbox-sequence-id", "4".to_string()),
        ("outbox-mutation-id", "m4".to_string()),
        ("trace-id", "t4".to_string()),
    ] {
        assert!(
            headers.contains(&(k.to_string(), v.clone())),
            "{k}={v} in {headers:?}"
        );
    }
}

/// Tansu, an independent Kafka-compatible broker (crates.io). Its build takes about 25
/// minutes, so it is not part of every CI run: `scripts/install-tansu.sh` installs it, and
/// `scripts/test.sh` runs these tests whenever `tansu` is on the PATH.
mod tansu {
    use super::*;
    use outbox_testkit::server::ServerProcess;
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;

    async fn tansu_harness() -> (ServerProcess, KafkaHarness) {
        let server = ServerProcess::start(
            "tansu",
            &[
                "broker",
                "--listener-url",
                "tcp://127.0.0.1:{port}",
                "--advertised-listener-url",
                "tcp://127.0.0.1:{port}",
                "--storage-engine",
                "memory://tansu/",
            ],
        );
        let servers = format!("127.0.0.1:{}", server.port);
        let topic = format!("orders-{}", uuid::Uuid::new_v4().simple());
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", &servers)
            .create()
            .unwrap();
        admin
            .create_topics(
                &[NewTopic::new(&topic, 3, TopicReplication::Fixed(1))],
                &AdminOptions::new(),
            )
            .await
            .unwrap();
        let harness = harness_for(servers, topic, None).await;
        (server, harness)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs tansu on the PATH (scripts/install-tansu.sh); scripts/test.sh runs it when present"]
    async fn tansu_delivers_every_event_in_order_per_key() {
        let (_server, harness) = tansu_harness().await;
        outbox_testkit::publisher::delivers_every_event_in_order_per_key(&harness).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs tansu on the PATH (scripts/install-tansu.sh); scripts/test.sh runs it when present"]
    async fn tansu_redelivery_carries_the_same_event_id() {
        let (_server, harness) = tansu_harness().await;
        outbox_testkit::publisher::redelivery_carries_the_same_event_id(&harness).await;
    }
}

/// A batch refused as too large after more than half the send's `timeout` (a slow broker)
/// is not sent again record by record: that resend could outlast `publish_timeout`, the
/// engine then give up on the record and retry it, and the stale copy land after the
/// retry, or after the key's next event. It is retried as it was, naming the settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_refused_too_late_for_a_resend_in_time_is_retried_naming_the_settings() {
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    let cluster = MockCluster::new(1).unwrap();
    let topic = format!("orders-{}", uuid::Uuid::new_v4().simple());
    cluster.create_topic(&topic, 1, 1).unwrap();
    let config: SinkConfig = serde_json::from_value(serde_json::json!({
        "uri": format!("kafka://{}", cluster.bootstrap_servers()),
        "timeout": "4s",
    }))
    .unwrap();
    let sink = outbox_publishers::build_sink("kafka", &config)
        .await
        .unwrap();
    let routed = |id: i64| outbox_publishers::Routed {
        cloudevents: None,
        event: outbox_testkit::publisher::event(id, "k", b"{}".to_vec()),
        target: topic.clone(),
    };
    assert!(sink.send(vec![routed(1)]).await[0].is_ok());
    cluster
        .broker_round_trip_time(1, Duration::from_millis(2500))
        .unwrap();
    cluster.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE],
    );
    let err = sink
        .send(vec![routed(2)])
        .await
        .remove(0)
        .expect_err("refused, with no time left to send it alone");
    assert!(
        matches!(err.disposition(), outbox_core::Disposition::Retry { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("batch.size"), "{err}");
}
