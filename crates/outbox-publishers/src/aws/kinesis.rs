//! Amazon Kinesis Data Streams (`kinesis:`): `PutRecords`, the route's target naming the
//! stream (its name, or its ARN).
//!
//! `PartitionKey` = the ordering key, so one key's records share a shard and keep their
//! order (keys longer than Kinesis's 256 characters are replaced by their SHA-256, still one
//! shard per key). A record has no headers, so its data is the relay's JSON envelope (the
//! file sink's line: event id, type, key, headers, payload), or the CloudEvent itself on a
//! route with `cloudevents = "structured"`.

use std::sync::Arc;

use base64::Engine;
use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_core::{Outcome, PublishError, PublishErrorKind};
use serde_json::{json, Value};

use super::credentials::Env;
use super::{AwsClient, AwsConfig, BatchApi, Probe, Service};
use crate::error::SinkSetupError;
use crate::sink::{Routed, Sink};

/// The largest record (data and partition key), and the largest request.
pub const MAX_RECORD_BYTES: usize = 1_048_576;
pub const MAX_REQUEST_BYTES: usize = 5 * 1_048_576;
/// The longest partition key, in characters.
const MAX_KEY_CHARS: usize = 256;

pub struct Kinesis {
    client: AwsClient,
}

/// The record's partition key for an ordering key.
fn partition_key(key: &str) -> String {
    if !key.is_empty() && key.chars().count() <= MAX_KEY_CHARS {
        return key.to_string();
    }
    use sha2::Digest;
    sha2::Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What a record, a webhook body or an EventBridge detail carries when the protocol has no
/// headers: the relay's envelope, or a structured CloudEvent as it is.
pub(crate) fn envelope(routed: &Routed) -> Result<Vec<u8>, PublishError> {
    if routed.cloudevents == Some(crate::cloudevents::ContentMode::Structured) {
        return Ok(routed.event.payload.as_bytes().to_vec());
    }
    let mut data = Vec::with_capacity(routed.event.payload.len() + 256);
    crate::json_lines::encode_line(&routed.event, &mut data)?;
    data.pop(); // the line's newline
    Ok(data)
}

impl BatchApi for Kinesis {
    const PROBE: Probe = Probe::Json {
        prefix: "Kinesis_20131202",
        action: "ListStreams",
        version: "1.1",
        body: r#"{"Limit": 1}"#,
    };
    const MAX_ENTRIES: usize = 500;
    const MAX_BATCH_BYTES: usize = MAX_REQUEST_BYTES;
    const SYSTEM: &'static str = "aws_kinesis";
    const MAX_MESSAGE_BYTES: usize = MAX_RECORD_BYTES;
    type Entry = Value;

    fn client(&self) -> &AwsClient {
        &self.client
    }

    fn entry(&self, routed: &Routed) -> Result<(Value, usize), PublishError> {
        let data = envelope(routed)?;
        let key = partition_key(routed.event.ordering_key());
        let size = data.len() + key.len();
        if size > MAX_RECORD_BYTES {
            return Err(PublishError::new(
                PublishErrorKind::TooLarge,
                format!("the Kinesis record would be {size} bytes with the relay's envelope; Kinesis takes at most {MAX_RECORD_BYTES}"),
            ));
        }
        let data = base64::engine::general_purpose::STANDARD.encode(&data);
        Ok((json!({ "Data": data, "PartitionKey": key }), size))
    }

    fn send_entries(
        self: Arc<Self>,
        target: String,
        records: Arc<[Value]>,
    ) -> BoxFuture<'static, Result<Vec<Outcome>, PublishError>> {
        async move {
            let count = records.len();
            let arn = target.starts_with("arn:");
            let request = PutRecords {
                stream_name: (!arn).then_some(target.as_str()),
                stream_arn: arn.then_some(target.as_str()),
                records: &records,
            };
            let what = self.client.what("PutRecords");
            match self
                .client
                .json("Kinesis_20131202", "PutRecords", "1.1", &request)
                .await
            {
                // The answer lists every record, in the request's order.
                Ok(answer) => Ok(super::outcomes_in_order(
                    count,
                    &answer["Records"],
                    "SequenceNumber",
                    &what,
                )),
                Err(error) => Err(error),
            }
        }
        .boxed()
    }
}

/// A `PutRecords` request, encoded from the records without copying them.
#[derive(serde::Serialize)]
struct PutRecords<'a> {
    #[serde(rename = "StreamName", skip_serializing_if = "Option::is_none")]
    stream_name: Option<&'a str>,
    #[serde(rename = "StreamARN", skip_serializing_if = "Option::is_none")]
    stream_arn: Option<&'a str>,
    #[serde(rename = "Records")]
    records: &'a [Value],
}

pub fn sink(uri: &str, config: &AwsConfig, env: Env<'_>) -> Result<Arc<dyn Sink>, SinkSetupError> {
    super::no_uri_rest(uri, "kinesis", "the stream is the route's target")?;
    Ok(Arc::new(super::AwsSink::new(Kinesis {
        client: AwsClient::new(Service::Kinesis, config, env)?,
    })))
}
