//! `--only binlog`: binlog capture's drain (issue 35) in one run beside the two things it is
//! judged against, on the same MariaDB and the same backlog:
//! - **the floor**: MariaDB's own `mariadb-binlog --read-from-remote-server`, reading the
//!   same stretch of the binary log as a replica and writing it nowhere; and the same reader
//!   decoding every row (`--base64-output=DECODE-ROWS --verbose`), the least work a relay
//!   must do with a row, since MariaDB sends row images undecoded (PostgreSQL's walsender
//!   decodes for `pg_recvlogical` and the relay alike);
//! - **the delete floor**: MariaDB deleting the same number of rows by key with nothing else
//!   running ([`delete_floor`]): the server's part of the table form, whatever the relay does;
//! - **polling**: `run --drain` of the same number of rows from the same table;
//! - **the table-less form**: binlog capture of the same events written to a BLACKHOLE
//!   table, which has no delivered rows to delete.
//!
//! Each drain is `run --drain` to the file sink, timed by `/usr/bin/time` (wall, CPU, peak
//! RSS). The capture's backlog is written after a first start stored its position, so it is
//! read from the log, not adopted from the table.
//!
//! Then what each mode costs the application ([`writer_cost`]): [`WRITERS`] writers commit
//! single-row INSERTs into the outbox for a while with no relay, with the polling relay
//! running, and with binlog capture running.

use std::path::Path;

use anyhow::{bail, Context, Result};
use mysql_async::prelude::Queryable;
use serde_json::{json, Value};

use crate::{measure, Bench};

/// The keys the backlog is spread over.
const KEYS: u64 = 64;

/// A fresh `bench_binlog` database, migrated for binlog capture, whose capture stored its
/// first position (what is written next is read from the log, not adopted): the admin URL,
/// the database's URL, and a connection using it.
async fn fresh_database(
    b: &Bench,
) -> Result<(String, String, mysql_async::Pool, mysql_async::Conn)> {
    let admin = b
        .servers
        .mysql_url
        .clone()
        .context("binlog bench: no MariaDB (scripts/servers.sh did not start it)")?;
    let url = with_database(&admin, "bench_binlog");
    let pool = mysql_async::Pool::new(mysql_async::Opts::from_url(&admin)?);
    let mut conn = pool.get_conn().await?;
    conn.query_drop("DROP DATABASE IF EXISTS bench_binlog")
        .await?;
    conn.query_drop("CREATE DATABASE bench_binlog").await?;
    conn.query_drop("USE bench_binlog").await?;
    relay(
        b,
        &["migrate", "--capture", "binlog", "--database-url", &url],
    )?;
    let sink = format!("file:{}", b.work.join("binlog-first.jsonl").display());
    relay(b, &drain_args(&url, &sink, &["--capture", "binlog"]))?;
    Ok((admin, url, pool, conn))
}

/// `--only binlog-writers`: the writers' cost alone ([`writer_cost`]), on a fresh database.
pub async fn writers(b: &Bench) -> Result<Value> {
    let (_, url, pool, mut conn) = fresh_database(b).await?;
    let writers = writer_cost(b, &url, &mut conn).await?;
    conn.query_drop("DROP DATABASE bench_binlog").await?;
    drop(conn);
    pool.disconnect().await?;
    Ok(json!({ "writer_cost": writers }))
}

