//! What keeps WAL capture from working on a database (`check`, and `run` before any
//! session), the slot as the server shows it, and the adoption record `drop-slot` forgets.

use super::*;
use outbox_core::ident::TableName;

/// What keeps WAL capture from working on this database, each with its fix, besides what
/// the polling store finds: `check` and `run` call it before any session starts.
pub async fn verify_capture(
    main: &PgStore,
    publication: &outbox_core::ident::Ident,
    slot: &str,
    source: Option<SourceTable>,
) -> StoreResult<Vec<Problem>> {
    // `migrate --capture wal` installs the trigger that notifies nobody, and `main` expects
    // that one (its tables say `poll_wakeup`).
    let mut problems = main.verify().await?;
    let tables = capture_tables(main.tables(), publication, source);
    let sql = CaptureStatements::new(&tables);
    let level: String = main.query_rows("wal_level", &sql.wal_level, &[]).await?[0].get(0);
    if level != "logical" {
        problems.push(Problem::blocking(
            format!("the server runs with wal_level = {level}; WAL capture needs logical"),
            "set wal_level = logical in postgresql.conf and restart PostgreSQL (or use --capture poll)",
        ));
    }
    // Checked for the role connected now: in `migrate`, that may not be the relay's.
    let role = main.query_rows("role", &sql.replication_role, &[]).await?;
    if let Some(row) = role.first().filter(|r| !r.get::<_, bool>(0)) {
        let name: String = row.get(1);
        problems.push(Problem::blocking(
            format!("the role {name:?} may not replicate (no REPLICATION attribute)"),
            format!(
                "as a superuser: ALTER ROLE \"{}\" REPLICATION (for the role the relay runs as)",
                name.replace('"', "\"\"")
            ),
        ));
    }
    problems.extend(publication_problems(main, &sql, &tables, publication).await?);
    problems.extend(main.unidentified_rows(&tables.parked).await?);
    let parked = main.with_tables(Tables {
        outbox: tables.parked.clone(),
        ..main.tables().clone()
    });
    if let Err(e) = parked.backlog().await {
        problems.push(Problem::blocking(
            format!(
                "the parked table {} cannot be read: {}",
                tables.parked,
                e.report()
            ),
            "run `outbox-relay migrate --capture wal`",
        ));
    }
    match main.query_rows("adopted", &sql.adopted, &[&slot]).await {
        Ok(_) => problems.extend(stranded(main, &sql, &tables, slot).await?),
        Err(e) => problems.push(Problem::blocking(
            format!(
                "the table {} cannot be read: {} (the relay records there that a slot's \
                 session adopted the rows that predate the slot)",
                tables.adopted,
                e.report()
            ),
            "run `outbox-relay migrate --capture wal` (a relay of an earlier version made the \
             other tables; migrate adds what is missing)",
        )),
    }
    problems.extend(public_emit(main, &sql, &tables).await?);
    problems.extend(legacy_emit(main, &sql, &tables).await?);
    problems.extend(earlier_emit(main, &sql, &tables).await?);
    problems.extend(parked_ids(main, &tables).await?);
    problems.extend(other_slots(main, &sql, &tables, slot).await);
    problems.extend(synchronous_standby_names(main).await?);
    let status = slot_status(main, slot).await?;
    let capacity = &main
        .query_rows("replication capacity", &sql.replication_capacity, &[])
        .await?[0];
    let (slots, max_slots, senders, max_senders): (i64, i64, i64, i64) = (
        capacity.get(0),
        capacity.get(1),
        capacity.get(2),
        capacity.get(3),
    );
    if status.is_none() && slots >= max_slots {
        problems.push(Problem::blocking(
            format!("the replication slot {slot:?} does not exist yet, and the server's slots are all taken (max_replication_slots = {max_slots}): the relay cannot create it"),
            "raise max_replication_slots in postgresql.conf and restart PostgreSQL, or drop a slot that is no longer used (SELECT slot_name, active FROM pg_replication_slots; then SELECT pg_drop_replication_slot('<name>'))",
        ));
    }
    // Degraded, not blocking: a sender is often busy only for a while (a base backup, a
    // replica reconnecting), and the relay's session retries until one is free.
    if !status.as_ref().is_some_and(|s| s.active) && senders >= max_senders {
        problems.push(Problem::degraded(
            format!("the server's WAL senders are all busy (max_wal_senders = {max_senders}): the relay cannot start a replication session until one is free"),
            "raise max_wal_senders in postgresql.conf and restart PostgreSQL, or stop a replication client that is no longer needed (SELECT application_name, client_addr FROM pg_stat_replication)",
        ));
    }
    problems.extend(status.and_then(|status| slot_problem(slot, &status)));
    Ok(problems)
}

