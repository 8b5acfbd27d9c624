//! HTTP webhooks, signed the Standard Webhooks way: `webhook-id` = event id,
//! `webhook-timestamp`, and `webhook-signature` = `v1,` + base64(HMAC-SHA256(secret,
//! "{id}.{timestamp}.{body}")). Requests run concurrently, capped per destination.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use futures::future::{join_all, BoxFuture};
use futures::FutureExt;
use hmac::{Hmac, Mac};
use outbox_core::{Outcome, PublishError, PublishErrorKind};
use sha2::Sha256;
use tokio::sync::Semaphore;

use serde::{Deserialize, Serialize};

use crate::cloudevents::{Binding, ContentMode};
use crate::error::SinkSetupError;
use crate::settings::{ConfirmTimeout, TlsFiles};
use crate::sink::{Routed, Sink};
use crate::template::Template;
use outbox_core::redact::Secret;

/// The environment variable that holds the signing secret when the config file does not.
pub const SECRET_ENV: &str = "OUTBOX_RELAY_WEBHOOK_SECRET";

/// Concurrent requests per destination.
pub const DEFAULT_CONCURRENCY: usize = 16;

/// A webhook sink's own settings (`[sinks.NAME]` with an `http://` or `https://` URL template).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct WebhookConfig {
    #[serde(flatten)]
    pub timeout: ConfirmTimeout,
    #[serde(flatten)]
    pub tls: TlsFiles,
    /// Concurrent requests per destination [default: 16].
    pub concurrency: Option<usize>,
    /// The signing secret, `whsec_<base64>` (or OUTBOX_RELAY_WEBHOOK_SECRET).
    pub secret: Option<Secret>,
}

pub struct WebhookSink {
    client: reqwest::Client,
    url: Arc<Template>,
    /// What the health check asks, when no placeholder stands in the URL's scheme, host or
    /// port ([`health_url`]).
    health_url: Option<reqwest::Url>,
    shown: String,
    key: Option<Arc<Vec<u8>>>,
    /// The URL's password and the signing secret, scrubbed from what receivers answer.
    secrets: Arc<crate::http::KnownSecrets>,
    per_destination: usize,
    /// The sink's timeout, for one request: requests wait at most half of it to start.
    timeout: Duration,
    limits: Arc<Mutex<DestinationLimits>>,
}

/// Each destination's requests at a time. A destination's entry stays while a request of
/// it holds or awaits its semaphore; the rest are swept once the map has doubled since the
/// last sweep: one entry per destination ever seen (a tenant's, a user's) grew for the
/// life of the process.
#[derive(Default)]
struct DestinationLimits {
    by_destination: HashMap<String, Arc<Semaphore>>,
    sweep_at: usize,
}

impl DestinationLimits {
    /// The fewest entries at which a sweep is worth its walk.
    const SWEEP_FLOOR: usize = 1024;

    fn get(&mut self, destination: &str, per_destination: usize) -> Arc<Semaphore> {
        if self.by_destination.len() >= self.sweep_at.max(Self::SWEEP_FLOOR) {
            // Only the map holds it: no request of that destination is in flight.
            self.by_destination
                .retain(|_, limit| Arc::strong_count(limit) > 1);
            self.sweep_at = 2 * self.by_destination.len();
        }
        self.by_destination
            .entry(destination.to_string())
            .or_insert_with(|| Arc::new(Semaphore::new(per_destination)))
            .clone()
    }
}

/// Decodes a `whsec_<base64>` secret into the HMAC key.
pub fn decode_secret(secret: &str) -> Result<Vec<u8>, String> {
    let encoded = secret
        .strip_prefix("whsec_")
        .ok_or("the webhook secret must look like whsec_<base64> (Standard Webhooks)")?;
    base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .map_err(|_| "the webhook secret's part after whsec_ is not valid base64".to_string())
}

/// The `webhook-signature` header value for one request.
pub fn sign(key: &[u8], id: &str, timestamp: u64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes keys of any length");
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
    )
}

