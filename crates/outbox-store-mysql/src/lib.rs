//! MySQL 8 / MariaDB (≥ 10.6) outbox store.
//!
//! Every MySQL table is a [`Mapping`]: the native layout ([`Mapping::native_mysql`]), the
//! MySQL seed's `outbox_events` ([`Mapping::mysql_outbox_events`]) or a custom mapping, run
//! by [`outbox_layout::store::MappedStore`]. This is its database part. Claims follow the
//! seed's advice: `SELECT ... ORDER BY ... LIMIT n FOR UPDATE SKIP LOCKED` under READ
//! COMMITTED (no gap locks that would block the application's inserts), then one `UPDATE`
//! marking the batch where the table can mark it, in one transaction. The active relay holds
//! a `GET_LOCK` named after the table on a dedicated connection (see ARCHITECTURE.md,
//! "Mapped layouts").

use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Opts, OptsBuilder, Pool, PoolConstraints, PoolOpts, Row, Value};
use outbox_core::store::{NodeRegistry, Problem, StoreResult, OPERATION_TIMEOUT};
use outbox_core::{SequenceId, StoreError, StoreErrorKind};
use outbox_layout::memory::{RawRow, RowId};
use outbox_layout::params::{self, Params};
use outbox_layout::sql::Sql;
use outbox_layout::store::{Claim, MappedDb, MappedStore, Opened};
use outbox_layout::{Dialect, IdType, Mapping};

mod locks;
mod nodes;
mod schema;

/// The MySQL/MariaDB store. Cheap to clone.
pub type MySqlStore = MappedStore<MySql>;

/// Connection settings and the table. Its `Debug` shows the URL redacted.
#[derive(Clone)]
pub struct MySqlOptions {
    /// `mysql://user:password@host:port/db` (`mariadb://` too); TLS with `?require_ssl=true`
    /// (and `verify_ca`, `verify_identity`).
    pub url: String,
    pub mapping: Mapping,
    /// The layout's name, for logs and fixes.
    pub layout: String,
    /// Where the table has no attempt limit of its own.
    pub max_attempts: u32,
    pub pool_size: usize,
    /// The nodes table (native layout), or `None`.
    pub nodes_table: Option<String>,
    /// How long one operation may wait for the database before it fails as a lost
    /// connection (`None`: [`OPERATION_TIMEOUT`]). Migrations are not bounded.
    pub operation_timeout: Option<Duration>,
}

impl std::fmt::Debug for MySqlOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlOptions")
            .field("url", &outbox_core::redact::RedactedUrl(&self.url))
            .field("mapping", &self.mapping)
            .field("layout", &self.layout)
            .field("max_attempts", &self.max_attempts)
            .field("pool_size", &self.pool_size)
            .field("nodes_table", &self.nodes_table)
            .field("operation_timeout", &self.operation_timeout)
            .finish()
    }
}

/// The MySQL part of [`MySqlStore`].
pub struct MySql {
    pool: Pool,
    opts: Opts,
    nodes: Option<nodes::Nodes>,
    operation_timeout: Duration,
    /// Said once: the lock's holder is a session this role cannot see.
    holder_unseen: std::sync::atomic::AtomicBool,
}

/// Maps a driver error to its kind, by server error code, never by message text.
pub fn classify(error: &mysql_async::Error) -> StoreErrorKind {
    use mysql_async::DriverError as D;
    match error {
        mysql_async::Error::Server(e) => match e.code {
            1146 | 1054 | 1305 => StoreErrorKind::MissingSchema,
            1142 | 1143 | 1044 | 1227 => StoreErrorKind::Privilege,
            // Access denied, an unknown database, a host not allowed, an authentication the
            // client cannot do, TLS required: the URL or the account is wrong, and no retry
            // mends it.
            1045 | 1049 | 1130 | 1251 | 1698 | 3159 => StoreErrorKind::Config,
            1205 | 1213 => StoreErrorKind::Conflict,
            // A row refused: a foreign key (1451 to a deleted row, 1452 from an inserted
            // one), a duplicate key, a NULL or a value a column refuses, a check constraint
            // (MySQL 3819, MariaDB 4025), a trigger's SIGNAL (1644).
            1048 | 1062 | 1406 | 1451 | 1452 | 1644 | 3819 | 4025 => StoreErrorKind::RowRefused,
            // MySQL 8's ER_CLIENT_INTERACTION_TIMEOUT (4031) ends an idle session, as 2013
            // does on older servers.
            1040 | 1053 | 2006 | 2013 | 1927 | 4031 => StoreErrorKind::Connection,
            // A read-only server: a replica the URL points at, or a primary being demoted.
            // A failover behind the URL mends it, as a lost connection's reconnect does.
            code if read_only_server(code) => StoreErrorKind::Connection,
            _ => StoreErrorKind::Query,
        },
        // A statement the relay built wrong: its bug, not the network's.
        mysql_async::Error::Driver(
            D::FromValue { .. }
            | D::FromRow { .. }
            | D::Params(_)
            | D::MixedParams
            | D::NestedTransaction
            | D::StmtParamsMismatch { .. }
            | D::StmtParamsNumberExceedsLimit { .. },
        ) => StoreErrorKind::Query,
        // An account or TLS setting the server and the URL do not agree on.
        mysql_async::Error::Driver(
            D::UnknownAuthPlugin { .. }
            | D::MysqlOldPasswordDisabled
            | D::CleartextPluginDisabled
            | D::NoClientSslFlagFromServer,
        ) => StoreErrorKind::Config,
        mysql_async::Error::Io(_) | mysql_async::Error::Driver(_) => StoreErrorKind::Connection,
        mysql_async::Error::Url(_) => StoreErrorKind::Config,
        _ => StoreErrorKind::Query,
    }
}

/// A server that takes no writes, as the relay tells it.
const READ_ONLY: &str = "the server takes no writes (read_only or innodb_read_only is on: a \
                         replica, or a primary being demoted)";

/// What to do about [`READ_ONLY`].
const READ_ONLY_FIX: &str = "point the relay's URL at the primary";

/// ER_OPTION_PREVENTS_STATEMENT (`--read-only`), ER_READ_ONLY_MODE,
/// ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION: the server takes no writes.
fn read_only_server(code: u16) -> bool {
    matches!(code, 1290 | 1836 | 1792)
}

/// ER_DATA_TOO_LONG: a value longer than its column, refused in strict mode (the default).
const DATA_TOO_LONG: u16 = 1406;

/// Whether the server refused a value of the row itself: too long or out of range for its
/// column, not valid for its type (MySQL's JSON), failing a CHECK (MariaDB's JSON
/// columns check `JSON_VALID`, which refuses a document nested 32 deep), or a statement
/// larger than the server's `max_allowed_packet` ([`too_large_for_the_server`]; rows
/// written one at a time may pass). The same row fails every time, where any other
/// `Query` failure may pass on a later try.
pub fn refuses_a_value(error: &mysql_async::Error) -> bool {
    const REFUSED_VALUE: [u16; 8] = [
        1264, // ER_WARN_DATA_OUT_OF_RANGE
        1265, // WARN_DATA_TRUNCATED
        1292, // ER_TRUNCATED_WRONG_VALUE
        1366, // ER_TRUNCATED_WRONG_VALUE_FOR_FIELD (a character the column's set lacks)
        DATA_TOO_LONG,
        3140, // ER_INVALID_JSON_TEXT (MySQL)
        3157, // ER_JSON_DOCUMENT_TOO_DEEP (MySQL)
        4025, // ER_CONSTRAINT_FAILED (MariaDB's CHECK)
    ];
    matches!(error, mysql_async::Error::Server(e) if REFUSED_VALUE.contains(&e.code))
        || too_large_for_the_server(error)
}

