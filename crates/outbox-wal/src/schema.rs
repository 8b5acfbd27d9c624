//! What `migrate --capture wal` creates besides the outbox: the publication WAL capture
//! reads, the parked table, and the function that writes table-less events
//! ([`crate::emit_function_ddl`]); and every statement WAL capture runs on them.

use outbox_core::ident::{Ident, TableName};
use outbox_core::migration::{Lock, Run, Step, Steps};
use outbox_core::{StoreError, StoreErrorKind};

use crate::emit::{emit_function, emit_function_ddl, emit_prefix, DRAIN_MARKER};
use crate::table::{ColumnNames, SourceTable};

/// Creates the publication `publication` of `table`'s INSERTs, if no publication of that
/// name exists. INSERTs only: the relay's own deletes of delivered rows, and any updates,
/// stay out of the stream. Needs the table's owner (or a superuser). An existing
/// publication of the same name is left as it is.
pub fn publication_ddl(publication: &Ident, table: &TableName) -> String {
    publication_of(publication, &[table])
}

/// [`publication_ddl`] over several tables.
fn publication_of(publication: &Ident, tables: &[&TableName]) -> String {
    let name = publication.as_str();
    let quoted = publication.quoted();
    let table = tables
        .iter()
        .map(|t| t.quoted())
        .collect::<Vec<_>>()
        .join(", ");
    // A table missing from a publication that lists its tables (one dropped and made again
    // left it, and `check` refused to run without it) is added back.
    let add_missing: String = tables
        .iter()
        .map(|t| {
            let (schema, table_name) = (
                t.schema.as_str().replace('\'', "''"),
                t.name.as_str().replace('\'', "''"),
            );
            format!(
                r#"
    IF NOT (SELECT puballtables FROM pg_catalog.pg_publication WHERE pubname = '{name}')
          AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_publication_tables
                           WHERE pubname = '{name}' AND schemaname = '{schema}'
                             AND tablename = '{table_name}') THEN
        ALTER PUBLICATION {quoted} ADD TABLE {table};
    END IF;"#,
                table = t.quoted()
            )
        })
        .collect();
    format!(
        r#"DO $outbox_publication$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = '{name}') THEN
        CREATE PUBLICATION {quoted} FOR TABLE {table} WITH (publish = 'insert');
    END IF;{add_missing}
END
$outbox_publication$;"#
    )
}

/// The tables WAL capture works with.
#[derive(Clone, Debug)]
pub struct CaptureTables {
    /// The native outbox table: the parked table is made like it.
    pub outbox: TableName,
    /// The table whose INSERTs are captured, and deleted once delivered: the native outbox,
    /// or a mapped table (Debezium's `outboxevent`).
    pub source: SourceTable,
    /// `<outbox>_parked`: events that must wait (a retry's backoff, a scheduled time, the
    /// later events of a key that waits). Outside the publication, so the slot moves past
    /// them; the same columns and indexes as the outbox, so the polling claim serves it.
    pub parked: TableName,
    pub dead_letters: TableName,
    pub publication: Ident,
    /// `<outbox>_adopted`: the slots whose session has adopted the rows that predate them
    /// (see [`CaptureStatements::adopt`]), so that whichever relay first streams from a slot
    /// adopts, once, and a crash or a standby's takeover in between cannot skip it.
    pub adopted: TableName,
    /// `<outbox>_confirm_marks`: per slot, the position no relay confirms it past until it
    /// has raised the mark (see [`CaptureStatements::raise_mark`]): a slot confirmed past
    /// its mark was moved by something else, made again or advanced by hand.
    pub marks: TableName,
}

impl CaptureTables {
    /// The tables of capturing the native outbox itself.
    pub fn new(outbox: TableName, dead_letters: TableName, publication: Ident) -> Self {
        Self::with_source(
            SourceTable::native(outbox.clone()),
            outbox,
            dead_letters,
            publication,
        )
    }

    /// The tables of capturing `source`, with the native `outbox` tables keeping parked
    /// events and dead letters.
    pub fn with_source(
        source: SourceTable,
        outbox: TableName,
        dead_letters: TableName,
        publication: Ident,
    ) -> Self {
        let [parked, adopted, marks] = SIBLING_SUFFIXES.map(|suffix| sibling(&outbox, suffix));
        CaptureTables {
            outbox,
            source,
            parked,
            dead_letters,
            publication,
            adopted,
            marks,
        }
    }

    /// WAL capture's steps, the `wal` component of `<outbox>_versions`. Its objects
    /// also follow the settings (the publication's tables, a mapped source), so `migrate`
    /// applies [`CaptureTables::ddl`] again after the steps. Add a step at the end for
    /// every change, and keep `crates/outbox-relay/tests/fixtures/` current.
    pub fn steps(&self) -> Steps {
        Steps::new(
            "wal",
            vec![
                Step {
                    version: 1,
                    summary:
                        "WAL capture: the publication, the parked and adopted tables, the emit \
                          function (the publication takes no lock that blocks writes)",
                    statements: vec![self.ddl()],
                    lock: Lock::Online,
                    run: Run::InTransaction,
                    older_relays_run: false,
                },
                Step {
                    version: 2,
                    summary: "WAL capture: the publication's version each slot adopted at, so a \
                          change made while no relay ran is seen at the next start",
                    statements: vec![format!(
                        "ALTER TABLE {} ADD COLUMN IF NOT EXISTS publication_version text NULL;",
                        self.adopted.quoted()
                    )],
                    lock: Lock::Online,
                    run: Run::InTransaction,
                    // An earlier relay records adoptions without it, which this one completes.
                    older_relays_run: true,
                },
                Step {
                    version: 3,
                    summary: "WAL capture: the parked table's index of the keys still waiting, \
                          so that settling parked rows does not read the whole table to learn \
                          which keys flow again (an adopted backlog made each settle a scan)",
                    statements: vec![format!(
                        "CREATE INDEX CONCURRENTLY IF NOT EXISTS \"{name}\" ON {parked} (({key_hash}))
    WHERE delivered_at IS NULL;",
                        name = self.parked_keys_index_name(),
                        parked = self.parked.quoted(),
                        key_hash = outbox_store_postgres::Tables::ORDERING_KEY_HASH,
                    )],
                    lock: Lock::Online,
                    run: Run::Alone,
                    // An index an earlier relay does not use.
                    older_relays_run: true,
                },
                Step {
                    version: 4,
                    summary: "WAL capture: the position each slot may be confirmed up to, raised \
                          before the relay confirms past it, so that a slot made again or \
                          advanced by hand is told at once and its table adopted again",
                    statements: vec![self.marks_ddl()],
                    lock: Lock::Online,
                    run: Run::InTransaction,
                    // An earlier relay confirms past the marks: the next session of this one
                    // takes the slot for moved, and adopts the rows still in the table again.
                    older_relays_run: true,
                },
            ],
        )
    }

