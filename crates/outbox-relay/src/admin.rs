//! The admin API under `/api/v1/` and the dashboard at `/`.
//!
//! Every operation goes through the store's [`outbox_core::store::Operations`], as the CLI's
//! operator commands do (`operator.rs`), with the same messages. With an admin token configured,
//! every API call needs `Authorization: Bearer <token>` (reads too: they show payloads), compared
//! in constant time; only the dashboard's own files are open, so that the page can load and ask for
//! the token. Without a token the server stays on loopback, reads are open there, and changes
//! answer 403. The check ([`gate`]) looks at the request line and headers only, before any body is
//! read. Each mutating call is logged at info level with what it did, never with the token.
//!
//! Backlog and lag over time come from [`History`]: the engine's own backlog gauges, read
//! from the metrics recorder every [`SAMPLE_EVERY`] and kept for [`HISTORY_SPAN`]. What
//! `/api/v1/status` reads from the database (backlog per destination, nodes, partitions)
//! comes from [`StoreFigures`]: read at most once per interval and shared by every client, so
//! any number of open dashboards costs the database one read per interval.

// A handler's refusal is its `Response`, built once per request: boxing it buys nothing.
#![allow(clippy::result_large_err)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, RawQuery, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use outbox_core::redact::Secret;
use outbox_core::store::{
    Backlog, DeadQuery, DeadRetried, DeadSelector, DestinationStats, NodeRecord, PartitionRecord,
    StoreResult,
};
use outbox_core::{StoreError, StoreErrorKind};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::operator::{
    dead_record_json, purged_text, replay_all, replay_selector, retried_text, NOTHING_TO_REPLAY,
};

/// How often [`History`] samples the gauges.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// How far back [`History`] reaches.
pub const HISTORY_SPAN: Duration = Duration::from_secs(3600);
/// The rates in `/api/v1/status` are averaged over this window.
const RATE_WINDOW: Duration = Duration::from_secs(60);
/// A store call the API makes gives up after this long (503).
const STORE_PATIENCE: Duration = Duration::from_secs(5);
/// The largest page of dead letters.
const MAX_PAGE: u32 = 1000;
/// The largest request body read: a selector is a few hundred bytes, a list of ids a few
/// thousand.
pub const MAX_BODY: usize = 64 * 1024;
/// Counts `/api/v1/status` requests.
pub const STATUS_REQUESTS: &str = "outbox_console_status_requests_total";
/// Counts the store reads behind them ([`StoreFigures`]): at most one per interval, however
/// many clients poll.
pub const STORE_READS: &str = "outbox_console_store_reads_total";
/// Counts requests refused for a missing or wrong admin token.
pub const AUTH_FAILURES: &str = "outbox_admin_auth_failures_total";
/// Failed authentications are logged at most once per this interval, with their count.
const AUTH_FAILURE_LOG_EVERY: Duration = Duration::from_secs(10);

const INDEX_HTML: &str = include_str!("dashboard/index.html");
const APP_JS: &str = include_str!("dashboard/app.js");
const APP_CSS: &str = include_str!("dashboard/app.css");

/// What the admin API reads and acts on: the running relay's store and settings.
pub struct Console {
    /// The running relay's store (the CLI's `stats` reads the same).
    pub store: crate::store::AnyStore,
    /// What the relay reads events from, for the header (the WAL stream with `--capture wal`).
    pub describe: String,
    /// This relay's node id.
    pub node: String,
    /// The settings in effect, secrets redacted ([`redacted_settings`]).
    pub settings: Value,
    /// `None`: reads are open (on loopback), changes answer 403.
    pub token: Option<Secret>,
    pub metrics: PrometheusHandle,
    pub history: Mutex<History>,
    /// The store figures `/api/v1/status` shows, shared by every client.
    pub figures: StoreFigures,
    /// The outbox's name under `[[outboxes]]`: its history reads only its own series.
    pub outbox: Option<String>,
    /// The replay running, if one is (on a task of its own, past its request's end): a
    /// second one answers 409 meanwhile, rather than publish the same events again beside it.
    pub replay: Arc<Mutex<Option<ReplayProgress>>>,
}

/// How far the running replay has got, as `/api/v1/status` shows it.
#[derive(Clone, Debug)]
pub struct ReplayProgress {
    pub total: u64,
    pub replayed: u64,
    pub started: SystemTime,
}

/// What `/api/v1/status` reads from the store, in one go.
pub struct StoreRead {
    /// When the read began: the figures are at least this recent.
    pub as_of: SystemTime,
    pub backlog: Backlog,
    pub destinations: Vec<DestinationStats>,
    pub nodes: Vec<NodeRecord>,
    /// `None` for stores without partition leases.
    pub partitions: Option<Vec<PartitionRecord>>,
}

/// The last [`StoreRead`], read again only once it is `every` old (or a change made through
/// the API marked it stale). One request reads at a time and the others wait for its result
/// (single flight), so N browsers polling cost one read per interval, not N.
pub struct StoreFigures {
    every: Duration,
    /// The last read and when it finished (the interval counts from there, so a slow read
    /// cannot run back to back).
    last: tokio::sync::Mutex<Option<(tokio::time::Instant, Arc<StoreRead>)>>,
    stale: AtomicBool,
}

impl StoreFigures {
    /// Figures read at most once per `every` (the engine's backlog interval).
    pub fn new(every: Duration) -> StoreFigures {
        StoreFigures {
            every,
            last: tokio::sync::Mutex::new(None),
            stale: AtomicBool::new(false),
        }
    }

