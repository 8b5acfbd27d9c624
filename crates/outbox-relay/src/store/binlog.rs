//! Binlog capture's tables (the parked rows, the stored position), what `check` verifies of
//! the server, and the reader's start (`--capture binlog`, MySQL/MariaDB: the native table,
//! the MySQL seed's `outbox_events` and custom mappings that fit, see [`BinlogCapture::new`]).

use std::sync::Arc;
use std::time::Duration;

use outbox_binlog::{BinlogConfig, BinlogStore, BinlogStoreOptions, SeatConfig, StillReading};
use outbox_core::store::Problem;
use outbox_core::{NodeId, StoreError, StoreErrorKind};
use outbox_store_mysql::{MySqlOptions, MySqlStore};

/// The names binlog capture works with, resolved from the settings.
#[derive(Clone, Debug)]
pub struct BinlogSettings {
    /// This relay's server id as a replica of the server ([`default_server_id`]).
    pub server_id: u32,
}

/// Binlog capture of one outbox: its tables and the store over its parked rows.
#[derive(Clone)]
pub struct BinlogCapture {
    pub url: String,
    pub server_id: u32,
    pub database: String,
    pub table: String,
    /// The outbox table's layout (the native table's, or a mapped one's).
    pub mapping: outbox_layout::Mapping,
    pub parked_table: String,
    pub positions_table: String,
    /// The polling store over the parked table: the engine's parked rows and every dead
    /// letter of binlog capture (`dead list`, `dead retry` act on it).
    pub parked: MySqlStore,
    /// Whether the outbox is a BLACKHOLE table, once read ([`BinlogCapture::is_blackhole`]).
    blackhole: std::sync::OnceLock<bool>,
}

/// How long a standby waits after the active reader's last write (SIGSTOP, a frozen VM):
/// the reader renews it every third of it.
const SEAT_LEASE: Duration = Duration::from_secs(15);

/// A server id for the relay that no real replica is likely to have: the database, table
/// and node id hashed (FNV-1a) into the upper half of the 31-bit range. Each node of an outbox
/// reads with an id of its own: a server that sees a second reader with an id ends the
/// first's stream, and waits for it to end, which a paused reader whose socket is full does
/// only after `net_write_timeout` (a minute by default): the standby taking over would read
/// nothing meanwhile.
pub fn default_server_id(database: &str, table: &str, node: &str) -> u32 {
    let mut hash: u32 = 0x811c_9dc5;
    for byte in format!("{database}.{table}/{node}").bytes() {
        hash = (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193);
    }
    0x4000_0000 | (hash & 0x3fff_ffff)
}

impl BinlogCapture {
    /// The capture of the outbox `options` names. A mapped table is captured when binlog
    /// capture can read it: an integer row id (what delivered rows are settled by, and what
    /// an event id is derived from where the table has none), and a JSON payload (parked
    /// rows keep it in the native layout's `json` column).
    pub fn new(options: &MySqlOptions, settings: &BinlogSettings) -> Result<Self, StoreError> {
        let config =
            |e: outbox_binlog::BinlogError| StoreError::new(StoreErrorKind::Config, e.to_string());
        let mapping = &options.mapping;
        let refuse = |what: &str| {
            Err(StoreError::new(
                StoreErrorKind::Config,
                format!(
                    "binlog capture of the table {} needs {what}; use --capture poll with it",
                    mapping.table
                ),
            ))
        };
        if mapping.id_type != outbox_layout::IdType::Integer {
            return refuse("an integer row id (`id_type = \"integer\"`)");
        }
        if mapping.payload_format != outbox_layout::PayloadFormat::Json {
            return refuse("a JSON payload (`payload_format = \"json\"`)");
        }
        // What polling reads from other columns or tables, which capture does not (yet):
        // refused rather than dropped.
        let unread = [
            ("traceparent", mapping.traceparent.is_some()),
            ("tracestate", mapping.tracestate.is_some()),
            ("span_context", mapping.span_context.is_some()),
            ("event_id_header", mapping.event_id_header.is_some()),
            ("max_attempts_from", mapping.max_attempts_from.is_some()),
        ];
        if let Some((setting, _)) = unread.iter().find(|(_, set)| *set) {
            return refuse(&format!(
                "no `{setting}` in its mapping (binlog capture does not read it)"
            ));
        }
        let database = match &options.mapping.schema {
            Some(database) => database.clone(),
            None => outbox_binlog::database_of(&options.url).map_err(config)?,
        };
        let table = options.mapping.table.clone();
        let parked_table = format!("{table}_parked");
        let parked = MySqlStore::new(MySqlOptions {
            mapping: outbox_layout::Mapping {
                waiting_rows_block_their_key: true,
                ..outbox_layout::Mapping::native_mysql(
                    options.mapping.schema.as_deref(),
                    &parked_table,
                    false,
                )
            },
            nodes_table: None,
            operation_timeout: None,
            ..options.clone()
        })?;
        Ok(BinlogCapture {
            url: options.url.clone(),
            server_id: settings.server_id,
            positions_table: format!("{table}_binlog"),
            database,
            table,
            mapping: mapping.clone(),
            parked_table,
            parked,
            blackhole: std::sync::OnceLock::new(),
        })
    }