    /// The marks table (wal step 4).
    fn marks_ddl(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} (
    slot  text PRIMARY KEY,
    up_to pg_lsn NOT NULL
);",
            self.marks.quoted()
        )
    }

    /// The parked table's index of waiting keys (wal step 3), its name within the schema.
    fn parked_keys_index_name(&self) -> String {
        format!("{}_keys_idx", self.parked.name)
    }

    /// The indexes the steps build with `CREATE INDEX CONCURRENTLY` (quoted,
    /// schema-qualified): `migrate` drops one an interrupted build left invalid before
    /// building it again.
    pub fn concurrent_indexes(&self) -> Vec<String> {
        vec![self.parked.sibling("_keys_idx")]
    }

    /// What `migrate --capture wal` adds to the outbox's DDL. Idempotent.
    pub fn ddl(&self) -> String {
        let outbox = self.outbox.quoted();
        let parked = self.parked.quoted();
        format!(
            r#"
-- WAL capture (`--capture wal`): the publication the relay's replication slot reads.
{publication}

-- Events that wait (retry backoff, a scheduled available_at, later events of a waiting key),
-- parked outside the publication so the slot never waits for one key. LIKE copies the columns,
-- the sequence default (parked rows draw their ids in parking order) and the indexes the
-- claim uses; no trigger.
CREATE TABLE IF NOT EXISTS {parked} (LIKE {outbox} INCLUDING DEFAULTS INCLUDING INDEXES);

-- The slots whose first session moved the rows that predate them to the parked table (the
-- slot's stream does not carry those): recorded in the same transaction as the move, so it
-- happens once per slot, whichever relay streams first, and again after a crash mid-way.
CREATE TABLE IF NOT EXISTS {adopted} (
    slot        text PRIMARY KEY,
    adopted_at  timestamptz NOT NULL DEFAULT now(),
    -- The publication's version at the adoption: a change since is seen at the next start.
    publication_version text NULL
);
-- The emit function refuses events while none of these slots streams, in the writer's rights.
GRANT SELECT ON {adopted} TO PUBLIC;

-- Per slot, the position no relay confirms it past before raising this mark: a slot confirmed
-- past it was moved by something else (made again or advanced by hand), and adopts again.
{marks}

-- Table-less events: SELECT {function}('orders', 'order-42', 'OrderPlaced', '{{"id": 42}}');
{emit}
{shared_ids}"#,
            publication = match self.is_mapped() {
                // The native outbox too: `dead retry` and `send` write there.
                true => publication_of(&self.publication, &[&self.source.name, &self.outbox]),
                false => publication_ddl(&self.publication, &self.source.name),
            },
            shared_ids = self.shared_ids_ddl(),
            adopted = self.adopted.quoted(),
            marks = self.marks_ddl(),
            function = emit_function(&self.outbox),
            emit = emit_function_ddl(&self.outbox),
        )
    }

    /// Whether a mapped table is captured (beside the native outbox).
    pub fn is_mapped(&self) -> bool {
        self.source.name != self.outbox
    }

    /// The tables whose INSERTs the publication must carry: the source, and beside a mapped
    /// one the native outbox (`dead retry` and `send` write there).
    pub fn captured(&self) -> Vec<&TableName> {
        match self.is_mapped() {
            true => vec![&self.source.name, &self.outbox],
            false => vec![&self.source.name],
        }
    }

    /// The source's row id sequence, by the name `bigserial` gives it.
    fn source_sequence(&self) -> TableName {
        TableName {
            schema: self.source.name.schema.clone(),
            name: Ident::new(
                &format!(
                    "{}_{}_seq",
                    self.source.name.name, self.source.columns.sequence_id
                ),
                "sequence name",
            )
            .unwrap_or_else(|_| self.source.name.name.clone()),
        }
    }

    /// A mapped table's events are held, parked and dead-lettered by its row ids: the
    /// native outbox and the parked table draw theirs from the same sequence, so no two
    /// events anywhere share one. The native outbox's parked table draws from the outbox's
    /// sequence too (`LIKE … INCLUDING DEFAULTS`): an outbox dropped and made again took
    /// the parked table's default with it (CASCADE), every adoption then failed on a NULL
    /// id, and capture stalled for good while `check` said ok. Every `migrate` restores it.
    fn shared_ids_ddl(&self) -> String {
        let source = self.source.name.quoted().replace('\'', "''");
        let column = self.source.columns.sequence_id.replace('\'', "''");
        format!(
            r#"
-- The captured table's row ids are the events' ids: the relay's own tables draw from its sequence.
DO $outbox_ids$
DECLARE
    ids text := pg_get_serial_sequence('{source}', '{column}');
BEGIN
    IF ids IS NULL THEN
        RAISE EXCEPTION 'the column {column} of {source} has no sequence of its own: WAL capture of this table needs it to be a bigserial';
    END IF;
    -- Only where the default differs: the ALTER takes the table's ACCESS EXCLUSIVE lock,
    -- which every migrate waited for behind any reader (pg_dump, a report).
{native_outbox}    IF NOT EXISTS (SELECT 1 FROM pg_attrdef d JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
                    WHERE d.adrelid = '{parked_literal}'::regclass AND a.attname = 'sequence_id'
                      AND pg_get_expr(d.adbin, d.adrelid) = format('nextval(%L::regclass)', ids::regclass::text)) THEN
        EXECUTE format('ALTER TABLE {parked} ALTER COLUMN sequence_id SET DEFAULT nextval(%L::regclass)', ids);
    END IF;
END
$outbox_ids$;
"#,
            native_outbox = match self.is_mapped() {
                true => format!(
                    r#"    IF NOT EXISTS (SELECT 1 FROM pg_attrdef d JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
                    WHERE d.adrelid = '{outbox_literal}'::regclass AND a.attname = 'sequence_id'
                      AND pg_get_expr(d.adbin, d.adrelid) = format('nextval(%L::regclass)', ids::regclass::text)) THEN
        EXECUTE format('ALTER TABLE {outbox} ALTER COLUMN sequence_id SET DEFAULT nextval(%L::regclass)', ids);
    END IF;
"#,
                    outbox_literal = self.outbox.quoted().replace('\'', "''"),
                    outbox = self.outbox.quoted(),
                ),
                false => String::new(),
            },
            parked_literal = self.parked.quoted().replace('\'', "''"),
            parked = self.parked.quoted(),
        )
    }

    /// Grants the relay's role needs for WAL capture, and what the server needs, as SQL
    /// comments where an administrator must act.
    pub fn grants(&self, role: &str) -> String {
        let role = format!("\"{}\"", role.replace('"', "\"\""));
        let parked = self.parked.quoted();
        let outbox = self.source.name.quoted();
        let source_sequence = match self.is_mapped() {
            true => format!(
                "\nGRANT USAGE ON SEQUENCE {} TO {role};\n\
                 -- Adopting the rows the table holds when the slot is created checks their JSON\n\
                 -- with a function made for that session (in pg_temp): the role needs TEMPORARY\n\
                 -- on the database, which PUBLIC has unless it was revoked:\n\
                 --   GRANT TEMPORARY ON DATABASE <this database> TO {role};",
                self.source_sequence().quoted()
            ),
            false => String::new(),
        };
        format!(
            r#"
-- WAL capture needs, besides the grants above:
GRANT SELECT, INSERT, UPDATE, DELETE ON {parked} TO {role};
GRANT SELECT, INSERT, DELETE ON {adopted} TO {role};
GRANT SELECT, INSERT, UPDATE ON {marks} TO {role};
GRANT USAGE ON SEQUENCE {sequence} TO {role};
GRANT DELETE ON {outbox} TO {role};{source_sequence}
-- The role must be allowed to replicate (a superuser runs this once):
--   ALTER ROLE {role} REPLICATION;
-- and pg_hba.conf must let it connect to this database (a `host` line for the database, as
-- for any client; logical replication does not use the `replication` pseudo-database).
-- The server needs (postgresql.conf, then a restart):
--   wal_level = logical
--   max_replication_slots >= 1 per relay deployment (default 10)
--   max_wal_senders >= 1 per running relay (default 10)
--   max_slot_wal_keep_size = '10GB'   -- or another bound: a relay that stays off then
--                                       loses its slot instead of filling the disk
-- Table-less events need only EXECUTE on {function} for the writers.
"#,
            sequence = self.outbox.sibling("_sequence_id_seq"),
            adopted = self.adopted.quoted(),
            marks = self.marks.quoted(),
            function = emit_function(&self.outbox),
        )
    }
}

