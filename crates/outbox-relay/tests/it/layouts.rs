//! The seeds' own tables on PostgreSQL, created from their DDL verbatim (tests/fixtures/seeds),
//! filled with their example inserts, relayed by the binary to a real NATS JetStream server.
//! Each test checks the success action (deleted / marked / delivered_at set) and the failure
//! path (dead state, `dead list`, `dead retry`, `dead purge`, `prune`).

use crate::support;

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use crate::support::{pg, RelayProcess, BIN};
use mysql_async::prelude::Queryable;
use outbox_testkit::eventually;
use outbox_testkit::nats::{stream, PrivateNats};

const WAIT: Duration = Duration::from_secs(30);

struct Harness {
    dir: tempfile::TempDir,
    url: String,
    db: Option<tokio_postgres::Client>,
    _nats: PrivateNats,
    nats_url: String,
    js: async_nats::jetstream::Context,
}

struct Message {
    subject: String,
    payload: String,
    bytes: Vec<u8>,
    header: std::collections::HashMap<String, String>,
}

impl Harness {
    async fn new(fixture: &str) -> Harness {
        let url = outbox_testkit::fresh_pg_database().await;
        let db = pg(&url).await;
        db.batch_execute(fixture)
            .await
            .expect("apply the seed's DDL");
        let mut h = Harness::on(url).await;
        h.db = Some(db);
        h
    }

    /// NATS and a working directory for a relay on the database at `url`.
    async fn on(url: String) -> Harness {
        outbox_testkit::install_crypto();
        let nats = PrivateNats::with_stream(stream("SEED", &["seed.>"])).await;
        let (nats_url, js) = (nats.url.clone(), nats.js.clone());
        Harness {
            dir: tempfile::tempdir().unwrap(),
            url,
            db: None,
            _nats: nats,
            nats_url,
            js,
        }
    }

    /// Routes `routed` destinations to NATS (`seed.<destination>`); the rest have no route, so
    /// they fail twice and go dead.
    fn configure(&self, layout: &str, routed: &[&str]) {
        let mut routes = String::new();
        for glob in routed {
            routes.push_str(&format!(
                "[[routes]]\ndestinations = \"{glob}\"\nsink = \"nats\"\ntarget = \"seed.{{destination}}\"\n"
            ));
        }
        std::fs::write(
            self.dir.path().join("outbox-relay.toml"),
            format!(
                r#"
database_url = "{url}"
layout = "{layout}"
http_addr = ""
poll_interval = "100ms"
lease = "2s"
publish_timeout = "1500ms"
[retry]
base_delay = "10ms"
max_delay = "20ms"
max_attempts = 2
[sinks.nats]
uri = "{nats}"
{routes}"#,
                url = self.url,
                nats = self.nats_url,
            ),
        )
        .unwrap();
    }

    /// [`Harness::configure`] for a custom mapping whose `[mapping]` section is `mapping`
    /// (placed before the sinks: it must follow the top-level keys).
    fn configure_mapping(&self, mapping: &str) {
        self.configure("custom", &["*"]);
        let config = self.dir.path().join("outbox-relay.toml");
        let text = std::fs::read_to_string(&config).unwrap().replace(
            "[sinks.nats]",
            &format!("[mapping]\n{mapping}\n[sinks.nats]"),
        );
        std::fs::write(&config, text).unwrap();
    }

    fn pg(&self) -> &tokio_postgres::Client {
        self.db.as_ref().expect("a PostgreSQL harness")
    }

    fn relay(&self, name: &str) -> RelayProcess {
        RelayProcess::spawn(self.dir.path(), name, &["run"], &[])
    }

