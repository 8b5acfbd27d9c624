//! Who holds the locks the relay's sessions wait for, for `/readyz` to name
//! ([`outbox_core::OutboxStore::lock_holders`]).
//!
//! Two kinds of wait, asked of the server's own tables on a connection of its own (the
//! pool's may all be the waiting ones):
//! - **Row locks** (InnoDB): an application's `SELECT … FOR UPDATE` or a transaction left
//!   open holds rows the relay's delete or update waits for. `information_schema`'s
//!   `INNODB_LOCK_WAITS` names the blocking transaction (MariaDB, MySQL 5.7; MySQL 8 moved
//!   it to `performance_schema.data_lock_waits`, which this does not read).
//! - **Metadata locks**: `LOCK TABLES`, `FLUSH TABLES WITH READ LOCK`, a backup stage or an
//!   `ALTER TABLE` in another session. The relay's sessions then show `Waiting for … lock`;
//!   MariaDB names the holder only with its `metadata_lock_info` plugin, and where it is
//!   not installed the line says how to install it.
//!
//! Sessions of other users are visible only with the `PROCESS` privilege; without it the
//! line says so.

use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Opts, Row};
use outbox_core::store::{LockHolders, StoreResult};

/// Sessions whose InnoDB transactions hold rows of the outbox's tables (`?`: the prefix
/// `` `db`.`outbox `` that `INNODB_LOCKS` names them by, covering its parked, nodes and
/// dead-letter tables) that a session of the relay's user waits for. Not every wait of the
/// user: an application sharing it waited on its own tables, and `/readyz` told the
/// operator to end the application's transaction.
const ROW_LOCK_HOLDERS: &str = "
SELECT DISTINCT b.trx_mysql_thread_id, p.USER, p.HOST, p.COMMAND, p.STATE,
       TIMESTAMPDIFF(SECOND, b.trx_started, NOW()), LEFT(COALESCE(b.trx_query, p.INFO), 200)
  FROM information_schema.INNODB_LOCK_WAITS w
  JOIN information_schema.INNODB_LOCKS l ON l.lock_id = w.requested_lock_id
  JOIN information_schema.INNODB_TRX r ON r.trx_id = w.requesting_trx_id
  JOIN information_schema.INNODB_TRX b ON b.trx_id = w.blocking_trx_id
  JOIN information_schema.PROCESSLIST waiting ON waiting.ID = r.trx_mysql_thread_id
  LEFT JOIN information_schema.PROCESSLIST p ON p.ID = b.trx_mysql_thread_id
 WHERE waiting.USER = SUBSTRING_INDEX(USER(), '@', 1)
   AND LEFT(l.lock_table, CHAR_LENGTH(?)) = ?
 ORDER BY 1";

/// How many of the relay's user's sessions wait for a metadata lock.
const METADATA_WAITS: &str = "
SELECT COUNT(*) FROM information_schema.PROCESSLIST
 WHERE USER = SUBSTRING_INDEX(USER(), '@', 1) AND ID <> CONNECTION_ID()
   AND STATE LIKE 'Waiting for % lock'";

/// Sessions, not waiting themselves, holding a metadata lock on the outbox table (its
/// database `?`, its name `?`) or a global read or backup lock: the modes every statement
/// takes (`MDL_BACKUP_DML` and the like) are left out.
const METADATA_LOCK_HOLDERS: &str = "
SELECT DISTINCT m.THREAD_ID, p.USER, p.HOST, p.COMMAND, p.STATE, p.TIME, LEFT(p.INFO, 200)
  FROM information_schema.METADATA_LOCK_INFO m
  JOIN information_schema.PROCESSLIST p ON p.ID = m.THREAD_ID
 WHERE m.THREAD_ID <> CONNECTION_ID()
   AND COALESCE(p.STATE, '') NOT LIKE 'Waiting for %'
   AND ((m.LOCK_TYPE = 'Table metadata lock'
         AND m.TABLE_SCHEMA = COALESCE(?, DATABASE()) AND m.TABLE_NAME = ?)
        OR m.LOCK_MODE LIKE 'MDL_BACKUP_FTWRL%'
        OR m.LOCK_MODE IN ('MDL_BACKUP_START', 'MDL_BACKUP_FLUSH', 'MDL_BACKUP_WAIT_FLUSH',
                           'MDL_BACKUP_WAIT_DDL', 'MDL_BACKUP_WAIT_COMMIT',
                           'MDL_BACKUP_BLOCK_DDL'))
 ORDER BY 1";

