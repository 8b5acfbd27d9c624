//! Rows of the native outbox table, as INSERTs in the WAL, mapped to events by column *name*
//! from the table's Relation message, so column order, added columns and dropped columns
//! never matter.

use std::time::SystemTime;

use outbox_core::ident::TableName;
use outbox_core::{Event, Headers, Payload};

use crate::decode::{ColumnValue, Relation, TupleData};
use crate::event::{EventSource, Undecodable, WalEvent};

/// The outbox table as the WAL describes it: where each column the relay reads sits in
/// its rows. Built from a Relation message; valid until the next one for the table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxColumns {
    event_id: usize,
    destination: usize,
    event_type: usize,
    sequence_id: Option<usize>,
    partition_key: Option<usize>,
    payload: Option<usize>,
    headers: Option<usize>,
    mutation_id: Option<usize>,
    created_at: Option<usize>,
    available_at: Option<usize>,
    /// Every column's name, in row order, for the dead letters' `raw`.
    names: Vec<String>,
}

/// The outbox table's definition lacks a column the relay needs.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the outbox table {table} has no column {column}: WAL capture reads tables created by \
     `outbox-relay migrate`; check the configured outbox table and the publication"
)]
pub struct MissingColumn {
    pub table: String,
    pub column: &'static str,
}

impl OutboxColumns {
    /// Whether `relation` is the outbox table.
    pub fn is_outbox(relation: &Relation<'_>, table: &TableName) -> bool {
        // pgoutput names pg_catalog with an empty namespace; an outbox never lives there.
        relation.namespace == table.schema.as_str() && relation.name == table.name.as_str()
    }

