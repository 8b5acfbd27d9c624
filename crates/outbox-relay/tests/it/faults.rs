//! Network faults between relays and their database and broker (issue 13, section 4).
//!
//! Two or more relay processes share one PostgreSQL database and publish to a real
//! JetStream while writers commit (and roll back) events. Each relay reaches the database and
//! the broker through its own [`FaultProxy`], so one node's links can be delayed, cut,
//! blackholed or made half-open while the others' stay healthy. After every scenario: no
//! committed event is lost, first deliveries are in per-key order, duplicates are counted
//! and bounded, no rolled-back event is published, and every relay still exits cleanly.
//!
//! The defaults keep each test short for CI. `scripts/chaos.sh` runs the long variants by
//! setting these (humantime durations such as `30s`, `5m`):
//!
//! | variable | default | what |
//! |---|---|---|
//! | `OUTBOX_FAULTS_BROKER_DELAY` | 3s | (a) one node's broker link delay |
//! | `OUTBOX_FAULTS_DB_CUT` | 3s | (a) how long that node's database link is cut |
//! | `OUTBOX_FAULTS_DB_BLACKHOLE` | 3s | (b) each blackhole spell |
//! | `OUTBOX_FAULTS_STALE_RECOVERY` | 60s | (b') how long a node may take to get over dead flows |
//! | `OUTBOX_FAULTS_HALF_OPEN` | 3s | (c) each half-open spell |
//! | `OUTBOX_FAULTS_CHURN` | 16s | (d) how long membership keeps changing |
//! | `OUTBOX_FAULTS_CHURN_PERIOD` | 2s | (d) time between changes |
//! | `OUTBOX_FAULTS_SEED` | 1 | (d) which changes, in which order |
//! | `OUTBOX_FAULTS_WRITERS` | 3 | writer tasks (10 keys each) |
//! | `OUTBOX_FAULTS_PACE` | 100ms | each writer's pause between transactions |
//! | `OUTBOX_FAULTS_PUBLISH_TIMEOUT` | 2s | the relays' `--publish-timeout` |
//! | `OUTBOX_FAULTS_FIGURES` | unset | a file each test appends its figures line to |
//! | `OUTBOX_FAULTS_KEEP_LOGS` | unset | keep the relays' logs (the directory is printed) |

use std::collections::HashSet;
use std::process::Command;
use std::time::Duration;

use async_nats::jetstream;
use outbox_testkit::{eventually_explained, query_count, Direction, FaultProxy};
use tokio::time::Instant;

use crate::support::{pg, stream_deliveries, Deliveries, Figures, RelayProcess, Writers, BIN};

const PARTITIONS: i64 = 16;

/// The relays' `--max-in-flight`: the most rows a node holds, so the most events another
/// node can repeat when this one is fenced (published, but the ack never committed).
const MAX_IN_FLIGHT: usize = 200;

fn env_duration(name: &str, default: &str) -> Duration {
    let value = std::env::var(name).unwrap_or_else(|_| default.to_string());
    humantime::parse_duration(&value).unwrap_or_else(|e| panic!("{name}={value}: {e}"))
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name).map_or(default, |v| {
        v.parse().unwrap_or_else(|e| panic!("{name}={v}: {e}"))
    })
}

/// Sleeps until `duration` after `since`: the length of a fault, not a synchronisation.
async fn hold_fault(since: Instant, duration: Duration) {
    tokio::time::sleep_until(since + duration).await;
}

/// One relay process and the two proxies its links go through.
struct Node {
    name: String,
    relay: RelayProcess,
    db: FaultProxy,
    broker: FaultProxy,
}

/// The servers, the relays, a recorder of every message on the broker and the writers'
/// database URL.
struct Rig {
    _nats: outbox_testkit::nats::PrivateNats,
    nats_url: String,
    database_url: String,
    js: jetstream::Context,
    deliveries: Deliveries,
    admin: tokio_postgres::Client,
    nodes: Vec<Node>,
    publish_timeout: String,
    started: Instant,
    /// Last, so that it outlives the nodes: a failing test prints their logs from it.
    dir: tempfile::TempDir,
}

