//! Embedded SQLite outbox store: the zero-configuration default (`./outbox.db`).
//!
//! It keeps the PostgreSQL store's semantics (leases, per-key blocking, retries, dead
//! letters) in the same table layout, with times as Unix milliseconds. SQLite has no
//! NOTIFY: [`OutboxStore::subscribe`] watches `PRAGMA data_version` on its own connection,
//! which changes whenever another connection commits, so a poll costs one tiny read.
//! rusqlite is synchronous, so every operation runs on a blocking thread.

use outbox_core::time::millis;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_core::event::headers_from_json_text;
use outbox_core::store::{
    Backlog, ClaimRequest, Claimed, DeadLetter, Heartbeat, Heartbeated, Incarnation,
    LeaseExtension, LeaseHolder, NodeRecord, NodeRegistry, NodeRow, OnChange, Problem,
    Registration, RetryLater, StoreFuture, StoreResult,
};
use outbox_core::{
    Event, NewEvent, NodeId, OutboxStore, Payload, SequenceId, StoreError, StoreErrorKind,
};
use rusqlite::types::ValueRef;
use rusqlite::{params, Connection, OptionalExtension, Row};
use uuid::Uuid;

mod ops;
pub mod schema;

/// How often the wake-up task reads `PRAGMA data_version`.
pub const DEFAULT_CHANGE_POLL: Duration = Duration::from_millis(10);

const DDL: &str = r#"
CREATE TABLE IF NOT EXISTS outbox (
    sequence_id   INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id      TEXT NOT NULL UNIQUE DEFAULT (lower(
                      hex(randomblob(4)) || '-' || hex(randomblob(2)) || '-4' ||
                      substr(hex(randomblob(2)), 2) || '-' ||
                      substr('89ab', 1 + (abs(random()) % 4), 1) ||
                      substr(hex(randomblob(2)), 2) || '-' || hex(randomblob(6)))),
    destination   TEXT NOT NULL,
    partition_key TEXT,
    event_type    TEXT NOT NULL,
    payload       TEXT,                                  -- JSON text
    headers       TEXT NOT NULL DEFAULT '{}',            -- JSON object
    mutation_id   TEXT,
    rejected      INTEGER NOT NULL DEFAULT 0,
    created_at    INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    available_at  INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    attempts      INTEGER NOT NULL DEFAULT 0,
    last_error    TEXT,
    locked_by     TEXT,
    locked_until  INTEGER,
    delivered_at  INTEGER
);
CREATE INDEX IF NOT EXISTS outbox_pending_idx ON outbox (sequence_id) WHERE delivered_at IS NULL;
CREATE INDEX IF NOT EXISTS outbox_blocking_idx ON outbox (coalesce(partition_key, destination), sequence_id)
    WHERE delivered_at IS NULL AND (locked_by IS NOT NULL OR attempts > 0);
CREATE TABLE IF NOT EXISTS outbox_dead_letters (
    sequence_id   INTEGER PRIMARY KEY,
    event_id      TEXT NOT NULL,
    destination   TEXT NOT NULL,
    partition_key TEXT,
    event_type    TEXT NOT NULL,
    payload       TEXT,
    headers       TEXT NOT NULL DEFAULT '{}',
    mutation_id   TEXT,
    rejected      INTEGER NOT NULL DEFAULT 0,
    created_at    INTEGER NOT NULL,
    attempts      INTEGER NOT NULL,
    last_error    TEXT NOT NULL,
    dead_at       INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS outbox_nodes (
    id     TEXT PRIMARY KEY,
    expiry TIMESTAMP NOT NULL                            -- Unix milliseconds
);
"#;

/// Since when the oldest pending row has waited to go out, in ms (`?1` now): a row that
/// failed since its creation; one never tried since it became due, and not at all while it
/// is scheduled for later. From `created_at` alone, an event scheduled for tomorrow aged the
/// backlog from its insert, and the oldest-pending alert fired on it.
pub(crate) const WAITING_SINCE: &str = "min(CASE
        WHEN typeof(created_at) <> 'integer' THEN NULL
        WHEN attempts > 0 OR typeof(available_at) <> 'integer' THEN created_at
        WHEN available_at <= ?1 THEN max(created_at, available_at)
    END)";

/// The rows a claim may take: pending, due, unleased (`?2` is now), and those `$blocking` (a
/// condition on `o`, with `?1` the node) lets through. A text or blob `available_at` is
/// claimed to be dead-lettered, saying why; a NULL one (a table made without the NOT NULL)
/// is due: never claimed, it held nothing back, and its key's later rows went out.
macro_rules! claimable {
    ($blocking:expr) => {
        concat!(
            "o.delivered_at IS NULL
       AND (o.available_at <= ?2 OR typeof(o.available_at) IN ('text', 'blob', 'null'))
       AND (o.locked_until IS NULL OR o.locked_until < ?2)",
            $blocking
        )
    };
}

