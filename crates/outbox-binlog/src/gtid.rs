//! MariaDB's GTID state: per replication domain, the last transaction's global id
//! (`domain-server-sequence`), as `@@gtid_binlog_pos` and `BINLOG_GTID_POS()` give it and as
//! a replica connects with (`@slave_connect_state`). Every server of a replication topology
//! names a transaction by the same GTID, so the state is where a reader goes on at a
//! promoted replica, whose files and offsets are its own. Pure state.

use std::collections::BTreeMap;
use std::fmt;

/// The GTID state at a place in the log: each domain's last GTID.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GtidState(BTreeMap<u32, (u32, u64)>);

impl GtidState {
    /// Reads `0-1-100,1-2-7` (an empty text is the empty state); `None` for anything else
    /// (MySQL's GTID sets are not read).
    pub fn parse(text: &str) -> Option<Self> {
        let mut state = GtidState::default();
        for gtid in text.split(',').map(str::trim).filter(|g| !g.is_empty()) {
            let (domain, server, sequence) = parse_gtid(gtid)?;
            state.0.insert(domain, (server, sequence));
        }
        Some(state)
    }

    /// The transaction `gtid` (one `domain-server-sequence`) was read: its domain is now
    /// at it. A GTID of another form leaves the state as it was and says so (`false`).
    pub fn advance(&mut self, gtid: &str) -> bool {
        match parse_gtid(gtid) {
            Some((domain, server, sequence)) => {
                self.0.insert(domain, (server, sequence));
                true
            }
            None => false,
        }
    }
}

fn parse_gtid(gtid: &str) -> Option<(u32, u32, u64)> {
    let mut parts = gtid.split('-');
    let domain = parts.next()?.parse().ok()?;
    let server = parts.next()?.parse().ok()?;
    let sequence = parts.next()?.parse().ok()?;
    parts.next().is_none().then_some((domain, server, sequence))
}

impl fmt::Display for GtidState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (domain, (server, sequence))) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{domain}-{server}-{sequence}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_keeps_each_domains_last_gtid_in_domain_order() {
        let mut state = GtidState::parse("1-2-7, 0-1-100").unwrap();
        assert_eq!(state.to_string(), "0-1-100,1-2-7");
        assert!(state.advance("0-3-101"), "a promoted server's own");
        assert!(state.advance("5-1-1"), "a new domain");
        assert_eq!(state.to_string(), "0-3-101,1-2-7,5-1-1");
        assert_eq!(GtidState::parse("").unwrap().to_string(), "");
    }

    #[test]
    fn mysqls_gtids_and_garbage_are_not_a_mariadb_state() {
        assert_eq!(
            GtidState::parse("3e11fa47-71ca-11e1-9e33-c80aa9429562:1-5"),
            None
        );
        assert_eq!(GtidState::parse("0-1"), None);
        assert_eq!(GtidState::parse("0-1-2-3"), None);
        let mut state = GtidState::default();
        assert!(!state.advance("3e11fa47-71ca-11e1-9e33-c80aa9429562:5"));
        assert_eq!(state, GtidState::default());
    }
}
