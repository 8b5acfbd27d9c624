//! The binlog stream against the real MariaDB 10.11 (`scripts/servers.sh` starts it with a
//! row-based binary log): commit order, rollbacks, other tables and statements passed by,
//! a rotated log followed, and a reader resumed from a position the stream gave.

use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Opts};
use outbox_binlog::{
    binary_logs, blackhole_ddl, blackhole_problem, current_position, database_of, oldest_log,
    retention_problem, server_problems, BinlogConfig, BinlogError, BinlogPosition, BinlogReader,
    Output,
};

async fn connect(url: &str) -> Conn {
    Conn::new(Opts::from_url(url).unwrap()).await.unwrap()
}

/// Outputs until `rows` committed rows arrived: each row's `sequence_id` and key, per
/// transaction.
async fn transactions(
    reader: &mut BinlogReader,
    rows: usize,
) -> Vec<(Vec<(String, String)>, Output)> {
    let mut transactions = Vec::new();
    let mut current = Vec::new();
    let mut seen = 0;
    while seen < rows {
        let output = crate::next_output(reader.next()).await;
        match &output {
            Output::Row(row) => {
                seen += 1;
                current.push((
                    row.get("sequence_id").unwrap().to_string(),
                    row.get("partition_key").unwrap().to_string(),
                ));
            }
            Output::Committed { .. } => transactions.push((std::mem::take(&mut current), output)),
            Output::RolledBack { .. } => panic!("no transaction of these tests rolls back"),
        }
    }
    if !current.is_empty() {
        // The last transaction's commit follows its rows.
        let commit = reader.next().await.unwrap().unwrap();
        transactions.push((current, commit));
    }
    transactions
}

fn ids(transactions: &[(Vec<(String, String)>, Output)]) -> Vec<Vec<String>> {
    transactions
        .iter()
        .map(|(rows, _)| rows.iter().map(|(id, _)| id.clone()).collect())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_inserts_arrive_in_commit_order_and_nothing_else_does() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let database = Opts::from_url(&url).unwrap().db_name().unwrap().to_string();
    let mut setup = connect(&url).await;
    setup
        .query_drop(
            "CREATE TABLE outbox (
                sequence_id bigint unsigned NOT NULL AUTO_INCREMENT PRIMARY KEY,
                partition_key varchar(255) NULL,
                payload json NULL,
                created_at datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6));
             CREATE TABLE other (id int PRIMARY KEY);
             CREATE TABLE plain (id int PRIMARY KEY) ENGINE=MyISAM",
        )
        .await
        .unwrap();
    let start = current_position(&url).await.unwrap();
    let config = BinlogConfig {
        url: url.clone(),
        server_id: 1000 + fastrand_id(),
        database,
        table: "outbox".into(),
    };
    let mut reader = BinlogReader::start(&config, &start).await.unwrap();

    // Two writers on key `a`: the first inserts first and commits last.
    let (mut first, mut second) = (connect(&url).await, connect(&url).await);
    first.query_drop("BEGIN").await.unwrap();
    first
        .query_drop("INSERT INTO outbox (partition_key, payload) VALUES ('a', '{\"n\": 1}')")
        .await
        .unwrap();
    second.query_drop("BEGIN").await.unwrap();
    second
        .query_drop("INSERT INTO outbox (partition_key, payload) VALUES ('a', '{\"n\": 2}')")
        .await
        .unwrap();
    second.query_drop("COMMIT").await.unwrap();
    first.query_drop("COMMIT").await.unwrap();
    // Rolled back, another table, an update and a delete: none is an event.
    first.query_drop("BEGIN").await.unwrap();
    first
        .query_drop("INSERT INTO outbox (partition_key) VALUES ('rolled back')")
        .await
        .unwrap();
    first.query_drop("ROLLBACK").await.unwrap();
    // Rolled back after writing a table that cannot roll back too: MariaDB logs that
    // table's change as a transaction of its own, without the outbox row (id 4).
    first.query_drop("BEGIN").await.unwrap();
    first
        .query_drop("INSERT INTO outbox (partition_key) VALUES ('mixed, rolled back')")
        .await
        .unwrap();
    first
        .query_drop("INSERT INTO plain VALUES (1)")
        .await
        .unwrap();
    first.query_drop("ROLLBACK").await.unwrap();
    first
        .query_drop("INSERT INTO other VALUES (1)")
        .await
        .unwrap();
    first
        .query_drop("UPDATE outbox SET payload = NULL WHERE sequence_id = 1")
        .await
        .unwrap();
    first
        .query_drop("DELETE FROM outbox WHERE sequence_id = 2")
        .await
        .unwrap();
    // Two rows in one transaction, then the log rotates, then one more.
    first
        .query_drop("INSERT INTO outbox (partition_key) VALUES ('b'), ('c')")
        .await
        .unwrap();
    first.query_drop("FLUSH BINARY LOGS").await.unwrap();
    first
        .query_drop("INSERT INTO outbox (partition_key) VALUES ('d')")
        .await
        .unwrap();

    let seen = transactions(&mut reader, 5).await;
    assert_eq!(
        ids(&seen),
        [vec!["2"], vec!["1"], vec!["5", "6"], vec!["7"]],
        "commit order, whole transactions; the rolled-back ids 3 and 4 are not there"
    );
    let keys: Vec<&str> = seen[1].0.iter().map(|(_, key)| key.as_str()).collect();
    assert_eq!(keys, ["a"]);
    let Output::Committed {
        next: before_rotation,
        rows,
        gtid: third,
    } = &seen[2].1
    else {
        unreachable!()
    };
    assert_eq!(*rows, 2);
    let Output::Committed {
        next: after_rotation,
        gtid: fourth,
        ..
    } = &seen[3].1
    else {
        unreachable!()
    };
    // MariaDB's GTIDs (domain-server-sequence): the server's, in commit order.
    let sequence = |gtid: &Option<String>| -> u64 {
        let gtid = gtid
            .as_deref()
            .expect("MariaDB gives every transaction a GTID");
        let parts: Vec<&str> = gtid.split('-').collect();
        assert_eq!(parts[..2], ["0", "1"], "domain 0, server_id 1: {gtid}");
        parts[2].parse().unwrap()
    };
    assert!(sequence(third) < sequence(fourth));
    assert_ne!(
        before_rotation.file, after_rotation.file,
        "the rotated log is followed"
    );

    // A reader resumed where the stream said the third transaction ended reads from there.
    // Each reader is a replica of its own (the server ends an older replica's session when
    // another registers with the same server_id), and the one before it is gone.
    drop(reader);
    let replica = |n: u32| BinlogConfig {
        server_id: config.server_id + n,
        ..config.clone()
    };
    let mut resumed = BinlogReader::start(&replica(1), before_rotation)
        .await
        .unwrap();
    let by_position = transactions(&mut resumed, 1).await;
    assert_eq!(ids(&by_position), [vec!["7"]]);
    drop(resumed);

    // So does one started after the third transaction's GTID (how a relay goes on at a
    // promoted replica), naming the same file and offsets.
    let mut by_gtid = BinlogReader::start_after_gtid(&replica(2), third.as_deref().unwrap())
        .await
        .unwrap();
    let by_gtid = transactions(&mut by_gtid, 1).await;
    assert_eq!(ids(&by_gtid), [vec!["7"]]);
    let ends = |t: &[(Vec<(String, String)>, Output)]| match &t[0].1 {
        Output::Committed { next, gtid, .. } => (next.clone(), gtid.clone()),
        other => panic!("{other:?}"),
    };
    assert_eq!(ends(&by_gtid), ends(&by_position));
    assert_eq!(ends(&by_gtid).0, after_rotation.clone());

    // A GTID this server's log does not hold (another server's, as after a failover to a
    // server whose history diverged) is refused, not read past. (One ahead of the log is
    // not always refused at once: MariaDB may wait for it.)
    let diverged = format!("0-99-{}", sequence(fourth));
    let mut refused = BinlogReader::start_after_gtid(&replica(3), &diverged)
        .await
        .unwrap();
    match tokio::time::timeout(Duration::from_secs(20), refused.next())
        .await
        .expect("no answer for 20 s")
    {
        Err(BinlogError::GtidNotInLog { gtid, .. }) => assert_eq!(gtid, diverged),
        other => panic!("not refused: {other:?}"),
    }
}

