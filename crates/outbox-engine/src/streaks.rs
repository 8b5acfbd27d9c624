//! What `/readyz` says of publishing, per send group: the pure state behind it.
//!
//! A send group (one sink, or one webhook receiver: `Publisher::send_group`) whose
//! publishes keep failing, none of its events confirmed, is trouble once it lasts past the
//! grace, whatever the other groups do: with one streak for the whole relay, a working sink
//! beside a broken one confirmed events every second and kept `/readyz` green while every
//! event of the other waited. A streak ends when an event of its group is confirmed, or
//! when no retry has continued it for longer than the longest backoff and the grace (its
//! events dead-lettered, or nothing left to send): a streak no retry continued says nothing
//! of now.
//!
//! The same streaks say what a failure spends of its event's attempts
//! ([`PublishStreaks::attempt`]): nothing while its destination is down, so that an outage
//! longer than the retries dead-letters nothing.
//!
//! One event failing alone is no evidence against its destination (a receiver may refuse
//! that event alone), but an outbox whose events share one key sends only its head, so
//! through an outage only that event fails. There the sink's own health check decides
//! ([`PublishStreaks::wants_probe`], [`PublishStreaks::probed`]): a destination whose check
//! fails too is down, and its lone event spends nothing either.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use outbox_core::{PublishErrorKind, SequenceId};

/// What a failed publish spends of its event's attempts (`retry.max_attempts`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Attempt {
    /// One attempt.
    Counted,
    /// None: its destination has confirmed nothing for `lasted`, and the failure is the
    /// destination's condition. The event is retried, waiting as the outage has lasted.
    InOutage { lasted: Duration },
}

impl Attempt {
    /// The event's attempts after this failure, from `before`.
    pub fn attempts_after(self, before: u32) -> u32 {
        match self {
            Attempt::Counted => before.saturating_add(1),
            Attempt::InOutage { .. } => before,
        }
    }
}

/// One group's failing streak.
#[derive(Clone, Debug, PartialEq)]
struct Streak {
    since: Instant,
    last: Instant,
    error: String,
    /// The first event whose failure the streak holds, and whether another one failed in
    /// it too: one event failing alone is no evidence against its destination.
    first_failed: Option<SequenceId>,
    several_failed: bool,
    /// A health check of the destination is running, asked after a lone failure.
    probing: bool,
    /// When the last check that ended within this streak was started, and whether it
    /// found the destination down.
    verdict: Option<(Instant, bool)>,
}

impl Streak {
    /// Whether the streak shows its destination down: more than one event failed in it,
    /// or the destination's health check, started within it, failed.
    fn shows_the_destination_down(&self) -> bool {
        self.several_failed
            || self
                .verdict
                .is_some_and(|(at, down)| down && at >= self.since)
    }
}

#[derive(Debug, Default)]
pub struct PublishStreaks {
    groups: HashMap<u64, Streak>,
}

impl PublishStreaks {
    /// A batch of `group` came back at `now`: an event confirmed ends the group's streak;
    /// else a failure to retry (`error`) starts it or carries it on; `failed` are the events
    /// whose failures were the destination's condition (a 500 of another event says nothing
    /// of the destination, and made a lone event's 503s count no more). Dead letters are their events' own fault, not the sink's: a batch of them alone
    /// says nothing.
    pub fn batch(
        &mut self,
        group: u64,
        confirmed: bool,
        (error, failed): (Option<String>, &[SequenceId]),
        now: Instant,
    ) {
        if confirmed {
            self.groups.remove(&group);
        } else if let Some(error) = error {
            let streak = self.groups.entry(group).or_insert_with(|| Streak {
                since: now,
                last: now,
                error: String::new(),
                first_failed: None,
                several_failed: false,
                probing: false,
                verdict: None,
            });
            streak.last = now;
            streak.error = error;
            for id in failed {
                match streak.first_failed {
                    None => streak.first_failed = Some(*id),
                    Some(first) if first != *id => streak.several_failed = true,
                    Some(_) => {}
                }
            }
        }
    }

