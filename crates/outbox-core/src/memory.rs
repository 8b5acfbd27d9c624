//! What a change-stream capture (WAL, binlog) may hold in memory, in bytes: from the
//! moment its reader takes an event off the stream until the engine settles it (delivered,
//! parked or dead-lettered).
//!
//! Counting events alone bounds nothing when events are large: 600 events of 1 MiB behind
//! a slow webhook once took 605 MiB, and the count-based limits allowed some 30,000 events
//! in memory, enough for an OOM kill that re-reads the same backlog and crash-loops. So
//! every event read is charged here by its size, and the reader reads only while the total
//! is under the budget. The charge is a value that travels with the event and gives its
//! bytes back when dropped, so no path that lets go of an event (settled, left to another
//! relay, a broken session's queue dropped) can forget to return them.
//!
//! One event larger than the whole budget is still read, alone: a budget must never stop
//! the stream for good.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

use crate::Event;

/// What an event costs beyond its strings: the event's own fields, its place in the
/// capture's maps, and the allocator's rounding.
pub const EVENT_OVERHEAD: usize = 256;

/// The shared count of bytes held, against its limit.
#[derive(Debug)]
pub struct MemoryBudget {
    limit: usize,
    held: AtomicUsize,
    /// The largest event charged so far: what a claim of rows from the parked table
    /// expects each row to cost.
    largest: AtomicUsize,
    /// The most bytes held at once.
    peak: AtomicUsize,
    freed: Notify,
}

impl MemoryBudget {
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(MemoryBudget {
            limit: limit.max(1),
            held: AtomicUsize::new(0),
            largest: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            freed: Notify::new(),
        })
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// Bytes that may still be taken before the reader waits (0 when full).
    pub fn room(&self) -> usize {
        self.limit.saturating_sub(self.held())
    }

    /// The most bytes held at once so far.
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    /// The largest single event charged so far (0 before the first).
    pub fn largest_event(&self) -> usize {
        self.largest.load(Ordering::Relaxed)
    }

    /// Counts `bytes` as held until the returned charge is dropped. Never refused: the
    /// reader asks [`MemoryBudget::has_room`] first, and one event over the budget must
    /// still pass.
    pub fn charge(self: &Arc<Self>, bytes: usize) -> Charge {
        if bytes == 0 {
            return Charge::none();
        }
        let held = self.held.fetch_add(bytes, Ordering::AcqRel) + bytes;
        self.peak.fetch_max(held, Ordering::Relaxed);
        self.largest.fetch_max(bytes, Ordering::Relaxed);
        Charge {
            budget: Some(self.clone()),
            bytes,
        }
    }

    /// Counts `bytes` as held for what is about to be read (a claim's rows, whose sizes are
    /// known only once they arrive), so that nothing else takes the room meanwhile. The
    /// rows then [`Charge::take`] their share of it.
    pub fn reserve(self: &Arc<Self>, bytes: usize) -> Charge {
        if bytes == 0 {
            return Charge::none();
        }
        let held = self.held.fetch_add(bytes, Ordering::AcqRel) + bytes;
        self.peak.fetch_max(held, Ordering::Relaxed);
        Charge {
            budget: Some(self.clone()),
            bytes,
        }
    }

    /// Waits until something is free. Cancel-safe: a release between the check and the
    /// wait leaves a permit in `freed`, so the wait cannot miss it.
    pub async fn has_room(&self) {
        loop {
            let freed = self.freed.notified();
            if self.room() > 0 {
                return;
            }
            freed.await;
        }
    }

    fn release(&self, bytes: usize) {
        self.held.fetch_sub(bytes, Ordering::AcqRel);
        self.freed.notify_one();
    }
}

/// Bytes of a [`MemoryBudget`] held by one event, given back when dropped.
#[derive(Debug)]
pub struct Charge {
    budget: Option<Arc<MemoryBudget>>,
    bytes: usize,
}