/// A claim in two statements. The first picks up to `?3` claimable rows in order, read
/// outside the write lock: it may walk every row a stuck key holds back, and under the lock
/// that walk kept the application's inserts waiting. The second, under the write lock,
/// leases to `?1` for `?4` ms those of the picked rows (`?3`, a JSON array) that are still
/// claimable, checked again as it takes them.
///
/// SQLite keeps a key (or destination) written as bytes as a BLOB, which SQL never finds
/// equal to the same text, while the relay reads both as one key. The lease turns a BLOB
/// key into text, so every row that can hold a key back (leased, or tried) holds text, and
/// the rows checked against them are compared as text (`ordered_blocking!`): `|| ''`,
/// which makes text with no affinity, unlike `CAST(… AS TEXT)`, whose TEXT affinity kept
/// the planner from the key's index (a walk of every pending row below each one claimed).
macro_rules! claim_sql {
    ($blocking:expr, $crowded:expr) => {
        (
            concat!(
                "SELECT o.sequence_id FROM outbox o WHERE ",
                claimable!($blocking),
                $crowded,
                " ORDER BY o.sequence_id LIMIT ?3"
            ),
            concat!(
                "
UPDATE outbox SET locked_by = ?1, locked_until = ?2 + ?4,
       partition_key = CASE typeof(partition_key)
           WHEN 'blob' THEN CAST(partition_key AS TEXT) ELSE partition_key END,
       destination = CASE typeof(destination)
           WHEN 'blob' THEN CAST(destination AS TEXT) ELSE destination END
 WHERE sequence_id IN (
    SELECT o.sequence_id FROM outbox o
     WHERE o.sequence_id IN (SELECT value FROM json_each(?3))
       AND ",
                claimable!($blocking),
                ")
RETURNING sequence_id, event_id, destination, partition_key, event_type, payload, headers,
          mutation_id, rejected, attempts, created_at, available_at"
            ),
        )
    };
}

/// What holds a row back behind its key under per-key order.
macro_rules! ordered_blocking {
    () => {
        "
       AND NOT EXISTS (
           SELECT 1 FROM outbox p
            WHERE coalesce(p.partition_key, p.destination)
                  = (coalesce(o.partition_key, o.destination) || '')
              AND p.sequence_id < o.sequence_id
              AND p.delivered_at IS NULL
              AND (p.locked_by IS NOT NULL OR p.attempts > 0)
              AND (p.available_at > ?2 OR (p.locked_until > ?2 AND p.locked_by <> ?1)))"
    };
}

/// Unordered claims (`--ordering none`) leave out the per-key blocking.
const CLAIM_UNORDERED: (&str, &str) = claim_sql!("", "");

/// SQLite is the single-node store: claims ignore partition fences.
const CLAIM: (&str, &str) = claim_sql!(ordered_blocking!(), "");

/// [`CLAIM`] leaving out the crowded keys (`?4`, a JSON array), and looking no further than
/// the first `?5` claimable rows (`outbox_core::store::Crowded`): an uncorrelated subquery,
/// evaluated once, that bounds the rowid range walked.
const CLAIM_CROWDED: (&str, &str) = claim_sql!(
    ordered_blocking!(),
    "
       AND (coalesce(o.partition_key, o.destination) || '')
           NOT IN (SELECT value FROM json_each(?4))
       AND o.sequence_id <= (SELECT coalesce(max(w.sequence_id), 0) FROM (
             SELECT sequence_id FROM outbox
              WHERE delivered_at IS NULL AND (locked_until IS NULL OR locked_until < ?2)
              ORDER BY sequence_id LIMIT ?5) w)"
);

/// The SQLite store. Cheap to clone.
#[derive(Clone)]
pub struct SqliteStore {
    conn: Arc<Mutex<Connection>>,
    path: PathBuf,
    retain_delivered: bool,
    /// The database file opened, and its identity then (none in memory).
    opened: Option<Arc<OpenedFile>>,
    /// The ping's own read-only connection to that file: on `conn`, a ping queued behind the
    /// relay's writes, which wait (up to the busy timeout) while the application holds the
    /// write lock, and `/readyz` said the database did not answer while it was readable.
    ping: Option<Arc<Mutex<Connection>>>,
}

/// The file a connection has open, as it was when opened: a file removed or replaced at its
/// path (an application that made its database again) is not the one the relay reads, and
/// the relay saw none of the new file's events while it claimed from the old one, ready.
struct OpenedFile {
    /// The file SQLite resolved, and the path as configured when it names the same file
    /// (a symbolic link re-pointed, as an atomic deploy does, is a replacement too).
    paths: Vec<PathBuf>,
    identity: (u64, u64),
}

impl OpenedFile {
    fn of(conn: &Connection, configured: &Path) -> Option<OpenedFile> {
        let file: String = conn
            .query_row(
                "SELECT file FROM pragma_database_list WHERE name = 'main'",
                [],
                |r| r.get(0),
            )
            .ok()?;
        let resolved = PathBuf::from(file);
        let identity = file_identity(&resolved).ok()?;
        let mut paths = vec![resolved];
        if file_identity(configured).is_ok_and(|found| found == identity) {
            paths.push(configured.to_path_buf());
        }
        Some(OpenedFile { paths, identity })
    }

    /// A read-only connection of its own to the file (for the ping).
    fn reader(&self) -> rusqlite::Result<Connection> {
        let reader = Connection::open_with_flags(
            &self.paths[0],
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        reader.busy_timeout(Duration::from_secs(2))?;
        Ok(reader)
    }

    /// Whether its paths still name the file opened.
    fn still_at_its_path(&self) -> StoreResult<()> {
        for path in &self.paths {
            if !file_identity(path).is_ok_and(|identity| identity == self.identity) {
                return Err(StoreError::new(
                    StoreErrorKind::Connection,
                    format!(
                        "the database file {} was removed or replaced since the relay opened \
                         it: the relay reads the old file and sees none of the new one's \
                         events; restart the relay",
                        path.display()
                    ),
                ));
            }
        }
        Ok(())
    }
}

fn file_identity(path: &Path) -> std::io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path)?;
    Ok((meta.dev(), meta.ino()))
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn sql_error(context: &str, error: rusqlite::Error) -> StoreError {
    use rusqlite::ErrorCode;
    let kind = match error.sqlite_error_code() {
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => StoreErrorKind::Conflict,
        Some(ErrorCode::CannotOpen | ErrorCode::NotADatabase) => StoreErrorKind::Config,
        Some(ErrorCode::ReadOnly | ErrorCode::PermissionDenied) => StoreErrorKind::Privilege,
        Some(ErrorCode::DatabaseCorrupt) => StoreErrorKind::Corrupt,
        // A foreign key, a unique or check constraint, a trigger's RAISE(ABORT).
        Some(ErrorCode::ConstraintViolation) => StoreErrorKind::RowRefused,
        _ if error.to_string().contains("no such table") => StoreErrorKind::MissingSchema,
        _ => StoreErrorKind::Query,
    };
    // SQLite has no roles to grant to: the file system decides.
    let read_only = matches!(
        error.sqlite_error_code(),
        Some(ErrorCode::ReadOnly | ErrorCode::PermissionDenied)
    );
    let code = error.sqlite_error_code();
    let e = StoreError::new(kind, format!("{context}: {error}")).with_source(error);
    if read_only {
        e.with_hint(READ_ONLY_HINT)
    } else if code == Some(ErrorCode::CannotOpen) {
        e.with_hint(CANNOT_OPEN_HINT)
    } else if code == Some(ErrorCode::NotADatabase) {
        // Its fix named "the configuration value named in the message", which named none.
        e.with_hint(NOT_A_DATABASE_HINT)
    } else {
        e
    }
}

/// The fix for a file that is no SQLite database.
const NOT_A_DATABASE_HINT: &str = "the file is not an SQLite database (or is corrupt, or \
    encrypted): point database_url (--database-url, DATABASE_URL) at the outbox's database, \
    sqlite:PATH";

/// The fix for a database file SQLite can neither open nor create.
const CANNOT_OPEN_HINT: &str = "the file cannot be opened or created there: check that its \
    directory exists and the relay's user may write it, or point database_url \
    (--database-url, DATABASE_URL) at sqlite:PATH in a writable directory";

/// The fix for a database SQLite may not write.
pub const READ_ONLY_HINT: &str = "the database file or its directory is read-only for the \
    relay's user: make both writable by it (chmod u+w, or chown); SQLite writes its -wal and \
    -shm files beside the database (or drop mode=ro from a file: URL)";

/// The mode of a database file the relay creates: the outbox holds business data, so only
/// the relay's user may read it. SQLite gives the -wal and -shm files the database file's
/// mode; a database that exists keeps its own (create it beforehand to share it).
pub const DATABASE_FILE_MODE: u32 = 0o600;

/// Creates the database file with [`DATABASE_FILE_MODE`] unless it exists. A failure is left
/// to SQLite's own open, which reports it.
fn create_private(path: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::OpenOptionsExt;
    let name = path.to_string_lossy();
    let file = if name.starts_with("file:") {
        uri_file(&name)?
    } else if name.is_empty() || name == ":memory:" {
        return None;
    } else {
        path.to_path_buf()
    };
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(DATABASE_FILE_MODE)
        .open(&file)
        .ok()
        .map(|_| file)
}

/// The file an SQLite URI (`file:outbox.db?mode=rwc`, `file:///var/lib/outbox%20a.db`) makes
/// SQLite create, if any: none for in-memory ones, ones that open only a file that exists
/// (`mode=ro`, `mode=rw`), or a remote authority (which SQLite refuses itself).
fn uri_file(uri: &str) -> Option<PathBuf> {
    let rest = uri.strip_prefix("file:")?;
    let rest = rest.split('#').next().unwrap_or(rest);
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    let creates = query
        .split('&')
        .all(|p| !matches!(p, "mode=ro" | "mode=rw" | "mode=memory"));
    let path = match path.strip_prefix("//") {
        Some(after) => {
            let slash = after.find('/').unwrap_or(after.len());
            let authority = &after[..slash];
            if !(authority.is_empty() || authority == "localhost") {
                return None;
            }
            &after[slash..]
        }
        None => path,
    };
    let path = percent_decode(path)?;
    (creates && !path.is_empty() && path != ":memory:").then(|| PathBuf::from(path))
}

/// `%HH` escapes decoded, as SQLite decodes a URI's path: a `%` not followed by two hex
/// digits stays as it is written, as SQLite keeps it (`odd%zz.db`); `None` for a path
/// that is no UTF-8 once decoded.
fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .filter(|hex| bytes[i] == b'%' && hex.iter().all(u8::is_ascii_hexdigit));
        match hex.and_then(|hex| u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()) {
            Some(byte) => {
                out.push(byte);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// Opens the database at `path`, creating its file private if it is new. A file made
/// here for an opening that then fails is removed while still empty: refused, it was left
/// behind as a 0-byte database, which the next start took for a new one.
fn open(path: &Path) -> StoreResult<Connection> {
    let created = create_private(path);
    let opened = open_created(path);
    if let (Err(_), Some(file)) = (&opened, created) {
        if std::fs::metadata(&file).is_ok_and(|m| m.len() == 0) {
            let _ = std::fs::remove_file(&file);
        }
    }
    opened
}

fn open_created(path: &Path) -> StoreResult<Connection> {
    let conn = Connection::open(path).map_err(|e| {
        sql_error(
            &format!("cannot open SQLite database {}", path.display()),
            e,
        )
    })?;
    conn.busy_timeout(Duration::from_secs(10))
        .map_err(|e| sql_error("busy_timeout", e))?;
    // Switching a new file to WAL needs it to itself, and SQLite answers "database is locked"
    // at once, without the busy timeout, while another process opens it too (a relay and a
    // `send` started together on a new outbox.db). Wait that out as the timeout would.
    let started = std::time::Instant::now();
    let mode = loop {
        let switched = conn
            .query_row("PRAGMA journal_mode = WAL", [], |row| {
                row.get::<_, String>(0)
            })
            .and_then(|mode| {
                conn.execute_batch("PRAGMA synchronous = FULL")
                    .map(|()| mode)
            });
        match switched {
            Ok(mode) => break mode,
            Err(e)
                if e.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseBusy)
                    && started.elapsed() < CONFIGURE_PATIENCE =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(sql_error("configure SQLite", e)),
        }
    };
    // SQLite answers with the mode it is in, and keeps the old one where WAL cannot apply:
    // a VFS without shared memory or locks (`vfs=unix-none`), a file system without them.
    // The relay's reads would then block the application's writes, and without locks the
    // two could corrupt the file. An in-memory database stays `memory`.
    if !mode.eq_ignore_ascii_case("wal") && !mode.eq_ignore_ascii_case("memory") {
        return Err(StoreError::new(
            StoreErrorKind::Config,
            format!(
                "SQLite did not switch {} to WAL (it stays in `{mode}` journal mode): the relay \
                 needs WAL, so that the application's writes and the relay's reads share the \
                 file safely; open it with the default VFS, on a local file system",
                path.display()
            ),
        ));
    }
    Ok(conn)
}

/// How long opening waits for another process to finish setting up the same new file.
const CONFIGURE_PATIENCE: Duration = Duration::from_secs(10);

impl SqliteStore {
    /// Opens (creating if needed) the database file.
    pub fn open(path: impl AsRef<Path>, retain_delivered: bool) -> StoreResult<Self> {
        let path = path.as_ref().to_path_buf();
        let conn = open(&path)?;
        let opened = OpenedFile::of(&conn, &path).map(Arc::new);
        let ping = opened
            .as_ref()
            .and_then(|file| file.reader().ok())
            .map(|reader| Arc::new(Mutex::new(reader)));
        Ok(SqliteStore {
            conn: Arc::new(Mutex::new(conn)),
            path,
            retain_delivered,
            opened,
            ping,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The DDL `migrate` applies.
    pub fn ddl() -> &'static str {
        DDL
    }

    /// Applies the steps the file lacks ([`schema::steps`]), each recorded with its version.
    pub async fn migrate(&self) -> StoreResult<()> {
        self.with_conn(schema::apply).await
    }

    /// What the file holds of the schema.
    pub async fn schema_found(&self) -> StoreResult<outbox_core::migration::Found> {
        self.with_conn(|conn| schema::read_found(conn)).await
    }

    /// Runs arbitrary SQL (for tests and tools).
    pub async fn batch_execute(&self, sql: &str) -> StoreResult<()> {
        let sql = sql.to_string();
        self.with_conn(move |conn| {
            conn.execute_batch(&sql)
                .map_err(|e| sql_error("execute", e))
        })
        .await
    }

    fn with_conn<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> StoreResult<T> + Send + 'static,
    ) -> StoreFuture<T> {
        let conn = self.conn.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                let mut guard = conn.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                f(&mut guard)
            })
            .await
            .map_err(|e| {
                StoreError::new(StoreErrorKind::Query, format!("SQLite task failed: {e}"))
            })?
        }
        .boxed()
    }

    /// Runs `f` inside an immediate transaction.
    fn in_tx<T: Send + 'static>(
        &self,
        context: &'static str,
        f: impl FnOnce(&rusqlite::Transaction<'_>) -> rusqlite::Result<T> + Send + 'static,
    ) -> StoreFuture<T> {
        self.with_conn(move |conn| {
            let tx = conn
                .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
                .map_err(|e| sql_error(context, e))?;
            let value = f(&tx).map_err(|e| sql_error(context, e))?;
            tx.commit().map_err(|e| sql_error(context, e))?;
            Ok(value)
        })
    }
}

