//! The reader of the binary log: the outbox table's inserted rows, decoded from the row
//! events themselves, handed out per committed transaction in commit order.
//!
//! Contract of [`BinlogReader`]:
//! - [`next`](BinlogReader::next) yields the outbox table's inserted rows of each committed
//!   transaction, in commit order, each transaction that inserted any closed by
//!   [`Output::Committed`] with the position after it: the position to resume from once
//!   every row before it is settled.
//! - Rows of other tables, updates and deletes are not events and are passed by.
//! - A rotated log (`FLUSH BINARY LOGS`, a size limit) is followed into the next file.
//! - A MySQL 8 compressed transaction is read event by event; one that cannot be read stops
//!   the reader, as does a MariaDB compressed event: nothing is passed over unread.
//! - The GTID state at every place read is kept, so each position names its place on any
//!   server of the replication topology ([`gtid`]).

use std::collections::HashMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use mysql_async::binlog::events::{
    Event, EventData, RowsEventData, TableMapEvent, TransactionPayloadEvent,
};
use mysql_async::binlog::events::{OptionalMetaExtractor, OptionalMetadataField};
use mysql_async::binlog::value::BinlogValue;
use mysql_async::consts::ColumnType;
use mysql_async::prelude::Queryable;
use mysql_async::{BinlogStreamRequest, Conn, Sid, Value};
use mysql_common::binlog::consts::TransactionPayloadCompressionType;
use mysql_common::io::ParseBuf;

use crate::{
    gtid, opts, statement, BinlogConfig, BinlogError, BinlogPosition, Result, FATAL_READING_BINLOG,
};

#[cfg(test)]
mod mysql8;

/// One inserted row, by column name, as text (`None` for NULL).
#[derive(Clone, Debug)]
pub struct Row {
    pub(crate) columns: Arc<Vec<String>>,
    pub(crate) values: Vec<Option<String>>,
    /// The columns whose value is unknown (left out of the row image, or unreadable), each
    /// with why: their value reads as `None`, which is not NULL.
    pub(crate) unknown: Vec<(usize, String)>,
    pub(crate) ordinal: u64,
    /// When the server logged its transaction (the event header's timestamp, in seconds).
    pub(crate) logged_at: Option<u32>,
}

impl Row {
    /// The row's number in what this reader has read, from 1: the id [`crate::Positions`] settles
    /// it by (a BLACKHOLE row has no id of its own).
    pub fn ordinal(&self) -> u64 {
        self.ordinal
    }

    /// The value of `column`; `None` when NULL or not a column of the table.
    pub fn get(&self, column: &str) -> Option<&str> {
        let index = self.columns.iter().position(|c| c == column)?;
        self.values.get(index)?.as_deref()
    }

    /// When the server logged the row's transaction, to the second; `None` if the event
    /// carried no time.
    pub fn logged_at(&self) -> Option<std::time::SystemTime> {
        self.logged_at.map(seconds_since_the_epoch)
    }

    /// Why a value of the row is unknown (the first such column's reason), if one is.
    pub fn undecodable(&self) -> Option<&str> {
        self.unknown.first().map(|(_, why)| why.as_str())
    }

    /// Why the value of `column` is unknown (it then reads as `None`): a row whose needed
    /// column is unknown is dead-lettered with the reason, and the others go on.
    pub fn unknown(&self, column: &str) -> Option<&str> {
        let index = self.columns.iter().position(|c| c == column)?;
        self.unknown
            .iter()
            .find(|(i, _)| *i == index)
            .map(|(_, why)| why.as_str())
    }
}

/// What the stream carries.
#[derive(Clone, Debug)]
pub enum Output {
    /// A row a committed transaction inserted into the outbox table.
    Row(Row),
    /// The end of a transaction that inserted `rows` rows: `next` is where the log goes on,
    /// and `gtid` the transaction's global id where the server gives one (MariaDB
    /// `domain-server-sequence`, MySQL `source_uuid:number`).
    Committed {
        next: BinlogPosition,
        rows: u64,
        gtid: Option<String>,
    },
    /// The end of a transaction that was rolled back: its `rows` rows, handed out already,
    /// never happened; `next` is where the log goes on. Only a non-transactional table's
    /// rows reach the log this way (MySQL logs what a rolled-back transaction could not undo
    /// in a BLACKHOLE outbox, then ROLLBACK; MariaDB 10.11 leaves such rows out).
    RolledBack { next: BinlogPosition, rows: u64 },
}

/// Where a reader's events come from: the server's stream, or in tests events written
/// here. The contract is mysql_async's stream's: it keeps the table maps of the events
/// handed out, and hands out the events inside a MySQL 8 compressed transaction right after
/// the transaction's payload event.
/// Whether an event read before the log's format description ends with the CRC32 of the
/// rest of it. The artificial rotate a session from a GTID starts with names the file, and
/// comes before the format description says whether the log's events carry a checksum, so
/// its name is read with whatever follows it; the servers differ on whether a checksum
/// does. MariaDB adds one whenever the log has them; MySQL adds none when the reader's
/// `@master_binlog_checksum` is not an algorithm's name (mysql_async sets `'ALL'`), and
/// taking the log's setting for the rotate's cut four characters off the file's name: every
/// position stored until the next rotation named a file that does not exist, and the next
/// start was refused as purged. The bytes say which: a name whose last four bytes happen
/// to be the CRC32 of the rest (one in 2^32) would be cut, and refused the same way at the
/// next start, never skipped past.
fn ends_with_its_checksum(event: &Event) -> bool {
    let mut raw = Vec::new();
    if event
        .write(
            mysql_common::binlog::consts::BinlogVersion::Version4,
            &mut raw,
        )
        .is_err()
    {
        return false;
    }
    let Some(split) = raw.len().checked_sub(4) else {
        return false;
    };
    let (covered, sum) = raw.split_at(split);
    <[u8; 4]>::try_from(sum).is_ok_and(|sum| crc32fast::hash(covered) == u32::from_le_bytes(sum))
}

/// The savepoints of a transaction, and its outbox rows read since the first. A server logs
/// a `ROLLBACK TO` a savepoint as a query after the rows it undid, instead of leaving them
/// out, when the transaction also changed a non-transactional table (MyISAM, MEMORY): read
/// as they came, those rows went out, events of changes that never happened. So the rows
/// that follow a savepoint wait for the transaction's end, and a `ROLLBACK TO` drops those
/// read since its savepoint.
#[derive(Debug, Default)]
struct Savepoints {
    /// Each savepoint's name (as logged), and how many of `rows` were read before it.
    marks: Vec<(Vec<u8>, usize)>,
    held: HeldRows,
    /// More than [`ROWS_HELD`] rows or [`BYTES_HELD`] bytes came: the rest of the
    /// transaction's rows go out as read.
    overflowed: bool,
}

/// Outbox rows a transaction holds until its end says what they are, and the bytes of
/// their values.
#[derive(Debug, Default)]
struct HeldRows {
    rows: Vec<Output>,
    bytes: usize,
}

impl HeldRows {
    fn extend(&mut self, rows: impl IntoIterator<Item = Output>) {
        for row in rows {
            self.bytes += output_bytes(&row);
            self.rows.push(row);
        }
    }

    /// Keeps the first `kept` rows; returns how many went.
    fn truncate(&mut self, kept: usize) -> usize {
        let undone = self.rows.split_off(kept);
        self.bytes -= undone.iter().map(output_bytes).sum::<usize>();
        undone.len()
    }

    /// Whether they are more than a transaction's rows are held to: [`ROWS_HELD`] rows or
    /// [`BYTES_HELD`] bytes.
    fn too_many(&self) -> bool {
        self.rows.len() > ROWS_HELD || self.bytes > BYTES_HELD
    }
}

/// The most outbox rows (and bytes of their values) a transaction's savepoints, or an XA
/// transaction, hold until its end. Past them, a savepoint's rows go out as read (said
/// once, with what a later `ROLLBACK TO` would mean), and an XA transaction stops the
/// reader (its rows may be only prepared).
const ROWS_HELD: usize = 10_000;
const BYTES_HELD: usize = 64 * 1024 * 1024;

/// A savepoint statement as the server logs it in a transaction.
#[derive(Debug, PartialEq, Eq)]
enum SavepointQuery<'a> {
    Set(&'a [u8]),
    RollbackTo(&'a [u8]),
}

/// Whether two savepoint names, as logged, name one savepoint: the servers look names up
/// without regard to case (in their system character set, utf8), and log each statement
/// with the name as its statement typed it (`SAVEPOINT A` moves `a`).
fn same_savepoint(a: &[u8], b: &[u8]) -> bool {
    match (std::str::from_utf8(a), std::str::from_utf8(b)) {
        (Ok(a), Ok(b)) => a.to_lowercase() == b.to_lowercase(),
        _ => a.eq_ignore_ascii_case(b),
    }
}

fn savepoint_query(query: &[u8]) -> Option<SavepointQuery<'_>> {
    if let Some(rest) = query.strip_prefix(b"SAVEPOINT ") {
        return Some(SavepointQuery::Set(rest.trim_ascii()));
    }
    let rest = query.strip_prefix(b"ROLLBACK TO ")?;
    let name = rest.strip_prefix(b"SAVEPOINT ").unwrap_or(rest);
    Some(SavepointQuery::RollbackTo(name.trim_ascii()))
}

/// The bytes of a row's values.
fn output_bytes(output: &Output) -> usize {
    match output {
        Output::Row(row) => row.values.iter().flatten().map(String::len).sum(),
        _ => 0,
    }
}

trait EventSource: Send {
    fn next_event(&mut self) -> BoxFuture<'_, Option<mysql_async::Result<Event>>>;
    fn table_map(&self, table_id: u64) -> Option<&TableMapEvent<'static>>;
}

impl EventSource for mysql_async::BinlogStream {
    fn next_event(&mut self) -> BoxFuture<'_, Option<mysql_async::Result<Event>>> {
        self.next().boxed()
    }

    fn table_map(&self, table_id: u64) -> Option<&TableMapEvent<'static>> {
        self.get_tme(table_id)
    }
}

/// A MySQL 8 compressed transaction (`binlog_transaction_compression`) being read: its
/// events come after its payload event, and the log's places are the payload's.
#[derive(Debug)]
struct Payload {
    /// The end of the payload event: the end of every event inside it.
    end: u64,
    /// Bytes of its events not handed out yet.
    left: u64,
}

/// The bytes of the events inside a transaction payload, read through to prove that they
/// decompress (mysql_async hands out none of them when they do not, without a word) and
/// that their headers' sizes tile them exactly (mysql_common panics on an event longer than
/// what is left; the reader stops at this payload instead, before the stream reads on).
/// Read as a stream, a chunk at a time: mysql_async holds the whole transaction
/// decompressed already, and a second copy doubled what a large one cost.
fn payload_events_size(payload: &TransactionPayloadEvent<'_>) -> std::io::Result<u64> {
    let mut events = payload.decompressed()?;
    let mut tiles = EventTiles::default();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let n = std::io::Read::read(&mut events, &mut chunk)?;
        if n == 0 {
            break;
        }
        tiles.read(&chunk[..n])?;
    }
    let size = tiles.end()?;
    let compressed = payload.algorithm() != TransactionPayloadCompressionType::NONE;
    if compressed && size != payload.uncompressed_size() {
        return Err(std::io::Error::other(format!(
            "it decompresses to {size} bytes, and says {}",
            payload.uncompressed_size()
        )));
    }
    Ok(size)
}

/// Events read a chunk at a time, each header's size saying where the next begins.
#[derive(Default)]
struct EventTiles {
    /// Bytes read so far.
    read: u64,
    /// Where the event being read began, and its header's first bytes while they come.
    event_at: u64,
    header: Vec<u8>,
    /// Where the next event begins, once the header said.
    next_at: Option<u64>,
}

impl EventTiles {
    /// Each event's header: timestamp (4), type (1), server id (4), then its size (4).
    const SIZE_END: usize = 13;

