//! Secrets kept in files (a systemd credential, a mounted Kubernetes Secret).

use std::os::unix::fs::PermissionsExt;
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

/// The permission bits of the file at `path` when every user of the host may read it: the
/// file grants others read and each directory above it lets them through (a private
/// directory protects a file whatever its own mode). `None` when it is private to its owner
/// and group, or cannot be inspected. Group read is left alone: sharing a file with the
/// relay's group (Kubernetes' `defaultMode: 0440`) is a choice.
pub fn readable_by_everyone(path: &Path) -> Option<u32> {
    let path = std::fs::canonicalize(path).ok()?;
    let mode = std::fs::metadata(&path).ok()?.permissions().mode();
    if mode & 0o004 == 0 {
        return None;
    }
    let every_directory_passable = path
        .ancestors()
        .skip(1)
        .all(|dir| std::fs::metadata(dir).is_ok_and(|m| m.permissions().mode() & 0o001 != 0));
    every_directory_passable.then_some(mode & 0o777)
}

/// The warning for the file at `path` that every user of the host may read (`mode`);
/// `subject` names it, its path included.
pub fn exposed_warning(subject: &str, path: &Path, mode: u32) -> String {
    format!(
        "{subject} can be read by every user of this host (mode {mode:04o}): make it the \
         relay's own with `chmod 600 {}` (or 640 and the relay's group)",
        path.display()
    )
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

    #[test]
    fn a_file_is_readable_by_everyone_only_through_passable_directories() {
        let dir = tempfile::tempdir().unwrap();
        let inner = dir.path().join("inner");
        std::fs::create_dir(&inner).unwrap();
        let path = inner.join("token");
        std::fs::write(&path, "secret-token-value\n").unwrap();
        let set = |p: &Path, mode: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap()
        };
        set(dir.path(), 0o755);
        set(&inner, 0o755);
        set(&path, 0o644);
        assert_eq!(readable_by_everyone(&path), Some(0o644));
        set(&path, 0o640);
        assert_eq!(
            readable_by_everyone(&path),
            None,
            "group read is left alone"
        );
        set(&path, 0o604);
        set(&inner, 0o750);
        assert_eq!(
            readable_by_everyone(&path),
            None,
            "a private directory protects it"
        );
        assert_eq!(readable_by_everyone(&inner.join("absent")), None);
    }
}
