//! DDL, grants and statement texts, built from validated table names.

use outbox_core::ident::{Ident, TableName};
use outbox_core::migration::{Lock, Run, Step, Steps};
use outbox_core::store::DeadSelector;
use outbox_core::StoreError;

/// How long the oldest pending row has waited to go out, in ms: a row that failed since its
/// creation; one never tried since it became due, and not at all while it is scheduled for
/// later. From `created_at` alone, an event scheduled for tomorrow aged the backlog from its
/// insert, and the oldest-pending alert fired on it.
const WAITING_FOR_MS: &str = "(extract(epoch from now() - min(CASE
        WHEN attempts > 0 THEN created_at
        WHEN available_at <= now() THEN greatest(created_at, available_at)
    END) FILTER (WHERE isfinite(created_at))) * 1000)::int8";

/// The blocking index's name after the outbox's. It differs from the obsolete one right after
/// the table name, so that PostgreSQL's shortening of long names (63 bytes) cannot make them
/// one name.
const BLOCKING_INDEX_SUFFIX: &str = "_key_blockers_idx";
const OBSOLETE_BLOCKING_INDEX_SUFFIX: &str = "_blocking_idx";

/// The notification channel the trigger signals and the relay listens on.
pub const DEFAULT_NOTIFY_CHANNEL: &str = "outbox_relay";

/// The sessions holding locks the relay's own sessions (its role, its application name)
/// wait for. Another role's state and statement show only to a role with
/// pg_read_all_stats; its process id, user and application show to any.
pub const LOCK_HOLDERS: &str = "
SELECT DISTINCT holder.pid, holder.usename::text, holder.application_name, holder.state,
       extract(epoch FROM now() - holder.xact_start)::int8, left(holder.query, 200)
  FROM pg_stat_activity waiting
 CROSS JOIN LATERAL unnest(pg_blocking_pids(waiting.pid)) AS blocking(pid)
  JOIN pg_stat_activity holder ON holder.pid = blocking.pid
 WHERE waiting.usename = current_user
   AND waiting.application_name = current_setting('application_name')
   AND waiting.wait_event_type = 'Lock'
 ORDER BY 1";

/// The names of everything the relay owns in the database.
#[derive(Clone, Debug)]
pub struct Tables {
    pub outbox: TableName,
    pub dead_letters: TableName,
    pub nodes: TableName,
    /// Partition leases: `<outbox>_partitions`.
    pub partitions: TableName,
    /// `<outbox>_versions`: the version `migrate` reached, per component (`outbox`,
    /// and `wal` for WAL capture's objects).
    pub versions: TableName,
    pub notify_channel: Ident,
    /// Partitions a new outbox gets (`migrate --partitions`).
    pub partition_count: u32,
    /// Writers notify only while a relay waits for rows (`wakeup = "gated"`).
    pub gated_wakeup: bool,
    /// Writers never notify (`wakeup = "poll"`): the trigger function does nothing and the
    /// relay polls. A transaction that has sent a NOTIFY cannot `PREPARE TRANSACTION`, so
    /// applications using two-phase commit need this mode.
    pub poll_wakeup: bool,
    /// The nodes table is the native one, with the columns of its steps (`partitions_table`);
    /// a seed's (a mapped layout's) has only `id` and `expiry`.
    pub native_nodes: bool,
}

impl Tables {
    pub fn new(
        outbox_schema: &str,
        outbox_table: &str,
        nodes_schema: &str,
        nodes_table: &str,
        notify_channel: &str,
    ) -> Result<Self, StoreError> {
        let outbox = TableName::new(outbox_schema, outbox_table)?;
        let dead_letters = TableName::new(outbox_schema, &format!("{outbox_table}_dead_letters"))?;
        let partitions = TableName::new(outbox_schema, &format!("{outbox_table}_partitions"))?;
        let versions = TableName::new(outbox_schema, &format!("{outbox_table}_versions"))?;
        Ok(Tables {
            outbox,
            dead_letters,
            nodes: TableName::new(nodes_schema, nodes_table)?,
            partitions,
            versions,
            notify_channel: Ident::new(notify_channel, "notify channel")?,
            partition_count: outbox_core::partition::DEFAULT_PARTITIONS,
            gated_wakeup: false,
            poll_wakeup: false,
            native_nodes: true,
        })
    }

    /// The relay's own tables under their default names: `public.outbox`,
    /// `public.outbox_nodes`, the default notify channel.
    pub fn standard() -> Self {
        Tables::new(
            "public",
            "outbox",
            "public",
            "outbox_nodes",
            DEFAULT_NOTIFY_CHANNEL,
        )
        .expect("the default names are valid identifiers")
    }

    /// `"schema"."<outbox>_partition"(key, count)`: the SQL twin of
    /// `outbox_core::partition_of`.
    pub fn partition_function(&self) -> String {
        self.outbox.sibling("_partition")
    }

    /// The index of rows that are not available yet (scheduled, or waiting to retry), which the
    /// scan floor reads to know until when it may skip them. Quoted, schema-qualified.
    pub fn scheduled_index(&self) -> String {
        self.outbox.sibling("_scheduled_idx")
    }

    /// The index of the pending rows (`delivered_at IS NULL`), which every claim walks in
    /// order. Quoted, schema-qualified.
    pub fn pending_index(&self) -> String {
        self.outbox.sibling("_pending_idx")
    }

    /// The ordering-key expression; the claim query and the blocking index must agree on it.
    pub const ORDERING_KEY: &'static str = "coalesce(partition_key, destination)";

    /// What the blocking index holds of the ordering key: its 64-bit hash. A btree row holds
    /// at most about 2.7 kB, and keys (composite ids, URLs) can be longer; the claim compares
    /// the hash, to find the index, and the key itself, so colliding keys never block each other.
    pub const ORDERING_KEY_HASH: &'static str =
        "hashtextextended(coalesce(partition_key, destination), 0)";

    /// The index of rows that can hold back later rows of their key (leased, or waiting to
    /// retry), over the key's hash. Quoted, schema-qualified.
    pub fn blocking_index(&self) -> String {
        self.outbox.sibling(BLOCKING_INDEX_SUFFIX)
    }

    /// The blocking index earlier versions created, over the key itself: it cannot take a key
    /// longer than a btree row, so every claim or retry that put such a key into it failed.
    /// `migrate` drops it. Quoted, schema-qualified.
    pub fn obsolete_blocking_index(&self) -> String {
        self.outbox.sibling(OBSOLETE_BLOCKING_INDEX_SUFFIX)
    }

    /// The advisory-lock key (as text, hashed in SQL) a waiting relay holds under the gated
    /// wake-up.
    pub fn wakeup_key(&self) -> String {
        format!("outbox-relay wake-up {}", self.outbox)
    }

    fn notify_function(&self) -> String {
        self.outbox.sibling("_notify")
    }

    fn trigger_name(&self) -> String {
        format!("{}_trigger", self.outbox.name)
    }

    /// The version table itself, created before any step (idempotent).
    pub fn version_table_ddl(&self) -> String {
        format!(
            "-- The schema's version per component, advanced after each step (see README, Upgrading).
{create_schema}
CREATE TABLE IF NOT EXISTS {table} (
    component     text PRIMARY KEY,
    version       integer NOT NULL,
    readable_from integer NOT NULL, -- the oldest schema version a relay must know to run on it
    migrated_at   timestamptz NOT NULL DEFAULT now()
);
",
            create_schema = outbox_layout::sql::pg_create_schema(&self.outbox.schema.quoted()),
            table = self.versions.quoted(),
        )
    }

    /// Records that `component` reached `version`: run after its step, in the step's
    /// transaction when it has one.
    pub fn record_version(&self, component: &str, version: u32, readable_from: u32) -> String {
        format!(
            "INSERT INTO {table} (component, version, readable_from) VALUES ('{component}', {version}, {readable_from})
    ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version,
        readable_from = EXCLUDED.readable_from, migrated_at = now();
",
            table = self.versions.quoted(),
        )
    }

    /// The indexes the steps build with `CREATE INDEX CONCURRENTLY`: an interrupted build
    /// leaves its index INVALID, which `IF NOT EXISTS` would then keep, so `migrate` drops
    /// an invalid one before building it again. Quoted, schema-qualified.
    pub fn concurrent_indexes(&self) -> Vec<String> {
        vec![
            self.pending_index(),
            self.blocking_index(),
            self.scheduled_index(),
        ]
    }

