//! What a mapped table cannot hold, kept by its active relay: row handles for UUID ids, the
//! rows it holds, attempts (without an attempts column) and keys waiting for a retry. And the
//! decoding of a selected row into an event, shared by the PostgreSQL and MySQL executors.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use outbox_core::event::headers_from_json_text;
use outbox_core::time::from_micros;
use outbox_core::{Claimed, Event, Payload, SequenceId};
use uuid::Uuid;

use crate::{IdType, KeyFallback, Mapping, PayloadFormat};

/// A row id as the database returned it.
#[derive(Clone, Debug, PartialEq)]
pub enum RowId {
    Integer(i64),
    Uuid(Uuid),
}

impl RowId {
    pub fn integer(&self) -> Option<i64> {
        match self {
            RowId::Integer(i) => Some(*i),
            RowId::Uuid(_) => None,
        }
    }

    pub fn uuid(&self) -> Option<Uuid> {
        match self {
            RowId::Uuid(u) => Some(*u),
            RowId::Integer(_) => None,
        }
    }
}

/// A selected row, in [`crate::sql::Sql::select_list`] order, as plain values.
#[derive(Clone, Debug)]
pub struct RawRow {
    pub id: RowId,
    pub event_id: Option<String>,
    pub destination: Option<String>,
    pub key: Option<String>,
    pub event_type: Option<String>,
    pub payload: Option<Vec<u8>>,
    pub headers: Option<String>,
    pub mutation_id: Option<String>,
    pub rejected: Option<i64>,
    pub attempts: Option<i64>,
    pub created_micros: Option<i64>,
    pub max_attempts: Option<i64>,
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

impl RawRow {
    /// Reads the columns after the id, in [`crate::sql::Sql::select_list`] order: `payload`
    /// reads the payload column (bytes or text, as the mapping keeps it), `text` and `int`
    /// the others, which the statement casts to text or an integer.
    pub fn read<E>(
        id: RowId,
        text: impl Fn(usize) -> Result<Option<String>, E>,
        int: impl Fn(usize) -> Result<Option<i64>, E>,
        payload: impl FnOnce(usize) -> Result<Option<Vec<u8>>, E>,
    ) -> Result<RawRow, E> {
        Ok(RawRow {
            id,
            event_id: text(1)?,
            destination: text(2)?,
            key: text(3)?,
            event_type: text(4)?,
            payload: payload(5)?,
            headers: text(6)?,
            mutation_id: text(7)?,
            rejected: int(8)?,
            attempts: int(9)?,
            created_micros: int(10)?,
            max_attempts: int(11)?,
            traceparent: text(12)?,
            tracestate: text(13)?,
        })
    }
}

/// The active relay's memory of a mapped table. Engine handles are the integer ids
/// themselves; UUID ids get process-local numbers in claim order (so per-key order holds),
/// kept until the row settles.
#[derive(Default)]
pub struct Memory {
    next: i64,
    by_uuid: HashMap<Uuid, i64>,
    by_handle: HashMap<i64, Uuid>,
    /// Held rows: their ordering keys, the node holding them and until when.
    held: HashMap<i64, Held>,
    attempts: HashMap<i64, u32>,
    /// Keys whose head waits to retry, until when.
    retrying: HashMap<String, Instant>,
}

struct Held {
    key: String,
    node: String,
    until: Instant,
}

impl Memory {
    fn handle(&mut self, id: &RowId) -> i64 {
        match id {
            RowId::Integer(i) => *i,
            RowId::Uuid(u) => {
                if let Some(h) = self.by_uuid.get(u) {
                    return *h;
                }
                self.next += 1;
                self.by_uuid.insert(*u, self.next);
                self.by_handle.insert(self.next, *u);
                self.next
            }
        }
    }

