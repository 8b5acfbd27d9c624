//! Ably, through its REST API: channel = destination (or the route's target), name = event
//! type, data = payload, extras.headers = the event's headers plus the Models SDK's
//! `x-ably-models-event-uuid` (mutation id) and `x-ably-models-reject`.
//!
//! Idempotency: every message carries the client-supplied id `<event_id>:0`, so a retried
//! publish of the same event is dropped by Ably. Ably requires the messages of one request
//! to share one base id, so each event goes in its own request; the requests run
//! concurrently on pooled connections.

use std::path::PathBuf;
use std::sync::Arc;

use base64::Engine;
use futures::future::{join_all, BoxFuture};
use futures::FutureExt;
use outbox_core::{Event, Outcome, Payload, PublishError, PublishErrorKind};
use serde_json::{json, Map, Value};

use serde::{Deserialize, Serialize};

use crate::error::SinkSetupError;
use crate::settings::{ConfirmTimeout, TlsFiles};
use crate::sink::{Routed, Sink};

pub const DEFAULT_REST_URL: &str = "https://rest.ably.io";
/// Ably's default maximum message size (64 KiB); larger accounts set `max_message_bytes`.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 65_536;
pub const MUTATION_HEADER: &str = "x-ably-models-event-uuid";
pub const REJECT_HEADER: &str = "x-ably-models-reject";

/// An Ably sink's own settings (`[sinks.NAME]` with the URI `ably:`).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AblyConfig {
    #[serde(flatten)]
    pub timeout: ConfirmTimeout,
    #[serde(flatten)]
    pub tls: TlsFiles,
    /// A file holding the API key (or ABLY_API_KEY / OUTBOX_RELAY_ABLY_API_KEY).
    pub api_key_file: Option<PathBuf>,
    /// REST endpoint [default: `https://rest.ably.io`].
    pub rest_url: Option<String>,
}

pub struct AblySink {
    client: reqwest::Client,
    rest_url: String,
    authorization: Arc<String>,
    /// The API key, scrubbed from what Ably answers.
    secrets: Arc<crate::http::KnownSecrets>,
}

/// The relay's own variable for the API key (after ABLY_API_KEY).
pub const OURS_ENV: &str = "OUTBOX_RELAY_ABLY_API_KEY";

/// The API key: from `api_key_file`, else ABLY_API_KEY, else OUTBOX_RELAY_ABLY_API_KEY, else
/// the Ably connector's ADBC_ABLY_API_KEY.
fn api_key(uri: &str, config: &AblyConfig) -> Result<String, SinkSetupError> {
    if uri.trim() != "ably:" {
        return Err(SinkSetupError::config(
            "the Ably sink URI is just `ably:`; give the API key through api_key_file or ABLY_API_KEY, never in the URI",
        ));
    }
    let key = match &config.api_key_file {
        Some(path) => std::fs::read_to_string(path).map_err(|e| {
            SinkSetupError::config(format!(
                "cannot read the Ably API key file {}: {e}",
                path.display()
            ))
        })?,
        None => std::env::var("ABLY_API_KEY")
            .or_else(|_| std::env::var(OURS_ENV))
            .or_else(|_| std::env::var("ADBC_ABLY_API_KEY"))
            .map_err(|_| {
                SinkSetupError::config("no Ably API key: set ABLY_API_KEY or api_key_file")
            })?,
    };
    let key = key.trim().to_string();
    if !key.contains(':') {
        return Err(SinkSetupError::config(
            "the Ably API key must look like <app>.<key id>:<secret>",
        ));
    }
    Ok(key)
}

