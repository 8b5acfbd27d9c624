//! Mapped layouts on PostgreSQL: the seeds' own tables (Ably connector, Open Outbox Relay,
//! export) and custom column mappings, run by [`outbox_layout::store::MappedStore`]. This is
//! its database part: the active-relay lock (a session advisory lock on a dedicated
//! connection), binding parameters as PostgreSQL arrays and values, the one-statement claim,
//! and the wake-up, which is the native store's (LISTEN and gate) about the mapped table.

use std::future::Future;
use std::time::Duration;

use futures::future::BoxFuture;
use outbox_core::ident::TableName;
use outbox_core::store::{NodeRegistry, OnChange, Problem, StoreResult};
use outbox_core::{OutboxStore, SequenceId, StoreError, StoreErrorKind};
use outbox_layout::memory::{RawRow, RowId};
use outbox_layout::params::{Params, Value};
use outbox_layout::sql::Sql;
use outbox_layout::store::{Claim, MappedDb, MappedStore, Opened};
use outbox_layout::{Dialect, IdType, Mapping, PayloadFormat, Seed};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;
use uuid::Uuid;

use crate::error::{db_error, pool_error};
use crate::{PgOptions, PgStore};

/// The channel the Ably connector's trigger notifies.
const ADBC_CHANNEL: &str = "ably_adbc";

/// A PostgreSQL store over a mapped table. Cheap to clone.
pub type MappedPgStore = MappedStore<MappedPg>;

/// What [`MappedPgStore::new`] needs.
pub struct MappedPgOptions {
    /// The connection; its tables' notify channel is the one the table's trigger signals.
    pub pg: PgOptions,
    pub mapping: Mapping,
    /// The layout's name, for logs and fixes.
    pub layout: String,
    /// Where the table has no attempt limit of its own.
    pub max_attempts: u32,
}

/// The PostgreSQL part of [`MappedPgStore`].
pub struct MappedPg {
    /// The native store about the mapped table: pool, LISTEN, gate, and (Ably connector)
    /// the nodes table.
    base: PgStore,
    seed: Option<Seed>,
}

type Bound = Vec<Box<dyn ToSql + Sync + Send>>;

fn bind(params: Params) -> Bound {
    params
        .into_values()
        .into_iter()
        .map(|value| -> Box<dyn ToSql + Sync + Send> {
            match value {
                Value::Bool(b) => Box::new(b),
                Value::Int(i) => Box::new(i),
                Value::Text(t) => Box::new(t),
                Value::Uuid(u) => Box::new(u),
                Value::Ints(v) => Box::new(v),
                Value::Uuids(v) => Box::new(v),
                Value::Texts(v) => Box::new(v),
            }
        })
        .collect()
}

fn refs(bound: &Bound) -> Vec<&(dyn ToSql + Sync)> {
    bound
        .iter()
        .map(|p| p.as_ref() as &(dyn ToSql + Sync))
        .collect()
}

impl MappedPg {
    fn inner(&self) -> &crate::Inner {
        &self.base.inner
    }

    /// Only the Ably connector's layout has a nodes table.
    fn uses_nodes_table(&self) -> bool {
        self.seed == Some(Seed::Adbc)
    }

    /// The Ably connector's own trigger (in its DDL) is the wake-up as long as the relay
    /// notifies on its channel; a gated or poll wake-up, or another channel, replaces its body.
    fn seed_trigger_suffices(&self) -> bool {
        let t = self.base.tables();
        self.seed == Some(Seed::Adbc)
            && !t.gated_wakeup
            && !t.poll_wakeup
            && t.notify_channel.as_str() == ADBC_CHANNEL
    }
}

impl MappedDb for MappedPg {
    type Options = MappedPgOptions;
    type Row = Row;
    type Lock = tokio_postgres::Client;
    const DIALECT: Dialect = Dialect::Postgres;
    const NAME: &'static str = "postgres";
    /// A closed connection is known without a round trip.
    const LOCK_CHECK_INTERVAL: Duration = Duration::ZERO;

    fn open(options: MappedPgOptions) -> StoreResult<Opened<Self>> {
        let MappedPgOptions {
            mut pg,
            mapping,
            layout,
            max_attempts,
        } = options;
        // The wake-up (trigger, channel, gate key) is the native store's, about the mapped
        // table: the base store then LISTENs and gates exactly as it does for its own.
        pg.tables.outbox = TableName::new(
            mapping.schema.as_deref().unwrap_or("public"),
            &mapping.table,
        )?;
        // A seed's nodes table gets none of the native steps.
        pg.tables.native_nodes = false;
        Ok(Opened {
            db: MappedPg {
                base: PgStore::new(pg)?,
                seed: mapping.seed,
            },
            mapping,
            layout,
            max_attempts,
        })
    }

