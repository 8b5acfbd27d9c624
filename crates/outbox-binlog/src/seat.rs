//! One active reader per outbox, and the position it stores.
//!
//! The server keeps no slot for a binlog reader, so the relay keeps its own position, in a
//! small table ([`positions_ddl`]), one row per outbox. Only the *active* reader may read
//! the log and write that row; the others wait as standbys. The seat has three guards:
//!
//! - **A lock.** The active reader holds `GET_LOCK` on a connection of its own. The server
//!   releases it when that connection ends (the relay exits, crashes, or is killed).
//! - **A lease.** A paused process (SIGSTOP, a VM freeze) keeps its connection, and so its
//!   lock, for as long as the server's `wait_timeout` (eight hours by default). So the row
//!   also carries a lease the active reader renews with every write. A standby that finds
//!   the lease lapsed ends the holder's connection (`KILL CONNECTION`: the same user may,
//!   others need `CONNECTION ADMIN`), which frees the lock.
//! - **An epoch.** Each taking of the seat increments the row's epoch, and every write is
//!   conditional on the epoch the writer took the seat at. A reader that lost the seat
//!   while paused has its writes refused ([`BinlogError::Fenced`]) even if a write was
//!   already on its way.

use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, OptsBuilder};

use crate::{opts, BinlogError, BinlogPosition, Result};

/// ER_NO_SUCH_THREAD: the connection to end is gone already.
const ER_NO_SUCH_THREAD: u16 = 1094;

/// The table that keeps each outbox's reader position (MySQL/MariaDB DDL).
pub fn positions_ddl(table: &str) -> String {
    let table = quoted(table);
    format!(
        "CREATE TABLE IF NOT EXISTS {table} (
    outbox        varchar(191) NOT NULL PRIMARY KEY,
    log_file      varchar(255) NOT NULL DEFAULT '',
    log_offset    bigint unsigned NOT NULL DEFAULT 0,
    holder        varchar(255) NOT NULL DEFAULT '',
    connection_id bigint unsigned NOT NULL DEFAULT 0,
    epoch         bigint NOT NULL DEFAULT 0,
    lease_until   datetime(6) NOT NULL DEFAULT '1970-01-01 00:00:01',
    updated_at    datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    {GTID_COLUMNS}
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;
"
    )
}

/// The columns that say whose log the position is in, and where it is by GTID, added to
/// the positions table after it was first released ([`upgrade_positions`] adds them to a
/// table made before).
const GTID_COLUMNS: &str = "server_id     bigint unsigned NULL,
    gtid          text NULL";

/// ER_BAD_FIELD_ERROR: a column the statement names is not in the table.
const ER_BAD_FIELD_ERROR: u16 = 1054;

/// Adds the GTID columns to a positions table made before they existed (`migrate` runs it;
/// idempotent). MySQL 8 has no `ADD COLUMN IF NOT EXISTS`, so the table's columns are read.
pub async fn upgrade_positions(url: &str, positions: &str) -> Result<()> {
    let mut conn = Conn::new(opts(url)?).await?;
    let (database, table) = match positions.split_once('.') {
        Some((database, table)) => (Some(database.to_string()), table.to_string()),
        None => (None, positions.to_string()),
    };
    let has: Option<i64> = conn
        .exec_first(
            "SELECT count(*) FROM information_schema.COLUMNS
              WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME = ?
                AND COLUMN_NAME = 'gtid'",
            (database, table),
        )
        .await?;
    if has == Some(0) {
        let columns = GTID_COLUMNS.replace('\n', "").replace("    ", " ");
        let (server_id, gtid) = columns.split_once(',').unwrap_or_default();
        conn.query_drop(format!(
            "SET SESSION lock_wait_timeout = {}",
            crate::parked::ALTER_LOCK_WAIT_SECONDS
        ))
        .await?;
        crate::parked::alter_once(
            &mut conn,
            format!(
                "ALTER TABLE {} ADD COLUMN {}, ADD COLUMN {}",
                quoted(positions),
                server_id.trim(),
                gtid.trim()
            ),
        )
        .await?;
    }
    conn.disconnect().await?;
    Ok(())
}