/// Whether `error` refuses a statement larger than the server's `max_allowed_packet`: as
/// the server says it (ER_NET_PACKET_TOO_LARGE), or as the client refuses to send it (it
/// keeps the limit it read at connecting).
pub fn too_large_for_the_server(error: &mysql_async::Error) -> bool {
    use mysql_common::proto::codec::error::PacketCodecError;
    match error {
        mysql_async::Error::Server(e) => e.code == 1153,
        mysql_async::Error::Io(mysql_async::IoError::Io(e)) => e
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<PacketCodecError>())
            .is_some_and(|e| matches!(e, PacketCodecError::PacketTooLarge)),
        _ => false,
    }
}

fn db_error(context: &str, error: mysql_async::Error) -> StoreError {
    let kind = classify(&error);
    match &error {
        mysql_async::Error::Server(e) if e.code == DATA_TOO_LONG => StoreError::new(
            kind,
            format!(
                "{context}: {}: shorten the value (an ordering key can be a hash of a longer \
                 one) or widen the column, e.g. ALTER TABLE .. MODIFY partition_key text (the \
                 native table's destination, partition_key and event_type are varchar(255))",
                e.message
            ),
        ),
        mysql_async::Error::Server(e) if read_only_server(e.code) => StoreError::new(
            kind,
            format!(
                "{context}: {}: {READ_ONLY}: {READ_ONLY_FIX}; the relay retries until it can write",
                e.message
            ),
        ),
        mysql_async::Error::Server(e) if e.code == 1049 => StoreError::new(
            kind,
            format!(
                "{context}: {}: check the database name in the URL (`migrate` creates tables, \
                 not the database: CREATE DATABASE it first)",
                e.message
            ),
        ),
        mysql_async::Error::Server(e) if e.code == 3159 => StoreError::new(
            kind,
            format!(
                "{context}: {}: the account requires TLS: add `?require_ssl=true` to the URL",
                e.message
            ),
        ),
        mysql_async::Error::Server(e) => StoreError::new(kind, format!("{context}: {}", e.message)),
        _ => StoreError::new(kind, format!("{context}: {error}")),
    }
}

/// Named values (`:pn`); none at all is `Params::Empty` (the driver refuses named values
/// for a statement without placeholders).
fn bind(params: Params) -> mysql_async::Params {
    let named = params.named();
    if named.is_empty() {
        return mysql_async::Params::Empty;
    }
    mysql_async::Params::Named(
        named
            .into_iter()
            .map(|(name, value)| {
                let value = match value {
                    params::Value::Bool(b) => Value::from(b),
                    params::Value::Int(i) => Value::from(i),
                    params::Value::Text(t) => t.map_or(Value::NULL, Value::from),
                    params::Value::Uuid(u) => Value::from(u.to_string()),
                    // Lists are expanded or inlined for MySQL; `Params` makes no arrays here.
                    params::Value::Ints(_) | params::Value::Uuids(_) | params::Value::Texts(_) => {
                        Value::NULL
                    }
                };
                (name.into_bytes(), value)
            })
            .collect(),
    )
}

/// The row's id, read back as the mapping's type. An id read as another (zero, or a UUID
/// in another form) would be marked, acked and dead-lettered as a row that is not there:
/// the row would come back for ever, and rows read alike would go out as one event.
fn read_id(row: &Row, mapping: &Mapping) -> StoreResult<RowId> {
    parse_row_id(&text(col(row, 0)).unwrap_or_default(), mapping)
}

/// A row id as the statements read it back, as text.
fn parse_row_id(id_text: &str, mapping: &Mapping) -> StoreResult<RowId> {
    match mapping.id_type {
        IdType::Integer => id_text.parse().ok().map(RowId::Integer),
        // Only the hyphenated form: the statements name ids in it, and 32 bare digits
        // would parse but match no row.
        IdType::Uuid => uuid::Uuid::try_parse(id_text)
            .ok()
            .filter(|_| id_text.len() == 36)
            .map(RowId::Uuid),
    }
    .ok_or_else(|| unreadable_id(mapping, id_text))
}

/// How to map an id column the relay can read back as the mapping's id type.
fn id_column_fix(mapping: &Mapping) -> &'static str {
    match mapping.id_type {
        IdType::Integer => "map an integer column as the id",
        IdType::Uuid => {
            "map a CHAR(36) column as the id; for UUIDs kept in BINARY(16), add one that \
             renders them, e.g. `id_text CHAR(36) AS (LOWER(INSERT(INSERT(INSERT(INSERT(HEX(id), \
             9, 0, '-'), 14, 0, '-'), 19, 0, '-'), 24, 0, '-'))) STORED` with a unique index, \
             and map that"
        }
    }
}

/// A row id the relay cannot read back as the mapping's id type.
fn unreadable_id(mapping: &Mapping, read: &str) -> StoreError {
    let wanted = match mapping.id_type {
        IdType::Integer => "an integer",
        IdType::Uuid => "a UUID in text form (CHAR(36))",
    };
    let shown: String = read.chars().take(40).collect();
    if mapping.id_type == IdType::Integer
        && !read.is_empty()
        && read
            .trim_start_matches('-')
            .bytes()
            .all(|b| b.is_ascii_digit())
    {
        return StoreError::new(
            StoreErrorKind::SchemaMismatch,
            format!(
                "the id column {id:?} holds {shown}, beyond the largest id the relay can hold \
                 ({}, a signed 64-bit integer), so the row is not relayed: give it an id \
                 within that range (`UPDATE … SET {id} = … WHERE {id} = {shown}`), and keep \
                 the table's AUTO_INCREMENT below it",
                i64::MAX,
                id = mapping.id,
            ),
        );
    }
    StoreError::new(
        StoreErrorKind::SchemaMismatch,
        format!(
            "the id column {:?} holds {shown:?}, which is not {wanted}: {}",
            mapping.id,
            id_column_fix(mapping)
        ),
    )
}

/// A column's raw value.
fn col(row: &Row, i: usize) -> &Value {
    row.as_ref(i).unwrap_or(&Value::NULL)
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::NULL => None,
        Value::Bytes(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::Int(i) => Some(i.to_string()),
        Value::UInt(u) => Some(u.to_string()),
        other => Some(other.as_sql(true).trim_matches('\'').to_string()),
    }
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::NULL => None,
        Value::Int(i) => Some(*i),
        Value::UInt(u) => i64::try_from(*u).ok(),
        Value::Float(f) => Some(*f as i64),
        Value::Double(d) => Some(*d as i64),
        Value::Bytes(b) => String::from_utf8_lossy(b)
            .trim()
            .parse::<f64>()
            .ok()
            .map(|f| f as i64),
        _ => None,
    }
}

