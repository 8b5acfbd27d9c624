//! Whether a mapped table's columns have types the layout's statements can read. A mapping
//! names columns; a column of another type than its field needs passed `check` and then
//! failed every claim at `run` (a `text` column cast with `isfinite`, an `int` under `CASE
//! WHEN`), for every key, or ended the relay with "run `outbox-relay migrate`", which does
//! nothing for a table the application owns.

use std::collections::HashMap;

use crate::{Dialect, IdType, Mapping, PayloadFormat};

const INTEGERS: &[&str] = &["smallint", "integer", "bigint"];
const TIMESTAMPS: &[&str] = &["timestamp with time zone", "timestamp without time zone"];
const TEXTS: &[&str] = &["text", "character varying", "character", "json", "jsonb"];

/// What is wrong with the types of `m`'s columns, as `types` (column → information_schema's
/// `data_type`) gives them; one line per column. PostgreSQL's only: the MySQL store checks
/// its id and key columns itself, and MySQL converts between the others.
pub(crate) fn problems(
    m: &Mapping,
    dialect: Dialect,
    types: &HashMap<String, String>,
) -> Vec<String> {
    if dialect != Dialect::Postgres {
        return Vec::new();
    }
    let id_types: &[&str] = match m.id_type {
        IdType::Integer => INTEGERS,
        IdType::Uuid => &["uuid"],
    };
    let (payload_types, payload_why): (&[&str], &str) = match m.payload_format {
        PayloadFormat::Bytes => (&["bytea"], "payload_format = \"bytes\" reads bytes"),
        PayloadFormat::Json | PayloadFormat::Text => (
            TEXTS,
            "a JSON or text payload is read as text (for a bytea column, set \
             payload_format = \"bytes\")",
        ),
    };
    let mut expected: Vec<(&str, &str, &[&str], &str)> = vec![
        (
            "id",
            m.id.as_str(),
            id_types,
            "the row id is a 64-bit integer (or a uuid, with id_type = \"uuid\")",
        ),
        ("payload", m.payload.as_str(), payload_types, payload_why),
    ];
    let timestamps = [
        ("created_at", &m.created_at),
        ("updated_at", &m.updated_at),
        ("available_at", &m.available_at),
        ("locked_until", &m.locked_until),
        ("locked_at", &m.locked_at),
        ("delivered_at", &m.delivered_at),
        ("dead_at", &m.dead_at),
    ];
    for (field, column) in timestamps {
        if let Some(column) = column {
            expected.push((field, column, TIMESTAMPS, "it is compared with times"));
        }
    }
    if let Some(column) = &m.attempts {
        expected.push(("attempts", column, INTEGERS, "it is counted up"));
    }
    if let Some(column) = &m.rejected {
        expected.push(("rejected", column, &["boolean"], "it is a flag"));
    }
    expected
        .into_iter()
        .filter_map(|(field, column, accepted, why)| {
            let found = types.get(column)?;
            (!accepted.contains(&found.as_str())).then(|| {
                format!(
                    "column {column:?} (the mapping's {field}) is {found}, which the relay \
                     cannot read as its {field}: {why}; it takes {}",
                    accepted.join(", ")
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapping() -> Mapping {
        Mapping {
            table: "t".into(),
            id: "id".into(),
            destination: "topic".into(),
            payload: "body".into(),
            ..Mapping::empty()
        }
    }

    fn types(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(c, t)| (c.to_string(), t.to_string()))
            .collect()
    }

    #[test]
    fn columns_of_types_the_statements_cannot_read_are_named_with_their_field() {
        let mut m = mapping();
        m.created_at = Some("created".into());
        m.rejected = Some("rej".into());
        m.attempts = Some("att".into());
        let fine = types(&[
            ("id", "bigint"),
            ("body", "jsonb"),
            ("created", "timestamp with time zone"),
            ("rej", "boolean"),
            ("att", "integer"),
        ]);
        assert!(problems(&m, Dialect::Postgres, &fine).is_empty());
        let wrong = types(&[
            ("id", "numeric"),
            ("body", "bytea"),
            ("created", "text"),
            ("rej", "integer"),
            ("att", "text"),
        ]);
        let said = problems(&m, Dialect::Postgres, &wrong);
        assert_eq!(said.len(), 5, "{said:?}");
        assert!(said[1].contains("payload_format = \"bytes\""), "{said:?}");
        assert!(said
            .iter()
            .any(|s| s.contains("\"rej\" (the mapping's rejected) is integer")));
        // MySQL's store checks its own; a column not there is another problem's.
        assert!(problems(&m, Dialect::MySql, &wrong).is_empty());
        assert!(problems(&m, Dialect::Postgres, &types(&[])).is_empty());
        m.payload_format = PayloadFormat::Bytes;
        m.id_type = IdType::Uuid;
        let bytes = types(&[("id", "uuid"), ("body", "text")]);
        let said = problems(&m, Dialect::Postgres, &bytes);
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(said[0].contains("it takes bytea"), "{said:?}");
    }
}
