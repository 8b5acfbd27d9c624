//! Kafka with the idempotent producer (`enable.idempotence`, `acks=all`): the message key is
//! the ordering key, so per-key order holds within a partition; headers carry the event id
//! (consumers de-duplicate on it: Kafka has no per-message de-duplication across producer
//! sessions), the event type, sequence id and the event's own headers. Rows are acked only
//! after each message's delivery report.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::{join_all, BoxFuture};
use futures::FutureExt;
use outbox_core::{Outcome, PublishError, PublishErrorKind};
use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

use serde::{Deserialize, Serialize};

use crate::error::SinkSetupError;
use crate::settings::{ConfirmTimeout, TlsFiles};
use crate::sink::{Routed, Sink};
use outbox_core::redact::Secret;

/// The producer's default `message.max.bytes`.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 1_000_000;

pub const HEADER_EVENT_ID: &str = "outbox-event-id";
pub const HEADER_EVENT_TYPE: &str = "outbox-event-type";
pub const HEADER_SEQUENCE_ID: &str = "outbox-sequence-id";
pub const HEADER_MUTATION_ID: &str = "outbox-mutation-id";
/// The headers the relay stamps each record with.
const RELAY_HEADERS: [&str; 4] = [
    HEADER_EVENT_ID,
    HEADER_EVENT_TYPE,
    HEADER_SEQUENCE_ID,
    HEADER_MUTATION_ID,
];

/// A Kafka sink's own settings (`[sinks.NAME]` with a `kafka://` or `kafkas://` URI).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct KafkaConfig {
    #[serde(flatten)]
    pub timeout: ConfirmTimeout,
    #[serde(flatten)]
    pub tls: TlsFiles,
    /// SASL mechanism (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512) and credentials.
    pub sasl_mechanism: Option<String>,
    pub sasl_username: Option<String>,
    pub sasl_password: Option<Secret>,
    /// Extra librdkafka properties (the secret ones shown as `***`, like every `Secret`).
    #[serde(serialize_with = "properties", deserialize_with = "scalar_properties")]
    pub kafka: BTreeMap<String, String>,
}

/// librdkafka's properties, each value written as a string, number or boolean (all text to
/// librdkafka). A value of another type is refused without being quoted: it may be a
/// password.
fn scalar_properties<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<BTreeMap<String, String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Scalar {
        Text(String),
        Whole(i64),
        Number(f64),
        Flag(bool),
    }
    let read = BTreeMap::<String, Scalar>::deserialize(deserializer).map_err(|_| {
        serde::de::Error::custom(
            "kafka properties are librdkafka's, each a string, number or boolean \
             (\"batch.size\" = \"65536\")",
        )
    })?;
    Ok(read
        .into_iter()
        .map(|(name, value)| {
            let text = match value {
                Scalar::Text(t) => t,
                Scalar::Whole(n) => n.to_string(),
                Scalar::Number(n) => n.to_string(),
                Scalar::Flag(b) => b.to_string(),
            };
            (name, text)
        })
        .collect())
}

/// librdkafka's properties whose values are secrets (it marks them sensitive): passwords,
/// passphrases, client secrets, private keys in PEM and the OAUTHBEARER config.
fn is_secret_property(name: &str) -> bool {
    name.ends_with(".password")
        || name.ends_with(".passphrase")
        || name.ends_with(".secret")
        || name.ends_with("key.pem")
        || name == "sasl.oauthbearer.config"
}

fn properties<S: serde::Serializer>(
    map: &BTreeMap<String, String>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut out = serializer.serialize_map(Some(map.len()))?;
    for (name, value) in map {
        if is_secret_property(name) {
            out.serialize_entry(name, &Secret::new(value.clone()))?;
        } else {
            out.serialize_entry(name, value)?;
        }
    }
    out.end()
}

/// The sink's producers, their librdkafka logs through [`KafkaLogs`].
type RelayProducer = FutureProducer<KafkaLogs>;

/// librdkafka's own log lines as they come, and its "global errors" at debug: each of
/// those repeats a log line (a broker that refuses connections gave one `FAIL` line and
/// two identical `Global error` lines, all at ERROR, for every attempt), and what they say
/// reaches the relay's own log through the publishes and health checks that fail.
pub struct KafkaLogs;

impl ClientContext for KafkaLogs {
    fn error(&self, error: KafkaError, reason: &str) {
        tracing::debug!(%error, reason, "librdkafka global error");
    }
}

pub struct KafkaSink {
    /// Made again from `client` after a fatal error ([`KafkaSink::producer`]).
    producer: std::sync::Mutex<RelayProducer>,
    /// Sends what the broker refused in a record batch too large, each record in a request
    /// of its own (made at the first need).
    solo: Arc<SoloProducer>,
    client: ClientConfig,
    shown: String,
    max_message_bytes: usize,
}