    /// `database.table`: the outbox's key in the positions table, and its lock's.
    fn outbox_key(&self) -> String {
        format!("{}.{}", self.database, self.table)
    }

    /// Whether the outbox is the native table (the BLACKHOLE form is one of its).
    fn native(&self) -> bool {
        self.mapping.seed == Some(outbox_layout::Seed::NativeMysql)
    }

    /// Adds what later versions keep in binlog capture's tables to ones made before (the
    /// positions table's GTID columns, the parked table's index of waiting keys);
    /// idempotent. `migrate` runs it after [`BinlogCapture::ddl`].
    pub async fn upgrade(&self) -> Result<(), StoreError> {
        let fail = |e| StoreError::new(StoreErrorKind::Query, format!("binlog capture: {e}"));
        outbox_binlog::upgrade_positions(
            &self.url,
            &format!("{}.{}", self.database, self.positions_table),
        )
        .await
        .map_err(fail)?;
        outbox_binlog::upgrade_parked(&self.url, &self.database, &self.parked_table)
            .await
            .map_err(fail)
    }

    /// The parked table ([`outbox_binlog::parked_ddl`]: the native layout's columns and
    /// the index of its waiting keys, InnoDB) and the positions table; idempotent.
    pub fn ddl(&self) -> String {
        let db = &self.database;
        let parked = outbox_binlog::parked_ddl(db, &self.parked_table);
        format!(
            "{parked}{}",
            outbox_binlog::positions_ddl(&format!("{db}.{}", self.positions_table))
        )
    }

    /// The privileges binlog capture adds to the polling store's.
    pub fn grants(&self, role: &str) -> String {
        let db = &self.database;
        format!(
            "-- Binlog capture reads the binary log as a replica would, and keeps parked rows and\n\
             -- its position in tables of its own.\n\
             GRANT REPLICATION SLAVE, REPLICATION CLIENT ON *.* TO '{role}'@'%';\n\
             -- MySQL 8 with GTIDs: the first position's GTID set, read with the position under\n\
             -- one lock (performance_schema.log_status), which a failover goes on from:\n\
             -- GRANT BACKUP_ADMIN ON *.* TO '{role}'@'%';\n\
             GRANT SELECT, INSERT, UPDATE, DELETE ON `{db}`.`{}` TO '{role}'@'%';\n\
             GRANT SELECT, INSERT, UPDATE ON `{db}`.`{}` TO '{role}'@'%';\n",
            self.parked_table, self.positions_table
        )
    }

    /// A reader's configuration for `check`'s look at the server's log: a server id of its
    /// own, so that it takes no running relay's stream (MySQL ends a reader's stream when
    /// another comes with its id).
    fn probe_config(&self) -> BinlogConfig {
        BinlogConfig {
            // In the upper half, as the relays' default ids are, and never this relay's.
            server_id: (self.server_id ^ 0x15A5_A5A5) | 0x4000_0000,
            ..self.reader_config()
        }
    }

    /// The reader's configuration: the server, the relay's server id, the outbox table.
    fn reader_config(&self) -> BinlogConfig {
        BinlogConfig {
            url: self.url.clone(),
            server_id: self.server_id,
            database: self.database.clone(),
            table: self.table.clone(),
        }
    }