    /// The native schema's steps, in order. Add a step at the end for every change (never
    /// edit one that has shipped: databases have recorded it), and keep
    /// `crates/outbox-relay/tests/fixtures/` current (see its README).
    pub fn steps(&self) -> Steps {
        let t = self.outbox.quoted();
        let n = self.outbox.name.as_str();
        let schema = self.outbox.schema.quoted();
        let dl = self.dead_letters.quoted();
        let nodes = self.nodes.quoted();
        let create_schema = outbox_layout::sql::pg_create_schema(&schema);
        let create_nodes_schema = outbox_layout::sql::pg_create_schema(&self.nodes.schema.quoted());
        let key_hash = Self::ORDERING_KEY_HASH;
        let blocking_index = format!("\"{n}{BLOCKING_INDEX_SUFFIX}\""); // in the table's schema
        let parts = self.partitions.quoted();
        let partition_fn = self.partition_function();
        let partition_count = self.partition_count;
        let tables = format!(
            r#"{create_schema}
{create_nodes_schema}

-- Applications insert here, in the same transaction as their data change.
CREATE TABLE IF NOT EXISTS {t} (
    sequence_id   bigserial PRIMARY KEY,          -- publish order
    event_id      uuid NOT NULL UNIQUE DEFAULT gen_random_uuid(), -- idempotency key sent to brokers
    destination   text NOT NULL,                  -- channel, topic or subject
    partition_key text,                           -- ordering key; NULL means the destination
    event_type    text NOT NULL,                  -- message name
    payload       jsonb,
    headers       jsonb NOT NULL DEFAULT '{{}}',
    mutation_id   text,
    rejected      boolean NOT NULL DEFAULT false,
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- relay bookkeeping: applications leave these alone (available_at may schedule delivery)
    available_at  timestamptz NOT NULL DEFAULT now(),
    attempts      integer NOT NULL DEFAULT 0,
    last_error    text,
    locked_by     text,
    locked_until  timestamptz,
    delivered_at  timestamptz                     -- set only with --retain-delivered
);

-- Events that can never be delivered, whole, with their attempts and last error.
CREATE TABLE IF NOT EXISTS {dl} (
    sequence_id   bigint PRIMARY KEY,
    event_id      uuid NOT NULL,
    destination   text NOT NULL,
    partition_key text,
    event_type    text NOT NULL,
    payload       jsonb,
    headers       jsonb NOT NULL DEFAULT '{{}}',
    mutation_id   text,
    rejected      boolean NOT NULL DEFAULT false,
    created_at    timestamptz NOT NULL,
    attempts      integer NOT NULL,
    last_error    text NOT NULL,
    dead_at       timestamptz NOT NULL DEFAULT now()
);

-- A key's partition: the first 4 bytes of md5(key), sign bit cleared, modulo the count.
CREATE OR REPLACE FUNCTION {partition_fn}(key text, partitions integer) RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT ((('x' || substr(md5(key), 1, 8))::bit(32)::integer) & 2147483647) % partitions $$;

-- Partition leases: one owner at a time, a fencing epoch that grows with every takeover.
CREATE TABLE IF NOT EXISTS {parts} (
    partition   integer PRIMARY KEY,
    owner       text,
    epoch       bigint NOT NULL DEFAULT 0,
    lease_until timestamptz
);
INSERT INTO {parts} (partition)
    SELECT generate_series(0, {partition_count} - 1)
    WHERE NOT EXISTS (SELECT 1 FROM {parts});

-- Relay nodes and their heartbeats (the Ably connector's nodes table).
CREATE TABLE IF NOT EXISTS {nodes} (
    id     text PRIMARY KEY,
    expiry timestamp without time zone NOT NULL
);
"#
        );
        let index = |sql: String| Step {
            version: 0,
            summary: "",
            statements: vec![sql],
            lock: Lock::Online,
            run: Run::Alone,
            older_relays_run: true,
        };
        // A column of the nodes table, added in a transaction of its own that gives up on
        // the lock rather than hold heartbeats up.
        let nodes_column = |version, summary, column: &str| Step {
            version,
            summary,
            statements: vec![format!(
                "SET LOCAL lock_timeout = '5s';
ALTER TABLE {nodes} ADD COLUMN IF NOT EXISTS {column};"
            )],
            lock: Lock::Locks(
                "an ACCESS EXCLUSIVE lock on the nodes table (not the outbox) for a catalog \
                 change, milliseconds once granted; it waits at most 5 s for it (lock_timeout) \
                 and then fails rather than hold heartbeats up: run `migrate` again",
            ),
            run: Run::InTransaction,
            older_relays_run: true,
        };
        let steps = vec![
            Step {
                version: 1,
                summary: "the outbox, dead-letter, partitions and nodes tables and the partition \
                          function, where missing (existing tables are not touched)",
                statements: vec![tables],
                lock: Lock::Online,
                run: Run::InTransaction,
                older_relays_run: false,
            },
            Step {
                version: 2,
                summary: "the pending rows' index (the claim scan)",
                ..index(format!(
                    "CREATE INDEX CONCURRENTLY IF NOT EXISTS \"{n}_pending_idx\" ON {t} (sequence_id) WHERE delivered_at IS NULL;"
                ))
            },
            Step {
                version: 3,
                summary: "the blocking index over the ordering key's hash, replacing the one over \
                          the key (a btree row holds at most about 2.7 kB, and a longer key failed \
                          every claim that leased it)",
                statements: vec![
                    format!(
                        "CREATE INDEX CONCURRENTLY IF NOT EXISTS {blocking_index} ON {t} (({key_hash}), sequence_id)
    WHERE delivered_at IS NULL AND (locked_by IS NOT NULL OR attempts > 0);"
                    ),
                    format!(
                        "DROP INDEX CONCURRENTLY IF EXISTS {};",
                        self.obsolete_blocking_index()
                    ),
                ],
                ..index(String::new())
            },
            Step {
                version: 4,
                summary: "the scheduled rows' index (rows available later than written: the \
                          scan floor reads when the next comes due)",
                ..index(format!(
                    "CREATE INDEX CONCURRENTLY IF NOT EXISTS \"{n}_scheduled_idx\" ON {t} (available_at)
    WHERE delivered_at IS NULL AND available_at > created_at;"
                ))
            },
            nodes_column(
                5,
                "the nodes table's protocol column (rolling upgrades: which cluster protocol \
                 each node speaks; NULL for relays from before it)",
                "protocol integer",
            ),
            nodes_column(
                6,
                "the nodes table's partitions_table column (which outbox's partitions each \
                 node takes: '' for none, NULL for relays from before it)",
                "partitions_table text",
            ),
            nodes_column(
                7,
                "the nodes table's relays_outbox and claims columns (the outbox each node \
                 relays and how it takes its events: ordered, unordered or WAL capture; nodes \
                 of one outbox that take them two ways are refused)",
                "relays_outbox text, ADD COLUMN IF NOT EXISTS claims text",
            ),
            nodes_column(
                8,
                "the nodes table's partition_count column (the count each ordered node splits \
                 keys by: a node started after the partitions table changed waits for the \
                 nodes of the old count to stop before it takes partitions)",
                "partition_count integer",
            ),
        ];
        Steps::new("outbox", steps)
    }

    /// The native nodes table as the steps leave it, where missing: `migrate` makes it
    /// after the steps, for a `nodes_table` named after they ran (the first step made the one
    /// named then, and `migrate` told to run `migrate`). Keep it in step with the steps'
    /// `nodes_column`s.
    pub fn nodes_table_where_missing(&self) -> Option<String> {
        if !self.native_nodes {
            return None;
        }
        Some(format!(
            "{}
CREATE TABLE IF NOT EXISTS {} (
    id               text PRIMARY KEY,
    expiry           timestamp without time zone NOT NULL,
    protocol         integer,
    partitions_table text,
    relays_outbox    text,
    claims           text,
    partition_count  integer
);",
            outbox_layout::sql::pg_create_schema(&self.nodes.schema.quoted()),
            self.nodes.quoted()
        ))
    }

    /// Everything `migrate` creates on a database with none of it, as `migrate --print`
    /// shows it without a database: the version table, every step (each followed by the
    /// version it reaches), and the wake-up trigger.
    pub fn ddl(&self) -> String {
        let steps = self.steps();
        let mut out = self.version_table_ddl();
        for step in &steps.steps {
            out.push('\n');
            out.push_str(&self.printable_step(&steps, step));
        }
        out.push('\n');
        out.push_str(&self.wakeup_ddl());
        out
    }

    /// A step as `migrate --print` shows it, with the statement that records its version.
    pub fn printable_step(&self, steps: &Steps, step: &Step) -> String {
        let mut out = step.printable(steps.component);
        if step.run == Run::Alone {
            out.push_str(
                "-- (interrupted? an index it left INVALID must be dropped with DROP INDEX CONCURRENTLY first)\n",
            );
        }
        out.push_str(&self.record_version(
            steps.component,
            step.version,
            steps.readable_from(step.version),
        ));
        out
    }

    /// The statement-level trigger that wakes the relay on commit (its body follows the
    /// wake-up mode: notify, gated, or nothing under `poll`), and its function. Idempotent.
    /// Mapped layouts install the same on their table (named after it).
    pub fn wakeup_ddl(&self) -> String {
        let t = self.outbox.quoted();
        let func = self.notify_function();
        let trigger = self.trigger_name();
        let channel = self.notify_channel.as_str();
        let notify = if self.poll_wakeup {
            // The trigger stays (so switching modes is `migrate` again, which replaces this
            // body), but sends nothing.
            "-- --wakeup poll: no NOTIFY, so inserting transactions can PREPARE TRANSACTION.
    NULL;"
                .to_string()
        } else if self.gated_wakeup {
            format!(
                "-- Gated: only while a relay waits (it then holds this lock); a relay at work polls.
    IF NOT pg_try_advisory_xact_lock_shared(hashtext('{}')) THEN
        PERFORM pg_notify('{channel}', '');
    END IF;",
                self.wakeup_key()
            )
        } else {
            format!("PERFORM pg_notify('{channel}', '');")
        };
        format!(
            r#"-- Wakes the relay after each inserting statement; never fails the application's insert.
CREATE OR REPLACE FUNCTION {func}() RETURNS trigger AS $$
BEGIN
    {notify}
    RETURN NULL;
EXCEPTION
    WHEN others THEN
        RAISE WARNING 'unexpected error in %: %', TG_NAME, SQLERRM;
        RETURN NULL;
END;
$$ LANGUAGE plpgsql;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = '{trigger}' AND tgrelid = '{t}'::regclass) THEN
        CREATE TRIGGER "{trigger}" AFTER INSERT ON {t}
            FOR EACH STATEMENT EXECUTE FUNCTION {func}();
    END IF;
END
$$;
"#
        )
    }

