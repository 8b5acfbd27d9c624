//! WAL capture (`--capture wal`, issue 16), measured in the same run as the polling relay:
//! the drain of a backlog written while the relay was off (as rows, and as `outbox_emit`
//! messages), the latency modes `wal` and `wal-emit`, and the writer-cost variants below.
//!
//! Each comes with PostgreSQL's own client, `pg_recvlogical`, reading a slot the same way
//! (pgoutput, the publication, messages) and doing nothing with what it reads: the drain's,
//! the latency's and the writer cost's floor on this host, measured in the same run. Where
//! the relay's figure is near it, the server, not the relay, sets the figure.
//!
//! The slot is always created (with pgoutput) before the first event is written: rows that
//! predate a new slot are adopted into the parked table and relayed by polling, which is
//! not what these figures are about.

use std::collections::HashMap;
use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::measure::{self, LatencyPlan};
use crate::{wait_child, Bench, PAYLOAD_SQL, SUBJECT};

/// The bench relays' replication slot.
pub const SLOT: &str = "outbox_bench";

/// What makes `outbox-relay run` capture from the WAL.
pub const RELAY_ARGS: [&str; 4] = ["--capture", "wal", "--slot", SLOT];

/// Writer cost: the slot exists (and keeps the WAL), no relay reads it.
pub const WRITERS_SLOT: &str = "WAL capture, slot, no relay";
/// Writer cost: a WAL-capture relay streams from the slot and relays to the file sink.
pub const WRITERS_RELAY: &str = "WAL capture, relay running";
/// Writer cost: as [`WRITERS_RELAY`], the writers calling `outbox_emit` instead of inserting.
pub const WRITERS_EMIT: &str = "WAL capture, outbox_emit, relay running";
/// Writer cost: PostgreSQL's own `pg_recvlogical` streams the slot (pgoutput) to
/// `/dev/null`: what the host allows a WAL consumer that does nothing with the events.
pub const WRITERS_FLOOR: &str = "WAL, pg_recvlogical to /dev/null, no relay";

/// The latency modes that measure the host's floor instead of the relay: `pg_recvlogical`
/// reads the slot (pgoutput, as the relay does) and an event counts as confirmed when its
/// bytes reach the bench through a pipe. Nothing is published, so what is left of the
/// latency is the walsender's: the time from a commit to its decoded transaction.
pub const FLOOR_MODES: [&str; 2] = ["recvlogical", "recvlogical-emit"];

/// The latency modes that measure a WAL-capture relay as the floor is measured: its stdout
/// sink into a pipe to the bench, so the broker's cost is left out.
pub const PIPED_MODES: [&str; 2] = ["wal-stdout", "wal-emit-stdout"];

/// `pg_recvlogical`, from the same PostgreSQL installation as the bench's server.
const PG_RECVLOGICAL: &str = "/usr/lib/postgresql/15/bin/pg_recvlogical";

/// `--only wal`: the latency runs.
pub const LATENCY_PLAN: LatencyPlan<'static> = &[
    (1_000, 1, "wal"),
    (1_000, 1, "wal-emit"),
    (10_000, 1, "wal"),
    (10_000, 10, "recvlogical"),
    (10_000, 10, "wal-stdout"),
    (10_000, 10, "wal"),
    (10_000, 10, "recvlogical-emit"),
    (10_000, 10, "wal-emit-stdout"),
    (10_000, 10, "wal-emit"),
];

/// `--only wal`: the writer-cost variants (with the no-trigger row they are compared with).
pub const WRITER_VARIANTS: &[&str] = &[
    "no trigger",
    WRITERS_SLOT,
    WRITERS_FLOOR,
    WRITERS_RELAY,
    WRITERS_EMIT,
];

