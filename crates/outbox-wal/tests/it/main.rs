//! The integration tests of `outbox-wal`, one module per subject, linked into one test binary
//! (`it`): `cargo nextest run -p outbox-wal -E 'binary(it) & test(/^MODULE::/)'` runs one module.

mod postgres;
