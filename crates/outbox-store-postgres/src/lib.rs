//! PostgreSQL outbox store.
//!
//! Claims, acks, retries and dead-letters are one prepared statement each per batch (see
//! [`schema::Statements`]). Wake-ups come from LISTEN on a dedicated connection; the
//! statement-level trigger created by [`PgStore::migrate`] sends them.

mod access;
mod decode;
mod error;
mod handed;
mod listen;
pub mod mapped;
mod migrate;
mod ops;
mod owned;
mod registry;
pub mod schema;
mod shutdown_watch;
pub mod tls;
mod verify;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_core::ident::TableName;
use outbox_core::migration::{Found, Steps};
use outbox_core::store::{
    Backlog, ClaimRequest, Claimed, Crowded, DeadLetter, LeaseExtension, LeaseHolder, LockHolders,
    OnChange, Problem, RetryLater, StoreFuture, StoreResult,
};
use outbox_core::{Fence, NewEvent, NodeId, OutboxStore, SequenceId, StoreError, StoreErrorKind};
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;
use tokio_postgres_rustls::MakeRustlsConnect;

pub use access::Step;
pub use error::classify;
pub use mapped::MappedPgStore;
pub(crate) use outbox_core::time::{from_micros, millis};
pub use schema::{Tables, DEFAULT_NOTIFY_CHANNEL};

use decode::{claimed_ids, row_to_claimed};
use error::{db_error, pool_error};
use listen::listen_forever;
use verify::verify;
pub(crate) use verify::{missing_privileges, missing_trigger, refuse_standby};

/// Connection settings and table names. Its `Debug` shows the URL redacted.
#[derive(Clone)]
pub struct PgOptions {
    /// `postgres://user:password@host:port/db?sslmode=require`.
    pub url: String,
    pub tables: Tables,
    /// Keep delivered rows (with `delivered_at`) instead of deleting them.
    pub retain_delivered: bool,
    /// Extra CA certificates (PEM) for TLS, besides the system's roots.
    pub ca_file: Option<PathBuf>,
    pub pool_size: usize,
    /// The sessions' `application_name` (`outbox-relay <node id>`), so `pg_stat_activity`
    /// tells the relay's sessions apart; a URL that sets one keeps its own.
    pub application_name: Option<String>,
    /// How long a store operation may wait for the database before it fails as a lost
    /// connection (`None`: [`OPERATION_TIMEOUT`]). Migrations are not bounded.
    pub operation_timeout: Option<Duration>,
}

impl std::fmt::Debug for PgOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgOptions")
            .field("url", &outbox_core::redact::RedactedUrl(&self.url))
            .field("tables", &self.tables)
            .field("retain_delivered", &self.retain_delivered)
            .field("ca_file", &self.ca_file)
            .field("pool_size", &self.pool_size)
            .field("application_name", &self.application_name)
            .field("operation_timeout", &self.operation_timeout)
            .finish()
    }
}

impl PgOptions {
    /// `url` and `tables` with the defaults: delivered rows deleted, the system's CAs, 4
    /// connections, `application_name` `outbox-relay`, operations bounded by
    /// [`OPERATION_TIMEOUT`].
    pub fn new(url: impl Into<String>, tables: Tables) -> Self {
        PgOptions {
            url: url.into(),
            tables,
            retain_delivered: false,
            ca_file: None,
            pool_size: 4,
            application_name: None,
            operation_timeout: None,
        }
    }
}

pub use outbox_core::store::OPERATION_TIMEOUT;

/// TCP settings that notice a dead peer even on an idle connection (the LISTEN session, the
/// active relay's lock session): keepalive probes after 10 s of silence, every 5 s, 3 of
/// them (about 25 s); and unacknowledged data aborts the connection after 20 s. A URL that
/// sets any of these keeps its own value.
const TCP_DEFAULTS: [(&str, Duration); 3] = [
    ("keepalives_idle", Duration::from_secs(10)),
    ("keepalives_interval", Duration::from_secs(5)),
    ("tcp_user_timeout", Duration::from_secs(20)),
];
const KEEPALIVE_RETRIES: u32 = 3;

/// The connections the nodes and partitions tables' statements run on ([`Inner`]'s
/// `coordination`): heartbeats and lease renewals, one at a time, and the console's reads.
const COORDINATION_POOL: usize = 2;

/// How long `migrate`'s DDL waits for a lock on a table the application writes
/// (`PgStore::apply_ddl`).
pub const DDL_LOCK_WAIT: Duration = Duration::from_secs(5);

/// The fix when `migrate`'s DDL gave up on a lock.
const DDL_LOCK_HINT: &str = "migrate waited 5 s for a lock on a table the application \
    writes, which another session holds (a long or idle-in-transaction session, VACUUM FULL, \
    ALTER TABLE): it gave up rather than hold every insert queued behind it; find that \
    session with SELECT pid, state, xact_start, query FROM pg_stat_activity WHERE state <> \
    'idle' ORDER BY xact_start, and run migrate again once it has ended";

