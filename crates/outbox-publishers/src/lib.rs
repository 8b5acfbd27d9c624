//! Publishers for outbox-relay: a [`Router`] (the engine's [`outbox_core::Publisher`]) over
//! named [`Sink`]s, one module per broker.

#[cfg(feature = "ably")]
pub mod ably;
#[cfg(feature = "aws")]
pub mod aws;
pub mod cloudevents;
pub mod config;
pub mod error;
mod group_write;
#[cfg(any(feature = "webhook", feature = "ably", feature = "aws"))]
mod http;
pub mod json_lines;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis")]
pub mod redis;
pub mod router;
pub mod settings;
pub mod sink;
pub mod template;
pub mod trace;
#[cfg(feature = "webhook")]
pub mod webhook;

use std::collections::BTreeMap;
use std::sync::Arc;

pub use config::{RouteConfig, SinkConfig, SinkKind, SinkSettings};
pub use error::{SinkSetupError, SinkSetupKind};
pub use json_lines::{FileSink, StdoutSink};
pub use router::{Route, Router};
pub use sink::{Routed, Sink};
pub use template::Template;

/// Builds one sink from its settings. Connections are made lazily or retried in the
/// background, so a broker that is down at start delays delivery but not the relay.
pub async fn build_sink(name: &str, config: &SinkConfig) -> Result<Arc<dyn Sink>, SinkSetupError> {
    let sink = connect_sink(name, config).await?;
    if let (Some(set), Some(fixed), true) = (
        config.max_message_bytes(),
        sink.max_message_bytes(),
        sink.limit_is_fixed(),
    ) {
        if set > fixed {
            // The sink refuses what is over its own limit anyway, as its own error.
            let how = match config.settings() {
                #[cfg(feature = "kafka")]
                SinkSettings::Kafka(_) => {
                    "raise the producer's message.max.bytes under [sinks.NAME.kafka] instead"
                }
                _ => "the service takes no more",
            };
            return Err(SinkSetupError::config(format!(
                "`max_message_bytes` = {set} is above the {fixed} bytes this sink can send \
                 ({how}): lower it, or leave it out"
            )));
        }
    }
    Ok(match config.max_message_bytes() {
        Some(limit) => Arc::new(sink::Limited {
            inner: sink,
            max_message_bytes: limit,
        }),
        None => sink,
    })
}

async fn connect_sink(name: &str, config: &SinkConfig) -> Result<Arc<dyn Sink>, SinkSetupError> {
    let uri = config.uri().trim();
    match config.settings() {
        #[cfg(feature = "nats")]
        SinkSettings::Nats(settings) => nats::sink(uri, settings).await,
        #[cfg(feature = "kafka")]
        SinkSettings::Kafka(settings) => kafka::sink(uri, settings),
        #[cfg(feature = "rabbitmq")]
        SinkSettings::RabbitMq(settings) => rabbitmq::sink(uri, settings),
        #[cfg(feature = "redis")]
        SinkSettings::Redis(settings) => redis::sink(uri, settings),
        #[cfg(feature = "webhook")]
        SinkSettings::Webhook(settings) => webhook::sink(uri, settings),
        #[cfg(feature = "ably")]
        SinkSettings::Ably(settings) => ably::sink(uri, settings),
        #[cfg(feature = "aws")]
        SinkSettings::Sqs(_)
        | SinkSettings::Sns(_)
        | SinkSettings::Kinesis(_)
        | SinkSettings::EventBridge(_) => aws::sink(config, &|name| std::env::var(name).ok()),
        // Every sink with settings of its own is matched above, so the rest is stdout, a
        // file, or a sink this build leaves out (or an unknown scheme, from `--sink`).
        SinkSettings::None => {
            let in_sink = |e: SinkSetupError| SinkSetupError::config(format!("sink {name}: {e}"));
            match SinkKind::of(uri).map_err(in_sink)? {
                SinkKind::Stdout => Ok(Arc::new(StdoutSink::new())),
                SinkKind::File => {
                    let path = uri.trim_start_matches("file:");
                    let path = path.strip_prefix("//").unwrap_or(path);
                    if path.is_empty() {
                        return Err(SinkSetupError::config(
                            "sink `file:` needs a path, e.g. file:/var/lib/outbox/events.jsonl",
                        ));
                    }
                    Ok(Arc::new(FileSink::open(path)?))
                }
                unbuilt => Err(in_sink(unbuilt.not_built())),
            }
        }
    }
}

