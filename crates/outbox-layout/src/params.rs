//! Statement parameters for a mapped table, written once for both dialects.
//!
//! [`Params`] hands out each value's placeholder in the dialect's syntax (`$n::type` for
//! PostgreSQL, `:pn` for MySQL) and keeps the values in order, so the SQL builder's fragments
//! and the driver's binding always agree. A placeholder may appear more than once in a
//! statement. On PostgreSQL every value handed out must appear at least once (the server
//! counts the statement's parameters); the builder's statements guarantee that for theirs.

use uuid::Uuid;

use crate::memory::RowId;
use crate::{Dialect, IdType};

/// A value bound to a statement.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Bool(bool),
    Int(i64),
    Text(Option<String>),
    Uuid(Uuid),
    /// An array (PostgreSQL only: MySQL lists are expanded or inlined).
    Ints(Vec<i64>),
    Uuids(Vec<Uuid>),
    Texts(Vec<String>),
}

/// The values of one statement, in placeholder order.
#[derive(Clone, Debug)]
pub struct Params {
    dialect: Dialect,
    /// Placeholders handed out before this statement's first (see [`Params::after`]).
    offset: usize,
    values: Vec<Value>,
}

impl Params {
    pub fn new(dialect: Dialect) -> Self {
        Params {
            dialect,
            offset: 0,
            values: Vec::new(),
        }
    }

    /// A second statement's parameters, numbered on from `self`'s, for statements that
    /// PostgreSQL runs as one and MySQL as two.
    pub fn after(&self) -> Self {
        Params {
            dialect: self.dialect,
            offset: self.offset + self.values.len(),
            values: Vec::new(),
        }
    }

    /// This statement's values and the previous one's, as one statement binds them.
    pub fn join(mut self, next: Params) -> Self {
        self.values.extend(next.values);
        self
    }

    pub fn values(&self) -> &[Value] {
        &self.values
    }

    pub fn into_values(self) -> Vec<Value> {
        self.values
    }

    fn push(&mut self, value: Value, pg_type: &str) -> String {
        self.values.push(value);
        let n = self.offset + self.values.len();
        match self.dialect {
            Dialect::Postgres => format!("${n}::{pg_type}"),
            Dialect::MySql => format!(":p{n}"),
        }
    }

    pub fn int(&mut self, value: i64) -> String {
        self.push(Value::Int(value), "int8")
    }

    pub fn bool(&mut self, value: bool) -> String {
        self.push(Value::Bool(value), "bool")
    }

    pub fn text(&mut self, value: impl Into<Option<String>>) -> String {
        self.push(Value::Text(value.into()), "text")
    }

    /// One row id.
    pub fn id(&mut self, id: &RowId) -> String {
        match id {
            RowId::Integer(i) => self.int(*i),
            RowId::Uuid(u) => match self.dialect {
                Dialect::Postgres => self.push(Value::Uuid(*u), "uuid"),
                Dialect::MySql => self.text(u.to_string()),
            },
        }
    }

    /// Membership of the id column in `ids`, written after the column: `= ANY($n)` (one
    /// array) or `IN (1, 2)` (formatted here: integers and UUIDs need no quoting beyond
    /// their own). An empty list matches nothing.
    pub fn in_ids(&mut self, ids: &[RowId], id_type: IdType) -> String {
        match self.dialect {
            Dialect::Postgres => format!("= ANY({})", self.id_array(ids, id_type)),
            Dialect::MySql if ids.is_empty() => "IN (NULL)".into(),
            Dialect::MySql => {
                let list: Vec<String> = ids
                    .iter()
                    .map(|id| match id {
                        RowId::Integer(i) => i.to_string(),
                        RowId::Uuid(u) => format!("'{u}'"),
                    })
                    .collect();
                format!("IN ({})", list.join(", "))
            }
        }
    }

    /// PostgreSQL: the row ids as one array placeholder of the id column's type.
    fn id_array(&mut self, ids: &[RowId], id_type: IdType) -> String {
        match id_type {
            IdType::Integer => {
                let ids = ids.iter().filter_map(RowId::integer).collect();
                self.push(Value::Ints(ids), "int8[]")
            }
            IdType::Uuid => {
                let ids = ids.iter().filter_map(RowId::uuid).collect();
                self.push(Value::Uuids(ids), "uuid[]")
            }
        }
    }

    /// `expr` is none of the row ids `ids` (not empty: leave the condition out instead).
    pub fn not_in_ids(&mut self, expr: &str, ids: &[RowId], id_type: IdType) -> String {
        match self.dialect {
            Dialect::Postgres => format!(
                "{expr} NOT IN (SELECT unnest({}))",
                self.id_array(ids, id_type)
            ),
            Dialect::MySql => format!("{expr} NOT {}", self.in_ids(ids, id_type)),
        }
    }

    /// `expr` is none of `values`, byte for byte (not empty: leave the condition out
    /// instead). PostgreSQL gets one array, probed as a hash (`NOT IN (SELECT unnest(..))`;
    /// `NOT (.. = ANY(..))` would compare each scanned row with every element). MySQL
    /// compares as bytes: under the connection's collation a key waiting to retry held back
    /// `order-1`, `ORDER-1` and `order-1 ` with it.
    pub fn not_in_texts(&mut self, expr: &str, values: Vec<String>) -> String {
        match self.dialect {
            Dialect::Postgres => format!(
                "{expr} NOT IN (SELECT unnest({}))",
                self.push(Value::Texts(values), "text[]")
            ),
            Dialect::MySql => {
                let names: Vec<String> = values
                    .into_iter()
                    .map(|v| format!("CAST({} AS BINARY)", self.text(v)))
                    .collect();
                format!("CAST({expr} AS BINARY) NOT IN ({})", names.join(", "))
            }
        }
    }

    /// The placeholder names of a MySQL statement with their values (`pn`).
    pub fn named(self) -> Vec<(String, Value)> {
        let offset = self.offset;
        self.values
            .into_iter()
            .enumerate()
            .map(|(i, v)| (format!("p{}", offset + i + 1), v))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_number_on_across_statements() {
        let mut first = Params::new(Dialect::Postgres);
        assert_eq!(first.int(1), "$1::int8");
        let mut second = first.after();
        assert_eq!(second.text("a".to_string()), "$2::text");
        assert_eq!(first.join(second).values().len(), 2);
        let mut my = Params::new(Dialect::MySql);
        my.int(1);
        let mut next = my.after();
        assert_eq!(next.bool(true), ":p2");
        assert_eq!(next.named()[0].0, "p2");
    }

    #[test]
    fn mysql_id_lists_are_inlined_and_an_empty_one_matches_nothing() {
        let mut p = Params::new(Dialect::MySql);
        assert_eq!(
            p.in_ids(&[RowId::Integer(1), RowId::Integer(2)], IdType::Integer),
            "IN (1, 2)"
        );
        assert_eq!(p.in_ids(&[], IdType::Integer), "IN (NULL)");
        assert!(p.values().is_empty());
    }
}
