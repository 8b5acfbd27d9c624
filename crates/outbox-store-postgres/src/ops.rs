//! Operator commands on PostgreSQL: per-destination stats, dead letters, replay, prune.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::FutureExt;
use outbox_core::store::{
    DeadQuery, DeadRecord, DeadSelector, DestinationStats, EventRecord, EventState, Operations,
    ReplaySelector, StoreFuture,
};
use outbox_core::SequenceId;
use tokio_postgres::types::ToSql;

use crate::{from_micros, PgStore};

fn seconds(t: SystemTime) -> f64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_secs_f64(),
        Err(e) => -e.duration().as_secs_f64(),
    }
}

/// The WHERE clause and its parameter for a selector (parameter `$1`).
fn selector(s: &DeadSelector) -> (&'static str, Box<dyn ToSql + Sync + Send>) {
    match s {
        DeadSelector::Ids(ids) => ("sequence_id = ANY($1::int8[])", Box::new(ids.clone())),
        DeadSelector::Destination(d) => ("destination = $1", Box::new(d.clone())),
        DeadSelector::All => ("$1::bool", Box::new(true)),
    }
}

impl PgStore {
    /// Runs a statement on the dead letters `which` selects: `statement` gets the outbox and
    /// dead-letter tables (quoted) and the selector's condition (over parameter `$1`).
    fn on_dead_letters(
        &self,
        context: &'static str,
        which: DeadSelector,
        statement: impl FnOnce(String, String, &str) -> String,
    ) -> StoreFuture<u64> {
        let inner = self.inner.clone();
        let (condition, param) = selector(&which);
        let tables = &inner.tables;
        let sql = statement(
            tables.outbox.quoted(),
            tables.dead_letters.quoted(),
            condition,
        );
        async move { Self::execute(&inner, context, &sql, &[&*param as &(dyn ToSql + Sync)]).await }
            .boxed()
    }
}

impl Operations for PgStore {
    fn destination_stats(&self) -> StoreFuture<Vec<DestinationStats>> {
        let inner = self.inner.clone();
        async move {
            let t = inner.tables.outbox.quoted();
            let dl = inner.tables.dead_letters.quoted();
            let pending = Self::query(
                &inner,
                "stats",
                &format!(
                    "SELECT destination, count(*)::int8, count(*) FILTER (WHERE attempts > 0)::int8,
                            (extract(epoch from now() - min(created_at) FILTER (WHERE isfinite(created_at))) * 1000)::int8
                       FROM {t} WHERE delivered_at IS NULL GROUP BY destination"
                ),
                &[],
            )
            .await?;
            let dead = Self::query(
                &inner,
                "stats",
                &format!("SELECT destination, count(*)::int8 FROM {dl} GROUP BY destination"),
                &[],
            )
            .await?;
            let mut by: BTreeMap<String, DestinationStats> = BTreeMap::new();
            for r in pending {
                let s = stats_of(&mut by, &r);
                s.pending = r.get::<_, i64>(1) as u64;
                s.retrying = r.get::<_, i64>(2) as u64;
                s.oldest_pending_age = r
                    .get::<_, Option<i64>>(3)
                    .map(|ms| Duration::from_millis(ms.max(0) as u64));
            }
            for r in dead {
                let s = stats_of(&mut by, &r);
                s.dead = r.get::<_, i64>(1) as u64;
            }
            Ok(by.into_values().collect())
        }
        .boxed()
    }

    fn dead_list(&self, query: DeadQuery) -> StoreFuture<Vec<DeadRecord>> {
        let inner = self.inner.clone();
        async move {
            let dl = inner.tables.dead_letters.quoted();
            let limit = i64::from(query.limit);
            let rows = Self::query(
                &inner,
                "dead list",
                &format!(
                    "SELECT sequence_id, event_id, destination, event_type, attempts::int8, last_error,
                            (extract(epoch from dead_at) * 1000000)::int8
                       FROM {dl}
                      WHERE ($1::text IS NULL OR destination = $1)
                        AND ($2::text IS NULL OR event_type = $2) AND sequence_id > $3
                      ORDER BY sequence_id LIMIT $4"
                ),
                &[&query.destination, &query.event_type, &query.after, &limit],
            )
            .await?;
            Ok(rows
                .iter()
                .map(|r| DeadRecord {
                    sequence_id: r.get(0),
                    // Dead letters of undecodable rows keep what the outbox row held.
                    event_id: r.try_get(1).unwrap_or_default(),
                    destination: r.try_get(2).unwrap_or_default(),
                    event_type: r.try_get(3).unwrap_or_default(),
                    attempts: r.get::<_, i64>(4).max(0) as u32,
                    last_error: r.get(5),
                    dead_at: from_micros(r.get(6)),
                })
                .collect())
        }
        .boxed()
    }

