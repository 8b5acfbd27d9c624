//! Configuration: defaults, then a TOML file, then `OUTBOX_RELAY_*` environment variables
//! (and `DATABASE_URL`), then command-line flags. Later sources win.
//!
//! [`Config`] declares every setting: its key (in the file, and as `OUTBOX_RELAY_<KEY>`), its
//! type and its default (`Config::default`). A setting that has a flag is a field of the same
//! name in `cli.rs`, serialized as it is into the flags' layer; the flag's help shows the
//! default from here. [`Config::resolve`] turns the result into what `run` hands to the
//! engine, the cluster coordinator, the sinks and the HTTP server.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::{Dict, Value};
use figment::{Figment, Provider};
use outbox_cluster::ClusterConfig;
use outbox_core::redact::{redact_url, Secret};
use outbox_core::{Health, NodeId, RetryPolicy};
use outbox_engine::{EngineConfig, WakeMode};
use outbox_layout::{Dialect, LayoutKind};
use outbox_publishers::{RouteConfig, SinkConfig};

use crate::store::StoreSettings;
use serde::{Deserialize, Serialize};

/// The zero-configuration database: a SQLite file in the working directory.
pub const DEFAULT_DATABASE_URL: &str = "sqlite:outbox.db";
/// The zero-configuration sink.
pub const DEFAULT_SINK: &str = "stdout";
/// Loopback only: metrics and health are not for the outside world unless asked.
pub const DEFAULT_HTTP_ADDR: &str = "127.0.0.1:2259";
/// The file read from the working directory when `--config` is not given.
pub const DEFAULT_CONFIG_FILE: &str = "outbox-relay.toml";
/// The schema of the outbox and nodes tables (on MySQL: the URL's database).
const DEFAULT_SCHEMA: &str = "public";
const DEFAULT_NODES_TABLE: &str = "outbox_nodes";
/// The name every slot had by default before names were derived ([`Config::slot_name`]), and
/// the start of those names.
const DEFAULT_SLOT: &str = "outbox_relay";
const DEFAULT_PUBLICATION: &str = "outbox_relay";

/// Durations are written with units: `500ms`, `2s`, `5m`, `7d`.
pub use outbox_core::time::duration_text as duration;

/// Ordering mode: per key (partitioned across nodes), or none (any node, any row).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum OrderingMode {
    /// Events of one key are published in sequence order, across failover and rebalancing.
    Key,
    /// No ordering: every node claims any ready rows (maximum throughput).
    None,
}

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

/// How the relay reads events (PostgreSQL).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum CaptureMode {
    /// Claim rows from the outbox table (every store).
    Poll,
    /// Read committed INSERTs and `outbox_emit` messages from a logical replication slot,
    /// in commit order (PostgreSQL, native layout; `migrate --capture wal` first).
    Wal,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub database_url: String,
    /// A file holding the database URL (`--database-url-file`), read once at start in place
    /// of `database_url`: for systemd credentials and Kubernetes secret volumes, since the
    /// URL carries the password.
    pub database_url_file: Option<PathBuf>,
    /// Extra CA certificates (PEM) for database TLS.
    pub database_ca_file: Option<PathBuf>,
    /// One sink for every destination; when set it replaces `[sinks]` and `[[routes]]`.
    pub sink: Option<String>,
    /// Named sinks (`[sinks.NAME]`), used with `[[routes]]`.
    pub sinks: BTreeMap<String, SinkConfig>,
    /// Destination globs to sinks and target templates, first match wins.
    pub routes: Vec<RouteConfig>,
    pub outbox_schema: String,
    pub outbox_table: String,
    pub nodes_schema: String,
    pub nodes_table: String,
    pub notify_channel: String,
    pub retain_delivered: bool,
    pub auto_migrate: bool,
    #[serde(with = "duration")]
    pub poll_interval: Duration,
    pub poll_fixed_rate: bool,
    pub batch_size: usize,
    pub max_in_flight: usize,
    #[serde(with = "duration")]
    pub lease: Duration,
    #[serde(with = "duration")]
    pub publish_timeout: Duration,
    #[serde(with = "duration")]
    pub shutdown_timeout: Duration,
    #[serde(with = "duration")]
    pub heartbeat_interval: Duration,
    #[serde(with = "duration")]
    pub heartbeat_timeout: Duration,
    /// `host:port` for /healthz, /readyz, /metrics, the admin API and the dashboard; empty
    /// turns the server off.
    pub http_addr: String,
    /// The admin API's bearer token (`OUTBOX_RELAY_ADMIN_TOKEN`); never shown.
    pub admin_token: Option<Secret>,
    /// A file holding the admin API's bearer token (`--admin-token-file`).
    pub admin_token_file: Option<PathBuf>,
    /// Host names the HTTP server answers to besides IP addresses and `localhost`: the
    /// names a browser or proxy reaches it by. Any other `Host` is refused (DNS rebinding).
    #[serde(deserialize_with = "host_names")]
    pub allowed_hosts: Vec<String>,
    pub node_id: Option<String>,
    pub ordering: OrderingMode,
    /// Partitions a new outbox is created with (`migrate`); fixed afterwards.
    pub partitions: u32,
    pub pool_size: usize,
    pub log_format: LogFormat,
    pub log_level: String,
    /// `[retry]`: base_delay, max_delay, max_attempts, max_attempts_by_type.
    pub retry: RetryPolicy,
    /// The outbox table's layout: the relay's own (`native`), a seed's, or `custom`.
    pub layout: LayoutKind,
    /// The column mapping of `layout = "custom"` (`[mapping]`).
    pub mapping: Option<outbox_layout::Mapping>,
    /// How writers wake the relay: `notify` or `gated`; `migrate` installs the matching trigger.
    pub wakeup: WakeupMode,
    /// How events are read: `poll` (the table) or `wal` (logical replication).
    pub capture: CaptureMode,
    /// The logical replication slot of `capture = "wal"`; empty: named after the database
    /// and table ([`Config::slot_name`]).
    pub slot: String,
    /// The publication of `capture = "wal"`.
    pub publication: String,
    /// `[[outboxes]]`: several outboxes in one process, each a table of settings that
    /// replace the top-level ones ([`Config::outboxes`]).
    pub outboxes: Vec<Dict>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            database_url: DEFAULT_DATABASE_URL.into(),
            database_url_file: None,
            database_ca_file: None,
            sink: None,
            sinks: Default::default(),
            routes: Vec::new(),
            outbox_schema: DEFAULT_SCHEMA.into(),
            outbox_table: LayoutKind::Native.default_outbox_table().into(),
            nodes_schema: DEFAULT_SCHEMA.into(),
            nodes_table: DEFAULT_NODES_TABLE.into(),
            notify_channel: outbox_store_postgres::DEFAULT_NOTIFY_CHANNEL.into(),
            retain_delivered: false,
            auto_migrate: false,
            poll_interval: outbox_engine::DEFAULT_POLL_INTERVAL,
            poll_fixed_rate: false,
            batch_size: outbox_engine::DEFAULT_BATCH_SIZE,
            max_in_flight: outbox_engine::DEFAULT_MAX_IN_FLIGHT,
            lease: outbox_engine::DEFAULT_LEASE,
            publish_timeout: outbox_engine::DEFAULT_PUBLISH_TIMEOUT,
            shutdown_timeout: outbox_engine::DEFAULT_SHUTDOWN_TIMEOUT,
            heartbeat_interval: outbox_cluster::DEFAULT_HEARTBEAT_INTERVAL,
            heartbeat_timeout: outbox_cluster::DEFAULT_HEARTBEAT_TIMEOUT,
            http_addr: DEFAULT_HTTP_ADDR.into(),
            admin_token: None,
            admin_token_file: None,
            allowed_hosts: Vec::new(),
            node_id: None,
            ordering: OrderingMode::Key,
            partitions: outbox_core::partition::DEFAULT_PARTITIONS,
            pool_size: 8,
            log_format: LogFormat::Text,
            log_level: "info".into(),
            retry: RetryPolicy::default(),
            layout: LayoutKind::Native,
            mapping: None,
            wakeup: WakeupMode::Notify,
            capture: CaptureMode::Poll,
            // Empty: named after the database and table ([`Config::slot_name`]).
            slot: String::new(),
            publication: DEFAULT_PUBLICATION.into(),
            outboxes: Vec::new(),
        }
    }
}

/// Debug output never shows the database password.
impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tables = self.layout_tables();
        let database_url = match &self.database_url_file {
            Some(file) => format!(
                "{} (from {})",
                redact_url(&self.database_url),
                file.display()
            ),
            None => redact_url(&self.database_url),
        };
        f.debug_struct("Config")
            .field("database_url", &database_url)
            .field("sink", &self.sink.as_deref().map(redact_url))
            .field("sinks", &self.sinks.keys().collect::<Vec<_>>())
            .field("layout", &self.layout.to_string())
            // The tables in effect: a layout's own names where none are configured.
            .field(
                "outbox",
                &format!("{}.{}", tables.outbox_schema, tables.outbox_table),
            )
            .field(
                "nodes",
                &format!("{}.{}", tables.nodes_schema, tables.nodes_table),
            )
            .field("poll_interval", &self.poll_interval)
            .field("poll_fixed_rate", &self.poll_fixed_rate)
            .field("retain_delivered", &self.retain_delivered)
            .field("batch_size", &self.batch_size)
            .field("lease", &self.lease)
            .field("http_addr", &self.http_addr)
            .field(
                "admin_token",
                &(self.admin_token.is_some() || self.admin_token_file.is_some()).then_some("***"),
            )
            .finish_non_exhaustive()
    }
}

