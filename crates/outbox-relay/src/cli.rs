//! Command-line interface.
//!
//! A flag that sets a setting is a field named after the setting's key (its clap id is the
//! key, `retry.max_attempts` for `--max-attempts`), so that the flags serialize straight into
//! the configuration's highest layer ([`Cli::flags`]). It has no doc comment: its help is the
//! setting's own documentation, where the setting is declared, and ends with the setting's
//! default from `Config::default()` ([`command`]); `outbox-relay settings` prints the same
//! declarations as the configuration reference ([`reference_text`]). A flag with a doc
//! comment of its own says what the setting means for its command (`check --sink`). Fields
//! that are no setting (`--config`, `--drain`, `--print`) are `#[serde(skip)]`.

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
    /// With `[[outboxes]]` in the config file: the outbox to act on. Without it, run, migrate,
    /// check and stats act on every outbox; the other commands need it.
    #[arg(long, global = true, value_name = "NAME")]
    #[serde(skip)]
    pub outbox: Option<String>,
    #[arg(long, global = true, value_name = "URL")]
    pub database_url: Option<String>,
    #[arg(long, global = true, value_name = "FILE")]
    pub database_url_file: Option<PathBuf>,
    #[arg(long, global = true, value_name = "FILE")]
    pub database_ca_file: Option<PathBuf>,
    #[arg(long, global = true, value_name = "LAYOUT")]
    pub layout: Option<String>,
    #[arg(long, global = true, value_enum, value_name = "MODE")]
    pub wakeup: Option<WakeupMode>,
    #[arg(long, global = true, value_enum, value_name = "MODE")]
    pub capture: Option<CaptureMode>,
    #[arg(long, global = true, value_name = "ID")]
    pub binlog_server_id: Option<u32>,
    #[arg(long, global = true, value_name = "MIB")]
    pub binlog_memory_mib: Option<u64>,
    #[arg(long, global = true, value_name = "NAME")]
    pub slot: Option<String>,
    #[arg(long, global = true, value_name = "NAME")]
    pub publication: Option<String>,
    #[arg(long, global = true, value_name = "MIB")]
    pub wal_memory_mib: Option<u64>,
    #[arg(long, global = true, value_name = "NAME")]
    pub outbox_schema: Option<String>,
    #[arg(long, global = true, value_name = "NAME")]
    pub outbox_table: Option<String>,
    #[arg(long, global = true, value_name = "NAME")]
    pub nodes_schema: Option<String>,
    #[arg(long, global = true, value_name = "NAME")]
    pub nodes_table: Option<String>,
    #[arg(long, global = true, value_enum, value_name = "FORMAT")]
    pub log_format: Option<LogFormat>,
    #[arg(long, global = true, value_name = "FILTER")]
    pub log_level: Option<String>,
}

