//! Mapped layouts on PostgreSQL: the seeds' own tables (Ably connector, Open Outbox Relay,
//! export) and custom column mappings.
//!
//! One relay per table is active at a time: it holds a session advisory lock on a dedicated
//! connection, and standby relays claim nothing until that connection is gone. On taking
//! over, the new active relay returns every row the previous one held to pending (counting
//! the attempt where the table counts them, so a poison event that kills relays ends dead).
//! What the table has no column for (attempts, the next attempt time, a lease) is kept in
//! memory; see ARCHITECTURE.md, "Mapped layouts".

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_core::store::{
    Backlog, ClaimRequest, Claimed, DeadLetter, DeadRecord, DeadSelector, DestinationStats,
    Incarnation, NodeRecord, NodeRegistry, OnChange, Operations, Problem, Registration, RetryLater,
    StoreResult,
};
use outbox_core::{Fence, NewEvent, NodeId, OutboxStore, SequenceId, StoreError, StoreErrorKind};
use outbox_layout::memory::{decode, derived_event_id, Memory, RawRow, RowId};
use outbox_layout::sql::Sql;
use outbox_layout::{IdType, Mapping, PayloadFormat, Seed};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;
use uuid::Uuid;

use crate::error::{db_error, pool_error};
use crate::{PgOptions, PgStore};
use outbox_core::ident::{Ident, TableName};

/// The channel the Ably connector's trigger notifies.
const ADBC_CHANNEL: &str = "ably_adbc";
use outbox_core::time::{from_micros, micros, millis};

/// How often a standby relay tries to become the active one, and the active one reaps.
const LEADER_RETRY: Duration = Duration::from_secs(1);

struct Leader {
    client: Option<tokio_postgres::Client>,
    last_try: Option<Instant>,
    last_reap: Option<Instant>,
}

pub(crate) struct MappedInner {
    sql: Sql,
    layout: String,
    default_max_attempts: i64,
    memory: Mutex<Memory>,
    leader: tokio::sync::Mutex<Leader>,
    claim_marks: String,
    claim_unmarked: String,
}

/// A PostgreSQL store over a mapped table. Cheap to clone.
#[derive(Clone)]
pub struct MappedPgStore {
    base: PgStore,
    inner: Arc<MappedInner>,
}

impl MappedPgStore {
    /// `layout` names the layout in logs; `notify_channel` is the channel the table's trigger
    /// signals [default: the one in `options`]; `max_attempts` applies where the table has no
    /// limit of its own.
    pub fn new(
        mut options: PgOptions,
        mapping: Mapping,
        layout: &str,
        notify_channel: Option<&str>,
        max_attempts: u32,
    ) -> StoreResult<Self> {
        // The wake-up (trigger, channel, gate key) is the native store's, about the mapped
        // table: the base store then LISTENs and gates exactly as it does for its own.
        options.tables.outbox = TableName::new(
            mapping.schema.as_deref().unwrap_or("public"),
            &mapping.table,
        )?;
        if let Some(channel) = notify_channel {
            options.tables.notify_channel = Ident::new(channel, "notify channel")?;
        }
        let sql = Sql::new(mapping, outbox_layout::Dialect::Postgres)?;
        let base = PgStore::new(options)?;
        let items = select_items(&sql);
        let aliased: Vec<String> = items
            .iter()
            .enumerate()
            .map(|(i, e)| format!("{e} AS c{i}"))
            .collect();
        let order: Vec<String> = sql
            .order_by()
            .split(", ")
            .enumerate()
            .map(|(i, e)| format!("{e} AS k{i}"))
            .collect();
        let columns: Vec<String> = (0..items.len()).map(|i| format!("c{i}")).collect();
        let order_keys: Vec<String> = (0..order.len()).map(|i| format!("k{i}")).collect();
        let t = sql.table();
        let id = sql.id_column();
        let id_array = match sql.mapping.id_type {
            IdType::Integer => "int8[]",
            IdType::Uuid => "uuid[]",
        };
        // `NOT IN (SELECT unnest(..))` probes a hash; `NOT (.. = ANY(..))` would compare each
        // scanned row with every element. Neither array holds NULL.
        let candidates = format!(
            "SELECT {id} AS id FROM {t} o
              WHERE {} AND {} NOT IN (SELECT unnest($2::text[]))
              ORDER BY {} LIMIT $1",
            sql.claimable(),
            sql.key_expr(),
            sql.order_by()
        );
        let claim_marks = format!(
            "WITH c AS ({candidates} FOR UPDATE SKIP LOCKED),
                  u AS (UPDATE {t} o SET {} FROM c
                         WHERE {id} = c.id AND $3::text IS NOT NULL AND $4::int8 >= 0
                         RETURNING {}, {})
             SELECT {} FROM u ORDER BY {}",
            sql.claim_set("$3::text", "$4").join(", "),
            aliased.join(", "),
            order.join(", "),
            columns.join(", "),
            order_keys.join(", ")
        );
        let claim_unmarked = format!(
            "SELECT {} FROM {t} o
              WHERE {} AND {} NOT IN (SELECT unnest($2::text[]))
                AND {id} NOT IN (SELECT unnest($3::{id_array}))
              ORDER BY {} LIMIT $1",
            sql.select_list(),
            sql.claimable(),
            sql.key_expr(),
            sql.order_by()
        );
        Ok(MappedPgStore {
            base,
            inner: Arc::new(MappedInner {
                sql,
                layout: layout.to_string(),
                default_max_attempts: max_attempts as i64,
                memory: Mutex::new(Memory::default()),
                leader: tokio::sync::Mutex::new(Leader {
                    client: None,
                    last_try: None,
                    last_reap: None,
                }),
                claim_marks,
                claim_unmarked,
            }),
        })
    }