fn text_of(value: ValueRef<'_>) -> Result<Option<String>, String> {
    match value {
        ValueRef::Null => Ok(None),
        ValueRef::Text(t) | ValueRef::Blob(t) => std::str::from_utf8(t)
            .map(|s| Some(s.to_string()))
            .map_err(|_| "is not UTF-8 text".to_string()),
        ValueRef::Integer(i) => Ok(Some(i.to_string())),
        ValueRef::Real(f) => Ok(Some(f.to_string())),
    }
}

/// Column `index` as text, naming the column when it is not UTF-8 (SQLite keeps whatever
/// bytes a `CAST(X'..' AS TEXT)` gives it).
fn text_column(row: &Row<'_>, index: usize, name: &str) -> Result<Option<String>, String> {
    text_of(row.get_ref(index).map_err(|e| format!("{name}: {e}"))?).map_err(|e| {
        format!("{name} {e}; correct it in the dead letters, then `outbox-relay dead retry`")
    })
}

/// Column `index` as an integer; text that is not one is not read as 0.
fn integer_column(row: &Row<'_>, index: usize, name: &str) -> Result<Option<i64>, String> {
    match row.get_ref(index).map_err(|e| format!("{name}: {e}"))? {
        ValueRef::Null => Ok(None),
        ValueRef::Integer(i) => Ok(Some(i)),
        other => Err(format!("{name} is {:?}, not an integer", other.data_type())),
    }
}