    fn read(&mut self, mut bytes: &[u8]) -> std::io::Result<()> {
        while !bytes.is_empty() {
            match self.next_at {
                // Within an event's body: skip to its end.
                Some(next) => {
                    let skip = usize::try_from(next - self.read)
                        .unwrap_or(usize::MAX)
                        .min(bytes.len());
                    bytes = &bytes[skip..];
                    self.read += skip as u64;
                    if self.read == next {
                        self.event_at = next;
                        self.next_at = None;
                        self.header.clear();
                    }
                }
                None => {
                    let take = (Self::SIZE_END - self.header.len()).min(bytes.len());
                    self.header.extend_from_slice(&bytes[..take]);
                    bytes = &bytes[take..];
                    self.read += take as u64;
                    if self.header.len() == Self::SIZE_END {
                        let h = &self.header[9..13];
                        let size = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
                        if size < EVENT_HEADER_LEN {
                            return Err(self.broken());
                        }
                        self.next_at = Some(self.event_at + size as u64);
                    }
                }
            }
        }
        Ok(())
    }

    /// The bytes read, once every event ended where the last read did.
    fn end(&self) -> std::io::Result<u64> {
        match (self.next_at, self.header.is_empty()) {
            (None, true) => Ok(self.read),
            _ => Err(self.broken()),
        }
    }

    fn broken(&self) -> std::io::Error {
        std::io::Error::other(format!(
            "its event at byte {} has a broken size",
            self.event_at
        ))
    }
}

/// The columns of `table_map` of a type the reader cannot read, for an error that names
/// them with the way out. MariaDB logs a `COMPRESSED` column as types 140 and 141, which
/// mysql_common does not know; past one, no later column's metadata can be found either.
fn unknown_column_types(table_map: &TableMapEvent<'_>) -> String {
    let count = usize::try_from(table_map.columns_count()).unwrap_or(0);
    let unknown: Vec<String> = (0..count)
        .filter_map(|i| match table_map.get_raw_column_type(i) {
            Err(e) => Some(format!("column {i}: type {}", e.0)),
            Ok(_) => None,
        })
        .collect();
    if unknown.is_empty() {
        return "no column is of an unknown type: the table map is malformed".into();
    }
    format!(
        "{}; MariaDB logs a COMPRESSED column so: ALTER TABLE … MODIFY the column without \
         COMPRESSED, or relay this outbox by polling (`--capture poll`)",
        unknown.join(", ")
    )
}

/// A binary log event's common header.
const EVENT_HEADER_LEN: usize = 19;

/// The largest event the reader takes: the server's own ceiling for `max_allowed_packet`.
const MAX_EVENT_BYTES: usize = outbox_store_mysql::LARGEST_PACKET;

/// An event header's timestamp as a time.
fn seconds_since_the_epoch(seconds: u32) -> std::time::SystemTime {
    std::time::UNIX_EPOCH + std::time::Duration::from_secs(u64::from(seconds))
}

/// Reads the outbox table's inserts from the binary log.
pub struct BinlogReader {
    stream: Box<dyn EventSource>,
    /// The compressed transaction whose events are being read, if one is.
    payload: Option<Payload>,
    /// The server's, to describe the table again after an `ALTER TABLE`.
    url: String,
    /// The table's database and name as the server stores them (what its table maps say).
    database: String,
    table: String,
    /// The table's columns in their order, as row events carry them.
    columns: Arc<Vec<String>>,
    /// What each column's value in the log needs to read as the table shows it.
    kinds: Vec<ColumnKind>,
    /// `kinds` as described, before a table map's logged character sets changed them:
    /// each table id's are applied to these, not to the last one's.
    described_kinds: Vec<ColumnKind>,
    /// Each column's `DATA_TYPE`, to compare with the types a table map logs.
    data_types: Vec<String>,
    /// The server's character set of each collation id, for the ones table maps log.
    collations: Arc<HashMap<u16, String>>,
    /// The outbox's table id whose table map was found to match the table as described:
    /// an `ALTER TABLE` gives the table a new id, whose map is compared again.
    matched_table_id: Option<u64>,
    /// The log file being read (row events' positions are within it); empty until the
    /// first rotate names it, when reading started from a GTID.
    file: String,
    /// Whether a format description was read: an artificial rotate after one moves to
    /// the next file.
    format_read: bool,
    /// The outbox rows of the XA transaction being read (its events began with `XA START`),
    /// held until its end says what they are: committed (MySQL's one-phase commit), or only
    /// prepared (`XA PREPARE`), which a later `XA COMMIT` or `XA ROLLBACK` decides.
    xa_rows: Option<HeldRows>,
    /// The savepoints of the transaction being read, and the outbox rows read since its
    /// first, held until its end ([`Savepoints`]).
    savepoints: Option<Savepoints>,
    /// Rows of the current transaction handed out so far.
    rows_in_transaction: u64,
    /// Rows read since the reader started.
    rows_read: u64,
    /// Rows of one row event not yet handed out.
    pending: std::collections::VecDeque<Output>,
    /// A row event of the outbox table in a layout other than the one described, and its
    /// end: kept while the table is described again, so a call cancelled meanwhile (`next`
    /// is cancel-safe) leaves it to be read by the next call, not passed by.
    altered: Option<(Event, usize, u64)>,
    /// Whether the server has sent an event: its error 1236 then says the log could not be
    /// read on (a crash mid-write, a checksum), not that the start position is gone.
    read_any: bool,
    /// Since when an output is asked for ([`BinlogReader::next`] called, its output not yet
    /// returned): silence before that is the caller's pause, not the server's.
    asked_at: Option<tokio::time::Instant>,
    /// When the server last sent anything, heartbeats included ([`BINLOG_SILENCE`]).
    heard_at: tokio::time::Instant,
    /// How long it waits in silence ([`BINLOG_SILENCE`] unless told otherwise).
    silence: std::time::Duration,
    /// Where reading started (a GTID start's file is empty), for an error that says so.
    started_at: BinlogPosition,
    /// The GTID state reading started after, if it did.
    started_after_gtid: Option<String>,
    /// The global id of the transaction being read, when the server gives one.
    gtid: Option<String>,
    /// The GTID state at what was read so far (each transaction's GTID is applied as its
    /// GTID event is read: only a transaction's end is ever stored); `None` where it is not
    /// known (GTIDs off, or a position stored without one).
    gtid_state: Option<gtid::GtidState>,
    /// The GTID state at `boundary`: the state moves on at each transaction's GTID event,
    /// before the transaction's end is read, so the boundary keeps its own.
    boundary_gtid: Option<String>,
    /// Whether `boundary` is a place read in the log: a reader started after a GTID knows
    /// its file only from the first rotate, and its offset from the first transaction's end.
    boundary_known: bool,
    /// The end of the last event read, in `file`.
    read_to: u64,
    /// The end of the last transaction read, of any table, in `file`: where a reader may
    /// start again (never inside a transaction, whose table maps would be missed).
    boundary: u64,
    /// The server's timestamp (its event header's, in seconds) of the last event of a
    /// transaction read: how far behind the reader reads.
    logged_at: Option<u32>,
    /// Whether the server sent a heartbeat since the last event: it had nothing more to send,
    /// so everything written is read.
    caught_up: bool,
    /// Whether the server is MariaDB (which never logs a rolled-back BLACKHOLE row).
    mariadb: bool,
}

/// Where a reader starts.
enum Start<'a> {
    Position(&'a BinlogPosition),
    /// After a GTID state, either family's ([`gtid::GtidState`]).
    AfterGtid(&'a gtid::GtidState),
}

/// MySQL's binary JSON as JSON text, the way MySQL itself prints it: a DECIMAL stays a
/// number (mysql_common's own conversion makes it a string, which would change the
/// payload's types), a date or time is a string.
fn json_text(dom: mysql_async::binlog::jsonb::JsonDom, out: &mut String) {
    use mysql_async::binlog::jsonb::{JsonContainer, JsonDom, JsonNumber, JsonScalar};
    match dom {
        JsonDom::Container(JsonContainer::Array(items)) => {
            out.push('[');
            for (i, item) in items.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                json_text(item, out);
            }
            out.push(']');
        }
        JsonDom::Container(JsonContainer::Object(members)) => {
            out.push('{');
            for (i, (key, value)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&serde_json::Value::String(key).to_string());
                out.push(':');
                json_text(value, out);
            }
            out.push('}');
        }
        JsonDom::Scalar(JsonScalar::Number(JsonNumber::Decimal(decimal))) => {
            out.push_str(&decimal.to_string());
        }
        JsonDom::Scalar(scalar) => out.push_str(&serde_json::Value::from(scalar).to_string()),
    }
}

/// MariaDB's compressed query and row events (`log_bin_compress`): 165 to 171.
const MARIADB_COMPRESSED_EVENTS: std::ops::RangeInclusive<u8> = 0xa5..=0xab;

/// MySQL 8's compressed transaction (`TRANSACTION_PAYLOAD_EVENT`).
const TRANSACTION_PAYLOAD_EVENT: u8 = 40;

/// The end of an XA transaction's first phase (`XA_PREPARE_LOG_EVENT`, MySQL and MariaDB).
const XA_PREPARE_LOG_EVENT: u8 = 38;

/// An incident: events the server could not write are missing here (MySQL and MariaDB).
const INCIDENT_EVENT: u8 = 26;

/// A heartbeat: the server is quiet, and says so (MariaDB's and MySQL's, and MySQL 8's
/// second form).
const HEARTBEAT_EVENTS: [u8; 2] = [27, 41];

/// The events of a transaction, whose header's timestamp is when it was logged: queries
/// (BEGIN, COMMIT, DDL), XIDs, table maps, rows (v1 and v2), GTIDs (MySQL's, anonymous and
/// MariaDB's), XA PREPARE and MariaDB's annotations.
const TRANSACTION_EVENTS: [u8; 15] = [2, 16, 19, 23, 24, 25, 30, 31, 32, 33, 34, 38, 160, 162, 40];

/// How often a quiet server sends the reader a heartbeat (`@master_heartbeat_period`).
pub const BINLOG_HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(2);

/// How long the reader waits with nothing from the server, not even a heartbeat, before it
/// takes the connection for dead: on a dump only the server speaks, so a connection a NAT
/// or proxy dropped silently would otherwise be waited on for good.
pub const BINLOG_SILENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// MariaDB's GTID event (`GTID_EVENT`, 162), which mysql_common does not decode: its body
/// starts with the sequence number (8 bytes) and the domain id (4 bytes), little-endian; the
/// server id is the event header's.
const MARIADB_GTID_EVENT: u8 = 0xa2;

/// MariaDB's GTID in its text form, from a GTID event's body; `None` when too short.
fn mariadb_gtid(body: &[u8], server_id: u32) -> Option<String> {
    let sequence = u64::from_le_bytes(body.get(..8)?.try_into().ok()?);
    let domain = u32::from_le_bytes(body.get(8..12)?.try_into().ok()?);
    Some(format!("{domain}-{server_id}-{sequence}"))
}

/// Whether a MariaDB GTID event begins an XA transaction's first phase (its events up to
/// `XA PREPARE`): the flag `FL_PREPARED_XA` in the byte after the domain id.
fn mariadb_prepared_xa(body: &[u8]) -> bool {
    const FL_PREPARED_XA: u8 = 64;
    body.get(12)
        .is_some_and(|flags| flags & FL_PREPARED_XA != 0)
}

/// The GTID state at the file and offset a reader starts at. The server says it for its own
/// file and offset (`said`: MariaDB's `BINLOG_GTID_POS`; `None` from MySQL, which has no
/// such function, or for a place the server does not know): the state stored beside the
/// position is only the fallback, since a relay of an earlier version moved the position
/// without it. An empty answer is a known state, that of a server that wrote no GTID before
/// the place: the first GTID read fills it. Taken for unknown, it left every position of the
/// session stored without a state, and a failover refused.
///
/// The state stored with a position is the server's at that place (a boundary carries the
/// state of its own place, `a_boundary_carries_the_gtid_state_of_its_own_place_in_the_log`).
/// When the server now says another, the log at that file and offset is not the one the
/// relay read: it was reset (`RESET MASTER`, which also starts the sequences again), or the
/// server was rebuilt or restored with the same `server_id`, and new files of the same
/// names reached the offset. Reading from there read another history's events and skipped
/// the rest: refused, as a purged position is.
/// The GTID state the server says it has at `at` in its log (MariaDB's `BINLOG_GTID_POS`);
/// `None` from MySQL, which has no such function, or for a place the server does not know.
pub(crate) async fn gtid_state_said_at(conn: &mut Conn, at: &BinlogPosition) -> Option<String> {
    conn.exec_first::<Option<String>, _, _>("SELECT BINLOG_GTID_POS(?, ?)", (&at.file, at.offset))
        .await
        .ok()
        .flatten()
        .flatten()
}

