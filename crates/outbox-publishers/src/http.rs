//! What the HTTP sinks (webhooks, Ably) share: the client and the status → outcome rule.

use std::time::Duration;

use outbox_core::{PublishError, PublishErrorKind};

use crate::error::SinkSetupError;
use crate::settings::TlsFiles;

/// Builds a client with the sink's TLS files (rustls, the process-wide provider).
pub fn client(tls: &TlsFiles, timeout: Duration) -> Result<reqwest::Client, SinkSetupError> {
    let setup = SinkSetupError::config;
    let mut builder = reqwest::Client::builder()
        .timeout(timeout)
        .connect_timeout(Duration::from_secs(5))
        .pool_max_idle_per_host(64)
        // A receiver must not send the relay (and a signed body) anywhere else: a redirect is
        // an answer like any other ([`outcome`]).
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("outbox-relay/", env!("CARGO_PKG_VERSION")));
    if let Some(path) = &tls.ca_file {
        let pem = std::fs::read(path)
            .map_err(|e| setup(format!("cannot read {}: {e}", path.display())))?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem)
            .map_err(|e| setup(format!("invalid CA file {}: {e}", path.display())))?;
        // A file without one would leave the system's roots alone to verify the receiver.
        if certs.is_empty() {
            return Err(setup(format!(
                "CA file {} holds no PEM certificate (-----BEGIN CERTIFICATE-----): point \
                 tls_ca_file at the CA's certificate in PEM",
                path.display()
            )));
        }
        for cert in certs {
            builder = builder.add_root_certificate(cert);
        }
    }
    if let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) {
        let mut pem = std::fs::read(cert)
            .map_err(|e| setup(format!("cannot read {}: {e}", cert.display())))?;
        pem.extend(
            std::fs::read(key).map_err(|e| setup(format!("cannot read {}: {e}", key.display())))?,
        );
        let identity = reqwest::Identity::from_pem(&pem).map_err(|e| {
            setup(format!(
                "invalid client certificate {} or key {}: {} (both PEM: the certificate \
                 chain, and its PKCS#8, PKCS#1 or SEC1 private key)",
                cert.display(),
                key.display(),
                outbox_core::error::report(&e)
            ))
        })?;
        builder = builder.identity(identity);
    }
    builder.build().map_err(|e| {
        setup(format!(
            "HTTP client setup failed: {}",
            outbox_core::error::report(&e)
        ))
    })
}

/// The most of a receiver's body kept in an error (and so in `last_error`, which the API
/// serves): enough to say why, too little to carry another service's page.
pub const BODY_EXCERPT_CHARS: usize = 200;

/// The one place an HTTP response status becomes an outcome: 2xx delivered; 408, 429
/// (honouring Retry-After), 5xx retryable; 413 too large; 401/403 unauthorised; a redirect
/// (followed never) and an endpoint that is not there (404, 405, 407, 410, 421) retried, as
/// the receiver's condition; other 4xx permanent. `location` is a redirect's target: only
/// its host is named.
pub fn outcome(
    status: reqwest::StatusCode,
    retry_after: Option<&str>,
    location: Option<&str>,
    body: &str,
    what: &str,
) -> Result<(), PublishError> {
    if status.is_success() {
        return Ok(());
    }
    let code = status.as_u16();
    if status.is_redirection() {
        let host = location
            .and_then(|l| reqwest::Url::parse(l).ok())
            .and_then(|u| u.host_str().map(str::to_string))
            .unwrap_or_else(|| "its own host".into());
        // Retried: the receiver's condition (maintenance, an http -> https move), not the
        // event's; dead-lettering emptied the outbox while it lasted.
        return Err(PublishError::new(
            PublishErrorKind::Unavailable,
            format!(
                "{what} answered {status}, a redirect to {host}: the relay follows no \
                 redirects; set the sink's URL to where the receiver is"
            ),
        ));
    }
    let mut detail: String = body.chars().take(BODY_EXCERPT_CHARS).collect();
    if body.chars().nth(BODY_EXCERPT_CHARS).is_some() {
        detail.push('…');
    }
    let mut message = format!("{what} answered {status}: {detail}");
    // No such endpoint, or not one for this request: a wrong path, a receiver not deployed
    // yet, an ingress's default backend, a proxy asking for credentials. It is the same for
    // every event, and dead-lettering emptied the outbox while it lasted.
    if matches!(code, 404 | 405 | 407 | 410 | 421) {
        message.push_str(" (retried: check the sink's URL and that the receiver is deployed)");
        return Err(PublishError::new(PublishErrorKind::Unavailable, message));
    }
    let kind = match code {
        408 => PublishErrorKind::Timeout,
        429 => PublishErrorKind::Throttled,
        413 => PublishErrorKind::TooLarge,
        401 | 403 => PublishErrorKind::Unauthorized,
        // A gateway with no receiver behind it, or one that says it is away: the
        // destination's condition, which spends no attempt while it lasts. A 500 may be
        // this event's own doing, and counts.
        502..=504 => PublishErrorKind::Unavailable,
        500..=599 => PublishErrorKind::BrokerFailure,
        _ => PublishErrorKind::Rejected,
    };
    let mut error = PublishError::new(kind, message);
    if let Some(delay) = retry_after.and_then(parse_retry_after) {
        error = error.with_retry_after(delay);
    }
    Err(error)
}