/// A position read from the positions table that predates its GTID columns.
fn unupgraded(positions: &str) -> BinlogError {
    BinlogError::Config(format!(
        "the positions table {positions} predates this version (it has no gtid column): run \
         `outbox-relay migrate --capture binlog`"
    ))
}

/// A position as stored: where, and the server whose log it is in (`None`: stored before
/// the relay kept it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredPosition {
    pub position: BinlogPosition,
    pub server_id: Option<u64>,
}

/// The position stored for `outbox` in the positions table `positions`, as `check` reads
/// it: `None` while capture never started.
pub async fn stored_position(
    url: &str,
    positions: &str,
    outbox: &str,
) -> Result<Option<StoredPosition>> {
    let mut conn = Conn::new(opts(url)?).await?;
    let row = read_position(&mut conn, positions, outbox).await?;
    conn.disconnect().await?;
    Ok(row.and_then(|(_, stored)| stored))
}

/// A positions table's row: epoch, file, offset, server id, GTID state.
type PositionRow = (i64, String, u64, Option<u64>, Option<String>);

/// The row of `outbox`: its epoch, and its position unless none was stored.
async fn read_position(
    conn: &mut Conn,
    positions: &str,
    outbox: &str,
) -> Result<Option<(i64, Option<StoredPosition>)>> {
    let row: Option<PositionRow> = conn
        .exec_first(
            format!(
                "SELECT epoch, log_file, log_offset, server_id, gtid FROM {} WHERE outbox = ?",
                quoted(positions)
            ),
            (outbox,),
        )
        .await
        .map_err(|e| match e {
            mysql_async::Error::Server(e) if e.code == ER_BAD_FIELD_ERROR => unupgraded(positions),
            other => other.into(),
        })?;
    Ok(row.map(|(epoch, file, offset, server_id, gtid)| {
        let stored = (!file.is_empty()).then_some(StoredPosition {
            position: BinlogPosition { file, offset, gtid },
            server_id,
        });
        (epoch, stored)
    }))
}

/// The lease's end, `?` milliseconds from now (with the row's time of writing), and whether
/// it has passed. On the server's UTC clock: `NOW()` follows the session's time zone, which
/// each connection fixes as it connects (the system's, by default). A clock moved forward
/// (daylight saving time, `SET GLOBAL time_zone`) made a standby's new connection take a
/// healthy reader's lease for lapsed and end it; one moved back left a paused reader's lease
/// valid for an hour more.
const RENEWED: &str = "lease_until = UTC_TIMESTAMP(6) + INTERVAL (? * 1000) MICROSECOND, \
                       updated_at = UTC_TIMESTAMP(6)";
const LAPSED: &str = "lease_until < UTC_TIMESTAMP(6)";

/// Who to take the seat as, and for which outbox. Its `Debug` shows the URL redacted.
#[derive(Clone)]
pub struct SeatConfig {
    pub url: String,
    /// The positions table ([`positions_ddl`]).
    pub positions: String,
    /// The outbox the reader reads for (`database.table`): the row's key, and the lock's.
    pub outbox: String,
    /// This relay (its node id), shown to the standbys.
    pub holder: String,
    /// How long a write keeps the seat: a standby takes over this long after the active
    /// reader's last write.
    pub lease: Duration,
}

impl std::fmt::Debug for SeatConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeatConfig")
            .field("url", &outbox_core::redact::RedactedUrl(&self.url))
            .field("positions", &self.positions)
            .field("outbox", &self.outbox)
            .field("holder", &self.holder)
            .field("lease", &self.lease)
            .finish()
    }
}

