//! The table-less form: a table with the BLACKHOLE engine stores nothing, yet every row
//! inserted into it is written to the binary log, where binlog capture reads it. The outbox
//! then never grows and never needs deleting from. Not every server has the engine: MariaDB
//! ships it as a plugin (`INSTALL SONAME 'ha_blackhole'`), MySQL 8 builds it in, and managed
//! services often turn it off.

use mysql_async::prelude::Queryable;
use mysql_async::Conn;
use outbox_core::store::Problem;
use outbox_layout::sql::MYSQL_EVENT_COLUMNS;

use crate::{opts, Result};

/// The table-less form's last column, after an event's own ([`MYSQL_EVENT_COLUMNS`]).
const CREATED_AT: &str = "created_at    datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)";

/// The BLACKHOLE outbox table `table`: an event's columns only (nothing is stored to lease,
/// retry or mark). Its rows are read back from the binary log alone.
pub fn blackhole_ddl(table: &str) -> String {
    let table = table.replace('`', "``");
    format!(
        "CREATE TABLE IF NOT EXISTS `{table}` (
    {MYSQL_EVENT_COLUMNS}
    {CREATED_AT}
) ENGINE=BLACKHOLE DEFAULT CHARSET=utf8mb4;
"
    )
}

/// The names of the columns [`blackhole_ddl`] declares.
pub(crate) fn blackhole_columns() -> impl Iterator<Item = &'static str> {
    MYSQL_EVENT_COLUMNS
        .lines()
        .chain([CREATED_AT])
        .filter_map(|line| line.split_whitespace().next())
}

/// What the BLACKHOLE outbox `database.table` lacks of the table-less form's columns, each
/// with its fix (the polling store's checks ask for the native table's, which a table that
/// stores nothing has no use for).
pub async fn blackhole_table_problems(
    url: &str,
    database: &str,
    table: &str,
) -> Result<Vec<Problem>> {
    let mut conn = Conn::new(opts(url)?).await?;
    let present: Vec<String> = conn
        .exec(
            "SELECT COLUMN_NAME FROM information_schema.COLUMNS
             WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ?",
            (database, table),
        )
        .await?;
    conn.disconnect().await?;
    Ok(blackhole_columns()
        .filter(|column| !present.iter().any(|p| p.eq_ignore_ascii_case(column)))
        .map(|column| {
            Problem::blocking(
                format!(
                    "the BLACKHOLE table {database}.{table} has no column {column}, which the \
                     table-less form's rows carry"
                ),
                "create the table with the table-less form's columns (README, \"The table-less \
                 form\"; `outbox-relay migrate --capture binlog --print` shows them)",
            )
        })
        .collect())
}

/// The parked table `database.table` when it stores nothing (a BLACKHOLE table, as one made
/// `LIKE` a BLACKHOLE outbox was): every retry and dead letter parked there would be lost.
pub async fn parked_table_problem(
    url: &str,
    database: &str,
    table: &str,
) -> Result<Option<Problem>> {
    Ok(is_blackhole(url, database, table).await?.then(|| {
        Problem::blocking(
            format!(
                "the parked table {database}.{table} is a BLACKHOLE table: the retries and dead \
                 letters parked there would be lost"
            ),
            format!(
                "with no relay running, `DROP TABLE {database}.{table}` (it holds nothing) and run \
                 `outbox-relay migrate --capture binlog`, which creates it as InnoDB"
            ),
        )
    }))
}

/// Why the server cannot take the BLACKHOLE form, with what to do; `None` when it can.
pub async fn blackhole_problem(url: &str) -> Result<Option<Problem>> {
    let mut conn = Conn::new(opts(url)?).await?;
    let support: Option<String> = conn
        .query_first("SELECT SUPPORT FROM information_schema.ENGINES WHERE ENGINE = 'BLACKHOLE'")
        .await?;
    conn.disconnect().await?;
    Ok(match support.as_deref() {
        Some("YES" | "DEFAULT") => None,
        other => Some(Problem::blocking(
            format!(
                "the server has no BLACKHOLE engine ({}), so the table-less form cannot be used",
                other.map_or("not installed".to_string(), |s| format!("support: {s}"))
            ),
            "use the outbox table itself, or install the engine (MariaDB: INSTALL SONAME \
             'ha_blackhole'; managed services may not allow it)",
        )),
    })
}

/// Whether `database.table` is a BLACKHOLE table (the table-less form); an error when there
/// is no such table.
pub async fn is_blackhole(url: &str, database: &str, table: &str) -> Result<bool> {
    let mut conn = Conn::new(opts(url)?).await?;
    let engine: Option<Option<String>> = conn
        .exec_first(
            "SELECT ENGINE FROM information_schema.TABLES WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ?",
            (database, table),
        )
        .await?;
    conn.disconnect().await?;
    match engine {
        Some(engine) => Ok(engine.is_some_and(|e| e.eq_ignore_ascii_case("BLACKHOLE"))),
        None => Err(crate::BinlogError::Config(format!(
            "table {database}.{table} does not exist: run `outbox-relay migrate --capture binlog`"
        ))),
    }
}
