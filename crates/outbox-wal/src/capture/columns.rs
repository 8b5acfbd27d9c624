//! Events as the array parameters of the park and dead-letter statements, made storable:
//! a payload jsonb refuses is kept as the JSON string of its text, marked in the headers
//! ([`PAYLOAD_KEPT_AS_TEXT`]); what PostgreSQL refuses otherwise (a NUL in a text column)
//! is made visible in a dead letter, and such an event is never parked.

use super::*;
use outbox_core::event::{PAYLOAD_KEPT_AS_TEXT, UNDECODABLE, UNDECODABLE_TYPE};

/// Undecodable events as the parameters of the dead-letter statement, with no attempt
/// made.
#[derive(Default)]
pub(super) struct DeadColumns {
    pub(super) ids: Vec<SequenceId>,
    pub(super) columns: EventColumns,
    pub(super) attempts: Vec<i32>,
    pub(super) errors: Vec<String>,
}

impl DeadColumns {
    pub(super) fn push(&mut self, id: SequenceId, position: EventPosition, u: &Undecodable) {
        self.ids.push(id);
        self.columns.push_undecodable(u, position);
        self.attempts.push(0);
        self.errors.push(visible_nul(&u.reason));
    }

    /// An event that cannot be parked as it is, because of `what`.
    pub(super) fn push_event(&mut self, id: SequenceId, event: &Event, what: &str) {
        self.ids.push(id);
        self.columns.push(event);
        self.attempts.push(0);
        self.errors.push(format!(
            "{what}, which PostgreSQL cannot store: it could not wait in the parked table, so it \
             was dead-lettered, NULs shown as \\0 in text and headers jsonb refuses kept as \
             their JSON text in a string"
        ));
    }

    pub(super) fn params(&self) -> Vec<&(dyn ToSql + Sync)> {
        self.columns
            .params(&[&self.ids], &[&self.attempts, &self.errors])
    }
}

/// Events as the array parameters of the park and dead-letter statements.
#[derive(Default)]
pub(super) struct EventColumns {
    pub(super) event_ids: Vec<uuid::Uuid>,
    pub(super) destinations: Vec<String>,
    pub(super) keys: Vec<Option<String>>,
    pub(super) types: Vec<String>,
    pub(super) payloads: Vec<Option<String>>,
    pub(super) headers: Vec<String>,
    pub(super) mutations: Vec<Option<String>>,
    pub(super) rejected: Vec<bool>,
    pub(super) created: Vec<SystemTime>,
    pub(super) parking: ParkColumns,
}

#[derive(Default)]
pub(super) struct ParkColumns {
    pub(super) delays: Vec<i64>,
    pub(super) not_before: Vec<Option<SystemTime>>,
    pub(super) attempts: Vec<i32>,
    pub(super) errors: Vec<Option<String>>,
}

impl ParkColumns {
    pub(super) fn push(&mut self, park: &Park) {
        self.delays
            .push(i64::try_from(park.delay.as_millis()).unwrap_or(i64::MAX));
        self.not_before.push(park.not_before);
        self.attempts
            .push(i32::try_from(park.attempts).unwrap_or(i32::MAX));
        // The engine's errors hold no NUL; the capture's own reasons (an undecodable event
        // behind a parked key) quote what the message held.
        self.errors.push(park.error.as_deref().map(visible_nul));
    }
}

impl EventColumns {
    /// A statement's parameters: `before`, the event columns in the order the park and
    /// dead-letter statements both take them, then `after`.
    pub(super) fn params<'a>(
        &'a self,
        before: &[&'a (dyn ToSql + Sync)],
        after: &[&'a (dyn ToSql + Sync)],
    ) -> Vec<&'a (dyn ToSql + Sync)> {
        let columns: [&'a (dyn ToSql + Sync); 9] = [
            &self.event_ids,
            &self.destinations,
            &self.keys,
            &self.types,
            &self.payloads,
            &self.headers,
            &self.mutations,
            &self.rejected,
            &self.created,
        ];
        [before, &columns, after].concat()
    }

