//! What `migrate` creates for a mapped table and the grants it prints: the seeds' tables as
//! their projects give them, and the side table for dead rows of layouts that cannot mark
//! them.

use super::Sql;
use crate::{DeadState, Dialect, IdType, Mapping, OnSuccess, Seed};

impl Sql {
    /// The side table for dead rows (created by `migrate` when the layout needs it).
    pub fn dead_table_ddl(&self) -> Option<String> {
        if self.mapping.dead_state() != DeadState::SideTable {
            return None;
        }
        let id_type = match (self.dialect, self.mapping.id_type) {
            (Dialect::Postgres, IdType::Integer) => "bigint",
            (Dialect::Postgres, IdType::Uuid) => "uuid",
            (Dialect::MySql, IdType::Integer) => "bigint unsigned",
            (Dialect::MySql, IdType::Uuid) => "char(36)",
        };
        let time = match self.dialect {
            Dialect::Postgres => "timestamptz NOT NULL DEFAULT now()",
            Dialect::MySql => "datetime(6) NOT NULL",
        };
        Some(format!(
            "-- Dead events of a layout that cannot mark them; the outbox row itself is left as it is.\n\
             CREATE TABLE IF NOT EXISTS {} (\n    id {id_type} PRIMARY KEY,\n    attempts integer NOT NULL,\n    last_error text NOT NULL,\n    dead_at {time}\n);\n",
            self.dead_table()
        ))
    }

    /// The objects `migrate` creates: the seed's DDL (presets), and the side table if any;
    /// `None` when there is nothing to create (a custom mapping that marks dead rows itself).
    pub fn ddl(&self) -> Option<String> {
        let m = &self.mapping;
        let mut ddl = match m.seed {
            Some(Seed::Adbc) => adbc_outbox_ddl(m),
            Some(Seed::OpenOutbox) => open_outbox_ddl(m),
            Some(Seed::Export) => export_ddl(m),
            Some(Seed::MysqlOutboxEvents) => mysql_outbox_events_ddl(m),
            Some(Seed::NativeMysql) => native_mysql_ddl(m),
            Some(Seed::Debezium) => debezium_ddl(m),
            // A custom mapping's table is the application's own.
            None => String::new(),
        };
        if let Some(side) = self.dead_table_ddl() {
            ddl.push_str(&side);
        }
        (!ddl.is_empty()).then_some(ddl)
    }

    /// The least privileges at run time.
    pub fn grants(&self, role: &str) -> String {
        let t = self.table();
        let write = match self.mapping.on_success {
            OnSuccess::Delete => "SELECT, UPDATE, DELETE",
            OnSuccess::Mark => "SELECT, UPDATE",
        };
        let role = match self.dialect {
            Dialect::Postgres => format!("\"{role}\""),
            Dialect::MySql => format!("'{role}'@'%'"),
        };
        let mut out = String::new();
        // A table outside the search path's public schema is reached through its schema.
        if let (Dialect::Postgres, Some(schema)) = (self.dialect, self.mapping.schema.as_deref()) {
            if schema != "public" {
                out.push_str(&format!(
                    "GRANT USAGE ON SCHEMA {} TO {role};\n",
                    self.quote(schema)
                ));
            }
        }
        out.push_str(&format!("GRANT {write} ON {t} TO {role};\n"));
        if let Some(from) = &self.mapping.max_attempts_from {
            out.push_str(&format!(
                "GRANT SELECT ON {} TO {role};\n",
                self.qualified(&from.table)
            ));
        }
        if self.dead_table_ddl().is_some() {
            out.push_str(&format!(
                "GRANT SELECT, INSERT, DELETE ON {} TO {role};\n",
                self.dead_table()
            ));
        }
        out.push_str(&format!(
            "-- Operators (`dead purge`, `prune`) also need DELETE on {t}.\n"
        ));
        out
    }
}

/// PostgreSQL's `CREATE SCHEMA` for `schema` (quoted), run only where it is missing.
/// `CREATE SCHEMA IF NOT EXISTS` asks for CREATE on the database before it looks, even for
/// a schema that exists: a role that owns its tables in `public` (PostgreSQL 15's usual
/// grant, CREATE on the schema only) could never run `migrate`.
pub fn pg_create_schema(schema: &str) -> String {
    format!(
        "DO $create_schema$ BEGIN IF to_regnamespace('{}') IS NULL THEN CREATE SCHEMA {schema}; \
         END IF; END $create_schema$;",
        schema.replace('\'', "''")
    )
}