/// `name` is NULL where the relay needs a value.
fn required<T>(value: Option<T>, name: &str) -> Result<T, String> {
    value.ok_or_else(|| {
        format!("{name} is NULL, which the relay cannot publish; set {name} in the dead letters, then `outbox-relay dead retry`")
    })
}

/// Decodes one claimed row. Only an unreadable `sequence_id` (the table's INTEGER PRIMARY
/// KEY, so never) fails the claim; any other column that cannot be read makes the row
/// [`Claimed::Undecodable`], to be dead-lettered while the rows of other keys flow.
/// A text column as the operator sees it: bytes that are not UTF-8 (SQLite stores what it
/// is given) shown with U+FFFD, a number as its digits, NULL as `None`. The dead letters
/// keep such rows' bytes; listing them must not fail on them.
pub(crate) fn lossy_text(row: &Row<'_>, index: usize) -> Option<String> {
    match row.get_ref(index) {
        Ok(ValueRef::Text(t) | ValueRef::Blob(t)) => Some(String::from_utf8_lossy(t).into_owned()),
        Ok(ValueRef::Integer(i)) => Some(i.to_string()),
        Ok(ValueRef::Real(f)) => Some(f.to_string()),
        _ => None,
    }
}

fn row_to_claimed(row: &Row<'_>) -> rusqlite::Result<Claimed> {
    let sequence_id: i64 = row.get(0)?;
    // The ordering key as the claim statement compares it: the bytes, whatever they are.
    let raw_text = |index| lossy_text(row, index);
    let lossy_destination = raw_text(2).unwrap_or_default();
    let lossy_key = raw_text(3);
    let attempts = integer_column(row, 9, "attempts")
        .ok()
        .flatten()
        .unwrap_or(0)
        .clamp(0, i64::from(u32::MAX)) as u32;
    let decoded = (|| {
        let event_id_text = required(text_column(row, 1, "event_id")?, "event_id")?;
        let event_id = Uuid::parse_str(&event_id_text)
            .map_err(|e| format!("event_id {event_id_text:?} is not a UUID: {e}"))?;
        let destination = required(text_column(row, 2, "destination")?, "destination")?;
        let partition_key = text_column(row, 3, "partition_key")?;
        let event_type = required(text_column(row, 4, "event_type")?, "event_type")?;
        let payload = match text_column(row, 5, "payload")? {
            None => Payload::Null,
            Some(text) => Payload::from_json_text(text)?,
        };
        let headers_text = required(text_column(row, 6, "headers")?, "headers")?;
        let headers = headers_from_json_text(&headers_text)?;
        let mutation_id = text_column(row, 7, "mutation_id")?;
        let rejected = required(integer_column(row, 8, "rejected")?, "rejected")?;
        // Unix milliseconds; beyond what microseconds hold is out of range as well.
        let created_ms = required(integer_column(row, 10, "created_at")?, "created_at")?;
        if let Ok(ValueRef::Text(t) | ValueRef::Blob(t)) = row.get_ref(11) {
            // Claimed to be told, not skipped: text sorts above every number, so the row
            // was never due and held nothing back.
            return Err(format!(
                "available_at is {:?}, not a number: SQLite's outbox keeps it as Unix \
                 milliseconds (an INTEGER, e.g. CAST((julianday('now') - 2440587.5) * 86400000 \
                 AS INTEGER)); set it so in the dead letters, then `outbox-relay dead retry`",
                String::from_utf8_lossy(t)
            ));
        }
        let Some(created_micros) = created_ms
            .checked_mul(1000)
            .filter(|m| outbox_core::time::created_at_problem(*m).is_none())
        else {
            return Err(format!(
                "created_at is {created_ms} milliseconds from the Unix epoch, outside the years \
                 1 to 9999 that an event can carry; set created_at to the event's real time in \
                 the dead letters, then `outbox-relay dead retry`"
            ));
        };
        Ok::<_, String>(Event {
            sequence_id,
            event_id,
            destination,
            partition_key,
            event_type,
            payload,
            headers,
            mutation_id,
            rejected: rejected != 0,
            attempts,
            max_attempts: None,
            created_at: outbox_core::time::from_micros(created_micros),
        })
    })();
    Ok(match decoded {
        Ok(event) => Claimed::Event(event.into()),
        Err(reason) => Claimed::Undecodable {
            sequence_id,
            ordering_key: lossy_key.unwrap_or_else(|| lossy_destination.clone()),
            destination: lossy_destination,
            attempts,
            reason,
        },
    })
}

