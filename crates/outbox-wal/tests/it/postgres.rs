//! WAL capture against the real PostgreSQL 15 (`wal_level = logical`): commit order,
//! rollbacks, emitted messages, restart from the confirmed position, and a 100,000-event
//! transaction streamed without buffering.
//!
//! Every test makes its own database and slot, and drops the slot when it ends, passed or
//! not: a slot left behind pins WAL for everyone on the server.

use std::time::Duration;

use outbox_core::ident::{Ident, TableName};
use outbox_store_postgres::schema::Tables;
use outbox_wal::{
    drop_slot, emit_function_ddl, publication_ddl, Acknowledgements, EventPosition, EventSource,
    Lsn, Output, WalConfig, WalError, WalEvent, WalStream,
};
use tokio_postgres::{Client, NoTls};

const PUBLICATION: &str = "outbox_wal_test";

/// A fresh database with the native outbox, `outbox_emit` and a publication of the
/// outbox's INSERTs, and a slot name of its own, dropped on drop.
struct Fixture {
    url: String,
    config: WalConfig,
    _slot: outbox_testkit::SlotGuard,
}

impl Fixture {
    async fn new() -> Fixture {
        let url = outbox_testkit::fresh_pg_database().await;
        let db = connect(&url).await;
        // The native schema by its steps (some build indexes outside a transaction).
        outbox_store_postgres::PgStore::new(outbox_store_postgres::PgOptions::new(
            &url,
            Tables::standard(),
        ))
        .unwrap()
        .migrate()
        .await
        .unwrap();
        db.batch_execute(&emit_function_ddl(
            &outbox_core::ident::TableName::new("public", "outbox").unwrap(),
        ))
        .await
        .unwrap();
        let publication = publication_ddl(
            &Ident::new(PUBLICATION, "publication").unwrap(),
            &TableName::new("public", "outbox").unwrap(),
        );
        // Twice: `migrate` runs it on every start.
        db.batch_execute(&publication).await.unwrap();
        db.batch_execute(&publication).await.unwrap();
        let slot = format!("t_{}", uuid::Uuid::new_v4().simple());
        let mut config = WalConfig::new(
            url.clone(),
            slot,
            PUBLICATION,
            TableName::new("public", "outbox").unwrap(),
        );
        config.status_interval = Duration::from_millis(50);
        Fixture {
            _slot: outbox_testkit::SlotGuard {
                url: url.clone(),
                slot: config.slot.clone(),
            },
            url,
            config,
        }
    }

    async fn start(&self) -> WalStream {
        start(&self.config).await
    }

    /// Records the slot as a relay's session would (`<outbox>_adopted`, as `migrate
    /// --capture wal` makes it): the emit function accepts events only while a slot
    /// recorded there streams. For the tests that read the stream without the capture.
    async fn record_the_slot_as_the_relays(&self, db: &tokio_postgres::Client) {
        db.batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS outbox_adopted (slot text PRIMARY KEY,
                 adopted_at timestamptz NOT NULL DEFAULT now(), publication_version text NULL);
             INSERT INTO outbox_adopted (slot) VALUES ('{}');",
            self.config.slot
        ))
        .await
        .unwrap();
    }
}