/// A router with one sink for every destination (`--sink URI`).
pub async fn from_uri(uri: &str) -> Result<Arc<dyn outbox_core::Publisher>, SinkSetupError> {
    let sink = build_sink("default", &SinkConfig::new(uri)).await?;
    Ok(Arc::new(Router::single("default", sink)))
}

/// Refuses a secret given through the environment that no sink of the process would use:
/// [`webhook::SECRET_ENV`] when every webhook sink has a `secret` of its own (or there is
/// none), and `OUTBOX_RELAY_ABLY_API_KEY` without an Ably sink. A rotation through the
/// deployment's environment otherwise changed nothing, without a word. `sinks` are every
/// outbox's.
pub fn refuse_unused_secrets<'a>(
    sinks: impl IntoIterator<Item = &'a SinkConfig>,
) -> Result<(), SinkSetupError> {
    let set = |name: &str| std::env::var_os(name).is_some_and(|v| !v.is_empty());
    let settings: Vec<&SinkSettings> = sinks.into_iter().map(SinkConfig::settings).collect();
    #[cfg(feature = "webhook")]
    if set(webhook::SECRET_ENV)
        && !settings
            .iter()
            .any(|s| matches!(s, SinkSettings::Webhook(w) if w.secret.is_none()))
    {
        return Err(SinkSetupError::config(format!(
            "{} is set, but no webhook sink signs with it (each has a `secret` of its own, or \
             there is none): unset it, or remove the `secret` of the sink it is for",
            webhook::SECRET_ENV
        )));
    }
    #[cfg(feature = "ably")]
    if set(ably::OURS_ENV) && !settings.iter().any(|s| matches!(s, SinkSettings::Ably(_))) {
        return Err(SinkSetupError::config(format!(
            "{} is set, but no sink is an Ably one (`ably:`): unset it, or add the Ably sink",
            ably::OURS_ENV
        )));
    }
    let _ = (set, settings);
    Ok(())
}