/// Whether the URL's query sets `key`.
fn url_sets(url: &str, key: &str) -> bool {
    outbox_core::redact::query_start(url).is_some_and(|start| {
        url[start + 1..].split('&').any(|pair| {
            outbox_core::redact::url_decoded(pair.split('=').next().unwrap_or("")) == key
        })
    })
}

struct Inner {
    pool: Pool,
    /// The nodes and partitions tables' statements (heartbeats, lease renewals) run on
    /// connections of their own: on the outbox's pool they waited behind claims and acks
    /// that a lock on the outbox held (VACUUM FULL, an ALTER), the leases lapsed although
    /// every node was alive, and every partition moved at a new epoch once the lock went.
    coordination: Pool,
    config: tokio_postgres::Config,
    tls: MakeRustlsConnect,
    tables: Tables,
    sql: schema::Statements,
    retain_delivered: bool,
    operation_timeout: Duration,
    /// The engine's waiting state, for the gated wake-up.
    waiting: tokio::sync::watch::Sender<bool>,
    /// Since when the server refuses new connections (a smart shutdown), `None` while it
    /// takes them: the store's sessions older than that let go (see `shutdown_watch`).
    refused: Arc<tokio::sync::watch::Sender<shutdown_watch::RefusedSince>>,
    /// The rows each node holds from owned-partition claims, and where claims start.
    owned: owned::OwnedClaims,
    /// The event id of each row handed out, which its settle checks.
    handed: handed::HandedOut,
    /// Whether claims may use the scan floor now.
    floor: owned::FloorHealth,
}

/// Planner settings of the store's sessions. A claim walks the pending index in id order and
/// stops at its limit. On a table that was never analyzed (a backlog loaded after an
/// outage, before autovacuum got to it) the planner guesses that few rows match, and reads
/// every pending row at or above the floor to sort them instead: 300 ms per claim instead of
/// a few, a drain of 300,000 events at 12,000-75,000/s instead of 160,000/s (BENCHMARKS.md).
/// The index gives the order for free, so a plan that sorts is never the better one for the
/// relay's statements; statements with no index to follow still sort. Such a sort is priced
/// past `jit_above_cost`, and PostgreSQL compiled the statement at each execution (150-250
/// ms each for two of WAL capture's start-up checks): the JIT compiler is off, as none of
/// the relay's short statements gains from it.
const INDEX_ORDER_PLANS: &str = "-c enable_sort=off -c jit=off";

/// The PostgreSQL store. Cheap to clone.
#[derive(Clone)]
pub struct PgStore {
    inner: Arc<Inner>,
}

impl PgStore {
    /// Builds the pool. No connection is opened until first use.
    pub fn new(options: PgOptions) -> StoreResult<Self> {
        let (mut config, tls) = tls::prepare(&options.url, options.ca_file.as_deref())?;
        if config.get_application_name().is_none() {
            config.application_name(
                options
                    .application_name
                    .as_deref()
                    .unwrap_or("outbox-relay"),
            );
        }
        for (key, value) in TCP_DEFAULTS {
            if !url_sets(&options.url, key) {
                match key {
                    "keepalives_idle" => config.keepalives_idle(value),
                    "keepalives_interval" => config.keepalives_interval(value),
                    _ => config.tcp_user_timeout(value),
                };
            }
        }
        if !url_sets(&options.url, "keepalives_retries") {
            config.keepalives_retries(KEEPALIVE_RETRIES);
        }
        if !url_sets(&options.url, "keepalives") {
            config.keepalives(true);
        }
        // The server ends a statement when the relay gave up on it: a backend waiting on a
        // lock would otherwise wait on (keeping the row locks it took) after its client
        // left, and every retry would add one. A URL's own statement_timeout is kept.
        // Below the client's own bound, so that the server's answer (which names a lock
        // wait for what it is) comes before the client takes the connection for lost.
        let operation_timeout = options.operation_timeout.unwrap_or(OPERATION_TIMEOUT);
        let statement_bound = format!(
            "-c statement_timeout={}",
            (operation_timeout * 9 / 10).as_millis()
        );
        let session_options = match config.get_options() {
            Some(own) if own.contains("statement_timeout") => format!("{own} {INDEX_ORDER_PLANS}"),
            Some(own) => format!("{own} {INDEX_ORDER_PLANS} {statement_bound}"),
            None => format!("{INDEX_ORDER_PLANS} {statement_bound}"),
        };
        config.options(&session_options);
        let manager = || {
            Manager::from_config(
                config.clone(),
                tls.clone(),
                ManagerConfig {
                    recycling_method: RecyclingMethod::Fast,
                },
            )
        };
        // A connection made before the server began to refuse new ones (a smart shutdown)
        // is closed at its next use instead of being used again (`shutdown_watch`).
        let refused = Arc::new(tokio::sync::watch::channel(None).0);
        let give_way = || {
            let refusing = refused.clone();
            deadpool_postgres::Hook::sync_fn(move |_, metrics| {
                match shutdown_watch::pooled_before_the_refusal(&refusing, metrics.created) {
                    true => Err(deadpool_postgres::HookError::message(
                        "PostgreSQL refuses new connections",
                    )),
                    false => Ok(()),
                }
            })
        };
        let pool = |size: usize| {
            Pool::builder(manager())
                .pre_recycle(give_way())
                .max_size(size)
                .wait_timeout(Some(Duration::from_secs(10)))
                .create_timeout(Some(shutdown_watch::POOL_CONNECT_TIMEOUT))
                .runtime(deadpool_postgres::Runtime::Tokio1)
                .build()
                .map_err(|e| StoreError::new(StoreErrorKind::Config, format!("pool setup: {e}")))
        };
        Ok(PgStore {
            inner: Arc::new(Inner {
                pool: pool(options.pool_size.max(2))?,
                coordination: pool(COORDINATION_POOL)?,
                config,
                tls,
                sql: schema::Statements::new(&options.tables),
                tables: options.tables,
                retain_delivered: options.retain_delivered,
                operation_timeout,
                waiting: tokio::sync::watch::channel(false).0,
                refused,
                owned: Default::default(),
                handed: Default::default(),
                floor: Default::default(),
            }),
        })
    }

