//! The console's cost (issue 17): the same drain measured without and then with a headless
//! Chromium open on the relay's dashboard, both with the relay's HTTP server on a loopback
//! port, so the only difference is the browser polling the admin API every 2 s.
//!
//! The browser reaches the relay through a small proxy in this process, which counts the
//! status requests that pass (the proof that the page was polling) and, while the relay is
//! not up yet, answers with a page that reloads itself. So Chromium is started, and done
//! starting, before the relay begins to drain: its start-up is not what is measured.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::measure::{f, run_drain};
use crate::Bench;

/// What the proxy answers while the relay is not listening yet: a page that reloads itself.
const WAIT_PAGE: &str =
    r#"<!doctype html><meta http-equiv="refresh" content="0.2"><p>relay starting"#;

/// `chromium` on the PATH, if any.
fn chromium() -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("chromium"))
            .find(|p| p.is_file())
    })
}

/// A free loopback port (the relay binds it a moment later).
fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// What passed through the proxy.
#[derive(Default)]
struct Counts {
    /// Pages served while the relay was not listening.
    waits: AtomicU64,
    status_requests: AtomicU64,
    dashboard_loads: AtomicU64,
}

/// The browser's way to the relay.
struct Proxy {
    addr: SocketAddr,
    counts: Arc<Counts>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start(relay: SocketAddr) -> Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let counts = Arc::new(Counts::default());
        let shared = counts.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let counts = shared.clone();
                tokio::spawn(async move {
                    let _ = forward(client, relay, &counts).await;
                });
            }
        });
        Ok(Proxy { addr, counts, task })
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn occurrences(haystack: &[u8], needle: &[u8]) -> u64 {
    haystack
        .windows(needle.len())
        .filter(|w| *w == needle)
        .count() as u64
}

/// One browser connection: to the relay, counting requests, or the wait page.
async fn forward(mut client: TcpStream, relay: SocketAddr, counts: &Counts) -> Result<()> {
    let Ok(server) = TcpStream::connect(relay).await else {
        let mut request = [0u8; 4096];
        let _ = client.read(&mut request).await;
        let response = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nCache-Control: no-store\r\n\
             Connection: close\r\nContent-Length: {}\r\n\r\n{WAIT_PAGE}",
            WAIT_PAGE.len()
        );
        client.write_all(response.as_bytes()).await?;
        counts.waits.fetch_add(1, Ordering::Relaxed);
        return Ok(());
    };
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let up = async {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = from_client.read(&mut buf).await?;
            if n == 0 {
                return to_server.shutdown().await;
            }
            // A request line arrives in one piece: browsers write a request at once.
            let bytes = &buf[..n];
            counts.status_requests.fetch_add(
                occurrences(bytes, b"GET /api/v1/status "),
                Ordering::Relaxed,
            );
            counts
                .dashboard_loads
                .fetch_add(occurrences(bytes, b"GET / "), Ordering::Relaxed);
            to_server.write_all(bytes).await?;
        }
    };
    let down = tokio::io::copy(&mut from_server, &mut to_client);
    let _ = tokio::join!(up, down);
    Ok(())
}

/// Headless Chromium in a process group of its own, with a private profile directory.
struct Browser {
    child: Child,
    profile: PathBuf,
}

impl Browser {
    fn open(program: &Path, url: &str, profile: PathBuf) -> Result<Browser> {
        use std::os::unix::process::CommandExt;
        std::fs::create_dir_all(&profile)?;
        let child = Command::new(program)
            .args(["--headless=new", "--no-sandbox", "--disable-gpu"])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg(url)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // Its renderers and helpers share the group, so one signal ends them all.
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        Ok(Browser { child, profile })
    }

    fn signal_group(&self, signal: &str) {
        let _ = Command::new("kill")
            .args([signal, "--", &format!("-{}", self.child.id())])
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        self.signal_group("-TERM");
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        self.signal_group("-KILL");
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// One drain of `n` prefilled events to `sink` with the HTTP server on `http`.
async fn drain_with_http(b: &Bench, sink: &str, n: u64, http: &str) -> Result<Value> {
    let db = b.reset().await?;
    b.prefill(&db, "outbox", n, false).await?;
    let file = b.work.join("dashboard-drain.jsonl");
    run_drain(b, &db, sink, &file, n, &["--http-addr", http]).await
}

/// The drain to `sink` without, then with, a browser on the dashboard.
pub async fn drain(b: &Bench, sink: &str) -> Result<Value> {
    let n = b.settings.events;
    let Some(program) = chromium() else {
        let why = "no `chromium` on the PATH (Debian: apt-get install chromium)";
        eprintln!("drain: the dashboard run is skipped: {why}");
        return Ok(json!({ "skipped": why }));
    };
    let relay: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
    let http = relay.to_string();

    eprintln!("drain: relay, {n} events to {sink}, HTTP server on, no browser");
    let without = drain_with_http(b, sink, n, &http).await?;

    let proxy = Proxy::start(relay).await?;
    let url = format!("http://{}/", proxy.addr);
    let browser = Browser::open(&program, &url, b.work.join("chromium-profile"))?;
    // Started and rendering (it has reloaded the wait page) before the backlog is written.
    let deadline = Instant::now() + Duration::from_secs(60);
    while proxy.counts.waits.load(Ordering::Relaxed) < 2 {
        if Instant::now() > deadline {
            bail!("chromium did not load {url} within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "drain: relay, {n} events to {sink}, HTTP server on, headless Chromium on the dashboard"
    );
    let with = drain_with_http(b, sink, n, &http).await?;
    drop(browser);
    let (status_requests, loads) = (
        proxy.counts.status_requests.load(Ordering::Relaxed),
        proxy.counts.dashboard_loads.load(Ordering::Relaxed),
    );
    drop(proxy);
    if loads == 0 || status_requests == 0 {
        bail!("the browser never reached the dashboard ({loads} page loads, {status_requests} status requests)");
    }
    let ratio = with["events_per_s"].as_f64().unwrap_or(0.0)
        / without["events_per_s"].as_f64().unwrap_or(1.0);
    Ok(json!({
        "sink": sink,
        "without_browser": without,
        "with_browser": with,
        "ratio": ratio,
        "status_requests": status_requests,
        "dashboard_loads": loads,
    }))
}

/// The Markdown lines for the dashboard run.
pub fn markdown(r: &Value) -> String {
    let d = &r["drain"]["dashboard"];
    if d.is_null() {
        return String::new();
    }
    if let Some(why) = d["skipped"].as_str() {
        return format!("Dashboard open during the drain: skipped, {why}.\n\n");
    }
    let (without, with) = (&d["without_browser"], &d["with_browser"]);
    format!(
        "Dashboard open during the drain ({} events to the {} sink, the HTTP server on a \
         loopback port in both): {} events/s without a browser, {} events/s with headless \
         Chromium on the dashboard (ratio {}×; the page made {} status requests); relay CPU s \
         per 1M {} and {}, PostgreSQL CPU s {} and {}.\n\n",
        without["events"],
        d["sink"].as_str().unwrap_or(""),
        f(&without["events_per_s"]),
        f(&with["events_per_s"]),
        f(&d["ratio"]),
        d["status_requests"],
        f(&without["relay_cpu_s_per_million"]),
        f(&with["relay_cpu_s_per_million"]),
        f(&without["postgres_cpu_s"]),
        f(&with["postgres_cpu_s"]),
    )
}
