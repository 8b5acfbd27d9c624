//! Maps PostgreSQL and pool errors to [`StoreErrorKind`]s by SQLSTATE, never by message text.

use outbox_core::{StoreError, StoreErrorKind};
use tokio_postgres::error::SqlState;

pub fn classify(error: &tokio_postgres::Error) -> StoreErrorKind {
    let Some(code) = error.code() else {
        // No SQLSTATE: either the connection failed (I/O, TLS, closed) or the client
        // refused a parameter or row (a bug, not worth a reconnect).
        let io = std::error::Error::source(error)
            .is_some_and(|s| s.downcast_ref::<std::io::Error>().is_some());
        return if error.is_closed() || io || error.to_string().starts_with("error connecting") {
            StoreErrorKind::Connection
        } else {
            StoreErrorKind::Query
        };
    };
    if *code == SqlState::UNDEFINED_TABLE
        || *code == SqlState::UNDEFINED_COLUMN
        || *code == SqlState::UNDEFINED_FUNCTION
        || *code == SqlState::INVALID_SCHEMA_NAME
    {
        StoreErrorKind::MissingSchema
    } else if *code == SqlState::INSUFFICIENT_PRIVILEGE {
        StoreErrorKind::Privilege
    } else if *code == SqlState::INVALID_PASSWORD
        || *code == SqlState::INVALID_AUTHORIZATION_SPECIFICATION
        || *code == SqlState::INVALID_CATALOG_NAME
    {
        StoreErrorKind::Config
    } else if *code == SqlState::T_R_DEADLOCK_DETECTED
        || *code == SqlState::T_R_SERIALIZATION_FAILURE
        || *code == SqlState::LOCK_NOT_AVAILABLE
    {
        StoreErrorKind::Conflict
    } else if code.code().starts_with("23") || *code == SqlState::RAISE_EXCEPTION {
        // Integrity constraints (a foreign key to an outbox row) and a trigger's plain
        // RAISE EXCEPTION: about a row, which the settles split out.
        StoreErrorKind::RowRefused
    } else if code.code().starts_with("08")
        || code.code().starts_with("57")
        || *code == SqlState::TOO_MANY_CONNECTIONS
    {
        // Connection exceptions; 57P01 is pg_terminate_backend, 57P03 "starting up".
        StoreErrorKind::Connection
    } else {
        StoreErrorKind::Query
    }
}

/// The fix for a failed TLS handshake: the host and port are right (the server answered), the
/// certificates or the sslmode are not.
pub const TLS_HINT: &str = "check the URL's sslmode (require needs a server with ssl = on; \
    verify-ca and verify-full need the CA that signed the server's certificate, given with \
    --database-ca-file or sslrootcert, and verify-full a certificate naming the URL's host)";

/// tokio-postgres reports a failed handshake (a certificate refused, a server without TLS)
/// as its TLS error kind, which it exposes only through this text.
fn is_tls_failure(error: &tokio_postgres::Error) -> bool {
    error
        .to_string()
        .starts_with("error performing TLS handshake")
}

/// The fix for a statement the server ended at the store's bound (statement_timeout) or a
/// lock it could not get: almost always another session's lock, not the network.
pub const WAITED_HINT: &str = "the statement waited past the relay's operation timeout, most \
    often for a lock another session holds on the outbox's tables (VACUUM FULL, CLUSTER, \
    REINDEX, ALTER TABLE, pg_repack, a long or idle-in-transaction session): find it with \
    SELECT pid, state, query FROM pg_stat_activity WHERE pid = ANY(pg_blocking_pids(<the \
    relay's pid>)), and let it finish or end it; the relay retries meanwhile";

/// The fix for a row the relay writes whose id a table holds already: the outbox's id
/// sequence was reset behind the dead letters' ids.
pub const UNIQUE_HINT: &str = "a row with this id is there already: if the outbox's id \
    sequence was reset (TRUNCATE … RESTART IDENTITY, a restore, ALTER SEQUENCE … RESTART), \
    set it past every id the dead-letter table holds (`outbox-relay check` prints the setval \
    that does it); the relay retries meanwhile";

/// The fix for writes refused by a database in read-only mode.
pub const READ_ONLY_HINT: &str = "the database refuses writes (default_transaction_read_only \
    for the database or role, a standby, or a managed service gone read-only, often on a full \
    disk): the relay claims and settles by writing; make it writable, and the relay goes on";