    pub fn every(&self) -> Duration {
        self.every
    }

    /// The next request reads again (after a retry, purge or replay, so the operator sees
    /// its effect at once).
    pub fn mark_stale(&self) {
        self.stale.store(true, Ordering::SeqCst);
    }

    /// The current figures: the last read while it is younger than the interval, otherwise
    /// a new one. Cancel-safe: a request dropped while reading releases the lock, and the
    /// next waiter reads.
    async fn current(&self, store: &crate::store::AnyStore) -> StoreResult<Arc<StoreRead>> {
        let mut last = self.last.lock().await;
        if let Some((at, read)) = &*last {
            if at.elapsed() < self.every && !self.stale.load(Ordering::SeqCst) {
                return Ok(read.clone());
            }
        }
        // Cleared before reading: a change made during the read marks the figures stale again.
        self.stale.store(false, Ordering::SeqCst);
        ::metrics::counter!(STORE_READS).increment(1);
        let read = Arc::new(read_store(store).await?);
        *last = Some((tokio::time::Instant::now(), read.clone()));
        Ok(read)
    }
}

async fn read_store(store: &crate::store::AnyStore) -> StoreResult<StoreRead> {
    let as_of = SystemTime::now();
    let crate::store::BacklogReport {
        backlog,
        destinations,
    } = store.backlog_report().await?;
    let nodes = store.registry().live_nodes().await?;
    let partitions = match &store.partition_registry() {
        Some(r) => Some(r.partitions().await?),
        None => None,
    };
    Ok(StoreRead {
        as_of,
        backlog,
        destinations,
        nodes,
        partitions,
    })
}

/// One sample of the engine's gauges and counters.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sample {
    /// Unix milliseconds.
    pub at: u64,
    pub pending: f64,
    pub retrying: f64,
    pub dead: f64,
    pub oldest_age_seconds: f64,
    pub published: f64,
    pub retried: f64,
    pub dead_lettered: f64,
    pub store_errors: f64,
}

/// The last [`HISTORY_SPAN`] of samples, oldest first.
#[derive(Default)]
pub struct History {
    samples: VecDeque<Sample>,
}

impl History {
    pub fn push(&mut self, sample: Sample) {
        let keep = (HISTORY_SPAN.as_millis() / SAMPLE_EVERY.as_millis()) as usize + 1;
        while self.samples.len() >= keep {
            self.samples.pop_front();
        }
        self.samples.push_back(sample);
    }

    /// Samples taken after `after` (Unix ms).
    pub fn since(&self, after: u64) -> Vec<Sample> {
        self.samples
            .iter()
            .filter(|s| s.at > after)
            .copied()
            .collect()
    }

    /// Per-second rates of the counters over the last `window`: published, retried,
    /// dead-lettered, store errors; `None` before two samples exist.
    pub fn rates(&self, window: Duration) -> Option<[f64; 4]> {
        let last = self.samples.back()?;
        let from = last.at.saturating_sub(window.as_millis() as u64);
        let first = self.samples.iter().find(|s| s.at >= from)?;
        let seconds = (last.at.checked_sub(first.at)? as f64) / 1000.0;
        if seconds <= 0.0 {
            return None;
        }
        // A counter never goes down; a drop would be a restart of the recorder.
        let rate = |a: f64, b: f64| ((b - a).max(0.0)) / seconds;
        Some([
            rate(first.published, last.published),
            rate(first.retried, last.retried),
            rate(first.dead_lettered, last.dead_lettered),
            rate(first.store_errors, last.store_errors),
        ])
    }
}

