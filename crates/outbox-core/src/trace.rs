//! Trace context: the W3C `traceparent`/`tracestate` an application writes with an event,
//! and the [`Telemetry`] contract through which the engine reports its own steps (claim,
//! publish, settle) as spans.
//!
//! The relay carries an event's trace context to the broker in the event's headers, under
//! the W3C names ([`TRACEPARENT`], [`TRACESTATE`]); each sink puts headers where its broker
//! keeps them. [`TraceParent::parse`] is the one validation: a value it refuses is never
//! treated as trace context (no span link, no header of the relay's own making), and the
//! event is delivered with its headers unchanged.

use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use crate::error::{PublishError, StoreError};
use crate::event::{Event, Headers};

/// The W3C Trace Context header that names the producing span.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C Trace Context header with vendor-specific trace state.
pub const TRACESTATE: &str = "tracestate";

/// A parsed W3C `traceparent` (version `00` layout; later versions are read by their first
/// four fields, as the specification asks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub flags: u8,
}

/// Why a `traceparent` value was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("malformed traceparent {value:?}: {reason}")]
pub struct TraceParentError {
    /// The value as found (cut at 80 characters).
    pub value: String,
    pub reason: &'static str,
}

impl TraceParent {
    /// Parses `version-traceid-parentid-flags` as the W3C Trace Context specification
    /// defines it: lowercase hex, version `ff` invalid, version `00` exactly 55 characters,
    /// a later version at least that with anything after a `-`, and neither id all zeros.
    pub fn parse(value: &str) -> Result<TraceParent, TraceParentError> {
        let fail = |reason| TraceParentError {
            value: value.chars().take(80).collect(),
            reason,
        };
        let b = value.as_bytes();
        if b.len() < 55 {
            return Err(fail("shorter than 55 characters"));
        }
        if b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
            return Err(fail("fields are not separated by '-' at the W3C positions"));
        }
        let version = hex_byte(&b[0..2]).ok_or_else(|| fail("version is not lowercase hex"))?;
        if version == 0xff {
            return Err(fail("version ff is invalid"));
        }
        if version == 0 && b.len() != 55 {
            return Err(fail("version 00 must be exactly 55 characters"));
        }
        if version != 0 && b.len() > 55 && b[55] != b'-' {
            return Err(fail("a later version's extra fields must follow a '-'"));
        }
        let mut trace_id = [0u8; 16];
        decode_hex(&b[3..35], &mut trace_id)
            .ok_or_else(|| fail("trace id is not lowercase hex"))?;
        let mut span_id = [0u8; 8];
        decode_hex(&b[36..52], &mut span_id)
            .ok_or_else(|| fail("parent id is not lowercase hex"))?;
        let flags = hex_byte(&b[53..55]).ok_or_else(|| fail("flags are not lowercase hex"))?;
        if trace_id == [0; 16] {
            return Err(fail("trace id is all zeros"));
        }
        if span_id == [0; 8] {
            return Err(fail("parent id is all zeros"));
        }
        Ok(TraceParent {
            trace_id,
            span_id,
            flags,
        })
    }

    /// The sampled flag.
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("00-")?;
        for b in self.trace_id {
            write!(f, "{b:02x}")?;
        }
        f.write_str("-")?;
        for b in self.span_id {
            write!(f, "{b:02x}")?;
        }
        write!(f, "-{:02x}", self.flags)
    }
}

fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

fn hex_byte(pair: &[u8]) -> Option<u8> {
    Some(hex_digit(pair[0])? << 4 | hex_digit(pair[1])?)
}

fn decode_hex(text: &[u8], out: &mut [u8]) -> Option<()> {
    for (i, o) in out.iter_mut().enumerate() {
        *o = hex_byte(&text[2 * i..2 * i + 2])?;
    }
    Some(())
}

/// The `traceparent` and `tracestate` entries of a span context written as Java properties
/// (`key=value` or `key:value` lines, `#` and `!` comments), as Debezium's
/// `tracingspancontext` column holds it. Escapes beyond `\:` and `\=` do not occur in these
/// values. The values are returned as written: [`TraceParent::parse`] checks them.
pub fn from_java_properties(text: &str) -> (Option<String>, Option<String>) {
    let mut found = (None, None);
    for line in text.lines().map(str::trim) {
        if line.starts_with('#') || line.starts_with('!') {
            continue;
        }
        let Some(split) = line.find(['=', ':']) else {
            continue;
        };
        let value = line[split + 1..]
            .trim()
            .replace("\\:", ":")
            .replace("\\=", "=");
        match line[..split].trim() {
            TRACEPARENT => found.0 = Some(value),
            TRACESTATE => found.1 = Some(value),
            _ => {}
        }
    }
    found
}

