//! The publisher conformance suite against a real nats-server with JetStream (one private
//! server per test, so the restart test disturbs nobody).

use std::sync::Arc;

use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_publishers::{Sink, SinkConfig};
use outbox_testkit::nats::{stream, PrivateNats};
use outbox_testkit::publisher::{BrokerHarness, Received};

struct NatsHarness {
    server: PrivateNats,
    sink: Arc<dyn Sink>,
    subject: String,
    stream: String,
}

fn url(server: &PrivateNats) -> String {
    server.url.clone()
}

async fn new_harness() -> NatsHarness {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let subject = format!("orders.{id}");
    let stream = format!("S{id}");
    let server = PrivateNats::with_stream(async_nats::jetstream::stream::Config {
        storage: async_nats::jetstream::stream::StorageType::File,
        ..self::stream(&stream, &[&subject])
    })
    .await;
    let config = SinkConfig::new(url(&server));
    let sink = outbox_publishers::build_sink("nats", &config)
        .await
        .unwrap();
    NatsHarness {
        server,
        sink,
        subject,
        stream,
    }
}

impl BrokerHarness for NatsHarness {
    fn sink(&self) -> Arc<dyn Sink> {
        self.sink.clone()
    }

    fn target(&self) -> String {
        self.subject.clone()
    }

    fn received(&self) -> BoxFuture<'_, Vec<Received>> {
        async move {
            let Ok(client) = async_nats::connect(url(&self.server)).await else {
                return Vec::new();
            };
            let js = async_nats::jetstream::new(client);
            let Ok(mut stream) = js.get_stream(&self.stream).await else {
                return Vec::new();
            };
            let Ok(info) = stream.info().await else {
                return Vec::new();
            };
            let (first, last) = (info.state.first_sequence, info.state.last_sequence);
            let mut out = Vec::new();
            for seq in first..=last {
                if last == 0 {
                    break;
                }
                let message = stream.get_raw_message(seq).await.unwrap();
                let header = |name: &str| {
                    message
                        .headers
                        .get(name)
                        .map(|v| v.as_str().to_string())
                        .unwrap_or_default()
                };
                out.push(Received {
                    event_id: header("Nats-Msg-Id"),
                    ordering_key: Some(header("Outbox-Partition-Key")),
                    payload: message.payload.to_vec(),
                    traceparent: message.headers.get("traceparent").map(|v| v.to_string()),
                    tracestate: message.headers.get("tracestate").map(|v| v.to_string()),
                    headers: message
                        .headers
                        .iter()
                        .flat_map(|(name, values)| {
                            values
                                .iter()
                                .map(move |v| (name.to_string(), v.as_str().to_string()))
                        })
                        .collect(),
                });
            }
            out
        }
        .boxed()
    }

    fn broker_dedupes(&self) -> bool {
        true
    }

    fn oversized_bytes(&self) -> usize {
        2 * 1024 * 1024 // nats-server's default max_payload is 1 MiB
    }

    fn stop_broker(&self) -> BoxFuture<'_, ()> {
        async move { self.server.stop() }.boxed()
    }

    fn start_broker(&self) -> BoxFuture<'_, ()> {
        async move { self.server.resume() }.boxed()
    }
}

