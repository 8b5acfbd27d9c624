//! /healthz, /readyz and /metrics, with the admin API and the dashboard (`admin.rs`): for one
//! outbox ([`serve`]), or for the outboxes of `[[outboxes]]` ([`serve_outboxes`]), each under
//! `/outboxes/NAME/` and served on its own runtime.

use outbox_core::redact::escape_controls;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{any, get};
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use outbox_core::health::{Check, DEFAULT_STALL};
use outbox_core::{Health, OutboxStore, Publisher};
use tower::ServiceExt;

mod connections;
pub mod settings;

/// What `/readyz` and `/metrics` read of one running outbox.
#[derive(Clone)]
pub struct Probes {
    pub store: Arc<dyn OutboxStore>,
    pub publisher: Arc<dyn Publisher>,
    pub health: Arc<Health>,
    /// The last look at the database and the sink, shared by the `/readyz` requests of
    /// [`PROBE_REUSE`].
    pub looked: Arc<tokio::sync::Mutex<Option<Look>>>,
}

impl Probes {
    pub fn new(
        store: Arc<dyn OutboxStore>,
        publisher: Arc<dyn Publisher>,
        health: Arc<Health>,
    ) -> Probes {
        Probes {
            store,
            publisher,
            health,
            looked: Arc::default(),
        }
    }
}

/// How long one look at the database and the sink answers `/readyz`. `/readyz` needs no
/// token, and each look takes a pool connection and asks the sink (a webhook receiver gets
/// a `HEAD`, an AWS sink a signed call that counts against the account's limits): without
/// this, any client could multiply its requests into the database's and the sink's load.
/// Requests that come while a look runs wait for it and share its answer.
pub const PROBE_REUSE: Duration = Duration::from_secs(1);

/// One look at the database and the sink: when it ended, and what was wrong.
pub struct Look {
    at: std::time::Instant,
    reasons: Vec<Reason>,
}

/// What one look found wrong: with the database or the sink (`what`), and what it said.
#[derive(Clone)]
struct Reason {
    what: &'static str,
    detail: String,
}

#[derive(Clone)]
struct AppState {
    probes: Probes,
    metrics: PrometheusHandle,
    /// The admin token: with one, `/readyz` gives its reasons to callers that send it only.
    token: Option<outbox_core::redact::Secret>,
}

async fn listen(addr: SocketAddr) -> anyhow::Result<(tokio::net::TcpListener, SocketAddr)> {
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| {
        format!("cannot listen on {addr}: choose another --http-addr (127.0.0.1:0 picks a free port, an empty value turns it off)")
    })?;
    let bound = listener.local_addr()?;
    Ok((listener, bound))
}

/// A client has this long to send a request's headers. hyper starts the clock when the
/// connection waits for a request, so it also closes idle keep-alive connections.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// A request (its body included) is answered within this, or gets 408.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// An answer being sent must make progress within this, or the connection is closed: a
/// client that stops reading (its receive window full) would otherwise hold its slot for as
/// long as its kernel answers TCP's window probes, which is for good.
pub const WRITE_STALL_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection takes no new request after this, and is closed once its answer in progress
/// is sent (within the request and write bounds above): a client that pipelines requests
/// and reads their answers a trickle at a time would otherwise keep its slot for good.
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(30);
/// Paths every client may ask for whatever its `Host`: probes and scrapers name the relay
/// as they like, and these show no event. To a `Host` not the relay's, `/readyz` gives its
/// verdict only ([`ForeignHost`]).
const PROBES: [&str; 3] = ["/healthz", "/readyz", "/metrics"];

/// Marks a probe asked with a `Host` that is not the relay's: perhaps a page whose name was
/// rebound to the relay's address (DNS rebinding), which must not read `/readyz`'s reasons.
#[derive(Clone, Copy)]
struct ForeignHost;

/// The policy every response carries. The dashboard loads its script and stylesheet from
/// this origin and has no inline ones, so nothing else is needed; no page may frame it
/// (clickjacking the retry and purge buttons).
pub const CONTENT_SECURITY_POLICY: &str =
    "default-src 'self'; base-uri 'self'; form-action 'self'; frame-ancestors 'none'";

