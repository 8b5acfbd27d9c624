//! NATS JetStream: `Nats-Msg-Id` = event id, so the stream's duplicate window drops
//! redeliveries; each event is confirmed by its PubAck.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::context::PublishErrorKind as JsKind;
use async_nats::jetstream::message::PublishMessage;
use async_nats::{HeaderMap, HeaderName, HeaderValue, ServerAddr};
use bytes::Bytes;
use futures::future::{join_all, BoxFuture};
use futures::FutureExt;
use outbox_core::{Outcome, PublishError, PublishErrorKind};

use serde::{Deserialize, Serialize};

use crate::error::SinkSetupError;
use crate::settings::{ConfirmTimeout, TlsFiles};
use crate::sink::{Routed, Sink};
use outbox_core::redact::Secret;

/// JetStream's command headers an event's own headers may not carry.
const REFUSED_FROM_EVENTS: [&str; 3] = ["Nats-Rollup", "Nats-TTL", "Nats-Msg-Id"];

/// Header names the relay sets besides `Nats-Msg-Id` and the event's own headers.
pub const HEADER_EVENT_TYPE: &str = "Outbox-Event-Type";
pub const HEADER_PARTITION_KEY: &str = "Outbox-Partition-Key";
pub const HEADER_SEQUENCE_ID: &str = "Outbox-Sequence-Id";
pub const HEADER_MUTATION_ID: &str = "Outbox-Mutation-Id";

/// A NATS sink's own settings (`[sinks.NAME]` with a `nats://` or `tls://` URI).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct NatsConfig {
    #[serde(flatten)]
    pub timeout: ConfirmTimeout,
    #[serde(flatten)]
    pub tls: TlsFiles,
    /// A credentials file (JWT + nkey seed).
    pub creds_file: Option<PathBuf>,
    /// A file holding an nkey seed.
    pub nkey_seed_file: Option<PathBuf>,
    /// A token (prefer the URI's user info, or an environment variable).
    pub token: Option<Secret>,
}

/// How long a subject found without a stream fails at once, without a publish, before the
/// next event to it is published again (a stream created meanwhile is then found).
pub const MISSING_STREAM_RECHECK: Duration = Duration::from_secs(1);

pub struct NatsSink {
    client: async_nats::Client,
    jetstream: async_nats::jetstream::Context,
    shown: String,
    /// Subjects whose last publish found no stream, and when.
    missing_streams: Arc<Mutex<HashMap<String, Instant>>>,
    /// What the server refused this connection lately (see [`Refusals`]).
    refusals: Arc<Mutex<Refusals>>,
    /// What was said of the connection, and its last error (see [`Link`]).
    link: Arc<Mutex<Link>>,
}

/// The connection as the relay tells it. The client reports every reconnect attempt, and
/// logged each at INFO: a host that does not resolve filled `check`'s output and the log
/// with a line a second. A loss is said once, with its error, and the return once; `health`
/// names the last error.
#[derive(Debug, Default)]
struct Link {
    last_error: Option<String>,
    said_lost: bool,
}

impl Link {
    fn note(&mut self, event: &async_nats::Event, shown: &str) {
        match event {
            async_nats::Event::Connected => {
                if self.said_lost {
                    tracing::info!(sink = shown, "NATS connection restored");
                }
                *self = Link::default();
            }
            async_nats::Event::Disconnected if !self.said_lost => {
                self.said_lost = true;
                tracing::warn!(sink = shown, "NATS connection lost; reconnecting");
            }
            async_nats::Event::ClientError(e) => {
                let error = outbox_core::redact::redact_url(&e.to_string());
                if !self.said_lost {
                    self.said_lost = true;
                    tracing::warn!(sink = shown, %error, "cannot reach NATS; retrying");
                }
                self.last_error = Some(error);
            }
            _ => {}
        }
    }
}

/// The permissions violations the server reported on the connection. NATS reports them
/// there (`-ERR 'Permissions Violation for Publish to "x"'`), not with the publish, whose
/// PubAck then never comes: without these, a subject or reply inbox the relay's user may not
/// use was seen only as "no PubAck in time", at every attempt.
#[derive(Debug, Default)]
struct Refusals {
    /// Subjects whose publish was refused, and when: the latest [`Refusals::KEPT`].
    publishes: VecDeque<(String, Instant)>,
    /// The reply inbox the server refused to subscribe the relay to, on this connection:
    /// no PubAck reaches the relay until a new connection subscribes again.
    inbox: Option<String>,
}

