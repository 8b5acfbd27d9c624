//! What the relay shows of what it was given: no secret of a URL or an environment value in
//! a log line, `check`, a stored `last_error`, the CLI or the API; no request sent where a
//! receiver redirects; no forged log line or raw escape sequence from untrusted text.

use crate::support;
use crate::support::admin;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox_testkit::{eventually_explained, query_count};
use tokio::io::AsyncWriteExt;

use crate::support::{http_addr, migrated_pg_database, pg, text, RelayProcess, BIN};
use admin::Admin;

/// A local HTTP endpoint that answers every request with `answer` (a whole raw response)
/// and counts the connections it accepted.
struct Receiver {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
}

impl Receiver {
    async fn start(answer: String) -> Receiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let counted = connections.clone();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                let answer = answer.clone();
                tokio::spawn(async move {
                    support::read_http_request(&mut socket).await;
                    let _ = socket.write_all(answer.as_bytes()).await;
                    let _ = socket.shutdown().await;
                });
            }
        });
        Receiver { addr, connections }
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

fn answer(status: &str, headers: &str, body: &str) -> String {
    format!(
        "HTTP/1.1 {status}\r\n{headers}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Every dead letter and event the API serves, and the status, as one text.
async fn api_text(admin: &Admin) -> String {
    let mut shown = String::new();
    for path in ["/api/v1/status", "/api/v1/dead-letters?limit=1000"] {
        let (code, body) = admin.get_text(path).await;
        assert_eq!(code, 200, "{path}: {body}");
        shown.push_str(&body);
    }
    let (_, dead) = admin.get("/api/v1/dead-letters?limit=1000").await;
    let items = dead["dead_letters"].as_array().cloned().unwrap_or_default();
    assert!(!items.is_empty(), "{dead}");
    for item in items {
        let id = &item["sequence_id"];
        let (code, body) = admin.get_text(&format!("/api/v1/events/{id}")).await;
        assert_eq!(code, 200, "event {id}: {body}");
        shown.push_str(&body);
    }
    shown
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_reaches_a_log_check_a_stored_error_the_cli_or_the_api() {
    outbox_testkit::install_crypto();
    let url = migrated_pg_database().await;
    // The test server trusts loopback: the password is carried, never checked.
    let url = url.replacen("postgres@", "postgres:PgPassw0rd-s3cr3t@", 1);
    let dir = tempfile::tempdir().unwrap();
    let busy = Receiver::start(answer("503 Service Unavailable", "", "busy")).await;
    let closed = outbox_testkit::server::free_port();
    write_sinks_with_secrets(dir.path(), &busy.addr, closed);
    check_shows_no_secret(dir.path(), &url);
    let db = pg(&url).await;
    db.batch_execute(
        "INSERT INTO outbox (destination, partition_key, event_type, payload) VALUES
         ('basic', 'k1', 't', '{}'), ('capability', 'k2', 't', '{}'), ('down', 'k3', 't', '{}')",
    )
    .await
    .unwrap();
    let args = [
        "--config",
        "relay.toml",
        "run",
        "--database-url",
        &url,
        "--http-addr",
        "127.0.0.1:0",
        "--log-format",
        "json",
        "--max-attempts",
        "1",
    ];
    let mut relay = RelayProcess::spawn(dir.path(), "relay", &args, &secret_env());
    let addr = http_addr(&relay).await;
    eventually_explained(
        "the three events dead-lettered",
        Duration::from_secs(30),
        || relay.logs(),
        || {
            let db = &db;
            async move {
                let dead = query_count(db, "SELECT count(*) FROM outbox_dead_letters", &[])
                    .await
                    .unwrap();
                (dead == 3).then_some(())
            }
        },
    )
    .await;
    stored_errors_the_api_and_dead_list_show_no_secret(&db, &addr, dir.path(), &url).await;
    assert!(relay.terminate().await.success(), "{}", relay.logs());
    let logs = relay.logs();
    assert!(logs.contains("dead-lettering"), "{logs}");
    assert_hidden("the log", &logs);
    assert!(busy.connections() >= 2);
}

const TOKEN: &str = "12345678901234567890";

/// What no output may show.
const SECRETS: [&str; 11] = [
    "PgPassw0rd-s3cr3t",
    "BasicPassw0rd-s3cr3t",
    "QueryTok3n-s3cr3t",
    "C0deLooksGenerated7x9",
    "Xk3sZ9sLack5ecretPath8",
    "D0wnS1gnature5ecretValue",
    "OtelPassw0rd-s3cr3t",
    "d2ViaG9vay1zaWduaW5nLXMzY3IzdA",
    "QmFzaWNTaW5rU2lnbmluZ0tleTE",
    "Q2FwYWJpbGl0eVNpZ25pbmdLZXky",
    TOKEN,
];

fn assert_hidden(what: &str, shown: &str) {
    for secret in SECRETS {
        assert!(!shown.contains(secret), "{secret} in {what}: {shown}");
    }
}

/// The environment of `check` and `run`: the admin token, one sink's secret, an OTLP URL
/// with a password.
fn secret_env() -> [(&'static str, &'static str); 3] {
    [
        ("OUTBOX_RELAY_ADMIN_TOKEN", TOKEN),
        // The `down` sink's: the others have their own (one shared secret is refused).
        (
            "OUTBOX_RELAY_WEBHOOK_SECRET",
            "whsec_d2ViaG9vay1zaWduaW5nLXMzY3IzdA==",
        ),
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "http://otel:OtelPassw0rd-s3cr3t@127.0.0.1:1",
        ),
    ]
}

/// Three webhook sinks, each URL and signing secret with secrets in it: `basic` and
/// `capability` answer 503, `down` is a closed port.
fn write_sinks_with_secrets(dir: &Path, busy: &impl std::fmt::Display, closed: u16) {
    let config = format!(
        r#"
[sinks.basic]
uri = "http://relay:BasicPassw0rd-s3cr3t@{busy}/in?access_token=QueryTok3n-s3cr3t&code=C0deLooksGenerated7x9&channel=orders"
secret = "whsec_QmFzaWNTaW5rU2lnbmluZ0tleTE="

[sinks.capability]
uri = "http://{busy}/services/T0AAAA/B0BBBB/Xk3sZ9sLack5ecretPath8"
secret = "whsec_Q2FwYWJpbGl0eVNpZ25pbmdLZXky"

[sinks.down]
uri = "http://127.0.0.1:{closed}/hook?sig=D0wnS1gnature5ecretValue"

[[routes]]
destinations = "basic"
sink = "basic"

[[routes]]
destinations = "capability"
sink = "capability"

[[routes]]
destinations = "down"
sink = "down"
"#,
    );
    std::fs::write(dir.join("relay.toml"), config).unwrap();
}

fn check_shows_no_secret(dir: &Path, url: &str) {
    let check = std::process::Command::new(BIN)
        .args(["--config", "relay.toml", "check", "--database-url", url])
        .current_dir(dir)
        .envs(secret_env())
        .output()
        .unwrap();
    let shown = format!("{}{}", text(&check.stdout), text(&check.stderr));
    assert!(shown.contains("configuration is valid"), "{shown}");
    assert_hidden("check", &shown);
}

async fn stored_errors_the_api_and_dead_list_show_no_secret(
    db: &tokio_postgres::Client,
    addr: &str,
    dir: &Path,
    url: &str,
) {
    let stored: Vec<String> = db
        .query("SELECT last_error FROM outbox_dead_letters", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, Option<String>>(0).unwrap_or_default())
        .collect();
    let stored = stored.join("\n");
    assert!(stored.contains("relay:***@"), "{stored}");
    assert_hidden("last_error", &stored);
    let admin = Admin::with_token(addr, Some(TOKEN));
    assert_hidden("the API", &api_text(&admin).await);
    let dead = std::process::Command::new(BIN)
        .args(["dead", "list", "--database-url", url])
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(dead.status.success(), "{}", text(&dead.stderr));
    assert_hidden(
        "dead list",
        &format!("{}{}", text(&dead.stdout), text(&dead.stderr)),
    );
}

/// A receiver's redirect is a failure naming the target's host only; the relay never
/// follows it (the second port sees no connection), and a receiver's long body is kept as
/// a short excerpt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_is_never_followed_and_a_long_body_is_cut() {
    let url = migrated_pg_database().await;
    let dir = tempfile::tempdir().unwrap();
    let internal = Receiver::start(answer("200 OK", "", "internal secrets")).await;
    let location = format!("location: http://{}/admin/export\r\n", internal.addr);
    let redirecting = Receiver::start(answer("307 Temporary Redirect", &location, "")).await;
    let chatty = Receiver::start(answer("400 Bad Request", "", &"x".repeat(5000))).await;
    let config = format!(
        r#"
[sinks.redirecting]
uri = "http://{redirecting}/in"

[sinks.chatty]
uri = "http://{chatty}/in"

[[routes]]
destinations = "redirecting"
sink = "redirecting"

[[routes]]
destinations = "chatty"
sink = "chatty"
"#,
        redirecting = redirecting.addr,
        chatty = chatty.addr,
    );
    std::fs::write(dir.path().join("relay.toml"), config).unwrap();
    let db = pg(&url).await;
    db.batch_execute(
        "INSERT INTO outbox (destination, partition_key, event_type, payload) VALUES
         ('redirecting', 'k1', 't', '{}'), ('chatty', 'k2', 't', '{}')",
    )
    .await
    .unwrap();
    let args = [
        "--config",
        "relay.toml",
        "run",
        "--database-url",
        &url,
        "--http-addr",
        "",
        "--max-attempts",
        "1",
    ];
    let mut relay = RelayProcess::spawn(dir.path(), "relay", &args, &[]);
    let stored = eventually_explained(
        "both events dead-lettered",
        Duration::from_secs(30),
        || relay.logs(),
        || {
            let db = &db;
            async move {
                let rows = db
                    .query(
                        "SELECT destination, last_error FROM outbox_dead_letters",
                        &[],
                    )
                    .await
                    .unwrap();
                (rows.len() == 2).then(|| {
                    rows.iter()
                        .map(|r| (r.get::<_, String>(0), r.get::<_, String>(1)))
                        .collect::<std::collections::BTreeMap<_, _>>()
                })
            }
        },
    )
    .await;
    assert!(relay.terminate().await.success(), "{}", relay.logs());
    assert_eq!(internal.connections(), 0, "the redirect was followed");
    let redirected = &stored["redirecting"];
    assert!(
        redirected.contains("307") && redirected.contains("127.0.0.1"),
        "{redirected}"
    );
    assert!(!redirected.contains("/admin/export"), "{redirected}");
    let cut = &stored["chatty"];
    assert!(cut.contains(&"x".repeat(200)), "{cut}");
    assert!(!cut.contains(&"x".repeat(201)), "{cut}");
}

/// A newline and an escape sequence in a destination and in a receiver's answer forge no
/// line of the default text log, and `dead list` and `stats` show them escaped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_text_forges_no_log_line_and_drives_no_terminal() {
    let url = migrated_pg_database().await;
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start(answer(
        "400 Bad Request",
        "",
        "no\nERROR forged from the body\u{1b}[2J",
    ))
    .await;
    let destination = "orders\n2026-01-01T00:00:00Z ERROR forged\u{1b}[31m";
    let db = pg(&url).await;
    db.execute(
        "INSERT INTO outbox (destination, partition_key, event_type, payload)
         VALUES ($1, 'k', 't', '{}')",
        &[&destination],
    )
    .await
    .unwrap();
    let sink = format!("http://{}/in", receiver.addr);
    let args = [
        "run",
        "--database-url",
        &url,
        "--sink",
        &sink,
        "--http-addr",
        "",
        "--max-attempts",
        "1",
    ];
    let mut relay = RelayProcess::spawn(dir.path(), "relay", &args, &[]);
    eventually_explained(
        "the event dead-lettered",
        Duration::from_secs(30),
        || relay.logs(),
        || {
            let db = &db;
            async move {
                let dead = query_count(db, "SELECT count(*) FROM outbox_dead_letters", &[])
                    .await
                    .unwrap();
                (dead == 1).then_some(())
            }
        },
    )
    .await;
    assert!(relay.terminate().await.success(), "{}", relay.logs());
    let logs = relay.logs();
    assert!(logs.contains("dead-lettering"), "{logs}");
    assert!(!logs.contains('\u{1b}'), "{logs}");
    for line in logs.lines() {
        assert!(
            line.starts_with("20") && !line.starts_with("2026-01-01"),
            "a forged line: {line:?}\n{logs}"
        );
    }
    for command in [&["dead", "list"][..], &["stats"][..]] {
        let out = std::process::Command::new(BIN)
            .args(command)
            .args(["--database-url", &url])
            .output()
            .unwrap();
        let shown = text(&out.stdout);
        assert!(out.status.success(), "{command:?}: {}", text(&out.stderr));
        assert!(!shown.contains('\u{1b}'), "{command:?}: {shown}");
        assert!(shown.contains("\\u{1b}[31m"), "{command:?}: {shown}");
        assert!(
            !shown.lines().any(|l| l.starts_with("2026-01-01")),
            "{command:?}: {shown}"
        );
    }
    // A drain that dead-letters ends on an `error:` line quoting the receiver's answer: it
    // reached the terminal raw, escape sequences and forged lines with it.
    db.execute(
        "INSERT INTO outbox (destination, partition_key, event_type, payload)
         VALUES ('orders', 'k', 't', '{}')",
        &[],
    )
    .await
    .unwrap();
    let drain = std::process::Command::new(BIN)
        .args(["run", "--drain", "--database-url", &url, "--sink", &sink])
        .args(["--http-addr", "", "--max-attempts", "1"])
        .output()
        .unwrap();
    let said = text(&drain.stderr);
    assert_eq!(drain.status.code(), Some(1), "{said}");
    assert!(said.contains("error:"), "{said}");
    assert!(!said.contains('\u{1b}'), "{said}");
    assert!(
        !said.lines().any(|l| l.starts_with("ERROR forged")),
        "a forged line: {said}"
    );
}

