//! Command-line interface.
//!
//! A flag that sets a setting is a field named after the setting's key (its clap id is the
//! key, `retry.max_attempts` for `--max-attempts`), so that the flags serialize straight into
//! the configuration's highest layer ([`Cli::flags`]) and their help shows the setting's
//! default from `Config::default()` ([`command`]). Fields that are no setting (`--config`,
//! `--drain`, `--print`) are `#[serde(skip)]`.

use std::path::PathBuf;

use clap::{Args, CommandFactory, Parser, Subcommand};
use figment::providers::Serialized;
use figment::value::{Dict, Value};
use figment::{Figment, Metadata, Profile, Provider};
use serde::Serialize;

use crate::config::{CaptureMode, Config, LogFormat, OrderingMode, WakeupMode};

/// Publishes transactional-outbox rows to brokers: at least once, in order per key,
/// de-duplicable by event id.
///
/// With no configuration it relays ./outbox.db (SQLite) to stdout. Point it at PostgreSQL
/// with --database-url (or DATABASE_URL). Settings come from defaults, then a TOML file
/// (--config, or ./outbox-relay.toml), then OUTBOX_RELAY_* environment variables, then flags.
#[derive(Parser, Debug)]
#[command(name = "outbox-relay", version = crate::VERSION, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Args, Clone, Debug, Serialize)]
pub struct GlobalArgs {
    /// TOML configuration file [default: ./outbox-relay.toml when present]. Also
    /// OUTBOX_RELAY_CONFIG.
    #[arg(long, global = true, value_name = "FILE", env = "OUTBOX_RELAY_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// With [[outboxes]] in the config file: the outbox to act on. Without it, run, migrate,
    /// check and stats act on every outbox; the other commands need it.
    #[arg(long, global = true, value_name = "NAME")]
    #[serde(skip)]
    pub outbox: Option<String>,
    /// Database URL: postgres://user:pass@host:port/db[?sslmode=require],
    /// mysql://user:pass@host:port/db[?require_ssl=true] (MySQL 8, MariaDB >= 10.6) or
    /// sqlite:PATH. Also OUTBOX_RELAY_DATABASE_URL or DATABASE_URL.
    #[arg(long, global = true, value_name = "URL")]
    pub database_url: Option<String>,
    /// A file whose first line is the database URL, read once at start instead of
    /// --database-url: a systemd credential or a mounted Kubernetes Secret, so that the
    /// password is in no environment. Also OUTBOX_RELAY_DATABASE_URL_FILE.
    #[arg(long, global = true, value_name = "FILE")]
    pub database_url_file: Option<PathBuf>,
    /// Extra CA certificates (PEM) for database TLS (verify-ca, verify-full; with them,
    /// sslmode=require verifies the server too).
    #[arg(long, global = true, value_name = "FILE")]
    pub database_ca_file: Option<PathBuf>,
    /// The outbox table's layout: native (the relay's own tables), adbc (Ably Database
    /// Connector), open-outbox (Open Outbox Relay), export (event + event_type),
    /// mysql-outbox-events (the MySQL 8 seed), debezium (Debezium's outboxevent table), or
    /// custom (a [mapping] in the config file).
    /// Each seed layout defaults to its own table name.
    #[arg(long, global = true, value_name = "LAYOUT")]
    pub layout: Option<String>,
    /// How writers wake the relay on PostgreSQL: notify (every inserting statement NOTIFYs),
    /// gated (only while the relay waits for rows; cheaper for writers under load) or poll
    /// (never: the relay polls every --poll-interval; for applications that use two-phase
    /// commit, since a transaction that sent a NOTIFY cannot PREPARE TRANSACTION).
    /// `migrate` installs the matching trigger function.
    #[arg(long, global = true, value_enum, value_name = "MODE")]
    pub wakeup: Option<WakeupMode>,
    /// How the relay reads events on PostgreSQL: poll (claims rows from the outbox table) or
    /// wal (reads committed INSERTs and outbox_emit() messages from a logical replication
    /// slot, in commit order, at no cost to writers; needs wal_level = logical, a role with
    /// REPLICATION, and `migrate --capture wal`).
    #[arg(long, global = true, value_enum, value_name = "MODE")]
    pub capture: Option<CaptureMode>,
    /// The logical replication slot of --capture wal, created on first run. One active relay
    /// streams from it; others wait as standbys. Default: outbox_relay_<database>, with
    /// _<schema> and _<table> when they are not public and outbox (a slot made by an earlier
    /// version under the old default, outbox_relay, is kept).
    #[arg(long, global = true, value_name = "NAME")]
    pub slot: Option<String>,
    /// The publication of --capture wal (created by `migrate --capture wal`).
    #[arg(long, global = true, value_name = "NAME")]
    pub publication: Option<String>,
    /// Schema of the outbox table.
    #[arg(long, global = true, value_name = "NAME")]
    pub outbox_schema: Option<String>,
    /// Name of the outbox table; dead letters go to <name>_dead_letters.
    #[arg(long, global = true, value_name = "NAME")]
    pub outbox_table: Option<String>,
    /// Schema of the nodes table.
    #[arg(long, global = true, value_name = "NAME")]
    pub nodes_schema: Option<String>,
    /// Name of the nodes table.
    #[arg(long, global = true, value_name = "NAME")]
    pub nodes_table: Option<String>,
    /// Log format.
    #[arg(long, global = true, value_enum, value_name = "FORMAT")]
    pub log_format: Option<LogFormat>,
    /// Log level or filter, e.g. info, debug, outbox_engine=debug.
    #[arg(long, global = true, value_name = "FILTER")]
    pub log_level: Option<String>,
}

