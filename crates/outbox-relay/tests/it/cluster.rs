//! Several relay processes over one PostgreSQL database, publishing to a real JetStream,
//! while writers commit and roll back and nodes are killed, stopped, frozen and added.

use std::collections::{HashMap, HashSet};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_testkit::nats::{stream, PrivateNats};
use outbox_testkit::server::ScriptedServer;
use outbox_testkit::{eventually, query_count};
use uuid::Uuid;

use crate::support::{pg, RelayProcess, BIN};

struct Cluster {
    dir: tempfile::TempDir,
    database_url: String,
    nats_url: String,
    ordering: &'static str,
}

impl Cluster {
    fn start_node(&self, name: &str) -> RelayProcess {
        // Each node's connections carry its name, so a test can find and kill them.
        let url = format!("{}?application_name={name}", self.database_url);
        let args = [
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
        RelayProcess::spawn(self.dir.path(), name, &args, &[])
    }
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

#[derive(Default)]
struct Ledger {
    committed: HashMap<String, (String, i64)>, // event id → (key, sequence id)
    rolled_back: HashSet<String>,
}

/// Writer `w` owns keys `w-0..w-9` and commits 1-4 events per transaction, rolling back
/// every fifth; it paces itself so the faults land mid-stream.
async fn writer(
    url: String,
    w: usize,
    transactions: usize,
    ledger: Arc<Mutex<Ledger>>,
    progress: Arc<AtomicUsize>,
) {
    let mut client = pg(&url).await;
    let mut rng = fastrand::Rng::with_seed(w as u64 + 7);
    for t in 0..transactions {
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
                Ok(true) => ledger.committed.extend(rows),
                Ok(false) => ledger
                    .rolled_back
                    .extend(rows.into_iter().map(|(id, _)| id)),
                // A commit whose answer was lost: the test's database restart can do that. Its rows
                // count as committed only if they exist; the checker looks them up at the end.
                Err(_) => ledger
                    .rolled_back
                    .extend(rows.into_iter().map(|(id, _)| format!("unknown:{id}"))),
            }
        }
        progress.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(8)).await; // pacing, not synchronisation
    }
}

/// Reads the whole stream: (event id, key, sequence id) in stream order.
async fn stream_contents(js: &async_nats::jetstream::Context) -> Vec<(String, String, i64)> {
    let mut stream = js.get_stream("ORDERS").await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut out = Vec::new();
    for seq in 1..=last {
        if let Ok(m) = stream.get_raw_message(seq).await {
            let h = |n: &str| {
                m.headers
                    .get(n)
                    .map(|v| v.as_str().to_string())
                    .unwrap_or_default()
            };
            out.push((
                h("Nats-Msg-Id"),
                h("Outbox-Partition-Key"),
                h("Outbox-Sequence-Id").parse().unwrap_or(-1),
            ));
        }
    }
    out
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
    let nats = PrivateNats::with_stream(async_nats::jetstream::stream::Config {
        duplicate_window: Duration::from_secs(600),
        ..stream("ORDERS", &["orders"])
    })
    .await;
    let (nats_url, js) = (nats.url.clone(), nats.js.clone());
    let database_url = match &faults {
        Faults::DatabaseRestart(server) => {
            format!("postgres://postgres@127.0.0.1:{}/postgres", server.port)
        }
        Faults::Nodes => outbox_testkit::fresh_pg_database().await,
    };
    let cluster = Cluster {
        dir: tempfile::tempdir().unwrap(),
        database_url: database_url.clone(),
        nats_url,
        ordering,
    };
    let migrated = Command::new(BIN)
        .args([
            "migrate",
            "--database-url",
            &database_url,
            "--partitions",
            "16",
        ])
        .output()
        .unwrap();
    assert!(
        migrated.status.success(),
        "{}",
        String::from_utf8_lossy(&migrated.stderr)
    );

    let mut nodes: Vec<RelayProcess> = (1..=3)
        .map(|i| cluster.start_node(&format!("relay-{i}")))
        .collect();
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let progress = Arc::new(AtomicUsize::new(0));
    let (writers, per_writer) = (3, 400);
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            tokio::spawn(writer(
                database_url.clone(),
                w,
                per_writer,
                ledger.clone(),
                progress.clone(),
            ))
        })
        .collect();
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

    // The rows whose commit answer was lost: committed if present.
    let mut ledger = std::mem::take(&mut *ledger.lock().unwrap());
    let admin = pg(&database_url).await;
    let unknown: Vec<String> = ledger
        .rolled_back
        .iter()
        .filter_map(|id| id.strip_prefix("unknown:").map(String::from))
        .collect();
    ledger.rolled_back.retain(|id| !id.starts_with("unknown:"));
    for id in unknown {
        ledger.rolled_back.insert(id); // treated as unknown: neither required nor forbidden
    }
    let committed = ledger.committed;
    every_committed_event_reaches_the_stream(&js, &admin, &committed).await;

    no_loss_no_duplicate_no_reordering(&js, &admin, &committed, &ledger.rolled_back, ordering)
        .await;
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

