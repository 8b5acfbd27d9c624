//! Exponential backoff with jitter, and the dead-letter decision; [`Backoff`] for the
//! relay's own operations that must eventually succeed.

use std::collections::HashMap;
use std::time::Duration;

use crate::error::{Disposition, PublishError};

/// Default first retry delay: long enough for a broker blip to pass, short enough not to be noticed.
pub const DEFAULT_BASE_DELAY: Duration = Duration::from_millis(500);
/// Default cap on the retry delay: an outage is retried at least every five minutes.
pub const DEFAULT_MAX_DELAY: Duration = Duration::from_secs(300);
/// Default attempts before an event is dead-lettered (about an hour of retries at the defaults).
pub const DEFAULT_MAX_ATTEMPTS: u32 = 20;

crate::settings! {
    /// How failed publishes are retried. Deserialized as the relay's `[retry]` settings.
    #[derive(Clone, Debug, PartialEq)]
    #[serde(deny_unknown_fields)]
    pub struct RetryPolicy {
        /// First retry delay; each retry doubles it, with jitter.
        #[serde(with = "crate::time::duration_text")]
        pub base_delay: Duration = DEFAULT_BASE_DELAY,
        /// Longest retry delay.
        #[serde(with = "crate::time::duration_text")]
        pub max_delay: Duration = DEFAULT_MAX_DELAY,
        /// Attempts before an event is dead-lettered; per event type in the config file's
        /// [retry.max_attempts_by_type].
        pub max_attempts: u32 = DEFAULT_MAX_ATTEMPTS,
        /// Overrides of `max_attempts` by event type (the export seed's `event_type.max_retry_count`).
        pub max_attempts_by_type: HashMap<String, u32> = HashMap::new(),
    }
}

impl RetryPolicy {
    /// Refuses a policy that could never deliver or whose delays contradict each other.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_attempts == 0 {
            return Err("retry.max_attempts must be at least 1".into());
        }
        if let Some((event_type, _)) = self.max_attempts_by_type.iter().find(|(_, n)| **n == 0) {
            return Err(format!(
                "retry.max_attempts_by_type.{event_type} must be at least 1: an event is \
                 attempted once before any retry"
            ));
        }
        // A zero backoff spends every attempt at once: a broker restarting for a second
        // would dead-letter the whole backlog.
        if self.base_delay < MIN_BASE_DELAY {
            return Err(format!(
                "retry.base_delay must be at least 10ms (got {:?}): with no wait between \
                 attempts a short outage dead-letters every event",
                self.base_delay
            ));
        }
        if self.base_delay > self.max_delay {
            return Err("retry.base_delay must not exceed retry.max_delay".into());
        }
        Ok(())
    }
}

/// The shortest `base_delay` accepted.
pub const MIN_BASE_DELAY: Duration = Duration::from_millis(10);

/// What happens to an event after a failed attempt.
#[derive(Clone, Debug, PartialEq)]
pub enum RetryDecision {
    /// Publish again after this delay.
    RetryAfter(Duration),
    /// Move to the dead letters.
    DeadLetter,
}

impl RetryPolicy {
    pub fn max_attempts_for(&self, event_type: &str) -> u32 {
        self.max_attempts_by_type
            .get(event_type)
            .copied()
            .unwrap_or(self.max_attempts)
            .max(1)
    }

    /// The delay before attempt `attempts + 1`, where `attempts` failures happened so far
    /// (at least one). "Equal jitter": half the exponential delay is fixed, half random,
    /// so retries spread out but never come sooner than half the backoff.
    pub fn backoff(&self, attempts: u32) -> Duration {
        let exponent = attempts.saturating_sub(1).min(30);
        let full = self
            .base_delay
            .saturating_mul(1u32 << exponent)
            .min(self.max_delay);
        let half = full / 2;
        half + half.mul_f64(fastrand::f64())
    }

    /// Decides what follows a failed attempt. `attempts` counts this failed attempt.
    pub fn decide(&self, event_type: &str, attempts: u32, error: &PublishError) -> RetryDecision {
        self.decide_with_limit(self.max_attempts_for(event_type), attempts, error)
    }

    /// [`RetryPolicy::decide`] with the limit given (a row's own limit).
    pub fn decide_with_limit(
        &self,
        max_attempts: u32,
        attempts: u32,
        error: &PublishError,
    ) -> RetryDecision {
        match error.disposition() {
            Disposition::Permanent => RetryDecision::DeadLetter,
            Disposition::Retry { .. } if attempts >= max_attempts.max(1) => {
                RetryDecision::DeadLetter
            }
            // A broker's Retry-After lengthens the wait, never shortens it below the backoff:
            // `Retry-After: 0` (or a date past) spent every attempt in a second.
            Disposition::Retry { after: Some(after) } => {
                RetryDecision::RetryAfter(after.max(self.backoff(attempts)).min(self.max_delay))
            }
            Disposition::Retry { after: None } => RetryDecision::RetryAfter(self.backoff(attempts)),
        }
    }
}

