//! WAL capture: outbox events read from PostgreSQL logical replication, in commit order.
//!
//! The pieces, from the wire up:
//! - [`mod@decode`]: the pgoutput decoder (protocol version 1, with messages). Pure.
//! - [`table`] and [`emit`]: what an event looks like in the WAL: an INSERT into the native
//!   outbox table (columns found by name), or a transactional logical decoding message with
//!   the `outbox` prefix (the format and the `outbox_emit` SQL function are in [`emit`]).
//! - [`assemble`]: decoded messages → events of committed transactions, in commit order,
//!   each handed out as it arrives, and a `Committed` marker per transaction.
//! - [`budget`]: the bytes of events capture may hold, read ahead and in flight.
//! - `burst`: how the reader cuts the stream into the items the engine claims from.
//! - [`ack`]: which position the slot may be confirmed at, given which events are settled.
//! - [`schema`]: the publication `migrate --capture wal` creates.
//! - [`settings`]: the slot and the publication, as the operator sets them.
//! - [`replication`]: PostgreSQL's streaming replication protocol: the connection (TLS,
//!   authentication), simple queries, and the stream, read through one buffer.
//! - [`client`]: the replication session over it (the slot, START_REPLICATION, status
//!   updates, the drain's end).
//!
//! Events are decoded from the stream itself, never re-read from the table: a row read back
//! when the WAL announces it may not be visible yet, and acknowledging the WAL anyway loses
//! it.

pub mod ack;
pub mod assemble;
pub mod budget;
mod burst;
pub mod capture;
pub mod client;
pub mod decode;
pub mod emit;
pub mod event;
pub mod lsn;
pub mod replication;
pub mod schema;
pub mod settings;
pub mod table;

pub use ack::{AckError, Acknowledgements};
pub use assemble::{AssembleError, Assembler, AssemblerStats, Output};
pub use capture::{
    decoding_problems, forget_adoption, slot_status, verify_capture, CaptureStatus, SlotStatus,
    WalStore, WalStoreOptions,
};
pub use client::{drop_slot, History, SlotState, WalConfig, WalError, WalStream};
pub use decode::{decode, DecodeError, LogicalMessage};
pub use emit::{emit_function, emit_function_ddl, emit_prefix, EMIT_FUNCTION, EMIT_PREFIX};
pub use event::{EventPosition, EventSource, Undecodable, WalEvent};
pub use lsn::Lsn;
pub use schema::publication_ddl;
pub use settings::{WalSettings, DEFAULT_MEMORY_MIB, MAX_MEMORY_MIB};
pub use table::{ColumnNames, SourceTable};