/// What is wrong with the relay's slot as `pg_replication_slots` shows it, if anything:
/// unusable, invalidated or about to be, or holding back WAL and the server's vacuum with no
/// relay streaming, or with one that stays far behind.
fn slot_problem(slot: &str, status: &SlotStatus) -> Option<Problem> {
    let wal_status = status.wal_status.as_deref();
    let holds_much = |wal: Option<i64>| {
        wal.unwrap_or_default() > SLOT_RETAINED_WARNING
            || status.catalog_xmin_age.unwrap_or_default() > SLOT_XMIN_AGE_WARNING
    };
    if let Some((cause, fix)) = crate::client::unusable_slot(
        slot,
        status.plugin.as_deref(),
        status.in_this_database,
        status.two_phase,
    ) {
        Some(Problem::blocking(
            format!("the replication slot {slot:?} cannot be used: {cause}"),
            fix,
        ))
    } else if wal_status == Some("lost") {
        Some(Problem::blocking(
            format!("the replication slot {slot:?} is invalidated (wal_status = lost): the WAL it needed was removed"),
            "events written while it fell behind cannot be read from the WAL: recover them from the application, then `outbox-relay drop-slot` and run the relay again",
        ))
    } else if wal_status == Some("unreserved") {
        Some(Problem::degraded(
            format!("the replication slot {slot:?} is about to lose WAL it needs (wal_status = unreserved)"),
            "start the relay now, or raise max_slot_wal_keep_size",
        ))
    } else if !status.active && holds_much(status.retained_bytes) {
        Some(Problem::degraded(
            format!(
                "no relay streams from the replication slot {slot:?}, which holds back {}, growing with every write",
                status.holds_back()
            ),
            "start the relay, or drop the slot (`outbox-relay drop-slot`) if WAL capture is no longer used; bound it with max_slot_wal_keep_size",
        ))
    } else if status.active && status.lag_bytes.unwrap_or_default() > SLOT_RETAINED_WARNING {
        // Its relay confirms within seconds of what it read: a slot this far behind has a
        // relay draining a backlog, or one whose confirmations stall. (Not by catalog_xmin:
        // any long transaction of the server holds that back, however well the relay
        // keeps up.) A risk to know of, not a failure: the relay runs, and `check` gates
        // deploys.
        Some(Problem::advisory(
            format!(
                "a relay streams from the replication slot {slot:?}, but the slot is {} MiB \
                 of WAL behind and holds back {}: the relay is draining a backlog, or its \
                 confirmations stall",
                status.lag_bytes.unwrap_or_default() / (1024 * 1024),
                status.holds_back()
            ),
            "look at the relay's /readyz and its outbox_wal_slot_lag_bytes and \
             outbox_wal_settle_stall_seconds: a relay that stays behind needs a faster sink \
             or a larger max_in_flight; bound the slot with max_slot_wal_keep_size",
        ))
    } else {
        None
    }
}

