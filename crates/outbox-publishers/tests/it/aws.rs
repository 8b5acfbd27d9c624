//! The publisher conformance suite for the AWS sinks (SQS, SNS, Kinesis, EventBridge)
//! against moto in server mode, the AWS stand-in `scripts/servers.sh` starts
//! (`OUTBOX_TEST_AWS_ENDPOINT`): no AWS service runs on this machine. moto parses each
//! request with the services' own API models (botocore's), so a request it accepts has the
//! shape AWS expects; it does not check signatures, which `aws::sigv4`'s test checks
//! against botocore's signer instead.
//!
//! Every harness owns its queues, topics, streams and rules (unique names on the shared
//! server), and reaches the sink under test through a [`FaultProxy`], which stands in for
//! the service being unreachable and back; the consumer side reads moto directly.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_core::{Disposition, PublishErrorKind};
use outbox_publishers::aws::{self, AwsClient, AwsConfig, Service};
use outbox_publishers::{Routed, Sink, SinkConfig};
use outbox_testkit::publisher::{event, BrokerHarness, Received};
use outbox_testkit::{FaultHandle, FaultProxy};
use serde_json::{json, Value};

fn moto() -> String {
    std::env::var("OUTBOX_TEST_AWS_ENDPOINT").expect(
        "OUTBOX_TEST_AWS_ENDPOINT is not set: run the tests through scripts/test.sh, or \
         `eval \"$(scripts/servers.sh start)\"` first (it starts moto)",
    )
}

/// The environment the sinks see: moto takes any key.
fn env(name: &str) -> Option<String> {
    match name {
        "AWS_ACCESS_KEY_ID" => Some("AKIDTESTING".into()),
        "AWS_SECRET_ACCESS_KEY" => Some("testing".into()),
        "AWS_REGION" => Some("us-east-1".into()),
        _ => None,
    }
}

/// A client straight to moto, for setting up and reading back.
fn admin(service: Service) -> AwsClient {
    outbox_testkit::install_crypto();
    let config = AwsConfig {
        endpoint: Some(moto()),
        ..AwsConfig::default()
    };
    AwsClient::new(service, &config, &env).expect("a client for moto")
}

fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

async fn create_queue(name: &str) -> (String, String) {
    let sqs = admin(Service::Sqs);
    let mut attributes = json!({});
    if name.ends_with(".fifo") {
        attributes = json!({ "FifoQueue": "true" });
    }
    let created = sqs
        .json(
            "AmazonSQS",
            "CreateQueue",
            "1.0",
            &json!({ "QueueName": name, "Attributes": attributes }),
        )
        .await
        .expect("CreateQueue");
    let url = created["QueueUrl"].as_str().unwrap().to_string();
    let arn = sqs
        .json(
            "AmazonSQS",
            "GetQueueAttributes",
            "1.0",
            &json!({ "QueueUrl": url, "AttributeNames": ["QueueArn"] }),
        )
        .await
        .expect("GetQueueAttributes")["Attributes"]["QueueArn"]
        .as_str()
        .unwrap()
        .to_string();
    (url, arn)
}

/// How a consumer finds the event in what it reads.
#[derive(Clone, Copy)]
enum Shape {
    /// The payload as the body, the event's fields as message attributes (SQS, SNS raw).
    Attributes,
    /// EventBridge's event, the relay's envelope (or a CloudEvent) as its `detail`.
    EventBridgeDetail,
    /// A Kinesis record whose data is the envelope (or a CloudEvent).
    Envelope,
}

/// Where the consumer reads.
enum Reader {
    Queue(String),
    Kinesis(String),
}

struct AwsHarness {
    sink: Arc<dyn Sink>,
    target: String,
    reader: Reader,
    shape: Shape,
    dedupes: bool,
    oversized: usize,
    /// A queue hands each message out once: what was read so far.
    read: Mutex<Vec<Received>>,
    _proxy: FaultProxy,
    faults: FaultHandle,
}

