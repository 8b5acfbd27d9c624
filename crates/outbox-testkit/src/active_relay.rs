//! The active relay of a mapped table (MySQL's native one included): what its engine does
//! once the session holding the table's lock ends, whichever database holds it.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use outbox_core::health::PUBLISH_GRACE;
use outbox_core::{NewEvent, NodeId, OutboxStore, Ownership, PublishErrorKind};
use outbox_engine::{EngineConfig, WakeMode};

use crate::eventually;
use crate::recording::RecordingPublisher;

/// The active relay whose lock's session ended (a killed backend or connection, a server
/// restart) went on publishing what it held, beside the relay that took the table over:
/// once its event in flight was answered, the key's next event went out from it too.
///
/// And a sink failing before that (another key's event, retried) kept it a failing
/// publisher on `/readyz` for minutes, a standby that publishes nothing: it forgets it.
///
/// `store` is a migrated, empty table's; `keep_active` runs its lock's keeper for the
/// ownership given; `take_over` ends the session holding the lock and returns once another
/// session holds it (one that waited for it first, so the relay cannot take it back).
pub async fn a_relay_whose_table_lock_ended_publishes_nothing_more_of_what_it_held(
    store: Arc<dyn OutboxStore>,
    keep_active: impl FnOnce(Arc<Ownership>) -> BoxFuture<'static, ()>,
    take_over: BoxFuture<'static, ()>,
) {
    let events =
        [("slow", "k"), ("next", "k"), ("refused", "other")].map(|(event_type, key)| NewEvent {
            destination: "d".into(),
            partition_key: Some(key.into()),
            event_type: event_type.into(),
            payload: Some("{}".into()),
            ..NewEvent::default()
        });
    let next = store.insert(events.to_vec()).await.unwrap()[1];
    let publisher = RecordingPublisher::new();
    publisher.hold("slow");
    publisher.fail("refused", usize::MAX, PublishErrorKind::Unavailable);
    let ownership = Ownership::new(1);
    let keeper = tokio::spawn(keep_active(ownership.clone()));
    let mut config = EngineConfig::new(NodeId::random());
    config.wake = WakeMode::FixedRate;
    config.settings.poll_interval = Duration::from_millis(50);
    config.settings.publish_timeout = Duration::from_secs(60);
    config.shared.ownership = Some(ownership.clone());
    let health = config.shared.health.clone();
    // Publish failures count once they have lasted the grace: looked at from then.
    let publish_trouble = move || {
        let then = std::time::Instant::now() + PUBLISH_GRACE;
        health
            .troubles(then, Duration::from_secs(3600))
            .iter()
            .any(|t| t.what == "publish")
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let engine = tokio::spawn(outbox_engine::run(
        store,
        Arc::new(publisher.clone()),
        config,
        async move {
            let _ = stopped.await;
        },
    ));
    eventually(
        "the first event in flight, another failing",
        Duration::from_secs(20),
        || async { (publisher.holding() > 0 && publish_trouble()).then_some(()) },
    )
    .await;
    take_over.await;
    eventually(
        "the relay sees its lock gone",
        Duration::from_secs(20),
        || async { ownership.held().is_empty().then_some(()) },
    )
    .await;
    eventually(
        "the standby forgets its publish failures",
        Duration::from_secs(20),
        || async { (!publish_trouble()).then_some(()) },
    )
    .await;
    // The event in flight is answered. Its key's next event is the other relay's now: it
    // went out here within milliseconds before the fix; a second is the bound of the look.
    publisher.release("slow");
    let look_until = tokio::time::Instant::now() + Duration::from_secs(1);
    while !publisher.attempts().contains(&next) && tokio::time::Instant::now() < look_until {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        !publisher.attempts().contains(&next),
        "the relay published an event it held after another relay took the table over"
    );
    let _ = stop.send(());
    engine.await.unwrap().unwrap();
    keeper.abort();
}