/// The librdkafka properties for a sink: `kafka://host:port[,host:port]` (plaintext) or
/// `kafkas://...` (TLS), SASL from the settings, then any raw `kafka` properties.
pub fn client_config(uri: &str, config: &KafkaConfig) -> Result<ClientConfig, SinkSetupError> {
    let (tls, servers) = if let Some(rest) = uri.strip_prefix("kafkas://") {
        (true, rest)
    } else if let Some(rest) = uri.strip_prefix("kafka://") {
        // Any TLS file asks for TLS: a client certificate without a CA (the system's roots
        // then) connected in plaintext, a SASL password sent in clear.
        let files = &config.tls;
        let tls = files.ca_file.is_some() || files.cert_file.is_some() || files.key_file.is_some();
        (tls, rest)
    } else {
        return Err(SinkSetupError::config(
            "a Kafka sink URI looks like kafka://host:port[,host:port] (kafkas:// for TLS)",
        ));
    };
    let servers = servers.trim_end_matches('/');
    if servers.is_empty() {
        return Err(SinkSetupError::config("the Kafka URI names no broker"));
    }
    if servers.contains('@') {
        // librdkafka would take `user:password@host` for a host name, and log it.
        return Err(SinkSetupError::config(
            "a Kafka URI carries no user or password: give them as the sink's sasl_username \
             and sasl_password (with sasl_mechanism), and the URI as kafka://host:port",
        ));
    }
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", servers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("max.in.flight.requests.per.connection", "5")
        .set("linger.ms", "2")
        // librdkafka's default, consistent_random, sends an empty key to a random partition,
        // another every few milliseconds: a key of '' lost its order. `consistent` hashes
        // every other key as consistent_random does (CRC32: no key moves) and keeps empty
        // keys on one partition. A raw `partitioner` (murmur2 for Java's placement) wins.
        .set("partitioner", "consistent")
        .set(
            "message.timeout.ms",
            config.timeout.get().as_millis().to_string(),
        )
        // librdkafka waits this long (30 s by default) before it calls a topic missing, and
        // a record timing out first said "timed out", retried as a broker that is down, for
        // a topic that is not there. Half the timeout leaves a new topic time to appear.
        .set(
            "topic.metadata.propagation.max.ms",
            (config.timeout.get().as_millis() / 2).max(1).to_string(),
        )
        .set("client.id", "outbox-relay");
    let sasl = config.sasl_mechanism.is_some();
    if !sasl && (config.sasl_username.is_some() || config.sasl_password.is_some()) {
        // Without a mechanism they were left out, and the relay connected unauthenticated.
        return Err(SinkSetupError::config(
            "sasl_username and sasl_password need sasl_mechanism (PLAIN, SCRAM-SHA-256 or \
             SCRAM-SHA-512): set it, or remove them",
        ));
    }
    let protocol = match (tls, sasl) {
        (false, false) => "plaintext",
        (true, false) => "ssl",
        (false, true) => "sasl_plaintext",
        (true, true) => "sasl_ssl",
    };
    c.set("security.protocol", protocol);
    if let Some(ca) = &config.tls.ca_file {
        c.set("ssl.ca.location", ca.display().to_string());
    }
    if let (Some(cert), Some(key)) = (&config.tls.cert_file, &config.tls.key_file) {
        c.set("ssl.certificate.location", cert.display().to_string());
        c.set("ssl.key.location", key.display().to_string());
    }
    if let Some(mechanism) = &config.sasl_mechanism {
        c.set("sasl.mechanism", mechanism);
        if let Some(user) = &config.sasl_username {
            c.set("sasl.username", user);
        }
        if let Some(password) = &config.sasl_password {
            c.set("sasl.password", password.expose());
        }
    }
    for (k, v) in &config.kafka {
        if let Some(setting) = owned_by_a_setting(k) {
            // Why for the timeout: the one whose raw form escaped a check.
            let why = match setting {
                "timeout" => {
                    " (the relay checks it against the others: `timeout` must be shorter than \
                     publish_timeout)"
                }
                _ => "",
            };
            return Err(SinkSetupError::config(format!(
                "kafka property {k} is the sink's `{setting}` setting: set that instead{why}"
            )));
        }
        if let Some(why) = guarantee_broken_by(k, v) {
            return Err(SinkSetupError::config(format!(
                "kafka property {k} = {v:?} cannot be set: {why}; remove it"
            )));
        }
        c.set(k, v);
    }
    let timeout_ms = config.timeout.get().as_millis();
    if let Some(propagation) = config.kafka.get("topic.metadata.propagation.max.ms") {
        if propagation
            .trim()
            .parse::<u128>()
            .is_ok_and(|ms| ms >= timeout_ms)
        {
            return Err(SinkSetupError::config(format!(
                "kafka property topic.metadata.propagation.max.ms = {propagation:?} is not \
                 below the sink's timeout ({timeout_ms} ms): a record to a topic that does not \
                 exist would time out before librdkafka says the topic is missing; lower it, \
                 or raise `timeout`"
            )));
        }
    }
    Ok(c)
}