/// The secret values a sink sends (a URL's password, the Basic credential made of it, a
/// signing secret, an API key), to scrub from what a receiver answers: one that echoed the
/// request's password in an error put it in `last_error`, the log and the API, where
/// [`outbox_core::redact::redact_url`] cannot know it for one.
#[derive(Clone, Debug, Default)]
pub struct KnownSecrets(Vec<String>);

impl KnownSecrets {
    /// The shortest value scrubbed: a shorter one would hide common words.
    const SHORTEST: usize = 4;

    /// `values`, and each one's base64 (padded or not), longest first.
    pub fn new(values: impl IntoIterator<Item = String>) -> Self {
        use base64::Engine;
        let mut all = Vec::new();
        for value in values.into_iter().filter(|v| v.len() >= Self::SHORTEST) {
            let encoded = base64::engine::general_purpose::STANDARD.encode(&value);
            all.push(encoded.trim_end_matches('=').to_string());
            all.push(encoded);
            all.push(value);
        }
        all.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        all.dedup();
        KnownSecrets(all)
    }

    /// The secrets of a URL's user info: its password as written and percent-decoded, and
    /// `user:password` as HTTP Basic sends it (decoded), whose base64 [`new`](Self::new)
    /// adds.
    pub fn of_user_info(url: &str) -> Vec<String> {
        let Some((_, after_scheme)) = url.split_once("://") else {
            return Vec::new();
        };
        let Some(at) = outbox_core::redact::user_info_end(after_scheme) else {
            return Vec::new();
        };
        let decoded = outbox_core::redact::url_decoded;
        match after_scheme[..at].split_once(':') {
            Some((user, password)) => vec![
                password.to_string(),
                decoded(password),
                format!("{}:{}", decoded(user), decoded(password)),
            ],
            // A user alone is sent as `user:` (whose base64 does not hold the user's).
            None => vec![
                after_scheme[..at].to_string(),
                decoded(&after_scheme[..at]),
                format!("{}:", decoded(&after_scheme[..at])),
            ],
        }
    }

    /// `text` with every known secret replaced by `***`.
    pub fn scrub(&self, text: &str) -> String {
        let mut text = text.to_string();
        for secret in &self.0 {
            if text.contains(secret.as_str()) {
                text = text.replace(secret.as_str(), "***");
            }
        }
        text
    }
}

/// Turns a response into an outcome; `special` may claim a failure first from the body,
/// which is quoted with the sink's `secrets` scrubbed.
pub async fn response_outcome(
    response: reqwest::Response,
    what: &str,
    secrets: &KnownSecrets,
    special: impl Fn(&str) -> Option<PublishError>,
) -> Result<(), PublishError> {
    let status = response.status();
    if status.is_success() {
        return Ok(());
    }
    let retry_after = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let location = response
        .headers()
        .get("location")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = secrets.scrub(&bounded_text(response, ERROR_BODY_LIMIT).await);
    if let Some(error) = special(&body) {
        return Err(error);
    }
    outcome(
        status,
        retry_after.as_deref(),
        location.as_deref(),
        &body,
        what,
    )
}

/// Retry-After in seconds or as an HTTP date.
pub fn parse_retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate_to_system_time(value)?;
    Some(
        at.duration_since(std::time::SystemTime::now())
            .unwrap_or_default(),
    )
}

fn httpdate_to_system_time(value: &str) -> Option<std::time::SystemTime> {
    // "Sun, 06 Nov 1994 08:49:37 GMT" is RFC 1123, a profile of RFC 2822; humantime reads
    // RFC 3339 only, so rebuild it in that form.
    let parts: Vec<&str> = value.split_whitespace().collect();
    if parts.len() != 6 || parts[5] != "GMT" {
        return None;
    }
    let month = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ]
    .iter()
    .position(|m| *m == parts[2])?
        + 1;
    let text = format!("{}-{:02}-{:0>2}T{}Z", parts[3], month, parts[1], parts[4]);
    humantime::parse_rfc3339(&text).ok()
}

