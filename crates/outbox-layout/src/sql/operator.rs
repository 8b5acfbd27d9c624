//! What operators and checks run on a mapped table, beside the lifecycle: counts and
//! per-destination stats, dead rows listed, retried and purged, one event looked up, replay
//! and prune, the table's columns for `check`, and an application's insert for `send`.

use super::Sql;
use crate::params::Params;
use crate::{DeadState, Dialect, IdType, State};

impl Sql {
    /// `(pending, retrying, dead, oldest pending age ms)` per destination (or in total when
    /// `by_destination` is false).
    pub fn stats(&self, by_destination: bool) -> String {
        let m = &self.mapping;
        let sum = |cond: &str| {
            self.int(&format!(
                "coalesce(sum(CASE WHEN {cond} THEN 1 ELSE 0 END), 0)"
            ))
        };
        let retrying = match (self.opt(&m.attempts), self.dialect) {
            (Some(a), _) => format!("({}) AND {a} > 0", self.pending()),
            (None, Dialect::Postgres) => "false".into(),
            (None, Dialect::MySql) => "1 = 0".into(),
        };
        // Since when the row has waited to go out: since its creation once it failed; since
        // it became due while never tried; not at all while scheduled for later. From
        // `created_at` alone, an event scheduled for tomorrow aged the backlog from its
        // insert, and the oldest-pending alert fired on it.
        let waiting_since = |c: &str| match self.opt(&m.available_at) {
            None => c.to_string(),
            Some(a) => {
                let failed = match self.opt(&m.attempts) {
                    Some(attempts) => format!("WHEN {attempts} > 0 THEN {c} "),
                    None => String::new(),
                };
                format!(
                    "CASE {failed}WHEN {a} IS NULL THEN {c} WHEN {a} <= {} THEN \
                     (CASE WHEN {a} > {c} THEN {a} ELSE {c} END) END",
                    self.now()
                )
            }
        };
        let age = match self.opt(&m.created_at) {
            Some(c) => {
                let since = waiting_since(&c);
                match self.dialect {
                    Dialect::Postgres => format!(
                        "(extract(epoch from {} - min(CASE WHEN {} AND isfinite({c}) THEN {since} END)) * 1000)::int8",
                        self.now(),
                        self.pending()
                    ),
                    Dialect::MySql => format!(
                        "CAST(TIMESTAMPDIFF(MICROSECOND, min(CASE WHEN {} THEN {since} END), {}) / 1000 AS SIGNED)",
                        self.pending(),
                        self.now()
                    ),
                }
            }
            None => self.null_int().into(),
        };
        let dest = self.text(&self.col(&m.destination));
        let (select_dest, group) = if by_destination {
            (
                format!("{dest}, "),
                format!(" GROUP BY {dest} ORDER BY {dest}"),
            )
        } else {
            (String::new(), String::new())
        };
        format!(
            "SELECT {select_dest}{}, {}, {}, {age} FROM {} o WHERE ({}) OR ({}){group}",
            sum(&self.pending()),
            sum(&retrying),
            sum(&self.dead()),
            self.table(),
            self.pending(),
            self.dead(),
        )
    }

    fn dead_at(&self) -> String {
        let m = &self.mapping;
        match m.dead_state() {
            DeadState::Timestamp(c) => self.micros(&self.col(&c)),
            DeadState::SideTable => self.micros(&format!(
                "(SELECT dl.dead_at FROM {} dl WHERE dl.id = {})",
                self.dead_table(),
                self.id()
            )),
            _ => match self.opt(&m.updated_at) {
                Some(c) => self.micros(&c),
                None => self.null_int().into(),
            },
        }
    }

    /// A dead row's attempts and last error (the side table's, where the layout keeps them
    /// there), as an int and a text expression over alias `o`.
    fn attempts_and_error(&self) -> (String, String) {
        let m = &self.mapping;
        let side = m.dead_state() == DeadState::SideTable;
        let side_col = |c: &str| {
            format!(
                "(SELECT dl.{c} FROM {} dl WHERE dl.id = {})",
                self.dead_table(),
                self.id()
            )
        };
        let attempts = if side {
            self.int(&side_col("attempts"))
        } else {
            self.opt(&m.attempts)
                .map(|a| self.int(&a))
                .unwrap_or_else(|| self.null_int().into())
        };
        let error = if side {
            self.text(&side_col("last_error"))
        } else {
            self.opt(&m.last_error)
                .map(|c| self.text(&c))
                .unwrap_or_else(|| self.null_text().into())
        };
        (attempts, error)
    }

    /// The event type as text (the destination where the layout has no type).
    pub fn event_type_text(&self) -> String {
        let m = &self.mapping;
        self.text(&self.col(m.event_type.as_ref().unwrap_or(&m.destination)))
    }

