//! The transaction assembler: decoded pgoutput messages in, committed outbox events out, in
//! commit order, without holding a transaction in memory.
//!
//! pgoutput (protocol version 1, no streaming) sends a transaction only after it committed,
//! whole, and transactions in commit order. So every event between a Begin and its Commit
//! belongs to a committed transaction, and the assembler hands each one out as it arrives,
//! tagged with its [`EventPosition`]; the Commit then closes the transaction with
//! [`Output::Committed`], which carries the `end_lsn` to confirm once every event of the
//! transaction is safe (see [`crate::ack`]). A 100,000-event transaction therefore passes
//! through one event at a time: [`Assembler::buffered_events`] is always 0.
//!
//! A rolled-back transaction is never sent, and neither are its messages: rows and
//! transactional messages of an aborted transaction can never come out.
//!
//! One assembler serves one replication session: the server sends Relation messages again
//! in every session, and a transaction cut off by a broken connection is sent again, whole,
//! in the next.

use std::collections::HashMap;
use std::time::SystemTime;

use crate::decode::{self, Begin, DecodeError, LogicalMessage};
use crate::emit;
use crate::event::{EventPosition, Undecodable, WalEvent};
use crate::lsn::Lsn;
use crate::table::{OutboxColumns, SourceTable};

/// What the assembler hands out, in stream order.
// Nearly every output is an event: boxing it would cost an allocation per event to save
// space in the rare markers.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum Output {
    /// An event of the open (committed) transaction; `Err` when the row or message cannot
    /// be decoded, which still counts as an event of its transaction.
    Event {
        position: EventPosition,
        event: Result<WalEvent, Box<Undecodable>>,
    },
    /// The transaction at `commit_lsn` ended after `events` events. Confirming `end_lsn`
    /// tells the server never to send it again.
    Committed {
        commit_lsn: Lsn,
        end_lsn: Lsn,
        events: u64,
        commit_time: SystemTime,
    },
    /// A server keepalive between transactions: every transaction that committed before
    /// `wal_end` has been sent. Once those are settled, `wal_end` may be confirmed, which
    /// keeps the slot moving while the outbox is idle and other databases write.
    Idle { wal_end: Lsn },
    /// A message with the outbox prefix that is not transactional: it was sent whether or
    /// not its writer committed, so it is not relayed. The caller logs it.
    Skipped { lsn: Lsn, reason: &'static str },
}

/// The stream broke pgoutput's rules, or the outbox table cannot be read. The session
/// cannot go on; a new one (from the slot's confirmed position) may.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AssembleError {
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error("pgoutput stream out of order: {0}")]
    OutOfOrder(String),
    #[error("pgoutput sent a change of relation {oid} before describing it")]
    UnknownRelation { oid: u32 },
}

/// Counts of what went through, for metrics and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AssemblerStats {
    pub transactions: u64,
    pub events: u64,
    pub undecodable: u64,
    /// Changes of other tables, and updates, deletes and truncates of any.
    pub other_changes: u64,
    /// Messages with other prefixes.
    pub other_messages: u64,
    pub skipped: u64,
    /// Relation messages describing a captured table: the server sends one before the
    /// table's first change of a session, and again after its definition, or what the
    /// publication sends of it, changed.
    pub captured_relations: u64,
}

struct OpenTransaction {
    begin: Begin,
    commit_time: SystemTime,
    events: u64,
}

/// Turns one session's decoded messages into [`Output`]s.
pub struct Assembler {
    /// The captured tables: the configured one, and the native outbox beside a mapped
    /// table (`dead retry` and `send` write there).
    sources: Vec<SourceTable>,
    prefix: String,
    /// Relation OID → the outbox's columns, or `None` for another table.
    relations: HashMap<u32, Option<OutboxColumns>>,
    open: Option<OpenTransaction>,
    stats: AssemblerStats,
}

impl Assembler {
    /// Events are rows inserted into `source` and transactional messages with `prefix`
    /// ([`emit::EMIT_PREFIX`] unless configured otherwise).
    pub fn new(source: SourceTable, prefix: impl Into<String>) -> Self {
        Assembler {
            sources: vec![source],
            prefix: prefix.into(),
            relations: HashMap::new(),
            open: None,
            stats: AssemblerStats::default(),
        }
    }

    /// Captures the rows inserted into `source` too.
    pub fn also(mut self, source: SourceTable) -> Self {
        self.sources.push(source);
        self
    }

