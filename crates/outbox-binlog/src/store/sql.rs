//! The statements binlog capture runs itself (the parked table's claims, acks, retries and
//! dead letters are the polling store's): parking, deleting delivered rows, the parked
//! keys, and the adoption of rows already in the table.

use crate::seat::quoted;

/// The parked table's columns that a park writes, in its `VALUES` order.
const PARK_COLUMNS: &str = "event_id, destination, partition_key, event_type, payload, headers, \
     mutation_id, rejected, created_at, available_at, attempts, last_error, dead_at";

/// One parked row's values: `available_at` is the later of now plus the delay
/// (microseconds) and the row's own `not_before`, and `dead_at` is set for a dead letter.
const PARK_VALUES: &str = "(?, ?, ?, ?, ?, ?, ?, ?, ?, \
     GREATEST(NOW(6) + INTERVAL ? MICROSECOND, COALESCE(CAST(? AS DATETIME(6)), NOW(6))), \
     ?, ?, IF(?, NOW(6), NULL))";

/// The values one parked row binds.
pub(super) const PARK_PARAMS: usize = 14;

/// The ordering key of a row of the native layout.
const KEY: &str = "COALESCE(partition_key, destination)";

#[derive(Clone, Debug)]
pub(super) struct Statements {
    outbox: String,
    parked: String,
    positions: String,
}

impl Statements {
    /// `outbox`, `parked` and `positions` as configured (`db.table` or `table`).
    pub(super) fn new(outbox: &str, parked: &str, positions: &str) -> Self {
        Statements {
            outbox: quoted(outbox),
            parked: quoted(parked),
            positions: quoted(positions),
        }
    }

    /// `rows` parked rows, inserted in their order (the parked table's ids, and so its
    /// claims, follow it). An event parked before (read again after a restart) keeps its
    /// row.
    pub(super) fn park(&self, rows: usize) -> String {
        let values = vec![PARK_VALUES; rows].join(", ");
        format!(
            "INSERT INTO {parked} ({PARK_COLUMNS}) VALUES {values}
             ON DUPLICATE KEY UPDATE sequence_id = sequence_id",
            parked = self.parked
        )
    }

    /// $1 the outbox's name in the positions table: the seat's epoch, read under a shared
    /// lock so that no standby takes the seat until the park commits.
    pub(super) fn seat_epoch(&self) -> String {
        format!(
            "SELECT epoch FROM {} WHERE outbox = ? LOCK IN SHARE MODE",
            self.positions
        )
    }

    /// Deletes the outbox rows `rows` by `sequence_id`. The ids are written into the text
    /// (integers, nothing to escape): a statement with as many placeholders as rows would be
    /// prepared anew for every count, a round trip and a parse per ack.
    pub(super) fn delete_rows(&self, rows: &[i64]) -> String {
        let ids: Vec<String> = rows.iter().map(i64::to_string).collect();
        format!(
            "DELETE FROM {} WHERE sequence_id IN ({})",
            self.outbox,
            ids.join(",")
        )
    }

    /// Every key with a row waiting in the parked table.
    pub(super) fn parked_keys(&self) -> String {
        format!(
            "SELECT DISTINCT {KEY} FROM {} WHERE delivered_at IS NULL AND dead_at IS NULL",
            self.parked
        )
    }

    /// Which of `keys` keys still have a row waiting in the parked table.
    pub(super) fn still_parked(&self, keys: usize) -> String {
        format!(
            "SELECT DISTINCT {KEY} FROM {} WHERE delivered_at IS NULL AND dead_at IS NULL
                AND {KEY} IN ({})",
            self.parked,
            placeholders(keys)
        )
    }

    /// The adoption of the rows already in the outbox table when capture first starts (the
    /// log from its first position does not carry them): moved to the parked table in
    /// their order, in the transaction that stores that position. The rows are locked
    /// first, which waits for every transaction that wrote one and has not committed yet
    /// (its rows may be in the log before the position, and must not be left behind).
    pub(super) fn adoption(&self) -> Vec<String> {
        let Statements { outbox, parked, .. } = self;
        let copied = "event_id, destination, partition_key, event_type, payload, headers, \
             mutation_id, rejected, created_at, available_at, attempts, last_error, dead_at";
        vec![
            format!("SELECT sequence_id FROM {outbox} WHERE delivered_at IS NULL FOR UPDATE"),
            format!(
                "INSERT INTO {parked} ({copied})
                 SELECT {copied} FROM {outbox} o WHERE o.delivered_at IS NULL ORDER BY o.sequence_id
                 ON DUPLICATE KEY UPDATE {parked}.sequence_id = {parked}.sequence_id"
            ),
            format!(
                "DELETE FROM {outbox} WHERE delivered_at IS NULL
                    AND event_id IN (SELECT event_id FROM {parked})"
            ),
        ]
    }
}

fn placeholders(n: usize) -> String {
    vec!["?"; n.max(1)].join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_park_binds_its_values_row_by_row_in_order() {
        let sql = Statements::new("db.outbox", "db.outbox_parked", "db.outbox_binlog");
        let park = sql.park(2);
        assert_eq!(park.matches('?').count(), 2 * PARK_PARAMS);
        assert!(
            park.starts_with("INSERT INTO `db`.`outbox_parked`"),
            "{park}"
        );
        assert!(sql.delete_rows(&[1, 22, 333]).ends_with("IN (1,22,333)"));
    }
}
