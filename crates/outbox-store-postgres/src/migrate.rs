//! `migrate`: the steps a database lacks ([`outbox_core::migration`]), each recorded in
//! `<outbox>_versions` as it completes, on a session of its own that holds the
//! migrate lock.

use std::time::Duration;

use outbox_core::ident::TableName;
use outbox_core::migration::{Found, Run, Steps};
use outbox_core::{Backoff, StoreError};

use crate::error::{db_error, pool_error};
use crate::{PgStore, StoreResult, Tables};

/// The advisory lock every `migrate` holds, whichever outbox it migrates.
const MIGRATE_LOCK: &str = "SELECT pg_try_advisory_lock(hashtext('outbox-relay migrate'))";
const MIGRATE_UNLOCK: &str = "SELECT pg_advisory_unlock(hashtext('outbox-relay migrate'))";

/// One component's steps and where they live.
pub struct Component<'a> {
    pub steps: &'a Steps,
    /// The outbox's names: the version table is `<outbox>_versions`.
    pub tables: &'a Tables,
    /// A table whose presence without a recorded version means a schema from before
    /// versions.
    pub probe: &'a TableName,
    /// Indexes built concurrently: an invalid one (an interrupted build) is dropped first.
    pub concurrent_indexes: Vec<String>,
    /// Indexes a step dropped that an older relay still creates (its `--auto-migrate`
    /// during a rolling upgrade): dropped at every migrate, whatever the recorded version.
    pub obsolete_indexes: Vec<String>,
}

/// A session of its own, outside the pool: it holds a session-level lock, which must not
/// outlive `migrate` on a pooled connection; dropping it ends the session and the lock.
pub(crate) struct MigrateSession(deadpool_postgres::ClientWrapper);

impl MigrateSession {
    /// Opens the session and takes the migrate lock. The lock is tried, not waited for in
    /// SQL: a waiting statement holds a snapshot, and `CREATE INDEX CONCURRENTLY` in the
    /// session holding the lock waits for every older snapshot, so the two would deadlock.
    pub(crate) async fn open(store: &PgStore) -> StoreResult<Self> {
        let client = store
            .inner
            .pool
            .get()
            .await
            .map_err(|e| pool_error("migrate", e))?;
        let client = deadpool_postgres::Object::take(client);
        client
            // A migration (an index built over a large table) takes what it takes: the
            // pool's sessions end statements at the operation timeout.
            .batch_execute(
                "SET client_min_messages = warning; SET statement_timeout = 0; \
                 SET lock_timeout = 0",
            )
            .await
            .map_err(|e| db_error("migrate", e))?;
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        let mut said = false;
        loop {
            let row = client
                .query_one(MIGRATE_LOCK, &[])
                .await
                .map_err(|e| db_error("migrate", e))?;
            if row.get::<_, bool>(0) {
                return Ok(MigrateSession(client));
            }
            if !said {
                tracing::info!(
                    "waiting for another `outbox-relay migrate` on this database to finish"
                );
                said = true;
            }
            // Nothing to await: PostgreSQL offers no wait that holds no snapshot.
            tokio::time::sleep(backoff.next_delay()).await;
        }
    }

    pub(crate) async fn batch(&self, sql: &str) -> StoreResult<()> {
        self.0
            .batch_execute(sql)
            .await
            .map_err(|e| db_error("migrate", e))
    }

    pub(crate) async fn close(self) {
        // The session ends on drop anyway; unlocking first is only tidier.
        let _ = self.0.batch_execute(MIGRATE_UNLOCK).await;
    }

    /// What the database holds of the component.
    pub(crate) async fn found(&self, c: &Component<'_>) -> StoreResult<Found> {
        read_found(&self.0, &c.tables.versions, c.steps.component, c.probe).await
    }

    /// Applies the steps the database lacks, each recorded as it completes.
    pub(crate) async fn apply(&self, c: &Component<'_>) -> StoreResult<Found> {
        self.batch(&c.tables.version_table_ddl()).await?;
        let found = self.found(c).await?;
        let latest = c.steps.latest();
        if let Found::At { version, .. } = found {
            if version > latest {
                // A newer relay migrated it: its steps are unknown here, and none is undone.
                return Ok(found);
            }
        }
        for step in c.steps.after(found.version()) {
            let record = c.tables.record_version(
                c.steps.component,
                step.version,
                c.steps.readable_from(step.version),
            );
            match step.run {
                Run::InTransaction => {
                    let mut sql = String::from("BEGIN;\n");
                    for s in &step.statements {
                        sql.push_str(s);
                        sql.push('\n');
                    }
                    sql.push_str(&record);
                    sql.push_str("COMMIT;");
                    if let Err(e) = self.batch(&sql).await {
                        let _ = self.0.batch_execute("ROLLBACK").await;
                        return Err(step_failed(c, step.version, e));
                    }
                }
                Run::Alone => {
                    self.drop_invalid(&c.concurrent_indexes)
                        .await
                        .map_err(|e| step_failed(c, step.version, e))?;
                    for s in &step.statements {
                        self.batch(s)
                            .await
                            .map_err(|e| step_failed(c, step.version, e))?;
                    }
                    self.batch(&record)
                        .await
                        .map_err(|e| step_failed(c, step.version, e))?;
                }
            }
            tracing::info!(
                component = c.steps.component,
                version = step.version,
                "schema step applied: {}",
                step.summary
            );
        }
        self.rebuild_lost_indexes(c, found.version())
            .await
            .map_err(|e| step_failed(c, latest, e))?;
        self.drop_obsolete(&c.obsolete_indexes)
            .await
            .map_err(|e| step_failed(c, latest, e))?;
        Ok(Found::At {
            version: latest,
            readable_from: c.steps.readable_from(latest),
        })
    }

