//! The configured store: settings turned into a store and a capture (`settings.rs`,
//! `capture.rs`), made ready to run on (`ready.rs`), and the operations only the CLI needs.

use std::sync::Arc;

use anyhow::Context;
use outbox_core::migration::{judge, Found, Steps, Verdict};
use outbox_core::store::NodeRegistry;
use outbox_core::OutboxStore;
use outbox_store_mysql::{MySqlOptions, MySqlStore};
use outbox_store_postgres::mapped::MappedPgOptions;
use outbox_store_postgres::{MappedPgStore, PgOptions, PgStore};
use outbox_store_sqlite::SqliteStore;

use crate::error::failure;

mod binlog;
mod capture;
mod ready;
pub mod settings;

pub use binlog::{BinlogCapture, BinlogRun, BinlogSettings};
pub use capture::{Capture, CaptureRun, CapturedTable};
pub use ready::{ready_store, retry_transient_telling};

/// The backlog as `stats` and the admin API show it.
pub struct BacklogReport {
    /// In total.
    pub backlog: outbox_core::store::Backlog,
    pub destinations: Vec<outbox_core::store::DestinationStats>,
}

/// One of the stores, with the operations only the CLI needs (DDL, migration).
#[derive(Clone)]
pub enum AnyStore {
    Postgres(PgStore),
    /// The native table on PostgreSQL, read through logical replication (`--capture wal`).
    PostgresWal(PgStore, Capture),
    /// A seed's table or a custom mapping on PostgreSQL.
    MappedPostgres(MappedPgStore),
    /// MySQL 8 / MariaDB: the native layout or a mapped table.
    MySql(MySqlStore),
    /// The native table on MySQL/MariaDB, read from the binary log (`--capture binlog`).
    MySqlBinlog(MySqlStore, Box<BinlogCapture>),
    Sqlite(SqliteStore),
}

impl AnyStore {
    /// What `check` verified of the schema when it found nothing wrong: MySQL and SQLite
    /// have no trigger of the relay's (it said it checked one there).
    pub fn verified_objects(&self) -> &'static str {
        match self {
            AnyStore::Postgres(_) | AnyStore::PostgresWal(..) | AnyStore::MappedPostgres(_) => {
                "tables, trigger and privileges"
            }
            AnyStore::MySql(_) | AnyStore::MySqlBinlog(..) => "tables and privileges",
            AnyStore::Sqlite(_) => "tables",
        }
    }
}

/// Which store to open and how, resolved from the settings by [`crate::config::Config::store_settings`].
#[derive(Clone, Debug)]
pub enum StoreSettings {
    Postgres(Box<PostgresSettings>),
    MySql(Box<MySqlOptions>),
    MySqlBinlog(Box<MySqlOptions>, BinlogSettings),
    Sqlite {
        path: std::path::PathBuf,
        retain_delivered: bool,
    },
}

/// The PostgreSQL part of [`StoreSettings`].
#[derive(Clone, Debug)]
pub struct PostgresSettings {
    pub options: PgOptions,
    /// A seed's table or a custom mapping, and the layout's name; `None`: the native layout.
    pub mapped: Option<(outbox_layout::Mapping, String)>,
    pub max_attempts: u32,
    /// `--capture wal` (native layout only).
    pub capture: Option<Capture>,
}

/// The store behind `any` as the trait object the calling method returns: every store is
/// an `OutboxStore`, a `NodeRegistry` and an `Operations`, so one match serves all three.
macro_rules! shared_store {
    ($any:expr) => {
        match $any {
            AnyStore::Postgres(s) | AnyStore::PostgresWal(s, _) => Arc::new(s.clone()),
            AnyStore::MappedPostgres(s) => Arc::new(s.clone()),
            AnyStore::MySql(s) | AnyStore::MySqlBinlog(s, _) => Arc::new(s.clone()),
            AnyStore::Sqlite(s) => Arc::new(s.clone()),
        }
    };
}