    fn event(&self, id: SequenceId) -> StoreFuture<Option<EventRecord>> {
        let inner = self.inner.clone();
        async move {
            let (t, dl) = (
                inner.tables.outbox.quoted(),
                inner.tables.dead_letters.quoted(),
            );
            let micros = |c: &str| {
                format!(
                    "CASE WHEN isfinite({c}) THEN (extract(epoch from {c}) * 1000000)::int8 END"
                )
            };
            // A row is in one of the two tables at a time.
            let rows = Self::query(
                &inner,
                "event",
                &format!(
                    "SELECT sequence_id, event_id, destination, event_type, partition_key,
                            payload::text, headers::text, attempts::int8, last_error, {created},
                            delivered_at IS NOT NULL, false, NULL::int8
                       FROM {t} WHERE sequence_id = $1
                     UNION ALL
                     SELECT sequence_id, event_id, destination, event_type, partition_key,
                            payload::text, headers::text, attempts::int8, last_error, {created},
                            false, true, {dead_at}
                       FROM {dl} WHERE sequence_id = $1",
                    created = micros("created_at"),
                    dead_at = micros("dead_at"),
                ),
                &[&id],
            )
            .await?;
            Ok(rows.first().map(|r| EventRecord {
                sequence_id: r.get(0),
                event_id: r.try_get(1).unwrap_or_default(),
                destination: r.try_get(2).unwrap_or_default(),
                event_type: r.try_get(3).unwrap_or_default(),
                ordering_key: r.try_get(4).unwrap_or_default(),
                payload: r.get(5),
                headers: r.get(6),
                state: match (r.get::<_, bool>(11), r.get::<_, bool>(10)) {
                    (true, _) => EventState::Dead,
                    (false, true) => EventState::Delivered,
                    (false, false) => EventState::Pending,
                },
                attempts: r.get::<_, i64>(7).max(0) as u32,
                last_error: r.get(8),
                created_at: r.get::<_, Option<i64>>(9).map(from_micros),
                dead_at: r.get::<_, Option<i64>>(12).map(from_micros),
            }))
        }
        .boxed()
    }

    fn dead_retry(&self, which: DeadSelector) -> StoreFuture<u64> {
        // The INSERT fires the outbox trigger, so relays wake up at once.
        self.on_dead_letters("dead retry", which, |t, dl, condition| {
            format!(
                "WITH moved AS (DELETE FROM {dl} WHERE {condition} RETURNING *)
                 INSERT INTO {t} (sequence_id, event_id, destination, partition_key, event_type,
                                  payload, headers, mutation_id, rejected, created_at)
                 SELECT sequence_id, event_id, destination, partition_key, event_type,
                        payload, headers, mutation_id, rejected, created_at FROM moved"
            )
        })
    }

    fn dead_purge(&self, which: DeadSelector) -> StoreFuture<u64> {
        self.on_dead_letters("dead purge", which, |_, dl, condition| {
            format!("DELETE FROM {dl} WHERE {condition}")
        })
    }

    fn count_replayable(&self, selector: ReplaySelector) -> StoreFuture<u64> {
        let inner = self.inner.clone();
        async move {
            let t = inner.tables.outbox.quoted();
            let rows = Self::query(
                &inner,
                "replay",
                &format!(
                    "SELECT count(*)::int8 FROM {t}
                      WHERE delivered_at IS NOT NULL AND created_at >= to_timestamp($1)
                        AND created_at < to_timestamp($2) AND ($3::text IS NULL OR destination = $3)"
                ),
                &[&seconds(selector.since), &seconds(selector.until), &selector.destination],
            )
            .await?;
            Ok(rows[0].get::<_, i64>(0) as u64)
        }
        .boxed()
    }

