//! Sink settings, as written under `[sinks.NAME]` in the configuration file.
//!
//! The URI's scheme chooses the sink ([`SinkKind`]). What every sink reads (`uri`,
//! `max_message_bytes`) is declared here once, in [`SinkConfig`]; each sink module owns a
//! struct of its own settings (`NatsConfig`, `RedisConfig`, ...) with unknown fields denied,
//! and the settings several brokers share are declared once too ([`ConfirmTimeout`],
//! [`TlsFiles`], in `settings.rs`) and flattened into theirs. So a setting the chosen sink does not read (a
//! Redis `maxlen` on a NATS sink) is a configuration error naming it, never silently ignored.

use serde::de::value::MapAccessDeserializer;
use serde::de::{DeserializeOwned, DeserializeSeed, IntoDeserializer, MapAccess};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};
use std::time::Duration;

use crate::error::SinkSetupError;
pub use crate::settings::{duration, ConfirmTimeout, TlsFiles, DEFAULT_SINK_TIMEOUT};
use outbox_core::redact::redact_url;

/// The sink a URI names, by its scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SinkKind {
    Stdout,
    File,
    Nats,
    Kafka,
    RabbitMq,
    Redis,
    Webhook,
    Ably,
    Sqs,
    Sns,
    Kinesis,
    EventBridge,
}

impl SinkKind {
    pub const ALL: [SinkKind; 12] = [
        SinkKind::Stdout,
        SinkKind::File,
        SinkKind::Nats,
        SinkKind::Kafka,
        SinkKind::RabbitMq,
        SinkKind::Redis,
        SinkKind::Webhook,
        SinkKind::Ably,
        SinkKind::Sqs,
        SinkKind::Sns,
        SinkKind::Kinesis,
        SinkKind::EventBridge,
    ];

    /// The URI schemes that choose this sink.
    pub fn schemes(self) -> &'static [&'static str] {
        match self {
            SinkKind::Stdout => &["stdout"],
            SinkKind::File => &["file"],
            SinkKind::Nats => &["nats", "tls"],
            SinkKind::Kafka => &["kafka", "kafkas"],
            SinkKind::RabbitMq => &["amqp", "amqps"],
            SinkKind::Redis => &["redis", "rediss"],
            SinkKind::Webhook => &["http", "https"],
            SinkKind::Ably => &["ably"],
            SinkKind::Sqs => &["sqs"],
            SinkKind::Sns => &["sns"],
            SinkKind::Kinesis => &["kinesis"],
            SinkKind::EventBridge => &["eventbridge"],
        }
    }

    /// The sink's name in messages, and the cargo feature that builds it (none: always built).
    pub fn name_and_feature(self) -> (&'static str, Option<&'static str>) {
        match self {
            SinkKind::Stdout => ("stdout", None),
            SinkKind::File => ("file", None),
            SinkKind::Nats => ("NATS", Some("nats")),
            SinkKind::Kafka => ("Kafka", Some("kafka")),
            SinkKind::RabbitMq => ("RabbitMQ", Some("rabbitmq")),
            SinkKind::Redis => ("Redis", Some("redis")),
            SinkKind::Webhook => ("webhook", Some("webhook")),
            SinkKind::Ably => ("Ably", Some("ably")),
            SinkKind::Sqs => ("SQS", Some("aws")),
            SinkKind::Sns => ("SNS", Some("aws")),
            SinkKind::Kinesis => ("Kinesis", Some("aws")),
            SinkKind::EventBridge => ("EventBridge", Some("aws")),
        }
    }

    /// Why the sink sends nowhere a route's `target` could name, for those that do not (a
    /// target given to one would change nothing).
    pub fn ignores_targets(self) -> Option<&'static str> {
        match self {
            SinkKind::Stdout | SinkKind::File => {
                Some("it writes every event alike, its destination in the line")
            }
            SinkKind::Webhook => Some(
                "its URL, a template with {destination}, names where each event goes: put \
                 the target in the URL of a sink of its own",
            ),
            _ => None,
        }
    }

    /// Whether this build has the sink.
    pub fn is_built(self) -> bool {
        match self {
            SinkKind::Stdout | SinkKind::File => true,
            SinkKind::Nats => cfg!(feature = "nats"),
            SinkKind::Kafka => cfg!(feature = "kafka"),
            SinkKind::RabbitMq => cfg!(feature = "rabbitmq"),
            SinkKind::Redis => cfg!(feature = "redis"),
            SinkKind::Webhook => cfg!(feature = "webhook"),
            SinkKind::Ably => cfg!(feature = "ably"),
            SinkKind::Sqs | SinkKind::Sns | SinkKind::Kinesis | SinkKind::EventBridge => {
                cfg!(feature = "aws")
            }
        }
    }

    /// The sink `uri` names; an unknown scheme is a configuration error listing the choices.
    pub fn of(uri: &str) -> Result<SinkKind, SinkSetupError> {
        let scheme = scheme_of(uri);
        SinkKind::ALL
            .into_iter()
            .find(|kind| kind.schemes().contains(&scheme))
            .ok_or_else(|| {
                SinkSetupError::config(format!(
                    "unknown URI scheme {scheme:?}: use stdout, file:PATH, nats://, kafka://, amqp://, redis://, http(s)://, ably:, sqs:, sns:, kinesis: or eventbridge:"
                ))
            })
    }

    /// The error for a sink this build leaves out, naming the feature that brings it.
    pub(crate) fn not_built(self) -> SinkSetupError {
        let (sink, feature) = self.name_and_feature();
        SinkSetupError::config(format!(
            "this build has no {sink} sink; build with --features {} (or use a build that has it)",
            feature.unwrap_or_default()
        ))
    }
}