/// The Ably connector's environment variables and the settings they set (`layout = "adbc"`).
pub const ADBC_ALIASES: &[(&str, &str)] = &[
    ("ADBC_POSTGRES_CONNECTION_URI", "database_url"),
    ("ADBC_OUTBOX_TABLE_TABLE_SCHEMA", "outbox_schema"),
    ("ADBC_OUTBOX_TABLE_TABLE_NAME", "outbox_table"),
    ("ADBC_NODES_TABLE_TABLE_SCHEMA", "nodes_schema"),
    ("ADBC_NODES_TABLE_TABLE_NAME", "nodes_table"),
    ("ADBC_OUTBOX_TABLE_AUTO_CREATE", "auto_migrate"),
    ("ADBC_POLL_INTERVAL", "poll_interval"),
    ("ADBC_POLL_FIXED_RATE", "poll_fixed_rate"),
    ("ADBC_HEARTBEAT_TIMEOUT", "heartbeat_timeout"),
];

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

impl Config {
    /// Layers the sources. `file` is `--config`; without it `outbox-relay.toml` is read if
    /// present. `flags` is the command line's layer (`Cli::flags`).
    pub fn load(file: Option<&Path>, flags: impl Provider + Clone) -> anyhow::Result<Config> {
        // The layers above the defaults, kept apart so that a database URL given anywhere
        // can be told from the default one (`database_url_file` refuses the former).
        let mut figment = Figment::new();
        match file {
            Some(path) => {
                if !path.exists() {
                    bail!(
                        "config file {} does not exist (check --config or OUTBOX_RELAY_CONFIG)",
                        path.display()
                    );
                }
                figment = figment.merge(Toml::file(path));
            }
            None if Path::new(DEFAULT_CONFIG_FILE).exists() => {
                figment = figment.merge(Toml::file(DEFAULT_CONFIG_FILE));
            }
            None => {}
        }
        let env = Env::prefixed("OUTBOX_RELAY_")
            .split("__")
            // OUTBOX_RELAY_CONFIG names the file (`--config`); it is no setting. The admin
            // token is read verbatim below: figment would read `0123…` as a number.
            .ignore(&["webhook_secret", "config", "admin_token"]);
        let layout: LayoutKind = figment
            .clone()
            .merge(env.clone())
            .merge(flags.clone())
            .extract_inner("layout")
            .unwrap_or_default();
        figment = figment.merge(
            Env::raw()
                .only(&["DATABASE_URL"])
                .map(|_| "database_url".into()),
        );
        if layout == LayoutKind::Adbc {
            // The Ably connector's own settings carry over (below OUTBOX_RELAY_* and flags).
            figment = figment.merge(Env::raw().filter_map(|key| {
                ADBC_ALIASES
                    .iter()
                    .find(|(adbc, _)| key.as_str().eq_ignore_ascii_case(adbc))
                    .map(|(_, ours)| (*ours).into())
            }));
        }
        figment = figment.merge(env);
        if let Ok(token) = std::env::var("OUTBOX_RELAY_ADMIN_TOKEN") {
            figment = figment.merge(Serialized::default("admin_token", Secret::new(token)));
        }
        figment = figment.merge(flags);
        let url_given = figment.contains("database_url");
        let mut config: Config = Figment::from(Serialized::defaults(Config::default()))
            .merge(figment)
            .extract()
            .map_err(|e| anyhow::anyhow!("invalid configuration: {}", describe_figment_error(e)))?;
        config.read_database_url_file(url_given)?;
        if config.outboxes.is_empty() {
            config.validate()?;
        } else {
            // The top level only lends its settings to the outboxes, each validated whole
            // (`outboxes`); what belongs to the process is checked here.
            config.http_socket_addr()?;
            config.allowed_host_names()?;
        }
        Ok(config)
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        self.database_kind()?;
        self.allowed_host_names()?;
        if self.batch_size == 0 || self.batch_size > 50_000 {
            bail!(
                "batch_size must be between 1 and 50000 (got {})",
                self.batch_size
            );
        }
        if self.max_in_flight < self.batch_size {
            bail!(
                "max_in_flight ({}) must be at least batch_size ({})",
                self.max_in_flight,
                self.batch_size
            );
        }
        if self.lease < Duration::from_millis(300) {
            bail!("lease must be at least 300ms (got {:?})", self.lease);
        }
        if self.poll_interval.is_zero() {
            bail!("poll_interval must be greater than zero");
        }
        // A node stops publishing a partition at 3/4 of its lease (heartbeat_timeout) after
        // the last renewal; with fewer than three renewals in that time, one slow heartbeat
        // statement hands every partition over.
        if self.heartbeat_timeout < self.heartbeat_interval * 3 {
            bail!(
                "heartbeat_timeout ({:?}) must be at least 3 x heartbeat_interval ({:?}): leases \
                 are renewed every interval, and one late renewal must not lose them",
                self.heartbeat_timeout,
                self.heartbeat_interval
            );
        }
        // Below this, every publish times out and is sent again, duplicating every event.
        if self.publish_timeout < Duration::from_millis(100) {
            bail!(
                "publish_timeout must be at least 100ms (got {:?}): every publish would time out \
                 and be sent again",
                self.publish_timeout
            );
        }
        // A row lease stops guarding its row when it runs out: a publish still waiting then
        // can be confirmed after another node took the row and published the key's next
        // events. (Partition leases bound each publish by themselves, see the engine.)
        if self.publish_timeout >= self.lease {
            bail!(
                "publish_timeout ({:?}) must be shorter than lease ({:?}): a publish must not \
                 outlive the lease on its row",
                self.publish_timeout,
                self.lease
            );
        }
        if self.partitions == 0 || self.partitions > 4096 {
            bail!(
                "partitions must be between 1 and 4096 (got {})",
                self.partitions
            );
        }
        if self.retry.max_attempts == 0 {
            bail!("retry.max_attempts must be at least 1");
        }
        if self.retry.base_delay > self.retry.max_delay {
            bail!("retry.base_delay must not exceed retry.max_delay");
        }
        self.http_socket_addr()?;
        self.refuse_settings_without_effect()?;
        self.check_names()?;
        Ok(())
    }

    /// A setting that cannot apply to this configuration is an error, never silently ignored.
    fn refuse_settings_without_effect(&self) -> anyhow::Result<()> {
        let database = self.database_kind()?;
        let store = match database {
            DatabaseKind::Postgres => None,
            DatabaseKind::MySql => Some("MySQL/MariaDB"),
            DatabaseKind::Sqlite(_) => Some("SQLite"),
        };
        if let Some(store) = store {
            if self.notify_channel != outbox_store_postgres::DEFAULT_NOTIFY_CHANNEL {
                bail!(
                    "notify_channel has no effect on {store}, which has no NOTIFY (the relay \
                     {}): remove the setting",
                    self.wake_description()
                );
            }
            if self.wakeup == WakeupMode::Gated {
                bail!(
                    "wakeup = \"gated\" (--wakeup gated) gates PostgreSQL's NOTIFY, which {store} \
                     does not have: remove it (or use --wakeup poll to poll at a fixed rate)"
                );
            }
        }
        if let DatabaseKind::Sqlite(_) = database {
            if self.layout != LayoutKind::Native {
                bail!(
                    "layout = \"{}\" runs on PostgreSQL or MySQL/MariaDB; SQLite supports the \
                     native layout only: remove --layout (or use a PostgreSQL or MySQL URL)",
                    self.layout
                );
            }
            if self.outbox_table != LayoutKind::Native.default_outbox_table()
                || self.outbox_schema != DEFAULT_SCHEMA
            {
                bail!(
                    "outbox_table and outbox_schema have no effect on SQLite, whose store uses \
                     `outbox`: remove them"
                );
            }
        }
        if database == DatabaseKind::MySql && !self.layout.runs_on(Dialect::MySql) {
            bail!(
                "layout = \"{}\" is a PostgreSQL table (its seed defines it for PostgreSQL); on \
                 MySQL/MariaDB use the native or mysql-outbox-events layout, or a custom mapping",
                self.layout
            );
        }
        if self.layout != LayoutKind::Custom && self.mapping.is_some() {
            bail!(
                "a [mapping] section has no effect with layout = \"{}\": set layout = \"custom\" \
                 to use it, or remove it",
                self.layout
            );
        }
        if self.poll_fixed_rate && self.wakeup == WakeupMode::Gated {
            bail!(
                "poll_fixed_rate (--poll-fixed-rate) and wakeup = \"gated\" contradict each other: \
                 a fixed-rate relay never listens, so the gate would wake nobody; use --wakeup \
                 poll to poll at a fixed rate, or drop --poll-fixed-rate"
            );
        }
        if self.capture == CaptureMode::Wal {
            self.refuse_settings_without_effect_on_wal(&database)?;
        } else if !self.slot.is_empty() || self.publication != DEFAULT_PUBLICATION {
            bail!(
                "slot and publication apply to WAL capture only: add --capture wal \
                 (capture = \"wal\"), or remove them"
            );
        }
        if self.sink.is_some() && (!self.routes.is_empty() || !self.sinks.is_empty()) {
            bail!(
                "sink (--sink, OUTBOX_RELAY_SINK) replaces every [sinks.NAME] and [[routes]], \
                 which would be ignored: give either sink or [sinks] with [[routes]], not both"
            );
        }
        for route in &self.routes {
            route.cloudevents().map_err(anyhow::Error::msg)?;
        }
        Ok(())
    }