impl AnyStore {
    pub fn open(settings: StoreSettings) -> anyhow::Result<Self> {
        let report = |e: outbox_core::StoreError| failure(e.report(), &e);
        match settings {
            StoreSettings::Postgres(pg) => {
                let PostgresSettings {
                    options,
                    mapped,
                    max_attempts,
                    capture,
                } = *pg;
                if let Some((mapping, layout)) = mapped {
                    // Every layout wakes on the channel in `options` (the seed's own for adbc).
                    let store = MappedPgStore::new(MappedPgOptions {
                        pg: options,
                        mapping,
                        layout,
                        max_attempts,
                    })
                    .map_err(report)?;
                    return Ok(AnyStore::MappedPostgres(store));
                }
                let store = PgStore::new(options).map_err(report)?;
                Ok(match capture {
                    Some(capture) => AnyStore::PostgresWal(store, capture),
                    None => AnyStore::Postgres(store),
                })
            }
            StoreSettings::MySql(options) => {
                Ok(AnyStore::MySql(MySqlStore::new(*options).map_err(report)?))
            }
            StoreSettings::MySqlBinlog(options, binlog) => {
                let capture = BinlogCapture::new(&options, &binlog).map_err(report)?;
                let main = MySqlStore::new(*options).map_err(report)?;
                Ok(AnyStore::MySqlBinlog(main, Box::new(capture)))
            }
            StoreSettings::Sqlite {
                path,
                retain_delivered,
            } => {
                let store = SqliteStore::open(&path, retain_delivered)
                    .map_err(report)
                    .with_context(|| format!("opening {}", path.display()))?;
                Ok(AnyStore::Sqlite(store))
            }
        }
    }

    pub fn outbox(&self) -> Arc<dyn OutboxStore> {
        shared_store!(self)
    }

    /// Partition leases: PostgreSQL only (SQLite is the single-node store).
    pub fn partition_registry(&self) -> Option<Arc<dyn outbox_core::store::PartitionRegistry>> {
        match self {
            AnyStore::Postgres(s) => Some(Arc::new(s.clone())),
            // Mapped layouts run one active relay per table (see MappedPgStore); WAL capture
            // one active consumer per slot.
            AnyStore::PostgresWal(..)
            | AnyStore::MappedPostgres(_)
            | AnyStore::MySql(_)
            | AnyStore::MySqlBinlog(..)
            | AnyStore::Sqlite(_) => None,
        }
    }

