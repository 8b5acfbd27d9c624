//! Which connections the HTTP server keeps: at most [`MAX_CONNECTIONS`] in all and
//! [`MAX_CONNECTIONS_PER_PEER`] per peer, and when one of those is full, room is made for
//! the new connection by closing the oldest idle one in it (no request in progress: a
//! keep-alive connection between requests, or one still sending its request's headers).
//!
//! Before, a full server let new connections wait, and a full peer closed them. Anyone who
//! could connect held every slot with half-sent headers, renewed as the header timeout
//! closed them: `/healthz` went unanswered (64 connections from 127.0.0.1, which every local
//! user shares) or answered in 9 s (four addresses), past the probes' timeouts. A probe
//! sends its request as it connects, so it is the newest and never the oldest idle one.
//!
//! The table is pure state; the server acts on its answers ([`Admission`]).

use std::collections::BTreeMap;
use std::net::IpAddr;

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 256;
/// Connections served at once from one peer ([`peer_of`]).
pub const MAX_CONNECTIONS_PER_PEER: usize = MAX_CONNECTIONS / 4;

/// A connection's number, in the order they were admitted (so the lowest is the oldest).
pub type ConnectionId = u64;

/// What to do with a new connection.
#[derive(Debug, PartialEq, Eq)]
pub enum Admission {
    /// Serve it as `id`; close `evicted` first, if any (its slot is the new one's).
    Serve {
        id: ConnectionId,
        evicted: Option<ConnectionId>,
    },
    /// Every connection in its peer's or the server's share has a request in progress:
    /// close the new one.
    Refuse,
}

#[derive(Debug)]
struct Open {
    peer: IpAddr,
    /// Requests in progress.
    busy: usize,
}

/// The open connections, oldest first.
#[derive(Debug)]
pub struct Table {
    limit: usize,
    per_peer: usize,
    next: ConnectionId,
    open: BTreeMap<ConnectionId, Open>,
}

impl Default for Table {
    fn default() -> Self {
        Table::new(MAX_CONNECTIONS, MAX_CONNECTIONS_PER_PEER)
    }
}

impl Table {
    pub fn new(limit: usize, per_peer: usize) -> Self {
        Table {
            limit,
            per_peer,
            next: 0,
            open: BTreeMap::new(),
        }
    }

    /// A new connection from `address`.
    pub fn admit(&mut self, address: IpAddr) -> Admission {
        let peer = peer_of(address);
        let of_peer = self.open.values().filter(|o| o.peer == peer).count();
        // The peer's share first: making room in it frees a slot of the server's too.
        let scope = if of_peer >= self.per_peer {
            Some(Some(peer))
        } else if self.open.len() >= self.limit {
            Some(None)
        } else {
            None
        };
        let evicted = match scope {
            None => None,
            Some(scope) => {
                let oldest_idle = self
                    .open
                    .iter()
                    .find(|(_, o)| o.busy == 0 && scope.is_none_or(|p| o.peer == p))
                    .map(|(id, _)| *id);
                match oldest_idle {
                    Some(id) => {
                        self.open.remove(&id);
                        Some(id)
                    }
                    None => return Admission::Refuse,
                }
            }
        };
        let id = self.next;
        self.next += 1;
        self.open.insert(id, Open { peer, busy: 0 });
        Admission::Serve { id, evicted }
    }

    /// A request of connection `id` began.
    pub fn request_began(&mut self, id: ConnectionId) {
        if let Some(open) = self.open.get_mut(&id) {
            open.busy += 1;
        }
    }

    /// A request of connection `id` was answered (or dropped).
    pub fn request_ended(&mut self, id: ConnectionId) {
        if let Some(open) = self.open.get_mut(&id) {
            open.busy = open.busy.saturating_sub(1);
        }
    }

    /// Connection `id` closed (a no-op if it was evicted).
    pub fn closed(&mut self, id: ConnectionId) {
        self.open.remove(&id);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.open.len()
    }
}

