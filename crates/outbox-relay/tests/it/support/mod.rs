//! What the binary's tests share: starting relay processes, signalling them, reading their
//! logs (printed, and kept on disk, when a test fails), and database clients.

pub mod admin;
pub mod webdriver;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use outbox_testkit::{eventually, eventually_explained};

pub const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

/// Runs `outbox-relay <args>` in `dir`, output captured, no database URL inherited.
pub fn relay(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(args)
        .current_dir(dir)
        .env_remove("DATABASE_URL")
        .env_remove("OUTBOX_RELAY_DATABASE_URL")
        .output()
        .expect("run outbox-relay")
}

/// [`relay`] that must succeed: its stdout and stderr, which a failure shows.
#[track_caller]
pub fn relay_ok(dir: &Path, args: &[&str]) -> String {
    let out = relay(dir, args);
    let said = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(
        out.status.success(),
        "outbox-relay {args:?} failed:\n{said}"
    );
    said
}

/// A fresh PostgreSQL database with the relay's tables (`migrate`); its URL.
pub async fn migrated_pg_database() -> String {
    let url = outbox_testkit::fresh_pg_database().await;
    let migrated = Command::new(BIN)
        .args(["migrate", "--database-url", &url])
        .output()
        .expect("run outbox-relay migrate");
    assert!(migrated.status.success(), "{}", text(&migrated.stderr));
    url
}

/// The path of `program` on PATH. A missing tool fails the test, naming the package
/// `scripts/servers.sh install` installs it from: a test that cannot run must not pass.
#[track_caller]
pub fn installed(program: &str, package: &str) -> PathBuf {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(program))
            .find(|path| path.is_file())
    });
    // Not in a closure: the panic names the test's line (`track_caller`).
    let Some(path) = found else {
        panic!("{program} is missing: run `scripts/servers.sh install` ({package})");
    };
    path
}

