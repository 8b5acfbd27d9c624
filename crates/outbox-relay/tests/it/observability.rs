//! The shipped Grafana dashboard and Prometheus alert rules (`deploy/`), checked with
//! Debian's `prometheus` package: `promtool check rules`, `promtool test rules` (every alert
//! fires and resolves), and a real Prometheus that scrapes running relays (one polling, one
//! with `--capture wal`, one with `--capture binlog`) and is asked, through its HTTP API, for every metric name the
//! dashboard and the alerts use: a misspelt or vanished name fails here. On the relays' real
//! series a dead letter fires its alert, and the liveness and partition alerts stay quiet.
//!
//! Without `promtool` and `prometheus` (`scripts/servers.sh install` installs them) the tests
//! fail, as the console's do without Chromium.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use outbox_testkit::{
    eventually, eventually_explained, fresh_pg_database, query_count, wait_for_count,
};

use crate::support::{
    http_addr, http_get, installed, metric_value, pg, relay, text, wait_for_lines, RelayProcess,
};

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

fn alerts_file() -> PathBuf {
    deploy().join("prometheus/alerts.yml")
}

fn dashboard_file() -> PathBuf {
    deploy().join("grafana/outbox-relay.json")
}

/// Debian's package with `promtool` and `prometheus`.
const PROMETHEUS_PACKAGE: &str = "Debian's prometheus package";

#[track_caller]
fn succeeded(what: &str, out: &Output) -> String {
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{stdout}\n{}",
        out.status,
        text(&out.stderr)
    );
    stdout
}

// ---- promtool ----

#[test]
fn promtool_checks_the_alert_rules() {
    let promtool = installed("promtool", PROMETHEUS_PACKAGE);
    let out = Command::new(promtool)
        .args(["check", "rules"])
        .arg(alerts_file())
        .output()
        .unwrap();
    let stdout = succeeded("promtool check rules", &out);
    let rules = alert_names(&std::fs::read_to_string(alerts_file()).unwrap()).len();
    assert!(
        stdout.contains(&format!("SUCCESS: {rules} rules found")),
        "{stdout}"
    );
}

/// The alert names of a rules file, in order.
fn alert_names(rules: &str) -> Vec<String> {
    rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert:"))
        .map(|name| name.trim().to_string())
        .collect()
}

#[test]
fn promtool_unit_tests_fire_and_resolve_every_alert() {
    let promtool = installed("promtool", PROMETHEUS_PACKAGE);
    let tests = deploy().join("prometheus/alerts_test.yml");
    let out = Command::new(promtool)
        .args(["test", "rules"])
        .arg(&tests)
        .output()
        .unwrap();
    succeeded("promtool test rules", &out);

    // Every alert has a case where it fires and a later one, in the same test group, where
    // it no longer does.
    let cases = alert_cases(&std::fs::read_to_string(&tests).unwrap());
    for alert in alert_names(&std::fs::read_to_string(alerts_file()).unwrap()) {
        let resolves = cases.iter().any(|group| {
            let evals: Vec<&(u32, bool)> = group.get(&alert).into_iter().flatten().collect();
            evals.iter().any(|(fired_at, fires)| {
                *fires && evals.iter().any(|(at, fires)| !*fires && at > fired_at)
            })
        });
        assert!(
            resolves,
            "alerts_test.yml has no case where {alert} fires and then resolves"
        );
    }
}