impl CaptureStatements {
    /// The slot: active, wal_status, retained bytes, lag bytes (NULL when the server is a
    /// standby), plugin, whether in this database, its catalog_xmin's age in transactions.
    /// `$1` slot name.
    pub fn slot_query() -> &'static str {
        "SELECT active, wal_status,
                CASE WHEN pg_is_in_recovery() THEN NULL
                     ELSE pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::int8 END,
                CASE WHEN pg_is_in_recovery() THEN NULL
                     ELSE pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::int8 END,
                plugin, database IS NOT DISTINCT FROM current_database(),
                age(catalog_xmin)::int8,
                -- PostgreSQL 14+ (read by name: older servers have no such column).
                coalesce((to_jsonb(s) ->> 'two_phase')::bool, false)
           FROM pg_catalog.pg_replication_slots s WHERE slot_name = $1"
    }
}

/// Every statement WAL capture runs, built once.
#[derive(Clone, Debug)]
pub struct CaptureStatements {
    /// Parks events (in order; an event already parked is skipped by its event id):
    /// `$1` event ids, `$2` destinations, `$3` keys, `$4` types, `$5` payloads (JSON text),
    /// `$6` headers (JSON text), `$7` mutation ids, `$8` rejected, `$9` created_at, `$10`
    /// delays (ms), `$11` not-before times, `$12` attempts, `$13` last errors.
    /// And the delete of the parked events' rows (`$14` their ids, `$15` their
    /// transactions' ids), in one statement returning one row: the row ids it did not
    /// delete whose transactions are not visible yet (`not_visible_yet`), and the event
    /// ids whose park the conflict skipped (parked, or adopted, before).
    pub park_and_delete: String,
    /// Writes dead letters from decoded events. `$1` sequence ids, then as the parks without
    /// the times: `$2`..`$9`, `$10` created_at, `$11` attempts, `$12` errors.
    pub dead_letter: String,
    /// Deletes delivered, parked or dead-lettered rows of the outbox (`$1` sequence ids,
    /// `$2` their transactions' ids), returning one row: the array of the ids in `$1` it
    /// did not delete whose transactions are not visible yet (`not_visible_yet`).
    pub delete_delivered: String,
    /// Moves every pending row of the outbox table into the parked table, in its order,
    /// under new ids (after every row parked before): run when the slot is created, since
    /// rows committed before it (written while no slot existed, or by an earlier polling
    /// relay) are not in its stream. Rows committed after it are in both places: the
    /// stream's copy is parked behind its parked copy, whose event id's conflict settles it
    /// (`AdoptedCopies`), or delivered twice past `AdoptedCopies::MOST`, never lost.
    pub adopt: Adoption,
    /// Whether the slot `$1` has adopted the table's rows: its adoption is recorded, and
    /// none of the first 1,000 rows the adoption would move is [`stranded`](Self::stranded)
    /// (a slot dropped and made again by hand keeps its name, and so its predecessor's
    /// record).
    pub adopted: String,
    /// How many of the first 1,000 rows (of each table, in its order) the adoption would
    /// move (`$1` the slot) were inserted by transactions older than the slot's
    /// `catalog_xmin`: they ended before a position the slot has passed, so its stream will
    /// never bring them. The slot's stream settles every row it brings (deleted, parked or
    /// dead-lettered) before it confirms past it, so such a row is one its adoption never
    /// moved. Complete only as far as `catalog_xmin` has come: it trails the slot's
    /// position, and a slot made while another held the server's horizon back starts with
    /// that one's.
    pub stranded: String,
    /// The slot `$1`'s `catalog_xmin`, as text (no row: no such slot):
    /// [`stranded`](Self::stranded) can change only when it does.
    pub slot_catalog_xmin: String,
    /// The slot `$1`'s mark, a WAL position as an integer. No row: no mark yet (a slot no
    /// relay of this version confirmed).
    pub slot_mark: String,
    /// The slot `$1`'s confirmed position, as an integer. Read before its mark: the mark
    /// only rises, so a raise and a confirmation between the two reads cannot make the slot
    /// look past it.
    pub slot_confirmed: String,
    /// Raises the slot `$1`'s mark to `$2` (a WAL position as text), never lowering it, and
    /// returns it: written, durably and under the slot's writes' guard, before the relay
    /// confirms past the mark it had. So no relay confirms a slot past its mark, and a slot
    /// confirmed past it was moved by something else.
    pub raise_mark: String,
    /// Which of the privileges the marks table (`$1`, as text) needs the current role
    /// lacks, one row each (`has_table_privilege` with a list answers for any of them).
    pub marks_privileges: String,
    /// The publication's version (`$1` the slot) its adoption recorded: a change since, made
    /// while no relay ran, left rows out of the stream all the same.
    pub adopted_publication_version: String,
    /// Records that the slot `$1` adopted them, at the publication's version `$2`: a step of
    /// the adoption's transaction, after [`forget_adoption`](Self::forget_adoption): a record
    /// a slot's predecessor left (see [`stranded`](Self::stranded)) is replaced, so that its
    /// `xmin` is this adoption's (a delete and an insert: the role has no UPDATE on it).
    pub record_adoption: String,
    /// The event ids the slot `$1`'s adoption moved that are still in the parked table, as
    /// it wrote them: its rows there whose `xmin` is the record's (a retry or a mark is an
    /// update, which leaves the row out). At most `$2` of them, and
    /// the server's WAL position now, past the commit of every transaction whose rows the
    /// adoption saw: the stream's copies of those events come before it.
    pub adopted_copies: String,