/// Process output as text.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A relay process whose stderr (its logs) goes to `<dir>/<name>.log`, appended to (a
/// restarted node's log follows its earlier runs').
pub struct RelayProcess {
    pub name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl RelayProcess {
    /// Runs `outbox-relay <args>` in `dir` with `env` set (and `DATABASE_URL` unset unless
    /// given), stdout discarded.
    pub fn spawn(dir: &Path, name: &str, args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::spawn_build(BIN, dir, name, args, env)
    }

    /// The same, of the relay binary `bin` (another build of it).
    pub fn spawn_build(
        bin: &str,
        dir: &Path,
        name: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let log = dir.join(format!("{name}.log"));
        let mut command = Command::new(bin);
        command
            .args(args)
            .current_dir(dir)
            .env_remove("DATABASE_URL")
            .env_remove("OUTBOX_RELAY_DATABASE_URL")
            .stdout(std::fs::File::create(dir.join(format!("{name}.stdout"))).unwrap())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)
                    .unwrap(),
            );
        for (k, v) in env {
            command.env(k, v);
        }
        let child = command
            .stdin(Stdio::null())
            .spawn()
            .expect("start outbox-relay");
        RelayProcess {
            name: name.to_string(),
            child: Some(child),
            log,
        }
    }

    pub fn pid(&self) -> String {
        self.child.as_ref().expect("running").id().to_string()
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Sends a signal such as `-TERM`, `-STOP` or `-CONT`.
    pub fn signal(&self, signal: &str) {
        assert!(Command::new("kill")
            .args([signal, &self.pid()])
            .status()
            .unwrap()
            .success());
    }

    /// SIGKILL, and reap.
    pub fn kill9(&mut self) {
        let mut child = self.child.take().expect("running");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    pub async fn wait_exit(&mut self) -> ExitStatus {
        self.wait_exit_within(Duration::from_secs(30)).await
    }

    /// Waits for the exit; fails the test if it takes longer than `within`.
    pub async fn wait_exit_within(&mut self, within: Duration) -> ExitStatus {
        let child = self.child.as_mut().expect("running");
        let status = eventually("the relay to exit", within, || {
            let s = child.try_wait().unwrap();
            async move { s }
        })
        .await;
        self.child = None;
        status
    }

    /// SIGTERM, then wait for the exit.
    pub async fn terminate(&mut self) -> ExitStatus {
        self.signal("-TERM");
        self.wait_exit().await
    }

    /// SIGTERM, then wait for the exit; fails the test if it takes longer than `within`.
    pub async fn terminate_within(&mut self, within: Duration) -> ExitStatus {
        self.signal("-TERM");
        self.wait_exit_within(within).await
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the relay's log contains `text`; on timeout the failure shows the log.
    pub async fn wait_for_log(&self, what: &str, within: Duration, text: &str) {
        outbox_testkit::eventually_explained(
            what,
            within,
            || self.logs(),
            || {
                let seen = self.logs().contains(text);
                async move { seen.then_some(()) }
            },
        )
        .await
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = Command::new("kill")
                .args(["-CONT", &child.id().to_string()])
                .status();
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            let keep = std::env::temp_dir().join("outbox-relay-failed-test-logs");
            let _ = std::fs::create_dir_all(&keep);
            let _ = std::fs::copy(&self.log, keep.join(format!("{}.log", self.name)));
            let logs = self.logs();
            let tail: Vec<&str> = logs.lines().rev().take(40).collect();
            eprintln!(
                "--- {} (last lines; whole log kept in {}) ---\n{}",
                self.name,
                keep.display(),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
    }
}

pub async fn pg(url: &str) -> tokio_postgres::Client {
    try_pg(url).await.unwrap()
}

pub async fn try_pg(url: &str) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    Ok(client)
}

/// JSON lines of a sink file; a torn line (from a kill -9 mid-write) is skipped.
/// After `dead retry` of an undecodable event's dead letter: waits until `dead_again` says
/// the relay found it undecodable again, or the sink file `out` holds more than `sent`
/// lines (it was published: the caller's assertion then says so).
pub async fn await_dead_again_or_published<F, Fut>(
    relay: &RelayProcess,
    out: &Path,
    sent: usize,
    dead_again: F,
) where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    eventually_explained(
        "the retried dead letter found undecodable again, or published",
        Duration::from_secs(60),
        || relay.logs(),
        || {
            let again = dead_again();
            async move { (again.await || read_lines(out).len() > sent).then_some(()) }
        },
    )
    .await;
}

/// `run` polling the database at `url` into the file `out`, as node `name`, without HTTP
/// endpoints, with `extra` flags; the process runs in `dir`.
pub fn polling_to_a_file(
    dir: &Path,
    url: &str,
    name: &str,
    out: &Path,
    extra: &[&str],
) -> RelayProcess {
    let sink = format!("file:{}", out.display());
    let mut args = vec![
        "run",
        "--database-url",
        url,
        "--sink",
        &sink,
        "--node-id",
        name,
        "--http-addr",
        "",
    ];
    args.extend(extra);
    RelayProcess::spawn(dir, name, &args, &[])
}

/// The arguments of `run` on the database at `url` to `sink`, then `extra`.
pub fn run_args<'a>(url: &'a str, sink: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["run", "--database-url", url, "--sink", sink];
    args.extend_from_slice(extra);
    args
}

pub fn read_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Waits until the sink file at `path` holds a number of JSON lines that `done` accepts.
pub async fn wait_for_lines(
    what: &str,
    path: &Path,
    timeout: Duration,
    done: impl Fn(usize) -> bool,
) {
    eventually(what, timeout, || {
        let n = read_lines(path).len();
        let ready = done(n);
        async move { ready.then_some(()) }
    })
    .await
}

// ---- Writers, and what reached the broker: for the chaos tests (`faults.rs`) ----

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// What the writers did, by event id.
#[derive(Default)]
pub struct Ledger {
    /// event id → (key, sequence id)
    pub committed: HashMap<String, (String, i64)>,
    pub rolled_back: HashSet<String>,
    /// Events of transactions whose commit answer was lost: neither required nor forbidden.
    pub unknown: HashSet<String>,
}

