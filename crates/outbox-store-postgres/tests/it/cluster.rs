//! Partition leases, fencing epochs and the claim modes, against real PostgreSQL.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::store::{ClaimRequest, Heartbeat, LeaseHolder, PartitionRegistry, Problem};
use outbox_core::{partition_of, Claimed, Fence, NewEvent, NodeId, OutboxStore};
use outbox_store_postgres::{PgOptions, PgStore, Tables, DEFAULT_NOTIFY_CHANNEL};
use outbox_testkit::{eventually, query_count};

use crate::session;

async fn store(partitions: u32) -> (PgStore, String) {
    let url = outbox_testkit::fresh_pg_database().await;
    let mut tables = Tables::standard();
    tables.partition_count = partitions;
    let store = PgStore::new(PgOptions::new(url.as_str(), tables)).unwrap();
    store.migrate().await.unwrap();
    (store, url)
}

/// A coordinator's configuration for node `node`.
fn cluster_config(
    node: &str,
    heartbeat_interval: Duration,
    heartbeat_timeout: Duration,
) -> outbox_cluster::ClusterConfig {
    outbox_cluster::ClusterConfig {
        node: NodeId(node.into()),
        settings: outbox_cluster::ClusterSettings {
            heartbeat_interval,
            heartbeat_timeout,
        },
        health: outbox_core::Health::new(),
    }
}

fn event(key: &str, n: usize) -> NewEvent {
    NewEvent {
        destination: "d".into(),
        partition_key: Some(key.into()),
        event_type: "t".into(),
        payload: Some(format!("{n}")),
        ..NewEvent::default()
    }
}

fn owned(node: &NodeId, fence: Fence, limit: usize) -> ClaimRequest {
    ClaimRequest {
        fence: Some(Arc::new(fence)),
        ..ClaimRequest::new(node.clone(), limit, Duration::from_secs(30))
    }
}

