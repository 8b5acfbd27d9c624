//! The database's settings: which database, which tables and layout, and how the relay learns
//! of new rows. Read by the store factory ([`DatabaseSettings::store_settings`]).

use std::path::PathBuf;

use anyhow::bail;
use outbox_core::redact::redact_url;
use outbox_layout::LayoutKind;
use outbox_wal::WalSettings;
use serde::{Deserialize, Serialize};

use super::{Capture, CapturedTable, PostgresSettings, StoreSettings};

/// The zero-configuration database: a SQLite file in the working directory.
pub const DEFAULT_DATABASE_URL: &str = "sqlite:outbox.db";
/// The schema of the outbox and nodes tables (on MySQL: the URL's database).
pub const DEFAULT_SCHEMA: &str = "public";
/// The nodes table of the native layout (a seed's layout may bring its own).
pub const DEFAULT_NODES_TABLE: &str = "outbox_nodes";
/// Connections per store: enough for claims, settles, lease extension and the console's reads
/// at once, few enough for a database that serves many relays.
pub const DEFAULT_POOL_SIZE: usize = 8;

/// How writers wake the relay (PostgreSQL).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum WakeupMode {
    /// Every inserting statement NOTIFYs (simple; NOTIFY serialises commits under load).
    Notify,
    /// Writers NOTIFY only while a relay waits for rows; a relay at work polls every few
    /// milliseconds instead. Cheaper for writers; one waiting node per table gets the
    /// notifications, other cluster nodes rely on poll_interval.
    Gated,
    /// Writers never NOTIFY and the relay polls every poll_interval (as with
    /// poll_fixed_rate). For applications that use two-phase commit: PostgreSQL refuses to
    /// PREPARE a transaction that has sent a NOTIFY.
    Poll,
}

/// How the relay reads events.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum CaptureMode {
    /// Claim rows from the outbox table (every store).
    Poll,
    /// Read committed INSERTs and `outbox_emit` messages from a logical replication slot,
    /// in commit order (PostgreSQL: the native or debezium layout; `migrate --capture wal`
    /// first).
    Wal,
    /// Read committed INSERTs from the binary log as a replica would, in commit order
    /// (MySQL/MariaDB: the native, mysql-outbox-events or a custom layout; `migrate
    /// --capture binlog` first).
    Binlog,
}