/// The ids as a JSON array, for `sequence_id IN (SELECT value FROM json_each(?))`: one
/// statement per batch, as on PostgreSQL.
fn text_list(texts: &[String]) -> String {
    serde_json::to_string(texts).unwrap_or_else(|_| "[]".into())
}

fn id_list(ids: &[SequenceId]) -> String {
    serde_json::to_string(ids).unwrap_or_else(|_| "[]".into())
}

const IN_IDS: &str = "sequence_id IN (SELECT value FROM json_each(?2))";

impl OutboxStore for SqliteStore {
    fn describe(&self) -> String {
        format!("sqlite {}", self.path.display())
    }

    fn claim(&self, request: ClaimRequest) -> StoreFuture<Vec<Claimed>> {
        let crowded = request.ordered && !request.crowded.is_empty();
        let (pick, take) = match (request.ordered, crowded) {
            (false, _) => CLAIM_UNORDERED,
            (true, false) => CLAIM,
            (true, true) => CLAIM_CROWDED,
        };
        self.with_conn(move |conn| {
            let failed = |e| sql_error("claim", e);
            let (node, now, limit) = (&request.node.0, now_ms(), request.limit as i64);
            let picked: Vec<i64> = conn
                .prepare_cached(pick)
                .and_then(|mut stmt| {
                    let keys = text_list(&request.crowded.keys);
                    let window = request.crowded.window as i64;
                    let plain = params![node, now, limit];
                    let with_crowd = params![node, now, limit, keys, window];
                    let values = if crowded { with_crowd } else { plain };
                    stmt.query_map(values, |r| r.get(0))?.collect()
                })
                .map_err(failed)?;
            if picked.is_empty() {
                return Ok(Vec::new());
            }
            let tx = conn
                .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
                .map_err(failed)?;
            let mut claimed = tx
                .prepare_cached(take)
                .and_then(|mut stmt| {
                    stmt.query_map(
                        params![
                            request.node.0,
                            now_ms(),
                            id_list(&picked),
                            millis(request.lease)
                        ],
                        row_to_claimed,
                    )?
                    .collect::<rusqlite::Result<Vec<_>>>()
                })
                .map_err(failed)?;
            tx.commit().map_err(failed)?;
            claimed.sort_unstable_by_key(Claimed::sequence_id);
            Ok(claimed)
        })
    }

    fn ack(&self, holder: LeaseHolder, ids: Vec<SequenceId>) -> StoreFuture<u64> {
        let node = holder.node;
        let retain = self.retain_delivered;
        self.in_tx("ack", move |tx| {
            let n = if retain {
                tx.prepare_cached(&format!(
                    "UPDATE outbox SET delivered_at = ?3, locked_by = NULL, locked_until = NULL
                      WHERE {IN_IDS} AND locked_by = ?1"
                ))?
                .execute(params![node.0, id_list(&ids), now_ms()])?
            } else {
                tx.prepare_cached(&format!(
                    "DELETE FROM outbox WHERE {IN_IDS} AND locked_by = ?1"
                ))?
                .execute(params![node.0, id_list(&ids)])?
            };
            Ok(n as u64)
        })
    }