pub(crate) fn start_gtid_state(
    said: Option<String>,
    from: &BinlogPosition,
) -> Result<Option<gtid::GtidState>> {
    let said_state = said.as_deref().and_then(gtid::GtidState::parse);
    let stored_state = from.gtid.as_deref().and_then(gtid::GtidState::parse);
    match (said_state, stored_state) {
        (Some(said_state), Some(stored_state)) if said_state != stored_state => {
            Err(BinlogError::Purged {
                position: from.clone(),
                reason: format!(
                    "the server's log there follows GTID state {said_state}, not the \
                     {stored_state} the relay stored with the position: the log was reset \
                     (RESET MASTER), or the server was rebuilt or restored with the same \
                     server_id"
                ),
            })
        }
        (Some(state), _) | (None, Some(state)) => Ok(Some(state)),
        (None, None) => Ok(None),
    }
}

/// A MySQL GTID set as `COM_BINLOG_DUMP_GTID` names it: one entry per source.
fn dump_sources(state: &gtid::GtidState) -> Result<Vec<Sid<'static>>> {
    state
        .mysql_sources()
        .iter()
        .map(|source| source.parse::<Sid<'static>>())
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(|e| BinlogError::Config(format!("GTID set {state}: {e}")))
}

impl BinlogReader {
    /// Starts reading at `from` (a transaction's start: a position [`Output::Committed`]
    /// gave, or [`crate::current_position`]).
    pub async fn start(config: &BinlogConfig, from: &BinlogPosition) -> Result<Self> {
        Self::start_at(config, Start::Position(from)).await
    }

    /// Starts reading after the GTID state `gtid` ([`gtid::GtidState`]), on any server of
    /// the replication topology: the way to go on after a failover to a promoted replica,
    /// whose file names and offsets differ from the old primary's.
    /// - MariaDB's state (`domain-server-sequence`, one per replication domain): the server
    ///   sends what follows each domain's last GTID, and refuses a state its log does not
    ///   continue (strict mode). [`Output::Committed`] gives one transaction's GTID, which is
    ///   the whole state only where the servers write one domain (the default).
    /// - MySQL's set (`uuid:1-100,…`): the server sends every transaction not in it
    ///   (`COM_BINLOG_DUMP_GTID`), and refuses when it purged some of them, or when the set
    ///   holds transactions it never had.
    ///
    /// Either way nothing is skipped.
    pub async fn start_after_gtid(config: &BinlogConfig, gtid: &str) -> Result<Self> {
        let state = gtid::GtidState::parse(gtid)
            .filter(|state| !state.is_empty())
            .ok_or_else(|| {
                BinlogError::Config(format!(
                    "{gtid:?} is not a GTID state to go on after (MariaDB's \
                     domain-server-sequence list, or MySQL's uuid:intervals set)"
                ))
            })?;
        Self::start_at(config, Start::AfterGtid(&state)).await
    }

    async fn start_at(config: &BinlogConfig, start: Start<'_>) -> Result<Self> {
        // A row event can outgrow the server's max_allowed_packet (lowered after the row was
        // written, or an image larger than its INSERT): the dump sends it whatever the
        // setting, and a client holding to the server's value would refuse it at every
        // reconnect. A replica reads with its own limit, 1 GiB at most, as this does.
        let opts = mysql_async::OptsBuilder::from_opts(opts(&config.url)?)
            .max_allowed_packet(Some(MAX_EVENT_BYTES));
        let mut conn = Conn::new(opts).await?;
        let format: Option<String> = conn.query_first("SELECT @@GLOBAL.binlog_format").await?;
        if format.as_deref() != Some("ROW") {
            return Err(BinlogError::Config(format!(
                "binlog_format is {}, and binlog capture reads rows: set binlog_format = ROW",
                format.as_deref().unwrap_or("unknown")
            )));
        }
        let layout = Layout::describe(&mut conn, &config.database, &config.table).await?;
        let mariadb = crate::is_mariadb(&mut conn).await?;
        // MariaDB sends its GTID events as they are to a replica that says it can read them
        // (otherwise it rewrites each as a BEGIN query). MySQL ignores the variable.
        conn.query_drop("SET @mariadb_slave_capability = 4").await?;
        // In nanoseconds, as a replica sets it (both servers).
        conn.query_drop(format!(
            "SET @master_heartbeat_period = {}",
            BINLOG_HEARTBEAT.as_nanos()
        ))
        .await?;
        // Registered under a name of its own: `check` tells this outbox's relay from
        // another reader under the same server id ([`crate::server_id_problems`]).
        let name = crate::registered_name(config);
        let request = BinlogStreamRequest::new(config.server_id).with_hostname(name.as_bytes());
        let (request, from) = match start {
            Start::Position(from) => (
                request
                    .with_filename(from.file.as_bytes())
                    .with_pos(from.offset),
                from.clone(),
            ),
            Start::AfterGtid(state) => {
                let request = match state.is_mysql() {
                    false => {
                        conn.exec_drop("SET @slave_connect_state = ?", (state.to_string(),))
                            .await?;
                        conn.query_drop("SET @slave_gtid_strict_mode = 1").await?;
                        request
                    }
                    true => request.with_gtid().with_gtid_set(dump_sources(state)?),
                };
                // The file is named by the first (artificial) rotate
                // ([`ends_with_its_checksum`]).
                let from = BinlogPosition {
                    file: String::new(),
                    offset: 4,
                    gtid: Some(state.to_string()),
                };
                (request.with_filename(b"").with_pos(4), from)
            }
        };
        let gtid_state = match start {
            Start::Position(from) => {
                start_gtid_state(gtid_state_said_at(&mut conn, from).await, from)?
            }
            Start::AfterGtid(state) => Some(state.clone()),
        };
        let stream = conn.get_binlog_stream(request).await?;
        let mut reader = BinlogReader::of(Box::new(stream), config, layout, from);
        reader.mariadb = mariadb;
        reader.gtid_state = gtid_state;
        reader.boundary_gtid = reader.gtid_state.as_ref().map(ToString::to_string);
        if let Start::AfterGtid(state) = start {
            reader.started_after_gtid = Some(state.to_string());
            reader.boundary_known = false;
        }
        Ok(reader)
    }

    /// A reader of `stream`, which starts at `from`, of the table `config` names, laid out
    /// as `layout` says.
    fn of(
        stream: Box<dyn EventSource>,
        config: &BinlogConfig,
        layout: Layout,
        from: BinlogPosition,
    ) -> Self {
        BinlogReader {
            stream,
            payload: None,
            url: config.url.clone(),
            database: layout.database,
            table: layout.table,
            columns: Arc::new(layout.columns),
            described_kinds: layout.kinds.clone(),
            kinds: layout.kinds,
            data_types: layout.data_types,
            collations: Arc::new(layout.collations),
            matched_table_id: None,
            file: from.file.clone(),
            format_read: false,
            xa_rows: None,
            savepoints: None,
            altered: None,
            read_any: false,
            asked_at: None,
            heard_at: tokio::time::Instant::now(),
            silence: BINLOG_SILENCE,
            rows_in_transaction: 0,
            rows_read: 0,
            pending: Default::default(),
            read_to: from.offset,
            boundary: from.offset,
            started_at: from,
            started_after_gtid: None,
            gtid: None,
            gtid_state: None,
            boundary_gtid: None,
            boundary_known: true,
            logged_at: None,
            caught_up: false,
            mariadb: false,
        }
    }

    /// Waits `silence` with nothing from the server before taking the connection for dead
    /// ([`BINLOG_SILENCE`] by default): an event arrives whole or not at all, and a large one
    /// over a slow link can take longer.
    pub fn set_silence(&mut self, silence: std::time::Duration) {
        self.silence = silence;
    }

    /// When the server logged the last event of a transaction read (its event header's
    /// timestamp); `None` before any.
    pub fn logged_at(&self) -> Option<std::time::SystemTime> {
        self.logged_at.map(seconds_since_the_epoch)
    }

    /// Whether the server said, by a heartbeat since the last event read, that it has
    /// nothing more to send: the reader has read everything written.
    pub fn caught_up(&self) -> bool {
        self.caught_up && self.pending.is_empty() && self.altered.is_none()
    }

    /// Whether the server is MariaDB.
    pub fn mariadb(&self) -> bool {
        self.mariadb
    }

    /// Outputs decoded and not yet handed out: at most one row event's rows (the server cuts
    /// a transaction's rows into events of `binlog_row_event_max_size`), however large the
    /// transaction, or the rows a transaction held behind savepoints (or an XA
    /// transaction's) with its commit, after its end was read.
    pub fn buffered_rows(&self) -> usize {
        self.pending.len()
    }

    /// Where the log has been read to: the end of the last event read, of whatever table
    /// (`run --drain` is done once it reaches the position current at its start).
    pub fn read_to(&self) -> BinlogPosition {
        self.at(self.read_to)
    }

    /// The end of the last transaction read, of any table: a position to resume from when
    /// nothing of the outbox is unsettled before it. `None` until a reader started after a
    /// GTID has read a transaction's end (its start is known only by the GTID).
    pub fn boundary(&self) -> Option<BinlogPosition> {
        self.boundary_known.then(|| BinlogPosition {
            gtid: self.boundary_gtid.clone(),
            ..self.at(self.boundary)
        })
    }

    /// The next output; `None` when the server ended the stream. Cancel-safe.
    pub async fn next(&mut self) -> Result<Option<Output>> {
        // A call cancelled before its output keeps counting from the first ask.
        self.asked_at.get_or_insert_with(tokio::time::Instant::now);
        let output = self.read_next().await;
        if let Ok(Some(_)) = output {
            self.asked_at = None;
        }
        output
    }