impl Rig {
    async fn start(nodes: usize) -> Rig {
        outbox_testkit::install_crypto();
        let nats = outbox_testkit::nats::PrivateNats::with_stream(jetstream::stream::Config {
            duplicate_window: Duration::from_secs(3600),
            ..outbox_testkit::nats::stream("ORDERS", &["orders"])
        })
        .await;
        let (nats_url, js) = (nats.url.clone(), nats.js.clone());
        let deliveries = Deliveries::record(&nats.client, "orders").await;
        let database_url = outbox_testkit::fresh_pg_database().await;
        let migrated = Command::new(BIN)
            .args(["migrate", "--database-url", &database_url])
            .args(["--partitions", &PARTITIONS.to_string()])
            .output()
            .unwrap();
        assert!(
            migrated.status.success(),
            "{}",
            String::from_utf8_lossy(&migrated.stderr)
        );
        let publish_timeout =
            humantime::format_duration(env_duration("OUTBOX_FAULTS_PUBLISH_TIMEOUT", "2s"))
                .to_string();
        let mut dir = tempfile::Builder::new()
            .prefix("outbox-faults-")
            .tempdir()
            .unwrap();
        if std::env::var_os("OUTBOX_FAULTS_KEEP_LOGS").is_some() {
            dir.disable_cleanup(true);
            eprintln!("relay logs in {}", dir.path().display());
        }
        let mut rig = Rig {
            dir,
            _nats: nats,
            nats_url,
            admin: pg(&database_url).await,
            database_url,
            js,
            deliveries,
            nodes: Vec::new(),
            publish_timeout,
            started: Instant::now(),
        };
        for _ in 0..nodes {
            rig.add_node().await;
        }
        rig
    }

    /// Starts `relay-<n>` behind two new proxies; returns its index.
    async fn add_node(&mut self) -> usize {
        let name = format!("relay-{}", self.nodes.len() + 1);
        let max_in_flight = MAX_IN_FLIGHT.to_string();
        let (db, db_url) = FaultProxy::start_for_url(&self.database_url).await.unwrap();
        let (broker, broker_url) = FaultProxy::start_for_url(&self.nats_url).await.unwrap();
        // The name on its connections, for the database's view of who is connected.
        let db_url = format!("{db_url}?application_name={name}");
        let args = [
            "run",
            "--database-url",
            &db_url,
            "--sink",
            &broker_url,
            "--node-id",
            &name,
            "--heartbeat-interval",
            "250ms",
            "--heartbeat-timeout",
            "1500ms",
            "--lease",
            "3s",
            "--batch-size",
            "100",
            "--max-in-flight",
            &max_in_flight,
            "--poll-interval",
            "200ms",
            "--publish-timeout",
            &self.publish_timeout,
            "--shutdown-timeout",
            "5s",
            "--http-addr",
            "",
            "--log-format",
            "json",
            "--retry-base-delay",
            "50ms",
            "--retry-max-delay",
            "500ms",
            "--max-attempts",
            "100000",
        ];
        let relay = RelayProcess::spawn(self.dir.path(), &name, &args, &[]);
        self.nodes.push(Node {
            name,
            relay,
            db,
            broker,
        });
        self.nodes.len() - 1
    }

    fn say(&self, what: &str) {
        eprintln!("[{:>6.1}s] {what}", self.started.elapsed().as_secs_f64());
    }

