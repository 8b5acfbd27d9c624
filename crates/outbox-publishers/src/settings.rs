//! The settings several sinks share, flattened into each one's own.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How long a broker has to confirm before the event is retried.
pub const DEFAULT_SINK_TIMEOUT: Duration = Duration::from_secs(10);

/// `timeout`, read by every broker sink (stdout and files confirm by writing).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct ConfirmTimeout {
    /// Time the broker has to confirm one batch [default: 10s].
    #[serde(with = "opt_duration", default)]
    pub timeout: Option<Duration>,
}

impl ConfirmTimeout {
    pub fn get(self) -> Duration {
        self.timeout.unwrap_or(DEFAULT_SINK_TIMEOUT)
    }
}

/// `tls_ca_file`, `tls_cert_file`, `tls_key_file`, read by the sinks whose client takes
/// certificates from files (all brokers but RabbitMQ, which uses the system's roots).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(try_from = "TlsFilesGiven")]
pub struct TlsFiles {
    /// PEM CA certificates to trust, besides the system's roots.
    #[serde(rename = "tls_ca_file")]
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate and key, for brokers that require mutual TLS.
    #[serde(rename = "tls_cert_file")]
    pub cert_file: Option<PathBuf>,
    #[serde(rename = "tls_key_file")]
    pub key_file: Option<PathBuf>,
}

/// [`TlsFiles`] as given, before the client certificate and its key are checked to come
/// together: each sink took the pair only when both were there, and connected without a
/// client certificate when one was missing.
#[derive(Deserialize)]
struct TlsFilesGiven {
    tls_ca_file: Option<PathBuf>,
    tls_cert_file: Option<PathBuf>,
    tls_key_file: Option<PathBuf>,
}

impl TryFrom<TlsFilesGiven> for TlsFiles {
    type Error = String;

    fn try_from(given: TlsFilesGiven) -> Result<Self, String> {
        match (&given.tls_cert_file, &given.tls_key_file) {
            (Some(_), None) => Err(
                "tls_cert_file needs tls_key_file (the certificate's private \
                 key, PEM): give both, or neither"
                    .into(),
            ),
            (None, Some(_)) => Err("tls_key_file needs tls_cert_file (the client certificate, \
                 PEM): give both, or neither"
                .into()),
            _ => Ok(TlsFiles {
                ca_file: given.tls_ca_file,
                cert_file: given.tls_cert_file,
                key_file: given.tls_key_file,
            }),
        }
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
        outbox_core::time::duration_text::parse(&text).map_err(serde::de::Error::custom)
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

    /// A confirmation timeout: at least a millisecond (0 timed every publish out at once,
    /// and librdkafka reads a `message.timeout.ms` of 0 as "never").
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|text| {
                let timeout = outbox_core::time::duration_text::parse(&text)
                    .map_err(serde::de::Error::custom)?;
                if timeout < Duration::from_millis(1) {
                    return Err(serde::de::Error::custom(format!(
                        "timeout {text:?} is under a millisecond: a broker cannot confirm in \
                         that (Kafka would read 0 as never); give e.g. \"10s\""
                    )));
                }
                Ok(timeout)
            })
            .transpose()
    }
}
