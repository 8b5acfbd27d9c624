//! Typed errors and their classification.
//!
//! Every error the relay meets is one of two kinds: a [`PublishError`] from a sink or a
//! [`StoreError`] from the database. Whether it is worth retrying is decided here and
//! nowhere else: see [`PublishErrorKind::disposition`] and [`StoreErrorKind::is_retryable`].

use std::error::Error as StdError;
use std::time::Duration;

type Source = Box<dyn StdError + Send + Sync + 'static>;

/// What the relay does with an event whose publish failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Disposition {
    /// Try again later; `after` is a delay the sink asked for (for example HTTP Retry-After).
    Retry { after: Option<Duration> },
    /// Never retry: the event goes to the dead letters at once.
    Permanent,
}

/// Why a sink did not confirm an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PublishErrorKind {
    /// The broker cannot be reached or the connection dropped.
    Unavailable,
    /// No confirmation arrived in time.
    Timeout,
    /// The broker asked us to slow down.
    Throttled,
    /// The broker failed on its side (HTTP 5xx, a broker-internal error).
    BrokerFailure,
    /// The target (stream, exchange, topic) does not exist yet.
    MissingTarget,
    /// No route is configured for the event's destination.
    NoRoute,
    /// Local I/O failed (file sink, stdout).
    Io,
    /// The message is larger than the broker accepts.
    TooLarge,
    /// The broker refused our credentials or permissions. Retried: it is the sink's
    /// condition, not the event's (a credential rotated, a permission not granted yet), and
    /// dead-lettering at once emptied the whole outbox into the dead letters, one claim at
    /// a time, until it was fixed.
    Unauthorized,
    /// The broker refused this message for good (HTTP 4xx, invalid subject...).
    Rejected,
    /// The event could not be encoded for this sink.
    Encoding,
    /// Not sent at all: an earlier event of its key in the batch failed, and a sink that
    /// keeps a key's runs in order ([`crate::Publisher::max_events_per_key`]) sends none of
    /// the key's later events after it; or the sink had no room to start it in time (a
    /// webhook's requests per destination all busy). It counts as no attempt.
    NotSent,
}

impl PublishErrorKind {
    /// The one place that decides whether a publish failure is retried.
    pub fn disposition(self) -> Disposition {
        use PublishErrorKind::*;
        match self {
            Unavailable | Timeout | Throttled | BrokerFailure | MissingTarget | NoRoute | Io
            | Unauthorized | NotSent => Disposition::Retry { after: None },
            TooLarge | Rejected | Encoding => Disposition::Permanent,
        }
    }

    /// Whether the failure is the destination's condition rather than the event's: a
    /// broker away or refusing everyone, out of time, overloaded, a full disk. Such a
    /// failure, while the destination confirms nothing else, spends none of the event's
    /// attempts (`PublishStreaks::attempt` in the engine): an outage longer than the
    /// retries dead-lettered every event that would have gone out once it ended.
    /// `BrokerFailure` (an HTTP 500 among them) and a missing target or route may be the
    /// event's own, and always count.
    pub fn is_the_destinations_condition(self) -> bool {
        use PublishErrorKind::*;
        match self {
            Unavailable | Timeout | Throttled | Unauthorized | Io => true,
            BrokerFailure | MissingTarget | NoRoute | TooLarge | Rejected | Encoding | NotSent => {
                false
            }
        }
    }

    pub fn as_str(self) -> &'static str {
        use PublishErrorKind::*;
        match self {
            Unavailable => "unavailable",
            Timeout => "timeout",
            Throttled => "throttled",
            BrokerFailure => "broker_failure",
            MissingTarget => "missing_target",
            NoRoute => "no_route",
            Io => "io",
            TooLarge => "too_large",
            Unauthorized => "unauthorized",
            Rejected => "rejected",
            Encoding => "encoding",
            NotSent => "not_sent",
        }
    }
}

/// A failed publish of one event.
#[derive(Debug, thiserror::Error)]
#[error("{}: {message}", kind.as_str())]
pub struct PublishError {
    kind: PublishErrorKind,
    message: String,
    retry_after: Option<Duration>,
    source: Option<Source>,
}

impl PublishError {
    pub fn new(kind: PublishErrorKind, message: impl Into<String>) -> Self {
        PublishError {
            kind,
            message: message.into(),
            retry_after: None,
            source: None,
        }
    }

