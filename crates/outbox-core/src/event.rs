//! The event envelope.

use std::collections::BTreeMap;
use std::fmt;
use std::time::SystemTime;

use serde::Serialize;
use serde_json::value::RawValue;
use uuid::Uuid;

/// The publish order of an event: the outbox table's `sequence_id`.
pub type SequenceId = i64;

/// The idempotency key of an event, carried to the broker's de-duplication field.
pub type EventId = Uuid;

/// Event headers: string keys to string values. JSON values that are not strings are
/// carried as their JSON text.
pub type Headers = BTreeMap<String, String>;

/// The identity of one relay process; it owns the leases it takes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NodeId(pub String);

impl NodeId {
    /// A fresh, unique node id.
    pub fn random() -> Self {
        NodeId(Uuid::new_v4().to_string())
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The message body.
#[derive(Clone, Debug)]
pub enum Payload {
    /// No payload (SQL NULL).
    Null,
    /// A JSON document, kept as the database returned it so it is never re-encoded.
    Json(Box<RawValue>),
    /// Raw bytes, published as they are.
    Bytes(Vec<u8>),
}

impl Payload {
    /// The bytes a broker receives as the message body.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Payload::Null => b"null",
            Payload::Json(raw) => raw.get().as_bytes(),
            Payload::Bytes(bytes) => bytes,
        }
    }

    /// The length of the message body in bytes.
    pub fn len(&self) -> usize {
        self.as_bytes().len()
    }

    /// True when the body is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Parses JSON text into a payload; the text is kept verbatim.
    pub fn from_json_text(text: String) -> Result<Self, String> {
        RawValue::from_string(text)
            .map(Payload::Json)
            .map_err(|e| format!("payload is not valid JSON: {e}"))
    }

    /// The payload a stored row holds, given its `headers`: one kept as a JSON string of its
    /// text (marked by the header [`PAYLOAD_KEPT_AS_TEXT`], which is taken out) is that
    /// text again.
    pub fn restore_kept(self, headers: &mut Headers) -> Result<Self, String> {
        if headers.remove(PAYLOAD_KEPT_AS_TEXT).is_none() {
            return Ok(self);
        }
        let Payload::Json(raw) = self else {
            return Ok(self);
        };
        let text: String = serde_json::from_str(raw.get()).map_err(|e| {
            format!(
                "the payload kept as its JSON text ({PAYLOAD_KEPT_AS_TEXT}) is no JSON string: {e}"
            )
        })?;
        Payload::from_json_text(text)
    }
}

/// The header of a row whose payload is kept as a JSON string of its JSON text, read back
/// by [`Payload::restore_kept`]. PostgreSQL's jsonb refuses some JSON that the relay must
/// still keep (`\u0000`, a lone surrogate escape, a number past `numeric`'s range, nesting
/// deeper than it parses): a WAL event with such a payload that has to wait behind a retry
/// of its key was dead-lettered instead, and a retry of the dead letter published the
/// string. The name is the relay's own: a row an application writes should not carry it.
pub const PAYLOAD_KEPT_AS_TEXT: &str = "outbox-relay-payload-kept-as-text";

/// The header of a dead letter kept for an event that could not be decoded (WAL capture's:
/// a message or row the relay could not read as an event), its value the reason: its payload
/// is the raw content, for inspection, and its type a placeholder. Such a row is never
/// published: a retry finds it undecodable again ([`undecodable_dead_letter`]), as polling's
/// retry of a row still wrong does. The name is the relay's own.
pub const UNDECODABLE: &str = "outbox-relay-undecodable";

/// The event type WAL capture gave the dead letter of an undecodable event, before it was
/// marked with [`UNDECODABLE`].
pub const UNDECODABLE_TYPE: &str = "(undecodable)";

/// Why a stored row with these `headers` and `event_type` is the dead letter of an event that
/// could not be decoded, which must not be published (its payload is the raw content).
pub fn undecodable_dead_letter(headers: &Headers, event_type: &str) -> Option<String> {
    let reason = match headers.get(UNDECODABLE) {
        // The note below, made for an earlier retry, is said once.
        Some(reason) => reason
            .split(UNDECODABLE_NOTE)
            .next()
            .unwrap_or_default()
            .to_string(),
        // An earlier version's, unmarked.
        None if event_type == UNDECODABLE_TYPE && headers.is_empty() => {
            "it could not be read as an event".into()
        }
        None => return None,
    };
    Some(format!(
        "{reason}{UNDECODABLE_NOTE}what could be read of an event that could not be decoded, \
         no event to publish: write the event again, correctly, and purge this dead letter)"
    ))
}

