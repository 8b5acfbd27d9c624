//! A local OTLP/HTTP trace receiver, written for the tests because no OpenTelemetry
//! collector runs here. It takes what a real collector takes on its HTTP port: `POST
//! /v1/traces` with `content-type: application/x-protobuf` and an
//! `ExportTraceServiceRequest` body (decoded with `opentelemetry-proto`'s generated types),
//! and answers as a collector does (200, an empty protobuf `ExportTraceServiceResponse`).
//! Every request is recorded as it arrived, including those a collector would refuse, so a
//! test can check the path, the content type and the body.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
pub use opentelemetry_proto::tonic::common::v1::{any_value, KeyValue};
pub use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use tokio::sync::Notify;

/// One request as it arrived.
#[derive(Clone, Debug)]
pub struct Received {
    pub method: String,
    pub path: String,
    pub content_type: Option<String>,
    /// The decoded body, or why it did not decode.
    pub body: Result<ExportTraceServiceRequest, String>,
}

#[derive(Default)]
struct Shared {
    received: Mutex<Vec<Received>>,
    arrived: Notify,
}

/// The receiver; it stops when dropped.
pub struct OtlpReceiver {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

/// A span with the `service.name` of the resource it came with.
#[derive(Clone, Debug)]
pub struct ReceivedSpan {
    pub service: Option<String>,
    pub span: Span,
}

impl ReceivedSpan {
    pub fn name(&self) -> &str {
        &self.span.name
    }

    /// A string, integer or boolean attribute as text.
    pub fn attribute(&self, key: &str) -> Option<String> {
        attribute(&self.span.attributes, key)
    }
}

/// An attribute of `attributes` as text (strings, integers, booleans, doubles).
pub fn attribute(attributes: &[KeyValue], key: &str) -> Option<String> {
    let value = attributes.iter().find(|kv| kv.key == key)?.value.as_ref()?;
    Some(match value.value.as_ref()? {
        any_value::Value::StringValue(s) => s.clone(),
        any_value::Value::IntValue(i) => i.to_string(),
        any_value::Value::BoolValue(b) => b.to_string(),
        any_value::Value::DoubleValue(d) => d.to_string(),
        other => format!("{other:?}"),
    })
}

/// Lowercase hex of an id.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl OtlpReceiver {
    /// Listens on 127.0.0.1 at a free port.
    pub async fn start() -> OtlpReceiver {
        let shared = Arc::new(Shared::default());
        let app = axum::Router::new()
            .fallback(receive)
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the OTLP receiver");
        let addr = listener.local_addr().expect("local address");
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        OtlpReceiver { addr, shared, task }
    }

    /// The base URL, as `OTEL_EXPORTER_OTLP_ENDPOINT` takes it.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request so far.
    pub fn received(&self) -> Vec<Received> {
        self.shared.received.lock().unwrap().clone()
    }

    /// Every span of every well-formed request so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        let mut spans = Vec::new();
        for received in self.received() {
            let Ok(request) = received.body else { continue };
            for resource_spans in request.resource_spans {
                let service = resource_spans
                    .resource
                    .as_ref()
                    .and_then(|r| attribute(&r.attributes, "service.name"));
                for scope in resource_spans.scope_spans {
                    for span in scope.spans {
                        spans.push(ReceivedSpan {
                            service: service.clone(),
                            span,
                        });
                    }
                }
            }
        }
        spans
    }

    /// Waits until `done` holds for the spans received, at most `within`; panics with what
    /// arrived otherwise.
    pub async fn wait_for_spans(
        &self,
        within: Duration,
        done: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> Vec<ReceivedSpan> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let arrived = self.shared.arrived.notified();
            let spans = self.spans();
            if done(&spans) {
                return spans;
            }
            if tokio::time::timeout_at(deadline, arrived).await.is_err() {
                let names: Vec<&str> = spans.iter().map(|s| s.name()).collect();
                panic!("the expected spans did not arrive within {within:?}; received: {names:?}");
            }
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn receive(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, [(&'static str, &'static str); 1], Vec<u8>) {
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .map(String::from);
    let decoded = ExportTraceServiceRequest::decode(body).map_err(|e| e.to_string());
    let ok = method == Method::POST
        && uri.path() == "/v1/traces"
        && content_type.as_deref() == Some("application/x-protobuf")
        && decoded.is_ok();
    shared.received.lock().unwrap().push(Received {
        method: method.to_string(),
        path: uri.path().to_string(),
        content_type,
        body: decoded,
    });
    shared.arrived.notify_waiters();
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::BAD_REQUEST
    };
    (
        status,
        [("content-type", "application/x-protobuf")],
        ExportTraceServiceResponse::default().encode_to_vec(),
    )
}