    /// A new term as the table's active relay (the lock taken, or taken again after its
    /// session was lost): the rows the last term held are reaped back to pending, so all it
    /// knew goes, but handles keep counting up. The engine's lanes still hold the last
    /// term's handles: a row given one of them again was taken for that row's lease renewed
    /// and never published, and the old row's ack, mapped to the new row's UUID, deleted it
    /// undelivered. An ack of a last term's handle now maps to no row (the row comes again:
    /// a duplicate at worst).
    pub fn take_over(&mut self) {
        *self = Memory {
            next: self.next,
            ..Memory::default()
        };
    }

    /// The UUID behind a handle (UUID-keyed tables).
    pub fn uuid(&self, handle: SequenceId) -> Option<Uuid> {
        self.by_handle.get(&handle).copied()
    }

    /// Held handles.
    pub fn held(&self) -> Vec<SequenceId> {
        self.held.keys().copied().collect()
    }

    /// Keys a claim by `node` must leave out: a head waits to retry, or another node holds
    /// a live lease on the key.
    pub fn blocked_keys(&mut self, node: &str) -> Vec<String> {
        let now = Instant::now();
        self.retrying.retain(|_, due| *due > now);
        let mut keys: std::collections::BTreeSet<String> = self.retrying.keys().cloned().collect();
        keys.extend(
            self.held
                .values()
                .filter(|h| h.node != node && h.until > now)
                .map(|h| h.key.clone()),
        );
        keys.into_iter().collect()
    }

    /// Keys the table shows waiting to retry, each until its last row is due: a relay that
    /// takes the table over (a restart, a standby) blocks them as its predecessor did,
    /// whose memory is gone. Without it, a later row of such a key was claimed and
    /// delivered before the retry.
    pub fn waiting(&mut self, keys: impl IntoIterator<Item = (String, Duration)>) {
        let now = Instant::now();
        for (key, left) in keys {
            let due = now + left;
            let until = self.retrying.entry(key).or_insert(due);
            *until = (*until).max(due);
        }
    }

    /// A failed attempt: its key waits `delay`; attempts are remembered. Call it once the
    /// table has recorded the retry, so a table-side `available_at` is never later than the
    /// moment the key unblocks here.
    pub fn retry(&mut self, handle: SequenceId, attempts: u32, delay: Duration) {
        self.attempts.insert(handle, attempts);
        if let Some(held) = self.held.get(&handle) {
            self.retrying
                .insert(held.key.clone(), Instant::now() + delay);
        }
    }

    /// Failed attempts the table has recorded: each key waits its delay, and the rows leave
    /// this relay (see [`Memory::retry`]).
    pub fn retried(&mut self, retries: &[outbox_core::store::RetryLater]) {
        for r in retries {
            self.retry(r.sequence_id, r.attempts, r.delay);
        }
        let handles: Vec<SequenceId> = retries.iter().map(|r| r.sequence_id).collect();
        self.settled(&handles, false);
    }

    /// Leases extended to `now + lease`.
    pub fn extend(&mut self, handles: &[SequenceId], lease: Duration) {
        let until = Instant::now() + lease;
        for h in handles {
            if let Some(held) = self.held.get_mut(h) {
                held.until = until;
            }
        }
    }

