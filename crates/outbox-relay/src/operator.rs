//! Operator commands: dead letters, replay, prune.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::SystemTime;

use outbox_core::store::{
    DeadQuery, DeadRecord, DeadRetried, DeadSelector, Operations, ReplayPage, ReplaySelector,
};

use crate::cli::{DeadCommand, DeadSelectArgs, PruneArgs, ReplayArgs};
use crate::config::{duration, Config};
use crate::error::config_error;
use crate::progress::Progress;
use crate::store::{ready_store, AnyStore};

/// The most rows one `prune` delete takes: larger deletes hold their locks (and, on
/// PostgreSQL, bloat the WAL of one transaction) for longer than a pause of the relay's.
const MAX_PRUNE_BATCH: u32 = 50_000;

/// The store as the one-shot commands use it: its tables must exist already, and a database
/// that is down fails at once.
pub(crate) async fn ready_existing_store(config: &Config) -> anyhow::Result<AnyStore> {
    let settings = config.store_settings()?;
    ready_store(&config.database.database_url, settings, false, false).await
}

async fn operations(config: &Config) -> anyhow::Result<Arc<dyn Operations>> {
    refuse_a_missing_sqlite_file(config)?;
    Ok(ready_existing_store(config).await?.operations())
}

/// An operator command that reads or changes what a relay keeps, pointed at a SQLite file
/// that does not exist (a typo, the wrong working directory for the default `outbox.db`):
/// opening it made an empty database, and the command reported "no dead letters", "0
/// pending", or a purge of nothing, with exit 0.
pub(crate) fn refuse_a_missing_sqlite_file(config: &Config) -> anyhow::Result<()> {
    match missing_sqlite_file(config) {
        Some(path) => Err(config_error(format!(
            "no SQLite database at {}: check --database-url and the working directory (the \
             default is outbox.db in it); `outbox-relay migrate` or `run` creates it",
            path.display()
        ))),
        None => Ok(()),
    }
}

/// The SQLite file the configuration names, if opening it would make a new one (a plain
/// path that does not exist; a `file:` URI or `:memory:` is left to SQLite).
pub(crate) fn missing_sqlite_file(config: &Config) -> Option<std::path::PathBuf> {
    match config.database.database_kind() {
        Ok(crate::config::DatabaseKind::Sqlite(path)) => {
            let uri = path.to_string_lossy();
            (!uri.starts_with("file:") && uri != ":memory:" && !path.exists()).then_some(path)
        }
        _ => None,
    }
}

fn store_error(e: outbox_core::StoreError) -> anyhow::Error {
    anyhow::anyhow!(e.report())
}

fn selector(args: DeadSelectArgs) -> DeadSelector {
    match (args.ids.is_empty(), args.destination, args.all) {
        (false, _, _) => DeadSelector::Ids(args.ids),
        (true, Some(d), _) => DeadSelector::Destination(d),
        _ => DeadSelector::All,
    }
}

