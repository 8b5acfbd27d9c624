//! The GTID state at a place in the binary log: the same place on every server of a
//! replication topology, since each server names a transaction by the same global id, where
//! files and offsets are each server's own. It is where a reader goes on at a promoted
//! replica. Pure state.
//!
//! Each server family writes its own form, and a state holds one of them:
//! - MariaDB: per replication domain, the last transaction's GTID (`domain-server-sequence`),
//!   as `@@gtid_binlog_pos` and `BINLOG_GTID_POS()` give it and as a replica connects with
//!   (`@slave_connect_state`);
//! - MySQL: the set of every transaction executed, per source UUID (and, from 8.4, per tag)
//!   a list of intervals (`uuid:1-5:7,uuid2:1-3`, `uuid:1-5:tag:1-2`), as `@@gtid_executed`
//!   gives it and as a replica connects with (`COM_BINLOG_DUMP_GTID`).
//!
//! Written from MySQL's documentation ("GTID Format and Storage"); only MariaDB's form is
//! tested against a server here.

use std::collections::BTreeMap;
use std::fmt;

/// The GTID state at a place in the log.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GtidState {
    /// MariaDB: each domain's last GTID, as (server, sequence).
    domains: BTreeMap<u32, (u32, u64)>,
    /// MySQL: per source (its UUID, then its tag, empty for untagged), the transactions
    /// executed, as sorted, disjoint, non-adjacent inclusive intervals.
    sources: BTreeMap<(uuid::Uuid, String), Vec<(u64, u64)>>,
}

impl GtidState {
    /// Reads either form (an empty text is the empty state; MySQL's line breaks after
    /// commas are allowed); `None` for anything else, or for the two forms mixed.
    pub fn parse(text: &str) -> Option<Self> {
        let mut state = GtidState::default();
        for item in text.split(',').map(str::trim).filter(|g| !g.is_empty()) {
            if item.contains(':') {
                state.add_mysql_group(item)?;
            } else {
                let (domain, server, sequence) = parse_mariadb_gtid(item)?;
                state.domains.insert(domain, (server, sequence));
            }
        }
        (state.domains.is_empty() || state.sources.is_empty()).then_some(state)
    }

    /// Whether the state is in MySQL's form (a reader then asks for the transactions not in
    /// the set, rather than for those after each domain's last).
    pub fn is_mysql(&self) -> bool {
        !self.sources.is_empty()
    }

    /// Whether it names no transaction at all: as a place to go on from on another server,
    /// that is the start of its whole history, which is never what a reader meant.
    pub fn is_empty(&self) -> bool {
        self.domains.is_empty() && self.sources.is_empty()
    }

    /// The transaction `gtid` was read: MariaDB's `domain-server-sequence` makes it its
    /// domain's last; MySQL's `uuid:number` (or `uuid:tag:number`) joins the set. A GTID of
    /// another form, or of the other family, leaves the state as it was and says so
    /// (`false`).
    pub fn advance(&mut self, gtid: &str) -> bool {
        if let Some((domain, server, sequence)) = parse_mariadb_gtid(gtid) {
            if self.sources.is_empty() {
                self.domains.insert(domain, (server, sequence));
                return true;
            }
            return false;
        }
        let Some((source, number)) = parse_mysql_gtid(gtid) else {
            return false;
        };
        if !self.domains.is_empty() {
            return false;
        }
        add_interval(self.sources.entry(source).or_default(), (number, number));
        true
    }

    /// MySQL's form, one text per source as `uuid[:tag]:a-b:c`: what a replica names in
    /// `COM_BINLOG_DUMP_GTID`, one entry each.
    pub fn mysql_sources(&self) -> Vec<String> {
        self.sources
            .iter()
            .map(|((uuid, tag), intervals)| {
                let mut text = uuid.to_string();
                if !tag.is_empty() {
                    text.push(':');
                    text.push_str(tag);
                }
                write_intervals(&mut text, intervals);
                text
            })
            .collect()
    }

