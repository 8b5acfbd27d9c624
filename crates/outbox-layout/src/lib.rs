//! Outbox table layouts.
//!
//! The native layout is the relay's own table (see the PostgreSQL and SQLite stores). Every
//! other layout is a [`Mapping`]: which column holds the destination, the key, the payload,
//! and how a row's state is kept (a status column, a flag, timestamps or nothing). The
//! seeds' tables are named presets of it ([`Mapping::adbc`], [`Mapping::open_outbox`],
//! [`Mapping::export`], [`Mapping::mysql_outbox_events`]); `layout = "custom"` reads one from
//! the configuration. [`sql::Sql`] turns a validated mapping into statements for PostgreSQL
//! or MySQL/MariaDB.
//!
//! Mapped tables rarely have the bookkeeping columns the native layout has, so the stores
//! that run them keep what is missing in memory and run one *active* relay per table at a
//! time (a database lock decides which; the others stand by and take over when it dies).
//! See ARCHITECTURE.md, "Mapped layouts".

mod column_types;
pub mod memory;
pub mod params;
#[cfg(test)]
mod snapshot;
pub mod sql;
pub mod store;

use std::fmt;

use outbox_core::ident::Ident;
use outbox_core::{StoreError, StoreErrorKind};
use serde::{Deserialize, Serialize};

/// The SQL dialect a mapping is rendered for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    Postgres,
    MySql,
}

/// The type of the row id column.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum IdType {
    /// An integer (serial, bigint, auto-increment).
    #[default]
    Integer,
    /// A UUID primary key (PostgreSQL).
    Uuid,
}

/// What orders a row whose key column is NULL (or when there is no key column).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum KeyFallback {
    /// The destination is the ordering key.
    #[default]
    Destination,
    /// Every row is its own key: no ordering between rows.
    Row,
}

/// How the payload column is published.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum PayloadFormat {
    /// JSON text (json, jsonb or a text column holding JSON): published verbatim; a row whose
    /// payload is not JSON is dead-lettered.
    #[default]
    Json,
    /// Bytes (bytea, blob): published as they are.
    Bytes,
    /// Any text: published as its UTF-8 bytes.
    Text,
}

/// How a row's state is kept.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum State {
    /// No state column: a row is pending until it is deleted, or until `delivered_at` (or
    /// `dead_at`) is set.
    Rows,
    /// A boolean-like flag: `pending` until done (the Ably connector's `processed`, the MySQL
    /// seed's `isConsumed`).
    Flag {
        column: String,
        pending: String,
        done: String,
    },
    /// A status column (Open Outbox Relay's PENDING/DELIVERING/DELIVERED/DEAD, the export
    /// seed's NEW/PROCESSING/DONE/ERROR).
    Status {
        column: String,
        pending: String,
        /// Set while a relay holds the row.
        in_flight: Option<String>,
        delivered: String,
        dead: Option<String>,
    },
}

/// What happens to a delivered row.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum OnSuccess {
    /// Delete it.
    #[default]
    Delete,
    /// Keep it, marked delivered (status, flag, and `delivered_at`/`updated_at` when mapped).
    Mark,
}

/// Per-row attempt limits read from another table (the export seed's
/// `event_type.max_retry_count`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MaxAttemptsFrom {
    pub table: String,
    /// The column of `table` matched against `join_column` of the outbox.
    pub key_column: String,
    /// The outbox column holding the key (e.g. `type_code`).
    pub join_column: String,
    /// The column holding the limit.
    pub column: String,
    /// `true` when the limit counts retries after the first attempt (attempts = limit + 1).
    #[serde(default)]
    pub counts_retries: bool,
}

