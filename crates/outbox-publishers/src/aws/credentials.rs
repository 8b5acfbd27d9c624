//! Where the AWS sinks' credentials come from: the SDKs' standard chain, in their order.
//!
//! 1. The environment: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`.
//! 2. Web identity (Kubernetes IRSA, EKS): `AWS_WEB_IDENTITY_TOKEN_FILE` and `AWS_ROLE_ARN`,
//!    exchanged at STS (`AssumeRoleWithWebIdentity`) and again before they expire, because
//!    the token file is rotated.
//! 3. A profile (`profile` setting, `AWS_PROFILE`, else `default`) in `~/.aws/credentials`
//!    and `~/.aws/config` (`AWS_SHARED_CREDENTIALS_FILE`, `AWS_CONFIG_FILE`): static keys,
//!    or a `web_identity_token_file` with a `role_arn`.
//! 4. The container endpoint (ECS, EKS Pod Identity): `AWS_CONTAINER_CREDENTIALS_RELATIVE_URI`
//!    (on 169.254.170.2) or `AWS_CONTAINER_CREDENTIALS_FULL_URI`, with the token of
//!    `AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE` or `AWS_CONTAINER_AUTHORIZATION_TOKEN`.
//! 5. EC2 instance metadata (IMDSv2), unless `AWS_EC2_METADATA_DISABLED=true`; its address
//!    from `AWS_EC2_METADATA_SERVICE_ENDPOINT`. Whether the relay is on EC2 is known only by
//!    asking, so, as with the SDKs, a relay with nothing else set learns it at its first
//!    request, whose error names the other steps it could use instead.
//!
//! What this chain does not read is refused by name rather than skipped: a profile that
//! uses `credential_process`, SSO or `source_profile` role chaining.
//!
//! Temporary credentials are fetched again [`REFRESH_BEFORE_EXPIRY`] before they expire, by
//! one background task per sink while requests go on signing with the current ones; only a
//! sink with no valid credentials waits for a fetch (and all its requests share that one).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use outbox_core::{PublishError, PublishErrorKind};

use super::metadata::{self, AuthToken, Container, Imds};
pub use super::sigv4::Credentials;

use crate::error::SinkSetupError;
use outbox_core::redact::Secret;

/// The process environment, or a test's stand-in for it.
pub type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// Credentials are fetched again this long before they expire.
pub const REFRESH_BEFORE_EXPIRY: Duration = Duration::from_secs(300);
/// A background refresh waits this long after the last: when one fails, or the endpoint
/// hands out credentials already inside the refresh window, the requests signing meanwhile
/// must not each ask it again.
const REFRESH_SPACING: Duration = Duration::from_secs(10);

/// Where the credentials come from.
enum Source {
    Static(Credentials),
    WebIdentity {
        role_arn: String,
        token_file: PathBuf,
        session_name: String,
        sts_endpoint: String,
    },
    Container(Container),
    Imds(Imds),
}

/// The credentials the chain found, fetched again when temporary ones near their expiry.
pub struct Provider {
    source: Source,
    /// Where they came from, for logs and errors: never a secret.
    origin: String,
    http: reqwest::Client,
    /// What requests sign with; locked only to read or replace it, never across a fetch.
    cached: Mutex<Option<Credentials>>,
    /// Held while fetching, so a sink fetches once however many requests need credentials.
    fetching: Arc<tokio::sync::Mutex<()>>,
    /// When a background refresh last started, to space the next.
    refreshed_at: Mutex<Option<Instant>>,
    /// Whether the current run of failed refreshes was logged: once per run.
    warned: AtomicBool,
}

/// What the chain found besides credentials: the profile's region, if it names one.
pub struct Found {
    pub provider: Arc<Provider>,
    pub profile_region: Option<String>,
}

fn non_empty(env: Env<'_>, name: &str) -> Option<String> {
    env(name).filter(|value| !value.trim().is_empty())
}