    pub fn sql(&self) -> &Sql {
        &self.inner.sql
    }

    /// The seed's DDL (none for a custom mapping, whose table the application owns), the
    /// relay's side table if the layout needs one, and the wake-up trigger on the table.
    pub fn ddl(&self) -> String {
        let mut ddl = self.inner.sql.ddl().unwrap_or_default();
        if self.uses_nodes_table() {
            let nodes = self.base.tables().nodes.quoted();
            ddl.push_str(&format!(
                "CREATE SCHEMA IF NOT EXISTS {};\nCREATE TABLE IF NOT EXISTS {nodes} ( id TEXT PRIMARY KEY, expiry TIMESTAMP WITHOUT TIME ZONE NOT NULL );\n",
                self.base.tables().nodes.schema.quoted()
            ));
        }
        if !self.seed_trigger_suffices() {
            ddl.push_str(&self.base.tables().wakeup_ddl());
        }
        ddl
    }

    /// The Ably connector's own trigger (in its DDL) is the wake-up as long as the relay
    /// notifies on its channel; a gated or poll wake-up, or another channel, replaces its body.
    fn seed_trigger_suffices(&self) -> bool {
        let t = self.base.tables();
        self.inner.sql.mapping.seed == Some(Seed::Adbc)
            && !t.gated_wakeup
            && !t.poll_wakeup
            && t.notify_channel.as_str() == ADBC_CHANNEL
    }

    pub fn grants(&self, role: &str) -> String {
        let mut grants = format!(
            "-- The relay's run-time role for the {} layout.\n{}",
            self.inner.layout,
            self.inner.sql.grants(role)
        );
        if self.uses_nodes_table() {
            let nodes = self.base.tables().nodes.quoted();
            grants.push_str(&format!(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON {nodes} TO \"{role}\";\n"
            ));
        }
        grants
    }

    /// Only the Ably connector's layout has a nodes table; on the others the active-relay
    /// lock is the whole of the coordination, and nodes are not listed.
    fn uses_nodes_table(&self) -> bool {
        self.inner.sql.mapping.seed == Some(Seed::Adbc)
    }

    pub async fn migrate(&self) -> StoreResult<()> {
        self.base.apply_ddl(&self.ddl()).await
    }

    /// Runs arbitrary SQL (for tests and tools).
    pub async fn batch_execute(&self, sql: &str) -> StoreResult<()> {
        self.base.batch_execute(sql).await
    }

    /// True when this process is the table's active relay (for tests and `stats`).
    pub async fn is_active(&self) -> bool {
        let leader = self.inner.leader.lock().await;
        leader.client.as_ref().is_some_and(|c| !c.is_closed())
    }
}

fn select_items(sql: &Sql) -> Vec<String> {
    // select_list joins with ", " at the top level only; split the same way it was built.
    split_top_level(&sql.select_list())
}

fn split_top_level(list: &str) -> Vec<String> {
    let mut items = Vec::new();
    let mut depth = 0i32;
    let mut current = String::new();
    let mut quoted = false;
    for ch in list.chars() {
        match ch {
            '\'' => quoted = !quoted,
            '(' if !quoted => depth += 1,
            ')' if !quoted => depth -= 1,
            ',' if !quoted && depth == 0 => {
                items.push(current.trim().to_string());
                current.clear();
                continue;
            }
            _ => {}
        }
        current.push(ch);
    }
    if !current.trim().is_empty() {
        items.push(current.trim().to_string());
    }
    items
}

impl MappedInner {
    fn table_name(&self) -> String {
        match &self.sql.mapping.schema {
            Some(s) => format!("{s}.{}", self.sql.mapping.table),
            None => self.sql.mapping.table.clone(),
        }
    }
}

/// A PostgreSQL row in `select_list` order as plain values. Every column but the id is cast
/// to text or int8 by the statement, so only an id column whose type changed under the
/// relay fails, as a typed error that names it.
fn raw_row(row: &Row, mapping: &Mapping) -> StoreResult<RawRow> {
    let read_error = |index: usize, e: tokio_postgres::Error| {
        StoreError::new(
            StoreErrorKind::SchemaMismatch,
            format!(
                "claim: column {} of the mapped table cannot be read: {}",
                row.columns()[index].name(),
                outbox_core::error::report(&e)
            ),
        )
    };
    let id = match mapping.id_type {
        IdType::Integer => row.try_get(0).map(RowId::Integer),
        IdType::Uuid => row.try_get(0).map(RowId::Uuid),
    }
    .map_err(|e| read_error(0, e))?;
    let text = |index: usize| -> StoreResult<Option<String>> {
        row.try_get(index).map_err(|e| read_error(index, e))
    };
    let int = |index: usize| -> StoreResult<Option<i64>> {
        row.try_get(index).map_err(|e| read_error(index, e))
    };
    Ok(RawRow {
        id,
        event_id: text(1)?,
        destination: text(2)?,
        key: text(3)?,
        event_type: text(4)?,
        payload: match mapping.payload_format {
            PayloadFormat::Bytes => row.try_get(5).map_err(|e| read_error(5, e))?,
            _ => text(5)?.map(String::into_bytes),
        },
        headers: text(6)?,
        mutation_id: text(7)?,
        rejected: int(8)?,
        attempts: int(9)?,
        created_micros: int(10)?,
        max_attempts: int(11)?,
    })
}

