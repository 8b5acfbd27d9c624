//! Several relay processes over one PostgreSQL database, publishing to a real JetStream,
//! while writers commit and roll back and nodes are killed, stopped, frozen and added; and
//! the soak (`soak`, run by `scripts/soak.sh`), which repeats every fault until a million
//! events are written; and a rolling upgrade from an older build
//! (`rolling_upgrade_from_an_older_build`, run by `scripts/rolling-upgrade.sh`).

use std::collections::{HashMap, HashSet};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use outbox_testkit::nats::{stream, PrivateNats};
use outbox_testkit::server::ScriptedServer;
use outbox_testkit::{eventually, query_count};
use uuid::Uuid;

use crate::support::{pg, Ledger, RelayProcess, BIN};

/// How the nodes read the outbox: polling it, or `--capture wal` (one node streams from
/// the replication slot, the others wait as standbys).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Capture {
    Poll,
    Wal,
}

impl Capture {
    fn flags(self) -> &'static [&'static str] {
        match self {
            Capture::Poll => &[],
            Capture::Wal => &["--capture", "wal"],
        }
    }

    fn name(self) -> &'static str {
        match self {
            Capture::Poll => "poll",
            Capture::Wal => "wal",
        }
    }
}

struct Cluster {
    dir: tempfile::TempDir,
    database_url: String,
    nats_url: String,
    ordering: &'static str,
    capture: Capture,
}

impl Cluster {
    fn start_node(&self, name: &str) -> RelayProcess {
        self.start_node_of(BIN, name)
    }

    /// A node of the relay binary `bin` (another build, in the rolling upgrade).
    fn start_node_of(&self, bin: &str, name: &str) -> RelayProcess {
        // Each node's connections carry its name, so a test can find and kill them.
        let url = format!("{}?application_name={name}", self.database_url);
        let mut args = vec![
            "run",
            "--database-url",
            &url,
            "--sink",
            &self.nats_url,
            "--node-id",
            name,
            "--ordering",
            self.ordering,
            "--heartbeat-interval",
            "250ms",
            "--heartbeat-timeout",
            "1500ms",
            "--lease",
            "3s",
            "--publish-timeout",
            "2s",
            "--batch-size",
            "100",
            "--poll-interval",
            "200ms",
            "--http-addr",
            "",
            "--log-format",
            "json",
            "--retry-base-delay",
            "50ms",
            "--retry-max-delay",
            "500ms",
            "--max-attempts",
            "1000",
        ];
        args.extend(self.capture.flags());
        RelayProcess::spawn_build(bin, self.dir.path(), name, &args, &[])
    }

    /// `migrate` (with the capture mode's flags), 16 partitions when polling (WAL capture
    /// leases none, and refuses the setting).
    fn migrate(&self) {
        self.migrate_with(BIN);
    }

    /// `migrate` as the relay binary `bin` runs it.
    fn migrate_with(&self, bin: &str) {
        let migrated = Command::new(bin)
            .args(["migrate", "--database-url", &self.database_url])
            .args(match self.capture {
                Capture::Poll => &["--partitions", "16"][..],
                Capture::Wal => &[],
            })
            .args(self.capture.flags())
            .output()
            .unwrap();
        assert!(
            migrated.status.success(),
            "{}",
            String::from_utf8_lossy(&migrated.stderr)
        );
    }
}

/// A private nats-server with the stream `ORDERS` (subject `orders`), which drops a message
/// whose `Nats-Msg-Id` it stored less than `duplicate_window` ago.
async fn private_nats(duplicate_window: Duration) -> PrivateNats {
    PrivateNats::with_stream(async_nats::jetstream::stream::Config {
        duplicate_window,
        ..stream("ORDERS", &["orders"])
    })
    .await
}