/// Starts a session. A slot whose previous consumer has just gone may still show as active
/// for a moment (the server releases it when that walsender's command ends): that refusal
/// (object_in_use), and only that, is retried.
async fn start(config: &WalConfig) -> WalStream {
    let mut tries = 0;
    loop {
        match WalStream::start(config).await {
            Ok(stream) => return stream,
            Err(WalError::Connection(e)) if e.to_string().contains("55006") && tries < 100 => {
                tries += 1;
                eprintln!("slot still active, retry {tries}: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("start WAL capture: {e}"),
        }
    }
}

async fn connect(url: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.unwrap();
    tokio::spawn(connection);
    client
}

async fn insert(db: &Client, key: &str, n: i32) -> i64 {
    db.query_one(
        "INSERT INTO outbox (destination, partition_key, event_type, payload)
         VALUES ('orders', $1, 'Placed', jsonb_build_object('n', $2::int4)) RETURNING sequence_id",
        &[&key, &n],
    )
    .await
    .unwrap()
    .get(0)
}

/// One transaction as the stream delivered it.
#[derive(Debug)]
struct Transaction {
    commit_lsn: Lsn,
    end_lsn: Lsn,
    events: Vec<(EventPosition, WalEvent)>,
}

async fn next(stream: &mut WalStream) -> Output {
    // A bound on a hang, not a synchronisation: every awaited output was already committed.
    tokio::time::timeout(Duration::from_secs(60), stream.next())
        .await
        .expect("an output within 60 s")
        .expect("the stream works")
        .expect("the stream is open")
}

/// Reads until `count` transactions with events have committed; events are registered in
/// `acks`. Transactions without events (another prefix's messages) are passed over.
async fn read_transactions(
    stream: &mut WalStream,
    acks: &mut Acknowledgements,
    count: usize,
) -> Vec<Transaction> {
    let mut done = Vec::new();
    let mut events = Vec::new();
    while done.len() < count {
        let output = next(stream).await;
        acks.observe(&output);
        match output {
            Output::Event { position, event } => {
                events.push((position, event.expect("a decodable event")))
            }
            Output::Committed {
                commit_lsn,
                end_lsn,
                events: n,
                ..
            } => {
                assert_eq!(n as usize, events.len());
                if n > 0 {
                    done.push(Transaction {
                        commit_lsn,
                        end_lsn,
                        events: std::mem::take(&mut events),
                    });
                }
            }
            Output::Idle { .. } | Output::Skipped { .. } => {}
        }
    }
    done
}

/// `transactions` transactions of `events` events each, event `e` of transaction `t` of key
/// `k{e}` with payload `n` = `t * 10 + e`.
async fn write_transactions(db: &Client, transactions: i32, events: i32) {
    for t in 0..transactions {
        db.batch_execute("BEGIN").await.unwrap();
        for e in 0..events {
            insert(db, &format!("k{e}"), t * 10 + e).await;
        }
        db.batch_execute("COMMIT").await.unwrap();
    }
}

/// A stream started, then [`write_transactions`] written and read back whole.
async fn written_and_read(
    transactions: i32,
    events: i32,
) -> (
    Fixture,
    WalStream,
    Client,
    Acknowledgements,
    Vec<Transaction>,
) {
    let fixture = Fixture::new().await;
    let mut stream = fixture.start().await;
    let db = connect(&fixture.url).await;
    write_transactions(&db, transactions, events).await;
    let mut acks = Acknowledgements::new(stream.slot().confirmed_flush);
    let read = read_transactions(&mut stream, &mut acks, transactions as usize).await;
    (fixture, stream, db, acks, read)
}

/// Confirms `at`, ends the session, and checks the slot holds it.
async fn confirm_and_stop(fixture: &Fixture, mut stream: WalStream, at: Lsn) {
    stream.confirm(at);
    stream.stop(Duration::from_secs(10)).await.unwrap();
    let probe = connect(&fixture.url).await;
    assert_eq!(slot_confirmed(&probe, &fixture.config.slot).await, at);
}

/// The slot's confirmed position, as the server has it.
async fn slot_confirmed(db: &Client, slot: &str) -> Lsn {
    let confirmed: String = db
        .query_one(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    confirmed.parse().unwrap()
}

/// The payloads' `n` of `transactions`' events, in order.
fn payloads(transactions: &[Transaction]) -> Vec<i64> {
    transactions
        .iter()
        .flat_map(|t| t.events.iter().map(|(_, e)| payload_n(e)))
        .collect()
}

fn payload_n(event: &WalEvent) -> i64 {
    let value: serde_json::Value = serde_json::from_slice(event.payload.as_bytes()).unwrap();
    value["n"].as_i64().unwrap()
}

fn sequence_id(event: &WalEvent) -> i64 {
    match event.source {
        EventSource::Table {
            sequence_id: Some(id),
        } => id,
        other => panic!("not a table row: {other:?}"),
    }
}

#[tokio::test]
async fn transactions_arrive_in_commit_order_not_sequence_order() {
    let fixture = Fixture::new().await;
    let mut stream = fixture.start().await;
    assert!(stream.slot().created);
    // Five writers open their transactions in order (so their rows draw sequence ids in
    // order), then commit in another order.
    let mut writers = Vec::new();
    for i in 0..5 {
        let db = connect(&fixture.url).await;
        db.batch_execute("BEGIN").await.unwrap();
        let a = insert(&db, "k", i * 10).await;
        let b = insert(&db, "k", i * 10 + 1).await;
        assert!(a < b);
        writers.push(db);
    }
    let commit_order = [3, 0, 4, 1, 2];
    for &i in &commit_order {
        writers[i].batch_execute("COMMIT").await.unwrap();
    }

    let mut acks = Acknowledgements::new(stream.slot().confirmed_flush);
    let transactions = read_transactions(&mut stream, &mut acks, 5).await;
    let delivered: Vec<Vec<i64>> = transactions
        .iter()
        .map(|t| t.events.iter().map(|(_, e)| payload_n(e)).collect())
        .collect();
    let expected: Vec<Vec<i64>> = commit_order
        .iter()
        .map(|&i| vec![i as i64 * 10, i as i64 * 10 + 1])
        .collect();
    assert_eq!(delivered, expected);
    // Sequence ids are not in delivery order: the WAL's order is the commit order.
    let ids: Vec<i64> = transactions
        .iter()
        .flat_map(|t| t.events.iter().map(|(_, e)| sequence_id(e)))
        .collect();
    assert_ne!(ids, {
        let mut sorted = ids.clone();
        sorted.sort();
        sorted
    });
    for pair in transactions.windows(2) {
        assert!(pair[0].end_lsn <= pair[1].commit_lsn);
    }
    for t in &transactions {
        let ordinals: Vec<u64> = t.events.iter().map(|(p, _)| p.ordinal).collect();
        assert_eq!(ordinals, vec![0, 1]);
        assert!(t.events.iter().all(|(p, _)| p.commit_lsn == t.commit_lsn));
        let event = &t.events[0].1;
        assert_eq!(
            (
                event.destination.as_str(),
                event.ordering_key(),
                event.event_type.as_str()
            ),
            ("orders", "k", "Placed")
        );
    }
    stream.stop(Duration::from_secs(5)).await.unwrap();
}

#[tokio::test]
async fn rolled_back_rows_never_appear() {
    let fixture = Fixture::new().await;
    let mut stream = fixture.start().await;
    let db = connect(&fixture.url).await;
    fixture.record_the_slot_as_the_relays(&db).await;
    db.batch_execute("BEGIN").await.unwrap();
    insert(&db, "k", 1).await;
    db.batch_execute("ROLLBACK").await.unwrap();
    // A committed transaction whose savepoint was rolled back keeps only the rest.
    db.batch_execute("BEGIN").await.unwrap();
    insert(&db, "k", 2).await;
    db.batch_execute("SAVEPOINT s").await.unwrap();
    insert(&db, "k", 3).await;
    db.batch_execute("ROLLBACK TO SAVEPOINT s").await.unwrap();
    insert(&db, "k", 4).await;
    db.batch_execute("COMMIT").await.unwrap();
    // A rolled-back emitted message is gone too.
    db.batch_execute("BEGIN; SELECT outbox_emit('orders', 'k', 'Placed', '{\"n\": 5}'); ROLLBACK;")
        .await
        .unwrap();
    insert(&db, "k", 6).await;

    let mut acks = Acknowledgements::new(stream.slot().confirmed_flush);
    let transactions = read_transactions(&mut stream, &mut acks, 2).await;
    let delivered: Vec<Vec<i64>> = transactions
        .iter()
        .map(|t| t.events.iter().map(|(_, e)| payload_n(e)).collect())
        .collect();
    assert_eq!(delivered, vec![vec![2, 4], vec![6]]);
    stream.stop(Duration::from_secs(5)).await.unwrap();
    // The operator's drop waits for the stopped session to release the slot.
    assert!(drop_slot(&fixture.config, |_| {}).await.unwrap());
    assert!(!drop_slot(&fixture.config, |_| {}).await.unwrap());
}

#[tokio::test]
async fn emitted_messages_interleave_with_rows_in_commit_order() {
    let fixture = Fixture::new().await;
    let mut stream = fixture.start().await;
    let db = connect(&fixture.url).await;
    fixture.record_the_slot_as_the_relays(&db).await;
    let early = connect(&fixture.url).await;
    // Opened first, committed last.
    early.batch_execute("BEGIN").await.unwrap();
    let early_id: uuid::Uuid = early
        .query_one(
            "SELECT outbox_emit('orders', 'k', 'Placed', '{\"n\": 1}', '{\"trace\": \"t\"}')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    insert(&db, "k", 2).await;
    db.batch_execute(
        "BEGIN;
         INSERT INTO outbox (destination, partition_key, event_type, payload)
              VALUES ('orders', 'k', 'Placed', '{\"n\": 3}');
         SELECT outbox_emit('orders', NULL, 'Placed', '{\"n\": 4}');
         SELECT pg_logical_emit_message(true, 'not-outbox', 'ignored');
         SELECT pg_logical_emit_message(false, 'outbox', '{\"destination\":\"d\",\"type\":\"t\"}');
         INSERT INTO outbox (destination, partition_key, event_type, payload)
              VALUES ('orders', 'k', 'Placed', '{\"n\": 5}');
         COMMIT;",
    )
    .await
    .unwrap();
    early.batch_execute("COMMIT").await.unwrap();
    let message_error = db
        .batch_execute("SELECT outbox_emit(NULL, 'k', 'Placed', '{}')")
        .await
        .unwrap_err();
    assert!(message_error
        .as_db_error()
        .is_some_and(|e| e.message().contains("must not be NULL")));

    let mut acks = Acknowledgements::new(stream.slot().confirmed_flush);
    let mut skipped = 0;
    let mut events = Vec::new();
    let mut commits = 0;
    while commits < 3 {
        let output = next(&mut stream).await;
        acks.observe(&output);
        match output {
            Output::Event { event, .. } => events.push(event.unwrap()),
            Output::Committed { events: n, .. } if n > 0 => commits += 1,
            Output::Skipped { .. } => skipped += 1,
            _ => {}
        }
    }
    let order: Vec<(i64, bool)> = events
        .iter()
        .map(|e| {
            (
                payload_n(e),
                matches!(e.source, EventSource::Message { .. }),
            )
        })
        .collect();
    assert_eq!(
        order,
        vec![(2, false), (3, false), (4, true), (5, false), (1, true)]
    );
    assert_eq!(skipped, 1);
    let early_event = &events[4];
    assert_eq!(early_event.event_id, early_id);
    assert_eq!(early_event.headers["trace"], "t");
    assert_eq!(early_event.ordering_key(), "k");
    assert_eq!(events[2].ordering_key(), "orders");
    assert_eq!(stream.assembler().stats().other_messages, 1);
    stream.stop(Duration::from_secs(5)).await.unwrap();
}

/// A keepalive between two transactions may carry the position of the second's commit record
/// (the server had read everything before it), and the relay then confirms exactly there.
/// PostgreSQL skips on restart only the transactions whose commit record starts before the
/// confirmed position, so the second comes again, whole.
#[tokio::test]
async fn a_slot_confirmed_at_a_commit_record_sends_that_transaction_again() {
    let (fixture, stream, db, _, transactions) = written_and_read(3, 2).await;
    let at_commit = transactions[1].commit_lsn;
    assert!(at_commit >= transactions[0].end_lsn);
    confirm_and_stop(&fixture, stream, at_commit).await;

    // One more transaction marks the end of what comes again.
    insert(&db, "k0", 99).await;
    let mut stream = fixture.start().await;
    let mut acks = Acknowledgements::new(stream.slot().confirmed_flush);
    let mut again = Vec::new();
    while !again
        .last()
        .is_some_and(|t: &Transaction| t.events.iter().any(|(_, e)| payload_n(e) == 99))
    {
        again.extend(read_transactions(&mut stream, &mut acks, 1).await);
    }
    assert_eq!(payloads(&again), vec![10, 11, 20, 21, 99]);
    assert_eq!(again[0].commit_lsn, at_commit);
    stream.stop(Duration::from_secs(5)).await.unwrap();
}

#[tokio::test]
async fn a_restart_resumes_after_the_confirmed_transaction() {
    let (fixture, stream, db, mut acks, transactions) = written_and_read(6, 3).await;
    // The sink confirmed the first three transactions, and one event of the fourth.
    for t in &transactions[..3] {
        for (position, _) in &t.events {
            acks.settle(*position).unwrap();
        }
    }
    acks.settle(transactions[3].events[0].0).unwrap();
    let confirmable = acks.confirmable();
    // Past the third transaction, never past the fourth's commit record. A keepalive read
    // between the two carries the position the server had read up to: past the third's end
    // when other databases wrote (their transactions are skipped by this slot), and the
    // fourth's commit record itself when it was the next record the server read. A slot
    // confirmed there sends the fourth again
    // (`a_slot_confirmed_at_a_commit_record_sends_that_transaction_again`).
    assert!(
        confirmable >= transactions[2].end_lsn && confirmable <= transactions[3].commit_lsn,
        "{confirmable} after {} and before {}",
        transactions[2].end_lsn,
        transactions[3].commit_lsn
    );
    confirm_and_stop(&fixture, stream, confirmable).await;

    // One more transaction while the relay is away.
    insert(&db, "k0", 60).await;
    let mut stream = fixture.start().await;
    assert!(!stream.slot().created);
    assert_eq!(stream.slot().confirmed_flush, confirmable);
    let mut acks = Acknowledgements::new(stream.slot().confirmed_flush);
    let again = read_transactions(&mut stream, &mut acks, 4).await;
    let delivered = payloads(&again);
    // The fourth transaction comes again whole (its settled event too), at the same
    // positions, and nothing before it.
    assert_eq!(delivered, vec![30, 31, 32, 40, 41, 42, 50, 51, 52, 60]);
    for (before, after) in transactions[3..].iter().zip(&again) {
        assert_eq!(before.commit_lsn, after.commit_lsn);
        let ids = |t: &Transaction| -> Vec<uuid::Uuid> {
            t.events.iter().map(|(_, e)| e.event_id).collect()
        };
        assert_eq!(ids(before), ids(after));
    }
    stream.stop(Duration::from_secs(5)).await.unwrap();
}

#[tokio::test]
async fn a_large_transaction_streams_through_without_being_buffered() {
    const EVENTS: u64 = 100_000;
    let fixture = Fixture::new().await;
    let mut stream = fixture.start().await;
    let db = connect(&fixture.url).await;
    let started = std::time::Instant::now();
    db.batch_execute(&format!(
        "INSERT INTO outbox (destination, partition_key, event_type, payload)
         SELECT 'orders', 'k' || (g % 100), 'Placed', jsonb_build_object('n', g)
           FROM generate_series(1, {EVENTS}) g"
    ))
    .await
    .unwrap();
    let inserted = started.elapsed();

    let mut acks = Acknowledgements::new(stream.slot().confirmed_flush);
    let mut handed_out = 0u64;
    let mut max_buffered = 0usize;
    let mut max_in_flight = 0usize;
    let mut expected_n = 1;
    let end_lsn = loop {
        let output = next(&mut stream).await;
        max_buffered = max_buffered.max(stream.assembler().buffered_events());
        acks.observe(&output);
        match output {
            Output::Event { position, event } => {
                // Each event arrives before the transaction's end, in order, and is settled
                // as a sink would: the assembler keeps none of them.
                assert_eq!(payload_n(&event.unwrap()), expected_n);
                expected_n += 1;
                handed_out += 1;
                acks.settle(position).unwrap();
            }
            Output::Committed {
                events, end_lsn, ..
            } if events > 0 => {
                assert_eq!(events, EVENTS);
                break end_lsn;
            }
            _ => {}
        }
        max_in_flight = max_in_flight.max(acks.transactions_in_flight());
    };
    // For the record only (no timing is asserted).
    eprintln!(
        "100,000-event transaction: insert {inserted:?}, then streamed in {:?}",
        started.elapsed() - inserted
    );
    assert_eq!(
        handed_out, EVENTS,
        "every event was handed out before the commit"
    );
    assert_eq!(max_buffered, 0);
    assert_eq!(max_in_flight, 1, "one record for the whole transaction");
    assert_eq!(acks.confirmable(), end_lsn);
    stream.confirm(end_lsn);
    stream.stop(Duration::from_secs(10)).await.unwrap();
}

#[tokio::test]
async fn columns_are_found_by_name_after_the_table_changes() {
    let fixture = Fixture::new().await;
    let mut stream = fixture.start().await;
    let db = connect(&fixture.url).await;
    insert(&db, "k", 1).await;
    db.batch_execute(
        "ALTER TABLE outbox DROP COLUMN mutation_id;
         ALTER TABLE outbox ADD COLUMN tenant text;",
    )
    .await
    .unwrap();
    db.batch_execute(
        "INSERT INTO outbox (tenant, destination, partition_key, event_type, payload)
         VALUES ('t1', 'orders', 'k', 'Placed', '{\"n\": 2}')",
    )
    .await
    .unwrap();
    let mut acks = Acknowledgements::new(stream.slot().confirmed_flush);
    let transactions = read_transactions(&mut stream, &mut acks, 2).await;
    let delivered: Vec<i64> = transactions
        .iter()
        .flat_map(|t| t.events.iter().map(|(_, e)| payload_n(e)))
        .collect();
    assert_eq!(delivered, vec![1, 2]);
    stream.stop(Duration::from_secs(5)).await.unwrap();
}

/// A column an event is made of, renamed while the relay reads: rows written meanwhile are
/// undecodable, kept whole (every column's value), and the stream goes on. A renamed payload
/// was read as absent (each event sent with a null payload, its row deleted), and a renamed
/// event type ended every session at the same message, for good, even once renamed back.
#[tokio::test]
async fn rows_written_while_a_column_is_renamed_away_are_undecodable_and_the_stream_goes_on() {
    let fixture = Fixture::new().await;
    let mut stream = fixture.start().await;
    let db = connect(&fixture.url).await;
    for (column, renamed) in [("payload", "body"), ("event_type", "kind")] {
        db.batch_execute(&format!(
            "ALTER TABLE outbox RENAME COLUMN {column} TO {renamed}"
        ))
        .await
        .unwrap();
        db.batch_execute(&format!(
            "INSERT INTO outbox (destination, partition_key, {}, {})
             VALUES ('orders', 'k', 'Placed', '{{\"n\": 1}}')",
            if column == "event_type" {
                renamed
            } else {
                "event_type"
            },
            if column == "payload" {
                renamed
            } else {
                "payload"
            },
        ))
        .await
        .unwrap();
        db.batch_execute(&format!(
            "ALTER TABLE outbox RENAME COLUMN {renamed} TO {column}"
        ))
        .await
        .unwrap();
    }
    insert(&db, "k", 2).await;
    let mut outcomes = Vec::new();
    while outcomes.len() < 3 {
        if let Output::Event { event, .. } = next(&mut stream).await {
            outcomes.push(event);
        }
    }
    for (outcome, column) in outcomes.iter().zip(["payload", "event_type"]) {
        let undecodable = outcome.as_ref().expect_err("undecodable");
        assert!(
            undecodable
                .reason
                .contains(&format!("has no column {column}")),
            "{}",
            undecodable.reason
        );
        assert!(
            undecodable.raw.contains("{\"n\": 1}"),
            "{}",
            undecodable.raw
        );
    }
    assert_eq!(payload_n(outcomes[2].as_ref().unwrap()), 2);
    stream.stop(Duration::from_secs(5)).await.unwrap();
}

#[tokio::test]
async fn a_drain_ends_at_the_position_current_when_it_started() {
    let fixture = Fixture::new().await;
    // Create the slot first: a slot sees only what commits after it exists.
    fixture
        .start()
        .await
        .stop(Duration::from_secs(5))
        .await
        .unwrap();
    let db = connect(&fixture.url).await;
    for n in 0..3 {
        insert(&db, "k", n).await;
    }
    let current: String = db
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let mut config = fixture.config.clone();
    config.stop_at = Some(current.parse().unwrap());
    let mut stream = start(&config).await;
    insert(&db, "k", 3).await; // after the drain's position: not part of it
    let mut delivered = Vec::new();
    loop {
        let output = tokio::time::timeout(Duration::from_secs(60), stream.next())
            .await
            .expect("an output within 60 s")
            .expect("the stream works");
        match output {
            Some(Output::Event { event, .. }) => delivered.push(payload_n(&event.unwrap())),
            Some(_) => {}
            None => break,
        }
    }
    assert_eq!(delivered, vec![0, 1, 2]);
}

#[tokio::test]
async fn idle_keepalives_move_the_slot_past_other_writes() {
    let fixture = Fixture::new().await;
    let mut stream = fixture.start().await;
    let db = connect(&fixture.url).await;
    // Writes the publication does not cover: the WAL grows, the outbox stays empty.
    db.batch_execute(
        "CREATE TABLE other (n int); INSERT INTO other SELECT generate_series(1, 1000);",
    )
    .await
    .unwrap();
    let written: String = db
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let written: Lsn = written.parse().unwrap();
    let mut acks = Acknowledgements::new(stream.slot().confirmed_flush);
    loop {
        let output = next(&mut stream).await;
        acks.observe(&output);
        match output {
            Output::Idle { wal_end } if wal_end >= written => break,
            Output::Event { .. } => panic!("no outbox event was written"),
            _ => {}
        }
    }
    let confirmable = acks.confirmable();
    assert!(confirmable >= written);
    stream.confirm(confirmable);
    stream.stop(Duration::from_secs(10)).await.unwrap();
    // The server applies a status update after it arrives: look until it has.
    outbox_testkit::eventually(
        "the slot confirmed past the other writes",
        Duration::from_secs(10),
        || async { (slot_confirmed(&db, &fixture.config.slot).await >= written).then_some(()) },
    )
    .await;
}

#[tokio::test]
async fn one_consumer_holds_the_slot_and_a_standby_takes_over_when_it_goes() {
    let fixture = Fixture::new().await;
    let active = fixture.start().await;
    // A standby is refused while the active session holds the slot, and told why.
    let refused = match WalStream::start(&fixture.config).await {
        Ok(_) => panic!("two sessions held one slot"),
        Err(e) => e,
    };
    assert!(
        refused.is_slot_in_use() && refused.is_retryable(),
        "{refused}"
    );
    // The active one dies without a goodbye; the standby's retries take the slot.
    drop(active);
    let mut standby = fixture.start().await;
    let db = connect(&fixture.url).await;
    insert(&db, "k", 1).await;
    let mut acks = Acknowledgements::new(standby.slot().confirmed_flush);
    let transactions = read_transactions(&mut standby, &mut acks, 1).await;
    assert_eq!(payload_n(&transactions[0].events[0].1), 1);
    // The server ends the session (as in a restart): the error says to start again.
    db.batch_execute(&format!(
        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
          WHERE slot_name = '{}'",
        fixture.config.slot
    ))
    .await
    .unwrap();
    let ended = loop {
        match tokio::time::timeout(Duration::from_secs(60), standby.next())
            .await
            .expect("the end of the session within 60 s")
        {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the session ended without an error"),
            Err(e) => break e,
        }
    };
    assert!(ended.is_retryable(), "{ended}");
}

/// A [`WalStore`] over the fixture's database (its capture tables made), with the store's
/// bound for one operation `operation_timeout`.
async fn wal_store(fixture: &Fixture, operation_timeout: Option<Duration>) -> outbox_wal::WalStore {
    use outbox_store_postgres::{PgOptions, PgStore};
    let main = PgStore::new(PgOptions {
        operation_timeout,
        ..PgOptions::new(&fixture.url, Tables::standard())
    })
    .unwrap();
    let publication = Ident::new(PUBLICATION, "publication").unwrap();
    let capture = outbox_wal::capture::capture_tables(main.tables(), &publication, None);
    main.migrate_extra(&capture.ddl()).await.unwrap();
    outbox_wal::WalStore::start(
        main,
        outbox_wal::WalStoreOptions {
            wal: fixture.config.clone(),
            publication,
            drain: false,
            labels: Default::default(),
            max_in_flight: outbox_engine::DEFAULT_MAX_IN_FLIGHT,
        },
    )
}

/// The relay's engine over [`WalStore`], in-process, with a recording publisher.
mod through_the_engine {
    use std::sync::Arc;

    use outbox_core::{NodeId, PublishErrorKind, RetryPolicy};
    use outbox_engine::EngineConfig;
    use outbox_testkit::eventually;
    use outbox_testkit::recording::RecordingPublisher;
    use outbox_wal::WalStore;

    use super::*;

    /// A relay: the store, the engine task, and the switch that stops it.
    struct Relay {
        store: WalStore,
        stop: Option<tokio::sync::oneshot::Sender<()>>,
        engine: tokio::task::JoinHandle<outbox_engine::Summary>,
    }

    impl Relay {
        async fn start(fixture: &Fixture, publisher: &RecordingPublisher) -> Relay {
            Relay::bounded(fixture, publisher, None).await
        }

        /// [`Relay::start`] with the store's bound for one operation `operation_timeout`.
        async fn bounded(
            fixture: &Fixture,
            publisher: &RecordingPublisher,
            operation_timeout: Option<Duration>,
        ) -> Relay {
            let store = super::wal_store(fixture, operation_timeout).await;
            let mut config = EngineConfig::new(NodeId("wal-test".into()));
            config.settings.retry = RetryPolicy {
                base_delay: Duration::from_millis(50),
                max_delay: Duration::from_millis(200),
                max_attempts: 1000,
                ..RetryPolicy::default()
            };
            config.settings.poll_interval = Duration::from_millis(100);
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let engine = tokio::spawn(outbox_engine::run(
                Arc::new(store.clone()),
                Arc::new(publisher.clone()),
                config,
                async move {
                    let _ = stopped.await;
                },
            ));
            let engine = tokio::spawn(async move { engine.await.unwrap().unwrap() });
            Relay {
                store,
                stop: Some(stop),
                engine,
            }
        }

        async fn stop(mut self) {
            let _ = self.stop.take().unwrap().send(());
            self.engine.await.unwrap();
            self.store.close(Duration::from_secs(10)).await;
        }
    }

    /// A fresh fixture, a connection to its database, and a relay streaming from its slot
    /// to a recording publisher that accepts everything.
    async fn streaming_relay() -> (Fixture, Client, RecordingPublisher, Relay) {
        let fixture = Fixture::new().await;
        let db = connect(&fixture.url).await;
        let publisher = RecordingPublisher::new();
        let relay = Relay::start(&fixture, &publisher).await;
        relay.store.wait_streaming(Duration::from_secs(30)).await;
        (fixture, db, publisher, relay)
    }

    async fn confirmed(db: &Client, slot: &str) -> Lsn {
        super::slot_confirmed(db, slot).await
    }

    /// Runs `sql` (one statement) in a transaction, and returns a WAL position inside it,
    /// before its commit: a slot confirmed to it has passed the transaction. The WAL's end
    /// read after the commit can hold other sessions' writes too (other tests' databases),
    /// which the relay confirms with keepalives only once they make 16 MiB (its confirm
    /// mark's slack): a wait for that position timed out whenever the suite was busy.
    async fn lsn_within(db: &Client, sql: &str) -> Lsn {
        let messages = db
            .simple_query(&format!(
                "BEGIN; {sql}; SELECT pg_current_wal_insert_lsn()::text; COMMIT"
            ))
            .await
            .unwrap();
        let lsn = messages
            .iter()
            .rev()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_string),
                _ => None,
            })
            .expect("the position's row");
        lsn.parse().unwrap()
    }

    /// The statement [`insert_typed`] runs, with its values written in.
    fn insert_typed_sql(key: &str, event_type: &str, n: i32) -> String {
        format!(
            "INSERT INTO outbox (destination, partition_key, event_type, payload)
             VALUES ('orders', '{key}', '{event_type}', jsonb_build_object('n', {n}))"
        )
    }

    async fn insert_typed(db: &Client, key: &str, event_type: &str, n: i32) {
        db.execute(
            "INSERT INTO outbox (destination, partition_key, event_type, payload)
             VALUES ('orders', $1, $2, jsonb_build_object('n', $3::int4))",
            &[&key, &event_type, &n],
        )
        .await
        .unwrap();
    }

    fn delivered_n(publisher: &RecordingPublisher, key: &str) -> Vec<i64> {
        publisher
            .delivered()
            .iter()
            .filter(|e| e.ordering_key() == key)
            .map(|e| {
                serde_json::from_slice::<serde_json::Value>(e.payload.as_bytes()).unwrap()["n"]
                    .as_i64()
                    .unwrap()
            })
            .collect()
    }

    async fn count(db: &Client, table: &str) -> i64 {
        db.query_one(&format!("SELECT count(*) FROM {table}"), &[])
            .await
            .unwrap()
            .get(0)
    }

    /// The adoption moves the backlog that predates the slot in one transaction, which the
    /// store's bound for one operation (30 s) cut off, every time it was tried, once the
    /// table held a few million rows: capture never started. Here that bound is 50 ms, and
    /// the backlog takes longer to move.
    #[tokio::test]
    async fn a_backlog_whose_adoption_outlasts_one_operations_bound_is_adopted() {
        let fixture = Fixture::new().await;
        let db = connect(&fixture.url).await;
        db.batch_execute(
            "INSERT INTO outbox (destination, partition_key, event_type, payload)
             SELECT 'orders', 'k' || (i % 100), 'T', jsonb_build_object('n', i)
               FROM generate_series(1, 100000) i",
        )
        .await
        .unwrap();
        let publisher = RecordingPublisher::new();
        let relay = Relay::bounded(&fixture, &publisher, Some(Duration::from_millis(50))).await;
        let status = relay.store.wait_streaming(Duration::from_secs(60)).await;
        assert_eq!(status, outbox_wal::CaptureStatus::Streaming);
        assert_eq!(count(&db, "outbox").await, 0, "moved to the parked table");
        relay.stop().await;
    }

    /// A key whose head keeps failing is parked: the other keys go on, the slot moves past
    /// every transaction (the parked ones are durable elsewhere), and once the sink accepts
    /// it again the key's events follow in commit order.
    #[tokio::test]
    async fn a_failing_key_is_parked_and_holds_back_neither_the_slot_nor_other_keys() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter("outbox_wal=debug,outbox_engine=debug")
            .with_test_writer()
            .try_init();
        let fixture = Fixture::new().await;
        let db = connect(&fixture.url).await;
        let publisher = RecordingPublisher::new();
        publisher.fail("Stuck", usize::MAX, PublishErrorKind::Unavailable);
        let relay = Relay::start(&fixture, &publisher).await;
        relay.store.wait_streaming(Duration::from_secs(30)).await;
        insert_typed(&db, "a", "Stuck", 1).await;
        insert_typed(&db, "a", "Placed", 2).await;
        insert_typed(&db, "b", "Placed", 3).await;
        insert_typed(&db, "a", "Placed", 4).await;
        let written = lsn_within(&db, &insert_typed_sql("b", "Placed", 5)).await;
        eventually("key b delivered", Duration::from_secs(30), || async {
            (delivered_n(&publisher, "b") == [3, 5]).then_some(())
        })
        .await;
        eventually(
            "the slot confirmed past the parked key's transactions",
            Duration::from_secs(30),
            || async { (confirmed(&db, &fixture.config.slot).await >= written).then_some(()) },
        )
        .await;
        if !delivered_n(&publisher, "a").is_empty() {
            let rows = db
                .query(
                    "SELECT sequence_id, attempts, (available_at > now())::text, locked_by, payload::text FROM outbox_parked ORDER BY 1",
                    &[],
                )
                .await
                .unwrap();
            let rows: Vec<(i64, i32, String, Option<String>, String)> = rows
                .iter()
                .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
                .collect();
            panic!(
                "a overtook its stuck head: delivered {:?}, attempts by id {:?}, parked {rows:?}",
                delivered_n(&publisher, "a"),
                publisher.attempts()
            );
        }
        assert_eq!(
            count(&db, "outbox_parked").await,
            3,
            "a's three events wait there"
        );
        assert_eq!(
            count(&db, "outbox").await,
            0,
            "settled rows leave the outbox"
        );
        // A new event of the parked key queues behind it.
        insert_typed(&db, "a", "Placed", 6).await;
        eventually(
            "the new event of a parked too",
            Duration::from_secs(30),
            || async { (count(&db, "outbox_parked").await == 4).then_some(()) },
        )
        .await;
        // Each delete from the parked table (a delivered row's ack) takes 0.3 s: the checks
        // below must wait for what the relay writes after a publish, not race it (CI once
        // saw a delivered row still parked).
        db.batch_execute(
            "CREATE FUNCTION slow_delete() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN PERFORM pg_sleep(0.3); RETURN NULL; END $$;
             CREATE TRIGGER slow_delete BEFORE DELETE ON outbox_parked
               FOR EACH STATEMENT EXECUTE FUNCTION slow_delete();",
        )
        .await
        .unwrap();
        publisher.fail("Stuck", 0, PublishErrorKind::Unavailable);
        eventually("key a delivered", Duration::from_secs(30), || async {
            (delivered_n(&publisher, "a").len() == 4).then_some(())
        })
        .await;
        assert_eq!(delivered_n(&publisher, "a"), [1, 2, 4, 6]);
        // A delivered row leaves the parked table after its publish (the ack is a statement
        // of its own), and only then is its key unparked.
        eventually(
            "the parked table empties",
            Duration::from_secs(30),
            || async {
                (count(&db, "outbox_parked").await == 0 && relay.store.parked_keys() == 0)
                    .then_some(())
            },
        )
        .await;
        // Once the key has nothing parked, its events flow from the stream again.
        db.batch_execute(
            "CREATE TABLE park_log (sequence_id bigint NOT NULL);
             CREATE FUNCTION log_park() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN INSERT INTO park_log VALUES (NEW.sequence_id); RETURN NULL; END $$;
             CREATE TRIGGER log_park AFTER INSERT ON outbox_parked
               FOR EACH ROW EXECUTE FUNCTION log_park();",
        )
        .await
        .unwrap();
        insert_typed(&db, "a", "Placed", 7).await;
        eventually("a flows again", Duration::from_secs(30), || async {
            (delivered_n(&publisher, "a").len() == 5).then_some(())
        })
        .await;
        assert_eq!(delivered_n(&publisher, "a"), [1, 2, 4, 6, 7]);
        assert_eq!(count(&db, "park_log").await, 0, "7 came from the stream");
        relay.stop().await;
    }

    /// Acks of many small batches share few deletes: one delete transaction (and WAL
    /// flush) per confirmed batch would put the relay's commits between the writers'. The
    /// contract is that deletes start at most once per `DELETE_SPACING` (50 ms), so a
    /// statement trigger logs each delete's start, and their count must fit the span they
    /// ran over. Without the spacing, a delete ran as soon as the last one ended: one per
    /// event here, since the events come 2 ms apart.
    #[tokio::test]
    async fn acks_of_a_trickle_of_small_transactions_share_spaced_deletes() {
        let (_fixture, db, publisher, relay) = streaming_relay().await;
        // After the slot's first run, whose adoption of earlier rows is a delete too.
        db.batch_execute(
            "CREATE TABLE delete_log (at timestamptz NOT NULL);
             CREATE FUNCTION log_delete() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN INSERT INTO delete_log VALUES (statement_timestamp()); RETURN NULL; END $$;
             CREATE TRIGGER log_delete AFTER DELETE ON outbox
               FOR EACH STATEMENT EXECUTE FUNCTION log_delete();",
        )
        .await
        .unwrap();
        // A transaction every 2 ms, as a busy application's would commit.
        const EVENTS: i32 = 300;
        db.batch_execute(&format!(
            "DO $$ BEGIN
                 FOR n IN 1..{EVENTS} LOOP
                     INSERT INTO outbox (destination, partition_key, event_type, payload)
                     VALUES ('orders', 'k' || n % 10, 'Placed', jsonb_build_object('n', n));
                     COMMIT;
                     PERFORM pg_sleep(0.002);
                 END LOOP;
             END $$"
        ))
        .await
        .unwrap();
        eventually(
            "every row delivered and deleted",
            Duration::from_secs(60),
            || async { (count(&db, "outbox").await == 0).then_some(()) },
        )
        .await;
        relay.stop().await;
        assert_eq!(publisher.delivered().len(), EVENTS as usize);
        let log = db
            .query_one(
                "SELECT count(*), (extract(epoch FROM max(at) - min(at)) * 1000)::float8
                   FROM delete_log",
                &[],
            )
            .await
            .unwrap();
        let (deletes, span_ms): (i64, f64) = (log.get(0), log.get(1));
        // The slack: a row not yet visible to its delete is looked for again with the next
        // claim, and the relay's clock is not the server's.
        let spacing_ms = outbox_core::capture::DELETE_SPACING.as_secs_f64() * 1000.0;
        let allowed = (span_ms / spacing_ms).floor() as i64 + 3;
        assert!(
            deletes <= allowed,
            "{deletes} deletes over {span_ms:.0} ms for {EVENTS} events; at most {allowed} fit \
             one per {spacing_ms} ms"
        );
    }

    /// What is parked survives the relay: a new one finds the parked keys before it hands
    /// out anything, so a later event of such a key still waits behind the parked one.
    #[tokio::test]
    async fn parked_keys_survive_a_restart() {
        let fixture = Fixture::new().await;
        let db = connect(&fixture.url).await;
        let publisher = RecordingPublisher::new();
        publisher.fail("Stuck", usize::MAX, PublishErrorKind::Unavailable);
        let relay = Relay::start(&fixture, &publisher).await;
        relay.store.wait_streaming(Duration::from_secs(30)).await;
        insert_typed(&db, "a", "Stuck", 1).await;
        eventually("a parked", Duration::from_secs(30), || async {
            (count(&db, "outbox_parked").await == 1).then_some(())
        })
        .await;
        relay.stop().await;
        // Written while no relay runs; the next one must not let it overtake 1.
        insert_typed(&db, "a", "Placed", 2).await;
        let publisher = RecordingPublisher::new();
        let relay = Relay::start(&fixture, &publisher).await;
        eventually("a delivered", Duration::from_secs(30), || async {
            (delivered_n(&publisher, "a").len() == 2).then_some(())
        })
        .await;
        assert_eq!(delivered_n(&publisher, "a"), [1, 2]);
        relay.stop().await;
    }

    /// A sink's error that quotes a NUL (a receiver answering in UTF-16, say): PostgreSQL's
    /// text holds none, so the park recording the retry failed, was queued again ahead of
    /// every other, and every later claim failed on it: no key moved, the slot stopped.
    #[tokio::test]
    async fn a_sink_error_holding_a_nul_is_parked_and_blocks_no_other_key() {
        let (fixture, db, publisher, relay) = streaming_relay().await;
        publisher.fail_saying(
            "Stuck",
            1,
            PublishErrorKind::Unavailable,
            "503: \0B\0u\0s\0y",
        );
        insert_typed(&db, "a", "Stuck", 1).await;
        eventually("a parked", Duration::from_secs(30), || async {
            let error: Option<String> = db
                .query_opt("SELECT last_error FROM outbox_parked", &[])
                .await
                .unwrap()
                .and_then(|row| row.get(0));
            error
        })
        .await;
        let written = lsn_within(&db, &insert_typed_sql("b", "Placed", 2)).await;
        eventually(
            "b delivered and a retried",
            Duration::from_secs(30),
            || async {
                (delivered_n(&publisher, "b") == [2] && delivered_n(&publisher, "a") == [1])
                    .then_some(())
            },
        )
        .await;
        eventually("the slot past both", Duration::from_secs(30), || async {
            (confirmed(&db, &fixture.config.slot).await >= written).then_some(())
        })
        .await;
        relay.stop().await;
    }

    /// An `outbox_emit` message whose event id holds a NUL: its reason quotes it, and the
    /// dead letter that recorded it failed for good (PostgreSQL's text holds no NUL).
    #[tokio::test]
    async fn an_undecodable_message_quoting_a_nul_is_dead_lettered_and_settled() {
        let (fixture, db, _publisher, relay) = streaming_relay().await;
        let message = serde_json::json!({
            "v": 1,
            "destination": "orders",
            "key": "k",
            "type": "Placed",
            "event_id": "00000000-0000-0000-0000-00000000000\u{0}",
            "payload": {"n": 1},
        });
        let emit = format!(
            "SELECT pg_logical_emit_message(true, 'outbox', '{}')",
            message.to_string().replace('\'', "''")
        );
        let written = lsn_within(&db, &emit).await;
        let error: String = eventually("the dead letter", Duration::from_secs(30), || async {
            db.query_opt("SELECT last_error FROM outbox_dead_letters", &[])
                .await
                .unwrap()
                .map(|row| row.get(0))
        })
        .await;
        assert!(error.contains("\\0"), "the NUL shown: {error}");
        eventually("the slot past it", Duration::from_secs(30), || async {
            (confirmed(&db, &fixture.config.slot).await >= written).then_some(())
        })
        .await;
        relay.stop().await;
    }

    /// A message that is not the documented format becomes a dead letter with the reason,
    /// and the slot moves past it.
    #[tokio::test]
    async fn an_undecodable_message_is_dead_lettered_and_settled() {
        let (fixture, db, publisher, relay) = streaming_relay().await;
        db.batch_execute(
            "BEGIN; SELECT pg_logical_emit_message(true, 'outbox', 'not json'); COMMIT;",
        )
        .await
        .unwrap();
        let written = lsn_within(
            &db,
            "SELECT outbox_emit('orders', 'k', 'Placed', '{\"n\": 1}')",
        )
        .await;
        eventually("the good event", Duration::from_secs(30), || async {
            (delivered_n(&publisher, "k") == [1]).then_some(())
        })
        .await;
        let dead = eventually("the dead letter", Duration::from_secs(30), || async {
            db.query_opt(
                "SELECT sequence_id, last_error, payload #>> '{}' FROM outbox_dead_letters",
                &[],
            )
            .await
            .unwrap()
        })
        .await;
        let (id, error, raw): (i64, String, String) = (dead.get(0), dead.get(1), dead.get(2));
        assert!(
            id < 0,
            "a table-less event's id is minus its position: {id}"
        );
        assert!(!error.is_empty());
        assert_eq!(raw, "not json");
        eventually("the slot past both", Duration::from_secs(30), || async {
            (confirmed(&db, &fixture.config.slot).await >= written).then_some(())
        })
        .await;
        relay.stop().await;
    }
}

