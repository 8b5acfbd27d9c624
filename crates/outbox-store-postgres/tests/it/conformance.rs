//! The store conformance suite against a real PostgreSQL server (see scripts/servers.sh).

use std::sync::Arc;

use futures::future::BoxFuture;
use futures::FutureExt;
use std::time::{Duration, UNIX_EPOCH};

use outbox_core::store::{NodeRegistry, Operations, PartitionRegistry};
use outbox_core::{OutboxStore, SequenceId};
use outbox_store_postgres::{PgOptions, PgStore, Tables};
use outbox_testkit::conformance::{DeadRow, Expect, Harness, OddTime, RenamedColumn};

/// The suite's harness for both PostgreSQL stores: the native one, and the mapped one over an
/// application's table (below). Only the tables differ.
struct PgHarness<S> {
    store: S,
    retaining: S,
    client: tokio_postgres::Client,
    /// A session of its own, holding a row locked for the `row_locks` case.
    locker: tokio_postgres::Client,
    /// The outbox table.
    table: &'static str,
    /// Which of its rows are still queued (a mapped table keeps dead rows, marked).
    queued: &'static str,
    /// Where the dead rows are: a table, with the condition that picks them.
    dead: &'static str,
    /// The native store's partition leases (a mapped table has none).
    partitions: Option<Arc<dyn PartitionRegistry>>,
    /// How `verify` names the table and the fix of a renamed column.
    renamed_column: RenamedColumn,
}

pub fn options(url: &str, retain_delivered: bool) -> PgOptions {
    PgOptions {
        url: url.to_string(),
        tables: Tables::standard(),
        retain_delivered,
        ca_file: None,
        application_name: None,
        operation_timeout: None,
        pool_size: 4,
    }
}

/// A plain connection to `url`, its connection task spawned.
pub(crate) async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
}

async fn new_harness() -> PgHarness<PgStore> {
    let url = outbox_testkit::fresh_pg_database().await;
    let store = PgStore::new(options(&url, false)).unwrap();
    store.migrate().await.unwrap();
    PgHarness {
        retaining: PgStore::new(options(&url, true)).unwrap(),
        client: connect(&url).await,
        locker: connect(&url).await,
        table: "outbox",
        queued: "true",
        dead: "outbox_dead_letters",
        partitions: Some(Arc::new(store.clone())),
        renamed_column: RenamedColumn {
            what: "column mutation_id of public.outbox is missing",
            fix: "RENAME COLUMN \"mut_id\" TO mutation_id; (if mut_id is it",
        },
        store,
    }
}