#[derive(Subcommand, Clone, Debug)]
pub enum Command {
    /// Relay events from the outbox to the sink until SIGTERM/SIGINT (or, with --drain, until
    /// nothing deliverable is left).
    Run(RunArgs),
    /// Create the outbox, dead-letter and nodes tables, indexes and NOTIFY trigger
    /// (idempotent), or print their DDL and grants.
    Migrate(MigrateArgs),
    /// Validate the configuration, connect, and verify tables, trigger, privileges and sink.
    Check(CheckArgs),
    /// Insert one event into the outbox, as an application would.
    Send(SendArgs),
    /// Drop the logical replication slot of --capture wal (waits for an active relay to
    /// let go of it). The server then frees the WAL it kept; events not yet relayed from it
    /// are not relayed.
    DropSlot,
    /// Show the backlog per destination, the live nodes and which partitions each owns.
    Stats(StatsArgs),
    /// Ask the running relay's HTTP server (http_addr) whether it is up (/healthz) or ready
    /// (/readyz): exit 0 if so, 1 if not. For container health checks, where no curl is.
    Health(HealthArgs),
    /// Inspect, resend or delete dead-lettered events.
    #[command(subcommand)]
    Dead(DeadCommand),
    /// Publish retained delivered events again (needs --retain-delivered), for consumers
    /// that lost data.
    Replay(ReplayArgs),
    /// Delete old delivered (retained) rows and dead letters, in small batches.
    Prune(PruneArgs),
}

#[derive(Subcommand, Clone, Debug)]
pub enum DeadCommand {
    /// List dead letters: id, destination, type, attempts and last error.
    List {
        /// Only this destination.
        #[arg(long, value_name = "D")]
        destination: Option<String>,
        /// Only this event type.
        #[arg(long = "type", value_name = "T")]
        event_type: Option<String>,
        /// Only those after this sequence id (the last one of the previous page).
        #[arg(long, default_value_t = 0, value_name = "ID")]
        after: i64,
        /// At most this many [default: 50].
        #[arg(long, default_value_t = 50, value_name = "N")]
        limit: u32,
        /// Print JSON lines.
        #[arg(long)]
        json: bool,
    },
    /// Move dead letters back into the outbox, attempts reset, to be published again.
    Retry(DeadSelectArgs),
    /// Delete dead letters.
    Purge(DeadSelectArgs),
}

#[derive(Args, Clone, Debug)]
#[group(required = true, multiple = false)]
pub struct DeadSelectArgs {
    /// These sequence ids (repeatable).
    #[arg(long = "id", value_name = "ID")]
    pub ids: Vec<i64>,
    /// Every dead letter of this destination.
    #[arg(long, value_name = "D")]
    pub destination: Option<String>,
    /// Every dead letter.
    #[arg(long)]
    pub all: bool,
}