    /// The task that keeps `ownership` in step with a mapped table's active-relay lock
    /// (MySQL's native table included), for as long as it runs; `None` for the stores
    /// without one (binlog capture's parked table is claimed through the capture).
    pub fn keep_active(
        &self,
        ownership: Arc<outbox_core::Ownership>,
        lease: std::time::Duration,
        health: Arc<outbox_core::Health>,
    ) -> Option<futures::future::BoxFuture<'static, ()>> {
        use futures::FutureExt;
        match self {
            AnyStore::MappedPostgres(s) => {
                Some(s.clone().keep_active(ownership, lease, health).boxed())
            }
            AnyStore::MySql(s) => Some(s.clone().keep_active(ownership, lease, health).boxed()),
            AnyStore::Postgres(_)
            | AnyStore::PostgresWal(..)
            | AnyStore::MySqlBinlog(..)
            | AnyStore::Sqlite(_) => None,
        }
    }

    /// Dead letters, replays and event lookups. Binlog capture's dead letters are rows of its
    /// parked table.
    pub fn operations(&self) -> Arc<dyn outbox_core::store::Operations> {
        match self {
            AnyStore::MySqlBinlog(_, capture) => Arc::new(capture.parked.clone()),
            other => shared_store!(other),
        }
    }

    pub fn registry(&self) -> Arc<dyn NodeRegistry> {
        shared_store!(self)
    }

    /// SQLite is the embedded default: it always creates its own tables.
    pub fn creates_tables_implicitly(&self) -> bool {
        matches!(self, AnyStore::Sqlite(_))
    }

    /// Applies the steps the database lacks, component by component. A schema a newer
    /// relay migrated, which this one cannot run on, is refused before anything is applied
    /// (this relay would otherwise put back its own trigger and capture objects).
    pub async fn migrate(&self) -> Result<(), outbox_core::StoreError> {
        for (steps, found) in self.schema_components().await? {
            if found.version() > steps.latest() {
                judge(&steps, found, "migrate")?;
            }
        }
        match self {
            AnyStore::Postgres(s) => s.migrate().await,
            AnyStore::PostgresWal(s, capture) => {
                if let Some(source) = &capture.source {
                    s.migrate_extra(&source.ddl()).await?;
                }
                s.migrate().await?;
                let wal = capture.tables(s);
                s.migrate_component(&wal.steps(), &wal.parked, wal.concurrent_indexes())
                    .await?;
                // The publication's tables and a mapped source follow the settings: applied
                // again on every migrate (idempotent).
                s.migrate_extra(&wal.ddl()).await
            }
            AnyStore::MappedPostgres(s) => s.migrate().await,
            AnyStore::MySql(s) => s.migrate().await,
            AnyStore::MySqlBinlog(s, capture) => {
                use outbox_layout::store::MappedDb;
                // A custom mapping with nothing of the polling store's to create still
                // gets capture's own tables.
                if s.db().steps(s.sql()).is_some() {
                    s.migrate().await?;
                }
                // Idempotent, and applied again by every migrate.
                s.db().batch_execute(&capture.ddl()).await?;
                capture.upgrade().await
            }
            AnyStore::Sqlite(s) => s.migrate().await,
        }
    }

    /// The versioned components of this store's schema: each one's steps and what the
    /// database holds of it. Mapped PostgreSQL layouts have none: a seed's table is the
    /// seed's, and what the relay adds to it is re-applied by every `migrate`.
    pub async fn schema_components(&self) -> Result<Vec<(Steps, Found)>, outbox_core::StoreError> {
        Ok(match self {
            AnyStore::Postgres(s) => vec![(s.tables().steps(), s.schema_found().await?)],
            AnyStore::PostgresWal(s, capture) => {
                let wal = capture.tables(s);
                vec![
                    (s.tables().steps(), s.schema_found().await?),
                    (wal.steps(), s.component_found("wal", &wal.parked).await?),
                ]
            }
            AnyStore::MappedPostgres(_) => Vec::new(),
            AnyStore::MySql(s) | AnyStore::MySqlBinlog(s, _) => match s.db().steps(s.sql()) {
                Some(steps) => vec![(steps, s.db().schema_found(s.sql()).await?)],
                None => Vec::new(),
            },
            AnyStore::Sqlite(s) => vec![(
                outbox_store_sqlite::schema::steps(),
                s.schema_found().await?,
            )],
        })
    }

    /// Judges each component's recorded version: a line for each that this relay runs on
    /// (`check` prints them, `run` logs them), or the [`StoreErrorKind::SchemaVersion`]
    /// error `run` refuses with (exit 2), naming `migrate` or the upgrade.
    ///
    /// [`StoreErrorKind::SchemaVersion`]: outbox_core::StoreErrorKind::SchemaVersion
    pub async fn schema_versions(&self) -> Result<Vec<(Verdict, String)>, outbox_core::StoreError> {
        let what = self.outbox().describe();
        let mut lines = Vec::new();
        for (steps, found) in self.schema_components().await? {
            let component = steps.component;
            let latest = steps.latest();
            let verdict = judge(&steps, found, &what)?;
            lines.push((
                verdict,
                match verdict {
                    Verdict::Current => format!("{component} schema at version {latest}"),
                    Verdict::Missing => format!("{component} schema not created yet"),
                    Verdict::NewerReadable { version } => format!(
                        "{component} schema at version {version}, newer than this relay's \
                     {latest}; its later steps leave this relay's statements working"
                    ),
                },
            ));
        }
        Ok(lines)
    }

    /// The least-privilege GRANTs of the relay's run-time role `role`: what `migrate
    /// --print --role` shows and `migrate --grant-to` applies. `None` for SQLite, which has
    /// no roles.
    pub fn grants(&self, role: &str) -> Option<String> {
        Some(match self {
            AnyStore::Postgres(s) => s.tables().grants(role),
            AnyStore::PostgresWal(s, capture) => format!(
                "{}\n{}",
                s.tables().grants(role),
                capture.tables(s).grants(role)
            ),
            AnyStore::MappedPostgres(s) => s.grants(role),
            AnyStore::MySql(s) => s.grants(role),
            AnyStore::MySqlBinlog(s, capture) => {
                format!("{}\n{}", s.grants(role), capture.grants(role))
            }
            AnyStore::Sqlite(_) => return None,
        })
    }

    /// Runs a script of several statements (the grants) on the store's database.
    pub async fn execute_script(&self, sql: &str) -> Result<(), outbox_core::StoreError> {
        match self {
            AnyStore::Postgres(s) | AnyStore::PostgresWal(s, _) => s.batch_execute(sql).await,
            AnyStore::MappedPostgres(s) => s.batch_execute(sql).await,
            AnyStore::MySql(s) | AnyStore::MySqlBinlog(s, _) => s.batch_execute(sql).await,
            AnyStore::Sqlite(_) => Ok(()),
        }
    }

    /// The DDL and grants `migrate --print` shows: against a database it can ask, only the
    /// steps that database lacks; otherwise every step.
    pub async fn printable_ddl(&self, role: &str) -> String {
        // Bounded: `--print` is also how a schema is reviewed with no database at hand.
        let asked = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            self.outbox().ping().await?;
            self.schema_components().await
        })
        .await;
        let (found, note): (Vec<Option<Found>>, String) = match asked {
            Ok(Ok(components)) => (
                components.iter().map(|(_, f)| Some(*f)).collect(),
                "-- The steps this database lacks (its version is in the versions table).\n"
                    .to_string(),
            ),
            Ok(Err(e)) => (
                Vec::new(),
                format!(
                    "-- The database could not be asked ({}): every step follows, each idempotent.\n",
                    e.report().replace('\n', " ")
                ),
            ),
            Err(_) => (
                Vec::new(),
                "-- The database did not answer within 5 s: every step follows, each idempotent.\n"
                    .to_string(),
            ),
        };
        let found_at = |i: usize| found.get(i).copied().flatten();
        let mysql_steps = |s: &MySqlStore| match s.db().steps(s.sql()) {
            Some(steps) => format!(
                "{note}{}",
                outbox_store_mysql::MySql::printable_steps(s.sql(), &steps, found_at(0))
            ),
            None => "-- A custom mapping runs on the application's own table: nothing to create.\n"
                .into(),
        };
        match self {
            AnyStore::Postgres(s) => format!(
                "{note}{}\n{}\n{}",
                s.printable_steps(&s.tables().steps(), found_at(0)),
                s.tables().wakeup_ddl(),
                self.grants(role).unwrap_or_default()
            ),
            AnyStore::PostgresWal(s, capture) => {
                let wal = capture.tables(s);
                let source = capture.source.as_deref().map(CapturedTable::ddl);
                let wal_steps = wal.steps();
                let wal_current = found_at(1).is_some_and(|f| f.version() >= wal_steps.latest());
                let again = if wal_current {
                    format!(
                        "-- Applied again by every migrate (it follows the settings):\n{}",
                        wal.ddl()
                    )
                } else {
                    String::new()
                };
                format!(
                    "{note}{}{}\n{}\n{}\n{again}\n{}",
                    source.unwrap_or_default(),
                    s.printable_steps(&s.tables().steps(), found_at(0)),
                    s.tables().wakeup_ddl(),
                    s.printable_steps(&wal_steps, found_at(1)),
                    self.grants(role).unwrap_or_default()
                )
            }
            AnyStore::MappedPostgres(s) => format!(
                "{}\n{}",
                s.ddl().unwrap_or_default(),
                self.grants(role).unwrap_or_default()
            ),
            AnyStore::MySql(s) => format!(
                "{}\n{}",
                mysql_steps(s),
                self.grants(role).unwrap_or_default()
            ),
            AnyStore::MySqlBinlog(s, capture) => format!(
                "{}{}\n-- Binlog capture's own tables, applied again by every migrate:\n{}\n{}",
                capture.server_requirements(),
                mysql_steps(s),
                capture.ddl(),
                self.grants(role).unwrap_or_default()
            ),
            AnyStore::Sqlite(_) => format!(
                "-- SQLite has no roles: the relay needs read/write access to the database file\n-- and its directory (for the WAL).\n{note}{}",
                outbox_store_sqlite::schema::printable_steps(found_at(0))
            ),
        }
    }
}