/// Decodes a claimed row; a `created_at` no event can carry (see
/// [`outbox_core::time::created_at_problem`]) makes it undecodable.
fn decode_row(
    mapping: &Mapping,
    raw: RawRow,
    memory: &mut Memory,
    node: &str,
    lease: Duration,
) -> Claimed {
    let created_at_problem = raw
        .created_micros
        .and_then(outbox_core::time::created_at_problem);
    match (
        decode(mapping, raw, memory, node, lease),
        created_at_problem,
    ) {
        (Claimed::Event(event), Some(reason)) => Claimed::Undecodable {
            sequence_id: event.sequence_id,
            ordering_key: event.ordering_key().to_string(),
            destination: event.destination,
            attempts: event.attempts,
            reason,
        },
        (claimed, _) => claimed,
    }
}

/// Database ids for engine handles, as a bindable array.
enum Ids {
    Integer(Vec<i64>),
    Uuid(Vec<Uuid>),
}

impl Ids {
    fn param(&self) -> &(dyn ToSql + Sync) {
        match self {
            Ids::Integer(v) => v,
            Ids::Uuid(v) => v,
        }
    }

    fn len(&self) -> usize {
        match self {
            Ids::Integer(v) => v.len(),
            Ids::Uuid(v) => v.len(),
        }
    }
}

impl MappedPgStore {
    fn ids(&self, handles: &[SequenceId]) -> Ids {
        match self.inner.sql.mapping.id_type {
            IdType::Integer => Ids::Integer(handles.to_vec()),
            IdType::Uuid => {
                let memory = self.inner.memory.lock().expect("memory lock");
                Ids::Uuid(handles.iter().filter_map(|h| memory.uuid(*h)).collect())
            }
        }
    }

    fn id_array(&self) -> &'static str {
        match self.inner.sql.mapping.id_type {
            IdType::Integer => "int8[]",
            IdType::Uuid => "uuid[]",
        }
    }

    /// Rows that settled leave memory.
    fn settled(&self, handles: &[SequenceId], done: bool) {
        self.inner
            .memory
            .lock()
            .expect("memory lock")
            .settled(handles, done);
    }

    /// Becomes (or stays) the active relay; false when another relay is active.
    async fn ensure_active(&self, lease: Duration) -> StoreResult<bool> {
        let mut leader = self.inner.leader.lock().await;
        if leader.client.as_ref().is_some_and(|c| c.is_closed()) {
            tracing::warn!(layout = %self.inner.layout, "lost the connection holding the active-relay lock; claiming stops until it is taken again");
            leader.client = None;
        }
        if leader.client.is_none() {
            if leader.last_try.is_some_and(|t| t.elapsed() < LEADER_RETRY) {
                return Ok(false);
            }
            leader.last_try = Some(Instant::now());
            let base = &self.base.inner;
            let (client, connection) = base
                .config
                .connect(base.tls.clone())
                .await
                .map_err(|e| db_error("take the active-relay lock", e))?;
            tokio::spawn(async move {
                let _ = connection.await;
            });
            let key = format!("outbox-relay {}", self.inner.table_name());
            let row = client
                .query_one("SELECT pg_try_advisory_lock(hashtext($1))", &[&key])
                .await
                .map_err(|e| db_error("take the active-relay lock", e))?;
            if !row.get::<_, bool>(0) {
                return Ok(false);
            }
            leader.client = Some(client);
            *self.inner.memory.lock().expect("memory lock") = Memory::default();
            let reaped = self.reap(true, lease).await?;
            tracing::info!(layout = %self.inner.layout, table = %self.inner.table_name(), reaped, "this relay is now the table's active relay");
            leader.last_reap = Some(Instant::now());
        } else if leader.last_reap.is_none_or(|t| t.elapsed() >= lease / 2) {
            leader.last_reap = Some(Instant::now());
            let reaped = self.reap(false, lease).await?;
            if reaped > 0 {
                tracing::warn!(layout = %self.inner.layout, reaped, "returned rows with expired leases to pending");
            }
        }
        Ok(true)
    }

    /// Returns rows held by a gone relay to pending (or dead, on their last attempt).
    async fn reap(&self, all: bool, lease: Duration) -> StoreResult<u64> {
        let sql = &self.inner.sql;
        let max = self.inner.default_max_attempts;
        let lease = millis(lease);
        let mut total = 0;
        for to_dead in [true, false] {
            if let Some(statement) = sql.reap(to_dead, "$1::int8", "$2::bool", "$3::int8") {
                total +=
                    PgStore::execute(&self.base.inner, "reap", &statement, &[&max, &all, &lease])
                        .await?;
            }
        }
        Ok(total)
    }
}

impl OutboxStore for MappedPgStore {
    fn describe(&self) -> String {
        format!(
            "postgres {} ({} layout)",
            self.inner.table_name(),
            self.inner.layout
        )
    }

