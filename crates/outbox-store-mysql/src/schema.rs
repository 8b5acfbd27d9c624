//! The versioned schema on MySQL/MariaDB ([`outbox_core::migration`]): the layout's steps,
//! the version table `<table>_versions`, and `migrate`'s runner.

use mysql_async::prelude::Queryable;
use mysql_async::Conn;
use outbox_core::migration::{Found, Lock, Run, Step, Steps};
use outbox_core::store::StoreResult;
use outbox_core::{StoreError, StoreErrorKind};
use outbox_layout::sql::Sql;
use outbox_layout::store::MappedDb;

use crate::{db_error, MySql};

impl MySql {
    /// The layout's steps, or `None` for a custom mapping (the application owns its
    /// table). Add a step at the end for every change (never edit one that has shipped:
    /// databases have recorded it), and keep `crates/outbox-relay/tests/fixtures/` current.
    pub fn steps(&self, sql: &Sql) -> Option<Steps> {
        let ddl = self.ddl(sql)?;
        let mut steps = vec![Step {
            version: 1,
            summary: "the layout's tables (and the nodes table), where missing; existing \
                      tables are not touched",
            statements: vec![ddl],
            lock: Lock::Online,
            // MySQL commits DDL as it goes: a transaction would not hold it.
            run: Run::Alone,
            older_relays_run: false,
        }];
        if sql.mapping.seed == Some(outbox_layout::Seed::NativeMysql) {
            steps.push(Step {
                version: 2,
                summary: "created_at and available_at default to UTC, whatever the inserting \
                          session's time zone: the relay compares them with UTC, and a default \
                          in local time held each event back by the zone's offset",
                statements: vec![utc_defaults(sql), rows_ahead_of_utc_due_now(sql)],
                lock: Lock::Online,
                run: Run::Alone,
                older_relays_run: true,
            });
            steps.push(Step {
                version: 3,
                summary: "the pending index carries available_at and locked_until, so a claim \
                          passes rows scheduled for later (or waiting out a retry, or leased) \
                          in the index alone: it read each one's row, 350 ms a claim over \
                          300,000 scheduled rows",
                statements: vec![pending_index_covers_the_claim(sql)],
                lock: Lock::Online,
                run: Run::Alone,
                older_relays_run: true,
            });
        }
        Some(Steps::new("outbox", steps))
    }

    /// `<table>_versions`, quoted, in the table's schema.
    pub fn versions_table(sql: &Sql) -> String {
        sql.qualified(&format!("{}_versions", sql.mapping.table))
    }

    fn version_table_ddl(sql: &Sql) -> String {
        format!(
            "-- The schema's version per component, advanced after each step (see README, Upgrading).
CREATE TABLE IF NOT EXISTS {} (
    component     varchar(32) PRIMARY KEY,
    version       integer NOT NULL,
    readable_from integer NOT NULL,
    migrated_at   datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
) ENGINE=InnoDB;
",
            Self::versions_table(sql)
        )
    }

    fn record_version(sql: &Sql, component: &str, version: u32, readable_from: u32) -> String {
        format!(
            "INSERT INTO {} (component, version, readable_from) VALUES ('{component}', {version}, {readable_from})
    ON DUPLICATE KEY UPDATE version = VALUES(version), readable_from = VALUES(readable_from),
        migrated_at = CURRENT_TIMESTAMP(6);
",
            Self::versions_table(sql)
        )
    }

    /// The steps `found` lacks, as `migrate --print` shows them; every step when the
    /// database could not be asked (`None`).
    pub fn printable_steps(sql: &Sql, steps: &Steps, found: Option<Found>) -> String {
        steps.printable_missing(found, &Self::version_table_ddl(sql), |step| {
            step.printable(steps.component)
                + &Self::record_version(
                    sql,
                    steps.component,
                    step.version,
                    steps.readable_from(step.version),
                )
        })
    }

    /// What the database holds of the layout's schema.
    pub async fn schema_found(&self, sql: &Sql) -> StoreResult<Found> {
        let mut conn = self.conn("reading the schema version").await?;
        read_found(&mut conn, sql).await
    }