/// The URI's scheme: `nats` for `nats://host`, `file` for `file:PATH`.
fn scheme_of(uri: &str) -> &str {
    uri.trim().split(':').next().unwrap_or_default()
}

/// One `[sinks.NAME]`: the URI, the settings every sink reads, and the chosen sink's own.
/// Built by reading a table (serde) or from a bare URI ([`SinkConfig::new`]), so its
/// settings always belong to the sink its URI names.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SinkConfig {
    /// `stdout`, `file:PATH`, `nats://`, `kafka://`, `amqp://`/`amqps://`,
    /// `redis://`/`rediss://`, `http://`/`https://` (a URL template), `ably:`, `sqs:`, `sns:`,
    /// `kinesis:`, `eventbridge:` (`eventbridge://BUS`).
    uri: String,
    /// Payloads larger than this are dead-lettered at once [default: the broker's limit].
    max_message_bytes: Option<usize>,
    #[serde(flatten)]
    settings: SinkSettings,
}

/// The settings of the sink a URI names, each owned by its sink's module.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum SinkSettings {
    /// stdout and files read nothing more; a sink this build leaves out is refused when built.
    None,
    #[cfg(feature = "nats")]
    Nats(crate::nats::NatsConfig),
    #[cfg(feature = "kafka")]
    Kafka(crate::kafka::KafkaConfig),
    #[cfg(feature = "rabbitmq")]
    RabbitMq(crate::rabbitmq::RabbitMqConfig),
    #[cfg(feature = "redis")]
    Redis(crate::redis::RedisConfig),
    #[cfg(feature = "webhook")]
    Webhook(crate::webhook::WebhookConfig),
    #[cfg(feature = "ably")]
    Ably(crate::ably::AblyConfig),
    #[cfg(feature = "aws")]
    Sqs(crate::aws::settings::AwsConfig),
    #[cfg(feature = "aws")]
    Sns(crate::aws::settings::AwsConfig),
    #[cfg(feature = "aws")]
    Kinesis(crate::aws::settings::AwsConfig),
    #[cfg(feature = "aws")]
    EventBridge(crate::aws::settings::EventBridgeConfig),
}