impl Provider {
    /// Walks the chain. `profile` is the sink's `profile` setting: named explicitly, it is
    /// read first (as the SDKs do with a profile given in code), not shadowed by the
    /// environment. `region` is the sink's `region` setting, for the STS endpoint.
    pub fn from_chain(
        env: Env<'_>,
        profile: Option<&str>,
        sink_region: Option<&str>,
        http: reqwest::Client,
    ) -> Result<Found, SinkSetupError> {
        let found = |source, origin: String, profile_region| Found {
            provider: Arc::new(Provider {
                source,
                origin,
                http: http.clone(),
                cached: Mutex::new(None),
                fetching: Arc::default(),
                refreshed_at: Mutex::new(None),
                warned: AtomicBool::new(false),
            }),
            profile_region,
        };
        let from_env = profile.is_none();
        if let Some(access_key_id) = non_empty(env, "AWS_ACCESS_KEY_ID").filter(|_| from_env) {
            let secret = non_empty(env, "AWS_SECRET_ACCESS_KEY").ok_or_else(|| {
                SinkSetupError::config(
                    "AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not: set both",
                )
            })?;
            let credentials = Credentials {
                access_key_id,
                secret_access_key: Secret::new(secret),
                session_token: non_empty(env, "AWS_SESSION_TOKEN").map(Secret::new),
                expires: None,
            };
            return Ok(found(
                Source::Static(credentials),
                "the environment".into(),
                None,
            ));
        }
        if let Some(token_file) = non_empty(env, "AWS_WEB_IDENTITY_TOKEN_FILE").filter(|_| from_env)
        {
            let role_arn = non_empty(env, "AWS_ROLE_ARN").ok_or_else(|| {
                SinkSetupError::config(
                    "AWS_WEB_IDENTITY_TOKEN_FILE is set but AWS_ROLE_ARN is not: set the role \
                     to assume",
                )
            })?;
            let source = web_identity(env, sink_region, role_arn.clone(), token_file.into(), None);
            return Ok(found(
                source,
                format!("web identity (role {role_arn})"),
                None,
            ));
        }
        let name = profile
            .map(str::to_string)
            .or_else(|| non_empty(env, "AWS_PROFILE"))
            .unwrap_or_else(|| "default".into());
        let profile = read_profile(env, &name)?;
        let region = profile.get("region").cloned();
        if let Some(access_key_id) = profile.get("aws_access_key_id") {
            let secret = profile.get("aws_secret_access_key").ok_or_else(|| {
                SinkSetupError::config(format!(
                    "AWS profile {name:?} has aws_access_key_id but no aws_secret_access_key"
                ))
            })?;
            let credentials = Credentials {
                access_key_id: access_key_id.clone(),
                secret_access_key: Secret::new(secret.clone()),
                session_token: profile.get("aws_session_token").cloned().map(Secret::new),
                expires: None,
            };
            return Ok(found(
                Source::Static(credentials),
                format!("AWS profile {name:?}"),
                region,
            ));
        }
        if let (Some(token_file), Some(role_arn)) = (
            profile.get("web_identity_token_file"),
            profile.get("role_arn"),
        ) {
            let source = web_identity(
                env,
                sink_region.or(region.as_deref()),
                role_arn.clone(),
                token_file.into(),
                profile.get("role_session_name").cloned(),
            );
            return Ok(found(
                source,
                format!("AWS profile {name:?} (web identity, role {role_arn})"),
                region,
            ));
        }
        for unsupported in [
            "credential_process",
            "sso_session",
            "sso_start_url",
            "source_profile",
        ] {
            if profile.contains_key(unsupported) {
                return Err(SinkSetupError::config(format!(
                    "AWS profile {name:?} uses {unsupported}, which outbox-relay does not read: \
                     give the relay static keys or a web identity (AWS_WEB_IDENTITY_TOKEN_FILE \
                     and AWS_ROLE_ARN) instead"
                )));
            }
        }
        let relative = non_empty(env, "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI");
        let full = non_empty(env, "AWS_CONTAINER_CREDENTIALS_FULL_URI");
        if relative.is_some() || full.is_some() {
            let url = Container::url(relative, full)?;
            let token = match non_empty(env, "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE") {
                Some(file) => Some(AuthToken::File(file.trim().into())),
                None => non_empty(env, "AWS_CONTAINER_AUTHORIZATION_TOKEN")
                    .map(|token| AuthToken::Value(Secret::new(token))),
            };
            let origin = format!("the container credentials endpoint {url}");
            let container = Container {
                url,
                token,
                http: metadata::client()?,
            };
            return Ok(found(Source::Container(container), origin, region));
        }
        let disabled = non_empty(env, "AWS_EC2_METADATA_DISABLED")
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
        if !disabled {
            let endpoint = Imds::endpoint(
                non_empty(env, "AWS_EC2_METADATA_SERVICE_ENDPOINT"),
                non_empty(env, "AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE"),
            )?;
            let origin = format!("instance metadata at {endpoint}");
            let imds = Imds {
                endpoint,
                http: metadata::client()?,
            };
            return Ok(found(Source::Imds(imds), origin, region));
        }
        Err(SinkSetupError::config(
            "no AWS credentials found (and AWS_EC2_METADATA_DISABLED=true): set \
             AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_WEB_IDENTITY_TOKEN_FILE and \
             AWS_ROLE_ARN (Kubernetes), AWS_PROFILE with keys in ~/.aws/credentials, \
             AWS_CONTAINER_CREDENTIALS_RELATIVE_URI or _FULL_URI (ECS, EKS Pod Identity), or \
             let the relay read EC2 instance metadata",
        ))
    }

