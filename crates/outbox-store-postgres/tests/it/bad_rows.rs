//! Rows and columns an operator or application got wrong, in what only PostgreSQL lets them
//! be (the cases every store shares, odd `created_at` values and a renamed column, are in the
//! conformance suite): NULLs where `migrate` made NOT NULL are claimed as undecodable (to be
//! dead-lettered with their reason) while the rows of other keys flow, and a column type
//! changed under a running relay stops claims with an error naming it, past the cached plan.

use std::time::{Duration, SystemTime};

use outbox_core::store::{ClaimRequest, Claimed, DeadLetter, LeaseHolder};
use outbox_core::{NodeId, OutboxStore, StoreErrorKind};
use outbox_store_postgres::{PgOptions, PgStore, Tables};
use outbox_testkit::query_count;

async fn store() -> (PgStore, tokio_postgres::Client) {
    let url = outbox_testkit::fresh_pg_database().await;
    let store = PgStore::new(PgOptions::new(url.as_str(), Tables::standard())).unwrap();
    store.migrate().await.unwrap();
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    (store, client)
}

fn claim() -> ClaimRequest {
    ClaimRequest::new(NodeId("n1".into()), 100, Duration::from_secs(30))
}

/// Claims everything, dead-letters the undecodable rows as the engine does, and returns
/// (delivered destinations with their created_at, (sequence_id, reason) of the dead).
async fn claim_and_settle(store: &PgStore) -> (Vec<(String, SystemTime)>, Vec<(i64, String)>) {
    let claimed = store.claim(claim()).await.expect("claim");
    let mut events = Vec::new();
    let mut dead = Vec::new();
    for c in claimed {
        match c {
            Claimed::Event(e) => events.push((e.destination.clone(), e.created_at)),
            Claimed::Undecodable {
                sequence_id,
                reason,
                ..
            } => dead.push((sequence_id, reason)),
        }
    }
    let entries = dead
        .iter()
        .map(|(id, reason)| DeadLetter {
            sequence_id: *id,
            attempts: 1,
            error: reason.clone(),
        })
        .collect::<Vec<_>>();
    let n = store
        .dead_letter(LeaseHolder::unfenced(NodeId("n1".into())), entries)
        .await
        .expect("dead-letter the undecodable rows");
    assert_eq!(n as usize, dead.len());
    (events, dead)
}

#[tokio::test]
async fn nulls_where_migrate_made_not_null_are_dead_lettered_and_other_keys_flow() {
    let (store, client) = store().await;
    client
        .batch_execute(
            "ALTER TABLE outbox ALTER COLUMN destination DROP NOT NULL,
                                ALTER COLUMN event_type DROP NOT NULL,
                                ALTER COLUMN headers DROP NOT NULL,
                                ALTER COLUMN event_id DROP NOT NULL,
                                ALTER COLUMN created_at DROP NOT NULL,
                                ALTER COLUMN rejected DROP NOT NULL;
             INSERT INTO outbox (destination, partition_key, event_type, headers) VALUES
               (NULL, 'k1', 't', '{}'),
               ('d2', NULL, NULL, '{}'),
               ('d3', NULL, 't', NULL),
               ('ok', NULL, 't', '{}');
             INSERT INTO outbox (destination, event_type, event_id) VALUES ('d5', 't', NULL);
             INSERT INTO outbox (destination, event_type, created_at) VALUES ('d6', 't', NULL);
             INSERT INTO outbox (destination, event_type, rejected) VALUES ('d7', 't', NULL);
             INSERT INTO outbox (destination, event_type) VALUES ('ok2', 't');",
        )
        .await
        .unwrap();
    let (events, dead) = claim_and_settle(&store).await;
    let names: Vec<&str> = events.iter().map(|(d, _)| d.as_str()).collect();
    assert_eq!(names, ["ok", "ok2"]);
    let reasons: Vec<&str> = dead.iter().map(|(_, r)| r.as_str()).collect();
    for column in [
        "destination",
        "event_type",
        "headers",
        "event_id",
        "created_at",
        "rejected",
    ] {
        let expected = format!("{column} is NULL");
        assert!(
            reasons.iter().any(|r| r.starts_with(&expected)),
            "{column}: {reasons:?}"
        );
    }
    assert!(
        reasons.iter().all(|r| r.contains("dead retry")),
        "{reasons:?}"
    );
    let pending = query_count(&client, "SELECT count(*) FROM outbox", &[])
        .await
        .unwrap();
    assert_eq!(pending, 2, "the undecodable rows left the outbox");

    // `check` names each dropped NOT NULL, as a problem the relay can run with.
    let problems = store.verify().await.unwrap();
    for column in ["destination", "event_type", "headers", "event_id"] {
        let p = problems
            .iter()
            .find(|p| p.what.starts_with(&format!("column {column} ")))
            .unwrap_or_else(|| panic!("{column}: {problems:?}"));
        assert!(p.what.contains("allows NULL"), "{p:?}");
        assert!(p.fix.contains("SET NOT NULL"), "{p:?}");
        assert!(p.is_degraded(), "{p:?}");
    }
}

