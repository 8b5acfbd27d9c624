//! The benchmark suite (issue 6): drain, latency, keep-up, writer cost and scaling, each
//! against a seed-style baseline relay measured in the same run where the issue asks for one.
//!
//! `cargo run --release -p outbox-bench -- [--events N] [--quick] [--out DIR]`
//!
//! It starts its own durable PostgreSQL (with pg_stat_statements) and NATS through
//! `scripts/servers.sh` in `/tmp/outbox-relay-bench`, drives release builds of the relay as
//! child processes, records the machine, and writes `results.json` and `results.md` to
//! `--out` (default `bench-results`). See BENCHMARKS.md for the method.

mod baseline;
mod binlog;
mod curve;
mod dashboard;
mod load;
mod measure;
mod wal;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

pub const SUBJECT: &str = "bench.orders";

/// The drains' payload for row `i` of `generate_series`: about 200 bytes of JSON.
pub const PAYLOAD_SQL: &str =
    "jsonb_build_object('seq', i, 'customer', 'customer-' || (i % 1000), \
     'total', 99.95, 'currency', 'EUR', 'items', 3, 'note', repeat('x', 100))";

/// Where `scripts/servers.sh` keeps the bench servers' data, sockets and pids.
const STATE_DIR: &str = "/tmp/outbox-relay-bench";

/// Settings from the command line.
#[derive(Clone, Debug)]
pub struct Settings {
    pub events: u64,
    pub baseline_events: u64,
    pub latency_seconds: u64,
    pub scaling_events: u64,
    pub out: PathBuf,
    pub only: Option<String>,
    /// Drain sinks to measure (`file`, `nats`).
    pub sinks: Vec<String>,
    /// Extra options for the drained and latency relays (for sweeps).
    pub relay_args: Vec<String>,
    /// Latency runs as (events/s, events per transaction, mode); empty = the full plan.
    pub latency_plan: Vec<(u64, u64, String)>,
    /// `OUTBOX_BENCH_RELAY_LOG`: the latency relays' log filter; when set, their logs are kept.
    pub relay_log: Option<String>,
    /// Events per transaction of the WAL drains' backlog (a user's backlog is many
    /// transactions; one huge one is decoded only after its commit, spilled to disk).
    pub wal_events_per_transaction: u64,
    /// `--wal-drain-rounds N`: the `outbox_emit` drain measured N times over one backlog,
    /// the floor and the relay alternating, so that the host's speed drifting between two
    /// drains minutes apart moves both sides of each ratio alike.
    pub wal_drain_rounds: u64,
    /// Rows per transaction of the `--only binlog` backlog.
    pub binlog_events_per_transaction: u64,
    /// `--relay-sslmode`: how the measured relay connects to PostgreSQL (libpq's `sslmode`;
    /// unset: the relay's default, `prefer`, which uses the server's TLS). The bench's own
    /// writers and readers never use TLS.
    pub relay_sslmode: Option<String>,
    /// `--only curve`: the backlogs drained to one destination.
    pub scale_backlogs: Vec<u64>,
    /// `--only curve`: the destination counts of the 1M-event spread runs.
    pub scale_destinations: Vec<u64>,
}