outbox_core::settings! {
    /// What the operator sets about the database (the keys of the same names).
    #[derive(Clone, PartialEq)]
    pub struct DatabaseSettings {
        /// Database URL: postgres://user:pass@host:port/db[?sslmode=require],
        /// mysql://user:pass@host:port/db[?require_ssl=true] (MySQL 8, MariaDB >= 10.6) or
        /// sqlite:PATH. Also OUTBOX_RELAY_DATABASE_URL or DATABASE_URL.
        pub database_url: String = DEFAULT_DATABASE_URL.into(),
        /// A file whose first line is the database URL, read once at start instead of
        /// --database-url: a systemd credential or a mounted Kubernetes Secret, so that the
        /// password is in no environment. Also OUTBOX_RELAY_DATABASE_URL_FILE.
        pub database_url_file: Option<PathBuf> = None,
        /// Extra CA certificates (PEM) for database TLS (verify-ca, verify-full; with them,
        /// sslmode=require verifies the server too).
        pub database_ca_file: Option<PathBuf> = None,
        /// The outbox table's layout: native (the relay's own tables), adbc (Ably Database
        /// Connector), open-outbox (Open Outbox Relay), export (event + event_type),
        /// mysql-outbox-events (the MySQL 8 seed), debezium (Debezium's outboxevent table), or
        /// custom (a [mapping] in the config file).
        /// Each seed layout defaults to its own table name.
        pub layout: LayoutKind = LayoutKind::Native,
        /// The column mapping of layout = "custom" ([mapping]): the table and its columns.
        pub mapping: Option<outbox_layout::Mapping> = None,
        /// How writers wake the relay on PostgreSQL: notify (every inserting statement NOTIFYs),
        /// gated (only while the relay waits for rows; cheaper for writers under load) or poll
        /// (never: the relay polls every --poll-interval; for applications that use two-phase
        /// commit, since a transaction that sent a NOTIFY cannot PREPARE TRANSACTION).
        /// `migrate` installs the matching trigger function.
        pub wakeup: WakeupMode = WakeupMode::Notify,
        /// How the relay reads events: poll (claims rows from the outbox table), wal
        /// (PostgreSQL: reads committed INSERTs and outbox_emit() messages from a logical
        /// replication slot, in commit order, at no cost to writers; needs wal_level = logical,
        /// a role with REPLICATION, and `migrate --capture wal`) or binlog (MySQL/MariaDB:
        /// reads committed INSERTs from the binary log as a replica would, in commit order;
        /// needs binlog_format = ROW, a role with REPLICATION SLAVE and REPLICATION CLIENT,
        /// and `migrate --capture binlog`).
        pub capture: CaptureMode = CaptureMode::Poll,
        /// The server id binlog capture reads the binary log as (unique among the server's
        /// replicas and the outbox's other relays). Default: one derived from the database,
        /// the table and the node id.
        pub binlog_server_id: Option<u32> = None,
        /// The MiB of events binlog capture may hold between the binary log and the sink
        /// (read ahead, in flight, parked rows claimed): the reader waits for room beyond it.
        /// Default: 32, as wal_memory_mib for WAL capture.
        pub binlog_memory_mib: Option<u64> = None,
        /// Schema of the outbox table.
        pub outbox_schema: String = DEFAULT_SCHEMA.into(),
        /// Name of the outbox table; dead letters go to <name>_dead_letters. Default: the
        /// layout's table (outbox for the native layout, outboxevent for debezium, event for
        /// export); a name given, even `outbox`, wins over the layout's.
        pub outbox_table: String = String::new(),
        /// Schema of the nodes table.
        pub nodes_schema: String = DEFAULT_SCHEMA.into(),
        /// Name of the nodes table. Default: the layout's (outbox_nodes for the native
        /// layout); a name given wins.
        pub nodes_table: String = String::new(),
        /// The channel writers NOTIFY and the relay LISTENs on (PostgreSQL). Default: the
        /// layout's (outbox_relay for the native layout); a name given wins. Set in the file
        /// or OUTBOX_RELAY_NOTIFY_CHANNEL (no flag).
        pub notify_channel: String = String::new(),
        /// Keep delivered rows, marked with delivered_at, instead of deleting them.
        pub retain_delivered: bool = false,
        /// Create missing tables and trigger at start (needs CREATE privileges).
        pub auto_migrate: bool = false,
        /// Partitions to spread ordering keys over, fixed when the outbox is created.
        pub partitions: u32 = outbox_core::partition::DEFAULT_PARTITIONS,
        /// Database connections the store keeps open.
        pub pool_size: usize = DEFAULT_POOL_SIZE,
    }
}

/// The password never shows: the URL goes through the one redactor, with the file it came
/// from.
impl std::fmt::Debug for DatabaseSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (outbox, nodes) = self.shown_tables();
        f.debug_struct("DatabaseSettings")
            .field("database_url", &self.shown_url())
            .field("layout", &self.layout.to_string())
            // The tables in effect: a layout's own names where none are configured.
            .field("outbox", &outbox)
            .field("nodes", &nodes)
            .field("retain_delivered", &self.retain_delivered)
            .finish_non_exhaustive()
    }
}

impl DatabaseSettings {
    /// The database URL as logs and `check` show it: redacted, with the file it came from.
    pub fn shown_url(&self) -> String {
        let url = redact_url(&self.database_url);
        match &self.database_url_file {
            Some(file) => format!("{url} (from {})", file.display()),
            None => url,
        }
    }