impl<S> Harness for PgHarness<S>
where
    S: OutboxStore + NodeRegistry + Operations + Clone,
{
    fn store(&self) -> Arc<dyn OutboxStore> {
        Arc::new(self.store.clone())
    }

    fn retaining_store(&self) -> Arc<dyn OutboxStore> {
        Arc::new(self.retaining.clone())
    }

    fn registry(&self) -> Arc<dyn NodeRegistry> {
        Arc::new(self.store.clone())
    }

    fn operations(&self) -> Arc<dyn Operations> {
        Arc::new(self.store.clone())
    }

    fn insert_rolled_back(&self, destination: &str) -> BoxFuture<'_, ()> {
        let sql = format!(
            "BEGIN; INSERT INTO {} (destination, event_type, payload) VALUES ('{destination}', 't', '1'); ROLLBACK;",
            self.table
        );
        async move { self.client.batch_execute(&sql).await.unwrap() }.boxed()
    }

    fn insert_undecodable(&self, destination: &str) -> BoxFuture<'_, SequenceId> {
        let destination = destination.to_string();
        let sql = format!(
            "INSERT INTO {} (destination, event_type, payload, headers)
             VALUES ($1, 't', '{{}}', '[\"not\", \"an object\"]') RETURNING sequence_id",
            self.table
        );
        async move {
            let row = self.client.query_one(&sql, &[&destination]).await.unwrap();
            row.get(0)
        }
        .boxed()
    }

    fn row_state(&self, id: SequenceId) -> BoxFuture<'_, Option<(i64, Option<String>, bool)>> {
        let sql = format!(
            "SELECT attempts::int8, last_error, delivered_at IS NOT NULL FROM {}
              WHERE sequence_id = $1 AND {}",
            self.table, self.queued
        );
        async move {
            self.client
                .query_opt(&sql, &[&id])
                .await
                .unwrap()
                .map(|r| (r.get(0), r.get(1), r.get(2)))
        }
        .boxed()
    }

    fn table(&self) -> &str {
        self.table
    }

    fn execute<'a>(&'a self, sql: &'a str) -> BoxFuture<'a, ()> {
        async move { self.client.batch_execute(sql).await.unwrap() }.boxed()
    }

    fn lock_row_elsewhere(&self, id: Option<SequenceId>) -> BoxFuture<'_, ()> {
        let sql = match id {
            Some(id) => format!(
                "BEGIN; SELECT 1 FROM {} WHERE sequence_id = {id} FOR UPDATE",
                self.table
            ),
            None => "COMMIT".into(),
        };
        async move { self.locker.batch_execute(&sql).await.unwrap() }.boxed()
    }

    fn refuse_deleting(&self, id: Option<SequenceId>) -> BoxFuture<'_, ()> {
        let sql = match id {
            Some(id) => format!(
                "CREATE TABLE IF NOT EXISTS orders (event bigint REFERENCES {} (sequence_id));
                 INSERT INTO orders VALUES ({id});",
                self.table
            ),
            None => "DELETE FROM orders".into(),
        };
        async move { self.client.batch_execute(&sql).await.unwrap() }.boxed()
    }

    fn partitions(&self) -> Option<Arc<dyn PartitionRegistry>> {
        self.partitions.clone()
    }

    fn odd_created_at(&self) -> Vec<OddTime> {
        const OUTSIDE: &str = "outside the years 1 to 9999";
        let moon = UNIX_EPOCH - Duration::from_secs(14_182_940);
        let row = |destination, sql, expect| OddTime {
            destination,
            sql,
            expect,
        };
        vec![
            row(
                "moon",
                "'1969-07-20 20:17:40+00'",
                Expect::Delivered(Some(moon)),
            ),
            row("ad1", "'0001-01-01 00:00:00+00'", Expect::Delivered(None)),
            row(
                "far",
                "'10000-01-01 00:00:00+00'",
                Expect::DeadLettered(&[OUTSIDE]),
            ),
            row(
                "inf",
                "'infinity'",
                Expect::DeadLettered(&[OUTSIDE, "created_at is infinity"]),
            ),
            row("-inf", "'-infinity'", Expect::DeadLettered(&[OUTSIDE])),
            row(
                "bc",
                "'0044-03-15 12:00:00+00 BC'",
                Expect::DeadLettered(&[OUTSIDE]),
            ),
            row("ok", "now()", Expect::Delivered(None)),
        ]
    }

    fn renamed_column(&self) -> RenamedColumn {
        self.renamed_column.clone()
    }

    fn dead_rows(&self) -> BoxFuture<'_, Vec<DeadRow>> {
        let sql = format!(
            "SELECT sequence_id, attempts::int8, last_error, payload::text FROM {} ORDER BY sequence_id",
            self.dead
        );
        async move {
            self.client
                .query(&sql, &[])
                .await
                .unwrap()
                .iter()
                .map(|r| DeadRow {
                    sequence_id: r.get(0),
                    attempts: r.get(1),
                    last_error: r.get(2),
                    payload: r.get(3),
                })
                .collect()
        }
        .boxed()
    }
}

outbox_testkit::store_conformance!(new_harness);

/// Dead letters have a table of their own here, so one whose event the application wrote
/// again collides with it: see the case's own account.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_retry_leaves_a_dead_letter_whose_event_came_back() {
    let harness = new_harness().await;
    outbox_testkit::conformance::operator_retry_leaves_a_dead_letter_whose_event_came_back(
        &harness,
    )
    .await;
}

/// The suite against `MappedPgStore` with a custom mapping over an application's table
/// shaped like the native one (the MySQL native layout's mapping, here as a custom one).
mod mapped {
    use super::*;
    use outbox_layout::Mapping;
    use outbox_store_postgres::mapped::MappedPgOptions;
    use outbox_store_postgres::MappedPgStore;

