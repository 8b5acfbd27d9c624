//! The nodes table of the native layout on MySQL/MariaDB: membership for `status` and the
//! node id's uniqueness, as the PostgreSQL store keeps it.

use std::time::Duration;

use futures::FutureExt;
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Params, Pool, Row, Value};
use outbox_core::store::{
    Heartbeat, Heartbeated, Incarnation, NodeRecord, NodeRegistry, NodeRow, Registration,
    StoreFuture, StoreResult,
};
use outbox_core::time::{from_micros, millis};
use outbox_core::NodeId;

use crate::{bounded, col, db_error, int, text};

/// The nodes table, quoted and qualified, on the store's pool. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Nodes {
    pool: Pool,
    table: String,
    /// Each operation's bound ([`crate::bounded`]).
    operation_timeout: Duration,
}

fn named(pairs: Vec<(&str, Value)>) -> Params {
    Params::Named(
        pairs
            .into_iter()
            .map(|(k, v)| (k.as_bytes().to_vec(), v))
            .collect(),
    )
}

impl Nodes {
    /// `table` in `database` (the connection's own when `None`).
    pub(crate) fn new(
        pool: Pool,
        database: Option<&str>,
        table: &str,
        operation_timeout: Duration,
    ) -> Self {
        let table = match database {
            Some(d) => format!("`{d}`.`{table}`"),
            None => format!("`{table}`"),
        };
        Nodes {
            pool,
            table,
            operation_timeout,
        }
    }

    pub(crate) fn ddl(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} (\n    id varchar(64) PRIMARY KEY,\n    expiry datetime(6) NOT NULL\n) ENGINE=InnoDB;\n",
            self.table
        )
    }

    pub(crate) fn grants(&self, role: &str) -> String {
        format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO '{role}'@'%';\n",
            self.table
        )
    }

    async fn conn(&self, context: &str) -> StoreResult<Conn> {
        self.pool.get_conn().await.map_err(|e| db_error(context, e))
    }

    /// Deletes the rows of the nodes table that `condition` selects; the number deleted.
    fn delete_where(
        &self,
        context: &'static str,
        condition: &'static str,
        params: Params,
    ) -> StoreFuture<u64> {
        let store = self.clone();
        async move {
            let statement = format!("DELETE FROM {} WHERE {condition}", store.table);
            store.exec(context, &statement, params).await
        }
        .boxed()
    }

    async fn exec(&self, context: &str, statement: &str, params: Params) -> StoreResult<u64> {
        bounded(self.operation_timeout, context, async {
            let mut conn = self.conn(context).await?;
            conn.exec_drop(statement, params)
                .await
                .map_err(|e| db_error(context, e))?;
            Ok(conn.affected_rows())
        })
        .await
    }

    async fn rows(&self, context: &str, statement: &str, params: Params) -> StoreResult<Vec<Row>> {
        bounded(self.operation_timeout, context, async {
            let mut conn = self.conn(context).await?;
            conn.exec(statement, params)
                .await
                .map_err(|e| db_error(context, e))
        })
        .await
    }

    /// In one transaction: reads the node's row (its expiry in microseconds since the epoch,
    /// counted without the session's time zone, and whether it is live), and writes `now +
    /// ttl` if `may_write` accepts what it read. Returns the expiry read and the one written.
    /// Callers bound it ([`crate::bounded`]).
    async fn write_node_expiry(
        &self,
        context: &'static str,
        nodes: &str,
        node: &NodeId,
        ttl: Duration,
        may_write: impl FnOnce(Option<NodeRow>) -> bool,
    ) -> StoreResult<(Option<i64>, Option<i64>)> {
        let micros = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', expiry)";
        let id = || named(vec![("id", Value::from(node.0.as_str()))]);
        let mut conn = self.conn(context).await?;
        let mut tx = conn
            .start_transaction(mysql_async::TxOpts::default())
            .await
            .map_err(|e| db_error(context, e))?;
        let read: Option<Row> = tx
            .exec_first(
                format!(
                    "SELECT {micros}, expiry >= UTC_TIMESTAMP(6) FROM {nodes} WHERE id = :id FOR UPDATE"
                ),
                id(),
            )
            .await
            .map_err(|e| db_error(context, e))?;
        let current = read.map(|r| NodeRow {
            expiry: Incarnation(int(col(&r, 0)).unwrap_or(0)),
            live: int(col(&r, 1)).unwrap_or(0) != 0,
        });
        if !may_write(current) {
            tx.rollback().await.map_err(|e| db_error(context, e))?;
            return Ok((current.map(|c| c.expiry.0), None));
        }
        tx.exec_drop(
            format!(
                "INSERT INTO {nodes} (id, expiry) VALUES (:id, UTC_TIMESTAMP(6) + INTERVAL (:ttl * 1000) MICROSECOND)
                 ON DUPLICATE KEY UPDATE expiry = VALUES(expiry)"
            ),
            named(vec![
                ("id", Value::from(node.0.as_str())),
                ("ttl", Value::from(millis(ttl))),
            ]),
        )
        .await
        .map_err(|e| db_error(context, e))?;
        let written: Option<Row> = tx
            .exec_first(format!("SELECT {micros} FROM {nodes} WHERE id = :id"), id())
            .await
            .map_err(|e| db_error(context, e))?;
        tx.commit().await.map_err(|e| db_error(context, e))?;
        Ok((
            current.map(|c| c.expiry.0),
            written.and_then(|r| int(col(&r, 0))),
        ))
    }
}

