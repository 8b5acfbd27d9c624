//! The parked table (`<outbox>_parked`): the native layout's columns, whose rows the MySQL
//! store claims, retries and dead-letters, and an index of the keys waiting in it.
//!
//! After parked rows are settled, capture asks which of their keys still have rows waiting
//! there ([`still_parked`]). Keys compare byte for byte (under the table's collation `a`, `A`
//! and `a ` are one value), and no index serves `CAST(COALESCE(partition_key, destination)
//! AS BINARY)`: every settle read the whole table, and a backlog adopted at the first start
//! drained in quadratic time. So each row carries its key's CRC32 in a virtual column
//! ([`KEY_HASH_COLUMN`], MariaDB has no functional indexes), indexed with the row's state
//! ([`keys_index_name`]): a key costs one index probe, which stops at its first waiting row,
//! the key itself compared byte for byte (colliding keys are told apart).
//!
//! Binlog capture's tables are no versioned schema steps: `migrate` applies
//! [`parked_ddl`] on every run, and [`upgrade_parked`] adds the column and the index to a
//! table made before them. A relay on such a table still runs (the old statement, a scan per
//! settle), says so once, and `check` reports it ([`parked_index_problem`]).

use std::collections::HashSet;

use mysql_async::prelude::Queryable;
use mysql_async::Conn;
use outbox_core::store::Problem;

use crate::seat::{quote_identifier, quoted};
use crate::{opts, Result};

/// The parked table's column of each row's key hash.
pub const KEY_HASH_COLUMN: &str = "key_hash";

/// [`KEY_HASH_COLUMN`]'s definition: CRC32 of the key's bytes (32 bits: a collision costs a
/// row read, never a wrong answer). Virtual: kept in the index only, and added to a table
/// without rebuilding it.
const KEY_HASH: &str = "key_hash      int unsigned AS \
     (CRC32(CAST(COALESCE(partition_key, destination) AS BINARY))) VIRTUAL";

/// The ordering key of a parked row, its bytes.
const KEY_BYTES: &str = "CAST(COALESCE(partition_key, destination) AS BINARY)";

/// The index of the keys waiting in the parked table `table`: by key hash, then the row's
/// state, so a key's waiting rows are one equality on all three columns (MySQL has no
/// partial index).
pub fn keys_index_name(table: &str) -> String {
    format!("{table}_keys")
}

fn keys_index(table: &str) -> String {
    format!(
        "KEY {} ({KEY_HASH_COLUMN}, delivered_at, dead_at)",
        quote_identifier(&keys_index_name(table))
    )
}

/// The parked table `database.table`: the native layout's columns and indexes, InnoDB (never
/// `LIKE` the outbox, which in the table-less form is a BLACKHOLE table that would store no
/// parked row), with the key hash and its index; idempotent.
pub fn parked_ddl(database: &str, table: &str) -> String {
    let native = outbox_layout::Mapping::native_mysql(Some(database), table, false);
    outbox_layout::sql::native_mysql_ddl(&native).replacen(
        "\n) ENGINE=",
        &format!(",\n    {KEY_HASH},\n    {}\n) ENGINE=", keys_index(table)),
        1,
    )
}

/// `db.table` or `table` as its database (`None`: the connection's) and table.
fn split(qualified: &str) -> (Option<&str>, &str) {
    match qualified.split_once('.') {
        Some((database, table)) => (Some(database), table),
        None => (None, qualified),
    }
}

/// Whether the parked table `parked` (`db.table` or `table`) has an index led by
/// [`KEY_HASH_COLUMN`] (under any name).
pub async fn keys_indexed(conn: &mut Conn, parked: &str) -> Result<bool> {
    let (database, table) = split(parked);
    let n: Option<i64> = conn
        .exec_first(
            "SELECT count(*) FROM information_schema.STATISTICS
              WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME = ?
                AND SEQ_IN_INDEX = 1 AND COLUMN_NAME = ?",
            (database, table, KEY_HASH_COLUMN),
        )
        .await?;
    Ok(n.unwrap_or(0) > 0)
}