/// Where [`undecodable_dead_letter`]'s note on a reason begins.
const UNDECODABLE_NOTE: &str = " (this dead letter keeps ";

impl Serialize for Payload {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Payload::Null => serializer.serialize_unit(),
            Payload::Json(raw) => raw.serialize(serializer),
            Payload::Bytes(bytes) => match std::str::from_utf8(bytes) {
                Ok(text) => serializer.serialize_str(text),
                Err(_) => serializer.serialize_bytes(bytes),
            },
        }
    }
}

/// One event, decoded from an outbox row and claimed by this node.
#[derive(Clone, Debug)]
pub struct Event {
    pub sequence_id: SequenceId,
    pub event_id: EventId,
    /// The channel, topic or subject.
    pub destination: String,
    /// The ordering key as written; `None` means the destination orders the event.
    pub partition_key: Option<String>,
    /// The message name.
    pub event_type: String,
    pub payload: Payload,
    pub headers: Headers,
    pub mutation_id: Option<String>,
    pub rejected: bool,
    /// How many publish attempts were made before this one.
    pub attempts: u32,
    /// This row's own attempt limit, when its table keeps one (the export seed's
    /// `event_type.max_retry_count`); otherwise the retry policy decides.
    pub max_attempts: Option<u32>,
    pub created_at: SystemTime,
}

impl Event {
    /// An event on its first attempt: no key (the destination orders it), no headers or
    /// mutation id, not rejected, no limit of its own, created now. A store or capture fills
    /// in what its row or message carries with struct update syntax.
    pub fn new(
        sequence_id: SequenceId,
        event_id: EventId,
        destination: impl Into<String>,
        event_type: impl Into<String>,
        payload: Payload,
    ) -> Event {
        Event {
            sequence_id,
            event_id,
            destination: destination.into(),
            partition_key: None,
            event_type: event_type.into(),
            payload,
            headers: Headers::new(),
            mutation_id: None,
            rejected: false,
            attempts: 0,
            max_attempts: None,
            created_at: SystemTime::now(),
        }
    }

    /// The key whose events are published strictly in `sequence_id` order.
    pub fn ordering_key(&self) -> &str {
        self.partition_key.as_deref().unwrap_or(&self.destination)
    }
}

/// An event an application (or `outbox-relay send`) writes into the outbox.
#[derive(Clone, Debug, Default)]
pub struct NewEvent {
    pub event_id: Option<EventId>,
    pub destination: String,
    pub partition_key: Option<String>,
    pub event_type: String,
    /// JSON text, or `None` for SQL NULL.
    pub payload: Option<String>,
    pub headers: Headers,
    pub mutation_id: Option<String>,
}

/// Parses header JSON text (as stored in the database) into [`Headers`]: string values as
/// they are, others as their JSON text, exactly (compacted). Read through a `Value`, a number
/// went through `f64`: `9007199254740993` went out as `9007199254740992`, a 30-digit order
/// id in exponent form, and a number past `f64`'s range dead-lettered the row though
/// `jsonb` had stored it.
pub fn headers_from_json_text(text: &str) -> Result<Headers, String> {
    let not_json = |e: serde_json::Error| format!("headers are not valid JSON: {e}");
    let raw: &serde_json::value::RawValue = serde_json::from_str(text).map_err(not_json)?;
    let kind = match raw.get().as_bytes().first() {
        Some(b'{') => {
            let map: BTreeMap<String, &serde_json::value::RawValue> =
                serde_json::from_str(raw.get()).map_err(not_json)?;
            return map
                .into_iter()
                .map(|(name, value)| {
                    let value = match value.get().as_bytes().first() {
                        Some(b'"') => serde_json::from_str(value.get()).map_err(not_json)?,
                        _ => compact_json(value.get()),
                    };
                    Ok((name, value))
                })
                .collect();
        }
        Some(b'n') => return Ok(Headers::new()),
        Some(b'[') => "an array",
        Some(b'"') => "a string",
        Some(b't' | b'f') => "a boolean",
        _ => "a number",
    };
    Err(format!("headers must be a JSON object, found {kind}"))
}