    async fn read_next(&mut self) -> Result<Option<Output>> {
        loop {
            if let Some(output) = self.pending.pop_front() {
                return Ok(Some(output));
            }
            if self.altered.is_some() {
                self.read_altered().await?;
                continue;
            }
            // Silence is counted while an output is asked for: until the caller asks again
            // (its channel or memory budget full, behind a slow sink) the server's events wait
            // unread, and the first one asked for then may not have fully arrived. Counted
            // from the last event heard, such a pause took a healthy connection for dead.
            let listening_since = self
                .asked_at
                .map_or(self.heard_at, |at| at.max(self.heard_at));
            let heard =
                tokio::time::timeout_at(listening_since + self.silence, self.stream.next_event())
                    .await;
            let Ok(event) = heard else {
                return Err(BinlogError::Silent(self.silence));
            };
            let Some(event) = event else {
                return Ok(None);
            };
            let event = match event {
                Ok(event) => {
                    self.read_any = true;
                    self.heard_at = tokio::time::Instant::now();
                    event
                }
                Err(mysql_async::Error::Server(e))
                    if e.code == FATAL_READING_BINLOG && self.read_any =>
                {
                    return Err(BinlogError::Decode(format!(
                        "the server stopped sending its binary log after {} offset {} ({}, \
                         error 1236): the relay reads it again from the stored position; if \
                         this repeats there, the log is damaged at that place (a crash while it \
                         was written, a checksum that fails): see the server's error log",
                        self.file, self.read_to, e.message
                    )));
                }
                Err(mysql_async::Error::Server(e)) if e.code == FATAL_READING_BINLOG => {
                    if let Some(gtid) = &self.started_after_gtid {
                        return Err(BinlogError::GtidNotInLog {
                            gtid: gtid.clone(),
                            reason: e.message,
                        });
                    }
                    return Err(BinlogError::Purged {
                        position: self.started_at.clone(),
                        reason: e.message,
                    });
                }
                Err(e) => return Err(e.into()),
            };
            // The events inside a compressed transaction end where its payload does.
            // Whether the log is read to the end of this event: not inside a compressed
            // transaction until its last event (a drain stops at what was read to).
            let mut whole = true;
            let end = match &mut self.payload {
                Some(payload) => {
                    let end = payload.end;
                    payload.left = payload
                        .left
                        .saturating_sub(u64::from(event.header().event_size()));
                    whole = payload.left == 0;
                    if whole {
                        self.payload = None;
                    }
                    end
                }
                None => u64::from(event.header().log_pos()),
            };
            if event.header().event_type_raw() == TRANSACTION_PAYLOAD_EVENT {
                whole = false;
            }
            let kind = event.header().event_type_raw();
            self.caught_up = HEARTBEAT_EVENTS.contains(&kind);
            // A transaction's events carry the time it was logged; a log file's own (its
            // format description, rotates, GTID lists) the file's, which may be old.
            if TRANSACTION_EVENTS.contains(&kind) && event.header().timestamp() != 0 {
                self.logged_at = Some(event.header().timestamp());
            }
            match kind {
                // Only to say the server is there: its position is not the reader's.
                kind if HEARTBEAT_EVENTS.contains(&kind) => continue,
                MARIADB_GTID_EVENT => {
                    // A transaction's first event: MariaDB marks an XA transaction's first
                    // phase in its flags (it logs no `XA START` query).
                    self.xa_rows = mariadb_prepared_xa(event.data()).then(HeldRows::default);
                    self.gtid = mariadb_gtid(event.data(), event.header().server_id());
                    if let (Some(state), Some(gtid)) = (&mut self.gtid_state, &self.gtid) {
                        state.advance(gtid);
                    }
                    continue;
                }
                // The server lost events here (`LOST_EVENTS`: a binary log write that failed
                // under binlog_error_action = IGNORE_ERROR, or a statement cache that
                // overflowed): a replica stops at it, and so does the reader.
                INCIDENT_EVENT => {
                    return Err(BinlogError::Incident {
                        at: format!("{} offset {end}", self.file),
                    });
                }
                // mysql_common reads none of them: their rows would pass unread.
                kind if MARIADB_COMPRESSED_EVENTS.contains(&kind) => {
                    return Err(BinlogError::CompressedEvent {
                        at: format!("{} offset {end}", self.file),
                    });
                }
                // MySQL logs `XA COMMIT … ONE PHASE` as this event with its first byte set:
                // the transaction's rows are committed.
                XA_PREPARE_LOG_EVENT if event.data().first() == Some(&1) => {
                    // Read to its end, as any transaction's end (a drain ends there).
                    if end != 0 && whole {
                        self.read_to = end;
                    }
                    self.pending
                        .extend(self.xa_rows.take().map(|xa| xa.rows).unwrap_or_default());
                    if self.rows_in_transaction > 0 {
                        let committed = self.committed(end);
                        self.pending.push_back(committed);
                    } else {
                        self.set_boundary(end);
                    }
                    continue;
                }
                XA_PREPARE_LOG_EVENT => {
                    if let Some(rows) =
                        (self.xa_rows.take().map(|xa| xa.rows)).filter(|rows| !rows.is_empty())
                    {
                        return Err(BinlogError::Config(format!(
                            "an XA transaction prepared at {} offset {end} wrote {} rows to \
                             the outbox: the binary log carries them at XA PREPARE, before \
                             XA COMMIT or XA ROLLBACK decides them, and binlog capture stops \
                             rather than relay rows that may be rolled back. Relay this \
                             outbox by polling (`--capture poll`, which claims committed \
                             rows only), or write its rows outside XA transactions (a \
                             one-phase commit, as a transaction manager makes of a single \
                             resource's transaction, is read as any other)",
                            self.file,
                            rows.len()
                        )));
                    }
                    // Another table's: a place a reader may start from.
                    self.rows_in_transaction = 0;
                    self.set_boundary(end);
                }
                _ => {}
            }
            if end != 0 && whole {
                self.read_to = end;
            }
            let data = event
                .read_data()
                .map_err(|e| BinlogError::Decode(e.to_string()))?;
            // Rows the writer's session logged as a statement (its binlog_format is not
            // ROW): no row event follows, and the transaction's end would be taken for
            // another table's, its rows passed by unread. A LOAD DATA so logged is a
            // Begin_load_query event (the file) and an Execute_load_query event (the
            // statement).
            let logged_insert = match &data {
                Some(EventData::QueryEvent(query)) => statement::logged_insert(
                    &query.query(),
                    &query.schema(),
                    &self.database,
                    &self.table,
                ),
                Some(EventData::ExecuteLoadQueryEvent(query)) => statement::logged_insert(
                    &query.query(),
                    &query.schema(),
                    &self.database,
                    &self.table,
                ),
                _ => None,
            };
            if let Some(statement) = logged_insert {
                return Err(BinlogError::StatementLogged {
                    at: format!("{} offset {end}", self.file),
                    table: format!("{}.{}", self.database, self.table),
                    statement,
                });
            }
            let mut altered_width = None;
            match data {
                // The rotate the server sends first, before the log's checksum setting
                // is known, is artificial (position 0) and names the file requested:
                // its name would carry the checksum's bytes.
                // A rotate at the end of a file, or an artificial one after a format
                // description: the server goes on in the next file. It sends only the
                // artificial one where the last file has no rotate at its end (it ended
                // with a stop event: the server was restarted), and this reader would
                // otherwise go on naming the old file with the new one's offsets.
                Some(EventData::RotateEvent(rotate)) if end != 0 || self.format_read => {
                    self.file = rotate.name().into_owned();
                    self.read_to = rotate.position();
                    self.set_boundary(rotate.position());
                }
                // Started from a GTID: the artificial rotate is the only word of the file.
                Some(EventData::RotateEvent(rotate)) if self.file.is_empty() => {
                    let name = rotate.name_raw();
                    let name = match ends_with_its_checksum(&event) {
                        true => &name[..name.len().saturating_sub(4)],
                        false => name,
                    };
                    self.file = String::from_utf8_lossy(name).into_owned();
                }
                // A transaction without a GTID (MySQL's gtid_mode OFF, or mixing them): no
                // set names the places after it, so none is stored from here on, and a
                // failover is refused rather than guessed.
                // A new file, maybe of a restarted server, whose table ids start again:
                // the outbox's is matched afresh, not taken for the one matched before.
                Some(EventData::FormatDescriptionEvent(_)) => {
                    self.format_read = true;
                    self.matched_table_id = None;
                }
                Some(EventData::AnonymousGtidEvent(_)) => {
                    self.xa_rows = None;
                    self.gtid = None;
                    self.gtid_state = None;
                }
                Some(EventData::GtidEvent(event)) => {
                    // A transaction's first event; MySQL's XA transactions go on with an
                    // `XA START` query.
                    self.xa_rows = None;
                    let source = uuid::Uuid::from_bytes(event.sid());
                    let gtid = match event.tag() {
                        Some(tag) => format!("{source}:{tag}:{}", event.gno()),
                        None => format!("{source}:{}", event.gno()),
                    };
                    // A state that cannot take it (one read as MariaDB's) is unknown now.
                    if self.gtid_state.as_mut().is_some_and(|s| !s.advance(&gtid)) {
                        self.gtid_state = None;
                    }
                    self.gtid = Some(gtid);
                }
                // The end of a transaction that inserted outbox rows: an XID for
                // transactional tables, a COMMIT query for the others (BLACKHOLE).
                Some(EventData::XidEvent(_)) if self.rows_in_transaction > 0 => {
                    return Ok(Some(self.committed(end)));
                }
                // Another table's transaction ended: a place a reader may start from.
                Some(EventData::XidEvent(_)) => self.set_boundary(end),
                Some(EventData::QueryEvent(query))
                    if query.query_raw().starts_with(b"XA START") =>
                {
                    self.xa_rows = Some(HeldRows::default());
                }
                Some(EventData::QueryEvent(query))
                    if self.xa_rows.is_none() && savepoint_query(query.query_raw()).is_some() =>
                {
                    self.savepoint(query.query_raw(), end);
                }
                // A transaction without outbox rows ended, or an XA transaction's second
                // phase (its rows were in its first, and refused there).
                Some(EventData::QueryEvent(query))
                    if self.rows_in_transaction == 0
                        && (matches!(query.query_raw(), b"COMMIT" | b"ROLLBACK")
                            || query.query_raw().starts_with(b"XA COMMIT")
                            || query.query_raw().starts_with(b"XA ROLLBACK")) =>
                {
                    self.xa_rows = None;
                    self.set_boundary(end);
                }
                Some(EventData::QueryEvent(query)) if self.rows_in_transaction > 0 => {
                    match query.query_raw() {
                        b"COMMIT" => return Ok(Some(self.committed(end))),
                        b"ROLLBACK" => {
                            self.gtid = None;
                            // Rows held behind savepoints never went out.
                            let held =
                                (self.savepoints.take()).map_or(0, |s| s.held.rows.len() as u64);
                            let rows = std::mem::take(&mut self.rows_in_transaction);
                            return Ok(Some(Output::RolledBack {
                                next: self.at(end),
                                rows: rows - held,
                            }));
                        }
                        _ => {}
                    }
                }
                Some(EventData::RowsEvent(rows)) => match self.take_rows(&rows) {
                    Err(BinlogError::LayoutChanged { width }) => altered_width = Some(width),
                    taken => {
                        taken?;
                        self.hold_read_rows(end)?;
                    }
                },
                // A compressed transaction: its events come next, each read as any other.
                Some(EventData::TransactionPayloadEvent(payload)) => {
                    let left = payload_events_size(&payload).map_err(|e| {
                        BinlogError::Decode(format!(
                            "the compressed transaction at {} offset {end} cannot be read \
                             ({e}), and the relay stops rather than skip its rows",
                            self.file
                        ))
                    })?;
                    self.payload = (left > 0).then_some(Payload { end, left });
                }
                _ => {}
            }
            if let Some(width) = altered_width {
                self.altered = Some((event, width, end));
            }
        }
    }

    /// The outbox's row event of another layout ([`BinlogReader::altered`]): the table is
    /// described again, then the event read with its new columns. Cancelled while the table
    /// is described, the event stays for the next call.
    async fn read_altered(&mut self) -> Result<()> {
        let Some((_, width, end)) = &self.altered else {
            return Ok(());
        };
        let (width, end) = (*width, *end);
        let table_id = match self.altered.as_ref().map(|(event, ..)| event.read_data()) {
            Some(Ok(Some(EventData::RowsEvent(rows)))) => rows.table_id(),
            Some(Err(e)) => return Err(BinlogError::Decode(e.to_string())),
            _ => {
                return Err(BinlogError::Decode(
                    "an altered row event is not one".into(),
                ))
            }
        };
        self.describe_again(width, end, table_id).await?;
        let Some((event, _, _)) = self.altered.take() else {
            return Ok(());
        };
        if let Some(EventData::RowsEvent(rows)) = event
            .read_data()
            .map_err(|e| BinlogError::Decode(e.to_string()))?
        {
            self.take_rows(&rows)?;
        }
        self.hold_read_rows(end)
    }

    /// The rows just read wait for their transaction's end where it may still undo them: an
    /// XA transaction's, and those after a savepoint. Every row event passes here, whichever
    /// way it was read.
    fn hold_read_rows(&mut self, end: u64) -> Result<()> {
        self.hold_xa_rows(end)?;
        self.hold_savepoint_rows(end);
        Ok(())
    }

    /// Inside an XA transaction, the rows just read are held until its end says whether
    /// they are committed.
    fn hold_xa_rows(&mut self, end: u64) -> Result<()> {
        if let Some(held) = &mut self.xa_rows {
            held.extend(self.pending.drain(..));
            if held.too_many() {
                return Err(BinlogError::Config(format!(
                    "an XA transaction at {} offset {end} wrote more than {ROWS_HELD} rows or \
                     {} MiB to the outbox before its end, which binlog capture holds to learn \
                     whether they are committed; relay this outbox by polling \
                     (`--capture poll`), or write its rows outside XA transactions",
                    self.file,
                    BYTES_HELD >> 20
                )));
            }
        }
        Ok(())
    }

