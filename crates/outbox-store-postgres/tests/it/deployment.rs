//! Deployment faults at the store, against real PostgreSQL: a database that stops answering,
//! the gated wake-up in a cluster, and two-phase commit.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox_core::OutboxStore;
use outbox_store_postgres::{PgOptions, PgStore, Tables};
use outbox_testkit::{eventually, FaultProxy};

fn options(url: &str) -> PgOptions {
    PgOptions::new(url.to_string(), Tables::standard())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_on_a_blackholed_connection_ends_with_a_retryable_error() {
    let url = outbox_testkit::fresh_pg_database().await;
    PgStore::new(options(&url))
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let (proxy, proxied) = FaultProxy::start_for_url(&url).await.unwrap();
    let store = PgStore::new(PgOptions {
        operation_timeout: Some(Duration::from_secs(1)),
        ..options(&proxied)
    })
    .unwrap();
    outbox_testkit::conformance::a_claim_through_a_blackhole_fails_retryably(&store, &proxy).await;
}

fn gated(url: &str, name: &str) -> PgStore {
    let mut options = options(url);
    options.tables.gated_wakeup = true;
    options.application_name = Some(name.into());
    PgStore::new(options).unwrap()
}

/// Subscribes `store` and counts its wake-ups.
fn count_wakeups(store: &PgStore) -> (Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    let count = Arc::new(AtomicUsize::new(0));
    let counter = count.clone();
    let task = store
        .subscribe(Arc::new(move || {
            counter.fetch_add(1, Ordering::Relaxed);
        }))
        .expect("PostgreSQL subscribes");
    (count, tokio::spawn(task))
}

/// The application name of the session holding the gate exclusively, if any.
async fn gate_holder(admin: &tokio_postgres::Client) -> Option<String> {
    admin
        .query_opt(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid)
              WHERE l.locktype = 'advisory' AND l.mode = 'ExclusiveLock' AND l.granted
                AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            &[],
        )
        .await
        .unwrap()
        .map(|r| r.get(0))
}

