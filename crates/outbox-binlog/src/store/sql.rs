//! The statements binlog capture runs itself (the parked table's claims, acks, retries and
//! dead letters are the polling store's): parking, deleting delivered rows, the parked
//! keys, and the adoption of rows already in the table (which of some keys still wait in
//! the parked table is [`crate::parked::still_parked`], over the table's index).

use outbox_layout::sql::Sql;
use outbox_layout::{Dialect, Mapping, Seed};

use super::event::PARKED_TEXT_CHARS;
use crate::seat::quoted;
use crate::BinlogError;

/// The parked table's columns that a park writes, in its `VALUES` order.
const PARK_COLUMNS: &str = "event_id, destination, partition_key, event_type, payload, headers, \
     mutation_id, rejected, created_at, available_at, attempts, last_error, dead_at";

/// One parked row's values: `available_at` is the later of now plus the delay
/// (microseconds) and the row's own `not_before`, and `dead_at` is set for a dead letter.
const PARK_VALUES: &str = "?, ?, ?, ?, ?, ?, ?, ?, ?, \
     GREATEST(NOW(6) + INTERVAL ? MICROSECOND, COALESCE(CAST(? AS DATETIME(6)), NOW(6))), \
     ?, ?, IF(?, NOW(6), NULL)";

/// The values one parked row binds.
pub(super) const PARK_PARAMS: usize = 14;

/// What each row adds to [`Statements::park`]'s text: its values in parentheses, and a
/// comma and space.
pub(super) const PARK_TEXT_PER_ROW: usize = PARK_VALUES.len() + 4;

/// The session variable in which the adoption leaves how many rows it adopted as dead
/// letters (read by [`crate::seat::ActiveReader::store_first`]).
pub const ADOPTED_DEAD: &str = "@outbox_relay_adopted_dead";

/// The ordering key of a row of the native layout.
const KEY: &str = "COALESCE(partition_key, destination)";

#[derive(Clone, Debug)]
pub(super) struct Statements {
    outbox: String,
    parked: String,
    /// The parked table as configured, unquoted.
    parked_name: String,
    positions: String,
    /// The outbox table's layout, its schema the database read: how a delivered row is
    /// settled (deleted, or marked), and how a mapped table's rows are adopted.
    source: Sql,
    /// Each row's event id in SQL, derived (where the table has no event id column) from the
    /// layout as configured: polling derives it from that, schema or none.
    event_id: String,
    /// When the relay started, in SQL (UTC): the creation time of an adopted row whose
    /// mapping has none. They were written before the relay started; dated when adopted
    /// (after `run --drain` began), a drain took one left failing for an event that arrived
    /// during it, and exited 0.
    started: String,
}

