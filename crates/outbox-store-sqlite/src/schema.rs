//! The versioned schema on SQLite ([`outbox_core::migration`]): the steps, the version
//! table `outbox_versions`, and `migrate`'s runner.

use outbox_core::migration::{Found, Lock, Run, Step, Steps};
use outbox_core::store::StoreResult;
use outbox_core::{StoreError, StoreErrorKind};
use rusqlite::{Connection, OptionalExtension};

use crate::{sql_error, DDL};

const VERSION_TABLE_DDL: &str = "-- The schema's version per component, advanced after each step (see README, Upgrading).
CREATE TABLE IF NOT EXISTS outbox_versions (
    component     TEXT PRIMARY KEY,
    version       INTEGER NOT NULL,
    readable_from INTEGER NOT NULL,
    migrated_at   INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER))
);
";

/// SQLite's steps. Add a step at the end for every change (never edit one that has
/// shipped: databases have recorded it), and keep `crates/outbox-relay/tests/fixtures/`
/// current.
pub fn steps() -> Steps {
    Steps::new(
        "outbox",
        vec![Step {
            version: 1,
            summary: "the outbox, dead-letter and nodes tables and their indexes, where missing",
            statements: vec![DDL.trim().to_string()],
            // SQLite has one writer: a step holds the write lock for its whole transaction
            // (milliseconds on tables that exist, as this one creates only what is missing).
            lock: Lock::Locks(
                "holds SQLite's write lock for its transaction (creating what is missing: \
                 milliseconds; building the indexes of an existing table without them, about \
                 a second per million rows, while writes wait)",
            ),
            run: Run::InTransaction,
            older_relays_run: false,
        }],
    )
}

fn record_version(component: &str, version: u32, readable_from: u32) -> String {
    format!(
        "INSERT INTO outbox_versions (component, version, readable_from) VALUES ('{component}', {version}, {readable_from})
    ON CONFLICT (component) DO UPDATE SET version = excluded.version,
        readable_from = excluded.readable_from,
        migrated_at = CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER);
"
    )
}

/// The steps `found` lacks, as `migrate --print` shows them (all of them for `None`).
pub fn printable_steps(found: Option<Found>) -> String {
    let steps = steps();
    steps.printable_missing(found, VERSION_TABLE_DDL, |step| {
        step.printable(steps.component)
            + &record_version(
                steps.component,
                step.version,
                steps.readable_from(step.version),
            )
    })
}

/// Applies the steps the file lacks, each in an immediate transaction with its version.
/// The version is read in that transaction, under SQLite's write lock: read before it, a
/// newer relay's migration committed while this one waited for the lock went unseen, and
/// this one recorded its older version over the newer one's (and ran on a schema it must
/// refuse). A newer schema is judged as `run` judges it, and nothing is applied to it.
pub(crate) fn apply(conn: &mut Connection) -> StoreResult<()> {
    let steps = steps();
    conn.execute_batch(VERSION_TABLE_DDL)
        .map_err(|e| sql_error("migrate", e))?;
    // A file at this relay's version (every start, every operator command) takes no write
    // lock: an application's long write transaction would otherwise hold them up.
    if read_found(conn)?.version() == steps.latest() {
        return Ok(());
    }
    loop {
        conn.execute_batch("BEGIN IMMEDIATE")
            .map_err(|e| sql_error("migrate", e))?;
        let applied = apply_next(conn, &steps).and_then(|applied| {
            conn.execute_batch("COMMIT")
                .map_err(|e| sql_error("migrate", e))?;
            Ok(applied)
        });
        match applied {
            Ok(true) => {}
            Ok(false) => return Ok(()),
            Err(e) => {
                // The connection is the store's one writer: no transaction is left open on it.
                let _ = conn.execute_batch("ROLLBACK");
                return Err(e);
            }
        }
    }
}

/// Within the caller's transaction: the next step the file lacks, with its version; false
/// when none is left (or the schema is newer than this relay's).
fn apply_next(conn: &Connection, steps: &Steps) -> StoreResult<bool> {
    let found = read_found(conn)?;
    if found.version() > steps.latest() {
        outbox_core::migration::judge(steps, found, "migrate")?;
        return Ok(false);
    }
    let Some(step) = steps.after(found.version()).next() else {
        return Ok(false);
    };
    if matches!(found, Found::Unversioned) {
        refuse_a_foreign_outbox(conn)?;
    }
    let mut sql = String::new();
    for s in &step.statements {
        sql.push_str(s);
        sql.push('\n');
    }
    sql.push_str(&record_version(
        steps.component,
        step.version,
        steps.readable_from(step.version),
    ));
    conn.execute_batch(&sql).map_err(|e| {
        sql_error(
            &format!(
                "migrate: step {} (`migrate` again resumes here)",
                step.version
            ),
            e,
        )
    })?;
    Ok(true)
}

/// An `outbox` table that is not the relay's (no `sequence_id` column): the first step's
/// index on it failed with "no such column: sequence_id in …", the whole DDL quoted, and
/// `migrate` again failed the same way.
fn refuse_a_foreign_outbox(conn: &Connection) -> StoreResult<()> {
    let columns: Vec<String> = conn
        .prepare("SELECT name FROM pragma_table_info('outbox')")
        .and_then(|mut stmt| stmt.query_map([], |r| r.get(0))?.collect())
        .map_err(|e| sql_error("migrate: reading the outbox table's columns", e))?;
    if columns.iter().any(|c| c == "sequence_id") {
        return Ok(());
    }
    Err(StoreError::new(
        StoreErrorKind::Config,
        format!(
            "migrate: a table named outbox already exists, with other columns ({}): it is \
             not the relay's outbox",
            columns.join(", ")
        ),
    )
    .with_hint(
        "rename that table, or point database_url (--database-url) at another database file",
    ))
}

/// The recorded version, or whether the outbox table exists without one.
pub(crate) fn read_found(conn: &Connection) -> StoreResult<Found> {
    let context = "reading the schema version";
    let exists = |name: &str| -> StoreResult<bool> {
        conn.query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1",
            [name],
            |r| r.get::<_, i64>(0),
        )
        .map(|n| n > 0)
        .map_err(|e| sql_error(context, e))
    };
    if exists("outbox_versions")? {
        let row: Option<(i64, i64)> = conn
            .query_row(
                "SELECT version, readable_from FROM outbox_versions WHERE component = 'outbox'",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
            .map_err(|e| sql_error(context, e))?;
        if let Some((version, readable_from)) = row {
            return Found::recorded(version, readable_from, || {
                "outbox_versions holds a negative version".into()
            });
        }
    }
    Ok(if exists("outbox")? {
        Found::Unversioned
    } else {
        Found::Nothing
    })
}
