//! The integration tests of `outbox-store-postgres`: one module per subject, linked into one test
//! binary (`it`). One module's tests:
//! `cargo nextest run -p outbox-store-postgres -E 'binary(it) & test(/^MODULE::/)'`.

mod bad_rows;
mod cluster;
mod conformance;
mod deployment;
mod long_keys;
mod row_locks;
