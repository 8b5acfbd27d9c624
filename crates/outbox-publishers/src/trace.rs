//! Trace context as the sinks carry it. Sinks with a header map (Kafka record headers, NATS
//! headers, the AMQP headers table, Ably's `extras.headers`) carry the event's headers, so a
//! `traceparent`/`tracestate` written with the event arrives under its W3C name already.
//! Sinks without one get it where their consumers look: webhooks as HTTP request headers,
//! Redis Streams as entry fields, both only when [`trace_context`] accepts the value.

use std::sync::atomic::{AtomicBool, Ordering};

use outbox_core::trace::TraceContext;
use outbox_core::Event;

static WARNED: AtomicBool = AtomicBool::new(false);

/// The event's valid trace context, if it has one. A malformed `traceparent` is not trace
/// context: it is reported once per process (at warn) and `None` is returned; the event is
/// still delivered with its headers as written.
pub fn trace_context(event: &Event) -> Option<TraceContext> {
    match TraceContext::from_headers(&event.headers)? {
        Ok(cx) => Some(cx),
        Err(e) => {
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    event_id = %event.event_id,
                    destination = %event.destination,
                    error = %e,
                    "event header traceparent is malformed (W3C Trace Context); the event is \
                     delivered with its headers, but not as trace context (no span link, no \
                     trace header of the relay's making). Later malformed values are not reported"
                );
            }
            None
        }
    }
}

/// The `(name, value)` pairs of the event's valid trace context: `traceparent`, and
/// `tracestate` when written.
pub fn trace_fields(event: &Event) -> Vec<(&'static str, String)> {
    let Some(cx) = trace_context(event) else {
        return Vec::new();
    };
    let mut fields = vec![(outbox_core::trace::TRACEPARENT, cx.parent.to_string())];
    if let Some(state) = cx.state {
        fields.push((outbox_core::trace::TRACESTATE, state));
    }
    fields
}
