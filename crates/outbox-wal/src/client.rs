//! The replication client: one logical replication session over `pgwire-replication`,
//! feeding the assembler, with a confirmed position that only the caller advances.

use std::time::Duration;

use outbox_core::ident::TableName;
use pgwire_replication::{PgWireError, ReplicationClient, ReplicationConfig, ReplicationEvent};

use crate::assemble::{AssembleError, Assembler, Output};
use crate::decode::{Begin, Commit, EmittedMessage, LogicalMessage};
use crate::emit::emit_prefix;
use crate::lsn::Lsn;
use crate::table::SourceTable;

/// Where and how to replicate. Its `Debug` leaves the URL out: it may hold a password.
#[derive(Clone)]
pub struct WalConfig {
    /// The database URL (`postgres://user:password@host:port/db?sslmode=...`), the same as the
    /// store's. The role needs the REPLICATION attribute.
    pub url: String,
    /// The logical replication slot: created with pgoutput on first use. 1-63 of `a-z`,
    /// `0-9`, `_` (PostgreSQL's rule for slot names).
    pub slot: String,
    /// The publication of the outbox's INSERTs (`migrate --capture wal` creates it).
    pub publication: String,
    /// The table whose INSERTs are events: the native outbox, or a mapped table.
    pub source: SourceTable,
    /// The native outbox, captured beside a mapped `source`.
    pub native_outbox: Option<TableName>,
    /// The prefix of outbox messages ([`emit_prefix`] of the outbox the emit function
    /// writes for: the native one).
    pub message_prefix: String,
    /// How often the confirmed position is reported when it moved (and at most how long a
    /// confirmation waits to be reported).
    pub status_interval: Duration,
    /// Outputs read ahead of the caller, at most (a count; [`WalConfig::memory_budget`]
    /// bounds their bytes).
    pub read_ahead: usize,
    /// Bytes of events capture may hold, read ahead and in flight together
    /// ([`crate::budget`]).
    pub memory_budget: usize,
    /// End the stream once a transaction that commits at or after this position begins,
    /// or a keepalive reaches it (`run --drain`).
    pub stop_at: Option<Lsn>,
    /// Shown in `pg_stat_replication`.
    pub application_name: String,
    /// Extra CA certificates (PEM) for TLS (`--database-ca-file`); `sslrootcert=` in the URL
    /// wins, as for the store's connections.
    pub ca_file: Option<std::path::PathBuf>,
    /// Create the slot when it is missing (the first run). A relay that already streamed
    /// from it sets this to `false`: a slot that vanished since (dropped by hand) may have
    /// taken events with it, which a new slot would skip without a word.
    pub create_slot: bool,
}

impl WalConfig {
    pub fn new(
        url: impl Into<String>,
        slot: impl Into<String>,
        publication: impl Into<String>,
        outbox_table: TableName,
    ) -> Self {
        WalConfig {
            url: url.into(),
            slot: slot.into(),
            publication: publication.into(),
            message_prefix: emit_prefix(&outbox_table),
            source: SourceTable::native(outbox_table),
            native_outbox: None,
            // A stop waits for the last confirmation to be reported (the client has no way
            // to send it at once): at 1 s, every `run --drain` ended on the next whole
            // second of its session. A status message is 34 bytes; an idle stream sends one
            // per interval too (the client's wake-up interval is this one).
            status_interval: Duration::from_millis(250),
            read_ahead: 8192,
            memory_budget: crate::budget::DEFAULT_MEMORY_BUDGET,
            stop_at: None,
            application_name: "outbox-relay".into(),
            ca_file: None,
            create_slot: true,
        }
    }
}

impl std::fmt::Debug for WalConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WalConfig")
            .field("url", &"(hidden)")
            .field("slot", &self.slot)
            .field("publication", &self.publication)
            .field("source", &self.source.name)
            .field("message_prefix", &self.message_prefix)
            .field("status_interval", &self.status_interval)
            .field("read_ahead", &self.read_ahead)
            .field("memory_budget", &self.memory_budget)
            .field("stop_at", &self.stop_at)
            .field("application_name", &self.application_name)
            .field("ca_file", &self.ca_file)
            .field("create_slot", &self.create_slot)
            .finish()
    }
}