    /// The outbox and nodes tables in effect (a layout's own names where none are
    /// configured), with their schema where the store has schemas.
    pub fn shown_tables(&self) -> (String, String) {
        let tables = self.layout_tables();
        // On MySQL the default schema stands for the URL's database, and SQLite has none:
        // `public` is PostgreSQL's alone.
        let schemaless = matches!(
            self.database_kind(),
            Ok(DatabaseKind::MySql | DatabaseKind::Sqlite(_))
        );
        let qualified = |schema: &str, table: &str| match schemaless && schema == DEFAULT_SCHEMA {
            true => table.to_string(),
            false => format!("{schema}.{table}"),
        };
        (
            qualified(&tables.outbox_schema, &tables.outbox_table),
            qualified(&tables.nodes_schema, &tables.nodes_table),
        )
    }
}

/// Table names after the layout's defaults: a seed's table name replaces the native default.
#[derive(Clone, Debug, PartialEq)]
pub struct LayoutTables {
    pub outbox_schema: String,
    pub outbox_table: String,
    pub nodes_schema: String,
    pub nodes_table: String,
    pub notify_channel: String,
}

/// Which database a URL names.
#[derive(Clone, Debug, PartialEq)]
pub enum DatabaseKind {
    Postgres,
    MySql,
    Sqlite(PathBuf),
}

impl DatabaseKind {
    /// The store's name where a setting does not apply to it; `None` for PostgreSQL, where
    /// every setting does.
    pub fn other_than_postgres(&self) -> Option<&'static str> {
        match self {
            DatabaseKind::Postgres => None,
            DatabaseKind::MySql => Some("MySQL/MariaDB"),
            DatabaseKind::Sqlite(_) => Some("SQLite"),
        }
    }
}

