//! The integration tests of `outbox-store-postgres`: one module per subject, linked into one test
//! binary (`it`). One module's tests:
//! `cargo nextest run -p outbox-store-postgres -E 'binary(it) & test(/^MODULE::/)'`.

mod bad_rows;
mod cluster;
mod conformance;
mod deployment;
mod long_keys;
mod row_locks;

/// A second session on the test database, as an application would hold one.
async fn session(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
}
