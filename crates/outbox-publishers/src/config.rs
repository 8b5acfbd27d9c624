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

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
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
