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
use outbox_layout::{KeyFallback, Mapping, Seed, State};

use crate::reread::RowIdentity;
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
    /// Which event the row is, in every session that reads it.
    pub(crate) identity: Option<RowIdentity>,
}

/// Reads `row` as an event of the table `mapping` describes (its `sequence_id` is left 0:
/// the capture gives it its id); `None` for a row inserted in a state other than the
/// layout's pending one (delivered or dead already), which polling would not claim either.
pub fn decode(row: &Row, mapping: &Mapping) -> Option<Captured> {
    // A row whose state is unknown is dead-lettered with the reason; one whose state is
    // known and not pending is no event, whatever else of it is unknown.
    let state_column = match &mapping.state {
        State::Flag { column, .. } | State::Status { column, .. } => Some(column.as_str()),
        State::Rows => None,
    };
    if state_column.and_then(|c| row.unknown(c)).is_none() && !is_pending(row, mapping) {
        return None;
    }
    // Only the columns the layout reads matter (a TEXT column the INSERT did not name, left
    // out under NOBLOB, is nothing to this relay).
    let unknown = read_columns(mapping).find_map(|column| row.unknown(column));
    let row_id = row.get(&mapping.id);
    let sequence_id = row_id.and_then(|id| id.parse::<i64>().ok());
    let event_id = || match &mapping.event_id {
        Some(column) => row.get(column).map(|id| id.trim().to_string()),
        None => row_id.map(|id| derived_event_id(mapping, id).to_string()),
    };
    let destination = row.get(&mapping.destination).map(str::to_string);
    let native = mapping.seed == Some(Seed::NativeMysql);
    let partition_key = match mapping.key.as_deref().and_then(|column| row.get(column)) {
        Some(key) => Some(key.to_string()),
        // The native table's events keep no key; a mapped table's carry the one polling
        // gives them.
        None if native => None,
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
    let event = match unknown {
        Some(reason) => Err(undecodable(format!("the row cannot be read: {reason}"))),
        None => event_of(row, mapping, event_id(), partition_key.clone())
            .and_then(|event| fits_the_parked_table(&event).map(|()| event))
            .map_err(undecodable),
    };
    let not_before = mapping
        .available_at
        .as_deref()
        .and_then(|column| row.get(column))
        .and_then(|at| parse_timestamp(at, true).ok())
        .filter(|at| *at > SystemTime::now());
    let event_id = match &event {
        Ok(event) => Some(event.event_id),
        Err(u) => u.event_id,
    };
    Some(Captured {
        row: sequence_id,
        not_before,
        identity: RowIdentity::of(row_id.map(RowIdentity::row_key), event_id),
        event,
    })
}

/// The columns of the outbox table that its rows are read by: those the layout reads, of
/// the BLACKHOLE table's columns alone in the table-less form (it has no id, lease or
/// schedule). The relay's start checked that the table has each.
pub fn needed_columns(mapping: &Mapping, blackhole: bool) -> Vec<String> {
    read_columns(mapping)
        .filter(|column| !blackhole || crate::schema::blackhole_columns().any(|c| c == *column))
        .map(str::to_string)
        .collect()
}

/// The first of `needed` that `columns` (a row's table, as described) lacks.
pub fn missing_column<'n>(needed: &'n [String], columns: &[String]) -> Option<&'n str> {
    needed
        .iter()
        .find(|column| !columns.contains(column))
        .map(String::as_str)
}

/// The columns of the outbox table the layout reads.
fn read_columns(mapping: &Mapping) -> impl Iterator<Item = &str> {
    let state = match &mapping.state {
        State::Flag { column, .. } | State::Status { column, .. } => Some(column),
        State::Rows => None,
    };
    [
        Some(&mapping.id),
        Some(&mapping.destination),
        Some(&mapping.payload),
        state,
    ]
    .into_iter()
    .chain([
        mapping.event_id.as_ref(),
        mapping.key.as_ref(),
        mapping.event_type.as_ref(),
        mapping.headers.as_ref(),
        mapping.mutation_id.as_ref(),
        mapping.rejected.as_ref(),
        mapping.created_at.as_ref(),
        mapping.available_at.as_ref(),
    ])
    .flatten()
    .map(String::as_str)
}

/// The parked table's `varchar(255)` columns, which a park writes: a mapped table's longer
/// destination, key or type could never be parked (the native table has the same limits).
pub const PARKED_TEXT_CHARS: usize = 255;