    /// How to go on once the stored position cannot be read on from (its log purged,
    /// another server's, unreadable): forget the position (a file of '' is a position never
    /// stored, and the epoch is kept), and the next start adopts the
    /// rows still in the outbox table (the events of transactions whose rows were delivered
    /// and deleted are not lost: they were delivered). A BLACKHOLE outbox (`blackhole`)
    /// stores nothing to adopt: the events are in the binary log only, and lost where no
    /// server's log still has them.
    pub fn recovery(&self, blackhole: bool) -> String {
        // An UPDATE, never a DELETE: the row's epoch fences a paused ex-reader's writes, and
        // a row made again would start it over at 0, where that reader's epoch may be valid.
        let forget = forget_position(&self.database, &self.positions_table, &self.outbox_key());
        if blackhole {
            return format!(
                "the outbox is a BLACKHOLE table, which stores nothing: the events committed \
                 since that position are in the binary log only, and where it no longer has \
                 them they are lost. The way back: point the relay (--database-url) at a \
                 server whose binary logs still cover them (a replica that has them, with \
                 GTIDs on: the relay goes on there after the stored GTID state); where none \
                 does, rebuild those events from the application's own records. Then, to \
                 read on from the server's current position, forget the position ({forget}) \
                 and start the relay: it adopts nothing, the table holds no rows"
            );
        }
        format!(
            "the events committed since that position and still in the outbox table are not \
             lost: forget the position ({forget}) and start the relay, which adopts the rows \
             still in the table and reads on from the server's current position"
        )
    }

    /// What the server needs, as `migrate --print` states it, with the table-less form's
    /// table.
    pub fn server_requirements(&self) -> String {
        let needs = "-- Binlog capture needs, on the server (the relay checks each at `check`):\n\
             --   log_bin on, binlog_format = ROW, binlog_row_image = FULL,\n\
             --   log_bin_compress = OFF (MariaDB; MySQL 8's compressed transactions are read),\n\
             --   a binlog_expire_logs_seconds (expire_logs_days) longer than the relay may be off,\n\
             --   and a binlog_server_id no replica or other relay of the server uses (unset, each\n\
             --   outbox derives its own from its database and table).\n";
        if !self.native() {
            return needs.to_string();
        }
        let blackhole: String = outbox_binlog::blackhole_ddl(&self.table)
            .lines()
            .map(|line| format!("--   {line}\n"))
            .collect();
        format!(
            "{needs}-- The table-less form: create the outbox table with ENGINE=BLACKHOLE instead, before\n\
             -- migrating (the relay reads its rows from the log; `check` says whether the server\n\
             -- has the engine):\n{blackhole}"
        )
    }