fn settings() -> Result<Settings> {
    let mut s = Settings {
        events: 1_000_000,
        baseline_events: 50_000,
        latency_seconds: 10,
        scaling_events: 200_000,
        out: PathBuf::from("bench-results"),
        only: None,
        sinks: vec!["file".into(), "nats".into()],
        relay_args: Vec::new(),
        latency_plan: Vec::new(),
        relay_log: std::env::var("OUTBOX_BENCH_RELAY_LOG").ok(),
        wal_events_per_transaction: 1_000,
        wal_drain_rounds: 1,
        binlog_events_per_transaction: 1_000,
        relay_sslmode: None,
        scale_backlogs: curve::BACKLOGS.to_vec(),
        scale_destinations: curve::DESTINATIONS.to_vec(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().context("a value must follow the flag");
        match arg.as_str() {
            "--events" => s.events = value()?.parse()?,
            "--baseline-events" => s.baseline_events = value()?.parse()?,
            "--latency-seconds" => s.latency_seconds = value()?.parse()?,
            "--scaling-events" => s.scaling_events = value()?.parse()?,
            "--scale-backlogs" => s.scale_backlogs = numbers(&value()?)?,
            "--scale-destinations" => s.scale_destinations = numbers(&value()?)?,
            "--out" => s.out = PathBuf::from(value()?),
            "--only" => s.only = Some(value()?),
            "--sinks" => s.sinks = value()?.split(',').map(str::to_string).collect(),
            "--relay-args" => {
                s.relay_args = value()?.split_whitespace().map(str::to_string).collect()
            }
            "--latency-plan" => s.latency_plan = parse_latency_plan(&value()?)?,
            "--binlog-events-per-transaction" => {
                s.binlog_events_per_transaction = value()?.parse::<u64>()?.max(1)
            }
            "--wal-events-per-transaction" => {
                s.wal_events_per_transaction = value()?.parse::<u64>()?.max(1)
            }
            "--wal-drain-rounds" => s.wal_drain_rounds = value()?.parse::<u64>()?.max(1),
            "--relay-sslmode" => s.relay_sslmode = Some(value()?),
            "--quick" => {
                s.events = 100_000;
                s.baseline_events = 10_000;
                s.latency_seconds = 4;
                s.scaling_events = 50_000;
            }
            "--help" | "-h" => {
                println!("outbox-bench [--events N] [--baseline-events N] [--latency-seconds S] [--scaling-events N] [--quick] [--only binlog|binlog-writers|curve|drain|latency|keepup|writers|scaling|wal|wal-drain|wal-memory] [--out DIR]");
                println!("  drain sweeps: [--sinks file,nats] [--relay-args \"--batch-size 2000\"]; --baseline-events 0 skips the baseline and the PostgreSQL floor");
                println!("  --only drain ends with the dashboard run: the drain to the first sink, once without and once with headless `chromium` open on the relay's dashboard (skipped without chromium)");
                println!("  latency subsets: [--latency-plan 10000x10:notify+gated,1000x1:poll] (events/s x events per transaction : modes notify|gated|poll|baseline|wal|wal-emit; mapped: the relay on the baseline's table through a custom mapping; wal-stdout|wal-emit-stdout: the WAL relay's stdout sink piped into the bench, no broker; and the host's WAL floor recvlogical|recvlogical-emit: pg_recvlogical reading the slot, no relay)");
                println!("  --only curve: the scale curve, `run --drain` to the file sink of un-analyzed backlogs of [--scale-backlogs 100000,1000000,10000000] rows to one destination, and of 1,000,000 rows over [--scale-destinations 1,8,64] destinations; the 10M run needs about 9 GB free disk");
                println!("  --only binlog: binlog capture's drain on MariaDB, beside mariadb-binlog --read-from-remote-server reading the same log (the floor, raw and decoding rows), MariaDB deleting the same rows alone (the delete floor), polling's drain of the same table and the table-less (BLACKHOLE) form's, with MariaDB's CPU for each, then the writers' cost; [--binlog-events-per-transaction N] sizes the backlog's transactions (default 1000; --events N with N per transaction is one transaction, whose peak RSS the report shows)");
                println!("  --only binlog-writers: the writers' cost part of --only binlog alone, on a fresh database");
                println!("  --only wal-drain: the WAL capture drains alone (table form and outbox_emit, each beside pg_recvlogical's drain of the same backlog); [--wal-drain-rounds N] drains the outbox_emit backlog N times, the floor and the relay alternating, and reports each round's ratio and their median");
                println!("  --only wal-memory: WAL capture's drain of 256 events of 1 MiB to a webhook answering each after 500 ms, with the relay's peak RSS (also part of --only wal)");
                println!("  --only wal: the WAL capture drains (table form and outbox_emit), WAL latency runs and WAL writer cost only; [--wal-events-per-transaction N] sizes the drains' backlog transactions (default 1000)");
                println!("  --relay-sslmode disable|prefer|require: how the measured relay connects to PostgreSQL (default: the relay's own, prefer, which uses the server's TLS)");
                println!("  environment: OUTBOX_BENCH_RELAY_LOG=<filter> keeps the latency relays' JSON logs; OUTBOX_BENCH_LATENCY_TRACE=<path> writes each latency run's events as \"ms since the first commit, latency ms\" lines to <path>-<mode>-<rate>x<per transaction>; OUTBOX_BENCH_RELAY_BIN=<path> measures that relay binary instead of building one");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}; see --help"),
        }
    }
    if let Some(only) = s.only.as_deref() {
        if !ONLY.contains(&only) {
            bail!(
                "--only {only:?} names no part of the suite: one of {}",
                ONLY.join(", ")
            );
        }
    }
    Ok(s)
}

/// A comma-separated list of counts; empty for none.
fn numbers(list: &str) -> Result<Vec<u64>> {
    list.split(',')
        .filter(|n| !n.is_empty())
        .map(|n| {
            n.trim()
                .parse::<u64>()
                .with_context(|| format!("{n:?} in {list:?} is not a count"))
        })
        .collect()
}

/// The parts `--only` can pick.
const ONLY: [&str; 11] = [
    "binlog",
    "binlog-writers",
    "curve",
    "drain",
    "latency",
    "keepup",
    "writers",
    "scaling",
    "wal",
    "wal-drain",
    "wal-memory",
];

/// `RATExPER:MODE+MODE,...`, for example `10000x10:notify+gated,1000x1:baseline`.
/// The latency modes that measure a relay (the floor's are [`wal::FLOOR_MODES`]).
const RELAY_LATENCY_MODES: [&str; 7] = [
    "notify", "gated", "poll", "baseline", "mapped", "wal", "wal-emit",
];

fn parse_latency_plan(text: &str) -> Result<Vec<(u64, u64, String)>> {
    let mut plan = Vec::new();
    for item in text.split(',') {
        let (rate, modes) = item
            .split_once(':')
            .with_context(|| format!("latency plan item {item:?}: expected RATExPER:MODES"))?;
        let (rate, per) = rate.split_once('x').unwrap_or((rate, "1"));
        for mode in modes.split('+') {
            let modes = RELAY_LATENCY_MODES
                .iter()
                .chain(&wal::PIPED_MODES)
                .chain(&wal::FLOOR_MODES);
            if !modes.clone().any(|known| *known == mode) {
                let known: Vec<&str> = modes.copied().collect();
                bail!(
                    "latency plan item {item:?}: unknown mode {mode:?} ({})",
                    known.join(", ")
                );
            }
            plan.push((rate.parse()?, per.parse()?, mode.to_string()));
        }
    }
    Ok(plan)
}

/// The servers this run started, stopped on drop.
pub struct Servers {
    pub admin_url: String,
    /// MariaDB's admin URL, with `--only binlog`.
    pub mysql_url: Option<String>,
    pub nats_url: String,
    pub pg_data: PathBuf,
    /// nats-server's pid file, for its CPU time.
    pub nats_pid_file: PathBuf,
    /// mariadbd's pid file (with `--only binlog`), for its CPU time.
    pub mariadb_pid_file: PathBuf,
    env: Vec<(String, String)>,
}

impl Servers {
    fn start(mariadb: bool) -> Result<Servers> {
        let servers = if mariadb {
            "postgres nats mariadb"
        } else {
            "postgres nats"
        };
        let env = vec![
            ("OUTBOX_TEST_STATE".to_string(), STATE_DIR.to_string()),
            ("OUTBOX_TEST_SERVERS".into(), servers.into()),
            ("OUTBOX_TEST_MARIADB_PORT".into(), "54307".into()),
            ("OUTBOX_TEST_PG_PORT".into(), "54339".into()),
            ("OUTBOX_TEST_NATS_PORT".into(), "54232".into()),
            ("OUTBOX_PG_DURABLE".into(), "1".into()),
            (
                "OUTBOX_PG_EXTRA".into(),
                "-c shared_preload_libraries=pg_stat_statements".into(),
            ),
        ];
        let out = Command::new("scripts/servers.sh")
            .arg("start")
            .envs(env.iter().cloned())
            .stderr(Stdio::inherit())
            .output()
            .context("scripts/servers.sh start (run from the repository root)")?;
        if !out.status.success() {
            bail!("scripts/servers.sh start failed");
        }
        let exports: BTreeMap<String, String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.strip_prefix("export "))
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Ok(Servers {
            mysql_url: exports.get("OUTBOX_TEST_MYSQL_URL").cloned(),
            admin_url: exports
                .get("OUTBOX_TEST_DATABASE_URL")
                .context("no database URL")?
                .clone(),
            nats_url: exports
                .get("OUTBOX_TEST_NATS_URL")
                .context("no NATS URL")?
                .clone(),
            pg_data: PathBuf::from(exports.get("OUTBOX_TEST_PG_DATA").context("no data dir")?),
            nats_pid_file: Path::new(STATE_DIR).join("nats/nats.pid"),
            mariadb_pid_file: Path::new(STATE_DIR).join("mariadb/mysqld.pid"),
            env,
        })
    }

    pub fn db_url(&self, name: &str) -> String {
        let cut = self.admin_url.rfind('/').expect("a path");
        format!("{}/{name}", &self.admin_url[..cut])
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        let _ = Command::new("scripts/servers.sh")
            .arg("stop")
            .envs(self.env.iter().cloned())
            .status();
    }
}

