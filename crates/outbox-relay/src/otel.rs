//! The relay's own spans over OTLP (`otel` feature): the engine's [`Telemetry`] reports,
//! turned into OpenTelemetry spans and exported with the standard `OTEL_*` variables.
//!
//! Off unless `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` is set
//! (and neither `OTEL_SDK_DISABLED=true` nor `OTEL_TRACES_EXPORTER=none`): then no exporter,
//! no thread and no socket exist, and the engine takes no timestamps. The transport is
//! OTLP over HTTP with protobuf bodies (`http/protobuf`, the collector's port 4318); a
//! `grpc` protocol is refused with the fix. The exporter's requests run on the relay's
//! runtime through the one reqwest client stack the webhook sink already uses.
//!
//! Spans follow the messaging semantic conventions:
//! - `claim <table>` (kind consumer, `messaging.operation.type` `receive`): a claim that
//!   returned rows (an empty one is no span: an idle relay claims every poll interval);
//! - `publish <destination>` (kind producer, `send`), one per outbox destination in a batch,
//!   with `messaging.system` and `messaging.destination.name` from the route, the batch's
//!   `messaging.batch.message_count`, `messaging.message.id` for a single event, and one
//!   span link per event that carries a valid `traceparent` (the link's
//!   `messaging.message.id` names the event);
//! - `ack <table>`, `retry <table>`, `dead_letter <table>` (kind client, `settle`).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::trace::{
    Link, Span as _, SpanBuilder, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId,
    TraceState, TracerProvider as _,
};
use opentelemetry::KeyValue;
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use outbox_core::trace::{SettleKind, Span, Telemetry};
use outbox_core::{Event, PublishError, Publisher, StoreError};

use crate::error::ConfigError;

/// The variables that switch export on.
pub const ENDPOINT_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
];

/// How long one export request may take (unless `OTEL_EXPORTER_OTLP_TIMEOUT` says).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The exporter and the engine's end of it.
pub struct Otel {
    provider: SdkTracerProvider,
    telemetry: Arc<OtlpTelemetry>,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// Whether the environment asks for trace export.
pub fn requested() -> bool {
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return false;
    }
    if var("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none")) {
        return false;
    }
    ENDPOINT_VARS.iter().any(|name| var(name).is_some())
}

/// The endpoint variables as URLs and the header variables as `key=value` lists, as the
/// exporter reads them. It read neither until an export: an endpoint that is no URL failed
/// every export as a "network error", and a header entry it could not read (an API key's
/// name with a space) was dropped, its requests sent without it, both without a word.
fn check_endpoints_and_headers() -> Result<(), ConfigError> {
    for name in ENDPOINT_VARS {
        let Some(endpoint) = var(name) else { continue };
        let shown = outbox_core::redact::redact_url(&endpoint);
        match reqwest::Url::parse(&endpoint) {
            Ok(url) if matches!(url.scheme(), "http" | "https") => {}
            Ok(url) => {
                return Err(ConfigError(format!(
                    "{name}={shown} is not an http:// or https:// URL (its scheme is {}): \
                     point it at the collector's OTLP/HTTP port, e.g. http://collector:4318",
                    url.scheme()
                )))
            }
            Err(e) => {
                return Err(ConfigError(format!(
                    "{name}={shown} is no URL ({e}): write e.g. http://collector:4318"
                )))
            }
        }
    }
    for name in [
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
        "OTEL_EXPORTER_OTLP_HEADERS",
    ] {
        let Some(headers) = var(name) else { continue };
        for entry in headers.split(',').filter(|e| !e.trim().is_empty()) {
            // The key only: values are credentials.
            let (key, value) = entry.split_once('=').unwrap_or((entry, ""));
            let key = key.trim();
            let readable = reqwest::header::HeaderName::from_bytes(key.as_bytes()).is_ok()
                && entry.contains('=')
                && reqwest::header::HeaderValue::from_str(value.trim()).is_ok();
            if !readable {
                return Err(ConfigError(format!(
                    "{name}: the entry {:?} is no header=value pair a request can carry (a \
                     header's name has no spaces; its value no line breaks): write \
                     name=value[,name=value], percent-encoding what the value must hold",
                    outbox_core::redact::escape_controls(key)
                )));
            }
        }
    }
    Ok(())
}