fn bytes(v: &Value) -> Option<Vec<u8>> {
    match v {
        Value::NULL => None,
        Value::Bytes(b) => Some(b.clone()),
        other => text(other).map(String::into_bytes),
    }
}

impl MySql {
    /// A pooled connection, bounded by the operation timeout: a server that accepts and
    /// never answers held `migrate` (whose statements are not bounded) for good.
    async fn conn(&self, context: &str) -> StoreResult<Conn> {
        bounded(self.operation_timeout, context, async {
            self.pool.get_conn().await.map_err(|e| db_error(context, e))
        })
        .await
    }

    /// The table as the relay's locks name it: `database.table`.
    fn outbox_name(&self, m: &Mapping) -> String {
        let database = m.schema.as_deref().or(self.opts.db_name()).unwrap_or("");
        format!("{database}.{}", m.table)
    }

    fn lock_name(&self, m: &Mapping) -> String {
        polling_lock_name(&self.outbox_name(m))
    }

    /// `conn`, which just took the active relay's lock of `mapping`'s table, as the lock
    /// held; refused (the lock let go, [`StoreErrorKind::Config`]) while a binlog capture
    /// reader of the same table holds its own ([`ways_meet`]). The relay stays a standby,
    /// saying why, and tries again: a switch of ways goes on once the other way's relays
    /// have stopped.
    async fn hold_alone(&self, mapping: &Mapping, mut conn: Conn) -> StoreResult<HeldLock> {
        let context = "take the active-relay lock";
        let outbox = self.outbox_name(mapping);
        let capture = capture_lock_name(&outbox);
        let reader = self
            .bounded(context, async {
                other_way_holder(&mut conn, &capture)
                    .await
                    .map_err(|e| db_error(context, e))
            })
            .await;
        match reader {
            Ok(None) => Ok(HeldLock::hold(conn, self.operation_timeout)),
            Ok(Some(reader)) => {
                let_go(conn).await;
                Err(StoreError::new(
                    StoreErrorKind::Config,
                    ways_meet(&outbox, Relaying::Polling, reader),
                ))
            }
            Err(e) => {
                let_go(conn).await;
                Err(e)
            }
        }
    }
}

impl MappedDb for MySql {
    type Options = MySqlOptions;
    type Row = Row;
    type Lock = HeldLock;
    const DIALECT: Dialect = Dialect::MySql;
    const NAME: &'static str = "mysql";
    /// The lock's own task pings its session ([`HeldLock`]): the check reads its verdict.
    const LOCK_CHECK_INTERVAL: Duration = Duration::ZERO;

    fn open(options: MySqlOptions) -> StoreResult<Opened<Self>> {
        let url = match options.url.strip_prefix("mariadb://") {
            Some(rest) => format!("mysql://{rest}"),
            None => options.url.clone(),
        };
        let parsed = Opts::from_url(&url).map_err(|e| {
            StoreError::new(
                StoreErrorKind::Config,
                format!("invalid MySQL URL: {e}; use mysql://user:password@host:port/database"),
            )
        })?;
        let opts: Opts = session_settings(OptsBuilder::from_opts(parsed))
            .pool_opts(pool_opts(options.pool_size)?)
            // A dead peer is noticed on an idle pooled connection too (the driver sets none).
            .tcp_keepalive(Some(Duration::from_secs(10)))
            .into();
        let pool = Pool::new(opts.clone());
        let timeout = options.operation_timeout.unwrap_or(OPERATION_TIMEOUT);
        let nodes = options.nodes_table.as_ref().map(|table| {
            nodes::Nodes::new(
                pool.clone(),
                options.mapping.schema.as_deref(),
                table,
                timeout,
            )
        });
        Ok(Opened {
            db: MySql {
                pool,
                opts,
                nodes,
                operation_timeout: timeout,
                holder_unseen: std::sync::atomic::AtomicBool::new(false),
            },
            mapping: options.mapping,
            layout: options.layout,
            max_attempts: options.max_attempts,
        })
    }

    /// Takes the lock, or ends a holder whose session has been idle for
    /// [`LOCK_STALE_AFTER`] and takes it then: a live holder pings its session every
    /// [`LOCK_KEEPALIVE`] ([`HeldLock`]), so such a holder is gone (its host died, its
    /// network was cut) or paused. The server would keep its session, and the lock, until
    /// its `wait_timeout` (8 hours by default) or TCP's keepalive (about 2 hours): a
    /// standby relayed nothing meanwhile, its `/readyz` green.
    async fn take_lock(&self, mapping: &Mapping) -> StoreResult<Option<HeldLock>> {
        let context = "take the active-relay lock";
        let name = self.lock_name(mapping);
        let taken = self.bounded(context, async {
            let mut conn = lock_connection(&self.opts, context).await?;
            if read_only(&mut conn)
                .await
                .map_err(|e| db_error(context, e))?
            {
                return Err(StoreError::new(
                    StoreErrorKind::Connection,
                    format!(
                        "{context}: {READ_ONLY}: {READ_ONLY_FIX}; the relay retries until it \
                         can write"
                    ),
                ));
            }
            let got: Option<Option<i64>> = conn
                .exec_first("SELECT GET_LOCK(?, 0)", (&name,))
                .await
                .map_err(|e| db_error(context, e))?;
            if got.flatten() == Some(1) {
                return Ok(Ok(conn));
            }
            let holder: Option<(Option<u64>, Option<String>, Option<u64>)> = conn
                .exec_first(
                    "SELECT h.id, p.COMMAND, p.TIME
                       FROM (SELECT IS_USED_LOCK(?) AS id) h
                       LEFT JOIN information_schema.PROCESSLIST p ON p.ID = h.id",
                    (&name,),
                )
                .await
                .map_err(|e| db_error(context, e))?;
            let stale = match holder {
                Some((Some(id), Some(command), Some(idle)))
                    if command == "Sleep" && idle >= LOCK_STALE_AFTER.as_secs() =>
                {
                    Some((id, idle))
                }
                Some((Some(id), None, _)) => {
                    if !self
                        .holder_unseen
                        .swap(true, std::sync::atomic::Ordering::Relaxed)
                    {
                        tracing::warn!(
                            connection = id,
                            lock = %name,
                            "the active relay's lock is held by a session this role cannot see \
                             (another database user, and no PROCESS privilege): a holder that is \
                             gone or paused is not told from a live one, and this relay waits \
                             until the server ends it; run every relay as the same user"
                        );
                    }
                    None
                }
                _ => None,
            };
            Ok(Err((conn, stale)))
        });
        let (conn, (holder, idle)) = match taken.await? {
            Ok(conn) => return self.hold_alone(mapping, conn).await.map(Some),
            Err((conn, None)) => {
                let_go(conn).await;
                return Ok(None);
            }
            Err((conn, Some(stale))) => (conn, stale),
        };
        tracing::warn!(
            connection = holder,
            idle_seconds = idle,
            lock = %name,
            "the active relay's lock is held by a session idle past its keepalive (a relay \
             whose host or network is gone, or that is paused): ending it to take over"
        );
        self.taking_over(mapping, |context| {
            end_holder(conn, Some(holder), &name, context)
        })
        .await
    }

    async fn lock_alive(&self, lock: &mut HeldLock) -> bool {
        lock.alive()
    }