fn ids(claimed: &[Claimed]) -> Vec<i64> {
    claimed.iter().map(Claimed::sequence_id).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_and_rust_agree_on_partitions() {
    let (_, url) = store(64).await;
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let keys: Vec<String> = (0..500)
        .map(|i| format!("key-{i}-ü"))
        .chain(["".to_string()])
        .collect();
    let rows = client
        .query(
            "SELECT k, outbox_partition(k, 64) FROM unnest($1::text[]) AS k",
            &[&keys],
        )
        .await
        .unwrap();
    for row in rows {
        let key: String = row.get(0);
        assert_eq!(row.get::<_, i32>(1), partition_of(&key, 64), "key {key:?}");
    }
}

/// In a LATIN1 database the database hashes a key's LATIN1 bytes and the relay its UTF-8
/// ones: `ü` put a key in two partitions, and a node holding one of them dropped the key's
/// rows at every claim. Ordered relays refuse such a database, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordered_relays_refuse_a_database_whose_encoding_is_not_utf8() {
    let admin = outbox_testkit::fresh_pg_database().await;
    let (client, conn) = tokio_postgres::connect(&admin, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let name = format!("t_{}", uuid::Uuid::new_v4().simple());
    client
        .batch_execute(&format!(
            "CREATE DATABASE {name} ENCODING 'LATIN1' TEMPLATE template0 \
             LC_COLLATE 'C' LC_CTYPE 'C'"
        ))
        .await
        .unwrap();
    let url = outbox_testkit::with_database(&admin, &name);
    let store = PgStore::new(PgOptions::new(url.as_str(), Tables::standard())).unwrap();
    store.migrate().await.unwrap();
    let refused = store.partition_count().await.unwrap_err();
    assert!(
        refused.to_string().contains("encoding is LATIN1"),
        "{refused}"
    );
    assert_eq!(refused.kind(), outbox_core::StoreErrorKind::Config);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_are_exclusive_and_each_takeover_bumps_the_epoch() {
    let (store, _) = store(8).await;
    assert_eq!(store.partition_count().await.unwrap(), 8);
    let (a, b) = (NodeId::random(), NodeId::random());
    let taken = store
        .acquire(a.clone(), vec![0, 1], Duration::from_millis(400))
        .await
        .unwrap();
    assert_eq!(taken, vec![(0, 1), (1, 1)]);
    assert!(
        store
            .acquire(b.clone(), vec![0, 1, 2], Duration::from_secs(30))
            .await
            .unwrap()
            == vec![(2, 1)],
        "0 and 1 are leased"
    );
    // A's lease runs out; B takes over with a higher epoch; A can no longer renew.
    let retaken = eventually("A's lease to expire", Duration::from_secs(10), || {
        let store = store.clone();
        let b = b.clone();
        async move {
            let t = store
                .acquire(b, vec![0], Duration::from_secs(30))
                .await
                .unwrap();
            (!t.is_empty()).then_some(t)
        }
    })
    .await;
    assert_eq!(retaken, vec![(0, 2)]);
    // Partition 1's lease ran out too, and nobody took it: A cannot renew it either (a lease
    // of one epoch is unbroken), but takes it again at the next epoch.
    let renewed = store
        .renew(a.clone(), vec![(0, 1), (1, 1)], Duration::from_secs(30))
        .await
        .unwrap();
    assert!(
        renewed.is_empty(),
        "lapsed leases are not renewed: {renewed:?}"
    );
    let again = store
        .acquire(a.clone(), vec![1], Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(again, vec![(1, 2)]);
    let renewed = store
        .renew(a.clone(), again, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(renewed, vec![1], "a live lease is renewed");
    assert_eq!(
        store
            .release_partitions(b.clone(), vec![0, 2])
            .await
            .unwrap(),
        2
    );
    let records = store.partitions().await.unwrap();
    assert_eq!(records[0].owner, None);
    assert_eq!(
        records[0].epoch, 2,
        "the epoch stays; the next owner gets 3"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_lost_its_partitions_cannot_settle_and_the_new_owner_takes_the_rows() {
    let (store, _) = store(4).await;
    let seq = store
        .insert((0..20).map(|i| event(&format!("k{}", i % 5), i)).collect())
        .await
        .unwrap();
    let (a, b) = (NodeId::random(), NodeId::random());
    let all = vec![0, 1, 2, 3];
    let a_epochs = store
        .acquire(a.clone(), all.clone(), Duration::from_millis(300))
        .await
        .unwrap();
    let a_fence = Fence {
        count: 4,
        partitions: all.clone(),
        epochs: a_epochs.iter().map(|(_, e)| *e).collect(),
    };
    let claimed = store.claim(owned(&a, a_fence.clone(), 100)).await.unwrap();
    assert_eq!(ids(&claimed), seq, "A holds every partition");

    // A stalls past its partition leases (its row leases, 30 s, are still live); B takes over.
    let b_epochs = eventually(
        "A's partition leases to expire",
        Duration::from_secs(10),
        || {
            let store = store.clone();
            let (b, all) = (b.clone(), all.clone());
            async move {
                let t = store
                    .acquire(b, all, Duration::from_secs(30))
                    .await
                    .unwrap();
                (t.len() == 4).then_some(t)
            }
        },
    )
    .await;
    let b_fence = Fence {
        count: 4,
        partitions: all.clone(),
        epochs: b_epochs.iter().map(|(_, e)| *e).collect(),
    };
    assert!(
        b_fence
            .epochs
            .iter()
            .zip(&a_fence.epochs)
            .all(|(b, a)| b > a),
        "takeover bumps epochs"
    );
    let reclaimed = store.claim(owned(&b, b_fence.clone(), 100)).await.unwrap();
    assert_eq!(
        ids(&reclaimed),
        seq,
        "the new owner does not wait for the old row leases"
    );

    // A wakes up: everything it tries to settle is fenced.
    let a_fence = Some(Arc::new(a_fence));
    assert_eq!(
        store
            .ack(
                LeaseHolder {
                    node: a.clone(),
                    fence: a_fence.clone()
                },
                seq.clone()
            )
            .await
            .unwrap(),
        0
    );
    let retry = vec![outbox_core::store::RetryLater {
        sequence_id: seq[0],
        attempts: 1,
        error: "x".into(),
        delay: Duration::ZERO,
    }];
    assert_eq!(
        store
            .retry_later(
                LeaseHolder {
                    node: a.clone(),
                    fence: a_fence.clone()
                },
                retry
            )
            .await
            .unwrap(),
        0
    );
    let dead = vec![outbox_core::store::DeadLetter {
        sequence_id: seq[1],
        attempts: 1,
        error: "x".into(),
    }];
    assert_eq!(
        store
            .dead_letter(
                LeaseHolder {
                    node: a,
                    fence: a_fence
                },
                dead
            )
            .await
            .unwrap(),
        0
    );
    // B settles.
    assert_eq!(
        store
            .ack(
                LeaseHolder {
                    node: b,
                    fence: Some(Arc::new(b_fence))
                },
                seq.clone()
            )
            .await
            .unwrap(),
        20
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owned_claims_cover_only_the_fence_and_unordered_claims_ignore_keys() {
    let (store, _) = store(4).await;
    let keys: Vec<String> = (0..40).map(|i| format!("key{i}")).collect();
    let seq = store
        .insert(keys.iter().enumerate().map(|(i, k)| event(k, i)).collect())
        .await
        .unwrap();
    let node = NodeId::random();
    let taken = store
        .acquire(node.clone(), vec![1, 3], Duration::from_secs(30))
        .await
        .unwrap();
    let fence = Fence {
        count: 4,
        partitions: vec![1, 3],
        epochs: taken.iter().map(|(_, e)| *e).collect(),
    };
    let claimed = store.claim(owned(&node, fence, 100)).await.unwrap();
    let expected: Vec<i64> = seq
        .iter()
        .zip(&keys)
        .filter(|(_, k)| [1, 3].contains(&partition_of(k, 4)))
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(ids(&claimed), expected);

    // A retrying head blocks its key in ordered claims, not in unordered ones.
    let (store, _) = store_with_retrying_head().await;
    let other = NodeId::random();
    let ordered = store
        .claim(ClaimRequest::new(
            other.clone(),
            10,
            Duration::from_secs(30),
        ))
        .await
        .unwrap();
    assert!(ordered.is_empty(), "the key waits for its head");
    let unordered = store
        .claim(ClaimRequest {
            ordered: false,
            ..ClaimRequest::new(other, 10, Duration::from_secs(30))
        })
        .await
        .unwrap();
    assert_eq!(
        unordered.len(),
        1,
        "unordered claims take the later row at once"
    );
}

/// A node holding every partition of a 4-partition store.
async fn sole_owner(store: &PgStore) -> (NodeId, Fence) {
    let node = NodeId::random();
    let taken = store
        .acquire(node.clone(), vec![0, 1, 2, 3], Duration::from_secs(60))
        .await
        .unwrap();
    let fence = Fence {
        count: 4,
        partitions: vec![0, 1, 2, 3],
        epochs: taken.iter().map(|(_, e)| *e).collect(),
    };
    (node, fence)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_do_not_pass_an_insert_that_commits_after_later_rows() {
    let (store, url) = store(4).await;
    let (node, fence) = sole_owner(&store).await;
    let (writer, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    // An application transaction draws its id and stays open while later rows commit.
    writer
        .batch_execute(
            "BEGIN; INSERT INTO outbox (destination, partition_key, event_type, payload)
                    VALUES ('d', 'slow', 't', '0')",
        )
        .await
        .unwrap();
    let mut later = Vec::new();
    for round in 0..3 {
        let seq = store
            .insert((0..5).map(|i| event(&format!("k{i}"), round)).collect())
            .await
            .unwrap();
        later.extend(seq);
        let claimed = store.claim(owned(&node, fence.clone(), 100)).await.unwrap();
        assert!(
            claimed.iter().all(|c| later.contains(&c.sequence_id())),
            "only committed rows"
        );
    }
    writer.batch_execute("COMMIT").await.unwrap();
    let slow: i64 = writer
        .query_one(
            "SELECT sequence_id FROM outbox WHERE partition_key = 'slow'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(slow < later[0], "the open insert drew the lowest id");
    let claimed = store.claim(owned(&node, fence.clone(), 100)).await.unwrap();
    assert_eq!(
        ids(&claimed),
        vec![slow],
        "the row committed last is claimed at once, below rows already claimed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_that_retries_is_claimed_again_when_due_before_its_keys_later_rows() {
    let (store, url) = store(4).await;
    let (node, fence) = sole_owner(&store).await;
    let seq = store
        .insert(vec![event("k", 0), event("other", 1), event("k", 2)])
        .await
        .unwrap();
    let claimed = store.claim(owned(&node, fence.clone(), 2)).await.unwrap();
    assert_eq!(ids(&claimed), seq[..2]);
    let retry = vec![outbox_core::store::RetryLater {
        sequence_id: seq[0],
        attempts: 1,
        error: "down".into(),
        delay: Duration::from_millis(300),
    }];
    let f = Some(Arc::new(fence.clone()));
    assert_eq!(
        store
            .retry_later(
                LeaseHolder {
                    node: node.clone(),
                    fence: f
                },
                retry
            )
            .await
            .unwrap(),
        1
    );
    let waiting = store.claim(owned(&node, fence.clone(), 10)).await.unwrap();
    assert!(
        waiting.is_empty(),
        "the key waits for its head: {:?}",
        ids(&waiting)
    );
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let client = Arc::new(client);
    let head = seq[0];
    eventually("the retry to come due", Duration::from_secs(10), || {
        let client = client.clone();
        async move {
            let due: bool = client
                .query_one(
                    "SELECT available_at <= now() FROM outbox WHERE sequence_id = $1",
                    &[&head],
                )
                .await
                .unwrap()
                .get(0);
            due.then_some(())
        }
    })
    .await;
    let claimed = store.claim(owned(&node, fence, 10)).await.unwrap();
    assert_eq!(
        ids(&claimed),
        vec![seq[0], seq[2]],
        "the head first, at once"
    );
}

/// A store whose key "k" has a head waiting an hour to retry and one row behind it.
async fn store_with_retrying_head() -> (PgStore, String) {
    let (store, url) = store(4).await;
    let seq = store
        .insert(vec![event("k", 0), event("k", 1)])
        .await
        .unwrap();
    let node = NodeId::random();
    store
        .claim(ClaimRequest::new(node.clone(), 1, Duration::from_secs(30)))
        .await
        .unwrap();
    let retry = vec![outbox_core::store::RetryLater {
        sequence_id: seq[0],
        attempts: 1,
        error: "down".into(),
        delay: Duration::from_secs(3600),
    }];
    assert_eq!(
        store
            .retry_later(LeaseHolder::unfenced(node), retry)
            .await
            .unwrap(),
        1
    );
    (store, url)
}

/// Inserts `count` rows of other keys and claims them, so that the floor moves past them.
async fn claim_other_rows(store: &PgStore, node: &NodeId, fence: &Fence, round: usize) {
    let seq = store
        .insert((0..5).map(|i| event(&format!("other{i}"), round)).collect())
        .await
        .unwrap();
    let claimed = store.claim(owned(node, fence.clone(), 100)).await.unwrap();
    assert_eq!(ids(&claimed), seq, "round {round}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_do_not_pass_an_id_the_application_drew_before_its_insert() {
    let (store, url) = store(4).await;
    let (node, fence) = sole_owner(&store).await;
    // Hibernate's and jOOQ's SEQUENCE strategy: draw the id, insert it later in the same
    // transaction, while other rows are inserted and claimed.
    let app = session(&url).await;
    app.batch_execute("BEGIN").await.unwrap();
    let drawn: i64 = app
        .query_one(
            "SELECT nextval(pg_get_serial_sequence('outbox', 'sequence_id'))",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    for round in 0..3 {
        claim_other_rows(&store, &node, &fence, round).await;
    }
    app.execute(
        "INSERT INTO outbox (sequence_id, destination, partition_key, event_type, payload)
         VALUES ($1, 'd', 'k', 't', '1')",
        &[&drawn],
    )
    .await
    .unwrap();
    app.batch_execute("COMMIT").await.unwrap();
    let later = store.insert(vec![event("k", 2)]).await.unwrap();
    let claimed = store.claim(owned(&node, fence, 100)).await.unwrap();
    assert_eq!(
        ids(&claimed),
        vec![drawn, later[0]],
        "the row committed first goes first"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_that_hands_out_ids_ahead_keeps_claims_from_the_start() {
    let (store, url) = store(4).await;
    let (node, fence) = sole_owner(&store).await;
    // Hibernate's pooled optimiser: one nextval hands the application 50 ids, which it
    // inserts in later transactions, holding no lock in between.
    let app = session(&url).await;
    app.batch_execute(
        "ALTER SEQUENCE outbox_sequence_id_seq INCREMENT BY 50;
         SELECT setval('outbox_sequence_id_seq', 1000)",
    )
    .await
    .unwrap();
    let block_end: i64 = app
        .query_one("SELECT nextval('outbox_sequence_id_seq')", &[])
        .await
        .unwrap()
        .get(0);
    for round in 0..3 {
        claim_other_rows(&store, &node, &fence, round).await;
    }
    let pooled = block_end - 10;
    app.execute(
        "INSERT INTO outbox (sequence_id, destination, partition_key, event_type, payload)
         VALUES ($1, 'd', 'k', 't', '1')",
        &[&pooled],
    )
    .await
    .unwrap();
    let later = store.insert(vec![event("k", 2)]).await.unwrap();
    let claimed = store.claim(owned(&node, fence, 100)).await.unwrap();
    assert_eq!(ids(&claimed), vec![pooled, later[0]]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_row_goes_out_when_due_before_later_rows_of_its_key() {
    let (store, url) = store(4).await;
    let (node, fence) = sole_owner(&store).await;
    let app = session(&url).await;
    let scheduled: i64 = app
        .query_one(
            "INSERT INTO outbox (destination, partition_key, event_type, payload, available_at)
             VALUES ('d', 'k', 't', '0', now() + interval '300 milliseconds')
             RETURNING sequence_id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // Claims pass the row while it is not due.
    for round in 0..3 {
        claim_other_rows(&store, &node, &fence, round).await;
    }
    let app = Arc::new(app);
    eventually(
        "the scheduled row to come due",
        Duration::from_secs(10),
        || {
            let app = app.clone();
            async move {
                let due: bool = app
                    .query_one(
                        "SELECT available_at <= now() FROM outbox WHERE sequence_id = $1",
                        &[&scheduled],
                    )
                    .await
                    .unwrap()
                    .get(0);
                due.then_some(())
            }
        },
    )
    .await;
    let later = store.insert(vec![event("k", 1)]).await.unwrap();
    let claimed = store.claim(owned(&node, fence, 100)).await.unwrap();
    assert_eq!(
        ids(&claimed),
        vec![scheduled, later[0]],
        "available first, out first"
    );
}

/// A sink that takes events and never confirms them (a broker link that went silent).
struct SilentSink;

impl outbox_core::Publisher for SilentSink {
    fn describe(&self) -> String {
        "silent".into()
    }

    fn publish(
        &self,
        _batch: Vec<Arc<outbox_core::Event>>,
    ) -> futures::future::BoxFuture<'static, Vec<outbox_core::Outcome>> {
        Box::pin(futures::future::pending())
    }

    fn health(&self) -> futures::future::BoxFuture<'static, Result<(), outbox_core::PublishError>> {
        Box::pin(async { Ok(()) })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_is_abandoned_when_the_partition_lease_runs_out() {
    let (store, url) = store(4).await;
    let (node, fence) = sole_owner(&store).await;
    // The node's own view of its leases runs out soon and is never renewed (its coordinator
    // stalled); the publish timeout alone would wait an hour.
    let ownership = outbox_core::Ownership::new(4);
    let valid_until = std::time::Instant::now() + Duration::from_millis(500);
    for (partition, epoch) in fence.partitions.iter().zip(&fence.epochs) {
        ownership.grant(*partition, *epoch, valid_until);
    }
    let seq = store.insert(vec![event("k", 0)]).await.unwrap();
    let mut config = outbox_engine::EngineConfig::new(node);
    config.shared.ownership = Some(ownership);
    config.settings.publish_timeout = Duration::from_secs(3600);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let engine = tokio::spawn(outbox_engine::run(
        Arc::new(store),
        Arc::new(SilentSink),
        config,
        async move {
            let _ = stopped.await;
        },
    ));
    let app = Arc::new(session(&url).await);
    let error: String = eventually(
        "the unconfirmed publish to be given up",
        Duration::from_secs(20),
        || {
            let app = app.clone();
            let id = seq[0];
            async move {
                app.query_one(
                    "SELECT last_error FROM outbox WHERE sequence_id = $1",
                    &[&id],
                )
                .await
                .unwrap()
                .get::<_, Option<String>>(0)
            }
        },
    )
    .await;
    assert!(error.contains("lease ran out"), "{error}");
    let _ = stop.send(());
    engine.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn printed_grants_name_the_sequence_postgres_made_for_a_long_table_name() {
    let url = outbox_testkit::fresh_pg_database().await;
    // 50 characters: PostgreSQL shortens "<table>_sequence_id_seq" its own way.
    let table = "orders_outbox_for_the_billing_and_invoicing_domain";
    assert_eq!(table.len(), 50);
    let tables = Tables::new(
        "public",
        table,
        "public",
        "outbox_nodes",
        DEFAULT_NOTIFY_CHANNEL,
    )
    .unwrap();
    let store = PgStore::new(PgOptions::new(url.as_str(), tables.clone())).unwrap();
    store.migrate().await.unwrap();
    let role = format!("relay_{}", std::process::id());
    let admin = session(&url).await;
    admin
        .batch_execute(&format!(
            "DROP ROLE IF EXISTS {role}; CREATE ROLE {role}; {}",
            tables.grants(&role)
        ))
        .await
        .unwrap();
    let granted: bool = admin
        .query_one(
            "SELECT has_sequence_privilege($1, pg_get_serial_sequence($2, 'sequence_id'), 'SELECT')",
            &[&role, &format!("public.{table}")],
        )
        .await
        .unwrap()
        .get(0);
    let database: String = admin
        .query_one("SELECT current_database()", &[])
        .await
        .unwrap()
        .get(0);
    admin
        .batch_execute(&format!(
            "REVOKE ALL ON DATABASE \"{database}\" FROM {role}; DROP OWNED BY {role}; DROP ROLE {role}"
        ))
        .await
        .unwrap();
    assert!(granted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_on_a_table_without_statistics_reads_only_the_rows_it_returns() {
    let (store, url) = store(4).await;
    let (node, fence) = sole_owner(&store).await;
    let app = Arc::new(session(&url).await);
    // A backlog loaded after an outage, before autovacuum analyzed it (kept from doing so
    // here, so that the test does not depend on its timing).
    app.batch_execute(
        "ALTER TABLE outbox SET (autovacuum_enabled = false);
         INSERT INTO outbox (destination, partition_key, event_type, payload)
         SELECT 'd', 'k' || (i % 100), 't', '{}' FROM generate_series(1, 50000) i",
    )
    .await
    .unwrap();
    let claimed = store.claim(owned(&node, fence, 10)).await.unwrap();
    assert_eq!(claimed.len(), 10);
    // The store's session reports its counters when it goes idle.
    let read: i64 = eventually(
        "the claim's table statistics",
        Duration::from_secs(30),
        || {
            let app = app.clone();
            async move {
                app.batch_execute("SELECT pg_stat_clear_snapshot()")
                    .await
                    .unwrap();
                let row = app
                    .query_one(
                        "SELECT coalesce(seq_scan, 0) + coalesce(idx_scan, 0),
                            coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)
                       FROM pg_stat_user_tables WHERE relname = 'outbox'",
                        &[],
                    )
                    .await
                    .unwrap();
                (row.get::<_, i64>(0) > 0).then(|| row.get::<_, i64>(1))
            }
        },
    )
    .await;
    assert!(
        read < 1_000,
        "a claim of 10 rows read {read} rows of 50,000: it did not follow the pending index"
    );
}

/// The real nodes table, with faults: one heartbeat's answer lost after its write committed
/// (`armed`: as when the connection drops between the commit and the reply), and listings
/// of the live nodes that fail (`listings_to_fail` of them).
struct FaultyNodesTable {
    store: PgStore,
    armed: std::sync::atomic::AtomicBool,
    heartbeats: std::sync::atomic::AtomicUsize,
    listings_to_fail: std::sync::atomic::AtomicUsize,
    listings_failed: std::sync::atomic::AtomicUsize,
}

impl FaultyNodesTable {
    fn new(store: PgStore) -> Self {
        FaultyNodesTable {
            store,
            armed: false.into(),
            heartbeats: 0.into(),
            listings_to_fail: 0.into(),
            listings_failed: 0.into(),
        }
    }
}

impl outbox_core::store::NodeRegistry for FaultyNodesTable {
    fn register(
        &self,
        node: NodeId,
        ttl: Duration,
    ) -> futures::future::BoxFuture<
        'static,
        outbox_core::store::StoreResult<outbox_core::store::Registration>,
    > {
        self.store.register(node, ttl)
    }

    fn heartbeat(
        &self,
        beat: outbox_core::store::Heartbeat,
    ) -> futures::future::BoxFuture<
        'static,
        outbox_core::store::StoreResult<outbox_core::store::Heartbeated>,
    > {
        use std::sync::atomic::Ordering::SeqCst;
        self.heartbeats.fetch_add(1, SeqCst);
        let beat = self.store.heartbeat(beat);
        if !self.armed.swap(false, SeqCst) {
            return beat;
        }
        Box::pin(async move {
            beat.await?.pushed().expect("the row was this process's");
            Err(outbox_core::StoreError::new(
                outbox_core::StoreErrorKind::Connection,
                "connection lost before the answer",
            ))
        })
    }

    fn remove_expired(
        &self,
    ) -> futures::future::BoxFuture<'static, outbox_core::store::StoreResult<u64>> {
        self.store.remove_expired()
    }

    fn deregister(
        &self,
        node: NodeId,
        last: outbox_core::store::Incarnation,
    ) -> futures::future::BoxFuture<'static, outbox_core::store::StoreResult<()>> {
        self.store.deregister(node, last)
    }

    fn live_nodes(
        &self,
    ) -> futures::future::BoxFuture<
        'static,
        outbox_core::store::StoreResult<Vec<outbox_core::store::NodeRecord>>,
    > {
        use std::sync::atomic::Ordering::SeqCst;
        let failing = self
            .listings_to_fail
            .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if failing {
            self.listings_failed.fetch_add(1, SeqCst);
            return Box::pin(async {
                Err(outbox_core::StoreError::new(
                    outbox_core::StoreErrorKind::Query,
                    "canceling statement due to statement timeout (a fault of the test)",
                ))
            });
        }
        self.store.live_nodes()
    }
}

/// A heartbeat answered but a listing of the live nodes that failed skipped the renewal of
/// the node's leases: after a few such rounds they ran out by its own clock, and its
/// partitions stopped publishing while nothing was wrong with them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_are_renewed_while_the_live_nodes_cannot_be_listed() {
    use std::sync::atomic::Ordering::SeqCst;
    let (store, _url) = store(4).await;
    let registry = Arc::new(FaultyNodesTable::new(store.clone()));
    let ownership = outbox_core::Ownership::new(4);
    let heartbeat_timeout = Duration::from_secs(1);
    let coordinator = outbox_cluster::Coordinator::start(
        registry.clone(),
        Some(outbox_cluster::Partitions {
            registry: Arc::new(store),
            ownership: ownership.clone(),
        }),
        cluster_config("n1", Duration::from_millis(50), heartbeat_timeout),
    )
    .await
    .unwrap();
    eventually("every partition held", Duration::from_secs(10), || {
        let held = ownership.held().len();
        async move { (held == 4).then_some(()) }
    })
    .await;
    // Failed listings for longer than a lease lasts by the node's clock (0.75 s): 25 rounds
    // of at least 50 ms.
    registry.listings_to_fail.store(25, SeqCst);
    eventually("25 failed listings", Duration::from_secs(20), || {
        let failed = registry.listings_failed.load(SeqCst);
        async move { (failed >= 25).then_some(()) }
    })
    .await;
    let (publishable, _) = ownership.publishable(std::time::Instant::now());
    assert_eq!(
        publishable.len(),
        4,
        "leases ran out by the node's clock while only the listing of nodes failed"
    );
    coordinator
        .stop(tokio::time::Instant::now() + Duration::from_secs(5))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_whose_answer_was_lost_does_not_make_the_node_think_it_was_displaced() {
    use std::sync::atomic::Ordering::SeqCst;
    let (store, _url) = store(4).await;
    let registry = Arc::new(FaultyNodesTable::new(store));
    let coordinator = outbox_cluster::Coordinator::start(
        registry.clone(),
        None,
        cluster_config("n1", Duration::from_millis(50), Duration::from_secs(5)),
    )
    .await
    .unwrap();
    registry.armed.store(true, SeqCst);
    eventually("the answer to be lost", Duration::from_secs(10), || {
        let lost = !registry.armed.load(SeqCst);
        async move { lost.then_some(()) }
    })
    .await;
    let lost_at = registry.heartbeats.load(SeqCst);
    eventually("three more heartbeats", Duration::from_secs(10), || {
        let beats = registry.heartbeats.load(SeqCst);
        let displaced = coordinator.is_displaced();
        async move { (beats >= lost_at + 3 || displaced).then_some(()) }
    })
    .await;
    assert!(
        !coordinator.is_displaced(),
        "its own write, whose answer was lost, is not another process"
    );
}

/// What `verify` finds once `statement` ran on the database at `url`; every problem is one
/// `run` starts with (degraded), and one of them says `named`.
async fn degraded_after(store: &PgStore, url: &str, statement: &str, named: &str) -> Vec<Problem> {
    session(url).await.batch_execute(statement).await.unwrap();
    let problems = store.verify().await.unwrap();
    assert!(
        problems.iter().any(|p| p.what.contains(named)),
        "{named}: {problems:?}"
    );
    assert!(problems.iter().all(|p| p.is_degraded()), "{problems:?}");
    problems
}

/// The pending rows' index, or the event ids' UNIQUE constraint, dropped by hand: `check`
/// said ok while every claim read the whole table, or while two rows could share an event
/// id. Each is named, not refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_pending_index_or_event_id_constraint_is_named_by_check() {
    let (store, url) = store(4).await;
    degraded_after(
        &store,
        &url,
        "DROP INDEX outbox_pending_idx",
        "outbox_pending_idx",
    )
    .await;
    let problems = degraded_after(
        &store,
        &url,
        "ALTER TABLE outbox DROP CONSTRAINT outbox_event_id_key",
        "event_id alone",
    )
    .await;
    assert!(
        problems
            .iter()
            .any(|p| p.fix.contains("ADD UNIQUE (event_id)")),
        "{problems:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_migrated_before_the_scheduled_index_is_slower_not_refused() {
    let (store, url) = store(4).await;
    // `run` starts on it: the floor is off, and says so.
    degraded_after(
        &store,
        &url,
        "DROP INDEX outbox_scheduled_idx",
        "outbox_scheduled_idx",
    )
    .await;
    let (node, fence) = sole_owner(&store).await;
    let seq = store.insert(vec![event("k", 0)]).await.unwrap();
    let claimed = store.claim(owned(&node, fence, 10)).await.unwrap();
    assert_eq!(ids(&claimed), seq);
}

/// Waits until a session of the test database waits for a row lock: the statement a race
/// test holds back has reached it.
async fn until_a_session_waits_for_a_lock(url: &str, what: &str) {
    let watcher = session(url).await;
    eventually(what, Duration::from_secs(10), || async {
        let waiting = query_count(
            &watcher,
            "SELECT count(*) FROM pg_stat_activity
                  WHERE datname = current_database() AND wait_event_type = 'Lock'",
            &[],
        )
        .await
        .unwrap();
        (waiting > 0).then_some(())
    })
    .await;
}

/// Race: a node's heartbeat comes in (a stalled link healed) while another node is removing
/// its expired row. The heartbeat's UPDATE waits for the DELETE's lock and then finds no row;
/// a re-insert that looks for the row in the statement's snapshot, taken before the DELETE
/// committed, still sees it and inserts nothing. The node then took itself for displaced by
/// another process and stopped with exit 2 (`faults::database_blackholed`, CI on ea6855f).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn race_a_heartbeat_waiting_on_the_removal_of_its_expired_row_registers_it_again() {
    use outbox_core::store::{NodeRegistry, Registration};
    let (store, url) = store(4).await;
    let node = NodeId("stalled".into());
    let Registration::Registered(last) = store
        .register(node.clone(), Duration::from_millis(1))
        .await
        .unwrap()
    else {
        panic!("a fresh table has no row for the node");
    };
    // Another node's removal of expired rows, held open before it commits.
    let remover = session(&url).await;
    eventually("the row to expire", Duration::from_secs(10), || async {
        let expired: bool = remover
            .query_one(
                "SELECT expiry < (now() AT TIME ZONE 'UTC') FROM outbox_nodes WHERE id = 'stalled'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        expired.then_some(())
    })
    .await;
    remover.batch_execute("BEGIN").await.unwrap();
    let removed = remover
        .execute(
            "DELETE FROM outbox_nodes WHERE expiry < (now() AT TIME ZONE 'UTC')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(removed, 1);

    let heartbeat = tokio::spawn({
        let store = store.clone();
        let node = node.clone();
        async move {
            store
                .heartbeat(Heartbeat {
                    node,
                    last,
                    ttl: Duration::from_secs(30),
                })
                .await
        }
    });
    until_a_session_waits_for_a_lock(&url, "the heartbeat to wait for the removal's lock").await;
    remover.batch_execute("COMMIT").await.unwrap();

    let beat = heartbeat.await.unwrap().unwrap();
    assert!(
        beat.pushed().is_some(),
        "a heartbeat that finds its row removed registers it again; none came back, which \
         the node takes for another process under its id"
    );
    let live: Vec<String> = store
        .live_nodes()
        .await
        .unwrap()
        .into_iter()
        .map(|n| n.id)
        .collect();
    assert_eq!(live, vec!["stalled".to_string()]);
}

/// Race: two processes start under one node id at once. The second's registration waits for
/// the first's uncommitted insert of the row, and then finds the row live but not in its
/// statement's snapshot: the store reports a conflict. Registration must look again, and
/// then wait out (or be refused by) the row that stands, not fail the start on the
/// conflict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn race_a_registration_that_meets_a_concurrent_insert_of_its_row_looks_again() {
    let (store, url) = store(4).await;
    // The first process's registration, held open before it commits; its row expires in 2 s,
    // as a process killed right after starting would leave it.
    let first = session(&url).await;
    first.batch_execute("BEGIN").await.unwrap();
    first
        .execute(
            "INSERT INTO outbox_nodes (id, expiry)
             VALUES ('twin', (now() AT TIME ZONE 'UTC') + interval '2 seconds')",
            &[],
        )
        .await
        .unwrap();
    let second = tokio::spawn({
        let store = store.clone();
        async move {
            outbox_cluster::Coordinator::start(
                Arc::new(store),
                None,
                cluster_config("twin", Duration::from_millis(200), Duration::from_secs(30)),
            )
            .await
        }
    });
    until_a_session_waits_for_a_lock(
        &url,
        "the second registration to wait for the first's insert",
    )
    .await;
    first.batch_execute("COMMIT").await.unwrap();
    // The first process never heartbeats: once its row expires, the second takes it over.
    let started = tokio::time::timeout(Duration::from_secs(20), second)
        .await
        .expect("registration ends once the first row expires")
        .unwrap();
    let coordinator = started.unwrap_or_else(|e| {
        panic!("a conflict during registration is looked at again, not fatal: {e}")
    });
    coordinator
        .stop(tokio::time::Instant::now() + Duration::from_secs(5))
        .await;
}

/// A lock on the outbox (VACUUM FULL, an ALTER, pg_repack's swap) holds every claim and ack
/// for as long as it lasts. Those took every connection of the pool, and the heartbeats and
/// lease renewals, which touch only the nodes and partitions tables, waited for one: the
/// leases lapsed although every node was alive, and every partition moved at a new epoch
/// once the lock went. They run on connections of their own now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_go_on_while_a_lock_on_the_outbox_holds_every_claim() {
    use outbox_core::store::{NodeRegistry, Registration};
    let url = outbox_testkit::fresh_pg_database().await;
    let mut options = PgOptions::new(url.as_str(), Tables::standard());
    options.pool_size = 2;
    let store = PgStore::new(options).unwrap();
    store.migrate().await.unwrap();
    let node = NodeId("busy".into());
    let Registration::Registered(last) = store
        .register(node.clone(), Duration::from_secs(30))
        .await
        .unwrap()
    else {
        panic!("a fresh table has no row for the node");
    };
    let locker = session(&url).await;
    locker
        .batch_execute("BEGIN; LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    // As many claims as the pool has connections, each waiting on the lock.
    let claims: Vec<_> = (0..2)
        .map(|_| {
            let store = store.clone();
            let node = node.clone();
            tokio::spawn(async move {
                store
                    .claim(ClaimRequest::new(node, 10, Duration::from_secs(30)))
                    .await
            })
        })
        .collect();
    eventually(
        "both claims waiting on the lock",
        Duration::from_secs(30),
        || async {
            let waiting: i64 = locker
            .query_one(
                "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'outbox'::regclass",
                &[],
            )
            .await
            .unwrap()
            .get(0);
            (waiting >= 2).then_some(())
        },
    )
    .await;
    let beat = store
        .heartbeat(Heartbeat {
            node,
            last,
            ttl: Duration::from_secs(30),
        })
        .await;
    locker.batch_execute("COMMIT").await.unwrap();
    for claim in claims {
        claim.await.unwrap().unwrap();
    }
    assert!(
        beat.unwrap().pushed().is_some(),
        "the heartbeat went through"
    );
}

/// An unordered node and an ordered one starting together: each looked for the other before
/// it registered, neither was there yet, and both relayed (most events twice, the unordered
/// node stopping only at its next heartbeat). After registering, a node announces itself
/// and looks again, and the one that finds the other is refused, leaving no row behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_peer_of_the_other_kind_registered_during_its_start_is_refused() {
    let (store, url) = store(4).await;
    let partitions = FaultyPartitions::new(store.clone());
    *partitions
        .ordered_peer_starts_after_the_first_look
        .lock()
        .unwrap() = Some(url.clone());
    let started = outbox_cluster::Coordinator::start_claiming(
        Arc::new(store.clone()),
        outbox_cluster::Claims::Unordered(Arc::new(partitions)),
        cluster_config("u1", Duration::from_millis(50), Duration::from_secs(1)),
    )
    .await;
    let Err(err) = started else {
        panic!("started beside the ordered node o1");
    };
    assert_eq!(err.kind(), outbox_core::StoreErrorKind::Config, "{err}");
    assert!(
        err.to_string()
            .contains("another way (o1, ordered (polling, --ordering key))"),
        "{err}"
    );
    let left = "SELECT count(*) FROM outbox_nodes WHERE id = 'u1'";
    assert_eq!(
        query_count(&crate::session(&url).await, left, &[])
            .await
            .unwrap(),
        0
    );
}

/// The real partitions table, with faults: the answer of one acquire that took
/// partitions lost after it committed (`acquire_answer_lost`), and listings of the nodes
/// sharing the partitions that fail (`peer_listings_to_fail` of them).
struct FaultyPartitions {
    store: PgStore,
    acquire_answer_lost: std::sync::atomic::AtomicBool,
    peer_listings_to_fail: std::sync::atomic::AtomicUsize,
    peer_listings_failed: std::sync::atomic::AtomicUsize,
    /// The database in which an ordered node `o1` registers right after the first look for
    /// nodes claiming the other way has read its answer (two nodes starting together).
    ordered_peer_starts_after_the_first_look: std::sync::Mutex<Option<String>>,
}

impl FaultyPartitions {
    fn new(store: PgStore) -> Self {
        FaultyPartitions {
            store,
            acquire_answer_lost: false.into(),
            peer_listings_to_fail: 0.into(),
            peer_listings_failed: 0.into(),
            ordered_peer_starts_after_the_first_look: Default::default(),
        }
    }
}

impl outbox_core::store::PartitionRegistry for FaultyPartitions {
    fn nodes_behind(
        &self,
        node: NodeId,
        protocol: u32,
        oldest: u32,
    ) -> outbox_core::store::StoreFuture<Vec<(String, u32)>> {
        self.store.nodes_behind(node, protocol, oldest)
    }
    fn partition_peers(&self) -> outbox_core::store::StoreFuture<Vec<String>> {
        use std::sync::atomic::Ordering::SeqCst;
        if self
            .peer_listings_to_fail
            .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            self.peer_listings_failed.fetch_add(1, SeqCst);
            return Box::pin(async {
                Err(outbox_core::StoreError::new(
                    outbox_core::StoreErrorKind::Query,
                    "canceling statement due to statement timeout (a fault of the test)",
                ))
            });
        }
        self.store.partition_peers()
    }
    fn partition_count(&self) -> outbox_core::store::StoreFuture<u32> {
        self.store.partition_count()
    }
    fn claim_mode_peers(
        &self,
        node: NodeId,
        way: outbox_core::store::Way,
        announce: bool,
    ) -> outbox_core::store::StoreFuture<Vec<(String, outbox_core::store::Way)>> {
        let looked = self.store.claim_mode_peers(node, way, announce);
        let racing = match announce {
            false => self
                .ordered_peer_starts_after_the_first_look
                .lock()
                .unwrap()
                .take(),
            true => None,
        };
        Box::pin(async move {
            let peers = looked.await?;
            if let Some(url) = racing {
                crate::session(&url)
                    .await
                    .batch_execute(
                        "INSERT INTO outbox_nodes (id, expiry, partitions_table)
                         VALUES ('o1', (now() AT TIME ZONE 'UTC') + interval '1 hour',
                                 '\"public\".\"outbox_partitions\"')",
                    )
                    .await
                    .unwrap();
            }
            Ok(peers)
        })
    }
    fn acquire(
        &self,
        node: NodeId,
        partitions: Vec<i32>,
        ttl: Duration,
    ) -> outbox_core::store::StoreFuture<Vec<(i32, i64)>> {
        let taken = self.store.acquire(node, partitions, ttl);
        if !self
            .acquire_answer_lost
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            return taken;
        }
        Box::pin(async move {
            assert!(
                !taken.await?.is_empty(),
                "the first acquire takes partitions"
            );
            Err(outbox_core::StoreError::new(
                outbox_core::StoreErrorKind::Connection,
                "connection lost before the answer (a fault of the test)",
            ))
        })
    }
    fn renew(
        &self,
        node: NodeId,
        held: Vec<(i32, i64)>,
        ttl: Duration,
    ) -> outbox_core::store::StoreFuture<Vec<i32>> {
        self.store.renew(node, held, ttl)
    }
    fn release_partitions(
        &self,
        node: NodeId,
        partitions: Vec<i32>,
    ) -> outbox_core::store::StoreFuture<u64> {
        self.store.release_partitions(node, partitions)
    }
    fn partitions(
        &self,
    ) -> outbox_core::store::StoreFuture<Vec<outbox_core::store::PartitionRecord>> {
        self.store.partitions()
    }
}

/// An acquire that committed and lost its answer left the partitions leased to the node,
/// which did not know it: its next acquire passed them over as another's live leases, and
/// they idled until the lease ran out (here 30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_whose_acquire_lost_its_answer_are_taken_at_the_next_round() {
    let (store, _url) = store(4).await;
    let ownership = outbox_core::Ownership::new(4);
    let coordinator = outbox_cluster::Coordinator::start(
        Arc::new(store.clone()),
        Some(outbox_cluster::Partitions {
            registry: Arc::new(FaultyPartitions {
                acquire_answer_lost: true.into(),
                ..FaultyPartitions::new(store)
            }),
            ownership: ownership.clone(),
        }),
        cluster_config("n1", Duration::from_millis(50), Duration::from_secs(30)),
    )
    .await
    .unwrap();
    eventually(
        "every partition held, well within the lease",
        Duration::from_secs(10),
        || {
            let held = ownership.held().len();
            async move { (held == 4).then_some(()) }
        },
    )
    .await;
    coordinator
        .stop(tokio::time::Instant::now() + Duration::from_secs(5))
        .await;
}

/// A node alone among the relays that take partitions, beside one that takes none (an
/// unordered relay, another outbox's). A failed listing of the partitions' peers counted
/// every live node: the node handed half its partitions to the one that takes none, where
/// they lay unserved until the next round gave them back. Now, as when the live nodes
/// cannot be listed, the leases held are renewed and nothing moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_listing_of_the_partitions_peers_moves_no_partition() {
    use outbox_core::store::NodeRegistry;
    use std::sync::atomic::Ordering::SeqCst;
    let (store, _url) = store(4).await;
    // Live for the whole test, taking no partitions.
    store
        .register(NodeId("takes-none".into()), Duration::from_secs(120))
        .await
        .unwrap();
    let partitions = Arc::new(FaultyPartitions::new(store.clone()));
    let ownership = outbox_core::Ownership::new(4);
    let coordinator = outbox_cluster::Coordinator::start(
        Arc::new(store.clone()),
        Some(outbox_cluster::Partitions {
            registry: partitions.clone(),
            ownership: ownership.clone(),
        }),
        cluster_config("n1", Duration::from_millis(50), Duration::from_secs(2)),
    )
    .await
    .unwrap();
    eventually("every partition held", Duration::from_secs(10), || {
        let held = ownership.held().len();
        async move { (held == 4).then_some(()) }
    })
    .await;
    partitions.peer_listings_to_fail.store(10, SeqCst);
    let publishable = || ownership.publishable(std::time::Instant::now()).0.len();
    let mut fewest = 4;
    while partitions.peer_listings_failed.load(SeqCst) < 10 {
        fewest = fewest.min(publishable());
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    fewest = fewest.min(publishable());
    coordinator
        .stop(tokio::time::Instant::now() + Duration::from_secs(5))
        .await;
    assert_eq!(
        fewest, 4,
        "partitions were handed to a node that takes none while the peers could not be listed"
    );
}