    async fn take_lock(&self, mapping: &Mapping) -> StoreResult<Option<Self::Lock>> {
        let inner = self.inner();
        let opened = std::time::Instant::now();
        let (client, connection) = inner
            .config
            .connect(inner.tls.clone())
            .await
            .map_err(|e| db_error("take the active-relay lock", e))?;
        // The session ends (and the lock with it) once the server refuses new connections: a
        // smart shutdown waits for it too (see `shutdown_watch`).
        let mut refused = inner.refused.subscribe();
        tokio::spawn(async move {
            tokio::select! {
                _ = connection => {}
                _ = refused.wait_for(|since| since.is_some_and(|at| at > opened)) => {}
            }
        });
        crate::hold_waiting_session(&client, &inner.config).await;
        let table = match &mapping.schema {
            Some(s) => format!("{s}.{}", mapping.table),
            None => mapping.table.clone(),
        };
        let row = client
            .query_one(
                "SELECT pg_try_advisory_lock(hashtext($1))",
                &[&format!("outbox-relay {table}")],
            )
            .await
            .map_err(|e| db_error("take the active-relay lock", e))?;
        Ok(row.get::<_, bool>(0).then_some(client))
    }

    async fn lock_alive(&self, lock: &mut Self::Lock) -> bool {
        !lock.is_closed()
    }

    async fn query(
        &self,
        context: &'static str,
        statement: String,
        params: Params,
    ) -> StoreResult<Vec<Row>> {
        let bound = bind(params);
        PgStore::query(self.inner(), context, &statement, &refs(&bound)).await
    }

    async fn execute(
        &self,
        context: &'static str,
        statement: String,
        params: Params,
    ) -> StoreResult<u64> {
        let bound = bind(params);
        PgStore::execute(self.inner(), context, &statement, &refs(&bound)).await
    }

    /// One transaction, the executions pipelined on its connection.
    async fn execute_each(
        &self,
        context: &'static str,
        statement: String,
        rows: Vec<Params>,
    ) -> StoreResult<u64> {
        let inner = self.inner();
        let bound: Vec<Bound> = rows.into_iter().map(bind).collect();
        crate::bounded(inner, context, async {
            let mut client = inner.pool.get().await.map_err(|e| pool_error(context, e))?;
            let tx = client
                .transaction()
                .await
                .map_err(|e| db_error(context, e))?;
            let prepared = tx
                .prepare_cached(&statement)
                .await
                .map_err(|e| PgStore::statement_error(inner, context, e))?;
            let refs: Vec<_> = bound.iter().map(refs).collect();
            let counts =
                futures::future::try_join_all(refs.iter().map(|r| tx.execute(&prepared, r)))
                    .await
                    .map_err(|e| PgStore::statement_error(inner, context, e))?;
            tx.commit().await.map_err(|e| db_error(context, e))?;
            Ok(counts.iter().sum())
        })
        .await
    }

    /// One statement: the rows are selected, locked and marked together.
    async fn claim(&self, sql: &Sql, claim: Claim) -> StoreResult<Vec<Row>> {
        let mut params = claim.params;
        let limit = params.int(claim.limit);
        let Some((node, lease)) = claim.mark else {
            // Nothing to mark: the active relay excludes what it holds, nobody else claims.
            let statement = sql.claim_select(&claim.condition, &limit, false);
            return self.query("claim", statement, params).await;
        };
        let (node, lease) = (params.text(node), params.int(lease));
        let statement = sql.claim_and_mark(&claim.condition, &limit, &node, &lease);
        let mut rows = self.query("claim", statement, params).await?;
        let order = sql.claim_order_column();
        rows.sort_by_key(|row| Self::int(row, order));
        Ok(rows)
    }

    async fn insert(
        &self,
        statement: String,
        values: Vec<Option<String>>,
    ) -> StoreResult<SequenceId> {
        let client = self
            .inner()
            .pool
            .get()
            .await
            .map_err(|e| pool_error("insert", e))?;
        let prepared = client
            .prepare_cached(&statement)
            .await
            .map_err(|e| db_error("insert", e))?;
        let params: Bound = prepared
            .params()
            .iter()
            .zip(values)
            .map(|(ty, v)| typed(ty, v))
            .collect::<Result<_, _>>()?;
        let row = client
            .query_one(&prepared, &refs(&params))
            .await
            .map_err(|e| db_error("insert", e))?;
        Ok(match *row.columns()[0].type_() {
            Type::INT4 => row.get::<_, i32>(0) as i64,
            Type::INT8 => row.get::<_, i64>(0),
            _ => 0,
        })
    }

