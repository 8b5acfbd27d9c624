//! A captured row as the engine's event: the native layout's columns as the binary log
//! carries them (text), in the table form and the BLACKHOLE form (which has no
//! `sequence_id`, `rejected` or `available_at`) alike.

use std::time::SystemTime;

use outbox_core::event::headers_from_json_text;
use outbox_core::time::parse_timestamp;
use outbox_core::{Event, Headers, Payload};
use serde_json::value::RawValue;

use crate::Row;

/// A row that is no event: dead-lettered with the reason, never dropped.
#[derive(Clone, Debug)]
pub struct Undecodable {
    pub reason: String,
    pub event_id: Option<uuid::Uuid>,
    pub destination: Option<String>,
    pub partition_key: Option<String>,
}

impl Undecodable {
    /// The key the row's event would have had: it waits behind that key's earlier events.
    pub fn ordering_key(&self) -> &str {
        self.partition_key
            .as_deref()
            .or(self.destination.as_deref())
            .unwrap_or("")
    }
}

/// One row read from the log.
#[derive(Debug)]
pub struct Captured {
    /// The outbox row's `sequence_id` (table form), deleted once the event is settled.
    pub row: Option<i64>,
    /// When the row asks to be sent no earlier than a later time (`available_at`).
    pub not_before: Option<SystemTime>,
    pub event: Result<Event, Box<Undecodable>>,
}

/// Reads `row` as an event (its `sequence_id` is left 0: the capture gives it its id).
pub fn decode(row: &Row) -> Captured {
    let sequence_id = row.get("sequence_id").and_then(|id| id.parse::<i64>().ok());
    let undecodable = |reason: String| {
        Box::new(Undecodable {
            reason,
            event_id: row.get("event_id").and_then(|id| id.parse().ok()),
            destination: row.get("destination").map(str::to_string),
            partition_key: row.get("partition_key").map(str::to_string),
        })
    };
    let event = match row.undecodable() {
        Some(reason) => Err(undecodable(format!("the row cannot be read: {reason}"))),
        None => event_of(row).map_err(undecodable),
    };
    let not_before = row
        .get("available_at")
        .and_then(|at| parse_timestamp(at, true).ok())
        .filter(|at| *at > SystemTime::now());
    Captured {
        row: sequence_id,
        not_before,
        event,
    }
}

fn event_of(row: &Row) -> Result<Event, String> {
    let required = |column: &str| {
        row.get(column)
            .ok_or_else(|| format!("{column} is NULL or missing"))
    };
    let event_id = required("event_id")?
        .parse()
        .map_err(|e| format!("event_id is not a UUID: {e}"))?;
    let payload = match row.get("payload") {
        None => Payload::Null,
        Some(text) => Payload::Json(
            RawValue::from_string(text.to_string())
                .map_err(|e| format!("payload is not JSON: {e}"))?,
        ),
    };
    let headers = match row.get("headers") {
        None => Headers::new(),
        Some(text) => headers_from_json_text(text)?,
    };
    let created_at = match row.get("created_at") {
        Some(text) => parse_timestamp(text, true)?,
        None => SystemTime::now(),
    };
    Ok(Event {
        partition_key: row.get("partition_key").map(str::to_string),
        headers,
        mutation_id: row.get("mutation_id").map(str::to_string),
        rejected: matches!(row.get("rejected"), Some(flag) if flag != "0"),
        created_at,
        ..Event::new(
            0,
            event_id,
            required("destination")?,
            required("event_type")?,
            payload,
        )
    })
}
