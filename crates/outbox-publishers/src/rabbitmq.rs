//! RabbitMQ with publisher confirms: persistent messages, `message_id` = event id, the
//! event's headers, `mandatory` so an unroutable message comes back instead of vanishing.
//! A batch is published on one confirm-mode channel and its confirms awaited together.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::{join_all, BoxFuture};
use futures::FutureExt;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::Confirmation;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ErrorKind};
use outbox_core::{Outcome, Payload, PublishError, PublishErrorKind};
use tokio::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::error::SinkSetupError;
use crate::settings::ConfirmTimeout;
use crate::sink::{fail_all, Routed, Sink};
use crate::template::Template;

/// RabbitMQ's default `max_message_size` (128 MiB); a lower server limit is learned from
/// the broker's refusal.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 128 * 1024 * 1024;

/// How long a size limit learned from the broker's refusal stands before a message over it
/// is tried against the broker again: the broker's `max_message_size` can be raised while
/// the relay runs, and a limit kept for good dead-lettered, until a restart, messages the
/// broker by then accepted.
const LEARNED_LIMIT_KEPT: Duration = Duration::from_secs(300);

/// The broker's message size limit as learned from its refusals (pure state).
#[derive(Debug, Default)]
struct LearnedLimit {
    refused_over: Option<(usize, Instant)>,
}

impl LearnedLimit {
    fn learned(&mut self, limit: usize, now: Instant) {
        self.refused_over = Some((limit, now));
    }

    /// The limit messages are held to `now`: the learned one for [`LEARNED_LIMIT_KEPT`],
    /// then RabbitMQ's default again.
    fn current(&self, now: Instant) -> usize {
        match self.refused_over {
            Some((limit, at)) if now.saturating_duration_since(at) < LEARNED_LIMIT_KEPT => limit,
            _ => DEFAULT_MAX_MESSAGE_BYTES,
        }
    }
}

/// Why one message of a batch failed on its channel.
enum Failure {
    /// Its own failure, as the relay reports it.
    Own(PublishError),
    /// Only another message of its batch, refused as too large, made the broker close the
    /// channel: it is published once more on a fresh channel.
    Collateral(PublishError),
}

impl Failure {
    fn error(&self) -> &PublishError {
        match self {
            Failure::Own(e) | Failure::Collateral(e) => e,
        }
    }

    fn into_error(self) -> PublishError {
        match self {
            Failure::Own(e) | Failure::Collateral(e) => e,
        }
    }
}

/// What RabbitMQ's unroutable (returned) messages become.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Unroutable {
    /// Retry with backoff (a queue or binding may be added), then dead-letter.
    #[default]
    Retry,
    /// Dead-letter at once.
    DeadLetter,
}

/// A RabbitMQ sink's own settings (`[sinks.NAME]` with an `amqp://` or `amqps://` URI).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RabbitMqConfig {
    #[serde(flatten)]
    pub timeout: ConfirmTimeout,
    /// The exchange, a template [default: "" (the default exchange: the routing key names
    /// the queue)].
    pub exchange: Option<String>,
    /// What an unroutable message becomes.
    pub unroutable: Unroutable,
}

pub struct RabbitSink {
    inner: Arc<Inner>,
}

struct Inner {
    uri: String,
    shown: String,
    exchange: Template,
    unroutable: Unroutable,
    timeout: Duration,
    /// The message size limit the broker refused a message for, and when.
    learned_limit: std::sync::Mutex<LearnedLimit>,
    /// The connection's negotiated frame size: a message's properties (its headers among
    /// them) travel in one frame, which AMQP does not split.
    frame_max: AtomicUsize,
    session: Mutex<Option<(Connection, Channel)>>,
    /// One batch at a time on the channel: lapin hands a returned (unroutable) message to
    /// whichever confirmation it completes next, not to its own, so a batch tells its
    /// returned messages by their ids, and only while no other batch's are pending.
    publishing: tokio::sync::Mutex<()>,
    /// A batch's confirmations may still be pending on the channel: set as a batch starts,
    /// cleared once every one of them came in. One given up on (its timeout, or the engine
    /// dropping the publish) stays pending inside lapin, and would take the next batch's
    /// returned message: that message, unroutable, was then confirmed as published. The
    /// next batch gets a new channel instead.
    abandoned_confirms: AtomicBool,
}

