//! Webhooks and Ably against real local HTTP servers. Ably's hosted service cannot be
//! reached from here, so its tests run a local server that checks the exact REST request
//! Ably documents (POST /channels/{channel}/messages, Basic auth with the API key, one JSON
//! message with a client-supplied id) and answers as Ably does.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_core::Disposition;
use outbox_publishers::{Routed, Sink, SinkConfig};
use outbox_testkit::publisher::{event, BrokerHarness, Received};
use serde_json::json;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const ABLY_KEY: &str = "appid.keyid:keysecret";

#[derive(Clone, Debug)]
struct Request {
    path: String,
    headers: HeaderMap,
    body: Vec<u8>,
}

#[derive(Default)]
struct Recorder {
    requests: Mutex<Vec<Request>>,
    /// Scripted answers (status, Retry-After), used before answering 2xx.
    script: Mutex<VecDeque<(u16, Option<&'static str>)>>,
    in_flight: Mutex<(usize, usize)>, // (now, max)
    slow: Mutex<Option<Duration>>,
}

/// A sink's settings as a `[sinks.NAME]` table would give them.
fn read_config(table: serde_json::Value) -> SinkConfig {
    serde_json::from_value(table).expect("valid sink settings")
}

async fn record(
    State(rec): State<Arc<Recorder>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    {
        let mut f = rec.in_flight.lock().unwrap();
        f.0 += 1;
        f.1 = f.1.max(f.0);
    }
    let slow = *rec.slow.lock().unwrap();
    if let Some(d) = slow {
        tokio::time::sleep(d).await; // a slow endpoint, so concurrent requests overlap
    }
    rec.in_flight.lock().unwrap().0 -= 1;
    if let Some((status, retry_after)) = rec.script.lock().unwrap().pop_front() {
        let mut response = StatusCode::from_u16(status).unwrap().into_response();
        if let Some(r) = retry_after {
            response
                .headers_mut()
                .insert("retry-after", r.parse().unwrap());
        }
        return response;
    }
    rec.requests.lock().unwrap().push(Request {
        path: uri.path().to_string(),
        headers,
        body: body.to_vec(),
    });
    StatusCode::CREATED.into_response()
}

/// A local HTTP server that records requests; it can be stopped and restarted on its port.
struct Receiver {
    recorder: Arc<Recorder>,
    addr: SocketAddr,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

async fn close_after_413(mut response: Response) -> Response {
    if response.status() == StatusCode::PAYLOAD_TOO_LARGE {
        response.headers_mut().insert(
            axum::http::header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
    }
    response
}

impl Receiver {
    async fn start() -> Receiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let receiver = Receiver {
            recorder: Arc::default(),
            addr: listener.local_addr().unwrap(),
            task: Mutex::new(None),
        };
        receiver.serve(listener);
        receiver
    }

    fn serve(&self, listener: tokio::net::TcpListener) {
        let app = axum::Router::new()
            .route("/hooks/{*rest}", post(record))
            .route("/channels/{channel}/messages", post(record))
            .layer(DefaultBodyLimit::max(1024 * 1024)) // larger bodies get 413
            // The unread rest of a refused body ends the connection: say so, as nginx does,
            // or the client may send the next request on it and see it close
            // (`IncompleteMessage`: the oversized test's small event failed once in CI).
            .layer(axum::middleware::map_response(close_after_413))
            .with_state(self.recorder.clone());
        *self.task.lock().unwrap() = Some(tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        }));
    }

    fn stop(&self) {
        if let Some(task) = self.task.lock().unwrap().take() {
            task.abort();
        }
    }

