//! Rows of the captured outbox table, as INSERTs in the WAL, mapped to events by column
//! *name* from the table's Relation message, so column order, added columns and dropped
//! columns never matter. The names are the native table's, or a mapped table's
//! ([`ColumnNames`]: Debezium's `outboxevent`).

use outbox_core::time::parse_timestamp;
use std::time::SystemTime;

use outbox_core::ident::TableName;
use outbox_core::{Event, Headers, Payload, StoreError, StoreErrorKind};
use outbox_layout::{IdType, Mapping};

use crate::decode::{ColumnValue, Relation, TupleData};
use crate::event::{EventSource, Undecodable, WalEvent};

/// A table whose INSERTs capture reads, and what its columns are named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceTable {
    pub name: TableName,
    pub columns: ColumnNames,
}

impl SourceTable {
    /// The native outbox table `name`, its columns named as `migrate` creates them.
    pub fn native(name: TableName) -> Self {
        SourceTable {
            name,
            columns: ColumnNames::native(),
        }
    }

    /// The outbox columns of `relation` when it is this table; `None` for another table.
    pub fn columns_of(&self, relation: &Relation<'_>) -> Option<OutboxColumns> {
        OutboxColumns::is_outbox(relation, &self.name)
            .then(|| OutboxColumns::resolve(relation, &self.columns))
    }
}

/// Which column of the captured table holds what, by name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ColumnNames {
    pub event_id: String,
    pub destination: String,
    pub event_type: String,
    /// The row's integer id: the engine's sequence id, and what delivered rows are deleted by.
    pub sequence_id: String,
    pub partition_key: Option<String>,
    pub payload: Option<String>,
    /// A JSON object of headers.
    pub headers: Option<String>,
    pub mutation_id: Option<String>,
    pub created_at: Option<String>,
    pub available_at: Option<String>,
    /// A boolean the application sets on an event it rejects (Ably's connector's flag),
    /// passed on to the sink as the polling relay does.
    pub rejected: Option<String>,
    /// A span context in Java properties (Debezium's `tracingspancontext`): its
    /// `traceparent` and `tracestate` become headers.
    pub span_context: Option<String>,
    /// A header that carries the event id (Debezium's `id`).
    pub event_id_header: Option<String>,
    /// Timestamps are `timestamp without time zone` holding UTC.
    pub utc_timestamps: bool,
}

impl ColumnNames {
    /// The native outbox table's.
    pub fn native() -> Self {
        ColumnNames {
            event_id: "event_id".into(),
            destination: "destination".into(),
            event_type: "event_type".into(),
            sequence_id: "sequence_id".into(),
            partition_key: Some("partition_key".into()),
            payload: Some("payload".into()),
            headers: Some("headers".into()),
            mutation_id: Some("mutation_id".into()),
            created_at: Some("created_at".into()),
            available_at: Some("available_at".into()),
            rejected: Some("rejected".into()),
            span_context: None,
            event_id_header: None,
            utc_timestamps: false,
        }
    }

    /// A mapped table's (a layout's [`Mapping`]), when WAL capture can read it: it needs an
    /// integer row id to delete by, and an event id column (a row's WAL position is not
    /// stable enough to derive one from).
    pub fn of_mapping(mapping: &Mapping) -> Result<Self, StoreError> {
        let refuse = |what: &str| {
            StoreError::new(
                StoreErrorKind::Config,
                format!("WAL capture of the table {} needs {what}", mapping.table),
            )
        };
        if mapping.id_type != IdType::Integer {
            return Err(refuse("an integer row id"));
        }
        let event_id = mapping
            .event_id
            .clone()
            .ok_or_else(|| refuse("an event id column"))?;
        Ok(ColumnNames {
            event_id,
            destination: mapping.destination.clone(),
            event_type: mapping
                .event_type
                .clone()
                .unwrap_or_else(|| mapping.destination.clone()),
            sequence_id: mapping.id.clone(),
            partition_key: mapping.key.clone(),
            payload: Some(mapping.payload.clone()),
            headers: mapping.headers.clone(),
            mutation_id: mapping.mutation_id.clone(),
            created_at: mapping.created_at.clone(),
            available_at: mapping.available_at.clone(),
            rejected: mapping.rejected.clone(),
            span_context: mapping.span_context.clone(),
            event_id_header: mapping.event_id_header.clone(),
            utc_timestamps: mapping.utc_timestamps,
        })
    }
}