pub async fn drain(b: &Bench) -> Result<Value> {
    let (n, per_transaction) = (b.settings.events, b.settings.binlog_events_per_transaction);
    let (admin, url, pool, mut conn) = fresh_database(b).await?;

    eprintln!("drain: binlog capture, {n} events ({per_transaction} per transaction)");
    let start = position(&mut conn).await?;
    prefill(&mut conn, n, per_transaction).await?;
    let raw_floor = floor(b, &admin, &start, false)?;
    let decoding_floor = floor(b, &admin, &start, true)?;
    let sink = format!("file:{}", b.work.join("binlog-drain.jsonl").display());
    let capture = timed_drain(b, &drain_args(&url, &sink, &["--capture", "binlog"]), n)?;
    let left: i64 = conn
        .query_first("SELECT (SELECT count(*) FROM outbox) + (SELECT count(*) FROM outbox_parked)")
        .await?
        .unwrap_or(-1);

    let delete_floor = delete_floor(b, &admin, &mut conn, n, per_transaction).await?;

    eprintln!("drain: polling, {n} events from the same table");
    prefill(&mut conn, n, per_transaction).await?;
    let sink = format!("file:{}", b.work.join("poll-drain.jsonl").display());
    let polling = timed_drain(b, &drain_args(&url, &sink, &[]), n)?;
    let table_less = table_less_drain(b, &admin, &mut conn).await?;
    conn.query_drop("USE bench_binlog").await?;
    let writers = writer_cost(b, &url, &mut conn).await?;
    conn.query_drop("DROP DATABASE bench_binlog").await?;
    drop(conn);
    pool.disconnect().await?;
    let ratio = |x: &Value, y: &Value| {
        json!(x["events_per_s"].as_f64().unwrap_or(0.0) / y["events_per_s"].as_f64().unwrap_or(1.0))
    };
    Ok(json!({
        "events": n,
        "events_per_transaction": per_transaction,
        "floor": raw_floor,
        "decoding_floor": decoding_floor,
        "capture": capture,
        "polling": polling,
        "table_less": table_less,
        "capture_rows_left": left,
        "capture_vs_floor": ratio(&capture, &raw_floor),
        "capture_vs_decoding_floor": ratio(&capture, &decoding_floor),
        "capture_vs_polling": ratio(&capture, &polling),
        "delete_floor": delete_floor,
        "capture_vs_delete_floor": ratio(&capture, &delete_floor),
        "table_less_vs_floor": ratio(&table_less, &raw_floor),
        "table_less_vs_decoding_floor": ratio(&table_less, &decoding_floor),
        "writer_cost": writers,
    }))
}

/// The server's own floor for the table form: the same backlog deleted by its primary key
/// in ranges of `DELETE_RANGE` rows, on one connection logging keys only (as the relay's
/// deletes log), with nothing else running. A capture that deletes what it delivered cannot
/// drain faster than MariaDB deletes, and on this host the two share two cores. In a database
/// of its own, so that no capture reads its rows back from the log. Its MariaDB CPU counts
/// InnoDB's purge of the deleted rows, which runs on after the deletes commit.
async fn delete_floor(
    b: &Bench,
    admin: &str,
    conn: &mut mysql_async::Conn,
    n: u64,
    per_transaction: u64,
) -> Result<Value> {
    const DELETE_RANGE: u64 = 500;
    const DATABASE: &str = "bench_binlog_delete_floor";
    eprintln!(
        "drain: MariaDB deleting {n} rows by key, {DELETE_RANGE} to a statement (the delete floor)"
    );
    conn.query_drop(format!("DROP DATABASE IF EXISTS {DATABASE}"))
        .await?;
    conn.query_drop(format!("CREATE DATABASE {DATABASE}"))
        .await?;
    relay(
        b,
        &["migrate", "--database-url", &with_database(admin, DATABASE)],
    )?;
    conn.query_drop(format!("USE {DATABASE}")).await?;
    prefill(conn, n, per_transaction).await?;
    let (first, last): (Option<u64>, Option<u64>) = conn
        .query_first("SELECT MIN(sequence_id), MAX(sequence_id) FROM outbox")
        .await?
        .unwrap_or((None, None));
    let (Some(first), Some(last)) = (first, last) else {
        bail!("the delete floor's backlog is empty");
    };
    purged(conn).await?;
    conn.query_drop("SET SESSION binlog_row_image = 'MINIMAL'")
        .await?;
    let server_before = measure::mariadb_cpu(b);
    let started = std::time::Instant::now();
    let mut from = first;
    while from <= last {
        let to = from + DELETE_RANGE - 1;
        conn.query_drop(format!(
            "DELETE FROM outbox WHERE sequence_id BETWEEN {from} AND {to}"
        ))
        .await?;
        from = to + 1;
    }
    let wall = started.elapsed().as_secs_f64();
    let purge_s = purged(conn).await?;
    let server_cpu = measure::mariadb_cpu(b) - server_before;
    conn.query_drop("SET SESSION binlog_row_image = DEFAULT")
        .await?;
    conn.query_drop(format!("DROP DATABASE {DATABASE}")).await?;
    conn.query_drop("USE bench_binlog").await?;
    Ok(json!({
        "wall_s": wall,
        "events_per_s": n as f64 / wall,
        "purge_after_s": purge_s,
        "mariadb_cpu_s_per_million": server_cpu * 1e6 / n as f64,
    }))
}

