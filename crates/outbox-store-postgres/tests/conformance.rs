//! The store conformance suite against a real PostgreSQL server (see scripts/servers.sh).

use std::sync::Arc;

use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_core::store::NodeRegistry;
use outbox_core::{OutboxStore, SequenceId};
use outbox_store_postgres::{PgOptions, PgStore, Tables};
use outbox_testkit::conformance::{DeadRow, Harness};

struct PgHarness {
    store: PgStore,
    retaining: PgStore,
    client: tokio_postgres::Client,
}

pub fn options(url: &str, retain_delivered: bool) -> PgOptions {
    PgOptions {
        url: url.to_string(),
        tables: Tables::standard(),
        retain_delivered,
        ca_file: None,
        application_name: None,
        operation_timeout: None,
        pool_size: 4,
    }
}

async fn new_harness() -> PgHarness {
    let url = outbox_testkit::fresh_pg_database().await;
    let store = PgStore::new(options(&url, false)).unwrap();
    store.migrate().await.unwrap();
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    PgHarness {
        retaining: PgStore::new(options(&url, true)).unwrap(),
        store,
        client,
    }
}

impl Harness for PgHarness {
    fn store(&self) -> Arc<dyn OutboxStore> {
        Arc::new(self.store.clone())
    }

    fn retaining_store(&self) -> Arc<dyn OutboxStore> {
        Arc::new(self.retaining.clone())
    }

    fn registry(&self) -> Arc<dyn NodeRegistry> {
        Arc::new(self.store.clone())
    }

    fn operations(&self) -> Arc<dyn outbox_core::store::Operations> {
        Arc::new(self.store.clone())
    }

    fn insert_rolled_back(&self, destination: &str) -> BoxFuture<'_, ()> {
        let sql = format!(
            "BEGIN; INSERT INTO outbox (destination, event_type, payload) VALUES ('{destination}', 't', '1'); ROLLBACK;"
        );
        async move { self.client.batch_execute(&sql).await.unwrap() }.boxed()
    }

    fn insert_undecodable(&self, destination: &str) -> BoxFuture<'_, SequenceId> {
        let destination = destination.to_string();
        async move {
            let row = self
                .client
                .query_one(
                    "INSERT INTO outbox (destination, event_type, payload, headers)
                     VALUES ($1, 't', '{}', '[\"not\", \"an object\"]') RETURNING sequence_id",
                    &[&destination],
                )
                .await
                .unwrap();
            row.get(0)
        }
        .boxed()
    }

    fn row_state(&self, id: SequenceId) -> BoxFuture<'_, Option<(i64, Option<String>, bool)>> {
        async move {
            self.client
                .query_opt(
                    "SELECT attempts::int8, last_error, delivered_at IS NOT NULL FROM outbox WHERE sequence_id = $1",
                    &[&id],
                )
                .await
                .unwrap()
                .map(|r| (r.get(0), r.get(1), r.get(2)))
        }
        .boxed()
    }

    fn dead_rows(&self) -> BoxFuture<'_, Vec<DeadRow>> {
        async move {
            self.client
                .query(
                    "SELECT sequence_id, attempts::int8, last_error, payload::text FROM outbox_dead_letters ORDER BY sequence_id",
                    &[],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| DeadRow {
                    sequence_id: r.get(0),
                    attempts: r.get(1),
                    last_error: r.get(2),
                    payload: r.get(3),
                })
                .collect()
        }
        .boxed()
    }
}

outbox_testkit::store_conformance!(new_harness);