    fn replay_batch(
        &self,
        selector: ReplaySelector,
        after: SequenceId,
        batch: u32,
    ) -> StoreFuture<(u64, SequenceId)> {
        let inner = self.inner.clone();
        async move {
            let t = inner.tables.outbox.quoted();
            let batch = i64::from(batch);
            let rows = Self::query(
                &inner,
                "replay",
                &format!(
                    "WITH b AS (
                        SELECT sequence_id FROM {t}
                         WHERE delivered_at IS NOT NULL AND created_at >= to_timestamp($1)
                           AND created_at < to_timestamp($2) AND ($3::text IS NULL OR destination = $3)
                           AND sequence_id > $4
                         ORDER BY sequence_id LIMIT $5 FOR UPDATE)
                     UPDATE {t} o SET delivered_at = NULL, attempts = 0, last_error = NULL,
                            available_at = now(), locked_by = NULL, locked_until = NULL
                       FROM b WHERE o.sequence_id = b.sequence_id
                     RETURNING o.sequence_id"
                ),
                &[
                    &seconds(selector.since),
                    &seconds(selector.until),
                    &selector.destination,
                    &after,
                    &batch,
                ],
            )
            .await?;
            let last = rows.iter().map(|r| r.get::<_, i64>(0)).max().unwrap_or(after);
            if !rows.is_empty() {
                // An UPDATE fires no insert trigger: wake the relays ourselves.
                let channel = inner.tables.notify_channel.as_str().to_string();
                Self::execute(&inner, "replay", "SELECT pg_notify($1, '')", &[&channel]).await?;
            }
            Ok((rows.len() as u64, last))
        }
        .boxed()
    }

    fn count_prunable(
        &self,
        delivered_before: Option<SystemTime>,
        dead_before: Option<SystemTime>,
    ) -> StoreFuture<(u64, u64)> {
        let inner = self.inner.clone();
        async move {
            let (t, dl) = (
                inner.tables.outbox.quoted(),
                inner.tables.dead_letters.quoted(),
            );
            let count = |table: String, column: &'static str, before: Option<SystemTime>| {
                let inner = inner.clone();
                async move {
                    let Some(before) = before else { return Ok(0) };
                    let sql = format!(
                        "SELECT count(*)::int8 FROM {table} WHERE {column} < to_timestamp($1)"
                    );
                    let rows = Self::query(&inner, "prune", &sql, &[&seconds(before)]).await?;
                    Ok::<u64, outbox_core::StoreError>(rows[0].get::<_, i64>(0) as u64)
                }
            };
            let delivered = count(t, "delivered_at", delivered_before).await?;
            let dead = count(dl, "dead_at", dead_before).await?;
            Ok((delivered, dead))
        }
        .boxed()
    }

    fn prune_delivered(&self, before: SystemTime, batch: u32) -> StoreFuture<u64> {
        let table = self.inner.tables.outbox.quoted();
        prune(self, table, "delivered_at", before, batch)
    }

    fn prune_dead(&self, before: SystemTime, batch: u32) -> StoreFuture<u64> {
        let table = self.inner.tables.dead_letters.quoted();
        prune(self, table, "dead_at", before, batch)
    }
}

/// Deletes up to `batch` rows of `table` whose `column` is older than `before`, skipping
/// rows other transactions hold, so a prune never waits on or blocks the relay for long.
fn prune(
    store: &PgStore,
    table: String,
    column: &'static str,
    before: SystemTime,
    batch: u32,
) -> StoreFuture<u64> {
    let inner = store.inner.clone();
    async move {
        let sql = format!(
            "DELETE FROM {table} WHERE sequence_id IN (
                SELECT sequence_id FROM {table} WHERE {column} < to_timestamp($1)
                 ORDER BY sequence_id LIMIT $2 FOR UPDATE SKIP LOCKED)"
        );
        PgStore::execute(
            &inner,
            "prune",
            &sql,
            &[&seconds(before), &i64::from(batch)],
        )
        .await
    }
    .boxed()
}

/// The entry of the destination in column 0 of `row`. A NULL there (an operator dropped NOT
/// NULL; the relay dead-letters such rows) counts as "".
fn stats_of<'a>(
    by: &'a mut BTreeMap<String, DestinationStats>,
    row: &tokio_postgres::Row,
) -> &'a mut DestinationStats {
    let destination: String = row
        .try_get::<_, Option<String>>(0)
        .ok()
        .flatten()
        .unwrap_or_default();
    let stats = by.entry(destination.clone()).or_default();
    stats.destination = destination;
    stats
}
