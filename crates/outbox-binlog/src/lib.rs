//! Binlog capture for MySQL and MariaDB (issue 35): rows inserted into the outbox table,
//! read from the binary log as a replica reads it, relayed through the engine like any store.
//!
//! The binary log holds committed transactions only, each whole and in commit order (the
//! order their commits reached the log), so the stream needs no buffering to leave rolled
//! back work out: a transaction's row events come between its start and its XID event. The
//! rows are decoded from the row events themselves (`binlog_format = ROW`), never read back
//! from the table.
//!
//! - [`BinlogReader`] (`reader.rs`) reads the log: the outbox table's inserted rows of each
//!   committed transaction, in commit order, each closed by the position to resume from.
//! - [`Positions`] says which position may be stored, given which rows are settled (the WAL
//!   slot's rule); [`gtid`] is the GTID state that names a position on every server.
//! - [`seat`] keeps one active reader per outbox and the position it stores; [`Capture`]
//!   puts the reader, the rule and the seat together.
//! - [`store`] is [`BinlogStore`], the engine's store over a [`Capture`].
//! - [`mod@schema`] has the table-less form: a BLACKHOLE table, written to the log only.
//! - [`parked`] is the parked table: its DDL, and the index of the keys waiting in it.
//!
//! This file holds what they share: the errors, positions and configuration, and the
//! server's side: what it lacks for capture ([`server_problems`]), where its log is
//! ([`current_position`], [`binary_logs`]), and whether a stored position is still in them
//! ([`retention_problem`]; a reader started at a purged position fails with
//! [`BinlogError::Purged`], never skipping).

pub mod capture;
pub mod gtid;
pub mod parked;
mod positions;
mod reader;
mod reread;
pub mod schema;
pub mod seat;
mod statement;
pub mod store;
pub use capture::{Capture, Started};
pub use parked::{parked_ddl, parked_index_problem, upgrade_parked};
pub use positions::{Front, Positions, UnknownRow};
pub use reader::{BinlogReader, Output, Row, BINLOG_HEARTBEAT, BINLOG_SILENCE};
pub use schema::{
    blackhole_ddl, blackhole_problem, blackhole_table_problems, is_blackhole, parked_table_problem,
};
pub use seat::{
    positions_ddl, quote_identifier, quote_string, stored_position, upgrade_positions,
    ActiveReader, SeatConfig, StoredPosition, Taken,
};
pub use store::{BinlogStore, BinlogStoreOptions, CaptureStatus, StillReading};

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Opts};
use outbox_core::store::Problem;

/// Why the stream stopped.
#[derive(Debug, thiserror::Error)]
pub enum BinlogError {
    #[error("binlog capture: {0}")]
    Config(String),
    #[error("binlog connection: {0}")]
    Connection(#[from] mysql_async::Error),
    #[error("binlog event: {0}")]
    Decode(String),
    /// The server sent nothing, not even a heartbeat, for this long.
    #[error(
        "binlog connection: the server sent nothing, not even a heartbeat, for {0:?}: the \
         connection is taken for dead (a NAT, proxy or firewall that dropped it), and the \
         relay reads again from the stored position"
    )]
    Silent(std::time::Duration),
    /// A row event of the outbox table is `width` columns wide, unlike the table as the
    /// reader described it (the reader describes it again, and stops if it still differs).
    #[error("a row event of the outbox table has {width} columns, unlike the table")]
    LayoutChanged { width: usize },
    /// Rows written before an `ALTER TABLE` of the outbox table, read after it.
    #[error(
        "a row event of {table} at {at} {differs}: the table was altered after these rows \
         were written, and binlog capture reads a row's columns by their place and type, so \
         it stops rather than read them under the wrong names or types. Alter the outbox \
         table while the relay runs (it reads on across the change) or after a drain, not \
         while it is stopped with rows unread; with binlog_row_metadata = FULL (SET GLOBAL, \
         and in the server's configuration) the log names the columns of rows written from \
         then on, and such rows are read by them"
    )]
    TableAltered {
        at: String,
        table: String,
        /// How the event differs from the table as it is now.
        differs: String,
    },
    /// A write to the outbox table that the server logged as a statement, not as rows: the
    /// writing session's `binlog_format` is not ROW. Its rows are in no row event.
    #[error(
        "the server logged a write to the outbox table {table} as a statement at {at} \
         ({statement}, its values not repeated here): the writing session's binlog_format is \
         not ROW (STATEMENT or MIXED, set globally or by that session), so the rows it \
         inserted are not in the binary log as rows, and binlog capture stops here rather \
         than pass them by; the stored position stays before it. Set binlog_format = ROW \
         globally (SET GLOBAL binlog_format = 'ROW', and in the server's configuration) and \
         for every session that writes the outbox (no SET SESSION binlog_format, which needs \
         SUPER or BINLOG ADMIN: revoke it from the application's role)"
    )]
    StatementLogged {
        at: String,
        table: String,
        /// The statement's verb and target (`INSERT INTO shop.outbox`), never its values,
        /// which may be the events' payloads.
        statement: String,
    },
    /// An incident event: the server says events are missing from its log at that place.
    #[error(
        "an incident event at {at}: the server says events are missing from its binary log \
         here (a write to the log that failed, a statement cache that overflowed); as a \
         replica would, binlog capture stops rather than skip them, and the stored position \
         stays before it"
    )]
    Incident { at: String },
    /// MariaDB's compressed event (`log_bin_compress`), which the reader cannot read.
    #[error(
        "a compressed event (MariaDB's log_bin_compress) at {at}: binlog capture does not \
         read those, and stops rather than skip its rows; SET GLOBAL log_bin_compress = OFF \
         (and in the server's configuration). The stored position stays before this \
         transaction, whose events stay compressed in the log: capture goes on only from a \
         position after it"
    )]
    CompressedEvent { at: String },
    /// The server no longer has the log at the position asked for.
    #[error(
        "the binary log at {file} offset {offset} is not on the server any more ({reason}): \
         events written since that position may be gone (purged by binlog_expire_logs_seconds \
         or expire_logs_days while the relay was off, or the log was reset), and the relay \
         never skips them silently",
        file = position.file,
        offset = position.offset
    )]
    Purged {
        position: BinlogPosition,
        reason: String,
    },
    /// The server's log does not continue after the GTID state asked for: it is ahead of
    /// this server (a replica that has not caught up), or the transactions after it were
    /// purged, or the history diverged.
    #[error(
        "the server's binary log does not continue after GTID {gtid} ({reason}): point the \
         relay at a server that has the transactions after it (a replica that has caught up), \
         and never at one whose history diverged; nothing was skipped"
    )]
    GtidNotInLog { gtid: String, reason: String },
    /// The stored position is in another server's log, and no GTID state was stored with
    /// it ([`capture::resume`]).
    #[error(
        "the stored position ({file} offset {offset}) is in the binary log of server {stored_by}, \
         and the relay is now connected to server {server} (a failover, or another server): \
         files and offsets are each server's own, and no GTID state was stored with it (the \
         servers write no GTIDs, MySQL's gtid_mode is not ON, or the position was stored by \
         an earlier version of the relay), so the relay does not guess where to go on",
        file = position.file,
        offset = position.offset
    )]
    OtherServer {
        position: BinlogPosition,
        stored_by: u64,
        server: u64,
    },
    /// Another reader took the seat ([`seat`]): this one must stop reading and writing.
    #[error(
        "another relay has taken over reading the binary log of {outbox} (this one held it at \
         epoch {epoch}, and was paused or cut off past its lease): this relay stops reading \
         and waits as a standby"
    )]
    Fenced { outbox: String, epoch: i64 },
}

