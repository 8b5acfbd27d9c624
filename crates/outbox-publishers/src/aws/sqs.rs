//! Amazon SQS (`sqs:`): `SendMessageBatch`, the route's target naming the queue (its name,
//! or its URL).
//!
//! A FIFO queue (`.fifo`) gets `MessageGroupId` = the ordering key and
//! `MessageDeduplicationId` = the event id, so per-key order and de-duplication are the
//! queue's own. A standard queue keeps neither: SQS may reorder and repeat, and consumers
//! drop repeats by the `outbox-event-id` attribute. The body is the payload; the event's
//! fields travel as message attributes ([`super::message_attributes`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_core::{Outcome, PublishError, PublishErrorKind};
use serde::Serialize;
use serde_json::{json, Map, Value};

use super::credentials::Env;
use super::{AwsClient, AwsConfig, BatchApi, Probe, Service};
use crate::error::SinkSetupError;
use crate::sink::{Routed, Sink};

/// SQS's largest message (body and attributes), and its largest batch request.
pub const MAX_MESSAGE_BYTES: usize = 1_048_576;

pub struct Sqs {
    client: AwsClient,
    /// Queue name -> URL, as `GetQueueUrl` answered.
    urls: Mutex<HashMap<String, String>>,
}

impl Sqs {
    /// The queue's URL: the target itself when it is one, else looked up once by name.
    async fn queue_url(&self, target: &str) -> Result<String, PublishError> {
        if target.starts_with("https://") || target.starts_with("http://") {
            return Ok(target.to_string());
        }
        if let Some(url) = self
            .urls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(target)
        {
            return Ok(url.clone());
        }
        let answer = self
            .client
            .json(
                "AmazonSQS",
                "GetQueueUrl",
                "1.0",
                &json!({ "QueueName": target }),
            )
            .await?;
        let url = answer["QueueUrl"].as_str().ok_or_else(|| {
            PublishError::new(
                PublishErrorKind::BrokerFailure,
                format!("SQS GetQueueUrl answered without a QueueUrl for {target:?}"),
            )
        })?;
        self.urls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(target.to_string(), url.to_string());
        Ok(url.to_string())
    }
}

impl BatchApi for Sqs {
    const PROBE: Probe = Probe::Json {
        prefix: "AmazonSQS",
        action: "ListQueues",
        version: "1.0",
        body: r#"{"MaxResults": 1}"#,
    };
    const MAX_ENTRIES: usize = 10;
    const MAX_BATCH_BYTES: usize = MAX_MESSAGE_BYTES;
    const SYSTEM: &'static str = "aws_sqs";
    const MAX_MESSAGE_BYTES: usize = MAX_MESSAGE_BYTES;
    type Entry = Map<String, Value>;

    fn client(&self) -> &AwsClient {
        &self.client
    }

    fn entry(&self, routed: &Routed) -> Result<(Self::Entry, usize), PublishError> {
        let super::Message {
            body,
            attributes,
            size,
        } = super::message(routed, "SQS", MAX_MESSAGE_BYTES)?;
        let mut entry = Map::new();
        entry.insert("MessageBody".into(), body.into());
        let attributes: Map<String, Value> = attributes
            .into_iter()
            .map(|(name, value)| {
                (
                    name.to_string(),
                    json!({ "DataType": "String", "StringValue": value }),
                )
            })
            .collect();
        entry.insert("MessageAttributes".into(), attributes.into());
        if routed.target.ends_with(".fifo") {
            let group = super::message_group(routed.event.ordering_key());
            entry.insert("MessageGroupId".into(), group.into());
            let id = routed.event.event_id.hyphenated().to_string();
            entry.insert("MessageDeduplicationId".into(), id.into());
        }
        Ok((entry, size))
    }

    fn send_entries(
        self: Arc<Self>,
        target: String,
        entries: Arc<[Self::Entry]>,
    ) -> BoxFuture<'static, Result<Vec<Outcome>, PublishError>> {
        async move {
            let count = entries.len();
            // The lookup is about no one entry: each fails with it, and the batch is not
            // sent again entry by entry (a lookup refused as permanent was repeated once
            // per entry, each then dead-lettered).
            let url = match self.queue_url(&target).await {
                Ok(url) => url,
                Err(error) => return Ok(crate::sink::fail_n(count, &error)),
            };
            let request = Batch {
                queue_url: &url,
                entries: entries
                    .iter()
                    .enumerate()
                    .map(|(id, entry)| WithId {
                        id: id.to_string(),
                        entry,
                    })
                    .collect(),
            };
            match self
                .client
                .json("AmazonSQS", "SendMessageBatch", "1.0", &request)
                .await
            {
                Ok(answer) => Ok(super::outcomes_by_id(
                    count,
                    &super::EntryAnswer::from_json(&answer["Successful"]),
                    &super::EntryAnswer::from_json(&answer["Failed"]),
                    &self.client.what("SendMessageBatch"),
                )),
                Err(error) => Err(error),
            }
        }
        .boxed()
    }
}

/// A `SendMessageBatch` request, encoded from the entries without copying them.
#[derive(Serialize)]
struct Batch<'a> {
    #[serde(rename = "QueueUrl")]
    queue_url: &'a str,
    #[serde(rename = "Entries")]
    entries: Vec<WithId<'a>>,
}

/// An entry with its `Id` in the request (its index).
#[derive(Serialize)]
struct WithId<'a> {
    #[serde(rename = "Id")]
    id: String,
    #[serde(flatten)]
    entry: &'a Map<String, Value>,
}

pub fn sink(uri: &str, config: &AwsConfig, env: Env<'_>) -> Result<Arc<dyn Sink>, SinkSetupError> {
    super::no_uri_rest(uri, "sqs", "the queue is the route's target")?;
    Ok(Arc::new(super::AwsSink::new(Sqs {
        client: AwsClient::new(Service::Sqs, config, env)?,
        urls: Mutex::default(),
    })))
}