/// Context every measurement needs.
pub struct Bench {
    pub servers: Servers,
    pub bin: PathBuf,
    pub work: PathBuf,
    pub settings: Settings,
}

pub async fn connect(url: &str) -> Result<tokio_postgres::Client> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .with_context(|| format!("connect to {url}"))?;
    tokio::spawn(connection);
    Ok(client)
}

impl Bench {
    pub fn url(&self) -> String {
        self.servers.db_url("bench")
    }

    /// The URL the measured relay connects with (see [`Settings::relay_sslmode`]).
    pub fn relay_url(&self) -> String {
        match &self.settings.relay_sslmode {
            Some(mode) => format!("{}?sslmode={mode}", self.url()),
            None => self.url(),
        }
    }

    /// A fresh `bench` database with the relay's tables (and pg_stat_statements).
    pub async fn reset(&self) -> Result<tokio_postgres::Client> {
        let admin = connect(&self.servers.admin_url).await?;
        // A replication slot keeps its database from being dropped (and WAL on disk).
        wal::drop_slots(&admin).await?;
        admin
            .batch_execute("DROP DATABASE IF EXISTS bench WITH (FORCE)")
            .await?;
        admin.batch_execute("CREATE DATABASE bench").await?;
        self.relay_cli(&["migrate"])?;
        let db = connect(&self.url()).await?;
        db.batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .await?;
        Ok(db)
    }

