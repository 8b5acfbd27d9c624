//! `verify`: what the native schema and the role must have for the relay to run (the
//! primary, the tables and privileges, the columns, the wake-up trigger, the indexes).

use outbox_core::store::{Problem, StoreResult};
use outbox_core::{StoreError, StoreErrorKind};

use crate::error::db_error;
use crate::{Inner, PgStore};

/// Refuses a hot standby: it takes no writes, so a relay there would fail every claim.
/// Checked by `verify`, which `run` and `check` call first thing.
pub(crate) async fn refuse_standby(inner: &Inner) -> StoreResult<()> {
    let rows = PgStore::query(inner, "verify", "SELECT pg_is_in_recovery()", &[]).await?;
    if rows[0].get::<_, bool>(0) {
        return Err(StoreError::new(
            StoreErrorKind::Config,
            "the database is a hot standby (pg_is_in_recovery() is true), which takes no writes: \
             point the database URL at the primary, not at a replica or a pooler that routes to one",
        ));
    }
    Ok(())
}

pub(crate) async fn verify(inner: &Inner) -> StoreResult<Vec<Problem>> {
    refuse_standby(inner).await?;
    let t = &inner.tables;
    let mut problems = Vec::new();
    // A primary can refuse writes too (a cutover's freeze, a service gone read-only on a
    // full disk): every claim would fail, retried without end.
    let read_only = PgStore::query(
        inner,
        "verify",
        "SELECT current_setting('transaction_read_only') = 'on'",
        &[],
    )
    .await?;
    if read_only[0].get::<_, bool>(0) {
        // Degraded: a read-only window passes, and the relay retries through it.
        problems.push(Problem::degraded(
            "the database refuses writes (transaction_read_only is on for the relay's \
             sessions), and the relay claims and settles by writing",
            crate::error::READ_ONLY_HINT,
        ));
    }
    let migrate_fix = "run `outbox-relay migrate` (or apply `outbox-relay migrate --print`)";
    // (table, privileges the relay needs on it)
    let needs = [
        (&t.outbox, "SELECT, UPDATE, DELETE"),
        (&t.dead_letters, "SELECT, INSERT"),
        (&t.nodes, "SELECT, INSERT, UPDATE, DELETE"),
        (&t.partitions, "SELECT, UPDATE"),
    ];
    for (table, privileges) in needs {
        let name = table.quoted();
        let rows = PgStore::query(
            inner,
            "verify",
            "SELECT to_regclass($1) IS NOT NULL",
            &[&name],
        )
        .await?;
        if !rows[0].get::<_, bool>(0) {
            problems.push(Problem::blocking(
                format!("table {table} does not exist"),
                migrate_fix,
            ));
            continue;
        }
        let shown = table.to_string();
        let print = "outbox-relay migrate --print";
        let missing = missing_privileges(inner, &name, &shown, privileges, print).await?;
        problems.extend(missing);
    }
    if !problems.iter().any(|p| p.fails_check()) {
        let rows = PgStore::query(inner, "verify", &inner.sql.partition_count, &[]).await?;
        let missing = crate::registry::missing_partitions(&t.partitions, rows[0].get(2));
        problems.extend(missing.map(|(what, fix)| Problem::blocking(what, fix)));
    }
    problems.extend(verify_outbox_columns(inner).await?);
    // Only over tables that are all there, with their columns.
    if problems.iter().all(|p| !p.fails_check()) {
        problems.extend(sequence_went_back(inner).await?);
    }
    let (trigger, table) = t.trigger_exists_sql();
    problems.extend(
        missing_trigger(inner, &trigger, &table, &t.outbox.to_string(), migrate_fix).await?,
    );
    index_problems(inner, &mut problems, migrate_fix).await?;
    problems.extend(unidentified_rows(inner, &t.outbox.quoted(), &t.outbox.to_string()).await?);
    problems
        .extend(hidden_by_row_security(inner, &t.outbox.quoted(), &t.outbox.to_string()).await?);
    Ok(problems)
}