/// Why WAL capture stopped.
#[derive(Debug, thiserror::Error)]
pub enum WalError {
    #[error("WAL capture configuration: {0}")]
    Config(String),
    #[error("replication slot {slot:?} cannot be used: {reason}")]
    Slot { slot: String, reason: String },
    #[error(
        "publication {0:?} does not exist in this database: run `outbox-relay migrate --capture wal`"
    )]
    MissingPublication(String),
    #[error("replication connection: {0}")]
    Connection(#[from] PgWireError),
    #[error(transparent)]
    Stream(#[from] AssembleError),
}

impl WalError {
    /// Whether a new session may succeed where this one failed: a dropped connection, a
    /// server shutting down or out of connections, or a slot held by another consumer (a
    /// standby waits on that). Not a configuration, privilege, slot or stream problem: the
    /// same answer, or the same bytes, would come again.
    pub fn is_retryable(&self) -> bool {
        match self {
            WalError::Connection(PgWireError::Server(message)) => match sqlstate(message) {
                Some(code) => {
                    code == SLOT_IN_USE
                        || ["08", "40", "53", "57", "58"]
                            .iter()
                            .any(|class| code.starts_with(class))
                }
                None => false,
            },
            WalError::Connection(e) => e.is_io() || e.is_transient(),
            WalError::Config(_)
            | WalError::Slot { .. }
            | WalError::MissingPublication(_)
            | WalError::Stream(_) => false,
        }
    }

    /// The slot is held by another session: another relay is the active consumer.
    pub fn is_slot_in_use(&self) -> bool {
        matches!(self, WalError::Connection(PgWireError::Server(message))
            if sqlstate(message) == Some(SLOT_IN_USE))
    }
}

/// object_in_use: PostgreSQL's answer to START_REPLICATION on a slot another session holds.
const SLOT_IN_USE: &str = "55006";

/// The SQLSTATE `pgwire-replication` appends to a server error's text: `... (SQLSTATE 55006)`.
fn sqlstate(message: &str) -> Option<&str> {
    let code = message.strip_suffix(')')?.rsplit_once("(SQLSTATE ")?.1;
    (code.len() == 5).then_some(code)
}

/// The slot as the session found it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotState {
    /// Whether this session created the slot.
    pub created: bool,
    /// Where the stream starts: nothing committed before it is sent.
    pub confirmed_flush: Lsn,
}

/// One replication session.
///
/// Contract:
/// - [`next`](Self::next) yields the assembler's outputs in stream order: events of
///   committed transactions only, in commit order, each transaction closed by
///   [`Output::Committed`].
/// - The slot's confirmed position moves only through [`confirm`](Self::confirm): never by
///   itself, never backwards. Keepalive replies and periodic status updates report the
///   last confirmed position (`pgwire-replication` sends them from its worker task, also
///   while the caller is busy).
/// - The session holds the slot (an active slot has one consumer); dropping or
///   [`stop`](Self::stop)ping it releases the slot for a standby.
pub struct WalStream {
    client: ReplicationClient,
    assembler: Assembler,
    slot: SlotState,
    confirmed: Lsn,
    stop_at: Option<Lsn>,
}

impl WalStream {
    /// Connects in replication mode, creates the slot if it is missing, checks the
    /// publication, and starts replication from the slot's confirmed position.
    pub async fn start(config: &WalConfig) -> Result<Self, WalError> {
        check_name(&config.slot, "slot")?;
        check_name(&config.publication, "publication")?;
        let replication = replication_config(config)?;
        let mut client = ReplicationClient::connect_gated(replication.clone()).await?;
        let publication = client
            .simple_query(&format!(
                "SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = '{}'",
                config.publication
            ))
            .await?;
        if publication.is_empty() {
            return Err(WalError::MissingPublication(config.publication.clone()));
        }
        let slot = ensure_slot(&mut client, &config.slot, config.create_slot).await?;
        // The worker's first status update would otherwise report the start position (0/0
        // means "the slot's"): report the slot's own, so the position never goes back.
        drop(client);
        let replication = replication
            .with_start_lsn(slot.confirmed_flush.into())
            .with_ack_lsn(slot.confirmed_flush.into());
        let mut client = ReplicationClient::connect(replication).await?;
        client.wait_started().await?;
        Ok(WalStream {
            client,
            assembler: {
                let assembler =
                    Assembler::new(config.source.clone(), config.message_prefix.clone());
                match &config.native_outbox {
                    Some(native) => assembler.also(SourceTable::native(native.clone())),
                    None => assembler,
                }
            },
            slot,
            confirmed: slot.confirmed_flush,
            stop_at: config.stop_at,
        })
    }