/// An event handed out and never settled (a bug, or a sink that never answers) stopped the
/// slot's confirmation for good while later events flowed, and `/readyz` (the store's
/// ping) stayed green: now the ping names the stalled transaction once it has not moved for
/// the patience, and is well again once it settles.
#[tokio::test]
async fn an_event_handed_out_and_never_settled_fails_the_ping_until_it_settles() {
    use outbox_core::store::{ClaimRequest, LeaseHolder};
    use outbox_core::{NodeId, OutboxStore};
    use outbox_testkit::eventually;

    let fixture = Fixture::new().await;
    let db = connect(&fixture.url).await;
    let store = wal_store(&fixture, None).await;
    store.set_settle_patience(Duration::from_secs(1));
    store.wait_streaming(Duration::from_secs(30)).await;
    insert(&db, "k", 1).await;
    let node = NodeId("wal-test".into());
    let claimed = eventually("the event handed out", Duration::from_secs(30), || async {
        let claimed = (store.claim(ClaimRequest::new(node.clone(), 10, Duration::from_secs(30))))
            .await
            .unwrap();
        (!claimed.is_empty()).then_some(claimed)
    })
    .await;
    store.ping().await.expect("nothing stalled yet");
    let stall = eventually("the ping failing", Duration::from_secs(30), || async {
        store.ping().await.err()
    })
    .await
    .to_string();
    assert!(
        stall.contains("0 of its 1 event(s) read settled") && stall.contains("has not moved"),
        "{stall}"
    );
    let ids = claimed
        .iter()
        .map(outbox_core::Claimed::sequence_id)
        .collect();
    store.ack(LeaseHolder::unfenced(node), ids).await.unwrap();
    eventually(
        "the ping well again once the event settles",
        Duration::from_secs(30),
        || async { store.ping().await.ok() },
    )
    .await;
    store.close(Duration::from_secs(10)).await;
}