/// The scheme, host and port of a URL template that writes them out (`https://host:8443`
/// of `https://host:8443/hooks/{destination}`); `None` when a placeholder stands in them.
fn origin(url: &Template) -> Option<&str> {
    let text = url.leading_text();
    let rest = text.split_once("://")?.1;
    let end = match rest.find(['/', '?', '#']) {
        Some(end) => end,
        None if url.literal().is_some() => rest.len(),
        None => return None,
    };
    Some(&text[..text.len() - rest.len() + end])
}

/// What a URL template's health check asks: its written-out text up to the first
/// placeholder, without a query or fragment (`https://h/hooks/` of
/// `https://h/hooks/{destination}?k=v`), so that a gateway that routes by path asks the
/// receiver's backend, not whatever serves `/`; `None` where [`origin`] is.
fn health_url(url: &Template) -> Option<&str> {
    let origin = origin(url)?;
    let text = url.leading_text();
    let end = text[origin.len()..]
        .find(['?', '#'])
        .map_or(text.len(), |at| origin.len() + at);
    Some(&text[..end])
}

fn url_escape(value: &str) -> String {
    percent_encoding::utf8_percent_encode(value, percent_encoding::NON_ALPHANUMERIC).to_string()
}

impl WebhookSink {
    pub fn new(uri: &str, config: &WebhookConfig) -> Result<Self, SinkSetupError> {
        let url = Template::parse(uri).map_err(SinkSetupError::config)?;
        if config.concurrency == Some(0) {
            return Err(SinkSetupError::config(
                "`concurrency` = 0 would never send a request: use 1 or more (default 16)",
            ));
        }
        let shown = outbox_core::redact::redact_url(uri);
        // A host or port no URL can have fails every event alike: refused now.
        let origin = origin(&url)
            .map(|origin| {
                reqwest::Url::parse(origin).map_err(|e| {
                    SinkSetupError::config(format!(
                        "the webhook URL {shown} is no URL ({e}): write it as \
                         http(s)://HOST[:PORT]/PATH, with placeholders after the host"
                    ))
                })
            })
            .transpose()?;
        let health_url = match (origin, health_url(&url)) {
            (Some(origin), Some(path)) => Some(reqwest::Url::parse(path).unwrap_or(origin)),
            _ => None,
        };
        let secret = match &config.secret {
            Some(s) => Some(s.expose().to_string()),
            None => std::env::var(SECRET_ENV).ok().filter(|s| !s.is_empty()),
        };
        let mut known = crate::http::KnownSecrets::of_user_info(uri);
        known.extend(secret.clone());
        let secrets = Arc::new(crate::http::KnownSecrets::new(known));
        let key = secret
            .map(|s| decode_secret(&s).map(Arc::new))
            .transpose()
            .map_err(SinkSetupError::config)?;
        let tls_given = config.tls.ca_file.is_some() || config.tls.cert_file.is_some();
        if tls_given && uri.trim().to_ascii_lowercase().starts_with("http://") {
            return Err(SinkSetupError::config(format!(
                "tls_ca_file and tls_cert_file have no effect on {shown}, a plain http:// URL: \
                 use https://, or remove them"
            )));
        }
        Ok(WebhookSink {
            client: crate::http::client(&config.tls, config.timeout.get())?,
            url: Arc::new(url),
            health_url,
            shown,
            key,
            secrets,
            per_destination: config.concurrency.unwrap_or(DEFAULT_CONCURRENCY),
            timeout: config.timeout.get(),
            limits: Arc::default(),
        })
    }

    fn limit_for(&self, destination: &str) -> Arc<Semaphore> {
        let mut limits = self.limits.lock().unwrap_or_else(|p| p.into_inner());
        limits.get(destination, self.per_destination)
    }
}