/// Per test group of a promtool test file: each alert's evaluations, as (minute, fires).
/// Reads the layout alerts_test.yml is written in (`eval_time: Nm`, then `alertname:`, then
/// `exp_alerts:` when it fires).
fn alert_cases(tests: &str) -> Vec<BTreeMap<String, Vec<(u32, bool)>>> {
    let mut groups: Vec<BTreeMap<String, Vec<(u32, bool)>>> = Vec::new();
    let lines: Vec<&str> = tests.lines().map(str::trim).collect();
    for (i, line) in lines.iter().enumerate() {
        if line.starts_with("- interval:") {
            groups.push(BTreeMap::new());
        }
        let Some(minutes) = line
            .strip_prefix("- eval_time:")
            .and_then(|t| t.trim().strip_suffix('m'))
        else {
            continue;
        };
        let minutes: u32 = minutes.parse().expect("eval_time in minutes");
        let alert = lines[i + 1]
            .strip_prefix("alertname:")
            .expect("alertname after eval_time")
            .trim()
            .to_string();
        let fires = lines
            .get(i + 2)
            .is_some_and(|l| l.starts_with("exp_alerts:"));
        groups
            .last_mut()
            .expect("a test group")
            .entry(alert)
            .or_default()
            .push((minutes, fires));
    }
    groups
}

// ---- Metric names in PromQL ----

/// The metric names a PromQL expression selects: identifiers outside label matchers, range
/// and string literals that are no function, keyword or grouping label. Grafana variables
/// (`$job`) are skipped.
fn metric_names(expr: &str) -> BTreeSet<String> {
    const KEYWORDS: &[&str] = &[
        "and", "or", "unless", "offset", "bool", "atan2", "inf", "nan",
    ];
    const GROUPING: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    let chars: Vec<char> = expr.chars().collect();
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    // The index after the bracket that closes the one at `open`, skipping quoted text.
    let close = |open: usize, closing: char| {
        let mut i = open + 1;
        let mut quote = None;
        while i < chars.len() {
            match (quote, chars[i]) {
                (Some(_), '\\') => i += 1,
                (Some(q), c) if c == q => quote = None,
                (None, '"' | '\'' | '`') => quote = Some(chars[i]),
                (None, c) if c == closing => return i + 1,
                _ => {}
            }
            i += 1;
        }
        chars.len()
    };
    let mut names = BTreeSet::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if matches!(c, '"' | '\'' | '`') {
            // A string literal: skip to its end.
            let mut j = i + 1;
            while j < chars.len() && chars[j] != c {
                j += if chars[j] == '\\' { 2 } else { 1 };
            }
            i = j + 1;
        } else if c == '{' {
            i = close(i, '}');
        } else if c == '[' {
            i = close(i, ']');
        } else if c == '$' || c.is_ascii_digit() || c == '.' {
            // A variable, or a number or duration (1e9, 5m).
            i += 1;
            while i < chars.len() && (ident(chars[i]) || matches!(chars[i], '.' | '{' | '}')) {
                i += 1;
            }
        } else if ident(c) {
            let start = i;
            while i < chars.len() && ident(chars[i]) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut next = i;
            while next < chars.len() && chars[next].is_whitespace() {
                next += 1;
            }
            // `sum by (job) (...)`: an aggregation, with its grouping first.
            let rest: String = chars[next..]
                .iter()
                .collect::<String>()
                .to_ascii_lowercase();
            let grouped = ["by", "without"].iter().any(|g| {
                rest.strip_prefix(g)
                    .is_some_and(|after| after.starts_with(|c: char| !ident(c)))
            });
            let paren = chars.get(next) == Some(&'(') || grouped;
            let lower = word.to_ascii_lowercase();
            if GROUPING.contains(&lower.as_str()) {
                if paren {
                    i = close(next, ')');
                }
            } else if !paren && !KEYWORDS.contains(&lower.as_str()) {
                names.insert(word);
            }
        } else {
            i += 1;
        }
    }
    names
}

