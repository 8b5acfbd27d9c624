//! The cluster's settings: how often a node heartbeats and how long silence is tolerated.

use std::time::Duration;

/// How often a node pushes its expiry forward and renews its partition leases: often enough
/// that a lease survives a few slow statements, rarely enough to cost the database nothing.
pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(2);
/// How long a silent node stays listed, and how long a partition lease lasts: five missed
/// beats. A dead node's partitions are taken over within this time.
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);

/// Renewals a lease must survive: a node stops publishing a partition at 3/4 of its lease
/// after the last renewal, so with fewer renewals than this in that time one slow heartbeat
/// statement hands every partition over.
const RENEWALS_PER_TIMEOUT: u32 = 3;

outbox_core::settings! {
    /// What the operator sets about cluster membership (the keys of the same names).
    #[derive(Clone, Debug, PartialEq)]
    pub struct ClusterSettings {
        /// How often this node heartbeats in the nodes table.
        #[serde(with = "outbox_core::time::duration_text")]
        pub heartbeat_interval: Duration = DEFAULT_HEARTBEAT_INTERVAL,
        /// How long a silent node stays listed.
        #[serde(with = "outbox_core::time::duration_text")]
        pub heartbeat_timeout: Duration = DEFAULT_HEARTBEAT_TIMEOUT,
    }
}

/// The shortest heartbeat interval: 0 made the node heartbeat and renew its leases in a loop.
pub const MIN_HEARTBEAT_INTERVAL: Duration = Duration::from_millis(100);

impl ClusterSettings {
    /// Refuses timings under which leases would be lost without a node failing.
    pub fn validate(&self) -> Result<(), String> {
        if self.heartbeat_interval < MIN_HEARTBEAT_INTERVAL {
            return Err(format!(
                "heartbeat_interval ({:?}) must be at least {MIN_HEARTBEAT_INTERVAL:?}: each \
                 beat writes the nodes table and renews the node's leases",
                self.heartbeat_interval
            ));
        }
        if self.heartbeat_timeout < self.heartbeat_interval * RENEWALS_PER_TIMEOUT {
            return Err(format!(
                "heartbeat_timeout ({:?}) must be at least 3 x heartbeat_interval ({:?}): leases \
                 are renewed every interval, and one late renewal must not lose them",
                self.heartbeat_timeout, self.heartbeat_interval
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heartbeat_interval_of_zero_is_refused() {
        let zero = ClusterSettings {
            heartbeat_interval: Duration::ZERO,
            ..ClusterSettings::default()
        };
        assert!(zero.validate().unwrap_err().contains("heartbeat_interval"));
    }

    #[test]
    fn a_timeout_shorter_than_three_beats_is_refused() {
        ClusterSettings::default().validate().unwrap();
        let err = ClusterSettings {
            heartbeat_interval: Duration::from_secs(4),
            ..ClusterSettings::default()
        }
        .validate()
        .unwrap_err();
        assert!(err.contains("at least 3 x heartbeat_interval"), "{err}");
    }
}