/// A column mapping for an existing outbox table. Column names are validated identifiers and
/// always quoted.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Mapping {
    /// The schema (PostgreSQL) or database (MySQL); `None`: the connection's default.
    pub schema: Option<String>,
    pub table: String,
    /// The row id: primary key, and the tie-breaker of the publish order.
    pub id: String,
    #[serde(default)]
    pub id_type: IdType,
    /// Publish order; defaults to the id.
    #[serde(default)]
    pub order_by: Vec<String>,
    /// A UUID column sent as the dedupe id; without one the id is derived from the table and
    /// row id (a name-based UUID, stable across retries and restarts).
    pub event_id: Option<String>,
    pub destination: String,
    /// The ordering-key column; NULL falls back to `key_fallback`.
    pub key: Option<String>,
    #[serde(default)]
    pub key_fallback: KeyFallback,
    /// The message name; defaults to the destination.
    pub event_type: Option<String>,
    pub payload: String,
    #[serde(default)]
    pub payload_format: PayloadFormat,
    pub headers: Option<String>,
    /// A text column with the W3C `traceparent` of the producing span, for tables that keep
    /// trace context in a column of its own rather than in `headers`: carried to the broker
    /// as the `traceparent` header when valid (a `traceparent` in `headers` wins).
    #[serde(default)]
    pub traceparent: Option<String>,
    /// A text column holding the span context as Java properties (`key=value` lines), as
    /// Debezium's `tracingspancontext` does: its `traceparent` and `tracestate` entries are
    /// read as the two columns above would be. Not with `traceparent`.
    #[serde(default)]
    pub span_context: Option<String>,
    /// A header that carries the event id with every message (Debezium's event router sets
    /// `id`), besides the sink's own de-duplication field.
    #[serde(default)]
    pub event_id_header: Option<String>,
    /// A text column with the W3C `tracestate`, carried with a valid `traceparent`.
    #[serde(default)]
    pub tracestate: Option<String>,
    pub mutation_id: Option<String>,
    pub rejected: Option<String>,
    pub created_at: Option<String>,
    pub updated_at: Option<String>,
    pub attempts: Option<String>,
    pub last_error: Option<String>,
    pub available_at: Option<String>,
    pub locked_by: Option<String>,
    /// Lease expiry.
    pub locked_until: Option<String>,
    /// Lease start.
    pub locked_at: Option<String>,
    pub delivered_at: Option<String>,
    pub dead_at: Option<String>,
    /// Timestamp columns are `timestamp without time zone` holding UTC (PostgreSQL).
    #[serde(default)]
    pub utc_timestamps: bool,
    pub state: State,
    #[serde(default)]
    pub on_success: OnSuccess,
    pub max_attempts_from: Option<MaxAttemptsFrom>,
    /// Extra `(column, SQL expression)` pairs for `outbox-relay send` (presets only).
    #[serde(skip)]
    pub insert_defaults: Vec<(String, String)>,
    /// The DDL that creates the table, exactly as its seed defines it (presets only).
    #[serde(skip)]
    pub seed: Option<Seed>,
    /// A key with a pending row not due yet (`available_at` later) has none of its rows
    /// claimed, whichever relay recorded the wait (binlog capture's parked table, whose rows
    /// capture writes itself, and which a relay may take over with nothing in memory).
    #[serde(skip)]
    pub waiting_rows_block_their_key: bool,
}

/// The column `migrate --layout debezium` adds to order Debezium's outbox table.
pub const DEBEZIUM_SEQUENCE: &str = "relay_sequence";

/// The seed a preset comes from: its DDL is what `migrate` creates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seed {
    Adbc,
    OpenOutbox,
    Export,
    MysqlOutboxEvents,
    NativeMysql,
    Debezium,
}

/// Where a dead row goes.
#[derive(Clone, Debug, PartialEq)]
pub enum DeadState {
    /// The status column's dead value.
    Status(String),
    /// The flag's done value (rows are deleted on success, so a done row left over is dead).
    Flag(String),
    /// A timestamp column.
    Timestamp(String),
    /// A side table `<table>_dead_letters(id, attempts, last_error, dead_at)` the relay owns;
    /// the row itself is left untouched.
    SideTable,
}