/// What keeps the publication from carrying every INSERT of each captured table, whole:
/// missing, not covering a table, not publishing INSERTs, a row filter, a column list. Each
/// makes pgoutput leave rows out of the stream while the slot moves past them. Beside a
/// mapped table the native outbox is captured too (`dead retry` and `send` write there), and
/// the fix names both.
pub(super) async fn publication_problems(
    main: &PgStore,
    sql: &CaptureStatements,
    tables: &CaptureTables,
    publication: &outbox_core::ident::Ident,
) -> StoreResult<Vec<Problem>> {
    let name = publication.as_str();
    let captured = tables.captured();
    // Each fix changes only what is wrong for the captured table: the publication may be
    // shared (another outbox of the database, another consumer), and `SET TABLE` with ours
    // alone took the others out of it.
    let quoted = publication.quoted();
    let add_table =
        |table: &TableName| format!("ALTER PUBLICATION {quoted} ADD TABLE {}", table.quoted());
    let whole_table = |table: &TableName| {
        format!(
            "ALTER PUBLICATION {quoted} DROP TABLE {t}; ALTER PUBLICATION {quoted} ADD TABLE {t}",
            t = table.quoted()
        )
    };
    let drift = "rows written meanwhile are not in the stream: once it is fixed, the relay's \
                 next session moves the rows still in the table to the parked table";
    let mut problems = Vec::new();
    for table in captured {
        let (schema, table_name) = (table.schema.as_str(), table.name.as_str());
        let rows = main
            .query_rows(
                "publication",
                &sql.publication,
                &[&name, &schema, &table_name],
            )
            .await?;
        let Some(row) = rows.first() else {
            let exists: bool = main
                .query_rows("publication", &sql.publication_exists, &[&name])
                .await?
                .first()
                .is_some_and(|row| row.get(0));
            if !exists {
                return Ok(vec![Problem::blocking(
                    format!("the publication {name:?} does not exist"),
                    "run `outbox-relay migrate --capture wal` (or apply `migrate --capture wal --print`)",
                )]);
            }
            // `migrate` leaves an existing publication as it is.
            problems.push(Problem::blocking(
                format!("the publication {name:?} does not cover {table}: {drift}"),
                add_table(table),
            ));
            continue;
        };
        let (inserts, filter, left_out): (bool, Option<String>, Vec<String>) =
            (row.get(0), row.get(1), row.get(2));
        // INSERTs added to what it publishes already, which other consumers may need.
        let with_inserts: String = row.get(3);
        let publish_inserts =
            format!("ALTER PUBLICATION {quoted} SET (publish = '{with_inserts}')");
        if !inserts {
            problems.push(Problem::blocking(
                format!("the publication {name:?} publishes no INSERTs of {table}: {drift}"),
                publish_inserts,
            ));
        }
        if let Some(filter) = filter {
            problems.push(Problem::blocking(
                format!("the publication {name:?} has a row filter on {table} (WHERE {filter}): rows it filters out are never relayed; {drift}"),
                whole_table(table),
            ));
        }
        if !left_out.is_empty() {
            problems.push(Problem::blocking(
                format!(
                    "the publication {name:?} has a column list that leaves out {} of {table}: events would be read without them; {drift}",
                    left_out.join(", ")
                ),
                whole_table(table),
            ));
        }
    }
    Ok(problems)
}