    /// Builds again the indexes of steps recorded before this migration (up to `recorded`)
    /// that are gone or invalid since: dropped by hand, a restore without them, a rebuild
    /// (`REINDEX CONCURRENTLY`) interrupted. `check` and `run` refuse to run without them
    /// and name `migrate` as the fix, whose steps were all recorded, so it did nothing. The
    /// index steps are idempotent (`IF NOT EXISTS`), and run again whole.
    async fn rebuild_lost_indexes(&self, c: &Component<'_>, recorded: u32) -> StoreResult<()> {
        let mut lost = Vec::new();
        for index in &c.concurrent_indexes {
            let row = self
                .0
                .query_one(
                    "SELECT NOT coalesce((SELECT indisvalid FROM pg_index
                                           WHERE indexrelid = to_regclass($1)), false)",
                    &[index],
                )
                .await
                .map_err(|e| db_error("migrate", e))?;
            if row.get::<_, bool>(0) {
                lost.push(index.as_str());
            }
        }
        if lost.is_empty() {
            return Ok(());
        }
        tracing::warn!(indexes = ?lost, "building again indexes that are gone or invalid since their step was recorded");
        self.drop_invalid(&c.concurrent_indexes).await?;
        let index_steps = c
            .steps
            .steps
            .iter()
            .filter(|step| step.version <= recorded && matches!(step.run, Run::Alone));
        for step in index_steps {
            for statement in &step.statements {
                self.batch(statement).await?;
            }
        }
        Ok(())
    }

    /// Drops each of `indexes` that exists.
    async fn drop_obsolete(&self, indexes: &[String]) -> StoreResult<()> {
        for index in indexes {
            let row = self
                .0
                .query_one("SELECT to_regclass($1) IS NOT NULL", &[index])
                .await
                .map_err(|e| db_error("migrate", e))?;
            if row.get::<_, bool>(0) {
                tracing::warn!(%index, "dropping an index a step had dropped, which an older relay made again");
                self.batch(&format!("DROP INDEX CONCURRENTLY IF EXISTS {index}"))
                    .await?;
            }
        }
        Ok(())
    }

    /// Drops each of `indexes` that an interrupted concurrent build left invalid, so that
    /// the step's `IF NOT EXISTS` builds it again instead of keeping a useless one.
    async fn drop_invalid(&self, indexes: &[String]) -> StoreResult<()> {
        for index in indexes {
            let row = self
                .0
                .query_one(
                    "SELECT coalesce((SELECT NOT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)), false)",
                    &[index],
                )
                .await
                .map_err(|e| db_error("migrate", e))?;
            if row.get::<_, bool>(0) {
                tracing::warn!(%index, "dropping an index an interrupted migration left invalid, to build it again");
                self.batch(&format!("DROP INDEX CONCURRENTLY IF EXISTS {index}"))
                    .await?;
            }
        }
        Ok(())
    }
}

fn step_failed(c: &Component<'_>, version: u32, e: StoreError) -> StoreError {
    let kind = e.kind();
    let failed = StoreError::new(
        kind,
        format!(
            "{} schema step {version} failed (the steps before it are recorded; `migrate` \
             again resumes here)",
            c.steps.component
        ),
    )
    .with_source(e);
    with_lock_hint(failed)
}

/// A migration's statement that gave up waiting for a lock says to run `migrate` again once
/// the transaction holding it ends.
pub(crate) fn with_lock_hint(e: StoreError) -> StoreError {
    match e.kind() {
        outbox_core::StoreErrorKind::Conflict => {
            e.with_hint(outbox_core::migration::STEP_LOCK_HINT)
        }
        _ => e,
    }
}

/// What the database holds of `component`: its recorded version (where `probe` exists), or
/// whether `probe` exists without one.
pub(crate) async fn read_found(
    client: &tokio_postgres::Client,
    versions: &TableName,
    component: &str,
    probe: &TableName,
) -> StoreResult<Found> {
    let versions_quoted = versions.quoted();
    let row = client
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL",
            &[&versions_quoted, &probe.quoted()],
        )
        .await
        .map_err(|e| db_error("reading the schema version", e))?;
    let (has_versions, has_probe) = (row.get::<_, bool>(0), row.get::<_, bool>(1));
    // A version recorded for tables that are gone (an outbox dropped by hand) stands for
    // nothing: every step runs again (each is idempotent). Trusted, it made `migrate` skip
    // them, and its "table does not exist" error told to run `migrate`.
    if has_versions && has_probe {
        let rows = client
            .query(
                &format!(
                    "SELECT version, readable_from FROM {versions_quoted} WHERE component = $1"
                ),
                &[&component],
            )
            .await
            .map_err(|e| db_error("reading the schema version", e))?;
        if let Some(row) = rows.first() {
            return Found::recorded(
                row.get::<_, i32>(0).into(),
                row.get::<_, i32>(1).into(),
                || format!("{versions} holds a negative version for {component}"),
            );
        }
    }
    Ok(if has_probe {
        Found::Unversioned
    } else {
        Found::Nothing
    })
}
