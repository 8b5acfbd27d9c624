//! Configuration: defaults, then a TOML file, then `OUTBOX_RELAY_*` environment variables
//! (and `DATABASE_URL`), then command-line flags. Later sources win.
//!
//! Each part of the relay owns its settings, declared once beside the code that reads them
//! with `outbox_core::settings!`: [`EngineSettings`] (outbox-engine), [`ClusterSettings`]
//! (outbox-cluster), [`WalSettings`] (outbox-wal), [`DatabaseSettings`] (`store/settings.rs`),
//! [`HttpSettings`] (`http/settings.rs`) and [`RelaySettings`] (here: sinks, the node, logging
//! and `[[outboxes]]`). [`Config`] `#[serde(flatten)]`s them, so a key is a field's name in
//! the file and, upper-cased, in `OUTBOX_RELAY_<KEY>`. A setting that has a flag is a field
//! of the same name in `cli.rs`, serialized as it is into the flags' layer; the flag's help
//! is the setting's documentation and default ([`reference()`]), which `outbox-relay settings`
//! prints whole. [`Config::validate`] runs each part's own checks and the rules between
//! parts; [`Config::resolve`] turns the result into what `run` hands to the engine, the
//! cluster coordinator, the sinks and the HTTP server.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use anyhow::bail;
use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::{Dict, Value};
use figment::{Figment, Provider};
use outbox_cluster::{ClusterConfig, ClusterSettings};
use outbox_core::redact::{redact_url, Secret};
use outbox_core::settings::{Documented, SettingDoc};
use outbox_core::{Health, NodeId};
use outbox_engine::{EngineConfig, EngineSettings, WakeMode};
use outbox_layout::{Dialect, LayoutKind};
use outbox_publishers::{RouteConfig, SinkConfig};
use outbox_wal::WalSettings;
use serde::{Deserialize, Serialize};

pub use crate::http::settings::HttpSettings;
pub use crate::store::settings::{CaptureMode, DatabaseKind, DatabaseSettings, WakeupMode};
use crate::store::settings::{DEFAULT_NODES_TABLE, DEFAULT_POOL_SIZE, DEFAULT_SCHEMA};
use crate::store::StoreSettings;

/// The zero-configuration sink.
pub const DEFAULT_SINK: &str = "stdout";
/// The file read from the working directory when `--config` is not given.
pub const DEFAULT_CONFIG_FILE: &str = "outbox-relay.toml";
/// Events, errors and start-up lines; `debug` is for one crate at a time.
const DEFAULT_LOG_LEVEL: &str = "info";
/// More worker threads than this is a typo, not a host.
const MAX_WORKER_THREADS: usize = 1024;
/// Database connections per pool: far beyond what a database serves one client.
const MAX_POOL_SIZE: usize = 1000;

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

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

outbox_core::settings! {
    /// The binary's own settings: where events go, the node, how the parts fit together
    /// (ordering), logging, and `[[outboxes]]`.
    #[derive(Clone, PartialEq)]
    pub struct RelaySettings {
        /// Where every event goes: stdout, file:PATH, nats://, kafka://, amqp://, redis://,
        /// http(s)://URL-template, ably:, sqs:, sns:, kinesis: or eventbridge: [default: the
        /// config's [sinks]/[[routes]], else stdout].
        pub sink: Option<String> = None,
        /// Named sinks ([sinks.NAME]), used with [[routes]]; each reads the settings of its
        /// URI's scheme.
        pub sinks: BTreeMap<String, SinkConfig> = BTreeMap::new(),
        /// Destination globs to sinks and target templates ([[routes]]), first match wins.
        pub routes: Vec<RouteConfig> = Vec::new(),
        /// This node's id in the nodes table [default: <hostname>-<random>].
        pub node_id: Option<String> = None,
        /// key: per-key order across the cluster, through partition ownership (PostgreSQL's
        /// native outbox); none: every node claims any ready rows, for maximum throughput (a
        /// mapped layout, every MySQL/MariaDB outbox among them, runs one active relay either
        /// way: none only stops one key's failure from holding back its later events). All
        /// nodes of an outbox use the same mode: on PostgreSQL's native outbox a node is
        /// refused (exit 2) beside live nodes of the other mode.
        pub ordering: OrderingMode = OrderingMode::Key,
        /// Log format.
        pub log_format: LogFormat = LogFormat::Text,
        /// Log level or filter, e.g. info, debug, outbox_engine=debug.
        pub log_level: String = DEFAULT_LOG_LEVEL.into(),
        /// Threads that run the relay's tasks (each [[outboxes]] entry gets as many). One
        /// suits most hosts: the work per event is small, and tasks that hand events to each
        /// other on one thread skip the cross-thread wake-ups that cost a second thread more
        /// CPU than it adds (BENCHMARKS.md). More may help a host with idle cores and many
        /// busy destinations.
        pub worker_threads: usize = 1,
        /// Several outboxes in one process ([[outboxes]]), each a table of settings that replace
        /// the top-level ones, with a name.
        pub outboxes: Vec<Dict> = Vec::new(),
    }
}

/// Sinks are listed by name only: their URIs and settings may hold credentials.
impl std::fmt::Debug for RelaySettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelaySettings")
            .field("sink", &self.sink.as_deref().map(redact_url))
            .field("sinks", &self.sinks.keys().collect::<Vec<_>>())
            .field("node_id", &self.node_id)
            .field("ordering", &self.ordering)
            .finish_non_exhaustive()
    }
}

/// A lowercase name of a settings enum, as the settings file writes it.
fn lower(value: impl std::fmt::Debug) -> String {
    format!("{value:?}").to_lowercase()
}

impl Config {
    /// What `check` says of the configuration in effect: the settings an operator looks
    /// for, readable, with no secret (the database URL redacted, sinks by name or redacted
    /// URI, the admin token only as present). It printed `Config { database: … }`.
    pub fn summary(&self) -> String {
        let database = &self.database;
        let (outbox, nodes) = database.shown_tables();
        let sinks = match (
            &self.relay.sink,
            self.relay.sinks.keys().collect::<Vec<_>>(),
        ) {
            (Some(uri), _) => redact_url(uri),
            (None, names) if names.is_empty() => "stdout".to_string(),
            (None, names) => names
                .iter()
                .map(|n| n.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        };
        let engine = &self.engine;
        let retry = &engine.retry;
        let http = &self.http;
        let token = match http.admin_token.is_some() || http.admin_token_file.is_some() {
            true => "an admin token required",
            false => "no admin token: the admin API is read-only",
        };
        let http = match http.http_addr.trim() {
            "" => "off".to_string(),
            addr => format!("{addr} ({token})"),
        };
        format!(
            "    database: {} (layout {}, capture {}, tables {outbox} and {nodes}{})\n    sinks: {sinks} \
             (ordering {}{})\n    claims of {} rows, at most {} in flight, lease {:?}, publish \
             timeout {:?}; up to {} attempts, {:?} to {:?} apart\n    http: {http}",
            database.shown_url(),
            database.layout,
            lower(database.capture),
            match database.retain_delivered {
                true => ", delivered rows kept",
                false => "",
            },
            lower(self.relay.ordering),
            match &self.relay.node_id {
                Some(node) => format!(", node {node}"),
                None => String::new(),
            },
            engine.batch_size,
            engine.max_in_flight,
            engine.lease,
            engine.publish_timeout,
            retry.max_attempts,
            retry.base_delay,
            retry.max_delay,
        )
    }
}

/// Every setting: each part's struct flattened, so that its fields are top-level keys.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(flatten)]
    pub database: DatabaseSettings,
    #[serde(flatten)]
    pub engine: EngineSettings,
    #[serde(flatten)]
    pub cluster: ClusterSettings,
    #[serde(flatten)]
    pub wal: WalSettings,
    #[serde(flatten)]
    pub http: HttpSettings,
    #[serde(flatten)]
    pub relay: RelaySettings,
}

/// The parts' declarations, in `Config`'s order.
const PARTS: [&[SettingDoc]; 6] = [
    DatabaseSettings::DOCS,
    EngineSettings::DOCS,
    ClusterSettings::DOCS,
    WalSettings::DOCS,
    HttpSettings::DOCS,
    RelaySettings::DOCS,
];

/// Every setting's documentation, part by part, as the reference and the flags' help show
/// it; a table's keys (`retry.max_attempts`) follow the table's own.
pub fn reference() -> &'static [(String, &'static str)] {
    static REFERENCE: OnceLock<Vec<(String, &'static str)>> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let tables: [(&str, &[SettingDoc]); 1] = [("retry", outbox_core::RetryPolicy::DOCS)];
        let mut all = Vec::new();
        for doc in PARTS.into_iter().flatten() {
            all.push((doc.key.to_string(), doc.doc));
            if let Some((table, keys)) = tables.iter().find(|(t, _)| *t == doc.key) {
                all.extend(keys.iter().map(|k| (format!("{table}.{}", k.key), k.doc)));
            }
        }
        all
    })
}