/// The outbox table as the WAL describes it: where each column the relay reads sits in
/// its rows. Built from a Relation message; valid until the next one for the table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxColumns {
    event_id: Option<usize>,
    destination: Option<usize>,
    event_type: Option<usize>,
    sequence_id: Option<usize>,
    partition_key: Option<usize>,
    payload: Option<usize>,
    headers: Option<usize>,
    mutation_id: Option<usize>,
    created_at: Option<usize>,
    available_at: Option<usize>,
    rejected: Option<usize>,
    span_context: Option<usize>,
    event_id_header: Option<String>,
    utc_timestamps: bool,
    /// Every column's name, in row order, for the dead letters' `raw`.
    names: Vec<String>,
    /// Columns the relay reads that the relation lacks (renamed or dropped while rows were
    /// written): its rows are undecodable, each kept whole in its dead letter's `raw`.
    missing: Option<MissingColumn>,
}

/// The outbox table's definition, as a Relation message gave it, lacks columns the relay
/// reads (`column`: their names).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the outbox table {table} has no column {column} (renamed or dropped while rows were \
     written): restore it; until then each row is dead-lettered, every column's value kept \
     in the dead letter's payload as name=value lines"
)]
pub struct MissingColumn {
    pub table: String,
    pub column: String,
}

impl OutboxColumns {
    /// Whether `relation` is the outbox table.
    pub fn is_outbox(relation: &Relation<'_>, table: &TableName) -> bool {
        // pgoutput names pg_catalog with an empty namespace; an outbox never lives there.
        relation.namespace == table.schema.as_str() && relation.name == table.name.as_str()
    }

    /// Finds the columns by name. The event id, destination, event type and payload are
    /// what an event is: a relation without one of them (renamed or dropped while the relay
    /// reads) gives columns whose every row is undecodable, saying which. A stream error
    /// would end every session at the same message, for good, and a payload read as absent
    /// would send each event with a null one. So is a mapped table's sequence id (its rows
    /// are deleted by it). The other columns are read where present, as NULL where not (a
    /// table that drops its `mutation_id` has none).
    pub fn resolve(relation: &Relation<'_>, names: &ColumnNames) -> Self {
        let find = |name: &str| relation.columns.iter().position(|c| c.name == name);
        let optional = |name: &Option<String>| name.as_deref().and_then(find);
        let native = names == &ColumnNames::native();
        let wanted = [
            Some(&names.event_id),
            Some(&names.destination),
            Some(&names.event_type),
            names.payload.as_ref(),
            (!native).then_some(&names.sequence_id),
        ];
        let absent: Vec<&str> = wanted
            .into_iter()
            .flatten()
            .filter(|name| find(name).is_none())
            .map(String::as_str)
            .collect();
        let missing = (!absent.is_empty()).then(|| MissingColumn {
            table: format!("{}.{}", relation.namespace, relation.name),
            column: absent.join(", "),
        });
        OutboxColumns {
            event_id: find(&names.event_id),
            destination: find(&names.destination),
            event_type: find(&names.event_type),
            sequence_id: find(&names.sequence_id),
            partition_key: optional(&names.partition_key),
            payload: optional(&names.payload),
            headers: optional(&names.headers),
            mutation_id: optional(&names.mutation_id),
            created_at: optional(&names.created_at),
            available_at: optional(&names.available_at),
            rejected: optional(&names.rejected),
            span_context: optional(&names.span_context),
            event_id_header: names.event_id_header.clone(),
            utc_timestamps: names.utc_timestamps,
            names: relation
                .columns
                .iter()
                .map(|c| c.name.to_string())
                .collect(),
            missing,
        }
    }

