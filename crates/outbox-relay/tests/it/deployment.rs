//! Deployment faults against real PostgreSQL: two processes under one node id, a relay
//! pointed at a hot standby, the sessions' application name, and `migrate` as a schema's owner.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use outbox_testkit::server::{free_port, ScriptedServer};
use outbox_testkit::{eventually, eventually_explained};

use crate::support::{pg, read_lines, wait_for_lines, RelayProcess, BIN};

/// `migrate` of a polled outbox with 8 partitions.
fn migrate(url: &str) {
    migrate_with(url, &["--partitions", "8"]);
}

/// `migrate` with `extra` flags.
fn migrate_with(url: &str, extra: &[&str]) {
    let out = Command::new(BIN)
        .args(["migrate", "--database-url", url])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A relay named `node` (the process's own log name is `name`) publishing to `sink`.
fn relay(dir: &Path, name: &str, url: &str, node: &str, sink: &Path) -> RelayProcess {
    relay_expiring_after(dir, name, url, node, sink, "1500ms")
}

/// [`relay`] with its row's `heartbeat_timeout`.
fn relay_expiring_after(
    dir: &Path,
    name: &str,
    url: &str,
    node: &str,
    sink: &Path,
    heartbeat_timeout: &str,
) -> RelayProcess {
    let sink = format!("file:{}", sink.display());
    let args = [
        "run",
        "--database-url",
        url,
        "--sink",
        &sink,
        "--node-id",
        node,
        "--heartbeat-interval",
        "200ms",
        "--heartbeat-timeout",
        heartbeat_timeout,
        "--poll-interval",
        "100ms",
        "--http-addr",
        "",
    ];
    RelayProcess::spawn(dir, name, &args, &[])
}

async fn send(url: &str, key: &str) {
    pg(url)
        .await
        .execute(
            "INSERT INTO outbox (destination, partition_key, event_type, payload)
             VALUES ('d', $1, 't', '{}')",
            &[&key],
        )
        .await
        .unwrap();
}

/// Inserts `rows` events over `keys` keys, and an application's table `orders` whose row
/// refers to the `nth` of them (a foreign key), in one transaction; returns that event's id.
async fn an_order_refers_to_one_of(
    db: &tokio_postgres::Client,
    rows: i64,
    keys: i64,
    nth: i64,
) -> i64 {
    db.batch_execute(&format!(
        "CREATE TABLE orders (event bigint REFERENCES outbox (sequence_id));
         INSERT INTO outbox (destination, partition_key, event_type, payload)
           SELECT 'd', 'k' || (n % {keys}), 't', '{{}}' FROM generate_series(1, {rows}) n;
         INSERT INTO orders SELECT min(sequence_id) + {nth} - 1 FROM outbox;"
    ))
    .await
    .unwrap();
    db.query_one("SELECT event FROM orders", &[])
        .await
        .unwrap()
        .get(0)
}

/// Waits until the outbox holds `rows` rows (`what`, said if it never does).
async fn outbox_rows_become(
    db: &tokio_postgres::Client,
    node: &RelayProcess,
    rows: i64,
    what: &str,
) {
    eventually_explained(
        what,
        Duration::from_secs(60),
        || node.logs(),
        || async {
            let left: i64 = db
                .query_one("SELECT count(*) FROM outbox", &[])
                .await
                .ok()?
                .get(0);
            (left == rows).then_some(())
        },
    )
    .await;
}

/// Waits until `node`'s row is in the nodes table and returns its expiry as text.
async fn registered(url: &str, node: &str, process: &RelayProcess) -> String {
    let client = pg(url).await;
    eventually_explained(
        "the node to register",
        Duration::from_secs(30),
        || process.logs(),
        || {
            let client = &client;
            async move {
                client
                    .query_opt(
                        "SELECT expiry::text FROM outbox_nodes WHERE id = $1",
                        &[&node],
                    )
                    .await
                    .unwrap()
                    .map(|r| r.get::<_, String>(0))
            }
        },
    )
    .await
}

/// A database restored from a snapshot (or failed over to a replica that lagged) shows the
/// node's row as this process wrote it some heartbeats ago. Before, the relay took that for
/// another process under its id and stopped (exit 2), and restarted, waited out the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_row_went_back_to_an_earlier_heartbeat_of_its_own_carries_on() {
    let url = outbox_testkit::fresh_pg_database().await;
    migrate(&url);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("events.jsonl");
    // A long expiry: the earlier value is still live when written back, so that no removal
    // of expired rows makes the row simply gone.
    let relay = relay_expiring_after(dir.path(), "relay", &url, "same", &out, "60s");
    let earlier = registered(&url, "same", &relay).await;
    let client = pg(&url).await;
    let a_later_heartbeat = || {
        eventually_explained(
            "a later heartbeat",
            Duration::from_secs(30),
            || relay.logs(),
            || {
                let (client, earlier) = (&client, &earlier);
                async move {
                    let expiry = "SELECT expiry::text FROM outbox_nodes WHERE id = 'same'";
                    let now: String = client.query_one(expiry, &[]).await.unwrap().get(0);
                    (now != *earlier).then_some(())
                }
            },
        )
    };
    a_later_heartbeat().await;
    // The restore, as far as the nodes table goes.
    client
        .execute(
            "UPDATE outbox_nodes SET expiry = $1::text::timestamp WHERE id = 'same'",
            &[&earlier],
        )
        .await
        .unwrap();
    relay
        .wait_for_log(
            "the relay to recognise its own earlier heartbeat",
            Duration::from_secs(30),
            "an earlier heartbeat of this process's",
        )
        .await;
    send(&url, "k").await;
    wait_for_lines("the relay to deliver", &out, Duration::from_secs(30), |n| {
        n >= 1
    })
    .await;
    // Heartbeats go on from the earlier value.
    a_later_heartbeat().await;
    assert!(relay.is_running(), "{}", relay.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_live_process_with_the_same_node_id_is_refused() {
    let url = outbox_testkit::fresh_pg_database().await;
    migrate(&url);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("events.jsonl");
    let first = relay(dir.path(), "first", &url, "same", &out);
    registered(&url, "same", &first).await;

    let mut second = relay(dir.path(), "second", &url, "same", &out);
    let status = second.wait_exit().await;
    let logs = second.logs();
    assert_eq!(status.code(), Some(2), "a configuration error: {logs}");
    assert!(
        logs.contains("another live process is running as node same") && logs.contains("--node-id"),
        "{logs}"
    );
    // The first process is untouched and still delivers.
    assert!(first.is_running());
    send(&url, "k").await;
    wait_for_lines(
        "the first relay to deliver",
        &out,
        Duration::from_secs(30),
        |n| n == 1,
    )
    .await;
}

/// `migrate` makes the partitions table once: another count given later changed nothing
/// while `migrate` said it had migrated, and `run` split keys by the table's count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_count_the_table_contradicts_is_refused() {
    let url = outbox_testkit::fresh_pg_database().await;
    migrate(&url);
    let out = Command::new(BIN)
        .args(["migrate", "--database-url", &url, "--partitions", "16"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("partitions = 16 is set, but the partitions table holds 8")
            && err.contains("remove the setting (or set it to 8)"),
        "{err}"
    );
    let out = Command::new(BIN)
        .args(["run", "--drain", "--database-url", &url, "--http-addr", ""])
        .env("OUTBOX_RELAY_PARTITIONS", "16")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("the partitions table holds 8"), "{err}");
    // Given as the table holds it, or not at all, both run.
    migrate(&url);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarted_after_kill_9_comes_up_under_the_same_id() {
    let url = outbox_testkit::fresh_pg_database().await;
    migrate(&url);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("events.jsonl");
    let mut first = relay(dir.path(), "first", &url, "same", &out);
    registered(&url, "same", &first).await;
    first.kill9();

    // Its row outlives it until the heartbeat timeout; the restart waits that out.
    let restarted = relay(dir.path(), "restarted", &url, "same", &out);
    send(&url, "k").await;
    eventually_explained(
        "the restarted relay to deliver",
        Duration::from_secs(30),
        || restarted.logs(),
        || {
            let n = read_lines(&out).len();
            async move { (n == 1).then_some(()) }
        },
    )
    .await;
    assert!(restarted.is_running());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_id_another_process_took_stops_and_exits_2() {
    let url = outbox_testkit::fresh_pg_database().await;
    migrate(&url);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("events.jsonl");
    let mut frozen = relay(dir.path(), "frozen", &url, "same", &out);
    registered(&url, "same", &frozen).await;
    // Frozen past its expiry, the first process looks dead, and a second one takes the id.
    frozen.signal("-STOP");
    let second = relay(dir.path(), "second", &url, "same", &out);
    // The second process must have taken the row (not be waiting) before the first wakes up.
    second
        .wait_for_log(
            "the second process to register",
            Duration::from_secs(30),
            "registered in the nodes table",
        )
        .await;

    frozen.signal("-CONT");
    let status = frozen.wait_exit().await;
    let logs = frozen.logs();
    assert_eq!(status.code(), Some(2), "{logs}");
    assert!(
        logs.contains("another process is heartbeating as this node"),
        "{logs}"
    );
    // The survivor keeps its row (the displaced process did not deregister it) and delivers.
    assert!(second.is_running());
    let client = pg(&url).await;
    assert!(client
        .query_opt("SELECT 1 FROM outbox_nodes WHERE id = 'same'", &[])
        .await
        .unwrap()
        .is_some());
    send(&url, "k").await;
    wait_for_lines(
        "the second relay to deliver",
        &out,
        Duration::from_secs(30),
        |n| n >= 1,
    )
    .await;
}

const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

/// Runs a PostgreSQL tool, as the postgres user when root (initdb and pg_ctl refuse root).
fn as_pg(program: &str, args: &[&str]) {
    let program = format!("{PG_BIN}/{program}");
    let mut command = if nix_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--", &program]);
        c
    } else {
        Command::new(&program)
    };
    let out = command.args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn nix_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"))
}

/// A hot standby of a primary on `primary_port`: `pg_basebackup -R`, then `pg_ctl start` on
/// a port of its own; stopped on drop.
struct Standby {
    dir: tempfile::TempDir,
    port: u16,
}

impl Standby {
    fn start(primary_port: u16) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("standby")
            .tempdir()
            .unwrap();
        // The postgres user must reach the directory.
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o777),
        )
        .unwrap();
        let data = dir.path().join("data");
        let data = data.to_str().unwrap();
        as_pg(
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &primary_port.to_string(),
                "-U",
                "postgres",
                "-D",
                data,
                "-R",
                "-X",
                "stream",
            ],
        );
        let port = free_port();
        // These at least the primary's, or a standby refuses to start.
        let options = format!(
            "-c listen_addresses=127.0.0.1 -p {port} -k {} -c max_connections=400 \
             -c max_prepared_transactions=10 -c ssl=off",
            dir.path().display()
        );
        let log = dir.path().join("log");
        as_pg(
            "pg_ctl",
            &[
                "-D",
                data,
                "-l",
                log.to_str().unwrap(),
                "-w",
                "start",
                "-o",
                &options,
            ],
        );
        Standby { dir, port }
    }
}

