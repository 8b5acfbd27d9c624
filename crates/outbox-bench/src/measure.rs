//! The six measurements and the Markdown report.

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use serde_json::{json, Value};

use crate::{baseline, connect, dashboard, load, wait_child, wal, Bench, SUBJECT};

const TICKS: f64 = 100.0;

/// CPU seconds of a process from `/proc/<pid>/stat`: (own, reaped children).
fn proc_cpu(pid: &str) -> Option<(f64, f64, i64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let n = |i: usize| {
        rest.get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let ppid = rest.get(1)?.parse().ok()?;
    Some(((n(11) + n(12)) / TICKS, (n(13) + n(14)) / TICKS, ppid))
}

/// PostgreSQL's CPU seconds so far: the postmaster, its live children, and the children it
/// has reaped.
fn pg_cpu(b: &Bench) -> f64 {
    let pid_file = b.servers.pg_data.join("postmaster.pid");
    let Some(pm) = std::fs::read_to_string(pid_file)
        .ok()
        .and_then(|s| s.lines().next().map(str::to_string))
    else {
        return 0.0;
    };
    let pm_num: i64 = pm.parse().unwrap_or(0);
    let mut total = proc_cpu(&pm).map_or(0.0, |(own, reaped, _)| own + reaped);
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if let Some((own, _, ppid)) = proc_cpu(&name) {
                if ppid == pm_num {
                    total += own;
                }
            }
        }
    }
    total
}

/// nats-server's CPU seconds so far.
fn nats_cpu(b: &Bench) -> f64 {
    pid_file_cpu(&b.servers.nats_pid_file)
}

/// mariadbd's CPU seconds so far (one process: its connections are threads).
pub(crate) fn mariadb_cpu(b: &Bench) -> f64 {
    pid_file_cpu(&b.servers.mariadb_pid_file)
}

fn pid_file_cpu(pid_file: &std::path::Path) -> f64 {
    std::fs::read_to_string(pid_file)
        .ok()
        .and_then(|pid| proc_cpu(pid.trim()))
        .map_or(0.0, |(own, _, _)| own)
}

/// CPU seconds the two servers use from `start` on.
pub(crate) struct ServerCpu {
    postgres: f64,
    nats: f64,
}

impl ServerCpu {
    pub(crate) fn start(b: &Bench) -> ServerCpu {
        ServerCpu {
            postgres: pg_cpu(b),
            nats: nats_cpu(b),
        }
    }

    /// (PostgreSQL, nats-server) CPU seconds since `start`.
    pub(crate) fn used(&self, b: &Bench) -> (f64, f64) {
        (pg_cpu(b) - self.postgres, nats_cpu(b) - self.nats)
    }
}

fn self_cpu() -> f64 {
    proc_cpu("self").map_or(0.0, |(own, _, _)| own)
}

pub(crate) async fn statements(db: &tokio_postgres::Client) -> Result<i64> {
    Ok(db
        .query_one(
            "SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_statements
              WHERE query NOT ILIKE '%pg_stat_statements%'",
            &[],
        )
        .await?
        .get(0))
}

/// `/usr/bin/time` output of the relay with `args`: wall, user, system, peak RSS KiB.
pub(crate) fn timed(b: &Bench, args: &[&str]) -> Result<(f64, f64, f64, u64)> {
    timed_program(&b.work, &b.bin, args)
}

/// `/usr/bin/time` of `program` with `args`, its output discarded: wall, user, system
/// seconds, peak RSS KiB.
pub(crate) fn timed_program(
    work: &std::path::Path,
    program: &std::path::Path,
    args: &[impl AsRef<std::ffi::OsStr> + std::fmt::Debug],
) -> Result<(f64, f64, f64, u64)> {
    let out = work.join("time.txt");
    let status = Command::new("/usr/bin/time")
        .args(["-f", "%e %U %S %M", "-o"])
        .arg(&out)
        .arg(program)
        .args(args)
        .stdout(std::process::Stdio::null())
        .status()
        .context("/usr/bin/time (apt-get install time)")?;
    if !status.success() {
        bail!("{} {args:?} failed", program.display());
    }
    let text = std::fs::read_to_string(out)?;
    let v: Vec<f64> = text
        .lines()
        .last()
        .unwrap_or("")
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    Ok((v[0], v[1], v[2], v[3] as u64))
}

pub(crate) async fn stream_count(js: &async_nats::jetstream::Context) -> Result<u64> {
    Ok(js.get_stream("BENCH").await?.info().await?.state.messages)
}