    pub fn tables(&self) -> &Tables {
        &self.inner.tables
    }

    /// Applies the native schema's steps the database lacks ([`Tables::steps`]), each
    /// recorded as it completes, then the wake-up trigger (its body follows the wake-up
    /// mode, so every `migrate` replaces it). Serialized against concurrent migrations.
    pub async fn migrate(&self) -> StoreResult<()> {
        let session = migrate::MigrateSession::open(self).await?;
        let result = async {
            let steps = self.inner.tables.steps();
            let found = session.apply(&self.outbox_component(&steps)).await?;
            if let Some(nodes) = self.inner.tables.nodes_table_where_missing() {
                session.batch(&nodes).await?;
            }
            if found.version() > steps.latest() {
                // A newer relay migrated it, perhaps while this one waited for the lock (a
                // rolling upgrade): judged as `run` judges it, and its wake-up trigger,
                // which may differ from this relay's, is left as it is.
                outbox_core::migration::judge(&steps, found, "migrate")?;
                return Ok(());
            }
            // The trigger's lock on the outbox waits behind any transaction that wrote it,
            // and every insert of the application queues behind the wait: bounded.
            session
                .batch(&format!(
                    "BEGIN;\nSET LOCAL lock_timeout = '{}ms';\n{}COMMIT;",
                    DDL_LOCK_WAIT.as_millis(),
                    self.inner.tables.wakeup_ddl()
                ))
                .await
                .map_err(migrate::with_lock_hint)
        }
        .await;
        session.close().await;
        result?;
        // A count other than the table's, given to a later `migrate`, would change nothing.
        self.stored_partitions().await.map(drop)
    }

    /// The native schema as a versioned component, for the runner.
    fn outbox_component<'a>(&'a self, steps: &'a Steps) -> migrate::Component<'a> {
        let t = &self.inner.tables;
        migrate::Component {
            steps,
            tables: t,
            probe: &t.outbox,
            concurrent_indexes: t.concurrent_indexes(),
            obsolete_indexes: vec![t.obsolete_blocking_index()],
        }
    }

    /// Applies `steps`, whose objects `probe` stands for, as a component of this outbox's
    /// schema (WAL capture's, beside the outbox's). `concurrent_indexes`: the indexes its
    /// steps build concurrently (an invalid one, left by an interrupted build, is dropped
    /// first).
    pub async fn migrate_component(
        &self,
        steps: &Steps,
        probe: &TableName,
        concurrent_indexes: Vec<String>,
    ) -> StoreResult<()> {
        let session = migrate::MigrateSession::open(self).await?;
        let result = session
            .apply(&migrate::Component {
                steps,
                tables: &self.inner.tables,
                probe,
                concurrent_indexes,
                obsolete_indexes: Vec::new(),
            })
            .await;
        session.close().await;
        result.map(drop)
    }

    /// What the database holds of the native schema.
    pub async fn schema_found(&self) -> StoreResult<Found> {
        let t = &self.inner.tables;
        self.component_found("outbox", &t.outbox).await
    }

    /// What the database holds of `component`, whose objects `probe` stands for.
    pub async fn component_found(&self, component: &str, probe: &TableName) -> StoreResult<Found> {
        let client = self
            .inner
            .pool
            .get()
            .await
            .map_err(|e| pool_error("reading the schema version", e))?;
        migrate::read_found(&client, &self.inner.tables.versions, component, probe).await
    }

    /// The steps of `steps` that `found` lacks, as `migrate --print` shows them; with
    /// `found` unknown (no database), every step and the version table.
    pub fn printable_steps(&self, steps: &Steps, found: Option<Found>) -> String {
        let t = &self.inner.tables;
        steps.printable_missing(found, &t.version_table_ddl(), |step| {
            t.printable_step(steps, step)
        })
    }

