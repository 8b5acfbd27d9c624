//! The AWS sinks' credentials from the machine: EC2 instance metadata (IMDSv2) and the
//! ECS/EKS container endpoint, against servers in this process that answer as AWS documents
//! them (the session-token PUT and its TTL header, the token on every GET or 401, the role
//! listing, expiry, the container endpoint's `Authorization`). The end-to-end test signs a
//! real call to moto (`OUTBOX_TEST_AWS_ENDPOINT`) with what the fake IMDS handed out.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, put};
use axum::Router;
use futures::FutureExt;
use outbox_core::{Disposition, PublishErrorKind};
use outbox_publishers::aws::credentials::{Found, Provider};
use outbox_publishers::aws::{self, AwsClient, AwsConfig, Service};
use outbox_publishers::{Routed, SinkConfig, SinkSetupError};
use serde_json::json;
use tokio::sync::Notify;

const ROLE: &str = "outbox-relay-role";
const TTL_HEADER: &str = "x-aws-ec2-metadata-token-ttl-seconds";
const TOKEN_HEADER: &str = "x-aws-ec2-metadata-token";

/// What the fake IMDS hands out, fetch by fetch, and what it saw.
#[derive(Default)]
struct Imds {
    tokens: Mutex<Vec<String>>,
    /// Credential documents asked for (answered or not).
    fetches: AtomicUsize,
    /// GETs refused for a missing or unknown token.
    refused: AtomicUsize,
    /// Seconds until expiry of the credentials of fetch n (1-based); 6 hours past the list.
    expires_in: Mutex<Vec<i64>>,
    /// Fetches from this one on fail with 500.
    fail_from: Mutex<Option<usize>>,
    /// Fetch n waits for this before it answers.
    hold: Mutex<Option<(usize, Arc<Notify>)>>,
    /// Wakes a test waiting for the next fetch.
    fetched: Notify,
}

impl Imds {
    fn token_ok(&self, headers: &HeaderMap) -> bool {
        let sent = headers.get(TOKEN_HEADER).and_then(|v| v.to_str().ok());
        let ok = sent.is_some_and(|t| self.tokens.lock().unwrap().iter().any(|k| k == t));
        if !ok {
            self.refused.fetch_add(1, Ordering::SeqCst);
        }
        ok
    }
}

/// `PUT /latest/api/token`: a TTL header of 1 to 21600 seconds is required.
async fn imds_token(State(imds): State<Arc<Imds>>, headers: HeaderMap) -> Response {
    let ttl = headers
        .get(TTL_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u32>().ok());
    match ttl {
        Some(ttl @ 1..=21600) => {
            let token = format!("imds-token-{}", uuid::Uuid::new_v4().simple());
            imds.tokens.lock().unwrap().push(token.clone());
            ([(TTL_HEADER, ttl.to_string())], token).into_response()
        }
        _ => StatusCode::BAD_REQUEST.into_response(),
    }
}

async fn imds_roles(State(imds): State<Arc<Imds>>, headers: HeaderMap) -> Response {
    if !imds.token_ok(&headers) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    ROLE.into_response()
}

async fn imds_credentials(
    State(imds): State<Arc<Imds>>,
    Path(role): Path<String>,
    headers: HeaderMap,
) -> Response {
    if !imds.token_ok(&headers) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    if role != ROLE {
        return StatusCode::NOT_FOUND.into_response();
    }
    let n = imds.fetches.fetch_add(1, Ordering::SeqCst) + 1;
    imds.fetched.notify_waiters();
    let hold = imds.hold.lock().unwrap().clone();
    if let Some((at, gate)) = hold.filter(|(at, _)| *at == n) {
        let _ = at;
        gate.notified().await;
    }
    if imds.fail_from.lock().unwrap().is_some_and(|from| n >= from) {
        return (StatusCode::INTERNAL_SERVER_ERROR, "internal error").into_response();
    }
    let expires_in = imds
        .expires_in
        .lock()
        .unwrap()
        .get(n - 1)
        .copied()
        .unwrap_or(6 * 3600);
    document(n, expires_in).to_string().into_response()
}