impl Drop for Standby {
    fn drop(&mut self) {
        let data = self.dir.path().join("data");
        let _ = std::panic::catch_unwind(|| {
            as_pg(
                "pg_ctl",
                &[
                    "-D",
                    data.to_str().unwrap(),
                    "-m",
                    "immediate",
                    "-w",
                    "stop",
                ],
            )
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_pointed_at_a_hot_standby_refuses_to_run() {
    let primary = ScriptedServer::start("postgres", "OUTBOX_TEST_PG_PORT");
    let primary_url = format!("postgres://postgres@127.0.0.1:{}/postgres", primary.port);
    migrate(&primary_url);
    let standby = Standby::start(primary.port);
    let url = format!("postgres://postgres@127.0.0.1:{}/postgres", standby.port);
    // The standby has replayed the migration: everything but its role looks right.
    let client = pg(&url).await;
    eventually(
        "the standby to show the outbox",
        Duration::from_secs(30),
        || {
            let client = &client;
            async move {
                let row = client
                    .query_one("SELECT to_regclass('outbox') IS NOT NULL", &[])
                    .await
                    .unwrap();
                row.get::<_, bool>(0).then_some(())
            }
        },
    )
    .await;

    let check = Command::new(BIN)
        .args(["check", "--database-url", &url])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&check.stdout);
    assert!(!check.status.success(), "{text}");
    assert!(
        text.contains("hot standby") && text.contains("primary"),
        "{text}"
    );

    let run = Command::new(BIN)
        .args(["run", "--drain", "--database-url", &url, "--http-addr", ""])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("hot standby") && stderr.contains("point the database URL at the primary"),
        "{stderr}"
    );
    // The same relay against the primary runs.
    let run = Command::new(BIN)
        .args([
            "run",
            "--drain",
            "--database-url",
            &primary_url,
            "--http-addr",
            "",
        ])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
}

/// How many of this database's sessions carry `name`.
async fn sessions_named(client: &tokio_postgres::Client, name: &str) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND application_name = $1",
            &[&name],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_carry_the_node_id_in_their_application_name() {
    let url = outbox_testkit::fresh_pg_database().await;
    migrate(&url);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("events.jsonl");
    let client = pg(&url).await;
    let named = relay(dir.path(), "named", &url, "node-7", &out);
    eventually_explained(
        "the relay's sessions to carry its node id",
        Duration::from_secs(30),
        || named.logs(),
        || {
            let client = &client;
            async move { (sessions_named(client, "outbox-relay node-7").await > 0).then_some(()) }
        },
    )
    .await;
    // A URL that names its sessions keeps its name.
    let own = format!("{url}?application_name=mine");
    let custom = relay(dir.path(), "custom", &own, "node-8", &out);
    registered(&url, "node-8", &custom).await;
    assert!(sessions_named(&client, "mine").await > 0);
    assert_eq!(sessions_named(&client, "outbox-relay node-8").await, 0);
}

/// Inserts an event in a transaction that goes through two-phase commit.
async fn insert_prepared(url: &str, gid: &str) -> Result<(), tokio_postgres::Error> {
    let client = pg(url).await;
    client.batch_execute("BEGIN").await?;
    client
        .execute(
            "INSERT INTO outbox (destination, partition_key, event_type, payload)
             VALUES ('d', 'k', 't', '{}')",
            &[],
        )
        .await?;
    client
        .batch_execute(&format!("PREPARE TRANSACTION '{gid}'"))
        .await?;
    client
        .batch_execute(&format!("COMMIT PREPARED '{gid}'"))
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_phase_commit_works_against_an_outbox_migrated_with_wakeup_poll() {
    // A private server: the shared one may predate max_prepared_transactions in servers.sh.
    let server = ScriptedServer::start("postgres", "OUTBOX_TEST_PG_PORT");
    let admin = format!("postgres://postgres@127.0.0.1:{}/postgres", server.port);
    let client = pg(&admin).await;
    for db in ["notify_mode", "poll_mode"] {
        client
            .batch_execute(&format!("CREATE DATABASE {db}"))
            .await
            .unwrap();
    }
    let notify_url = outbox_testkit::with_database(&admin, "notify_mode");
    let poll_url = outbox_testkit::with_database(&admin, "poll_mode");
    migrate(&notify_url);
    let out = Command::new(BIN)
        .args(["migrate", "--database-url", &poll_url, "--wakeup", "poll"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The default trigger NOTIFYs, and PostgreSQL will not prepare such a transaction.
    let refused = insert_prepared(&notify_url, "with-notify")
        .await
        .expect_err("a NOTIFY blocks PREPARE TRANSACTION");
    let message = refused.as_db_error().map(|e| e.message().to_string());
    assert!(
        message
            .as_deref()
            .is_some_and(|m| m.contains("cannot PREPARE a transaction that has executed")),
        "{refused:?}"
    );
    insert_prepared(&poll_url, "without-notify").await.unwrap();

    // The relay in poll mode delivers the event.
    let dir = tempfile::tempdir().unwrap();
    let sink = dir.path().join("events.jsonl");
    let run = Command::new(BIN)
        .args([
            "run",
            "--drain",
            "--database-url",
            &poll_url,
            "--wakeup",
            "poll",
            "--sink",
            &format!("file:{}", sink.display()),
            "--http-addr",
            "",
        ])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(read_lines(&sink).len(), 1);
}

/// A URL naming a standby and the primary, as an HA setup's does: WAL capture's replication
/// session streams from the primary, wherever it is in the list (it dialled the first host
/// only, and a standby cannot decode).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_capture_given_a_standby_and_the_primary_streams_from_the_primary() {
    let primary = ScriptedServer::start("postgres", "OUTBOX_TEST_PG_PORT");
    let primary_url = format!("postgres://postgres@127.0.0.1:{}/postgres", primary.port);
    let dir = tempfile::tempdir().unwrap();
    migrate_with(&primary_url, &["--capture", "wal"]);
    let standby = Standby::start(primary.port);
    send(&primary_url, "k").await;
    let both = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        standby.port, primary.port
    );
    let out = dir.path().join("events.jsonl");
    let sink = format!("file:{}", out.display());
    let slot = "standby_test_slot";
    let _guard = outbox_testkit::SlotGuard {
        url: primary_url.clone(),
        slot: slot.into(),
    };
    let drain = Command::new(BIN)
        .args([
            "run",
            "--drain",
            "--capture",
            "wal",
            "--slot",
            slot,
            "--database-url",
            &both,
            "--sink",
            &sink,
            "--http-addr",
            "",
        ])
        .output()
        .unwrap();
    assert!(
        drain.status.success(),
        "{}",
        String::from_utf8_lossy(&drain.stderr)
    );
    assert_eq!(read_lines(&out).len(), 1, "the row was relayed");
}

/// A database or role that does not exist is the configuration's to fix: `check` exits 2 as
/// `run`, `stats`, `dead` and `migrate` do (it exited 1, a runtime failure); an unreachable
/// server stays a runtime failure (1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_exits_2_for_a_database_or_role_that_does_not_exist() {
    let admin = std::env::var("OUTBOX_TEST_DATABASE_URL").expect("OUTBOX_TEST_DATABASE_URL");
    let (base, _) = admin.rsplit_once('/').unwrap();
    let host = base.split_once('@').map_or(base, |(_, host)| host);
    for (url, code) in [
        (format!("{base}/outbox_no_such_database"), 2),
        (format!("postgres://outbox_no_such_role@{host}/postgres"), 2),
        ("postgres://postgres@127.0.0.1:1/postgres".to_string(), 1),
    ] {
        let (exit, said) = check_at(&url);
        assert_eq!(exit, Some(code), "{url}: {said}");
    }
}

/// A role at its connection limit (`ALTER ROLE … CONNECTION LIMIT`): the refusal was taken
/// for a server that does not answer, and the fix told to check that the database runs and
/// the URL's host. It names the limits to look at.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_at_its_connection_limit_is_told_the_limit_not_the_network() {
    let url = outbox_testkit::fresh_pg_database().await;
    let admin = pg(&url).await;
    let role = format!("limited_{}", std::process::id());
    admin
        .batch_execute(&format!(
            "DROP ROLE IF EXISTS {role}; CREATE ROLE {role} LOGIN CONNECTION LIMIT 0"
        ))
        .await
        .unwrap();
    let (_, rest) = url.split_once('@').unwrap();
    let limited = format!("postgres://{role}@{rest}");
    let (exit, said) = check_at(&limited);
    admin
        .batch_execute(&format!("DROP ROLE {role}"))
        .await
        .unwrap();
    assert_ne!(exit, Some(0), "{said}");
    assert!(
        said.contains("too many connections for role")
            && said.contains("CONNECTION LIMIT")
            && !said.contains("check that the database is running"),
        "{said}"
    );
}

/// A role that may create tables in `public` but not schemas in the database (PostgreSQL
/// 15's usual grant: CREATE on the schema): `migrate` failed, "permission denied for
/// database", for `CREATE SCHEMA IF NOT EXISTS public` asks for the database's CREATE
/// before it looks. It now makes a schema only where one is missing; for every layout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_runs_as_a_role_that_may_create_only_in_its_schema() {
    let url = outbox_testkit::fresh_pg_database().await;
    let db = pg(&url).await;
    let database = url.rsplit('/').next().unwrap().to_string();
    let role = format!("owner_{}", uuid::Uuid::new_v4().simple());
    db.batch_execute(&format!(
        "REVOKE CREATE ON DATABASE \"{database}\" FROM PUBLIC;
         CREATE ROLE {role} LOGIN;
         GRANT CREATE, USAGE ON SCHEMA public TO {role};"
    ))
    .await
    .unwrap();
    let as_owner = url.replacen("postgres@", &format!("{role}@"), 1);
    for layout in ["native", "debezium"] {
        migrate_with(&as_owner, &["--layout", layout]);
    }
    let tables: i64 = db
        .query_one(
            "SELECT count(*) FROM pg_tables WHERE tableowner = $1",
            &[&role],
        )
        .await
        .unwrap()
        .get(0);
    assert!(tables >= 3, "the owner made the tables: {tables}");
    db.batch_execute(&format!("DROP OWNED BY {role} CASCADE; DROP ROLE {role};"))
        .await
        .unwrap();
}

