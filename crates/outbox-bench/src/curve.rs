//! `--only curve`: the scale curve. The relay drains backlogs of growing size (100k, 1M and
//! 10M rows, to one destination) and a backlog spread over more destinations (1, 8 and 64),
//! each with `run --drain` to the file sink. The table is loaded in one statement and never
//! analyzed, as a user's table is right after a burst of writes. A relay whose cost per event
//! grows with the backlog, or whose memory does, shows it here: the target is the
//! 10M drain at 0.8× the 1M rate or better, with the peak RSS flat.

use anyhow::Result;
use serde_json::{json, Value};

use crate::measure::{self, f};
use crate::Bench;

/// Backlog sizes of the curve, to one destination.
pub const BACKLOGS: [u64; 3] = [100_000, 1_000_000, 10_000_000];
/// Destinations of the spread runs, each over [`SPREAD_EVENTS`] events.
pub const DESTINATIONS: [u64; 3] = [1, 8, 64];
/// The backlog of the spread runs.
const SPREAD_EVENTS: u64 = 1_000_000;

/// Every run of the curve (`--scale-backlogs` and `--scale-destinations` pick others).
pub async fn curve(b: &Bench) -> Result<Value> {
    let mut backlogs = Vec::new();
    for &n in &b.settings.scale_backlogs {
        backlogs.push(drain(b, n, 1).await?);
    }
    let mut spread = Vec::new();
    for &destinations in &b.settings.scale_destinations {
        spread.push(drain(b, SPREAD_EVENTS, destinations).await?);
    }
    Ok(json!({ "backlogs": backlogs, "destinations": spread }))
}

/// One `run --drain` of `n` rows spread over `destinations` destinations.
async fn drain(b: &Bench, n: u64, destinations: u64) -> Result<Value> {
    eprintln!("curve: {n} events to {destinations} destination(s), no statistics");
    let db = b.reset().await?;
    b.prefill_to(
        &db,
        "outbox",
        n,
        &format!("'bench.d' || (i % {destinations})"),
    )
    .await?;
    let mut run = measure::run_drain(b, &db, "file", &b.work.join("curve.jsonl"), n, &[]).await?;
    run["destinations"] = json!(destinations);
    Ok(run)
}

/// The curve's table for `results.md`, with each row's rate as a ratio to the 1M run's.
pub fn markdown(r: &Value) -> String {
    let c = &r["curve"];
    if c.is_null() {
        return String::new();
    }
    let reference = c["backlogs"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|x| x["events"] == json!(1_000_000))
        .and_then(|x| x["events_per_s"].as_f64());
    let mut s = String::from(
        "\n### Scale curve (file sink, no statistics)\n\n| backlog | destinations | events/s | ratio to the 1M, 1-destination rate | CPU s per 1M | peak RSS MB | Postgres CPU s |\n|---|---|---|---|---|---|---|\n",
    );
    for x in c["backlogs"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(c["destinations"].as_array().into_iter().flatten())
    {
        let ratio = match (x["events_per_s"].as_f64(), reference) {
            (Some(rate), Some(reference)) => format!("{}×", f(&json!(rate / reference))),
            _ => "-".into(),
        };
        s.push_str(&format!(
            "| {} | {} | {} | {ratio} | {} | {} | {} |\n",
            x["events"],
            x["destinations"],
            f(&x["events_per_s"]),
            f(&x["relay_cpu_s_per_million"]),
            f(&x["peak_rss_mb"]),
            f(&x["postgres_cpu_s"]),
        ));
    }
    s
}
