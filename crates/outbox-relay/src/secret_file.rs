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
        // A file with text past a blank first line is not empty: saying so sent the
        // operator looking at the wrong file.
        let state = if text.trim().is_empty() {
            "is empty"
        } else {
            "has a blank first line (the secret is read from the first line alone)"
        };
        return Err(config_error(format!(
            "the {what} file {} {state}: put the {what} on its first line (or point {flag} \
             at the file that holds it)",
            path.display()
        )));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blank_first_line_is_named_as_such_not_as_an_empty_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "\nsecret-token-value\n").unwrap();
        let said = read(&path, "admin token", "--admin-token-file")
            .unwrap_err()
            .to_string();
        assert!(said.contains("blank first line"), "{said}");
        assert!(!said.contains("secret-token-value"), "{said}");
        std::fs::write(&path, "\n").unwrap();
        let said = read(&path, "admin token", "--admin-token-file")
            .unwrap_err()
            .to_string();
        assert!(said.contains("is empty"), "{said}");
    }
}