/// Rows the slot's stream will never bring though its adoption is recorded: the slot was
/// dropped and made again under its name while no relay ran (a relay that finds it
/// missing forgets the record), so the record is its predecessor's. The next session
/// adopts them; until then they wait, and `check` says so.
pub(super) async fn stranded(
    main: &PgStore,
    sql: &CaptureStatements,
    tables: &CaptureTables,
    slot: &str,
) -> StoreResult<Vec<Problem>> {
    let mut problems = mark_problems(main, sql, tables).await;
    let recorded = main
        .query_rows("adopted", &sql.adopted_publication_version, &[&slot])
        .await?;
    if recorded.is_empty() {
        return Ok(problems);
    }
    // The publication changed since the adoption (and perhaps back), while no relay ran:
    // rows written while it left their INSERTs out are in no stream. (An adoption recorded
    // without the version says nothing either way; the next session adopts again.)
    let adopted_at: Option<String> = recorded[0].get(0);
    let now: Option<String> = main
        .query_rows(
            "publication",
            &sql.publication_version,
            &[&tables.publication.as_str()],
        )
        .await?
        .first()
        .and_then(|row| row.get(0));
    if adopted_at.is_some() && adopted_at != now {
        problems.push(Problem::degraded(
            format!(
                "the publication {} changed since the replication slot {slot:?} adopted the \
                 rows of {} (while no relay ran): rows written while it left their INSERTs out \
                 are in no stream",
                tables.publication, tables.source.name
            ),
            "start the relay: its next session moves the rows still in the table to the parked \
             table and relays them",
        ));
        return Ok(problems);
    }
    // The slot's position first: the mark only rises, so a relay's raise and confirmation
    // between the two reads cannot make the slot look past it.
    let position = |rows: StoreResult<Vec<tokio_postgres::Row>>| {
        rows.ok().and_then(|rows| super::first_position(&rows))
    };
    let confirmed = position(main.query_rows("slot", &sql.slot_confirmed, &[&slot]).await);
    let mark = position(
        main.query_rows("confirm mark", &sql.slot_mark, &[&slot])
            .await,
    );
    let moved = matches!((confirmed, mark), (Some(confirmed), Some(mark)) if confirmed > mark);
    if moved {
        problems.push(Problem::degraded(
            format!(
                "the replication slot {slot:?} is confirmed past the position the relays may \
                 confirm it to ({}): something else moved it (it was dropped and made again, \
                 or advanced with pg_replication_slot_advance, by hand, or a relay of another \
                 outbox was given it), and its stream skips \
                 the rows of {} it moved past",
                tables.marks, tables.source.name
            ),
            "start the relay: its next session moves the rows still in the table to the parked \
             table and relays them (`outbox-relay drop-slot` before making a slot again by \
             hand avoids this; events of outbox_emit it moved past are in no table)",
        ));
        return Ok(problems);
    }
    let count: i64 = match main.query_rows("stranded", &sql.stranded, &[&slot]).await {
        Ok(rows) => rows[0].get(0),
        Err(e) => {
            problems.push(Problem::degraded(
                format!(
                    "cannot tell whether rows of {} wait that the replication slot {slot:?} will \
                     not bring: {}",
                    tables.source.name,
                    e.report()
                ),
                "grant the privileges `outbox-relay migrate --capture wal --print` lists",
            ));
            return Ok(problems);
        }
    };
    if count == 0 {
        return Ok(problems);
    }
    problems.push(Problem::degraded(
        format!(
            "{count} rows of {} (of the first 1,000 in its order) were committed before the \
             replication slot {slot:?} was made \
             (their transactions are older than its catalog_xmin), yet the slot's adoption of \
             such rows is recorded: the slot was dropped and made again under its name while \
             no relay ran, and its stream will never bring them",
            tables.source.name
        ),
        "start the relay: its next session moves them to the parked table and relays them \
         (`outbox-relay drop-slot` before making a slot again by hand avoids this)",
    ));
    Ok(problems)
}

/// Other slots that streamed this outbox and still exist: one left behind when the relay
/// moved to a new `--slot` (or a new default name) holds WAL and the server's vacuum back for
/// good, and one a relay streams from sends every event a second time.
async fn other_slots(
    main: &PgStore,
    sql: &CaptureStatements,
    tables: &CaptureTables,
    slot: &str,
) -> Vec<Problem> {
    // A table an earlier version did not make is named by its own problem.
    let Ok(rows) = main
        .query_rows("other slots", &sql.other_slots, &[&slot])
        .await
    else {
        return Vec::new();
    };
    let ours = crate::client::outbox_tag(&tables.source.name, &crate::emit_prefix(&tables.outbox));
    rows.iter()
        .filter(|row| {
            // Streaming to a relay of another outbox: the name is that outbox's now.
            let holder: Option<String> = row.get(3);
            let tag = holder.as_deref().and_then(super::reader::outbox_tag_of);
            tag.is_none_or(|tag| tag == ours)
        })
        .map(|row| {
            let (other, active, held): (String, bool, i64) = (row.get(0), row.get(1), row.get(2));
            let what = if active {
                "a relay streams from it now, so every event goes out once through each slot"
                    .to_string()
            } else {
                format!(
                    "no relay streams from it, and it holds back {} MiB of WAL, and the server's \
                     vacuum, growing with every write",
                    held / (1 << 20)
                )
            };
            Problem::degraded(
                format!(
                    "the replication slot {other:?} streamed {} too (it is recorded in {} or {}), \
                     besides the configured {slot:?}: {what}",
                    tables.source.name, tables.adopted, tables.marks
                ),
                format!(
                    "keep one slot per outbox: unless a relay of another outbox now uses \
                     {other:?}, stop the relay that streams from it, then `outbox-relay drop-slot \
                     --slot {other}` with this outbox's other flags"
                ),
            )
        })
        .collect()
}

