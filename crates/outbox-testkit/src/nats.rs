//! A NATS JetStream server of the test's own, with its streams: the one way tests get a
//! private broker (tests content with a stream on the shared server use
//! `OUTBOX_TEST_NATS_URL`).

use std::ops::Deref;
use std::path::Path;
use std::time::Duration;

use async_nats::jetstream;

use crate::eventually;
use crate::server::ServerProcess;

/// A private nats-server (JetStream stored in its directory) and a client connected to it.
/// Derefs to its [`ServerProcess`]: `port`, `stop()`, `resume()`.
pub struct PrivateNats {
    pub server: ServerProcess,
    /// The URL the relay and sinks connect to (`nats://` or, with TLS, `tls://`).
    pub url: String,
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    /// The configuration file's directory, for a server started from one.
    _config: Option<tempfile::TempDir>,
}

/// The users of [`PrivateNats::with_users`]: `admin` may do anything (the harness's own
/// client), `narrow` may publish to JetStream's API and `orders.allowed.>` only, and `deaf`
/// may publish anywhere but not subscribe to reply inboxes, where PubAcks come.
pub const USERS: &str = r#"
authorization {
  users = [
    { user: admin, password: admin }
    { user: narrow, password: narrow, permissions: {
        publish: { allow: ["$JS.API.>", "orders.allowed.>"] },
        subscribe: { allow: ["_INBOX.>"] } } }
    { user: deaf, password: deaf, permissions: { subscribe: { deny: ["_INBOX.>"] } } }
  ]
}
"#;

/// A stream `name` capturing `subjects`, the rest default: spread it into a
/// `jetstream::stream::Config { duplicate_window, ..stream(…) }` for more.
pub fn stream(name: &str, subjects: &[&str]) -> jetstream::stream::Config {
    jetstream::stream::Config {
        name: name.into(),
        subjects: subjects.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

impl PrivateNats {
    /// A server with JetStream and the stream `config`.
    pub async fn with_stream(config: jetstream::stream::Config) -> PrivateNats {
        let nats = PrivateNats::start().await;
        nats.add_stream(config).await;
        nats
    }

    /// A server with JetStream and no stream yet.
    pub async fn start() -> PrivateNats {
        PrivateNats::spawn(JETSTREAM, None).await
    }

    /// A server without JetStream (for the sink's refusal of one).
    pub async fn without_jetstream() -> PrivateNats {
        PrivateNats::spawn(&[], None).await
    }

    /// A server with JetStream whose users (`admin`, `narrow`, `deaf`; each user's password
    /// is its name) have the permissions [`USERS`] gives them. `url` names no user:
    /// [`PrivateNats::url_of`] gives a user's.
    pub async fn with_users() -> PrivateNats {
        let config = tempfile::tempdir().unwrap();
        write_config(config.path(), USERS);
        let file = config.path().join("nats.conf").display().to_string();
        let mut nats = PrivateNats::spawn_as(&["-c", &file], None, Some("admin")).await;
        nats._config = Some(config);
        nats
    }

    /// Replaces the users' block of a server started [`PrivateNats::with_users`] and has the
    /// server reload it (SIGHUP), keeping its connections.
    pub fn reload_users(&self, users: &str) {
        let config = self._config.as_ref().expect("a server started with_users");
        write_config(config.path(), users);
        let pid = self.server.pid().expect("the server runs");
        let status = std::process::Command::new("kill")
            .args(["-HUP", &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "signal nats-server to reload");
    }

    /// The URL with `user`'s credentials (its password is its name).
    pub fn url_of(&self, user: &str) -> String {
        self.url.replacen("://", &format!("://{user}:{user}@"), 1)
    }

    /// A server with JetStream that accepts TLS only, with the certificates of
    /// [`test_certs`](crate::server::test_certs) in `certs`; the client trusts their CA.
    pub async fn with_tls(certs: &Path) -> PrivateNats {
        PrivateNats::spawn(JETSTREAM, Some(certs)).await
    }

    async fn spawn(extra: &[&str], tls: Option<&Path>) -> PrivateNats {
        PrivateNats::spawn_as(extra, tls, None).await
    }

    async fn spawn_as(extra: &[&str], tls: Option<&Path>, user: Option<&str>) -> PrivateNats {
        crate::install_crypto();
        let path = |f: &str| tls.unwrap().join(f).display().to_string();
        let mut args = vec!["-a", "127.0.0.1", "-p", "{port}"];
        args.extend(extra);
        let tls_args;
        if tls.is_some() {
            tls_args = [path("server.pem"), path("server.key")];
            args.extend(["--tls", "--tlscert", &tls_args[0], "--tlskey", &tls_args[1]]);
        }
        let server = ServerProcess::start("nats-server", &args);
        let scheme = if tls.is_some() { "tls" } else { "nats" };
        let url = format!("{scheme}://127.0.0.1:{}", server.port);
        let client = eventually(
            "nats-server to accept clients",
            Duration::from_secs(10),
            || {
                let url = url.clone();
                async move {
                    let options = match user {
                        Some(user) => async_nats::ConnectOptions::with_user_and_password(
                            user.into(),
                            user.into(),
                        ),
                        None => async_nats::ConnectOptions::new(),
                    };
                    let options = match tls {
                        Some(certs) => options
                            .add_root_certificates(certs.join("ca.pem"))
                            .require_tls(true),
                        None => options,
                    };
                    options.connect(&url).await.ok()
                }
            },
        )
        .await;
        let js = jetstream::new(client.clone());
        PrivateNats {
            server,
            url,
            client,
            js,
            _config: None,
        }
    }

    /// Adds the stream `config`.
    pub async fn add_stream(&self, config: jetstream::stream::Config) {
        let name = config.name.clone();
        self.js
            .create_stream(config)
            .await
            .unwrap_or_else(|e| panic!("create the stream {name}: {e}"));
    }
}

const JETSTREAM: &[&str] = &["-js", "-sd", "{dir}/js"];

/// A configuration file in `dir` with JetStream (stored in `dir`) and `users`. JetStream is
/// in the file, not on the command line: a reload turns off what the file does not name.
fn write_config(dir: &Path, users: &str) {
    let store = dir.join("js");
    let text = format!(
        "jetstream {{ store_dir: {:?} }}\n{users}",
        store.display().to_string()
    );
    std::fs::write(dir.join("nats.conf"), text).unwrap();
}

impl Deref for PrivateNats {
    type Target = ServerProcess;

    fn deref(&self) -> &ServerProcess {
        &self.server
    }
}