/// Adds the browser hardening headers to every response, whichever route or refusal made it.
fn with_security_headers(app: Router) -> Router {
    use axum::http::HeaderValue;
    use tower_http::set_header::SetResponseHeaderLayer;
    let headers = [
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
    ];
    headers.into_iter().fold(app, |app, (name, value)| {
        app.layer(SetResponseHeaderLayer::overriding(
            name,
            HeaderValue::from_static(value),
        ))
    })
}

/// Serves `app` on `listener` with the bounds above, HTTP/1.1 only, until aborted.
async fn serve_bounded(listener: tokio::net::TcpListener, app: Router) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let app = with_security_headers(app.layer(
        tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            REQUEST_TIMEOUT,
        ),
    ));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT);
    let table = Connections::default();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors, say: pause rather than spin.
                if !matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::ConnectionReset
                ) {
                    tracing::warn!(error = %e, "HTTP server cannot accept a connection");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                continue;
            }
        };
        // Closed at once (dropped) when every connection in its share is busy.
        let Some(held) = table.admit(peer.ip()) else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = Counted {
            inner: hyper_util::service::TowerToHyperService::new(app.clone()),
            held: held.clone(),
        };
        let stream = WritesProgress::new(stream, WRITE_STALL_TIMEOUT);
        let connection = http.serve_connection(TokioIo::new(stream), service);
        tokio::spawn(async move {
            // A client that goes away or times out is no news.
            let mut connection = std::pin::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                // Room made for a newer connection: this one was idle.
                () = held.evicted.notified() => {}
                () = tokio::time::sleep(CONNECTION_LIFETIME) => {
                    connection.as_mut().graceful_shutdown();
                    let last_answer = REQUEST_TIMEOUT + WRITE_STALL_TIMEOUT;
                    let _ = tokio::time::timeout(last_answer, connection).await;
                }
            }
            held.close();
        });
    }
}

/// The server's [`connections::Table`], shared by the accept loop and the connections'
/// tasks, with a way to close each connection it evicts.
#[derive(Clone, Default)]
struct Connections(Arc<std::sync::Mutex<ConnectionsInner>>);

#[derive(Default)]
struct ConnectionsInner {
    table: connections::Table,
    evict: std::collections::HashMap<connections::ConnectionId, Arc<tokio::sync::Notify>>,
}

impl Connections {
    fn lock(&self) -> std::sync::MutexGuard<'_, ConnectionsInner> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Admits a connection from `address`, closing the one evicted for it; `None`: refused.
    fn admit(&self, address: std::net::IpAddr) -> Option<HeldConnection> {
        let mut inner = self.lock();
        match inner.table.admit(address) {
            connections::Admission::Refuse => None,
            connections::Admission::Serve { id, evicted } => {
                if let Some(notify) = evicted.and_then(|e| inner.evict.remove(&e)) {
                    notify.notify_one();
                }
                let evicted = Arc::new(tokio::sync::Notify::new());
                inner.evict.insert(id, evicted.clone());
                Some(HeldConnection {
                    connections: self.clone(),
                    id,
                    evicted,
                })
            }
        }
    }
}

/// One admitted connection: its requests are counted, and it is let go when closed.
#[derive(Clone)]
struct HeldConnection {
    connections: Connections,
    id: connections::ConnectionId,
    /// Notified when the table closes it to make room.
    evicted: Arc<tokio::sync::Notify>,
}

impl HeldConnection {
    fn close(&self) {
        let mut inner = self.connections.lock();
        inner.table.closed(self.id);
        inner.evict.remove(&self.id);
    }
}

/// Ends a request's count when dropped: answered, or abandoned with its connection.
struct InProgress(HeldConnection);

impl Drop for InProgress {
    fn drop(&mut self) {
        self.0.connections.lock().table.request_ended(self.0.id);
    }
}

/// The app's service, counting the requests in progress on its connection: a connection
/// with one is never closed to make room.
struct Counted<S> {
    inner: S,
    held: HeldConnection,
}