    /// Forgets the slot `$1`'s adoption (its slot was dropped: a new one must adopt again).
    pub forget_adoption: String,
    /// Forgets the slot's adoption only while no slot of its name exists: a record left by
    /// a slot dropped since (or copied to a promoted standby) must not stand for the slot
    /// the session is about to create. Conditional, so that a relay racing another's
    /// creation never forgets the adoption of the slot it finds made.
    pub forget_adoption_of_missing_slot: String,
    /// A row while the slot `$1` streams to the session named `$2` (its
    /// `application_name`, unique per session): the guard of every write a session's events
    /// make, so a relay that lost the slot (paused past its session's end, while another
    /// took over) writes nothing for events the new holder is sent again.
    pub owns_slot: String,
    /// Runs before [`owns_slot`](Self::owns_slot) in the same transaction: holds the slot
    /// `$1`'s writes (a shared lock, to the transaction's end) so that a session taking the
    /// slot over ([`take_slot_writes`](Self::take_slot_writes)) waits for a write that passed
    /// the guard to commit or roll back, and a write after it sees the new holder. A writer
    /// paused mid-transaction is ended by the server after 10 s idle.
    pub hold_slot_writes: String,
    /// Waits for every write [`hold_slot_writes`](Self::hold_slot_writes) holds on the slot
    /// `$1` (up to 20 s, within the store's 30 s for one operation), to the transaction's end: a new session reads the parked keys
    /// under it, so a park an earlier holder committed late is among them.
    pub take_slot_writes: String,
    /// Whether schema `$1` has an earlier version's `outbox_emit` and no `outbox` table (so
    /// the function was another outbox's).
    pub legacy_emit: String,
    /// The overloads of `pg_logical_emit_message` that PUBLIC may execute.
    pub public_emit: String,
    /// The body of the function `$1` (a signature), if it exists.
    pub function_body: String,
    /// The oldest transactions with an id (what making a slot waits for), and the prepared
    /// ones, each described in a line.
    pub running_transactions: String,
    /// The keys that have parked events, each with the text size of its largest row.
    pub parked_keys: String,
    /// Which of `$1` still have parked events.
    pub still_parked: String,
    /// A non-transactional outbox message, whose position marks "everything committed up
    /// to now" (`run --drain`): returns its LSN as text.
    pub drain_marker: String,
    /// The server's `wal_level`.
    pub wal_level: String,
    /// What the publication `$1` publishes of the table `$2`.`$3`: whether INSERTs, its row
    /// filter, and the table's columns it leaves out. No row: it does not cover the table.
    pub publication: String,
    /// Whether the publication `$1` exists.
    pub publication_exists: String,
    /// Whether the publication `$1` was made by a transaction newer than the slot `$2`'s
    /// `catalog_xmin`, while no session streams from the slot and it is not a failover slot
    /// (PostgreSQL 17's column, read by name so older servers need none): decoding from the
    /// slot may then read the publication as it was before it existed.
    pub publication_newer_than_slot: String,
    /// Decodes the slot `$2`'s stream with the publication `$1` up to its first change,
    /// without moving the slot: fails as a session would ("publication … does not exist").
    pub peek_slot: String,
    /// The publication `$1`'s catalog rows (its own, the captured tables' and its schemas'),
    /// each by id and row version (`xmin`): an `ALTER PUBLICATION` of what the relay reads
    /// moves one of them, even if a later one undoes what it changed. `NULL` when the
    /// publication does not exist.
    pub publication_version: String,
    /// Whether the current role may replicate, and its name.
    pub replication_role: String,
    /// Replication slots taken and allowed, WAL senders busy and allowed: a slot the first
    /// run must create, and a session it must start, each need one free.
    pub replication_capacity: String,
    /// The slots of this database other than `$1` that streamed this outbox (recorded in its
    /// adoption or confirm-mark table), still exist, and were not confirmed past this
    /// outbox's mark for them since: each by name, whether a session streams from it, the
    /// WAL it holds (bytes from its restart position), and its session's `application_name`.
    pub other_slots: String,
    /// The `application_name` of the session the slot `$1` streams to, if any.
    pub slot_holder: String,
}

