//! The operator console: the admin API (`/api/v1/`) and the dashboard (`/`) of a running
//! relay, against real PostgreSQL and NATS JetStream (and the zero-config SQLite store), and
//! the dashboard in a real headless Chromium driven through chromedriver.
//!
//! Screenshots go to `target/console-screenshots/` (not committed).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use outbox_testkit::{eventually, eventually_explained};
use serde_json::{json, Value};

use crate::support;
use crate::support::admin;
use crate::support::webdriver;

use crate::support::{
    http_addr, metric_value, migrated_pg_database, pg, relay, stream_deliveries, text, Deliveries,
    RelayProcess,
};
use admin::Admin;

const TOKEN: &str = "console-test-token-0123456789";
const PATIENCE: Duration = Duration::from_secs(30);

fn screenshots() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/console-screenshots")
}

/// An inserted event: its sequence id, event id and payload.
#[derive(Clone, Debug)]
struct Row {
    seq: i64,
    event_id: String,
    payload: Value,
}

/// A migrated PostgreSQL database, a JetStream stream for `<prefix>.ok` and none yet for
/// `<prefix>.late` (so its events are dead-lettered), with events of both inserted, and a
/// relay publishing them with the admin API on a free loopback port.
struct World {
    database_url: String,
    nats: async_nats::Client,
    js: async_nats::jetstream::Context,
    prefix: String,
    ok: Vec<Row>,
    late: Vec<Row>,
    relay: RelayProcess,
    api: Admin,
    /// Last, so that it outlives the relay: a failing test prints its log from it.
    _dir: tempfile::TempDir,
}

impl World {
    async fn start(token: Option<&str>) -> World {
        outbox_testkit::install_crypto();
        let nats_url = std::env::var("OUTBOX_TEST_NATS_URL")
            .expect("OUTBOX_TEST_NATS_URL is not set: source /tmp/servers.env");
        let nats = async_nats::connect(&nats_url).await.unwrap();
        let js = async_nats::jetstream::new(nats.clone());
        let prefix = format!(
            "console{}",
            &uuid::Uuid::new_v4().simple().to_string()[..10]
        );
        js.create_stream(async_nats::jetstream::stream::Config {
            name: format!("{}_OK", prefix.to_uppercase()),
            subjects: vec![format!("{prefix}.ok")],
            ..Default::default()
        })
        .await
        .unwrap();
        let database_url = migrated_pg_database().await;
        let client = pg(&database_url).await;
        let mut ok = Vec::new();
        for n in 1..=3 {
            ok.push(
                insert(
                    &client,
                    format!("{prefix}.ok"),
                    &format!("k{n}"),
                    "created",
                    n,
                )
                .await,
            );
        }
        let late = vec![
            insert(&client, format!("{prefix}.late"), "l1", "created", 10).await,
            insert(&client, format!("{prefix}.late"), "l2", "deleted", 11).await,
        ];
        let dir = tempfile::tempdir().unwrap();
        let args = [
            "run",
            "--database-url",
            &database_url,
            "--sink",
            &nats_url,
            "--http-addr",
            "127.0.0.1:0",
            "--log-format",
            "json",
            "--retain-delivered",
            "--max-attempts",
            "2",
            "--retry-base-delay",
            "10ms",
            "--retry-max-delay",
            "20ms",
        ];
        let env: Vec<(&str, &str)> = token
            .map(|t| vec![("OUTBOX_RELAY_ADMIN_TOKEN", t)])
            .unwrap_or_default();
        let relay = RelayProcess::spawn(dir.path(), "console-relay", &args, &env);
        let api = Admin::with_token(&http_addr(&relay).await, token);
        let world = World {
            _dir: dir,
            database_url,
            nats,
            js,
            prefix,
            ok,
            late,
            relay,
            api,
        };
        // The `.ok` events are delivered, the `.late` ones dead after two attempts.
        world
            .until("the .ok events delivered and the .late ones dead", |s| {
                s["backlog"]["dead"] == 2 && s["backlog"]["pending"] == 0
            })
            .await;
        world
    }

    fn late_destination(&self) -> String {
        format!("{}.late", self.prefix)
    }

    /// Waits until `/api/v1/status` satisfies `check`; returns that status.
    async fn until(&self, what: &str, check: impl Fn(&Value) -> bool) -> Value {
        eventually_explained(
            what,
            PATIENCE,
            || self.relay.logs(),
            || async {
                let (code, s) = self.api.get("/api/v1/status").await;
                (code == 200 && check(&s)).then_some(s)
            },
        )
        .await
    }

    /// Creates the stream the `.late` events need.
    async fn open_late_stream(&self) -> String {
        let name = format!("{}_LATE", self.prefix.to_uppercase());
        self.js
            .create_stream(async_nats::jetstream::stream::Config {
                name: name.clone(),
                subjects: vec![self.late_destination()],
                ..Default::default()
            })
            .await
            .unwrap();
        name
    }

    /// Waits until the stream holds the event with this sequence id.
    async fn wait_delivered(&self, stream: &str, seq: i64) {
        eventually_explained(
            &format!("event {seq} in stream {stream}"),
            PATIENCE,
            || self.relay.logs(),
            || async {
                stream_deliveries(&self.js, stream)
                    .await
                    .iter()
                    .any(|d| d.seq == seq)
                    .then_some(())
            },
        )
        .await
    }

    async fn close(mut self) {
        for suffix in ["OK", "LATE"] {
            let _ = self
                .js
                .delete_stream(format!("{}_{suffix}", self.prefix.to_uppercase()))
                .await;
        }
        assert!(self.relay.terminate().await.success());
        let logs = self.relay.logs();
        assert!(!logs.contains(TOKEN), "the token was logged");
    }
}

/// Inserts an event as an application does.
async fn insert(
    client: &tokio_postgres::Client,
    destination: String,
    key: &str,
    event_type: &str,
    n: i64,
) -> Row {
    let payload = json!({"order": n, "note": format!("<b>order {n}</b>")});
    let row = client
        .query_one(
            "INSERT INTO outbox (destination, partition_key, event_type, payload)
             VALUES ($1, $2, $3, $4::text::jsonb) RETURNING sequence_id, event_id::text",
            &[&destination, &key, &event_type, &payload.to_string()],
        )
        .await
        .unwrap();
    Row {
        seq: row.get(0),
        event_id: row.get(1),
        payload,
    }
}

/// A number as the page shows it.
fn as_text(v: &Value) -> Value {
    Value::String(v.to_string())
}

