//! The active reader's seat against the real MariaDB 10.11: one reader at a time, its
//! position kept across readers, a paused reader's lapsed lease taken over (its connection
//! ended, which frees its lock), and a late write of an ex-reader refused by the epoch.

use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Opts};
use outbox_binlog::{positions_ddl, ActiveReader, BinlogError, BinlogPosition, SeatConfig, Taken};

const POSITIONS: &str = "outbox_binlog_positions";

async fn connect(url: &str) -> Conn {
    Conn::new(Opts::from_url(url).unwrap()).await.unwrap()
}

/// A fresh database with the positions table, and an admin connection to it.
async fn database() -> (String, Conn) {
    let url = outbox_testkit::fresh_mysql_database().await;
    let mut admin = connect(&url).await;
    admin.query_drop(positions_ddl(POSITIONS)).await.unwrap();
    (url, admin)
}

fn seat(url: &str, holder: &str, lease: Duration) -> SeatConfig {
    let database = Opts::from_url(url).unwrap().db_name().unwrap().to_string();
    SeatConfig {
        url: url.into(),
        positions: POSITIONS.into(),
        outbox: format!("{database}.outbox"),
        holder: holder.into(),
        lease,
    }
}

async fn take(config: &SeatConfig) -> Taken {
    ActiveReader::take(config).await.unwrap()
}

fn active(taken: Taken) -> ActiveReader {
    match taken {
        Taken::Active(reader) => reader,
        Taken::Held { holder } => panic!("the seat is held by {holder}"),
    }
}

