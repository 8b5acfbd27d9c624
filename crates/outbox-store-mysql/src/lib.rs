//! MySQL 8 / MariaDB (≥ 10.6) outbox store.
//!
//! Every MySQL table is a [`Mapping`]: the native layout ([`Mapping::native_mysql`]), the
//! MySQL seed's `outbox_events` ([`Mapping::mysql_outbox_events`]) or a custom mapping.
//! Claims follow the seed's advice: `SELECT ... ORDER BY ... LIMIT n FOR UPDATE SKIP LOCKED`
//! under READ COMMITTED (no gap locks that would block the application's inserts), batched,
//! then one `UPDATE` marking the batch where the table can mark it, in one transaction.
//!
//! As with PostgreSQL's mapped layouts, one relay per table is active at a time: it holds a
//! `GET_LOCK` named after the table on a dedicated connection; the others stand by and take
//! over when that connection is gone (see ARCHITECTURE.md, "Mapped layouts").

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::future::BoxFuture;
use futures::FutureExt;
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Opts, OptsBuilder, Params, Pool, PoolConstraints, PoolOpts, Row, Value};
use outbox_core::store::{
    Backlog, ClaimRequest, Claimed, DeadLetter, DeadRecord, DeadSelector, DestinationStats,
    Incarnation, NodeRecord, NodeRegistry, OnChange, Operations, Problem, Registration, RetryLater,
    StoreResult,
};
use outbox_core::time::{from_micros, micros, millis};
use outbox_core::{Fence, NewEvent, NodeId, OutboxStore, SequenceId, StoreError, StoreErrorKind};
use outbox_layout::memory::{decode, derived_event_id, Memory, RawRow, RowId};
use outbox_layout::sql::Sql;
use outbox_layout::{DeadState, Dialect, IdType, Mapping, Seed};

/// How often a standby relay tries to become active, and the active one checks its lock
/// connection and reaps.
const LEADER_CHECK: Duration = Duration::from_secs(1);

/// Connection settings and the table.
#[derive(Clone, Debug)]
pub struct MySqlOptions {
    /// `mysql://user:password@host:port/db` (`mariadb://` too); TLS with `?require_ssl=true`
    /// (and `verify_ca`, `verify_identity`).
    pub url: String,
    pub mapping: Mapping,
    /// The layout's name, for logs and fixes.
    pub layout: String,
    /// Where the table has no attempt limit of its own.
    pub max_attempts: u32,
    pub pool_size: usize,
    /// The nodes table (native layout), or `None`.
    pub nodes_table: Option<String>,
}

struct Leader {
    conn: Option<Conn>,
    last_check: Option<Instant>,
    last_reap: Option<Instant>,
}

struct Inner {
    pool: Pool,
    opts: Opts,
    sql: Sql,
    layout: String,
    max_attempts: i64,
    nodes_table: Option<String>,
    memory: Mutex<Memory>,
    leader: tokio::sync::Mutex<Leader>,
}

/// The MySQL/MariaDB store. Cheap to clone.
#[derive(Clone)]
pub struct MySqlStore {
    inner: Arc<Inner>,
}

/// Maps a driver error to its kind, by server error code, never by message text.
pub fn classify(error: &mysql_async::Error) -> StoreErrorKind {
    match error {
        mysql_async::Error::Server(e) => match e.code {
            1146 | 1054 | 1049 | 1305 => StoreErrorKind::MissingSchema,
            1142 | 1143 | 1044 | 1227 => StoreErrorKind::Privilege,
            1045 => StoreErrorKind::Config,
            1205 | 1213 => StoreErrorKind::Conflict,
            1040 | 1053 | 2006 | 2013 | 1927 => StoreErrorKind::Connection,
            _ => StoreErrorKind::Query,
        },
        mysql_async::Error::Io(_) | mysql_async::Error::Driver(_) => StoreErrorKind::Connection,
        mysql_async::Error::Url(_) => StoreErrorKind::Config,
        _ => StoreErrorKind::Query,
    }
}

/// ER_DATA_TOO_LONG: a value longer than its column, refused in strict mode (the default).
const DATA_TOO_LONG: u16 = 1406;

fn db_error(context: &str, error: mysql_async::Error) -> StoreError {
    let kind = classify(&error);
    match &error {
        mysql_async::Error::Server(e) if e.code == DATA_TOO_LONG => StoreError::new(
            kind,
            format!(
                "{context}: {}: shorten the value (an ordering key can be a hash of a longer \
                 one) or widen the column, e.g. ALTER TABLE .. MODIFY partition_key text (the \
                 native table's destination, partition_key and event_type are varchar(255))",
                e.message
            ),
        ),
        mysql_async::Error::Server(e) => StoreError::new(kind, format!("{context}: {}", e.message)),
        _ => StoreError::new(kind, format!("{context}: {error}")),
    }
}

/// A column's raw value (`Row::take` with a target type panics on a mismatch).
fn col(row: &mut Row, i: usize) -> Value {
    row.take::<Value, usize>(i).unwrap_or(Value::NULL)
}

fn text(v: Value) -> Option<String> {
    match v {
        Value::NULL => None,
        Value::Bytes(b) => Some(String::from_utf8_lossy(&b).into_owned()),
        Value::Int(i) => Some(i.to_string()),
        Value::UInt(u) => Some(u.to_string()),
        other => Some(other.as_sql(true).trim_matches('\'').to_string()),
    }
}

fn int(v: Value) -> Option<i64> {
    match v {
        Value::NULL => None,
        Value::Int(i) => Some(i),
        Value::UInt(u) => i64::try_from(u).ok(),
        Value::Float(f) => Some(f as i64),
        Value::Double(d) => Some(d as i64),
        Value::Bytes(b) => String::from_utf8_lossy(&b)
            .trim()
            .parse::<f64>()
            .ok()
            .map(|f| f as i64),
        _ => None,
    }
}

fn bytes(v: Value) -> Option<Vec<u8>> {
    match v {
        Value::NULL => None,
        Value::Bytes(b) => Some(b),
        other => text(other).map(String::into_bytes),
    }
}