/// A transaction that changed a table that cannot roll back (MyISAM) is logged with its
/// `ROLLBACK TO SAVEPOINT` as a query after the outbox row it undid: the row went out, an
/// event of a change that never happened. (An ORM's nested atomic block that fails is such
/// a rollback.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_row_undone_by_a_rollback_to_a_savepoint_is_not_relayed() {
    let (_url, mut db, mut reader) = reading_from_now(
        "CREATE TABLE outbox (sequence_id bigint PRIMARY KEY AUTO_INCREMENT, partition_key text);
         CREATE TABLE plain (id int) ENGINE=MyISAM",
        6000,
    )
    .await;
    db.query_drop(
        "BEGIN;
         INSERT INTO plain VALUES (1);
         INSERT INTO outbox (partition_key) VALUES ('before');
         SAVEPOINT s;
         INSERT INTO outbox (partition_key) VALUES ('undone');
         ROLLBACK TO SAVEPOINT s;
         INSERT INTO outbox (partition_key) VALUES ('after');
         COMMIT;
         INSERT INTO outbox (partition_key) VALUES ('next');
         FLUSH TABLES outbox;
         BEGIN;
         INSERT INTO plain VALUES (2);
         SAVEPOINT s;
         INSERT INTO outbox (partition_key) VALUES ('undone after a reopen');
         ROLLBACK TO SAVEPOINT s;
         INSERT INTO outbox (partition_key) VALUES ('after a reopen');
         COMMIT;",
    )
    .await
    .unwrap();
    let seen = transactions(&mut reader, 4).await;
    let keys: Vec<Vec<&str>> = (seen.iter())
        .map(|(rows, _)| rows.iter().map(|(_, key)| key.as_str()).collect())
        .collect();
    // The last transaction's first row event names the table by a new id (FLUSH TABLES
    // opened it again), which has the reader describe the table before reading it: its rows
    // wait for the transaction's end all the same.
    assert_eq!(
        keys,
        [
            vec!["before", "after"],
            vec!["next"],
            vec!["after a reopen"]
        ]
    );
}

/// A server id of its own for each run: two readers with the same id make the server drop
/// the first.
fn fastrand_id() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
        % 1_000_000
}

/// The test server has everything binlog capture needs; a role without the replication
/// privileges is told which grants it lacks, and how to give them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_servers_settings_and_the_roles_privileges_are_checked_by_name() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let problems = server_problems(&url, &database_of(&url).unwrap())
        .await
        .unwrap();
    // The test server logs no column names (binlog_row_metadata = NO_LOG): said, as
    // advice, since a swap of two columns of one type would then go unseen. It writes its
    // log and tables without syncing each commit, for speed: said too, since a crash of its
    // host could undo transactions whose events went out.
    let (advice, problems): (Vec<_>, Vec<_>) = problems.into_iter().partition(|p| !p.fails_check());
    assert!(problems.is_empty(), "{problems:?}");
    let advised = |variable: &str| advice.iter().any(|p| p.what.starts_with(variable));
    assert!(
        advised("binlog_row_metadata")
            && advised("sync_binlog is 0")
            && advised("innodb_flush_log_at_trx_commit is 0"),
        "{advice:?}"
    );
    assert_eq!(advice.len(), 3, "{advice:?}");
    let mut admin = connect(&url).await;
    admin
        .query_drop(
            "CREATE USER IF NOT EXISTS 'outbox_binlog_plain'@'127.0.0.1' IDENTIFIED BY 'p';
             GRANT SELECT ON *.* TO 'outbox_binlog_plain'@'127.0.0.1'",
        )
        .await
        .unwrap();
    let opts = Opts::from_url(&url).unwrap();
    let plain = format!(
        "mysql://outbox_binlog_plain:p@{}:{}/{}",
        opts.ip_or_hostname(),
        opts.tcp_port(),
        opts.db_name().unwrap()
    );
    let problems = server_problems(&plain, &database_of(&plain).unwrap())
        .await
        .unwrap();
    let said: Vec<String> = problems
        .iter()
        .filter(|p| p.fails_check())
        .map(|p| format!("{} (fix: {})", p.what, p.fix))
        .collect();
    assert_eq!(said.len(), 2, "{said:?}");
    assert!(said[0].contains("REPLICATION SLAVE") && said[0].contains("GRANT REPLICATION SLAVE"));
    assert!(said[1].contains("REPLICATION CLIENT"), "{said:?}");
}

/// Replication privileges granted through a role count while the role is in use at login
/// (a default role); a role granted but not in use gives none, and the fix says how to put
/// it in use. (MySQL 8 lists a role's privileges only when asked `USING` it: unit-tested,
/// no MySQL server here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replication_privileges_through_a_role_count_while_the_role_is_in_use() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let opts = Opts::from_url(&url).unwrap();
    let suffix = fastrand_id();
    let (user, role) = (
        format!("outbox_rr_{suffix}"),
        format!("outbox_rrole_{suffix}"),
    );
    let mut admin = connect(&url).await;
    admin
        .query_drop(format!(
            "CREATE ROLE {role};
             GRANT REPLICATION SLAVE, BINLOG MONITOR ON *.* TO {role};
             CREATE USER '{user}'@'127.0.0.1' IDENTIFIED BY 'p';
             GRANT SELECT ON *.* TO '{user}'@'127.0.0.1';
             GRANT {role} TO '{user}'@'127.0.0.1';"
        ))
        .await
        .unwrap();
    let as_user = format!(
        "mysql://{user}:p@{}:{}/{}",
        opts.ip_or_hostname(),
        opts.tcp_port(),
        opts.db_name().unwrap()
    );
    let blocking = || async {
        let problems = server_problems(&as_user, &database_of(&as_user).unwrap())
            .await
            .unwrap();
        problems
            .into_iter()
            .filter(|p| p.fails_check())
            .map(|p| format!("{} (fix: {})", p.what, p.fix))
            .collect::<Vec<String>>()
    };
    let not_in_use = blocking().await;
    assert_eq!(not_in_use.len(), 2, "{not_in_use:?}");
    assert!(not_in_use[0].contains("SET DEFAULT ROLE"), "{not_in_use:?}");
    admin
        .query_drop(format!("SET DEFAULT ROLE {role} FOR '{user}'@'127.0.0.1'"))
        .await
        .unwrap();
    let in_use = blocking().await;
    assert!(in_use.is_empty(), "{in_use:?}");
    admin
        .query_drop(format!("DROP USER '{user}'@'127.0.0.1'; DROP ROLE {role}"))
        .await
        .unwrap();
}