fn fits_the_parked_table(event: &Event) -> Result<(), String> {
    let too_long = [
        ("destination", Some(&event.destination)),
        ("partition key", event.partition_key.as_ref()),
        ("event type", Some(&event.event_type)),
    ]
    .into_iter()
    .find(|(_, value)| value.is_some_and(|v| v.chars().count() > PARKED_TEXT_CHARS));
    match too_long {
        Some((what, _)) => Err(format!(
            "the {what} is longer than {PARKED_TEXT_CHARS} characters, which binlog capture's \
             parked table holds"
        )),
        None => Ok(()),
    }
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
    // MySQL compares with the column's collation, most often case-insensitive.
    match (row.get(column), pending.as_str()) {
        (Some(value), pending) if value.eq_ignore_ascii_case(pending) => true,
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
    // Without a column of its own, when its transaction was logged (as WAL capture takes
    // the commit's time): `run --drain` tells the rows written before it began by it.
    let created_at = match get(&mapping.created_at) {
        Some(text) => parse_timestamp(text, true)?,
        None => row.logged_at().unwrap_or_else(SystemTime::now),
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
            // Polling's rule: no type column, or NULL in it, is the destination.
            get(&mapping.event_type).unwrap_or(destination),
            payload,
        )
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// A row of the MySQL seed's table, its `type` left out of the row image, `isConsumed` as
    /// given (`None`: left out too).
    fn row(consumed: Option<&str>) -> Row {
        let columns = [
            "id",
            "type",
            "message",
            "isConsumed",
            "createdAt",
            "updatedAt",
        ];
        let mut unknown = vec![(1, "column type is not in the row image".to_string())];
        if consumed.is_none() {
            unknown.push((3, "column isConsumed is not in the row image".to_string()));
        }
        Row {
            columns: Arc::new(columns.map(String::from).to_vec()),
            values: vec![
                Some("7".into()),
                None,
                Some("{}".into()),
                consumed.map(String::from),
                Some("2026-12-02 00:00:00.000000".into()),
                None,
            ],
            unknown,
            ordinal: 1,
            logged_at: None,
        }
    }

    #[test]
    fn the_columns_rows_are_read_by_are_the_layouts_and_of_a_blackhole_table_its_own() {
        let native = Mapping::native_mysql(None, "outbox", false);
        let needed = needed_columns(&native, false);
        for column in ["sequence_id", "payload", "partition_key", "available_at"] {
            assert!(needed.iter().any(|c| c == column), "{column} in {needed:?}");
        }
        let blackhole = needed_columns(&native, true);
        assert!(blackhole.iter().any(|c| c == "payload"), "{blackhole:?}");
        assert!(
            !blackhole.iter().any(|c| c == "id" || c == "available_at"),
            "{blackhole:?}"
        );
        let renamed: Vec<String> = needed
            .iter()
            .map(|c| c.replace("payload", "data"))
            .collect();
        assert_eq!(missing_column(&needed, &renamed), Some("payload"));
        assert_eq!(missing_column(&needed, &needed), None);
        let seed = Mapping::mysql_outbox_events(None, "outbox_events");
        let columns: Vec<String> = needed_columns(&seed, false)
            .into_iter()
            .filter(|c| c != "isConsumed")
            .collect();
        assert_eq!(
            missing_column(&needed_columns(&seed, false), &columns),
            Some("isConsumed")
        );
    }

    #[test]
    fn a_row_whose_state_is_known_and_not_pending_is_no_event_whatever_else_is_unknown() {
        let mapping = Mapping::mysql_outbox_events(None, "outbox_events");
        assert!(decode(&row(Some("1")), &mapping).is_none());
    }

    #[test]
    fn a_pending_row_or_one_of_unknown_state_missing_a_read_column_is_undecodable() {
        let mapping = Mapping::mysql_outbox_events(None, "outbox_events");
        for consumed in [Some("0"), None] {
            let captured = decode(&row(consumed), &mapping).expect("an event to dead-letter");
            let reason = captured.event.unwrap_err().reason;
            assert!(reason.contains("not in the row image"), "{reason}");
        }
    }

    /// Without a `created_at` column, an event was made at its reading: `run --drain` took a
    /// row written before it began, parked during it, for one written during it.
    #[test]
    fn an_event_without_a_creation_column_was_created_when_its_transaction_was_logged() {
        let mut mapping = Mapping::mysql_outbox_events(None, "outbox_events");
        mapping.destination = "message".into();
        mapping.event_type = None;
        mapping.created_at = None;
        let logged = Row {
            logged_at: Some(1_700_000_000),
            ..row(Some("0"))
        };
        let event = decode(&logged, &mapping).unwrap().event.unwrap();
        assert_eq!(
            event.created_at,
            SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000)
        );
    }

    #[test]
    fn a_column_the_layout_does_not_read_may_be_unknown() {
        let mut mapping = Mapping::mysql_outbox_events(None, "outbox_events");
        mapping.destination = "message".into();
        mapping.event_type = None;
        let captured = decode(&row(Some("0")), &mapping).expect("an event");
        assert!(captured.event.is_ok(), "{:?}", captured.event);
    }
}