    /// Decodes and assembles one `XLogData` payload.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> Result<Option<Output>, AssembleError> {
        self.push(decode::decode(bytes)?)
    }

    /// Assembles one message: at most one output per message.
    pub fn push(&mut self, message: LogicalMessage<'_>) -> Result<Option<Output>, AssembleError> {
        match message {
            LogicalMessage::Begin(begin) => {
                if let Some(open) = &self.open {
                    return Err(AssembleError::OutOfOrder(format!(
                        "Begin of the transaction at {} while the one at {} is open",
                        begin.final_lsn, open.begin.final_lsn
                    )));
                }
                self.open = Some(OpenTransaction {
                    begin,
                    commit_time: pg_time(begin.commit_time),
                    events: 0,
                });
                Ok(None)
            }
            LogicalMessage::Commit(commit) => {
                let open = self.open.take().ok_or_else(|| {
                    AssembleError::OutOfOrder(format!(
                        "Commit at {} outside a transaction",
                        commit.commit_lsn
                    ))
                })?;
                if commit.commit_lsn != open.begin.final_lsn {
                    return Err(AssembleError::OutOfOrder(format!(
                        "Commit at {} closes the transaction that began with final LSN {}",
                        commit.commit_lsn, open.begin.final_lsn
                    )));
                }
                self.stats.transactions += 1;
                Ok(Some(Output::Committed {
                    commit_lsn: commit.commit_lsn,
                    end_lsn: commit.end_lsn,
                    events: open.events,
                    commit_time: open.commit_time,
                }))
            }
            LogicalMessage::Relation(relation) => {
                let columns = self
                    .sources
                    .iter()
                    .find_map(|source| source.columns_of(&relation));
                if columns.is_some() {
                    self.stats.captured_relations += 1;
                }
                self.relations.insert(relation.oid, columns);
                Ok(None)
            }
            LogicalMessage::Insert(insert) => {
                let columns =
                    self.relations
                        .get(&insert.relation)
                        .ok_or(AssembleError::UnknownRelation {
                            oid: insert.relation,
                        })?;
                let Some(columns) = columns else {
                    self.stats.other_changes += 1;
                    return Ok(None);
                };
                let (position, commit_time) = next_position(&mut self.open, "Insert")?;
                let event = columns.event(&insert.new, commit_time);
                Ok(Some(self.hand_out(position, event)))
            }
            LogicalMessage::Message(message) => {
                if message.prefix != self.prefix {
                    self.stats.other_messages += 1;
                    return Ok(None);
                }
                if !message.transactional && message.content == emit::DRAIN_MARKER {
                    // `run --drain` wrote it between transactions: everything committed
                    // before it has been sent.
                    return Ok(self.keepalive(message.lsn));
                }
                if !message.transactional {
                    self.stats.skipped += 1;
                    return Ok(Some(Output::Skipped {
                        lsn: message.lsn,
                        reason: "a non-transactional message with the outbox prefix is sent \
                                 even if its transaction rolls back; write events with \
                                 pg_logical_emit_message(true, ...) or outbox_emit(...)",
                    }));
                }
                let (position, commit_time) = next_position(&mut self.open, "Message")?;
                let event =
                    emit::decode_message(message.content, message.lsn, position, commit_time);
                Ok(Some(self.hand_out(position, event)))
            }
            // The publication asks for INSERTs only; whatever else arrives is skipped, whole.
            LogicalMessage::Update(_) | LogicalMessage::Delete(_) | LogicalMessage::Truncate(_) => {
                self.stats.other_changes += 1;
                Ok(None)
            }
            LogicalMessage::Origin(_) | LogicalMessage::Type(_) => Ok(None),
        }
    }

    /// A server keepalive at `wal_end`: [`Output::Idle`] between transactions, nothing
    /// inside one (its position may lie past the open transaction's commit, and confirming
    /// that would skip the rest of the transaction after a restart).
    pub fn keepalive(&mut self, wal_end: Lsn) -> Option<Output> {
        if self.open.is_some() {
            None
        } else {
            Some(Output::Idle { wal_end })
        }
    }

    /// Events decoded and not yet handed out. Always 0: each event leaves with the message
    /// that carried it. Kept so that tests hold the design to it.
    pub fn buffered_events(&self) -> usize {
        0
    }

    /// Whether a transaction has begun and not yet committed in this stream.
    pub fn in_transaction(&self) -> bool {
        self.open.is_some()
    }

    pub fn stats(&self) -> AssemblerStats {
        self.stats
    }

    fn hand_out(
        &mut self,
        position: EventPosition,
        event: Result<WalEvent, Box<Undecodable>>,
    ) -> Output {
        self.stats.events += 1;
        if event.is_err() {
            self.stats.undecodable += 1;
        }
        Output::Event { position, event }
    }
}