/// The table-less form: rows inserted into a BLACKHOLE table are in the binary log, in
/// commit order, and nowhere else. A server without the engine is told how to get it (the
/// test server has it as a plugin, installed here once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackhole_outbox_stores_nothing_and_its_rows_are_read_from_the_log() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let database = Opts::from_url(&url).unwrap().db_name().unwrap().to_string();
    let mut db = connect(&url).await;
    if let Some(problem) = blackhole_problem(&url).await.unwrap() {
        assert!(
            problem.fix.contains("INSTALL SONAME 'ha_blackhole'"),
            "{problem:?}"
        );
        // Two tests could race to install it: the second one's error is harmless.
        let _ = db.query_drop("INSTALL SONAME 'ha_blackhole'").await;
    }
    assert!(blackhole_problem(&url).await.unwrap().is_none());
    db.query_drop(blackhole_ddl("outbox_events_log"))
        .await
        .unwrap();
    let start = current_position(&url).await.unwrap();
    let config = BinlogConfig {
        url: url.clone(),
        server_id: 2_000_000 + fastrand_id(),
        database,
        table: "outbox_events_log".into(),
    };
    let mut reader = BinlogReader::start(&config, &start).await.unwrap();
    db.query_drop(
        "INSERT INTO outbox_events_log (destination, partition_key, event_type, payload)
         VALUES ('orders', 'k', 'Placed', '{\"n\": 1}'), ('orders', 'k', 'Paid', '{\"n\": 2}')",
    )
    .await
    .unwrap();
    db.query_drop(
        "INSERT INTO outbox_events_log (destination, event_type) VALUES ('orders', 'Shipped')",
    )
    .await
    .unwrap();
    // Rows of a non-transactional table end with a COMMIT query, not an XID: each
    // transaction must still close with the position to store.
    let mut seen = Vec::new();
    let mut commits = Vec::new();
    while commits.len() < 2 {
        let output = crate::next_output(reader.next()).await;
        match output {
            Output::Row(row) => {
                assert_eq!(row.get("event_id").map(str::len), Some(36), "a UUID");
                seen.push((
                    row.get("event_type").unwrap().to_string(),
                    row.get("payload").map(str::to_string),
                ));
            }
            Output::Committed { rows, next, .. } => commits.push((rows, next)),
            Output::RolledBack { .. } => panic!("nothing was rolled back"),
        }
    }
    assert_eq!(
        commits.iter().map(|(rows, _)| *rows).collect::<Vec<_>>(),
        [2, 1]
    );
    assert!(commits[0].1.offset < commits[1].1.offset);

    // A BLACKHOLE row written in a transaction that rolls back: MariaDB 10.11 leaves it
    // out of the log. (MySQL logs what it could not undo, closed by ROLLBACK: the reader
    // then says `RolledBack`, and its rows never happened.)
    db.query_drop("CREATE TABLE orders (id int PRIMARY KEY) ENGINE=InnoDB")
        .await
        .unwrap();
    db.query_drop("BEGIN").await.unwrap();
    db.query_drop("INSERT INTO orders VALUES (1)")
        .await
        .unwrap();
    db.query_drop(
        "INSERT INTO outbox_events_log (destination, event_type) VALUES ('orders', 'Undone')",
    )
    .await
    .unwrap();
    db.query_drop("ROLLBACK").await.unwrap();
    db.query_drop(
        "INSERT INTO outbox_events_log (destination, event_type) VALUES ('orders', 'After')",
    )
    .await
    .unwrap();
    let mut read = Vec::new();
    while !read.iter().any(|r: &String| r.starts_with("committed")) {
        let output = crate::next_output(reader.next()).await;
        read.push(match output {
            Output::Row(row) => format!("row {}", row.get("event_type").unwrap()),
            Output::Committed { rows, .. } => format!("committed {rows}"),
            Output::RolledBack { rows, .. } => format!("rolled back {rows}"),
        });
    }
    assert_eq!(read, ["row After", "committed 1"]);
    assert_eq!(
        seen,
        [
            ("Placed".to_string(), Some("{\"n\": 1}".to_string())),
            ("Paid".to_string(), Some("{\"n\": 2}".to_string())),
            ("Shipped".to_string(), None),
        ]
    );
    let stored: Option<i64> = db
        .query_first("SELECT count(*) FROM outbox_events_log")
        .await
        .unwrap();
    assert_eq!(stored, Some(0), "the table stores nothing");
}

/// A 100,000-row transaction streams through a reader that holds one row event's rows at a
/// time, not the transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100_000_row_transaction_is_streamed_without_holding_it() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let database = Opts::from_url(&url).unwrap().db_name().unwrap().to_string();
    let mut db = connect(&url).await;
    db.query_drop(
        "CREATE TABLE outbox (
            sequence_id bigint unsigned NOT NULL AUTO_INCREMENT PRIMARY KEY,
            partition_key varchar(255) NULL,
            payload json NULL)",
    )
    .await
    .unwrap();
    let start = current_position(&url).await.unwrap();
    let config = BinlogConfig {
        url: url.clone(),
        server_id: 3_000_000 + fastrand_id(),
        database,
        table: "outbox".into(),
    };
    let mut reader = BinlogReader::start(&config, &start).await.unwrap();
    // MariaDB bounds a recursive query at 1,000 iterations unless the session raises it.
    db.query_drop("SET SESSION max_recursive_iterations = 200000")
        .await
        .unwrap();
    db.query_drop(
        "INSERT INTO outbox (partition_key, payload)
         WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 100000)
         SELECT concat('k', i % 100), json_object('i', i) FROM n",
    )
    .await
    .unwrap();
    let (mut rows, mut most_buffered, mut last_id) = (0u64, 0usize, 0u64);
    loop {
        let output = tokio::time::timeout(Duration::from_secs(60), reader.next())
            .await
            .expect("the stream brought nothing for 60 s")
            .unwrap()
            .expect("the stream ended");
        most_buffered = most_buffered.max(reader.buffered_rows());
        match output {
            Output::Row(row) => {
                let id: u64 = row.get("sequence_id").unwrap().parse().unwrap();
                assert!(id > last_id, "in order");
                last_id = id;
                rows += 1;
            }
            Output::Committed {
                rows: committed, ..
            } => {
                assert_eq!(committed, 100_000);
                break;
            }
            Output::RolledBack { .. } => panic!("the transaction committed"),
        }
    }
    assert_eq!(rows, 100_000);
    assert!(most_buffered < 1_000, "{most_buffered} rows held at once");
}

/// A position whose log the server no longer has is refused with the reason, never skipped:
/// here a file before the server's first (purging the shared test server's logs would pull
/// them from under other tests; the server's answer is the same). Today's oldest log is no
/// problem for a position after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_position_in_a_purged_log_is_refused_and_never_skipped() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let database = Opts::from_url(&url).unwrap().db_name().unwrap().to_string();
    let oldest = oldest_log(&url).await.unwrap();
    let (base, _) = oldest.rsplit_once('.').unwrap();
    let gone = BinlogPosition {
        file: format!("{base}.000000"),
        offset: 4,
        gtid: None,
    };
    let logs = binary_logs(&url).await.unwrap();
    let problem = retention_problem(&gone, &logs, false).expect("before the oldest log");
    assert!(problem.what.contains("purged"), "{problem:?}");
    let current = current_position(&url).await.unwrap();
    // Unless the log was rotated meanwhile from the only one (the server is shared).
    let logs = binary_logs(&url).await.unwrap();
    if logs.len() == 1 || current.file != logs[0].0 {
        assert!(retention_problem(&current, &logs, false).is_none());
    }
    let config = BinlogConfig {
        url: url.clone(),
        server_id: 4_000_000 + fastrand_id(),
        database,
        table: "outbox".into(),
    };
    let mut db = connect(&url).await;
    db.query_drop("CREATE TABLE outbox (sequence_id bigint PRIMARY KEY)")
        .await
        .unwrap();
    let mut reader = BinlogReader::start(&config, &gone).await.unwrap();
    match tokio::time::timeout(Duration::from_secs(20), reader.next())
        .await
        .unwrap()
    {
        Err(e @ BinlogError::Purged { .. }) => {
            let said = e.to_string();
            assert!(
                said.contains(&gone.file) && said.contains("never skips"),
                "{said}"
            );
        }
        other => panic!("a purged position was read from: {other:?}"),
    }
}

/// Binlog capture adopts a mapped table's rows with the event ids polling derives for them
/// (`derived_event_id`, a version 5 UUID): computed by MariaDB from the SQL the layout
/// renders, for a table with and without a schema, and ids small and large.
#[tokio::test]
async fn the_sql_event_id_of_a_row_is_the_one_polling_derives() {
    use outbox_layout::sql::Sql;
    use outbox_layout::{Dialect, Mapping};
    let url = outbox_testkit::fresh_mysql_database().await;
    let mut conn = connect(&url).await;
    for mapping in [
        Mapping::mysql_outbox_events(None, "outbox_events"),
        Mapping::mysql_outbox_events(Some("shop"), "outbox_events"),
    ] {
        let expr = Sql::new(mapping.clone(), Dialect::MySql)
            .unwrap()
            .event_id_expr();
        for id in [1i64, 42, 9_007_199_254_740_993, i64::MAX] {
            let got: String = conn
                .exec_first(format!("SELECT {expr} FROM (SELECT ? AS id) o"), (id,))
                .await
                .unwrap()
                .unwrap();
            let want = outbox_layout::memory::derived_event_id(&mapping, &id.to_string());
            assert_eq!(got, want.to_string(), "{:?} row {id}", mapping.schema);
        }
    }
}