impl AnyStore {
    /// Streams from the slot earlier versions named by default (`outbox_relay`), when no
    /// slot was configured and this database has that slot (pgoutput): an upgraded relay
    /// must not start a new slot, which would skip what the old one still holds. For a
    /// one-shot command: when the database cannot say (unreachable), the old name is kept,
    /// so that no slot of a new name is made or dropped on a guess. `run` asks until the
    /// database answers instead ([`AnyStore::legacy_slot_in_use`]).
    pub async fn keep_legacy_slot(&mut self) {
        let decided = self.legacy_slot_in_use().await;
        let AnyStore::PostgresWal(_, capture) = self else {
            return;
        };
        let Some(legacy) = capture.legacy_slot.clone() else {
            return;
        };
        let keep = decided.unwrap_or_else(|e| {
            tracing::warn!(error = %e.report(), slot = %legacy, "cannot tell whether this database has the slot earlier versions made; keeping that name");
            true
        });
        self.use_legacy_slot(keep);
    }

    /// Whether this database has the slot earlier versions made by default, to be streamed
    /// from ([`AnyStore::keep_legacy_slot`]); false when there is nothing to ask. An error:
    /// the database could not say.
    pub async fn legacy_slot_in_use(&self) -> Result<bool, outbox_core::StoreError> {
        let AnyStore::PostgresWal(pg, capture) = self else {
            return Ok(false);
        };
        let Some(legacy) = &capture.legacy_slot else {
            return Ok(false);
        };
        let status = outbox_wal::slot_status(pg, legacy).await?;
        Ok(status.is_some_and(|s| s.in_this_database && s.plugin.as_deref() == Some("pgoutput")))
    }