    fn retry_later(&self, holder: LeaseHolder, retries: Vec<RetryLater>) -> StoreFuture<u64> {
        let node = holder.node;
        self.in_tx("retry", move |tx| {
            let now = now_ms();
            let mut stmt = tx.prepare_cached(
                "UPDATE outbox SET attempts = ?3, last_error = ?4, available_at = ?5,
                        locked_by = NULL, locked_until = NULL
                  WHERE sequence_id = ?2 AND locked_by = ?1",
            )?;
            let mut n = 0;
            for r in &retries {
                n += stmt.execute(params![
                    node.0,
                    r.sequence_id,
                    r.attempts,
                    r.error,
                    now + millis(r.delay)
                ])? as u64;
            }
            Ok(n)
        })
    }

    fn dead_letter(&self, holder: LeaseHolder, entries: Vec<DeadLetter>) -> StoreFuture<u64> {
        let node = holder.node;
        // A table made without the NOT NULLs (`check` calls it degraded) holds rows with
        // NULLs the dead letters refuse: such a row is undecodable for that very NULL, and
        // its dead letter failed every time, its key stuck. They are kept as empty (the
        // reason names the NULL), and `created_at` as the time of death.
        self.in_tx("dead-letter", move |tx| {
            let now = now_ms();
            let mut copy = tx.prepare_cached(
                "INSERT OR REPLACE INTO outbox_dead_letters
                   (sequence_id, event_id, destination, partition_key, event_type, payload, headers,
                    mutation_id, rejected, created_at, attempts, last_error, dead_at)
                 SELECT sequence_id, coalesce(event_id, ''), coalesce(destination, ''),
                        partition_key, coalesce(event_type, ''), payload,
                        coalesce(headers, '{}'), mutation_id, coalesce(rejected, 0),
                        coalesce(created_at, ?5), ?3, ?4, ?5
                   FROM outbox WHERE sequence_id = ?2 AND locked_by = ?1",
            )?;
            let mut delete =
                tx.prepare_cached("DELETE FROM outbox WHERE sequence_id = ?2 AND locked_by = ?1")?;
            let mut n = 0;
            for e in &entries {
                copy.execute(params![node.0, e.sequence_id, e.attempts, e.error, now])?;
                n += delete.execute(params![node.0, e.sequence_id])? as u64;
            }
            Ok(n)
        })
    }

    fn release(&self, node: NodeId, ids: Vec<SequenceId>) -> StoreFuture<u64> {
        self.in_tx("release", move |tx| {
            let n = tx
                .prepare_cached(&format!(
                    "UPDATE outbox SET locked_by = NULL, locked_until = NULL
                      WHERE {IN_IDS} AND locked_by = ?1"
                ))?
                .execute(params![node.0, id_list(&ids)])?;
            Ok(n as u64)
        })
    }

    fn release_unheld(&self, node: NodeId, held: Vec<SequenceId>) -> StoreFuture<u64> {
        self.in_tx("release unheld", move |tx| {
            let n = tx
                .prepare_cached(&format!(
                    "UPDATE outbox SET locked_by = NULL, locked_until = NULL
                      WHERE locked_by = ?1 AND delivered_at IS NULL AND NOT {IN_IDS}"
                ))?
                .execute(params![node.0, id_list(&held)])?;
            Ok(n as u64)
        })
    }

    fn extend_leases(&self, extension: LeaseExtension) -> StoreFuture<u64> {
        let LeaseExtension { node, ids, lease } = extension;
        self.in_tx("extend leases", move |tx| {
            let n = tx
                .prepare_cached(&format!(
                    "UPDATE outbox SET locked_until = ?3 WHERE {IN_IDS} AND locked_by = ?1"
                ))?
                .execute(params![node.0, id_list(&ids), now_ms() + millis(lease)])?;
            Ok(n as u64)
        })
    }

    fn backlog(&self) -> StoreFuture<Backlog> {
        self.with_conn(|conn| {
            let (pending, retrying, oldest): (i64, i64, Option<i64>) = conn
                .query_row(
                    &format!(
                        "SELECT count(*), count(*) FILTER (WHERE attempts > 0), {WAITING_SINCE}
                           FROM outbox WHERE delivered_at IS NULL"
                    ),
                    [now_ms()],
                    |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
                )
                .map_err(|e| sql_error("backlog", e))?;
            let dead: i64 = conn
                .query_row("SELECT count(*) FROM outbox_dead_letters", [], |r| r.get(0))
                .map_err(|e| sql_error("backlog", e))?;
            Ok(Backlog {
                pending: pending as u64,
                retrying: retrying as u64,
                dead: dead as u64,
                oldest_pending_age: oldest
                    .map(|ms| Duration::from_millis(now_ms().saturating_sub(ms).max(0) as u64)),
            })
        })
    }