    fn running(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|i| self.nodes[*i].relay.is_running())
            .collect()
    }

    async fn partitions_of(&self, node: usize) -> Vec<i32> {
        self.admin
            .query(
                "SELECT partition FROM outbox_partitions WHERE owner = $1 AND lease_until > now()",
                &[&self.nodes[node].name],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    /// Waits until the running nodes, and only they, hold every partition (the assignment
    /// settled after a change).
    async fn wait_balanced(&self) {
        let running: HashSet<String> = self
            .running()
            .into_iter()
            .map(|i| self.nodes[i].name.clone())
            .collect();
        let admin = &self.admin;
        eventually_explained(
            "every partition held by the running nodes, each holding some",
            Duration::from_secs(60),
            || format!("running: {running:?}"),
            || {
                let running = &running;
                async move {
                    let rows = admin
                        .query(
                            "SELECT owner, count(*) FROM outbox_partitions
                              WHERE owner IS NOT NULL AND lease_until > now() GROUP BY owner",
                            &[],
                        )
                        .await
                        .ok()?;
                    let owners: HashSet<String> = rows.iter().map(|r| r.get(0)).collect();
                    let held: i64 = rows.iter().map(|r| r.get::<_, i64>(1)).sum();
                    (owners == *running && held == PARTITIONS).then_some(())
                }
            },
        )
        .await;
    }

    /// Waits until nodes other than `node` hold every partition `node` held: the cluster
    /// noticed that `node` is gone.
    async fn wait_taken_over(&self, node: usize, partitions: &[i32]) {
        let (admin, name) = (&self.admin, &self.nodes[node].name);
        eventually_explained(
            &format!("{name}'s partitions to be taken over"),
            Duration::from_secs(60),
            || self.nodes[node].relay.logs(),
            || async move {
                let n = query_count(
                    admin,
                    "SELECT count(*) FROM outbox_partitions
                          WHERE partition = ANY($1) AND owner <> $2 AND lease_until > now()",
                    &[&partitions, name],
                )
                .await
                .ok()?;
                (n as usize == partitions.len()).then_some(())
            },
        )
        .await;
    }

    /// Waits until `n` more messages reach the broker: delivery goes on.
    async fn wait_delivered_more(&self, n: usize) {
        let target = self.deliveries.len() + n;
        eventually_explained(
            "more deliveries",
            Duration::from_secs(60),
            || self.tails(),
            || {
                let done = self.deliveries.len() >= target;
                async move { done.then_some(()) }
            },
        )
        .await;
    }

    fn tails(&self) -> String {
        let mut out = String::new();
        for node in &self.nodes {
            let logs = node.relay.logs();
            let tail: Vec<&str> = logs.lines().rev().take(15).collect();
            out += &format!("--- {} ---\n", node.name);
            for line in tail.into_iter().rev() {
                out += line;
                out.push('\n');
            }
        }
        out
    }

    /// Stops the writers, heals every link, waits for the outbox to drain, checks what the
    /// broker got, prints the figures and stops the relays. `max_duplicates` is the bound
    /// this scenario's faults justify.
    async fn finish(mut self, scenario: &str, writers: Writers, max_duplicates: usize) -> Figures {
        let ledger = writers.stop().await;
        for node in &self.nodes {
            node.db.heal();
            node.broker.heal();
        }
        if self.running().len() < 2 {
            self.add_node().await;
        }
        let committed = &ledger.committed;
        self.say(&format!("{} events committed; draining", committed.len()));
        let (admin, deliveries) = (&self.admin, &self.deliveries);
        eventually_explained(
            "every committed event on the broker and the outbox empty",
            Duration::from_secs(120),
            || {
                let seen: HashSet<String> =
                    deliveries.snapshot().into_iter().map(|d| d.id).collect();
                let missing = committed.keys().filter(|id| !seen.contains(*id)).count();
                format!("{missing} committed events missing\n{}", self.tails())
            },
            || async move {
                let left = query_count(admin, "SELECT count(*) FROM outbox", &[])
                    .await
                    .ok()?;
                let seen: HashSet<String> =
                    deliveries.snapshot().into_iter().map(|d| d.id).collect();
                (left == 0 && committed.keys().all(|id| seen.contains(id))).then_some(())
            },
        )
        .await;
        let dead = query_count(admin, "SELECT count(*) FROM outbox_dead_letters", &[])
            .await
            .unwrap();
        assert_eq!(dead, 0, "nothing is dead-lettered");

        let messages = self.deliveries.snapshot();
        let figures = Figures::of(&messages);
        let stream = stream_deliveries(&self.js, "ORDERS").await;
        let stored = Figures::of(&stream);
        let lost_leases: usize = self
            .nodes
            .iter()
            .map(|n| n.relay.logs().matches("lost partition lease").count())
            .sum();
        let line = format!(
            "FIGURES scenario={scenario} events={} committed={} messages={} duplicates={} \
             max_copies={} max_reorder={} stream={} stream_max_reorder={} nodes={} \
             lost_partition_leases={lost_leases} elapsed={:.1}s",
            figures.events,
            committed.len(),
            figures.messages,
            figures.duplicates,
            figures.max_copies,
            figures.max_reorder,
            stored.messages,
            stored.max_reorder,
            self.nodes.len(),
            self.started.elapsed().as_secs_f64(),
        );
        eprintln!("{line}");
        if let Ok(path) = std::env::var("OUTBOX_FAULTS_FIGURES") {
            use std::io::Write;
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .unwrap();
            writeln!(file, "{line}").unwrap();
        }

        // Nothing lost, nothing invented.
        let on_broker: HashSet<&str> = messages.iter().map(|d| d.id.as_str()).collect();
        let in_stream: HashSet<&str> = stream.iter().map(|d| d.id.as_str()).collect();
        for id in committed.keys() {
            assert!(in_stream.contains(id.as_str()), "{id} is not in the stream");
        }
        for id in &ledger.rolled_back {
            assert!(
                !on_broker.contains(id.as_str()),
                "rolled-back event {id} was published"
            );
        }
        for id in &on_broker {
            assert!(
                committed.contains_key(*id) || ledger.unknown.contains(*id),
                "{id} was published but never committed"
            );
        }
        // Order: first deliveries per key, as subscribers saw them and as the stream kept them.
        assert_eq!(
            figures.max_reorder, 0,
            "first deliveries out of key order: {:?}",
            figures.reordered
        );
        assert_eq!(
            stored.max_reorder, 0,
            "stream out of key order: {:?}",
            stored.reordered
        );
        assert_eq!(
            stored.duplicates, 0,
            "JetStream's dedupe window drops repeats"
        );
        assert!(
            figures.duplicates <= max_duplicates,
            "{} duplicates, more than the {max_duplicates} these faults explain",
            figures.duplicates
        );

        for i in self.running() {
            let node = &mut self.nodes[i];
            let status = node.relay.terminate().await;
            assert!(
                status.success(),
                "{} exits 0 after SIGTERM: {status}",
                node.name
            );
        }
        figures
    }
}

/// The writers' ordering keys. A publish that times out concerns a lane's head, and a node
/// has at most one head per key out at a time.
fn keys() -> usize {
    10 * env_number("OUTBOX_FAULTS_WRITERS", 3) as usize
}

fn start_writers(rig: &Rig) -> Writers {
    Writers::start(
        &rig.database_url,
        env_number("OUTBOX_FAULTS_WRITERS", 3) as usize,
        env_duration("OUTBOX_FAULTS_PACE", "100ms"),
    )
}

/// Publish attempts that can time out during a spell of `fault`: one per publish timeout,
/// plus the one under way when it began and the one when it ended. `fault` is the length
/// measured around the spell (from before it was applied to after it was healed), not the
/// planned one: on a loaded host a takeover, and so the fault, lasts longer than planned.
fn attempts_during(fault: Duration) -> usize {
    let timeout = env_duration("OUTBOX_FAULTS_PUBLISH_TIMEOUT", "2s");
    (fault.as_secs_f64() / timeout.as_secs_f64()).ceil() as usize + 2
}

/// (a) One node's broker link delays everything it publishes while its database link is
/// cut: the other node takes its partitions over and publishes their events while the first
/// node's copies are still on the way; they land later, as redeliveries.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_link_delayed_while_database_link_cut() {
    let delay = env_duration("OUTBOX_FAULTS_BROKER_DELAY", "3s");
    let cut = env_duration("OUTBOX_FAULTS_DB_CUT", "3s");
    let rig = Rig::start(2).await;
    let writers = start_writers(&rig);
    rig.wait_balanced().await;
    rig.wait_delivered_more(20).await;

    let victim = &rig.nodes[0];
    let held = rig.partitions_of(0).await;
    rig.say(&format!(
        "{}: broker link delayed by {delay:?}, database link cut",
        victim.name
    ));
    let delayed_since = Instant::now();
    victim.broker.latency(Direction::Both, delay);
    // Events keep coming, so the victim has publishes on the slow path when the cut comes.
    writers.wait_for_more(20).await;
    let cut_since = Instant::now();
    victim.db.cut();
    rig.wait_taken_over(0, &held).await;
    rig.say("its partitions were taken over");
    hold_fault(cut_since, cut).await;
    victim.db.heal();
    rig.say(&format!(
        "database link healed after {:?}; broker link still delayed",
        cut_since.elapsed()
    ));
    // Everything the victim sent while cut off arrives with the full delay.
    hold_fault(Instant::now(), delay).await;
    victim.broker.heal();
    let delayed_for = delayed_since.elapsed();
    rig.say(&format!("broker link healed after {delayed_for:?}"));
    rig.wait_balanced().await;
    writers.wait_for_more(20).await;

    // Repeated: what the victim held when it was fenced, and its attempts that timed out on
    // the delayed link (one head per key each, every publish timeout) for as long as it was
    // delayed, and one delay more for the copies still on the way when it healed.
    let bound = MAX_IN_FLIGHT + keys() * attempts_during(delayed_for + delay);
    rig.finish("a-delay-and-cut", writers, bound).await;
}