/// PostgreSQL by itself consuming the outbox in batches of 1,000, with no relay: deleting
/// (the least any relay must do), and leasing then deleting (what a leased claim and an ack
/// do). The physical floor the relay's drain is measured against.
async fn postgres_floor(b: &Bench, n: u64) -> Result<Value> {
    let mut out = json!({});
    for (name, steps) in [
        (
            "delete_only",
            vec!["DELETE FROM outbox WHERE sequence_id IN (SELECT sequence_id FROM outbox ORDER BY sequence_id LIMIT 1000)"],
        ),
        (
            "lease_then_delete",
            vec![
                "UPDATE outbox SET locked_by = 'x', locked_until = now() + interval '30 s' WHERE sequence_id IN (SELECT sequence_id FROM outbox WHERE locked_by IS NULL ORDER BY sequence_id LIMIT 1000)",
                "DELETE FROM outbox WHERE sequence_id IN (SELECT sequence_id FROM outbox WHERE locked_by = 'x' ORDER BY sequence_id LIMIT 1000)",
            ],
        ),
    ] {
        eprintln!("drain: PostgreSQL alone, {name}, {n} rows");
        let db = b.reset().await?;
        b.prefill(&db, "outbox", n, false).await?;
        let start = Instant::now();
        loop {
            let mut touched = 0;
            for step in &steps {
                touched += db.execute(*step, &[]).await?;
            }
            if touched == 0 {
                break;
            }
        }
        out[name] = json!(n as f64 / start.elapsed().as_secs_f64());
    }
    Ok(out)
}

/// 1. Drain: the relay and the baseline, to the file sink and to JetStream.
pub async fn drain(b: &Bench) -> Result<Value> {
    let n = b.settings.events;
    let mut out = json!({});
    let with_baseline = b.settings.baseline_events > 0;
    if with_baseline {
        out["postgres_floor_events_per_s"] = postgres_floor(b, n.min(200_000)).await?;
    }
    for sink in b.settings.sinks.iter().map(String::as_str) {
        // As a user's backlog is right after it was loaded (no statistics yet), and after
        // VACUUM ANALYZE: the rate must not depend on the difference.
        let relay = drain_relay(b, sink, n, false).await?;
        let analyzed = drain_relay(b, sink, n, true).await?;
        if !with_baseline {
            out[sink] = json!({ "relay": relay, "relay_analyzed": analyzed });
            continue;
        }

        let bn = b.settings.baseline_events;
        eprintln!("drain: baseline, {bn} events to {sink}");
        let db = b.reset().await?;
        db.batch_execute(baseline::DDL).await?;
        b.prefill(&db, "baseline_outbox", bn, false).await?;
        let js = b.nats_stream().await?;
        let sink_impl = match sink {
            "file" => baseline::Sink::file(&b.work.join("baseline.jsonl"))?,
            _ => baseline::Sink::Nats(Box::new(js.clone())),
        };
        db.batch_execute("SELECT pg_stat_statements_reset()")
            .await?;
        let (servers, self0, start) = (ServerCpu::start(b), self_cpu(), Instant::now());
        let published =
            baseline::run(&b.url(), sink_impl, Arc::new(AtomicBool::new(false)), true).await?;
        let wall = start.elapsed().as_secs_f64();
        all_arrived(&format!("drain: baseline to {sink}"), bn, published)?;
        let ((pg, nats), own) = (servers.used(b), self_cpu() - self0);
        let calls = statements(&db).await?;
        let base = json!({
            "events": bn, "delivered": published, "wall_s": wall,
            "events_per_s": bn as f64 / wall,
            "relay_cpu_s_per_million": own * 1e6 / bn as f64,
            "statements_per_event": calls as f64 / bn as f64,
            "postgres_cpu_s": pg,
            "nats_server_cpu_s": nats,
        });
        let ratio = relay["events_per_s"].as_f64().unwrap_or(0.0)
            / base["events_per_s"].as_f64().unwrap_or(1.0);
        out[sink] =
            json!({ "relay": relay, "relay_analyzed": analyzed, "baseline": base, "ratio": ratio });
    }
    if let Some(sink) = b.settings.sinks.first() {
        out["dashboard"] = dashboard::drain(b, sink).await?;
    }
    Ok(out)
}

/// One relay drain of `n` prefilled events to `sink`.
async fn drain_relay(b: &Bench, sink: &str, n: u64, analyze: bool) -> Result<Value> {
    let statistics = if analyze { "analyzed" } else { "no statistics" };
    eprintln!("drain: relay, {n} events to {sink}, {statistics}");
    let db = b.reset().await?;
    b.prefill(&db, "outbox", n, analyze).await?;
    run_drain(b, &db, sink, &b.work.join("drain.jsonl"), n, &[]).await
}