/// Writer tasks inserting into `outbox` until stopped: writer `w` owns keys `w-0..w-9`,
/// commits 1-4 events per transaction, rolls back every fifth and pauses `pace` in between.
pub struct Writers {
    stop: Arc<AtomicBool>,
    committed: Arc<AtomicUsize>,
    ledger: Arc<Mutex<Ledger>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Writers {
    pub fn start(url: &str, writers: usize, pace: Duration) -> Writers {
        let stop = Arc::new(AtomicBool::new(false));
        let committed = Arc::new(AtomicUsize::new(0));
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let tasks = (0..writers)
            .map(|w| {
                let (url, stop) = (url.to_string(), stop.clone());
                let (committed, ledger) = (committed.clone(), ledger.clone());
                tokio::spawn(async move {
                    let mut rng = fastrand::Rng::with_seed(w as u64 + 7);
                    let mut client = pg(&url).await;
                    let mut t = 0;
                    while !stop.load(Ordering::Relaxed) {
                        if client.is_closed() {
                            // The server may be restarting: try again after the pause.
                            match try_pg(&url).await {
                                Ok(c) => client = c,
                                Err(_) => {
                                    tokio::time::sleep(pace.max(Duration::from_millis(50))).await;
                                    continue;
                                }
                            }
                        }
                        let outcome = write_transaction(&mut client, &mut rng, w, t).await;
                        {
                            let mut ledger = ledger.lock().unwrap();
                            match outcome {
                                Written::Committed(rows) => {
                                    committed.fetch_add(rows.len(), Ordering::Relaxed);
                                    ledger.committed.extend(rows);
                                }
                                Written::RolledBack(ids) => ledger.rolled_back.extend(ids),
                                Written::Unknown(ids) => ledger.unknown.extend(ids),
                            }
                        }
                        t += 1;
                        tokio::time::sleep(pace).await; // pacing, not synchronisation
                    }
                })
            })
            .collect();
        Writers {
            stop,
            committed,
            ledger,
            tasks,
        }
    }

    /// Events committed so far.
    pub fn committed(&self) -> usize {
        self.committed.load(Ordering::Relaxed)
    }

    /// Waits until `n` more events are committed (the writers keep going through faults).
    pub async fn wait_for_more(&self, n: usize) {
        let target = self.committed() + n;
        eventually("the writers' progress", Duration::from_secs(60), || {
            let done = self.committed() >= target;
            async move { done.then_some(()) }
        })
        .await
    }

    pub async fn stop(self) -> Ledger {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.unwrap();
        }
        std::mem::take(&mut *self.ledger.lock().unwrap())
    }
}

enum Written {
    Committed(Vec<(String, (String, i64))>),
    RolledBack(Vec<String>),
    Unknown(Vec<String>),
}

async fn write_transaction(
    client: &mut tokio_postgres::Client,
    rng: &mut fastrand::Rng,
    w: usize,
    t: usize,
) -> Written {
    let Ok(tx) = client.transaction().await else {
        return Written::RolledBack(Vec::new());
    };
    let mut rows = Vec::new();
    for _ in 0..rng.usize(1..=4) {
        let id = uuid::Uuid::new_v4();
        let key = format!("{w}-{}", rng.usize(0..10));
        let inserted = tx
            .query_one(
                "INSERT INTO outbox (event_id, destination, partition_key, event_type, payload)
                 VALUES ($1, 'orders', $2, 'created', jsonb_build_object('w', $3::int, 't', $4::int))
                 RETURNING sequence_id",
                &[&id, &key, &(w as i32), &(t as i32)],
            )
            .await;
        match inserted {
            Ok(row) => rows.push((id.to_string(), (key, row.get::<_, i64>(0)))),
            Err(_) => return Written::RolledBack(rows.into_iter().map(|(id, _)| id).collect()),
        }
    }
    let ids = || rows.iter().map(|(id, _)| id.clone()).collect();
    if t % 5 == 4 {
        let _ = tx.rollback().await;
        return Written::RolledBack(ids());
    }
    match tx.commit().await {
        Ok(()) => Written::Committed(rows),
        Err(_) => Written::Unknown(ids()),
    }
}

/// One message on the broker: its dedupe id, ordering key and outbox sequence id.
#[derive(Clone, Debug)]
pub struct Delivery {
    pub id: String,
    pub key: String,
    pub seq: i64,
}

impl Delivery {
    fn from_headers(headers: Option<&async_nats::HeaderMap>) -> Delivery {
        let header = |name: &str| {
            headers
                .and_then(|h| h.get(name))
                .map(|v| v.as_str().to_string())
                .unwrap_or_default()
        };
        Delivery {
            id: header("Nats-Msg-Id"),
            key: header("Outbox-Partition-Key"),
            seq: header("Outbox-Sequence-Id").parse().unwrap_or(-1),
        }
    }
}