/// An outbox of two columns, and another table.
const OUTBOX_AND_OTHER: &str =
    "CREATE TABLE outbox (sequence_id bigint PRIMARY KEY AUTO_INCREMENT, partition_key text);
     CREATE TABLE other (id int PRIMARY KEY)";

/// A fresh database with the tables `ddl` makes, a connection to it, and a reader of its
/// outbox table from the log's current end, as a replica of an id of its own (`id_base` plus
/// a run's own part).
async fn reading_from_now(ddl: &str, id_base: u32) -> (String, Conn, BinlogReader) {
    let url = outbox_testkit::fresh_mysql_database().await;
    let database = Opts::from_url(&url).unwrap().db_name().unwrap().to_string();
    let mut conn = connect(&url).await;
    conn.query_drop(ddl).await.unwrap();
    let start = current_position(&url).await.unwrap();
    let config = BinlogConfig {
        url: url.clone(),
        server_id: id_base + fastrand_id(),
        database,
        table: "outbox".into(),
    };
    let reader = BinlogReader::start(&config, &start).await.unwrap();
    (url, conn, reader)
}

/// Every place a reader reports as one to start again from carries the GTID state the
/// server gives that file and offset (`BINLOG_GTID_POS`), even while the next transaction
/// is being read (its GTID event read, its end not yet): the state a failover resumes after
/// is never ahead of the position stored with it. Also a transaction's end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_boundary_carries_the_gtid_state_of_its_own_place_in_the_log() {
    let (url, mut conn, mut reader) = reading_from_now(OUTBOX_AND_OTHER, 3000).await;
    conn.query_drop("INSERT INTO other VALUES (1)")
        .await
        .unwrap();
    conn.query_drop("INSERT INTO outbox (partition_key) VALUES ('a')")
        .await
        .unwrap();
    let gtid_at = |position: BinlogPosition| {
        let url = url.clone();
        async move {
            let mut conn = connect(&url).await;
            let state: Option<String> = conn
                .exec_first(
                    "SELECT BINLOG_GTID_POS(?, ?)",
                    (&position.file, position.offset),
                )
                .await
                .unwrap();
            (position.gtid.clone(), state)
        }
    };
    // The outbox row is handed out with its transaction's end not yet read.
    assert!(matches!(
        crate::next_output(reader.next()).await,
        Output::Row(_)
    ));
    let (carried, server) = gtid_at(reader.boundary().unwrap()).await;
    assert_eq!(
        carried, server,
        "the boundary after the other table's transaction"
    );
    let Output::Committed { next, .. } = crate::next_output(reader.next()).await else {
        panic!("the outbox transaction's end")
    };
    let (carried, server) = gtid_at(next).await;
    assert_eq!(carried, server, "the outbox transaction's end");
}

/// A writer whose session logs only the columns its INSERT names (`binlog_row_image =
/// MINIMAL`) leaves the others out of the log: such a row is undecodable, saying which
/// column and how to fix it, never read as if they were NULL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_missing_from_the_row_image_makes_the_row_undecodable() {
    let (_url, mut conn, mut reader) = reading_from_now(
        "CREATE TABLE outbox (sequence_id bigint PRIMARY KEY AUTO_INCREMENT,
                              partition_key text, status varchar(10) NOT NULL DEFAULT 'NEW')",
        4000,
    )
    .await;
    conn.query_drop(
        "SET SESSION binlog_row_image = 'MINIMAL';
         INSERT INTO outbox (partition_key) VALUES ('a')",
    )
    .await
    .unwrap();
    let Output::Row(row) = crate::next_output(reader.next()).await else {
        panic!("the row")
    };
    assert_eq!(row.get("partition_key"), Some("a"));
    assert_eq!(row.unknown("partition_key"), None);
    assert!(row.unknown("status").is_some(), "not NULL: unknown");
    let reason = row.undecodable().expect("undecodable");
    assert!(
        reason.contains("status") && reason.contains("binlog_row_image = FULL"),
        "{reason}"
    );
}

/// XA transactions, as a transaction manager writes them. MariaDB logs a two-phase one's
/// rows at `XA PREPARE`, in events of their own, and its `XA COMMIT` or `XA ROLLBACK` later
/// as another transaction: another table's passes by either way; one that wrote the outbox
/// stops the reader, which hands out none of its rows (they may be rolled back), naming the
/// way out. A one-phase commit is logged as any transaction, and read as one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_xa_transaction_prepared_with_outbox_rows_stops_the_reader_before_any_is_relayed() {
    let (url, mut conn, mut reader) = reading_from_now(OUTBOX_AND_OTHER, 5000).await;
    // XA ids are the server's: each run's own (a prepared one outlives its session).
    let run = Opts::from_url(&url).unwrap().db_name().unwrap().to_string();
    conn.query_drop(format!(
        "XA START '{run}-1'; INSERT INTO other VALUES (1); XA END '{run}-1';
         XA PREPARE '{run}-1'; XA COMMIT '{run}-1';
         XA START '{run}-2'; INSERT INTO other VALUES (2); XA END '{run}-2';
         XA PREPARE '{run}-2'; XA ROLLBACK '{run}-2';
         XA START '{run}-3'; INSERT INTO outbox (partition_key) VALUES ('one-phase');
         XA END '{run}-3'; XA COMMIT '{run}-3' ONE PHASE;
         XA START '{run}-4'; INSERT INTO outbox (partition_key) VALUES ('two-phase');
         XA END '{run}-4'; XA PREPARE '{run}-4'"
    ))
    .await
    .unwrap();
    drop(conn);
    connect(&url)
        .await
        .query_drop(format!("XA ROLLBACK '{run}-4'"))
        .await
        .unwrap();
    let Output::Row(row) = crate::next_output(reader.next()).await else {
        panic!("the one-phase transaction's row")
    };
    assert_eq!(row.get("partition_key"), Some("one-phase"));
    assert!(matches!(
        crate::next_output(reader.next()).await,
        Output::Committed { rows: 1, .. }
    ));
    let stopped = tokio::time::timeout(Duration::from_secs(20), reader.next())
        .await
        .expect("the reader answered");
    let Err(BinlogError::Config(reason)) = stopped else {
        panic!("the prepared transaction's row refused, not {stopped:?}")
    };
    assert!(reason.contains("XA PREPARE"), "{reason}");
    assert!(reason.contains("--capture poll"), "{reason}");
}

/// A writer whose session logs statements as such (`binlog_format = STATEMENT`, here for
/// its session only: the test server is shared) inserts an outbox row no row event carries.
/// Its transaction's end was taken for another table's, and the row passed by unread, the
/// position stored past it. The reader stops at the statement now, naming it and the fix,
/// and reads no row after it; the place to start again stays before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_insert_logged_as_a_statement_stops_the_reader_before_it() {
    let (_url, mut conn, mut reader) = reading_from_now(OUTBOX_AND_OTHER, 5500).await;
    conn.query_drop("INSERT INTO outbox (partition_key) VALUES ('as-rows')")
        .await
        .unwrap();
    let Output::Row(row) = crate::next_output(reader.next()).await else {
        panic!("the row logged as rows")
    };
    assert_eq!(row.get("partition_key"), Some("as-rows"));
    let Output::Committed { next, .. } = crate::next_output(reader.next()).await else {
        panic!("its transaction's end")
    };
    conn.query_drop(
        "SET SESSION binlog_format = 'STATEMENT';
         INSERT INTO outbox (partition_key) VALUES ('as-a-statement')",
    )
    .await
    .unwrap();
    let past = log_end(&mut conn).await;
    conn.query_drop(
        "SET SESSION binlog_format = 'ROW';
         INSERT INTO outbox (partition_key) VALUES ('after')",
    )
    .await
    .unwrap();
    let said = stops_with(&mut reader).await;
    assert!(
        said.contains("as a statement")
            && said.contains("INSERT INTO")
            && said.contains("binlog_format = ROW"),
        "{said}"
    );
    // The statement's values may be the events' payloads: said in status, /readyz and the
    // logs, they are left out.
    assert!(!said.contains("as-a-statement"), "{said}");
    let boundary = reader.boundary().expect("a place read in the log");
    assert_start_again_before_the_statement(&next, &boundary, &past);
}

