mod capture;
mod compressed;
mod mariadb;
mod parked;
mod seat;
mod store;

/// A replica server id of its own for each reader of the shared test server, in this
/// process and in the others nextest runs beside it (two readers with one id end each
/// other's sessions: MariaDB's error 4052).
fn server_id() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    5_000_000 + (std::process::id() % 10_000) * 100 + NEXT.fetch_add(1, Ordering::SeqCst) % 100
}

/// The stream's next output, from `next` (a reader's or a capture's): the 20 s bound is on a
/// hang, not a synchronisation, since every awaited row was committed.
async fn next_output(
    next: impl std::future::Future<
        Output = Result<Option<outbox_binlog::Output>, outbox_binlog::BinlogError>,
    >,
) -> outbox_binlog::Output {
    tokio::time::timeout(std::time::Duration::from_secs(20), next)
        .await
        .expect("the stream brought nothing for 20 s")
        .unwrap()
        .expect("the stream ended")
}