/// The replication connection speaks TLS as the store's connections do (libpq's
/// `sslmode`): `verify-full` without the server's CA is refused for its certificate, with
/// it the stream runs over TLS, `require` encrypts without checking, `disable` does not
/// encrypt. `pg_stat_ssl` says which, for the walsender of each session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replication_connection_uses_tls_as_its_sslmode_says() {
    let fixture = Fixture::new().await;
    let ca = std::env::var("OUTBOX_TEST_PG_CA").expect("OUTBOX_TEST_PG_CA from scripts/servers.sh");
    let db = connect(&fixture.url).await;
    let with = |mode: &str, name: &str| WalConfig {
        url: format!("{}?sslmode={mode}", fixture.url),
        application_name: name.into(),
        ..fixture.config.clone()
    };
    match WalStream::start(&with("verify-full", "tls_untrusted")).await {
        Err(e) => assert!(e.to_string().to_lowercase().contains("certificate"), "{e}"),
        Ok(_) => panic!("a certificate signed by an unknown CA was accepted"),
    }
    let verified = WalConfig {
        ca_file: Some(ca.into()),
        ..with("verify-full", "tls_verified")
    };
    for (config, encrypted) in [
        (verified, true),
        (with("require", "tls_required"), true),
        (with("disable", "tls_off"), false),
    ] {
        let stream = start(&config).await;
        let ssl: bool = db
            .query_one(
                "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_replication r USING (pid)
                  WHERE r.application_name = $1",
                &[&config.application_name],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(ssl, encrypted, "{}", config.application_name);
        stream.stop(Duration::from_secs(5)).await.unwrap();
    }
}

