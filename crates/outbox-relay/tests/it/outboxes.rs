//! `[[outboxes]]`: several outboxes in one process, against real PostgreSQL, MariaDB, SQLite
//! and nats-server.

use std::path::Path;
use std::time::Duration;

use outbox_testkit::eventually;
use outbox_testkit::faultproxy::FaultProxy;

use crate::support;
use crate::support::webdriver;

use crate::support::{http_addr, http_get, read_lines, relay, text, RelayProcess};

/// Waits until the file sink at `path` holds at least `n` events.
async fn wait_for_lines_in(path: &Path, n: usize) {
    support::wait_for_lines(
        &format!("{n} events in {}", path.display()),
        path,
        Duration::from_secs(30),
        |have| have >= n,
    )
    .await;
}

fn send(dir: &Path, outbox: &str, destination: &str, key: &str, payload: &str) {
    let sent = relay(
        dir,
        &[
            "--outbox",
            outbox,
            "send",
            "--destination",
            destination,
            "--key",
            key,
            payload,
        ],
    );
    assert!(sent.status.success(), "{}", text(&sent.stderr));
}

/// The value of one series of `/metrics`, found by its name and labels in any order.
fn series(metrics: &str, name: &str, labels: &[&str]) -> Option<f64> {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .find(|l| labels.iter().all(|label| l.contains(label)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outboxes_on_three_databases_relay_side_by_side_each_with_its_own_label_and_console() {
    outbox_testkit::install_crypto();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let postgres = outbox_testkit::fresh_pg_database().await;
    let mariadb = outbox_testkit::fresh_mysql_database().await;
    write_three_outboxes(d, &postgres, &mariadb);
    migrate_migrates_each_under_its_name(d, &postgres).await;
    send_to_each(d);
    commands_on_one_outbox_need_its_name(d);

    let mut process = RelayProcess::spawn(d, "relay", &["run"], &[]);
    each_outbox_delivers_in_key_order(d).await;
    let addr = http_addr(&process).await;
    one_endpoint_labels_every_series_with_its_outbox(&addr).await;
    the_index_lists_them_and_each_console_is_under_its_name(&addr).await;
    the_billing_dashboard_reads_billings_api_in_a_browser(&addr).await;

    let status = process.terminate().await;
    assert!(status.success(), "{}", process.logs());
}

/// Each outbox its own database, layout, tables, sinks and routes; `batch_size` is
/// inherited from the top level, `retry` replaced whole for one outbox.
fn write_three_outboxes(d: &Path, postgres: &str, mariadb: &str) {
    let config = format!(
        r#"
http_addr = "127.0.0.1:0"
log_format = "json"
batch_size = 50

[[outboxes]]
name = "orders"
database_url = "{postgres}"
outbox_table = "orders_outbox"
nodes_table = "orders_nodes"
sink = "file:orders.jsonl"

[[outboxes]]
name = "billing"
database_url = "{mariadb}"
outbox_table = "billing_events"
retry = {{ max_attempts = 3 }}
[outboxes.sinks.ledger]
uri = "file:ledger.jsonl"
[outboxes.sinks.rest]
uri = "file:billing-rest.jsonl"
[[outboxes.routes]]
destinations = "ledger.*"
sink = "ledger"
[[outboxes.routes]]
destinations = "*"
sink = "rest"

[[outboxes]]
name = "local"
database_url = "sqlite:local.db"
sink = "file:local.jsonl"
"#
    );
    std::fs::write(d.join("outbox-relay.toml"), config).unwrap();
}

/// `migrate` without --outbox migrates each, under a heading of its name.
async fn migrate_migrates_each_under_its_name(d: &Path, postgres: &str) {
    let migrated = relay(d, &["migrate"]);
    assert!(migrated.status.success(), "{}", text(&migrated.stderr));
    let out = text(&migrated.stdout);
    for name in ["orders", "billing", "local"] {
        assert!(out.contains(&format!("-- outbox {name}")), "{out}");
    }
    // The custom table names are the ones created.
    let pg = support::pg(postgres).await;
    pg.query_one("SELECT count(*) FROM public.orders_outbox", &[])
        .await
        .unwrap();
}

fn send_to_each(d: &Path) {
    for i in 0..3 {
        send(d, "orders", "orders.created", &format!("o{i}"), "{\"n\":1}");
        send(d, "local", "local.events", "k", &format!("{{\"n\":{i}}}"));
    }
    send(d, "billing", "ledger.entries", "acct-1", "{\"cents\":100}");
    send(d, "billing", "ledger.entries", "acct-1", "{\"cents\":200}");
    send(d, "billing", "invoices", "inv-1", "{\"total\":3}");
}

/// A command that acts on one outbox needs --outbox, and says which exist.
fn commands_on_one_outbox_need_its_name(d: &Path) {
    let ambiguous = relay(d, &["dead", "list"]);
    assert_eq!(ambiguous.status.code(), Some(2));
    assert!(
        text(&ambiguous.stderr).contains("--outbox NAME (the outboxes are orders, billing, local)"),
        "{}",
        text(&ambiguous.stderr)
    );
    let unknown = relay(d, &["--outbox", "shipping", "stats"]);
    assert_eq!(unknown.status.code(), Some(2));
    assert!(
        text(&unknown.stderr)
            .contains("there is no such outbox; the outboxes are orders, billing, local"),
        "{}",
        text(&unknown.stderr)
    );
    let stats = relay(d, &["stats"]);
    assert!(stats.status.success(), "{}", text(&stats.stderr));
    let stats = text(&stats.stdout);
    assert!(stats.contains("== outbox billing =="), "{stats}");
    assert!(stats.contains("ledger.entries"), "{stats}");
}

async fn each_outbox_delivers_in_key_order(d: &Path) {
    wait_for_lines_in(&d.join("orders.jsonl"), 3).await;
    wait_for_lines_in(&d.join("local.jsonl"), 3).await;
    wait_for_lines_in(&d.join("ledger.jsonl"), 2).await;
    wait_for_lines_in(&d.join("billing-rest.jsonl"), 1).await;
    // Per-key order holds within each outbox.
    let ledger: Vec<i64> = read_lines(&d.join("ledger.jsonl"))
        .iter()
        .map(|l| l["payload"]["cents"].as_i64().unwrap())
        .collect();
    assert_eq!(ledger, [100, 200]);
}

/// One metrics endpoint; every outbox's series carry its name.
async fn one_endpoint_labels_every_series_with_its_outbox(addr: &str) {
    let ready = http_get(addr, "/readyz").await.unwrap();
    assert_eq!(ready, (200, "ready\n".to_string()));
    // One metrics endpoint; every outbox's series carry its name. (A sink's write lands
    // before the engine counts it: wait for the last count.)
    let metrics = eventually(
        "every outbox's events counted",
        Duration::from_secs(30),
        || {
            let addr = addr.to_string();
            async move {
                let metrics = http_get(&addr, "/metrics").await?.1;
                let counted = [
                    "destination=\"orders.created\",outbox=\"orders\"} 3",
                    "destination=\"local.events\",outbox=\"local\"} 3",
                    "destination=\"invoices\",outbox=\"billing\"} 1",
                    "destination=\"ledger.entries\",outbox=\"billing\"} 2",
                ]
                .iter()
                .all(|s| metrics.contains(s));
                counted.then_some(metrics)
            }
        },
    )
    .await;
    let published = |outbox: &str, destination: &str| {
        series(
            &metrics,
            "outbox_events_published_total",
            &[
                &format!("outbox=\"{outbox}\""),
                &format!("destination=\"{destination}\""),
            ],
        )
    };
    assert_eq!(
        published("orders", "orders.created"),
        Some(3.0),
        "{metrics}"
    );
    assert_eq!(published("local", "local.events"), Some(3.0), "{metrics}");
    assert_eq!(
        published("billing", "ledger.entries"),
        Some(2.0),
        "{metrics}"
    );
    assert_eq!(published("billing", "invoices"), Some(1.0), "{metrics}");
    // Scrape-time gauges are labelled too, and no engine series goes unlabelled.
    for outbox in ["orders", "billing", "local"] {
        assert!(
            series(
                &metrics,
                "outbox_health_problems",
                &[&format!("outbox=\"{outbox}\"")]
            )
            .is_some(),
            "{metrics}"
        );
    }
    let unlabelled: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("outbox_") && !l.contains("outbox=\""))
        .collect();
    assert!(unlabelled.is_empty(), "{unlabelled:?}");
}

async fn the_index_lists_them_and_each_console_is_under_its_name(addr: &str) {
    // The index lists them, and each console is under its name.
    let list: serde_json::Value =
        serde_json::from_str(&http_get(addr, "/api/v1/outboxes").await.unwrap().1).unwrap();
    let names: Vec<&str> = list["outboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["orders", "billing", "local"]);
    let (code, body) = http_get(addr, "/outboxes/billing/api/v1/status")
        .await
        .unwrap();
    assert_eq!(code, 200, "{body}");
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(
        status["outbox"]
            .as_str()
            .unwrap()
            .contains("billing_events"),
        "{status}"
    );
    let (code, page) = http_get(addr, "/outboxes/local/").await.unwrap();
    assert_eq!(code, 200);
    assert!(page.contains("<base href=\"/outboxes/local/\">"), "{page}");
    let (code, body) = http_get(addr, "/outboxes/shipping/api/v1/status")
        .await
        .unwrap();
    assert_eq!(code, 404, "{body}");
    // The bare name of an outbox redirects to its console; one no outbox has (a control
    // character in it failed the redirect with a 500) is not found.
    let (code, _) = http_get(addr, "/outboxes/local").await.unwrap();
    assert_eq!(code, 308);
    for unknown in ["/outboxes/shipping", "/outboxes/%0a"] {
        let (code, body) = http_get(addr, unknown).await.unwrap();
        assert_eq!(code, 404, "{unknown}: {body}");
        assert!(body.contains("no outbox named"), "{unknown}: {body}");
    }
}

/// In a real browser, the dashboard under /outboxes/billing/ reads billing's API: its page,
/// script and calls all resolve under that path.
async fn the_billing_dashboard_reads_billings_api_in_a_browser(addr: &str) {
    let browser = webdriver::Browser::start().await;
    browser
        .goto(&format!("http://{addr}/outboxes/billing/"))
        .await;
    let shots = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/console-screenshots");
    browser.wait_for(&shots, "#nodes tbody tr[data-node]").await;
    let identity = browser
        .execute(
            "return document.getElementById('identity').textContent;",
            serde_json::json!([]),
        )
        .await;
    assert!(
        identity.as_str().unwrap().contains("billing_events"),
        "{identity}"
    );
    let published = browser
        .execute(
            "return document.getElementById('fig-published').textContent;",
            serde_json::json!([]),
        )
        .await;
    assert_eq!(published, "3", "billing's own count, not the process's");
    browser
        .screenshot(&shots.join("outboxes-billing.png"))
        .await;
}

/// One outbox whose database does not answer, and one whose broker link is cut, hold up
/// nobody else: the third delivers everything sent to it meanwhile, `/metrics` answers, and
/// `/readyz` names the two. Once healed, they deliver what waited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_database_or_a_cut_broker_stalls_only_its_own_outbox() {
    outbox_testkit::install_crypto();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let nats_url = std::env::var("OUTBOX_TEST_NATS_URL")
        .expect("OUTBOX_TEST_NATS_URL is not set: source /tmp/servers.env");
    let (js, subject) = support::nats_stream().await;

    let hung_db = support::migrated_pg_database().await;
    let cut_db = support::migrated_pg_database().await;
    let healthy_db = support::migrated_pg_database().await;
    let (db_proxy, hung_db_via_proxy) = FaultProxy::start_for_url(&hung_db).await.unwrap();
    let (nats_proxy, nats_via_proxy) = FaultProxy::start_for_url(&nats_url).await.unwrap();
    // The hung database accepts connections and never answers, from the start.
    db_proxy.handle().blackhole();
    write_hung_cut_and_healthy(d, &hung_db_via_proxy, &cut_db, &nats_via_proxy, &healthy_db);
    events_wait_in_the_hung_outbox(&hung_db).await;

    let mut process = RelayProcess::spawn(d, "relay", &["run"], &[]);
    let addr = http_addr(&process).await;
    the_cut_outbox_delivers_once_then_loses_its_broker(d, &js, &subject, &nats_proxy).await;
    the_healthy_outbox_delivers_everything_meanwhile(d, &healthy_db, &js, &subject).await;
    readyz_names_both_stalled_outboxes_and_metrics_answer(&addr).await;
    once_healed_they_deliver_what_waited(d, &addr, &js, &subject, &db_proxy, &nats_proxy).await;

    let status = process.terminate().await;
    assert!(status.success(), "{}", process.logs());
}

/// Outboxes `hung` (its database behind a proxy), `cut` (its broker behind one) and `healthy`.
fn write_hung_cut_and_healthy(
    d: &Path,
    hung_db_via_proxy: &str,
    cut_db: &str,
    nats_via_proxy: &str,
    healthy_db: &str,
) {
    let config = format!(
        r#"
http_addr = "127.0.0.1:0"
log_format = "json"

[[outboxes]]
name = "hung"
database_url = "{hung_db_via_proxy}"
sink = "file:hung.jsonl"

[[outboxes]]
name = "cut"
database_url = "{cut_db}"
sink = "{nats_via_proxy}"

[[outboxes]]
name = "healthy"
database_url = "{healthy_db}"
sink = "file:healthy.jsonl"
"#
    );
    std::fs::write(d.join("outbox-relay.toml"), config).unwrap();
}

/// Events wait in the hung outbox before the relay starts (sent past the proxy).
async fn events_wait_in_the_hung_outbox(hung_db: &str) {
    let hung = support::pg(hung_db).await;
    for i in 0..5 {
        hung.execute(
            "INSERT INTO outbox (destination, partition_key, event_type, payload) VALUES ('h', 'k', 't', $1::text::jsonb)",
            &[&format!("{{\"n\":{i}}}")],
        )
        .await
        .unwrap();
    }
}

/// The cut outbox delivers once, then its broker link is reset and refused.
async fn the_cut_outbox_delivers_once_then_loses_its_broker(
    d: &Path,
    js: &async_nats::jetstream::Context,
    subject: &str,
    nats_proxy: &FaultProxy,
) {
    send(d, "cut", &format!("{subject}.a"), "k", "{\"n\":0}");
    eventually(
        "the first event through the broker",
        Duration::from_secs(30),
        || async { (support::stream_len(js, subject).await == 1).then_some(()) },
    )
    .await;
    nats_proxy.handle().cut_and_wait().await;
    for i in 1..4 {
        send(
            d,
            "cut",
            &format!("{subject}.a"),
            "k",
            &format!("{{\"n\":{i}}}"),
        );
    }
}

/// Meanwhile the healthy outbox delivers everything sent to it.
async fn the_healthy_outbox_delivers_everything_meanwhile(
    d: &Path,
    healthy_db: &str,
    js: &async_nats::jetstream::Context,
    subject: &str,
) {
    let pg = support::pg(healthy_db).await;
    for i in 0..200 {
        pg.execute(
            "INSERT INTO outbox (destination, partition_key, event_type, payload) VALUES ('ok', $1, 't', '{}')",
            &[&format!("k{}", i % 10)],
        )
        .await
        .unwrap();
    }
    wait_for_lines_in(&d.join("healthy.jsonl"), 200).await;
    assert_eq!(read_lines(&d.join("hung.jsonl")).len(), 0);
    assert_eq!(support::stream_len(js, subject).await, 1);
}

/// /readyz names both stalled outboxes, not the healthy one; /metrics still answers.
async fn readyz_names_both_stalled_outboxes_and_metrics_answer(addr: &str) {
    let (code, body) = eventually(
        "/readyz to name the hung and the cut outbox",
        Duration::from_secs(60),
        || {
            let addr = addr.to_string();
            async move {
                http_get(&addr, "/readyz")
                    .await
                    .filter(|(_, b)| b.contains("outbox hung:") && b.contains("outbox cut:"))
            }
        },
    )
    .await;
    assert_eq!(code, 503, "{body}");
    assert!(!body.contains("outbox healthy"), "{body}");
    eventually(
        "/metrics to count the healthy outbox's 200",
        Duration::from_secs(30),
        || {
            let addr = addr.to_string();
            async move {
                let metrics = http_get(&addr, "/metrics").await?.1;
                let healthy = ["outbox=\"healthy\""];
                (series(&metrics, "outbox_events_published_total", &healthy) == Some(200.0))
                    .then_some(())
            }
        },
    )
    .await;
}

/// Once healed, the hung and the cut outbox deliver what waited, and /readyz recovers.
async fn once_healed_they_deliver_what_waited(
    d: &Path,
    addr: &str,
    js: &async_nats::jetstream::Context,
    subject: &str,
    db_proxy: &FaultProxy,
    nats_proxy: &FaultProxy,
) {
    db_proxy.handle().heal();
    nats_proxy.handle().heal();
    wait_for_lines_in(&d.join("hung.jsonl"), 5).await;
    eventually(
        "the cut outbox's events after the heal",
        Duration::from_secs(60),
        || async { (support::stream_len(js, subject).await >= 4).then_some(()) },
    )
    .await;
    eventually("/readyz to recover", Duration::from_secs(60), || {
        let addr = addr.to_string();
        async move { http_get(&addr, "/readyz").await.filter(|(c, _)| *c == 200) }
    })
    .await;
}

#[test]
fn outbox_is_refused_where_the_configuration_has_no_outboxes() {
    let dir = tempfile::tempdir().unwrap();
    let refused = relay(dir.path(), &["--outbox", "orders", "stats"]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(
        text(&refused.stderr).contains("--outbox orders: the configuration has no [[outboxes]]"),
        "{}",
        text(&refused.stderr)
    );
    // `health` asks the process, never one outbox: --outbox there is refused, not ignored.
    let refused = relay(dir.path(), &["--outbox", "orders", "health"]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(
        text(&refused.stderr).contains("remove --outbox"),
        "{}",
        text(&refused.stderr)
    );
}

/// SIGTERM reaches an outbox still waiting for its database: the process exits 0 at once,
/// with several outboxes (where the process handles SIGTERM from the start) and with one.
/// Before, the waiting outbox never heard of it, and the process hung until SIGKILL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_an_outbox_still_waiting_for_its_database() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let database = outbox_testkit::fresh_pg_database().await;
    let (proxy, hung) = FaultProxy::start_for_url(&database).await.unwrap();
    proxy.handle().blackhole();
    std::fs::write(
        d.join("outbox-relay.toml"),
        format!(
            r#"
http_addr = "127.0.0.1:0"
log_format = "json"
[[outboxes]]
name = "hung"
database_url = "{hung}"
sink = "file:hung.jsonl"
[[outboxes]]
name = "local"
database_url = "sqlite:local.db"
sink = "file:local.jsonl"
"#
        ),
    )
    .unwrap();
    let mut several = RelayProcess::spawn(d, "several", &["run"], &[]);
    several
        .wait_for_log(
            "the local outbox to start",
            Duration::from_secs(30),
            "outbox-relay starting",
        )
        .await;
    several.signal("-TERM");
    let status = several.wait_exit_within(Duration::from_secs(30)).await;
    assert!(status.success(), "{status:?}\n{}", several.logs());

    let mut one = RelayProcess::spawn(
        d,
        "one",
        &[
            "--config",
            "/dev/null",
            "run",
            "--database-url",
            &hung,
            "--http-addr",
            "",
        ],
        &[],
    );
    one.wait_for_log(
        "the relay to wait for its database",
        Duration::from_secs(60),
        "waiting for the database",
    )
    .await;
    one.signal("-TERM");
    let status = one.wait_exit_within(Duration::from_secs(30)).await;
    assert!(status.success(), "{status:?}\n{}", one.logs());
}

/// The shared server guards like one outbox's: with the process's admin token, the index of
/// outboxes and each outbox's API answer only with it (before reading any body), while the
/// probes and pages do not need it; and only IP addresses, localhost and `allowed_hosts`
/// (here from the file) are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_server_needs_the_token_for_every_api_call_and_a_known_host() {
    outbox_testkit::install_crypto();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let token = "outboxes-test-token-0123456789";
    std::fs::write(
        d.join("outbox-relay.toml"),
        r#"
http_addr = "127.0.0.1:0"
log_format = "json"
allowed_hosts = ["relay.internal"]

[[outboxes]]
name = "orders"
database_url = "sqlite:orders.db"
sink = "file:orders.jsonl"

[[outboxes]]
name = "billing"
database_url = "sqlite:billing.db"
sink = "file:billing.jsonl"
"#,
    )
    .unwrap();
    let migrated = relay(d, &["migrate"]);
    assert!(migrated.status.success(), "{}", text(&migrated.stderr));
    let mut process =
        RelayProcess::spawn(d, "relay", &["run"], &[("OUTBOX_RELAY_ADMIN_TOKEN", token)]);
    let addr = http_addr(&process).await;
    support::readyz(&process, &addr, 200, "ready", Duration::from_secs(30)).await;
    let ask = |method: &str, path: &str, host: &str, headers: &str| {
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {host}\r\n{headers}Connection: close\r\n\r\n"
        );
        let addr = addr.clone();
        async move { support::http_exchange(&addr, &head).await }
    };
    let bearer = format!("Authorization: bearer {token}\r\n");
    let api = [
        "/api/v1/outboxes",
        "/outboxes/orders/api/v1/status",
        "/outboxes/billing/api/v1/dead-letters",
        "/outboxes/billing/api/v1/events/1",
        // Decoded on the way to the outbox: still the API.
        "/outboxes/orders/%61pi/v1/status",
    ];
    for path in api {
        let (code, body) = ask("GET", path, &addr, "").await;
        assert_eq!(code, 401, "{path}: {body}");
        let (code, body) = ask("GET", path, &addr, &bearer).await;
        assert!(code == 200 || code == 404, "{path}: {code} {body}");
    }
    let (code, list) = ask("GET", "/api/v1/outboxes", &addr, &bearer).await;
    assert_eq!(code, 200);
    assert!(list.contains("\"billing\""), "{list}");
    let big = "Content-Type: application/json\r\nContent-Length: 3000000\r\n";
    let (code, body) = ask(
        "POST",
        "/outboxes/orders/api/v1/dead-letters/retry",
        &addr,
        big,
    )
    .await;
    assert_eq!(code, 401, "{body}");
    for path in [
        "/healthz",
        "/readyz",
        "/metrics",
        "/",
        "/assets/app.css",
        "/outboxes/orders/",
        "/outboxes/orders/assets/app.js",
    ] {
        let (code, body) = ask("GET", path, &addr, "").await;
        assert_eq!(code, 200, "{path}: {body}");
        // What `/api/v1/outboxes` needs the token for (each store and its file) is not
        // shown by the open pages.
        assert!(!body.contains("billing.db"), "{path}: {body}");
    }
    let (code, body) = ask("GET", "/outboxes/nosuch/", &addr, "").await;
    assert_eq!(code, 404, "{body}");
    assert!(!body.contains("billing"), "{body}");

    for host in ["evil.example", "evil.example:80"] {
        for path in [
            "/",
            "/api/v1/outboxes",
            "/outboxes/orders/",
            "/outboxes/orders/api/v1/status",
        ] {
            let (code, body) = ask("GET", path, host, &bearer).await;
            assert_eq!(code, 421, "{host}{path}: {body}");
            assert!(body.contains("allowed_hosts"), "{body}");
        }
        assert_eq!(ask("GET", "/metrics", host, "").await.0, 200);
    }
    for host in ["relay.internal:2259", "localhost", "127.0.0.1"] {
        let (code, body) = ask("GET", "/outboxes/billing/api/v1/status", host, &bearer).await;
        assert_eq!(code, 200, "{host}: {body}");
    }
    assert!(process.terminate().await.success(), "{}", process.logs());
}

/// An outbox still starting (its database unreachable) answered its API's routes without
/// the token, if only to say that it was starting: the token is asked for first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_still_starting_asks_for_the_token_before_saying_so() {
    outbox_testkit::install_crypto();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let token = "outboxes-test-token-0123456789";
    let closed = outbox_testkit::server::free_port();
    std::fs::write(
        d.join("outbox-relay.toml"),
        format!(
            r#"
http_addr = "127.0.0.1:0"
log_format = "json"

[[outboxes]]
name = "orders"
database_url = "sqlite:orders.db"
sink = "file:orders.jsonl"

[[outboxes]]
name = "billing"
database_url = "postgres://relay@127.0.0.1:{closed}/app"
sink = "file:billing.jsonl"
"#
        ),
    )
    .unwrap();
    let mut process =
        RelayProcess::spawn(d, "relay", &["run"], &[("OUTBOX_RELAY_ADMIN_TOKEN", token)]);
    let addr = http_addr(&process).await;
    let ask = |path: &'static str, headers: String| {
        let head =
            format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}Connection: close\r\n\r\n");
        let addr = addr.clone();
        async move { support::http_exchange(&addr, &head).await }
    };
    let path = "/outboxes/billing/api/v1/status";
    let (code, body) = ask(path, String::new()).await;
    assert_eq!(code, 401, "{body}");
    let (code, body) = ask(path, format!("Authorization: Bearer {token}\r\n")).await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("outbox billing is starting"), "{body}");
    assert!(process.terminate().await.success(), "{}", process.logs());
}