async fn build(uri: &str, settings: Value) -> (Arc<dyn Sink>, FaultProxy) {
    outbox_testkit::install_crypto();
    let (proxy, endpoint) = FaultProxy::start_for_url(&moto()).await.expect("a proxy");
    // moto is one Python process serving every test at once, and loads a service's models
    // on its first request: on a loaded CI host a single call took over 3 s. The tests that
    // stop the broker cut connections (an immediate reset), so no test waits on this.
    let mut table = json!({ "uri": uri, "endpoint": endpoint, "timeout": "20s" });
    table
        .as_object_mut()
        .unwrap()
        .extend(settings.as_object().cloned().unwrap_or_default());
    let config: SinkConfig = serde_json::from_value(table).expect("valid sink settings");
    (aws::sink(&config, &env).expect("the sink"), proxy)
}

impl AwsHarness {
    async fn new(
        uri: &str,
        settings: Value,
        target: String,
        reader: Reader,
        shape: Shape,
        dedupes: bool,
        oversized: usize,
    ) -> Self {
        let (sink, proxy) = build(uri, settings).await;
        AwsHarness {
            sink,
            target,
            reader,
            shape,
            dedupes,
            oversized,
            read: Mutex::default(),
            faults: proxy.handle(),
            _proxy: proxy,
        }
    }
}

async fn sqs_fifo() -> AwsHarness {
    let name = format!("{}.fifo", unique("orders"));
    let (url, _) = create_queue(&name).await;
    // The route's target is the queue's name: the sink looks its URL up.
    AwsHarness::new(
        "sqs:",
        json!({}),
        name,
        Reader::Queue(url),
        Shape::Attributes,
        true,
        1_100_000,
    )
    .await
}

async fn sns_fifo() -> AwsHarness {
    let topic = format!("{}.fifo", unique("orders"));
    let sns = admin(Service::Sns);
    let created = sns
        .query(&[
            ("Action", "CreateTopic"),
            ("Version", "2010-03-31"),
            ("Name", &topic),
            ("Attributes.entry.1.key", "FifoTopic"),
            ("Attributes.entry.1.value", "true"),
        ])
        .await
        .expect("CreateTopic");
    let topic_arn = aws::xml::text(&created, "TopicArn").unwrap();
    let (url, queue_arn) = create_queue(&format!("{}.fifo", unique("subscriber"))).await;
    sns.query(&[
        ("Action", "Subscribe"),
        ("Version", "2010-03-31"),
        ("TopicArn", &topic_arn),
        ("Protocol", "sqs"),
        ("Endpoint", &queue_arn),
        ("Attributes.entry.1.key", "RawMessageDelivery"),
        ("Attributes.entry.1.value", "true"),
    ])
    .await
    .expect("Subscribe");
    // The target is the topic's name: the sink makes it an ARN with the account STS names.
    AwsHarness::new(
        "sns:",
        json!({}),
        topic,
        Reader::Queue(url),
        Shape::Attributes,
        true,
        300_000,
    )
    .await
}

async fn kinesis() -> AwsHarness {
    let stream = unique("orders");
    admin(Service::Kinesis)
        .json(
            "Kinesis_20131202",
            "CreateStream",
            "1.1",
            &json!({ "StreamName": stream, "ShardCount": 2 }),
        )
        .await
        .expect("CreateStream");
    AwsHarness::new(
        "kinesis:",
        json!({}),
        stream.clone(),
        Reader::Kinesis(stream),
        Shape::Envelope,
        false,
        1_100_000,
    )
    .await
}