    /// An event's columns, made storable: what PostgreSQL refuses ([`unstorable`]) is made
    /// visible instead (only dead letters get such an event; parks check first).
    pub(super) fn push(&mut self, event: &Event) {
        self.event_ids.push(event.event_id);
        self.destinations.push(visible_nul(&event.destination));
        self.keys
            .push(event.partition_key.as_deref().map(visible_nul));
        self.types.push(visible_nul(&event.event_type));
        // A payload jsonb refuses is kept as a JSON string of its text, marked in the
        // headers so that a claim of the row (or of its dead letter, retried) reads the
        // text again ([`Payload::restore_kept`]). A marker the event brought is not kept:
        // the name is the relay's.
        let mut headers = event.headers.clone();
        headers.remove(PAYLOAD_KEPT_AS_TEXT);
        let payload = payload_json(&event.payload).map(|p| {
            if !jsonb_refuses(&p) {
                p
            } else if p.len() <= JSONB_STRING_BYTES {
                headers.insert(PAYLOAD_KEPT_AS_TEXT.into(), "true".into());
                serde_json::to_string(&p).unwrap_or_else(|_| "null".into())
            } else {
                // Not even as a string: a note of its size (only a dead letter gets it).
                storable_json(&p)
            }
        });
        self.payloads.push(payload);
        let headers = serde_json::to_string(&headers).unwrap_or_else(|_| "{}".into());
        self.headers.push(storable_json(&headers));
        self.mutations
            .push(event.mutation_id.as_deref().map(visible_nul));
        self.rejected.push(event.rejected);
        self.created.push(event.created_at);
    }

    pub(super) fn push_undecodable(&mut self, u: &Undecodable, position: EventPosition) {
        self.event_ids
            .push(u.event_id.unwrap_or_else(|| position.derived_event_id()));
        self.destinations
            .push(visible_nul(u.destination.as_deref().unwrap_or_default()));
        self.keys.push(u.partition_key.as_deref().map(visible_nul));
        self.types.push(UNDECODABLE_TYPE.into());
        // A message's bytes as (lossy) text: NULs shown, as jsonb stores no \u0000.
        self.payloads
            .push(serde_json::to_string(&visible_nul(&u.raw)).ok());
        // Marked, so that a retry finds it undecodable again instead of publishing it.
        let marker = std::collections::BTreeMap::from([(UNDECODABLE, visible_nul(&u.reason))]);
        let headers = serde_json::to_string(&marker).unwrap_or_else(|_| "{}".into());
        self.headers.push(storable_json(&headers));
        self.mutations.push(None);
        self.rejected.push(false);
        self.created.push(SystemTime::now());
    }
}

/// What of `event` PostgreSQL cannot store, even with its payload kept as text: a NUL byte
/// in a text column, JSON jsonb refuses in its headers (`\u0000`, or half of a surrogate
/// pair), or a refused payload too long even as a string.
pub(super) fn unstorable(event: &Event) -> Option<&'static str> {
    let text = [
        Some(event.destination.as_str()),
        event.partition_key.as_deref(),
        Some(event.event_type.as_str()),
        event.mutation_id.as_deref(),
    ];
    if text.into_iter().flatten().any(|t| t.contains('\0')) {
        return Some("a NUL byte in its destination, key, type or mutation id");
    }
    if payload_json(&event.payload)
        .is_some_and(|p| jsonb_refuses(&p) && p.len() > JSONB_STRING_BYTES)
    {
        return Some("a payload jsonb refuses, too long to keep even as its JSON text");
    }
    let headers = serde_json::to_string(&event.headers).unwrap_or_default();
    jsonb_refuses(&headers).then_some("\\u0000 or a lone surrogate escape in its headers")
}

/// `text` with each NUL shown as `\0`, by the stores' one rule for it
/// ([`outbox_core::store::storable_error`]).
pub(super) fn visible_nul(text: &str) -> String {
    outbox_core::store::storable_error(text.to_string())
}

/// JSON text jsonb accepts: as it is, or (holding an escape jsonb refuses) as a JSON string
/// of itself.
pub(super) fn storable_json(json: &str) -> String {
    if json.len() > JSONB_STRING_BYTES {
        // Not even as a string: said instead, so that the dead letter is written at all.
        let said = format!(
            "(JSON of {} bytes, more than a jsonb value holds: not kept)",
            json.len()
        );
        serde_json::to_string(&said).unwrap_or_else(|_| "null".into())
    } else if jsonb_refuses(json) {
        serde_json::to_string(json).unwrap_or_else(|_| "null".into())
    } else {
        json.to_string()
    }
}

