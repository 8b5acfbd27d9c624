//! AWS sinks: SQS, SNS, Kinesis Data Streams and EventBridge, through each service's batch
//! API (`SendMessageBatch`, `PublishBatch`, `PutRecords`, `PutEvents`).
//!
//! One small client serves all four: SigV4-signed `POST`s over the reqwest client the HTTP
//! sinks already use, the JSON protocol for SQS, Kinesis and EventBridge and the query
//! protocol for SNS. The official SDK (aws-config with the four service crates) would add
//! minutes of build time and megabytes of binary for four calls; BENCHMARKS.md has the
//! measured figures.
//!
//! What every AWS sink shares is here: the settings ([`AwsConfig`], in `settings.rs`), the endpoint and region
//! rules, the request ([`AwsClient`]), the one place AWS errors become publish outcomes
//! ([`classify`]), and the batching ([`send_batched`]): events are grouped by target, cut
//! into the service's batches by count and bytes, the batches sent concurrently, and each
//! event's outcome taken from its own entry, so only the failed entries are retried.

pub mod credentials;
pub mod eventbridge;
pub mod kinesis;
pub mod metadata;
pub mod settings;
pub mod sigv4;
pub mod sns;
pub mod sqs;
pub mod xml;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::future::{join_all, BoxFuture};
use futures::FutureExt;
use outbox_core::{Outcome, PublishError, PublishErrorKind};
use serde::Serialize;
use serde_json::Value;
use tokio::sync::Semaphore;

use crate::config::{SinkConfig, SinkSettings};
use crate::error::SinkSetupError;
use crate::sink::{Routed, Sink};
use credentials::{Env, Provider};
pub use settings::AwsConfig;

/// Requests in flight at once per sink.
pub const DEFAULT_CONCURRENCY: usize = 16;

/// The AWS services the sinks call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Service {
    Sqs,
    Sns,
    Kinesis,
    EventBridge,
    Sts,
}

impl Service {
    /// The name in signatures and in public endpoints' host names.
    fn signing_name(self) -> &'static str {
        match self {
            Service::Sqs => "sqs",
            Service::Sns => "sns",
            Service::Kinesis => "kinesis",
            Service::EventBridge => "events",
            Service::Sts => "sts",
        }
    }

    /// The SDKs' per-service endpoint variable.
    fn endpoint_env(self) -> &'static str {
        match self {
            Service::Sqs => "AWS_ENDPOINT_URL_SQS",
            Service::Sns => "AWS_ENDPOINT_URL_SNS",
            Service::Kinesis => "AWS_ENDPOINT_URL_KINESIS",
            Service::EventBridge => "AWS_ENDPOINT_URL_EVENTBRIDGE",
            Service::Sts => "AWS_ENDPOINT_URL_STS",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Service::Sqs => "SQS",
            Service::Sns => "SNS",
            Service::Kinesis => "Kinesis",
            Service::EventBridge => "EventBridge",
            Service::Sts => "STS",
        }
    }
}

/// The domain of a region's public endpoints.
fn dns_suffix(region: &str) -> &'static str {
    if region.starts_with("cn-") {
        "amazonaws.com.cn"
    } else {
        "amazonaws.com"
    }
}

/// The partition of ARNs in a region.
pub fn partition(region: &str) -> &'static str {
    if region.starts_with("cn-") {
        "aws-cn"
    } else if region.starts_with("us-gov-") {
        "aws-us-gov"
    } else {
        "aws"
    }
}

/// What the sink URI holds after its scheme. It carries nothing else (but EventBridge's
/// bus): the target comes from the route, the region and endpoint from the settings.
fn uri_rest<'a>(uri: &'a str, scheme: &str) -> &'a str {
    let rest = uri.trim().strip_prefix(scheme).unwrap_or_default();
    let rest = rest.strip_prefix(':').unwrap_or(rest);
    rest.strip_prefix("//").unwrap_or(rest)
}

/// Refuses a URI with more than its scheme, saying where that part belongs.
fn no_uri_rest(uri: &str, scheme: &str, target: &str) -> Result<(), SinkSetupError> {
    match uri_rest(uri, scheme) {
        "" => Ok(()),
        // What follows the scheme is not quoted: it may be credentials.
        _ => Err(SinkSetupError::config(format!(
            "the sink URI is just `{scheme}:`, with nothing after it: {target}, `region` and \
             `endpoint` are settings of the sink, and credentials come from the environment \
             (AWS_ACCESS_KEY_ID, a profile, a role)"
        ))),
    }
}

/// Builds the AWS sink `config` names, reading credentials, region and endpoints from `env`
/// where its settings leave them out (the relay gives the process environment).
pub fn sink(config: &SinkConfig, env: Env<'_>) -> Result<Arc<dyn crate::Sink>, SinkSetupError> {
    let uri = config.uri().trim();
    match config.settings() {
        SinkSettings::Sqs(settings) => sqs::sink(uri, settings, env),
        SinkSettings::Sns(settings) => sns::sink(uri, settings, env),
        SinkSettings::Kinesis(settings) => kinesis::sink(uri, settings, env),
        SinkSettings::EventBridge(settings) => eventbridge::sink(uri, settings, env),
        _ => Err(SinkSetupError::config(format!("{uri:?} names no AWS sink"))),
    }
}

/// An AWS sink: one [`BatchApi`] behind the [`Sink`] contract.
pub struct AwsSink<A: BatchApi>(Arc<A>);

impl<A: BatchApi> AwsSink<A> {
    pub fn new(api: A) -> Self {
        AwsSink(Arc::new(api))
    }
}

impl<A: BatchApi> Sink for AwsSink<A> {
    fn describe(&self) -> String {
        let client = self.0.client();
        outbox_core::redact::redact_url(&format!(
            "{} at {} ({}, credentials from {})",
            client.service.name(),
            client.endpoint(),
            client.region(),
            client.credentials_origin()
        ))
    }

    fn send(&self, batch: Vec<Routed>) -> BoxFuture<'static, Vec<Outcome>> {
        send_batched(self.0.clone(), batch)
    }

    /// Whether the service answers a signed call and takes the credentials.
    fn health(&self) -> BoxFuture<'static, Result<(), PublishError>> {
        let api = self.0.clone();
        async move { api.client().probe(A::PROBE).await }.boxed()
    }

    fn max_message_bytes(&self) -> Option<usize> {
        Some(A::MAX_MESSAGE_BYTES)
    }

    /// The service's own limit.
    fn limit_is_fixed(&self) -> bool {
        true
    }

    fn messaging_system(&self) -> Option<&'static str> {
        Some(A::SYSTEM)
    }
}