// Parsed once per process: boxing `run`'s arguments would save nothing worth a `Box`.
#[allow(clippy::large_enum_variant)]
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
    /// Print every setting: its key in the config file, its environment variable, the flag
    /// that sets it, its default, and what it does.
    Settings,
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
        /// Only those after this sequence id (the last one of the previous page) [default:
        /// from the first, negative ids included]
        #[arg(long, value_name = "ID", allow_negative_numbers = true)]
        after: Option<i64>,
        /// At most this many (1 or more).
        #[arg(long, default_value_t = 50, value_name = "N",
              value_parser = clap::value_parser!(u32).range(1..))]
        limit: u32,
        /// Print JSON lines.
        #[arg(long)]
        json: bool,
    },
    /// Move dead letters back into the outbox, attempts reset, to be published again. Exits 1
    /// when an id given names no dead letter, or a row stays dead (its event id is in the
    /// outbox again).
    Retry(DeadSelectArgs),
    /// Delete dead letters. Exits 1 when an id given names no dead letter.
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
    /// Rows per delete statement, 1 to 50000.
    // An id of its own: `batch_size` is the engine's setting, which `settings` lists with
    // the flags that set it.
    #[arg(
        id = "prune_batch_size",
        long = "batch-size",
        default_value_t = 1000,
        value_name = "N"
    )]
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
    #[arg(long, value_name = "URI")]
    pub sink: Option<String>,
    #[arg(long)]
    pub auto_migrate: bool,
    /// Deliver everything deliverable now, then exit (for cron jobs and tests): 0 when
    /// nothing is left pending and nothing was dead-lettered, 1 when events are left
    /// undelivered (retrying, dead-lettered, or still pending after waiting out other nodes'
    /// leases), with how many and why.
    #[arg(long)]
    #[serde(skip)]
    pub drain: bool,
    #[arg(long)]
    pub retain_delivered: bool,
    #[arg(long, value_name = "DURATION")]
    pub poll_interval: Option<String>,
    #[arg(long)]
    pub poll_fixed_rate: bool,
    #[arg(long, value_name = "N")]
    pub batch_size: Option<usize>,
    #[arg(long, value_name = "N")]
    pub max_in_flight: Option<usize>,
    #[arg(long, value_name = "DURATION")]
    pub lease: Option<String>,
    #[arg(long, value_name = "DURATION")]
    pub publish_timeout: Option<String>,
    #[arg(long, value_name = "DURATION")]
    pub shutdown_timeout: Option<String>,
    #[command(flatten)]
    pub retry: RetryArgs,
    #[arg(long, value_name = "DURATION")]
    pub heartbeat_interval: Option<String>,
    #[arg(long, value_name = "DURATION")]
    pub heartbeat_timeout: Option<String>,
    #[arg(long, value_name = "HOST:PORT")]
    pub http_addr: Option<String>,
    #[arg(long, value_name = "FILE")]
    pub admin_token_file: Option<std::path::PathBuf>,
    #[arg(long, value_name = "NAME,...", value_delimiter = ',')]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allowed_hosts: Vec<String>,
    #[arg(long, value_name = "ID")]
    pub node_id: Option<String>,
    #[arg(long, value_enum, value_name = "MODE")]
    pub ordering: Option<OrderingMode>,
    #[arg(long, value_name = "N")]
    pub worker_threads: Option<usize>,
}

/// The `[retry]` settings' flags.
#[derive(Args, Clone, Debug, Serialize)]
pub struct RetryArgs {
    #[arg(
        long = "retry-base-delay",
        id = "retry.base_delay",
        value_name = "DURATION"
    )]
    pub base_delay: Option<String>,
    #[arg(
        long = "retry-max-delay",
        id = "retry.max_delay",
        value_name = "DURATION"
    )]
    pub max_delay: Option<String>,
    #[arg(long = "max-attempts", id = "retry.max_attempts", value_name = "N")]
    pub max_attempts: Option<u32>,
}

#[derive(Args, Clone, Debug, Serialize)]
pub struct MigrateArgs {
    /// Print the DDL and the least-privilege GRANTs instead of applying them.
    #[arg(long)]
    #[serde(skip)]
    pub print: bool,
    /// Role named in the GRANTs `--print` shows (default outbox_relay). Only with
    /// `--print`: to grant them after migrating, use `--grant-to`.
    #[arg(long, value_name = "ROLE")]
    #[serde(skip)]
    pub role: Option<String>,
    /// After migrating, grant the relay's run-time role ROLE what it needs: the GRANTs
    /// `--print --role ROLE` shows (the role must exist). For a migration run as another
    /// role than the relays', as the Kubernetes Job does: tables it makes are otherwise
    /// out of the relays' reach.
    #[arg(long, value_name = "ROLE", conflicts_with = "print")]
    #[serde(skip)]
    pub grant_to: Option<String>,
    #[arg(long, value_name = "N")]
    pub partitions: Option<u32>,
}