impl<S, B> hyper::service::Service<hyper::Request<B>> for Counted<S>
where
    S: hyper::service::Service<hyper::Request<B>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn call(&self, request: hyper::Request<B>) -> Self::Future {
        self.held
            .connections
            .lock()
            .table
            .request_began(self.held.id);
        let in_progress = InProgress(self.held.clone());
        let answer = self.inner.call(request);
        Box::pin(async move {
            let answer = answer.await;
            drop(in_progress);
            answer
        })
    }
}

/// A connection whose writes fail once one has waited `stall` without the client taking a
/// byte (hyper has no write timeout of its own; the request timeout ends with the handler,
/// before the answer is sent). Reads pass through: the header timeout bounds those.
struct WritesProgress<S> {
    inner: S,
    stall: Duration,
    stalled_since: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl<S> WritesProgress<S> {
    fn new(inner: S, stall: Duration) -> Self {
        WritesProgress {
            inner,
            stall,
            stalled_since: None,
        }
    }

    /// `written`, unless it is still waiting and has been for `stall`.
    fn bounded<T>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        written: std::task::Poll<std::io::Result<T>>,
    ) -> std::task::Poll<std::io::Result<T>> {
        use std::future::Future;
        use std::task::Poll;
        if written.is_ready() {
            self.stalled_since = None;
            return written;
        }
        let stall = self.stall;
        let timer = self
            .stalled_since
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(stall)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the client took no byte of its answer for the write stall timeout",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for WritesProgress<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for WritesProgress<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let written = std::pin::Pin::new(&mut self.inner).poll_write(cx, buf);
        self.bounded(cx, written)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let written = std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.bounded(cx, written)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let flushed = std::pin::Pin::new(&mut self.inner).poll_flush(cx);
        self.bounded(cx, flushed)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let closed = std::pin::Pin::new(&mut self.inner).poll_shutdown(cx);
        self.bounded(cx, closed)
    }
}

/// The host names a server answers to besides IP addresses and `localhost`
/// (`allowed_hosts`, lowercased).
#[derive(Clone, Default)]
pub struct AllowedHosts(Arc<[String]>);

impl AllowedHosts {
    pub fn new(names: Vec<String>) -> AllowedHosts {
        AllowedHosts(names.into())
    }

    /// Whether a `Host` header's value names this relay: an IP address (a browser that
    /// asked for an address is not being rebound), `localhost`, or a configured name; any
    /// port.
    fn allows(&self, host: &str) -> bool {
        let name = if let Some(rest) = host.strip_prefix('[') {
            // [v6]:port
            return rest
                .split_once(']')
                .is_some_and(|(ip, _)| ip.parse::<std::net::Ipv6Addr>().is_ok());
        } else {
            match host.rsplit_once(':') {
                Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
                _ => host,
            }
        };
        let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
        name.parse::<std::net::Ipv4Addr>().is_ok() || name == "localhost" || self.0.contains(&name)
    }
}

/// Refuses a request whose `Host` is not this relay's (DNS rebinding: a page elsewhere
/// whose name now resolves to this address), before anything else reads it.
async fn check_host(
    State(hosts): State<AllowedHosts>,
    mut request: Request,
    next: Next,
) -> Response {
    // RFC 9112 §3.2: a request with more than one Host is answered 400. The first was
    // checked, and a second named another host to whatever read that one.
    if request.headers().get_all(header::HOST).iter().count() > 1 {
        return (
            StatusCode::BAD_REQUEST,
            "a request may name one Host header\n",
        )
            .into_response();
    }
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| request.uri().authority().map(|a| a.as_str()));
    let allowed = host.is_some_and(|host| hosts.allows(host));
    if PROBES.contains(&request.uri().path()) {
        if !allowed {
            request.extensions_mut().insert(ForeignHost);
        }
        return next.run(request).await;
    }
    match host {
        Some(_) if allowed => next.run(request).await,
        _ => {
            let shown = host.map_or("none".into(), |h| format!("{h:?}"));
            (
                StatusCode::MISDIRECTED_REQUEST,
                format!(
                    "this relay answers to IP addresses, localhost and the names in allowed_hosts, \
                     not to the host {shown}: if that is its name, add it to allowed_hosts \
                     (OUTBOX_RELAY_ALLOWED_HOSTS or --allowed-hosts)\n"
                ),
            )
                .into_response()
        }
    }
}

