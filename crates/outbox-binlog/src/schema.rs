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

/// The BLACKHOLE outbox table `table`: an event's columns only (nothing is stored to lease,
/// retry or mark). Its rows are read back from the binary log alone.
pub fn blackhole_ddl(table: &str) -> String {
    let table = table.replace('`', "``");
    format!(
        "CREATE TABLE IF NOT EXISTS `{table}` (
    {MYSQL_EVENT_COLUMNS}
    created_at    datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
) ENGINE=BLACKHOLE DEFAULT CHARSET=utf8mb4;
"
    )
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
