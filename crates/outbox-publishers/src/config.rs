//! Sink settings, as written under `[sinks.NAME]` in the configuration file.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A secret value: it deserializes like a string and never shows in `Debug` output.
#[derive(Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(transparent)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("\"***\"")
    }
}

/// What RabbitMQ's unroutable (returned) messages become.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Unroutable {
    /// Retry with backoff (a queue or binding may be added), then dead-letter.
    #[default]
    Retry,
    /// Dead-letter at once.
    DeadLetter,
}

/// Redelivered events within this window are not appended twice to a Redis stream.
pub const DEFAULT_REDIS_DEDUPE_WINDOW: Duration = Duration::from_secs(24 * 3600);
/// Concurrent requests per destination for webhooks.
pub const DEFAULT_WEBHOOK_CONCURRENCY: usize = 16;
/// How long a broker has to confirm before the event is retried.
pub const DEFAULT_SINK_TIMEOUT: Duration = Duration::from_secs(10);

fn default_dedupe_window() -> Duration {
    DEFAULT_REDIS_DEDUPE_WINDOW
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SinkConfig {
    /// `stdout`, `file:PATH`, `nats://`, `kafka://`, `amqp://`/`amqps://`, `redis://`/`rediss://`,
    /// `http://`/`https://` (a URL template), `ably:`.
    pub uri: String,
    /// Payloads larger than this are dead-lettered at once [default: the broker's limit].
    pub max_message_bytes: Option<usize>,
    /// Time the broker has to confirm one batch [default: 10s].
    #[serde(with = "opt_duration")]
    pub timeout: Option<Duration>,
    /// PEM CA certificates to trust (TLS), besides the system's roots.
    pub tls_ca_file: Option<PathBuf>,
    /// PEM client certificate and key, for brokers that require mutual TLS.
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    /// NATS: credentials file (JWT + nkey seed).
    pub creds_file: Option<PathBuf>,
    /// NATS: a file holding an nkey seed.
    pub nkey_seed_file: Option<PathBuf>,
    /// NATS: a token (prefer the URI's user info, or an environment variable).
    pub token: Option<Secret>,
    /// Kafka: SASL mechanism (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512) and credentials.
    pub sasl_mechanism: Option<String>,
    pub sasl_username: Option<String>,
    pub sasl_password: Option<Secret>,
    /// Kafka: extra librdkafka properties.
    pub kafka: std::collections::BTreeMap<String, String>,
    /// RabbitMQ: the exchange, a template [default: "" (the default exchange: the routing
    /// key names the queue)].
    pub exchange: Option<String>,
    /// RabbitMQ: what an unroutable message becomes.
    pub unroutable: Unroutable,
    /// Redis: approximate MAXLEN for each stream.
    pub maxlen: Option<usize>,
    /// Redis: how long an event id is remembered to drop redeliveries [default: 24h].
    #[serde(with = "crate::config::duration", default = "default_dedupe_window")]
    pub dedupe_window: Duration,
    /// Webhooks: concurrent requests per destination [default: 16].
    pub concurrency: Option<usize>,
    /// Webhooks: the signing secret, `whsec_<base64>` (or OUTBOX_RELAY_WEBHOOK_SECRET).
    pub secret: Option<Secret>,
    /// Ably: a file holding the API key (or ABLY_API_KEY / OUTBOX_RELAY_ABLY_API_KEY).
    pub api_key_file: Option<PathBuf>,
    /// Ably: REST endpoint [default: https://rest.ably.io].
    pub rest_url: Option<String>,
}

/// Written out so that a sink built in code (`--sink URI`) gets the same defaults as one read
/// from a file: a derived default would give the Redis dedupe window 0s.
impl Default for SinkConfig {
    fn default() -> Self {
        SinkConfig {
            uri: String::new(),
            max_message_bytes: None,
            timeout: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            creds_file: None,
            nkey_seed_file: None,
            token: None,
            sasl_mechanism: None,
            sasl_username: None,
            sasl_password: None,
            kafka: Default::default(),
            exchange: None,
            unroutable: Unroutable::default(),
            maxlen: None,
            dedupe_window: DEFAULT_REDIS_DEDUPE_WINDOW,
            concurrency: None,
            secret: None,
            api_key_file: None,
            rest_url: None,
        }
    }
}

/// The settings each sink reads, by URI scheme, besides `uri` and `max_message_bytes`
/// (which every sink honours).
const SETTINGS_READ: &[(&[&str], &[&str])] = &[
    (&["stdout", "file"], &[]),
    (
        &["nats", "tls"],
        &[
            "timeout",
            "tls_ca_file",
            "tls_cert_file",
            "tls_key_file",
            "creds_file",
            "nkey_seed_file",
            "token",
        ],
    ),
    (
        &["kafka", "kafkas"],
        &[
            "timeout",
            "tls_ca_file",
            "tls_cert_file",
            "tls_key_file",
            "sasl_mechanism",
            "sasl_username",
            "sasl_password",
            "kafka",
        ],
    ),
    (&["amqp", "amqps"], &["timeout", "exchange", "unroutable"]),
    (
        &["redis", "rediss"],
        &[
            "timeout",
            "tls_ca_file",
            "tls_cert_file",
            "tls_key_file",
            "maxlen",
            "dedupe_window",
        ],
    ),
    (
        &["http", "https"],
        &[
            "timeout",
            "tls_ca_file",
            "tls_cert_file",
            "tls_key_file",
            "concurrency",
            "secret",
        ],
    ),
    (
        &["ably"],
        &[
            "timeout",
            "tls_ca_file",
            "tls_cert_file",
            "tls_key_file",
            "api_key_file",
            "rest_url",
        ],
    ),
];

impl SinkConfig {
    /// The URI's scheme: `nats` for `nats://host`, `file` for `file:PATH`.
    pub fn scheme(&self) -> &str {
        self.uri.trim().split(':').next().unwrap_or_default()
    }

    /// Settings given here that this sink never reads (a Redis `maxlen` on a NATS sink): they
    /// would have no effect, so the relay refuses them. Empty for an unknown scheme, which
    /// building the sink reports.
    pub fn settings_without_effect(&self) -> Vec<&'static str> {
        let scheme = self.scheme();
        let Some((_, read)) = SETTINGS_READ
            .iter()
            .find(|(schemes, _)| schemes.contains(&scheme))
        else {
            return Vec::new();
        };
        self.settings_given()
            .into_iter()
            .filter(|setting| !read.contains(setting))
            .collect()
    }

    /// The sink-specific settings that differ from their defaults.
    fn settings_given(&self) -> Vec<&'static str> {
        let d = SinkConfig::default();
        let given = [
            ("timeout", self.timeout != d.timeout),
            ("tls_ca_file", self.tls_ca_file.is_some()),
            ("tls_cert_file", self.tls_cert_file.is_some()),
            ("tls_key_file", self.tls_key_file.is_some()),
            ("creds_file", self.creds_file.is_some()),
            ("nkey_seed_file", self.nkey_seed_file.is_some()),
            ("token", self.token.is_some()),
            ("sasl_mechanism", self.sasl_mechanism.is_some()),
            ("sasl_username", self.sasl_username.is_some()),
            ("sasl_password", self.sasl_password.is_some()),
            ("kafka", !self.kafka.is_empty()),
            ("exchange", self.exchange.is_some()),
            ("unroutable", self.unroutable != d.unroutable),
            ("maxlen", self.maxlen.is_some()),
            ("dedupe_window", self.dedupe_window != d.dedupe_window),
            ("concurrency", self.concurrency.is_some()),
            ("secret", self.secret.is_some()),
            ("api_key_file", self.api_key_file.is_some()),
            ("rest_url", self.rest_url.is_some()),
        ];
        given
            .into_iter()
            .filter_map(|(name, set)| set.then_some(name))
            .collect()
    }
}