/// The server's "access denied; you need the PROCESS privilege".
const NEEDS_PROCESS: u16 = 1227;
/// "Unknown table … in information_schema": the plugin's table is not there.
const UNKNOWN_TABLE: u16 = 1109;

/// What the relay's sessions wait for, and who holds it; see the module docs.
pub(crate) async fn lock_holders(
    opts: Opts,
    within: Duration,
    schema: Option<String>,
    table: String,
) -> StoreResult<LockHolders> {
    let context = "lock holders";
    let sessions = crate::bounded(within, context, async {
        let mut conn = Conn::new(opts)
            .await
            .map_err(|e| crate::db_error(context, e))?;
        let found = holders(&mut conn, schema, table).await;
        conn.disconnect().await.ok();
        found.map_err(|e| crate::db_error(context, e))
    })
    .await?;
    Ok(LockHolders {
        sessions,
        end_one: "KILL <id>",
    })
}

async fn holders(
    conn: &mut Conn,
    schema: Option<String>,
    table: String,
) -> Result<Vec<String>, mysql_async::Error> {
    let mut said = Vec::new();
    let database: Option<String> = match &schema {
        Some(schema) => Some(schema.clone()),
        None => conn.query_first("SELECT DATABASE()").await?,
    };
    let tables = format!(
        "`{}`.`{}",
        database.unwrap_or_default().replace('`', "``"),
        table.replace('`', "``")
    );
    match conn
        .exec::<Row, _, _>(ROW_LOCK_HOLDERS, (&tables, &tables))
        .await
    {
        Ok(rows) => said.extend(rows.iter().map(|row| session_line(row, "in a transaction"))),
        Err(e) if server_code(&e) == Some(NEEDS_PROCESS) => {
            said.push(PROCESS_HIDDEN.to_string());
            return Ok(said);
        }
        Err(e) => return Err(e),
    }
    let waiting: Option<i64> = conn.query_first(METADATA_WAITS).await?;
    if waiting.unwrap_or(0) == 0 {
        return Ok(said);
    }
    match conn
        .exec::<Row, _, _>(METADATA_LOCK_HOLDERS, (schema, table))
        .await
    {
        Ok(rows) => said.extend(rows.iter().map(|row| session_line(row, "in its state"))),
        Err(e) if server_code(&e) == Some(UNKNOWN_TABLE) => said.push(UNNAMED_METADATA.into()),
        Err(e) if server_code(&e) == Some(NEEDS_PROCESS) => said.push(PROCESS_HIDDEN.into()),
        Err(e) => return Err(e),
    }
    Ok(said)
}

const PROCESS_HIDDEN: &str = "sessions the relay's role cannot see (grant it PROCESS to have \
                              them named: GRANT PROCESS ON *.* TO <role>)";

const UNNAMED_METADATA: &str = "a session holding a metadata lock on the outbox (LOCK \
     TABLES, FLUSH TABLES WITH READ LOCK, a backup stage or an ALTER TABLE), which MariaDB \
     names only with its metadata_lock_info plugin (INSTALL SONAME 'metadata_lock_info'; \
     MySQL lists it in performance_schema.metadata_locks)";

fn server_code(error: &mysql_async::Error) -> Option<u16> {
    match error {
        mysql_async::Error::Server(e) => Some(e.code),
        _ => None,
    }
}

/// `connection 12 (user app@10.0.0.5, Sleep, in a transaction for 40s, last statement "…")`:
/// columns id, user, host, command, state, seconds, statement.
fn session_line(row: &Row, seconds_are: &str) -> String {
    let text = |i: usize| crate::text(crate::col(row, i));
    let id = text(0).unwrap_or_else(|| "?".into());
    let user = match (text(1), text(2)) {
        (Some(user), Some(host)) => format!("{user}@{host}"),
        (user, _) => user.unwrap_or_else(|| "?".into()),
    };
    let mut said = format!("connection {id} (user {user}");
    for part in [text(3), text(4)].into_iter().flatten() {
        if !part.is_empty() {
            said.push_str(&format!(", {part}"));
        }
    }
    if let Some(seconds) = text(5) {
        said.push_str(&format!(", {seconds_are} for {seconds}s"));
    }
    if let Some(statement) = text(6).filter(|s| !s.is_empty()) {
        said.push_str(&format!(", last statement {statement:?}"));
    }
    said.push(')');
    said
}