impl DatabaseSettings {
    pub fn database_kind(&self) -> anyhow::Result<DatabaseKind> {
        let url = self.database_url.trim();
        if url.is_empty() {
            bail!("the database URL is empty: set DATABASE_URL (or --database-url, OUTBOX_RELAY_DATABASE_URL, database_url)");
        }
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            return Ok(DatabaseKind::Postgres);
        }
        if let Some(path) = url.strip_prefix("sqlite:") {
            let path = path.strip_prefix("//").unwrap_or(path);
            if path.is_empty() {
                bail!("database URL `sqlite:` needs a file path, e.g. sqlite:outbox.db");
            }
            // Each process would have a database of its own, gone when it exits: `send`
            // said it inserted an event no relay could ever read.
            let query = path.split_once('?').map_or("", |(_, query)| query);
            if path == ":memory:"
                || path.starts_with("file::memory:")
                || query.split('&').any(|p| p == "mode=memory")
            {
                bail!(
                    "database URL {url:?} is an in-memory SQLite database, which lives only \
                     inside one process: what `send` writes there no relay can read, and a \
                     relay's is gone when it stops; give a file, e.g. sqlite:outbox.db"
                );
            }
            // sqlx writes parameters after the path (`sqlite://app.db?mode=rwc`); SQLite
            // reads them only in a `file:` URI, and took the rest for the file's name.
            if path.contains('?') && !path.starts_with("file:") {
                return Ok(DatabaseKind::Sqlite(PathBuf::from(format!("file:{path}"))));
            }
            return Ok(DatabaseKind::Sqlite(PathBuf::from(path)));
        }
        let shown = redact_url(url);
        if url.starts_with("mysql://") || url.starts_with("mariadb://") {
            return Ok(DatabaseKind::MySql);
        }
        bail!("unsupported database URL {shown}: use postgres://user@host:port/db, mysql://user@host:port/db or sqlite:PATH")
    }

    /// Whether the store keeps a nodes table: PostgreSQL's native outbox (and WAL
    /// capture's), the Ably connector's layout, MySQL/MariaDB's native one, SQLite. Other
    /// mapped layouts run one active relay behind a lock, with no members to count.
    pub fn uses_nodes_table(&self) -> bool {
        match self.database_kind() {
            Ok(DatabaseKind::MySql) => self.layout == LayoutKind::Native,
            Ok(DatabaseKind::Postgres) => {
                self.capture == CaptureMode::Wal
                    || matches!(self.layout, LayoutKind::Native | LayoutKind::Adbc)
            }
            _ => true,
        }
    }

    /// The table names in effect for the layout: a name left at its default becomes the
    /// layout's own (a seed's table, the Ably connector's nodes table and channel).
    pub fn layout_tables(&self) -> LayoutTables {
        let native = LayoutKind::Native;
        // Empty: not given, so the layout's own name, else the native one. A name given
        // wins even when it is the native default (`--outbox-table outbox` beside
        // `--layout debezium` was once taken for no name, and `outboxevent` used).
        let layout_default = |set: &str, default: &str, own: Option<&str>| match set {
            "" => own.unwrap_or(default).to_string(),
            given => given.to_string(),
        };
        LayoutTables {
            outbox_schema: self.outbox_schema.clone(),
            outbox_table: layout_default(
                &self.outbox_table,
                native.default_outbox_table(),
                Some(self.layout.default_outbox_table()),
            ),
            nodes_schema: self.nodes_schema.clone(),
            nodes_table: layout_default(
                &self.nodes_table,
                DEFAULT_NODES_TABLE,
                self.layout.default_nodes_table(),
            ),
            notify_channel: layout_default(
                &self.notify_channel,
                outbox_store_postgres::DEFAULT_NOTIFY_CHANNEL,
                self.layout.default_notify_channel(),
            ),
        }
    }

    /// The column mapping of a non-native layout.
    pub fn layout_mapping(&self) -> anyhow::Result<Option<outbox_layout::Mapping>> {
        use outbox_layout::{LayoutKind as L, Mapping};
        let t = self.layout_tables();
        let mysql = self.database_kind()? == DatabaseKind::MySql;
        let database = (t.outbox_schema != DEFAULT_SCHEMA).then_some(t.outbox_schema.as_str());
        let mapping = match self.layout {
            L::Native if mysql => Mapping::native_mysql(database, &t.outbox_table, self.retain_delivered),
            L::Native => return Ok(None),
            L::Adbc => Mapping::adbc(&t.outbox_schema, &t.outbox_table),
            L::OpenOutbox => Mapping::open_outbox(&t.outbox_schema, &t.outbox_table),
            L::Export => Mapping::export(&t.outbox_schema, &t.outbox_table),
            L::MysqlOutboxEvents => Mapping::mysql_outbox_events(database, &t.outbox_table),
            L::Debezium => Mapping::debezium(&t.outbox_schema, &t.outbox_table),
            L::Custom => self.mapping.clone().ok_or_else(|| {
                anyhow::anyhow!("layout = \"custom\" needs a [mapping] section naming the table and its columns (see the README, \"Layouts\")")
            })?,
        };
        mapping
            .validate()
            .map_err(|e| anyhow::anyhow!(e.report()))?;
        Ok(Some(mapping))
    }

    /// Table, schema and channel names are SQL identifiers: refused here, before any store
    /// opens, so that a bad name is a configuration error like any other bad value.
    pub fn check_names(&self) -> anyhow::Result<()> {
        let t = self.layout_tables();
        let report = |e: outbox_core::StoreError| anyhow::anyhow!(e.report());
        outbox_core::ident::TableName::new(&t.outbox_schema, &t.outbox_table).map_err(report)?;
        outbox_core::ident::TableName::new(&t.nodes_schema, &t.nodes_table).map_err(report)?;
        outbox_core::ident::Ident::new(&t.notify_channel, "notify channel").map_err(report)?;
        self.layout_mapping()?;
        Ok(())
    }

    /// The server and the database the URL reaches, without credentials or parameters: two
    /// URLs that differ only there reach the same tables. A default port is spelled out.
    pub fn identity(&self) -> (String, String) {
        if let Ok(DatabaseKind::Sqlite(path)) = self.database_kind() {
            let file = format!("sqlite:{}", path.display());
            return (file.clone(), file);
        }
        let url = self.database_url.trim();
        let Some((scheme, rest)) = url.split_once("://") else {
            let url = url.split(['?', '#']).next().unwrap_or(url);
            return (url.to_string(), url.to_string());
        };
        // The credentials go first: a password may hold a `/`, `?` or `#`.
        let rest = without_user_info(rest);
        let rest = rest.split(['?', '#']).next().unwrap_or(rest);
        let (host, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let host = same_host(host);
        let host = host.as_str();
        let (scheme, port) = match scheme {
            "postgres" | "postgresql" => ("postgres", "5432"),
            _ => ("mysql", "3306"),
        };
        // `host:port`, `[v6]:port` carry a port; `host`, `[v6]` get the default.
        let has_port = host.rsplit_once(':').is_some_and(|(_, p)| !p.contains(']'));
        let server = if has_port {
            format!("{scheme}://{host}")
        } else {
            format!("{scheme}://{host}:{port}")
        };
        let database = format!("{server}{path}");
        (server, database)
    }

    /// The replication slot of WAL capture (see [`WalSettings::slot_name`]).
    pub fn slot_name(&self, wal: &WalSettings) -> String {
        let t = self.layout_tables();
        wal.slot_name(&self.postgres_database(), &t.outbox_schema, &t.outbox_table)
    }

    /// The database a PostgreSQL URL connects to, as libpq picks it: `dbname=`, the path,
    /// or else the user's name. (A URL without a path once named the default slot
    /// `outbox_relay_`, the same for every database of the server.)
    fn postgres_database(&self) -> String {
        let url = self.database_url.trim();
        let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
        // The credentials go first: a password may hold a `/`, `?` or `#`.
        let user = outbox_core::redact::user_info_end(rest)
            .map(|at| rest[..at].split(':').next().unwrap_or_default());
        let rest = without_user_info(rest);
        let (base, query) = rest.split_once('?').unwrap_or((rest, ""));
        let param = |name: &str| {
            query
                .split('&')
                .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
                .filter(|v| !v.is_empty())
                .map(str::to_string)
        };
        let path = base.find('/').map_or("", |slash| &base[slash + 1..]);
        let path = path.split('#').next().unwrap_or_default();
        param("dbname")
            .or_else(|| (!path.is_empty()).then(|| path.to_string()))
            .or_else(|| param("user"))
            .or_else(|| user.filter(|u| !u.is_empty()).map(str::to_string))
            .unwrap_or_else(|| "postgres".into())
    }

    /// Which store the settings name, and its options: `wal` for `capture = "wal"`,
    /// `max_attempts` for the mapped stores' dead-letter rule, `node_id` for the sessions'
    /// application_name.
    pub fn store_settings(
        &self,
        wal: &WalSettings,
        max_attempts: u32,
        node_id: Option<&str>,
    ) -> anyhow::Result<StoreSettings> {
        let report = |e: outbox_core::StoreError| crate::error::failure(e.report(), &e);
        let tables = self.layout_tables();
        let mut mapping = self.layout_mapping()?;
        Ok(match self.database_kind()? {
            DatabaseKind::Postgres => {
                // WAL capture of a mapped table (Debezium's) reads it from the stream and keeps
                // parked events and dead letters in native tables of its own, `<table>_relay`.
                let captured = match self.capture {
                    CaptureMode::Wal => mapping.take(),
                    CaptureMode::Poll | CaptureMode::Binlog => None,
                };
                let native_table = match &captured {
                    Some(_) => format!("{}_relay", tables.outbox_table),
                    None => tables.outbox_table.clone(),
                };
                let mut pg_tables = outbox_store_postgres::Tables::new(
                    &tables.outbox_schema,
                    &native_table,
                    &tables.nodes_schema,
                    &tables.nodes_table,
                    &tables.notify_channel,
                )
                .map_err(report)?;
                pg_tables.partition_count = self.partitions;
                pg_tables.gated_wakeup = self.wakeup == WakeupMode::Gated;
                // WAL capture needs no NOTIFY: the stream wakes the relay.
                pg_tables.poll_wakeup =
                    self.wakeup == WakeupMode::Poll || self.capture == CaptureMode::Wal;
                if self.capture == CaptureMode::Wal {
                    outbox_wal::schema::sibling_names_fit(&pg_tables.outbox).map_err(report)?;
                }
                let capture = match self.capture {
                    // Refused by `validate` on PostgreSQL.
                    CaptureMode::Poll | CaptureMode::Binlog => None,
                    CaptureMode::Wal => Some(Capture {
                        slot: self.slot_name(wal),
                        legacy_slot: wal.legacy_slot(&tables.outbox_schema, &tables.outbox_table),
                        publication: outbox_core::ident::Ident::new(
                            wal.publication(),
                            "publication name",
                        )
                        .map_err(report)?,
                        source: captured
                            .map(CapturedTable::of)
                            .transpose()
                            .map_err(report)?
                            .map(Box::new),
                    }),
                };
                StoreSettings::Postgres(Box::new(PostgresSettings {
                    options: outbox_store_postgres::PgOptions {
                        url: self.database_url.clone(),
                        tables: pg_tables,
                        retain_delivered: self.retain_delivered,
                        ca_file: self.database_ca_file.clone(),
                        pool_size: self.pool_size,
                        application_name: Some(match node_id {
                            Some(node) => format!("outbox-relay {node}"),
                            None => "outbox-relay".into(),
                        }),
                        operation_timeout: None,
                    },
                    mapped: mapping.map(|m| (m, self.layout.to_string())),
                    max_attempts,
                    capture,
                }))
            }
            DatabaseKind::MySql => {
                // PostgreSQL-only layouts were refused by `validate`.
                let Some(mapping) = mapping else {
                    bail!("every MySQL layout is a mapping");
                };
                let server_id = self.binlog_server_id.unwrap_or_else(|| {
                    let database = outbox_binlog::database_of(&self.database_url)
                        .ok()
                        .or_else(|| mapping.schema.clone())
                        .unwrap_or_default();
                    super::binlog::default_server_id(
                        &database,
                        &mapping.table,
                        node_id.unwrap_or_default(),
                    )
                });
                let options = outbox_store_mysql::MySqlOptions {
                    url: self.database_url.clone(),
                    mapping,
                    layout: self.layout.to_string(),
                    max_attempts,
                    pool_size: self.pool_size,
                    nodes_table: (self.layout == LayoutKind::Native).then_some(tables.nodes_table),
                    operation_timeout: None,
                };
                match self.capture {
                    CaptureMode::Binlog => StoreSettings::MySqlBinlog(
                        Box::new(options),
                        super::binlog::BinlogSettings { server_id },
                    ),
                    CaptureMode::Poll | CaptureMode::Wal => StoreSettings::MySql(Box::new(options)),
                }
            }
            // Other layouts and table names were refused by `validate`.
            DatabaseKind::Sqlite(path) => StoreSettings::Sqlite {
                path,
                retain_delivered: self.retain_delivered,
            },
        })
    }
}