impl SinkSettings {
    /// The longest one batch may take at a sink whose requests wait for a free slot (the
    /// webhook's per destination, the AWS sinks' `concurrency`, RabbitMQ's one batch at a
    /// time on its channel): it gives up waiting after half its timeout (the default one
    /// too), then gives the request its whole timeout. `None` for the other sinks, whose
    /// longest batch is their timeout.
    pub fn longest_batch(&self) -> Option<Duration> {
        let timeout = self
            .confirm_timeout()
            .unwrap_or(crate::settings::DEFAULT_SINK_TIMEOUT);
        let waits = match self {
            SinkSettings::None => return None,
            #[cfg(feature = "webhook")]
            SinkSettings::Webhook(_) => true,
            #[cfg(feature = "rabbitmq")]
            SinkSettings::RabbitMq(_) => true,
            #[cfg(feature = "aws")]
            SinkSettings::Sqs(_)
            | SinkSettings::Sns(_)
            | SinkSettings::Kinesis(_)
            | SinkSettings::EventBridge(_) => true,
            #[allow(unreachable_patterns)]
            _ => false,
        };
        waits.then(|| timeout + crate::sink::turn_wait(timeout))
    }

    /// The confirmation `timeout` the sink's table sets; `None`: not set, or a sink that
    /// confirms by writing (stdout, files).
    pub fn confirm_timeout(&self) -> Option<Duration> {
        match self {
            SinkSettings::None => None,
            #[cfg(feature = "nats")]
            SinkSettings::Nats(c) => c.timeout.timeout,
            #[cfg(feature = "kafka")]
            SinkSettings::Kafka(c) => c.timeout.timeout,
            #[cfg(feature = "rabbitmq")]
            SinkSettings::RabbitMq(c) => c.timeout.timeout,
            #[cfg(feature = "redis")]
            SinkSettings::Redis(c) => c.timeout.timeout,
            #[cfg(feature = "webhook")]
            SinkSettings::Webhook(c) => c.timeout.timeout,
            #[cfg(feature = "ably")]
            SinkSettings::Ably(c) => c.timeout.timeout,
            #[cfg(feature = "aws")]
            SinkSettings::Sqs(c) | SinkSettings::Sns(c) | SinkSettings::Kinesis(c) => {
                c.timeout.timeout
            }
            #[cfg(feature = "aws")]
            SinkSettings::EventBridge(c) => c.aws.timeout.timeout,
        }
    }
}

/// What stdout and file sinks read beyond the common settings: nothing.
#[derive(Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct NoSettings {}

impl SinkConfig {
    /// The sink `uri` names, with its defaults (`--sink URI`). A scheme no sink of this build
    /// reads is reported when the sink is built.
    pub fn new(uri: impl Into<String>) -> Self {
        let uri = uri.into();
        let settings = SinkKind::of(&uri)
            .and_then(|kind| read_settings(kind, &uri, Map::new()))
            .unwrap_or(SinkSettings::None);
        SinkConfig {
            uri,
            max_message_bytes: None,
            settings,
        }
    }

    /// Reads one `[sinks.NAME]` table: `uri` chooses the sink, whose own settings struct then
    /// reads the rest. A setting that sink does not read is refused by name.
    pub fn from_table(mut table: Map<String, Value>) -> Result<Self, SinkSetupError> {
        let uri: String = take(&mut table, "uri")?.ok_or_else(|| {
            SinkSetupError::config(
                "`uri` is missing: every sink needs one, e.g. uri = \"nats://127.0.0.1:4222\"",
            )
        })?;
        let max_message_bytes = take(&mut table, "max_message_bytes")?;
        if max_message_bytes == Some(0) {
            // Every event larger than nothing would be dead-lettered as too large.
            return Err(SinkSetupError::config(
                "`max_message_bytes` = 0 refuses every event (each would be dead-lettered as \
                 too large): set the largest message the broker takes, or leave it out for \
                 the sink's own limit",
            ));
        }
        let settings = read_settings(SinkKind::of(&uri)?, &uri, table)?;
        Ok(SinkConfig {
            uri,
            max_message_bytes,
            settings,
        })
    }

    pub fn uri(&self) -> &str {
        &self.uri
    }

    pub fn max_message_bytes(&self) -> Option<usize> {
        self.max_message_bytes
    }

    pub fn settings(&self) -> &SinkSettings {
        &self.settings
    }
}

impl<'de> Deserialize<'de> for SinkConfig {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // The sink is known only once `uri` is read, and a table's keys come in any order:
        // the table is read whole first.
        let table = Map::<String, Value>::deserialize(deserializer)?;
        SinkConfig::from_table(table).map_err(serde::de::Error::custom)
    }
}

