//! The contract between the router and one broker connection.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use outbox_core::{Event, Outcome, PublishError, PublishErrorKind};

/// An event with the target (subject, topic, exchange/routing key, stream, URL, channel)
/// its route resolved.
#[derive(Clone, Debug)]
pub struct Routed {
    pub event: Arc<Event>,
    pub target: String,
    /// The CloudEvents content mode the router shaped the event in, if its route asks for
    /// one: the event's headers (binary) or payload (structured) already carry it, and a
    /// sink whose normal body wraps the payload (webhooks) sends the payload alone.
    pub cloudevents: Option<crate::cloudevents::ContentMode>,
}

/// One configured broker connection. The contract is [`outbox_core::Publisher`]'s: one
/// outcome per event, in batch order, `Ok` only after the broker's confirmation, many
/// events in flight, the event id in the broker's de-duplication field.
pub trait Sink: Send + Sync + 'static {
    /// What logs, `check` and errors call the sink: its URI through
    /// [`outbox_core::redact::redact_url`], never a secret.
    fn describe(&self) -> String;

    fn send(&self, batch: Vec<Routed>) -> BoxFuture<'static, Vec<Outcome>>;

    fn health(&self) -> BoxFuture<'static, Result<(), PublishError>>;

    /// Whether one `send` stores its events in order and, when one fails with a retryable
    /// error, stores none after it: the promise behind
    /// [`outbox_core::Publisher::max_events_per_key`]. A file's or stdout's one write per
    /// send keeps it; brokers that confirm each message on its own do not.
    fn stores_a_prefix(&self) -> bool {
        false
    }

    /// Whether sends to different destinations share nothing that one could wait on (a
    /// webhook's receivers, each a server of its own): the router then publishes each
    /// destination's events apart ([`outbox_core::Publisher::send_group`]). Sends over one
    /// broker connection share it, and stay in one batch.
    fn sends_by_destination(&self) -> bool {
        false
    }

    /// The largest payload the broker accepts, if it has a limit.
    fn max_message_bytes(&self) -> Option<usize> {
        None
    }

    /// Whether [`Sink::max_message_bytes`] is fixed (a service's limit, or the sink's own
    /// setting), not learned from a broker that may take more: a sink's `max_message_bytes`
    /// above a fixed limit cannot apply, and is refused.
    fn limit_is_fixed(&self) -> bool {
        false
    }

    fn close(&self) -> BoxFuture<'static, ()> {
        Box::pin(async {})
    }

    /// The `messaging.system` of the semantic conventions, for telemetry.
    fn messaging_system(&self) -> Option<&'static str> {
        None
    }

    /// How the protocol carries CloudEvents attributes in binary mode: `None` when no
    /// CloudEvents protocol binding exists for it (routes may then ask for structured mode
    /// only). A sink that returns a binding sends the attribute headers the router adds as
    /// protocol headers, and the `content-type` header as the protocol's content type.
    fn cloudevents_binding(&self) -> Option<crate::cloudevents::Binding> {
        None
    }

    /// What `target` addresses instead of events, when it names the broker's own API
    /// (NATS's `$JS.`, Kafka's `__consumer_offsets`): publishing there would act with the
    /// relay's credentials, so the router refuses it unless a route names it literally.
    fn reserved_target(&self, _target: &str) -> Option<&'static str> {
        None
    }
}

/// The same error for every event of a batch (the connection itself failed).
pub fn fail_all(batch: &[Routed], error: &PublishError) -> Vec<Outcome> {
    fail_n(batch.len(), error)
}

/// [`fail_all`] for `count` events.
pub fn fail_n(count: usize, error: &PublishError) -> Vec<Outcome> {
    let report = error.report_without_kind();
    (0..count)
        .map(|_| Err(PublishError::new(error.kind(), report.clone())))
        .collect()
}

/// When a batch's request that waits for its turn (a free request slot, the channel) is
/// given up on: half the sink's `timeout` from the batch's start, so that the wait and the
/// request's own timeout fit in `publish_timeout`, which the configuration keeps above both
/// ([`crate::SinkSettings::longest_batch`]).
pub fn turn_deadline(timeout: Duration) -> tokio::time::Instant {
    tokio::time::Instant::now() + turn_wait(timeout)
}

/// The longest a request waits for its turn: half the sink's `timeout`.
pub fn turn_wait(timeout: Duration) -> Duration {
    timeout / 2
}

/// `turn`, if it comes by `until`; past it, the request is given back unsent (no attempt
/// counted), and goes in a later batch. The engine's publish timeout covers the whole batch:
/// requests queued behind slow ones outlived it, and every event of the batch was retried,
/// those the broker had taken too. `shown`: the sink; `held`: what held the turn.
pub async fn in_turn<T>(
    until: tokio::time::Instant,
    turn: impl Future<Output = T>,
    shown: &str,
    held: impl FnOnce() -> String,
) -> Result<T, PublishError> {
    tokio::time::timeout_at(until, turn).await.map_err(|_| {
        PublishError::new(
            PublishErrorKind::NotSent,
            format!("{shown}: not sent, {} for half the sink's timeout", held()),
        )
    })
}

/// A sink whose size limit comes from configuration instead of the broker.
pub struct Limited {
    pub inner: Arc<dyn Sink>,
    pub max_message_bytes: usize,
}

impl Sink for Limited {
    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn send(&self, batch: Vec<Routed>) -> BoxFuture<'static, Vec<Outcome>> {
        self.inner.send(batch)
    }

    fn health(&self) -> BoxFuture<'static, Result<(), PublishError>> {
        self.inner.health()
    }

    fn stores_a_prefix(&self) -> bool {
        self.inner.stores_a_prefix()
    }

    fn sends_by_destination(&self) -> bool {
        self.inner.sends_by_destination()
    }

    fn max_message_bytes(&self) -> Option<usize> {
        Some(self.max_message_bytes)
    }

    fn close(&self) -> BoxFuture<'static, ()> {
        self.inner.close()
    }

    fn messaging_system(&self) -> Option<&'static str> {
        self.inner.messaging_system()
    }

    fn cloudevents_binding(&self) -> Option<crate::cloudevents::Binding> {
        self.inner.cloudevents_binding()
    }

    fn reserved_target(&self, target: &str) -> Option<&'static str> {
        self.inner.reserved_target(target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::PublishErrorKind;

    /// Each event of a failed batch carries the batch's error once: its kind was said
    /// twice (`missing_target: missing_target: SQS SendMessageBatch …`).
    #[test]
    fn a_failed_batchs_error_is_said_once_per_event() {
        let error = PublishError::new(PublishErrorKind::MissingTarget, "SQS queue q is gone");
        let outcomes = fail_n(2, &error);
        for outcome in outcomes {
            let said = outcome.unwrap_err();
            assert_eq!(said.kind(), PublishErrorKind::MissingTarget);
            assert_eq!(said.to_string(), "missing_target: SQS queue q is gone");
        }
    }
}