#[derive(Args, Clone, Debug)]
pub struct ReplayArgs {
    /// Events created at or after this time (RFC 3339, e.g. 2026-11-20T10:00:00Z) or this
    /// long ago (e.g. 2h).
    #[arg(long, value_name = "TIME")]
    pub since: String,
    /// Events created before this time [default: now].
    #[arg(long, value_name = "TIME")]
    pub until: Option<String>,
    /// Only this destination.
    #[arg(long, value_name = "D")]
    pub destination: Option<String>,
}

#[derive(Args, Clone, Debug)]
pub struct PruneArgs {
    /// Delete delivered (retained) rows delivered longer ago than this, e.g. 7d.
    #[arg(long, value_name = "AGE")]
    pub delivered_older_than: Option<String>,
    /// Delete dead letters dead longer ago than this, e.g. 30d.
    #[arg(long, value_name = "AGE")]
    pub dead_older_than: Option<String>,
    /// Only count what would be deleted.
    #[arg(long)]
    pub dry_run: bool,
    /// Rows per delete statement [default: 1000].
    #[arg(long, default_value_t = 1000, value_name = "N")]
    pub batch_size: u32,
}

#[derive(Args, Clone, Debug, Serialize)]
pub struct HealthArgs {
    /// Ask /readyz (database, sinks and the node's own work) instead of /healthz.
    #[arg(long)]
    #[serde(skip)]
    pub ready: bool,
    /// The relay's HTTP address (a wildcard address is asked on loopback).
    #[arg(long, value_name = "HOST:PORT")]
    pub http_addr: Option<String>,
}

#[derive(Args, Clone, Debug)]
pub struct StatsArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Clone, Debug, Serialize)]
pub struct RunArgs {
    /// Where every event goes: stdout, file:PATH, nats://, kafka://, amqp://, redis://,
    /// http(s)://URL-template, ably:, sqs:, sns:, kinesis: or eventbridge: [default: the
    /// config's [sinks]/[[routes]], else stdout].
    #[arg(long, value_name = "URI")]
    pub sink: Option<String>,
    /// Create missing tables and trigger at start (needs CREATE privileges).
    #[arg(long)]
    pub auto_migrate: bool,
    /// Deliver everything deliverable now, then exit (for cron jobs and tests): 0 when
    /// nothing is left pending and nothing was dead-lettered, 1 when events are left
    /// undelivered (retrying, dead-lettered, or still pending after waiting out other nodes'
    /// leases), with how many and why.
    #[arg(long)]
    #[serde(skip)]
    pub drain: bool,
    /// Keep delivered rows, marked with delivered_at, instead of deleting them.
    #[arg(long)]
    pub retain_delivered: bool,
    /// Safety-poll period while LISTENing, or the polling period with --poll-fixed-rate.
    #[arg(long, value_name = "DURATION")]
    pub poll_interval: Option<String>,
    /// Do not LISTEN for notifications; poll every --poll-interval instead.
    #[arg(long)]
    pub poll_fixed_rate: bool,
    /// Rows claimed per statement.
    #[arg(long, value_name = "N")]
    pub batch_size: Option<usize>,
    /// Rows one node holds at most while publishing.
    #[arg(long, value_name = "N")]
    pub max_in_flight: Option<usize>,
    /// Lease on claimed rows; a crashed node's rows return after it.
    #[arg(long, value_name = "DURATION")]
    pub lease: Option<String>,
    /// Time a sink has to confirm a batch before it is retried; shorter than --lease, and cut
    /// short when the node's partition lease runs out.
    #[arg(long, value_name = "DURATION")]
    pub publish_timeout: Option<String>,
    /// Time a graceful shutdown waits for in-flight events.
    #[arg(long, value_name = "DURATION")]
    pub shutdown_timeout: Option<String>,
    #[command(flatten)]
    pub retry: RetryArgs,
    /// How often this node heartbeats in the nodes table.
    #[arg(long, value_name = "DURATION")]
    pub heartbeat_interval: Option<String>,
    /// How long a silent node stays listed.
    #[arg(long, value_name = "DURATION")]
    pub heartbeat_timeout: Option<String>,
    /// Address for /healthz, /readyz, /metrics, the admin API (/api/v1/) and the dashboard
    /// (/); 127.0.0.1:0 picks a free port, an empty value turns it off. A non-loopback
    /// address needs an admin token.
    #[arg(long, value_name = "HOST:PORT")]
    pub http_addr: Option<String>,
    /// A file holding the admin API's bearer token (or set OUTBOX_RELAY_ADMIN_TOKEN).
    /// Without a token the admin API is read-only.
    #[arg(long, value_name = "FILE")]
    pub admin_token_file: Option<std::path::PathBuf>,
    /// Host names the server answers to besides IP addresses and localhost (the names a
    /// browser or proxy uses for it), comma-separated; requests for any other Host are
    /// refused, against DNS rebinding.
    #[arg(long, value_name = "NAME,...", value_delimiter = ',')]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allowed_hosts: Vec<String>,
    /// This node's id in the nodes table [default: <hostname>-<random>].
    #[arg(long, value_name = "ID")]
    pub node_id: Option<String>,
    /// key: per-key order across the cluster, through partition ownership (PostgreSQL);
    /// none: every node claims any ready rows, for maximum throughput. All nodes of a cluster
    /// must use the same mode.
    #[arg(long, value_enum, value_name = "MODE")]
    pub ordering: Option<OrderingMode>,
}

