//! CloudEvents 1.0 envelopes, optional per route (`cloudevents = "binary" | "structured"`).
//!
//! - **Binary** content mode: the payload stays the message body and each attribute becomes a
//!   header under the broker's protocol binding ([`Binding`]).
//! - **Structured** content mode: the body is the JSON event format (`data`, or `data_base64`
//!   for a byte payload), with content type `application/cloudevents+json`.
//!
//! Attributes: `id` = event id, `source` = the route's template, `specversion` = `1.0`,
//! `type` = event type, `time` = created_at, `subject` and the `partitionkey` extension = the
//! ordering key, `datacontenttype` from the payload's kind.
//!
//! The router shapes the event once ([`shape`]); sinks send its headers and payload as they
//! always do. A sink with no CloudEvents binding for its protocol (Redis Streams, Ably, files)
//! has none, and a route that
//! asks for binary mode on it is refused when the configuration loads.

use std::sync::Arc;

use base64::Engine as _;
use outbox_core::{Event, Payload, PublishError, PublishErrorKind};
use serde::{Deserialize, Serialize};

use crate::template::Template;

/// The content type of a structured CloudEvent in the JSON event format.
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json";

/// The default `source` template when a route does not set `cloudevents_source`.
pub const DEFAULT_SOURCE: &str = "/outbox/{destination}";

/// How a route's events are put in a CloudEvents envelope.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ContentMode {
    Binary,
    Structured,
}

/// A route's CloudEvents setting.
#[derive(Clone, Debug, PartialEq)]
pub struct CloudEvents {
    pub mode: ContentMode,
    pub source: Template,
}

/// How one protocol carries CloudEvents attributes in binary mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binding {
    /// HTTP: `ce-` headers, percent-encoded values; `datacontenttype` is `Content-Type`.
    Http,
    /// Kafka: `ce_` headers, UTF-8 values; `datacontenttype` is the `content-type` header.
    Kafka,
    /// NATS (2.2+ headers): `ce-` headers, percent-encoded values, `ce-datacontenttype` too.
    Nats,
    /// RabbitMQ (AMQP 0-9-1): `ce-` headers, UTF-8 values; `datacontenttype` is the
    /// message's content-type property (the sink moves the `content-type` header there).
    /// This is the RabbitMQ binding that Knative Eventing and the CloudEvents SDKs read; the
    /// spec's AMQP binding (`cloudEvents_` properties) is written for AMQP 1.0.
    RabbitMq,
}

impl Binding {
    fn prefix(self) -> &'static str {
        match self {
            Binding::Http | Binding::Nats | Binding::RabbitMq => "ce-",
            Binding::Kafka => "ce_",
        }
    }

    /// Whether `datacontenttype` travels as the protocol's own content type.
    fn content_type_is_native(self) -> bool {
        !matches!(self, Binding::Nats)
    }

    fn percent_encodes(self) -> bool {
        matches!(self, Binding::Http | Binding::Nats)
    }
}

/// The header under which the content type travels, for structured events and for the
/// bindings whose `datacontenttype` is the protocol's own content type.
pub const CONTENT_TYPE_HEADER: &str = "content-type";

fn data_content_type(payload: &Payload) -> &'static str {
    match payload {
        Payload::Json(_) | Payload::Null => "application/json",
        Payload::Bytes(_) => "application/octet-stream",
    }
}

/// The context attributes of `event`, in the order the spec lists them.
fn attributes(event: &Event, source: &Template) -> Result<Vec<(&'static str, String)>, String> {
    let time = outbox_core::time::rfc3339_micros(event.created_at)?;
    let mut attributes = vec![
        ("specversion", "1.0".to_string()),
        ("id", event.event_id.hyphenated().to_string()),
        ("source", source.render(event)),
        ("type", event.event_type.clone()),
        ("datacontenttype", data_content_type(&event.payload).into()),
        ("time", time),
    ];
    // The spec forbids empty values: an empty key is no subject.
    let key = event.ordering_key();
    if !key.is_empty() {
        attributes.push(("subject", key.to_string()));
        attributes.push(("partitionkey", key.to_string()));
    }
    Ok(attributes)
}