fn ids(page: &Value) -> Vec<i64> {
    page["dead_letters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["sequence_id"].as_i64().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_reports_and_acts_on_postgres_and_nats() {
    let w = World::start(Some(TOKEN)).await;
    status_shows_the_backlog_nodes_partitions_and_redacted_settings(&w).await;
    rates_and_history_follow_the_samples(&w).await;
    dead_letters_are_filtered_and_paged(&w).await;
    one_event_shows_its_payload_and_headers(&w).await;
    bad_input_is_a_400_or_404_with_a_message(&w).await;
    mutations_need_the_token_and_refuse_bad_input(&w).await;
    a_retried_dead_letter_reaches_the_broker_once_its_stream_exists(&w).await;
    the_other_is_purged_by_destination(&w).await;
    the_retained_events_are_replayed_to_the_broker(&w).await;
    a_replay_held_up_is_answered_while_it_goes_on(&w).await;
    every_mutation_is_logged(&w).await;
    w.close().await;
}

/// Status: backlog per destination, this node with its partitions, settings redacted.
async fn status_shows_the_backlog_nodes_partitions_and_redacted_settings(w: &World) {
    let api = &w.api;
    let late = w.late_destination();
    let s = api.status().await;
    assert_eq!(s["version"], env!("CARGO_PKG_VERSION"));
    // The commit the binary was built from (build.rs), as `--version` shows it.
    let version = text(&relay(Path::new("."), &["--version"]).stdout);
    let commit = s["commit"].as_str().unwrap();
    assert!(
        version.contains(&format!("({commit})")),
        "{version} / {commit}"
    );
    let destinations = s["destinations"].as_array().unwrap();
    let of = |d: &str| destinations.iter().find(|x| x["destination"] == d).cloned();
    let l = of(&late).expect("the .late destination");
    assert_eq!(
        (l["pending"].as_u64(), l["dead"].as_u64()),
        (Some(0), Some(2))
    );
    // Delivered and retained rows are no backlog.
    assert!(of(&format!("{}.ok", w.prefix)).is_none(), "{s}");
    let nodes = s["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 1, "{s}");
    assert_eq!(nodes[0]["this_node"], true);
    let partitions = &s["partitions"];
    assert_eq!(partitions["count"], 64);
    let owned = w
        .until("the node to hold every partition", |s| {
            s["partitions"]["unowned"]
                .as_array()
                .is_some_and(|u| u.is_empty())
        })
        .await;
    assert_eq!(
        owned["nodes"][0]["partitions"].as_array().unwrap().len(),
        64
    );
    let lease = &owned["partitions"]["leases"][0];
    assert!(lease["epoch"].as_i64().unwrap() >= 1, "{lease}");
    assert_eq!(lease["owner"], owned["node"]);
    assert_eq!(s["settings"]["admin_token"], "***");
    assert_eq!(s["admin"]["token_configured"], true);
    let (_, raw_status) = api.get_text("/api/v1/status").await;
    assert!(!raw_status.contains(TOKEN));
    assert_eq!(
        s["settings"]["database_url"],
        outbox_core::redact::redact_url(&w.database_url)
    );
}

/// Rates appear once the history has two samples.
async fn rates_and_history_follow_the_samples(w: &World) {
    let api = &w.api;
    let rated = w
        .until("publish rates", |s| {
            s["rates"]["published_per_second"].is_number()
        })
        .await;
    assert!(
        rated["totals"]["published"].as_f64().unwrap() >= 3.0,
        "{rated}"
    );
    let (code, history) = api.get("/api/v1/history").await;
    assert_eq!(code, 200);
    let samples = history["samples"].as_array().unwrap();
    assert!(samples.len() >= 2);
    let last_at = samples.last().unwrap()["at"].as_u64().unwrap();
    let (_, newer) = api.get(&format!("/api/v1/history?after={last_at}")).await;
    assert!(newer["samples"]
        .as_array()
        .unwrap()
        .iter()
        .all(|s| s["at"].as_u64().unwrap() > last_at));
}

/// Dead letters: filters and pages.
async fn dead_letters_are_filtered_and_paged(w: &World) {
    let api = &w.api;
    let late = w.late_destination();
    let path = |q: &str| format!("/api/v1/dead-letters?{q}");
    let (code, all) = api.get(&path(&format!("destination={late}"))).await;
    assert_eq!(code, 200, "{all}");
    assert_eq!(ids(&all), vec![w.late[0].seq, w.late[1].seq]);
    assert_eq!(all["dead_letters"][0]["attempts"], 2);
    assert!(all["dead_letters"][0]["last_error"]
        .as_str()
        .unwrap()
        .contains("no JetStream stream"));
    assert!(all["next_after"].is_null());
    let (_, deleted) = api.get(&path("type=deleted")).await;
    assert_eq!(ids(&deleted), vec![w.late[1].seq]);
    let (_, first) = api.get(&path("limit=1")).await;
    assert_eq!(ids(&first), vec![w.late[0].seq]);
    assert_eq!(first["next_after"], w.late[0].seq);
    let (_, second) = api
        .get(&path(&format!("limit=1&after={}", w.late[0].seq)))
        .await;
    assert_eq!(ids(&second), vec![w.late[1].seq]);
}

/// One event, with its payload and headers, whatever its `created_at` (a writer's value: one
/// before 1970 panicked the handler, and the connection was dropped unanswered).
async fn one_event_shows_its_payload_and_headers(w: &World) {
    let api = &w.api;
    pg(&w.database_url)
        .await
        .execute(
            "UPDATE outbox_dead_letters SET created_at = '1969-07-20 20:17:40+00'
             WHERE sequence_id = $1",
            &[&w.late[1].seq],
        )
        .await
        .unwrap();
    let (code, e) = api.get(&format!("/api/v1/events/{}", w.late[1].seq)).await;
    assert_eq!(code, 200, "{e}");
    assert_eq!(e["created_at"], "1969-07-20T20:17:40.000Z");
    assert_eq!(e["state"], "dead");
    assert_eq!(e["event_id"], w.late[1].event_id);
    assert_eq!(e["event_type"], "deleted");
    assert_eq!(e["ordering_key"], "l2");
    assert_eq!(e["payload"], w.late[1].payload);
    let (_, delivered) = api.get(&format!("/api/v1/events/{}", w.ok[0].seq)).await;
    assert_eq!(delivered["state"], "delivered");
}

/// Bad input is a 400 (or 404) with a message, never a panic.
async fn bad_input_is_a_400_or_404_with_a_message(w: &World) {
    let api = &w.api;
    for (path, expected) in [
        ("/api/v1/events/abc", 400),
        ("/api/v1/events/x1", 400),
        // Ids below 0 are WAL capture's table-less events': looked up, not refused.
        ("/api/v1/events/-1", 404),
        ("/api/v1/events/99999999", 404),
        ("/api/v1/dead-letters?limit=0", 400),
        ("/api/v1/dead-letters?limit=x", 400),
        ("/api/v1/dead-letters?after=3x", 400),
        ("/api/v1/dead-letters?colour=red", 400),
        ("/api/v1/dead-letters?destination=%zz", 400),
        ("/api/v1/dead-letters?destination=nowhere", 400),
        ("/api/v1/history?after=soon", 400),
        ("/api/v1/nothing", 404),
    ] {
        let (code, body) = api.get(path).await;
        assert_eq!(code, expected, "{path}: {body}");
        assert!(
            body["error"].as_str().is_some_and(|m| !m.is_empty()),
            "{path}: {body}"
        );
    }
}

/// Mutations need the token.
async fn mutations_need_the_token_and_refuse_bad_input(w: &World) {
    let api = &w.api;
    let retry = "/api/v1/dead-letters/retry";
    let one = json!({ "ids": [w.late[0].seq] }).to_string();
    let (code, body) = api.post(retry, &one, None).await;
    assert_eq!(code, 401, "{body}");
    let (code, _) = api
        .post(retry, &one, Some("console-test-token-0123456780"))
        .await;
    assert_eq!(code, 401);
    let (code, _) = api.post(retry, &one, Some("short")).await;
    assert_eq!(code, 401);
    for (body, what) in [
        ("{", "bad JSON"),
        ("[]", "not an object"),
        (r#"{"ids": []}"#, "no ids"),
        (r#"{"ids": [1], "all": true}"#, "two selectors"),
        (r#"{"destination": "nowhere"}"#, "unknown destination"),
        (r#"{"everything": true}"#, "unknown field"),
    ] {
        let (code, reply) = api.post(retry, body, Some(TOKEN)).await;
        assert_eq!(code, 400, "{what}: {reply}");
        assert!(reply["error"].is_string(), "{what}: {reply}");
    }
    // Nothing was retried by any of that.
    assert_eq!(api.status().await["backlog"]["dead"], 2);
}

/// Retry one: once its stream exists, it reaches the broker.
async fn a_retried_dead_letter_reaches_the_broker_once_its_stream_exists(w: &World) {
    let api = &w.api;
    let retry = "/api/v1/dead-letters/retry";
    let one = json!({ "ids": [w.late[0].seq] }).to_string();
    let stream = w.open_late_stream().await;
    let (code, body) = api.post(retry, &one, Some(TOKEN)).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["retried"], 1);
    assert_eq!(
        body["message"],
        "moved 1 dead letters back to the outbox; the relay publishes them again"
    );
    w.wait_delivered(&stream, w.late[0].seq).await;
    // The broker confirms before the row is marked: the state follows.
    let retried = format!("/api/v1/events/{}", w.late[0].seq);
    eventually("the retried event marked delivered", PATIENCE, || async {
        let (_, e) = api.get(&retried).await;
        (e["state"] == "delivered").then_some(())
    })
    .await;
}

/// Purge the other, by destination.
async fn the_other_is_purged_by_destination(w: &World) {
    let api = &w.api;
    let late = w.late_destination();
    let purge = "/api/v1/dead-letters/purge";
    let (code, body) = api
        .post(
            purge,
            &json!({ "destination": late }).to_string(),
            Some(TOKEN),
        )
        .await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["purged"], 1);
    let (_, empty) = api.get("/api/v1/dead-letters").await;
    assert!(ids(&empty).is_empty());
    let (code, _) = api.get(&format!("/api/v1/events/{}", w.late[1].seq)).await;
    assert_eq!(code, 404);
}

/// Replay the retained .ok events: the broker sees them again. Sixty years back reaches
/// before 1970, which the replay's log line panicked on after the events had gone out:
/// the reply was a 500, and a client that tried again sent them all once more.
async fn the_retained_events_are_replayed_to_the_broker(w: &World) {
    let api = &w.api;
    let subject = format!("{}.ok", w.prefix);
    let seen = Deliveries::record(&w.nats, &subject).await;
    let body = json!({ "since": "60y", "destination": subject }).to_string();
    let (code, _) = api.post("/api/v1/replay", &body, None).await;
    assert_eq!(code, 401);
    let (code, bad) = api
        .post("/api/v1/replay", r#"{"since": "tomorrow"}"#, Some(TOKEN))
        .await;
    assert_eq!(code, 400, "{bad}");
    let (code, reply) = api.post("/api/v1/replay", &body, Some(TOKEN)).await;
    assert_eq!(code, 200, "{reply}");
    assert_eq!(reply["replayed"], 3);
    let want: Vec<i64> = w.ok.iter().map(|r| r.seq).collect();
    eventually("the replayed events on the broker", PATIENCE, || {
        let mut got: Vec<i64> = seen.snapshot().iter().map(|d| d.seq).collect();
        got.sort();
        got.dedup();
        let done = got == want;
        async move { done.then_some(()) }
    })
    .await;
}

/// A replay longer than the request's patience is answered 202 while it goes on (the
/// request's timeout answered a body-less 408), shows its progress in the status, keeps a
/// second replay out, and is logged when it ends.
async fn a_replay_held_up_is_answered_while_it_goes_on(w: &World) {
    let api = &w.api;
    let subject = format!("{}.ok", w.prefix);
    w.until("the replayed events delivered again", |s| {
        s["backlog"]["pending"] == 0
    })
    .await;
    // Another session's lock on the rows holds the replay's update.
    let mut holder = pg(&w.database_url).await;
    let lock = holder.transaction().await.unwrap();
    let locked = lock
        .query(
            "SELECT sequence_id FROM outbox WHERE destination = $1 FOR UPDATE",
            &[&subject],
        )
        .await
        .unwrap();
    assert_eq!(locked.len(), 3);
    let body = json!({ "since": "60y", "destination": subject }).to_string();
    let (code, reply) = api.post("/api/v1/replay", &body, Some(TOKEN)).await;
    assert_eq!(code, 202, "{reply}");
    assert_eq!(reply["replaying"], 3);
    assert!(
        reply["message"]
            .as_str()
            .unwrap()
            .contains("/api/v1/status"),
        "{reply}"
    );
    let (_, status) = api.get("/api/v1/status").await;
    assert_eq!(status["replay"]["total"], 3, "{}", status["replay"]);
    let (code, second) = api.post("/api/v1/replay", &body, Some(TOKEN)).await;
    assert_eq!(code, 409, "{second}");
    lock.commit().await.unwrap();
    w.until("the replay finished", |s| s["replay"].is_null())
        .await;
    let logs = w.relay.logs();
    assert_eq!(
        logs.matches("admin API: delivered events replayed").count(),
        2,
        "both replays logged"
    );
}

/// Every mutation was logged with what it did.
async fn every_mutation_is_logged(w: &World) {
    let logs = w.relay.logs();
    for what in [
        "admin API: dead letters retried",
        "admin API: dead letters purged",
        "admin API: delivered events replayed",
    ] {
        assert!(logs.contains(what), "{what} not logged");
    }
}

/// The zero-config default: SQLite, a file sink, no token. The API reads; mutations are
/// refused with how to enable them; a non-loopback address is refused without a token.
#[tokio::test]
async fn without_a_token_the_api_is_read_only_and_stays_on_loopback() {
    outbox_testkit::install_crypto();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let refused = relay(d, &["run", "--http-addr", "0.0.0.0:0"]);
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused.stderr));
    let message = text(&refused.stderr);
    assert!(
        message.contains("not a loopback address") && message.contains("OUTBOX_RELAY_ADMIN_TOKEN"),
        "{message}"
    );

    std::fs::write(
        d.join("outbox-relay.toml"),
        r#"
retain_delivered = true
[retry]
base_delay = "10ms"
max_delay = "20ms"
max_attempts = 2
[sinks.out]
uri = "file:out.jsonl"
[[routes]]
destinations = "orders"
sink = "out"
"#,
    )
    .unwrap();
    for (destination, key) in [("orders", "a"), ("nowhere", "b")] {
        let sent = relay(
            d,
            &[
                "send",
                "--destination",
                destination,
                "--key",
                key,
                r#"{"n": 1}"#,
            ],
        );
        assert!(sent.status.success(), "{}", text(&sent.stderr));
    }
    let mut relay_process = RelayProcess::spawn(
        d,
        "sqlite-relay",
        &["run", "--http-addr", "127.0.0.1:0", "--log-format", "json"],
        &[],
    );
    let api = Admin::new(&http_addr(&relay_process).await);
    let s = eventually("the unrouted event dead", PATIENCE, || async {
        let s = api.status().await;
        (s["backlog"]["dead"] == 1 && s["backlog"]["pending"] == 0).then_some(s)
    })
    .await;
    assert!(s["partitions"].is_null(), "{s}");
    assert_eq!(s["admin"]["token_configured"], false);
    assert_eq!(s["settings"]["database_url"], "sqlite:outbox.db");
    assert_eq!(s["nodes"].as_array().unwrap().len(), 1);
    let (code, page) = api.get("/api/v1/dead-letters?destination=nowhere").await;
    assert_eq!(code, 200, "{page}");
    let id = ids(&page)[0];
    let (_, e) = api.get(&format!("/api/v1/events/{id}")).await;
    assert_eq!(
        (e["state"].as_str(), &e["payload"]),
        (Some("dead"), &json!({"n": 1}))
    );
    assert!(
        e["last_error"].as_str().unwrap().contains("no route"),
        "{e}"
    );

    for path in [
        "/api/v1/dead-letters/retry",
        "/api/v1/dead-letters/purge",
        "/api/v1/replay",
    ] {
        let (code, body) = api.post(path, r#"{"all": true}"#, Some(TOKEN)).await;
        assert_eq!(code, 403, "{path}: {body}");
        let m = body["error"].as_str().unwrap();
        assert!(
            m.contains("OUTBOX_RELAY_ADMIN_TOKEN") && m.contains("--admin-token-file"),
            "{m}"
        );
    }
    assert_eq!(api.status().await["backlog"]["dead"], 1);
    // The dashboard is served from the binary.
    let (code, html) = api.get_text("/").await;
    assert_eq!(code, 200);
    // Its links are relative to its <base>: `/` here, `/outboxes/NAME/` among outboxes.
    assert!(html.contains("<base href=\"/\">") && html.contains("src=\"assets/app.js\""));
    let (code, js) = api.get_text("/assets/app.js").await;
    assert_eq!(code, 200);
    assert!(js.contains("/api/v1/status"));
    assert!(relay_process.terminate().await.success());
}

/// The dashboard in a real browser: the figures it shows are the API's, and a dead letter
/// retried from the page reaches the broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_the_api_figures_and_retries_from_the_page() {
    let w = World::start(Some(TOKEN)).await;
    let shots = screenshots();
    let browser = webdriver::Browser::start().await;
    browser.goto(&w.api.base).await;
    the_page_asks_for_the_token_and_uses_it(&browser, &shots).await;
    the_figures_shown_equal_the_apis(&w, &browser, &shots).await;
    a_dead_letter_shows_its_payload_and_last_error(&w, &browser, &shots).await;
    the_token_typed_once_retries_from_the_page(&w, &browser, &shots).await;
    bulk_actions_are_off_while_a_type_is_filtered(&browser, &shots).await;
    every_control_takes_the_focus_and_keeps_it_through_updates(&w, &browser, &shots).await;
    drop(browser);
    w.close().await;
}

/// A table whose rows have UUID ids (here the open-outbox seed's) lists its dead letters with
/// sequence id 0, which no per-row action can choose: the page showed "0" and its View, Retry
/// and Purge answered 400. It now shows no id and greys those buttons out, saying what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_of_uuid_rows_offer_no_per_row_action() {
    outbox_testkit::install_crypto();
    let url = outbox_testkit::fresh_pg_database().await;
    let db = pg(&url).await;
    db.batch_execute(include_str!("../fixtures/seeds/open_outbox.sql"))
        .await
        .unwrap();
    db.batch_execute(
        "INSERT INTO openoutbox_events (event_id, event_type, payload, status, attempts, last_error)
              VALUES ('00000000-0000-4000-8000-000000000009', 'user.signup',
                      convert_to('x', 'UTF8'), 'DEAD', 2, 'no route')",
    )
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut relay_process = pg_relay_with(
        dir.path(),
        "uuid-rows",
        &url,
        &["--layout", "open-outbox"],
        &[("OUTBOX_RELAY_ADMIN_TOKEN", TOKEN)],
    );
    let api = Admin::with_token(&http_addr(&relay_process).await, Some(TOKEN));
    let shots = screenshots();
    let browser = webdriver::Browser::start().await;
    browser.goto(&api.base).await;
    the_page_asks_for_the_token_and_uses_it(&browser, &shots).await;
    browser
        .wait_for(&shots, "#dead-letters tbody tr[data-id]")
        .await;
    let row = browser
        .execute(
            "const tr = document.querySelector('#dead-letters tbody tr[data-id]'); \
             const buttons = [...tr.querySelectorAll('button')]; \
             return [tr.cells[0].textContent, buttons.map((b) => b.disabled), buttons[1].title];",
            json!([]),
        )
        .await;
    assert_eq!(row[0], "–", "{row}");
    assert_eq!(row[1], json!([true, true, true]), "{row}");
    assert!(row[2].as_str().unwrap().contains("UUID ids"), "{row}");
    drop(browser);
    assert!(relay_process.terminate().await.success());
}

/// What the dashboard shows: its figures, rows, nodes, dead letters, partitions and charts.
const SHOWN_SCRIPT: &str = r#"
        const text = (id) => document.getElementById(id).textContent;
        const rows = [...document.querySelectorAll('#destinations tbody tr[data-destination]')]
            .map((tr) => [...tr.cells].map((c) => c.textContent));
        const nodes = [...document.querySelectorAll('#nodes tbody tr[data-node]')]
            .map((tr) => tr.dataset.node);
        const dead = [...document.querySelectorAll('#dead-letters tbody tr[data-id]')]
            .map((tr) => Number(tr.dataset.id));
        return { pending: text('fig-pending'), retrying: text('fig-retrying'),
                 dead: text('fig-dead'), published: text('fig-published'), rows, nodes, dead_ids: dead,
                 partitions: document.querySelectorAll('#partitions span').length,
                 unowned: document.querySelectorAll('#partitions span.unowned').length,
                 chart_paths: document.querySelectorAll('#chart-backlog path').length };
"#;

/// The button that views the second `.late` dead letter.
fn view_button(w: &World) -> String {
    format!(
        "#dead-letters tr[data-id='{}'] button[data-action='view']",
        w.late[1].seq
    )
}

/// The API answers nothing without the token: the page asks for it, and uses it once typed.
async fn the_page_asks_for_the_token_and_uses_it(browser: &webdriver::Browser, shots: &Path) {
    let asked = "return [document.getElementById('token-state').textContent, \
                 document.activeElement.id];";
    eventually("the page to ask for the token", PATIENCE, || async {
        let asked = browser.execute(asked, json!([])).await;
        (asked == json!(["token needed", "token"])).then_some(())
    })
    .await;
    let field = browser.wait_for(shots, "#token").await;
    browser.type_into(&field, TOKEN).await;
    browser.click(shots, "#token-save").await;
    browser
        .wait_for(shots, "#destinations tbody tr[data-destination]")
        .await;
}

/// The figures shown equal the API's (nothing changes meanwhile: the backlog is settled).
async fn the_figures_shown_equal_the_apis(w: &World, browser: &webdriver::Browser, shots: &Path) {
    let s = w
        .until("a settled status with rates", |s| {
            s["rates"]["published_per_second"].is_number()
                && s["partitions"]["unowned"]
                    .as_array()
                    .is_some_and(|u| u.is_empty())
        })
        .await;
    let expected_rows: Vec<Value> = s["destinations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            json!([
                d["destination"],
                d["pending"].to_string(),
                d["retrying"].to_string(),
                d["dead"].to_string()
            ])
        })
        .collect();
    let shown = eventually("the page to show the API's figures", PATIENCE, || async {
        let shown = browser.execute(SHOWN_SCRIPT, json!([])).await;
        let rows: Vec<Value> = shown["rows"]
            .as_array()?
            .iter()
            .map(|r| Value::Array(r.as_array().unwrap()[..4].to_vec()))
            .collect();
        let same = shown["pending"] == as_text(&s["backlog"]["pending"])
            && shown["retrying"] == as_text(&s["backlog"]["retrying"])
            && shown["dead"] == as_text(&s["backlog"]["dead"])
            && rows == expected_rows
            && shown["unowned"] == 0
            && shown["chart_paths"].as_u64() >= Some(3);
        same.then_some(shown)
    })
    .await;
    assert_eq!(shown["nodes"], json!([s["node"]]));
    assert_eq!(shown["partitions"], 64);
    assert_eq!(shown["dead_ids"], json!([w.late[0].seq, w.late[1].seq]));
    browser.screenshot(&shots.join("1-overview.png")).await;
}

