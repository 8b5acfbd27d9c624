//! The integration tests of `outbox-wal`: one module per subject, linked into one test
//! binary (`it`). One module's tests:
//! `cargo nextest run -p outbox-wal -E 'binary(it) & test(/^MODULE::/)'`.

mod postgres;
