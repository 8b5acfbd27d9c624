//! Rows and columns an operator or application got wrong, in every store: a `created_at` no
//! event can carry is claimed as undecodable (to be dead-lettered with its reason) while the
//! other rows flow, and `verify` (what `check` prints) names a renamed column. What a database
//! lets a row hold differs, so each harness writes the rows in its own SQL ([`OddTime`]);
//! the procedure and the checks are these.

use std::time::{Duration, SystemTime};

use outbox_core::store::{ClaimRequest, Claimed, DeadLetter, LeaseHolder};
use outbox_core::{NodeId, OutboxStore};

use super::Harness;

/// A row whose `created_at` is written as `sql` (a literal or expression of the database's
/// SQL), and what must become of it.
#[derive(Clone, Debug)]
pub struct OddTime {
    /// The row's destination (its ordering key: every row has its own).
    pub destination: &'static str,
    pub sql: &'static str,
    pub expect: Expect,
}

#[derive(Clone, Debug)]
pub enum Expect {
    /// Delivered, at this exact time if one is given.
    Delivered(Option<SystemTime>),
    /// Dead-lettered, the reason containing each of these.
    DeadLettered(&'static [&'static str]),
}

/// What `verify` says once the outbox's `mutation_id` is renamed `mut_id`: its one problem's
/// `what` and `fix` contain these.
#[derive(Clone, Debug)]
pub struct RenamedColumn {
    pub what: &'static str,
    pub fix: &'static str,
}

/// Claims everything and dead-letters the undecodable rows, as the engine does; returns the
/// events (destination, created_at) and the dead rows' reasons in sequence order.
pub async fn claim_and_settle(store: &dyn OutboxStore) -> (Vec<(String, SystemTime)>, Vec<String>) {
    let node = NodeId("n1".into());
    let claimed = store
        .claim(ClaimRequest::new(
            node.clone(),
            100,
            Duration::from_secs(30),
        ))
        .await
        .expect("one bad row never fails the claim");
    let mut events = Vec::new();
    let mut dead = Vec::new();
    for c in claimed {
        match c {
            Claimed::Event(e) => events.push((e.destination.clone(), e.created_at)),
            Claimed::Undecodable {
                sequence_id,
                reason,
                ..
            } => dead.push(DeadLetter {
                sequence_id,
                attempts: 1,
                error: reason,
            }),
        }
    }
    dead.sort_by_key(|d| d.sequence_id);
    let reasons = dead.iter().map(|d| d.error.clone()).collect();
    let n = dead.len() as u64;
    assert_eq!(
        store
            .dead_letter(LeaseHolder::unfenced(node), dead)
            .await
            .unwrap(),
        n
    );
    (events, reasons)
}

pub async fn created_at_before_1970_is_delivered_and_beyond_9999_is_dead_lettered(h: &dyn Harness) {
    let rows = h.odd_created_at();
    let values: Vec<String> = rows
        .iter()
        .map(|r| format!("('{}', 't', {})", r.destination, r.sql))
        .collect();
    h.execute(&format!(
        "INSERT INTO {} (destination, event_type, created_at) VALUES {}",
        h.table(),
        values.join(", ")
    ))
    .await;
    let (events, reasons) = claim_and_settle(&*h.store()).await;

    let delivered: Vec<(&str, Option<SystemTime>)> = rows
        .iter()
        .filter_map(|r| match r.expect {
            Expect::Delivered(at) => Some((r.destination, at)),
            Expect::DeadLettered(_) => None,
        })
        .collect();
    let names: Vec<&str> = events.iter().map(|(d, _)| d.as_str()).collect();
    let expected: Vec<&str> = delivered.iter().map(|(d, _)| *d).collect();
    assert_eq!(names, expected, "{reasons:?}");
    for ((name, at), (_, expected)) in events.iter().zip(&delivered) {
        if let Some(expected) = expected {
            assert_eq!(at, expected, "{name}");
        }
    }

    let dead: Vec<&[&str]> = rows
        .iter()
        .filter_map(|r| match r.expect {
            Expect::DeadLettered(parts) => Some(parts),
            Expect::Delivered(_) => None,
        })
        .collect();
    assert_eq!(reasons.len(), dead.len(), "{reasons:?}");
    for (reason, parts) in reasons.iter().zip(dead) {
        for part in parts {
            assert!(reason.contains(part), "{part:?} in {reason}");
        }
    }
    assert_eq!(
        h.dead_rows().await.len(),
        reasons.len(),
        "kept as dead letters"
    );
}

pub async fn verify_names_a_renamed_column(h: &dyn Harness) {
    let store = h.store();
    assert_eq!(store.verify().await.unwrap(), vec![]);
    h.execute(&format!(
        "ALTER TABLE {} RENAME COLUMN mutation_id TO mut_id",
        h.table()
    ))
    .await;
    // A column the relay does not read is no problem.
    h.execute(&format!("ALTER TABLE {} ADD COLUMN tenant text", h.table()))
        .await;
    let problems = store.verify().await.unwrap();
    assert_eq!(problems.len(), 1, "{problems:?}");
    let expected = h.renamed_column();
    let p = &problems[0];
    assert!(p.what.contains(expected.what), "{p:?}");
    assert!(p.fix.contains(expected.fix), "{p:?}");
    assert!(!p.is_degraded(), "{p:?}");
}