    async fn resume(&self) {
        // The aborted server task drops its listener asynchronously: retry until the port is free.
        let listener = outbox_testkit::eventually(
            "the receiver's port to be free",
            Duration::from_secs(10),
            || async { tokio::net::TcpListener::bind(self.addr).await.ok() },
        )
        .await;
        self.serve(listener);
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn requests(&self) -> Vec<Request> {
        self.recorder.requests.lock().unwrap().clone()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop();
    }
}

fn body_payload(value: &serde_json::Value) -> Vec<u8> {
    match value {
        serde_json::Value::String(s) => s.as_bytes().to_vec(),
        other => other.to_string().into_bytes(),
    }
}

// ---------------------------------------------------------------- webhooks

struct WebhookHarness {
    receiver: Receiver,
    sink: Arc<dyn Sink>,
    target: String,
}

async fn webhook_harness() -> WebhookHarness {
    let receiver = Receiver::start().await;
    let config = read_config(json!({
        "uri": format!("{}/hooks/{{destination}}?key={{partition_key}}", receiver.url()),
        "secret": SECRET,
        "timeout": "2s",
    }));
    let sink = outbox_publishers::build_sink("hooks", &config)
        .await
        .unwrap();
    WebhookHarness {
        receiver,
        sink,
        target: format!("orders-{}", uuid::Uuid::new_v4().simple()),
    }
}

/// Checks the Standard Webhooks signature of a request, as a receiver would.
fn verify_signature(request: &Request) {
    let header = |n: &str| {
        request
            .headers
            .get(n)
            .unwrap_or_else(|| panic!("missing {n}"))
            .to_str()
            .unwrap()
            .to_string()
    };
    let key = outbox_publishers::webhook::decode_secret(SECRET).unwrap();
    let expected = outbox_publishers::webhook::sign(
        &key,
        &header("webhook-id"),
        header("webhook-timestamp").parse().unwrap(),
        &request.body,
    );
    assert_eq!(header("webhook-signature"), expected);
}

/// Every header of a request, as (name, value) text.
fn headers_of(request: &Request) -> Vec<(String, String)> {
    request
        .headers
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_str().unwrap_or_default().to_string()))
        .collect()
}

impl BrokerHarness for WebhookHarness {
    fn sink(&self) -> Arc<dyn Sink> {
        self.sink.clone()
    }

    fn target(&self) -> String {
        self.target.clone()
    }

    fn received(&self) -> BoxFuture<'_, Vec<Received>> {
        async move {
            self.receiver
                .requests()
                .iter()
                .map(|r| {
                    verify_signature(r);
                    let content_type = r.headers["content-type"].to_str().unwrap();
                    let id = r.headers["webhook-id"].to_str().unwrap().to_string();
                    let cloudevent = r.headers.contains_key("ce-id")
                        || content_type == "application/cloudevents+json";
                    if cloudevent {
                        // The body is the CloudEvent's data, or its envelope.
                        return Received {
                            event_id: id,
                            ordering_key: None,
                            payload: r.body.to_vec(),
                            traceparent: None,
                            tracestate: None,
                            headers: headers_of(r),
                        };
                    }
                    assert_eq!(content_type, "application/json");
                    let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
                    assert_eq!(
                        r.headers["webhook-id"].to_str().unwrap(),
                        body["event_id"].as_str().unwrap()
                    );
                    Received {
                        event_id: body["event_id"].as_str().unwrap().to_string(),
                        ordering_key: body["partition_key"].as_str().map(String::from),
                        payload: body_payload(&body["payload"]),
                        traceparent: r
                            .headers
                            .get("traceparent")
                            .map(|v| v.to_str().unwrap().to_string()),
                        tracestate: r
                            .headers
                            .get("tracestate")
                            .map(|v| v.to_str().unwrap().to_string()),
                        headers: headers_of(r),
                    }
                })
                .collect()
        }
        .boxed()
    }

    fn broker_dedupes(&self) -> bool {
        false // receivers de-duplicate on webhook-id
    }

    fn oversized_bytes(&self) -> usize {
        2 * 1024 * 1024 // the receiver answers 413 above 1 MiB
    }

    fn stop_broker(&self) -> BoxFuture<'_, ()> {
        async move { self.receiver.stop() }.boxed()
    }

    fn start_broker(&self) -> BoxFuture<'_, ()> {
        async move { self.receiver.resume().await }.boxed()
    }
}

mod webhook {
    use super::*;
    outbox_testkit::publisher_conformance!(webhook_harness);
}

