//! The reader on a MySQL 8 stream, which no server here writes (Debian packages MariaDB
//! only): its GTID events, anonymous transactions and compressed transactions, as MySQL's
//! documentation ("The Binary Log" in the source documentation, WL#3549) lays out their bytes.
//! The events are written here and handed to the reader the way mysql_async's stream hands
//! them out: the events inside a compressed transaction right after its payload event.

use std::collections::VecDeque;
use std::io::Cursor;

use futures::future::BoxFuture;
use futures::FutureExt;
use mysql_common::binlog::consts::{BinlogVersion, TransactionPayloadCompressionType};
use mysql_common::binlog::events::{Event, GtidEvent, TableMapEvent, TransactionPayloadEvent};
use mysql_common::binlog::EventStreamReader;
use mysql_common::proto::MySerialize;

use super::*;

const SOURCE: &str = "3e11fa47-71ca-11e1-9e33-c80aa9429562";
const TABLE_ID: u64 = 108;

const QUERY_EVENT: u8 = 2;
const XID_EVENT: u8 = 16;
const TABLE_MAP_EVENT: u8 = 19;
const WRITE_ROWS_EVENT: u8 = 30;
const GTID_EVENT: u8 = 33;
const ANONYMOUS_GTID_EVENT: u8 = 34;
const TRANSACTION_PAYLOAD_EVENT: u8 = 40;

/// Events written here, handed out as mysql_async's stream does.
struct WrittenEvents {
    reader: EventStreamReader,
    events: VecDeque<Vec<u8>>,
    /// The events inside the last payload event, while some are left.
    inside: Option<Cursor<Vec<u8>>>,
    /// The server error that follows the events, if one does.
    then: Option<u16>,
}

impl EventSource for WrittenEvents {
    fn next_event(&mut self) -> BoxFuture<'_, Option<mysql_async::Result<Event>>> {
        async move {
            if let Some(inside) = &mut self.inside {
                match self.reader.read_decompressed(inside) {
                    Ok(Some(event)) => return Some(Ok(event)),
                    Ok(None) => self.inside = None,
                    Err(e) => return Some(Err(e.into())),
                }
            }
            let Some(bytes) = self.events.pop_front() else {
                return self.then.take().map(|code| {
                    Err(mysql_async::Error::Server(mysql_async::ServerError {
                        code,
                        message: "could not find next log".into(),
                        state: "HY000".into(),
                    }))
                });
            };
            let event = self.reader.read(&bytes[..]).ok()??;
            if event.header().event_type_raw() == TRANSACTION_PAYLOAD_EVENT {
                let payload: TransactionPayloadEvent<'_> = event.read_event().ok()?;
                self.inside = Some(Cursor::new(payload.danger_decompress()));
            }
            Some(Ok(event))
        }
        .boxed()
    }

    fn table_map(&self, table_id: u64) -> Option<&TableMapEvent<'static>> {
        self.reader.get_tme(table_id)
    }
}

/// One event: the common header (timestamp, type, server id, size, the next event's
/// position, flags), then `body`.
fn event(kind: u8, next: u32, body: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::new();
    bytes.extend(1_700_000_000u32.to_le_bytes());
    bytes.push(kind);
    bytes.extend(1u32.to_le_bytes());
    bytes.extend((19 + body.len() as u32).to_le_bytes());
    bytes.extend(next.to_le_bytes());
    bytes.extend(0u16.to_le_bytes());
    bytes.extend(body);
    bytes
}

fn gtid(number: u64, next: u32) -> Vec<u8> {
    let source = *uuid::Uuid::parse_str(SOURCE).unwrap().as_bytes();
    let mut body = Vec::new();
    GtidEvent::new(source, number)
        .with_lc_typecode()
        .serialize(&mut body);
    event(GTID_EVENT, next, &body)
}

fn anonymous_gtid(next: u32) -> Vec<u8> {
    let mut body = Vec::new();
    GtidEvent::new([0; 16], 0)
        .with_lc_typecode()
        .serialize(&mut body);
    event(ANONYMOUS_GTID_EVENT, next, &body)
}

/// `BEGIN`: thread id, execution time, schema length, error code, status variables'
/// length, then the schema (empty) with its NUL, then the statement.
fn begin(next: u32) -> Vec<u8> {
    query("BEGIN", next)
}