/// The Ably connector's outbox table, function and trigger, exactly as its documentation
/// gives them (names substituted).
pub fn adbc_outbox_ddl(m: &Mapping) -> String {
    let schema = m.schema.as_deref().unwrap_or("public");
    let create_schema = pg_create_schema(&format!("\"{schema}\""));
    let table = &m.table;
    format!(
        r#"{create_schema}
CREATE TABLE IF NOT EXISTS "{schema}"."{table}" ( sequence_id serial PRIMARY KEY, mutation_id TEXT NOT NULL, channel TEXT NOT NULL, name TEXT NOT NULL, rejected boolean NOT NULL DEFAULT false, data JSONB, headers JSONB, locked_by TEXT, lock_expiry TIMESTAMP WITHOUT TIME ZONE, processed BOOLEAN NOT NULL DEFAULT false );
CREATE OR REPLACE FUNCTION "{schema}"."{table}_notify"() RETURNS trigger AS $$ BEGIN PERFORM pg_notify('ably_adbc'::text, ''::text); RETURN NULL; EXCEPTION -- ensure this function can never throw an uncaught exception
 WHEN others THEN RAISE WARNING 'unexpected error in %s: %%', SQLERRM; RETURN NULL; END; $$ LANGUAGE plpgsql;
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = '{table}_trigger' AND tgrelid = '"{schema}"."{table}"'::regclass) THEN
        CREATE TRIGGER "{table}_trigger" AFTER INSERT ON "{schema}"."{table}" FOR EACH STATEMENT EXECUTE PROCEDURE "{schema}"."{table}_notify"();
    END IF;
END
$$;
"#
    )
}

/// Debezium's outbox table as its outbox extension creates it, and what the relay adds to a
/// table that exists already: the optional `timestamp` and `tracingspancontext` columns, and
/// the `relay_sequence` the relay orders by (its default fills it for inserts that name
/// their columns, as Debezium's applications' do). A table that holds rows is refused: they
/// are most likely published by Debezium already, and nothing orders them (the error says
/// how to relay them anyway).
pub fn debezium_ddl(m: &Mapping) -> String {
    let schema = m.schema.as_deref().unwrap_or("public");
    let create_schema = pg_create_schema(&format!("\"{schema}\""));
    let t = format!("\"{schema}\".\"{}\"", m.table);
    let n = &m.table;
    let seq = crate::DEBEZIUM_SEQUENCE;
    format!(
        r#"{create_schema}
CREATE TABLE IF NOT EXISTS {t} (
    id uuid NOT NULL PRIMARY KEY,
    aggregatetype varchar(255) NOT NULL,
    aggregateid varchar(255) NOT NULL,
    type varchar(255) NOT NULL,
    "timestamp" timestamp NOT NULL DEFAULT (now() AT TIME ZONE 'utc'),
    payload jsonb,
    tracingspancontext varchar(256)
);
{timestamp}
{tracing}
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = '{schema}' AND table_name = '{n}' AND column_name = '{seq}') THEN
        IF EXISTS (SELECT 1 FROM {t}) THEN
            RAISE EXCEPTION '{n} holds rows, and Debezium never deletes the rows it relays, so these were most likely published already; relayed again they would go out twice, in an order the table cannot give (its id is random, its timestamp ties). Stop Debezium once it has caught up, delete them (DELETE FROM {t}), and run migrate again; to relay them anyway, add the column first (ALTER TABLE {t} ADD COLUMN {seq} bigserial), which numbers them in the table''s physical order';
        END IF;
        ALTER TABLE {t} ADD COLUMN {seq} bigserial;
    END IF;
END
$$;
{sequence_key}
"#,
        timestamp = pg_column_where_missing(
            schema,
            n,
            "timestamp",
            "timestamp NOT NULL DEFAULT (now() AT TIME ZONE 'utc')"
        ),
        tracing = pg_column_where_missing(schema, n, "tracingspancontext", "varchar(256)"),
        sequence_key = pg_index_where_missing(
            schema,
            &format!("\"{n}_{seq}_key\""),
            &format!("CREATE UNIQUE INDEX \"{n}_{seq}_key\" ON {t} ({seq})")
        ),
    )
}