    /// Ends the holder's connection (`KILL CONNECTION`, which the server allows on a
    /// connection of the same user, or with CONNECTION ADMIN / SUPER), then waits for the
    /// lock the server frees with it.
    async fn take_lock_from_stale(
        &self,
        mapping: &Mapping,
        entitled: &(dyn Fn() -> bool + Sync),
    ) -> StoreResult<Option<HeldLock>> {
        self.taking_over(mapping, |context| {
            self.take_stale_lock(mapping, entitled, context)
        })
        .await
    }

    async fn query(
        &self,
        context: &'static str,
        statement: String,
        params: Params,
    ) -> StoreResult<Vec<Row>> {
        self.bounded(context, async {
            let mut conn = self.conn(context).await?;
            conn.exec(statement, bind(params))
                .await
                .map_err(|e| db_error(context, e))
        })
        .await
    }

    async fn execute(
        &self,
        context: &'static str,
        statement: String,
        params: Params,
    ) -> StoreResult<u64> {
        self.bounded(context, async {
            let mut conn = self.conn(context).await?;
            conn.exec_drop(statement, bind(params))
                .await
                .map_err(|e| db_error(context, e))?;
            Ok(conn.affected_rows())
        })
        .await
    }

    async fn execute_each(
        &self,
        context: &'static str,
        statement: String,
        rows: Vec<Params>,
    ) -> StoreResult<u64> {
        self.bounded(context, async {
            let mut conn = self.conn(context).await?;
            let mut tx = conn
                .start_transaction(mysql_async::TxOpts::default())
                .await
                .map_err(|e| db_error(context, e))?;
            let mut n = 0;
            for params in rows {
                tx.exec_drop(&statement, bind(params))
                    .await
                    .map_err(|e| db_error(context, e))?;
                n += tx.affected_rows();
            }
            tx.commit().await.map_err(|e| db_error(context, e))?;
            Ok(n)
        })
        .await
    }

    async fn claim(&self, sql: &Sql, claim: Claim) -> StoreResult<Vec<Row>> {
        self.bounded("claim", self.claim_once(sql, claim)).await
    }

    async fn insert(
        &self,
        statement: String,
        values: Vec<Option<String>>,
    ) -> StoreResult<SequenceId> {
        self.bounded("insert", async {
            let mut conn = self.conn("insert").await?;
            let values: Vec<Value> = values
                .into_iter()
                .map(|v| v.map_or(Value::NULL, Value::from))
                .collect();
            conn.exec_drop(statement, values)
                .await
                .map_err(|e| db_error("insert", e))?;
            Ok(conn.last_insert_id().unwrap_or(0) as i64)
        })
        .await
    }

    fn row_id(row: &Row, mapping: &Mapping) -> StoreResult<()> {
        read_id(row, mapping).map(drop)
    }

    fn raw_row(row: &Row, mapping: &Mapping) -> StoreResult<RawRow> {
        RawRow::read(
            read_id(row, mapping)?,
            |i| Ok(text(col(row, i))),
            |i| Ok(int(col(row, i))),
            |i| Ok(bytes(col(row, i))),
        )
    }

    fn int(row: &Row, index: usize) -> Option<i64> {
        int(col(row, index))
    }

    fn text(row: &Row, index: usize) -> Option<String> {
        text(col(row, index))
    }

    async fn ping(&self) -> StoreResult<()> {
        self.bounded("ping", async {
            let mut conn = self.conn("ping").await?;
            conn.ping().await.map_err(|e| db_error("ping", e))
        })
        .await
    }

    async fn refuse_unusable(&self) -> StoreResult<()> {
        let rows = self
            .query(
                "verify",
                "SELECT VERSION()".into(),
                Params::new(Dialect::MySql),
            )
            .await?;
        let version = rows
            .first()
            .and_then(|r| text(col(r, 0)))
            .unwrap_or_default();
        match skip_locked_missing(&version) {
            Some(needed) => Err(StoreError::new(
                StoreErrorKind::Config,
                format!(
                    "the server is {version}, which has no `FOR UPDATE SKIP LOCKED` (the relay's \
                     claims need it): upgrade to {needed} or later"
                ),
            )),
            None => Ok(()),
        }
    }

    async fn verify_access(&self, sql: &Sql, layout: &str) -> StoreResult<Vec<Problem>> {
        let mut problems = self.column_problems(sql).await?;
        let rows = self
            .query(
                "verify",
                READ_ONLY_QUERY.into(),
                Params::new(Dialect::MySql),
            )
            .await?;
        if rows.first().is_some_and(answers_read_only) {
            // Degraded: a switchover's window passes, and the relay retries through it.
            problems.push(Problem::degraded(
                format!(
                    "{READ_ONLY}, and the relay claims and settles by writing; an account allowed \
                     past read_only would write to a replica and break its replication"
                ),
                READ_ONLY_FIX,
            ));
        }
        let side = match sql.dead_table_ddl() {
            Some(_) => {
                let probe = format!("SELECT 1 FROM {} LIMIT 1", sql.dead_table());
                match self
                    .query("verify", probe, Params::new(Dialect::MySql))
                    .await
                {
                    Ok(_) => true,
                    Err(e) => {
                        problems.push(Problem::blocking(format!("the dead-letter side table: {e}"), format!(
                            "run `outbox-relay migrate --layout {layout}` (or apply `outbox-relay migrate --layout {layout} --print`)"
                        )));
                        false
                    }
                }
            }
            None => false,
        };
        problems.extend(self.missing_privileges(sql, layout, side).await);
        Ok(problems)
    }

    /// The layout's tables (and the nodes table of the native layout), or `None` for a
    /// custom mapping.
    fn ddl(&self, sql: &Sql) -> Option<String> {
        let mut ddl = sql.ddl()?;
        if let Some(nodes) = &self.nodes {
            ddl.push_str(&nodes.ddl());
        }
        Some(ddl)
    }

    fn grants(&self, sql: &Sql, layout: &str, role: &str) -> String {
        let nodes = self.nodes.as_ref().map(|n| n.grants(role));
        // Read to refuse a schema older or newer than the relay runs on.
        let versions = self.steps(sql).map(|_| {
            format!(
                "GRANT SELECT ON {} TO '{role}'@'%';\n",
                Self::versions_table(sql)
            )
        });
        format!(
            "-- The relay's run-time account for the {layout} layout (MySQL/MariaDB).\n-- CREATE USER '{role}'@'%' IDENTIFIED BY '...';\n{}{}{}",
            sql.grants(role),
            nodes.unwrap_or_default(),
            versions.unwrap_or_default()
        )
    }

    async fn migrate(&self, sql: &Sql) -> StoreResult<()> {
        let Some(steps) = self.steps(sql) else {
            return Err(StoreError::new(
                StoreErrorKind::Config,
                "this custom mapping runs on the application's existing table and marks dead rows itself: there is nothing to migrate",
            ));
        };
        self.apply_steps(sql, &steps).await?;
        // The nodes table named now, where missing: the first step made the one named then,
        // and a later `nodes_table` (an outbox of its own, as README's many outboxes ask)
        // was never made, migrate said "migrated" and `run` failed telling to migrate.
        if let Some(nodes) = &self.nodes {
            let mut conn = self.conn("migrate").await?;
            conn.query_drop(nodes.ddl())
                .await
                .map_err(|e| db_error("migrate: the nodes table", e))?;
        }
        Ok(())
    }