    /// A savepoint statement of the transaction being read ([`Savepoints`]).
    fn savepoint(&mut self, query: &[u8], end: u64) {
        match savepoint_query(query) {
            Some(SavepointQuery::Set(name)) => {
                let savepoints = self.savepoints.get_or_insert_with(Savepoints::default);
                // A name set again moves: SQL keeps one savepoint of a name.
                savepoints.marks.retain(|(n, _)| !same_savepoint(n, name));
                let held = savepoints.held.rows.len();
                savepoints.marks.push((name.to_vec(), held));
            }
            Some(SavepointQuery::RollbackTo(name)) => {
                let found = self.savepoints.as_mut().and_then(|savepoints| {
                    let at =
                        (savepoints.marks.iter()).position(|(n, _)| same_savepoint(n, name))?;
                    Some((savepoints, at))
                });
                match found {
                    Some((savepoints, at)) if !savepoints.overflowed => {
                        let kept = savepoints.marks[at].1;
                        // Savepoints set after it are gone with what it undid.
                        savepoints.marks.truncate(at + 1);
                        let undone = savepoints.held.truncate(kept);
                        self.rows_in_transaction -= undone as u64;
                        tracing::debug!(
                            rows = undone,
                            "outbox rows undone by ROLLBACK TO a savepoint"
                        );
                    }
                    _ => tracing::error!(
                        at = %format!("{} offset {end}", self.file),
                        savepoint = %String::from_utf8_lossy(name),
                        "the server logged a ROLLBACK TO a savepoint whose outbox rows were \
                         handed out as read (its SAVEPOINT not read, or more rows after it than \
                         are held): they may have been delivered, events of changes that never \
                         happened"
                    ),
                }
            }
            None => {}
        }
    }

    /// Holds the rows just read while the transaction has savepoints ([`Savepoints`]).
    fn hold_savepoint_rows(&mut self, end: u64) {
        let Some(savepoints) = self.savepoints.as_mut().filter(|s| !s.overflowed) else {
            return;
        };
        savepoints.held.extend(self.pending.drain(..));
        if savepoints.held.too_many() {
            tracing::warn!(
                at = %format!("{} offset {end}", self.file),
                rows = savepoints.held.rows.len(),
                "a transaction wrote more outbox rows after a savepoint than the reader holds \
                 until its end: they go out as read, and a ROLLBACK TO that savepoint logged \
                 after them (only when the transaction changed a non-transactional table too) \
                 would not undo them"
            );
            savepoints.overflowed = true;
            self.pending
                .extend(std::mem::take(&mut savepoints.held).rows);
        }
    }

    /// A transaction (or a log file) ended at `end`: a place to start again from, with the
    /// GTID state there.
    fn set_boundary(&mut self, end: u64) {
        self.savepoints = None;
        self.boundary = end;
        self.boundary_gtid = self.gtid_state.as_ref().map(ToString::to_string);
        self.boundary_known = true;
    }

    /// The commit of the transaction being read, which ends at `end`.
    fn committed(&mut self, end: u64) -> Output {
        // Rows held behind savepoints are committed, and go out ahead of their commit.
        let held = (self.savepoints.take())
            .map(|s| s.held.rows)
            .unwrap_or_default();
        self.set_boundary(end);
        let committed = Output::Committed {
            next: self.at(end),
            rows: std::mem::take(&mut self.rows_in_transaction),
            gtid: self.gtid.take(),
        };
        let mut held: std::collections::VecDeque<Output> = held.into();
        match held.pop_front() {
            None => committed,
            Some(first) => {
                // Ahead of anything queued (nothing is, at a transaction's end).
                held.push_back(committed);
                held.append(&mut self.pending);
                self.pending = held;
                first
            }
        }
    }

    /// The position `offset` in the file being read.
    fn at(&self, offset: u64) -> BinlogPosition {
        BinlogPosition {
            file: self.file.clone(),
            offset,
            gtid: self.gtid_state.as_ref().map(ToString::to_string),
        }
    }

    /// The outbox table's inserted rows of one row event, queued in their order.
    fn take_rows(&mut self, rows: &RowsEventData<'_>) -> Result<()> {
        let insert = matches!(
            rows,
            RowsEventData::WriteRowsEvent(_) | RowsEventData::WriteRowsEventV1(_)
        );
        let Some(table_map) = self.stream.table_map(rows.table_id()) else {
            return Err(BinlogError::Decode(format!(
                "a row event of table id {} came without its table map",
                rows.table_id()
            )));
        };
        if !insert
            || table_map.database_name() != self.database.as_str()
            || table_map.table_name() != self.table.as_str()
        {
            return Ok(());
        }
        // Rows are decoded by column position: a row event of another width is of another
        // layout (an `ALTER TABLE` since the table was described), whose columns would be
        // read under the wrong names.
        let width = usize::try_from(rows.num_columns()).unwrap_or(usize::MAX);
        if width != self.columns.len() {
            return Err(BinlogError::LayoutChanged { width });
        }
        // As wide, and still altered since (a column's type changed, columns reordered):
        // the table map's types, and its column names where the server logs them
        // (binlog_row_metadata = FULL), must be the described table's. The first table id
        // read is taken for the table described at the start if they match; a later one
        // (the table opened again, after an `ALTER TABLE` among other things) has the table
        // described again: a character set converted shows in no table map without
        // binlog_row_metadata, and its rows would be read in the old one.
        match self.matched_table_id {
            Some(id) if id == rows.table_id() => {}
            None if layout_differs(table_map, &self.columns, &self.data_types).is_none() => {
                self.matched_table_id = Some(rows.table_id());
                self.kinds = kinds_for(table_map, &self.described_kinds, &self.collations);
            }
            _ => return Err(BinlogError::LayoutChanged { width }),
        }
        // Decoded here column by column from the event's bytes: mysql_common's own row
        // iterator builds a `Column`, names and all, for every column of every row, which
        // was most of a drain's allocations.
        let Some(present) = rows.columns_after_image() else {
            return Err(BinlogError::Decode(
                "an INSERT row event of the outbox table without its columns' bitmap".into(),
            ));
        };
        let broken =
            |what: String| BinlogError::Decode(format!("a row of the outbox table: {what}"));
        let null_bitmap_len = present.count_ones().div_ceil(8);
        let mut buf = ParseBuf(rows.rows_data());
        // Each row takes at least its NULL bitmap's byte, but for an image of no columns,
        // which no server writes for an INSERT: its rows could not be told apart.
        if null_bitmap_len == 0 && !buf.is_empty() {
            return Err(broken("its image has no columns".into()));
        }
        while !buf.is_empty() {
            let nulls: &[u8] = buf
                .parse(null_bitmap_len)
                .map_err(|e| broken(format!("its NULL bitmap: {e}")))?;
            let mut in_image = 0;
            let mut unknown = Vec::new();
            let mut values = Vec::with_capacity(width);
            for i in 0..width {
                if !present.get(i).is_some_and(|bit| *bit) {
                    // Not NULL: unknown. The writer's session logged only the columns its
                    // INSERT named (binlog_row_image = MINIMAL or NOBLOB for that session).
                    let column = self.columns.get(i).map_or("?", String::as_str);
                    unknown.push((
                        i,
                        format!(
                            "column {column} is not in the binary log's row image (the writing \
                             session's binlog_row_image is not FULL): set binlog_row_image = \
                             FULL for every session that writes the outbox"
                        ),
                    ));
                    values.push(None);
                    continue;
                }
                let null = nulls
                    .get(in_image / 8)
                    .is_none_or(|byte| byte >> (in_image % 8) & 1 == 1);
                in_image += 1;
                if null {
                    values.push(None);
                    continue;
                }
                let column_type = table_map.get_column_type(i).ok().flatten().ok_or_else(|| {
                    broken(format!(
                        "column {i} is of a type binlog capture does not know ({})",
                        unknown_column_types(table_map)
                    ))
                })?;
                // mysql_common indexes a type's metadata unchecked: none (an earlier
                // column of a type it does not know) must not reach it.
                let meta = table_map.get_column_metadata(i).ok_or_else(|| {
                    broken(format!(
                        "column {i}: its table map's metadata cannot be read past a column of \
                         a type binlog capture does not know ({})",
                        unknown_column_types(table_map)
                    ))
                })?;
                // A value that cannot be parsed leaves the rest of the event unreadable.
                let value: BinlogValue<'_> = buf
                    .parse((column_type, meta, false, false))
                    .map_err(|e| broken(format!("column {i}: {e}")))?;
                let kind = self.kinds.get(i).unwrap_or(&ColumnKind::AsIs);
                values.push(match kind.text(&value) {
                    Ok(value) => value,
                    Err(reason) => {
                        let column = self.columns.get(i).map_or("?", String::as_str);
                        unknown.push((i, format!("column {column}: {reason}")));
                        None
                    }
                });
            }
            self.rows_in_transaction += 1;
            self.rows_read += 1;
            self.pending.push_back(Output::Row(Row {
                columns: self.columns.clone(),
                values,
                unknown,
                ordinal: self.rows_read,
                logged_at: self.logged_at,
            }));
        }
        Ok(())
    }
}

/// The outbox table as the server describes it.
struct Layout {
    /// Its database and name as the server stores them: under `lower_case_table_names`
    /// the table maps name `outbox` for a table configured as `Outbox`.
    database: String,
    table: String,
    columns: Vec<String>,
    kinds: Vec<ColumnKind>,
    data_types: Vec<String>,
    /// The server's character set of each collation id.
    collations: HashMap<u16, String>,
}

impl Layout {
    async fn describe(conn: &mut Conn, database: &str, table: &str) -> Result<Layout> {
        // `information_schema` compares names without case: `Outbox` and `outbox` may be two
        // tables (`lower_case_table_names = 0`), of which the one named exactly is meant.
        type Described = (String, String, String, String, String, Option<String>);
        let described: Vec<Described> = conn
            .exec(
                "SELECT TABLE_SCHEMA, TABLE_NAME, COLUMN_NAME, DATA_TYPE, COLUMN_TYPE,
                        CHARACTER_SET_NAME
                   FROM information_schema.COLUMNS
                  WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ?
                  ORDER BY TABLE_SCHEMA, TABLE_NAME, ORDINAL_POSITION",
                (database, table),
            )
            .await?;
        let exact = described
            .iter()
            .any(|(d, t, ..)| d == database && t == table);
        let (database, table) = match described.first() {
            Some(_) if exact => (database.to_string(), table.to_string()),
            Some((d, t, ..)) => (d.clone(), t.clone()),
            None => {
                return Err(BinlogError::Config(format!(
                    "table {database}.{table} does not exist: run `outbox-relay migrate`"
                )))
            }
        };
        let collations: Vec<(u16, String)> = conn
            .query(
                "SELECT ID, CHARACTER_SET_NAME FROM information_schema.COLLATIONS
                  WHERE ID IS NOT NULL",
            )
            .await?;
        let mut layout = Layout {
            database,
            table,
            columns: Vec::new(),
            kinds: Vec::new(),
            data_types: Vec::new(),
            collations: collations.into_iter().collect(),
        };
        for (d, t, name, data_type, column_type, charset) in described {
            if d == layout.database && t == layout.table {
                let kind = ColumnKind::of(&data_type, &column_type).in_charset(charset);
                layout.columns.push(name);
                layout.kinds.push(kind);
                layout.data_types.push(data_type);
            }
        }
        Ok(layout)
    }
}