    pub fn slot(&self) -> SlotState {
        self.slot
    }

    /// The next output; `Ok(None)` when the stream ended: [`stop`](Self::stop) was called,
    /// or `stop_at` was reached. An error ends the session: start a new one (from the
    /// slot's confirmed position) if [`WalError::is_retryable`].
    pub async fn next(&mut self) -> Result<Option<Output>, WalError> {
        loop {
            let Some(event) = self.client.recv().await? else {
                return Ok(None);
            };
            let output = match event {
                ReplicationEvent::XLogData { data, .. } => self.assembler.push_bytes(&data)?,
                // The client decodes these three itself and hands them over parsed.
                ReplicationEvent::Begin {
                    final_lsn,
                    xid,
                    commit_time_micros,
                } => self.assembler.push(LogicalMessage::Begin(Begin {
                    final_lsn: final_lsn.into(),
                    commit_time: commit_time_micros,
                    xid,
                }))?,
                ReplicationEvent::Commit {
                    lsn,
                    end_lsn,
                    commit_time_micros,
                } => self.assembler.push(LogicalMessage::Commit(Commit {
                    flags: 0,
                    commit_lsn: lsn.into(),
                    end_lsn: end_lsn.into(),
                    commit_time: commit_time_micros,
                }))?,
                ReplicationEvent::Message {
                    transactional,
                    lsn,
                    prefix,
                    content,
                } => self
                    .assembler
                    .push(LogicalMessage::Message(EmittedMessage {
                        transactional,
                        lsn: lsn.into(),
                        prefix: &prefix,
                        content: &content,
                    }))?,
                ReplicationEvent::KeepAlive { wal_end, .. } => {
                    let wal_end = Lsn::from(wal_end);
                    if self.stop_at.is_some_and(|stop| wal_end >= stop)
                        && !self.assembler.in_transaction()
                    {
                        self.client.stop();
                    }
                    self.assembler.keepalive(wal_end)
                }
                ReplicationEvent::StoppedAt { .. } => return Ok(None),
                // `ReplicationEvent` may grow: what we do not know is not ours.
                #[allow(unreachable_patterns)]
                _ => None,
            };
            if output.is_some() {
                return Ok(output);
            }
        }
    }

    /// Confirms `lsn` to the slot: the server may drop WAL before it and will never send a
    /// transaction that ended at or before it again. Call it only with a position every
    /// event before which is settled ([`crate::Acknowledgements::confirmable`]). Lower
    /// positions than the last are ignored. Reported within `status_interval`.
    pub fn confirm(&mut self, lsn: Lsn) {
        if lsn > self.confirmed {
            self.confirmed = lsn;
            self.client.update_applied_lsn(lsn.into());
        }
    }

    /// The last position passed to [`confirm`](Self::confirm) (or the slot's at start).
    pub fn confirmed(&self) -> Lsn {
        self.confirmed
    }

    /// The last confirmed position the server has been told.
    pub fn reported(&self) -> Lsn {
        self.client.metrics().last_applied_lsn().into()
    }

    pub fn assembler(&self) -> &Assembler {
        &self.assembler
    }

    /// Ends the session: waits up to `wait` for the last confirmation to be reported, then
    /// closes the stream. A confirmation that was not reported by then is not lost work,
    /// only repeated work: its transactions are sent again to the next session.
    pub async fn stop(mut self, wait: Duration) -> Result<(), WalError> {
        let deadline = tokio::time::Instant::now() + wait;
        // The worker reports on its own schedule and offers no completion signal; a short
        // poll of its counter is the only way to know.
        while self.reported() < self.confirmed && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.client.shutdown().await?;
        Ok(())
    }
}