    /// The least privileges the relay's role needs at run time.
    pub fn grants(&self, role: &str) -> String {
        let t = self.outbox.quoted();
        let dl = self.dead_letters.quoted();
        let nodes = self.nodes.quoted();
        let parts = self.partitions.quoted();
        let partition_fn = self.partition_function();
        let versions = self.versions.quoted();
        let role = format!("\"{role}\"");
        let mut schemas = vec![self.outbox.schema.quoted()];
        if self.nodes.schema != self.outbox.schema {
            schemas.push(self.nodes.schema.quoted());
        }
        format!(
            r#"-- The relay's run-time role: no DDL, no access beyond these tables.
-- CREATE ROLE {role} LOGIN PASSWORD '...';
GRANT USAGE ON SCHEMA {schemas} TO {role};
GRANT SELECT, UPDATE, DELETE ON {t} TO {role};
-- To read how far ids have been handed out (claims then skip what they have been through).
-- The sequence's name is PostgreSQL's (it shortens long names its own way): ask for it.
DO $grant$ BEGIN
    EXECUTE format('GRANT SELECT ON SEQUENCE %s TO %s',
                   pg_get_serial_sequence('{t}', 'sequence_id'), '{role}');
END $grant$;
GRANT SELECT, INSERT ON {dl} TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE ON {nodes} TO {role};
GRANT SELECT, UPDATE ON {parts} TO {role};
GRANT EXECUTE ON FUNCTION {partition_fn}(text, integer) TO {role};
-- To refuse a schema older or newer than it runs on.
GRANT SELECT ON {versions} TO {role};
-- Applications (and `outbox-relay send`) also need:
--   GRANT INSERT ON {t} TO app_role;
--   GRANT USAGE ON SEQUENCE <SELECT pg_get_serial_sequence('{t}', 'sequence_id')> TO app_role;
-- Operators (`dead retry`, `dead purge`, `prune`) also need:
--   GRANT INSERT ON {t} TO operator_role;
--   GRANT DELETE ON {dl} TO operator_role;
"#,
            schemas = schemas.join(", "),
        )
    }

    pub fn trigger_exists_sql(&self) -> (String, String) {
        (self.trigger_name(), self.outbox.quoted())
    }
}

/// Statement texts, built once per store.
#[derive(Debug)]
pub struct Statements {
    /// Ordered, every partition, row leases decide (a single node).
    pub claim: String,
    /// Ordered, only the node's partitions; other nodes' row leases do not count there.
    pub claim_owned: String,
    /// `claim` and `claim_owned` leaving out crowded keys (`outbox_core::store::Crowded`).
    pub claim_crowded: String,
    pub claim_owned_crowded: String,
    /// The scan floor's reads around an owned claim (see `owned.rs`): the sequence's last
    /// value and whether it can vouch for ids; the sessions that may still insert below it;
    /// when the next row not available yet comes due; after the claim, whether the fence
    /// held and whether that due time has passed.
    pub floor_sequence: String,
    pub floor_writers: String,
    pub floor_due: String,
    pub floor_after: String,
    /// Any ready rows (`--ordering none`).
    pub claim_unordered: String,
    pub ack_delete: Guarded,
    pub ack_retain: Guarded,
    pub retry_later: Guarded,
    pub dead_letter: Guarded,
    pub release: String,
    pub release_unheld: String,
    pub extend_leases: String,
    pub backlog: String,
    pub dead_count: String,
    pub insert: String,
    pub heartbeat: String,
    pub remove_expired: String,
    pub deregister: String,
    pub live_nodes: String,
    /// Announces this node's cluster protocol and lists the live nodes behind the oldest it
    /// shares partitions with.
    pub nodes_behind: String,
    /// The live nodes that take this outbox's partitions, or may (rows from before the
    /// `partitions_table` column).
    pub partition_peers: String,
    pub partition_count: String,
    /// How a node claims this outbox's rows, announced, and the nodes that claim them the
    /// other way (`--ordering none` beside ordered nodes).
    pub claim_mode_peers: String,
    pub acquire: String,
    pub renew: String,
    pub release_partitions: String,
    pub partitions: String,
    /// Registration in the nodes table: takes the node's row only if absent or expired.
    pub register: String,
    pub ops: OperatorStatements,
}

/// A settle statement in its two forms: under row leases (the node must still lease the row)
/// and under partition ownership (the row's partition must still be the node's, at the epoch
/// it holds). Both are composed from one text with the guard in its place.
#[derive(Debug)]
pub struct Guarded {
    /// The node still leases the row: `o.locked_by = $1`, not released.
    pub row_lease: String,
    /// The partition fence, whose parameters follow the statement's own.
    pub partition_fence: String,
}

/// Columns returned for each claimed row, decoded by `row_to_claimed`.
const RETURNED: &str = "o.sequence_id, o.event_id, o.destination, o.partition_key, o.event_type, \
     o.payload::text, o.headers::text, o.mutation_id, o.rejected, o.attempts, o.created_at";

/// The row-lease guard of a settle: the node ($1) still leases the row (a released row keeps
/// its `locked_by` with no `locked_until`, see [`Native::release`]).
const ROW_LEASE: &str = " AND o.locked_by = $1 AND o.locked_until IS NOT NULL";

/// A settled row (`o`) is still the one handed out (`u`, whose `event_id` is the row's as
/// claimed, or NULL for a row settled by id alone: see `handed.rs`). A row that took a
/// handed-out row's sequence id (the sequence restarted) is not it.
const SAME_ROW: &str = " AND (u.event_id IS NULL OR o.event_id = u.event_id)";

/// An acked row (`o`) is one handed out: its event id is one of those handed out with the
/// acked ids ($3), or it is settled by id alone ($4: see `handed.rs`). A row that took a
/// handed-out row's sequence id (the sequence restarted) is not. The event ids are read
/// into a hash table once (a hashed subplan: the OR keeps it from becoming a join). A join
/// to the pairs, as the other settles have, was planned as a nested loop that read all
/// of them again for every row: 300-500 ms for an ack of 1,000 rows, a seventh of the
/// drain rate; a check of each row against the whole array cost 2 ms.
const HANDED_OUT: &str =
    " AND (o.event_id IN (SELECT unnest($3::uuid[])) OR o.sequence_id = ANY($4::int8[]))";

/// The ordering key of the claimed or settled row (`o`) and of an earlier row (`p`).
const KEY_O: &str = "coalesce(o.partition_key, o.destination)";
const KEY_P: &str = "coalesce(p.partition_key, p.destination)";

impl Statements {
    pub fn new(tables: &Tables) -> Self {
        let native = Native::new(tables);
        Statements {
            claim: native.claim(),
            claim_owned: native.claim_owned(),
            claim_crowded: native.claim_crowded(),
            claim_owned_crowded: native.claim_owned_crowded(),
            floor_sequence: native.floor_sequence(),
            floor_writers: native.floor_writers(),
            floor_due: native.floor_due(),
            floor_after: native.floor_after(),
            claim_unordered: native.claim_unordered(),
            ack_delete: native.ack_delete(),
            ack_retain: native.ack_retain(),
            retry_later: native.retry_later(),
            dead_letter: native.dead_letter(),
            release: native.release(),
            release_unheld: native.release_unheld(),
            extend_leases: native.extend_leases(),
            backlog: native.backlog(),
            dead_count: native.dead_count(),
            insert: native.insert(),
            heartbeat: native.heartbeat(),
            remove_expired: native.remove_expired(),
            deregister: native.deregister(),
            live_nodes: native.live_nodes(),
            nodes_behind: native.nodes_behind(),
            partition_peers: native.partition_peers(),
            partition_count: native.partition_count(),
            claim_mode_peers: native.claim_mode_peers(),
            acquire: native.acquire(),
            renew: native.renew(),
            release_partitions: native.release_partitions(),
            partitions: native.partitions(),
            register: native.register(),
            ops: native.operator_statements(),
        }
    }
}