/// The top-level keys, as serde's "expected one of" lists them.
fn top_level_keys() -> &'static [&'static str] {
    static KEYS: OnceLock<Vec<&'static str>> = OnceLock::new();
    KEYS.get_or_init(|| PARTS.into_iter().flatten().map(|doc| doc.key).collect())
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

impl Config {
    /// The settings `figment` holds. serde's flatten hands each part its values without
    /// figment's record of where they came from (Figment#80), so a failure is diagnosed
    /// again with each part extracted on its own, where figment names the setting and its
    /// source (a file, a variable, a flag).
    #[allow(clippy::result_large_err)] // figment's own error, handed on as figment made it
    pub fn extract(figment: &Figment) -> Result<Config, figment::Error> {
        figment.extract::<Config>().map_err(|flattened| {
            unknown_setting(figment)
                .or_else(|| figment.extract::<DatabaseSettings>().err())
                .or_else(|| figment.extract::<EngineSettings>().err())
                .or_else(|| figment.extract::<ClusterSettings>().err())
                .or_else(|| figment.extract::<WalSettings>().err())
                .or_else(|| figment.extract::<HttpSettings>().err())
                .or_else(|| figment.extract::<RelaySettings>().err())
                .unwrap_or(flattened)
        })
    }

    /// Layers the sources. `file` is `--config`; without it `outbox-relay.toml` is read if
    /// present. `flags` is the command line's layer (`Cli::flags`).
    pub fn load(file: Option<&Path>, flags: impl Provider + Clone) -> anyhow::Result<Config> {
        // The layers above the defaults, kept apart so that a database URL given anywhere
        // can be told from the default one (`database_url_file` refuses the former).
        let mut figment = Figment::new();
        match file {
            Some(path) => figment = figment.merge(config_file(path)?),
            None if Path::new(DEFAULT_CONFIG_FILE).exists() => {
                figment = figment.merge(Toml::file(DEFAULT_CONFIG_FILE));
            }
            None => {}
        }
        // `vars_os`: `vars` panics on a variable that is no UTF-8, anywhere in the environment.
        let service_links: std::collections::HashSet<String> = std::env::vars_os()
            .filter_map(|(name, value)| {
                let name = name.into_string().ok()?;
                let key = name.strip_prefix("OUTBOX_RELAY_")?.to_ascii_lowercase();
                kubernetes_service_link(&key, &value.to_string_lossy()).then_some(key)
            })
            .collect();
        let env = Env::prefixed("OUTBOX_RELAY_")
            .split("__")
            // OUTBOX_RELAY_CONFIG names the file (`--config`); it is no setting. The admin
            // token is read below, untrimmed. The webhook secret and the Ably key are read
            // by their sinks.
            .ignore(&["webhook_secret", "config", "admin_token", "ably_api_key"])
            .filter(move |key| !service_links.contains(&key.as_str().to_ascii_lowercase()));
        let layout: LayoutKind = figment
            .clone()
            .merge(AsWritten(env.clone()))
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
        figment = figment.merge(AsWritten(env));
        if let Ok(token) = std::env::var("OUTBOX_RELAY_ADMIN_TOKEN") {
            figment = figment.merge(Serialized::default("admin_token", Secret::new(token)));
        }
        figment = figment.merge(flags);
        let url_given = figment.contains("database_url");
        let defaults = Figment::from(Serialized::defaults(Config::default()));
        let mut config = Config::extract(&defaults.merge(figment))
            .map_err(|e| anyhow::anyhow!("invalid configuration: {}", describe_figment_error(e)))?;
        config.read_database_url_file(url_given)?;
        if config.relay.outboxes.is_empty() {
            config.validate()?;
        } else {
            // The top level only lends its settings to the outboxes, each validated whole
            // (`outboxes`); what belongs to the process is checked here.
            config.http.validate()?;
            config.check_worker_threads()?;
        }
        Ok(config)
    }

    /// A warning for each file read for this configuration that holds a secret and that
    /// every user of the host may read: the settings file (`file`, as given to [`load`]) when
    /// it sets a secret, and the admin token and database URL files. Logged once logging is
    /// up; the relay runs on, as libpq does with a readable password file.
    ///
    /// [`load`]: Config::load
    pub fn secrets_everyone_may_read(&self, file: Option<&Path>) -> Vec<String> {
        use crate::secret_file::{exposed_warning, readable_by_everyone};
        let mut warnings = Vec::new();
        let settings_file = file.or_else(|| {
            let default = Path::new(DEFAULT_CONFIG_FILE);
            default.exists().then_some(default)
        });
        if let Some(path) = settings_file {
            if let Some(mode) = readable_by_everyone(path) {
                let secrets = secrets_set_by(path);
                if !secrets.is_empty() {
                    let subject = format!(
                        "the settings file {} (it sets {})",
                        path.display(),
                        secrets.join(", ")
                    );
                    warnings.push(exposed_warning(&subject, path, mode));
                }
            }
        }
        let outbox_url_files = self.relay.outboxes.iter().filter_map(|outbox| {
            outbox
                .get("database_url_file")
                .and_then(|value| value.as_str())
                .map(PathBuf::from)
        });
        let files = [
            (self.http.admin_token_file.clone(), "the admin token file"),
            (
                self.database.database_url_file.clone(),
                "the database URL file",
            ),
        ]
        .into_iter()
        .filter_map(|(path, what)| Some((path?, what)))
        .chain(outbox_url_files.map(|path| (path, "the database URL file")));
        for (path, what) in files {
            if let Some(mode) = readable_by_everyone(&path) {
                let subject = format!("{what} {}", path.display());
                warnings.push(exposed_warning(&subject, &path, mode));
            }
        }
        warnings
    }

    /// The runtime's worker count, which the process uses before any outbox is validated.
    fn check_worker_threads(&self) -> anyhow::Result<()> {
        if !(1..=MAX_WORKER_THREADS).contains(&self.relay.worker_threads) {
            bail!(
                "worker_threads must be between 1 and {MAX_WORKER_THREADS} (got {})",
                self.relay.worker_threads
            );
        }
        Ok(())
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        let database = self.database.database_kind()?;
        self.http.allowed_host_names()?;
        self.engine.validate().map_err(anyhow::Error::msg)?;
        self.cluster.validate().map_err(anyhow::Error::msg)?;
        if self.database.partitions == 0 || self.database.partitions > 4096 {
            bail!(
                "partitions must be between 1 and 4096 (got {})",
                self.database.partitions
            );
        }
        self.http.socket_addr()?;
        self.check_worker_threads()?;
        if !(1..=MAX_POOL_SIZE).contains(&self.database.pool_size) {
            bail!(
                "pool_size must be between 1 and {MAX_POOL_SIZE} (got {})",
                self.database.pool_size
            );
        }
        self.refuse_settings_without_effect(&database)?;
        self.database.check_names()?;
        if let Some(node_id) = &self.relay.node_id {
            check_node_id(node_id, &database)?;
        }
        Ok(())
    }

    /// A setting that cannot apply to this configuration is an error, never silently ignored.
    fn refuse_settings_without_effect(&self, database: &DatabaseKind) -> anyhow::Result<()> {
        let db = &self.database;
        if let Some(store) = database.other_than_postgres() {
            // Empty: not given. A name given is refused even when it is PostgreSQL's
            // default channel, which was once let through as if it were no name.
            if !db.notify_channel.is_empty() {
                bail!(
                    "notify_channel has no effect on {store}, which has no NOTIFY (the relay \
                     {}): remove the setting",
                    self.wake_description()
                );
            }
            if db.wakeup == WakeupMode::Gated {
                bail!(
                    "wakeup = \"gated\" (--wakeup gated) gates PostgreSQL's NOTIFY, which {store} \
                     does not have: remove it (or use --wakeup poll to poll at a fixed rate)"
                );
            }
        }
        if db.database_ca_file.is_some() && *database != DatabaseKind::Postgres {
            bail!(
                "database_ca_file (--database-ca-file) is read by the PostgreSQL store only: \
                 remove it (MySQL/MariaDB verify against the system's CAs with the URL's \
                 `verify_ca=true`; add a private CA to the system's store)"
            );
        }
        if let DatabaseKind::Sqlite(_) = database {
            let given = [
                (
                    !(db.nodes_table.is_empty() || db.nodes_table == DEFAULT_NODES_TABLE)
                        || db.nodes_schema != DEFAULT_SCHEMA,
                    "nodes_table and nodes_schema have no effect on SQLite, whose store uses \
                     `outbox_nodes`: remove them",
                ),
                (
                    db.pool_size != DEFAULT_POOL_SIZE,
                    "pool_size has no effect on SQLite, which writes through one connection: \
                     remove it",
                ),
                (
                    db.partitions != outbox_core::partition::DEFAULT_PARTITIONS,
                    "partitions has no effect on SQLite, the single-node store: remove it",
                ),
            ];
            if let Some((_, refusal)) = given.iter().find(|(set, _)| *set) {
                bail!("{refusal}");
            }
            if db.layout != LayoutKind::Native {
                bail!(
                    "layout = \"{}\" runs on PostgreSQL or MySQL/MariaDB; SQLite supports the \
                     native layout only: remove --layout (or use a PostgreSQL or MySQL URL)",
                    db.layout
                );
            }
            let table = db.outbox_table.as_str();
            if !(table.is_empty() || table == LayoutKind::Native.default_outbox_table())
                || db.outbox_schema != DEFAULT_SCHEMA
            {
                bail!(
                    "outbox_table and outbox_schema have no effect on SQLite, whose store uses \
                     `outbox`: remove them"
                );
            }
        }
        if db.partitions != outbox_core::partition::DEFAULT_PARTITIONS {
            let one_active = match database {
                DatabaseKind::MySql => Some("MySQL/MariaDB run one active relay per outbox"),
                _ if db.capture == CaptureMode::Wal => Some("WAL capture runs one reader per slot"),
                _ if db.layout != LayoutKind::Native => {
                    Some("a mapped layout runs one active relay per table")
                }
                _ => None,
            };
            if let Some(why) = one_active {
                bail!(
                    "partitions has no effect here: {why}, which leases no partitions; remove \
                     it (partitions split keys among the nodes of PostgreSQL's native outbox)"
                );
            }
        }
        let nodes_given = !(db.nodes_table.is_empty() || db.nodes_table == DEFAULT_NODES_TABLE)
            || db.nodes_schema != DEFAULT_SCHEMA;
        if nodes_given && !db.uses_nodes_table() {
            bail!(
                "nodes_table and nodes_schema have no effect with layout = \"{}\", which runs \
                 one active relay behind a lock and keeps no nodes table: remove them",
                db.layout
            );
        }
        if *database == DatabaseKind::MySql && db.nodes_schema != DEFAULT_SCHEMA {
            bail!(
                "nodes_schema has no effect on MySQL/MariaDB, whose nodes table is in the \
                 outbox's database: remove it"
            );
        }
        if *database == DatabaseKind::MySql && !db.layout.runs_on(Dialect::MySql) {
            bail!(
                "layout = \"{}\" is a PostgreSQL table (its seed defines it for PostgreSQL); on \
                 MySQL/MariaDB use the native or mysql-outbox-events layout, or a custom mapping",
                db.layout
            );
        }
        if db.retain_delivered && db.layout != LayoutKind::Native {
            if let Some(mapping) = db.layout_mapping()? {
                if !mapping.retains_delivered() {
                    bail!(
                        "retain_delivered (--retain-delivered) has no effect with layout = \
                         \"{}\", which deletes a delivered row: remove it, or use a layout that \
                         marks delivered rows (or a custom mapping with on_success marking them)",
                        db.layout
                    );
                }
            }
        }
        if db.layout != LayoutKind::Custom && db.mapping.is_some() {
            bail!(
                "a [mapping] section has no effect with layout = \"{}\": set layout = \"custom\" \
                 to use it, or remove it",
                db.layout
            );
        }
        if self.engine.poll_fixed_rate && db.wakeup == WakeupMode::Gated {
            bail!(
                "poll_fixed_rate (--poll-fixed-rate) and wakeup = \"gated\" contradict each other: \
                 a fixed-rate relay never listens, so the gate would wake nobody; use --wakeup \
                 poll to poll at a fixed rate, or drop --poll-fixed-rate"
            );
        }
        if db.capture == CaptureMode::Wal {
            self.refuse_settings_without_effect_on_wal(database)?;
        } else if self.wal.is_set() {
            bail!(
                "slot, publication and wal_memory_mib apply to WAL capture only: add --capture \
                 wal (capture = \"wal\"), or remove them"
            );
        }
        if db.capture == CaptureMode::Binlog {
            self.refuse_settings_without_effect_on_binlog(database)?;
        } else if db.binlog_memory_mib.is_some() {
            bail!(
                "binlog_memory_mib (--binlog-memory-mib) applies to binlog capture only: add \
                 --capture binlog (capture = \"binlog\"), or remove it"
            );
        } else if db.binlog_server_id.is_some() {
            bail!(
                "binlog_server_id (--binlog-server-id) applies to binlog capture only: add \
                 --capture binlog (capture = \"binlog\"), or remove it"
            );
        }
        let relay = &self.relay;
        // An empty value is a value: a template's `OUTBOX_RELAY_SINK: ""` (the Kubernetes
        // Secret's) set beside [[routes]] was refused as replacing them, and alone failed
        // as a URI of no scheme, neither naming the empty setting.
        if relay.sink.as_ref().is_some_and(|s| s.trim().is_empty()) {
            bail!(
                "sink (--sink, OUTBOX_RELAY_SINK) is set but empty: give a sink URI (e.g. \
                 nats://nats:4222), or unset it (in Kubernetes, delete the key from the \
                 outbox-relay-env Secret) to use the settings file's [sinks.NAME] and \
                 [[routes]], or the default, stdout"
            );
        }
        let urls = std::iter::once((
            "database_url (--database-url)".to_string(),
            self.database.database_url.as_str(),
        ))
        .chain(
            relay
                .sink
                .as_deref()
                .map(|s| ("sink (--sink)".to_string(), s)),
        )
        .chain(
            (relay.sinks.iter()).map(|(name, sink)| (format!("[sinks.{name}] uri"), sink.uri())),
        );
        for (setting, url) in urls {
            if outbox_core::redact::user_info_has_whitespace(url) {
                bail!(
                    "{setting}: its user info (the password) holds a space, which the relay's \
                     messages could not hide: percent-encode it (a space is %20; the clients \
                     decode it)"
                );
            }
        }
        if relay.sinks.is_empty() && relay.sink.is_none() {
            if let Some(route) = relay.routes.first() {
                bail!(
                    "[[routes]] sends to the sink {:?}, but no [sinks.NAME] is set, so every \
                     event would go to stdout: add [sinks.{}] (an [[outboxes]] entry that sets \
                     its routes sets its [sinks] too: it replaces the top level's)",
                    route.sink,
                    route.sink
                );
            }
        }
        if relay.sink.is_some() && (!relay.routes.is_empty() || !relay.sinks.is_empty()) {
            bail!(
                "sink (--sink, OUTBOX_RELAY_SINK) replaces every [sinks.NAME] and [[routes]], \
                 which would be ignored: give either sink or [sinks] with [[routes]], not both"
            );
        }
        for route in &relay.routes {
            route.cloudevents().map_err(anyhow::Error::msg)?;
        }
        // The engine gives up on a publish after publish_timeout: a sink's longer wait for
        // its broker would be cut short there.
        let (sinks, _) = self.sink_setup();
        for (name, sink) in &sinks {
            if let Some(timeout) = sink.settings().confirm_timeout() {
                if timeout >= self.engine.publish_timeout {
                    bail!(
                        "the sink {name}'s timeout ({timeout:?}) must be shorter than \
                         publish_timeout ({:?}), which ends every publish first: lower the \
                         sink's timeout, or raise publish_timeout (and lease, which must stay \
                         longer)",
                        self.engine.publish_timeout
                    );
                }
            }
            // A request that waited for a free slot for half the sink's timeout still has
            // its whole timeout: cut short by publish_timeout, its batch's events were all
            // retried, those the broker had taken too.
            if let Some(longest) = sink.settings().longest_batch() {
                if longest >= self.engine.publish_timeout {
                    bail!(
                        "the sink {name} may take {longest:?} for a batch (its timeout is {:?}: \
                         a request waits up to half of it for a free slot, then has all of it), \
                         not shorter than publish_timeout ({:?}), which would end such a batch \
                         and retry its delivered events too: keep the sink's timeout under two \
                         thirds of publish_timeout (lower it, or raise publish_timeout and \
                         lease)",
                        sink.settings()
                            .confirm_timeout()
                            .unwrap_or(outbox_publishers::settings::DEFAULT_SINK_TIMEOUT),
                        self.engine.publish_timeout
                    );
                }
            }
        }
        Ok(())
    }

    fn refuse_settings_without_effect_on_wal(&self, database: &DatabaseKind) -> anyhow::Result<()> {
        if *database != DatabaseKind::Postgres {
            bail!("capture = \"wal\" reads PostgreSQL's logical replication: use a postgres:// URL, or --capture poll");
        }
        let db = &self.database;
        if !matches!(db.layout, LayoutKind::Native | LayoutKind::Debezium) {
            bail!(
                "capture = \"wal\" reads the native outbox table, Debezium's outbox table \
                 (layout = \"debezium\") and outbox_emit messages; layout = \"{}\" is polled: \
                 use --capture poll with it",
                db.layout
            );
        }
        let refused = [
            (db.retain_delivered, "retain_delivered (--retain-delivered): WAL capture deletes a delivered row; replay has nothing to read"),
            (self.relay.ordering == OrderingMode::None, "ordering = \"none\" (--ordering none): WAL capture relays each key in commit order"),
            (db.wakeup != WakeupMode::Notify, "wakeup (--wakeup): the replication stream wakes the relay, writers never notify"),
            (!db.notify_channel.is_empty(), "notify_channel: the replication stream wakes the relay, nothing listens"),
            (self.engine.poll_fixed_rate, "poll_fixed_rate (--poll-fixed-rate): the replication stream wakes the relay"),
        ];
        if let Some((_, what)) = refused.iter().find(|(set, _)| *set) {
            bail!("{what}; remove it, or use --capture poll");
        }
        self.wal.validate().map_err(anyhow::Error::msg)
    }

    fn refuse_settings_without_effect_on_binlog(
        &self,
        database: &DatabaseKind,
    ) -> anyhow::Result<()> {
        if *database != DatabaseKind::MySql {
            bail!("capture = \"binlog\" reads the MySQL/MariaDB binary log: use a mysql:// URL, or --capture poll");
        }
        let db = &self.database;
        if !matches!(
            db.layout,
            LayoutKind::Native | LayoutKind::MysqlOutboxEvents | LayoutKind::Custom
        ) {
            bail!(
                "capture = \"binlog\" reads the native outbox table, the MySQL seed's \
                 (layout = \"mysql-outbox-events\") and custom mappings; layout = \"{}\" is \
                 polled: use --capture poll with it",
                db.layout
            );
        }
        if db.binlog_server_id == Some(0) {
            bail!("binlog_server_id must be 1 or more: the server refuses a replica with id 0");
        }
        if let Some(mib) = db.binlog_memory_mib {
            if !(1..=outbox_wal::MAX_MEMORY_MIB).contains(&mib) {
                bail!(
                    "binlog_memory_mib must be between 1 and {} (got {mib}): it is the MiB of \
                     events binlog capture may hold",
                    outbox_wal::MAX_MEMORY_MIB
                );
            }
        }
        let refused = [
            (db.retain_delivered, "retain_delivered (--retain-delivered): binlog capture deletes a delivered row"),
            (self.relay.ordering == OrderingMode::None, "ordering = \"none\" (--ordering none): binlog capture relays each key in commit order"),
            (self.engine.poll_fixed_rate, "poll_fixed_rate (--poll-fixed-rate): the binary log wakes the relay"),
            (db.wakeup != WakeupMode::Notify, "wakeup (--wakeup): the binary log wakes the relay"),
        ];
        if let Some((_, what)) = refused.iter().find(|(set, _)| *set) {
            bail!("{what}; remove it, or use --capture poll");
        }
        Ok(())
    }

    /// The replication slot of WAL capture (see [`WalSettings::slot_name`]).
    pub fn slot_name(&self) -> String {
        self.database.slot_name(&self.wal)
    }

    /// How the relay learns of new rows, for its start-up line.
    pub fn wake_description(&self) -> &'static str {
        let db = &self.database;
        let fixed = self.engine.poll_fixed_rate || db.wakeup == WakeupMode::Poll;
        match db.database_kind() {
            _ if db.capture == CaptureMode::Wal => "logical replication stream",
            _ if db.capture == CaptureMode::Binlog => "binary log stream",
            _ if fixed => "fixed-rate polling",
            Ok(DatabaseKind::Sqlite(_)) => "data_version watch + safety poll",
            Ok(DatabaseKind::MySql) => "polling (MySQL has no NOTIFY)",
            _ if db.wakeup == WakeupMode::Gated => "gated notify + safety poll",
            _ => "notify + safety poll",
        }
    }

    /// With `database_url_file`, the URL from that file in place of `database_url`;
    /// `url_given` says a source other than the defaults set `database_url`, which is then
    /// refused: one of the two would be ignored.
    fn read_database_url_file(&mut self, url_given: bool) -> anyhow::Result<()> {
        let Some(path) = &self.database.database_url_file else {
            return Ok(());
        };
        if url_given {
            return Err(anyhow::Error::new(crate::error::ConfigError(
                "both a database URL (DATABASE_URL, OUTBOX_RELAY_DATABASE_URL, --database-url or \
                 database_url) and --database-url-file (OUTBOX_RELAY_DATABASE_URL_FILE, \
                 database_url_file) are set: keep one"
                    .into(),
            )));
        }
        let url = crate::secret_file::read(path, "database URL", "--database-url-file")?;
        self.database.database_url = url.expose().to_string();
        Ok(())
    }

    /// The sinks and routes in effect: `sink` alone, `[sinks]` with `[[routes]]`, or stdout.
    pub fn sink_setup(&self) -> (BTreeMap<String, SinkConfig>, Vec<RouteConfig>) {
        let relay = &self.relay;
        match (&relay.sink, relay.sinks.is_empty()) {
            (Some(uri), _) => (single_sink(uri), Vec::new()),
            (None, true) => (single_sink(DEFAULT_SINK), Vec::new()),
            (None, false) => (relay.sinks.clone(), relay.routes.clone()),
        }
    }

    /// Which store the settings name, and its options.
    pub fn store_settings(&self) -> anyhow::Result<StoreSettings> {
        self.database.store_settings(
            &self.wal,
            self.engine.retry.max_attempts,
            self.relay.node_id.as_deref(),
        )
    }

    /// What `run` hands to the store, the engine, the cluster coordinator, the sinks and the
    /// HTTP server, for the node `node`. With `drain`, the engine
    /// delivers what is deliverable now and returns. The engine's `ownership` is left for
    /// `run` to set, once the store says how many partitions there are.
    pub fn resolve(&self, node: NodeId, drain: bool) -> anyhow::Result<RunParts> {
        let health = Health::new();
        // A capture's stream wakes the engine, and nothing waits out another node's leases.
        let captured = self.database.capture != CaptureMode::Poll;
        let mut engine = EngineConfig::new(node.clone());
        engine.settings = self.engine.clone();
        // Nothing notifies under `--wakeup poll`: listening would only cost a connection.
        // WAL capture's stream wakes the engine whatever else is set.
        let fixed_rate = self.engine.poll_fixed_rate || self.database.wakeup == WakeupMode::Poll;
        engine.wake = if fixed_rate && !captured {
            WakeMode::FixedRate
        } else {
            WakeMode::Notify
        };
        engine.drain = drain;
        // Rows leased by a node that died come back after their lease; its partitions, once
        // its heartbeat expired and the next beat takes them. Under WAL capture nothing
        // waits out another node's leases.
        engine.drain_patience = if captured {
            self.engine.lease
        } else {
            self.engine.lease.max(self.cluster.heartbeat_timeout)
                + self.cluster.heartbeat_interval * 2
        };
        engine.ordered = self.relay.ordering == OrderingMode::Key;
        engine.shared.health = health.clone();
        let cluster = ClusterConfig {
            node,
            settings: self.cluster.clone(),
            health: health.clone(),
        };
        let (sinks, routes) = self.sink_setup();
        let (http_addr, admin_token) = self.http.listen()?;
        Ok(RunParts {
            store: self.store_settings()?,
            engine,
            cluster,
            sinks,
            routes,
            http_addr,
            admin_token,
            allowed_hosts: self.http.allowed_host_names()?,
            health,
        })
    }
}