impl Layout {
    /// The columns as `table_map` logs them where it names them (binlog_row_metadata =
    /// FULL, which also logs each integer's signedness, each string's character set and
    /// each ENUM's and SET's labels): `None` where it does not, or cannot be read.
    fn logged(table_map: &TableMapEvent<'_>, collations: &HashMap<u16, String>) -> Option<Layout> {
        use ColumnType::*;
        let meta = OptionalMetaExtractor::new(table_map.iter_optional_meta()).ok()?;
        let columns: Vec<String> = meta
            .iter_column_name()
            .map(|name| name.map(|name| name.name().into_owned()))
            .collect::<std::io::Result<_>>()
            .ok()?;
        let width = columns.len();
        // No names logged (binlog_row_metadata NO_LOG or MINIMAL): nothing to read by.
        if width == 0 || width as u64 != table_map.columns_count() {
            return None;
        }
        let (mut enums, mut sets) = (Vec::new(), Vec::new());
        for field in table_map.iter_optional_meta() {
            match field.ok()? {
                OptionalMetadataField::EnumStrValue(values) => {
                    for labels in values.iter_values() {
                        let labels = labels.ok()?;
                        enums.push(
                            labels
                                .values()
                                .iter()
                                .map(|l| l.value().into_owned())
                                .collect(),
                        );
                    }
                }
                OptionalMetadataField::SetStrValue(values) => {
                    for labels in values.iter_values() {
                        let labels = labels.ok()?;
                        sets.push(
                            labels
                                .values()
                                .iter()
                                .map(|l| l.value().into_owned())
                                .collect(),
                        );
                    }
                }
                _ => {}
            }
        }
        let (mut enums, mut sets) = (enums.into_iter(), sets.into_iter());
        // One flag for each numeric column, in column order.
        let mut unsigned = meta.iter_signedness();
        let charsets = logged_collations(table_map)?;
        let mut kinds = Vec::with_capacity(width);
        for (i, collation) in charsets.into_iter().enumerate() {
            let logged_type = table_map.get_column_type(i).ok()??;
            let is_unsigned = logged_type.is_numeric_type() && unsigned.next()?;
            let kind = match logged_type {
                MYSQL_TYPE_TINY if is_unsigned => ColumnKind::Unsigned(8),
                MYSQL_TYPE_SHORT if is_unsigned => ColumnKind::Unsigned(16),
                MYSQL_TYPE_INT24 if is_unsigned => ColumnKind::Unsigned(24),
                MYSQL_TYPE_LONG if is_unsigned => ColumnKind::Unsigned(32),
                MYSQL_TYPE_LONGLONG if is_unsigned => ColumnKind::Unsigned(64),
                MYSQL_TYPE_TIMESTAMP | MYSQL_TYPE_TIMESTAMP2 => ColumnKind::Timestamp,
                MYSQL_TYPE_ENUM => ColumnKind::Enum(enums.next()?),
                MYSQL_TYPE_SET => ColumnKind::Set(sets.next()?),
                MYSQL_TYPE_BIT => ColumnKind::Bit,
                string if string.is_character_type() => {
                    kind_of_collation(Some(string), collation?, collations)?
                }
                _ => ColumnKind::AsIs,
            };
            kinds.push(kind);
        }
        Some(Layout {
            database: table_map.database_name().into_owned(),
            table: table_map.table_name().into_owned(),
            columns,
            kinds,
            // Not compared with later maps' types: a later table id is described again.
            data_types: vec![String::new(); width],
            collations: collations.clone(),
        })
    }
}

impl BinlogReader {
    /// A row event of the outbox table is `width` columns wide, and the table was described
    /// with another number: an `ALTER TABLE` since. Described again, the table as it is now
    /// reads the events written after the change; events written before it (read again
    /// after a restart) are read by the columns their table map names (binlog_row_metadata
    /// = FULL), and where it names none, the reader stops rather than read them under the
    /// wrong names.
    async fn describe_again(&mut self, width: usize, end: u64, table_id: u64) -> Result<()> {
        let mut conn = Conn::new(opts(&self.url)?).await?;
        let layout = Layout::describe(&mut conn, &self.database, &self.table).await?;
        let _ = conn.disconnect().await;
        let differs = match self.stream.table_map(table_id) {
            _ if layout.columns.len() != width => Some(format!(
                "has {width} columns, and the table has {} now",
                layout.columns.len()
            )),
            Some(table_map) => layout_differs(table_map, &layout.columns, &layout.data_types),
            None => Some(format!("came without its table map (table id {table_id})")),
        };
        // The table as it is now does not fit, but as it was described does: a reopen that
        // changed nothing (FLUSH TABLES, a restart) read before a later ALTER TABLE. Read
        // on with the description that fits.
        let still_fits = self.columns.len() == width
            && self
                .stream
                .table_map(table_id)
                .is_some_and(|map| layout_differs(map, &self.columns, &self.data_types).is_none());
        if differs.is_some() && still_fits {
            self.matched(table_id);
            return Ok(());
        }
        if let Some(differs) = differs {
            let at = format!("{} offset {end}", self.file);
            let table = format!("{}.{}", self.database, self.table);
            // Rows written before an ALTER TABLE, read after it (after a restart): where
            // the map names its columns (binlog_row_metadata = FULL), it says all they were
            // written with. Capture stopped there for good; a BLACKHOLE outbox, whose rows
            // are nowhere else, could only be recovered by skipping them.
            let logged = self
                .stream
                .table_map(table_id)
                .filter(|map| map.columns_count() as usize == width)
                .and_then(|map| Layout::logged(map, &self.collations));
            let Some(logged) = logged else {
                return Err(BinlogError::TableAltered { at, table, differs });
            };
            tracing::warn!(
                %table,
                %at,
                %differs,
                "rows written before an ALTER TABLE of the outbox are read by the columns \
                 the binary log names for them"
            );
            self.columns = Arc::new(logged.columns);
            self.described_kinds = logged.kinds.clone();
            self.kinds = logged.kinds;
            self.data_types = logged.data_types;
            self.matched_table_id = Some(table_id);
            return Ok(());
        }
        self.data_types = layout.data_types;
        if *self.columns != layout.columns || self.kinds != layout.kinds {
            tracing::info!(
                table = %format!("{}.{}", self.database, self.table),
                columns = width,
                "the outbox table was altered: its rows are read with its new columns from here on"
            );
        }
        self.columns = Arc::new(layout.columns);
        self.described_kinds = layout.kinds.clone();
        self.kinds = layout.kinds;
        self.collations = Arc::new(layout.collations);
        self.matched(table_id);
        Ok(())
    }

    /// The outbox's rows come under `table_id` from here on, whose table map fits the
    /// table as described.
    fn matched(&mut self, table_id: u64) {
        self.matched_table_id = Some(table_id);
        if let Some(table_map) = self.stream.table_map(table_id) {
            self.kinds = kinds_for(table_map, &self.described_kinds, &self.collations);
        }
    }
}

/// The kinds a table id's rows read by: the `described` ones, with each string column in
/// the character set the table map logs for it where it logs them (binlog_row_metadata
/// MINIMAL or FULL). Rows written before an `ALTER TABLE … CONVERT TO CHARACTER SET` and
/// read after a restart were decoded in the table's new character set: utf8mb4 read as
/// latin1, garbled with no error.
fn kinds_for(
    table_map: &TableMapEvent<'_>,
    described: &[ColumnKind],
    collations: &HashMap<u16, String>,
) -> Vec<ColumnKind> {
    let Some(logged) = kinds_as_logged(table_map, described, collations) else {
        return described.to_vec();
    };
    tracing::info!(
        table = %format!("{}.{}", table_map.database_name(), table_map.table_name()),
        "the binary log gives the outbox's string columns other character sets than the \
         table has now (an ALTER TABLE … CONVERT TO CHARACTER SET since): its rows are read \
         in the logged ones"
    );
    logged
}

/// The collation `table_map` logs for each column that has one, by column index (`None`
/// for a column without), if the map logs character sets (binlog_row_metadata MINIMAL or
/// FULL) and its list matches the columns; `None` otherwise.
///
/// The list has one entry per string column in column order (ENUM and SET have theirs
/// apart), and the servers give a GEOMETRY column one too (binary: MariaDB and MySQL count
/// it with the BLOBs it is built on), which mysql_common's `is_character_type` leaves out:
/// every string column after a GEOMETRY took the collation of the column before it, and
/// was read in it silently. A per-column list of another length is not used.
fn logged_collations(table_map: &TableMapEvent<'_>) -> Option<Vec<Option<u16>>> {
    let width = usize::try_from(table_map.columns_count()).ok()?;
    let mut has_one = Vec::with_capacity(width);
    for i in 0..width {
        // A type it cannot read puts every later column's collation out of step.
        let column_type = table_map.get_column_type(i).ok()??;
        has_one.push(
            column_type.is_character_type() || column_type == ColumnType::MYSQL_TYPE_GEOMETRY,
        );
    }
    let per_column = table_map
        .iter_optional_meta()
        .find_map(|field| match field {
            Ok(OptionalMetadataField::ColumnCharset(list)) => Some(list.iter_charsets().count()),
            _ => None,
        });
    if per_column.is_some_and(|n| n != has_one.iter().filter(|h| **h).count()) {
        return None;
    }
    let meta = OptionalMetaExtractor::new(table_map.iter_optional_meta()).ok()?;
    // Infinite where a default is logged; empty where nothing is (NO_LOG).
    let mut logged = meta.iter_charset();
    let mut collations = Vec::with_capacity(width);
    for has_one in has_one {
        collations.push(match has_one {
            true => Some(logged.next()?.ok()?),
            false => None,
        });
    }
    Some(collations)
}

/// How a string column logged in `collation` reads: binary as its bytes, any other in its
/// character set (`None` for a GEOMETRY column, read as described).
fn kind_of_collation(
    column_type: Option<ColumnType>,
    collation: u16,
    collations: &HashMap<u16, String>,
) -> Option<ColumnKind> {
    if column_type == Some(ColumnType::MYSQL_TYPE_GEOMETRY) {
        return None;
    }
    Some(match collations.get(&collation).map(String::as_str) {
        Some("binary") => ColumnKind::AsIs,
        Some(charset) => ColumnKind::Text(Charset::of(charset)),
        None => ColumnKind::Text(Charset::Other(format!("collation {collation}"))),
    })
}

/// `kinds` with each string column in the character set `table_map` logs for it, if the
/// map logs character sets for certain ([`logged_collations`]) and one differs; `None`
/// otherwise.
fn kinds_as_logged(
    table_map: &TableMapEvent<'_>,
    kinds: &[ColumnKind],
    collations: &HashMap<u16, String>,
) -> Option<Vec<ColumnKind>> {
    let logged = logged_collations(table_map)?;
    let mut out = kinds.to_vec();
    let mut changed = false;
    for (i, (kind, collation)) in out.iter_mut().zip(logged).enumerate() {
        let column_type = table_map.get_column_type(i).ok().flatten();
        let Some(as_logged) = collation.and_then(|c| kind_of_collation(column_type, c, collations))
        else {
            continue;
        };
        if matches!(kind, ColumnKind::AsIs | ColumnKind::Text(_)) && *kind != as_logged {
            *kind = as_logged;
            changed = true;
        }
    }
    changed.then_some(out)
}

/// How `table_map` differs from the table described as `columns` of `data_types`
/// (`information_schema`'s `DATA_TYPE`), if it does: a column's logged type is not one its
/// described type is logged as, or (where the server logs names: binlog_row_metadata =
/// FULL) a column's name is another. Without names, two columns of one type swapped by an
/// `ALTER TABLE` cannot be told apart.
fn layout_differs(
    table_map: &TableMapEvent<'_>,
    columns: &[String],
    data_types: &[String],
) -> Option<String> {
    for (i, data_type) in data_types.iter().enumerate() {
        let Some(expected) = logged_as(data_type) else {
            continue;
        };
        // A type it does not know is said when a row is read, with its fix.
        let Ok(Some(logged)) = table_map.get_column_type(i) else {
            continue;
        };
        if !expected.contains(&logged) {
            let column = columns.get(i).map_or("?", String::as_str);
            return Some(format!(
                "logs column {} ({column}, {data_type} when the table was described) as \
                 {logged:?}",
                i + 1
            ));
        }
    }
    let names = table_map
        .iter_optional_meta()
        .find_map(|field| match field {
            Ok(OptionalMetadataField::ColumnName(names)) => Some(names),
            _ => None,
        })?;
    let logged: Vec<String> = names
        .iter_names()
        .filter_map(|name| name.ok())
        .map(|name| name.name().into_owned())
        .collect();
    let same = logged.len() == columns.len()
        && logged
            .iter()
            .zip(columns)
            .all(|(a, b)| a.eq_ignore_ascii_case(b));
    (!same).then(|| format!("names its columns {logged:?}, and the table {columns:?}"))
}