/// ER_MASTER_FATAL_ERROR_READING_BINLOG: the file or position asked for is not in the
/// server's binary log (purged, reset, or never written).
const FATAL_READING_BINLOG: u16 = 1236;

/// ER_PARSE_ERROR: a statement this server does not know.
const PARSE_ERROR: u16 = 1064;

/// Where `stored` stands against the server's binary logs (`logs`, `SHOW BINARY LOGS`:
/// each file and its size, oldest first), for an outbox that is a BLACKHOLE table or not:
/// - in a file the server has, within it: no problem, unless that file is the oldest and not
///   the one written to (never purged): the next purge removes it, a warning (`check` fails
///   on it for a BLACKHOLE outbox, whose events are nowhere else);
/// - past the end of a file the server has, or in a file it never had (a higher number, or
///   another basename: the log was reset or renamed, or it is another server's history):
///   blocking, since reading would fail, or read another log's events;
/// - in a file before the oldest, of the same basename: blocking, purged.
///
/// Blocking problems carry a generic fix: the relay gives its own recovery.
pub fn retention_problem(
    stored: &BinlogPosition,
    logs: &[(String, u64)],
    blackhole: bool,
) -> Option<Problem> {
    let forget =
        "forget the stored position, then start capture from the server's current position";
    let (Some((oldest, _)), Some((newest, _))) = (logs.first(), logs.last()) else {
        return Some(Problem::blocking(
            "the server lists no binary log",
            "start it with log_bin (and binlog_format = ROW)",
        ));
    };
    let at = format!("{}:{}", stored.file, stored.offset);
    let basename = |file: &str| file.rsplit_once('.').map(|(base, _)| base.to_string());
    match logs.iter().find(|(file, _)| *file == stored.file) {
        Some((file, size)) if stored.offset > *size => Some(Problem::blocking(
            format!(
                "the stored position {at} is past the end of the server's {file} ({size} \
                 bytes): that is not the log the position was read in (the log was reset \
                 and written again, or this is another server whose logs have the same names)"
            ),
            forget,
        )),
        Some((file, _)) if file != newest && file == oldest => Some(match blackhole {
            true => Problem::degraded(
                format!(
                    "the stored position {at} is in the server's oldest binary log: the next \
                     purge removes it, and with it the events committed since that position, \
                     which a BLACKHOLE outbox keeps nowhere else"
                ),
                "start the relay now (it reads on past that log), and raise \
                 binlog_expire_logs_seconds (expire_logs_days) above the longest time the \
                 relay may be off",
            ),
            false => Problem::advisory(
                format!(
                    "the stored position {at} is in the server's oldest binary log: the next \
                     purge removes it (the relay then refuses to read on, and the events still \
                     in the outbox table are relayed once the position is forgotten)"
                ),
                "start the relay, or raise binlog_expire_logs_seconds (expire_logs_days) above \
                 the longest time the relay may be off",
            ),
        }),
        Some(_) => None,
        None if basename(&stored.file) == basename(oldest)
            && log_number(&stored.file) < log_number(oldest) =>
        {
            Some(Problem::blocking(
                format!(
                    "the stored position {at} is in a binary log the server has purged (its \
                     oldest is {oldest})"
                ),
                forget,
            ))
        }
        None => Some(Problem::blocking(
            format!(
                "the stored position {at} is not in this server's binary logs ({oldest} to \
                 {newest}): the log was reset (RESET MASTER), its name changed (log_bin's \
                 basename), or the position is another server's history (a server restored \
                 or replaced); reading from it would fail, or read another log's events"
            ),
            forget,
        )),
    }
}