/// Open Outbox Relay's table and indexes, as its documentation gives them (without the
/// development-only `DROP TABLE`).
pub fn open_outbox_ddl(m: &Mapping) -> String {
    let schema = m.schema.as_deref().unwrap_or("public");
    let create_schema = pg_create_schema(&format!("\"{schema}\""));
    let t = format!("\"{schema}\".\"{}\"", m.table);
    let n = &m.table;
    format!(
        r#"{create_schema}
CREATE TABLE IF NOT EXISTS {t} (
    event_id UUID PRIMARY KEY,
    event_type TEXT NOT NULL,
    partition_key TEXT,
    payload BYTEA NOT NULL,
    headers JSONB NOT NULL DEFAULT '{{}}',
    status TEXT NOT NULL DEFAULT 'PENDING',
    attempts INT NOT NULL DEFAULT 0,
    last_error TEXT,
    available_at TIMESTAMPTZ NOT NULL DEFAULT NOW(),
    locked_by TEXT,
    locked_at TIMESTAMPTZ,
    delivered_at TIMESTAMPTZ,
    created_at TIMESTAMPTZ NOT NULL DEFAULT NOW(),
    updated_at TIMESTAMPTZ NOT NULL DEFAULT NOW(),
    CONSTRAINT check_valid_status CHECK ( status IN ('PENDING', 'DELIVERING', 'DELIVERED', 'DEAD') ));
{indexes}"#,
        indexes = [
            (
                "processing_queue",
                "(available_at ASC, created_at ASC) WHERE status = 'PENDING'"
            ),
            (
                "stuck_leases",
                "(locked_at ASC) WHERE status = 'DELIVERING'"
            ),
            (
                "metrics_count",
                "(status) INCLUDE (attempts) WHERE status = 'PENDING'"
            ),
            (
                "metrics_lag",
                "(status, created_at ASC) WHERE status = 'PENDING'"
            ),
            (
                "prune_delivered",
                "(delivered_at) WHERE status = 'DELIVERED'"
            ),
            ("prune_dead", "(updated_at) WHERE status = 'DEAD'"),
        ]
        .iter()
        .map(|(what, on)| {
            let name = format!("idx_{n}_{what}");
            pg_index_where_missing(schema, &name, &format!("CREATE INDEX {name} ON {t} {on}"))
                + "\n"
        })
        .collect::<String>(),
    )
}