    fn insert(&self, events: Vec<NewEvent>) -> StoreFuture<Vec<SequenceId>> {
        self.in_tx("insert", move |tx| {
            let mut stmt = tx.prepare_cached(
                "INSERT INTO outbox (event_id, destination, partition_key, event_type, payload,
                                     headers, mutation_id)
                 VALUES (coalesce(?1, lower(hex(randomblob(16)))), ?2, ?3, ?4, ?5, ?6, ?7)
                 RETURNING sequence_id",
            )?;
            let mut ids = Vec::with_capacity(events.len());
            for e in &events {
                let event_id = e.event_id.unwrap_or_else(Uuid::new_v4).to_string();
                let headers = serde_json::to_string(&e.headers).unwrap_or_else(|_| "{}".into());
                ids.push(stmt.query_row(
                    params![
                        event_id,
                        e.destination,
                        e.partition_key,
                        e.event_type,
                        e.payload,
                        headers,
                        e.mutation_id
                    ],
                    |r| r.get(0),
                )?);
            }
            Ok(ids)
        })
    }

    fn ping(&self) -> StoreFuture<()> {
        let (Some(file), Some(reader)) = (self.opened.clone(), self.ping.clone()) else {
            // In memory: the store's own connection is the database.
            return self.with_conn(|conn| {
                conn.query_row("SELECT 1", [], |_| Ok(()))
                    .map_err(|e| sql_error("ping", e))
            });
        };
        async move {
            tokio::task::spawn_blocking(move || {
                file.still_at_its_path()?;
                let reader = reader.lock().unwrap_or_else(|p| p.into_inner());
                reader
                    .query_row("SELECT count(*) FROM sqlite_master", [], |_| Ok(()))
                    .map_err(|e| sql_error("ping", e))
            })
            .await
            .map_err(|e| {
                StoreError::new(StoreErrorKind::Query, format!("SQLite task failed: {e}"))
            })?
        }
        .boxed()
    }

    fn verify(&self) -> StoreFuture<Vec<Problem>> {
        self.with_conn(|conn| {
            let mut problems = Vec::new();
            for table in ["outbox", "outbox_dead_letters", "outbox_nodes"] {
                let found: Option<String> = conn
                    .query_row(
                        "SELECT name FROM sqlite_master WHERE type = 'table' AND name = ?1",
                        [table],
                        |r| r.get(0),
                    )
                    .optional()
                    .map_err(|e| sql_error("verify", e))?;
                if found.is_none() {
                    problems.push(Problem::blocking(
                        format!("table {table} does not exist"),
                        "run `outbox-relay migrate` (or `run --auto-migrate`)",
                    ));
                } else if table == "outbox" {
                    problems.extend(verify_outbox_columns(conn)?);
                }
            }
            Ok(problems)
        })
    }

    fn subscribe(&self, on_change: OnChange) -> Option<BoxFuture<'static, ()>> {
        let path = self.path.clone();
        Some(watch_data_version(path, on_change).boxed())
    }
}

impl SqliteStore {
    /// A database the relay may read but not write, for `check` alone (`verify` serves every
    /// command, and `stats` or `dead list` read a database the relay may not write): `check`
    /// said ok, and `run` failed at once on its first write.
    pub fn unwritable_problem(&self) -> StoreFuture<Option<Problem>> {
        self.with_conn(|conn| {
            Ok(unwritable(conn).map(|why| {
                Problem::blocking(
                    format!("the relay cannot write the database: {why}"),
                    READ_ONLY_HINT,
                )
            }))
        })
    }
}

/// Why `conn` cannot write its database, if it cannot: opened read-only (SQLite falls back
/// to that for a file its user may not write, and `mode=ro` asks for it), or refused the
/// write lock a relay's first write takes. Nothing is written.
fn unwritable(conn: &Connection) -> Option<String> {
    if conn.is_readonly(rusqlite::MAIN_DB).unwrap_or(false) {
        return Some("it is open read-only".into());
    }
    match conn.execute_batch("BEGIN IMMEDIATE; ROLLBACK") {
        Ok(()) => None,
        // A relay writing meanwhile holds the lock: the database is writable.
        Err(rusqlite::Error::SqliteFailure(f, _))
            if matches!(
                f.code,
                rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked
            ) =>
        {
            None
        }
        Err(e) => {
            let _ = conn.execute_batch("ROLLBACK");
            Some(e.to_string())
        }
    }
}

/// The outbox table's columns in `conn`: name, declared type, NOT NULL.
fn outbox_columns(conn: &Connection) -> rusqlite::Result<Vec<(String, String, bool)>> {
    let mut stmt =
        conn.prepare("SELECT name, type, \"notnull\" FROM pragma_table_info('outbox')")?;
    let columns = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get::<_, i64>(2)? != 0)))?;
    columns.collect()
}

/// Compares the outbox table's columns with those [`DDL`] declares, read back from a scratch
/// in-memory database (so the two cannot drift). SQLite reads any value from any column, so
/// only a missing (renamed) column stops claims; a different declared type or a missing NOT
/// NULL lets through rows that go to the dead letters.
fn verify_outbox_columns(conn: &Connection) -> StoreResult<Vec<Problem>> {
    let declared = Connection::open_in_memory()
        .and_then(|scratch| {
            scratch.execute_batch(DDL)?;
            outbox_columns(&scratch)
        })
        .map_err(|e| sql_error("verify", e))?;
    let found = outbox_columns(conn).map_err(|e| sql_error("verify", e))?;
    let mut problems = Vec::new();
    for (column, ty, not_null) in declared {
        match found.iter().find(|(c, ..)| *c == column) {
            None => problems.push(Problem::missing_column(&column, "table outbox", format!(
                    "ALTER TABLE outbox RENAME COLUMN <its current name> TO {column}; or ALTER TABLE outbox ADD COLUMN {column} {ty} (see `outbox-relay migrate --print`)"
                ))),
            Some((_, found_ty, found_not_null)) => {
                if !found_ty.eq_ignore_ascii_case(&ty) {
                    problems.push(Problem::degraded(
                        format!("column {column} of table outbox is declared {found_ty}, not {ty}: rows whose {column} the relay cannot read go to the dead letters"),
                        format!("rebuild the table with {column} {ty} (see `outbox-relay migrate --print`)"),
                    ));
                } else if not_null && !found_not_null && column == "available_at" {
                    problems.push(Problem::degraded(
                        "column available_at of table outbox allows NULL: a row with NULL there is due at once",
                        "rebuild the table with available_at NOT NULL (see `outbox-relay migrate --print`)",
                    ));
                } else if not_null && !found_not_null {
                    problems.push(Problem::nullable_column(
                        &column,
                        "table outbox",
                        format!("rebuild the table with {column} NOT NULL (see `outbox-relay migrate --print`)"),
                    ));
                }
            }
        }
    }
    Ok(problems)
}