/// The outbox in a publication that publishes deletes (one `FOR ALL TABLES` for a replica)
/// and set to `REPLICA IDENTITY NOTHING`: PostgreSQL refuses every DELETE of it, so no
/// delivered row was deleted (under WAL capture the slot stopped being confirmed), and
/// `check` said ok. It now names the table, the publication and the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_an_outbox_whose_deletes_a_publication_refuses() {
    let url = outbox_testkit::fresh_pg_database().await;
    migrate_with(&url, &[]);
    let db = pg(&url).await;
    db.batch_execute(
        "CREATE PUBLICATION replica_feed FOR ALL TABLES;
         ALTER TABLE outbox REPLICA IDENTITY NOTHING;",
    )
    .await
    .unwrap();
    let check = || {
        Command::new(BIN)
            .args(["check", "--database-url", &url])
            .output()
            .unwrap()
    };
    let out = check();
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains("REPLICA IDENTITY NOTHING and is in publication(s) replica_feed"),
        "{said}"
    );
    assert!(said.contains("REPLICA IDENTITY DEFAULT"), "{said}");
    db.batch_execute("ALTER TABLE outbox REPLICA IDENTITY DEFAULT")
        .await
        .unwrap();
    let out = check();
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("REPLICA IDENTITY"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    db.batch_execute("DROP PUBLICATION replica_feed")
        .await
        .unwrap();
}