/// The longest node id on MySQL/MariaDB, whose stores keep it in a `varchar(64)`; the
/// generated default fits it everywhere.
pub const MAX_NODE_ID_CHARS: usize = 64;

/// A node id names the node in the nodes table, its leases and its sessions: an empty one
/// (`--node-id "$POD_NAME"` with the variable unset) would be shared by every such node.
fn check_node_id(node_id: &str, database: &DatabaseKind) -> anyhow::Result<()> {
    if node_id.trim().is_empty() || node_id.chars().any(char::is_control) {
        bail!(
            "node_id {node_id:?} is not a node id: give it printable characters (or leave it \
             unset for the host name and a random suffix)"
        );
    }
    if *database == DatabaseKind::MySql && node_id.chars().count() > MAX_NODE_ID_CHARS {
        bail!(
            "node_id {node_id:?} is longer than the {MAX_NODE_ID_CHARS} characters MySQL/MariaDB \
             keep of it: shorten it (or leave it unset for the host name and a random suffix)"
        );
    }
    Ok(())
}

/// Environment variables as figment reads them, except where its reading would change the
/// value: `0123`, `1e3` or `+7` stay text. figment takes anything that looks like a number
/// for one, and a secret or name written in digits would lose its leading zeros unseen.
struct AsWritten(Env);