/// Named parameters (`:name`).
fn named(pairs: Vec<(&str, Value)>) -> Params {
    if pairs.is_empty() {
        return Params::Empty;
    }
    Params::Named(
        pairs
            .into_iter()
            .map(|(k, v)| (k.as_bytes().to_vec(), v))
            .collect::<HashMap<_, _>>(),
    )
}

/// An id list inlined into the statement: integers are formatted by us, UUIDs quoted.
fn id_list(ids: &[RowId]) -> String {
    ids.iter()
        .map(|id| match id {
            RowId::Integer(i) => i.to_string(),
            RowId::Uuid(u) => format!("'{u}'"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

impl MySqlStore {
    /// Builds the pool. No connection is opened until first use.
    pub fn new(options: MySqlOptions) -> StoreResult<Self> {
        let sql = Sql::new(options.mapping, Dialect::MySql)?;
        let url = match options.url.strip_prefix("mariadb://") {
            Some(rest) => format!("mysql://{rest}"),
            None => options.url.clone(),
        };
        let parsed = Opts::from_url(&url).map_err(|e| {
            StoreError::new(
                StoreErrorKind::Config,
                format!("invalid MySQL URL: {e}; use mysql://user:password@host:port/database"),
            )
        })?;
        let constraints = PoolConstraints::new(0, options.pool_size.max(2)).expect("min below max");
        let opts: Opts = OptsBuilder::from_opts(parsed)
            .init(vec![
                // Timestamps are written and read as UTC, whatever the server's zone.
                "SET time_zone = '+00:00'",
                // The seed's reason: no gap locks blocking the application's inserts.
                "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
            ])
            .pool_opts(PoolOpts::default().with_constraints(constraints))
            .into();
        Ok(MySqlStore {
            inner: Arc::new(Inner {
                pool: Pool::new(opts.clone()),
                opts,
                sql,
                layout: options.layout,
                max_attempts: options.max_attempts as i64,
                nodes_table: options.nodes_table,
                memory: Mutex::new(Memory::default()),
                leader: tokio::sync::Mutex::new(Leader {
                    conn: None,
                    last_check: None,
                    last_reap: None,
                }),
            }),
        })
    }

    pub fn sql(&self) -> &Sql {
        &self.inner.sql
    }

    async fn conn(&self, context: &str) -> StoreResult<Conn> {
        self.inner
            .pool
            .get_conn()
            .await
            .map_err(|e| db_error(context, e))
    }

    async fn exec(&self, context: &str, statement: &str, params: Params) -> StoreResult<u64> {
        let mut conn = self.conn(context).await?;
        conn.exec_drop(statement, params)
            .await
            .map_err(|e| db_error(context, e))?;
        Ok(conn.affected_rows())
    }

    async fn rows(&self, context: &str, statement: &str, params: Params) -> StoreResult<Vec<Row>> {
        let mut conn = self.conn(context).await?;
        conn.exec(statement, params)
            .await
            .map_err(|e| db_error(context, e))
    }

    /// Runs arbitrary SQL, several statements allowed (for tests and tools).
    pub async fn batch_execute(&self, sql: &str) -> StoreResult<()> {
        let mut conn = self.conn("execute").await?;
        conn.query_drop(sql)
            .await
            .map_err(|e| db_error("execute", e))
    }

    fn nodes(&self) -> Option<String> {
        self.inner
            .nodes_table
            .as_ref()
            .map(|n| self.inner.sql.qualified(n))
    }

    /// The layout's tables (and the nodes table of the native layout), or `None` for a
    /// custom mapping.
    pub fn ddl(&self) -> Option<String> {
        let mut ddl = self.inner.sql.ddl()?;
        if let Some(nodes) = self.nodes() {
            ddl.push_str(&format!(
                "CREATE TABLE IF NOT EXISTS {nodes} (\n    id varchar(64) PRIMARY KEY,\n    expiry datetime(6) NOT NULL\n) ENGINE=InnoDB;\n"
            ));
        }
        Some(ddl)
    }

    pub fn grants(&self, role: &str) -> String {
        let mut out = format!(
            "-- The relay's run-time account for the {} layout (MySQL/MariaDB).\n-- CREATE USER '{role}'@'%' IDENTIFIED BY '...';\n{}",
            self.inner.layout,
            self.inner.sql.grants(role)
        );
        if let Some(nodes) = self.nodes() {
            out.push_str(&format!(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON {nodes} TO '{role}'@'%';\n"
            ));
        }
        out
    }

    pub async fn migrate(&self) -> StoreResult<()> {
        let Some(ddl) = self.ddl() else {
            return Err(StoreError::new(
                StoreErrorKind::Config,
                "this custom mapping runs on the application's existing table and marks dead rows itself: there is nothing to migrate",
            ));
        };
        let mut conn = self.conn("migrate").await?;
        conn.query_drop("SELECT GET_LOCK('outbox-relay migrate', 60)")
            .await
            .map_err(|e| db_error("migrate", e))?;
        let result = conn
            .query_drop(&ddl)
            .await
            .map_err(|e| db_error("migrate", e));
        let _ = conn
            .query_drop("SELECT RELEASE_LOCK('outbox-relay migrate')")
            .await;
        result
    }

    fn lock_name(&self) -> String {
        let m = &self.inner.sql.mapping;
        // GET_LOCK names are server-wide: name the database too.
        let database = m
            .schema
            .as_deref()
            .or(self.inner.opts.db_name())
            .unwrap_or("");
        let name = format!("outbox-relay {database}.{}", m.table);
        // GET_LOCK names are limited to 64 characters.
        name.chars().take(64).collect()
    }

    /// Becomes (or stays) the active relay; false when another relay is.
    async fn ensure_active(&self, lease: Duration) -> StoreResult<bool> {
        let mut leader = self.inner.leader.lock().await;
        let due = leader
            .last_check
            .is_none_or(|t| t.elapsed() >= LEADER_CHECK);
        if !due {
            return Ok(leader.conn.is_some());
        }
        leader.last_check = Some(Instant::now());
        if let Some(conn) = leader.conn.as_mut() {
            if conn.ping().await.is_err() {
                tracing::warn!(layout = %self.inner.layout, "lost the connection holding the active-relay lock; claiming stops until it is taken again");
                leader.conn = None;
                return Ok(false);
            }
            if leader.last_reap.is_none_or(|t| t.elapsed() >= lease / 2) {
                leader.last_reap = Some(Instant::now());
                let reaped = self.reap(false, lease).await?;
                if reaped > 0 {
                    tracing::warn!(layout = %self.inner.layout, reaped, "returned rows with expired leases to pending");
                }
            }
            return Ok(true);
        }
        let mut conn = Conn::new(self.inner.opts.clone())
            .await
            .map_err(|e| db_error("take the active-relay lock", e))?;
        let got: Option<Option<i64>> = conn
            .exec_first("SELECT GET_LOCK(?, 0)", (self.lock_name(),))
            .await
            .map_err(|e| db_error("take the active-relay lock", e))?;
        if got.flatten() != Some(1) {
            return Ok(false);
        }
        leader.conn = Some(conn);
        *self.inner.memory.lock().expect("memory lock") = Memory::default();
        let reaped = self.reap(true, lease).await?;
        leader.last_reap = Some(Instant::now());
        tracing::info!(layout = %self.inner.layout, table = %self.inner.sql.table(), reaped, "this relay is now the table's active relay");
        Ok(true)
    }

    async fn reap(&self, all: bool, lease: Duration) -> StoreResult<u64> {
        let mut total = 0;
        for to_dead in [true, false] {
            if let Some(statement) = self.inner.sql.reap(to_dead, ":max", ":all", ":lease") {
                total += self
                    .exec(
                        "reap",
                        &statement,
                        named(vec![
                            ("max", Value::from(self.inner.max_attempts)),
                            ("all", Value::from(all)),
                            ("lease", Value::from(millis(lease))),
                        ]),
                    )
                    .await?;
            }
        }
        Ok(total)
    }

    fn row_ids(&self, handles: &[SequenceId]) -> Vec<RowId> {
        match self.inner.sql.mapping.id_type {
            IdType::Integer => handles.iter().map(|h| RowId::Integer(*h)).collect(),
            IdType::Uuid => {
                let memory = self.inner.memory.lock().expect("memory lock");
                handles
                    .iter()
                    .filter_map(|h| memory.uuid(*h).map(RowId::Uuid))
                    .collect()
            }
        }
    }

    fn settled(&self, handles: &[SequenceId], done: bool) {
        self.inner
            .memory
            .lock()
            .expect("memory lock")
            .settled(handles, done);
    }

    fn raw_row(&self, mut row: Row) -> RawRow {
        let id_text = text(col(&mut row, 0)).unwrap_or_default();
        RawRow {
            id: match self.inner.sql.mapping.id_type {
                IdType::Integer => RowId::Integer(id_text.parse().unwrap_or(0)),
                IdType::Uuid => RowId::Uuid(uuid::Uuid::parse_str(&id_text).unwrap_or_default()),
            },
            event_id: text(col(&mut row, 1)),
            destination: text(col(&mut row, 2)),
            key: text(col(&mut row, 3)),
            event_type: text(col(&mut row, 4)),
            payload: bytes(col(&mut row, 5)),
            headers: text(col(&mut row, 6)),
            mutation_id: text(col(&mut row, 7)),
            rejected: int(col(&mut row, 8)),
            attempts: int(col(&mut row, 9)),
            created_micros: int(col(&mut row, 10)),
            max_attempts: int(col(&mut row, 11)),
        }
    }

    fn at(&self, name: &str) -> String {
        format!("FROM_UNIXTIME(:{name} / 1000000)")
    }

    fn unsupported(&self, what: &str) -> StoreError {
        StoreError::new(
            StoreErrorKind::Config,
            format!("the {} layout {what}", self.inner.layout),
        )
    }
}

impl OutboxStore for MySqlStore {
    fn describe(&self) -> String {
        format!(
            "mysql {} ({} layout)",
            self.inner.sql.table(),
            self.inner.layout
        )
    }

    fn claim(&self, request: ClaimRequest) -> BoxFuture<'static, StoreResult<Vec<Claimed>>> {
        let store = self.clone();
        async move {
            if !store.ensure_active(request.lease).await? {
                return Ok(Vec::new());
            }
            let sql = &store.inner.sql;
            let (blocked, held) = {
                let mut memory = store.inner.memory.lock().expect("memory lock");
                (memory.blocked_keys(&request.node.0), memory.held())
            };
            let mut condition = sql.claimable();
            let mut params: Vec<(String, Value)> = Vec::new();
            if !blocked.is_empty() {
                let names: Vec<String> = (0..blocked.len()).map(|i| format!(":k{i}")).collect();
                condition.push_str(&format!(
                    " AND {} NOT IN ({})",
                    sql.key_expr(),
                    names.join(", ")
                ));
                for (i, key) in blocked.into_iter().enumerate() {
                    params.push((format!("k{i}"), Value::from(key)));
                }
            }
            let marks = sql.mapping.marks_claims();
            if !marks && !held.is_empty() {
                condition.push_str(&format!(
                    " AND {} NOT IN ({})",
                    sql.id_column(),
                    id_list(&store.row_ids(&held))
                ));
            }
            let select = format!(
                "SELECT {} FROM {} o WHERE {condition} ORDER BY {} LIMIT {} FOR UPDATE SKIP LOCKED",
                sql.select_list(),
                sql.table(),
                sql.order_by(),
                request.limit.max(1)
            );
            let params = Params::Named(
                params
                    .into_iter()
                    .map(|(k, v)| (k.into_bytes(), v))
                    .collect(),
            );
            let mut conn = store.conn("claim").await?;
            let mut tx = conn
                .start_transaction(mysql_async::TxOpts::default())
                .await
                .map_err(|e| db_error("claim", e))?;
            let rows: Vec<Row> = if matches!(params, Params::Named(ref m) if m.is_empty()) {
                tx.exec(&select, ()).await
            } else {
                tx.exec(&select, params).await
            }
            .map_err(|e| db_error("claim", e))?;
            let raws: Vec<RawRow> = rows.into_iter().map(|r| store.raw_row(r)).collect();
            let set = sql.claim_set(":node", ":lease");
            if marks && !raws.is_empty() && !set.is_empty() {
                let ids: Vec<RowId> = raws.iter().map(|r| r.id.clone()).collect();
                let update =
                    sql.update(&set, &format!("{} IN ({})", sql.id_column(), id_list(&ids)));
                tx.exec_drop(
                    &update,
                    named(vec![
                        ("node", Value::from(request.node.0.as_str())),
                        ("lease", Value::from(millis(request.lease))),
                    ]),
                )
                .await
                .map_err(|e| db_error("claim", e))?;
            }
            tx.commit().await.map_err(|e| db_error("claim", e))?;
            let mut memory = store.inner.memory.lock().expect("memory lock");
            Ok(raws
                .into_iter()
                .map(|raw| {
                    decode(
                        &sql.mapping,
                        raw,
                        &mut memory,
                        &request.node.0,
                        request.lease,
                    )
                })
                .collect())
        }
        .boxed()
    }

    fn ack(
        &self,
        node: NodeId,
        _fence: Option<Arc<Fence>>,
        ids: Vec<SequenceId>,
    ) -> BoxFuture<'static, StoreResult<u64>> {
        let store = self.clone();
        async move {
            let row_ids = store.row_ids(&ids);
            if row_ids.is_empty() {
                return Ok(0);
            }
            let statement = store
                .inner
                .sql
                .ack(&format!("IN ({})", id_list(&row_ids)), ":node");
            let n = store
                .exec(
                    "ack",
                    &statement,
                    named(vec![("node", Value::from(node.0))]),
                )
                .await?;
            store.settled(&ids, true);
            Ok(n)
        }
        .boxed()
    }

    fn retry_later(
        &self,
        node: NodeId,
        _fence: Option<Arc<Fence>>,
        retries: Vec<RetryLater>,
    ) -> BoxFuture<'static, StoreResult<u64>> {
        let store = self.clone();
        async move {
            let sql = &store.inner.sql;
            let set = sql.retry_set(":attempts", ":error", ":delay");
            let mut n = 0;
            if set.is_empty() {
                n = retries.len() as u64;
            } else {
                let mut conn = store.conn("retry").await?;
                let mut tx = conn
                    .start_transaction(mysql_async::TxOpts::default())
                    .await
                    .map_err(|e| db_error("retry", e))?;
                for r in &retries {
                    let Some(id) = store.row_ids(&[r.sequence_id]).pop() else {
                        continue;
                    };
                    let statement = sql.update(
                        &set,
                        &format!(
                            "{} = {} AND {}",
                            sql.id_column(),
                            id_list(&[id]),
                            sql.fence(":node")
                        ),
                    );
                    tx.exec_drop(
                        &statement,
                        named(vec![
                            ("attempts", Value::from(r.attempts)),
                            ("error", Value::from(r.error.as_str())),
                            ("delay", Value::from(millis(r.delay))),
                            ("node", Value::from(node.0.as_str())),
                        ]),
                    )
                    .await
                    .map_err(|e| db_error("retry", e))?;
                    n += tx.affected_rows();
                }
                tx.commit().await.map_err(|e| db_error("retry", e))?;
            }
            // After the table recorded it: the key unblocks here no sooner than there.
            store
                .inner
                .memory
                .lock()
                .expect("memory lock")
                .retried(&retries);
            Ok(n)
        }
        .boxed()
    }

    fn dead_letter(
        &self,
        node: NodeId,
        _fence: Option<Arc<Fence>>,
        entries: Vec<DeadLetter>,
    ) -> BoxFuture<'static, StoreResult<u64>> {
        let store = self.clone();
        async move {
            let sql = &store.inner.sql;
            let handles: Vec<SequenceId> = entries.iter().map(|e| e.sequence_id).collect();
            let mut conn = store.conn("dead-letter").await?;
            let mut tx = conn
                .start_transaction(mysql_async::TxOpts::default())
                .await
                .map_err(|e| db_error("dead-letter", e))?;
            let mut n = 0;
            for e in &entries {
                let Some(id) = store.row_ids(&[e.sequence_id]).pop() else {
                    continue;
                };
                let id = id_list(&[id]);
                let statement = if sql.mapping.dead_state() == DeadState::SideTable {
                    format!(
                        "INSERT IGNORE INTO {} (id, attempts, last_error, dead_at)
                         SELECT {}, :attempts, :error, UTC_TIMESTAMP(6) FROM {} o
                          WHERE {} = {id} AND {}",
                        sql.dead_table(),
                        sql.id_column(),
                        sql.table(),
                        sql.id_column(),
                        sql.fence(":node")
                    )
                } else {
                    sql.update(
                        &sql.dead_set(":attempts", ":error"),
                        &format!("{} = {id} AND {}", sql.id_column(), sql.fence(":node")),
                    )
                };
                tx.exec_drop(
                    &statement,
                    named(vec![
                        ("attempts", Value::from(e.attempts)),
                        ("error", Value::from(e.error.as_str())),
                        ("node", Value::from(node.0.as_str())),
                    ]),
                )
                .await
                .map_err(|e| db_error("dead-letter", e))?;
                n += tx.affected_rows();
            }
            tx.commit().await.map_err(|e| db_error("dead-letter", e))?;
            store.settled(&handles, true);
            Ok(n)
        }
        .boxed()
    }

    fn release(&self, node: NodeId, ids: Vec<SequenceId>) -> BoxFuture<'static, StoreResult<u64>> {
        let store = self.clone();
        async move {
            let row_ids = store.row_ids(&ids);
            let statement = store
                .inner
                .sql
                .release(&format!("IN ({})", id_list(&row_ids)), ":node");
            let n = match statement {
                Some(s) if !row_ids.is_empty() => {
                    store
                        .exec("release", &s, named(vec![("node", Value::from(node.0))]))
                        .await?
                }
                _ => ids.len() as u64,
            };
            store.settled(&ids, false);
            Ok(n)
        }
        .boxed()
    }

    fn extend_leases(
        &self,
        node: NodeId,
        ids: Vec<SequenceId>,
        lease: Duration,
    ) -> BoxFuture<'static, StoreResult<u64>> {
        let store = self.clone();
        async move {
            let row_ids = store.row_ids(&ids);
            match store
                .inner
                .sql
                .extend(&format!("IN ({})", id_list(&row_ids)), ":node", ":lease")
            {
                Some(s) if !row_ids.is_empty() => {
                    store
                        .exec(
                            "extend leases",
                            &s,
                            named(vec![
                                ("node", Value::from(node.0)),
                                ("lease", Value::from(millis(lease))),
                            ]),
                        )
                        .await
                }
                _ => Ok(ids.len() as u64),
            }
        }
        .boxed()
    }

    fn backlog(&self) -> BoxFuture<'static, StoreResult<Backlog>> {
        let store = self.clone();
        async move {
            let mut rows = store
                .rows("backlog", &store.inner.sql.stats(false), Params::Empty)
                .await?;
            let mut row = rows.pop().ok_or_else(|| {
                StoreError::new(StoreErrorKind::Query, "backlog: no row returned")
            })?;
            let mut n = |i: usize| int(col(&mut row, i));
            Ok(Backlog {
                pending: n(0).unwrap_or(0) as u64,
                retrying: n(1).unwrap_or(0) as u64,
                dead: n(2).unwrap_or(0) as u64,
                oldest_pending_age: n(3).map(|ms| Duration::from_millis(ms.max(0) as u64)),
            })
        }
        .boxed()
    }

    fn insert(&self, events: Vec<NewEvent>) -> BoxFuture<'static, StoreResult<Vec<SequenceId>>> {
        let store = self.clone();
        async move {
            let m = &store.inner.sql.mapping;
            let sql = &store.inner.sql;
            let mut conn = store.conn("insert").await?;
            let mut ids = Vec::new();
            for event in events {
                let mut columns: Vec<String> =
                    vec![sql.quote(&m.destination), sql.quote(&m.payload)];
                let mut values: Vec<String> = vec![":destination".into(), ":payload".into()];
                let mut params = vec![
                    ("destination", Value::from(event.destination.as_str())),
                    (
                        "payload",
                        event.payload.as_deref().map_or(Value::NULL, Value::from),
                    ),
                ];
                let mut add = |column: &Option<String>, name: &'static str, value: Value| {
                    if let Some(c) = column.as_ref().filter(|c| **c != m.destination) {
                        columns.push(sql.quote(c));
                        values.push(format!(":{name}"));
                        params.push((name, value));
                    }
                };
                add(
                    &m.key,
                    "key",
                    event
                        .partition_key
                        .as_deref()
                        .map_or(Value::NULL, Value::from),
                );
                add(
                    &m.event_type,
                    "type",
                    Value::from(event.event_type.as_str()),
                );
                add(
                    &m.headers,
                    "headers",
                    Value::from(
                        serde_json::to_string(&event.headers).unwrap_or_else(|_| "{}".into()),
                    ),
                );
                add(
                    &m.mutation_id,
                    "mutation",
                    event
                        .mutation_id
                        .as_deref()
                        .map_or(Value::NULL, Value::from),
                );
                if let Some(id) = event.event_id {
                    add(&m.event_id, "event_id", Value::from(id.to_string()));
                }
                for (column, expression) in &m.insert_defaults {
                    let quoted = sql.quote(column);
                    if !columns.contains(&quoted) {
                        columns.push(quoted);
                        values.push(expression.clone());
                    }
                }
                let statement = format!(
                    "INSERT INTO {} ({}) VALUES ({})",
                    sql.table(),
                    columns.join(", "),
                    values.join(", ")
                );
                conn.exec_drop(&statement, named(params))
                    .await
                    .map_err(|e| db_error("insert", e))?;
                ids.push(conn.last_insert_id().unwrap_or(0) as i64);
            }
            Ok(ids)
        }
        .boxed()
    }

    fn ping(&self) -> BoxFuture<'static, StoreResult<()>> {
        let store = self.clone();
        async move {
            let mut conn = store.conn("ping").await?;
            conn.ping().await.map_err(|e| db_error("ping", e))
        }
        .boxed()
    }

    fn verify(&self) -> BoxFuture<'static, StoreResult<Vec<Problem>>> {
        let store = self.clone();
        async move { verify(&store).await }.boxed()
    }

    fn subscribe(&self, _on_change: OnChange) -> Option<BoxFuture<'static, ()>> {
        // MySQL has no LISTEN/NOTIFY: the engine polls.
        None
    }
}

