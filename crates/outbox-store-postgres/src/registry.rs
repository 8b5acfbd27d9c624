//! The cluster's tables: the nodes table (membership, heartbeats) and the partitions
//! table (leases and fencing epochs).

use std::time::Duration;

use futures::FutureExt;
use outbox_core::store::{
    ClaimMode, Heartbeat, Heartbeated, Incarnation, NodeRecord, NodeRegistry, PartitionRecord,
    PartitionRegistry, Registration, StoreFuture, Way,
};
use outbox_core::{NodeId, StoreError, StoreErrorKind};

use crate::{from_micros, millis, Inner, PgStore};
use outbox_core::store::StoreResult;

impl NodeRegistry for PgStore {
    fn register(&self, node: NodeId, ttl: Duration) -> StoreFuture<Registration> {
        let inner = self.inner.clone();
        async move {
            let ttl = millis(ttl);
            let rows =
                Self::coordinate(&inner, "register", &inner.sql.register, &[&node.0, &ttl]).await?;
            let Some(row) = rows.first() else {
                // Another session took the row after this statement's snapshot was taken.
                return Err(StoreError::new(
                    StoreErrorKind::Conflict,
                    "register: the node's row changed during registration",
                ));
            };
            let expiry = Incarnation(row.get(1));
            Ok(if row.get(0) {
                Registration::Registered(expiry)
            } else {
                Registration::Taken(expiry)
            })
        }
        .boxed()
    }

    fn heartbeat(&self, beat: Heartbeat) -> StoreFuture<Heartbeated> {
        let Heartbeat { node, last, ttl } = beat;
        let inner = self.inner.clone();
        async move {
            let ttl = millis(ttl);
            let rows = Self::coordinate(
                &inner,
                "heartbeat",
                &inner.sql.heartbeat,
                &[&node.0, &ttl, &last.0],
            )
            .await?;
            Ok(match rows.first() {
                Some(r) if r.get(1) => Heartbeated::Pushed(Incarnation(r.get(0))),
                row => Heartbeated::RowShows(row.map(|r| Incarnation(r.get(0)))),
            })
        }
        .boxed()
    }

    fn remove_expired(&self) -> StoreFuture<u64> {
        let inner = self.inner.clone();
        async move {
            Self::coordinate_execute(
                &inner,
                "remove expired nodes",
                &inner.sql.remove_expired,
                &[],
            )
            .await
        }
        .boxed()
    }

    fn deregister(&self, node: NodeId, last: Incarnation) -> StoreFuture<()> {
        let inner = self.inner.clone();
        async move {
            Self::coordinate_execute(
                &inner,
                "deregister",
                &inner.sql.deregister,
                &[&node.0, &last.0],
            )
            .await
            .map(|_| ())
        }
        .boxed()
    }

    fn live_nodes(&self) -> StoreFuture<Vec<NodeRecord>> {
        let inner = self.inner.clone();
        async move {
            let rows = Self::coordinate(&inner, "list nodes", &inner.sql.live_nodes, &[]).await?;
            Ok(rows
                .iter()
                .map(|r| NodeRecord {
                    id: r.get(0),
                    expiry: from_micros(r.get(1)),
                })
                .collect())
        }
        .boxed()
    }
}

impl PartitionRegistry for PgStore {
    fn nodes_behind(
        &self,
        node: NodeId,
        protocol: u32,
        oldest: u32,
    ) -> StoreFuture<Vec<(String, u32)>> {
        let inner = self.inner.clone();
        async move {
            let (protocol, oldest) = (protocol as i32, oldest as i32);
            let rows = Self::coordinate(
                &inner,
                "nodes of older protocols",
                &inner.sql.nodes_behind,
                &[&node.0, &protocol, &oldest],
            )
            .await?;
            Ok(rows
                .iter()
                .map(|r| (r.get::<_, String>(0), r.get::<_, i32>(1).max(0) as u32))
                .collect())
        }
        .boxed()
    }

