//! Builds the configured store.

use std::sync::Arc;

use anyhow::Context;
use outbox_core::store::NodeRegistry;
use outbox_core::OutboxStore;
use outbox_store_postgres::{PgOptions, PgStore, Tables};
use outbox_store_sqlite::SqliteStore;

use crate::config::{Config, DatabaseKind};

/// One of the stores, with the operations only the CLI needs (DDL, migration).
#[derive(Clone)]
pub enum AnyStore {
    Postgres(PgStore),
    Sqlite(SqliteStore),
}

impl AnyStore {
    pub fn open(config: &Config) -> anyhow::Result<Self> {
        match config.database_kind()? {
            DatabaseKind::Postgres => {
                let mut tables = pg_tables(config)?;
                tables.partition_count = config.partitions;
                let store = PgStore::new(PgOptions {
                    url: config.database_url.clone(),
                    tables,
                    retain_delivered: config.retain_delivered,
                    ca_file: config.database_ca_file.clone(),
                    pool_size: config.pool_size,
                })
                .map_err(|e| anyhow::anyhow!(e.report()))?;
                Ok(AnyStore::Postgres(store))
            }
            DatabaseKind::Sqlite(path) => {
                if config.outbox_table != "outbox" || config.outbox_schema != "public" {
                    anyhow::bail!("custom table names are supported on PostgreSQL only; the SQLite store uses `outbox`");
                }
                let store = SqliteStore::open(&path, config.retain_delivered)
                    .map_err(|e| anyhow::anyhow!(e.report()))
                    .with_context(|| format!("opening {}", path.display()))?;
                Ok(AnyStore::Sqlite(store))
            }
        }
    }

    pub fn outbox(&self) -> Arc<dyn OutboxStore> {
        match self {
            AnyStore::Postgres(s) => Arc::new(s.clone()),
            AnyStore::Sqlite(s) => Arc::new(s.clone()),
        }
    }

    /// Partition leases: PostgreSQL only (SQLite is the single-node store).
    pub fn partition_registry(&self) -> Option<Arc<dyn outbox_core::store::PartitionRegistry>> {
        match self {
            AnyStore::Postgres(s) => Some(Arc::new(s.clone())),
            AnyStore::Sqlite(_) => None,
        }
    }

    pub fn operations(&self) -> Arc<dyn outbox_core::store::Operations> {
        match self {
            AnyStore::Postgres(s) => Arc::new(s.clone()),
            AnyStore::Sqlite(s) => Arc::new(s.clone()),
        }
    }

    pub fn registry(&self) -> Arc<dyn NodeRegistry> {
        match self {
            AnyStore::Postgres(s) => Arc::new(s.clone()),
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
            AnyStore::Sqlite(s) => s.migrate().await,
        }
    }

    /// The DDL and grants `migrate --print` shows.
    pub fn printable_ddl(&self, role: &str) -> String {
        match self {
            AnyStore::Postgres(s) => {
                format!("{}\n{}", s.tables().ddl(), s.tables().grants(role))
            }
            AnyStore::Sqlite(_) => format!(
                "-- SQLite has no roles: the relay needs read/write access to the database file\n-- and its directory (for the WAL).\n{}",
                SqliteStore::ddl()
            ),
        }
    }
}

fn pg_tables(config: &Config) -> anyhow::Result<Tables> {
    Tables::new(
        &config.outbox_schema,
        &config.outbox_table,
        &config.nodes_schema,
        &config.nodes_table,
        &config.notify_channel,
    )
    .map_err(|e| anyhow::anyhow!(e.report()))
}