/// The sum of every series of `name` in Prometheus text (0 when absent); with `outbox`,
/// only that outbox's series.
fn metric_sum(text: &str, name: &str, outbox: Option<&str>) -> f64 {
    let label = outbox.map(|o| format!("outbox=\"{o}\""));
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter(|l| {
            label
                .as_ref()
                .is_none_or(|label| l.contains(label.as_str()))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .filter(|v| v.is_finite())
        // An empty sum of floats is -0.0, which the API served as `-0.0`.
        .fold(0.0, |sum, v| sum + v)
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

/// Reads the engine's metrics (of `outbox` only, when given) into a [`Sample`].
pub fn sample(metrics: &PrometheusHandle, outbox: Option<&str>) -> Sample {
    use outbox_engine::metrics as m;
    let text = metrics.render();
    let sum = |name: &str| metric_sum(&text, name, outbox);
    Sample {
        at: unix_ms(SystemTime::now()),
        pending: sum(m::BACKLOG),
        retrying: sum(m::RETRYING),
        dead: sum(m::DEAD),
        oldest_age_seconds: sum(m::OLDEST_AGE),
        published: sum(m::PUBLISHED),
        retried: sum(m::RETRIED),
        dead_lettered: sum(m::DEAD_LETTERED),
        store_errors: sum(m::STORE_ERRORS),
    }
}

/// Samples into `console.history` every [`SAMPLE_EVERY`], until aborted.
pub async fn keep_history(console: Arc<Console>) {
    let mut ticker = tokio::time::interval(SAMPLE_EVERY);
    loop {
        ticker.tick().await;
        let s = sample(&console.metrics, console.outbox.as_deref());
        lock(&console.history).push(s);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The settings as JSON with every secret replaced by `***`: each [`Secret`] setting, and
/// the secret parts of every URL (through the one redactor).
pub fn redacted_settings(config: &crate::config::Config) -> Value {
    fn walk(value: Value) -> Value {
        match value {
            Value::String(s) => Value::String(outbox_core::redact::redact_url(&s)),
            Value::Array(items) => Value::Array(items.into_iter().map(walk).collect()),
            Value::Object(map) => {
                Value::Object(map.into_iter().map(|(k, v)| (k, walk(v))).collect())
            }
            other => other,
        }
    }
    walk(outbox_core::redact::redacted(|| {
        serde_json::to_value(config).unwrap_or_default()
    }))
}

/// The console's routes (the caller adds `/healthz`, `/readyz` and `/metrics`). `base` is
/// the path the browser sees them under (`/`, or `/outboxes/NAME/` on a shared server):
/// the page's links and API calls are relative to it.
pub fn routes(console: Arc<Console>, base: &str) -> Router {
    let index = INDEX_HTML.replace("<base href=\"/\">", &format!("<base href=\"{base}\">"));
    Router::new()
        .route(
            "/",
            get(move || async move { asset("text/html; charset=utf-8", index) }),
        )
        .route(
            "/assets/app.js",
            get(|| async { asset("text/javascript; charset=utf-8", APP_JS) }),
        )
        .route("/assets/app.css", get(|| async { stylesheet() }))
        .route("/api/v1/status", get(status))
        .route("/api/v1/history", get(history))
        .route("/api/v1/dead-letters", get(dead_letters))
        .route("/api/v1/events/{id}", get(event))
        .route("/api/v1/dead-letters/retry", post(dead_retry))
        .route("/api/v1/dead-letters/purge", post(dead_purge))
        .route("/api/v1/replay", post(replay))
        .fallback(|| async { failure(StatusCode::NOT_FOUND, "no such endpoint".into()) })
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(axum::middleware::from_fn_with_state(
            Gate::new(console.token.clone(), dashboard_file),
            gate,
        ))
        .with_state(console)
}

/// The dashboard's own files, open without the token: the page loads, then asks for it.
fn dashboard_file(path: &str) -> bool {
    matches!(path, "/" | "/assets/app.js" | "/assets/app.css")
}

/// Who may ask for what: the admin token, and the paths open without it.
#[derive(Clone)]
pub(crate) struct Gate {
    token: Option<Secret>,
    open: fn(&str) -> bool,
    /// When failures were last logged, and how many came since.
    failures: Arc<Mutex<(Option<std::time::Instant>, u64)>>,
}

impl Gate {
    pub(crate) fn new(token: Option<Secret>, open: fn(&str) -> bool) -> Gate {
        Gate {
            token,
            open,
            failures: Arc::default(),
        }
    }

    /// Counts a refused token, and logs the failures since the last line at most once per
    /// [`AUTH_FAILURE_LOG_EVERY`]: a guessing client must not flood the log.
    fn failed(&self, request: &Request) {
        ::metrics::counter!(AUTH_FAILURES).increment(1);
        let mut failures = lock(&self.failures);
        failures.1 += 1;
        if failures
            .0
            .is_none_or(|at| at.elapsed() >= AUTH_FAILURE_LOG_EVERY)
        {
            tracing::warn!(
                failures = failures.1,
                path = %outbox_core::redact::escape_controls(request.uri().path()),
                "admin API: requests refused for a missing or wrong admin token"
            );
            *failures = (Some(std::time::Instant::now()), 0);
        }
    }
}

/// Lets a request through to a path that is not open only as [`authorize`] says, looking at
/// its method and headers alone: a refused request's body is never read.
pub(crate) async fn gate(State(gate): State<Gate>, request: Request, next: Next) -> Response {
    if (gate.open)(request.uri().path()) {
        return next.run(request).await;
    }
    let token = gate.token.as_ref().map(Secret::expose);
    if let Err(r) = authorize(token, request.method(), request.headers()) {
        if r.status() == StatusCode::UNAUTHORIZED {
            gate.failed(&request);
        }
        return r;
    }
    // A body announced too large is refused before it is sent (DefaultBodyLimit still
    // stops one that does not say its length).
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return body_too_large();
    }
    let response = next.run(request).await;
    // A body that did not say its length (chunked) is stopped while read, with the body
    // extractor's own plain text: answered as one that said it.
    let json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|t| t.as_bytes().starts_with(b"application/json"));
    if response.status() == StatusCode::PAYLOAD_TOO_LARGE && !json {
        return body_too_large();
    }
    response
}

/// The answer to a request body over [`MAX_BODY`].
fn body_too_large() -> Response {
    failure(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!(
            "request bodies are limited to {} KiB; select dead letters by destination or \
             {{\"all\": true}} rather than by a long list of ids",
            MAX_BODY / 1024
        ),
    )
}

/// The dashboard's stylesheet (the shared server's index uses it too).
pub(crate) fn stylesheet() -> Response {
    asset("text/css; charset=utf-8", APP_CSS)
}

/// A page or file of the dashboard, fetched again on each visit (no stale script after an
/// upgrade).
pub(crate) fn asset(content_type: &'static str, body: impl IntoResponse) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

pub(crate) fn reply(status: StatusCode, body: Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

pub(crate) fn failure(status: StatusCode, message: String) -> Response {
    reply(status, json!({ "error": message }))
}

/// A store failure as the CLI words it; unsupported operations (a configuration matter for
/// the layout) are 501, an unreachable database 503.
fn store_failure(e: StoreError) -> Response {
    let status = match e.kind() {
        StoreErrorKind::Config => StatusCode::NOT_IMPLEMENTED,
        StoreErrorKind::Connection | StoreErrorKind::Conflict => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    failure(status, e.report())
}

/// Runs a store call with [`STORE_PATIENCE`].
async fn patiently<T>(
    what: &str,
    call: impl std::future::Future<Output = StoreResult<T>>,
) -> Result<T, Response> {
    match tokio::time::timeout(STORE_PATIENCE, call).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(store_failure(e)),
        Err(_) => Err(failure(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "{what}: the database did not answer within {}s",
                STORE_PATIENCE.as_secs()
            ),
        )),
    }
}

fn seconds(d: Option<Duration>) -> Value {
    d.map_or(Value::Null, |d| json!(d.as_secs_f64()))
}

fn time_text(t: SystemTime) -> String {
    outbox_core::time::display_time(t)
}

async fn status(State(c): State<Arc<Console>>) -> Response {
    ::metrics::counter!(STATUS_REQUESTS).increment(1);
    match status_body(&c).await {
        Ok(body) => reply(StatusCode::OK, body),
        Err(r) => r,
    }
}

async fn status_body(c: &Console) -> Result<Value, Response> {
    let read = patiently("backlog, nodes and partitions", c.figures.current(&c.store)).await?;
    let StoreRead {
        as_of,
        backlog,
        destinations,
        nodes,
        partitions,
    } = &*read;
    let now = SystemTime::now();
    // Leases as they stood when they were read.
    let live = |p: &PartitionRecord| p.owner.is_some() && p.lease_until.is_some_and(|t| t > *as_of);
    let owned_by = |id: &str| -> Vec<i32> {
        partitions
            .iter()
            .flatten()
            .filter(|p| live(p) && p.owner.as_deref() == Some(id))
            .map(|p| p.partition)
            .collect()
    };
    let (shown, left_out) = busiest_destinations(destinations);
    let rates = lock(&c.history).rates(RATE_WINDOW);
    // The counters now, not as of the last sample.
    let totals = sample(&c.metrics, c.outbox.as_deref());
    let rate = |i: usize| rates.map_or(Value::Null, |r| json!(r[i]));
    Ok(json!({
        "version": env!("CARGO_PKG_VERSION"),
        "commit": env!("OUTBOX_BUILD_COMMIT"),
        "node": c.node,
        "outbox": c.describe,
        "now": time_text(now),
        "backlog": {
            "pending": backlog.pending,
            "retrying": backlog.retrying,
            "dead": backlog.dead,
            "oldest_pending_age_seconds": seconds(backlog.oldest_pending_age),
            // Destinations, nodes and partitions come from the same read.
            "as_of": time_text(*as_of),
            "refresh_seconds": c.figures.every().as_secs_f64(),
        },
        "destinations": shown.iter().map(|d| json!({
            "destination": d.destination,
            "pending": d.pending,
            "retrying": d.retrying,
            "dead": d.dead,
            "oldest_pending_age_seconds": seconds(d.oldest_pending_age),
        })).collect::<Vec<_>>(),
        "destinations_left_out": left_out,
        "nodes": nodes.iter().map(|n| json!({
            "id": n.id,
            "this_node": n.id == c.node,
            "expiry": time_text(n.expiry),
            "heartbeat_due_in_seconds": n.expiry.duration_since(now).unwrap_or_default().as_secs_f64(),
            "partitions": owned_by(&n.id),
        })).collect::<Vec<_>>(),
        "partitions": partitions.as_ref().map(|ps| json!({
            "count": ps.len(),
            "unowned": ps.iter().filter(|p| !live(p)).map(|p| p.partition).collect::<Vec<_>>(),
            "leases": ps.iter().map(|p| json!({
                "partition": p.partition,
                "owner": if live(p) { json!(p.owner) } else { Value::Null },
                "epoch": p.epoch,
                "lease_until": p.lease_until.map(time_text),
            })).collect::<Vec<_>>(),
        })),
        "rates": {
            "window_seconds": RATE_WINDOW.as_secs(),
            "published_per_second": rate(0),
            "retried_per_second": rate(1),
            "dead_lettered_per_second": rate(2),
            "store_errors_per_second": rate(3),
        },
        "totals": {
            "published": totals.published,
            "retried": totals.retried,
            "dead_lettered": totals.dead_lettered,
            "store_errors": totals.store_errors,
        },
        "replay": lock(&c.replay).as_ref().map(|r| json!({
            "total": r.total,
            "replayed": r.replayed,
            "started": time_text(r.started),
        })),
        "admin": { "token_configured": c.token.is_some() },
        "settings": c.settings,
    }))
}

/// Query parameters, percent-decoded; unknown names are refused so a typo is not ignored,
/// and so is a name given twice (one of the two would be dropped unsaid) or a NUL, which
/// no database column holds (PostgreSQL refused it, and the API answered 500).
fn query_params(raw: Option<String>, known: &[&str]) -> Result<Vec<(String, String)>, Response> {
    let mut out: Vec<(String, String)> = Vec::new();
    for pair in raw.unwrap_or_default().split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let (k, v) = (percent_decode(k)?, percent_decode(v)?);
        if !known.contains(&k.as_str()) {
            return Err(failure(
                StatusCode::BAD_REQUEST,
                format!("unknown query parameter {k:?}; known: {}", known.join(", ")),
            ));
        }
        if out.iter().any(|(seen, _)| *seen == k) {
            return Err(failure(
                StatusCode::BAD_REQUEST,
                format!("the query parameter {k:?} is given twice; give it once"),
            ));
        }
        if v.contains('\0') {
            return Err(failure(
                StatusCode::BAD_REQUEST,
                format!("the query parameter {k:?} holds a NUL character, which no event has"),
            ));
        }
        out.push((k, v));
    }
    Ok(out)
}

fn percent_decode(text: &str) -> Result<String, Response> {
    let bad = || {
        failure(
            StatusCode::BAD_REQUEST,
            format!("malformed percent-encoding in the query: {text:?}"),
        )
    };
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = text.get(i + 1..i + 3).ok_or_else(bad)?;
                out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).map_err(|_| bad())
}

async fn history(State(c): State<Arc<Console>>, RawQuery(raw): RawQuery) -> Response {
    let params = match query_params(raw, &["after"]) {
        Ok(p) => p,
        Err(r) => return r,
    };
    let mut after = 0;
    for (_, v) in params {
        match v.parse::<u64>() {
            Ok(a) => after = a,
            Err(_) => {
                return failure(
                    StatusCode::BAD_REQUEST,
                    format!("after must be Unix milliseconds (a sample's `at`), got {v:?}"),
                )
            }
        }
    }
    let samples = lock(&c.history).since(after);
    reply(
        StatusCode::OK,
        json!({
            "interval_seconds": SAMPLE_EVERY.as_secs(),
            "span_seconds": HISTORY_SPAN.as_secs(),
            "samples": samples.iter().map(|s| json!({
                "at": s.at,
                "pending": s.pending,
                "retrying": s.retrying,
                "dead": s.dead,
                "oldest_age_seconds": s.oldest_age_seconds,
                "published": s.published,
                "retried": s.retried,
                "dead_lettered": s.dead_lettered,
                "store_errors": s.store_errors,
            })).collect::<Vec<_>>(),
        }),
    )
}

/// The most destinations `/api/v1/status` lists (as many as the metrics label).
const STATUS_DESTINATIONS: usize = 500;

/// The [`STATUS_DESTINATIONS`] destinations with the most events waiting or dead, in the
/// store's order, and what the others hold together (`null` when none is left out). A
/// table with a destination per customer made the status 30 MB, read every 2 s by each
/// dashboard, whose page then failed to draw.
fn busiest_destinations(all: &[DestinationStats]) -> (Vec<&DestinationStats>, Value) {
    if all.len() <= STATUS_DESTINATIONS {
        return (all.iter().collect(), Value::Null);
    }
    let held = |d: &DestinationStats| d.pending + d.dead;
    let mut ranked: Vec<usize> = (0..all.len()).collect();
    ranked.sort_by_key(|&i| std::cmp::Reverse(held(&all[i])));
    let (kept, rest) = ranked.split_at(STATUS_DESTINATIONS);
    let mut kept = kept.to_vec();
    kept.sort_unstable();
    let sum = |f: fn(&DestinationStats) -> u64| rest.iter().map(|&i| f(&all[i])).sum::<u64>();
    (
        kept.into_iter().map(|i| &all[i]).collect(),
        json!({
            "destinations": rest.len(),
            "pending": sum(|d| d.pending),
            "retrying": sum(|d| d.retrying),
            "dead": sum(|d| d.dead),
        }),
    )
}

/// Refuses a destination no pending event or dead letter carries (a typo, most likely).
/// Whether `destination` is one the status figures know. Answered from those figures alone
/// (read at most once per interval, shared by every client): a request naming a destination
/// nobody uses must not cost the database a scan of its own.
async fn known_destination(c: &Console, destination: &str) -> Result<(), Response> {
    let read = patiently("destinations", c.figures.current(&c.store)).await?;
    if read
        .destinations
        .iter()
        .any(|d| d.destination == destination)
    {
        return Ok(());
    }
    Err(failure(
        StatusCode::BAD_REQUEST,
        format!(
            "unknown destination {destination:?}: no pending event or dead letter carried it \
             when the figures were last read (every {}; see /api/v1/status for the \
             destinations)",
            humantime::format_duration(c.figures.every())
        ),
    ))
}

async fn dead_letters(State(c): State<Arc<Console>>, RawQuery(raw): RawQuery) -> Response {
    let params = match query_params(raw, &["destination", "type", "limit", "after"]) {
        Ok(p) => p,
        Err(r) => return r,
    };
    let mut query = DeadQuery {
        limit: 50,
        ..DeadQuery::default()
    };
    for (k, v) in params {
        let number = |what: &str| {
            failure(
                StatusCode::BAD_REQUEST,
                format!("{k} must be {what}, got {v:?}"),
            )
        };
        match k.as_str() {
            "destination" if !v.is_empty() => query.destination = Some(v),
            "type" if !v.is_empty() => query.event_type = Some(v),
            "limit" => match v.parse::<u32>() {
                Ok(n) if (1..=MAX_PAGE).contains(&n) => query.limit = n,
                _ => return number(&format!("a number from 1 to {MAX_PAGE}")),
            },
            "after" => match v.parse::<i64>() {
                Ok(n) => query.after = n,
                _ => return number("a sequence id"),
            },
            _ => {}
        }
    }
    if let Some(d) = &query.destination {
        if let Err(r) = known_destination(&c, d).await {
            return r;
        }
    }
    let limit = query.limit as usize;
    let rows = match patiently("dead letters", c.store.operations().dead_list(query)).await {
        Ok(rows) => rows,
        Err(r) => return r,
    };
    // A full page may have more after it. A table with UUID row ids shows them as 0 and
    // cannot be paged by id: no `next_after`, which gave its first page again for good.
    // (Ids below 0 page as any other: WAL capture's table-less events draw theirs there.)
    let next_after = (rows.len() == limit)
        .then(|| rows.last().map(|r| r.sequence_id))
        .flatten()
        .filter(|&id| id != 0);
    reply(
        StatusCode::OK,
        json!({
            "dead_letters": rows.iter().map(dead_record_json).collect::<Vec<_>>(),
            "next_after": next_after,
        }),
    )
}

/// JSON text as JSON, anything else as a string.
fn as_json(text: Option<String>) -> Value {
    match text {
        None => Value::Null,
        Some(t) => serde_json::from_str(&t).unwrap_or(Value::String(t)),
    }
}

async fn event(State(c): State<Arc<Console>>, Path(id): Path<String>) -> Response {
    // Any integer: WAL capture's table-less events have ids below 0.
    let id = match id.parse::<i64>() {
        Ok(id) => id,
        _ => {
            return failure(
                StatusCode::BAD_REQUEST,
                format!("event id must be a sequence id (an integer), got {id:?}"),
            )
        }
    };
    match patiently("event", c.store.operations().event(id)).await {
        Ok(Some(e)) => reply(
            StatusCode::OK,
            json!({
                "sequence_id": e.sequence_id,
                "event_id": e.event_id,
                "destination": e.destination,
                "event_type": e.event_type,
                "ordering_key": e.ordering_key,
                "state": e.state.name(),
                "attempts": e.attempts,
                "last_error": e.last_error,
                "created_at": e.created_at.map(time_text),
                "dead_at": e.dead_at.map(time_text),
                "payload": as_json(e.payload),
                "headers": as_json(e.headers),
            }),
        ),
        Ok(None) => failure(
            StatusCode::NOT_FOUND,
            format!("no event {id}: it was delivered and deleted, purged, or never existed"),
        ),
        Err(r) => r,
    }
}

/// Constant-time equality: the time taken depends on the lengths only.
fn same_secret(given: &[u8], expected: &[u8]) -> bool {
    let mut diff = u8::from(given.len() != expected.len());
    for (i, e) in expected.iter().enumerate() {
        diff |= e ^ given.get(i).copied().unwrap_or(0);
    }
    std::hint::black_box(diff) == 0
}

/// With a token, every call needs it; without one, reads pass (the server is on loopback)
/// and changes are refused.
pub(crate) fn authorize(
    token: Option<&str>,
    method: &Method,
    headers: &HeaderMap,
) -> Result<(), Response> {
    let Some(token) = token else {
        if method == Method::GET || method == Method::HEAD {
            return Ok(());
        }
        return Err(failure(
            StatusCode::FORBIDDEN,
            "the admin API is read-only: no admin token is configured; set \
             OUTBOX_RELAY_ADMIN_TOKEN or --admin-token-file FILE and restart the relay"
                .into(),
        ));
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer);
    match given {
        Some(given) if same_secret(given.as_bytes(), token.as_bytes()) => Ok(()),
        _ => {
            let mut r = failure(
                StatusCode::UNAUTHORIZED,
                "the admin API needs the header `Authorization: Bearer <admin token>` with the \
                 relay's admin token, for reads too (they show event payloads)"
                    .into(),
            );
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
            Err(r)
        }
    }
}

/// The token of an `Authorization: Bearer <token>` header. The scheme is matched in any case
/// (RFC 6750 after RFC 9110: `bearer` and `BEARER` are `Bearer`).
fn bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_start())
}