pub mod duration {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_duration(&text).map_err(|e| {
            serde::de::Error::custom(format!(
                "invalid duration {text:?} ({e}); write it with a unit, e.g. 500ms, 2s, 24h"
            ))
        })
    }
}

mod opt_duration {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => super::duration::serialize(d, s),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|text| {
                humantime::parse_duration(&text).map_err(|e| {
                    serde::de::Error::custom(format!(
                        "invalid duration {text:?} ({e}); write it with a unit, e.g. 5s"
                    ))
                })
            })
            .transpose()
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sink(uri: &str) -> SinkConfig {
        SinkConfig {
            uri: uri.into(),
            ..SinkConfig::default()
        }
    }

    #[test]
    fn a_setting_another_sink_reads_is_named() {
        let nats = SinkConfig {
            maxlen: Some(1000),
            ..sink("nats://127.0.0.1:4222")
        };
        assert_eq!(nats.settings_without_effect(), ["maxlen"]);
        let redis = SinkConfig {
            maxlen: Some(1000),
            dedupe_window: Duration::from_secs(60),
            ..sink("redis://127.0.0.1")
        };
        assert!(redis.settings_without_effect().is_empty());
        let file = SinkConfig {
            timeout: Some(Duration::from_secs(1)),
            exchange: Some("x".into()),
            ..sink("file:/tmp/x.jsonl")
        };
        assert_eq!(file.settings_without_effect(), ["timeout", "exchange"]);
        let amqp = SinkConfig {
            tls_ca_file: Some("/ca.pem".into()),
            ..sink("amqps://host")
        };
        assert_eq!(amqp.settings_without_effect(), ["tls_ca_file"]);
        assert!(sink("gopher://x").settings_without_effect().is_empty());
    }

    #[test]
    fn a_sink_built_in_code_keeps_the_redis_dedupe_window() {
        assert_eq!(sink("redis://h").dedupe_window, DEFAULT_REDIS_DEDUPE_WINDOW);
        let read: SinkConfig = serde_json::from_str(r#"{"uri": "redis://h"}"#).unwrap();
        assert_eq!(read, sink("redis://h"));
    }
}