#[test]
fn metric_names_are_read_out_of_promql() {
    let names = |e: &str| metric_names(e).into_iter().collect::<Vec<_>>();
    assert_eq!(
        names(r#"sum by (job, le) (rate(a_total{job=~"$job", x="}{"}[$__rate_interval])) > 1e9"#),
        ["a_total"]
    );
    assert_eq!(
        names("max without(instance) (a_total) + sum(by_total) - bytes"),
        ["a_total", "by_total", "bytes"]
    );
    assert_eq!(
        names("absent(timestamp(b{check=\"x\"}) - b{check=\"x\"} < 60) or on(job) c offset 5m"),
        ["b", "c"]
    );
    assert_eq!(
        names("max(d) / ignoring (x) group_left e and bool_f"),
        ["bool_f", "d", "e"]
    );
    assert_eq!(names("time() - up"), ["up"]);
}

/// Every `expr` of the dashboard's panels, and the metric of each `label_values(metric, label)`
/// variable query.
fn dashboard_queries(dashboard: &serde_json::Value) -> (Vec<String>, BTreeSet<String>) {
    fn walk(v: &serde_json::Value, exprs: &mut Vec<String>, variables: &mut BTreeSet<String>) {
        match v {
            serde_json::Value::Object(map) => {
                for (key, value) in map {
                    match (key.as_str(), value) {
                        ("expr", serde_json::Value::String(e)) => exprs.push(e.clone()),
                        ("query" | "definition", serde_json::Value::String(q)) => {
                            if let Some(args) = q
                                .trim()
                                .strip_prefix("label_values(")
                                .and_then(|a| a.strip_suffix(')'))
                            {
                                if let Some((metric, _label)) = args.split_once(',') {
                                    variables.extend(metric_names(metric));
                                }
                            }
                        }
                        _ => walk(value, exprs, variables),
                    }
                }
            }
            serde_json::Value::Array(items) => {
                for item in items {
                    walk(item, exprs, variables);
                }
            }
            _ => {}
        }
    }
    let (mut exprs, mut variables) = (Vec::new(), BTreeSet::new());
    walk(dashboard, &mut exprs, &mut variables);
    (exprs, variables)
}

/// What Grafana needs to import the dashboard and lay it out: an id per panel, a query per
/// panel through the data source variable, and panels that fit the 24-column grid without
/// overlapping. (The queries themselves are checked against a real Prometheus below.)
#[test]
fn the_dashboard_is_well_formed() {
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dashboard_file()).unwrap()).unwrap();
    assert_eq!(dashboard["uid"], "outbox-relay");
    assert!(dashboard["schemaVersion"].as_u64().is_some());
    let variables: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(variables, ["datasource", "job"]);
    let panels = dashboard["panels"].as_array().unwrap();
    let mut ids = BTreeSet::new();
    let mut cells: BTreeMap<(u64, u64), String> = BTreeMap::new();
    for panel in panels {
        let title = panel["title"].as_str().unwrap().to_string();
        assert!(
            ids.insert(panel["id"].as_u64().unwrap()),
            "duplicate id: {title}"
        );
        let grid = &panel["gridPos"];
        let [x, y, w, h] = ["x", "y", "w", "h"].map(|k| grid[k].as_u64().unwrap());
        assert!(
            x + w <= 24 && w > 0 && h > 0,
            "{title} does not fit the grid"
        );
        for cell in (x..x + w).flat_map(|cx| (y..y + h).map(move |cy| (cx, cy))) {
            if let Some(other) = cells.insert(cell, title.clone()) {
                panic!("{title} overlaps {other}");
            }
        }
        if panel["type"] == "row" {
            continue;
        }
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title}");
        let targets = panel["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title} has no query");
        let refs: BTreeSet<&str> = targets
            .iter()
            .map(|t| t["refId"].as_str().unwrap())
            .collect();
        assert_eq!(refs.len(), targets.len(), "{title}: refIds repeat");
        for target in targets {
            assert!(
                target["expr"].as_str().is_some_and(|e| e.contains("$job")),
                "{title}: every query selects the chosen jobs: {target}"
            );
        }
    }
}

// ---- A real Prometheus ----

/// GET `path` from `addr` over HTTP/1.0 (so the answer is not chunked); the status and body.
async fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.ok()?;
    let response = String::from_utf8_lossy(&response);
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b)?;
    Some((status, body.to_string()))
}

/// `text` percent-encoded for a query string.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A Prometheus of the test's own: 127.0.0.1, a free port, its own temporary directory;
/// killed on drop if [`Prometheus::stop`] was not reached.
struct Prometheus {
    child: Option<Child>,
    addr: String,
    log: PathBuf,
}