fn document(n: usize, expires_in: i64) -> serde_json::Value {
    let now = SystemTime::now();
    let expires = if expires_in >= 0 {
        now + Duration::from_secs(expires_in as u64)
    } else {
        now - Duration::from_secs(expires_in.unsigned_abs())
    };
    json!({
        "Code": "Success",
        "LastUpdated": humantime::format_rfc3339_seconds(now).to_string(),
        "Type": "AWS-HMAC",
        "AccessKeyId": format!("ASIAIMDS{n}"),
        "SecretAccessKey": format!("imds-secret-{n}"),
        "Token": format!("imds-session-{n}"),
        "Expiration": humantime::format_rfc3339_seconds(expires).to_string(),
    })
}

async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    format!("http://{address}")
}

async fn fake_imds(imds: Arc<Imds>) -> String {
    let router = Router::new()
        .route("/latest/api/token", put(imds_token))
        .route(
            "/latest/meta-data/iam/security-credentials/",
            get(imds_roles),
        )
        .route(
            "/latest/meta-data/iam/security-credentials/{role}",
            get(imds_credentials),
        )
        .with_state(imds);
    serve(router).await
}

fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let vars: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |name| vars.get(name).cloned()
}

/// The chain as a sink would walk it, with no profile files to find.
fn chain(vars: &[(&str, &str)]) -> Result<Found, SinkSetupError> {
    outbox_testkit::install_crypto();
    let mut vars = vars.to_vec();
    vars.push(("HOME", "/nonexistent"));
    Provider::from_chain(&env_of(&vars), None, None, reqwest::Client::new())
}

#[tokio::test]
async fn imds_v2_hands_out_the_roles_credentials() {
    let imds = Arc::new(Imds::default());
    let endpoint = fake_imds(imds.clone()).await;
    let found = chain(&[("AWS_EC2_METADATA_SERVICE_ENDPOINT", &endpoint)]).unwrap();
    assert_eq!(
        found.provider.origin(),
        format!("instance metadata at {endpoint}")
    );
    let credentials = found.provider.get().await.unwrap();
    assert_eq!(credentials.access_key_id, "ASIAIMDS1");
    assert_eq!(credentials.secret_access_key.expose(), "imds-secret-1");
    assert_eq!(
        credentials.session_token.as_ref().map(|t| t.expose()),
        Some("imds-session-1")
    );
    assert!(credentials.expires.is_some());
    // Valid credentials are served from the cache, not fetched per request.
    found.provider.get().await.unwrap();
    assert_eq!(imds.fetches.load(Ordering::SeqCst), 1);
    // Neither the secret nor the session token shows in Debug output.
    let shown = format!("{credentials:?}");
    assert!(
        !shown.contains("imds-secret") && !shown.contains("imds-session"),
        "{shown}"
    );
}

/// IMDSv2 refuses a GET without the session token (401): the client must send it on the
/// listing and on the role's document, and does.
#[tokio::test]
async fn a_get_without_the_session_token_is_refused_and_the_client_sends_it() {
    outbox_testkit::install_crypto();
    let imds = Arc::new(Imds::default());
    let endpoint = fake_imds(imds.clone()).await;
    let bare = reqwest::get(format!(
        "{endpoint}/latest/meta-data/iam/security-credentials/"
    ))
    .await
    .unwrap();
    assert_eq!(bare.status(), 401, "the fake IMDS requires the token");
    assert_eq!(imds.refused.swap(0, Ordering::SeqCst), 1);
    let no_ttl = reqwest::Client::new()
        .put(format!("{endpoint}/latest/api/token"))
        .send()
        .await
        .unwrap();
    assert_eq!(no_ttl.status(), 400, "the PUT requires its TTL header");

    let found = chain(&[("AWS_EC2_METADATA_SERVICE_ENDPOINT", &endpoint)]).unwrap();
    let got = found.provider.get().await;
    assert!(got.is_ok(), "{:?}", got.err().map(|e| e.report()));
    assert_eq!(imds.refused.load(Ordering::SeqCst), 0);
}

