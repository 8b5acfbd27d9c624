//! The publisher conformance suite against a real redis-server (one private server per test).

use std::sync::Arc;

use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_publishers::{Sink, SinkConfig};
use outbox_testkit::publisher::{BrokerHarness, Received};
use outbox_testkit::server::ServerProcess;
use redis::AsyncCommands;
use serde_json::json;

struct RedisHarness {
    server: ServerProcess,
    sink: Arc<dyn Sink>,
    stream: String,
}

/// A sink's settings as a `[sinks.NAME]` table would give them.
fn read_config(table: serde_json::Value) -> SinkConfig {
    serde_json::from_value(table).expect("valid sink settings")
}

fn url(server: &ServerProcess) -> String {
    format!("redis://127.0.0.1:{}", server.port)
}

/// A redis-server of the test's own on 127.0.0.1, saving no snapshots, with `extra` flags.
fn redis_server(extra: &[&str]) -> ServerProcess {
    let mut args = vec!["--bind", "127.0.0.1", "--port", "{port}", "--save", ""];
    args.extend_from_slice(extra);
    ServerProcess::start("redis-server", &args)
}

async fn new_harness() -> RedisHarness {
    // Append-only with fsync, so a killed and restarted server keeps what it acknowledged.
    let server = redis_server(&[
        "--dir",
        "{dir}",
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
    ]);
    let config = read_config(json!({ "uri": url(&server), "max_message_bytes": 1024 * 1024 }));
    let sink = outbox_publishers::build_sink("redis", &config)
        .await
        .unwrap();
    RedisHarness {
        server,
        sink,
        stream: format!("orders:{}", uuid::Uuid::new_v4().simple()),
    }
}

impl BrokerHarness for RedisHarness {
    fn sink(&self) -> Arc<dyn Sink> {
        self.sink.clone()
    }

    fn target(&self) -> String {
        self.stream.clone()
    }

