//! A capture over the real MariaDB 10.11: it resumes where its settled rows allow and no
//! further back, stores its first position before reading (so nothing written after the
//! first start is missed, however soon it stops), and runs once per outbox.

use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Opts};
use outbox_binlog::{positions_ddl, BinlogConfig, Capture, Output, SeatConfig, Started};

const POSITIONS: &str = "outbox_binlog_positions";

struct Outbox {
    url: String,
    db: Conn,
    binlog: BinlogConfig,
}

async fn outbox() -> Outbox {
    let url = outbox_testkit::fresh_mysql_database().await;
    let database = Opts::from_url(&url).unwrap().db_name().unwrap().to_string();
    let mut db = Conn::new(Opts::from_url(&url).unwrap()).await.unwrap();
    db.query_drop(positions_ddl(POSITIONS)).await.unwrap();
    db.query_drop(
        "CREATE TABLE outbox (sequence_id bigint unsigned NOT NULL AUTO_INCREMENT PRIMARY KEY,
                              payload text NULL)",
    )
    .await
    .unwrap();
    let binlog = BinlogConfig {
        url: url.clone(),
        server_id: crate::server_id(),
        database,
        table: "outbox".into(),
    };
    Outbox { url, db, binlog }
}

impl Outbox {
    fn seat(&self, holder: &str) -> SeatConfig {
        SeatConfig {
            url: self.url.clone(),
            positions: POSITIONS.into(),
            outbox: format!("{}.outbox", self.binlog.database),
            holder: holder.into(),
            lease: Duration::from_secs(60),
        }
    }

    async fn start(&self, holder: &str) -> Capture {
        match Capture::start(&self.binlog, &self.seat(holder), &[])
            .await
            .unwrap()
        {
            Started::Active(capture) => *capture,
            Started::Held { holder } => panic!("held by {holder}"),
        }
    }

    /// One transaction inserting `payloads`.
    async fn write(&mut self, payloads: &[&str]) {
        let values = payloads
            .iter()
            .map(|p| format!("('{p}')"))
            .collect::<Vec<_>>()
            .join(", ");
        self.db
            .query_drop(format!("INSERT INTO outbox (payload) VALUES {values}"))
            .await
            .unwrap();
    }
}

/// The payloads and ordinals of the next `transactions` committed transactions.
async fn read(capture: &mut Capture, transactions: usize) -> Vec<Vec<(String, u64)>> {
    let mut read = Vec::new();
    let mut current = Vec::new();
    while read.len() < transactions {
        let output = crate::next_output(capture.next()).await;
        match output {
            Output::Row(row) => {
                current.push((row.get("payload").unwrap().to_string(), row.ordinal()))
            }
            Output::Committed { .. } => read.push(std::mem::take(&mut current)),
            Output::RolledBack { .. } => current.clear(),
        }
    }
    read
}

fn payloads(read: &[Vec<(String, u64)>]) -> Vec<Vec<&str>> {
    read.iter()
        .map(|t| t.iter().map(|(p, _)| p.as_str()).collect())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capture_resumes_after_what_was_settled_and_not_beyond() {
    let mut outbox = outbox().await;
    let mut first = outbox.start("relay-1").await;
    outbox.write(&["a1", "a2"]).await;
    outbox.write(&["b1"]).await;
    let first_read = read(&mut first, 2).await;
    assert_eq!(payloads(&first_read), [vec!["a1", "a2"], vec!["b1"]]);
    // The first transaction settles in reverse; the second is left unsettled.
    for (_, ordinal) in first_read[0].iter().rev() {
        first.settle(*ordinal).unwrap();
    }
    first.leave().await.unwrap();

    let mut second = outbox.start("relay-2").await;
    assert_eq!(
        payloads(&read(&mut second, 1).await),
        [vec!["b1"]],
        "the unsettled transaction comes again, the settled one does not"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_is_written_after_the_first_start_is_read_however_soon_that_capture_stops() {
    let mut outbox = outbox().await;
    // The first capture starts (at the server's current position) and stops at once,
    // having read nothing.
    let first = outbox.start("relay-1").await;
    first.leave().await.unwrap();
    outbox.write(&["written after the first start"]).await;
    let mut second = outbox.start("relay-2").await;
    assert_eq!(
        payloads(&read(&mut second, 1).await),
        [vec!["written after the first start"]]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_capture_per_outbox_the_others_wait() {
    let outbox = outbox().await;
    let _active = outbox.start("relay-1").await;
    match Capture::start(&outbox.binlog, &outbox.seat("relay-2"), &[])
        .await
        .unwrap()
    {
        Started::Held { holder } => assert_eq!(holder, "relay-1"),
        Started::Active(_) => panic!("two active captures"),
    }
}

/// A relay behind a slow sink stops asking for the log's events (its channel or memory
/// budget full) for longer than the silence that takes a connection for dead
/// (`BINLOG_SILENCE`, 10 s). The silence counted from the last event heard, so when the
/// next event asked for after the pause was larger than the socket's buffers (not all there
/// at once), the session failed as silent: a reconnection, and everything read again, after
/// nearly every large event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_of_the_relays_own_is_no_silence_of_the_server() {
    let mut outbox = outbox().await;
    outbox
        .db
        .query_drop("ALTER TABLE outbox MODIFY payload longtext NULL")
        .await
        .unwrap();
    let mut capture = outbox.start("relay-1").await;
    // One transaction: a small row, then one of 15 MiB (under the server's 16 MiB
    // max_allowed_packet), more than the loopback socket's buffers hold, in an event of its
    // own right after the small row's.
    outbox
        .db
        .query_drop(
            "INSERT INTO outbox (payload) VALUES ('small'), (REPEAT('x', 15 * 1024 * 1024))",
        )
        .await
        .unwrap();
    match crate::next_output(capture.next()).await {
        Output::Row(row) => assert_eq!(row.get("payload").unwrap(), "small"),
        other => panic!("the small row, not {other:?}"),
    }
    // The pause itself is what is tested: no condition to await.
    tokio::time::sleep(outbox_binlog::BINLOG_SILENCE + Duration::from_secs(2)).await;
    let large = tokio::time::timeout(Duration::from_secs(30), capture.next())
        .await
        .expect("the stream brought nothing for 30 s");
    match large {
        Ok(Some(Output::Row(row))) => {
            assert_eq!(row.get("payload").unwrap().len(), 15 * 1024 * 1024)
        }
        other => panic!("the large row, not {other:?}"),
    }
}