/// `check` against `url`: its exit code and report.
fn check_at(url: &str) -> (Option<i32>, String) {
    let out = Command::new(BIN)
        .args(["check", "--database-url", url])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    (out.status.code(), said)
}

/// The outbox's id sequence reset (`ALTER SEQUENCE … RESTART`) while rows are pending:
/// rows written next took ids below them and went out first, out of order within their
/// keys, and `check` said ok. It now fails, with the `setval` that mends it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_an_id_sequence_reset_behind_pending_rows() {
    let url = outbox_testkit::fresh_pg_database().await;
    migrate_with(&url, &[]);
    let db = pg(&url).await;
    for key in ["a", "b", "c"] {
        send(&url, key).await;
    }
    // The first delivered (its row gone), then the sequence reset: the next row takes its id.
    db.batch_execute(
        "DELETE FROM outbox WHERE sequence_id = (SELECT min(sequence_id) FROM outbox);
         ALTER SEQUENCE outbox_sequence_id_seq RESTART WITH 1;",
    )
    .await
    .unwrap();
    send(&url, "a").await;
    let (code, said) = check_at(&url);
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains("went back behind the ids of rows still"),
        "{said}"
    );
    assert!(said.contains("setval("), "{said}");
    db.batch_execute(
        "SELECT setval('outbox_sequence_id_seq', (SELECT max(sequence_id) FROM outbox))",
    )
    .await
    .unwrap();
    let (code, said) = check_at(&url);
    assert!(!said.contains("went back"), "{code:?} {said}");
}