/// What only `check` looks for, since it decodes the slot's stream: the publication dropped
/// and made again after the slot's position, with WAL written in between. Decoding reads the
/// publication as of each change, so every session of the slot fails for good (the run's
/// error names it too). A relay that meets it forgets the slot's adoption, so no record
/// tells it. Looked for only when the publication is newer than the slot's `catalog_xmin`,
/// no session streams, and the slot is not a failover slot (PostgreSQL 17 may make decoding
/// wait for its standbys): then the stream is decoded up to its first change, as a session
/// would, without moving the slot, for at most 5 s (cancelled by the server, which frees the
/// slot).
pub async fn decoding_problems(
    main: &PgStore,
    publication: &outbox_core::ident::Ident,
    slot: &str,
    source: Option<SourceTable>,
) -> Vec<Problem> {
    let tables = capture_tables(main.tables(), publication, source);
    let sql = CaptureStatements::new(&tables);
    publication_made_again(main, &sql, &tables, slot)
        .await
        .into_iter()
        .collect()
}

async fn publication_made_again(
    main: &PgStore,
    sql: &CaptureStatements,
    tables: &CaptureTables,
    slot: &str,
) -> Option<Problem> {
    let name = tables.publication.as_str();
    let newer = main
        .query_rows(
            "publication",
            &sql.publication_newer_than_slot,
            &[&name, &slot],
        )
        .await
        .ok()?
        .first()
        .is_some_and(|row| row.get::<_, bool>(0));
    if !newer {
        return None;
    }
    let bounded = [(
        "SET LOCAL statement_timeout = '5s'",
        &[] as &[&(dyn ToSql + Sync)],
    )];
    let error = main
        .transaction_then_query(
            "peek slot",
            &bounded,
            Some((&sql.peek_slot, &[&name, &slot])),
        )
        .await
        .err()?
        .report();
    (error.contains("publication") && error.contains("does not exist")).then(|| {
        Problem::degraded(
            format!(
                "the publication {name:?} was dropped and made again after the replication slot \
                 {slot:?}'s position, with WAL written in between, which PostgreSQL cannot \
                 decode: every session of the slot fails ({error})"
            ),
            "run `outbox-relay drop-slot`, then start the relay: the new slot's first session \
             moves the rows still in the table to the parked table (outbox_emit events written \
             in between are in no table)",
        )
    })
}

/// The privileges the slot's confirm mark needs that the role lacks: without them the
/// relay confirms without a mark, and tells a slot made again by hand late.
async fn mark_problems(
    main: &PgStore,
    sql: &CaptureStatements,
    tables: &CaptureTables,
) -> Vec<Problem> {
    let (marks, quoted) = (tables.marks.to_string(), tables.marks.quoted());
    let lacking = match main
        .query_rows("confirm mark privileges", &sql.marks_privileges, &[&quoted])
        .await
    {
        Ok(rows) => rows.iter().map(|row| row.get::<_, String>(0)).collect(),
        Err(e) => vec![e.report()],
    };
    if lacking.is_empty() {
        return vec![];
    }
    vec![Problem::degraded(
        format!(
            "the slot's confirm mark cannot be kept in {marks} ({}): the relay confirms the \
             slot without it, and tells a slot dropped and made again, or advanced, by hand \
             only once its catalog_xmin has moved",
            lacking.join(", ")
        ),
        "run `outbox-relay migrate --capture wal`, and grant what `outbox-relay migrate \
         --capture wal --print` lists to the relay's role",
    )]
}