    pub fn relay_cli(&self, args: &[&str]) -> Result<()> {
        let status = Command::new(&self.bin)
            .args(args)
            .args(["--database-url", &self.relay_url()])
            .stdout(Stdio::null())
            .status()?;
        if !status.success() {
            bail!("outbox-relay {args:?} failed");
        }
        Ok(())
    }

    /// `outbox-relay run` with `args`, logs to `<work>/<name>.log`.
    pub fn spawn_relay(&self, name: &str, args: &[&str]) -> Result<Child> {
        self.spawn_relay_with_stdout(name, args, Stdio::null())
    }

    /// As [`Bench::spawn_relay`], with the relay's standard output going to `stdout`.
    pub fn spawn_relay_with_stdout(
        &self,
        name: &str,
        args: &[&str],
        stdout: Stdio,
    ) -> Result<Child> {
        let log = std::fs::File::create(self.work.join(format!("{name}.log")))?;
        // OUTBOX_BENCH_RELAY_LOG=trace records every claim in the relay's log.
        let level = self.settings.relay_log.as_deref().unwrap_or("warn");
        Ok(Command::new(&self.bin)
            .arg("run")
            .args([
                "--database-url",
                &self.relay_url(),
                "--http-addr",
                "",
                "--log-level",
                level,
                "--log-format",
                "json",
            ])
            .args(args)
            .stdout(stdout)
            .stderr(log)
            .spawn()?)
    }

