//! Publishers for outbox-relay: a [`Router`] (the engine's [`outbox_core::Publisher`]) over
//! named [`Sink`]s, one module per broker.

#[cfg(feature = "ably")]
pub mod ably;
pub mod config;
#[cfg(any(feature = "webhook", feature = "ably"))]
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
pub mod sink;
pub mod template;
#[cfg(feature = "webhook")]
pub mod webhook;

use std::collections::BTreeMap;
use std::sync::Arc;

use outbox_core::{PublishError, PublishErrorKind};

pub use config::{RouteConfig, Secret, SinkConfig};
pub use json_lines::{FileSink, StdoutSink};
pub use router::{Route, Router};
pub use sink::{Routed, Sink};
pub use template::Template;

fn invalid(message: impl Into<String>) -> PublishError {
    PublishError::new(PublishErrorKind::Rejected, message)
}

/// Builds one sink from its settings. Connections are made lazily or retried in the
/// background, so a broker that is down at start delays delivery but not the relay.
pub async fn build_sink(name: &str, config: &SinkConfig) -> Result<Arc<dyn Sink>, PublishError> {
    let sink = connect_sink(name, config).await?;
    Ok(match config.max_message_bytes {
        Some(limit) => Arc::new(sink::Limited {
            inner: sink,
            max_message_bytes: limit,
        }),
        None => sink,
    })
}

async fn connect_sink(name: &str, config: &SinkConfig) -> Result<Arc<dyn Sink>, PublishError> {
    let uri = config.uri.trim();
    let scheme = uri.split(':').next().unwrap_or_default();
    match scheme {
        "stdout" => Ok(Arc::new(StdoutSink::new())),
        "file" => {
            let path = uri.trim_start_matches("file:");
            let path = path.strip_prefix("//").unwrap_or(path);
            if path.is_empty() {
                return Err(invalid(
                    "sink `file:` needs a path, e.g. file:/var/lib/outbox/events.jsonl",
                ));
            }
            Ok(Arc::new(FileSink::open(path)?))
        }
        #[cfg(feature = "nats")]
        "nats" | "tls" => nats::sink(config).await,
        #[cfg(feature = "redis")]
        "redis" | "rediss" => redis::sink(config),
        #[cfg(feature = "kafka")]
        "kafka" | "kafkas" => kafka::sink(config),
        #[cfg(feature = "rabbitmq")]
        "amqp" | "amqps" => rabbitmq::sink(config),
        #[cfg(feature = "webhook")]
        "http" | "https" => webhook::sink(config),
        #[cfg(feature = "ably")]
        "ably" => ably::sink(config),
        other => Err(invalid(match unbuilt_sink(other) {
            Some((sink, feature)) => format!(
                "sink {name}: this build has no {sink} sink; build with --features {feature} (or use a build that has it)"
            ),
            None => format!(
                "sink {name}: unknown URI scheme {other:?}: use stdout, file:PATH, nats://, kafka://, amqp://, redis://, http(s):// or ably:"
            ),
        })),
    }
}

/// Each feature-gated sink: its URI schemes, its name, its cargo feature.
const GATED_SINKS: &[(&[&str], &str, &str, bool)] = &[
    (&["nats", "tls"], "NATS", "nats", cfg!(feature = "nats")),
    (
        &["kafka", "kafkas"],
        "Kafka",
        "kafka",
        cfg!(feature = "kafka"),
    ),
    (
        &["amqp", "amqps"],
        "RabbitMQ",
        "rabbitmq",
        cfg!(feature = "rabbitmq"),
    ),
    (
        &["redis", "rediss"],
        "Redis",
        "redis",
        cfg!(feature = "redis"),
    ),
    (
        &["http", "https"],
        "webhook",
        "webhook",
        cfg!(feature = "webhook"),
    ),
    (&["ably"], "Ably", "ably", cfg!(feature = "ably")),
];

/// The sink and cargo feature of a scheme this build left out, if it is one.
fn unbuilt_sink(scheme: &str) -> Option<(&'static str, &'static str)> {
    GATED_SINKS
        .iter()
        .find(|(schemes, _, _, built)| !built && schemes.contains(&scheme))
        .map(|(_, sink, feature, _)| (*sink, *feature))
}

/// A router with one sink for every destination (`--sink URI`).
pub async fn from_uri(uri: &str) -> Result<Arc<dyn outbox_core::Publisher>, PublishError> {
    let config = SinkConfig {
        uri: uri.to_string(),
        ..SinkConfig::default()
    };
    let sink = build_sink("default", &config).await?;
    Ok(Arc::new(Router::single("default", sink)))
}

/// A router over configured sinks and routes. Without routes, a single sink takes every
/// destination.
pub async fn build_router(
    sinks: &BTreeMap<String, SinkConfig>,
    routes: &[RouteConfig],
) -> Result<Arc<dyn outbox_core::Publisher>, PublishError> {
    let mut built = Vec::new();
    for (name, config) in sinks {
        built.push((name.clone(), build_sink(name, config).await?));
    }
    let mut parsed = Vec::new();
    for route in routes {
        let target = match &route.target {
            Some(t) => Template::parse(t).map_err(invalid)?,
            None => Template::destination(),
        };
        parsed.push(Route::new(&route.destinations, &route.sink, target).map_err(invalid)?);
    }
    if parsed.is_empty() {
        if built.len() != 1 {
            return Err(invalid(
                "several sinks are configured but no [[routes]]: add routes that map destinations to sinks",
            ));
        }
        parsed.push(Route::new("*", &built[0].0, Template::destination()).map_err(invalid)?);
    }
    Ok(Arc::new(Router::new(built, parsed).map_err(invalid)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Meaningful in a build without some sink (`cargo test -p outbox-publishers
    /// --no-default-features --lib`): each left-out scheme names the feature that brings it.
    #[tokio::test]
    async fn a_scheme_left_out_of_the_build_names_its_feature() {
        for (schemes, sink, feature, built) in GATED_SINKS {
            if *built {
                continue;
            }
            for scheme in *schemes {
                let uri = format!("{scheme}://127.0.0.1:1");
                let result = build_sink(
                    "main",
                    &SinkConfig {
                        uri: uri.clone(),
                        ..SinkConfig::default()
                    },
                )
                .await;
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
        let err = build_sink(
            "main",
            &SinkConfig {
                uri: "gopher://x".into(),
                ..SinkConfig::default()
            },
        )
        .await
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("unknown URI scheme"), "{err}");
    }
}