async fn reconnect(url: &str) -> tokio_postgres::Client {
    loop {
        if let Ok((client, connection)) = tokio_postgres::connect(url, tokio_postgres::NoTls).await
        {
            tokio::spawn(connection);
            return client;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// How far the writers got: transactions ended (committed or not) and events committed.
#[derive(Default)]
struct Progress {
    transactions: AtomicUsize,
    committed: AtomicUsize,
}

/// Writer `w` owns keys `w-0..w-9` and commits 1-4 events per transaction, rolling back
/// every fifth; it paces itself so the faults land mid-stream. It stops after `transactions`
/// transactions, or once the writers together committed `events` events.
async fn writer(
    url: String,
    w: usize,
    (transactions, events): (usize, usize),
    ledger: Arc<Mutex<Ledger>>,
    progress: Arc<Progress>,
) {
    let mut client = reconnect(&url).await;
    let mut rng = fastrand::Rng::with_seed(w as u64 + 7);
    for t in 0..transactions {
        if progress.committed.load(Ordering::Relaxed) >= events {
            break;
        }
        if client.is_closed() {
            // The database restarted under us: reconnect.
            client = reconnect(&url).await;
        }
        let Ok(tx) = client.transaction().await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let mut rows = Vec::new();
        let mut failed = false;
        for _ in 0..rng.usize(1..=4) {
            let id = Uuid::new_v4();
            let key = format!("{w}-{}", rng.usize(0..10));
            match tx
                .query_one(
                    "INSERT INTO outbox (event_id, destination, partition_key, event_type, payload)
                     VALUES ($1, 'orders', $2, 'created', jsonb_build_object('w', $3::int, 't', $4::int)) RETURNING sequence_id",
                    &[&id, &key, &(w as i32), &(t as i32)],
                )
                .await
            {
                Ok(row) => rows.push((id.to_string(), (key, row.get::<_, i64>(0)))),
                Err(_) => {
                    failed = true;
                    break;
                }
            }
        }
        let outcome = if failed || t % 5 == 4 {
            tx.rollback().await.map(|_| false)
        } else {
            tx.commit().await.map(|_| true)
        };
        {
            let mut ledger = ledger.lock().unwrap();
            match outcome {
                Ok(true) => {
                    progress.committed.fetch_add(rows.len(), Ordering::Relaxed);
                    ledger.committed.extend(rows);
                }
                Ok(false) => ledger
                    .rolled_back
                    .extend(rows.into_iter().map(|(id, _)| id)),
                // A commit whose answer was lost (a database restart, killed sessions): it
                // may have committed or not, so its events are neither required nor forbidden.
                Err(_) => ledger.unknown.extend(rows.into_iter().map(|(id, _)| id)),
            }
        }
        progress.transactions.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(8)).await; // pacing, not synchronisation
    }
}

/// Starts `writers` writers on `url`; see [`writer`] for when they stop.
fn start_writers(
    url: &str,
    writers: usize,
    limits: (usize, usize),
    ledger: &Arc<Mutex<Ledger>>,
    progress: &Arc<Progress>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..writers)
        .map(|w| {
            tokio::spawn(writer(
                url.to_string(),
                w,
                limits,
                ledger.clone(),
                progress.clone(),
            ))
        })
        .collect()
}

enum Faults {
    /// kill -9 and restart, SIGTERM, SIGSTOP past the lease and SIGCONT, a fourth node,
    /// and one node's connections killed with pg_terminate_backend.
    Nodes,
    /// The whole database restarted mid-run.
    DatabaseRestart(ScriptedServer),
}

async fn scenario(ordering: &'static str, faults: Faults) {
    outbox_testkit::install_crypto();
    let nats = private_nats(Duration::from_secs(600)).await;
    let database_url = match &faults {
        Faults::DatabaseRestart(server) => {
            format!("postgres://postgres@127.0.0.1:{}/postgres", server.port)
        }
        Faults::Nodes => outbox_testkit::fresh_pg_database().await,
    };
    let cluster = Cluster {
        dir: tempfile::tempdir().unwrap(),
        database_url: database_url.clone(),
        nats_url: nats.url.clone(),
        ordering,
        capture: Capture::Poll,
    };
    cluster.migrate();

    let mut nodes: Vec<RelayProcess> = (1..=3)
        .map(|i| cluster.start_node(&format!("relay-{i}")))
        .collect();
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let progress = Arc::new(Progress::default());
    let (writers, per_writer) = (3, 400);
    let tasks = start_writers(
        &database_url,
        writers,
        (per_writer, usize::MAX),
        &ledger,
        &progress,
    );
    let total = writers * per_writer;
    let admin = pg(&database_url).await;

    match &faults {
        Faults::Nodes => {
            kill_stop_freeze_join_and_cut_nodes(
                &cluster, &mut nodes, &admin, &progress, total, ordering,
            )
            .await;
        }
        Faults::DatabaseRestart(server) => {
            reach(&progress, total, 0.4).await;
            server.script("restart-postgres");
        }
    }
    for t in tasks {
        t.await.unwrap();
    }

    let ledger = std::mem::take(&mut *ledger.lock().unwrap());
    let admin = pg(&database_url).await;
    let mut check = StreamCheck::new(&ledger, ordering == "key");
    every_committed_event_reaches_the_stream(
        &mut check,
        &nats.js,
        &admin,
        Duration::from_secs(120),
    )
    .await;
    no_loss_no_duplicate_no_reordering(&check, true);
    if matches!(faults, Faults::Nodes) && ordering == "key" {
        assert!(
            nodes[2].logs().contains("lost partition lease"),
            "the frozen node noticed it lost its partitions"
        );
    }
    for node in nodes.iter_mut().filter(|n| n.is_running()) {
        node.signal("-TERM");
        let status = node.wait_exit().await;
        assert!(status.success(), "{} exits 0", node.name);
    }
}

/// Waits until the writers have ended `fraction` of their `total` transactions.
async fn reach(progress: &Progress, total: usize, fraction: f64) {
    eventually("the writers' progress", Duration::from_secs(120), || {
        let done = progress.transactions.load(Ordering::Relaxed) as f64 >= fraction * total as f64;
        async move { done.then_some(()) }
    })
    .await
}

/// SIGTERM, which the node must answer by exiting 0.
async fn stop_node(node: &mut RelayProcess) {
    node.signal("-TERM");
    let status = node.wait_exit().await;
    assert!(status.success(), "SIGTERM exits 0: {}", node.logs());
}

/// SIGSTOP, until another node holds every partition the frozen one held (polling with
/// `--ordering key`; `must_hold`: it held some), or for a while past its lease; then SIGCONT.
async fn freeze_past_the_lease(
    admin: &tokio_postgres::Client,
    node: &RelayProcess,
    cluster: &Cluster,
    must_hold: bool,
) {
    let watch_partitions = cluster.ordering == "key" && cluster.capture == Capture::Poll;
    let frozen: Vec<i32> = if watch_partitions {
        admin
            .query(
                "SELECT partition FROM outbox_partitions WHERE owner = $1",
                &[&node.name],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    } else {
        Vec::new()
    };
    node.signal("-STOP");
    if watch_partitions && !frozen.is_empty() {
        // Frozen past its lease: another node takes every partition it had.
        eventually("the frozen node's partitions to be taken over", Duration::from_secs(30), || {
            let (admin, frozen, name) = (&admin, &frozen, &node.name);
            async move {
                let n = query_count(admin, "SELECT count(*) FROM outbox_partitions
                          WHERE partition = ANY($1) AND owner IS NOT NULL AND owner <> $2 AND lease_until > now()", &[frozen, name]).await.unwrap();
                (n as usize == frozen.len()).then_some(())
            }
        })
        .await;
    } else {
        assert!(
            !(must_hold && watch_partitions),
            "{} held partitions before it froze",
            node.name
        );
        // Frozen past its 3 s lease; nothing to observe.
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    node.signal("-CONT");
}

/// Waits until the node named `name` is connected, then kills its database sessions
/// (pg_terminate_backend); how many.
async fn cut_sessions(admin: &tokio_postgres::Client, name: &str) -> i64 {
    let connected = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1";
    eventually(
        "the node to connect",
        Duration::from_secs(30),
        || async move {
            let n = query_count(admin, connected, &[&name]).await.unwrap();
            (n > 0).then_some(())
        },
    )
    .await;
    query_count(
        admin,
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1",
        &[&name],
    )
    .await
    .unwrap()
}

/// As the writers go: relay-1 killed (-9) and restarted, relay-2 stopped (SIGTERM), relay-3
/// frozen past its lease and thawed, relay-4 joining, and relay-4's connections killed.
async fn kill_stop_freeze_join_and_cut_nodes(
    cluster: &Cluster,
    nodes: &mut Vec<RelayProcess>,
    admin: &tokio_postgres::Client,
    progress: &Progress,
    total: usize,
    ordering: &str,
) {
    reach(progress, total, 0.15).await;
    nodes[0].kill9();
    reach(progress, total, 0.25).await;
    nodes[0] = cluster.start_node("relay-1b");
    reach(progress, total, 0.35).await;
    stop_node(&mut nodes[1]).await;
    reach(progress, total, 0.45).await;
    freeze_past_the_lease(admin, &nodes[2], cluster, true).await;
    reach(progress, total, 0.6).await;
    nodes.push(cluster.start_node("relay-4"));
    if ordering == "key" {
        // `stats` shows the rebalanced cluster: every partition owned, fair shares.
        let url = cluster.database_url.clone();
        eventually(
            "a fair share for every node in `stats`",
            Duration::from_secs(30),
            || {
                let out = Command::new(BIN)
                    .args(["stats", "--json", "--database-url", &url])
                    .output()
                    .unwrap();
                let stats: serde_json::Value =
                    serde_json::from_slice(&out.stdout).unwrap_or_default();
                let nodes = stats["nodes"].as_array().cloned().unwrap_or_default();
                let shares: Vec<usize> = nodes
                    .iter()
                    .map(|n| n["partitions"].as_array().map_or(0, |p| p.len()))
                    .collect();
                let fair = 16usize.div_ceil(nodes.len().max(1));
                let done = nodes.len() == 3
                    && nodes.iter().any(|n| n["id"] == "relay-4")
                    && shares.iter().sum::<usize>() == 16
                    && shares.iter().all(|s| *s <= fair && *s > 0);
                async move { done.then_some(()) }
            },
        )
        .await;
    }
    reach(progress, total, 0.75).await;
    let killed = cut_sessions(admin, "relay-4").await;
    assert!(killed > 0, "relay-4 had connections to kill");
}

/// What the checker found in the stream.
#[derive(Clone, Copy, Debug, Default)]
struct Figures {
    /// Messages in the stream.
    messages: usize,
    /// Committed events not in the stream.
    lost: usize,
    /// Events of rolled-back transactions in the stream.
    rolled_back_published: usize,
    /// Keys whose first deliveries are out of sequence order (ordered only).
    reordered_keys: usize,
    /// Messages beyond an event's first.
    duplicates: usize,
}

/// The checker. It reads the stream front to back as it grows, each message once (an
/// ordered consumer, headers only), so a stream of a million messages costs a million steps:
/// every committed event in the stream, no rolled-back one, duplicates counted, and
/// (`ordered`) each key's first deliveries in sequence order.
struct StreamCheck<'a> {
    ledger: &'a Ledger,
    ordered: bool,
    messages: Option<async_nats::jetstream::consumer::pull::Ordered>,
    /// The stream sequence read up to.
    read: u64,
    seen: HashSet<String>,
    /// Committed events seen.
    found: usize,
    last: HashMap<String, i64>,
    reordered: HashSet<String>,
    figures: Figures,
}

impl<'a> StreamCheck<'a> {
    fn new(ledger: &'a Ledger, ordered: bool) -> Self {
        StreamCheck {
            ledger,
            ordered,
            messages: None,
            read: 0,
            seen: HashSet::new(),
            found: 0,
            last: HashMap::new(),
            reordered: HashSet::new(),
            figures: Figures::default(),
        }
    }

    /// Reads what the stream holds now that was not read yet.
    async fn read_to_end(&mut self, js: &async_nats::jetstream::Context) {
        let mut stream = js.get_stream("ORDERS").await.unwrap();
        let last = stream.info().await.unwrap().state.last_sequence;
        if self.read >= last {
            return;
        }
        if self.messages.is_none() {
            let consumer = stream
                .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
                    headers_only: true,
                    ..Default::default()
                })
                .await
                .unwrap();
            self.messages = Some(consumer.messages().await.unwrap());
        }
        let mut messages = self.messages.take().unwrap();
        while self.read < last {
            let message = tokio::time::timeout(Duration::from_secs(30), messages.next())
                .await
                .expect("the stream's next message")
                .expect("an open stream")
                .expect("a message");
            let info = message.info().unwrap();
            let when = format!("{:?}", info.published);
            self.read = info.stream_sequence;
            let header = |n: &str| {
                message
                    .headers
                    .as_ref()
                    .and_then(|h| h.get(n))
                    .map(|v| v.as_str().to_string())
                    .unwrap_or_default()
            };
            let (id, key) = (header("Nats-Msg-Id"), header("Outbox-Partition-Key"));
            let seq = header("Outbox-Sequence-Id").parse().unwrap_or(-1);
            self.take(id, key, seq, when);
        }
        self.messages = Some(messages);
    }

    fn take(&mut self, id: String, key: String, seq: i64, when: String) {
        self.figures.messages += 1;
        if self.seen.contains(&id) {
            self.figures.duplicates += 1;
            return;
        }
        // Order by the sequence ids the writers saw: with WAL capture an event that waited
        // for a retry is sent from the parked table, under the parked row's sequence id.
        let (key, seq) = match self.ledger.committed.get(&id) {
            Some((key, seq)) => (key.clone(), *seq),
            None => (key, seq),
        };
        if self.ledger.committed.contains_key(&id) {
            self.found += 1;
        } else if self.ledger.rolled_back.contains(&id) {
            // Events whose commit's answer was lost (`unknown`) may be in the stream or not.
            eprintln!("rolled-back event {id} was published");
            self.figures.rolled_back_published += 1;
        }
        if self.ordered {
            if let Some(prev) = self.last.insert(key.clone(), seq) {
                if prev >= seq && self.reordered.insert(key.clone()) {
                    eprintln!(
                        "key {key}: first deliveries went {prev} then {seq} (stream sequence {}, stored at {when})",
                        self.read
                    );
                }
            }
        }
        self.seen.insert(id);
    }

    fn all_found(&self) -> bool {
        self.found == self.ledger.committed.len()
    }

    fn figures(&self) -> Figures {
        Figures {
            lost: self.ledger.committed.len() - self.found,
            reordered_keys: self.reordered.len(),
            ..self.figures
        }
    }
}

/// Waits (up to `within`) until every committed event is in the stream and the outbox is
/// empty; what is still missing then counts as lost.
async fn every_committed_event_reaches_the_stream(
    check: &mut StreamCheck<'_>,
    js: &async_nats::jetstream::Context,
    admin: &tokio_postgres::Client,
    within: Duration,
) {
    let deadline = Instant::now() + within;
    loop {
        check.read_to_end(js).await;
        let left = query_count(admin, "SELECT count(*) FROM outbox", &[]).await;
        if (check.all_found() && left.as_ref().is_ok_and(|n| *n == 0)) || Instant::now() > deadline
        {
            if !check.all_found() {
                eprintln!(
                    "timed out after {within:?}: {} committed events not in the stream, {left:?} rows in the outbox",
                    check.ledger.committed.len() - check.found
                );
            }
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Fails on a lost event, a rolled-back one published, a key out of order, and (if
/// `duplicates_fail`) a duplicate; the figures.
fn no_loss_no_duplicate_no_reordering(check: &StreamCheck<'_>, duplicates_fail: bool) -> Figures {
    let f = check.figures();
    eprintln!(
        "{} committed, {} in the stream, {f:?} ({} ordering)",
        check.ledger.committed.len(),
        f.messages,
        if check.ordered { "key" } else { "no" }
    );
    assert_eq!(f.lost, 0, "committed events missing from the stream");
    assert_eq!(f.rolled_back_published, 0, "rolled-back events published");
    assert_eq!(
        f.reordered_keys, 0,
        "keys whose first deliveries went out of order"
    );
    if duplicates_fail {
        assert_eq!(
            f.duplicates, 0,
            "JetStream's dedupe window drops every redelivery"
        );
    }
    f
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ordered_cluster_survives_kills_freezes_joins_and_killed_connections() {
    scenario("key", Faults::Nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unordered_cluster_loses_nothing_under_the_same_faults() {
    scenario("none", Faults::Nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ordered_cluster_survives_a_database_restart() {
    let server = ScriptedServer::start("postgres", "OUTBOX_TEST_PG_PORT");
    scenario("key", Faults::DatabaseRestart(server)).await;
}

// ---- The soak (issue 34): scripts/soak.sh ----

/// A number from the environment variable `name`, or `default`.
fn env_number(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v
            .replace(['_', ','], "")
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v} is not a number")),
        Err(_) => default,
    }
}

/// The relay processes this test started (children of its threads) and their resident
/// memory: VmRSS in KiB, by pid.
fn relay_rss_kib(bin: &str) -> Vec<u64> {
    // The kernel keeps a process's name to its first 15 bytes.
    let name: String = std::path::Path::new(bin)
        .file_name()
        .map(|n| n.to_string_lossy().chars().take(15).collect())
        .unwrap_or_default();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    let mut pids: Vec<String> = tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| c.split_whitespace().map(String::from).collect::<Vec<_>>())
        .collect();
    pids.sort();
    pids.dedup();
    pids.iter()
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == name)
        })
        .filter_map(|pid| {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .collect()
}

/// Every node's RSS, sampled every second: (time since the start, the largest node's KiB).
struct RssSampler {
    samples: Arc<Mutex<Vec<(Duration, u64)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl RssSampler {
    /// Samples the children running the relay binary `bin`.
    fn start(since: Instant, bin: &str) -> RssSampler {
        let bin = bin.to_string();
        let samples = Arc::new(Mutex::new(Vec::new()));
        let into = samples.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                if let Some(max) = relay_rss_kib(&bin).into_iter().max() {
                    into.lock().unwrap().push((since.elapsed(), max));
                }
            }
        });
        RssSampler { samples, task }
    }

    /// Peaks in MiB: the first minute's, the last minute's, and the whole run's.
    fn stop(self) -> (f64, f64, f64) {
        self.task.abort();
        let samples = self.samples.lock().unwrap();
        let end = samples.last().map_or(Duration::ZERO, |s| s.0);
        let peak = |keep: &dyn Fn(Duration) -> bool| {
            samples
                .iter()
                .filter(|(t, _)| keep(*t))
                .map(|(_, kib)| *kib)
                .max()
                .unwrap_or(0) as f64
                / 1024.0
        };
        (
            peak(&|t| t < Duration::from_secs(60)),
            peak(&|t| t + Duration::from_secs(60) >= end),
            peak(&|_| true),
        )
    }
}

/// The cluster of the soak: its nodes, the relay binary they run, and a count to name
/// restarted ones (`relay-<slot>-<n>`).
struct SoakNodes {
    nodes: Vec<RelayProcess>,
    bin: String,
    restarts: usize,
}

impl SoakNodes {
    fn restart(&mut self, cluster: &Cluster, i: usize) {
        self.restarts += 1;
        let name = format!("relay-{}-{}", i + 1, self.restarts);
        self.nodes[i] = cluster.start_node_of(&self.bin, &name);
    }
}

/// Prints `soak: HH:MM:SS.mmm UTC <what>`: the faults' times, to set beside the logs'.
fn say(what: &str) {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
        % 86_400_000;
    let (h, m, s) = (ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60);
    eprintln!("soak: {h:02}:{m:02}:{s:02}.{:03} UTC {what}", ms % 1000);
}

/// One round of every fault, a few seconds apart, with the writers going: a node killed
/// (-9) and restarted, one stopped (SIGTERM) and restarted, one frozen past its lease and
/// thawed, one's database sessions killed, a NATS restart and a PostgreSQL restart. Round
/// `r` starts at node `r`, so each fault meets every node in turn (with WAL capture: the
/// streaming one and the standbys).
async fn fault_round(
    r: usize,
    cluster: &Cluster,
    soak: &mut SoakNodes,
    admin: &mut tokio_postgres::Client,
    nats: &PrivateNats,
    postgres: &ScriptedServer,
) {
    let gap = || tokio::time::sleep(Duration::from_secs(3));
    let n = soak.nodes.len();
    let at = |k: usize| (r + k) % n;
    gap().await;
    say(&format!("kill -9 {}", soak.nodes[at(0)].name));
    soak.nodes[at(0)].kill9();
    tokio::time::sleep(Duration::from_secs(1)).await;
    soak.restart(cluster, at(0));
    gap().await;
    say(&format!("SIGTERM {}", soak.nodes[at(1)].name));
    stop_node(&mut soak.nodes[at(1)]).await;
    soak.restart(cluster, at(1));
    gap().await;
    say(&format!("SIGSTOP {}", soak.nodes[at(2)].name));
    freeze_past_the_lease(admin, &soak.nodes[at(2)], cluster, false).await;
    gap().await;
    let name = soak.nodes[at(3)].name.clone();
    say(&format!("pg_terminate_backend {name}"));
    cut_sessions(admin, &name).await;
    gap().await;
    say("NATS restart");
    nats.stop();
    tokio::time::sleep(Duration::from_secs(2)).await;
    nats.resume();
    gap().await;
    say("PostgreSQL restart");
    postgres.script("restart-postgres");
    *admin = reconnect(&cluster.database_url).await;
}

/// An ordered cluster (no node started yet) on a private PostgreSQL and a private NATS
/// whose dedupe window is longer than any run: a redelivery JetStream keeps is one to count.
async fn private_cluster(capture: Capture) -> (ScriptedServer, PrivateNats, Cluster) {
    let postgres = ScriptedServer::start("postgres", "OUTBOX_TEST_PG_PORT");
    let nats = private_nats(Duration::from_secs(24 * 3600)).await;
    // OUTBOX_SOAK_KEEP=1 keeps the nodes' logs (the directory is printed) to trace a failure.
    let keep = std::env::var("OUTBOX_SOAK_KEEP").is_ok_and(|v| v == "1");
    let dir = tempfile::Builder::new()
        .disable_cleanup(keep)
        .tempdir()
        .unwrap();
    if keep {
        eprintln!("soak: the nodes' logs are kept in {}", dir.path().display());
    }
    let cluster = Cluster {
        dir,
        database_url: format!("postgres://postgres@127.0.0.1:{}/postgres", postgres.port),
        nats_url: nats.url.clone(),
        ordering: "key",
        capture,
    };
    (postgres, nats, cluster)
}

/// What the writers committed and what the stream holds, for a summary line:
/// `events=… rolled_back=… unknown=… lost=… rolled_back_published=… reordered_keys=…
/// duplicates=… messages=…`.
fn outcome(ledger: &Ledger, check: &StreamCheck<'_>) -> String {
    let f = check.figures();
    format!(
        "events={} rolled_back={} unknown={} lost={} rolled_back_published={} reordered_keys={} duplicates={} messages={}",
        ledger.committed.len(),
        ledger.rolled_back.len(),
        ledger.unknown.len(),
        f.lost,
        f.rolled_back_published,
        f.reordered_keys,
        f.duplicates,
        f.messages,
    )
}

/// The capture mode named by the environment variable `name` (`poll` unless set).
fn capture_from_env(name: &str) -> Capture {
    match std::env::var(name).as_deref() {
        Err(_) | Ok("poll") => Capture::Poll,
        Ok("wal") => Capture::Wal,
        Ok(other) => panic!("{name}={other}: poll or wal"),
    }
}

/// The soak (issue 34 §2), run by `scripts/soak.sh` (not by CI): a cluster of
/// `OUTBOX_SOAK_NODES` relays (3) on a private PostgreSQL and a private NATS, with
/// `OUTBOX_SOAK_CAPTURE` (`poll`, or `wal`: one node streams, the others stand by), while
/// `OUTBOX_SOAK_WRITERS` writers (12) commit and roll back until `OUTBOX_SOAK_EVENTS`
/// events (1,000,000) are committed, and rounds of every fault ([`fault_round`]) repeat
/// meanwhile. Then every event is checked: nothing lost, no rolled-back event, per-key
/// order of first deliveries, duplicates counted. The nodes' RSS is sampled every second.
/// It prints one line, `soak: capture=… events=… …`, and fails on a loss, a rolled-back
/// event published or a key out of order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "the soak: scripts/soak.sh runs it"]
async fn soak() {
    outbox_testkit::install_crypto();
    let events = env_number("OUTBOX_SOAK_EVENTS", 1_000_000);
    let capture = capture_from_env("OUTBOX_SOAK_CAPTURE");
    let node_count = env_number("OUTBOX_SOAK_NODES", 3).max(1);
    let writers = env_number("OUTBOX_SOAK_WRITERS", 12).max(1);
    let started = Instant::now();

    // Never the shared servers: the soak restarts both.
    let (postgres, nats, cluster) = private_cluster(capture).await;
    cluster.migrate();
    // `OUTBOX_SOAK_RELAY_BIN`: the nodes run that build (scripts/soak.sh sets a release
    // one with OUTBOX_SOAK_RELEASE=1); this test's own build otherwise.
    let bin = std::env::var("OUTBOX_SOAK_RELAY_BIN").unwrap_or_else(|_| BIN.to_string());
    let mut soak = SoakNodes {
        nodes: (1..=node_count)
            .map(|i| cluster.start_node_of(&bin, &format!("relay-{i}")))
            .collect(),
        bin,
        restarts: 0,
    };
    let rss = RssSampler::start(started, &soak.bin);
    say("writers start");
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let progress = Arc::new(Progress::default());
    let tasks = start_writers(
        &cluster.database_url,
        writers,
        (usize::MAX, events),
        &ledger,
        &progress,
    );
    let mut admin = reconnect(&cluster.database_url).await;
    let mut rounds = 0;
    // At least one round, and rounds until the writers are done.
    while rounds == 0 || progress.committed.load(Ordering::Relaxed) < events {
        fault_round(rounds, &cluster, &mut soak, &mut admin, &nats, &postgres).await;
        rounds += 1;
        eprintln!(
            "soak: round {rounds} done at {:.0}s, {} events committed",
            started.elapsed().as_secs_f64(),
            progress.committed.load(Ordering::Relaxed)
        );
    }
    for t in tasks {
        t.await.unwrap();
    }
    say("writers done");
    let written = started.elapsed();
    let ledger = std::mem::take(&mut *ledger.lock().unwrap());
    let mut check = StreamCheck::new(&ledger, true);
    every_committed_event_reaches_the_stream(
        &mut check,
        &nats.js,
        &admin,
        Duration::from_secs(900),
    )
    .await;
    let (first_minute, last_minute, max) = rss.stop();
    println!(
        "soak: capture={} nodes={node_count} writers={writers} {} rounds={rounds} written_in={:.0}s elapsed={:.0}s rss_mb_first_minute_peak={first_minute:.1} rss_mb_last_minute_peak={last_minute:.1} rss_mb_max={max:.1}",
        capture.name(),
        outcome(&ledger, &check),
        written.as_secs_f64(),
        started.elapsed().as_secs_f64(),
    );
    no_loss_no_duplicate_no_reordering(&check, false);
    assert!(max > 0.0, "no relay process was found to sample its RSS");
    for node in &mut soak.nodes {
        stop_node(node).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_leaves_a_partition_with_an_unconfirmed_publish_to_expire() {
    let url = outbox_testkit::fresh_pg_database().await;
    let dir = tempfile::tempdir().unwrap();
    // A webhook endpoint that takes the request and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}/events", listener.local_addr().unwrap());
    let accepted = Arc::new(Mutex::new(Vec::new()));
    let held = accepted.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            held.lock().unwrap().push(socket);
        }
    });
    let migrate = Command::new(BIN)
        .args(["migrate", "--database-url", &url])
        .output()
        .unwrap();
    assert!(migrate.status.success(), "{migrate:?}");
    let db = pg(&url).await;
    db.batch_execute(
        "INSERT INTO outbox (destination, partition_key, event_type, payload)
         VALUES ('d', 'stuck', 't', '{}')",
    )
    .await
    .unwrap();
    let args = [
        "run",
        "--database-url",
        &url,
        "--sink",
        &endpoint,
        "--node-id",
        "n1",
        "--shutdown-timeout",
        "500ms",
        "--http-addr",
        "",
    ];
    let mut relay = RelayProcess::spawn(dir.path(), "n1", &args, &[]);
    eventually(
        "the publish to reach the endpoint",
        Duration::from_secs(30),
        || {
            let reached = !accepted.lock().unwrap().is_empty();
            async move { reached.then_some(()) }
        },
    )
    .await;
    assert!(relay.terminate().await.success(), "{}", relay.logs());
    let stuck = outbox_core::partition_of("stuck", 64);
    let owners: Vec<(i32, Option<String>)> = db
        .query(
            "SELECT partition, owner FROM outbox_partitions ORDER BY partition",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    for (partition, owner) in owners {
        if partition == stuck {
            assert_eq!(
                owner.as_deref(),
                Some("n1"),
                "the broker may still take the publish: the lease must run out first"
            );
        } else {
            assert_eq!(owner, None, "partition {partition} is released at once");
        }
    }
}

/// Two outboxes on one database share the default nodes table. Every ordered node split
/// its outbox's partitions over every live row of that table, so each relay took half of
/// its own partitions and the other half stayed unowned for good: their keys never went out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_of_two_outboxes_sharing_the_nodes_table_each_take_all_their_partitions() {
    let url = outbox_testkit::fresh_pg_database().await;
    let dir = tempfile::tempdir().unwrap();
    for table in ["outbox", "billing"] {
        let migrate = Command::new(BIN)
            .args(["migrate", "--database-url", &url, "--outbox-table", table])
            .output()
            .unwrap();
        assert!(migrate.status.success(), "{migrate:?}");
    }
    let relay = |table: &str, node: &str| {
        let sink = format!("file:{table}.jsonl");
        let args = [
            "run",
            "--node-id",
            node,
            "--heartbeat-interval",
            "200ms",
            "--outbox-table",
            table,
            "--database-url",
            &url,
            "--http-addr",
            "",
            "--sink",
            &sink,
        ];
        RelayProcess::spawn(dir.path(), node, &args, &[])
    };
    let mut orders = relay("outbox", "n1");
    let mut billing = relay("billing", "n2");
    let db = pg(&url).await;
    let db = &db;
    let holds_all = |table: &'static str, node: &'static str| async move {
        let sql = format!(
            "SELECT count(*) FILTER (WHERE owner = $1 AND lease_until > now()) = count(*) FROM {table}"
        );
        db.query_one(sql.as_str(), &[&node])
            .await
            .unwrap()
            .get::<_, bool>(0)
    };
    // Both registered, then five rounds of each (200 ms apart) in which to split.
    let both = "SELECT count(*) FROM outbox_nodes WHERE id IN ('n1', 'n2')";
    eventually("both nodes' rows", Duration::from_secs(60), || async move {
        (query_count(db, both, &[]).await.ok()? == 2).then_some(())
    })
    .await;
    let beats = "SELECT extract(epoch from expiry)::float8 FROM outbox_nodes WHERE id = $1";
    let first = db
        .query_one(beats, &[&"n1"])
        .await
        .unwrap()
        .get::<_, f64>(0);
    eventually(
        "five more heartbeats",
        Duration::from_secs(60),
        || async move {
            let now = db.query_one(beats, &[&"n1"]).await.ok()?.get::<_, f64>(0);
            (now >= first + 1.0).then_some(())
        },
    )
    .await;
    for (table, node) in [("outbox_partitions", "n1"), ("billing_partitions", "n2")] {
        eventually(
            &format!("{node} to hold every partition of {table}"),
            Duration::from_secs(30),
            || async move { holds_all(table, node).await.then_some(()) },
        )
        .await;
    }
    assert!(orders.terminate().await.success(), "{}", orders.logs());
    assert!(billing.terminate().await.success(), "{}", billing.logs());
}

/// A new database with the outbox migrated; its URL.
async fn migrated_outbox() -> String {
    let url = outbox_testkit::fresh_pg_database().await;
    let migrate = Command::new(BIN)
        .args(["migrate", "--database-url", &url])
        .output()
        .unwrap();
    assert!(migrate.status.success(), "{migrate:?}");
    url
}

/// Node `node` of the outbox at `url`, `--ordering ordering`, heartbeating every 200 ms (its
/// row expires 3 s after the last) and writing its events to `events.jsonl` in `dir`.
fn node_to_a_file(dir: &std::path::Path, url: &str, node: &str, ordering: &str) -> RelayProcess {
    node_to_a_file_beating(dir, url, node, ordering, "3s")
}

/// [`node_to_a_file`] whose row and leases last `heartbeat_timeout`.
fn node_to_a_file_beating(
    dir: &std::path::Path,
    url: &str,
    node: &str,
    ordering: &str,
    heartbeat_timeout: &str,
) -> RelayProcess {
    let flags = [
        "--ordering",
        ordering,
        "--heartbeat-interval",
        "200ms",
        "--heartbeat-timeout",
        heartbeat_timeout,
    ];
    crate::support::polling_to_a_file(dir, url, node, &dir.join("events.jsonl"), &flags)
}

/// Partitions added to the partitions table under a running node: the node kept hashing
/// keys by the count it started with, partitions 64 to 127 stayed unowned, a node started
/// after the change hashed by 128 and shared keys with it, and `/readyz` said nothing. The
/// node now stops (exit 1, naming the change), and started again takes the new count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_added_under_a_running_node_stop_it_and_its_restart_takes_the_new_count() {
    let url = migrated_outbox().await;
    let dir = tempfile::tempdir().unwrap();
    let start = || node_to_a_file(dir.path(), &url, "n1", "key");
    let db = pg(&url).await;
    let db = &db;
    let holds = |count: i64| async move {
        let owned =
            "SELECT count(*) FROM outbox_partitions WHERE owner = 'n1' AND lease_until > now()";
        (query_count(db, owned, &[]).await.ok()? == count).then_some(())
    };
    let mut relay = start();
    eventually(
        "n1 to hold the 64 partitions",
        Duration::from_secs(30),
        || holds(64),
    )
    .await;
    db.batch_execute("INSERT INTO outbox_partitions (partition) SELECT generate_series(64, 127)")
        .await
        .unwrap();
    let status = relay.wait_exit_within(Duration::from_secs(30)).await;
    let logs = relay.logs();
    assert_eq!(status.code(), Some(1), "{logs}");
    assert!(
        logs.contains("the partitions table changed under the running relay: it now holds 128 rows, numbered 0 to 127, where this node started with 64 partitions"),
        "{logs}"
    );
    let mut relay = start();
    eventually(
        "n1 to hold the 128 partitions",
        Duration::from_secs(30),
        || holds(128),
    )
    .await;
    db.batch_execute(
        "INSERT INTO outbox (destination, partition_key, event_type, payload)
         SELECT 'orders', 'k' || i, 't', to_jsonb(i) FROM generate_series(1, 200) i",
    )
    .await
    .unwrap();
    crate::support::wait_for_lines(
        "the events written after the restart",
        &dir.path().join("events.jsonl"),
        Duration::from_secs(30),
        |n| n >= 200,
    )
    .await;
    assert!(relay.terminate().await.success(), "{}", relay.logs());
}

/// A node started right after partitions were added, while a node of the old count still
/// ran: it hashed keys by 128 beside a node hashing them by 64 until that one's next round,
/// and shared keys with it (84 and 98 of 8,000 events went out twice in a review, with a
/// 5 s heartbeat). Each ordered node now writes its count in its row, and one that finds a
/// live node of another count takes no partition until that node is gone. The old node is
/// paused (SIGSTOP) across the change, so that it is surely still there when the new one
/// starts; resumed, it sees the change and stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_started_after_the_partitions_changed_waits_for_the_nodes_of_the_old_count() {
    let url = migrated_outbox().await;
    let dir = tempfile::tempdir().unwrap();
    let db = pg(&url).await;
    let db = &db;
    // n1's row outlives the pause: 30 s.
    let mut old = node_to_a_file_beating(dir.path(), &url, "n1", "key", "30s");
    eventually(
        "n1 to hold the 64 partitions",
        Duration::from_secs(30),
        || async move { (partitions_held(db, "n1").await == 64).then_some(()) },
    )
    .await;
    old.signal("-STOP");
    db.batch_execute("INSERT INTO outbox_partitions (partition) SELECT generate_series(64, 127)")
        .await
        .unwrap();
    let mut new = node_to_a_file(dir.path(), &url, "n2", "key");
    new.wait_for_log(
        "n2 waiting for the node of the old count",
        Duration::from_secs(30),
        "waiting for nodes that split keys by another partition count to stop before taking \
         partitions: n1 (64 partitions); this node splits them by 128",
    )
    .await;
    assert_eq!(partitions_held(db, "n2").await, 0, "{}", new.logs());
    old.signal("-CONT");
    let status = old.wait_exit_within(Duration::from_secs(30)).await;
    let logs = old.logs();
    assert_eq!(status.code(), Some(1), "{logs}");
    // The old node is the one behind the table: it stops, and never says it waits for the
    // new one (it did, wrongly, for a round, its count said to be the table's).
    assert!(
        logs.contains("the partitions table changed under the running relay"),
        "{logs}"
    );
    assert!(
        !logs.contains("waiting for nodes that split keys"),
        "{logs}"
    );
    eventually(
        "n2 to hold the 128 partitions",
        Duration::from_secs(30),
        || async move { (partitions_held(db, "n2").await == 128).then_some(()) },
    )
    .await;
    assert!(new.terminate().await.success(), "{}", new.logs());
}

/// Ordered and unordered (`--ordering none`) nodes on one outbox: an ordered claim leases
/// no row, so the unordered node claimed the rows the ordered one held and most events went
/// out twice, and nothing refused the mix. A node of either kind is now refused at its
/// start beside nodes of the other (exit 2), and an unordered node that finds an ordered
/// one while running (the two started together) stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordered_and_unordered_nodes_of_one_outbox_are_never_left_to_run_together() {
    let url = migrated_outbox().await;
    let dir = tempfile::tempdir().unwrap();
    let start = |node: &str, ordering: &str| node_to_a_file(dir.path(), &url, node, ordering);
    // Exits 2, saying `said`.
    async fn refused(relay: &mut RelayProcess, said: &str) {
        let status = relay.wait_exit_within(Duration::from_secs(30)).await;
        let logs = relay.logs();
        assert_eq!(status.code(), Some(2), "{logs}");
        assert!(logs.contains(said), "{logs}");
    }
    let db = pg(&url).await;
    let db = &db;
    let mut ordered = start("n1", "key");
    eventually(
        "n1 to hold partitions",
        Duration::from_secs(30),
        || async move { (partitions_held(db, "n1").await > 0).then_some(()) },
    )
    .await;
    let mut unordered = start("u1", "none");
    refused(
        &mut unordered,
        "this unordered (--ordering none) node would relay the outbox beside node(s) that take \
         its events another way (n1, ordered (polling, --ordering key))",
    )
    .await;
    assert!(ordered.terminate().await.success(), "{}", ordered.logs());

    let mut unordered = start("u1", "none");
    let announced = "SELECT count(*) FROM outbox_nodes WHERE id = 'u1' AND claims = 'unordered'";
    eventually(
        "u1 to say it relays unordered",
        Duration::from_secs(30),
        || async move { (query_count(db, announced, &[]).await.ok()? == 1).then_some(()) },
    )
    .await;
    let mut ordered = start("n2", "key");
    refused(
        &mut ordered,
        "this ordered (polling, --ordering key) node would relay the outbox beside node(s) that \
         take its events another way (u1, unordered (--ordering none))",
    )
    .await;
    assert!(unordered.is_running(), "{}", unordered.logs());

    // An ordered node that announced itself while the unordered one ran (as when the two
    // start together): the unordered one stops.
    db.batch_execute(
        "INSERT INTO outbox_nodes (id, expiry, partitions_table)
         VALUES ('n3', (now() AT TIME ZONE 'UTC') + interval '1 hour', '\"public\".\"outbox_partitions\"')",
    )
    .await
    .unwrap();
    refused(&mut unordered, "(n3, ordered (polling, --ordering key))").await;
    assert!(unordered.logs().contains("stopping (exit 2)"));

    // A node of the other kind that died keeps its row until its expiry: waited out.
    db.batch_execute("DELETE FROM outbox_nodes WHERE id = 'n3'")
        .await
        .unwrap();
    let mut unordered = start("u2", "none");
    let announced = "SELECT count(*) FROM outbox_nodes WHERE id = 'u2' AND claims = 'unordered'";
    eventually(
        "u2 to say it relays unordered",
        Duration::from_secs(30),
        || async move { (query_count(db, announced, &[]).await.ok()? == 1).then_some(()) },
    )
    .await;
    unordered.kill9();
    let mut ordered = start("n4", "key");
    eventually(
        "n4 to hold partitions once u2's row expired",
        Duration::from_secs(30),
        || async move { (partitions_held(db, "n4").await > 0).then_some(()) },
    )
    .await;
    assert!(
        ordered
            .logs()
            .contains("waiting for their heartbeats to move"),
        "{}",
        ordered.logs()
    );
    assert!(ordered.terminate().await.success(), "{}", ordered.logs());
}