/// The outcome of trying to take the seat.
#[derive(Debug)]
pub enum Taken {
    /// This relay is the active reader.
    Active(ActiveReader),
    /// Another reader holds the seat, its lease not lapsed.
    Held { holder: String },
}

/// The active reader's seat: the connection that holds the lock, and the epoch it writes at.
#[derive(Debug)]
pub struct ActiveReader {
    conn: Conn,
    config: SeatConfig,
    epoch: i64,
    stored: Option<StoredPosition>,
    /// The server's `@@server_id`: whose log the positions this reader stores are in.
    server_id: u64,
    /// A moment before the last write of the lease, from which it runs (as this process
    /// reckons it: at most as long as the server does).
    lease_from: std::time::Instant,
}

impl ActiveReader {
    /// Takes the seat if it is free, or if its holder's lease has lapsed (ending the
    /// holder's connection); otherwise says who holds it.
    pub async fn take(config: &SeatConfig) -> Result<Taken> {
        // Affected rows count matched rows, so a write that changes nothing still proves
        // the epoch matched.
        let opts = OptsBuilder::from_opts(opts(&config.url)?).client_found_rows(true);
        let mut conn = Conn::new(opts).await?;
        let lock = lock_name(&config.outbox);
        let table = quoted(&config.positions);
        conn.exec_drop(
            format!("INSERT IGNORE INTO {table} (outbox) VALUES (?)"),
            (&config.outbox,),
        )
        .await?;
        // GET_LOCK and IS_USED_LOCK answer NULL as well as a value (on an error, or when
        // the lock is free): read as `Option<Option<_>>`, never as a bare number.
        let got: Option<Option<i64>> = conn.exec_first("SELECT GET_LOCK(?, 0)", (&lock,)).await?;
        if got.flatten() != Some(1) {
            let row: Option<(String, u64, i64, i64)> = conn
                .exec_first(
                    format!(
                        "SELECT holder, connection_id, epoch, {LAPSED}
                           FROM {table} WHERE outbox = ?"
                    ),
                    (&config.outbox,),
                )
                .await?;
            let (holder, connection, epoch, lapsed) = row.unwrap_or_default();
            let using: Option<Option<u64>> =
                conn.exec_first("SELECT IS_USED_LOCK(?)", (&lock,)).await?;
            if lapsed == 0 || using.flatten() != Some(connection) {
                // A live lease; or a lock holder the row does not name (a reader between
                // its lock and its first write, or one that just left): try again later.
                conn.disconnect().await?;
                return Ok(Taken::Held { holder });
            }
            // Fence the holder first, and only if its lease is still lapsed: a holder that
            // renewed since is left alone, and one that did not has its writes refused from
            // now on, before its connection is ended.
            conn.exec_drop(
                format!(
                    "UPDATE {table} SET epoch = epoch + 1
                      WHERE outbox = ? AND epoch = ? AND {LAPSED}"
                ),
                (&config.outbox, epoch),
            )
            .await?;
            if conn.affected_rows() == 0 {
                conn.disconnect().await?;
                return Ok(Taken::Held { holder });
            }
            match conn
                .query_drop(format!("KILL CONNECTION {connection}"))
                .await
            {
                Ok(()) => {}
                // Gone already (it exited, or another standby ended it): the lock is free.
                Err(mysql_async::Error::Server(e)) if e.code == ER_NO_SUCH_THREAD => {}
                Err(e) => {
                    return Err(BinlogError::Config(format!(
                        "the active binlog reader ({holder}) let its lease lapse, but its \
                         connection {connection} still holds the lock and this role cannot end \
                         it ({e}): run every relay of this outbox as the same database user, or \
                         grant this one CONNECTION ADMIN (MySQL 8) or CONNECTION ADMIN / SUPER \
                         (MariaDB)"
                    )))
                }
            }
            // The server frees the lock as it ends the connection; wait for that, not longer.
            let got: Option<Option<i64>> =
                conn.exec_first("SELECT GET_LOCK(?, 10)", (&lock,)).await?;
            if got.flatten() != Some(1) {
                conn.disconnect().await?;
                return Ok(Taken::Held { holder });
            }
        }
        let polling = outbox_store_mysql::polling_lock_name(&config.outbox);
        if let Some(relay) = outbox_store_mysql::other_way_holder(&mut conn, &polling).await? {
            conn.disconnect().await?;
            return Err(BinlogError::Config(outbox_store_mysql::ways_meet(
                &config.outbox,
                outbox_store_mysql::Relaying::Capture,
                relay,
            )));
        }
        let lease_ms = lease_millis(config.lease);
        let lease_from = std::time::Instant::now();
        conn.exec_drop(
            format!(
                "UPDATE {table} SET epoch = epoch + 1, holder = ?, connection_id = CONNECTION_ID(),
                        {RENEWED}
                  WHERE outbox = ?"
            ),
            (&config.holder, lease_ms, &config.outbox),
        )
        .await?;
        let (epoch, stored) = read_position(&mut conn, &config.positions, &config.outbox)
            .await?
            .ok_or_else(|| {
                BinlogError::Config(format!(
                    "the positions table {} lost the row of {} while it was being taken",
                    config.positions, config.outbox
                ))
            })?;
        let server_id: Option<u64> = conn.query_first("SELECT @@server_id").await?;
        Ok(Taken::Active(ActiveReader {
            conn,
            config: config.clone(),
            epoch,
            stored,
            server_id: server_id.unwrap_or_default(),
            lease_from,
        }))
    }