/// The replication connection logs in with each password method PostgreSQL offers it:
/// SCRAM-SHA-256, md5 and a plain password (the roles `scripts/servers.sh` lists in
/// pg_hba.conf); a wrong password is refused by the server, and not retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replication_connection_logs_in_with_scram_md5_or_a_password() {
    let fixture = Fixture::new().await;
    let db = connect(&fixture.url).await;
    let host_and_database = fixture.url.split_once('@').unwrap().1;
    for (role, encryption) in [
        ("outbox_auth_scram", "scram-sha-256"),
        ("outbox_auth_md5", "md5"),
        ("outbox_auth_password", "scram-sha-256"),
    ] {
        // Roles are the server's: made once, their password set again each run.
        db.batch_execute(&format!(
            "DO $$ BEGIN
               IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN
                 CREATE ROLE {role} LOGIN REPLICATION;
               END IF;
             END $$;
             SET password_encryption = '{encryption}';
             ALTER ROLE {role} PASSWORD 's3cret';"
        ))
        .await
        .unwrap();
        let config = WalConfig {
            url: format!("postgres://{role}:s3cret@{host_and_database}?sslmode=disable"),
            application_name: role.into(),
            ..fixture.config.clone()
        };
        let stream = start(&config).await;
        let user: String = db
            .query_one(
                "SELECT usename::text FROM pg_stat_replication WHERE application_name = $1",
                &[&role],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(user, role);
        stream.stop(Duration::from_secs(5)).await.unwrap();
        let wrong = WalConfig {
            url: config.url.replace("s3cret", "wrong"),
            ..config.clone()
        };
        match WalStream::start(&wrong).await {
            Err(e) => {
                assert!(e.to_string().contains("28P01"), "{role}: {e}");
                assert!(!e.is_retryable(), "{role}: {e}");
            }
            Ok(_) => panic!("{role} logged in with a wrong password"),
        }
        // With channel_binding=require, SCRAM is bound to the TLS session (SCRAM-SHA-256-
        // PLUS), and a server asking for the password any other way is not sent it: the
        // replication login answered a cleartext or md5 request whatever the URL said.
        let bound = WalConfig {
            url: config
                .url
                .replace("sslmode=disable", "sslmode=require&channel_binding=require"),
            ..config.clone()
        };
        match (role, WalStream::start(&bound).await) {
            ("outbox_auth_scram", Ok(stream)) => stream.stop(Duration::from_secs(5)).await.unwrap(),
            ("outbox_auth_scram", Err(e)) => panic!("{role}: {e}"),
            (_, Ok(_)) => panic!("{role} logged in without channel binding"),
            (_, Err(e)) => {
                let said = e.to_string();
                assert!(
                    said.contains("channel_binding=require") && !said.contains("28P01"),
                    "{role}: {said}"
                );
            }
        }
    }
}