    fn partition_peers(&self) -> StoreFuture<Vec<String>> {
        let inner = self.inner.clone();
        async move {
            let rows = Self::coordinate(&inner, "partition peers", &inner.sql.partition_peers, &[])
                .await?;
            Ok(rows.iter().map(|r| r.get(0)).collect())
        }
        .boxed()
    }

    fn claim_mode_peers(
        &self,
        node: NodeId,
        way: Way,
        announce: bool,
    ) -> StoreFuture<Vec<(String, Way)>> {
        let inner = self.inner.clone();
        async move {
            let count = way.partitions.map(|n| n.min(i32::MAX as u32) as i32);
            let rows = Self::coordinate(
                &inner,
                "nodes taking the events another way",
                &inner.sql.claim_mode_peers,
                &[&node.0, &way.mode.as_str(), &announce, &count],
            )
            .await?;
            Ok(rows
                .iter()
                .map(|r| {
                    let claims: Option<&str> = r.get(1);
                    let count: Option<i32> = r.get(2);
                    let way = Way {
                        mode: ClaimMode::from_stored(claims),
                        partitions: count.map(|n| n.max(0) as u32),
                    };
                    (r.get(0), way)
                })
                .collect())
        }
        .boxed()
    }

    /// The count, for a node that partitions keys: in a database whose keys hash alike.
    fn partition_count(&self) -> StoreFuture<u32> {
        let store = self.clone();
        async move {
            let (count, encoding) = store.stored_partitions().await?;
            keys_hash_alike(encoding.as_deref())?;
            Ok(count)
        }
        .boxed()
    }

    fn acquire(
        &self,
        node: NodeId,
        partitions: Vec<i32>,
        ttl: Duration,
    ) -> StoreFuture<Vec<(i32, i64)>> {
        let inner = self.inner.clone();
        async move {
            let ttl = millis(ttl);
            let rows = Self::coordinate(
                &inner,
                "acquire partitions",
                &inner.sql.acquire,
                &[&node.0, &partitions, &ttl],
            )
            .await?;
            Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
        }
        .boxed()
    }

    fn renew(&self, node: NodeId, held: Vec<(i32, i64)>, ttl: Duration) -> StoreFuture<Vec<i32>> {
        let inner = self.inner.clone();
        async move {
            let (partitions, epochs): (Vec<i32>, Vec<i64>) = held.into_iter().unzip();
            let ttl = millis(ttl);
            let rows = Self::coordinate(
                &inner,
                "renew partitions",
                &inner.sql.renew,
                &[&node.0, &partitions, &epochs, &ttl],
            )
            .await?;
            Ok(rows.iter().map(|r| r.get(0)).collect())
        }
        .boxed()
    }

    fn release_partitions(&self, node: NodeId, partitions: Vec<i32>) -> StoreFuture<u64> {
        let inner = self.inner.clone();
        async move {
            Self::coordinate_execute(
                &inner,
                "release partitions",
                &inner.sql.release_partitions,
                &[&node.0, &partitions],
            )
            .await
        }
        .boxed()
    }

    fn partitions(&self) -> StoreFuture<Vec<PartitionRecord>> {
        let inner = self.inner.clone();
        async move {
            let rows =
                Self::coordinate(&inner, "list partitions", &inner.sql.partitions, &[]).await?;
            Ok(rows
                .iter()
                .map(|r| PartitionRecord {
                    partition: r.get(0),
                    owner: r.get(1),
                    epoch: r.get(2),
                    lease_until: r.get::<_, Option<i64>>(3).map(from_micros),
                })
                .collect())
        }
        .boxed()
    }
}

impl PgStore {
    /// A query on the coordination pool (see `Inner::coordination`).
    async fn coordinate(
        inner: &Inner,
        context: &'static str,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> StoreResult<Vec<tokio_postgres::Row>> {
        Self::query_on(inner, &inner.coordination, context, sql, params).await
    }

    /// A statement on the coordination pool; the rows it affected.
    async fn coordinate_execute(
        inner: &Inner,
        context: &'static str,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> StoreResult<u64> {
        Self::execute_on(inner, &inner.coordination, context, sql, params).await
    }