    /// When the lease last written runs from: the take's, or the first position's after
    /// the adoption (which can outlast the lease: a reader counting from its take saw its
    /// lease lapsed, and its standby duties, such as ending a paused ex-reader's session on
    /// the parked table, were given up).
    pub fn lease_from(&self) -> std::time::Instant {
        self.lease_from
    }

    /// The position stored when the seat was taken (`None`: never stored; start from the
    /// server's current position and adopt the rows already in the table).
    pub fn stored(&self) -> Option<&BinlogPosition> {
        self.stored.as_ref().map(|s| &s.position)
    }

    /// The server whose log the stored position is in, as it was stored (`None`: stored
    /// before the relay kept it, or never stored).
    pub fn stored_server_id(&self) -> Option<u64> {
        self.stored.as_ref().and_then(|s| s.server_id)
    }

    /// The `@@server_id` of the server this reader is connected to.
    pub fn server_id(&self) -> u64 {
        self.server_id
    }

    /// The epoch this reader took the seat at.
    pub fn epoch(&self) -> i64 {
        self.epoch
    }

    /// Stores `position` and renews the lease. Refused ([`BinlogError::Fenced`]) once
    /// another reader has taken the seat.
    pub async fn store(&mut self, position: &BinlogPosition) -> Result<()> {
        self.write(Some(position)).await?;
        self.stored = Some(StoredPosition {
            position: position.clone(),
            server_id: Some(self.server_id),
        });
        Ok(())
    }

