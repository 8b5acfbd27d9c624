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
/// `\u0000` in JSON (jsonb refuses it).
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
    if payload_json(&event.payload).is_some_and(|p| holds_nul_escape(&p)) {
        return Some("\\u0000 in its payload");
    }
    let headers = serde_json::to_string(&event.headers).unwrap_or_default();
    holds_nul_escape(&headers).then_some("\\u0000 in its headers")
}

/// `text` with each NUL shown as `\0`.
pub(super) fn visible_nul(text: &str) -> String {
    text.replace('\0', "\\0")
}

/// JSON text jsonb accepts: as it is, or (holding `\u0000`) as a JSON string of itself.
pub(super) fn storable_json(json: &str) -> String {
    if holds_nul_escape(json) {
        serde_json::to_string(json).unwrap_or_else(|_| "null".into())
    } else {
        json.to_string()
    }
}

/// Whether JSON text holds the escape `\u0000` (an escaped backslash followed by `u0000`
/// is no such escape).
pub(super) fn holds_nul_escape(json: &str) -> bool {
    let bytes = json.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' {
            if bytes[i + 1..].starts_with(b"u0000") {
                return true;
            }
            // Skip the escaped character (a backslash among them).
            i += 2;
        } else {
            i += 1;
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
        assert!(holds_nul_escape(r#"{"a":"\u0000"}"#));
        assert!(
            holds_nul_escape(r#"["x\\\u0000"]"#),
            "an escaped backslash, then the escape"
        );
        assert!(
            !holds_nul_escape(r#"{"a":"\\u0000"}"#),
            "a backslash, then text"
        );
        assert!(!holds_nul_escape(r#"{"a":"\u0001"}"#));
        assert!(!holds_nul_escape(r#"{"a":"ends with a backslash\"#));
    }

    #[test]
    fn json_jsonb_refuses_is_kept_as_a_string_of_itself() {
        let json = r#"{"a":"\u0000"}"#;
        let stored = storable_json(json);
        assert!(!holds_nul_escape(&stored), "{stored}");
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
