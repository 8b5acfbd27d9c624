//! Why a sink could not be set up, and what that means for the relay.
//!
//! Failures of one event are [`outbox_core::PublishError`]s, classified in `outbox-core`. A
//! sink that cannot be set up at all (a bad URI, a setting it does not read, an unreadable TLS
//! or credentials file, a broker that refuses the relay at start-up) fails before any event:
//! it gets this type instead, and [`SinkSetupKind`] alone decides whether only the
//! configuration can fix it.

use std::error::Error as StdError;

type Source = Box<dyn StdError + Send + Sync + 'static>;

/// Why a sink could not be set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SinkSetupKind {
    /// Only the configuration can fix it: a URI or setting the sink cannot use, a file it
    /// cannot read, credentials the broker refuses, a sink this build leaves out.
    Config,
    /// The broker could not be reached at start-up; it may come back by itself.
    Unavailable,
}

impl SinkSetupKind {
    /// The one place that decides whether a set-up failure is the operator's configuration
    /// (the binary exits 2 for those, as for any configuration error).
    pub fn is_config(self) -> bool {
        match self {
            SinkSetupKind::Config => true,
            SinkSetupKind::Unavailable => false,
        }
    }
}

/// A sink that could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct SinkSetupError {
    kind: SinkSetupKind,
    message: String,
    source: Option<Source>,
}

impl SinkSetupError {
    pub fn new(kind: SinkSetupKind, message: impl Into<String>) -> Self {
        SinkSetupError {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// A failure only the configuration can fix; the message names the setting and the fix.
    pub fn config(message: impl Into<String>) -> Self {
        Self::new(SinkSetupKind::Config, message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(SinkSetupKind::Unavailable, message)
    }

    /// Chains the underlying error instead of formatting it into the message.
    pub fn with_source(mut self, source: impl Into<Source>) -> Self {
        self.source = Some(source.into());
        self
    }

    pub fn kind(&self) -> SinkSetupKind {
        self.kind
    }

    /// The message with its chain of causes.
    pub fn report(&self) -> String {
        outbox_core::error::report(self)
    }
}
