//! The integration tests of `outbox-relay`: one module per subject, linked into one test
//! binary (`it`). One module's tests:
//! `cargo nextest run -p outbox-relay -E 'binary(it) & test(/^MODULE::/)'`.

mod bad_inputs;
mod binlog;
#[cfg(feature = "nats")]
mod brokers;
#[cfg(feature = "nats")]
mod cluster;
mod config_errors;
mod console;
mod deployment;
mod e2e;
mod exposure;
mod faults;
mod file_sink;
mod layouts;
mod observability;
mod operator;
#[cfg(all(feature = "nats", feature = "otel"))]
mod otel;
#[cfg(feature = "nats")]
mod outboxes;
#[cfg(feature = "nats")]
mod packaging;
mod stop;
mod support;
mod upgrade;
mod wal;