/// Every message published on a subject, redeliveries included, in the order the server
/// passed them on: a core subscription, which JetStream's dedupe does not filter.
pub struct Deliveries {
    log: Arc<Mutex<Vec<Delivery>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Deliveries {
    pub async fn record(client: &async_nats::Client, subject: &str) -> Deliveries {
        let mut subscriber = client.subscribe(subject.to_string()).await.unwrap();
        // The server has the subscription once a flush returns: nothing published later is missed.
        client.flush().await.unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = log.clone();
        let task = tokio::spawn(async move {
            use futures::StreamExt;
            while let Some(message) = subscriber.next().await {
                let delivery = Delivery::from_headers(message.headers.as_ref());
                sink.lock().unwrap().push(delivery);
            }
        });
        Deliveries { log, task }
    }

    pub fn len(&self) -> usize {
        self.log.lock().unwrap().len()
    }

    pub fn snapshot(&self) -> Vec<Delivery> {
        self.log.lock().unwrap().clone()
    }
}

impl Drop for Deliveries {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A JetStream stream's messages in stream order.
pub async fn stream_deliveries(js: &async_nats::jetstream::Context, name: &str) -> Vec<Delivery> {
    let mut stream = js.get_stream(name).await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut out = Vec::new();
    for seq in 1..=last {
        if let Ok(m) = stream.get_raw_message(seq).await {
            out.push(Delivery::from_headers(Some(&m.headers)));
        }
    }
    out
}

/// What a run delivered: distinct events, messages, redeliveries and order.
#[derive(Debug, Default)]
pub struct Figures {
    pub events: usize,
    pub messages: usize,
    /// Messages beyond the first of their event.
    pub duplicates: usize,
    /// The most messages one event produced.
    pub max_copies: usize,
    /// The most same-key events with a later sequence id first delivered before an event
    /// (0: first deliveries are in per-key order).
    pub max_reorder: usize,
    /// Up to five examples of first deliveries out of order.
    pub reordered: Vec<String>,
}

impl Figures {
    pub fn of(deliveries: &[Delivery]) -> Figures {
        let mut copies: HashMap<&str, usize> = HashMap::new();
        let mut firsts: HashMap<&str, Vec<i64>> = HashMap::new();
        for d in deliveries {
            let n = copies.entry(&d.id).or_default();
            *n += 1;
            if *n == 1 {
                firsts.entry(&d.key).or_default().push(d.seq);
            }
        }
        let mut figures = Figures {
            events: copies.len(),
            messages: deliveries.len(),
            duplicates: deliveries.len() - copies.len(),
            max_copies: copies.values().copied().max().unwrap_or(0),
            ..Figures::default()
        };
        for (key, seqs) in firsts {
            for (i, seq) in seqs.iter().enumerate() {
                let ahead = seqs[..i].iter().filter(|s| *s > seq).count();
                if ahead > 0 && figures.reordered.len() < 5 {
                    figures
                        .reordered
                        .push(format!("key {key}: {seq} after {ahead} later events"));
                }
                figures.max_reorder = figures.max_reorder.max(ahead);
            }
        }
        figures
    }
}

// ---- The relay's HTTP endpoints ----

/// `GET path` from the relay's HTTP server at `addr`: the status and the body, or `None`
/// when the server does not answer.
pub async fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response.split("\r\n\r\n").nth(1).unwrap_or_default();
    Some((status, body.to_string()))
}

/// Sends `request` (raw HTTP/1.1, which should say `Connection: close`) to `addr` and reads
/// the reply to its end: the status and the body. Panics when no reply comes within 30 s.
pub async fn http_exchange(addr: &str, request: &str) -> (u16, String) {
    let response = http_response(addr, request).await;
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP reply: {response:?}"));
    let body = response.split("\r\n\r\n").nth(1).unwrap_or_default();
    (status, body.to_string())
}

/// Sends `request` (which must close the connection) to `addr`; returns the whole reply,
/// status line and headers included.
pub async fn http_response(addr: &str, request: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.unwrap();
        String::from_utf8_lossy(&response).into_owned()
    };
    tokio::time::timeout(Duration::from_secs(30), exchange)
        .await
        .unwrap_or_else(|_| panic!("no reply within 30 s to {request:?}"))
}