    /// Runs idempotent DDL in one transaction, serialized against concurrent migrations.
    /// Each lock it needs it waits for at most [`DDL_LOCK_WAIT`]: a lock on an application's
    /// table (a mapped layout's, the outbox under WAL capture) queued behind a long
    /// transaction held every insert of the application queued behind it, for as long as
    /// that transaction lasted. The DDL takes no lock where the objects exist.
    pub(crate) async fn apply_ddl(&self, ddl: &str) -> StoreResult<()> {
        let session = migrate::MigrateSession::open(self).await?;
        let wait = DDL_LOCK_WAIT.as_millis();
        let result = session
            .batch(&format!(
                "BEGIN;\nSET LOCAL lock_timeout = '{wait}ms';\n{ddl}\nCOMMIT;"
            ))
            .await
            .map_err(|e| {
                if e.hint() == error::WAITED_HINT {
                    e.with_hint(DDL_LOCK_HINT)
                } else {
                    e
                }
            });
        if result.is_err() {
            let _ = session.batch("ROLLBACK").await;
        }
        session.close().await;
        result
    }

    /// A connection of `pool` with `sql` prepared on it, through its statement cache.
    async fn prepared_on(
        pool: &Pool,
        context: &'static str,
        sql: &str,
    ) -> StoreResult<(deadpool_postgres::Client, tokio_postgres::Statement)> {
        let client = pool.get().await.map_err(|e| pool_error(context, e))?;
        let statement = client
            .prepare_cached(sql)
            .await
            .map_err(|e| db_error(context, e))?;
        Ok((client, statement))
    }

    /// A statement's failure; a plan a changed column type made stale is forgotten.
    fn statement_error(
        inner: &Inner,
        context: &'static str,
        e: tokio_postgres::Error,
    ) -> StoreError {
        forget_stale_plans(inner, &e);
        db_error(context, e)
    }

    /// Runs `sql` with parameters on a pooled connection, through the statement cache.
    async fn execute(
        inner: &Inner,
        context: &'static str,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> StoreResult<u64> {
        Self::execute_on(inner, &inner.pool, context, sql, params).await
    }

    /// [`PgStore::execute`] on `pool`.
    async fn execute_on(
        inner: &Inner,
        pool: &Pool,
        context: &'static str,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> StoreResult<u64> {
        bounded(inner, context, async {
            let (client, statement) = Self::prepared_on(pool, context, sql).await?;
            client
                .execute(&statement, params)
                .await
                .map_err(|e| Self::statement_error(inner, context, e))
        })
        .await
    }

    async fn query(
        inner: &Inner,
        context: &'static str,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> StoreResult<Vec<Row>> {
        Self::query_on(inner, &inner.pool, context, sql, params).await
    }

    /// [`PgStore::query`] on `pool`.
    async fn query_on(
        inner: &Inner,
        pool: &Pool,
        context: &'static str,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> StoreResult<Vec<Row>> {
        bounded(inner, context, async {
            let (client, statement) = Self::prepared_on(pool, context, sql).await?;
            client
                .query(&statement, params)
                .await
                .map_err(|e| Self::statement_error(inner, context, e))
        })
        .await
    }

    /// Runs arbitrary SQL (for tests and tools).
    pub async fn batch_execute(&self, sql: &str) -> StoreResult<()> {
        let client = self
            .inner
            .pool
            .get()
            .await
            .map_err(|e| pool_error("execute", e))?;
        client
            .batch_execute(sql)
            .await
            .map_err(|e| db_error("execute", e))
    }
}

/// Settings of a session that only waits (LISTEN, an advisory lock held):
/// - it is not ended by an `idle_session_timeout` set on the role or database (PostgreSQL
///   14+): the lock would be lost and taken again every period, each time giving back the
///   rows in flight;
/// - the server notices a client gone without closing (its host crashed, the network cut)
///   as soon as the client would notice the server: the client's TCP keepalives and user
///   timeout (`config`) apply on the server's side too. The server probes an idle session
///   only after the system's keepalive time, two hours by default, and until then the
///   session's lock stayed held: no standby could take the table over.
///
/// A server without one of these settings (older, or a Unix socket, where they do not
/// apply) keeps its own; its error is of no account.
pub(crate) async fn hold_waiting_session(
    client: &tokio_postgres::Client,
    config: &tokio_postgres::Config,
) {
    let mut settings = vec![("idle_session_timeout", 0)];
    if config.get_keepalives() {
        let secs = |d: Duration| d.as_secs().max(1) as u128;
        settings.push(("tcp_keepalives_idle", secs(config.get_keepalives_idle())));
        if let Some(interval) = config.get_keepalives_interval() {
            settings.push(("tcp_keepalives_interval", secs(interval)));
        }
        if let Some(retries) = config.get_keepalives_retries() {
            settings.push(("tcp_keepalives_count", u128::from(retries)));
        }
    }
    if let Some(timeout) = config.get_tcp_user_timeout() {
        settings.push(("tcp_user_timeout", timeout.as_millis()));
    }
    for (name, value) in settings {
        let _ = client.batch_execute(&format!("SET {name} = {value}")).await;
    }
}