    /// What keeps binlog capture from running, each with its fix: the server's settings and
    /// the role's privileges, and a stored position the server's logs no longer reach.
    pub async fn problems(&self) -> Result<Vec<Problem>, StoreError> {
        let mut problems = outbox_binlog::server_problems(&self.url, &self.database)
            .await
            .map_err(read_failed)?;
        let stored = outbox_binlog::stored_position(
            &self.url,
            &format!("{}.{}", self.database, self.positions_table),
            &self.outbox_key(),
        )
        .await;
        let server = outbox_binlog::server_id(&self.url)
            .await
            .map_err(read_failed)?;
        problems.extend(
            outbox_binlog::server_id_problems(&self.reader_config())
                .await
                .map_err(read_failed)?,
        );
        let blackhole = self.is_blackhole().await?;
        let resumed = match &stored {
            Ok(Some(stored)) => Some(outbox_binlog::capture::resume(
                &stored.position,
                stored.server_id,
                server,
            )),
            _ => None,
        };
        match stored {
            // Another server's position (a failover): the relay goes on after its GTID
            // state, or refuses without one; its file names say nothing of this server's.
            Ok(Some(_)) if !matches!(resumed, Some(Ok(outbox_binlog::capture::Resume::At(_)))) => {
                let refused = match resumed {
                    Some(Err(e)) => Some(e),
                    Some(Ok(outbox_binlog::capture::Resume::AfterGtid(gtid))) => {
                        outbox_binlog::gtid_resume_refused(&self.probe_config(), &gtid).await
                    }
                    _ => None,
                };
                if let Some(e) = refused {
                    problems.push(Problem::blocking(e.to_string(), self.recovery(blackhole)));
                }
            }
            Ok(Some(stored)) => {
                let stored = stored.position;
                let logs = match outbox_binlog::binary_logs(&self.url).await {
                    Ok(logs) => logs,
                    // A role without REPLICATION CLIENT: named above already, with its
                    // grant, which is the fix (not "the database is unreachable").
                    Err(e) if e.store_kind() == StoreErrorKind::Privilege => {
                        if !problems
                            .iter()
                            .any(|p| p.what.contains("REPLICATION CLIENT"))
                        {
                            problems.push(Problem::blocking(
                                format!("the role may not list the binary logs: {e}"),
                                "GRANT REPLICATION CLIENT ON *.* TO <the relay's role> \
                                 (MariaDB 10.5+ also names it BINLOG MONITOR)",
                            ));
                        }
                        return Ok(problems);
                    }
                    Err(e) => return Err(read_failed(e)),
                };
                let problem = outbox_binlog::retention_problem(&stored, &logs, blackhole);
                let reset = match problem {
                    Some(_) => None,
                    None => outbox_binlog::reset_log_refused(&self.url, &stored).await,
                };
                problems.extend(problem.map(|mut problem| {
                    if !problem.is_degraded() {
                        problem.fix = self.recovery(blackhole);
                    }
                    problem
                }));
                if let Some(e) = reset {
                    problems.push(Problem::blocking(e.to_string(), self.recovery(blackhole)));
                }
            }
            Ok(None) => {}
            Err(e) => problems.push(Problem::blocking(
                format!("binlog capture's positions table cannot be read: {e}"),
                "run `outbox-relay migrate --capture binlog`",
            )),
        }
        if blackhole {
            problems.extend(
                outbox_binlog::blackhole_problem(&self.url)
                    .await
                    .map_err(read_failed)?,
            );
        }
        problems.extend(
            outbox_binlog::parked_table_problem(&self.url, &self.database, &self.parked_table)
                .await
                .unwrap_or_default(),
        );
        problems.extend(
            outbox_binlog::parked_index_problem(&self.url, &self.database, &self.parked_table)
                .await
                .unwrap_or_default(),
        );
        Ok(problems)
    }

    /// Whether the outbox is the table-less form's BLACKHOLE table, read once; false while
    /// the table does not exist (the polling store's checks then say so, with the fix).
    pub async fn is_blackhole(&self) -> Result<bool, StoreError> {
        if let Some(known) = self.blackhole.get() {
            return Ok(*known);
        }
        match outbox_binlog::is_blackhole(&self.url, &self.database, &self.table).await {
            Ok(blackhole) => Ok(*self.blackhole.get_or_init(|| blackhole)),
            Err(outbox_binlog::BinlogError::Config(_)) => Ok(false),
            Err(e) => Err(read_failed(e)),
        }
    }

    /// What the table-less form's table lacks, each with its fix.
    pub async fn blackhole_table_problems(&self) -> Result<Vec<Problem>, StoreError> {
        outbox_binlog::blackhole_table_problems(&self.url, &self.database, &self.table)
            .await
            .map_err(read_failed)
    }