/// The sink's own setting that sets the raw property `key`, if one does: set raw, it replaced
/// the setting unchecked (a `message.timeout.ms` past `publish_timeout` had the engine give
/// up on a record librdkafka then delivered, sent again: a duplicate).
fn owned_by_a_setting(key: &str) -> Option<&'static str> {
    match key.trim() {
        "message.timeout.ms" | "delivery.timeout.ms" => Some("timeout"),
        "bootstrap.servers" | "metadata.broker.list" => Some("uri"),
        "security.protocol" => Some("uri (kafkas:// for TLS) and sasl_mechanism"),
        "sasl.mechanism" | "sasl.mechanisms" => Some("sasl_mechanism"),
        "sasl.username" => Some("sasl_username"),
        "sasl.password" => Some("sasl_password"),
        "ssl.ca.location" => Some("ca_file"),
        "ssl.certificate.location" => Some("cert_file"),
        "ssl.key.location" => Some("key_file"),
        _ => None,
    }
}

/// Why the raw property `key = value` would break what the relay promises, if it would:
/// every record acknowledged by all in-sync replicas, and the idempotent producer that keeps
/// a key's records in order across retries.
fn guarantee_broken_by(key: &str, value: &str) -> Option<&'static str> {
    let value = value.trim().to_ascii_lowercase();
    match key.trim() {
        "acks" | "request.required.acks" if !matches!(value.as_str(), "all" | "-1") => Some(
            "an event is acked once every in-sync replica holds it (acks = all, which the \
             relay sets); fewer acknowledgements could lose what was acked",
        ),
        "partitioner" if value.ends_with("random") && value != "murmur2_random" && value != "fnv1a_random" => Some(
            "a random partitioner scatters a key's records, or an empty key's, over partitions: \
             use consistent, murmur2 or fnv1a",
        ),
        "enable.idempotence" if value != "true" => Some(
            "the idempotent producer (which the relay sets) keeps a key's records in order, \
             and unduplicated, when librdkafka retries",
        ),
        // `test.mock.num.brokers` replaces the brokers (and the URI's, and TLS) with an
        // in-process fake that acknowledged every record: each event acked, none in Kafka.
        key if key.starts_with("test.") => Some(
            "librdkafka's test properties (test.mock.num.brokers among them) put an \
             in-process fake in place of the brokers, which acknowledges every record: events \
             would be acked and deleted without ever reaching Kafka",
        ),
        "delivery.report.only.error" if value == "true" => Some(
            "an event is acked on its delivery report, which this turns off for every record \
             delivered: none would be acked, and each would be sent again and again",
        ),
        "transactional.id" => Some(
            "the relay's producer is idempotent, not transactional (it acks each event on \
             its own delivery report): with a transactional id every record fails outside \
             a transaction",
        ),
        _ => None,
    }
}

impl KafkaSink {
    pub fn new(uri: &str, config: &KafkaConfig) -> Result<Self, SinkSetupError> {
        let client = client_config(uri, config)?;
        let max_message_bytes = config
            .kafka
            .get("message.max.bytes")
            .and_then(|v| v.parse().ok())
            .unwrap_or(DEFAULT_MAX_MESSAGE_BYTES);
        // librdkafka checks its properties here and connects later, in the background.
        let producer: RelayProducer =
            client.create_with_context(KafkaLogs).map_err(|e| match e {
                // Its Display quotes the value, which may be a misspelt password's.
                KafkaError::ClientConfig(_, description, name, _) => SinkSetupError::config(
                    format!("invalid Kafka settings: property `{name}`: {description}"),
                ),
                e => SinkSetupError::config(format!("invalid Kafka settings: {e}")).with_source(e),
            })?;
        // The resend has what is left of the send's `timeout` once the batch came back
        // refused, at most half: the whole send stays within it, and so within
        // `publish_timeout`. Past that, a record the engine gave up on could still land
        // after the retry of its event, and after the key's next event.
        let within = config.timeout.get() / 2;
        let mut solo = client.clone();
        solo.set("batch.num.messages", "1")
            .set("linger.ms", "0")
            .set("message.timeout.ms", within.as_millis().max(1).to_string())
            .set(
                "topic.metadata.propagation.max.ms",
                (within.as_millis() / 2).max(1).to_string(),
            );
        Ok(KafkaSink {
            producer: std::sync::Mutex::new(producer),
            solo: Arc::new(SoloProducer {
                client: solo,
                producer: std::sync::Mutex::new(None),
                within,
                warned_at: std::sync::Mutex::new(None),
            }),
            client,
            shown: outbox_core::redact::redact_url(uri),
            max_message_bytes,
        })
    }