/// Calls `on_change` whenever another connection commits to the database file.
async fn watch_data_version(path: PathBuf, on_change: OnChange) {
    let conn = match tokio::task::spawn_blocking(move || open(&path)).await {
        Ok(Ok(conn)) => Arc::new(Mutex::new(conn)),
        Ok(Err(e)) => {
            tracing::warn!(error = %e.report(), "cannot watch SQLite for changes; polling only");
            return;
        }
        Err(_) => return,
    };
    let mut last: Option<i64> = None;
    let mut ticker = tokio::time::interval(DEFAULT_CHANGE_POLL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let conn = conn.clone();
        let version = tokio::task::spawn_blocking(move || {
            let guard = conn.lock().unwrap_or_else(|p| p.into_inner());
            guard.query_row("PRAGMA data_version", [], |r| r.get::<_, i64>(0))
        })
        .await;
        if let Ok(Ok(version)) = version {
            if last.is_some_and(|l| l != version) {
                on_change();
            }
            last = Some(version);
        }
    }
}

/// The node's row, if it has one, live when its expiry is `now` or later.
fn node_row(
    tx: &rusqlite::Transaction<'_>,
    node: &NodeId,
    now: i64,
) -> rusqlite::Result<Option<NodeRow>> {
    let expiry: Option<i64> = tx
        .query_row(
            "SELECT expiry FROM outbox_nodes WHERE id = ?1",
            [&node.0],
            |r| r.get(0),
        )
        .optional()?;
    Ok(expiry.map(|expiry| NodeRow {
        expiry: Incarnation(expiry),
        live: expiry >= now,
    }))
}

/// Writes the node's row (made if missing) with `expiry`.
fn set_node_expiry(
    tx: &rusqlite::Transaction<'_>,
    node: &NodeId,
    expiry: i64,
) -> rusqlite::Result<()> {
    tx.execute(
        "INSERT INTO outbox_nodes (id, expiry) VALUES (?1, ?2)
         ON CONFLICT (id) DO UPDATE SET expiry = excluded.expiry",
        params![node.0, expiry],
    )
    .map(|_| ())
}

/// Expiries are milliseconds since the Unix epoch; the immediate transaction serialises the
/// read and the write, so each check-then-write below is atomic.
impl NodeRegistry for SqliteStore {
    fn register(&self, node: NodeId, ttl: Duration) -> StoreFuture<Registration> {
        self.in_tx("register", move |tx| {
            let now = now_ms();
            match node_row(tx, &node, now)? {
                Some(row) if !NodeRow::may_register(Some(row)) => {
                    return Ok(Registration::Taken(row.expiry))
                }
                _ => {}
            }
            let expiry = now + millis(ttl);
            set_node_expiry(tx, &node, expiry)?;
            // Rows still leased under this id are a dead process's (its row was absent or
            // had run out): the claim lets a node's own leases pass its keys, so unreleased
            // they would neither hold back their keys' later rows nor be claimed.
            tx.execute(
                "UPDATE outbox SET locked_by = NULL, locked_until = NULL
                  WHERE locked_by = ?1 AND delivered_at IS NULL",
                [&node.0],
            )?;
            Ok(Registration::Registered(Incarnation(expiry)))
        })
    }

    fn heartbeat(&self, beat: Heartbeat) -> StoreFuture<Heartbeated> {
        let Heartbeat { node, last, ttl } = beat;
        self.in_tx("heartbeat", move |tx| {
            let now = now_ms();
            let row = node_row(tx, &node, now)?;
            if !NodeRow::may_heartbeat(row, last) {
                return Ok(Heartbeated::RowShows(row.map(|r| r.expiry)));
            }
            let expiry = now + millis(ttl);
            set_node_expiry(tx, &node, expiry)?;
            Ok(Heartbeated::Pushed(Incarnation(expiry)))
        })
    }

    fn remove_expired(&self) -> StoreFuture<u64> {
        self.in_tx("remove expired nodes", |tx| {
            tx.execute("DELETE FROM outbox_nodes WHERE expiry < ?1", [now_ms()])
                .map(|n| n as u64)
        })
    }

    fn deregister(&self, node: NodeId, last: Incarnation) -> StoreFuture<()> {
        self.in_tx("deregister", move |tx| {
            tx.execute(
                "DELETE FROM outbox_nodes WHERE id = ?1 AND expiry = ?2",
                params![node.0, last.0],
            )
            .map(|_| ())
        })
    }

    fn live_nodes(&self) -> StoreFuture<Vec<NodeRecord>> {
        self.with_conn(|conn| {
            let mut stmt = conn
                .prepare("SELECT id, expiry FROM outbox_nodes WHERE expiry >= ?1 ORDER BY id")
                .map_err(|e| sql_error("list nodes", e))?;
            let rows = stmt
                .query_map([now_ms()], |r| {
                    Ok(NodeRecord {
                        id: r.get(0)?,
                        expiry: UNIX_EPOCH
                            + Duration::from_millis(r.get::<_, i64>(1)?.max(0) as u64),
                    })
                })
                .map_err(|e| sql_error("list nodes", e))?;
            rows.collect::<rusqlite::Result<Vec<_>>>()
                .map_err(|e| sql_error("list nodes", e))
        })
    }
}

#[cfg(test)]
mod plan_tests {
    use super::*;

    /// Each claim's check of the rows holding its key back searches the key's index, never
    /// the pending rows below it: a comparison whose sides differ in affinity (a key cast to
    /// text) kept the planner from it.
    #[test]
    fn the_key_blocking_check_searches_the_keys_index() {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(DDL).unwrap();
        for (name, statement) in [("claim", CLAIM.0), ("crowded claim", CLAIM_CROWDED.0)] {
            let mut plan = conn
                .prepare(&format!("EXPLAIN QUERY PLAN {statement}"))
                .unwrap();
            let unbound = vec![rusqlite::types::Null; plan.parameter_count()];
            let steps: Vec<String> = plan
                .query_map(rusqlite::params_from_iter(unbound), |r| {
                    r.get::<_, String>(3)
                })
                .unwrap()
                .map(Result::unwrap)
                .collect();
            assert!(
                steps
                    .iter()
                    .any(|s| s.contains("SEARCH p USING INDEX outbox_blocking_idx")),
                "{name}: {steps:?}"
            );
        }
    }
}
