//! What stores built on this one (WAL capture) need beyond the [`OutboxStore`] contract:
//! the same pool under other table names, and their own statements with the same
//! timeouts, statement cache and error classification.
//!
//! [`OutboxStore`]: outbox_core::OutboxStore

use std::sync::Arc;
use std::time::Duration;

use outbox_core::store::StoreResult;
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use crate::error::{db_error, pool_error};
use crate::{bounded_within, schema, Inner, PgStore, Tables};

/// Makes the transaction's commit wait for the local WAL flush when the session would not
/// (`synchronous_commit = off`); a stronger setting (`on`, `remote_apply`, ...) is kept.
const DURABLE_COMMIT: &str = "SELECT set_config('synchronous_commit', 'local', true) \
     WHERE current_setting('synchronous_commit') = 'off'";

/// One statement of [`PgStore::transaction`].
pub type Step<'a> = (&'a str, &'a [&'a (dyn ToSql + Sync)]);

impl PgStore {
    /// A store over other tables (`tables.outbox` may be any table with the outbox's columns
    /// and indexes), sharing this store's connection pool and settings.
    pub fn with_tables(&self, tables: Tables) -> PgStore {
        let inner = &self.inner;
        PgStore {
            inner: Arc::new(Inner {
                pool: inner.pool.clone(),
                coordination: inner.coordination.clone(),
                config: inner.config.clone(),
                tls: inner.tls.clone(),
                sql: schema::Statements::new(&tables),
                tables,
                retain_delivered: inner.retain_delivered,
                operation_timeout: inner.operation_timeout,
                waiting: tokio::sync::watch::channel(false).0,
                // The pool's, which it shares.
                refused: inner.refused.clone(),
                owned: Default::default(),
                handed: Default::default(),
                floor: Default::default(),
            }),
        }
    }

    /// `check`'s finding for `table` (a table the capture deletes or updates rows of, such
    /// as its parked table) in a publication of deletes or updates without a replica
    /// identity, which makes PostgreSQL refuse those writes.
    pub async fn unidentified_rows(
        &self,
        table: &outbox_core::ident::TableName,
    ) -> StoreResult<Vec<outbox_core::store::Problem>> {
        crate::verify::unidentified_rows(&self.inner, &table.quoted(), &table.to_string()).await
    }

