//! The application's side: writers inserting transactions of one row (or a few), at a fixed
//! rate or as fast as they can.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::SUBJECT;

/// Stands for the table in the writers' functions: the writers call `outbox_emit` (WAL
/// capture's table-less events) instead of inserting rows.
pub const EMIT: &str = "outbox_emit()";

fn insert_sql(table: &str) -> String {
    if table == EMIT {
        "SELECT outbox_emit($1, $2, 'order.created', $3::text::jsonb)".into()
    } else if table == "outbox" {
        "INSERT INTO outbox (destination, partition_key, event_type, payload)
         VALUES ($1, $2, 'order.created', $3::text::jsonb)"
            .into()
    } else {
        format!("INSERT INTO {table} (destination, partition_key, payload) VALUES ($1, $2, $3::text::jsonb)")
    }
}

/// About 200 bytes of JSON carrying `seq`.
pub fn payload(seq: u64) -> String {
    format!(
        "{{\"seq\": {seq}, \"customer\": \"customer-{}\", \"total\": 99.95, \"currency\": \"EUR\", \"items\": 3, \"note\": \"{}\"}}",
        seq % 1000,
        "x".repeat(100)
    )
}

/// Commit times by sequence number.
pub type Commits = Arc<Mutex<Vec<(u64, Instant)>>>;

/// The columns an insert into `table` names, and the `event_type` value it writes (with its
/// trailing comma) where the table has that column: the relay's own `outbox` table does, the
/// mapped tables the benchmark compares with do not.
pub fn insert_columns(table: &str) -> (&'static str, &'static str) {
    if table == "outbox" {
        (
            "destination, partition_key, event_type, payload",
            "'order.created', ",
        )
    } else {
        ("destination, partition_key, payload", "")
    }
}

/// Inserts `n` rows in one statement (one transaction, one statement-level trigger call).
fn multi_insert_sql(table: &str) -> String {
    if table == EMIT {
        return "SELECT count(outbox_emit($1, k, 'order.created', p::jsonb))
                  FROM unnest($2::text[], $3::text[]) AS u(k, p)"
            .into();
    }
    let (columns, event_type) = insert_columns(table);
    format!(
        "INSERT INTO {table} ({columns})
         SELECT $1, k, {event_type}p::jsonb FROM unnest($2::text[], $3::text[]) AS u(k, p)"
    )
}

/// `writers` connections inserting at `rate` events per second in total for `seconds`, in
/// transactions of `per_commit` events; returns when they stop, with each event's commit time
/// (taken when COMMIT returned).
pub async fn fixed_rate(
    url: &str,
    table: &str,
    rate: u64,
    seconds: u64,
    writers: u64,
    per_commit: u64,
) -> Result<Commits> {
    let commits: Commits = Arc::new(Mutex::new(Vec::new()));
    let next = Arc::new(AtomicU64::new(1));
    let period = Duration::from_secs_f64((writers * per_commit) as f64 / rate as f64);
    let until = Instant::now() + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for _ in 0..writers {
        let client = crate::connect(url).await?;
        let sql = if per_commit == 1 {
            insert_sql(table)
        } else {
            multi_insert_sql(table)
        };
        let (commits, next) = (commits.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let statement = client.prepare(&sql).await?;
            let mut ticker = tokio::time::interval(period);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while Instant::now() < until {
                ticker.tick().await;
                let first = next.fetch_add(per_commit, Ordering::Relaxed);
                let seqs: Vec<u64> = (first..first + per_commit).collect();
                let keys: Vec<String> = seqs
                    .iter()
                    .map(|seq| format!("customer-{}", seq % 1000))
                    .collect();
                let payloads: Vec<String> = seqs.iter().map(|seq| payload(*seq)).collect();
                if per_commit == 1 {
                    client
                        .execute(&statement, &[&SUBJECT, &keys[0], &payloads[0]])
                        .await?;
                } else {
                    client
                        .execute(&statement, &[&SUBJECT, &keys, &payloads])
                        .await?;
                }
                let at = Instant::now();
                commits
                    .lock()
                    .unwrap()
                    .extend(seqs.into_iter().map(|seq| (seq, at)));
            }
            Ok::<_, anyhow::Error>(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok(commits)
}

/// `writers` connections inserting as fast as they can for `seconds`; inserts per second.
pub async fn flat_out(url: &str, table: &str, writers: u64, seconds: f64) -> Result<f64> {
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(seconds);
    let mut tasks = Vec::new();
    for w in 0..writers {
        let client = crate::connect(url).await?;
        let sql = insert_sql(table);
        let done = done.clone();
        tasks.push(tokio::spawn(async move {
            let statement = client.prepare(&sql).await?;
            let mut seq = w * 1_000_000_000;
            while Instant::now() < until {
                seq += 1;
                let key = format!("customer-{}", seq % 1000);
                client
                    .execute(&statement, &[&SUBJECT, &key, &payload(seq)])
                    .await?;
                done.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<_, anyhow::Error>(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64())
}