/// Whether JSON text holds what jsonb refuses: the escape `\u0000`, a `\uD800`-`\uDFFF` that
/// is not part of a high-then-low surrogate pair (an escaped backslash followed by `u0000`
/// is no such escape), a number out of `numeric`'s range, nesting deeper than
/// [`JSONB_DEPTH`], or more than [`JSONB_BYTES`]. The `json` type and the message form keep
/// such text, jsonb does not: a park that met it failed, first in every claim, for good.
pub(super) fn jsonb_refuses(json: &str) -> bool {
    if json.len() > JSONB_BYTES {
        return true;
    }
    let bytes = json.as_bytes();
    let unicode_escape = |at: usize| -> Option<u16> {
        let hex = bytes.get(at..at + 6)?;
        if !hex.starts_with(b"\\u") {
            return None;
        }
        u16::from_str_radix(std::str::from_utf8(&hex[2..]).ok()?, 16).ok()
    };
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'\\' {
            i += 1;
            continue;
        }
        match unicode_escape(i) {
            Some(0) => return true,
            Some(0xD800..=0xDBFF) => match unicode_escape(i + 6) {
                Some(0xDC00..=0xDFFF) => i += 12,
                _ => return true,
            },
            Some(0xDC00..=0xDFFF) => return true,
            Some(_) => i += 6,
            // Skip the escaped character (a backslash among them).
            None => i += 2,
        }
    }
    has_a_number_numeric_refuses(bytes)
}

/// The deepest nesting taken for storable as jsonb. PostgreSQL's parser recurses for each
/// level, and refuses past `max_stack_depth` (2 MB by default: far deeper; its own tests
/// refuse 10,000 levels under 100 kB); no event needs a thousand.
const JSONB_DEPTH: usize = 1_000;

/// The longest JSON text taken for storable as jsonb. Its values' offsets are 28 bits (256
/// MiB) in the binary form, which can be four times the text (`1,` is 8 bytes there).
const JSONB_BYTES: usize = 64 * 1024 * 1024;

/// The longest text stored as one jsonb string (with its quotes and escapes): past it, a
/// dead letter keeps a note of its size instead.
const JSONB_STRING_BYTES: usize = 0x0FFF_FFFF - 1024;

/// Whether JSON text holds a number outside jsonb's `numeric` ("value overflows numeric
/// format": more than 131,072 digits before the decimal point, more than 16,383 after it,
/// or an exponent PostgreSQL does not read at all), or nests deeper than [`JSONB_DEPTH`].
/// JSON, serde and the `json` type take any such text.
fn has_a_number_numeric_refuses(json: &[u8]) -> bool {
    let mut i = 0;
    let mut in_string = false;
    let mut depth = 0usize;
    while i < json.len() {
        let b = json[i];
        if in_string {
            match b {
                b'\\' => i += 2,
                b'"' => {
                    in_string = false;
                    i += 1;
                }
                _ => i += 1,
            }
            continue;
        }
        if b == b'"' {
            in_string = true;
            i += 1;
        } else if b == b'[' || b == b'{' {
            depth += 1;
            if depth > JSONB_DEPTH {
                return true;
            }
            i += 1;
        } else if b == b']' || b == b'}' {
            depth = depth.saturating_sub(1);
            i += 1;
        } else if b == b'-' || b.is_ascii_digit() {
            let start = i;
            while i < json.len()
                && matches!(json[i], b'0'..=b'9' | b'.' | b'e' | b'E' | b'+' | b'-')
            {
                i += 1;
            }
            if numeric_refuses(&json[start..i]) {
                return true;
            }
        } else {
            i += 1;
        }
    }
    false
}