async fn eventbridge() -> AwsHarness {
    let bus = unique("bus");
    let source = unique("shop");
    let events = admin(Service::EventBridge);
    let call = |action: &'static str, body: Value| {
        let events = &events;
        async move {
            events
                .json("AWSEvents", action, "1.1", &body)
                .await
                .unwrap_or_else(|e| panic!("{action}: {e}"))
        }
    };
    call("CreateEventBus", json!({ "Name": bus })).await;
    let (url, queue_arn) = create_queue(&unique("rule-target")).await;
    let rule = unique("rule");
    call(
        "PutRule",
        json!({ "Name": rule, "EventBusName": bus, "EventPattern": json!({ "source": [source] }).to_string() }),
    )
    .await;
    call(
        "PutTargets",
        json!({ "Rule": rule, "EventBusName": bus, "Targets": [{ "Id": "queue", "Arn": queue_arn }] }),
    )
    .await;
    AwsHarness::new(
        &format!("eventbridge://{bus}"),
        json!({}),
        source,
        Reader::Queue(url),
        Shape::EventBridgeDetail,
        false,
        300_000,
    )
    .await
}

/// A received message from the envelope (or CloudEvent) a record or detail carries.
fn from_envelope(envelope: &Value) -> Received {
    if envelope.get("specversion").is_some() {
        return Received {
            event_id: envelope["id"].as_str().unwrap_or_default().into(),
            ordering_key: None,
            payload: envelope.to_string().into_bytes(),
            traceparent: None,
            tracestate: None,
            headers: Vec::new(),
        };
    }
    let payload = match &envelope["payload"] {
        Value::String(text) => text.clone().into_bytes(),
        other => other.to_string().into_bytes(),
    };
    let header = |name: &str| envelope["headers"][name].as_str().map(str::to_string);
    Received {
        event_id: envelope["event_id"].as_str().unwrap_or_default().into(),
        ordering_key: envelope["partition_key"].as_str().map(str::to_string),
        payload,
        traceparent: header("traceparent"),
        tracestate: header("tracestate"),
        headers: envelope["headers"]
            .as_object()
            .map(|h| {
                h.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                    .collect()
            })
            .unwrap_or_default(),
    }
}

