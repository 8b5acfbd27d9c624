//! Test support: databases on the servers `scripts/servers.sh` starts, a scriptable
//! recording publisher, and the conformance suites every store must pass.

pub mod active_relay;
pub mod cloudevents_sdk;
pub mod conformance;
pub mod faultproxy;
pub mod nats;
pub mod otlp;
pub mod publisher;
pub mod recording;
pub mod server;
pub mod slow_webhook;
pub mod snapshot;

pub use faultproxy::{Direction, FaultHandle, FaultProxy};
pub use slow_webhook::SlowWebhook;

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
    // The tests that make the server read-only run alone and set it back; one stopped
    // halfway (a timeout, Ctrl-C) would fail every later test of a server kept running.
    conn.query_drop(format!("SET GLOBAL read_only = 0; CREATE DATABASE {name}"))
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

/// The number a `SELECT count(*) …` (or any one-row, `bigint`-first query) returns. A wait
/// that must ride out a dropped connection takes the error with `.ok()?`; others unwrap it.
pub async fn query_count(
    db: &tokio_postgres::Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<i64, tokio_postgres::Error> {
    Ok(db.query_one(sql, params).await?.get(0))
}

/// Waits until `count_sql` (a `SELECT count(*) …`) counts `want` rows on `db`. A failed
/// query is tried again, as a wait through a fault must; on timeout, the panic shows the
/// last count or error.
pub async fn wait_for_count(
    what: &str,
    db: &tokio_postgres::Client,
    count_sql: &str,
    want: i64,
    timeout: Duration,
) {
    let last = std::sync::Mutex::new(String::from("no answer yet"));
    let last = &last;
    eventually_explained(
        what,
        timeout,
        || format!("the last count: {}", last.lock().unwrap()),
        || async move {
            let counted = query_count(db, count_sql, &[]).await;
            *last.lock().unwrap() = match &counted {
                Ok(n) => n.to_string(),
                Err(e) => format!("failed: {e}"),
            };
            (counted.ok()? == want).then_some(())
        },
    )
    .await
}

/// Ends the replication slot's consumer, if any, and drops the slot; retried while the
/// ended consumer has not released it yet (object_in_use). A slot left behind pins WAL for
/// every test on the server.
pub async fn force_drop_slot(url: &str, slot: &str) -> Result<(), String> {
    let (db, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(connection);
    for _ in 0..200 {
        let result = db
            .execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
                  WHERE slot_name = $1 AND active_pid IS NOT NULL",
                &[&slot],
            )
            .await;
        if let Err(e) = result {
            return Err(e.to_string());
        }
        let result = db
            .execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
                  WHERE slot_name = $1",
                &[&slot],
            )
            .await;
        match result {
            Ok(_) => return Ok(()),
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::OBJECT_IN_USE) => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    Err("the slot stayed active".into())
}

/// Drops its replication slot when dropped, passed or failed ([`force_drop_slot`]).
pub struct SlotGuard {
    pub url: String,
    pub slot: String,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let (url, slot) = (self.url.clone(), self.slot.clone());
        // Drop cannot await, and the test's runtime may be the one this would block: a
        // thread and a runtime of our own.
        let dropped = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?
                .block_on(force_drop_slot(&url, &slot))
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            eprintln!("could not drop slot {}: {dropped:?}", self.slot);
        }
    }
}