outbox_testkit::publisher_conformance!(new_harness);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_stream_is_a_retryable_error_naming_the_subject() {
    let harness = new_harness().await;
    let event = outbox_testkit::publisher::event(1, "k", b"{}".to_vec());
    let outcomes = harness
        .sink
        .send(vec![outbox_publishers::Routed {
            cloudevents: None,
            event,
            target: "nowhere.subject".into(),
        }])
        .await;
    let err = outcomes[0].as_ref().unwrap_err();
    assert!(
        matches!(err.disposition(), outbox_core::Disposition::Retry { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("nowhere.subject"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_headers_type_and_key_travel_as_nats_headers() {
    let harness = new_harness().await;
    let event = outbox_testkit::publisher::event(7, "customer-7", b"{\"a\":1}".to_vec());
    let id = event.event_id.to_string();
    let routed = outbox_publishers::Routed {
        cloudevents: None,
        event,
        target: harness.subject.clone(),
    };
    assert!(harness.sink.send(vec![routed]).await[0].is_ok());
    let client = async_nats::connect(url(&harness.server)).await.unwrap();
    let stream = async_nats::jetstream::new(client)
        .get_stream(&harness.stream)
        .await
        .unwrap();
    let message = stream.get_raw_message(1).await.unwrap();
    let h = &message.headers;
    assert_eq!(h.get("Nats-Msg-Id").unwrap().as_str(), id);
    assert_eq!(
        h.get("Outbox-Event-Type").unwrap().as_str(),
        "order.created"
    );
    assert_eq!(
        h.get("Outbox-Partition-Key").unwrap().as_str(),
        "customer-7"
    );
    assert_eq!(h.get("Outbox-Sequence-Id").unwrap().as_str(), "7");
    assert_eq!(h.get("Outbox-Mutation-Id").unwrap().as_str(), "m7");
    assert_eq!(h.get("trace-id").unwrap().as_str(), "t7");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_is_verified_against_the_configured_ca() {
    outbox_testkit::install_crypto();
    let certs = outbox_testkit::server::test_certs();
    let server = PrivateNats::with_tls(certs.path()).await;
    let url = server.url.clone();
    // The stream, made over TLS by a client that trusts the test CA.
    server.add_stream(stream("TLS", &["secure"])).await;
    let config: SinkConfig = serde_json::from_value(serde_json::json!({
        "uri": url,
        "tls_ca_file": certs.path().join("ca.pem"),
    }))
    .unwrap();
    let sink = outbox_publishers::build_sink("nats", &config)
        .await
        .unwrap();
    let event = outbox_testkit::publisher::event(1, "k", b"{}".to_vec());
    let outcomes = sink
        .send(vec![outbox_publishers::Routed {
            cloudevents: None,
            event,
            target: "secure".into(),
        }])
        .await;
    assert!(outcomes[0].is_ok(), "{:?}", outcomes[0]);
    // Without the CA the server is not trusted: nothing is published.
    let untrusted = SinkConfig::new(url);
    let sink = outbox_publishers::build_sink("nats", &untrusted)
        .await
        .unwrap();
    let event = outbox_testkit::publisher::event(2, "k", b"{}".to_vec());
    let outcomes = sink
        .send(vec![outbox_publishers::Routed {
            cloudevents: None,
            event,
            target: "secure".into(),
        }])
        .await;
    assert!(
        outcomes[0].is_err(),
        "an untrusted server must not get the event"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_jetstream_is_a_setup_error() {
    let server = PrivateNats::without_jetstream().await;
    let err = match outbox_publishers::build_sink("nats", &SinkConfig::new(url(&server))).await {
        Ok(_) => panic!("a server without JetStream cannot take the relay's events"),
        Err(e) => e,
    };
    assert!(err.kind().is_config(), "{err}");
    assert!(
        err.to_string().contains("start nats-server with -js"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subject_without_a_stream_fails_at_once_until_it_is_checked_again() {
    let harness = new_harness().await;
    let send = |seq: i64| {
        let event = outbox_testkit::publisher::event(seq, "k", b"{}".to_vec());
        harness.sink.send(vec![outbox_publishers::Routed {
            cloudevents: None,
            event,
            target: "later.subject".into(),
        }])
    };
    let kind = |mut outcomes: Vec<outbox_core::Outcome>| outcomes.remove(0).map_err(|e| e.kind());
    let missing = Err(outbox_core::PublishErrorKind::MissingTarget);
    assert_eq!(kind(send(1).await), missing);
    harness
        .server
        .add_stream(stream("LATER", &["later.subject"]))
        .await;
    // Found missing a moment ago: not published again yet.
    assert_eq!(kind(send(2).await), missing);
    tokio::time::sleep(outbox_publishers::nats::MISSING_STREAM_RECHECK).await;
    assert_eq!(kind(send(3).await), Ok(()));
}

/// A stream's own refusal of a message (here its `max_msg_size`, far below the server's
/// `max_payload`) came back as a status 400, and was retried with backoff, its key held for
/// an hour, before it was dead-lettered. A stream's 400 is the message's: permanent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_the_stream_refuses_fails_permanently() {
    let server = PrivateNats::start().await;
    server
        .add_stream(async_nats::jetstream::stream::Config {
            max_message_size: 1024,
            ..stream("SMALL", &["small"])
        })
        .await;
    let sink = outbox_publishers::build_sink("nats", &SinkConfig::new(url(&server)))
        .await
        .unwrap();
    let routed = |seq, bytes: usize| outbox_publishers::Routed {
        cloudevents: None,
        event: outbox_testkit::publisher::event(seq, "k", vec![b'x'; bytes]),
        target: "small".into(),
    };
    let outcomes = sink.send(vec![routed(1, 4096), routed(2, 10)]).await;
    let err = outcomes[0].as_ref().unwrap_err();
    assert_eq!(
        err.disposition(),
        outbox_core::Disposition::Permanent,
        "{err}"
    );
    assert_eq!(err.kind(), outbox_core::PublishErrorKind::TooLarge, "{err}");
    assert!(outcomes[1].is_ok(), "{:?}", outcomes[1]);
}

/// An account whose JetStream storage is full answers each publish with a 400 (error
/// 10002, "resource limits exceeded for account"), which was taken for the message's own
/// refusal: every event was dead-lettered at once until space was freed. It is the
/// account's condition, as a full stream's 503 is: retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_jetstream_account_is_retried_not_dead_lettered() {
    outbox_testkit::install_crypto();
    let conf = tempfile::tempdir().unwrap();
    let conf_path = conf.path().join("nats.conf");
    std::fs::write(
        &conf_path,
        "accounts { APP { jetstream { max_file: 65536, max_mem: 0 }, \
         users: [{ user: relay, password: relay-pw }] } }\n",
    )
    .unwrap();
    let conf_arg = conf_path.display().to_string();
    let server = outbox_testkit::server::ServerProcess::start(
        "nats-server",
        &[
            "-a",
            "127.0.0.1",
            "-p",
            "{port}",
            "-js",
            "-sd",
            "{dir}/js",
            "-c",
            &conf_arg,
        ],
    );
    let url = format!("nats://relay:relay-pw@127.0.0.1:{}", server.port);
    let client =
        outbox_testkit::eventually("nats-server", std::time::Duration::from_secs(10), || {
            let url = url.clone();
            async move {
                async_nats::ConnectOptions::with_user_and_password(
                    "relay".into(),
                    "relay-pw".into(),
                )
                .connect(url.replace("relay:relay-pw@", ""))
                .await
                .ok()
            }
        })
        .await;
    async_nats::jetstream::new(client)
        .create_stream(async_nats::jetstream::stream::Config {
            storage: async_nats::jetstream::stream::StorageType::File,
            ..stream("FULL", &["full"])
        })
        .await
        .unwrap();
    // The user and password are the URI's: async-nats itself reads no credentials from a
    // URI, and the sink used to connect without them (every publish then failed as
    // "not connected").
    let sink = outbox_publishers::build_sink("nats", &SinkConfig::new(url.clone()))
        .await
        .unwrap();
    let routed = |seq| outbox_publishers::Routed {
        cloudevents: None,
        event: outbox_testkit::publisher::event(seq, "k", vec![b'x'; 16 * 1024]),
        target: "full".into(),
    };
    assert!(
        sink.send(vec![routed(0)]).await.remove(0).is_ok(),
        "the URI's credentials are used"
    );
    let mut refused = None;
    for seq in 1..=20 {
        if let Err(e) = sink.send(vec![routed(seq)]).await.remove(0) {
            refused = Some(e);
            break;
        }
    }
    let err = refused.expect("the account's 64 KiB took 20 messages of 16 KiB");
    assert!(
        matches!(err.disposition(), outbox_core::Disposition::Retry { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("account"), "{err}");
}

/// The client let 20,000 publishes wait for their PubAck, and the sink awaits a batch's
/// acks only once all of it is sent: a batch (or the batches in flight together) of more
/// held the next send waiting for a permit that no ack could free. Every event of it timed
/// out although the stream stored it, at every attempt, until it was dead-lettered. The
/// engine's `max_in_flight` (up to 10,000,000) bounds what is in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_more_than_20000_events_is_confirmed() {
    let harness = new_harness().await;
    let batch: Vec<outbox_publishers::Routed> = (1..=20_001)
        .map(|seq| outbox_publishers::Routed {
            cloudevents: None,
            event: outbox_testkit::publisher::event(seq, &format!("k{seq}"), b"{}".to_vec()),
            target: harness.subject.clone(),
        })
        .collect();
    // The bound of a failure only: the batch takes about a second.
    let outcomes =
        tokio::time::timeout(std::time::Duration::from_secs(60), harness.sink.send(batch))
            .await
            .expect("the batch's sends stalled");
    let failed: Vec<_> = outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
    assert!(
        failed.is_empty(),
        "{} failed, the first: {}",
        failed.len(),
        failed[0]
    );
}

/// A sealed stream refuses every message (a 400, error 10109): the stream's condition,
/// which an operator undoes, not the message's. It dead-lettered every event sent to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_stream_is_retried_not_dead_lettered() {
    let harness = new_harness().await;
    change_stream(&harness, |config| config.sealed = true).await;
    let err = refused_as_the_streams_condition(&harness, 1).await;
    assert!(err.contains("sealed"), "{err}");
}

/// Changes the harness's stream's configuration with `change`.
async fn change_stream(
    harness: &NatsHarness,
    change: impl FnOnce(&mut async_nats::jetstream::stream::Config),
) {
    let client = async_nats::connect(url(&harness.server)).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let mut config = js
        .get_stream(&harness.stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .config
        .clone();
    change(&mut config);
    js.update_stream(config).await.unwrap();
}

/// Sends event `n` of key `k`, which the stream must refuse as its own condition (retried):
/// the error, as said.
async fn refused_as_the_streams_condition(harness: &NatsHarness, n: i64) -> String {
    let outcomes = send_numbered(harness, n).await;
    let err = outcomes[0].as_ref().unwrap_err();
    assert!(
        matches!(err.disposition(), outbox_core::Disposition::Retry { .. }),
        "{err}"
    );
    err.to_string()
}

/// Sends event `n` of key `k` to the harness's subject.
async fn send_numbered(harness: &NatsHarness, n: i64) -> Vec<outbox_core::publisher::Outcome> {
    harness
        .sink
        .send(vec![outbox_publishers::Routed {
            cloudevents: None,
            event: outbox_testkit::publisher::event(n, "k", b"{}".to_vec()),
            target: harness.subject.clone(),
        }])
        .await
}

/// A stream full with `discard = new` (its max_msgs reached) refuses each new message (a
/// 503, error 10077): retried as the stream's condition, and said with the fix, where it was
/// "publish failed" with the server's words alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_stream_that_discards_new_messages_is_said_with_the_fix() {
    let harness = new_harness().await;
    change_stream(&harness, |config| {
        config.max_messages = 1;
        config.discard = async_nats::jetstream::stream::DiscardPolicy::New;
    })
    .await;
    let first = send_numbered(&harness, 1).await;
    assert!(first[0].is_ok(), "{:?}", first[0]);
    let err = refused_as_the_streams_condition(&harness, 2).await;
    assert!(err.contains("max_msgs"), "{err}");
}

/// A stream set to `no_ack` stores what it is sent and answers nothing: every publish timed
/// out, at every attempt, told only as "no PubAck in time". The error now names the stream
/// and its no_ack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_acks_nothing_is_named_in_the_timeout() {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let subject = format!("orders.{id}");
    let stream_name = format!("S{id}");
    let server = PrivateNats::with_stream(async_nats::jetstream::stream::Config {
        no_ack: true,
        ..stream(&stream_name, &[&subject])
    })
    .await;
    let config: SinkConfig = serde_json::from_value(serde_json::json!({
        "uri": url(&server),
        "timeout": "1s",
    }))
    .unwrap();
    let sink = outbox_publishers::build_sink("nats", &config)
        .await
        .unwrap();
    let outcomes = sink
        .send(vec![outbox_publishers::Routed {
            cloudevents: None,
            event: outbox_testkit::publisher::event(1, "k", b"{}".to_vec()),
            target: subject,
        }])
        .await;
    let err = outcomes[0].as_ref().unwrap_err();
    assert!(
        err.to_string().contains(&stream_name) && err.to_string().contains("no_ack"),
        "{err}"
    );
}

/// One event to `subject` through a sink of `user` on `server`, with a short PubAck timeout.
async fn send_as(server: &PrivateNats, user: &str, subject: &str) -> outbox_core::Outcome {
    let config: SinkConfig = serde_json::from_value(serde_json::json!({
        "uri": server.url_of(user),
        "timeout": "1s",
    }))
    .unwrap();
    let sink = outbox_publishers::build_sink("nats", &config)
        .await
        .unwrap();
    send_one(&sink, subject).await
}

/// A permission the server refused: retried as one, and said with `said`.
#[track_caller]
fn refused_as_unauthorized(err: &outbox_core::PublishError, said: &str) {
    assert_eq!(
        err.kind(),
        outbox_core::PublishErrorKind::Unauthorized,
        "{err}"
    );
    assert!(err.to_string().contains(said), "{err}");
}

async fn send_one(sink: &Arc<dyn Sink>, subject: &str) -> outbox_core::Outcome {
    sink.send(vec![outbox_publishers::Routed {
        cloudevents: None,
        event: outbox_testkit::publisher::event(1, "k", b"{}".to_vec()),
        target: subject.into(),
    }])
    .await
    .remove(0)
}

/// NATS tells of a subject the relay's user may not publish to on the connection, not with
/// the publish: every attempt timed out, told only as "no PubAck in time". The error now
/// says the server refused it, and is retried as a permission the operator may yet grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subject_the_user_may_not_publish_to_is_named_as_refused() {
    let server = PrivateNats::with_users().await;
    server.add_stream(stream("ORDERS", &["orders.>"])).await;
    assert!(send_as(&server, "narrow", "orders.allowed.1").await.is_ok());
    let err = send_as(&server, "narrow", "orders.denied.1")
        .await
        .unwrap_err();
    refused_as_unauthorized(&err, "refused the relay's publish to \"orders.denied.1\"");
}

/// A user that may publish but not subscribe to reply inboxes never gets a PubAck. The error
/// names the inbox, and a permission granted by a reload of the server's configuration (which
/// keeps connections, so the refused subscription is not made again by itself) is picked up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_inbox_the_user_may_not_subscribe_to_is_named_and_a_grant_picked_up() {
    let server = PrivateNats::with_users().await;
    server.add_stream(stream("ORDERS", &["orders.>"])).await;
    let config: SinkConfig = serde_json::from_value(serde_json::json!({
        "uri": server.url_of("deaf"),
        "timeout": "1s",
    }))
    .unwrap();
    let sink = outbox_publishers::build_sink("nats", &config)
        .await
        .unwrap();
    let err = send_one(&sink, "orders.any").await.unwrap_err();
    refused_as_unauthorized(&err, "subscription to its reply inbox \"_INBOX.");
    server.reload_users(
        &outbox_testkit::nats::USERS
            .replace(r#"permissions: { subscribe: { deny: ["_INBOX.>"] } }"#, ""),
    );
    outbox_testkit::eventually(
        "the granted inbox to bring PubAcks",
        std::time::Duration::from_secs(20),
        || {
            let sink = sink.clone();
            async move { send_one(&sink, "orders.any").await.ok() }
        },
    )
    .await;
}
