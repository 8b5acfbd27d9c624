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
/// - `publish` receives a batch in which each ordering key has at most
///   [`Publisher::max_events_per_key`] events (one by default), consecutive and in order,
///   and returns exactly one outcome per event, in the same order as the batch. (Under
///   `--ordering none` every event is a lane of its own, and a batch may hold any number of
///   a key's events.)
/// - `Ok` means the sink confirmed the event: only then is its row acked. A publisher never
///   reports `Ok` before the broker's confirmation (PubAck, delivery report, publisher
///   confirm, fsync).
/// - A publisher keeps many events in flight within a batch (no round trip per event where
///   the broker allows it), and the engine may call `publish` again before earlier batches
///   complete; batches in flight together never share an ordering key.
/// - Delivery is at least once: after a crash an event may be published again. Publishers
///   carry [`Event::event_id`] in the broker's de-duplication field so consumers (or the
///   broker) can drop the copy.
/// - A publisher never panics on bad input: an event it cannot encode or that is too large
///   gets a permanent error.
pub trait Publisher: Send + Sync + 'static {
    /// A short name for logs and metrics, e.g. `file:/var/log/events.jsonl`.
    fn describe(&self) -> String;

    fn publish(&self, batch: Vec<Arc<Event>>) -> BoxFuture<'static, Vec<Outcome>>;

    /// How many consecutive events of one ordering key a batch may carry. One (the default):
    /// a key's next event waits for the outcome of the one before.
    ///
    /// More than one is a promise about a batch's events of one key: the sink stores them in
    /// batch order, and when one fails with a retryable error, no later one of them was
    /// stored (a file's single write of the batch, which a failure cuts to a prefix). The
    /// engine acks a key's confirmed prefix and publishes the rest again after the first
    /// failure, so a key's events reach the sink in order, duplicates aside. Sinks that
    /// confirm each message on its own (a broker's per-message acks) cannot promise it: a
    /// later message can be stored while an earlier one times out.
    fn max_events_per_key(&self) -> usize {
        1
    }

    /// Whether events may go out in [`Publisher::send_group`]s, each published as a batch
    /// of its own. False (the default): every batch may mix any events.
    fn has_send_groups(&self) -> bool {
        false
    }

    /// The group of `event`'s send, where [`Publisher::has_send_groups`]: events of
    /// different groups never wait on each other (different sinks, a webhook's different
    /// receivers), so the engine publishes each group's events in batches of their own. A
    /// batch's outcomes come back together: one slow receiver in a mixed batch held every
    /// other sink's events of it, and their keys, until it answered.
    fn send_group(&self, event: &Event) -> u64 {
        let _ = event;
        0
    }

    /// Checks that the sink is reachable (for `/readyz` and `check`).
    fn health(&self) -> BoxFuture<'static, Result<(), PublishError>>;

    /// [`Publisher::health`] of the sink `event` goes to, where there are several (the
    /// router's sinks). The engine asks it when one event keeps failing alone: a check that
    /// fails too says the destination is down, and the event spends none of its attempts;
    /// one that passes says the destination refuses that event, which then counts them.
    fn health_of(&self, event: &Event) -> BoxFuture<'static, Result<(), PublishError>> {
        let _ = event;
        self.health()
    }

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
