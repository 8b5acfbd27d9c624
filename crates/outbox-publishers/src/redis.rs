//! Redis Streams: XADD per event through a script that first checks a per-event key, so a
//! redelivered event is not appended twice within the de-duplication window. All of a
//! batch's scripts go out pipelined on one multiplexed connection.

use std::sync::Arc;
use std::time::Duration;

use futures::future::{join_all, BoxFuture};
use futures::FutureExt;
use outbox_core::{Outcome, PublishError, PublishErrorKind};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ErrorKind, RedisError, Script, ServerErrorKind};
use tokio::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::error::SinkSetupError;
use crate::settings::{ConfirmTimeout, TlsFiles};
use crate::sink::{fail_all, Routed, Sink};

/// Appends unless the event's id was seen within the window and its entry is still in the
/// stream. An entry gone since (the stream deleted or trimmed: what `replay` is for) is
/// appended again: a replay within the window was counted as published, and nothing was.
/// - The id is recorded only after XADD succeeded, so a failed append never marks the event
///   as sent.
/// - Before the XADD, the key is written as `pending`: a user that may append but not
///   write the key (an ACL without SET) is refused before anything is appended. Redis does
///   not undo a script's writes, and the append that went through was made again at every
///   retry. A `pending` key is no record of an append.
///
/// KEYS: stream, dedupe key. ARGV: window seconds, maxlen (0: none), field/value pairs.
const APPEND_ONCE: &str = r#"
local seen = redis.call('GET', KEYS[2])
if seen and seen ~= 'pending' and #redis.call('XRANGE', KEYS[1], seen, seen) > 0 then
  return false
end
redis.call('SET', KEYS[2], 'pending', 'EX', ARGV[1])
local id
if tonumber(ARGV[2]) > 0 then
  id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, 3))
else
  id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
end
redis.call('SET', KEYS[2], id, 'EX', ARGV[1])
return id
"#;

/// Redelivered events within this window are not appended twice to a Redis stream.
pub const DEFAULT_DEDUPE_WINDOW: Duration = Duration::from_secs(24 * 3600);

/// A Redis sink's own settings (`[sinks.NAME]` with a `redis://` or `rediss://` URI).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RedisConfig {
    #[serde(flatten)]
    pub timeout: ConfirmTimeout,
    #[serde(flatten)]
    pub tls: TlsFiles,
    /// Approximate MAXLEN for each stream.
    pub maxlen: Option<usize>,
    /// How long an event id is remembered to drop redeliveries [default: 24h].
    #[serde(with = "crate::settings::duration")]
    pub dedupe_window: Duration,
}

/// Written out: a derived default would give the dedupe window 0s.
impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            timeout: ConfirmTimeout::default(),
            tls: TlsFiles::default(),
            maxlen: None,
            dedupe_window: DEFAULT_DEDUPE_WINDOW,
        }
    }
}

pub struct RedisSink {
    inner: Arc<Inner>,
}

struct Inner {
    client: redis::Client,
    connection: Mutex<Option<ConnectionManager>>,
    script: Script,
    maxlen: usize,
    window_secs: u64,
    timeout: Duration,
    shown: String,
}

impl RedisSink {
    pub fn new(uri: &str, config: &RedisConfig) -> Result<Self, SinkSetupError> {
        let shown = outbox_core::redact::redact_url(uri);
        if config.maxlen == Some(0) {
            // Redis's MAXLEN 0 empties the stream; here 0 meant unbounded, silently.
            return Err(SinkSetupError::config(
                "`maxlen` = 0: Redis would trim each stream to nothing; leave `maxlen` out for \
                 streams that are not trimmed, or give the entries to keep",
            ));
        }
        if config.dedupe_window < Duration::from_secs(1) {
            // Kept in whole seconds: a shorter window became a second, silently.
            return Err(SinkSetupError::config(format!(
                "`dedupe_window` = {:?}: it is kept in whole seconds, at least 1s",
                config.dedupe_window
            )));
        }
        let tls = &config.tls;
        let client = if tls.ca_file.is_some() || tls.cert_file.is_some() {
            let read = |path: &std::path::Path| {
                std::fs::read(path).map_err(|e| SinkSetupError::config(format!("cannot read {}: {e}", path.display())))
            };
            let root_cert = tls.ca_file.as_deref().map(read).transpose()?;
            let client_tls = match (&tls.cert_file, &tls.key_file) {
                (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
                    client_cert: read(cert)?,
                    client_key: read(key)?,
                }),
                _ => None,
            };
            redis::Client::build_with_tls(uri, redis::TlsCertificates { client_tls, root_cert })
        } else {
            redis::Client::open(uri)
        }
        .map_err(|e| SinkSetupError::config(format!("invalid Redis URI {shown}: {e}; use redis://host:port[/db] (rediss:// for TLS), with user info before the host where the server wants it")))?;
        Ok(RedisSink {
            inner: Arc::new(Inner {
                client,
                connection: Mutex::new(None),
                script: Script::new(APPEND_ONCE),
                maxlen: config.maxlen.unwrap_or(0),
                window_secs: config.dedupe_window.as_secs().max(1),
                timeout: config.timeout.get(),
                shown,
            }),
        })
    }
}