impl Prometheus {
    /// Starts Prometheus scraping `targets` every second as job `outbox-relay`, with the
    /// shipped alert rules evaluated every second; returns once it is ready.
    async fn start(binary: &Path, dir: &Path, targets: &[&str]) -> Prometheus {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let config = dir.join("prometheus.yml");
        let targets: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 rule_files: ['{}']\n\
                 scrape_configs:\n  - job_name: outbox-relay\n    static_configs:\n      - targets: [{}]\n",
                alerts_file().display(),
                targets.join(", ")
            ),
        )
        .unwrap();
        let log = dir.join("prometheus.log");
        let mut child = Command::new(binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start prometheus");
        let ready = eventually_explained(
            "Prometheus to be ready",
            Duration::from_secs(60),
            || std::fs::read_to_string(&log).unwrap_or_default(),
            || {
                let exited = child.try_wait().unwrap();
                let addr = addr.clone();
                async move {
                    if let Some(status) = exited {
                        return Some(Err(status));
                    }
                    match get(&addr, "/-/ready").await {
                        Some((200, _)) => Some(Ok(())),
                        _ => None,
                    }
                }
            },
        )
        .await;
        if let Err(status) = ready {
            panic!(
                "Prometheus exited ({status}):\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        Prometheus {
            child: Some(child),
            addr,
            log,
        }
    }

    /// `GET /api/v1/<path>`'s `data`, panicking on any answer but success.
    async fn api(&self, path: &str) -> serde_json::Value {
        let (status, body) = get(&self.addr, &format!("/api/v1/{path}"))
            .await
            .unwrap_or_else(|| panic!("Prometheus did not answer /api/v1/{path}"));
        let value: serde_json::Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("/api/v1/{path} answered {status} {body}: {e}"));
        assert_eq!(value["status"], "success", "/api/v1/{path}: {body}");
        value["data"].clone()
    }

    /// The series an instant query returns.
    async fn query(&self, promql: &str) -> Vec<serde_json::Value> {
        self.api(&format!("query?query={}", encode(promql))).await["result"]
            .as_array()
            .unwrap()
            .clone()
    }

    /// Every metric name Prometheus holds.
    async fn names(&self) -> BTreeSet<String> {
        self.api("label/__name__/values")
            .await
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect()
    }

    fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, and wait for the exit.
    async fn stop(&mut self) {
        let mut child = self.child.take().expect("running");
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let status = eventually("Prometheus to exit", Duration::from_secs(30), || {
            let s = child.try_wait().unwrap();
            async move { s }
        })
        .await;
        assert!(status.success(), "Prometheus exited with {status}");
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            let logs = self.logs();
            let tail: Vec<&str> = logs.lines().rev().take(30).collect();
            eprintln!(
                "--- prometheus (last lines) ---\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
    }
}

/// A replication slot dropped when the test ends, passed or not: a slot left behind pins WAL
/// for everyone on the server.
async fn insert_events(url: &str, n: usize) {
    let db = pg(url).await;
    for i in 0..n {
        db.execute(
            "INSERT INTO outbox (event_id, destination, partition_key, event_type, payload)
             VALUES ($1, 'orders', $2, 'created', '{}')",
            &[&uuid::Uuid::new_v4(), &format!("key-{i}")],
        )
        .await
        .unwrap();
    }
}

/// Waits until the relay at `addr` exports `name`.
async fn wait_for_metric(relay: &RelayProcess, addr: &str, name: &str) {
    eventually_explained(
        &format!("{name} on the relay's /metrics"),
        Duration::from_secs(30),
        || relay.logs(),
        || async move {
            let (_, body) = http_get(addr, "/metrics").await?;
            metric_value(&body, name).map(|_| ())
        },
    )
    .await
}