/// In binary mode a webhook carries the attribute headers the router made, and none of the
/// event's own `ce-` headers: a stray one would make a consumer read a different event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_cloudevents_on_webhooks_carry_only_the_attribute_headers() {
    use outbox_core::Publisher;
    use outbox_publishers::cloudevents::{CloudEvents, ContentMode};
    use outbox_publishers::{Route, Router, Template};
    outbox_testkit::install_crypto();
    let h = webhook_harness().await;
    let mut e = (*event(1, "k", b"{}".to_vec())).clone();
    e.headers.insert("ce-id".into(), "forged".into());
    e.headers.insert("ce-stray".into(), "x".into());
    let e = Arc::new(e);
    let route = Route::new("*", "hooks", Template::parse(&h.target()).unwrap())
        .unwrap()
        .with_cloudevents(CloudEvents {
            mode: ContentMode::Binary,
            source: Template::destination(),
        });
    let router = Router::new(vec![("hooks".to_string(), h.sink.clone())], vec![route]).unwrap();
    let outcomes = router.publish(vec![e.clone()]).await;
    assert!(outcomes.iter().all(|o| o.is_ok()), "{outcomes:?}");
    let requests = h.receiver.requests();
    let request = requests.last().expect("one request");
    assert_eq!(
        request.headers["ce-id"].to_str().unwrap(),
        e.event_id.to_string()
    );
    assert!(
        !request.headers.contains_key("ce-stray"),
        "{:?}",
        request.headers
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_statuses_map_to_outcomes_and_urls_are_templated() {
    outbox_testkit::install_crypto();
    let h = webhook_harness().await;
    let mut e = (*event(1, "a/b c", b"{}".to_vec())).clone();
    e.destination = "orders".into();
    let e = Arc::new(e);
    let send = |e: &Arc<outbox_core::Event>| {
        h.sink.send(vec![Routed {
            cloudevents: None,
            event: e.clone(),
            target: String::new(),
        }])
    };
    for (status, retry_after, retryable) in [
        (503, None, true),
        (408, None, true),
        (429, Some("3"), true),
        (400, None, false),
        (422, None, false),
        // No such endpoint (yet): the receiver's condition (a wrong path, a receiver not
        // deployed, an ingress's default backend), which dead-lettered every event.
        (404, None, true),
        (410, None, true),
    ] {
        h.receiver
            .recorder
            .script
            .lock()
            .unwrap()
            .push_back((status, retry_after));
        let outcome = send(&e).await.remove(0);
        let err = outcome.expect_err("scripted failure");
        assert_eq!(
            matches!(err.disposition(), Disposition::Retry { .. }),
            retryable,
            "{status}: {err}"
        );
        if status == 429 {
            assert_eq!(
                err.disposition(),
                Disposition::Retry {
                    after: Some(Duration::from_secs(3))
                }
            );
        }
    }
    assert!(send(&e).await[0].is_ok());
    let requests = h.receiver.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0].path, "/hooks/orders");
    verify_signature(&requests[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_concurrency_is_capped_per_destination() {
    outbox_testkit::install_crypto();
    let receiver = Receiver::start().await;
    *receiver.recorder.slow.lock().unwrap() = Some(Duration::from_millis(30));
    let config = read_config(json!({
        "uri": format!("{}/hooks/{{destination}}", receiver.url()),
        "concurrency": 4,
    }));
    let sink = outbox_publishers::build_sink("hooks", &config)
        .await
        .unwrap();
    let batch = (0..40)
        .map(|i| Routed {
            cloudevents: None,
            event: event(i, &format!("k{i}"), b"{}".to_vec()),
            target: String::new(),
        })
        .collect();
    assert!(sink.send(batch).await.iter().all(|o| o.is_ok()));
    let max = receiver.recorder.in_flight.lock().unwrap().1;
    assert!(
        max <= 4,
        "at most 4 requests in flight per destination, saw {max}"
    );
    assert!(max > 1, "requests run concurrently, saw {max}");
    assert!(
        receiver
            .requests()
            .iter()
            .all(|r| r.headers.get("webhook-signature").is_none()),
        "no secret, no signature"
    );
}

/// The engine's publish timeout covers a whole batch: a batch queued behind a slow
/// receiver's few requests at a time outlived it, and every event was retried, the ones
/// delivered too (each delivered again, up to its dead letter). A request that cannot
/// start within half the sink's timeout is given back unsent, and is not sent at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_cannot_start_in_time_are_given_back_unsent() {
    outbox_testkit::install_crypto();
    let receiver = Receiver::start().await;
    *receiver.recorder.slow.lock().unwrap() = Some(Duration::from_millis(100));
    let config = read_config(json!({
        "uri": format!("{}/hooks/{{destination}}", receiver.url()),
        "concurrency": 1,
        "timeout": "400ms",
    }));
    let sink = outbox_publishers::build_sink("hooks", &config)
        .await
        .unwrap();
    let events: Vec<_> = (0..10)
        .map(|i| event(i, &format!("k{i}"), b"{}".to_vec()))
        .collect();
    let batch = events
        .iter()
        .map(|e| Routed {
            cloudevents: None,
            event: e.clone(),
            target: String::new(),
        })
        .collect();
    let outcomes = sink.send(batch).await;
    assert!(outcomes[0].is_ok(), "{:?}", outcomes[0]);
    let unsent: Vec<usize> = (0..10)
        .filter(|i| {
            matches!(&outcomes[*i], Err(e) if e.kind() == outbox_core::PublishErrorKind::NotSent)
        })
        .collect();
    assert!(!unsent.is_empty(), "{outcomes:?}");
    assert_eq!(
        outcomes.iter().filter(|o| o.is_ok()).count() + unsent.len(),
        10,
        "sent, or given back: {outcomes:?}"
    );
    let received: Vec<String> = receiver
        .requests()
        .iter()
        .filter_map(|r| r.headers.get("webhook-id")?.to_str().ok().map(String::from))
        .collect();
    for (i, e) in events.iter().enumerate() {
        let id = e.event_id.to_string();
        assert_eq!(
            received.contains(&id),
            !unsent.contains(&i),
            "event {i}: sent once it is not given back"
        );
    }
}

// ---------------------------------------------------------------- Ably

struct AblyHarness {
    receiver: Receiver,
    sink: Arc<dyn Sink>,
    channel: String,
    _key_file: tempfile::NamedTempFile,
}

async fn ably_harness() -> AblyHarness {
    let receiver = Receiver::start().await;
    let key_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(key_file.path(), format!("{ABLY_KEY}\n")).unwrap();
    let config = read_config(json!({
        "uri": "ably:",
        "rest_url": receiver.url(),
        "api_key_file": key_file.path(),
        "timeout": "2s",
    }));
    let sink = outbox_publishers::build_sink("ably", &config)
        .await
        .unwrap();
    AblyHarness {
        receiver,
        sink,
        channel: format!("posts:{}", uuid::Uuid::new_v4().simple()),
        _key_file: key_file,
    }
}

/// Checks one request against Ably's REST publish contract and returns the message.
fn ably_message(request: &Request, channel: &str) -> serde_json::Value {
    use base64::Engine;
    let expected_path = format!("/channels/{}/messages", channel.replace(':', "%3A"));
    assert_eq!(request.path, expected_path);
    let auth = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(ABLY_KEY)
    );
    assert_eq!(request.headers["authorization"].to_str().unwrap(), auth);
    assert_eq!(
        request.headers["content-type"].to_str().unwrap(),
        "application/json"
    );
    let message: serde_json::Value = serde_json::from_slice(&request.body).unwrap();
    let id = message["id"].as_str().expect("a client-supplied id");
    assert!(
        id.ends_with(":0") && uuid::Uuid::parse_str(&id[..id.len() - 2]).is_ok(),
        "id {id} is <event id>:0"
    );
    message
}

