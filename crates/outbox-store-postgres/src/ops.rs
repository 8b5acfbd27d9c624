//! Operator commands on PostgreSQL: per-destination stats, dead letters, replay, prune.
//! Their statements are written with the others, in `schema.rs` (`OperatorStatements`).

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::FutureExt;
use outbox_core::store::{
    DeadQuery, DeadRecord, DeadRetried, DeadSelector, DestinationStats, EventRecord, EventState,
    Operations, ReplayPage, ReplaySelector, StoreFuture, StoreResult,
};
use outbox_core::SequenceId;
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use crate::schema::{BySelector, OperatorStatements};
use crate::{from_micros, Inner, PgStore};

fn seconds(t: SystemTime) -> f64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_secs_f64(),
        Err(e) => -e.duration().as_secs_f64(),
    }
}

/// The selector's value: parameter `$1` of its condition (see `BySelector`).
fn selector_value(s: &DeadSelector) -> Box<dyn ToSql + Sync + Send> {
    match s {
        DeadSelector::Ids(ids) => Box::new(ids.clone()),
        DeadSelector::Destination(d) => Box::new(d.clone()),
        DeadSelector::All => Box::new(true),
    }
}

impl PgStore {
    /// Runs `statement` on the dead letters `which` selects.
    fn on_dead_letters(
        &self,
        context: &'static str,
        which: DeadSelector,
        statement: fn(&OperatorStatements) -> &BySelector,
    ) -> StoreFuture<u64> {
        let inner = self.inner.clone();
        let param = selector_value(&which);
        async move {
            let sql = statement(&inner.sql.ops).for_selector(&which);
            Self::execute(&inner, context, sql, &[&*param as &(dyn ToSql + Sync)]).await
        }
        .boxed()
    }

    /// Runs a replay statement: its parameters are the selector's window and destination
    /// (`$1` to `$3`), then `more`.
    async fn replay_query(
        inner: &Inner,
        sql: &str,
        selector: &ReplaySelector,
        more: &[&(dyn ToSql + Sync)],
    ) -> StoreResult<Vec<Row>> {
        let (since, until) = (seconds(selector.since), seconds(selector.until));
        let mut params: Vec<&(dyn ToSql + Sync)> = vec![&since, &until, &selector.destination];
        params.extend_from_slice(more);
        Self::query(inner, "replay", sql, &params).await
    }
}

impl Operations for PgStore {
    fn destination_stats(&self) -> StoreFuture<Vec<DestinationStats>> {
        let inner = self.inner.clone();
        async move {
            let ops = &inner.sql.ops;
            let pending = Self::query(&inner, "stats", &ops.stats_pending, &[]).await?;
            let dead = Self::query(&inner, "stats", &ops.stats_dead, &[]).await?;
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
            let limit = i64::from(query.limit);
            let rows = Self::query(
                &inner,
                "dead list",
                &inner.sql.ops.dead_list,
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
                    attempts: outbox_core::event::attempts_of(r.get::<_, i64>(4)),
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
            let rows = Self::query(&inner, "event", &inner.sql.ops.event, &[&id]).await?;
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
                attempts: outbox_core::event::attempts_of(r.get::<_, i64>(7)),
                last_error: r.get(8),
                created_at: r.get::<_, Option<i64>>(9).map(from_micros),
                dead_at: r.get::<_, Option<i64>>(12).map(from_micros),
            }))
        }
        .boxed()
    }

    fn dead_retry(&self, which: DeadSelector) -> StoreFuture<DeadRetried> {
        let inner = self.inner.clone();
        let param = selector_value(&which);
        async move {
            let sql = inner.sql.ops.dead_retry.for_selector(&which);
            let rows =
                Self::query(&inner, "dead retry", sql, &[&*param as &(dyn ToSql + Sync)]).await?;
            let count = |i| rows.first().map_or(0, |r| r.get::<_, i64>(i).max(0) as u64);
            Ok(DeadRetried {
                moved: count(0),
                left: count(1),
            })
        }
        .boxed()
    }

    fn dead_purge(&self, which: DeadSelector) -> StoreFuture<u64> {
        self.on_dead_letters("dead purge", which, |ops| &ops.dead_purge)
    }

    fn count_replayable(&self, selector: ReplaySelector) -> StoreFuture<u64> {
        let inner = self.inner.clone();
        async move {
            let sql = &inner.sql.ops.count_replayable;
            let rows = Self::replay_query(&inner, sql, &selector, &[]).await?;
            Ok(rows[0].get::<_, i64>(0) as u64)
        }
        .boxed()
    }

    fn replay_batch(&self, page: ReplayPage) -> StoreFuture<(u64, SequenceId)> {
        let inner = self.inner.clone();
        async move {
            let size = i64::from(page.size);
            let sql = &inner.sql.ops.replay_batch;
            let rows =
                Self::replay_query(&inner, sql, &page.selector, &[&page.after, &size]).await?;
            let last = rows
                .iter()
                .map(|r| r.get::<_, i64>(0))
                .max()
                .unwrap_or(page.after);
            if !rows.is_empty() {
                // An UPDATE fires no insert trigger: wake the relays ourselves.
                let channel = inner.tables.notify_channel.as_str().to_string();
                let wake = &inner.sql.ops.wake_relays;
                Self::execute(&inner, "replay", wake, &[&channel]).await?;
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
            let count = |statement: fn(&OperatorStatements) -> &String,
                         before: Option<SystemTime>| {
                let inner = inner.clone();
                async move {
                    let Some(before) = before else { return Ok(0) };
                    let sql = statement(&inner.sql.ops);
                    let rows = Self::query(&inner, "prune", sql, &[&seconds(before)]).await?;
                    Ok::<u64, outbox_core::StoreError>(rows[0].get::<_, i64>(0) as u64)
                }
            };
            let delivered = count(|ops| &ops.count_delivered_before, delivered_before).await?;
            let dead = count(|ops| &ops.count_dead_before, dead_before).await?;
            Ok((delivered, dead))
        }
        .boxed()
    }

    fn prune_delivered(&self, before: SystemTime, batch: u32) -> StoreFuture<u64> {
        prune(self, |ops| &ops.prune_delivered, before, batch)
    }

    fn prune_dead(&self, before: SystemTime, batch: u32) -> StoreFuture<u64> {
        prune(self, |ops| &ops.prune_dead, before, batch)
    }
}

/// Runs a prune `statement`: deletes up to `batch` rows older than `before`.
fn prune(
    store: &PgStore,
    statement: fn(&OperatorStatements) -> &String,
    before: SystemTime,
    batch: u32,
) -> StoreFuture<u64> {
    let inner = store.inner.clone();
    async move {
        let sql = statement(&inner.sql.ops);
        PgStore::execute(&inner, "prune", sql, &[&seconds(before), &i64::from(batch)]).await
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
