//! The integration tests of `outbox-store-sqlite`, one module per subject, linked into one test binary
//! (`it`): `cargo nextest run -p outbox-store-sqlite -E 'binary(it) & test(/^MODULE::/)'` runs one module.

mod bad_rows;
mod conformance;
mod permissions;