/// The native tables' names, quoted, from which each statement is written.
struct Native {
    t: String,
    dl: String,
    nodes: String,
    parts: String,
    func: String,
    scheduled: String,
    /// `nodes` has the `partitions_table` column (see [`Tables::native_nodes`]).
    native_nodes: bool,
}

impl Native {
    fn new(tables: &Tables) -> Self {
        Native {
            native_nodes: tables.native_nodes,
            t: tables.outbox.quoted(),
            dl: tables.dead_letters.quoted(),
            nodes: tables.nodes.quoted(),
            parts: tables.partitions.quoted(),
            func: tables.partition_function(),
            scheduled: tables.scheduled_index(),
        }
    }

    /// The partition fence: the row's partition is held by the node ($1) at the epoch it
    /// holds. `first` numbers the partitions, epochs and partition count parameters. The
    /// confirmed partitions are computed once per statement (an InitPlan); a node holding
    /// every partition then skips the per-row hash altogether.
    fn partition_fence(&self, first: usize) -> String {
        let Native { parts, func, .. } = self;
        let (p, e, n) = (first, first + 1, first + 2);
        let confirmed = format!(
            "CAST((SELECT coalesce(array_agg(pp.partition), '{{}}') FROM {parts} pp
                         JOIN unnest(${p}::int4[], ${e}::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                        WHERE pp.owner = $1 AND pp.epoch = h.epoch) AS int4[])"
        );
        format!(
            " AND (cardinality({confirmed}) = ${n} OR {func}({KEY_O}, ${n}) = ANY({confirmed}))"
        )
    }

    /// A settle statement under each guard: `statement` writes the text around the guard, and
    /// the fence's parameters are numbered from `first_fence_param` on. Fenced settles (owned
    /// partitions) hold no row lease: the fence takes the lease's place.
    fn settle(&self, first_fence_param: usize, statement: impl Fn(&str) -> String) -> Guarded {
        Guarded {
            row_lease: statement(ROW_LEASE),
            partition_fence: statement(&self.partition_fence(first_fence_param)),
        }
    }

    /// An earlier row of the same key: the hash finds it in the blocking index, the key
    /// itself rules out a collision. (Against a database migrated before the hash index,
    /// the key comparison finds the old index instead.)
    fn same_key() -> String {
        format!("hashtextextended({KEY_P}, 0) = hashtextextended({KEY_O}, 0) AND {KEY_P} = {KEY_O}")
    }

    /// No earlier pending row of the same key blocks `o`: one that `blocks` says is blocking,
    /// among those leased or failed before (the blocking index's predicate).
    fn unblocked(&self, blocks: &str) -> String {
        let t = &self.t;
        let same_key = Self::same_key();
        format!(
            "NOT EXISTS (
                    SELECT 1 FROM {t} p
                    WHERE {same_key}
                      AND p.sequence_id < o.sequence_id
                      AND p.delivered_at IS NULL
                      AND (p.locked_by IS NOT NULL OR p.attempts > 0)
                      AND ({blocks}))"
        )
    }

    /// A claim under row leases: up to $2 ready rows, not leased, that pass `candidates`,
    /// locked (skipping rows other transactions hold), of which those that pass `keep` are
    /// leased to the node ($1) for $3 ms.
    fn leasing_claim(&self, candidates: &str, keep: &str) -> String {
        let t = &self.t;
        let passed = self.passed();
        format!(
            "WITH locked AS (
                    SELECT o.sequence_id FROM {t} o
                    WHERE o.delivered_at IS NULL
                      AND o.available_at <= now()
                      AND (o.locked_until IS NULL OR o.locked_until < now())
                      {candidates}
                    ORDER BY o.sequence_id
                    LIMIT $2
                    FOR UPDATE SKIP LOCKED),
                  {passed},
                  claimable AS (
                    SELECT o.sequence_id FROM {t} o JOIN locked l ON l.sequence_id = o.sequence_id
                    WHERE {keep})
                 UPDATE {t} o
                    SET locked_by = $1, locked_until = now() + $3::int8 * interval '1 millisecond'
                   FROM claimable c
                  WHERE o.sequence_id = c.sequence_id
              RETURNING {RETURNED}"
        )
    }

    /// Within a claim whose rows are `locked` (SKIP LOCKED, in sequence order): for each
    /// key, its first ready, unleased row before the last one locked that the claim did not
    /// lock: one another transaction holds (an application's `SELECT … FOR UPDATE`, or FOR
    /// KEY SHARE from a foreign key's check), or one its candidates left out. The second
    /// pass never saw a fresh row held so (it looks at rows leased or failed, and other
    /// claims' rows are kept off by the key locks): SKIP LOCKED passed it, and the later
    /// rows of its key went out first. A plain read of the range the claim's scan covered,
    /// with none of its per-row checks; an ordered claim keeps a row only ahead of its key's
    /// ([`Native::not_passed`]).
    fn passed(&self) -> String {
        let t = &self.t;
        format!(
            "passed AS (
                    SELECT {KEY_O} AS k, min(o.sequence_id) AS first
                    FROM {t} o
                    WHERE o.delivered_at IS NULL
                      AND o.available_at <= now()
                      AND (o.locked_until IS NULL OR o.locked_until < now())
                      AND o.sequence_id < (SELECT max(sequence_id) FROM locked)
                      AND o.sequence_id NOT IN (SELECT sequence_id FROM locked)
                    GROUP BY 1)"
        )
    }

    /// No row of `o`'s key that the claim passed comes before it ([`Native::passed`]).
    fn not_passed() -> String {
        format!(
            "NOT EXISTS (SELECT 1 FROM passed WHERE passed.k = {KEY_O} AND passed.first < o.sequence_id)"
        )
    }

    /// $1 node, $2 limit, $3 lease in ms. See outbox_core::store for the contract. A row
    /// waiting to retry blocks its key, and so does one another node leases.
    ///
    /// The rows are locked with SKIP LOCKED, and what blocks is read from the statement's
    /// snapshot. So an earlier row of the key that another transaction holds locked (a node
    /// settling, releasing or extending it, or claiming it) would be skipped while its last
    /// committed state, say a lapsed lease, lets the later row through: the later row would
    /// go out first. Hence the second pass (`keep`): a locked row goes only when every
    /// earlier row of its key that was ever leased or failed is locked by this claim too, or
    /// leased by this node (the engine's lanes order those).
    ///
    /// An earlier row never leased nor failed is held locked only by another claim, and that
    /// the second pass cannot see. So a claim also takes, for each key whose rows it would
    /// lock, a transaction-level advisory lock ([`Native::key_lock`]); a claim that cannot
    /// have a key's lock passes over every row of that key, and takes them next time.
    fn claim(&self) -> String {
        self.claim_leaving_out("")
    }

    /// [`Native::claim`] leaving out the crowded keys ($4) and looking no further than the
    /// first $5 claimable rows ([`Native::uncrowded`]).
    fn claim_crowded(&self) -> String {
        let unleased = "(w.locked_until IS NULL OR w.locked_until < now())";
        self.claim_leaving_out(&self.uncrowded(4, unleased, 5))
    }

    fn claim_leaving_out(&self, crowded: &str) -> String {
        let no_lease_or_retry_blocks = self
            .unblocked("p.available_at > now() OR (p.locked_until > now() AND p.locked_by <> $1)");
        let not_ours_nor_locked_here = self.unblocked(
            "(p.locked_by IS DISTINCT FROM $1 OR p.locked_until IS NULL OR p.locked_until <= now())
                          AND p.sequence_id NOT IN (SELECT sequence_id FROM locked)",
        );
        let key_lock = self.key_lock();
        let not_passed = Self::not_passed();
        self.leasing_claim(
            &format!(
                "{crowded} AND CASE WHEN {no_lease_or_retry_blocks} THEN {key_lock} ELSE false END"
            ),
            &format!("{not_ours_nor_locked_here} AND {not_passed}"),
        )
    }

    /// The advisory lock a claim takes on the key of a row it would lock (`o`), until it
    /// commits: the outbox's name and the key, each hashed to 32 bits (a collision only makes
    /// a claim pass over a key it could have taken).
    fn key_lock(&self) -> String {
        let table = self.t.replace('\'', "''");
        format!("pg_try_advisory_xact_lock(hashtext('{table}'), hashtext({KEY_O}))")
    }

    /// Any ready rows (`--ordering none`).
    fn claim_unordered(&self) -> String {
        self.leasing_claim("", "true")
    }

    /// Rows (`o`) not of the crowded keys (`$keys`, text[]), and no further on than the
    /// last of the first `$window` available rows (`w`) that pass `claimable` (a bound the
    /// index scan stops at: an uncorrelated scalar subquery, so an InitPlan). Leaving a key
    /// out would otherwise walk past every row of its backlog, in every claim. A key whose
    /// backlog fills the whole window holds the others back as before.
    fn uncrowded(&self, keys: u8, claimable: &str, window: u8) -> String {
        let t = &self.t;
        format!(
            "AND NOT ({KEY_O} = ANY(${keys}::text[]))
                      AND o.sequence_id <= (SELECT coalesce(max(b.sequence_id), 0) FROM (
                            SELECT w.sequence_id FROM {t} w
                             WHERE w.delivered_at IS NULL AND w.available_at <= now() AND {claimable}
                             ORDER BY w.sequence_id LIMIT ${window}) b)"
        )
    }

    /// Owned partitions: $1 node, $2 limit, $3 the rows this node already holds, $4 the
    /// partition count, $5 its partitions, $6 their epochs, $7 the scan floor (rows held
    /// in $3 are only those at or above it), $8 when a row the floor passed comes due
    /// (microseconds since the epoch): from then on a claim above the start returns
    /// nothing, and the store claims again from the start ([`crate::owned::FROM_THE_START`]). The floor is not used with keys to leave out
    /// ([`Native::claim_owned_crowded`]): it passes only rows a claim saw. A plain SELECT: ownership
    /// (checked here against the live leases, and fencing every settle) replaces the row
    /// lease, so rows are neither updated nor locked at claim time. See ARCHITECTURE.md.
    /// `NOT IN (SELECT unnest(..))` is a hashed subplan; `NOT (.. = ANY($3))` compares
    /// every scanned row with every held id (BENCHMARKS.md, "What each change bought").
    /// The array never holds NULL, so NOT IN means what it says. Only a row waiting to
    /// retry blocks its key (ownership replaces leases).
    fn claim_owned(&self) -> String {
        self.claim_owned_leaving_out("")
    }

    /// [`Native::claim_owned`] leaving out the crowded keys ($9) and looking no further
    /// than the first $10 available rows of its partitions that the node does not hold
    /// ([`Native::uncrowded`]).
    fn claim_owned_crowded(&self) -> String {
        // Rows of the partitions the node holds: the others' rows would fill the window.
        let func = &self.func;
        let held = self.held_partitions();
        let ours = format!(
            "w.sequence_id NOT IN (SELECT unnest($3::int8[]))
               AND (cardinality({held}) = $4
                    OR {func}(coalesce(w.partition_key, w.destination), $4) = ANY({held}))"
        );
        self.claim_owned_leaving_out(&self.uncrowded(9, &ours, 10))
    }

    /// The partitions the database confirms the node ($1) holds of its fence ($5 and $6:
    /// owner, epoch, live lease), computed once per claim (an InitPlan): rows are then
    /// filtered against an array while the pending index is walked in order, and a node
    /// holding every partition skips the per-row hash altogether.
    fn held_partitions(&self) -> String {
        let parts = &self.parts;
        format!(
            "CAST((SELECT coalesce(array_agg(pp.partition), '{{}}') FROM {parts} pp
                     JOIN unnest($5::int4[], $6::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                    WHERE pp.owner = $1 AND pp.epoch = h.epoch AND pp.lease_until > now()) AS int4[])"
        )
    }

    fn claim_owned_leaving_out(&self, crowded: &str) -> String {
        let Native { t, func, .. } = self;
        let from_the_start = crate::owned::FROM_THE_START;
        let held = self.held_partitions();
        let no_retry_blocks = self.unblocked("p.attempts > 0 AND p.available_at > now()");
        format!(
            "SELECT {RETURNED} FROM {t} o
                  WHERE o.delivered_at IS NULL
                    AND o.available_at <= now()
                    AND o.sequence_id NOT IN (SELECT unnest($3::int8[]))
                    AND (cardinality({held}) = $4 OR {func}({KEY_O}, $4) = ANY({held}))
                    AND {no_retry_blocks}
                    AND $1::text IS NOT NULL
                    AND o.sequence_id >= $7
                    AND ($7 = '{from_the_start}'::int8 OR $8::int8 IS NULL OR now() < to_timestamp($8::int8 / 1000000.0))
                    {crowded}
                  ORDER BY o.sequence_id
                  LIMIT $2"
        )
    }

    /// The sequence's last value, whether it exists, whether it hands out ids one by
    /// one (INCREMENT 1, CACHE 1: otherwise a session can insert an id drawn earlier,
    /// holding no lock in between), and whether the scheduled index exists.
    fn floor_sequence(&self) -> String {
        let Native { t, scheduled, .. } = self;
        format!(
            "SELECT coalesce(pg_sequence_last_value(q.s), 0)::int8, q.s IS NOT NULL,
                        (SELECT seqcache FROM pg_catalog.pg_sequence WHERE seqrelid = q.s)::int8,
                        (SELECT seqincrement FROM pg_catalog.pg_sequence WHERE seqrelid = q.s)::int8,
                        to_regclass('{scheduled}') IS NOT NULL
                   FROM (SELECT pg_get_serial_sequence('{t}', 'sequence_id')::regclass AS s) q"
        )
    }

    /// Sessions that may still insert an id at or below the sequence's last value: those
    /// holding the outbox's insert lock, and those that drew from the sequence in their
    /// open transaction (`nextval` holds the sequence's lock until the transaction ends:
    /// ORMs draw the id before the INSERT). Every mode an insert or a draw takes or
    /// implies; not the vacuum's.
    fn floor_writers(&self) -> String {
        let t = &self.t;
        format!(
            "SELECT coalesce(array_agg(l.virtualtransaction), '{{}}') FROM pg_catalog.pg_locks l
                  WHERE l.locktype = 'relation'
                    AND l.relation IN ('{t}'::regclass, pg_get_serial_sequence('{t}', 'sequence_id')::regclass)
                    AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())
                    AND l.mode IN ('RowExclusiveLock', 'ShareRowExclusiveLock', 'ExclusiveLock', 'AccessExclusiveLock')"
        )
    }

    /// Before the claim: when the first row of the node's partitions that is not
    /// available yet comes due ($1 node, $2 partitions, $3 partition count), in
    /// microseconds since the epoch; NULL when there is none (or only `infinity`). The
    /// floor may pass such rows only until then. `available_at > created_at` matches
    /// the scheduled index's predicate, so the read is one index probe.
    fn floor_due(&self) -> String {
        let Native { t, func, .. } = self;
        format!(
            "SELECT CASE WHEN isfinite(m) THEN (extract(epoch from m) * 1000000)::int8 END
                   FROM (SELECT min(o.available_at) AS m FROM {t} o
                          WHERE o.delivered_at IS NULL AND o.available_at > o.created_at
                            AND o.available_at > now()
                            AND (cardinality($2::int4[]) = $3 OR {func}({KEY_O}, $3) = ANY($2::int4[]))
                            AND $1::text IS NOT NULL) d"
        )
    }

    /// After the claim ($1 node, $2 partitions, $3 epochs, $4 the floor's due time):
    /// whether every partition of the fence was still held, lease unbroken, and whether
    /// the floor's due time has passed.
    fn floor_after(&self) -> String {
        let parts = &self.parts;
        format!(
            "SELECT (SELECT count(*) FROM {parts} pp
                           JOIN unnest($2::int4[], $3::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                          WHERE pp.owner = $1 AND pp.epoch = h.epoch AND pp.lease_until > now())
                        = cardinality($2::int4[]),
                        coalesce(now() >= to_timestamp($4::int8 / 1000000.0), false)"
        )
    }

    /// $1 node, $2 ids, $3 the event ids handed out with them, $4 the ids settled by id
    /// alone (`HANDED_OUT`).
    fn ack_delete(&self) -> Guarded {
        let t = &self.t;
        self.settle(5, |guard| {
            format!("DELETE FROM {t} o WHERE o.sequence_id = ANY($2){HANDED_OUT}{guard}")
        })
    }

    /// $1 node, $2 ids, $3 and $4 as for [`Native::ack_delete`] (`--retain-delivered`).
    fn ack_retain(&self) -> Guarded {
        let t = &self.t;
        self.settle(5, |guard| {
            format!(
                "UPDATE {t} o SET delivered_at = now(), locked_by = NULL, locked_until = NULL
                      WHERE o.sequence_id = ANY($2){HANDED_OUT}{guard}"
            )
        })
    }

    /// $1 node, $2 ids, $3 attempts, $4 errors, $5 delays in ms, $6 event ids.
    fn retry_later(&self) -> Guarded {
        let t = &self.t;
        self.settle(7, |guard| {
            format!(
                "UPDATE {t} o
                        SET attempts = u.attempts, last_error = u.error,
                            available_at = now() + u.delay_ms * interval '1 millisecond',
                            locked_by = NULL, locked_until = NULL
                       FROM unnest($2::int8[], $3::int4[], $4::text[], $5::int8[], $6::uuid[])
                            AS u(sequence_id, attempts, error, delay_ms, event_id)
                      WHERE o.sequence_id = u.sequence_id{SAME_ROW}{guard}"
            )
        })
    }

    /// $1 node, $2 ids, $3 attempts, $4 errors, $5 event ids: moves each row whole into the
    /// dead letters.
    fn dead_letter(&self) -> Guarded {
        let Native { t, dl, .. } = self;
        self.settle(6, |guard| {
            format!(
                "WITH moved AS (
                            DELETE FROM {t} o
                             USING unnest($2::int8[], $3::int4[], $4::text[], $5::uuid[])
                                   AS u(sequence_id, attempts, error, event_id)
                             WHERE o.sequence_id = u.sequence_id{SAME_ROW}{guard}
                         RETURNING o.*, u.attempts AS final_attempts, u.error AS final_error)
                         INSERT INTO {dl} (sequence_id, event_id, destination, partition_key, event_type,
                                           payload, headers, mutation_id, rejected, created_at,
                                           attempts, last_error)
                         -- Undecodable rows too: a NULL where the dead letters allow none is
                         -- kept as an empty value (last_error says which it was).
                         SELECT sequence_id, coalesce(event_id, '00000000-0000-0000-0000-000000000000'),
                                coalesce(destination, ''), partition_key, coalesce(event_type, ''),
                                payload, coalesce(headers, '{{}}'), mutation_id, coalesce(rejected, false),
                                coalesce(created_at, now()), final_attempts, final_error
                           FROM moved"
            )
        })
    }

    /// $1 node, $2 ids. A released row keeps its `locked_by` and loses its `locked_until`:
    /// claimable at once, settled by no one, and still counted by a claim's second pass as
    /// an earlier row of its key that was leased ([`Native::claim`]). Clearing `locked_by`
    /// made it look never leased, and a later row of its key could then pass it while a
    /// write that waited on the release still held it locked.
    fn release(&self) -> String {
        let t = &self.t;
        format!(
            "UPDATE {t} SET locked_until = NULL
                  WHERE sequence_id = ANY($2) AND locked_by = $1 AND locked_until IS NOT NULL"
        )
    }

    /// $1 node, $2 the ids it holds: every other row it leases is released as by
    /// [`Native::release`] (the leases of a claim whose answer was lost). Pending and
    /// leased: the blocking index's rows, not the table's.
    fn release_unheld(&self) -> String {
        let t = &self.t;
        format!(
            "UPDATE {t} SET locked_until = NULL
                  WHERE locked_by = $1 AND locked_until IS NOT NULL AND delivered_at IS NULL
                    AND sequence_id NOT IN (SELECT unnest($2::int8[]))"
        )
    }

    fn extend_leases(&self) -> String {
        let t = &self.t;
        format!(
            "UPDATE {t} SET locked_until = now() + $3::int8 * interval '1 millisecond'
                  WHERE sequence_id = ANY($2) AND locked_by = $1 AND locked_until IS NOT NULL"
        )
    }

    fn backlog(&self) -> String {
        let t = &self.t;
        format!(
            "SELECT count(*)::int8,
                        count(*) FILTER (WHERE attempts > 0)::int8,
                        {WAITING_FOR_MS}
                   FROM {t} WHERE delivered_at IS NULL"
        )
    }

    fn dead_count(&self) -> String {
        format!("SELECT count(*)::int8 FROM {}", self.dl)
    }

    fn insert(&self) -> String {
        let t = &self.t;
        format!(
            "INSERT INTO {t} (event_id, destination, partition_key, event_type, payload,
                                  headers, mutation_id)
                 SELECT coalesce(u.event_id, gen_random_uuid()), u.destination, u.partition_key,
                        u.event_type, u.payload::jsonb, u.headers::jsonb, u.mutation_id
                   FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[],
                               $6::text[], $7::text[])
                        WITH ORDINALITY AS u(event_id, destination, partition_key, event_type,
                                             payload, headers, mutation_id, n)
                  ORDER BY u.n
              RETURNING sequence_id"
        )
    }

    /// $1 node, $2 ttl in ms, $3 the expiry this process last wrote (microseconds,
    /// compared exactly: timestamps are integers of microseconds). The row is pushed
    /// only while it shows our value, or inserted again if it is gone; otherwise the
    /// expiry it shows comes back, flagged false (none, if it changed after this
    /// statement's snapshot). "Gone" is the unique index's word, not the snapshot's: a
    /// removal of the expired row that commits while the UPDATE waits for its lock is
    /// still a row in this statement's snapshot.
    fn heartbeat(&self) -> String {
        let nodes = &self.nodes;
        let (takes_column, takes_none, _) = self.takes_no_partitions();
        format!(
            "WITH pushed AS (
                    UPDATE {nodes}
                       SET expiry = (now() AT TIME ZONE 'UTC') + $2::int8 * interval '1 millisecond'
                     WHERE id = $1
                       AND expiry = 'epoch'::timestamp + $3::int8 * interval '1 microsecond'
                 RETURNING expiry
                 ), inserted AS (
                    INSERT INTO {nodes} (id, expiry{takes_column})
                    SELECT $1, (now() AT TIME ZONE 'UTC') + $2::int8 * interval '1 millisecond'{takes_none}
                     WHERE NOT EXISTS (SELECT 1 FROM pushed)
                        ON CONFLICT (id) DO NOTHING
                 RETURNING expiry
                 )
                 SELECT (extract(epoch from expiry) * 1000000)::int8, true FROM pushed
                 UNION ALL
                 SELECT (extract(epoch from expiry) * 1000000)::int8, true FROM inserted
                 UNION ALL
                 SELECT (extract(epoch from expiry) * 1000000)::int8, false FROM {nodes}
                  WHERE id = $1
                    AND NOT EXISTS (SELECT 1 FROM pushed)
                    AND NOT EXISTS (SELECT 1 FROM inserted)"
        )
    }

    fn remove_expired(&self) -> String {
        let nodes = &self.nodes;
        format!("DELETE FROM {nodes} WHERE expiry < (now() AT TIME ZONE 'UTC')")
    }

    fn deregister(&self) -> String {
        let nodes = &self.nodes;
        format!(
            "DELETE FROM {nodes}
                  WHERE id = $1 AND expiry = 'epoch'::timestamp + $2::int8 * interval '1 microsecond'"
        )
    }

    /// $1 node, $2 its protocol, $3 the oldest it shares partitions with. The UPDATE runs
    /// whether or not its rows are read, and also says whose partitions the node takes; the
    /// SELECT leaves this node out.
    fn nodes_behind(&self) -> String {
        let (nodes, parts) = (&self.nodes, self.parts_literal());
        format!(
            "WITH announced AS (
                    UPDATE {nodes} SET protocol = $2, partitions_table = {parts}
                     WHERE id = $1
                       AND (protocol IS DISTINCT FROM $2 OR partitions_table IS DISTINCT FROM {parts})
                 RETURNING id
                 )
                 SELECT id, coalesce(protocol, 1) FROM {nodes}
                  WHERE id <> $1 AND expiry >= (now() AT TIME ZONE 'UTC')
                    AND coalesce(protocol, 1) < $3
                  ORDER BY id"
        )
    }

    /// A node's row says at first that it takes no partitions (`''`): one that does says
    /// whose in [`Native::nodes_behind`], every round. Only in the native nodes table: the
    /// column list, its value, and its update on a row taken again.
    fn takes_no_partitions(&self) -> (&'static str, &'static str, &'static str) {
        match self.native_nodes {
            true => (
                ", partitions_table, relays_outbox, claims, partition_count",
                ", '', NULL, NULL, NULL",
                ", partitions_table = EXCLUDED.partitions_table, relays_outbox = NULL, claims = NULL, \
                 partition_count = NULL",
            ),
            false => ("", "", ""),
        }
    }

    /// The partitions table's name as an SQL string literal (what `partitions_table` holds).
    fn parts_literal(&self) -> String {
        format!("'{}'", self.parts.replace('\'', "''"))
    }

    /// $1 node, $2 its mode (`ClaimMode::as_str`), $3 whether to announce it, $4 its
    /// partition count (ordered; else NULL): with $3, writes into the node's row the outbox
    /// it relays, how, and (ordered) whose partitions it takes and by which count; then
    /// lists the other live nodes of this outbox that take its events another way, with
    /// theirs (NULL: an ordered node from before the column, known by the partitions it
    /// takes), and the ordered ones that split keys by another count. The list is read in
    /// the statement's snapshot, before the write.
    fn claim_mode_peers(&self) -> String {
        let (nodes, parts) = (&self.nodes, self.parts_literal());
        let outbox = format!("'{}'", self.t.replace('\'', "''"));
        let takes = format!("CASE WHEN $2 = 'ordered' THEN {parts} ELSE '' END");
        format!(
            "WITH announced AS (
                    UPDATE {nodes}
                       SET partitions_table = {takes}, relays_outbox = {outbox}, claims = $2,
                           partition_count = $4
                     WHERE id = $1 AND $3
                       AND (partitions_table IS DISTINCT FROM {takes}
                            OR relays_outbox IS DISTINCT FROM {outbox}
                            OR claims IS DISTINCT FROM $2
                            OR partition_count IS DISTINCT FROM $4)
                 RETURNING id
                 )
                 SELECT id, claims, partition_count FROM {nodes}
                  WHERE id <> $1 AND expiry >= (now() AT TIME ZONE 'UTC')
                    AND (relays_outbox = {outbox} AND claims <> $2
                         OR claims IS NULL AND $2 <> 'ordered' AND partitions_table = {parts}
                         OR relays_outbox = {outbox} AND claims = $2
                            AND partition_count <> $4)
                  ORDER BY id"
        )
    }

    /// A row whose `partitions_table` is NULL was written by a relay from before the column,
    /// which may take partitions: it counts, as every node did.
    fn partition_peers(&self) -> String {
        let (nodes, parts) = (&self.nodes, self.parts_literal());
        format!(
            "SELECT id FROM {nodes}
                  WHERE expiry >= (now() AT TIME ZONE 'UTC')
                    AND (partitions_table IS NULL OR partitions_table = {parts})
                  ORDER BY id"
        )
    }

    fn live_nodes(&self) -> String {
        let nodes = &self.nodes;
        format!(
            "SELECT id, (extract(epoch from expiry) * 1000000)::int8 FROM {nodes}
                  WHERE expiry >= (now() AT TIME ZONE 'UTC') ORDER BY id"
        )
    }

    /// The partitions table's count, the database's encoding (keys are hashed in it), and
    /// the numbers missing from 0 to the highest (NULL when none is).
    fn partition_count(&self) -> String {
        let parts = &self.parts;
        format!(
            "SELECT count(*)::int8, (SELECT pg_encoding_to_char(encoding)::text FROM pg_database \
              WHERE datname = current_database()),
              CASE WHEN count(*) > 0 AND (min(partition) <> 0 OR max(partition) <> count(*) - 1)
                   THEN (SELECT string_agg(n::text, ', ' ORDER BY n)
                           FROM generate_series(0, (SELECT max(partition) FROM {parts})) n
                          WHERE NOT EXISTS (SELECT FROM {parts} p WHERE p.partition = n)) END
              FROM {parts}"
        )
    }

    /// $1 node, $2 partitions, $3 ttl in ms. A partition the node holds already is taken
    /// again, at a new epoch: the node asks only for what it does not know it holds, so
    /// such a lease is one whose acquire lost its answer (nothing was done under it).
    fn acquire(&self) -> String {
        let parts = &self.parts;
        format!(
            "UPDATE {parts}
                    SET owner = $1, epoch = epoch + 1,
                        lease_until = now() + $3::int8 * interval '1 millisecond'
                  WHERE partition = ANY($2::int4[])
                    AND (owner IS NULL OR owner = $1 OR lease_until IS NULL OR lease_until < now())
              RETURNING partition, epoch"
        )
    }

    /// $1 node, $2 partitions, $3 epochs, $4 ttl in ms. A lease that ran out is not
    /// renewed (it is taken again, at a new epoch): a lease of one epoch is then unbroken,
    /// which the scan floor relies on.
    fn renew(&self) -> String {
        let parts = &self.parts;
        format!(
            "UPDATE {parts} p SET lease_until = now() + $4::int8 * interval '1 millisecond'
                   FROM unnest($2::int4[], $3::int8[]) AS h(partition, epoch)
                  WHERE p.partition = h.partition AND p.owner = $1 AND p.epoch = h.epoch
                    AND p.lease_until > now()
              RETURNING p.partition"
        )
    }

    fn release_partitions(&self) -> String {
        let parts = &self.parts;
        format!(
            "UPDATE {parts} SET owner = NULL, lease_until = NULL
                  WHERE partition = ANY($2::int4[]) AND owner = $1"
        )
    }

    fn partitions(&self) -> String {
        let parts = &self.parts;
        format!(
            "SELECT partition, owner, epoch, (extract(epoch from lease_until) * 1000000)::int8
                   FROM {parts} ORDER BY partition"
        )
    }

    /// $1 node, $2 ttl in ms. Takes the row only if absent or expired; otherwise the
    /// second branch reports the expiry that stands.
    fn register(&self) -> String {
        let nodes = &self.nodes;
        let (takes_column, takes_none, takes_again) = self.takes_no_partitions();
        format!(
            "WITH taken AS (
                    INSERT INTO {nodes} (id, expiry{takes_column})
                    VALUES ($1, (now() AT TIME ZONE 'UTC') + $2::int8 * interval '1 millisecond'{takes_none})
                        ON CONFLICT (id) DO UPDATE SET expiry = EXCLUDED.expiry{takes_again}
                     WHERE {nodes}.expiry < (now() AT TIME ZONE 'UTC')
                 RETURNING expiry
                 )
                 SELECT true, (extract(epoch from expiry) * 1000000)::int8 FROM taken
                 UNION ALL
                 SELECT false, (extract(epoch from expiry) * 1000000)::int8 FROM {nodes}
                  WHERE id = $1 AND NOT EXISTS (SELECT 1 FROM taken)"
        )
    }
}

