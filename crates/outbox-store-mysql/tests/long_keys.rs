//! Ordering keys longer than the native table's column, against MariaDB. The key is not
//! indexed on MySQL (blocked keys are passed to the claim as values), so no index row limit
//! applies; the native column refuses what it cannot hold, and the error says what to do.

use mysql_async::prelude::Queryable;
use outbox_core::{NewEvent, OutboxStore};
use outbox_layout::Mapping;
use outbox_store_mysql::{MySqlOptions, MySqlStore};

async fn fresh_mysql_database() -> String {
    let admin = std::env::var("OUTBOX_TEST_MYSQL_URL").expect(
        "OUTBOX_TEST_MYSQL_URL is not set: run the tests through scripts/test.sh, \
         or `eval \"$(scripts/servers.sh start)\"` first",
    );
    let name = format!("t_{}", uuid::Uuid::new_v4().simple());
    let mut conn = mysql_async::Conn::from_url(&admin)
        .await
        .expect("connect to MariaDB");
    conn.query_drop(format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    conn.disconnect().await.unwrap();
    let cut = admin.rfind('/').unwrap();
    format!("{}/{name}", &admin[..cut])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_10kb_key_is_refused_at_insert_with_the_fix() {
    let url = fresh_mysql_database().await;
    let store = MySqlStore::new(MySqlOptions {
        url,
        mapping: Mapping::native_mysql(None, "outbox", false),
        layout: "native".into(),
        max_attempts: 20,
        pool_size: 2,
        nodes_table: Some("outbox_nodes".into()),
    })
    .unwrap();
    store.migrate().await.unwrap();
    let error = store
        .insert(vec![NewEvent {
            destination: "d".into(),
            partition_key: Some("k".repeat(10_240)),
            event_type: "t".into(),
            payload: Some("1".into()),
            ..NewEvent::default()
        }])
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("Data too long for column 'partition_key'")
            && error.contains("hash of a longer one")
            && error.contains("MODIFY partition_key text"),
        "{error}"
    );
    assert_eq!(
        store.backlog().await.unwrap().pending,
        0,
        "nothing half-written"
    );
}