    async fn batch_execute(&self, sql: &str) -> StoreResult<()> {
        let mut conn = self.conn("execute").await?;
        conn.query_drop(sql)
            .await
            .map_err(|e| db_error("execute", e))
    }

    fn lock_holders(
        &self,
        mapping: &Mapping,
    ) -> Option<outbox_core::store::StoreFuture<outbox_core::store::LockHolders>> {
        Some(Box::pin(locks::lock_holders(
            self.opts.clone(),
            self.operation_timeout,
            mapping.schema.clone(),
            mapping.table.clone(),
        )))
    }

    fn nodes(&self) -> Option<&dyn NodeRegistry> {
        self.nodes.as_ref().map(|n| n as &dyn NodeRegistry)
    }
}

/// The oldest release with `SKIP LOCKED`, when `version` (`SELECT VERSION()`) is older.
/// Major and minor alone: MySQL 8.0's first releases were milestones nobody runs, and
/// Aurora writes `8.0.mysql_aurora.3.05.2`. MariaDB's replication prefix `5.5.5-` is no
/// part of its version.
fn skip_locked_missing(version: &str) -> Option<&'static str> {
    let bare = version.strip_prefix("5.5.5-").unwrap_or(version);
    let mut numbers = bare
        .split(|c: char| !c.is_ascii_digit())
        .map_while(|n| n.parse::<u32>().ok());
    let at = (numbers.next()?, numbers.next()?);
    if bare.to_ascii_lowercase().contains("mariadb") {
        (at < (10, 6)).then_some("MariaDB 10.6")
    } else {
        (at < (8, 0)).then_some("MySQL 8.0")
    }
}

/// Whether a column of `data_type` (information_schema's, lower case) reads as `id_type`.
fn id_column_fits(data_type: &str, id_type: IdType) -> bool {
    const INTEGERS: [&str; 6] = [
        "tinyint",
        "smallint",
        "mediumint",
        "int",
        "integer",
        "bigint",
    ];
    const TEXTS: [&str; 7] = [
        "char",
        "varchar",
        "tinytext",
        "text",
        "mediumtext",
        "longtext",
        "uuid",
    ];
    match id_type {
        IdType::Integer => INTEGERS.contains(&data_type),
        IdType::Uuid => TEXTS.contains(&data_type),
    }
}

impl MySql {
    /// The writes the relay makes that the role may not: each tried as a statement that
    /// matches no row, which the server refuses (1142) all the same without the privilege.
    /// `check` said "privileges" without asking; a role without DELETE published, failed
    /// its ack, and under a restarting supervisor published the same rows again each time.
    async fn missing_privileges(&self, sql: &Sql, layout: &str, side: bool) -> Vec<Problem> {
        let (table, id) = (sql.table(), sql.quote(&sql.mapping.id));
        let mut probes = vec![(
            "UPDATE",
            table.clone(),
            format!("UPDATE {table} SET {id} = {id} WHERE FALSE"),
        )];
        if !sql.mapping.retains_delivered() {
            probes.push((
                "DELETE",
                table.clone(),
                format!("DELETE FROM {table} WHERE FALSE"),
            ));
        }
        if side {
            let dead = sql.dead_table();
            probes.push((
                "INSERT",
                dead.clone(),
                format!("INSERT INTO {dead} SELECT * FROM {dead} WHERE FALSE"),
            ));
            probes.push((
                "DELETE",
                dead.clone(),
                format!("DELETE FROM {dead} WHERE FALSE"),
            ));
        }
        let mut problems = Vec::new();
        for (privilege, on, probe) in probes {
            let refused = self
                .query("verify", probe, Params::new(Dialect::MySql))
                .await
                .err()
                .filter(|e| e.kind() == StoreErrorKind::Privilege);
            if refused.is_some() {
                problems.push(Problem::blocking(
                    format!("the current role lacks {privilege} on {on}"),
                    format!(
                        "GRANT {privilege} ON {on} TO <relay role>; (see `outbox-relay migrate \
                         --layout {layout} --print --role <relay role>`)"
                    ),
                ));
            }
        }
        problems
    }

    /// The mapped id and key columns' types, where the relay cannot work with them.
    async fn column_problems(&self, sql: &Sql) -> StoreResult<Vec<Problem>> {
        let m = &sql.mapping;
        let mut problems = Vec::new();
        let data_type = async |column: &str| -> StoreResult<Option<String>> {
            let mut p = Params::new(Dialect::MySql);
            let statement = sql.column_type_query(column, &mut p);
            let rows = self.query("verify", statement, p).await?;
            Ok(rows
                .first()
                .and_then(|r| text(col(r, 0)))
                .map(|t| t.to_ascii_lowercase()))
        };
        if let Some(found) = data_type(&m.id).await? {
            if !id_column_fits(&found, m.id_type) {
                let wanted = match m.id_type {
                    IdType::Integer => "an integer type",
                    IdType::Uuid => "CHAR(36) (a UUID in text form)",
                };
                problems.push(Problem::blocking(
                    format!(
                        "the id column {:?} is {found}, and the mapping reads it as {wanted}: \
                         the relay could not name its rows to mark, delete or dead-letter them",
                        m.id
                    ),
                    id_column_fix(m),
                ));
            }
        }
        if let Some(key) = &m.key {
            let binary = [
                "binary",
                "varbinary",
                "tinyblob",
                "blob",
                "mediumblob",
                "longblob",
            ];
            if let Some(found) = data_type(key)
                .await?
                .filter(|t| binary.contains(&t.as_str()))
            {
                problems.push(Problem::degraded(
                    format!(
                        "the key column {key:?} is {found}: a key that is not UTF-8 text reaches \
                         the sink altered, and can share its order with another"
                    ),
                    format!(
                        "map a text column as the key, e.g. a generated `key_text VARCHAR(64) \
                         AS (HEX({key})) STORED`"
                    ),
                ));
            }
        }
        Ok(problems)
    }

    /// [`bounded`] by the store's operation timeout.
    async fn bounded<T>(
        &self,
        context: &'static str,
        operation: impl std::future::Future<Output = StoreResult<T>>,
    ) -> StoreResult<T> {
        bounded(self.operation_timeout, context, operation).await
    }

    /// A takeover of the lock from a stale holder (`take`, given its context), bounded: the
    /// operation timeout and the 10 s its `GET_LOCK` waits of its own. The lock taken is
    /// held from here ([`HeldLock`]).
    async fn taking_over<'a, F>(
        &'a self,
        mapping: &Mapping,
        take: impl FnOnce(&'static str) -> F,
    ) -> StoreResult<Option<HeldLock>>
    where
        F: std::future::Future<Output = StoreResult<Option<Conn>>> + 'a,
    {
        let context = "take the active-relay lock from a stale holder";
        let within = self.operation_timeout + Duration::from_secs(10);
        match tokio::time::timeout(within, take(context)).await {
            Ok(taken) => match taken? {
                Some(conn) => self.hold_alone(mapping, conn).await.map(Some),
                None => Ok(None),
            },
            Err(_) => Err(StoreError::new(
                StoreErrorKind::Connection,
                format!("{context}: no answer from the database within {within:?}"),
            )),
        }
    }

