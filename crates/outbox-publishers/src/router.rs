//! Routes events to sinks by destination glob, renders their target, enforces size limits,
//! and reassembles one outcome per event in batch order.

use std::collections::HashMap;
use std::sync::Arc;

use futures::future::{join_all, BoxFuture};
use futures::FutureExt;
use globset::{Glob, GlobMatcher};
use outbox_core::{
    Event, MessagingDestination, Outcome, PublishError, PublishErrorKind, Publisher,
};

use crate::cloudevents::{CloudEvents, ContentMode};
use crate::sink::{Routed, Sink};
use crate::template::Template;

/// One route: destinations matching `glob` go to `sink`, at `target`, as CloudEvents when
/// `cloudevents` says so.
pub struct Route {
    pub pattern: String,
    matcher: GlobMatcher,
    pub sink: String,
    pub target: Template,
    pub cloudevents: Option<CloudEvents>,
}

impl Route {
    pub fn new(pattern: &str, sink: &str, target: Template) -> Result<Self, String> {
        let matcher = Glob::new(pattern)
            .map_err(|e| format!("invalid destination pattern {pattern:?}: {e}"))?
            .compile_matcher();
        Ok(Route {
            pattern: pattern.to_string(),
            matcher,
            sink: sink.to_string(),
            target,
            cloudevents: None,
        })
    }

    /// Whether the configuration itself names `target`: the route's target has no
    /// placeholder, or its pattern is exactly `destination` (no glob). Only then may an
    /// event reach a broker's own API.
    fn names_literally(&self, destination: &str, target: &str) -> bool {
        let glob = self.pattern.contains(['*', '?', '[', '{', '\\']);
        self.target.literal() == Some(target) || (!glob && self.pattern == destination)
    }

    /// The same route, its events sent as CloudEvents.
    pub fn with_cloudevents(self, cloudevents: CloudEvents) -> Self {
        Route {
            cloudevents: Some(cloudevents),
            ..self
        }
    }
}

/// The refusal of an event whose target is a broker's own API (an event's author could
/// otherwise delete a stream with the relay's credentials): permanent, so it is dead-lettered.
fn reserved(destination: &str, target: &str, what: &str) -> PublishError {
    PublishError::new(
        PublishErrorKind::Rejected,
        format!(
            "destination {destination:?} would be published to {target:?}, which is {what}, \
             not a place for events: refused unless configured; if it is meant, add a \
             [[routes]] entry whose destinations is exactly {destination:?} (or whose target \
             is exactly {target:?})"
        ),
    )
}

/// The publisher the engine sees.
pub struct Router {
    sinks: HashMap<String, Arc<dyn Sink>>,
    routes: Vec<Route>,
}

impl Router {
    pub fn new(sinks: Vec<(String, Arc<dyn Sink>)>, routes: Vec<Route>) -> Result<Self, String> {
        let sinks: HashMap<String, Arc<dyn Sink>> = sinks.into_iter().collect();
        for route in &routes {
            let Some(sink) = sinks.get(&route.sink) else {
                let mut names: Vec<_> = sinks.keys().cloned().collect();
                names.sort();
                return Err(format!(
                    "route {:?} names sink {:?}, which is not configured (configured: {})",
                    route.pattern,
                    route.sink,
                    names.join(", ")
                ));
            };
            let binary = route
                .cloudevents
                .as_ref()
                .is_some_and(|c| c.mode == ContentMode::Binary);
            if binary && sink.cloudevents_binding().is_none() {
                return Err(format!(
                    "route {:?} asks for CloudEvents in binary mode, but sink {:?} ({}) has no \
                     CloudEvents binding for binary mode (Kafka, NATS, RabbitMQ and webhooks do): \
                     use cloudevents = \"structured\"",
                    route.pattern,
                    route.sink,
                    sink.describe()
                ));
            }
        }
        Ok(Router { sinks, routes })
    }