/// Forgets that `slot` adopted the outbox's rows, once the slot is dropped: a slot made
/// again by that name starts after rows its predecessor never brought, and must adopt them.
/// Only while no slot of the name exists: a relay may have made it again meanwhile, and
/// recorded its own adoption.
pub async fn forget_adoption(
    main: &PgStore,
    publication: &outbox_core::ident::Ident,
    slot: &str,
) -> StoreResult<()> {
    let sql = CaptureStatements::new(&capture_tables(main.tables(), publication, None));
    match main
        .query_rows(
            "forget adoption",
            &sql.forget_adoption_of_missing_slot,
            &[&slot],
        )
        .await
    {
        // A database migrated by an earlier version: nothing recorded, nothing to forget.
        Err(e) if e.kind() == StoreErrorKind::MissingSchema => Ok(()),
        result => result.map(drop),
    }
}

/// The slot as `pg_replication_slots` shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotStatus {
    /// A session streams from it.
    pub active: bool,
    /// `reserved`, `extended`, `unreserved` (about to lose WAL it needs) or `lost`.
    pub wal_status: Option<String>,
    /// WAL it keeps on the server's disk, in bytes (`None` on a standby server).
    pub retained_bytes: Option<i64>,
    /// WAL written since its confirmed position, in bytes.
    pub lag_bytes: Option<i64>,
    /// Its output plugin (`None` for a physical slot).
    pub plugin: Option<String>,
    /// It is a slot of the database the relay connects to.
    pub in_this_database: bool,
    /// Transactions since its `catalog_xmin`: how far it holds back the server's vacuum of
    /// catalog rows and, on PostgreSQL 15, the recycling of emptied btree pages in every
    /// table of the server (an outbox's indexes grow by the rows it relays meanwhile).
    pub catalog_xmin_age: Option<i64>,
    /// It decodes prepared transactions at PREPARE (made with `two_phase = true`).
    pub two_phase: bool,
}

impl SlotStatus {
    /// What an idle slot holds back, in words, for `check` and `drop-slot`.
    pub fn holds_back(&self) -> String {
        let wal = self
            .retained_bytes
            .map(|r| format!("{} MiB of WAL on the server's disk", r / (1024 * 1024)));
        let xmin = self.catalog_xmin_age.map(|age| {
            format!(
                "the server's vacuum of catalog rows and the recycling of emptied index pages \
                 in every table, for the {age} transactions since its catalog_xmin"
            )
        });
        match [wal, xmin].into_iter().flatten().collect::<Vec<_>>() {
            held if held.is_empty() => "nothing yet".into(),
            held => held.join(", and "),
        }
    }
}

/// A warning while `synchronous_standby_names` names every standby (`*`): the server may
/// make the relay's replication session a synchronous standby, and every commit would wait
/// for the relay's deliveries (the relay lets such a session go, see the reader).
async fn synchronous_standby_names(main: &PgStore) -> StoreResult<Option<Problem>> {
    let rows = main
        .query_rows(
            "synchronous_standby_names",
            "SELECT current_setting('synchronous_standby_names')",
            &[],
        )
        .await?;
    let names: String = rows[0].get(0);
    Ok(names.contains('*').then(|| {
        Problem::degraded(
            format!(
                "synchronous_standby_names is {names:?}: its '*' names the relay's replication \
                 session too, which the server may make a synchronous standby; every commit \
                 would then wait for the relay's deliveries, and the relay lets such a session \
                 go, so it streams only while a physical standby is chosen first"
            ),
            "name the standbys in synchronous_standby_names (ALTER SYSTEM SET \
             synchronous_standby_names = 'FIRST 1 (replica1, replica2)'; SELECT \
             pg_reload_conf())",
        )
    }))
}

/// The slot named `slot`, if it exists.
pub async fn slot_status(main: &PgStore, slot: &str) -> StoreResult<Option<SlotStatus>> {
    let sql = CaptureStatements::slot_query();
    let rows = main.query_rows("slot", sql, &[&slot]).await?;
    Ok(rows.first().map(|row| SlotStatus {
        active: row.get(0),
        wal_status: row.get(1),
        retained_bytes: row.get(2),
        lag_bytes: row.get(3),
        plugin: row.get(4),
        in_this_database: row.get(5),
        catalog_xmin_age: row.get(6),
        two_phase: row.get(7),
    }))
}