fn parse_body<T: serde::de::DeserializeOwned>(body: &Bytes, example: &str) -> Result<T, Response> {
    serde_json::from_slice(body).map_err(|e| {
        failure(
            StatusCode::BAD_REQUEST,
            format!("invalid request body: {e}; send JSON such as {example}"),
        )
    })
}

/// Which dead letters a retry or purge touches: exactly one of the three.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeadBody {
    ids: Option<Vec<i64>>,
    destination: Option<String>,
    #[serde(default)]
    all: bool,
}

const DEAD_BODY: &str = r#"{"ids": [12, 13]}, {"destination": "orders"} or {"all": true}"#;

async fn dead_selector(c: &Console, body: &Bytes) -> Result<DeadSelector, Response> {
    let b: DeadBody = parse_body(body, DEAD_BODY)?;
    let bad = |m: &str| failure(StatusCode::BAD_REQUEST, format!("{m}; send {DEAD_BODY}"));
    match (b.ids, b.destination, b.all) {
        (Some(ids), None, false) => {
            if ids.is_empty() {
                return Err(bad("ids must be a non-empty list of sequence ids"));
            }
            if let Some(id) = ids.iter().find(|i| **i <= 0) {
                return Err(bad(&format!(
                    "ids are sequence ids, 1 or more: {id} is none"
                )));
            }
            Ok(DeadSelector::Ids(ids))
        }
        (None, Some(d), false) => {
            known_destination(c, &d).await?;
            Ok(DeadSelector::Destination(d))
        }
        (None, None, true) => Ok(DeadSelector::All),
        _ => Err(bad("give exactly one of ids, destination or all")),
    }
}