// ---- A rolling upgrade with two builds (issue 34 §1): scripts/rolling-upgrade.sh ----

/// Waits until the writers have committed `events` events.
async fn committed(progress: &Progress, events: usize) {
    eventually("the writers' progress", Duration::from_secs(900), || {
        let done = progress.committed.load(Ordering::Relaxed) >= events;
        async move { done.then_some(()) }
    })
    .await
}

/// The cluster protocol in `node`'s row of the nodes table, once the row is there (`None`:
/// a build from before protocol versions, which leaves the column NULL, or a schema from
/// before the column).
async fn protocol_of(admin: &tokio_postgres::Client, node: &str) -> Option<i32> {
    // Read through the row's JSON: an older build's schema has no such column.
    let sql = "SELECT (to_jsonb(n) ->> 'protocol')::int4 FROM outbox_nodes n WHERE n.id = $1";
    eventually("the node's row", Duration::from_secs(60), || async move {
        let rows = admin.query(sql, &[&node]).await.ok()?;
        rows.first().map(|r| r.get::<_, Option<i32>>(0))
    })
    .await
}

/// The partitions `node` holds under a live lease.
async fn partitions_held(admin: &tokio_postgres::Client, node: &str) -> i64 {
    query_count(
        admin,
        "SELECT count(*) FROM outbox_partitions WHERE owner = $1 AND lease_until > now()",
        &[&node],
    )
    .await
    .unwrap()
}

