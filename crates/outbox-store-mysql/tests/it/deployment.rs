//! Deployment faults at the store, against real MariaDB: a database that stops answering.

use std::time::Duration;

use outbox_store_mysql::MySqlStore;
use outbox_testkit::FaultProxy;

use crate::native_store;

/// A statement on a connection the network silently dropped waited for good: the claim
/// never ended, and the relay never claimed again while `/readyz` alone said so. Each
/// operation is now bounded, as PostgreSQL's are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_on_a_blackholed_connection_ends_with_a_retryable_error() {
    let url = outbox_testkit::fresh_mysql_database().await;
    native_store(&url, None).migrate().await.unwrap();
    let (proxy, proxied) = FaultProxy::start_for_url(&url).await.unwrap();
    let store: MySqlStore = native_store(&proxied, Some(Duration::from_secs(1)));
    outbox_testkit::conformance::a_claim_through_a_blackhole_fails_retryably(&store, &proxy).await;
}

/// The outbox in a database other than the URL's (`outbox_schema`, as `[[outboxes]]`
/// suggests to keep outboxes apart): `migrate` made the table in the URL's database, step 2
/// found no column to change there and was recorded done, and `run` then found no table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_makes_the_outbox_in_its_configured_database() {
    use mysql_async::prelude::Queryable;
    use outbox_core::OutboxStore;
    let url = outbox_testkit::fresh_mysql_database().await;
    let other = outbox_testkit::fresh_mysql_database().await;
    let other_db = mysql_async::Opts::from_url(&other)
        .unwrap()
        .db_name()
        .unwrap()
        .to_string();
    let store = store_over(
        &url,
        outbox_layout::Mapping::native_mysql(Some(&other_db), "outbox", false),
        "native",
    );
    store.migrate().await.unwrap();
    assert_eq!(
        store.verify().await.unwrap(),
        [],
        "the schema as run needs it"
    );
    let mut conn = mysql_async::Conn::from_url(url.as_str()).await.unwrap();
    let here: Option<String> = conn
        .query_first(
            "SELECT table_name FROM information_schema.tables
             WHERE table_schema = DATABASE() AND table_name = 'outbox'",
        )
        .await
        .unwrap();
    assert_eq!(here, None, "nothing made in the URL's database");
}

/// A role granted the outbox table alone (as the first release's grants were): the versions
/// table is not in its `information_schema`, so the schema read as unversioned, `run` said
/// to run `migrate`, and `migrate` (by an administrator) changed nothing. The read now says
/// what the role lacks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_that_cannot_read_the_versions_table_is_told_the_grant() {
    use mysql_async::prelude::Queryable;
    let url = outbox_testkit::fresh_mysql_database().await;
    native_store(&url, None).migrate().await.unwrap();
    let (mut admin, user, limited) = limited_user(&url, "outbox").await;
    let store: MySqlStore = native_store(&limited, None);
    let found = store.db().schema_found(store.sql()).await;
    admin
        .query_drop(format!("DROP USER '{user}'@'%'"))
        .await
        .unwrap();
    let refused = match found {
        Ok(found) => panic!("read as {found:?}"),
        Err(e) => e,
    };
    assert_eq!(refused.kind(), outbox_core::StoreErrorKind::Privilege);
    assert!(
        refused.to_string().contains("SELECT ON")
            && refused.to_string().contains("outbox_versions"),
        "{refused}"
    );
}

/// A custom mapping of UUIDs kept in `BINARY(16)`, MySQL's usual form. Every row read as
/// the zero UUID: rows went out as one event (one handle, one derived event id), its ack
/// matched no row, and it came back for ever while nothing else was delivered. `check` now
/// names the column and the fix; and in a CHAR(36) column, a row whose id is no UUID is set
/// aside with its key, while every other key flows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_the_relay_cannot_read_is_named_by_check_and_set_aside_by_claims() {
    use mysql_async::prelude::Queryable;
    use outbox_core::OutboxStore;
    let url = outbox_testkit::fresh_mysql_database().await;
    let mut admin = mysql_async::Conn::from_url(url.as_str()).await.unwrap();
    let table = |name: &str, id: &str| {
        format!(
            "CREATE TABLE {name} (
                 id {id} NOT NULL PRIMARY KEY,
                 type VARCHAR(255) NOT NULL,
                 message JSON NOT NULL,
                 isConsumed TINYINT(1) NOT NULL DEFAULT 0,
                 createdAt DATETIME(6) NOT NULL,
                 updatedAt DATETIME(6) NOT NULL,
                 deadAt DATETIME(6) NULL);"
        )
    };
    admin
        .query_drop(format!(
            "{}{}
             INSERT INTO binary_ids (id, type, message, createdAt, updatedAt) VALUES
                 (UNHEX(REPLACE(UUID(), '-', '')), 'orders', '{{}}', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6));
             INSERT INTO text_ids (id, type, message, createdAt, updatedAt) VALUES
                 ('not-a-uuid', 'payments', '{{\"n\": 1}}', '2026-01-01 00:00:01', UTC_TIMESTAMP(6)),
                 (UUID(), 'payments', '{{\"n\": 2}}', '2026-01-01 00:00:02', UTC_TIMESTAMP(6)),
                 (UUID(), 'orders', '{{\"n\": 3}}', '2026-01-01 00:00:03', UTC_TIMESTAMP(6))",
            table("binary_ids", "BINARY(16)"),
            table("text_ids", "CHAR(36)")
        ))
        .await
        .unwrap();
    let store = |table: &str| {
        let mapping = outbox_layout::Mapping {
            table: table.into(),
            id_type: outbox_layout::IdType::Uuid,
            dead_at: Some("deadAt".into()),
            seed: None,
            ..outbox_layout::Mapping::mysql_outbox_events(None, table)
        };
        store_over(&url, mapping, "custom")
    };
    let problems = store("binary_ids").verify().await.unwrap();
    assert!(
        problems
            .iter()
            .any(|p| p.severity() == outbox_core::store::Severity::Blocking
                && p.what.contains("\"id\" is binary")
                && p.fix.starts_with("map a CHAR(36) column")),
        "{problems:?}"
    );
    assert_eq!(
        claimed_keys(&store("text_ids")).await,
        ["orders"],
        "the unreadable row's key waits, the others flow"
    );
}