async fn dead_retry(State(c): State<Arc<Console>>, body: Bytes) -> Response {
    dead_action(&c, &body, DeadAction::Retry).await
}

async fn dead_purge(State(c): State<Arc<Console>>, body: Bytes) -> Response {
    dead_action(&c, &body, DeadAction::Purge).await
}

#[derive(Clone, Copy)]
enum DeadAction {
    Retry,
    Purge,
}

/// Retries or purges the dead letters the body selects, as `dead retry` / `dead purge` do.
/// The change runs on a task of its own, which logs its outcome whatever the request
/// learns: past [`STORE_PATIENCE`] the request is answered that it may still complete,
/// where it was told the database did not answer, and the change then went through
/// unlogged.
async fn dead_action(c: &Arc<Console>, body: &Bytes, action: DeadAction) -> Response {
    let selector = match dead_selector(c, body).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let (what, done) = match action {
        DeadAction::Retry => ("dead retry", "admin API: dead letters retried"),
        DeadAction::Purge => ("dead purge", "admin API: dead letters purged"),
    };
    let change = tokio::spawn({
        let c = c.clone();
        async move {
            let ops = c.store.operations();
            let outcome = match action {
                DeadAction::Retry => {
                    crate::operator::dead_retry_in_pages(&*ops, selector.clone(), |_| {}).await
                }
                DeadAction::Purge => ops
                    .dead_purge(selector.clone())
                    .await
                    .map(|moved| DeadRetried { moved, left: 0 }),
            };
            c.figures.mark_stale();
            match &outcome {
                Ok(n) => tracing::info!(?selector, count = n.moved, left = n.left, "{done}"),
                Err(e) => {
                    tracing::warn!(?selector, error = %e.report(), "admin API: {what} failed")
                }
            }
            outcome
        }
    });
    let n = match tokio::time::timeout(STORE_PATIENCE, change).await {
        Ok(Ok(Ok(n))) => n,
        Ok(Ok(Err(e))) => return store_failure(e),
        Ok(Err(panicked)) => {
            return failure(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("{what}: the change failed ({panicked}); see the relay's log"),
            )
        }
        Err(_) => {
            return failure(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "{what}: the database has not answered within {}s; the change may still \
                     complete, and the relay's log says when it does",
                    STORE_PATIENCE.as_secs()
                ),
            )
        }
    };
    match action {
        DeadAction::Retry => reply(
            StatusCode::OK,
            json!({ "retried": n.moved, "left": n.left, "message": retried_text(n) }),
        ),
        DeadAction::Purge => reply(
            StatusCode::OK,
            json!({ "purged": n.moved, "message": purged_text(n.moved) }),
        ),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplayBody {
    since: String,
    until: Option<String>,
    destination: Option<String>,
}

async fn replay(State(c): State<Arc<Console>>, body: Bytes) -> Response {
    let b: ReplayBody = match parse_body(
        &body,
        r#"{"since": "2h"} or {"since": "2026-11-20T10:00:00Z", "until": "1h", "destination": "orders"}"#,
    ) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let selector = match replay_selector(&b.since, b.until.as_deref(), b.destination) {
        Ok(s) => s,
        Err(e) => {
            return failure(
                StatusCode::BAD_REQUEST,
                format!("{e:#}")
                    .replace("--since", "since")
                    .replace("--until", "until"),
            )
        }
    };
    // Taken before the count, so two requests never both start.
    {
        let mut running = lock(&c.replay);
        if running.is_some() {
            return failure(
                StatusCode::CONFLICT,
                "a replay is running already; try again once it has finished (its progress is \
                 under \"replay\" in /api/v1/status)"
                    .into(),
            );
        }
        *running = Some(ReplayProgress {
            total: 0,
            replayed: 0,
            started: SystemTime::now(),
        });
    }
    // Lets go of the replay's place when it ends, however it ends.
    struct Replaying(Arc<Mutex<Option<ReplayProgress>>>);
    impl Drop for Replaying {
        fn drop(&mut self) {
            *lock(&self.0) = None;
        }
    }
    let replaying = Replaying(c.replay.clone());
    let total = match patiently(
        "replay",
        c.store.operations().count_replayable(selector.clone()),
    )
    .await
    {
        Ok(n) => n,
        Err(r) => return r,
    };
    if total == 0 {
        return reply(
            StatusCode::OK,
            json!({ "replayed": 0, "message": NOTHING_TO_REPLAY }),
        );
    }
    if let Some(progress) = lock(&c.replay).as_mut() {
        progress.total = total;
    }
    // Batches commit one by one; the whole may take longer than one store call's patience,
    // or than the request's: on a task of its own, it finishes (and is logged) even if the
    // request is answered first.
    let ops = c.store.operations();
    let console = c.clone();
    let replayed = tokio::spawn(async move {
        let replaying = replaying;
        let replayed = replay_all(&*ops, selector.clone(), |n| {
            if let Some(progress) = lock(&replaying.0).as_mut() {
                progress.replayed += n;
            }
        })
        .await;
        console.figures.mark_stale();
        match &replayed {
            Ok(n) => tracing::info!(
                since = %time_text(selector.since),
                until = %time_text(selector.until),
                destination = ?selector.destination,
                count = n,
                "admin API: delivered events replayed"
            ),
            Err(e) => tracing::warn!(
                since = %time_text(selector.since),
                until = %time_text(selector.until),
                destination = ?selector.destination,
                error = %e.report(),
                "admin API: replay failed"
            ),
        }
        replayed
    });
    // A long replay is answered while it goes on, where the request's timeout answered a
    // body-less 408 and left the caller to guess.
    match tokio::time::timeout(STORE_PATIENCE, replayed).await {
        Ok(Ok(Ok(n))) => reply(
            StatusCode::OK,
            json!({ "replayed": n, "message": format!("replayed {n} events") }),
        ),
        Ok(Ok(Err(e))) => store_failure(e),
        Ok(Err(e)) => failure(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the replay failed: {e}; see the relay's log"),
        ),
        Err(_) => reply(
            StatusCode::ACCEPTED,
            json!({
                "replaying": total,
                "message": format!(
                    "replaying {total} events: it goes on, its progress is under \"replay\" \
                     in /api/v1/status, and the relay's log says when it has finished"
                ),
            }),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_scheme_is_matched_in_any_case() {
        for value in ["Bearer abc", "bearer abc", "BEARER abc", " bEaReR   abc "] {
            assert_eq!(bearer(value), Some("abc"), "{value}");
        }
        for value in ["Basic abc", "Bearerabc", "Bearer", "Token abc"] {
            assert_eq!(bearer(value), None, "{value}");
        }
    }

    #[test]
    fn secrets_compare_equal_only_when_equal() {
        assert!(same_secret(b"0123456789abcdef", b"0123456789abcdef"));
        assert!(!same_secret(b"0123456789abcdeX", b"0123456789abcdef"));
        assert!(!same_secret(b"0123456789abcde", b"0123456789abcdef"));
        assert!(!same_secret(b"0123456789abcdef0", b"0123456789abcdef"));
        assert!(!same_secret(b"", b"0123456789abcdef"));
    }

    #[test]
    fn metric_sums_add_every_series_of_the_name_only() {
        let text = "# HELP outbox_events_published_total x\n\
                    outbox_events_published_total{destination=\"a\"} 3\n\
                    outbox_events_published_total{destination=\"b\"} 4\n\
                    outbox_events_published_total_other 100\n\
                    outbox_backlog_events 7\n";
        assert_eq!(metric_sum(text, "outbox_events_published_total", None), 7.0);
        assert_eq!(metric_sum(text, "outbox_backlog_events", None), 7.0);
        assert_eq!(metric_sum(text, "outbox_dead_letter_events", None), 0.0);
        // Served as JSON: `0.0`, never `-0.0` (an empty sum of floats is -0.0).
        let none = metric_sum(text, "outbox_dead_letter_events", None);
        assert_eq!(serde_json::json!(none).to_string(), "0.0");
    }

    /// Among several outboxes, a console's history is its own outbox's.
    #[test]
    fn metric_sums_of_one_outbox_read_only_its_series() {
        let text = "outbox_events_published_total{destination=\"a\",outbox=\"orders\"} 3\n\
                    outbox_events_published_total{destination=\"a\",outbox=\"billing\"} 4\n\
                    outbox_events_published_total{destination=\"b\",outbox=\"orders\"} 5\n";
        let sum = |outbox| metric_sum(text, "outbox_events_published_total", outbox);
        assert_eq!(sum(Some("orders")), 8.0);
        assert_eq!(sum(Some("billing")), 4.0);
        assert_eq!(sum(None), 12.0);
    }

    #[test]
    fn history_keeps_an_hour_and_rates_span_the_window() {
        let mut h = History::default();
        for i in 0..1000u64 {
            h.push(Sample {
                at: i * 5000,
                published: (i * 50) as f64,
                ..Sample::default()
            });
        }
        assert_eq!(h.samples.len(), 721);
        assert_eq!(h.since(999 * 5000 - 1).len(), 1);
        let rates = h.rates(Duration::from_secs(60)).unwrap();
        assert!((rates[0] - 10.0).abs() < 1e-9, "{rates:?}");
    }

    #[test]
    fn settings_never_show_secrets() {
        let mut config = crate::config::Config::default();
        config.database.database_url = "postgres://relay:hunter2@db/app".into();
        config.http.admin_token = Some(Secret::new("0123456789abcdef0123"));
        config.relay.sink = Some("nats://user:pw@broker:4222".into());
        let shown = redacted_settings(&config).to_string();
        for secret in ["hunter2", "0123456789abcdef0123", ":pw@"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert!(shown.contains("postgres://relay:***@db/app"), "{shown}");
    }

    /// A NUL reached PostgreSQL, which refused it (500, with a fix pointing at the tables);
    /// a name given twice kept the last value unsaid.
    #[test]
    fn a_query_with_a_nul_or_a_name_twice_is_refused() {
        let status = |raw: &str| match query_params(Some(raw.into()), &["type", "limit"]) {
            Ok(_) => StatusCode::OK,
            Err(r) => r.status(),
        };
        assert_eq!(status("type=%00"), StatusCode::BAD_REQUEST);
        assert_eq!(status("limit=1&limit=2"), StatusCode::BAD_REQUEST);
        assert_eq!(status("type=a&limit=2"), StatusCode::OK);
    }

    #[test]
    fn percent_decoding_handles_plus_and_escapes_and_refuses_junk() {
        assert_eq!(percent_decode("a%2Fb+c").unwrap(), "a/b c");
        assert!(percent_decode("%zz").is_err());
        assert!(percent_decode("%4").is_err());
        assert!(percent_decode("%ff").is_err());
    }
}