impl RabbitSink {
    pub fn new(uri: &str, config: &RabbitMqConfig) -> Result<Self, SinkSetupError> {
        let shown = outbox_core::redact::redact_url(uri);
        // Connections are made on first use; a URI that cannot work is refused now.
        uri.parse::<lapin::uri::AMQPUri>().map_err(|e| {
            SinkSetupError::config(format!(
                "invalid RabbitMQ URI {shown}: {e}; use amqp://host[:port][/vhost] (amqps:// for \
                 TLS), with user info before the host where the broker wants it"
            ))
        })?;
        // The AMQP client's parser takes an IPv6 literal's host for none, and connects to
        // localhost instead: a broker listening there would have taken the events, and the
        // credentials, in the named one's stead.
        let authority = uri.split_once("://").map_or("", |(_, rest)| rest);
        let authority = authority.split(['/', '?']).next().unwrap_or("");
        if authority.rsplit('@').next().unwrap_or("").starts_with('[') {
            return Err(SinkSetupError::config(format!(
                "RabbitMQ URI {shown} names an IPv6 address, which the AMQP client cannot \
                 connect to (it would connect to localhost instead): use a host name that \
                 resolves to it"
            )));
        }
        let exchange = Template::parse(config.exchange.as_deref().unwrap_or(""))
            .map_err(|e| SinkSetupError::config(format!("exchange: {e}")))?;
        Ok(RabbitSink {
            inner: Arc::new(Inner {
                uri: uri.to_string(),
                shown,
                exchange,
                unroutable: config.unroutable,
                timeout: config.timeout.get(),
                learned_limit: Default::default(),
                frame_max: AtomicUsize::new(DEFAULT_FRAME_MAX),
                session: Mutex::new(None),
                publishing: tokio::sync::Mutex::new(()),
                abandoned_confirms: AtomicBool::new(false),
            }),
        })
    }
}

impl Inner {
    /// The confirm-mode channel, on a new connection when the connection or channel is gone.
    /// A channel the broker closed (a refusal) is not replaced on the same connection:
    /// lapin can reuse its number before the broker has seen it closed, and the broker then
    /// closes the whole connection (CHANNEL_ERROR "expected 'channel.open'") under the
    /// batches publishing on it.
    ///
    /// `replace`: a new one whatever the current one's state (a batch gave up on its
    /// confirmations there, [`Inner::abandoned_confirms`]). Only a batch asks it, under
    /// [`Inner::publishing`]: no other batch is waiting on the channel then.
    async fn channel(&self, replace: bool) -> Result<Channel, PublishError> {
        let mut session = self.session.lock().await;
        if let Some((connection, channel)) = session.as_ref() {
            if !replace && connection.status().connected() && channel.status().connected() {
                return Ok(channel.clone());
            }
        }
        if let Some((old, _)) = session.take().filter(|(c, _)| c.status().connected()) {
            // Its channel is closed, or no batch waits on it any more (one gave up on its
            // confirmations); not under the lock.
            tokio::spawn(async move {
                let closing = old.close(200, "replaced after its channel closed".into());
                let _ = tokio::time::timeout(Duration::from_secs(1), closing).await;
            });
        }
        let connect = async {
            let connection =
                Connection::connect(&self.uri, ConnectionProperties::default()).await?;
            let channel = connection.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            Ok::<_, lapin::Error>((connection, channel))
        };
        let (connection, channel) = tokio::time::timeout(Duration::from_secs(5), connect)
            .await
            .map_err(|_| {
                PublishError::new(
                    PublishErrorKind::Unavailable,
                    format!("{}: connection timed out", self.shown),
                )
            })?
            // Opening a channel sends no message, so its failure is never collateral.
            .map_err(|e| self.classify(e, 0, "").into_error())?;
        let frame_max = connection.configuration().frame_max();
        if frame_max > 0 {
            self.frame_max.store(frame_max as usize, Ordering::Relaxed);
        }
        *session = Some((connection, channel.clone()));
        Ok(channel)
    }

