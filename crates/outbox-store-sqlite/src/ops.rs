//! Operator commands on SQLite: per-destination stats, dead letters, replay, prune.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use outbox_core::store::{
    DeadQuery, DeadRecord, DeadRetried, DeadSelector, DestinationStats, EventRecord, EventState,
    Operations, ReplayPage, ReplaySelector, StoreFuture, StoreResult,
};
use outbox_core::SequenceId;
use rusqlite::{params, types::Value};

use crate::{lossy_text, now_ms, sql_error, SqliteStore};

/// A required text column, read as [`lossy_text`] reads it (NULL as empty).
fn text(row: &rusqlite::Row<'_>, index: usize) -> String {
    lossy_text(row, index).unwrap_or_default()
}

/// Column `index` when it holds an integer; `None` for NULL and any other type (SQLite
/// keeps what it is given).
fn integer(row: &rusqlite::Row<'_>, index: usize) -> Option<i64> {
    match row.get_ref(index) {
        Ok(rusqlite::types::ValueRef::Integer(n)) => Some(n),
        _ => None,
    }
}

fn at_ms(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

fn ms(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_millis() as i64,
        Err(e) => -(e.duration().as_millis() as i64),
    }
}

/// The WHERE clause and its parameter for a selector (parameter `?1`).
fn selector(s: &DeadSelector) -> (&'static str, Value) {
    match s {
        DeadSelector::Ids(ids) => (
            "sequence_id IN (SELECT value FROM json_each(?1))",
            Value::Text(serde_json::to_string(ids).unwrap_or_else(|_| "[]".into())),
        ),
        DeadSelector::Destination(d) => ("destination = ?1", Value::Text(d.clone())),
        DeadSelector::All => ("?1", Value::Integer(1)),
    }
}

impl Operations for SqliteStore {
    fn destination_stats(&self) -> StoreFuture<Vec<DestinationStats>> {
        self.with_conn(|conn| {
            let mut by: BTreeMap<String, DestinationStats> = BTreeMap::new();
            let now = now_ms();
            let mut stmt = conn
                .prepare(&format!(
                    "SELECT destination, count(*), count(*) FILTER (WHERE attempts > 0),
                            {}
                       FROM outbox WHERE delivered_at IS NULL GROUP BY destination",
                    crate::WAITING_SINCE
                ))
                .map_err(|e| sql_error("stats", e))?;
            let rows = stmt
                .query_map([now], |r| {
                    Ok((
                        text(r, 0),
                        r.get::<_, i64>(1)?,
                        r.get::<_, i64>(2)?,
                        r.get::<_, Option<i64>>(3)?,
                    ))
                })
                .map_err(|e| sql_error("stats", e))?;
            for row in rows {
                let (d, pending, retrying, oldest) = row.map_err(|e| sql_error("stats", e))?;
                let s = by.entry(d.clone()).or_default();
                s.destination = d;
                s.pending = pending as u64;
                s.retrying = retrying as u64;
                s.oldest_pending_age =
                    oldest.map(|t| Duration::from_millis(now.saturating_sub(t).max(0) as u64));
            }
            let mut stmt = conn
                .prepare(
                    "SELECT destination, count(*) FROM outbox_dead_letters GROUP BY destination",
                )
                .map_err(|e| sql_error("stats", e))?;
            let rows = stmt
                .query_map([], |r| Ok((text(r, 0), r.get::<_, i64>(1)?)))
                .map_err(|e| sql_error("stats", e))?;
            for row in rows {
                let (d, dead) = row.map_err(|e| sql_error("stats", e))?;
                let s = by.entry(d.clone()).or_default();
                s.destination = d;
                s.dead = dead as u64;
            }
            Ok(by.into_values().collect())
        })
    }