    /// Where the credentials come from, never what they are.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Drops fetched credentials the service called expired, so the next request fetches
    /// new ones.
    pub async fn forget(&self) {
        *self.cached.lock().expect("never poisoned") = None;
    }

    /// Credentials to sign the next request with. Valid ones are returned at once (a
    /// refresh they near runs in the background); only none, or expired ones, wait for a
    /// fetch.
    pub async fn get(self: &Arc<Self>) -> Result<Credentials, PublishError> {
        if let Source::Static(credentials) = &self.source {
            return Ok(credentials.clone());
        }
        let current = self.cached.lock().expect("never poisoned").clone();
        let now = SystemTime::now();
        if let Some(credentials) = current {
            match credentials.expires {
                None => return Ok(credentials),
                Some(at) if at > now + REFRESH_BEFORE_EXPIRY => return Ok(credentials),
                Some(at) if at > now => {
                    self.refresh_in_background();
                    return Ok(credentials);
                }
                Some(_) => {}
            }
        }
        let _fetching = self.fetching.lock().await;
        // Another request may have fetched while this one waited.
        if let Some(credentials) = self.valid() {
            return Ok(credentials);
        }
        // Kept when the fetch fails: the error says when they expired.
        let expired = self.cached.lock().expect("never poisoned").clone();
        match self.fetch().await {
            Ok(credentials) => {
                self.store(&credentials);
                Ok(credentials)
            }
            Err(error) => Err(match expired.and_then(|c| c.expires) {
                Some(at) => PublishError::new(
                    PublishErrorKind::Unavailable,
                    format!(
                        "the AWS credentials from {} expired at {} and could not be fetched \
                         again (the relay keeps asking; the cause below names the fix)",
                        self.origin,
                        metadata::expiry(Some(at))
                    ),
                )
                .with_source(error),
                None => error,
            }),
        }
    }

    /// Returns once no fetch is running: for tests, to see what a background refresh left.
    #[doc(hidden)]
    pub async fn idle(&self) {
        let _fetching = self.fetching.lock().await;
    }

    /// The cached credentials if they have not expired.
    fn valid(&self) -> Option<Credentials> {
        let now = SystemTime::now();
        self.cached
            .lock()
            .expect("never poisoned")
            .clone()
            .filter(|c| c.expires.is_none_or(|at| at > now))
    }

    fn store(&self, credentials: &Credentials) {
        *self.cached.lock().expect("never poisoned") = Some(credentials.clone());
        if self.warned.swap(false, Ordering::Relaxed) {
            tracing::info!(origin = %self.origin, "AWS credentials refreshed again");
        }
        tracing::debug!(
            origin = %self.origin,
            expires = %metadata::expiry(credentials.expires),
            "fetched AWS credentials"
        );
    }