/// Waits until the writers have written `fraction` of their `total` events.
async fn reach(progress: &AtomicUsize, total: usize, fraction: f64) {
    eventually("the writers' progress", Duration::from_secs(120), || {
        let done = progress.load(Ordering::Relaxed) as f64 >= fraction * total as f64;
        async move { done.then_some(()) }
    })
    .await
}

/// As the writers go: relay-1 killed (-9) and restarted, relay-2 stopped (SIGTERM), relay-3
/// frozen past its lease and thawed, relay-4 joining, and relay-4's connections killed.
async fn kill_stop_freeze_join_and_cut_nodes(
    cluster: &Cluster,
    nodes: &mut Vec<RelayProcess>,
    admin: &tokio_postgres::Client,
    progress: &AtomicUsize,
    total: usize,
    ordering: &str,
) {
    reach(progress, total, 0.15).await;
    nodes[0].kill9();
    reach(progress, total, 0.25).await;
    nodes[0] = cluster.start_node("relay-1b");
    reach(progress, total, 0.35).await;
    nodes[1].signal("-TERM");
    let status = nodes[1].wait_exit().await;
    assert!(status.success(), "SIGTERM exits 0: {}", nodes[1].logs());
    reach(progress, total, 0.45).await;
    let frozen: Vec<i32> = admin
        .query(
            "SELECT partition FROM outbox_partitions WHERE owner = 'relay-3'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    nodes[2].signal("-STOP");
    if ordering == "key" {
        assert!(
            !frozen.is_empty(),
            "relay-3 held partitions before it froze"
        );
        // Frozen past its lease: another node takes every partition it had.
        eventually("relay-3's partitions to be taken over", Duration::from_secs(30), || {
            let (admin, frozen) = (&admin, &frozen);
            async move {
                let n = query_count(admin, "SELECT count(*) FROM outbox_partitions
                          WHERE partition = ANY($1) AND owner IS NOT NULL AND owner <> 'relay-3' AND lease_until > now()", &[frozen]).await.unwrap();
                (n as usize == frozen.len()).then_some(())
            }
        })
        .await;
    } else {
        tokio::time::sleep(Duration::from_secs(2)).await; // frozen for a while; nothing to observe
    }
    nodes[2].signal("-CONT");
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
    eventually(
        "relay-4 to connect",
        Duration::from_secs(30),
        || async move {
            let n = query_count(
                admin,
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'relay-4'",
                &[],
            )
            .await
            .unwrap();
            (n > 0).then_some(())
        },
    )
    .await;
    let killed = query_count(admin, "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = 'relay-4'", &[]).await.unwrap();
    assert!(killed > 0, "relay-4 had connections to kill");
}

async fn every_committed_event_reaches_the_stream(
    js: &async_nats::jetstream::Context,
    admin: &tokio_postgres::Client,
    committed: &HashMap<String, (String, i64)>,
) {
    eventually(
        "every committed event in the stream and the outbox empty",
        Duration::from_secs(120),
        || async move {
            let left = query_count(admin, "SELECT count(*) FROM outbox", &[])
                .await
                .ok()?;
            let seen: HashSet<String> = stream_contents(js)
                .await
                .into_iter()
                .map(|(id, _, _)| id)
                .collect();
            (left == 0 && committed.keys().all(|id| seen.contains(id))).then_some(())
        },
    )
    .await;
}

/// The checker: every committed event in the stream, no rolled-back one, no duplicate, and
/// (ordered) each key's first deliveries in sequence order.
async fn no_loss_no_duplicate_no_reordering(
    js: &async_nats::jetstream::Context,
    admin: &tokio_postgres::Client,
    committed: &HashMap<String, (String, i64)>,
    rolled_back: &HashSet<String>,
    ordering: &str,
) {
    let contents = stream_contents(js).await;
    let mut seen = HashSet::new();
    let mut duplicates = 0;
    let mut last: HashMap<String, i64> = HashMap::new();
    for (id, key, seq) in &contents {
        if !seen.insert(id.clone()) {
            duplicates += 1;
            continue;
        }
        if !committed.contains_key(id) {
            // A row the writer saw fail or roll back must never appear, unless its commit's
            // answer was lost (then it may have committed after all).
            let unknown_commit: bool = admin
                .query_opt(
                    "SELECT 1 FROM outbox WHERE event_id = $1::text::uuid",
                    &[id],
                )
                .await
                .unwrap()
                .is_some();
            assert!(
                !unknown_commit || !rolled_back.contains(id),
                "rolled-back event {id} was published"
            );
        }
        if ordering == "key" {
            if let Some(prev) = last.insert(key.clone(), *seq) {
                assert!(
                    prev < *seq,
                    "key {key}: first deliveries went {prev} then {seq}"
                );
            }
        }
    }
    eprintln!(
        "{} committed, {} in the stream, {} duplicates ({} ordering)",
        committed.len(),
        contents.len(),
        duplicates,
        ordering
    );
    assert_eq!(
        duplicates, 0,
        "JetStream's dedupe window drops every redelivery"
    );
    for id in committed.keys() {
        assert!(seen.contains(id));
    }
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