/// View a dead letter: its payload and last error.
async fn a_dead_letter_shows_its_payload_and_last_error(
    w: &World,
    browser: &webdriver::Browser,
    shots: &Path,
) {
    let view_css = view_button(w);
    browser.click(shots, &view_css).await;
    let detail = eventually("the event's detail", PATIENCE, || async {
        let d = browser
            .execute(
                "const p = document.getElementById('detail-payload'); \
                 const e = document.getElementById('detail-error'); \
                 return p && e ? [p.textContent, e.textContent] : null;",
                json!([]),
            )
            .await;
        d.as_array().cloned()
    })
    .await;
    let payload: Value = serde_json::from_str(detail[0].as_str().unwrap()).unwrap();
    assert_eq!(payload, w.late[1].payload);
    assert!(detail[1].as_str().unwrap().contains("no JetStream stream"));
    browser.screenshot(&shots.join("2-dead-letter.png")).await;
}

/// "Retry/Purge all shown" select by destination only: with a type typed into the filter
/// they acted on every type, and a purge deleted every dead letter. They are off while a
/// type is filtered.
async fn bulk_actions_are_off_while_a_type_is_filtered(browser: &webdriver::Browser, shots: &Path) {
    let state = "return ['dead-retry-all', 'dead-purge-all']\
                 .map((id) => document.getElementById(id).disabled);";
    assert_eq!(
        browser.execute(state, json!([])).await,
        json!([false, false])
    );
    let field = browser.wait_for(shots, "#dead-type").await;
    browser.type_into(&field, "order.created").await;
    assert_eq!(browser.execute(state, json!([])).await, json!([true, true]));
    browser
        .execute(
            "const f = document.getElementById('dead-type'); f.value = ''; \
             f.dispatchEvent(new Event('input'));",
            json!([]),
        )
        .await;
    assert_eq!(
        browser.execute(state, json!([])).await,
        json!([false, false])
    );
}