/// The log's end now (`SHOW MASTER STATUS`): its file and offset.
async fn log_end(conn: &mut Conn) -> (String, u64) {
    let end: mysql_async::Row = conn
        .query_first("SHOW MASTER STATUS")
        .await
        .unwrap()
        .unwrap();
    (end.get(0).unwrap(), end.get(1).unwrap())
}

/// The reader stopped at a statement it cannot read, with its place to start again at or
/// after `next` (the end of the last transaction it read: other tests' writes to the
/// server-wide log may lie between, which it passes over) and before `past`, the log's end
/// once the statement was written. Places compare by file, then offset: another test may
/// rotate the log in between (CI saw `next` in one file and the statement in the next).
fn assert_start_again_before_the_statement(
    next: &BinlogPosition,
    boundary: &BinlogPosition,
    past: &(String, u64),
) {
    let (next, boundary, past) = (
        (next.file.as_str(), next.offset),
        (boundary.file.as_str(), boundary.offset),
        (past.0.as_str(), past.1),
    );
    assert!(
        next <= boundary && boundary < past,
        "the reader starts again at or after {next:?}, before the statement (the log at \
         {past:?}): {boundary:?}"
    );
}

/// Statements that only read the outbox, logged as statements (pt-table-checksum sets its
/// session's binlog_format to STATEMENT and writes `REPLACE INTO percona.checksums … SELECT
/// 'shop', 'outbox', … FROM shop.outbox`), stopped capture for good: any mention of the
/// table counted. They pass now, and the reader reads on; one whose target is the outbox
/// still stops it, also behind a leading `--` comment, which was read as no verb at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_statement_logged_insert_whose_target_is_the_outbox_stops_the_reader() {
    let (url, mut conn, mut reader) = reading_from_now(OUTBOX_AND_OTHER, 5600).await;
    let database = Opts::from_url(&url).unwrap().db_name().unwrap().to_string();
    conn.query_drop("SET SESSION binlog_format = 'STATEMENT'")
        .await
        .unwrap();
    conn.query_drop(format!(
        "REPLACE INTO other (id) SELECT COUNT(*) FROM `{database}`.`outbox` \
         WHERE partition_key <> 'outbox' /*checksum table*/"
    ))
    .await
    .unwrap();
    conn.query_drop("INSERT INTO other SELECT 100 + COUNT(*) FROM outbox")
        .await
        .unwrap();
    conn.query_drop(
        "SET SESSION binlog_format = 'ROW';
         INSERT INTO outbox (partition_key) VALUES ('read on')",
    )
    .await
    .unwrap();
    let Output::Row(row) = crate::next_output(reader.next()).await else {
        panic!("the row after the statements that read the outbox")
    };
    assert_eq!(row.get("partition_key"), Some("read on"));
    let Output::Committed { next, .. } = crate::next_output(reader.next()).await else {
        panic!("its transaction's end")
    };
    conn.query_drop("SET SESSION binlog_format = 'STATEMENT'")
        .await
        .unwrap();
    conn.query_drop("-- app: order 17\nINSERT INTO outbox (partition_key) VALUES ('secret')")
        .await
        .unwrap();
    let past = log_end(&mut conn).await;
    conn.query_drop(
        "SET SESSION binlog_format = 'ROW';
         INSERT INTO outbox (partition_key) VALUES ('after')",
    )
    .await
    .unwrap();
    let said = stops_with(&mut reader).await;
    assert!(
        said.contains(&format!("INSERT INTO {database}.outbox")) && !said.contains("secret"),
        "{said}"
    );
    let boundary = reader.boundary().expect("a place read in the log");
    assert_start_again_before_the_statement(&next, &boundary, &past);
}

/// A LOAD DATA into the outbox logged as a statement is a Begin_load_query event (the
/// file) and an Execute_load_query event (the statement), which the reader did not look at:
/// its rows were passed by. It stops the reader now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_load_data_logged_as_a_statement_stops_the_reader() {
    let (url, _conn, mut reader) = reading_from_now(OUTBOX_AND_OTHER, 5700).await;
    let database = Opts::from_url(&url).unwrap().db_name().unwrap().to_string();
    let file = std::env::temp_dir().join(format!("{database}-rows.csv"));
    std::fs::write(&file, "loaded-1\nloaded-2\n").unwrap();
    let opts = mysql_async::OptsBuilder::from_opts(Opts::from_url(&url).unwrap())
        .local_infile_handler(Some(mysql_async::WhiteListFsHandler::new([file.clone()])));
    let mut conn = Conn::new(opts).await.unwrap();
    conn.query_drop("SET SESSION binlog_format = 'STATEMENT'")
        .await
        .unwrap();
    let loaded = conn
        .query_drop(format!(
            "LOAD DATA LOCAL INFILE '{}' INTO TABLE outbox (partition_key)",
            file.display()
        ))
        .await;
    std::fs::remove_file(&file).ok();
    loaded.expect("LOAD DATA LOCAL INFILE (the server's local_infile is on)");
    let said = stops_with(&mut reader).await;
    assert!(
        said.contains(&format!("LOAD DATA … INTO TABLE {database}.outbox"))
            && !said.contains("rows.csv"),
        "{said}"
    );
}

/// A MariaDB server of the test's own (with `servers.sh` variables `env`), the URL of its
/// database `shop` (not made yet), and a session as root.
pub(crate) async fn private_mariadb(
    env: &[(&'static str, &str)],
) -> (outbox_testkit::server::ScriptedServer, String, Conn) {
    let server = outbox_testkit::server::ScriptedServer::start_with(
        "mariadb",
        "OUTBOX_TEST_MARIADB_PORT",
        env,
    );
    let url = format!("mysql://root@127.0.0.1:{}/shop", server.port);
    let admin = connect(&format!("mysql://root@127.0.0.1:{}/mysql", server.port)).await;
    (server, url, admin)
}

/// A server that has written no GTID yet (new, or after `RESET MASTER`: here a private one,
/// since the shared test server's log must not be reset) answers `BINLOG_GTID_POS` with an
/// empty state. The reader took it for unknown, so no place it gave, in the whole session,
/// carried a state, and a failover was refused; it is a known, empty state, which the first
/// transaction's GTID fills.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_with_no_gtid_yet_gives_its_places_a_known_state_from_the_first_transaction() {
    let (_server, url, mut admin) = private_mariadb(&[("MARIADB_SERVER_ID", "7")]).await;
    admin
        .query_drop(
            "CREATE DATABASE shop;
             CREATE TABLE shop.outbox (sequence_id bigint PRIMARY KEY AUTO_INCREMENT,
                                       partition_key text);
             RESET MASTER",
        )
        .await
        .unwrap();
    let start = current_position(&url).await.unwrap();
    let config = BinlogConfig {
        url: url.clone(),
        server_id: crate::server_id(),
        database: "shop".into(),
        table: "outbox".into(),
    };
    let mut reader = BinlogReader::start(&config, &start).await.unwrap();
    assert_eq!(
        reader.boundary().and_then(|b| b.gtid).as_deref(),
        Some(""),
        "known: no GTID before the start"
    );
    admin
        .query_drop("INSERT INTO shop.outbox (partition_key) VALUES ('a')")
        .await
        .unwrap();
    assert!(matches!(
        crate::next_output(reader.next()).await,
        Output::Row(_)
    ));
    let Output::Committed { next, gtid, .. } = crate::next_output(reader.next()).await else {
        panic!("the transaction's end")
    };
    assert_eq!(gtid.as_deref(), Some("0-7-1"));
    assert_eq!(next.gtid.as_deref(), Some("0-7-1"), "{next:?}");
}

/// A server that leaves the outbox's database out of its log (`binlog-ignore-db`, or a
/// `binlog-do-db` list without it): the rows never reach the log and waited in the table
/// for good, with `check` content. It is refused, naming the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_does_not_log_the_outboxs_database_is_refused() {
    let (_server, shop, _admin) =
        private_mariadb(&[("MARIADB_EXTRA_ARGS", "--binlog-ignore-db=shop")]).await;
    let url = shop.replace("/shop", "/mysql");
    let said: Vec<String> = server_problems(&url, "shop")
        .await
        .unwrap()
        .iter()
        .filter(|p| p.fails_check())
        .map(ToString::to_string)
        .collect();
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(
        said[0].contains("logs no change to the database shop")
            && said[0].contains("binlog-ignore-db"),
        "{said:?}"
    );
    let others: Vec<_> = server_problems(&url, "billing")
        .await
        .unwrap()
        .into_iter()
        .filter(|p| p.fails_check())
        .collect();
    assert!(others.is_empty(), "{others:?}");
}