fn from_sqs_message(message: &Value, shape: Shape) -> Received {
    let body = message["Body"].as_str().unwrap_or_default();
    match shape {
        Shape::EventBridgeDetail => {
            let event: Value = serde_json::from_str(body).expect("an EventBridge event");
            from_envelope(&event["detail"])
        }
        Shape::Envelope => from_envelope(&serde_json::from_str(body).unwrap()),
        Shape::Attributes => {
            let attributes: HashMap<String, String> = message["MessageAttributes"]
                .as_object()
                .map(|a| {
                    a.iter()
                        .map(|(k, v)| {
                            (
                                k.clone(),
                                v["StringValue"].as_str().unwrap_or_default().into(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            let payload = match attributes.get(aws::ATTRIBUTE_ENCODING).map(String::as_str) {
                Some("base64") => base64::engine::general_purpose::STANDARD
                    .decode(body)
                    .unwrap(),
                _ => body.as_bytes().to_vec(),
            };
            Received {
                event_id: attributes
                    .get(aws::ATTRIBUTE_EVENT_ID)
                    .cloned()
                    .unwrap_or_default(),
                ordering_key: attributes.get(aws::ATTRIBUTE_KEY).cloned(),
                payload,
                traceparent: attributes.get("traceparent").cloned(),
                tracestate: attributes.get("tracestate").cloned(),
                headers: attributes.into_iter().collect(),
            }
        }
    }
}

impl AwsHarness {
    /// Takes what the queue holds now, deleting it (a FIFO group waits for that).
    async fn drain_queue(&self, url: &str) {
        let sqs = admin(Service::Sqs);
        loop {
            let answer = sqs
                .json(
                    "AmazonSQS",
                    "ReceiveMessage",
                    "1.0",
                    &json!({ "QueueUrl": url, "MaxNumberOfMessages": 10, "MessageAttributeNames": ["All"], "WaitTimeSeconds": 0 }),
                )
                .await
                .expect("ReceiveMessage");
            let messages = answer["Messages"].as_array().cloned().unwrap_or_default();
            if messages.is_empty() {
                return;
            }
            let entries: Vec<Value> = messages
                .iter()
                .enumerate()
                .map(|(i, m)| json!({ "Id": i.to_string(), "ReceiptHandle": m["ReceiptHandle"] }))
                .collect();
            sqs.json(
                "AmazonSQS",
                "DeleteMessageBatch",
                "1.0",
                &json!({ "QueueUrl": url, "Entries": entries }),
            )
            .await
            .expect("DeleteMessageBatch");
            let mut read = self.read.lock().unwrap();
            read.extend(messages.iter().map(|m| from_sqs_message(m, self.shape)));
        }
    }

    /// Every record of every shard, shard by shard (one key's records share a shard).
    async fn read_stream(&self, stream: &str) -> Vec<Received> {
        let kinesis = admin(Service::Kinesis);
        let call = |action: &'static str, body: Value| {
            let kinesis = &kinesis;
            async move {
                kinesis
                    .json("Kinesis_20131202", action, "1.1", &body)
                    .await
                    .unwrap_or_else(|e| panic!("{action}: {e}"))
            }
        };
        let shards = call("ListShards", json!({ "StreamName": stream })).await;
        let mut received = Vec::new();
        for shard in shards["Shards"].as_array().cloned().unwrap_or_default() {
            let iterator = call(
                "GetShardIterator",
                json!({ "StreamName": stream, "ShardId": shard["ShardId"], "ShardIteratorType": "TRIM_HORIZON" }),
            )
            .await;
            let mut iterator = iterator["ShardIterator"].clone();
            loop {
                let page = call(
                    "GetRecords",
                    json!({ "ShardIterator": iterator, "Limit": 1000 }),
                )
                .await;
                let records = page["Records"].as_array().cloned().unwrap_or_default();
                for record in &records {
                    let data = base64::engine::general_purpose::STANDARD
                        .decode(record["Data"].as_str().unwrap())
                        .unwrap();
                    received.push(from_envelope(&serde_json::from_slice(&data).unwrap()));
                }
                if records.is_empty() || page["NextShardIterator"].is_null() {
                    break;
                }
                iterator = page["NextShardIterator"].clone();
            }
        }
        received
    }
}

impl BrokerHarness for AwsHarness {
    fn sink(&self) -> Arc<dyn Sink> {
        self.sink.clone()
    }

    fn target(&self) -> String {
        self.target.clone()
    }

    fn received(&self) -> BoxFuture<'_, Vec<Received>> {
        async move {
            match &self.reader {
                Reader::Queue(url) => {
                    self.drain_queue(url).await;
                    self.read.lock().unwrap().clone()
                }
                Reader::Kinesis(stream) => self.read_stream(stream).await,
            }
        }
        .boxed()
    }

    fn broker_dedupes(&self) -> bool {
        self.dedupes
    }

    fn oversized_bytes(&self) -> usize {
        self.oversized
    }

    /// The service unreachable: every connection through the proxy is reset.
    fn stop_broker(&self) -> BoxFuture<'_, ()> {
        async move { self.faults.cut() }.boxed()
    }

    fn start_broker(&self) -> BoxFuture<'_, ()> {
        async move { self.faults.heal() }.boxed()
    }
}

mod sqs {
    outbox_testkit::publisher_conformance!(super::sqs_fifo);
}

mod sns {
    outbox_testkit::publisher_conformance!(super::sns_fifo);
}

mod kinesis {
    outbox_testkit::publisher_conformance!(super::kinesis);
}

mod eventbridge {
    outbox_testkit::publisher_conformance!(super::eventbridge);
}

fn routed(target: &str, events: &[Arc<outbox_core::Event>]) -> Vec<Routed> {
    events
        .iter()
        .map(|e| Routed {
            cloudevents: None,
            event: e.clone(),
            target: target.into(),
        })
        .collect()
}

/// One batch of more events than `SendMessageBatch` takes (10), some with keys SQS refuses
/// as a message group (a space, too long): every event arrives, in order per key, and
/// each key's events share one group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_batches_are_cut_to_the_service_limit_and_odd_keys_keep_one_group() {
    let harness = sqs_fifo().await;
    let long_key = "k".repeat(300);
    let keys = ["plain", "with space", long_key.as_str()];
    let mut all = Vec::new();
    for round in 0..3i64 {
        let batch: Vec<_> = (0..25i64)
            .map(|i| {
                event(
                    round * 25 + i,
                    &format!("{}-{i}", keys[i as usize % 3]),
                    b"{}".to_vec(),
                )
            })
            .collect();
        let outcomes = harness.sink.send(routed(&harness.target, &batch)).await;
        assert!(outcomes.iter().all(|o| o.is_ok()), "{outcomes:?}");
        all.extend(batch);
    }
    let received = outbox_testkit::eventually("75 messages", Duration::from_secs(30), || async {
        let got = harness.received().await;
        (got.len() >= 75).then_some(got)
    })
    .await;
    assert_eq!(received.len(), 75);
    let mut last: HashMap<String, i64> = HashMap::new();
    for r in &received {
        let e = all
            .iter()
            .find(|e| e.event_id.to_string() == r.event_id)
            .unwrap();
        assert_eq!(
            r.ordering_key.as_deref(),
            Some(e.ordering_key()),
            "the key travels as written"
        );
        if let Some(previous) = last.insert(e.ordering_key().to_string(), e.sequence_id) {
            assert!(
                previous < e.sequence_id,
                "key {} out of order",
                e.ordering_key()
            );
        }
    }
}

/// In one batch, an event the service refuses fails alone, for good; the others are
/// delivered (the entries' own outcomes, not the request's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_refused_entry_fails_alone() {
    let harness = eventbridge().await;
    let config: SinkConfig = serde_json::from_value(json!({
        "uri": "eventbridge:",
        "endpoint": moto(),
        "detail": "payload",
    }))
    .unwrap();
    let sink = aws::sink(&config, &env).unwrap();
    let batch = vec![
        event(1, "a", br#"{"ok":1}"#.to_vec()),
        event(2, "b", b"[1, 2]".to_vec()),
        event(3, "c", br#"{"ok":3}"#.to_vec()),
    ];
    let outcomes = sink.send(routed(&harness.target, &batch)).await;
    assert!(outcomes[0].is_ok() && outcomes[2].is_ok(), "{outcomes:?}");
    let refused = outcomes[1].as_ref().unwrap_err();
    assert_eq!(refused.disposition(), Disposition::Permanent, "{refused}");
    assert!(refused.to_string().contains("JSON object"), "{refused}");
}

/// A queue that does not exist is a missing target (retried: it may be created), named
/// with the fix; a queue created later then gets the events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_queue_is_retried_until_it_exists() {
    let (sink, _proxy) = build("sqs:", json!({})).await;
    let name = unique("later");
    let batch = vec![event(1, "k", b"{}".to_vec())];
    let outcomes = sink.send(routed(&name, &batch)).await;
    let error = outcomes[0].as_ref().unwrap_err();
    assert_eq!(error.kind(), PublishErrorKind::MissingTarget, "{error}");
    assert!(error.to_string().contains("create it"), "{error}");
    let (url, _) = create_queue(&name).await;
    let outcomes = sink.send(routed(&name, &batch)).await;
    assert!(outcomes[0].is_ok(), "{outcomes:?}");
    let harness_reader = admin(Service::Sqs)
        .json(
            "AmazonSQS",
            "ReceiveMessage",
            "1.0",
            &json!({ "QueueUrl": url, "MessageAttributeNames": ["All"] }),
        )
        .await
        .unwrap();
    let message = &harness_reader["Messages"][0];
    assert_eq!(
        message["MessageAttributes"][aws::ATTRIBUTE_EVENT_ID]["StringValue"],
        batch[0].event_id.to_string()
    );
}

/// The engine's publish timeout covers the whole batch: requests queued behind the
/// `concurrency` slow ones outlived it, and every event was retried, those SQS had taken
/// too. A request not started within half the sink's timeout is given back unsent (no
/// attempt), and the one that started is confirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_cannot_start_in_time_are_given_back_unsent() {
    let (sink, proxy) = build("sqs:", json!({ "timeout": "4s", "concurrency": 1 })).await;
    let name = unique("slow");
    let (url, _) = create_queue(&name).await;
    // Warm: the first call loads moto's models.
    let warm = sink
        .send(routed(&url, &[event(1, "warm", b"{}".to_vec())]))
        .await;
    assert!(warm[0].is_ok(), "{warm:?}");
    // Answers come 2.5 s late: the first request holds the one slot past half the timeout
    // (2 s), and is answered within it (4 s), with room for a slow host either way.
    proxy.handle().latency(
        outbox_testkit::faultproxy::Direction::ToClient,
        Duration::from_millis(2500),
    );
    // 30 keys: three requests of 10 entries, one at a time.
    let batch: Vec<_> = (0..30)
        .map(|n| event(n + 2, &format!("k{n}"), b"{}".to_vec()))
        .collect();
    let outcomes = sink.send(routed(&url, &batch)).await;
    let sent = outcomes.iter().filter(|o| o.is_ok()).count();
    let unsent = outcomes
        .iter()
        .filter(|o| {
            o.as_ref()
                .is_err_and(|e| e.kind() == PublishErrorKind::NotSent)
        })
        .count();
    assert_eq!((sent, unsent), (10, 20), "{outcomes:?}");
}