/// Row-level security on the outbox with no policy for the relay's role: the relay saw no
/// row, and `/readyz`, the backlog and `check` all said nothing was pending. `check` now
/// names it, with the policy that lets the relay see the rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_row_security_that_hides_the_outbox_from_the_relay() {
    let url = outbox_testkit::fresh_pg_database().await;
    migrate_with(&url, &[]);
    let db = pg(&url).await;
    let role = format!("relay_{}", uuid::Uuid::new_v4().simple());
    let printed = Command::new(BIN)
        .args([
            "migrate",
            "--print",
            "--role",
            &role,
            "--database-url",
            &url,
        ])
        .output()
        .unwrap();
    db.batch_execute(&format!(
        "CREATE ROLE {role} LOGIN; {}",
        String::from_utf8_lossy(&printed.stdout)
    ))
    .await
    .unwrap();
    let app = format!("app_{}", uuid::Uuid::new_v4().simple());
    db.batch_execute(&format!(
        "CREATE ROLE {app}; ALTER TABLE outbox ENABLE ROW LEVEL SECURITY;
         CREATE POLICY app_rows ON outbox TO {app} USING (true);"
    ))
    .await
    .unwrap();
    let as_relay = url.replacen("postgres@", &format!("{role}@"), 1);
    let (code, said) = check_at(&as_relay);
    assert_eq!(code, Some(1), "{said}");
    assert!(said.contains("row-level security is on"), "{said}");
    db.batch_execute(&format!(
        "CREATE POLICY relay_rows ON outbox TO {role} USING (true)"
    ))
    .await
    .unwrap();
    let (_, said) = check_at(&as_relay);
    assert!(!said.contains("row-level security"), "{said}");
    db.batch_execute(&format!(
        "DROP OWNED BY {role} CASCADE; DROP ROLE {role}; DROP POLICY app_rows ON outbox; DROP ROLE {app};"
    ))
    .await
    .unwrap();
}