impl Otel {
    /// Starts the exporter when the environment asks for it (see [`requested`]); `None`
    /// otherwise. `table` names the outbox in claim and settle spans; `max_links` is the
    /// largest batch a publish span links (unless `OTEL_SPAN_LINK_COUNT_LIMIT` says).
    pub fn from_env(
        node: &str,
        table: &str,
        max_links: usize,
    ) -> Result<Option<Otel>, ConfigError> {
        if !requested() {
            return Ok(None);
        }
        if let Some(exporter) = var("OTEL_TRACES_EXPORTER") {
            if !exporter.eq_ignore_ascii_case("otlp") {
                return Err(ConfigError(format!(
                    "OTEL_TRACES_EXPORTER={exporter} is not supported: this relay exports \
                     spans over OTLP only (set it to otlp, or none to switch export off)"
                )));
            }
        }
        let protocol = var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            .or_else(|| var("OTEL_EXPORTER_OTLP_PROTOCOL"))
            .unwrap_or_else(|| "http/protobuf".into());
        if protocol != "http/protobuf" {
            return Err(ConfigError(format!(
                "OTEL_EXPORTER_OTLP_PROTOCOL={protocol} is not supported: this relay exports \
                 OTLP over HTTP with protobuf bodies; set it to http/protobuf and point \
                 OTEL_EXPORTER_OTLP_ENDPOINT at the collector's HTTP port (4318 by default)"
            )));
        }
        check_endpoints_and_headers()?;
        let timeout = match [
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
            "OTEL_EXPORTER_OTLP_TIMEOUT",
        ]
        .into_iter()
        .find_map(|name| var(name).map(|value| (name, value)))
        {
            None => REQUEST_TIMEOUT,
            Some((name, ms)) => match ms.trim().parse::<u64>() {
                Ok(ms) if ms > 0 => Duration::from_millis(ms),
                // Taken for the default, `10s` left every export at 10 s without a word.
                _ => {
                    return Err(ConfigError(format!(
                        "{name}={ms} is not a number of milliseconds above 0: write e.g. 10000 \
                         for ten seconds"
                    )))
                }
            },
        };
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| ConfigError(format!("cannot build the OTLP HTTP client: {e}")))?;
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| ConfigError("the OTLP exporter must start inside the runtime".into()))?;
        use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_timeout(timeout)
            .with_http_client(OnRuntime { client, runtime })
            .build()
            .map_err(|e| ConfigError(format!("cannot set up OTLP trace export: {e}")))?;
        let mut resource = Resource::builder();
        let named = var("OTEL_SERVICE_NAME").is_some()
            || var("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|a| a.contains("service.name="));
        if !named {
            resource = resource.with_service_name("outbox-relay");
        }
        let resource = resource
            .with_attribute(KeyValue::new("service.instance.id", node.to_string()))
            .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
            .build();
        let mut builder = SdkTracerProvider::builder()
            .with_resource(resource)
            .with_batch_exporter(exporter);
        if var("OTEL_SPAN_LINK_COUNT_LIMIT").is_none() {
            builder = builder
                .with_max_links_per_span(u32::try_from(max_links.max(128)).unwrap_or(u32::MAX));
        }
        let provider = builder.build();
        let tracer = provider.tracer("outbox-relay");
        tracing::info!(
            endpoint = %outbox_core::redact::redact_url(
                &var(ENDPOINT_VARS[0]).or_else(|| var(ENDPOINT_VARS[1])).unwrap_or_default()
            ),
            "exporting the relay's spans over OTLP (http/protobuf)"
        );
        Ok(Some(Otel {
            provider,
            telemetry: Arc::new(OtlpTelemetry {
                tracer,
                table: table.to_string(),
            }),
        }))
    }

    pub fn telemetry(&self) -> Arc<dyn Telemetry> {
        self.telemetry.clone()
    }

    /// Exports what is queued and stops, within `budget`: a collector that does not answer
    /// costs the budget, never more (the spans are then dropped, with a warning).
    pub async fn shutdown(self, budget: Duration) {
        let provider = self.provider;
        let flush = tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(budget));
        match tokio::time::timeout(budget + Duration::from_millis(500), flush).await {
            Ok(Ok(Ok(()))) => tracing::debug!("spans exported"),
            Ok(Ok(Err(e))) => {
                tracing::warn!(error = %e, "could not export the last spans at shutdown")
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "span export stopped abnormally"),
            Err(_) => tracing::warn!(
                ?budget,
                "the OTLP collector did not take the last spans in time; dropped them"
            ),
        }
    }
}