/// Valid JSON text without the whitespace between its tokens (as `Value`'s `to_string`
/// writes it), its numbers and strings untouched.
fn compact_json(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let (mut in_string, mut escaped) = (false, false);
    for c in text.chars() {
        if in_string {
            out.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if c == '"' {
            in_string = true;
            out.push(c);
        } else if !c.is_ascii_whitespace() {
            out.push(c);
        }
    }
    out
}

/// An attempt count as a table stores it (any integer type), for [`Event::attempts`]:
/// negative as 0, and past `u32::MAX` as `u32::MAX` (cast, 2^32 was 0: a row that had failed
/// that often started over, and no longer held back its key as a retrying row does).
pub fn attempts_of(stored: i64) -> u32 {
    u32::try_from(stored.max(0)).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dead_letter_of_an_undecodable_event_is_told_once_however_often_retried() {
        let marked = |reason: &str| Headers::from([(UNDECODABLE.to_string(), reason.to_string())]);
        let first = undecodable_dead_letter(&marked("headers must be a JSON object"), "T").unwrap();
        assert!(
            first.starts_with("headers must be a JSON object (this dead letter keeps"),
            "{first}"
        );
        let again = undecodable_dead_letter(&marked(&first), "T").unwrap();
        assert_eq!(again, first);
        let earlier = undecodable_dead_letter(&Headers::new(), UNDECODABLE_TYPE).unwrap();
        assert!(
            earlier.starts_with("it could not be read as an event"),
            "{earlier}"
        );
        assert_eq!(undecodable_dead_letter(&Headers::new(), "T"), None);
        let other = Headers::from([("h".to_string(), "v".to_string())]);
        assert_eq!(undecodable_dead_letter(&other, UNDECODABLE_TYPE), None);
    }

    #[test]
    fn attempt_counts_saturate_instead_of_wrapping() {
        assert_eq!(attempts_of(-3), 0);
        assert_eq!(attempts_of(7), 7);
        assert_eq!(attempts_of(1 << 32), u32::MAX);
        assert_eq!(attempts_of(i64::MAX), u32::MAX);
    }

    fn event(key: Option<&str>) -> Event {
        Event {
            partition_key: key.map(String::from),
            ..Event::new(1, Uuid::nil(), "orders", "created", Payload::Null)
        }
    }

    #[test]
    fn ordering_key_defaults_to_destination() {
        assert_eq!(event(None).ordering_key(), "orders");
        assert_eq!(event(Some("customer-7")).ordering_key(), "customer-7");
    }

    #[test]
    fn json_payload_is_kept_verbatim() {
        let p = Payload::from_json_text(r#"{"b": 1,  "a":[2]}"#.into()).unwrap();
        assert_eq!(p.as_bytes(), br#"{"b": 1,  "a":[2]}"#);
        assert!(Payload::from_json_text("{nope".into()).is_err());
    }

    #[test]
    fn headers_accept_objects_only() {
        let h = headers_from_json_text(r#"{"trace":"abc","n":5,"list":[1]}"#).unwrap();
        assert_eq!(h["trace"], "abc");
        assert_eq!(h["n"], "5");
        assert_eq!(h["list"], "[1]");
        assert!(headers_from_json_text("null").unwrap().is_empty());
        let err = headers_from_json_text("[1,2]").unwrap_err();
        assert!(
            err.contains("must be a JSON object, found an array"),
            "{err}"
        );
        for (text, kind) in [
            (r#""x""#, "a string"),
            ("true", "a boolean"),
            (" 7", "a number"),
        ] {
            let err = headers_from_json_text(text).unwrap_err();
            assert!(err.ends_with(kind), "{text}: {err}");
        }
    }

    /// Numbers went through `f64`: changed past 2^53, or refused past its range.
    #[test]
    fn header_values_keep_their_json_text_exactly_and_compacted() {
        let h = headers_from_json_text(
            r#"{"id": 9007199254740993, "price": 1.50, "big": 1e400,
                "o": { "a" : [1, 2], "s": "x \" y" }, "t": "caf\u00e9", "b": false}"#,
        )
        .unwrap();
        assert_eq!(h["id"], "9007199254740993");
        assert_eq!(h["price"], "1.50");
        assert_eq!(h["big"], "1e400");
        assert_eq!(h["o"], r#"{"a":[1,2],"s":"x \" y"}"#);
        assert_eq!(h["t"], "caf\u{e9}");
        assert_eq!(h["b"], "false");
        assert!(headers_from_json_text(r#"{"a": 1"#)
            .unwrap_err()
            .contains("not valid JSON"));
    }
}