/// Credentials nearing expiry are fetched again in the background: requests meanwhile keep
/// signing with the current ones without waiting, then move to the new ones.
#[tokio::test]
async fn credentials_are_refreshed_before_they_expire_without_holding_requests() {
    let imds = Arc::new(Imds::default());
    // Both sets are inside the refresh window (5 minutes) but valid for 4 more.
    *imds.expires_in.lock().unwrap() = vec![240, 240];
    let gate = Arc::new(Notify::new());
    *imds.hold.lock().unwrap() = Some((2, gate.clone()));
    let endpoint = fake_imds(imds.clone()).await;
    let found = chain(&[("AWS_EC2_METADATA_SERVICE_ENDPOINT", &endpoint)]).unwrap();
    let provider = found.provider;
    assert_eq!(provider.get().await.unwrap().access_key_id, "ASIAIMDS1");

    // This request starts the refresh, which the fake IMDS holds, and goes on at once:
    // its future is ready on its first poll, without waiting for anything.
    let second_fetch = imds.fetched.notified();
    tokio::pin!(second_fetch);
    second_fetch.as_mut().enable();
    let during = provider.get().now_or_never();
    let during = during.expect("a request waited for the refresh");
    assert_eq!(during.unwrap().access_key_id, "ASIAIMDS1");
    tokio::time::timeout(Duration::from_secs(5), second_fetch)
        .await
        .expect("no refresh started");
    // Requests meanwhile start no second refresh, and wait for none.
    for _ in 0..10 {
        let meanwhile = provider.get().now_or_never();
        let meanwhile = meanwhile.expect("a request waited for the refresh");
        assert_eq!(meanwhile.unwrap().access_key_id, "ASIAIMDS1");
    }
    assert_eq!(imds.fetches.load(Ordering::SeqCst), 2);

    gate.notify_one();
    let refreshed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let credentials = provider.get().await.unwrap();
            if credentials.access_key_id != "ASIAIMDS1" {
                return credentials;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the refreshed credentials were never used");
    assert_eq!(refreshed.access_key_id, "ASIAIMDS2");
    // The new set is inside the window too: requests do not each fetch again.
    for _ in 0..5 {
        assert_eq!(provider.get().await.unwrap().access_key_id, "ASIAIMDS2");
        provider.idle().await;
    }
    assert_eq!(imds.fetches.load(Ordering::SeqCst), 2);
}

/// A refresh that fails keeps the current credentials while they are valid; once they have
/// expired, requests fail retryably, naming the source.
#[tokio::test]
async fn a_failed_refresh_keeps_valid_credentials_then_fails_retryably_once_expired() {
    let imds = Arc::new(Imds::default());
    *imds.expires_in.lock().unwrap() = vec![2];
    *imds.fail_from.lock().unwrap() = Some(2);
    let endpoint = fake_imds(imds.clone()).await;
    let found = chain(&[("AWS_EC2_METADATA_SERVICE_ENDPOINT", &endpoint)]).unwrap();
    let provider = found.provider;
    let first = provider.get().await.unwrap();
    assert_eq!(first.access_key_id, "ASIAIMDS1");
    let failed_refresh = imds.fetched.notified();
    tokio::pin!(failed_refresh);
    failed_refresh.as_mut().enable();
    assert_eq!(provider.get().await.unwrap().access_key_id, "ASIAIMDS1");
    tokio::time::timeout(Duration::from_secs(5), failed_refresh)
        .await
        .expect("no refresh started");
    provider.idle().await;
    // The refresh failed: the current credentials still sign, and the requests meanwhile
    // do not each ask again.
    for _ in 0..5 {
        assert_eq!(provider.get().await.unwrap().access_key_id, "ASIAIMDS1");
        provider.idle().await;
    }
    assert_eq!(imds.fetches.load(Ordering::SeqCst), 2);

    // Waiting for time itself to pass the expiry, not for another task.
    let expires = first.expires.unwrap();
    if let Ok(left) = expires.duration_since(SystemTime::now()) {
        tokio::time::sleep(left + Duration::from_millis(50)).await;
    }
    let error = provider.get().await.unwrap_err();
    assert!(
        matches!(error.disposition(), Disposition::Retry { .. }),
        "{error}"
    );
    let report = error.report();
    assert!(
        report.contains(&format!("from instance metadata at {endpoint} expired at"))
            && report.contains("HTTP 500"),
        "{report}"
    );
}

/// From a container behind the instance's default hop limit (1), the token PUT's answer
/// never arrives: the error names the hop limit and the command that raises it.
#[tokio::test]
async fn a_token_put_without_an_answer_names_the_hop_limit_fix() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    // Takes connections and reads, but answers nothing, as past the hop limit.
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let found = chain(&[("AWS_EC2_METADATA_SERVICE_ENDPOINT", &endpoint)]).unwrap();
    let error = found.provider.get().await.unwrap_err();
    assert!(
        matches!(error.disposition(), Disposition::Retry { .. }),
        "{error}"
    );
    let report = error.report();
    assert!(
        report.contains("hop limit")
            && report.contains(
                "aws ec2 modify-instance-metadata-options --instance-id <id> \
                 --http-put-response-hop-limit 2"
            ),
        "{report}"
    );
}