    fn received(&self) -> BoxFuture<'_, Vec<Received>> {
        async move {
            let Ok(client) = redis::Client::open(url(&self.server)) else {
                return Vec::new();
            };
            let Ok(mut c) = client.get_multiplexed_async_connection().await else {
                return Vec::new();
            };
            let reply: redis::streams::StreamRangeReply = c.xrange_all(&self.stream).await.unwrap();
            reply
                .ids
                .iter()
                .map(|entry| {
                    let text = |name: &str| entry.get::<String>(name).unwrap_or_default();
                    Received {
                        event_id: text("event_id"),
                        ordering_key: Some(text("key")),
                        payload: entry.get::<Vec<u8>>("payload").unwrap_or_default(),
                        traceparent: entry.get::<String>("traceparent"),
                        tracestate: entry.get::<String>("tracestate"),
                        headers:
                            serde_json::from_str::<std::collections::BTreeMap<String, String>>(
                                &text("headers"),
                            )
                            .unwrap_or_default()
                            .into_iter()
                            .collect(),
                    }
                })
                .collect()
        }
        .boxed()
    }

    fn broker_dedupes(&self) -> bool {
        true
    }

    fn oversized_bytes(&self) -> usize {
        2 * 1024 * 1024
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
async fn entries_carry_every_field_and_maxlen_trims() {
    let server = ServerProcess::start(
        "redis-server",
        &["--bind", "127.0.0.1", "--port", "{port}", "--save", ""],
    );
    let config = read_config(json!({ "uri": url(&server), "maxlen": 10 }));
    let sink = outbox_publishers::build_sink("redis", &config)
        .await
        .unwrap();
    let events: Vec<_> = (0..300)
        .map(|i| outbox_testkit::publisher::event(i, &format!("k{i}"), b"{\"a\":1}".to_vec()))
        .collect();
    let routed = |events: &[std::sync::Arc<outbox_core::Event>]| {
        events
            .iter()
            .map(|e| outbox_publishers::Routed {
                cloudevents: None,
                event: e.clone(),
                target: "s".into(),
            })
            .collect::<Vec<_>>()
    };
    // Order across keys within one batch is not defined: the newest goes last, on its own.
    assert!(sink
        .send(routed(&events[..299]))
        .await
        .iter()
        .all(|o| o.is_ok()));
    assert!(sink
        .send(routed(&events[299..]))
        .await
        .iter()
        .all(|o| o.is_ok()));
    let mut c = redis::Client::open(url(&server))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let len: usize = c.xlen("s").await.unwrap();
    assert!(len < 300, "MAXLEN ~ trims the stream (len {len})");
    let reply: redis::streams::StreamRangeReply = c.xrange_all("s").await.unwrap();
    let wanted = events[299].event_id.to_string();
    let last = reply
        .ids
        .iter()
        .find(|e| e.get::<String>("event_id").as_deref() == Some(wanted.as_str()))
        .expect("the newest event survives trimming");
    assert_eq!(last.get::<String>("type").unwrap(), "order.created");
    assert_eq!(last.get::<String>("key").unwrap(), "k299");
    assert_eq!(last.get::<String>("sequence_id").unwrap(), "299");
    assert_eq!(last.get::<String>("mutation_id").unwrap(), "m299");
    assert_eq!(
        last.get::<String>("headers").unwrap(),
        "{\"trace-id\":\"t299\"}"
    );
    assert_eq!(last.get::<String>("payload").unwrap(), "{\"a\":1}");
}

/// An event sent again within the dedupe window is dropped while its entry is in the
/// stream, and appended again once the entry is gone. `replay` after a stream was deleted
/// (what it is for) was counted as published for a day, and nothing reached the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_sent_again_is_appended_again_only_when_its_entry_is_gone() {
    let server = ServerProcess::start(
        "redis-server",
        &["--bind", "127.0.0.1", "--port", "{port}", "--save", ""],
    );
    let config = read_config(json!({ "uri": url(&server) }));
    let mut c = redis::Client::open(url(&server))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let len = async |c: &mut redis::aio::MultiplexedConnection| -> usize {
        c.xlen("replayed").await.unwrap()
    };
    let sink = outbox_publishers::build_sink("redis", &config)
        .await
        .unwrap();
    let event = outbox_testkit::publisher::event(1, "k", b"{}".to_vec());
    let send = || {
        sink.send(vec![outbox_publishers::Routed {
            cloudevents: None,
            event: event.clone(),
            target: "replayed".into(),
        }])
    };
    assert!(send().await.remove(0).is_ok());
    assert!(send().await.remove(0).is_ok());
    assert_eq!(len(&mut c).await, 1, "a redelivery is dropped");
    let _: () = c.del("replayed").await.unwrap();
    assert!(send().await.remove(0).is_ok());
    assert_eq!(len(&mut c).await, 1, "sent again once its entry is gone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_is_verified_against_the_configured_ca() {
    outbox_testkit::install_crypto();
    let certs = outbox_testkit::server::test_certs();
    let path = |f: &str| certs.path().join(f).display().to_string();
    let server = ServerProcess::start(
        "redis-server",
        &[
            "--bind",
            "127.0.0.1",
            "--port",
            "0",
            "--tls-port",
            "{port}",
            "--save",
            "",
            "--tls-cert-file",
            &path("server.pem"),
            "--tls-key-file",
            &path("server.key"),
            "--tls-ca-cert-file",
            &path("ca.pem"),
            "--tls-auth-clients",
            "no",
        ],
    );
    let config = read_config(json!({
        "uri": format!("rediss://127.0.0.1:{}", server.port),
        "tls_ca_file": certs.path().join("ca.pem"),
    }));
    let outcome = send_one(&config, "secure").await;
    assert!(outcome.is_ok(), "{outcome:?}");
    let untrusted = SinkConfig::new(config.uri());
    assert!(
        send_one(&untrusted, "secure").await.is_err(),
        "an untrusted server must not get the event"
    );
}

/// Builds a sink from `config` and sends it one event (`{}`, key `k`) for `target`.
async fn send_one(config: &SinkConfig, target: &str) -> outbox_core::Outcome {
    let sink = outbox_publishers::build_sink("redis", config)
        .await
        .unwrap();
    let event = outbox_testkit::publisher::event(1, "k", b"{}".to_vec());
    sink.send(vec![outbox_publishers::Routed {
        cloudevents: None,
        event,
        target: target.into(),
    }])
    .await
    .remove(0)
}

/// The server's refusals become publish outcomes by their error code: a key of another type
/// (WRONGTYPE) is the destination's condition, retried (refused for good, every event sent
/// there was dead-lettered at once); a missing permission (NOPERM) or password (NOAUTH) is
/// unauthorized.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_classified_by_the_servers_error_code() {
    use outbox_core::PublishErrorKind;
    let server = ServerProcess::start(
        "redis-server",
        &["--bind", "127.0.0.1", "--port", "{port}", "--save", ""],
    );
    let mut admin = redis::Client::open(url(&server))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let refused = |uri: String, target: &'static str| async move {
        send_one(&SinkConfig::new(uri), target)
            .await
            .expect_err("the server refuses it")
    };

    let _: () = admin.set("a-string", "not a stream").await.unwrap();
    let err = refused(url(&server), "a-string").await;
    assert!(
        matches!(err.disposition(), outbox_core::Disposition::Retry { .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("another type than a stream"),
        "{err}"
    );

    let _: () = redis::cmd("ACL")
        .arg(&[
            "SETUSER",
            "no-scripts",
            "on",
            ">pw",
            "~*",
            "+@all",
            "-@scripting",
        ])
        .query_async(&mut admin)
        .await
        .unwrap();
    let limited = format!("redis://no-scripts:pw@127.0.0.1:{}", server.port);
    let err = refused(limited, "s").await;
    assert_eq!(err.kind(), PublishErrorKind::Unauthorized, "{err}");
    // A role allowed no INFO still publishes: the check for a cluster node is skipped.
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "no-info", "on", ">pw", "~*", "+@all", "-info"])
        .query_async(&mut admin)
        .await
        .unwrap();
    let no_info = SinkConfig::new(format!("redis://no-info:pw@127.0.0.1:{}", server.port));
    let sent = send_one(&no_info, "allowed").await;
    assert!(sent.is_ok(), "{sent:?}");

    let _: () = redis::cmd("CONFIG")
        .arg(&["SET", "requirepass", "sekrit"])
        .query_async(&mut admin)
        .await
        .unwrap();
    // Redis closes an unauthenticated connection that sends a script's many arguments
    // ("Protocol error"), so the missing password shows in the health check's PING.
    let sink = outbox_publishers::build_sink("redis", &SinkConfig::new(url(&server)))
        .await
        .unwrap();
    let err = sink
        .health()
        .await
        .expect_err("the server requires a password");
    assert_eq!(err.kind(), PublishErrorKind::Unauthorized, "{err}");
}