/// A warning while every role that can connect may write outbox events (and forge their
/// ids) with `pg_logical_emit_message`, which PostgreSQL lets PUBLIC execute; the fix makes
/// the outbox's emit function the gate. Only a superuser can revoke it, and other tools of
/// the database may use it, so the relay says so rather than doing it.
async fn public_emit(
    main: &PgStore,
    sql: &CaptureStatements,
    tables: &CaptureTables,
) -> StoreResult<Vec<Problem>> {
    let rows = main
        .query_rows("emit privilege", &sql.public_emit, &[])
        .await?;
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let functions: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    let emit = crate::emit::emit_function(&tables.outbox);
    let role = main_role(main).await;
    Ok(vec![Problem::advisory(
        format!(
            "every role that can connect may write outbox events, and forge their ids, with {} \
             (PostgreSQL lets PUBLIC execute it)",
            functions.join(" and ")
        ),
        format!(
            "as a superuser, make {emit} the gate: REVOKE EXECUTE ON FUNCTION {all} FROM PUBLIC; \
             GRANT EXECUTE ON FUNCTION {text} TO \"{role}\" (the relay writes its drain marker with \
             it), <the owner of {emit}>; ALTER FUNCTION {emit} SECURITY DEFINER; REVOKE EXECUTE \
             ON FUNCTION {emit} FROM PUBLIC; GRANT EXECUTE ON FUNCTION {emit} TO <each writer's \
             role> (first check that no other tool of this database emits messages itself)",
            all = functions.join(", "),
            // The one both the relay's marker and outbox_emit call; the bytea form neither.
            text = "pg_logical_emit_message(boolean, text, text)",
            role = role.replace('"', "\"\""),
        ),
    )])
}

/// A leftover of an earlier version: `<schema>.outbox_emit` beside an outbox of another
/// name, in a schema with no `outbox` table. It wrote every outbox's messages under the one
/// prefix `outbox`, which this outbox no longer reads (its own is `outbox:<schema>.<table>`,
/// written by `<schema>.<table>_emit`): writers still calling it would lose their events.
async fn legacy_emit(
    main: &PgStore,
    sql: &CaptureStatements,
    tables: &CaptureTables,
) -> StoreResult<Vec<Problem>> {
    if tables.outbox.name.as_str() == "outbox" {
        return Ok(Vec::new());
    }
    let schema = tables.outbox.schema.as_str();
    let rows = main
        .query_rows("legacy emit function", &sql.legacy_emit, &[&schema])
        .await?;
    if !rows.first().is_some_and(|r| r.get::<_, bool>(0)) {
        return Ok(Vec::new());
    }
    let old = format!("{}.outbox_emit", tables.outbox.schema.quoted());
    let new = crate::emit::emit_function(&tables.outbox);
    Ok(vec![Problem::blocking(
        format!(
            "{old}, made by an earlier version, writes events under the message prefix `outbox`, \
             which this outbox no longer reads (its prefix is `{}`, written by {new}): events \
             written with it would be lost",
            crate::emit::emit_prefix(&tables.outbox)
        ),
        format!(
            "switch the writers to {new} (same arguments), let the last events written with \
             {old} be relayed (an earlier version's `run --drain`), then DROP FUNCTION {old}(text, \
             text, text, jsonb, jsonb, uuid)"
        ),
    )])
}

/// The emit function as an earlier version made it, which `run` does not replace (only
/// `migrate` does): it lacks what this version's adds, the refusal of an emit while no slot
/// of the database streams, whose events were lost without a word.
async fn earlier_emit(
    main: &PgStore,
    sql: &CaptureStatements,
    tables: &CaptureTables,
) -> StoreResult<Vec<Problem>> {
    let signature = crate::emit::emit_signature(&tables.outbox);
    let rows = main
        .query_rows("emit function", &sql.function_body, &[&signature])
        .await?;
    let Some(body) = rows.first().and_then(|r| r.get::<_, Option<String>>(0)) else {
        return Ok(Vec::new());
    };
    if body == crate::emit::emit_function_body(&tables.outbox) {
        return Ok(Vec::new());
    }
    Ok(vec![Problem::degraded(
        format!(
            "{} is not this version's: an earlier version made it (or it was changed by hand), \
             and it accepts events while no slot of the database streams, which are lost",
            crate::emit::emit_function(&tables.outbox)
        ),
        "run `outbox-relay migrate --capture wal` with this version (it replaces the \
         function, keeping SECURITY DEFINER where it was set)",
    )])
}