    /// The producer, made again if librdkafka raised a fatal error on it: the idempotent
    /// producer then fails every record for good (`__FATAL`), and was never replaced, so
    /// each event was retried to its attempt limit and dead-lettered until a restart. The
    /// records it failed go again, in order, through the new one.
    fn producer(&self) -> RelayProducer {
        let mut producer = self
            .producer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((code, reason)) = producer.client().fatal_error() {
            match self.client.create_with_context(KafkaLogs) {
                Ok(fresh) => {
                    tracing::error!(sink = %self.shown, error = %reason, ?code, "the Kafka producer hit a fatal error; a new one takes over");
                    *producer = fresh;
                }
                Err(e) => {
                    tracing::error!(sink = %self.shown, error = %e, "the Kafka producer hit a fatal error and a new one could not be made; trying again with the next batch");
                }
            }
        }
        producer.clone()
    }
}

/// A producer that sends each record in a record batch of its own. The broker refuses a
/// batch over its topic's `max.message.bytes` whole, every record in it however small, and
/// librdkafka does not split it: the records come back together at each retry, and were
/// refused together to their attempt limit, small events of other keys dead-lettered with
/// the one too large. Sent again one by one, each small one is delivered, and one refused
/// alone is too large by itself.
struct SoloProducer {
    client: ClientConfig,
    producer: std::sync::Mutex<Option<RelayProducer>>,
    /// How long after the send began the resend may start, and how long it may take.
    within: Duration,
    /// When a resend was last logged: one line a minute.
    warned_at: std::sync::Mutex<Option<std::time::Instant>>,
}

impl SoloProducer {
    /// The producer if it was ever made (to flush at shutdown).
    fn existing(&self) -> Option<RelayProducer> {
        self.producer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Says, once a minute at most, that batches are refused whole and sent again record by
    /// record: slower, and mended by a setting.
    fn warn_of_resend(&self, topic: &str, records: usize) {
        let mut warned_at = self
            .warned_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if warned_at.is_some_and(|at| at.elapsed() < Duration::from_secs(60)) {
            return;
        }
        *warned_at = Some(std::time::Instant::now());
        tracing::warn!(
            topic,
            records,
            "the broker refused a record batch as larger than the topic's max.message.bytes; \
             its records go again one per request, which is slower: set the sink's batch.size \
             (under [sinks.NAME.kafka]) at or below the topic's max.message.bytes"
        );
    }

    /// The producer, made at the first need, and again after a fatal error.
    fn get(&self) -> Result<RelayProducer, KafkaError> {
        let mut slot = self
            .producer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match &*slot {
            Some(producer) if producer.client().fatal_error().is_none() => Ok(producer.clone()),
            _ => {
                let fresh: RelayProducer = self.client.create_with_context(KafkaLogs)?;
                *slot = Some(fresh.clone());
                Ok(fresh)
            }
        }
    }
}

/// How one record's send failed.
enum Failed {
    /// librdkafka refused it when it was handed over.
    Enqueued(KafkaError),
    /// Its delivery report says so.
    Delivered(KafkaError),
    /// The producer shut down before reporting.
    Shutdown,
}

impl Failed {
    /// The broker refused the record batch that carried it as too large.
    fn in_a_batch_too_large(&self) -> bool {
        matches!(self, Failed::Delivered(e) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::MessageSizeTooLarge))
    }

    fn into_error(self, topic: &str) -> PublishError {
        match self {
            Failed::Enqueued(e) => classify(e, topic),
            Failed::Delivered(e) => classify_delivery(e, topic),
            Failed::Shutdown => PublishError::new(
                PublishErrorKind::Unavailable,
                "the Kafka producer shut down",
            ),
        }
    }
}

/// Hands `routed` to `producer`, stamped with the relay's headers and the event's own:
/// the future resolves with its delivery report.
fn produce(producer: &RelayProducer, routed: &Routed) -> BoxFuture<'static, Result<(), Failed>> {
    let event = &routed.event;
    let id = event.event_id.hyphenated().to_string();
    let sequence = event.sequence_id.to_string();
    let mut headers = OwnedHeaders::new_with_capacity(event.headers.len() + 4)
        .insert(Header {
            key: HEADER_EVENT_ID,
            value: Some(id.as_str()),
        })
        .insert(Header {
            key: HEADER_EVENT_TYPE,
            value: Some(event.event_type.as_str()),
        })
        .insert(Header {
            key: HEADER_SEQUENCE_ID,
            value: Some(sequence.as_str()),
        });
    if let Some(m) = &event.mutation_id {
        headers = headers.insert(Header {
            key: HEADER_MUTATION_ID,
            value: Some(m.as_str()),
        });
    }
    // An event's own header of a relay header's name is left out: Kafka keeps both, and
    // consumers read the last, which would replace the id stamp. Kafka's header names are
    // case-sensitive: only the relay's own names, as it stamps them on this record.
    let stamped = |name: &str| {
        RELAY_HEADERS.contains(&name) && (name != HEADER_MUTATION_ID || event.mutation_id.is_some())
    };
    for (k, v) in event.headers.iter().filter(|(k, _)| !stamped(k)) {
        headers = headers.insert(Header {
            key: k.as_str(),
            value: Some(v.as_str()),
        });
    }
    let record = FutureRecord::to(&routed.target)
        .key(event.ordering_key())
        .payload(event.payload.as_bytes())
        .headers(headers);
    match producer.send_result(record) {
        Ok(delivery) => async move {
            match delivery.await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err((e, _))) => Err(Failed::Delivered(e)),
                Err(_) => Err(Failed::Shutdown),
            }
        }
        .boxed(),
        Err((e, _)) => async move { Err(Failed::Enqueued(e)) }.boxed(),
    }
}

