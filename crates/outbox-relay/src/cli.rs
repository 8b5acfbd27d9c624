//! Command-line interface.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::config::{FlagOverrides, LogFormat, OrderingMode, RetryFlags};

/// Publishes transactional-outbox rows to brokers: at least once, in order per key,
/// de-duplicable by event id.
///
/// With no configuration it relays ./outbox.db (SQLite) to stdout. Point it at PostgreSQL
/// with --database-url (or DATABASE_URL). Settings come from defaults, then a TOML file
/// (--config, or ./outbox-relay.toml), then OUTBOX_RELAY_* environment variables, then flags.
#[derive(Parser, Debug)]
#[command(name = "outbox-relay", version, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Args, Debug)]
pub struct GlobalArgs {
    /// TOML configuration file [default: ./outbox-relay.toml when present].
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Database URL: postgres://user:pass@host:port/db[?sslmode=require],
    /// mysql://user:pass@host:port/db[?require_ssl=true] (MySQL 8, MariaDB >= 10.6) or sqlite:PATH
    /// [default: sqlite:outbox.db]. Also OUTBOX_RELAY_DATABASE_URL or DATABASE_URL.
    #[arg(long, global = true, value_name = "URL")]
    pub database_url: Option<String>,
    /// Extra CA certificates (PEM) for database TLS (verify-ca, verify-full; with them,
    /// sslmode=require verifies the server too).
    #[arg(long, global = true, value_name = "FILE")]
    pub database_ca_file: Option<PathBuf>,
    /// The outbox table's layout: native (the relay's own tables), adbc (Ably Database
    /// Connector), open-outbox (Open Outbox Relay), export (event + event_type),
    /// mysql-outbox-events (the MySQL 8 seed), or custom (a [mapping] in the config file)
    /// [default: native]. Each seed layout defaults to its own table name.
    #[arg(long, global = true, value_name = "LAYOUT")]
    pub layout: Option<String>,
    /// How writers wake the relay on PostgreSQL: notify (every inserting statement NOTIFYs),
    /// gated (only while the relay waits for rows; cheaper for writers under load) or poll
    /// (never: the relay polls every --poll-interval; for applications that use two-phase
    /// commit, since a transaction that sent a NOTIFY cannot PREPARE TRANSACTION).
    /// `migrate` installs the matching trigger function [default: notify].
    #[arg(long, global = true, value_enum, value_name = "MODE")]
    pub wakeup: Option<crate::config::WakeupMode>,
    /// Schema of the outbox table [default: public].
    #[arg(long, global = true, value_name = "NAME")]
    pub outbox_schema: Option<String>,
    /// Name of the outbox table [default: outbox]. Dead letters go to <name>_dead_letters.
    #[arg(long, global = true, value_name = "NAME")]
    pub outbox_table: Option<String>,
    /// Schema of the nodes table [default: public].
    #[arg(long, global = true, value_name = "NAME")]
    pub nodes_schema: Option<String>,
    /// Name of the nodes table [default: outbox_nodes].
    #[arg(long, global = true, value_name = "NAME")]
    pub nodes_table: Option<String>,
    /// Log format.
    #[arg(long, global = true, value_enum, value_name = "FORMAT")]
    pub log_format: Option<LogFormat>,
    /// Log level or filter, e.g. info, debug, outbox_engine=debug [default: info].
    #[arg(long, global = true, value_name = "FILTER")]
    pub log_level: Option<String>,
}

#[derive(Subcommand, Debug)]
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
    /// Show the backlog per destination, the live nodes and which partitions each owns.
    Stats(StatsArgs),
    /// Inspect, resend or delete dead-lettered events.
    #[command(subcommand)]
    Dead(DeadCommand),
    /// Publish retained delivered events again (needs --retain-delivered), for consumers
    /// that lost data.
    Replay(ReplayArgs),
    /// Delete old delivered (retained) rows and dead letters, in small batches.
    Prune(PruneArgs),
}