/// The token typed once is used for changes too.
async fn the_token_typed_once_retries_from_the_page(
    w: &World,
    browser: &webdriver::Browser,
    shots: &Path,
) {
    let stream = w.open_late_stream().await;
    let retry_css = format!(
        "#dead-letters tr[data-id='{}'] button[data-action='retry']",
        w.late[0].seq
    );
    let message = "return document.getElementById('message').textContent;";
    browser.click(shots, &retry_css).await;
    eventually("the page to report the retry", PATIENCE, || async {
        let m = browser.execute(message, json!([])).await;
        m.as_str()?.contains("moved 1 dead letters").then_some(())
    })
    .await;
    w.wait_delivered(&stream, w.late[0].seq).await;
    // The page follows without a reload.
    eventually(
        "the page to show the retried event delivered",
        PATIENCE,
        || async {
            let shown = browser.execute(SHOWN_SCRIPT, json!([])).await;
            (shown["dead"] == "1"
                && shown["pending"] == "0"
                && shown["dead_ids"] == json!([w.late[1].seq]))
            .then_some(())
        },
    )
    .await;
    let stored = browser
        .execute(
            "return sessionStorage.getItem('outbox-relay-admin-token');",
            json!([]),
        )
        .await;
    assert_eq!(stored, TOKEN);
}