async fn verify(store: &MySqlStore) -> StoreResult<Vec<Problem>> {
    let m = &store.inner.sql.mapping;
    let fix = if m.seed.is_some() {
        format!(
            "run `outbox-relay migrate --layout {}` (or apply `outbox-relay migrate --layout {} --print`)",
            store.inner.layout, store.inner.layout
        )
    } else {
        "check the [mapping] section of the configuration against the table".to_string()
    };
    let schema_expr = match &m.schema {
        Some(_) => ":schema",
        None => "DATABASE()",
    };
    let rows = store
        .rows(
            "verify",
            &format!(
                "SELECT CAST(column_name AS CHAR) FROM information_schema.columns WHERE table_schema = {schema_expr} AND table_name = :table"
            ),
            named(vec![
                ("schema", Value::from(m.schema.clone().unwrap_or_default())),
                ("table", Value::from(m.table.as_str())),
            ]),
        )
        .await?;
    let present: HashSet<String> = rows
        .into_iter()
        .filter_map(|mut r| text(col(&mut r, 0)))
        .collect();
    let mut problems = Vec::new();
    if present.is_empty() {
        problems.push(Problem {
            what: format!(
                "table {} does not exist (or the account cannot see it)",
                store.inner.sql.table()
            ),
            fix,
        });
        return Ok(problems);
    }
    for column in m.columns() {
        if !present.contains(column) {
            problems.push(Problem {
                what: format!(
                    "table {} has no column {column:?}, which the {} layout maps",
                    store.inner.sql.table(),
                    store.inner.layout
                ),
                fix: fix.clone(),
            });
        }
    }
    if store.inner.sql.dead_table_ddl().is_some() {
        let probe = format!("SELECT 1 FROM {} LIMIT 1", store.inner.sql.dead_table());
        if let Err(e) = store.rows("verify", &probe, Params::Empty).await {
            problems.push(Problem {
                what: format!("the dead-letter side table: {e}"),
                fix: fix.clone(),
            });
        }
    }
    Ok(problems)
}