impl Mapping {
    /// The Ably Database Connector's outbox table (`sequence_id`, `mutation_id`, `channel`,
    /// `name`, `rejected`, `data`, `headers`, `locked_by`, `lock_expiry`, `processed`).
    /// Channel is the destination and the ordering key; processed rows are deleted.
    pub fn adbc(schema: &str, table: &str) -> Self {
        Mapping {
            schema: Some(schema.into()),
            table: table.into(),
            id: "sequence_id".into(),
            event_type: Some("name".into()),
            destination: "channel".into(),
            payload: "data".into(),
            headers: Some("headers".into()),
            mutation_id: Some("mutation_id".into()),
            rejected: Some("rejected".into()),
            locked_by: Some("locked_by".into()),
            locked_until: Some("lock_expiry".into()),
            utc_timestamps: true,
            state: State::Flag {
                column: "processed".into(),
                pending: "false".into(),
                done: "true".into(),
            },
            on_success: OnSuccess::Delete,
            seed: Some(Seed::Adbc),
            ..Mapping::empty()
        }
    }

    /// Open Outbox Relay's `openoutbox_events`: statuses PENDING → DELIVERING → DELIVERED or
    /// DEAD, a bytea payload, `event_type` as destination, `partition_key` as ordering key.
    pub fn open_outbox(schema: &str, table: &str) -> Self {
        Mapping {
            schema: Some(schema.into()),
            table: table.into(),
            id: "event_id".into(),
            id_type: IdType::Uuid,
            order_by: vec!["created_at".into(), "event_id".into()],
            event_id: Some("event_id".into()),
            destination: "event_type".into(),
            key: Some("partition_key".into()),
            event_type: Some("event_type".into()),
            payload: "payload".into(),
            payload_format: PayloadFormat::Bytes,
            headers: Some("headers".into()),
            created_at: Some("created_at".into()),
            updated_at: Some("updated_at".into()),
            attempts: Some("attempts".into()),
            last_error: Some("last_error".into()),
            available_at: Some("available_at".into()),
            locked_by: Some("locked_by".into()),
            locked_at: Some("locked_at".into()),
            delivered_at: Some("delivered_at".into()),
            state: State::Status {
                column: "status".into(),
                pending: "PENDING".into(),
                in_flight: Some("DELIVERING".into()),
                delivered: "DELIVERED".into(),
                dead: Some("DEAD".into()),
            },
            on_success: OnSuccess::Mark,
            seed: Some(Seed::OpenOutbox),
            ..Mapping::empty()
        }
    }

    /// The export seed's `event` table with `event_type(code, max_retry_count)`: statuses
    /// NEW → PROCESSING → DONE or ERROR, `processing_retries_count`, no ordering between
    /// rows (the seed processes each event on its own).
    pub fn export(schema: &str, table: &str) -> Self {
        Mapping {
            schema: Some(schema.into()),
            table: table.into(),
            id: "id".into(),
            destination: "type_code".into(),
            key_fallback: KeyFallback::Row,
            event_type: Some("type_code".into()),
            payload: "payload".into(),
            created_at: Some("created_at".into()),
            updated_at: Some("updated_at".into()),
            attempts: Some("processing_retries_count".into()),
            state: State::Status {
                column: "status".into(),
                pending: "NEW".into(),
                in_flight: Some("PROCESSING".into()),
                delivered: "DONE".into(),
                dead: Some("ERROR".into()),
            },
            on_success: OnSuccess::Mark,
            max_attempts_from: Some(MaxAttemptsFrom {
                table: "event_type".into(),
                key_column: "code".into(),
                join_column: "type_code".into(),
                column: "max_retry_count".into(),
                counts_retries: true,
            }),
            seed: Some(Seed::Export),
            ..Mapping::empty()
        }
    }

