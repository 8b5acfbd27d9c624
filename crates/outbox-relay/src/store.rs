//! Builds the configured store.

use std::sync::Arc;

use anyhow::Context;
use outbox_core::store::NodeRegistry;
use outbox_core::OutboxStore;
use outbox_store_mysql::{MySqlOptions, MySqlStore};
use outbox_store_postgres::mapped::MappedPgOptions;
use outbox_store_postgres::{MappedPgStore, PgOptions, PgStore, Tables};
use outbox_store_sqlite::SqliteStore;

use crate::config::{CaptureMode, Config, DatabaseKind};

/// The replication slot and publication of `--capture wal`.
#[derive(Clone, Debug)]
pub struct Capture {
    pub slot: String,
    pub publication: outbox_core::ident::Ident,
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
    Sqlite(SqliteStore),
}

impl AnyStore {
    pub fn open(config: &Config) -> anyhow::Result<Self> {
        match config.database_kind()? {
            DatabaseKind::Postgres => {
                let mut tables = pg_tables(config)?;
                tables.partition_count = config.partitions;
                tables.gated_wakeup = config.wakeup == crate::config::WakeupMode::Gated;
                // WAL capture needs no NOTIFY: the stream wakes the relay.
                tables.poll_wakeup = config.wakeup == crate::config::WakeupMode::Poll
                    || config.capture == CaptureMode::Wal;
                let options = PgOptions {
                    url: config.database_url.clone(),
                    tables,
                    retain_delivered: config.retain_delivered,
                    ca_file: config.database_ca_file.clone(),
                    pool_size: config.pool_size,
                    application_name: Some(match &config.node_id {
                        Some(node) => format!("outbox-relay {node}"),
                        None => "outbox-relay".into(),
                    }),
                    operation_timeout: None,
                };
                if let Some(mapping) = config.layout_mapping()? {
                    // Every layout wakes on the channel in `options` (the seed's own for adbc).
                    let store = MappedPgStore::new(MappedPgOptions {
                        pg: options,
                        mapping,
                        layout: config.layout.to_string(),
                        max_attempts: config.retry.max_attempts,
                    })
                    .map_err(|e| crate::commands::failure(e.report(), &e))?;
                    return Ok(AnyStore::MappedPostgres(store));
                }
                let store =
                    PgStore::new(options).map_err(|e| crate::commands::failure(e.report(), &e))?;
                if config.capture == CaptureMode::Wal {
                    let publication =
                        outbox_core::ident::Ident::new(&config.publication, "publication name")
                            .map_err(|e| crate::commands::failure(e.report(), &e))?;
                    let capture = Capture {
                        slot: config.slot.clone(),
                        publication,
                    };
                    return Ok(AnyStore::PostgresWal(store, capture));
                }
                Ok(AnyStore::Postgres(store))
            }
            DatabaseKind::MySql => {
                // PostgreSQL-only layouts were refused with the configuration (`validate`).
                let Some(mapping) = config.layout_mapping()? else {
                    anyhow::bail!("every MySQL layout is a mapping");
                };
                let store = MySqlStore::new(MySqlOptions {
                    url: config.database_url.clone(),
                    mapping,
                    layout: config.layout.to_string(),
                    max_attempts: config.retry.max_attempts,
                    pool_size: config.pool_size,
                    nodes_table: (config.layout == outbox_layout::LayoutKind::Native)
                        .then(|| config.layout_tables().nodes_table),
                })
                .map_err(|e| crate::commands::failure(e.report(), &e))?;
                Ok(AnyStore::MySql(store))
            }
            DatabaseKind::Sqlite(path) => {
                // Other layouts and table names were refused with the configuration (`validate`).
                let store = SqliteStore::open(&path, config.retain_delivered)
                    .map_err(|e| crate::commands::failure(e.report(), &e))
                    .with_context(|| format!("opening {}", path.display()))?;
                Ok(AnyStore::Sqlite(store))
            }
        }
    }