/// A dead-letter page for a destination nobody uses is answered from the status figures,
/// without a query of its own: with the dead-letter table locked, it still answers at once
/// (a `GROUP BY` per request would wait for the lock, and answer 503).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_destination_costs_the_database_nothing() {
    outbox_testkit::install_crypto();
    let url = migrated_pg_database().await;
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "run",
        "--database-url",
        &url,
        "--sink",
        "stdout",
        "--http-addr",
        "127.0.0.1:0",
        "--log-format",
        "json",
    ];
    let mut relay = RelayProcess::spawn(dir.path(), "relay", &args, &[]);
    let addr = http_addr(&relay).await;
    let admin = Admin::new(&addr);
    admin.status().await;
    let mut db = pg(&url).await;
    let lock = db.transaction().await.unwrap();
    lock.batch_execute("LOCK TABLE outbox_dead_letters IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    for i in 0..5 {
        let (code, body) = admin
            .get(&format!("/api/v1/dead-letters?destination=nobody-{i}"))
            .await;
        assert_eq!(code, 400, "{body}");
        assert!(body.to_string().contains("unknown destination"), "{body}");
    }
    lock.rollback().await.unwrap();
    assert!(relay.terminate().await.success(), "{}", relay.logs());
}

/// Refused tokens are counted and logged, a line per 10 s at most with the count; and
/// `check` refuses a token that `run` refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_authentications_are_counted_and_logged_sparingly() {
    outbox_testkit::install_crypto();
    let url = migrated_pg_database().await;
    let dir = tempfile::tempdir().unwrap();
    let token = "a-good-admin-token-0123456789";
    let args = [
        "run",
        "--database-url",
        &url,
        "--sink",
        "stdout",
        "--http-addr",
        "127.0.0.1:0",
        "--log-format",
        "json",
    ];
    let env = [("OUTBOX_RELAY_ADMIN_TOKEN", token)];
    let mut relay = RelayProcess::spawn(dir.path(), "relay", &args, &env);
    let addr = http_addr(&relay).await;
    let guesser = Admin::with_token(&addr, Some("a-wrong-guess-0123456789"));
    for _ in 0..30 {
        assert_eq!(guesser.get("/api/v1/status").await.0, 401);
    }
    let (_, metrics) = Admin::new(&addr).get_text("/metrics").await;
    assert_eq!(
        support::metric_value(&metrics, "outbox_admin_auth_failures_total"),
        Some(30.0),
        "{metrics}"
    );
    assert!(relay.terminate().await.success(), "{}", relay.logs());
    let logs = relay.logs();
    let lines = logs
        .lines()
        .filter(|l| l.contains("refused for a missing or wrong admin token"))
        .count();
    assert!((1..30).contains(&lines), "{lines} lines: {logs}");
    assert!(!logs.contains("a-wrong-guess"), "{logs}");

    let check = std::process::Command::new(BIN)
        .args(["check", "--database-url", &url])
        .env("OUTBOX_RELAY_ADMIN_TOKEN", "short")
        .output()
        .unwrap();
    assert_eq!(check.status.code(), Some(2), "{}", text(&check.stdout));
    assert!(text(&check.stderr).contains("at least 16 characters"));
    // A token no client can send: every request was refused, the console saying "token
    // refused".
    let check = std::process::Command::new(BIN)
        .args(["check", "--database-url", &url])
        .env("OUTBOX_RELAY_ADMIN_TOKEN", "pässwort-geheim-1234")
        .output()
        .unwrap();
    assert_eq!(check.status.code(), Some(2), "{}", text(&check.stdout));
    assert!(
        text(&check.stderr).contains("other than visible ASCII or a space"),
        "{}",
        text(&check.stderr)
    );
    // A passphrase's inner spaces go through a header, and were always taken.
    let check = std::process::Command::new(BIN)
        .args(["check", "--database-url", &url])
        .env("OUTBOX_RELAY_ADMIN_TOKEN", "correct horse battery staple")
        .output()
        .unwrap();
    assert_ne!(check.status.code(), Some(2), "{}", text(&check.stderr));
}

