//! How the process stops: on a signal, and within the shutdown's budget.

use std::time::Duration;

/// Resolves on SIGTERM or SIGINT.
pub async fn signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch SIGTERM; only Ctrl-C stops the relay");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
    }
}

/// How long past `shutdown_timeout` the process may linger (a thread blocked in a driver,
/// say) before it is ended anyway.
const SHUTDOWN_BACKSTOP_GRACE: Duration = Duration::from_secs(2);

/// Every step of the shutdown is bounded by `shutdown_timeout`; should something block a
/// thread regardless, this ends the process (exit 1) shortly after, saying so.
pub fn backstop(shutdown_timeout: Duration) {
    let spawned = std::thread::Builder::new()
        .name("shutdown-backstop".into())
        .spawn(move || {
            std::thread::sleep(shutdown_timeout + SHUTDOWN_BACKSTOP_GRACE);
            tracing::error!(
                shutdown_timeout = ?shutdown_timeout,
                "shutdown did not finish in time; exiting anyway (rows still leased come back when their leases run out)"
            );
            eprintln!("error: shutdown did not finish within {shutdown_timeout:?}; exiting anyway");
            std::process::exit(i32::from(crate::error::EXIT_FAILURE));
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the shutdown backstop");
    }
}