/// A row event larger than the server's `max_allowed_packet` (lowered after the row was
/// written, or a row whose image outgrows its INSERT): the reader's connection took the
/// server's limit for its own, refused the event ("packet too large") at every reconnect,
/// and capture never got past it. It reads it, as a replica does with its own limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_event_larger_than_the_servers_max_allowed_packet_is_read() {
    let (_server, url, mut admin) = private_mariadb(&[("MARIADB_SERVER_ID", "8")]).await;
    admin
        .query_drop(
            "CREATE DATABASE shop;
             CREATE TABLE shop.outbox (sequence_id bigint PRIMARY KEY AUTO_INCREMENT,
                                       partition_key text, payload longtext)",
        )
        .await
        .unwrap();
    let start = current_position(&url).await.unwrap();
    admin
        .exec_drop(
            "INSERT INTO shop.outbox (partition_key, payload) VALUES ('a', ?)",
            ("x".repeat(900 * 1024),),
        )
        .await
        .unwrap();
    admin
        .query_drop("SET GLOBAL max_allowed_packet = 512 * 1024")
        .await
        .unwrap();
    let config = BinlogConfig {
        url: url.clone(),
        server_id: crate::server_id(),
        database: "shop".into(),
        table: "outbox".into(),
    };
    let mut reader = BinlogReader::start(&config, &start).await.unwrap();
    let Output::Row(row) = crate::next_output(reader.next()).await else {
        panic!("the large row")
    };
    assert_eq!(row.get("payload").map(str::len), Some(900 * 1024));
}

/// An outbox of an id and a key, which the `ALTER TABLE` tests change.
const KEY_ONLY_OUTBOX: &str = "CREATE TABLE outbox (sequence_id bigint PRIMARY KEY AUTO_INCREMENT,
                                                     partition_key text NULL)";

/// Rows are read by column position. An `ALTER TABLE` that adds a column before the key
/// while the reader reads: the rows after it were read under the old names (the key read
/// from the new column). The reader describes the table again at the first row event of the
/// new width, and reads on with its new columns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_after_an_alter_table_are_read_with_the_new_columns() {
    let (url, mut conn, mut reader) = reading_from_now(KEY_ONLY_OUTBOX, 5000).await;
    conn.query_drop("INSERT INTO outbox (partition_key) VALUES ('a')")
        .await
        .unwrap();
    let Output::Row(row) = crate::next_output(reader.next()).await else {
        panic!("the first row")
    };
    assert_eq!(row.get("partition_key"), Some("a"));
    assert!(matches!(
        crate::next_output(reader.next()).await,
        Output::Committed { .. }
    ));
    let before_the_alter = current_position(&url).await.unwrap();
    conn.query_drop(
        "INSERT INTO outbox (partition_key) VALUES ('b');
         ALTER TABLE outbox ADD COLUMN tenant varchar(20) NULL AFTER sequence_id;
         INSERT INTO outbox (tenant, partition_key) VALUES ('t', 'c')",
    )
    .await
    .unwrap();
    let mut keys = Vec::new();
    while keys.len() < 2 {
        if let Output::Row(row) = crate::next_output(reader.next()).await {
            keys.push((
                row.get("partition_key").map(str::to_string),
                row.get("tenant").map(str::to_string),
            ));
        }
    }
    assert_eq!(
        keys,
        [
            (Some("b".into()), None),
            (Some("c".into()), Some("t".into()))
        ],
        "each row under its own columns"
    );
    // Read again from before the change, the row written before it matches the table
    // neither way it was described: the reader stops, naming the change.
    let stopped = stop_reading_again(&url, &before_the_alter).await;
    assert!(
        stopped.contains("altered") && stopped.contains("2 columns"),
        "{stopped}"
    );
}

/// What stops a reader started at `from` on the outbox of `url`, which must stop before it
/// hands out a row (read under a description the row does not match).
async fn stop_reading_again(url: &str, from: &outbox_binlog::BinlogPosition) -> String {
    let config = BinlogConfig {
        url: url.to_string(),
        server_id: 5000 + fastrand_id(),
        database: Opts::from_url(url).unwrap().db_name().unwrap().to_string(),
        table: "outbox".into(),
    };
    let mut again = BinlogReader::start(&config, from).await.unwrap();
    loop {
        match again.next().await {
            Ok(Some(Output::Row(row))) => panic!("a row read by the wrong description: {row:?}"),
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the stream ended"),
            Err(e) => break e.to_string(),
        }
    }
}

/// `ALTER TABLE … CONVERT TO CHARACTER SET` while the reader reads: the table map logs the
/// same types, so rows after it were decoded in the old character set (`é` in utf8mb4 read
/// as latin1's `Ã©`), and every key, type and destination with them. The table's new id has
/// it described again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_character_set_converted_while_reading_reads_later_rows_in_the_new_one() {
    let (_url, mut conn, mut reader) = reading_from_now(
        "CREATE TABLE outbox (sequence_id bigint PRIMARY KEY AUTO_INCREMENT,
                              partition_key varchar(64) NULL) DEFAULT CHARSET = latin1",
        5500,
    )
    .await;
    conn.query_drop("SET NAMES utf8mb4").await.unwrap();
    let mut keys = Vec::new();
    for statement in [
        "INSERT INTO outbox (partition_key) VALUES ('é')",
        "ALTER TABLE outbox CONVERT TO CHARACTER SET utf8mb4",
        "INSERT INTO outbox (partition_key) VALUES ('é')",
    ] {
        conn.query_drop(statement).await.unwrap();
    }
    while keys.len() < 2 {
        if let Output::Row(row) = crate::next_output(reader.next()).await {
            keys.push(row.get("partition_key").map(str::to_string));
        }
    }
    assert_eq!(keys, [Some("é".to_string()), Some("é".to_string())]);
}

/// `ALTER TABLE … CONVERT TO CHARACTER SET` between rows read again after a restart: the
/// table was described as it is now, so the rows written before it were decoded in the new
/// character set: utf8mb4's `é` read as latin1's `Ã©`, with no error, and a latin1 `é` in
/// utf8mb4 refused. Where the server logs the columns' character sets
/// (binlog_row_metadata MINIMAL or FULL), each row is read in the one logged with it. An
/// ENUM and a GEOMETRY column before the strings check that the logged sets are matched to
/// the right columns (ENUM and SET have theirs apart; a GEOMETRY has one, which was missed,
/// and every later string was read in its neighbour's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_before_a_character_set_conversion_are_read_in_theirs_after_a_restart() {
    let (_server, url, mut admin) = private_mariadb(&[("MARIADB_SERVER_ID", "8")]).await;
    admin
        .query_drop(
            "SET GLOBAL binlog_row_metadata = 'MINIMAL';
             CREATE DATABASE shop;
             CREATE TABLE shop.outbox (sequence_id bigint PRIMARY KEY AUTO_INCREMENT,
                                       state enum('new', 'old') NULL,
                                       shape geometry NULL,
                                       partition_key varchar(64) NULL,
                                       payload text NULL) DEFAULT CHARSET = utf8mb4",
        )
        .await
        .unwrap();
    let mut conn = connect(&url).await;
    conn.query_drop("SET NAMES utf8mb4").await.unwrap();
    let before = current_position(&url).await.unwrap();
    for statement in [
        "INSERT INTO outbox (state, partition_key, payload) VALUES ('old', 'é1', 'ü1')",
        "ALTER TABLE outbox CONVERT TO CHARACTER SET latin1",
        "INSERT INTO outbox (state, partition_key, payload) VALUES ('new', 'é2', 'ü2')",
        "ALTER TABLE outbox CONVERT TO CHARACTER SET utf8mb4",
        "INSERT INTO outbox (state, partition_key, payload) VALUES ('new', 'é3', 'ü3')",
    ] {
        conn.query_drop(statement).await.unwrap();
    }
    let rows: Vec<_> = read_again(&url, &before, 3)
        .await
        .iter()
        .map(|row| {
            (
                row.get("state").map(str::to_string),
                row.get("partition_key").map(str::to_string),
                row.get("payload").map(str::to_string),
            )
        })
        .collect();
    let row = |state: &str, n: u8| {
        (
            Some(state.to_string()),
            Some(format!("é{n}")),
            Some(format!("ü{n}")),
        )
    };
    assert_eq!(rows, [row("old", 1), row("new", 2), row("new", 3)]);
}