/// A query event of `statement` (as [`begin`]).
fn query(statement: &str, next: u32) -> Vec<u8> {
    let mut body = vec![0; 13];
    body.push(0);
    body.extend(statement.as_bytes());
    event(QUERY_EVENT, next, &body)
}

/// The end of the XA transaction `X'31'`'s events: `XA PREPARE`, or with `one_phase`
/// `XA COMMIT … ONE PHASE`. Whether one phase, the format id, the lengths of its two
/// parts, then the parts.
fn xa_end(one_phase: bool, next: u32) -> Vec<u8> {
    let mut body = vec![u8::from(one_phase)];
    body.extend(1u32.to_le_bytes());
    body.extend(1u32.to_le_bytes());
    body.extend(0u32.to_le_bytes());
    body.push(b'1');
    event(XA_PREPARE_LOG_EVENT, next, &body)
}

/// The table map of `shop`.`outbox` (id BIGINT, aggregate VARCHAR(64) NULL).
fn table_map(next: u32) -> Vec<u8> {
    let mut body = TABLE_ID.to_le_bytes()[..6].to_vec();
    body.extend(1u16.to_le_bytes());
    for name in ["shop", "outbox"] {
        body.push(name.len() as u8);
        body.extend(name.as_bytes());
        body.push(0);
    }
    body.push(2); // columns
    body.extend([8, 15]); // LONGLONG, VARCHAR
    body.push(2); // metadata: VARCHAR's maximum length in bytes
    body.extend(64u16.to_le_bytes());
    body.push(0b10); // nullable: aggregate
    event(TABLE_MAP_EVENT, next, &body)
}

/// A version 2 WRITE_ROWS event of `rows` (id, aggregate) into `shop`.`outbox`.
fn write_rows(rows: &[(i64, &str)], next: u32) -> Vec<u8> {
    let mut body = TABLE_ID.to_le_bytes()[..6].to_vec();
    body.extend(1u16.to_le_bytes()); // the statement's end
    body.extend(2u16.to_le_bytes()); // extra data: its own length only
    body.push(2); // columns
    body.push(0b11); // both in the after image
    for (id, aggregate) in rows {
        body.push(0); // no NULLs
        body.extend(id.to_le_bytes());
        body.push(aggregate.len() as u8);
        body.extend(aggregate.as_bytes());
    }
    event(WRITE_ROWS_EVENT, next, &body)
}

fn xid(next: u32) -> Vec<u8> {
    event(XID_EVENT, next, &7u64.to_le_bytes())
}

/// A compressed transaction holding `events` (which carry no positions of their own).
fn payload(events: &[Vec<u8>], next: u32, algorithm: TransactionPayloadCompressionType) -> Vec<u8> {
    let plain: Vec<u8> = events.concat();
    let data = match algorithm {
        TransactionPayloadCompressionType::ZSTD => zstd::encode_all(&plain[..], 3).unwrap(),
        _ => plain.clone(),
    };
    let mut body = Vec::new();
    TransactionPayloadEvent::new(0, algorithm, plain.len() as u64, data.clone())
        .with_payload_size(data.len() as u64)
        .serialize(&mut body);
    event(TRANSACTION_PAYLOAD_EVENT, next, &body)
}

fn reader_of(events: Vec<Vec<u8>>, gtid_state: Option<&str>) -> BinlogReader {
    let config = BinlogConfig {
        url: String::new(),
        server_id: 1000,
        database: "shop".into(),
        table: "outbox".into(),
    };
    let source = WrittenEvents {
        reader: EventStreamReader::new(BinlogVersion::Version4),
        events: events.into(),
        inside: None,
        then: None,
    };
    let mut reader = BinlogReader::of(
        Box::new(source),
        &config,
        Layout {
            database: config.database.clone(),
            table: config.table.clone(),
            columns: vec!["id".into(), "aggregate".into()],
            kinds: vec![ColumnKind::AsIs, ColumnKind::AsIs],
            // Not compared with the table maps' types.
            data_types: vec![String::new(), String::new()],
            collations: Default::default(),
        },
        BinlogPosition::at("binlog.000003", 1000),
    );
    reader.gtid_state = gtid_state.map(|s| gtid::GtidState::parse(s).unwrap());
    reader
}

