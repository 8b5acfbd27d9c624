//! Table-less events: the emit-message format, its decoder, and the SQL function that
//! writes it.
//!
//! # The format (version 1)
//!
//! An application writes an event, in its own transaction, as a transactional logical
//! decoding message:
//!
//! ```sql
//! SELECT pg_logical_emit_message(true, 'outbox', '<content>');
//! ```
//!
//! - **prefix**: `outbox` ([`EMIT_PREFIX`]). Messages with other prefixes are not ours and
//!   are skipped. pgoutput sends every message of the database whatever the publication,
//!   so the prefix is the only filter.
//! - **transactional**: must be `true`. A transactional message is decoded only if its
//!   transaction commits, in the transaction's commit order, together with the rest of the
//!   transaction. A non-transactional one is sent at once even if the writer then rolls
//!   back, which an outbox must never do: it is skipped and reported
//!   ([`crate::Output::Skipped`]).
//! - **content**: one UTF-8 JSON object:
//!
//! | field | type | |
//! |---|---|---|
//! | `v` | number | format version, `1`; absent means 1; any other value is undecodable |
//! | `destination` | string | required: the channel, topic or subject |
//! | `type` | string | required: the message name (`event_type`) |
//! | `key` | string or null | the ordering key (`partition_key`); null or absent: the destination |
//! | `payload` | any JSON | the message body, kept verbatim; null or absent: no payload |
//! | `headers` | object | string values as they are, others as their JSON text; null or absent: none |
//! | `event_id` | UUID string | the idempotency key; absent: derived from the event's WAL position ([`crate::EventPosition::derived_event_id`]), so a redelivery carries the same id |
//! | `mutation_id` | string | optional, as in the table |
//!
//! Other fields are ignored, so later versions can add optional ones. Content that breaks
//! these rules becomes an [`Undecodable`] event, which the engine dead-letters.
//!
//! The event's `created_at` is its transaction's commit time. No table row exists, so no
//! table grows and nothing is deleted after delivery.
//!
//! [`emit_function_ddl`] creates `outbox_emit(...)`, which writes this format.

use std::time::SystemTime;

use outbox_core::ident::TableName;
use outbox_core::{Event, EventId, Headers, Payload};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::event::{EventPosition, EventSource, Undecodable, WalEvent};
use crate::lsn::Lsn;

/// The logical decoding message prefix of the default outbox's events (`public.outbox`).
pub const EMIT_PREFIX: &str = "outbox";

/// The message prefix of `outbox`'s events: [`EMIT_PREFIX`] for `public.outbox` (as it
/// always was), `outbox:<schema>.<table>` for any other. pgoutput sends every message of the
/// database to every slot, so the prefix is what keeps two outboxes of one database from
/// relaying each other's events.
pub fn emit_prefix(outbox: &TableName) -> String {
    if outbox.schema.as_str() == "public" && outbox.name.as_str() == "outbox" {
        EMIT_PREFIX.to_string()
    } else {
        format!("{EMIT_PREFIX}:{}.{}", outbox.schema, outbox.name)
    }
}

/// `outbox`'s emit function, quoted: `<schema>."<table>_emit"` (`outbox_emit` for a table
/// named `outbox`).
pub fn emit_function(outbox: &TableName) -> String {
    format!("{}.\"{}_emit\"", outbox.schema.quoted(), outbox.name)
}

/// The content of the non-transactional outbox message `run --drain` writes at start-up: its
/// position marks "everything committed before the drain started" (it is not an event).
pub const DRAIN_MARKER: &[u8] = b"outbox-relay drain marker";

/// The SQL function that writes an outbox message.
pub const EMIT_FUNCTION: &str = "outbox_emit";