    /// Dead rows: id, event id, destination, type, attempts, last error, dead at (µs).
    /// `filter` is more conditions over alias `o` (each starting with ` AND `), `limit` a
    /// placeholder. Rows come in id order when ids are integers (so a page can continue
    /// after the last id), else in publish order.
    pub fn dead_list(&self, filter: &str, limit: &str) -> String {
        let m = &self.mapping;
        let (attempts, error) = self.attempts_and_error();
        let dest = self.text(&self.col(&m.destination));
        let order = match m.id_type {
            IdType::Integer => self.id(),
            IdType::Uuid => self.order_by(),
        };
        format!(
            "SELECT {}, {}, {dest}, {}, {attempts}, {error}, {} FROM {} o WHERE {}{filter} ORDER BY {order} LIMIT {limit}",
            self.text(&self.id()),
            self.opt(&m.event_id).map(|c| self.text(&c)).unwrap_or_else(|| self.null_text().into()),
            self.event_type_text(),
            self.dead_at(),
            self.table(),
            self.dead(),
        )
    }

    /// The rows matching `condition` (over alias `o`): the `select_list` columns, then the
    /// state (0 pending, 1 delivered, 2 dead), attempts and last error as a dead row has
    /// them, and the dead-at time (µs), from [`Sql::claim_order_column`] on.
    pub fn event(&self, condition: &str) -> String {
        let (attempts, error) = self.attempts_and_error();
        let delivered = self.delivered().unwrap_or_else(|| "1 = 0".into());
        let state = self.int(&format!(
            "(CASE WHEN {} THEN 2 WHEN {delivered} THEN 1 ELSE 0 END)",
            self.dead()
        ));
        format!(
            "SELECT {}, {state}, {attempts}, {error}, {} FROM {} o WHERE {condition}",
            self.select_list(),
            self.dead_at(),
            self.table(),
        )
    }

    /// Returns dead rows (selected by `condition`, over alias `o`) to pending with their
    /// attempts reset; `None` for the side table (the executor deletes its rows instead).
    pub fn dead_retry(&self, condition: &str) -> Option<String> {
        let m = &self.mapping;
        let mut set = Vec::new();
        match (&m.state, m.dead_state()) {
            (_, DeadState::SideTable) => return None,
            (
                State::Status {
                    column, pending, ..
                },
                _,
            )
            | (
                State::Flag {
                    column, pending, ..
                },
                _,
            ) => set.push(format!(
                "{} = {}",
                self.quote(column),
                self.state_literal(pending)
            )),
            (State::Rows, _) => {}
        }
        if let DeadState::Timestamp(c) = m.dead_state() {
            set.push(format!("{} = NULL", self.quote(&c)));
        }
        if let Some(c) = &m.attempts {
            set.push(format!("{} = 0", self.quote(c)));
        }
        if let Some(c) = &m.last_error {
            set.push(format!("{} = NULL", self.quote(c)));
        }
        if let Some(c) = &m.available_at {
            set.push(format!("{} = {}", self.quote(c), self.now()));
        }
        set.extend(self.unlock());
        self.touch(&mut set);
        Some(self.update(&set, &format!("({}) AND {condition}", self.dead())))
    }

    /// The destination as text, over alias `o`.
    pub fn destination_text(&self) -> String {
        self.text(&self.col(&self.mapping.destination))
    }

    /// The timestamp a delivered row is aged by for `prune`.
    pub fn delivered_time(&self) -> Option<String> {
        let m = &self.mapping;
        self.opt(&m.delivered_at)
            .or_else(|| self.opt(&m.updated_at))
            .or_else(|| self.opt(&m.created_at))
    }

    /// The timestamp a dead row is aged by for `prune`.
    pub fn dead_time(&self) -> Option<String> {
        let m = &self.mapping;
        match m.dead_state() {
            DeadState::Timestamp(c) => Some(self.col(&c)),
            DeadState::SideTable => Some(format!(
                "(SELECT dl.dead_at FROM {} dl WHERE dl.id = {})",
                self.dead_table(),
                self.id()
            )),
            _ => self.opt(&m.updated_at).or_else(|| self.opt(&m.created_at)),
        }
    }

    /// `created_at` over alias `o`, when mapped.
    pub fn created_at(&self) -> Option<String> {
        self.opt(&self.mapping.created_at)
    }