/// Removes `key` from the table and reads it, naming it if its value does not fit.
fn take<T: DeserializeOwned>(
    table: &mut Map<String, Value>,
    key: &str,
) -> Result<Option<T>, SinkSetupError> {
    table
        .remove(key)
        .map(|value| {
            // Option: a value written out as null (serde's None) reads back as unset.
            Option::<T>::deserialize(value)
                .map_err(|e| SinkSetupError::config(format!("`{key}`: {e}")))
        })
        .transpose()
        .map(Option::flatten)
}

/// The settings of the `kind` sink from what is left of its table.
fn read_settings(
    kind: SinkKind,
    uri: &str,
    table: Map<String, Value>,
) -> Result<SinkSettings, SinkSetupError> {
    match kind {
        SinkKind::Stdout | SinkKind::File => {
            read::<NoSettings>(uri, table)?;
            Ok(SinkSettings::None)
        }
        #[cfg(feature = "nats")]
        SinkKind::Nats => read(uri, table).map(SinkSettings::Nats),
        #[cfg(feature = "kafka")]
        SinkKind::Kafka => read(uri, table).map(SinkSettings::Kafka),
        #[cfg(feature = "rabbitmq")]
        SinkKind::RabbitMq => read(uri, table).map(SinkSettings::RabbitMq),
        #[cfg(feature = "redis")]
        SinkKind::Redis => read(uri, table).map(SinkSettings::Redis),
        #[cfg(feature = "webhook")]
        SinkKind::Webhook => read(uri, table).map(SinkSettings::Webhook),
        #[cfg(feature = "ably")]
        SinkKind::Ably => read(uri, table).map(SinkSettings::Ably),
        #[cfg(feature = "aws")]
        SinkKind::Sqs => read(uri, table).map(SinkSettings::Sqs),
        #[cfg(feature = "aws")]
        SinkKind::Sns => read(uri, table).map(SinkSettings::Sns),
        #[cfg(feature = "aws")]
        SinkKind::Kinesis => read(uri, table).map(SinkSettings::Kinesis),
        #[cfg(feature = "aws")]
        SinkKind::EventBridge => read(uri, table).map(SinkSettings::EventBridge),
        // A sink this build leaves out has no settings type to check against; building it
        // names the feature that brings it (commands that never build sinks still work).
        #[allow(unreachable_patterns)]
        _ => Ok(SinkSettings::None),
    }
}

/// Reads a sink's own settings struct `T`. A key `T` does not have is refused first, with
/// the fix, rather than as serde's bare "unknown field".
fn read<T>(uri: &str, table: Map<String, Value>) -> Result<T, SinkSetupError>
where
    T: DeserializeOwned + Serialize + Default,
{
    // The settings `T` has are the keys of its default, serialized (flattened parts too).
    let known = match serde_json::to_value(T::default()) {
        Ok(Value::Object(known)) => known,
        _ => Map::new(),
    };
    if let Some(key) = table.keys().find(|key| !known.contains_key(*key)) {
        return Err(SinkSetupError::config(format!(
            "`{key}` has no effect on a {} sink ({}), which does not read it: remove it, or check \
             the sink's uri",
            scheme_of(uri),
            redact_url(uri.trim())
        )));
    }
    let entries = Entries {
        entries: table.into_iter(),
        value: None,
    };
    T::deserialize(MapAccessDeserializer::new(entries))
        .map_err(|e| SinkSetupError::config(e.to_string()))
}

/// A table's entries fed to a settings struct, so that a value that does not fit is named by
/// its key (deserializing the table as one JSON value would not say which).
struct Entries {
    entries: serde_json::map::IntoIter,
    value: Option<(String, Value)>,
}