    /// Rows that left this relay: released or retried (`done` false), or acked or dead.
    pub fn settled(&mut self, handles: &[SequenceId], done: bool) {
        for h in handles {
            self.held.remove(h);
            if done {
                self.attempts.remove(h);
                if let Some(u) = self.by_handle.remove(h) {
                    self.by_uuid.remove(&u);
                }
            }
        }
    }
}

/// The dedupe id of a row without an event id column: a name-based UUID of the table and row
/// id, the same on every attempt and every relay.
pub fn derived_event_id(mapping: &Mapping, id: &str) -> Uuid {
    let table = match &mapping.schema {
        Some(s) => format!("{s}.{}", mapping.table),
        None => mapping.table.clone(),
    };
    Uuid::new_v5(
        &Uuid::NAMESPACE_OID,
        format!("outbox-relay:{table}:{id}").as_bytes(),
    )
}

/// Decodes a claimed row and records it as held. A row that cannot be decoded becomes
/// [`Claimed::Undecodable`], to be dead-lettered; so does a `created_at` no event can carry
/// (see [`outbox_core::time::created_at_problem`]).
pub fn decode(
    mapping: &Mapping,
    raw: RawRow,
    memory: &mut Memory,
    node: &str,
    lease: Duration,
) -> Claimed {
    let handle = memory.handle(&raw.id);
    let id_text = match &raw.id {
        RowId::Integer(i) => i.to_string(),
        RowId::Uuid(u) => u.to_string(),
    };
    debug_assert_eq!(
        matches!(raw.id, RowId::Uuid(_)),
        mapping.id_type == IdType::Uuid
    );
    let destination = raw.destination.unwrap_or_default();
    let key = raw.key.unwrap_or_else(|| match mapping.key_fallback {
        KeyFallback::Destination => destination.clone(),
        KeyFallback::Row => format!("row:{id_text}"),
    });
    let attempts = raw
        .attempts
        .map(outbox_core::event::attempts_of)
        .unwrap_or_else(|| memory.attempts.get(&handle).copied().unwrap_or(0));
    memory.held.insert(
        handle,
        Held {
            key: key.clone(),
            node: node.to_string(),
            until: Instant::now() + lease,
        },
    );
    let payload = match (raw.payload, mapping.payload_format) {
        (None, _) => Ok(Payload::Null),
        (Some(bytes), PayloadFormat::Bytes | PayloadFormat::Text) => Ok(Payload::Bytes(bytes)),
        (Some(bytes), PayloadFormat::Json) => String::from_utf8(bytes)
            .map_err(|_| "payload is not UTF-8 JSON".to_string())
            .and_then(Payload::from_json_text),
    };
    let headers = match raw.headers {
        None => Ok(Default::default()),
        Some(text) => headers_from_json_text(&text),
    }
    // The dead letter of an event a capture could not decode, retried: no event to publish.
    .and_then(|h| {
        let event_type = raw.event_type.as_deref().unwrap_or_default();
        match outbox_core::event::undecodable_dead_letter(&h, event_type) {
            Some(reason) => Err(reason),
            None => Ok(h),
        }
    })
    .map(|h| {
        let (traceparent, tracestate) = match &mapping.span_context {
            Some(_) => outbox_core::trace::from_java_properties(
                raw.traceparent.as_deref().unwrap_or_default(),
            ),
            None => (raw.traceparent, raw.tracestate),
        };
        with_trace_columns(h, traceparent, tracestate, &id_text)
    });
    let event_id = match raw.event_id {
        Some(text) => Uuid::parse_str(text.trim()).map_err(|e| format!("event id {text:?}: {e}")),
        None => Ok(derived_event_id(mapping, &id_text)),
    };
    let created_at = match raw
        .created_micros
        .and_then(outbox_core::time::created_at_problem)
    {
        Some(reason) => Err(reason),
        None => Ok(()),
    };
    let decoded = payload.and_then(|p| {
        headers.and_then(|h| event_id.and_then(|id| created_at.map(|()| (p, h, id))))
    });
    match decoded {
        Ok((payload, mut headers, event_id)) => Claimed::Event(Arc::new(Event {
            sequence_id: handle,
            event_id,
            event_type: raw.event_type.unwrap_or_else(|| destination.clone()),
            destination,
            partition_key: Some(key),
            payload,
            headers: {
                if let Some(name) = &mapping.event_id_header {
                    headers.insert(name.clone(), event_id.hyphenated().to_string());
                }
                headers
            },
            mutation_id: raw.mutation_id,
            rejected: raw.rejected.unwrap_or(0) != 0,
            attempts,
            max_attempts: raw
                .max_attempts
                .map(|n| outbox_core::event::attempts_of(n.max(1))),
            created_at: raw.created_micros.map_or_else(SystemTime::now, from_micros),
        })),
        Err(reason) => Claimed::Undecodable {
            sequence_id: handle,
            ordering_key: key,
            destination,
            attempts,
            reason,
        },
    }
}

/// Adds a row's trace-context columns to its headers, as the header-carrying tables have
/// them: a valid `traceparent` (with `tracestate`, if any) becomes the `traceparent` header,
/// unless the headers already hold one. A malformed value is left out and reported once.
fn with_trace_columns(
    mut headers: outbox_core::Headers,
    traceparent: Option<String>,
    tracestate: Option<String>,
    row: &str,
) -> outbox_core::Headers {
    use outbox_core::trace::{TraceParent, TRACEPARENT, TRACESTATE};
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let Some(traceparent) = traceparent
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
    else {
        return headers;
    };
    if headers.keys().any(|k| k.eq_ignore_ascii_case(TRACEPARENT)) {
        return headers;
    }
    match TraceParent::parse(&traceparent) {
        Ok(parent) => {
            headers.insert(TRACEPARENT.into(), parent.to_string());
            if let Some(state) = tracestate
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
            {
                headers.insert(TRACESTATE.into(), state);
            }
        }
        Err(e) => {
            if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!(
                    row,
                    error = %e,
                    "the traceparent column holds a malformed value (W3C Trace Context); the \
                     event is delivered without trace context. Later malformed values are not \
                     reported"
                );
            }
        }
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(30);

    fn raw(id: RowId) -> RawRow {
        RawRow {
            id,
            event_id: None,
            destination: Some("t".into()),
            key: None,
            event_type: None,
            payload: Some(b"{\"a\":1}".to_vec()),
            headers: None,
            mutation_id: None,
            rejected: None,
            attempts: None,
            created_micros: None,
            max_attempts: None,
            traceparent: None,
            tracestate: None,
        }
    }

    /// Handles of UUID-keyed rows are never given twice, a new term included: the engine
    /// still holds the last term's.
    #[test]
    fn a_new_term_gives_no_handle_the_last_one_gave() {
        let mut memory = Memory::default();
        let (u1, u2, u3) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        assert_eq!(memory.handle(&RowId::Uuid(u1)), 1);
        assert_eq!(memory.handle(&RowId::Uuid(u2)), 2);
        memory.take_over();
        assert_eq!(
            memory.uuid(1),
            None,
            "an ack of the last term's handle maps to no row"
        );
        assert_eq!(memory.handle(&RowId::Uuid(u3)), 3);
        assert_eq!(memory.handle(&RowId::Uuid(u1)), 4);
    }

    #[test]
    fn trace_columns_become_headers_when_valid() {
        const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut m = Mapping::open_outbox("public", "e");
        m.traceparent = Some("traceparent".into());
        m.tracestate = Some("tracestate".into());
        let mut memory = Memory::default();
        let decoded = |raw: RawRow, memory: &mut Memory| match decode(&m, raw, memory, "n", LEASE) {
            Claimed::Event(e) => e.headers.clone(),
            other => panic!("{other:?}"),
        };
        let valid = RawRow {
            traceparent: Some(TP.into()),
            tracestate: Some("congo=t61rcWkgMzE".into()),
            ..raw(RowId::Uuid(Uuid::new_v4()))
        };
        let h = decoded(valid, &mut memory);
        assert_eq!(h["traceparent"], TP);
        assert_eq!(h["tracestate"], "congo=t61rcWkgMzE");
        let malformed = RawRow {
            traceparent: Some("00-nope".into()),
            tracestate: Some("congo=t61rcWkgMzE".into()),
            ..raw(RowId::Uuid(Uuid::new_v4()))
        };
        assert!(decoded(malformed, &mut memory).is_empty());
        let in_headers = RawRow {
            headers: Some(r#"{"traceparent":"mine"}"#.into()),
            traceparent: Some(TP.into()),
            ..raw(RowId::Uuid(Uuid::new_v4()))
        };
        assert_eq!(decoded(in_headers, &mut memory)["traceparent"], "mine");
    }

    /// Debezium's `tracingspancontext` is Java properties, as `Properties.store` writes it
    /// (a date comment first); its entries become the trace headers, and the event id travels
    /// as the `id` header too.
    #[test]
    fn a_debezium_row_reads_its_span_context_and_carries_its_id_header() {
        const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let m = Mapping::debezium("public", "outboxevent");
        let id = Uuid::new_v4();
        let row = RawRow {
            event_id: Some(id.to_string()),
            key: Some("order-1".into()),
            traceparent: Some(format!(
                "#Thu Nov 26 03:20:00 UTC 2026\ntraceparent={TP}\ntracestate=congo\\=t61rcWkgMzE\n"
            )),
            ..raw(RowId::Integer(7))
        };
        let event = match decode(&m, row, &mut Memory::default(), "n", LEASE) {
            Claimed::Event(e) => e,
            other => panic!("{other:?}"),
        };
        assert_eq!(event.headers["traceparent"], TP);
        assert_eq!(event.headers["tracestate"], "congo=t61rcWkgMzE");
        assert_eq!(event.headers["id"], id.to_string());
        assert_eq!(event.event_id, id);
        assert_eq!(event.partition_key.as_deref(), Some("order-1"));
        let without = RawRow {
            event_id: Some(id.to_string()),
            traceparent: Some("uber-trace-id=abc:def:0:1\n".into()),
            ..raw(RowId::Integer(8))
        };
        match decode(&m, without, &mut Memory::default(), "n", LEASE) {
            Claimed::Event(e) => assert!(!e.headers.contains_key("traceparent")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn uuid_rows_get_handles_in_claim_order_until_they_settle() {
        let m = Mapping::open_outbox("public", "e");
        let mut memory = Memory::default();
        let a = Uuid::new_v4();
        let b = Uuid::new_v4();
        let ha = decode(&m, raw(RowId::Uuid(a)), &mut memory, "n", LEASE).sequence_id();
        let hb = decode(&m, raw(RowId::Uuid(b)), &mut memory, "n", LEASE).sequence_id();
        assert!(ha < hb);
        assert_eq!(
            decode(&m, raw(RowId::Uuid(a)), &mut memory, "n", LEASE).sequence_id(),
            ha
        );
        memory.settled(&[ha], true);
        assert_eq!(memory.uuid(ha), None);
        assert_eq!(memory.uuid(hb), Some(b));
    }

    #[test]
    fn a_retrying_head_blocks_its_key_until_it_is_due() {
        let m = Mapping::adbc("public", "outbox");
        let mut memory = Memory::default();
        let h = decode(&m, raw(RowId::Integer(7)), &mut memory, "n", LEASE).sequence_id();
        memory.retry(h, 1, Duration::from_secs(60));
        memory.settled(&[h], false);
        assert_eq!(memory.blocked_keys("n"), ["t"]);
        memory.retrying.insert("t".into(), Instant::now());
        assert!(
            memory.blocked_keys("n").is_empty(),
            "due: the key flows again"
        );
        match decode(&m, raw(RowId::Integer(7)), &mut memory, "n", LEASE) {
            Claimed::Event(e) => {
                assert_eq!(e.attempts, 1);
                assert_eq!(e.event_id, derived_event_id(&m, "7"), "stable dedupe id");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn keys_held_by_another_node_are_blocked() {
        let m = Mapping::adbc("public", "outbox");
        let mut memory = Memory::default();
        decode(&m, raw(RowId::Integer(1)), &mut memory, "a", LEASE);
        assert_eq!(memory.blocked_keys("b"), ["t"]);
        assert!(memory.blocked_keys("a").is_empty());
        memory.extend(&[1], Duration::ZERO);
        assert!(
            memory.blocked_keys("b").is_empty(),
            "an expired lease blocks nothing"
        );
    }

    #[test]
    fn a_row_that_is_not_json_is_undecodable_not_fatal() {
        let m = Mapping::adbc("public", "outbox");
        let mut row = raw(RowId::Integer(1));
        row.payload = Some(b"New comment!".to_vec());
        assert!(matches!(
            decode(&m, row, &mut Memory::default(), "n", LEASE),
            Claimed::Undecodable { .. }
        ));
    }
}