/// The types a column of `DATA_TYPE` `data_type` is logged as in a table map; `None` for
/// a type not compared (MariaDB's UUID, INET6 and the like).
fn logged_as(data_type: &str) -> Option<&'static [ColumnType]> {
    use ColumnType::*;
    Some(match data_type.to_ascii_lowercase().as_str() {
        "tinyint" => &[MYSQL_TYPE_TINY],
        "smallint" => &[MYSQL_TYPE_SHORT],
        "mediumint" => &[MYSQL_TYPE_INT24],
        "int" | "integer" => &[MYSQL_TYPE_LONG],
        "bigint" => &[MYSQL_TYPE_LONGLONG],
        "float" => &[MYSQL_TYPE_FLOAT],
        "double" | "real" => &[MYSQL_TYPE_DOUBLE],
        "decimal" | "numeric" => &[MYSQL_TYPE_NEWDECIMAL, MYSQL_TYPE_DECIMAL],
        "date" => &[MYSQL_TYPE_NEWDATE, MYSQL_TYPE_DATE],
        "time" => &[MYSQL_TYPE_TIME2, MYSQL_TYPE_TIME],
        "datetime" => &[MYSQL_TYPE_DATETIME2, MYSQL_TYPE_DATETIME],
        "timestamp" => &[MYSQL_TYPE_TIMESTAMP2, MYSQL_TYPE_TIMESTAMP],
        "year" => &[MYSQL_TYPE_YEAR],
        "char" | "binary" => &[MYSQL_TYPE_STRING],
        "varchar" | "varbinary" => &[MYSQL_TYPE_VARCHAR, MYSQL_TYPE_VAR_STRING],
        "tinytext" | "text" | "mediumtext" | "longtext" | "tinyblob" | "blob" | "mediumblob"
        | "longblob" => &[
            MYSQL_TYPE_BLOB,
            MYSQL_TYPE_TINY_BLOB,
            MYSQL_TYPE_MEDIUM_BLOB,
            MYSQL_TYPE_LONG_BLOB,
        ],
        "json" => &[MYSQL_TYPE_JSON, MYSQL_TYPE_BLOB],
        "bit" => &[MYSQL_TYPE_BIT],
        "enum" => &[MYSQL_TYPE_ENUM, MYSQL_TYPE_STRING],
        "set" => &[MYSQL_TYPE_SET, MYSQL_TYPE_STRING],
        _ => return None,
    })
}

/// How a column's value in the log reads as the table shows it (`information_schema`'s
/// `DATA_TYPE` and `COLUMN_TYPE`): the log carries some types in a form of its own.
#[derive(Clone, Debug, PartialEq, Eq)]
enum ColumnKind {
    AsIs,
    /// An unsigned integer of these bits: the log carries its bytes without the sign
    /// (unless `binlog_row_metadata` says it, which MariaDB does not by default), so a
    /// `tinyint unsigned` 200 reads as -56.
    Unsigned(u32),
    /// Seconds since the epoch in the log; a UTC date and time in the table's text.
    Timestamp,
    /// The label's number (from 1) in the log.
    Enum(Vec<String>),
    /// A bitmask of the labels in the log (little-endian bytes).
    Set(Vec<String>),
    /// The bits' bytes (big-endian) in the log; the number in the table's text.
    Bit,
    /// A string column's characters, in the log as its character set stores them.
    Text(Charset),
    /// MariaDB's `UUID` type: 16 bytes in the log (in the text's order, on 10.11), the
    /// hyphenated text in the table's. Read as text, every event id of such a column was
    /// bytes no UUID parses from, and every event was dead-lettered.
    Uuid,
}

/// A string column's character set, as the log carries its values.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Charset {
    /// utf8mb4, utf8mb3 and ascii: UTF-8 as they are.
    Utf8,
    /// MySQL's latin1, which is Windows-1252 (with 0x81, 0x8D, 0x8F, 0x90 and 0x9D kept as
    /// the control characters of the same number).
    Latin1,
    /// Any other (its name): read where its bytes are UTF-8 (ASCII text), refused otherwise.
    Other(String),
}

impl Charset {
    fn of(name: &str) -> Charset {
        match name.to_ascii_lowercase().as_str() {
            "utf8mb4" | "utf8mb3" | "utf8" | "ascii" => Charset::Utf8,
            "latin1" => Charset::Latin1,
            other => Charset::Other(other.to_string()),
        }
    }

    fn decode(&self, bytes: &[u8]) -> std::result::Result<String, String> {
        match self {
            Charset::Latin1 => Ok(bytes.iter().map(|b| windows_1252(*b)).collect()),
            Charset::Utf8 => String::from_utf8(bytes.to_vec())
                .map_err(|_| "its bytes in the binary log are not UTF-8".to_string()),
            Charset::Other(name) => String::from_utf8(bytes.to_vec()).map_err(|_| {
                format!(
                    "its character set, {name}, is not one binlog capture reads (utf8mb4, \
                     utf8mb3, ascii, latin1): convert the column (ALTER TABLE … MODIFY … \
                     CHARACTER SET utf8mb4)"
                )
            }),
        }
    }
}

/// MySQL's latin1 byte as a character: Windows-1252, whose 0x80-0x9F are mostly
/// punctuation and letters, not control characters.
fn windows_1252(byte: u8) -> char {
    const HIGH: [char; 32] = [
        '\u{20AC}', '\u{0081}', '\u{201A}', '\u{0192}', '\u{201E}', '\u{2026}', '\u{2020}',
        '\u{2021}', '\u{02C6}', '\u{2030}', '\u{0160}', '\u{2039}', '\u{0152}', '\u{008D}',
        '\u{017D}', '\u{008F}', '\u{0090}', '\u{2018}', '\u{2019}', '\u{201C}', '\u{201D}',
        '\u{2022}', '\u{2013}', '\u{2014}', '\u{02DC}', '\u{2122}', '\u{0161}', '\u{203A}',
        '\u{0153}', '\u{009D}', '\u{017E}', '\u{0178}',
    ];
    match byte {
        0x80..=0x9F => HIGH[usize::from(byte - 0x80)],
        other => char::from(other),
    }
}

impl ColumnKind {
    fn of(data_type: &str, column_type: &str) -> Self {
        let unsigned = |bits| match column_type.to_ascii_lowercase().contains("unsigned") {
            true => ColumnKind::Unsigned(bits),
            false => ColumnKind::AsIs,
        };
        match data_type.to_ascii_lowercase().as_str() {
            "tinyint" => unsigned(8),
            "smallint" => unsigned(16),
            "mediumint" => unsigned(24),
            "int" | "integer" => unsigned(32),
            "bigint" => unsigned(64),
            "timestamp" => ColumnKind::Timestamp,
            "enum" => ColumnKind::Enum(labels(column_type)),
            "set" => ColumnKind::Set(labels(column_type)),
            "bit" => ColumnKind::Bit,
            "uuid" => ColumnKind::Uuid,
            _ => ColumnKind::AsIs,
        }
    }

    /// A string column's kind in the character set `charset` (`None`: not a string, or a
    /// binary string, whose bytes are read as they are).
    fn in_charset(self, charset: Option<String>) -> Self {
        match (self, charset) {
            (ColumnKind::AsIs, Some(charset)) => ColumnKind::Text(Charset::of(&charset)),
            (kind, _) => kind,
        }
    }

    /// `value` as text, as the table would show it; `None` for NULL.
    fn text(&self, value: &BinlogValue<'_>) -> std::result::Result<Option<String>, String> {
        if let BinlogValue::Value(Value::Bytes(bytes)) = value {
            match self {
                ColumnKind::Text(charset) => return charset.decode(bytes).map(Some),
                ColumnKind::Uuid => {
                    return uuid::Uuid::from_slice(bytes)
                        .map(|id| Some(id.hyphenated().to_string()))
                        .map_err(|_| {
                            format!("a UUID column's value is {} bytes, not 16", bytes.len())
                        })
                }
                ColumnKind::Bit => {
                    let n = bytes.iter().fold(0u128, |n, b| n << 8 | u128::from(*b));
                    return Ok(Some(n.to_string()));
                }
                ColumnKind::Set(labels) => {
                    let chosen: Vec<&str> = labels
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| bytes.get(i / 8).is_some_and(|b| b >> (i % 8) & 1 == 1))
                        .map(|(_, label)| label.as_str())
                        .collect();
                    return Ok(Some(chosen.join(",")));
                }
                _ => {}
            }
        }
        let Some(text) = text(value)? else {
            return Ok(None);
        };
        Ok(Some(match self {
            ColumnKind::Unsigned(bits) => match text.parse::<i64>() {
                Ok(n) if n < 0 => (i128::from(n) + (1i128 << bits)).to_string(),
                _ => text,
            },
            ColumnKind::Timestamp => {
                let (seconds, micros) = text.split_once('.').unwrap_or((&text, "0"));
                let seconds: u64 = seconds
                    .parse()
                    .map_err(|_| format!("{text:?} is not a TIMESTAMP's seconds"))?;
                let micros: u64 = format!("{micros:0<6}")[..6]
                    .parse()
                    .map_err(|_| format!("{text:?} is not a TIMESTAMP's seconds"))?;
                let at = std::time::UNIX_EPOCH
                    + std::time::Duration::from_secs(seconds)
                    + std::time::Duration::from_micros(micros);
                outbox_core::time::rfc3339_micros(at)?
                    .trim_end_matches('Z')
                    .replacen('T', " ", 1)
            }
            ColumnKind::Enum(labels) => match text.parse::<usize>() {
                // 0 is the empty string an invalid value was stored as.
                Ok(0) => String::new(),
                Ok(n) => labels
                    .get(n - 1)
                    .cloned()
                    .ok_or_else(|| format!("ENUM value {n} past its {} labels", labels.len()))?,
                Err(_) => text,
            },
            _ => text,
        }))
    }
}

/// The labels of an `enum('a','b''c')` or `set(…)` column type, in order.
fn labels(column_type: &str) -> Vec<String> {
    let inner = column_type
        .split_once('(')
        .and_then(|(_, rest)| rest.rsplit_once(')'))
        .map_or("", |(inner, _)| inner);
    let mut labels = Vec::new();
    let mut chars = inner.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\'' {
            continue;
        }
        let mut label = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\'' if chars.peek() == Some(&'\'') => {
                    chars.next();
                    label.push('\'');
                }
                '\'' => break,
                other => label.push(other),
            }
        }
        labels.push(label);
    }
    labels
}