    fn refuse_settings_without_effect_on_wal(&self, database: &DatabaseKind) -> anyhow::Result<()> {
        if *database != DatabaseKind::Postgres {
            bail!("capture = \"wal\" reads PostgreSQL's logical replication: use a postgres:// URL, or --capture poll");
        }
        if !matches!(self.layout, LayoutKind::Native | LayoutKind::Debezium) {
            bail!(
                "capture = \"wal\" reads the native outbox table, Debezium's outbox table \
                 (layout = \"debezium\") and outbox_emit messages; layout = \"{}\" is polled: \
                 use --capture poll with it",
                self.layout
            );
        }
        let refused = [
            (self.retain_delivered, "retain_delivered (--retain-delivered): WAL capture deletes a delivered row; replay has nothing to read"),
            (self.ordering == OrderingMode::None, "ordering = \"none\" (--ordering none): WAL capture relays each key in commit order"),
            (self.wakeup != WakeupMode::Notify, "wakeup (--wakeup): the replication stream wakes the relay, writers never notify"),
            (self.poll_fixed_rate, "poll_fixed_rate (--poll-fixed-rate): the replication stream wakes the relay"),
        ];
        if let Some((_, what)) = refused.iter().find(|(set, _)| *set) {
            bail!("{what}; remove it, or use --capture poll");
        }
        for (name, what) in [
            (&self.slot_name(), "slot"),
            (&self.publication, "publication"),
        ] {
            let valid = !name.is_empty()
                && name.len() <= 63
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
            if !valid {
                bail!("invalid {what} name {name:?}: use 1-63 lowercase ASCII letters, digits or underscores");
            }
        }
        Ok(())
    }

    /// Table, schema and channel names are SQL identifiers: refused here, before any store
    /// opens, so that a bad name is a configuration error like any other bad value.
    fn check_names(&self) -> anyhow::Result<()> {
        let t = self.layout_tables();
        let report = |e: outbox_core::StoreError| anyhow::anyhow!(e.report());
        outbox_core::ident::TableName::new(&t.outbox_schema, &t.outbox_table).map_err(report)?;
        outbox_core::ident::TableName::new(&t.nodes_schema, &t.nodes_table).map_err(report)?;
        outbox_core::ident::Ident::new(&t.notify_channel, "notify channel").map_err(report)?;
        self.layout_mapping()?;
        Ok(())
    }