/// Error 1236 ends the stream: before any event, the position asked for is not in the log
/// (purged); after events, the log could not be read on there, and saying it was purged
/// would point the operator at skipping to the server's current position.
#[tokio::test]
async fn error_1236_says_purged_only_before_the_first_event() {
    let mut at_start = reader_of(Vec::new(), None);
    at_start.stream = Box::new(WrittenEvents {
        reader: EventStreamReader::new(BinlogVersion::Version4),
        events: VecDeque::new(),
        inside: None,
        then: Some(FATAL_READING_BINLOG),
    });
    let e = at_start.next().await.expect_err("an error");
    assert!(matches!(e, BinlogError::Purged { .. }), "{e}");
    let mut later = reader_of(vec![gtid(41, 1100)], None);
    later.stream = Box::new(WrittenEvents {
        reader: EventStreamReader::new(BinlogVersion::Version4),
        events: VecDeque::from([gtid(41, 1100)]),
        inside: None,
        then: Some(FATAL_READING_BINLOG),
    });
    let e = later.next().await.expect_err("an error");
    assert!(!matches!(e, BinlogError::Purged { .. }), "{e}");
    assert!(e.to_string().contains("offset 1100"), "{e}");
}

/// Every output until the events run out, rows as their id and aggregate.
async fn read_all(reader: &mut BinlogReader) -> Vec<String> {
    let mut outputs = Vec::new();
    while let Some(output) = reader.next().await.unwrap() {
        outputs.push(match output {
            Output::Row(row) => format!(
                "row {} {}",
                row.get("id").unwrap(),
                row.get("aggregate").unwrap()
            ),
            Output::Committed { next, rows, gtid } => format!(
                "commit {rows} at {} gtid {}",
                next.offset,
                gtid.unwrap_or_default()
            ),
            Output::RolledBack { next, rows } => format!("rollback {rows} at {}", next.offset),
        });
    }
    outputs
}

#[tokio::test]
async fn a_compressed_transactions_rows_are_read_and_end_where_its_payload_does() {
    let inside = [
        begin(0),
        table_map(0),
        write_rows(&[(1, "a"), (2, "b")], 0),
        write_rows(&[(3, "a")], 0),
        xid(0),
    ];
    for algorithm in [
        TransactionPayloadCompressionType::ZSTD,
        TransactionPayloadCompressionType::NONE,
    ] {
        let mut reader = reader_of(
            vec![
                gtid(41, 1100),
                payload(&inside, 1400, algorithm),
                gtid(42, 1500),
                begin(1560),
                table_map(1620),
                write_rows(&[(4, "c")], 1700),
                xid(1731),
            ],
            Some(&format!("{SOURCE}:1-40")),
        );
        assert_eq!(
            read_all(&mut reader).await,
            [
                "row 1 a".to_string(),
                "row 2 b".into(),
                "row 3 a".into(),
                format!("commit 3 at 1400 gtid {SOURCE}:41"),
                "row 4 c".into(),
                format!("commit 1 at 1731 gtid {SOURCE}:42"),
            ],
            "{algorithm:?}"
        );
        let boundary = reader.boundary().unwrap();
        assert_eq!(
            (boundary.offset, boundary.gtid),
            (1731, Some(format!("{SOURCE}:1-42")))
        );
    }
}

#[tokio::test]
async fn a_place_inside_a_compressed_transaction_is_never_given_out() {
    // Another table's compressed transaction, then the outbox's: the boundary after the
    // first is the first payload's end, whatever its events say of themselves.
    let other = [begin(0), xid(0)];
    let mut reader = reader_of(
        vec![
            gtid(41, 1100),
            payload(&other, 1200, TransactionPayloadCompressionType::ZSTD),
        ],
        Some(&format!("{SOURCE}:1-40")),
    );
    assert!(read_all(&mut reader).await.is_empty());
    let boundary = reader.boundary().unwrap();
    assert_eq!(
        (boundary.offset, boundary.gtid),
        (1200, Some(format!("{SOURCE}:1-41")))
    );
    assert_eq!(reader.read_to().offset, 1200);
}

#[tokio::test]
async fn a_payload_that_does_not_decompress_stops_the_reader_rather_than_skip_its_rows() {
    let inside = [begin(0), table_map(0), write_rows(&[(1, "a")], 0), xid(0)];
    let mut broken = payload(&inside, 1400, TransactionPayloadCompressionType::ZSTD);
    let last = broken.len() - 1;
    broken[last] ^= 0xff; // the compressed frame's last byte
    let mut reader = reader_of(vec![gtid(41, 1100), broken], None);
    let error = reader.next().await.unwrap_err().to_string();
    assert!(
        error.contains("compressed transaction at binlog.000003 offset 1400 cannot be read"),
        "{error}"
    );
}