impl MySqlStore {
    /// In one transaction: reads the node's row (its expiry in microseconds since the epoch,
    /// counted without the session's time zone, and whether it is live), and writes `now +
    /// ttl` if `may_write` accepts what it read. Returns what was read and what was written.
    async fn write_node_expiry(
        &self,
        context: &'static str,
        nodes: &str,
        node: &NodeId,
        ttl: Duration,
        may_write: impl FnOnce(Option<(i64, bool)>) -> bool,
    ) -> StoreResult<(Option<i64>, Option<i64>)> {
        let micros = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', expiry)";
        let id = || named(vec![("id", Value::from(node.0.as_str()))]);
        let mut conn = self.conn(context).await?;
        let mut tx = conn
            .start_transaction(mysql_async::TxOpts::default())
            .await
            .map_err(|e| db_error(context, e))?;
        let read: Option<Row> = tx
            .exec_first(
                format!(
                    "SELECT {micros}, expiry >= UTC_TIMESTAMP(6) FROM {nodes} WHERE id = :id FOR UPDATE"
                ),
                id(),
            )
            .await
            .map_err(|e| db_error(context, e))?;
        let current = read.map(|mut r| {
            (
                int(col(&mut r, 0)).unwrap_or(0),
                int(col(&mut r, 1)).unwrap_or(0) != 0,
            )
        });
        if !may_write(current) {
            tx.rollback().await.map_err(|e| db_error(context, e))?;
            return Ok((current.map(|c| c.0), None));
        }
        tx.exec_drop(
            format!(
                "INSERT INTO {nodes} (id, expiry) VALUES (:id, UTC_TIMESTAMP(6) + INTERVAL (:ttl * 1000) MICROSECOND)
                 ON DUPLICATE KEY UPDATE expiry = VALUES(expiry)"
            ),
            named(vec![
                ("id", Value::from(node.0.as_str())),
                ("ttl", Value::from(millis(ttl))),
            ]),
        )
        .await
        .map_err(|e| db_error(context, e))?;
        let written: Option<Row> = tx
            .exec_first(format!("SELECT {micros} FROM {nodes} WHERE id = :id"), id())
            .await
            .map_err(|e| db_error(context, e))?;
        tx.commit().await.map_err(|e| db_error(context, e))?;
        Ok((
            current.map(|c| c.0),
            written.and_then(|mut r| int(col(&mut r, 0))),
        ))
    }
}