/// An ack the database refuses for a privilege the relay's grants do not cover (here an
/// audit trigger a DBA put on the outbox, writing where the relay may not): the relay
/// exited, and a supervisor's restarts published the same pending events again at each
/// start (5,829 copies of 300 in 30 s). It now retries the ack, publishing nothing twice,
/// until the cause is fixed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_refused_for_a_privilege_is_retried_without_exiting_or_publishing_again() {
    let url = outbox_testkit::fresh_pg_database().await;
    migrate_with(&url, &[]);
    let db = pg(&url).await;
    db.batch_execute(
        "CREATE FUNCTION refuse_delete() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN RAISE EXCEPTION 'permission denied for table outbox_audit'
                USING ERRCODE = 'insufficient_privilege'; END $$;
         CREATE TRIGGER audit_delete BEFORE DELETE ON outbox
           FOR EACH ROW EXECUTE FUNCTION refuse_delete();",
    )
    .await
    .unwrap();
    for key in ["a", "b", "c"] {
        send(&url, key).await;
    }
    let dir = tempfile::tempdir().unwrap();
    let sink = dir.path().join("out.jsonl");
    let mut node = relay(dir.path(), "relay", &url, "n1", &sink);
    node.wait_for_log(
        "the refused ack retried",
        Duration::from_secs(60),
        "store write failed; retrying",
    )
    .await;
    assert!(node.is_running(), "{}", node.logs());
    db.batch_execute("DROP TRIGGER audit_delete ON outbox")
        .await
        .unwrap();
    outbox_rows_become(&db, &node, 0, "the acks through once the trigger is gone").await;
    assert!(node.terminate().await.success(), "{}", node.logs());
    assert_eq!(read_lines(&sink).len(), 3, "each event published once");
}

/// A row the database refuses to delete (an application's table keeps a foreign key to its
/// outbox row): its ack failed whole and was retried whole, so every other row of the
/// batch, of every key, stayed in the table, to be published again at the next start, and
/// `/readyz` turned green whenever another settle succeeded. The batch is now acked in
/// halves down to the one row, which alone waits; `/readyz` stays red while it does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_a_foreign_key_keeps_holds_back_no_other_row_of_its_ack() {
    let url = outbox_testkit::fresh_pg_database().await;
    migrate_with(&url, &[]);
    let db = pg(&url).await;
    // One transaction: the relay's first claim takes them all, one ack batch.
    let kept = an_order_refers_to_one_of(&db, 20, 5, 8).await;
    let dir = tempfile::tempdir().unwrap();
    let sink_path = dir.path().join("out.jsonl");
    let sink = format!("file:{}", sink_path.display());
    let mut node = RelayProcess::spawn(
        dir.path(),
        "relay",
        &crate::support::run_serving(&sink, &["--database-url", &url, "--poll-interval", "100ms"]),
        &[],
    );
    let addr = crate::support::http_addr(&node).await;
    eventually_explained(
        "every row but the one kept deleted",
        Duration::from_secs(60),
        || node.logs(),
        || async {
            let left: Vec<i64> = db
                .query("SELECT sequence_id FROM outbox", &[])
                .await
                .ok()?
                .iter()
                .map(|r| r.get(0))
                .collect();
            (left == [kept]).then_some(())
        },
    )
    .await;
    let said =
        crate::support::readyz(&node, &addr, 503, "foreign key", Duration::from_secs(30)).await;
    assert!(said.contains(&format!("row {kept}")), "{said}");
    // Other keys' rows go on while it waits, and their acks leave /readyz red.
    send(&url, "other").await;
    outbox_rows_become(&db, &node, 1, "the later row acked").await;
    let (status, body) = crate::support::http_get(&addr, "/readyz").await.unwrap();
    assert_eq!(status, 503, "{body}");
    db.batch_execute("DELETE FROM orders").await.unwrap();
    crate::support::readyz(&node, &addr, 200, "", Duration::from_secs(30)).await;
    let left: i64 = db
        .query_one("SELECT count(*) FROM outbox", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0);
    assert!(node.terminate().await.success(), "{}", node.logs());
    assert_eq!(
        read_lines(&sink_path).len(),
        21,
        "each event published once"
    );
}

/// A relay polling `url` every 100 ms to a file, serving HTTP, once `/readyz` says ready:
/// its directory, the process and its HTTP address.
async fn a_ready_relay_polling(url: &str) -> (tempfile::TempDir, RelayProcess, String) {
    let dir = tempfile::tempdir().unwrap();
    let sink = format!("file:{}", dir.path().join("out.jsonl").display());
    let node = RelayProcess::spawn(
        dir.path(),
        "relay",
        &crate::support::run_serving(&sink, &["--database-url", url, "--poll-interval", "100ms"]),
        &[],
    );
    let addr = crate::support::http_addr(&node).await;
    crate::support::readyz(&node, &addr, 200, "", Duration::from_secs(30)).await;
    (dir, node, addr)
}

/// A session holding a lock the relay's claims wait for (a DBA's `LOCK TABLE`, left open):
/// `/readyz` said the database did not answer, which reads as a dead network, and the DBA
/// had to find the session alone. It now names the session holding the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_names_the_session_holding_the_lock_the_relay_waits_for() {
    let url = outbox_testkit::fresh_pg_database().await;
    migrate_with(&url, &[]);
    let (_dir, mut node, addr) = a_ready_relay_polling(&url).await;
    let locker = pg(&url).await;
    locker
        .batch_execute(
            "SET application_name = 'nightly-maintenance';
             BEGIN; LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE;",
        )
        .await
        .unwrap();
    let pid: i32 = locker
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let said = crate::support::readyz(
        &node,
        &addr,
        503,
        "nightly-maintenance",
        Duration::from_secs(60),
    )
    .await;
    assert!(said.contains(&format!("pid {pid}")), "{said}");
    locker.batch_execute("ROLLBACK").await.unwrap();
    crate::support::readyz(&node, &addr, 200, "", Duration::from_secs(60)).await;
    assert!(node.terminate().await.success(), "{}", node.logs());
}