    /// The event an inserted row carries. `commit_time` stands in for a missing
    /// `created_at` column.
    pub fn event(
        &self,
        row: &TupleData<'_>,
        commit_time: SystemTime,
    ) -> Result<WalEvent, Box<Undecodable>> {
        let sequence_id = self
            .sequence_id
            .and_then(|i| text(row, i).ok().flatten())
            .and_then(|s| s.parse().ok());
        let source = EventSource::Table { sequence_id };
        let undecodable = |reason: String| {
            Box::new(Undecodable {
                reason,
                source,
                event_id: self
                    .event_id
                    .and_then(|i| text(row, i).ok().flatten())
                    .and_then(|s| s.parse().ok()),
                destination: self
                    .destination
                    .and_then(|i| text(row, i).ok().flatten())
                    .map(String::from),
                partition_key: self
                    .partition_key
                    .and_then(|i| text(row, i).ok().flatten())
                    .map(String::from),
                raw: self.raw(row),
            })
        };
        if row.columns.len() != self.names.len() {
            return Err(undecodable(format!(
                "the row has {} columns, its relation {}",
                row.columns.len(),
                self.names.len()
            )));
        }
        if let Some(missing) = &self.missing {
            return Err(undecodable(missing.to_string()));
        }
        let required = |i: Option<usize>, name: &str| match i.map(|i| text(row, i)) {
            Some(Ok(Some(value))) => Ok(value),
            Some(Ok(None)) => Err(undecodable(format!("{name} is NULL"))),
            Some(Err(e)) => Err(undecodable(format!("{name}: {e}"))),
            None => Err(undecodable(format!("the table has no column {name}"))),
        };
        let optional = |i: Option<usize>, name: &str| match i.map(|i| text(row, i)) {
            None | Some(Ok(None)) => Ok(None),
            Some(Ok(Some(value))) => Ok(Some(value)),
            Some(Err(e)) => Err(undecodable(format!("{name}: {e}"))),
        };
        let event_id: outbox_core::EventId = required(self.event_id, "event_id")?
            .parse()
            .map_err(|e| undecodable(format!("event_id is not a UUID: {e}")))?;
        let payload = match optional(self.payload, "payload")? {
            None => Payload::Null,
            Some(json) => Payload::from_json_text(json.to_string()).map_err(&undecodable)?,
        };
        let mut headers = match optional(self.headers, "headers")? {
            None => Headers::new(),
            Some(json) => outbox_core::event::headers_from_json_text(json).map_err(&undecodable)?,
        };
        let event_type = required(self.event_type, "event_type")?;
        // A dead letter of an undecodable event, retried (`dead retry` writes it back to the
        // outbox): its payload is the raw content it kept, no event's.
        if let Some(reason) = outbox_core::event::undecodable_dead_letter(&headers, event_type) {
            let mut dead = undecodable(reason);
            if let Payload::Json(kept) = &payload {
                if let Ok(raw) = serde_json::from_str::<String>(kept.get()) {
                    dead.raw = raw;
                }
            }
            return Err(dead);
        }
        if let Some(text) = optional(self.span_context, "span context")? {
            add_span_context(&mut headers, text);
        }
        if let Some(name) = &self.event_id_header {
            headers.insert(name.clone(), event_id.to_string());
        }
        let timestamp = |i: Option<usize>, name: &str| match optional(i, name)? {
            None => Ok(None),
            Some(text) => parse_timestamp(text, self.utc_timestamps)
                .map(Some)
                .map_err(|e| undecodable(format!("{name}: {e}"))),
        };
        let created_at = timestamp(self.created_at, "created_at")?.unwrap_or(commit_time);
        if let Some(problem) =
            outbox_core::time::created_at_problem(outbox_core::time::micros(created_at))
        {
            return Err(undecodable(format!("created_at {problem}")));
        }
        Ok(WalEvent {
            event: Event {
                partition_key: optional(self.partition_key, "partition_key")?.map(String::from),
                headers,
                mutation_id: optional(self.mutation_id, "mutation_id")?.map(String::from),
                // pgoutput's text form of a boolean.
                rejected: optional(self.rejected, "rejected")? == Some("t"),
                created_at,
                ..Event::new(
                    0,
                    event_id,
                    required(self.destination, "destination")?,
                    event_type,
                    payload,
                )
            },
            // `infinity` (never) is kept as unreadable rather than guessed.
            available_at: timestamp(self.available_at, "available_at")?,
            source,
        })
    }

