mod capture;
mod compressed;
mod mariadb;
mod seat;
mod store;

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