/// The `[retry]` settings' flags.
#[derive(Args, Clone, Debug, Serialize)]
pub struct RetryArgs {
    /// First retry delay; each retry doubles it, with jitter.
    #[arg(
        long = "retry-base-delay",
        id = "retry.base_delay",
        value_name = "DURATION"
    )]
    pub base_delay: Option<String>,
    /// Longest retry delay.
    #[arg(
        long = "retry-max-delay",
        id = "retry.max_delay",
        value_name = "DURATION"
    )]
    pub max_delay: Option<String>,
    /// Attempts before an event is dead-lettered; per event type in the config file's
    /// [retry.max_attempts_by_type].
    #[arg(long = "max-attempts", id = "retry.max_attempts", value_name = "N")]
    pub max_attempts: Option<u32>,
}

#[derive(Args, Clone, Debug, Serialize)]
pub struct MigrateArgs {
    /// Print the DDL and the least-privilege GRANTs instead of applying them.
    #[arg(long)]
    #[serde(skip)]
    pub print: bool,
    /// Role named in the printed GRANTs.
    #[arg(long, default_value = "outbox_relay", value_name = "ROLE")]
    #[serde(skip)]
    pub role: String,
    /// Partitions to spread ordering keys over, fixed when the outbox is created.
    #[arg(long, value_name = "N")]
    pub partitions: Option<u32>,
}

#[derive(Args, Clone, Debug, Serialize)]
pub struct CheckArgs {
    /// The sink to check as well [default: the configured sink].
    #[arg(long, value_name = "URI")]
    pub sink: Option<String>,
}

#[derive(Args, Clone, Debug)]
pub struct SendArgs {
    /// The channel, topic or subject.
    #[arg(long, value_name = "DESTINATION")]
    pub destination: String,
    /// Ordering key [default: the destination].
    #[arg(long, value_name = "KEY")]
    pub key: Option<String>,
    /// Event type (message name).
    #[arg(long = "type", default_value = "event", value_name = "TYPE")]
    pub event_type: String,
    /// A header, repeatable.
    #[arg(long = "header", value_name = "NAME=VALUE", value_parser = parse_header)]
    pub headers: Vec<(String, String)>,
    /// Event id (UUID) [default: generated].
    #[arg(long, value_name = "UUID")]
    pub event_id: Option<uuid::Uuid>,
    /// Mutation id, as in the Ably connector.
    #[arg(long, value_name = "ID")]
    pub mutation_id: Option<String>,
    /// The payload, as JSON (for text, quote it: '"hello"').
    #[arg(value_name = "PAYLOAD_JSON")]
    pub payload: String,
}

fn parse_header(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("header {text:?} must look like name=value")),
    }
}

impl Cli {
    /// The flags given, as the configuration's highest layer.
    pub fn flags(&self) -> Figment {
        let flags = Figment::from(Given(&self.global));
        match &self.command {
            Command::Run(args) => flags.merge(Given(args)),
            Command::Check(args) => flags.merge(Given(args)),
            Command::Migrate(args) => flags.merge(Given(args)),
            Command::Health(args) => flags.merge(Given(args)),
            Command::Send(_)
            | Command::DropSlot
            | Command::Stats(_)
            | Command::Dead(_)
            | Command::Replay(_)
            | Command::Prune(_) => flags,
        }
    }
}

/// Flags as a configuration layer: only the flags given. A flag left out (`None`, or `false`
/// for a switch, which can only turn a setting on) leaves the lower layers' value.
struct Given<T>(T);