/// The binary-mode header names under `binding`, for the attributes [`shape`] writes as
/// headers (a sink forwarding only those, like webhooks, never sends a stray `ce-` header
/// of the event's own).
pub fn attribute_headers(binding: Binding) -> impl Iterator<Item = String> {
    [
        "specversion",
        "id",
        "source",
        "type",
        "datacontenttype",
        "time",
        "subject",
        "partitionkey",
    ]
    .into_iter()
    .filter(move |name| !(*name == "datacontenttype" && binding.content_type_is_native()))
    .map(move |name| format!("{}{name}", binding.prefix()))
}

/// The HTTP and NATS bindings' rule: space, `"`, `%` and everything outside printable ASCII
/// become `%XY` per UTF-8 byte.
fn percent_encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        if matches!(byte, 0x21..=0x7E) && byte != b'"' && byte != b'%' {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// `event` as the CloudEvent its route asks for, ready for a sink with `binding` (`None`:
/// the sink has no binary binding; only structured mode reaches it). Fails only for an
/// event whose time cannot be written (outside the years 1 to 9999), permanently.
pub fn shape(
    event: &Event,
    settings: &CloudEvents,
    binding: Option<Binding>,
) -> Result<Arc<Event>, PublishError> {
    let attributes = attributes(event, &settings.source)
        .map_err(|problem| PublishError::new(PublishErrorKind::Encoding, problem))?;
    let mut shaped = event.clone();
    match (settings.mode, binding) {
        (ContentMode::Binary, Some(binding)) => {
            for (name, value) in attributes {
                if name == "datacontenttype" && binding.content_type_is_native() {
                    // The protocol's own content type: a media type, never percent-encoded.
                    shaped.headers.insert(CONTENT_TYPE_HEADER.into(), value);
                } else {
                    let value = if binding.percent_encodes() {
                        percent_encode(&value)
                    } else {
                        value
                    };
                    shaped
                        .headers
                        .insert(format!("{}{name}", binding.prefix()), value);
                }
            }
        }
        (ContentMode::Binary, None) => {
            return Err(PublishError::new(
                PublishErrorKind::Encoding,
                "this sink has no CloudEvents binary binding; use cloudevents = \"structured\"",
            ))
        }
        (ContentMode::Structured, _) => {
            let mut envelope = serde_json::Map::new();
            for (name, value) in attributes {
                envelope.insert(name.into(), serde_json::Value::String(value));
            }
            let mut body = serde_json::to_vec(&envelope).map_err(|e| {
                PublishError::new(PublishErrorKind::Encoding, "cannot encode the CloudEvent")
                    .with_source(e)
            })?;
            // `data` goes in as the JSON the database returned, never re-encoded.
            body.pop(); // the closing brace
            match &event.payload {
                Payload::Json(raw) => {
                    body.extend_from_slice(b",\"data\":");
                    body.extend_from_slice(raw.get().as_bytes());
                }
                Payload::Null => body.extend_from_slice(b",\"data\":null"),
                Payload::Bytes(bytes) => {
                    body.extend_from_slice(b",\"data_base64\":\"");
                    body.extend_from_slice(
                        base64::engine::general_purpose::STANDARD
                            .encode(bytes)
                            .as_bytes(),
                    );
                    body.push(b'"');
                }
            }
            body.push(b'}');
            shaped.payload =
                Payload::from_json_text(String::from_utf8(body).expect("JSON text is UTF-8"))
                    .map_err(|e| {
                        PublishError::new(
                            PublishErrorKind::Encoding,
                            "cannot encode the CloudEvent",
                        )
                        .with_source(e)
                    })?;
            shaped
                .headers
                .insert(CONTENT_TYPE_HEADER.into(), STRUCTURED_CONTENT_TYPE.into());
        }
    }
    Ok(Arc::new(shaped))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    fn event(payload: Payload) -> Event {
        Event {
            partition_key: Some("customer 7".into()),
            created_at: UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_456),
            ..Event::new(
                3,
                uuid::Uuid::from_u128(7),
                "orders",
                "order.created",
                payload,
            )
        }
    }

    fn settings(mode: ContentMode) -> CloudEvents {
        CloudEvents {
            mode,
            source: Template::parse(DEFAULT_SOURCE).unwrap(),
        }
    }

    fn json(text: &str) -> Payload {
        Payload::from_json_text(text.into()).unwrap()
    }

    #[test]
    fn binary_mode_follows_each_binding() {
        let e = event(json(r#"{"total": 1}"#));
        let kafka = shape(&e, &settings(ContentMode::Binary), Some(Binding::Kafka)).unwrap();
        assert_eq!(
            kafka.payload.as_bytes(),
            e.payload.as_bytes(),
            "body untouched"
        );
        assert_eq!(
            kafka.headers["ce_id"],
            "00000000-0000-0000-0000-000000000007"
        );
        assert_eq!(kafka.headers["ce_source"], "/outbox/orders");
        assert_eq!(kafka.headers["ce_type"], "order.created");
        assert_eq!(kafka.headers["ce_time"], "2023-11-14T22:13:20.123456Z");
        assert_eq!(kafka.headers["ce_subject"], "customer 7");
        assert_eq!(kafka.headers["ce_partitionkey"], "customer 7");
        assert_eq!(kafka.headers["content-type"], "application/json");
        assert!(!kafka.headers.contains_key("ce_datacontenttype"));

        let http = shape(&e, &settings(ContentMode::Binary), Some(Binding::Http)).unwrap();
        assert_eq!(
            http.headers["ce-subject"], "customer%207",
            "percent-encoded"
        );
        assert_eq!(http.headers["ce-specversion"], "1.0");

        let nats = shape(&e, &settings(ContentMode::Binary), Some(Binding::Nats)).unwrap();
        assert_eq!(nats.headers["ce-datacontenttype"], "application/json");
        assert!(!nats.headers.contains_key("content-type"));

        let rabbit = shape(&e, &settings(ContentMode::Binary), Some(Binding::RabbitMq)).unwrap();
        assert_eq!(
            rabbit.headers["ce-subject"], "customer 7",
            "not percent-encoded"
        );
        assert_eq!(rabbit.headers["content-type"], "application/json");
    }

    #[test]
    fn structured_mode_wraps_json_verbatim_and_bytes_in_base64() {
        let e = event(json(r#"{"total": 12.50}"#));
        let shaped = shape(&e, &settings(ContentMode::Structured), None).unwrap();
        assert_eq!(shaped.headers["content-type"], STRUCTURED_CONTENT_TYPE);
        let text = std::str::from_utf8(shaped.payload.as_bytes()).unwrap();
        assert!(text.ends_with(r#","data":{"total": 12.50}}"#), "{text}");
        let v: serde_json::Value = serde_json::from_str(text).unwrap();
        assert_eq!(v["specversion"], "1.0");
        assert_eq!(v["id"], "00000000-0000-0000-0000-000000000007");
        assert_eq!(v["datacontenttype"], "application/json");

        let bytes = shape(
            &event(Payload::Bytes(vec![0, 255])),
            &settings(ContentMode::Structured),
            None,
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_slice(bytes.payload.as_bytes()).unwrap();
        assert_eq!(v["data_base64"], "AP8=");
        assert_eq!(v["datacontenttype"], "application/octet-stream");
    }

    #[test]
    fn header_values_are_percent_encoded_by_the_bindings_rule() {
        assert_eq!(percent_encode("a b\"c%d"), "a%20b%22c%25d");
        assert_eq!(
            percent_encode("Euro € 😀"),
            "Euro%20%E2%82%AC%20%F0%9F%98%80"
        );
        assert_eq!(percent_encode("/outbox/orders"), "/outbox/orders");
    }

    #[test]
    fn an_empty_ordering_key_is_no_subject() {
        let mut e = event(Payload::Null);
        e.partition_key = Some(String::new());
        e.destination = String::new();
        let shaped = shape(&e, &settings(ContentMode::Binary), Some(Binding::Kafka)).unwrap();
        assert!(!shaped.headers.contains_key("ce_subject"));
        assert!(!shaped.headers.contains_key("ce_partitionkey"));
        let names: Vec<String> = attribute_headers(Binding::Http).collect();
        assert!(names.contains(&"ce-id".to_string()));
        assert!(!names.iter().any(|n| n.ends_with("datacontenttype")));
    }

    #[test]
    fn binary_mode_without_a_binding_fails_permanently() {
        let err = shape(&event(Payload::Null), &settings(ContentMode::Binary), None).unwrap_err();
        assert!(err.to_string().contains("structured"), "{err}");
    }
}
