//! The replication session's task: starts sessions (waiting as a standby while another
//! relay holds the slot), adopts the rows that predate the slot, checks the publication and
//! the database's answer while streaming, and forwards outputs to claims and confirmations
//! to the server.

use super::mark::ConfirmMark;
use super::*;

/// How long the adoption of the rows that predate a slot may take: it moves the whole
/// backlog in one transaction, which the store's 30 s bound for one operation cut off, every
/// time it was tried, once the table held a few million rows.
const ADOPTION_TIMEOUT: Duration = Duration::from_secs(15 * 60);
/// The replication session's task: starts sessions (waiting as a standby while another
/// relay holds the slot), forwards outputs to claims and confirmations to the server.
pub(super) struct Reader {
    pub(super) config: WalConfig,
    /// The current session's `application_name`: the configured one and a token of its own.
    pub(super) session_name: String,
    pub(super) tables: CaptureTables,
    pub(super) publication: outbox_core::ident::Ident,
    pub(super) main: PgStore,
    pub(super) sql: CaptureStatements,
    pub(super) drain: bool,
    pub(super) tx: mpsc::Sender<Item>,
    pub(super) confirm: watch::Receiver<Confirmable>,
    pub(super) close: watch::Receiver<bool>,
    pub(super) status: watch::Sender<CaptureStatus>,
    pub(super) on_change: Arc<Mutex<Option<OnChange>>>,
    pub(super) dead_letters: Arc<CaptureDeadLetters>,
    /// Charged for every output read; the stream is read only while it has room.
    pub(super) memory: Arc<MemoryBudget>,
    pub(super) sessions: Sessions,
    /// Told which session streams, for claims ([`LiveSession`]).
    pub(super) live: Arc<LiveSession>,
    /// Why the slot is confirmed no further while the relay runs on, for `/readyz` (the
    /// store's ping); `None` while it is confirmed as its settled events allow.
    pub(super) confirm_stall: Arc<Mutex<Option<String>>>,
    /// Told what the server was last told ([`ToldServer`]), for the settled positions.
    pub(super) told: Arc<ToldServer>,
}

/// What the reader remembers from one session to the next.
pub(super) struct Sessions {
    /// Sessions started so far: the next one's number is announced to claims, which drop
    /// what an earlier one left queued.
    pub(super) started: u64,
    /// A session has streamed: a slot missing now was dropped by hand, and may have taken
    /// events with it, so it is not created again (see [`WalConfig::create_slot`]).
    pub(super) streamed: bool,
    /// `run --drain` wrote its end marker (once: the drain ends at the first one).
    pub(super) drain_marker_written: bool,
    pub(super) backoff: Backoff,
    /// The publication's catalog rows as last checked, by their ids and row versions
    /// ([`CaptureStatements::publication_version`]): any change moves them, even one undone
    /// before the next check, which pgoutput applies to the WAL in between all the same.
    /// (Behind a lock: the check runs inside the stream's `select!`, which borrows the
    /// reader.)
    pub(super) publication_version: std::sync::Mutex<Option<String>>,
    /// The slot's `catalog_xmin` at the last look for stranded rows
    /// ([`Reader::stranded_rows`]): they are looked for again only once it moved.
    pub(super) stranded_checked_at: std::sync::Mutex<Option<String>>,
    /// The slot's confirm mark: nothing is confirmed past it ([`ConfirmMark`]).
    pub(super) mark: std::sync::Mutex<ConfirmMark>,
    /// The server's history as the last session found it, and how many times it changed
    /// ([`Confirmable`]).
    pub(super) history: Option<crate::History>,
    pub(super) histories: u64,
    /// The furthest position read on this history (a transaction's end, a keepalive's).
    pub(super) read_to: std::sync::atomic::AtomicU64,
}

impl Sessions {
    /// A session started on a server of `history`, whose WAL is flushed to `flushed`:
    /// whether it is another history than the last session's (which confirmations and
    /// settled positions of before do not apply to). A server whose WAL ends before what
    /// was read from it was rolled back (a disk snapshot, a backup restored without a new
    /// timeline, `pg_resetwal`): its positions name other transactions too.
    pub(super) fn history_changed(&mut self, history: crate::History, flushed: Lsn) -> bool {
        let read_to = Lsn(self.read_to.load(std::sync::atomic::Ordering::Relaxed));
        let changed = self
            .history
            .is_some_and(|last| last != history || flushed < read_to);
        if changed {
            self.histories += 1;
            self.read_to.store(0, std::sync::atomic::Ordering::Relaxed);
            // The mark last read or raised was the other history's.
            *self.mark.lock().unwrap_or_else(|e| e.into_inner()) = ConfirmMark::default();
        }
        self.history = Some(history);
        changed
    }

    /// The server's WAL was found rolled back once the session had started (its confirm
    /// mark went back): another history from here, as [`Sessions::history_changed`] finds
    /// it at the start.
    pub(super) fn wal_rolled_back(&mut self) {
        self.histories += 1;
        self.read_to.store(0, std::sync::atomic::Ordering::Relaxed);
    }

