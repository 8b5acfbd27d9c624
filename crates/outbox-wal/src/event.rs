//! What the WAL yields: events, where each came from, and the ones that cannot be decoded.

use std::time::SystemTime;

use outbox_core::{Event, EventId, SequenceId};

use crate::lsn::Lsn;

/// Where an event stands in the WAL: its transaction's commit position and its place in the
/// transaction. The same committed transaction decodes to the same positions every time it
/// is sent, so a position names an event across reconnects and restarts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventPosition {
    /// The transaction's commit record (the Begin message's final LSN).
    pub commit_lsn: Lsn,
    /// 0 for the transaction's first event, counting only events (rows of the outbox table
    /// and outbox messages), not other changes.
    pub ordinal: u64,
    /// The transaction's id (the Begin message's): whether its rows are visible to other
    /// sessions yet, which the stream cannot say (see `capture::Inner::delete_delivered`).
    pub xid: u32,
}

impl EventPosition {
    /// An event id for an event that carries none (an emitted message written by hand
    /// without `event_id`): derived from the position, so a redelivery carries the same id
    /// and brokers can drop the duplicate. A UUID of version 8 (custom) holding the whole
    /// commit LSN and the ordinal's low 56 bits, laid around the version and variant bits:
    /// before 0.3 the version overwrote four bits of the LSN, and transactions committed
    /// 4 KiB of WAL apart shared an id (a broker dropped the second as a duplicate, and a
    /// park skipped it).
    pub fn derived_event_id(&self) -> EventId {
        let lsn = self.commit_lsn.0;
        let mut bytes = [0u8; 16];
        bytes[..6].copy_from_slice(&(lsn >> 16).to_be_bytes()[2..]);
        bytes[6] = 0x80 | ((lsn >> 12) & 0x0f) as u8;
        bytes[7] = (lsn >> 4) as u8;
        bytes[8] = 0x80 | (lsn & 0x0f) as u8;
        bytes[9..].copy_from_slice(&self.ordinal.to_be_bytes()[1..]);
        EventId::from_bytes(bytes)
    }
}

/// How an event was written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventSource {
    /// An INSERT into the outbox table; the row's `sequence_id` when the table has one.
    Table { sequence_id: Option<SequenceId> },
    /// A transactional `pg_logical_emit_message` with the outbox prefix, at `lsn`.
    Message { lsn: Lsn },
}

/// One event decoded from the WAL: the engine's [`Event`] (as yet without a sequence id, see
/// [`WalEvent::into_core`]), with what only the WAL knows of it. Reads as its `Event`.
#[derive(Clone, Debug)]
pub struct WalEvent {
    /// `sequence_id` is 0 until [`WalEvent::into_core`]; `created_at` is the row's, or for a
    /// message its transaction's commit time.
    pub event: Event,
    /// The row's `available_at`, when the table has the column: a time in the future asks
    /// for delayed delivery, which WAL capture has to honour by parking the event.
    pub available_at: Option<SystemTime>,
    pub source: EventSource,
}

impl std::ops::Deref for WalEvent {
    type Target = Event;

    fn deref(&self) -> &Event {
        &self.event
    }
}

impl WalEvent {
    /// The engine's event. `sequence_id` is the caller's: WAL events have no table sequence
    /// in the message form, so the caller names them (WAL capture uses the row's id, or minus
    /// the message's position), and that is the id the engine settles by.
    pub fn into_core(self, sequence_id: SequenceId) -> Event {
        Event {
            sequence_id,
            ..self.event
        }
    }
}

/// An outbox row or message that cannot become an event (a header that is not a JSON
/// object, a message that is not the documented JSON, a `created_at` of `infinity`). It
/// still occupies its position: the engine dead-letters it (with `raw` as the record) and
/// then counts it as settled, or the slot could never move past it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Undecodable {
    /// What is wrong, naming the field.
    pub reason: String,
    pub source: EventSource,
    /// What could be read of the event, for the dead letter.
    pub event_id: Option<EventId>,
    pub destination: Option<String>,
    pub partition_key: Option<String>,
    /// The row as `column=value` lines, or the message's content as (lossy) UTF-8.
    pub raw: String,
}

impl Undecodable {
    /// The key its lane is ordered by: its partition key, else its destination, as an
    /// event's (empty when neither could be read).
    pub fn ordering_key(&self) -> &str {
        self.partition_key
            .as_deref()
            .or(self.destination.as_deref())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(lsn: u64, ordinal: u64) -> EventPosition {
        EventPosition {
            commit_lsn: Lsn(lsn),
            ordinal,
            xid: 7,
        }
    }

    /// Every bit of the commit LSN, and of the ordinal up to 2^56, makes another id: two
    /// transactions 4 KiB of WAL apart shared one when the version overwrote bits 12-15.
    #[test]
    fn derived_event_ids_differ_in_every_bit_of_the_position() {
        let base = at(0x1_0000, 0).derived_event_id();
        for bit in 0..64 {
            let other = at(0x1_0000 ^ (1 << bit), 0).derived_event_id();
            assert_ne!(other, base, "LSN bit {bit}");
        }
        for bit in 0..56 {
            assert_ne!(
                at(0x1_0000, 1 << bit).derived_event_id(),
                base,
                "ordinal bit {bit}"
            );
        }
        assert_eq!(base.get_version_num(), 8);
        assert_eq!(base.get_variant(), uuid::Variant::RFC4122);
        assert_eq!(at(0x1_0000, 0).derived_event_id(), base, "stable");
    }
}