/// Rows written before an `ALTER TABLE` of the outbox and read after it, after a restart:
/// they fit the table neither as it is now nor as the reader last described it, and
/// capture stopped for good (a BLACKHOLE outbox, whose rows are nowhere else, could only
/// skip them). Where the server names the columns in the log (binlog_row_metadata = FULL),
/// they are read by the columns, signedness, character sets and labels logged with them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_before_an_alter_table_are_read_by_their_logged_columns_after_a_restart() {
    let (_server, url, mut admin) = private_mariadb(&[("MARIADB_SERVER_ID", "9")]).await;
    admin
        .query_drop(
            "SET GLOBAL binlog_row_metadata = 'FULL';
             CREATE DATABASE shop;
             CREATE TABLE shop.outbox (sequence_id bigint PRIMARY KEY AUTO_INCREMENT,
                                       shape geometry NULL,
                                       partition_key varchar(64) CHARACTER SET latin1 NULL,
                                       tries tinyint unsigned NULL,
                                       state enum('new', 'old') NULL,
                                       note text NULL)",
        )
        .await
        .unwrap();
    let mut conn = connect(&url).await;
    conn.query_drop("SET NAMES utf8mb4").await.unwrap();
    let before = current_position(&url).await.unwrap();
    for statement in [
        "INSERT INTO outbox (partition_key, tries, state, note) VALUES ('é', 200, 'old', 'n')",
        "ALTER TABLE outbox DROP COLUMN note, ADD COLUMN tenant text NULL,
                            MODIFY partition_key varchar(64) CHARACTER SET utf8mb4 NULL",
        "INSERT INTO outbox (partition_key, tries, state, tenant) VALUES ('é', 201, 'new', 't')",
    ] {
        conn.query_drop(statement).await.unwrap();
    }
    let rows = read_again(&url, &before, 2).await;
    let read = |row: &outbox_binlog::Row, column| row.get(column).map(str::to_string);
    assert_eq!(
        ["partition_key", "tries", "state", "note", "tenant"].map(|c| read(&rows[0], c)),
        [
            Some("é".into()),
            Some("200".into()),
            Some("old".into()),
            Some("n".into()),
            None
        ],
        "the earlier row by its own columns: {:?}",
        rows[0]
    );
    assert_eq!(
        ["partition_key", "tries", "state", "note", "tenant"].map(|c| read(&rows[1], c)),
        [
            Some("é".into()),
            Some("201".into()),
            Some("new".into()),
            None,
            Some("t".into())
        ],
        "the later row by the table's columns now: {:?}",
        rows[1]
    );
}

/// The first `n` rows of `shop.outbox` on the server of `url` from `from`, read as a
/// restarted relay reads them again, each decodable.
async fn read_again(
    url: &str,
    from: &outbox_binlog::BinlogPosition,
    n: usize,
) -> Vec<outbox_binlog::Row> {
    let config = BinlogConfig {
        url: url.to_string(),
        server_id: crate::server_id(),
        database: "shop".into(),
        table: "outbox".into(),
    };
    let mut reader = BinlogReader::start(&config, from).await.unwrap();
    let mut rows = Vec::new();
    while rows.len() < n {
        if let Output::Row(row) = crate::next_output(reader.next()).await {
            assert_eq!(row.undecodable(), None, "{row:?}");
            rows.push(row);
        }
    }
    rows
}

/// A reopen of the table that changes nothing (FLUSH TABLES, a restart) gives it a new id:
/// read behind a later `ALTER TABLE`, the rows between were compared with the table as it
/// is now, which they do not fit, and the reader stopped. They fit the description it has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reopened_table_read_behind_a_later_alter_table_reads_on() {
    let (_url, mut conn, mut reader) = reading_from_now(KEY_ONLY_OUTBOX, 5600).await;
    for statement in [
        "INSERT INTO outbox (partition_key) VALUES ('a')",
        "FLUSH TABLES",
        "INSERT INTO outbox (partition_key) VALUES ('b')",
        "ALTER TABLE outbox ADD COLUMN tenant text NULL",
        "INSERT INTO outbox (partition_key, tenant) VALUES ('c', 't')",
    ] {
        conn.query_drop(statement).await.unwrap();
    }
    let mut keys = Vec::new();
    while keys.len() < 3 {
        if let Output::Row(row) = crate::next_output(reader.next()).await {
            keys.push(row.get("partition_key").map(str::to_string));
        }
    }
    assert_eq!(
        keys,
        [
            Some("a".to_string()),
            Some("b".to_string()),
            Some("c".to_string())
        ]
    );
}

/// An `ALTER TABLE` that keeps the column count (a column's type changed) while the reader
/// reads: the width did not change, so rows after it were decoded by the old description (a
/// DATETIME made TIMESTAMP read as the seconds since the epoch). The table map of the
/// table's new id logs the new type: the reader describes the table again and reads the
/// value as the table shows it; read again from before the change, the earlier row matches
/// the table neither way, and the reader stops rather than misread it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_whose_type_an_alter_table_changed_is_read_by_its_new_type() {
    let (url, mut conn, mut reader) = reading_from_now(
        "CREATE TABLE outbox (sequence_id bigint PRIMARY KEY AUTO_INCREMENT,
                              partition_key text NULL, created_at datetime(6) NULL)",
        5000,
    )
    .await;
    conn.query_drop("SET time_zone = '+00:00'").await.unwrap();
    let before_the_alter = current_position(&url).await.unwrap();
    conn.query_drop(
        "INSERT INTO outbox (partition_key, created_at) VALUES ('a', '2024-12-02 00:40:00.5');
         ALTER TABLE outbox MODIFY created_at timestamp(6) NULL;
         INSERT INTO outbox (partition_key, created_at) VALUES ('b', '2024-12-02 00:40:00.5')",
    )
    .await
    .unwrap();
    let mut read = Vec::new();
    while read.len() < 2 {
        if let Output::Row(row) = crate::next_output(reader.next()).await {
            assert_eq!(row.undecodable(), None, "{row:?}");
            read.push((
                row.get("partition_key").map(str::to_string),
                row.get("created_at").map(str::to_string),
            ));
        }
    }
    let at = Some("2024-12-02 00:40:00.500000".to_string());
    assert_eq!(
        read,
        [(Some("a".into()), at.clone()), (Some("b".into()), at)],
        "each row by its own column types"
    );
    let stopped = stop_reading_again(&url, &before_the_alter).await;
    assert!(
        stopped.contains("altered") && stopped.contains("created_at"),
        "{stopped}"
    );
}