    fn claim(&self, request: ClaimRequest) -> BoxFuture<'static, StoreResult<Vec<Claimed>>> {
        let store = self.clone();
        async move {
            if !store.ensure_active(request.lease).await? {
                return Ok(Vec::new());
            }
            let inner = &store.inner;
            let (blocked, held) = {
                let mut memory = inner.memory.lock().expect("memory lock");
                (memory.blocked_keys(&request.node.0), memory.held())
            };
            let limit = request.limit as i64;
            let rows = if inner.sql.mapping.marks_claims() {
                let lease = millis(request.lease);
                PgStore::query(
                    &store.base.inner,
                    "claim",
                    &inner.claim_marks,
                    &[&limit, &blocked, &request.node.0, &lease],
                )
                .await?
            } else {
                let held = store.ids(&held);
                PgStore::query(
                    &store.base.inner,
                    "claim",
                    &inner.claim_unmarked,
                    &[&limit, &blocked, held.param()],
                )
                .await?
            };
            let raw = rows
                .iter()
                .map(|r| raw_row(r, &inner.sql.mapping))
                .collect::<StoreResult<Vec<_>>>()?;
            let mut memory = inner.memory.lock().expect("memory lock");
            Ok(raw
                .into_iter()
                .map(|raw| {
                    decode_row(
                        &inner.sql.mapping,
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
            let db_ids = store.ids(&ids);
            let statement = store
                .inner
                .sql
                .ack(&format!("= ANY($1::{})", store.id_array()), "$2::text");
            let n = PgStore::execute(
                &store.base.inner,
                "ack",
                &statement,
                &[db_ids.param(), &node.0],
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
            let handles: Vec<i64> = retries.iter().map(|r| r.sequence_id).collect();
            let set = store
                .inner
                .sql
                .retry_set("u.attempts", "u.error", "u.delay_ms");
            let n = if set.is_empty() || store.ids(&handles).len() == 0 {
                retries.len() as u64
            } else {
                let db_ids = store.ids(&handles);
                let attempts: Vec<i32> = retries
                    .iter()
                    .map(|r| i32::try_from(r.attempts).unwrap_or(i32::MAX))
                    .collect();
                let errors: Vec<&str> = retries.iter().map(|r| r.error.as_str()).collect();
                let delays: Vec<i64> = retries.iter().map(|r| millis(r.delay)).collect();
                let statement = format!(
                    "UPDATE {t} o SET {set} FROM unnest($1::{arr}, $3::int4[], $4::text[], $5::int8[])
                        AS u(id, attempts, error, delay_ms)
                      WHERE {id} = u.id AND {fence}",
                    t = store.inner.sql.table(),
                    set = set.join(", "),
                    arr = store.id_array(),
                    id = store.inner.sql.id_column(),
                    fence = store.inner.sql.fence("$2::text"),
                );
                PgStore::execute(
                    &store.base.inner,
                    "retry",
                    &statement,
                    &[db_ids.param(), &node.0, &attempts, &errors, &delays],
                )
                .await?
            };
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
            let handles: Vec<i64> = entries.iter().map(|e| e.sequence_id).collect();
            let db_ids = store.ids(&handles);
            let attempts: Vec<i32> = entries
                .iter()
                .map(|e| i32::try_from(e.attempts).unwrap_or(i32::MAX))
                .collect();
            let errors: Vec<&str> = entries.iter().map(|e| e.error.as_str()).collect();
            let unnest = format!(
                "unnest($1::{}, $3::int4[], $4::text[]) AS u(id, attempts, error)",
                store.id_array()
            );
            let statement = if sql.mapping.dead_state() == outbox_layout::DeadState::SideTable {
                format!(
                    "INSERT INTO {dl} (id, attempts, last_error)
                     SELECT u.id, u.attempts, u.error FROM {unnest}
                      WHERE EXISTS (SELECT 1 FROM {t} o WHERE {id} = u.id AND {fence})
                     ON CONFLICT (id) DO NOTHING",
                    dl = sql.dead_table(),
                    t = sql.table(),
                    id = sql.id_column(),
                    fence = sql.fence("$2::text"),
                )
            } else {
                format!(
                    "UPDATE {t} o SET {set} FROM {unnest} WHERE {id} = u.id AND {fence}",
                    t = sql.table(),
                    set = sql.dead_set("u.attempts", "u.error").join(", "),
                    id = sql.id_column(),
                    fence = sql.fence("$2::text"),
                )
            };
            let n = PgStore::execute(
                &store.base.inner,
                "dead-letter",
                &statement,
                &[db_ids.param(), &node.0, &attempts, &errors],
            )
            .await?;
            store.settled(&handles, true);
            Ok(n)
        }
        .boxed()
    }

    fn release(&self, node: NodeId, ids: Vec<SequenceId>) -> BoxFuture<'static, StoreResult<u64>> {
        let store = self.clone();
        async move {
            let statement = store
                .inner
                .sql
                .release(&format!("= ANY($1::{})", store.id_array()), "$2::text");
            let n = match statement {
                Some(statement) => {
                    let db_ids = store.ids(&ids);
                    PgStore::execute(
                        &store.base.inner,
                        "release",
                        &statement,
                        &[db_ids.param(), &node.0],
                    )
                    .await?
                }
                None => ids.len() as u64,
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
            store
                .inner
                .memory
                .lock()
                .expect("memory lock")
                .extend(&ids, lease);
            let statement = store.inner.sql.extend(
                &format!("= ANY($1::{})", store.id_array()),
                "$2::text",
                "$3::int8",
            );
            match statement {
                Some(statement) => {
                    let db_ids = store.ids(&ids);
                    let lease = millis(lease);
                    PgStore::execute(
                        &store.base.inner,
                        "extend leases",
                        &statement,
                        &[db_ids.param(), &node.0, &lease],
                    )
                    .await
                }
                None => Ok(ids.len() as u64),
            }
        }
        .boxed()
    }

    fn backlog(&self) -> BoxFuture<'static, StoreResult<Backlog>> {
        let store = self.clone();
        async move {
            let rows = PgStore::query(
                &store.base.inner,
                "backlog",
                &store.inner.sql.stats(false),
                &[],
            )
            .await?;
            let row = &rows[0];
            Ok(Backlog {
                pending: row.get::<_, i64>(0) as u64,
                retrying: row.get::<_, i64>(1) as u64,
                dead: row.get::<_, i64>(2) as u64,
                oldest_pending_age: row
                    .get::<_, Option<i64>>(3)
                    .map(|ms| Duration::from_millis(ms.max(0) as u64)),
            })
        }
        .boxed()
    }

    fn insert(&self, events: Vec<NewEvent>) -> BoxFuture<'static, StoreResult<Vec<SequenceId>>> {
        let store = self.clone();
        async move { insert(&store, events).await }.boxed()
    }

    fn ping(&self) -> BoxFuture<'static, StoreResult<()>> {
        self.base.ping()
    }

    fn verify(&self) -> BoxFuture<'static, StoreResult<Vec<Problem>>> {
        let store = self.clone();
        async move { verify(&store).await }.boxed()
    }