impl Inner {
    /// The shared connection, made on first use; it reconnects by itself afterwards.
    async fn connection(&self) -> Result<ConnectionManager, PublishError> {
        let mut slot = self.connection.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(Some(self.timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_secs(2));
        let mut manager = ConnectionManager::new_with_config(self.client.clone(), config)
            .await
            .map_err(|e| classify(e, &self.shown))?;
        // A cluster node answers keys of another node's slots with MOVED: every such event
        // failed as a broker failure until dead-lettered. Said once, at the connection.
        // A role allowed no INFO (least privilege), or a server with INFO renamed away
        // (`rename-command`, "unknown command"), cannot tell: it is not asked to.
        let info: String = match redis::cmd("INFO")
            .arg("cluster")
            .query_async(&mut manager)
            .await
        {
            Ok(info) => info,
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::Server(ServerErrorKind::NoPerm | ServerErrorKind::ResponseError)
                ) =>
            {
                String::new()
            }
            Err(e) => return Err(classify(e, &self.shown)),
        };
        if info.lines().any(|l| l.trim() == "cluster_enabled:1") {
            return Err(PublishError::new(
                PublishErrorKind::Unavailable,
                format!(
                    "{} is a Redis Cluster node: Redis Cluster is not supported; point the sink \
                     at a standalone server, or at the primary under a name that follows \
                     failovers",
                    self.shown
                ),
            ));
        }
        *slot = Some(manager.clone());
        Ok(manager)
    }
}

/// What a user of the sink may need granted: the script's commands, on the streams and the
/// de-duplication keys.
const GRANTS: &str = "grant the sink's Redis user +evalsha +script|load +get +set +xrange \
    +xadd on the streams' keys and ~outbox-relay:dedupe:*";

/// The one place Redis errors become publish outcomes, by the client's kind and, for the
/// server's replies the client has no kind for, by the reply's error code (its first word,
/// `WRONGTYPE`). One exception reads the text: Redis 7.0 refuses a command inside a script
/// for the user's ACL with the generic code `ERR`.
fn classify(error: RedisError, what: &str) -> PublishError {
    let refused_in_script = error.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
        && error
            .detail()
            .is_some_and(|d| d.contains("can't run this command"));
    if refused_in_script {
        return PublishError::new(
            PublishErrorKind::Unauthorized,
            format!("redis {what}: the user may not run a command of the relay's script; {GRANTS}"),
        )
        .with_source(error);
    }
    let kind = match error.kind() {
        ErrorKind::AuthenticationFailed => PublishErrorKind::Unauthorized,
        ErrorKind::Server(ServerErrorKind::NoPerm) => {
            return PublishError::new(
                PublishErrorKind::Unauthorized,
                format!("redis {what}: refused for the user's permissions; {GRANTS}"),
            )
            .with_source(error)
        }
        // The server was demoted (a failover): the connection is made again for the next
        // send, which finds the primary where the name now points.
        ErrorKind::Server(ServerErrorKind::ReadOnly) => {
            return PublishError::new(
                PublishErrorKind::Unavailable,
                format!(
                    "redis {what}: the server is a read-only replica; point the sink at the \
                     primary (a name that follows failovers)"
                ),
            )
            .with_source(error)
        }
        // The server's condition, the same for every event: loading its data, or a
        // failover under way.
        ErrorKind::Server(
            ServerErrorKind::BusyLoading
            | ServerErrorKind::TryAgain
            | ServerErrorKind::MasterDown
            | ServerErrorKind::ClusterDown,
        ) => PublishErrorKind::Unavailable,
        // Before `Io`: a timeout is of that kind too, and was reported as unavailable.
        _ if error.is_timeout() => PublishErrorKind::Timeout,
        ErrorKind::Io => PublishErrorKind::Unavailable,
        _ if error.is_connection_dropped() || error.is_connection_refusal() => {
            PublishErrorKind::Unavailable
        }
        ErrorKind::Extension => match error.code() {
            // A password the server requires and the URI does not give.
            Some("NOAUTH") => PublishErrorKind::Unauthorized,
            // The target key holds something other than a stream: the destination's
            // condition (an operator deletes or renames the key), not the event's.
            // Refused for good, every event sent there was dead-lettered at once.
            Some("WRONGTYPE") => {
                return PublishError::new(
                    PublishErrorKind::Unavailable,
                    format!(
                        "redis {what}: the target key holds another type than a stream: \
                         delete or rename that key, or route the events to another one"
                    ),
                )
                .with_source(error)
            }
            // Full: it refuses every write, not this event's alone.
            Some("OOM") => {
                return PublishError::new(
                    PublishErrorKind::Unavailable,
                    format!(
                        "redis {what}: the server is out of memory (used memory above \
                         maxmemory, and a policy that evicts none of the streams): set the \
                         sink's maxlen to trim them, raise maxmemory, or let the consumers \
                         catch up"
                    ),
                )
                .with_source(error)
            }
            // Busy running another client's script.
            Some("BUSY") => PublishErrorKind::Unavailable,
            _ => PublishErrorKind::BrokerFailure,
        },
        // The rest: the server may recover.
        _ => PublishErrorKind::BrokerFailure,
    };
    PublishError::new(kind, format!("redis {what}")).with_source(error)
}