/// The peer an address counts as: an IPv6 address by its /64 (one host is handed a whole
/// /64, so counted by address it could open as many connections as it has addresses), an
/// IPv4-mapped one as its IPv4 address, any other address as itself.
pub fn peer_of(ip: IpAddr) -> IpAddr {
    use std::net::Ipv6Addr;
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from_bits(v6.to_bits() & !u128::from(u64::MAX))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn served(admission: Admission) -> (ConnectionId, Option<ConnectionId>) {
        match admission {
            Admission::Serve { id, evicted } => (id, evicted),
            Admission::Refuse => panic!("refused"),
        }
    }

    #[test]
    fn an_ipv6_peer_is_its_64_and_a_mapped_ipv4_one_its_ipv4_address() {
        assert_eq!(peer_of(ip("2001:db8:1:2:aaaa::1")), ip("2001:db8:1:2::"));
        assert_eq!(
            peer_of(ip("2001:db8:1:2:ffff:ffff:ffff:ffff")),
            peer_of(ip("2001:db8:1:2::7"))
        );
        assert_ne!(
            peer_of(ip("2001:db8:1:3::1")),
            peer_of(ip("2001:db8:1:2::1"))
        );
        assert_eq!(peer_of(ip("::ffff:10.0.0.7")), ip("10.0.0.7"));
        assert_eq!(peer_of(ip("10.0.0.7")), ip("10.0.0.7"));
        let mut table = Table::new(8, 2);
        for i in 1..=2 {
            served(table.admit(ip(&format!("2001:db8::{i}"))));
        }
        let (_, evicted) = served(table.admit(ip("2001:db8::ffff")));
        assert_eq!(
            evicted,
            Some(0),
            "another address of the same /64 is the same peer"
        );
        let (_, evicted) = served(table.admit(ip("2001:db9::1")));
        assert_eq!(evicted, None);
    }

    /// Race: a peer holds its whole share with half-sent headers when a probe from the same
    /// address connects. Before, the probe was closed at once.
    #[test]
    fn a_full_peer_makes_room_by_closing_its_oldest_idle_connection() {
        let mut table = Table::new(8, 3);
        let local = ip("127.0.0.1");
        let held: Vec<_> = (0..3).map(|_| served(table.admit(local)).0).collect();
        let (probe, evicted) = served(table.admit(local));
        assert_eq!(evicted, Some(held[0]));
        assert_eq!(table.len(), 3);
        // The probe's request is in progress: the next newcomer closes the next oldest.
        table.request_began(probe);
        assert_eq!(served(table.admit(local)).1, Some(held[1]));
    }

    /// Race: four peers fill the server with half-sent headers when a fifth connects.
    /// Before, it waited in the listen backlog until one of them gave up.
    #[test]
    fn a_full_server_makes_room_by_closing_the_oldest_idle_connection_of_any_peer() {
        let mut table = Table::new(4, 2);
        let ids: Vec<_> = ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]
            .iter()
            .map(|a| served(table.admit(ip(a))).0)
            .collect();
        table.request_began(ids[0]);
        let (_, evicted) = served(table.admit(ip("10.0.0.3")));
        assert_eq!(
            evicted,
            Some(ids[1]),
            "the oldest idle one, not the busy oldest"
        );
        assert_eq!(table.len(), 4);
    }

    /// Interleaving: every connection of the full scope has a request in progress; one
    /// ends, and then a newcomer takes its connection's place.
    #[test]
    fn a_newcomer_is_refused_only_while_every_connection_in_its_scope_is_busy() {
        let mut table = Table::new(2, 2);
        let a = served(table.admit(ip("10.0.0.1"))).0;
        let b = served(table.admit(ip("10.0.0.2"))).0;
        table.request_began(a);
        table.request_began(b);
        assert_eq!(table.admit(ip("10.0.0.3")), Admission::Refuse);
        table.request_ended(b);
        assert_eq!(served(table.admit(ip("10.0.0.3"))).1, Some(b));
        // An evicted connection's own end changes nothing.
        table.closed(b);
        table.request_ended(b);
        assert_eq!(table.len(), 2);
    }

    #[test]
    fn a_closed_connection_frees_its_slot() {
        let mut table = Table::new(1, 1);
        let a = served(table.admit(ip("10.0.0.1"))).0;
        table.request_began(a);
        assert_eq!(table.admit(ip("10.0.0.1")), Admission::Refuse);
        table.closed(a);
        assert_eq!(served(table.admit(ip("10.0.0.1"))).1, None);
    }
}