/// One `outbox-relay run --drain` (with `extra_args`) of the `n` events waiting in the
/// database to `sink` (the file sink writes `file`, removed afterwards): its wall and CPU
/// time, peak memory, statements per event, the servers' CPU and what arrived. The polling
/// and the WAL-capture drains are measured alike through it. The HTTP server is off unless
/// `extra_args` gives an `--http-addr`.
pub(crate) async fn run_drain(
    b: &Bench,
    db: &tokio_postgres::Client,
    sink: &str,
    file: &std::path::Path,
    n: u64,
    extra_args: &[&str],
) -> Result<Value> {
    let js = b.nats_stream().await?;
    let target = match sink {
        "file" => format!("file:{}", file.display()),
        _ => b.servers.nats_url.clone(),
    };
    db.batch_execute("SELECT pg_stat_statements_reset()")
        .await?;
    let servers = ServerCpu::start(b);
    let url = b.relay_url();
    let mut args = drain_args(&url, &target);
    if !extra_args.contains(&"--http-addr") {
        args.extend(["--http-addr", ""]);
    }
    args.extend(extra_args);
    args.extend(b.settings.relay_args.iter().map(String::as_str));
    // Off the runtime's worker: the dashboard run's proxy serves the browser meanwhile.
    let (wall, user, sys, rss) = tokio::task::block_in_place(|| timed(b, &args))?;
    let (pg, nats) = servers.used(b);
    let calls = statements(db).await?;
    // The stream drops a repeated event id within its duplicate window (2 minutes); the file
    // keeps every line, so its ids are counted once each.
    let delivered = match sink {
        "file" => distinct_event_ids(&[file])?,
        _ => stream_count(&js).await?,
    };
    let _ = std::fs::remove_file(file);
    all_arrived(
        &format!("drain to {sink} ({})", extra_args.join(" ")),
        n,
        delivered,
    )?;
    Ok(json!({
        "events": n, "delivered": delivered, "wall_s": wall,
        "events_per_s": n as f64 / wall,
        "relay_cpu_s_per_million": (user + sys) * 1e6 / n as f64,
        "peak_rss_mb": rss as f64 / 1024.0,
        "statements_per_event": calls as f64 / n as f64,
        "postgres_cpu_s": pg,
        "nats_server_cpu_s": nats,
    }))
}

/// How many different event ids the file sink wrote to `files`, all together. Read line by
/// line, each id kept as 128 bits: the scale curve's 10M-event file is about 3 GB.
fn distinct_event_ids(files: &[&std::path::Path]) -> Result<u64> {
    use std::io::BufRead;
    let mut ids = std::collections::HashSet::new();
    for file in files {
        let reader = std::io::BufReader::new(
            std::fs::File::open(file)
                .with_context(|| format!("the file sink's {}", file.display()))?,
        );
        for line in reader.lines() {
            let line = line.with_context(|| format!("reading {}", file.display()))?;
            let event: EventIdOnly = serde_json::from_str(&line)
                .with_context(|| format!("a line of {}: {line}", file.display()))?;
            ids.insert(event.event_id.as_u128());
        }
    }
    Ok(ids.len() as u64)
}

/// The one field of a file sink's line that the drains count.
#[derive(serde::Deserialize)]
struct EventIdOnly {
    event_id: uuid::Uuid,
}

/// Fails the run when fewer events arrived than were sent: a figure over events that never
/// arrived would be a speed the relay did not reach. More than were sent (repeats past the
/// stream's duplicate window) is said, not fatal.
fn all_arrived(run: &str, sent: u64, arrived: u64) -> Result<()> {
    if arrived < sent {
        bail!(
            "{run}: {} of {sent} events never arrived ({arrived} did)",
            sent - arrived
        );
    }
    if arrived > sent {
        eprintln!("{run}: {arrived} distinct messages arrived for {sent} events sent");
    }
    Ok(())
}

/// `outbox-relay run --drain` of the database at `url` to `sink`, logging warnings only.
pub(crate) fn drain_args<'a>(url: &'a str, sink: &'a str) -> Vec<&'a str> {
    vec![
        "run",
        "--drain",
        "--database-url",
        url,
        "--sink",
        sink,
        "--log-level",
        "warn",
    ]
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

pub(crate) fn signal(child: &std::process::Child, sig: &str) {
    let _ = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status();
}

/// Stamps each event's arrival at a NATS subscriber, on a thread and runtime of its own:
/// on the bench's runtime the stamp waited for the 16 writers' tasks, and a broker's
/// delivery measured later than `pg_recvlogical`'s pipe, which a thread of its own reads.
/// Dropping the returned sender stops it.
async fn subscribe_on_own_thread(
    url: &str,
    received: Arc<Mutex<HashMap<u64, Instant>>>,
) -> Result<tokio::sync::oneshot::Sender<()>> {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (ready_tx, ready) = tokio::sync::oneshot::channel();
    let url = url.to_string();
    std::thread::spawn(move || {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => runtime,
            Err(e) => return drop(ready_tx.send(Err(anyhow::Error::from(e)))),
        };
        runtime.block_on(async move {
            let subscribed = async {
                let nats = async_nats::connect(&url).await?;
                anyhow::Ok(nats.subscribe("bench.>").await?)
            };
            let mut sub = match subscribed.await {
                Ok(sub) => sub,
                Err(e) => return drop(ready_tx.send(Err(e))),
            };
            let _ = ready_tx.send(Ok(()));
            tokio::pin!(stopped);
            loop {
                let m = tokio::select! {
                    m = sub.next() => m,
                    _ = &mut stopped => return,
                };
                let Some(m) = m else { return };
                let at = Instant::now();
                if let Ok(v) = serde_json::from_slice::<Value>(&m.payload) {
                    if let Some(seq) = v["seq"].as_u64() {
                        received.lock().unwrap().entry(seq).or_insert(at);
                    }
                }
            }
        });
    });
    ready.await.context("the NATS subscriber's thread")??;
    Ok(stop)
}

