//! Where the AWS sinks' credentials come from: the SDKs' standard chain, in their order.
//!
//! 1. The environment: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`.
//! 2. Web identity (Kubernetes IRSA, EKS): `AWS_WEB_IDENTITY_TOKEN_FILE` and `AWS_ROLE_ARN`,
//!    exchanged at STS (`AssumeRoleWithWebIdentity`) and again before they expire, because
//!    the token file is rotated.
//! 3. A profile (`profile` setting, `AWS_PROFILE`, else `default`) in `~/.aws/credentials`
//!    and `~/.aws/config` (`AWS_SHARED_CREDENTIALS_FILE`, `AWS_CONFIG_FILE`): static keys,
//!    or a `web_identity_token_file` with a `role_arn`.
//!
//! What this chain does not read is refused by name rather than skipped: a profile that
//! uses `credential_process`, SSO or `source_profile` role chaining. Instance metadata
//! (EC2 IMDS) and the ECS container endpoint are not read either.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use outbox_core::{PublishError, PublishErrorKind};
use tokio::sync::Mutex;

use crate::error::SinkSetupError;
use outbox_core::redact::Secret;

/// The process environment, or a test's stand-in for it.
pub type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// Credentials are fetched again this long before they expire.
const REFRESH_BEFORE_EXPIRY: Duration = Duration::from_secs(300);

/// One set of credentials.
#[derive(Clone, Debug, PartialEq)]
pub struct Credentials {
    pub access_key_id: String,
    pub secret_access_key: Secret,
    pub session_token: Option<Secret>,
    /// When temporary credentials stop working.
    pub expires: Option<SystemTime>,
}

/// Where the credentials come from.
enum Source {
    Static(Credentials),
    WebIdentity {
        role_arn: String,
        token_file: PathBuf,
        session_name: String,
        sts_endpoint: String,
    },
}

/// The credentials the chain found, fetched again when temporary ones near their expiry.
pub struct Provider {
    source: Source,
    /// Where they came from, for logs and errors: never a secret.
    origin: String,
    http: reqwest::Client,
    cached: Mutex<Option<Credentials>>,
}

/// What the chain found besides credentials: the profile's region, if it names one.
pub struct Found {
    pub provider: Provider,
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
            provider: Provider {
                source,
                origin,
                http: http.clone(),
                cached: Mutex::new(None),
            },
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
        Err(SinkSetupError::config(
            "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, \
             AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN (Kubernetes), or AWS_PROFILE with keys \
             in ~/.aws/credentials",
        ))
    }

    /// Where the credentials come from, never what they are.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Drops fetched credentials the service called expired, so the next request fetches
    /// new ones.
    pub async fn forget(&self) {
        *self.cached.lock().await = None;
    }

    /// Credentials to sign the next request with.
    pub async fn get(&self) -> Result<Credentials, PublishError> {
        let (role_arn, token_file, session_name, sts_endpoint) = match &self.source {
            Source::Static(credentials) => return Ok(credentials.clone()),
            Source::WebIdentity {
                role_arn,
                token_file,
                session_name,
                sts_endpoint,
            } => (role_arn, token_file, session_name, sts_endpoint),
        };
        let mut cached = self.cached.lock().await;
        if let Some(credentials) = cached.as_ref() {
            let fresh = credentials
                .expires
                .is_none_or(|at| at > SystemTime::now() + REFRESH_BEFORE_EXPIRY);
            if fresh {
                return Ok(credentials.clone());
            }
        }
        match self
            .assume_role(role_arn, token_file, session_name, sts_endpoint)
            .await
        {
            Ok(credentials) => {
                *cached = Some(credentials.clone());
                Ok(credentials)
            }
            // Refreshed early: credentials that still work are used until they expire.
            Err(error) => match cached.as_ref() {
                Some(still) if still.expires.is_some_and(|at| at > SystemTime::now()) => {
                    tracing::warn!(
                        error = %error.report(),
                        origin = %self.origin,
                        "could not refresh AWS credentials; using the current ones until they expire"
                    );
                    Ok(still.clone())
                }
                _ => Err(error),
            },
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
            return Err(super::query_error(status.as_u16(), &body, &what));
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
        let err = chain(&[("HOME", "/nonexistent")], None)
            .err()
            .unwrap()
            .to_string();
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
}
