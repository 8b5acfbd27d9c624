//! The event id of each row the store handed out, until the row is settled or released.
//!
//! A settle names its rows by sequence id, and a sequence id is not a row's identity for
//! good: `TRUNCATE … RESTART IDENTITY` (or `ALTER SEQUENCE … RESTART`) gives the next rows
//! the ids of rows still in flight, and the in-flight events' acks then deleted the new
//! rows, unsent. So every settle also names each row's event id, which the table keeps
//! unique: a row that took a handed-out row's sequence id is left alone, and claimed in
//! its turn.

use std::collections::HashMap;
use std::sync::Mutex;

use outbox_core::SequenceId;
use uuid::Uuid;

/// Per node, the event id of each row handed out and not yet settled or released.
#[derive(Default)]
pub struct HandedOut {
    nodes: Mutex<HashMap<String, HashMap<SequenceId, Uuid>>>,
}

impl HandedOut {
    /// Records the rows a claim handed to `node`. A row whose id the node still holds keeps
    /// the event id it was first handed out with: an unordered claim leaves out no held id,
    /// so after a restarted sequence it hands out a new row under a held row's id, which the
    /// engine drops as held. Taking the new row's event id, the held event's ack deleted the
    /// new row, unsent.
    pub fn record(&self, node: &str, rows: impl Iterator<Item = (SequenceId, Option<Uuid>)>) {
        let mut nodes = self.nodes.lock().expect("handed-out rows lock");
        let handed = nodes.entry(node.to_string()).or_default();
        for (id, event_id) in rows {
            if let Some(event_id) = event_id {
                handed.entry(id).or_insert(event_id);
            }
        }
    }

    /// The event id of each of `ids` handed to `node`, which a settle checks: `None` for
    /// rows it settles by sequence id alone (undecodable rows, which may have no event
    /// id, and rows this store did not hand out).
    pub fn event_ids(&self, node: &str, ids: &[SequenceId]) -> Vec<Option<Uuid>> {
        let nodes = self.nodes.lock().expect("handed-out rows lock");
        let handed = nodes.get(node);
        ids.iter()
            .map(|id| handed.and_then(|h| h.get(id)).copied())
            .collect()
    }

    /// Forgets rows settled or released by `node`.
    pub fn forget(&self, node: &str, ids: &[SequenceId]) {
        let mut nodes = self.nodes.lock().expect("handed-out rows lock");
        if let Some(handed) = nodes.get_mut(node) {
            for id in ids {
                handed.remove(id);
            }
        }
    }

    /// Forgets every row of `node`'s but `held` (what its engine still holds).
    pub fn forget_all_but(&self, node: &str, held: &[SequenceId]) {
        let mut nodes = self.nodes.lock().expect("handed-out rows lock");
        if let Some(handed) = nodes.get_mut(node) {
            let kept: HashMap<SequenceId, Uuid> = held
                .iter()
                .filter_map(|id| handed.get(id).map(|event_id| (*id, *event_id)))
                .collect();
            *handed = kept;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uuid(n: u128) -> Option<Uuid> {
        Some(Uuid::from_u128(n))
    }

    #[test]
    fn a_settle_checks_the_event_id_of_each_row_handed_out_and_only_the_id_of_the_rest() {
        let handed = HandedOut::default();
        handed.record("a", [(1, uuid(11)), (2, None)].into_iter());
        handed.record("b", [(3, uuid(13))].into_iter());
        assert_eq!(handed.event_ids("a", &[1, 2, 3]), [uuid(11), None, None]);
        handed.forget("a", &[1]);
        assert_eq!(handed.event_ids("a", &[1]), [None]);
        assert_eq!(handed.event_ids("b", &[3]), [uuid(13)]);
    }

    #[test]
    fn a_row_handed_out_under_a_held_id_does_not_take_the_held_rows_place() {
        let handed = HandedOut::default();
        handed.record("a", [(1, uuid(11))].into_iter());
        handed.record("a", [(1, uuid(21)), (1, None)].into_iter());
        assert_eq!(handed.event_ids("a", &[1]), [uuid(11)]);
        // Settled, the id is free: claimed again, it is checked against the new row.
        handed.forget("a", &[1]);
        handed.record("a", [(1, uuid(21))].into_iter());
        assert_eq!(handed.event_ids("a", &[1]), [uuid(21)]);
    }

    #[test]
    fn forgetting_all_but_the_held_rows_keeps_their_event_ids() {
        let handed = HandedOut::default();
        handed.record("a", [(1, uuid(11)), (2, uuid(12))].into_iter());
        handed.forget_all_but("a", &[2, 5]);
        assert_eq!(handed.event_ids("a", &[1, 2]), [None, uuid(12)]);
    }
}