    fn subscribe(&self, on_change: OnChange) -> Option<BoxFuture<'static, ()>> {
        // The base store listens on this table's channel, and gates it (see `new`).
        self.base.subscribe(on_change)
    }

    fn set_waiting(&self, waiting: bool) {
        self.base.set_waiting(waiting);
    }
}

/// Inserts events the way an application would, converting each value to the column's type.
async fn insert(store: &MappedPgStore, events: Vec<NewEvent>) -> StoreResult<Vec<SequenceId>> {
    let m = &store.inner.sql.mapping;
    let sql = &store.inner.sql;
    let mut columns: Vec<&str> = vec![&m.destination, &m.payload];
    if let Some(c) = &m.key {
        columns.push(c);
    }
    if let Some(c) = m.event_type.as_ref().filter(|c| **c != m.destination) {
        columns.push(c);
    }
    for c in [&m.headers, &m.mutation_id, &m.event_id]
        .into_iter()
        .flatten()
    {
        columns.push(c);
    }
    let placeholders: Vec<String> = (1..=columns.len()).map(|i| format!("${i}")).collect();
    let statement_text = format!(
        "INSERT INTO {} ({}) VALUES ({}) RETURNING {}",
        sql.table(),
        columns
            .iter()
            .map(|c| sql.quote(c))
            .collect::<Vec<_>>()
            .join(", "),
        placeholders.join(", "),
        sql.quote(&m.id)
    );
    let client = store
        .base
        .inner
        .pool
        .get()
        .await
        .map_err(|e| pool_error("insert", e))?;
    let statement = client
        .prepare_cached(&statement_text)
        .await
        .map_err(|e| db_error("insert", e))?;
    let mut ids = Vec::with_capacity(events.len());
    for event in events {
        let event_id = event.event_id.unwrap_or_else(Uuid::new_v4);
        let mut values: Vec<Option<String>> =
            vec![Some(event.destination.clone()), event.payload.clone()];
        if m.key.is_some() {
            values.push(event.partition_key.clone());
        }
        if m.event_type.as_ref().is_some_and(|c| *c != m.destination) {
            values.push(Some(event.event_type.clone()));
        }
        if m.headers.is_some() {
            values.push(Some(
                serde_json::to_string(&event.headers).unwrap_or_else(|_| "{}".into()),
            ));
        }
        if m.mutation_id.is_some() {
            values.push(Some(
                event
                    .mutation_id
                    .clone()
                    .unwrap_or_else(|| event_id.to_string()),
            ));
        }
        if m.event_id.is_some() {
            values.push(Some(event_id.to_string()));
        }
        let params: Vec<Box<dyn ToSql + Sync + Send>> = statement
            .params()
            .iter()
            .zip(values)
            .map(|(ty, v)| typed(ty, v))
            .collect::<Result<_, _>>()?;
        let refs: Vec<&(dyn ToSql + Sync)> = params
            .iter()
            .map(|p| p.as_ref() as &(dyn ToSql + Sync))
            .collect();
        let row = client
            .query_one(&statement, &refs)
            .await
            .map_err(|e| db_error("insert", e))?;
        ids.push(match m.id_type {
            IdType::Integer => match row.columns()[0].type_() {
                &Type::INT4 => row.get::<_, i32>(0) as i64,
                _ => row.get::<_, i64>(0),
            },
            IdType::Uuid => 0,
        });
    }
    Ok(ids)
}