impl Refusals {
    const KEPT: usize = 64;

    /// Takes note of the server's error `text`, if it is a permissions violation.
    fn note(&mut self, text: &str, at: Instant) {
        let lower = text.to_ascii_lowercase();
        let quoted = |prefix: &str| {
            lower
                .starts_with(prefix)
                .then(|| text[prefix.len()..].trim().trim_matches('"').to_string())
        };
        if let Some(subject) = quoted("permissions violation for publish to ") {
            self.publishes.retain(|(s, _)| *s != subject);
            if self.publishes.len() == Self::KEPT {
                self.publishes.pop_front();
            }
            self.publishes.push_back((subject, at));
        } else if let Some(subject) = quoted("permissions violation for subscription to ") {
            if subject.starts_with("_INBOX.") {
                self.inbox = Some(subject);
            }
        }
    }

    /// Whether a publish to `subject` was refused at or after `since`.
    fn refused_publish(&self, subject: &str, since: Instant) -> bool {
        self.publishes
            .iter()
            .any(|(s, at)| s == subject && *at >= since)
    }
}

impl NatsSink {
    pub async fn connect(uri: &str, config: &NatsConfig) -> Result<Self, SinkSetupError> {
        let addr: ServerAddr = uri.parse().map_err(|e| {
            SinkSetupError::config(format!(
                "invalid NATS URI: {e}; use nats://host:port (with user info before the host where the server wants it)"
            ))
        })?;
        // `nats://` alone parses, to a host of nothing that is reconnected to for good.
        if addr.host().is_empty() {
            return Err(SinkSetupError::config(
                "the NATS URI names no host; use nats://host:port (with user info before the host where the server wants it)",
            ));
        }
        // async-nats reads no credentials from the URI itself: its user info is taken here.
        let decoded = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8_lossy()
                .into_owned()
        };
        let user_info = addr
            .username()
            .map(|user| (decoded(user), addr.password().map(decoded)));
        let given = [
            config.creds_file.is_some().then_some("creds_file"),
            config.nkey_seed_file.is_some().then_some("nkey_seed_file"),
            config.token.is_some().then_some("token"),
            user_info.is_some().then_some("the URI's user info"),
        ];
        let given: Vec<&str> = given.into_iter().flatten().collect();
        if given.len() > 1 {
            // The first would win and the others be ignored.
            return Err(SinkSetupError::config(format!(
                "{} are each a way to authenticate to NATS: give one",
                given.join(" and ")
            )));
        }
        let mut options = match (&config.creds_file, &config.nkey_seed_file, &config.token) {
            (Some(path), _, _) => async_nats::ConnectOptions::with_credentials_file(path)
                .await
                .map_err(|e| {
                    SinkSetupError::config(format!(
                        "cannot read NATS creds file {}: {e}",
                        path.display()
                    ))
                })?,
            (None, Some(path), _) => {
                let seed = std::fs::read_to_string(path).map_err(|e| {
                    SinkSetupError::config(format!(
                        "cannot read NATS nkey seed file {}: {e}",
                        path.display()
                    ))
                })?;
                // Checked here: async-nats takes any text, and its connects then failed for
                // good, each saying only that no key pair was made.
                if let Err(e) = nkeys::KeyPair::from_seed(seed.trim()) {
                    return Err(SinkSetupError::config(format!(
                        "the NATS nkey seed file {} holds no nkey seed ({e}): put the user's \
                         seed in it (one line beginning SU, as `nsc` or `nk -gen user` \
                         writes it)",
                        path.display()
                    )));
                }
                async_nats::ConnectOptions::with_nkey(seed.trim().to_string())
            }
            (None, None, Some(token)) => {
                async_nats::ConnectOptions::with_token(token.expose().to_string())
            }
            (None, None, None) => match user_info {
                Some((user, Some(password))) => {
                    async_nats::ConnectOptions::with_user_and_password(user, password)
                }
                // `nats://TOKEN@host`: a lone user info part is a token.
                Some((token, None)) => async_nats::ConnectOptions::with_token(token),
                None => async_nats::ConnectOptions::new(),
            },
        };
        if let Some(ca) = &config.tls.ca_file {
            options = options.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let (Some(cert), Some(key)) = (&config.tls.cert_file, &config.tls.key_file) {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        if uri.starts_with("tls://") {
            options = options.require_tls(true);
        }
        let shown = format!("nats://{}:{}", addr.host(), addr.port());
        let refusals: Arc<Mutex<Refusals>> = Arc::default();
        let noted = refusals.clone();
        let link: Arc<Mutex<Link>> = Arc::default();
        let (linked, said) = (link.clone(), shown.clone());
        let client = options
            .event_callback(move |event| {
                linked
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .note(&event, &said);
                let mut refusals = noted.lock().expect("not poisoned");
                match event {
                    async_nats::Event::ServerError(async_nats::ServerError::Other(text)) => {
                        refusals.note(&text, Instant::now())
                    }
                    // A new connection subscribes its reply inbox again.
                    async_nats::Event::Connected => refusals.inbox = None,
                    _ => {}
                }
                std::future::ready(())
            })
            .name("outbox-relay")
            .connection_timeout(Duration::from_secs(5))
            // A broker that is down at start is retried in the background, like a dropped one.
            .retry_on_initial_connect()
            .connect(addr)
            .await
            .map_err(|e| classify_connect(e, &shown))?;
        let jetstream = async_nats::jetstream::ContextBuilder::new()
            .timeout(config.timeout.get())
            // The engine's `max_in_flight` bounds what is in flight. A bound of the client's
            // own below it stalled: a batch's acks are awaited once all of it is sent, so
            // its send past the bound waited for a permit only those acks could free.
            .max_ack_inflight(UNBOUNDED_ACKS_IN_FLIGHT)
            .backpressure_on_inflight(true)
            .build(client.clone());
        // A server without JetStream refuses every event the same way: said once, here.
        // (A server not reached yet is left to the publishes, which retry.)
        if connected_within(&client, Duration::from_secs(2)).await {
            if let Err(e) = jetstream.query_account().await {
                if jetstream_disabled(&e) {
                    return Err(SinkSetupError::config(format!(
                        "{shown} has no JetStream for the relay's account, and the NATS sink \
                         publishes to JetStream streams: start nats-server with -js (or enable \
                         JetStream for the account)"
                    ))
                    .with_source(e));
                }
            }
        }
        Ok(NatsSink {
            client,
            jetstream,
            shown,
            missing_streams: Arc::default(),
            refusals,
            link,
        })
    }
}

/// Whether the server answered that JetStream is off (no responders on its API, or the
/// account's 503 "JetStream not enabled"), not merely slow.
fn jetstream_disabled(error: &async_nats::jetstream::context::AccountError) -> bool {
    use async_nats::jetstream::context::AccountErrorKind as K;
    match error.kind() {
        K::JetStreamUnavailable => true,
        K::JetStream(e) => e.code() == 503,
        _ => false,
    }
}

/// The one place a failed NATS connection becomes a set-up error, by the client's kind.
fn classify_connect(error: async_nats::ConnectError, shown: &str) -> SinkSetupError {
    use async_nats::ConnectErrorKind as K;
    let message = match error.kind() {
        K::ServerParse => format!("invalid NATS server address {shown}"),
        K::Tls => format!("TLS set-up for {shown} failed: check the tls_* files"),
        K::Authentication | K::AuthorizationViolation => format!(
            "{shown} refused the relay's credentials: check the URI's user info, creds_file, \
             nkey_seed_file or token"
        ),
        K::Dns | K::TimedOut | K::Io | K::MaxReconnects => {
            return SinkSetupError::unavailable(format!("cannot connect to {shown}"))
                .with_source(error)
        }
    };
    SinkSetupError::config(message).with_source(error)
}

/// The event's headers as NATS carries them: text lines, so a name is printable ASCII
/// without ':' and a value has no line break. An event with anything else is refused for
/// good, naming what NATS cannot carry (the client would otherwise abort the process).
fn headers_for(routed: &Routed) -> Result<HeaderMap, PublishError> {
    let event = &routed.event;
    let sequence_id = event.sequence_id.to_string();
    // JetStream reads some headers as commands: `Nats-Rollup` purges the subject's (or the
    // stream's) earlier messages, acknowledged events of other keys among them; `Nats-TTL`
    // expires the message; `Nats-Msg-Id` is the relay's id stamp. An event's own is refused,
    // naming it (`Nats-Expected-*`, a writer's guard, goes as given).
    if let Some(name) = event.headers.keys().find(|name| {
        REFUSED_FROM_EVENTS
            .iter()
            .any(|r| r.eq_ignore_ascii_case(name))
    }) {
        return Err(PublishError::new(
            PublishErrorKind::Encoding,
            format!(
                "the event's header {name} is a JetStream command (a rollup would purge the \
                 stream's earlier messages, a TTL expire the event, a message id replace the \
                 relay's), which the relay does not pass on from events; rename it in the \
                 event's headers"
            ),
        ));
    }
    let own = [
        HEADER_EVENT_TYPE,
        HEADER_SEQUENCE_ID,
        HEADER_PARTITION_KEY,
        HEADER_MUTATION_ID,
    ];
    // An event's header of a relay header's name, in another case, would travel beside it.
    let mut fields: Vec<(&str, &str)> = event
        .headers
        .iter()
        .filter(|(name, _)| !own.iter().any(|o| o.eq_ignore_ascii_case(name)))
        .map(|(name, value)| (name.as_str(), value.as_str()))
        .collect();
    fields.push((HEADER_EVENT_TYPE, event.event_type.as_str()));
    fields.push((HEADER_SEQUENCE_ID, sequence_id.as_str()));
    if let Some(key) = &event.partition_key {
        fields.push((HEADER_PARTITION_KEY, key.as_str()));
    }
    if let Some(mutation) = &event.mutation_id {
        fields.push((HEADER_MUTATION_ID, mutation.as_str()));
    }
    let mut headers = HeaderMap::new();
    for (name, value) in fields {
        let parsed_name = (!name.is_empty())
            .then(|| HeaderName::from_str(name).ok())
            .flatten();
        let Some(parsed_name) = parsed_name else {
            return Err(PublishError::new(
                PublishErrorKind::Encoding,
                format!(
                    "header name {name:?} cannot travel as a NATS header (printable ASCII \
                     without ':' or spaces); rename it in the event's headers"
                ),
            ));
        };
        let Ok(parsed_value) = HeaderValue::from_str(value) else {
            return Err(PublishError::new(
                PublishErrorKind::Encoding,
                format!(
                    "the value of NATS header {name} has a line break, which a NATS header \
                     cannot carry; remove it from the event's {name}"
                ),
            ));
        };
        headers.insert(parsed_name, parsed_value);
    }
    Ok(headers)
}

/// Why `subject` cannot be published to, if it cannot: NATS subjects are dot-separated
/// tokens with no whitespace.
fn subject_problem(subject: &str) -> Option<PublishError> {
    let malformed = subject.is_empty()
        || subject.contains(char::is_whitespace)
        || subject.starts_with('.')
        || subject.ends_with('.')
        || subject.contains("..")
        // A wildcard token: JetStream stored the event under the literal `a.*`, which no
        // subscriber of a concrete subject matches, and the relay took its PubAck for
        // delivery.
        || subject.split('.').any(|token| token == "*" || token == ">");
    malformed.then(|| {
        PublishError::new(
            PublishErrorKind::Rejected,
            format!(
                "{subject:?} is not a NATS subject to publish to (dot-separated tokens, no \
                 spaces, tabs or line breaks, no `*` or `>` wildcard); publish such \
                 destinations under a valid subject with a [[routes]] entry's target"
            ),
        )
    })
}

/// What a subject addresses when it is one of the server's own: JetStream's API
/// (`$JS.API.STREAM.DELETE.X` deletes a stream), the system account's, key-value and
/// object stores' (`$KV.`, `$O.`: a write to a bucket), or a client's reply inbox.
fn api_subject(subject: &str) -> Option<&'static str> {
    const RESERVED: [(&str, &str); 5] = [
        ("$JS.", "NATS's JetStream API"),
        ("$SYS.", "NATS's system account"),
        ("$KV.", "a NATS key-value bucket"),
        ("$O.", "a NATS object store"),
        ("_INBOX.", "a NATS client's reply inbox"),
    ];
    RESERVED
        .iter()
        .find(|(prefix, _)| subject.starts_with(prefix))
        .map(|(_, what)| *what)
}

