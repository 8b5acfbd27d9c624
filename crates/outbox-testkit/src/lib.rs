//! Test support: databases on the servers `scripts/servers.sh` starts, a scriptable
//! recording publisher, and the conformance suites every store must pass.

pub mod conformance;
pub mod faultproxy;
pub mod publisher;
pub mod recording;
pub mod server;

pub use faultproxy::{Direction, FaultHandle, FaultProxy};

/// Installs the process-wide TLS provider, as the binary does at start-up.
pub fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

use std::time::Duration;

/// The admin URL of the test PostgreSQL server. Tests fail (they do not skip) without it.
pub fn pg_admin_url() -> String {
    std::env::var("OUTBOX_TEST_DATABASE_URL").expect(
        "OUTBOX_TEST_DATABASE_URL is not set: run the tests through scripts/test.sh, \
         or `eval \"$(scripts/servers.sh start)\"` first",
    )
}

/// Creates an empty database with a unique name and returns its URL, so tests never share state.
pub async fn fresh_pg_database() -> String {
    let admin = pg_admin_url();
    let (client, connection) = tokio_postgres::connect(&admin, tokio_postgres::NoTls)
        .await
        .expect("connect to the test PostgreSQL server");
    tokio::spawn(connection);
    let name = format!("t_{}", uuid::Uuid::new_v4().simple());
    client
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .expect("create test database");
    with_database(&admin, &name)
}

/// Creates an empty database with a unique name on the test MariaDB server
/// (`OUTBOX_TEST_MYSQL_URL`) and returns its URL. Tests fail (they do not skip) without it.
pub async fn fresh_mysql_database() -> String {
    use mysql_async::prelude::Queryable;
    let admin = std::env::var("OUTBOX_TEST_MYSQL_URL").expect(
        "OUTBOX_TEST_MYSQL_URL is not set: run the tests through scripts/test.sh, \
         or `eval \"$(scripts/servers.sh start)\"` first",
    );
    let name = format!("t_{}", uuid::Uuid::new_v4().simple());
    let mut conn = mysql_async::Conn::from_url(admin.as_str())
        .await
        .expect("connect to the test MariaDB server");
    conn.query_drop(format!("CREATE DATABASE {name}"))
        .await
        .expect("create test database");
    conn.disconnect().await.expect("disconnect");
    with_database(&admin, &name)
}

/// `url` with its database name replaced.
pub fn with_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let cut = base.rfind('/').expect("URL has a path");
    let mut out = format!("{}/{}", &base[..cut], database);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

/// Polls `check` until it returns `Some`, or panics after `timeout` naming `what`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    eventually_explained(what, timeout, String::new, check).await
}

/// [`eventually`], adding `explain()` (say, a process's log) to the panic on timeout.
pub async fn eventually_explained<T, F, Fut>(
    what: &str,
    timeout: Duration,
    explain: impl Fn() -> String,
    mut check: F,
) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!(
                "timed out after {timeout:?} waiting for {what}\n{}",
                explain()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