/// A text value bound as the column's type.
fn typed(ty: &Type, value: Option<String>) -> StoreResult<Box<dyn ToSql + Sync + Send>> {
    let bad = |e: String| StoreError::new(StoreErrorKind::Config, e);
    Ok(match (ty, value) {
        (_, None) if *ty == Type::JSON || *ty == Type::JSONB => Box::new(None::<serde_json::Value>),
        (_, None) if *ty == Type::BYTEA => Box::new(None::<Vec<u8>>),
        (_, None) => Box::new(None::<String>),
        (t, Some(v)) if *t == Type::JSON || *t == Type::JSONB => Box::new(
            serde_json::from_str::<serde_json::Value>(&v)
                .map_err(|e| bad(format!("payload or headers are not JSON: {e}")))?,
        ),
        (t, Some(v)) if *t == Type::BYTEA => Box::new(v.into_bytes()),
        (t, Some(v)) if *t == Type::UUID => {
            Box::new(Uuid::parse_str(&v).map_err(|e| bad(format!("{v:?} is not a UUID: {e}")))?)
        }
        (t, Some(v)) if *t == Type::INT2 => Box::new(
            v.parse::<i16>()
                .map_err(|e| bad(format!("{v:?} is not a smallint: {e}")))?,
        ),
        (t, Some(v)) if *t == Type::INT4 => Box::new(
            v.parse::<i32>()
                .map_err(|e| bad(format!("{v:?} is not an integer: {e}")))?,
        ),
        (t, Some(v)) if *t == Type::INT8 => Box::new(
            v.parse::<i64>()
                .map_err(|e| bad(format!("{v:?} is not a bigint: {e}")))?,
        ),
        (_, Some(v)) => Box::new(v),
    })
}

async fn verify(store: &MappedPgStore) -> StoreResult<Vec<Problem>> {
    crate::refuse_standby(&store.base.inner).await?;
    let sql = &store.inner.sql;
    let m = &sql.mapping;
    let schema = m.schema.clone().unwrap_or_else(|| "public".into());
    let mut problems = Vec::new();
    let fix = if m.seed.is_some() {
        format!(
            "run `outbox-relay migrate --layout {}` (or apply `outbox-relay migrate --layout {} --print`)",
            store.inner.layout, store.inner.layout
        )
    } else {
        "check the [mapping] section of the configuration against the table".to_string()
    };
    let rows = PgStore::query(
        &store.base.inner,
        "verify",
        "SELECT column_name::text FROM information_schema.columns WHERE table_schema = $1 AND table_name = $2",
        &[&schema, &m.table],
    )
    .await?;
    let present: HashSet<String> = rows.iter().map(|r| r.get(0)).collect();
    if present.is_empty() {
        problems.push(Problem {
            what: format!(
                "table {schema}.{} does not exist (or the role cannot see it)",
                m.table
            ),
            fix,
        });
        return Ok(problems);
    }
    for column in m.columns() {
        if !present.contains(column) {
            problems.push(Problem {
                what: format!(
                    "table {schema}.{} has no column {column:?}, which the {} layout maps",
                    m.table, store.inner.layout
                ),
                fix: fix.clone(),
            });
        }
    }
    let needed = if m.retains_delivered() {
        "SELECT, UPDATE"
    } else {
        "SELECT, UPDATE, DELETE"
    };
    let table = sql.table();
    for privilege in needed.split(", ") {
        let rows = PgStore::query(
            &store.base.inner,
            "verify",
            "SELECT has_table_privilege(current_user, $1, $2)",
            &[&table, &privilege],
        )
        .await?;
        if !rows[0].get::<_, bool>(0) {
            problems.push(Problem {
                what: format!("the current role lacks {privilege} on {table}"),
                fix: format!(
                    "GRANT {privilege} ON {table} TO <relay role>; (see `outbox-relay migrate --layout {} --print`)",
                    store.inner.layout
                ),
            });
        }
    }
    // Every layout's table wakes the relay through the same trigger as the native one.
    let trigger = format!("{}_trigger", m.table);
    let fix = format!(
        "run `outbox-relay migrate --layout {}` (or apply `outbox-relay migrate --layout {} --print`)",
        store.inner.layout, store.inner.layout
    );
    problems
        .extend(crate::missing_trigger(&store.base.inner, &trigger, &table, &table, &fix).await?);
    Ok(problems)
}

/// Layouts without a nodes table keep no membership: one active relay holds the table's lock.
impl NodeRegistry for MappedPgStore {
    fn register(
        &self,
        node: NodeId,
        ttl: Duration,
    ) -> BoxFuture<'static, StoreResult<Registration>> {
        if !self.uses_nodes_table() {
            return futures::future::ready(Ok(Registration::Registered(Incarnation(0)))).boxed();
        }
        self.base.register(node, ttl)
    }

    fn heartbeat(
        &self,
        node: NodeId,
        last: Incarnation,
        ttl: Duration,
    ) -> BoxFuture<'static, StoreResult<Option<Incarnation>>> {
        if !self.uses_nodes_table() {
            return futures::future::ready(Ok(Some(last))).boxed();
        }
        self.base.heartbeat(node, last, ttl)
    }

    fn remove_expired(&self) -> BoxFuture<'static, StoreResult<u64>> {
        if !self.uses_nodes_table() {
            return futures::future::ready(Ok(0)).boxed();
        }
        self.base.remove_expired()
    }

    fn deregister(&self, node: NodeId, last: Incarnation) -> BoxFuture<'static, StoreResult<()>> {
        if !self.uses_nodes_table() {
            return futures::future::ready(Ok(())).boxed();
        }
        self.base.deregister(node, last)
    }

    fn live_nodes(&self) -> BoxFuture<'static, StoreResult<Vec<NodeRecord>>> {
        if !self.uses_nodes_table() {
            return futures::future::ready(Ok(Vec::new())).boxed();
        }
        self.base.live_nodes()
    }
}