/// The transport failed (no status): retryable.
pub fn transport_error(error: reqwest::Error, what: &str) -> PublishError {
    let (kind, failed) = if error.is_timeout() {
        (PublishErrorKind::Timeout, "request failed")
    } else if error.is_builder() {
        // The event's own: a header value it carries that HTTP cannot (a control
        // character in `tracestate`), a URL its values made invalid. Never sent.
        (PublishErrorKind::Encoding, "the request cannot be made")
    } else {
        (PublishErrorKind::Unavailable, "request failed")
    };
    // reqwest's text names the whole URL, query-string tokens included; `what` names it
    // redacted.
    PublishError::new(kind, format!("{what}: {failed}")).with_source(error.without_url())
}

/// How much of a refusal's body is read: only its start is quoted in the error.
pub(crate) const ERROR_BODY_LIMIT: usize = 64 * 1024;

/// At most `limit` bytes of a response's body, as (lossy) text. A receiver or proxy that
/// refused with an endless body held the publish, and the body in memory, until the
/// request timed out.
pub(crate) async fn bounded_text(mut response: reqwest::Response, limit: usize) -> String {
    let mut body = Vec::new();
    while body.len() < limit {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                let take = chunk.len().min(limit - body.len());
                body.extend_from_slice(&chunk[..take]);
            }
            _ => break,
        }
    }
    String::from_utf8_lossy(&body).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::Disposition;
    use reqwest::StatusCode;

    /// A CA file holding no certificate (a key, a DER file, a wrong path's text) was taken as
    /// none, leaving the system's roots alone to verify the receiver: refused at setup.
    #[test]
    fn a_ca_file_without_a_certificate_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ca.pem");
        std::fs::write(&path, "not a certificate\n").unwrap();
        let tls = TlsFiles {
            ca_file: Some(path),
            ..TlsFiles::default()
        };
        let err = client(&tls, Duration::from_secs(1)).expect_err("refused");
        let text = err.to_string();
        assert!(
            text.contains("ca.pem") && text.contains("no PEM certificate"),
            "{text}"
        );
    }

    /// A request reqwest cannot build (here a header value with a line break, as an
    /// event's `tracestate` could carry) was retried as an unreachable receiver.
    #[test]
    fn a_request_that_cannot_be_built_is_the_events_permanent_error() {
        outbox_testkit::install_crypto();
        let built = client(&TlsFiles::default(), Duration::from_secs(1))
            .unwrap()
            .post("http://127.0.0.1:9/")
            .header("tracestate", "a=b\nc")
            .build()
            .unwrap_err();
        let e = transport_error(built, "webhook");
        assert_eq!(e.disposition(), Disposition::Permanent, "{e}");
    }

    #[test]
    fn statuses_map_to_the_documented_outcomes() {
        assert!(outcome(StatusCode::NO_CONTENT, None, None, "", "x").is_ok());
        for (code, retry) in [
            (408, true),
            (429, true),
            (500, true),
            (503, true),
            (400, false),
            (409, false),
            (415, false),
            (422, false),
            (413, false),
            (404, true),
            (405, true),
            (407, true),
            (410, true),
            (421, true),
            (401, true),
            (403, true),
            // A redirect is the receiver's condition (maintenance, an http -> https move),
            // not the event's: it dead-lettered every event while it lasted.
            (301, true),
            (307, true),
        ] {
            let e = outcome(StatusCode::from_u16(code).unwrap(), None, None, "", "x").unwrap_err();
            assert_eq!(
                matches!(e.disposition(), Disposition::Retry { .. }),
                retry,
                "{code}"
            );
        }
        for (code, kind) in [
            (500, PublishErrorKind::BrokerFailure),
            (502, PublishErrorKind::Unavailable),
            (503, PublishErrorKind::Unavailable),
            (504, PublishErrorKind::Unavailable),
        ] {
            let e = outcome(StatusCode::from_u16(code).unwrap(), None, None, "", "x").unwrap_err();
            assert_eq!(e.kind(), kind, "{code}");
        }
        // A URL with a user alone is sent as Basic `user:`: that base64 is scrubbed too.
        let known = KnownSecrets::new(KnownSecrets::of_user_info("https://TOKEN1@h/x"));
        assert_eq!(
            known.scrub(r#"{"credentials":"VE9LRU4xOg=="}"#),
            r#"{"credentials":"***"}"#
        );
        let e = outcome(StatusCode::TOO_MANY_REQUESTS, Some("7"), None, "", "x").unwrap_err();
        assert_eq!(
            e.disposition(),
            Disposition::Retry {
                after: Some(Duration::from_secs(7))
            }
        );
    }

    #[test]
    fn retry_after_accepts_http_dates() {
        let past = parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        assert_eq!(past, Duration::ZERO);
        assert!(parse_retry_after("soon").is_none());
    }
}