/// `/readyz` needs no token, and each look at readiness takes a pool connection and asks the
/// sink (a webhook receiver gets a `HEAD`; an AWS sink, a signed call against the account's
/// limits). Concurrent and repeated requests share one look a second: 50 at once used to
/// send the receiver 50 `HEAD`s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_requests_share_one_look_at_the_sink() {
    outbox_testkit::install_crypto();
    let receiver = Receiver::start(answer("200 OK", "", "")).await;
    let dir = tempfile::tempdir().unwrap();
    let sink = format!("http://{}/hook", receiver.addr);
    let args = support::run_serving(&sink, &[]);
    let mut relay = RelayProcess::spawn(dir.path(), "relay", &args, &[]);
    let addr = http_addr(&relay).await;
    support::readyz(&relay, &addr, 200, "ready", Duration::from_secs(30)).await;
    let before = receiver.connections();
    let admin = Admin::new(&addr);
    let asked = (0..50).map(|_| admin.get_text("/readyz"));
    for (code, body) in futures::future::join_all(asked).await {
        assert_eq!(code, 200, "{body}");
    }
    let looks = receiver.connections() - before;
    // One look, or two where the requests straddle the end of a look's second.
    assert!(
        looks <= 2,
        "50 requests to /readyz asked the sink {looks} times"
    );
    assert!(relay.terminate().await.success(), "{}", relay.logs());
}