impl MappedPgStore {
    /// A timestamp parameter as the table's timestamp columns hold it.
    fn at(&self, placeholder: &str) -> String {
        if self.inner.sql.mapping.utc_timestamps {
            format!("(to_timestamp({placeholder}::int8::float8 / 1e6) AT TIME ZONE 'UTC')")
        } else {
            format!("to_timestamp({placeholder}::int8::float8 / 1e6)")
        }
    }

    fn unsupported(&self, what: &str) -> StoreError {
        StoreError::new(
            StoreErrorKind::Config,
            format!("the {} layout {what}", self.inner.layout),
        )
    }

    /// The condition and parameter selecting dead rows for `dead retry` / `dead purge`.
    fn selector(
        &self,
        selector: &DeadSelector,
    ) -> StoreResult<(String, Box<dyn ToSql + Sync + Send>)> {
        let sql = &self.inner.sql;
        Ok(match selector {
            DeadSelector::Ids(ids) => match sql.mapping.id_type {
                IdType::Integer => (
                    format!("{} = ANY($1::int8[])", sql.id_column()),
                    Box::new(ids.clone()),
                ),
                IdType::Uuid => {
                    return Err(self.unsupported(
                        "has UUID row ids: select dead events with --destination or --all",
                    ))
                }
            },
            DeadSelector::Destination(d) => (
                format!("{} = $1", sql.destination_text()),
                Box::new(d.clone()),
            ),
            DeadSelector::All => ("$1::bool".into(), Box::new(true)),
        })
    }
}

impl Operations for MappedPgStore {
    fn destination_stats(&self) -> BoxFuture<'static, StoreResult<Vec<DestinationStats>>> {
        let store = self.clone();
        async move {
            let rows = PgStore::query(
                &store.base.inner,
                "stats",
                &store.inner.sql.stats(true),
                &[],
            )
            .await?;
            Ok(rows
                .iter()
                .map(|r| DestinationStats {
                    destination: r.get(0),
                    pending: r.get::<_, i64>(1) as u64,
                    retrying: r.get::<_, i64>(2) as u64,
                    dead: r.get::<_, i64>(3) as u64,
                    oldest_pending_age: r
                        .get::<_, Option<i64>>(4)
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
            let limit = limit as i64;
            let (statement, rows) = match &destination {
                Some(d) => {
                    let s = store.inner.sql.dead_list(Some("$2"), "$1");
                    let rows =
                        PgStore::query(&store.base.inner, "dead list", &s, &[&limit, d]).await?;
                    (s, rows)
                }
                None => {
                    let s = store.inner.sql.dead_list(None, "$1");
                    let rows =
                        PgStore::query(&store.base.inner, "dead list", &s, &[&limit]).await?;
                    (s, rows)
                }
            };
            let _ = statement;
            Ok(rows
                .iter()
                .map(|r| {
                    let id: String = r.get(0);
                    DeadRecord {
                        sequence_id: id.parse().unwrap_or(0),
                        event_id: r
                            .get::<_, Option<String>>(1)
                            .and_then(|t| Uuid::parse_str(&t).ok())
                            .unwrap_or_else(|| derived_event_id(&store.inner.sql.mapping, &id)),
                        destination: r.get(2),
                        event_type: r.get(3),
                        attempts: r.get::<_, Option<i64>>(4).unwrap_or(0).max(0) as u32,
                        last_error: r.get::<_, Option<String>>(5).unwrap_or_else(|| {
                            "(this layout has no column for the error: see the relay's log)".into()
                        }),
                        dead_at: r.get::<_, Option<i64>>(6).map_or(UNIX_EPOCH, from_micros),
                    }
                })
                .collect())
        }
        .boxed()
    }

    fn dead_retry(&self, selector: DeadSelector) -> BoxFuture<'static, StoreResult<u64>> {
        let store = self.clone();
        async move {
            let (condition, param) = store.selector(&selector)?;
            let sql = &store.inner.sql;
            let statement = match sql.dead_retry(&condition) {
                Some(s) => s,
                None => format!(
                    "DELETE FROM {dl} WHERE id IN (SELECT {id} FROM {t} o WHERE {condition})",
                    dl = sql.dead_table(),
                    id = sql.id_column(),
                    t = sql.table()
                ),
            };
            PgStore::execute(
                &store.base.inner,
                "dead retry",
                &statement,
                &[param.as_ref()],
            )
            .await
        }
        .boxed()
    }

    fn dead_purge(&self, selector: DeadSelector) -> BoxFuture<'static, StoreResult<u64>> {
        let store = self.clone();
        async move {
            let (condition, param) = store.selector(&selector)?;
            let sql = &store.inner.sql;
            let statement = if sql.mapping.dead_state() == outbox_layout::DeadState::SideTable {
                format!(
                    "WITH gone AS (DELETE FROM {t} o WHERE ({dead}) AND {condition} RETURNING {id} AS id)
                     DELETE FROM {dl} WHERE id IN (SELECT id FROM gone)",
                    t = sql.table(),
                    dead = sql.dead(),
                    id = sql.id_column(),
                    dl = sql.dead_table(),
                )
            } else {
                format!(
                    "DELETE FROM {} o WHERE ({}) AND {condition}",
                    sql.table(),
                    sql.dead()
                )
            };
            PgStore::execute(&store.base.inner, "dead purge", &statement, &[param.as_ref()]).await
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
            let (condition, _) = store.replay_condition()?;
            let statement = format!(
                "SELECT count(*)::int8 FROM {} o WHERE {condition} AND ($3::text IS NULL OR {} = $3)",
                store.inner.sql.table(),
                store.inner.sql.destination_text()
            );
            let rows = PgStore::query(
                &store.base.inner,
                "replay",
                &statement,
                &[&micros(since), &micros(until), &destination],
            )
            .await?;
            Ok(rows[0].get::<_, i64>(0) as u64)
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
            let (condition, id) = store.replay_condition()?;
            let sql = &store.inner.sql;
            let statement = format!(
                "WITH b AS (SELECT {id} AS id FROM {t} o
                             WHERE {condition} AND ($3::text IS NULL OR {dest} = $3) AND {id} > $4
                             ORDER BY {id} LIMIT $5)
                 UPDATE {t} o SET {set} FROM b WHERE {id} = b.id RETURNING ({id})::int8",
                t = sql.table(),
                dest = sql.destination_text(),
                set = sql.replay_set().join(", "),
            );
            let batch = batch as i64;
            let rows = PgStore::query(
                &store.base.inner,
                "replay",
                &statement,
                &[&micros(since), &micros(until), &destination, &after, &batch],
            )
            .await?;
            let last = rows
                .iter()
                .map(|r| r.get::<_, i64>(0))
                .max()
                .unwrap_or(after);
            Ok((rows.len() as u64, last))
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
            let mut counts = (0, 0);
            if let (Some(before), Some((condition, _))) =
                (delivered_before, store.prune_delivered_condition())
            {
                counts.0 = store.count(&condition, micros(before)).await?;
            }
            if let (Some(before), Some(condition)) = (dead_before, store.prune_dead_condition()) {
                counts.1 = store.count(&condition, micros(before)).await?;
            }
            Ok(counts)
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
            let Some((condition, _)) = store.prune_delivered_condition() else {
                return Ok(0);
            };
            store
                .delete_batch(&condition, micros(before), batch, false)
                .await
        }
        .boxed()
    }

    fn prune_dead(&self, before: SystemTime, batch: u32) -> BoxFuture<'static, StoreResult<u64>> {
        let store = self.clone();
        async move {
            let Some(condition) = store.prune_dead_condition() else {
                return Ok(0);
            };
            let side = store.inner.sql.mapping.dead_state() == outbox_layout::DeadState::SideTable;
            store
                .delete_batch(&condition, micros(before), batch, side)
                .await
        }
        .boxed()
    }
}