/// The operator commands' statements (`ops.rs`), over the outbox and its dead letters.
#[derive(Debug)]
pub struct OperatorStatements {
    /// Per destination: pending, retrying, the oldest pending row's age in ms.
    pub stats_pending: String,
    /// Per destination: dead letters.
    pub stats_dead: String,
    /// $1 destination or NULL, $2 event type or NULL, $3 after this id, $4 limit.
    pub dead_list: String,
    /// $1 the id: the row in whichever of the two tables holds it.
    pub event: String,
    /// Moves dead letters back into the outbox; the INSERT fires the outbox trigger, so
    /// relays wake up at once.
    pub dead_retry: BySelector,
    pub dead_purge: BySelector,
    /// $1 since, $2 until (seconds), $3 destination or NULL.
    pub count_replayable: String,
    /// As `count_replayable`, then $4 after this id, $5 batch: makes delivered rows pending.
    pub replay_batch: String,
    /// An UPDATE fires no insert trigger: $1 the channel to wake the relays on.
    pub wake_relays: String,
    /// $1 before (seconds).
    pub count_delivered_before: String,
    pub count_dead_before: String,
    /// $1 before (seconds), $2 batch.
    pub prune_delivered: String,
    pub prune_dead: String,
}

/// A statement on the dead letters a `DeadSelector` picks, one text per kind of selector;
/// `$1` is the selector's value.
#[derive(Debug)]
pub struct BySelector {
    pub ids: String,
    pub destination: String,
    pub all: String,
}