/// Whether `a` is at or after `b` in the log (files by their number).
pub fn at_or_after(a: &BinlogPosition, b: &BinlogPosition) -> bool {
    (log_number(&a.file), a.offset) >= (log_number(&b.file), b.offset)
}

/// The number a binary log file's name ends with (`mariadb-bin.000042`: 42).
fn log_number(file: &str) -> u64 {
    file.rsplit_once('.')
        .and_then(|(_, n)| n.parse().ok())
        .unwrap_or(0)
}

/// Bytes of binary log the server has written past `read_to`: the rest of its file, and
/// every later file whole (`SHOW BINARY LOGS`).
pub async fn bytes_behind(url: &str, read_to: &BinlogPosition) -> Result<u64> {
    let mut conn = Conn::new(opts(url)?).await?;
    let logs: Vec<mysql_async::Row> = conn.query("SHOW BINARY LOGS").await?;
    conn.disconnect().await?;
    let reading = log_number(&read_to.file);
    Ok(logs
        .iter()
        .filter_map(|row| Some((row.get::<String, _>(0)?, row.get::<u64, _>(1)?)))
        .map(|(file, size)| match log_number(&file).cmp(&reading) {
            std::cmp::Ordering::Less => 0,
            std::cmp::Ordering::Equal => size.saturating_sub(read_to.offset),
            std::cmp::Ordering::Greater => size,
        })
        .sum())
}

/// The server's oldest binary log file (`SHOW BINARY LOGS`' first).
pub async fn oldest_log(url: &str) -> Result<String> {
    let mut conn = Conn::new(opts(url)?).await?;
    let first: Option<mysql_async::Row> = conn.query_first("SHOW BINARY LOGS").await?;
    conn.disconnect().await?;
    first
        .and_then(|row| row.get::<String, _>(0))
        .ok_or_else(|| BinlogError::Config("the server lists no binary log".into()))
}

/// The server's binary logs, oldest first, each with its size in bytes (`SHOW BINARY
/// LOGS`).
pub async fn binary_logs(url: &str) -> Result<Vec<(String, u64)>> {
    let mut conn = Conn::new(opts(url)?).await?;
    let logs: Vec<mysql_async::Row> = conn.query("SHOW BINARY LOGS").await?;
    conn.disconnect().await?;
    Ok(logs
        .iter()
        .filter_map(|row| Some((row.get::<String, _>(0)?, row.get::<u64, _>(1)?)))
        .collect())
}

impl BinlogError {
    /// What the failure means to a caller that reports it as a store's: a driver error as
    /// the MySQL store classifies its own (a privilege missing is no outage to wait out), a
    /// bad setting as configuration, anything else of the stream as a connection to retry.
    pub fn store_kind(&self) -> outbox_core::StoreErrorKind {
        match self {
            BinlogError::Connection(e) => outbox_store_mysql::classify(e),
            BinlogError::Config(_) => outbox_core::StoreErrorKind::Config,
            _ => outbox_core::StoreErrorKind::Connection,
        }
    }
}

pub(crate) type Result<T> = std::result::Result<T, BinlogError>;

/// A place in the binary log: a file and the byte offset of an event in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BinlogPosition {
    pub file: String,
    pub offset: u64,
    /// The GTID state at this place (MariaDB's or MySQL's, see [`gtid::GtidState`]), where
    /// the reader knows it: the same place on any server of the topology, which a file and
    /// offset are not.
    pub gtid: Option<String>,
}

impl BinlogPosition {
    /// `file` at `offset`, its GTID state unknown.
    pub fn at(file: impl Into<String>, offset: u64) -> Self {
        BinlogPosition {
            file: file.into(),
            offset,
            gtid: None,
        }
    }
}

/// What to read, and as which replica. Its `Debug` shows the URL redacted.
#[derive(Clone)]
pub struct BinlogConfig {
    /// `mysql://user:password@host:port/database`. The user needs REPLICATION SLAVE (and
    /// REPLICATION CLIENT for the log's position).
    pub url: String,
    /// This reader's server id, unique among the server's replicas and readers.
    pub server_id: u32,
    pub database: String,
    pub table: String,
}

impl std::fmt::Debug for BinlogConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BinlogConfig")
            .field("url", &outbox_core::redact::RedactedUrl(&self.url))
            .field("server_id", &self.server_id)
            .field("database", &self.database)
            .field("table", &self.table)
            .finish()
    }
}

/// How long [`gtid_resume_refused`] waits for the server to refuse a GTID state: it refuses
/// one its log does not continue (a diverged history) at once.
pub const GTID_PROBE: std::time::Duration = std::time::Duration::from_secs(3);