    /// The partitions table's count (refused where the `partitions` setting contradicts
    /// it), and the database's encoding.
    pub(crate) async fn stored_partitions(
        &self,
    ) -> outbox_core::store::StoreResult<(u32, Option<String>)> {
        let inner = &self.inner;
        let rows =
            Self::coordinate(inner, "partition count", &inner.sql.partition_count, &[]).await?;
        let count = rows[0].get::<_, i64>(0).max(0) as u32;
        configured_partitions_hold(inner.tables.partition_count, count)?;
        partitions_numbered_from_zero(&inner.tables.partitions, rows[0].get(2))?;
        Ok((count, rows[0].get(1)))
    }
}

/// Refuses a partitions table whose numbers are not 0 to its count less one (`missing`, as
/// the partition count's statement lists them); see [`missing_partitions`].
pub(crate) fn partitions_numbered_from_zero(
    table: &outbox_core::ident::TableName,
    missing: Option<String>,
) -> Result<(), StoreError> {
    match missing_partitions(table, missing) {
        None => Ok(()),
        Some((what, fix)) => Err(
            StoreError::new(StoreErrorKind::Config, format!("{what}; {fix}"))
                .with_hint("a partitions table numbers its rows from 0, with no gap"),
        ),
    }
}

/// What is wrong, and its fix, when the partitions table lacks the numbers `missing`: keys
/// hash modulo the count, so the keys of a missing number were owned by no node. One node
/// holding every row relayed them all; a second node's first hand-over stalled those keys
/// for good, with `/readyz` and `check` green.
pub(crate) fn missing_partitions(
    table: &outbox_core::ident::TableName,
    missing: Option<String>,
) -> Option<(String, String)> {
    let missing = missing?;
    let first = missing.split(", ").next().unwrap_or("0").to_string();
    Some((
        format!(
            "the partitions table {table} lacks partition(s) {missing}: keys hash to every \
             number from 0 to its count less one, and a missing one's keys would be owned by \
             no node"
        ),
        format!(
            "put the rows back: INSERT INTO {table} (partition) VALUES ({first}), one per \
             missing number"
        ),
    ))
}

/// Refuses partitions over a database whose encoding is not UTF-8. The database hashes a
/// key's bytes in its own encoding, the relay the UTF-8 bytes it reads: a key with a
/// character beyond ASCII fell in one partition for the claims and another for the lanes
/// and the hand-over, and a node holding only the first dropped its rows at every claim,
/// for good, or one holding both let a moved partition's key go out of order.
pub(crate) fn keys_hash_alike(encoding: Option<&str>) -> Result<(), StoreError> {
    match encoding {
        // SQL_ASCII keeps the client's UTF-8 bytes as they came.
        None | Some("UTF8" | "SQL_ASCII") => Ok(()),
        Some(other) => Err(StoreError::new(
            StoreErrorKind::Config,
            format!(
                "the database's encoding is {other}, and ordered relays partition keys by a hash \
                 that the database computes over the key in its encoding and the relay over the \
                 key in UTF-8: keys beyond ASCII would belong to two partitions; keep the outbox \
                 in a database created with ENCODING 'UTF8', or run with --ordering none"
            ),
        )
        .with_hint("ordered relays need a UTF-8 database")),
    }
}

/// Refuses a `partitions` setting that the partitions table contradicts: `migrate` makes
/// the table once and never changes its count, so a count given later would be ignored.
/// The default stands for "not given" and follows the table.
pub(crate) fn configured_partitions_hold(configured: u32, stored: u32) -> Result<(), StoreError> {
    if configured == outbox_core::partition::DEFAULT_PARTITIONS
        || stored == 0
        || configured == stored
    {
        return Ok(());
    }
    Err(StoreError::new(
        StoreErrorKind::Config,
        format!(
            "partitions = {configured} is set, but the partitions table holds {stored}: the \
             count is fixed when `migrate` first makes the table, and a relay running with \
             another count would split keys differently from its peers; remove the setting \
             (or set it to {stored})"
        ),
    )
    .with_hint("the partition count cannot be changed on an existing outbox"))
}