    /// Chains the underlying error instead of formatting it into the message.
    pub fn with_source(mut self, source: impl Into<Source>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// A delay the broker asked for; it replaces the backoff for this attempt.
    pub fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    pub fn kind(&self) -> PublishErrorKind {
        self.kind
    }

    pub fn disposition(&self) -> Disposition {
        match self.kind.disposition() {
            Disposition::Retry { .. } => Disposition::Retry {
                after: self.retry_after,
            },
            Disposition::Permanent => Disposition::Permanent,
        }
    }

    /// [`report`](Self::report) without the kind in front, for the same failure made again
    /// with the same kind (one per event of a failed batch), which said its kind twice
    /// (`missing_target: missing_target: …`).
    pub fn report_without_kind(&self) -> String {
        let report = self.report();
        match report.strip_prefix(self.kind.as_str()) {
            Some(rest) => rest.strip_prefix(": ").unwrap_or(rest).to_string(),
            None => report,
        }
    }

    /// The message with its chain of causes, as stored in `last_error` (which the API
    /// serves): through the one redactor, so that no cause's URL carries a secret there.
    pub fn report(&self) -> String {
        crate::redact::redact_url(&report(self))
    }
}

/// Why a database operation failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// The database cannot be reached or the connection dropped.
    Connection,
    /// A transient conflict (deadlock, serialization failure, lock timeout, busy).
    Conflict,
    /// The outbox or nodes table (or the trigger) is missing.
    MissingSchema,
    /// The database role lacks a privilege.
    Privilege,
    /// The configuration is wrong (bad URL, bad identifier, TLS setup).
    Config,
    /// A column has a type the relay cannot read (altered after `migrate`).
    SchemaMismatch,
    /// The schema's recorded version is older than the relay needs, or newer than it knows
    /// (see [`crate::migration`]): only `migrate` or an upgrade fixes it.
    SchemaVersion,
    /// The database reports its storage damaged (SQLite's SQLITE_CORRUPT): no retry can
    /// succeed, and each would publish again what it cannot ack.
    Corrupt,
    /// The database refused a row the statement wrote or deleted: a constraint (a foreign
    /// key from an application's table to an outbox row, a unique or check constraint) or a
    /// trigger's exception. Retried; a settle of several rows that fails so is split, row
    /// by row at the end, so that the one row refused holds back no other.
    RowRefused,
    /// Any other failure of a statement.
    Query,
}

impl StoreErrorKind {
    /// The one place that decides whether a database failure is retried.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            StoreErrorKind::Connection
                | StoreErrorKind::Conflict
                | StoreErrorKind::RowRefused
                | StoreErrorKind::Query
        )
    }
    /// What an operator should do about it.
    pub fn hint(self) -> &'static str {
        match self {
            StoreErrorKind::Connection => "check that the database is running and the URL's host, port and credentials are right",
            StoreErrorKind::Conflict => "this is transient; the relay retries by itself",
            StoreErrorKind::MissingSchema => "run `outbox-relay migrate` (or `run --auto-migrate`), or apply the DDL from `outbox-relay migrate --print`",
            StoreErrorKind::Privilege => "grant the privileges listed by `outbox-relay migrate --print` to the relay's role; the operator's commands (`dead retry`, `dead purge`, `prune`, `replay`) and the console's actions need the operator grants it prints as comments too",
            StoreErrorKind::Config => "fix the configuration value named in the message",
            StoreErrorKind::Corrupt => "stop writing to the database and recover it (`sqlite3 FILE .recover`, or restore a backup); events published but not acked are sent again once it is sound",
            StoreErrorKind::SchemaMismatch => "restore the column's type as `outbox-relay migrate --print` shows it; `outbox-relay check` lists every column that differs, with the ALTER TABLE that restores it",
            StoreErrorKind::SchemaVersion => "run `outbox-relay migrate` if the schema is older than the relay needs; upgrade the relay if it is newer",
            StoreErrorKind::RowRefused => "the database refused a row, as its message says: a constraint or a trigger on the table (a foreign key from another table to an outbox row, a unique or check constraint, a trigger's exception); change or drop it, or the row (a running relay retries a refused settle row by row meanwhile, the other rows going on)",
            StoreErrorKind::Query => "see the database's message; `outbox-relay check` verifies the tables",
        }
    }
}