/// (b) The database goes silent without a RST (no error, no EOF) for one node, then for
/// every node. The silent node must be noticed (its partitions move), and everyone must
/// resume once the statements held in the network complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn database_blackholed() {
    let spell = env_duration("OUTBOX_FAULTS_DB_BLACKHOLE", "3s");
    let rig = Rig::start(2).await;
    let writers = start_writers(&rig);
    rig.wait_balanced().await;
    rig.wait_delivered_more(20).await;

    let held = rig.partitions_of(0).await;
    rig.say(&format!("{}: database blackholed", rig.nodes[0].name));
    let since = Instant::now();
    rig.nodes[0].db.blackhole();
    rig.wait_taken_over(0, &held).await;
    rig.say("its partitions were taken over");
    hold_fault(since, spell).await;
    rig.nodes[0].db.heal();
    rig.say("healed");
    rig.wait_balanced().await;
    rig.wait_delivered_more(20).await;

    rig.say("every node: database blackholed");
    let since = Instant::now();
    for node in &rig.nodes {
        node.db.blackhole();
    }
    writers.wait_for_more(20).await;
    hold_fault(since, spell).await;
    for node in &rig.nodes {
        node.db.heal();
    }
    rig.say("healed");
    rig.wait_delivered_more(20).await;

    // A blackholed node's acks are held, not lost: once they go through they are fenced
    // if the partition moved, and the new owner repeats those events. Without its database
    // a node claims nothing, so it can only have published rows it already held: at most
    // MAX_IN_FLIGHT for each of the three node-spells.
    let bound = 3 * MAX_IN_FLIGHT;
    rig.finish("b-blackhole", writers, bound).await;
}

