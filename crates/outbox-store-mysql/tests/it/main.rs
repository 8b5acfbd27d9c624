//! The integration tests of `outbox-store-mysql`: one module per subject, linked into one test
//! binary (`it`). One module's tests:
//! `cargo nextest run -p outbox-store-mysql -E 'binary(it) & test(/^MODULE::/)'`.

mod active_relay;
mod claims;
mod conformance;
mod deployment;
mod session;

/// The native layout's store on `url`, without a nodes table, its operations bound by
/// `operation_timeout` (`None`: the default).
fn native_store(
    url: &str,
    operation_timeout: Option<std::time::Duration>,
) -> outbox_store_mysql::MySqlStore {
    outbox_store_mysql::MySqlStore::new(outbox_store_mysql::MySqlOptions {
        url: url.into(),
        mapping: outbox_layout::Mapping::native_mysql(None, "outbox", false),
        layout: "native".into(),
        max_attempts: 10,
        pool_size: 2,
        nodes_table: None,
        operation_timeout,
    })
    .unwrap()
}