/// Waits up to `limit` for the connection (at start-up, or while reconnecting), so a batch
/// fails fast when NATS is down instead of waiting out every ack timeout.
async fn connected_within(client: &async_nats::Client, limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if client.connection_state() == async_nats::connection::State::Connected {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The failure of an event whose subject no JetStream stream captures (retried: the stream
/// may be created later).
fn no_stream(subject: &str) -> PublishError {
    PublishError::new(
        PublishErrorKind::MissingTarget,
        format!("no JetStream stream captures subject {subject:?}; create a stream for it (e.g. `nats stream add --subjects '{subject}'`)"),
    )
}

/// Why publishes sent since `sent` timed out, where the server said: it refused the
/// relay's user the subject or the reply inbox (see [`Refusals`]), or the subject's stream is
/// set to `no_ack` (it stores the message and answers nothing). Each was told only as "no
/// PubAck in time", at every attempt; their errors now name the cause and the fix. The stream
/// lookup is made for a few subjects of the batch at most, and only when some timed out.
async fn explain_unanswered(
    client: &async_nats::Client,
    jetstream: &async_nats::jetstream::Context,
    refusals: &Mutex<Refusals>,
    sent: Instant,
    batch: &[Routed],
    outcomes: &mut [Outcome],
) {
    let mut looked_up: Vec<(String, Option<String>)> = Vec::new();
    let mut deaf = false;
    for (outcome, routed) in outcomes.iter_mut().zip(batch) {
        if !outcome
            .as_ref()
            .is_err_and(|e| e.kind() == PublishErrorKind::Timeout)
        {
            continue;
        }
        let subject = &routed.target;
        let (refused, inbox) = {
            let refusals = refusals.lock().expect("not poisoned");
            (
                refusals.refused_publish(subject, sent),
                refusals.inbox.clone(),
            )
        };
        if refused {
            *outcome = Err(PublishError::new(
                PublishErrorKind::Unauthorized,
                format!(
                    "the NATS server refused the relay's publish to {subject:?} (permissions \
                     violation): allow the relay's user to publish to it in the server's \
                     authorization, or route the destination to a subject it may publish to"
                ),
            ));
            continue;
        }
        if let Some(inbox) = inbox {
            deaf = true;
            *outcome = Err(PublishError::new(
                PublishErrorKind::Unauthorized,
                format!(
                    "no PubAck for {subject:?} can reach the relay: the NATS server refused \
                     its subscription to its reply inbox {inbox:?} (permissions violation); \
                     allow the relay's user to subscribe to _INBOX.> in the server's \
                     authorization"
                ),
            ));
            continue;
        }
        let known = looked_up
            .iter()
            .find(|(s, _)| s == subject)
            .map(|(_, n)| n.clone());
        let silent = match known {
            Some(silent) => silent,
            None if looked_up.len() < 4 => {
                let silent = tokio::time::timeout(Duration::from_secs(2), async {
                    let name = jetstream.stream_by_subject(subject.as_str()).await.ok()?;
                    let stream = jetstream.get_stream(&name).await.ok()?;
                    stream.cached_info().config.no_ack.then_some(name)
                })
                .await
                .ok()
                .flatten();
                looked_up.push((subject.clone(), silent.clone()));
                silent
            }
            None => None,
        };
        if let Some(stream) = silent {
            *outcome = Err(PublishError::new(
                PublishErrorKind::Timeout,
                format!(
                    "no PubAck for {subject:?}: its stream {stream:?} is set to no_ack, so it \
                     confirms nothing and the relay cannot know what it stored; turn no_ack \
                     off in the stream's configuration"
                ),
            ));
        }
    }
    // The refused subscription is not tried again on this connection: a new one picks up a
    // permission granted meanwhile (a reload of the server's configuration keeps
    // connections).
    if deaf {
        if let Err(e) = client.force_reconnect().await {
            tracing::debug!(error = %e, "NATS reconnect after a refused reply inbox failed");
        }
    }
}

/// The one place NATS errors become publish outcomes.
fn classify(error: async_nats::jetstream::context::PublishError, subject: &str) -> PublishError {
    let (kind, message) = match error.kind() {
        JsKind::StreamNotFound => return no_stream(subject).with_source(error),
        JsKind::MaxPayloadExceeded => (
            PublishErrorKind::TooLarge,
            format!("message for {subject:?} exceeds the server's max_payload"),
        ),
        JsKind::TimedOut => (
            PublishErrorKind::Timeout,
            format!("no PubAck for {subject:?} in time"),
        ),
        JsKind::BrokenPipe => (
            PublishErrorKind::Unavailable,
            "connection to NATS lost".to_string(),
        ),
        JsKind::MaxAckPending => (
            PublishErrorKind::Throttled,
            "too many unconfirmed publishes".to_string(),
        ),
        // JetStream's own refusals carry an HTTP-like status: 401/403 are permissions, 400
        // the message's own (over the stream's max_msg_size, a header the stream refuses):
        // sending it again gets the same answer.
        _ if matches!(jetstream_status(&error), Some((401 | 403, _))) => (
            PublishErrorKind::Unauthorized,
            format!("not allowed to publish to {subject:?}"),
        ),
        _ if matches!(jetstream_status(&error), Some((400, _))) => match jetstream_status(&error) {
            Some((_, STREAM_MESSAGE_EXCEEDS_MAXIMUM)) => (
                PublishErrorKind::TooLarge,
                format!("message for {subject:?} exceeds its stream's max_msg_size"),
            ),
            // The account's JetStream storage is full: its condition, not the message's,
            // as a full stream's 503 is. Dead-lettering emptied the outbox until space came.
            Some((_, ACCOUNT_RESOURCES_EXCEEDED)) => (
                PublishErrorKind::Throttled,
                format!(
                    "the account's JetStream storage is full, publishing to {subject:?}: free \
                     space or raise the account's max_file/max_mem limits"
                ),
            ),
            // Sealed by an operator, who may unseal it (or make another stream): the
            // stream's condition. Dead-lettering emptied the outbox of its subjects.
            Some((_, STREAM_SEALED)) => (
                PublishErrorKind::Unavailable,
                format!(
                    "the stream capturing {subject:?} is sealed and takes no message: unseal \
                     it, or route the subject to another stream"
                ),
            ),
            _ => (
                PublishErrorKind::Rejected,
                format!("the stream capturing {subject:?} refused the message"),
            ),
        },
        // A stream at its max_msgs, max_bytes or max_msgs_per_subject with discard = new
        // refuses new messages until it has room: its condition, said with the fix.
        _ if matches!(jetstream_status(&error), Some((503, STREAM_STORE_FAILED))) => (
            PublishErrorKind::Throttled,
            format!(
                "the stream capturing {subject:?} refused to store the message, most often \
                 because it is full (its max_msgs, max_bytes or max_msgs_per_subject reached, \
                 with discard = new): raise the limit, let consumers free room (work-queue \
                 retention, max_age), or use discard = old"
            ),
        ),
        _ => (
            PublishErrorKind::BrokerFailure,
            format!("publish to {subject:?} failed"),
        ),
    };
    PublishError::new(kind, message).with_source(error)
}

/// As many unconfirmed publishes as tokio's semaphore can count: no bound of the client's.
const UNBOUNDED_ACKS_IN_FLIGHT: usize = usize::MAX >> 4;

/// JetStream's error code for a message its stream could not store, with status 503: a
/// full stream's "maximum messages exceeded" or "maximum bytes exceeded" among others.
const STREAM_STORE_FAILED: u64 = 10077;

/// JetStream's error code for a sealed stream ("invalid operation on sealed stream").
const STREAM_SEALED: u64 = 10109;

/// JetStream's error code for an account over its storage limits ("resource limits
/// exceeded for account").
const ACCOUNT_RESOURCES_EXCEEDED: u64 = 10002;

/// JetStream's error code for a message over its stream's `max_msg_size`.
const STREAM_MESSAGE_EXCEEDS_MAXIMUM: u64 = 10054;

/// The status and JetStream error code of the API error behind a failed publish, if the
/// server sent one.
fn jetstream_status(error: &async_nats::jetstream::context::PublishError) -> Option<(usize, u64)> {
    std::error::Error::source(error)?
        .downcast_ref::<async_nats::jetstream::Error>()
        .map(|e| (e.code(), e.error_code().0))
}

impl Sink for NatsSink {
    fn messaging_system(&self) -> Option<&'static str> {
        Some("nats")
    }

    fn reserved_target(&self, target: &str) -> Option<&'static str> {
        api_subject(target)
    }

    fn cloudevents_binding(&self) -> Option<crate::cloudevents::Binding> {
        Some(crate::cloudevents::Binding::Nats)
    }

    fn describe(&self) -> String {
        self.shown.clone()
    }

    fn send(&self, batch: Vec<Routed>) -> BoxFuture<'static, Vec<Outcome>> {
        let jetstream = self.jetstream.clone();
        let client = self.client.clone();
        let missing_streams = self.missing_streams.clone();
        let refusals = self.refusals.clone();
        async move {
            let sent = Instant::now();
            if !connected_within(&client, Duration::from_secs(2)).await {
                return batch
                    .iter()
                    .map(|_| {
                        Err(PublishError::new(
                            PublishErrorKind::Unavailable,
                            "not connected to NATS; reconnecting",
                        ))
                    })
                    .collect();
            }
            // Subjects found without a stream a moment ago fail at once, not once per event.
            let known_missing: HashSet<String> = {
                let mut missing = missing_streams.lock().expect("not poisoned");
                missing.retain(|_, found| found.elapsed() < MISSING_STREAM_RECHECK);
                missing.keys().cloned().collect()
            };
            // Send every message first, then await the acks: the whole batch is in flight.
            let mut pending = Vec::with_capacity(batch.len());
            for routed in &batch {
                if known_missing.contains(&routed.target) {
                    pending.push(Err(no_stream(&routed.target)));
                    continue;
                }
                if let Some(problem) = subject_problem(&routed.target) {
                    pending.push(Err(problem));
                    continue;
                }
                let headers = match headers_for(routed) {
                    Ok(headers) => headers,
                    Err(problem) => {
                        pending.push(Err(problem));
                        continue;
                    }
                };
                let message = PublishMessage::build()
                    .payload(Bytes::copy_from_slice(routed.event.payload.as_bytes()))
                    .headers(headers)
                    .message_id(routed.event.event_id.hyphenated().to_string());
                let sent = jetstream.send_publish(routed.target.clone(), message).await;
                pending.push(Ok(sent));
            }
            let acks = pending
                .into_iter()
                .zip(&batch)
                .map(|(sent, routed)| async move {
                    match sent {
                        Err(refused) => Err(refused),
                        Ok(Ok(ack)) => ack
                            .await
                            .map(|_| ())
                            .map_err(|e| classify(e, &routed.target)),
                        Ok(Err(e)) => Err(classify(e, &routed.target)),
                    }
                });
            let mut outcomes = join_all(acks).await;
            explain_unanswered(&client, &jetstream, &refusals, sent, &batch, &mut outcomes).await;
            let now = Instant::now();
            let mut missing = missing_streams.lock().expect("not poisoned");
            for (outcome, routed) in outcomes.iter().zip(&batch) {
                let no_stream = outcome
                    .as_ref()
                    .is_err_and(|e| e.kind() == PublishErrorKind::MissingTarget);
                if no_stream && !known_missing.contains(&routed.target) {
                    missing.insert(routed.target.clone(), now);
                }
            }
            outcomes
        }
        .boxed()
    }

    fn health(&self) -> BoxFuture<'static, Result<(), PublishError>> {
        let client = self.client.clone();
        let shown = self.shown.clone();
        let last_error = (self.link.lock().unwrap_or_else(|e| e.into_inner()))
            .last_error
            .clone();
        async move {
            match (client.connection_state(), last_error) {
                (async_nats::connection::State::Connected, _) => Ok(()),
                (state, error) => Err(PublishError::new(
                    PublishErrorKind::Unavailable,
                    match error {
                        Some(error) => format!("{shown} is {state:?}, the last attempt: {error}"),
                        None => format!("{shown} is {state:?}"),
                    },
                )),
            }
        }
        .boxed()
    }

    fn max_message_bytes(&self) -> Option<usize> {
        let max = self.client.server_info().max_payload;
        (max > 0).then_some(max)
    }

    fn close(&self) -> BoxFuture<'static, ()> {
        let client = self.client.clone();
        async move {
            // A flush waits for a connection: while NATS is unreachable it would never
            // return, and there is nothing buffered worth waiting for (every event the sink
            // has not confirmed is delivered again from the outbox).
            if client.connection_state() == async_nats::connection::State::Connected {
                let _ = client.flush().await;
            }
        }
        .boxed()
    }
}