/// The REST message for one event.
pub fn message(event: &Event) -> Value {
    let mut headers: Map<String, Value> = event
        .headers
        .iter()
        .map(|(k, v)| (k.clone(), Value::String(v.clone())))
        .collect();
    if let Some(mutation) = &event.mutation_id {
        headers.insert(MUTATION_HEADER.into(), Value::String(mutation.clone()));
    }
    headers.insert(
        REJECT_HEADER.into(),
        Value::String(event.rejected.to_string()),
    );
    let mut message = json!({
        "id": format!("{}:0", event.event_id.hyphenated()),
        "name": event.event_type,
        "extras": { "headers": headers },
    });
    // As Ably's SDKs do: strings go as they are, other JSON as text with encoding "json",
    // bytes that are not UTF-8 as base64.
    match &event.payload {
        Payload::Null => {}
        Payload::Json(raw) => match serde_json::from_str::<Value>(raw.get()) {
            Ok(Value::String(s)) => message["data"] = Value::String(s),
            _ => {
                message["data"] = Value::String(raw.get().to_string());
                message["encoding"] = Value::String("json".into());
            }
        },
        Payload::Bytes(bytes) => match std::str::from_utf8(bytes) {
            Ok(text) => message["data"] = Value::String(text.to_string()),
            Err(_) => {
                message["data"] =
                    Value::String(base64::engine::general_purpose::STANDARD.encode(bytes));
                message["encoding"] = Value::String("base64".into());
            }
        },
    }
    message
}

impl AblySink {
    pub fn new(uri: &str, config: &AblyConfig) -> Result<Self, SinkSetupError> {
        let key = api_key(uri, config)?;
        let secret = key.split_once(':').map(|(_, secret)| secret.to_string());
        let secrets = Arc::new(crate::http::KnownSecrets::new(
            [Some(key.clone()), secret].into_iter().flatten(),
        ));
        let authorization = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(key)
        );
        Ok(AblySink {
            client: crate::http::client(&config.tls, config.timeout.get())?,
            rest_url: config
                .rest_url
                .clone()
                .unwrap_or_else(|| DEFAULT_REST_URL.into())
                .trim_end_matches('/')
                .to_string(),
            authorization: Arc::new(authorization),
            secrets,
        })
    }
}

impl Sink for AblySink {
    fn messaging_system(&self) -> Option<&'static str> {
        Some("ably")
    }

    fn describe(&self) -> String {
        format!("ably {}", self.rest_url)
    }

    fn send(&self, batch: Vec<Routed>) -> BoxFuture<'static, Vec<Outcome>> {
        let requests: Vec<_> = batch
            .into_iter()
            .map(|routed| {
                let channel = percent_encoding::utf8_percent_encode(
                    &routed.target,
                    percent_encoding::NON_ALPHANUMERIC,
                )
                .to_string();
                let url = format!("{}/channels/{channel}/messages", self.rest_url);
                let request = self
                    .client
                    .post(url)
                    .header("authorization", self.authorization.as_str())
                    .header("content-type", "application/json")
                    .header("x-ably-version", "2")
                    .body(message(&routed.event).to_string());
                let what = format!("Ably channel {:?}", routed.target);
                let secrets = self.secrets.clone();
                async move {
                    let response = request
                        .send()
                        .await
                        .map_err(|e| crate::http::transport_error(e, &what))?;
                    // Ably's error code 40009 means "message too large", whatever the status.
                    crate::http::response_outcome(response, &what, &secrets, |body| {
                        let code = serde_json::from_str::<Value>(body)
                            .ok()
                            .and_then(|v| v["error"]["code"].as_u64());
                        (code == Some(40009)).then(|| {
                            PublishError::new(
                                PublishErrorKind::TooLarge,
                                format!("{what}: message too large"),
                            )
                        })
                    })
                    .await
                }
            })
            .collect();
        async move { join_all(requests).await }.boxed()
    }

    fn health(&self) -> BoxFuture<'static, Result<(), PublishError>> {
        let request = self.client.get(format!("{}/time", self.rest_url));
        let what = self.describe();
        async move {
            let response = request
                .send()
                .await
                .map_err(|e| crate::http::transport_error(e, &what))?;
            crate::http::outcome(response.status(), None, None, "", &what)
        }
        .boxed()
    }

    fn max_message_bytes(&self) -> Option<usize> {
        Some(DEFAULT_MAX_MESSAGE_BYTES)
    }
}

pub fn sink(uri: &str, config: &AblyConfig) -> Result<Arc<dyn Sink>, SinkSetupError> {
    Ok(Arc::new(AblySink::new(uri, config)?))
}