/// Makes the relay count a store error: claims wait on a table lock, and the waiting
/// connections are terminated (a connection error is retried, and counted).
async fn cause_store_error(url: &str, relay: &RelayProcess, addr: &str) {
    let admin = pg(url).await;
    eventually_explained(
        "outbox_store_errors_total on the relay's /metrics",
        Duration::from_secs(60),
        || relay.logs(),
        || {
            let admin = &admin;
            async move {
                admin
                    .batch_execute("BEGIN; LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
                    .await
                    .unwrap();
                let waiting = "FROM pg_stat_activity WHERE datname = current_database()
                                 AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'";
                eventually(
                    "a relay statement to wait on the lock",
                    Duration::from_secs(10),
                    || async move {
                        let n = query_count(admin, &format!("SELECT count(*) {waiting}"), &[])
                            .await
                            .unwrap();
                        (n > 0).then_some(())
                    },
                )
                .await;
                admin
                    .batch_execute(&format!("SELECT pg_terminate_backend(pid) {waiting}"))
                    .await
                    .unwrap();
                admin.batch_execute("ROLLBACK").await.unwrap();
                let (_, body) = http_get(addr, "/metrics").await?;
                metric_value(&body, "outbox_store_errors_total").map(|_| ())
            }
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scraping_relays_has_every_metric_the_dashboard_and_the_alerts_use() {
    let prometheus_bin = installed("prometheus", PROMETHEUS_PACKAGE);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut polling = PollingRelay::start(d).await;
    let mut wal = WalRelay::start(d).await;
    let mut binlog = BinlogRelay::start(d).await;
    let prom_dir = d.join("prometheus");
    std::fs::create_dir(&prom_dir).unwrap();
    let targets = [&polling.addr[..], &wal.addr, &binlog.addr];
    let mut prometheus = Prometheus::start(&prometheus_bin, &prom_dir, &targets).await;

    every_relay_is_scraped_with_no_dead_letters_yet(&prometheus, targets.len()).await;
    traffic_makes_every_series(&polling, &wal, &binlog).await;
    let alert_queries = the_shipped_rules_load_and_evaluate(&prometheus).await;
    the_alerts_follow_the_relays_series(&prometheus, &polling.addr).await;
    every_metric_the_dashboard_and_the_alerts_use_exists(&prometheus, &alert_queries).await;

    prometheus.stop().await;
    binlog.process.terminate().await;
    wal.process.terminate().await;
    polling.process.terminate().await;
    drop(wal.slot);
}

/// A polling relay in ordered mode (partitions, nodes) writing to a file.
struct PollingRelay {
    url: String,
    out_dir: std::path::PathBuf,
    events: std::path::PathBuf,
    process: RelayProcess,
    addr: String,
}

impl PollingRelay {
    async fn start(d: &Path) -> PollingRelay {
        let url = fresh_pg_database().await;
        succeeded(
            "migrate",
            &relay(d, &["migrate", "--database-url", &url, "--partitions", "4"]),
        );
        let out_dir = d.join("out");
        std::fs::create_dir(&out_dir).unwrap();
        let events = out_dir.join("events.jsonl");
        let sink = format!("file:{}", events.display());
        let polling = RelayProcess::spawn(
            d,
            "polling",
            &[
                "run",
                "--database-url",
                &url,
                "--sink",
                &sink,
                "--http-addr",
                "127.0.0.1:0",
                "--log-format",
                "json",
                "--poll-interval",
                "100ms",
                "--heartbeat-interval",
                "500ms",
                "--max-attempts",
                "2",
                "--retry-base-delay",
                "50ms",
                "--retry-max-delay",
                "100ms",
            ],
            &[],
        );
        let polling_addr = http_addr(&polling).await;

        PollingRelay {
            url,
            out_dir,
            events,
            process: polling,
            addr: polling_addr,
        }
    }
}

/// A relay reading the WAL of a database of its own, through a slot of its own.
struct WalRelay {
    url: String,
    slot: outbox_testkit::SlotGuard,
    events: std::path::PathBuf,
    process: RelayProcess,
    addr: String,
}

impl WalRelay {
    async fn start(d: &Path) -> WalRelay {
        let url = fresh_pg_database().await;
        let slot = outbox_testkit::SlotGuard {
            url: url.clone(),
            slot: format!("t_{}", uuid::Uuid::new_v4().simple()),
        };
        let (events, process, addr) = capturing(d, "wal", &url, &["--slot", &slot.slot]).await;
        WalRelay {
            url,
            slot,
            events,
            process,
            addr,
        }
    }
}

/// `migrate --capture <capture>` of the database at `url`, then a relay of that capture
/// (with `extra` flags) to the file `<capture>-events.jsonl`: the file, the relay and its
/// HTTP address.
async fn capturing(
    d: &Path,
    capture: &str,
    url: &str,
    extra: &[&str],
) -> (PathBuf, RelayProcess, String) {
    let migrate = ["migrate", "--database-url", url, "--capture", capture];
    succeeded(&format!("migrate --capture {capture}"), &relay(d, &migrate));
    let events = d.join(format!("{capture}-events.jsonl"));
    let sink = format!("file:{}", events.display());
    let mut args = vec!["run", "--database-url", url, "--capture", capture];
    args.extend(extra);
    args.extend(["--sink", &sink]);
    args.extend(["--http-addr", "127.0.0.1:0", "--log-format", "json"]);
    let process = RelayProcess::spawn(d, capture, &args, &[]);
    let addr = http_addr(&process).await;
    (events, process, addr)
}

/// A relay reading the binary log of a MariaDB database of its own.
struct BinlogRelay {
    url: String,
    events: std::path::PathBuf,
    process: RelayProcess,
    addr: String,
}

impl BinlogRelay {
    async fn start(d: &Path) -> BinlogRelay {
        let url = outbox_testkit::fresh_mysql_database().await;
        let (events, process, addr) = capturing(d, "binlog", &url, &[]).await;
        BinlogRelay {
            url,
            events,
            process,
            addr,
        }
    }

    async fn insert_events(&self, n: i64) {
        use mysql_async::prelude::Queryable;
        let pool = mysql_async::Pool::new(mysql_async::Opts::from_url(&self.url).unwrap());
        let mut conn = pool.get_conn().await.unwrap();
        for i in 0..n {
            conn.exec_drop(
                "INSERT INTO outbox (destination, partition_key, event_type, payload)
                 VALUES ('orders', 'k', 'T', JSON_OBJECT('n', ?))",
                (i,),
            )
            .await
            .unwrap();
        }
        drop(conn);
        pool.disconnect().await.unwrap();
    }
}

/// Every relay is scraped, and Prometheus has seen the outbox without dead letters.
async fn every_relay_is_scraped_with_no_dead_letters_yet(prometheus: &Prometheus, relays: usize) {
    eventually_explained(
        "Prometheus to scrape every relay",
        Duration::from_secs(60),
        || prometheus.logs(),
        || {
            let prometheus = &*prometheus;
            async move {
                let targets = prometheus.api("targets").await;
                let up = targets["activeTargets"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter(|t| t["health"] == "up")
                    .count();
                (up == relays).then_some(())
            }
        },
    )
    .await;

    // Prometheus has seen the outbox without dead letters, so that the one made below is
    // growth an alert sees.
    eventually_explained(
        "Prometheus to see no dead letters yet",
        Duration::from_secs(60),
        || prometheus.logs(),
        || {
            let prometheus = &*prometheus;
            async move {
                (!prometheus
                    .query("outbox_dead_letter_events == 0")
                    .await
                    .is_empty())
                .then_some(())
            }
        },
    )
    .await;
}

/// Traffic, so that every series exists.
async fn traffic_makes_every_series(polling: &PollingRelay, wal: &WalRelay, binlog: &BinlogRelay) {
    let (url, events, out_dir) = (&polling.url, &polling.events, &polling.out_dir);
    let (polling_addr, polling) = (&polling.addr, &polling.process);
    let (wal_url, wal_events) = (&wal.url, &wal.events);
    let (wal_addr, wal) = (&wal.addr, &wal.process);
    // Traffic, so that every series exists: deliveries, a failing sink (retries), a row
    // that cannot be decoded (a dead letter), and a failed database operation.
    insert_events(url, 5).await;
    wait_for_lines(
        "the polling relay's deliveries",
        events,
        Duration::from_secs(30),
        |n| n == 5,
    )
    .await;
    // Acked too: lines are in the file before their write's outcome is known (the sink
    // checks that the file is still at its path after the fsync), and a directory removed
    // in between fails that write, which would add the five to the dead letters below.
    let db = pg(url).await;
    let outbox = "SELECT count(*) FROM outbox";
    wait_for_count("the five acked", &db, outbox, 0, Duration::from_secs(30)).await;
    std::fs::remove_dir_all(out_dir).unwrap();
    insert_events(url, 1).await;
    wait_for_metric(polling, polling_addr, "outbox_events_retried_total").await;
    std::fs::create_dir(out_dir).unwrap();
    // Headers that are no JSON object: dead-lettered at once. (A sink that fails alike for
    // every event, as the missing directory above, is an outage: it spends no attempts.)
    db.batch_execute(
        "INSERT INTO outbox (destination, partition_key, event_type, payload, headers)
         VALUES ('orders', 'odd', 'created', '{}', '[1]')",
    )
    .await
    .unwrap();
    wait_for_metric(polling, polling_addr, "outbox_events_dead_lettered_total").await;
    cause_store_error(url, polling, polling_addr).await;
    insert_events(wal_url, 3).await;
    wait_for_lines(
        "the WAL relay's deliveries",
        wal_events,
        Duration::from_secs(30),
        |n| n == 3,
    )
    .await;
    wait_for_metric(wal, wal_addr, "outbox_wal_slot_lag_bytes").await;
    binlog.insert_events(3).await;
    wait_for_lines(
        "the binlog relay's deliveries",
        &binlog.events,
        Duration::from_secs(30),
        |n| n == 3,
    )
    .await;
    wait_for_metric(&binlog.process, &binlog.addr, "outbox_binlog_lag_seconds").await;
}

/// The shipped rules are loaded and evaluate without error; returns their queries.
async fn the_shipped_rules_load_and_evaluate(prometheus: &Prometheus) -> Vec<String> {
    // The shipped rules are loaded and evaluate without error.
    let rules_file = std::fs::read_to_string(alerts_file()).unwrap();
    let shipped: BTreeSet<String> = alert_names(&rules_file).into_iter().collect();
    let alert_queries: Vec<String> = eventually_explained(
        "every shipped alert rule to be loaded and evaluated without error",
        Duration::from_secs(60),
        || prometheus.logs(),
        || {
            let (prometheus, shipped) = (&*prometheus, &shipped);
            async move {
                let groups = prometheus.api("rules").await;
                let rules: Vec<serde_json::Value> = groups["groups"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .flat_map(|g| g["rules"].as_array().unwrap().clone())
                    .collect();
                let loaded: BTreeSet<String> = rules
                    .iter()
                    .map(|r| r["name"].as_str().unwrap().to_string())
                    .collect();
                assert_eq!(&loaded, shipped, "the rules Prometheus loaded");
                for rule in &rules {
                    assert_ne!(
                        rule["health"], "err",
                        "rule {} fails: {}",
                        rule["name"], rule["lastError"]
                    );
                }
                rules.iter().all(|r| r["health"] == "ok").then(|| {
                    rules
                        .iter()
                        .map(|r| r["query"].as_str().unwrap().to_string())
                        .collect()
                })
            }
        },
    )
    .await;

    alert_queries
}

/// The dead letter fires its alert; the liveness, ownership and WAL alerts stay quiet.
async fn the_alerts_follow_the_relays_series(prometheus: &Prometheus, polling_addr: &str) {
    // On the relays' real series: the dead letter fires its alert; every relay counts as live
    // nodes and every partition has an owner, so those alerts are not even pending.
    let firing = eventually_explained(
        "OutboxDeadLettersGrowing to fire",
        Duration::from_secs(60),
        || prometheus.logs(),
        || {
            let prometheus = &*prometheus;
            async move {
                let alerts = prometheus.api("alerts").await;
                alerts["alerts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|a| {
                        a["labels"]["alertname"] == "OutboxDeadLettersGrowing"
                            && a["state"] == "firing"
                    })
                    .cloned()
            }
        },
    )
    .await;
    assert_eq!(firing["labels"]["job"], "outbox-relay", "{firing}");
    assert_eq!(
        firing["value"].as_str().map(|v| v.parse::<f64>().unwrap()),
        Some(1.0),
        "{firing}"
    );
    let live = prometheus
        .query(r#"timestamp(outbox_last_success_timestamp_seconds{check="heartbeat"}) - outbox_last_success_timestamp_seconds{check="heartbeat"} < 60"#)
        .await;
    assert_eq!(
        live.len(),
        3,
        "relays counted live by OutboxNoLiveRelay: {live:?}"
    );
    let partitions = prometheus
        .query(&format!(r#"outbox_partitions{{instance="{polling_addr}"}} == 4 and on() outbox_unowned_partitions{{instance="{polling_addr}"}} == 0"#))
        .await;
    assert_eq!(
        partitions.len(),
        1,
        "4 partitions, none unowned: {partitions:?}"
    );
    let alerts = prometheus.api("alerts").await;
    for alert in alerts["alerts"].as_array().unwrap() {
        assert!(
            ![
                "OutboxNoLiveRelay",
                "OutboxPartitionsUnowned",
                "OutboxWalNotStreaming",
                "OutboxBinlogNotReading",
                "OutboxBinlogLag"
            ]
            .iter()
            .any(|name| alert["labels"]["alertname"] == *name),
            "{alert}"
        );
    }
}

/// The dashboard's queries are valid PromQL, and every metric they or the alerts name exists.
async fn every_metric_the_dashboard_and_the_alerts_use_exists(
    prometheus: &Prometheus,
    alert_queries: &[String],
) {
    // The dashboard's queries are valid PromQL (with Grafana's variables filled in).
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dashboard_file()).unwrap()).unwrap();
    let (exprs, variable_metrics) = dashboard_queries(&dashboard);
    assert!(exprs.len() >= 20, "the dashboard's queries: {exprs:?}");
    for expr in &exprs {
        let query = expr.replace("$__rate_interval", "1m").replace("$job", ".+");
        prometheus
            .api(&format!("query?query={}", encode(&query)))
            .await;
    }

    // Every metric they name exists in Prometheus.
    let mut wanted: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (source, exprs) in [("alert rule", alert_queries), ("dashboard", &exprs[..])] {
        for expr in exprs {
            for name in metric_names(expr) {
                wanted
                    .entry(name)
                    .or_default()
                    .push(format!("{source}: {expr}"));
            }
        }
    }
    for name in variable_metrics {
        wanted
            .entry(name)
            .or_default()
            .push("dashboard variable".into());
    }
    for expected in [
        "outbox_oldest_pending_age_seconds",
        "outbox_unowned_partitions",
        "outbox_wal_slot_lag_bytes",
        "outbox_binlog_reading",
        "outbox_commit_to_confirm_seconds_bucket",
        "up",
    ] {
        assert!(
            wanted.contains_key(expected),
            "{expected} not read out of {wanted:?}"
        );
    }
    let missing = || {
        let wanted = &wanted;
        let prometheus = &*prometheus;
        async move {
            let have = prometheus.names().await;
            wanted
                .iter()
                .filter(|(name, _)| !have.contains(*name))
                .map(|(name, used)| format!("{name} (used by {})", used.join("; ")))
                .collect::<Vec<_>>()
        }
    };
    let waited = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if missing().await.is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    if waited.is_err() {
        panic!(
            "metrics the dashboard or the alerts use that Prometheus does not have after scraping every relay:\n{}",
            missing().await.join("\n")
        );
    }
}