/// Kafka's own topics (`__consumer_offsets`, `__transaction_state`, Connect's and
/// Streams' internals) start with `__`: a record there corrupts what they hold.
fn internal_topic(topic: &str) -> Option<&'static str> {
    topic.starts_with("__").then_some("a Kafka internal topic")
}

/// The one place Kafka errors become publish outcomes, for a record to `topic`.
fn classify(error: KafkaError, topic: &str) -> PublishError {
    classify_as(error, format!("kafka topic {topic:?}"))
}

/// [`classify`], the error saying what failed as `what`.
fn classify_as(error: KafkaError, what: String) -> PublishError {
    use RDKafkaErrorCode as C;
    let kind = match error.rdkafka_error_code() {
        Some(C::MessageSizeTooLarge) => PublishErrorKind::TooLarge,
        Some(
            C::TopicAuthorizationFailed
            | C::ClusterAuthorizationFailed
            | C::SaslAuthenticationFailed,
        ) => PublishErrorKind::Unauthorized,
        Some(C::UnknownTopicOrPartition | C::UnknownTopic) => PublishErrorKind::MissingTarget,
        Some(C::MessageTimedOut | C::RequestTimedOut) => PublishErrorKind::Timeout,
        Some(C::QueueFull) => PublishErrorKind::Throttled,
        // The record's own: a topic name the broker refuses (`orders:7`), a record it
        // refuses, a policy (a topic's own rules) it breaks. Sent again, refused again.
        // librdkafka refuses a topic name over 512 bytes as an invalid argument, before
        // any broker sees it; a NUL in it cannot reach librdkafka at all.
        Some(
            C::InvalidRecord
            | C::InvalidTopic
            | C::InvalidMessage
            | C::PolicyViolation
            | C::InvalidArgument,
        ) => PublishErrorKind::Rejected,
        _ if matches!(error, KafkaError::Nul(_)) => PublishErrorKind::Rejected,
        _ => PublishErrorKind::Unavailable,
    };
    let what = match kind {
        // librdkafka's own check, before any broker: its words name no setting.
        PublishErrorKind::TooLarge => format!(
            "{what}: the record (payload, key and headers) is larger than the producer's \
             message.max.bytes ({DEFAULT_MAX_MESSAGE_BYTES} unless set under \
             [sinks.NAME.kafka])"
        ),
        _ => what,
    };
    PublishError::new(kind, what).with_source(error)
}

/// A delivery report's error. librdkafka refuses a record over the producer's
/// `message.max.bytes` when it is sent, before any batch; a `MESSAGE_TOO_LARGE` reported at
/// delivery is the broker's refusal of the whole record batch, over the topic's
/// `max.message.bytes`, which fails every record in it however small, and librdkafka does
/// not split the batch. As the record's own, it dead-lettered whole batches of small events
/// at once. The sink sends such records again one by one ([`SoloProducer`]); this is the
/// error of those it could not (no producer for it), retried.
fn classify_delivery(error: KafkaError, topic: &str) -> PublishError {
    if error.rdkafka_error_code() != Some(RDKafkaErrorCode::MessageSizeTooLarge) {
        return classify(error, topic);
    }
    PublishError::new(
        PublishErrorKind::BrokerFailure,
        format!(
            "kafka topic {topic:?} refused the record batch carrying this event as larger than \
             its max.message.bytes: set the sink's batch.size and message.max.bytes (under \
             [sinks.NAME.kafka]) at or below the topic's max.message.bytes, or raise the \
             topic's (its records could not be sent again one by one in time)"
        ),
    )
    .with_source(error)
}

/// A record the broker refused as too large when it was alone in its record batch: the
/// event is larger than the topic's `max.message.bytes` by itself, and will never fit.
fn too_large_alone(failure: Failed, topic: &str) -> PublishError {
    let error = PublishError::new(
        PublishErrorKind::TooLarge,
        format!(
            "kafka topic {topic:?} refused this event, sent alone, as larger than the topic's \
             max.message.bytes: raise the topic's max.message.bytes (and the sink's \
             message.max.bytes under [sinks.NAME.kafka]), or make the event smaller"
        ),
    );
    match failure {
        Failed::Enqueued(e) | Failed::Delivered(e) => error.with_source(e),
        Failed::Shutdown => error,
    }
}