impl Statements {
    /// The outbox `mapping` describes, with `parked` and `positions` as configured
    /// (`db.table` or `table`).
    pub(super) fn new(
        mapping: &Mapping,
        parked: &str,
        positions: &str,
    ) -> Result<Self, BinlogError> {
        let config = |e: outbox_core::StoreError| BinlogError::Config(e.to_string());
        let event_id = Sql::new(mapping.clone(), Dialect::MySql)
            .map_err(config)?
            .event_id_expr();
        // Named with its database only where the mapping names one (else the sessions'
        // own): a database name that is no identifier (`shop-db`) was put in the mapping,
        // and every run was refused that `migrate` and `check` had passed.
        let source = Sql::new(mapping.clone(), Dialect::MySql).map_err(config)?;
        Ok(Statements {
            outbox: source.table(),
            parked: quoted(parked),
            parked_name: parked.to_string(),
            positions: quoted(positions),
            source,
            event_id,
            started: {
                let micros = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_micros());
                // The relay's statements run in UTC (`store::pool_opts`, the adoption's own
                // `SET time_zone`): FROM_UNIXTIME gives UTC.
                format!(
                    "FROM_UNIXTIME({}.{:06})",
                    micros / 1_000_000,
                    micros % 1_000_000
                )
            },
        })
    }

    /// `rows` parked rows, inserted in their order (the parked table's ids, and so its
    /// claims, follow it). An event parked before (read again after a restart) keeps its
    /// row.
    pub(super) fn park(&self, rows: usize) -> String {
        let values = vec![format!("({PARK_VALUES})"); rows].join(", ");
        format!(
            "INSERT INTO {parked} ({PARK_COLUMNS}) VALUES {values}
             ON DUPLICATE KEY UPDATE sequence_id = sequence_id",
            parked = self.parked
        )
    }

    /// A park ([`Statements::park`]) of one row whose payload the server copies from the
    /// outbox row itself, for a row too large to send (past the server's
    /// max_allowed_packet): the park's values but the payload, then the outbox row's id. No
    /// row (deleted meanwhile) inserts nothing.
    pub(super) fn park_copied(&self) -> String {
        let id = self.source.column(&self.source.mapping.id);
        let payload = self.source.column(&self.source.mapping.payload);
        let values = PARK_VALUES.replacen("?, ?, ?, ?, ?,", &format!("?, ?, ?, ?, {payload},"), 1);
        format!(
            "INSERT INTO {parked} ({PARK_COLUMNS}) SELECT {values} FROM {outbox} o WHERE {id} = ?
             ON DUPLICATE KEY UPDATE {parked}.sequence_id = {parked}.sequence_id",
            parked = self.parked,
            outbox = self.outbox,
        )
    }

    /// ? an event id: 1 if the parked table has it.
    pub(super) fn parked_event(&self) -> String {
        format!("SELECT 1 FROM {} WHERE event_id = ?", self.parked)
    }

    /// $1 the outbox's name in the positions table: the seat's epoch, read under a shared
    /// lock so that no standby takes the seat until the park commits, with the session's
    /// `max_allowed_packet`, which the park's statements are sized by.
    pub(super) fn seat_epoch(&self) -> String {
        format!(
            "SELECT epoch, @@max_allowed_packet FROM {} WHERE outbox = ? LOCK IN SHARE MODE",
            self.positions
        )
    }

    /// Whether a delivered row is deleted (not marked).
    pub(super) fn deletes_delivered(&self) -> bool {
        self.source.mapping.on_success == outbox_layout::OnSuccess::Delete
    }

    /// Settles the outbox rows `rows` (by the layout's row id) as the layout settles a
    /// delivered row: deleted, or marked delivered ([`Sql::ack_captured`]).
    pub(super) fn settle_rows(&self, rows: &[i64]) -> String {
        self.source.ack_captured(rows)
    }

    /// Every key with a row waiting in the parked table. Keys compare byte for byte, as the
    /// relay's own do: under the table's collation `a`, `A` and `a ` are one value, and
    /// `DISTINCT` would name only one of the keys that wait.
    pub(super) fn parked_keys(&self) -> String {
        format!(
            "SELECT DISTINCT CAST({KEY} AS BINARY) FROM {}
              WHERE delivered_at IS NULL AND dead_at IS NULL",
            self.parked
        )
    }

    /// The parked table, `db.table` or `table` as configured (unquoted): which keys still
    /// wait there is [`crate::parked::still_parked`], over its index of waiting keys.
    pub(super) fn parked_table(&self) -> &str {
        &self.parked_name
    }

    /// The adoption of the rows already in the outbox table when capture first starts (the
    /// log from its first position does not carry them): moved to the parked table in
    /// their order, in the transaction that stores that position. The rows are locked
    /// first, which waits for every transaction that wrote one and has not committed yet
    /// (its rows may be in the log before the position, and must not be left behind).
    pub(super) fn adoption(&self) -> Vec<String> {
        if self.source.mapping.seed != Some(Seed::NativeMysql) {
            return self.mapped_adoption();
        }
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

    /// [`Statements::adoption`] of a mapped table: its pending rows, in the layout's order,
    /// become parked rows of the native columns (with the event ids polling would give
    /// them), then are settled as delivered rows are (deleted, or marked), matched by that
    /// id. A row polling could not relay either (a payload or headers that are not JSON, a
    /// destination, key or type longer than the parked table holds) is adopted as a dead
    /// letter saying why. It runs in UTC, as every other statement of the relay does (the
    /// seat's connection keeps the server's zone, which its leases are reckoned in).
    fn mapped_adoption(&self) -> Vec<String> {
        let Statements {
            outbox,
            parked,
            source,
            event_id,
            ..
        } = self;
        let pending = source.pending();
        let MappedRow {
            problem,
            mut values,
        } = self.mapped_row();
        values.extend([
            problem.clone(),
            format!("IF(({problem}) IS NOT NULL, NOW(6), NULL)"),
        ]);
        vec![
            "SET @outbox_relay_time_zone = @@session.time_zone, time_zone = '+00:00'".into(),
            "SET @outbox_relay_adoption_started = NOW(6)".into(),
            format!("SELECT 1 FROM {outbox} o WHERE {pending} FOR UPDATE"),
            format!(
                "INSERT INTO {parked} ({PARK_COLUMNS})
                 SELECT {} FROM {outbox} o WHERE {pending} ORDER BY {}
                 ON DUPLICATE KEY UPDATE {parked}.sequence_id = {parked}.sequence_id",
                values.join(", "),
                source.order_by()
            ),
            source.settle_delivered(&format!(
                "{pending} AND {event_id} IN (SELECT event_id FROM {parked})"
            )),
            // For the run's count of dead letters (`--drain` fails on them).
            format!(
                "SELECT COUNT(*) INTO {ADOPTED_DEAD} FROM {parked}
                  WHERE dead_at >= @outbox_relay_adoption_started
                    AND last_error LIKE '%(adopted by binlog capture)'"
            ),
            "SET time_zone = @outbox_relay_time_zone".into(),
        ]
    }

    /// The parked row polling would make of the outbox row `o` of a mapped table: its
    /// values in [`PARK_COLUMNS`] order up to `attempts` (payload and headers NULL where the
    /// row has a problem), and the problem (an SQL expression, NULL for none).
    fn mapped_row(&self) -> MappedRow {
        let source = &self.source;
        let m = &source.mapping;
        let column = |c: &Option<String>| {
            c.as_deref()
                .map_or_else(|| "NULL".to_string(), |c| source.column(c))
        };
        let as_text = |expr: String| format!("CAST({expr} AS CHAR)");
        let destination = as_text(source.column(&m.destination));
        let key = source.key_expr();
        let event_type = format!(
            "COALESCE({}, {destination})",
            as_text(column(&m.event_type))
        );
        let payload = source.column(&m.payload);
        let headers = column(&m.headers);
        let chars = PARKED_TEXT_CHARS;
        let problems = [
            (
                format!("{payload} IS NOT NULL AND NOT JSON_VALID({payload})"),
                format!("{} is not JSON", m.payload),
            ),
            (
                format!("{headers} IS NOT NULL AND NOT JSON_VALID({headers})"),
                "the headers are not JSON".to_string(),
            ),
            (
                format!("CHAR_LENGTH({destination}) > {chars}"),
                format!("the destination is longer than {chars} characters"),
            ),
            (
                format!("CHAR_LENGTH({key}) > {chars}"),
                format!("the partition key is longer than {chars} characters"),
            ),
            (
                format!("CHAR_LENGTH({event_type}) > {chars}"),
                format!("the event type is longer than {chars} characters"),
            ),
        ];
        let problem = format!(
            "CASE {} ELSE NULL END",
            problems
                .iter()
                .map(|(when, said)| format!(
                    "WHEN {when} THEN '{} (adopted by binlog capture)'",
                    said.replace('\'', "''")
                ))
                .collect::<Vec<_>>()
                .join(" ")
        );
        let fit = |expr: &str| format!("LEFT({expr}, {chars})");
        let bad = format!("({problem}) IS NOT NULL");
        let values = vec![
            self.event_id.clone(),
            fit(&destination),
            fit(&key),
            fit(&event_type),
            format!("IF({bad}, NULL, {payload})"),
            format!("IF({bad}, NULL, {headers})"),
            column(&m.mutation_id),
            m.rejected.as_ref().map_or("0".into(), |c| {
                format!("CASE WHEN {} THEN 1 ELSE 0 END", source.column(c))
            }),
            format!("COALESCE({}, {})", column(&m.created_at), self.started),
            format!("COALESCE({}, NOW(6))", column(&m.available_at)),
            "0".into(),
        ];
        MappedRow { problem, values }
    }

    /// ? the error, ? the outbox row's id: a dead letter of that row copied from the table
    /// itself, for a row whose log image could not be read (a writer's `binlog_row_image`
    /// leaving columns out, bytes not of the column's character set, an event id that is no
    /// UUID). The table holds the whole row until it is settled, so nothing the writer
    /// committed is lost with the image; no row (deleted meanwhile) inserts nothing.
    pub(super) fn dead_letter_copied(&self) -> String {
        let Statements {
            outbox,
            parked,
            source,
            ..
        } = self;
        let id = format!("o.{}", source.quote(&source.mapping.id));
        let values = if source.mapping.seed == Some(Seed::NativeMysql) {
            "event_id, destination, partition_key, event_type, payload, headers, mutation_id, \
             rejected, created_at, available_at, attempts"
                .split(", ")
                .map(|c| format!("o.{c}"))
                .collect::<Vec<_>>()
        } else {
            // A message that is not JSON (often why the row was undecodable) is kept as a
            // JSON string of its text, as the parked table's column takes it.
            let mut values = self.mapped_row().values;
            let payload = source.column(&source.mapping.payload);
            values[4] = format!(
                "IF(JSON_VALID({payload}), {payload}, JSON_QUOTE(CAST({payload} AS CHAR)))"
            );
            if let Some(headers) = &source.mapping.headers {
                let headers = source.column(headers);
                values[5] = format!("IF(JSON_VALID({headers}), {headers}, NULL)");
            }
            values
        };
        format!(
            "INSERT INTO {parked} ({PARK_COLUMNS})
             SELECT {}, ?, NOW(6) FROM {outbox} o WHERE {id} = ?
             ON DUPLICATE KEY UPDATE {parked}.sequence_id = {parked}.sequence_id",
            values.join(", ")
        )
    }
}

