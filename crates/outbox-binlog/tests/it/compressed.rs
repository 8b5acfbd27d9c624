//! MariaDB's compressed binary log (`log_bin_compress`) against the real MariaDB 10.11: the
//! server check names it, and the reader stops at the first compressed event with the fix
//! rather than pass its rows unread. The setting is server-wide, so this test runs alone
//! (`.config/nextest.toml`) and turns it off again whatever happens.

use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Opts};
use outbox_binlog::{
    current_position, database_of, server_problems, BinlogConfig, BinlogError, BinlogReader,
};

/// Turns compression off again when dropped, even if the test fails.
struct Compressed(String);

impl Drop for Compressed {
    fn drop(&mut self) {
        let url = self.0.clone();
        // A fresh runtime: the test's may be gone by now.
        let _ = std::thread::spawn(move || {
            tokio::runtime::Runtime::new().unwrap().block_on(async {
                let mut conn = Conn::new(Opts::from_url(&url).unwrap()).await.unwrap();
                conn.query_drop("SET GLOBAL log_bin_compress = OFF")
                    .await
                    .unwrap();
            })
        })
        .join();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_binary_log_is_named_by_the_check_and_stops_the_reader() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let database = Opts::from_url(&url).unwrap().db_name().unwrap().to_string();
    let mut db = Conn::new(Opts::from_url(&url).unwrap()).await.unwrap();
    db.query_drop(
        "CREATE TABLE outbox (sequence_id bigint unsigned NOT NULL AUTO_INCREMENT PRIMARY KEY,
                              payload text NULL)",
    )
    .await
    .unwrap();
    let start = current_position(&url).await.unwrap();
    let _restore = Compressed(url.clone());
    db.query_drop("SET GLOBAL log_bin_compress = ON")
        .await
        .unwrap();

    let problems = server_problems(&url, &database_of(&url).unwrap())
        .await
        .unwrap();
    assert!(
        problems
            .iter()
            .any(|p| p.what.contains("log_bin_compress") && p.fix.contains("OFF")),
        "{problems:?}"
    );

    // Larger than log_bin_compress_min_len (256 bytes by default): written compressed.
    let payload = "x".repeat(2_000);
    db.exec_drop("INSERT INTO outbox (payload) VALUES (?)", (&payload,))
        .await
        .unwrap();
    let config = BinlogConfig {
        url: url.clone(),
        server_id: crate::server_id(),
        database,
        table: "outbox".into(),
    };
    let mut reader = BinlogReader::start(&config, &start).await.unwrap();
    loop {
        let next = tokio::time::timeout(Duration::from_secs(20), reader.next())
            .await
            .expect("the stream brought nothing for 20 s");
        match next {
            Err(e @ BinlogError::CompressedEvent { .. }) => {
                let message = e.to_string();
                assert!(message.contains("log_bin_compress = OFF"), "{message}");
                break;
            }
            Ok(Some(output)) => assert!(
                !matches!(output, outbox_binlog::Output::Committed { .. }),
                "a compressed transaction was passed over: {output:?}"
            ),
            other => panic!("{other:?}"),
        }
    }
}