    /// Starts one refresh unless one is running or the last started moments ago; requests
    /// keep the current credentials meanwhile.
    fn refresh_in_background(self: &Arc<Self>) {
        let Ok(fetching) = self.fetching.clone().try_lock_owned() else {
            return;
        };
        {
            let mut refreshed_at = self.refreshed_at.lock().expect("never poisoned");
            if refreshed_at.is_some_and(|at| at.elapsed() < REFRESH_SPACING) {
                return;
            }
            *refreshed_at = Some(Instant::now());
        }
        let provider = self.clone();
        tokio::spawn(async move {
            let _fetching = fetching;
            match provider.fetch().await {
                Ok(credentials) => provider.store(&credentials),
                Err(error) => {
                    if !provider.warned.swap(true, Ordering::Relaxed) {
                        let expires = provider.valid().and_then(|c| c.expires);
                        tracing::warn!(
                            error = %error.report(),
                            origin = %provider.origin,
                            expires = %metadata::expiry(expires),
                            "could not refresh AWS credentials; using the current ones until \
                             they expire"
                        );
                    }
                }
            }
        });
    }

    /// New credentials from the source.
    async fn fetch(&self) -> Result<Credentials, PublishError> {
        match &self.source {
            Source::Static(credentials) => Ok(credentials.clone()),
            Source::WebIdentity {
                role_arn,
                token_file,
                session_name,
                sts_endpoint,
            } => {
                self.assume_role(role_arn, token_file, session_name, sts_endpoint)
                    .await
            }
            Source::Container(container) => container.fetch().await,
            Source::Imds(imds) => imds.fetch().await,
        }
    }

    /// Exchanges the web identity token at STS.
    async fn assume_role(
        &self,
        role_arn: &str,
        token_file: &std::path::Path,
        session_name: &str,
        sts_endpoint: &str,
    ) -> Result<Credentials, PublishError> {
        // Read each time: Kubernetes rotates the projected token file.
        // Retried: Kubernetes may be rotating the projected file.
        let token = std::fs::read_to_string(token_file).map_err(|e| {
            PublishError::new(
                PublishErrorKind::Unavailable,
                format!(
                    "cannot read the web identity token file {}: {e}",
                    token_file.display()
                ),
            )
        })?;
        let form = [
            ("Action", "AssumeRoleWithWebIdentity"),
            ("Version", "2011-06-15"),
            ("RoleArn", role_arn),
            ("RoleSessionName", session_name),
            ("WebIdentityToken", token.trim()),
        ];
        let what = format!("STS at {sts_endpoint} (AssumeRoleWithWebIdentity)");
        // The token is the proof of identity: this one request is not signed.
        let response = self
            .http
            .post(sts_endpoint)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(super::form_encode(&form))
            .send()
            .await
            .map_err(|e| crate::http::transport_error(e, &what))?;
        let status = response.status();
        let body = response.text().await.unwrap_or_default();
        if !status.is_success() {
            // STS refusing the relay's own identity (a malformed role ARN or session name,
            // a token it does not trust) is the sink's condition, not any event's: retried,
            // as a refused credential is, never a reason to dead-letter the events.
            let refused = super::query_error(status.as_u16(), &body, &what);
            return Err(match refused.disposition() {
                outbox_core::Disposition::Permanent => {
                    PublishError::new(PublishErrorKind::Unauthorized, refused.to_string())
                }
                _ => refused,
            });
        }
        let field = |tag: &str| {
            super::xml::text(&body, tag).ok_or_else(|| {
                PublishError::new(
                    PublishErrorKind::BrokerFailure,
                    format!("{what} answered without {tag}"),
                )
            })
        };
        let expires = field("Expiration")?;
        let credentials = Credentials {
            access_key_id: field("AccessKeyId")?,
            secret_access_key: Secret::new(field("SecretAccessKey")?),
            session_token: Some(Secret::new(field("SessionToken")?)),
            // Unreadable: treated as not expiring soon, and fetched again on a refusal.
            expires: humantime::parse_rfc3339(expires.trim()).ok(),
        };
        Ok(credentials)
    }
}

