//! Every statement the builder writes, for each preset in each dialect, held to
//! `snapshots/statements.sql` (see `outbox_testkit::snapshot`).

use std::fmt::Write;

use outbox_testkit::snapshot::assert_snapshot;

use crate::memory::RowId;
use crate::params::Params;
use crate::sql::{Failure, Sql};
use crate::{Dialect, Mapping};

fn layouts() -> Vec<(&'static str, Mapping)> {
    vec![
        ("adbc", Mapping::adbc("public", "outbox")),
        (
            "open_outbox",
            Mapping::open_outbox("public", "openoutbox_events"),
        ),
        ("export", Mapping::export("public", "event")),
        ("debezium", Mapping::debezium("public", "outboxevent")),
        (
            "mysql_outbox_events",
            Mapping::mysql_outbox_events(None, "outbox_events"),
        ),
        (
            "native_mysql",
            Mapping::native_mysql(Some("app"), "outbox", false),
        ),
        (
            "native_mysql retained",
            Mapping::native_mysql(None, "outbox", true),
        ),
    ]
}

fn statements(sql: &Sql) -> Vec<(&'static str, Option<String>)> {
    let (ids, node, lease, n) = match sql.dialect {
        Dialect::Postgres => ("= ANY($ids)", "$node", "$lease", "$n"),
        Dialect::MySql => ("IN (1, 2)", ":node", ":lease", ":n"),
    };
    let failure = Failure {
        id: ":id".into(),
        node: node.into(),
        attempts: ":attempts".into(),
        error: ":error".into(),
    };
    let mut params = Params::new(sql.dialect);
    let columns = sql.mapping.columns();
    vec![
        ("table", Some(sql.table())),
        ("dead_table", Some(sql.dead_table())),
        ("now", Some(sql.now().into())),
        ("id_expr", Some(sql.id_expr())),
        ("key_expr", Some(sql.key_expr())),
        ("select_list", Some(sql.select_list())),
        ("pending", Some(sql.pending())),
        ("dead", Some(sql.dead())),
        ("delivered", sql.delivered()),
        ("claimable", Some(sql.claimable())),
        ("order_by", Some(sql.order_by())),
        ("claim_set", Some(sql.claim_set(node, lease).join(", "))),
        ("fence", Some(sql.fence(node))),
        ("ack", Some(sql.ack(ids, 2, node))),
        (
            "retry_set",
            Some(sql.retry_set(":attempts", ":error", ":delay").join(", ")),
        ),
        (
            "dead_set",
            Some(sql.dead_set(":attempts", ":error").join(", ")),
        ),
        ("release", sql.release(ids, node)),
        (
            "release unheld",
            sql.release_unheld(Some(":not_held"), node),
        ),
        ("extend", sql.extend(ids, node, lease)),
        ("reap to pending", sql.reap(false, ":max", ":all", lease)),
        ("reap to dead", sql.reap(true, ":max", ":all", lease)),
        ("stats", Some(sql.stats(false))),
        ("stats by destination", Some(sql.stats(true))),
        ("dead_list", Some(sql.dead_list(" AND :filter", n))),
        ("event", Some(sql.event(":condition"))),
        ("dead_retry", sql.dead_retry(":condition")),
        ("destination_text", Some(sql.destination_text())),
        ("delivered_time", sql.delivered_time()),
        ("dead_time", sql.dead_time()),
        ("created_at", sql.created_at()),
        ("replay_set", Some(sql.replay_set().join(", "))),
        ("dead_table_ddl", sql.dead_table_ddl()),
        ("ddl", sql.ddl()),
        ("grants", Some(sql.grants("relay"))),
        (
            "claim_select",
            Some(sql.claim_select(":condition", n, false)),
        ),
        (
            "claim_select locking",
            Some(sql.claim_select(":condition", n, true)),
        ),
        (
            "claim_and_mark",
            Some(sql.claim_and_mark(":condition", n, node, lease)),
        ),
        (
            "claim_order_column",
            Some(sql.claim_order_column().to_string()),
        ),
        ("at_micros", Some(sql.at_micros(":micros"))),
        ("destination_is", Some(sql.destination_is(":destination"))),
        (
            "delivered_between",
            sql.delivered_between(":since", ":until"),
        ),
        ("delivered_before", sql.delivered_before(":before")),
        ("dead_before", sql.dead_before(":before")),
        (
            "release_unheld",
            sql.release_unheld(Some(":not_held"), ":node"),
        ),
        ("count", Some(sql.count(":condition"))),
        ("pick", Some(sql.pick(":condition", n))),
        ("delete", Some(sql.delete(ids))),
        ("delete_dead_records", Some(sql.delete_dead_records(ids))),
        ("retry", sql.retry(&failure, ":delay")),
        ("dead_letter", Some(sql.dead_letter(&failure))),
        ("columns_query", Some(sql.columns_query(&mut params))),
        (
            "column_length_query",
            Some(sql.column_length_query("last_error", &mut params)),
        ),
        (
            "unique_column_query",
            Some(sql.unique_column_query("event_id", &mut params)),
        ),
        ("insert", Some(sql.insert(&columns[..2]))),
        (
            "not_in_ids",
            Some(params.not_in_ids(
                &sql.id_column(),
                &[RowId::Integer(1), RowId::Integer(2)],
                sql.mapping.id_type,
            )),
        ),
        (
            "not_in_texts",
            Some(params.not_in_texts(&sql.key_expr(), vec!["a".into(), "b".into()])),
        ),
    ]
}

#[test]
fn every_statement_of_every_preset_in_each_dialect() {
    let mut out = String::new();
    for (layout, mapping) in layouts() {
        for dialect in [Dialect::Postgres, Dialect::MySql] {
            let sql = Sql::new(mapping.clone(), dialect).unwrap();
            for (name, statement) in statements(&sql) {
                let statement = statement.unwrap_or_else(|| "(none)".into());
                writeln!(out, "-- {layout}, {dialect:?}: {name}\n{statement}\n").unwrap();
            }
        }
    }
    assert_snapshot(env!("CARGO_MANIFEST_DIR"), "statements.sql", &out);
}