    /// One sink for every destination.
    pub fn single(name: &str, sink: Arc<dyn Sink>) -> Self {
        let route = Route::new("*", name, Template::destination()).expect("valid glob");
        Router::new(vec![(name.to_string(), sink)], vec![route]).expect("route names the sink")
    }

    fn route(&self, event: &Event) -> Option<&Route> {
        self.routes
            .iter()
            .find(|r| r.matcher.is_match(&event.destination))
    }
}

impl Publisher for Router {
    fn messaging_destination(&self, event: &Event) -> Option<MessagingDestination> {
        let route = self.route(event)?;
        Some(MessagingDestination {
            system: self.sinks[&route.sink].messaging_system()?,
            name: route.target.render(event),
        })
    }

    fn describe(&self) -> String {
        // Each sink describes itself through the one redactor; this is the last guard.
        let mut names: Vec<String> = self
            .sinks
            .values()
            .map(|s| outbox_core::redact::redact_url(&s.describe()))
            .collect();
        names.sort();
        names.join(", ")
    }

    /// A key's run only where every event goes to one sink that stores a prefix of each
    /// send: with two sinks, one could store a key's later event while the other fails an
    /// earlier one.
    fn max_events_per_key(&self) -> usize {
        match self.sinks.values().collect::<Vec<_>>()[..] {
            [sink] if sink.stores_a_prefix() => usize::MAX,
            _ => 1,
        }
    }

    /// More than one sink, or a sink whose destinations each have a receiver of their own.
    fn has_send_groups(&self) -> bool {
        self.sinks.len() > 1 || self.sinks.values().any(|s| s.sends_by_destination())
    }

    /// The event's sink, and its destination where that sink sends each apart. An event no
    /// route takes fails at once, in a group of its own.
    fn send_group(&self, event: &Event) -> u64 {
        use std::hash::{Hash, Hasher};
        let Some(route) = self.route(event) else {
            return u64::MAX;
        };
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        route.sink.hash(&mut hasher);
        if self.sinks[&route.sink].sends_by_destination() {
            event.destination.hash(&mut hasher);
        }
        hasher.finish()
    }