impl RetryPolicy {
    /// The wait after a failure that spent no attempt: it came while its destination has
    /// confirmed nothing for `outage` (the engine's `PublishStreaks::attempt`), so it is
    /// retried whatever its attempts. It waits about as long as the outage has lasted
    /// (half of it fixed, half random), at least the backoff of its `attempts` and at most
    /// `max_delay`: a long outage is tried less and less often, as counted attempts were,
    /// not every `base_delay` for as long as it lasts. A broker's Retry-After lengthens it.
    pub fn wait_in_outage(
        &self,
        attempts: u32,
        outage: Duration,
        error: &PublishError,
    ) -> Duration {
        let full = outage.clamp(self.base_delay, self.max_delay);
        let half = full / 2;
        let wait = (half + half.mul_f64(fastrand::f64())).max(self.backoff(attempts.max(1)));
        let asked = match error.disposition() {
            Disposition::Retry { after: Some(after) } => after,
            _ => Duration::ZERO,
        };
        wait.max(asked).min(self.max_delay)
    }
}

/// The wait between tries of an operation the relay repeats until it succeeds (a store
/// write, a claim, a reconnect, a start-up check): `first`, doubled after each failure up to
/// `cap`, and back to `first` after a success. No jitter: one process retries one thing, so
/// there is no herd to spread out.
#[derive(Clone, Debug)]
pub struct Backoff {
    first: Duration,
    cap: Duration,
    next: Duration,
}

impl Backoff {
    pub const fn new(first: Duration, cap: Duration) -> Self {
        Backoff {
            first,
            cap,
            next: first,
        }
    }

    /// The wait before the next try; the one after is twice as long (at most `cap`).
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = self.next.saturating_mul(2).min(self.cap);
        delay
    }

    /// The last try succeeded: the next failure waits `first` again.
    pub fn reset(&mut self) {
        self.next = self.first;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::PublishErrorKind;

    #[test]
    fn backoff_doubles_up_to_its_cap_and_starts_over_after_a_success() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(500));
        let waits: Vec<u64> = (0..5).map(|_| b.next_delay().as_millis() as u64).collect();
        assert_eq!(waits, vec![100, 200, 400, 500, 500]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(100));
    }

    fn policy() -> RetryPolicy {
        RetryPolicy {
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(10),
            max_attempts: 5,
            max_attempts_by_type: HashMap::from([("fragile".to_string(), 2)]),
        }
    }

    #[test]
    fn backoff_grows_exponentially_within_jitter_bounds() {
        let p = policy();
        for attempts in 1..=12u32 {
            let full = Duration::from_millis(100 * (1u64 << (attempts - 1))).min(p.max_delay);
            for _ in 0..50 {
                let d = p.backoff(attempts);
                assert!(
                    d >= full / 2 && d <= full,
                    "attempt {attempts}: {d:?} vs {full:?}"
                );
            }
        }
    }

    /// A wait in an outage grows with the outage, as counted attempts' backoff did, never
    /// below the event's own backoff nor above `max_delay`, and a Retry-After lengthens it.
    #[test]
    fn a_wait_in_an_outage_grows_with_it_within_the_bounds() {
        let p = policy();
        let down = PublishError::new(PublishErrorKind::Unavailable, "down");
        for _ in 0..50 {
            let early = p.wait_in_outage(1, Duration::from_millis(30), &down);
            assert!(early >= Duration::from_millis(50) && early <= Duration::from_millis(100));
            let later = p.wait_in_outage(1, Duration::from_secs(4), &down);
            assert!(later >= Duration::from_secs(2) && later <= Duration::from_secs(4));
            let long = p.wait_in_outage(1, Duration::from_secs(3600), &down);
            assert!(long >= Duration::from_secs(5) && long <= p.max_delay);
            // Its own backoff is the floor: 4 failures counted wait at least 400 ms.
            let own = p.wait_in_outage(4, Duration::from_millis(30), &down);
            assert!(own >= Duration::from_millis(400), "{own:?}");
        }
        let asked = down.with_retry_after(Duration::from_secs(8));
        assert_eq!(
            p.wait_in_outage(1, Duration::from_millis(30), &asked),
            Duration::from_secs(8)
        );
    }

    #[test]
    fn retries_until_max_attempts_then_dead_letters() {
        let p = policy();
        let err = PublishError::new(PublishErrorKind::Unavailable, "down");
        assert!(matches!(
            p.decide("t", 4, &err),
            RetryDecision::RetryAfter(_)
        ));
        assert_eq!(p.decide("t", 5, &err), RetryDecision::DeadLetter);
        assert_eq!(p.decide("fragile", 2, &err), RetryDecision::DeadLetter);
    }

    #[test]
    fn permanent_errors_dead_letter_at_once() {
        let err = PublishError::new(PublishErrorKind::TooLarge, "1 MiB > 64 KiB");
        assert_eq!(policy().decide("t", 1, &err), RetryDecision::DeadLetter);
    }

    /// A receiver answering 429 with `Retry-After: 0` had each event retried as fast as
    /// round trips allowed, and dead-lettered after its attempts in under a second.
    #[test]
    fn a_broker_requested_delay_never_shortens_the_backoff() {
        let err =
            PublishError::new(PublishErrorKind::Throttled, "429").with_retry_after(Duration::ZERO);
        for attempts in 1..5 {
            let RetryDecision::RetryAfter(wait) = policy().decide("t", attempts, &err) else {
                panic!("retried")
            };
            let full = Duration::from_millis(100) * (1 << (attempts - 1));
            assert!(
                wait >= full.min(Duration::from_secs(10)) / 2,
                "{attempts}: {wait:?}"
            );
        }
    }

    #[test]
    fn broker_requested_delay_is_capped() {
        let err = PublishError::new(PublishErrorKind::Throttled, "429")
            .with_retry_after(Duration::from_secs(3600));
        assert_eq!(
            policy().decide("t", 1, &err),
            RetryDecision::RetryAfter(Duration::from_secs(10))
        );
    }
}
