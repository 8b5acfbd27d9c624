//! Cluster membership through the database's nodes table, as the Ably connector keeps it.
//!
//! A node registers by writing its row with `expiry = now + heartbeat_timeout`, pushes the
//! expiry forward every `heartbeat_interval`, deletes rows that expired (nodes that died),
//! and deletes its own row when it leaves. Partition ownership builds on this (issue 4).

use std::sync::Arc;
use std::time::Duration;

use outbox_core::store::NodeRegistry;
use outbox_core::{NodeId, StoreError};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// How often a node pushes its expiry forward.
pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(2);
/// How long a node stays listed without a heartbeat: five missed beats.
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);

pub const CLUSTER_NODES: &str = "outbox_cluster_nodes";

#[derive(Clone, Debug)]
pub struct MembershipConfig {
    pub node: NodeId,
    pub heartbeat_interval: Duration,
    pub heartbeat_timeout: Duration,
}

/// This node's live membership; [`Membership::leave`] ends it.
pub struct Membership {
    registry: Arc<dyn NodeRegistry>,
    node: NodeId,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Membership {
    /// Registers the node (failing if the database refuses) and starts heartbeating.
    pub async fn join(
        registry: Arc<dyn NodeRegistry>,
        config: MembershipConfig,
    ) -> Result<Self, StoreError> {
        registry
            .heartbeat(config.node.clone(), config.heartbeat_timeout)
            .await?;
        tracing::info!(node = %config.node, "registered in the nodes table");
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn({
            let registry = registry.clone();
            let config = config.clone();
            async move {
                let mut ticker = tokio::time::interval(config.heartbeat_interval);
                ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                ticker.tick().await;
                loop {
                    tokio::select! {
                        _ = ticker.tick() => beat(&*registry, &config).await,
                        _ = stopped.changed() => return,
                    }
                }
            }
        });
        Ok(Membership {
            registry,
            node: config.node,
            stop,
            task,
        })
    }

    /// Stops heartbeating and removes this node's row.
    pub async fn leave(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
        match tokio::time::timeout(
            Duration::from_secs(5),
            self.registry.deregister(self.node.clone()),
        )
        .await
        {
            Ok(Ok(())) => tracing::info!(node = %self.node, "deregistered"),
            Ok(Err(e)) => {
                tracing::warn!(error = %e.report(), "could not deregister; the row expires by itself")
            }
            Err(_) => tracing::warn!("deregistering timed out; the row expires by itself"),
        }
    }
}

async fn beat(registry: &dyn NodeRegistry, config: &MembershipConfig) {
    if let Err(e) = registry
        .heartbeat(config.node.clone(), config.heartbeat_timeout)
        .await
    {
        tracing::warn!(error = %e.report(), "heartbeat failed");
        return;
    }
    match registry.remove_expired().await {
        Ok(0) => {}
        Ok(n) => tracing::info!(nodes = n, "removed expired nodes"),
        Err(e) => tracing::warn!(error = %e.report(), "could not remove expired nodes"),
    }
    if let Ok(nodes) = registry.live_nodes().await {
        metrics::gauge!(CLUSTER_NODES).set(nodes.len() as f64);
    }
}