/// Usable without a mouse: every control takes the focus.
async fn every_control_takes_the_focus_and_keeps_it_through_updates(
    w: &World,
    browser: &webdriver::Browser,
    shots: &Path,
) {
    let view_css = view_button(w);
    let unfocusable = browser
        .execute(
            "return [...document.querySelectorAll('button, input, select')] \
               .filter((e) => { e.focus(); return document.activeElement !== e && !e.disabled; }) \
               .map((e) => e.id || e.textContent);",
            json!([]),
        )
        .await;
    assert_eq!(unfocusable, json!([]));
    // A focused button keeps the focus while the page updates around it.
    let before = browser
        .execute(
            "document.querySelector(arguments[0]).focus(); return document.body.dataset.updated;",
            json!([view_css]),
        )
        .await;
    let focused = eventually("the page's next update", PATIENCE, || async {
        let now = browser
            .execute(
                "return [document.body.dataset.updated,                          document.activeElement.matches(arguments[0])];",
                json!([view_css]),
            )
            .await;
        (now[0] != before).then(|| now[1].clone())
    })
    .await;
    assert_eq!(focused, true, "the focus was lost by an update");
    browser.screenshot(&shots.join("3-after-retry.png")).await;
}

/// The console's counters: (store reads behind `/api/v1/status`, status requests).
async fn console_counters(api: &Admin) -> (u64, u64) {
    let (code, metrics) = api.get_text("/metrics").await;
    assert_eq!(code, 200);
    let value = |name: &str| {
        metric_value(&metrics, name).unwrap_or_else(|| panic!("no {name} in /metrics"))
    };
    (
        value("outbox_console_store_reads_total") as u64,
        value("outbox_console_status_requests_total") as u64,
    )
}

/// `outbox-relay run` on the PostgreSQL database `database_url`, to a file sink, its HTTP
/// server on a free loopback port, logging JSON, with `env` set.
fn pg_relay(dir: &Path, name: &str, database_url: &str, env: &[(&str, &str)]) -> RelayProcess {
    pg_relay_with(dir, name, database_url, &[], env)
}

/// [`pg_relay`] with `extra` arguments after `run`'s own.
fn pg_relay_with(
    dir: &Path,
    name: &str,
    database_url: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> RelayProcess {
    let mut args = vec![
        "run",
        "--database-url",
        database_url,
        "--sink",
        "file:out.jsonl",
        "--http-addr",
        "127.0.0.1:0",
        "--log-format",
        "json",
    ];
    args.extend_from_slice(extra);
    RelayProcess::spawn(dir, name, &args, env)
}

/// However many clients poll `/api/v1/status`, the relay reads the store at most once per
/// interval: requests that arrive while a read is under way wait for it and share its
/// result, and a change shows up once the interval has passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_status_requests_share_one_store_read() {
    outbox_testkit::install_crypto();
    let database_url = migrated_pg_database().await;
    let dir = tempfile::tempdir().unwrap();
    let mut relay_process = pg_relay(dir.path(), "figures-relay", &database_url, &[]);
    let api = Arc::new(Admin::new(&http_addr(&relay_process).await));
    let first = api.status().await;
    let first_as_of = first["backlog"]["as_of"]
        .as_str()
        .unwrap_or_else(|| panic!("no backlog.as_of in {first}"))
        .to_string();
    assert_eq!(first["backlog"]["refresh_seconds"], 5.0, "{first}");
    let (reads, requests) = console_counters(&api).await;
    let ask = || {
        let api = api.clone();
        tokio::spawn(async move { api.get("/api/v1/status").await })
    };

    // Every read of the backlog counts the dead letters: hold them until released.
    let blocker = pg(&database_url).await;
    blocker
        .batch_execute("BEGIN; LOCK TABLE outbox_dead_letters IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    // Ask until the figures are due again and a request has begun the next read.
    let mut waiting = Vec::new();
    eventually("a store read under way", PATIENCE, || {
        waiting.push(ask());
        let api = api.clone();
        async move { (console_counters(&api).await.0 == reads + 1).then_some(()) }
    })
    .await;
    // A burst of requests while that read waits: all reach the relay, none reads again.
    let burst: Vec<_> = (0..16).map(|_| ask()).collect();
    let asked = requests + (waiting.len() + burst.len()) as u64;
    eventually("every request at the relay", PATIENCE, || async {
        (console_counters(&api).await.1 >= asked).then_some(())
    })
    .await;
    assert_eq!(
        console_counters(&api).await.0,
        reads + 1,
        "requests that arrived during a read began reads of their own"
    );
    blocker.batch_execute("COMMIT").await.unwrap();

    let mut shared = BTreeSet::new();
    for request in burst {
        let (code, s) = request.await.unwrap();
        assert_eq!(code, 200, "{s}");
        shared.insert(s["backlog"]["as_of"].as_str().unwrap().to_string());
    }
    assert_eq!(shared.len(), 1, "the burst saw different reads: {shared:?}");
    let shared = shared.pop_first().unwrap();
    assert_ne!(shared, first_as_of);
    for request in waiting {
        let (code, s) = request.await.unwrap();
        assert_eq!(code, 200, "{s}");
        let as_of = s["backlog"]["as_of"].as_str().unwrap();
        assert!(as_of == first_as_of || as_of == shared, "{as_of}");
    }
    assert_eq!(console_counters(&api).await.0, reads + 1);

    // A new event shows once the figures are read again.
    blocker
        .execute(
            "INSERT INTO outbox (destination, event_type, payload, available_at)
             VALUES ('later', 'scheduled', '{}', now() + interval '1 hour')",
            &[],
        )
        .await
        .unwrap();
    let fresh = eventually("the scheduled event in the status", PATIENCE, || async {
        let s = api.status().await;
        (s["backlog"]["pending"] == 1).then_some(s)
    })
    .await;
    assert_ne!(fresh["backlog"]["as_of"], shared.as_str());
    assert_eq!(fresh["destinations"][0]["destination"], "later");
    assert!(relay_process.terminate().await.success());
}

/// A destination per customer: `/api/v1/status` listed every one (30 MB at 300,000, read
/// every 2 s by each dashboard, whose page then failed to draw). It lists the 500 holding
/// the most events, and sums the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_lists_the_busiest_destinations_and_sums_the_others() {
    outbox_testkit::install_crypto();
    let database_url = migrated_pg_database().await;
    // Scheduled an hour ahead, so that the relay leaves them pending: 600 destinations of
    // one event each, and one of three.
    pg(&database_url)
        .await
        .batch_execute(
            "INSERT INTO outbox (destination, event_type, payload, available_at)
             SELECT 'customer-' || i, 't', '{}', now() + interval '1 hour'
               FROM generate_series(1, 600) i;
             INSERT INTO outbox (destination, event_type, payload, available_at)
             SELECT 'busy', 't', '{}', now() + interval '1 hour' FROM generate_series(1, 3)",
        )
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut relay_process = pg_relay(dir.path(), "busiest-relay", &database_url, &[]);
    let api = Admin::new(&http_addr(&relay_process).await);
    let s = eventually("the backlog in the status", PATIENCE, || async {
        let s = api.status().await;
        (s["backlog"]["pending"] == 603).then_some(s)
    })
    .await;
    let listed = s["destinations"].as_array().unwrap();
    assert_eq!(listed.len(), 500);
    assert!(
        listed
            .iter()
            .any(|d| d["destination"] == "busy" && d["pending"] == 3),
        "the busiest destination is listed"
    );
    let left_out = &s["destinations_left_out"];
    assert_eq!(left_out["destinations"], 101, "{left_out}");
    assert_eq!(left_out["pending"], 101, "{left_out}");
    assert!(relay_process.terminate().await.success());
}