/// Row-level security on `table` (quoted) for a role that is neither its owner nor
/// BYPASSRLS, and no policy naming the role or PUBLIC: the relay's claims see no row, and
/// the rows waited for good while `/readyz`, the backlog and `check` said nothing pended.
pub(crate) async fn hidden_by_row_security(
    inner: &Inner,
    table: &str,
    shown: &str,
) -> StoreResult<Vec<Problem>> {
    let rows = PgStore::query(
        inner,
        "verify",
        "SELECT c.relrowsecurity
                AND (c.relforcerowsecurity OR NOT pg_has_role(c.relowner, 'USAGE'))
                AND NOT (SELECT rolbypassrls FROM pg_catalog.pg_roles WHERE rolname = current_user)
                AND NOT EXISTS (SELECT FROM pg_catalog.pg_policies p
                                 WHERE p.schemaname = n.nspname AND p.tablename = c.relname
                                   AND (current_user = ANY (p.roles) OR 'public' = ANY (p.roles)))
           FROM pg_catalog.pg_class c
           JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
          WHERE c.oid = to_regclass($1)",
        &[&table],
    )
    .await?;
    if !rows.first().is_some_and(|r| r.get::<_, bool>(0)) {
        return Ok(Vec::new());
    }
    Ok(vec![Problem::blocking(
        format!(
            "row-level security is on for {shown}, and no policy names the relay's role, which \
             is neither the table's owner nor BYPASSRLS: the relay sees none of its rows, and \
             relays none"
        ),
        format!(
            "CREATE POLICY outbox_relay ON {table} TO <relay role> USING (true); (or ALTER \
             ROLE <relay role> BYPASSRLS, or ALTER TABLE {table} DISABLE ROW LEVEL SECURITY)"
        ),
    )])
}

/// `table` (quoted) in a publication that publishes deletes or updates (one `FOR ALL
/// TABLES` for a replica, another tool's) with no replica identity (`REPLICA IDENTITY
/// NOTHING`, or the default without a primary key): PostgreSQL refuses every DELETE and
/// UPDATE of it, so no delivered row was deleted (under WAL capture the slot stopped being
/// confirmed) while `check` said ok.
pub(crate) async fn unidentified_rows(
    inner: &Inner,
    table: &str,
    shown: &str,
) -> StoreResult<Vec<Problem>> {
    let rows = PgStore::query(
        inner,
        "verify",
        "SELECT c.relreplident::text,
                EXISTS (SELECT FROM pg_catalog.pg_index i
                         WHERE i.indrelid = c.oid AND i.indisprimary),
                ARRAY(SELECT DISTINCT pt.pubname::text
                        FROM pg_catalog.pg_publication_tables pt
                        JOIN pg_catalog.pg_publication p ON p.pubname = pt.pubname
                       WHERE pt.schemaname = n.nspname AND pt.tablename = c.relname
                         AND (p.pubdelete OR p.pubupdate)
                       ORDER BY 1)
           FROM pg_catalog.pg_class c
           JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
          WHERE c.oid = to_regclass($1)",
        &[&table],
    )
    .await?;
    let Some(row) = rows.first() else {
        return Ok(Vec::new());
    };
    let (identity, primary_key, publications): (String, bool, Vec<String>) =
        (row.get(0), row.get(1), row.get(2));
    let unidentified = identity == "n" || (identity == "d" && !primary_key);
    if !unidentified || publications.is_empty() {
        return Ok(Vec::new());
    }
    let why = if identity == "n" {
        "REPLICA IDENTITY NOTHING"
    } else {
        "no primary key for its default replica identity"
    };
    Ok(vec![Problem::blocking(
        format!(
            "table {shown} has {why} and is in publication(s) {} that publish deletes or \
             updates: PostgreSQL refuses every DELETE and UPDATE of it, so no delivered row \
             is deleted or marked",
            publications.join(", ")
        ),
        format!(
            "ALTER TABLE {table} REPLICA IDENTITY DEFAULT (with a primary key) or FULL, or \
             ALTER PUBLICATION <name> DROP TABLE {table}"
        ),
    )])
}

