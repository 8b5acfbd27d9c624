//! The `outbox-relay` binary: a thin layer of commands over the engine, stores and sinks.

/// `println!` for a command's output. A reader that left (`outbox-relay dead list | head`)
/// is no failure of the command ([`write_out`]), where `println!` panicked and the relay
/// called it a bug.
macro_rules! outln {
    ($($arg:tt)*) => { $crate::write_out(format_args!("{}\n", format_args!($($arg)*))) };
}

/// `print!` as [`outln!`] writes.
macro_rules! out {
    ($($arg:tt)*) => { $crate::write_out(format_args!($($arg)*)) };
}

mod admin;
mod cli;
mod commands;
mod config;
mod error;
mod http;
mod operator;
#[cfg(feature = "otel")]
mod otel;
#[cfg(not(feature = "otel"))]
#[path = "otel_off.rs"]
mod otel;
mod outboxes;
mod progress;
mod recorder;
mod relay;
mod secret_file;
mod shutdown;
mod store;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::FromArgMatches;

/// The version `--version` and the admin API show: the crate's, and the commit it was built
/// from (`build.rs`).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("OUTBOX_BUILD_COMMIT"),
    ")"
);

use crate::cli::{Cli, Command};
use crate::config::{Config, LogFormat};

/// The text log's fields with control characters escaped: a newline or an escape sequence
/// in a destination, a key or a receiver's answer must not forge a line or drive a terminal.
/// (JSON escapes them itself.)
fn escaped_fields() -> impl for<'w> tracing_subscriber::fmt::FormatFields<'w> {
    use tracing_subscriber::field::MakeExt;
    tracing_subscriber::fmt::format::debug_fn(|w, field, value| {
        let text = format!("{value:?}");
        // Our own fields are redacted where they are logged; a dependency's (an exporter's
        // URL with its password) are not.
        let text = outbox_core::redact::redact_url(&text);
        let text = outbox_core::redact::escape_controls(&text);
        match field.name() {
            "message" => write!(w, "{text}"),
            name => write!(w, "{name}={text}"),
        }
    })
    .delimited(" ")
}

// glibc's malloc took a fifth of the relay's CPU publishing to JetStream, much of it waiting
// on arena locks between runtime threads (perf; BENCHMARKS.md). Built without transparent huge
// pages (`no_thp`): with them, peak RSS doubled.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn init_logging(config: &Config) -> anyhow::Result<()> {
    // An empty filter has no directive, and turned every log line off without a word.
    if config.relay.log_level.trim().is_empty() {
        anyhow::bail!(
            "the log level is empty, which would log nothing: use e.g. info, debug or \
             outbox_engine=debug (`off` logs nothing)"
        );
    }
    refuse_bare_targets(&config.relay.log_level)?;
    let mut filter =
        tracing_subscriber::EnvFilter::try_new(&config.relay.log_level).map_err(|e| {
            anyhow::anyhow!(
                "invalid log level {:?}: {e}; use e.g. info, debug or outbox_engine=debug",
                config.relay.log_level
            )
        })?;
    // The trace exporter's own debug lines carry its endpoint's URL, password and all (the
    // JSON format quotes fields as they are): kept at info unless asked for by name.
    if !config.relay.log_level.contains("opentelemetry") {
        filter = filter.add_directive("opentelemetry=info".parse()?);
    }
    // lapin logs a message the broker returned (unroutable) at WARN with its body and
    // headers: an authorization header or a card number went to the log. The sink's own
    // error names the failure without them. Off whatever the level asks for.
    filter = filter.add_directive("lapin::returned_messages=off".parse()?);
    // The NATS client logs each event of its connection at INFO, every reconnect attempt
    // among them; the sink says a loss and a return once itself.
    if !config.relay.log_level.contains("async_nats") {
        filter = filter.add_directive("async_nats=warn".parse()?);
    }
    // Logs go to stderr: stdout belongs to the stdout sink. Colours only on a terminal: a
    // redirected log (a file, journald, a collector) would keep the escape codes.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match config.relay.log_format {
        LogFormat::Json => builder.json().flatten_event(true).init(),
        LogFormat::Text => builder.fmt_fields(escaped_fields()).init(),
    }
    Ok(())
}