/// An event's trace context as the application wrote it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceContext {
    pub parent: TraceParent,
    /// The `tracestate` header as written (list members, comma-separated), if any.
    pub state: Option<String>,
}

impl TraceContext {
    /// The trace context in `headers`: `None` when there is no `traceparent`, an error when
    /// there is one that [`TraceParent::parse`] refuses. Header names match case-insensitively
    /// (HTTP header names are case-insensitive, and applications write `Traceparent` too).
    pub fn from_headers(headers: &Headers) -> Option<Result<TraceContext, TraceParentError>> {
        let parent = header(headers, TRACEPARENT)?;
        Some(TraceParent::parse(parent.trim()).map(|parent| {
            TraceContext {
                parent,
                state: header(headers, TRACESTATE)
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(String::from),
            }
        }))
    }
}

fn header<'h>(headers: &'h Headers, name: &str) -> Option<&'h str> {
    headers.get(name).map(String::as_str).or_else(|| {
        headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    })
}

/// One settle statement the engine ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SettleKind {
    Ack,
    Retry,
    DeadLetter,
}

impl SettleKind {
    /// The operation's name in span names and attributes: `ack`, `retry`, `dead_letter`.
    pub fn as_str(self) -> &'static str {
        match self {
            SettleKind::Ack => "ack",
            SettleKind::Retry => "retry",
            SettleKind::DeadLetter => "dead_letter",
        }
    }
}

/// Where the engine reports the steps of each batch, once each step has finished.
///
/// # Contract
/// - The engine calls these methods only when telemetry is configured
///   (`EngineConfig::telemetry`); without it, no timestamp is taken and nothing is collected,
///   so telemetry that is off costs one branch per batch.
/// - Each call describes a finished step with its start and end time; an implementation
///   must not block (it queues a span and returns). It is called from the engine's tasks.
/// - `published` receives the whole batch handed to the publisher, with one outcome per
///   event in batch order, and `systems` tells which messaging system each destination
///   went to as far as the publisher knows (its sinks' `messaging_system`).
/// - The engine holds no trace context of its own: an implementation reads each event's
///   with [`TraceContext::from_headers`].
pub trait Telemetry: Send + Sync + fmt::Debug + 'static {
    /// A claim statement returned `result` (rows or the error).
    fn claimed(&self, span: Span, result: Result<usize, &StoreError>);

    /// A batch was published (or failed, per event).
    fn published(
        &self,
        span: Span,
        publisher: &dyn crate::Publisher,
        batch: &[Arc<Event>],
        outcomes: &[Result<(), PublishError>],
    );

    /// A settle statement for `rows` rows finished (`Ok(n)`: n rows changed).
    fn settled(&self, span: Span, kind: SettleKind, rows: usize, result: Result<u64, &StoreError>);
}

/// When a step ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub start: SystemTime,
    pub end: SystemTime,
}

impl Span {
    /// A step that started at `start` and ends now.
    pub fn since(start: SystemTime) -> Span {
        Span {
            start,
            end: SystemTime::now(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_and_prints_the_w3c_example() {
        let tp = TraceParent::parse(VALID).unwrap();
        assert_eq!(tp.trace_id[0], 0x4b);
        assert_eq!(tp.span_id[7], 0xb7);
        assert!(tp.sampled());
        assert_eq!(tp.to_string(), VALID);
    }

    #[test]
    fn refuses_malformed_values() {
        for (bad, why) in [
            ("", "shorter"),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
                "shorter",
            ),
            (
                "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
                "trace id",
            ),
            (
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                "all zeros",
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                "all zeros",
            ),
            (
                "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "version ff",
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
                "exactly 55",
            ),
            (
                "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "separated",
            ),
            (
                "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
                "later version",
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
                "flags",
            ),
        ] {
            let err = TraceParent::parse(bad).unwrap_err();
            assert!(err.reason.contains(why), "{bad}: {err}");
        }
        // A later version may carry more fields.
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-ever";
        assert!(TraceParent::parse(later).is_ok());
    }

    #[test]
    fn reads_headers_case_insensitively() {
        let mut h = Headers::new();
        assert!(TraceContext::from_headers(&h).is_none());
        h.insert("Traceparent".into(), VALID.into());
        h.insert("tracestate".into(), "congo=t61rcWkgMzE".into());
        let cx = TraceContext::from_headers(&h).unwrap().unwrap();
        assert_eq!(cx.parent.to_string(), VALID);
        assert_eq!(cx.state.as_deref(), Some("congo=t61rcWkgMzE"));
        h.insert("Traceparent".into(), "nope".into());
        assert!(TraceContext::from_headers(&h).unwrap().is_err());
    }
}