/// A string column in latin1 (MariaDB's default character set: a table an application made
/// without naming one): the log carries its bytes in latin1, which were read as UTF-8, each
/// non-ASCII character replaced, and relayed so. They read as their characters now (MySQL's
/// latin1 is Windows-1252: `€` and `–` too), as polling reads them; a character set the
/// reader does not know makes the row undecodable where its bytes are not ASCII.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn string_columns_are_read_in_their_character_set() {
    let (_url, mut conn, mut reader) = reading_from_now(
        "CREATE TABLE outbox (sequence_id bigint PRIMARY KEY AUTO_INCREMENT,
                              partition_key varchar(50) CHARACTER SET latin1 NULL,
                              payload text CHARACTER SET latin1 NULL,
                              label varchar(50) CHARACTER SET sjis NULL)",
        6000,
    )
    .await;
    conn.query_drop("SET NAMES utf8mb4").await.unwrap();
    conn.exec_drop(
        "INSERT INTO outbox (partition_key, payload, label) VALUES (?, ?, 'plain')",
        ("café €", "{\"a\": \"naïve – ok\"}"),
    )
    .await
    .unwrap();
    conn.exec_drop(
        "INSERT INTO outbox (partition_key, label) VALUES ('k', ?)",
        ("日本",),
    )
    .await
    .unwrap();
    let mut rows = Vec::new();
    while rows.len() < 2 {
        if let Output::Row(row) = crate::next_output(reader.next()).await {
            rows.push(row);
        }
    }
    assert_eq!(rows[0].get("partition_key"), Some("café €"));
    assert_eq!(rows[0].get("payload"), Some("{\"a\": \"naïve – ok\"}"));
    assert_eq!(rows[0].get("label"), Some("plain"));
    assert_eq!(rows[0].undecodable(), None);
    let reason = rows[1].undecodable().expect("the sjis text is not read");
    assert!(
        reason.contains("sjis") && reason.contains("utf8mb4"),
        "{reason}"
    );
}

/// The first error `reader` stops with, within 20 s; a row read or the stream's end fails.
async fn stops_with(reader: &mut BinlogReader) -> String {
    let stopped = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match reader.next().await {
                Ok(Some(Output::Row(row))) => panic!("a row read: {row:?}"),
                Ok(Some(_)) => continue,
                Ok(None) => panic!("the stream ended"),
                Err(e) => break e.to_string(),
            }
        }
    })
    .await;
    stopped.expect("the reader went on past the row for 20 s")
}

/// MariaDB logs a `COMPRESSED` column as a type mysql_common does not know. A row with a
/// value in it was passed by unread (the decode error was dropped, and the position stored
/// past its transaction); a row with NULL in it panicked the reader on the next column,
/// whose metadata could not be found. Both stop the reader now, naming the column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_of_a_type_the_reader_cannot_read_stops_it_naming_the_column() {
    let ddl = "CREATE TABLE outbox (sequence_id bigint PRIMARY KEY AUTO_INCREMENT,
                                    body text COMPRESSED NULL,
                                    partition_key varchar(20) NULL)";
    let (url, mut conn, mut reader) = reading_from_now(ddl, 5100).await;
    let before = current_position(&url).await.unwrap();
    conn.query_drop("INSERT INTO outbox (body, partition_key) VALUES ('x', 'a')")
        .await
        .unwrap();
    let stopped = stops_with(&mut reader).await;
    assert!(
        stopped.contains("column 1: type 14") && stopped.contains("COMPRESSED"),
        "{stopped}"
    );
    let after = current_position(&url).await.unwrap();
    conn.query_drop("INSERT INTO outbox (body, partition_key) VALUES (NULL, 'b')")
        .await
        .unwrap();
    let config = BinlogConfig {
        url: url.clone(),
        server_id: 5100 + fastrand_id(),
        database: Opts::from_url(&url).unwrap().db_name().unwrap().to_string(),
        table: "outbox".into(),
    };
    let mut null_first = BinlogReader::start(&config, &after).await.unwrap();
    let stopped = stops_with(&mut null_first).await;
    assert!(stopped.contains("column 2"), "{stopped}");
    assert!(before != after);
}

/// `next` is cancel-safe (the capture races it against its timers). A row event of a new
/// layout made the call describe the table again, an await, with the event taken from the
/// stream: a call cancelled there lost the event, and the next call read on past it. Calls
/// cut short here, the first ones well before the description can finish, still bring the
/// row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_of_a_new_layout_survives_a_call_cancelled_while_the_table_is_described() {
    let (_url, mut conn, mut reader) = reading_from_now(KEY_ONLY_OUTBOX, 5200).await;
    conn.query_drop(
        "ALTER TABLE outbox ADD COLUMN tenant varchar(20) NULL AFTER sequence_id;
         INSERT INTO outbox (tenant, partition_key) VALUES ('t', 'c')",
    )
    .await
    .unwrap();
    let mut patience = Duration::from_micros(50);
    let row = loop {
        assert!(patience < Duration::from_secs(30), "no row");
        match tokio::time::timeout(patience, reader.next()).await {
            Err(_) => patience *= 2,
            Ok(Ok(Some(Output::Row(row)))) => break row,
            Ok(Ok(Some(Output::Committed { .. }))) => panic!("the commit came without its row"),
            Ok(Ok(Some(_))) => {}
            Ok(other) => panic!("{other:?}"),
        }
    };
    assert_eq!(row.get("partition_key"), Some("c"));
    assert_eq!(row.get("tenant"), Some("t"));
}

/// A dump connection dropped silently (a NAT or proxy that forgot the flow): on a dump only
/// the server speaks, so the reader waited for good, while the seat's lease was renewed on
/// its own connection and no standby took over. The server now sends heartbeats while it is
/// quiet, and a reader that hears nothing, not even those, for `BINLOG_SILENCE` says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dump_connection_gone_silent_is_taken_for_dead() {
    let (url, mut conn, _) = reading_from_now(OUTBOX_AND_OTHER, 5300).await;
    let (proxy, proxied) = outbox_testkit::FaultProxy::start_for_url(&url)
        .await
        .unwrap();
    let config = BinlogConfig {
        // Over the proxy only: mysql_async would move a local connection to the server's
        // socket.
        url: format!("{proxied}?prefer_socket=false"),
        server_id: 5300 + fastrand_id(),
        database: Opts::from_url(&url).unwrap().db_name().unwrap().to_string(),
        table: "outbox".into(),
    };
    let start = current_position(&url).await.unwrap();
    let mut reader = BinlogReader::start(&config, &start).await.unwrap();
    conn.query_drop("INSERT INTO outbox (partition_key) VALUES ('a')")
        .await
        .unwrap();
    assert!(matches!(
        crate::next_output(reader.next()).await,
        Output::Row(_)
    ));
    proxy.handle().blackhole_existing();
    conn.query_drop("INSERT INTO outbox (partition_key) VALUES ('b')")
        .await
        .unwrap();
    let waited = outbox_binlog::BINLOG_SILENCE + Duration::from_secs(20);
    let stopped = tokio::time::timeout(waited, async {
        loop {
            match reader.next().await {
                Ok(Some(_)) => continue,
                Ok(None) => break "the stream ended".to_string(),
                Err(e) => break e.to_string(),
            }
        }
    })
    .await
    .expect("the reader still waits on a dead connection");
    assert!(stopped.contains("heartbeat"), "{stopped}");
}

/// A quiet server is not a dead one: its heartbeats keep the reader waiting past
/// `BINLOG_SILENCE`, and the next row comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_server_keeps_its_reader_with_heartbeats() {
    let (_url, mut conn, mut reader) = reading_from_now(OUTBOX_AND_OTHER, 5400).await;
    let quiet = outbox_binlog::BINLOG_SILENCE + Duration::from_secs(3);
    let waited = tokio::time::timeout(quiet, async {
        loop {
            match reader.next().await {
                Ok(Some(_)) => continue,
                other => break other,
            }
        }
    })
    .await;
    assert!(waited.is_err(), "the reader stopped: {waited:?}");
    conn.query_drop("INSERT INTO outbox (partition_key) VALUES ('a')")
        .await
        .unwrap();
    let row = loop {
        if let Output::Row(row) = crate::next_output(reader.next()).await {
            break row;
        }
    };
    assert_eq!(row.get("partition_key"), Some("a"));
}