    /// The MySQL 8 seed's `outbox_events(id, type, message, isConsumed, createdAt, updatedAt)`:
    /// FIFO by `createdAt, id`, `type` as destination and ordering key, `isConsumed` set on
    /// success. Dead events go to a side table; the row stays unconsumed.
    pub fn mysql_outbox_events(database: Option<&str>, table: &str) -> Self {
        Mapping {
            schema: database.map(str::to_string),
            table: table.into(),
            id: "id".into(),
            order_by: vec!["createdAt".into(), "id".into()],
            destination: "type".into(),
            event_type: Some("type".into()),
            payload: "message".into(),
            created_at: Some("createdAt".into()),
            updated_at: Some("updatedAt".into()),
            state: State::Flag {
                column: "isConsumed".into(),
                pending: "0".into(),
                done: "1".into(),
            },
            on_success: OnSuccess::Mark,
            insert_defaults: vec![
                ("createdAt".into(), "UTC_TIMESTAMP()".into()),
                ("updatedAt".into(), "UTC_TIMESTAMP()".into()),
            ],
            seed: Some(Seed::MysqlOutboxEvents),
            ..Mapping::empty()
        }
    }

    /// The native layout on MySQL/MariaDB: the PostgreSQL native columns, plus `dead_at`
    /// (dead rows stay in the table, out of the queue).
    pub fn native_mysql(database: Option<&str>, table: &str, retain_delivered: bool) -> Self {
        Mapping {
            schema: database.map(str::to_string),
            table: table.into(),
            id: "sequence_id".into(),
            event_id: Some("event_id".into()),
            destination: "destination".into(),
            key: Some("partition_key".into()),
            event_type: Some("event_type".into()),
            payload: "payload".into(),
            headers: Some("headers".into()),
            mutation_id: Some("mutation_id".into()),
            rejected: Some("rejected".into()),
            created_at: Some("created_at".into()),
            attempts: Some("attempts".into()),
            last_error: Some("last_error".into()),
            available_at: Some("available_at".into()),
            locked_by: Some("locked_by".into()),
            locked_until: Some("locked_until".into()),
            delivered_at: Some("delivered_at".into()),
            dead_at: Some("dead_at".into()),
            state: State::Rows,
            on_success: if retain_delivered {
                OnSuccess::Mark
            } else {
                OnSuccess::Delete
            },
            insert_defaults: vec![("event_id".into(), "UUID()".into())],
            seed: Some(Seed::NativeMysql),
            ..Mapping::empty()
        }
    }

    /// The table Debezium's outbox event router reads (`id` uuid, `aggregatetype`,
    /// `aggregateid`, `type`, `payload`, `timestamp`, `tracingspancontext`), so applications
    /// written for Debezium keep their inserts: `aggregatetype` is the destination,
    /// `aggregateid` the ordering key, `type` the event type, `id` the event id (also sent as
    /// the `id` header, as the router does), and delivered rows are deleted.
    ///
    /// The table has nothing that orders its rows (Debezium reads them in WAL order; its
    /// `id` is random and `timestamp` ties within a transaction), so `migrate` adds a
    /// `relay_sequence bigserial` column that the applications' inserts fill by default; the
    /// relay orders, claims and deletes by it.
    pub fn debezium(schema: &str, table: &str) -> Self {
        Mapping {
            schema: Some(schema.into()),
            table: table.into(),
            id: DEBEZIUM_SEQUENCE.into(),
            event_id: Some("id".into()),
            destination: "aggregatetype".into(),
            key: Some("aggregateid".into()),
            event_type: Some("type".into()),
            payload: "payload".into(),
            span_context: Some("tracingspancontext".into()),
            event_id_header: Some("id".into()),
            created_at: Some("timestamp".into()),
            utc_timestamps: true,
            state: State::Rows,
            on_success: OnSuccess::Delete,
            insert_defaults: vec![("id".into(), "gen_random_uuid()".into())],
            seed: Some(Seed::Debezium),
            ..Mapping::empty()
        }
    }

