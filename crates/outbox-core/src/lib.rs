//! Domain core of outbox-relay.
//!
//! This crate holds the vocabulary every other crate shares and performs no I/O:
//! - [`event`]: the event envelope as read from an outbox row, and its ordering key;
//! - [`error`]: typed errors, each classified as retryable or permanent in one place;
//! - [`retry`]: exponential backoff with jitter and the dead-letter decision;
//! - [`store`]: the [`store::OutboxStore`] contract (claim → ack / retry / dead-letter);
//! - [`publisher`]: the [`publisher::Publisher`] contract (a batch in, one outcome per event);
//! - [`ident`]: validated, quoted SQL identifiers for configurable schema and table names;
//! - [`id_hash`]: maps keyed by sequence id, hashed for the per-event paths;
//! - [`memory`]: the byte budget of what a change-stream capture holds;
//! - [`redact`]: secrets out of URLs and the messages that quote them;
//! - [`migration`]: versioned schemas: the steps `migrate` applies and how `run` judges a version;
//! - [`metric_labels`]: metrics recorded by more than one crate, and their label guard;
//! - [`trace`]: W3C trace context in event headers, and the [`trace::Telemetry`] contract.

pub mod capture;
pub mod error;
pub mod event;
pub mod health;
pub mod id_hash;
pub mod ident;
pub mod memory;
pub mod metric_labels;
pub mod migration;
pub mod ownership;
pub mod partition;
pub mod publisher;
pub mod redact;
pub mod retry;
pub mod settings;
pub mod store;
pub mod time;
pub mod trace;

pub use error::{Disposition, PublishError, PublishErrorKind, StoreError, StoreErrorKind};
pub use event::{Event, EventId, Headers, NewEvent, NodeId, Payload, SequenceId};
pub use health::Health;
pub use ownership::Ownership;
pub use partition::{partition_of, Fence};
pub use publisher::{MessagingDestination, Outcome, Publisher};
pub use retry::{Backoff, RetryDecision, RetryPolicy};
pub use store::{Claimed, OutboxStore};
pub use trace::{Telemetry, TraceContext, TraceParent};