/// When `application_name`'s session last started a try for the gate (its wake-up
/// connection runs nothing else): the first such start after `after`, awaited.
async fn next_gate_try(
    admin: &tokio_postgres::Client,
    application_name: &str,
    after: Option<&str>,
) -> String {
    eventually(
        &format!("{application_name} to try for the gate again"),
        Duration::from_secs(30),
        || async {
            let started: Option<String> = admin
                .query_opt(
                    "SELECT query_start::text FROM pg_stat_activity
                      WHERE application_name = $1 AND query LIKE '%pg_try_advisory_lock%'",
                    &[&application_name],
                )
                .await
                .unwrap()
                .and_then(|row| row.get(0));
            started.filter(|at| Some(at.as_str()) != after)
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_another_relays_gate_a_waiting_relay_is_not_woken_by_its_tries_for_it() {
    let url = outbox_testkit::fresh_pg_database().await;
    let (admin, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let holder = gated(&url, "gate-a");
    holder.migrate().await.unwrap();
    let (_, a_task) = count_wakeups(&holder);
    holder.set_waiting(true);
    eventually(
        "relay a to hold the gate",
        Duration::from_secs(30),
        || async { (gate_holder(&admin).await.as_deref() == Some("gate-a")).then_some(()) },
    )
    .await;

    let other = gated(&url, "gate-b");
    let (b_wakeups, b_task) = count_wakeups(&other);
    other.set_waiting(true);
    // Relay b is woken once after its LISTEN, before its first try for the gate; from then
    // on, tries that find relay a holding the gate must not wake it (the bug woke it after
    // each one, every 5 ms). Counted over tries, not over a stretch of time, so the
    // host's speed cannot decide the outcome.
    let first = next_gate_try(&admin, "gate-b", None).await;
    let woken_before = b_wakeups.load(Ordering::SeqCst);
    let second = next_gate_try(&admin, "gate-b", Some(&first)).await;
    next_gate_try(&admin, "gate-b", Some(&second)).await;
    assert_eq!(
        gate_holder(&admin).await.as_deref(),
        Some("gate-a"),
        "relay a held the gate throughout"
    );
    let woken = b_wakeups.load(Ordering::SeqCst) - woken_before;
    assert_eq!(
        woken, 0,
        "relay b was woken {woken} times by two tries for a gate relay a holds"
    );

    // When relay a goes to work, it gives the gate up, and relay b takes it.
    holder.set_waiting(false);
    eventually(
        "relay b to take the gate",
        Duration::from_secs(30),
        || async { (gate_holder(&admin).await.as_deref() == Some("gate-b")).then_some(()) },
    )
    .await;
    a_task.abort();
    b_task.abort();
}

/// A statement the store gave up on (its operation timeout) is ended by the server too: its
/// backend waited on for the lock (keeping the row locks it had taken), and every retry
/// left one more such backend, until the application's connections ran out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_the_store_gave_up_on_does_not_wait_on_in_the_server() {
    let url = outbox_testkit::fresh_pg_database().await;
    PgStore::new(options(&url))
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let store = PgStore::new(PgOptions {
        operation_timeout: Some(Duration::from_secs(1)),
        application_name: Some("bounded-store".into()),
        ..options(&url)
    })
    .unwrap();
    let (mut locker, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let lock = locker.transaction().await.unwrap();
    lock.batch_execute("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let request = outbox_core::store::ClaimRequest::new(
        outbox_core::NodeId("n1".into()),
        10,
        Duration::from_secs(30),
    );
    let claimed = store.claim(request).await;
    assert!(
        claimed.as_ref().is_err_and(|e| e.is_retryable()),
        "{claimed:?}"
    );
    // Said as what it is, a wait for another session's lock, not a lost connection.
    let said = claimed.unwrap_err().report();
    assert!(said.contains("pg_blocking_pids"), "{said}");
    let (admin, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    outbox_testkit::wait_for_count(
        "the store's waiting statement to end",
        &admin,
        "SELECT count(*) FROM pg_stat_activity
          WHERE application_name = 'bounded-store' AND wait_event_type = 'Lock'",
        0,
        Duration::from_secs(10),
    )
    .await;
    lock.rollback().await.unwrap();
}

/// A fresh migrated database with `setting` (`name = value`, quotes doubled) set on it for
/// every new session, and a session of the test's opened before it.
async fn migrated_with_database_setting(setting: &str) -> (String, tokio_postgres::Client) {
    let url = outbox_testkit::fresh_pg_database().await;
    PgStore::new(options(&url))
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let (admin, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    admin
        .batch_execute(&format!(
            "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET {setting}', current_database());
             END $$"
        ))
        .await
        .unwrap();
    (url, admin)
}

/// A primary that refuses writes (`default_transaction_read_only`, as a cutover's freeze or
/// a service gone read-only on a full disk sets it) passed `check`, and every claim then
/// failed, retried without end, with a hint pointing at the tables. `check` names it, and
/// the claim's error says the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_refuses_writes_is_named_by_check_and_by_the_claims() {
    let (url, _admin) = migrated_with_database_setting("default_transaction_read_only = on").await;
    let store = PgStore::new(options(&url)).unwrap();
    let problems = store.verify().await.unwrap();
    let said: Vec<String> = problems.iter().map(ToString::to_string).collect();
    assert!(
        said.iter()
            .any(|p| p.contains("refuses writes") && p.contains("make it writable")),
        "{said:?}"
    );
    let claimed = store
        .claim(outbox_core::store::ClaimRequest::new(
            outbox_core::NodeId("n1".into()),
            10,
            Duration::from_secs(30),
        ))
        .await;
    let error = claimed.unwrap_err();
    assert!(error.is_retryable(), "{error:?}");
    assert!(
        error.report().contains("make it writable"),
        "{}",
        error.report()
    );
}

/// An `idle_session_timeout` set on the database (PostgreSQL 14+) ended the LISTEN session
/// (and a mapped layout's lock session) at every period: the lock was taken again each
/// time, giving back the rows in flight. Those sessions keep no such timeout: the listener
/// stays idle past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_session_outlives_the_databases_idle_session_timeout() {
    let (url, admin) = migrated_with_database_setting("idle_session_timeout = ''1s''").await;
    let mut options = options(&url);
    options.application_name = Some("idle-listener".into());
    let store = PgStore::new(options).unwrap();
    let (_wakeups, listening) = count_wakeups(&store);
    outbox_testkit::wait_for_count(
        "the LISTEN session idle for 3 s",
        &admin,
        "SELECT count(*) FROM pg_stat_activity
          WHERE application_name = 'idle-listener' AND state = 'idle'
            AND query LIKE 'LISTEN%' AND state_change < now() - interval '3 s'",
        1,
        Duration::from_secs(20),
    )
    .await;
    listening.abort();
}

/// `migrate` of a mapped layout runs again at every `run --auto-migrate`. Its `ADD COLUMN IF
/// NOT EXISTS` and `CREATE INDEX IF NOT EXISTS` took their locks before looking, so behind a
/// transaction that wrote the table (a batch job, a session left idle in transaction) they
/// waited for as long as it lasted, and every insert of the application queued behind them.
/// Now nothing there is locked, and a lock that is needed is waited for 5 s at most.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrating_a_mapped_table_again_holds_no_insert_behind_a_long_transaction() {
    use outbox_store_postgres::mapped::MappedPgOptions;
    use outbox_store_postgres::MappedPgStore;
    let url = outbox_testkit::fresh_pg_database().await;
    let store = move |url: &str| {
        MappedPgStore::new(MappedPgOptions {
            pg: options(url),
            mapping: outbox_layout::Mapping::debezium("public", "outboxevent"),
            layout: "debezium".into(),
            max_attempts: 20,
        })
        .unwrap()
    };
    store(&url).migrate().await.unwrap();
    let connect = || async {
        let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        client
    };
    let insert = "INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload)
                  VALUES (gen_random_uuid(), 'order', '1', 'created', '{}')";
    // A transaction that wrote the table and stays open.
    let writer = connect().await;
    writer.batch_execute("BEGIN").await.unwrap();
    writer.batch_execute(insert).await.unwrap();
    let again = store(&url);
    let migrating = tokio::spawn(async move { again.migrate().await });
    // The application's next insert, once migrate is done or waits for a lock.
    let application = connect().await;
    eventually(
        "migrate done or waiting",
        Duration::from_secs(30),
        || async {
            let waiting: i64 = application
                .query_one(
                    "SELECT count(*) FROM pg_locks
                  WHERE NOT granted AND database = (SELECT oid FROM pg_database
                                                    WHERE datname = current_database())",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            (migrating.is_finished() || waiting > 0).then_some(())
        },
    )
    .await;
    application
        .batch_execute("SET statement_timeout = '3s'")
        .await
        .unwrap();
    let inserted = application.batch_execute(insert).await;
    writer.batch_execute("COMMIT").await.unwrap();
    assert!(inserted.is_ok(), "the application's insert: {inserted:?}");
    migrating.await.unwrap().unwrap();
}

/// A fresh database migrated by a native store, and a client of its own on it.
async fn migrated_with_a_client() -> (String, PgStore, tokio_postgres::Client) {
    let url = outbox_testkit::fresh_pg_database().await;
    let store = PgStore::new(options(&url)).unwrap();
    store.migrate().await.unwrap();
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    (url, store, client)
}

/// A native outbox without its wake-up trigger (made by the application's own migration
/// tool, or the trigger dropped): `migrate`, as `check` advises, creates it, and the
/// trigger's lock on the table waited behind any transaction that wrote it, for as long as
/// that lasted, every insert of the application queued behind. The wait is now bounded:
/// `migrate` fails after it, saying to run it again once the transaction ends, and then
/// makes the trigger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_trigger_waits_for_its_lock_a_bounded_time() {
    let (url, _, writer) = migrated_with_a_client().await;
    let triggers = "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'outbox'::regclass
                    AND NOT tgisinternal";
    let trigger: String = writer
        .query_one(
            "SELECT tgname::text FROM pg_trigger WHERE tgrelid = 'outbox'::regclass
             AND NOT tgisinternal",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    writer
        .batch_execute(&format!("DROP TRIGGER \"{trigger}\" ON outbox"))
        .await
        .unwrap();
    // A transaction that wrote the outbox and stays open.
    writer.batch_execute("BEGIN").await.unwrap();
    writer
        .batch_execute(
            "INSERT INTO outbox (destination, partition_key, event_type, payload)
             VALUES ('d', 'k', 't', '{}')",
        )
        .await
        .unwrap();
    let again = PgStore::new(options(&url)).unwrap();
    let migrated = tokio::time::timeout(Duration::from_secs(30), again.migrate())
        .await
        .expect("migrate waited for the lock without bound");
    let err = migrated.expect_err("the trigger's lock is held");
    assert!(
        err.report().contains("run `outbox-relay migrate` again"),
        "{}",
        err.report()
    );
    writer.batch_execute("COMMIT").await.unwrap();
    again.migrate().await.unwrap();
    let n: i64 = writer.query_one(triggers, &[]).await.unwrap().get(0);
    assert_eq!(n, 1, "migrate made the trigger once the transaction ended");
}

/// A schema a newer relay migrated, which this one cannot run on, reached by this relay's
/// `migrate` (it read the version before taking the migrate lock, while the newer relay
/// migrated: a rolling upgrade). Under the lock, the store returned and then put its own
/// wake-up function over the newer relay's. It now refuses the schema there, and leaves the
/// function as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_schema_found_under_the_migrate_lock_is_refused_and_left_alone() {
    let (_, store, client) = migrated_with_a_client().await;
    let function: String = client
        .query_one(
            "SELECT tgfoid::regproc::text FROM pg_trigger WHERE tgrelid = 'outbox'::regclass
             AND NOT tgisinternal",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // What a newer relay leaves: a later version only relays from it on may run on, and a
    // wake-up function of its own.
    client
        .batch_execute(&format!(
            "UPDATE outbox_versions SET version = version + 5, readable_from = version + 5
              WHERE component = 'outbox';
             CREATE OR REPLACE FUNCTION {function}() RETURNS trigger AS $$
             BEGIN -- the newer relay's
                 RETURN NULL;
             END $$ LANGUAGE plpgsql;"
        ))
        .await
        .unwrap();
    let err = store.migrate().await.expect_err("a newer schema");
    assert_eq!(
        err.kind(),
        outbox_core::StoreErrorKind::SchemaVersion,
        "{}",
        err.report()
    );
    let body: String = client
        .query_one(
            &format!("SELECT prosrc FROM pg_proc WHERE oid = '{function}'::regproc"),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(body.contains("the newer relay's"), "replaced: {body}");
}

/// An index a recorded step built, gone since (dropped by hand, a restore without it):
/// `check` and `run` refuse to run and name `migrate` as the fix, but every step was
/// recorded, so `migrate` did nothing and the relay stayed down. `migrate` builds it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_builds_again_an_index_gone_since_its_step() {
    let (_, store, client) = migrated_with_a_client().await;
    for index in store.tables().concurrent_indexes() {
        client
            .batch_execute(&format!("DROP INDEX {index}"))
            .await
            .unwrap();
    }
    assert!(
        !store.verify().await.unwrap().is_empty(),
        "check names the missing indexes"
    );
    store.migrate().await.unwrap();
    for index in store.tables().concurrent_indexes() {
        let valid: bool = client
            .query_one(
                "SELECT coalesce((SELECT indisvalid FROM pg_index
                                   WHERE indexrelid = to_regclass($1)), false)",
                &[&index],
            )
            .await
            .unwrap()
            .get(0);
        assert!(valid, "{index} built again");
    }
    let problems = store.verify().await.unwrap();
    assert!(problems.is_empty(), "{problems:?}");
}

/// The plan's text lines of `EXPLAIN (ANALYZE) sql` on `client`.
async fn explained(client: &tokio_postgres::Client, sql: &str) -> Vec<String> {
    client
        .simple_query(&format!("EXPLAIN (ANALYZE) {sql}"))
        .await
        .unwrap()
        .into_iter()
        .filter_map(|message| match message {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_string),
            _ => None,
        })
        .collect()
}

/// The store's sessions price sorts out (`enable_sort=off`), so a statement that must sort
/// all the same costs past `jit_above_cost`, and PostgreSQL compiled it at every execution:
/// 150-250 ms each for two of WAL capture's start-up checks, half a second before a relay
/// streamed. The sessions run without the JIT compiler, which none of their short
/// statements gains from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_that_must_sort_is_not_compiled_at_each_execution() {
    let url = outbox_testkit::fresh_pg_database().await;
    let sorting = "SELECT relname FROM pg_catalog.pg_class ORDER BY relname::text";
    let (plain, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    plain.batch_execute("SET enable_sort = off").await.unwrap();
    let priced_out = explained(&plain, sorting).await;
    assert!(
        priced_out.iter().any(|line| line.starts_with("JIT:")),
        "the test server compiles a priced-out sort (its JIT, llvmjit, is installed and on): {priced_out:#?}"
    );

    let store = PgStore::new(options(&url)).unwrap();
    store
        .batch_execute(&format!(
            "DO $$ DECLARE line text; BEGIN
               FOR line IN EXECUTE 'EXPLAIN (ANALYZE) {sorting}' LOOP
                 IF line LIKE 'JIT:%' THEN RAISE EXCEPTION 'compiled: %', line; END IF;
               END LOOP; END $$"
        ))
        .await
        .unwrap();
}

/// The active relay of a mapped table whose lock's session ended (a killed backend)
/// publishes nothing more of what it held ([`MappedStore::keep_active`]).
///
/// [`MappedStore::keep_active`]: outbox_layout::store::MappedStore::keep_active
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_table_lock_ended_publishes_nothing_more_of_what_it_held() {
    use futures::FutureExt;
    use outbox_store_postgres::mapped::MappedPgOptions;
    use outbox_store_postgres::MappedPgStore;

    let url = outbox_testkit::fresh_pg_database().await;
    let store = MappedPgStore::new(MappedPgOptions {
        pg: options(&url),
        mapping: outbox_layout::Mapping::debezium("public", "outboxevent"),
        layout: "debezium".into(),
        max_attempts: 20,
    })
    .unwrap();
    store.migrate().await.unwrap();
    let take_over = async move {
        let admin = crate::conformance::connect(&url).await;
        let other = crate::conformance::connect(&url).await;
        let taking = tokio::spawn(async move {
            other
                .execute(
                    "SELECT pg_advisory_lock(hashtext('outbox-relay public.outboxevent'))",
                    &[],
                )
                .await
                .unwrap();
            // Held for the rest of the test.
            std::mem::forget(other);
        });
        let this_database =
            "database = (SELECT oid FROM pg_database WHERE datname = current_database())";
        eventually("the other relay waits for the lock", Duration::from_secs(20), || async {
            let waiting: i64 = admin
                .query_one(
                    &format!("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND {this_database}"),
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            (waiting > 0).then_some(())
        })
        .await;
        admin
            .execute(
                &format!("SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND granted AND {this_database}"),
                &[],
            )
            .await
            .unwrap();
        taking.await.unwrap();
    };
    outbox_testkit::active_relay::a_relay_whose_table_lock_ended_publishes_nothing_more_of_what_it_held(
        Arc::new(store.clone()),
        |ownership| {
            store
                .keep_active(ownership, Duration::from_secs(30), outbox_core::Health::new())
                .boxed()
        },
        take_over.boxed(),
    )
    .await;
}
