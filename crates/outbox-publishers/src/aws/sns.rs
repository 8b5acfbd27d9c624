//! Amazon SNS (`sns:`): `PublishBatch`, the route's target naming the topic (its ARN, or its
//! name, made an ARN with the account STS `GetCallerIdentity` names, which needs no
//! permission).
//!
//! A FIFO topic (`.fifo`) gets `MessageGroupId` = the ordering key and
//! `MessageDeduplicationId` = the event id, like an SQS FIFO queue. Messages carry the same
//! attributes as SQS messages ([`super::message_attributes`]); subscribers see them as
//! message attributes (raw delivery) or in the notification's `MessageAttributes`.

use std::sync::Arc;

use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_core::{Outcome, PublishError, PublishErrorKind};
use tokio::sync::OnceCell;

use super::credentials::Env;
use super::{AwsClient, AwsConfig, BatchApi, Probe, Service};
use crate::error::SinkSetupError;
use crate::sink::{Routed, Sink};

/// SNS's largest message, and its largest batch request.
pub const MAX_MESSAGE_BYTES: usize = 262_144;

pub struct Sns {
    client: AwsClient,
    sts: AwsClient,
    account: OnceCell<String>,
}

/// One message's parameters, named relative to its `PublishBatchRequestEntries.member.N.`.
type Params = Vec<(String, String)>;

impl Sns {
    /// The topic's ARN: the target itself when it is one, else built from its name.
    async fn topic_arn(&self, target: &str) -> Result<String, PublishError> {
        if target.starts_with("arn:") {
            return Ok(target.to_string());
        }
        let account = self
            .account
            .get_or_try_init(|| async {
                let answer = self
                    .sts
                    .query(&[("Action", "GetCallerIdentity"), ("Version", "2011-06-15")])
                    .await?;
                super::xml::text(&answer, "Account").ok_or_else(|| {
                    PublishError::new(
                        PublishErrorKind::BrokerFailure,
                        "STS GetCallerIdentity answered without an Account",
                    )
                })
            })
            .await?;
        let region = self.client.region();
        Ok(format!(
            "arn:{}:sns:{region}:{account}:{target}",
            super::partition(region)
        ))
    }
}

impl BatchApi for Sns {
    const PROBE: Probe = Probe::Query {
        action: "ListTopics",
        version: "2010-03-31",
    };
    const MAX_ENTRIES: usize = 10;
    const MAX_BATCH_BYTES: usize = MAX_MESSAGE_BYTES;
    const SYSTEM: &'static str = "aws.sns";
    const MAX_MESSAGE_BYTES: usize = MAX_MESSAGE_BYTES;
    type Entry = Params;

    fn client(&self) -> &AwsClient {
        &self.client
    }

    fn entry(&self, routed: &Routed) -> Result<(Params, usize), PublishError> {
        let super::Message {
            body,
            attributes,
            size,
        } = super::message(routed, "SNS", MAX_MESSAGE_BYTES)?;
        let mut params = vec![("Message".to_string(), body)];
        for (n, (name, value)) in attributes.into_iter().enumerate() {
            let at = format!("MessageAttributes.entry.{}", n + 1);
            params.push((format!("{at}.Name"), name.to_string()));
            params.push((format!("{at}.Value.DataType"), "String".into()));
            params.push((format!("{at}.Value.StringValue"), value));
        }
        if routed.target.ends_with(".fifo") {
            let group = super::message_group(routed.event.ordering_key());
            params.push(("MessageGroupId".into(), group));
            let id = routed.event.event_id.hyphenated().to_string();
            params.push(("MessageDeduplicationId".into(), id));
        }
        Ok((params, size))
    }

    fn send_entries(
        self: Arc<Self>,
        target: String,
        entries: Arc<[Params]>,
    ) -> BoxFuture<'static, Result<Vec<Outcome>, PublishError>> {
        async move {
            let count = entries.len();
            let topic = match self.topic_arn(&target).await {
                Ok(topic) => topic,
                Err(error) => return Err(error),
            };
            let ids: Vec<String> = (0..count).map(|id| id.to_string()).collect();
            // Names are made per request; values are the entries' own, not copied.
            let mut params: Vec<(String, &str)> = vec![
                ("Action".into(), "PublishBatch"),
                ("Version".into(), "2010-03-31"),
                ("TopicArn".into(), &topic),
            ];
            for (id, entry) in entries.iter().enumerate() {
                let at = format!("PublishBatchRequestEntries.member.{}", id + 1);
                params.push((format!("{at}.Id"), &ids[id]));
                params.extend(entry.iter().map(|(k, v)| (format!("{at}.{k}"), v.as_str())));
            }
            let params: Vec<(&str, &str)> = params.iter().map(|(k, v)| (k.as_str(), *v)).collect();
            match self.client.query(&params).await {
                Ok(answer) => Ok(super::outcomes_by_id(
                    count,
                    &super::EntryAnswer::from_xml(&answer, "Successful"),
                    &super::EntryAnswer::from_xml(&answer, "Failed"),
                    &self.client.what("PublishBatch"),
                )),
                Err(error) => Err(error),
            }
        }
        .boxed()
    }
}

pub fn sink(uri: &str, config: &AwsConfig, env: Env<'_>) -> Result<Arc<dyn Sink>, SinkSetupError> {
    super::no_uri_rest(uri, "sns", "the topic is the route's target")?;
    let client = AwsClient::new(Service::Sns, config, env)?;
    let sts = client.sibling(Service::Sts, env)?;
    Ok(Arc::new(super::AwsSink::new(Sns {
        client,
        sts,
        account: OnceCell::new(),
    })))
}