/// See [`Statements::mapped_row`].
struct MappedRow {
    problem: String,
    values: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_parked_row_adds_its_share_of_the_statements_text() {
        let native = Mapping::native_mysql(None, "outbox", false);
        let sql = Statements::new(&native, "db.outbox_parked", "db.outbox_binlog").unwrap();
        assert_eq!(sql.park(3).len() - sql.park(2).len(), PARK_TEXT_PER_ROW);
    }

    #[test]
    fn a_copied_park_binds_the_parks_values_but_the_payload_and_then_the_row() {
        let native = Mapping::native_mysql(None, "outbox", false);
        let sql = Statements::new(&native, "db.outbox_parked", "db.outbox_binlog").unwrap();
        let copied = sql.park_copied();
        assert_eq!(copied.matches('?').count(), PARK_PARAMS);
        assert!(copied.contains("?, ?, ?, ?, o.`payload`, ?"), "{copied}");
        assert_eq!(copied.matches('(').count(), copied.matches(')').count());
    }

    #[test]
    fn a_park_binds_its_values_row_by_row_in_order() {
        let native = Mapping::native_mysql(None, "outbox", false);
        let sql = Statements::new(&native, "db.outbox_parked", "db.outbox_binlog").unwrap();
        let park = sql.park(2);
        assert_eq!(park.matches('?').count(), 2 * PARK_PARAMS);
        assert!(
            park.starts_with("INSERT INTO `db`.`outbox_parked`"),
            "{park}"
        );
        let settle = sql.settle_rows(&[1, 22, 333]);
        assert!(settle.starts_with("DELETE FROM `outbox` WHERE"), "{settle}");
        assert!(
            settle.ends_with("`outbox`.`sequence_id` IN (1,22,333) ORDER BY `sequence_id` LIMIT 3"),
            "{settle}"
        );
    }