/// Runs a store operation with the operation timeout. A connection that did not answer in
/// time may be dead without knowing it (a blackholed network), and its neighbours with it:
/// the pool forgets its idle connections, so the retry opens fresh ones.
async fn bounded<T>(
    inner: &Inner,
    context: &'static str,
    operation: impl std::future::Future<Output = StoreResult<T>>,
) -> StoreResult<T> {
    bounded_within(inner, None, context, operation).await
}

/// [`bounded`] by `within` when given, else by the store's operation timeout.
async fn bounded_within<T>(
    inner: &Inner,
    within: Option<Duration>,
    context: &'static str,
    operation: impl std::future::Future<Output = StoreResult<T>>,
) -> StoreResult<T> {
    let within = within.unwrap_or(inner.operation_timeout);
    // Its own statement: the operation (and the connection it holds, which goes back to the
    // pool) is dropped before the pool is cleared.
    let result = tokio::time::timeout(within, operation).await;
    result.unwrap_or_else(|_| {
        inner.pool.retain(|_, _| false);
        inner.coordination.retain(|_, _| false);
        Err(outbox_core::store::no_answer(context, within))
    })
}

/// An owned-partition claim (ordered, fenced), with the scan floor's reads pipelined around
/// it on the same connection, in this order: sequence, writers, due time, claim, after.
async fn claim_owned(
    inner: &Inner,
    node: &str,
    limit: i64,
    fence: &Fence,
    crowded: &Crowded,
) -> StoreResult<Vec<Row>> {
    let client = inner.pool.get().await.map_err(|e| pool_error("claim", e))?;
    match claim_owned_once(inner, &client, node, limit, fence, crowded).await? {
        Some(rows) => Ok(rows),
        // A row the floor passed has come due: claim again from the start, so that it goes out
        // before the rows of its key that it holds back.
        None => {
            inner.owned.due_passed(node);
            Ok(
                claim_owned_once(inner, &client, node, limit, fence, crowded)
                    .await?
                    .unwrap_or_default(),
            )
        }
    }
}

/// One owned claim; `None` when it started above the start and the floor's due time had
/// passed.
async fn claim_owned_once(
    inner: &Inner,
    client: &deadpool_postgres::Client,
    node: &str,
    limit: i64,
    fence: &Fence,
    crowded: &Crowded,
) -> StoreResult<Option<Vec<Row>>> {
    let sql = &inner.sql;
    let statement = match crowded.is_empty() {
        true => &sql.claim_owned,
        false => &sql.claim_owned_crowded,
    };
    let claim = client
        .prepare_cached(statement)
        .await
        .map_err(|e| db_error("claim", e))?;
    let mut floor_statements = None;
    // The floor passes only rows a claim saw; one that leaves crowded rows out scans from zero.
    if inner.floor.usable() && inner.owned.wants_floor(node) && crowded.is_empty() {
        match futures::try_join!(
            client.prepare_cached(&sql.floor_sequence),
            client.prepare_cached(&sql.floor_writers),
            client.prepare_cached(&sql.floor_due),
            client.prepare_cached(&sql.floor_after),
        ) {
            Ok(statements) => floor_statements = Some(statements),
            Err(e) => inner.floor.failed(db_error("scan floor", e)),
        }
    }
    let plan = inner.owned.plan(node, fence, floor_statements.is_some());
    let window = crowded.window as i64;
    let count = fence.count as i32;
    let mut claim_params: Vec<&(dyn ToSql + Sync)> = vec![
        &node,
        &limit,
        &plan.held,
        &count,
        &fence.partitions,
        &fence.epochs,
        &plan.start,
        &plan.due,
    ];
    if !crowded.is_empty() {
        claim_params.extend([&crowded.keys as &(dyn ToSql + Sync), &window]);
    }
    let Some((sequence, writers, due, after)) = floor_statements else {
        let rows = client.query(&claim, &claim_params).await.map_err(|e| {
            forget_stale_plans(inner, &e);
            db_error("claim", e)
        })?;
        let ids = claimed_ids(&inner.tables, &rows)?;
        inner.owned.claim_returned(node, ids.len() as i64 >= limit);
        inner.owned.claimed(node, &plan, &ids, None);
        return Ok(Some(rows));
    };
    let due_params: [&(dyn ToSql + Sync); 3] = [&node, &fence.partitions, &count];
    let after_params: [&(dyn ToSql + Sync); 4] =
        [&node, &fence.partitions, &fence.epochs, &plan.due];
    // Polled in this order, the five are sent in this order, in one round trip.
    let (sequence, writers, due, rows, after) = futures::join!(
        client.query_one(&sequence, &[]),
        client.query_one(&writers, &[]),
        client.query_one(&due, &due_params),
        client.query(&claim, &claim_params),
        client.query_one(&after, &after_params),
    );
    let rows = rows.map_err(|e| {
        forget_stale_plans(inner, &e);
        db_error("claim", e)
    })?;
    let ids = claimed_ids(&inner.tables, &rows)?;
    inner.owned.claim_returned(node, ids.len() as i64 >= limit);
    let seen = match (sequence, writers, due, after) {
        (Ok(sequence), Ok(writers), Ok(due), Ok(after)) => {
            // Rows make the statement's clock check moot: it passed, or none would return.
            if ids.is_empty() && plan.start > owned::FROM_THE_START && after.get::<_, bool>(1) {
                inner.owned.claimed(node, &plan, &ids, None);
                return Ok(None);
            }
            match owned::SequenceCheck::from_row(&sequence).problem() {
                Some(problem) => {
                    inner.floor.unusable(problem);
                    None
                }
                None => {
                    inner.floor.in_use();
                    Some(owned::Observation {
                        sequence: sequence.get(0),
                        writers: writers.get(0),
                        next_due: due.get(0),
                        claimed: &ids,
                        full: ids.len() as i64 >= limit,
                        fence_held: after.get(0),
                    })
                }
            }
        }
        (Err(e), _, _, _) | (_, Err(e), _, _) | (_, _, Err(e), _) | (_, _, _, Err(e)) => {
            inner.floor.failed(db_error("scan floor", e));
            None
        }
    };
    tracing::trace!(
        start = plan.start,
        held = plan.held.len(),
        claimed = ids.len(),
        sequence = seen.as_ref().map(|s| s.sequence),
        writers = seen.as_ref().map(|s| s.writers.len()),
        "owned claim"
    );
    inner.owned.claimed(node, &plan, &ids, seen);
    Ok(Some(rows))
}