/// Binds `addr` and serves until the returned task is aborted. Returns the bound address
/// (useful with port 0).
pub async fn serve(
    addr: SocketAddr,
    probes: Probes,
    metrics: PrometheusHandle,
    console: Arc<crate::admin::Console>,
    hosts: AllowedHosts,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let (listener, bound) = listen(addr).await?;
    let token = console.token.clone();
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(AppState {
            probes,
            metrics,
            token,
        })
        .merge(crate::admin::routes(console.clone(), "/"))
        .layer(axum::middleware::from_fn_with_state(hosts, check_host));
    let task = tokio::spawn(async move {
        tokio::select! {
            () = serve_bounded(listener, app) => {}
            () = crate::admin::keep_history(console) => {}
        }
    });
    Ok((bound, task))
}

async fn readyz(
    State(state): State<AppState>,
    foreign: Option<axum::Extension<ForeignHost>>,
    headers: HeaderMap,
) -> (StatusCode, String) {
    let shown = Shown::to(state.token.as_ref(), &headers, foreign.is_some());
    verdict(readiness(&state.probes).await, shown)
}

/// What `/readyz` tells its caller. Its reasons quote what a database or sink said (a
/// webhook receiver's body, which may echo a payload) and name keys (often a customer's or
/// an order's id). `/readyz` needs no token, so that probes work; with an admin token set,
/// a caller without it learns only whether the relay is ready.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Shown {
    Reasons,
    VerdictOnly,
}

impl Shown {
    /// Reasons to a caller with the token (or any, with none set) that named the relay as
    /// its `Host`; to a `foreign_host`, the verdict only, token or not.
    fn to(
        token: Option<&outbox_core::redact::Secret>,
        headers: &HeaderMap,
        foreign_host: bool,
    ) -> Shown {
        if foreign_host {
            return Shown::VerdictOnly;
        }
        match crate::admin::authorize(token.map(|t| t.expose()), &Method::GET, headers) {
            Ok(()) => Shown::Reasons,
            Err(_) => Shown::VerdictOnly,
        }
    }
}

/// The answer of `/readyz`. Reasons are escaped (control characters): `health --ready`
/// prints them.
fn verdict(reasons: Vec<String>, shown: Shown) -> (StatusCode, String) {
    if reasons.is_empty() {
        (StatusCode::OK, "ready\n".into())
    } else if shown == Shown::VerdictOnly {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: {} problem(s); the relay's log names them, and so does /readyz \
                 asked with the admin token (`Authorization: Bearer <token>`, as `health \
                 --ready` sends it)\n",
                reasons.len()
            ),
        )
    } else {
        let reasons: Vec<_> = reasons.iter().map(|r| escape_controls(r)).collect();
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}\n", reasons.join("; ")),
        )
    }
}

/// Why an outbox is not ready; empty when it is.
async fn readiness(probes: &Probes) -> Vec<String> {
    let looked = looked_within(probes, PROBE_REUSE).await;
    // What the node's own work says, as of now: a ping can pass while claims, settles or
    // lease renewals fail (a revoked privilege) or hang.
    let troubles = probes
        .health
        .troubles(std::time::Instant::now(), DEFAULT_STALL)
        .into_iter()
        .map(|t| t.to_string());
    looked
        .into_iter()
        .map(|r| r.detail)
        .chain(troubles)
        .collect()
}

/// What the last look at the database and the sink found, looking again when it is older
/// than `age`. Callers that come while a look runs wait for it and share its answer.
async fn looked_within(probes: &Probes, age: Duration) -> Vec<Reason> {
    let mut last = probes.looked.lock().await;
    match last.as_ref().filter(|l| l.at.elapsed() < age) {
        Some(look) => look.reasons.clone(),
        None => {
            let reasons = look(probes).await;
            *last = Some(Look {
                at: std::time::Instant::now(),
                reasons: reasons.clone(),
            });
            reasons
        }
    }
}

/// The problems of the last look, if it is recent (as of a scrape, which does not look).
fn last_look_problems(probes: &Probes) -> usize {
    match probes.looked.try_lock() {
        Ok(last) => (last.as_ref())
            .filter(|l| l.at.elapsed() < 2 * LOOK_EVERY)
            .map_or(0, |l| l.reasons.len()),
        Err(_) => 0,
    }
}