    /// A `uuid:…` group: intervals, and (MySQL 8.4) tags that name the source of the
    /// intervals after them.
    fn add_mysql_group(&mut self, group: &str) -> Option<()> {
        let mut parts = group.split(':').map(str::trim);
        let uuid = uuid::Uuid::parse_str(parts.next()?).ok()?;
        let mut tag = String::new();
        let mut any = false;
        for part in parts {
            if part.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_') {
                tag = valid_tag(part)?;
                continue;
            }
            let interval = match part.split_once('-') {
                Some((start, end)) => (gno(start)?, gno(end)?),
                None => {
                    let number = gno(part)?;
                    (number, number)
                }
            };
            if interval.0 > interval.1 {
                return None;
            }
            add_interval(
                self.sources.entry((uuid, tag.clone())).or_default(),
                interval,
            );
            any = true;
        }
        any.then_some(())
    }
}

/// A MySQL 8.4 tag: a letter or `_`, then up to 31 letters, digits or `_` (kept lowercase,
/// as the server does).
fn valid_tag(tag: &str) -> Option<String> {
    let ok = tag.len() <= 32 && tag.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    ok.then(|| tag.to_ascii_lowercase())
}

fn parse_mariadb_gtid(gtid: &str) -> Option<(u32, u32, u64)> {
    let mut parts = gtid.split('-');
    let domain = parts.next()?.parse().ok()?;
    let server = parts.next()?.parse().ok()?;
    let sequence = parts.next()?.parse().ok()?;
    parts.next().is_none().then_some((domain, server, sequence))
}

/// `uuid:number` or `uuid:tag:number`.
fn parse_mysql_gtid(gtid: &str) -> Option<((uuid::Uuid, String), u64)> {
    let mut parts = gtid.split(':');
    let uuid = uuid::Uuid::parse_str(parts.next()?).ok()?;
    let (tag, number) = match (parts.next()?, parts.next()) {
        (number, None) => (String::new(), number),
        (tag, Some(number)) => (valid_tag(tag)?, number),
    };
    let number = gno(number)?;
    parts.next().is_none().then_some(((uuid, tag), number))
}

/// A MySQL transaction number: 1 to 2^63 - 1.
fn gno(text: &str) -> Option<u64> {
    let number: u64 = text.trim().parse().ok()?;
    (1..=i64::MAX as u64).contains(&number).then_some(number)
}

/// Adds `new` to sorted, disjoint, non-adjacent intervals, merging what it touches.
fn add_interval(intervals: &mut Vec<(u64, u64)>, new: (u64, u64)) {
    let (mut start, mut end) = new;
    // The intervals that overlap or touch `new` form one run: they merge into it.
    let first = intervals.partition_point(|&(_, e)| e.saturating_add(1) < start);
    let mut last = first;
    while last < intervals.len() && intervals[last].0 <= end.saturating_add(1) {
        start = start.min(intervals[last].0);
        end = end.max(intervals[last].1);
        last += 1;
    }
    intervals.splice(first..last, [(start, end)]);
}

fn write_intervals(text: &mut String, intervals: &[(u64, u64)]) {
    use std::fmt::Write;
    for (start, end) in intervals {
        let _ = match start == end {
            true => write!(text, ":{start}"),
            false => write!(text, ":{start}-{end}"),
        };
    }
}