impl NodeRegistry for Nodes {
    fn register(&self, node: NodeId, ttl: Duration) -> StoreFuture<Registration> {
        let store = self.clone();
        async move {
            let nodes = store.table.clone();
            let write =
                store.write_node_expiry("register", &nodes, &node, ttl, NodeRow::may_register);
            let (current, written) = bounded(store.operation_timeout, "register", write).await?;
            Ok(match (written, current) {
                (Some(w), _) => Registration::Registered(Incarnation(w)),
                (None, c) => Registration::Taken(Incarnation(c.unwrap_or(0))),
            })
        }
        .boxed()
    }

    fn heartbeat(&self, beat: Heartbeat) -> StoreFuture<Heartbeated> {
        let Heartbeat { node, last, ttl } = beat;
        let store = self.clone();
        async move {
            let nodes = store.table.clone();
            let write = store.write_node_expiry("heartbeat", &nodes, &node, ttl, |row| {
                NodeRow::may_heartbeat(row, last)
            });
            let (current, written) = bounded(store.operation_timeout, "heartbeat", write).await?;
            Ok(match written {
                Some(w) => Heartbeated::Pushed(Incarnation(w)),
                None => Heartbeated::RowShows(current.map(Incarnation)),
            })
        }
        .boxed()
    }

    fn remove_expired(&self) -> StoreFuture<u64> {
        self.delete_where(
            "remove expired nodes",
            "expiry < UTC_TIMESTAMP(6)",
            Params::Empty,
        )
    }

    fn deregister(&self, node: NodeId, last: Incarnation) -> StoreFuture<()> {
        self.delete_where(
            "deregister",
            "id = :id AND TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', expiry) = :last",
            named(vec![
                ("id", Value::from(node.0)),
                ("last", Value::from(last.0)),
            ]),
        )
        .map(|deleted| deleted.map(|_| ()))
        .boxed()
    }

    fn live_nodes(&self) -> StoreFuture<Vec<NodeRecord>> {
        let store = self.clone();
        async move {
            let nodes = &store.table;
            let rows = store
                .rows(
                    "list nodes",
                    &format!(
                        "SELECT id, CAST(UNIX_TIMESTAMP(expiry) * 1000000 AS SIGNED) FROM {nodes}
                          WHERE expiry >= UTC_TIMESTAMP(6) ORDER BY id"
                    ),
                    Params::Empty,
                )
                .await?;
            Ok(rows
                .into_iter()
                .map(|r| NodeRecord {
                    id: text(col(&r, 0)).unwrap_or_default(),
                    expiry: from_micros(int(col(&r, 1)).unwrap_or(0)),
                })
                .collect())
        }
        .boxed()
    }
}