/// Whether the server refuses to continue after the GTID state `gtid`, as a relay's start
/// there would find (`check`'s look, after a failover): a reader as `config` names it
/// (under a server id of its own) is started there, and given [`GTID_PROBE`] to be refused.
/// A state ahead of the log, which MariaDB may wait for, is not told this way. Only a
/// refusal counts: any other failure (the server unreachable, a privilege missing) is left
/// to the start that meets it, which retries or names it.
pub async fn gtid_resume_refused(config: &BinlogConfig, gtid: &str) -> Option<BinlogError> {
    let refused = |e: BinlogError| match e {
        BinlogError::GtidNotInLog { .. } | BinlogError::Purged { .. } => Some(e),
        other => {
            tracing::debug!(error = %other, "looking whether the server continues the stored GTID state");
            None
        }
    };
    let mut reader = match BinlogReader::start_after_gtid(config, gtid).await {
        Ok(reader) => reader,
        Err(e) => return refused(e),
    };
    match tokio::time::timeout(GTID_PROBE, reader.next()).await {
        Ok(Err(e)) => refused(e),
        Ok(Ok(_)) | Err(_) => None,
    }
}

/// Whether the server's log at `stored` (a place in this server's log) is another than the
/// one the relay read there: its GTID state there (MariaDB's `BINLOG_GTID_POS`) is not the
/// one stored with the place (the log was reset, or the server rebuilt with the same
/// `server_id`). `None` when they agree, or when either is unknown (MySQL, a place stored
/// without its state), as a reader starting there decides.
pub async fn reset_log_refused(url: &str, stored: &BinlogPosition) -> Option<BinlogError> {
    stored.gtid.as_ref()?;
    let mut conn = Conn::new(opts(url).ok()?).await.ok()?;
    let said = reader::gtid_state_said_at(&mut conn, stored).await;
    let _ = conn.disconnect().await;
    reader::start_gtid_state(said, stored).err()
}

/// The server's `@@server_id`: whose binary log a position is in.
pub async fn server_id(url: &str) -> Result<u64> {
    let mut conn = Conn::new(opts(url)?).await?;
    let id: Option<u64> = conn.query_first("SELECT @@server_id").await?;
    conn.disconnect().await?;
    Ok(id.unwrap_or_default())
}

/// The binary log's current end, where a new reader starts. On MySQL it carries the GTID
/// set executed there, which must name exactly the transactions before the position: one
/// left out would be asked for again at a promoted replica (which fails once that replica
/// purged it), one named after it would be skipped there.
/// - MySQL 8.0.14+ gives both under one lock in `performance_schema.log_status` (for a role
///   with `BACKUP_ADMIN`).
/// - Otherwise `SHOW MASTER STATUS` (`SHOW BINARY LOG STATUS` on 8.4) reads its
///   `Executed_Gtid_Set` apart from the position: a transaction written to the log and not
///   yet committed is before the position and not in the set. MySQL then stores no set,
///   and a failover is refused rather than guessed (see [`capture::resume`]).
/// - MariaDB's statement has no set: its reader asks `BINLOG_GTID_POS` for the position.
pub async fn current_position(url: &str) -> Result<BinlogPosition> {
    let mut conn = Conn::new(opts(url)?).await?;
    let consistent: Option<String> = conn
        .query_first("SELECT CAST(`LOCAL` AS CHAR) FROM performance_schema.log_status")
        .await
        .ok()
        .flatten();
    if let Some(position) = consistent.as_deref().and_then(log_status_position) {
        conn.disconnect().await?;
        return Ok(position);
    }
    let row: Option<mysql_async::Row> = match conn.query_first("SHOW MASTER STATUS").await {
        // MySQL 8.4 has only its new name (MariaDB and MySQL before 8.2 only the old one).
        Err(mysql_async::Error::Server(e)) if e.code == PARSE_ERROR => {
            conn.query_first("SHOW BINARY LOG STATUS").await?
        }
        row => row?,
    };
    conn.disconnect().await?;
    match row {
        Some(row) => {
            let file: String = row.get(0).unwrap_or_default();
            let offset: u64 = row.get(1).unwrap_or_default();
            if file.is_empty() {
                return Err(no_binary_log());
            }
            Ok(BinlogPosition::at(file, offset))
        }
        None => Err(no_binary_log()),
    }
}

fn no_binary_log() -> BinlogError {
    BinlogError::Config(
        "the server writes no binary log: start it with log_bin (and binlog_format = ROW)".into(),
    )
}

/// The position in `performance_schema.log_status`'s `LOCAL` column (MySQL 8.0.14+):
/// `{"gtid_executed": "…", "binary_log_file": "…", "binary_log_position": N}`. An empty
/// `gtid_executed` is a known, empty state (the server wrote no GTID yet).
fn log_status_position(local: &str) -> Option<BinlogPosition> {
    let local: serde_json::Value = serde_json::from_str(local).ok()?;
    let file = local.get("binary_log_file")?.as_str()?;
    let offset = local.get("binary_log_position")?.as_u64()?;
    let gtid = local.get("gtid_executed")?.as_str()?;
    let state = gtid::GtidState::parse(gtid)?;
    (!file.is_empty()).then(|| BinlogPosition {
        gtid: Some(state.to_string()),
        ..BinlogPosition::at(file, offset)
    })
}

