//! What more than one crate records under the same metric: its name, and the label guard
//! that keeps its destinations few.
//!
//! The engine counts dead letters as it settles them; WAL capture counts the rows its
//! slot's first run dead-letters while adopting a table, which never reach the engine.
//! Both go through the same outbox's [`DestinationLabels`], so its cap is one count.

use std::collections::HashSet;
use std::sync::Mutex;

/// Events moved to the dead letters, by destination.
pub const DEAD_LETTERED: &str = "outbox_events_dead_lettered_total";

/// Distinct destinations labelled before the rest become `other`.
pub const DEFAULT_DESTINATION_LABELS: usize = 500;

/// Caps the number of distinct destination label values of one outbox, so a destination
/// per entity (`posts:123`) cannot blow up the metrics; the rest are counted as `other`.
/// One per outbox: another outbox's destinations do not use up its cap.
#[derive(Debug)]
pub struct DestinationLabels {
    seen: Mutex<HashSet<String>>,
    limit: usize,
}

impl Default for DestinationLabels {
    fn default() -> Self {
        DestinationLabels::new(DEFAULT_DESTINATION_LABELS)
    }
}

impl DestinationLabels {
    pub fn new(limit: usize) -> Self {
        DestinationLabels {
            seen: Mutex::new(HashSet::new()),
            limit,
        }
    }

    /// The destination's label value, its control characters escaped: a writer chooses
    /// destinations, and `/metrics` (which needs no token) printed one raw, so a `curl` of it
    /// in a terminal ran the escape sequences it held.
    pub fn label(&self, destination: &str) -> String {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let shown = || crate::redact::escape_controls(destination).into_owned();
        if seen.contains(destination) {
            return shown();
        }
        if seen.len() < self.limit {
            seen.insert(destination.to_string());
            return shown();
        }
        "other".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations_beyond_the_limit_become_other() {
        let labels = DestinationLabels::new(2);
        assert_eq!(labels.label("a"), "a");
        assert_eq!(labels.label("b"), "b");
        assert_eq!(labels.label("c"), "other");
        assert_eq!(labels.label("a"), "a");
    }

    #[test]
    fn a_destinations_control_characters_are_escaped() {
        let labels = DestinationLabels::new(2);
        assert_eq!(
            labels.label("evil\u{1b}]0;pwned\u{7}"),
            "evil\\u{1b}]0;pwned\\u{7}"
        );
    }
}