impl Charge {
    /// No bytes: what an output that is no event (a commit, a keepalive) carries.
    pub fn none() -> Self {
        Charge {
            budget: None,
            bytes: 0,
        }
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// One event's charge of `bytes`, taken out of this reservation as far as it goes and
    /// charged to `budget` beyond it: what is held stays counted throughout, never twice.
    pub fn take(&mut self, bytes: usize, budget: &Arc<MemoryBudget>) -> Charge {
        if bytes == 0 {
            return Charge::none();
        }
        let from_reservation = bytes.min(self.bytes);
        self.bytes -= from_reservation;
        let beyond = bytes - from_reservation;
        if beyond > 0 {
            let held = budget.held.fetch_add(beyond, Ordering::AcqRel) + beyond;
            budget.peak.fetch_max(held, Ordering::Relaxed);
        }
        budget.largest.fetch_max(bytes, Ordering::Relaxed);
        Charge {
            budget: Some(budget.clone()),
            bytes,
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if let Some(budget) = self.budget.take() {
            budget.release(self.bytes);
        }
    }
}

/// What one event costs while capture holds it.
pub fn event_bytes(e: &Event) -> usize {
    let headers: usize = e.headers.iter().map(|(k, v)| k.len() + v.len() + 48).sum();
    EVENT_OVERHEAD
        + e.payload.len()
        + e.destination.len()
        + e.event_type.len()
        + e.partition_key.as_ref().map_or(0, String::len)
        + e.mutation_id.as_ref().map_or(0, String::len)
        + headers
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_charge_gives_its_bytes_back_when_dropped_whatever_path_drops_it() {
        let budget = MemoryBudget::new(1000);
        let a = budget.charge(600);
        let b = budget.charge(300);
        assert_eq!(budget.held(), 900);
        assert_eq!(budget.room(), 100);
        drop(a);
        assert_eq!(budget.held(), 300);
        // In a queue that is dropped whole (a broken session's).
        let queue = vec![b, budget.charge(50)];
        drop(queue);
        assert_eq!(budget.held(), 0);
        assert_eq!(budget.largest_event(), 600);
        assert_eq!(budget.peak(), 900);
    }

    #[test]
    fn one_event_larger_than_the_budget_is_still_charged_so_the_stream_never_stops_for_good() {
        let budget = MemoryBudget::new(1000);
        let big = budget.charge(5000);
        assert_eq!(budget.room(), 0);
        drop(big);
        assert_eq!(budget.room(), 1000);
    }

    #[test]
    fn race_a_reservation_keeps_the_room_of_rows_still_on_their_way() {
        let budget = MemoryBudget::new(1000);
        // A claim reserves room for its rows before it asks for them...
        let mut reservation = budget.reserve(600);
        // ...so the reader, meanwhile, finds only the rest.
        assert_eq!(budget.room(), 400);
        let reader = budget.charge(400);
        assert_eq!(budget.room(), 0);
        // The rows arrive: 250 and 500 bytes. Each takes from the reservation what it can.
        let first = reservation.take(250, &budget);
        let second = reservation.take(500, &budget);
        assert_eq!(
            budget.held(),
            1150,
            "50 over: the second row was larger than reserved"
        );
        drop(reservation);
        assert_eq!(budget.held(), 1150, "nothing was left of the reservation");
        assert_eq!(budget.largest_event(), 500, "a reservation is no event");
        drop((first, second, reader));
        assert_eq!(budget.held(), 0);
        // An unused reservation gives back all it held.
        let unused = budget.reserve(300);
        drop(unused);
        assert_eq!(budget.held(), 0);
        assert_eq!(budget.peak(), 1150);
    }

    #[test]
    fn a_marker_costs_nothing() {
        let budget = MemoryBudget::new(10);
        let none = budget.charge(0);
        assert_eq!(none.bytes(), 0);
        assert_eq!(budget.held(), 0);
    }

    #[tokio::test]
    async fn a_reader_waiting_for_room_wakes_when_an_event_settles() {
        let budget = MemoryBudget::new(100);
        let held = budget.charge(100);
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move { budget.has_room().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "full: the reader waits");
        drop(held);
        tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .expect("woken by the release")
            .unwrap();
    }
}