impl CaptureStatements {
    pub fn new(tables: &CaptureTables) -> Self {
        let parked = tables.parked.quoted();
        let dl = tables.dead_letters.quoted();
        let key = "coalesce(partition_key, destination)";
        let marker = String::from_utf8_lossy(DRAIN_MARKER);
        CaptureStatements {
            park_and_delete: format!(
                "{deletes}, parked AS ({park} RETURNING event_id)
                 SELECT {undeleted},
                        ARRAY(SELECT e FROM unnest($1::uuid[]) AS e
                              EXCEPT SELECT event_id FROM parked)",
                deletes = deletes_with(tables, "$14"),
                park = park_insert(&parked),
                undeleted = not_visible_yet("$14", "$15"),
            ),
            // A dead letter already there under the same id is this event's (written by a
            // try whose answer was lost, or by an earlier session): left as it is. One of
            // another event (an older dead letter, from before the outbox's ids were reset)
            // keeps its id, and this one takes a new one, negative and below every dead
            // letter's and the batch's (the batch's own are inserted after, unseen by this
            // statement's snapshot), saying so in its error: skipped, the event was lost with
            // its outbox row.
            dead_letter: format!(
                "WITH u AS (
                     SELECT * FROM unnest($1::int8[], $2::uuid[], $3::text[], $4::text[], $5::text[],
                                          $6::text[], $7::text[], $8::text[], $9::bool[],
                                          $10::timestamptz[], $11::int4[], $12::text[])
                                   AS u(s, e, d, k, t, p, h, m, r, c, n, err)),
                 taken AS (
                     SELECT u.s FROM u JOIN {dl} x ON x.sequence_id = u.s AND x.event_id <> u.e
                      -- Moved by a try whose answer was lost: there already.
                      WHERE NOT EXISTS (SELECT 1 FROM {dl} y
                                         WHERE y.sequence_id < 0 AND y.event_id = u.e)),
                 kept AS (
                     INSERT INTO {dl} ({dead_columns})
                     SELECT s, e, d, k, t, p::jsonb, h::jsonb, m, r, c, n, err FROM u
                      WHERE u.s NOT IN (SELECT s FROM taken)
                     ON CONFLICT (sequence_id) DO NOTHING)
                 INSERT INTO {dl} ({dead_columns})
                 SELECT least((SELECT min(sequence_id) FROM {dl}), (SELECT min(s) FROM u), 0)
                          - row_number() OVER (ORDER BY u.s),
                        e, d, k, t, p::jsonb, h::jsonb, m, r, c, n,
                        err || format(' (dead-lettered under a new id: %s is an older dead letter''s, \
                                       of another event)', u.s)
                   FROM u WHERE u.s IN (SELECT s FROM taken)",
                dead_columns = "sequence_id, event_id, destination, partition_key, event_type, \
                                payload, headers, mutation_id, rejected, created_at, attempts, \
                                last_error",
            ),
            // The ids left undeleted, as one array (nearly always empty): returning every
            // deleted id was a row per event for the client to decode.
            delete_delivered: format!("{} SELECT {}", deletes(tables), not_visible_yet("$1", "$2")),
            adopt: adopt(tables),
            legacy_emit: "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_proc p
                                   JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
                                  WHERE n.nspname = $1 AND p.proname = 'outbox_emit')
                              AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_class c
                                   JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
                                  WHERE n.nspname = $1 AND c.relname = 'outbox')"
                .into(),
            public_emit: "SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p
                           WHERE p.proname = 'pg_logical_emit_message'
                             AND p.pronamespace = 'pg_catalog'::regnamespace
                             AND EXISTS (
                                 SELECT 1 FROM aclexplode(coalesce(p.proacl,
                                                 acldefault('f', p.proowner))) a
                                  WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE')
                           ORDER BY 1"
                .into(),
            running_transactions: "(SELECT format('pid %s (%s, database %s) since %s', pid,
                                       coalesce(nullif(application_name, ''), usename::text, '?'),
                                       coalesce(datname, '?'),
                                       coalesce(xact_start::text, '?'))
                                  FROM pg_catalog.pg_stat_activity
                                 WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()
                                 ORDER BY xact_start NULLS LAST LIMIT 3)
                                UNION ALL
                                (SELECT format('prepared transaction %L since %s', gid, prepared)
                                  FROM pg_catalog.pg_prepared_xacts ORDER BY prepared LIMIT 3)"
                .into(),
            function_body: "SELECT p.prosrc FROM pg_catalog.pg_proc p
                             WHERE p.oid = pg_catalog.to_regprocedure($1)"
                .into(),
            hold_slot_writes:
                "SELECT set_config('idle_in_transaction_session_timeout', '10s', true),
                                      pg_advisory_xact_lock_shared(
                                          hashtext('outbox-relay slot writes ' || $1))::text"
                    .into(),
            take_slot_writes: "SELECT set_config('lock_timeout', '20s', true),
                                      pg_advisory_xact_lock(
                                          hashtext('outbox-relay slot writes ' || $1))::text"
                .into(),
            owns_slot: "SELECT 1 FROM pg_catalog.pg_replication_slots s
                          JOIN pg_catalog.pg_stat_activity a ON a.pid = s.active_pid
                         WHERE s.slot_name = $1 AND a.application_name = $2"
                .into(),
            // CASE, so that the table is scanned only when an adoption is recorded.
            adopted: format!(
                "SELECT CASE WHEN EXISTS (SELECT 1 FROM {adopted} WHERE slot = $1)
                             THEN NOT EXISTS ({stranded})
                             ELSE false END",
                adopted = tables.adopted.quoted(),
                stranded = stranded_rows(tables),
            ),
            stranded: format!(
                "SELECT count(*)::int8 FROM ({}) AS s",
                stranded_rows(tables)
            ),
            slot_catalog_xmin: "SELECT catalog_xmin::text FROM pg_catalog.pg_replication_slots
                                 WHERE slot_name = $1"
                .into(),
            slot_mark: format!(
                "SELECT (up_to - '0/0'::pg_lsn)::int8 FROM {} WHERE slot = $1",
                tables.marks.quoted()
            ),
            slot_confirmed: "SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::int8
                               FROM pg_catalog.pg_replication_slots WHERE slot_name = $1"
                .into(),
            marks_privileges:
                "SELECT p || ' on it lacking' FROM unnest(ARRAY['SELECT', 'INSERT', 'UPDATE']) AS p
                                 WHERE NOT has_table_privilege(current_user, $1::text, p)"
                    .into(),
            raise_mark: format!(
                "INSERT INTO {marks} AS m (slot, up_to) VALUES ($1, $2::text::pg_lsn)
                 ON CONFLICT (slot) DO UPDATE SET up_to = greatest(m.up_to, excluded.up_to)
                 RETURNING (up_to - '0/0'::pg_lsn)::int8",
                marks = tables.marks.quoted()
            ),
            adopted_publication_version: format!(
                "SELECT publication_version FROM {} WHERE slot = $1",
                tables.adopted.quoted()
            ),
            record_adoption: format!(
                "INSERT INTO {} (slot, publication_version) VALUES ($1, $2)",
                tables.adopted.quoted()
            ),

            // Rows keep the inserting transaction's id as `xmin` until they are updated (a
            // retry): such a row is left out, and its stream copy may go out twice, as
            // before. Read on the primary, where the slot is.
            adopted_copies: format!(
                "SELECT ARRAY(SELECT p.event_id FROM {parked} p JOIN {adopted} a ON p.xmin = a.xmin
                               WHERE a.slot = $1 LIMIT $2),
                        (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::int8",
                adopted = tables.adopted.quoted()
            ),
            forget_adoption: format!("DELETE FROM {} WHERE slot = $1", tables.adopted.quoted()),
            forget_adoption_of_missing_slot: format!(
                "DELETE FROM {} WHERE slot = $1 AND NOT EXISTS
                   (SELECT FROM pg_catalog.pg_replication_slots WHERE slot_name = $1)
                 RETURNING slot, (SELECT up_to::text FROM {} WHERE slot = $1)",
                tables.adopted.quoted(),
                tables.marks.quoted()
            ),
            // With each key the text size of its largest row (the whole row's, an upper
            // bound of what it costs in memory): parked claims are sized by it.
            parked_keys: format!(
                "SELECT {key}, max(octet_length(p::text))::int8 FROM {parked} p
                  WHERE delivered_at IS NULL GROUP BY 1"
            ),
            // One probe of the index of waiting keys (wal step 3) per key, which stops at its
            // first row: by the key's hash, then the key itself, so colliding keys are told
            // apart. A key of an adopted backlog can have thousands of rows.
            still_parked: format!(
                "SELECT DISTINCT k FROM unnest($1::text[]) AS k,
                        LATERAL (SELECT FROM {parked}
                                  WHERE delivered_at IS NULL
                                    AND {key_hash} = hashtextextended(k, 0) AND {key} = k
                                  LIMIT 1) AS waiting",
                key_hash = outbox_store_postgres::Tables::ORDERING_KEY_HASH,
            ),
            drain_marker: format!(
                "SELECT pg_logical_emit_message(false, '{prefix}', '{marker}')::text",
                prefix = emit_prefix(&tables.outbox).replace('\'', "''")
            ),
            wal_level: "SELECT current_setting('wal_level')".into(),
            publication: "SELECT p.pubinsert, pt.rowfilter,
                        ARRAY(SELECT a.attname::text FROM pg_catalog.pg_attribute a
                               WHERE a.attrelid = c.oid AND a.attnum > 0
                                 AND NOT a.attisdropped AND a.attgenerated = ''
                                 AND a.attname <> ALL (pt.attnames)
                               ORDER BY a.attnum),
                        array_to_string(ARRAY['insert',
                            CASE WHEN p.pubupdate THEN 'update' END,
                            CASE WHEN p.pubdelete THEN 'delete' END,
                            CASE WHEN p.pubtruncate THEN 'truncate' END], ', ')
                   FROM pg_catalog.pg_publication p
                   JOIN pg_catalog.pg_publication_tables pt ON pt.pubname = p.pubname
                   JOIN pg_catalog.pg_namespace n ON n.nspname = pt.schemaname
                   JOIN pg_catalog.pg_class c
                     ON c.relnamespace = n.oid AND c.relname = pt.tablename
                  WHERE p.pubname = $1 AND pt.schemaname = $2 AND pt.tablename = $3"
                .into(),
            publication_version: format!(
                "SELECT p.oid::text || '.' || p.xmin::text || ':' ||
                        coalesce((SELECT string_agg(r.oid::text || '.' || r.xmin::text, ','
                                                    ORDER BY r.oid)
                                    FROM pg_catalog.pg_publication_rel r
                                   WHERE r.prpubid = p.oid
                                     AND r.prrelid IN ({captured})), '') || ':' ||
                        coalesce((SELECT string_agg(n.oid::text || '.' || n.xmin::text, ','
                                                    ORDER BY n.oid)
                                    FROM pg_catalog.pg_publication_namespace n
                                   WHERE n.pnpubid = p.oid
                                     AND n.pnnspid IN (SELECT c.relnamespace
                                                         FROM pg_catalog.pg_class c
                                                        WHERE c.oid IN ({captured}))), '')
                   FROM pg_catalog.pg_publication p WHERE p.pubname = $1",
                captured = tables
                    .captured()
                    .iter()
                    .map(|table| format!("to_regclass('{}')", table.quoted().replace('\'', "''")))
                    .collect::<Vec<_>>()
                    .join(", "),
            ),
            publication_exists: "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_publication
                                              WHERE pubname = $1)"
                .into(),
            publication_newer_than_slot: "SELECT EXISTS (
                   SELECT FROM pg_catalog.pg_publication p, pg_catalog.pg_replication_slots s
                    WHERE p.pubname = $1 AND s.slot_name = $2 AND NOT s.active
                      AND NOT coalesce((to_jsonb(s) ->> 'failover')::boolean, false)
                      AND s.catalog_xmin IS NOT NULL AND age(p.xmin) < age(s.catalog_xmin))"
                .into(),
            peek_slot: "SELECT count(*) FROM pg_catalog.pg_logical_slot_peek_binary_changes(
                          $2, NULL, 1, 'proto_version', '1', 'publication_names', $1)"
                .into(),
            replication_role: "SELECT rolreplication OR rolsuper, current_user::text
                                 FROM pg_catalog.pg_roles WHERE rolname = current_user"
                .into(),
            slot_holder: "SELECT a.application_name::text
                            FROM pg_catalog.pg_replication_slots s
                            JOIN pg_catalog.pg_stat_activity a ON a.pid = s.active_pid
                           WHERE s.slot_name = $1"
                .into(),
            // A slot confirmed past the mark this outbox keeps for it streams another's now
            // (a name used again): left out.
            other_slots: format!(
                "SELECT s.slot_name::text, s.active,
                        coalesce(pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_lsn(),
                                                            s.restart_lsn), 0)::int8,
                        a.application_name::text
                   FROM pg_catalog.pg_replication_slots s
                   LEFT JOIN {marks} m ON m.slot = s.slot_name
                   LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = s.active_pid
                  WHERE s.slot_name <> $1 AND s.database = pg_catalog.current_database()
                    AND s.slot_name IN (SELECT slot FROM {adopted} UNION SELECT slot FROM {marks})
                    AND (m.up_to IS NULL OR s.confirmed_flush_lsn IS NULL
                         OR s.confirmed_flush_lsn <= m.up_to)
                  ORDER BY 1",
                adopted = tables.adopted.quoted(),
                marks = tables.marks.quoted()
            ),
            replication_capacity: "SELECT (SELECT count(*) FROM pg_catalog.pg_replication_slots),
                                          current_setting('max_replication_slots')::int8,
                                          (SELECT count(*) FROM pg_catalog.pg_stat_replication),
                                          current_setting('max_wal_senders')::int8"
                .into(),
        }
    }
}