/// Adds the key hash and its index to the parked table `database.table` made before them
/// (`migrate` runs it after [`parked_ddl`]; idempotent). MySQL 8 has neither `ADD COLUMN IF
/// NOT EXISTS` nor `CREATE INDEX IF NOT EXISTS`, so the table's columns and indexes are
/// read; the column and the index are two statements, each online (a virtual column is
/// added without copying the table, and the index is built while rows are written).
///
/// A BLACKHOLE parked table (made `LIKE` a BLACKHOLE outbox by an earlier version) takes no
/// generated column: it is left as it is, and `check` says to make it again
/// ([`crate::parked_table_problem`]).
pub async fn upgrade_parked(url: &str, database: &str, table: &str) -> Result<()> {
    if crate::is_blackhole(url, database, table).await? {
        return Ok(());
    }
    let mut conn = Conn::new(opts(url)?).await?;
    let qualified = format!("{}.{}", quote_identifier(database), quote_identifier(table));
    let has_column: Option<i64> = conn
        .exec_first(
            "SELECT count(*) FROM information_schema.COLUMNS
              WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ? AND COLUMN_NAME = ?",
            (database, table, KEY_HASH_COLUMN),
        )
        .await?;
    conn.query_drop(format!(
        "SET SESSION lock_wait_timeout = {ALTER_LOCK_WAIT_SECONDS}"
    ))
    .await?;
    if has_column == Some(0) {
        alter_once(
            &mut conn,
            format!("ALTER TABLE {qualified} ADD COLUMN {KEY_HASH}"),
        )
        .await?;
    }
    if !keys_indexed(&mut conn, &format!("{database}.{table}")).await? {
        alter_once(
            &mut conn,
            format!("ALTER TABLE {qualified} ADD {}", keys_index(table)),
        )
        .await?;
    }
    conn.disconnect().await?;
    Ok(())
}

/// How long an upgrade's ALTER waits for the table's metadata lock (MySQL's default is a
/// year, MariaDB's a day): behind a `mysqldump --single-transaction` every write of the
/// capture to the table queued behind it. It fails then: `migrate` again once it ends.
pub(crate) const ALTER_LOCK_WAIT_SECONDS: u32 = 5;

/// Runs an upgrade's `ALTER` that adds a column or an index; one that another relay's
/// upgrade added meanwhile (two nodes starting with `--auto-migrate`) is done, not an error.
pub(crate) async fn alter_once(conn: &mut Conn, alter: String) -> Result<()> {
    const ER_DUP_FIELDNAME: u16 = 1060;
    const ER_DUP_KEYNAME: u16 = 1061;
    match conn.query_drop(alter).await {
        Err(mysql_async::Error::Server(e))
            if e.code == ER_DUP_FIELDNAME || e.code == ER_DUP_KEYNAME =>
        {
            Ok(())
        }
        other => Ok(other?),
    }
}

/// The parked table `database.table` without the index of its waiting keys (made before
/// it, and not migrated since): the relay runs, slower. Nothing for a table that does not
/// exist or is a BLACKHOLE table ([`crate::parked_table_problem`] says what to do then).
pub async fn parked_index_problem(
    url: &str,
    database: &str,
    table: &str,
) -> Result<Option<Problem>> {
    let mut conn = Conn::new(opts(url)?).await?;
    let engine: Option<Option<String>> = conn
        .exec_first(
            "SELECT ENGINE FROM information_schema.TABLES
              WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ?",
            (database, table),
        )
        .await?;
    let indexed = keys_indexed(&mut conn, &format!("{database}.{table}")).await?;
    conn.disconnect().await?;
    // No table, or a BLACKHOLE one: other problems say so, with their fixes.
    let innodb_like = matches!(&engine, Some(e) if !e.as_deref().is_some_and(|e| e.eq_ignore_ascii_case("BLACKHOLE")));
    Ok((innodb_like && !indexed).then(|| {
        Problem::degraded(
            format!(
                "the parked table {database}.{table} has no index of its waiting keys ({}): \
                 every settle of parked rows reads the whole table to learn which keys flow \
                 again, and a large adopted backlog drains in quadratic time",
                keys_index_name(table)
            ),
            "run `outbox-relay migrate --capture binlog` (it adds the virtual column \
             key_hash and its index, online), then restart the relay",
        )
    }))
}

