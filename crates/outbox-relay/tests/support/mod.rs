//! What the binary's tests share: starting relay processes, signalling them, reading their
//! logs (printed, and kept on disk, when a test fails), and database clients.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use outbox_testkit::eventually;

pub const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

/// A relay process whose stderr (its logs) goes to `<dir>/<name>.log`.
pub struct RelayProcess {
    pub name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl RelayProcess {
    /// Runs `outbox-relay <args>` in `dir` with `env` set (and `DATABASE_URL` unset unless
    /// given), stdout discarded.
    pub fn spawn(dir: &Path, name: &str, args: &[&str], env: &[(&str, &str)]) -> Self {
        let log = dir.join(format!("{name}.log"));
        let mut command = Command::new(BIN);
        command
            .args(args)
            .current_dir(dir)
            .env_remove("DATABASE_URL")
            .env_remove("OUTBOX_RELAY_DATABASE_URL")
            .stdout(std::fs::File::create(dir.join(format!("{name}.stdout"))).unwrap())
            .stderr(std::fs::File::create(&log).unwrap());
        for (k, v) in env {
            command.env(k, v);
        }
        let child = command
            .stdin(Stdio::null())
            .spawn()
            .expect("start outbox-relay");
        RelayProcess {
            name: name.to_string(),
            child: Some(child),
            log,
        }
    }

    pub fn pid(&self) -> String {
        self.child.as_ref().expect("running").id().to_string()
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Sends a signal such as `-TERM`, `-STOP` or `-CONT`.
    pub fn signal(&self, signal: &str) {
        assert!(Command::new("kill")
            .args([signal, &self.pid()])
            .status()
            .unwrap()
            .success());
    }

    /// SIGKILL, and reap.
    pub fn kill9(&mut self) {
        let mut child = self.child.take().expect("running");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    pub async fn wait_exit(&mut self) -> ExitStatus {
        let child = self.child.as_mut().expect("running");
        let status = eventually("the relay to exit", Duration::from_secs(30), || {
            let s = child.try_wait().unwrap();
            async move { s }
        })
        .await;
        self.child = None;
        status
    }

    /// SIGTERM, then wait for the exit.
    pub async fn terminate(&mut self) -> ExitStatus {
        self.signal("-TERM");
        self.wait_exit().await
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = Command::new("kill")
                .args(["-CONT", &child.id().to_string()])
                .status();
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            let keep = std::env::temp_dir().join("outbox-relay-failed-test-logs");
            let _ = std::fs::create_dir_all(&keep);
            let _ = std::fs::copy(&self.log, keep.join(format!("{}.log", self.name)));
            let logs = self.logs();
            let tail: Vec<&str> = logs.lines().rev().take(40).collect();
            eprintln!(
                "--- {} (last lines; whole log kept in {}) ---\n{}",
                self.name,
                keep.display(),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
    }
}

pub async fn pg(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
}

/// JSON lines of a sink file; a torn line (from a kill -9 mid-write) is skipped.
pub fn read_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Waits until the sink file at `path` holds a number of JSON lines that `done` accepts.
pub async fn wait_for_lines(
    what: &str,
    path: &Path,
    timeout: Duration,
    done: impl Fn(usize) -> bool,
) {
    eventually(what, timeout, || {
        let n = read_lines(path).len();
        let ready = done(n);
        async move { ready.then_some(()) }
    })
    .await
}