impl fmt::Display for GtidState {
    /// MariaDB's `0-1-100,1-2-7`; MySQL's `uuid:1-5:tag:1-2,uuid2:3`, each UUID's untagged
    /// intervals before its tags.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut items: Vec<String> = self
            .domains
            .iter()
            .map(|(domain, (server, sequence))| format!("{domain}-{server}-{sequence}"))
            .collect();
        let mut current: Option<uuid::Uuid> = None;
        for ((uuid, tag), intervals) in &self.sources {
            if current != Some(*uuid) {
                items.push(uuid.to_string());
                current = Some(*uuid);
            }
            let text = items.last_mut().expect("pushed above");
            if !tag.is_empty() {
                text.push(':');
                text.push_str(tag);
            }
            write_intervals(text, intervals);
        }
        f.write_str(&items.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "3e11fa47-71ca-11e1-9e33-c80aa9429562";
    const B: &str = "4f22ab58-82db-22f2-af44-d91bb0530673";

    #[test]
    fn a_state_keeps_each_domains_last_gtid_in_domain_order() {
        let mut state = GtidState::parse("1-2-7, 0-1-100").unwrap();
        assert_eq!(state.to_string(), "0-1-100,1-2-7");
        assert!(state.advance("0-3-101"), "a promoted server's own");
        assert!(state.advance("5-1-1"), "a new domain");
        assert_eq!(state.to_string(), "0-3-101,1-2-7,5-1-1");
        assert_eq!(GtidState::parse("").unwrap().to_string(), "");
        assert!(!state.is_mysql());
    }

    #[test]
    fn a_mysql_set_reads_as_the_server_prints_it_and_grows_by_each_transaction() {
        let printed = format!("{B}:1-3,\n{A}:1-5:7");
        let mut state = GtidState::parse(&printed).unwrap();
        assert!(state.is_mysql());
        assert_eq!(state.to_string(), format!("{A}:1-5:7,{B}:1-3"));
        assert!(state.advance(&format!("{A}:6")), "fills the gap");
        assert_eq!(state.to_string(), format!("{A}:1-7,{B}:1-3"));
        assert!(state.advance(&format!("{A}:9")));
        assert!(state.advance(&format!("{A}:8")), "joins both sides");
        assert!(state.advance(&format!("{A}:3")), "already in: no change");
        assert_eq!(state.to_string(), format!("{A}:1-9,{B}:1-3"));
        assert_eq!(
            state.mysql_sources(),
            vec![format!("{A}:1-9"), format!("{B}:1-3")]
        );
    }

    #[test]
    fn mysql_84_tags_name_sources_of_their_own() {
        let mut state = GtidState::parse(&format!("{A}:1-5:Batch:1-2:3")).unwrap();
        assert_eq!(state.to_string(), format!("{A}:1-5:batch:1-3"));
        assert!(state.advance(&format!("{A}:batch:4")));
        assert!(state.advance(&format!("{A}:6")));
        assert_eq!(state.to_string(), format!("{A}:1-6:batch:1-4"));
        assert_eq!(
            state.mysql_sources(),
            vec![format!("{A}:1-6"), format!("{A}:batch:1-4")]
        );
    }

    #[test]
    fn garbage_and_mixed_forms_are_not_a_state() {
        for text in [
            "0-1",
            "0-1-2-3",
            "not-a-uuid:1-5",
            A,
            &format!("{A}:0-3"),
            &format!("{A}:5-3"),
            &format!("{A}:1-x"),
            &format!("{A}:a-tag:1"),
            &format!("{A}:{}:1", "t".repeat(33)),
            &format!("{A}:1-{}", u64::MAX),
            &format!("0-1-100,{A}:1-5"),
        ] {
            assert_eq!(GtidState::parse(text), None, "{text}");
        }
        let mut mariadb = GtidState::parse("0-1-100").unwrap();
        assert!(
            !mariadb.advance(&format!("{A}:5")),
            "the other family's GTID"
        );
        let mut mysql = GtidState::parse(&format!("{A}:1-5")).unwrap();
        assert!(!mysql.advance("0-1-101"));
        assert!(!mysql.advance(&format!("{A}:0")));
        assert!(
            !mysql.advance(&format!("{A}:{}", i64::MAX as u64 + 1)),
            "past MySQL's"
        );
        assert_eq!(mysql.to_string(), format!("{A}:1-5"));
        assert!(GtidState::parse("").unwrap().is_empty());
    }

    #[test]
    fn intervals_merge_whatever_order_transactions_arrive_in() {
        // A replica applying in parallel commits out of order: the set is the same.
        let orders: [&[u64]; 3] = [&[1, 2, 3, 4, 5], &[5, 3, 1, 4, 2], &[2, 4, 1, 5, 3]];
        for order in orders {
            let mut intervals = Vec::new();
            for &n in order {
                add_interval(&mut intervals, (n, n));
            }
            assert_eq!(intervals, vec![(1, 5)], "{order:?}");
        }
        let mut intervals = vec![(1, 2), (5, 6), (9, 10)];
        add_interval(&mut intervals, (3, 8));
        assert_eq!(intervals, vec![(1, 10)]);
        add_interval(&mut intervals, (u64::MAX - 1, u64::MAX));
        assert_eq!(intervals, vec![(1, 10), (u64::MAX - 1, u64::MAX)]);
    }
}