/// A failed database operation.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct StoreError {
    kind: StoreErrorKind,
    message: String,
    source: Option<Source>,
    /// A fix more precise than the kind's (a TLS failure is a `Connection` error, but its
    /// fix is about certificates, not about the host and port).
    hint: Option<&'static str>,
}

impl StoreError {
    pub fn new(kind: StoreErrorKind, message: impl Into<String>) -> Self {
        StoreError {
            kind,
            message: message.into(),
            source: None,
            hint: None,
        }
    }

    /// Replaces the kind's hint; the kind alone still decides whether it is retried.
    pub fn with_hint(mut self, hint: &'static str) -> Self {
        self.hint = Some(hint);
        self
    }

    /// What an operator should do about it.
    pub fn hint(&self) -> &'static str {
        self.hint.unwrap_or(self.kind.hint())
    }

    pub fn with_source(mut self, source: impl Into<Source>) -> Self {
        self.source = Some(source.into());
        self
    }

    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }

    /// The same failure, its message led by what it was about (`row 42`).
    pub fn about(mut self, what: impl std::fmt::Display) -> Self {
        self.message = format!("{what}: {}", self.message);
        self
    }

    pub fn is_retryable(&self) -> bool {
        self.kind.is_retryable()
    }

    /// The same failure for another caller that waited on the one statement that failed
    /// (the acks a group commit carried): its kind, its fix, and its message with the
    /// causes, as redacted text (the fix is added once, by [`StoreError::report`]).
    pub fn duplicate(&self) -> StoreError {
        StoreError {
            kind: self.kind,
            message: crate::redact::redact_url(&report(self)),
            source: None,
            hint: self.hint,
        }
    }

    /// The message with its causes and the operator hint, through the one redactor (a
    /// driver's error may quote the URL it failed on).
    pub fn report(&self) -> String {
        crate::redact::redact_url(&format!("{} (fix: {})", report(self), self.hint()))
    }
}

/// An error and its chain of causes on one line, without repeats.
pub fn report(error: &dyn StdError) -> String {
    let mut out = error.to_string();
    let mut cause = error.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refusal of an operator's command (`dead retry` under the run-time role `migrate
    /// --print` grants) told to grant what the role had; the operator grants are the
    /// commented ones.
    #[test]
    fn a_privilege_refused_names_the_operator_grants_too() {
        let hint = StoreErrorKind::Privilege.hint();
        assert!(hint.contains("operator grants"), "{hint}");
        assert!(hint.contains("dead retry"), "{hint}");
    }

    #[test]
    fn permanent_kinds_are_never_retried() {
        for kind in [
            PublishErrorKind::TooLarge,
            PublishErrorKind::Rejected,
            PublishErrorKind::Encoding,
        ] {
            assert_eq!(kind.disposition(), Disposition::Permanent, "{kind:?}");
        }
        // A refused credential is the sink's, not the event's: every event would fail.
        for kind in [
            PublishErrorKind::Unavailable,
            PublishErrorKind::Unauthorized,
        ] {
            assert_eq!(kind.disposition(), Disposition::Retry { after: None });
        }
    }

    #[test]
    fn retry_after_is_carried_for_retryable_errors_only() {
        let e = PublishError::new(PublishErrorKind::Throttled, "429")
            .with_retry_after(Duration::from_secs(3));
        assert_eq!(
            e.disposition(),
            Disposition::Retry {
                after: Some(Duration::from_secs(3))
            }
        );
        let e = PublishError::new(PublishErrorKind::TooLarge, "too big")
            .with_retry_after(Duration::from_secs(3));
        assert_eq!(e.disposition(), Disposition::Permanent);
    }

    #[test]
    fn report_chains_sources() {
        let io = std::io::Error::other("disk full");
        let e = PublishError::new(PublishErrorKind::Io, "writing events.jsonl").with_source(io);
        assert_eq!(e.report(), "io: writing events.jsonl: disk full");
        let s = StoreError::new(
            StoreErrorKind::MissingSchema,
            "relation \"outbox\" does not exist",
        );
        assert!(s.report().contains("outbox-relay migrate"));
        assert!(!s.is_retryable());
    }
}