/// A URL naming the server's Unix socket directory (`host=/path`) streams over the socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replication_connection_reaches_a_unix_socket() {
    let fixture = Fixture::new().await;
    let data =
        std::env::var("OUTBOX_TEST_PG_DATA").expect("OUTBOX_TEST_PG_DATA from scripts/servers.sh");
    let socket_dir = std::path::Path::new(&data)
        .parent()
        .unwrap()
        .display()
        .to_string();
    let url: tokio_postgres::Config = fixture.url.parse().unwrap();
    let port = url.get_ports()[0];
    let database = url.get_dbname().unwrap();
    let config = WalConfig {
        url: format!("postgres://postgres@/{database}?host={socket_dir}&port={port}"),
        application_name: "unix_socket_stream".into(),
        ..fixture.config.clone()
    };
    let stream = start(&config).await;
    let db = connect(&fixture.url).await;
    // A Unix-socket client has no address.
    let address: Option<String> = db
        .query_one(
            "SELECT a.client_addr::text FROM pg_stat_replication r JOIN pg_stat_activity a USING (pid)
              WHERE r.application_name = 'unix_socket_stream'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(address, None);
    stream.stop(Duration::from_secs(5)).await.unwrap();
}

/// A reader that stops reading (its claims behind, its memory budget full) keeps its
/// session by `keep_alive`: with `wal_sender_timeout` at 1 s (the URL's `options`), a
/// stream left alone for 3 s is ended by the server, and one kept alive meanwhile is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_not_read_for_a_while_is_kept_alive_past_wal_sender_timeout() {
    for kept_alive in [true, false] {
        // A slot each: the second session must not be sent the first one's event again.
        let fixture = Fixture::new().await;
        let db = connect(&fixture.url).await;
        let config = WalConfig {
            url: format!("{}?options=-c%20wal_sender_timeout%3D1s", fixture.url),
            ..fixture.config.clone()
        };
        let mut stream = start(&config).await;
        let until = tokio::time::Instant::now() + Duration::from_secs(3);
        while tokio::time::Instant::now() < until {
            if kept_alive {
                stream.keep_alive().await.unwrap();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        insert(&db, "a", 1).await;
        let read = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match stream.next().await {
                    Ok(Some(Output::Event { .. })) => return Ok(()),
                    Ok(Some(_)) => continue,
                    Ok(None) => return Err("the stream ended".to_string()),
                    Err(e) => return Err(e.to_string()),
                }
            }
        })
        .await
        .expect("nothing within 10 s");
        if kept_alive {
            read.unwrap();
            stream.stop(Duration::from_secs(5)).await.unwrap();
        } else {
            assert!(
                read.is_err(),
                "a silent session outlived wal_sender_timeout"
            );
        }
    }
}