fn web_identity(
    env: Env<'_>,
    region: Option<&str>,
    role_arn: String,
    token_file: PathBuf,
    session_name: Option<String>,
) -> Source {
    let region = region
        .map(str::to_string)
        .or_else(|| non_empty(env, "AWS_REGION"))
        .or_else(|| non_empty(env, "AWS_DEFAULT_REGION"));
    let sts_endpoint = non_empty(env, "AWS_ENDPOINT_URL_STS")
        .or_else(|| non_empty(env, "AWS_ENDPOINT_URL"))
        .unwrap_or_else(|| match region {
            Some(region) => format!("https://sts.{region}.{}", super::dns_suffix(&region)),
            None => "https://sts.amazonaws.com".into(),
        });
    Source::WebIdentity {
        role_arn,
        token_file,
        session_name: session_name
            .or_else(|| non_empty(env, "AWS_ROLE_SESSION_NAME"))
            .unwrap_or_else(|| "outbox-relay".into()),
        sts_endpoint,
    }
}

/// The settings of profile `name`: `~/.aws/config`'s `[profile NAME]` (`[default]`), then
/// `~/.aws/credentials`' `[NAME]`, whose values win.
fn read_profile(env: Env<'_>, name: &str) -> Result<HashMap<String, String>, SinkSetupError> {
    let home = non_empty(env, "HOME").unwrap_or_default();
    let config_file = non_empty(env, "AWS_CONFIG_FILE").unwrap_or(format!("{home}/.aws/config"));
    let credentials_file =
        non_empty(env, "AWS_SHARED_CREDENTIALS_FILE").unwrap_or(format!("{home}/.aws/credentials"));
    let config_section = match name {
        "default" => "default".to_string(),
        other => format!("profile {other}"),
    };
    let mut settings = HashMap::new();
    let mut seen = false;
    for (file, section) in [
        (config_file, config_section),
        (credentials_file, name.into()),
    ] {
        let text = match std::fs::read_to_string(&file) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(SinkSetupError::config(format!("cannot read {file}: {e}")));
            }
        };
        if let Some(found) = ini_section(&text, &section) {
            seen = true;
            settings.extend(found);
        }
    }
    if !seen && name != "default" {
        return Err(SinkSetupError::config(format!(
            "AWS profile {name:?} is in neither ~/.aws/config nor ~/.aws/credentials: check \
             AWS_PROFILE or the sink's `profile`"
        )));
    }
    Ok(settings)
}