impl Provider for AsWritten {
    fn metadata(&self) -> figment::Metadata {
        self.0.metadata()
    }

    fn data(&self) -> Result<figment::value::Map<figment::Profile, Dict>, figment::Error> {
        let mut dict = Dict::new();
        for (key, written) in self.0.iter() {
            let key = with_case_kept(key.as_str());
            let read: Value = written.parse().expect("figment's parse is infallible");
            let kept = match read {
                Value::Num(..) | Value::Bool(..)
                    if serde_json::to_string(&read).ok().as_deref() != Some(written.trim()) =>
                {
                    Value::from(written)
                }
                read => read,
            };
            insert_at(&mut dict, &key, kept);
        }
        Ok(self.0.profile.collect(dict))
    }
}

/// The tables whose keys are names of the user's, not settings: figment reads variable
/// names in lower case, and `OUTBOX_RELAY_RETRY__MAX_ATTEMPTS_BY_TYPE__OrderCreated` set a
/// cap for `ordercreated`, which no event has.
const TABLES_OF_NAMES: [&str; 1] = ["retry.max_attempts_by_type."];

/// `key` (figment's, lower case) with a name under [`TABLES_OF_NAMES`] in the case its
/// variable gives it.
fn with_case_kept(key: &str) -> String {
    let Some(table) = TABLES_OF_NAMES
        .iter()
        .find(|table| key.starts_with(**table))
    else {
        return key.to_string();
    };
    std::env::vars_os()
        .filter_map(|(name, _)| {
            let name = name.into_string().ok()?;
            let written = name.strip_prefix("OUTBOX_RELAY_")?.replace("__", ".");
            written.eq_ignore_ascii_case(key).then_some(written)
        })
        .next()
        .map_or_else(
            || key.to_string(),
            |written| format!("{table}{}", &written[table.len()..]),
        )
}