/// Creates `<schema>.outbox_emit(destination text, key text, type text, payload jsonb,
/// headers jsonb DEFAULT '{}', event_id uuid DEFAULT gen_random_uuid()) RETURNS uuid`: writes
/// one event in the [format](self) into the caller's transaction and returns its event id.
/// Needs no privilege beyond EXECUTE: `pg_logical_emit_message` is executable by PUBLIC. A
/// NULL destination or type raises an error in the writer's transaction, where it can still
/// be fixed, rather than becoming a dead letter later; a NULL event_id gets a fresh one.
/// So does an emit while no slot of the relay's streams (none yet before its first start,
/// one dropped, one being made, one invalidated): a message is in the WAL only, and one
/// written before a slot is consistent is in no slot's stream. Such events were accepted and
/// lost without a word. The relay's slots are those `<outbox>_adopted` names (a slot's first
/// session records it there), which every role may read: any pgoutput slot of the database
/// let emits through, so an application's own logical replication subscriber made the
/// relay's absence silent again. The slots are read once a second per session (a read costs
/// several emits), so an emit within a second of a slot's drop can still pass.
///
/// Applied by every `migrate`, so it leaves a function with this body as it is, and keeps
/// `SECURITY DEFINER` on one it replaces: the README's gate (a `SECURITY DEFINER` function,
/// the only way to emit) makes it so, and `CREATE OR REPLACE` alone set it back to the
/// caller's rights, so every writer's next emit failed for lack of `pg_logical_emit_message`.
pub fn emit_function_ddl(outbox: &TableName) -> String {
    let function = emit_function(outbox);
    let signature = emit_signature(outbox);
    let signature_literal = signature.replace('\'', "''");
    let body = emit_function_body(outbox);
    format!(
        r#"DO $migrate_emit$
DECLARE
    current_body text;
    definer boolean;
BEGIN
    SELECT p.prosrc, p.prosecdef INTO current_body, definer
      FROM pg_catalog.pg_proc p
     WHERE p.oid = pg_catalog.to_regprocedure('{signature_literal}');
    IF current_body IS NOT DISTINCT FROM $outbox_emit${body}$outbox_emit$ THEN
        RETURN;
    END IF;
    CREATE OR REPLACE FUNCTION {function}(
        destination text, key text, type text, payload jsonb,
        headers jsonb DEFAULT '{{}}', event_id uuid DEFAULT gen_random_uuid())
    RETURNS uuid
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
    AS $outbox_emit${body}$outbox_emit$;
    IF definer THEN
        ALTER FUNCTION {signature} SECURITY DEFINER;
    END IF;
END
$migrate_emit$;"#
    )
}

/// `outbox`'s emit function with its argument types, as `to_regprocedure` reads it.
pub fn emit_signature(outbox: &TableName) -> String {
    format!(
        "{}(text, text, text, jsonb, jsonb, uuid)",
        emit_function(outbox)
    )
}

/// The body this version gives `outbox`'s emit function (`pg_proc.prosrc`): `check` tells
/// an earlier version's apart by it.
pub fn emit_function_body(outbox: &TableName) -> String {
    let prefix = emit_prefix(outbox).replace('\'', "''");
    let name = format!("{}_emit", outbox.name);
    let adopted = crate::schema::sibling(outbox, "_adopted").quoted();
    format!(
        r#"
DECLARE
    id uuid := coalesce($6, gen_random_uuid());
BEGIN
    IF $1 IS NULL OR $3 IS NULL THEN
        RAISE EXCEPTION '{name}: destination and type must not be NULL'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    -- Looked at once a second per session: reading the slots costs more than the emit.
    IF current_setting('outbox_relay.stream_seen', true)
       IS DISTINCT FROM date_trunc('second', statement_timestamp())::text THEN
        IF NOT EXISTS (SELECT FROM pg_replication_slots s JOIN {adopted} a ON a.slot = s.slot_name
                        WHERE s.database = current_database() AND s.plugin = 'pgoutput'
                          AND s.confirmed_flush_lsn IS NOT NULL
                          AND s.wal_status IS DISTINCT FROM 'lost') THEN
            RAISE EXCEPTION '{name}: no replication slot of outbox-relay streams yet, so this event would be written to no stream and lost'
                USING ERRCODE = 'object_not_in_prerequisite_state',
                      HINT = 'start outbox-relay run --capture wal (its first start makes the slot), then write again';
        END IF;
        PERFORM set_config('outbox_relay.stream_seen',
                           date_trunc('second', statement_timestamp())::text, false);
    END IF;
    PERFORM pg_logical_emit_message(true, '{prefix}', json_build_object(
        'v', 1, 'event_id', id, 'destination', $1, 'key', $2, 'type', $3,
        'payload', $4, 'headers', coalesce($5, '{{}}'::jsonb))::text);
    RETURN id;
END
"#
    )
}