/// (b') One node's open database connections go silent for good (a firewall or NAT lost
/// their flows; no RST) while new connections work. Nothing heals: the node must give up on
/// the dead connections by itself, reconnect and take its share of partitions again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn database_flows_blackholed_for_good() {
    // The store gives up on a statement after 30 s (`OPERATION_TIMEOUT`); TCP keepalives
    // cannot help here, since the proxy's own kernel acknowledges every segment.
    let recovery = env_duration("OUTBOX_FAULTS_STALE_RECOVERY", "60s");
    let rig = Rig::start(2).await;
    let writers = start_writers(&rig);
    rig.wait_balanced().await;
    rig.wait_delivered_more(20).await;

    let held = rig.partitions_of(0).await;
    rig.say(&format!(
        "{}: its open database connections blackholed",
        rig.nodes[0].name
    ));
    rig.nodes[0].db.blackhole_existing();
    // Which comes first depends on the pool: if the coordinator's heartbeat runs on a dead
    // flow, the node's lease runs out and the other takes its partitions; if the pool opens
    // a fresh connection for it (the dead ones are all busy with hung statements), the node
    // keeps its partitions, /readyz reports the stall, and its statements give up after the
    // operation timeout. Either way it must get over the dead flows by itself.
    let (admin, name, held, node) = (&rig.admin, &rig.nodes[0].name, &held, &rig.nodes[0]);
    eventually_explained(
        &format!("{name}'s partitions to be taken over, or {name} to recover by itself"),
        recovery,
        || node.relay.logs(),
        || async move {
            let recovered = node.relay.logs().contains("\"message\":\"recovered\"");
            let n = query_count(
                admin,
                "SELECT count(*) FROM outbox_partitions
                      WHERE partition = ANY($1) AND owner <> $2 AND lease_until > now()",
                &[held, name],
            )
            .await
            .ok()?;
            (recovered || n as usize == held.len()).then_some(())
        },
    )
    .await;
    rig.say("taken over or recovered; waiting for it to hold partitions again unhealed");
    let (admin, name) = (&rig.admin, &rig.nodes[0].name);
    eventually_explained(
        &format!("{name} to hold partitions again without a heal"),
        recovery,
        || rig.tails(),
        || async move {
            let n = query_count(
                admin,
                "SELECT count(*) FROM outbox_partitions WHERE owner = $1 AND lease_until > now()",
                &[name],
            )
            .await
            .ok()?;
            (n > 0).then_some(())
        },
    )
    .await;
    rig.say("it came back");
    rig.wait_balanced().await;
    writers.wait_for_more(20).await;

    let bound = MAX_IN_FLIGHT;
    rig.finish("b2-dead-flows", writers, bound).await;
}