/// A sink that refuses every event (a receiver answering 400) wrote one ERROR line per
/// event dead-lettered: at 5,000 events a second, 5,000 lines a second. One line per batch
/// now names the first and the count; `dead list` shows each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_refusing_everything_writes_one_error_line_per_batch() {
    let receiver = Receiver::start(answer("400 Bad Request", "", "no")).await;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let url = format!("sqlite:{}", d.join("outbox.db").display());
    let run = |args: &[&str]| support::relay(d, args);
    assert!(run(&["migrate", "--database-url", &url]).status.success());
    {
        let conn = rusqlite::Connection::open(d.join("outbox.db")).unwrap();
        for i in 0..40 {
            conn.execute(
                "INSERT INTO outbox (destination, partition_key, event_type, payload)
                 VALUES ('orders', ?1, 't', '{}')",
                [format!("k{i}")],
            )
            .unwrap();
        }
    }
    let sink = format!("http://{}/in", receiver.addr);
    let out = run(&[
        "run",
        "--drain",
        "--log-format",
        "json",
        "--http-addr",
        "",
        "--sink",
        &sink,
        "--database-url",
        &url,
    ]);
    let log = text(&out.stderr);
    let errors = log
        .lines()
        .filter(|l| l.contains("\"level\":\"ERROR\"") && l.contains("dead-letter"))
        .count();
    assert!((1..=4).contains(&errors), "{errors} error lines: {log}");
    assert!(log.contains("\"events\":"), "{log}");
    let dead = run(&["dead", "list", "--database-url", &url, "--limit", "100"]);
    assert_eq!(text(&dead.stdout).matches("orders").count(), 40);
}

