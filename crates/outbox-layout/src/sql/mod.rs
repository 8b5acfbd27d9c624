//! Statements for a mapped table, in PostgreSQL or MySQL/MariaDB syntax.
//!
//! Every method returns complete statement text. Placeholders are written by the caller's
//! fragments (`$n` for PostgreSQL, `?` for MySQL), so the executor decides how id lists are
//! bound: PostgreSQL arrays, or MySQL lists of integers it formats itself. Every claimed row
//! is selected as [`Sql::select_list`] in this order: id, event id, destination, key, type,
//! payload, headers, mutation id, rejected, attempts, created_at (µs), max attempts,
//! traceparent, tracestate.
//!
//! This module holds the expressions every statement is written from and the lifecycle's
//! statements (claim, ack, retry, dead-letter, release, extend, reap); `operator.rs` holds
//! what operators and checks run, `ddl.rs` what `migrate` creates and the grants.

mod ddl;
mod operator;

pub use ddl::{
    adbc_outbox_ddl, debezium_ddl, export_ddl, mysql_outbox_events_ddl, native_mysql_ddl,
    open_outbox_ddl, pg_create_schema, MYSQL_EVENT_COLUMNS, MYSQL_PENDING_INDEX_COLUMNS,
};

use uuid::Uuid;

/// How long a MySQL/MariaDB session of the relay may wait for its next statement
/// ([`MYSQL_SESSION_SETTINGS`] sets it as `wait_timeout`).
pub const MYSQL_IDLE_SESSION: std::time::Duration = std::time::Duration::from_secs(10);

/// How long a MySQL/MariaDB statement of the relay waits for a lock, row or table
/// ([`MYSQL_SESSION_SETTINGS`] sets `innodb_lock_wait_timeout` and `lock_wait_timeout`):
/// less than the relay's own bound on an operation
/// ([`outbox_core::store::OPERATION_TIMEOUT`]). The relay gives up on a statement at its
/// bound and drops the connection, but InnoDB does not see a client gone during a lock
/// wait: with its default of 50 s, a reap of expired leases the relay had given up on ran
/// once the lock was let go, clearing a lease the relay still held, and the row went out
/// again after later rows of its key. `lock_wait_timeout` (metadata locks: an `ALTER
/// TABLE`) defaults to a year.
pub const MYSQL_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(20);

/// What every MySQL/MariaDB connection of the relay runs first, the polling store's and
/// binlog capture's alike (and again after the pool resets a connection between uses).
pub const MYSQL_SESSION_SETTINGS: [&str; 2] = [
    // Timestamps are written and read as UTC, whatever the server's zone: `available_at`
    // is computed from `NOW(6)` and compared with claims' times.
    //
    // And the server ends a session that waits longer than [`MYSQL_IDLE_SESSION`] for the
    // relay's next statement, rolling its transaction back. A paused relay (SIGSTOP, a frozen
    // VM) otherwise keeps a transaction's row locks for the server's `wait_timeout`, 8 hours
    // by default, and the standby that takes over waits on them: MySQL has no
    // `idle_in_transaction_session_timeout` (MariaDB's `idle_transaction_timeout` is not in
    // MySQL 8). The pools close their idle connections before the server would.
    //
    // And a statement waits for a lock at most [`MYSQL_LOCK_WAIT`].
    "SET time_zone = '+00:00', wait_timeout = 10, innodb_lock_wait_timeout = 20, \
     lock_wait_timeout = 20",
    // The seed's reason: no gap locks, which in REPEATABLE READ made the application's
    // inserts wait for a claim or a delete of delivered rows in flight.
    "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
];

use crate::{
    literal, DeadState, Dialect, IdType, KeyFallback, Mapping, OnSuccess, PayloadFormat, State,
};

/// A validated mapping rendered for one dialect.
#[derive(Clone, Debug)]
pub struct Sql {
    pub mapping: Mapping,
    pub dialect: Dialect,
}

/// The placeholders of a statement on one failed row ([`Sql::retry`], [`Sql::dead_letter`]):
/// the row, the node that must still hold it, its attempts so far and its last error.
#[derive(Clone, Debug)]
pub struct Failure {
    pub id: String,
    pub node: String,
    pub attempts: String,
    pub error: String,
}

/// The message every reaped row gets as its last error.
pub const REAPED: &str =
    "the relay holding this event stopped before settling it (lease expired); counted as an attempt";

impl Sql {
    /// Validates the mapping.
    pub fn new(mapping: Mapping, dialect: Dialect) -> Result<Self, outbox_core::StoreError> {
        mapping.validate()?;
        Ok(Sql { mapping, dialect })
    }

    pub fn quote(&self, name: &str) -> String {
        match self.dialect {
            Dialect::Postgres => format!("\"{name}\""),
            Dialect::MySql => format!("`{name}`"),
        }
    }

    /// The schema-qualified table.
    pub fn table(&self) -> String {
        self.qualified(&self.mapping.table)
    }

    /// A table in the mapping's schema.
    pub fn qualified(&self, name: &str) -> String {
        match &self.mapping.schema {
            Some(schema) => format!("{}.{}", self.quote(schema), self.quote(name)),
            None => self.quote(name),
        }
    }

    /// The relay's side table for dead rows of layouts that cannot mark them.
    pub fn dead_table(&self) -> String {
        self.qualified(&format!("{}_dead_letters", self.mapping.table))
    }

    fn col(&self, name: &str) -> String {
        format!("o.{}", self.quote(name))
    }

    fn opt(&self, name: &Option<String>) -> Option<String> {
        name.as_deref().map(|n| self.col(n))
    }

