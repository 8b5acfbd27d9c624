//! WAL capture's slot and publication, the table it reads, and the reader's start.

use std::sync::Arc;

use outbox_core::metric_labels::DestinationLabels;
use outbox_core::NodeId;
use outbox_store_postgres::PgStore;

/// The replication slot and publication of `--capture wal`.
#[derive(Clone, Debug)]
pub struct Capture {
    pub slot: String,
    /// The name earlier versions gave every slot by default (`outbox_relay`), when no slot
    /// was configured: a relay upgraded onto a database that has it keeps streaming from it
    /// ([`super::AnyStore::keep_legacy_slot`]).
    pub legacy_slot: Option<String>,
    pub publication: outbox_core::ident::Ident,
    /// A mapped table captured instead of the native outbox (Debezium's); boxed, since its
    /// mapping is large and most captures read the native table.
    pub source: Option<Box<CapturedTable>>,
}

/// A mapped table read from the WAL: its layout's mapping, and its columns by name.
#[derive(Clone, Debug)]
pub struct CapturedTable {
    pub mapping: outbox_layout::Mapping,
    pub source: outbox_wal::SourceTable,
}

impl CapturedTable {
    /// A mapped table as WAL capture reads it (see [`outbox_wal::ColumnNames::of_mapping`]).
    pub fn of(mapping: outbox_layout::Mapping) -> Result<Self, outbox_core::StoreError> {
        let columns = outbox_wal::ColumnNames::of_mapping(&mapping)?;
        let name = outbox_core::ident::TableName::new(
            mapping.schema.as_deref().unwrap_or("public"),
            &mapping.table,
        )?;
        let source = outbox_wal::SourceTable { name, columns };
        Ok(CapturedTable { mapping, source })
    }

    pub(super) fn source(&self) -> outbox_wal::SourceTable {
        self.source.clone()
    }

    /// The mapped table's own DDL (Debezium's table, and the relay's order column).
    pub(super) fn ddl(&self) -> String {
        match self.mapping.seed {
            Some(outbox_layout::Seed::Debezium) => outbox_layout::sql::debezium_ddl(&self.mapping),
            _ => String::new(),
        }
    }
}

impl Capture {
    pub(super) fn tables(&self, store: &PgStore) -> outbox_wal::schema::CaptureTables {
        let source = self.source.as_deref().map(CapturedTable::source);
        outbox_wal::capture::capture_tables(store.tables(), &self.publication, source)
    }

    /// The table the stream is read from.
    pub fn source_table(&self, store: &PgStore) -> outbox_wal::SourceTable {
        match &self.source {
            Some(source) => source.source(),
            None => outbox_wal::SourceTable::native(store.tables().outbox.clone()),
        }
    }

    /// Starts the replication reader: the store the engine claims from.
    pub fn start(&self, pg: &PgStore, run: CaptureRun) -> outbox_wal::WalStore {
        let source = self.source_table(pg);
        let mut wal = outbox_wal::WalConfig::new(
            run.database_url,
            self.slot.clone(),
            self.publication.as_str(),
            source.name.clone(),
        );
        wal.source = source;
        // Beside a mapped table, the native outbox is captured too: `dead retry` and `send`
        // write there.
        wal.native_outbox = self.source.is_some().then(|| pg.tables().outbox.clone());
        // The emit function writes for the native outbox, whatever table is captured.
        wal.message_prefix = outbox_wal::emit_prefix(&pg.tables().outbox);
        wal.application_name = format!("outbox-relay {}", run.node);
        wal.read_ahead = run.read_ahead;
        wal.memory_budget = run.memory_budget;
        outbox_wal::WalStore::start(
            pg.clone(),
            outbox_wal::WalStoreOptions {
                wal,
                publication: self.publication.clone(),
                drain: run.drain,
                labels: run.labels,
                max_in_flight: run.max_in_flight,
            },
        )
    }

    /// The parked table's backlog per destination, for `stats`.
    pub async fn parked_stats(
        &self,
        store: &PgStore,
    ) -> Result<Vec<outbox_core::store::DestinationStats>, outbox_core::StoreError> {
        use outbox_core::store::Operations;
        let parked = store.with_tables(outbox_store_postgres::Tables {
            outbox: self.tables(store).parked,
            ..store.tables().clone()
        });
        parked.destination_stats().await
    }
}

/// What a capture's reader takes from the rest of the run.
pub struct CaptureRun {
    pub database_url: String,
    /// Named in the session's application_name.
    pub node: NodeId,
    /// Events read ahead of the claims.
    pub read_ahead: usize,
    /// Bytes of events the capture may hold.
    pub memory_budget: usize,
    /// The engine's `max_in_flight`.
    pub max_in_flight: usize,
    pub drain: bool,
    /// The engine's destination labels, shared with adoption's counts.
    pub labels: Arc<DestinationLabels>,
}