    /// What to say of the connection when the broker has blocked its publishers
    /// (`connection.blocked`): it then reads no message, and every publish waits for a
    /// confirmation that cannot come. A timeout alone named no cause.
    async fn blocked(&self) -> Option<&'static str> {
        let session = self.session.lock().await;
        session
            .as_ref()
            .is_some_and(|(connection, _)| connection.status().blocked())
            .then_some(
                "the broker has blocked publishing (connection.blocked: a memory or disk \
                 alarm); free memory or disk on the broker, or raise its \
                 vm_memory_high_watermark or lower its disk_free_limit",
            )
    }

    /// A fixed exchange (no placeholder, not the default "") that does not exist fails every
    /// publish: looked for with a passive declare, on a channel of its own, since a failed
    /// declare closes its channel.
    async fn exchange_exists(&self) -> Result<(), PublishError> {
        let Some(name) = self.exchange.literal().filter(|name| !name.is_empty()) else {
            return Ok(());
        };
        let probe = {
            let session = self.session.lock().await;
            let Some((connection, _)) = session.as_ref() else {
                return Ok(());
            };
            connection.create_channel().await
        }
        .map_err(|e| self.classify(e, 0, "").into_error())?;
        let declared = probe
            .exchange_declare(
                short(name, "exchange")?,
                lapin::ExchangeKind::Direct,
                lapin::options::ExchangeDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await;
        if declared.is_ok() {
            let _ = probe.close(200, "exchange found".into()).await;
        }
        declared.map_err(|e| self.classify(e, 0, name).into_error())
    }

    /// The one place RabbitMQ errors become publish outcomes. `size` and `exchange` are the
    /// message's, to tell the oversized message, or the one sent to a missing exchange,
    /// apart from the others on the channel the broker closed for it.
    fn classify(&self, error: lapin::Error, size: usize, exchange: &str) -> Failure {
        let (kind, message) = match error.kind() {
            ErrorKind::ProtocolError(amqp) => {
                let text = amqp.get_message().to_string();
                match amqp.kind() {
                    // PRECONDITION_FAILED covers other refusals too; only the broker's text
                    // says it is the size ("message size N is larger than configured max
                    // size M"), and only the text carries the limit.
                    AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)
                        if text.contains("larger than") =>
                    {
                        // "message size N is larger than configured max size M"
                        if let Some(limit) = text
                            .rsplit(' ')
                            .next()
                            .and_then(|m| m.parse::<usize>().ok())
                        {
                            self.learned_limit
                                .lock()
                                .expect("learned limit lock")
                                .learned(limit, Instant::now());
                            if size <= limit {
                                return Failure::Collateral(PublishError::new(
                                    PublishErrorKind::Unavailable,
                                    format!(
                                        "{}: channel closed after another message was refused \
                                         as too large",
                                        self.shown
                                    ),
                                ));
                            }
                        }
                        (PublishErrorKind::TooLarge, text)
                    }
                    AMQPErrorKind::Soft(AMQPSoftError::CONTENTTOOLARGE) => {
                        (PublishErrorKind::TooLarge, text)
                    }
                    // "ACCESS_REFUSED - access to exchange 'X' in vhost '/' refused for user
                    // 'u'": as for a missing exchange, the channel's other messages failed
                    // with X's refusal; only X's are refused.
                    AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)
                        if text.contains("exchange '")
                            && !text.contains(&format!("exchange '{}'", broker_name(exchange))) =>
                    {
                        return Failure::Collateral(PublishError::new(
                            PublishErrorKind::Unavailable,
                            format!(
                                "{}: channel closed after another message's exchange was \
                                 refused to this user",
                                self.shown
                            ),
                        ));
                    }
                    AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED) => {
                        (PublishErrorKind::Unauthorized, text)
                    }
                    // "NOT_FOUND - no exchange 'X' in vhost '/'": the broker closed the
                    // channel, failing every message waiting on it; only X's are refused.
                    AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)
                        if text.contains("no exchange")
                            && !text.contains(&format!("'{}'", broker_name(exchange))) =>
                    {
                        return Failure::Collateral(PublishError::new(
                            PublishErrorKind::Unavailable,
                            format!(
                                "{}: channel closed after another message's exchange was not \
                                 found",
                                self.shown
                            ),
                        ));
                    }
                    AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND) => (
                        PublishErrorKind::MissingTarget,
                        format!(
                            "{text} (declare the exchange, or fix the sink's exchange setting)"
                        ),
                    ),
                    // A hard error closes the connection; the message is not refused,
                    // it goes again on a new one. (RabbitMQ answers a frame that lapin sends
                    // on a channel the broker just closed, after a size refusal, with a hard
                    // CHANNEL_ERROR "expected 'channel.open'".)
                    AMQPErrorKind::Hard(_) => (
                        PublishErrorKind::Unavailable,
                        format!("the broker closed the connection: {text}"),
                    ),
                    _ => (PublishErrorKind::BrokerFailure, text),
                }
            }
            ErrorKind::IOError(_)
            | ErrorKind::RuntimeShutdownError(_)
            | ErrorKind::MissingHeartbeatError
            | ErrorKind::InvalidConnectionState(_)
            | ErrorKind::InvalidChannelState(..) => {
                (PublishErrorKind::Unavailable, "connection lost".to_string())
            }
            _ => (
                PublishErrorKind::BrokerFailure,
                "publish failed".to_string(),
            ),
        };
        Failure::Own(
            PublishError::new(kind, format!("{}: {message}", self.shown)).with_source(error),
        )
    }

    /// What the broker's confirmation of one message means for its event, given the
    /// messages the broker returned as unroutable while the batch was confirmed (by message
    /// id, with the broker's reason). A returned message lapin attached to this
    /// confirmation may be another's: only the event's own id in `returned` makes it
    /// unroutable.
    fn confirmed(
        &self,
        confirmation: Confirmation,
        exchange: &str,
        routed: &Routed,
        returned: &HashMap<String, String>,
    ) -> Result<(), PublishError> {
        if let Some(reason) = returned.get(&message_id(routed)) {
            let kind = match self.unroutable {
                Unroutable::Retry => PublishErrorKind::NoRoute,
                Unroutable::DeadLetter => PublishErrorKind::Rejected,
            };
            return Err(PublishError::new(
                kind,
                format!(
                    "{}: unroutable ({reason}): no queue is bound to exchange {exchange:?} with \
                     routing key {:?}",
                    self.shown, routed.target
                ),
            ));
        }
        match confirmation {
            Confirmation::Ack(_) => Ok(()),
            // A full queue refuses every message routed to it until a consumer makes room:
            // the destination's condition, which spends no attempt while it lasts.
            Confirmation::Nack(_) => Err(PublishError::new(
                PublishErrorKind::Throttled,
                format!(
                    "{}: the broker refused to store the message (nack) sent to exchange \
                     {exchange:?} with routing key {:?}: a queue it routes to is full and \
                     rejects publishes (x-overflow = reject-publish, at x-max-length or \
                     x-max-length-bytes), or the broker could not store it; make room in \
                     that queue or raise its limit",
                    self.shown, routed.target
                ),
            )),
            Confirmation::NotRequested => Err(PublishError::new(
                PublishErrorKind::BrokerFailure,
                "publisher confirms are not enabled",
            )),
        }
    }

    /// The message's properties; an error where a value AMQP carries as a short string
    /// ([`short`]) is too long.
    fn properties(routed: &Routed, frame_max: usize) -> Result<BasicProperties, PublishError> {
        let event = &routed.event;
        // The properties travel in one content-header frame. One over the connection's
        // frame size made the broker close the connection (FRAME_ERROR, frame_too_large),
        // failing the batch's other messages, and was retried as a broker gone: at every
        // try, again.
        let field = |name: &str, value: usize| 1 + name.len() + 1 + 4 + value;
        let relays_own = field("outbox-event-type", event.event_type.len())
            + field("outbox-partition-key", event.ordering_key().len())
            + field("outbox-sequence-id", 8)
            + event
                .mutation_id
                .as_ref()
                .map_or(0, |m| field("outbox-mutation-id", m.len()));
        let header_bytes: usize = relays_own
            + event
                .headers
                .iter()
                .map(|(k, v)| field(k, v.len()))
                .sum::<usize>();
        let room = frame_max.saturating_sub(PROPERTIES_BESIDE_HEADERS);
        if header_bytes > room {
            return Err(PublishError::new(
                PublishErrorKind::TooLarge,
                format!(
                    "the event's headers (with its key and the relay's own) take \
                     {header_bytes} bytes, and a RabbitMQ message's properties travel in one \
                     frame of at most {frame_max} bytes (the connection's frame_max; about \
                     {room} left for headers): carry the data in the payload, or raise the \
                     broker's frame_max"
                ),
            ));
        }
        let mut headers = FieldTable::default();
        // The RabbitMQ binding carries a CloudEvent's content type in the content-type property.
        let content_type = event.headers.get(crate::cloudevents::CONTENT_TYPE_HEADER);
        for (k, v) in &event.headers {
            if k == crate::cloudevents::CONTENT_TYPE_HEADER && routed.cloudevents.is_some() {
                continue;
            }
            // RabbitMQ reads CC and BCC as extra routing keys, in an array: a text value is
            // an invalid message, for which the broker closes the channel and fails every
            // message waiting on it, the batch's others among them, at every try.
            // (Only these exact names: `cc` or `Bcc` is an ordinary header to the broker.)
            if k == "CC" || k == "BCC" {
                return Err(PublishError::new(
                    PublishErrorKind::Encoding,
                    format!(
                        "the event's header {k} is RabbitMQ's sender-selected routing (an \
                         array of routing keys), which an event's text header cannot be; \
                         rename it in the event's headers"
                    ),
                ));
            }
            headers.insert(
                short(k, "header name")?,
                AMQPValue::LongString(LongString::from(v.as_str())),
            );
        }
        let text = |s: &str| AMQPValue::LongString(LongString::from(s));
        headers.insert("outbox-event-type".into(), text(&event.event_type));
        headers.insert("outbox-partition-key".into(), text(event.ordering_key()));
        headers.insert(
            "outbox-sequence-id".into(),
            AMQPValue::LongLongInt(event.sequence_id),
        );
        if let Some(m) = &event.mutation_id {
            headers.insert("outbox-mutation-id".into(), text(m));
        }
        let mut properties = BasicProperties::default()
            .with_message_id(message_id(routed).as_str().into())
            .with_delivery_mode(2)
            .with_type(short(&event.event_type, "event type")?)
            .with_headers(headers);
        if let Ok(created) = event.created_at.duration_since(std::time::UNIX_EPOCH) {
            properties = properties.with_timestamp(created.as_secs());
        }
        match content_type {
            Some(content_type) if routed.cloudevents.is_some() => {
                properties = properties.with_content_type(short(content_type, "content type")?);
            }
            _ if matches!(event.payload, Payload::Json(_)) => {
                properties = properties.with_content_type("application/json".into());
            }
            _ => {}
        }
        Ok(properties)
    }
}