/// The export seed's tables. Its article gives the queries, not the DDL: these are the columns
/// those queries use (`id`, `type_code`, `payload`, `status`, `processing_retries_count`,
/// `updated_at`), plus `created_at`.
pub fn export_ddl(m: &Mapping) -> String {
    let schema = m.schema.as_deref().unwrap_or("public");
    let create_schema = pg_create_schema(&format!("\"{schema}\""));
    let t = format!("\"{schema}\".\"{}\"", m.table);
    let types = format!("\"{schema}\".\"event_type\"");
    let n = &m.table;
    format!(
        r#"{create_schema}
CREATE TABLE IF NOT EXISTS {types} (
    code text PRIMARY KEY,
    max_retry_count integer NOT NULL
);
CREATE TABLE IF NOT EXISTS {t} (
    id bigserial PRIMARY KEY,
    type_code text NOT NULL REFERENCES {types} (code),
    payload jsonb NOT NULL,
    status text NOT NULL DEFAULT 'NEW',
    processing_retries_count integer NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
{new}
{processing}
"#,
        new = pg_index_where_missing(
            schema,
            &format!("\"{n}_new_idx\""),
            &format!("CREATE INDEX \"{n}_new_idx\" ON {t} (id) WHERE status = 'NEW'")
        ),
        processing = pg_index_where_missing(
            schema,
            &format!("\"{n}_processing_idx\""),
            &format!("CREATE INDEX \"{n}_processing_idx\" ON {t} (updated_at) WHERE status = 'PROCESSING'")
        ),
    )
}

/// `create` (a `CREATE INDEX` of index `name`, as SQL writes it, in `schema`) run only where
/// the index is missing. `CREATE INDEX IF NOT EXISTS` takes its SHARE lock before it looks:
/// at every `migrate` (and `run --auto-migrate`) it queued behind any transaction writing the
/// table, and every application insert queued behind it.
fn pg_index_where_missing(schema: &str, name: &str, create: &str) -> String {
    format!(
        "DO $relay$ BEGIN IF to_regclass('\"{schema}\".{}') IS NULL THEN {create}; END IF; END $relay$;",
        name.replace('\'', "''")
    )
}

/// `ALTER TABLE … ADD COLUMN` of `column` (its `definition`) to `schema.table`, run only
/// where the column is missing: `ADD COLUMN IF NOT EXISTS` takes the table's ACCESS
/// EXCLUSIVE lock before it looks, and every reader and writer of the table queued behind it.
fn pg_column_where_missing(schema: &str, table: &str, column: &str, definition: &str) -> String {
    format!(
        "DO $relay$ BEGIN IF NOT EXISTS (SELECT 1 FROM information_schema.columns WHERE \
         table_schema = '{schema}' AND table_name = '{table}' AND column_name = '{column}') \
         THEN ALTER TABLE \"{schema}\".\"{table}\" ADD COLUMN \"{column}\" {definition}; END IF; END $relay$;"
    )
}

/// The MySQL seed's `outbox_events`, as its `SHOW CREATE TABLE` gives it (the collation
/// is MySQL 8's; MariaDB gets its own default).
pub fn mysql_outbox_events_ddl(m: &Mapping) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {} (
`id` bigint unsigned NOT NULL AUTO_INCREMENT,
`type` tinyint unsigned NOT NULL,
`message` mediumtext NOT NULL,
`isConsumed` tinyint(1) NOT NULL DEFAULT '0',
`createdAt` datetime NOT NULL,
`updatedAt` datetime NOT NULL,
PRIMARY KEY (`id`),
KEY `outbox_events_is_consumed_created_at` (`isConsumed`,`createdAt`),
KEY `createdAt` (`createdAt`)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;
",
        mysql_table(m)
    )
}

/// The mapping's table on MySQL, in its database where the mapping names one (the versions
/// and nodes tables are: a table made in the URL's database instead was not found by any
/// later statement, and `migrate` recorded its steps done).
fn mysql_table(m: &Mapping) -> String {
    match &m.schema {
        Some(database) => format!("`{database}`.`{}`", m.table),
        None => format!("`{}`", m.table),
    }
}

/// An event's own columns on MySQL/MariaDB, in the order both the native table and binlog
/// capture's BLACKHOLE table declare them (binlog capture reads rows by column position).
pub const MYSQL_EVENT_COLUMNS: &str = "event_id      char(36) NOT NULL DEFAULT (UUID()),
    destination   varchar(255) NOT NULL,
    partition_key varchar(255) NULL,
    event_type    varchar(255) NOT NULL,
    payload       json NULL,
    headers       json NULL,
    mutation_id   varchar(255) NULL,";

/// The native layout on MySQL/MariaDB.
/// The native MySQL table's pending index as step 3 of its migrations remakes it (the
/// first step's, which has shipped, is left as it was): the claim's order after its
/// equalities, then the columns of its other conditions, which InnoDB checks in the index (index condition
/// pushdown) instead of reading the row of every one it passes: rows scheduled for later,
/// waiting out a retry or leased.
pub const MYSQL_PENDING_INDEX_COLUMNS: &str =
    "delivered_at, dead_at, sequence_id, available_at, locked_until";

pub fn native_mysql_ddl(m: &Mapping) -> String {
    let t = &m.table;
    let qualified = mysql_table(m);
    format!(
        "CREATE TABLE IF NOT EXISTS {qualified} (
    sequence_id   bigint unsigned NOT NULL AUTO_INCREMENT PRIMARY KEY,
    {MYSQL_EVENT_COLUMNS}
    rejected      boolean NOT NULL DEFAULT false,
    created_at    datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    available_at  datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    attempts      integer NOT NULL DEFAULT 0,
    last_error    text NULL,
    locked_by     varchar(64) NULL,
    locked_until  datetime(6) NULL,
    delivered_at  datetime(6) NULL,
    dead_at       datetime(6) NULL,
    UNIQUE KEY `{t}_event_id` (event_id),
    KEY `{t}_pending` (delivered_at, dead_at, sequence_id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;
"
    )
}
