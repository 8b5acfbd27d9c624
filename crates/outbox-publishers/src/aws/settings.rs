//! The AWS sinks' settings.

use serde::{Deserialize, Serialize};

use crate::settings::{ConfirmTimeout, TlsFiles};

/// The settings every AWS sink reads (`[sinks.NAME]` with `sqs:`, `sns:`, `kinesis:` or
/// `eventbridge:`). Unknown keys are refused when the table is read (`config::read`): this
/// struct is also flattened into EventBridge's, so it cannot deny them itself.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(default)]
pub struct AwsConfig {
    #[serde(flatten)]
    pub timeout: ConfirmTimeout,
    #[serde(flatten)]
    pub tls: TlsFiles,
    /// The region [default: AWS_REGION, AWS_DEFAULT_REGION, then the profile's `region`].
    pub region: Option<String>,
    /// The service endpoint, for a VPC endpoint or a local stand-in [default: the service's
    /// own AWS_ENDPOINT_URL_SQS, _SNS, _KINESIS or _EVENTBRIDGE, then AWS_ENDPOINT_URL, then
    /// the region's public endpoint].
    pub endpoint: Option<String>,
    /// The profile in ~/.aws/config and ~/.aws/credentials [default: AWS_PROFILE, then
    /// `default`]. Environment credentials, then a web identity, come first.
    pub profile: Option<String>,
    /// Batch requests in flight at once [default: 16].
    pub concurrency: Option<usize>,
}

/// What `Detail` holds.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DetailForm {
    /// The relay's envelope, with the event id.
    #[default]
    Envelope,
    /// The payload alone (a JSON object).
    Payload,
}

/// An EventBridge sink's own settings (unknown keys are refused as for [`AwsConfig`]).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(default)]
pub struct EventBridgeConfig {
    #[serde(flatten)]
    pub aws: AwsConfig,
    /// The `DetailType` template [default: "{event_type}"].
    pub detail_type: Option<String>,
    /// `envelope` (the relay's JSON with the event id) or `payload` [default: envelope].
    pub detail: Option<DetailForm>,
}