impl Sink for KafkaSink {
    fn messaging_system(&self) -> Option<&'static str> {
        Some("kafka")
    }

    fn reserved_target(&self, target: &str) -> Option<&'static str> {
        internal_topic(target)
    }

    fn cloudevents_binding(&self) -> Option<crate::cloudevents::Binding> {
        Some(crate::cloudevents::Binding::Kafka)
    }

    fn describe(&self) -> String {
        self.shown.clone()
    }

    fn send(&self, batch: Vec<Routed>) -> BoxFuture<'static, Vec<Outcome>> {
        // Enqueue the whole batch, then await every delivery report.
        let producer = self.producer();
        let began = std::time::Instant::now();
        let deliveries: Vec<_> = batch.iter().map(|r| produce(&producer, r)).collect();
        let solo = self.solo.clone();
        async move {
            let mut failed: Vec<(usize, Failed)> = Vec::new();
            let mut outcomes: Vec<Outcome> = Vec::with_capacity(batch.len());
            for (i, result) in join_all(deliveries).await.into_iter().enumerate() {
                outcomes.push(Ok(()));
                if let Err(failure) = result {
                    failed.push((i, failure));
                }
            }
            let (in_batches_too_large, others): (Vec<_>, Vec<_>) =
                failed.into_iter().partition(|(_, f)| f.in_a_batch_too_large());
            for (i, failure) in others {
                outcomes[i] = Err(failure.into_error(&batch[i].target));
            }
            if in_batches_too_large.is_empty() {
                return outcomes;
            }
            // Each again, alone in its request (`SoloProducer`), while the send has time.
            let resender = match began.elapsed() < solo.within {
                true => solo.get().map_err(|e| {
                    tracing::warn!(error = %e, "could not make the Kafka producer that sends records one by one; the records of a batch refused as too large are retried as they were");
                }),
                false => Err(()),
            };
            let Ok(resender) = resender else {
                for (i, failure) in in_batches_too_large {
                    outcomes[i] = Err(failure.into_error(&batch[i].target));
                }
                return outcomes;
            };
            solo.warn_of_resend(&batch[in_batches_too_large[0].0].target, in_batches_too_large.len());
            let solo = resender;
            let resent = join_all(
                in_batches_too_large
                    .iter()
                    .map(|(i, _)| produce(&solo, &batch[*i])),
            )
            .await;
            for ((i, _), result) in in_batches_too_large.into_iter().zip(resent) {
                let topic = &batch[i].target;
                outcomes[i] = match result {
                    Ok(()) => Ok(()),
                    Err(f) if f.in_a_batch_too_large() => Err(too_large_alone(f, topic)),
                    Err(f) => Err(f.into_error(topic)),
                };
            }
            outcomes
        }
        .boxed()
    }

    fn health(&self) -> BoxFuture<'static, Result<(), PublishError>> {
        let producer = self.producer();
        let shown = self.shown.clone();
        async move {
            if let Some((_, reason)) = producer.client().fatal_error() {
                return Err(PublishError::new(
                    PublishErrorKind::BrokerFailure,
                    format!("{shown}: the producer hit a fatal error ({reason})"),
                ));
            }
            tokio::task::spawn_blocking(move || {
                producer
                    .client()
                    .fetch_metadata(None, Duration::from_secs(3))
            })
            .await
            .map_err(|e| PublishError::new(PublishErrorKind::Unavailable, format!("{shown}: {e}")))?
            .map(|_| ())
            .map_err(|e| classify_as(e, format!("{shown}: reading the cluster's metadata")))
        }
        .boxed()
    }

    fn max_message_bytes(&self) -> Option<usize> {
        Some(self.max_message_bytes)
    }

    /// librdkafka's `message.max.bytes`, which the sink sets.
    fn limit_is_fixed(&self) -> bool {
        true
    }

    fn close(&self) -> BoxFuture<'static, ()> {
        let producers: Vec<RelayProducer> = std::iter::once(self.producer())
            .chain(self.solo.existing())
            .collect();
        let shown = self.shown.clone();
        async move {
            for producer in producers {
                let flushed =
                    tokio::task::spawn_blocking(move || producer.flush(Duration::from_secs(5)))
                        .await;
                if let Ok(Err(e)) = flushed {
                    // Their events were not acked: they go out again at the next start.
                    tracing::warn!(sink = %shown, error = %e, "records still unconfirmed at shutdown; their events are not acked, and are sent again at the next start");
                }
            }
        }
        .boxed()
    }
}