/// Stops the node `old` (SIGTERM: it exits 0) and starts one of this build named `new`.
/// Polling, waits until the new node announces this build's protocol and holds partitions
/// beside `other` (`Some`: a node of the older build still running), so both builds are
/// seen working side by side; with WAL capture, until it has registered.
async fn replace_with_this_build(
    cluster: &Cluster,
    admin: &tokio_postgres::Client,
    old: &mut RelayProcess,
    new: &str,
    other: Option<&str>,
) -> RelayProcess {
    say(&format!("SIGTERM {}, start {new} of this build", old.name));
    stop_node(old).await;
    let node = cluster.start_node(new);
    if cluster.capture == Capture::Wal {
        // No partitions to share: one node streams from the slot, and the protocol (which
        // governs sharing partitions) is not announced. The new node stands by.
        protocol_of(admin, new).await;
        return node;
    }
    // A node registers first and announces its protocol when it asks for partitions.
    let protocol = eventually(
        "the new node's protocol",
        Duration::from_secs(60),
        || async {
            let sql = "SELECT protocol FROM outbox_nodes WHERE id = $1 AND protocol IS NOT NULL";
            let rows = admin.query(sql, &[&new]).await.ok()?;
            rows.first().map(|r| r.get::<_, i32>(0))
        },
    )
    .await;
    assert_eq!(protocol, outbox_core::migration::CLUSTER_PROTOCOL as i32);
    if cluster.capture == Capture::Poll {
        eventually(
            "the new node to hold partitions beside the older one",
            Duration::from_secs(60),
            || async move {
                let mine = partitions_held(admin, new).await;
                let theirs = match other {
                    Some(other) => partitions_held(admin, other).await,
                    None => 1,
                };
                (mine > 0 && theirs > 0).then_some(())
            },
        )
        .await;
    }
    node
}