impl NodeRegistry for MySqlStore {
    fn register(
        &self,
        node: NodeId,
        ttl: Duration,
    ) -> BoxFuture<'static, StoreResult<Registration>> {
        let store = self.clone();
        async move {
            let Some(nodes) = store.nodes() else {
                return Ok(Registration::Registered(Incarnation(0)));
            };
            let (current, written) = store
                .write_node_expiry("register", &nodes, &node, ttl, |row| {
                    !row.is_some_and(|(_, live)| live)
                })
                .await?;
            Ok(match (written, current) {
                (Some(w), _) => Registration::Registered(Incarnation(w)),
                (None, c) => Registration::Taken(Incarnation(c.unwrap_or(0))),
            })
        }
        .boxed()
    }

    fn heartbeat(
        &self,
        node: NodeId,
        last: Incarnation,
        ttl: Duration,
    ) -> BoxFuture<'static, StoreResult<Option<Incarnation>>> {
        let store = self.clone();
        async move {
            let Some(nodes) = store.nodes() else {
                return Ok(Some(last));
            };
            let (_, written) = store
                .write_node_expiry("heartbeat", &nodes, &node, ttl, |row| {
                    row.is_none_or(|(expiry, _)| expiry == last.0)
                })
                .await?;
            Ok(written.map(Incarnation))
        }
        .boxed()
    }

    fn remove_expired(&self) -> BoxFuture<'static, StoreResult<u64>> {
        let store = self.clone();
        async move {
            let Some(nodes) = store.nodes() else {
                return Ok(0);
            };
            store
                .exec(
                    "remove expired nodes",
                    &format!("DELETE FROM {nodes} WHERE expiry < UTC_TIMESTAMP(6)"),
                    Params::Empty,
                )
                .await
        }
        .boxed()
    }

    fn deregister(&self, node: NodeId, last: Incarnation) -> BoxFuture<'static, StoreResult<()>> {
        let store = self.clone();
        async move {
            let Some(nodes) = store.nodes() else {
                return Ok(());
            };
            store
                .exec(
                    "deregister",
                    &format!(
                        "DELETE FROM {nodes}
                          WHERE id = :id AND TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', expiry) = :last"
                    ),
                    named(vec![("id", Value::from(node.0)), ("last", Value::from(last.0))]),
                )
                .await
                .map(|_| ())
        }
        .boxed()
    }

    fn live_nodes(&self) -> BoxFuture<'static, StoreResult<Vec<NodeRecord>>> {
        let store = self.clone();
        async move {
            let Some(nodes) = store.nodes() else {
                return Ok(Vec::new());
            };
            let rows = store
                .rows(
                    "list nodes",
                    &format!(
                        "SELECT id, CAST(UNIX_TIMESTAMP(expiry) * 1000000 AS SIGNED) FROM {nodes}
                          WHERE expiry >= UTC_TIMESTAMP(6) ORDER BY id"
                    ),
                    Params::Empty,
                )
                .await?;
            Ok(rows
                .into_iter()
                .map(|mut r| NodeRecord {
                    id: text(col(&mut r, 0)).unwrap_or_default(),
                    expiry: from_micros(int(col(&mut r, 1)).unwrap_or(0)),
                })
                .collect())
        }
        .boxed()
    }
}