impl<'de> MapAccess<'de> for Entries {
    type Error = serde_json::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Self::Error> {
        let Some((key, value)) = self.entries.next() else {
            return Ok(None);
        };
        let read = seed.deserialize(key.clone().into_deserializer())?;
        self.value = Some((key, value));
        Ok(Some(read))
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, Self::Error> {
        let (key, value) = self
            .value
            .take()
            .ok_or_else(|| serde::de::Error::custom("a value was asked for before its key"))?;
        seed.deserialize(value)
            .map_err(|e| serde::de::Error::custom(format_args!("`{key}`: {e}")))
    }
}

/// A route as written under `[[routes]]`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// A glob over destinations: `orders.*`, `posts:*`, `*`.
    pub destinations: String,
    /// The name of a `[sinks.NAME]` entry.
    pub sink: String,
    /// The target template [default: "{destination}"].
    pub target: Option<String>,
    /// Send the route's events as CloudEvents 1.0: `binary` (attributes in the protocol's
    /// headers, the payload as the body) or `structured` (the JSON event format as the body)
    /// [default: neither, the relay's own message format].
    #[serde(default)]
    pub cloudevents: Option<crate::cloudevents::ContentMode>,
    /// The CloudEvents `source` attribute, a template like `target`
    /// [default: "/outbox/{destination}"]. Only with `cloudevents`.
    #[serde(default)]
    pub cloudevents_source: Option<String>,
}

