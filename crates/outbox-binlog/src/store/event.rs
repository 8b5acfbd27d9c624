//! A captured row as the engine's event, read by the names its layout's [`Mapping`] gives
//! its columns (the binary log carries them as text): the native table, its BLACKHOLE form
//! (which has no `sequence_id`, `rejected` or `available_at`), and mapped tables (the MySQL
//! seed's `outbox_events`, custom mappings), whose rows without an event id column get the
//! id polling would give them ([`derived_event_id`]).

use std::time::SystemTime;

use outbox_core::event::headers_from_json_text;
use outbox_core::time::parse_timestamp;
use outbox_core::{Event, Headers, Payload};
use serde_json::value::RawValue;

use outbox_layout::memory::derived_event_id;
use outbox_layout::{KeyFallback, Mapping, State};

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

/// Reads `row` as an event of the table `mapping` describes (its `sequence_id` is left 0:
/// the capture gives it its id); `None` for a row inserted in a state other than the
/// layout's pending one (delivered or dead already), which polling would not claim either.
pub fn decode(row: &Row, mapping: &Mapping) -> Option<Captured> {
    if !is_pending(row, mapping) {
        return None;
    }
    let row_id = row.get(&mapping.id);
    let sequence_id = row_id.and_then(|id| id.parse::<i64>().ok());
    let event_id = || match &mapping.event_id {
        Some(column) => row.get(column).map(str::to_string),
        None => row_id.map(|id| derived_event_id(mapping, id).to_string()),
    };
    let destination = row.get(&mapping.destination).map(str::to_string);
    let partition_key = match &mapping.key {
        Some(column) => row.get(column).map(str::to_string),
        // A table without a key column: every event carries the key polling gives it.
        None => match mapping.key_fallback {
            KeyFallback::Destination => destination.clone(),
            KeyFallback::Row => row_id.map(|id| format!("row:{id}")),
        },
    };
    let undecodable = |reason: String| {
        Box::new(Undecodable {
            reason,
            event_id: event_id().and_then(|id| id.parse().ok()),
            destination: destination.clone(),
            partition_key: partition_key.clone(),
        })
    };
    let event = match row.undecodable() {
        Some(reason) => Err(undecodable(format!("the row cannot be read: {reason}"))),
        None => event_of(row, mapping, event_id(), partition_key.clone()).map_err(undecodable),
    };
    let not_before = mapping
        .available_at
        .as_deref()
        .and_then(|column| row.get(column))
        .and_then(|at| parse_timestamp(at, true).ok())
        .filter(|at| *at > SystemTime::now());
    Some(Captured {
        row: sequence_id,
        not_before,
        event,
    })
}

/// Whether an inserted row is in the layout's pending state. The log carries a flag or a
/// status as the column's text (a MySQL boolean as `0` or `1`), so `false` and `true` in a
/// mapping match those too, as they do in MySQL's own comparison.
fn is_pending(row: &Row, mapping: &Mapping) -> bool {
    let (State::Flag {
        column, pending, ..
    }
    | State::Status {
        column, pending, ..
    }) = &mapping.state
    else {
        return true;
    };
    match (row.get(column), pending.as_str()) {
        (Some(value), pending) if value == pending => true,
        (Some("0"), "false") | (Some("1"), "true") => true,
        _ => false,
    }
}

fn event_of(
    row: &Row,
    mapping: &Mapping,
    event_id: Option<String>,
    partition_key: Option<String>,
) -> Result<Event, String> {
    let get = |column: &Option<String>| column.as_deref().and_then(|c| row.get(c));
    let required = |column: &str| {
        row.get(column)
            .ok_or_else(|| format!("{column} is NULL or missing"))
    };
    let event_id = event_id
        .ok_or_else(|| match &mapping.event_id {
            Some(column) => format!("{column} is NULL or missing"),
            None => format!("{} is NULL or missing", mapping.id),
        })?
        .parse()
        .map_err(|e| format!("the event id is not a UUID: {e}"))?;
    let payload = match row.get(&mapping.payload) {
        None => Payload::Null,
        Some(text) => Payload::Json(
            RawValue::from_string(text.to_string())
                .map_err(|e| format!("{} is not JSON: {e}", mapping.payload))?,
        ),
    };
    let headers = match get(&mapping.headers) {
        None => Headers::new(),
        Some(text) => headers_from_json_text(text)?,
    };
    let created_at = match get(&mapping.created_at) {
        Some(text) => parse_timestamp(text, true)?,
        None => SystemTime::now(),
    };
    let destination = required(&mapping.destination)?;
    Ok(Event {
        partition_key,
        headers,
        mutation_id: get(&mapping.mutation_id).map(str::to_string),
        rejected: matches!(get(&mapping.rejected), Some(flag) if flag != "0"),
        created_at,
        ..Event::new(
            0,
            event_id,
            destination,
            match &mapping.event_type {
                Some(column) => required(column)?,
                None => destination,
            },
            payload,
        )
    })
}