impl MySqlStore {
    /// A dead-row selector as a condition over alias `o`, with its parameters.
    fn selector(
        &self,
        selector: &DeadSelector,
    ) -> StoreResult<(String, Vec<(&'static str, Value)>)> {
        let sql = &self.inner.sql;
        Ok(match selector {
            DeadSelector::Ids(ids) => {
                if sql.mapping.id_type != IdType::Integer {
                    return Err(self.unsupported(
                        "has UUID row ids: select dead events with --destination or --all",
                    ));
                }
                let list: Vec<RowId> = ids.iter().map(|i| RowId::Integer(*i)).collect();
                (
                    format!("{} IN ({})", sql.id_column(), id_list(&list)),
                    Vec::new(),
                )
            }
            DeadSelector::Destination(d) => (
                format!("{} = :destination", sql.destination_text()),
                vec![("destination", Value::from(d.as_str()))],
            ),
            DeadSelector::All => ("1 = 1".into(), Vec::new()),
        })
    }

    /// Ids of up to `limit` rows matching `condition`.
    async fn pick(
        &self,
        condition: &str,
        params: Vec<(&str, Value)>,
        limit: u32,
    ) -> StoreResult<Vec<RowId>> {
        let sql = &self.inner.sql;
        let statement = format!(
            "SELECT CAST({} AS CHAR) FROM {} o WHERE {condition} ORDER BY {} LIMIT {limit}",
            sql.id_column(),
            sql.table(),
            sql.id_column()
        );
        let rows = self.rows("select rows", &statement, named(params)).await?;
        Ok(rows
            .into_iter()
            .filter_map(|mut r| text(col(&mut r, 0)))
            .map(|t| match sql.mapping.id_type {
                IdType::Integer => RowId::Integer(t.parse().unwrap_or(0)),
                IdType::Uuid => RowId::Uuid(uuid::Uuid::parse_str(&t).unwrap_or_default()),
            })
            .collect())
    }

    /// Deletes rows by id (and their side-table records).
    async fn delete_ids(&self, ids: &[RowId]) -> StoreResult<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let sql = &self.inner.sql;
        let list = id_list(ids);
        let n = self
            .exec(
                "delete",
                &format!(
                    "DELETE FROM {} WHERE {} IN ({list})",
                    sql.table(),
                    sql.quote(&sql.mapping.id)
                ),
                Params::Empty,
            )
            .await?;
        if sql.dead_table_ddl().is_some() {
            self.exec(
                "delete",
                &format!("DELETE FROM {} WHERE id IN ({list})", sql.dead_table()),
                Params::Empty,
            )
            .await?;
        }
        Ok(n)
    }