impl Sink for WebhookSink {
    fn messaging_system(&self) -> Option<&'static str> {
        Some("webhook")
    }

    fn cloudevents_binding(&self) -> Option<Binding> {
        Some(Binding::Http)
    }

    fn describe(&self) -> String {
        self.shown.clone()
    }

    /// Each destination has its receiver and its own limit of requests at a time.
    fn sends_by_destination(&self) -> bool {
        true
    }

    fn send(&self, batch: Vec<Routed>) -> BoxFuture<'static, Vec<Outcome>> {
        let queued_until = crate::sink::turn_deadline(self.timeout);
        let (per_destination, shown) = (self.per_destination, self.shown.clone());
        let requests: Vec<_> = batch
            .into_iter()
            .map(|routed| {
                let client = self.client.clone();
                let url = self.url.render_with(&routed.event, url_escape);
                let key = self.key.clone();
                let secrets = self.secrets.clone();
                let limit = self.limit_for(&routed.event.destination);
                let shown = shown.clone();
                async move {
                    // A thousand requests queued behind `concurrency` slow ones outlived
                    // the engine's publish timeout.
                    let held = || {
                        format!(
                            "its destination's {per_destination} requests at a time were all busy"
                        )
                    };
                    let _permit =
                        crate::sink::in_turn(queued_until, limit.acquire_owned(), &shown, held)
                            .await?
                            .expect("semaphore is never closed");
                    // A CloudEvent is the payload itself (binary mode) or its envelope
                    // (structured, already the payload); otherwise the relay's JSON line.
                    let body = match routed.cloudevents {
                        Some(_) => routed.event.payload.as_bytes().to_vec(),
                        None => {
                            let mut body = Vec::with_capacity(256);
                            crate::json_lines::encode_line(&routed.event, &mut body)?;
                            body.pop(); // the trailing newline
                            body
                        }
                    };
                    let id = routed.event.event_id.hyphenated().to_string();
                    let timestamp = SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .unwrap_or(Duration::ZERO)
                        .as_secs();
                    let content_type = match routed.cloudevents {
                        Some(_) => routed
                            .event
                            .headers
                            .get(crate::cloudevents::CONTENT_TYPE_HEADER)
                            .map_or("application/json", String::as_str),
                        None => "application/json",
                    };
                    let mut request = client
                        .post(&url)
                        .header("content-type", content_type)
                        .header("webhook-id", &id)
                        .header("webhook-timestamp", timestamp.to_string());
                    if routed.cloudevents == Some(ContentMode::Binary) {
                        for name in crate::cloudevents::attribute_headers(Binding::Http) {
                            if let Some(value) = routed.event.headers.get(&name) {
                                request = request.header(name, value);
                            }
                        }
                    }
                    for (name, value) in crate::trace::trace_fields(&routed.event) {
                        request = request.header(name, value);
                    }
                    if let Some(key) = &key {
                        request =
                            request.header("webhook-signature", sign(key, &id, timestamp, &body));
                    }
                    let what = format!("webhook {}", outbox_core::redact::redact_url(&url));
                    let response = request
                        .body(body)
                        .send()
                        .await
                        .map_err(|e| crate::http::transport_error(e, &what))?;
                    crate::http::response_outcome(response, &what, &secrets, |_| None).await
                }
            })
            .collect();
        async move { join_all(requests).await }.boxed()
    }

    fn health(&self) -> BoxFuture<'static, Result<(), PublishError>> {
        // A webhook endpoint has no standard health check: a HEAD request to its URL, as
        // far as it is written out, shows that the server answers (any status will do, but
        // a gateway's 502-504: a load balancer with no receiver behind it answers them),
        // over TLS as configured. A host given by a placeholder is known per event only;
        // failures surface there.
        let Some(url) = self.health_url.clone() else {
            return async { Ok(()) }.boxed();
        };
        let what = format!(
            "webhook server {} (check the host and port of the sink's URL, and that the \
             receiver is running)",
            outbox_core::redact::redact_url(url.as_str())
        );
        let request = self.client.head(url);
        async move {
            let response = request
                .send()
                .await
                .map_err(|e| crate::http::transport_error(e, &what))?;
            match response.status().as_u16() {
                status @ 502..=504 => Err(PublishError::new(
                    PublishErrorKind::Unavailable,
                    format!("{what} answered {status}: no receiver is serving behind it"),
                )),
                _ => Ok(()),
            }
        }
        .boxed()
    }
}

