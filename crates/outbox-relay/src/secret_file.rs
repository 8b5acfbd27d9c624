//! Secrets kept in files (a systemd credential, a mounted Kubernetes Secret).

use std::path::Path;

use outbox_core::redact::Secret;

use crate::error::config_error;

/// The secret `what` from the first line of the file at `path`, trimmed (an editor's or
/// `echo`'s newline is no part of it). A file that cannot be read or holds nothing is a
/// configuration error naming the file and `flag`; the error never quotes the content.
pub fn read(path: &Path, what: &str, flag: &str) -> anyhow::Result<Secret> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        config_error(format!(
            "cannot read the {what} file {}: {e} (check {flag}, and that the relay's user may \
             read the file)",
            path.display()
        ))
    })?;
    let value = Secret::new(text.lines().next().unwrap_or_default().trim());
    if value.expose().is_empty() {
        return Err(config_error(format!(
            "the {what} file {} is empty: put the {what} on its first line (or point {flag} \
             at the file that holds it)",
            path.display()
        )));
    }
    Ok(value)
}