    /// Runs one query through the statement cache, bounded by the operation timeout.
    pub async fn query_rows(
        &self,
        context: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> StoreResult<Vec<Row>> {
        Self::query(&self.inner, context, sql, params).await
    }

    /// Runs statements in one transaction, bounded by the operation timeout; returns each
    /// one's row count. The commit is durable (flushed to disk) even where the server or
    /// role runs with `synchronous_commit = off`: WAL capture confirms the slot past what
    /// these transactions wrote, and a crash must not take the writes back after that.
    pub async fn transaction(
        &self,
        context: &'static str,
        steps: &[Step<'_>],
    ) -> StoreResult<Vec<u64>> {
        Ok(self.transaction_then_query(context, steps, None).await?.0)
    }

    /// [`PgStore::transaction`], then `query` in the same transaction (before it commits):
    /// the steps' row counts and the query's rows (none without a query).
    pub async fn transaction_then_query(
        &self,
        context: &'static str,
        steps: &[Step<'_>],
        query: Option<Step<'_>>,
    ) -> StoreResult<(Vec<u64>, Vec<Row>)> {
        let done = self
            .guarded_transaction(context, None, steps, query, None)
            .await?;
        // Without a guard it always runs.
        Ok(done.unwrap_or_default())
    }

    /// [`PgStore::transaction`], run only if the queries `guard`, run first and in order in
    /// the same transaction, end with one that returns a row; `Ok(None)` (nothing written)
    /// when the last returns none. A guard that locks what it reads (the statements before
    /// the last can take the lock) fences the steps against a concurrent change of it.
    pub async fn transaction_if(
        &self,
        context: &'static str,
        guard: &[Step<'_>],
        steps: &[Step<'_>],
    ) -> StoreResult<Option<Vec<u64>>> {
        let done = self
            .guarded_transaction(context, Some(guard), steps, None, None)
            .await?;
        Ok(done.map(|(counts, _)| counts))
    }

    /// [`PgStore::transaction_then_query`] under a guard, as [`PgStore::transaction_if`]
    /// runs it: `Ok(None)` (nothing written, nothing queried) when the guard returns no row.
    pub async fn transaction_if_then_query(
        &self,
        context: &'static str,
        guard: &[Step<'_>],
        steps: &[Step<'_>],
        query: Option<Step<'_>>,
    ) -> StoreResult<Option<(Vec<u64>, Vec<Row>)>> {
        self.guarded_transaction(context, Some(guard), steps, query, None)
            .await
    }

    /// [`PgStore::transaction_if_then_query`] bounded by `within`, not the store's operation
    /// timeout: for work whose length grows with the table (moving a backlog), which a
    /// bound meant for one batch would cut off every time it is tried.
    pub async fn long_transaction_if_then_query(
        &self,
        context: &'static str,
        within: Duration,
        guard: &[Step<'_>],
        steps: &[Step<'_>],
        query: Option<Step<'_>>,
    ) -> StoreResult<Option<(Vec<u64>, Vec<Row>)>> {
        self.guarded_transaction(context, Some(guard), steps, query, Some(within))
            .await
    }

    async fn guarded_transaction(
        &self,
        context: &'static str,
        guard: Option<&[Step<'_>]>,
        steps: &[Step<'_>],
        query_step: Option<Step<'_>>,
        within: Option<Duration>,
    ) -> StoreResult<Option<(Vec<u64>, Vec<Row>)>> {
        let inner = &self.inner;
        bounded_within(inner, within, context, async {
            let mut client = inner.pool.get().await.map_err(|e| pool_error(context, e))?;
            let tx = client
                .transaction()
                .await
                .map_err(|e| db_error(context, e))?;
            let prepared = async |sql: &str| {
                tx.prepare_cached(sql)
                    .await
                    .map_err(|e| db_error(context, e))
            };
            let query = async |sql: &str, params: &[&(dyn ToSql + Sync)]| {
                tx.query(&prepared(sql).await?, params)
                    .await
                    .map_err(|e| Self::statement_error(inner, context, e))
            };
            // A transaction given longer than the operation timeout has its statements
            // bounded as long (as the sessions' are: a tenth below the client's bound).
            if let Some(within) = within.filter(|w| *w > inner.operation_timeout) {
                tx.batch_execute(&format!(
                    "SET LOCAL statement_timeout = {}",
                    (within * 9 / 10).as_millis()
                ))
                .await
                .map_err(|e| db_error(context, e))?;
            }
            // Sent with the transaction's first statement rather than in a round trip of its
            // own: the server runs them in the order sent.
            let mut durable = Some(tx.batch_execute(DURABLE_COMMIT));
            if let Some(guard) = guard {
                let mut allowed = Vec::new();
                for (sql, params) in guard {
                    allowed = after_durable(context, &mut durable, query(sql, params)).await?;
                }
                if allowed.is_empty() {
                    // Dropped unfinished: rolled back.
                    return Ok(None);
                }
            }
            let mut counts = Vec::with_capacity(steps.len());
            for (sql, params) in steps {
                let execute = async {
                    tx.execute(&prepared(sql).await?, params)
                        .await
                        .map_err(|e| Self::statement_error(inner, context, e))
                };
                counts.push(after_durable(context, &mut durable, execute).await?);
            }
            let mut rows = Vec::new();
            if let Some((sql, params)) = query_step {
                rows = after_durable(context, &mut durable, query(sql, params)).await?;
            }
            // A transaction with no statement still commits durably.
            if let Some(setting) = durable.take() {
                setting.await.map_err(|e| db_error(context, e))?;
            }
            drop(durable);
            tx.commit().await.map_err(|e| db_error(context, e))?;
            Ok(Some((counts, rows)))
        })
        .await
    }

    /// Runs idempotent DDL in one transaction, serialized against concurrent migrations
    /// (the same lock as [`PgStore::migrate`]).
    pub async fn migrate_extra(&self, ddl: &str) -> StoreResult<()> {
        self.apply_ddl(ddl).await
    }
}

/// `statement`, sent together with the durable-commit setting while that is unsent (the
/// setting first): one round trip for both. The setting's error comes first, being the
/// cause of the statement's ("current transaction is aborted").
async fn after_durable<T, D>(
    context: &'static str,
    durable: &mut Option<D>,
    statement: impl std::future::Future<Output = StoreResult<T>>,
) -> StoreResult<T>
where
    D: std::future::Future<Output = Result<(), tokio_postgres::Error>>,
{
    match durable.take() {
        None => statement.await,
        Some(setting) => {
            let (set, result) = futures::join!(setting, statement);
            set.map_err(|e| db_error(context, e))?;
            result
        }
    }
}