impl MappedPgStore {
    /// Delivered rows created in `[$1, $2)` µs; and the integer id column.
    fn replay_condition(&self) -> StoreResult<(String, String)> {
        let sql = &self.inner.sql;
        let delivered = sql.delivered().ok_or_else(|| {
            self.unsupported("deletes delivered rows: there is nothing to replay")
        })?;
        let created = sql.created_at().ok_or_else(|| {
            self.unsupported("has no creation time column: replay cannot select by time")
        })?;
        if sql.mapping.id_type != IdType::Integer {
            return Err(self.unsupported("has UUID row ids: replay it with SQL, e.g. UPDATE ... SET status = 'PENDING' WHERE created_at >= ..."));
        }
        Ok((
            format!(
                "({delivered}) AND {created} >= {} AND {created} < {}",
                self.at("$1"),
                self.at("$2")
            ),
            sql.id_column(),
        ))
    }

    fn prune_delivered_condition(&self) -> Option<(String, ())> {
        let sql = &self.inner.sql;
        let delivered = sql.delivered()?;
        let time = sql.delivered_time()?;
        Some((format!("({delivered}) AND {time} < {}", self.at("$1")), ()))
    }

    fn prune_dead_condition(&self) -> Option<String> {
        let sql = &self.inner.sql;
        let time = sql.dead_time()?;
        Some(format!("({}) AND {time} < {}", sql.dead(), self.at("$1")))
    }

    async fn count(&self, condition: &str, before: i64) -> StoreResult<u64> {
        let statement = format!(
            "SELECT count(*)::int8 FROM {} o WHERE {condition}",
            self.inner.sql.table()
        );
        let rows = PgStore::query(&self.base.inner, "prune", &statement, &[&before]).await?;
        Ok(rows[0].get::<_, i64>(0) as u64)
    }

    async fn delete_batch(
        &self,
        condition: &str,
        before: i64,
        batch: u32,
        side_table: bool,
    ) -> StoreResult<u64> {
        let sql = &self.inner.sql;
        let t = sql.table();
        let id = sql.id_column();
        let pick = format!("SELECT {id} FROM {t} o WHERE {condition} LIMIT $2");
        let statement = if side_table {
            format!(
                "WITH gone AS (DELETE FROM {t} d WHERE d.{q} IN ({pick}) RETURNING d.{q} AS id)
                 DELETE FROM {dl} WHERE id IN (SELECT id FROM gone)",
                q = sql.quote(&sql.mapping.id),
                dl = sql.dead_table()
            )
        } else {
            format!(
                "DELETE FROM {t} d WHERE d.{} IN ({pick})",
                sql.quote(&sql.mapping.id)
            )
        };
        let batch = batch as i64;
        PgStore::execute(&self.base.inner, "prune", &statement, &[&before, &batch]).await
    }
}