/// What the server lacks for binlog capture of an outbox in `database`, each with its fix
/// (`check --capture binlog` will list them): a binary log, in rows, with whole row images,
/// that logs `database`, written durably, and a role that may read it as a replica.
pub async fn server_problems(url: &str, database: &str) -> Result<Vec<Problem>> {
    let mut conn = Conn::new(opts(url)?).await?;
    let durability: Vec<(String, String)> = conn
        .query(
            "SHOW GLOBAL VARIABLES
              WHERE Variable_name IN ('sync_binlog', 'innodb_flush_log_at_trx_commit')",
        )
        .await?;
    let filters = logged_database_filters(&mut conn).await;
    let settings: Option<(String, String, String)> = conn
        .query_first(
            "SELECT CAST(@@GLOBAL.log_bin AS CHAR), @@GLOBAL.binlog_format, @@GLOBAL.binlog_row_image",
        )
        .await?;
    let mut grants: Vec<String> = conn.query("SHOW GRANTS").await?;
    // MySQL 8 lists a role's privileges only when asked for them (MariaDB lists those of
    // the role in use): a role's replication privileges were taken for missing.
    if !is_mariadb(&mut conn).await? {
        // No such function before MySQL 8: no roles either.
        let roles: Option<Option<String>> = conn
            .query_first("SELECT CURRENT_ROLE()")
            .await
            .ok()
            .flatten();
        if let Some(statement) = grants_with_roles(roles.flatten().as_deref()) {
            if let Ok(with_roles) = conn.query::<String, _>(statement).await {
                grants = with_roles;
            }
        }
    }
    // Compression that binlog capture does not read: MariaDB's compressed events (MySQL
    // 8.0.20+'s compressed transactions are read). MySQL has no such variable.
    let compressions: Vec<(String, String)> = conn
        .query("SHOW GLOBAL VARIABLES WHERE Variable_name = 'log_bin_compress'")
        .await?;
    // MariaDB 10.5+ and MySQL 8.0.1+: FULL logs each column's name in the table maps.
    let metadata: Vec<(String, String)> = conn
        .query("SHOW GLOBAL VARIABLES WHERE Variable_name = 'binlog_row_metadata'")
        .await?;
    let expiry: Vec<(String, String)> = conn
        .query(
            "SHOW GLOBAL VARIABLES
              WHERE Variable_name IN ('binlog_expire_logs_seconds', 'expire_logs_days')",
        )
        .await?;
    conn.disconnect().await?;
    let (log_bin, format, image) = settings.unwrap_or_default();
    let mut problems = Vec::new();
    if log_bin != "1" && !log_bin.eq_ignore_ascii_case("on") {
        problems.push(Problem::blocking(
            "the server writes no binary log (log_bin is off)",
            "start it with log_bin (MariaDB: --log-bin; MySQL 8 has it on by default) and a server_id",
        ));
    }
    if !format.eq_ignore_ascii_case("ROW") {
        problems.push(Problem::blocking(
            format!("binlog_format is {format}: the binary log holds statements, not the rows inserted"),
            "SET GLOBAL binlog_format = 'ROW' and put binlog_format = ROW in the server's configuration",
        ));
    }
    if !image.eq_ignore_ascii_case("FULL") {
        problems.push(Problem::blocking(
            format!("binlog_row_image is {image}: inserted rows may come without every column"),
            "SET GLOBAL binlog_row_image = 'FULL' and put it in the server's configuration",
        ));
    }
    for (variable, value) in compressions {
        if value.eq_ignore_ascii_case("ON") {
            problems.push(Problem::blocking(
                format!(
                    "{variable} is ON: the server writes compressed events, which binlog \
                     capture does not read (it stops at the first rather than skip it)"
                ),
                format!("SET GLOBAL {variable} = OFF and put it in the server's configuration"),
            ));
        }
    }
    for (variable, value) in metadata {
        if !value.eq_ignore_ascii_case("FULL") {
            // MINIMAL logs the columns' character sets, NO_LOG nothing.
            let charsets = match value.eq_ignore_ascii_case("MINIMAL") {
                true => "",
                false => {
                    ", and no character set: rows written before an ALTER TABLE … CONVERT \
                     TO CHARACTER SET and read after it (after a restart) are read in the \
                     new one, garbled"
                }
            };
            problems.push(Problem::advisory(
                format!(
                    "{variable} is {value}: the binary log names no column, so an ALTER TABLE \
                     of the outbox that swaps two columns of one type while rows are unread \
                     is not seen (a changed count or type is), and their values would be \
                     read under each other's names{charsets}"
                ),
                format!("SET GLOBAL {variable} = 'FULL' and put it in the server's configuration"),
            ));
        }
    }
    problems.extend(retention_advice(&expiry));
    if let Some((logged_only, ignored)) = filters {
        let listed = |list: &str| list.split(',').any(|name| name.trim() == database);
        if listed(&ignored) || (!logged_only.trim().is_empty() && !listed(&logged_only)) {
            problems.push(Problem::blocking(
                format!(
                    "the server logs no change to the database {database} (binlog_ignore_db \
                     {ignored:?}, binlog_do_db {logged_only:?}): the outbox's rows never reach \
                     the binary log, and would wait in the table for good"
                ),
                format!(
                    "remove {database} from the server's binlog-ignore-db (or add it to \
                     binlog-do-db) and restart it, or use --capture poll"
                ),
            ));
        }
    }
    for (variable, value) in durability {
        if value.trim() != "1" {
            // At 0 InnoDB writes its log about once a second, not at commit: the server's
            // process alone dying loses what the binary log already holds (reproduced with
            // kill -9 of mariadbd: thousands of events delivered, their rows gone).
            let crash = match (variable.as_str(), value.trim()) {
                ("innodb_flush_log_at_trx_commit", "0") => {
                    "a crash of the server's process alone (an OOM kill, kill -9, a bug), not \
                     only of its host,"
                }
                _ => "a crash of the server's host",
            };
            problems.push(Problem::advisory(
                format!(
                    "{variable} is {value}: {crash} can lose the last transactions of its \
                     log, or of its tables, after the relay delivered their events (events of \
                     transactions the recovery undid), and leave the stored position past the \
                     log's end"
                ),
                format!("SET GLOBAL {variable} = 1 and put it in the server's configuration"),
            ));
        }
    }
    // `GRANT role TO user` (no ON): a role granted, not in use at login.
    let role_granted = grants.iter().any(|line| {
        let line = line.to_ascii_uppercase();
        line.starts_with("GRANT ") && !line.contains(" ON ")
    });
    for (privilege, why) in [
        ("REPLICATION SLAVE", "to read the binary log"),
        ("REPLICATION CLIENT", "to read its position"),
    ] {
        if !granted(&grants, privilege) {
            let fix = match role_granted {
                true => format!(
                    "GRANT {privilege} ON *.* TO <the relay's role>; given through a role, \
                     the role must be in use at login: SET DEFAULT ROLE ALL TO <the relay's \
                     user> (MySQL), SET DEFAULT ROLE <role> FOR <the relay's user> (MariaDB)"
                ),
                false => format!("GRANT {privilege} ON *.* TO <the relay's role>"),
            };
            problems.push(Problem::blocking(
                format!("the role lacks {privilege}, which it needs {why}"),
                fix,
            ));
        }
    }
    Ok(problems)
}