/// RabbitMQ's default `frame_max` (128 KiB), until a connection says its own.
const DEFAULT_FRAME_MAX: usize = 131_072;

/// What a message's properties take in its frame besides its headers, at most: the frame's
/// and the properties' framing, the message id, the type and content type (short strings,
/// 255 bytes each), the delivery mode and timestamp.
const PROPERTIES_BESIDE_HEADERS: usize = 1024;

/// `text` as an AMQP short string, at most 255 bytes (exchange and routing key, a header's
/// name, the type and content type properties), or the event's permanent error saying
/// which is too long: lapin's own conversion panics past that.
fn short(text: &str, what: &str) -> Result<ShortString, PublishError> {
    ShortString::try_new(text).map_err(|_| {
        let start: String = text.chars().take(40).collect();
        PublishError::new(
            PublishErrorKind::Encoding,
            format!(
                "the {what} {start:?}… is {} bytes long, and AMQP carries at most 255",
                text.len()
            ),
        )
    })
}

impl Sink for RabbitSink {
    fn messaging_system(&self) -> Option<&'static str> {
        Some("rabbitmq")
    }

    fn cloudevents_binding(&self) -> Option<crate::cloudevents::Binding> {
        Some(crate::cloudevents::Binding::RabbitMq)
    }

    fn describe(&self) -> String {
        self.inner.shown.clone()
    }

    fn send(&self, batch: Vec<Routed>) -> BoxFuture<'static, Vec<Outcome>> {
        let inner = self.inner.clone();
        async move {
            let until = crate::sink::turn_deadline(inner.timeout);
            let mut outcomes = publish_batch(&inner, &batch, until).await;
            // A size refusal makes the broker close the channel, failing the rest of the
            // batch with it; those go once more on a fresh channel.
            // A message too large, or sent to a missing exchange, makes the broker close the
            // channel: the rest of the batch failed with it.
            let refused = outcomes.iter().any(|o| {
                o.as_ref().is_err_and(|e| {
                    matches!(
                        e.error().kind(),
                        PublishErrorKind::TooLarge
                            | PublishErrorKind::MissingTarget
                            | PublishErrorKind::Unauthorized
                    )
                })
            });
            let collateral: Vec<usize> = outcomes
                .iter()
                .enumerate()
                .filter(|(_, o)| match o {
                    Err(Failure::Collateral(_)) => true,
                    Err(Failure::Own(e)) => refused && e.kind() == PublishErrorKind::Unavailable,
                    Ok(()) => false,
                })
                .map(|(i, _)| i)
                .collect();
            if !collateral.is_empty() {
                // On a new connection ([`Inner::channel`]).
                let again: Vec<Routed> = collateral.iter().map(|&i| batch[i].clone()).collect();
                for (i, outcome) in collateral
                    .into_iter()
                    .zip(publish_batch(&inner, &again, until).await)
                {
                    outcomes[i] = outcome;
                }
            }
            outcomes
                .into_iter()
                .map(|o| o.map_err(Failure::into_error))
                .collect()
        }
        .boxed()
    }

    fn health(&self) -> BoxFuture<'static, Result<(), PublishError>> {
        let inner = self.inner.clone();
        async move {
            inner.channel(false).await?;
            if let Some(blocked) = inner.blocked().await {
                return Err(PublishError::new(
                    PublishErrorKind::Throttled,
                    format!("{}: {blocked}", inner.shown),
                ));
            }
            inner.exchange_exists().await
        }
        .boxed()
    }

    fn max_message_bytes(&self) -> Option<usize> {
        let learned = self.inner.learned_limit.lock().expect("learned limit lock");
        Some(learned.current(Instant::now()))
    }
}