/// Waits (up to a minute) until InnoDB has purged what committed transactions left behind
/// (its history list is empty); returns how long that took.
async fn purged(conn: &mut mysql_async::Conn) -> Result<f64> {
    let started = std::time::Instant::now();
    while started.elapsed() < std::time::Duration::from_secs(60) {
        let row: Option<(String, u64)> = conn
            .query_first("SHOW GLOBAL STATUS LIKE 'Innodb_history_list_length'")
            .await?;
        if row.is_none_or(|(_, length)| length == 0) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let waited = started.elapsed().as_secs_f64();
    if waited >= 60.0 {
        eprintln!("binlog bench: InnoDB had not purged after a minute; the figures that follow include its purge");
    }
    Ok(waited)
}

/// Binlog capture of the backlog written to a BLACKHOLE outbox (the table-less form), in a
/// database of its own: nothing is stored, so nothing is deleted once delivered.
async fn table_less_drain(b: &Bench, admin: &str, conn: &mut mysql_async::Conn) -> Result<Value> {
    let n = b.settings.events;
    eprintln!("drain: binlog capture, {n} events through a BLACKHOLE table");
    conn.query_drop("DROP DATABASE IF EXISTS bench_binlog_table_less")
        .await?;
    conn.query_drop("CREATE DATABASE bench_binlog_table_less")
        .await?;
    conn.query_drop("USE bench_binlog_table_less").await?;
    if outbox_binlog::blackhole_problem(admin).await?.is_some() {
        // Debian's MariaDB ships the engine as a plugin.
        conn.query_drop("INSTALL SONAME 'ha_blackhole'").await?;
    }
    conn.query_drop(outbox_binlog::blackhole_ddl("outbox"))
        .await?;
    let url = with_database(admin, "bench_binlog_table_less");
    relay(
        b,
        &["migrate", "--capture", "binlog", "--database-url", &url],
    )?;
    let sink = format!("file:{}", b.work.join("table-less-first.jsonl").display());
    relay(b, &drain_args(&url, &sink, &["--capture", "binlog"]))?;
    prefill(conn, n, b.settings.binlog_events_per_transaction).await?;
    let sink = format!("file:{}", b.work.join("table-less-drain.jsonl").display());
    let drained = timed_drain(b, &drain_args(&url, &sink, &["--capture", "binlog"]), n)?;
    let delivered = std::fs::read(b.work.join("table-less-drain.jsonl"))
        .map(|bytes| bytes.iter().filter(|&&byte| byte == b'\n').count() as u64)
        .unwrap_or(0);
    if delivered < n {
        bail!("the table-less drain delivered {delivered} of {n} events");
    }
    conn.query_drop("DROP DATABASE bench_binlog_table_less")
        .await?;
    Ok(drained)
}

/// The application's writers of the writer-cost runs.
const WRITERS: usize = 16;

/// How many single-row INSERTs [`WRITERS`] writers commit per second, and their p99 commit
/// time, for [`measure`]'s latency seconds each: with no relay, with the polling relay
/// (`run`, woken by its poll interval) and with binlog capture (`run --capture binlog`),
/// each relaying to the file sink as the writers write.
async fn writer_cost(b: &Bench, url: &str, conn: &mut mysql_async::Conn) -> Result<Value> {
    let seconds = b.settings.latency_seconds.max(5);
    let mut rows = serde_json::Map::new();
    for (mode, extra) in [
        ("no relay", None),
        ("polling", Some(vec![])),
        ("binlog capture", Some(vec!["--capture", "binlog"])),
    ] {
        conn.query_drop("DELETE FROM outbox").await?;
        if mode == "binlog capture" {
            // The stored position is the capture drain's: what polling and the other runs
            // wrote since would be read (and delivered) again while the writers are timed.
            let sink = format!("file:{}", b.work.join("writers-catch-up.jsonl").display());
            relay(b, &drain_args(url, &sink, &["--capture", "binlog"]))?;
        }
        let mut relay = match &extra {
            Some(extra) => {
                let sink = format!("file:{}", b.work.join("writers.jsonl").display());
                let mut args = vec!["run", "--database-url", url, "--sink", &sink];
                args.extend(["--http-addr", "", "--log-level", "warn"]);
                args.extend(extra.iter().copied());
                Some(
                    std::process::Command::new(&b.bin)
                        .args(&args)
                        .stdout(std::process::Stdio::null())
                        .spawn()
                        .context("starting the relay")?,
                )
            }
            None => None,
        };
        // The relay's start-up is not the writers' cost.
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        eprintln!("writer cost (MariaDB): {mode}, {WRITERS} writers, {seconds} s");
        let measured = write_for(url, seconds).await;
        // What the relay had not taken out of the table when the writers stopped: a relay
        // that falls behind does less work in the window, and so costs the writers less.
        // (Parked rows are not counted: nothing in this run fails, so none are parked.)
        let rows_left: mysql_async::Result<Option<u64>> =
            conn.query_first("SELECT COUNT(*) FROM outbox").await;
        if let Some(relay) = &mut relay {
            let _ = relay.kill();
            let _ = relay.wait();
        }
        let mut measured = measured?;
        measured["rows_left"] = json!(rows_left?);
        rows.insert(mode.into(), measured);
    }
    let rate = |rows: &serde_json::Map<String, Value>, mode: &str| {
        rows[mode]["commits_per_s"].as_f64().unwrap_or(0.0)
    };
    let base = rate(&rows, "no relay");
    for mode in ["polling", "binlog capture"] {
        let cost = 1.0 - rate(&rows, mode) / base;
        rows[mode]["cost_vs_no_relay"] = json!(cost);
    }
    Ok(Value::Object(rows))
}

/// [`WRITERS`] connections committing single-row INSERTs for `seconds`.
async fn write_for(url: &str, seconds: u64) -> Result<Value> {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for writer in 0..WRITERS {
        let url = url.to_string();
        tasks.push(tokio::spawn(async move {
            let mut conn = mysql_async::Conn::from_url(url.as_str()).await?;
            let mut times = Vec::new();
            let mut i = 0u64;
            while std::time::Instant::now() < until {
                let started = std::time::Instant::now();
                conn.exec_drop(
                    "INSERT INTO outbox (destination, partition_key, event_type, payload)
                     VALUES ('bench', ?, 'order.created', JSON_OBJECT('seq', ?))",
                    (format!("customer-{}", (writer as u64 * 7 + i) % KEYS), i),
                )
                .await?;
                times.push(started.elapsed());
                i += 1;
            }
            conn.disconnect().await?;
            Ok::<_, anyhow::Error>(times)
        }));
    }
    let mut times = Vec::new();
    for task in tasks {
        times.extend(task.await??);
    }
    times.sort();
    let p99 = times
        .get(times.len().saturating_sub(1) * 99 / 100)
        .map_or(0.0, |t| t.as_secs_f64() * 1000.0);
    Ok(json!({
        "commits_per_s": times.len() as f64 / seconds as f64,
        "p99_ms": p99,
    }))
}

/// `url` with its database replaced by `database`.
fn with_database(url: &str, database: &str) -> String {
    let cut = url.rfind('/').expect("a path");
    format!("{}/{database}", &url[..cut])
}

fn drain_args<'a>(url: &'a str, sink: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = measure::drain_args(url, sink);
    args.extend(["--http-addr", ""]);
    args.extend(extra);
    args
}