    /// Fills the outbox with `n` events: JSON payloads of about 200 bytes over 1,000 keys.
    /// The table is left as a user's would be right after a bulk load: without statistics
    /// until autovacuum gets to it (`analyze` runs `VACUUM ANALYZE` for the comparison).
    pub async fn prefill(
        &self,
        db: &tokio_postgres::Client,
        table: &str,
        n: u64,
        analyze: bool,
    ) -> Result<()> {
        self.prefill_to(db, table, n, &format!("'{SUBJECT}'"))
            .await?;
        if analyze {
            db.batch_execute(&format!("VACUUM ANALYZE {table}")).await?;
        }
        Ok(())
    }

    /// Inserts `n` rows into `table` in one statement, each row's destination the SQL
    /// expression `destination` (of `i`, the row's number).
    pub async fn prefill_to(
        &self,
        db: &tokio_postgres::Client,
        table: &str,
        n: u64,
        destination: &str,
    ) -> Result<()> {
        let (columns, event_type) = load::insert_columns(table);
        db.batch_execute(&format!(
            "INSERT INTO {table} ({columns})
             SELECT {destination}, 'customer-' || (i % 1000), {event_type} {PAYLOAD_SQL}
               FROM generate_series(1, {n}) i"
        ))
        .await?;
        Ok(())
    }

    pub async fn nats_stream(&self) -> Result<async_nats::jetstream::Context> {
        let js = async_nats::jetstream::new(async_nats::connect(&self.servers.nats_url).await?);
        let _ = js.delete_stream("BENCH").await;
        js.create_stream(async_nats::jetstream::stream::Config {
            name: "BENCH".into(),
            subjects: vec!["bench.>".into()],
            ..Default::default()
        })
        .await?;
        Ok(js)
    }
}