/// Commit-to-confirmation latency of one configuration at `rate` events/s.
async fn latency_run(b: &Bench, rate: u64, per_commit: u64, mode: &str) -> Result<Value> {
    let db = b.reset().await?;
    let js = b.nats_stream().await?;
    // `mapped`: the relay on the baseline's own table, as a peer's outbox table it maps.
    let table = if mode == "baseline" || mode == "mapped" {
        db.batch_execute(baseline::DDL).await?;
        "baseline_outbox"
    } else {
        "outbox"
    };
    // Where the writers write: the table, or (`wal-emit`) table-less events.
    let writes_to = if mode.contains("-emit") {
        load::EMIT
    } else {
        table
    };
    let received: Arc<Mutex<HashMap<u64, Instant>>> = Arc::default();
    let collector = subscribe_on_own_thread(&b.servers.nats_url, received.clone()).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let mut relay = None;
    let mut floor = None;
    let mut base_task = None;
    let mapped_config: String;
    match mode {
        _ if wal::FLOOR_MODES.contains(&mode) => {
            wal::prepare(b, &db).await?;
            let mut child = wal::spawn_recvlogical(b, &db, Stdio::piped()).await?;
            let output = child.output().context("pg_recvlogical's output")?;
            wal::stamp_arrivals(output, received.clone());
            floor = Some(child);
        }
        "baseline" => {
            let (url, stop, js) = (b.url(), stop.clone(), js.clone());
            base_task = Some(tokio::spawn(async move {
                baseline::run(&url, baseline::Sink::Nats(Box::new(js)), stop, false).await
            }));
        }
        _ => {
            // A piped mode measures the relay's own pipeline as the floor is measured: its
            // stdout sink into a pipe, no broker.
            let piped = wal::PIPED_MODES.contains(&mode);
            let sink = if piped {
                "stdout"
            } else {
                b.servers.nats_url.as_str()
            };
            let mut args = vec!["--sink", sink];
            match mode {
                "gated" => {
                    b.relay_cli(&["migrate", "--wakeup", "gated"])?;
                    args.extend(["--wakeup", "gated"]);
                }
                "poll" => args.extend(["--poll-fixed-rate", "--poll-interval", "50ms"]),
                "mapped" => {
                    let config = b.work.join("mapped.toml");
                    std::fs::write(&config, baseline::MAPPING)?;
                    mapped_config = config.display().to_string();
                    args.extend(["--config", &mapped_config, "--auto-migrate"]);
                }
                _ if mode.starts_with("wal") => {
                    // The slot exists before the relay starts, as in production: nothing
                    // is adopted into the parked table.
                    wal::prepare(b, &db).await?;
                    args.extend(wal::RELAY_ARGS);
                }
                _ => {}
            }
            args.extend(b.settings.relay_args.iter().map(String::as_str));
            let stdout = if piped { Stdio::piped() } else { Stdio::null() };
            let mut child = b.spawn_relay_with_stdout("latency", &args, stdout)?;
            if piped {
                let output = child.stdout.take().context("the relay's stdout")?;
                wal::stamp_arrivals(output, received.clone());
            }
            relay = Some(child);
        }
    }
    // Ready when a probe event (seq 0) comes through.
    let probe = format!(
        "INSERT INTO {table} (destination, partition_key, {}payload) VALUES ('{SUBJECT}', 'probe', {}'{{\"seq\": 0}}')",
        if table == "outbox" { "event_type, " } else { "" },
        if table == "outbox" { "'probe', " } else { "" },
    );
    db.batch_execute(&probe).await?;
    let ready = Instant::now();
    while !received.lock().unwrap().contains_key(&0) {
        if ready.elapsed() > Duration::from_secs(30) {
            bail!("latency ({mode}): the relay did not deliver a probe event within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The CPU the consumer (the relay, or `pg_recvlogical`) and nats-server spend on the
    // measured events, from here to the last delivery.
    let consumer = (relay.as_ref().map(Child::id))
        .or(floor.as_ref().map(wal::Recvlogical::id))
        .map(|pid| pid.to_string());
    let consumer_cpu = || consumer.as_deref().and_then(proc_cpu).map_or(0.0, |c| c.0);
    let cpu_at_start = (consumer_cpu(), nats_cpu(b));
    let writers = if rate >= 5000 { 16 } else { 4 };
    let seconds = b.settings.latency_seconds;
    let commits = load::fixed_rate(&b.url(), writes_to, rate, seconds, writers, per_commit).await?;
    let commits: Vec<(u64, Instant)> = commits.lock().unwrap().clone();
    let wait = Instant::now();
    while received.lock().unwrap().len() < commits.len() + 1
        && wait.elapsed() < Duration::from_secs(30)
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let per_event_us = |cpu_s: f64| cpu_s / commits.len().max(1) as f64 * 1e6;
    let consumer_us = consumer
        .is_some()
        .then(|| per_event_us(consumer_cpu() - cpu_at_start.0));
    // Modes that publish nothing leave the broker idle: no figure rather than its idle CPU.
    let publishes = !wal::PIPED_MODES.contains(&mode) && !wal::FLOOR_MODES.contains(&mode);
    let nats_us = publishes.then(|| per_event_us(nats_cpu(b) - cpu_at_start.1));
    stop.store(true, Ordering::Relaxed);
    if let Some(mut r) = relay {
        signal(&r, "-TERM");
        wait_child(&mut r, Duration::from_secs(30))?;
    }
    drop(floor);
    if let Some(t) = base_task {
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
    drop(collector);
    let got = received.lock().unwrap();
    let mut ms: Vec<f64> = commits
        .iter()
        .filter_map(|(seq, at)| {
            got.get(seq)
                .map(|r| r.saturating_duration_since(*at).as_secs_f64() * 1000.0)
        })
        .collect();
    if let Ok(path) = std::env::var("OUTBOX_BENCH_LATENCY_TRACE") {
        let start = commits.first().map(|(_, at)| *at);
        let mut lines = String::new();
        for (seq, at) in &commits {
            if let (Some(r), Some(start)) = (got.get(seq), start) {
                lines.push_str(&format!(
                    "{:.1} {:.2}\n",
                    at.duration_since(start).as_secs_f64() * 1000.0,
                    r.saturating_duration_since(*at).as_secs_f64() * 1000.0
                ));
            }
        }
        std::fs::write(format!("{path}-{mode}-{rate}x{per_commit}"), lines)?;
    }
    ms.sort_by(|a, b| a.total_cmp(b));
    Ok(json!({
        "mode": mode, "target_rate": rate, "events_per_commit": per_commit,
        "achieved_rate": commits.len() as f64 / seconds as f64,
        "events": commits.len(), "missing": commits.len() - ms.len(),
        "p50_ms": percentile(&ms, 0.5), "p99_ms": percentile(&ms, 0.99),
        "p999_ms": percentile(&ms, 0.999), "max_ms": ms.last().copied().unwrap_or(f64::NAN),
        "consumer_cpu_us_per_event": consumer_us, "nats_cpu_us_per_event": nats_us,
    }))
}

/// Latency runs as (events/s, events per transaction, mode).
pub type LatencyPlan<'a> = &'a [(u64, u64, &'a str)];

/// Latency (2.) at 1,000/s and 10,000/s: NOTIFY, the gated wake-up, fixed-rate polling
/// (50 ms), the baseline, the relay on the baseline's table through a mapping (at 1,000/s)
/// and WAL capture (rows, and `outbox_emit`), with single-row
/// transactions; then 10,000/s as transactions of 10 events (1,000 commits/s), which this
/// machine's writers can reach with a trigger.
pub const LATENCY_PLAN: LatencyPlan<'static> = &[
    (1_000, 1, "notify"),
    (1_000, 1, "gated"),
    (1_000, 1, "poll"),
    (1_000, 1, "baseline"),
    (1_000, 1, "mapped"),
    (1_000, 1, "wal"),
    (1_000, 1, "wal-emit"),
    (10_000, 1, "notify"),
    (10_000, 1, "gated"),
    (10_000, 1, "poll"),
    (10_000, 1, "baseline"),
    (10_000, 1, "wal"),
    (10_000, 1, "wal-emit"),
    (10_000, 10, "notify"),
    (10_000, 10, "gated"),
    (10_000, 10, "poll"),
    (10_000, 10, "baseline"),
    (10_000, 10, "recvlogical"),
    (10_000, 10, "wal"),
    (10_000, 10, "recvlogical-emit"),
    (10_000, 10, "wal-emit"),
];

/// The latency runs of `--latency-plan`, or else `default`.
pub async fn latency(b: &Bench, default: LatencyPlan<'_>) -> Result<Value> {
    let mut plan = b.settings.latency_plan.clone();
    if plan.is_empty() {
        plan = default
            .iter()
            .map(|(rate, per, mode)| (*rate, *per, mode.to_string()))
            .collect();
    }
    let mut runs = Vec::new();
    for (rate, per_commit, mode) in plan {
        eprintln!("latency: {mode} at {rate}/s, {per_commit} per transaction");
        runs.push(latency_run(b, rate, per_commit, &mode).await?);
    }
    Ok(Value::Array(runs))
}

async fn backlog(db: &tokio_postgres::Client) -> Result<i64> {
    Ok(db
        .query_one("SELECT count(*)::int8 FROM outbox", &[])
        .await?
        .get(0))
}

/// Keep-up (3.): the insert rate with the relay off for `--latency-seconds` (at least 5 s),
/// then whether the backlog stays bounded for twice as long with it on while the writers go
/// flat out, with each wake-up.
pub async fn keep_up(b: &Bench) -> Result<Value> {
    let mut out = json!({});
    for wakeup in ["notify", "gated"] {
        out[wakeup] = keep_up_with(b, wakeup).await?;
    }
    Ok(out)
}

/// How long the relay may take to empty the outbox once keep-up's writers stop; the run
/// fails past it.
const KEEP_UP_DRAIN_LIMIT: Duration = Duration::from_secs(120);

async fn keep_up_with(b: &Bench, wakeup: &str) -> Result<Value> {
    let seconds = b.settings.latency_seconds.max(5) as f64;
    eprintln!("keep-up ({wakeup}): insert rate without the relay");
    b.reset().await?;
    b.relay_cli(&["migrate", "--wakeup", wakeup])?;
    let off = load::flat_out(&b.url(), "outbox", 16, seconds).await?;
    let db = b.reset().await?;
    b.relay_cli(&["migrate", "--wakeup", wakeup])?;
    b.nats_stream().await?;
    let mut relay = b.spawn_relay(
        "keepup",
        &["--sink", &b.servers.nats_url, "--wakeup", wakeup],
    )?;
    eprintln!("keep-up ({wakeup}): insert rate with the relay publishing to JetStream");
    let samples = Arc::new(Mutex::new(Vec::new()));
    let sampler = {
        let (url, samples) = (b.url(), samples.clone());
        tokio::spawn(async move {
            let db = connect(&url).await?;
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let n = backlog(&db).await?;
                samples.lock().unwrap().push(n);
            }
            #[allow(unreachable_code)]
            Ok::<_, anyhow::Error>(())
        })
    };
    let on = load::flat_out(&b.url(), "outbox", 16, seconds * 2.0).await?;
    sampler.abort();
    let at_end = backlog(&db).await?;
    let start = Instant::now();
    let mut left = at_end;
    while left > 0 && start.elapsed() < KEEP_UP_DRAIN_LIMIT {
        tokio::time::sleep(Duration::from_millis(50)).await;
        left = backlog(&db).await?;
    }
    let drain_after = start.elapsed().as_secs_f64();
    signal(&relay, "-TERM");
    wait_child(&mut relay, Duration::from_secs(30))?;
    if left > 0 {
        bail!(
            "keep-up ({wakeup}): {left} of the {at_end} events left when the writers stopped \
             were still in the outbox {KEEP_UP_DRAIN_LIMIT:?} later: the relay did not drain"
        );
    }
    let samples = samples.lock().unwrap().clone();
    let max = samples.iter().copied().max().unwrap_or(0).max(at_end);
    Ok(json!({
        "seconds_relay_off": seconds,
        "seconds_relay_on": seconds * 2.0,
        "insert_rate_relay_off": off,
        "insert_rate_relay_on": on,
        "backlog_samples": samples,
        "backlog_max": max,
        "backlog_at_end": at_end,
        "drained_after_s": drain_after,
        "bounded": (max as f64) < on,
    }))
}

/// The advisory lock a waiting relay holds under `wakeup = "gated"` (see the PostgreSQL store).
const GATE_KEY: &str = "SELECT pg_advisory_lock(hashtext('outbox-relay wake-up public.outbox'))";

/// Writer cost under the gated trigger while a connection of the bench holds the gate, as a
/// waiting relay does (every commit notifies). No relay runs: a real one would wake at the
/// first insert and let the gate go.
pub const WRITERS_GATE_HELD: &str = "gated, gate held (no relay)";
/// Writer cost under the gated trigger with nobody holding the gate, as writers find it
/// while a relay works (no commit notifies). No relay runs, so none of a relay's claims and
/// deletes compete with the writers for the cores.
pub const WRITERS_GATE_FREE: &str = "gated, gate free (no relay)";

/// The writer-cost variants of the full suite.
pub const WRITER_VARIANTS: &[&str] = &[
    "no trigger",
    "NOTIFY trigger",
    WRITERS_GATE_HELD,
    WRITERS_GATE_FREE,
    wal::WRITERS_SLOT,
    wal::WRITERS_FLOOR,
    wal::WRITERS_RELAY,
    wal::WRITERS_EMIT,
];

/// 5. Writer cost of the wake-up mechanism (and of WAL capture) at 1, 4 and 16 writers.
pub async fn writer_cost(b: &Bench, variants: &[&str]) -> Result<Value> {
    let seconds = (b.settings.latency_seconds as f64 / 2.0).max(3.0);
    let mut rows = Vec::new();
    for variant in variants.iter().copied() {
        let db = b.reset().await?;
        // A listener, as the relay would be.
        let listener = connect(&b.url()).await?;
        listener.batch_execute("LISTEN outbox_relay").await?;
        let holder = connect(&b.url()).await?;
        let mut relay = None;
        // `pg_recvlogical` for the floor variant; ended when the variant is.
        let mut floor = None;
        let mut writes_to = "outbox";
        match variant {
            "no trigger" => {
                db.batch_execute("DROP TRIGGER outbox_trigger ON outbox")
                    .await?
            }
            "NOTIFY trigger" => {}
            wal::WRITERS_SLOT => wal::prepare(b, &db).await?,
            wal::WRITERS_FLOOR => {
                wal::prepare(b, &db).await?;
                floor = Some(wal::spawn_recvlogical(b, &db, Stdio::null()).await?);
            }
            wal::WRITERS_RELAY | wal::WRITERS_EMIT => {
                relay = Some(wal::start_relay(b, &db, "writers").await?);
                if variant == wal::WRITERS_EMIT {
                    writes_to = load::EMIT;
                }
            }
            _ => {
                b.relay_cli(&["migrate", "--wakeup", "gated"])?;
                if variant == WRITERS_GATE_HELD {
                    holder.batch_execute(GATE_KEY).await?;
                }
            }
        }
        let mut rates = serde_json::Map::new();
        for writers in [1u64, 4, 16] {
            eprintln!("writer cost: {variant}, {writers} writers");
            db.batch_execute("TRUNCATE outbox").await?;
            let rate = load::flat_out(&b.url(), writes_to, writers, seconds).await?;
            rates.insert(writers.to_string(), json!(rate));
        }
        if let Some(mut relay) = relay {
            signal(&relay, "-TERM");
            wait_child(&mut relay, Duration::from_secs(60))?;
        }
        drop(floor);
        rows.push(json!({ "variant": variant, "inserts_per_s": rates }));
    }
    Ok(Value::Array(rows))
}

/// 6. Scaling: 1, 2 and 3 nodes draining the same backlog, ordered and unordered.
pub async fn scaling(b: &Bench) -> Result<Value> {
    let n = b.settings.scaling_events;
    let mut runs = Vec::new();
    for ordering in ["key", "none"] {
        for nodes in 1..=3usize {
            eprintln!("scaling: {nodes} node(s), ordering {ordering}, {n} events");
            let db = b.reset().await?;
            b.prefill(&db, "outbox", n, false).await?;
            let start = Instant::now();
            let mut children = Vec::new();
            for i in 0..nodes {
                let sink = format!("file:{}", b.work.join(format!("scale-{i}.jsonl")).display());
                children.push(b.spawn_relay(
                    &format!("scale-{i}"),
                    &[
                        "--sink",
                        &sink,
                        "--ordering",
                        ordering,
                        "--node-id",
                        &format!("bench-{i}"),
                    ],
                )?);
            }
            while backlog(&db).await? > 0 {
                if start.elapsed() > Duration::from_secs(600) {
                    bail!("scaling: the backlog did not drain within 10 minutes");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let wall = start.elapsed().as_secs_f64();
            for c in &children {
                signal(c, "-TERM");
            }
            for mut c in children {
                wait_child(&mut c, Duration::from_secs(60))?;
            }
            let files: Vec<_> = (0..nodes)
                .map(|i| b.work.join(format!("scale-{i}.jsonl")))
                .collect();
            let paths: Vec<&std::path::Path> = files.iter().map(|f| f.as_path()).collect();
            let delivered = distinct_event_ids(&paths)?;
            for file in &files {
                let _ = std::fs::remove_file(file);
            }
            all_arrived(
                &format!("scaling: {nodes} node(s), ordering {ordering}"),
                n,
                delivered,
            )?;
            runs.push(json!({
                "ordering": ordering, "nodes": nodes, "events": n, "delivered": delivered,
                "wall_s": wall, "events_per_s": n as f64 / wall,
            }));
        }
    }
    Ok(Value::Array(runs))
}

pub(crate) fn f(v: &Value) -> String {
    match v.as_f64() {
        Some(x) if x >= 100.0 => format!("{x:.0}"),
        Some(x) if x >= 10.0 => format!("{x:.1}"),
        Some(x) if x >= 0.1 || x == 0.0 => format!("{x:.2}"),
        Some(x) => format!("{x:.4}"),
        None => "-".into(),
    }
}

/// The report, from the results.
pub fn markdown(r: &Value) -> String {
    let mut s = format!(
        "## Results ({}, {} cores, {} GiB, {}, kernel {})\n\n",
        r["date"].as_str().unwrap_or(""),
        r["machine"]["cores"],
        r["machine"]["memory_gib"],
        r["postgres"].as_str().unwrap_or(""),
        r["machine"]["kernel"].as_str().unwrap_or(""),
    );
    if let Some(mode) = r["settings"]["relay_sslmode"].as_str() {
        s.push_str(&format!(
            "The relay connected to PostgreSQL with `sslmode` {mode}.\n\n"
        ));
    }
    let null = Value::Null;
    let d = r.get("drain").unwrap_or(&null);
    if !d.is_null() || r.get("wal_drain").is_some() {
        s.push_str("### Drain\n\n| sink | relay | events | events/s | CPU s per 1M | peak RSS MB | statements/event | Postgres CPU s | nats-server CPU s | ratio to baseline |\n|---|---|---|---|---|---|---|---|---|---|\n");
        for sink in ["file", "nats"] {
            let x = &d[sink];
            for who in ["relay", "relay_analyzed", "baseline"] {
                let y = &x[who];
                if y.is_null() {
                    continue;
                }
                let label = match who {
                    "relay" => "relay, no statistics",
                    "relay_analyzed" => "relay, after VACUUM ANALYZE",
                    _ => "baseline, no statistics",
                };
                let relay = who != "baseline";
                let ratio = match who {
                    "relay" => format!("{}×", f(&x["ratio"])),
                    "relay_analyzed" => "-".into(),
                    _ => "1×".into(),
                };
                s.push_str(&format!(
                    "| {sink} | {label} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                    y["events"],
                    f(&y["events_per_s"]),
                    f(&y["relay_cpu_s_per_million"]),
                    if relay {
                        f(&y["peak_rss_mb"])
                    } else {
                        "-".into()
                    },
                    f(&y["statements_per_event"]),
                    f(&y["postgres_cpu_s"]),
                    f(&y["nats_server_cpu_s"]),
                    ratio,
                ));
            }
            s.push_str(&wal::drain_rows(r, sink));
        }
        let floor = &d["postgres_floor_events_per_s"];
        if !floor.is_null() {
            s.push_str(&format!(
            "\nPostgreSQL alone, batches of 1,000 rows, no relay: {} rows/s deleted, {} rows/s leased then deleted.\n\n",
            f(&floor["delete_only"]), f(&floor["lease_then_delete"])
        ));
        }
        s.push_str(&wal::drain_note(r));
        s.push('\n');
        s.push_str(&dashboard::markdown(r));
    }
    s.push_str(&wal::large_events_note(r));
    if let Some(Value::Array(runs)) = r.get("latency") {
        s.push_str("### Latency, commit to confirmation (ms)\n\n");
        s.push_str(&table(
            &[
                "target rate",
                "events per transaction",
                "achieved",
                "mode",
                "p50",
                "p99",
                "p99.9",
                "max",
                "missing",
                "relay (or pg_recvlogical) CPU µs/event",
                "nats-server CPU µs/event",
            ],
            runs,
            |x| {
                vec![
                    x["target_rate"].to_string(),
                    x["events_per_commit"].to_string(),
                    f(&x["achieved_rate"]),
                    x["mode"].as_str().unwrap_or("").to_string(),
                    f(&x["p50_ms"]),
                    f(&x["p99_ms"]),
                    f(&x["p999_ms"]),
                    f(&x["max_ms"]),
                    x["missing"].to_string(),
                    f(&x["consumer_cpu_us_per_event"]),
                    f(&x["nats_cpu_us_per_event"]),
                ]
            },
        ));
        s.push('\n');
    }
    if let Some(keep) = r.get("keep_up") {
        s.push_str("### Keep-up (16 writers flat out; the relay publishing to JetStream)\n\n");
        for wakeup in ["notify", "gated"] {
            let k = &keep[wakeup];
            s.push_str(&format!(
                "- **{wakeup}**: {} inserts/s with the relay off ({} s), {} with it on ({} s). Backlog each second: {}; max {}, {} when the writers stopped, drained {} s later. Bounded: {}.\n",
                f(&k["insert_rate_relay_off"]), f(&k["seconds_relay_off"]),
                f(&k["insert_rate_relay_on"]), f(&k["seconds_relay_on"]), k["backlog_samples"],
                k["backlog_max"], k["backlog_at_end"], f(&k["drained_after_s"]), k["bounded"],
            ));
        }
        s.push('\n');
    }
    if let Some(Value::Array(rows)) = r.get("writer_cost") {
        let base = rows
            .first()
            .map(|x| x["inserts_per_s"].clone())
            .unwrap_or_default();
        s.push_str("### Writer cost (single-row inserts/s; change against no trigger)\n\n");
        s.push_str(&table(
            &["wake-up", "1 writer", "4 writers", "16 writers"],
            rows,
            |x| {
                let cell = |w: &str| {
                    let v = x["inserts_per_s"][w].as_f64().unwrap_or(0.0);
                    let b = base[w].as_f64().unwrap_or(1.0);
                    format!("{v:.0} ({:+.0}%)", (v / b - 1.0) * 100.0)
                };
                let variant = x["variant"].as_str().unwrap_or("").to_string();
                vec![variant, cell("1"), cell("4"), cell("16")]
            },
        ));
        s.push('\n');
    }
    if let Some(Value::Array(runs)) = r.get("scaling") {
        s.push_str("### Scaling (drain to per-node file sinks, wall time including start-up)\n\n");
        s.push_str(&table(
            &["ordering", "nodes", "events", "events/s"],
            runs,
            |x| {
                vec![
                    x["ordering"].as_str().unwrap_or("").to_string(),
                    x["nodes"].to_string(),
                    x["events"].to_string(),
                    f(&x["events_per_s"]),
                ]
            },
        ));
    }
    s
}

/// A markdown table: the header row, its rule, then one row of `cells(x)` for each result.
fn table(header: &[&str], results: &[Value], cells: impl Fn(&Value) -> Vec<String>) -> String {
    let row = |cells: &[String]| format!("| {} |\n", cells.join(" | "));
    let header: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    let mut out = row(&header);
    out.push_str(&format!("|{}\n", "---|".repeat(header.len())));
    for x in results {
        out.push_str(&row(&cells(x)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_event_fails_the_run_and_a_repeated_one_counts_once() {
        let file = std::env::temp_dir().join(format!("outbox-bench-ids-{}", std::process::id()));
        std::fs::write(
            &file,
            // The file sink writes each event's id as a UUID.
            "{\"event_id\":\"0190a1b2-0000-7000-8000-00000000000a\",\"sequence_id\":1}\n\
             {\"event_id\":\"0190a1b2-0000-7000-8000-00000000000b\",\"sequence_id\":2}\n\
             {\"event_id\":\"0190a1b2-0000-7000-8000-00000000000a\",\"sequence_id\":1}\n",
        )
        .unwrap();
        let delivered = distinct_event_ids(&[file.as_path()]);
        std::fs::remove_file(&file).unwrap();
        assert_eq!(delivered.unwrap(), 2);

        let missing = all_arrived("drain to file ()", 3, 2).unwrap_err();
        assert_eq!(
            missing.to_string(),
            "drain to file (): 1 of 3 events never arrived (2 did)"
        );
        assert!(all_arrived("drain to file ()", 2, 2).is_ok());
        assert!(
            all_arrived("drain to nats ()", 2, 3).is_ok(),
            "repeats are said, not fatal"
        );
    }
}