/// A partitions table with a number missing (a row deleted by hand): the keys hashing to it
/// were owned by no node. One node relayed them all (it held every row, so every partition),
/// a second node's first hand-over stalled them for good, and `check`, `migrate` and
/// `/readyz` said all was well. Each now refuses the table, naming the number and the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitions_table_with_a_number_missing_is_refused_naming_it() {
    let url = outbox_testkit::fresh_pg_database().await;
    migrate_with(&url, &[]);
    pg(&url)
        .await
        .batch_execute("DELETE FROM outbox_partitions WHERE partition IN (7, 48)")
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let sink = format!("file:{}", dir.path().join("out.jsonl").display());
    let said = |out: &std::process::Output| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    let check = Command::new(BIN)
        .args(["check", "--database-url", &url, "--sink", &sink])
        .output()
        .unwrap();
    assert_eq!(check.status.code(), Some(1), "{}", said(&check));
    assert!(
        said(&check).contains("lacks partition(s) 7, 48"),
        "{}",
        said(&check)
    );
    assert!(said(&check).contains("VALUES (7)"), "{}", said(&check));
    let migrate = Command::new(BIN)
        .args(["migrate", "--database-url", &url])
        .output()
        .unwrap();
    assert_eq!(migrate.status.code(), Some(2), "{}", said(&migrate));
    assert!(said(&migrate).contains("lacks partition(s) 7, 48"));
    let run = Command::new(BIN)
        .args(["run", "--drain", "--database-url", &url, "--sink", &sink])
        .args(["--http-addr", ""])
        .output()
        .unwrap();
    // As for a missing table: the database is not ready.
    assert_eq!(run.status.code(), Some(1), "{}", said(&run));
    assert!(
        said(&run).contains("lacks partition(s) 7, 48"),
        "{}",
        said(&run)
    );
}

/// The same on MariaDB, where a metadata lock's holder is named only with the server's
/// `metadata_lock_info` plugin: without it, `/readyz` says which plugin names it; with it,
/// the connection holding `LOCK TABLES`. Before, the store named nobody, and its hint was
/// PostgreSQL's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_names_the_mariadb_session_holding_the_lock_the_relay_waits_for() {
    use mysql_async::prelude::Queryable;
    let url = outbox_testkit::fresh_mysql_database().await;
    migrate_with(&url, &[]);
    let mut admin = mysql_async::Conn::from_url(url.as_str()).await.unwrap();
    admin
        .query_drop("UNINSTALL PLUGIN IF EXISTS metadata_lock_info")
        .await
        .unwrap();
    let (_dir, mut node, addr) = a_ready_relay_polling(&url).await;
    // The application's own lock wait, on a table of its own, as the same user: none of the
    // relay's business. Before, `/readyz` told the operator to KILL its holder.
    admin
        .query_drop(
            "CREATE TABLE accounts (id int PRIMARY KEY, n int); INSERT INTO accounts VALUES (1, 0)",
        )
        .await
        .unwrap();
    let mut holder = mysql_async::Conn::from_url(url.as_str()).await.unwrap();
    holder
        .query_drop("BEGIN; UPDATE accounts SET n = n + 1 WHERE id = 1")
        .await
        .unwrap();
    let unrelated = holder.id();
    let waiter = tokio::spawn({
        let url = url.clone();
        async move {
            let mut waiter = mysql_async::Conn::from_url(url.as_str()).await.unwrap();
            waiter
                .query_drop("SET SESSION innodb_lock_wait_timeout = 300; UPDATE accounts SET n = n + 1 WHERE id = 1")
                .await
        }
    });
    let mut locker = mysql_async::Conn::from_url(url.as_str()).await.unwrap();
    locker.query_drop("LOCK TABLES outbox WRITE").await.unwrap();
    let id = locker.id();
    let said = crate::support::readyz(
        &node,
        &addr,
        503,
        "INSTALL SONAME 'metadata_lock_info'",
        Duration::from_secs(90),
    )
    .await;
    assert!(said.contains("KILL <id>"), "{said}");
    admin
        .query_drop("INSTALL PLUGIN IF NOT EXISTS metadata_lock_info SONAME 'metadata_lock_info'")
        .await
        .unwrap();
    let said = crate::support::readyz(
        &node,
        &addr,
        503,
        &format!("connection {id} "),
        Duration::from_secs(90),
    )
    .await;
    assert!(!said.contains("metadata_lock_info"), "{said}");
    assert!(
        !said.contains(&format!("connection {unrelated} ")),
        "{said}"
    );
    holder.query_drop("ROLLBACK").await.unwrap();
    waiter.await.unwrap().unwrap();
    locker.query_drop("UNLOCK TABLES").await.unwrap();
    crate::support::readyz(&node, &addr, 200, "", Duration::from_secs(60)).await;
    admin
        .query_drop("UNINSTALL PLUGIN IF EXISTS metadata_lock_info")
        .await
        .unwrap();
    assert!(node.terminate().await.success(), "{}", node.logs());
}