    /// Sets delivered rows back to pending for `replay`.
    pub fn replay_set(&self) -> Vec<String> {
        let m = &self.mapping;
        let mut set = Vec::new();
        match &m.state {
            State::Status {
                column, pending, ..
            }
            | State::Flag {
                column, pending, ..
            } => set.push(format!(
                "{} = {}",
                self.quote(column),
                self.state_literal(pending)
            )),
            State::Rows => {}
        }
        if let Some(c) = &m.delivered_at {
            set.push(format!("{} = NULL", self.quote(c)));
        }
        if let Some(c) = &m.attempts {
            set.push(format!("{} = 0", self.quote(c)));
        }
        if let Some(c) = &m.available_at {
            set.push(format!("{} = {}", self.quote(c), self.now()));
        }
        self.touch(&mut set);
        set
    }

    /// A timestamp placeholder holding microseconds since the epoch, as the table's
    /// timestamp columns hold it.
    pub fn at_micros(&self, micros: &str) -> String {
        match (self.dialect, self.mapping.utc_timestamps) {
            (Dialect::Postgres, false) => format!("to_timestamp({micros}::float8 / 1e6)"),
            (Dialect::Postgres, true) => {
                format!("(to_timestamp({micros}::float8 / 1e6) AT TIME ZONE 'UTC')")
            }
            // The session's time zone is UTC (see the MySQL store).
            (Dialect::MySql, _) => format!("FROM_UNIXTIME({micros} / 1000000)"),
        }
    }

    /// The destination equals a placeholder.
    pub fn destination_is(&self, destination: &str) -> String {
        self.same_text(&self.destination_text(), destination)
    }

    /// The event type equals a placeholder.
    pub fn event_type_is(&self, event_type: &str) -> String {
        self.same_text(&self.event_type_text(), event_type)
    }

    /// Two texts are the same, byte for byte: MySQL compares under the connection's
    /// collation, case- and accent-blind, and `dead purge --destination orders` deleted
    /// `Orders`' and `ördérs`' dead letters too (PostgreSQL and SQLite compare exactly).
    fn same_text(&self, a: &str, b: &str) -> String {
        match self.dialect {
            Dialect::Postgres => format!("{a} = {b}"),
            Dialect::MySql => format!("CAST({a} AS BINARY) = CAST({b} AS BINARY)"),
        }
    }

    /// Delivered rows created in `[since, until)` (placeholders in µs), for `replay`; `None`
    /// when the table keeps no delivered rows or no creation time.
    pub fn delivered_between(&self, since: &str, until: &str) -> Option<String> {
        let (delivered, created) = (self.delivered()?, self.created_at()?);
        Some(format!(
            "({delivered}) AND {created} >= {} AND {created} < {}",
            self.at_micros(since),
            self.at_micros(until)
        ))
    }

    /// Delivered rows older than `before` (µs), for `prune`.
    pub fn delivered_before(&self, before: &str) -> Option<String> {
        Some(format!(
            "({}) AND {} < {}",
            self.delivered()?,
            self.delivered_time()?,
            self.at_micros(before)
        ))
    }

    /// Dead rows older than `before` (µs), for `prune`.
    pub fn dead_before(&self, before: &str) -> Option<String> {
        Some(format!(
            "({}) AND {} < {}",
            self.dead(),
            self.dead_time()?,
            self.at_micros(before)
        ))
    }

    /// How many rows match `condition`.
    pub fn count(&self, condition: &str) -> String {
        format!(
            "SELECT {} FROM {} o WHERE {condition}",
            self.int("count(*)"),
            self.table()
        )
    }

    /// The ids (as text) of up to `limit` rows matching `condition`, in id order.
    pub fn pick(&self, condition: &str, limit: &str) -> String {
        format!(
            "SELECT {} FROM {} o WHERE {condition} ORDER BY {} LIMIT {limit}",
            self.text(&self.id()),
            self.table(),
            self.id()
        )
    }

    /// Deletes rows by id (`ids` as [`Params::in_ids`] writes it).
    pub fn delete(&self, ids: &str) -> String {
        format!(
            "DELETE FROM {} WHERE {} {ids}",
            self.table(),
            self.quote(&self.mapping.id)
        )
    }

    /// Deletes rows by id that still match `condition` (over alias `o`, its parameters
    /// before the ids'): the rows were picked by an earlier statement, and one that `replay`
    /// or `dead retry` made pending meanwhile no longer matches.
    pub fn delete_matching(&self, ids: &str, condition: &str) -> String {
        let id = format!("o.{}", self.quote(&self.mapping.id));
        match self.dialect {
            Dialect::Postgres => format!(
                "DELETE FROM {} o WHERE ({condition}) AND {id} {ids}",
                self.table()
            ),
            // MySQL's single-table DELETE takes no alias (MariaDB 10.11).
            Dialect::MySql => format!(
                "DELETE o FROM {} o WHERE ({condition}) AND {id} {ids}",
                self.table()
            ),
        }
    }