    /// What a failure of `kind`, of an event that failed `before` times already, in a batch
    /// of `group` that came back at `now` spends, asked before [`batch`](Self::batch)
    /// records that batch.
    ///
    /// An event's first failure always counts: the stores know a row that failed, and hold
    /// its key's later rows back behind it, by `attempts > 0` (left at 0, they went out
    /// before it), and `max_attempts = 1` dead-letters at the first failure, as it says.
    /// A later one spends nothing when the failure is the destination's condition
    /// ([`PublishErrorKind::is_the_destinations_condition`]), no event of the batch was
    /// confirmed, and an earlier batch began a streak that a failure continued within
    /// `recent`, in which more than one event failed, or the destination's health check
    /// failed ([`probed`](Self::probed)): the destination is down, and
    /// counting there dead-lettered, after the retries' hour, every event that would have
    /// gone out once it came back. The batch that begins a streak counts. A poison event
    /// beside working ones counts each time, since their confirmations end the streak
    /// between its tries; one failing alone in its group, its destination's health
    /// check passing, counts too (a receiver that answers 503 to that event alone, on a
    /// quiet system, kept it for good).
    pub fn attempt(
        &self,
        group: u64,
        (batch_confirmed, kind, before): (bool, PublishErrorKind, u32),
        now: Instant,
        recent: Duration,
    ) -> Attempt {
        if before == 0 || batch_confirmed || !kind.is_the_destinations_condition() {
            return Attempt::Counted;
        }
        match self.groups.get(&group) {
            Some(streak)
                if streak.shows_the_destination_down()
                    && now.saturating_duration_since(streak.last) <= recent =>
            {
                Attempt::InOutage {
                    lasted: now.saturating_duration_since(streak.since),
                }
            }
            _ => Attempt::Counted,
        }
    }

    /// Whether to check `group`'s destination now, asked after [`batch`](Self::batch)
    /// recorded a failure: its streak holds one event's failures alone, and no check is
    /// running. A yes marks one running until [`probed`](Self::probed). A check per lone
    /// failure at most: they come at the event's backoff.
    pub fn wants_probe(&mut self, group: u64) -> bool {
        match self.groups.get_mut(&group) {
            Some(streak) if !streak.several_failed && !streak.probing => {
                streak.probing = true;
                true
            }
            _ => false,
        }
    }

    /// `group`'s health check, started at `started`, found its destination `down` (or
    /// not). A verdict of a check started before the group's streak began says nothing
    /// of it (and leaves the streak's own check running); one for a group with no streak
    /// now is dropped.
    pub fn probed(&mut self, group: u64, started: Instant, down: bool) {
        if let Some(streak) = self.groups.get_mut(&group) {
            if started >= streak.since {
                streak.probing = false;
                streak.verdict = Some((started, down));
            }
        }
    }