    fn dead_list(&self, query: DeadQuery) -> StoreFuture<Vec<DeadRecord>> {
        self.with_conn(move |conn| {
            let mut stmt = conn
                .prepare(
                    "SELECT sequence_id, event_id, destination, event_type, attempts, last_error, dead_at
                       FROM outbox_dead_letters
                      WHERE (?1 IS NULL OR destination = ?1) AND (?2 IS NULL OR event_type = ?2)
                        AND sequence_id > ?3
                      ORDER BY sequence_id LIMIT ?4",
                )
                .map_err(|e| sql_error("dead list", e))?;
            let rows = stmt
                .query_map(
                    params![query.destination, query.event_type, query.after, query.limit],
                    |r| {
                        Ok(DeadRecord {
                            sequence_id: r.get(0)?,
                            event_id: uuid::Uuid::parse_str(&text(r, 1)).unwrap_or_default(),
                            destination: text(r, 2),
                            event_type: text(r, 3),
                            attempts: outbox_core::event::attempts_of(r.get::<_, i64>(4)?),
                            last_error: text(r, 5),
                            dead_at: at_ms(r.get(6)?),
                        })
                    },
                )
                .map_err(|e| sql_error("dead list", e))?;
            rows.collect::<rusqlite::Result<Vec<_>>>().map_err(|e| sql_error("dead list", e))
        })
    }

    fn event(&self, id: SequenceId) -> StoreFuture<Option<EventRecord>> {
        self.with_conn(move |conn| {
            // The outbox first, then the dead letters: a row is in one of them at a time.
            let found = conn
                .query_row(
                    "SELECT sequence_id, event_id, destination, event_type, partition_key, payload,
                            headers, attempts, last_error, created_at, delivered_at, NULL
                       FROM outbox WHERE sequence_id = ?1
                     UNION ALL
                     SELECT sequence_id, event_id, destination, event_type, partition_key, payload,
                            headers, attempts, last_error, created_at, NULL, dead_at
                       FROM outbox_dead_letters WHERE sequence_id = ?1",
                    [id],
                    |r| {
                        let delivered: Option<i64> = r.get(10)?;
                        let dead_at: Option<i64> = r.get(11)?;
                        Ok(EventRecord {
                            sequence_id: r.get(0)?,
                            event_id: uuid::Uuid::parse_str(&text(r, 1)).unwrap_or_default(),
                            destination: text(r, 2),
                            event_type: text(r, 3),
                            ordering_key: lossy_text(r, 4),
                            payload: lossy_text(r, 5),
                            headers: lossy_text(r, 6),
                            state: match (dead_at, delivered) {
                                (Some(_), _) => EventState::Dead,
                                (None, Some(_)) => EventState::Delivered,
                                (None, None) => EventState::Pending,
                            },
                            attempts: outbox_core::event::attempts_of(integer(r, 7).unwrap_or(0)),
                            last_error: lossy_text(r, 8),
                            // The rows dead-lettered for an odd created_at (text, a real)
                            // are the ones an operator looks at: shown without it.
                            created_at: integer(r, 9).map(at_ms),
                            dead_at: dead_at.map(at_ms),
                        })
                    },
                )
                .map(Some);
            match found {
                Err(rusqlite::Error::QueryReturnedNoRows) => Ok(None),
                other => other.map_err(|e| sql_error("event", e)),
            }
        })
    }