/// Slot and publication names go into replication commands unquoted (the client writes
/// `START_REPLICATION SLOT <name>` as given), so only PostgreSQL's slot-name characters pass.
fn check_name(name: &str, what: &str) -> Result<(), WalError> {
    let valid = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if valid {
        Ok(())
    } else {
        Err(WalError::Config(format!(
            "invalid {what} name {name:?}: use 1-63 lowercase ASCII letters, digits or underscores"
        )))
    }
}

fn replication_config(config: &WalConfig) -> Result<ReplicationConfig, WalError> {
    // libpq's TLS parameters, which tokio-postgres's parser does not all know, come out
    // first, and mean what they mean to the store's own connections.
    let (url, sslmode, rootcert) = outbox_store_postgres::tls::split_tls_params(&config.url);
    let ca_file = rootcert.or_else(|| config.ca_file.clone());
    let url: tokio_postgres::Config = url
        .parse()
        .map_err(|e| WalError::Config(format!("the database URL cannot be parsed: {e}")))?;
    let host = match url.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(host)) => host.clone(),
        #[cfg(unix)]
        Some(tokio_postgres::config::Host::Unix(dir)) => dir.to_string_lossy().into_owned(),
        None => "localhost".into(),
    };
    let port = url.get_ports().first().copied().unwrap_or(5432);
    let user = url
        .get_user()
        .ok_or_else(|| WalError::Config("the database URL names no user".into()))?;
    let password = url
        .get_password()
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .unwrap_or_default();
    let database = url.get_dbname().unwrap_or(user);
    let tls = tls_config(sslmode.as_deref().unwrap_or("prefer"), ca_file, &host)?;
    let mut replication = ReplicationConfig::new(
        host,
        user,
        password,
        database,
        config.slot.clone(),
        config.publication.as_str(),
    )
    .with_port(port)
    .with_tls(tls)
    .with_status_interval(config.status_interval)
    .with_wakeup_interval(config.status_interval)
    .with_buffer_size(CLIENT_BUFFER)
    .with_application_name(config.application_name.clone())
    // Timestamps are parsed from their text: fix the style they are written in.
    .with_options("-c DateStyle=ISO -c TimeZone=UTC");
    if let Some(stop) = config.stop_at {
        replication = replication.with_stop_lsn(stop.into());
    }
    Ok(replication)
}

/// Replication messages the client parses ahead of the reader. A count, not bytes, so it
/// is kept small: 16 events of 1 MiB beside the memory budget, while a burst of small ones
/// still finds a queue to take at once.
const CLIENT_BUFFER: usize = 16;

/// The replication connection's TLS for a libpq `sslmode`: the same meanings as the store's
/// connections (a CA file makes `require` check the certificate and its name).
fn tls_config(
    sslmode: &str,
    ca_file: Option<std::path::PathBuf>,
    host: &str,
) -> Result<pgwire_replication::TlsConfig, WalError> {
    use pgwire_replication::{SslMode, TlsConfig};
    let tls = match sslmode {
        "disable" | "allow" => return Ok(TlsConfig::disabled()),
        // Without TLS support, "prefer" falls back to what it prefers over failing.
        "prefer" if cfg!(not(feature = "tls")) => return Ok(TlsConfig::disabled()),
        "prefer" => TlsConfig {
            mode: SslMode::Prefer,
            ..TlsConfig::disabled()
        },
        "require" | "verify-ca" | "verify-full" if cfg!(not(feature = "tls")) => {
            return Err(WalError::Config(
                "the database URL asks for TLS, and this build of WAL capture has none: \
                 build outbox-wal with its `tls` feature"
                    .into(),
            ))
        }
        "require" if ca_file.is_none() => TlsConfig::require(),
        "require" | "verify-full" => TlsConfig::verify_full(ca_file),
        "verify-ca" => TlsConfig::verify_ca(ca_file),
        other => {
            return Err(WalError::Config(format!(
                "invalid sslmode {other:?}: use disable, prefer, require, verify-ca or verify-full"
            )))
        }
    };
    Ok(tls.with_sni_hostname(host))
}

