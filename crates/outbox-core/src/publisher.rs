//! The publisher (sink) contract.

use std::sync::Arc;

use futures::future::BoxFuture;

use crate::error::PublishError;
use crate::event::Event;

/// The result of publishing one event: `Ok` once the sink has confirmed it durably
/// (broker ack, fsync), otherwise a classified [`PublishError`].
pub type Outcome = Result<(), PublishError>;

/// A sink that events are published to.
///
/// # Contract
/// - `publish` receives a batch whose events all have distinct ordering keys, and returns
///   exactly one outcome per event, in the same order as the batch.
/// - `Ok` means the sink confirmed the event: only then is its row acked. A publisher never
///   reports `Ok` before the broker's confirmation (PubAck, delivery report, publisher
///   confirm, fsync).
/// - A publisher keeps many events in flight within a batch (no round trip per event where
///   the broker allows it), and the engine may call `publish` again before earlier batches
///   complete; batches never share an ordering key.
/// - Delivery is at least once: after a crash an event may be published again. Publishers
///   carry [`Event::event_id`] in the broker's de-duplication field so consumers (or the
///   broker) can drop the copy.
/// - A publisher never panics on bad input: an event it cannot encode or that is too large
///   gets a permanent error.
pub trait Publisher: Send + Sync + 'static {
    /// A short name for logs and metrics, e.g. `file:/var/log/events.jsonl`.
    fn describe(&self) -> String;

    fn publish(&self, batch: Vec<Arc<Event>>) -> BoxFuture<'static, Vec<Outcome>>;

    /// Checks that the sink is reachable (for `/readyz` and `check`).
    fn health(&self) -> BoxFuture<'static, Result<(), PublishError>>;

    /// Flushes and closes connections at shutdown.
    fn close(&self) -> BoxFuture<'static, ()> {
        Box::pin(async {})
    }

    /// Where `event` goes, for telemetry only (span attributes): the messaging system and
    /// the destination's name there (subject, topic, routing key, stream, URL). `None` when
    /// the publisher cannot say (no route). Called only while telemetry is on.
    fn messaging_destination(&self, event: &Event) -> Option<MessagingDestination> {
        let _ = event;
        None
    }
}

/// A destination as the messaging semantic conventions name it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessagingDestination {
    /// `messaging.system`: `kafka`, `rabbitmq`, `nats`, `redis`, `webhook`, `ably`, `file`.
    pub system: &'static str,
    /// `messaging.destination.name`.
    pub name: String,
}
