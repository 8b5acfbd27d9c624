//! Routes events to sinks by destination glob, renders their target, enforces size limits,
//! and reassembles one outcome per event in batch order.

use std::collections::HashMap;
use std::sync::Arc;

use futures::future::{join_all, BoxFuture};
use futures::FutureExt;
use globset::{Glob, GlobMatcher};
use outbox_core::{Event, Outcome, PublishError, PublishErrorKind, Publisher};

use crate::sink::{Routed, Sink};
use crate::template::Template;

/// One route: destinations matching `glob` go to `sink`, at `target`.
pub struct Route {
    pub pattern: String,
    matcher: GlobMatcher,
    pub sink: String,
    pub target: Template,
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
        })
    }
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
            if !sinks.contains_key(&route.sink) {
                let mut names: Vec<_> = sinks.keys().cloned().collect();
                names.sort();
                return Err(format!(
                    "route {:?} names sink {:?}, which is not configured (configured: {})",
                    route.pattern,
                    route.sink,
                    names.join(", ")
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
    fn describe(&self) -> String {
        let mut names: Vec<String> = self.sinks.values().map(|s| s.describe()).collect();
        names.sort();
        names.join(", ")
    }

    fn publish(&self, batch: Vec<Arc<Event>>) -> BoxFuture<'static, Vec<Outcome>> {
        let mut outcomes: Vec<Option<Outcome>> = (0..batch.len()).map(|_| None).collect();
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
            if let Some(limit) = self.sinks[&route.sink].max_message_bytes() {
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
            let target = route.target.render(&event);
            let group = groups.entry(route.sink.as_str()).or_default();
            group.0.push(i);
            group.1.push(Routed { event, target });
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

    fn close(&self) -> BoxFuture<'static, ()> {
        let closes: Vec<_> = self.sinks.values().map(|s| s.close()).collect();
        async move {
            join_all(closes).await;
        }
        .boxed()
    }
}