    /// The current time as the timestamp columns hold it.
    pub fn now(&self) -> &'static str {
        match (self.dialect, self.mapping.utc_timestamps) {
            (Dialect::Postgres, false) => "now()",
            (Dialect::Postgres, true) => "(now() AT TIME ZONE 'UTC')",
            (Dialect::MySql, _) => "UTC_TIMESTAMP(6)",
        }
    }

    /// `now + ms` for a placeholder holding milliseconds.
    fn now_plus(&self, ms: &str) -> String {
        match self.dialect {
            Dialect::Postgres => format!("{} + {ms}::int8 * interval '1 millisecond'", self.now()),
            Dialect::MySql => format!("{} + INTERVAL ({ms} * 1000) MICROSECOND", self.now()),
        }
    }

    fn now_minus(&self, ms: &str) -> String {
        match self.dialect {
            Dialect::Postgres => format!("{} - {ms}::int8 * interval '1 millisecond'", self.now()),
            Dialect::MySql => format!("{} - INTERVAL ({ms} * 1000) MICROSECOND", self.now()),
        }
    }

    fn text(&self, expr: &str) -> String {
        match self.dialect {
            Dialect::Postgres => format!("({expr})::text"),
            Dialect::MySql => format!("CAST({expr} AS CHAR)"),
        }
    }

    fn int(&self, expr: &str) -> String {
        match self.dialect {
            Dialect::Postgres => format!("({expr})::int8"),
            Dialect::MySql => format!("CAST({expr} AS SIGNED)"),
        }
    }

    fn micros(&self, expr: &str) -> String {
        match self.dialect {
            // 'infinity' has no epoch to speak of: it reads as a time beyond any the relay
            // accepts, so the row is dead-lettered with the reason instead of failing the
            // whole statement.
            Dialect::Postgres => format!(
                "CASE WHEN isfinite({expr}) THEN (extract(epoch from {expr}) * 1000000)::int8 \
                 WHEN {expr} > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END"
            ),
            // Not UNIX_TIMESTAMP(): it gives NULL before 1970, which read as no time at all.
            // The difference is taken in the session's time zone, which the store sets to
            // UTC.
            Dialect::MySql => {
                format!("TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', {expr})")
            }
        }
    }

    fn null_text(&self) -> &'static str {
        match self.dialect {
            Dialect::Postgres => "NULL::text",
            Dialect::MySql => "NULL",
        }
    }

    fn null_int(&self) -> &'static str {
        match self.dialect {
            Dialect::Postgres => "NULL::int8",
            Dialect::MySql => "NULL",
        }
    }

    /// The row id as selected (`int8` or `uuid`).
    pub fn id_expr(&self) -> String {
        let id = self.col(&self.mapping.id);
        match (self.mapping.id_type, self.dialect) {
            // `+ 0`, not `CAST(… AS SIGNED)`: both drop ZEROFILL's padding, but the cast
            // wraps a BIGINT UNSIGNED past 2^63 to a negative id that names no row, so its
            // ack matched nothing and the row went out again every second. Read as it is,
            // such an id is one the relay cannot hold, and the row is set aside.
            (IdType::Integer, Dialect::MySql) => format!("({id} + 0)"),
            (IdType::Integer, Dialect::Postgres) => self.int(&id),
            (IdType::Uuid, _) => id,
        }
    }

    fn id(&self) -> String {
        self.col(&self.mapping.id)
    }

    /// The ordering key as text; the same expression the executor derives for decoded rows.
    pub fn key_expr(&self) -> String {
        let fallback = match self.mapping.key_fallback {
            KeyFallback::Destination => self.text(&self.col(&self.mapping.destination)),
            KeyFallback::Row => match self.dialect {
                Dialect::Postgres => format!("'row:' || {}", self.text(&self.id())),
                Dialect::MySql => format!("CONCAT('row:', {})", self.text(&self.id())),
            },
        };
        match &self.mapping.key {
            Some(key) => format!("coalesce({}, {fallback})", self.text(&self.col(key))),
            None => fallback,
        }
    }

    /// The ordering key as the database compares it exactly: MySQL compares texts under the
    /// connection's collation (case-, accent- and trailing-space-blind), so there, as bytes.
    fn exact_key(&self) -> String {
        match self.dialect {
            Dialect::Postgres => self.key_expr(),
            Dialect::MySql => format!("CAST({} AS BINARY)", self.key_expr()),
        }
    }

    /// Whether claims leave out crowded keys: only in the default order of integer ids,
    /// where an id bounds the window ([`Sql::window_end`]).
    pub fn leaves_out_crowded_keys(&self) -> bool {
        self.mapping.order_by.is_empty() && self.mapping.id_type == IdType::Integer
    }

    /// The id of the last of the first `window` claimable rows, for a claim that leaves
    /// keys out to go no further (see [`outbox_core::store::Crowded`]): it would otherwise
    /// walk past every row of their backlogs. `None` where rows go out in another order than
    /// their integer id's (a custom `order_by`, UUID ids): such a table's claims leave no
    /// key out. Run apart, so MySQL's range scan has a constant to stop at.
    pub fn window_end(&self, window: usize) -> Option<String> {
        if !self.leaves_out_crowded_keys() {
            return None;
        }
        let id = self.id();
        Some(format!(
            "SELECT max(w.id) FROM (SELECT {id} AS id FROM {} o WHERE {} ORDER BY {id} LIMIT {window}) w",
            self.table(),
            self.claimable(),
        ))
    }

    /// The columns of a claimed row (see the module docs for the order).
    pub fn select_list(&self) -> String {
        self.select_items().join(", ")
    }

    fn select_items(&self) -> Vec<String> {
        let m = &self.mapping;
        let text_or_null = |c: &Option<String>| match self.opt(c) {
            Some(c) => self.text(&c),
            None => self.null_text().to_string(),
        };
        let int_or_null = |c: &Option<String>| match self.opt(c) {
            Some(c) => self.int(&c),
            None => self.null_int().to_string(),
        };
        let payload = match (self.dialect, m.payload_format) {
            (Dialect::Postgres, PayloadFormat::Bytes) => self.col(&m.payload),
            (Dialect::Postgres, _) => self.text(&self.col(&m.payload)),
            (Dialect::MySql, _) => self.col(&m.payload),
        };
        let created = match self.opt(&m.created_at) {
            Some(c) => self.micros(&c),
            None => self.null_int().to_string(),
        };
        let max_attempts = match self.max_attempts_of_row() {
            Some(max) => self.int(&max),
            None => self.null_int().to_string(),
        };
        [
            self.id_expr(),
            text_or_null(&m.event_id),
            self.text(&self.col(&m.destination)),
            text_or_null(&m.key),
            text_or_null(&m.event_type),
            payload,
            text_or_null(&m.headers),
            text_or_null(&m.mutation_id),
            match self.opt(&m.rejected) {
                Some(c) => self.int(&format!("CASE WHEN {c} THEN 1 ELSE 0 END")),
                None => self.null_int().to_string(),
            },
            int_or_null(&m.attempts),
            created,
            max_attempts,
            // A span-context column (Java properties) stands in the traceparent slot; the
            // decoder reads its entries.
            text_or_null(if m.span_context.is_some() {
                &m.span_context
            } else {
                &m.traceparent
            }),
            text_or_null(&m.tracestate),
        ]
        .into()
    }

    /// The row's attempt limit, read from the table the mapping names for it.
    fn max_attempts_of_row(&self) -> Option<String> {
        let from = self.mapping.max_attempts_from.as_ref()?;
        let plus = if from.counts_retries { " + 1" } else { "" };
        Some(format!(
            "(SELECT mx.{col}{plus} FROM {table} mx WHERE mx.{key} = {join})",
            col = self.quote(&from.column),
            table = self.qualified(&from.table),
            key = self.quote(&from.key_column),
            join = self.col(&from.join_column),
        ))
    }

    fn state_literal(&self, value: &str) -> String {
        literal(value).expect("validated")
    }

    fn state_is(&self, value: &str) -> Option<String> {
        match &self.mapping.state {
            State::Flag { column, .. } | State::Status { column, .. } => Some(format!(
                "{} = {}",
                self.col(column),
                self.state_literal(value)
            )),
            State::Rows => None,
        }
    }

    /// Rows that are not delivered nor dead (in flight included).
    pub fn pending(&self) -> String {
        let m = &self.mapping;
        let mut parts = Vec::new();
        match &m.state {
            State::Status {
                column,
                pending,
                in_flight,
                ..
            } => {
                let mut values = vec![self.state_literal(pending)];
                values.extend(in_flight.iter().map(|v| self.state_literal(v)));
                parts.push(format!("{} IN ({})", self.col(column), values.join(", ")));
            }
            State::Flag { pending, .. } => parts.extend(self.state_is(pending)),
            State::Rows => {}
        }
        if let Some(d) = self.opt(&m.delivered_at) {
            if !matches!(m.state, State::Status { .. }) {
                parts.push(format!("{d} IS NULL"));
            }
        }
        match m.dead_state() {
            DeadState::Timestamp(c) => parts.push(format!("{} IS NULL", self.col(&c))),
            DeadState::SideTable => parts.push(format!(
                "NOT EXISTS (SELECT 1 FROM {} dl WHERE dl.id = {})",
                self.dead_table(),
                self.id()
            )),
            _ => {}
        }
        if parts.is_empty() {
            "true".into()
        } else {
            parts.join(" AND ")
        }
    }

    /// Dead rows.
    pub fn dead(&self) -> String {
        match self.mapping.dead_state() {
            DeadState::Status(v) | DeadState::Flag(v) => self.state_is(&v).expect("a state column"),
            DeadState::Timestamp(c) => format!("{} IS NOT NULL", self.col(&c)),
            DeadState::SideTable => format!(
                "EXISTS (SELECT 1 FROM {} dl WHERE dl.id = {})",
                self.dead_table(),
                self.id()
            ),
        }
    }

    /// Delivered rows that are retained.
    pub fn delivered(&self) -> Option<String> {
        let m = &self.mapping;
        if m.on_success != OnSuccess::Mark && !matches!(m.state, State::Rows) {
            return None;
        }
        match &m.state {
            State::Status { delivered, .. } => self.state_is(delivered),
            State::Flag { done, .. } => self.state_is(done).map(|s| {
                if m.dead_state() == DeadState::SideTable {
                    s
                } else {
                    format!("{s} AND NOT ({})", self.dead())
                }
            }),
            State::Rows => self
                .opt(&m.delivered_at)
                .map(|d| format!("{d} IS NOT NULL")),
        }
    }

    /// Rows that may be claimed now (besides the blocked keys and held ids the executor adds).
    pub fn claimable(&self) -> String {
        let m = &self.mapping;
        let mut parts = Vec::new();
        match &m.state {
            State::Status { pending, .. } => parts.extend(self.state_is(pending)),
            _ => parts.push(self.pending()),
        }
        if matches!(m.state, State::Status { .. }) {
            if let DeadState::SideTable = m.dead_state() {
                parts.push(self.pending());
            }
        }
        match (self.opt(&m.locked_by), self.opt(&m.locked_until)) {
            (_, Some(until)) => {
                parts.push(format!("({until} IS NULL OR {until} < {})", self.now()))
            }
            (Some(by), None)
                if !matches!(
                    m.state,
                    State::Status {
                        in_flight: Some(_),
                        ..
                    }
                ) =>
            {
                parts.push(format!("{by} IS NULL"))
            }
            _ => {}
        }
        if let Some(a) = self.opt(&m.available_at) {
            parts.push(format!("{a} <= {}", self.now()));
            if m.waiting_rows_block_their_key {
                // Uncorrelated, so evaluated once a claim: the subquery's alias `o` shadows the
                // claimed row's, so its columns are its own rows'.
                let key = self.exact_key();
                let waiting = format!(
                    "FROM {} o WHERE {} AND {a} > {}",
                    self.table(),
                    self.pending(),
                    self.now()
                );
                parts.push(match self.dialect {
                    Dialect::Postgres => format!("{key} NOT IN (SELECT {key} {waiting})"),
                    // MariaDB ran the subquery again for every candidate row (a DEPENDENT
                    // SUBQUERY): 5 s a claim over 25,000 parked rows, past the statement's
                    // bound, so nothing was delivered. Grouped in a derived table, the
                    // waiting keys are read once (16 ms).
                    Dialect::MySql => format!(
                        "{key} NOT IN (SELECT w.k FROM (SELECT {key} AS k {waiting} GROUP BY k) w)"
                    ),
                });
            }
        }
        parts.join(" AND ")
    }

    /// The keys with a row waiting to retry (attempts recorded, due later than now), with
    /// the milliseconds until the last of them is due; `None` where the table keeps no
    /// attempts or due time.
    pub fn waiting_keys(&self) -> Option<String> {
        let m = &self.mapping;
        let due = self.opt(&m.available_at)?;
        let attempts = self.opt(&m.attempts)?;
        let now = self.now();
        let (key, group) = (self.key_expr(), self.exact_key());
        let (key, left) = match self.dialect {
            Dialect::Postgres => (
                key,
                format!("CAST(extract(epoch FROM max({due}) - {now}) * 1000 AS bigint)"),
            ),
            // Grouped by bytes, so each group's texts are one: `min` picks it.
            Dialect::MySql => (
                format!("min({key})"),
                format!("TIMESTAMPDIFF(MICROSECOND, {now}, max({due})) DIV 1000"),
            ),
        };
        Some(format!(
            "SELECT {key}, {left} FROM {} o WHERE {} AND {attempts} > 0 AND {due} > {now} \
             GROUP BY {group}",
            self.table(),
            self.pending()
        ))
    }

    /// A column of the table, on alias `o`.
    pub fn column(&self, name: &str) -> String {
        self.col(name)
    }

    /// Each row's event id in SQL: its event id column, or, without one, the id
    /// [`crate::memory::derived_event_id`] gives the row (a version 5 UUID of the table and row
    /// id, computed here from its SHA-1 as RFC 9562 lays it out). MySQL/MariaDB only: it is
    /// how binlog capture adopts a mapped table's rows with the ids polling would give them.
    pub fn event_id_expr(&self) -> String {
        if let Some(column) = &self.mapping.event_id {
            // Polling trims the id before reading it.
            return format!("TRIM({})", self.text(&self.col(column)));
        }
        debug_assert_eq!(self.dialect, Dialect::MySql);
        let table = match &self.mapping.schema {
            Some(s) => format!("{s}.{}", self.mapping.table),
            None => self.mapping.table.clone(),
        };
        let name = format!("outbox-relay:{table}:")
            .replace('\\', "\\\\")
            .replace('\'', "''");
        let namespace = Uuid::NAMESPACE_OID.simple();
        // The id as polling reads it (`… + 0`: no ZEROFILL padding).
        let h = format!(
            "SHA1(CONCAT(UNHEX('{namespace}'), '{name}', {}))",
            self.text(&self.id_expr())
        );
        // Hex digit 13 is the version (5); digit 17 keeps its low two bits under the
        // variant's `10`.
        format!(
            "CONCAT(SUBSTR({h}, 1, 8), '-', SUBSTR({h}, 9, 4), '-5', SUBSTR({h}, 14, 3), '-', \
             LOWER(CONV((CONV(SUBSTR({h}, 17, 1), 16, 10) & 3) | 8, 10, 16)), \
             SUBSTR({h}, 18, 3), '-', SUBSTR({h}, 21, 12))"
        )
    }

    /// `ORDER BY` terms.
    pub fn order_by(&self) -> String {
        if self.mapping.order_by.is_empty() {
            self.id()
        } else {
            self.mapping
                .order_by
                .iter()
                .map(|c| self.col(c))
                .collect::<Vec<_>>()
                .join(", ")
        }
    }

    /// `SET` items marking a claim, for a node and lease placeholder; empty when the table has
    /// nothing to mark.
    pub fn claim_set(&self, node: &str, lease_ms: &str) -> Vec<String> {
        let m = &self.mapping;
        let q = |c: &str| self.quote(c);
        let mut set = Vec::new();
        if let State::Status {
            column,
            in_flight: Some(v),
            ..
        } = &m.state
        {
            set.push(format!("{} = {}", q(column), self.state_literal(v)));
        }
        if let Some(c) = &m.locked_by {
            set.push(format!("{} = {node}", q(c)));
        }
        if let Some(c) = &m.locked_until {
            set.push(format!("{} = {}", q(c), self.now_plus(lease_ms)));
        }
        if let Some(c) = &m.locked_at {
            set.push(format!("{} = {}", q(c), self.now()));
        }
        if !set.is_empty() {
            if let Some(c) = &m.updated_at {
                set.push(format!("{} = {}", q(c), self.now()));
            }
        }
        set
    }

    fn unlock(&self) -> Vec<String> {
        let m = &self.mapping;
        [&m.locked_by, &m.locked_until, &m.locked_at]
            .into_iter()
            .flatten()
            .map(|c| format!("{} = NULL", self.quote(c)))
            .collect()
    }

    fn touch(&self, set: &mut Vec<String>) {
        if let Some(c) = &self.mapping.updated_at {
            let column = format!("{} =", self.quote(c));
            if !set.is_empty() && !set.iter().any(|s| s.starts_with(&column)) {
                set.push(format!("{} = {}", self.quote(c), self.now()));
            }
        }
    }

    fn back_to_pending(&self) -> Vec<String> {
        let mut set = Vec::new();
        if let State::Status {
            column,
            pending,
            in_flight: Some(_),
            ..
        } = &self.mapping.state
        {
            set.push(format!(
                "{} = {}",
                self.quote(column),
                self.state_literal(pending)
            ));
        }
        set.extend(self.unlock());
        set
    }

    /// Settles apply only to rows this node still holds, as far as the table can tell.
    pub fn fence(&self, node: &str) -> String {
        let m = &self.mapping;
        if let (
            None,
            State::Status {
                in_flight: Some(_), ..
            },
        ) = (&m.locked_by, &m.state)
        {
            // No lease owner: the in-flight state is all the table says.
            if let Some(held) = self.held_marker() {
                return format!("{held} AND {}", self.owner(node));
            }
        }
        self.owner(node)
    }

    /// The lease owner is `node` (the placeholder), where the table names one; else only
    /// that a node is given.
    fn owner(&self, node: &str) -> String {
        match self.opt(&self.mapping.locked_by) {
            Some(by) => format!("{by} = {node}"),
            None => format!("{node} IS NOT NULL"),
        }
    }

    /// Marks delivered rows (delete, or mark): the `count` rows whose id is `ids`
    /// (`IN (…)`), still leased to `node`. On MySQL the statement stops at `count` rows
    /// (`Sql::stop_after`).
    pub fn ack(&self, ids: &str, count: usize, node: &str) -> String {
        let fence = self.fence(node);
        let id = self.quote(&self.mapping.id);
        self.stop_after(
            self.settle_delivered(&format!("o.{id} {ids} AND {fence}")),
            count,
        )
    }

    /// `statement` (a DELETE or UPDATE of rows picked by id), stopped at `count` rows on
    /// MySQL: a scan that went on past the last of them (a small table is scanned whole)
    /// would read the next row, and wait for an application's transaction still inserting
    /// it (and, in REPEATABLE READ, lock the gap that transaction's next insert goes into).
    fn stop_after(&self, statement: String, count: usize) -> String {
        match self.dialect {
            Dialect::MySql => format!(
                "{statement} ORDER BY {} LIMIT {count}",
                self.quote(&self.mapping.id)
            ),
            Dialect::Postgres => statement,
        }
    }

    /// Marks delivered the rows a log reader (binlog capture) took, which no claim leased:
    /// those whose row id is one of `ids`, unfenced. The ids are written into the text
    /// (integers, nothing to escape), since a statement with as many placeholders as rows
    /// would be prepared anew for every count.
    /// - A run of consecutive ids is one range (`BETWEEN`), walked in the index in one
    ///   pass, rather than a lookup per id.
    /// - On MySQL the statement stops at the number of rows (`Sql::stop_after`).
    pub fn ack_captured(&self, ids: &[i64]) -> String {
        let mut sorted = ids.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        let id = self.quote(&self.mapping.id);
        let column = format!("o.{id}");
        let mut ranges = Vec::new();
        let mut singles = Vec::new();
        for (first, last) in consecutive_runs(&sorted) {
            match last - first {
                0 => singles.push(first.to_string()),
                1 => singles.extend([first.to_string(), last.to_string()]),
                _ => ranges.push(format!("{column} BETWEEN {first} AND {last}")),
            }
        }
        if !singles.is_empty() || ranges.is_empty() {
            ranges.push(format!("{column} IN ({})", singles.join(",")));
        }
        let condition = match ranges.len() {
            1 => ranges.remove(0),
            _ => format!("({})", ranges.join(" OR ")),
        };
        self.stop_after(self.settle_delivered(&condition), sorted.len())
    }

    /// Deletes or marks delivered the rows `condition` selects (on alias `o`).
    pub fn settle_delivered(&self, condition: &str) -> String {
        let t = self.table();
        match self.mapping.on_success {
            OnSuccess::Delete => match self.dialect {
                Dialect::Postgres => format!("DELETE FROM {t} o WHERE {condition}"),
                // A single-table DELETE, which MariaDB takes without an alias: the columns
                // are the table's. The multi-table `DELETE o FROM` form read the row after
                // the last one it deleted, and so waited for an application's transaction
                // still inserting it.
                Dialect::MySql => format!(
                    "DELETE FROM {t} WHERE {}",
                    condition.replace("o.`", &format!("{t}.`"))
                ),
            },
            OnSuccess::Mark => {
                let m = &self.mapping;
                let mut set = Vec::new();
                match &m.state {
                    State::Status {
                        column, delivered, ..
                    } => set.push(format!(
                        "{} = {}",
                        self.quote(column),
                        self.state_literal(delivered)
                    )),
                    State::Flag { column, done, .. } => set.push(format!(
                        "{} = {}",
                        self.quote(column),
                        self.state_literal(done)
                    )),
                    State::Rows => {}
                }
                if let Some(c) = &m.delivered_at {
                    set.push(format!("{} = {}", self.quote(c), self.now()));
                }
                set.extend(self.unlock());
                self.touch(&mut set);
                self.update(&set, condition)
            }
        }
    }

    /// `UPDATE <table> o SET <set> WHERE <condition>`, qualifying the targets as the dialect
    /// wants them.
    pub fn update(&self, set: &[String], condition: &str) -> String {
        // MySQL qualifies SET targets with the alias; PostgreSQL refuses that.
        let prefix = if self.dialect == Dialect::MySql {
            "o."
        } else {
            ""
        };
        let set = set
            .iter()
            .map(|s| format!("{prefix}{s}"))
            .collect::<Vec<_>>()
            .join(", ");
        format!("UPDATE {} o SET {set} WHERE {condition}", self.table())
    }

    /// `SET` items recording the attempts and last error, where the table has the columns.
    fn failure_set(&self, attempts: &str, error: &str) -> Vec<String> {
        let m = &self.mapping;
        let attempts = m.attempts.as_ref().map(|c| (c, attempts));
        let error = m.last_error.as_ref().map(|c| (c, error));
        [attempts, error]
            .into_iter()
            .flatten()
            .map(|(column, value)| format!("{} = {value}", self.quote(column)))
            .collect()
    }

    /// `SET` items recording a failed attempt; placeholders for attempts, error and delay.
    pub fn retry_set(&self, attempts: &str, error: &str, delay_ms: &str) -> Vec<String> {
        let m = &self.mapping;
        let mut set = self.back_to_pending();
        set.extend(self.failure_set(attempts, error));
        if let Some(c) = &m.available_at {
            set.push(format!("{} = {}", self.quote(c), self.now_plus(delay_ms)));
        }
        self.touch(&mut set);
        set
    }

    /// The `SET` item that makes a row dead: its dead state or time (none for the side table).
    fn dead_mark(&self) -> Option<String> {
        let m = &self.mapping;
        match m.dead_state() {
            DeadState::Status(v) | DeadState::Flag(v) => {
                let column = match &m.state {
                    State::Status { column, .. } | State::Flag { column, .. } => column,
                    State::Rows => unreachable!("a dead value needs a state column"),
                };
                Some(format!(
                    "{} = {}",
                    self.quote(column),
                    self.state_literal(&v)
                ))
            }
            DeadState::Timestamp(c) => Some(format!("{} = {}", self.quote(&c), self.now())),
            DeadState::SideTable => None,
        }
    }

    /// `SET` items for a dead row (not for the side table).
    pub fn dead_set(&self, attempts: &str, error: &str) -> Vec<String> {
        let mut set: Vec<String> = self.dead_mark().into_iter().collect();
        set.extend(self.failure_set(attempts, error));
        set.extend(self.unlock());
        self.touch(&mut set);
        set
    }

    /// Returns held rows to pending without counting an attempt.
    pub fn release(&self, ids: &str, node: &str) -> Option<String> {
        let mut set = self.back_to_pending();
        self.touch(&mut set);
        (!set.is_empty()).then(|| {
            self.update(
                &set,
                &format!(
                    "o.{} {ids} AND {}",
                    self.quote(&self.mapping.id),
                    self.fence(node)
                ),
            )
        })
    }

    /// Extends the leases of held rows.
    pub fn extend(&self, ids: &str, node: &str, lease_ms: &str) -> Option<String> {
        let m = &self.mapping;
        let q = |c: &str| self.quote(c);
        let set = if let Some(c) = &m.locked_until {
            format!("{} = {}", q(c), self.now_plus(lease_ms))
        } else if let Some(c) = &m.locked_at {
            format!("{} = {}", q(c), self.now())
        } else if let (
            Some(c),
            State::Status {
                in_flight: Some(_), ..
            },
        ) = (&m.updated_at, &m.state)
        {
            format!("{} = {}", q(c), self.now())
        } else {
            return None;
        };
        Some(self.update(
            &[set],
            &format!(
                "o.{} {ids} AND {} AND {lease_ms} >= 0",
                q(&m.id),
                self.fence(node)
            ),
        ))
    }

    /// Returns every row `node` holds in the table but those the condition `not_held`
    /// leaves out (or all, `None`) to pending without counting an attempt. `None` when the
    /// table marks no row held (memory alone holds them).
    pub fn release_unheld(&self, not_held: Option<&str>, node: &str) -> Option<String> {
        let mut set = self.back_to_pending();
        self.touch(&mut set);
        let held = self.held_marker()?;
        let mut condition = format!("{held} AND {}", self.owner(node));
        if let Some(not_held) = not_held {
            condition = format!("{condition} AND {not_held}");
        }
        (!set.is_empty()).then(|| self.update(&set, &condition))
    }

    /// The condition of a row the table marks held (in flight, or leased).
    fn held_marker(&self) -> Option<String> {
        let m = &self.mapping;
        Some(
            match (&m.state, self.opt(&m.locked_by), self.opt(&m.locked_until)) {
                (
                    State::Status {
                        column,
                        in_flight: Some(v),
                        ..
                    },
                    _,
                    _,
                ) => {
                    format!("{} = {}", self.col(column), self.state_literal(v))
                }
                (_, Some(by), _) => format!("{by} IS NOT NULL"),
                (_, None, Some(until)) => format!("{until} IS NOT NULL"),
                _ => return None,
            },
        )
    }

    /// Rows held by a relay that is gone: `all` (a placeholder, true at takeover) or whose
    /// lease ran out (`lease_ms` placeholder).
    fn stale(&self, all: &str, lease_ms: &str) -> Option<String> {
        let m = &self.mapping;
        let held = self.held_marker()?;
        let expired = if let Some(until) = self.opt(&m.locked_until) {
            format!("{until} < {}", self.now())
        } else if let Some(at) = self.opt(&m.locked_at) {
            format!("{at} < {}", self.now_minus(lease_ms))
        } else if let Some(at) = self.opt(&m.updated_at) {
            format!("{at} < {}", self.now_minus(lease_ms))
        } else {
            format!("{lease_ms} < 0")
        };
        Some(format!("{held} AND ({all} OR {expired})"))
    }

    /// The reaper: returns stale held rows to pending, counting the attempt where the table
    /// counts them, or (`to_dead`) marks dead those whose last allowed attempt it was.
    /// Placeholders: `max` (default max attempts), `all`, `lease_ms`, in that order.
    pub fn reap(&self, to_dead: bool, max: &str, all: &str, lease_ms: &str) -> Option<String> {
        let m = &self.mapping;
        let stale = self.stale(all, lease_ms)?;
        let counts = m.attempts.is_some() && matches!(m.state, State::Status { .. });
        if to_dead && !counts {
            return None;
        }
        let max_expr = match self.max_attempts_of_row() {
            Some(of_row) => format!("coalesce({of_row}, {max})"),
            None => max.to_string(),
        };
        let mut condition = stale;
        let mut set = if to_dead {
            let mut set: Vec<String> = self.dead_mark().into_iter().collect();
            set.extend(self.unlock());
            set
        } else {
            self.back_to_pending()
        };
        if counts {
            let attempts = self.col(m.attempts.as_deref().unwrap_or_default());
            set.extend(self.failure_set(&format!("{attempts} + 1"), &format!("'{REAPED}'")));
            let cmp = if to_dead { ">=" } else { "<" };
            condition = format!("{condition} AND {attempts} + 1 {cmp} {max_expr}");
        } else {
            condition = format!("{condition} AND {max} IS NOT NULL");
        }
        // Every placeholder appears, whichever columns the table has.
        condition = format!("{condition} AND {lease_ms} >= 0");
        self.touch(&mut set);
        Some(self.update(&set, &condition))
    }

    /// The id column over alias `o`.
    pub fn id_column(&self) -> String {
        self.id()
    }
}

