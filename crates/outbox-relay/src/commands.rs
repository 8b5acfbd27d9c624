//! The subcommands.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::bail;
use outbox_core::redact::redact_url;
use outbox_core::NewEvent;

use crate::cli::{MigrateArgs, SendArgs};
use crate::config::Config;
use crate::error::{config_error, failure};
use crate::operator::ready_existing_store;
use crate::relay::{build_sink, relay_outbox, Place};
use crate::store::{AnyStore, BacklogReport};

pub async fn run(config: Config, drain: bool) -> anyhow::Result<ExitCode> {
    let metrics = crate::recorder::install()?;
    relay_outbox(
        config,
        drain,
        metrics,
        Place::Alone,
        crate::shutdown::signal(),
    )
    .await?;
    Ok(ExitCode::SUCCESS)
}

/// `run` with `[[outboxes]]`: see `outboxes::run`.
pub async fn run_outboxes(
    config: Config,
    outboxes: Vec<crate::config::NamedOutbox>,
    drain: bool,
) -> anyhow::Result<ExitCode> {
    let metrics = crate::recorder::install()?;
    crate::outboxes::run(config, outboxes, drain, metrics).await
}

/// `health`: asks the running relay's HTTP server for /healthz (or /readyz): exit 0 on 200,
/// 1 otherwise, printing what it answered. A wildcard listen address is asked on loopback.
pub async fn health(config: Config, ready: bool) -> anyhow::Result<ExitCode> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Some(mut addr) = config.http.socket_addr()? else {
        return Err(config_error(
            "health asks the relay's HTTP server, which is off (http_addr is empty): set \
             http_addr, or check the process some other way"
                .into(),
        ));
    };
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr {
            std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    let path = if ready { "/readyz" } else { "/healthz" };
    // With an admin token, /readyz gives its reasons to callers that send it only.
    let authorization = match config.http.admin_token()? {
        Some(token) => format!("Authorization: Bearer {}\r\n", token.expose()),
        None => String::new(),
    };
    let ask = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{authorization}Connection: close\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&response).into_owned())
    };
    let response = match tokio::time::timeout(Duration::from_secs(5), ask).await {
        Ok(Ok(response)) => response,
        Ok(Err(e)) => {
            bail!("http://{addr}{path}: {e} (is the relay running, with http_addr {addr}?)")
        }
        Err(_) => bail!("http://{addr}{path}: no answer within 5s"),
    };
    let status = response.split_whitespace().nth(1).unwrap_or_default();
    let status = outbox_core::redact::escape_controls(status);
    // Escaped as the server escapes it: an older one did not.
    let body = response.split("\r\n\r\n").nth(1).unwrap_or_default().trim();
    let body = outbox_core::redact::escape_controls(body);
    if status == "200" {
        outln!("{body}");
        Ok(ExitCode::SUCCESS)
    } else {
        bail!("http://{addr}{path} answered {status}: {body}")
    }
}

