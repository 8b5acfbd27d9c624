//! The HTTP server's settings: where it listens, the admin API's token, and the host names
//! it answers to.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use outbox_core::redact::Secret;

use crate::error::ConfigError;

/// Loopback only: metrics and health are not for the outside world unless asked.
pub const DEFAULT_HTTP_ADDR: &str = "127.0.0.1:2259";
/// The shortest admin token: 16 characters of `openssl rand -hex` are 64 bits, beyond
/// guessing through a rate of requests a server answers.
const MIN_TOKEN_LEN: usize = 16;

outbox_core::settings! {
    /// What the operator sets about the HTTP server (the keys of the same names). They belong
    /// to the process: an `[[outboxes]]` entry cannot set them.
    #[derive(Clone, Debug, PartialEq)]
    pub struct HttpSettings {
        /// Address for /healthz, /readyz, /metrics, the admin API (/api/v1/) and the dashboard
        /// (/); 127.0.0.1:0 picks a free port, an empty value turns it off. A non-loopback
        /// address needs an admin token.
        pub http_addr: String = DEFAULT_HTTP_ADDR.into(),
        /// The admin API's bearer token, from OUTBOX_RELAY_ADMIN_TOKEN, admin_token_file, or
        /// the settings file (then readable by the relay's user alone); never shown.
        pub admin_token: Option<Secret> = None,
        /// A file holding the admin API's bearer token (or set OUTBOX_RELAY_ADMIN_TOKEN).
        /// Without a token the admin API is read-only.
        pub admin_token_file: Option<PathBuf> = None,
        /// Host names the server answers to besides IP addresses and localhost (the names a
        /// browser or proxy uses for it), comma-separated; requests for any other Host are
        /// refused, against DNS rebinding.
        #[serde(deserialize_with = "host_names")]
        pub allowed_hosts: Vec<String> = Vec::new(),
    }
}

impl HttpSettings {
    /// Refuses an address or host name the server could not use.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.socket_addr()?;
        self.allowed_host_names()?;
        Ok(())
    }

    /// Where the server listens; `None`: nowhere.
    pub fn socket_addr(&self) -> anyhow::Result<Option<SocketAddr>> {
        if self.http_addr.trim().is_empty() {
            return Ok(None);
        }
        self.http_addr.parse().map(Some).with_context(|| {
            format!(
                "invalid http_addr {:?}: use host:port, e.g. 127.0.0.1:2259",
                outbox_core::redact::redact_url(&self.http_addr)
            )
        })
    }

    /// The admin API's token: `admin_token` (`OUTBOX_RELAY_ADMIN_TOKEN`) or the first line
    /// of `admin_token_file`; `None` leaves the API read-only.
    pub fn admin_token(&self) -> anyhow::Result<Option<Secret>> {
        let config_error = |m: String| anyhow::Error::new(ConfigError(m));
        let token = match (&self.admin_token, &self.admin_token_file) {
            (Some(_), Some(_)) => {
                return Err(config_error(
                    "both OUTBOX_RELAY_ADMIN_TOKEN (admin_token) and --admin-token-file \
                     (admin_token_file) are set: keep one"
                        .into(),
                ))
            }
            (Some(token), None) => token.expose().trim().to_string(),
            (None, Some(path)) => {
                crate::secret_file::read(path, "admin token", "--admin-token-file")?
                    .expose()
                    .to_string()
            }
            (None, None) => return Ok(None),
        };
        if token.len() < MIN_TOKEN_LEN {
            return Err(config_error(
                "the admin token must be at least 16 characters (e.g. `openssl rand -hex 32`)"
                    .into(),
            ));
        }
        // An HTTP header carries visible ASCII and spaces only: any other token was accepted
        // here and then refused on every request, the console saying "token refused".
        if !token.bytes().all(|b| b.is_ascii_graphic() || b == b' ') {
            return Err(config_error(
                "the admin token holds a character other than visible ASCII or a space (a \
                 control character or a non-ASCII letter), which no HTTP client can send in \
                 its Authorization header: make one with `openssl rand -hex 32`"
                    .into(),
            ));
        }
        Ok(Some(Secret::new(token)))
    }

    /// Where the server listens (`None`: nowhere) and the admin API's token. A server beyond
    /// loopback needs the token.
    pub fn listen(&self) -> anyhow::Result<(Option<SocketAddr>, Option<Secret>)> {
        let http_addr = self.socket_addr()?;
        let admin_token = self.admin_token()?;
        if http_addr.is_none() {
            let without_server = [
                (
                    admin_token.is_some(),
                    "an admin token (OUTBOX_RELAY_ADMIN_TOKEN or --admin-token-file)",
                ),
                (!self.allowed_hosts.is_empty(), "allowed_hosts"),
            ];
            if let Some((_, setting)) = without_server.iter().find(|(set, _)| *set) {
                return Err(anyhow::Error::new(ConfigError(format!(
                    "{setting} is set, but http_addr is empty, so there is no HTTP server for it \
                     to apply to: remove it, or set http_addr (e.g. 127.0.0.1:2259)"
                ))));
            }
        }
        if let Some(addr) = http_addr {
            if !addr.ip().is_loopback() && admin_token.is_none() {
                return Err(anyhow::Error::new(ConfigError(format!(
                    "http_addr {addr} is not a loopback address, and the admin API there would \
                     have no token: set OUTBOX_RELAY_ADMIN_TOKEN or --admin-token-file FILE, or \
                     listen on 127.0.0.1"
                ))));
            }
        }
        Ok((http_addr, admin_token))
    }

    /// `allowed_hosts`, lowercased: bare host names, refused with the fix when one carries a
    /// port, a scheme or a path (the check ignores the port a client sends).
    pub fn allowed_host_names(&self) -> anyhow::Result<Vec<String>> {
        self.allowed_hosts
            .iter()
            .map(|name| {
                let bare = name.trim().trim_end_matches('.').to_ascii_lowercase();
                let fine = !bare.is_empty()
                    && bare
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
                if fine {
                    Ok(bare)
                } else {
                    Err(anyhow::Error::new(ConfigError(format!(
                        "allowed_hosts: {name:?} is not a host name; give names only, without \
                         scheme or port, e.g. relay.internal"
                    ))))
                }
            })
            .collect()
    }
}

/// A list of names from TOML's array, or from one string separated by commas (what
/// `OUTBOX_RELAY_ALLOWED_HOSTS=a,b` gives).
fn host_names<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    use serde::Deserialize;
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Names {
        One(String),
        Many(Vec<String>),
    }
    Ok(match Names::deserialize(d)? {
        Names::One(text) => text
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(String::from)
            .collect(),
        Names::Many(names) => names,
    })
}