#[tokio::test]
async fn an_anonymous_transaction_leaves_no_gtid_state_to_store() {
    let mut reader = reader_of(
        vec![
            gtid(41, 1100),
            begin(1160),
            xid(1191),
            anonymous_gtid(1250),
            begin(1310),
            table_map(1390),
            write_rows(&[(1, "a")], 1420),
            xid(1451),
        ],
        Some(&format!("{SOURCE}:1-40")),
    );
    let outputs = read_all(&mut reader).await;
    assert_eq!(outputs, ["row 1 a", "commit 1 at 1451 gtid "]);
    let boundary = reader.boundary().unwrap();
    assert_eq!((boundary.offset, boundary.gtid), (1451, None));
}

#[tokio::test]
async fn a_mysql_gtid_on_a_reader_without_a_state_is_the_transactions_own_only() {
    let mut reader = reader_of(
        vec![
            gtid(7, 1100),
            begin(1160),
            table_map(1240),
            write_rows(&[(1, "a")], 1270),
            xid(1301),
        ],
        None,
    );
    assert_eq!(
        read_all(&mut reader).await,
        [
            "row 1 a".to_string(),
            format!("commit 1 at 1301 gtid {SOURCE}:7")
        ]
    );
    assert_eq!(reader.boundary().unwrap().gtid, None);
}

#[tokio::test]
async fn the_log_is_read_past_a_compressed_transaction_only_after_its_last_event() {
    let inside = [
        begin(0),
        table_map(0),
        write_rows(&[(1, "a")], 0),
        write_rows(&[(2, "b")], 0),
        xid(0),
    ];
    let mut reader = reader_of(
        vec![
            gtid(41, 1100),
            payload(&inside, 1400, TransactionPayloadCompressionType::ZSTD),
        ],
        None,
    );
    // A drain that stops once the log is read to its end must not stop after row 1.
    let mut read_to = Vec::new();
    while let Some(output) = reader.next().await.unwrap() {
        read_to.push((matches!(output, Output::Row(_)), reader.read_to().offset));
    }
    assert_eq!(read_to, [(true, 1100), (true, 1100), (false, 1400)]);
}

#[tokio::test]
async fn a_payload_whose_event_sizes_do_not_add_up_stops_the_reader_without_a_panic() {
    for size in [5u32, 10_000] {
        let mut rows = write_rows(&[(1, "a")], 0);
        rows[9..13].copy_from_slice(&size.to_le_bytes());
        let inside = [begin(0), table_map(0), rows, xid(0)];
        let mut reader = reader_of(
            vec![
                gtid(41, 1100),
                payload(&inside, 1400, TransactionPayloadCompressionType::ZSTD),
            ],
            None,
        );
        let error = reader.next().await.unwrap_err().to_string();
        assert!(error.contains("broken size"), "{size}: {error}");
    }
}

/// MySQL logs an XA transaction committed in one phase as its events from `XA START` to an
/// `XA_PREPARE_LOG_EVENT` marked one-phase: its rows are held until that end, then relayed
/// with it. One prepared (the same event, not so marked; a later `XA COMMIT` or
/// `XA ROLLBACK` decides it) stops the reader before any of its rows is handed out.
#[tokio::test]
async fn a_one_phase_xa_commit_is_relayed_at_its_end_and_a_prepared_one_stops_the_reader() {
    let mut reader = reader_of(
        vec![
            gtid(1, 1100),
            query("XA START X'31',X'',1", 1150),
            table_map(1200),
            write_rows(&[(1, "a")], 1250),
            query("XA END X'31',X'',1", 1300),
            xa_end(true, 1350),
            gtid(2, 1400),
            query("XA START X'32',X'',1", 1450),
            table_map(1500),
            write_rows(&[(2, "b")], 1550),
            query("XA END X'32',X'',1", 1600),
            xa_end(false, 1650),
        ],
        None,
    );
    let mut outputs = Vec::new();
    let stopped = loop {
        match reader.next().await {
            Ok(Some(Output::Row(row))) => outputs.push(format!("row {}", row.get("id").unwrap())),
            Ok(Some(Output::Committed { next, rows, .. })) => {
                // Read to that end, which a drain waits for.
                assert_eq!(reader.read_to().offset, next.offset);
                outputs.push(format!("commit {rows} at {}", next.offset))
            }
            Ok(other) => panic!("{other:?}"),
            Err(e) => break e,
        }
    };
    assert_eq!(outputs, ["row 1", "commit 1 at 1350"]);
    assert!(
        matches!(&stopped, BinlogError::Config(reason) if reason.contains("XA PREPARE")),
        "{stopped}"
    );
}