/// The MySQL seed's id is a BIGINT UNSIGNED. A row whose id is past 2^63 was read through
/// `CAST(… AS SIGNED)`, as a negative id naming no row: it was published, its ack matched
/// nothing, and it went out again about every second, for good. It is now set aside with
/// its key, naming the id and the fix, while other keys flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsigned_id_past_the_signed_range_is_set_aside_not_published_again_and_again() {
    use mysql_async::prelude::Queryable;
    let url = outbox_testkit::fresh_mysql_database().await;
    let mut admin = mysql_async::Conn::from_url(url.as_str()).await.unwrap();
    admin
        .query_drop(
            "CREATE TABLE outbox_events (
                 id BIGINT UNSIGNED NOT NULL AUTO_INCREMENT PRIMARY KEY,
                 type TINYINT UNSIGNED NOT NULL,
                 message MEDIUMTEXT NOT NULL,
                 isConsumed TINYINT(1) NOT NULL DEFAULT 0,
                 createdAt DATETIME NOT NULL,
                 updatedAt DATETIME NOT NULL);
             INSERT INTO outbox_events (id, type, message, createdAt, updatedAt) VALUES
                 (7, 2, '{\"n\": 1}', '2026-01-01 00:00:02', UTC_TIMESTAMP()),
                 (9223372036854775809, 1, '{\"n\": 2}', '2026-01-01 00:00:01', UTC_TIMESTAMP());",
        )
        .await
        .unwrap();
    let store = store_over(
        &url,
        outbox_layout::Mapping::mysql_outbox_events(None, "outbox_events"),
        "mysql-outbox-events",
    );
    store.migrate().await.unwrap();
    assert_eq!(
        claimed_keys(&store).await,
        ["2"],
        "the row past 2^63 is set aside, the other flows"
    );
}

/// A store over the table `mapping` names at `url`, with `layout`'s name.
fn store_over(url: &str, mapping: outbox_layout::Mapping, layout: &str) -> MySqlStore {
    MySqlStore::new(outbox_store_mysql::MySqlOptions {
        url: url.to_string(),
        mapping,
        layout: layout.into(),
        max_attempts: 10,
        pool_size: 2,
        nodes_table: None,
        operation_timeout: None,
    })
    .unwrap()
}

/// The keys of up to ten rows one claim of `store` takes, in claim order.
async fn claimed_keys(store: &MySqlStore) -> Vec<String> {
    use outbox_core::store::ClaimRequest;
    use outbox_core::OutboxStore;
    let request = ClaimRequest::new(outbox_core::NodeId::random(), 10, Duration::from_secs(30));
    let claimed = store.claim(request).await.unwrap();
    claimed
        .iter()
        .map(|c| c.ordering_key().to_string())
        .collect()
}