    /// Applies the steps the database lacks, each recorded after it, under `lock`.
    pub(crate) async fn apply_steps(&self, sql: &Sql, steps: &Steps) -> StoreResult<()> {
        let mut conn = self.conn("migrate").await?;
        let got: Option<Option<i64>> = conn
            .query_first("SELECT GET_LOCK('outbox-relay migrate', 600)")
            .await
            .map_err(|e| db_error("migrate", e))?;
        if got.flatten() != Some(1) {
            return Err(StoreError::new(
                StoreErrorKind::Conflict,
                "migrate: another `outbox-relay migrate` held the migrate lock for 10 minutes; run it again when that one ends",
            ));
        }
        let result = async {
            conn.query_drop(Self::version_table_ddl(sql))
                .await
                .map_err(|e| db_error("migrate", e))?;
            let found = read_found(&mut conn, sql).await?;
            for step in steps.after(found.version()) {
                for s in &step.statements {
                    conn.query_drop(s).await.map_err(|e| {
                        let error = db_error(
                            &format!(
                                "migrate: step {} (the steps before it are recorded; `migrate` again resumes here)",
                                step.version
                            ),
                            e,
                        );
                        match error.kind() {
                            StoreErrorKind::Conflict => error
                                .with_hint(outbox_core::migration::STEP_LOCK_HINT),
                            _ => error,
                        }
                    })?;
                }
                let record = Self::record_version(
                    sql,
                    steps.component,
                    step.version,
                    steps.readable_from(step.version),
                );
                conn.query_drop(record)
                    .await
                    .map_err(|e| db_error("migrate", e))?;
            }
            Ok(())
        }
        .await;
        let _ = conn
            .query_drop("SELECT RELEASE_LOCK('outbox-relay migrate')")
            .await;
        result
    }
}

/// The recorded version, or whether the layout's table exists without one.
async fn read_found(conn: &mut Conn, sql: &Sql) -> StoreResult<Found> {
    let schema = sql.mapping.schema.clone();
    let exists = "SELECT COUNT(*) FROM information_schema.tables \
                  WHERE table_schema = COALESCE(?, DATABASE()) AND table_name = ?";
    let context = "reading the schema version";
    // Read directly: `information_schema` lists only the tables a role has a privilege on,
    // so a role without one on the versions table was told the schema had no version, to
    // run `migrate` again, for good.
    const ER_NO_SUCH_TABLE: u16 = 1146;
    const ER_TABLEACCESS_DENIED: u16 = 1142;
    let versions = MySql::versions_table(sql);
    let row: Result<Option<(i64, i64)>, _> = conn
        .exec_first(
            format!("SELECT version, readable_from FROM {versions} WHERE component = ?"),
            ("outbox",),
        )
        .await;
    match row {
        Ok(Some((version, readable_from))) => {
            return Found::recorded(version, readable_from, || {
                format!("{versions} holds a negative version")
            })
        }
        Ok(None) => {}
        Err(mysql_async::Error::Server(e)) if e.code == ER_NO_SUCH_TABLE => {}
        Err(mysql_async::Error::Server(e)) if e.code == ER_TABLEACCESS_DENIED => {
            return Err(StoreError::new(
                StoreErrorKind::Privilege,
                format!(
                    "{context}: the relay's role cannot read {versions} ({}): grant it \
                     SELECT ON {versions} (`outbox-relay migrate --print` lists every grant \
                     it needs)",
                    e.message
                ),
            ))
        }
        Err(e) => return Err(db_error(context, e)),
    }
    let has_table: Option<i64> = conn
        .exec_first(exists, (schema, sql.mapping.table.clone()))
        .await
        .map_err(|e| db_error(context, e))?;
    Ok(if has_table.unwrap_or(0) > 0 {
        Found::Unversioned
    } else {
        Found::Nothing
    })
}

/// Sets `column`'s default to the UTC time, where the table has that column (binlog
/// capture's BLACKHOLE table has no `available_at`).
/// Both defaults in one ALTER. One ALTER each left a moment (or, when the second waited
/// out its lock, until `migrate` ran again) in which an insert from a session east of UTC
/// took `created_at` in UTC and `available_at` in local time: held back by the zone's
/// offset, behind rows of its key written after it, and missed by the repair below, which
/// knows such rows by their two defaults being equal.
fn utc_defaults(sql: &Sql) -> String {
    let columns = ["created_at", "available_at"];
    let alter = format!(
        "ALTER TABLE {} {}",
        sql.table(),
        columns
            .map(|column| format!("ALTER COLUMN `{column}` SET DEFAULT (UTC_TIMESTAMP(6))"))
            .join(", ")
    );
    // The ALTER waits for the table's metadata lock, and the application's inserts queue
    // behind it: at most 5 s (MySQL's default is a year), then the step fails, to run again.
    format!(
        "SET SESSION lock_wait_timeout = 5;\n{}",
        where_columns(sql, &columns, &alter)
    )
}

/// Rows written before the UTC defaults by a session east of UTC took its local time: due
/// hours from now, behind rows of their keys written since (which take UTC). Rows that took
/// both defaults (`available_at = created_at`), never tried, are due now. Run after the
/// defaults change, so no row written in between keeps a local time.
fn rows_ahead_of_utc_due_now(sql: &Sql) -> String {
    let update = format!(
        "UPDATE {} SET available_at = UTC_TIMESTAMP(6)
  WHERE delivered_at IS NULL AND dead_at IS NULL AND attempts = 0
    AND available_at = created_at AND available_at > UTC_TIMESTAMP(6)",
        sql.table()
    );
    let columns = [
        "available_at",
        "created_at",
        "delivered_at",
        "dead_at",
        "attempts",
    ];
    format!(
        "SET SESSION innodb_lock_wait_timeout = 5;\n{}",
        where_columns(sql, &columns, &update)
    )
}