/// The claims, retries and dead-letterings [`crate::store::MappedStore`] runs. Placeholders
/// come from [`crate::params::Params`]; a statement that may not use every value it is handed
/// says so with a guard (`AND $n IS NOT NULL`), because PostgreSQL counts parameters (so do
/// those in `operator.rs`).
impl Sql {
    /// Up to `limit` rows matching `condition` in publish order (`select_list` columns);
    /// `lock` takes their row locks, skipping rows other transactions hold.
    pub fn claim_select(&self, condition: &str, limit: &str, lock: bool) -> String {
        format!(
            "SELECT {} FROM {} o WHERE {condition} ORDER BY {} LIMIT {limit}{}",
            self.select_list(),
            self.table(),
            self.order_by(),
            if lock { " FOR UPDATE SKIP LOCKED" } else { "" }
        )
    }

    /// The first `limit` rows matching `condition` in publish order, each id with its key,
    /// read without locks: what a claim would take if no other transaction held a row.
    pub fn claim_order(&self, condition: &str, limit: &str) -> String {
        format!(
            "SELECT {}, {} FROM {} o WHERE {condition} ORDER BY {} LIMIT {limit}",
            self.id_expr(),
            self.key_expr(),
            self.table(),
            self.order_by(),
        )
    }

    /// PostgreSQL: selects, locks and marks a claim in one statement, returning the rows
    /// (`select_list` columns) and, last, each row's place in publish order, for the
    /// executor to sort by. Sorting in SQL would cost a Sort node, which the relay's sessions
    /// price out (`enable_sort=off`); before their JIT compiler was turned off, that price set
    /// it off: 200 ms a claim.
    pub fn claim_and_mark(
        &self,
        condition: &str,
        limit: &str,
        node: &str,
        lease_ms: &str,
    ) -> String {
        let (t, id, key, order) = (self.table(), self.id(), self.key_expr(), self.order_by());
        // `l` is what SKIP LOCKED takes; `u` the same rows read without locks, in order
        // (`n`), which has the rows another transaction holds too (an application's
        // `SELECT … FOR UPDATE`): a key is taken only up to its first row `l` passed, or
        // its later rows went out first. Rows of `l` past the end of `u` wait.
        format!(
            "WITH l AS (SELECT {id} AS id FROM {t} o WHERE {condition}
                         ORDER BY {order} LIMIT {limit} FOR UPDATE SKIP LOCKED),
                  u AS (SELECT x.id, x.k, row_number() OVER () AS n
                          FROM (SELECT {id} AS id, {key} AS k FROM {t} o WHERE {condition}
                                 ORDER BY {order} LIMIT {limit}) x),
                  passed AS (SELECT k, min(n) AS n FROM u
                              WHERE NOT EXISTS (SELECT 1 FROM l WHERE l.id = u.id) GROUP BY k),
                  c AS (SELECT u.id, u.n FROM u JOIN l ON l.id = u.id
                          LEFT JOIN passed ON passed.k IS NOT DISTINCT FROM u.k
                         WHERE passed.n IS NULL OR u.n < passed.n)
             UPDATE {t} o SET {} FROM c
              WHERE {id} = c.id AND {node} IS NOT NULL AND {lease_ms} >= 0
             RETURNING {}, c.n",
            self.claim_set(node, lease_ms).join(", "),
            self.select_list(),
        )
    }

    /// The column of [`Sql::claim_and_mark`]'s rows that gives their order.
    pub fn claim_order_column(&self) -> usize {
        self.select_items().len()
    }

    /// Records one failed attempt of a held row; `None` when the table has nothing to record.
    pub fn retry(&self, failure: &Failure, delay_ms: &str) -> Option<String> {
        let set = self.retry_set(&failure.attempts, &failure.error, delay_ms);
        (!set.is_empty()).then(|| {
            let row = self.failed_row(failure);
            self.update(&set, &format!("{row} AND {delay_ms} >= 0"))
        })
    }

    /// Makes one held row dead: marks it, or records it in the side table.
    pub fn dead_letter(&self, failure: &Failure) -> String {
        let Failure {
            attempts, error, ..
        } = failure;
        if self.mapping.dead_state() != DeadState::SideTable {
            return self.update(&self.dead_set(attempts, error), &self.failed_row(failure));
        }
        let held = self.held_row(failure);
        let (dl, id_column, t) = (self.dead_table(), self.id(), self.table());
        match self.dialect {
            Dialect::Postgres => format!(
                "INSERT INTO {dl} (id, attempts, last_error)
                 SELECT {id_column}, {attempts}, {error} FROM {t} o WHERE {held}
                 ON CONFLICT (id) DO NOTHING"
            ),
            Dialect::MySql => format!(
                "INSERT IGNORE INTO {dl} (id, attempts, last_error, dead_at)
                 SELECT {id_column}, {attempts}, {error}, UTC_TIMESTAMP(6) FROM {t} o WHERE {held}"
            ),
        }
    }

    /// The row a failure names, while its node still holds it.
    fn held_row(&self, failure: &Failure) -> String {
        format!(
            "{} = {} AND {}",
            self.id(),
            failure.id,
            self.fence(&failure.node)
        )
    }

    /// [`Sql::held_row`], with conditions on the attempts and error that always hold, so
    /// their placeholders appear even where no column takes them.
    fn failed_row(&self, failure: &Failure) -> String {
        let Failure {
            attempts, error, ..
        } = failure;
        let held = self.held_row(failure);
        format!("{held} AND {attempts} >= 0 AND {error} IS NOT NULL")
    }
}