    /// Deletes the side table's records of rows by id whose row is gone.
    pub fn delete_dead_records_of_missing(&self, ids: &str) -> String {
        let dead = self.dead_table();
        format!(
            "DELETE FROM {dead} WHERE id {ids} AND NOT EXISTS \
             (SELECT 1 FROM {} o WHERE o.{} = {dead}.id)",
            self.table(),
            self.quote(&self.mapping.id)
        )
    }

    /// Deletes the side table's records of rows by id.
    pub fn delete_dead_records(&self, ids: &str) -> String {
        format!("DELETE FROM {} WHERE id {ids}", self.dead_table())
    }

    /// information_schema's filter for the table's columns.
    fn the_tables_columns(&self, params: &mut Params) -> String {
        let schema = match (self.dialect, &self.mapping.schema) {
            (_, Some(schema)) => params.text(schema.clone()),
            (Dialect::Postgres, None) => params.text("public".to_string()),
            (Dialect::MySql, None) => "DATABASE()".into(),
        };
        let table = params.text(self.mapping.table.clone());
        format!("table_schema = {schema} AND table_name = {table}")
    }

    /// The names of the table's columns (for `check`).
    /// The table's columns, each with its type (information_schema's `data_type`).
    pub fn columns_query(&self, params: &mut Params) -> String {
        let table = self.the_tables_columns(params);
        format!(
            "SELECT {}, {} FROM information_schema.columns WHERE {table}",
            self.text("column_name"),
            self.text("data_type")
        )
    }

    /// The most characters, and bytes, `column` of the table holds (NULL where unbounded):
    /// the first row's two integers.
    pub fn column_length_query(&self, column: &str, params: &mut Params) -> String {
        let table = self.the_tables_columns(params);
        let column = params.text(column.to_string());
        format!(
            "SELECT {}, {} FROM information_schema.columns \
              WHERE {table} AND column_name = {column}",
            self.int("character_maximum_length"),
            self.int("character_octet_length")
        )
    }

    /// The type of `column` of the table (information_schema's `data_type`), in the first
    /// row.
    pub fn column_type_query(&self, column: &str, params: &mut Params) -> String {
        let table = self.the_tables_columns(params);
        let column = params.text(column.to_string());
        format!(
            "SELECT {} FROM information_schema.columns \
              WHERE {table} AND column_name = {column}",
            self.text("data_type")
        )
    }

    /// How many unique indexes hold `column` of the table alone (a primary key among
    /// them), in the first row: none, and two rows may share an event id. Partial and
    /// prefix indexes do not count: they leave rows outside them free to repeat it.
    pub fn unique_column_query(&self, column: &str, params: &mut Params) -> String {
        match self.dialect {
            Dialect::Postgres => {
                let table = params.text(self.table());
                let column = params.text(column.to_string());
                format!(
                    "SELECT count(*)::int8 FROM pg_index i \
                       JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] \
                      WHERE i.indrelid = to_regclass({table}) AND i.indisunique \
                        AND i.indnkeyatts = 1 AND i.indpred IS NULL AND a.attname = {column}"
                )
            }
            Dialect::MySql => {
                let table = self.the_tables_columns(params);
                let column = params.text(column.to_string());
                format!(
                    "SELECT CAST(COUNT(*) AS SIGNED) FROM (SELECT index_name \
                       FROM information_schema.statistics WHERE {table} AND non_unique = 0 \
                      GROUP BY index_name \
                     HAVING COUNT(*) = 1 AND MAX(column_name) = {column} \
                        AND MAX(sub_part) IS NULL) u"
                )
            }
        }
    }

    /// Inserts one row as an application would: `columns` take one untyped placeholder each
    /// (`$n` or `?`, converted to the column's type by the executor), the mapping's insert
    /// defaults fill the columns left out, and PostgreSQL returns the row id.
    pub fn insert(&self, columns: &[&str]) -> String {
        let mut names: Vec<String> = columns.iter().map(|c| self.quote(c)).collect();
        let mut values: Vec<String> = (1..=columns.len())
            .map(|i| match self.dialect {
                Dialect::Postgres => format!("${i}"),
                Dialect::MySql => "?".into(),
            })
            .collect();
        for (column, expression) in &self.mapping.insert_defaults {
            if !columns.contains(&column.as_str()) {
                names.push(self.quote(column));
                values.push(expression.clone());
            }
        }
        let returning = match self.dialect {
            Dialect::Postgres => format!(" RETURNING {}", self.quote(&self.mapping.id)),
            Dialect::MySql => String::new(),
        };
        format!(
            "INSERT INTO {} ({}) VALUES ({}){returning}",
            self.table(),
            names.join(", "),
            values.join(", ")
        )
    }
}
