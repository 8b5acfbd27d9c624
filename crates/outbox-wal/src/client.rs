//! The replication client: one logical replication session ([`crate::replication`]) feeding
//! the assembler, with a confirmed position that only the caller advances.

use std::time::Duration;

use crate::assemble::{AssembleError, Assembler, Output};
use crate::emit::emit_prefix;
use crate::lsn::Lsn;
use crate::replication::{
    ConnectOptions, Connection, ConnectionError, Endpoint, ReplicationStream, StreamMessage,
    SLOT_IN_USE,
};
use crate::table::SourceTable;
use outbox_core::ident::TableName;

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

/// [`WalConfig::outbox_tag`] of a capture of `source` whose messages carry `message_prefix`.
pub(crate) fn outbox_tag(source: &TableName, message_prefix: &str) -> String {
    let outbox = format!("{source}|{message_prefix}");
    format!("ob_{:08x}", crate::settings::stable_hash(&outbox))
}

impl WalConfig {
    /// The outbox this capture streams, as a tag in its sessions' `application_name`
    /// (`ob_` and 8 hex digits, of the captured table and the message prefix): a standby
    /// that finds the slot held by a session of another outbox's tag says so, since two
    /// outboxes cannot share a slot (the holder confirms past the other's messages).
    pub fn outbox_tag(&self) -> String {
        outbox_tag(&self.source.name, &self.message_prefix)
    }

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
    Connection(#[from] ConnectionError),
    #[error(transparent)]
    Stream(#[from] AssembleError),
}

impl WalError {
    /// Whether a new session may succeed where this one failed
    /// ([`ConnectionError::is_retryable`]). Not a configuration, slot or stream problem: the
    /// same answer, or the same bytes, would come again.
    pub fn is_retryable(&self) -> bool {
        match self {
            WalError::Connection(e) => e.is_retryable(),
            WalError::Config(_)
            | WalError::Slot { .. }
            | WalError::MissingPublication(_)
            | WalError::Stream(_) => false,
        }
    }

    /// The slot is held by another session: another relay is the active consumer.
    pub fn is_slot_in_use(&self) -> bool {
        matches!(self, WalError::Connection(e) if e.sqlstate() == Some(SLOT_IN_USE))
    }
}

/// Which WAL a server writes (`IDENTIFY_SYSTEM`): its cluster's system identifier and its
/// timeline. A position means the same transaction only within one history: a promoted
/// standby goes on on a new timeline, and writes other transactions at positions the old
/// primary used past the switch; a restored backup does the same; another cluster (an
/// upgrade, another server behind the same address) shares nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct History {
    pub system: u64,
    pub timeline: u32,
}

/// The slot as the session found it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotState {
    /// Whether this session created the slot.
    pub created: bool,
    /// The server's history, as the session started.
    pub history: History,
    /// Where the server's WAL was flushed to as the session started: everything it sent
    /// before is there after a crash (it sends only flushed WAL), so a server whose WAL ends
    /// before what was read from it was rolled back (a disk snapshot, `pg_resetwal`).
    pub flushed: Lsn,
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
///   last confirmed position, from within [`next`](Self::next); a caller that stops
///   reading for a while calls [`keep_alive`](Self::keep_alive) meanwhile.
/// - [`next`](Self::next) is cancel-safe.
/// - The session holds the slot (an active slot has one consumer); dropping or
///   [`stop`](Self::stop)ping it releases the slot for a standby.
pub struct WalStream {
    stream: ReplicationStream,
    assembler: Assembler,
    slot: SlotState,
    stop_at: Option<Lsn>,
}

impl WalStream {
    /// Connects in replication mode, creates the slot if it is missing, checks the
    /// publication, and starts replication from the slot's confirmed position.
    pub async fn start(config: &WalConfig) -> Result<Self, WalError> {
        check_name(&config.slot, "slot")?;
        check_name(&config.publication, "publication")?;
        let mut connection = connect_to_primary(&connect_options(config)?).await?;
        let publication = connection
            .simple_query(&format!(
                "SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = '{}'",
                config.publication
            ))
            .await?;
        if publication.is_empty() {
            return Err(WalError::MissingPublication(config.publication.clone()));
        }
        let (history, flushed) = identify_system(&mut connection).await?;
        let (created, confirmed_flush) =
            ensure_slot(&mut connection, &config.slot, config.create_slot).await?;
        let slot = SlotState {
            created,
            history,
            flushed,
            confirmed_flush,
        };
        // From the slot's own position, so the first status update never moves it back.
        let stream = connection
            .start_replication(
                &config.slot,
                &config.publication,
                slot.confirmed_flush,
                config.status_interval,
            )
            .await?;
        Ok(WalStream {
            stream,
            assembler: {
                let assembler =
                    Assembler::new(config.source.clone(), config.message_prefix.clone());
                match &config.native_outbox {
                    Some(native) => assembler.also(SourceTable::native(native.clone())),
                    None => assembler,
                }
            },
            slot,
            stop_at: config.stop_at,
        })
    }