/// Pings the database and asks the sink whether it is healthy, both at once: one after the
/// other, two slow answers took longer than a readiness probe's timeout (5 s in the
/// manifests).
async fn look(probes: &Probes) -> Vec<Reason> {
    let limit = Duration::from_secs(3);
    let (db, sink) = tokio::join!(
        tokio::time::timeout(limit, probes.store.ping()),
        tokio::time::timeout(limit, probes.publisher.health())
    );
    let db = match db {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("database: {}", e.report())),
        Err(_) => Err("database: no answer within 3s".into()),
    };
    let sink = match sink {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!(
            "sink {}: {}",
            probes.publisher.describe(),
            e.report()
        )),
        Err(_) => Err(format!(
            "sink {}: no answer within 3s",
            probes.publisher.describe()
        )),
    };
    let db = db.err().map(|detail| Reason {
        what: "database",
        detail,
    });
    let sink = sink.err().map(|detail| Reason {
        what: "sink",
        detail,
    });
    let holders = lock_holders(probes, limit).await.map(|detail| Reason {
        what: "database",
        detail,
    });
    [db, sink, holders].into_iter().flatten().collect()
}

/// Who holds the locks the relay's statements wait for, asked while its work is in
/// trouble: a DBA's `LOCK TABLE`, or a session left idle in a transaction, was reported
/// as a database that does not answer, and the DBA had to find the session alone.
async fn lock_holders(probes: &Probes, limit: Duration) -> Option<String> {
    if probes
        .health
        .troubles(std::time::Instant::now(), DEFAULT_STALL)
        .is_empty()
    {
        return None;
    }
    let holders = tokio::time::timeout(limit, probes.store.lock_holders()?)
        .await
        .ok()?
        .ok()?;
    if holders.sessions.is_empty() {
        return None;
    }
    let said = format!(
        "the relay's statements wait for locks held by {}: let it finish, or end it ({})",
        holders.sessions.join("; "),
        holders.end_one
    );
    Some(said)
}

/// Gauges computed at scrape time, so they are true even while the tasks that would update
/// them wait on a database that does not answer.
fn refresh_health_gauges(probes: &Probes) {
    let health = &probes.health;
    let now = std::time::Instant::now();
    for check in Check::ALL {
        if let Some(at) = health.last_success(check) {
            let unix = at
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs_f64();
            metrics::gauge!(outbox_engine::metrics::LAST_SUCCESS, "check" => check.name())
                .set(unix);
        }
    }
    if let Some(owned) = health.owned_partitions(now) {
        metrics::gauge!(outbox_cluster::OWNED_PARTITIONS).set(owned as f64);
    }
    let problems = health.troubles(now, DEFAULT_STALL).len() + last_look_problems(probes);
    metrics::gauge!(outbox_engine::metrics::TROUBLES).set(problems as f64);
}

async fn metrics_text(State(state): State<AppState>) -> String {
    refresh_health_gauges(&state.probes);
    state.metrics.render()
}

// ---- Many outboxes on one server ----

/// A started outbox as the shared server sees it: its probes, its console's routes, and the
/// runtime its requests run on (so that its metrics carry its label, and a slow outbox
/// holds up only its own requests).
pub struct Served {
    pub probes: Probes,
    pub console: Router,
    pub runtime: tokio::runtime::Handle,
}

/// One outbox's place on the shared server: empty until the outbox has started (its
/// database answered and its sinks were built).
pub struct OutboxSlot {
    pub name: String,
    served: OnceLock<Served>,
}

impl OutboxSlot {
    pub fn new(name: String) -> Arc<OutboxSlot> {
        Arc::new(OutboxSlot {
            name,
            served: OnceLock::new(),
        })
    }

    /// Called once, by the outbox, when it has started.
    pub fn fill(&self, served: Served) {
        let _ = self.served.set(served);
    }

    fn served(&self) -> Option<&Served> {
        self.served.get()
    }
}