/// The name a reader registers under (its `report_host`, which `SHOW SLAVE HOSTS` lists
/// beside its server id): `outbox-relay <database>.<table>`, so that `check` tells this
/// outbox's relay from another reader registered under the same id.
pub fn registered_name(config: &BinlogConfig) -> String {
    outbox_core::ident::server_lock_name(
        "outbox-relay ",
        &format!("{}.{}", config.database, config.table),
    )
}

/// Another reader of the server's binary log registered under `config.server_id`, each with
/// its fix. The server keeps one reader per server id: a second one ends the first's
/// session, which reconnects and ends the second's, and neither reads for long (a replica's
/// replication flaps with the relay's). Registered readers only (replicas, relays):
/// `mariadb-binlog` does not register. Where the role may not list them (MariaDB 10.5+ asks
/// REPLICATION MASTER ADMIN), nothing is said.
pub async fn server_id_problems(config: &BinlogConfig) -> Result<Vec<Problem>> {
    let mut conn = Conn::new(opts(&config.url)?).await?;
    let mut readers = Vec::new();
    // MySQL 8.4 knows only the first; MariaDB and MySQL 8.0 the second.
    for statement in ["SHOW REPLICAS", "SHOW SLAVE HOSTS"] {
        if let Ok(rows) = conn.query::<mysql_async::Row, _>(statement).await {
            readers = rows;
            break;
        }
    }
    conn.disconnect().await?;
    let ours = registered_name(config);
    let id = config.server_id;
    let fix = "give the relay a binlog_server_id (--binlog-server-id) no other replica or \
               relay of the server uses, or leave it unset: each outbox then derives its own \
               from its database and table";
    let mut problems = Vec::new();
    // Server_id, Host and Port lead both statements' columns.
    for row in &readers {
        // `get_opt`: `get` panics on a value it cannot convert (a NULL host).
        let column = |i: usize| {
            row.get_opt::<Option<String>, _>(i)
                .and_then(|value| value.ok())
                .flatten()
        };
        if column(0).and_then(|s| s.parse::<u64>().ok()) != Some(u64::from(id)) {
            continue;
        }
        let host = column(1).unwrap_or_default();
        let port = column(2).unwrap_or_default();
        let collides = "the server keeps one reader per server id, so each ends the other's \
                        session and neither reads for long";
        if host == ours {
            continue;
        }
        problems.push(if let Some(outbox) = host.strip_prefix("outbox-relay ") {
            Problem::blocking(
                format!(
                    "the relay of another outbox ({outbox}) reads this server's binary log as \
                     server id {id} too: {collides}"
                ),
                fix,
            )
        } else if host.is_empty() {
            Problem::advisory(
                format!(
                    "a reader registered without a name reads this server's binary log as \
                     server id {id}: a replica without report_host, or a relay older than \
                     this one; if it is not this outbox's relay, {collides}"
                ),
                fix,
            )
        } else {
            Problem::blocking(
                format!(
                    "the replica {host}:{port} reads this server's binary log as server id \
                     {id}: {collides}"
                ),
                fix,
            )
        });
    }
    Ok(problems)
}

/// Below this, the server's binary log retention is said by `check`: a relay stopped for a
/// weekend, or a failed deploy left over a night, outlives the logs it reads on from.
const SHORTEST_RETENTION: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// The server's binary log retention (`binlog_expire_logs_seconds`, or else
/// `expire_logs_days`; 0 for both keeps the logs until purged by hand), said when shorter
/// than [`SHORTEST_RETENTION`]: how long the relay may be off before its stored position is
/// purged, and it must adopt the rows still in the table (or, table-less, lose the events).
fn retention_advice(variables: &[(String, String)]) -> Option<Problem> {
    let value = |name: &str| {
        variables
            .iter()
            .find(|(variable, _)| variable.eq_ignore_ascii_case(name))
            .and_then(|(_, value)| value.trim().parse::<f64>().ok())
            .filter(|value| *value > 0.0)
    };
    let seconds = value("binlog_expire_logs_seconds")
        .or_else(|| value("expire_logs_days").map(|days| days * 86_400.0))?;
    let kept = std::time::Duration::from_secs_f64(seconds);
    (kept < SHORTEST_RETENTION).then(|| {
        Problem::advisory(
            format!(
                "the server keeps its binary logs for {}: a relay off longer than that finds \
                 its stored position purged, and must adopt the rows still in the table (a \
                 BLACKHOLE outbox's events are lost)",
                humantime::format_duration(kept)
            ),
            "SET GLOBAL binlog_expire_logs_seconds = 604800 (a week; expire_logs_days = 7 on \
             older servers) and put it in the server's configuration, or keep the relay's \
             downtime shorter",
        )
    })
}