/// The runs of consecutive integers in sorted, distinct `ids`, each as (first, last).
fn consecutive_runs(ids: &[i64]) -> Vec<(i64, i64)> {
    let mut runs: Vec<(i64, i64)> = Vec::new();
    for &id in ids {
        match runs.last_mut() {
            Some((_, last)) if last.checked_add(1) == Some(id) => *last = id,
            _ => runs.push((id, id)),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pg(m: Mapping) -> Sql {
        Sql::new(m, Dialect::Postgres).unwrap()
    }

    #[test]
    fn the_session_settings_bound_an_idle_session_by_mysql_idle_session() {
        let wait = format!("wait_timeout = {}", MYSQL_IDLE_SESSION.as_secs());
        assert!(
            MYSQL_SESSION_SETTINGS.iter().any(|s| s.contains(&wait)),
            "{MYSQL_SESSION_SETTINGS:?}"
        );
    }

    #[test]
    fn the_session_settings_end_a_lock_wait_before_the_relay_gives_up_on_it() {
        let waits = MYSQL_LOCK_WAIT.as_secs();
        for variable in ["innodb_lock_wait_timeout", "lock_wait_timeout"] {
            let set = format!(" {variable} = {waits}");
            assert!(
                MYSQL_SESSION_SETTINGS.iter().any(|s| s.contains(&set)),
                "{MYSQL_SESSION_SETTINGS:?}"
            );
        }
        assert!(MYSQL_LOCK_WAIT < outbox_core::store::OPERATION_TIMEOUT);
    }

    #[test]
    fn adbc_claims_unprocessed_unlocked_rows_and_deletes_on_ack() {
        let s = pg(Mapping::adbc("public", "outbox"));
        let c = s.claimable();
        assert!(c.contains("o.\"processed\" = false"), "{c}");
        assert!(
            c.contains("o.\"lock_expiry\" < (now() AT TIME ZONE 'UTC')"),
            "{c}"
        );
        assert!(s
            .ack("= ANY($1)", 2, "$2")
            .starts_with("DELETE FROM \"public\".\"outbox\" o"));
        assert!(s.dead().contains("\"processed\" = true"));
    }

    #[test]
    fn open_outbox_moves_through_its_statuses() {
        let s = pg(Mapping::open_outbox("public", "openoutbox_events"));
        assert!(s.claimable().contains("o.\"status\" = 'PENDING'"));
        let claim = s.claim_set("$4", "$5").join(", ");
        assert!(
            claim.contains("\"status\" = 'DELIVERING'") && claim.contains("\"locked_at\" = now()"),
            "{claim}"
        );
        let ack = s.ack("= ANY($1)", 2, "$2");
        assert!(
            ack.contains("\"status\" = 'DELIVERED'") && ack.contains("\"delivered_at\" = now()"),
            "{ack}"
        );
        let reap = s.reap(true, "$1", "$2", "$3").unwrap();
        assert!(
            reap.contains("'DEAD'") && reap.contains("\"attempts\" = o.\"attempts\" + 1"),
            "{reap}"
        );
    }

    #[test]
    fn export_reads_max_attempts_from_event_type() {
        let s = pg(Mapping::export("public", "event"));
        assert!(s
            .select_list()
            .contains("(SELECT mx.\"max_retry_count\" + 1 FROM \"public\".\"event_type\" mx"));
        assert!(s.key_expr().contains("'row:'"));
    }

    #[test]
    fn mysql_seed_uses_backquotes_and_a_side_table() {
        let s = Sql::new(
            Mapping::mysql_outbox_events(None, "outbox_events"),
            Dialect::MySql,
        )
        .unwrap();
        assert!(s.claimable().contains("o.`isConsumed` = 0"));
        assert!(s.claimable().contains("`outbox_events_dead_letters`"));
        let parked = Sql::new(
            Mapping {
                waiting_rows_block_their_key: true,
                ..Mapping::native_mysql(None, "outbox_parked", false)
            },
            Dialect::MySql,
        )
        .unwrap();
        assert!(
            parked.claimable().contains(
                "NOT IN (SELECT w.k FROM (SELECT CAST(coalesce(CAST(o.`partition_key` AS CHAR), \
                 CAST(o.`destination` AS CHAR)) AS BINARY) AS k FROM `outbox_parked` o WHERE o.`delivered_at` IS NULL AND o.`dead_at` IS NULL \
                 AND o.`available_at` > UTC_TIMESTAMP(6) GROUP BY k) w)"
            ),
            "{}",
            parked.claimable()
        );
        assert!(s.ack("IN (1)", 1, "?").contains("o.`isConsumed` = 1"));
        assert!(s.claim_set("?", "?").is_empty());
        assert!(s
            .ddl()
            .unwrap()
            .contains("CREATE TABLE IF NOT EXISTS `outbox_events_dead_letters`"));
    }
}
