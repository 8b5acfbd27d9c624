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

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// One group's failing streak.
#[derive(Clone, Debug, PartialEq)]
struct Streak {
    since: Instant,
    last: Instant,
    error: String,
}

#[derive(Debug, Default)]
pub struct PublishStreaks {
    groups: HashMap<u64, Streak>,
}

impl PublishStreaks {
    /// A batch of `group` came back at `now`: an event confirmed ends the group's streak;
    /// else a failure to retry (`error`) starts it or carries it on. Dead letters are their
    /// events' own fault, not the sink's: a batch of them alone says nothing.
    pub fn batch(&mut self, group: u64, confirmed: bool, error: Option<String>, now: Instant) {
        if confirmed {
            self.groups.remove(&group);
        } else if let Some(error) = error {
            let streak = self.groups.entry(group).or_insert_with(|| Streak {
                since: now,
                last: now,
                error: String::new(),
            });
            streak.last = now;
            streak.error = error;
        }
    }

    /// Forgets the streaks no failure continued within `recent`, and returns the oldest
    /// left: since when, and its latest error.
    pub fn oldest(&mut self, now: Instant, recent: Duration) -> Option<(Instant, String)> {
        self.groups
            .retain(|_, s| now.saturating_duration_since(s.last) <= recent);
        self.groups
            .values()
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
        streaks.batch(1, false, Some("stream not found".into()), t0);
        for s in 1..=40 {
            let now = t0 + Duration::from_secs(s);
            streaks.batch(2, true, None, now);
            if s % 5 == 0 {
                streaks.batch(1, false, Some("stream not found".into()), now);
            }
        }
        let now = t0 + Duration::from_secs(40);
        assert_eq!(
            streaks.oldest(now, RECENT),
            Some((t0, "stream not found".to_string()))
        );
        streaks.batch(1, true, None, now);
        assert_eq!(streaks.oldest(now, RECENT), None);
    }

    /// The oldest streak is the one reported; a group's streak keeps its start while it
    /// goes on, with its latest error.
    #[test]
    fn the_oldest_streak_is_reported_with_its_latest_error() {
        let t0 = Instant::now();
        let mut streaks = PublishStreaks::default();
        streaks.batch(1, false, Some("a".into()), t0);
        streaks.batch(2, false, Some("b".into()), t0 + Duration::from_secs(1));
        streaks.batch(
            1,
            false,
            Some("a again".into()),
            t0 + Duration::from_secs(2),
        );
        let now = t0 + Duration::from_secs(3);
        assert_eq!(
            streaks.oldest(now, RECENT),
            Some((t0, "a again".to_string()))
        );
        streaks.batch(1, true, None, now);
        assert_eq!(
            streaks.oldest(now, RECENT),
            Some((t0 + Duration::from_secs(1), "b".to_string()))
        );
    }

    /// A streak no retry continued within `recent` is forgotten (its events were
    /// dead-lettered, or nothing is left to send); dead letters alone neither start nor
    /// end one.
    #[test]
    fn a_streak_no_retry_continued_is_forgotten() {
        let t0 = Instant::now();
        let mut streaks = PublishStreaks::default();
        streaks.batch(1, false, Some("503".into()), t0);
        streaks.batch(1, false, None, t0 + Duration::from_secs(10));
        assert!(streaks.oldest(t0 + RECENT, RECENT).is_some());
        assert!(streaks
            .oldest(t0 + RECENT + Duration::from_secs(1), RECENT)
            .is_none());
        assert!(streaks.is_empty());
    }
}