    /// [`MappedDb::take_lock_from_stale`], unbounded.
    async fn take_stale_lock(
        &self,
        mapping: &Mapping,
        entitled: &(dyn Fn() -> bool + Sync),
        context: &'static str,
    ) -> StoreResult<Option<Conn>> {
        let name = self.lock_name(mapping);
        let mut conn = lock_connection(&self.opts, context).await?;
        let got: Option<Option<i64>> = conn
            .exec_first("SELECT GET_LOCK(?, 0)", (&name,))
            .await
            .map_err(|e| db_error(context, e))?;
        if got.flatten() == Some(1) {
            return Ok(Some(conn));
        }
        let holder: Option<Option<u64>> = conn
            .exec_first("SELECT IS_USED_LOCK(?)", (&name,))
            .await
            .map_err(|e| db_error(context, e))?;
        match holder.flatten() {
            Some(_) if !entitled() => {
                let_go(conn).await;
                Ok(None)
            }
            holder => end_holder(conn, holder, &name, context).await,
        }
    }

    /// One transaction: the claimable rows are read without locks, then those rows alone
    /// locked (skipping rows other transactions hold) and marked by id; rows behind an
    /// earlier row of their key that another transaction holds are left out
    /// ([`not_behind_locked_rows`]).
    ///
    /// Not one locking read over the condition: InnoDB locks every row such a read passes,
    /// and MariaDB kept the locks of the rows the condition then refused (rows scheduled
    /// for later, or waiting out a retry) until the commit. 300,000 scheduled rows cost
    /// 600,000 locks a claim; the application's updates of them waited on the relay, its
    /// inserts failed once the locks filled the buffer pool, and the server aborted.
    async fn claim_once(&self, sql: &Sql, claim: Claim) -> StoreResult<Vec<Row>> {
        let mut unlocked = claim.params.clone();
        let order = sql.claim_order(&claim.condition, &unlocked.int(claim.limit));
        let mut conn = self.conn("claim").await?;
        let mut tx = conn
            .start_transaction(mysql_async::TxOpts::default())
            .await
            .map_err(|e| db_error("claim", e))?;
        let in_order: Vec<(Value, Option<String>)> = tx
            .exec(&order, bind(unlocked))
            .await
            .map_err(|e| db_error("claim", e))?;
        // Every id read back, or none: a row whose id cannot be read is locked by the
        // condition alone, and the store sets it aside once claimed, as before.
        let found: Option<Vec<RowId>> = in_order
            .iter()
            .map(|(id, _)| parse_row_id(&text(id).unwrap_or_default(), &sql.mapping).ok())
            .collect();
        let mut rows: Vec<Row> = Vec::new();
        if !in_order.is_empty() {
            let mut params = claim.params;
            let limit = params.int(claim.limit);
            let condition = match found {
                Some(ids) => {
                    let membership = params.in_ids(&ids, sql.mapping.id_type);
                    format!("({}) AND {} {membership}", claim.condition, sql.id_column())
                }
                None => claim.condition.clone(),
            };
            let select = sql.claim_select(&condition, &limit, true);
            let update = params.after();
            rows = tx
                .exec(&select, bind(params))
                .await
                .map_err(|e| db_error("claim", e))?;
            rows = not_behind_locked_rows(rows, &in_order);
            self.mark_claimed(sql, &mut tx, update, claim.mark, &rows)
                .await?;
        }
        tx.commit().await.map_err(|e| db_error("claim", e))?;
        Ok(rows)
    }

    /// Marks the claimed `rows` with the node and its lease, in the claim's transaction.
    async fn mark_claimed(
        &self,
        sql: &Sql,
        tx: &mut mysql_async::Transaction<'_>,
        mut update: Params,
        mark: Option<(String, i64)>,
        rows: &[Row],
    ) -> StoreResult<()> {
        if let (Some((node, lease)), false) = (mark, rows.is_empty()) {
            let set = sql.claim_set(&update.text(node), &update.int(lease));
            // A row whose id cannot be read back is set aside by the store, unmarked.
            let ids: Vec<RowId> = rows
                .iter()
                .filter_map(|r| read_id(r, &sql.mapping).ok())
                .collect();
            let membership = update.in_ids(&ids, sql.mapping.id_type);
            if !set.is_empty() {
                let statement = sql.update(&set, &format!("{} {membership}", sql.id_column()));
                tx.exec_drop(statement, bind(update))
                    .await
                    .map_err(|e| db_error("claim", e))?;
            }
        }
        Ok(())
    }
}

/// The claimed `rows` (locked, in publish order, skipping rows other transactions hold)
/// that no earlier row of their key was skipped for: an application's `SELECT … FOR
/// UPDATE` on an outbox row made the claim pass it, and the later rows of its key went out
/// first. `in_order` is the same claim read without locks, each id with its key: a key
/// with a row there that the claim lacks is held back from that row on, and claimed rows
/// past its end (it covers less when rows were skipped) wait for the next claim.
fn not_behind_locked_rows(rows: Vec<Row>, in_order: &[(Value, Option<String>)]) -> Vec<Row> {
    let claimed: Vec<Option<String>> = rows.iter().map(|r| text(col(r, 0))).collect();
    let unlocked = in_order.iter().map(|(id, _)| text(id));
    if in_order.len() == claimed.len() && unlocked.zip(&claimed).all(|(id, c)| id == *c) {
        return rows;
    }
    let mut skipped_keys = std::collections::HashSet::new();
    let mut keep = std::collections::HashSet::new();
    for (id, key) in in_order {
        let id = text(id);
        if claimed.contains(&id) {
            if !skipped_keys.contains(key) {
                keep.insert(id);
            }
        } else {
            skipped_keys.insert(key.clone());
        }
    }
    let before = rows.len();
    let rows: Vec<Row> = rows
        .into_iter()
        .filter(|r| keep.contains(&text(col(r, 0))))
        .collect();
    tracing::debug!(
        left = before - rows.len(),
        "rows behind an earlier row of their key that another transaction holds locked wait"
    );
    rows
}

/// `operation`, failing as a lost connection once it has waited `within`: a connection the
/// network dropped silently answers nothing, and the driver waits for good. The connection
/// goes with the dropped operation.
pub(crate) async fn bounded<T>(
    within: Duration,
    context: &str,
    operation: impl std::future::Future<Output = StoreResult<T>>,
) -> StoreResult<T> {
    tokio::time::timeout(within, operation)
        .await
        .unwrap_or_else(|_| Err(outbox_core::store::no_answer(context, within)))
}

/// The server's own ceiling for `max_allowed_packet` (1 GiB), which the client takes as its
/// limit for packets it reads and sends.
pub const LARGEST_PACKET: usize = 1 << 30;

/// Every connection's session settings (a pooled connection is reset each time it goes back
/// to the pool; `session::a_connection_back_from_the_pool_keeps_utc_and_read_committed`
/// shows they hold after it), and a client limit for packets of [`LARGEST_PACKET`]: with
/// the server's `max_allowed_packet` for its own (mysql_async's default), a row written
/// before the server's limit was lowered could not be read, and every claim that read it
/// failed, for good. The server still refuses a statement past its own limit
/// ([`too_large_for_the_server`]).
pub fn session_settings(builder: OptsBuilder) -> OptsBuilder {
    builder
        .setup(outbox_layout::sql::MYSQL_SESSION_SETTINGS.to_vec())
        .max_allowed_packet(Some(LARGEST_PACKET))
}