    /// Every column but the id is cast to text or int8 by the statement, so only an id
    /// column whose type changed under the relay fails, as a typed error that names it.
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
            IdType::Uuid => row.try_get::<_, Uuid>(0).map(RowId::Uuid),
        }
        .map_err(|e| read_error(0, e))?;
        RawRow::read(
            id,
            |i| row.try_get(i).map_err(|e| read_error(i, e)),
            |i| row.try_get(i).map_err(|e| read_error(i, e)),
            |i| {
                match mapping.payload_format {
                    PayloadFormat::Bytes => row.try_get(i),
                    _ => row
                        .try_get::<_, Option<String>>(i)
                        .map(|text| text.map(String::into_bytes)),
                }
                .map_err(|e| read_error(i, e))
            },
        )
    }

    fn int(row: &Row, index: usize) -> Option<i64> {
        row.try_get::<_, Option<i64>>(index).ok().flatten()
    }

    fn text(row: &Row, index: usize) -> Option<String> {
        row.try_get::<_, Option<String>>(index).ok().flatten()
    }

    fn ping(&self) -> impl Future<Output = StoreResult<()>> + Send {
        self.base.ping()
    }

    async fn refuse_unusable(&self) -> StoreResult<()> {
        crate::refuse_standby(self.inner()).await
    }

    async fn verify_access(&self, sql: &Sql, layout: &str) -> StoreResult<Vec<Problem>> {
        let needed = if sql.mapping.retains_delivered() {
            "SELECT, UPDATE"
        } else {
            "SELECT, UPDATE, DELETE"
        };
        let table = sql.table();
        let print = format!("outbox-relay migrate --layout {layout} --print");
        let mut problems =
            crate::missing_privileges(self.inner(), &table, &table, needed, &print).await?;
        // The side table of dead letters, where the layout keeps them: without INSERT, the
        // first bad row (days after a deploy) stopped the relay, every key with it.
        if sql.dead_table_ddl().is_some() {
            let dead = sql.dead_table();
            let exists = PgStore::query(
                self.inner(),
                "verify",
                "SELECT to_regclass($1) IS NOT NULL",
                &[&dead],
            )
            .await?;
            if exists.first().is_some_and(|row| row.get::<_, bool>(0)) {
                problems.extend(
                    crate::missing_privileges(
                        self.inner(),
                        &dead,
                        &dead,
                        "SELECT, INSERT, DELETE",
                        &print,
                    )
                    .await?,
                );
            } else {
                problems.push(Problem::blocking(
                    format!("table {dead} (the layout's dead letters) does not exist"),
                    format!("run `outbox-relay migrate --layout {layout}` (or apply `{print}`)"),
                ));
            }
        }
        problems.extend(
            crate::verify::unidentified_rows(self.inner(), &table, &sql.mapping.table).await?,
        );
        // Every layout's table wakes the relay through the same trigger as the native one.
        let trigger = format!("{}_trigger", sql.mapping.table);
        let fix = format!(
            "run `outbox-relay migrate --layout {layout}` (or apply `outbox-relay migrate --layout {layout} --print`)"
        );
        problems
            .extend(crate::missing_trigger(self.inner(), &trigger, &table, &table, &fix).await?);
        Ok(problems)
    }

    /// The seed's DDL (none for a custom mapping, whose table the application owns), the
    /// relay's side table if the layout needs one, and the wake-up trigger on the table.
    fn ddl(&self, sql: &Sql) -> Option<String> {
        let mut ddl = sql.ddl().unwrap_or_default();
        let tables = self.base.tables();
        if self.uses_nodes_table() {
            ddl.push_str(&format!(
                "{}\nCREATE TABLE IF NOT EXISTS {} ( id TEXT PRIMARY KEY, expiry TIMESTAMP WITHOUT TIME ZONE NOT NULL );\n",
                outbox_layout::sql::pg_create_schema(&tables.nodes.schema.quoted()),
                tables.nodes.quoted()
            ));
        }
        if !self.seed_trigger_suffices() {
            ddl.push_str(&tables.wakeup_ddl());
        }
        Some(ddl)
    }

    fn grants(&self, sql: &Sql, layout: &str, role: &str) -> String {
        let mut grants = format!(
            "-- The relay's run-time role for the {layout} layout.\n{}",
            sql.grants(role)
        );
        if self.uses_nodes_table() {
            grants.push_str(&format!(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO \"{role}\";\n",
                self.base.tables().nodes.quoted()
            ));
        }
        grants
    }

    async fn migrate(&self, sql: &Sql) -> StoreResult<()> {
        let ddl = self.ddl(sql).unwrap_or_default();
        self.base.apply_ddl(&ddl).await
    }

    async fn batch_execute(&self, sql: &str) -> StoreResult<()> {
        self.base.batch_execute(sql).await
    }

    fn nodes(&self) -> Option<&dyn NodeRegistry> {
        self.uses_nodes_table()
            .then_some(&self.base as &dyn NodeRegistry)
    }

    fn subscribe(&self, on_change: OnChange) -> Option<BoxFuture<'static, ()>> {
        // The base store listens on this table's channel, and gates it (see `open`).
        self.base.subscribe(on_change)
    }

    fn give_way_to_shutdown(&self) -> Option<BoxFuture<'static, ()>> {
        self.base.give_way_to_shutdown()
    }

    fn set_waiting(&self, waiting: bool) {
        self.base.set_waiting(waiting);
    }
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