/// A `WITH` clause deleting the rows of ids `$1` from the captured tables, as `deleted(id)`.
fn deletes(tables: &CaptureTables) -> String {
    deletes_with(tables, "$1")
}

/// [`deletes`] of the row ids in parameter `param`.
fn deletes_with(tables: &CaptureTables, param: &str) -> String {
    let source = tables.source.name.quoted();
    let row_id = quote(&tables.source.columns.sequence_id);
    let mut with = format!(
        "WITH deleted AS (DELETE FROM {source} WHERE {row_id} = ANY({param}) RETURNING {row_id} AS id)"
    );
    if tables.is_mapped() {
        with = format!(
            "WITH from_source AS (DELETE FROM {source} WHERE {row_id} = ANY({param}) RETURNING {row_id} AS id),
                  from_outbox AS (DELETE FROM {outbox} WHERE sequence_id = ANY({param}) RETURNING sequence_id AS id),
                  deleted AS (SELECT id FROM from_source UNION ALL SELECT id FROM from_outbox)",
            outbox = tables.outbox.quoted()
        );
    }
    with
}

/// An array of the row ids in parameter `ids` that the CTE `deleted` did not delete and whose
/// transactions (their ids, 32 bits, in parameter `xids`) the statement's snapshot does not
/// see yet. The stream carries a transaction once its commit is in the WAL, a moment before
/// other sessions see its rows (longer while the commit waits on a synchronous standby):
/// such a row is to be deleted later. A row missing although its transaction is visible was
/// deleted already: adopted into the parked table, or its event sent again after a
/// reconnect. The 32-bit ids are widened to the 64-bit id nearest the snapshot's `xmax`
/// (as PostgreSQL compares them, modulo 2^32): a transaction of the stream is far less than
/// 2^31 ids either side of it, since the slot's `catalog_xmin` holds the server's freezing
/// back, and the server stops taking new ids before that distance.
fn not_visible_yet(ids: &str, xids: &str) -> String {
    format!(
        "ARRAY(SELECT u.id
                 FROM unnest({ids}::int8[], {xids}::int8[]) AS u(id, xid),
                      pg_catalog.pg_current_snapshot() AS snap,
                      LATERAL (SELECT pg_catalog.pg_snapshot_xmax(snap)::text::int8 AS xmax) m,
                      LATERAL (SELECT m.xmax + (u.xid - m.xmax % 4294967296 + 6442450944)
                                                % 4294967296 - 2147483648 AS xid) g
                WHERE u.id NOT IN (SELECT id FROM deleted)
                  AND NOT pg_catalog.pg_visible_in_snapshot(greatest(g.xid, 0)::text::xid8, snap))"
    )
}