impl Sink for RedisSink {
    fn messaging_system(&self) -> Option<&'static str> {
        Some("redis")
    }

    fn describe(&self) -> String {
        self.inner.shown.clone()
    }

    fn send(&self, batch: Vec<Routed>) -> BoxFuture<'static, Vec<Outcome>> {
        let inner = self.inner.clone();
        async move {
            let script = &inner.script;
            let (maxlen, window, shown) = (inner.maxlen, inner.window_secs, &inner.shown);
            let connection = match inner.connection().await {
                Ok(c) => c,
                Err(e) => return fail_all(&batch, &e),
            };
            let demoted = std::sync::atomic::AtomicBool::new(false);
            let demoted = &demoted;
            let appends = batch.iter().map(|routed| {
                let mut connection = connection.clone();
                let event = &routed.event;
                let mut invocation = script.key(&routed.target);
                invocation
                    .key(format!(
                        "outbox-relay:dedupe:{{{}}}:{}",
                        routed.target, event.event_id
                    ))
                    .arg(window)
                    .arg(maxlen)
                    .arg("event_id")
                    .arg(event.event_id.to_string())
                    .arg("sequence_id")
                    .arg(event.sequence_id)
                    .arg("destination")
                    .arg(&event.destination)
                    .arg("type")
                    .arg(&event.event_type)
                    .arg("key")
                    .arg(event.ordering_key())
                    .arg("headers")
                    .arg(serde_json::to_string(&event.headers).unwrap_or_else(|_| "{}".into()))
                    .arg("payload")
                    .arg(event.payload.as_bytes());
                if let Some(m) = &event.mutation_id {
                    invocation.arg("mutation_id").arg(m);
                }
                for (name, value) in crate::trace::trace_fields(event) {
                    invocation.arg(name).arg(value);
                }
                async move {
                    invocation
                        .invoke_async::<Option<String>>(&mut connection)
                        .await
                        .map(|_| ())
                        .map_err(|e| {
                            if e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly) {
                                demoted.store(true, std::sync::atomic::Ordering::Relaxed);
                            }
                            classify(e, shown)
                        })
                }
            });
            let outcomes = join_all(appends).await;
            if demoted.load(std::sync::atomic::Ordering::Relaxed) {
                // READONLY keeps the connection open: made again, it finds the primary.
                *inner.connection.lock().await = None;
            }
            outcomes
        }
        .boxed()
    }

    fn health(&self) -> BoxFuture<'static, Result<(), PublishError>> {
        let client = self.inner.client.clone();
        let shown = self.inner.shown.clone();
        async move {
            let mut c = tokio::time::timeout(
                Duration::from_secs(2),
                client.get_multiplexed_async_connection(),
            )
            .await
            .map_err(|_| {
                PublishError::new(PublishErrorKind::Timeout, format!("{shown}: no answer"))
            })?
            .map_err(|e| classify(e, &shown))?;
            match redis::cmd("PING").query_async::<String>(&mut c).await {
                Ok(_) => Ok(()),
                // The server answered, and the user is logged in: a role allowed no PING
                // (least privilege) is not sick. It failed `/readyz` while every event went
                // out; a refusal the publishes meet shows in their outcomes.
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoPerm) => Ok(()),
                Err(e) => Err(classify(e, &shown)),
            }
        }
        .boxed()
    }
}

pub fn sink(uri: &str, config: &RedisConfig) -> Result<Arc<dyn Sink>, SinkSetupError> {
    Ok(Arc::new(RedisSink::new(uri, config)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_maxlen_of_zero_and_a_window_under_a_second_are_refused() {
        let refused = |config: RedisConfig| match RedisSink::new("redis://127.0.0.1:6379", &config)
        {
            Err(e) => e.to_string(),
            Ok(_) => panic!("accepted"),
        };
        let err = refused(RedisConfig {
            maxlen: Some(0),
            ..RedisConfig::default()
        });
        assert!(err.contains("`maxlen` = 0"), "{err}");
        let err = refused(RedisConfig {
            dedupe_window: Duration::from_millis(500),
            ..RedisConfig::default()
        });
        assert!(err.contains("at least 1s"), "{err}");
        assert!(RedisSink::new("redis://127.0.0.1:6379", &RedisConfig::default()).is_ok());
    }
}