/// Sets the dotted `path` in `dict`, making the tables on the way. A table set where one
/// is already is merged into it, whichever variable came first (as figment's own does).
fn insert_at(dict: &mut Dict, path: &str, value: Value) {
    match path.split_once('.') {
        None => match (dict.get_mut(path), value) {
            (Some(Value::Dict(_, existing)), Value::Dict(_, given)) => {
                for (key, value) in given {
                    insert_at(existing, &key, value);
                }
            }
            (_, value) => {
                dict.insert(path.to_string(), value);
            }
        },
        Some((table, rest)) => {
            let entry = dict
                .entry(table.to_string())
                .or_insert_with(|| Value::from(Dict::new()));
            if !matches!(entry, Value::Dict(..)) {
                *entry = Value::from(Dict::new());
            }
            if let Value::Dict(_, inner) = entry {
                insert_at(inner, rest, value);
            }
        }
    }
}

/// A key no part declares, as figment reports an unknown field: with the key and where it
/// was set.
fn unknown_setting(figment: &Figment) -> Option<figment::Error> {
    let given = figment.extract::<Dict>().ok()?;
    let key = given
        .keys()
        .find(|key| !top_level_keys().contains(&key.as_str()))?;
    let mut error = figment::Error::from(figment::error::Kind::UnknownField(
        key.clone(),
        top_level_keys(),
    ))
    .with_path(key);
    error.metadata = figment.find_metadata(key).cloned();
    error.profile = Some(figment.profile().clone());
    Some(error)
}

/// Settings that belong to the process, not to one outbox: an `[[outboxes]]` entry that sets
/// one is refused.
/// Every HTTP setting is one (one server for the process), and these.
const PROCESS_SETTINGS: &[&str] = &[
    "log_format",
    "log_level",
    "node_id",
    "outboxes",
    "worker_threads",
];