/// A purge the database answers only after the request's patience: the request was told
/// the database did not answer, the purge then went through all the same, and nothing
/// logged it. The request is now told the change may still complete, and the log says
/// when it does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_slower_than_the_request_is_said_to_go_on_and_logged_when_done() {
    outbox_testkit::install_crypto();
    let database_url = migrated_pg_database().await;
    let blocker = pg(&database_url).await;
    blocker
        .batch_execute(
            "INSERT INTO outbox_dead_letters (sequence_id, event_id, destination, event_type,
                                              created_at, attempts, last_error, dead_at)
             VALUES (1, gen_random_uuid(), 'orders', 't', now(), 1, 'refused', now())",
        )
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut relay_process = pg_relay(
        dir.path(),
        "slow-purge-relay",
        &database_url,
        &[("OUTBOX_RELAY_ADMIN_TOKEN", TOKEN)],
    );
    let api = Admin::with_token(&http_addr(&relay_process).await, Some(TOKEN));
    blocker
        .batch_execute("BEGIN; LOCK TABLE outbox_dead_letters IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let (code, body) = api
        .post("/api/v1/dead-letters/purge", r#"{"ids": [1]}"#, Some(TOKEN))
        .await;
    assert_eq!(code, 503, "{body}");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("may still complete")),
        "{body}"
    );
    blocker.batch_execute("COMMIT").await.unwrap();
    relay_process
        .wait_for_log(
            "the purge logged",
            PATIENCE,
            "admin API: dead letters purged",
        )
        .await;
    let left: i64 = blocker
        .query_one("SELECT count(*) FROM outbox_dead_letters", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0);
    assert!(relay_process.terminate().await.success());
}

// ---- The operator surface, safe to expose ----

