//! The engine's settings: what an operator tunes about claiming, publishing and settling.

use std::time::Duration;

use outbox_core::RetryPolicy;

/// Rows claimed per statement: the fastest drain of the sizes measured (BENCHMARKS.md, "What
/// each change bought").
pub const DEFAULT_BATCH_SIZE: usize = 1000;
/// Rows one node holds at most (claimed, not yet settled): ten claims' worth keeps a hot
/// node's lanes full while bounding what a crash hands back to other nodes.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 10_000;
/// How long a claim's lease lives; a crashed node's rows come back after this. Long enough to
/// outlive the default publish timeout, short enough that a crash delays its rows by seconds.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The safety poll with LISTEN (a lost notification costs at most this), or the polling period
/// in fixed-rate mode.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(1);
/// How long a sink may take to confirm a batch before its events are retried; shorter than
/// the row lease, which must outlive every publish of its row. Partition leases bound each
/// publish by themselves (`Engine::lease_lost`).
pub const DEFAULT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a graceful shutdown may take in all: waiting for in-flight publishes, then
/// releasing rows, closing the sinks, giving up partitions and deregistering. Within the
/// 30 s grace period that Kubernetes and systemd give before killing.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(15);

/// What the engine holds of claimed events by default, in MiB: ten thousand events of 6 KiB.
pub const DEFAULT_MEMORY_MIB: u64 = 64;
/// The most `memory_mib` may be (64 GiB): more is a typo, not a plan.
const MAX_MEMORY_MIB: u64 = 65_536;
/// How often the backlog gauges are read. Each read counts the pending rows, so on a large
/// backlog it is a scan of its own; 5 s keeps the gauges useful for alerts.
pub const DEFAULT_BACKLOG_INTERVAL: Duration = Duration::from_secs(5);

/// The largest claim: one statement's rows are held in memory and settled together.
const MAX_BATCH_SIZE: usize = 50_000;
/// The most rows a node may hold: more is a typo, not a plan (and twice it, the window a
/// claim leaving keys out looks through, must stay a count the databases take).
const MAX_IN_FLIGHT: usize = 10_000_000;
/// The shortest lease: leases are extended every third of it, and shorter ones expire between
/// two extensions on a loaded database.
const MIN_LEASE: Duration = Duration::from_millis(300);
/// The shortest publish timeout: below it, every publish times out and is sent again,
/// duplicating every event.
const MIN_PUBLISH_TIMEOUT: Duration = Duration::from_millis(100);
const MIN_POLL_INTERVAL: Duration = Duration::from_millis(10);

outbox_core::settings! {
    /// What the operator sets about the engine (the keys of the same names).
    #[derive(Clone, Debug, PartialEq)]
    pub struct EngineSettings {
        /// Rows claimed per statement.
        pub batch_size: usize = DEFAULT_BATCH_SIZE,
        /// Rows one node holds at most while publishing.
        pub max_in_flight: usize = DEFAULT_MAX_IN_FLIGHT,
        /// The most claimed events the node holds in memory, in MiB, counted by their size
        /// (payload, key, headers): no claim is made while they fill it, and a claim takes no
        /// more rows than fit at the size of the last claim's largest. One event larger than
        /// this is still claimed, alone.
        pub memory_mib: u64 = DEFAULT_MEMORY_MIB,
        /// Lease on claimed rows; a crashed node's rows return after it.
        #[serde(with = "outbox_core::time::duration_text")]
        pub lease: Duration = DEFAULT_LEASE,
        /// Safety-poll period while LISTENing, or the polling period with --poll-fixed-rate.
        #[serde(with = "outbox_core::time::duration_text")]
        pub poll_interval: Duration = DEFAULT_POLL_INTERVAL,
        /// Do not LISTEN for notifications; poll every --poll-interval instead.
        pub poll_fixed_rate: bool = false,
        /// Time a sink has to confirm a batch before it is retried; shorter than --lease, and cut
        /// short when the node's partition lease runs out.
        #[serde(with = "outbox_core::time::duration_text")]
        pub publish_timeout: Duration = DEFAULT_PUBLISH_TIMEOUT,
        /// Time a graceful shutdown waits for in-flight events.
        #[serde(with = "outbox_core::time::duration_text")]
        pub shutdown_timeout: Duration = DEFAULT_SHUTDOWN_TIMEOUT,
        /// How failed publishes are retried ([retry]): base_delay, max_delay, max_attempts,
        /// max_attempts_by_type.
        pub retry: RetryPolicy = RetryPolicy::default(),
        /// How often the backlog gauges (and the console's counts) are read; each read counts
        /// the pending rows, a scan of its own on a large backlog.
        #[serde(with = "outbox_core::time::duration_text")]
        pub backlog_interval: Duration = DEFAULT_BACKLOG_INTERVAL,
    }
}

impl EngineSettings {
    /// The memory budget in bytes.
    pub fn memory_budget(&self) -> usize {
        usize::try_from(self.memory_mib.saturating_mul(1024 * 1024)).unwrap_or(usize::MAX)
    }

    /// Rows of one ordering key past which claims leave the key out: a quarter of
    /// `max_in_flight`, so that a key slow to confirm leaves the node's other three
    /// quarters to the other keys (a lane publishes one head at a time anyway).
    pub fn key_share(&self) -> usize {
        (self.max_in_flight / 4).max(1)
    }