/// Writes events to the parked table (see [`CaptureStatements::park_and_delete`]).
fn park_insert(parked: &str) -> String {
    format!(
        "INSERT INTO {parked} (event_id, destination, partition_key, event_type, payload,
                        headers, mutation_id, rejected, created_at, available_at, attempts,
                        last_error)
                 SELECT e, d, k, t, p::jsonb, h::jsonb, m, r, c,
                        greatest(now() + w * interval '1 millisecond', coalesce(a, '-infinity')),
                        n, err
                   FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[],
                               $6::text[], $7::text[], $8::bool[], $9::timestamptz[],
                               $10::int8[], $11::timestamptz[], $12::int4[], $13::text[])
                        WITH ORDINALITY AS u(e, d, k, t, p, h, m, r, c, w, a, n, err, i)
                  ORDER BY i
                 ON CONFLICT (event_id) DO NOTHING"
    )
}

/// The suffixes of WAL capture's tables beside the outbox: the parked table, the adoption
/// record and the confirm marks.
const SIBLING_SUFFIXES: [&str; 3] = ["_parked", "_adopted", "_confirm_marks"];

/// Whether WAL capture's tables beside `outbox` have names PostgreSQL takes (63 bytes):
/// an error naming the longest and the fix otherwise. Checked where the configuration is
/// read, before any of them is named.
pub fn sibling_names_fit(outbox: &TableName) -> Result<(), StoreError> {
    for suffix in SIBLING_SUFFIXES {
        let name = format!("{}{suffix}", outbox.name);
        if Ident::new(&name, "table name").is_err() {
            // The outbox's own name, or a mapped table's `<table>_relay`: said as what to cut.
            let longest = SIBLING_SUFFIXES.iter().map(|s| s.len()).max().unwrap_or(0);
            let over = (outbox.name.as_str().len() + longest).saturating_sub(63);
            return Err(StoreError::new(
                StoreErrorKind::Config,
                format!(
                    "WAL capture keeps a table named {name}, longer than PostgreSQL's 63 bytes: \
                     give the outbox table a name {over} characters shorter (--outbox-table)"
                ),
            ));
        }
    }
    Ok(())
}

/// The table `<outbox><suffix>` beside `outbox` (names checked by [`sibling_names_fit`]).
pub(crate) fn sibling(outbox: &TableName, suffix: &str) -> TableName {
    TableName {
        schema: outbox.schema.clone(),
        name: Ident::new(&format!("{}{suffix}", outbox.name), "table name")
            .unwrap_or_else(|_| outbox.name.clone()),
    }
}

fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// The rows the adoption would move ([`adopt`]) that the slot `$1`'s stream will never
/// bring: inserted by a transaction older than the slot's `catalog_xmin`, which ended
/// before a position the slot passed. `age`, not `<`: transaction ids wrap around.
///
/// Only the first 1,000 rows of each table in their order (through its index), so that no
/// check scans a large backlog. Stranded rows are a slot's predecessor's, written before it
/// was made, and so nearly always come first: they drew their ids before any row the slot
/// brings, unless a transaction that drew its ids earlier committed after the slot was made.
fn stranded_rows(tables: &CaptureTables) -> String {
    let limit = "LIMIT 1000";
    let native = |table: &TableName| {
        format!(
            "(SELECT xmin AS inserted_by FROM {} WHERE delivered_at IS NULL
               ORDER BY sequence_id {limit})",
            table.quoted()
        )
    };
    let adoptable = match tables.source.columns == ColumnNames::native() {
        true => native(&tables.source.name),
        false => format!(
            "(SELECT xmin AS inserted_by FROM {} ORDER BY {} {limit}) UNION ALL {}",
            tables.source.name.quoted(),
            quote(&tables.source.columns.sequence_id),
            native(&tables.outbox)
        ),
    };
    format!(
        "SELECT 1 FROM ({adoptable}) AS r, pg_catalog.pg_replication_slots AS s
          WHERE s.slot_name = $1 AND s.catalog_xmin IS NOT NULL
            AND age(r.inserted_by) > age(s.catalog_xmin)"
    )
}

/// The statements that adopt the rows that predate the slot, run in one transaction.
#[derive(Clone, Debug)]
pub struct Adoption {
    pub steps: Vec<String>,
    /// A mapped table's last statement, a query: it dead-letters the rows that do not
    /// decode, and returns `destination, count` of them. The native table's typed rows
    /// always decode.
    pub dead_letters: Option<String>,
}