/// Whether PostgreSQL's `numeric` refuses the JSON number `token` as out of its range.
fn numeric_refuses(token: &[u8]) -> bool {
    /// Decimal digits before the point: a base-10,000 weight of at most 32,767.
    const MAX_DIGITS_BEFORE_POINT: i64 = 131_072;
    /// Digits after the point (`NUMERIC_DSCALE_MAX`).
    const MAX_DIGITS_AFTER_POINT: i64 = 16_383;
    /// PostgreSQL refuses an exponent this large before looking at the digits.
    const MAX_EXPONENT: i64 = (i32::MAX / 2) as i64;
    let token = token.strip_prefix(b"-").unwrap_or(token);
    let (mantissa, exponent) = match token.iter().position(|b| matches!(b, b'e' | b'E')) {
        Some(at) => (&token[..at], &token[at + 1..]),
        None => (token, &b""[..]),
    };
    let (negative, digits) = match exponent.split_first() {
        Some((b'-', rest)) => (true, rest),
        Some((b'+', rest)) => (false, rest),
        _ => (false, exponent),
    };
    let magnitude = digits.iter().fold(0i64, |n, d| {
        n.saturating_mul(10)
            .saturating_add(i64::from(d.wrapping_sub(b'0')))
    });
    if magnitude >= MAX_EXPONENT {
        return true;
    }
    let exponent = if negative { -magnitude } else { magnitude };
    let (integer, fraction) = match mantissa.iter().position(|b| *b == b'.') {
        Some(at) => (&mantissa[..at], &mantissa[at + 1..]),
        None => (mantissa, &b""[..]),
    };
    if fraction.len() as i64 - exponent > MAX_DIGITS_AFTER_POINT {
        return true;
    }
    let significant = integer.iter().skip_while(|d| **d == b'0').count() as i64;
    let before_point = if significant > 0 {
        significant + exponent
    } else {
        match fraction.iter().position(|d| *d != b'0') {
            Some(zeros) => exponent - zeros as i64,
            // Zero: no digit before the point, whatever the exponent.
            None => return false,
        }
    };
    before_point > MAX_DIGITS_BEFORE_POINT
}