#[derive(Clone)]
struct SharedState {
    slots: Arc<[Arc<OutboxSlot>]>,
    metrics: PrometheusHandle,
    /// The admin token. With one, the open pages show the outboxes' names only, not what
    /// `/api/v1/outboxes` needs the token for (each store, a SQLite file's path), and
    /// `/readyz` its reasons to callers that send it only.
    token: Option<outbox_core::redact::Secret>,
}

/// What the shared server shows without the admin token: the probes, the index page and
/// its stylesheet; each outbox's console (under `/outboxes/`) checks the token itself.
fn shared_open(path: &str) -> bool {
    PROBES.contains(&path)
        || path == "/"
        || path == "/assets/app.css"
        || path.starts_with("/outboxes/")
}

impl SharedState {
    fn slot(&self, name: &str) -> Option<&Arc<OutboxSlot>> {
        self.slots.iter().find(|s| s.name == name)
    }
}

/// The one server of `[[outboxes]]`: `/healthz`; `/readyz` ready only when every outbox
/// is, naming the ones that are not; `/metrics` with an `outbox` label on every series; an
/// index of the outboxes at `/` and `/api/v1/outboxes`; and each outbox's dashboard and
/// admin API under `/outboxes/NAME/`. Starts at once: an outbox still waiting for its
/// database shows as starting.
pub async fn serve_outboxes(
    addr: SocketAddr,
    slots: Vec<Arc<OutboxSlot>>,
    metrics: PrometheusHandle,
    token: Option<outbox_core::redact::Secret>,
    hosts: AllowedHosts,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let (listener, bound) = listen(addr).await?;
    let state = SharedState {
        slots: slots.into(),
        metrics,
        token: token.clone(),
    };
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(shared_readyz))
        .route("/metrics", get(shared_metrics))
        .route("/", get(index))
        .route(
            "/assets/app.css",
            get(|| async { crate::admin::stylesheet() }),
        )
        .route("/api/v1/outboxes", get(outbox_list))
        .route("/outboxes/{name}", get(to_outbox_root))
        .route("/outboxes/{name}/", any(forward_root))
        .route("/outboxes/{name}/{*rest}", any(forward))
        .with_state(state)
        .layer(axum::middleware::from_fn_with_state(
            crate::admin::Gate::new(token, shared_open),
            crate::admin::gate,
        ))
        .layer(axum::middleware::from_fn_with_state(hosts, check_host));
    let task = tokio::spawn(serve_bounded(listener, app));
    Ok((bound, task))
}

/// How long the shared server waits for an outbox's runtime to answer a probe.
const OUTBOX_PATIENCE: Duration = Duration::from_secs(5);

async fn shared_readyz(
    State(state): State<SharedState>,
    foreign: Option<axum::Extension<ForeignHost>>,
    headers: HeaderMap,
) -> (StatusCode, String) {
    let shown = Shown::to(state.token.as_ref(), &headers, foreign.is_some());
    let checks = state.slots.iter().map(|slot| async move {
        let Some(served) = slot.served() else {
            return vec![format!(
                "outbox {}: starting (waiting for its database or sinks; see the log)",
                slot.name
            )];
        };
        let probes = served.probes.clone();
        let asked = served
            .runtime
            .spawn(async move { readiness(&probes).await });
        let reasons = match tokio::time::timeout(OUTBOX_PATIENCE, asked).await {
            Ok(Ok(reasons)) => reasons,
            Ok(Err(_)) => vec!["its runtime has stopped".to_string()],
            Err(_) => vec![format!("no answer within {OUTBOX_PATIENCE:?}")],
        };
        reasons
            .into_iter()
            .map(|r| format!("outbox {}: {r}", slot.name))
            .collect()
    });
    let reasons = futures::future::join_all(checks).await.concat();
    verdict(reasons, shown)
}

async fn shared_metrics(State(state): State<SharedState>) -> String {
    for slot in state.slots.iter() {
        if let Some(served) = slot.served() {
            crate::recorder::labelled(&slot.name, || refresh_health_gauges(&served.probes));
        }
    }
    state.metrics.render()
}

async fn outbox_list(State(state): State<SharedState>) -> Response {
    let list: Vec<serde_json::Value> = state
        .slots
        .iter()
        .map(|slot| {
            serde_json::json!({
                "name": slot.name,
                "started": slot.served().is_some(),
                "store": slot.served().map(|s| s.probes.store.describe()),
                "path": format!("/outboxes/{}/", slot.name),
            })
        })
        .collect();
    crate::admin::reply(StatusCode::OK, serde_json::json!({ "outboxes": list }))
}