    /// How many rows a claim may take with `held_bytes` held, each row expected to cost
    /// `row_bytes`. At least one when nothing is held. Before any row was seen (`None`),
    /// one: rows taken as 1 MiB each, a start-up backlog of 8 MiB events was claimed 64 at
    /// once (eight times the default budget), and claimed again after each OOM kill.
    pub fn rows_that_fit(&self, held_bytes: usize, row_bytes: Option<usize>) -> usize {
        let Some(row_bytes) = row_bytes else {
            return 1;
        };
        let room = self.memory_budget().saturating_sub(held_bytes);
        let fit = room / row_bytes.max(1);
        if held_bytes == 0 {
            fit.max(1)
        } else {
            fit
        }
    }

    /// Refuses values the engine cannot work with, naming the setting and the fix.
    pub fn validate(&self) -> Result<(), String> {
        if self.batch_size == 0 || self.batch_size > MAX_BATCH_SIZE {
            return Err(format!(
                "batch_size must be between 1 and {MAX_BATCH_SIZE} (got {})",
                self.batch_size
            ));
        }
        if !(1..=MAX_MEMORY_MIB).contains(&self.memory_mib) {
            return Err(format!(
                "memory_mib must be between 1 and {MAX_MEMORY_MIB} (got {}): it is the MiB of \
                 claimed events the node may hold",
                self.memory_mib
            ));
        }
        if self.max_in_flight > MAX_IN_FLIGHT {
            return Err(format!(
                "max_in_flight must be at most {MAX_IN_FLIGHT} (got {}): it is the rows one node \
                 holds while publishing",
                self.max_in_flight
            ));
        }
        if self.max_in_flight < self.batch_size {
            return Err(format!(
                "max_in_flight ({}) must be at least batch_size ({})",
                self.max_in_flight, self.batch_size
            ));
        }
        if self.lease < MIN_LEASE {
            return Err(format!(
                "lease must be at least 300ms (got {:?})",
                self.lease
            ));
        }
        // Each tick is a claim: a shorter interval is a busy loop against the database.
        if self.poll_interval < MIN_POLL_INTERVAL {
            return Err(format!(
                "poll_interval must be at least 10ms (got {:?}): each tick sends a claim to the \
                 database",
                self.poll_interval
            ));
        }
        if self.backlog_interval < Duration::from_secs(1) {
            return Err(format!(
                "backlog_interval must be at least 1s (got {:?}): each read counts the pending \
                 rows",
                self.backlog_interval
            ));
        }
        if self.publish_timeout < MIN_PUBLISH_TIMEOUT {
            return Err(format!(
                "publish_timeout must be at least 100ms (got {:?}): every publish would time out \
                 and be sent again",
                self.publish_timeout
            ));
        }
        // Zero abandoned every publish in flight at each SIGTERM: their rows came back after
        // the lease and went out again.
        if self.shutdown_timeout.is_zero() {
            return Err(
                "shutdown_timeout must be more than 0: a graceful shutdown waits this long for \
                 the events in flight to be confirmed (a few seconds, as publish_timeout)"
                    .to_string(),
            );
        }
        // A row lease stops guarding its row when it runs out: a publish still waiting then
        // can be confirmed after another node took the row and published the key's next
        // events. (Partition leases bound each publish by themselves, see the engine.)
        if self.publish_timeout >= self.lease {
            return Err(format!(
                "publish_timeout ({:?}) must be shorter than lease ({:?}): a publish must not \
                 outlive the lease on its row",
                self.publish_timeout, self.lease
            ));
        }
        self.retry.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_consistent() {
        EngineSettings::default().validate().unwrap();
    }

    #[test]
    fn impossible_timings_are_refused_by_name() {
        let refused = |s: EngineSettings| s.validate().unwrap_err();
        let err = refused(EngineSettings {
            publish_timeout: Duration::from_nanos(1),
            ..EngineSettings::default()
        });
        assert!(
            err.contains("publish_timeout must be at least 100ms"),
            "{err}"
        );
        let err = refused(EngineSettings {
            publish_timeout: Duration::from_secs(45),
            ..EngineSettings::default()
        });
        assert!(err.contains("shorter than lease"), "{err}");
        let err = refused(EngineSettings {
            shutdown_timeout: Duration::ZERO,
            ..EngineSettings::default()
        });
        assert!(
            err.contains("shutdown_timeout must be more than 0"),
            "{err}"
        );
        let err = refused(EngineSettings {
            batch_size: 2000,
            max_in_flight: 1000,
            ..EngineSettings::default()
        });
        assert!(err.contains("max_in_flight (1000)"), "{err}");
        let err = refused(EngineSettings {
            max_in_flight: usize::MAX,
            ..EngineSettings::default()
        });
        assert!(err.contains("max_in_flight must be at most"), "{err}");
        let err = refused(EngineSettings {
            backlog_interval: Duration::from_millis(10),
            ..EngineSettings::default()
        });
        assert!(
            err.contains("backlog_interval must be at least 1s"),
            "{err}"
        );
        let err = refused(EngineSettings {
            poll_interval: Duration::from_nanos(1),
            ..EngineSettings::default()
        });
        assert!(err.contains("poll_interval must be at least 10ms"), "{err}");
        let err = refused(EngineSettings {
            retry: outbox_core::RetryPolicy {
                base_delay: Duration::ZERO,
                max_delay: Duration::ZERO,
                ..Default::default()
            },
            ..EngineSettings::default()
        });
        assert!(
            err.contains("retry.base_delay must be at least 10ms"),
            "{err}"
        );
        let err = refused(EngineSettings {
            retry: outbox_core::RetryPolicy {
                max_attempts_by_type: [("order.placed".to_string(), 0)].into(),
                ..Default::default()
            },
            ..EngineSettings::default()
        });
        assert!(
            err.contains("retry.max_attempts_by_type.order.placed must be at least 1"),
            "{err}"
        );
    }
}