/// The JSON content, as written.
#[derive(Deserialize)]
struct Content {
    v: Option<serde_json::Value>,
    event_id: Option<EventId>,
    destination: String,
    key: Option<String>,
    #[serde(rename = "type")]
    event_type: String,
    payload: Option<Box<RawValue>>,
    headers: Option<Box<serde_json::value::RawValue>>,
    mutation_id: Option<String>,
}

/// A message's content for its dead letter: as text when it is UTF-8 without a NUL (and
/// does not begin as the hex form does), else every byte in PostgreSQL's bytea hex form
/// (`\x…`), which
/// `decode(substr(payload #>> '{}', 3), 'hex')` reads back. (As lossy text, bytes that were
/// not UTF-8 were lost, and a NUL, shown as `\0`, could not be told from those two
/// characters.)
fn raw_content(content: &[u8]) -> String {
    match std::str::from_utf8(content) {
        Ok(text) if !text.contains('\0') && !text.starts_with("\\x") => text.to_string(),
        _ => {
            let hex: String = content.iter().map(|b| format!("{b:02x}")).collect();
            format!("\\x{hex}")
        }
    }
}

/// Decodes one outbox message's content at `position`. `lsn` is the message's own WAL
/// position and `commit_time` its transaction's.
pub fn decode_message(
    content: &[u8],
    lsn: Lsn,
    position: EventPosition,
    commit_time: SystemTime,
) -> Result<WalEvent, Box<Undecodable>> {
    let source = EventSource::Message { lsn };
    let undecodable = |reason: String| Undecodable {
        reason,
        source,
        event_id: None,
        destination: None,
        partition_key: None,
        raw: raw_content(content),
    };
    let text = std::str::from_utf8(content)
        .map_err(|_| Box::new(undecodable("the outbox message is not UTF-8".into())))?;
    let message: Content = serde_json::from_str(text).map_err(|e| {
        Box::new(undecodable(format!(
            "the outbox message is not the documented JSON object: {e}"
        )))
    })?;
    let fail = |reason: String| {
        Box::new(Undecodable {
            event_id: message.event_id,
            destination: Some(message.destination.clone()),
            partition_key: message.key.clone(),
            ..undecodable(reason)
        })
    };
    match &message.v {
        None => {}
        Some(v) if v.as_u64() == Some(1) => {}
        Some(other) => {
            return Err(fail(format!(
                "outbox message format version {other} is not supported (only 1)"
            )))
        }
    }
    let headers = match &message.headers {
        None => Headers::new(),
        Some(text) => outbox_core::event::headers_from_json_text(text.get()).map_err(&fail)?,
    };
    Ok(WalEvent {
        event: Event {
            partition_key: message.key,
            headers,
            mutation_id: message.mutation_id,
            created_at: commit_time,
            ..Event::new(
                0,
                message
                    .event_id
                    .unwrap_or_else(|| position.derived_event_id()),
                message.destination,
                message.event_type,
                message.payload.map_or(Payload::Null, Payload::Json),
            )
        },
        available_at: None,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const POSITION: EventPosition = EventPosition {
        commit_lsn: Lsn(0x100),
        ordinal: 3,
        xid: 7,
    };

    fn decode(text: &str) -> Result<WalEvent, Box<Undecodable>> {
        decode_message(text.as_bytes(), Lsn(0x90), POSITION, SystemTime::UNIX_EPOCH)
    }

    #[test]
    fn decodes_the_documented_fields() {
        let event = decode(
            r#"{"v":1,"event_id":"6f1c9f3e-8d3a-4c1e-9a51-3c2b1d0e9f10","destination":"orders",
               "key":"o-1","type":"OrderPlaced","payload":{"b": 2, "a": [1]},
               "headers":{"trace":"t1","n":5},"mutation_id":"m1","future":true}"#,
        )
        .unwrap();
        assert_eq!(
            event.event_id.to_string(),
            "6f1c9f3e-8d3a-4c1e-9a51-3c2b1d0e9f10"
        );
        assert_eq!(event.destination, "orders");
        assert_eq!(event.ordering_key(), "o-1");
        assert_eq!(event.event_type, "OrderPlaced");
        assert_eq!(event.payload.as_bytes(), br#"{"b": 2, "a": [1]}"#);
        assert_eq!(event.headers["trace"], "t1");
        assert_eq!(event.headers["n"], "5");
        assert_eq!(event.mutation_id.as_deref(), Some("m1"));
        assert_eq!(event.source, EventSource::Message { lsn: Lsn(0x90) });
    }

    #[test]
    fn optional_fields_default_and_the_id_follows_the_position() {
        let a = decode(r#"{"destination":"d","type":"t"}"#).unwrap();
        let b = decode(r#"{"destination":"d","type":"t","key":null,"payload":null}"#).unwrap();
        assert_eq!(a.event_id, b.event_id);
        assert_eq!(a.event_id, POSITION.derived_event_id());
        assert_eq!(a.event_id.get_version_num(), 8);
        assert_eq!(a.ordering_key(), "d");
        assert!(matches!(a.payload, Payload::Null));
        assert!(a.headers.is_empty());
        let other = EventPosition {
            ordinal: 4,
            ..POSITION
        };
        assert_ne!(other.derived_event_id(), a.event_id);
    }

    #[test]
    fn content_that_breaks_the_format_is_undecodable_and_says_why() {
        for (content, why) in [
            ("not json", "not the documented JSON"),
            (r#"{"type":"t"}"#, "destination"),
            (r#"{"destination":"d","type":"t","v":2}"#, "version 2"),
            (
                r#"{"destination":"d","type":"t","headers":[1]}"#,
                "headers must be a JSON object",
            ),
            (
                r#"{"destination":"d","type":"t","event_id":"nope"}"#,
                "UUID",
            ),
        ] {
            let error = decode(content).unwrap_err();
            assert!(error.reason.contains(why), "{content}: {}", error.reason);
            assert_eq!(error.raw, content);
        }
        let error = decode_message(b"\xff", Lsn(1), POSITION, SystemTime::UNIX_EPOCH).unwrap_err();
        assert!(error.reason.contains("UTF-8"));
        assert_eq!(error.raw, "\\xff", "every byte kept");
        let error = decode_message(b"\0", Lsn(1), POSITION, SystemTime::UNIX_EPOCH).unwrap_err();
        assert_eq!(error.raw, "\\x00");
        let error = decode_message(b"\\x41", Lsn(1), POSITION, SystemTime::UNIX_EPOCH).unwrap_err();
        assert_eq!(
            error.raw, "\\x5c783431",
            "text that reads as the hex form is hex too"
        );
    }

    #[test]
    fn the_function_quotes_its_schema_and_uses_the_prefix() {
        let ddl = emit_function_ddl(&TableName::new("public", "outbox").unwrap());
        assert!(ddl.contains("CREATE OR REPLACE FUNCTION \"public\".\"outbox_emit\"("));
        assert!(ddl.contains("pg_logical_emit_message(true, 'outbox',"));
    }

    #[test]
    fn every_other_outbox_has_a_prefix_and_a_function_of_its_own() {
        let orders = TableName::new("app", "orders_outbox").unwrap();
        let other_schema = TableName::new("app", "outbox").unwrap();
        assert_eq!(emit_prefix(&orders), "outbox:app.orders_outbox");
        assert_eq!(emit_prefix(&other_schema), "outbox:app.outbox");
        let ddl = emit_function_ddl(&orders);
        assert!(ddl.contains("CREATE OR REPLACE FUNCTION \"app\".\"orders_outbox_emit\"("));
        assert!(ddl.contains("pg_logical_emit_message(true, 'outbox:app.orders_outbox',"));
    }
}