    /// Settles the slot's name: the earlier versions' default if `keep`, else the
    /// configured one (named per database and table).
    pub fn use_legacy_slot(&mut self, keep: bool) {
        let AnyStore::PostgresWal(_, capture) = self else {
            return;
        };
        let Some(legacy) = capture.legacy_slot.take() else {
            return;
        };
        if keep {
            tracing::info!(
                slot = %legacy,
                "streaming from the slot an earlier version made (its default name); new \
                 installations name their slot after the database and table"
            );
            capture.slot = legacy;
        }
    }

    /// The backlog in total and per destination, as `stats` and the admin API show it: with
    /// WAL capture, what waits in the parked table is pending too (dead letters counted
    /// once); with binlog capture, the rows in the outbox table are.
    pub async fn backlog_report(&self) -> Result<BacklogReport, outbox_core::StoreError> {
        // A BLACKHOLE outbox (binlog capture's table-less form) holds no row to count.
        let table_less = match self {
            AnyStore::MySqlBinlog(_, capture) => capture.is_blackhole().await?,
            _ => false,
        };
        let mut backlog = if table_less {
            outbox_core::store::Backlog::default()
        } else {
            self.outbox().backlog().await?
        };
        let parked = match self {
            AnyStore::PostgresWal(pg, capture) => Some(capture.parked_stats(pg).await?),
            AnyStore::MySqlBinlog(..) if table_less => None,
            AnyStore::MySqlBinlog(main, _) => {
                use outbox_core::store::Operations;
                // Dead letters and parked rows are in the parked table (`operations`); what
                // the outbox table holds is pending, not read or not settled yet.
                Some(main.destination_stats().await?)
            }
            _ => None,
        };
        let mut destinations = self.operations().destination_stats().await?;
        if let Some(parked) = parked {
            for parked in parked {
                match destinations
                    .iter_mut()
                    .find(|d| d.destination == parked.destination)
                {
                    Some(d) => {
                        d.pending += parked.pending;
                        d.retrying += parked.retrying;
                        d.oldest_pending_age = d.oldest_pending_age.max(parked.oldest_pending_age);
                    }
                    None => destinations
                        .push(outbox_core::store::DestinationStats { dead: 0, ..parked }),
                }
            }
            backlog.pending = destinations.iter().map(|d| d.pending).sum();
            backlog.retrying = destinations.iter().map(|d| d.retrying).sum();
            backlog.oldest_pending_age = destinations
                .iter()
                .filter_map(|d| d.oldest_pending_age)
                .max();
        }
        Ok(BacklogReport {
            backlog,
            destinations,
        })
    }

    /// What only `check` looks for, beside [`AnyStore::verify`]: looks that touch a WAL
    /// capture's slot ([`outbox_wal::decoding_problems`]), which a relay's every start
    /// should not, and whether the relay may write an SQLite database (which `stats` and
    /// `dead list` need not).
    pub async fn check_only_problems(&self) -> Vec<outbox_core::store::Problem> {
        match self {
            AnyStore::PostgresWal(s, capture) => {
                let source = capture.source.as_deref().map(CapturedTable::source);
                outbox_wal::decoding_problems(s, &capture.publication, &capture.slot, source).await
            }
            AnyStore::Sqlite(s) => match s.unwritable_problem().await {
                Ok(problem) => problem.into_iter().collect(),
                Err(e) => vec![outbox_core::store::Problem::blocking(
                    format!(
                        "could not tell whether the relay may write the database: {}",
                        e.report()
                    ),
                    outbox_store_sqlite::READ_ONLY_HINT,
                )],
            },
            _ => Vec::new(),
        }
    }

    /// What keeps the store from working, each with its fix.
    pub async fn verify(
        &self,
    ) -> Result<Vec<outbox_core::store::Problem>, outbox_core::StoreError> {
        match self {
            AnyStore::PostgresWal(s, capture) => {
                let source = capture.source.as_deref().map(CapturedTable::source);
                outbox_wal::verify_capture(s, &capture.publication, &capture.slot, source).await
            }
            AnyStore::MySqlBinlog(s, capture) => {
                // A table that stores nothing has none of the polling store's columns.
                let mut problems = if capture.is_blackhole().await? {
                    capture.blackhole_table_problems().await?
                } else {
                    s.verify().await?
                };
                problems.extend(capture.parked.verify().await?);
                problems.extend(capture.problems().await?);
                Ok(problems)
            }
            other => other.outbox().verify().await,
        }
    }
}
