//! How the binary fails: the configuration error and the exit codes.

use std::process::ExitCode;

// Exit 0 (`ExitCode::SUCCESS`): everything went as asked.

/// A failure at run time (a database or broker that failed, a drain left incomplete): trying
/// again may succeed.
pub const EXIT_FAILURE: u8 = 1;
/// A configuration only the operator can fix: trying again cannot succeed.
pub const EXIT_BAD_CONFIGURATION: u8 = 2;

/// A failure only the operator's configuration can fix: the binary exits 2 for it.
#[derive(Debug)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

/// `message` as a configuration error (exit 2).
pub fn config_error(message: String) -> anyhow::Error {
    anyhow::Error::new(ConfigError(message))
}

/// Whether `e` is, or wraps, a configuration error.
pub fn is_config_error(e: &anyhow::Error) -> bool {
    e.downcast_ref::<ConfigError>().is_some()
}

/// The exit code for an error the process ends with.
pub fn exit_code(e: &anyhow::Error) -> ExitCode {
    ExitCode::from(if is_config_error(e) {
        EXIT_BAD_CONFIGURATION
    } else {
        EXIT_FAILURE
    })
}

/// A store error as the binary reports it: exit 2 when only the configuration can fix it.
/// Whether `e` is the configuration's to fix (exit 2): a wrong setting, or a schema older or
/// newer than the relay runs on, fixed by `migrate` or an upgrade, never by retrying.
pub fn is_configuration(e: &outbox_core::StoreError) -> bool {
    matches!(
        e.kind(),
        outbox_core::StoreErrorKind::Config | outbox_core::StoreErrorKind::SchemaVersion
    )
}

pub fn failure(message: String, e: &outbox_core::StoreError) -> anyhow::Error {
    if is_configuration(e) {
        config_error(message)
    } else {
        anyhow::anyhow!(message)
    }
}