/// A zero-config relay (SQLite, stdout) holding one event, its HTTP server on a free
/// loopback port, with the admin token and `args` added.
async fn relay_with_token(dir: &Path, args: &[&str]) -> (RelayProcess, String) {
    outbox_testkit::install_crypto();
    let sent = relay(dir, &["send", "--destination", "orders", r#"{"n": 1}"#]);
    assert!(sent.status.success(), "{}", text(&sent.stderr));
    let mut all = vec![
        "run",
        "--http-addr",
        "127.0.0.1:0",
        "--log-format",
        "json",
        "--retain-delivered",
    ];
    all.extend_from_slice(args);
    let process = RelayProcess::spawn(
        dir,
        "token-relay",
        &all,
        &[("OUTBOX_RELAY_ADMIN_TOKEN", TOKEN)],
    );
    let addr = http_addr(&process).await;
    (process, addr)
}

/// A request of `method` for `path` with a `Host` and more header lines, that closes.
fn request(method: &str, path: &str, host: &str, headers: &str) -> String {
    format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\n{headers}Connection: close\r\n\r\n")
}

/// With a token configured, every API call needs it (reads show payloads); the probes and
/// the dashboard's files do not.
#[tokio::test]
async fn with_a_token_every_api_call_needs_it_but_not_the_probes_or_the_page() {
    let dir = tempfile::tempdir().unwrap();
    let (mut process, addr) = relay_with_token(dir.path(), &[]).await;
    let api = Admin::new(&addr);
    let with_token = format!("Bearer {TOKEN}");
    for path in [
        "/api/v1/status",
        "/api/v1/history",
        "/api/v1/dead-letters",
        "/api/v1/events/1",
        "/api/v1/nothing",
    ] {
        for refused in [
            None,
            Some("Bearer console-test-token-0123456780"),
            Some(TOKEN),
        ] {
            let (code, body) = api.get_authorized(path, refused).await;
            assert_eq!(code, 401, "{path} with {refused:?}: {body}");
            let m = body["error"].as_str().unwrap_or_default();
            assert!(m.contains("Authorization: Bearer"), "{path}: {m}");
        }
        let (code, body) = api.get_authorized(path, Some(&with_token)).await;
        assert_ne!(code, 401, "{path}: {body}");
    }
    let (code, e) = api
        .get_authorized("/api/v1/events/1", Some(&with_token))
        .await;
    assert_eq!((code, &e["payload"]), (200, &json!({"n": 1})), "{e}");
    let (code, body) = api
        .post("/api/v1/dead-letters/retry", r#"{"all": true}"#, None)
        .await;
    assert_eq!(code, 401, "{body}");
    support::readyz(&process, &addr, 200, "ready", PATIENCE).await;
    for path in [
        "/healthz",
        "/metrics",
        "/",
        "/assets/app.js",
        "/assets/app.css",
    ] {
        let (code, body) = api.get_text(path).await;
        assert_eq!(code, 200, "{path}: {body}");
    }
    assert!(process.terminate().await.success());
}

/// `Authorization: bearer ...` is `Bearer`: the scheme's case does not matter (RFC 6750).
#[tokio::test]
async fn the_bearer_scheme_is_matched_in_any_case() {
    let dir = tempfile::tempdir().unwrap();
    let (mut process, addr) = relay_with_token(dir.path(), &[]).await;
    let api = Admin::new(&addr);
    for scheme in ["bearer", "BEARER", "beaRer"] {
        let (code, body) = api
            .get_authorized("/api/v1/history", Some(&format!("{scheme} {TOKEN}")))
            .await;
        assert_eq!(code, 200, "{scheme}: {body}");
    }
    assert!(process.terminate().await.success());
}

/// The token is checked before any body is read: a 3 MB POST without it is refused as such
/// (401), not for its size; with it, a body announced over 64 KiB is refused unread.
#[tokio::test]
async fn a_refused_request_is_answered_before_its_body_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let (mut process, addr) = relay_with_token(dir.path(), &[]).await;
    let retry = "/api/v1/dead-letters/retry";
    // Only the head is sent: a server that waited for the body would not answer.
    let big = "Content-Type: application/json\r\nContent-Length: 3000000\r\n";
    for authorization in [
        "",
        "Authorization: Bearer console-test-token-0123456780\r\n",
    ] {
        let head = request("POST", retry, &addr, &format!("{authorization}{big}"));
        let (code, body) = support::http_exchange(&addr, &head).await;
        assert_eq!(code, 401, "{authorization:?}: {body}");
    }
    let authorized = format!("Authorization: Bearer {TOKEN}\r\n");
    let head = request("POST", retry, &addr, &format!("{authorized}{big}"));
    let (code, body) = support::http_exchange(&addr, &head).await;
    assert_eq!(code, 413, "{body}");
    assert!(body.contains("64 KiB"), "{body}");
    // One that does not say its length (chunked) is stopped while read, and answered the
    // same way: it was the body reader's bare "length limit exceeded".
    let chunk = format!(r#"{{"ids": [{}1]}}"#, "1, ".repeat(24_000));
    let chunked = format!(
        "{}{:x}\r\n{chunk}\r\n0\r\n\r\n",
        request(
            "POST",
            retry,
            &addr,
            &format!(
                "{authorized}Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
            )
        ),
        chunk.len()
    );
    let (code, body) = support::http_exchange(&addr, &chunked).await;
    assert_eq!(code, 413, "{body}");
    assert!(body.contains("64 KiB"), "{body}");
    let post = |json: &'static str| {
        let head = request(
            "POST",
            retry,
            &addr,
            &format!(
                "{authorized}Content-Type: application/json\r\nContent-Length: {}\r\n",
                json.len()
            ),
        );
        let addr = addr.clone();
        async move { support::http_exchange(&addr, &format!("{head}{json}")).await }
    };
    // Ids are sequence ids: a negative one is named.
    let (code, body) = post(r#"{"ids": [-1]}"#).await;
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("-1 is none"), "{body}");
    // A small one is read.
    let (code, body) = post(r#"{"all": true}"#).await;
    assert_eq!(code, 200, "{body}");
    assert!(process.terminate().await.success());
}

/// Every response, the page's and the API's, refusals and probes included, tells browsers not
/// to sniff types, frame the page, send referrers, or load anything from elsewhere.
#[tokio::test]
async fn every_response_carries_the_browser_hardening_headers() {
    let dir = tempfile::tempdir().unwrap();
    let (mut process, addr) = relay_with_token(dir.path(), &[]).await;
    let authorized = format!("Authorization: Bearer {TOKEN}\r\n");
    let asks = [
        ("/", addr.as_str(), "", 200),
        ("/assets/app.js", addr.as_str(), "", 200),
        ("/api/v1/status", addr.as_str(), authorized.as_str(), 200),
        ("/api/v1/status", addr.as_str(), "", 401),
        ("/api/v1/nothing", addr.as_str(), authorized.as_str(), 404),
        ("/", "evil.example", "", 421),
        ("/healthz", addr.as_str(), "", 200),
        ("/metrics", addr.as_str(), "", 200),
    ];
    for (path, host, headers, status) in asks {
        let reply = support::http_response(&addr, &request("GET", path, host, headers)).await;
        let head = reply.split("\r\n\r\n").next().unwrap().to_ascii_lowercase();
        assert!(
            head.starts_with(&format!("http/1.1 {status}")),
            "{path}: {head}"
        );
        for line in [
            "x-content-type-options: nosniff",
            "x-frame-options: deny",
            "referrer-policy: no-referrer",
            "content-security-policy: default-src 'self'; base-uri 'self'; \
             form-action 'self'; frame-ancestors 'none'",
        ] {
            assert!(
                head.contains(&format!("\r\n{line}\r\n")),
                "{path} lacks {line}: {head}"
            );
        }
    }
    assert!(process.terminate().await.success());
}

/// DNS rebinding: a page whose name resolves to the relay's address reaches it with its own
/// name as `Host`. Only IP addresses, localhost and the names in `allowed_hosts` are
/// answered (the probes excepted).
#[tokio::test]
async fn hosts_other_than_addresses_localhost_and_allowed_names_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (mut process, addr) = relay_with_token(
        dir.path(),
        &["--allowed-hosts", "relay.internal,Other.Example"],
    )
    .await;
    let authorized = format!("Authorization: Bearer {TOKEN}\r\n");
    let ask = |path: &str, host: &str| {
        let head = request("GET", path, host, &authorized);
        let addr = addr.clone();
        async move { support::http_exchange(&addr, &head).await }
    };
    for host in [
        "evil.example",
        "evil.example:2259",
        "relay.internal.evil.example",
        "localhost.evil.example",
    ] {
        for path in ["/api/v1/status", "/", "/assets/app.js"] {
            let (code, body) = ask(path, host).await;
            assert_eq!(code, 421, "{host}{path}: {body}");
            assert!(
                body.contains("allowed_hosts") && body.contains("OUTBOX_RELAY_ALLOWED_HOSTS"),
                "{body}"
            );
        }
        for path in ["/healthz", "/metrics"] {
            assert_eq!(ask(path, host).await.0, 200, "{host}{path}");
        }
    }
    for host in [
        addr.as_str(),
        "127.0.0.1",
        "[::1]:2259",
        "localhost",
        "LocalHost:8080",
        "relay.internal",
        "RELAY.internal:443",
        "other.example",
    ] {
        let (code, body) = ask("/api/v1/status", host).await;
        assert_eq!(code, 200, "{host}: {body}");
    }
    // Two Host headers, the first allowed: answered 400 (RFC 9112), not by the first.
    let twice = request(
        "GET",
        "/api/v1/status",
        "127.0.0.1",
        &format!("Host: evil.example\r\n{authorized}"),
    );
    let (code, body) = support::http_exchange(&addr, &twice).await;
    assert_eq!(code, 400, "{body}");
    assert!(process.terminate().await.success());
}

/// DNS rebinding reached `/readyz`, which skips the `Host` check so that probes may name the
/// relay as they like: without a token its reasons were shown, and they quote what a sink
/// or database said (a receiver's body may echo a payload) and name keys. A page whose name
/// was rebound to the relay read them. To a `Host` not the relay's, only the verdict.
#[tokio::test]
async fn a_rebound_host_learns_only_the_readiness_verdict() {
    outbox_testkit::install_crypto();
    let dir = tempfile::tempdir().unwrap();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let sink = format!("nats://127.0.0.1:{}", closed.local_addr().unwrap().port());
    drop(closed);
    let mut process = RelayProcess::spawn(
        dir.path(),
        "no-token-relay",
        &[
            "run",
            "--http-addr",
            "127.0.0.1:0",
            "--log-format",
            "json",
            "--sink",
            &sink,
        ],
        &[],
    );
    let addr = http_addr(&process).await;
    let ask = |host: &str| {
        let head = request("GET", "/readyz", host, "");
        let addr = addr.clone();
        async move { support::http_exchange(&addr, &head).await }
    };
    let reasons = outbox_testkit::eventually("not ready, naming the sink", PATIENCE, || async {
        let (code, body) = ask(&addr).await;
        (code == 503 && body.contains("127.0.0.1")).then_some(body)
    })
    .await;
    let (code, body) = ask("evil.example:2259").await;
    assert_eq!(code, 503, "{body}");
    assert!(
        body.starts_with("not ready: ") && !body.contains("127.0.0.1"),
        "a rebound page read the reasons: {body} (the relay's own host is shown: {reasons})"
    );
    assert!(process.terminate().await.success());
}

/// Slowloris: a client that never finishes its headers is closed, and so is one that keeps an
/// idle connection open after its answer.
#[tokio::test]
async fn slow_and_idle_connections_are_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let (mut process, addr) = relay_with_token(dir.path(), &[]).await;
    let closed = |mut stream: tokio::net::TcpStream| async move {
        let mut rest = Vec::new();
        // Generous: the server's own bound is far shorter; this only keeps a failure finite.
        tokio::time::timeout(Duration::from_secs(90), stream.read_to_end(&mut rest))
            .await
            .map(|_| String::from_utf8_lossy(&rest).into_owned())
    };
    let mut slow = tokio::net::TcpStream::connect(&addr).await.unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .await
        .unwrap();
    let mut idle = tokio::net::TcpStream::connect(&addr).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .unwrap();
    let (slow, idle) = tokio::join!(closed(slow), closed(idle));
    assert!(
        slow.is_ok(),
        "a client that never finished its headers is still connected"
    );
    let idle = idle.expect("an idle keep-alive connection is still open");
    assert!(
        idle.starts_with("HTTP/1.1 200") && idle.ends_with("ok\n"),
        "{idle:?}"
    );
    assert!(process.terminate().await.success());
}

/// A client that asks for answers and never reads them is closed once its answer stops
/// moving (`http::WRITE_STALL_TIMEOUT`, 10 s): before, the write waited for good (TCP's
/// window probes keep a zero-window peer alive), so 256 such clients, needing no token, held
/// every connection slot and the kubelet's `/healthz` went unanswered. Seen from the
/// server's side of the connection in `/proc/net/tcp`, as reading would let the answer move.
#[tokio::test]
#[cfg(target_os = "linux")]
async fn a_client_that_never_reads_its_answers_is_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let (mut process, addr) = relay_with_token(dir.path(), &[]).await;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(addr.parse().unwrap()).await.unwrap();
    // 600 answers of the dashboard's script (16 KiB each, no token needed): more than the
    // client's and the server's socket buffers hold (the server's grows to 4 MiB at most).
    const ASKED: usize = 600;
    let ask = "GET /assets/app.js HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".repeat(ASKED);
    stream.write_all(ask.as_bytes()).await.unwrap();
    let client = stream.local_addr().unwrap().port();
    let server = addr.rsplit(':').next().unwrap().parse::<u16>().unwrap();
    // The server's end of the connection leaves ESTABLISHED when it gives up on it.
    let established = move || {
        std::fs::read_to_string("/proc/net/tcp")
            .unwrap()
            .lines()
            .skip(1)
            .any(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                let port = |field: &str| {
                    u16::from_str_radix(field.rsplit(':').next().unwrap(), 16).unwrap()
                };
                port(fields[1]) == server && port(fields[2]) == client && fields[3] == "01"
            })
    };
    assert!(established(), "the connection is served");
    let closed = tokio::time::timeout(Duration::from_secs(60), async {
        while established() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "a client that reads nothing still holds its connection after 60 s"
    );
    // What was sent before the server gave up, then the end: not all 600 answers.
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), stream.read_to_end(&mut got))
        .await
        .expect("the connection ends")
        .ok();
    let answers = String::from_utf8_lossy(&got)
        .matches("HTTP/1.1 200")
        .count();
    assert!(answers < ASKED, "{answers} answers");
    // The relay still serves others.
    let (code, body) = Admin::new(&addr).get_text("/healthz").await;
    assert_eq!(code, 200, "{body}");
    assert!(process.terminate().await.success());
}