/// The outbox's id sequence behind the dead-letter table's ids (reset by `TRUNCATE …
/// RESTART IDENTITY`, a restore, an `ALTER SEQUENCE … RESTART`): the next event to be
/// dead-lettered with an id already there would fail on the table's key at every try, its
/// key held back for good.
async fn sequence_went_back(inner: &Inner) -> StoreResult<Option<Problem>> {
    let t = &inner.tables;
    let (outbox, dead) = (t.outbox.quoted(), t.dead_letters.quoted());
    // Index lookups only: the highest dead letter's id, whether the outbox holds a row of
    // that id (a reset sequence handing it out again), the outbox's highest id, and the
    // sequence's value where the role may read it (NULL otherwise, and before first use).
    let sql = format!(
        "WITH dead AS (SELECT max(sequence_id) AS max FROM {dead}),
              seq AS (SELECT pg_get_serial_sequence($1, 'sequence_id') AS name)
         SELECT seq.name, dead.max,
                CASE WHEN seq.name IS NOT NULL AND has_sequence_privilege(seq.name, 'SELECT')
                     THEN pg_sequence_last_value(seq.name::regclass) END,
                EXISTS (SELECT 1 FROM {outbox} o WHERE o.sequence_id = dead.max),
                (SELECT max(sequence_id) FROM {outbox})
           FROM dead, seq"
    );
    let rows = PgStore::query(inner, "verify", &sql, &[&outbox]).await?;
    let row = &rows[0];
    let (sequence, dead_max, last, taken, outbox_max): (
        Option<String>,
        Option<i64>,
        Option<i64>,
        bool,
        Option<i64>,
    ) = (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
    let Some(sequence) = sequence else {
        return Ok(None);
    };
    // Past every id either table holds: never backwards, for the application's inserts.
    let past = dead_max.unwrap_or(0).max(outbox_max.unwrap_or(0));
    // Behind the rows still in the outbox: rows written now take ids below rows still
    // pending, and go out before them, out of order within their keys, without a word.
    if let (Some(last), Some(outbox_max)) = (last, outbox_max) {
        if last < outbox_max {
            return Ok(Some(Problem::blocking(
                format!(
                    "the outbox's id sequence {sequence} went back behind the ids of rows still \
                     in the outbox (at {last}, up to {outbox_max}): it was reset, and rows \
                     written now would be relayed before earlier rows of their keys"
                ),
                format!("SELECT setval('{sequence}', {past});"),
            )));
        }
    }
    let Some(dead_max) = dead_max else {
        return Ok(None);
    };
    if !taken && last.is_none_or(|last| last >= dead_max) {
        return Ok(None);
    }
    // The relay runs with it (only an event dead-lettered under a taken id fails); check
    // fails, naming the fix.
    Ok(Some(Problem::degraded(
        format!(
            "the outbox's id sequence {sequence} went back behind the dead-letter table's ids \
             (up to {dead_max}): it was reset, and an event dead-lettered under an id already \
             there would fail at every try, holding back its key"
        ),
        format!("SELECT setval('{sequence}', {past});"),
    )))
}

/// A problem for each of `privileges` (as in "SELECT, UPDATE") that the current role lacks
/// on `table` (quoted; `shown` as the message names it); the fix points at `print`, the
/// command that prints every grant.
pub(crate) async fn missing_privileges(
    inner: &Inner,
    table: &str,
    shown: &str,
    privileges: &str,
    print: &str,
) -> StoreResult<Vec<Problem>> {
    let mut problems = Vec::new();
    for privilege in privileges.split(", ") {
        let rows = PgStore::query(
            inner,
            "verify",
            "SELECT has_table_privilege(current_user, $1, $2)",
            &[&table, &privilege],
        )
        .await?;
        if !rows[0].get::<_, bool>(0) {
            problems.push(Problem::blocking(
                format!("the current role lacks {privilege} on {shown}"),
                format!("GRANT {privilege} ON {table} TO <relay role>; (see `{print}`)"),
            ));
        }
    }
    Ok(problems)
}

/// The wake-up trigger `trigger` on `table` (quoted), if it is missing: the relay then polls.
pub(crate) async fn missing_trigger(
    inner: &Inner,
    trigger: &str,
    table: &str,
    shown: &str,
    fix: &str,
) -> StoreResult<Option<Problem>> {
    let rows = PgStore::query(
        inner,
        "verify",
        "SELECT count(*)::int8 FROM pg_trigger WHERE tgname = $1 AND tgrelid = to_regclass($2)",
        &[&trigger, &table],
    )
    .await?;
    Ok((rows[0].get::<_, i64>(0) == 0).then(|| {
        Problem::degraded(
            format!("trigger {trigger} on {shown} is missing: the relay is not woken on insert and falls back to polling"),
            fix,
        )
    }))
}

/// The indexes claims rely on, read in one statement. Without the scheduled index the scan
/// floor is off (slower, not wrong). The blocking index is over the key's hash; an outbox
/// migrated by an earlier version has the index over the key itself instead: claims still
/// find it (they compare the key too), so the relay runs, but a key too long for it fails
/// every claim or retry that leases it.
async fn index_problems(
    inner: &Inner,
    problems: &mut Vec<Problem>,
    migrate_fix: &str,
) -> StoreResult<()> {
    let t = &inner.tables;
    let (scheduled, index, obsolete, pending) = (
        t.scheduled_index(),
        t.blocking_index(),
        t.obsolete_blocking_index(),
        t.pending_index(),
    );
    let outbox = t.outbox.quoted();
    let rows = PgStore::query(
        inner,
        "verify",
        "SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL, to_regclass($3) IS NOT NULL,
                to_regclass($4) IS NOT NULL,
                EXISTS (SELECT FROM pg_catalog.pg_index i
                          JOIN pg_catalog.pg_attribute a
                            ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
                         WHERE i.indrelid = to_regclass($5) AND i.indisunique
                           AND i.indnkeyatts = 1 AND i.indpred IS NULL AND a.attname = 'event_id')",
        &[&scheduled, &index, &obsolete, &pending, &outbox],
    )
    .await?;
    let (scheduled_present, present, obsolete_present, pending_present, unique_event_ids) = (
        rows[0].get::<_, bool>(0),
        rows[0].get::<_, bool>(1),
        rows[0].get::<_, bool>(2),
        rows[0].get::<_, bool>(3),
        rows[0].get::<_, bool>(4),
    );
    // Its UNIQUE constraint dropped by hand: two rows with one event id go out as one event
    // to every sink that drops duplicates by id, the later one lost; `check` said ok.
    if !unique_event_ids {
        problems.push(Problem::degraded(
            format!(
                "no unique index holds {outbox}'s event_id alone: two rows with one event id go \
                 out as one event to every sink that drops duplicates by id (JetStream, SQS \
                 FIFO, a consumer's dedupe), and the later one is lost"
            ),
            format!("ALTER TABLE {outbox} ADD UNIQUE (event_id)"),
        ));
    }
    // Dropped by hand, claims read the whole table (its delivered rows too, with
    // --retain-delivered) for each batch; `check` said ok.
    if !pending_present {
        problems.push(Problem::degraded(
            format!("index {pending} is missing: every claim reads the whole table to find the pending rows"),
            migrate_fix,
        ));
    }
    if !scheduled_present {
        problems.push(Problem::degraded(
            format!(
                "index {scheduled} is missing: cluster claims scan the pending rows from the start"
            ),
            migrate_fix,
        ));
    }
    let fix = "run `outbox-relay migrate` (or apply `outbox-relay migrate --print`): it creates \
               the index and drops the old one";
    if obsolete_present {
        problems.push(Problem::degraded(
            format!(
                "index {obsolete} is from an earlier version and {index} is {}: an ordering key \
                 longer than about 2.7 kB fails every claim and retry that leases it",
                if present { "there too" } else { "missing" }
            ),
            fix,
        ));
    } else if !present {
        problems.push(Problem::blocking(
            format!(
                "index {index} is missing: every claim looks for each key's earlier rows without it"
            ),
            fix,
        ));
    }
    Ok(())
}

/// The native outbox table's columns as `migrate` creates them: name, type as
/// `format_type` writes it, other types the relay reads as well, and NOT NULL.
const OUTBOX_COLUMNS: [(&str, &str, &[&str], bool); 16] = [
    ("sequence_id", "bigint", &[], true),
    ("event_id", "uuid", &[], true),
    ("destination", "text", &["character varying"], true),
    ("partition_key", "text", &["character varying"], false),
    ("event_type", "text", &["character varying"], true),
    ("payload", "jsonb", &["json"], false),
    ("headers", "jsonb", &["json"], true),
    ("mutation_id", "text", &["character varying"], false),
    ("rejected", "boolean", &[], true),
    ("created_at", "timestamp with time zone", &[], true),
    ("available_at", "timestamp with time zone", &[], true),
    ("attempts", "integer", &[], true),
    ("last_error", "text", &["character varying"], false),
    ("locked_by", "text", &["character varying"], false),
    ("locked_until", "timestamp with time zone", &[], false),
    ("delivered_at", "timestamp with time zone", &[], false),
];

/// Compares the outbox table's columns with [`OUTBOX_COLUMNS`]: a missing (renamed) column
/// or a changed type stops the relay, so each is a problem; a dropped NOT NULL only sends
/// the rows with NULL there to the dead letters, so it is a degraded one. Columns the
/// relay does not know (an application's own) are left alone.
async fn verify_outbox_columns(inner: &Inner) -> StoreResult<Vec<Problem>> {
    let t = &inner.tables.outbox;
    let name = t.quoted();
    let rows = PgStore::query(
        inner,
        "verify",
        "SELECT a.attname::text, format_type(a.atttypid, NULL), a.attnotnull
           FROM pg_attribute a
          WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped
          ORDER BY a.attnum",
        &[&name],
    )
    .await?;
    let found: Vec<(String, String, bool)> = rows
        .iter()
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)))
        .collect::<Result<_, tokio_postgres::Error>>()
        .map_err(|e| db_error("verify", e))?;
    if found.is_empty() {
        return Ok(Vec::new()); // reported as a missing table
    }
    let known = |column: &str| OUTBOX_COLUMNS.iter().any(|(c, ..)| *c == column);
    let mut problems = Vec::new();
    for (column, ty, also, not_null) in OUTBOX_COLUMNS {
        let Some((_, found_ty, found_not_null)) = found.iter().find(|(c, ..)| c == column) else {
            // A renamed column: an unknown one of the same type is the likely culprit.
            let fix = match found.iter().find(|(c, t, _)| !known(c) && t == ty) {
                Some((other, ..)) => format!(
                    "ALTER TABLE {name} RENAME COLUMN \"{}\" TO {column}; (if {other} is it: the relay reads {column})",
                    other.replace('"', "\"\"")
                ),
                None => format!(
                    "ALTER TABLE {name} ADD COLUMN {column} {ty}; (see `outbox-relay migrate --print` for its default), or rename the column that holds it back to {column}"
                ),
            };
            problems.push(Problem::missing_column(column, t, fix));
            continue;
        };
        if found_ty != ty && !also.contains(&found_ty.as_str()) {
            problems.push(Problem::blocking(
                format!("column {column} of {t} has type {found_ty}; the relay reads {ty}"),
                format!("ALTER TABLE {name} ALTER COLUMN {column} TYPE {ty} USING {column}::{ty};"),
            ));
        } else if not_null && !found_not_null {
            problems.push(Problem::nullable_column(
                column,
                t,
                format!("ALTER TABLE {name} ALTER COLUMN {column} SET NOT NULL; (after setting {column} on the rows where it is NULL)"),
            ));
        }
    }
    Ok(problems)
}