    pub fn slot(&self) -> SlotState {
        self.slot
    }

    /// The next output; `Ok(None)` when the stream ended: the server ended it, or `stop_at`
    /// was reached. An error ends the session: start a new one (from the slot's confirmed
    /// position) if [`WalError::is_retryable`].
    pub async fn next(&mut self) -> Result<Option<Output>, WalError> {
        loop {
            let Some(message) = self.stream.recv().await? else {
                return Ok(None);
            };
            let output = match message {
                StreamMessage::Data(data) => {
                    if self
                        .stop_at
                        .is_some_and(|stop| begins_at_or_after(&data, stop))
                    {
                        return Ok(None);
                    }
                    self.assembler.push_bytes(&data)?
                }
                StreamMessage::Keepalive { wal_end } => {
                    if self.stop_at.is_some_and(|stop| wal_end >= stop)
                        && !self.assembler.in_transaction()
                    {
                        return Ok(None);
                    }
                    self.assembler.keepalive(wal_end)
                }
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
        self.stream.confirm(lsn);
    }

    /// Until the next read, the socket wakes this thread only once many bytes have arrived:
    /// for a reader that will not read before a deadline anyway (the burst pace).
    pub fn wake_late(&mut self) {
        self.stream.wake_late();
    }

    /// The next output, read no earlier than `not_before` unless a burst's worth of bytes
    /// waits sooner (the socket's late-wake mark reached): past it, every segment arriving
    /// would wake the thread until the deadline. Cancel-safe.
    pub async fn next_not_before(
        &mut self,
        not_before: Option<tokio::time::Instant>,
    ) -> Result<Option<Output>, WalError> {
        if let Some(at) = not_before {
            tokio::select! {
                () = tokio::time::sleep_until(at) => {}
                () = self.stream.filled_to_mark() => {}
            }
        }
        self.next().await
    }

    /// The last position passed to [`confirm`](Self::confirm) (or the slot's at start).
    pub fn confirmed(&self) -> Lsn {
        self.stream.confirmed()
    }

    /// The last confirmed position the server has been told.
    pub fn reported(&self) -> Lsn {
        self.stream.reported().unwrap_or(self.slot.confirmed_flush)
    }

    /// Reports the confirmed position when due, while the stream is not being read.
    pub async fn keep_alive(&mut self) -> Result<(), WalError> {
        Ok(self.stream.keep_alive().await?)
    }

    pub fn assembler(&self) -> &Assembler {
        &self.assembler
    }

    /// Ends the session: reports the last confirmation, then closes the stream (waiting up
    /// to `wait` for the server to end its side). A confirmation that was not reported is
    /// not lost work, only repeated work: its transactions are sent again to the next
    /// session.
    pub async fn stop(self, wait: Duration) -> Result<(), WalError> {
        Ok(self.stream.finish(wait).await?)
    }
}

/// Whether `data` is a pgoutput Begin of a transaction committing at or after `stop`: the
/// drain ends before it (its final position is the commit's).
fn begins_at_or_after(data: &[u8], stop: Lsn) -> bool {
    data.first() == Some(&b'B')
        && data
            .get(1..9)
            .and_then(|b| b.try_into().ok())
            .is_some_and(|b| Lsn(u64::from_be_bytes(b)) >= stop)
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

fn connect_options(config: &WalConfig) -> Result<ConnectOptions, WalError> {
    // libpq's TLS parameters, which tokio-postgres's parser does not all know, come out
    // first, and mean what they mean to the store's own connections.
    let (url, sslmode, rootcert) = outbox_store_postgres::tls::split_tls_params(&config.url);
    let ca_file = rootcert.or_else(|| config.ca_file.clone());
    let url: tokio_postgres::Config = url
        .parse()
        .map_err(|e| WalError::Config(format!("the database URL cannot be parsed: {e}")))?;
    // libpq's multi-host form: one port for every host, or one each.
    let ports = url.get_ports();
    let mut endpoints: Vec<Endpoint> = url
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| Endpoint {
            host: match host {
                tokio_postgres::config::Host::Tcp(host) => host.clone(),
                #[cfg(unix)]
                tokio_postgres::config::Host::Unix(dir) => dir.to_string_lossy().into_owned(),
            },
            port: ports.get(i).or(ports.first()).copied().unwrap_or(5432),
        })
        .collect();
    if endpoints.is_empty() {
        endpoints.push(Endpoint {
            host: "localhost".into(),
            port: ports.first().copied().unwrap_or(5432),
        });
    }
    let user = url
        .get_user()
        .ok_or_else(|| WalError::Config("the database URL names no user".into()))?;
    let (tls, tls_config) =
        outbox_store_postgres::tls::for_sslmode(sslmode.as_deref(), ca_file.as_deref())
            .map_err(|e| WalError::Config(e.report()))?;
    Ok(ConnectOptions {
        endpoints,
        user: user.to_string(),
        password: url
            .get_password()
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .unwrap_or_default(),
        database: url.get_dbname().unwrap_or(user).to_string(),
        application_name: config.application_name.clone(),
        // Timestamps are parsed from their text: fix the style they are written in. The
        // URL's own `options` (libpq's) follow.
        options: match url.get_options() {
            Some(more) => format!("-c DateStyle=ISO -c TimeZone=UTC {more}"),
            None => "-c DateStyle=ISO -c TimeZone=UTC".into(),
        },
        tls,
        tls_config,
        connect_timeout: url
            .get_connect_timeout()
            .copied()
            .unwrap_or(CONNECT_TIMEOUT),
        channel_binding: url.get_channel_binding(),
    })
}

/// A replication connection to the first of the URL's hosts that is a primary, tried in the
/// URL's order (as libpq's `target_session_attrs=read-write` would): a standby cannot
/// decode, and the relay's own writes go to the primary. With one host, its own error;
/// with several, each host's, retryable unless no host could ever serve.
async fn connect_to_primary(options: &ConnectOptions) -> Result<Connection, ConnectionError> {
    let mut failures = Vec::new();
    for endpoint in &options.endpoints {
        let failure = match Connection::connect(options, endpoint).await {
            Ok(mut connection) => {
                match connection
                    .simple_query("SELECT pg_catalog.pg_is_in_recovery()")
                    .await
                {
                    Ok(rows) if rows.first().and_then(|r| r.first()) == Some(&Some("t".into())) => {
                        ConnectionError::NoPrimary(format!(
                            "{endpoint} is a hot standby (in recovery)"
                        ))
                    }
                    Ok(_) => return Ok(connection),
                    Err(e) => e,
                }
            }
            Err(e) => e,
        };
        failures.push((endpoint, failure));
    }
    if failures.len() == 1 {
        let (_, only) = failures.pop().expect("one failure");
        return Err(only);
    }
    if failures.iter().all(|(_, e)| !e.is_retryable()) {
        let (_, first) = failures.swap_remove(0);
        return Err(first);
    }
    Err(ConnectionError::NoPrimary(
        failures
            .iter()
            .map(|(endpoint, e)| match e {
                ConnectionError::NoPrimary(said) => said.clone(),
                other => format!("{endpoint}: {other}"),
            })
            .collect::<Vec<_>>()
            .join("; "),
    ))
}

/// How long connecting may take unless the URL says (`connect_timeout`).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Why an existing slot cannot serve WAL capture, and the fix, if it cannot: it must be a
/// logical slot of pgoutput (a physical slot has no plugin) in the relay's database. Such a
/// slot is none of the relay's, so `drop-slot` leaves it alone too.
pub(crate) fn unusable_slot(
    slot: &str,
    plugin: Option<&str>,
    in_this_database: bool,
    two_phase: bool,
) -> Option<(String, String)> {
    let elsewhere = "choose another slot name (--slot)".to_string();
    match (plugin, in_this_database) {
        // Such a slot sends a prepared transaction at PREPARE, before anyone knows whether
        // it commits, whatever the client asks: the first PREPARE TRANSACTION in the
        // database (an XA application's) would end every session at it.
        (Some(_), true) if two_phase => Some((
            "it decodes prepared transactions at PREPARE (it was made with two_phase = \
             true), which the relay does not read"
                .into(),
            format!(
                "drop it (SELECT pg_drop_replication_slot('{slot}')) and let the relay make it, \
                 or make it with SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')"
            ),
        )),
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
    two_phase: bool,
    confirmed_flush: Option<String>,
    wal_status: Option<String>,
}

/// The slot named `slot`, if there is one.
async fn read_slot(connection: &mut Connection, slot: &str) -> Result<Option<SlotRow>, WalError> {
    let rows = connection
        .simple_query(&format!(
            "SELECT plugin, database = current_database(), confirmed_flush_lsn::text, wal_status,
                    coalesce((to_jsonb(s) ->> 'two_phase')::bool, false)
               FROM pg_catalog.pg_replication_slots s WHERE slot_name = '{slot}'"
        ))
        .await?;
    Ok(rows.first().map(|row| {
        let text = |i: usize| row.get(i).cloned().flatten();
        SlotRow {
            plugin: text(0),
            in_this_database: text(1).as_deref() == Some("t"),
            confirmed_flush: text(2),
            wal_status: text(3),
            two_phase: text(4).as_deref() == Some("t"),
        }
    }))
}

/// The server's [`History`], and the position its WAL is flushed to: `IDENTIFY_SYSTEM`'s
/// first three columns.
async fn identify_system(client: &mut Connection) -> Result<(History, Lsn), WalError> {
    let rows = client.simple_query("IDENTIFY_SYSTEM").await?;
    history_of(rows.first().map(Vec::as_slice).unwrap_or_default())
}

fn history_of(row: &[Option<String>]) -> Result<(History, Lsn), WalError> {
    let column = |n: usize| row.get(n).cloned().flatten().unwrap_or_default();
    let (system, timeline, flushed) = (column(0), column(1), column(2));
    match (system.parse(), timeline.parse(), flushed.parse()) {
        (Ok(system), Ok(timeline), Ok(flushed)) => Ok((History { system, timeline }, flushed)),
        _ => Err(WalError::Config(format!(
            "the server answered IDENTIFY_SYSTEM with system {system:?}, timeline {timeline:?} \
             and position {flushed:?}: is it PostgreSQL?"
        ))),
    }
}

/// Reads the slot, creating it (pgoutput) when missing and `create` allows: whether this
/// session created it, and its confirmed position.
async fn ensure_slot(
    client: &mut Connection,
    slot: &str,
    create: bool,
) -> Result<(bool, Lsn), WalError> {
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
            Err(e) if e.sqlstate() == Some("42710") => {}
            Err(e) => return Err(e.into()),
        }
        found = read_slot(client, slot).await?;
    }
    let row = found.ok_or_else(|| slot_error("it vanished right after it was created".into()))?;
    if let Some((cause, fix)) = unusable_slot(
        slot,
        row.plugin.as_deref(),
        row.in_this_database,
        row.two_phase,
    ) {
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
    Ok((created, confirmed_flush))
}

/// How long [`drop_slot`] waits between tries while a session streams from the slot.
const DROP_RETRY: Duration = Duration::from_secs(1);

/// Drops the configured slot, waiting for an active consumer to release it first: tried
/// again every second, `waiting` told the server's reason once. Returns whether a slot was
/// dropped. Over the replication protocol, so it needs the same role and connection
/// settings as the stream.
///
/// Not `DROP_REPLICATION_SLOT ... WAIT`: the server goes on waiting after the command is cut
/// short (Ctrl-C, a timeout, a closed terminal), and dropped the slot under the next relay
/// that streamed from it, losing the `outbox_emit` events written meanwhile.
pub async fn drop_slot(
    config: &WalConfig,
    mut waiting: impl FnMut(&str),
) -> Result<bool, WalError> {
    check_name(&config.slot, "slot")?;
    let mut client = connect_to_primary(&connect_options(config)?).await?;
    let slot = &config.slot;
    let Some(row) = read_slot(&mut client, slot).await? else {
        return Ok(false);
    };
    // Only a slot the relay could have made: a replica's physical slot, or another tool's,
    // is not dropped (nor waited for, as WAIT would) on the relay's word.
    // A two_phase slot of pgoutput in this database is the relay's to drop: its fix.
    if let Some((cause, fix)) =
        unusable_slot(slot, row.plugin.as_deref(), row.in_this_database, false)
    {
        return Err(WalError::Slot {
            slot: slot.clone(),
            reason: format!("{cause}, so it is not this relay's and is left alone: {fix}"),
        });
    }
    let mut said = false;
    loop {
        match client
            .simple_query(&format!("DROP_REPLICATION_SLOT {slot}"))
            .await
        {
            Ok(_) => return Ok(true),
            // undefined_object: there is no such slot.
            Err(e) if e.sqlstate() == Some("42704") => return Ok(false),
            // object_in_use: a session streams from it.
            Err(e) if e.sqlstate() == Some("55006") => {
                if !said {
                    waiting(&e.to_string());
                    said = true;
                }
                tokio::time::sleep(DROP_RETRY).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(code: &str) -> WalError {
        WalError::Connection(ConnectionError::Server {
            code: code.into(),
            message: "m".into(),
        })
    }

    #[test]
    fn identify_systems_answer_gives_the_servers_history() {
        let row = |system: &str, timeline: &str| {
            [system, timeline, "0/16B3748", "shop"].map(|c| Some(c.to_string()))
        };
        let (history, flushed) = history_of(&row("7411502239340123456", "3")).unwrap();
        assert_eq!(
            history,
            History {
                system: 7_411_502_239_340_123_456,
                timeline: 3
            }
        );
        assert_eq!(flushed, "0/16B3748".parse().unwrap());
        let e = history_of(&row("", "x")).unwrap_err().to_string();
        assert!(e.contains("IDENTIFY_SYSTEM"), "{e}");
        assert!(history_of(&[]).is_err(), "no row");
    }

    #[test]
    fn a_busy_slot_or_a_lost_connection_is_retried_a_refusal_is_not() {
        let busy = server("55006");
        assert!(busy.is_retryable() && busy.is_slot_in_use());
        assert!(server("57P03").is_retryable(), "shutting down");
        assert!(server("53300").is_retryable(), "too many clients");
        let denied = server("42501");
        assert!(!denied.is_retryable() && !denied.is_slot_in_use());
        let lost = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert!(WalError::Connection(lost.into()).is_retryable());
        assert!(
            !WalError::Connection(ConnectionError::Tls("bad certificate".into())).is_retryable()
        );
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
    fn the_url_becomes_the_connections_options() {
        let config = WalConfig::new(
            "postgres://relay:p%40ss@db.example:6543/app?sslmode=disable&connect_timeout=3",
            "s",
            "p",
            TableName::new("public", "outbox").unwrap(),
        );
        let options = connect_options(&config).unwrap();
        assert_eq!(options.tls, outbox_store_postgres::tls::TlsUse::Never);
        assert_eq!(
            (
                options.endpoints[0].host.as_str(),
                options.endpoints[0].port,
                options.user.as_str(),
                options.password.as_str(),
                options.database.as_str()
            ),
            ("db.example", 6543, "relay", "p@ss", "app")
        );
        assert_eq!(options.connect_timeout, Duration::from_secs(3));
        assert!(!format!("{config:?}").contains("p%40ss"));
        let tls = |mode: &str| WalConfig {
            url: config.url.replace("disable", mode),
            ..config.clone()
        };
        assert_eq!(
            connect_options(&tls("require")).unwrap().tls,
            outbox_store_postgres::tls::TlsUse::Always
        );
        assert!(connect_options(&tls("sometimes")).is_err());
        assert!(connect_options(&WalConfig {
            url: "not a url".into(),
            ..config
        })
        .is_err());
    }

    #[test]
    fn every_host_of_a_multi_host_url_is_an_endpoint_with_its_port() {
        let endpoints = |url: &str| {
            let config = WalConfig::new(url, "s", "p", TableName::new("public", "o").unwrap());
            connect_options(&config)
                .unwrap()
                .endpoints
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            endpoints("postgres://u@a:1,b:2/db?target_session_attrs=read-write"),
            ["a:1", "b:2"]
        );
        assert_eq!(endpoints("host=a,b port=7 user=u"), ["a:7", "b:7"]);
        assert_eq!(endpoints("postgres://u@/db"), ["localhost:5432"]);
    }

    #[test]
    fn a_drain_ends_before_a_transaction_committing_at_or_after_its_marker() {
        let begin = |final_lsn: u64| {
            let mut data = vec![b'B'];
            data.extend_from_slice(&final_lsn.to_be_bytes());
            data.extend_from_slice(&[0; 12]);
            data
        };
        assert!(!begins_at_or_after(&begin(99), Lsn(100)));
        assert!(begins_at_or_after(&begin(100), Lsn(100)));
        assert!(!begins_at_or_after(b"I", Lsn(0)), "not a Begin");
    }
}