/// The arrays a failed attempt's statement binds (retry and dead-letter alike): the ids,
/// the attempts (saturated to the int4 column) and the errors.
fn failed_columns<'a>(
    rows: impl Iterator<Item = (SequenceId, u32, &'a str)>,
) -> (Vec<i64>, Vec<i32>, Vec<&'a str>) {
    let (mut ids, mut attempts, mut errors) = (Vec::new(), Vec::new(), Vec::new());
    for (id, tries, error) in rows {
        ids.push(id);
        attempts.push(i32::try_from(tries).unwrap_or(i32::MAX));
        errors.push(error);
    }
    (ids, attempts, errors)
}

/// How a settle statement checks that its rows are the ones handed out (`handed.rs`).
#[derive(Clone, Copy)]
enum Checked {
    /// Paired with the ids: one array of event ids, NULL where unknown (retries and dead
    /// letters, joined to their arrays row by row).
    Paired,
    /// As a set (acks, `schema::HANDED_OUT`): the known event ids, and the ids settled by
    /// id alone.
    AsASet,
}

/// Runs a settle statement of `node`'s rows `ids`: `params` are the statement's own, but
/// for the rows' event ids, checked as `checked` says, which follow them, and the
/// partition fence's parameters when there is one.
async fn settle(
    inner: &Inner,
    context: &'static str,
    (sql, checked): (&schema::Guarded, Checked),
    (node, fence): (&str, Option<&Fence>),
    ids: &[SequenceId],
    params: &[&(dyn ToSql + Sync)],
) -> StoreResult<u64> {
    let event_ids = inner.handed.event_ids(node, ids);
    let known: Vec<uuid::Uuid> = event_ids.iter().flatten().copied().collect();
    let by_id_alone: Vec<SequenceId> = ids
        .iter()
        .zip(&event_ids)
        .filter(|(_, event_id)| event_id.is_none())
        .map(|(id, _)| *id)
        .collect();
    let count = fence.map(|fence| fence.count as i32);
    let mut all: Vec<&(dyn ToSql + Sync)> = params.to_vec();
    match checked {
        Checked::Paired => all.push(&event_ids),
        Checked::AsASet => {
            all.push(&known);
            all.push(&by_id_alone);
        }
    }
    let statement = match (fence, &count) {
        (Some(fence), Some(count)) => {
            all.push(&fence.partitions);
            all.push(&fence.epochs);
            all.push(count);
            &sql.partition_fence
        }
        _ => &sql.row_lease,
    };
    let n = PgStore::execute(inner, context, statement, &all).await?;
    inner.handed.forget(node, ids);
    Ok(n)
}

/// A table altered under a running relay fails its prepared statements with "cached plan
/// must not change result type" (SQLSTATE 0A000) for as long as they are reused: forget them
/// all, so the next try prepares afresh (and then reads the new column types, or says why
/// it cannot).
fn forget_stale_plans(inner: &Inner, error: &tokio_postgres::Error) {
    if error.code() == Some(&tokio_postgres::error::SqlState::FEATURE_NOT_SUPPORTED) {
        tracing::warn!(error = %error, "a table changed under the relay: preparing its statements again");
        inner.pool.manager().statement_caches.clear();
        inner.coordination.manager().statement_caches.clear();
    }
}

impl OutboxStore for PgStore {
    fn describe(&self) -> String {
        format!("postgres {}", self.inner.tables.outbox)
    }