/// The server's `binlog-do-db` and `binlog-ignore-db` lists (comma-separated, empty for
/// none); `None` where the role may not read them (they are then not checked).
async fn logged_database_filters(conn: &mut Conn) -> Option<(String, String)> {
    // MySQL 8.4 renamed the statement; MariaDB and MySQL 8.0 know the old name.
    for statement in ["SHOW MASTER STATUS", "SHOW BINARY LOG STATUS"] {
        if let Ok(Some(row)) = conn.query_first::<mysql_async::Row, _>(statement).await {
            let column = |name: &str| {
                row.get_opt::<Option<String>, _>(name)
                    .and_then(|value| value.ok())
                    .flatten()
                    .unwrap_or_default()
            };
            return Some((column("Binlog_Do_DB"), column("Binlog_Ignore_DB")));
        }
    }
    None
}

/// Whether the server is MariaDB (not MySQL).
pub(crate) async fn is_mariadb(conn: &mut Conn) -> Result<bool> {
    let version: Option<String> = conn.query_first("SELECT VERSION()").await?;
    Ok(version.is_some_and(|v| v.contains("MariaDB")))
}

/// MySQL's statement listing the session's privileges with those of its roles in use,
/// given `CURRENT_ROLE()`'s answer (`` `r1`@`%`,`r2`@`%` ``, or `NONE`); `None` without a
/// role in use.
fn grants_with_roles(current_roles: Option<&str>) -> Option<String> {
    let roles = current_roles?.trim();
    (!roles.is_empty() && !roles.eq_ignore_ascii_case("NONE"))
        .then(|| format!("SHOW GRANTS FOR CURRENT_USER() USING {roles}"))
}

/// Whether `SHOW GRANTS`' lines give `privilege` (or ALL PRIVILEGES) on `*.*`. MariaDB
/// 10.5+ spells REPLICATION CLIENT as BINLOG MONITOR, and grants either name.
fn granted(grants: &[String], privilege: &str) -> bool {
    let aliases: &[&str] = match privilege {
        "REPLICATION CLIENT" => &["REPLICATION CLIENT", "BINLOG MONITOR"],
        other => &[other],
    };
    grants.iter().any(|line| {
        let line = line.to_ascii_uppercase();
        let Some((privileges, on)) = line.split_once(" ON ") else {
            return false;
        };
        on.trim_start().starts_with("*.*")
            && (privileges.contains("ALL PRIVILEGES")
                || aliases.iter().any(|alias| privileges.contains(alias)))
    })
}

pub(crate) fn opts(url: &str) -> Result<Opts> {
    let url = match url.strip_prefix("mariadb://") {
        Some(rest) => format!("mysql://{rest}"),
        None => url.to_string(),
    };
    Opts::from_url(&url)
        .map_err(|e| BinlogError::Config(format!("the database URL cannot be parsed: {e}")))
}