fn relay(b: &Bench, args: &[&str]) -> Result<()> {
    let status = std::process::Command::new(&b.bin)
        .args(args)
        .stdout(std::process::Stdio::null())
        .status()?;
    if !status.success() {
        bail!("outbox-relay {args:?} failed");
    }
    Ok(())
}

/// A timed `run --drain` of `n` events.
fn timed_drain(b: &Bench, args: &[&str], n: u64) -> Result<Value> {
    let server_before = measure::mariadb_cpu(b);
    let (wall, user, sys, rss) = measure::timed(b, args)?;
    Ok(json!({
        "wall_s": wall,
        "mariadb_cpu_s_per_million": (measure::mariadb_cpu(b) - server_before) * 1e6 / n as f64,
        "events_per_s": n as f64 / wall,
        "relay_cpu_s": user + sys,
        "relay_cpu_s_per_million": (user + sys) * 1e6 / n as f64,
        "peak_rss_mb": rss as f64 / 1024.0,
    }))
}

/// The binary log's end (`SHOW MASTER STATUS`).
async fn position(conn: &mut mysql_async::Conn) -> Result<(String, u64)> {
    let row: mysql_async::Row = conn
        .query_first("SHOW MASTER STATUS")
        .await?
        .context("the server writes no binary log")?;
    Ok((row.get(0).context("file")?, row.get(1).context("offset")?))
}