fn is_process_setting(key: &str) -> bool {
    PROCESS_SETTINGS.contains(&key) || HttpSettings::DOCS.iter().any(|doc| doc.key == key)
}

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
        let config_error = |m: String| anyhow::Error::new(crate::error::ConfigError(m));
        let mut base = self.clone();
        base.relay.outboxes.clear();
        let base = match Value::serialize(&base) {
            Ok(Value::Dict(_, dict)) => dict,
            _ => bail!("cannot read the top-level settings as a table"),
        };
        let mut outboxes: Vec<NamedOutbox> = Vec::new();
        for (i, entry) in self.relay.outboxes.iter().enumerate() {
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
            if let Some(key) = entry.keys().find(|k| is_process_setting(k)) {
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
            let entry_figment = Figment::from(Serialized::defaults(settings)).merge(flags.clone());
            let mut config = Config::extract(&entry_figment).map_err(|e| {
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

/// Outboxes in one process must not share what only one of them can own.
fn refuse_shared_resources(outboxes: &[NamedOutbox]) -> Result<(), String> {
    for (i, a) in outboxes.iter().enumerate() {
        for b in &outboxes[i + 1..] {
            let (server, database) = a.config.database.identity();
            let (other_server, other_database) = b.config.database.identity();
            let pair = format!("[[outboxes]] `{}` and `{}`", a.name, b.name);
            let wal = |c: &Config| c.database.capture == CaptureMode::Wal;
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
            // A server keeps one binary log reader per server id: two would end each
            // other's session every second. Derived ids differ by table; a top-level id is
            // lent to every entry.
            let binlog = |c: &Config| c.database.capture == CaptureMode::Binlog;
            if server == other_server && binlog(&a.config) && binlog(&b.config) {
                if let (Some(id), Some(other_id)) = (
                    a.config.database.binlog_server_id,
                    b.config.database.binlog_server_id,
                ) {
                    if id == other_id {
                        return Err(format!(
                            "{pair} both read the binary log of {} as server id {id}: the \
                             server keeps one reader per id, and each would end the other's \
                             session; give each entry its own binlog_server_id, or set none \
                             (each outbox then derives its own from its database and table)",
                            redact_url(&server)
                        ));
                    }
                }
            }
            if database != other_database {
                continue;
            }
            let (ta, tb) = (
                a.config.database.layout_tables(),
                b.config.database.layout_tables(),
            );
            let shown = redact_url(&database);
            if (&ta.outbox_schema, &ta.outbox_table) == (&tb.outbox_schema, &tb.outbox_table) {
                // MySQL's tables are the URL's database's: it has no schema to name.
                let table = match a.config.database.database_kind() {
                    Ok(DatabaseKind::MySql) => ta.outbox_table.clone(),
                    _ => format!("{}.{}", ta.outbox_schema, ta.outbox_table),
                };
                return Err(format!(
                    "{pair} both relay {table} of {shown}: each table is one outbox; remove \
                     one, or give it its own outbox_table (or outbox_schema)"
                ));
            }
            let sqlite = matches!(
                a.config.database.database_kind(),
                Ok(DatabaseKind::Sqlite(_))
            );
            let both_count_nodes =
                a.config.database.uses_nodes_table() && b.config.database.uses_nodes_table();
            if !sqlite
                && both_count_nodes
                && (&ta.nodes_schema, &ta.nodes_table) == (&tb.nodes_schema, &tb.nodes_table)
            {
                return Err(format!(
                    "{pair} share the nodes table {}.{} of {shown}: the nodes of one would be \
                     counted as members of the other, and given partitions they never relay; \
                     give one its own nodes_table (or nodes_schema)",
                    ta.nodes_schema, ta.nodes_table
                ));
            }
            if wal(&a.config)
                && wal(&b.config)
                && a.config.wal.publication() == b.config.wal.publication()
            {
                return Err(format!(
                    "{pair} both use the publication {} of {shown}: a publication names its \
                     outbox's tables; give one its own publication",
                    a.config.wal.publication()
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
/// The `--config` file's layer. Figment reads nothing but a regular file, so a directory
/// (a ConfigMap mounted whole) or a pipe (`--config <(envsubst < t.toml)`) ran on the
/// defaults without a word: a directory is refused, a pipe read here.
fn config_file(path: &Path) -> anyhow::Result<figment::providers::Data<Toml>> {
    let shown = path.display();
    let metadata = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => anyhow::anyhow!(
            "config file {shown} does not exist (check --config or OUTBOX_RELAY_CONFIG)"
        ),
        _ => anyhow::anyhow!("config file {shown}: {e} (check --config or OUTBOX_RELAY_CONFIG)"),
    })?;
    if metadata.is_dir() {
        bail!(
            "config file {shown} is a directory: point --config (or OUTBOX_RELAY_CONFIG) at the \
             TOML file in it"
        );
    }
    if metadata.is_file() {
        return Ok(Toml::file(path));
    }
    let text = std::fs::read_to_string(path).map_err(|e| {
        anyhow::anyhow!("config file {shown}: {e} (check --config or OUTBOX_RELAY_CONFIG)")
    })?;
    Ok(Toml::string(&text))
}

/// The settings the file at `path` sets to a secret (a [`Secret`], or a URL with a
/// password), by name: where the settings it alone makes differ from their redacted form.
fn secrets_set_by(path: &Path) -> Vec<String> {
    fn differing(
        plain: &serde_json::Value,
        shown: &serde_json::Value,
        at: String,
        out: &mut Vec<String>,
    ) {
        use serde_json::Value;
        match (plain, shown) {
            (Value::Object(plain), Value::Object(shown)) => {
                for (key, value) in plain {
                    let name = if at.is_empty() {
                        key.clone()
                    } else {
                        format!("{at}.{key}")
                    };
                    match shown.get(key) {
                        Some(other) => differing(value, other, name, out),
                        None => out.push(name),
                    }
                }
            }
            (Value::Array(plain), Value::Array(shown)) if plain.len() == shown.len() => {
                for (i, (value, other)) in plain.iter().zip(shown).enumerate() {
                    differing(value, other, format!("{at}[{i}]"), out);
                }
            }
            _ if plain != shown => out.push(at),
            _ => {}
        }
    }
    let Ok(file_alone) = config_file(path).and_then(|file| {
        let figment = Figment::from(Serialized::defaults(Config::default())).merge(file);
        Config::extract(&figment).map_err(anyhow::Error::from)
    }) else {
        return Vec::new();
    };
    let plain = serde_json::to_value(&file_alone).unwrap_or_default();
    let shown = crate::admin::redacted_settings(&file_alone);
    let mut names = Vec::new();
    differing(&plain, &shown, String::new(), &mut names);
    names
}

/// A parse error's message without the excerpt of the source the TOML parser quotes: the
/// line it shows may hold a secret (a database URL with its password).
fn without_source_excerpt(message: &str) -> String {
    message
        .lines()
        .filter(|line| {
            let rest = line
                .trim_start()
                .trim_start_matches(|c: char| c.is_ascii_digit());
            !rest.trim_start().starts_with('|')
        })
        .collect::<Vec<_>>()
        .join(" ")
}

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
            let mut what = match &e.kind {
                figment::error::Kind::Message(message) => without_source_excerpt(message),
                // The value may be a URL with its password (`OUTBOX_RELAY_SINKS__MAIN=
                // nats://u:p@…` where a map is expected), or a token: the type tells enough.
                figment::error::Kind::InvalidType(figment::error::Actual::Str(_), expected) => {
                    format!("invalid type: found a string, expected {expected}")
                }
                kind => kind.to_string(),
            }
            .replace("unknown field", "unknown setting");
            // Whatever else a message quotes is shown redacted.
            what = outbox_core::redact::redact_url(&what);
            if let figment::error::Kind::InvalidType(figment::error::Actual::Str(text), _) = &e.kind
            {
                if text.trim().parse::<f64>().is_ok() {
                    // `AsWritten` keeps `0200` or `+7` as text rather than change it.
                    what.push_str(" (write the number as plain digits: no leading zero or sign)");
                }
            }
            let key = e.path.join(".");
            // A parse error names no setting: the file it is in, at least (it named neither).
            let file = e.metadata.as_ref().and_then(|md| match &md.source {
                Some(figment::Source::File(path)) => Some(path.display().to_string()),
                _ => None,
            });
            if key.is_empty() {
                match file {
                    Some(file) => format!("config file {file}: {what}"),
                    None => what,
                }
            } else {
                format!("{}: {what}", origin(&e, &key))
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn single_sink(uri: &str) -> BTreeMap<String, SinkConfig> {
    BTreeMap::from([("default".to_string(), SinkConfig::new(uri))])
}

/// Whether an `OUTBOX_RELAY_*` variable (`key`, the rest of its name in lower case) is one
/// that Kubernetes sets in every pod for a Service named `outbox-relay` or `outbox-relay-*`
/// (`OUTBOX_RELAY_SERVICE_HOST`, `OUTBOX_RELAY_PORT=tcp://…`, `…_PORT_2259_TCP_ADDR`): taken
/// for unknown settings, they stopped every pod of the manifests' own Service with exit 2.
/// No setting's name holds `service_host`, `service_port` or ends in `port`; a name ending
/// in `port` alone is a link only with a link's value (`tcp://…`): `OUTBOX_RELAY_HTTP_PORT=9090`,
/// someone's guess at a setting, was dropped without a word.
fn kubernetes_service_link(key: &str, value: &str) -> bool {
    let parts: Vec<&str> = key.split('_').collect();
    let is_proto = |p: &str| matches!(p, "tcp" | "udp" | "sctp");
    match parts.as_slice() {
        [.., "service", "host"] | [.., "service", "port"] => true,
        // OUTBOX_RELAY_PORT_2259_TCP, …_TCP_PROTO, …_TCP_ADDR, …_TCP_PORT
        [.., "port", number, proto] if number.parse::<u16>().is_ok() && is_proto(proto) => true,
        [.., "port", number, proto, "proto" | "addr" | "port"]
            if number.parse::<u16>().is_ok() && is_proto(proto) =>
        {
            true
        }
        // OUTBOX_RELAY_PORT=tcp://10.96.0.12:2259
        [.., "port"] => ["tcp://", "udp://", "sctp://"]
            .iter()
            .any(|scheme| value.starts_with(scheme)),
        // OUTBOX_RELAY_SERVICE_PORT_<port name>
        _ => parts
            .windows(3)
            .any(|w| w[0] == "service" && w[1] == "port" && !w[2].is_empty()),
    }
}

#[cfg(test)]
#[allow(clippy::result_large_err)] // figment::Jail's closure signature
mod tests {

    /// Kubernetes sets these in every pod for a Service named `outbox-relay`.
    #[test]
    fn kubernetes_service_links_are_no_settings() {
        for (key, value) in [
            ("service_host", "10.96.0.12"),
            ("service_port", "2259"),
            ("service_port_http", "2259"),
            ("port", "tcp://10.96.0.12:2259"),
            ("admin_port", "udp://10.96.0.13:9090"),
            ("port_2259_tcp", "tcp://10.96.0.12:2259"),
            ("port_2259_tcp_proto", "tcp"),
            ("port_2259_tcp_port", "2259"),
            ("port_2259_tcp_addr", "10.96.0.12"),
            ("admin_service_host", "10.96.0.13"),
            ("admin_port_9090_udp_addr", "10.96.0.13"),
        ] {
            assert!(kubernetes_service_link(key, value), "{key}");
        }
        for (key, value) in [
            ("database_url", "postgres://db/app"),
            ("http_addr", "127.0.0.1:9090"),
            ("sink", "stdout"),
            ("partitions", "64"),
            ("poll_interval", "1s"),
            // A guess at a setting, not a link: refused as unknown, not dropped.
            ("http_port", "9090"),
            ("port", "9090"),
        ] {
            assert!(!kubernetes_service_link(key, value), "{key}");
        }
    }
    use super::*;
    use outbox_core::RetryPolicy;
    use std::time::Duration;

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
        let config = {
            let mut c = Config::default();
            c.database.database_url = "postgres://u:topsecret@h/db".into();
            c
        };
        assert!(!format!("{config:?}").contains("topsecret"));
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
            assert_eq!(c.relay.sink.as_deref(), Some("file:/tmp/from-file.jsonl"));
            assert_eq!(c.engine.batch_size, 300);
            assert_eq!(c.engine.poll_interval, Duration::from_millis(250));
            assert_eq!(c.database.database_url, "postgres://from-env/db");
            assert_eq!(c.engine.retry.max_attempts, 7);
            assert_eq!(c.engine.retry.max_attempts_by_type["order.created"], 2);
            Ok(())
        });
    }

    /// A per-type cap set through the environment keeps its type's case: figment reads
    /// variable names in lower case, and the cap applied to no event.
    #[test]
    fn a_per_type_cap_from_the_environment_keeps_the_types_case() {
        figment::Jail::expect_with(|jail| {
            jail.set_env(
                "OUTBOX_RELAY_RETRY__MAX_ATTEMPTS_BY_TYPE__OrderCreated",
                "3",
            );
            let c =
                Config::load(None, flags(&["outbox-relay", "run"])).map_err(|e| e.to_string())?;
            assert_eq!(
                c.engine.retry.max_attempts_by_type,
                std::collections::HashMap::from([("OrderCreated".to_string(), 3)])
            );
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
            assert_eq!(c.http.allowed_host_names().unwrap(), ["relay.internal"]);
            jail.set_env("OUTBOX_RELAY_ALLOWED_HOSTS", "a.example, b.example");
            let c = load(&["outbox-relay", "run"])?;
            assert_eq!(c.http.allowed_hosts, ["a.example", "b.example"]);
            let c = load(&[
                "outbox-relay",
                "run",
                "--allowed-hosts",
                "c.example,d.example",
            ])?;
            assert_eq!(c.http.allowed_hosts, ["c.example", "d.example"]);
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
        let err = refused({
            let mut c = Config::default();
            c.engine.publish_timeout = Duration::from_nanos(1);
            c
        });
        assert!(
            err.contains("publish_timeout must be at least 100ms"),
            "{err}"
        );
        let err = refused({
            let mut c = Config::default();
            c.engine.publish_timeout = Duration::from_secs(45);
            c
        });
        assert!(err.contains("shorter than lease"), "{err}");
        let err = refused({
            let mut c = Config::default();
            c.cluster.heartbeat_interval = Duration::from_secs(4);
            c
        });
        assert!(err.contains("at least 3 x heartbeat_interval"), "{err}");
        let err = refused({
            let mut c = Config::default();
            c.relay.worker_threads = 0;
            c
        });
        assert!(
            err.contains("worker_threads must be between 1 and 1024 (got 0)"),
            "{err}"
        );
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
        let err = refused({
            let mut c = Config::default();
            c.database.wakeup = WakeupMode::Gated;
            c
        });
        assert!(
            err.contains("--wakeup gated") && err.contains("SQLite"),
            "{err}"
        );
        let err = refused({
            let mut c = Config::default();
            c.database.database_url = "mysql://relay@db/app".into();
            c.database.wakeup = WakeupMode::Gated;
            c
        });
        assert!(err.contains("MySQL/MariaDB"), "{err}");
        for url in ["sqlite:outbox.db", "mysql://relay@db/app"] {
            // PostgreSQL's default channel too: a name given is no default.
            for channel in ["events", outbox_store_postgres::DEFAULT_NOTIFY_CHANNEL] {
                let err = refused({
                    let mut c = Config::default();
                    c.database.database_url = url.into();
                    c.database.notify_channel = channel.into();
                    c
                });
                assert!(err.contains("notify_channel has no effect"), "{url}: {err}");
            }
        }
        let err = refused({
            let mut c = Config::default();
            c.database.database_url = pg.clone();
            c.engine.poll_fixed_rate = true;
            c.database.wakeup = WakeupMode::Gated;
            c
        });
        assert!(err.contains("poll_fixed_rate"), "{err}");
        let route = outbox_publishers::RouteConfig {
            destinations: "*".into(),
            sink: "main".into(),
            target: None,
            cloudevents: None,
            cloudevents_source: None,
        };
        let err = refused({
            let mut c = Config::default();
            c.relay.sink = Some("stdout".into());
            c.relay.sinks = [("main".to_string(), single_sink("stdout")["default"].clone())].into();
            c.relay.routes = vec![route];
            c
        });
        assert!(err.contains("--sink") && err.contains("not both"), "{err}");
        let err = refused({
            let mut c = Config::default();
            c.database.layout = outbox_layout::LayoutKind::OpenOutbox;
            c
        });
        assert!(
            err.contains("SQLite supports the native layout only"),
            "{err}"
        );
        let err = refused({
            let mut c = Config::default();
            c.database.database_url = pg.clone();
            c.database.mapping = Some(outbox_layout::Mapping::open_outbox("public", "events"));
            c
        });
        assert!(err.contains("[mapping] section has no effect"), "{err}");
        // What does apply passes: notify_channel and gated on PostgreSQL, on any layout.
        {
            let mut c = Config::default();
            c.database.database_url = pg.clone();
            c.database.layout = outbox_layout::LayoutKind::OpenOutbox;
            c.database.notify_channel = "events".into();
            c.database.wakeup = WakeupMode::Gated;
            c
        }
        .validate()
        .expect("notify_channel and gated apply to every PostgreSQL layout");
        {
            let mut c = Config::default();
            c.database.wakeup = WakeupMode::Poll;
            c
        }
        .validate()
        .expect("poll applies to SQLite: no data_version watch");
    }

    #[test]
    fn bad_names_are_configuration_errors() {
        let err = {
            let mut c = Config::default();
            c.database.database_url = "postgres://relay@db/app".into();
            c.database.nodes_table = "nodes; drop".into();
            c
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(err.contains("invalid table name \"nodes; drop\""), "{err}");
    }

    #[test]
    fn the_start_up_line_says_how_each_store_wakes() {
        let with = |url: &str, wakeup: WakeupMode| {
            let mut c = Config::default();
            c.database.database_url = url.into();
            c.database.wakeup = wakeup;
            c
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
            assert!(c.database.auto_migrate);
            assert_eq!(c.engine.retry.max_attempts, 7);
            assert_eq!(c.engine.retry.max_delay, Duration::from_secs(60));
            assert_eq!(c.engine.retry.base_delay, RetryPolicy::default().base_delay);
            Ok(())
        });
    }

    #[test]
    fn resolve_hands_each_part_its_settings() {
        let config = {
            let mut c = Config::default();
            c.engine.batch_size = 10;
            c.engine.lease = Duration::from_secs(40);
            c.engine.poll_fixed_rate = true;
            c.relay.ordering = OrderingMode::None;
            c.http.http_addr = String::new();
            c.relay.sink = Some("file:out.jsonl".into());
            c
        };
        let parts = config.resolve(NodeId("n1".into()), true).unwrap();
        assert_eq!(parts.engine.settings.batch_size, 10);
        assert_eq!(parts.engine.wake, WakeMode::FixedRate);
        assert!(parts.engine.drain && !parts.engine.ordered);
        assert_eq!(parts.engine.drain_patience, Duration::from_secs(44));
        assert_eq!(parts.cluster.node.0, "n1");
        assert_eq!(parts.cluster.settings, config.cluster);
        assert!(Arc::ptr_eq(
            &parts.engine.shared.health,
            &parts.cluster.health
        ));
        assert_eq!(parts.sinks["default"].uri(), "file:out.jsonl");
        assert!(parts.routes.is_empty() && parts.http_addr.is_none());
    }

    /// `check` prints the configuration: the tables it names are the layout's own.
    #[test]
    fn the_shown_configuration_names_the_layouts_tables() {
        let config = {
            let mut c = Config::default();
            c.database.database_url = "postgres://relay:secret@db/app".into();
            c.database.layout = LayoutKind::Debezium;
            c
        };
        let shown = format!("{config:?}");
        assert!(shown.contains(r#"outbox: "public.outboxevent""#), "{shown}");
        assert!(shown.contains(r#"layout: "debezium""#), "{shown}");
        assert!(!shown.contains("secret"), "{shown}");
    }

    #[test]
    fn wal_capture_settings_that_cannot_apply_are_refused() {
        // A PostgreSQL configuration with `set` applied to it.
        let on_pg = |set: fn(&mut Config)| {
            let mut c = Config::default();
            c.database.database_url = "postgres://relay@db/app".into();
            set(&mut c);
            c
        };
        let wal = |c: Config| {
            let mut c = c;
            c.database.capture = CaptureMode::Wal;
            c
        };
        let refused = |c: Config| c.validate().unwrap_err().to_string();
        let err = refused(wal(Config::default()));
        assert!(err.contains("postgres://"), "{err}");
        for (config, named) in [
            (on_pg(|c| c.database.layout = LayoutKind::Adbc), "layout"),
            (
                on_pg(|c| c.database.retain_delivered = true),
                "retain_delivered",
            ),
            (on_pg(|c| c.relay.ordering = OrderingMode::None), "ordering"),
            (on_pg(|c| c.database.wakeup = WakeupMode::Gated), "wakeup"),
            (on_pg(|c| c.wal.slot = "Bad-Name".into()), "slot"),
        ] {
            let err = refused(wal(config));
            assert!(err.contains(named), "{named}: {err}");
        }
        // Debezium's table is captured, with native tables of the relay's own beside it.
        let debezium = wal(on_pg(|c| c.database.layout = LayoutKind::Debezium));
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
        assert_eq!(source.source.name.name.as_str(), "outboxevent");
        assert_eq!(source.source.columns.sequence_id, "relay_sequence");
        // A slot without WAL capture would be silently ignored.
        let err = refused(on_pg(|c| c.wal.slot = "mine".into()));
        assert!(err.contains("--capture wal"), "{err}");
        // Resolved: the native store with its slot, and writers that notify nobody.
        let config = wal(on_pg(|c| c.wal.slot = "mine".into()));
        config.validate().unwrap();
        let parts = config.resolve(NodeId("n1".into()), false).unwrap();
        let crate::store::StoreSettings::Postgres(settings) = parts.store else {
            panic!("not PostgreSQL");
        };
        assert_eq!(settings.capture.as_ref().unwrap().slot, "mine");
        assert!(settings.options.tables.poll_wakeup && settings.mapped.is_none());
        assert_eq!(parts.engine.wake, WakeMode::Notify);
    }

    /// `[[outboxes]]` from a file and flags: each outbox's settings in effect, or the error.
    fn outboxes_of(toml: &str, args: &[&str]) -> Result<Vec<NamedOutbox>, String> {
        outboxes_with(&[("relay.toml", toml)], args)
    }

    /// The same, with `relay.toml` and the other `files` it names beside it.
    fn outboxes_with(files: &[(&str, &str)], args: &[&str]) -> Result<Vec<NamedOutbox>, String> {
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
        assert_eq!(
            orders.config.database.database_url,
            "postgres://relay@db/orders"
        );
        assert_eq!(orders.config.engine.batch_size, 100, "from the top level");
        assert_eq!(
            orders.config.engine.lease,
            Duration::from_secs(45),
            "from a flag"
        );
        assert_eq!(orders.config.relay.sink.as_deref(), Some("stdout"));
        assert_eq!(orders.config.engine.retry.max_attempts, 7);
        // An entry's table replaces the top-level one whole; its sinks replace `sink`.
        assert_eq!(billing.config.engine.retry.max_attempts, 2);
        assert_eq!(
            billing.config.engine.retry.base_delay,
            RetryPolicy::default().base_delay
        );
        assert_eq!(billing.config.relay.sink, None);
        assert_eq!(
            billing.config.relay.sinks.keys().collect::<Vec<_>>(),
            ["main"]
        );
        assert_eq!(billing.config.relay.routes.len(), 1);
        assert!(billing.config.relay.outboxes.is_empty());
        // A flag wins over an entry, as over the file.
        let flagged = outboxes_of(
            "[[outboxes]]\nname = \"a\"\nbatch_size = 5\n",
            &["outbox-relay", "run", "--batch-size", "9"],
        )
        .unwrap();
        assert_eq!(flagged[0].config.engine.batch_size, 9);
        // The top level only lends settings: what would not apply to it alone (a
        // PostgreSQL-only setting over the default SQLite URL) is judged in each outbox.
        let lent = outboxes_of(
            "wakeup = \"gated\"\n[[outboxes]]\nname = \"a\"\n\
             database_url = \"postgres://relay@db/app\"\n",
            &["outbox-relay", "run"],
        )
        .unwrap();
        assert_eq!(lent[0].config.database.wakeup, WakeupMode::Gated);
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
        // One MySQL server, its host spelled two ways, one outbox polling and one reading
        // the binary log: both ran, each relaying every event. MySQL's table has no schema.
        let err = refused(&two(
            "database_url = \"mysql://root@127.0.0.1:3306/app1\"\ncapture = \"binlog\"",
            "database_url = \"mysql://root@localhost:3306/app1\"",
        ));
        assert!(
            err.contains("both relay outbox of mysql://localhost:3306/app1"),
            "{err}"
        );
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
        // Layouts that keep no nodes table share none: they were refused, told to set a
        // nodes_table they then ignored.
        outboxes_of(
            &two(
                &format!("{pg}\nlayout = \"open-outbox\""),
                &format!("{pg}\nlayout = \"open-outbox\"\noutbox_table = \"billing\""),
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
        // A top-level binlog_server_id is lent to every entry: two binlog outboxes of one
        // server would read as one replica, ending each other's session every second.
        let my = |db: &str| format!("database_url = \"mysql://relay:secret@db/{db}\"");
        let err = outboxes_of(
            &format!(
                "capture = \"binlog\"\nbinlog_server_id = 4242\n{}",
                two(&my("one"), &my("two"))
            ),
            &["outbox-relay", "run"],
        )
        .unwrap_err();
        assert!(
            err.contains("both read the binary log of mysql://db") && err.contains("4242"),
            "{err}"
        );
        assert!(!err.contains("secret"), "{err}");
        outboxes_of(
            &format!("capture = \"binlog\"\n{}", two(&my("one"), &my("two"))),
            &["outbox-relay", "run"],
        )
        .unwrap();
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
        let err = refused(&two(
            pg,
            "database_url = \"sqlite:b.db\"\nworker_threads = 4",
        ));
        assert!(
            err.contains("`b` sets `worker_threads`, which belongs to the whole process"),
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
                let config = e.downcast_ref::<crate::error::ConfigError>().is_some();
                (format!("{e:#}"), config)
            });
            Ok(())
        });
        result
    }

    /// figment reads `0123` as the number 123, and a secret takes a number as its text: a
    /// token of digits lost its leading zero, `1e3` became `1000`, with nothing said.
    #[test]
    fn an_environment_value_is_read_as_written_where_a_number_would_change_it() {
        let toml = "[sinks.bus]\nuri = \"nats://127.0.0.1:4222\"\n[[routes]]\ndestinations = \"*\"\nsink = \"bus\"\n";
        let token = |value: &str| {
            let config = load_with_files(
                &[("relay.toml", toml)],
                &[
                    ("OUTBOX_RELAY_SINKS__BUS__TOKEN", value),
                    ("OUTBOX_RELAY_SINKS__BUS__MAX_MESSAGE_BYTES", "1000"),
                    ("OUTBOX_RELAY_BATCH_SIZE", "200"),
                ],
                &["outbox-relay", "check"],
            )
            .unwrap_or_else(|(e, _)| panic!("{value}: {e}"));
            let bus = &config.relay.sinks["bus"];
            assert_eq!(bus.max_message_bytes(), Some(1000));
            assert_eq!(config.engine.batch_size, 200);
            let outbox_publishers::SinkSettings::Nats(nats) = bus.settings() else {
                panic!("{:?}", bus.settings())
            };
            nats.token.as_ref().unwrap().expose().to_string()
        };
        for written in ["0123", "1e3", "1.50", "-0", "+7", "123", "true", "x9"] {
            assert_eq!(token(written), written);
        }
        // A table given whole and a key of it given alone are merged, in either order.
        let retry = ("OUTBOX_RELAY_RETRY", "{base_delay=\"2s\"}");
        let attempts = ("OUTBOX_RELAY_RETRY__MAX_ATTEMPTS", "5");
        for env in [[retry, attempts], [attempts, retry]] {
            let config = load_with_files(&[], &env, &["outbox-relay", "check"])
                .unwrap_or_else(|(e, _)| panic!("{e}"));
            assert_eq!(config.engine.retry.max_attempts, 5, "{env:?}");
            assert_eq!(
                config.engine.retry.base_delay,
                Duration::from_secs(2),
                "{env:?}"
            );
        }
        let (err, _) = load_with_files(
            &[],
            &[("OUTBOX_RELAY_BATCH_SIZE", "0200")],
            &["outbox-relay", "check"],
        )
        .unwrap_err();
        assert!(
            err.contains("OUTBOX_RELAY_BATCH_SIZE") && err.contains("no leading zero"),
            "{err}"
        );
    }

    /// The README's example names the tables by their defaults; on SQLite, `outbox_table =
    /// "outbox"` was accepted and `nodes_table = "outbox_nodes"` refused, saying the store
    /// uses `outbox_nodes`.
    #[test]
    fn sqlite_accepts_the_tables_named_as_it_names_them() {
        let toml = "database_url = \"sqlite:outbox.db\"\noutbox_table = \"outbox\"\nnodes_table = \"outbox_nodes\"\n";
        load_with_files(&[("relay.toml", toml)], &[], &["outbox-relay", "check"])
            .unwrap_or_else(|(e, _)| panic!("{e}"));
        let other = "database_url = \"sqlite:outbox.db\"\nnodes_table = \"relay_nodes\"\n";
        let (err, _) =
            load_with_files(&[("relay.toml", other)], &[], &["outbox-relay", "check"]).unwrap_err();
        assert!(err.contains("nodes_table") && !err.contains("   "), "{err}");
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
            by_flag.database.database_url, URL_WITH_PASSWORD,
            "the newline trimmed"
        );
        assert_eq!(
            by_flag.database.database_kind().unwrap(),
            DatabaseKind::Postgres
        );
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
        assert_eq!(by_env.database.database_url, URL_WITH_PASSWORD);
        let by_setting = load_with_files(
            &[file, ("relay.toml", "database_url_file = \"db-url\"\n")],
            &[],
            &["outbox-relay", "stats"],
        )
        .unwrap();
        assert_eq!(by_setting.database.database_url, URL_WITH_PASSWORD);
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
        let outboxes = outboxes_with(&files, &["outbox-relay", "check"]).unwrap();
        let urls: Vec<&str> = outboxes
            .iter()
            .map(|o| o.config.database.database_url.as_str())
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
            {
                let mut c = Config::default();
                c.database.database_url = url.into();
                c.database.outbox_table = table.unwrap_or("outbox").into();
                c.wal.slot = slot.into();
                c
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
