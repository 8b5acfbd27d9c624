//! The integration tests of `outbox-store-sqlite`: one module per subject, linked into one test
//! binary (`it`). One module's tests:
//! `cargo nextest run -p outbox-store-sqlite -E 'binary(it) & test(/^MODULE::/)'`.

mod bad_rows;
mod conformance;
mod permissions;
mod restart;