/// Off EC2 nothing answers at the metadata address: the error, retried, names what else
/// the relay could be given.
#[tokio::test]
async fn instance_metadata_out_of_reach_names_the_other_steps() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let found = chain(&[("AWS_EC2_METADATA_SERVICE_ENDPOINT", &endpoint)]).unwrap();
    let error = found.provider.get().await.unwrap_err();
    assert_eq!(error.kind(), PublishErrorKind::Unavailable, "{error}");
    let message = error.to_string();
    assert!(
        message.contains("cannot be reached")
            && message.contains("AWS_ACCESS_KEY_ID")
            && message.contains("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"),
        "{message}"
    );
}

/// The fake container endpoint (ECS, EKS Pod Identity): the one token it takes in
/// `Authorization`, and the tokens it was sent.
#[derive(Default)]
struct ContainerEndpoint {
    token: Mutex<String>,
    seen: Mutex<Vec<Option<String>>>,
}

async fn container_credentials(
    State(endpoint): State<Arc<ContainerEndpoint>>,
    headers: HeaderMap,
) -> Response {
    let sent = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let n = {
        let mut seen = endpoint.seen.lock().unwrap();
        seen.push(sent.clone());
        seen.len()
    };
    if sent.as_deref() != Some(endpoint.token.lock().unwrap().as_str()) {
        return (StatusCode::UNAUTHORIZED, "invalid token").into_response();
    }
    let mut document = document(n, 3600);
    document.as_object_mut().unwrap().remove("Code");
    document.as_object_mut().unwrap().remove("Type");
    document["RoleArn"] = json!("arn:aws:iam::123456789012:role/pod");
    document.to_string().into_response()
}

/// EKS Pod Identity: `AWS_CONTAINER_CREDENTIALS_FULL_URI` with the token file, read again
/// for every fetch because the kubelet rotates it.
#[tokio::test]
async fn container_credentials_carry_the_token_file() {
    let endpoint = Arc::new(ContainerEndpoint::default());
    *endpoint.token.lock().unwrap() = "pod-token-1".into();
    let router = Router::new()
        .route("/v1/credentials", get(container_credentials))
        .with_state(endpoint.clone());
    let url = format!("{}/v1/credentials", serve(router).await);
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("eks-pod-identity-token");
    std::fs::write(&token_file, "pod-token-1\n").unwrap();
    let token_path = token_file.display().to_string();
    let vars = [
        ("AWS_CONTAINER_CREDENTIALS_FULL_URI", url.as_str()),
        (
            "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
            token_path.as_str(),
        ),
        // The file wins over a token given inline.
        ("AWS_CONTAINER_AUTHORIZATION_TOKEN", "stale-inline-token"),
        // The container endpoint comes before instance metadata.
        ("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://127.0.0.1:9"),
    ];
    let found = chain(&vars).unwrap();
    assert_eq!(
        found.provider.origin(),
        format!("the container credentials endpoint {url}")
    );
    let got = found.provider.get().await;
    let credentials = got.unwrap_or_else(|e| panic!("{}", e.report()));
    assert_eq!(credentials.access_key_id, "ASIAIMDS1");

    // Rotated: the next fetch reads the new token.
    std::fs::write(&token_file, "pod-token-2\n").unwrap();
    *endpoint.token.lock().unwrap() = "pod-token-2".into();
    found.provider.forget().await;
    let got = found.provider.get().await;
    assert_eq!(
        got.unwrap_or_else(|e| panic!("{}", e.report()))
            .access_key_id,
        "ASIAIMDS2"
    );
    assert_eq!(
        *endpoint.seen.lock().unwrap(),
        [Some("pod-token-1".to_string()), Some("pod-token-2".into())]
    );

    // A token the endpoint refuses: retryable, naming the variables to check.
    *endpoint.token.lock().unwrap() = "pod-token-3".into();
    found.provider.forget().await;
    let error = found.provider.get().await.unwrap_err();
    assert_eq!(error.kind(), PublishErrorKind::Unavailable);
    assert!(
        error
            .to_string()
            .contains("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"),
        "{error}"
    );
}