/// The `key = value` lines of `[section]` in an INI text.
fn ini_section(text: &str, section: &str) -> Option<HashMap<String, String>> {
    let mut inside = false;
    let mut found = None;
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(header) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = header.trim() == section;
            if inside {
                found.get_or_insert_with(HashMap::new);
            }
            continue;
        }
        if let (true, Some((key, value))) = (inside, line.split_once('=')) {
            found
                .get_or_insert_with(HashMap::new)
                .insert(key.trim().to_ascii_lowercase(), value.trim().to_string());
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| vars.get(name).cloned()
    }

    fn chain(vars: &[(&str, &str)], profile: Option<&str>) -> Result<Found, SinkSetupError> {
        outbox_testkit::install_crypto();
        Provider::from_chain(&env_of(vars), profile, None, reqwest::Client::new())
    }

    #[tokio::test]
    async fn the_environment_comes_first_then_the_profile() {
        let dir = tempfile::tempdir().unwrap();
        let credentials = dir.path().join("credentials");
        let config = dir.path().join("config");
        std::fs::write(
            &credentials,
            "[default]\naws_access_key_id = AKDEFAULT\naws_secret_access_key = s1\n\n\
             [ci]\naws_access_key_id=AKCI\naws_secret_access_key=s2\naws_session_token=t2\n",
        )
        .unwrap();
        std::fs::write(
            &config,
            "[profile ci]\nregion = eu-west-1\n[profile sso]\nsso_session = x\n",
        )
        .unwrap();
        let files = [
            ("AWS_SHARED_CREDENTIALS_FILE", credentials.to_str().unwrap()),
            ("AWS_CONFIG_FILE", config.to_str().unwrap()),
        ];
        let mut vars = files.to_vec();
        vars.extend([
            ("AWS_ACCESS_KEY_ID", "AKENV"),
            ("AWS_SECRET_ACCESS_KEY", "s0"),
        ]);
        let found = chain(&vars, None).unwrap();
        assert_eq!(found.provider.get().await.unwrap().access_key_id, "AKENV");
        assert_eq!(found.provider.origin(), "the environment");
        // A profile named in the sink's settings is not shadowed by the environment.
        let found = chain(&vars, Some("ci")).unwrap();
        assert_eq!(found.provider.get().await.unwrap().access_key_id, "AKCI");

        let found = chain(&files, None).unwrap();
        assert_eq!(
            found.provider.get().await.unwrap().access_key_id,
            "AKDEFAULT"
        );

        let mut vars = files.to_vec();
        vars.push(("AWS_PROFILE", "ci"));
        let found = chain(&vars, None).unwrap();
        let got = found.provider.get().await.unwrap();
        assert_eq!(got.access_key_id, "AKCI");
        assert_eq!(got.session_token, Some(Secret::new("t2")));
        assert_eq!(found.profile_region.as_deref(), Some("eu-west-1"));

        let err = chain(&files, Some("sso")).err().unwrap().to_string();
        assert!(err.contains("uses sso_session"), "{err}");
        let err = chain(&files, Some("nope")).err().unwrap().to_string();
        assert!(err.contains("\"nope\" is in neither"), "{err}");
        let nothing = [
            ("HOME", "/nonexistent"),
            ("AWS_EC2_METADATA_DISABLED", "true"),
        ];
        let err = chain(&nothing, None).err().unwrap().to_string();
        assert!(err.contains("no AWS credentials found"), "{err}");
        let err = chain(&[("AWS_ACCESS_KEY_ID", "AK")], None)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("AWS_SECRET_ACCESS_KEY is not"), "{err}");
    }

    #[test]
    fn secrets_stay_out_of_debug_output() {
        let credentials = Credentials {
            access_key_id: "AKID".into(),
            secret_access_key: Secret::new("very-secret"),
            session_token: Some(Secret::new("token-secret")),
            expires: None,
        };
        let shown = format!("{credentials:?}");
        assert!(!shown.contains("very-secret"), "{shown}");
        assert!(!shown.contains("token-secret"), "{shown}");
    }

    /// Counts the warnings logged on this thread.
    #[derive(Default)]
    struct Warnings(std::sync::atomic::AtomicUsize);

    impl tracing::Subscriber for Warnings {
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, event: &tracing::Event<'_>) {
            if *event.metadata().level() == tracing::Level::WARN {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }

    /// Refreshes that keep failing while the credentials are valid are logged once, not once
    /// per attempt.
    #[tokio::test]
    async fn a_failing_refresh_is_logged_once() {
        let warnings = Arc::new(Warnings::default());
        let _logging = tracing::subscriber::set_default(warnings.clone());
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/creds", closed.local_addr().unwrap());
        drop(closed);
        let found = chain(&[("AWS_CONTAINER_CREDENTIALS_FULL_URI", &url)], None).unwrap();
        let provider = found.provider;
        let valid = Credentials {
            access_key_id: "ASIAVALID".into(),
            secret_access_key: Secret::new("s"),
            session_token: None,
            expires: Some(SystemTime::now() + Duration::from_secs(60)),
        };
        *provider.cached.lock().unwrap() = Some(valid);
        for _ in 0..3 {
            assert_eq!(provider.get().await.unwrap().access_key_id, "ASIAVALID");
            provider.idle().await;
            // The next request may try again at once, instead of 10 s later.
            let tried = provider.refreshed_at.lock().unwrap().take();
            assert!(tried.is_some(), "no refresh was tried");
        }
        assert_eq!(warnings.0.load(Ordering::SeqCst), 1);
    }
}