/// `n` events over [`KEYS`] keys, `per_transaction` to a transaction, inserted 1,000 rows
/// to a statement.
async fn prefill(conn: &mut mysql_async::Conn, n: u64, per_transaction: u64) -> Result<()> {
    const PER_STATEMENT: u64 = 1_000;
    let mut written = 0;
    while written < n {
        let transaction_end = n.min(written + per_transaction);
        conn.query_drop("START TRANSACTION").await?;
        while written < transaction_end {
            let batch = PER_STATEMENT.min(transaction_end - written);
            let values: Vec<String> = (written..written + batch)
                .map(|i| {
                    format!(
                        "('bench', 'customer-{}', 'order.created', JSON_OBJECT('seq', {i}, 'amount', {}))",
                        i % KEYS,
                        i % 1000
                    )
                })
                .collect();
            conn.query_drop(format!(
                "INSERT INTO outbox (destination, partition_key, event_type, payload) VALUES {}",
                values.join(", ")
            ))
            .await?;
            written += batch;
        }
        conn.query_drop("COMMIT").await?;
    }
    Ok(())
}

/// MariaDB's own client reading the log from `start` to its end as a replica, writing
/// nowhere, with every row image decoded to text when `decode`: wall and CPU.
fn floor(b: &Bench, admin: &str, start: &(String, u64), decode: bool) -> Result<Value> {
    let opts = mysql_async::Opts::from_url(admin)?;
    let port = opts.tcp_port().to_string();
    let mut args = vec![
        "--no-defaults".to_string(),
        "--read-from-remote-server".into(),
        format!("--host={}", opts.ip_or_hostname()),
        format!("--port={port}"),
        format!("--user={}", opts.user().unwrap_or("root")),
        format!("--start-position={}", start.1),
        "--to-last-log".into(),
        start.0.clone(),
    ];
    if let Some(password) = opts.pass() {
        args.push(format!("--password={password}"));
    }
    if decode {
        args.extend(["--base64-output=DECODE-ROWS".into(), "--verbose".into()]);
    }
    let (wall, user, sys, _) = measure::timed_program(&b.work, Path::new("mariadb-binlog"), &args)?;
    let n = b.settings.events;
    Ok(json!({
        "wall_s": wall,
        "events_per_s": n as f64 / wall,
        "cpu_s": user + sys,
        "cpu_s_per_million": (user + sys) * 1e6 / n as f64,
    }))
}