pub fn sink(uri: &str, config: &KafkaConfig) -> Result<Arc<dyn Sink>, SinkSetupError> {
    Ok(Arc::new(KafkaSink::new(uri, config)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// librdkafka's properties are text; a number or flag written bare is taken as its text,
    /// and a value of no scalar type is refused without being quoted (it may be a password:
    /// serde's own error quoted `98765432101234`).
    #[test]
    fn properties_take_scalars_as_text_and_refuse_others_unquoted() {
        let read: KafkaConfig = serde_json::from_value(serde_json::json!({
            "kafka": {"batch.size": 65536, "enable.idempotence": true, "client.rack": "r1"}
        }))
        .unwrap();
        assert_eq!(read.kafka["batch.size"], "65536");
        assert_eq!(read.kafka["enable.idempotence"], "true");
        let refused = serde_json::from_value::<KafkaConfig>(serde_json::json!({
            "kafka": {"ssl.key.password": [98765432101234_u64]}
        }))
        .unwrap_err()
        .to_string();
        assert!(!refused.contains("98765432101234"), "{refused}");
        assert!(refused.contains("string, number or boolean"), "{refused}");
    }

    /// A topic name librdkafka refuses (over 512 bytes, a NUL) is the record's own: sent
    /// again, refused again. Retried, it held its key back until `max_attempts`.
    #[test]
    fn a_topic_librdkafka_refuses_is_the_records_fault() {
        let invalid = KafkaError::MessageProduction(RDKafkaErrorCode::InvalidArgument);
        assert_eq!(classify(invalid, "t").kind(), PublishErrorKind::Rejected);
        let nul = std::ffi::CString::new("a\0b").unwrap_err();
        assert_eq!(
            classify(KafkaError::Nul(nul), "t").kind(),
            PublishErrorKind::Rejected
        );
        let down = KafkaError::MessageProduction(RDKafkaErrorCode::BrokerTransportFailure);
        assert_eq!(classify(down, "t").kind(), PublishErrorKind::Unavailable);
    }

    #[test]
    fn raw_properties_a_setting_owns_and_credentials_without_a_mechanism_are_refused() {
        let with = |kafka: &[(&str, &str)]| KafkaConfig {
            kafka: kafka
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..KafkaConfig::default()
        };
        let err = client_config("kafka://b:9092", &with(&[("message.timeout.ms", "60000")]))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("`timeout` setting") && err.contains("publish_timeout"),
            "{err}"
        );
        // The timeout's note is the timeout's alone.
        let err = client_config("kafka://b:9092", &with(&[("sasl.username", "u")]))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("`sasl_username` setting"), "{err}");
        assert!(!err.contains("publish_timeout"), "{err}");
        assert!(client_config("kafka://b:9092", &with(&[("linger.ms", "5")])).is_ok());
        let credentials = KafkaConfig {
            sasl_username: Some("relay".into()),
            sasl_password: Some(Secret::new("pw")),
            ..KafkaConfig::default()
        };
        let err = client_config("kafka://b:9092", &credentials)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("need sasl_mechanism"), "{err}");
    }

    #[test]
    fn topics_starting_with_two_underscores_are_kafkas_own() {
        for topic in ["__consumer_offsets", "__transaction_state", "__x"] {
            assert_eq!(
                internal_topic(topic),
                Some("a Kafka internal topic"),
                "{topic}"
            );
        }
        for topic in ["orders", "_orders", "orders__x", ""] {
            assert_eq!(internal_topic(topic), None, "{topic}");
        }
    }

    #[test]
    fn uri_and_settings_become_librdkafka_properties() {
        let config = KafkaConfig {
            sasl_mechanism: Some("SCRAM-SHA-512".into()),
            sasl_username: Some("relay".into()),
            sasl_password: Some(Secret::new("pw")),
            ..KafkaConfig::default()
        };
        let c = client_config("kafkas://b1:9093,b2:9093", &config).unwrap();
        assert_eq!(c.get("bootstrap.servers"), Some("b1:9093,b2:9093"));
        assert_eq!(c.get("security.protocol"), Some("sasl_ssl"));
        assert_eq!(c.get("enable.idempotence"), Some("true"));
        assert_eq!(c.get("acks"), Some("all"));
        assert_eq!(c.get("sasl.mechanism"), Some("SCRAM-SHA-512"));
        assert!(client_config("kafka://", &KafkaConfig::default()).is_err());
    }

    /// A client certificate without a CA connected in plaintext (with SASL, its password in
    /// clear): any TLS file asks for TLS.
    #[test]
    fn a_client_certificate_without_a_ca_is_tls() {
        let config = KafkaConfig {
            tls: crate::settings::TlsFiles {
                cert_file: Some("/etc/relay/client.pem".into()),
                key_file: Some("/etc/relay/client.key".into()),
                ..Default::default()
            },
            sasl_mechanism: Some("PLAIN".into()),
            sasl_username: Some("relay".into()),
            sasl_password: Some(Secret::new("pw")),
            ..KafkaConfig::default()
        };
        let c = client_config("kafka://b1:9093", &config).unwrap();
        assert_eq!(c.get("security.protocol"), Some("sasl_ssl"));
        let plain = client_config("kafka://b1:9092", &KafkaConfig::default()).unwrap();
        assert_eq!(plain.get("security.protocol"), Some("plaintext"));
    }

    /// Two of librdkafka's sensitive properties were shown in `/api/v1/status`, and a
    /// misspelt property's value was quoted in the error that refused it.
    #[test]
    fn secret_properties_never_show() {
        for name in [
            "sasl.oauthbearer.assertion.private.key.passphrase",
            "sasl.oauthbearer.assertion.private.key.pem",
            "ssl.key.pem",
            "ssl.key.password",
            "sasl.oauthbearer.client.secret",
            "sasl.oauthbearer.config",
        ] {
            assert!(is_secret_property(name), "{name}");
        }
        for name in ["ssl.ca.pem", "ssl.certificate.pem", "linger.ms"] {
            assert!(!is_secret_property(name), "{name}");
        }
        let config = KafkaConfig {
            kafka: [("sasl.pasword".to_string(), "hunter2-x".to_string())].into(),
            ..KafkaConfig::default()
        };
        let err = KafkaSink::new("kafka://127.0.0.1:9", &config)
            .err()
            .expect("a misspelt property is refused")
            .to_string();
        assert!(
            err.contains("sasl.pasword") && !err.contains("hunter2"),
            "{err}"
        );
    }

    /// Raw properties were applied last, so `acks = 1` or `enable.idempotence = false`
    /// silently undid what acking and per-key order rest on.
    #[test]
    fn raw_properties_cannot_undo_the_delivery_guarantees() {
        let with = |key: &str, value: &str| KafkaConfig {
            kafka: [(key.to_string(), value.to_string())].into_iter().collect(),
            ..KafkaConfig::default()
        };
        for (key, value) in [
            ("acks", "1"),
            ("request.required.acks", "0"),
            ("enable.idempotence", "false"),
        ] {
            let err = client_config("kafka://b:9092", &with(key, value))
                .err()
                .unwrap_or_else(|| panic!("{key} = {value} accepted"));
            assert!(err.to_string().contains(key), "{err}");
        }
        // A random partitioner scatters a key, and consistent_random an empty one.
        for (key, value) in [
            ("partitioner", "random"),
            ("partitioner", "consistent_random"),
        ] {
            assert!(client_config("kafka://b:9092", &with(key, value)).is_err());
        }
        let keeps = client_config("kafka://b:9092", &KafkaConfig::default()).unwrap();
        assert_eq!(keeps.get("partitioner"), Some("consistent"));
        for (key, value) in [
            ("acks", "all"),
            ("acks", "-1"),
            ("linger.ms", "5"),
            ("partitioner", "murmur2"),
        ] {
            assert!(client_config("kafka://b:9092", &with(key, value)).is_ok());
        }
    }

    /// Raw properties that took the acknowledgement away from the brokers' own: the mock
    /// cluster, which replaced the brokers and acknowledged every record (each event
    /// acked and deleted, none in Kafka, `check` saying ok); no delivery report for a
    /// record delivered (none ever acked, each sent again and again); a transactional id
    /// (every record failing, retried for good as a broker that is down).
    #[test]
    fn raw_properties_that_fake_or_withhold_the_acknowledgement_are_refused() {
        let with = |key: &str, value: &str| KafkaConfig {
            kafka: [(key.to_string(), value.to_string())].into_iter().collect(),
            ..KafkaConfig::default()
        };
        for (key, value, says) in [
            ("test.mock.num.brokers", "1", "in-process fake"),
            ("test.mock.broker.rtt", "10", "in-process fake"),
            ("delivery.report.only.error", "true", "none would be acked"),
            ("transactional.id", "relay-1", "not transactional"),
        ] {
            let err = client_config("kafka://b:9092", &with(key, value))
                .err()
                .unwrap_or_else(|| panic!("{key} = {value} accepted"))
                .to_string();
            assert!(err.contains(key) && err.contains(says), "{err}");
        }
        assert!(client_config(
            "kafka://b:9092",
            &with("delivery.report.only.error", "false")
        )
        .is_ok());
    }

    /// librdkafka calls a topic missing only after `topic.metadata.propagation.max.ms`, 30 s
    /// by default, past the default 10 s timeout: a record to a topic that is not there
    /// timed out, retried as a broker down, never named missing. The relay sets it to half
    /// the timeout, and refuses a raw one that is not below it.
    #[test]
    fn a_missing_topic_is_named_before_the_record_times_out() {
        let mut config = KafkaConfig::default();
        let c = client_config("kafka://b:9092", &config).unwrap();
        let timeout: u128 = c.get("message.timeout.ms").unwrap().parse().unwrap();
        let propagation: u128 = c
            .get("topic.metadata.propagation.max.ms")
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            propagation > 0 && propagation < timeout,
            "{propagation} / {timeout}"
        );
        config.kafka.insert(
            "topic.metadata.propagation.max.ms".into(),
            timeout.to_string(),
        );
        let err = client_config("kafka://b:9092", &config)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("not below the sink's timeout"), "{err}");
        config
            .kafka
            .insert("topic.metadata.propagation.max.ms".into(), "1000".into());
        assert!(client_config("kafka://b:9092", &config).is_ok());
    }
}