/// Kubernetes' web identity: the token file is exchanged at STS for temporary credentials,
/// which then sign the requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_web_identity_is_exchanged_at_sts() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "eyJhbGciOiJSUzI1NiJ9.test-token.signature\n").unwrap();
    let token = token.display().to_string();
    let endpoint = moto();
    let web_env = |name: &str| match name {
        "AWS_WEB_IDENTITY_TOKEN_FILE" => Some(token.clone()),
        "AWS_ROLE_ARN" => Some("arn:aws:iam::123456789012:role/outbox-relay".into()),
        "AWS_REGION" => Some("us-east-1".into()),
        "AWS_ENDPOINT_URL" => Some(endpoint.clone()),
        _ => None,
    };
    let name = unique("irsa");
    let (url, _) = create_queue(&name).await;
    let sink = aws::sink(&SinkConfig::new("sqs:"), &web_env).unwrap();
    assert!(
        sink.describe()
            .contains("web identity (role arn:aws:iam::123456789012:role/outbox-relay)"),
        "{}",
        sink.describe()
    );
    sink.health().await.expect("STS gave credentials");
    let outcomes = sink
        .send(routed(&url, &[event(1, "k", b"{}".to_vec())]))
        .await;
    assert!(outcomes[0].is_ok(), "{outcomes:?}");
}