    fn publish(&self, batch: Vec<Arc<Event>>) -> BoxFuture<'static, Vec<Outcome>> {
        let mut outcomes: Vec<Option<Outcome>> = (0..batch.len()).map(|_| None).collect();
        let run_keys: Option<Vec<String>> = (self.max_events_per_key() > 1)
            .then(|| batch.iter().map(|e| e.ordering_key().to_string()).collect());
        // sink name → (positions in the batch, routed events)
        let mut groups: HashMap<&str, (Vec<usize>, Vec<Routed>)> = HashMap::new();
        for (i, event) in batch.into_iter().enumerate() {
            let Some(route) = self.route(&event) else {
                outcomes[i] = Some(Err(PublishError::new(
                    PublishErrorKind::NoRoute,
                    format!(
                        "no route matches destination {:?}; add a [[routes]] entry for it",
                        event.destination
                    ),
                )));
                continue;
            };
            let sink = &self.sinks[&route.sink];
            let (event, cloudevents) = match &route.cloudevents {
                None => (event, None),
                Some(settings) => {
                    match crate::cloudevents::shape(&event, settings, sink.cloudevents_binding()) {
                        Ok(shaped) => (shaped, Some(settings.mode)),
                        Err(e) => {
                            outcomes[i] = Some(Err(e));
                            continue;
                        }
                    }
                }
            };
            if let Some(limit) = sink.max_message_bytes() {
                if event.payload.len() > limit {
                    outcomes[i] = Some(Err(PublishError::new(
                        PublishErrorKind::TooLarge,
                        format!(
                            "payload of {} bytes exceeds the {} byte limit of sink {}",
                            event.payload.len(),
                            limit,
                            route.sink
                        ),
                    )));
                    continue;
                }
            }
            // Only for its report: a malformed traceparent is said once, whatever the sink.
            let _ = crate::trace::trace_context(&event);
            let target = route.target.render(&event);
            if let Some(what) = sink.reserved_target(&target) {
                if !route.names_literally(&event.destination, &target) {
                    outcomes[i] = Some(Err(reserved(&event.destination, &target, what)));
                    continue;
                }
            }
            let group = groups.entry(route.sink.as_str()).or_default();
            group.0.push(i);
            group.1.push(Routed {
                event,
                target,
                cloudevents,
            });
        }
        if let Some(keys) = &run_keys {
            hold_back_after_failures(keys, &mut outcomes, &mut groups);
        }
        let sends: Vec<_> = groups
            .into_iter()
            .map(|(name, (positions, routed))| {
                let n = routed.len();
                let send = self.sinks[name].send(routed);
                async move { (positions, n, send.await) }
            })
            .collect();
        async move {
            for (positions, n, results) in join_all(sends).await {
                let mut results = results.into_iter();
                for (k, i) in positions.into_iter().enumerate() {
                    outcomes[i] = Some(results.next().unwrap_or_else(|| {
                        Err(PublishError::new(
                            PublishErrorKind::BrokerFailure,
                            format!("sink returned fewer outcomes than events ({k} of {n})"),
                        ))
                    }));
                }
            }
            outcomes
                .into_iter()
                .map(|o| o.expect("every event got an outcome"))
                .collect()
        }
        .boxed()
    }

    fn health(&self) -> BoxFuture<'static, Result<(), PublishError>> {
        let checks: Vec<_> = self.sinks.values().map(|s| s.health()).collect();
        async move {
            for result in join_all(checks).await {
                result?;
            }
            Ok(())
        }
        .boxed()
    }

    /// The health of the event's sink alone: another sink down says nothing of it. An event
    /// no route takes fails for want of one, never for its destination.
    fn health_of(&self, event: &Event) -> BoxFuture<'static, Result<(), PublishError>> {
        match self.route(event) {
            Some(route) => self.sinks[&route.sink].health(),
            None => async { Ok(()) }.boxed(),
        }
    }

    fn close(&self) -> BoxFuture<'static, ()> {
        let closes: Vec<_> = self.sinks.values().map(|s| s.close()).collect();
        async move {
            join_all(closes).await;
        }
        .boxed()
    }
}

