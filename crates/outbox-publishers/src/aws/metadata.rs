//! Credentials from the machine the relay runs on: the ECS/EKS container endpoint and EC2
//! instance metadata (IMDSv2), both answering the same JSON document.
//!
//! Only IMDSv2 is spoken: IMDSv1 (a GET without a session token) is what the token PUT
//! exists to replace, so a PUT that gets no answer is an error naming the fix, never a
//! fallback.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use outbox_core::redact::Secret;
use outbox_core::{PublishError, PublishErrorKind};
use serde::Deserialize;

use super::sigv4::Credentials;
use crate::error::SinkSetupError;

/// Instance metadata's default address, and the IPv6 one (`AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE`).
pub const IMDS_ENDPOINT: &str = "http://169.254.169.254";
pub const IMDS_ENDPOINT_IPV6: &str = "http://[fd00:ec2::254]";
/// ECS's endpoint, which `AWS_CONTAINER_CREDENTIALS_RELATIVE_URI` is relative to.
pub const ECS_ENDPOINT: &str = "http://169.254.170.2";

/// How long an IMDS session token lives: the largest IMDS allows, as the SDKs ask.
const TOKEN_TTL_SECONDS: &str = "21600";
/// The SDKs' timeouts for both endpoints: they answer locally or not at all.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);
/// The most of an endpoint's error body kept in an error.
const EXCERPT_CHARS: usize = 200;

/// The fix for a container whose PUT answer never arrives.
pub const HOP_LIMIT_FIX: &str =
    "aws ec2 modify-instance-metadata-options --instance-id <id> --http-put-response-hop-limit 2";

/// The client for both endpoints: short timeouts, no proxy (the SDKs never proxy them), no
/// redirects (an answer elsewhere is not the endpoint's).
pub fn client() -> Result<reqwest::Client, SinkSetupError> {
    reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(ANSWER_TIMEOUT)
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("outbox-relay/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| SinkSetupError::config(format!("HTTP client setup failed: {e}")))
}

/// A credentials endpoint failed: retried, as the machine's endpoint comes back (or a role
/// is attached) without the relay's configuration changing; `why` names the fix.
fn failed(why: String) -> PublishError {
    PublishError::new(PublishErrorKind::Unavailable, why)
}

/// The document both endpoints answer (IMDS adds `Code`, `Type` and `LastUpdated`).
#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Document {
    code: Option<String>,
    message: Option<String>,
    access_key_id: Option<String>,
    secret_access_key: Option<String>,
    token: Option<String>,
    expiration: Option<String>,
}

fn credentials(body: &str, what: &str) -> Result<Credentials, PublishError> {
    let document: Document = serde_json::from_str(body).map_err(|e| {
        failed(format!(
            "{what} answered a document that is not the credentials' JSON: {e}"
        ))
    })?;
    if let Some(code) = document.code.filter(|c| c != "Success") {
        let message = document.message.unwrap_or_default();
        return Err(failed(format!("{what} answered {code}: {message}")));
    }
    let (Some(access_key_id), Some(secret)) = (document.access_key_id, document.secret_access_key)
    else {
        return Err(failed(format!(
            "{what} answered without AccessKeyId and SecretAccessKey"
        )));
    };
    Ok(Credentials {
        access_key_id,
        secret_access_key: Secret::new(secret),
        session_token: document.token.map(Secret::new),
        // Unreadable: treated as not expiring, and fetched again on a refusal.
        expires: document
            .expiration
            .and_then(|at| humantime::parse_rfc3339(at.trim()).ok()),
    })
}

fn excerpt(body: &str) -> String {
    body.chars().take(EXCERPT_CHARS).collect()
}

/// EC2 instance metadata, IMDSv2.
pub struct Imds {
    pub endpoint: String,
    pub http: reqwest::Client,
}