    fn replay_condition(&self) -> StoreResult<String> {
        let sql = &self.inner.sql;
        let delivered = sql.delivered().ok_or_else(|| {
            self.unsupported("deletes delivered rows: there is nothing to replay")
        })?;
        let created = sql.created_at().ok_or_else(|| {
            self.unsupported("has no creation time column: replay cannot select by time")
        })?;
        if sql.mapping.id_type != IdType::Integer {
            return Err(self.unsupported("has UUID row ids: replay it with SQL"));
        }
        Ok(format!(
            "({delivered}) AND {created} >= {} AND {created} < {} AND (:destination IS NULL OR {} = :destination)",
            self.at("since"),
            self.at("until"),
            sql.destination_text()
        ))
    }
}

impl Operations for MySqlStore {
    fn destination_stats(&self) -> BoxFuture<'static, StoreResult<Vec<DestinationStats>>> {
        let store = self.clone();
        async move {
            let rows = store
                .rows("stats", &store.inner.sql.stats(true), Params::Empty)
                .await?;
            Ok(rows
                .into_iter()
                .map(|mut r| DestinationStats {
                    destination: text(col(&mut r, 0)).unwrap_or_default(),
                    pending: int(col(&mut r, 1)).unwrap_or(0) as u64,
                    retrying: int(col(&mut r, 2)).unwrap_or(0) as u64,
                    dead: int(col(&mut r, 3)).unwrap_or(0) as u64,
                    oldest_pending_age: int(col(&mut r, 4))
                        .map(|ms| Duration::from_millis(ms.max(0) as u64)),
                })
                .collect())
        }
        .boxed()
    }

    fn dead_list(
        &self,
        destination: Option<String>,
        limit: u32,
    ) -> BoxFuture<'static, StoreResult<Vec<DeadRecord>>> {
        let store = self.clone();
        async move {
            let statement = store.inner.sql.dead_list(
                destination.as_ref().map(|_| ":destination"),
                &limit.to_string(),
            );
            let params = match &destination {
                Some(d) => named(vec![("destination", Value::from(d.as_str()))]),
                None => Params::Empty,
            };
            let rows = store.rows("dead list", &statement, params).await?;
            Ok(rows
                .into_iter()
                .map(|mut r| {
                    let id = text(col(&mut r, 0)).unwrap_or_default();
                    let event_id = text(col(&mut r, 1));
                    let destination = text(col(&mut r, 2)).unwrap_or_default();
                    let event_type = text(col(&mut r, 3)).unwrap_or_default();
                    let attempts = int(col(&mut r, 4)).unwrap_or(0);
                    let last_error = text(col(&mut r, 5));
                    let dead_at = int(col(&mut r, 6));
                    DeadRecord {
                        sequence_id: id.parse().unwrap_or(0),
                        event_id: event_id
                            .and_then(|t| uuid::Uuid::parse_str(&t).ok())
                            .unwrap_or_else(|| derived_event_id(&store.inner.sql.mapping, &id)),
                        destination,
                        event_type,
                        attempts: attempts.max(0) as u32,
                        last_error: last_error.unwrap_or_else(|| {
                            "(this layout has no column for the error: see the relay's log)".into()
                        }),
                        dead_at: dead_at.map_or(UNIX_EPOCH, from_micros),
                    }
                })
                .collect())
        }
        .boxed()
    }

    fn dead_retry(&self, selector: DeadSelector) -> BoxFuture<'static, StoreResult<u64>> {
        let store = self.clone();
        async move {
            let (condition, params) = store.selector(&selector)?;
            let sql = &store.inner.sql;
            match sql.dead_retry(&condition) {
                Some(statement) => store.exec("dead retry", &statement, named(params)).await,
                None => {
                    let ids = store
                        .pick(
                            &format!("({}) AND {condition}", sql.dead()),
                            params,
                            u32::MAX,
                        )
                        .await?;
                    if ids.is_empty() {
                        return Ok(0);
                    }
                    store
                        .exec(
                            "dead retry",
                            &format!(
                                "DELETE FROM {} WHERE id IN ({})",
                                sql.dead_table(),
                                id_list(&ids)
                            ),
                            Params::Empty,
                        )
                        .await
                }
            }
        }
        .boxed()
    }

    fn dead_purge(&self, selector: DeadSelector) -> BoxFuture<'static, StoreResult<u64>> {
        let store = self.clone();
        async move {
            let (condition, params) = store.selector(&selector)?;
            let ids = store
                .pick(
                    &format!("({}) AND {condition}", store.inner.sql.dead()),
                    params,
                    u32::MAX,
                )
                .await?;
            store.delete_ids(&ids).await
        }
        .boxed()
    }

    fn count_replayable(
        &self,
        since: SystemTime,
        until: SystemTime,
        destination: Option<String>,
    ) -> BoxFuture<'static, StoreResult<u64>> {
        let store = self.clone();
        async move {
            let condition = store.replay_condition()?;
            let mut rows = store
                .rows(
                    "replay",
                    &format!(
                        "SELECT count(*) FROM {} o WHERE {condition}",
                        store.inner.sql.table()
                    ),
                    named(vec![
                        ("since", Value::from(micros(since))),
                        ("until", Value::from(micros(until))),
                        ("destination", destination.map_or(Value::NULL, Value::from)),
                    ]),
                )
                .await?;
            Ok(rows
                .pop()
                .and_then(|mut r| int(col(&mut r, 0)))
                .unwrap_or(0) as u64)
        }
        .boxed()
    }

    fn replay_batch(
        &self,
        since: SystemTime,
        until: SystemTime,
        destination: Option<String>,
        after: SequenceId,
        batch: u32,
    ) -> BoxFuture<'static, StoreResult<(u64, SequenceId)>> {
        let store = self.clone();
        async move {
            let sql = &store.inner.sql;
            let condition = format!(
                "{} AND {} > {after}",
                store.replay_condition()?,
                sql.id_column()
            );
            let ids = store
                .pick(
                    &condition,
                    vec![
                        ("since", Value::from(micros(since))),
                        ("until", Value::from(micros(until))),
                        ("destination", destination.map_or(Value::NULL, Value::from)),
                    ],
                    batch,
                )
                .await?;
            let last = ids
                .iter()
                .filter_map(|id| match id {
                    RowId::Integer(i) => Some(*i),
                    RowId::Uuid(_) => None,
                })
                .max()
                .unwrap_or(after);
            if ids.is_empty() {
                return Ok((0, after));
            }
            let set = sql.replay_set();
            let n = store
                .exec(
                    "replay",
                    &sql.update(&set, &format!("{} IN ({})", sql.id_column(), id_list(&ids))),
                    Params::Empty,
                )
                .await?;
            Ok((n, last))
        }
        .boxed()
    }

    fn count_prunable(
        &self,
        delivered_before: Option<SystemTime>,
        dead_before: Option<SystemTime>,
    ) -> BoxFuture<'static, StoreResult<(u64, u64)>> {
        let store = self.clone();
        async move {
            let sql = &store.inner.sql;
            let count = |condition: String, before: SystemTime| {
                let store = store.clone();
                async move {
                    let mut rows = store
                        .rows(
                            "prune",
                            &format!(
                                "SELECT count(*) FROM {} o WHERE {condition}",
                                store.inner.sql.table()
                            ),
                            named(vec![("before", Value::from(micros(before)))]),
                        )
                        .await?;
                    Ok::<u64, StoreError>(
                        rows.pop()
                            .and_then(|mut r| int(col(&mut r, 0)))
                            .unwrap_or(0) as u64,
                    )
                }
            };
            let mut out = (0, 0);
            if let (Some(before), Some(c)) = (delivered_before, store.prune_delivered_condition()) {
                out.0 = count(c, before).await?;
            }
            if let (Some(before), Some(time)) = (dead_before, sql.dead_time()) {
                out.1 = count(
                    format!("({}) AND {time} < {}", sql.dead(), store.at("before")),
                    before,
                )
                .await?;
            }
            Ok(out)
        }
        .boxed()
    }

    fn prune_delivered(
        &self,
        before: SystemTime,
        batch: u32,
    ) -> BoxFuture<'static, StoreResult<u64>> {
        let store = self.clone();
        async move {
            let Some(condition) = store.prune_delivered_condition() else {
                return Ok(0);
            };
            store.prune_where(&condition, before, batch).await
        }
        .boxed()
    }

    fn prune_dead(&self, before: SystemTime, batch: u32) -> BoxFuture<'static, StoreResult<u64>> {
        let store = self.clone();
        async move {
            let sql = &store.inner.sql;
            let Some(time) = sql.dead_time() else {
                return Ok(0);
            };
            let condition = format!("({}) AND {time} < {}", sql.dead(), store.at("before"));
            store.prune_where(&condition, before, batch).await
        }
        .boxed()
    }
}

impl MySqlStore {
    /// Deletes up to `batch` rows matching `condition` (which compares with `:before`).
    async fn prune_where(
        &self,
        condition: &str,
        before: SystemTime,
        batch: u32,
    ) -> StoreResult<u64> {
        let ids = self
            .pick(
                condition,
                vec![("before", Value::from(micros(before)))],
                batch,
            )
            .await?;
        self.delete_ids(&ids).await
    }

    fn prune_delivered_condition(&self) -> Option<String> {
        let sql = &self.inner.sql;
        Some(format!(
            "({}) AND {} < {}",
            sql.delivered()?,
            sql.delivered_time()?,
            self.at("before")
        ))
    }

    /// Whether this layout keeps the seed's own table (for `check`).
    pub fn seed(&self) -> Option<Seed> {
        self.inner.sql.mapping.seed
    }
}