/// Builds the sink behind an `Arc`.
pub async fn sink(uri: &str, config: &NatsConfig) -> Result<Arc<dyn Sink>, SinkSetupError> {
    Ok(Arc::new(NatsSink::connect(uri, config).await?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_nats::jetstream::context::PublishError as JsError;
    use async_nats::ConnectErrorKind as K;

    #[test]
    fn subjects_no_publish_can_use_are_refused_and_others_pass() {
        for bad in ["", "a b", ".a", "a.", "a..b", "a.*", ">", "a.>.b", "*"] {
            assert!(subject_problem(bad).is_some(), "{bad:?}");
        }
        for good in ["a", "a.b", "a.b*", "a>.b", "orders.eu-1", "a_*x"] {
            assert!(subject_problem(good).is_none(), "{good:?}");
        }
    }

    #[test]
    fn permissions_violations_are_noted_by_subject_and_time() {
        let mut r = Refusals::default();
        let before = Instant::now();
        r.note(r#"Permissions Violation for Publish to "orders.x""#, before);
        r.note(
            r#"permissions violation for subscription to "_INBOX.abc.*""#,
            before,
        );
        r.note("Maximum Payload Violation", before);
        r.note(
            r#"Permissions Violation for Subscription to "other.>""#,
            before,
        );
        assert!(r.refused_publish("orders.x", before));
        assert!(!r.refused_publish("orders.y", before));
        let later = before + Duration::from_millis(1);
        assert!(
            !r.refused_publish("orders.x", later),
            "a refusal before the batch was sent is not this batch's"
        );
        assert_eq!(r.inbox.as_deref(), Some("_INBOX.abc.*"));
        for i in 0..Refusals::KEPT + 1 {
            r.note(
                &format!(r#"Permissions Violation for Publish to "s.{i}""#),
                later,
            );
        }
        assert_eq!(r.publishes.len(), Refusals::KEPT, "bounded");
        assert!(!r.refused_publish("orders.x", before));
    }

    #[test]
    fn the_servers_own_subjects_are_named() {
        for (subject, what) in [
            ("$JS.API.STREAM.DELETE.X", "JetStream"),
            ("$SYS.REQ.SERVER.PING", "system account"),
            ("$KV.config.key", "key-value"),
            ("$O.files.C.x", "object store"),
            ("_INBOX.abc", "reply inbox"),
        ] {
            let said = api_subject(subject).unwrap_or_default();
            assert!(said.contains(what), "{subject}: {said:?}");
        }
        for subject in [
            "orders.created",
            "JS.API.x",
            "x.$JS.API",
            "$JSorders",
            "_INBOXES.x",
        ] {
            assert_eq!(api_subject(subject), None, "{subject}");
        }
    }

    /// JetStream's control headers from an event are refused (a `Nats-Rollup` purged the
    /// stream's earlier messages), and an event's header of a relay header's name does not
    /// travel beside the relay's.
    #[test]
    fn an_events_control_headers_are_refused_and_the_relays_own_win() {
        let routed = |headers: &[(&str, &str)]| {
            let mut event = (*outbox_testkit_event()).clone();
            for (name, value) in headers {
                event.headers.insert((*name).into(), (*value).into());
            }
            Routed {
                cloudevents: None,
                event: std::sync::Arc::new(event),
                target: "orders".into(),
            }
        };
        for name in ["Nats-Rollup", "nats-ttl", "NATS-MSG-ID"] {
            let refused = headers_for(&routed(&[(name, "all")])).unwrap_err();
            assert_eq!(refused.kind(), PublishErrorKind::Encoding, "{name}");
            assert!(refused.to_string().contains(name), "{refused}");
        }
        let headers = headers_for(&routed(&[("outbox-sequence-id", "999")])).unwrap();
        let values: Vec<String> = headers
            .iter()
            .filter(|(name, _)| name.to_string().eq_ignore_ascii_case(HEADER_SEQUENCE_ID))
            .flat_map(|(_, values)| values.iter().map(|v| v.to_string()))
            .collect();
        assert_eq!(values, ["7"]);
    }

    fn outbox_testkit_event() -> std::sync::Arc<outbox_core::Event> {
        std::sync::Arc::new(outbox_core::Event::new(
            7,
            uuid::Uuid::nil(),
            "orders",
            "placed",
            outbox_core::Payload::Null,
        ))
    }

    #[test]
    fn connect_errors_are_classified_by_their_kind() {
        let kind = |k| classify_connect(async_nats::ConnectError::new(k), "nats://h:4222").kind();
        for k in [
            K::ServerParse,
            K::Tls,
            K::Authentication,
            K::AuthorizationViolation,
        ] {
            assert!(kind(k).is_config(), "{k:?}");
        }
        for k in [K::Dns, K::TimedOut, K::Io, K::MaxReconnects] {
            assert!(!kind(k).is_config(), "{k:?}");
        }
    }

    #[test]
    fn a_refused_publish_is_classified_by_the_jetstream_status() {
        let refusal = |code: usize| {
            let api: async_nats::jetstream::Error = serde_json::from_value(serde_json::json!({
                "code": code, "err_code": 10000, "description": "some server text"
            }))
            .unwrap();
            classify(JsError::with_source(JsKind::Other, api), "orders").kind()
        };
        assert_eq!(refusal(403), PublishErrorKind::Unauthorized);
        assert_eq!(refusal(401), PublishErrorKind::Unauthorized);
        assert_eq!(refusal(500), PublishErrorKind::BrokerFailure);
        assert_eq!(
            classify(JsError::new(JsKind::StreamNotFound), "orders").kind(),
            PublishErrorKind::MissingTarget
        );
    }
}