/// `AWS_CONTAINER_CREDENTIALS_FULL_URI` may only send the token in clear to the hosts the
/// SDKs allow; anything else is refused when the sink is built.
#[test]
fn a_full_uri_to_another_host_is_refused() {
    for refused in [
        "http://169.254.169.254/latest/meta-data/",
        "http://example.com/creds",
        "http://10.0.0.7:8080/creds",
        "ftp://127.0.0.1/creds",
    ] {
        let error = chain(&[("AWS_CONTAINER_CREDENTIALS_FULL_URI", refused)])
            .err()
            .unwrap_or_else(|| panic!("{refused} was allowed"));
        assert!(error.kind().is_config(), "{error}");
        assert!(
            error.to_string().contains("169.254.170.23"),
            "the error names the hosts allowed: {error}"
        );
    }
    for allowed in [
        "http://127.0.0.1:8080/creds",
        "http://localhost/creds",
        "http://[::1]/creds",
        "http://169.254.170.2/v2/credentials/x",
        "http://169.254.170.23/v1/credentials",
        "http://[fd00:ec2::23]/v1/credentials",
        "https://creds.example.com/x",
    ] {
        let found = chain(&[("AWS_CONTAINER_CREDENTIALS_FULL_URI", allowed)]);
        assert!(found.is_ok(), "{allowed}: {:?}", found.err());
    }
    // RELATIVE_URI is on ECS's own address, and wins over FULL_URI.
    let found = chain(&[
        (
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
            "/v2/credentials/abc",
        ),
        ("AWS_CONTAINER_CREDENTIALS_FULL_URI", "http://example.com/"),
    ])
    .unwrap();
    assert_eq!(
        found.provider.origin(),
        "the container credentials endpoint http://169.254.170.2/v2/credentials/abc"
    );
}

/// The SDKs' order: the environment, then (web identity and profile, tested with the chain
/// itself) the container endpoint, then instance metadata unless it is disabled.
#[test]
fn the_chain_ends_with_the_container_then_instance_metadata() {
    let container = (
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "/v2/credentials/abc",
    );
    let imds = ("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://127.0.0.1:9");
    let keys = [
        ("AWS_ACCESS_KEY_ID", "AKENV"),
        ("AWS_SECRET_ACCESS_KEY", "secret"),
    ];
    let origin = |vars: &[(&str, &str)]| chain(vars).unwrap().provider.origin().to_string();
    assert_eq!(
        origin(&[keys[0], keys[1], container, imds]),
        "the environment"
    );
    assert!(origin(&[container, imds]).starts_with("the container credentials endpoint"));
    assert_eq!(origin(&[imds]), "instance metadata at http://127.0.0.1:9");
    assert_eq!(origin(&[]), "instance metadata at http://169.254.169.254");
    assert_eq!(
        origin(&[("AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE", "IPv6")]),
        "instance metadata at http://[fd00:ec2::254]"
    );
    let error = chain(&[("AWS_EC2_METADATA_SERVICE_ENDPOINT", "169.254.169.254")])
        .err()
        .unwrap();
    assert!(
        error.kind().is_config() && error.to_string().contains("is not an http URL"),
        "{error}"
    );
    let error = chain(&[imds, ("AWS_EC2_METADATA_DISABLED", "true")])
        .err()
        .unwrap();
    assert!(
        error.kind().is_config() && error.to_string().contains("no AWS credentials found"),
        "{error}"
    );
}

/// What the recording stand-in in front of moto saw.
#[derive(Default)]
struct Recorded {
    upstream: String,
    requests: Mutex<Vec<HeaderMap>>,
}