/// A router over configured sinks and routes. Without routes, a single sink takes every
/// destination. A route without a `target` (and the single sink) renders `default_target`:
/// the destination itself, or the layout's convention (Debezium's `outbox.event.{destination}`).
pub async fn build_router(
    sinks: &BTreeMap<String, SinkConfig>,
    routes: &[RouteConfig],
    default_target: &str,
) -> Result<Arc<dyn outbox_core::Publisher>, SinkSetupError> {
    let parsed_default = Template::parse(default_target).map_err(SinkSetupError::config)?;
    // SQS queue and SNS topic names have no dots (but `.fifo`): a default target with dots
    // (Debezium's `outbox.event.{destination}`) could never name one.
    let check_default = |sink: &str| -> Result<(), SinkSetupError> {
        let kind = sinks.get(sink).and_then(|c| SinkKind::of(c.uri()).ok());
        if matches!(kind, Some(SinkKind::Sqs | SinkKind::Sns)) && default_target.contains('.') {
            return Err(SinkSetupError::config(format!(
                "sink {sink} sends to the queue or topic its route's target names, and the \
                 layout's default target {default_target:?} has dots, which SQS and SNS names \
                 cannot have: give the route a target, e.g. target = \"outbox-event-{{destination}}\""
            )));
        }
        Ok(())
    };
    let default_target = parsed_default;
    // Checked before any sink connects, so the fix is named first.
    for route in routes.iter().filter(|r| r.target.is_none()) {
        check_default(&route.sink)?;
    }
    // A target a sink never reads: accepted, it changed nothing, without a word.
    for route in routes {
        let Some(target) = &route.target else {
            continue;
        };
        let kind = sinks
            .get(&route.sink)
            .and_then(|c| SinkKind::of(c.uri()).ok());
        if let Some((kind, why)) = kind.and_then(|k| Some((k, k.ignores_targets()?))) {
            return Err(SinkSetupError::config(format!(
                "the route of {:?} to sink {} sets target = {target:?}, which a {} sink does \
                 not use ({why}): remove it",
                route.destinations,
                route.sink,
                kind.name_and_feature().0
            )));
        }
    }
    if routes.is_empty() && sinks.len() == 1 {
        sinks.keys().try_for_each(|sink| check_default(sink))?;
    }
    #[cfg(feature = "webhook")]
    webhook::refuse_a_shared_secret(sinks.iter().filter_map(|(name, c)| match c.settings() {
        SinkSettings::Webhook(w) => Some((name.as_str(), w)),
        _ => None,
    }))?;
    let mut built = Vec::new();
    for (name, config) in sinks {
        built.push((name.clone(), build_sink(name, config).await?));
    }
    let mut parsed = Vec::new();
    for route in routes {
        let target = match &route.target {
            Some(t) => Template::parse(t).map_err(SinkSetupError::config)?,
            None => default_target.clone(),
        };
        let mut parsed_route =
            Route::new(&route.destinations, &route.sink, target).map_err(SinkSetupError::config)?;
        if let Some(cloudevents) = route.cloudevents().map_err(SinkSetupError::config)? {
            parsed_route = parsed_route.with_cloudevents(cloudevents);
        }
        parsed.push(parsed_route);
    }
    if parsed.is_empty() {
        if built.len() != 1 {
            return Err(SinkSetupError::config(
                "several sinks are configured but no [[routes]]: add routes that map destinations to sinks",
            ));
        }
        parsed.push(Route::new("*", &built[0].0, default_target).map_err(SinkSetupError::config)?);
    }
    Ok(Arc::new(
        Router::new(built, parsed).map_err(SinkSetupError::config)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A route's target given to a sink that reads none (stdout, a file, a webhook, whose
    /// URL names where each event goes) is refused, naming it: it changed nothing.
    #[tokio::test]
    async fn a_target_a_sink_never_reads_is_refused() {
        for (uri, kind) in [
            ("stdout", "stdout"),
            ("file:/tmp/never-written.jsonl", "file"),
            ("http://127.0.0.1:1/{destination}", "webhook"),
        ] {
            let sinks = BTreeMap::from([("s".to_string(), SinkConfig::new(uri))]);
            let routes = vec![RouteConfig {
                destinations: "orders".into(),
                sink: "s".into(),
                target: Some("elsewhere".into()),
                cloudevents: None,
                cloudevents_source: None,
            }];
            let Err(error) = build_router(&sinks, &routes, "{destination}").await else {
                panic!("{uri}: accepted");
            };
            let said = error.to_string();
            assert!(
                said.contains("target = \"elsewhere\"") && said.contains(&format!("a {kind} sink")),
                "{said}"
            );
        }
    }

    /// Debezium's default topic, `outbox.event.{destination}`, cannot name an SQS queue or
    /// an SNS topic: a route to one without a target is refused, with the fix.
    #[tokio::test]
    async fn a_default_target_with_dots_is_refused_for_sqs_and_sns() {
        let sinks = BTreeMap::from([("q".to_string(), SinkConfig::new("sqs:"))]);
        for routes in [
            vec![],
            vec![RouteConfig {
                destinations: "*".into(),
                sink: "q".into(),
                target: None,
                cloudevents: None,
                cloudevents_source: None,
            }],
        ] {
            let err = build_router(&sinks, &routes, "outbox.event.{destination}")
                .await
                .err()
                .expect("refused")
                .to_string();
            assert!(err.contains("give the route a target"), "{err}");
        }
    }

    /// Meaningful in a build without some sink (`cargo test -p outbox-publishers
    /// --no-default-features --lib`): each left-out scheme names the feature that brings it.
    #[tokio::test]
    async fn a_scheme_left_out_of_the_build_names_its_feature() {
        for kind in SinkKind::ALL.into_iter().filter(|kind| !kind.is_built()) {
            let (sink, feature) = kind.name_and_feature();
            let feature = feature.unwrap_or_default();
            for scheme in kind.schemes() {
                let uri = format!("{scheme}://127.0.0.1:1");
                // Read from a file too: the table is accepted (commands that build no sink
                // still run), and building the sink names the feature.
                let read: SinkConfig =
                    serde_json::from_value(serde_json::json!({ "uri": uri })).unwrap();
                assert_eq!(read, SinkConfig::new(&uri));
                let result = build_sink("main", &read).await;
                let err = result
                    .err()
                    .expect("no sink without its feature")
                    .to_string();
                assert!(
                    err.contains(&format!(
                        "this build has no {sink} sink; build with --features {feature}"
                    )),
                    "{uri}: {err}"
                );
            }
        }
        let err = build_sink("main", &SinkConfig::new("gopher://x"))
            .await
            .err()
            .unwrap();
        assert!(
            err.to_string().contains("sink main: unknown URI scheme"),
            "{err}"
        );
        assert!(err.kind().is_config());
    }
}