/// STS refusing the relay's web identity with a 400 (a malformed role ARN or session name)
/// was classified as the events' fault: every event was dead-lettered, one by one. It is the
/// sink's condition, retried as a refused credential is. (STS here is a local stand-in that
/// answers as STS does, `ErrorResponse` with `ValidationError`: moto accepts any role.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_web_identity_sts_refuses_is_retried_not_dead_lettered() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    outbox_testkit::install_crypto();
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "eyJhbGciOiJSUzI1NiJ9.test-token.signature\n").unwrap();
    let token = token.display().to_string();
    let sts = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let sts_url = format!("http://{}", sts.local_addr().unwrap());
    tokio::spawn(async move {
        let body = "<ErrorResponse><Error><Type>Sender</Type><Code>ValidationError</Code>\
                    <Message>1 validation error detected: Value 'outbox-relay' at 'roleArn' \
                    failed to satisfy constraint</Message></Error></ErrorResponse>";
        while let Ok((mut stream, _)) = sts.accept().await {
            let mut request = vec![0u8; 64 * 1024];
            let _ = stream.read(&mut request).await;
            let answer = format!(
                "HTTP/1.1 400 Bad Request\r\ncontent-type: text/xml\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(answer.as_bytes()).await;
        }
    });
    let endpoint = moto();
    let web_env = |name: &str| match name {
        "AWS_WEB_IDENTITY_TOKEN_FILE" => Some(token.clone()),
        "AWS_ROLE_ARN" => Some("outbox-relay".into()),
        "AWS_REGION" => Some("us-east-1".into()),
        "AWS_ENDPOINT_URL" => Some(endpoint.clone()),
        "AWS_ENDPOINT_URL_STS" => Some(sts_url.clone()),
        _ => None,
    };
    let sink = aws::sink(&SinkConfig::new("sqs:"), &web_env).unwrap();
    let batch = [event(1, "a", b"{}".to_vec()), event(2, "b", b"{}".to_vec())];
    let outcomes = sink.send(routed(&unique("sts"), &batch)).await;
    for outcome in outcomes {
        let error = outcome.expect_err("no credentials");
        assert!(
            matches!(error.disposition(), Disposition::Retry { .. }),
            "{error}"
        );
        assert!(error.to_string().contains("ValidationError"), "{error}");
    }
}