#[derive(Args, Clone, Debug, Serialize)]
pub struct CheckArgs {
    /// The sink to check instead of the configured ones: a URI, as --sink takes (default:
    /// the configured sink, or every `[sinks.NAME]`). Not with `[sinks]` in the
    /// configuration.
    #[arg(long, value_name = "URI")]
    pub sink: Option<String>,
}

#[derive(Args, Clone, Debug)]
pub struct SendArgs {
    /// The channel, topic or subject.
    #[arg(long, value_name = "DESTINATION", value_parser = not_blank)]
    pub destination: String,
    /// Ordering key [default: the destination].
    #[arg(long, value_name = "KEY")]
    pub key: Option<String>,
    /// Event type (message name).
    #[arg(long = "type", default_value = "event", value_name = "TYPE", value_parser = not_blank)]
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
    /// The payload, as JSON (for text, quote it: '"hello"'); `-` reads it from standard
    /// input, `@FILE` from a file (a payload too long for a command line).
    #[arg(value_name = "PAYLOAD_JSON")]
    pub payload: String,
}

/// A destination or type to send to: a blank one would be routed nowhere a reader looks.
fn not_blank(text: &str) -> Result<String, String> {
    match text.trim().is_empty() {
        true => Err("it must not be blank".into()),
        false => Ok(text.to_string()),
    }
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
            | Command::Settings
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

/// The command line: each setting flag's help is the setting's documentation, ending in the
/// default from `Config::default()`.
pub fn command() -> clap::Command {
    let defaults = serde_json::to_value(Config::default()).unwrap_or_default();
    with_settings(Cli::command(), &defaults)
}

/// A setting's documentation as clap's derive would make a doc comment into help: the first
/// paragraph, without its final period, and the whole when there are several paragraphs.
fn flag_help(doc: &str) -> (String, Option<String>) {
    let mut paragraphs: Vec<String> = Vec::new();
    let mut current: Vec<&str> = Vec::new();
    for line in doc.lines().map(str::trim) {
        if line.is_empty() {
            if !current.is_empty() {
                paragraphs.push(current.join(" "));
                current.clear();
            }
        } else {
            current.push(line);
        }
    }
    if !current.is_empty() {
        paragraphs.push(current.join(" "));
    }
    let mut short = paragraphs.first().cloned().unwrap_or_default();
    if short.ends_with('.') && !short.ends_with("..") {
        short.pop();
    }
    let long = (paragraphs.len() > 1).then(|| paragraphs.join("\n\n"));
    (short, long)
}

/// The default of setting `key` as `--help` shows it; `None` for switches and settings
/// without a value by default.
fn shown_default(defaults: &serde_json::Value, key: &str) -> Option<String> {
    match defaults.pointer(&format!("/{}", key.replace('.', "/")))? {
        // An empty default is "none given": the setting's documentation says what applies.
        serde_json::Value::String(s) if s.is_empty() => None,
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn with_settings(mut command: clap::Command, defaults: &serde_json::Value) -> clap::Command {
    let settings = crate::config::reference();
    let ids: Vec<String> = command
        .get_arguments()
        // An argument with a clap default is no setting (`prune --batch-size`).
        .filter(|arg| arg.get_default_values().is_empty())
        .map(|arg| arg.get_id().to_string())
        .collect();
    for id in ids {
        let Some((_, doc)) = settings.iter().find(|(key, _)| *key == id) else {
            continue;
        };
        let default = shown_default(defaults, &id);
        command = command.mut_arg(&id, |mut arg| {
            // A flag without help of its own shows the setting's.
            if arg.get_help().is_none() {
                let (help, long_help) = flag_help(doc);
                arg = arg.help(help);
                if let Some(long_help) = long_help {
                    arg = arg.long_help(long_help);
                }
            }
            let Some(value) = default else { return arg };
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
        command = command.mut_subcommand(name, |sub| with_settings(sub, defaults));
    }
    command
}

/// The configuration reference (`outbox-relay settings`): every setting in declaration order,
/// with its key and default as the config file writes them, its environment variable, the
/// flags that set it and the commands that take them, and its documentation. With the
/// `effective` configuration (the file, environment and flags loaded), a setting it gives
/// another value shows that value, secrets redacted, beside its default: `settings --config
/// FILE` listed the defaults alone, as if the file set nothing.
pub fn reference_text(effective: Option<&Config>) -> String {
    use std::fmt::Write;
    let defaults = crate::admin::redacted_settings(&Config::default());
    let effective = effective.map(crate::admin::redacted_settings);
    let mut command = command();
    command.build();
    let mut flags: Vec<(String, String, String)> = Vec::new();
    collect_flags(&command, "every command", &mut flags);
    let mut text = String::new();
    for (key, doc) in crate::config::reference() {
        let table = format!("{key}.");
        let default = match defaults.pointer(&format!("/{}", key.replace('.', "/"))) {
            Some(serde_json::Value::Null) | None => "(not set)".to_string(),
            _ if crate::config::reference()
                .iter()
                .any(|(k, _)| k.starts_with(&table)) =>
            {
                "(the table whose keys follow)".to_string()
            }
            Some(value) => value.to_string(),
        };
        let given = effective
            .as_ref()
            .and_then(|e| e.pointer(&format!("/{}", key.replace('.', "/"))))
            .filter(|value| !value.is_null() && !value.is_object())
            .map(ToString::to_string)
            .filter(|value| *value != default);
        match given {
            Some(value) => {
                let _ = writeln!(text, "{key} = {value}    (default: {default})");
            }
            None => {
                let _ = writeln!(text, "{key} = {default}");
            }
        }
        let variable = format!("OUTBOX_RELAY_{}", key.replace('.', "__").to_uppercase());
        let mut set_by = vec![variable];
        let mut given: Vec<(&str, Vec<&str>)> = Vec::new();
        for (id, long, place) in &flags {
            if id != key {
                continue;
            }
            match given.iter_mut().find(|(l, _)| *l == long.as_str()) {
                Some((_, places)) => places.push(place),
                None => given.push((long, vec![place])),
            }
        }
        set_by.extend(
            given
                .into_iter()
                .map(|(long, places)| format!("--{long} ({})", places.join(", "))),
        );
        let _ = writeln!(text, "    {}", set_by.join(", "));
        for line in doc.lines() {
            let _ = writeln!(text, "    {}", line.trim());
        }
        text.push('\n');
    }
    text
}

/// Every flag under `command`: its id, its long name, and the command that takes it (a
/// global flag is every command's).
fn collect_flags(command: &clap::Command, place: &str, flags: &mut Vec<(String, String, String)>) {
    for arg in command.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if arg.is_global_set() && place != "every command" {
            continue;
        }
        flags.push((
            arg.get_id().to_string(),
            long.to_string(),
            place.to_string(),
        ));
    }
    for sub in command.get_subcommands() {
        collect_flags(sub, sub.get_name(), flags);
    }
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
        shown(&[], "outbox-schema", d.database.outbox_schema.clone());
        // No name by default: the layout's applies, as the documentation says.
        assert!(!help_of(&[], "nodes-table").contains("[default"));
        assert!(!help_of(&[], "slot").contains("[default"));
        shown(&[], "wakeup", "notify".into());
        // Not a setting: its help is its own (clap adds its default when it renders it).
        assert_eq!(
            help_of(&["prune"], "batch-size"),
            "Rows per delete statement, 1 to 50000"
        );
        assert!(!help_of(&["run"], "auto-migrate").contains("[default"));
    }

    /// clap adds `[default: …]` from `default_value_t` to the help text, which some helps
    /// also wrote out: `--help` showed `[default: 1000] [default: 1000]`.
    #[test]
    fn no_help_line_shows_its_default_twice() {
        fn each(command: &mut clap::Command, path: &str) {
            // `-h`: each argument on one line, its help and clap's default.
            let help = command.render_help().to_string();
            for line in help.lines() {
                assert!(
                    line.matches("[default").count() <= 1,
                    "{path} --help: {line}"
                );
            }
            for sub in command.get_subcommands_mut() {
                let path = format!("{path} {}", sub.get_name());
                each(sub, &path);
            }
        }
        let mut command = command();
        command.build();
        each(&mut command, "outbox-relay");
    }

    /// Every argument under `command`, with the path of commands that takes it.
    fn arguments(command: &clap::Command) -> Vec<(String, clap::Arg)> {
        let mut all: Vec<(String, clap::Arg)> = command
            .get_arguments()
            .map(|a| (command.get_name().to_string(), a.clone()))
            .collect();
        for sub in command.get_subcommands() {
            all.extend(arguments(sub));
        }
        all
    }

    /// `--help` and the configuration reference (`outbox-relay settings`) come from the same
    /// declarations: a flag without help of its own is a declared setting and shows that
    /// setting's documentation; every setting flag is in the reference under its key, beside
    /// its environment variable; and the README's example file uses declared keys only.
    #[test]
    fn the_help_and_the_reference_come_from_the_same_declarations() {
        let settings = crate::config::reference();
        let declared = |id: &str| settings.iter().find(|(key, _)| key == id);
        let reference = reference_text(None);
        let mut raw = Cli::command();
        raw.build();
        let mut shown = command();
        shown.build();
        let helped: Vec<_> = arguments(&shown);
        let mut setting_flags = 0;
        for (place, arg) in arguments(&raw) {
            let (Some(long), id) = (arg.get_long(), arg.get_id().as_str()) else {
                continue;
            };
            let with_help = helped
                .iter()
                .find(|(p, a)| *p == place && a.get_id() == id)
                .map(|(_, a)| a.get_help().map(|h| h.to_string()).unwrap_or_default())
                .unwrap();
            if arg.get_help().is_some() {
                // Its own words: what the flag means for its command (or no setting at all).
                continue;
            }
            let Some((key, doc)) = declared(id) else {
                panic!("{place} --{long} has no help and sets no declared setting ({id})");
            };
            setting_flags += 1;
            let (help, _) = flag_help(doc);
            assert!(
                with_help.starts_with(&help),
                "{place} --{long}: {with_help:?} is not the documentation of {key}: {help:?}"
            );
            let entry = reference
                .split("\n\n")
                .find(|entry| entry.starts_with(&format!("{key} = ")))
                .unwrap_or_else(|| panic!("{key} is not in the reference"));
            let variable = format!("OUTBOX_RELAY_{}", key.replace('.', "__").to_uppercase());
            assert!(
                entry.contains(&format!("--{long} (")) && entry.contains(&variable),
                "{key}: {entry}"
            );
        }
        assert!(setting_flags > 30, "{setting_flags} setting flags");
        for (key, _) in settings {
            assert!(
                reference.contains(&format!("\n{key} = ")) || reference.starts_with(key.as_str()),
                "{key} is missing from the reference"
            );
        }
        // The README's example file: every key is one the relay reads.
        let readme = include_str!("../../../README.md");
        let example = readme
            .split("## Configuration\n")
            .nth(1)
            .and_then(|section| section.split("```toml\n").nth(1))
            .and_then(|block| block.split("```").next())
            .expect("the README's example configuration");
        let mut table = String::new();
        for line in example.lines().map(str::trim) {
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                table = format!("{name}.");
                continue;
            }
            let Some((key, _)) = line.split_once(" = ") else {
                continue;
            };
            if table == "retry.max_attempts_by_type." {
                continue; // event types, not keys
            }
            let key = format!("{table}{key}");
            assert!(declared(&key).is_some(), "README's {key} is no setting");
        }
    }
}