/// `run` to `sink` with the HTTP endpoints on a free port and JSON logs (so that
/// [`http_addr`] finds them), then `more`.
pub fn run_serving<'a>(sink: &'a str, more: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "run",
        "--sink",
        sink,
        "--http-addr",
        "127.0.0.1:0",
        "--log-format",
        "json",
    ];
    args.extend_from_slice(more);
    args
}

/// Waits until `/readyz` answers `status` with a body that contains `saying` (`""`: any);
/// returns the body.
pub async fn readyz(
    relay: &RelayProcess,
    addr: &str,
    status: u16,
    saying: &str,
    within: Duration,
) -> String {
    eventually_explained(
        &format!("/readyz {status} saying {saying:?}"),
        within,
        || relay.logs(),
        || {
            let addr = addr.to_string();
            async move {
                http_get(&addr, "/readyz")
                    .await
                    .filter(|(s, body)| *s == status && body.contains(saying))
                    .map(|(_, body)| body)
            }
        },
    )
    .await
}

/// The address the relay's HTTP server bound, from its JSON start-up log line (run it with
/// `--http-addr 127.0.0.1:0 --log-format json`).
pub async fn http_addr(relay: &RelayProcess) -> String {
    outbox_testkit::eventually_explained(
        "the relay's HTTP endpoints",
        Duration::from_secs(30),
        || relay.logs(),
        || {
            let addr = relay
                .logs()
                .lines()
                .find(|l| l.contains("HTTP endpoints"))
                .and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .and_then(|v| v["addr"].as_str().map(String::from));
            async move { addr }
        },
    )
    .await
}

/// Names of the process's threads (`/proc/PID/task/*/comm`, 15 characters at most).
pub fn threads(pid: &str) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .collect()
}

/// The value of an unlabelled metric (or the first series of a labelled one) in `/metrics`.
pub fn metric_value(metrics: &str, name: &str) -> Option<f64> {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

// ---- A PostgreSQL server of a test's own ----

const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"))
}

/// Runs a PostgreSQL tool as the postgres user when root (initdb and pg_ctl refuse root).
pub fn as_postgres(program: &str, args: &[&str]) {
    if let Err(e) = run_as_postgres(program, args) {
        panic!("{e}");
    }
}

fn run_as_postgres(program: &str, args: &[&str]) -> Result<(), String> {
    let program = format!("{PG_BIN}/{program}");
    let mut command = if running_as_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--", &program]);
        c
    } else {
        Command::new(&program)
    };
    let out = command.args(args).output().unwrap();
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// A PostgreSQL server of a test's own, for tests that change its settings or restart it
/// (the shared test servers are never restarted); stopped on drop.
pub struct OwnPostgres {
    dir: tempfile::TempDir,
    pub port: u16,
    options: Mutex<String>,
}

