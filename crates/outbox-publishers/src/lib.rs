//! Publishers (sinks) for outbox-relay, one module per target.
//!
//! Each implements [`outbox_core::Publisher`]; [`from_uri`] picks one from a `--sink` URI.

pub mod json_lines;

use outbox_core::{PublishError, PublishErrorKind, Publisher};
use std::sync::Arc;

pub use json_lines::{FileSink, StdoutSink};

/// Builds the publisher a `--sink` URI names: `stdout`, or `file:PATH`.
pub fn from_uri(uri: &str) -> Result<Arc<dyn Publisher>, PublishError> {
    if uri == "stdout" || uri == "stdout:" {
        return Ok(Arc::new(StdoutSink::new()));
    }
    if let Some(path) = uri.strip_prefix("file:") {
        let path = path.strip_prefix("//").unwrap_or(path);
        if path.is_empty() {
            return Err(PublishError::new(
                PublishErrorKind::Rejected,
                "sink `file:` needs a path, e.g. --sink file:/var/lib/outbox/events.jsonl",
            ));
        }
        return Ok(Arc::new(FileSink::open(path)?));
    }
    Err(PublishError::new(
        PublishErrorKind::Rejected,
        format!("unknown sink {uri:?}: use `stdout` or `file:PATH`"),
    ))
}