/// Why an existing slot cannot serve WAL capture, and the fix, if it cannot: it must be a
/// logical slot of pgoutput (a physical slot has no plugin) in the relay's database. Such a
/// slot is none of the relay's, so `drop-slot` leaves it alone too.
pub(crate) fn unusable_slot(
    slot: &str,
    plugin: Option<&str>,
    in_this_database: bool,
) -> Option<(String, String)> {
    let elsewhere = "choose another slot name (--slot)".to_string();
    match (plugin, in_this_database) {
        // A replica may stream from it: never suggest dropping it.
        (None, _) => Some((
            "it is a physical replication slot (a replica's?)".into(),
            elsewhere,
        )),
        (Some(plugin), _) if plugin != "pgoutput" => Some((
            format!("it uses the plugin {plugin:?}, not pgoutput"),
            format!(
                "{elsewhere}, or drop it if nothing reads it any more \
                 (SELECT pg_drop_replication_slot('{slot}'))"
            ),
        )),
        (_, false) => Some(("it belongs to another database".into(), elsewhere)),
        _ => None,
    }
}

/// A slot as the replication connection reads it from `pg_replication_slots`.
struct SlotRow {
    plugin: Option<String>,
    in_this_database: bool,
    confirmed_flush: Option<String>,
    wal_status: Option<String>,
}

/// The slot named `slot`, if there is one.
async fn read_slot(
    client: &mut ReplicationClient,
    slot: &str,
) -> Result<Option<SlotRow>, WalError> {
    let rows = client
        .simple_query(&format!(
            "SELECT plugin, database = current_database(), confirmed_flush_lsn::text, wal_status
               FROM pg_catalog.pg_replication_slots WHERE slot_name = '{slot}'"
        ))
        .await?;
    Ok(rows.first().map(|row| {
        let text = |i: usize| {
            row.get(i)
                .and_then(|v| v.as_ref())
                .map(|v| String::from_utf8_lossy(v).into_owned())
        };
        SlotRow {
            plugin: text(0),
            in_this_database: text(1).as_deref() == Some("t"),
            confirmed_flush: text(2),
            wal_status: text(3),
        }
    }))
}

/// Reads the slot, creating it (pgoutput) when missing and `create` allows.
async fn ensure_slot(
    client: &mut ReplicationClient,
    slot: &str,
    create: bool,
) -> Result<SlotState, WalError> {
    let slot_error = |reason: String| WalError::Slot {
        slot: slot.to_string(),
        reason,
    };
    let mut created = false;
    let mut found = read_slot(client, slot).await?;
    if found.is_none() && !create {
        return Err(slot_error(
            "it no longer exists (dropped while this relay streamed from it); events committed \
             after its last confirmed position may not have been relayed: check them, then \
             restart the relay, which creates the slot anew"
                .into(),
        ));
    }
    if found.is_none() {
        let create = format!("CREATE_REPLICATION_SLOT {slot} LOGICAL pgoutput NOEXPORT_SNAPSHOT");
        match client.simple_query(&create).await {
            Ok(_) => created = true,
            // Another relay created it meanwhile (duplicate_object): use theirs.
            Err(PgWireError::Server(message)) if sqlstate(&message) == Some("42710") => {}
            Err(e) => return Err(e.into()),
        }
        found = read_slot(client, slot).await?;
    }
    let row = found.ok_or_else(|| slot_error("it vanished right after it was created".into()))?;
    if let Some((cause, fix)) = unusable_slot(slot, row.plugin.as_deref(), row.in_this_database) {
        return Err(slot_error(format!("{cause}: {fix}")));
    }
    if row.wal_status.as_deref() == Some("lost") {
        return Err(slot_error(
            "it is invalidated (wal_status = lost: the WAL it needed was removed, see \
             max_slot_wal_keep_size); events written since it fell behind cannot be read \
             from the WAL: drop the slot and recover them from the application"
                .into(),
        ));
    }
    let confirmed_flush = row
        .confirmed_flush
        .ok_or_else(|| slot_error("it has no confirmed position".into()))?
        .parse()
        .map_err(|e| slot_error(format!("{e}")))?;
    Ok(SlotState {
        created,
        confirmed_flush,
    })
}