/// A rolling upgrade from an older build, run by `scripts/rolling-upgrade.sh` (not by CI:
/// it needs a second build of the relay, `OUTBOX_OLDER_RELAY_BIN`). The older build
/// migrates a private PostgreSQL and runs two nodes of an ordered cluster
/// (`OUTBOX_UPGRADE_CAPTURE`: `poll`, or `wal`, where one streams and one stands by) while
/// six writers commit and roll back `OUTBOX_UPGRADE_EVENTS` events (30,000). As the README's
/// "Upgrading" says: this build migrates while the older nodes run, then replaces them one
/// at a time, so nodes of both builds work side by side. Every event is then checked:
/// nothing lost, no rolled-back event, per-key order of first deliveries.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs an older build of the relay: scripts/rolling-upgrade.sh runs it"]
async fn rolling_upgrade_from_an_older_build() {
    outbox_testkit::install_crypto();
    let older = std::env::var("OUTBOX_OLDER_RELAY_BIN")
        .expect("OUTBOX_OLDER_RELAY_BIN: the older build (scripts/rolling-upgrade.sh makes it)");
    let capture = capture_from_env("OUTBOX_UPGRADE_CAPTURE");
    let events = env_number("OUTBOX_UPGRADE_EVENTS", 30_000);
    let started = Instant::now();
    let (_postgres, nats, cluster) = private_cluster(capture).await;
    say("the older build migrates and starts old-1 and old-2");
    cluster.migrate_with(&older);
    let mut nodes = vec![
        cluster.start_node_of(&older, "old-1"),
        cluster.start_node_of(&older, "old-2"),
    ];
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let progress = Arc::new(Progress::default());
    let tasks = start_writers(
        &cluster.database_url,
        6,
        (usize::MAX, events),
        &ledger,
        &progress,
    );
    let admin = reconnect(&cluster.database_url).await;
    assert_eq!(protocol_of(&admin, "old-1").await, None, "an older build");

    committed(&progress, events / 5).await;
    say("this build migrates while the older nodes run");
    cluster.migrate();
    committed(&progress, events * 2 / 5).await;
    nodes[0] =
        replace_with_this_build(&cluster, &admin, &mut nodes[0], "new-1", Some("old-2")).await;
    committed(&progress, events * 3 / 5).await;
    nodes[1] = replace_with_this_build(&cluster, &admin, &mut nodes[1], "new-2", None).await;
    for t in tasks {
        t.await.unwrap();
    }
    say("writers done");

    let ledger = std::mem::take(&mut *ledger.lock().unwrap());
    let mut check = StreamCheck::new(&ledger, true);
    every_committed_event_reaches_the_stream(
        &mut check,
        &nats.js,
        &admin,
        Duration::from_secs(600),
    )
    .await;
    println!(
        "upgrade: capture={} from={older} {} elapsed={:.0}s",
        capture.name(),
        outcome(&ledger, &check),
        started.elapsed().as_secs_f64(),
    );
    no_loss_no_duplicate_no_reordering(&check, false);
    for node in &mut nodes {
        stop_node(node).await;
    }
}