impl<T: Serialize> Provider for Given<T> {
    fn metadata(&self) -> Metadata {
        // Values set in code: their errors name the flag (see `describe_figment_error`).
        Serialized::defaults(&self.0).metadata()
    }

    fn data(&self) -> Result<figment::value::Map<Profile, Dict>, figment::Error> {
        fn given(dict: Dict) -> Dict {
            dict.into_iter()
                .filter_map(|(key, value)| match value {
                    Value::Empty(..) | Value::Bool(_, false) => None,
                    Value::Dict(tag, dict) => Some((key, Value::Dict(tag, given(dict)))),
                    value => Some((key, value)),
                })
                .collect()
        }
        let data = Serialized::defaults(&self.0).data()?;
        Ok(data.into_iter().map(|(p, dict)| (p, given(dict))).collect())
    }
}

/// The command line, each setting flag's help ending in the default from `Config::default()`.
pub fn command() -> clap::Command {
    let defaults = serde_json::to_value(Config::default()).unwrap_or_default();
    with_defaults(Cli::command(), &defaults)
}

fn with_defaults(mut command: clap::Command, defaults: &serde_json::Value) -> clap::Command {
    let shown: Vec<(String, String)> = command
        .get_arguments()
        // An argument with a clap default is no setting (`prune --batch-size`).
        .filter(|arg| arg.get_default_values().is_empty())
        .filter_map(|arg| {
            let id = arg.get_id().as_str();
            let pointer = format!("/{}", id.replace('.', "/"));
            let value = match defaults.pointer(&pointer)? {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Number(n) => n.to_string(),
                // Switches default to off; `None` has no value to show.
                _ => return None,
            };
            Some((id.to_string(), value))
        })
        .collect();
    for (id, value) in shown {
        command = command.mut_arg(id, |arg| {
            let help = arg.get_help().map(|h| format!("{h} [default: {value}]"));
            let long_help = arg
                .get_long_help()
                .map(|h| format!("{h} [default: {value}]"));
            let arg = match help {
                Some(help) => arg.help(help),
                None => arg,
            };
            match long_help {
                Some(help) => arg.long_help(help),
                None => arg,
            }
        });
    }
    let subcommands: Vec<String> = command
        .get_subcommands()
        .map(|s| s.get_name().to_string())
        .collect();
    for name in subcommands {
        command = command.mut_subcommand(name, |sub| with_defaults(sub, defaults));
    }
    command
}

#[cfg(test)]
mod tests {
    use super::*;

    fn help_of(path: &[&str], flag: &str) -> String {
        let mut command = command();
        command.build();
        let mut command = &command;
        for name in path {
            command = command.find_subcommand(name).expect("subcommand");
        }
        let arg = command
            .get_arguments()
            .find(|a| a.get_long() == Some(flag))
            .expect("flag");
        arg.get_help().expect("help").to_string()
    }

    /// The help shows the value the relay uses, from the one place it is set.
    #[test]
    fn the_help_shows_each_setting_default_from_the_config() {
        let d = Config::default();
        let shown = |path: &[&str], flag: &str, value: String| {
            let help = help_of(path, flag);
            assert!(
                help.ends_with(&format!("[default: {value}]")),
                "--{flag}: {help}"
            );
        };
        shown(&["run"], "batch-size", d.engine.batch_size.to_string());
        shown(&["run"], "lease", "30s".into());
        shown(&["run"], "retry-base-delay", "500ms".into());
        shown(&["run"], "retry-max-delay", "5m".into());
        shown(
            &["run"],
            "max-attempts",
            d.engine.retry.max_attempts.to_string(),
        );
        shown(&["run"], "http-addr", d.http.http_addr.clone());
        shown(&["run"], "ordering", "key".into());
        shown(
            &["migrate"],
            "partitions",
            d.database.partitions.to_string(),
        );
        shown(&[], "database-url", d.database.database_url.clone());
        shown(&[], "nodes-table", d.database.nodes_table.clone());
        shown(&[], "wakeup", "notify".into());
        // Not a setting: its help is its own.
        assert_eq!(
            help_of(&["prune"], "batch-size")
                .matches("[default")
                .count(),
            1
        );
        assert!(!help_of(&["run"], "auto-migrate").contains("[default"));
    }
}