/// A client that pipelines requests and reads their answers a trickle at a time is closed
/// once its connection is 30 s old (`http::CONNECTION_LIFETIME`) and its answer in
/// progress sent: each byte taken restarted the write-stall clock, so 256 such clients held
/// every slot for good.
#[tokio::test]
async fn a_client_reading_a_trickle_gives_its_connection_back() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let (mut process, addr) = relay_with_token(dir.path(), &[]).await;
    let mut stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
    // 6,000 answers of the dashboard's script (16 KiB each, no token needed): 96 MiB.
    const ASKED: usize = 6000;
    let ask = "GET /assets/app.js HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".repeat(ASKED);
    stream.write_all(ask.as_bytes()).await.unwrap();
    let started = std::time::Instant::now();
    let mut got = 0usize;
    let mut buf = vec![0u8; 64 * 1024];
    // At most 64 KiB every 100 ms: the answers always move (no write stall), and all of
    // them would take 150 s.
    let ended = tokio::time::timeout(Duration::from_secs(100), async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got += n,
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(
        ended.is_ok(),
        "still connected after {:?}, {got} bytes read",
        started.elapsed()
    );
    assert!(
        got < ASKED * 16 * 1024,
        "{got} bytes: every answer was read"
    );
    let (code, body) = Admin::new(&addr).get_text("/healthz").await;
    assert_eq!(code, 200, "{body}");
    assert!(process.terminate().await.success());
}

const HEALTHZ: &[u8] = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";

/// A connection to `addr` from the loopback address `from` (127.0.0.0/8 is all loopback).
async fn connect_from(from: &str, addr: &str) -> tokio::io::BufReader<tokio::net::TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
    let stream = socket.connect(addr.parse().unwrap()).await.unwrap();
    tokio::io::BufReader::new(stream)
}

/// One answer of /healthz on a kept-alive connection: its head, then "ok\n"; `None` when
/// the relay closed the connection instead.
async fn healthz_answer(
    stream: &mut tokio::io::BufReader<tokio::net::TcpStream>,
) -> Option<String> {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt};
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if stream.read_line(&mut line).await.ok()? == 0 {
            return None;
        }
        head.push_str(&line);
        if line == "\r\n" {
            break;
        }
    }
    let mut body = [0u8; 3];
    stream.read_exact(&mut body).await.ok()?;
    Some(head + std::str::from_utf8(&body).unwrap())
}

/// At most 256 connections are served at once: one more closes the oldest idle one (a
/// keep-alive connection between requests) to take its place, and the others are still
/// served. (From four addresses: one address is held to a quarter of them, next test.)
#[tokio::test]
async fn a_connection_beyond_the_cap_takes_the_place_of_the_oldest_idle_one() {
    use tokio::io::AsyncWriteExt;
    const CAP: usize = 256; // outbox-relay's http::MAX_CONNECTIONS
    let dir = tempfile::tempdir().unwrap();
    let (mut process, addr) = relay_with_token(dir.path(), &[]).await;
    let mut served = Vec::new();
    for i in 0..CAP {
        let mut stream = connect_from(&format!("127.0.0.{}", 2 + i % 4), &addr).await;
        stream.get_mut().write_all(HEALTHZ).await.unwrap();
        let answer = healthz_answer(&mut stream).await;
        assert!(answer.is_some_and(|a| a.starts_with("HTTP/1.1 200")));
        served.push(stream);
    }
    let mut extra = connect_from("127.0.0.1", &addr).await;
    extra.get_mut().write_all(HEALTHZ).await.unwrap();
    let answer = healthz_answer(&mut extra).await;
    assert!(answer.is_some_and(|a| a.starts_with("HTTP/1.1 200")));
    // The oldest was closed for it; the next oldest is still served.
    let _ = served[0].get_mut().write_all(HEALTHZ).await;
    assert_eq!(healthz_answer(&mut served[0]).await, None);
    served[1].get_mut().write_all(HEALTHZ).await.unwrap();
    assert!(healthz_answer(&mut served[1])
        .await
        .is_some_and(|a| a.starts_with("HTTP/1.1 200")));
    drop(served);
    assert!(process.terminate().await.success());
}

/// One address is served at most a quarter of the connections at once: each one more from
/// it takes the place of its own oldest idle one, and other addresses are still served.
/// The probes need no token, so one client holding every slot with idle keep-alive
/// connections kept the kubelet's probes waiting past their timeout.
#[tokio::test]
async fn one_address_is_served_a_quarter_of_the_connections_and_others_still_are() {
    use tokio::io::AsyncWriteExt;
    const CAP: usize = 256; // outbox-relay's http::MAX_CONNECTIONS
    let dir = tempfile::tempdir().unwrap();
    let (mut process, addr) = relay_with_token(dir.path(), &[]).await;
    let mut opened = Vec::new();
    for _ in 0..CAP {
        let mut stream = connect_from("127.0.0.2", &addr).await;
        stream.get_mut().write_all(HEALTHZ).await.unwrap();
        let answer = healthz_answer(&mut stream).await;
        assert!(answer.is_some_and(|a| a.starts_with("HTTP/1.1 200")));
        opened.push(stream);
    }
    // The newest quarter is kept; the ones before it were closed as the others came.
    let mut kept = opened.split_off(CAP - CAP / 4);
    let _ = opened[CAP - CAP / 4 - 1].get_mut().write_all(HEALTHZ).await;
    assert_eq!(healthz_answer(&mut opened[CAP - CAP / 4 - 1]).await, None);
    let mut probe = connect_from("127.0.0.1", &addr).await;
    probe.get_mut().write_all(HEALTHZ).await.unwrap();
    let answer = healthz_answer(&mut probe).await;
    assert!(answer.is_some_and(|a| a.starts_with("HTTP/1.1 200")));
    kept[0].get_mut().write_all(HEALTHZ).await.unwrap();
    assert!(healthz_answer(&mut kept[0])
        .await
        .is_some_and(|a| a.starts_with("HTTP/1.1 200")));
    drop((opened, kept));
    assert!(process.terminate().await.success());
}

/// Half-sent request headers, renewed as the header timeout closes them, held every slot:
/// 64 connections from 127.0.0.1 (which every local user shares) closed a probe from it at
/// once, and 64 from each of four addresses kept `/healthz` waiting until one timed out
/// (9 s, past the image's and Kubernetes' probe timeouts). A probe now takes the place of
/// the oldest of them at once.
#[tokio::test]
async fn half_sent_headers_in_every_slot_keep_no_probe_waiting() {
    use tokio::io::AsyncWriteExt;
    const CAP: usize = 256; // outbox-relay's http::MAX_CONNECTIONS
    let dir = tempfile::tempdir().unwrap();
    let (mut process, addr) = relay_with_token(dir.path(), &[]).await;
    let half = b"GET /healthz HTTP/1.1\r\nHost: 127";
    let since = std::time::Instant::now();
    let mut held = Vec::new();
    for i in 0..CAP {
        let from = if i < CAP / 4 {
            "127.0.0.1".to_string()
        } else {
            format!("127.0.0.{}", 2 + i % 3)
        };
        let mut stream = connect_from(&from, &addr).await;
        stream.get_mut().write_all(half).await.unwrap();
        held.push(stream);
    }
    let mut probe = connect_from("127.0.0.1", &addr).await;
    probe.get_mut().write_all(HEALTHZ).await.unwrap();
    let answer = healthz_answer(&mut probe).await;
    assert!(answer.is_some_and(|a| a.starts_with("HTTP/1.1 200")));
    // Answered by making room, not once a held connection's header timeout (10 s, the
    // server's) closed it: a question of cause, not of speed.
    assert!(
        since.elapsed() < Duration::from_secs(10),
        "the probe waited for a held connection's header timeout"
    );
    drop(held);
    assert!(process.terminate().await.success());
}