/// Drops the replication slots of the `bench` database, ending the session that holds one
/// (a relay just stopped may still be leaving). A slot keeps its database from being
/// dropped, and its WAL on the server's disk.
pub async fn drop_slots(admin: &tokio_postgres::Client) -> Result<()> {
    for _ in 0..100 {
        let rows = admin
            .query(
                "SELECT slot_name::text, active_pid FROM pg_catalog.pg_replication_slots
                  WHERE database = 'bench'",
                &[],
            )
            .await?;
        if rows.is_empty() {
            return Ok(());
        }
        for row in rows {
            let (name, pid): (String, Option<i32>) = (row.get(0), row.get(1));
            match pid {
                Some(pid) => {
                    admin
                        .execute("SELECT pg_terminate_backend($1)", &[&pid])
                        .await?;
                }
                // It may become active again meanwhile: then the next round ends it.
                None => {
                    let _ = admin
                        .execute("SELECT pg_drop_replication_slot($1)", &[&name])
                        .await;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("the replication slots of the bench database could not be dropped")
}

/// `migrate --capture wal` (the publication, the parked table, `outbox_emit`, and the
/// trigger that notifies no one), then the slot, before any event is written: made by a
/// drain of the empty outbox, so the relay records the slot's adoption (of nothing) itself.
/// A slot made by hand is adopted by the relay's first session, which moves every row
/// written meanwhile to the parked table (a slot made by hand may predate rows its stream
/// does not carry), and the bench would measure that instead of the stream. Returns once the
/// server has let go of the slot (its walsender ends a moment after the relay's exit), so
/// the next reader finds it free.
pub async fn prepare(b: &Bench, db: &tokio_postgres::Client) -> Result<()> {
    b.relay_cli(&["migrate", "--capture", "wal"])?;
    prepare_slot(b, db, SLOT).await
}

/// The relay's slot `slot`, made as [`prepare`] makes [`SLOT`] (after `migrate`).
async fn prepare_slot(b: &Bench, db: &tokio_postgres::Client, slot: &str) -> Result<()> {
    let mut drain = vec!["run", "--drain", "--sink", "stdout", "--http-addr", ""];
    drain.extend(["--capture", "wal", "--slot", slot]);
    b.relay_cli(&drain)?;
    await_slot_active(db, slot, false).await.with_context(|| {
        format!("the slot {slot} stayed active after the relay that made it exited")
    })
}

/// Waits, at most 30 s, until `slot` is streaming to a client (`active`), or is not.
async fn await_slot_active(db: &tokio_postgres::Client, slot: &str, active: bool) -> Result<()> {
    let start = Instant::now();
    while db
        .query_one(
            "SELECT coalesce(bool_or(active), false) FROM pg_catalog.pg_replication_slots
              WHERE slot_name = $1",
            &[&slot],
        )
        .await?
        .get::<_, bool>(0)
        != active
    {
        if start.elapsed() > Duration::from_secs(30) {
            bail!("still not so after 30 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// `pg_recvlogical` reading `slot` as the relay would: pgoutput, the relay's publication,
/// messages too, and the relay's `sslmode`.
async fn recvlogical(b: &Bench, db: &tokio_postgres::Client, slot: &str) -> Result<Command> {
    let publication: String = db
        .query_one("SELECT pubname::text FROM pg_catalog.pg_publication", &[])
        .await?
        .get(0);
    let mut command = Command::new(PG_RECVLOGICAL);
    command
        .args([
            "--dbname",
            &b.relay_url(),
            "--slot",
            slot,
            "--start",
            // An error ends it, instead of a silent reconnection the figures would hide.
            "--no-loop",
            "--file",
            "-",
        ])
        .args(["--option", "proto_version=1", "--option", "messages=true"])
        .args(["--option", &format!("publication_names={publication}")])
        .stderr(Stdio::inherit());
    Ok(command)
}

/// A running `pg_recvlogical`, ended (killed) when dropped, whatever the run's outcome:
/// it must not outlive the measurement that started it.
pub struct Recvlogical(Child);

impl Recvlogical {
    pub fn output(&mut self) -> Option<std::process::ChildStdout> {
        self.0.stdout.take()
    }

    pub fn id(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Recvlogical {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `pg_recvlogical` streaming [`SLOT`] (made by [`prepare`]) to `stdout`, once it streams.
pub async fn spawn_recvlogical(
    b: &Bench,
    db: &tokio_postgres::Client,
    stdout: Stdio,
) -> Result<Recvlogical> {
    let child = Recvlogical(
        recvlogical(b, db, SLOT)
            .await?
            .stdout(stdout)
            .spawn()
            .with_context(|| format!("starting {PG_RECVLOGICAL}"))?,
    );
    // Writes before the slot is active would still be read, but the writer-cost variant
    // must not measure a start-up.
    await_slot_active(db, SLOT, true)
        .await
        .context("pg_recvlogical did not start streaming")?;
    Ok(child)
}

/// The slot the drains' floor reads, made beside [`SLOT`] before the backlog is written.
const FLOOR_SLOT: &str = "outbox_bench_floor";

/// The drain's floor: `pg_recvlogical` reads [`FLOOR_SLOT`] up to the current position, to
/// `/dev/null`, and exits; its wall time, start-up and exit included as in the relay's.
async fn floor_drain(b: &Bench, db: &tokio_postgres::Client, slot: &str, n: u64) -> Result<Value> {
    let end: String = db
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    let mut command = recvlogical(b, db, slot).await?;
    command.arg(format!("--endpos={end}")).stdout(Stdio::null());
    let start = Instant::now();
    let mut child = Recvlogical(command.spawn()?);
    let status =
        tokio::task::block_in_place(|| wait_child(&mut child.0, Duration::from_secs(300)))?;
    let wall = start.elapsed().as_secs_f64();
    if !status.success() {
        bail!("pg_recvlogical --endpos {end} failed: {status}");
    }
    db.execute("SELECT pg_drop_replication_slot($1)", &[&slot])
        .await?;
    Ok(json!({ "events": n, "wall_s": wall, "events_per_s": n as f64 / wall }))
}

/// Stamps each `"seq": N` that `pg_recvlogical`'s output carries with the time its bytes
/// arrived, on a thread of its own until the output ends. The bytes are pgoutput's
/// (binary, unframed), but a row's payload and an `outbox_emit` message's content are
/// jsonb text, where each event's sequence number stands as `"seq": N` (`"seq":N` in the
/// relay's compact JSON lines).
pub fn stamp_arrivals(
    mut output: impl Read + Send + 'static,
    received: Arc<Mutex<HashMap<u64, Instant>>>,
) {
    std::thread::spawn(move || {
        const MARK: &[u8] = b"\"seq\":";
        let mut buffer = vec![0u8; 1 << 16];
        // The tail of the last read, which may hold the start of a split mark.
        let mut carried = Vec::new();
        loop {
            let n = match output.read(&mut buffer) {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let at = Instant::now();
            carried.extend_from_slice(&buffer[..n]);
            let mut seen = Vec::new();
            let (mut from, mut unfinished) = (0, None);
            while let Some(i) = find(&carried[from..], MARK) {
                let mut digits_at = from + i + MARK.len();
                digits_at += carried[digits_at..]
                    .iter()
                    .take_while(|b| **b == b' ')
                    .count();
                let digits = carried[digits_at..]
                    .iter()
                    .take_while(|b| b.is_ascii_digit())
                    .count();
                if digits_at + digits == carried.len() {
                    // The number may go on in the next read.
                    unfinished = Some(from + i);
                    break;
                }
                let number = std::str::from_utf8(&carried[digits_at..digits_at + digits]);
                if let Some(seq) = number.ok().and_then(|n| n.parse().ok()) {
                    seen.push(seq);
                }
                from = digits_at + digits;
            }
            // Keep an unfinished mark, or what could be the start of one.
            let keep_from = unfinished
                .unwrap_or_else(|| carried.len().saturating_sub(MARK.len() - 1).max(from));
            carried.drain(..keep_from);
            let mut received = received.lock().unwrap();
            for seq in seen {
                received.entry(seq).or_insert(at);
            }
        }
    });
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// A WAL-capture relay publishing to a file, once it relays (a probe row is gone).
pub async fn start_relay(b: &Bench, db: &tokio_postgres::Client, name: &str) -> Result<Child> {
    prepare(b, db).await?;
    let sink = format!("file:{}", b.work.join(format!("{name}.jsonl")).display());
    let mut args = vec!["--sink", sink.as_str()];
    args.extend(RELAY_ARGS);
    let relay = b.spawn_relay(name, &args)?;
    db.batch_execute(&format!(
        "INSERT INTO outbox (destination, partition_key, event_type, payload)
         VALUES ('{SUBJECT}', 'probe', 'probe', '{{\"seq\": 0}}')"
    ))
    .await?;
    let start = Instant::now();
    while db
        .query_one("SELECT count(*)::int8 FROM outbox", &[])
        .await?
        .get::<_, i64>(0)
        > 0
    {
        if start.elapsed() > Duration::from_secs(30) {
            bail!("the WAL-capture relay did not relay a probe row within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(relay)
}

/// Writes `n` events in transactions of `per` (a backlog written while the relay is off):
/// rows of the outbox (`table`), or `outbox_emit` messages (`emit`). Same payloads and keys
/// as the polling drain's.
async fn prefill(db: &tokio_postgres::Client, form: &str, n: u64, per: u64) -> Result<()> {
    let write = match form {
        "table" => format!(
            "INSERT INTO outbox (destination, partition_key, event_type, payload)
             SELECT '{SUBJECT}', 'customer-' || (i % 1000), 'order.created', {PAYLOAD_SQL}"
        ),
        _ => format!(
            "PERFORM outbox_emit('{SUBJECT}', 'customer-' || (i % 1000), 'order.created', {PAYLOAD_SQL})"
        ),
    };
    // One DO block, a COMMIT after each `per` events.
    db.batch_execute(&format!(
        "DO $prefill$
         BEGIN
             FOR c IN 0..{last} LOOP
                 {write}
                   FROM generate_series(c * {per}::int8 + 1, least((c + 1) * {per}::int8, {n})) i;
                 COMMIT;
             END LOOP;
         END
         $prefill$",
        last = n.div_ceil(per).saturating_sub(1),
    ))
    .await?;
    Ok(())
}

/// The WAL drains: each sink, each form.
pub async fn drain(b: &Bench) -> Result<Value> {
    let mut out = json!({
        "events_per_transaction": b.settings.wal_events_per_transaction,
        "sinks": b.settings.sinks,
    });
    for sink in b.settings.sinks.iter().map(String::as_str) {
        for form in ["table", "emit"] {
            out[sink][form] = drain_once(b, sink, form).await?;
        }
    }
    Ok(out)
}

/// One `run --capture wal --drain` of a prefilled backlog to `sink`.
async fn drain_once(b: &Bench, sink: &str, form: &str) -> Result<Value> {
    let (n, per) = (b.settings.events, b.settings.wal_events_per_transaction);
    eprintln!("drain: WAL capture, {n} events ({form}, {per} per transaction) to {sink}");
    let db = b.reset().await?;
    prepare(b, &db).await?;
    // More rounds for the messages only: a relay's drain of the rows deletes them, so a
    // second one over the same backlog would not do the same work.
    let rounds = match form {
        "emit" => b.settings.wal_drain_rounds,
        _ => 1,
    };
    let later_rounds: Vec<(String, String)> = (2..=rounds)
        .map(|i| (format!("{SLOT}_{i}"), format!("{FLOOR_SLOT}_{i}")))
        .collect();
    for (relay_slot, _) in &later_rounds {
        prepare_slot(b, &db, relay_slot).await?;
    }
    for floor_slot in
        std::iter::once(FLOOR_SLOT).chain(later_rounds.iter().map(|(_, f)| f.as_str()))
    {
        db.execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&floor_slot],
        )
        .await?;
    }
    prefill(&db, form, n, per).await?;
    let floor = floor_drain(b, &db, FLOOR_SLOT, n).await?;
    let wal_bytes: i64 = db
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::int8
               FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
            &[&SLOT],
        )
        .await?
        .get(0);
    let mut drained = measure::run_drain(
        b,
        &db,
        sink,
        &b.work.join("wal-drain.jsonl"),
        n,
        &RELAY_ARGS,
    )
    .await?;
    let left: i64 = db
        .query_one(
            "SELECT (SELECT count(*) FROM outbox) + (SELECT count(*) FROM outbox_parked)",
            &[],
        )
        .await?
        .get(0);
    if !later_rounds.is_empty() {
        let mut each = vec![round(&drained, &floor)];
        for (relay_slot, floor_slot) in &later_rounds {
            let floor = floor_drain(b, &db, floor_slot, n).await?;
            let args = ["--capture", "wal", "--slot", relay_slot.as_str()];
            let file = b.work.join("wal-drain.jsonl");
            let relay = measure::run_drain(b, &db, sink, &file, n, &args).await?;
            each.push(round(&relay, &floor));
            db.execute("SELECT pg_drop_replication_slot($1)", &[relay_slot])
                .await?;
        }
        let mut ratios: Vec<f64> = each.iter().filter_map(|r| r["ratio"].as_f64()).collect();
        drained["median_ratio"] = json!(median(&mut ratios));
        drained["rounds"] = json!(each);
    }
    drained["form"] = json!(form);
    drained["floor"] = floor;
    drained["backlog_wal_mb"] = json!(wal_bytes as f64 / 1_048_576.0);
    drained["rows_left"] = json!(left);
    Ok(drained)
}

/// One round of alternating drains: the relay's and the floor's rates, and their ratio.
fn round(drained: &Value, floor: &Value) -> Value {
    let rate = |v: &Value| v["events_per_s"].as_f64();
    json!({
        "floor_events_per_s": floor["events_per_s"],
        "events_per_s": drained["events_per_s"],
        "relay_cpu_s_per_million": drained["relay_cpu_s_per_million"],
        "ratio": rate(drained).zip(rate(floor)).map(|(relay, floor)| relay / floor),
    })
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    match values.len() % 2 {
        0 if mid > 0 => (values[mid - 1] + values[mid]) / 2.0,
        _ => values.get(mid).copied().unwrap_or(0.0),
    }
}

/// The WAL rows of the drain table for `sink`.
pub fn drain_rows(r: &Value, sink: &str) -> String {
    let mut s = String::new();
    let baseline = r["drain"][sink]["baseline"]["events_per_s"].as_f64();
    for (form, label) in [
        ("table", "WAL capture, rows"),
        ("emit", "WAL capture, outbox_emit"),
    ] {
        let y = &r["wal_drain"][sink][form];
        if y.is_null() {
            continue;
        }
        // The floor has no sink: shown once, under the first sink's rows.
        if r["wal_drain"]["sinks"][0] == json!(sink) {
            s.push_str(&format!(
                "| none | {label}: pg_recvlogical to /dev/null, no sink (the floor) | {} | {} | - | - | - | - | - | - |\n",
                y["floor"]["events"],
                measure::f(&y["floor"]["events_per_s"]),
            ));
        }
        let ratio = match (y["events_per_s"].as_f64(), baseline) {
            (Some(x), Some(base)) => format!("{}×", measure::f(&json!(x / base))),
            _ => "-".into(),
        };
        s.push_str(&format!(
            "| {sink} | {label} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            y["events"],
            measure::f(&y["events_per_s"]),
            measure::f(&y["relay_cpu_s_per_million"]),
            measure::f(&y["peak_rss_mb"]),
            measure::f(&y["statements_per_event"]),
            measure::f(&y["postgres_cpu_s"]),
            measure::f(&y["nats_server_cpu_s"]),
            ratio,
        ));
    }
    s
}

/// The note under the drain table.
pub fn drain_note(r: &Value) -> String {
    let w = &r["wal_drain"];
    if w.is_null() {
        return String::new();
    }
    let mut missing = Vec::new();
    for sink in ["file", "nats"] {
        for form in ["table", "emit"] {
            let y = &w[sink][form];
            if !y.is_null() && (y["delivered"] != y["events"] || y["rows_left"] != json!(0)) {
                missing.push(format!(
                    "{sink}/{form}: {} of {} delivered, {} rows left",
                    y["delivered"], y["events"], y["rows_left"]
                ));
            }
        }
    }
    let mut rounds = String::new();
    for sink in ["file", "nats"] {
        let y = &w[sink]["emit"];
        let Some(each) = y["rounds"].as_array() else {
            continue;
        };
        let pairs: Vec<String> = each
            .iter()
            .map(|round| {
                format!(
                    "{}/s against {}/s ({}×)",
                    measure::f(&round["events_per_s"]),
                    measure::f(&round["floor_events_per_s"]),
                    measure::f(&round["ratio"])
                )
            })
            .collect();
        rounds.push_str(&format!(
            "\noutbox_emit to {sink}, {} rounds over one backlog, the floor and the relay alternating: {}; median {}×.\n",
            each.len(),
            pairs.join(", "),
            measure::f(&y["median_ratio"]),
        ));
    }
    format!(
        "\nWAL capture: `run --capture wal --drain` from a slot created before the backlog was written in transactions of {} events ({} MB of WAL for the rows, {} MB for outbox_emit, file sink's runs). {}\n{rounds}",
        w["events_per_transaction"],
        measure::f(&w["file"]["table"]["backlog_wal_mb"]),
        measure::f(&w["file"]["emit"]["backlog_wal_mb"]),
        if missing.is_empty() {
            "Every event delivered, no row left.".to_string()
        } else {
            format!("Not all delivered: {}.", missing.join("; "))
        }
    )
}

/// Events of [`LARGE_EVENT_MIB`] each in the large-event drain.
pub const LARGE_EVENTS: u64 = 256;
/// The payload of each event in the large-event drain, in MiB.
const LARGE_EVENT_MIB: u64 = 1;
/// How long the large-event drain's webhook takes to answer each event.
const SLOW_SINK_PACE: Duration = Duration::from_millis(500);

/// `--only wal-memory` (and part of `--only wal`): `run --capture wal --drain` of
/// [`LARGE_EVENTS`] events of 1 MiB, from a slot created before they were written, to a
/// webhook that answers each after [`SLOW_SINK_PACE`]. The stream brings them far faster
/// than the sink takes them, so what the relay reads ahead in the meantime shows in its peak
/// RSS (the target: 128 MB).
pub async fn large_events(b: &Bench) -> Result<Value> {
    let n = LARGE_EVENTS;
    eprintln!("drain: WAL capture, {n} events of {LARGE_EVENT_MIB} MiB to a slow webhook");
    let db = b.reset().await?;
    prepare(b, &db).await?;
    db.batch_execute(&format!(
        "DO $prefill$
         BEGIN
             FOR c IN 0..{last} LOOP
                 INSERT INTO outbox (destination, partition_key, event_type, payload)
                 SELECT '{SUBJECT}', 'customer-' || (i % 64), 'order.created',
                        jsonb_build_object('seq', i, 'pad', repeat('x', {bytes}))
                   FROM generate_series(c * 8 + 1, least((c + 1) * 8, {n})) i;
                 COMMIT;
             END LOOP;
         END
         $prefill$",
        last = n.div_ceil(8) - 1,
        bytes = LARGE_EVENT_MIB * 1024 * 1024,
    ))
    .await?;
    let receiver = outbox_testkit::SlowWebhook::start(SLOW_SINK_PACE).await?;
    let sink = format!("http://{}/hooks/{{destination}}", receiver.addr);
    let url = b.relay_url();
    let mut args = measure::drain_args(&url, &sink);
    args.extend(["--http-addr", ""]);
    args.extend(RELAY_ARGS);
    args.extend(b.settings.relay_args.iter().map(String::as_str));
    // Off this worker: the receiver answers on the other one meanwhile.
    let (wall, user, sys, rss) = tokio::task::block_in_place(|| measure::timed(b, &args))?;
    let delivered = receiver.received() as u64;
    if delivered < n {
        bail!("the large-event drain delivered {delivered} of {n} events");
    }
    Ok(json!({
        "events": n, "delivered": delivered, "event_mib": LARGE_EVENT_MIB,
        "sink_pace_ms": SLOW_SINK_PACE.as_millis() as u64,
        "wall_s": wall, "events_per_s": n as f64 / wall,
        "relay_cpu_s": user + sys,
        "peak_rss_mb": rss as f64 / 1024.0,
    }))
}

/// The large-event drain's line in the report.
pub fn large_events_note(r: &Value) -> String {
    let y = &r["wal_memory"];
    if y.is_null() {
        return String::new();
    }
    format!(
        "\nWAL capture, {} events of {} MiB drained to a webhook answering each after {} ms: peak RSS {} MB (target ≤ 128 MB), {} events/s, {} of {} delivered.\n",
        y["events"],
        y["event_mib"],
        y["sink_pace_ms"],
        measure::f(&y["peak_rss_mb"]),
        measure::f(&y["events_per_s"]),
        y["delivered"],
        y["events"],
    )
}