/// How long a connection back from its last statement stays open in the pool for the next.
/// With mysql_async's default of none, the pool keeps no more idle connections than its
/// minimum, 0 here: every claim, ack and retry opened a connection (a TCP connect, a second
/// one to the server's socket, a login, the session settings) and closed it after one
/// statement. With [`IDLE_CONNECTION_CHECK`] it stays under the sessions' idle bound
/// ([`outbox_layout::sql::MYSQL_IDLE_SESSION`]), so the pool closes an idle connection
/// before the server ends it.
pub const IDLE_CONNECTION_TTL: Duration = Duration::from_secs(6);

/// How often the pool looks for connections idle past [`IDLE_CONNECTION_TTL`].
pub const IDLE_CONNECTION_CHECK: Duration = Duration::from_secs(1);

/// The pool of up to `size` connections (at least 2) the store runs on: none kept while the
/// relay is idle for [`IDLE_CONNECTION_TTL`], every one kept while it is busy.
pub fn pool_opts(size: usize) -> StoreResult<PoolOpts> {
    let constraints = PoolConstraints::new(0, size.max(2))
        .ok_or_else(|| StoreError::new(StoreErrorKind::Config, "invalid MySQL pool size"))?;
    Ok(PoolOpts::default()
        .with_constraints(constraints)
        .with_inactive_connection_ttl(IDLE_CONNECTION_TTL)
        .with_ttl_check_interval(IDLE_CONNECTION_CHECK))
}

/// Ends connection `holder` (`KILL CONNECTION`, which the server allows on a connection of
/// the same user, or with CONNECTION ADMIN / SUPER), then waits on `conn` for the lock `name`
/// the server frees with it.
async fn end_holder(
    mut conn: Conn,
    holder: Option<u64>,
    name: &str,
    context: &'static str,
) -> StoreResult<Option<Conn>> {
    const ER_NO_SUCH_THREAD: u16 = 1094;
    if let Some(holder) = holder {
        match conn.query_drop(format!("KILL CONNECTION {holder}")).await {
            Ok(()) => {
                tracing::warn!(connection = holder, lock = %name, "ended a stale holder's connection to take its lock")
            }
            Err(mysql_async::Error::Server(e)) if e.code == ER_NO_SUCH_THREAD => {}
            Err(e) => {
                return Err(StoreError::new(
                    classify(&e),
                    format!(
                        "{context}: connection {holder} of a relay that is gone or paused holds \
                         the lock {name:?}, and this role cannot end it ({e}): run every relay \
                         of this outbox as the same database user, or grant this one \
                         CONNECTION ADMIN (MySQL 8) or CONNECTION ADMIN / SUPER (MariaDB)"
                    ),
                ))
            }
        }
    }
    // The server frees the lock as it ends the connection: wait for that, not longer.
    let got: Option<Option<i64>> = conn
        .exec_first("SELECT GET_LOCK(?, 10)", (name,))
        .await
        .map_err(|e| db_error(context, e))?;
    Ok((got.flatten() == Some(1)).then_some(conn))
}

/// The `GET_LOCK` name of an outbox's (`database.table`) active polling relay: server-wide,
/// so the database is named too; at most 64 characters.
pub fn polling_lock_name(outbox: &str) -> String {
    outbox_core::ident::server_lock_name("outbox-relay ", outbox)
}

/// The `GET_LOCK` name of an outbox's (`database.table`) binlog capture reader.
pub fn capture_lock_name(outbox: &str) -> String {
    outbox_core::ident::server_lock_name("outbox-binlog:", outbox)
}

/// How a relay takes a MySQL outbox's events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Relaying {
    /// Claims from the table (the active relay's lock, [`polling_lock_name`]).
    Polling,
    /// Reads the binary log (the reader's seat, [`capture_lock_name`]).
    Capture,
}

/// The connection that holds the other way's `lock`, if any. Each way's lock keeps only
/// relays of its own way apart, and a polling relay beside a capture reader sends every
/// event twice (one takes each row from the table, the other from the log): a relay that
/// took its own way's lock asks this of the other's, so that of two started together at
/// least one sees the other.
pub async fn other_way_holder(
    conn: &mut Conn,
    lock: &str,
) -> Result<Option<u64>, mysql_async::Error> {
    let holder: Option<Option<u64>> = conn.exec_first("SELECT IS_USED_LOCK(?)", (lock,)).await?;
    Ok(holder.flatten())
}

/// Why a relay taking `outbox`'s events as `this` says is refused, the other way's lock
/// held by connection `holder`.
pub fn ways_meet(outbox: &str, this: Relaying, holder: u64) -> String {
    let (this, other) = match this {
        Relaying::Polling => (
            "polling relay",
            "a binlog capture relay (--capture binlog) reads it",
        ),
        Relaying::Capture => (
            "binlog capture relay",
            "a polling relay is its active relay",
        ),
    };
    format!(
        "this {this} would relay the outbox {outbox} while {other} (connection {holder} holds \
         that way's lock): each takes every event, one from the table, the other from the \
         binary log, so every event would go out twice; this relay takes no event while it \
         does. Run every relay of one outbox the same way: to switch, stop every relay of the \
         other way first"
    )
}

/// How often the active relay proves its lock's session alive: a ping, from a task of its
/// own, whatever the engine is doing (claims stop while a slow sink holds every event).
pub const LOCK_KEEPALIVE: Duration = Duration::from_secs(2);

/// A lock whose session has been idle this long belongs to a relay that is gone or paused
/// (a live one pings every [`LOCK_KEEPALIVE`]): a standby ends that session and takes over.
pub const LOCK_STALE_AFTER: Duration = Duration::from_secs(15);

/// The holder counts its lock as held only while its last answered ping is younger than
/// this, well inside [`LOCK_STALE_AFTER`]: a holder paused past the stale bound, or whose
/// pings go unanswered, stops claiming before a standby may end its session and take over.
pub const LOCK_ALIVE_FOR: Duration = Duration::from_secs(8);

/// The active-relay lock's session, owned by a task that pings it every
/// [`LOCK_KEEPALIVE`]; the first ping that fails or goes unanswered ends the task, and the
/// session with it. Dropped, it lets the lock go.
pub struct HeldLock {
    /// When the last ping was answered; `None` once one was not.
    answered: std::sync::Arc<std::sync::Mutex<Option<std::time::Instant>>>,
    keeper: tokio::task::JoinHandle<()>,
}