impl OwnPostgres {
    pub fn init() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("own-postgres")
            .tempdir()
            .unwrap();
        // The postgres user must reach the directory.
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o777),
        )
        .unwrap();
        let data = dir.path().join("data");
        as_postgres(
            "initdb",
            &[
                "-D",
                data.to_str().unwrap(),
                "-U",
                "postgres",
                "--auth=trust",
            ],
        );
        OwnPostgres {
            dir,
            port: outbox_testkit::server::free_port(),
            options: Mutex::new(String::new()),
        }
    }

    fn data(&self) -> String {
        self.dir.path().join("data").display().to_string()
    }

    /// Starts the server with `options` (`-c name=value ...`) and waits until it answers.
    pub fn start(&self, options: &str) {
        *self.options.lock().unwrap() = options.to_string();
        self.resume();
    }

    /// Stops the server as a crash would (`-m immediate`: connections reset, nothing
    /// said) and starts it again.
    pub fn crash_and_restart(&self) {
        self.stop("immediate");
        // The old server's processes may hold its shared memory for a moment after the
        // stop returns: then the start is refused, and tried again.
        for _ in 0..50 {
            if self.try_resume().is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        self.resume();
    }

    /// Starts it again with the options of the last [`start`](Self::start).
    pub fn resume(&self) {
        if let Err(e) = self.try_resume() {
            panic!("{e}");
        }
    }

    fn try_resume(&self) -> Result<(), String> {
        let options = format!(
            "-c listen_addresses=127.0.0.1 -p {} -k {} {}",
            self.port,
            self.dir.path().display(),
            self.options.lock().unwrap()
        );
        let log = self.dir.path().join("log");
        let data = self.data();
        let started = run_as_postgres(
            "pg_ctl",
            &[
                "-D",
                &data,
                "-l",
                log.to_str().unwrap(),
                "-w",
                "start",
                "-o",
                &options,
            ],
        );
        started.map_err(|e| {
            let log = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(10).collect();
            format!(
                "{e}\nserver log:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            )
        })
    }

    /// Copies the stopped server's data directory aside, as a disk snapshot would.
    pub fn snapshot(&self) {
        let snapshot = self.dir.path().join("snapshot");
        let copied = Command::new("cp")
            .args(["-a", &self.data(), snapshot.to_str().unwrap()])
            .status()
            .unwrap();
        assert!(copied.success());
    }

    /// Puts the stopped server's data directory back as [`snapshot`](Self::snapshot) left
    /// it: the server starts on the same system and timeline, its WAL rolled back.
    pub fn restore_snapshot(&self) {
        std::fs::remove_dir_all(self.data()).unwrap();
        let snapshot = self.dir.path().join("snapshot");
        let copied = Command::new("cp")
            .args(["-a", snapshot.to_str().unwrap(), &self.data()])
            .status()
            .unwrap();
        assert!(copied.success());
    }

    /// Stops the server in `mode` (`immediate`: a crash, as far as its clients can tell).
    pub fn stop(&self, mode: &str) {
        as_postgres("pg_ctl", &["-D", &self.data(), "-m", mode, "-w", "stop"]);
    }

    /// Stops the server in `mode`, failing when it is still up after `within` (pg_ctl's own
    /// wait: a server held by a client is left running then).
    pub fn try_stop(&self, mode: &str, within: Duration) -> Result<(), String> {
        let seconds = within.as_secs().max(1).to_string();
        let data = self.data();
        run_as_postgres(
            "pg_ctl",
            &["-D", &data, "-m", mode, "-t", &seconds, "-w", "stop"],
        )
    }

    /// `pg_ctl stop -m smart` finishes within 15 s while `relay` runs (it probes the server
    /// every 5 s; the shutdown took 5-6 s here), and the relay is still running.
    pub fn assert_a_smart_shutdown_is_not_held(&self, relay: &RelayProcess) {
        let began = std::time::Instant::now();
        let stopped = self.try_stop("smart", Duration::from_secs(15));
        // For the record (BENCHMARKS.md): a figure, not an assertion.
        eprintln!("the smart shutdown took {:?}", began.elapsed());
        assert!(
            stopped.is_ok(),
            "the smart shutdown waited for the relay: {stopped:?}\n{}",
            relay.logs()
        );
        assert!(relay.is_running(), "{}", relay.logs());
    }

    /// Starts the server again after a smart shutdown, and waits until `relay` says it
    /// takes connections again.
    pub async fn resume_and_await(&self, relay: &RelayProcess) {
        self.resume();
        relay
            .wait_for_log(
                "the relay back",
                Duration::from_secs(60),
                "PostgreSQL takes connections again",
            )
            .await;
    }

    pub fn url(&self, sslmode: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres?sslmode={sslmode}",
            self.port
        )
    }

    /// Writes `name` in the server's directory, owned by the user the server runs as.
    pub fn write(&self, name: &str, contents: &[u8], mode: u32) -> String {
        let path = self.dir.path().join(name);
        std::fs::write(&path, contents).unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(mode))
            .unwrap();
        if running_as_root() {
            let uid = |flag: &str| -> u32 {
                let out = Command::new("id")
                    .args([flag, "postgres"])
                    .output()
                    .unwrap();
                String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
            };
            std::os::unix::fs::chown(&path, Some(uid("-u")), Some(uid("-g"))).unwrap();
        }
        path.display().to_string()
    }
}

impl Drop for OwnPostgres {
    fn drop(&mut self) {
        let data = self.data();
        let _ = std::panic::catch_unwind(|| {
            as_postgres("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"])
        });
    }
}

// ---- NATS JetStream ----