/// Moves every pending row of the captured table into the parked table, in its rows'
/// order, under new ids drawn from the parked table's sequence as they are moved: parked
/// rows are claimed in id order, and a row of the same key parked before (an event
/// streamed, then retried) may have committed first yet drawn a later id than the row's
/// own, which was taken at its insert.
fn adopt(tables: &CaptureTables) -> Adoption {
    let parked = tables.parked.quoted();
    let source = tables.source.name.quoted();
    let c = &tables.source.columns;
    // A native table's rows, as they are, from the CTE `from`.
    let native_rows = |from: &str| {
        format!(
            "INSERT INTO {parked} (event_id, destination, partition_key,
                    event_type, payload, headers, mutation_id, rejected, created_at,
                    available_at, attempts, last_error)
             SELECT event_id, destination, partition_key, event_type, payload,
                    headers, mutation_id, rejected, created_at, available_at, attempts,
                    last_error
               FROM {from} ORDER BY sequence_id
             ON CONFLICT DO NOTHING"
        )
    };
    if *c == ColumnNames::native() {
        let moved = format!(
            "WITH moved AS (DELETE FROM {source} WHERE delivered_at IS NULL RETURNING *)
             {}",
            native_rows("moved")
        );
        return Adoption {
            steps: vec![moved],
            dead_letters: None,
        };
    }
    let or_null = |column: &Option<String>, cast: &str| match column {
        Some(column) => format!("{}::{cast}", quote(column)),
        None => "NULL".into(),
    };
    let mut headers = match &c.headers {
        Some(column) => format!("coalesce({}::jsonb, '{{}}'::jsonb)", quote(column)),
        None => "'{}'::jsonb".into(),
    };
    if let Some(name) = &c.event_id_header {
        headers = format!(
            "{headers} || jsonb_build_object('{}', {}::text)",
            name.replace('\'', "''"),
            quote(&c.event_id)
        );
    }
    let created_at = match (&c.created_at, c.utc_timestamps) {
        (Some(column), true) => format!("{} AT TIME ZONE 'utc'", quote(column)),
        (Some(column), false) => quote(column),
        (None, _) => "now()".into(),
    };
    // A mapped table's columns are the application's types: an id that is no UUID, a
    // payload that is no JSON (a text column), a NULL destination or type cannot be an
    // event. Such a row is moved to the dead letters with the reason, as the stream would,
    // instead of failing the statement and, with it, every other row.
    let (payload_text, payload_ok) = match &c.payload {
        Some(column) => (
            format!("{}::text", quote(column)),
            format!("({} IS NULL OR relay_payload IS NOT NULL)", quote(column)),
        ),
        None => ("NULL::text".into(), "true".into()),
    };
    let (event_id, destination, event_type) = (
        quote(&c.event_id),
        quote(&c.destination),
        quote(&c.event_type),
    );
    let decodable = format!(
        "relay_id IS NOT NULL AND {destination} IS NOT NULL AND {event_type} IS NOT NULL \
         AND {payload_ok}"
    );
    // The parked rows draw new ids, as the native form's do; the native outbox's rows
    // (`dead retry`, `send`) are moved as the native form moves them. It returns the rows
    // dead-lettered, by destination, for the metric.
    let moved = format!(
        "WITH deleted AS (DELETE FROM {source} RETURNING *),
              moved AS (
                SELECT d.*,
                       CASE WHEN {event_id}::text ~ '{UUID_TEXT}' THEN {event_id}::text::uuid
                       END AS relay_id,
                       pg_temp.outbox_relay_jsonb({payload_text}) AS relay_payload
                  FROM deleted d),
              moved_outbox AS (DELETE FROM {outbox} WHERE delivered_at IS NULL RETURNING *),
              adopted AS (
                INSERT INTO {parked} (event_id, destination, partition_key,
                       event_type, payload, headers, mutation_id, created_at)
                SELECT relay_id, {destination}::text, {key},
                       {event_type}::text, relay_payload, {headers}, {mutation}, {created_at}
                  FROM moved WHERE {decodable} ORDER BY {row_id}
                ON CONFLICT DO NOTHING RETURNING 1),
              native AS ({native} RETURNING 1),
              dead AS (
         INSERT INTO {dead} (sequence_id, event_id, destination, partition_key, event_type,
                payload, headers, mutation_id, created_at, attempts, last_error)
         SELECT {row_id}, coalesce(relay_id, gen_random_uuid()),
                coalesce({destination}::text, ''), {key}, coalesce({event_type}::text, ''),
                to_jsonb({payload_text}), '{{}}'::jsonb, {mutation}, {created_at}, 0,
                CASE WHEN relay_id IS NULL
                       THEN 'event_id is not a UUID: ' || coalesce(left({event_id}::text, 200), 'NULL')
                     WHEN {destination} IS NULL THEN 'destination is NULL'
                     WHEN {event_type} IS NULL THEN 'event_type is NULL'
                     ELSE 'payload is not valid JSON (kept here as a JSON string)'
                END
           FROM moved WHERE NOT ({decodable})
         ON CONFLICT DO NOTHING RETURNING destination)
         SELECT destination, count(*) FROM dead GROUP BY destination",
        outbox = tables.outbox.quoted(),
        dead = tables.dead_letters.quoted(),
        native = native_rows("moved_outbox"),
        key = or_null(&c.partition_key, "text"),
        mutation = or_null(&c.mutation_id, "text"),
        row_id = quote(&c.sequence_id),
    );
    // JSON can only be checked by casting; a cast that answers NULL instead of failing is
    // a function, made for this session only (PUBLIC's default TEMPORARY privilege), so
    // nothing is migrated for it.
    let tolerant_jsonb = "CREATE OR REPLACE FUNCTION pg_temp.outbox_relay_jsonb(value text)
           RETURNS jsonb LANGUAGE plpgsql IMMUTABLE AS $$
           BEGIN RETURN value::jsonb; EXCEPTION WHEN others THEN RETURN NULL; END $$"
        .to_string();
    Adoption {
        steps: vec![tolerant_jsonb],
        dead_letters: Some(moved),
    }
}

/// What PostgreSQL's uuid input accepts: 32 hex digits, a hyphen allowed after any group of
/// four, in optional braces.
const UUID_TEXT: &str = r"^\{?[0-9A-Fa-f]{4}(-?[0-9A-Fa-f]{4}){7}\}?$";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mapped_tables_grants_name_the_temporary_privilege_its_adoption_needs() {
        let table = |name: &str| TableName::new("public", name).unwrap();
        let publication = Ident::new("outbox_pub", "publication").unwrap();
        let native = CaptureTables::new(
            table("outbox"),
            table("outbox_dead_letters"),
            publication.clone(),
        );
        assert!(!native.grants("relay").contains("TEMPORARY"));
        let mapped = CaptureTables::with_source(
            SourceTable::native(table("outboxevent")),
            table("outbox"),
            table("outbox_dead_letters"),
            publication,
        );
        assert!(mapped
            .grants("relay")
            .contains(r#"GRANT TEMPORARY ON DATABASE <this database> TO "relay";"#));
    }

    #[test]
    fn the_publication_covers_the_outbox_inserts_only() {
        let ddl = publication_ddl(
            &Ident::new("outbox_pub", "publication").unwrap(),
            &TableName::new("app", "events").unwrap(),
        );
        assert!(ddl.contains(
            r#"CREATE PUBLICATION "outbox_pub" FOR TABLE "app"."events" WITH (publish = 'insert');"#
        ));
        assert!(ddl.contains("WHERE pubname = 'outbox_pub'"));
    }
}