/// The parked table's `sequence_id` without a default: the outbox's sequence it drew from
/// went with an outbox dropped and made again (CASCADE). Every adoption and park then
/// failed on a NULL id, and capture stalled for good while `check` said ok.
async fn parked_ids(main: &PgStore, tables: &CaptureTables) -> StoreResult<Option<Problem>> {
    let rows = main
        .query_rows(
            "parked ids",
            "SELECT EXISTS (SELECT FROM pg_catalog.pg_attrdef d
                              JOIN pg_catalog.pg_attribute a
                                ON a.attrelid = d.adrelid AND a.attnum = d.adnum
                             WHERE d.adrelid = to_regclass($1) AND a.attname = 'sequence_id'),
                    to_regclass($1) IS NOT NULL",
            &[&tables.parked.quoted()],
        )
        .await?;
    let (has_default, exists) = (rows[0].get::<_, bool>(0), rows[0].get::<_, bool>(1));
    Ok((exists && !has_default).then(|| {
        Problem::blocking(
            format!(
                "the parked table {}'s sequence_id has no default (the outbox's sequence it \
                 drew from is gone: was the outbox dropped and made again?), so every park \
                 and adoption fails",
                tables.parked
            ),
            "run `outbox-relay migrate --capture wal` (it restores the default)",
        )
    }))
}

/// The role the store connects as, for the fixes that name it.
async fn main_role(main: &PgStore) -> String {
    match main
        .query_rows("role", "SELECT current_user::text", &[])
        .await
    {
        Ok(rows) => rows.first().map(|r| r.get(0)).unwrap_or_default(),
        Err(_) => "<the relay's role>".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A relay streams from the slot, far behind: `check` named only an idle slot, and a
    /// relay whose confirmations stalled (or that fell behind a backlog for good) held the
    /// server's WAL without a word.
    #[test]
    fn a_slot_far_behind_its_streaming_relay_is_named_as_an_idle_one_is() {
        let far_behind = SlotStatus {
            active: true,
            retained_bytes: Some(300 * 1024 * 1024),
            lag_bytes: Some(290 * 1024 * 1024),
            plugin: Some("pgoutput".into()),
            in_this_database: true,
            ..SlotStatus::default()
        };
        let said = slot_problem("s", &far_behind).expect("named").to_string();
        assert!(
            said.contains("a relay streams from the replication slot \"s\""),
            "{said}"
        );
        assert!(said.contains("the slot is 290 MiB of WAL behind"), "{said}");
        let keeping_up = SlotStatus {
            lag_bytes: Some(1024 * 1024),
            // A long transaction elsewhere on the server holds it back.
            catalog_xmin_age: Some(5_000_000),
            ..far_behind.clone()
        };
        assert_eq!(
            slot_problem("s", &keeping_up),
            None,
            "retained WAL and an old catalog_xmin alone"
        );
        let idle = SlotStatus {
            active: false,
            ..far_behind
        };
        let said = slot_problem("s", &idle).expect("named").to_string();
        assert!(said.contains("no relay streams"), "{said}");
    }

    #[test]
    fn an_idle_slot_says_what_it_holds_back() {
        let slot = SlotStatus {
            retained_bytes: Some(300 * 1024 * 1024),
            catalog_xmin_age: Some(2_000_000),
            ..SlotStatus::default()
        };
        let said = slot.holds_back();
        assert!(said.contains("300 MiB of WAL"), "{said}");
        assert!(said.contains("recycling of emptied index pages"), "{said}");
        assert!(said.contains("2000000 transactions"), "{said}");
        assert_eq!(SlotStatus::default().holds_back(), "nothing yet");
    }
}