impl BrokerHarness for AblyHarness {
    fn sink(&self) -> Arc<dyn Sink> {
        self.sink.clone()
    }

    fn target(&self) -> String {
        self.channel.clone()
    }

    fn received(&self) -> BoxFuture<'_, Vec<Received>> {
        async move {
            self.receiver
                .requests()
                .iter()
                .map(|r| {
                    let m = ably_message(r, &self.channel);
                    let id = m["id"].as_str().unwrap();
                    Received {
                        event_id: id[..id.len() - 2].to_string(),
                        ordering_key: None,
                        payload: m["data"].as_str().unwrap_or_default().as_bytes().to_vec(),
                        traceparent: m["extras"]["headers"]["traceparent"]
                            .as_str()
                            .map(String::from),
                        tracestate: m["extras"]["headers"]["tracestate"]
                            .as_str()
                            .map(String::from),
                        headers: m["extras"]["headers"]
                            .as_object()
                            .into_iter()
                            .flatten()
                            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                            .collect(),
                    }
                })
                .collect()
        }
        .boxed()
    }

    fn broker_dedupes(&self) -> bool {
        false // Ably drops repeats of a client-supplied id; this local server does not
    }

    fn oversized_bytes(&self) -> usize {
        70 * 1024 // above Ably's default 64 KiB message limit
    }

    fn stop_broker(&self) -> BoxFuture<'_, ()> {
        async move { self.receiver.stop() }.boxed()
    }

    fn start_broker(&self) -> BoxFuture<'_, ()> {
        async move { self.receiver.resume().await }.boxed()
    }
}