    /// Positions up to `to` were read.
    fn read(&self, to: Lsn) {
        self.read_to
            .fetch_max(to.0, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Sessions {
    pub(super) fn new() -> Self {
        Sessions {
            started: 0,
            streamed: false,
            drain_marker_written: false,
            backoff: Backoff::new(Duration::from_millis(200), Duration::from_secs(5)),
            publication_version: std::sync::Mutex::new(None),
            stranded_checked_at: std::sync::Mutex::new(None),
            mark: std::sync::Mutex::new(ConfirmMark::default()),
            history: None,
            histories: 0,
            read_to: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

/// What `<outbox>_adopted` says of a slot.
enum Adopted {
    /// No adoption recorded: the next session adopts.
    No,
    /// Adopted, at this version of the publication (`None`: recorded by a relay from before
    /// versions were kept).
    At(Option<String>),
}

/// A failure of the confirm mark's statements that no retry mends: its table or a
/// privilege on it is missing.
fn cannot_be_kept(e: &StoreError) -> bool {
    matches!(
        e.kind(),
        StoreErrorKind::Privilege | StoreErrorKind::MissingSchema
    )
}

/// How a session's adoption check ended.
pub(super) enum AdoptCheck {
    /// The slot's rows are adopted (now, or before and the slot not moved since); `mark`:
    /// the slot's confirm mark as read before; `start`: the slot's confirmed position.
    Adopted { mark: Option<Lsn>, start: Lsn },
    /// This session no longer holds the slot, and adopted nothing.
    SlotLost,
}

/// How a session ended.
pub(super) enum SessionEnd {
    Closed,
    Broken(String),
    /// It cannot go on until an operator acts (the reason says how).
    Failed(String),
}

/// Why a session did not start: its SQL preparation, or the replication connection.
enum StartError {
    Forget(String),
    Stream(WalError),
}

impl Reader {
    pub(super) async fn run(mut self) {
        loop {
            if *self.close.borrow() {
                return;
            }
            let mut config = self.config.clone();
            config.create_slot = !self.sessions.streamed;
            self.session_name =
                session_name(&self.config.application_name, &self.config.outbox_tag());
            config.application_name = self.session_name.clone();
            let forgotten = match config.create_slot {
                true => self.forget_adoption_of_missing_slot().await,
                false => Ok(()),
            };
            let started = match forgotten {
                Err(reason) => Err(StartError::Forget(reason)),
                Ok(()) => {
                    let start = WalStream::start(&config);
                    tokio::pin!(start);
                    let patience = tokio::time::sleep(SESSION_START_PATIENCE);
                    tokio::pin!(patience);
                    let mut said = false;
                    loop {
                        tokio::select! {
                            started = &mut start => break started.map_err(StartError::Stream),
                            _ = self.close.changed() => return,
                            () = &mut patience, if !said => {
                                said = true;
                                self.starting_slowly(&config).await;
                            }
                        }
                    }
                }
            };
            let wait = match started {
                Ok(mut stream) => {
                    let (history, flushed) = (stream.slot().history, stream.slot().flushed);
                    if self.sessions.history_changed(history, flushed) {
                        self.told.reset();
                        tracing::warn!(system = history.system, timeline = history.timeline, %flushed, "the server's history changed (another system, a new timeline, or WAL ending before what was read from it: a promoted standby, a restored backup or disk snapshot): what was confirmed and settled before is not taken for this history's, and events read again are sent again");
                    }
                    self.sessions.streamed = true;
                    self.sessions.backoff.reset();
                    self.sessions.started += 1;
                    let end = self.stream(&mut stream).await;
                    self.live.set(0);
                    match end {
                        SessionEnd::Closed => {
                            self.confirm_up_to_mark(&mut stream, true, true).await;
                            if let Err(e) = stream.stop(Duration::from_secs(5)).await {
                                tracing::debug!(error = %e, "closing the replication session");
                            }
                            return;
                        }
                        SessionEnd::Broken(reason) => {
                            tracing::warn!(error = %reason, "the replication session broke; starting a new one from the slot's confirmed position");
                            self.set_status(CaptureStatus::Reconnecting(reason));
                            self.sessions.backoff.next_delay()
                        }
                        SessionEnd::Failed(reason) => self.failed(reason),
                    }
                }
                Err(StartError::Forget(reason)) => self.cannot_start(reason),
                Err(StartError::Stream(e)) if e.is_slot_in_use() => {
                    let holder = self.slot_holder().await;
                    if let SlotHolder::AnotherOutbox(holder) = holder {
                        self.failed(format!(
                            "the replication slot {:?} streams to a relay of another outbox (its \
                             session is {holder:?}): two outboxes cannot share a slot, since the \
                             relay holding it confirms past the other's events; give this outbox \
                             a slot of its own (--slot, or the default, named after the outbox)",
                            config.slot
                        ))
                    } else if let SlotHolder::NoRelay(holder) = holder {
                        // Waiting as a standby would relay nothing, for as long as that client
                        // runs, while every relay called itself ready.
                        self.failed(format!(
                            "the replication slot {:?} streams to a client that is no relay \
                             (its session is {holder:?}: pg_recvlogical, a Debezium connector?), \
                             which consumes the outbox's changes: stop that client, or give the \
                             relay a slot of its own (--slot)",
                            config.slot
                        ))
                    } else {
                        if *self.status.borrow() != CaptureStatus::Standby {
                            if self.drain {
                                // Its count of rows left, at the end, would not say why.
                                tracing::warn!(slot = %config.slot, "waiting as a standby: another relay streams from the slot, so this drain delivers nothing unless that relay stops; stop it to drain here, or leave the draining to it");
                            } else {
                                tracing::info!(slot = %config.slot, "another relay streams from the slot; waiting as a standby");
                            }
                        }
                        self.set_status(CaptureStatus::Standby);
                        if !self.stand_by_while_a_relay_streams().await {
                            return;
                        }
                        Duration::ZERO
                    }
                }
                Err(StartError::Stream(e)) if e.is_retryable() => self.cannot_start(describe(&e)),
                Err(StartError::Stream(e)) => self.failed(describe(&e)),
            };
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                _ = self.close.changed() => return,
            }
        }
    }

    /// Before a session that may create the slot: an adoption recorded for a slot of this
    /// name that no longer exists (dropped with SQL, or the record copied to a promoted
    /// standby, which has no slot) is forgotten, so that the slot created next adopts the
    /// rows its stream will not carry. Not done, the session must not start: the record
    /// would skip them for good.
    async fn forget_adoption_of_missing_slot(&self) -> Result<(), String> {
        let slot = &self.config.slot;
        let forgotten = self
            .main
            .query_rows(
                "forget a missing slot's adoption",
                &self.sql.forget_adoption_of_missing_slot,
                &[slot],
            )
            .await
            .map_err(|e| format!("forgetting the adoption of a missing slot: {}", e.report()))?;
        if let Some(row) = forgotten.first() {
            // The events of the old slot's stream alone: in no table, so nothing adopts them.
            let since = row
                .get::<_, Option<String>>(1)
                .map(|mark| format!("after about {mark} (the last position a relay recorded)"))
                .unwrap_or_else(|| "since the old slot's confirmed position".into());
            tracing::warn!(%slot, "the slot no longer exists but its adoption was recorded (dropped with SQL, or a promoted standby): the slot created now adopts the rows still in the table; outbox_emit events committed {since} and before the new slot were in the old slot's stream alone, and are lost");
        }
        Ok(())
    }

    /// A session could not start for a reason that may pass: the delay before trying again.
    /// A session not started after [`SESSION_START_PATIENCE`]: said, with what may hold it,
    /// and claims fail with it meanwhile. Making a slot waits for every transaction running
    /// on the server (in any database, prepared ones too, which can last days); the session
    /// waited without a word while `/readyz` said ready and nothing was relayed.
    async fn starting_slowly(&self, config: &WalConfig) {
        let patience = SESSION_START_PATIENCE.as_secs();
        let reason = if config.create_slot {
            let running = match self
                .main
                .query_rows("transactions", &self.sql.running_transactions, &[])
                .await
            {
                Ok(rows) if !rows.is_empty() => {
                    let found: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
                    format!(" (running now: {})", found.join("; "))
                }
                _ => String::new(),
            };
            format!(
                "the replication session has not started after {patience} s: making the slot \
                 {:?} waits until every transaction running on the server when it began has \
                 ended, in any database, prepared ones too{running}; end or commit them (or \
                 COMMIT PREPARED / ROLLBACK PREPARED)",
                config.slot
            )
        } else {
            format!(
                "the replication session has not started after {patience} s (the server is slow \
                 to answer the replication connection)"
            )
        };
        tracing::warn!(error = %reason, "the replication session is slow to start");
        self.set_status(CaptureStatus::Reconnecting(reason));
    }

    fn cannot_start(&mut self, reason: String) -> Duration {
        tracing::warn!(error = %reason, "cannot start the replication session; retrying");
        self.set_status(CaptureStatus::Reconnecting(reason));
        self.sessions.backoff.next_delay()
    }

    /// Waits while a relay of this outbox streams from the slot, asked over SQL every
    /// [`STANDBY_LOOKS_EVERY`]: each replication attempt on a slot in use is an ERROR in the
    /// server's log, which a standby that tried every second filled. Returns once the slot
    /// may be free (or who holds it cannot be told: the attempt says), false when closing.
    async fn stand_by_while_a_relay_streams(&mut self) -> bool {
        loop {
            tokio::select! {
                () = tokio::time::sleep(STANDBY_LOOKS_EVERY) => {}
                _ = self.close.changed() => return false,
            }
            if self.slot_holder().await != SlotHolder::ThisOutbox {
                return true;
            }
        }
    }

    /// Who holds the slot, as far as its session's name tells.
    async fn slot_holder(&self) -> SlotHolder {
        let Ok(rows) = self
            .main
            .query_rows("slot holder", &self.sql.slot_holder, &[&self.config.slot])
            .await
        else {
            return SlotHolder::Unknown;
        };
        let Some(row) = rows.first() else {
            return SlotHolder::Nobody;
        };
        let Some(holder) = row.try_get::<_, Option<String>>(0).ok().flatten() else {
            return SlotHolder::Unknown;
        };
        SlotHolder::of(holder, &self.config.outbox_tag())
    }

    /// Capture cannot go on until an operator acts: said once (not at every retry), and
    /// by claims and `/readyz` meanwhile. The delay before trying again.
    pub(super) fn failed(&mut self, reason: String) -> Duration {
        if *self.status.borrow() != CaptureStatus::Failed(reason.clone()) {
            tracing::error!(error = %reason, "WAL capture cannot start; retrying until fixed");
        }
        self.set_status(CaptureStatus::Failed(reason));
        self.sessions.backoff.next_delay()
    }

    /// Whether the publication carries every INSERT of the table, whole, and has not
    /// changed since the last check. While it is wrong no session streams (its keepalives
    /// would move the slot past the rows left out); once it changed, even back, the session
    /// ends (pgoutput left out what the publication left out at each point of the WAL). Either
    /// way the slot's adoption is forgotten: the next session, once it is right, moves the
    /// rows still in the table (those left out among them) to the parked table.
    pub(super) async fn publication_drift(&self) -> Option<SessionEnd> {
        let problems = match publication_problems(
            &self.main,
            &self.sql,
            &self.tables,
            &self.publication,
        )
        .await
        {
            Ok(problems) => problems,
            Err(e) => {
                return Some(SessionEnd::Broken(format!(
                    "reading the publication: {}",
                    e.report()
                )))
            }
        };
        let version = match self
            .main
            .query_rows(
                "publication",
                &self.sql.publication_version,
                &[&self.publication.as_str()],
            )
            .await
        {
            Ok(rows) => rows.first().and_then(|row| row.get(0)),
            Err(e) => {
                return Some(SessionEnd::Broken(format!(
                    "reading the publication: {}",
                    e.report()
                )))
            }
        };
        // Compared with this process's last check, or at its first with the version the
        // slot's adoption recorded, so that a change made while no relay ran (undone or not)
        // is seen too. An adoption recorded without one (by an earlier relay) says nothing of
        // the publication it was checked against: it counts as changed, and is done again.
        let seen = self.remembered_publication_version();
        let changed = match seen {
            Some(seen) => Some(seen) != version,
            None => match self.adopted_publication_version().await {
                Ok(Adopted::No) => false,
                Ok(Adopted::At(adopted)) => adopted.is_none() || adopted != version,
                Err(e) => {
                    return Some(SessionEnd::Broken(format!(
                        "reading the publication's version the slot adopted at: {}",
                        e.report()
                    )))
                }
            },
        };
        if problems.is_empty() && !changed {
            self.remember_publication_version(version);
            return None;
        }
        let slot = &self.config.slot;
        if let Err(e) = self
            .main
            .query_rows("forget adoption", &self.sql.forget_adoption, &[slot])
            .await
        {
            return Some(SessionEnd::Broken(format!(
                "the publication changed, and the slot's adoption cannot be forgotten: {}",
                e.report()
            )));
        }
        // Only now: a version remembered before the adoption is forgotten would hide the
        // change from the next check, should the forgetting fail.
        self.remember_publication_version(version);
        if problems.is_empty() {
            tracing::warn!(publication = %self.publication, "the publication changed since it was last checked: the session ends, and the next one moves the rows still in the table to the parked table (rows written meanwhile may have been left out of the stream)");
            return Some(SessionEnd::Broken("the publication changed".into()));
        }
        let said: Vec<String> = problems.iter().map(Problem::to_string).collect();
        Some(SessionEnd::Failed(said.join("; ")))
    }

    /// Whether rows the slot's stream will never bring wait in the table though its
    /// adoption is recorded: the slot was dropped and made again under its name while no
    /// relay ran, and the record is its predecessor's. Seen at the session's start once the
    /// slot's `catalog_xmin` has passed their transactions. A slot made while another slot
    /// or an open transaction held the server's horizon back starts with that older
    /// `catalog_xmin`, which moves on only once the session confirms past the next snapshot
    /// of running transactions the server logs (every 15 s under writes, or at a
    /// checkpoint); so this is looked at again as the publication is, each time the slot's
    /// `catalog_xmin` has moved. Found, the session ends, and the next one adopts them.
    async fn stranded_rows(&self) -> Option<SessionEnd> {
        let slot = &self.config.slot;
        let broken = |e: StoreError| {
            Some(SessionEnd::Broken(format!(
                "looking for rows the slot's stream does not carry: {}",
                e.report()
            )))
        };
        let catalog_xmin: Option<String> = match self
            .main
            .query_rows("catalog_xmin", &self.sql.slot_catalog_xmin, &[slot])
            .await
        {
            Ok(rows) => rows.first().and_then(|row| row.get(0)),
            Err(e) => return broken(e),
        };
        {
            let mut checked = self
                .sessions
                .stranded_checked_at
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if *checked == catalog_xmin {
                return None;
            }
            *checked = catalog_xmin;
        }
        let stranded: i64 = match self
            .main
            .query_rows("stranded", &self.sql.stranded, &[slot])
            .await
        {
            Ok(rows) => rows[0].get(0),
            Err(e) => return broken(e),
        };
        if stranded == 0 {
            return None;
        }
        tracing::warn!(%slot, rows = stranded, "rows committed before the slot was made wait in the table, though its adoption is recorded: the slot was dropped and made again under its name while no relay ran; the session ends, and the next one adopts them");
        Some(SessionEnd::Broken(
            "rows the slot's stream does not carry wait in the table".into(),
        ))
    }

    /// Ends the session when the server made it a synchronous standby
    /// (`synchronous_standby_names` matching its name, as `*` does): every commit of the
    /// server would then wait for the relay's confirmations, which follow its deliveries
    /// and its confirm mark, not the WAL, and the relay's own writes would wait on itself.
    async fn synchronous_standby(&self) -> Option<SessionEnd> {
        let rows = self
            .main
            .query_rows(
                "sync_state",
                "SELECT sync_state FROM pg_catalog.pg_stat_replication WHERE application_name = $1",
                &[&self.session_name],
            )
            .await
            .ok()?;
        let state: Option<String> = rows.first().and_then(|row| row.get(0));
        if !matches!(state.as_deref(), Some("sync" | "quorum")) {
            return None;
        }
        tracing::error!(
            slot = %self.config.slot,
            sync_state = state.as_deref().unwrap_or_default(),
            "the server made the relay's replication session a synchronous standby \
             (synchronous_standby_names matches its name, as '*' does): every commit of the \
             server would wait for the relay's deliveries; the session is let go. Name the \
             physical standbys in synchronous_standby_names instead of '*'"
        );
        Some(SessionEnd::Broken(
            "the server made the replication session a synchronous standby: name the physical \
             standbys in synchronous_standby_names instead of '*'"
                .into(),
        ))
    }

    pub(super) fn set_status(&self, status: CaptureStatus) {
        ::metrics::gauge!(metric::STREAMING).set(if status == CaptureStatus::Streaming {
            1.0
        } else {
            0.0
        });
        self.status.send_replace(status);
    }

    pub(super) fn notify(&self) {
        let on_change = self.on_change.lock().ok().and_then(|o| o.clone());
        if let Some(on_change) = on_change {
            on_change();
        }
    }

    /// [`Reader::send`] while the session is served as `forward` serves it: a full channel
    /// (the engine claims nothing while its in-flight work is full, behind a slow sink)
    /// could otherwise keep the session unanswered, and a server shutting down would wait
    /// for it. Status updates go out every second, and the session is let go, as while
    /// streaming, when the database stops answering over SQL.
    async fn send_serviced(&self, stream: &mut WalStream, item: Item) -> Result<(), SessionEnd> {
        let sent = self.serviced(stream, self.tx.send(item), true).await?;
        self.notify();
        sent.map_err(|_| SessionEnd::Closed)
    }

    /// Runs `work` while the session is kept (status updates, the database asked over SQL):
    /// a session's opening statements can outlast `wal_sender_timeout` (an adoption, the
    /// parked table read whole), and a session left unanswered that long is ended by the
    /// server, to be opened, and cut off, again. With `ask_sql`, the database is asked over
    /// SQL too, and a database that stops answering ends the session; not while `work` is
    /// a statement of its own, which a slow answer would cut off mid-way (its server side
    /// running on, holding its locks, until it rolls back). `Err`: the session ended.
    async fn serviced<T>(
        &self,
        stream: &mut WalStream,
        work: impl std::future::Future<Output = T>,
        ask_sql: bool,
    ) -> Result<T, SessionEnd> {
        let mut liveness = SqlLiveness::new();
        let mut close = self.close.clone();
        tokio::pin!(work);
        loop {
            tokio::select! {
                biased;
                done = &mut work => return Ok(done),
                _ = close.changed() => return Err(SessionEnd::Closed),
                _ = liveness.tick() => {
                    let end = if ask_sql {
                        self.serve(stream, &mut liveness).await
                    } else {
                        self.keep(stream, false).await
                    };
                    if let Some(end) = end {
                        return Err(end);
                    }
                }
            }
        }
    }

    /// Confirms what the settled events allow, up to the slot's confirm mark, raising the
    /// mark first when that allows more, a raise is due ([`ConfirmMark`]) and `may_raise`
    /// (not while a statement of the session's opening runs); `now_or_never`: the session's
    /// last confirmation, whatever the last raise's time. A raise that fails leaves the
    /// confirmation at the mark until the next one; one the database refuses for good (its
    /// table or privilege missing) turns the mark off.
    async fn confirm_up_to_mark(
        &self,
        stream: &mut WalStream,
        may_raise: bool,
        now_or_never: bool,
    ) {
        self.told.set(stream.reported());
        let wanted = self.confirm.borrow().within(self.sessions.histories);
        let now = std::time::Instant::now();
        let due = may_raise && {
            let mut mark = self.lock_mark();
            let due = mark.raise_due(wanted, now, now_or_never);
            if due {
                mark.trying(now);
            }
            due
        };
        if due {
            self.raise_mark(wanted).await;
        }
        let confirmable = self.lock_mark().confirmable(wanted);
        stream.confirm(confirmable);
    }

    /// Raises the slot's confirm mark to `up_to`, durably, while this session holds the slot
    /// (guarded as a park is: a session ended, and the slot then advanced by hand, must not
    /// lift the mark past it).
    async fn raise_mark(&self, up_to: Lsn) {
        if self.lock_mark().is_off() {
            return;
        }
        let slot = &self.config.slot;
        let position = up_to.to_string();
        let raise: &[&(dyn ToSql + Sync)] = &[slot, &position];
        let guard = SlotGuard::new(slot, &self.session_name);
        let raised = tokio::time::timeout(
            SqlLiveness::PATIENCE,
            self.main.transaction_if_then_query(
                "raise mark",
                &guard.steps(&self.sql),
                &[],
                Some((&self.sql.raise_mark, raise)),
            ),
        )
        .await;
        let failure = match raised {
            Ok(Ok(Some((_, rows)))) => {
                if let Some(mark) = first_position(&rows) {
                    self.lock_mark().raised(mark);
                }
                self.set_confirm_stall(None);
                return;
            }
            // The session no longer holds the slot: its end is the stream's to find.
            Ok(Ok(None)) => "the session no longer holds the slot".to_string(),
            Ok(Err(e)) if cannot_be_kept(&e) => {
                self.mark_cannot_be_kept(&e.report());
                return;
            }
            Ok(Err(e)) => e.report(),
            Err(_) => format!("no answer within {:?}", SqlLiveness::PATIENCE),
        };
        let failures = self.lock_mark().failed();
        if failures >= ConfirmMark::FAILURES_SAID {
            self.set_confirm_stall(Some(format!(
                "the slot's confirm mark in {} could not be raised {failures} times in a row \
                 (last: {failure}): the slot is confirmed no further, and the server keeps its \
                 WAL, until it is",
                self.tables.marks
            )));
        }
        if failures == ConfirmMark::FAILURES_SAID {
            tracing::warn!(error = %failure, table = %self.tables.marks, "the slot's confirm mark cannot be raised: the slot is confirmed no further until it is (the server keeps its WAL meanwhile); trying every second");
        } else {
            tracing::debug!(error = %failure, "raising the slot's confirm mark; again in a second");
        }
    }

    fn set_confirm_stall(&self, why: Option<String>) {
        *self
            .confirm_stall
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = why;
    }

    fn lock_mark(&self) -> std::sync::MutexGuard<'_, ConfirmMark> {
        self.sessions
            .mark
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The confirm mark's table or privilege is missing: the slot is confirmed without it,
    /// and a slot made again by hand is told by its `catalog_xmin` only. Said once.
    fn mark_cannot_be_kept(&self, reason: &str) {
        // Confirmed without it from now on: nothing held back.
        self.set_confirm_stall(None);
        if self.lock_mark().turn_off() {
            tracing::error!(error = %reason, table = %self.tables.marks, "the slot's confirm mark cannot be kept: the slot is confirmed without it, and a slot dropped and made again by hand, or advanced by hand, may be told late (grant what `outbox-relay migrate --capture wal --print` lists, then restart)");
        }
    }

    /// A status update with the confirmable position. `Some`: the session ended.
    async fn keep(&self, stream: &mut WalStream, may_raise: bool) -> Option<SessionEnd> {
        self.confirm_up_to_mark(stream, may_raise, false).await;
        let kept = stream.keep_alive().await;
        kept.err().map(|e| SessionEnd::Broken(describe(&e)))
    }

    /// A tick of a session's upkeep, reading the stream or not: a status update with the
    /// confirmable position, and the database asked over SQL. `Some`: the session ends.
    async fn serve(
        &self,
        stream: &mut WalStream,
        liveness: &mut SqlLiveness,
    ) -> Option<SessionEnd> {
        if let Some(end) = self.keep(stream, true).await {
            return Some(end);
        }
        liveness.check(&self.main).await.map(SessionEnd::Broken)
    }

    pub(super) async fn send(&self, item: Item) -> bool {
        let sent = self.tx.send(item).await.is_ok();
        self.notify();
        sent
    }

    /// Counts the rows a mapped table's adoption dead-lettered (`destination, count`): in
    /// `outbox_events_dead_lettered_total`, as the engine counts its own, and for
    /// `run --drain`'s summary.
    pub(super) fn count_adoption_dead_letters(&self, dead_by_destination: &[tokio_postgres::Row]) {
        let mut dead = 0;
        for row in dead_by_destination {
            // `destination` is the dead-letter table's (NOT NULL), `count(*)` a bigint.
            let (destination, n): (String, i64) = (row.get(0), row.get(1));
            let n = n.max(0) as u64;
            self.dead_letters.add(&destination, n);
            dead += n;
        }
        if dead > 0 {
            tracing::warn!(
                rows = dead,
                "rows of the outbox table that could not be read as events (an id that is no \
                 UUID, a payload that is no JSON) were moved to the dead letters with the \
                 reason: `outbox-relay dead list` shows them"
            );
        }
    }

    /// The events the slot's adoption parked that its stream may carry too
    /// ([`AdoptedCopies`]). Only a help against duplicates: if it cannot be read, the
    /// session goes on without it (a stream copy may then go out twice, never lost).
    async fn adopted_copies(&self) -> AdoptedCopies {
        let (slot, most) = (&self.config.slot, AdoptedCopies::MOST);
        let read = self
            .main
            .query_rows("adopted copies", &self.sql.adopted_copies, &[slot, &most])
            .await;
        let copies = read.map_err(|e| e.report()).and_then(|rows| {
            let Some(row) = rows.first() else {
                return Ok(AdoptedCopies::default());
            };
            // Typed reads that fail instead of panicking; a NULL id (a mapped table's
            // parked row) is no adopted copy.
            let ids: Vec<Option<uuid::Uuid>> = row.try_get(0).map_err(|e| e.to_string())?;
            let until: i64 = row.try_get(1).map_err(|e| e.to_string())?;
            Ok(AdoptedCopies::new(
                ids.into_iter().flatten(),
                Lsn(until.max(0) as u64),
            ))
        });
        copies.unwrap_or_else(|reason| {
            tracing::warn!(error = %reason, "reading which adopted events the stream carries too: their stream copies may go out twice");
            AdoptedCopies::default()
        })
    }

    /// Whether the slot's adoption is recorded, and at which version of the publication.
    async fn adopted_publication_version(&self) -> StoreResult<Adopted> {
        let rows = self
            .main
            .query_rows(
                "adopted",
                &self.sql.adopted_publication_version,
                &[&self.config.slot],
            )
            .await?;
        Ok(match rows.first() {
            Some(row) => Adopted::At(row.get(0)),
            None => Adopted::No,
        })
    }

    /// The publication's version this process checked last (`None`: no check yet).
    fn remembered_publication_version(&self) -> Option<String> {
        self.sessions
            .publication_version
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn remember_publication_version(&self, version: Option<String>) {
        *self
            .sessions
            .publication_version
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = version;
    }

    /// Moves the rows that predate the slot to the parked table, unless the slot's adoption
    /// is recorded as done: its stream does not carry them. Run at every session start, by
    /// whichever relay streams (and so holds the slot: no other adopts meanwhile), until it
    /// has committed once; the record is written in the same transaction as the move, so a
    /// crash leaves either both or neither. A slot made by hand, or by a relay that died
    /// before adopting, is adopted by the next session.
    /// A slot confirmed past its confirm mark was moved by something else since a relay last
    /// confirmed it, and is adopted again.
    pub(super) async fn adopt(&self) -> StoreResult<AdoptCheck> {
        let slot = &self.config.slot;
        let adopted = self
            .main
            .query_rows("adopted", &self.sql.adopted, &[slot])
            .await?;
        let recorded = adopted.first().is_some_and(|row| row.get::<_, bool>(0));
        // Read now that this session holds the slot (only it can move it, and never past
        // the mark), not as the session began: a hand may advance a slot until then.
        let confirmed = self
            .main
            .query_rows("slot", &self.sql.slot_confirmed, &[slot])
            .await?;
        let start = first_position(&confirmed).unwrap_or(Lsn(0));
        let mark = self.read_mark().await?;
        let moved = mark.is_some_and(|mark| start > mark);
        if recorded && moved {
            tracing::warn!(%slot, "the slot is confirmed past the position the relays may confirm it to: something else moved it (it was dropped and made again, or advanced, by hand, or a relay of another outbox was given it), and its stream skips what it moved past; the rows still in the table are adopted again");
        }
        if recorded && !moved {
            return Ok(AdoptCheck::Adopted { mark, start });
        }
        let no_params = &[] as &[&(dyn ToSql + Sync)];
        // The version the session's check read: one changed since is seen at the next check.
        let version = self.remembered_publication_version();
        let record: &[&(dyn ToSql + Sync)] = &[slot, &version];
        let slot_only: &[&(dyn ToSql + Sync)] = &[slot];
        // The mark raised to the slot in the same transaction, so that a moved slot's
        // adoption never commits without it (and the next session takes the slot for moved
        // again, adopting the whole table once more).
        let position = start.to_string();
        let raise: &[&(dyn ToSql + Sync)] = &[slot, &position];
        let raises = !self.lock_mark().is_off();
        let adoption = &self.sql.adopt;
        let steps: Vec<_> = adoption
            .steps
            .iter()
            .map(|sql| (sql.as_str(), no_params))
            .chain([
                (self.sql.forget_adoption.as_str(), slot_only),
                (self.sql.record_adoption.as_str(), record),
            ])
            .chain(raises.then_some((self.sql.raise_mark.as_str(), raise)))
            .collect();
        let dead_letters = adoption.dead_letters.as_deref().map(|sql| (sql, no_params));
        // Fenced as parks are: a relay paused past the slot's takeover must not move rows
        // the new holder streams, nor park keys it does not know are parked.
        let guard = SlotGuard::new(slot, &self.session_name);
        let Some((_, dead_by_destination)) = self
            .main
            .long_transaction_if_then_query(
                "adopt",
                ADOPTION_TIMEOUT,
                &guard.steps(&self.sql),
                &steps,
                dead_letters,
            )
            .await?
        else {
            return Ok(AdoptCheck::SlotLost);
        };
        tracing::info!(
            %slot,
            "the slot's rows are adopted: pending rows of the outbox table, which its stream \
             does not carry, were moved to the parked table to be relayed first"
        );
        self.count_adoption_dead_letters(&dead_by_destination);
        if raises {
            self.lock_mark().raised(start);
        }
        Ok(AdoptCheck::Adopted { mark, start })
    }

    /// The slot's confirm mark (`None`: none yet, or it cannot be kept, and is turned off).
    /// Any other failure fails the session's start: a session that went on without it
    /// could raise the mark past a slot moved by hand, which no later start would then see.
    async fn read_mark(&self) -> StoreResult<Option<Lsn>> {
        // A mark the role may read but not raise is as good as none: each session would
        // find the slot past it (confirmed without it) and adopt the table again.
        let marks = self.tables.marks.quoted();
        let lacking = self
            .main
            .query_rows(
                "confirm mark privileges",
                &self.sql.marks_privileges,
                &[&marks],
            )
            .await
            .map(|rows| {
                rows.first()
                    .map(|row| format!("{} {}", self.tables.marks, row.get::<_, String>(0)))
            });
        let unkept = match lacking {
            Ok(lacking) => lacking,
            Err(e) if cannot_be_kept(&e) => Some(e.report()),
            Err(e) => return Err(e),
        };
        if let Some(reason) = unkept {
            self.mark_cannot_be_kept(&reason);
            return Ok(None);
        }
        let read = self
            .main
            .query_rows("confirm mark", &self.sql.slot_mark, &[&self.config.slot])
            .await;
        match read {
            Ok(rows) => Ok(first_position(&rows)),
            Err(e) if cannot_be_kept(&e) => {
                self.mark_cannot_be_kept(&e.report());
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// One session: open it, then forward until it breaks or the store closes.
    pub(super) async fn stream(&mut self, stream: &mut WalStream) -> SessionEnd {
        if let Some(end) = self.open_session(stream).await {
            return end;
        }
        self.forward(stream).await
    }

    /// What a session does before it forwards: checks the publication, adopts the rows that
    /// predate the slot, announces itself to claims with the keys still parked, and (with
    /// `--drain`, once) writes the position the drain ends at. `Some`: the session ended.
    async fn open_session(&mut self, stream: &mut WalStream) -> Option<SessionEnd> {
        self.lock_mark().session_started();
        match self.serviced(stream, self.publication_drift(), false).await {
            Ok(None) => {}
            Ok(Some(end)) | Err(end) => return Some(end),
        }
        let adopted = match self.serviced(stream, self.adopt(), false).await {
            Ok(adopted) => adopted,
            Err(end) => return Some(end),
        };
        match adopted {
            Ok(AdoptCheck::Adopted { mark, start }) => {
                let (went_back, behind) = {
                    let mut state = self.lock_mark();
                    let went_back = state.checked(mark);
                    (went_back, state.confirmable(start) < start)
                };
                if went_back {
                    tracing::warn!(
                        mark = ?mark,
                        "the slot's confirm mark reads lower than this relay raised it: the \
                         server's WAL was rolled back (a disk snapshot or backup restored on \
                         the same timeline), so what was confirmed and settled before is not \
                         taken for what its positions hold now, and events read again are \
                         sent again"
                    );
                    self.sessions.wal_rolled_back();
                    self.told.reset();
                }
                // A slot no relay of this version confirmed has no mark yet: one from here.
                if behind {
                    self.raise_mark(start).await;
                }
            }
            Ok(AdoptCheck::SlotLost) => return Some(lost_slot(stream).await),
            Err(e) => {
                return Some(SessionEnd::Broken(format!(
                    "moving the rows that predate the slot to the parked table: {}",
                    e.report()
                )))
            }
        }
        // Under the slot's writes: a park that passed an earlier holder's guard commits
        // (or rolls back) first, and is among the keys read.
        let slot: &[&(dyn ToSql + Sync)] = &[&self.config.slot];
        // Bounded as the adoption is: the query reads every parked row (for its size), as
        // many as an adoption moved.
        let lock = [(self.sql.take_slot_writes.as_str(), slot)];
        let reading = self.main.long_transaction_if_then_query(
            "parked keys",
            ADOPTION_TIMEOUT,
            &lock,
            &[],
            Some((&self.sql.parked_keys, &[])),
        );
        let read = match self.serviced(stream, reading, false).await {
            Ok(read) => read,
            Err(end) => return Some(end),
        };
        let parked_keys = match read {
            // The lock's query returns its row: not met, but not a panic either.
            Ok(None) => {
                let reason = "reading the parked keys: the slot's write lock said nothing";
                return Some(SessionEnd::Broken(reason.into()));
            }
            Ok(Some((_, rows))) => rows
                .iter()
                .map(|r| (r.get::<_, String>(0), r.get::<_, Option<i64>>(1)))
                .collect::<Vec<_>>(),
            Err(e) => {
                let reason = format!("reading the parked keys: {}", e.report());
                return Some(SessionEnd::Broken(reason));
            }
        };
        let adopted_copies = match self.serviced(stream, self.adopted_copies(), false).await {
            Ok(copies) => copies,
            Err(end) => return Some(end),
        };
        let start = stream.slot().confirmed_flush;
        tracing::info!(slot = %self.config.slot, %start, created = stream.slot().created, "streaming from the replication slot");
        self.live.set(self.sessions.started);
        let largest_parked = (parked_keys.iter())
            .filter_map(|(_, size)| usize::try_from(size.unwrap_or(0)).ok())
            .max()
            .unwrap_or(0);
        let parked_keys = parked_keys.into_iter().map(|(key, _)| key).collect();
        let session = Item::Session {
            session: self.sessions.started,
            start,
            parked_keys,
            largest_parked,
            owner: self.session_name.clone(),
            adopted_copies,
            history: self.sessions.histories,
        };
        if let Err(end) = self.send_serviced(stream, session).await {
            return Some(end);
        }
        self.set_status(CaptureStatus::Streaming);
        if self.drain && !self.sessions.drain_marker_written {
            return self.write_drain_marker().await;
        }
        None
    }

    /// Writes the drain's end marker and tells claims its position.
    async fn write_drain_marker(&mut self) -> Option<SessionEnd> {
        let written = self
            .main
            .query_rows("drain marker", &self.sql.drain_marker, &[])
            .await;
        let lsn: String = match written {
            Ok(rows) => rows[0].get(0),
            Err(e) => {
                let reason = format!("writing the drain marker: {}", e.report());
                return Some(SessionEnd::Broken(reason));
            }
        };
        match lsn.parse::<Lsn>() {
            Ok(lsn) => {
                self.sessions.drain_marker_written = true;
                (!self.send(Item::DrainUntil(lsn)).await).then_some(SessionEnd::Closed)
            }
            Err(e) => Some(SessionEnd::Broken(format!(
                "the drain marker's position: {e}"
            ))),
        }
    }

    /// Forwards outputs to claims and confirmations to the server until the session breaks
    /// or the store closes, pinging the database and re-checking the publication meanwhile.
    async fn forward(&mut self, stream: &mut WalStream) -> SessionEnd {
        let mut liveness = SqlLiveness::new();
        // A slot in the channel is reserved before the stream is read, so a burst read is
        // never held back by a full channel while the session has other duties. Nor is
        // the stream read while the memory budget is full: what is unread waits in the
        // server's WAL (and the client's small buffer), not in this process.
        let mut permit = None;
        let mut pace = BurstPace::default();
        let mut relations_checked = 0;
        loop {
            let memory_full = self.memory.room() == 0;
            let paced = pace.wait_until(tokio::time::Instant::now());
            let next = tokio::select! {
                biased;
                _ = self.close.changed() => return SessionEnd::Closed,
                changed = self.confirm.changed() => {
                    if changed.is_err() {
                        return SessionEnd::Closed;
                    }
                    self.confirm.borrow_and_update();
                    self.confirm_up_to_mark(stream, true, false).await;
                    if let Err(e) = stream.keep_alive().await {
                        return SessionEnd::Broken(describe(&e));
                    }
                    continue;
                }
                _ = liveness.tick() => {
                    // Also while the stream is not read (claims behind, the memory budget
                    // full): the server ends a session that says nothing for
                    // wal_sender_timeout.
                    if let Some(end) = self.serve(stream, &mut liveness).await {
                        return end;
                    }
                    if liveness.publication_due() {
                        // They read the outbox table, which a migration's lock can hold for
                        // as long as the statement timeout: the session is kept meanwhile.
                        let checks = async {
                            if let Some(end) = self.publication_drift().await {
                                return Some(end);
                            }
                            if let Some(end) = self.synchronous_standby().await {
                                return Some(end);
                            }
                            self.stranded_rows().await
                        };
                        match self.serviced(stream, checks, false).await {
                            Ok(None) => {}
                            Ok(Some(end)) | Err(end) => return end,
                        }
                    }
                    continue;
                }
                reserved = self.tx.reserve(), if permit.is_none() => match reserved {
                    Ok(reserved) => {
                        permit = Some(reserved);
                        continue;
                    }
                    Err(_) => return SessionEnd::Closed,
                },
                () = self.memory.has_room(), if permit.is_some() && memory_full => continue,
                next = stream.next_not_before(paced), if permit.is_some() && !memory_full => next,
            };
            let Some(permit) = permit.take() else {
                continue;
            };
            let first = match next {
                Ok(Some(output)) => output,
                Ok(None) => return SessionEnd::Broken("the server ended the stream".into()),
                Err(e) => return SessionEnd::Broken(describe(&e)),
            };
            let (burst, end) = read_burst(stream, first, &self.memory).await;
            // A captured table described anew: its definition, or what the publication sends
            // of it (a column list, a row filter), may have changed at this point of the
            // WAL. Checked before anything after it is handed out: rows read without their
            // columns were dead-lettered as undecodable, and rows a filter left out came
            // late, after later rows of their key, until the periodic check noticed.
            let relations = stream.assembler().stats().captured_relations;
            if relations != relations_checked {
                match self.serviced(stream, self.publication_drift(), false).await {
                    Ok(None) => relations_checked = relations,
                    Ok(Some(end)) | Err(end) => return end,
                }
            }
            if tracing::enabled!(tracing::Level::TRACE) {
                // With the claim's `oldest_ms`: whether events reach the relay late, or wait
                // in it.
                if let Some(age) = commit_age(burst.iter().map(|c| &c.output)) {
                    let age_ms = age.as_secs_f64() * 1000.0;
                    tracing::trace!(outputs = burst.len(), first_commit_age_ms = age_ms, "read");
                }
            }
            // The furthest transaction with events read, and the furthest position read.
            let (mut events_through, mut read_to) = (None, None);
            for read in &burst {
                match read.output {
                    Output::Committed {
                        end_lsn, events, ..
                    } => {
                        read_to = read_to.max(Some(end_lsn));
                        if events > 0 {
                            events_through = events_through.max(Some(end_lsn));
                        }
                    }
                    Output::Idle { wal_end } => read_to = read_to.max(Some(wal_end)),
                    _ => {}
                }
            }
            if let Some(through) = events_through {
                self.lock_mark().events_read(through);
            }
            if let Some(to) = read_to {
                self.sessions.read(to);
            }
            let behind = burst.len() >= READ_BURST || self.memory.room() == 0;
            let now = tokio::time::Instant::now();
            pace.handed_over(behind, now);
            if pace.wait_until(now).is_some() {
                stream.wake_late();
            }
            permit.send(Item::Outputs(burst));
            self.notify();
            match end {
                BurstEnd::More => {}
                BurstEnd::Ended => return SessionEnd::Broken("the server ended the stream".into()),
                BurstEnd::Failed(e) => return SessionEnd::Broken(describe(&e)),
            }
        }
    }
}

/// The session found it no longer holds the slot: its stream's server process ended (the
/// stream's error says why, read here if it comes within a second) or another relay took
/// the slot over. What the stream sent meanwhile is dropped unconfirmed, so it comes again.
async fn lost_slot(stream: &mut WalStream) -> SessionEnd {
    let error = tokio::time::timeout(Duration::from_secs(1), async {
        loop {
            match stream.next().await {
                Ok(Some(_)) => continue,
                Ok(None) => return None,
                Err(e) => return Some(e),
            }
        }
    })
    .await;
    match error {
        Ok(Some(e)) => SessionEnd::Broken(describe(&e)),
        _ => SessionEnd::Broken(
            "this session no longer holds the slot (another relay took it over, or the server \
             ended the stream): the rows that predate the slot are left to the session that \
             holds it"
                .into(),
        ),
    }
}

/// `base`, the outbox's tag ([`WalConfig::outbox_tag`]) and a token no other session has
/// (an `application_name`: at most 63 bytes).
pub(super) fn session_name(base: &str, outbox_tag: &str) -> String {
    let token = uuid::Uuid::new_v4().simple().to_string();
    // PostgreSQL stores non-ASCII bytes of an application_name as `?`: the ownership guard
    // compares names, so the base keeps to what is stored as written.
    let mut base: String = base
        .chars()
        .map(|c| match c {
            'A'..='Z' | 'a'..='z' | '0'..='9' | ' ' | '_' | '.' | '-' => c,
            _ => '_',
        })
        .collect();
    while base.len() > 63 - 1 - outbox_tag.len() - 1 - 12 {
        base.pop();
    }
    format!("{base} {outbox_tag} {}", &token[..12])
}

/// How often a standby asks whether the relay streaming from the slot is still there.
const STANDBY_LOOKS_EVERY: Duration = Duration::from_secs(1);

/// How long a replication session may take to start before the reader says so and claims
/// fail with the reason ([`Reader::starting_slowly`]).
const SESSION_START_PATIENCE: Duration = Duration::from_secs(10);

/// Who holds a slot, told by its session's name ([`session_name`]).
#[derive(Debug, PartialEq)]
enum SlotHolder {
    /// A relay of this outbox (or one of an earlier version, whose name has no tag): this
    /// relay waits as its standby.
    ThisOutbox,
    /// A relay of another outbox.
    AnotherOutbox(String),
    /// A client whose name is not a relay's.
    NoRelay(String),
    /// The name could not be read.
    Unknown,
    /// No session streams from the slot (or there is no slot).
    Nobody,
}

impl SlotHolder {
    fn of(name: String, own_tag: &str) -> SlotHolder {
        match outbox_tag_of(&name) {
            Some(tag) if tag == own_tag => SlotHolder::ThisOutbox,
            Some(_) => SlotHolder::AnotherOutbox(name),
            None if name.starts_with("outbox-relay") => SlotHolder::ThisOutbox,
            None => SlotHolder::NoRelay(name),
        }
    }
}

/// The outbox tag in a session name ([`session_name`]); `None` in an earlier version's, or
/// another client's.
pub(super) fn outbox_tag_of(session_name: &str) -> Option<&str> {
    let mut parts = session_name.rsplit(' ');
    let (_token, tag) = (parts.next()?, parts.next()?);
    let hex = tag.strip_prefix("ob_")?;
    (hex.len() == 8 && hex.bytes().all(|b| b.is_ascii_hexdigit())).then_some(tag)
}

/// Whether the database still answers over SQL, asked every [`SqlLiveness::EVERY`] while
/// a session streams.
///
/// A relay that cannot write to the database cannot settle what it holds, so it cannot
/// confirm the slot up to the end of the WAL sent. PostgreSQL's fast shutdown ends the SQL
/// sessions first, then waits for every walsender's client to confirm the end of the WAL
/// before it completes: a relay that kept its replication session then would hold the
/// shutdown (and a restart, a failover) for as long as it runs. So when the SQL side fails
/// [`SqlLiveness::FAILURES`] times in a row, the session is let go. Nothing is lost: the
/// slot stays where it was confirmed, and the events come again, with the same ids, in the
/// next session.
///
/// Every [`SqlLiveness::PUBLICATION_EVERY`] answered ping, the publication is checked too
/// ([`Reader::publication_drift`]), and the rows a slot made again by hand does not bring
/// ([`Reader::stranded_rows`]).
pub(super) struct SqlLiveness {
    pub(super) ticks: tokio::time::Interval,
    pub(super) failures: u32,
    pub(super) answered: u32,
}

impl SqlLiveness {
    const EVERY: Duration = Duration::from_secs(1);
    /// Two, so that one lost connection the pool replaces costs no session.
    const FAILURES: u32 = 2;
    /// A ping that takes longer counts as failed (a server that no longer answers).
    const PATIENCE: Duration = Duration::from_secs(3);
    const PUBLICATION_EVERY: u32 = 5;

    pub(super) fn new() -> Self {
        let mut ticks =
            tokio::time::interval_at(tokio::time::Instant::now() + Self::EVERY, Self::EVERY);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        SqlLiveness {
            ticks,
            failures: 0,
            answered: 0,
        }
    }

    /// After an answered ping: whether it is the publication's turn.
    pub(super) fn publication_due(&mut self) -> bool {
        // A failed ping is the liveness check's to judge; no second query on top of it.
        if self.failures > 0 {
            return false;
        }
        self.answered += 1;
        self.answered.is_multiple_of(Self::PUBLICATION_EVERY)
    }

    pub(super) async fn tick(&mut self) {
        self.ticks.tick().await;
    }

    /// Pings the database; the reason to let the session go, once it has failed enough.
    pub(super) async fn check(&mut self, main: &PgStore) -> Option<String> {
        let failure = match tokio::time::timeout(Self::PATIENCE, main.ping()).await {
            Ok(Ok(())) => {
                self.failures = 0;
                return None;
            }
            Ok(Err(e)) => e.report(),
            Err(_) => format!("no answer within {:?}", Self::PATIENCE),
        };
        self.failures += 1;
        tracing::debug!(error = %failure, failures = self.failures, "the database did not answer over SQL");
        (self.failures >= Self::FAILURES).then(|| {
            format!(
                "the database does not answer over SQL ({failure}), so nothing the relay holds \
                 can be settled: the replication session is let go, so that a server shutting \
                 down does not wait for it (its events come again from the slot)"
            )
        })
    }
}

/// A replication error with the fix where one is known.
pub(super) fn describe(error: &WalError) -> String {
    let text = error.to_string();
    if text.contains("SQLSTATE 42501") || text.contains("must be superuser or replication role") {
        format!("{text}: grant the relay's role REPLICATION (ALTER ROLE <role> REPLICATION)")
    } else if text.contains("wal_level") {
        format!("{text}: set wal_level = logical and restart PostgreSQL")
    } else if text.contains("SQLSTATE 53400") || text.contains("replication slots are in use") {
        format!("{text}: raise max_replication_slots and restart PostgreSQL, or drop a slot no longer used (pg_replication_slots)")
    } else if text.contains("publication") && text.contains("does not exist") {
        // Decoding reads the publication as it was at each change's position: one dropped
        // and made again after the slot's position is missing for the WAL in between, for
        // good. (A publication missing today is refused before streaming, with its own fix.)
        format!(
            "{text}: the publication was dropped and made again after the slot's position, and \
             PostgreSQL cannot decode the WAL written in between; run `outbox-relay drop-slot`, \
             then start the relay: the new slot's first session moves the rows still in the table \
             to the parked table (outbox_emit events written in between are not in any table)"
        )
    } else if text.contains("max_wal_senders") {
        format!("{text}: raise max_wal_senders and restart PostgreSQL, or stop a replication client no longer needed (pg_stat_replication)")
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server's history changes with its system or timeline, and when its WAL ends before
    /// what was read from it (rolled back to a disk snapshot: positions read before name
    /// other transactions there); a crash keeps everything sent, which was flushed.
    #[test]
    fn a_history_changes_with_the_system_the_timeline_or_a_wal_rolled_back() {
        let primary = crate::History {
            system: 7,
            timeline: 1,
        };
        let mut sessions = Sessions::new();
        assert!(!sessions.history_changed(primary, Lsn(100)), "the first");
        sessions.read(Lsn(500));
        assert!(!sessions.history_changed(primary, Lsn(500)), "a crash");
        assert!(sessions.history_changed(primary, Lsn(400)), "rolled back");
        assert_eq!(sessions.histories, 1);
        assert!(
            !sessions.history_changed(primary, Lsn(400)),
            "read nothing since"
        );
        let promoted = crate::History {
            timeline: 2,
            ..primary
        };
        assert!(sessions.history_changed(promoted, Lsn(900)));
        let other = crate::History {
            system: 8,
            ..promoted
        };
        assert!(sessions.history_changed(other, Lsn(900)));
        assert_eq!(sessions.histories, 3);
    }

    /// A slot streamed to a client that is no relay (pg_recvlogical, Debezium) had every
    /// relay wait as its standby, relaying nothing while it called itself ready.
    #[test]
    fn a_slot_holder_is_told_by_its_session_name() {
        const TAG: &str = "ob_0123abcd";
        let of = |name: &str| SlotHolder::of(name.to_string(), TAG);
        assert_eq!(
            of(&session_name("outbox-relay n1", TAG)),
            SlotHolder::ThisOutbox
        );
        assert_eq!(
            of("outbox-relay n1"),
            SlotHolder::ThisOutbox,
            "an earlier relay"
        );
        let other = session_name("outbox-relay n1", "ob_99999999");
        assert_eq!(of(&other), SlotHolder::AnotherOutbox(other.clone()));
        for client in ["pg_recvlogical", "Debezium", ""] {
            assert_eq!(of(client), SlotHolder::NoRelay(client.into()), "{client:?}");
        }
    }

    #[test]
    fn a_session_name_is_stored_as_written_so_the_ownership_guard_can_match_it() {
        const TAG: &str = "ob_0123abcd";
        // PostgreSQL stores a non-ASCII byte of an application_name as `?`.
        let name = session_name("outbox-relay nœud-1 ümlaut", TAG);
        assert!(name.is_ascii(), "{name}");
        assert!(
            name.starts_with("outbox-relay n_ud-1 _mlaut ob_0123abcd "),
            "{name}"
        );
        let long = session_name(&"x".repeat(100), TAG);
        assert!(long.len() <= 63, "{}", long.len());
        assert_ne!(
            session_name("a", TAG),
            session_name("a", TAG),
            "a token of its own"
        );
    }

    #[test]
    fn a_session_names_outbox_tag_is_read_back_and_an_earlier_versions_has_none() {
        let long = session_name(&"x".repeat(100), "ob_0123abcd");
        assert_eq!(outbox_tag_of(&long), Some("ob_0123abcd"));
        assert_eq!(outbox_tag_of("outbox-relay node-1 0123456789ab"), None);
        assert_eq!(outbox_tag_of("psql"), None);
    }
}