#[derive(Subcommand, Debug)]
pub enum DeadCommand {
    /// List dead letters: id, destination, type, attempts and last error.
    List {
        /// Only this destination.
        #[arg(long, value_name = "D")]
        destination: Option<String>,
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

#[derive(Args, Debug)]
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

#[derive(Args, Debug)]
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

#[derive(Args, Debug)]
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

#[derive(Args, Debug)]
pub struct StatsArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Where every event goes: stdout, file:PATH, nats://, kafka://, amqp://, redis://,
    /// http(s)://URL-template or ably: [default: the config's [sinks]/[[routes]], else stdout].
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
    pub drain: bool,
    /// Keep delivered rows, marked with delivered_at, instead of deleting them.
    #[arg(long)]
    pub retain_delivered: bool,
    /// Safety-poll period while LISTENing, or the polling period with --poll-fixed-rate [default: 1s].
    #[arg(long, value_name = "DURATION")]
    pub poll_interval: Option<String>,
    /// Do not LISTEN for notifications; poll every --poll-interval instead.
    #[arg(long)]
    pub poll_fixed_rate: bool,
    /// Rows claimed per statement [default: 1000].
    #[arg(long, value_name = "N")]
    pub batch_size: Option<usize>,
    /// Rows one node holds at most while publishing [default: 10000].
    #[arg(long, value_name = "N")]
    pub max_in_flight: Option<usize>,
    /// Lease on claimed rows; a crashed node's rows return after it [default: 30s].
    #[arg(long, value_name = "DURATION")]
    pub lease: Option<String>,
    /// Time a sink has to confirm a batch before it is retried; shorter than --lease, and cut
    /// short when the node's partition lease runs out [default: 20s].
    #[arg(long, value_name = "DURATION")]
    pub publish_timeout: Option<String>,
    /// Time a graceful shutdown waits for in-flight events [default: 15s].
    #[arg(long, value_name = "DURATION")]
    pub shutdown_timeout: Option<String>,
    /// First retry delay; each retry doubles it, with jitter [default: 500ms].
    #[arg(long, value_name = "DURATION")]
    pub retry_base_delay: Option<String>,
    /// Longest retry delay [default: 5m].
    #[arg(long, value_name = "DURATION")]
    pub retry_max_delay: Option<String>,
    /// Attempts before an event is dead-lettered; per event type in the config file's
    /// [retry.max_attempts_by_type] [default: 20].
    #[arg(long, value_name = "N")]
    pub max_attempts: Option<u32>,
    /// How often this node heartbeats in the nodes table [default: 2s].
    #[arg(long, value_name = "DURATION")]
    pub heartbeat_interval: Option<String>,
    /// How long a silent node stays listed [default: 10s].
    #[arg(long, value_name = "DURATION")]
    pub heartbeat_timeout: Option<String>,
    /// Address for /healthz, /readyz and /metrics; 127.0.0.1:0 picks a free port, an empty
    /// value turns it off [default: 127.0.0.1:2259].
    #[arg(long, value_name = "HOST:PORT")]
    pub http_addr: Option<String>,
    /// This node's id in the nodes table [default: <hostname>-<random>].
    #[arg(long, value_name = "ID")]
    pub node_id: Option<String>,
    /// key: per-key order across the cluster, through partition ownership (PostgreSQL);
    /// none: every node claims any ready rows, for maximum throughput [default: key].
    /// All nodes of a cluster must use the same mode.
    #[arg(long, value_enum, value_name = "MODE")]
    pub ordering: Option<OrderingMode>,
}

#[derive(Args, Debug)]
pub struct MigrateArgs {
    /// Print the DDL and the least-privilege GRANTs instead of applying them.
    #[arg(long)]
    pub print: bool,
    /// Role named in the printed GRANTs.
    #[arg(long, default_value = "outbox_relay", value_name = "ROLE")]
    pub role: String,
    /// Partitions to spread ordering keys over, fixed when the outbox is created [default: 64].
    #[arg(long, value_name = "N")]
    pub partitions: Option<u32>,
}

#[derive(Args, Debug)]
pub struct CheckArgs {
    /// The sink to check as well [default: the configured sink].
    #[arg(long, value_name = "URI")]
    pub sink: Option<String>,
}

#[derive(Args, Debug)]
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
    /// The flags that override file and environment settings.
    pub fn overrides(&self) -> FlagOverrides {
        let g = &self.global;
        let mut o = FlagOverrides {
            database_url: g.database_url.clone(),
            layout: g.layout.clone(),
            wakeup: g.wakeup,
            database_ca_file: g.database_ca_file.clone(),
            outbox_schema: g.outbox_schema.clone(),
            outbox_table: g.outbox_table.clone(),
            nodes_schema: g.nodes_schema.clone(),
            nodes_table: g.nodes_table.clone(),
            log_format: g.log_format,
            log_level: g.log_level.clone(),
            ..FlagOverrides::default()
        };
        match &self.command {
            Command::Run(r) => {
                o.sink = r.sink.clone();
                o.auto_migrate = r.auto_migrate.then_some(true);
                o.retain_delivered = r.retain_delivered.then_some(true);
                o.poll_interval = r.poll_interval.clone();
                o.poll_fixed_rate = r.poll_fixed_rate.then_some(true);
                o.batch_size = r.batch_size;
                o.max_in_flight = r.max_in_flight;
                o.lease = r.lease.clone();
                o.publish_timeout = r.publish_timeout.clone();
                o.shutdown_timeout = r.shutdown_timeout.clone();
                o.heartbeat_interval = r.heartbeat_interval.clone();
                o.heartbeat_timeout = r.heartbeat_timeout.clone();
                o.http_addr = r.http_addr.clone();
                o.node_id = r.node_id.clone();
                o.ordering = r.ordering;
                let retry = RetryFlags {
                    base_delay: r.retry_base_delay.clone(),
                    max_delay: r.retry_max_delay.clone(),
                    max_attempts: r.max_attempts,
                };
                if retry.base_delay.is_some()
                    || retry.max_delay.is_some()
                    || retry.max_attempts.is_some()
                {
                    o.retry = Some(retry);
                }
            }
            Command::Check(c) => o.sink = c.sink.clone(),
            Command::Migrate(m) => o.partitions = m.partitions,
            Command::Send(_)
            | Command::Stats(_)
            | Command::Dead(_)
            | Command::Replay(_)
            | Command::Prune(_) => {}
        }
        o
    }
}