    fn empty() -> Self {
        Mapping {
            schema: None,
            table: String::new(),
            id: String::new(),
            id_type: IdType::Integer,
            order_by: Vec::new(),
            event_id: None,
            destination: String::new(),
            key: None,
            key_fallback: KeyFallback::Destination,
            event_type: None,
            payload: String::new(),
            payload_format: PayloadFormat::Json,
            headers: None,
            traceparent: None,
            tracestate: None,
            span_context: None,
            event_id_header: None,
            mutation_id: None,
            rejected: None,
            created_at: None,
            updated_at: None,
            attempts: None,
            last_error: None,
            available_at: None,
            locked_by: None,
            locked_until: None,
            locked_at: None,
            delivered_at: None,
            dead_at: None,
            utc_timestamps: false,
            state: State::Rows,
            on_success: OnSuccess::Delete,
            max_attempts_from: None,
            insert_defaults: Vec::new(),
            seed: None,
            waiting_rows_block_their_key: false,
        }
    }

    /// Every column the mapping names (for `check`).
    pub fn columns(&self) -> Vec<&str> {
        let mut columns = vec![
            self.id.as_str(),
            self.destination.as_str(),
            self.payload.as_str(),
        ];
        for c in [
            &self.event_id,
            &self.key,
            &self.event_type,
            &self.headers,
            &self.traceparent,
            &self.tracestate,
            &self.span_context,
            &self.mutation_id,
            &self.rejected,
            &self.created_at,
            &self.updated_at,
            &self.attempts,
            &self.last_error,
            &self.available_at,
            &self.locked_by,
            &self.locked_until,
            &self.locked_at,
            &self.delivered_at,
            &self.dead_at,
        ]
        .into_iter()
        .flatten()
        {
            columns.push(c);
        }
        match &self.state {
            State::Flag { column, .. } | State::Status { column, .. } => columns.push(column),
            State::Rows => {}
        }
        columns
    }

    /// Where dead rows go (derived from the state and columns).
    pub fn dead_state(&self) -> DeadState {
        match (&self.state, self.on_success) {
            (State::Status { dead: Some(d), .. }, _) => DeadState::Status(d.clone()),
            (State::Flag { done, .. }, OnSuccess::Delete) => DeadState::Flag(done.clone()),
            _ => match &self.dead_at {
                Some(column) => DeadState::Timestamp(column.clone()),
                None => DeadState::SideTable,
            },
        }
    }

    /// True when a claimed row is marked in the table (status, lease columns); false when only
    /// the relay's memory knows it is held.
    pub fn marks_claims(&self) -> bool {
        matches!(
            self.state,
            State::Status {
                in_flight: Some(_),
                ..
            }
        ) || self.locked_by.is_some()
            || self.locked_until.is_some()
    }

    /// True when delivered rows stay in the table (so `replay` and `prune` apply).
    pub fn retains_delivered(&self) -> bool {
        self.on_success == OnSuccess::Mark
    }