    fn dead_retry(&self, which: DeadSelector) -> StoreFuture<DeadRetried> {
        self.in_tx("dead retry", move |tx| {
            let (condition, param) = selector(&which);
            // A dead letter whose event id (or sequence id) the outbox holds already, as the
            // application wrote the event again, is left dead: its insert failed the whole
            // transaction, and no other dead letter moved.
            let taken = "EXISTS (SELECT 1 FROM outbox o WHERE o.event_id = d.event_id
                                    OR o.sequence_id = d.sequence_id)";
            let left: i64 = tx.query_row(
                &format!(
                    "SELECT count(*) FROM outbox_dead_letters d WHERE ({condition}) AND {taken}"
                ),
                [&param],
                |r| r.get(0),
            )?;
            let moved = tx.execute(
                &format!(
                    "INSERT INTO outbox (sequence_id, event_id, destination, partition_key, event_type,
                                         payload, headers, mutation_id, rejected, created_at)
                     SELECT sequence_id, event_id, destination, partition_key, event_type,
                            payload, headers, mutation_id, rejected, created_at
                       FROM outbox_dead_letters d WHERE ({condition}) AND NOT {taken}"
                ),
                [&param],
            )?;
            // Those now in the outbox as themselves.
            tx.execute(
                &format!(
                    "DELETE FROM outbox_dead_letters AS d WHERE ({condition}) AND EXISTS (
                         SELECT 1 FROM outbox o
                          WHERE o.sequence_id = d.sequence_id AND o.event_id = d.event_id)"
                ),
                [&param],
            )?;
            Ok(DeadRetried {
                moved: moved as u64,
                left: left.max(0) as u64,
            })
        })
    }

    fn dead_purge(&self, which: DeadSelector) -> StoreFuture<u64> {
        self.in_tx("dead purge", move |tx| {
            let (condition, param) = selector(&which);
            let n = tx.execute(
                &format!("DELETE FROM outbox_dead_letters WHERE {condition}"),
                [&param],
            )?;
            Ok(n as u64)
        })
    }

    fn count_replayable(&self, selector: ReplaySelector) -> StoreFuture<u64> {
        self.with_conn(move |conn| {
            conn.query_row(
                "SELECT count(*) FROM outbox WHERE delivered_at IS NOT NULL AND created_at >= ?1
                    AND created_at < ?2 AND (?3 IS NULL OR destination = ?3)",
                params![ms(selector.since), ms(selector.until), selector.destination],
                |r| r.get::<_, i64>(0),
            )
            .map(|n| n as u64)
            .map_err(|e| sql_error("replay", e))
        })
    }

    fn replay_batch(&self, page: ReplayPage) -> StoreFuture<(u64, SequenceId)> {
        self.in_tx("replay", move |tx| {
            let mut stmt = tx.prepare(
                "UPDATE outbox SET delivered_at = NULL, attempts = 0, last_error = NULL,
                        available_at = ?6, locked_by = NULL, locked_until = NULL
                  WHERE sequence_id IN (
                    SELECT sequence_id FROM outbox
                     WHERE delivered_at IS NOT NULL AND created_at >= ?1 AND created_at < ?2
                       AND (?3 IS NULL OR destination = ?3) AND sequence_id > ?4
                     ORDER BY sequence_id LIMIT ?5)
                 RETURNING sequence_id",
            )?;
            let ids = stmt
                .query_map(
                    params![
                        ms(page.selector.since),
                        ms(page.selector.until),
                        page.selector.destination,
                        page.after,
                        page.size,
                        now_ms()
                    ],
                    |r| r.get::<_, i64>(0),
                )?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok((
                ids.len() as u64,
                ids.iter().copied().max().unwrap_or(page.after),
            ))
        })
    }

    fn count_prunable(
        &self,
        delivered_before: Option<SystemTime>,
        dead_before: Option<SystemTime>,
    ) -> StoreFuture<(u64, u64)> {
        self.with_conn(move |conn| {
            let count = |sql: &str, before: Option<SystemTime>| -> StoreResult<u64> {
                match before {
                    None => Ok(0),
                    Some(b) => conn
                        .query_row(sql, [ms(b)], |r| r.get::<_, i64>(0))
                        .map(|n| n as u64)
                        .map_err(|e| sql_error("prune", e)),
                }
            };
            Ok((
                count(
                    "SELECT count(*) FROM outbox WHERE delivered_at < ?1",
                    delivered_before,
                )?,
                count(
                    "SELECT count(*) FROM outbox_dead_letters WHERE dead_at < ?1",
                    dead_before,
                )?,
            ))
        })
    }

    fn prune_delivered(&self, before: SystemTime, batch: u32) -> StoreFuture<u64> {
        prune(self, "outbox", "delivered_at", before, batch)
    }

    fn prune_dead(&self, before: SystemTime, batch: u32) -> StoreFuture<u64> {
        prune(self, "outbox_dead_letters", "dead_at", before, batch)
    }
}

/// Deletes up to `batch` rows of `table` whose `column` is older than `before`.
fn prune(
    store: &SqliteStore,
    table: &'static str,
    column: &'static str,
    before: SystemTime,
    batch: u32,
) -> StoreFuture<u64> {
    store.in_tx("prune", move |tx| {
        tx.execute(
            &format!(
                "DELETE FROM {table} WHERE sequence_id IN (
                    SELECT sequence_id FROM {table} WHERE {column} < ?1 ORDER BY sequence_id LIMIT ?2)"
            ),
            params![ms(before), batch],
        )
        .map(|n| n as u64)
    })
}