/// A JetStream stream on the shared test server (`OUTBOX_TEST_NATS_URL`) capturing
/// `<prefix>.>`, where the prefix (also the stream's name) is new: the context and prefix.
#[cfg(feature = "nats")] // used by the tests of NATS sinks only
pub async fn nats_stream() -> (async_nats::jetstream::Context, String) {
    let url = std::env::var("OUTBOX_TEST_NATS_URL")
        .expect("OUTBOX_TEST_NATS_URL is not set: source /tmp/servers.env");
    let js = async_nats::jetstream::new(async_nats::connect(url).await.unwrap());
    let prefix = format!("t{}", uuid::Uuid::new_v4().simple());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: prefix.clone(),
        subjects: vec![format!("{prefix}.>")],
        ..Default::default()
    })
    .await
    .unwrap();
    (js, prefix)
}

/// How many messages the stream `name` holds.
#[cfg(feature = "nats")] // used by the tests of NATS sinks only
pub async fn stream_len(js: &async_nats::jetstream::Context, name: &str) -> u64 {
    js.get_stream(name)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages
}

/// A NATS JetStream server of the test's own with the stream `ORDERS` (subject `orders`), a
/// recorder of what is published on it, and a fault proxy in front of it: the relay's URL.
pub async fn nats_behind_a_proxy() -> (
    outbox_testkit::nats::PrivateNats,
    Deliveries,
    outbox_testkit::FaultProxy,
    String,
) {
    nats_behind_a_proxy_on("orders").await
}

/// [`nats_behind_a_proxy`] whose stream `ORDERS` captures `subject`.
pub async fn nats_behind_a_proxy_on(
    subject: &str,
) -> (
    outbox_testkit::nats::PrivateNats,
    Deliveries,
    outbox_testkit::FaultProxy,
    String,
) {
    use outbox_testkit::nats::{stream, PrivateNats};
    let nats = PrivateNats::with_stream(async_nats::jetstream::stream::Config {
        duplicate_window: Duration::from_secs(3600),
        ..stream("ORDERS", &[subject])
    })
    .await;
    let nats_url = nats.url.clone();
    let deliveries = Deliveries::record(&nats.client, subject).await;
    let (proxy, broker_url) = outbox_testkit::FaultProxy::start_for_url(&nats_url)
        .await
        .unwrap();
    (nats, deliveries, proxy, broker_url)
}

/// Flags that keep retrying a broker that is away, quickly.
pub const RETRY_AN_OUTAGE: [&str; 8] = [
    "--publish-timeout",
    "2s",
    "--retry-base-delay",
    "50ms",
    "--retry-max-delay",
    "500ms",
    "--max-attempts",
    "100000",
];

/// Reads one request's head and its `content-length` body; the request line's path and the
/// body, `None` if the connection ended first.
pub async fn read_http_request(socket: &mut tokio::net::TcpStream) -> Option<(String, Vec<u8>)> {
    use tokio::io::AsyncReadExt;
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = socket.read(&mut buf).await.ok()?;
        if n == 0 {
            return None;
        }
        seen.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&seen).to_ascii_lowercase();
        if let Some(end) = text.find("\r\n\r\n") {
            let length: usize = text[..end]
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if seen.len() >= end + 4 + length {
                let head = String::from_utf8_lossy(&seen[..end]);
                let path = head.split(' ').nth(1).unwrap_or_default().to_string();
                return Some((path, seen[end + 4..end + 4 + length].to_vec()));
            }
        }
    }
}

/// A drain's flags for a test beside an active relay: a short lease, which is the drain's
/// patience under capture.
pub const STANDBY_DRAIN_FLAGS: [&str; 5] = ["--drain", "--lease", "3s", "--publish-timeout", "2s"];

/// A drain that waits as the active relay's standby says so at once, and again at its exit
/// (1), not that a row was left "leased by another node, or scheduled for later".
pub async fn assert_the_drain_says_it_waited_as_a_standby(drain: &mut RelayProcess) {
    drain
        .wait_for_log(
            "the drain saying it waits as a standby",
            Duration::from_secs(30),
            "this drain delivers nothing unless that relay stops",
        )
        .await;
    let status = drain.wait_exit_within(Duration::from_secs(60)).await;
    let logs = drain.logs();
    assert_eq!(status.code(), Some(1), "{logs}");
    assert!(logs.contains("so this drain read none of it"), "{logs}");
    assert!(!logs.contains("more pending"), "{logs}");
}
