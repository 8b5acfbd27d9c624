//! The integration tests of `outbox-store-mysql`: one module per subject, linked into one test
//! binary (`it`). One module's tests:
//! `cargo nextest run -p outbox-store-mysql -E 'binary(it) & test(/^MODULE::/)'`.

mod active_relay;
mod conformance;
mod deployment;
mod session;