/// Outcomes from an answer that lists `Successful` and `Failed` entries by their `Id` (the
/// entry's index), as SQS and SNS answer. An entry in neither list is not confirmed.
fn outcomes_by_id(
    count: usize,
    successful: &[EntryAnswer],
    failed: &[EntryAnswer],
    what: &str,
) -> Vec<Outcome> {
    let mut outcomes: Vec<Option<Outcome>> = (0..count).map(|_| None).collect();
    for answer in successful {
        if let Some(slot) = answer.id.and_then(|id| outcomes.get_mut(id)) {
            *slot = Some(Ok(()));
        }
    }
    for answer in failed {
        if let Some(slot) = answer.id.and_then(|id| outcomes.get_mut(id)) {
            *slot = Some(Err(entry_error(
                &answer.code,
                &answer.message,
                answer.sender_fault,
                what,
            )));
        }
    }
    outcomes
        .into_iter()
        .map(|o| o.unwrap_or_else(|| Err(unconfirmed(what))))
        .collect()
}

/// The failure of an entry the service's answer did not mention: not confirmed, retried.
fn unconfirmed(what: &str) -> PublishError {
    PublishError::new(
        PublishErrorKind::BrokerFailure,
        format!("{what} answered without this entry"),
    )
}

/// One entry of a batch answer.
#[derive(Default)]
struct EntryAnswer {
    id: Option<usize>,
    code: String,
    message: String,
    sender_fault: Option<bool>,
}