/// A redis-server of the test's own, and a connection to it for the test's own commands.
async fn server_and_admin() -> (ServerProcess, redis::aio::MultiplexedConnection) {
    let server = redis_server(&[]);
    let admin = redis::Client::open(url(&server))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    (server, admin)
}

/// A user allowed to append to streams and run scripts but not to write the event's
/// de-duplication key (`+@read +@stream +@scripting`, a natural least-privilege set, has no
/// SET): the script's XADD went through, its SET failed, the attempt counted as failed, and
/// every retry appended the event again (20 entries of one event, then a dead letter). The
/// script now proves it may write the key before it appends, so a refusal appends nothing,
/// and the refusal is unauthorized, naming the grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_that_may_append_but_not_record_the_event_appends_nothing() {
    use outbox_core::PublishErrorKind;
    let (server, mut admin) = server_and_admin().await;
    let _: () = redis::cmd("ACL")
        .arg(&[
            "SETUSER",
            "streamer",
            "on",
            ">pw",
            "~*",
            "+@read",
            "+@stream",
            "+@scripting",
            "+@connection",
            "+info",
        ])
        .query_async(&mut admin)
        .await
        .unwrap();
    let limited = SinkConfig::new(format!("redis://streamer:pw@127.0.0.1:{}", server.port));
    for _ in 0..3 {
        let err = send_one(&limited, "orders")
            .await
            .expect_err("the user may not SET");
        assert_eq!(err.kind(), PublishErrorKind::Unauthorized, "{err}");
        assert!(err.to_string().contains("outbox-relay:dedupe:"), "{err}");
    }
    let len: usize = admin.xlen("orders").await.unwrap();
    assert_eq!(len, 0, "a refused attempt appended the event");
    // Granted, the event goes out once, however often it is sent.
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "streamer", "+set"])
        .query_async(&mut admin)
        .await
        .unwrap();
    let sink = outbox_publishers::build_sink("redis", &limited)
        .await
        .unwrap();
    let event = outbox_testkit::publisher::event(1, "k", b"{}".to_vec());
    for _ in 0..2 {
        let sent = sink
            .send(vec![outbox_publishers::Routed {
                cloudevents: None,
                event: event.clone(),
                target: "orders".into(),
            }])
            .await
            .remove(0);
        assert!(sent.is_ok(), "{sent:?}");
    }
    let len: usize = admin.xlen("orders").await.unwrap();
    assert_eq!(len, 1);
}

/// A user allowed everything the sink sends but PING: the health check's PING was refused,
/// and `/readyz` failed while every event went out. The server answered and the user is
/// logged in: healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_allowed_no_ping_is_healthy_and_publishes() {
    let (server, mut admin) = server_and_admin().await;
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "no-ping", "on", ">pw", "~*", "+@all", "-ping"])
        .query_async(&mut admin)
        .await
        .unwrap();
    let config = SinkConfig::new(format!("redis://no-ping:pw@127.0.0.1:{}", server.port));
    let sink = outbox_publishers::build_sink("redis", &config)
        .await
        .unwrap();
    let healthy = sink.health().await;
    assert!(healthy.is_ok(), "{healthy:?}");
    let sent = send_one(&config, "orders").await;
    assert!(sent.is_ok(), "{sent:?}");
}