    const TABLE: &str = "
        CREATE TABLE events (
            sequence_id  bigserial PRIMARY KEY,
            event_id     uuid NOT NULL UNIQUE DEFAULT gen_random_uuid(),
            destination  text NOT NULL,
            partition_key text,
            event_type   text NOT NULL,
            payload      jsonb,
            headers      jsonb,
            mutation_id  text,
            rejected     boolean NOT NULL DEFAULT false,
            created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
            available_at timestamptz NOT NULL DEFAULT now(),
            attempts     integer NOT NULL DEFAULT 0,
            last_error   text,
            locked_by    text,
            locked_until timestamptz,
            delivered_at timestamptz,
            dead_at      timestamptz
        )";

    fn store(url: &str, retain: bool) -> MappedPgStore {
        let mapping = Mapping {
            seed: None,
            insert_defaults: Vec::new(),
            ..Mapping::native_mysql(None, "events", retain)
        };
        MappedPgStore::new(MappedPgOptions {
            pg: options(url, retain),
            mapping,
            layout: "custom".into(),
            max_attempts: 20,
        })
        .unwrap()
    }

    async fn new_harness() -> PgHarness<MappedPgStore> {
        let (url, client, store) = fresh_table().await;
        PgHarness {
            retaining: self::store(&url, true),
            store,
            client,
            locker: connect(&url).await,
            table: "events",
            // Dead rows stay in the table (dead_at set) but are out of the queue.
            queued: "dead_at IS NULL",
            dead: "events WHERE dead_at IS NOT NULL",
            partitions: None,
            renamed_column: RenamedColumn {
                what: "has no column \"mutation_id\"",
                fix: "check the [mapping] section",
            },
        }
    }

    /// A fresh database with the table, and the store migrated on it.
    async fn fresh_table() -> (String, tokio_postgres::Client, MappedPgStore) {
        let url = outbox_testkit::fresh_pg_database().await;
        let client = connect(&url).await;
        client.batch_execute(TABLE).await.unwrap();
        let store = store(&url, false);
        store.migrate().await.unwrap();
        (url, client, store)
    }

    /// The table's lock kept into `ownership` as a running relay keeps it (a 30 s lease).
    fn keep_active(
        store: &MappedPgStore,
        ownership: &Arc<outbox_core::Ownership>,
        health: Arc<outbox_core::Health>,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(
            store
                .clone()
                .keep_active(ownership.clone(), Duration::from_secs(30), health),
        )
    }

    // Every test but `node_registry`: a custom mapping keeps no membership (one active relay
    // per table is the whole of the coordination, and the Ably layout's nodes table is the
    // native store's, which the suite above runs).
    outbox_testkit::store_conformance!(@tests new_harness;
        exclusive_claims, claims_leave_out_crowded_keys,
        engine_a_slow_key_leaves_room_for_the_others,
        per_key_order_across_nodes, retry_scheduling,
        dead_lettering_keeps_the_whole_event, lease_expiry,
        crash_between_publish_and_ack_redelivers, rolled_back_inserts_are_never_claimed,
        undecodable_rows_are_claimed_for_dead_lettering, ack_deletes_or_retains,
        release_makes_rows_claimable, release_unheld_frees_the_rows_the_node_does_not_hold,
        engine_a_claim_whose_answer_was_lost_keeps_its_key_in_order,
        engine_delivers_in_order_per_key, engine_retry_blocks_only_its_key,
        engine_a_row_the_database_refuses_to_delete_holds_back_no_other,
        engine_dead_letters_after_max_attempts_and_moves_on,
        engine_dead_letters_permanent_errors_and_undecodable_rows,
        engine_unordered_retries_and_dead_letters_go_out_again,
        operator_lists_retries_and_purges_dead_letters, operator_replays_and_prunes_in_batches,
        operator_pages_dead_letters_and_shows_one_event);
    /// A takeover whose reap failed kept the lock: the predecessor's rows were never reaped
    /// (a table with no time to reap them by kept them in flight for good), and keys waiting
    /// to retry went unblocked. Now the lock is let go, the failure is on `/readyz`, and
    /// the whole takeover is tried again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_takeover_cut_short_lets_the_lock_go_and_says_so() {
        let (_, client, store) = fresh_table().await;
        // The reap's column gone: each takeover fails once it has the lock.
        client
            .batch_execute("ALTER TABLE events RENAME COLUMN locked_until TO lease_end")
            .await
            .unwrap();
        let health = outbox_core::Health::new();
        let keeper = keep_active(&store, &outbox_core::Ownership::new(1), health.clone());
        outbox_testkit::eventually("the failure on /readyz", Duration::from_secs(20), || {
            let troubles = health.troubles(std::time::Instant::now(), Duration::from_secs(60));
            let leases = troubles.iter().any(|t| t.what == "partition leases");
            async move { leases.then_some(()) }
        })
        .await;
        // Let go between two tries (one a second): held for good before.
        outbox_testkit::eventually("the lock let go", Duration::from_secs(20), || async {
            let held: i64 = client
                .query_one(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted
                        AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            (held == 0).then_some(())
        })
        .await;
        keeper.abort();
    }