/// Keeps [`Publisher::max_events_per_key`]'s promise for what the router itself refused:
/// once an event of a key failed here (no route, say, which is retried), no later event of
/// that key in the batch reaches the sink. Those fail too, and go out again after it.
fn hold_back_after_failures(
    keys: &[String],
    outcomes: &mut [Option<Outcome>],
    groups: &mut HashMap<&str, (Vec<usize>, Vec<Routed>)>,
) {
    let mut failed_at: HashMap<&str, usize> = HashMap::new();
    for (i, outcome) in outcomes.iter().enumerate() {
        if let Some(Err(_)) = outcome {
            failed_at.entry(&keys[i]).or_insert(i);
        }
    }
    if failed_at.is_empty() {
        return;
    }
    for (positions, routed) in groups.values_mut() {
        let kept: Vec<(usize, Routed)> = std::mem::take(positions)
            .into_iter()
            .zip(std::mem::take(routed))
            .filter(|(i, _)| {
                let held_back = failed_at.get(keys[*i].as_str()).is_some_and(|f| f < i);
                if held_back {
                    outcomes[*i] = Some(Err(PublishError::new(
                        PublishErrorKind::NotSent,
                        "an earlier event of its key failed in this batch",
                    )));
                }
                !held_back
            })
            .collect();
        (*positions, *routed) = kept.into_iter().unzip();
    }
    groups.retain(|_, (positions, _)| !positions.is_empty());
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::{Disposition, Payload};
    use std::sync::Mutex;

    /// Records (target, sequence id) and confirms everything.
    #[derive(Default)]
    struct Recorder(Mutex<Vec<(String, i64)>>);

    impl Sink for Recorder {
        fn describe(&self) -> String {
            "recorder".into()
        }
        fn send(&self, batch: Vec<Routed>) -> BoxFuture<'static, Vec<Outcome>> {
            let mut seen = self.0.lock().unwrap();
            let outcomes = batch
                .iter()
                .map(|r| {
                    seen.push((r.target.clone(), r.event.sequence_id));
                    Ok(())
                })
                .collect();
            async move { outcomes }.boxed()
        }
        fn health(&self) -> BoxFuture<'static, Result<(), PublishError>> {
            async { Ok(()) }.boxed()
        }
        fn max_message_bytes(&self) -> Option<usize> {
            Some(10)
        }
        fn reserved_target(&self, target: &str) -> Option<&'static str> {
            target.starts_with("$API.").then_some("the API")
        }
    }

    fn event(seq: i64, destination: &str, payload: &str) -> Arc<Event> {
        let payload = Payload::Bytes(payload.as_bytes().to_vec());
        Arc::new(Event::new(
            seq,
            uuid::Uuid::nil(),
            destination,
            "created",
            payload,
        ))
    }

    #[tokio::test]
    async fn routes_by_first_matching_glob_and_keeps_outcome_order() {
        let (a, b) = (Arc::new(Recorder::default()), Arc::new(Recorder::default()));
        let router = Router::new(
            vec![
                ("a".into(), a.clone() as Arc<dyn Sink>),
                ("b".into(), b.clone() as Arc<dyn Sink>),
            ],
            vec![
                Route::new(
                    "orders.*",
                    "a",
                    Template::parse("events.{destination}.{event_type}").unwrap(),
                )
                .unwrap(),
                Route::new("posts:*", "b", Template::destination()).unwrap(),
            ],
        )
        .unwrap();
        let outcomes = router
            .publish(vec![
                event(1, "orders.eu", "1"),
                event(2, "posts:7", "2"),
                event(3, "invoices", "3"),
                event(4, "orders.us", "this is too large"),
            ])
            .await;
        assert!(outcomes[0].is_ok() && outcomes[1].is_ok());
        let unrouted = outcomes[2].as_ref().unwrap_err();
        assert!(matches!(unrouted.disposition(), Disposition::Retry { .. }));
        assert!(unrouted
            .to_string()
            .contains("no route matches destination \"invoices\""));
        let large = outcomes[3].as_ref().unwrap_err();
        assert_eq!(large.disposition(), Disposition::Permanent);
        assert_eq!(
            *a.0.lock().unwrap(),
            vec![("events.orders.eu.created".to_string(), 1)]
        );
        assert_eq!(*b.0.lock().unwrap(), vec![("posts:7".to_string(), 2)]);
    }

    /// The health of an event's destination is its own sink's: a sink down beside it says
    /// nothing of the event (the engine asks when one event keeps failing alone), and an
    /// event with no route fails for want of one, not for a destination down.
    #[tokio::test]
    async fn an_events_health_is_its_own_sinks() {
        struct Down;
        impl Sink for Down {
            fn describe(&self) -> String {
                "down".into()
            }
            fn send(&self, batch: Vec<Routed>) -> BoxFuture<'static, Vec<Outcome>> {
                let n = batch.len();
                async move { (0..n).map(|_| Ok(())).collect() }.boxed()
            }
            fn health(&self) -> BoxFuture<'static, Result<(), PublishError>> {
                async { Err(PublishError::new(PublishErrorKind::Unavailable, "down")) }.boxed()
            }
        }
        let router = Router::new(
            vec![
                ("up".into(), Arc::new(Recorder::default()) as Arc<dyn Sink>),
                ("down".into(), Arc::new(Down) as Arc<dyn Sink>),
            ],
            vec![
                Route::new("orders.*", "up", Template::destination()).unwrap(),
                Route::new("posts.*", "down", Template::destination()).unwrap(),
            ],
        )
        .unwrap();
        assert!(router.health().await.is_err(), "the relay's: any sink down");
        assert!(router.health_of(&event(1, "orders.eu", "x")).await.is_ok());
        assert!(router.health_of(&event(2, "posts.a", "x")).await.is_err());
        assert!(router.health_of(&event(3, "invoices", "x")).await.is_ok());
    }

    /// Events of different sinks, and of a webhook's different destinations, go in batches
    /// of their own; one sink's destinations otherwise share a batch.
    #[test]
    fn sinks_and_a_webhooks_destinations_are_sent_apart() {
        struct PerDestination;
        impl Sink for PerDestination {
            fn describe(&self) -> String {
                "per destination".into()
            }
            fn send(&self, batch: Vec<Routed>) -> BoxFuture<'static, Vec<Outcome>> {
                let n = batch.len();
                async move { (0..n).map(|_| Ok(())).collect() }.boxed()
            }
            fn health(&self) -> BoxFuture<'static, Result<(), PublishError>> {
                async { Ok(()) }.boxed()
            }
            fn sends_by_destination(&self) -> bool {
                true
            }
        }
        let one = Router::single("a", Arc::new(Recorder::default()));
        assert!(
            !one.has_send_groups(),
            "one shared sink: every batch may mix"
        );
        let router = Router::new(
            vec![
                ("a".into(), Arc::new(Recorder::default()) as Arc<dyn Sink>),
                ("hooks".into(), Arc::new(PerDestination) as Arc<dyn Sink>),
            ],
            vec![
                Route::new("orders.*", "a", Template::destination()).unwrap(),
                Route::new("hook.*", "hooks", Template::destination()).unwrap(),
            ],
        )
        .unwrap();
        assert!(router.has_send_groups());
        let group = |destination| router.send_group(&event(1, destination, "x"));
        assert_eq!(
            group("orders.eu"),
            group("orders.us"),
            "one sink's destinations"
        );
        assert_ne!(group("orders.eu"), group("hook.a"), "two sinks");
        assert_ne!(
            group("hook.a"),
            group("hook.b"),
            "a webhook's two receivers"
        );
        assert_eq!(group("hook.a"), group("hook.a"));
        let hooks_only = Router::single("hooks", Arc::new(PerDestination));
        assert!(
            hooks_only.has_send_groups(),
            "one webhook sink, many receivers"
        );
        let limited = crate::sink::Limited {
            inner: Arc::new(PerDestination),
            max_message_bytes: 1024,
        };
        let limited = Router::single("hooks", Arc::new(limited));
        assert!(limited.has_send_groups(), "through a configured size limit");
    }

    /// Runs of a key only through one sink that stores a prefix; and once the router fails
    /// an event of a key (no route: retried), no later event of the key reaches the sink.
    #[tokio::test]
    async fn runs_of_a_key_go_only_to_one_prefix_storing_sink_and_stop_at_a_failure() {
        struct Prefix(Arc<Recorder>);
        impl Sink for Prefix {
            fn describe(&self) -> String {
                self.0.describe()
            }
            fn send(&self, batch: Vec<Routed>) -> BoxFuture<'static, Vec<Outcome>> {
                self.0.send(batch)
            }
            fn health(&self) -> BoxFuture<'static, Result<(), PublishError>> {
                self.0.health()
            }
            fn stores_a_prefix(&self) -> bool {
                true
            }
        }
        let recorder = Arc::new(Recorder::default());
        let only = |sink: Arc<dyn Sink>| {
            Router::new(
                vec![("a".into(), sink)],
                vec![Route::new("orders.*", "a", Template::destination()).unwrap()],
            )
            .unwrap()
        };
        assert_eq!(only(recorder.clone()).max_events_per_key(), 1);
        let router = only(Arc::new(Prefix(recorder.clone())));
        assert!(router.max_events_per_key() > 1);
        let two = Router::new(
            vec![
                (
                    "a".into(),
                    Arc::new(Prefix(recorder.clone())) as Arc<dyn Sink>,
                ),
                (
                    "b".into(),
                    Arc::new(Prefix(recorder.clone())) as Arc<dyn Sink>,
                ),
            ],
            vec![Route::new("*", "a", Template::destination()).unwrap()],
        )
        .unwrap();
        assert_eq!(two.max_events_per_key(), 1, "two sinks: one event per key");

        // Event 2 of key k has no route.
        let batch = [
            (1, "orders.eu", "k"),
            (2, "invoices", "k"),
            (3, "orders.eu", "k"),
        ]
        .into_iter()
        .chain([(4, "orders.eu", "other")])
        .map(|(seq, destination, key)| {
            let mut e = (*event(seq, destination, "x")).clone();
            e.partition_key = Some(key.into());
            Arc::new(e)
        })
        .collect();
        let outcomes = router.publish(batch).await;
        let failed: Vec<bool> = outcomes.iter().map(Result::is_err).collect();
        assert_eq!(failed, [false, true, true, false]);
        assert_eq!(
            outcomes[2].as_ref().unwrap_err().kind(),
            PublishErrorKind::NotSent
        );
        let sent: Vec<i64> = recorder.0.lock().unwrap().iter().map(|(_, s)| *s).collect();
        assert_eq!(sent, vec![1, 4], "event 3 waits for event 2 of its key");
    }

    /// A target that is the broker's own API is dead-lettered with the fix, unless a route
    /// names it: by an exact destination, or by a target without placeholders.
    #[tokio::test]
    async fn a_brokers_own_api_is_reached_only_through_a_route_that_names_it() {
        let sink = Arc::new(Recorder::default());
        let router = Router::new(
            vec![("s".into(), sink.clone() as Arc<dyn Sink>)],
            vec![
                Route::new("$API.exact", "s", Template::destination()).unwrap(),
                Route::new("fixed", "s", Template::parse("$API.fixed").unwrap()).unwrap(),
                Route::new("via.*", "s", Template::parse("$API.{event_type}").unwrap()).unwrap(),
                Route::new("*", "s", Template::destination()).unwrap(),
            ],
        )
        .unwrap();
        let outcomes = router
            .publish(vec![
                event(1, "$API.delete", "1"),
                event(2, "via.x", "2"),
                event(3, "$API.exact", "3"),
                event(4, "fixed", "4"),
                event(5, "orders", "5"),
            ])
            .await;
        for (i, (destination, target)) in
            [("$API.delete", "$API.delete"), ("via.x", "$API.created")]
                .into_iter()
                .enumerate()
        {
            let e = outcomes[i].as_ref().unwrap_err();
            assert_eq!(e.disposition(), Disposition::Permanent);
            let m = e.to_string();
            assert!(
                m.contains(&format!("{target:?}, which is the API"))
                    && m.contains(&format!("destinations is exactly {destination:?}")),
                "{m}"
            );
        }
        assert!(outcomes[2..].iter().all(|o| o.is_ok()), "{outcomes:?}");
        let sent: Vec<_> = sink.0.lock().unwrap().iter().map(|s| s.0.clone()).collect();
        assert_eq!(sent, ["$API.exact", "$API.fixed", "orders"]);
    }

    #[test]
    fn routes_must_name_configured_sinks() {
        let err = Router::new(
            vec![],
            vec![Route::new("*", "nope", Template::destination()).unwrap()],
        )
        .err()
        .unwrap();
        assert!(
            err.contains("names sink \"nope\", which is not configured"),
            "{err}"
        );
    }

    #[test]
    fn binary_cloudevents_need_a_sink_with_a_binding() {
        let route = |mode| {
            Route::new("*", "file", Template::destination())
                .unwrap()
                .with_cloudevents(CloudEvents {
                    mode,
                    source: Template::destination(),
                })
        };
        let sinks = || {
            vec![(
                "file".to_string(),
                Arc::new(Recorder::default()) as Arc<dyn Sink>,
            )]
        };
        let err = Router::new(sinks(), vec![route(ContentMode::Binary)])
            .err()
            .unwrap();
        assert!(
            err.contains("has no CloudEvents binding for binary mode")
                && err.contains("cloudevents = \"structured\""),
            "{err}"
        );
        assert!(Router::new(sinks(), vec![route(ContentMode::Structured)]).is_ok());
    }
}