    fn claim(&self, request: ClaimRequest) -> StoreFuture<Vec<Claimed>> {
        let inner = self.inner.clone();
        async move {
            let limit = request.limit as i64;
            let lease = millis(request.lease);
            let node = &request.node.0;
            let crowded = &request.crowded;
            let window = crowded.window as i64;
            let rows = match (&request.fence, request.ordered) {
                (_, false) => {
                    Self::query(
                        &inner,
                        "claim",
                        &inner.sql.claim_unordered,
                        &[node, &limit, &lease],
                    )
                    .await?
                }
                (None, true) if crowded.is_empty() => {
                    Self::query(&inner, "claim", &inner.sql.claim, &[node, &limit, &lease]).await?
                }
                (None, true) => {
                    Self::query(
                        &inner,
                        "claim",
                        &inner.sql.claim_crowded,
                        &[node, &limit, &lease, &crowded.keys, &window],
                    )
                    .await?
                }
                (Some(fence), true) => {
                    bounded(
                        &inner,
                        "claim",
                        claim_owned(&inner, node, limit, fence, crowded),
                    )
                    .await?
                }
            };
            let ids = claimed_ids(&inner.tables, &rows)?;
            inner.handed.record(
                node,
                ids.iter().zip(&rows).map(|(id, row)| {
                    let event_id: Option<uuid::Uuid> = row.try_get(1).ok().flatten();
                    (*id, event_id)
                }),
            );
            let mut claimed: Vec<Claimed> = ids
                .into_iter()
                .zip(&rows)
                .map(|(id, row)| row_to_claimed(id, row))
                .collect();
            // RETURNING does not keep the scan's order.
            claimed.sort_unstable_by_key(Claimed::sequence_id);
            Ok(claimed)
        }
        .boxed()
    }

    fn ack(&self, holder: LeaseHolder, ids: Vec<SequenceId>) -> StoreFuture<u64> {
        let LeaseHolder { node, fence } = holder;
        let inner = self.inner.clone();
        async move {
            let sql = if inner.retain_delivered {
                &inner.sql.ack_retain
            } else {
                &inner.sql.ack_delete
            };
            let n = settle(
                &inner,
                "ack",
                (sql, Checked::AsASet),
                (&node.0, fence.as_deref()),
                &ids,
                &[&node.0, &ids],
            )
            .await?;
            inner.owned.forget(&node.0, &ids, n < ids.len() as u64);
            Ok(n)
        }
        .boxed()
    }

    fn retry_later(&self, holder: LeaseHolder, retries: Vec<RetryLater>) -> StoreFuture<u64> {
        let LeaseHolder { node, fence } = holder;
        let inner = self.inner.clone();
        async move {
            let (ids, attempts, errors) = failed_columns(
                retries
                    .iter()
                    .map(|r| (r.sequence_id, r.attempts, r.error.as_str())),
            );
            let delays: Vec<i64> = retries.iter().map(|r| millis(r.delay)).collect();
            let n = settle(
                &inner,
                "retry",
                (&inner.sql.retry_later, Checked::Paired),
                (&node.0, fence.as_deref()),
                &ids,
                &[&node.0, &ids, &attempts, &errors, &delays],
            )
            .await?;
            inner.owned.forget(&node.0, &ids, true);
            Ok(n)
        }
        .boxed()
    }

    fn dead_letter(&self, holder: LeaseHolder, entries: Vec<DeadLetter>) -> StoreFuture<u64> {
        let LeaseHolder { node, fence } = holder;
        let inner = self.inner.clone();
        async move {
            let (ids, attempts, errors) = failed_columns(
                entries
                    .iter()
                    .map(|e| (e.sequence_id, e.attempts, e.error.as_str())),
            );
            let n = settle(
                &inner,
                "dead-letter",
                (&inner.sql.dead_letter, Checked::Paired),
                (&node.0, fence.as_deref()),
                &ids,
                &[&node.0, &ids, &attempts, &errors],
            )
            .await?;
            inner.owned.forget(&node.0, &ids, n < ids.len() as u64);
            Ok(n)
        }
        .boxed()
    }

    fn release(&self, node: NodeId, ids: Vec<SequenceId>) -> StoreFuture<u64> {
        let inner = self.inner.clone();
        async move {
            // Owned-claim rows hold no lease: forgetting them makes them claimable.
            inner.handed.forget(&node.0, &ids);
            let owned = inner.owned.forget(&node.0, &ids, true);
            let leased: Vec<i64> = ids
                .iter()
                .copied()
                .filter(|id| !owned.contains(id))
                .collect();
            let n = if leased.is_empty() {
                0
            } else {
                Self::execute(&inner, "release", &inner.sql.release, &[&node.0, &leased]).await?
            };
            Ok(n + owned.len() as u64)
        }
        .boxed()
    }

    fn release_unheld(&self, node: NodeId, held: Vec<SequenceId>) -> StoreFuture<u64> {
        let inner = self.inner.clone();
        async move {
            inner.handed.forget_all_but(&node.0, &held);
            let forgotten = inner.owned.forget_all_but(&node.0, &held);
            let n = Self::execute(
                &inner,
                "release unheld",
                &inner.sql.release_unheld,
                &[&node.0, &held],
            )
            .await?;
            Ok(n + forgotten)
        }
        .boxed()
    }