impl RouteConfig {
    /// The route's CloudEvents setting; `cloudevents_source` without `cloudevents` is refused
    /// (it would have no effect).
    pub fn cloudevents(&self) -> Result<Option<crate::cloudevents::CloudEvents>, String> {
        match (self.cloudevents, &self.cloudevents_source) {
            (None, None) => Ok(None),
            (None, Some(_)) => Err(format!(
                "route {:?}: cloudevents_source has no effect without cloudevents = \"binary\" or \"structured\"",
                self.destinations
            )),
            (Some(mode), source) => Ok(Some(crate::cloudevents::CloudEvents {
                mode,
                source: crate::Template::parse(
                    source
                        .as_deref()
                        .unwrap_or(crate::cloudevents::DEFAULT_SOURCE),
                )
                .map_err(|e| format!("route {:?}: cloudevents_source: {e}", self.destinations))?,
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(table: Value) -> Result<SinkConfig, String> {
        serde_json::from_value(table).map_err(|e| e.to_string())
    }

    #[test]
    fn a_max_message_bytes_of_zero_is_refused() {
        let err = read(json!({"uri": "stdout", "max_message_bytes": 0})).unwrap_err();
        assert!(
            err.contains("`max_message_bytes` = 0 refuses every event"),
            "{err}"
        );
        assert!(read(json!({"uri": "stdout", "max_message_bytes": 1})).is_ok());
    }

    #[test]
    fn cloudevents_settings_are_read_and_a_source_alone_is_refused() {
        let route = |v: Value| serde_json::from_value::<RouteConfig>(v).unwrap();
        let plain = route(json!({"destinations": "*", "sink": "s"}));
        assert_eq!(plain.cloudevents(), Ok(None));
        let binary = route(json!({"destinations": "*", "sink": "s", "cloudevents": "binary"}))
            .cloudevents()
            .unwrap()
            .unwrap();
        assert_eq!(binary.mode, crate::cloudevents::ContentMode::Binary);
        let err = route(json!({"destinations": "o.*", "sink": "s", "cloudevents_source": "/x"}))
            .cloudevents()
            .unwrap_err();
        assert!(err.contains("cloudevents_source has no effect"), "{err}");
        let err = route(json!({"destinations": "*", "sink": "s", "cloudevents": "structured", "cloudevents_source": "/{topic}"}))
            .cloudevents()
            .unwrap_err();
        assert!(
            err.contains("cloudevents_source") && err.contains("{destination}"),
            "{err}"
        );
        let err = serde_json::from_value::<RouteConfig>(
            json!({"destinations": "*", "sink": "s", "cloudevents": "envelope"}),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("binary") && err.contains("structured"),
            "{err}"
        );
    }

    #[test]
    fn a_setting_the_chosen_sink_does_not_read_is_refused_by_name() {
        #[cfg(feature = "nats")]
        {
            let err =
                read(json!({"uri": "nats://u:pw@127.0.0.1:4222", "maxlen": 1000})).unwrap_err();
            assert!(
                err.contains(
                    "`maxlen` has no effect on a nats sink (nats://u:***@127.0.0.1:4222), which \
                     does not read it: remove it, or check the sink's uri"
                ),
                "{err}"
            );
        }
        #[cfg(feature = "rabbitmq")]
        {
            let err = read(json!({"uri": "amqps://h", "tls_ca_file": "/ca.pem"})).unwrap_err();
            assert!(
                err.contains("`tls_ca_file` has no effect on a amqps"),
                "{err}"
            );
        }
        let err = read(json!({"uri": "file:/tmp/x.jsonl", "timeout": "1s"})).unwrap_err();
        assert!(
            err.contains("`timeout` has no effect on a file sink"),
            "{err}"
        );
        let err = read(json!({"uri": "stdout", "maxlenn": 1})).unwrap_err();
        assert!(
            err.contains("`maxlenn` has no effect on a stdout sink"),
            "{err}"
        );
        // What every sink reads is accepted everywhere.
        read(json!({"uri": "stdout", "max_message_bytes": 10})).unwrap();
    }

    #[cfg(all(feature = "redis", feature = "kafka"))]
    #[test]
    fn each_sink_reads_its_own_settings() {
        let redis = read(json!({
            "uri": "redis://h",
            "maxlen": 1000,
            "dedupe_window": "1m",
            "timeout": "2s",
            "tls_ca_file": "/ca.pem",
        }))
        .unwrap();
        let SinkSettings::Redis(settings) = redis.settings() else {
            panic!("a redis:// URI chooses the Redis sink: {redis:?}");
        };
        assert_eq!(settings.maxlen, Some(1000));
        assert_eq!(settings.dedupe_window, std::time::Duration::from_secs(60));
        assert_eq!(settings.timeout.get(), std::time::Duration::from_secs(2));
        assert_eq!(settings.tls.ca_file, Some("/ca.pem".into()));
        let kafka = read(json!({
            "uri": "kafkas://b:9093",
            "sasl_mechanism": "PLAIN",
            "kafka": {"linger.ms": "5"},
        }))
        .unwrap();
        assert!(matches!(kafka.settings(), SinkSettings::Kafka(k) if k.kafka["linger.ms"] == "5"));
    }

    #[cfg(feature = "redis")]
    #[test]
    fn a_value_that_does_not_fit_is_named() {
        let err = read(json!({"uri": "redis://h", "maxlen": "many"})).unwrap_err();
        assert!(err.contains("`maxlen`: invalid type"), "{err}");
        let err = read(json!({"uri": "redis://h", "timeout": "10"})).unwrap_err();
        assert!(err.contains("with a unit"), "{err}");
        let err = read(json!({"uri": 5})).unwrap_err();
        assert!(err.contains("`uri`: invalid type"), "{err}");
        let err = read(json!({"maxlen": 5})).unwrap_err();
        assert!(err.contains("`uri` is missing"), "{err}");
        let err = read(json!({"uri": "gopher://x"})).unwrap_err();
        assert!(err.contains("unknown URI scheme \"gopher\""), "{err}");
    }

    #[test]
    fn a_sink_built_from_its_uri_has_the_defaults_of_one_read_from_a_table() {
        for uri in [
            "stdout",
            "file:/tmp/x.jsonl",
            "nats://h:4222",
            "kafka://h:9092",
            "amqp://h",
            "redis://h",
            "https://h/{destination}",
            "ably:",
        ] {
            assert_eq!(
                read(json!({ "uri": uri })).unwrap(),
                SinkConfig::new(uri),
                "{uri}"
            );
        }
        #[cfg(feature = "redis")]
        {
            let SinkSettings::Redis(redis) = SinkConfig::new("redis://h").settings else {
                panic!("a redis:// URI chooses the Redis sink");
            };
            assert_eq!(redis.dedupe_window, crate::redis::DEFAULT_DEDUPE_WINDOW);
        }
    }

    #[cfg(feature = "redis")]
    #[test]
    fn a_config_written_out_reads_back_the_same() {
        let config = read(json!({
            "uri": "redis://h",
            "max_message_bytes": 100,
            "maxlen": 5,
            "dedupe_window": "1h",
            "timeout": "3s",
        }))
        .unwrap();
        let written = serde_json::to_value(&config).unwrap();
        assert_eq!(read(written).unwrap(), config);
        let stdout = SinkConfig::new("stdout");
        assert_eq!(
            read(serde_json::to_value(&stdout).unwrap()).unwrap(),
            stdout
        );
    }
}