/// The database a `mysql://` (or `mariadb://`) URL names.
pub fn database_of(url: &str) -> Result<String> {
    opts(url)?.db_name().map(str::to_string).ok_or_else(|| {
        BinlogError::Config(
            "the database URL names no database: use mysql://user:password@host:port/database"
                .into(),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A retention under a day is said, in the server's own variable or its older one; none
    /// (0: kept until purged by hand) or a week is not.
    #[test]
    fn a_binary_log_retention_under_a_day_is_said() {
        let vars = |seconds: &str, days: &str| {
            vec![
                (
                    "binlog_expire_logs_seconds".to_string(),
                    seconds.to_string(),
                ),
                ("expire_logs_days".to_string(), days.to_string()),
            ]
        };
        let said = retention_advice(&vars("3600", "0")).expect("an hour is said");
        assert!(said.what.contains("1h"), "{said}");
        assert!(!said.fails_check());
        assert!(retention_advice(&vars("0", "0.5")).is_some(), "half a day");
        assert!(
            retention_advice(&vars("0", "0")).is_none(),
            "kept until purged"
        );
        assert!(retention_advice(&vars("604800", "0")).is_none());
        assert!(retention_advice(&vars("0", "7")).is_none());
        assert!(retention_advice(&[]).is_none());
    }

    /// MySQL 8's `SHOW GRANTS` lists `GRANT role TO user` without the role's privileges:
    /// asked again with the roles in use, as `CURRENT_ROLE()` names them.
    #[test]
    fn a_mysql_roles_privileges_are_asked_for_with_the_roles_in_use() {
        assert_eq!(
            grants_with_roles(Some("`relay_role`@`%`,`reader`@`%`")).as_deref(),
            Some("SHOW GRANTS FOR CURRENT_USER() USING `relay_role`@`%`,`reader`@`%`")
        );
        assert_eq!(grants_with_roles(Some("NONE")), None);
        assert_eq!(grants_with_roles(None), None);
        let with_role = [
            "GRANT USAGE ON *.* TO `relay`@`%`".to_string(),
            "GRANT REPLICATION SLAVE, REPLICATION CLIENT ON *.* TO `relay`@`%`".to_string(),
            "GRANT `relay_role`@`%` TO `relay`@`%`".to_string(),
        ];
        assert!(granted(&with_role, "REPLICATION SLAVE"));
        assert!(granted(&with_role, "REPLICATION CLIENT"));
    }

    #[test]
    fn a_stored_position_is_checked_against_every_log_the_server_lists() {
        let at = |file: &str, offset: u64| BinlogPosition::at(file, offset);
        let logs = |files: &[&str]| -> Vec<(String, u64)> {
            files.iter().map(|f| (f.to_string(), 1000)).collect()
        };
        let three = logs(&["bin.000010", "bin.000011", "bin.000012"]);
        let severity = |p: Option<Problem>| p.map(|p| (p.severity(), p.what));
        use outbox_core::store::Severity::{Advisory, Blocking, Degraded};

        // The only log, or the newest, is never purged: no problem at all.
        assert_eq!(
            retention_problem(&at("bin.000010", 500), &logs(&["bin.000010"]), false),
            None
        );
        assert_eq!(
            retention_problem(&at("bin.000010", 500), &logs(&["bin.000010"]), true),
            None
        );
        assert_eq!(
            retention_problem(&at("bin.000012", 1000), &three, true),
            None
        );
        assert_eq!(retention_problem(&at("bin.000011", 4), &three, false), None);
        // The oldest of several: a warning, which fails `check` for a BLACKHOLE outbox.
        let (kind, what) =
            severity(retention_problem(&at("bin.000010", 4), &three, false)).unwrap();
        assert_eq!(kind, Advisory, "{what}");
        assert!(what.contains("next purge"), "{what}");
        let (kind, what) = severity(retention_problem(&at("bin.000010", 4), &three, true)).unwrap();
        assert_eq!(kind, Degraded, "{what}");
        assert!(what.contains("BLACKHOLE"), "{what}");
        // Before the oldest, by number (999999 rolls over to 1000000): purged.
        let (kind, what) =
            severity(retention_problem(&at("bin.000009", 4), &three, false)).unwrap();
        assert_eq!(kind, Blocking);
        assert!(what.contains("purged"), "{what}");
        assert_eq!(
            retention_problem(
                &at("bin.1000000", 4),
                &logs(&["bin.999999", "bin.1000000"]),
                false
            ),
            None
        );
        // A file the server never had: reset, renamed, or another server's.
        for gone in [
            at("bin.999999", 4),
            at("other-bin.000001", 4),
            at("bin.000013", 4),
        ] {
            let (kind, what) = severity(retention_problem(&gone, &three, false)).unwrap();
            assert_eq!(kind, Blocking, "{what}");
            assert!(what.contains("not in this server's binary logs"), "{what}");
        }
        // Past the end of a file it has: not the log the position was read in.
        let (kind, what) =
            severity(retention_problem(&at("bin.000012", 1001), &three, false)).unwrap();
        assert_eq!(kind, Blocking);
        assert!(what.contains("past the end"), "{what}");
        let (kind, _) = severity(retention_problem(&at("bin.000001", 4), &[], false)).unwrap();
        assert_eq!(kind, Blocking, "no log at all");
    }

    #[test]
    fn mysqls_log_status_gives_the_position_with_its_gtid_set() {
        let a = "3e11fa47-71ca-11e1-9e33-c80aa9429562";
        let local = format!(
            r#"{{"gtid_executed": "{a}:1-7,\n{a}:9", "binary_log_file": "binlog.000004", "binary_log_position": 1530}}"#
        );
        assert_eq!(
            log_status_position(&local),
            Some(BinlogPosition {
                file: "binlog.000004".into(),
                offset: 1530,
                gtid: Some(format!("{a}:1-7:9")),
            })
        );
        let fresh = r#"{"gtid_executed": "", "binary_log_file": "binlog.000001", "binary_log_position": 157}"#;
        assert_eq!(
            log_status_position(fresh).and_then(|p| p.gtid),
            Some(String::new()),
            "a server with no GTID yet has a known, empty state"
        );
        assert_eq!(log_status_position(r#"{"binary_log_file": ""}"#), None);
        assert_eq!(log_status_position("not json"), None);
    }

    #[test]
    fn replication_privileges_are_read_from_show_grants_lines() {
        let grants = |lines: &[&str]| lines.iter().map(|l| l.to_string()).collect::<Vec<_>>();
        let relay = grants(&[
            "GRANT REPLICATION SLAVE, BINLOG MONITOR ON *.* TO `relay`@`%`",
            "GRANT SELECT ON `app`.* TO `relay`@`%`",
        ]);
        assert!(granted(&relay, "REPLICATION SLAVE"));
        assert!(
            granted(&relay, "REPLICATION CLIENT"),
            "BINLOG MONITOR is its MariaDB name"
        );
        let root = grants(&["GRANT ALL PRIVILEGES ON *.* TO `root`@`localhost` WITH GRANT OPTION"]);
        assert!(granted(&root, "REPLICATION SLAVE"));
        let schema_only = grants(&["GRANT ALL PRIVILEGES ON `app`.* TO `app`@`%`"]);
        assert!(!granted(&schema_only, "REPLICATION SLAVE"), "not on *.*");
    }
}