impl HeldLock {
    fn hold(conn: Conn, timeout: Duration) -> HeldLock {
        let answered = std::sync::Arc::new(std::sync::Mutex::new(Some(std::time::Instant::now())));
        // A ping unanswered for longer than this is as good as failed.
        let timeout = timeout.min(LOCK_ALIVE_FOR - LOCK_KEEPALIVE);
        let keeper = tokio::spawn({
            let answered = answered.clone();
            async move {
                let mut conn = conn;
                loop {
                    tokio::time::sleep(LOCK_KEEPALIVE).await;
                    let answer = tokio::time::timeout(timeout, read_only(&mut conn)).await;
                    let ok = matches!(answer, Ok(Ok(false)));
                    if let Ok(Ok(true)) = answer {
                        tracing::warn!(
                            "the server holding the active relay's lock turned read-only (a \
                             switchover that demoted it?): letting the lock go, so that the \
                             relay takes it again on the server that takes writes"
                        );
                    }
                    let mut last = answered.lock().unwrap_or_else(|p| p.into_inner());
                    if !ok {
                        *last = None;
                        return;
                    }
                    *last = Some(std::time::Instant::now());
                }
            }
        });
        HeldLock { answered, keeper }
    }

    /// Whether the lock is still this relay's, as far as it can tell: its session answered
    /// a ping within [`LOCK_ALIVE_FOR`].
    fn alive(&self) -> bool {
        let last = *self.answered.lock().unwrap_or_else(|p| p.into_inner());
        answered_lately(last, std::time::Instant::now())
    }
}

/// Whether the server takes no writes. The active relay's lock is the server's alone: on a
/// primary demoted by a switchover (Orchestrator, ProxySQL, MHA set `read_only` on it), a
/// lock session left there keeps answering, while claims on new connections reach the new
/// primary, where a standby takes the same lock freely: two active relays.
async fn read_only(conn: &mut Conn) -> Result<bool, mysql_async::Error> {
    let answer: Option<Row> = conn.query_first(READ_ONLY_QUERY).await?;
    Ok(answer.as_ref().is_some_and(answers_read_only))
}

/// The server's read-only settings, as text: MariaDB 12 answers `read_only` as `ON`/`OFF`
/// (an enum with NO_LOCK modes), older servers and MySQL as 1/0.
const READ_ONLY_QUERY: &str =
    "SELECT CAST(@@global.read_only AS CHAR), CAST(@@global.innodb_read_only AS CHAR)";

/// Whether a row of [`READ_ONLY_QUERY`] says the server takes no writes.
fn answers_read_only(row: &Row) -> bool {
    (0..2).any(|i| {
        text(col(row, i))
            .is_some_and(|v| !matches!(v.trim().to_ascii_uppercase().as_str(), "0" | "OFF"))
    })
}

/// Whether a ping last `answered` (`None`: one went unanswered) keeps the lock held at `now`.
fn answered_lately(answered: Option<std::time::Instant>, now: std::time::Instant) -> bool {
    answered.is_some_and(|at| now.saturating_duration_since(at) < LOCK_ALIVE_FOR)
}

impl Drop for HeldLock {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

/// A connection of its own that holds a named lock (`GET_LOCK`) for as long as this relay
/// is active. It sits idle between the pings that prove it alive, so it keeps the server's
/// own `wait_timeout` rather than the idle bound of the session settings; a paused holder is
/// ended by the standby that takes over instead.
async fn lock_connection(opts: &Opts, context: &'static str) -> StoreResult<Conn> {
    let mut conn = Conn::new(opts.clone())
        .await
        .map_err(|e| db_error(context, e))?;
    // The server's own bound, but never below a minute: the keeper pings every
    // LOCK_KEEPALIVE, and a server whose wait_timeout was as short ended the session
    // between pings, so the relay lost its lock and reaped its own rows in flight, sent
    // again (a paused holder's session is ended by the standby, not by this bound).
    conn.query_drop("SET SESSION wait_timeout = GREATEST(@@GLOBAL.wait_timeout, 60)")
        .await
        .map_err(|e| db_error(context, e))?;
    Ok(conn)
}

/// Closes a connection the lock was not taken on, saying goodbye: a connection merely
/// dropped is an "Aborted connection" in the server's log and its `Aborted_clients`, once a
/// second per standby.
async fn let_go(conn: Conn) {
    let bound = LOCK_KEEPALIVE;
    if let Ok(Err(e)) = tokio::time::timeout(bound, conn.disconnect()).await {
        tracing::debug!(error = %e, "closing a connection the lock was not taken on");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Claims need `SKIP LOCKED`: on an older server every claim failed with a syntax error,
    /// retried for ever, while `check` passed.
    #[test]
    fn servers_without_skip_locked_are_named_with_the_release_to_upgrade_to() {
        for (version, missing) in [
            ("10.11.6-MariaDB-0+deb12u1", None),
            ("10.6.0-MariaDB", None),
            ("10.5.23-MariaDB-log", Some("MariaDB 10.6")),
            ("5.5.5-10.3.39-MariaDB", Some("MariaDB 10.6")),
            ("12.0.2-MariaDB", None),
            ("8.0.36", None),
            ("8.0.1", None),
            ("9.1.0", None),
            ("5.5.5-10.11.6-MariaDB", None),
            ("5.7.44-log", Some("MySQL 8.0")),
            ("5.7.mysql_aurora.2.11.2", Some("MySQL 8.0")),
            ("8.0.mysql_aurora.3.05.2", None),
            ("not a version", None),
        ] {
            assert_eq!(skip_locked_missing(version), missing, "{version}");
        }
    }

    #[test]
    fn id_columns_fit_only_types_read_back_as_the_mapping_reads_them() {
        assert!(id_column_fits("bigint", IdType::Integer));
        assert!(id_column_fits("char", IdType::Uuid));
        assert!(id_column_fits("uuid", IdType::Uuid));
        assert!(!id_column_fits("binary", IdType::Uuid));
        assert!(!id_column_fits("varbinary", IdType::Uuid));
        assert!(!id_column_fits("char", IdType::Integer));
    }

    /// Failures a retry cannot mend stop at once, naming the fix; a read-only server and a
    /// session MySQL ended for idling are retried.
    #[test]
    fn server_errors_are_classified_by_what_mends_them() {
        let server = |code: u16| {
            mysql_async::Error::Server(mysql_async::ServerError {
                code,
                message: "m".into(),
                state: "HY000".into(),
            })
        };
        for (code, kind) in [
            (1049, StoreErrorKind::Config),
            (3159, StoreErrorKind::Config),
            (1130, StoreErrorKind::Config),
            (4031, StoreErrorKind::Connection),
            (1290, StoreErrorKind::Connection),
            (1792, StoreErrorKind::Connection),
            (1146, StoreErrorKind::MissingSchema),
        ] {
            assert_eq!(classify(&server(code)), kind, "{code}");
        }
        let bug = mysql_async::Error::Driver(mysql_async::DriverError::MixedParams);
        assert_eq!(classify(&bug), StoreErrorKind::Query);
        assert!(db_error("claim", server(1290))
            .to_string()
            .contains("point the relay's URL at the primary"));
    }

    /// A holder paused past the stale bound (SIGSTOP, a frozen VM) resumed with its lock
    /// taken by a standby: its claims must stop on their own, before its keepalive task gets
    /// to ping and find out, and well before a standby may end its session.
    #[test]
    fn a_holder_whose_last_answer_is_old_holds_no_lock() {
        let at = std::time::Instant::now();
        assert!(answered_lately(Some(at), at + LOCK_KEEPALIVE));
        assert!(!answered_lately(Some(at), at + LOCK_ALIVE_FOR));
        assert!(!answered_lately(None, at));
        assert!(LOCK_ALIVE_FOR < LOCK_STALE_AFTER);
    }
}