/// Drops the configured slot, waiting for an active consumer to release it first
/// (`DROP_REPLICATION_SLOT ... WAIT`). Returns whether a slot was dropped. Over the
/// replication protocol, so it needs the same role and connection settings as the stream.
pub async fn drop_slot(config: &WalConfig) -> Result<bool, WalError> {
    check_name(&config.slot, "slot")?;
    let mut client = ReplicationClient::connect_gated(replication_config(config)?).await?;
    let slot = &config.slot;
    let Some(row) = read_slot(&mut client, slot).await? else {
        return Ok(false);
    };
    // Only a slot the relay could have made: a replica's physical slot, or another tool's,
    // is not dropped (nor waited for, as WAIT would) on the relay's word.
    if let Some((cause, fix)) = unusable_slot(slot, row.plugin.as_deref(), row.in_this_database) {
        return Err(WalError::Slot {
            slot: slot.clone(),
            reason: format!("{cause}, so it is not this relay's and is left alone: {fix}"),
        });
    }
    match client
        .simple_query(&format!("DROP_REPLICATION_SLOT {slot} WAIT"))
        .await
    {
        Ok(_) => Ok(true),
        // undefined_object: there is no such slot.
        Err(PgWireError::Server(message)) if sqlstate(&message) == Some("42704") => Ok(false),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(message: &str) -> WalError {
        WalError::Connection(PgWireError::Server(message.into()))
    }

    #[test]
    fn a_busy_slot_or_a_lost_connection_is_retried_a_refusal_is_not() {
        let busy = server("replication slot \"s\" is active for PID 7 (SQLSTATE 55006)");
        assert!(busy.is_retryable() && busy.is_slot_in_use());
        assert!(server("the database system is shutting down (SQLSTATE 57P03)").is_retryable());
        assert!(server("sorry, too many clients already (SQLSTATE 53300)").is_retryable());
        let denied = server("permission denied to start WAL sender (SQLSTATE 42501)");
        assert!(!denied.is_retryable() && !denied.is_slot_in_use());
        assert!(!server("no code").is_retryable());
        assert!(!WalError::Config("x".into()).is_retryable());
    }

    #[test]
    fn names_going_into_replication_commands_are_checked() {
        assert!(check_name("outbox_relay_1", "slot").is_ok());
        for bad in ["", "Upper", "a-b", "a b", "x'; DROP", &"a".repeat(64)] {
            assert!(check_name(bad, "slot").is_err(), "{bad}");
        }
    }

    #[test]
    fn the_url_becomes_a_replication_config() {
        let mut config = WalConfig::new(
            "postgres://relay:p%40ss@db.example:6543/app?sslmode=disable",
            "s",
            "p",
            TableName::new("public", "outbox").unwrap(),
        );
        config.stop_at = Some(Lsn(5));
        let replication = replication_config(&config).unwrap();
        assert!(!replication.tls.mode.requires_tls());
        assert_eq!(
            (
                replication.host.as_str(),
                replication.port,
                replication.user.as_str(),
                replication.password.as_str(),
                replication.database.as_str()
            ),
            ("db.example", 6543, "relay", "p@ss", "app")
        );
        assert_eq!(
            replication.stop_at_lsn,
            Some(pgwire_replication::Lsn::from_u64(5))
        );
        assert!(!format!("{config:?}").contains("p%40ss"));
        let tls = WalConfig {
            url: config.url.replace("disable", "require"),
            ..config.clone()
        };
        if cfg!(feature = "tls") {
            assert!(replication_config(&tls).unwrap().tls.mode.requires_tls());
        } else {
            assert!(replication_config(&tls).is_err());
        }
        assert!(replication_config(&WalConfig {
            url: "not a url".into(),
            ..config
        })
        .is_err());
    }
}