impl EntryAnswer {
    /// The entries of a JSON answer's list.
    fn from_json(list: &Value) -> Vec<EntryAnswer> {
        let text = |v: &Value, k: &str| v[k].as_str().unwrap_or_default().to_string();
        list.as_array()
            .map(|entries| {
                entries
                    .iter()
                    .map(|e| EntryAnswer {
                        id: e["Id"].as_str().and_then(|id| id.parse().ok()),
                        code: text(e, "Code"),
                        message: text(e, "Message"),
                        sender_fault: e["SenderFault"].as_bool(),
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The `<member>`s of a query answer's list.
    fn from_xml(document: &str, list: &str) -> Vec<EntryAnswer> {
        xml::members(document, list)
            .into_iter()
            .map(|m| EntryAnswer {
                id: xml::text(m, "Id").and_then(|id| id.parse().ok()),
                code: xml::text(m, "Code").unwrap_or_default(),
                message: xml::text(m, "Message").unwrap_or_default(),
                sender_fault: xml::text(m, "SenderFault").map(|f| f == "true"),
            })
            .collect()
    }
}

/// Where a service's requests go, and the `Host` and path its signatures cover.
struct Endpoint {
    url: String,
    host: String,
    path: String,
}

impl Endpoint {
    /// `explicit` (a setting or variable), else the region's public endpoint.
    fn resolve(
        service: Service,
        region: &str,
        explicit: Option<String>,
    ) -> Result<Endpoint, SinkSetupError> {
        let url = explicit.unwrap_or_else(|| {
            format!(
                "https://{}.{region}.{}",
                service.signing_name(),
                dns_suffix(region)
            )
        });
        let parsed = reqwest::Url::parse(&url).map_err(|e| {
            SinkSetupError::config(format!(
                "the {} endpoint {url:?} is not a URL ({e}): write it like \
                 https://sqs.eu-west-1.amazonaws.com",
                service.name()
            ))
        })?;
        let host = match (parsed.host_str(), parsed.port()) {
            (Some(host), Some(port)) => format!("{host}:{port}"),
            (Some(host), None) => host.to_string(),
            (None, _) => {
                return Err(SinkSetupError::config(format!(
                    "the {} endpoint {url:?} has no host",
                    service.name()
                )))
            }
        };
        Ok(Endpoint {
            path: parsed.path().to_string(),
            host,
            url,
        })
    }
}

/// A signed client for one AWS service.
pub struct AwsClient {
    http: reqwest::Client,
    service: Service,
    region: String,
    endpoint: String,
    /// The `Host` header the signature covers.
    host: String,
    path: String,
    credentials: Arc<Provider>,
    requests: Arc<Semaphore>,
    /// The size of `requests`: the `concurrency` setting.
    concurrency: usize,
    /// The sink's timeout, of which a batch's request waits for one of the `concurrency`
    /// slots half ([`AwsClient::slot`]).
    timeout: Duration,
}

impl AwsClient {
    /// A client whose credentials, region and endpoint come from `config`, then from `env`
    /// (the process environment; tests give their own).
    pub fn new(service: Service, config: &AwsConfig, env: Env<'_>) -> Result<Self, SinkSetupError> {
        let http = crate::http::client(&config.tls, config.timeout.get())?;
        if config.concurrency == Some(0) {
            return Err(SinkSetupError::config(
                "`concurrency` = 0 would never send a request: use 1 or more (default 16)",
            ));
        }
        let concurrency = config.concurrency.unwrap_or(DEFAULT_CONCURRENCY);
        let found = Provider::from_chain(
            env,
            config.profile.as_deref(),
            config.region.as_deref(),
            http.clone(),
        )?;
        let set = |name: &str| env(name).filter(|v| !v.trim().is_empty());
        let region = config
            .region
            .clone()
            .or_else(|| set("AWS_REGION"))
            .or_else(|| set("AWS_DEFAULT_REGION"))
            .or(found.profile_region)
            .ok_or_else(|| {
                SinkSetupError::config(format!(
                    "no AWS region for the {} sink: set `region` in its settings, or AWS_REGION",
                    service.name()
                ))
            })?;
        let explicit = config
            .endpoint
            .clone()
            .or_else(|| set(service.endpoint_env()))
            .or_else(|| set("AWS_ENDPOINT_URL"));
        let Endpoint {
            url: endpoint,
            host,
            path,
        } = Endpoint::resolve(service, &region, explicit)?;
        Ok(AwsClient {
            http,
            service,
            region,
            path,
            endpoint,
            host,
            credentials: found.provider,
            requests: Arc::new(Semaphore::new(concurrency)),
            concurrency,
            timeout: config.timeout.get(),
        })
    }

    /// One of the `concurrency` request slots, whenever one comes free.
    async fn slot_whenever(&self) -> tokio::sync::OwnedSemaphorePermit {
        (self.requests.clone().acquire_owned().await).expect("the semaphore is never closed")
    }

    /// One of the `concurrency` request slots, if one comes free by `until`
    /// ([`crate::sink::in_turn`]).
    async fn slot(
        &self,
        until: tokio::time::Instant,
    ) -> Result<tokio::sync::OwnedSemaphorePermit, PublishError> {
        let held = || {
            format!(
                "the sink's {} requests at a time were all busy",
                self.concurrency
            )
        };
        let slot = self.requests.clone().acquire_owned();
        let slot = crate::sink::in_turn(until, slot, self.service.name(), held).await?;
        Ok(slot.expect("the semaphore is never closed"))
    }

    /// A client for another service with the same credentials and region (SNS asks STS
    /// for the account of a topic named without its ARN).
    fn sibling(&self, service: Service, env: Env<'_>) -> Result<AwsClient, SinkSetupError> {
        // A custom endpoint outside AWS is a stand-in (LocalStack, moto) serving every
        // service; a VPC endpoint is one service's.
        let stand_in = (!self.endpoint.contains(".amazonaws.com")).then(|| self.endpoint.clone());
        let explicit = env(service.endpoint_env())
            .or_else(|| env("AWS_ENDPOINT_URL"))
            .or(stand_in);
        let Endpoint { url, host, path } = Endpoint::resolve(service, &self.region, explicit)?;
        Ok(AwsClient {
            http: self.http.clone(),
            service,
            region: self.region.clone(),
            host,
            path,
            endpoint: url,
            credentials: self.credentials.clone(),
            requests: self.requests.clone(),
            concurrency: self.concurrency,
            timeout: self.timeout,
        })
    }

    pub fn region(&self) -> &str {
        &self.region
    }

    /// The endpoint, for `describe`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Where the credentials come from.
    pub fn credentials_origin(&self) -> &str {
        self.credentials.origin()
    }

    pub(crate) fn what(&self, action: &str) -> String {
        format!("{} {action} at {}", self.service.name(), self.endpoint)
    }

    /// One signed POST; the response's status and body.
    async fn post(
        &self,
        headers: &[(&str, &str)],
        body: Vec<u8>,
        action: &str,
    ) -> Result<(u16, Option<String>, String), PublishError> {
        let credentials = self.credentials.get().await?;
        let signed = sigv4::sign(
            &sigv4::Request {
                host: &self.host,
                path: &self.path,
                headers,
                body: &body,
            },
            &sigv4::Scope {
                service: self.service.signing_name(),
                region: &self.region,
            },
            &credentials,
            SystemTime::now(),
        );
        let mut request = self.http.post(&self.endpoint);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        for (name, value) in signed {
            request = request.header(name, value);
        }
        let what = self.what(action);
        let response = request
            .body(body)
            .send()
            .await
            .map_err(|e| crate::http::transport_error(e, &what))?;
        let status = response.status().as_u16();
        let query_error = response
            .headers()
            .get("x-amzn-query-error")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let text = if (200..300).contains(&status) {
            response
                .text()
                .await
                .map_err(|e| crate::http::transport_error(e, &what))?
        } else {
            crate::http::bounded_text(response, crate::http::ERROR_BODY_LIMIT).await
        };
        Ok((status, query_error, text))
    }

    /// A JSON-protocol call (`X-Amz-Target: {prefix}.{action}`); the response document.
    pub async fn json(
        &self,
        target_prefix: &str,
        action: &str,
        json_version: &str,
        body: &(impl Serialize + ?Sized),
    ) -> Result<Value, PublishError> {
        let answer = self
            .json_answer(target_prefix, action, json_version, body)
            .await?;
        self.accepted(answer, action).await
    }

    /// A query-protocol call (form parameters, an XML answer).
    pub async fn query(&self, params: &[(&str, &str)]) -> Result<String, PublishError> {
        let action = params
            .iter()
            .find(|(k, _)| *k == "Action")
            .map_or("", |(_, v)| *v);
        let answer = self.query_answer(params).await?;
        self.accepted(answer, action).await
    }

    /// Whether the service answers and takes the credentials: a listing call the relay's
    /// role need not be allowed (a refused permission proves both as well as a listing).
    pub async fn probe(&self, probe: Probe) -> Result<(), PublishError> {
        let (answer, action) = match probe {
            Probe::Json {
                prefix,
                action,
                version,
                body,
            } => {
                let body: Value = serde_json::from_str(body).unwrap_or(Value::Null);
                let answer = self.json_answer(prefix, action, version, &body).await?;
                (answer.map(|_| String::new()), action)
            }
            Probe::Query { action, version } => {
                let answer = self
                    .query_answer(&[("Action", action), ("Version", version)])
                    .await?;
                (answer, action)
            }
        };
        match answer {
            Answer::Refused { code, .. }
                if matches!(
                    short_code(&code).as_ref(),
                    "AccessDenied" | "AccessDeniedException" | "AuthorizationError"
                ) =>
            {
                Ok(())
            }
            answer => self.accepted(answer, action).await.map(|_| ()),
        }
    }

    async fn json_answer(
        &self,
        target_prefix: &str,
        action: &str,
        json_version: &str,
        body: &(impl Serialize + ?Sized),
    ) -> Result<Answer<Value>, PublishError> {
        let target = format!("{target_prefix}.{action}");
        let content_type = format!("application/x-amz-json-{json_version}");
        let body = serde_json::to_vec(body).map_err(|e| {
            PublishError::new(PublishErrorKind::Encoding, "cannot encode the request")
                .with_source(e)
        })?;
        let (status, query_error, text) = self
            .post(
                &[("content-type", &content_type), ("x-amz-target", &target)],
                body,
                action,
            )
            .await?;
        let document: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        if (200..300).contains(&status) {
            return Ok(Answer::Ok(document));
        }
        // SQS names its query-protocol code in a header too: the one its docs list.
        let code = query_error
            .as_deref()
            .and_then(|h| h.split(';').next())
            .or_else(|| document["__type"].as_str())
            .or_else(|| document["code"].as_str())
            .unwrap_or_default()
            .to_string();
        let message = document["message"]
            .as_str()
            .or_else(|| document["Message"].as_str())
            .unwrap_or(&text)
            .to_string();
        Ok(Answer::Refused {
            status,
            code,
            message,
        })
    }

    async fn query_answer(&self, params: &[(&str, &str)]) -> Result<Answer<String>, PublishError> {
        let action = params
            .iter()
            .find(|(k, _)| *k == "Action")
            .map_or("", |(_, v)| *v);
        let body = form_encode(params);
        let (status, _, text) = self
            .post(
                &[(
                    "content-type",
                    "application/x-www-form-urlencoded; charset=utf-8",
                )],
                body.into_bytes(),
                action,
            )
            .await?;
        if (200..300).contains(&status) {
            return Ok(Answer::Ok(text));
        }
        let (code, message) = xml_code_and_message(&text);
        Ok(Answer::Refused {
            status,
            code,
            message,
        })
    }

    /// The answer's document, or its refusal classified.
    async fn accepted<T>(&self, answer: Answer<T>, action: &str) -> Result<T, PublishError> {
        match answer {
            Answer::Ok(document) => Ok(document),
            Answer::Refused {
                status,
                code,
                message,
            } => {
                let error = classify(Some(status), &code, &message, &self.what(action));
                self.on_refusal(&error, &code).await;
                Err(error)
            }
        }
    }

    /// Expired temporary credentials are fetched again for the next attempt.
    async fn on_refusal(&self, _error: &PublishError, code: &str) {
        if matches!(
            short_code(code).as_ref(),
            "ExpiredToken" | "ExpiredTokenException" | "RequestExpired"
        ) {
            self.credentials.forget().await;
        }
    }
}

/// A service's answer: accepted, or refused with its error code.
enum Answer<T> {
    Ok(T),
    Refused {
        status: u16,
        code: String,
        message: String,
    },
}

impl<T> Answer<T> {
    fn map<U>(self, f: impl FnOnce(T) -> U) -> Answer<U> {
        match self {
            Answer::Ok(t) => Answer::Ok(f(t)),
            Answer::Refused {
                status,
                code,
                message,
            } => Answer::Refused {
                status,
                code,
                message,
            },
        }
    }
}

/// The cheap call a sink's health check makes (see [`AwsClient::probe`]).
pub enum Probe {
    Json {
        prefix: &'static str,
        action: &'static str,
        version: &'static str,
        body: &'static str,
    },
    Query {
        action: &'static str,
        version: &'static str,
    },
}

/// `application/x-www-form-urlencoded`, with the encoding SigV4 and AWS expect.
pub(crate) fn form_encode(params: &[(&str, &str)]) -> String {
    const UNRESERVED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'_')
        .remove(b'.')
        .remove(b'~');
    params
        .iter()
        .map(|(k, v)| {
            format!(
                "{}={}",
                percent_encoding::utf8_percent_encode(k, UNRESERVED),
                percent_encoding::utf8_percent_encode(v, UNRESERVED)
            )
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// The error of a query-protocol (XML) answer.
fn query_error(status: u16, body: &str, what: &str) -> PublishError {
    let (code, message) = xml_code_and_message(body);
    classify(Some(status), &code, &message, what)
}

/// A query-protocol refusal's `<Code>` and `<Message>`.
fn xml_code_and_message(body: &str) -> (String, String) {
    let code = xml::text(body, "Code").unwrap_or_default();
    let message = xml::text(body, "Message").unwrap_or_else(|| body.chars().take(300).collect());
    (code, message)
}

/// The code without its namespace: `com.amazonaws.kinesis#ResourceNotFoundException` and
/// `AWS.SimpleQueueService.NonExistentQueue` become their last part.
fn short_code(code: &str) -> std::borrow::Cow<'_, str> {
    let code = code.rsplit('#').next().unwrap_or(code);
    let code = code.strip_prefix("AWS.SimpleQueueService.").unwrap_or(code);
    // SQS names KMS's errors `KMS.ThrottlingException` and the like: KMS's own names, as
    // the other services give them (stripped, `KMS.NotFoundException` was a missing queue).
    match code.strip_prefix("KMS.") {
        Some(kms) if !kms.starts_with("KMS") => format!("KMS{kms}").into(),
        Some(kms) => kms.into(),
        None => code.into(),
    }
}

/// The one place an AWS error becomes a publish outcome, by its error code first and its
/// HTTP status (none for one entry of a batch) second: throttling and service failures are
/// retried, a missing queue, topic, stream or bus is retried (it may be created), expired
/// temporary credentials are retried with fresh ones, a refused signature or permission is
/// unauthorised, and any other validation error is permanent.
pub fn classify(status: Option<u16>, code: &str, message: &str, what: &str) -> PublishError {
    use PublishErrorKind::*;
    let short = short_code(code);
    let short = short.as_ref();
    let kind = match short {
        "Throttling"
        | "ThrottlingException"
        | "ThrottledException"
        // SNS's wire code for ThrottledException, which a batch entry carries alone.
        | "Throttled"
        | "RequestThrottled"
        | "RequestThrottledException"
        | "TooManyRequestsException"
        | "ProvisionedThroughputExceededException"
        | "RequestLimitExceeded"
        | "LimitExceededException"
        | "KMSThrottlingException"
        | "KMSThrottling"
        | "SlowDown" => Throttled,
        "RequestTimeout" | "RequestTimeoutException" => Timeout,
        "InternalFailure"
        | "InternalError"
        | "InternalServerError"
        | "ServiceUnavailable"
        | "ServiceUnavailableException"
        | "KMSInternalException" => BrokerFailure,
        // Expired temporary credentials, a clock that drifted, an identity provider STS
        // could not reach: fixed by the next attempt (fresh credentials) or by time.
        "ExpiredToken"
        | "ExpiredTokenException"
        | "RequestExpired"
        | "RequestTimeTooSkewed"
        | "IDPCommunicationError" => Unavailable,
        "InvalidSignatureException" | "SignatureDoesNotMatch"
            if message.contains("Signature expired") =>
        {
            Unavailable
        }
        // `InvalidAddress`: a queue URL of another region or account than the endpoint's,
        // the route's target as wrong as a missing queue (it dead-lettered every event).
        "QueueDoesNotExist"
        | "NonExistentQueue"
        | "NotFound"
        | "NotFoundException"
        | "ResourceNotFoundException"
        | "InvalidAddress" => MissingTarget,
        // An endpoint that does not speak this service's API (a wrong `endpoint`, a
        // stand-in without it): the sink's condition, whatever the event.
        "UnsupportedOperation"
        | "UnknownOperationException"
        | "InvalidAction" => Unavailable,
        "BatchRequestTooLong" | "RequestEntityTooLarge" | "RequestEntityTooLargeException" => {
            TooLarge
        }
        // A queue whose `MaximumMessageSize` is below SQS's own limit.
        "InvalidParameterValue" if message.contains("must be shorter than") => TooLarge,
        "AccessDenied"
        | "AccessDeniedException"
        | "AuthorizationError"
        | "UnrecognizedClientException"
        | "InvalidClientTokenId"
        | "SignatureDoesNotMatch"
        | "InvalidSignatureException"
        | "IncompleteSignature"
        | "MissingAuthenticationToken"
        | "InvalidIdentityToken"
        | "KMSAccessDeniedException"
        | "KMSAccessDenied"
        // EventBridge's per-entry refusals of a `Source` or `DetailType` the role may not put
        // (an IAM condition not granted yet): entries carry no HTTP status to tell them by.
        | "NotAuthorizedForSourceException"
        | "NotAuthorizedForDetailTypeException"
        // A key disabled, deleted, pending import or not yet usable: the sink's key, not the
        // event, is wrong; retried (as a refused permission is) until an operator fixes it,
        // rather than every event dead-lettered (SQS `KMS.DisabledException` and the like,
        // SNS `KMSDisabled`, Kinesis `KMSDisabledException`).
        | "KMSDisabled"
        | "KMSDisabledException"
        | "DisabledException"
        | "KMSNotFound"
        | "KMSNotFoundException"
        | "KMSInvalidState"
        | "KMSInvalidStateException"
        | "InvalidStateException"
        | "KMSOptInRequired"
        | "KMSInvalidKeyUsageException"
        | "InvalidKeyUsageException" => Unauthorized,
        // No AWS error code at all: not the service's answer to the event, but a redirect,
        // a proxy's page, a wrong endpoint path. The sink's condition, retried: refusing it
        // as the event's dead-lettered every event in turn, each sent alone.
        "" => match status {
            Some(429) => Throttled,
            Some(413) => TooLarge,
            Some(401 | 403) => Unauthorized,
            Some(408) => Timeout,
            Some(500..=599) => BrokerFailure,
            _ => Unavailable,
        },
        _ => match status {
            Some(429) => Throttled,
            Some(413) => TooLarge,
            Some(401 | 403) => Unauthorized,
            Some(500..=599) => BrokerFailure,
            _ => Rejected,
        },
    };
    let shown = if short.is_empty() {
        status.map(|s| format!("HTTP {s}")).unwrap_or_default()
    } else {
        short.to_string()
    };
    // A refused signature quotes the request it expected, session token header and all:
    // what follows is never shown.
    let said = ["The Canonical String", "The String-to-Sign"]
        .iter()
        .filter_map(|quoted| message.find(quoted))
        .min()
        .map_or(message, |at| &message[..at]);
    let detail: String = said.trim_end().chars().take(300).collect();
    let hint = match (kind, short) {
        (_, "InvalidAddress") => {
            ": the queue URL's region and account must be the sink's (its `region` and \
             `endpoint`); fix the route's target, or the sink's region"
        }
        (_, "ExpiredToken" | "ExpiredTokenException") => {
            ": temporary credentials from the environment or a profile cannot be renewed by \
             the relay: give it fresh ones and restart it, or use a role (web identity, \
             container or instance credentials), which it renews"
        }
        // A signature refused as expired is the clock's too (classified unavailable above).
        (
            Unavailable,
            "RequestExpired"
            | "RequestTimeTooSkewed"
            | "InvalidSignatureException"
            | "SignatureDoesNotMatch",
        ) => ": the host's clock is off: check its time synchronisation (NTP)",
        (_, "UnsupportedOperation" | "UnknownOperationException" | "InvalidAction") => {
            ": the sink's endpoint does not serve this API: check its `endpoint` and URI"
        }
        (_, "InvalidParameterValue") if kind == TooLarge => {
            ": raise the queue's MaximumMessageSize, or set the sink's max_message_bytes to it"
        }
        (MissingTarget, _) => ": create it, or fix the route's target",
        (Unauthorized, _) => ": check the relay's credentials and its IAM policy",
        _ => "",
    };
    PublishError::new(kind, format!("{what} refused: {shown}: {detail}{hint}"))
}

/// The failure of one entry of a batch: `sender_fault` false (the service's side) is
/// retried whatever the code.
pub fn entry_error(
    code: &str,
    message: &str,
    sender_fault: Option<bool>,
    what: &str,
) -> PublishError {
    let error = classify(None, code, message, what);
    match sender_fault {
        Some(false) if error.disposition() == outbox_core::Disposition::Permanent => {
            PublishError::new(PublishErrorKind::BrokerFailure, error.to_string())
        }
        _ => error,
    }
}

/// One AWS batch API: how an event becomes an entry, and how a batch of entries to one
/// target is sent. [`send_batched`] does the rest.
pub trait BatchApi: Send + Sync + 'static {
    /// The `messaging.system` of the semantic conventions.
    const SYSTEM: &'static str;
    /// The largest payload the service takes (the entry checks the whole message).
    const MAX_MESSAGE_BYTES: usize;
    /// Most entries in one request.
    const MAX_ENTRIES: usize;
    /// Most bytes of entries in one request, as the service counts them.
    const MAX_BATCH_BYTES: usize;
    /// The health check's call.
    const PROBE: Probe;
    /// Cloned only to send an entry again on its own (see [`send_batched`]).
    type Entry: Clone + Send + Sync + 'static;

    fn client(&self) -> &AwsClient;

    /// The entry for one event and its size as the service counts it; an event the service
    /// would refuse (too large, not encodable) fails here alone, never its batch.
    fn entry(&self, routed: &Routed) -> Result<(Self::Entry, usize), PublishError>;

    /// Sends entries (at most `MAX_ENTRIES`, `MAX_BATCH_BYTES`) to `target`: one outcome
    /// per entry, in order, or the error of the request as a whole. The request is encoded
    /// from the shared entries, which are not copied on the way.
    fn send_entries(
        self: Arc<Self>,
        target: String,
        entries: Arc<[Self::Entry]>,
    ) -> BoxFuture<'static, Result<Vec<Outcome>, PublishError>>;
}

/// Sends a batch through `api`: by target, cut to the service's limits, concurrently.
pub fn send_batched<A: BatchApi>(
    api: Arc<A>,
    batch: Vec<Routed>,
) -> BoxFuture<'static, Vec<Outcome>> {
    let mut outcomes: Vec<Option<Outcome>> = Vec::with_capacity(batch.len());
    // target -> (position in the batch, entry, size), in batch order.
    let mut by_target: BTreeMap<String, Vec<(usize, A::Entry, usize)>> = BTreeMap::new();
    for (position, routed) in batch.iter().enumerate() {
        match api.entry(routed) {
            Ok((entry, size)) => {
                outcomes.push(None);
                by_target
                    .entry(routed.target.clone())
                    .or_default()
                    .push((position, entry, size));
            }
            Err(error) => outcomes.push(Some(Err(error))),
        }
    }
    let mut requests = Vec::new();
    for (target, entries) in by_target {
        let mut chunk: Vec<(usize, A::Entry)> = Vec::new();
        let mut bytes = 0;
        for (position, entry, size) in entries {
            if !chunk.is_empty()
                && (chunk.len() == A::MAX_ENTRIES || bytes + size > A::MAX_BATCH_BYTES)
            {
                requests.push((target.clone(), std::mem::take(&mut chunk)));
                bytes = 0;
            }
            bytes += size;
            chunk.push((position, entry));
        }
        if !chunk.is_empty() {
            requests.push((target, chunk));
        }
    }
    let until = crate::sink::turn_deadline(api.client().timeout);
    let sent: Vec<_> = requests
        .into_iter()
        .map(|(target, chunk)| {
            let (positions, entries): (Vec<usize>, Vec<A::Entry>) = chunk.into_iter().unzip();
            let api = api.clone();
            async move {
                let results = send_chunk(api, target, entries, until).await;
                positions.into_iter().zip(results).collect::<Vec<_>>()
            }
        })
        .collect();
    async move {
        for (position, outcome) in join_all(sent).await.into_iter().flatten() {
            outcomes[position] = Some(outcome);
        }
        outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Err(unconfirmed("the service"))))
            .collect()
    }
    .boxed()
}

/// Sends one chunk. A request refused as a whole for good (a validation error, too large)
/// may be one entry's fault: its entries are then sent one by one, so only that entry
/// fails and the others are delivered. Refused credentials fail them all (each would be
/// refused alike), and a retryable failure fails them all, to be retried.
async fn send_chunk<A: BatchApi>(
    api: Arc<A>,
    target: String,
    entries: Vec<A::Entry>,
    until: tokio::time::Instant,
) -> Vec<Outcome> {
    let count = entries.len();
    let entries: Arc<[A::Entry]> = entries.into();
    let slot = match api.client().slot(until).await {
        Ok(slot) => slot,
        Err(not_sent) => return crate::sink::fail_n(count, &not_sent),
    };
    let sent = api
        .clone()
        .send_entries(target.clone(), entries.clone())
        .await;
    drop(slot);
    let error = match sent {
        Ok(outcomes) => return outcomes,
        Err(error) => error,
    };
    let permanent = error.disposition() == outbox_core::Disposition::Permanent;
    if !permanent || error.kind() == PublishErrorKind::Unauthorized || count == 1 {
        return crate::sink::fail_n(count, &error);
    }
    let alone = entries.iter().map(|entry| {
        let api = api.clone();
        let target = target.clone();
        let entry: Arc<[A::Entry]> = Arc::new([entry.clone()]);
        async move {
            // Waited for however long it takes: given back unsent past a deadline, the entry
            // the service refuses would never be counted, and would come back in every
            // batch with the entries of its request.
            let _slot = api.client().slot_whenever().await;
            match api.send_entries(target, entry).await {
                Ok(mut outcomes) => outcomes
                    .pop()
                    .unwrap_or_else(|| Err(unconfirmed("the service"))),
                Err(error) => Err(error),
            }
        }
    });
    join_all(alone).await
}

/// The event's attributes as SQS and SNS carry them (at most 10 per message, so the
/// event's own headers travel as one JSON attribute): the event id, type, ordering key,
/// sequence and mutation ids, the valid trace context, the headers.
pub fn message_attributes(routed: &Routed) -> Vec<(&'static str, String)> {
    let event = &routed.event;
    let mut attributes = vec![
        (ATTRIBUTE_EVENT_ID, event.event_id.hyphenated().to_string()),
        (ATTRIBUTE_EVENT_TYPE, event.event_type.clone()),
        (ATTRIBUTE_KEY, event.ordering_key().to_string()),
        (ATTRIBUTE_SEQUENCE_ID, event.sequence_id.to_string()),
    ];
    if let Some(mutation) = &event.mutation_id {
        attributes.push((ATTRIBUTE_MUTATION_ID, mutation.clone()));
    }
    attributes.extend(crate::trace::trace_fields(event));
    if !event.headers.is_empty() {
        if let Ok(headers) = serde_json::to_string(&event.headers) {
            attributes.push((ATTRIBUTE_HEADERS, headers));
        }
    }
    attributes.retain(|(_, value)| !value.is_empty());
    attributes
}

pub const ATTRIBUTE_EVENT_ID: &str = "outbox-event-id";
pub const ATTRIBUTE_EVENT_TYPE: &str = "outbox-event-type";
pub const ATTRIBUTE_KEY: &str = "outbox-key";
pub const ATTRIBUTE_SEQUENCE_ID: &str = "outbox-sequence-id";
pub const ATTRIBUTE_MUTATION_ID: &str = "outbox-mutation-id";
pub const ATTRIBUTE_HEADERS: &str = "outbox-headers";
/// Set to `base64` when the body had to be encoded (see [`message_body`]).
pub const ATTRIBUTE_ENCODING: &str = "outbox-content-transfer-encoding";

/// An SQS or SNS message.
pub struct Message {
    pub body: String,
    pub attributes: Vec<(&'static str, String)>,
    /// As the service counts it: the body and each attribute's name, type and value.
    pub size: usize,
}

/// The SQS or SNS message for the event; an event larger than `max` fails alone, naming
/// `service`.
pub fn message(routed: &Routed, service: &str, max: usize) -> Result<Message, PublishError> {
    let (body, encoded) = message_body(routed.event.payload.as_bytes());
    let mut attributes = message_attributes(routed);
    if encoded {
        attributes.push((ATTRIBUTE_ENCODING, "base64".into()));
    }
    let size = body.len()
        + attributes
            .iter()
            .map(|(name, value)| name.len() + "String".len() + value.len())
            .sum::<usize>();
    if size > max {
        return Err(PublishError::new(
            PublishErrorKind::TooLarge,
            format!("the {service} message would be {size} bytes; {service} takes at most {max}"),
        ));
    }
    Ok(Message {
        body,
        attributes,
        size,
    })
}

/// Outcomes from an answer that lists every entry in the request's order (Kinesis'
/// `Records`, EventBridge's `Entries`): an entry with `ok_field` was taken, one with an
/// `ErrorCode` was refused, one with neither (or missing) is not confirmed.
fn outcomes_in_order(count: usize, entries: &Value, ok_field: &str, what: &str) -> Vec<Outcome> {
    (0..count)
        .map(|i| {
            let entry = &entries[i];
            match (entry[ok_field].as_str(), entry["ErrorCode"].as_str()) {
                (Some(_), _) => Ok(()),
                (None, Some(code)) => Err(entry_error(
                    code,
                    entry["ErrorMessage"].as_str().unwrap_or_default(),
                    None,
                    what,
                )),
                (None, None) => Err(unconfirmed(what)),
            }
        })
        .collect()
}

/// The message body SQS and SNS accept: the payload when it is text of the characters they
/// allow (XML's), else its base64 and `true` (the attribute
/// [`ATTRIBUTE_ENCODING`] then says so).
pub fn message_body(payload: &[u8]) -> (String, bool) {
    let allowed = |c: char| {
        matches!(c, '\u{9}' | '\u{a}' | '\u{d}' | '\u{20}'..='\u{d7ff}' | '\u{e000}'..='\u{fffd}')
            || c >= '\u{10000}'
    };
    match std::str::from_utf8(payload) {
        Ok(text) if !text.is_empty() && text.chars().all(allowed) => (text.to_string(), false),
        _ => {
            use base64::Engine;
            (
                base64::engine::general_purpose::STANDARD.encode(payload),
                true,
            )
        }
    }
}

/// The FIFO message group for an ordering key: the key itself when SQS and SNS accept it
/// (1–128 letters, digits and ASCII punctuation), else a digest of it, so every event of
/// one key still lands in one group (the key itself travels in `outbox-key`).
pub fn message_group(key: &str) -> String {
    let valid = !key.is_empty()
        && key.len() <= 128
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b.is_ascii_punctuation());
    if valid {
        return key.to_string();
    }
    use sha2::Digest;
    let digest = sha2::Sha256::digest(key.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256-{hex}")
}

/// How long a sink waits for a health check's answer.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::Disposition;

    #[test]
    fn errors_are_classified_by_code_then_status() {
        let kind = |status, code| classify(status, code, "m", "x").kind();
        for (status, code, expected) in [
            (
                Some(400),
                "com.amazonaws.kinesis#ProvisionedThroughputExceededException",
                PublishErrorKind::Throttled,
            ),
            (
                Some(400),
                "AWS.SimpleQueueService.NonExistentQueue",
                PublishErrorKind::MissingTarget,
            ),
            (Some(400), "ValidationException", PublishErrorKind::Rejected),
            (
                Some(403),
                "AccessDeniedException",
                PublishErrorKind::Unauthorized,
            ),
            (
                Some(400),
                "ExpiredTokenException",
                PublishErrorKind::Unavailable,
            ),
            (Some(503), "", PublishErrorKind::BrokerFailure),
            (Some(429), "", PublishErrorKind::Throttled),
            (None, "MalformedDetail", PublishErrorKind::Rejected),
            // EventBridge entries the role may not put: no status, the sink's condition.
            (
                None,
                "NotAuthorizedForSourceException",
                PublishErrorKind::Unauthorized,
            ),
            (
                None,
                "NotAuthorizedForDetailTypeException",
                PublishErrorKind::Unauthorized,
            ),
            (
                Some(400),
                "KMS.ThrottlingException",
                PublishErrorKind::Throttled,
            ),
            (Some(400), "KMSThrottling", PublishErrorKind::Throttled),
            (
                Some(400),
                "IDPCommunicationError",
                PublishErrorKind::Unavailable,
            ),
            (Some(400), "RequestTimeout", PublishErrorKind::Timeout),
            // No AWS code: a redirect, a proxy's page, a wrong path. The sink's condition,
            // retried (each event was dead-lettered on its first attempt).
            (Some(307), "", PublishErrorKind::Unavailable),
            (Some(404), "", PublishErrorKind::Unavailable),
            (Some(408), "", PublishErrorKind::Timeout),
            (Some(413), "", PublishErrorKind::TooLarge),
            // SNS's throttling of one batch entry.
            (None, "Throttled", PublishErrorKind::Throttled),
        ] {
            assert_eq!(kind(status, code), expected, "{status:?} {code}");
        }
        // The sink's KMS key refused or unusable: retried until an operator fixes it, never
        // every event dead-lettered as if each were at fault.
        for code in [
            "KMSAccessDenied",
            "KMSDisabled",
            "KMSNotFound",
            "KMSInvalidState",
            "KMSOptInRequired",
            "KMS.DisabledException",
            "KMS.InvalidStateException",
            "KMS.NotFoundException",
            "KMSDisabledException",
            "KMSNotFoundException",
            "KMSInvalidStateException",
        ] {
            let error = classify(Some(400), code, "m", "x");
            assert!(
                matches!(error.disposition(), Disposition::Retry { .. }),
                "{code}: {error:?}"
            );
            // The queue exists; its key is what is missing.
            assert_eq!(error.kind(), PublishErrorKind::Unauthorized, "{code}");
            assert!(!error.to_string().contains("create it"), "{code}: {error}");
        }
        let skewed = classify(
            Some(400),
            "InvalidSignatureException",
            "Signature expired: 20261126T031500Z is now earlier than 20261126T032000Z",
            "x",
        );
        assert_eq!(skewed.kind(), PublishErrorKind::Unavailable);
        assert_eq!(
            entry_error("Whatever", "m", Some(false), "x").disposition(),
            Disposition::Retry { after: None },
            "a failure on the service's side is retried"
        );
        assert_eq!(
            entry_error("InvalidParameterValue", "m", Some(true), "x").disposition(),
            Disposition::Permanent
        );
        // The reviewer's findings: a queue URL of another region, an endpoint that is no
        // SQS, a queue's own smaller size limit, credentials that cannot be renewed, a
        // clock off, each named with its fix, none dead-lettering every event.
        for (code, message, expected, says) in [
            (
                "InvalidAddress",
                "The address https://sqs.eu-west-1.amazonaws.com/1/q is not valid for this endpoint.",
                PublishErrorKind::MissingTarget,
                "region and account",
            ),
            (
                "UnknownOperationException",
                "",
                PublishErrorKind::Unavailable,
                "endpoint",
            ),
            (
                "InvalidParameterValue",
                "One or more parameters are invalid. Reason: Message must be shorter than 262144 bytes.",
                PublishErrorKind::TooLarge,
                "MaximumMessageSize",
            ),
            (
                "ExpiredToken",
                "The security token included in the request is expired",
                PublishErrorKind::Unavailable,
                "restart",
            ),
            (
                "RequestTimeTooSkewed",
                "The difference between the request time and the current time is too large.",
                PublishErrorKind::Unavailable,
                "NTP",
            ),
        ] {
            let error = classify(Some(400), code, message, "SQS x");
            assert_eq!(error.kind(), expected, "{code}: {error}");
            assert!(error.to_string().contains(says), "{code}: {error}");
        }
        let quoted = classify(
            Some(403),
            "SignatureDoesNotMatch",
            "The request signature we calculated does not match the signature you provided.\n\n\
             The Canonical String for this request should have been\n'POST\n/\n\n\
             x-amz-security-token:IQoJb3JpZ2luX2VjEXAMPLETOKEN\n'",
            "SQS x",
        )
        .to_string();
        assert!(!quoted.contains("IQoJb3JpZ2luX2VjEXAMPLETOKEN"), "{quoted}");
        assert!(quoted.contains("does not match"), "{quoted}");
        let missing = classify(Some(400), "QueueDoesNotExist", "gone", "SQS x").to_string();
        assert!(
            missing.contains("create it, or fix the route's target"),
            "{missing}"
        );
    }

    #[test]
    fn bodies_and_groups_are_what_sqs_and_sns_accept() {
        assert_eq!(message_body(b"{\"a\":1}"), ("{\"a\":1}".to_string(), false));
        assert_eq!(message_body(&[0xff, 0x00]), ("/wA=".to_string(), true));
        assert_eq!(message_body(b"nul\0"), ("bnVsAA==".to_string(), true));
        assert_eq!(message_group("customer-7/eu"), "customer-7/eu");
        let hashed = message_group("customer 7");
        assert!(
            hashed.starts_with("sha256-") && hashed.len() <= 128,
            "{hashed}"
        );
        assert_eq!(hashed, message_group("customer 7"), "one key, one group");
        assert_ne!(hashed, message_group("customer 8"));
    }

    /// A service that refuses a whole request for one bad entry (as SQS does for an
    /// attribute value it cannot take), and answers per entry otherwise.
    struct RefusesWholeRequests {
        client: AwsClient,
        requests: std::sync::Mutex<Vec<usize>>,
        /// How long a request of several entries takes to be answered.
        whole_takes: Duration,
    }

    impl BatchApi for RefusesWholeRequests {
        const SYSTEM: &'static str = "test";
        const PROBE: Probe = Probe::Query {
            action: "X",
            version: "1",
        };
        const MAX_MESSAGE_BYTES: usize = 1_000;
        const MAX_ENTRIES: usize = 10;
        const MAX_BATCH_BYTES: usize = 1_000;
        type Entry = bool;

        fn client(&self) -> &AwsClient {
            &self.client
        }

        fn entry(&self, routed: &Routed) -> Result<(bool, usize), PublishError> {
            Ok((routed.event.payload.as_bytes() == b"bad", 1))
        }

        fn send_entries(
            self: Arc<Self>,
            _target: String,
            entries: Arc<[bool]>,
        ) -> BoxFuture<'static, Result<Vec<Outcome>, PublishError>> {
            self.requests.lock().unwrap().push(entries.len());
            let refused = entries.iter().any(|bad| *bad);
            let takes = if entries.len() > 1 {
                self.whole_takes
            } else {
                self.whole_takes / 100
            };
            async move {
                tokio::time::sleep(takes).await;
                match refused {
                    true => Err(classify(Some(400), "InvalidParameterValue", "bad", "x")),
                    false => Ok(entries.iter().map(|_| Ok(())).collect()),
                }
            }
            .boxed()
        }
    }

    fn test_env(name: &str) -> Option<String> {
        match name {
            "AWS_ACCESS_KEY_ID" => Some("AK".to_string()),
            "AWS_SECRET_ACCESS_KEY" => Some("s".to_string()),
            "AWS_REGION" => Some("us-east-1".to_string()),
            _ => None,
        }
    }

    fn ok_bad_ok() -> Vec<Routed> {
        ["ok", "bad", "ok"]
            .iter()
            .enumerate()
            .map(|(i, payload)| {
                let event = outbox_core::Event::new(
                    i as i64,
                    uuid::Uuid::new_v4(),
                    "d",
                    "t",
                    outbox_core::Payload::Bytes(payload.as_bytes().to_vec()),
                );
                Routed {
                    event: Arc::new(event),
                    target: "q".into(),
                    cloudevents: None,
                }
            })
            .collect()
    }

    /// The entries of a refused request, sent again one by one after the batch's time to
    /// start its requests had passed, were given back unsent when a slot was busy: the
    /// refused entry was never counted, and came back with its request's others in every
    /// batch. They wait for a slot.
    #[tokio::test(start_paused = true)]
    async fn entries_sent_alone_after_a_slow_refusal_wait_for_a_slot() {
        outbox_testkit::install_crypto();
        let config = AwsConfig {
            concurrency: Some(1),
            timeout: crate::settings::ConfirmTimeout {
                timeout: Some(Duration::from_secs(2)),
            },
            ..AwsConfig::default()
        };
        let api = Arc::new(RefusesWholeRequests {
            client: AwsClient::new(Service::Sqs, &config, &test_env).unwrap(),
            requests: Default::default(),
            whole_takes: Duration::from_millis(1500),
        });
        let outcomes = send_batched(api.clone(), ok_bad_ok()).await;
        assert!(outcomes[0].is_ok() && outcomes[2].is_ok(), "{outcomes:?}");
        let refused = outcomes[1].as_ref().unwrap_err();
        assert_eq!(refused.disposition(), Disposition::Permanent, "{refused}");
    }

    /// One entry that gets a whole request refused fails alone: the others of its request
    /// are sent again one by one and delivered. A retryable refusal is not split.
    #[tokio::test]
    async fn a_request_refused_for_one_entry_is_split_so_only_that_entry_fails() {
        let env = test_env;
        outbox_testkit::install_crypto();
        let api = Arc::new(RefusesWholeRequests {
            client: AwsClient::new(Service::Sqs, &AwsConfig::default(), &env).unwrap(),
            requests: Default::default(),
            whole_takes: Duration::ZERO,
        });
        let batch = ok_bad_ok();
        let outcomes = send_batched(api.clone(), batch).await;
        assert!(outcomes[0].is_ok() && outcomes[2].is_ok(), "{outcomes:?}");
        let refused = outcomes[1].as_ref().unwrap_err();
        assert_eq!(refused.disposition(), Disposition::Permanent, "{refused}");
        assert_eq!(*api.requests.lock().unwrap(), [3, 1, 1, 1]);
    }

    #[test]
    fn form_encoding_escapes_like_sigv4() {
        assert_eq!(form_encode(&[("A b", "x/y~z=1")]), "A%20b=x%2Fy~z%3D1");
    }
}