/// The delete of delivered rows answers with the ids it did not find (a row whose commit is
/// in the WAL but not yet visible, or one deleted already), in one array, not a row per id.
#[tokio::test]
async fn the_delete_of_delivered_rows_names_only_the_rows_whose_commits_it_cannot_see_yet() {
    let fixture = Fixture::new().await;
    let db = connect(&fixture.url).await;
    let outbox = TableName::new("public", "outbox").unwrap();
    let tables = outbox_wal::schema::CaptureTables::new(
        outbox.clone(),
        TableName::new("public", "outbox_dead_letters").unwrap(),
        Ident::new(PUBLICATION, "publication").unwrap(),
    );
    let sql = outbox_wal::schema::CaptureStatements::new(&tables);
    let first = insert(&db, "a", 1).await;
    let second = insert(&db, "a", 2).await;
    // The 32-bit transaction id the stream's Begin carries.
    let xid_of = |id: i64| {
        let db = &db;
        async move {
            db.query_one(
                "SELECT xmin::text::int8 FROM outbox WHERE sequence_id = $1",
                &[&id],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
        }
    };
    let (first_xid, second_xid) = (xid_of(first).await, xid_of(second).await);
    // Deleted already (adopted, or delivered before a reconnect): its commit is visible.
    let gone = (second + 1000, second_xid);
    // A commit in the WAL but not visible yet, as on a synchronous standby: its
    // transaction still runs.
    let writer = connect(&fixture.url).await;
    writer.batch_execute("BEGIN").await.unwrap();
    let late: i64 = writer
        .query_one(
            "INSERT INTO outbox (destination, partition_key, event_type, payload)
             VALUES ('orders', 'b', 'Placed', '{}') RETURNING sequence_id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let late_xid: i64 = writer
        .query_one("SELECT pg_current_xact_id()::text::int8 % 4294967296", &[])
        .await
        .unwrap()
        .get(0);
    let undeleted: Vec<i64> = db
        .query_one(
            &sql.delete_delivered,
            &[
                &vec![first, second, gone.0, late],
                &vec![first_xid, second_xid, gone.1, late_xid],
            ],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(undeleted, vec![late], "only the row not visible yet");
    let left: i64 = db
        .query_one("SELECT count(*) FROM outbox", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0, "both visible rows deleted");
    writer.batch_execute("COMMIT").await.unwrap();
    let none: Vec<i64> = db
        .query_one(&sql.delete_delivered, &[&vec![late], &vec![late_xid]])
        .await
        .unwrap()
        .get(0);
    assert!(none.is_empty(), "deleted once visible: {none:?}");
    let none: Vec<i64> = db
        .query_one(
            &sql.delete_delivered,
            &[&Vec::<i64>::new(), &Vec::<i64>::new()],
        )
        .await
        .unwrap()
        .get(0);
    assert!(none.is_empty());
}

/// The dead-letter statement keeps every event of a batch: one whose id an older dead
/// letter of another event holds gets a new id below every dead letter's and the batch's
/// own (a batch's negative id, a mapped table's or one `dead retry` moved back, was taken by
/// the new id first, and that event skipped); written twice (an answer lost), nothing
/// doubles.
#[tokio::test]
async fn a_dead_letter_batch_keeps_every_event_whatever_ids_older_ones_hold() {
    let fixture = Fixture::new().await;
    let db = connect(&fixture.url).await;
    let tables = outbox_wal::schema::CaptureTables::new(
        TableName::new("public", "outbox").unwrap(),
        TableName::new("public", "outbox_dead_letters").unwrap(),
        Ident::new(PUBLICATION, "publication").unwrap(),
    );
    let sql = outbox_wal::schema::CaptureStatements::new(&tables);
    db.batch_execute(
        "INSERT INTO outbox_dead_letters (sequence_id, event_id, destination, event_type,
                                          created_at, attempts, last_error, dead_at)
         VALUES (5, gen_random_uuid(), 'orders', 'Older', now(), 1, 'older', now())",
    )
    .await
    .unwrap();
    let (clashing, moved_back) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    let write = || {
        let (db, sql) = (&db, &sql);
        async move {
            let ids: Vec<i64> = vec![5, -1];
            let events = vec![clashing, moved_back];
            let texts = |v: &str| vec![v.to_string(), v.to_string()];
            let keys: Vec<Option<String>> = vec![Some("k".into()), Some("k".into())];
            let none: Vec<Option<String>> = vec![None, None];
            let payloads: Vec<Option<String>> = vec![Some("{}".into()), Some("{}".into())];
            let rejected = vec![false, false];
            let created = vec![std::time::SystemTime::now(); 2];
            let attempts: Vec<i32> = vec![3, 3];
            db.execute(
                &sql.dead_letter,
                &[
                    &ids,
                    &events,
                    &texts("orders"),
                    &keys,
                    &texts("Failed"),
                    &payloads,
                    &payloads,
                    &none,
                    &rejected,
                    &created,
                    &attempts,
                    &texts("refused"),
                ],
            )
            .await
            .unwrap();
        }
    };
    write().await;
    write().await;
    let rows: Vec<(i64, uuid::Uuid, String)> = db
        .query(
            "SELECT sequence_id, event_id, last_error FROM outbox_dead_letters ORDER BY sequence_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(rows.len(), 3, "{rows:?}");
    let of = |event: uuid::Uuid| rows.iter().find(|(_, e, _)| *e == event).cloned();
    assert_eq!(of(moved_back).map(|r| r.0), Some(-1), "{rows:?}");
    let (id, _, error) = of(clashing).expect("the clashing event kept");
    assert!(id < -1, "below the batch's own ids: {id}");
    assert!(error.contains("older dead letter"), "{error}");
}