/// A URL's text after `://` without its user info (see [`outbox_core::redact::user_info_end`]).
fn without_user_info(after_scheme: &str) -> &str {
    outbox_core::redact::user_info_end(after_scheme)
        .map_or(after_scheme, |at| &after_scheme[at + 1..])
}

/// `host` (with its port, if any) as one server is spelled whichever way a URL names it:
/// host names are not case-sensitive, and the loopback has many names (`localhost`,
/// `127.0.0.1`, `[::1]`). Two outboxes of one table named `127.0.0.1` and `localhost` were
/// both run, each relaying every event.
fn same_host(host: &str) -> String {
    let (name, port) = match host.rsplit_once(':') {
        Some((name, port)) if !port.contains(']') && !name.is_empty() => (name, Some(port)),
        _ => (host, None),
    };
    let name = name.to_ascii_lowercase();
    let loopback = name == "localhost"
        || name == "[::1]"
        || name
            .parse::<std::net::Ipv4Addr>()
            .is_ok_and(|ip| ip.is_loopback());
    let name = if loopback {
        "localhost".to_string()
    } else {
        name
    };
    match port {
        Some(port) => format!("{name}:{port}"),
        None => name,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_urls_pick_the_store() {
        let with_url = |url: &str| DatabaseSettings {
            database_url: url.into(),
            ..DatabaseSettings::default()
        };
        assert_eq!(
            DatabaseSettings::default().database_kind().unwrap(),
            DatabaseKind::Sqlite("outbox.db".into())
        );
        let pg = with_url("postgresql://h/db");
        assert_eq!(pg.database_kind().unwrap(), DatabaseKind::Postgres);
        let err = with_url("oracle://x:pw@h")
            .database_kind()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("use postgres://") && !err.contains("pw"),
            "{err}"
        );
    }

    /// `check` printed `outbox: "public.outbox"` for a MySQL or SQLite store, neither of
    /// which has a `public` schema.
    #[test]
    fn the_settings_name_the_tables_as_each_store_does() {
        let shown = |url: &str| {
            format!(
                "{:?}",
                DatabaseSettings {
                    database_url: url.into(),
                    ..DatabaseSettings::default()
                }
            )
        };
        for url in ["mysql://u@h/shop", "sqlite:outbox.db"] {
            let text = shown(url);
            assert!(text.contains("outbox: \"outbox\""), "{text}");
        }
        let text = shown("postgres://u@h/shop");
        assert!(text.contains("outbox: \"public.outbox\""), "{text}");
    }

    #[test]
    fn a_seed_layout_brings_its_own_table_names() {
        let adbc = DatabaseSettings {
            layout: LayoutKind::Adbc,
            ..DatabaseSettings::default()
        };
        let t = adbc.layout_tables();
        assert_eq!(
            (t.outbox_table.as_str(), t.nodes_table.as_str()),
            ("outbox", "nodes")
        );
        assert_eq!(t.notify_channel, "ably_adbc");
        let export = DatabaseSettings {
            layout: LayoutKind::Export,
            nodes_table: "my_nodes".into(),
            ..DatabaseSettings::default()
        };
        let t = export.layout_tables();
        assert_eq!(
            (t.outbox_table.as_str(), t.nodes_table.as_str()),
            ("event", "my_nodes")
        );
        let named = DatabaseSettings {
            layout: LayoutKind::OpenOutbox,
            outbox_table: "events".into(),
            ..DatabaseSettings::default()
        };
        assert_eq!(named.layout_tables().outbox_table, "events");
    }

    #[test]
    fn a_table_name_given_wins_over_the_layouts_even_when_it_is_the_native_default() {
        let debezium = |outbox_table: &str| DatabaseSettings {
            layout: LayoutKind::Debezium,
            outbox_table: outbox_table.into(),
            ..DatabaseSettings::default()
        };
        assert_eq!(debezium("").layout_tables().outbox_table, "outboxevent");
        assert_eq!(debezium("outbox").layout_tables().outbox_table, "outbox");
        assert_eq!(
            debezium("myevents").layout_tables().outbox_table,
            "myevents"
        );
        let native = DatabaseSettings::default().layout_tables();
        assert_eq!(
            (native.outbox_table.as_str(), native.nodes_table.as_str()),
            ("outbox", DEFAULT_NODES_TABLE)
        );
        assert_eq!(
            native.notify_channel,
            outbox_store_postgres::DEFAULT_NOTIFY_CHANNEL
        );
        let adbc = |nodes_table: &str, notify_channel: &str| {
            DatabaseSettings {
                layout: LayoutKind::Adbc,
                nodes_table: nodes_table.into(),
                notify_channel: notify_channel.into(),
                ..DatabaseSettings::default()
            }
            .layout_tables()
        };
        let t = adbc(
            DEFAULT_NODES_TABLE,
            outbox_store_postgres::DEFAULT_NOTIFY_CHANNEL,
        );
        assert_eq!(t.nodes_table, DEFAULT_NODES_TABLE, "given, so kept");
        assert_eq!(
            t.notify_channel,
            outbox_store_postgres::DEFAULT_NOTIFY_CHANNEL
        );
        let t = adbc("", "");
        assert_eq!(
            (t.nodes_table.as_str(), t.notify_channel.as_str()),
            ("nodes", "ably_adbc")
        );
    }

    #[test]
    fn the_default_slot_is_named_after_the_database_libpq_would_connect_to() {
        let slot = |url: &str| {
            DatabaseSettings {
                database_url: url.into(),
                ..DatabaseSettings::default()
            }
            .slot_name(&WalSettings::default())
        };
        assert_eq!(slot("postgres://relay:pw@db:5432/app"), "outbox_relay_app");
        assert_eq!(
            slot("postgres://relay:pw@db/app?sslmode=require"),
            "outbox_relay_app"
        );
        assert_eq!(
            slot("postgres://relay:pw@db"),
            "outbox_relay_relay",
            "the user's name"
        );
        assert_eq!(slot("postgres://relay@db/"), "outbox_relay_relay");
        assert_eq!(
            slot("postgres://db?dbname=shop&user=x"),
            "outbox_relay_shop"
        );
        assert_eq!(slot("postgres://db?user=billing"), "outbox_relay_billing");
        assert_eq!(slot("postgres://db"), "outbox_relay_postgres");
        // A password holding a `/` once made the slot's name out of the password's end
        // (`outbox_relay_qw_e_db_app`), putting part of it in `pg_replication_slots`.
        assert_eq!(slot("postgres://relay:Zx9/Qw+e@db/app"), "outbox_relay_app");
        assert_eq!(slot("postgres://relay:a?b@db"), "outbox_relay_relay");
    }

    /// Whatever prints the resolved store settings (a `{:?}` in a log line, an `expect`)
    /// shows no password: their URLs' `Debug` is redacted.
    #[test]
    fn the_store_settings_debug_shows_no_password() {
        for url in [
            "postgres://relay:hunter2-pg@db/app",
            "mysql://relay:hunter2-my@db/app",
        ] {
            let settings = DatabaseSettings {
                database_url: url.into(),
                ..DatabaseSettings::default()
            };
            let resolved = settings
                .store_settings(&WalSettings::default(), 5, None)
                .unwrap();
            let shown = format!("{resolved:?}");
            assert!(shown.contains("relay:***@db"), "{shown}");
            assert!(!shown.contains("hunter2"), "{shown}");
        }
    }

    /// Two URLs that differ only in credentials, parameters or a spelled-out default port
    /// reach the same database.
    #[test]
    fn a_url_identity_leaves_out_credentials_and_spells_out_the_port() {
        let identity = |url: &str| {
            DatabaseSettings {
                database_url: url.into(),
                ..DatabaseSettings::default()
            }
            .identity()
        };
        let shown = identity("postgres://relay:secret@db/app?sslmode=require");
        assert_eq!(
            shown,
            ("postgres://db:5432".into(), "postgres://db:5432/app".into())
        );
        assert_eq!(identity("postgresql://other@db:5432/app"), shown);
        assert_eq!(identity("mysql://relay@db/app").1, "mysql://db:3306/app");
        // A password holding a `/`, `?` or `#` is no part of the host (the identity is quoted
        // in errors).
        assert_eq!(identity("postgres://relay:Zx9/Qw+e@db/app?x=1"), shown);
        assert_eq!(identity("postgres://relay:a#b?c@db/app"), shown);
        // One server, however its host is spelled.
        assert_eq!(
            identity("mysql://u@127.0.0.1:3306/app"),
            identity("mysql://u@LocalHost/app")
        );
        assert_eq!(
            identity("postgres://u@[::1]/app"),
            identity("postgres://u@127.0.0.2:5432/app")
        );
        assert_eq!(identity("postgres://u@DB/app"), shown);
        assert_ne!(identity("postgres://u@db2/app"), shown);
        assert_ne!(
            identity("postgres://u@localhost:5433/app").1,
            identity("postgres://u@localhost/app").1
        );
    }
}