/// A drain that meets a row the database refuses to delete ends non-zero naming the row,
/// once the settles in flight are done: it returned at the refusal, dropping the other
/// batches' acks, and rows it had published stayed in the table to go out again. Rows it
/// had not claimed yet stay for the next run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_that_meets_a_row_it_cannot_delete_names_it_and_leaves_no_other_row() {
    let url = outbox_testkit::fresh_pg_database().await;
    migrate_with(&url, &[]);
    let db = pg(&url).await;
    let kept = an_order_refers_to_one_of(&db, 3000, 7, 1500).await;
    let dir = tempfile::tempdir().unwrap();
    let sink = dir.path().join("out.jsonl");
    let out = Command::new(BIN)
        .args([
            "run",
            "--drain",
            "--database-url",
            &url,
            "--batch-size",
            "50",
        ])
        .args(["--sink", &format!("file:{}", sink.display())])
        .args(["--http-addr", ""])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains(&format!("row {kept}")), "{said}");
    let left: std::collections::BTreeSet<i64> = db
        .query("SELECT sequence_id FROM outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let published: Vec<i64> = read_lines(&sink)
        .iter()
        .map(|line| line["sequence_id"].as_i64().unwrap())
        .collect();
    let unique: std::collections::BTreeSet<i64> = published.iter().copied().collect();
    assert_eq!(unique.len(), published.len(), "each event published once");
    assert!(unique.contains(&kept) && left.contains(&kept));
    let published_and_left: Vec<i64> = left.intersection(&unique).copied().collect();
    assert_eq!(
        published_and_left,
        [kept],
        "every published row deleted but the refused one"
    );
}

/// A `nodes_table` named after the outbox was migrated (each outbox on a database its own,
/// as README's many outboxes ask): `migrate` made it only in its first step, which an
/// existing schema had run, so `migrate` said "migrated" (MariaDB) or told to run `migrate`
/// (PostgreSQL), `check` passed on MariaDB, and `run` failed telling to migrate. `check`
/// names it, and `migrate` makes it as its steps would have.
#[tokio::test]
async fn a_nodes_table_named_after_the_outbox_was_migrated_is_made_by_migrate() {
    use mysql_async::prelude::Queryable;
    let check = |url: &str| {
        Command::new(BIN)
            .args([
                "check",
                "--database-url",
                url,
                "--nodes-table",
                "later_nodes",
            ])
            .output()
            .unwrap()
    };
    let pg_url = outbox_testkit::fresh_pg_database().await;
    let my_url = outbox_testkit::fresh_mysql_database().await;
    for url in [&pg_url, &my_url] {
        migrate_with(url, &["--nodes-table", "first_nodes"]);
        let out = check(url);
        let said = String::from_utf8_lossy(&out.stderr).to_string()
            + &String::from_utf8_lossy(&out.stdout);
        assert!(!out.status.success(), "{url}: {said}");
        assert!(said.contains("later_nodes"), "{url}: {said}");
        migrate_with(url, &["--nodes-table", "later_nodes"]);
        let out = check(url);
        assert!(
            out.status.success(),
            "{url}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    // Made as the steps made the first one.
    let columns = "SELECT table_name::text, column_name::text, data_type::text, is_nullable::text
                     FROM information_schema.columns
                    WHERE table_name IN ('first_nodes', 'later_nodes')
                    ORDER BY ordinal_position";
    let rows = pg(&pg_url).await.query(columns, &[]).await.unwrap();
    let of = |table: &str| -> Vec<(String, String, String)> {
        rows.iter()
            .filter(|r| r.get::<_, String>(0) == table)
            .map(|r| (r.get(1), r.get(2), r.get(3)))
            .collect()
    };
    assert_eq!(of("later_nodes"), of("first_nodes"));
    let mut conn = mysql_async::Conn::from_url(&my_url).await.unwrap();
    let shape = |table: &'static str| {
        format!(
            "SELECT column_name, column_type, is_nullable FROM information_schema.columns
              WHERE table_schema = DATABASE() AND table_name = '{table}' ORDER BY ordinal_position"
        )
    };
    let first: Vec<(String, String, String)> = conn.query(shape("first_nodes")).await.unwrap();
    let later: Vec<(String, String, String)> = conn.query(shape("later_nodes")).await.unwrap();
    assert_eq!(later, first);
    assert!(!first.is_empty());
}

/// A start that loops on a failure it takes for passing (the database read-only for the
/// relay, a connection limit): `/readyz` answered 200 "ready" while nothing was relayed. It
/// fails, naming what the start waits for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_waiting_for_the_database_fails_readyz() {
    let url = outbox_testkit::fresh_pg_database().await;
    migrate(&url);
    let database = url.rsplit('/').next().unwrap().to_string();
    let admin = pg(&url).await;
    admin
        .batch_execute(&format!(
            "ALTER DATABASE \"{database}\" SET default_transaction_read_only = on"
        ))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let sink = format!("file:{}", dir.path().join("out.jsonl").display());
    let args = crate::support::run_args(
        &url,
        &sink,
        &["--http-addr", "127.0.0.1:0", "--log-format", "json"],
    );
    let mut relay = RelayProcess::spawn(dir.path(), "relay", &args, &[]);
    let addr = crate::support::http_addr(&relay).await;
    let body = crate::support::readyz(
        &relay,
        &addr,
        503,
        "registering in the nodes table",
        Duration::from_secs(30),
    )
    .await;
    assert!(
        body.contains("read-only") || body.contains("read only"),
        "{body}"
    );
    admin
        .batch_execute(&format!(
            "ALTER DATABASE \"{database}\" RESET default_transaction_read_only"
        ))
        .await
        .unwrap();
    relay.kill9();
}
