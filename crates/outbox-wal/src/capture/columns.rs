//! Events as the array parameters of the park and dead-letter statements, made storable:
//! what PostgreSQL refuses (a NUL) is made visible in a dead letter, and such an event is
//! never parked.

use super::*;

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
        self.errors.push(u.reason.clone());
    }

    /// An event that cannot be parked as it is, because of `what`.
    pub(super) fn push_event(&mut self, id: SequenceId, event: &Event, what: &str) {
        self.ids.push(id);
        self.columns.push(event);
        self.attempts.push(0);
        self.errors.push(format!(
            "{what}, which PostgreSQL cannot store: it could not wait in the parked table, so it \
             was dead-lettered, NULs shown as \\0 in text and a payload or headers holding \\u0000 \
             kept as their JSON text in a string"
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
        self.errors.push(park.error.clone());
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
        self.payloads
            .push(payload_json(&event.payload).map(|p| storable_json(&p)));
        let headers = serde_json::to_string(&event.headers).unwrap_or_else(|_| "{}".into());
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
        self.types.push("(undecodable)".into());
        // A message's bytes as (lossy) text: NULs shown, as jsonb stores no \u0000.
        self.payloads
            .push(serde_json::to_string(&visible_nul(&u.raw)).ok());
        self.headers.push("{}".into());
        self.mutations.push(None);
        self.rejected.push(false);
        self.created.push(SystemTime::now());
    }
}

/// What of `event` PostgreSQL cannot store as it is: a NUL byte in a text column, or
/// JSON jsonb refuses (`\u0000`, or half of a surrogate pair).
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
    if payload_json(&event.payload).is_some_and(|p| jsonb_refuses(&p)) {
        return Some("\\u0000 or a lone surrogate escape in its payload");
    }
    let headers = serde_json::to_string(&event.headers).unwrap_or_default();
    jsonb_refuses(&headers).then_some("\\u0000 or a lone surrogate escape in its headers")
}

/// `text` with each NUL shown as `\0`.
pub(super) fn visible_nul(text: &str) -> String {
    text.replace('\0', "\\0")
}

/// JSON text jsonb accepts: as it is, or (holding an escape jsonb refuses) as a JSON string
/// of itself.
pub(super) fn storable_json(json: &str) -> String {
    if jsonb_refuses(json) {
        serde_json::to_string(json).unwrap_or_else(|_| "null".into())
    } else {
        json.to_string()
    }
}

/// Whether JSON text holds an escape jsonb refuses: `\u0000`, or a `\uD800`-`\uDFFF` that is
/// not part of a high-then-low surrogate pair. (An escaped backslash followed by `u0000` is
/// no such escape.) The `json` type and the message form keep such text, jsonb does not.
pub(super) fn jsonb_refuses(json: &str) -> bool {
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
    false
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

    #[test]
    fn json_jsonb_refuses_is_kept_as_a_string_of_itself() {
        let json = r#"{"a":"\u0000"}"#;
        let stored = storable_json(json);
        assert!(!jsonb_refuses(&stored), "{stored}");
        let back: String = serde_json::from_str(&stored).unwrap();
        assert_eq!(back, json, "the text is kept whole");
        assert_eq!(storable_json(r#"{"a":1}"#), r#"{"a":1}"#);
    }

    #[test]
    fn an_event_with_a_nul_anywhere_cannot_be_parked() {
        let event = |destination: &str, payload: &str| {
            let payload = serde_json::value::RawValue::from_string(payload.into()).unwrap();
            Event::new(
                1,
                uuid::Uuid::nil(),
                destination,
                "T",
                Payload::Json(payload),
            )
        };
        assert_eq!(unstorable(&event("orders", "{}")), None);
        assert!(unstorable(&event("ord\0ers", "{}")).is_some());
        assert!(unstorable(&event("orders", r#"{"a":"\u0000"}"#)).is_some());
    }
}