fn position(file: &str, offset: u64) -> BinlogPosition {
    BinlogPosition {
        file: file.into(),
        offset,
        gtid: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_reader_holds_the_seat_and_the_next_starts_where_it_stored() {
    let (url, _admin) = database().await;
    let long = Duration::from_secs(60);
    let mut first = active(take(&seat(&url, "relay-1", long)).await);
    assert_eq!(
        first.stored(),
        None,
        "never stored: start from the current position"
    );
    first
        .store(&position("mariadb-bin.000007", 4242))
        .await
        .unwrap();

    match take(&seat(&url, "relay-2", long)).await {
        Taken::Held { holder } => assert_eq!(holder, "relay-1"),
        Taken::Active(_) => panic!("two active readers"),
    }

    // The first leaves (or exits): the lock goes with its connection.
    let epoch = first.epoch();
    first.leave().await.unwrap();
    let second = active(take(&seat(&url, "relay-2", long)).await);
    assert_eq!(second.stored(), Some(&position("mariadb-bin.000007", 4242)));
    assert_eq!(second.epoch(), epoch + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_readers_lapsed_lease_is_taken_over_and_its_late_writes_are_refused() {
    let (url, mut admin) = database().await;
    // The paused reader: it holds the lock on a live connection but writes nothing.
    let mut paused = active(take(&seat(&url, "paused", Duration::from_millis(300))).await);
    paused
        .store(&position("mariadb-bin.000001", 100))
        .await
        .unwrap();
    // Its lease lapses (awaited on the server's clock, which decides it).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let lapsed: Option<i64> = admin
            .query_first(format!(
                "SELECT lease_until < UTC_TIMESTAMP(6) FROM {POSITIONS} WHERE holder = 'paused'"
            ))
            .await
            .unwrap();
        if lapsed == Some(1) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the lease never lapsed"
        );
        tokio::task::yield_now().await;
    }

    let mut taker = active(take(&seat(&url, "taker", Duration::from_secs(60))).await);
    assert_eq!(taker.stored(), Some(&position("mariadb-bin.000001", 100)));

    // The paused reader wakes and writes: refused, its connection was ended.
    let late = paused.store(&position("mariadb-bin.000001", 999)).await;
    assert!(late.is_err(), "a late write went through");
    taker
        .store(&position("mariadb-bin.000002", 4))
        .await
        .unwrap();
    let stored: Option<(String, u64)> = admin
        .query_first(format!("SELECT log_file, log_offset FROM {POSITIONS}"))
        .await
        .unwrap();
    assert_eq!(stored, Some(("mariadb-bin.000002".to_string(), 4)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_at_an_old_epoch_is_fenced_even_on_a_live_connection() {
    let (url, mut admin) = database().await;
    let mut reader = active(take(&seat(&url, "relay-1", Duration::from_secs(60))).await);
    reader
        .store(&position("mariadb-bin.000003", 10))
        .await
        .unwrap();
    reader.renew().await.unwrap();
    // Another reader's takeover as the table records it (its connection is not needed).
    admin
        .query_drop(format!("UPDATE {POSITIONS} SET epoch = epoch + 1"))
        .await
        .unwrap();
    match reader.store(&position("mariadb-bin.000003", 20)).await {
        Err(BinlogError::Fenced { epoch, .. }) => assert_eq!(epoch, reader.epoch()),
        other => panic!("not fenced: {other:?}"),
    }
    assert!(matches!(
        reader.renew().await,
        Err(BinlogError::Fenced { .. })
    ));
}

/// A positions table made before the GTID columns: taking the seat says to run `migrate`;
/// `upgrade_positions` (which `migrate` runs) adds the columns, keeps the stored position,
/// and does nothing the second time; the next store records the server and the GTID state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_positions_table_from_before_gtids_is_upgraded_in_place() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let mut admin = connect(&url).await;
    let old = positions_ddl(POSITIONS).replace(
        ",\n    server_id     bigint unsigned NULL,\n    gtid          text NULL",
        "",
    );
    assert!(!old.contains("gtid"), "{old}");
    admin.query_drop(old).await.unwrap();
    let config = seat(&url, "relay-1", Duration::from_secs(60));
    let database = Opts::from_url(&url).unwrap().db_name().unwrap().to_string();
    admin
        .exec_drop(
            format!("INSERT INTO {POSITIONS} (outbox, log_file, log_offset) VALUES (?, 'mariadb-bin.000001', 77)"),
            (&config.outbox,),
        )
        .await
        .unwrap();
    match ActiveReader::take(&config).await {
        Err(BinlogError::Config(said)) => assert!(said.contains("migrate"), "{said}"),
        other => panic!("not refused: {other:?}"),
    }
    for _ in 0..2 {
        outbox_binlog::upgrade_positions(&url, &format!("{database}.{POSITIONS}"))
            .await
            .unwrap();
    }
    let mut reader = active(take(&config).await);
    assert_eq!(reader.stored(), Some(&position("mariadb-bin.000001", 77)));
    assert_eq!(reader.stored_server_id(), None, "stored before it was kept");
    let at = BinlogPosition {
        gtid: Some("0-1-5".into()),
        ..position("mariadb-bin.000001", 99)
    };
    reader.store(&at).await.unwrap();
    let stored = outbox_binlog::stored_position(&url, POSITIONS, &config.outbox)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stored.position, at);
    assert_eq!(stored.server_id, Some(reader.server_id()));
}

/// An adoption that outlasts the lease (here: it waits on a writer's open transaction for
/// three leases) keeps the seat: a second connection renews the lease meanwhile, so the
/// standby trying all along never takes over (which would end the adoption's connection,
/// and the next reader's adoption the same way), and the adoption then completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adoption_longer_than_the_lease_keeps_the_seat() {
    let (url, mut admin) = database().await;
    admin
        .query_drop("CREATE TABLE outbox (id bigint PRIMARY KEY)")
        .await
        .unwrap();
    let lease = Duration::from_secs(1);
    let mut reader = active(take(&seat(&url, "relay-1", lease)).await);
    // A writer's open transaction holds a row the adoption must lock.
    let mut writer = connect(&url).await;
    writer
        .query_drop("START TRANSACTION; INSERT INTO outbox VALUES (1)")
        .await
        .unwrap();
    let adoption = vec!["SELECT id FROM outbox FOR UPDATE".to_string()];
    let first = position("mariadb-bin.000001", 4);
    let adopting = reader.store_first(&first, &adoption);
    let standby = async {
        let until = std::time::Instant::now() + 3 * lease;
        while std::time::Instant::now() < until {
            match take(&seat(&url, "relay-2", lease)).await {
                Taken::Held { holder } => assert_eq!(holder, "relay-1"),
                Taken::Active(_) => panic!("the standby took the seat from a live adoption"),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        writer.query_drop("COMMIT").await.unwrap();
    };
    let (adopted, ()) = tokio::join!(adopting, standby);
    adopted.unwrap();
    assert_eq!(reader.stored(), Some(&first));
}