/// The native table's pending index remade with the claim's other conditions after its
/// order (`ALGORITHM=INPLACE, LOCK=NONE`: writers go on while InnoDB builds it), unless it
/// has them already, or the table lacks the columns (the BLACKHOLE form). The DDL waits at
/// most 5 s for the table's metadata lock, then the step fails, to run again.
fn pending_index_covers_the_claim(sql: &Sql) -> String {
    let schema = catalog_schema(sql);
    let table = sql.table();
    let index = format!("{}_pending", sql.mapping.table);
    let quoted_index = format!("`{}`", index.replace('`', "``"));
    let columns = outbox_layout::sql::MYSQL_PENDING_INDEX_COLUMNS;
    let add = format!("ADD INDEX {quoted_index} ({columns}), ALGORITHM=INPLACE, LOCK=NONE");
    let remake = format!("ALTER TABLE {table} DROP INDEX {quoted_index}, {add}");
    let make = format!("ALTER TABLE {table} {add}");
    let statistics = format!(
        "FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = {schema} AND TABLE_NAME = {} \
         AND INDEX_NAME = {}",
        literal(&sql.mapping.table),
        literal(&index)
    );
    // A table without the columns (the BLACKHOLE form keeps no state) has no such index.
    let names: Vec<String> = columns.split(", ").map(literal).collect();
    let has_columns = format!(
        "(SELECT COUNT(*) FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = {schema} \
         AND TABLE_NAME = {} AND COLUMN_NAME IN ({})) = {}",
        literal(&sql.mapping.table),
        names.join(", "),
        names.len()
    );
    format!(
        "SET SESSION lock_wait_timeout = 5;
SET @outbox_relay_step = (SELECT CASE
    WHEN NOT {has_columns} THEN 'DO 0'
    WHEN (SELECT COUNT(*) {statistics} AND COLUMN_NAME = 'available_at') > 0 THEN 'DO 0'
    WHEN (SELECT COUNT(*) {statistics}) > 0 THEN {}
    ELSE {} END);
PREPARE outbox_relay_step FROM @outbox_relay_step;
EXECUTE outbox_relay_step;
DEALLOCATE PREPARE outbox_relay_step;
",
        literal(&remake),
        literal(&make)
    )
}

/// A string literal of MySQL's SQL.
fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\\', "\\\\").replace('\'', "''"))
}

/// The table's schema as the catalog's `TABLE_SCHEMA` is compared with: the mapping's, or
/// the connection's database.
fn catalog_schema(sql: &Sql) -> String {
    sql.mapping
        .schema
        .as_deref()
        .map_or_else(|| "DATABASE()".to_string(), literal)
}

/// Runs `statement` only if the table has every one of `columns`: MySQL has no `IF` outside
/// a routine, so the statement is prepared from a query of the catalog.
fn where_columns(sql: &Sql, columns: &[&str], statement: &str) -> String {
    let schema = catalog_schema(sql);
    let names: Vec<String> = columns.iter().map(|c| literal(c)).collect();
    format!(
        "SET @outbox_relay_step = (SELECT IF(COUNT(*) = {}, {}, 'DO 0')
    FROM information_schema.COLUMNS
   WHERE TABLE_SCHEMA = {schema} AND TABLE_NAME = {} AND COLUMN_NAME IN ({}));
PREPARE outbox_relay_step FROM @outbox_relay_step;
EXECUTE outbox_relay_step;
DEALLOCATE PREPARE outbox_relay_step;
",
        columns.len(),
        literal(statement),
        literal(&sql.mapping.table),
        names.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One ALTER each left a moment, or until `migrate` ran again after the second waited
    /// out its lock, in which an insert east of UTC took one default in UTC and the other
    /// in local time: held back by the offset, and missed by the repair.
    #[test]
    fn step_2_changes_both_defaults_in_one_alter() {
        let mapping = outbox_layout::Mapping::native_mysql(None, "outbox", false);
        let sql = Sql::new(mapping, outbox_layout::Dialect::MySql).unwrap();
        let statement = utc_defaults(&sql);
        assert_eq!(statement.matches("ALTER TABLE").count(), 1, "{statement}");
        for column in ["created_at", "available_at"] {
            assert!(
                statement.contains(&format!(
                    "ALTER COLUMN `{column}` SET DEFAULT (UTC_TIMESTAMP(6))"
                )),
                "{statement}"
            );
        }
    }
}