/// A server that takes no writes (a replica the URL points at, or a primary being demoted):
/// `check` passed, and each claim failed with a bare "--read-only option" error, retried
/// under the hint to check the host and port. `check` now says the server is read-only and
/// to point the URL at the primary, and the claims' refusals say the same, retried until a
/// failover behind the URL mends them. `read_only` is server-wide: this test runs alone
/// (`.config/nextest.toml`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_server_is_named_by_check_and_its_refusals_are_retried() {
    use mysql_async::prelude::Queryable;
    use outbox_core::store::ClaimRequest;
    use outbox_core::OutboxStore;
    let url = outbox_testkit::fresh_mysql_database().await;
    let admin_store = native_store(&url, None);
    admin_store.migrate().await.unwrap();
    admin_store
        .insert(vec![outbox_core::NewEvent {
            destination: "d".into(),
            event_type: "t".into(),
            payload: Some("1".into()),
            ..outbox_core::NewEvent::default()
        }])
        .await
        .unwrap();
    let (mut admin, user, limited) = limited_user(&url, "*").await;
    admin.query_drop("SET GLOBAL read_only = 1").await.unwrap();
    let store: MySqlStore = native_store(&limited, None);
    let problems = store.verify().await;
    let claimed = store
        .claim(ClaimRequest::new(
            outbox_core::NodeId::random(),
            10,
            Duration::from_secs(30),
        ))
        .await;
    admin
        .query_drop(format!("SET GLOBAL read_only = 0; DROP USER '{user}'@'%'"))
        .await
        .unwrap();
    let problems = problems.unwrap();
    assert!(
        problems
            .iter()
            .any(|p| p.severity() == outbox_core::store::Severity::Degraded
                && p.what.contains("takes no writes")
                && p.fix.contains("primary")),
        "{problems:?}"
    );
    let refused = match claimed {
        Ok(rows) => panic!("claimed {} rows on a read-only server", rows.len()),
        Err(e) => e,
    };
    assert!(refused.kind().is_retryable(), "{refused}");
    assert!(
        refused
            .to_string()
            .contains("point the relay's URL at the primary"),
        "{refused}"
    );
}

/// A user of the database at `url` granted reads and writes on its `tables` alone (`*`: all
/// of them), without the privileges that pass `read_only`: an administrator's connection,
/// the user's name (to drop) and a URL as the user.
async fn limited_user(url: &str, tables: &str) -> (mysql_async::Conn, String, String) {
    use mysql_async::prelude::Queryable;
    let opts = mysql_async::Opts::from_url(url).unwrap();
    let database = opts.db_name().unwrap().to_string();
    let user = format!("u{}", &database[2..14]);
    let mut admin = mysql_async::Conn::from_url(url).await.unwrap();
    admin
        .query_drop(format!(
            "CREATE USER '{user}'@'%' IDENTIFIED BY 'secret-pw';
             GRANT SELECT, INSERT, UPDATE, DELETE ON `{database}`.{tables} TO '{user}'@'%'"
        ))
        .await
        .unwrap();
    let limited = format!(
        "mysql://{user}:secret-pw@{}:{}/{database}",
        opts.ip_or_hostname(),
        opts.tcp_port()
    );
    (admin, user, limited)
}

/// `verify` said nothing of privileges: a role without DELETE passed `check`, published,
/// failed its ack, and under a restarting supervisor published the same rows again each
/// time. Each write the relay makes is now tried (matching no row) and a refusal named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_names_a_write_the_role_may_not_make() {
    use mysql_async::prelude::Queryable;
    use outbox_core::OutboxStore;
    let url = outbox_testkit::fresh_mysql_database().await;
    native_store(&url, None).migrate().await.unwrap();
    let (mut admin, user, limited) = limited_user(&url, "*").await;
    let lacking = |problems: &[outbox_core::store::Problem]| -> Vec<String> {
        problems
            .iter()
            .filter(|p| p.what.contains("lacks"))
            .map(|p| p.to_string())
            .collect()
    };
    let problems = native_store(&limited, None).verify().await.unwrap();
    assert!(lacking(&problems).is_empty(), "{problems:?}");
    let database = mysql_async::Opts::from_url(&url)
        .unwrap()
        .db_name()
        .unwrap()
        .to_string();
    admin
        .query_drop(format!(
            "REVOKE DELETE ON `{database}`.* FROM '{user}'@'%';
             GRANT SELECT, INSERT, UPDATE ON `{database}`.* TO '{user}'@'%'"
        ))
        .await
        .unwrap();
    let problems = native_store(&limited, None).verify().await.unwrap();
    let said = lacking(&problems);
    assert_eq!(said.len(), 1, "{problems:?}");
    assert!(
        said[0].contains("lacks DELETE on") && said[0].contains("GRANT DELETE"),
        "{said:?}"
    );
    admin
        .query_drop(format!("DROP USER '{user}'@'%'"))
        .await
        .unwrap();
}

/// `migrate` against a server that accepts connections and never answers (a host behind a
/// firewall that drops, a hung server): taking its connection waited for good, so a
/// Kubernetes migrate Job stalled without a word. The DDL may run long; reaching the server
/// is bounded as every other operation is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_against_a_server_that_never_answers_gives_up() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let (proxy, proxied) = FaultProxy::start_for_url(&url).await.unwrap();
    proxy.blackhole();
    let store: MySqlStore = native_store(&proxied, Some(Duration::from_secs(1)));
    // Only a guard against hanging forever.
    let outcome = tokio::time::timeout(Duration::from_secs(60), store.migrate())
        .await
        .expect("migrate must give up by itself");
    let error = outcome.expect_err("nothing can be migrated through a blackhole");
    assert_eq!(
        error.kind(),
        outbox_core::StoreErrorKind::Connection,
        "{}",
        error.report()
    );
}