async fn index(State(state): State<SharedState>) -> Response {
    let items: String = state
        .slots
        .iter()
        .map(|slot| {
            // Names are [a-z0-9_-] (validated), safe in HTML as they are.
            let what = match slot.served() {
                Some(_) if state.token.is_some() => String::new(),
                Some(s) => html_text(&s.probes.store.describe()),
                None => "starting".into(),
            };
            format!(
                "<li><a href=\"/outboxes/{0}/\">{0}</a> <span class=\"muted\">{what}</span></li>",
                slot.name
            )
        })
        .collect();
    let page = format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>outbox-relay</title>\
         <link rel=\"stylesheet\" href=\"/assets/app.css\"></head><body><header>\
         <h1>outbox-relay</h1></header><main><h2>Outboxes</h2><ul id=\"outboxes\">{items}</ul>\
         </main></body></html>"
    );
    crate::admin::asset("text/html; charset=utf-8", page)
}

fn html_text(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

async fn forward_root(
    State(state): State<SharedState>,
    Path(name): Path<String>,
    request: Request,
) -> Response {
    forward_to(&state, &name, "", request).await
}

async fn forward(
    State(state): State<SharedState>,
    Path((name, rest)): Path<(String, String)>,
    request: Request,
) -> Response {
    forward_to(&state, &name, &rest, request).await
}

/// `/outboxes/NAME` to its console's root. A name no outbox has is answered as under the
/// root; redirected, one with a control character failed to make its `Location` (a 500).
async fn to_outbox_root(State(state): State<SharedState>, Path(name): Path<String>) -> Response {
    match state.slot(&name) {
        Some(_) => Redirect::permanent(&format!("/outboxes/{name}/")).into_response(),
        None => no_such_outbox(&state, &name),
    }
}

/// The answer to a name no outbox has. Given before the outbox's own token check: the
/// list only without a token.
fn no_such_outbox(state: &SharedState, name: &str) -> Response {
    let names: Vec<&str> = state.slots.iter().map(|s| s.name.as_str()).collect();
    let listed = match state.token.is_some() {
        true => String::new(),
        false => format!("; the outboxes are {}", names.join(", ")),
    };
    crate::admin::failure(
        StatusCode::NOT_FOUND,
        format!("no outbox named {name:?}{listed}"),
    )
}

/// Hands a request under `/outboxes/NAME/` to that outbox's console, on its runtime.
async fn forward_to(state: &SharedState, name: &str, rest: &str, request: Request) -> Response {
    let refuse = crate::admin::failure;
    let Some(slot) = state.slot(name) else {
        return no_such_outbox(state, name);
    };
    let Some(served) = slot.served() else {
        // The outbox's console checks the token once it runs; until then, here: a route
        // of its API answered without it, if only that the outbox was starting.
        let token = state
            .token
            .as_ref()
            .map(outbox_core::redact::Secret::expose);
        if let Err(refused) = crate::admin::authorize(token, request.method(), request.headers()) {
            return refused;
        }
        return refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("outbox {name} is starting (waiting for its database or sinks; see the log)"),
        );
    };
    let (mut parts, body) = request.into_parts();
    // The console routes afresh: this router's path parameters (name, rest) would otherwise
    // reach its `Path` extractors (`/api/v1/events/{id}` answered 500).
    parts.extensions = axum::http::Extensions::new();
    let query = parts
        .uri
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    parts.uri = match format!("/{rest}{query}").parse() {
        Ok(uri) => uri,
        Err(_) => return refuse(StatusCode::BAD_REQUEST, "invalid path".into()),
    };
    let console = served.console.clone();
    let answered = served
        .runtime
        .spawn(async move { console.oneshot(Request::from_parts(parts, body)).await });
    match answered.await {
        Ok(Ok(response)) => response,
        Ok(Err(never)) => match never {},
        Err(_) => refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("outbox {name} has stopped"),
        ),
    }
}