    /// The replication slot of WAL capture: the one configured, or by default one named
    /// after the database and the outbox table (`outbox_relay_<database>[_<schema>][_<table>]`,
    /// the schema and table left out when they are `public` and `outbox`), since a slot's
    /// name is the server's: a fixed default made a second database on one server refuse
    /// to start. Too long, or not `[a-z0-9_]`, it ends with a hash of the whole instead.
    pub fn slot_name(&self) -> String {
        if !self.slot.is_empty() {
            return self.slot.clone();
        }
        let (_, database) = database_identity(self);
        let database = database.rsplit('/').next().unwrap_or_default().to_string();
        let t = self.layout_tables();
        let mut parts = vec![DEFAULT_SLOT.to_string(), database];
        if t.outbox_schema != "public" {
            parts.push(t.outbox_schema.clone());
        }
        if t.outbox_table != "outbox" {
            parts.push(t.outbox_table.clone());
        }
        let whole = parts.join("_");
        let name: String = whole
            .chars()
            .map(|c| match c.to_ascii_lowercase() {
                c @ ('a'..='z' | '0'..='9' | '_') => c,
                _ => '_',
            })
            .collect();
        if name == whole && name.len() <= 63 {
            return name;
        }
        // FNV-1a: stable across builds and platforms, unlike std's hasher.
        let hash = whole.bytes().fold(0x811c_9dc5_u32, |h, b| {
            (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
        });
        let mut name = name;
        name.truncate(63 - 9);
        format!("{name}_{hash:08x}")
    }

    /// How the relay learns of new rows, for its start-up line.
    pub fn wake_description(&self) -> &'static str {
        let fixed = self.poll_fixed_rate || self.wakeup == WakeupMode::Poll;
        match self.database_kind() {
            _ if self.capture == CaptureMode::Wal => "logical replication stream",
            _ if fixed => "fixed-rate polling",
            Ok(DatabaseKind::Sqlite(_)) => "data_version watch + safety poll",
            Ok(DatabaseKind::MySql) => "polling (MySQL has no NOTIFY)",
            _ if self.wakeup == WakeupMode::Gated => "gated notify + safety poll",
            _ => "notify + safety poll",
        }
    }

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
            return Ok(DatabaseKind::Sqlite(PathBuf::from(path)));
        }
        let shown = redact_url(url);
        if url.starts_with("mysql://") || url.starts_with("mariadb://") {
            return Ok(DatabaseKind::MySql);
        }
        bail!("unsupported database URL {shown}: use postgres://user@host:port/db, mysql://user@host:port/db or sqlite:PATH")
    }

    /// The table names in effect for the layout: a name left at its default becomes the
    /// layout's own (a seed's table, the Ably connector's nodes table and channel).
    pub fn layout_tables(&self) -> LayoutTables {
        let native = LayoutKind::Native;
        let layout_default = |set: &str, default: &str, own: Option<&str>| match own {
            Some(own) if set == default => own.to_string(),
            _ => set.to_string(),
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

    pub fn http_socket_addr(&self) -> anyhow::Result<Option<SocketAddr>> {
        if self.http_addr.trim().is_empty() {
            return Ok(None);
        }
        self.http_addr.parse().map(Some).with_context(|| {
            format!(
                "invalid http_addr {:?}: use host:port, e.g. 127.0.0.1:2259",
                self.http_addr
            )
        })
    }

    /// The admin API's token: `admin_token` (`OUTBOX_RELAY_ADMIN_TOKEN`) or the first line
    /// of `admin_token_file`; `None` leaves the API read-only.
    pub fn admin_token(&self) -> anyhow::Result<Option<Secret>> {
        let config_error = |m: String| anyhow::Error::new(crate::commands::ConfigError(m));
        let token = match (&self.admin_token, &self.admin_token_file) {
            (Some(_), Some(_)) => {
                return Err(config_error(
                    "both OUTBOX_RELAY_ADMIN_TOKEN (admin_token) and --admin-token-file \
                     (admin_token_file) are set: keep one"
                        .into(),
                ))
            }
            (Some(token), None) => token.expose().trim().to_string(),
            (None, Some(path)) => read_secret_file(path, "admin token", "--admin-token-file")?
                .expose()
                .to_string(),
            (None, None) => return Ok(None),
        };
        if token.len() < 16 {
            return Err(config_error(
                "the admin token must be at least 16 characters (e.g. `openssl rand -hex 32`)"
                    .into(),
            ));
        }
        Ok(Some(Secret::new(token)))
    }

    /// With `database_url_file`, the URL from that file in place of `database_url`;
    /// `url_given` says a source other than the defaults set `database_url`, which is then
    /// refused: one of the two would be ignored.
    fn read_database_url_file(&mut self, url_given: bool) -> anyhow::Result<()> {
        let Some(path) = &self.database_url_file else {
            return Ok(());
        };
        if url_given {
            return Err(anyhow::Error::new(crate::commands::ConfigError(
                "both a database URL (DATABASE_URL, OUTBOX_RELAY_DATABASE_URL, --database-url or \
                 database_url) and --database-url-file (OUTBOX_RELAY_DATABASE_URL_FILE, \
                 database_url_file) are set: keep one"
                    .into(),
            )));
        }
        let url = read_secret_file(path, "database URL", "--database-url-file")?;
        self.database_url = url.expose().to_string();
        Ok(())
    }

    /// Where the HTTP server listens (`None`: nowhere) and the admin API's token. A server
    /// beyond loopback needs the token.
    pub fn http_settings(&self) -> anyhow::Result<(Option<SocketAddr>, Option<Secret>)> {
        let http_addr = self.http_socket_addr()?;
        let admin_token = self.admin_token()?;
        if let Some(addr) = http_addr {
            if !addr.ip().is_loopback() && admin_token.is_none() {
                return Err(anyhow::Error::new(crate::commands::ConfigError(format!(
                    "http_addr {addr} is not a loopback address, and the admin API there would \
                     have no token: set OUTBOX_RELAY_ADMIN_TOKEN or --admin-token-file FILE, or \
                     listen on 127.0.0.1"
                ))));
            }
        }
        Ok((http_addr, admin_token))
    }

    /// `allowed_hosts`, lowercased: bare host names, refused with the fix when one carries a
    /// port, a scheme or a path (the check ignores the port a client sends).
    pub fn allowed_host_names(&self) -> anyhow::Result<Vec<String>> {
        self.allowed_hosts
            .iter()
            .map(|name| {
                let bare = name.trim().trim_end_matches('.').to_ascii_lowercase();
                let fine = !bare.is_empty()
                    && bare
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
                if fine {
                    Ok(bare)
                } else {
                    Err(anyhow::Error::new(crate::commands::ConfigError(format!(
                        "allowed_hosts: {name:?} is not a host name; give names only, without \
                         scheme or port, e.g. relay.internal"
                    ))))
                }
            })
            .collect()
    }

    /// The sinks and routes in effect: `sink` alone, `[sinks]` with `[[routes]]`, or stdout.
    pub fn sink_setup(&self) -> (BTreeMap<String, SinkConfig>, Vec<RouteConfig>) {
        match (&self.sink, self.sinks.is_empty()) {
            (Some(uri), _) => (single_sink(uri), Vec::new()),
            (None, true) => (single_sink(DEFAULT_SINK), Vec::new()),
            (None, false) => (self.sinks.clone(), self.routes.clone()),
        }
    }

    /// Which store the settings name, and its options.
    pub fn store_settings(&self) -> anyhow::Result<StoreSettings> {
        let report = |e: outbox_core::StoreError| crate::commands::failure(e.report(), &e);
        let tables = self.layout_tables();
        let mut mapping = self.layout_mapping()?;
        Ok(match self.database_kind()? {
            DatabaseKind::Postgres => {
                // WAL capture of a mapped table (Debezium's) reads it from the stream and keeps
                // parked events and dead letters in native tables of its own, `<table>_relay`.
                let captured = match self.capture {
                    CaptureMode::Wal => mapping.take(),
                    CaptureMode::Poll => None,
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
                let capture = match self.capture {
                    CaptureMode::Poll => None,
                    CaptureMode::Wal => Some(crate::store::Capture {
                        slot: self.slot_name(),
                        // Only the README's default outbox: a second outbox of that database,
                        // added later, must not take over the slot of the first.
                        legacy_slot: (self.slot.is_empty()
                            && self.publication == DEFAULT_PUBLICATION
                            && (
                                self.layout_tables().outbox_schema.as_str(),
                                self.layout_tables().outbox_table.as_str(),
                            ) == ("public", "outbox"))
                            .then(|| DEFAULT_SLOT.into()),
                        publication: outbox_core::ident::Ident::new(
                            &self.publication,
                            "publication name",
                        )
                        .map_err(report)?,
                        source: captured
                            .map(crate::store::CapturedTable::of)
                            .transpose()
                            .map_err(report)?
                            .map(Box::new),
                    }),
                };
                StoreSettings::Postgres(Box::new(crate::store::PostgresSettings {
                    options: outbox_store_postgres::PgOptions {
                        url: self.database_url.clone(),
                        tables: pg_tables,
                        retain_delivered: self.retain_delivered,
                        ca_file: self.database_ca_file.clone(),
                        pool_size: self.pool_size,
                        application_name: Some(match &self.node_id {
                            Some(node) => format!("outbox-relay {node}"),
                            None => "outbox-relay".into(),
                        }),
                        operation_timeout: None,
                    },
                    mapped: mapping.map(|m| (m, self.layout.to_string())),
                    max_attempts: self.retry.max_attempts,
                    capture,
                }))
            }
            DatabaseKind::MySql => {
                // PostgreSQL-only layouts were refused by `validate`.
                let Some(mapping) = mapping else {
                    bail!("every MySQL layout is a mapping");
                };
                StoreSettings::MySql(Box::new(outbox_store_mysql::MySqlOptions {
                    url: self.database_url.clone(),
                    mapping,
                    layout: self.layout.to_string(),
                    max_attempts: self.retry.max_attempts,
                    pool_size: self.pool_size,
                    nodes_table: (self.layout == LayoutKind::Native).then_some(tables.nodes_table),
                }))
            }
            // Other layouts and table names were refused by `validate`.
            DatabaseKind::Sqlite(path) => StoreSettings::Sqlite {
                path,
                retain_delivered: self.retain_delivered,
            },
        })
    }

    /// What `run` hands to the store, the engine, the cluster coordinator, the sinks and the
    /// HTTP server, for the node `node`. With `drain`, the engine
    /// delivers what is deliverable now and returns. The engine's `ownership` is left for
    /// `run` to set, once the store says how many partitions there are.
    pub fn resolve(&self, node: NodeId, drain: bool) -> anyhow::Result<RunParts> {
        let health = Health::new();
        let mut engine = EngineConfig::new(node.clone());
        engine.batch_size = self.batch_size;
        engine.max_in_flight = self.max_in_flight;
        engine.lease = self.lease;
        engine.poll_interval = self.poll_interval;
        // Nothing notifies under `--wakeup poll`: listening would only cost a connection.
        engine.wake = if self.poll_fixed_rate || self.wakeup == WakeupMode::Poll {
            WakeMode::FixedRate
        } else {
            WakeMode::Notify
        };
        engine.retry = self.retry.clone();
        engine.publish_timeout = self.publish_timeout;
        engine.shutdown_timeout = self.shutdown_timeout;
        engine.drain = drain;
        // Rows leased by a node that died come back after their lease; its partitions, once
        // its heartbeat expired and the next beat takes them.
        engine.drain_patience =
            self.lease.max(self.heartbeat_timeout) + self.heartbeat_interval * 2;
        engine.ordered = self.ordering == OrderingMode::Key;
        if self.capture == CaptureMode::Wal {
            // The stream wakes the engine; nothing waits out another node's leases.
            engine.wake = WakeMode::Notify;
            engine.drain_patience = self.lease;
        }
        engine.health = health.clone();
        let cluster = ClusterConfig {
            node,
            heartbeat_interval: self.heartbeat_interval,
            heartbeat_timeout: self.heartbeat_timeout,
            health: health.clone(),
        };
        let (sinks, routes) = self.sink_setup();
        let (http_addr, admin_token) = self.http_settings()?;
        Ok(RunParts {
            store: self.store_settings()?,
            engine,
            cluster,
            sinks,
            routes,
            http_addr,
            admin_token,
            allowed_hosts: self.allowed_host_names()?,
            health,
        })
    }
}

/// Settings that belong to the process, not to one outbox: an `[[outboxes]]` entry that sets
/// one is refused.
const PROCESS_SETTINGS: &[&str] = &[
    "http_addr",
    "admin_token",
    "admin_token_file",
    "allowed_hosts",
    "log_format",
    "log_level",
    "node_id",
    "outboxes",
];

/// Where events go: an entry that sets any of these replaces all three, so that a top-level
/// `sink` never shadows an entry's `[sinks]` (or the other way round).
const SINK_SETTINGS: &[&str] = &["sink", "sinks", "routes"];

/// The database: an entry that sets either replaces both, so that an entry's own URL is not
/// refused for the top level's URL file (or the other way round).
const DATABASE_SETTINGS: &[&str] = &["database_url", "database_url_file"];

/// One outbox of `[[outboxes]]`: its name (the `outbox` label of its metrics, its path under
/// `/outboxes/`, and `--outbox NAME`) and its settings in effect.
#[derive(Clone, Debug)]
pub struct NamedOutbox {
    pub name: String,
    pub config: Config,
}

impl Config {
    /// The outboxes of `[[outboxes]]`, in file order; empty for a single-outbox config.
    ///
    /// An entry inherits every top-level setting it does not set (from the file or the
    /// environment); a setting it names replaces the top-level one whole (a table too: an
    /// entry's `retry` replaces `[retry]`). The command line's `flags` win over both, as
    /// everywhere. Each result is validated as a configuration of its own, and outboxes that
    /// would get in each other's way are refused: the same table, the same nodes table (its
    /// members would share out each other's partitions), the same replication slot (on one
    /// server) or publication.
    pub fn outboxes(&self, flags: &Figment) -> anyhow::Result<Vec<NamedOutbox>> {
        let config_error = |m: String| anyhow::Error::new(crate::commands::ConfigError(m));
        let mut base = self.clone();
        base.outboxes.clear();
        let base = match Value::serialize(&base) {
            Ok(Value::Dict(_, dict)) => dict,
            _ => bail!("cannot read the top-level settings as a table"),
        };
        let mut outboxes: Vec<NamedOutbox> = Vec::new();
        for (i, entry) in self.outboxes.iter().enumerate() {
            let name = match entry.get("name") {
                Some(Value::String(_, name)) => name.clone(),
                _ => {
                    return Err(config_error(format!(
                        "[[outboxes]] entry {} has no name: give each one name = \"...\" (its \
                         metrics label, its path under /outboxes/, and --outbox NAME)",
                        i + 1
                    )))
                }
            };
            let valid = !name.is_empty()
                && name.len() <= 32
                && name.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-'
                });
            if !valid {
                return Err(config_error(format!(
                    "invalid [[outboxes]] name {name:?}: use 1-32 lowercase ASCII letters, \
                     digits, '-' or '_'"
                )));
            }
            if outboxes.iter().any(|o| o.name == name) {
                return Err(config_error(format!(
                    "two [[outboxes]] entries are named {name:?}: give each its own name"
                )));
            }
            if let Some(key) = entry
                .keys()
                .find(|k| PROCESS_SETTINGS.contains(&k.as_str()))
            {
                return Err(config_error(format!(
                    "[[outboxes]] `{name}` sets `{key}`, which belongs to the whole process: \
                     set it once at the top level of the file"
                )));
            }
            if DATABASE_SETTINGS.iter().all(|k| entry.contains_key(*k)) {
                return Err(config_error(format!(
                    "[[outboxes]] `{name}` sets both database_url and database_url_file: keep \
                     one"
                )));
            }
            // A URL (or URL file) on the command line is every outbox's, as any flag is; the
            // top level holds it, read already.
            let flag_database = DATABASE_SETTINGS.iter().any(|k| flags.contains(k));
            let own_database =
                !flag_database && DATABASE_SETTINGS.iter().any(|k| entry.contains_key(*k));
            let mut settings = base.clone();
            for (group, replaced) in [(SINK_SETTINGS, true), (DATABASE_SETTINGS, own_database)] {
                if replaced && group.iter().any(|k| entry.contains_key(*k)) {
                    for key in group {
                        settings.remove(*key);
                    }
                }
            }
            for (key, value) in entry.iter().filter(|(k, _)| k.as_str() != "name") {
                if flag_database && DATABASE_SETTINGS.contains(&key.as_str()) {
                    continue;
                }
                settings.insert(key.clone(), value.clone());
            }
            let mut config: Config = Figment::from(Serialized::defaults(settings))
                .merge(flags.clone())
                .extract()
                .map_err(|e| {
                    config_error(format!(
                        "invalid [[outboxes]] `{name}`: {}",
                        describe_entry_error(e)
                    ))
                })?;
            if own_database {
                config
                    .read_database_url_file(false)
                    .map_err(|e| config_error(format!("[[outboxes]] `{name}`: {e:#}")))?;
            }
            config
                .validate()
                .map_err(|e| config_error(format!("invalid [[outboxes]] `{name}`: {e:#}")))?;
            outboxes.push(NamedOutbox { name, config });
        }
        refuse_shared_resources(&outboxes).map_err(config_error)?;
        Ok(outboxes)
    }
}