    fn raw(&self, row: &TupleData<'_>) -> String {
        let mut out = String::new();
        for (i, value) in row.columns.iter().enumerate() {
            let name = self.names.get(i).map_or("?", String::as_str);
            let value = match value {
                ColumnValue::Null => "NULL".into(),
                ColumnValue::UnchangedToast => "(unchanged TOAST)".into(),
                ColumnValue::Text(bytes) | ColumnValue::Binary(bytes) => {
                    String::from_utf8_lossy(bytes)
                }
            };
            out.push_str(&format!("{name}={value}\n"));
        }
        out
    }
}

/// A span context's valid trace context as headers (a `traceparent` in the headers wins).
/// A malformed one is left out: the event still goes, without trace context.
fn add_span_context(headers: &mut Headers, text: &str) {
    use outbox_core::trace::{TraceParent, TRACEPARENT, TRACESTATE};
    if headers.keys().any(|k| k.eq_ignore_ascii_case(TRACEPARENT)) {
        return;
    }
    let (parent, state) = outbox_core::trace::from_java_properties(text);
    if let Some(Ok(parent)) = parent.as_deref().map(TraceParent::parse) {
        headers.insert(TRACEPARENT.into(), parent.to_string());
        if let Some(state) = state.filter(|s| !s.is_empty()) {
            headers.insert(TRACESTATE.into(), state);
        }
    }
}

/// A column's text, `None` for NULL.
fn text<'a>(row: &TupleData<'a>, i: usize) -> Result<Option<&'a str>, String> {
    match row.columns.get(i) {
        None => Err("missing from the row".into()),
        Some(ColumnValue::Null) => Ok(None),
        Some(ColumnValue::Text(bytes)) => std::str::from_utf8(bytes)
            .map(Some)
            .map_err(|_| "not UTF-8".into()),
        // An INSERT always carries its values; binary needs `binary 'true'`, which the
        // client never asks for.
        Some(ColumnValue::UnchangedToast) => Err("an unchanged TOAST value in an INSERT".into()),
        Some(ColumnValue::Binary(_)) => Err("in binary format".into()),
    }
}