/// The exporter's HTTP client: reqwest on the relay's runtime. The SDK's batch processor
/// exports from a thread of its own, outside the runtime, so each request is spawned onto
/// the runtime and awaited from there.
#[derive(Debug)]
struct OnRuntime {
    client: reqwest::Client,
    runtime: tokio::runtime::Handle,
}

#[async_trait::async_trait]
impl HttpClient for OnRuntime {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let client = self.client.clone();
        let request = reqwest::Request::try_from(request.map(reqwest::Body::from))?;
        let exchange = self.runtime.spawn(async move {
            // reqwest's errors name the URL, and the endpoint's user info is a password.
            let response = client
                .execute(request)
                .await
                .map_err(reqwest::Error::without_url)?;
            let mut answer = Response::builder().status(response.status());
            if let Some(headers) = answer.headers_mut() {
                *headers = response.headers().clone();
            }
            let body = response
                .bytes()
                .await
                .map_err(reqwest::Error::without_url)?;
            Ok::<_, HttpError>(answer.body(body)?)
        });
        exchange.await?
    }
}

/// Turns the engine's reports into spans.
#[derive(Debug)]
pub struct OtlpTelemetry {
    tracer: SdkTracer,
    table: String,
}

const SYSTEM: &str = "messaging.system";
const DESTINATION: &str = "messaging.destination.name";
const OPERATION_TYPE: &str = "messaging.operation.type";
const OPERATION_NAME: &str = "messaging.operation.name";
const MESSAGE_ID: &str = "messaging.message.id";
const BATCH_COUNT: &str = "messaging.batch.message_count";
/// `messaging.system` of claim and settle spans: the outbox table is the queue read.
const OUTBOX_SYSTEM: &str = "outbox";

impl OtlpTelemetry {
    fn record(
        &self,
        name: String,
        kind: SpanKind,
        span: Span,
        attributes: Vec<KeyValue>,
        links: Vec<Link>,
        status: Status,
    ) {
        let mut started = SpanBuilder::from_name(Cow::Owned(name))
            .with_kind(kind)
            .with_start_time(span.start)
            .with_attributes(attributes)
            .with_links(links)
            .start(&self.tracer);
        started.set_status(status);
        started.end_with_timestamp(span.end);
    }

    fn outbox_span(
        &self,
        operation: &'static str,
        op_type: &'static str,
        rows: usize,
    ) -> Vec<KeyValue> {
        vec![
            KeyValue::new(SYSTEM, OUTBOX_SYSTEM),
            KeyValue::new(DESTINATION, self.table.clone()),
            KeyValue::new(OPERATION_TYPE, op_type),
            KeyValue::new(OPERATION_NAME, operation),
            KeyValue::new(BATCH_COUNT, rows as i64),
        ]
    }
}

fn error_status(message: String) -> Status {
    Status::Error {
        description: message.into(),
    }
}

