//! Private server processes for tests that stop and restart their broker.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

/// A free loopback port.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `N` free ports, all different: each listener is held until all are chosen. Chosen one at
/// a time with [`free_port`], two came out the same now and then (the kernel hands a port
/// just let go of out again), and the second server to bind it did not start.
pub fn free_ports<const N: usize>() -> [u16; N] {
    let held: Vec<TcpListener> = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    std::array::from_fn(|i| held[i].local_addr().unwrap().port())
}

/// A server process started from a command line, restartable on the same port and data dir.
pub struct ServerProcess {
    program: String,
    args: Vec<String>,
    pub port: u16,
    pub dir: tempfile::TempDir,
    child: Mutex<Option<Child>>,
}

impl ServerProcess {
    /// Starts `program args...` (where `{port}` and `{dir}` are substituted) and waits until
    /// the port accepts connections.
    pub fn start(program: &str, args: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let args = args
            .iter()
            .map(|a| {
                a.replace("{port}", &port.to_string())
                    .replace("{dir}", dir.path().to_str().unwrap())
            })
            .collect();
        let server = ServerProcess {
            program: program.to_string(),
            args,
            port,
            dir,
            child: Mutex::new(None),
        };
        server.resume();
        server
    }

    /// The running process's id, if it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.lock().unwrap().as_ref().map(|c| c.id())
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Kills the server (SIGKILL: the broker gets no chance to say goodbye).
    pub fn stop(&self) {
        if let Some(mut child) = self.child.lock().unwrap().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and data directory.
    pub fn resume(&self) {
        let child = Command::new(&self.program)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start {}: {e} (run scripts/servers.sh install)",
                    self.program
                )
            });
        *self.child.lock().unwrap() = Some(child);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "{} did not open port {}",
                self.program,
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One server of a test's own, started through `scripts/servers.sh` (for the slow starters,
/// PostgreSQL and RabbitMQ) with a private state directory and port, and stopped on drop.
pub struct ScriptedServer {
    state: tempfile::TempDir,
    pub port: u16,
    server: &'static str,
    port_env: &'static str,
    /// More variables for `servers.sh` (`MARIADB_SERVER_ID`).
    env: Vec<(&'static str, String)>,
}

impl ScriptedServer {
    /// `server` is a name `servers.sh` knows (`postgres`, `rabbitmq`); `port_env` the
    /// variable it reads that server's port from.
    pub fn start(server: &'static str, port_env: &'static str) -> Self {
        Self::start_with(server, port_env, &[])
    }

    /// [`ScriptedServer::start`] with more variables for `servers.sh`.
    pub fn start_with(
        server: &'static str,
        port_env: &'static str,
        env: &[(&'static str, &str)],
    ) -> Self {
        let state = tempfile::Builder::new()
            .prefix("own-server")
            .tempdir()
            .unwrap();
        // PostgreSQL runs as the postgres user, which must reach the directory.
        std::fs::set_permissions(
            state.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o777),
        )
        .unwrap();
        let server = ScriptedServer {
            state,
            port: free_port(),
            server,
            port_env,
            env: env.iter().map(|(k, v)| (*k, v.to_string())).collect(),
        };
        server.script("start");
        server
    }

    /// Runs `servers.sh <command>` for this server; returns its standard output.
    pub fn script(&self, command: &str) -> String {
        self.script_with(&[command])
    }

    /// Runs `servers.sh <args>` for this server (`rabbitmqctl …`); returns its standard
    /// output.
    pub fn script_with(&self, args: &[&str]) -> String {
        let command = args.join(" ");
        let script =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/servers.sh");
        let out = Command::new("bash")
            .arg(script)
            .args(args)
            .env("OUTBOX_TEST_STATE", self.state.path())
            .env(self.port_env, self.port.to_string())
            .env("OUTBOX_TEST_SERVERS", self.server)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "servers.sh {command} {}: {}",
            self.server,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }
}

impl Drop for ScriptedServer {
    fn drop(&mut self) {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.script("stop")));
    }
}

/// A throwaway CA (`ca.pem`) and a server certificate for 127.0.0.1 (`server.pem`,
/// `server.key`), made by `scripts/servers.sh certs`.
pub fn test_certs() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/servers.sh");
    let out = Command::new("bash")
        .arg(script)
        .arg("certs")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "servers.sh certs: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir
}