/// Records each request's headers and passes it on to moto unchanged.
async fn record_and_forward(
    State(recorded): State<Arc<Recorded>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    recorded.requests.lock().unwrap().push(headers.clone());
    let mut request = reqwest::Client::new().request(method, format!("{}{uri}", recorded.upstream));
    for (name, value) in &headers {
        if name != "host" && name != "content-length" {
            request = request.header(name.as_str(), value.as_bytes());
        }
    }
    let answer = request.body(body).send().await.unwrap();
    let status = StatusCode::from_u16(answer.status().as_u16()).unwrap();
    let mut forwarded = HeaderMap::new();
    for (name, value) in answer.headers() {
        if matches!(name.as_str(), "content-type" | "x-amzn-query-error") {
            forwarded.insert(
                axum::http::HeaderName::from_bytes(name.as_str().as_bytes()).unwrap(),
                axum::http::HeaderValue::from_bytes(value.as_bytes()).unwrap(),
            );
        }
    }
    (status, forwarded, answer.bytes().await.unwrap()).into_response()
}

/// An SQS sink on "EC2": its credentials come from the fake IMDS, and moto takes the call
/// signed with them (the access key id and session token checked on the way in).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sqs_sink_signs_with_instance_credentials() {
    outbox_testkit::install_crypto();
    let moto = std::env::var("OUTBOX_TEST_AWS_ENDPOINT").expect(
        "OUTBOX_TEST_AWS_ENDPOINT is not set: source /tmp/test-env.sh, or run the tests \
         through scripts/test.sh",
    );
    let imds = Arc::new(Imds::default());
    let imds_endpoint = fake_imds(imds.clone()).await;
    let recorded = Arc::new(Recorded {
        upstream: moto.clone(),
        ..Recorded::default()
    });
    let recorder = serve(
        Router::new()
            .fallback(any(record_and_forward))
            .with_state(recorded.clone()),
    )
    .await;

    // The queue, made with static keys straight at moto.
    let admin_env = env_of(&[
        ("AWS_ACCESS_KEY_ID", "AKIDADMIN"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_REGION", "us-east-1"),
    ]);
    let admin = AwsClient::new(
        Service::Sqs,
        &AwsConfig {
            endpoint: Some(moto.clone()),
            ..AwsConfig::default()
        },
        &admin_env,
    )
    .unwrap();
    let name = format!("imds-{}", uuid::Uuid::new_v4().simple());
    let created = admin
        .json(
            "AmazonSQS",
            "CreateQueue",
            "1.0",
            &json!({ "QueueName": name }),
        )
        .await
        .unwrap();
    let url = created["QueueUrl"].as_str().unwrap().to_string();

    let home = tempfile::tempdir().unwrap();
    let sink_env = env_of(&[
        ("AWS_REGION", "us-east-1"),
        ("AWS_EC2_METADATA_SERVICE_ENDPOINT", &imds_endpoint),
        ("HOME", home.path().to_str().unwrap()),
    ]);
    let config: SinkConfig =
        serde_json::from_value(json!({ "uri": "sqs:", "endpoint": recorder, "timeout": "5s" }))
            .unwrap();
    let sink = aws::sink(&config, &sink_env).unwrap();
    assert!(
        sink.describe()
            .contains("credentials from instance metadata"),
        "{}",
        sink.describe()
    );
    let event = outbox_testkit::publisher::event(1, "k", b"{\"on\":\"ec2\"}".to_vec());
    let outcomes = sink
        .send(vec![Routed {
            event,
            target: url.clone(),
            cloudevents: None,
        }])
        .await;
    assert!(outcomes[0].is_ok(), "{outcomes:?}");

    let requests = recorded.requests.lock().unwrap().clone();
    assert!(!requests.is_empty());
    for headers in &requests {
        let authorization = headers["authorization"].to_str().unwrap();
        assert!(
            authorization.starts_with("AWS4-HMAC-SHA256 Credential=ASIAIMDS1/"),
            "{authorization}"
        );
        assert_eq!(headers["x-amz-security-token"], "imds-session-1");
    }
    // And the message is in moto's queue.
    let received = admin
        .json(
            "AmazonSQS",
            "ReceiveMessage",
            "1.0",
            &json!({ "QueueUrl": url, "MaxNumberOfMessages": 1 }),
        )
        .await
        .unwrap();
    assert_eq!(
        received["Messages"][0]["Body"].as_str(),
        Some("{\"on\":\"ec2\"}")
    );
}