mod ably {
    use super::*;
    outbox_testkit::publisher_conformance!(ably_harness);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ably_request_is_the_documented_rest_publish() {
    outbox_testkit::install_crypto();
    let h = ably_harness().await;
    let mut e = (*event(5, "k", br#"{"body":"hi"}"#.to_vec())).clone();
    e.payload = outbox_core::Payload::from_json_text(r#"{"body":"hi"}"#.into()).unwrap();
    e.rejected = true;
    let e = Arc::new(e);
    assert!(h
        .sink
        .send(vec![Routed {
            cloudevents: None,
            event: e.clone(),
            target: h.channel.clone()
        }])
        .await[0]
        .is_ok());
    let m = ably_message(&h.receiver.requests()[0], &h.channel);
    assert_eq!(m["id"], format!("{}:0", e.event_id));
    assert_eq!(m["name"], "order.created");
    assert_eq!(m["data"], r#"{"body":"hi"}"#);
    assert_eq!(m["encoding"], "json");
    assert_eq!(m["extras"]["headers"]["trace-id"], "t5");
    assert_eq!(m["extras"]["headers"]["x-ably-models-event-uuid"], "m5");
    assert_eq!(m["extras"]["headers"]["x-ably-models-reject"], "true");
}

#[tokio::test]
async fn ably_keys_never_come_from_the_uri() {
    let config = SinkConfig::new("ably:appid.keyid:secret");
    let err = outbox_publishers::build_sink("ably", &config)
        .await
        .err()
        .unwrap();
    assert!(err.to_string().contains("never in the URI"), "{err}");
    assert!(!err.to_string().contains("secret"));
}

/// A receiver (or a proxy before it) refuses with a body that never ends. Only the body's
/// start is quoted in the error, yet all of it was read, into memory, until the request
/// timed out: the publish is answered once the start is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_with_an_endless_body_is_answered_without_reading_it_all() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    outbox_testkit::install_crypto();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut request = [0u8; 8192];
                let _ = socket.read(&mut request).await;
                let head = "HTTP/1.1 503 Service Unavailable\r\ntransfer-encoding: chunked\r\n\r\n";
                if socket.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let chunk = format!("{:x}\r\n{}\r\n", 4096, "x".repeat(4096));
                while socket.write_all(chunk.as_bytes()).await.is_ok() {}
            });
        }
    });
    let config = read_config(json!({
        "uri": format!("http://{addr}/hooks/{{destination}}"),
        "timeout": "60s",
    }));
    let sink = outbox_publishers::build_sink("hooks", &config)
        .await
        .unwrap();
    let sent = sink.send(vec![Routed {
        cloudevents: None,
        event: event(1, "k", b"{}".to_vec()),
        target: String::new(),
    }]);
    // Far below the sink's own 60 s timeout, which the endless body used to run into.
    let outcome = tokio::time::timeout(Duration::from_secs(20), sent)
        .await
        .expect("the refusal answered before the request's timeout")
        .remove(0);
    let error = outcome.expect_err("503");
    assert!(
        matches!(error.disposition(), Disposition::Retry { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("503"), "{error}");
}

/// A receiver whose error echoes what it was sent: the Authorization header (HTTP Basic,
/// made of the URL's password), the password itself, and the signing secret. The sink's
/// error, which becomes `last_error`, the log line and the API's answer, carried the
/// password (as base64, and as written). Every secret the sink sends is scrubbed from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_echoes_the_credentials_gets_none_into_the_error() {
    outbox_testkit::install_crypto();
    async fn echo(headers: HeaderMap) -> Response {
        let auth = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        let body = format!(
            "ERR auth={auth}; Authorization: {auth}; you sent password HOOKPASSs3cr3t, creds \
             hookuser:HOOKPASSs3cr3t, secret {SECRET}"
        );
        (StatusCode::BAD_REQUEST, body).into_response()
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().route("/hooks/{*rest}", post(echo));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let config = read_config(json!({
        "uri": format!("http://hookuser:HOOKPASSs3cr3t@{addr}/hooks/{{destination}}"),
        "secret": SECRET,
    }));
    let sink = outbox_publishers::build_sink("hooks", &config)
        .await
        .unwrap();
    let err = sink
        .send(vec![Routed {
            cloudevents: None,
            event: event(1, "k", b"{}".to_vec()),
            target: String::new(),
        }])
        .await
        .remove(0)
        .expect_err("the receiver refuses");
    let said = err.report();
    for secret in [
        "HOOKPASSs3cr3t",
        "aG9va3VzZXI6SE9PS1BBU1NzM2NyM3Q",
        &SECRET["whsec_".len()..],
    ] {
        assert!(!said.contains(secret), "{said}");
    }
    assert!(said.contains("ERR auth="), "{said}");
}

/// The webhook's health check is a HEAD to the receiver's URL as far as it is written out,
/// any answer passing: but a load balancer or gateway with no receiver behind it answers
/// 502-504, which is the receiver down. The check passed then, so an outbox of one key,
/// whose head alone fails through such an outage, spent that event's attempts as if the
/// receiver refused it. The gateway here routes by path, its `/` going nowhere (503): the
/// check asks `/hooks/`, the receiver's, where asking the server's root failed for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_with_no_receiver_behind_it_fails_the_health_check() {
    use std::sync::atomic::{AtomicU16, Ordering};
    outbox_testkit::install_crypto();
    let status = Arc::new(AtomicU16::new(404));
    let answer = status.clone();
    let app = axum::Router::new().fallback(move |uri: Uri| {
        let status = match uri.path().starts_with("/hooks/") {
            true => StatusCode::from_u16(answer.load(Ordering::SeqCst)).unwrap(),
            false => StatusCode::SERVICE_UNAVAILABLE,
        };
        async move { status }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let config = read_config(json!({ "uri": format!("http://{addr}/hooks/{{destination}}") }));
    let sink = outbox_publishers::build_sink("hooks", &config)
        .await
        .unwrap();
    for passing in [404, 405, 200, 500] {
        status.store(passing, Ordering::SeqCst);
        sink.health()
            .await
            .unwrap_or_else(|e| panic!("{passing}: {e}"));
    }
    for down in [502, 503, 504] {
        status.store(down, Ordering::SeqCst);
        let error = sink.health().await.expect_err("a gateway with no receiver");
        assert_eq!(error.kind(), outbox_core::PublishErrorKind::Unavailable);
        assert!(
            error.to_string().contains(&format!("answered {down}")),
            "{error}"
        );
    }
}