pub async fn dead(config: Config, command: DeadCommand) -> anyhow::Result<ExitCode> {
    let ops = operations(&config).await?;
    match command {
        DeadCommand::List {
            destination,
            event_type,
            after,
            limit,
            json,
        } => {
            let query = DeadQuery {
                destination,
                event_type,
                after: after.unwrap_or(DeadQuery::default().after),
                limit,
            };
            let rows = ops.dead_list(query).await.map_err(store_error)?;
            for r in &rows {
                let dead_at = outbox_core::time::display_time(r.dead_at);
                if json {
                    outln!("{}", dead_record_json(r));
                } else {
                    // Untrusted text: one row per line, no escape sequence reaches the terminal.
                    use outbox_core::redact::escape_controls as shown;
                    outln!(
                        "{}\t{}\t{}\t{}\tattempts={}\t{}\t{}",
                        r.sequence_id,
                        r.event_id,
                        shown(&r.destination),
                        shown(&r.event_type),
                        r.attempts,
                        dead_at,
                        shown(&r.last_error)
                    );
                }
            }
            if !json && rows.is_empty() {
                eprintln!("no dead letters");
            }
            // A full page may not be all: said on stderr, so stdout stays one row per line.
            if let Some(last) = rows
                .last()
                .filter(|_| !json && rows.len() >= limit as usize)
            {
                eprintln!(
                    "{limit} shown; there may be more: add --after {}",
                    last.sequence_id
                );
            }
        }
        DeadCommand::Retry(args) => {
            let selector = selector(args);
            let asked = ids_asked(&selector);
            let total = match &selector {
                DeadSelector::Ids(_) => asked,
                DeadSelector::Destination(d) => dead_count(&*ops, Some(d)).await?,
                DeadSelector::All => dead_count(&*ops, None).await?,
            };
            let mut progress = Progress::new("retrying dead letters", total);
            let done = dead_retry_in_pages(&*ops, selector, |n| progress.add(n))
                .await
                .map_err(store_error)?;
            progress.finish();
            outln!("{}", retried_text(done));
            // Rows left dead, or ids that named no dead letter: a script that retried
            // twice, or a mistyped id, was told all was well.
            let unmatched = asked.saturating_sub(done.moved + done.left);
            if unmatched > 0 {
                eprintln!("{}", not_dead_text(unmatched));
            }
            if unmatched > 0 || done.left > 0 {
                return Ok(ExitCode::FAILURE);
            }
        }
        DeadCommand::Purge(args) => {
            let selector = selector(args);
            let asked = ids_asked(&selector);
            let n = ops.dead_purge(selector).await.map_err(store_error)?;
            outln!("{}", purged_text(n));
            let unmatched = asked.saturating_sub(n);
            if unmatched > 0 {
                eprintln!("{}", not_dead_text(unmatched));
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// How many distinct ids a selector names (none for a destination or all).
fn ids_asked(selector: &DeadSelector) -> u64 {
    match selector {
        DeadSelector::Ids(ids) => {
            ids.iter().collect::<std::collections::BTreeSet<_>>().len() as u64
        }
        _ => 0,
    }
}

/// What `dead retry` and `dead purge` say of ids given that named no dead letter.
fn not_dead_text(unmatched: u64) -> String {
    format!(
        "{unmatched} of the ids given named no dead letter (no such id, an event still in the \
         outbox, or one already retried or purged): `outbox-relay dead list` shows the dead \
         letters, `outbox-relay stats` what is pending"
    )
}

/// How many dead letters `dead retry` moves in one statement.
const DEAD_RETRY_PAGE: u32 = 1_000;

/// `dead retry` of a destination's dead letters or of all, a page of ids at a time, each in
/// a statement of its own, `on_page` told how many each page held (the CLI's progress; the
/// admin API's retry goes the same way). In one statement, 1.2 million of them outlasted
/// PostgreSQL's statement timeout (nothing moved), and on SQLite held the application's
/// writers out for half a minute. Ids given are moved in one statement, as before, and so
/// are the dead letters of a store whose rows have no integer ids (a mapped table with UUID
/// row ids shows 0).
pub(crate) async fn dead_retry_in_pages(
    ops: &dyn Operations,
    selector: DeadSelector,
    mut on_page: impl FnMut(u64),
) -> outbox_core::store::StoreResult<DeadRetried> {
    let destination = match &selector {
        DeadSelector::Ids(_) => {
            let done = ops.dead_retry(selector).await?;
            on_page(done.moved + done.left);
            return Ok(done);
        }
        DeadSelector::Destination(d) => Some(d.clone()),
        DeadSelector::All => None,
    };
    let mut done = DeadRetried::default();
    let mut after = DeadQuery::default().after;
    loop {
        let page = ops
            .dead_list(DeadQuery {
                destination: destination.clone(),
                after,
                limit: DEAD_RETRY_PAGE,
                ..DeadQuery::default()
            })
            .await?;
        let Some(last) = page.last() else { break };
        if page.iter().any(|r| r.sequence_id == 0) {
            let rest = ops.dead_retry(selector).await?;
            done.moved += rest.moved;
            done.left += rest.left;
            on_page(rest.moved + rest.left);
            break;
        }
        after = last.sequence_id;
        let ids = page.iter().map(|r| r.sequence_id).collect();
        let moved = ops.dead_retry(DeadSelector::Ids(ids)).await?;
        done.moved += moved.moved;
        done.left += moved.left;
        on_page(page.len() as u64);
    }
    Ok(done)
}

/// How many dead letters a destination (or every one) has, for the progress line.
async fn dead_count(ops: &dyn Operations, destination: Option<&str>) -> anyhow::Result<u64> {
    let stats = ops.destination_stats().await.map_err(store_error)?;
    Ok(stats
        .iter()
        .filter(|s| destination.is_none_or(|d| d == s.destination))
        .map(|s| s.dead)
        .sum())
}

/// One dead letter as `dead list --json` and the admin API show it.
pub(crate) fn dead_record_json(r: &DeadRecord) -> serde_json::Value {
    serde_json::json!({
        "sequence_id": r.sequence_id,
        "event_id": r.event_id,
        "destination": r.destination,
        "event_type": r.event_type,
        "attempts": r.attempts,
        "last_error": r.last_error,
        "dead_at": outbox_core::time::display_time(r.dead_at),
    })
}

/// What `dead retry` did, as the CLI and the admin API say it.
pub(crate) fn retried_text(done: DeadRetried) -> String {
    let DeadRetried { moved, left } = done;
    let mut text =
        format!("moved {moved} dead letters back to the outbox; the relay publishes them again");
    if left > 0 {
        text.push_str(&format!(
            "; {left} left dead: the outbox holds their event id already (the application \
             wrote the event again): purge them if the new rows supersede them (`outbox-relay \
             dead list` shows them)"
        ));
    }
    text
}

/// What `dead purge` did, as the CLI and the admin API say it.
pub(crate) fn purged_text(n: u64) -> String {
    format!("deleted {n} dead letters")
}

/// Why `replay` found nothing to do.
pub(crate) const NOTHING_TO_REPLAY: &str =
    "no retained delivered events in that window (replay needs rows kept with --retain-delivered)";

/// A time given as RFC 3339 or as an age (`2h` means two hours ago).
fn parse_time(text: &str) -> anyhow::Result<SystemTime> {
    if let Ok(t) = humantime::parse_rfc3339_weak(text) {
        return Ok(t);
    }
    let age = duration::parse(text).map_err(|_| {
        config_error(format!(
            "invalid time {text:?}: give RFC 3339 (2026-11-20T10:00:00Z) or an age (2h, 7d)"
        ))
    })?;
    Ok(SystemTime::now() - age)
}

/// The events `replay` chooses: `since` and `until` as RFC 3339 or ages (`until` defaults to
/// now), of `destination` when given.
pub(crate) fn replay_selector(
    since: &str,
    until: Option<&str>,
    destination: Option<String>,
) -> anyhow::Result<ReplaySelector> {
    let since = parse_time(since)?;
    let until = until
        .map(parse_time)
        .transpose()?
        .unwrap_or_else(SystemTime::now);
    if since >= until {
        return Err(config_error(
            "--since must be before --until (an age counts back from now: --since 2h \
             --until 1h)"
                .into(),
        ));
    }
    Ok(ReplaySelector {
        since,
        until,
        destination,
    })
}

/// Marks the chosen events pending again, in batches, calling `on_batch` with each batch's
/// count; returns the total.
pub(crate) async fn replay_all(
    ops: &dyn Operations,
    selector: ReplaySelector,
    mut on_batch: impl FnMut(u64),
) -> Result<u64, outbox_core::StoreError> {
    let (mut after, mut total) = (0, 0);
    loop {
        let (n, last) = ops
            .replay_batch(ReplayPage {
                selector: selector.clone(),
                after,
                size: 1000,
            })
            .await?;
        // Done when a page finds nothing past `after`, not when one changes nothing: a page
        // whose rows were pruned between its pick and its update changes none, and the rows
        // after it still wait.
        if last <= after {
            return Ok(total);
        }
        if n > 0 {
            on_batch(n);
            total += n;
        }
        after = last;
    }
}

pub async fn replay(config: Config, args: ReplayArgs) -> anyhow::Result<ExitCode> {
    let selector = replay_selector(&args.since, args.until.as_deref(), args.destination.clone())?;
    let ops = operations(&config).await?;
    let total = ops
        .count_replayable(selector.clone())
        .await
        .map_err(store_error)?;
    if total == 0 {
        outln!("{NOTHING_TO_REPLAY}");
        return Ok(ExitCode::SUCCESS);
    }
    let mut progress = Progress::new("replaying", total);
    let mut queued = 0;
    replay_all(&*ops, selector, |n| {
        queued += n;
        progress.add(n)
    })
    .await
    .map_err(store_error)?;
    progress.finish();
    // It said only its progress line: that the rows wait for a relay went unsaid.
    outln!(
        "queued {queued} delivered events to go out again, under their own ids; a running \
         relay publishes them (`outbox-relay run`)"
    );
    Ok(ExitCode::SUCCESS)
}

pub async fn prune(config: Config, args: PruneArgs) -> anyhow::Result<ExitCode> {
    let cutoff = |age: &Option<String>, flag: &str| -> anyhow::Result<Option<SystemTime>> {
        age.as_deref()
            .map(|a| {
                duration::parse(a)
                    .map(|d| SystemTime::now() - d)
                    .map_err(|e| config_error(format!("--{flag}: {e}")))
            })
            .transpose()
    };
    let delivered = cutoff(&args.delivered_older_than, "delivered-older-than")?;
    let dead = cutoff(&args.dead_older_than, "dead-older-than")?;
    if delivered.is_none() && dead.is_none() {
        return Err(config_error(
            "give --delivered-older-than AGE, --dead-older-than AGE, or both (e.g. 7d, 30d)".into(),
        ));
    }
    if !(1..=MAX_PRUNE_BATCH).contains(&args.batch_size) {
        return Err(config_error(format!(
            "--batch-size must be between 1 and {MAX_PRUNE_BATCH} rows per delete (got {})",
            args.batch_size
        )));
    }
    let batch = args.batch_size;
    let ops = operations(&config).await?;
    let (n_delivered, n_dead) = ops
        .count_prunable(delivered, dead)
        .await
        .map_err(store_error)?;
    if args.dry_run {
        outln!("would delete {n_delivered} delivered rows and {n_dead} dead letters");
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(before) = delivered {
        let mut progress = Progress::new("pruning delivered rows", n_delivered);
        loop {
            let n = ops
                .prune_delivered(before, batch)
                .await
                .map_err(store_error)?;
            if n == 0 {
                break;
            }
            progress.add(n);
        }
        progress.finish();
    }
    if let Some(before) = dead {
        let mut progress = Progress::new("pruning dead letters", n_dead);
        loop {
            let n = ops.prune_dead(before, batch).await.map_err(store_error)?;
            if n == 0 {
                break;
            }
            progress.add(n);
        }
        progress.finish();
    }
    Ok(ExitCode::SUCCESS)
}