/// Settings that cannot apply are refused when the sink is built, with the fix.
#[test]
fn settings_that_cannot_apply_are_refused() {
    outbox_testkit::install_crypto();
    let err = |table: Value| -> String {
        match serde_json::from_value::<SinkConfig>(table) {
            Err(e) => e.to_string(),
            Ok(config) => aws::sink(&config, &env).err().expect("refused").to_string(),
        }
    };
    assert!(err(json!({ "uri": "sqs://my-queue" })).contains("the queue is the route's target"));
    assert!(err(json!({ "uri": "kinesis:", "maxlen": 5 }))
        .contains("`maxlen` has no effect on a kinesis sink"));
    assert!(err(json!({ "uri": "sqs:", "detail": "payload" })).contains("`detail` has no effect"));
    assert!(err(json!({ "uri": "eventbridge:", "detail_type": "{nope}" })).contains("detail_type"));
    assert!(err(json!({ "uri": "sqs:", "concurrency": 0 })).contains("`concurrency` = 0"));
    assert!(err(json!({ "uri": "sqs:", "endpoint": "not a url" })).contains("is not a URL"));
    let no_region = |name: &str| match name {
        "AWS_REGION" => None,
        other => env(other),
    };
    let config = SinkConfig::new("sns:");
    let e = aws::sink(&config, &no_region).err().unwrap().to_string();
    assert!(e.contains("no AWS region for the SNS sink"), "{e}");
}

/// The queue's URL lookup (`GetQueueUrl`) refused as permanent: the batch was sent again
/// entry by entry, the lookup repeated for each, and every event dead-lettered. The lookup
/// is about no one entry: each fails with it, once. (A stand-in server here, since the
/// answer is one moto does not give; it is SQS's JSON protocol error, as SQS words it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_queue_lookup_is_asked_once_not_once_per_event() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    outbox_testkit::install_crypto();
    let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", server.local_addr().unwrap());
    let requests = Arc::new(AtomicUsize::new(0));
    let counted = requests.clone();
    tokio::spawn(async move {
        let body = r#"{"__type":"com.amazonaws.sqs#InvalidParameterValue","message":"Value q! for parameter QueueName is invalid."}"#;
        while let Ok((mut stream, _)) = server.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            let mut request = vec![0u8; 64 * 1024];
            let _ = stream.read(&mut request).await;
            let answer = format!(
                "HTTP/1.1 400 Bad Request\r\ncontent-type: application/x-amz-json-1.0\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(answer.as_bytes()).await;
        }
    });
    let config: SinkConfig =
        serde_json::from_value(json!({ "uri": "sqs:", "endpoint": endpoint })).unwrap();
    let sink = aws::sink(&config, &env).unwrap();
    let batch = [
        event(1, "a", b"{}".to_vec()),
        event(2, "b", b"{}".to_vec()),
        event(3, "c", b"{}".to_vec()),
    ];
    let outcomes = sink.send(routed("q!", &batch)).await;
    for outcome in outcomes {
        let error = outcome.expect_err("the lookup was refused");
        assert!(
            error.to_string().contains("InvalidParameterValue"),
            "{error}"
        );
    }
    assert_eq!(requests.load(Ordering::SeqCst), 1, "GetQueueUrl asked once");
}