    fn extend_leases(&self, extension: LeaseExtension) -> StoreFuture<u64> {
        let LeaseExtension { node, ids, lease } = extension;
        let inner = self.inner.clone();
        async move {
            let leased: Vec<i64> = ids
                .iter()
                .copied()
                .filter(|id| !inner.owned.holds(&node.0, *id))
                .collect();
            let unleased = (ids.len() - leased.len()) as u64;
            if leased.is_empty() {
                return Ok(unleased);
            }
            let lease = millis(lease);
            let n = Self::execute(
                &inner,
                "extend leases",
                &inner.sql.extend_leases,
                &[&node.0, &leased, &lease],
            )
            .await?;
            Ok(n + unleased)
        }
        .boxed()
    }

    fn backlog(&self) -> StoreFuture<Backlog> {
        let inner = self.inner.clone();
        async move {
            let rows = Self::query(&inner, "backlog", &inner.sql.backlog, &[]).await?;
            let dead = Self::query(&inner, "backlog", &inner.sql.dead_count, &[]).await?;
            let row = &rows[0];
            let oldest: Option<i64> = row.get(2);
            Ok(Backlog {
                pending: row.get::<_, i64>(0) as u64,
                retrying: row.get::<_, i64>(1) as u64,
                dead: dead[0].get::<_, i64>(0) as u64,
                oldest_pending_age: oldest.map(|ms| Duration::from_millis(ms.max(0) as u64)),
            })
        }
        .boxed()
    }

    fn insert(&self, events: Vec<NewEvent>) -> StoreFuture<Vec<SequenceId>> {
        let inner = self.inner.clone();
        async move {
            let ids: Vec<Option<uuid::Uuid>> = events.iter().map(|e| e.event_id).collect();
            let destinations: Vec<&str> = events.iter().map(|e| e.destination.as_str()).collect();
            let keys: Vec<Option<&str>> =
                events.iter().map(|e| e.partition_key.as_deref()).collect();
            let types: Vec<&str> = events.iter().map(|e| e.event_type.as_str()).collect();
            let payloads: Vec<Option<&str>> = events.iter().map(|e| e.payload.as_deref()).collect();
            let headers: Vec<String> = events
                .iter()
                .map(|e| serde_json::to_string(&e.headers).unwrap_or_else(|_| "{}".into()))
                .collect();
            let mutations: Vec<Option<&str>> =
                events.iter().map(|e| e.mutation_id.as_deref()).collect();
            let rows = Self::query(
                &inner,
                "insert",
                &inner.sql.insert,
                &[
                    &ids,
                    &destinations,
                    &keys,
                    &types,
                    &payloads,
                    &headers,
                    &mutations,
                ],
            )
            .await?;
            Ok(rows.iter().map(|r| r.get(0)).collect())
        }
        .boxed()
    }

    fn ping(&self) -> StoreFuture<()> {
        let inner = self.inner.clone();
        async move {
            Self::execute(&inner, "ping", "SELECT 1", &[])
                .await
                .map(|_| ())
        }
        .boxed()
    }

    fn lock_holders(&self) -> Option<StoreFuture<LockHolders>> {
        let inner = self.inner.clone();
        Some(
            async move {
                // On the coordination pool: the main pool's sessions may all be the ones
                // waiting.
                let rows = Self::query_on(
                    &inner,
                    &inner.coordination,
                    "lock holders",
                    schema::LOCK_HOLDERS,
                    &[],
                )
                .await?;
                let sessions = rows
                    .iter()
                    .map(|row| {
                        let pid: i32 = row.get(0);
                        let user: Option<String> = row.get(1);
                        let application: Option<String> = row.get(2);
                        let state: Option<String> = row.get(3);
                        let running: Option<i64> = row.get(4);
                        let query: Option<String> = row.get(5);
                        let mut said = format!(
                            "pid {pid} (user {}, application {:?}, {}",
                            user.as_deref().unwrap_or("?"),
                            application.unwrap_or_default(),
                            state
                                .as_deref()
                                .unwrap_or("state not shown to the relay's role"),
                        );
                        if let Some(secs) = running {
                            said.push_str(&format!(", in a transaction for {secs}s"));
                        }
                        if let Some(query) = query.filter(|q| !q.is_empty()) {
                            said.push_str(&format!(", last statement {query:?}"));
                        }
                        said.push(')');
                        said
                    })
                    .collect();
                Ok(LockHolders {
                    sessions,
                    end_one: "SELECT pg_terminate_backend(<pid>)",
                })
            }
            .boxed(),
        )
    }

    fn verify(&self) -> StoreFuture<Vec<Problem>> {
        let inner = self.inner.clone();
        async move { verify(&inner).await }.boxed()
    }

    fn subscribe(&self, on_change: OnChange) -> Option<BoxFuture<'static, ()>> {
        let inner = self.inner.clone();
        Some(listen_forever(inner, on_change).boxed())
    }

    fn give_way_to_shutdown(&self) -> Option<BoxFuture<'static, ()>> {
        Some(shutdown_watch::watch(self.inner.clone()).boxed())
    }

    fn set_waiting(&self, waiting: bool) {
        self.inner.waiting.send_replace(waiting);
    }
}