impl BySelector {
    /// `statement` writes the text around the selector's condition.
    fn new(statement: impl Fn(&str) -> String) -> Self {
        BySelector {
            ids: statement("sequence_id = ANY($1::int8[])"),
            destination: statement("destination = $1"),
            all: statement("$1::bool"),
        }
    }

    pub fn for_selector(&self, selector: &DeadSelector) -> &str {
        match selector {
            DeadSelector::Ids(_) => &self.ids,
            DeadSelector::Destination(_) => &self.destination,
            DeadSelector::All => &self.all,
        }
    }
}

impl Native {
    fn operator_statements(&self) -> OperatorStatements {
        let Native { t, dl, .. } = self;
        let micros = |c: &str| {
            format!("CASE WHEN isfinite({c}) THEN (extract(epoch from {c}) * 1000000)::int8 END")
        };
        // Deletes up to a batch of rows older than the time, skipping rows other
        // transactions hold, so a prune never waits on or blocks the relay for long.
        let prune = |table: &str, column: &str| {
            format!(
                "DELETE FROM {table} WHERE sequence_id IN (
                SELECT sequence_id FROM {table} WHERE {column} < to_timestamp($1)
                 ORDER BY sequence_id LIMIT $2 FOR UPDATE SKIP LOCKED)"
            )
        };
        let count_before = |table: &str, column: &str| {
            format!("SELECT count(*)::int8 FROM {table} WHERE {column} < to_timestamp($1)")
        };
        OperatorStatements {
            stats_pending: format!(
                "SELECT destination, count(*)::int8, count(*) FILTER (WHERE attempts > 0)::int8,
                            {WAITING_FOR_MS}
                       FROM {t} WHERE delivered_at IS NULL GROUP BY destination"
            ),
            stats_dead: format!("SELECT destination, count(*)::int8 FROM {dl} GROUP BY destination"),
            dead_list: format!(
                "SELECT sequence_id, event_id, destination, event_type, attempts::int8, last_error,
                            (extract(epoch from dead_at) * 1000000)::int8
                       FROM {dl}
                      WHERE ($1::text IS NULL OR destination = $1)
                        AND ($2::text IS NULL OR event_type = $2) AND sequence_id > $3
                      ORDER BY sequence_id LIMIT $4"
            ),
            // A row is in one of the two tables at a time.
            event: format!(
                "SELECT sequence_id, event_id, destination, event_type, partition_key,
                            payload::text, headers::text, attempts::int8, last_error, {created},
                            delivered_at IS NOT NULL, false, NULL::int8
                       FROM {t} WHERE sequence_id = $1
                     UNION ALL
                     SELECT sequence_id, event_id, destination, event_type, partition_key,
                            payload::text, headers::text, attempts::int8, last_error, {created},
                            false, true, {dead_at}
                       FROM {dl} WHERE sequence_id = $1",
                created = micros("created_at"),
                dead_at = micros("dead_at"),
            ),
            // A dead letter whose event id (or sequence id) the outbox holds already, as the
            // application wrote the event again, is left dead: its insert failed the whole
            // statement, and no other dead letter moved. Answers (moved, left).
            dead_retry: BySelector::new(|condition| {
                format!(
                    "WITH chosen AS (
                        SELECT sequence_id, EXISTS (SELECT 1 FROM {t} o
                                                     WHERE o.event_id = d.event_id
                                                        OR o.sequence_id = d.sequence_id) AS taken
                          FROM {dl} d WHERE {condition}),
                 moved AS (DELETE FROM {dl}
                            WHERE sequence_id IN (SELECT sequence_id FROM chosen WHERE NOT taken)
                        RETURNING *),
                 inserted AS (
                     INSERT INTO {t} (sequence_id, event_id, destination, partition_key, event_type,
                                      payload, headers, mutation_id, rejected, created_at)
                     SELECT sequence_id, event_id, destination, partition_key, event_type,
                            payload, headers, mutation_id, rejected, created_at FROM moved
                     RETURNING 1)
                 SELECT (SELECT count(*) FROM inserted)::int8,
                        (SELECT count(*) FROM chosen WHERE taken)::int8"
                )
            }),
            dead_purge: BySelector::new(|condition| format!("DELETE FROM {dl} WHERE {condition}")),
            count_replayable: format!(
                "SELECT count(*)::int8 FROM {t}
                      WHERE delivered_at IS NOT NULL AND created_at >= to_timestamp($1)
                        AND created_at < to_timestamp($2) AND ($3::text IS NULL OR destination = $3)"
            ),
            replay_batch: format!(
                "WITH b AS (
                        SELECT sequence_id FROM {t}
                         WHERE delivered_at IS NOT NULL AND created_at >= to_timestamp($1)
                           AND created_at < to_timestamp($2) AND ($3::text IS NULL OR destination = $3)
                           AND sequence_id > $4
                         ORDER BY sequence_id LIMIT $5 FOR UPDATE)
                     UPDATE {t} o SET delivered_at = NULL, attempts = 0, last_error = NULL,
                            available_at = now(), locked_by = NULL, locked_until = NULL
                       FROM b WHERE o.sequence_id = b.sequence_id
                     RETURNING o.sequence_id"
            ),
            wake_relays: "SELECT pg_notify($1, '')".into(),
            count_delivered_before: count_before(t, "delivered_at"),
            count_dead_before: count_before(dl, "dead_at"),
            prune_delivered: prune(t, "delivered_at"),
            prune_dead: prune(dl, "dead_at"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tables() -> Tables {
        Tables::new(
            "app",
            "events",
            "app",
            "relay_nodes",
            DEFAULT_NOTIFY_CHANNEL,
        )
        .unwrap()
    }

    #[test]
    fn ddl_names_every_object_from_config_and_quotes_it() {
        let ddl = tables().ddl();
        assert!(ddl.contains("CREATE TABLE IF NOT EXISTS \"app\".\"events\" ("));
        assert!(ddl.contains("CREATE TABLE IF NOT EXISTS \"app\".\"events_dead_letters\" ("));
        assert!(ddl.contains("CREATE TABLE IF NOT EXISTS \"app\".\"relay_nodes\" ("));
        assert!(ddl.contains("FUNCTION \"app\".\"events_notify\"()"));
        assert!(
            ddl.contains("CREATE TRIGGER \"events_trigger\" AFTER INSERT ON \"app\".\"events\"")
        );
        assert!(ddl.contains("FOR EACH STATEMENT"));
        assert!(ddl.contains("pg_notify('outbox_relay', '')"));
    }

    #[test]
    fn the_blocking_index_and_the_claims_agree_on_the_hashed_key() {
        let t = tables();
        assert!(Tables::ORDERING_KEY_HASH.contains(Tables::ORDERING_KEY));
        let ddl = t.ddl();
        assert!(ddl.contains(&format!(
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS \"events_key_blockers_idx\" ON \"app\".\"events\" (({}), sequence_id)",
            Tables::ORDERING_KEY_HASH
        )));
        assert!(ddl.contains("DROP INDEX CONCURRENTLY IF EXISTS \"app\".\"events_blocking_idx\";"));
        let sql = Statements::new(&t);
        for claim in [&sql.claim, &sql.claim_owned] {
            // The hash finds the index; the key rules out collisions.
            assert!(claim.contains("hashtextextended(coalesce(p.partition_key, p.destination), 0) = hashtextextended(coalesce(o.partition_key, o.destination), 0) AND coalesce(p.partition_key, p.destination) = coalesce(o.partition_key, o.destination)"), "{claim}");
        }
    }

    /// Every statement and all DDL of the native table, held to `snapshots/statements.sql`
    /// (see `outbox_testkit::snapshot`): the default names, and others in another schema.
    #[test]
    fn every_statement_and_ddl() {
        use std::fmt::Write;
        let mut out = String::new();
        for mut tables in [Tables::standard(), tables()] {
            let name = tables.outbox.to_string();
            let s = Statements::new(&tables);
            let settles = [
                ("ack_delete", &s.ack_delete),
                ("ack_retain", &s.ack_retain),
                ("retry_later", &s.retry_later),
                ("dead_letter", &s.dead_letter),
            ];
            let mut all: Vec<(String, &str)> = settles
                .iter()
                .flat_map(|(n, f)| {
                    [
                        (format!("{n} (row lease)"), f.row_lease.as_str()),
                        (format!("{n} (partition fence)"), f.partition_fence.as_str()),
                    ]
                })
                .collect();
            let plain = [
                ("claim", &s.claim),
                ("claim_owned", &s.claim_owned),
                ("claim_crowded", &s.claim_crowded),
                ("claim_owned_crowded", &s.claim_owned_crowded),
                ("floor_sequence", &s.floor_sequence),
                ("floor_writers", &s.floor_writers),
                ("floor_due", &s.floor_due),
                ("floor_after", &s.floor_after),
                ("claim_unordered", &s.claim_unordered),
                ("release", &s.release),
                ("release_unheld", &s.release_unheld),
                ("extend_leases", &s.extend_leases),
                ("backlog", &s.backlog),
                ("dead_count", &s.dead_count),
                ("insert", &s.insert),
                ("heartbeat", &s.heartbeat),
                ("remove_expired", &s.remove_expired),
                ("deregister", &s.deregister),
                ("live_nodes", &s.live_nodes),
                ("nodes_behind", &s.nodes_behind),
                ("partition_peers", &s.partition_peers),
                ("partition_count", &s.partition_count),
                ("claim_mode_peers", &s.claim_mode_peers),
                ("acquire", &s.acquire),
                ("renew", &s.renew),
                ("release_partitions", &s.release_partitions),
                ("partitions", &s.partitions),
                ("register", &s.register),
            ];
            all.extend(plain.iter().map(|(n, t)| (n.to_string(), t.as_str())));
            let ops = &s.ops;
            let by_selector = [
                ("dead_retry", &ops.dead_retry),
                ("dead_purge", &ops.dead_purge),
            ];
            for (n, b) in by_selector {
                all.push((format!("{n} (ids)"), b.ids.as_str()));
                all.push((format!("{n} (destination)"), b.destination.as_str()));
                all.push((format!("{n} (all)"), b.all.as_str()));
            }
            let operator = [
                ("stats_pending", &ops.stats_pending),
                ("stats_dead", &ops.stats_dead),
                ("dead_list", &ops.dead_list),
                ("event", &ops.event),
                ("count_replayable", &ops.count_replayable),
                ("replay_batch", &ops.replay_batch),
                ("wake_relays", &ops.wake_relays),
                ("count_delivered_before", &ops.count_delivered_before),
                ("count_dead_before", &ops.count_dead_before),
                ("prune_delivered", &ops.prune_delivered),
                ("prune_dead", &ops.prune_dead),
            ];
            all.extend(operator.iter().map(|(n, t)| (n.to_string(), t.as_str())));
            for (statement, text) in all {
                writeln!(out, "-- {name}: {statement}\n{text}\n").unwrap();
            }
            let ddl = tables.ddl();
            let grants = tables.grants("relay");
            writeln!(out, "-- {name}: ddl\n{ddl}\n-- {name}: grants\n{grants}").unwrap();
            tables.gated_wakeup = true;
            writeln!(out, "-- {name}: gated wake-up\n{}", tables.wakeup_ddl()).unwrap();
            tables.poll_wakeup = true;
            writeln!(out, "-- {name}: poll wake-up\n{}", tables.wakeup_ddl()).unwrap();
        }
        outbox_testkit::snapshot::assert_snapshot(
            env!("CARGO_MANIFEST_DIR"),
            "statements.sql",
            &out,
        );
    }

    #[test]
    fn grants_are_least_privilege() {
        let g = tables().grants("relay");
        assert!(g.contains("GRANT SELECT, UPDATE, DELETE ON \"app\".\"events\" TO \"relay\";"));
        assert!(g.contains("GRANT SELECT, INSERT ON \"app\".\"events_dead_letters\" TO \"relay\";"));
        assert!(!g.contains("CREATE ON"));
        assert!(!g.contains("INSERT ON \"app\".\"events\" TO \"relay\""));
    }
}