    fn cli(&self, args: &[&str]) -> String {
        let out = command(self.dir.path(), args);
        assert!(
            out.status.success(),
            "outbox-relay {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    }

    /// `check`'s report. Its sink line is left out of account: a NATS sink connects lazily, so
    /// `check` may find it still connecting.
    fn check_store(&self) -> String {
        String::from_utf8_lossy(&command(self.dir.path(), &["check"]).stdout).to_string()
    }

    async fn messages(&self) -> Vec<Message> {
        let mut stream = self.js.get_stream("SEED").await.unwrap();
        let last = stream.info().await.unwrap().state.last_sequence;
        let mut out = Vec::new();
        for seq in 1..=last {
            let m = stream.get_raw_message(seq).await.unwrap();
            let header = m
                .headers
                .iter()
                .map(|(k, v)| (k.to_string(), v[0].to_string()))
                .collect();
            out.push(Message {
                subject: m.subject.to_string(),
                payload: String::from_utf8_lossy(&m.payload).to_string(),
                bytes: m.payload.to_vec(),
                header,
            });
        }
        out
    }

    async fn wait_messages(&self, n: usize) -> Vec<Message> {
        eventually(&format!("{n} messages in the stream"), WAIT, || async {
            let m = self.messages().await;
            (m.len() >= n).then_some(m)
        })
        .await
    }

    async fn count(&self, sql: &str) -> i64 {
        match &self.db {
            Some(db) => db.query_one(sql, &[]).await.unwrap().get(0),
            None => {
                let mut conn = mysql_async::Conn::from_url(self.url.as_str())
                    .await
                    .unwrap();
                let n: Option<i64> = conn.query_first(sql).await.unwrap();
                conn.disconnect().await.unwrap();
                n.unwrap_or(0)
            }
        }
    }

    async fn mysql(&self, sql: &str) {
        let mut conn = mysql_async::Conn::from_url(self.url.as_str())
            .await
            .unwrap();
        conn.query_drop(sql).await.unwrap();
        conn.disconnect().await.unwrap();
    }

    async fn wait_count(&self, what: &str, sql: &str, expected: i64) {
        eventually(what, WAIT, || async {
            (self.count(sql).await == expected).then_some(())
        })
        .await
    }
}

fn command(dir: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .current_dir(dir)
        .env_remove("DATABASE_URL")
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adbc_table_is_relayed_in_channel_order_and_processed_rows_are_deleted() {
    let h = Harness::new(include_str!("../fixtures/seeds/adbc.sql")).await;
    h.configure("adbc", &["posts:*"]);
    assert!(h
        .check_store()
        .contains("ok: tables, trigger and privileges"));
    // The seed's example transaction, with JSON data.
    h.pg().batch_execute(
        "CREATE TABLE comments (comment text);
         BEGIN;
         INSERT INTO comments (comment) VALUES ('New comment!');
         INSERT INTO outbox (mutation_id, channel, name, data) VALUES ('my-mutation-id', 'posts:123', 'addComment', '{\"comment\": \"New comment!\"}');
         COMMIT;
         INSERT INTO outbox (mutation_id, channel, name, data, headers, rejected)
              VALUES ('m2', 'posts:123', 'editComment', '{\"n\": 2}', '{\"author\": \"socrates\"}', true);
         INSERT INTO outbox (mutation_id, channel, name, data) VALUES ('m3', 'posts:9', 'addComment', '{\"n\": 3}');
         INSERT INTO outbox (mutation_id, channel, name, data) VALUES ('m4', 'nowhere', 'lost', '{\"n\": 4}');",
    )
    .await
    .unwrap();
    let mut relay = h.relay("adbc");
    let messages = h.wait_messages(3).await;
    let on_123: Vec<&Message> = messages
        .iter()
        .filter(|m| m.subject == "seed.posts:123")
        .collect();
    assert_eq!(on_123.len(), 2);
    assert_eq!(on_123[0].payload, r#"{"comment": "New comment!"}"#);
    assert_eq!(on_123[0].header["Outbox-Event-Type"], "addComment");
    assert_eq!(on_123[0].header["Outbox-Mutation-Id"], "my-mutation-id");
    assert_eq!(on_123[1].header["author"], "socrates");
    let ids: std::collections::HashSet<&str> = messages
        .iter()
        .map(|m| m.header["Nats-Msg-Id"].as_str())
        .collect();
    assert_eq!(ids.len(), 3, "every event has its own dedupe id");

    // Delivered rows are deleted; the unroutable one is dead: processed, left in place.
    h.wait_count(
        "the dead row marked processed",
        "SELECT count(*) FROM outbox WHERE channel = 'nowhere' AND processed",
        1,
    )
    .await;
    // Each delivered row's delete is an ack statement of its own, ordered by nothing
    // against the dead row's.
    h.wait_count(
        "the delivered rows deleted",
        "SELECT count(*) FROM outbox WHERE channel <> 'nowhere'",
        0,
    )
    .await;
    assert!(
        h.count("SELECT count(*) FROM nodes").await >= 1,
        "the relay heartbeats in the nodes table"
    );
    assert_eq!(relay.terminate().await.code(), Some(0));
    assert_eq!(
        h.count("SELECT count(*) FROM nodes").await,
        0,
        "a clean exit deregisters"
    );

    let listed = h.cli(&["dead", "list"]);
    assert!(
        listed.contains("nowhere") && listed.contains("lost"),
        "{listed}"
    );
    assert!(h.cli(&["stats"]).contains("nowhere"));
    // The seed's manual resend: back to unprocessed, and published once a route exists.
    h.cli(&["dead", "retry", "--destination", "nowhere"]);
    assert_eq!(
        h.count("SELECT count(*) FROM outbox WHERE processed").await,
        0
    );
    h.configure("adbc", &["posts:*", "nowhere"]);
    let mut relay = h.relay("adbc-2");
    h.wait_messages(4).await;
    h.wait_count("the resent row deleted", "SELECT count(*) FROM outbox", 0)
        .await;
    relay.terminate().await;

    // Purge removes dead rows.
    h.pg().batch_execute(
        "INSERT INTO outbox (mutation_id, channel, name, data, processed) VALUES ('m5', 'gone', 'x', '{}', true)",
    )
    .await
    .unwrap();
    h.cli(&["dead", "purge", "--all"]);
    assert_eq!(h.count("SELECT count(*) FROM outbox").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adbc_migrate_creates_exactly_the_connectors_objects_and_accepts_its_env_names() {
    let url = outbox_testkit::fresh_pg_database().await;
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args(["migrate", "--layout", "adbc"])
        .current_dir(dir.path())
        .env_remove("DATABASE_URL")
        .env("ADBC_POSTGRES_CONNECTION_URI", &url)
        .env("ADBC_OUTBOX_TABLE_TABLE_SCHEMA", "app")
        .env("ADBC_OUTBOX_TABLE_TABLE_NAME", "events")
        .env("ADBC_NODES_TABLE_TABLE_SCHEMA", "app")
        .env("ADBC_NODES_TABLE_TABLE_NAME", "relay_nodes")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let db = pg(&url).await;
    let tables: Vec<String> = db
        .query(
            "SELECT table_schema || '.' || table_name FROM information_schema.tables
              WHERE table_schema NOT IN ('pg_catalog', 'information_schema') ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(tables, ["app.events", "app.relay_nodes"]);
    let columns: Vec<String> = db
        .query(
            "SELECT column_name::text || ' ' || data_type FROM information_schema.columns
              WHERE table_schema = 'app' AND table_name = 'events' ORDER BY ordinal_position",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        columns,
        [
            "sequence_id integer",
            "mutation_id text",
            "channel text",
            "name text",
            "rejected boolean",
            "data jsonb",
            "headers jsonb",
            "locked_by text",
            "lock_expiry timestamp without time zone",
            "processed boolean"
        ]
    );
    let trigger: String = db
        .query_one(
            "SELECT tgname::text || ' ' || p.proname::text FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
              WHERE NOT tgisinternal",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(trigger, "events_trigger events_notify");
    let source: String = db
        .query_one(
            "SELECT prosrc FROM pg_proc WHERE proname = 'events_notify'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        source.contains("pg_notify('ably_adbc'::text, ''::text)"),
        "{source}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_outbox_events_go_pending_delivering_delivered_or_dead_and_the_reaper_counts_crashes()
{
    let h = Harness::new(include_str!("../fixtures/seeds/open_outbox.sql")).await;
    h.configure("open-outbox", &["user.*", "order.*"]);
    h.pg().batch_execute(
        "INSERT INTO openoutbox_events (event_id, event_type, partition_key, payload, headers)
              VALUES ('00000000-0000-4000-8000-000000000001', 'user.signup', 'u1', '\\x01ff02'::bytea, '{\"trace\": \"t1\"}');
         INSERT INTO openoutbox_events (event_id, event_type, partition_key, payload)
              VALUES ('00000000-0000-4000-8000-000000000002', 'user.signup', 'u1', convert_to('second', 'UTF8'));
         INSERT INTO openoutbox_events (event_id, event_type, payload)
              VALUES ('00000000-0000-4000-8000-000000000003', 'nowhere', convert_to('lost', 'UTF8'));
         -- Left DELIVERING by a relay that crashed: one with attempts to spare, one on its last.
         INSERT INTO openoutbox_events (event_id, event_type, payload, status, attempts, locked_by, locked_at)
              VALUES ('00000000-0000-4000-8000-000000000004', 'order.placed', convert_to('resumed', 'UTF8'), 'DELIVERING', 0, 'ghost', now() - interval '1 hour');
         INSERT INTO openoutbox_events (event_id, event_type, payload, status, attempts, locked_by, locked_at)
              VALUES ('00000000-0000-4000-8000-000000000005', 'order.placed', convert_to('poison', 'UTF8'), 'DELIVERING', 1, 'ghost', now() - interval '1 hour');",
    )
    .await
    .unwrap();
    let mut relay = h.relay("open-outbox");
    let messages = h.wait_messages(3).await;
    let signup: Vec<&Message> = messages
        .iter()
        .filter(|m| m.subject == "seed.user.signup")
        .collect();
    assert_eq!(signup.len(), 2);
    assert_eq!(
        signup[0].bytes,
        [1, 0xff, 2],
        "the bytea payload is published as raw bytes"
    );
    assert_eq!(
        signup[0].header["Nats-Msg-Id"],
        "00000000-0000-4000-8000-000000000001"
    );
    assert_eq!(signup[0].header["trace"], "t1");
    assert_eq!(signup[1].payload, "second");
    assert!(messages.iter().any(|m| m.payload == "resumed"));
    assert!(!messages.iter().any(|m| m.payload == "poison"));

    h.wait_count(
        "delivered rows marked with delivered_at",
        "SELECT count(*) FROM openoutbox_events WHERE status = 'DELIVERED' AND delivered_at IS NOT NULL AND locked_by IS NULL",
        3,
    )
    .await;
    h.wait_count(
        "the unroutable event dead after 2 attempts, and the poison event dead by the reaper",
        "SELECT count(*) FROM openoutbox_events WHERE status = 'DEAD' AND last_error IS NOT NULL AND attempts = 2",
        2,
    )
    .await;
    assert_eq!(
        h.count("SELECT attempts::int8 FROM openoutbox_events WHERE event_id = '00000000-0000-4000-8000-000000000004'").await,
        1,
        "the reaper counted the crashed attempt"
    );
    relay.terminate().await;

    let listed = h.cli(&["dead", "list"]);
    assert!(
        listed.contains("nowhere") && listed.contains("order.placed"),
        "{listed}"
    );
    h.cli(&["dead", "retry", "--destination", "nowhere"]);
    assert_eq!(
        h.count("SELECT count(*) FROM openoutbox_events WHERE status = 'PENDING' AND attempts = 0")
            .await,
        1
    );
    h.cli(&["dead", "purge", "--all"]);
    assert_eq!(
        h.count("SELECT count(*) FROM openoutbox_events WHERE status = 'DEAD'")
            .await,
        0
    );
    h.cli(&["prune", "--delivered-older-than", "0s"]);
    assert_eq!(
        h.count("SELECT count(*) FROM openoutbox_events WHERE status = 'DELIVERED'")
            .await,
        0
    );
    assert_eq!(
        h.count("SELECT count(*) FROM openoutbox_events").await,
        1,
        "the pending one stays"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_events_go_new_processing_done_or_error_with_per_type_retry_limits() {
    let h = Harness::new(include_str!("../fixtures/seeds/export.sql")).await;
    h.configure("export", &["order_created"]);
    h.pg().batch_execute(
        "INSERT INTO event_type (code, max_retry_count) VALUES ('order_created', 3), ('client_updated', 0);
         INSERT INTO event (type_code, payload) VALUES ('order_created', '{\"order\": 1}'), ('order_created', '{\"order\": 2}');
         INSERT INTO event (type_code, payload) VALUES ('client_updated', '{\"client\": 7}');
         -- Stuck in PROCESSING by an exporter that died: retries left, and none left.
         INSERT INTO event (type_code, payload, status, processing_retries_count, updated_at)
              VALUES ('order_created', '{\"order\": 3}', 'PROCESSING', 1, now() - interval '20 minutes'),
                     ('order_created', '{\"order\": 4}', 'PROCESSING', 3, now() - interval '20 minutes');",
    )
    .await
    .unwrap();
    let mut relay = h.relay("export");
    let messages = h.wait_messages(3).await;
    let payloads: std::collections::BTreeSet<&str> =
        messages.iter().map(|m| m.payload.as_str()).collect();
    assert_eq!(
        payloads,
        [r#"{"order": 1}"#, r#"{"order": 2}"#, r#"{"order": 3}"#]
            .into_iter()
            .collect()
    );
    h.wait_count(
        "delivered events DONE",
        "SELECT count(*) FROM event WHERE status = 'DONE'",
        3,
    )
    .await;
    // client_updated allows no retry: one attempt, then ERROR; order 4 had used its retries.
    h.wait_count(
        "failed events in ERROR",
        "SELECT count(*) FROM event WHERE status = 'ERROR'",
        2,
    )
    .await;
    assert_eq!(
        h.count(
            "SELECT processing_retries_count::int8 FROM event WHERE type_code = 'client_updated'"
        )
        .await,
        1
    );
    assert_eq!(
        h.count(
            "SELECT processing_retries_count::int8 FROM event WHERE payload = '{\"order\": 3}'"
        )
        .await,
        2,
        "the stalled event's retry was counted"
    );
    relay.terminate().await;
    h.cli(&["dead", "retry", "--destination", "client_updated"]);
    assert_eq!(
        h.count("SELECT count(*) FROM event WHERE status = 'NEW' AND processing_retries_count = 0")
            .await,
        1
    );
    let stats = h.cli(&["stats", "--json"]);
    assert!(stats.contains("client_updated"), "{stats}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_relay_takes_over_a_mapped_table_when_the_active_one_dies() {
    let h = Harness::new(include_str!("../fixtures/seeds/adbc.sql")).await;
    h.configure("adbc", &["*"]);
    let insert = |n: i32| {
        format!("INSERT INTO outbox (mutation_id, channel, name, data) VALUES ('m{n}', 'c', 'n', '{{\"n\": {n}}}')")
    };
    let mut first = h.relay("first");
    h.pg().batch_execute(&insert(1)).await.unwrap();
    h.wait_messages(1).await;
    let mut second = h.relay("second");
    eventually("both relays in the nodes table", WAIT, || async {
        (h.count("SELECT count(*) FROM nodes").await == 2).then_some(())
    })
    .await;
    first.kill9();
    for n in 2..=5 {
        h.pg().batch_execute(&insert(n)).await.unwrap();
    }
    let messages = h.wait_messages(5).await;
    let payloads: Vec<&str> = messages.iter().map(|m| m.payload.as_str()).collect();
    assert_eq!(
        payloads,
        [
            r#"{"n": 1}"#,
            r#"{"n": 2}"#,
            r#"{"n": 3}"#,
            r#"{"n": 4}"#,
            r#"{"n": 5}"#
        ],
        "the standby delivers in channel order"
    );
    assert!(second.logs().contains("now the table's active relay"));
    h.wait_count("every row deleted", "SELECT count(*) FROM outbox", 0)
        .await;
    second.terminate().await;
}

/// The active relay of a mapped table holds the table's lock on a session of its own, which
/// a smart shutdown (`pg_ctl stop -m smart`) waits for as for the pooled ones: the lock is let
/// go while the server refuses new connections, and taken again once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_smart_shutdown_of_postgresql_is_not_held_by_the_active_relay_of_a_mapped_table() {
    // Never the shared server: this one is stopped.
    let server = support::OwnPostgres::init();
    server.start("");
    let url = server.url("disable");
    let insert = |order: i32| {
        let url = url.clone();
        async move {
            pg(&url)
                .await
                .batch_execute(&format!(
                    "INSERT INTO event (type_code, payload)
                     VALUES ('order_created', '{{\"order\": {order}}}')"
                ))
                .await
                .unwrap();
        }
    };
    pg(&url)
        .await
        .batch_execute(&format!(
            "{}; INSERT INTO event_type (code, max_retry_count) VALUES ('order_created', 3);",
            include_str!("../fixtures/seeds/export.sql")
        ))
        .await
        .unwrap();
    let h = Harness::on(url.clone()).await;
    h.configure("export", &["order_created"]);
    let mut relay = h.relay("export");
    insert(1).await;
    h.wait_messages(1).await;
    server.assert_a_smart_shutdown_is_not_held(&relay);
    server.resume_and_await(&relay).await;
    insert(2).await;
    h.wait_messages(2).await;
    assert_eq!(
        relay
            .logs()
            .matches("this relay is now the table's active relay")
            .count(),
        2,
        "the lock let go and taken again\n{}",
        relay.logs()
    );
    relay.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_seed_outbox_events_are_relayed_fifo_and_marked_consumed_on_mariadb() {
    let h = Harness::on(outbox_testkit::fresh_mysql_database().await).await;
    // The seed's SHOW CREATE TABLE output, verbatim but for MySQL 8's collation
    // utf8mb4_0900_ai_ci, which MariaDB 10.11 does not have.
    let ddl = include_str!("../fixtures/seeds/mysql_outbox_events.sql")
        .replace(" COLLATE=utf8mb4_0900_ai_ci", "");
    h.mysql(&ddl).await;
    h.configure("mysql-outbox-events", &["1"]);
    let migrate = h.cli(&["migrate", "--print"]);
    assert!(
        migrate.contains("`outbox_events_dead_letters`"),
        "{migrate}"
    );
    // The side table for dead events is the relay's; the seed's table stays as it is.
    h.cli(&["migrate"]);
    // The seed's dispatch: INSERT INTO outbox_events (`id`,`type`,`message`,`isConsumed`,`createdAt`,`updatedAt`) VALUES (DEFAULT,?,?,?,?,?)
    for (n, kind) in [(1, 1), (2, 1), (3, 9), (4, 1)] {
        h.mysql(&format!(
            "INSERT INTO outbox_events (`id`,`type`,`message`,`isConsumed`,`createdAt`,`updatedAt`) \
             VALUES (DEFAULT,{kind},'{{\"id\":{n}}}',0,UTC_TIMESTAMP(),UTC_TIMESTAMP())"
        ))
        .await;
    }
    let mut relay = h.relay("mysql-seed");
    let messages = h.wait_messages(3).await;
    let payloads: Vec<&str> = messages.iter().map(|m| m.payload.as_str()).collect();
    assert_eq!(
        payloads,
        [r#"{"id":1}"#, r#"{"id":2}"#, r#"{"id":4}"#],
        "FIFO per type"
    );
    assert!(messages.iter().all(|m| m.subject == "seed.1"));
    h.wait_count(
        "delivered rows marked consumed",
        "SELECT count(*) FROM outbox_events WHERE isConsumed = 1",
        3,
    )
    .await;
    h.wait_count(
        "the unroutable event recorded dead, its row left unconsumed",
        "SELECT count(*) FROM outbox_events_dead_letters d JOIN outbox_events e ON e.id = d.id WHERE e.isConsumed = 0 AND d.attempts = 2",
        1,
    )
    .await;
    // The layout keeps no nodes table: `stats` says so, where it said "0 live" beside a
    // running relay.
    let stats = h.cli(&["stats"]);
    assert!(
        stats.contains("nodes: none kept (the mysql-outbox-events layout has no nodes table"),
        "{stats}"
    );
    relay.terminate().await;
    assert!(h.cli(&["dead", "list"]).contains("no_route"));
    h.cli(&["dead", "retry", "--all"]);
    assert_eq!(
        h.count("SELECT count(*) FROM outbox_events_dead_letters")
            .await,
        0
    );
    h.configure("mysql-outbox-events", &["1", "9"]);
    let mut relay = h.relay("mysql-seed-2");
    h.wait_messages(4).await;
    h.wait_count(
        "every row consumed",
        "SELECT count(*) FROM outbox_events WHERE isConsumed = 0",
        0,
    )
    .await;
    relay.terminate().await;
    h.cli(&["prune", "--delivered-older-than", "0s"]);
    assert_eq!(h.count("SELECT count(*) FROM outbox_events").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_layout_on_mariadb_migrates_sends_and_relays() {
    let h = Harness::on(outbox_testkit::fresh_mysql_database().await).await;
    h.configure("native", &["orders.*"]);
    h.cli(&["migrate"]);
    // No trigger of the relay's on MySQL: none is said to be checked.
    assert!(h.check_store().contains("ok: tables and privileges\n"));
    for n in 1..=3 {
        h.cli(&[
            "send",
            "--destination",
            "orders.eu",
            "--key",
            "c1",
            &format!("{{\"n\":{n}}}"),
        ]);
    }
    h.cli(&["send", "--destination", "nowhere", "{}"]);
    let mut relay = h.relay("mysql-native");
    let messages = h.wait_messages(3).await;
    let payloads: Vec<&str> = messages.iter().map(|m| m.payload.as_str()).collect();
    assert_eq!(payloads, [r#"{"n":1}"#, r#"{"n":2}"#, r#"{"n":3}"#]);
    h.wait_count(
        "delivered rows deleted, the dead one kept",
        "SELECT count(*) FROM outbox",
        1,
    )
    .await;
    h.wait_count(
        "the dead row",
        "SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL AND attempts = 2",
        1,
    )
    .await;
    assert!(h.count("SELECT count(*) FROM outbox_nodes").await >= 1);
    relay.terminate().await;
    let stats = h.cli(&["stats"]);
    assert!(stats.contains("nowhere"), "{stats}");
    h.cli(&["dead", "purge", "--all"]);
    assert_eq!(h.count("SELECT count(*) FROM outbox").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_mapping_relays_an_applications_own_table() {
    let h = Harness::new(
        "CREATE TABLE app_events (
             id bigserial PRIMARY KEY,
             topic text NOT NULL,
             aggregate_id text,
             kind text NOT NULL,
             body bytea NOT NULL,
             created_at timestamptz NOT NULL DEFAULT now(),
             sent_at timestamptz,
             trace_parent text
         );",
    )
    .await;
    h.configure("custom", &["billing.*"]);
    let config = h.dir.path().join("outbox-relay.toml");
    let mut text = std::fs::read_to_string(&config).unwrap();
    // The [mapping] must come after the top-level keys: insert it before the sinks.
    text = text.replace(
        "[sinks.nats]",
        r#"[mapping]
table = "app_events"
schema = "public"
id = "id"
destination = "topic"
key = "aggregate_id"
event_type = "kind"
payload = "body"
payload_format = "bytes"
created_at = "created_at"
delivered_at = "sent_at"
traceparent = "trace_parent"
on_success = "mark"
state = { kind = "rows" }

[sinks.nats]"#,
    );
    std::fs::write(&config, text).unwrap();
    let printed = h.cli(&["migrate", "--print"]);
    assert!(printed.contains("\"app_events_dead_letters\""), "{printed}");
    h.cli(&["migrate"]);
    h.pg()
        .batch_execute(
            "INSERT INTO app_events (topic, aggregate_id, kind, body, trace_parent) VALUES
             ('billing.invoice', 'acct-1', 'created', 'raw-1',
              '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'),
             ('billing.invoice', 'acct-1', 'paid', 'raw-2', 'not-a-traceparent'),
             ('shipping', NULL, 'sent', 'raw-3', NULL);",
        )
        .await
        .unwrap();
    let mut relay = h.relay("custom");
    let messages = h.wait_messages(2).await;
    assert_eq!(messages[0].payload, "raw-1");
    assert_eq!(messages[1].payload, "raw-2");
    assert_eq!(messages[1].header["Outbox-Event-Type"], "paid");
    // The trace column becomes the W3C header when valid, and nothing otherwise.
    assert_eq!(
        messages[0].header["traceparent"],
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    );
    assert!(!messages[1].header.contains_key("traceparent"));
    h.wait_count(
        "delivered rows marked",
        "SELECT count(*) FROM app_events WHERE sent_at IS NOT NULL",
        2,
    )
    .await;
    h.wait_count(
        "the unroutable row dead in the side table",
        "SELECT count(*) FROM app_events_dead_letters",
        1,
    )
    .await;
    relay.terminate().await;
    assert!(h.cli(&["dead", "list"]).contains("shipping"));
}

/// A mapping whose columns are of types its statements cannot read passed `check`, then
/// failed every claim at `run` (or ended it saying to run `migrate`, which does nothing
/// for the application's table). `check` and `run` now name each column, its type and the
/// mapping's field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mapped_column_of_a_type_the_relay_cannot_read_is_named_by_check_and_run() {
    let h = Harness::new(
        "CREATE TABLE typed_events (
             id bigserial PRIMARY KEY,
             topic text NOT NULL,
             k text,
             body bytea NOT NULL,
             created text DEFAULT now()::text,
             rej integer DEFAULT 0,
             sent_at timestamptz
         );",
    )
    .await;
    h.configure_mapping(
        r#"table = "typed_events"
id = "id"
destination = "topic"
key = "k"
payload = "body"
created_at = "created"
rejected = "rej"
delivered_at = "sent_at"
on_success = "mark"
state = { kind = "rows" }
"#,
    );
    h.cli(&["migrate"]);
    let checked = command(h.dir.path(), &["check"]);
    let said = String::from_utf8_lossy(&checked.stdout).to_string();
    assert!(!checked.status.success(), "{said}");
    for column in [
        "column \"body\" (the mapping's payload) is bytea",
        "payload_format = \"bytes\"",
        "column \"created\" (the mapping's created_at) is text",
        "column \"rej\" (the mapping's rejected) is integer",
    ] {
        assert!(said.contains(column), "{column}: {said}");
    }
    assert!(said.contains("check the [mapping] section"), "{said}");
    let ran = command(h.dir.path(), &["run"]);
    let err = String::from_utf8_lossy(&ran.stderr).to_string();
    assert!(!ran.status.success(), "{err}");
    assert!(err.contains("(the mapping's rejected) is integer"), "{err}");
}

/// A role given what `migrate --print --role` grants passes `check`; without INSERT on the
/// layout's dead-letter table it fails it, naming the grant. Unchecked, the first bad row
/// (days after a deploy) stopped the relay, and every key with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_a_missing_grant_on_the_layouts_dead_letter_table() {
    let h = Harness::new(
        "CREATE TABLE granted_events (
             id bigserial PRIMARY KEY,
             topic text NOT NULL,
             body jsonb NOT NULL,
             sent_at timestamptz
         );",
    )
    .await;
    h.configure_mapping(
        r#"table = "granted_events"
id = "id"
destination = "topic"
payload = "body"
delivered_at = "sent_at"
on_success = "mark"
state = { kind = "rows" }
"#,
    );
    h.cli(&["migrate"]);
    let database = h.url.rsplit('/').next().unwrap().to_string();
    let role = format!("r_{}", &database[database.len() - 12..]);
    let grants = h.cli(&["migrate", "--print", "--role", &role]);
    let grants = grants
        .split("-- The relay's run-time role")
        .nth(1)
        .map(|g| format!("-- {g}"))
        .unwrap_or(grants);
    h.pg()
        .batch_execute(&format!("CREATE ROLE {role} LOGIN; {grants}"))
        .await
        .unwrap();
    let as_role = h.url.replacen("postgres@", &format!("{role}@"), 1);
    let check = |url: &str| {
        let out = command(h.dir.path(), &["check", "--database-url", url]);
        let said = String::from_utf8_lossy(&out.stdout).to_string();
        (said, out.status)
    };
    let (said, _) = check(&as_role);
    assert!(
        !said.contains("lacks"),
        "the printed grants suffice: {said}"
    );
    h.pg()
        .batch_execute(&format!(
            "REVOKE INSERT ON granted_events_dead_letters FROM {role}"
        ))
        .await
        .unwrap();
    let (said, status) = check(&as_role);
    assert!(!status.success(), "{said}");
    assert!(
        said.contains("lacks INSERT on") && said.contains("granted_events_dead_letters"),
        "{said}"
    );
    h.pg()
        .batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
        .await
        .unwrap();
}

/// Inserts one Open Outbox event per call and waits until the relay has marked it delivered:
/// with an hour's poll interval only a wake-up on commit can bring it out in time.
async fn open_outbox_event_is_delivered_without_polling(h: &Harness, n: usize) {
    h.pg()
        .batch_execute(&format!(
            "INSERT INTO openoutbox_events (event_id, event_type, payload)
                  VALUES (gen_random_uuid(), 'user.signup', convert_to('event {n}', 'UTF8'))"
        ))
        .await
        .unwrap();
    h.wait_count(
        &format!("event {n} delivered on its commit's notification"),
        "SELECT count(*) FROM openoutbox_events WHERE status = 'DELIVERED'",
        n as i64,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seed_table_wakes_the_relay_on_commit_through_the_trigger_migrate_installs() {
    let h = Harness::new(include_str!("../fixtures/seeds/open_outbox.sql")).await;
    h.configure("open-outbox", &["user.*"]);
    let before = command(h.dir.path(), &["check"]);
    let report = String::from_utf8_lossy(&before.stdout);
    assert!(
        !before.status.success()
            && report.contains("trigger openoutbox_events_trigger on")
            && report.contains("migrate --layout open-outbox"),
        "check reports the missing trigger: {report}"
    );
    let printed = h.cli(&["migrate", "--print"]);
    assert!(
        printed.contains("CREATE TRIGGER \"openoutbox_events_trigger\" AFTER INSERT")
            && printed.contains("pg_notify('outbox_relay', '')"),
        "{printed}"
    );
    // Twice: the trigger is installed once, on the seed's existing table.
    h.cli(&["migrate"]);
    h.cli(&["migrate"]);
    assert_eq!(
        h.count("SELECT count(*) FROM pg_trigger WHERE tgrelid = 'openoutbox_events'::regclass AND NOT tgisinternal")
            .await,
        1
    );
    assert!(h
        .check_store()
        .contains("ok: tables, trigger and privileges"));
    let mut relay = RelayProcess::spawn(
        h.dir.path(),
        "open-outbox-notify",
        &["run", "--poll-interval", "1h"],
        &[],
    );
    for n in 1..=3 {
        open_outbox_event_is_delivered_without_polling(&h, n).await;
    }
    relay.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seed_table_under_the_gated_wakeup_wakes_a_waiting_relay() {
    let h = Harness::new(include_str!("../fixtures/seeds/open_outbox.sql")).await;
    h.configure("open-outbox", &["user.*"]);
    let printed = h.cli(&["migrate", "--wakeup", "gated", "--print"]);
    assert!(
        printed.contains("pg_try_advisory_xact_lock_shared(hashtext('outbox-relay wake-up public.openoutbox_events'))"),
        "{printed}"
    );
    h.cli(&["migrate", "--wakeup", "gated"]);
    let mut relay = RelayProcess::spawn(
        h.dir.path(),
        "open-outbox-gated",
        &["run", "--wakeup", "gated", "--poll-interval", "1h"],
        &[],
    );
    for n in 1..=3 {
        open_outbox_event_is_delivered_without_polling(&h, n).await;
    }
    relay.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_infinite_created_at_on_a_seed_table_dead_letters_its_row_and_the_rest_flows() {
    let h = Harness::new(include_str!("../fixtures/seeds/open_outbox.sql")).await;
    h.configure("open-outbox", &["user.*"]);
    h.pg().batch_execute(
        "INSERT INTO openoutbox_events (event_id, event_type, partition_key, payload, created_at)
              VALUES ('00000000-0000-4000-8000-000000000001', 'user.signup', 'u1', convert_to('never', 'UTF8'), 'infinity');
         INSERT INTO openoutbox_events (event_id, event_type, partition_key, payload)
              VALUES ('00000000-0000-4000-8000-000000000002', 'user.signup', 'u2', convert_to('flows', 'UTF8'));",
    )
    .await
    .unwrap();
    let mut relay = h.relay("open-outbox");
    let messages = h.wait_messages(1).await;
    assert_eq!(messages[0].payload, "flows");
    h.wait_count(
        "the row with an infinite created_at dead, naming it",
        "SELECT count(*) FROM openoutbox_events WHERE status = 'DEAD' AND last_error LIKE '%created_at is infinity%'",
        1,
    )
    .await;
    relay.terminate().await;
}

/// Debezium's outbox table, as an application written for Debezium fills it: `migrate
/// --layout debezium` adds the relay's order column (numbering the rows already there) and
/// the optional columns; the application's inserts stay as they were. Events go to
/// Debezium's default topic `outbox.event.<aggregatetype>`, keyed by `aggregateid`, with the
/// `id` header, the trace context from `tracingspancontext`, in order per aggregate (also
/// within one transaction, where `timestamp` ties), and delivered rows are deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debezium_outbox_table_keeps_its_inserts_and_goes_to_debeziums_topics() {
    const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let h = Harness::new(include_str!("../fixtures/seeds/debezium.sql")).await;
    h._nats
        .add_stream(stream("DEBEZIUM", &["outbox.event.>"]))
        .await;
    // Written before the relay's migration.
    h.pg()
        .batch_execute(
            "INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload)
                  VALUES ('00000000-0000-4000-8000-000000000001', 'Order', 'order-1', 'OrderCreated', '{\"n\": 1}');",
        )
        .await
        .unwrap();
    std::fs::write(
        h.dir.path().join("outbox-relay.toml"),
        format!(
            "database_url = \"{}\"\nlayout = \"debezium\"\nhttp_addr = \"\"\npoll_interval = \"100ms\"\n[sinks.nats]\nuri = \"{}\"\n",
            h.url, h.nats_url
        ),
    )
    .unwrap();
    let printed = h.cli(&["migrate", "--print"]);
    assert!(printed.contains("ADD COLUMN relay_sequence"), "{printed}");
    // A row already there was most likely published by Debezium: refused, with the fix.
    let refused = command(h.dir.path(), &["migrate"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{stderr}");
    assert!(
        stderr.contains("most likely published already")
            && stderr.contains("ADD COLUMN relay_sequence bigserial"),
        "{stderr}"
    );
    // The operator chooses to relay it: numbering it is theirs.
    h.pg()
        .batch_execute("ALTER TABLE outboxevent ADD COLUMN relay_sequence bigserial")
        .await
        .unwrap();
    h.cli(&["migrate"]);
    // The application's own inserts, unchanged: three events of one aggregate in one
    // transaction (one `timestamp`), and a traced one.
    h.pg()
        .batch_execute(&format!(
            "BEGIN;
             INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload)
                  VALUES ('00000000-0000-4000-8000-00000000000f', 'Order', 'order-2', 'OrderCreated', '{{\"n\": 2}}');
             INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload)
                  VALUES ('00000000-0000-4000-8000-00000000000e', 'Order', 'order-2', 'OrderPaid', '{{\"n\": 3}}');
             INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload)
                  VALUES ('00000000-0000-4000-8000-00000000000d', 'Order', 'order-2', 'OrderShipped', '{{\"n\": 4}}');
             INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, timestamp, payload, tracingspancontext)
                  VALUES ('00000000-0000-4000-8000-000000000002', 'Customer', 'customer-7', 'CustomerRenamed', now(), '{{\"n\": 5}}',
                          E'#Thu Nov 26 03:20:00 UTC 2026\\ntraceparent={TRACEPARENT}\\n');
             COMMIT;"
        ))
        .await
        .unwrap();
    let mut relay = h.relay("debezium");
    let messages = eventually("5 messages on Debezium's topics", WAIT, || async {
        let mut stream = h.js.get_stream("DEBEZIUM").await.unwrap();
        let last = stream.info().await.unwrap().state.last_sequence;
        let mut out = Vec::new();
        for seq in 1..=last {
            out.push(stream.get_raw_message(seq).await.unwrap());
        }
        (out.len() >= 5).then_some(out)
    })
    .await;
    assert_eq!(messages.len(), 5);
    let header = |m: &async_nats::jetstream::message::StreamMessage, name: &str| {
        m.headers.get(name).map(|v| v.to_string())
    };
    let orders: Vec<_> = messages
        .iter()
        .filter(|m| m.subject.as_str() == "outbox.event.Order")
        .collect();
    let payloads: Vec<String> = orders
        .iter()
        .map(|m| String::from_utf8_lossy(&m.payload).to_string())
        .collect();
    assert_eq!(
        payloads,
        [r#"{"n": 1}"#, r#"{"n": 2}"#, r#"{"n": 3}"#, r#"{"n": 4}"#],
        "in order per aggregate, also within one transaction"
    );
    assert_eq!(
        header(orders[1], "id").as_deref(),
        Some("00000000-0000-4000-8000-00000000000f"),
        "the id header, as Debezium's router sets it"
    );
    assert_eq!(
        header(orders[1], "Nats-Msg-Id").as_deref(),
        Some("00000000-0000-4000-8000-00000000000f")
    );
    assert_eq!(
        header(orders[1], "Outbox-Partition-Key").as_deref(),
        Some("order-2")
    );
    assert_eq!(
        header(orders[2], "Outbox-Event-Type").as_deref(),
        Some("OrderPaid")
    );
    let customer = messages
        .iter()
        .find(|m| m.subject.as_str() == "outbox.event.Customer")
        .expect("the customer event");
    assert_eq!(
        header(customer, "traceparent").as_deref(),
        Some(TRACEPARENT)
    );
    h.wait_count(
        "delivered rows deleted",
        "SELECT count(*) FROM outboxevent",
        0,
    )
    .await;
    relay.terminate().await;
}

/// Most Debezium tutorials name the table `outbox`. `--outbox-table outbox` beside
/// `--layout debezium` was taken for no name (it equals the native default), so `migrate`
/// made an empty `outboxevent` and `run --drain` exited 0 having relayed nothing.
#[tokio::test]
async fn a_table_named_outbox_beside_a_seed_layout_is_the_one_used() {
    let url = outbox_testkit::fresh_pg_database().await;
    let dir = tempfile::tempdir().unwrap();
    let flags = [
        "--layout",
        "debezium",
        "--outbox-table",
        "outbox",
        "--database-url",
        &url,
    ];
    let migrate: Vec<&str> = ["migrate"].into_iter().chain(flags).collect();
    let migrated = command(dir.path(), &migrate);
    assert!(
        migrated.status.success(),
        "{}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    let db = support::pg(&url).await;
    let tables: Vec<String> = db
        .query(
            "SELECT table_name::text FROM information_schema.tables
              WHERE table_schema = 'public' AND table_name IN ('outbox', 'outboxevent')",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        tables,
        ["outbox"],
        "the table the user named, not the layout's"
    );
    db.execute(
        "INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload)
         VALUES (gen_random_uuid(), 'order', 'o-1', 'OrderCreated', '{\"n\": 1}')",
        &[],
    )
    .await
    .unwrap();
    let out = dir.path().join("events.jsonl");
    let sink = format!("file:{}", out.display());
    let run: Vec<&str> = ["run", "--drain", "--http-addr", "", "--sink", &sink]
        .into_iter()
        .chain(flags)
        .collect();
    let drained = command(dir.path(), &run);
    assert!(
        drained.status.success(),
        "{}",
        String::from_utf8_lossy(&drained.stderr)
    );
    let lines = support::read_lines(&out);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["event_type"], "OrderCreated");
}

/// A custom mapping's event id column that no unique index holds: two rows with one event
/// id went out as one event to every sink that drops duplicates by id, and the later one
/// was lost without a word. `check` now warns, naming the column and the index to create;
/// with the index it says nothing. On PostgreSQL and on MariaDB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_warns_when_no_unique_index_holds_the_event_id_column() {
    let mapping = r#"table = "keyed_events"
id = "id"
event_id = "eid"
destination = "topic"
payload = "body"
state = { kind = "rows" }
"#;
    let warning = "no unique index holds the event id column \"eid\"";
    let pg = Harness::new(
        "CREATE TABLE keyed_events (
             id bigserial PRIMARY KEY,
             eid uuid NOT NULL,
             topic text NOT NULL,
             body jsonb NOT NULL
         );
         CREATE UNIQUE INDEX keyed_events_partly ON keyed_events (eid) WHERE topic <> 'x';",
    )
    .await;
    pg.configure_mapping(mapping);
    pg.cli(&["migrate"]);
    let said = pg.check_store();
    assert!(said.contains(warning), "{said}");
    assert!(said.contains("CREATE UNIQUE INDEX"), "{said}");
    pg.pg()
        .batch_execute("CREATE UNIQUE INDEX keyed_events_eid ON keyed_events (eid)")
        .await
        .unwrap();
    let said = pg.check_store();
    assert!(!said.contains(warning), "{said}");

    let my = Harness::on(outbox_testkit::fresh_mysql_database().await).await;
    my.mysql(
        "CREATE TABLE keyed_events (
             id BIGINT AUTO_INCREMENT PRIMARY KEY,
             eid CHAR(36) NOT NULL,
             topic VARCHAR(255) NOT NULL,
             body JSON NOT NULL,
             UNIQUE KEY keyed_events_pair (eid, topic),
             UNIQUE KEY keyed_events_prefix (eid(8))
         )",
    )
    .await;
    my.configure_mapping(mapping);
    my.cli(&["migrate"]);
    let said = my.check_store();
    assert!(said.contains(warning), "{said}");
    my.mysql("CREATE UNIQUE INDEX keyed_events_eid ON keyed_events (eid)")
        .await;
    let said = my.check_store();
    assert!(!said.contains(warning), "{said}");
}