impl Imds {
    /// `AWS_EC2_METADATA_SERVICE_ENDPOINT`, else the address `_ENDPOINT_MODE` picks.
    pub fn endpoint(
        explicit: Option<String>,
        mode: Option<String>,
    ) -> Result<String, SinkSetupError> {
        let Some(explicit) = explicit else {
            let ipv6 = mode.is_some_and(|m| m.trim().eq_ignore_ascii_case("ipv6"));
            return Ok(if ipv6 {
                IMDS_ENDPOINT_IPV6
            } else {
                IMDS_ENDPOINT
            }
            .into());
        };
        let endpoint = explicit.trim().trim_end_matches('/').to_string();
        match reqwest::Url::parse(&endpoint) {
            Ok(url) if matches!(url.scheme(), "http" | "https") && url.host().is_some() => {
                Ok(endpoint)
            }
            _ => Err(SinkSetupError::config(format!(
                "AWS_EC2_METADATA_SERVICE_ENDPOINT {explicit:?} is not an http URL: write it \
                 like http://169.254.169.254, or unset it"
            ))),
        }
    }

    pub async fn fetch(&self) -> Result<Credentials, PublishError> {
        let token = self.session_token().await?;
        let listing = format!(
            "{}/latest/meta-data/iam/security-credentials/",
            self.endpoint
        );
        let roles = self.get(&listing, &token).await?.ok_or_else(|| {
            failed(format!(
                "instance metadata at {} lists no IAM role: attach one to the instance (an \
                 instance profile), or give the relay credentials another way",
                self.endpoint
            ))
        })?;
        let role = roles.lines().map(str::trim).find(|r| !r.is_empty());
        let Some(role) = role else {
            return Err(failed(format!(
                "instance metadata at {} lists no IAM role: attach one to the instance",
                self.endpoint
            )));
        };
        let what = format!("instance metadata at {} (role {role})", self.endpoint);
        let body = self
            .get(&format!("{listing}{role}"), &token)
            .await?
            .ok_or_else(|| {
                failed(format!(
                    "{what}: the role's credentials are not there (the instance profile changed?)"
                ))
            })?;
        credentials(&body, &what)
    }

    /// The session token every GET must carry.
    async fn session_token(&self) -> Result<Secret, PublishError> {
        let url = format!("{}/latest/api/token", self.endpoint);
        let what = format!("instance metadata at {}", self.endpoint);
        let response = self
            .http
            .put(&url)
            .header("x-aws-ec2-metadata-token-ttl-seconds", TOKEN_TTL_SECONDS)
            .send()
            .await
            .map_err(|e| {
                let why = if e.is_connect() {
                    format!(
                        "{what} cannot be reached (the relay is not on EC2, or the instance's \
                         metadata endpoint is off), and no other AWS credentials are set: set \
                         AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_WEB_IDENTITY_TOKEN_FILE \
                         and AWS_ROLE_ARN, AWS_PROFILE with keys in ~/.aws/credentials, or \
                         AWS_CONTAINER_CREDENTIALS_RELATIVE_URI or _FULL_URI"
                    )
                } else if e.is_timeout() {
                    // IMDS drops the PUT's answer past its hop limit: a container on the
                    // instance (one hop more) waits for nothing.
                    format!(
                        "{what} took the session-token PUT but never answered: from a \
                         container, the instance's hop limit (1 by default) stops the answer; \
                         raise it with `{HOP_LIMIT_FIX}`"
                    )
                } else {
                    format!("{what}: the session-token PUT failed")
                };
                failed(why).with_source(e.without_url())
            })?;
        let status = response.status();
        let body = response.text().await.unwrap_or_default();
        match status.as_u16() {
            200..=299 if !body.trim().is_empty() => Ok(Secret::new(body.trim())),
            403 => Err(failed(format!(
                "{what} refused the session-token PUT (403): the instance's metadata \
                 endpoint is off (`aws ec2 modify-instance-metadata-options --http-endpoint \
                 enabled`), or a proxy added X-Forwarded-For"
            ))),
            code => Err(failed(format!(
                "{what} answered the session-token PUT with HTTP {code}: {}",
                excerpt(&body)
            ))),
        }
    }

    /// A GET with the session token; `None` when there is nothing there (404).
    async fn get(&self, url: &str, token: &Secret) -> Result<Option<String>, PublishError> {
        let what = format!("instance metadata at {}", self.endpoint);
        let request = self
            .http
            .get(url)
            .header("x-aws-ec2-metadata-token", token.expose());
        let (status, body) = answer(request, &what).await?;
        match status {
            200..=299 => Ok(Some(body)),
            404 => Ok(None),
            code => Err(failed(format!(
                "{what} answered HTTP {code}: {}",
                excerpt(&body)
            ))),
        }
    }
}

