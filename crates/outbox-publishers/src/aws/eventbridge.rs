//! Amazon EventBridge (`eventbridge:` for the default bus, `eventbridge://BUS` for another,
//! by name or ARN): `PutEvents`.
//!
//! `Source` = the route's target (a template, `{destination}` by default), `DetailType` =
//! the `detail_type` template (`{event_type}` by default). `Detail` must be a JSON object:
//! by default it is the relay's envelope (the file sink's line), which carries the event id
//! for consumers to drop repeats, because EventBridge gives every entry an id of its own;
//! with `detail = "payload"` it is the payload itself (then a JSON object, or the event is
//! refused for good). A route with `cloudevents = "structured"` sends the CloudEvent.

use std::sync::Arc;

use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_core::{Outcome, PublishError, PublishErrorKind};
use serde::Serialize;
use serde_json::{json, Value};

use super::credentials::Env;
pub use super::settings::{DetailForm, EventBridgeConfig};
use super::{AwsClient, BatchApi, Probe, Service};
use crate::error::SinkSetupError;
use crate::sink::{Routed, Sink};
use crate::template::Template;

/// The largest entry, and the largest request, as EventBridge counts them.
pub const MAX_ENTRY_BYTES: usize = 262_144;

pub struct EventBridge {
    client: AwsClient,
    bus: Option<String>,
    detail_type: Template,
    detail: DetailForm,
}

impl BatchApi for EventBridge {
    const PROBE: Probe = Probe::Json {
        prefix: "AWSEvents",
        action: "ListEventBuses",
        version: "1.1",
        body: r#"{"Limit": 1}"#,
    };
    const MAX_ENTRIES: usize = 10;
    const MAX_BATCH_BYTES: usize = MAX_ENTRY_BYTES;
    const SYSTEM: &'static str = "aws_eventbridge";
    const MAX_MESSAGE_BYTES: usize = MAX_ENTRY_BYTES;
    type Entry = Value;

    fn client(&self) -> &AwsClient {
        &self.client
    }

    fn entry(&self, routed: &Routed) -> Result<(Value, usize), PublishError> {
        let detail = match (self.detail, routed.cloudevents) {
            (DetailForm::Payload, None) => routed.event.payload.as_bytes().to_vec(),
            _ => super::kinesis::envelope(routed)?,
        };
        let detail = String::from_utf8(detail)
            .ok()
            .filter(|text| text.trim_start().starts_with('{'))
            .ok_or_else(|| {
                PublishError::new(
                    PublishErrorKind::Rejected,
                    "an EventBridge detail must be a JSON object, and this payload is not one: \
                     use the sink's default `detail = \"envelope\"`, or write JSON objects",
                )
            })?;
        let detail_type = self.detail_type.render(&routed.event);
        let size = routed.target.len() + detail_type.len() + detail.len();
        if size > MAX_ENTRY_BYTES {
            return Err(PublishError::new(
                PublishErrorKind::TooLarge,
                format!("the EventBridge entry would be {size} bytes; EventBridge takes at most {MAX_ENTRY_BYTES}"),
            ));
        }
        let mut entry = json!({
            "Source": routed.target,
            "DetailType": detail_type,
            "Detail": detail,
        });
        if let Some(bus) = &self.bus {
            entry["EventBusName"] = bus.clone().into();
        }
        Ok((entry, size))
    }

    /// The target is each entry's `Source`, already in it.
    fn send_entries(
        self: Arc<Self>,
        _source: String,
        entries: Arc<[Value]>,
    ) -> BoxFuture<'static, Result<Vec<Outcome>, PublishError>> {
        async move {
            let count = entries.len();
            let what = self.client.what("PutEvents");
            match self
                .client
                .json(
                    "AWSEvents",
                    "PutEvents",
                    "1.1",
                    &PutEvents { entries: &entries },
                )
                .await
            {
                // The answer lists every entry, in the request's order.
                Ok(answer) => Ok(super::outcomes_in_order(
                    count,
                    &answer["Entries"],
                    "EventId",
                    &what,
                )),
                Err(error) => Err(error),
            }
        }
        .boxed()
    }
}

/// A `PutEvents` request, encoded from the entries without copying them.
#[derive(Serialize)]
struct PutEvents<'a> {
    #[serde(rename = "Entries")]
    entries: &'a [Value],
}

pub fn sink(
    uri: &str,
    config: &EventBridgeConfig,
    env: Env<'_>,
) -> Result<Arc<dyn Sink>, SinkSetupError> {
    let bus = super::uri_rest(uri, "eventbridge");
    let detail_type = Template::parse(config.detail_type.as_deref().unwrap_or("{event_type}"))
        .map_err(|e| SinkSetupError::config(format!("`detail_type`: {e}")))?;
    Ok(Arc::new(super::AwsSink::new(EventBridge {
        client: AwsClient::new(Service::EventBridge, &config.aws, env)?,
        bus: (!bus.is_empty()).then(|| bus.to_string()),
        detail_type,
        detail: config.detail.unwrap_or_default(),
    })))
}