#[tokio::test]
async fn a_column_type_changed_under_a_running_relay_stops_claims_with_its_name_not_a_loop() {
    let (store, client) = store().await;
    client
        .batch_execute("INSERT INTO outbox (destination, event_type) VALUES ('a', 't')")
        .await
        .unwrap();
    assert_eq!(store.claim(claim()).await.unwrap().len(), 1);
    client
        .batch_execute(
            "ALTER TABLE outbox ALTER COLUMN event_id TYPE text;
             INSERT INTO outbox (destination, event_type) VALUES ('b', 't')",
        )
        .await
        .unwrap();
    // The cached plan fails once at most; the claim prepared afresh reads the new type and
    // refuses it for good.
    let mut errors = Vec::new();
    for _ in 0..3 {
        match store.claim(claim()).await {
            Ok(rows) => panic!("claimed {rows:?} with event_id as text"),
            Err(e) if e.kind() == StoreErrorKind::SchemaMismatch => {
                errors.push(e.report());
                break;
            }
            Err(e) => {
                assert!(e.is_retryable(), "{}", e.report());
                errors.push(e.report());
            }
        }
    }
    let last = errors.last().unwrap();
    assert!(
        last.contains("column event_id of public.outbox has type text"),
        "{errors:?}"
    );
    assert!(last.contains("outbox-relay check"), "{last}");
    assert!(errors.len() <= 2, "{errors:?}");

    // Every later claim of a row fails the same way: the relay stops with this message.
    client
        .batch_execute("INSERT INTO outbox (destination, event_type) VALUES ('c', 't')")
        .await
        .unwrap();
    let err = store.claim(claim()).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::SchemaMismatch);

    let problems = store.verify().await.unwrap();
    let p = problems
        .iter()
        .find(|p| p.what.contains("event_id"))
        .unwrap_or_else(|| panic!("{problems:?}"));
    assert!(
        p.what.contains("has type text; the relay reads uuid"),
        "{p:?}"
    );
    assert!(p.fix.contains("TYPE uuid USING event_id::uuid"), "{p:?}");
    assert!(!p.is_degraded());
}

/// The outbox's id sequence reset behind the dead letters' ids (`TRUNCATE … RESTART
/// IDENTITY`): the next event dead-lettered under an id already there failed on the key at
/// every try, its hint pointing nowhere, its key held back for good, with `check` content.
/// `check` now names the reset with the `setval` that fixes it, and the failure says why.
#[tokio::test]
async fn a_sequence_reset_behind_the_dead_letters_is_named_with_its_fix() {
    let (store, client) = store().await;
    let insert = "INSERT INTO outbox (destination, event_type, payload) VALUES ('d', 't', '{}')";
    client.batch_execute(insert).await.unwrap();
    let dead_letter = async |store: &PgStore| {
        let claimed = store.claim(claim()).await.expect("claim");
        store
            .dead_letter(
                LeaseHolder::unfenced(NodeId("n1".into())),
                vec![DeadLetter {
                    sequence_id: claimed[0].sequence_id(),
                    attempts: 1,
                    error: "refused".into(),
                }],
            )
            .await
    };
    assert_eq!(dead_letter(&store).await.unwrap(), 1);
    assert!(store.verify().await.unwrap().is_empty());
    client
        .batch_execute("TRUNCATE outbox RESTART IDENTITY")
        .await
        .unwrap();
    client.batch_execute(insert).await.unwrap();
    let said: Vec<String> = store
        .verify()
        .await
        .unwrap()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert!(
        said.iter()
            .any(|p| p.contains("behind the dead-letter table's ids")
                && p.contains("SELECT setval('public.outbox_sequence_id_seq', 1);")),
        "{said:?}"
    );
    let failed = dead_letter(&store).await.unwrap_err();
    assert!(
        failed.report().contains("sequence was reset"),
        "{}",
        failed.report()
    );
}