/// The keys one statement of [`still_parked`] probes at most: a statement per count up to
/// it, the keys padded to a power of two (prepared once each, and reused).
const PROBES: usize = 64;

/// Which of `keys` have rows waiting (undelivered, not dead) in the parked table `parked`
/// (`db.table` or `table`), byte for byte. With the index (`indexed`, [`keys_indexed`]),
/// one probe per key, which stops at its first row; without it, one statement over the
/// whole table.
pub async fn still_parked(
    conn: &mut Conn,
    parked: &str,
    indexed: bool,
    keys: &[String],
) -> std::result::Result<HashSet<String>, mysql_async::Error> {
    let parked = quoted(parked);
    let mut still = HashSet::new();
    if keys.is_empty() {
        return Ok(still);
    }
    if !indexed {
        let found: Vec<String> = conn.exec(scan(&parked, keys.len()), keys.to_vec()).await?;
        still.extend(found);
        return Ok(still);
    }
    for chunk in keys.chunks(PROBES) {
        let probes = chunk.len().next_power_of_two();
        let params: Vec<&String> = (0..probes)
            .map(|i| &chunk[i.min(chunk.len() - 1)])
            .flat_map(|key| [key, key])
            .collect();
        let found: Vec<String> = conn.exec(probes_sql(&parked, probes), params).await?;
        still.extend(found);
    }
    Ok(still)
}

/// `keys` probes of the index of waiting keys (the quoted table `parked`), each binding its
/// key twice: by hash, then the key's bytes, `LIMIT 1`. A `UNION ALL` of single-row probes
/// rather than one `IN` list, which would read every waiting row of each key (an adopted
/// key can have thousands).
fn probes_sql(parked: &str, keys: usize) -> String {
    let probe = format!(
        "(SELECT {KEY_BYTES} FROM {parked}
           WHERE {KEY_HASH_COLUMN} = CRC32(CAST(? AS BINARY))
             AND delivered_at IS NULL AND dead_at IS NULL
             AND {KEY_BYTES} = CAST(? AS BINARY) LIMIT 1)"
    );
    vec![probe; keys.max(1)].join("\nUNION ALL ")
}

/// [`still_parked`] on a table without the index: one statement, which reads every row.
fn scan(parked: &str, keys: usize) -> String {
    format!(
        "SELECT DISTINCT {KEY_BYTES} FROM {parked}
          WHERE delivered_at IS NULL AND dead_at IS NULL AND {KEY_BYTES} IN ({})",
        vec!["?"; keys.max(1)].join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parked_tables_ddl_has_the_native_columns_the_key_hash_and_its_index() {
        let ddl = parked_ddl("db", "outbox_parked");
        assert!(
            ddl.starts_with("CREATE TABLE IF NOT EXISTS `db`.`outbox_parked` ("),
            "{ddl}"
        );
        assert!(ddl.contains("KEY `outbox_parked_pending`"), "{ddl}");
        assert!(
            ddl.contains(
                "key_hash      int unsigned AS (CRC32(CAST(COALESCE(partition_key, destination) AS BINARY))) VIRTUAL,\n    \
                 KEY `outbox_parked_keys` (key_hash, delivered_at, dead_at)\n) ENGINE=InnoDB"
            ),
            "{ddl}"
        );
    }

    #[test]
    fn each_key_is_one_probe_that_stops_at_its_first_row() {
        let sql = probes_sql("`db`.`p`", 2);
        assert_eq!(sql.matches('?').count(), 4);
        assert_eq!(sql.matches("LIMIT 1)").count(), 2);
        assert_eq!(sql.matches("UNION ALL").count(), 1);
        assert!(sql.contains("key_hash = CRC32(CAST(? AS BINARY))"), "{sql}");
    }
}