/// The token the container endpoint wants in `Authorization`.
pub enum AuthToken {
    /// EKS Pod Identity's projected file, read for every fetch: it is rotated.
    File(PathBuf),
    Value(Secret),
}

/// The ECS (or EKS Pod Identity) container credentials endpoint.
pub struct Container {
    pub url: String,
    pub token: Option<AuthToken>,
    pub http: reqwest::Client,
}

impl Container {
    /// The endpoint the variables name: `relative` on ECS's address wins over `full`, which
    /// must be a host the SDKs allow.
    pub fn url(relative: Option<String>, full: Option<String>) -> Result<String, SinkSetupError> {
        if let Some(relative) = relative {
            let relative = relative.trim();
            let slash = if relative.starts_with('/') { "" } else { "/" };
            return Ok(format!("{ECS_ENDPOINT}{slash}{relative}"));
        }
        let full = full.unwrap_or_default();
        let refuse = |why: &str| {
            SinkSetupError::config(format!(
                "AWS_CONTAINER_CREDENTIALS_FULL_URI {full:?} {why}: use https, or plain http to \
                 a loopback address, 169.254.170.2, 169.254.170.23 or fd00:ec2::23 (as the AWS \
                 SDKs allow), so credentials never travel in clear to another host"
            ))
        };
        let parsed = reqwest::Url::parse(full.trim()).map_err(|_| refuse("is not a URL"))?;
        match parsed.scheme() {
            "https" => {}
            "http" if allowed_http_host(&parsed) => {}
            "http" => return Err(refuse("names a host the relay may not send the token to")),
            _ => return Err(refuse("is neither http nor https")),
        }
        Ok(full.trim().to_string())
    }

    pub async fn fetch(&self) -> Result<Credentials, PublishError> {
        let what = format!("the container credentials endpoint {}", self.url);
        let mut request = self.http.get(&self.url);
        let token = match &self.token {
            None => None,
            Some(AuthToken::Value(token)) => Some(token.expose().trim().to_string()),
            Some(AuthToken::File(path)) => Some(
                std::fs::read_to_string(path)
                    .map_err(|e| {
                        failed(format!(
                            "cannot read AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE {}: {e}: check \
                             the pod's projected token (EKS Pod Identity)",
                            path.display()
                        ))
                    })?
                    .trim()
                    .to_string(),
            ),
        };
        if let Some(token) = token {
            // A header value with a line break would be a second header.
            if token.contains(['\r', '\n']) {
                return Err(failed(
                    "the container authorization token holds a line break: it must be one line"
                        .into(),
                ));
            }
            request = request.header("authorization", token);
        }
        let (status, body) = answer(request, &what).await?;
        match status {
            200..=299 => credentials(&body, &what),
            code @ (401 | 403) => Err(failed(format!(
                "{what} refused the authorization token (HTTP {code}): check \
                 AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE or AWS_CONTAINER_AUTHORIZATION_TOKEN: {}",
                excerpt(&body)
            ))),
            code => Err(failed(format!(
                "{what} answered HTTP {code}: {}",
                excerpt(&body)
            ))),
        }
    }
}

/// Sends `request` to `what` (as errors name it): its status code and body (empty when the
/// body could not be read; the status then says what happened).
async fn answer(
    request: reqwest::RequestBuilder,
    what: &str,
) -> Result<(u16, String), PublishError> {
    let response = request
        .send()
        .await
        .map_err(|e| crate::http::transport_error(e, what))?;
    let status = response.status().as_u16();
    Ok((status, response.text().await.unwrap_or_default()))
}

/// Whether plain http may go to this host: loopback, or ECS's and EKS Pod Identity's
/// link-local addresses.
fn allowed_http_host(url: &reqwest::Url) -> bool {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let host = url.host_str().unwrap_or_default();
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V4(ip)) => {
            ip.is_loopback()
                || ip == Ipv4Addr::new(169, 254, 170, 2)
                || ip == Ipv4Addr::new(169, 254, 170, 23)
        }
        Ok(IpAddr::V6(ip)) => {
            ip.is_loopback() || ip == Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x23)
        }
        Err(_) => false,
    }
}

/// When the credentials expire, for logs.
pub fn expiry(at: Option<SystemTime>) -> String {
    at.map(|at| humantime::format_rfc3339_seconds(at).to_string())
        .unwrap_or_else(|| "never".into())
}