    /// Checks every name and the combinations; the error names the field and the fix.
    pub fn validate(&self) -> Result<(), StoreError> {
        let config = |message: String| StoreError::new(StoreErrorKind::Config, message);
        if let Some(schema) = &self.schema {
            Ident::new(schema, "mapping schema")?;
        }
        Ident::new(&self.table, "mapping table")?;
        let mut columns: Vec<(&str, &str)> = vec![
            ("id", &self.id),
            ("destination", &self.destination),
            ("payload", &self.payload),
        ];
        let optional = [
            ("event_id", &self.event_id),
            ("key", &self.key),
            ("event_type", &self.event_type),
            ("headers", &self.headers),
            ("traceparent", &self.traceparent),
            ("tracestate", &self.tracestate),
            ("span_context", &self.span_context),
            ("mutation_id", &self.mutation_id),
            ("rejected", &self.rejected),
            ("created_at", &self.created_at),
            ("updated_at", &self.updated_at),
            ("attempts", &self.attempts),
            ("last_error", &self.last_error),
            ("available_at", &self.available_at),
            ("locked_by", &self.locked_by),
            ("locked_until", &self.locked_until),
            ("locked_at", &self.locked_at),
            ("delivered_at", &self.delivered_at),
            ("dead_at", &self.dead_at),
        ];
        for (field, value) in optional {
            if let Some(v) = value {
                columns.push((field, v));
            }
        }
        for column in &self.order_by {
            columns.push(("order_by", column));
        }
        for (field, column) in columns {
            Ident::new(column, &format!("mapping.{field} column"))?;
        }
        match &self.state {
            State::Rows => {
                if self.on_success == OnSuccess::Mark && self.delivered_at.is_none() {
                    return Err(config("mapping: on_success = \"mark\" needs a state column or a delivered_at column to mark; set state.kind = \"status\" or \"flag\", or map delivered_at".into()));
                }
            }
            State::Flag {
                column,
                pending,
                done,
            } => {
                Ident::new(column, "mapping.state.column")?;
                literal(pending)?;
                literal(done)?;
            }
            State::Status {
                column,
                pending,
                in_flight,
                delivered,
                dead,
            } => {
                Ident::new(column, "mapping.state.column")?;
                for value in [
                    Some(pending),
                    in_flight.as_ref(),
                    Some(delivered),
                    dead.as_ref(),
                ]
                .into_iter()
                .flatten()
                {
                    literal(value)?;
                }
            }
        }
        if self.span_context.is_some() && (self.traceparent.is_some() || self.tracestate.is_some())
        {
            return Err(config(
                "mapping: span_context holds traceparent and tracestate itself; map it, or the \
                 traceparent and tracestate columns, not both"
                    .into(),
            ));
        }
        if let Some(header) = &self.event_id_header {
            if header.is_empty() || header.contains(|c: char| c.is_control() || c == ':') {
                return Err(config(format!(
                    "mapping: event_id_header {header:?} is not a header name"
                )));
            }
        }
        if self.locked_until.is_some() != self.locked_by.is_some() && self.locked_until.is_some() {
            return Err(config(
                "mapping: locked_until needs locked_by (the lease's owner) as well".into(),
            ));
        }
        if let Some(m) = &self.max_attempts_from {
            Ident::new(&m.table, "mapping.max_attempts_from.table")?;
            Ident::new(&m.key_column, "mapping.max_attempts_from.key_column")?;
            Ident::new(&m.join_column, "mapping.max_attempts_from.join_column")?;
            Ident::new(&m.column, "mapping.max_attempts_from.column")?;
        }
        Ok(())
    }
}

/// A state value rendered as an SQL literal: `true`, `false`, an integer, or a quoted word.
pub(crate) fn literal(value: &str) -> Result<String, StoreError> {
    let is_number = value.parse::<i64>().is_ok();
    if is_number || value == "true" || value == "false" {
        return Ok(value.to_string());
    }
    let word = !value.is_empty()
        && value.len() <= 63
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if word {
        Ok(format!("'{value}'"))
    } else {
        Err(StoreError::new(
            StoreErrorKind::Config,
            format!("mapping: state value {value:?} must be true, false, an integer or a word of letters, digits, '_', '-' or '.'"),
        ))
    }
}

/// The named layouts.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum LayoutKind {
    /// The relay's own tables.
    #[default]
    Native,
    /// The Ably Database Connector's outbox and nodes tables.
    Adbc,
    /// Open Outbox Relay's `openoutbox_events`.
    OpenOutbox,
    /// The export seed's `event` and `event_type`.
    Export,
    /// The MySQL 8 seed's `outbox_events`.
    MysqlOutboxEvents,
    /// The table Debezium's outbox event router reads.
    Debezium,
    /// A column mapping from the configuration (`[mapping]`).
    Custom,
}