/// A payload as JSON text for a jsonb column (bytes as a JSON string).
pub(super) fn payload_json(payload: &Payload) -> Option<String> {
    match payload {
        Payload::Null => None,
        Payload::Json(raw) => Some(raw.get().to_string()),
        Payload::Bytes(bytes) => serde_json::to_string(&String::from_utf8_lossy(bytes)).ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// JSON too long for jsonb, even as a string, is said in its dead letter instead of
    /// kept: stored, the dead letter failed, and with it every claim, for good.
    #[test]
    fn json_too_long_for_a_jsonb_string_is_kept_as_a_note_of_its_size() {
        let long = format!("[\"{}\"]", "x".repeat(JSONB_STRING_BYTES));
        let stored = storable_json(&long);
        assert!(stored.len() < 200, "{}", &stored[..200.min(stored.len())]);
        assert!(stored.contains("not kept"), "{stored}");
        let string = format!("[\"{}\"]", "x".repeat(JSONB_BYTES));
        assert!(jsonb_refuses(&string));
        assert_eq!(
            storable_json(&string),
            serde_json::to_string(&string).unwrap()
        );
    }

    /// Nesting past what PostgreSQL's parser takes failed a park in every claim, for good.
    #[test]
    fn nesting_deeper_than_a_thousand_is_refused_and_brackets_in_strings_do_not_count() {
        let nested = |depth: usize| format!("{}1{}", "[".repeat(depth), "]".repeat(depth));
        assert!(!jsonb_refuses(&nested(JSONB_DEPTH)));
        assert!(jsonb_refuses(&nested(JSONB_DEPTH + 1)));
        assert!(jsonb_refuses(&nested(1_000_000)));
        let quoted = format!(r#"{{"a":"{}"}}"#, "[".repeat(5_000));
        assert!(!jsonb_refuses(&quoted));
        let siblings = format!("[{}]", vec!["[[1]]"; 5_000].join(","));
        assert!(!jsonb_refuses(&siblings), "wide, not deep");
    }

    #[test]
    fn only_an_unescaped_u0000_is_the_escape_jsonb_refuses() {
        assert!(jsonb_refuses(r#"{"a":"\u0000"}"#));
        assert!(
            jsonb_refuses(r#"["x\\\u0000"]"#),
            "an escaped backslash, then the escape"
        );
        assert!(
            !jsonb_refuses(r#"{"a":"\\u0000"}"#),
            "a backslash, then text"
        );
        assert!(!jsonb_refuses(r#"{"a":"\u0001"}"#));
        assert!(!jsonb_refuses(r#"{"a":"ends with a backslash\"#));
    }

    #[test]
    fn half_a_surrogate_pair_is_refused_and_a_whole_pair_is_not() {
        assert!(!jsonb_refuses(r#"["\ud83d\ude00"]"#), "a pair: 😀");
        assert!(!jsonb_refuses(r#"["\uD83D\uDE00 and \u00e9"]"#));
        assert!(jsonb_refuses(r#"["\ud800"]"#), "a high one alone");
        assert!(jsonb_refuses(r#"["\ud800x"]"#), "a high one before text");
        assert!(
            jsonb_refuses(r#"["\ud800\u0041"]"#),
            "a high one before no low one"
        );
        assert!(jsonb_refuses(r#"["\udc00"]"#), "a low one alone");
        assert!(
            jsonb_refuses(r#"["\ud83d\ude00\udc00"]"#),
            "a pair, then a low one"
        );
        assert!(!jsonb_refuses(r#"["\\ud800"]"#), "a backslash, then text");
        let stored = storable_json(r#"["\ud800"]"#);
        assert!(!jsonb_refuses(&stored), "{stored}");
    }

    /// Each as PostgreSQL 15 answered `SELECT '<number>'::jsonb`.
    #[test]
    fn numbers_out_of_numerics_range_are_refused_as_postgresql_refuses_them() {
        let taken = [
            "1e131071",
            "-1e131071",
            "1E+131071",
            "123.456e131069",
            "100e131069",
            "0.00012e131075",
            "1e-16383",
            "0e-16383",
            "1.5e-16382",
            "0e1000000",
            "12.5",
            "-0",
        ];
        let refused = [
            "1e131072",
            "123.456e131070",
            "100e131070",
            "0.00012e131076",
            "1e-16384",
            "0e-16384",
            "0e-20000",
            "1.5e-16383",
            "1e-1000000",
            "1e99999999999999999999",
        ];
        for n in taken {
            assert!(!jsonb_refuses(&format!(r#"{{"a":[{n}]}}"#)), "{n}");
        }
        for n in refused {
            assert!(jsonb_refuses(&format!(r#"{{"a":[{n}]}}"#)), "{n}");
        }
        assert!(
            !jsonb_refuses(r#"{"a":"1e131072 in \"a string\""}"#),
            "text"
        );
        let stored = storable_json(r#"{"a":1e131072}"#);
        assert!(!jsonb_refuses(&stored), "{stored}");
    }

    #[test]
    fn json_jsonb_refuses_is_kept_as_a_string_of_itself() {
        let json = r#"{"a":"\u0000"}"#;
        let stored = storable_json(json);
        assert!(!jsonb_refuses(&stored), "{stored}");
        let back: String = serde_json::from_str(&stored).unwrap();
        assert_eq!(back, json, "the text is kept whole");
        assert_eq!(storable_json(r#"{"a":1}"#), r#"{"a":1}"#);
    }

    fn event(destination: &str, payload: &str) -> Event {
        let payload = serde_json::value::RawValue::from_string(payload.into()).unwrap();
        Event::new(
            1,
            uuid::Uuid::nil(),
            destination,
            "T",
            Payload::Json(payload),
        )
    }

    #[test]
    fn an_event_with_a_nul_in_a_text_column_cannot_be_parked() {
        assert_eq!(unstorable(&event("orders", "{}")), None);
        assert!(unstorable(&event("ord\0ers", "{}")).is_some());
    }

    /// A payload jsonb refuses was dead-lettered when its event had to wait behind a retry
    /// (a transient failure made permanent), and a retry of the dead letter published its
    /// text as a JSON string. It is parked as the JSON string of its text, marked, and read
    /// back whole.
    #[test]
    fn a_payload_jsonb_refuses_is_parked_as_its_text_and_read_back_whole() {
        let json = r#"{"a":"\u0000","b":1e131072}"#;
        let waiting = event("orders", json);
        assert_eq!(unstorable(&waiting), None);
        let mut columns = EventColumns::default();
        columns.push(&waiting);
        let stored = columns.payloads[0].clone().unwrap();
        assert!(!jsonb_refuses(&stored), "{stored}");
        let mut headers = outbox_core::event::headers_from_json_text(&columns.headers[0]).unwrap();
        assert!(headers.contains_key(PAYLOAD_KEPT_AS_TEXT), "{headers:?}");
        let back = Payload::from_json_text(stored)
            .unwrap()
            .restore_kept(&mut headers)
            .unwrap();
        assert_eq!(back.as_bytes(), json.as_bytes());
        assert!(headers.is_empty(), "the marker is taken out: {headers:?}");
        // A payload jsonb takes is stored as it is, unmarked.
        let mut plain = EventColumns::default();
        plain.push(&event("orders", r#"{"a":1}"#));
        assert_eq!(plain.payloads[0].as_deref(), Some(r#"{"a":1}"#));
        assert_eq!(plain.headers[0], "{}");
    }
}