/// The AMQP `message_id` of an event's message: its event id.
fn message_id(routed: &Routed) -> String {
    routed.event.event_id.hyphenated().to_string()
}

/// Publishes a batch on the confirm channel and awaits every confirm, once the batch
/// before it is done there, if that is by `until`. The engine's publish timeout covers the
/// whole batch: one queued behind slow ones outlived it, and every event was retried, those
/// the broker had confirmed too. A batch not started in time is given back unsent (no
/// attempt), and its events go in a later batch.
async fn publish_batch(
    inner: &Arc<Inner>,
    batch: &[Routed],
    until: tokio::time::Instant,
) -> Vec<Result<(), Failure>> {
    let held = || "the batch before it held the channel".to_string();
    let turn = inner.publishing.lock();
    let _alone = match crate::sink::in_turn(until, turn, &inner.shown, held).await {
        Ok(alone) => alone,
        Err(not_sent) => {
            return fail_all(batch, &not_sent)
                .into_iter()
                .map(|o| o.map_err(Failure::Own))
                .collect()
        }
    };
    {
        let abandoned = inner.abandoned_confirms.load(Ordering::SeqCst);
        let channel = match inner.channel(abandoned).await {
            Ok(c) => c,
            Err(e) => {
                return fail_all(batch, &e)
                    .into_iter()
                    .map(|o| o.map_err(Failure::Own))
                    .collect()
            }
        };
        // Until every confirmation came in: a publish dropped on the way leaves it set.
        inner.abandoned_confirms.store(true, Ordering::SeqCst);
        // Publish the whole batch, then await every confirm.
        let mut confirms = Vec::with_capacity(batch.len());
        for routed in batch {
            let exchange = inner.exchange.render(&routed.event);
            let message = short(&exchange, "exchange").and_then(|exchange| {
                let key = short(&routed.target, "routing key")?;
                let frame_max = inner.frame_max.load(Ordering::Relaxed);
                Ok((exchange, key, Inner::properties(routed, frame_max)?))
            });
            let published = match message {
                Ok((exchange, key, properties)) => Ok(channel
                    .basic_publish(
                        exchange,
                        key,
                        BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        },
                        routed.event.payload.as_bytes(),
                        properties,
                    )
                    .await),
                Err(e) => Err(e),
            };
            confirms.push((published, exchange));
        }
        let exchanges: Vec<String> = confirms.iter().map(|(_, e)| e.clone()).collect();
        let confirmations =
            confirms
                .into_iter()
                .zip(batch)
                .map(|((published, exchange), routed)| async move {
                    let size = routed.event.payload.len();
                    let confirm = published
                        .map_err(Failure::Own)?
                        .map_err(|e| inner.classify(e, size, &exchange))?;
                    match tokio::time::timeout(inner.timeout, confirm).await {
                        Err(_) => Err(Failure::Own(PublishError::new(
                            PublishErrorKind::Timeout,
                            match inner.blocked().await {
                                Some(blocked) => {
                                    format!("{}: no confirm in time: {blocked}", inner.shown)
                                }
                                None => format!("{}: no confirm in time", inner.shown),
                            },
                        ))),
                        Ok(Err(e)) => Err(inner.classify(e, size, &exchange)),
                        Ok(Ok(confirmation)) => Ok(confirmation),
                    }
                });
        let confirmations = join_all(confirmations).await;
        let timed_out = confirmations
            .iter()
            .any(|c| matches!(c, Err(Failure::Own(e)) if e.kind() == PublishErrorKind::Timeout));
        inner.abandoned_confirms.store(timed_out, Ordering::SeqCst);
        // The broker returns an unroutable message before confirming it, and every
        // confirmation of the batch is in: each returned message is among these.
        let returned: HashMap<String, String> = confirmations
            .iter()
            .filter_map(|c| match c {
                Ok(Confirmation::Ack(Some(r)) | Confirmation::Nack(Some(r))) => {
                    let id = r.delivery.properties.message_id().as_ref()?;
                    Some((id.to_string(), r.reply_text.to_string()))
                }
                _ => None,
            })
            .collect();
        confirmations
            .into_iter()
            .zip(batch.iter().zip(exchanges))
            .map(|(confirmation, (routed, exchange))| {
                inner
                    .confirmed(confirmation?, &exchange, routed, &returned)
                    .map_err(Failure::Own)
            })
            .collect()
    }
}