/// The link to the trace that produced `event`, from its valid `traceparent`.
fn producer_link(event: &Event) -> Option<Link> {
    let cx = outbox_publishers::trace::trace_context(event)?;
    let state = cx
        .state
        .as_deref()
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    let context = SpanContext::new(
        TraceId::from_bytes(cx.parent.trace_id),
        SpanId::from_bytes(cx.parent.span_id),
        TraceFlags::new(cx.parent.flags),
        true,
        state,
    );
    Some(Link::new(
        context,
        vec![KeyValue::new(MESSAGE_ID, event.event_id.to_string())],
        0,
    ))
}

impl Telemetry for OtlpTelemetry {
    fn claimed(&self, span: Span, result: Result<usize, &StoreError>) {
        let (rows, status) = match result {
            Ok(0) => return,
            Ok(rows) => (rows, Status::Unset),
            Err(e) => (0, error_status(e.report())),
        };
        self.record(
            format!("claim {}", self.table),
            SpanKind::Consumer,
            span,
            self.outbox_span("claim", "receive", rows),
            Vec::new(),
            status,
        );
    }

    fn published(
        &self,
        span: Span,
        publisher: &dyn Publisher,
        batch: &[Arc<Event>],
        outcomes: &[Result<(), PublishError>],
    ) {
        // One span per outbox destination of the batch.
        let mut groups: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, event) in batch.iter().enumerate() {
            groups
                .entry(event.destination.as_str())
                .or_default()
                .push(i);
        }
        for (destination, members) in groups {
            let first = &batch[members[0]];
            let target = publisher.messaging_destination(first);
            let mut attributes = vec![
                KeyValue::new(OPERATION_TYPE, "send"),
                KeyValue::new(OPERATION_NAME, "publish"),
                KeyValue::new(BATCH_COUNT, members.len() as i64),
            ];
            match &target {
                Some(target) => {
                    attributes.push(KeyValue::new(SYSTEM, target.system));
                    // A per-event target (a subject with the key in it) names no one
                    // destination: the outbox destination stands for them.
                    let uniform = members.len() == 1
                        || members.iter().skip(1).all(|&i| {
                            publisher.messaging_destination(&batch[i]).as_ref() == Some(target)
                        });
                    let name = if uniform {
                        target.name.as_str()
                    } else {
                        destination
                    };
                    attributes.push(KeyValue::new(DESTINATION, name.to_string()));
                }
                None => attributes.push(KeyValue::new(DESTINATION, destination.to_string())),
            }
            if members.len() == 1 {
                attributes.push(KeyValue::new(MESSAGE_ID, first.event_id.to_string()));
            }
            let links = members
                .iter()
                .filter_map(|&i| producer_link(&batch[i]))
                .collect();
            let failures: Vec<&PublishError> = members
                .iter()
                .filter_map(|&i| outcomes.get(i).and_then(|o| o.as_ref().err()))
                .collect();
            let status = match failures.first() {
                None => Status::Unset,
                Some(e) => {
                    attributes.push(KeyValue::new("error.type", format!("{:?}", e.kind())));
                    error_status(format!(
                        "{} of {} events failed: {}",
                        failures.len(),
                        members.len(),
                        e.report()
                    ))
                }
            };
            self.record(
                format!("publish {destination}"),
                SpanKind::Producer,
                span,
                attributes,
                links,
                status,
            );
        }
    }

    fn settled(&self, span: Span, kind: SettleKind, rows: usize, result: Result<u64, &StoreError>) {
        let mut attributes = self.outbox_span(kind.as_str(), "settle", rows);
        let status = match result {
            Ok(n) => {
                attributes.push(KeyValue::new("outbox.rows_changed", n as i64));
                Status::Unset
            }
            Err(e) => error_status(e.report()),
        };
        self.record(
            format!("{} {}", kind.as_str(), self.table),
            SpanKind::Client,
            span,
            attributes,
            Vec::new(),
            status,
        );
    }
}