    /// Stores the first position of a seat that never stored one, in one transaction with
    /// `adoption`: the statements that move the rows already in the outbox table to where
    /// they are relayed from (the log from `position` on does not carry them). Either both
    /// happen or neither does, so a reader killed midway adopts them again when it starts.
    ///
    /// The adoption of a large table, or one that waits for a writer's open transaction,
    /// can outlast the lease: a second connection renews it meanwhile, so no standby takes
    /// the seat (ending this connection, and the adoption with it) from a reader that is
    /// alive. A paused one renews nothing, and is taken over as always.
    ///
    /// Returns how many rows the adoption adopted as dead letters (rows that are no events),
    /// which it leaves in [`ADOPTED_DEAD`](crate::store::ADOPTED_DEAD).
    pub async fn store_first(
        &mut self,
        position: &BinlogPosition,
        adoption: &[String],
    ) -> Result<u64> {
        let store = Self::write_statement(&self.config.positions);
        let params = self.write_params(Some(position));
        let mut renewer = Conn::new(opts(&self.config.url)?).await?;
        let renew_params = self.write_params(None);
        let every = self.config.lease / 3;
        let fenced = self.fenced();
        let renewing = async {
            loop {
                tokio::time::sleep(every).await;
                renewer
                    .exec_drop(store.as_str(), renew_params.clone())
                    .await?;
                if renewer.affected_rows() == 0 {
                    return Err(fenced);
                }
            }
        };
        let adopting = async {
            // A reader paused inside the adoption would keep the position's row locked, and
            // with it the standby's fencing write, for the server's `wait_timeout` (8 hours
            // by default): the server ends it after the relay's idle bound instead. The seat
            // connection then sits idle between writes again, so the bound goes with the
            // transaction.
            self.conn
                .query_drop(format!(
                    "SET SESSION wait_timeout = {}",
                    outbox_layout::sql::MYSQL_IDLE_SESSION.as_secs()
                ))
                .await?;
            self.conn
                .query_drop(format!("SET {} = 0", crate::store::ADOPTED_DEAD))
                .await?;
            // Read committed: its locking read then locks the pending rows only. At the
            // server's default (repeatable read) it locked the gaps up to the table's end as
            // well, and the application's inserts waited for the whole adoption (failing past
            // innodb_lock_wait_timeout on a large table). Rows committed meanwhile are in the
            // log after `position`; one the adoption also sees comes twice, with its id.
            let mut options = mysql_async::TxOpts::default();
            options.with_isolation_level(mysql_async::IsolationLevel::ReadCommitted);
            let mut tx = self.conn.start_transaction(options).await?;
            for statement in adoption {
                tx.query_drop(statement).await?;
            }
            let lease_from = std::time::Instant::now();
            tx.exec_drop(store.as_str(), params).await?;
            if tx.affected_rows() == 0 {
                tx.rollback().await?;
                return Ok(false);
            }
            tx.commit().await?;
            self.lease_from = lease_from;
            self.conn
                .query_drop("SET SESSION wait_timeout = @@GLOBAL.wait_timeout")
                .await?;
            Ok::<_, BinlogError>(true)
        };
        let adopted = tokio::select! {
            // An adoption that committed is done, whatever the renewer says.
            biased;
            adopted = adopting => adopted,
            failed = renewing => failed.map(|()| false),
        };
        let _ = renewer.disconnect().await;
        if !adopted? {
            return Err(self.fenced());
        }
        self.stored = Some(StoredPosition {
            position: position.clone(),
            server_id: Some(self.server_id),
        });
        let dead: Option<Option<u64>> = self
            .conn
            .query_first(format!("SELECT {}", crate::store::ADOPTED_DEAD))
            .await?;
        Ok(dead.flatten().unwrap_or(0))
    }

    /// Renews the lease without moving the position (a reader with nothing new to store
    /// still keeps its seat).
    pub async fn renew(&mut self) -> Result<()> {
        self.write(None).await
    }

    /// Gives the seat up. The lock is released first: the server releases it with the
    /// connection too, but only once it has noticed the connection is gone, and a standby
    /// trying meanwhile would find it still held.
    pub async fn leave(mut self) -> Result<()> {
        let lock = lock_name(&self.config.outbox);
        self.conn
            .exec_drop("SELECT RELEASE_LOCK(?)", (&lock,))
            .await?;
        Ok(self.conn.disconnect().await?)
    }

    /// Renews the lease, storing `position` too when given, at this reader's epoch only.
    async fn write(&mut self, position: Option<&BinlogPosition>) -> Result<()> {
        let statement = Self::write_statement(&self.config.positions);
        let params = self.write_params(position);
        self.conn.exec_drop(statement, params).await?;
        if self.conn.affected_rows() == 0 {
            return Err(self.fenced());
        }
        Ok(())
    }

