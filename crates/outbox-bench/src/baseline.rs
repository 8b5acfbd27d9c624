//! The baseline: a relay built the way the seeds sketch one. In a transaction, `SELECT ...
//! ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED`, publish the rows one by one awaiting each
//! acknowledgement, `UPDATE ... SET sent = true`, `COMMIT`; woken by LISTEN (or a 1 s poll).

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use futures::StreamExt;

/// The baseline's table, trigger and channel.
pub const DDL: &str = "
CREATE TABLE baseline_outbox (
    id bigserial PRIMARY KEY,
    destination text NOT NULL,
    partition_key text,
    payload jsonb NOT NULL,
    sent boolean NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX baseline_outbox_unsent ON baseline_outbox (id) WHERE NOT sent;
CREATE FUNCTION baseline_notify() RETURNS trigger AS $$
BEGIN PERFORM pg_notify('baseline', ''); RETURN NULL; END $$ LANGUAGE plpgsql;
CREATE TRIGGER baseline_trigger AFTER INSERT ON baseline_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION baseline_notify();
";

/// The relay's mapping of the baseline's table (latency mode `mapped`): a peer's outbox
/// table that marks a `sent` flag, as a new user would map it.
pub const MAPPING: &str = r#"
layout = "custom"
[mapping]
schema = "public"
table = "baseline_outbox"
id = "id"
destination = "destination"
key = "partition_key"
payload = "payload"
created_at = "created_at"
on_success = "mark"
state = { kind = "flag", column = "sent", pending = "false", done = "true" }
"#;

/// Where the baseline publishes.
pub enum Sink {
    /// One line per event, `fdatasync` after each (the file's acknowledgement).
    File(std::fs::File),
    /// JetStream, awaiting each PubAck.
    Nats(Box<async_nats::jetstream::Context>),
}

impl Sink {
    pub fn file(path: &Path) -> Result<Sink> {
        Ok(Sink::File(std::fs::File::create(path)?))
    }

    async fn publish(&mut self, id: i64, destination: &str, payload: String) -> Result<()> {
        match self {
            Sink::File(file) => {
                writeln!(file, "{{\"id\":{id},\"payload\":{payload}}}")?;
                file.sync_data()?;
            }
            Sink::Nats(js) => {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert("Nats-Msg-Id", format!("baseline-{id}").as_str());
                js.publish_with_headers(destination.to_string(), headers, payload.into())
                    .await?
                    .await?;
            }
        }
        Ok(())
    }
}

/// Runs until `stop` is set (and, with `drain`, until a claim comes back empty).
pub async fn run(url: &str, mut sink: Sink, stop: Arc<AtomicBool>, drain: bool) -> Result<u64> {
    let (mut client, mut connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    let (wake_tx, mut wake_rx) = tokio::sync::mpsc::channel::<()>(1);
    tokio::spawn(async move {
        let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(message)) = messages.next().await {
            if let tokio_postgres::AsyncMessage::Notification(_) = message {
                let _ = wake_tx.try_send(());
            }
        }
    });
    client.batch_execute("LISTEN baseline").await?;
    let mut published = 0u64;
    loop {
        let tx = client.transaction().await?;
        let rows = tx
            .query(
                "SELECT id, destination, payload::text FROM baseline_outbox
                  WHERE NOT sent ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED",
                &[],
            )
            .await?;
        if rows.is_empty() {
            tx.commit().await?;
            if drain || stop.load(Ordering::Relaxed) {
                return Ok(published);
            }
            let _ = tokio::time::timeout(Duration::from_secs(1), wake_rx.recv()).await;
            continue;
        }
        let mut ids = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: i64 = row.get(0);
            sink.publish(id, row.get(1), row.get(2)).await?;
            ids.push(id);
        }
        tx.execute(
            "UPDATE baseline_outbox SET sent = true WHERE id = ANY($1)",
            &[&ids],
        )
        .await?;
        tx.commit().await?;
        published += ids.len() as u64;
    }
}