/// An incident event says the server lost events at that place (`LOST_EVENTS`): a replica
/// stops there, and so does the reader, before the transactions after it.
#[tokio::test]
async fn an_incident_event_stops_the_reader_before_what_follows() {
    // Its body: the incident's type (1, LOST_EVENTS, 2 bytes) and a message of length 0.
    let incident = event(26, 1150, &[1, 0, 0]);
    let mut reader = reader_of(
        vec![
            gtid(1, 1100),
            incident,
            gtid(2, 1200),
            table_map(1250),
            write_rows(&[(1, "a")], 1300),
            xid(1350),
        ],
        None,
    );
    let stopped = reader.next().await;
    assert!(
        matches!(&stopped, Err(e @ BinlogError::Incident { .. }) if e.to_string().contains("incident")),
        "nothing read past the incident: {stopped:?}"
    );
}

/// The artificial rotate a session from a GTID starts with, naming `file`, with or
/// without a CRC32 of itself at its end.
fn artificial_rotate(file: &str, checksummed: bool) -> Vec<u8> {
    const ROTATE_EVENT: u8 = 4;
    let mut body = 4u64.to_le_bytes().to_vec();
    body.extend(file.as_bytes());
    if !checksummed {
        return event(ROTATE_EVENT, 0, &body);
    }
    body.extend([0; 4]);
    let mut bytes = event(ROTATE_EVENT, 0, &body);
    let covered = bytes.len() - 4;
    let sum = crc32fast::hash(&bytes[..covered]);
    bytes[covered..].copy_from_slice(&sum.to_le_bytes());
    bytes
}

/// MySQL sends the first rotate without a checksum to a reader that set
/// `@master_binlog_checksum = 'ALL'` (mysql_async does), though its log has them; MariaDB
/// sends it with one. Cut by the log's setting, the file read `binlog.00` on MySQL, and
/// every position stored until the next rotation named a file the server does not have.
#[tokio::test]
async fn the_first_rotate_names_the_file_with_or_without_a_checksum() {
    for checksummed in [false, true] {
        let mut reader = reader_of(vec![artificial_rotate("binlog.000012", checksummed)], None);
        reader.file = String::new();
        assert!(read_all(&mut reader).await.is_empty());
        assert_eq!(reader.file, "binlog.000012", "checksummed: {checksummed}");
    }
}

/// A transaction that also changed a non-transactional table is logged with its
/// `ROLLBACK TO` a savepoint as a query after the rows it undid (both servers, MariaDB's
/// checked by hand): the undone rows went out as events of changes that never happened.
/// Rows after a savepoint wait for the transaction's end; a `ROLLBACK TO` drops those read
/// since its savepoint (and the savepoints set after it); rows before the first savepoint go
/// out as read.
#[tokio::test]
async fn rows_undone_by_a_rollback_to_a_savepoint_are_not_relayed() {
    let mut reader = reader_of(
        vec![
            gtid(41, 1050),
            begin(1100),
            table_map(1150),
            write_rows(&[(1, "before")], 1200),
            query("SAVEPOINT `a`", 1250),
            table_map(1300),
            write_rows(&[(2, "kept")], 1350),
            query("SAVEPOINT `b`", 1400),
            table_map(1450),
            write_rows(&[(3, "undone")], 1500),
            query("SAVEPOINT `c`", 1550),
            table_map(1600),
            write_rows(&[(4, "undone")], 1650),
            query("ROLLBACK TO `b`", 1700),
            table_map(1750),
            write_rows(&[(5, "after")], 1800),
            // `c` went with what `b`'s rollback undid: nothing more to undo.
            query("ROLLBACK TO `c`", 1850),
            xid(1900),
            // A transaction whose every row was undone: no commit to relay.
            gtid(42, 1950),
            begin(2000),
            query("SAVEPOINT `s`", 2050),
            table_map(2100),
            write_rows(&[(6, "undone")], 2150),
            query("ROLLBACK TO SAVEPOINT `s`", 2200),
            xid(2250),
        ],
        Some(&format!("{SOURCE}:1-40")),
    );
    assert_eq!(
        read_all(&mut reader).await,
        [
            "row 1 before".to_string(),
            "row 2 kept".into(),
            "row 5 after".into(),
            format!("commit 3 at 1900 gtid {SOURCE}:41"),
        ]
    );
    assert_eq!(reader.boundary().unwrap().offset, 2250);
}

