//! The integration tests of `outbox-store-mysql`, one module per subject, linked into one test binary
//! (`it`): `cargo nextest run -p outbox-store-mysql -E 'binary(it) & test(/^MODULE::/)'` runs one module.

mod conformance;