    /// Starts the reader: the store the engine claims from.
    pub async fn start(
        &self,
        main: &MySqlStore,
        run: BinlogRun,
    ) -> Result<BinlogStore, StoreError> {
        let config = |e: outbox_binlog::BinlogError| {
            StoreError::new(StoreErrorKind::Config, format!("binlog capture: {e}"))
        };
        let blackhole = outbox_binlog::is_blackhole(&self.url, &self.database, &self.table)
            .await
            .map_err(config)?;
        if blackhole && !self.native() {
            return Err(StoreError::new(
                StoreErrorKind::Config,
                format!(
                    "the table {}.{} is a BLACKHOLE table: the table-less form is the native \
                     layout's (`outbox-relay migrate --capture binlog` creates its columns)",
                    self.database, self.table
                ),
            ));
        }
        BinlogStore::start(BinlogStoreOptions {
            binlog: self.reader_config(),
            mapping: self.mapping.clone(),
            seat: SeatConfig {
                url: self.url.clone(),
                positions: format!("{}.{}", self.database, self.positions_table),
                outbox: self.outbox_key(),
                holder: run.node.0.clone(),
                lease: SEAT_LEASE,
            },
            parked_table: format!("{}.{}", self.database, self.parked_table),
            recovery: self.recovery(blackhole),
            blackhole,
            drain: run.drain,
            memory_budget: run.memory_budget,
            max_in_flight: run.max_in_flight,
            parked: Arc::new(self.parked.clone()),
            main: Arc::new(main.clone()),
            on_reading_stopped: Some({
                let parked = self.parked.clone();
                Arc::new(move || {
                    let parked = parked.clone();
                    tokio::spawn(async move { parked.step_down().await });
                })
            }),
            // The seat was free, or taken from a holder whose lease lapsed and whose seat
            // connection was ended: a session of that relay still holding the parked
            // table's lock is stale too.
            on_reading_started: Some({
                let parked = self.parked.clone();
                Arc::new(move |still_reading: StillReading| {
                    let parked = parked.clone();
                    // Tried again every second while this relay reads: a lock left with a
                    // paused ex-reader holds every parked row (and the later rows of their
                    // keys) for that relay's wait_timeout, 8 hours by default.
                    tokio::spawn(async move {
                        let mut said = false;
                        while still_reading() {
                            match parked.take_over(SEAT_LEASE, &*still_reading).await {
                                Ok(true) => return,
                                Ok(false) if !said => tracing::warn!("the parked table's lock is still held by a relay that no longer reads the binary log; trying again every second"),
                                Err(e) if !said => tracing::error!(error = %e, "could not take the parked table's lock from a relay that no longer reads the binary log; trying again every second"),
                                _ => {}
                            }
                            said = true;
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                    });
                })
            }),
        })
        .map_err(config)
    }
}

/// The statement that forgets the stored position of the outbox `key` in
/// `database`.`positions`, its names and key quoted: a backquote in a name, a quote or a
/// backslash in the key would otherwise break it, or make it another statement.
fn forget_position(database: &str, positions: &str, key: &str) -> String {
    use outbox_binlog::{quote_identifier, quote_string};
    format!(
        "UPDATE {}.{} SET log_file = '', log_offset = 0, server_id = NULL, gtid = NULL \
         WHERE outbox = {}",
        quote_identifier(database),
        quote_identifier(positions),
        quote_string(key)
    )
}

/// A failure to read what the server has (its settings, a table's engine or columns).
fn read_failed(e: outbox_binlog::BinlogError) -> StoreError {
    StoreError::new(e.store_kind(), format!("binlog capture: {e}"))
}

/// What the reader takes from the rest of the run.
pub struct BinlogRun {
    pub node: NodeId,
    pub memory_budget: usize,
    /// The engine's `max_in_flight`.
    pub max_in_flight: usize,
    pub drain: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_server_id_is_each_nodes_own_and_stays_clear_of_small_ids() {
        let id = default_server_id("shop", "outbox", "node-1");
        assert_eq!(id, default_server_id("shop", "outbox", "node-1"), "stable");
        assert_ne!(
            id,
            default_server_id("shop", "outbox", "node-2"),
            "a standby's own"
        );
        assert_ne!(id, default_server_id("shop", "other", "node-1"));
        assert!((0x4000_0000..0x8000_0000).contains(&id), "{id}");
    }

    /// The advised statement escaped only the key's quotes: a backquote in the database's or
    /// table's name, or a backslash in the key (which is `database.table`), broke it.
    #[test]
    fn the_recovery_statement_quotes_its_names_and_key() {
        assert_eq!(
            forget_position("sh`op", "out\\box_binlog", "sh`op.out\\box's"),
            "UPDATE `sh``op`.`out\\box_binlog` SET log_file = '', log_offset = 0, \
             server_id = NULL, gtid = NULL WHERE outbox = 'sh`op.out\\\\box''s'"
        );
        assert_eq!(
            forget_position("shop", "outbox_binlog", "shop.outbox"),
            "UPDATE `shop`.`outbox_binlog` SET log_file = '', log_offset = 0, server_id = NULL, \
             gtid = NULL WHERE outbox = 'shop.outbox'"
        );
    }
}