impl LayoutKind {
    /// The outbox table when none is configured: a seed's own table name.
    pub fn default_outbox_table(self) -> &'static str {
        match self {
            LayoutKind::Native | LayoutKind::Adbc | LayoutKind::Custom => "outbox",
            LayoutKind::OpenOutbox => "openoutbox_events",
            LayoutKind::Export => "event",
            LayoutKind::MysqlOutboxEvents => "outbox_events",
            LayoutKind::Debezium => "outboxevent",
        }
    }

    /// The target of a route that names none (and of `--sink`): the destination itself, or
    /// Debezium's topic `outbox.event.<aggregatetype>`.
    pub fn default_target(self) -> &'static str {
        match self {
            LayoutKind::Debezium => "outbox.event.{destination}",
            _ => "{destination}",
        }
    }

    /// The nodes table of a layout that brings its own (the Ably connector's `nodes`).
    pub fn default_nodes_table(self) -> Option<&'static str> {
        (self == LayoutKind::Adbc).then_some("nodes")
    }

    /// The NOTIFY channel of a layout whose trigger names its own (the Ably connector's).
    pub fn default_notify_channel(self) -> Option<&'static str> {
        (self == LayoutKind::Adbc).then_some("ably_adbc")
    }

    /// Whether the layout's table exists in this dialect: the PostgreSQL seeds' tables
    /// (adbc, open-outbox, export) are defined for PostgreSQL only.
    pub fn runs_on(self, dialect: Dialect) -> bool {
        match self {
            LayoutKind::Adbc
            | LayoutKind::OpenOutbox
            | LayoutKind::Export
            | LayoutKind::Debezium => dialect == Dialect::Postgres,
            LayoutKind::Native | LayoutKind::MysqlOutboxEvents | LayoutKind::Custom => true,
        }
    }
}

impl fmt::Display for LayoutKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LayoutKind::Native => "native",
            LayoutKind::Adbc => "adbc",
            LayoutKind::OpenOutbox => "open-outbox",
            LayoutKind::Export => "export",
            LayoutKind::MysqlOutboxEvents => "mysql-outbox-events",
            LayoutKind::Debezium => "debezium",
            LayoutKind::Custom => "custom",
        })
    }
}

impl std::str::FromStr for LayoutKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "native" => LayoutKind::Native,
            "adbc" => LayoutKind::Adbc,
            "open-outbox" => LayoutKind::OpenOutbox,
            "export" => LayoutKind::Export,
            "mysql-outbox-events" => LayoutKind::MysqlOutboxEvents,
            "debezium" => LayoutKind::Debezium,
            "custom" => LayoutKind::Custom,
            other => {
                return Err(format!(
                    "unknown layout {other:?}: use native, adbc, open-outbox, export, mysql-outbox-events, debezium or custom"
                ))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_validate() {
        Mapping::adbc("public", "outbox").validate().unwrap();
        Mapping::open_outbox("public", "openoutbox_events")
            .validate()
            .unwrap();
        Mapping::export("public", "event").validate().unwrap();
        Mapping::mysql_outbox_events(None, "outbox_events")
            .validate()
            .unwrap();
        Mapping::native_mysql(None, "outbox", false)
            .validate()
            .unwrap();
        Mapping::debezium("public", "outboxevent")
            .validate()
            .unwrap();
    }

    #[test]
    fn dead_rows_go_where_each_seed_can_keep_them() {
        assert_eq!(
            Mapping::adbc("public", "outbox").dead_state(),
            DeadState::Flag("true".into())
        );
        assert_eq!(
            Mapping::open_outbox("public", "e").dead_state(),
            DeadState::Status("DEAD".into())
        );
        assert_eq!(
            Mapping::export("public", "event").dead_state(),
            DeadState::Status("ERROR".into())
        );
        assert_eq!(
            Mapping::mysql_outbox_events(None, "outbox_events").dead_state(),
            DeadState::SideTable
        );
        assert_eq!(
            Mapping::native_mysql(None, "outbox", true).dead_state(),
            DeadState::Timestamp("dead_at".into())
        );
    }

    #[test]
    fn hostile_names_and_values_are_refused() {
        let mut m = Mapping::adbc("public", "outbox");
        m.destination = "channel; DROP TABLE x".into();
        assert!(m
            .validate()
            .unwrap_err()
            .to_string()
            .contains("destination"));
        assert!(literal("x' OR '1'='1").is_err());
        assert_eq!(literal("DEAD").unwrap(), "'DEAD'");
        assert_eq!(literal("0").unwrap(), "0");
    }
}