pub fn sink(uri: &str, config: &RabbitMqConfig) -> Result<Arc<dyn Sink>, SinkSetupError> {
    Ok(Arc::new(RabbitSink::new(uri, config)?))
}

/// An exchange as the broker names it in its refusals: the default exchange, `""` to a
/// publisher, is `amq.default` there.
fn broker_name(exchange: &str) -> &str {
    if exchange.is_empty() {
        "amq.default"
    } else {
        exchange
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unit test (pure state). A limit learned from a refusal was kept for good: with the
    /// broker's `max_message_size` raised while the relay ran, every larger message was
    /// dead-lettered without being sent, until a restart.
    #[test]
    fn a_learned_size_limit_stands_for_a_while_then_the_broker_is_asked_again() {
        let start = Instant::now();
        let mut limit = LearnedLimit::default();
        assert_eq!(limit.current(start), DEFAULT_MAX_MESSAGE_BYTES);
        limit.learned(1024 * 1024, start);
        assert_eq!(limit.current(start + LEARNED_LIMIT_KEPT / 2), 1024 * 1024);
        assert_eq!(
            limit.current(start + LEARNED_LIMIT_KEPT),
            DEFAULT_MAX_MESSAGE_BYTES
        );
    }

    /// The AMQP client took `[::1]` for no host and connected to localhost: such a URI is
    /// refused, naming why; a host name or an IPv4 address is taken.
    #[test]
    fn an_ipv6_literal_is_refused_and_names_are_taken() {
        let config = RabbitMqConfig::default();
        for uri in [
            "amqp://guest:guest@[::1]:5672/",
            "amqps://[2001:db8::7]/%2f",
        ] {
            let err = match RabbitSink::new(uri, &config) {
                Ok(_) => panic!("{uri} taken"),
                Err(e) => e,
            };
            assert!(err.kind().is_config(), "{err}");
            assert!(err.to_string().contains("IPv6"), "{err}");
            assert!(!err.to_string().contains("guest:guest"), "{err}");
        }
        for uri in [
            "amqp://guest:guest@127.0.0.1:5672/%2f",
            "amqps://broker.internal/orders",
        ] {
            assert!(RabbitSink::new(uri, &config).is_ok(), "{uri}");
        }
    }
}
