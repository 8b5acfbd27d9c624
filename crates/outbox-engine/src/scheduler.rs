//! When the engine claims: the claim step's state, apart from the I/O.
//!
//! One claim runs at a time. Another starts when something may have arrived (a wake-up, a
//! poll tick, a retry coming due) or at once while the last claim came back full (a
//! backlog), as long as the node has room for more rows and the backoff after a failed
//! claim has passed.

use std::time::Duration;

use futures::future::BoxFuture;
use outbox_core::store::StoreResult;
use outbox_core::{Backoff, Claimed};
use tokio::time::Instant;

/// A claim in progress, resolving to its [`Claim`].
pub type Claiming = BoxFuture<'static, Claim>;

/// A finished claim.
pub struct Claim {
    /// Its number (see [`ClaimScheduler::start`]).
    pub number: u64,
    /// The most rows it asked for: a full claim means more are waiting.
    pub limit: usize,
    /// The partitions and epochs it was fenced with (partition mode).
    pub fence: Option<std::sync::Arc<outbox_core::partition::Fence>>,
    pub result: StoreResult<Vec<Claimed>>,
}

/// The first wait after a failed claim; it doubles up to [`CLAIM_BACKOFF_CAP`].
const CLAIM_BACKOFF_FIRST: Duration = Duration::from_millis(100);
const CLAIM_BACKOFF_CAP: Duration = Duration::from_secs(5);

pub struct ClaimScheduler {
    /// The claim in flight.
    pub running: Option<Claiming>,
    /// Something may have arrived since the last claim started.
    wanted: bool,
    /// The last claim came back full: more is waiting.
    pub backlog: bool,
    /// The last claim returned nothing (with a drain: time to look at what is left).
    pub last_empty: bool,
    /// Claims started so far; each claim carries its number (see `Lanes::accept`).
    pub started: u64,
    backoff: Backoff,
    not_before: Instant,
}

impl Default for ClaimScheduler {
    fn default() -> Self {
        ClaimScheduler {
            running: None,
            wanted: true, // look once at start-up
            backlog: false,
            last_empty: false,
            started: 0,
            backoff: Backoff::new(CLAIM_BACKOFF_FIRST, CLAIM_BACKOFF_CAP),
            not_before: Instant::now(),
        }
    }
}

impl ClaimScheduler {
    /// Rows may have arrived: claim when next allowed.
    pub fn want(&mut self) {
        self.wanted = true;
    }

    /// Whether a claim for at most `capacity` more rows should start now.
    pub fn due(&self, capacity: usize) -> bool {
        self.running.is_none()
            && (self.wanted || self.backlog)
            && capacity > 0
            && Instant::now() >= self.not_before
    }

    /// A claim starts: returns its number.
    pub fn start(&mut self, claim: Claiming) -> u64 {
        self.wanted = false;
        self.started += 1;
        self.running = Some(claim);
        self.started
    }

    /// The running claim returned `rows` of at most `limit`.
    pub fn succeeded(&mut self, rows: usize, limit: usize) {
        self.running = None;
        self.backoff.reset();
        self.backlog = rows >= limit;
        self.last_empty = rows == 0;
    }

    /// The running claim failed and may be tried again: returns how long until then.
    pub fn failed(&mut self) -> Duration {
        self.running = None;
        self.wanted = true;
        let delay = self.backoff.next_delay();
        self.not_before = Instant::now() + delay;
        delay
    }

    /// When the backoff after a failed claim ends, if it has not yet.
    pub fn backing_off_until(&self) -> Option<Instant> {
        (self.not_before > Instant::now()).then_some(self.not_before)
    }

    /// Resolves when the running claim finishes; never, while none runs.
    pub async fn finished(&mut self) -> Claim {
        match self.running.as_mut() {
            Some(claim) => claim.await,
            None => std::future::pending().await,
        }
    }

    /// Nothing left to claim and nothing asked for: a drain may look at what is left.
    pub fn settled_empty(&self) -> bool {
        self.running.is_none() && self.last_empty && !self.wanted && !self.backlog
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    fn claim() -> Claiming {
        async {
            Claim {
                number: 0,
                limit: 0,
                fence: None,
                result: Ok(Vec::new()),
            }
        }
        .boxed()
    }

    #[test]
    fn a_full_claim_is_followed_at_once_an_empty_one_waits_for_a_cue() {
        let mut s = ClaimScheduler::default();
        assert!(s.due(10), "the start-up claim");
        s.start(claim());
        assert!(!s.due(10), "one claim at a time");
        s.succeeded(10, 10);
        assert!(s.due(10), "a backlog claims again at once");
        s.start(claim());
        s.succeeded(3, 10);
        assert!(!s.due(10), "caught up: wait for a wake-up or a poll");
        s.want();
        assert!(s.due(10));
        assert!(!s.due(0), "no room for more rows");
    }

    #[test]
    fn a_failed_claim_backs_off_doubling_and_a_success_resets_it() {
        let mut s = ClaimScheduler::default();
        s.start(claim());
        assert_eq!(s.failed(), Duration::from_millis(100));
        assert!(!s.due(10), "not before the backoff ends");
        assert!(s.backing_off_until().is_some());
        s.start(claim());
        assert_eq!(s.failed(), Duration::from_millis(200));
        s.start(claim());
        s.succeeded(0, 10);
        s.start(claim());
        assert_eq!(s.failed(), Duration::from_millis(100));
    }

    #[test]
    fn claim_numbers_count_every_start() {
        let mut s = ClaimScheduler::default();
        assert_eq!(s.start(claim()), 1);
        s.succeeded(0, 1);
        assert_eq!(s.start(claim()), 2);
        assert!(!s.settled_empty(), "a claim is running");
        s.succeeded(0, 1);
        assert!(s.settled_empty());
    }
}