/// How long a problem lasts before it is logged at error level: transient failures (a
/// deadlock, a restart) are retried and logged as warnings, and only what persists is news.
const REPORT_AFTER: Duration = Duration::from_secs(5);

/// How often the health watcher looks at the database and the sink itself, unless a
/// `/readyz` request looked since: the log and `outbox_health_problems` said nothing of a
/// sink `/readyz` found down (its look was the only one). Seldom, as a sink's look is a
/// request to it (a webhook receiver's `HEAD`); what the relay's own work meets (a publish
/// failing, a claim) is the node's own health, seen at once.
const LOOK_EVERY: Duration = Duration::from_secs(15);

/// Logs every problem `/readyz` would report once it has lasted [`REPORT_AFTER`] (error
/// level, with what to do), and again when it clears: the node's own work's, and those of
/// a look at the database and the sink every [`LOOK_EVERY`] (or a `/readyz` request's, if
/// more recent). Runs until aborted.
pub async fn watch_health(probes: Probes) {
    let mut first_seen: std::collections::HashMap<&'static str, (std::time::Instant, bool)> =
        std::collections::HashMap::new();
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    // The first look after a while: a relay starting looks at both as it starts.
    let first_look = tokio::time::Instant::now() + LOOK_EVERY;
    loop {
        ticker.tick().await;
        let looked = match tokio::time::Instant::now() >= first_look {
            true => looked_within(&probes, LOOK_EVERY).await,
            false => Vec::new(),
        };
        let now = std::time::Instant::now();
        let troubles: Vec<(&'static str, String, Duration)> = (probes.health)
            .troubles(now, DEFAULT_STALL)
            .into_iter()
            .map(|t| (t.what, t.detail.to_string(), t.lasting))
            .chain(
                looked
                    .into_iter()
                    .map(|r| (r.what, r.detail, Duration::ZERO)),
            )
            .collect();
        for (what, detail, lasting) in &troubles {
            let (since, logged) = first_seen
                .entry(what)
                .or_insert((now.checked_sub(*lasting).unwrap_or(now), false));
            if !*logged && now.saturating_duration_since(*since) >= REPORT_AFTER {
                *logged = true;
                tracing::error!(check = *what, problem = %detail, "relay unhealthy: /readyz reports 503 until this clears");
            }
        }
        first_seen.retain(|what, (_, logged)| {
            let still = troubles.iter().any(|(t, _, _)| t == what);
            if !still && *logged {
                tracing::info!(check = *what, "recovered");
            }
            still
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sink's error quoting its receiver's body drove the terminal of whoever ran
    /// `health --ready`, and reached every reader of the open probe as sent.
    #[test]
    fn a_reason_with_control_characters_is_answered_escaped() {
        let (status, body) = verdict(
            vec!["sink webhook: 503 \u{1b}[2Jgone\nforged".into()],
            Shown::Reasons,
        );
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(!body.trim_end().contains(['\u{1b}', '\n']), "{body:?}");
        assert!(body.contains("gone"), "{body:?}");
    }

    #[test]
    fn a_caller_without_the_token_is_told_the_verdict_only() {
        let reasons = || vec!["sink webhook: answered 422: bob@example.com".to_string()];
        let (status, body) = verdict(reasons(), Shown::VerdictOnly);
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(!body.contains("bob@"), "{body:?}");
        assert!(body.starts_with("not ready: 1 problem(s)"), "{body:?}");
        assert_eq!(verdict(Vec::new(), Shown::VerdictOnly).0, StatusCode::OK);
        let token = outbox_core::redact::Secret::new("t");
        let mut headers = HeaderMap::new();
        assert_eq!(
            Shown::to(None, &headers, false),
            Shown::Reasons,
            "no token: loopback"
        );
        assert_eq!(Shown::to(None, &headers, true), Shown::VerdictOnly);
        assert_eq!(Shown::to(Some(&token), &headers, false), Shown::VerdictOnly);
        headers.insert(header::AUTHORIZATION, "Bearer t".parse().unwrap());
        assert_eq!(Shown::to(Some(&token), &headers, false), Shown::Reasons);
        assert_eq!(Shown::to(Some(&token), &headers, true), Shown::VerdictOnly);
    }
}