/// The next event's position in the open transaction.
fn next_position(
    open: &mut Option<OpenTransaction>,
    what: &str,
) -> Result<(EventPosition, SystemTime), AssembleError> {
    let open = open
        .as_mut()
        .ok_or_else(|| AssembleError::OutOfOrder(format!("{what} outside a transaction")))?;
    let position = EventPosition {
        commit_lsn: open.begin.final_lsn,
        ordinal: open.events,
        xid: open.begin.xid,
    };
    open.events += 1;
    Ok((position, open.commit_time))
}

/// PostgreSQL's epoch, 2000-01-01, in microseconds after the Unix epoch.
const PG_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;

/// A PostgreSQL timestamp (microseconds since 2000-01-01 UTC) as a time.
pub(crate) fn pg_time(micros_since_2000: i64) -> SystemTime {
    outbox_core::time::from_micros(micros_since_2000.saturating_add(PG_EPOCH_UNIX_MICROS))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::wire;
    use crate::event::EventSource;
    use outbox_core::ident::TableName;

    /// An assembler of a table of the columns of [`COLUMNS`].
    fn assembler() -> Assembler {
        let outbox = TableName::new("public", "outbox").unwrap();
        Assembler::new(SourceTable::native(outbox), emit::EMIT_PREFIX)
    }

    const COLUMNS: &[(&str, u32)] = &[
        ("sequence_id", 20),
        ("event_id", 2950),
        ("destination", 25),
        ("event_type", 25),
        ("payload", 3802),
    ];

    fn row(sequence: &str) -> Vec<u8> {
        wire::insert(
            9,
            &[
                Some(sequence),
                Some("6f1c9f3e-8d3a-4c1e-9a51-3c2b1d0e9f10"),
                Some("orders"),
                Some("Placed"),
                None,
            ],
        )
    }

    fn feed(a: &mut Assembler, messages: &[Vec<u8>]) -> Vec<Output> {
        messages
            .iter()
            .filter_map(|m| a.push_bytes(m).unwrap())
            .collect()
    }

    #[test]
    fn events_leave_as_they_arrive_and_the_commit_closes_them() {
        let mut a = assembler();
        let out = feed(
            &mut a,
            &[
                wire::begin(0x500, 0, 1),
                wire::relation(9, "public", "outbox", COLUMNS),
                wire::relation(10, "public", "orders", &[("id", 20)]),
                wire::insert(10, &[Some("1")]),
                row("2"),
                wire::message(true, 0x480, "other", b"x"),
                wire::message(true, 0x490, "outbox", br#"{"destination":"d","type":"t"}"#),
                wire::commit(0x500, 0x528, 0),
            ],
        );
        assert_eq!(out.len(), 3);
        let Output::Event { position, event } = &out[0] else {
            panic!("{out:?}")
        };
        assert_eq!(
            *position,
            EventPosition {
                commit_lsn: Lsn(0x500),
                ordinal: 0,
                xid: 1,
            }
        );
        assert_eq!(
            event.as_ref().unwrap().source,
            EventSource::Table {
                sequence_id: Some(2)
            }
        );
        let Output::Event { position, event } = &out[1] else {
            panic!("{out:?}")
        };
        assert_eq!(position.ordinal, 1);
        assert_eq!(
            event.as_ref().unwrap().source,
            EventSource::Message { lsn: Lsn(0x490) }
        );
        let Output::Committed {
            commit_lsn,
            end_lsn,
            events,
            ..
        } = &out[2]
        else {
            panic!("{out:?}")
        };
        assert_eq!(
            (*commit_lsn, *end_lsn, *events),
            (Lsn(0x500), Lsn(0x528), 2)
        );
        let stats = a.stats();
        assert_eq!(
            (stats.events, stats.other_changes, stats.other_messages),
            (2, 1, 1)
        );
    }

    #[test]
    fn keepalives_inside_a_transaction_are_not_idle_positions() {
        let mut a = assembler();
        assert!(matches!(
            a.keepalive(Lsn(5)),
            Some(Output::Idle { wal_end: Lsn(5) })
        ));
        a.push_bytes(&wire::begin(0x500, 0, 1)).unwrap();
        assert!(a.keepalive(Lsn(0x600)).is_none());
        a.push_bytes(&wire::commit(0x500, 0x528, 0)).unwrap();
        assert!(a.keepalive(Lsn(0x600)).is_some());
    }

    #[test]
    fn out_of_order_streams_and_unknown_relations_are_errors() {
        let mut a = assembler();
        assert!(matches!(
            a.push_bytes(&wire::commit(1, 2, 0)),
            Err(AssembleError::OutOfOrder(_))
        ));
        a.push_bytes(&wire::begin(0x500, 0, 1)).unwrap();
        assert!(matches!(
            a.push_bytes(&wire::begin(0x600, 0, 2)),
            Err(AssembleError::OutOfOrder(_))
        ));
        assert_eq!(
            a.push_bytes(&row("1")).unwrap_err(),
            AssembleError::UnknownRelation { oid: 9 }
        );
        assert!(matches!(
            a.push_bytes(&wire::commit(0x501, 0x528, 0)),
            Err(AssembleError::OutOfOrder(_))
        ));
        let mut b = assembler();
        b.push_bytes(&wire::relation(9, "public", "outbox", COLUMNS))
            .unwrap();
        assert!(matches!(
            b.push_bytes(&row("1")),
            Err(AssembleError::OutOfOrder(_))
        ));
        // A table whose columns were renamed away: its rows are undecodable, saying which
        // column is gone (the session ended at the message, at every try, for good).
        let mut c = assembler();
        c.push_bytes(&wire::relation(9, "public", "outbox", &[("x", 25)]))
            .unwrap();
        c.push_bytes(&wire::begin(0x500, 0, 7)).unwrap();
        let out = c.push_bytes(&wire::insert(9, &[Some("1")])).unwrap();
        let Some(Output::Event {
            event: Err(undecodable),
            ..
        }) = out
        else {
            panic!("an undecodable row: {out:?}")
        };
        assert!(
            undecodable
                .reason
                .contains("public.outbox has no column event_id, destination, event_type, payload"),
            "{}",
            undecodable.reason
        );
        assert!(undecodable.raw.contains("x=1"), "{}", undecodable.raw);
    }

    #[test]
    fn non_transactional_outbox_messages_are_skipped_and_said() {
        let mut a = assembler();
        let out = a
            .push_bytes(&wire::message(false, 7, "outbox", b"{}"))
            .unwrap();
        assert!(matches!(out, Some(Output::Skipped { lsn: Lsn(7), .. })));
        assert_eq!(
            a.push_bytes(&wire::message(false, 8, "x", b""))
                .unwrap()
                .map(|_| ()),
            None
        );
    }

    /// Random streams of well-formed messages in any order, with random column values and
    /// message contents: every message is assembled or refused, and none panics.
    #[test]
    fn no_message_sequence_makes_the_assembler_panic() {
        let mut rng = fastrand::Rng::with_seed(16);
        let texts = [
            "",
            "null",
            "{}",
            "[1]",
            "x",
            "6f1c9f3e-8d3a-4c1e-9a51-3c2b1d0e9f10",
            "2026-11-23 12:38:36+00",
            "infinity",
            r#"{"destination":"d","type":"t"}"#,
            r#"{"destination":"d","type":"t","headers":{"a":1},"v":1}"#,
        ];
        let mut a = assembler();
        for _ in 0..20_000 {
            let columns = rng.usize(0..6);
            let values: Vec<Option<&str>> = (0..columns)
                .map(|_| (rng.u8(..4) != 0).then(|| texts[rng.usize(..texts.len())]))
                .collect();
            let lsn = rng.u64(..64);
            let message = match rng.u8(..6) {
                0 => wire::begin(lsn, 0, 1),
                1 => wire::commit(lsn, lsn + 1, 0),
                2 => wire::relation(
                    rng.u32(8..11),
                    "public",
                    "outbox",
                    &COLUMNS[..rng.usize(0..=4)],
                ),
                3 => wire::insert(rng.u32(8..11), &values),
                4 => wire::message(
                    rng.bool(),
                    lsn,
                    "outbox",
                    texts[rng.usize(..texts.len())].as_bytes(),
                ),
                _ => wire::relation(rng.u32(8..11), "public", "orders", COLUMNS),
            };
            if let Ok(Some(Output::Committed { .. })) = a.push_bytes(&message) {
                assert!(!a.in_transaction());
            }
        }
    }
}