/// `/readyz` needs no token, so that probes work, and its reasons quote what a sink or the
/// database said (a receiver's body may echo a payload) and name keys. With an admin token
/// set, a caller without it (or with a wrong one) learns only whether the relay is ready;
/// the token holder, and `health --ready`, which sends the configured token, read why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_tells_why_to_the_admin_token_holder_only() {
    outbox_testkit::install_crypto();
    let token = "readyz-admin-token-0123456789";
    let dir = tempfile::tempdir().unwrap();
    // Nothing listens there: the sink's look fails at once.
    let sink = format!(
        "http://127.0.0.1:{}/hook",
        outbox_testkit::server::free_port()
    );
    let args = support::run_serving(&sink, &[]);
    let env = [("OUTBOX_RELAY_ADMIN_TOKEN", token)];
    let mut relay = RelayProcess::spawn(dir.path(), "relay", &args, &env);
    let addr = http_addr(&relay).await;
    let hidden = support::readyz(&relay, &addr, 503, "not ready", Duration::from_secs(30)).await;
    assert!(
        hidden.contains("problem(s)") && !hidden.contains("webhook server"),
        "without the token: {hidden}"
    );
    let (code, wrong) = Admin::with_token(&addr, Some("not-the-token"))
        .get_text("/readyz")
        .await;
    assert!(code == 503 && !wrong.contains("webhook server"), "{wrong}");
    let (code, told) = Admin::with_token(&addr, Some(token))
        .get_text("/readyz")
        .await;
    assert!(
        code == 503 && told.contains("webhook server"),
        "with the token: {told}"
    );
    let health = std::process::Command::new(BIN)
        .args(["health", "--ready", "--http-addr", &addr])
        .env("OUTBOX_RELAY_ADMIN_TOKEN", token)
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(health.status.code(), Some(1));
    assert!(
        text(&health.stderr).contains("webhook server"),
        "{}",
        text(&health.stderr)
    );
    assert!(relay.terminate().await.success(), "{}", relay.logs());
}