/// A column's value as text, as the table would show it; `None` for NULL. MySQL 8 writes
/// JSON in its binary form (JSONB), read back into JSON text here; MariaDB's JSON is text.
fn text(value: &BinlogValue<'_>) -> std::result::Result<Option<String>, String> {
    Ok(match value {
        BinlogValue::Value(Value::NULL) => None,
        BinlogValue::Value(Value::Bytes(bytes)) => {
            Some(String::from_utf8_lossy(bytes).into_owned())
        }
        BinlogValue::Value(Value::Int(n)) => Some(n.to_string()),
        BinlogValue::Value(Value::UInt(n)) => Some(n.to_string()),
        BinlogValue::Value(Value::Float(n)) => Some(n.to_string()),
        BinlogValue::Value(Value::Double(n)) => Some(n.to_string()),
        BinlogValue::Value(Value::Date(y, mo, d, h, mi, s, us)) => Some(format!(
            "{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}.{us:06}"
        )),
        BinlogValue::Value(Value::Time(negative, days, h, mi, s, us)) => Some(format!(
            "{}{}:{mi:02}:{s:02}.{us:06}",
            if *negative { "-" } else { "" },
            u64::from(*days) * 24 + u64::from(*h)
        )),
        BinlogValue::Jsonb(jsonb) => {
            let dom = jsonb
                .clone()
                .parse()
                .map_err(|e| format!("MySQL's binary JSON cannot be read: {e}"))?;
            let mut out = String::new();
            json_text(dom, &mut out);
            Some(out)
        }
        // Partial JSON updates: only UPDATE rows carry them, and an event is an INSERT.
        BinlogValue::JsonDiff(_) => {
            return Err("a partial JSON update where an inserted row was expected".into())
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An event of `size` bytes as far as the tiling looks: its size at bytes 9..13.
    fn sized(size: u32) -> Vec<u8> {
        let mut event = vec![0u8; (size as usize).max(13)];
        event[9..13].copy_from_slice(&size.to_le_bytes());
        event
    }

    /// A payload's events, read in chunks of every size, end where the bytes do (headers
    /// cut across chunks too); a size below a header's, or an event longer than what is
    /// left, is a broken payload, at the event that says so.
    #[test]
    fn a_payloads_events_are_tiled_a_chunk_at_a_time() {
        let events: Vec<u8> = [19, 200, 70_000, 31].into_iter().flat_map(sized).collect();
        for chunk in [1, 5, 13, 19, 4096, events.len()] {
            let mut tiles = EventTiles::default();
            for bytes in events.chunks(chunk) {
                tiles.read(bytes).unwrap();
            }
            assert_eq!(
                tiles.end().unwrap(),
                events.len() as u64,
                "chunks of {chunk}"
            );
        }
        let mut short = EventTiles::default();
        let e = short.read(&[sized(19), sized(12)].concat()).unwrap_err();
        assert!(e.to_string().contains("byte 19"), "{e}");
        let mut cut = EventTiles::default();
        cut.read(&sized(50)[..40]).unwrap();
        assert!(cut.end().is_err(), "an event longer than what is left");
        let mut half_header = EventTiles::default();
        half_header.read(&[sized(19), vec![0; 5]].concat()).unwrap();
        assert!(half_header.end().is_err(), "a header cut short");
    }

    #[test]
    fn mysql_8_binary_json_is_read_back_as_json_text() {
        use mysql_async::binlog::jsonb;
        use mysql_common::proto::MyDeserialize;
        // {"a": 1, "b": "x"} as MySQL 8 writes it (a small object: count, size, key entries,
        // value entries, then the keys and the out-of-line values), per the JSONB format of
        // MySQL's json_binary.h.
        let bytes: &[u8] = &[
            0x00, // small object
            0x02, 0x00, // two members
            0x14, 0x00, // 20 bytes
            0x12, 0x00, 0x01, 0x00, // key "a" at 18, 1 byte
            0x13, 0x00, 0x01, 0x00, // key "b" at 19, 1 byte
            0x05, 0x01, 0x00, // int16 1, inline
            0x0c, 0x14, 0x00, // string at 20
            b'a', b'b', // the keys
            0x01, b'x', // the string: length 1, "x"
        ];
        let mut bytes = bytes.to_vec();
        bytes[3] = (bytes.len() - 1) as u8;
        let value = jsonb::Value::deserialize((), &mut mysql_common::io::ParseBuf(&bytes)).unwrap();
        let text = text(&BinlogValue::Jsonb(value)).unwrap().unwrap();
        assert_eq!(text, r#"{"a":1,"b":"x"}"#);
    }

    #[test]
    fn a_decimal_in_mysql_8_binary_json_stays_a_number() {
        use mysql_async::binlog::jsonb;
        use mysql_common::proto::MyDeserialize;
        // 12.50 as a DECIMAL(4,2) inside JSON: an opaque value of type NEWDECIMAL (0xf6),
        // 4 bytes: precision, scale, then the decimal's binary form (12 and 50, one byte
        // each, the sign bit set for a positive number).
        let bytes = [0x0f, 0xf6, 0x04, 0x04, 0x02, 0x8c, 0x32];
        let value = jsonb::Value::deserialize((), &mut mysql_common::io::ParseBuf(&bytes)).unwrap();
        assert_eq!(
            text(&BinlogValue::Jsonb(value)).unwrap().as_deref(),
            Some("12.50")
        );
    }

    #[test]
    fn values_the_log_carries_in_a_form_of_its_own_read_as_the_table_shows_them() {
        let read = |kind: &ColumnKind, value: Value| {
            kind.text(&BinlogValue::Value(value)).unwrap().unwrap()
        };
        let bytes = |b: &[u8]| Value::Bytes(b.to_vec());
        let unsigned = ColumnKind::of("tinyint", "tinyint(3) unsigned");
        assert_eq!(read(&unsigned, Value::Int(-56)), "200");
        assert_eq!(read(&unsigned, Value::Int(127)), "127");
        let big = ColumnKind::of("bigint", "bigint(20) unsigned");
        assert_eq!(read(&big, Value::Int(-1)), "18446744073709551615");
        assert_eq!(
            read(&ColumnKind::of("int", "int(11)"), Value::Int(-1)),
            "-1"
        );
        let at = ColumnKind::of("timestamp", "timestamp(6)");
        assert_eq!(
            read(&at, bytes(b"1733100000.5")),
            "2024-12-02 00:40:00.500000"
        );
        assert_eq!(
            read(&at, bytes(b"1733100000")),
            "2024-12-02 00:40:00.000000"
        );
        let status = ColumnKind::of("enum", "enum('PENDING','it''s','DONE')");
        assert_eq!(read(&status, Value::Int(1)), "PENDING");
        assert_eq!(read(&status, Value::Int(2)), "it's");
        assert_eq!(read(&status, Value::Int(0)), "");
        let set = ColumnKind::of("set", "set('a','b','c')");
        assert_eq!(read(&set, bytes(&[0b101])), "a,c");
        let bit = ColumnKind::of("bit", "bit(10)");
        assert_eq!(read(&bit, bytes(&[0b10, 0b1])), "513");
        assert!(
            ColumnKind::of("enum", "enum('a')")
                .text(&BinlogValue::Value(Value::Int(2)))
                .is_err(),
            "an ENUM number past its labels marks the row undecodable"
        );
    }

    #[test]
    fn a_mysql_gtid_set_is_asked_for_with_each_sources_intervals() {
        let a = "3e11fa47-71ca-11e1-9e33-c80aa9429562";
        let state = gtid::GtidState::parse(&format!("{a}:1-5:7:nightly:2-3")).unwrap();
        let sources = dump_sources(&state).unwrap();
        let described: Vec<_> = sources
            .iter()
            .map(|sid| {
                (
                    uuid::Uuid::from_bytes(sid.uuid()).to_string(),
                    sid.tag().map(|t| t.to_string()),
                    // The protocol's intervals end after their last transaction.
                    sid.intervals()
                        .iter()
                        .map(|i| (i.start(), i.end()))
                        .collect::<Vec<_>>(),
                )
            })
            .collect();
        assert_eq!(
            described,
            vec![
                (a.to_string(), None, vec![(1, 6), (7, 8)]),
                (a.to_string(), Some("nightly".to_string()), vec![(2, 4)]),
            ]
        );
    }

    /// Events written here, handed out in order; then the stream ends.
    struct Written(std::collections::VecDeque<Event>);

    impl EventSource for Written {
        fn next_event(&mut self) -> BoxFuture<'_, Option<mysql_async::Result<Event>>> {
            let event = self.0.pop_front().map(Ok);
            async move { event }.boxed()
        }

        fn table_map(&self, _: u64) -> Option<&TableMapEvent<'static>> {
            None
        }
    }

    /// `event` as the server sends it, ending at `log_pos`.
    fn written<'a, E: mysql_common::binlog::BinlogEvent<'a>>(event: E, log_pos: u32) -> Event {
        use mysql_common::binlog::consts::{BinlogVersion, EventFlags};
        use mysql_common::binlog::events::{BinlogEventHeader, FormatDescriptionEvent};
        use mysql_common::proto::MySerialize;
        let mut body = Vec::new();
        event.serialize(&mut body);
        let size = u32::try_from(BinlogEventHeader::LEN + body.len()).unwrap();
        let header =
            BinlogEventHeader::new(1, E::EVENT_TYPE, 1, size, log_pos, EventFlags::empty());
        let mut bytes = Vec::new();
        header.serialize(&mut bytes);
        bytes.extend(body);
        let format = FormatDescriptionEvent::new(BinlogVersion::Version4);
        Event::read(&format, &bytes[..]).unwrap()
    }

    /// A LOAD DATA logged as a statement: the file's Begin_load_query event, then an
    /// Execute_load_query event, which mysql_common reads as one of its own (no
    /// QueryEvent), with the statement and its default database.
    fn load_data(query: &str, schema: &str, log_pos: u32) -> Event {
        use mysql_common::binlog::consts::LoadDuplicateHandling;
        use mysql_common::binlog::events::ExecuteLoadQueryEvent;
        let event = ExecuteLoadQueryEvent::new(
            1,
            LoadDuplicateHandling::LOAD_DUP_ERROR,
            Vec::new(),
            schema.as_bytes().to_vec(),
        )
        .with_query(query.as_bytes().to_vec());
        written(event, log_pos)
    }

    fn reading(events: Vec<Event>) -> BinlogReader {
        let config = BinlogConfig {
            url: String::new(),
            server_id: 1,
            database: "shop".into(),
            table: "outbox".into(),
        };
        let layout = Layout {
            database: "shop".into(),
            table: "outbox".into(),
            columns: Vec::new(),
            kinds: Vec::new(),
            data_types: Vec::new(),
            collations: HashMap::new(),
        };
        let from = BinlogPosition::at("mariadb-bin.000001", 100);
        BinlogReader::of(Box::new(Written(events.into())), &config, layout, from)
    }

    /// The outbox's LOAD DATA logged as a statement was passed by, its rows lost: its
    /// Execute_load_query event was not looked at. It stops the reader now, before it.
    #[tokio::test]
    async fn an_outbox_load_data_logged_as_a_statement_stops_the_reader_before_it() {
        use mysql_common::binlog::events::XidEvent;
        let into_outbox = "LOAD DATA LOCAL INFILE '/tmp/SQL_LOAD_MB-1-0' INTO TABLE outbox \
                           FIELDS TERMINATED BY ',' (partition_key)";
        let mut reader = reading(vec![
            load_data(into_outbox, "shop", 200),
            written(XidEvent { xid: 7 }, 231),
        ]);
        match reader.next().await {
            Err(e @ BinlogError::StatementLogged { .. }) => {
                let said = e.to_string();
                assert!(
                    said.contains("LOAD DATA … INTO TABLE shop.outbox")
                        && said.contains("mariadb-bin.000001 offset 200")
                        && !said.contains("SQL_LOAD_MB"),
                    "{said}"
                );
            }
            other => panic!("the reader read on: {other:?}"),
        }
        let boundary = reader.boundary().expect("a place read");
        assert_eq!(
            boundary.offset, 100,
            "the place to start again is before it"
        );

        // Another table's load passes, and its transaction's end is a place to start from.
        let mut reader = reading(vec![
            load_data(
                "LOAD DATA INFILE 'outbox.csv' INTO TABLE archive",
                "shop",
                200,
            ),
            written(XidEvent { xid: 7 }, 231),
        ]);
        assert!(matches!(reader.next().await, Ok(None)));
        assert_eq!(reader.boundary().map(|b| b.offset), Some(231));
    }

    #[test]
    fn a_server_that_says_its_place_has_no_gtid_yet_gives_a_known_empty_state() {
        let from = BinlogPosition::at("mariadb-bin.000001", 4);
        let mut empty =
            (start_gtid_state(Some(String::new()), &from).ok().flatten()).expect("known");
        assert!(empty.is_empty());
        assert!(empty.advance("0-1-1"), "the first GTID read fills it");
        assert_eq!(empty.to_string(), "0-1-1");
        let shown = |said: Option<&str>, stored: Option<&str>| {
            let from = BinlogPosition {
                gtid: stored.map(String::from),
                ..BinlogPosition::at("mariadb-bin.000003", 5000)
            };
            start_gtid_state(said.map(String::from), &from).map(|s| s.map(|s| s.to_string()))
        };
        assert_eq!(
            shown(Some("0-1-9,1-2-4"), Some("1-2-4,0-1-9")).ok(),
            Some(Some("0-1-9,1-2-4".into())),
            "the same state, however written"
        );
        assert_eq!(shown(Some("0-1-9"), None).ok(), Some(Some("0-1-9".into())));
        assert_eq!(
            shown(None, Some("0-1-7")).ok(),
            Some(Some("0-1-7".into())),
            "MySQL, or a place the server does not know: the stored state"
        );
        assert_eq!(shown(None, None).ok(), Some(None));
        // The log reset (or the server rebuilt) and grown past the offset again: its state
        // there is another than the one read there, behind or ahead.
        for said in ["", "0-1-3", "0-1-12"] {
            let refused = shown(Some(said), Some("0-1-9"));
            assert!(
                matches!(refused, Err(BinlogError::Purged { .. })),
                "{said}: {refused:?}"
            );
        }
        // Stored as the position's state, an empty one is no place on another server.
        let stored = BinlogPosition {
            gtid: Some(String::new()),
            ..BinlogPosition::at("mariadb-bin.000001", 4)
        };
        assert!(matches!(
            crate::capture::resume(&stored, Some(1), 2),
            Err(BinlogError::OtherServer { .. })
        ));
    }

    #[test]
    fn a_mariadb_gtid_is_read_from_its_events_body() {
        let mut body = 4331u64.to_le_bytes().to_vec();
        body.extend(7u32.to_le_bytes());
        body.push(0); // flags
        assert_eq!(mariadb_gtid(&body, 1).as_deref(), Some("7-1-4331"));
        assert_eq!(mariadb_gtid(&body[..11], 1), None, "too short");
    }
}