    /// Finds the columns by name. `event_id`, `destination` and `event_type` are required
    /// (they are NOT NULL in the native table); the others are read when present.
    pub fn resolve(relation: &Relation<'_>) -> Result<Self, MissingColumn> {
        let find = |name: &str| relation.columns.iter().position(|c| c.name == name);
        let required = |column: &'static str| {
            find(column).ok_or_else(|| MissingColumn {
                table: format!("{}.{}", relation.namespace, relation.name),
                column,
            })
        };
        Ok(OutboxColumns {
            event_id: required("event_id")?,
            destination: required("destination")?,
            event_type: required("event_type")?,
            sequence_id: find("sequence_id"),
            partition_key: find("partition_key"),
            payload: find("payload"),
            headers: find("headers"),
            mutation_id: find("mutation_id"),
            created_at: find("created_at"),
            available_at: find("available_at"),
            names: relation
                .columns
                .iter()
                .map(|c| c.name.to_string())
                .collect(),
        })
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
                event_id: text(row, self.event_id)
                    .ok()
                    .flatten()
                    .and_then(|s| s.parse().ok()),
                destination: text(row, self.destination).ok().flatten().map(String::from),
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
        let required = |i: usize, name: &str| match text(row, i) {
            Ok(Some(value)) => Ok(value),
            Ok(None) => Err(undecodable(format!("{name} is NULL"))),
            Err(e) => Err(undecodable(format!("{name}: {e}"))),
        };
        let optional = |i: Option<usize>, name: &str| match i.map(|i| text(row, i)) {
            None | Some(Ok(None)) => Ok(None),
            Some(Ok(Some(value))) => Ok(Some(value)),
            Some(Err(e)) => Err(undecodable(format!("{name}: {e}"))),
        };
        let event_id = required(self.event_id, "event_id")?
            .parse()
            .map_err(|e| undecodable(format!("event_id is not a UUID: {e}")))?;
        let payload = match optional(self.payload, "payload")? {
            None => Payload::Null,
            Some(json) => Payload::from_json_text(json.to_string()).map_err(&undecodable)?,
        };
        let headers = match optional(self.headers, "headers")? {
            None => Headers::new(),
            Some(json) => serde_json::from_str(json)
                .map_err(|e| format!("headers are not JSON: {e}"))
                .and_then(|value| outbox_core::event::headers_from_json(&value))
                .map_err(&undecodable)?,
        };
        let timestamp = |i: Option<usize>, name: &str| match optional(i, name)? {
            None => Ok(None),
            Some(text) => parse_timestamptz(text)
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
                created_at,
                ..Event::new(
                    0,
                    event_id,
                    required(self.destination, "destination")?,
                    required(self.event_type, "event_type")?,
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
    let bad = || format!("{text:?} is not an ISO timestamp with time zone");
    let (text_ad, bc) = match text.strip_suffix(" BC") {
        Some(rest) => (rest, true),
        None => (text, false),
    };
    let (date, rest) = text_ad.split_once(' ').ok_or_else(bad)?;
    let mut date_parts = date.splitn(3, '-');
    let mut number = |max_len: usize| -> Result<i64, String> {
        let part = date_parts.next().ok_or_else(bad)?;
        if part.is_empty() || part.len() > max_len || !part.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        part.parse().map_err(|_| bad())
    };
    let year = number(7)?;
    let month = number(2)?;
    let day = number(2)?;
    // The offset starts at the first sign after the time.
    let sign_at = rest.find(['+', '-']).ok_or_else(bad)?;
    let (time, offset) = rest.split_at(sign_at);
    let (hms, fraction) = match time.split_once('.') {
        Some((hms, fraction)) => (hms, fraction),
        None => (time, ""),
    };
    let field = |s: &str, max: i64| -> Result<i64, String> {
        if s.len() != 2 || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let v: i64 = s.parse().map_err(|_| bad())?;
        if v > max {
            return Err(bad());
        }
        Ok(v)
    };
    let hms: Vec<&str> = hms.split(':').collect();
    let [h, m, s] = hms.as_slice() else {
        return Err(bad());
    };
    // 24:00:00 is valid PostgreSQL input and output.
    let (h, m, s) = (field(h, 24)?, field(m, 59)?, field(s, 60)?);
    if fraction.len() > 6 || !fraction.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let micros_fraction: i64 = if fraction.is_empty() {
        0
    } else {
        format!("{fraction:0<6}").parse().map_err(|_| bad())?
    };
    let (sign, offset) = offset.split_at(1);
    let offset_parts: Vec<&str> = offset.split(':').collect();
    if offset_parts.is_empty() || offset_parts.len() > 3 {
        return Err(bad());
    }
    let mut offset_seconds = 0;
    for (i, part) in offset_parts.iter().enumerate() {
        offset_seconds += field(part, 59)? * [3600, 60, 1][i];
    }
    if sign == "-" {
        offset_seconds = -offset_seconds;
    }
    if !(1..=12).contains(&month) || day < 1 || day > days_in_month(year, month, bc) {
        return Err(bad());
    }
    // Year 1 BC is year 0 of the proleptic Gregorian calendar.
    let year = if bc { 1 - year } else { year };
    let days = days_from_civil(year, month, day);
    let seconds = days * 86_400 + h * 3600 + m * 60 + s - offset_seconds;
    let micros = seconds
        .checked_mul(1_000_000)
        .and_then(|us| us.checked_add(micros_fraction))
        .ok_or_else(bad)?;
    Ok(outbox_core::time::from_micros(micros))
}

fn days_in_month(year: i64, month: i64, bc: bool) -> i64 {
    let year = if bc { 1 - year } else { year };
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    match month {
        2 if leap => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year.rem_euclid(400);
    let month_from_march = (month + 9) % 12;
    let day_of_year = (153 * month_from_march + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
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
        let columns = OutboxColumns::resolve(&relation).unwrap();
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

    #[test]
    fn a_bad_row_is_undecodable_with_what_could_be_read() {
        let relation_bytes = outbox_relation();
        let LogicalMessage::Relation(relation) = decode(&relation_bytes).unwrap() else {
            panic!()
        };
        let columns = OutboxColumns::resolve(&relation).unwrap();
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
        let error = OutboxColumns::resolve(&relation).unwrap_err();
        assert_eq!(error.column, "event_id");
        assert!(error
            .to_string()
            .contains("app.events has no column event_id"));
    }
}