/// The servers look a savepoint up by its name without regard to case, and log each
/// statement with the name as it was typed: `SAVEPOINT A` moves `a`, and `ROLLBACK TO a`
/// undoes only what followed `A`.
#[tokio::test]
async fn savepoint_names_differing_only_in_case_are_one_savepoint() {
    let mut reader = reader_of(
        vec![
            gtid(41, 1050),
            begin(1100),
            query("SAVEPOINT `a`", 1150),
            table_map(1200),
            write_rows(&[(1, "kept")], 1250),
            query("SAVEPOINT `A`", 1300),
            table_map(1350),
            write_rows(&[(2, "undone")], 1400),
            query("ROLLBACK TO `a`", 1450),
            query("SAVEPOINT `S`", 1500),
            table_map(1550),
            write_rows(&[(3, "undone")], 1600),
            query("ROLLBACK TO `s`", 1650),
            xid(1700),
        ],
        Some(&format!("{SOURCE}:1-40")),
    );
    assert_eq!(
        read_all(&mut reader).await,
        [
            "row 1 kept".to_string(),
            format!("commit 1 at 1700 gtid {SOURCE}:41"),
        ]
    );
}

/// A row event whose image has no columns (bytes no server writes) is a decoding error,
/// not a loop that reads nothing from its rows forever.
#[tokio::test]
async fn a_row_event_with_no_columns_in_its_image_stops_the_reader() {
    let mut rows = write_rows(&[(1, "a")], 1250);
    // The columns-present bitmap: after the 19-byte header, the table id (6), flags (2),
    // extra data (2) and the column count (1).
    assert_eq!(rows[30], 0b11);
    rows[30] = 0;
    let mut reader = reader_of(
        vec![
            gtid(41, 1050),
            begin(1100),
            table_map(1200),
            rows,
            xid(1300),
        ],
        Some(&format!("{SOURCE}:1-40")),
    );
    let error = loop {
        match reader.next().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the reader ended without an error"),
            Err(e) => break e.to_string(),
        }
    };
    assert!(error.contains("no columns"), "{error}");
}

/// What a transaction holds to its end (an XA transaction's rows, a savepoint's) is
/// bounded by its rows' bytes as well as their count: ten thousand rows of a megabyte were
/// ten gigabytes.
#[test]
fn rows_held_to_a_transactions_end_are_too_many_past_their_bytes_or_their_count() {
    let row = |bytes: usize| {
        Output::Row(Row {
            columns: Arc::new(vec!["payload".into()]),
            values: vec![Some("x".repeat(bytes))],
            unknown: Vec::new(),
            ordinal: 1,
            logged_at: None,
        })
    };
    let mut held = HeldRows::default();
    held.extend([row(BYTES_HELD / 2), row(BYTES_HELD / 2)]);
    assert!(!held.too_many());
    held.extend([row(1)]);
    assert!(held.too_many());
    assert_eq!(held.truncate(1), 2);
    assert_eq!(held.bytes, BYTES_HELD / 2);
    let mut small = HeldRows::default();
    small.extend((0..ROWS_HELD).map(|_| row(1)));
    assert!(!small.too_many());
    small.extend([row(1)]);
    assert!(small.too_many());
}

#[test]
fn savepoint_statements_are_read_as_the_servers_log_them() {
    assert_eq!(
        savepoint_query(b"SAVEPOINT `s`"),
        Some(SavepointQuery::Set(b"`s`"))
    );
    assert_eq!(
        savepoint_query(b"ROLLBACK TO `s`"),
        Some(SavepointQuery::RollbackTo(b"`s`"))
    );
    assert_eq!(
        savepoint_query(b"ROLLBACK TO SAVEPOINT `s`"),
        Some(SavepointQuery::RollbackTo(b"`s`"))
    );
    assert_eq!(savepoint_query(b"ROLLBACK"), None);
    assert_eq!(savepoint_query(b"COMMIT"), None);
}