    /// The lease's renewal, with the position when one is given (its columns keep their
    /// values otherwise), at the writer's epoch only.
    fn write_statement(positions: &str) -> String {
        let table = quoted(positions);
        format!(
            "UPDATE {table} SET log_file = COALESCE(?, log_file),
                    log_offset = COALESCE(?, log_offset),
                    gtid = IF(? IS NULL, gtid, ?),
                    server_id = IF(? IS NULL, server_id, @@server_id),
                    {RENEWED}
              WHERE outbox = ? AND epoch = ?"
        )
    }

    fn write_params(&self, position: Option<&BinlogPosition>) -> mysql_async::Params {
        let (file, offset) = position.map(|p| (p.file.clone(), p.offset)).unzip();
        let gtid = position.and_then(|p| p.gtid.clone());
        (
            file.clone(),
            offset,
            file.clone(),
            gtid,
            file,
            lease_millis(self.config.lease),
            self.config.outbox.clone(),
            self.epoch,
        )
            .into()
    }

    fn fenced(&self) -> BinlogError {
        BinlogError::Fenced {
            outbox: self.config.outbox.clone(),
            epoch: self.epoch,
        }
    }
}

fn lease_millis(lease: Duration) -> u64 {
    lease.as_millis().try_into().unwrap_or(u64::MAX)
}

/// A backquoted identifier, `db.table` split into its parts.
pub(crate) fn quoted(name: &str) -> String {
    name.split('.')
        .map(|part| format!("`{}`", part.replace('`', "``")))
        .collect::<Vec<_>>()
        .join(".")
}

/// One identifier (a database's or a table's name, never split at a `.`) backquoted, its
/// backquotes doubled, for a statement said to an operator: `` `out``box` ``.
pub fn quote_identifier(name: &str) -> String {
    format!("`{}`", name.replace('`', "``"))
}

/// `value` as a string literal, its quotes doubled and its backslashes escaped, as the
/// server reads it under its default `sql_mode` (not NO_BACKSLASH_ESCAPES).
pub fn quote_string(value: &str) -> String {
    format!("'{}'", value.replace('\\', "\\\\").replace('\'', "''"))
}

/// The seat lock's name ([`outbox_store_mysql::capture_lock_name`]).
fn lock_name(outbox: &str) -> String {
    outbox_store_mysql::capture_lock_name(outbox)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every statement of the seat reads and writes its lease on one clock, whatever the
    /// session's time zone (see [`RENEWED`]).
    #[test]
    fn the_lease_is_kept_on_the_servers_utc_clock() {
        for statement in [RENEWED, LAPSED, &ActiveReader::write_statement("p")] {
            assert!(!statement.contains("NOW("), "{statement}");
        }
        assert!(ActiveReader::write_statement("p").contains(RENEWED));
    }

    #[test]
    fn lock_names_fit_the_servers_limit_and_stay_apart() {
        assert_eq!(lock_name("shop.outbox"), "outbox-binlog:shop.outbox");
        let long_a = format!("shop.{}a", "x".repeat(80));
        let long_b = format!("shop.{}b", "x".repeat(80));
        assert!(lock_name(&long_a).len() <= 64);
        assert_ne!(lock_name(&long_a), lock_name(&long_b));
        let wide = format!("shop.{}", "é".repeat(60));
        assert!(lock_name(&wide).len() <= 64);
    }

    #[test]
    fn identifiers_are_quoted_part_by_part() {
        assert_eq!(quoted("shop.out`box"), "`shop`.`out``box`");
        assert_eq!(quote_identifier("sh.o`p"), "`sh.o``p`");
        assert_eq!(quote_string(r"it's a\b"), r"'it''s a\\b'");
        assert!(positions_ddl("outbox_binlog_positions")
            .starts_with("CREATE TABLE IF NOT EXISTS `outbox_binlog_positions` ("));
    }
}