    /// The oldest streak a failure continued within `recent` (what `/readyz` reports):
    /// since when, and its latest error. Forgets those no failure continued within `kept`,
    /// the longer window [`attempt`](Self::attempt) judges by: a retry in an outage comes
    /// back up to `max_delay` and a publish timeout after the failure before it, and a
    /// streak forgotten meanwhile made that retry count, and the outage be found anew.
    pub fn oldest(
        &mut self,
        now: Instant,
        (recent, kept): (Duration, Duration),
    ) -> Option<(Instant, String)> {
        self.groups
            .retain(|_, s| now.saturating_duration_since(s.last) <= kept);
        self.groups
            .values()
            .filter(|s| now.saturating_duration_since(s.last) <= recent)
            .min_by_key(|s| s.since)
            .map(|s| (s.since, s.error.clone()))
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Forgets every streak: the node publishes nothing now (a standby), and a failure
    /// from before says nothing of it.
    pub fn clear(&mut self) {
        self.groups.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RECENT: Duration = Duration::from_secs(60);

    /// A working group confirming beside a failing one does not end the failing one's
    /// streak (it did, with one streak for the relay); only its own confirmation does.
    #[test]
    fn a_working_group_does_not_hide_a_failing_one() {
        let t0 = Instant::now();
        let mut streaks = PublishStreaks::default();
        streaks.batch(1, false, (Some("stream not found".into()), &[1, 2]), t0);
        for s in 1..=40 {
            let now = t0 + Duration::from_secs(s);
            streaks.batch(2, true, (None, &[]), now);
            if s % 5 == 0 {
                streaks.batch(1, false, (Some("stream not found".into()), &[1, 2]), now);
            }
        }
        let now = t0 + Duration::from_secs(40);
        assert_eq!(
            streaks.oldest(now, (RECENT, RECENT)),
            Some((t0, "stream not found".to_string()))
        );
        streaks.batch(1, true, (None, &[]), now);
        assert_eq!(streaks.oldest(now, (RECENT, RECENT)), None);
    }

    /// The oldest streak is the one reported; a group's streak keeps its start while it
    /// goes on, with its latest error.
    #[test]
    fn the_oldest_streak_is_reported_with_its_latest_error() {
        let t0 = Instant::now();
        let mut streaks = PublishStreaks::default();
        streaks.batch(1, false, (Some("a".into()), &[1, 2]), t0);
        streaks.batch(
            2,
            false,
            (Some("b".into()), &[1, 2]),
            t0 + Duration::from_secs(1),
        );
        streaks.batch(
            1,
            false,
            (Some("a again".into()), &[1, 2]),
            t0 + Duration::from_secs(2),
        );
        let now = t0 + Duration::from_secs(3);
        assert_eq!(
            streaks.oldest(now, (RECENT, RECENT)),
            Some((t0, "a again".to_string()))
        );
        streaks.batch(1, true, (None, &[]), now);
        assert_eq!(
            streaks.oldest(now, (RECENT, RECENT)),
            Some((t0 + Duration::from_secs(1), "b".to_string()))
        );
    }

    const DOWN: PublishErrorKind = PublishErrorKind::Unavailable;

    /// A broker down: the batch that finds it so spends an attempt of each of its events;
    /// every batch that comes back after it, in flight then or retried since, spends none,
    /// for as long as the outage lasts; the first confirmation ends it, and failures count
    /// again.
    #[test]
    fn an_outage_spends_no_attempts_after_the_batch_that_finds_it() {
        let t0 = Instant::now();
        let mut streaks = PublishStreaks::default();
        assert_eq!(
            streaks.attempt(1, (false, DOWN, 1), t0, RECENT),
            Attempt::Counted
        );
        streaks.batch(1, false, (Some("refused".into()), &[1, 2]), t0);
        // Two hours of retries, one every 30 s: none spends an attempt.
        for s in (30..7200).step_by(30) {
            let now = t0 + Duration::from_secs(s);
            assert_eq!(
                streaks.attempt(1, (false, DOWN, 1), now, RECENT),
                Attempt::InOutage {
                    lasted: Duration::from_secs(s)
                }
            );
            streaks.batch(1, false, (Some("refused".into()), &[1, 2]), now);
        }
        let back = t0 + Duration::from_secs(7200);
        streaks.batch(1, true, (None, &[]), back);
        assert_eq!(
            streaks.attempt(1, (false, DOWN, 1), back + Duration::from_secs(1), RECENT),
            Attempt::Counted
        );
    }

    /// Two batches in flight when the broker goes: the second back finds the first's
    /// streak and spends nothing; one with a confirmed event among its failures counts
    /// them, whatever the streak.
    #[test]
    fn batches_in_flight_when_the_destination_goes_down_race_to_begin_the_outage() {
        let t0 = Instant::now();
        let mut streaks = PublishStreaks::default();
        assert_eq!(
            streaks.attempt(1, (false, DOWN, 1), t0, RECENT),
            Attempt::Counted
        );
        streaks.batch(1, false, (Some("timeout".into()), &[1, 2]), t0);
        let second = t0 + Duration::from_millis(5);
        assert!(matches!(
            streaks.attempt(1, (false, DOWN, 1), second, RECENT),
            Attempt::InOutage { .. }
        ));
        assert_eq!(
            streaks.attempt(1, (true, DOWN, 1), second, RECENT),
            Attempt::Counted
        );
    }

    /// A poison event beside working ones: their confirmations end the streak its own
    /// failure began, so each of its tries counts, and it is dead-lettered as before.
    #[test]
    fn a_poison_event_beside_confirmed_ones_spends_its_attempts() {
        let t0 = Instant::now();
        let mut streaks = PublishStreaks::default();
        for attempt in 0..20u64 {
            let tried = t0 + Duration::from_secs(attempt * 10);
            assert_eq!(
                streaks.attempt(1, (false, PublishErrorKind::Timeout, 1), tried, RECENT),
                Attempt::Counted,
                "try {attempt}"
            );
            streaks.batch(1, false, (Some("timeout".into()), &[1, 2]), tried);
            streaks.batch(1, true, (None, &[]), tried + Duration::from_secs(1));
        }
    }

    /// One event failing alone, on a quiet system (a receiver that answers 503 to it alone,
    /// no other event to confirm): no evidence against its destination, so each failure
    /// counts, and it is dead-lettered as before. It waited for good when any streak
    /// spared it. A second event failing in the streak makes it an outage.
    #[test]
    fn a_lone_failing_event_spends_its_attempts() {
        let t0 = Instant::now();
        let mut streaks = PublishStreaks::default();
        for s in 0..20u64 {
            let now = t0 + Duration::from_secs(s);
            assert_eq!(
                streaks.attempt(1, (false, DOWN, 1), now, RECENT),
                Attempt::Counted,
                "try {s}"
            );
            streaks.batch(1, false, (Some("503".into()), &[7]), now);
        }
        let now = t0 + Duration::from_secs(20);
        streaks.batch(1, false, (Some("503".into()), &[8]), now);
        assert!(matches!(
            streaks.attempt(1, (false, DOWN, 1), now, RECENT),
            Attempt::InOutage { .. }
        ));
    }

    /// An outbox whose events share one key sends only its head through an outage, so one
    /// event fails alone: its destination's health check decides. Failing, the event
    /// spends nothing (it was dead-lettered at its attempts, one event an hour at the
    /// defaults); passing, each failure counts, as a poison event's must. One check runs
    /// at a time, and each lone failure may ask for the next.
    #[test]
    fn a_lone_failing_event_spends_nothing_while_its_destination_fails_its_health_check() {
        let t0 = Instant::now();
        let mut streaks = PublishStreaks::default();
        streaks.batch(1, false, (Some("refused".into()), &[7]), t0);
        assert!(streaks.wants_probe(1));
        assert!(!streaks.wants_probe(1), "one check at a time");
        let checked = t0 + Duration::from_millis(1);
        streaks.probed(1, checked, true);
        let retried = t0 + Duration::from_secs(5);
        assert!(matches!(
            streaks.attempt(1, (false, DOWN, 1), retried, RECENT),
            Attempt::InOutage { .. }
        ));
        streaks.batch(1, false, (Some("refused".into()), &[7]), retried);
        assert!(streaks.wants_probe(1), "the next lone failure checks again");
        // The destination answers its health check again, and still refuses the event.
        streaks.probed(1, retried, false);
        assert_eq!(
            streaks.attempt(1, (false, DOWN, 1), t0 + Duration::from_secs(10), RECENT),
            Attempt::Counted
        );
        // Several events failing need no check.
        streaks.batch(1, false, (Some("refused".into()), &[8]), retried);
        assert!(!streaks.wants_probe(1));
    }

    /// A check started within one streak, ending after a confirmation closed it and a new
    /// streak began: it says nothing of the new one, whose lone event counts until a check
    /// of its own fails. A verdict for a group with no streak is dropped.
    #[test]
    fn a_check_started_before_its_streak_says_nothing_of_it() {
        let t0 = Instant::now();
        let mut streaks = PublishStreaks::default();
        streaks.batch(1, false, (Some("refused".into()), &[7]), t0);
        assert!(streaks.wants_probe(1));
        streaks.batch(1, true, (None, &[]), t0 + Duration::from_secs(1));
        streaks.probed(1, t0, true);
        assert!(streaks.is_empty());
        let again = t0 + Duration::from_secs(2);
        streaks.batch(1, false, (Some("503".into()), &[9]), again);
        assert!(streaks.wants_probe(1));
        streaks.probed(1, t0, true);
        assert_eq!(
            streaks.attempt(1, (false, DOWN, 1), again + Duration::from_secs(1), RECENT),
            Attempt::Counted
        );
        assert!(
            !streaks.wants_probe(1),
            "the new streak's own check still runs"
        );
        streaks.probed(1, again, true);
        assert!(matches!(
            streaks.attempt(1, (false, DOWN, 1), again + Duration::from_secs(1), RECENT),
            Attempt::InOutage { .. }
        ));
    }

    /// A failure that may be the event's own (an HTTP 500, a missing route) counts even in
    /// an outage; and one group's outage spares none of another group's failures.
    #[test]
    fn only_the_destinations_condition_in_its_own_group_is_spared() {
        let t0 = Instant::now();
        let mut streaks = PublishStreaks::default();
        streaks.batch(1, false, (Some("refused".into()), &[1, 2]), t0);
        let now = t0 + Duration::from_secs(5);
        for kind in [
            PublishErrorKind::BrokerFailure,
            PublishErrorKind::NoRoute,
            PublishErrorKind::MissingTarget,
        ] {
            assert_eq!(
                streaks.attempt(1, (false, kind, 1), now, RECENT),
                Attempt::Counted,
                "{kind:?}"
            );
        }
        for kind in [
            PublishErrorKind::Unavailable,
            PublishErrorKind::Timeout,
            PublishErrorKind::Throttled,
            PublishErrorKind::Unauthorized,
            PublishErrorKind::Io,
        ] {
            assert!(
                matches!(
                    streaks.attempt(1, (false, kind, 1), now, RECENT),
                    Attempt::InOutage { .. }
                ),
                "{kind:?}"
            );
        }
        assert_eq!(
            streaks.attempt(2, (false, DOWN, 1), now, RECENT),
            Attempt::Counted
        );
    }

    /// An event's first failure counts even in an outage: a row at 0 attempts holds back
    /// none of its key's later rows (a WAL capture's key went out of order under a broker
    /// outage when it stayed at 0). Later ones keep the attempts as they were.
    #[test]
    fn a_first_failure_counts_even_in_an_outage() {
        let t0 = Instant::now();
        let mut streaks = PublishStreaks::default();
        streaks.batch(1, false, (Some("refused".into()), &[1, 2]), t0);
        let now = t0 + Duration::from_secs(5);
        let first = streaks.attempt(1, (false, DOWN, 0), now, RECENT);
        assert_eq!(first, Attempt::Counted);
        assert_eq!(first.attempts_after(0), 1);
        let later = streaks.attempt(1, (false, DOWN, 1), now, RECENT);
        assert!(matches!(later, Attempt::InOutage { .. }), "{later:?}");
        assert_eq!(later.attempts_after(1), 1);
        assert_eq!(later.attempts_after(7), 7);
    }

    /// A retry in an outage comes back up to `max_delay` and a publish's timeout after
    /// the failure before it, past `/readyz`'s window: the streak is kept for the longer
    /// one, and that retry spends nothing. Forgotten at `/readyz`'s window, it counted, and
    /// the outage was found anew, so a long outage still spent attempts.
    #[test]
    fn a_retry_that_comes_back_after_readyz_window_is_still_in_the_outage() {
        let t0 = Instant::now();
        let kept = RECENT * 3;
        let mut streaks = PublishStreaks::default();
        streaks.batch(1, false, (Some("timeout".into()), &[1, 2]), t0);
        let late = t0 + RECENT * 2;
        assert_eq!(
            streaks.oldest(late, (RECENT, kept)),
            None,
            "/readyz's window"
        );
        assert!(matches!(
            streaks.attempt(1, (false, DOWN, 1), late, kept),
            Attempt::InOutage { .. }
        ));
    }

    /// A streak no failure continued within `recent` says nothing of now: the next failure
    /// counts (and begins a streak again).
    #[test]
    fn a_stale_streak_spares_nothing() {
        let t0 = Instant::now();
        let mut streaks = PublishStreaks::default();
        streaks.batch(1, false, (Some("refused".into()), &[1, 2]), t0);
        let later = t0 + RECENT + Duration::from_secs(1);
        assert_eq!(
            streaks.attempt(1, (false, DOWN, 1), later, RECENT),
            Attempt::Counted
        );
    }

    /// A streak no retry continued within `recent` is forgotten (its events were
    /// dead-lettered, or nothing is left to send); dead letters alone neither start nor
    /// end one.
    #[test]
    fn a_streak_no_retry_continued_is_forgotten() {
        let t0 = Instant::now();
        let mut streaks = PublishStreaks::default();
        streaks.batch(1, false, (Some("503".into()), &[1, 2]), t0);
        streaks.batch(1, false, (None, &[]), t0 + Duration::from_secs(10));
        assert!(streaks.oldest(t0 + RECENT, (RECENT, RECENT)).is_some());
        assert!(streaks
            .oldest(t0 + RECENT + Duration::from_secs(1), (RECENT, RECENT))
            .is_none());
        assert!(streaks.is_empty());
    }
}