/// Refuses a filter directive that is neither a level nor `target=level`: a bare word is
/// read as a target logged at every level, so `warning` (a common spelling of `warn`) logged
/// only a target named "warning", which is to say nothing, errors included.
fn refuse_bare_targets(filter: &str) -> anyhow::Result<()> {
    const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];
    for directive in filter.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let is_level = LEVELS.iter().any(|l| directive.eq_ignore_ascii_case(l));
        if !is_level && !directive.contains(['=', '[']) {
            let hint = match directive.to_ascii_lowercase().as_str() {
                "warning" => "warn".to_string(),
                "err" => "error".to_string(),
                "information" => "info".to_string(),
                _ => format!("{directive}=debug"),
            };
            anyhow::bail!(
                "invalid log level {filter:?}: {directive:?} is no level (trace, debug, info, \
                 warn, error, off) and no target=level (read as a module's name, it would log \
                 that module alone): did you mean {hint:?}?"
            );
        }
    }
    Ok(())
}

/// Runs `command` on the configuration's one outbox, or, with `[[outboxes]]`, on the one
/// `--outbox` names or on each in turn (`run` runs them all at once).
async fn dispatch(
    command: Command,
    config: Config,
    flags: figment::Figment,
    outbox: Option<String>,
) -> anyhow::Result<ExitCode> {
    if let Command::Health(args) = &command {
        // The process's HTTP server: one for every outbox.
        if outbox.is_some() {
            return Err(error::config_error(
                "health asks the process's one HTTP server, which serves every outbox: \
                 remove --outbox (GET /outboxes/NAME/api/v1/status shows one outbox)"
                    .into(),
            ));
        }
        return commands::health(config, args.ready).await;
    }
    if config.relay.outboxes.is_empty() {
        refuse_unused_secrets([&config])?;
        if let Some(name) = outbox {
            return Err(error::config_error(format!(
                "--outbox {name}: the configuration has no [[outboxes]]; remove --outbox, or \
                 list the outboxes in the config file (see the README, \"Many outboxes\")"
            )));
        }
        return run_command(command, config).await;
    }
    let outboxes = config.outboxes(&flags)?;
    refuse_unused_secrets(outboxes.iter().map(|o| &o.config))?;
    let names = || {
        outboxes
            .iter()
            .map(|o| o.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some(name) = outbox {
        let Some(chosen) = outboxes.iter().find(|o| o.name == name) else {
            return Err(error::config_error(format!(
                "--outbox {name}: there is no such outbox; the outboxes are {}",
                names()
            )));
        };
        return run_command(command, chosen.config.clone()).await;
    }
    let heading = match &command {
        Command::Run(args) => return commands::run_outboxes(config, outboxes, args.drain).await,
        Command::Migrate(_) => "--",
        Command::Check(_) | Command::Stats(cli::StatsArgs { json: false }) => "==",
        _ => {
            return Err(error::config_error(format!(
                "this command acts on one outbox: choose one with --outbox NAME (the outboxes \
                 are {})",
                names()
            )))
        }
    };
    // Each outbox in turn, all of them even when one fails; the worst result is the
    // process's (a configuration error, exit 2, before a runtime failure).
    let mut worst = ExitCode::SUCCESS;
    let mut failures = Vec::new();
    for outbox in &outboxes {
        let closing = if heading == "==" { " ==" } else { "" };
        outln!("{heading} outbox {}{closing}", outbox.name);
        match run_command(command.clone(), outbox.config.clone()).await {
            Ok(code) if code != ExitCode::SUCCESS => worst = code,
            Ok(_) => {}
            Err(e) => failures.push((outbox.name.clone(), e)),
        }
    }
    if failures.is_empty() {
        Ok(worst)
    } else {
        Err(outboxes::failed(failures))
    }
}

async fn run_command(command: Command, config: Config) -> anyhow::Result<ExitCode> {
    match command {
        Command::Run(args) => commands::run(config, args.drain).await,
        Command::Migrate(args) => commands::migrate(config, args).await,
        Command::Check(_) => commands::check(config).await,
        Command::Send(args) => commands::send(config, args).await,
        Command::DropSlot => commands::drop_slot(config).await,
        Command::Stats(args) => commands::stats(config, args.json).await,
        Command::Health(args) => commands::health(config, args.ready).await,
        Command::Dead(command) => operator::dead(config, command).await,
        Command::Replay(args) => operator::replay(config, args).await,
        Command::Prune(args) => operator::prune(config, args).await,
        Command::Settings => {
            out!("{}", cli::reference_text(Some(&config)));
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// A write past the process's file-size limit (`ulimit -f`, systemd's `LimitFSIZE`) raises
/// SIGXFSZ, whose default action ended the relay without a word at the file sink's (or
/// SQLite's) write that crossed it, and again after every restart. Ignored, the write fails
/// with EFBIG instead, which the sink reports with its fix, and retries.
#[allow(unsafe_code)]
fn write_past_the_file_size_limit_fails_instead_of_killing() {
    // SAFETY: setting a signal's disposition to SIG_IGN, before any other thread runs;
    // nothing in the process handles SIGXFSZ.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
}

fn main() -> ExitCode {
    write_past_the_file_size_limit_fails_instead_of_killing();
    let cli = match Cli::from_arg_matches(&cli::command().get_matches()) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    let config = match Config::load(cli.global.config.as_deref(), cli.flags()) {
        Ok(config) => config,
        Err(e) => {
            if let Command::Settings = cli.command {
                // The reference is shown whatever the configuration holds: its defaults,
                // then what is wrong with the configuration.
                out!("{}", cli::reference_text(None));
            }
            eprintln!("error: {e:#}");
            return ExitCode::from(error::EXIT_BAD_CONFIGURATION);
        }
    };
    if let Err(e) = init_logging(&config) {
        eprintln!("error: {e:#}");
        return ExitCode::from(error::EXIT_BAD_CONFIGURATION);
    }
    for warning in config.secrets_everyone_may_read(cli.global.config.as_deref()) {
        tracing::warn!("{warning}");
    }
    // One TLS crypto provider for every client in the process.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.relay.worker_threads)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let outbox = cli.global.outbox.clone();
    let flags = cli.flags();
    let log_format = config.relay.log_format;
    let result = block_on_a_worker(&runtime, dispatch(cli.command, config, flags, outbox))
        .and_then(|outcome| outcome);
    match result {
        Ok(code) => code,
        Err(e) => {
            // A text log is for people, and the `error:` line below says it to them: once.
            if log_format == LogFormat::Json {
                tracing::error!(error = %format!("{e:#}"), "outbox-relay failed");
            }
            // It can quote what a broker or receiver answered: no escape sequence or forged
            // line reaches the terminal (or the log collector reading stderr).
            let said = format!("{e:#}");
            eprintln!("error: {}", outbox_core::redact::escape_controls(&said));
            error::exit_code(&e)
        }
    }
}

/// Runs `work` to completion on one of `runtime`'s workers, not on the calling thread
/// (where `block_on` polls its own future). The engine's loop there and the tasks it spawns
/// on the workers (the WAL reader, sink writes) would otherwise wake each other across
/// threads, a futex or an eventfd for every batch: at 10,000 events/s that was about a
/// fifth of the relay's CPU.
pub(crate) fn block_on_a_worker<F>(
    runtime: &tokio::runtime::Runtime,
    work: F,
) -> anyhow::Result<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    runtime
        .block_on(runtime.spawn(work))
        .map_err(|e| anyhow::anyhow!("the relay's main task failed (a bug): {e}"))
}

/// [`outbox_publishers::refuse_unused_secrets`] over the sinks of every outbox in `configs`.
fn refuse_unused_secrets<'a>(
    configs: impl IntoIterator<Item = &'a config::Config>,
) -> anyhow::Result<()> {
    let sinks: Vec<outbox_publishers::SinkConfig> = configs
        .into_iter()
        .flat_map(|c| c.sink_setup().0.into_values())
        .collect();
    outbox_publishers::refuse_unused_secrets(&sinks).map_err(|e| error::config_error(e.to_string()))
}

/// Writes a command's output to stdout ([`outln!`]). Once the reader has left, the rest of
/// the output is dropped and the command goes on to its end and its own exit code: `check |
/// head -1` still fails when the check does, and `migrate --grant-to R | grep -m1 ..`
/// still grants.
fn write_out(text: std::fmt::Arguments<'_>) {
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, Ordering};
    static READER_LEFT: AtomicBool = AtomicBool::new(false);
    if READER_LEFT.load(Ordering::Relaxed) {
        return;
    }
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout.write_fmt(text).and_then(|()| stdout.flush()) {
        READER_LEFT.store(true, Ordering::Relaxed);
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            eprintln!("error: cannot write the output ({e}); the command goes on without it");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_main_task_runs_on_a_worker_beside_the_tasks_it_spawns() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let caller = std::thread::current().id();
        let (main_task, spawned) = block_on_a_worker(&runtime, async {
            let main_task = std::thread::current().id();
            let spawned = tokio::spawn(async { std::thread::current().id() })
                .await
                .unwrap();
            (main_task, spawned)
        })
        .unwrap();
        assert_ne!(main_task, caller);
        assert_eq!(main_task, spawned, "one worker: both run on it");
    }

    #[test]
    fn a_panic_in_the_main_task_is_an_error_not_a_hang() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap();
        let err = block_on_a_worker(&runtime, async { panic!("boom") }).unwrap_err();
        assert!(format!("{err}").contains("a bug"), "{err}");
    }
}