/// A server demoted to a replica (`REPLICAOF`, as a failover does to the old primary)
/// answers every write READONLY on the connection the sink kept: each event failed as a
/// broker failure until dead-lettered, and the sink never connected again (a name that
/// follows the failover to the new primary was never looked up again). It says the server
/// is a read-only replica, and connects again for the next send.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_demoted_to_a_replica_is_said_so_and_connected_to_again() {
    use outbox_core::PublishErrorKind;
    let (server, mut admin) = server_and_admin().await;
    let sink = outbox_publishers::build_sink("redis", &SinkConfig::new(url(&server)))
        .await
        .unwrap();
    let send = |n: i64| {
        let sink = sink.clone();
        async move {
            let event = outbox_testkit::publisher::event(n, "k", b"{}".to_vec());
            sink.send(vec![outbox_publishers::Routed {
                cloudevents: None,
                event,
                target: "orders".into(),
            }])
            .await
            .remove(0)
        }
    };
    assert!(send(1).await.is_ok());
    let clients = |admin: &mut redis::aio::MultiplexedConnection| {
        let mut admin = admin.clone();
        async move {
            let list: String = redis::cmd("CLIENT")
                .arg("LIST")
                .query_async(&mut admin)
                .await
                .unwrap();
            list.lines()
                .filter_map(|l| l.split(' ').next()?.strip_prefix("id="))
                .map(str::to_string)
                .collect::<Vec<_>>()
        }
    };
    let before = clients(&mut admin).await;
    let _: () = redis::cmd("REPLICAOF")
        .arg(&["127.0.0.1", "1"])
        .query_async(&mut admin)
        .await
        .unwrap();
    let err = send(2).await.expect_err("a replica refuses writes");
    assert_eq!(err.kind(), PublishErrorKind::Unavailable, "{err}");
    assert!(err.to_string().contains("read-only replica"), "{err}");
    let _: () = redis::cmd("REPLICAOF")
        .arg(&["NO", "ONE"])
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(send(3).await.is_ok());
    let after = clients(&mut admin).await;
    assert!(
        after.iter().any(|id| !before.contains(id)),
        "the sink went on with its old connection: {before:?} then {after:?}"
    );
}

/// A server with INFO renamed away (`rename-command INFO ""`, as hardened installs do)
/// answered the sink's cluster check "unknown command", and every event failed until it was
/// dead-lettered. The check is skipped there, as for a role allowed no INFO.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_with_info_renamed_away_is_published_to() {
    let server = redis_server(&["--rename-command", "INFO", ""]);
    let sent = send_one(&SinkConfig::new(url(&server)), "renamed").await;
    assert!(sent.is_ok(), "{sent:?}");
}

/// A Redis Cluster node answers a key of a slot another node serves with MOVED, and one of
/// a cluster missing slots with CLUSTERDOWN: the sink, which speaks to one server, retried
/// each event as a broker failure until it was dead-lettered. It says at its first
/// connection that Redis Cluster is not supported, and what to point it at.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_node_is_refused_saying_so() {
    let server = redis_server(&[
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "{dir}/nodes.conf",
    ]);
    let err = send_one(&SinkConfig::new(url(&server)), "orders")
        .await
        .expect_err("a cluster node is refused");
    let said = err.to_string();
    assert!(
        said.contains("Redis Cluster is not supported") && said.contains("standalone"),
        "{said}"
    );
}

/// A server out of memory refuses every write: the destination's condition, unavailable
/// (which spends no attempt while nothing is confirmed), with the fix. It was a broker
/// failure, which the engine counts as the event's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_out_of_memory_is_unavailable_and_names_the_fix() {
    use outbox_core::PublishErrorKind;
    let (server, mut admin) = server_and_admin().await;
    let config = SinkConfig::new(url(&server));
    assert!(send_one(&config, "s").await.is_ok());
    let _: () = redis::cmd("CONFIG")
        .arg(&["SET", "maxmemory-policy", "noeviction", "maxmemory", "1"])
        .query_async(&mut admin)
        .await
        .unwrap();
    let err = send_one(&config, "s")
        .await
        .expect_err("the server is full");
    assert_eq!(err.kind(), PublishErrorKind::Unavailable, "{err}");
    assert!(err.to_string().contains("out of memory"), "{err}");
    assert!(err.to_string().contains("maxlen"), "{err}");
}