    /// A mapped table without a creation column: its adopted rows are dated when the relay
    /// started, not when adopted (after a drain began, and taken for rows that arrived
    /// during it).
    #[test]
    fn rows_adopted_without_a_creation_time_are_dated_when_the_relay_started() {
        let mapping = Mapping {
            seed: None,
            created_at: None,
            ..Mapping::native_mysql(None, "events", false)
        };
        let sql = Statements::new(&mapping, "db.events_parked", "db.events_binlog").unwrap();
        let insert = sql
            .adoption()
            .into_iter()
            .find(|s| s.starts_with("INSERT INTO"))
            .unwrap();
        assert!(insert.contains("COALESCE(NULL, FROM_UNIXTIME("), "{insert}");
        assert_eq!(
            insert.matches("NOW(6)").count(),
            2,
            "available_at and dead_at: {insert}"
        );
    }

    #[test]
    fn runs_of_consecutive_ids_are_settled_as_ranges() {
        let native = Mapping::native_mysql(None, "outbox", false);
        let sql = Statements::new(&native, "db.outbox_parked", "db.outbox_binlog").unwrap();
        let settle = sql.settle_rows(&[12, 10, 11, 40, 20, 21, 13, 11]);
        assert!(
            settle.ends_with(
                "WHERE (`outbox`.`sequence_id` BETWEEN 10 AND 13 OR `outbox`.`sequence_id` IN (20,21,40)) ORDER BY `sequence_id` LIMIT 7"
            ),
            "{settle}"
        );
        let only_ranges = sql.settle_rows(&[3, 1, 2]);
        assert!(
            only_ranges.ends_with(
                "WHERE `outbox`.`sequence_id` BETWEEN 1 AND 3 ORDER BY `sequence_id` LIMIT 3"
            ),
            "{only_ranges}"
        );
    }
}