    pub fn outbox(&self) -> Arc<dyn OutboxStore> {
        match self {
            AnyStore::Postgres(s) | AnyStore::PostgresWal(s, _) => Arc::new(s.clone()),
            AnyStore::MappedPostgres(s) => Arc::new(s.clone()),
            AnyStore::MySql(s) => Arc::new(s.clone()),
            AnyStore::Sqlite(s) => Arc::new(s.clone()),
        }
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
            | AnyStore::Sqlite(_) => None,
        }
    }

    pub fn operations(&self) -> Arc<dyn outbox_core::store::Operations> {
        match self {
            AnyStore::Postgres(s) | AnyStore::PostgresWal(s, _) => Arc::new(s.clone()),
            AnyStore::MappedPostgres(s) => Arc::new(s.clone()),
            AnyStore::MySql(s) => Arc::new(s.clone()),
            AnyStore::Sqlite(s) => Arc::new(s.clone()),
        }
    }

    pub fn registry(&self) -> Arc<dyn NodeRegistry> {
        match self {
            AnyStore::Postgres(s) | AnyStore::PostgresWal(s, _) => Arc::new(s.clone()),
            AnyStore::MappedPostgres(s) => Arc::new(s.clone()),
            AnyStore::MySql(s) => Arc::new(s.clone()),
            AnyStore::Sqlite(s) => Arc::new(s.clone()),
        }
    }

    /// SQLite is the embedded default: it always creates its own tables.
    pub fn creates_tables_implicitly(&self) -> bool {
        matches!(self, AnyStore::Sqlite(_))
    }

    pub async fn migrate(&self) -> Result<(), outbox_core::StoreError> {
        match self {
            AnyStore::Postgres(s) => s.migrate().await,
            AnyStore::PostgresWal(s, capture) => {
                s.migrate().await?;
                s.migrate_extra(&capture.tables(s).ddl()).await
            }
            AnyStore::MappedPostgres(s) => s.migrate().await,
            AnyStore::MySql(s) => s.migrate().await,
            AnyStore::Sqlite(s) => s.migrate().await,
        }
    }

    /// The DDL and grants `migrate --print` shows.
    pub fn printable_ddl(&self, role: &str) -> String {
        match self {
            AnyStore::Postgres(s) => {
                format!("{}\n{}", s.tables().ddl(), s.tables().grants(role))
            }
            AnyStore::PostgresWal(s, capture) => {
                let wal = capture.tables(s);
                format!(
                    "{}\n{}\n{}\n{}",
                    s.tables().ddl(),
                    wal.ddl(),
                    s.tables().grants(role),
                    wal.grants(role)
                )
            }
            AnyStore::MappedPostgres(s) => {
                format!("{}\n{}", s.ddl().unwrap_or_default(), s.grants(role))
            }
            AnyStore::MySql(s) => format!(
                "{}\n{}",
                s.ddl().unwrap_or_else(|| "-- A custom mapping runs on the application's own table: nothing to create.\n".into()),
                s.grants(role)
            ),
            AnyStore::Sqlite(_) => format!(
                "-- SQLite has no roles: the relay needs read/write access to the database file\n-- and its directory (for the WAL).\n{}",
                SqliteStore::ddl()
            ),
        }
    }
}

impl AnyStore {
    /// What keeps the store from working, each with its fix.
    pub async fn verify(
        &self,
    ) -> Result<Vec<outbox_core::store::Problem>, outbox_core::StoreError> {
        match self {
            AnyStore::PostgresWal(s, capture) => {
                outbox_wal::verify_capture(s, &capture.publication, &capture.slot).await
            }
            other => other.outbox().verify().await,
        }
    }
}

impl Capture {
    fn tables(&self, store: &PgStore) -> outbox_wal::schema::CaptureTables {
        outbox_wal::capture::capture_tables(store.tables(), &self.publication)
    }
}

fn pg_tables(config: &Config) -> anyhow::Result<Tables> {
    let t = config.layout_tables();
    Tables::new(
        &t.outbox_schema,
        &t.outbox_table,
        &t.nodes_schema,
        &t.nodes_table,
        &t.notify_channel,
    )
    .map_err(|e| crate::commands::failure(e.report(), &e))
}