/// Errors in an `[[outboxes]]` entry name the setting as the file spells it.
fn describe_entry_error(error: figment::Error) -> String {
    describe_errors(error, |_, key| format!("setting `{key}`"))
}

/// The server and the database a URL reaches, without credentials or parameters: two URLs
/// that differ only there reach the same tables. A default port is spelled out.
fn database_identity(config: &Config) -> (String, String) {
    if let Ok(DatabaseKind::Sqlite(path)) = config.database_kind() {
        let file = format!("sqlite:{}", path.display());
        return (file.clone(), file);
    }
    let url = config.database_url.trim();
    let url = url.split(['?', '#']).next().unwrap_or(url);
    let Some((scheme, rest)) = url.split_once("://") else {
        return (url.to_string(), url.to_string());
    };
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let host = authority.rsplit('@').next().unwrap_or(authority);
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

/// Outboxes in one process must not share what only one of them can own.
fn refuse_shared_resources(outboxes: &[NamedOutbox]) -> Result<(), String> {
    for (i, a) in outboxes.iter().enumerate() {
        for b in &outboxes[i + 1..] {
            let (server, database) = database_identity(&a.config);
            let (other_server, other_database) = database_identity(&b.config);
            let pair = format!("[[outboxes]] `{}` and `{}`", a.name, b.name);
            let wal = |c: &Config| c.capture == CaptureMode::Wal;
            // Replication slots are named per server, not per database.
            if server == other_server
                && wal(&a.config)
                && wal(&b.config)
                && a.config.slot_name() == b.config.slot_name()
            {
                return Err(format!(
                    "{pair} both stream from the replication slot {} of {}: slot names are \
                     the server's, and a slot has one reader; give one its own slot",
                    a.config.slot_name(),
                    redact_url(&server)
                ));
            }
            if database != other_database {
                continue;
            }
            let (ta, tb) = (a.config.layout_tables(), b.config.layout_tables());
            let shown = redact_url(&database);
            if (&ta.outbox_schema, &ta.outbox_table) == (&tb.outbox_schema, &tb.outbox_table) {
                return Err(format!(
                    "{pair} both relay {}.{} of {shown}: each table is one outbox; remove one, \
                     or give it its own outbox_table (or outbox_schema)",
                    ta.outbox_schema, ta.outbox_table
                ));
            }
            let sqlite = matches!(a.config.database_kind(), Ok(DatabaseKind::Sqlite(_)));
            if !sqlite && (&ta.nodes_schema, &ta.nodes_table) == (&tb.nodes_schema, &tb.nodes_table)
            {
                return Err(format!(
                    "{pair} share the nodes table {}.{} of {shown}: the nodes of one would be \
                     counted as members of the other, and given partitions they never relay; \
                     give one its own nodes_table (or nodes_schema)",
                    ta.nodes_schema, ta.nodes_table
                ));
            }
            if wal(&a.config) && wal(&b.config) && a.config.publication == b.config.publication {
                return Err(format!(
                    "{pair} both use the publication {} of {shown}: a publication names its \
                     outbox's tables; give one its own publication",
                    a.config.publication
                ));
            }
        }
    }
    Ok(())
}

/// The parts `run` starts, resolved from the settings in one place.
pub struct RunParts {
    pub store: StoreSettings,
    pub engine: EngineConfig,
    pub cluster: ClusterConfig,
    pub sinks: BTreeMap<String, SinkConfig>,
    pub routes: Vec<RouteConfig>,
    /// Where /healthz, /readyz and /metrics listen; `None`: no HTTP server.
    pub http_addr: Option<SocketAddr>,
    /// The admin API's bearer token; `None`: its mutating endpoints answer 403.
    pub admin_token: Option<Secret>,
    /// The host names the HTTP server answers to besides IP addresses and `localhost`.
    pub allowed_hosts: Vec<String>,
    /// What the engine and the coordinator report to, and /readyz shows.
    pub health: Arc<Health>,
}

/// Figment's errors in the operator's terms: what is wrong, with which setting, and where the
/// value came from (a file, an environment variable, a flag); never the source-code location
/// that figment gives for values set in code (the flags).
fn describe_figment_error(error: figment::Error) -> String {
    describe_errors(error, |e, key| {
        let source = e.metadata.as_ref().and_then(|md| md.source.as_ref());
        match (source, &e.metadata, &e.profile) {
            (Some(figment::Source::File(path)), _, _) => {
                format!("setting `{key}` in {}", path.display())
            }
            // The flags (and the built-in defaults) are values set in code.
            (Some(figment::Source::Code(_)), _, _) => {
                format!("--{}", key.replace(['.', '_'], "-"))
            }
            // Figment names these variables without their prefix.
            (None, Some(md), _) if md.name.contains("OUTBOX_RELAY_") => format!(
                "environment variable OUTBOX_RELAY_{}",
                e.path.join("__").to_uppercase()
            ),
            (None, Some(md), Some(profile)) if md.name.contains("environment") => {
                format!("environment variable {}", md.interpolate(profile, &e.path))
            }
            _ => format!("setting `{key}`"),
        }
    })
}

/// Each of figment's errors as `<origin>: <what>`, the origin told by `origin` from the
/// error and its setting's dotted key.
fn describe_errors(
    error: figment::Error,
    origin: impl Fn(&figment::Error, &str) -> String,
) -> String {
    error
        .into_iter()
        .map(|e| {
            let what = e
                .kind
                .to_string()
                .replace("unknown field", "unknown setting");
            let key = e.path.join(".");
            if key.is_empty() {
                what
            } else {
                format!("{}: {what}", origin(&e, &key))
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// A list of names from TOML's array, or from one string separated by commas (what
/// `OUTBOX_RELAY_ALLOWED_HOSTS=a,b` gives).
fn host_names<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Names {
        One(String),
        Many(Vec<String>),
    }
    Ok(match Names::deserialize(d)? {
        Names::One(text) => text
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(String::from)
            .collect(),
        Names::Many(names) => names,
    })
}

/// The secret `what` from the first line of the file at `path`, trimmed (an editor's or
/// `echo`'s newline is no part of it). A file that cannot be read or holds nothing is a
/// configuration error naming the file and `flag`; the error never quotes the content.
fn read_secret_file(path: &Path, what: &str, flag: &str) -> anyhow::Result<Secret> {
    let config_error = |m: String| anyhow::Error::new(crate::commands::ConfigError(m));
    let text = std::fs::read_to_string(path).map_err(|e| {
        config_error(format!(
            "cannot read the {what} file {}: {e} (check {flag}, and that the relay's user may \
             read the file)",
            path.display()
        ))
    })?;
    let value = Secret::new(text.lines().next().unwrap_or_default().trim());
    if value.expose().is_empty() {
        return Err(config_error(format!(
            "the {what} file {} is empty: put the {what} on its first line (or point {flag} \
             at the file that holds it)",
            path.display()
        )));
    }
    Ok(value)
}

fn single_sink(uri: &str) -> BTreeMap<String, SinkConfig> {
    BTreeMap::from([("default".to_string(), SinkConfig::new(uri))])
}

#[cfg(test)]
#[allow(clippy::result_large_err)] // figment::Jail's closure signature
mod tests {
    use super::*;

    /// The command line's layer, as `main` builds it.
    fn flags(args: &[&str]) -> Figment {
        use clap::FromArgMatches;
        let matches = crate::cli::command()
            .try_get_matches_from(args)
            .expect("valid arguments");
        crate::cli::Cli::from_arg_matches(&matches)
            .expect("valid arguments")
            .flags()
    }

    #[test]
    fn debug_output_hides_the_password() {
        let config = Config {
            database_url: "postgres://u:topsecret@h/db".into(),
            ..Config::default()
        };
        assert!(!format!("{config:?}").contains("topsecret"));
    }

    #[test]
    fn database_urls_pick_the_store() {
        let mut c = Config::default();
        assert_eq!(
            c.database_kind().unwrap(),
            DatabaseKind::Sqlite("outbox.db".into())
        );
        c.database_url = "postgresql://h/db".into();
        assert_eq!(c.database_kind().unwrap(), DatabaseKind::Postgres);
        c.database_url = "oracle://x:pw@h".into();
        let err = c.database_kind().unwrap_err().to_string();
        assert!(
            err.contains("use postgres://") && !err.contains("pw"),
            "{err}"
        );
    }

    #[test]
    fn durations_need_units() {
        assert_eq!(
            duration::parse("250ms").unwrap(),
            Duration::from_millis(250)
        );
        assert_eq!(
            duration::parse("7d").unwrap(),
            Duration::from_secs(7 * 86400)
        );
        assert!(duration::parse("250").unwrap_err().contains("with a unit"));
    }

    #[test]
    fn flags_win_over_files_and_environment() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "relay.toml",
                r#"
                sink = "file:/tmp/from-file.jsonl"
                batch_size = 100
                [retry]
                max_attempts = 7
                [retry.max_attempts_by_type]
                "order.created" = 2
                "#,
            )?;
            jail.set_env("OUTBOX_RELAY_BATCH_SIZE", "200");
            jail.set_env("OUTBOX_RELAY_POLL_INTERVAL", "250ms");
            jail.set_env("DATABASE_URL", "postgres://from-env/db");
            let flags = flags(&["outbox-relay", "run", "--batch-size", "300"]);
            let c =
                Config::load(Some(Path::new("relay.toml")), flags).map_err(|e| e.to_string())?;
            assert_eq!(c.sink.as_deref(), Some("file:/tmp/from-file.jsonl"));
            assert_eq!(c.batch_size, 300);
            assert_eq!(c.poll_interval, Duration::from_millis(250));
            assert_eq!(c.database_url, "postgres://from-env/db");
            assert_eq!(c.retry.max_attempts, 7);
            assert_eq!(c.retry.max_attempts_by_type["order.created"], 2);
            Ok(())
        });
    }

    /// `allowed_hosts` from a TOML list, one comma-separated variable, or a repeated-or-
    /// comma-separated flag; a name with a port or scheme is refused with the fix.
    #[test]
    fn allowed_hosts_come_from_a_list_a_variable_or_a_flag() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("relay.toml", r#"allowed_hosts = ["Relay.Internal"]"#)?;
            let load = |args: &[&str]| {
                Config::load(Some(Path::new("relay.toml")), flags(args)).map_err(|e| e.to_string())
            };
            let c = load(&["outbox-relay", "run"])?;
            assert_eq!(c.allowed_host_names().unwrap(), ["relay.internal"]);
            jail.set_env("OUTBOX_RELAY_ALLOWED_HOSTS", "a.example, b.example");
            let c = load(&["outbox-relay", "run"])?;
            assert_eq!(c.allowed_hosts, ["a.example", "b.example"]);
            let c = load(&[
                "outbox-relay",
                "run",
                "--allowed-hosts",
                "c.example,d.example",
            ])?;
            assert_eq!(c.allowed_hosts, ["c.example", "d.example"]);
            jail.set_env("OUTBOX_RELAY_ALLOWED_HOSTS", "https://relay.example:8443");
            let err = load(&["outbox-relay", "run"]).unwrap_err();
            assert!(err.contains("without scheme or port"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn impossible_timings_are_refused() {
        let base = Config::default();
        base.validate().expect("the defaults are consistent");
        let refused = |c: Config| c.validate().unwrap_err().to_string();
        let err = refused(Config {
            publish_timeout: Duration::from_nanos(1),
            ..Config::default()
        });
        assert!(
            err.contains("publish_timeout must be at least 100ms"),
            "{err}"
        );
        let err = refused(Config {
            publish_timeout: Duration::from_secs(45),
            ..Config::default()
        });
        assert!(err.contains("shorter than lease"), "{err}");
        let err = refused(Config {
            heartbeat_interval: Duration::from_secs(4),
            ..Config::default()
        });
        assert!(err.contains("at least 3 x heartbeat_interval"), "{err}");
    }

    #[test]
    fn unknown_settings_and_bad_values_are_named() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("relay.toml", "batch_sise = 5\n")?;
            let err = Config::load(Some(Path::new("relay.toml")), Figment::new())
                .unwrap_err()
                .to_string();
            assert!(err.contains("batch_sise"), "{err}");
            jail.create_file("relay.toml", "lease = \"10\"\n")?;
            let err = Config::load(Some(Path::new("relay.toml")), Figment::new())
                .unwrap_err()
                .to_string();
            assert!(err.contains("with a unit"), "{err}");
            Ok(())
        });
    }

    /// Each setting that cannot apply is refused by name, with what to do instead.
    #[test]
    fn settings_without_effect_are_refused_by_name() {
        let pg = "postgres://relay@db/app".to_string();
        let refused = |c: Config| c.validate().unwrap_err().to_string();
        let err = refused(Config {
            wakeup: WakeupMode::Gated,
            ..Config::default()
        });
        assert!(
            err.contains("--wakeup gated") && err.contains("SQLite"),
            "{err}"
        );
        let err = refused(Config {
            database_url: "mysql://relay@db/app".into(),
            wakeup: WakeupMode::Gated,
            ..Config::default()
        });
        assert!(err.contains("MySQL/MariaDB"), "{err}");
        for url in ["sqlite:outbox.db", "mysql://relay@db/app"] {
            let err = refused(Config {
                database_url: url.into(),
                notify_channel: "events".into(),
                ..Config::default()
            });
            assert!(err.contains("notify_channel has no effect"), "{url}: {err}");
        }
        let err = refused(Config {
            database_url: pg.clone(),
            poll_fixed_rate: true,
            wakeup: WakeupMode::Gated,
            ..Config::default()
        });
        assert!(err.contains("poll_fixed_rate"), "{err}");
        let route = outbox_publishers::RouteConfig {
            destinations: "*".into(),
            sink: "main".into(),
            target: None,
            cloudevents: None,
            cloudevents_source: None,
        };
        let err = refused(Config {
            sink: Some("stdout".into()),
            sinks: [("main".to_string(), single_sink("stdout")["default"].clone())].into(),
            routes: vec![route],
            ..Config::default()
        });
        assert!(err.contains("--sink") && err.contains("not both"), "{err}");
        let err = refused(Config {
            layout: outbox_layout::LayoutKind::OpenOutbox,
            ..Config::default()
        });
        assert!(
            err.contains("SQLite supports the native layout only"),
            "{err}"
        );
        let err = refused(Config {
            database_url: pg.clone(),
            mapping: Some(outbox_layout::Mapping::open_outbox("public", "events")),
            ..Config::default()
        });
        assert!(err.contains("[mapping] section has no effect"), "{err}");
        // What does apply passes: notify_channel and gated on PostgreSQL, on any layout.
        Config {
            database_url: pg.clone(),
            layout: outbox_layout::LayoutKind::OpenOutbox,
            notify_channel: "events".into(),
            wakeup: WakeupMode::Gated,
            ..Config::default()
        }
        .validate()
        .expect("notify_channel and gated apply to every PostgreSQL layout");
        Config {
            wakeup: WakeupMode::Poll,
            ..Config::default()
        }
        .validate()
        .expect("poll applies to SQLite: no data_version watch");
    }

    #[test]
    fn bad_names_are_configuration_errors() {
        let err = Config {
            database_url: "postgres://relay@db/app".into(),
            nodes_table: "nodes; drop".into(),
            ..Config::default()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(err.contains("invalid table name \"nodes; drop\""), "{err}");
    }

    #[test]
    fn the_start_up_line_says_how_each_store_wakes() {
        let with = |url: &str, wakeup: WakeupMode| Config {
            database_url: url.into(),
            wakeup,
            ..Config::default()
        };
        let sqlite = with("sqlite:outbox.db", WakeupMode::Notify);
        assert_eq!(
            sqlite.wake_description(),
            "data_version watch + safety poll"
        );
        let pg = "postgres://db/app";
        assert_eq!(
            with(pg, WakeupMode::Notify).wake_description(),
            "notify + safety poll"
        );
        assert_eq!(
            with(pg, WakeupMode::Gated).wake_description(),
            "gated notify + safety poll"
        );
        assert_eq!(
            with(pg, WakeupMode::Poll).wake_description(),
            "fixed-rate polling"
        );
        assert!(with("mysql://db/app", WakeupMode::Notify)
            .wake_description()
            .contains("no NOTIFY"));
    }

    #[test]
    fn a_bad_value_names_its_flag_or_variable_never_a_source_file() {
        figment::Jail::expect_with(|jail| {
            let flags = flags(&["outbox-relay", "run", "--lease", "10"]);
            let err = Config::load(None, flags).unwrap_err().to_string();
            assert!(err.contains("--lease: invalid duration \"10\""), "{err}");
            assert!(!err.contains(".rs"), "{err}");
            jail.set_env("OUTBOX_RELAY_POLL_INTERVAL", "5");
            let err = Config::load(None, Figment::new()).unwrap_err().to_string();
            assert!(
                err.contains("environment variable OUTBOX_RELAY_POLL_INTERVAL")
                    && err.contains("write it with a unit"),
                "{err}"
            );
            Ok(())
        });
    }

    /// A switch not given leaves the file's value; a retry flag sets only its own field.
    #[test]
    fn absent_flags_leave_the_lower_layers_alone() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "relay.toml",
                "auto_migrate = true\nlayout = \"native\"\n[retry]\nmax_attempts = 7\n",
            )?;
            let flags = flags(&["outbox-relay", "run", "--retry-max-delay", "1m"]);
            let c =
                Config::load(Some(Path::new("relay.toml")), flags).map_err(|e| e.to_string())?;
            assert!(c.auto_migrate);
            assert_eq!(c.retry.max_attempts, 7);
            assert_eq!(c.retry.max_delay, Duration::from_secs(60));
            assert_eq!(c.retry.base_delay, RetryPolicy::default().base_delay);
            Ok(())
        });
    }

    #[test]
    fn resolve_hands_each_part_its_settings() {
        let config = Config {
            batch_size: 10,
            lease: Duration::from_secs(40),
            poll_fixed_rate: true,
            ordering: OrderingMode::None,
            http_addr: String::new(),
            sink: Some("file:out.jsonl".into()),
            ..Config::default()
        };
        let parts = config.resolve(NodeId("n1".into()), true).unwrap();
        assert_eq!(parts.engine.batch_size, 10);
        assert_eq!(parts.engine.wake, WakeMode::FixedRate);
        assert!(parts.engine.drain && !parts.engine.ordered);
        assert_eq!(parts.engine.drain_patience, Duration::from_secs(44));
        assert_eq!(parts.cluster.node.0, "n1");
        assert_eq!(parts.cluster.heartbeat_timeout, config.heartbeat_timeout);
        assert!(Arc::ptr_eq(&parts.engine.health, &parts.cluster.health));
        assert_eq!(parts.sinks["default"].uri(), "file:out.jsonl");
        assert!(parts.routes.is_empty() && parts.http_addr.is_none());
    }

    /// `check` prints the configuration: the tables it names are the layout's own.
    #[test]
    fn the_shown_configuration_names_the_layouts_tables() {
        let config = Config {
            database_url: "postgres://relay:secret@db/app".into(),
            layout: LayoutKind::Debezium,
            ..Config::default()
        };
        let shown = format!("{config:?}");
        assert!(shown.contains(r#"outbox: "public.outboxevent""#), "{shown}");
        assert!(shown.contains(r#"layout: "debezium""#), "{shown}");
        assert!(!shown.contains("secret"), "{shown}");
    }

    #[test]
    fn wal_capture_settings_that_cannot_apply_are_refused() {
        let pg = "postgres://relay@db/app".to_string();
        let wal = |c: Config| Config {
            capture: CaptureMode::Wal,
            ..c
        };
        let refused = |c: Config| c.validate().unwrap_err().to_string();
        let err = refused(wal(Config::default()));
        assert!(err.contains("postgres://"), "{err}");
        for (config, named) in [
            (
                Config {
                    database_url: pg.clone(),
                    layout: LayoutKind::Adbc,
                    ..Config::default()
                },
                "layout",
            ),
            (
                Config {
                    database_url: pg.clone(),
                    retain_delivered: true,
                    ..Config::default()
                },
                "retain_delivered",
            ),
            (
                Config {
                    database_url: pg.clone(),
                    ordering: OrderingMode::None,
                    ..Config::default()
                },
                "ordering",
            ),
            (
                Config {
                    database_url: pg.clone(),
                    wakeup: WakeupMode::Gated,
                    ..Config::default()
                },
                "wakeup",
            ),
            (
                Config {
                    database_url: pg.clone(),
                    slot: "Bad-Name".into(),
                    ..Config::default()
                },
                "slot",
            ),
        ] {
            let err = refused(wal(config));
            assert!(err.contains(named), "{named}: {err}");
        }
        // Debezium's table is captured, with native tables of the relay's own beside it.
        let debezium = wal(Config {
            database_url: pg.clone(),
            layout: LayoutKind::Debezium,
            ..Config::default()
        });
        debezium.validate().unwrap();
        let StoreSettings::Postgres(settings) = debezium.store_settings().unwrap() else {
            panic!("PostgreSQL")
        };
        assert!(settings.mapped.is_none(), "read from the WAL, not polled");
        assert_eq!(
            settings.options.tables.outbox.name.as_str(),
            "outboxevent_relay"
        );
        let source = settings.capture.unwrap().source.expect("a captured table");
        assert_eq!(source.table.name.as_str(), "outboxevent");
        assert_eq!(source.columns.sequence_id, "relay_sequence");
        // A slot without WAL capture would be silently ignored.
        let err = refused(Config {
            database_url: pg.clone(),
            slot: "mine".into(),
            ..Config::default()
        });
        assert!(err.contains("--capture wal"), "{err}");
        // Resolved: the native store with its slot, and writers that notify nobody.
        let config = wal(Config {
            database_url: pg,
            slot: "mine".into(),
            ..Config::default()
        });
        config.validate().unwrap();
        let parts = config.resolve(NodeId("n1".into()), false).unwrap();
        let crate::store::StoreSettings::Postgres(settings) = parts.store else {
            panic!("not PostgreSQL");
        };
        assert_eq!(settings.capture.as_ref().unwrap().slot, "mine");
        assert!(settings.options.tables.poll_wakeup && settings.mapped.is_none());
        assert_eq!(parts.engine.wake, WakeMode::Notify);
    }

    #[test]
    fn a_seed_layout_brings_its_own_table_names() {
        let adbc = Config {
            layout: LayoutKind::Adbc,
            ..Config::default()
        };
        let t = adbc.layout_tables();
        assert_eq!(
            (t.outbox_table.as_str(), t.nodes_table.as_str()),
            ("outbox", "nodes")
        );
        assert_eq!(t.notify_channel, "ably_adbc");
        let export = Config {
            layout: LayoutKind::Export,
            nodes_table: "my_nodes".into(),
            ..Config::default()
        };
        let t = export.layout_tables();
        assert_eq!(
            (t.outbox_table.as_str(), t.nodes_table.as_str()),
            ("event", "my_nodes")
        );
        let named = Config {
            layout: LayoutKind::OpenOutbox,
            outbox_table: "events".into(),
            ..Config::default()
        };
        assert_eq!(named.layout_tables().outbox_table, "events");
    }

    /// `[[outboxes]]` from a file and flags: each outbox's settings in effect, or the error.
    fn outboxes_of(toml: &str, args: &[&str]) -> Result<Vec<NamedOutbox>, String> {
        let mut result = Err(String::new());
        figment::Jail::expect_with(|jail| {
            jail.create_file("relay.toml", toml)?;
            let flags = flags(args);
            result = Config::load(Some(Path::new("relay.toml")), flags.clone())
                .and_then(|c| c.outboxes(&flags))
                .map_err(|e| format!("{e:#}"));
            Ok(())
        });
        result
    }

    #[test]
    fn an_outbox_inherits_what_it_does_not_set_and_replaces_what_it_does() {
        let outboxes = outboxes_of(
            r#"
            batch_size = 100
            sink = "stdout"
            [retry]
            max_attempts = 7
            base_delay = "1s"
            [[outboxes]]
            name = "orders"
            database_url = "postgres://relay@db/orders"
            [[outboxes]]
            name = "billing"
            database_url = "postgres://relay@db/billing"
            retry = { max_attempts = 2 }
            [outboxes.sinks.main]
            uri = "nats://nats:4222"
            [[outboxes.routes]]
            destinations = "*"
            sink = "main"
            "#,
            &["outbox-relay", "run", "--lease", "45s"],
        )
        .unwrap();
        let [orders, billing] = &outboxes[..] else {
            panic!("{outboxes:?}")
        };
        assert_eq!(orders.name, "orders");
        assert_eq!(orders.config.database_url, "postgres://relay@db/orders");
        assert_eq!(orders.config.batch_size, 100, "from the top level");
        assert_eq!(orders.config.lease, Duration::from_secs(45), "from a flag");
        assert_eq!(orders.config.sink.as_deref(), Some("stdout"));
        assert_eq!(orders.config.retry.max_attempts, 7);
        // An entry's table replaces the top-level one whole; its sinks replace `sink`.
        assert_eq!(billing.config.retry.max_attempts, 2);
        assert_eq!(
            billing.config.retry.base_delay,
            RetryPolicy::default().base_delay
        );
        assert_eq!(billing.config.sink, None);
        assert_eq!(billing.config.sinks.keys().collect::<Vec<_>>(), ["main"]);
        assert_eq!(billing.config.routes.len(), 1);
        assert!(billing.config.outboxes.is_empty());
        // A flag wins over an entry, as over the file.
        let flagged = outboxes_of(
            "[[outboxes]]\nname = \"a\"\nbatch_size = 5\n",
            &["outbox-relay", "run", "--batch-size", "9"],
        )
        .unwrap();
        assert_eq!(flagged[0].config.batch_size, 9);
        // The top level only lends settings: what would not apply to it alone (a
        // PostgreSQL-only setting over the default SQLite URL) is judged in each outbox.
        let lent = outboxes_of(
            "wakeup = \"gated\"\n[[outboxes]]\nname = \"a\"\n\
             database_url = \"postgres://relay@db/app\"\n",
            &["outbox-relay", "run"],
        )
        .unwrap();
        assert_eq!(lent[0].config.wakeup, WakeupMode::Gated);
        // Without [[outboxes]], nothing changes.
        assert!(outboxes_of("batch_size = 100\n", &["outbox-relay", "run"])
            .unwrap()
            .is_empty());
    }

    #[test]
    fn outboxes_that_cannot_share_a_process_are_refused_with_the_fix() {
        let refused = |toml: &str| outboxes_of(toml, &["outbox-relay", "run"]).unwrap_err();
        let two = |a: &str, b: &str| {
            format!("[[outboxes]]\nname = \"a\"\n{a}\n[[outboxes]]\nname = \"b\"\n{b}\n")
        };
        let pg = "database_url = \"postgres://relay:secret@db:5432/app\"";
        let pg_other_user = "database_url = \"postgres://other@db:5432/app?sslmode=require\"";
        let err = refused(&two(pg, pg_other_user));
        assert!(err.contains("both relay public.outbox"), "{err}");
        assert!(!err.contains("secret"), "{err}");
        let err = refused(&two(
            pg,
            &format!("{pg_other_user}\noutbox_table = \"billing\""),
        ));
        assert!(
            err.contains("share the nodes table public.outbox_nodes")
                && err.contains("nodes_table"),
            "{err}"
        );
        // Their own tables: accepted.
        outboxes_of(
            &two(
                pg,
                &format!("{pg}\noutbox_table = \"billing\"\nnodes_table = \"billing_nodes\""),
            ),
            &["outbox-relay", "run"],
        )
        .unwrap();
        let err = refused(&two(
            &format!("{pg}\ncapture = \"wal\""),
            &format!("{pg}\ncapture = \"wal\"\noutbox_table = \"b\"\nnodes_table = \"bn\""),
        ));
        // Their default slots differ (named after their tables); the publication is shared.
        assert!(err.contains("publication outbox_relay"), "{err}");
        // Slot names are the server's: two databases of one server (one URL with the
        // default port spelled out) cannot both use one slot; by default their slots are
        // named after their databases.
        let one = "database_url = \"postgres://relay@db/one\"\ncapture = \"wal\"";
        let two_db = "database_url = \"postgres://relay@db:5432/two\"\ncapture = \"wal\"";
        outboxes_of(&two(one, two_db), &["outbox-relay", "run"]).unwrap();
        let err = refused(&two(
            &format!("{one}\nslot = \"shared\""),
            &format!("{two_db}\nslot = \"shared\""),
        ));
        assert!(
            err.contains("replication slot shared of postgres://db:5432"),
            "{err}"
        );
        let err = refused(&two("", ""));
        assert!(
            err.contains("both relay public.outbox of sqlite:outbox.db"),
            "{err}"
        );
        let err = refused(&two(
            pg,
            "database_url = \"sqlite:b.db\"\nhttp_addr = \"127.0.0.1:1\"",
        ));
        assert!(
            err.contains("`b` sets `http_addr`, which belongs to the whole process"),
            "{err}"
        );
        let err = refused(&two(pg, "database_url = \"sqlite:b.db\"\nbatch_sise = 5"));
        assert!(
            err.contains("[[outboxes]] `b`: setting `batch_sise`: unknown setting"),
            "{err}"
        );
        let err = refused(&two(pg, "database_url = \"sqlite:b.db\"\nbatch_size = 0"));
        assert!(
            err.contains("[[outboxes]] `b`: batch_size must be"),
            "{err}"
        );
        let err = refused("[[outboxes]]\ndatabase_url = \"sqlite:b.db\"\n");
        assert!(err.contains("entry 1 has no name"), "{err}");
        let err = refused("[[outboxes]]\nname = \"Orders!\"\n");
        assert!(err.contains("invalid [[outboxes]] name"), "{err}");
        let err = refused(
            &two(
                "database_url = \"sqlite:a.db\"",
                "database_url = \"sqlite:b.db\"",
            )
            .replace("\"b\"", "\"a\""),
        );
        assert!(
            err.contains("two [[outboxes]] entries are named \"a\""),
            "{err}"
        );
    }

    /// `Config::load` with `args` in a jail holding `files`: the config, or the error as the
    /// binary prints it and whether it is a configuration error (exit 2).
    fn load_with_files(
        files: &[(&str, &str)],
        env: &[(&str, &str)],
        args: &[&str],
    ) -> Result<Config, (String, bool)> {
        let mut result = Err((String::new(), false));
        figment::Jail::expect_with(|jail| {
            for (name, content) in files {
                jail.create_file(name, content)?;
            }
            for (k, v) in env {
                jail.set_env(k, v);
            }
            let toml = files.iter().any(|(n, _)| *n == "relay.toml");
            let file = toml.then_some(Path::new("relay.toml"));
            result = Config::load(file, flags(args)).map_err(|e| {
                let config = e.downcast_ref::<crate::commands::ConfigError>().is_some();
                (format!("{e:#}"), config)
            });
            Ok(())
        });
        result
    }

    const URL_WITH_PASSWORD: &str = "postgres://relay:pw-in-file-7f3a@db.internal/app";

    #[test]
    fn the_database_url_is_read_from_a_file_given_by_flag_variable_or_setting() {
        let file = ("db-url", &*format!("{URL_WITH_PASSWORD}\n"));
        let by_flag = load_with_files(
            &[file],
            &[],
            &["outbox-relay", "check", "--database-url-file", "db-url"],
        )
        .unwrap();
        assert_eq!(
            by_flag.database_url, URL_WITH_PASSWORD,
            "the newline trimmed"
        );
        assert_eq!(by_flag.database_kind().unwrap(), DatabaseKind::Postgres);
        let shown = format!("{by_flag:?}");
        assert!(
            !shown.contains("pw-in-file") && shown.contains("(from db-url)"),
            "{shown}"
        );
        let by_env = load_with_files(
            &[file],
            &[("OUTBOX_RELAY_DATABASE_URL_FILE", "db-url")],
            &["outbox-relay", "migrate"],
        )
        .unwrap();
        assert_eq!(by_env.database_url, URL_WITH_PASSWORD);
        let by_setting = load_with_files(
            &[file, ("relay.toml", "database_url_file = \"db-url\"\n")],
            &[],
            &["outbox-relay", "stats"],
        )
        .unwrap();
        assert_eq!(by_setting.database_url, URL_WITH_PASSWORD);
    }

    #[test]
    fn a_database_url_file_that_cannot_serve_is_a_configuration_error_naming_it() {
        let flag = ["outbox-relay", "check", "--database-url-file", "db-url"];
        let refused = |files: &[(&str, &str)], env: &[(&str, &str)], args: &[&str]| {
            let (err, config) = load_with_files(files, env, args).unwrap_err();
            assert!(config, "a configuration error (exit 2): {err}");
            assert!(!err.contains("pw-in-file"), "{err}");
            err
        };
        let missing = refused(&[], &[], &flag);
        assert!(
            missing.contains("cannot read the database URL file db-url")
                && missing.contains("--database-url-file"),
            "{missing}"
        );
        let empty = refused(&[("db-url", "\n")], &[], &flag);
        assert!(
            empty.contains("the database URL file db-url is empty")
                && empty.contains("put the database URL on its first line"),
            "{empty}"
        );
        // A URL beside the file, from any source: one of them would be ignored.
        let file = ("db-url", URL_WITH_PASSWORD);
        for env in [
            ("DATABASE_URL", "postgres://other/db"),
            ("OUTBOX_RELAY_DATABASE_URL", "postgres://other/db"),
        ] {
            let both = refused(&[file], &[env], &flag);
            assert!(both.contains("keep one"), "{both}");
        }
        let both = refused(
            &[file, ("relay.toml", "database_url = \"sqlite:x.db\"\n")],
            &[("OUTBOX_RELAY_DATABASE_URL_FILE", "db-url")],
            &["outbox-relay", "run"],
        );
        assert!(both.contains("--database-url-file"), "{both}");
        // A URL the file holds that is no database URL is refused without its password.
        // (`main` exits 2 for every error of `load`.)
        let (bad, _) = load_with_files(
            &[("db-url", "oracle://relay:pw-in-file-7f3a@db/app")],
            &[],
            &flag,
        )
        .unwrap_err();
        assert!(
            bad.contains("unsupported database URL") && !bad.contains("pw-in-file"),
            "{bad}"
        );
    }

    #[test]
    fn an_outbox_has_its_own_database_url_file_or_inherits_the_top_level_one() {
        let toml = r#"
            database_url_file = "top-url"
            [[outboxes]]
            name = "inherits"
            [[outboxes]]
            name = "own-url"
            database_url = "postgres://relay@db/own"
            [[outboxes]]
            name = "own-file"
            database_url_file = "own-url"
            outbox_table = "own_outbox"
            nodes_table = "own_nodes"
            "#;
        let files = [
            ("relay.toml", toml),
            ("top-url", "postgres://relay:pw-top@db/top\n"),
            ("own-url", "postgres://relay:pw-own@db/top\n"),
        ];
        let outboxes_with = |files: &[(&str, &str)], args: &[&str]| {
            let mut result = Err(String::new());
            figment::Jail::expect_with(|jail| {
                for (name, content) in files {
                    jail.create_file(name, content)?;
                }
                let flags = flags(args);
                result = Config::load(Some(Path::new("relay.toml")), flags.clone())
                    .and_then(|c| c.outboxes(&flags))
                    .map_err(|e| format!("{e:#}"));
                Ok(())
            });
            result
        };
        let outboxes = outboxes_with(&files, &["outbox-relay", "check"]).unwrap();
        let urls: Vec<&str> = outboxes
            .iter()
            .map(|o| o.config.database_url.as_str())
            .collect();
        assert_eq!(
            urls,
            [
                "postgres://relay:pw-top@db/top",
                "postgres://relay@db/own",
                "postgres://relay:pw-own@db/top"
            ]
        );
        // A flag is every outbox's, as everywhere.
        let outboxes = outboxes_with(
            &[
                files[0],
                files[1],
                files[2],
                ("flag-url", "postgres://relay@db/flag"),
            ],
            &["outbox-relay", "check", "--database-url-file", "flag-url"],
        );
        // Two outboxes of one database and table: refused, which shows the flag's URL
        // replaced the top level's and the entry's own.
        let err = outboxes.unwrap_err();
        assert!(
            err.contains("`inherits` and `own-url` both relay public.outbox of")
                && err.contains("db:5432/flag"),
            "{err}"
        );
        let both = outboxes_with(
            &[(
                "relay.toml",
                "[[outboxes]]\nname = \"a\"\ndatabase_url = \"sqlite:a.db\"\n\
                 database_url_file = \"a-url\"\n",
            )],
            &["outbox-relay", "check"],
        )
        .unwrap_err();
        assert!(
            both.contains("`a` sets both database_url and database_url_file"),
            "{both}"
        );
        let missing = outboxes_with(
            &[(
                "relay.toml",
                "[[outboxes]]\nname = \"a\"\ndatabase_url_file = \"a-url\"\n",
            )],
            &["outbox-relay", "check"],
        )
        .unwrap_err();
        assert!(
            missing.contains("`a`") && missing.contains("database URL file a-url"),
            "{missing}"
        );
    }

    #[test]
    fn a_slot_is_named_after_its_database_and_table_unless_one_is_configured() {
        let named = |url: &str, table: Option<&str>, slot: &str| {
            Config {
                database_url: url.into(),
                outbox_table: table.unwrap_or("outbox").into(),
                slot: slot.into(),
                ..Config::default()
            }
            .slot_name()
        };
        let url = "postgres://relay@db:5432/shop";
        assert_eq!(named(url, None, ""), "outbox_relay_shop");
        assert_eq!(named(url, Some("orders"), ""), "outbox_relay_shop_orders");
        assert_eq!(named(url, None, "mine"), "mine");
        assert_eq!(
            named(url, None, "outbox_relay"),
            "outbox_relay",
            "an explicit old name"
        );
        // Not [a-z0-9_], or too long: a stable hash of the whole keeps names apart.
        let odd = named("postgres://relay@db/Shop-EU", None, "");
        assert!(odd.starts_with("outbox_relay_shop_eu_"), "{odd}");
        assert_ne!(odd, named("postgres://relay@db/shop_eu", None, ""));
        let long = named(&format!("postgres://relay@db/{}", "d".repeat(80)), None, "");
        assert_eq!(long.len(), 63, "{long}");
        assert_eq!(
            long,
            named(&format!("postgres://relay@db/{}", "d".repeat(80)), None, "")
        );
    }
}