/// Parses PostgreSQL's text output of a `timestamptz` under `DateStyle = ISO` (which the
/// client sets): `2026-11-23 12:38:36.123456+00`, offsets as `+05:30` or `-03:00:15`,
/// years past 9999, ` BC`. `infinity` and `-infinity` are refused: no instant fits them.
pub fn parse_timestamptz(text: &str) -> Result<SystemTime, String> {
    outbox_core::time::parse_timestamp(text, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{decode, wire, LogicalMessage};
    use outbox_core::time::micros;

    #[test]
    fn timestamps_in_iso_style() {
        let us = |t: &str| micros(parse_timestamptz(t).unwrap());
        assert_eq!(us("1970-01-01 00:00:00+00"), 0);
        assert_eq!(us("2026-11-23 12:38:36.5+00"), 1_795_437_516_500_000);
        assert_eq!(us("2026-11-23 14:08:36.5+01:30"), 1_795_437_516_500_000);
        assert_eq!(us("2026-11-23 09:38:36.5-03"), 1_795_437_516_500_000);
        assert_eq!(us("1969-12-31 23:59:59.999999+00"), -1);
        assert_eq!(us("2000-02-29 00:00:00+00"), 951_782_400_000_000);
        assert_eq!(us("0001-01-01 00:00:00+00"), -62_135_596_800_000_000);
        assert_eq!(us("0001-12-31 00:00:00+00 BC"), -62_135_683_200_000_000);
        assert_eq!(us("12026-01-01 00:00:00+00"), 317_336_745_600_000_000);
        for bad in [
            "infinity",
            "-infinity",
            "2026-02-30 00:00:00+00",
            "2026-11-23 12:38:36",
            "2026-11-23T12:38:36+00",
            "2026-11-23 12:38+00",
            "2026-11-23 12:38:36.1234567+00",
            "",
        ] {
            assert!(parse_timestamptz(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn timestamps_without_offset_are_utc_where_the_mapping_says_so() {
        let utc = |t: &str| micros(parse_timestamp(t, true).unwrap());
        assert_eq!(utc("2026-11-23 12:38:36.5"), 1_795_437_516_500_000);
        assert_eq!(utc("2026-11-23 14:08:36.5+01:30"), 1_795_437_516_500_000);
        assert_eq!(utc("0001-12-31 00:00:00 BC"), -62_135_683_200_000_000);
        assert_eq!(utc("1970-01-01 00:00:00.000001"), 1);
        assert!(parse_timestamp("2026-11-23 12:38:36", false).is_err());
        for bad in [
            "2026-11-23 12:38",
            "2026-11-23 12:38:36:01",
            "2026-11-23 12:38:36+01:00:00:00",
            "2026-11-23 12:38:36+",
        ] {
            assert!(parse_timestamp(bad, true).is_err(), "{bad}");
        }
    }

    fn outbox_relation() -> Vec<u8> {
        // Not the DDL's order, and with a column the relay does not know.
        wire::relation(
            9,
            "public",
            "outbox",
            &[
                ("payload", 3802),
                ("extra", 25),
                ("destination", 25),
                ("event_type", 25),
                ("event_id", 2950),
                ("partition_key", 25),
                ("headers", 3802),
                ("created_at", 1184),
                ("sequence_id", 20),
            ],
        )
    }

    #[test]
    fn maps_columns_by_name() {
        let relation_bytes = outbox_relation();
        let LogicalMessage::Relation(relation) = decode(&relation_bytes).unwrap() else {
            panic!()
        };
        let table = TableName::new("public", "outbox").unwrap();
        assert!(OutboxColumns::is_outbox(&relation, &table));
        let columns = OutboxColumns::resolve(&relation, &ColumnNames::native());
        let insert = wire::insert(
            9,
            &[
                Some(r#"{"n": 1}"#),
                Some("ignored"),
                Some("orders"),
                Some("Placed"),
                Some("6f1c9f3e-8d3a-4c1e-9a51-3c2b1d0e9f10"),
                None,
                Some(r#"{"h": "v"}"#),
                Some("1970-01-01 00:00:01+00"),
                Some("77"),
            ],
        );
        let LogicalMessage::Insert(insert) = decode(&insert).unwrap() else {
            panic!()
        };
        let event = columns.event(&insert.new, SystemTime::UNIX_EPOCH).unwrap();
        assert_eq!(event.destination, "orders");
        assert_eq!(event.event_type, "Placed");
        assert_eq!(event.partition_key, None);
        assert_eq!(event.payload.as_bytes(), br#"{"n": 1}"#);
        assert_eq!(event.headers["h"], "v");
        assert_eq!(micros(event.created_at), 1_000_000);
        assert_eq!(
            event.source,
            EventSource::Table {
                sequence_id: Some(77)
            }
        );
    }

    /// Debezium's `outboxevent`, by its own names: the row id the relay added, the id header,
    /// the trace context from the span context's properties, a `timestamp` without zone.
    #[test]
    fn a_mapped_table_is_read_by_its_column_names() {
        const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let relation_bytes = wire::relation(
            12,
            "public",
            "outboxevent",
            &[
                ("id", 2950),
                ("aggregatetype", 1043),
                ("aggregateid", 1043),
                ("type", 1043),
                ("payload", 3802),
                ("timestamp", 1114),
                ("tracingspancontext", 1043),
                ("relay_sequence", 20),
            ],
        );
        let LogicalMessage::Relation(relation) = decode(&relation_bytes).unwrap() else {
            panic!()
        };
        let names = ColumnNames {
            event_id: "id".into(),
            destination: "aggregatetype".into(),
            event_type: "type".into(),
            sequence_id: "relay_sequence".into(),
            partition_key: Some("aggregateid".into()),
            payload: Some("payload".into()),
            headers: None,
            mutation_id: None,
            created_at: Some("timestamp".into()),
            available_at: None,
            rejected: None,
            span_context: Some("tracingspancontext".into()),
            event_id_header: Some("id".into()),
            utc_timestamps: true,
        };
        let columns = OutboxColumns::resolve(&relation, &names);
        let span = format!("#Thu Nov 26 UTC 2026\ntraceparent={TP}\n");
        let insert = wire::insert(
            12,
            &[
                Some("6f1c9f3e-8d3a-4c1e-9a51-3c2b1d0e9f10"),
                Some("Order"),
                Some("order-7"),
                Some("OrderPaid"),
                Some(r#"{"n": 1}"#),
                Some("1970-01-01 00:00:02.5"),
                Some(&span),
                Some("41"),
            ],
        );
        let LogicalMessage::Insert(insert) = decode(&insert).unwrap() else {
            panic!()
        };
        let event = columns.event(&insert.new, SystemTime::UNIX_EPOCH).unwrap();
        assert_eq!(event.destination, "Order");
        assert_eq!(event.partition_key.as_deref(), Some("order-7"));
        assert_eq!(event.event_type, "OrderPaid");
        assert_eq!(event.headers["id"], "6f1c9f3e-8d3a-4c1e-9a51-3c2b1d0e9f10");
        assert_eq!(event.headers["traceparent"], TP);
        assert_eq!(
            micros(event.created_at),
            2_500_000,
            "a zone-less timestamp is UTC"
        );
        assert_eq!(
            event.source,
            EventSource::Table {
                sequence_id: Some(41)
            }
        );
        let mut without_sequence = names.clone();
        without_sequence.sequence_id = "nope".into();
        let missing = OutboxColumns::resolve(&relation, &without_sequence)
            .event(&insert.new, SystemTime::UNIX_EPOCH)
            .unwrap_err();
        assert!(
            missing.reason.contains("has no column nope"),
            "{}",
            missing.reason
        );
    }

    #[test]
    fn a_bad_row_is_undecodable_with_what_could_be_read() {
        let relation_bytes = outbox_relation();
        let LogicalMessage::Relation(relation) = decode(&relation_bytes).unwrap() else {
            panic!()
        };
        let columns = OutboxColumns::resolve(&relation, &ColumnNames::native());
        let insert = wire::insert(
            9,
            &[
                None,
                None,
                Some("orders"),
                Some("Placed"),
                Some("6f1c9f3e-8d3a-4c1e-9a51-3c2b1d0e9f10"),
                Some("k"),
                Some("[1]"),
                Some("infinity"),
                Some("78"),
            ],
        );
        let LogicalMessage::Insert(insert) = decode(&insert).unwrap() else {
            panic!()
        };
        let error = columns
            .event(&insert.new, SystemTime::UNIX_EPOCH)
            .unwrap_err();
        assert!(
            error.reason.contains("headers must be a JSON object"),
            "{}",
            error.reason
        );
        assert_eq!(error.destination.as_deref(), Some("orders"));
        assert_eq!(error.partition_key.as_deref(), Some("k"));
        assert!(error.event_id.is_some());
        assert!(error.raw.contains("headers=[1]\n"));
    }

    #[test]
    fn a_table_without_a_required_column_is_named() {
        let bytes = wire::relation(9, "app", "events", &[("destination", 25)]);
        let LogicalMessage::Relation(relation) = decode(&bytes).unwrap() else {
            panic!()
        };
        let columns = OutboxColumns::resolve(&relation, &ColumnNames::native());
        let insert = wire::insert(9, &[Some("orders")]);
        let LogicalMessage::Insert(insert) = decode(&insert).unwrap() else {
            panic!()
        };
        let error = columns
            .event(&insert.new, SystemTime::UNIX_EPOCH)
            .unwrap_err();
        assert!(
            error
                .reason
                .contains("app.events has no column event_id, event_type, payload"),
            "{}",
            error.reason
        );
        assert_eq!(error.destination.as_deref(), Some("orders"));
        assert!(error.raw.contains("destination=orders"), "{}", error.raw);
    }
}