/// Refuses [`SECRET_ENV`] as the secret of more than one of the webhook sinks (by name): each receiver holds
/// the key it verifies with, so with one key for all, any of them could sign messages that
/// another receiver would take as the relay's.
pub fn refuse_a_shared_secret<'a>(
    webhooks: impl IntoIterator<Item = (&'a str, &'a WebhookConfig)>,
) -> Result<(), SinkSetupError> {
    if std::env::var(SECRET_ENV).map_or(true, |s| s.is_empty()) {
        return Ok(());
    }
    let sharing: Vec<&str> = webhooks
        .into_iter()
        .filter(|(_, w)| w.secret.is_none())
        .map(|(name, _)| name)
        .collect();
    if sharing.len() < 2 {
        return Ok(());
    }
    Err(SinkSetupError::config(format!(
        "{SECRET_ENV} would sign for every webhook sink without a secret of its own ({}): each \
         receiver could then sign messages the others take as the relay's; give each \
         [sinks.NAME] its own secret = \"whsec_...\"",
        sharing.join(", ")
    )))
}

pub fn sink(uri: &str, config: &WebhookConfig) -> Result<Arc<dyn Sink>, SinkSetupError> {
    Ok(Arc::new(WebhookSink::new(uri, config)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations_without_a_request_in_flight_are_swept_and_busy_ones_kept() {
        let mut limits = DestinationLimits::default();
        let busy = limits.get("busy", 2);
        let _permit = busy.clone().try_acquire_owned().unwrap();
        for i in 0..100_000 {
            drop(limits.get(&format!("tenant-{i}"), 2));
        }
        assert!(
            limits.by_destination.len() <= 2 * DestinationLimits::SWEEP_FLOOR,
            "{} entries kept",
            limits.by_destination.len()
        );
        let again = limits.get("busy", 2);
        assert!(
            Arc::ptr_eq(&busy, &again),
            "the busy destination keeps its limit"
        );
        assert_eq!(again.available_permits(), 1);
    }

    #[test]
    fn signature_matches_the_standard_webhooks_reference_vector() {
        // From the Standard Webhooks specification's test vectors.
        let key = decode_secret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = br#"{"test": 2432232314}"#;
        assert_eq!(
            sign(&key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
        assert!(decode_secret("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").is_err());
    }

    #[test]
    fn the_origin_is_the_written_out_scheme_host_and_port() {
        let origin = |url: &str| origin(&Template::parse(url).unwrap()).map(str::to_string);
        for (url, expected) in [
            ("https://h:8443/hooks/{destination}", Some("https://h:8443")),
            ("http://h?to={destination}", Some("http://h")),
            ("http://h", Some("http://h")),
            ("http://{destination}.example.com/", None),
            ("http://h:{destination}/", None),
        ] {
            assert_eq!(origin(url).as_deref(), expected, "{url}");
        }
        let health_url = |url: &str| health_url(&Template::parse(url).unwrap()).map(str::to_string);
        for (url, expected) in [
            (
                "https://h:8443/hooks/{destination}",
                Some("https://h:8443/hooks/"),
            ),
            ("https://h/hook-{destination}/x", Some("https://h/hook-")),
            ("http://h/in?to={destination}", Some("http://h/in")),
            ("http://h/in#{destination}", Some("http://h/in")),
            ("http://h", Some("http://h")),
            ("http://h/events", Some("http://h/events")),
            ("http://{destination}.example.com/", None),
        ] {
            assert_eq!(health_url(url).as_deref(), expected, "{url}");
        }
        let refused = WebhookSink::new("http://h:99999/{destination}", &WebhookConfig::default());
        assert!(refused.err().unwrap().to_string().contains("is no URL"));
    }

    /// `concurrency = 0` was taken as 1 (`max(1)`); the AWS sinks refuse it, and so does this.
    #[test]
    fn concurrency_0_is_refused_not_taken_for_1() {
        let config = WebhookConfig {
            concurrency: Some(0),
            ..WebhookConfig::default()
        };
        let refused = WebhookSink::new("http://h/{destination}", &config);
        let text = refused.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("`concurrency` = 0"), "{text}");
    }
}