/// `drop-slot`: drops the replication slot of `--capture wal`.
pub async fn drop_slot(config: Config) -> anyhow::Result<ExitCode> {
    // Refused before the store opens: opening an SQLite path creates the file.
    if config.database.capture != crate::config::CaptureMode::Wal {
        return Err(config_error(
            "drop-slot drops the replication slot of WAL capture: add --capture wal (with \
             --slot if it is not the default)"
                .into(),
        ));
    }
    let mut store = AnyStore::open(config.store_settings()?)?;
    store.keep_legacy_slot().await;
    let AnyStore::PostgresWal(pg, capture) = &store else {
        return Err(config_error(
            "drop-slot drops the replication slot of WAL capture: add --capture wal (with \
             --slot if it is not the default)"
                .into(),
        ));
    };
    let wal = outbox_wal::WalConfig::new(
        config.database.database_url.clone(),
        capture.slot.clone(),
        capture.publication.as_str(),
        pg.tables().outbox.clone(),
    );
    // What it held back, said once it is gone (read before: a dropped slot shows nothing).
    let held = outbox_wal::slot_status(pg, &capture.slot)
        .await
        .ok()
        .flatten()
        .map(|s| s.holds_back());
    // The adoption is forgotten once the slot is gone, not before: a drop that waits for a
    // relay still streaming, and is cut short, leaves slot and record as they were. Should
    // forgetting fail, the next session that makes the slot forgets it (it does whenever
    // the slot is missing), so the new slot still adopts the table's rows.
    let waiting = |reason: &str| {
        eprintln!(
            "waiting: {reason}: the relay streaming from it must stop first (stop it, or \
             press Ctrl-C to leave the slot as it is)"
        )
    };
    match outbox_wal::drop_slot(&wal, waiting).await {
        Ok(true) => match held {
            Some(held) => outln!(
                "dropped the replication slot {}, which held back {held}",
                capture.slot
            ),
            None => outln!("dropped the replication slot {}", capture.slot),
        },
        Ok(false) => outln!("there is no replication slot {}", capture.slot),
        Err(e) => bail!("cannot drop the replication slot {}: {e}", capture.slot),
    }
    if let Err(e) = outbox_wal::forget_adoption(pg, &capture.publication, &capture.slot).await {
        tracing::warn!(
            slot = %capture.slot,
            error = %e.report(),
            "cannot forget that the slot adopted the outbox's rows; the relay's next session forgets it"
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn migrate(config: Config, args: MigrateArgs) -> anyhow::Result<ExitCode> {
    // Applied, a migration grants nothing to `--role`: the relays would find out later, on
    // a missing privilege.
    if args.role.is_some() && !args.print {
        return Err(config_error(
            "--role names the role in the GRANTs --print shows: add --print to see them, or \
             use --grant-to ROLE to grant them after migrating"
                .into(),
        ));
    }
    let sqlite = matches!(
        config.database.database_kind(),
        Ok(crate::config::DatabaseKind::Sqlite(_))
    );
    if sqlite && args.role.is_some() {
        return Err(config_error(
            "--role: SQLite has no roles, and its DDL grants nothing; the relay needs read and \
             write access to the database file and its directory"
                .into(),
        ));
    }
    // Printing the DDL for a file not made yet makes none: an empty database lacks the
    // same steps.
    let settings = match config.store_settings()? {
        crate::store::StoreSettings::Sqlite {
            path,
            retain_delivered,
        } if args.print && !path.exists() => crate::store::StoreSettings::Sqlite {
            path: ":memory:".into(),
            retain_delivered,
        },
        settings => settings,
    };
    let mut store = AnyStore::open(settings)?;
    store.keep_legacy_slot().await;
    if args.print {
        let role = args.role.as_deref().unwrap_or("outbox_relay");
        outbox_core::ident::Ident::new(role, "role name")
            .map_err(|e| config_error(format!("--role: {}", e.report())))?;
        outln!("{}", store.printable_ddl(role).await);
        return Ok(ExitCode::SUCCESS);
    }
    let grants = match &args.grant_to {
        None => None,
        Some(role) => {
            outbox_core::ident::Ident::new(role, "role name")
                .map_err(|e| config_error(format!("--grant-to: {}", e.report())))?;
            let grants = store.grants(role).ok_or_else(|| {
                config_error(
                    "--grant-to: SQLite has no roles; the relay needs read and write access to \
                     the database file and its directory"
                        .to_string(),
                )
            })?;
            Some((role, grants))
        }
    };
    store
        .migrate()
        .await
        .map_err(|e| failure(format!("migration failed: {}", e.report()), &e))?;
    outln!("migrated: {}", store.outbox().describe());
    if let Some((role, grants)) = grants {
        store.execute_script(&grants).await.map_err(|e| {
            failure(
                format!(
                    "granting {role} failed: {} (the role must exist; `migrate --print --role \
                     {role}` shows the GRANTs)",
                    e.report()
                ),
                &e,
            )
        })?;
        outln!("granted: what the relay needs, to {role}");
    }
    // What a migration cannot do itself (a server setting, a role attribute) is said now,
    // not at the first `run`. The migration did apply, so this is no failure; and it is
    // checked as the role that migrated, which may not be the one the relay runs as.
    match store.verify().await {
        Ok(problems) if problems.is_empty() => {}
        Ok(problems) => {
            let blocked = problems.iter().any(|p| !p.is_degraded());
            let verdict = if blocked {
                "not ready to run yet"
            } else {
                "ready to run"
            };
            outln!("{verdict}; what `check` finds, as this role:");
            print_problems(&problems);
        }
        Err(e) => outln!("could not check the result (run `check`): {}", e.report()),
    }
    Ok(ExitCode::SUCCESS)
}

/// Each problem `verify` found, with its fix, as `check` and `migrate` print them.
fn print_problems(problems: &[outbox_core::store::Problem]) {
    for p in problems {
        let label = if p.fails_check() {
            "problem"
        } else {
            "warning"
        };
        outln!("{label}: {}\n    fix: {}", p.what, p.fix);
    }
}

pub async fn check(config: Config) -> anyhow::Result<ExitCode> {
    let mut failed = false;
    let mut misconfigured = false;
    // The HTTP settings (the admin token among them) are checked as `run` checks them.
    config.http.listen()?;
    // The database URL is parsed first: "valid", then refused, was said of a bad one.
    config.store_settings()?;
    // The sinks are built (not reached) before too, for the same reason: a sink only the
    // configuration can fix was refused after "valid" was said.
    let (sinks, routes) = config.sink_setup();
    let sink = build_sink(&sinks, &routes, config.database.layout).await;
    match &sink {
        Err(e) if crate::error::is_config_error(e) => {
            misconfigured = true;
            outln!("problem: {e:#}");
        }
        _ => outln!("ok: configuration is valid\n{}", config.summary()),
    }
    // Opened, a mistyped path became a new database that `check` told to migrate: said,
    // and the sinks are checked all the same.
    match crate::operator::refuse_a_missing_sqlite_file(&config) {
        Err(e) => {
            misconfigured = true;
            outln!("problem: {e:#}");
        }
        Ok(()) => match check_database(&config).await? {
            DatabaseCheck::Unreachable {
                misconfigured: false,
            } => return Ok(ExitCode::FAILURE),
            // No such database or role: as `run` and the other commands exit.
            DatabaseCheck::Unreachable {
                misconfigured: true,
            } => return Ok(ExitCode::from(crate::error::EXIT_BAD_CONFIGURATION)),
            DatabaseCheck::Checked {
                problems,
                misconfigured: schema,
            } => {
                failed |= problems;
                misconfigured |= schema;
            }
        },
    }
    match sink {
        Ok(sink) => match sink.health().await {
            Ok(()) => outln!("ok: sink {} is reachable", sink.describe()),
            Err(e) => {
                failed = true;
                outln!("problem: sink {}: {}", sink.describe(), e.report());
            }
        },
        // Said above: only the operator can fix it.
        Err(e) if crate::error::is_config_error(&e) => failed = true,
        Err(e) => {
            failed = true;
            outln!("problem: {e:#}");
        }
    }
    Ok(if misconfigured {
        ExitCode::from(crate::error::EXIT_BAD_CONFIGURATION)
    } else if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// What `check` found of the database.
enum DatabaseCheck {
    /// It could not connect (said); `misconfigured`: because of a setting (an unknown
    /// database or role), not an outage.
    Unreachable { misconfigured: bool },
    /// It connected; `problems`: something fails the check (said); `misconfigured`: among
    /// them a schema version only `migrate` or an upgrade fixes.
    Checked { problems: bool, misconfigured: bool },
}

/// `check`'s look at the database: the connection, the schema's versions, the tables,
/// trigger and privileges, each said as it is found.
async fn check_database(config: &Config) -> anyhow::Result<DatabaseCheck> {
    let mut failed = false;
    let mut store = AnyStore::open(config.store_settings()?)?;
    store.keep_legacy_slot().await;
    let outbox = store.outbox();
    match outbox.ping().await {
        Ok(()) => outln!(
            "ok: connected to {}",
            redact_url(&config.database.database_url)
        ),
        Err(e) => {
            outln!(
                "problem: cannot connect to {}: {}",
                redact_url(&config.database.database_url),
                e.report()
            );
            return Ok(DatabaseCheck::Unreachable {
                misconfigured: crate::error::is_configuration(&e),
            });
        }
    }
    // A schema older or newer than this relay reads is for `migrate` or an upgrade to fix,
    // as every other command exits for it (check said 1, a runtime failure).
    let mut misconfigured = false;
    match store.schema_versions().await {
        Ok(lines) => lines.iter().for_each(|(_, l)| outln!("ok: {l}")),
        Err(e) => {
            failed = true;
            misconfigured = crate::error::is_configuration(&e);
            outln!("problem: {}", e.report());
        }
    }
    let mut verified = store.verify().await;
    if let Ok(problems) = &mut verified {
        problems.extend(store.check_only_problems().await);
    }
    match verified {
        Ok(problems) if problems.is_empty() => outln!("ok: {}", store.verified_objects()),
        Ok(problems) => {
            failed |= problems.iter().any(|p| p.fails_check());
            print_problems(&problems);
        }
        Err(e) => {
            failed = true;
            outln!("problem: {}", e.report());
        }
    }
    Ok(DatabaseCheck::Checked {
        problems: failed,
        misconfigured,
    })
}

pub async fn send(config: Config, mut args: SendArgs) -> anyhow::Result<ExitCode> {
    // A command line holds about 128 KiB: a larger payload comes from a file or stdin.
    let read = match args.payload.as_str() {
        "-" => Some(("standard input", std::io::read_to_string(std::io::stdin()))),
        path if path.starts_with('@') => Some((&path[1..], std::fs::read_to_string(&path[1..]))),
        _ => None,
    };
    if let Some((from, text)) = read {
        args.payload = text.map_err(|e| {
            crate::error::config_error(format!(
                "cannot read the payload from {from}: {e} (it must be UTF-8 JSON text)"
            ))
        })?;
    }
    // Given twice, a header's first value was dropped without a word.
    let mut names = std::collections::HashSet::new();
    if let Some((name, _)) = args.headers.iter().find(|(name, _)| !names.insert(name)) {
        return Err(crate::error::config_error(format!(
            "header {name:?} is given more than once: give each header once"
        )));
    }
    if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(&args.payload) {
        return Err(crate::error::config_error(format!(
            "the payload is not valid JSON ({e}); quote text as JSON, e.g. '\"hello\"', or send an object like '{{\"id\": 1}}'"
        )));
    }
    // A new SQLite file is made, as `run` makes one (send first, run later); but from another
    // directory than the relay's it went unnoticed, the event in a file no relay reads.
    let new_file = crate::operator::missing_sqlite_file(&config);
    let store = ready_existing_store(&config).await?;
    let event = NewEvent {
        event_id: args.event_id,
        destination: args.destination,
        partition_key: args.key,
        event_type: args.event_type,
        payload: Some(args.payload),
        headers: args.headers.into_iter().collect(),
        mutation_id: args.mutation_id,
    };
    let ids = store
        .outbox()
        .insert(vec![event])
        .await
        .map_err(|e| anyhow::anyhow!("insert failed: {}", e.report()))?;
    outln!("inserted event with sequence_id {}", ids[0]);
    if let Some(path) = new_file {
        let shown = std::fs::canonicalize(&path).unwrap_or(path);
        eprintln!(
            "note: made a new SQLite database at {}: a relay publishes this event only if it \
             reads that file (check the working directory, or pass --database-url)",
            shown.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `stats`: backlog, live nodes and partition owners.
pub async fn stats(config: Config, json: bool) -> anyhow::Result<ExitCode> {
    crate::operator::refuse_a_missing_sqlite_file(&config)?;
    let store = ready_existing_store(&config).await?;
    let report = |e: outbox_core::StoreError| anyhow::anyhow!(e.report());
    let BacklogReport {
        backlog,
        destinations,
    } = store.backlog_report().await.map_err(report)?;
    let mut slot = None;
    if let AnyStore::PostgresWal(pg, capture) = &store {
        let status = outbox_wal::slot_status(pg, &capture.slot)
            .await
            .map_err(report)?;
        slot = Some((capture.slot.clone(), status));
    }
    let nodes = store.registry().live_nodes().await.map_err(report)?;
    let partitions = match store.partition_registry() {
        Some(r) => r.partitions().await.map_err(report)?,
        None => Vec::new(),
    };
    let now = std::time::SystemTime::now();
    let owned_by = |id: &str| -> Vec<i32> {
        partitions
            .iter()
            .filter(|p| p.owner.as_deref() == Some(id) && p.lease_until.is_some_and(|t| t > now))
            .map(|p| p.partition)
            .collect()
    };
    let unowned: Vec<i32> = partitions
        .iter()
        .filter(|p| p.owner.is_none() || p.lease_until.is_none_or(|t| t <= now))
        .map(|p| p.partition)
        .collect();
    if json {
        let value = serde_json::json!({
            "outbox": store.outbox().describe(),
            "backlog": {
                "pending": backlog.pending,
                "retrying": backlog.retrying,
                "dead": backlog.dead,
                "oldest_pending_age_seconds": backlog.oldest_pending_age.map(|d| d.as_secs_f64()),
            },
            "destinations": destinations.iter().map(|d| serde_json::json!({
                "destination": d.destination,
                "pending": d.pending,
                "retrying": d.retrying,
                "dead": d.dead,
                "oldest_pending_age_seconds": d.oldest_pending_age.map(|a| a.as_secs_f64()),
            })).collect::<Vec<_>>(),
            "nodes": nodes.iter().map(|n| serde_json::json!({
                "id": n.id,
                "expiry": outbox_core::time::display_time(n.expiry),
                "partitions": owned_by(&n.id),
            })).collect::<Vec<_>>(),
            "partitions": partitions.len(),
            "unowned_partitions": unowned,
            "slot": slot.as_ref().map(|(name, status)| serde_json::json!({
                "name": name,
                "exists": status.is_some(),
                "active": status.as_ref().map(|s| s.active),
                "wal_status": status.as_ref().and_then(|s| s.wal_status.clone()),
                "retained_bytes": status.as_ref().and_then(|s| s.retained_bytes),
                "lag_bytes": status.as_ref().and_then(|s| s.lag_bytes),
            })),
        });
        outln!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(ExitCode::SUCCESS);
    }
    let age = backlog
        .oldest_pending_age
        .map(|d| {
            format!(
                ", oldest {}",
                humantime::format_duration(Duration::from_millis(d.as_millis() as u64))
            )
        })
        .unwrap_or_default();
    outln!(
        "{}: {} pending{age}, {} retrying, {} dead",
        store.outbox().describe(),
        backlog.pending,
        backlog.retrying,
        backlog.dead
    );
    if !destinations.is_empty() {
        outln!(
            "  {:<32} {:>9} {:>9} {:>7}  oldest pending",
            "destination",
            "pending",
            "retrying",
            "dead"
        );
        for d in &destinations {
            let oldest = d
                .oldest_pending_age
                .map(|a| humantime::format_duration(Duration::from_secs(a.as_secs())).to_string())
                .unwrap_or_else(|| "-".into());
            outln!(
                "  {:<32} {:>9} {:>9} {:>7}  {oldest}",
                // Untrusted text: no forged row, no escape sequence to the terminal.
                outbox_core::redact::escape_controls(&d.destination),
                d.pending,
                d.retrying,
                d.dead
            );
        }
    }
    if let Some((name, status)) = &slot {
        let mib = |b: Option<i64>| b.map_or("-".into(), |b| format!("{} MiB", b / (1024 * 1024)));
        match status {
            Some(s) => outln!(
                "replication slot {name}: {}, wal_status {}, retains {}, lag {}",
                if s.active {
                    "streaming"
                } else {
                    "no relay streams from it"
                },
                s.wal_status.as_deref().unwrap_or("-"),
                mib(s.retained_bytes),
                mib(s.lag_bytes)
            ),
            None => outln!(
                "replication slot {name}: not created yet (the relay's first run creates it)"
            ),
        }
    }
    if !config.database.uses_nodes_table() {
        // "0 live" read as no relay running while one was active.
        outln!(
            "nodes: none kept (the {} layout has no nodes table here: one relay at a time \
             holds the table's lock and relays it, the others wait as its standbys)",
            config.database.layout
        );
    } else {
        outln!("nodes ({} live):", nodes.len());
    }
    for n in &nodes {
        let left = n.expiry.duration_since(now).unwrap_or_default();
        let owned = owned_by(&n.id);
        let owned_text = if partitions.is_empty() {
            String::new()
        } else {
            format!("  partitions {} ({})", ranges(&owned), owned.len())
        };
        outln!(
            "  {}  heartbeat due within {}{owned_text}",
            outbox_core::redact::escape_controls(&n.id),
            humantime::format_duration(Duration::from_secs(left.as_secs()))
        );
    }
    if !partitions.is_empty() {
        outln!(
            "unowned partitions: {}",
            if unowned.is_empty() {
                "none".to_string()
            } else {
                ranges(&unowned)
            }
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `0-3,7,9-10` for a sorted list.
fn ranges(values: &[i32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < values.len() {
        let start = values[i];
        let mut end = start;
        while i + 1 < values.len() && values[i + 1] == end + 1 {
            i += 1;
            end = values[i];
        }
        out.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    if out.is_empty() {
        "none".into()
    } else {
        out.join(",")
    }
}