/// (c) One node's broker link goes half-open: first its acks vanish (the broker stores the
/// events, the relay hears nothing), then its publishes vanish (the broker gets nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_link_half_open() {
    let spell = env_duration("OUTBOX_FAULTS_HALF_OPEN", "3s");
    let rig = Rig::start(2).await;
    let writers = start_writers(&rig);
    rig.wait_balanced().await;
    rig.wait_delivered_more(20).await;
    let broker = &rig.nodes[0].broker;

    let mut attempts = 0;
    for (what, dropped) in [
        ("acks dropped", Direction::ToClient),
        ("publishes dropped", Direction::ToUpstream),
    ] {
        rig.say(&format!(
            "{}: broker link half-open, {what}",
            rig.nodes[0].name
        ));
        let since = Instant::now();
        broker.half_open(dropped);
        writers.wait_for_more(20).await;
        hold_fault(since, spell).await;
        broker.heal();
        let lasted = since.elapsed();
        attempts += attempts_during(lasted);
        rig.say(&format!("healed after {lasted:?}"));
        rig.wait_delivered_more(20).await;
    }

    // Each spell: every head of the node's keys retried once per publish timeout while it
    // lasted. The database link is fine, so no partition moves and nothing else repeats.
    let bound = keys() * attempts;
    rig.finish("c-half-open", writers, bound).await;
}

/// (d) Membership changes every period: nodes join, leave (SIGTERM), crash (SIGKILL), lose
/// their database link (cut, or blackholed) for one period.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn membership_keeps_changing() {
    let duration = env_duration("OUTBOX_FAULTS_CHURN", "16s");
    let period = env_duration("OUTBOX_FAULTS_CHURN_PERIOD", "2s");
    let seed = env_number("OUTBOX_FAULTS_SEED", 1);
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut rig = Rig::start(2).await;
    let writers = start_writers(&rig);
    rig.wait_balanced().await;
    rig.say(&format!(
        "churn for {duration:?}, every {period:?}, seed {seed}"
    ));

    let end = Instant::now() + duration;
    let mut changes = 0;
    while Instant::now() < end {
        let step = Instant::now();
        // A link fault lasts one period.
        for node in &rig.nodes {
            node.db.heal();
        }
        let running = rig.running();
        let pick = running[rng.usize(..running.len())];
        let name = rig.nodes[pick].name.clone();
        match rng.usize(0..5) {
            _ if running.len() < 2 => {
                let i = rig.add_node().await;
                rig.say(&format!("{} joins", rig.nodes[i].name));
            }
            0 if running.len() < 4 => {
                let i = rig.add_node().await;
                rig.say(&format!("{} joins", rig.nodes[i].name));
            }
            0 | 1 => {
                rig.say(&format!("{name} leaves (SIGTERM)"));
                let status = rig.nodes[pick].relay.terminate().await;
                assert!(status.success(), "{name} exits 0 after SIGTERM: {status}");
            }
            2 => {
                rig.say(&format!("{name} crashes (SIGKILL)"));
                rig.nodes[pick].relay.kill9();
            }
            3 => {
                rig.say(&format!("{name}: database link cut"));
                rig.nodes[pick].db.cut();
            }
            _ => {
                rig.say(&format!("{name}: database blackholed"));
                rig.nodes[pick].db.blackhole();
            }
        }
        changes += 1;
        hold_fault(step, period).await;
    }
    for node in &rig.nodes {
        node.db.heal();
    }
    rig.say(&format!("{changes} changes; settling"));
    rig.wait_balanced().await;
    writers.wait_for_more(20).await;

    // Each change fences at most one node (a SIGTERM should fence none), which can cost
    // what that node held.
    let bound = changes * MAX_IN_FLIGHT;
    rig.finish("d-churn", writers, bound).await;
}