/// The binlog lines of the report.
pub fn report(r: &Value) -> String {
    let y = &r["binlog"];
    if y.is_null() {
        return String::new();
    }
    format!(
        "\n## Binlog capture (MariaDB)\n\n{} events, {} per transaction, to the file sink.\n\n\
         | | events/s | CPU s per 1M | peak RSS MB | MariaDB CPU s per 1M |\n|---|---|---|---|---|\n\
         | floor (`mariadb-binlog --read-from-remote-server`) | {} | {} | | |\n\
         | floor decoding rows (`--base64-output=DECODE-ROWS --verbose`) | {} | {} | | |\n\
         | floor deleting the rows (MariaDB alone, by key, 500 to a statement) | {} | | | {} |\n\
         | binlog capture | {} | {} | {} | {} |\n\
         | polling, same table | {} | {} | {} | {} |\n\
         | binlog capture, table-less (BLACKHOLE) | {} | {} | {} | {} |\n\n\
         Capture: {}× the floor (target ≥ 0.9), {}× the decoding floor, {}× the delete floor, {}× polling (target ≥ 3); \
         rows left: {}. Table-less: {}× the floor, {}× the decoding floor.\n\n\
         Writer cost, {WRITERS} writers of single-row INSERTs (target: capture's ≤ polling's):\n\n\
         | | commits/s | p99 ms | cost vs no relay | rows left in the table at the end |\n|---|---|---|---|---|\n\
         | no relay | {} | {} | | {} |\n\
         | polling | {} | {} | {} | {} |\n\
         | binlog capture | {} | {} | {} | {} |\n",
        y["events"],
        y["events_per_transaction"],
        measure::f(&y["floor"]["events_per_s"]),
        measure::f(&y["floor"]["cpu_s_per_million"]),
        measure::f(&y["decoding_floor"]["events_per_s"]),
        measure::f(&y["decoding_floor"]["cpu_s_per_million"]),
        measure::f(&y["delete_floor"]["events_per_s"]),
        measure::f(&y["delete_floor"]["mariadb_cpu_s_per_million"]),
        measure::f(&y["capture"]["events_per_s"]),
        measure::f(&y["capture"]["relay_cpu_s_per_million"]),
        measure::f(&y["capture"]["peak_rss_mb"]),
        measure::f(&y["capture"]["mariadb_cpu_s_per_million"]),
        measure::f(&y["polling"]["events_per_s"]),
        measure::f(&y["polling"]["relay_cpu_s_per_million"]),
        measure::f(&y["polling"]["peak_rss_mb"]),
        measure::f(&y["polling"]["mariadb_cpu_s_per_million"]),
        measure::f(&y["table_less"]["events_per_s"]),
        measure::f(&y["table_less"]["relay_cpu_s_per_million"]),
        measure::f(&y["table_less"]["peak_rss_mb"]),
        measure::f(&y["table_less"]["mariadb_cpu_s_per_million"]),
        measure::f(&y["capture_vs_floor"]),
        measure::f(&y["capture_vs_decoding_floor"]),
        measure::f(&y["capture_vs_delete_floor"]),
        measure::f(&y["capture_vs_polling"]),
        y["capture_rows_left"],
        measure::f(&y["table_less_vs_floor"]),
        measure::f(&y["table_less_vs_decoding_floor"]),
        measure::f(&y["writer_cost"]["no relay"]["commits_per_s"]),
        measure::f(&y["writer_cost"]["no relay"]["p99_ms"]),
        y["writer_cost"]["no relay"]["rows_left"],
        measure::f(&y["writer_cost"]["polling"]["commits_per_s"]),
        measure::f(&y["writer_cost"]["polling"]["p99_ms"]),
        measure::f(&y["writer_cost"]["polling"]["cost_vs_no_relay"]),
        y["writer_cost"]["polling"]["rows_left"],
        measure::f(&y["writer_cost"]["binlog capture"]["commits_per_s"]),
        measure::f(&y["writer_cost"]["binlog capture"]["p99_ms"]),
        measure::f(&y["writer_cost"]["binlog capture"]["cost_vs_no_relay"]),
        y["writer_cost"]["binlog capture"]["rows_left"],
    )
}