    /// Race: a claim checked at one take of the lock is still running when the lock is
    /// lost and taken again, and the takeover reaps before the claim marks its rows. Those
    /// rows stayed leased to the relay, which had dropped them with the old take; the key's
    /// later row went out first. Now a takeover waits for the claims of the last take to
    /// end, so its reap returns what they marked.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn race_a_claim_in_flight_while_the_lock_is_lost_and_taken_again() {
        use outbox_core::store::{ClaimRequest, Crowded};
        use outbox_core::{Fence, NodeId};
        let (_, client, store) = fresh_table().await;
        // The claim's marking waits on an advisory lock this session holds: the claim is
        // held between its check of the take and its write, for as long as the test says.
        client
            .batch_execute(
                "CREATE FUNCTION hold_claims() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN
                   IF OLD.locked_by IS NULL AND NEW.locked_by IS NOT NULL THEN
                     PERFORM pg_advisory_lock_shared(4242, 4242);
                     PERFORM pg_advisory_unlock_shared(4242, 4242);
                   END IF;
                   RETURN NEW;
                 END $$;
                 CREATE TRIGGER hold_claims BEFORE UPDATE ON events
                   FOR EACH ROW EXECUTE FUNCTION hold_claims();
                 SELECT pg_advisory_lock(4242, 4242);",
            )
            .await
            .unwrap();
        let ownership = outbox_core::Ownership::new(1);
        let keeper = keep_active(&store, &ownership, outbox_core::Health::new());
        // Read as an engine holding nothing would: each look reports what it acted on.
        let held_at = |ownership: Arc<outbox_core::Ownership>| async move {
            ownership.set_busy(Default::default(), ownership.generation());
            ownership.held().first().map(|&(_, epoch)| epoch)
        };
        let first = outbox_testkit::eventually("the lock taken", Duration::from_secs(20), || {
            held_at(ownership.clone())
        })
        .await;
        let insert = |n: i32| {
            format!(
                "INSERT INTO events (destination, partition_key, event_type, payload)
                 VALUES ('d', 'k', 't', '{{\"n\": {n}}}')"
            )
        };
        client.batch_execute(&insert(1)).await.unwrap();
        let claim = |epoch: i64| {
            store.claim(ClaimRequest {
                node: NodeId("n1".into()),
                limit: 10,
                lease: Duration::from_secs(30),
                fence: Some(Arc::new(Fence {
                    count: 1,
                    partitions: vec![0],
                    epochs: vec![epoch],
                })),
                ordered: true,
                crowded: Crowded::default(),
            })
        };
        let in_flight = tokio::spawn(claim(first));
        outbox_testkit::eventually(
            "the claim held at its write",
            Duration::from_secs(20),
            || {
                let client = &client;
                async move {
                    let waiting = outbox_testkit::query_count(
                        client,
                        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
                       AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
                        &[],
                    )
                    .await
                    .unwrap();
                    (waiting > 0).then_some(())
                }
            },
        )
        .await;
        // The key's next event, after the claim read the table.
        client.batch_execute(&insert(2)).await.unwrap();
        client
            .batch_execute(
                "SELECT pg_terminate_backend(pid) FROM pg_locks
                 WHERE locktype = 'advisory' AND granted AND objsubid = 1
                   AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            )
            .await
            .unwrap();
        // Before the fix the lock was taken again (and reaped) within a second or two, the
        // claim still held: this gives that interleaving its chance. Now it cannot happen.
        let retaken = tokio::time::timeout(Duration::from_secs(4), async {
            loop {
                match held_at(ownership.clone()).await {
                    Some(epoch) if epoch != first => return epoch,
                    _ => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            }
        })
        .await;
        client
            .batch_execute("SELECT pg_advisory_unlock(4242, 4242)")
            .await
            .unwrap();
        let payloads = |claimed: Vec<outbox_core::Claimed>| -> Vec<String> {
            claimed
                .iter()
                .map(|c| match c {
                    outbox_core::Claimed::Event(event) => match &event.payload {
                        outbox_core::Payload::Json(raw) => raw.get().to_string(),
                        other => panic!("not the JSON written: {other:?}"),
                    },
                    undecodable => panic!("undecodable: {undecodable:?}"),
                })
                .collect()
        };
        let overtaken = payloads(in_flight.await.unwrap().unwrap());
        assert_eq!(overtaken, [r#"{"n": 1}"#], "the claim held at its write");
        let second = match retaken {
            Ok(epoch) => epoch,
            Err(_) => {
                outbox_testkit::eventually("the lock taken again", Duration::from_secs(20), || {
                    let ownership = ownership.clone();
                    async move { held_at(ownership).await.filter(|&e| e != first) }
                })
                .await
            }
        };
        let order = payloads(claim(second).await.unwrap());
        assert_eq!(
            order,
            [r#"{"n": 1}"#, r#"{"n": 2}"#],
            "the key's later event was claimed before the one the overtaken claim marked"
        );
        keeper.abort();
    }

    /// The server probed the idle session holding the table's lock only after the system's
    /// keepalive time, two hours by default: a relay whose host crashed (no FIN) kept the
    /// lock that long, and no standby could take the table over. The lock session now has
    /// the server probe as the relay does (10 s idle). Read from the server's socket in
    /// `/proc/net/tcp`, since no fault here can cut a connection without closing it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_server_probes_the_lock_session_as_often_as_the_relay_does() {
        let (_, client, store) = fresh_table().await;
        let ownership = outbox_core::Ownership::new(1);
        let keeper = keep_active(&store, &ownership, outbox_core::Health::new());
        outbox_testkit::eventually("the lock taken", Duration::from_secs(20), || {
            let held = !ownership.held().is_empty();
            async move { held.then_some(()) }
        })
        .await;
        let row = client
            .query_one(
                "SELECT inet_server_port(), a.client_port FROM pg_locks l
                   JOIN pg_stat_activity a USING (pid)
                 WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
                   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
                &[],
            )
            .await
            .unwrap();
        let (server, lock_client): (i32, i32) = (row.get(0), row.get(1));
        let (server, lock_client) = (format!(":{server:04X}"), format!(":{lock_client:04X}"));
        let server_socket_timer = || {
            let tcp = std::fs::read_to_string("/proc/net/tcp").unwrap()
                + &std::fs::read_to_string("/proc/net/tcp6").unwrap_or_default();
            // sl local rem st queues tr:when ...: the server's end is local = its port.
            tcp.lines()
                .map(|line| line.split_whitespace().collect::<Vec<_>>())
                .find(|f| f.len() > 5 && f[1].ends_with(&server) && f[2].ends_with(&lock_client))
                .map(|f| f[5].to_string())
                .expect("the server's socket of the lock session")
        };
        // Once the session's last answer is acknowledged (timer 1 is a retransmission's),
        // the idle socket has its keepalive timer (2) or, never probed, none (0).
        let timer = outbox_testkit::eventually("the session idle", Duration::from_secs(20), || {
            let timer = server_socket_timer();
            async move { (!timer.starts_with("01:")).then_some(timer) }
        })
        .await;
        let (kind, when) = timer.split_once(':').unwrap();
        let ticks = u64::from_str_radix(when, 16).unwrap();
        // Timer 2 is the keepalive timer; `when` counts clock ticks (100 a second).
        assert_eq!(
            kind, "02",
            "no keepalive timer on the server's socket: {timer}"
        );
        assert!(
            ticks <= 10 * 100,
            "the server probes the idle lock session only in {} s",
            ticks / 100
        );
        keeper.abort();
    }

    outbox_testkit::store_conformance!(@groups new_harness;
        long_keys: run,
        owned_partitions: not_applicable("a mapped table has no partition leases: one active relay per table"),
        created_at: run,
        renamed_column: run,
        row_locks: run);
}