fn machine() -> Value {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .unwrap_or("")
        .trim()
        .to_string();
    let mem_kib: u64 = read("/proc/meminfo")
        .lines()
        .find(|l| l.starts_with("MemTotal"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    json!({
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "cpu": cpu,
        "memory_gib": mem_kib / 1_048_576,
        "kernel": read("/proc/sys/kernel/osrelease").trim(),
    })
}

fn build_relay() -> Result<PathBuf> {
    // OUTBOX_BENCH_RELAY_BIN measures another build (an A/B of two commits) instead.
    if let Some(bin) = std::env::var_os("OUTBOX_BENCH_RELAY_BIN") {
        return Ok(PathBuf::from(bin));
    }
    // Under `cargo run` this process inherits the variables cargo sets for a package (its
    // CARGO_PKG_*, LD_LIBRARY_PATH, ...); passed on, they make the nested build rebuild
    // dependencies that the outer build then rebuilds again.
    let mut cargo = Command::new("cargo");
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        let set_by_cargo = (name.starts_with("CARGO_")
            && !matches!(&*name, "CARGO_HOME" | "CARGO_TARGET_DIR"))
            || matches!(&*name, "LD_LIBRARY_PATH" | "OUT_DIR" | "RUSTC" | "RUSTDOC");
        if set_by_cargo {
            cargo.env_remove(&*name);
        }
    }
    let status = cargo
        .args(["build", "--release", "-q", "-p", "outbox-relay"])
        .status()?;
    if !status.success() {
        bail!("cargo build --release -p outbox-relay failed");
    }
    Ok(PathBuf::from("target/release/outbox-relay"))
}

fn write_results(out: &Path, results: &Value) -> Result<()> {
    std::fs::create_dir_all(out)?;
    std::fs::write(
        out.join("results.json"),
        serde_json::to_string_pretty(results)?,
    )?;
    let md = measure::markdown(results) + &curve::markdown(results) + &binlog::report(results);
    std::fs::write(out.join("results.md"), &md)?;
    println!("{md}");
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let settings = settings()?;
    let bin = build_relay()?;
    let servers = Servers::start(
        settings
            .only
            .as_deref()
            .is_some_and(|o| o.starts_with("binlog")),
    )?;
    let work = std::env::temp_dir().join(format!("outbox-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let bench = Bench {
        servers,
        bin,
        work,
        settings: settings.clone(),
    };
    let pg_version: String = connect(&bench.servers.admin_url)
        .await?
        .query_one("SELECT version()", &[])
        .await?
        .get(0);
    let mut results = json!({
        "date": humantime_now(),
        "machine": machine(),
        "postgres": pg_version.split(',').next().unwrap_or("").to_string(),
        "settings": {
            "events": settings.events,
            "baseline_events": settings.baseline_events,
            "latency_seconds": settings.latency_seconds,
            "scaling_events": settings.scaling_events,
            "relay_sslmode": settings.relay_sslmode.as_deref().unwrap_or("prefer (the relay's default)"),
        },
    });
    let wanted = |name: &str| settings.only.as_deref().is_none_or(|o| o == name);
    let started = Instant::now();
    if wanted("drain") {
        results["drain"] = measure::drain(&bench).await?;
        write_results(&settings.out, &results)?;
        results["wal_drain"] = wal::drain(&bench).await?;
        write_results(&settings.out, &results)?;
    }
    if settings.only.as_deref() == Some("wal") {
        results["wal_drain"] = wal::drain(&bench).await?;
        write_results(&settings.out, &results)?;
        results["wal_memory"] = wal::large_events(&bench).await?;
        write_results(&settings.out, &results)?;
        results["latency"] = measure::latency(&bench, wal::LATENCY_PLAN).await?;
        write_results(&settings.out, &results)?;
        results["writer_cost"] = measure::writer_cost(&bench, wal::WRITER_VARIANTS).await?;
        write_results(&settings.out, &results)?;
    }
    if settings.only.as_deref() == Some("binlog") {
        results["binlog"] = binlog::drain(&bench).await?;
        write_results(&settings.out, &results)?;
    }
    if settings.only.as_deref() == Some("binlog-writers") {
        results["binlog"] = binlog::writers(&bench).await?;
        write_results(&settings.out, &results)?;
    }
    if settings.only.as_deref() == Some("curve") {
        results["curve"] = curve::curve(&bench).await?;
        write_results(&settings.out, &results)?;
    }
    if settings.only.as_deref() == Some("wal-drain") {
        results["wal_drain"] = wal::drain(&bench).await?;
        write_results(&settings.out, &results)?;
    }
    if settings.only.as_deref() == Some("wal-memory") {
        results["wal_memory"] = wal::large_events(&bench).await?;
        write_results(&settings.out, &results)?;
    }
    if wanted("latency") {
        results["latency"] = measure::latency(&bench, measure::LATENCY_PLAN).await?;
        write_results(&settings.out, &results)?;
    }
    if wanted("keepup") {
        results["keep_up"] = measure::keep_up(&bench).await?;
        write_results(&settings.out, &results)?;
    }
    if wanted("writers") {
        results["writer_cost"] = measure::writer_cost(&bench, measure::WRITER_VARIANTS).await?;
        write_results(&settings.out, &results)?;
    }
    if wanted("scaling") {
        results["scaling"] = measure::scaling(&bench).await?;
    }
    // No slot outlives the run (it would keep WAL on the bench server's disk).
    wal::drop_slots(&connect(&bench.servers.admin_url).await?).await?;
    results["duration_s"] = json!(started.elapsed().as_secs());
    write_results(&settings.out, &results)?;
    if settings.relay_log.is_none() {
        let _ = std::fs::remove_dir_all(&bench.work);
    } else {
        eprintln!("relay logs kept in {}", bench.work.display());
    }
    Ok(())
}

fn humantime_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // Days since the epoch to a civil date (proleptic Gregorian).
    let days = (secs / 86_400) as i64;
    let (z, era_days) = (days + 719_468, 146_097);
    let era = z.div_euclid(era_days);
    let doe = z - era * era_days;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

/// Waits for `child` with a deadline.
pub fn wait_child(child: &mut Child, timeout: Duration) -> Result<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!("process {} did not finish within {timeout:?}", child.id());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