/// The fix when the server refused the relay's login (SQLSTATE 28000, 28P01), at start or
/// when a running relay connected again: "fix the configuration value named in the message"
/// named nothing a role without LOGIN or a rotated password could be fixed by.
pub const LOGIN_REFUSED_HINT: &str = "the server refused the relay's login: a wrong or \
    rotated password in the URL, a pg_hba.conf line that rejects this host or user, or a role \
    without LOGIN (ALTER ROLE <role> LOGIN); fix it and start the relay again";

/// The fix when the server turned away a connection for a connection limit (SQLSTATE 53300):
/// the server's, the role's or the database's. It was taken for a server that does not
/// answer ("check that the database is running and the URL's host…").
pub const CONNECTION_LIMIT_HINT: &str = "a connection limit is reached: the server's \
    max_connections, or the role's or the database's CONNECTION LIMIT (as an administrator: \
    SELECT rolconnlimit FROM pg_roles WHERE rolname = '<the relay's role>'; SELECT datconnlimit \
    FROM pg_database WHERE datname = '<the database>'); the relay opens up to pool_size connections and a few of its own \
    (LISTEN, the cluster's heartbeats, WAL capture's replication session): raise the limit, or \
    lower --pool-size; the relay retries meanwhile";

/// The fix when the server turned away a connection for not using TLS.
pub const TLS_REQUIRED_HINT: &str = "the server accepts only TLS connections from this host: \
    use sslmode=require in the URL (or verify-full, with --database-ca-file for a private CA)";

/// pg_hba.conf refuses a plain connection that a `hostssl` line would accept; PostgreSQL says
/// so only in the message's last words ("…, no encryption").
fn is_refused_without_tls(db: &tokio_postgres::error::DbError) -> bool {
    *db.code() == SqlState::INVALID_AUTHORIZATION_SPECIFICATION
        && db.message().ends_with("no encryption")
}

pub fn db_error(context: &str, error: tokio_postgres::Error) -> StoreError {
    let kind = classify(&error);
    match error.as_db_error() {
        Some(db) if is_refused_without_tls(db) => {
            StoreError::new(kind, format!("{context}: {}", db.message()))
                .with_hint(TLS_REQUIRED_HINT)
        }
        Some(db)
            if *db.code() == SqlState::QUERY_CANCELED
                || *db.code() == SqlState::LOCK_NOT_AVAILABLE =>
        {
            StoreError::new(kind, format!("{context}: {}", db.message())).with_hint(WAITED_HINT)
        }
        Some(db) if *db.code() == SqlState::UNIQUE_VIOLATION => {
            StoreError::new(kind, format!("{context}: {}", db.message())).with_hint(UNIQUE_HINT)
        }
        Some(db)
            if *db.code() == SqlState::INVALID_PASSWORD
                || *db.code() == SqlState::INVALID_AUTHORIZATION_SPECIFICATION =>
        {
            StoreError::new(kind, format!("{context}: {}", db.message()))
                .with_hint(LOGIN_REFUSED_HINT)
        }
        Some(db) if *db.code() == SqlState::TOO_MANY_CONNECTIONS => {
            StoreError::new(kind, format!("{context}: {}", db.message()))
                .with_hint(CONNECTION_LIMIT_HINT)
        }
        Some(db) if *db.code() == SqlState::READ_ONLY_SQL_TRANSACTION => {
            StoreError::new(kind, format!("{context}: {}", db.message())).with_hint(READ_ONLY_HINT)
        }
        // The server's message says it all; the wrapper would only repeat it.
        Some(db) => StoreError::new(kind, format!("{context}: {}", db.message())),
        None if is_tls_failure(&error) => StoreError::new(kind, format!("{context}: {error}"))
            .with_source(error)
            .with_hint(TLS_HINT),
        None => StoreError::new(kind, format!("{context}: {error}")).with_source(error),
    }
}

pub fn pool_error(context: &str, error: deadpool_postgres::PoolError) -> StoreError {
    match error {
        deadpool_postgres::PoolError::Backend(e) => db_error(context, e),
        other => StoreError::new(
            StoreErrorKind::Connection,
            format!("{context}: no database connection: {other}"),
        ),
    }
}
