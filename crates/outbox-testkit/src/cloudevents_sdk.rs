//! Reads a received message back as a CloudEvent with the PyPI `cloudevents` SDK (2.x, its
//! protocol bindings), so that the relay's envelopes are checked by a consumer library and not
//! only by our own reading of the spec. `scripts/servers.sh start` makes the venv and exports
//! `OUTBOX_TEST_PYTHON`.

use base64::Engine as _;
use outbox_publishers::cloudevents::{Binding, ContentMode};
use serde_json::{json, Value};

use crate::publisher::Received;

/// The SDK's reader for each protocol; NATS has none in the SDK, and its binding is HTTP's
/// (`ce-` headers, percent-encoded values), so its messages are read as HTTP messages. Sinks
/// without a binding carry structured events only, read by the SDK's JSON event format.
const READER: &str = r#"
import base64, json, sys
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.bindings import http, kafka, rabbitmq

m = json.load(sys.stdin)
body = base64.b64decode(m["body_b64"])
fmt = JSONFormat()
reader = m["reader"]
if reader == "http":
    event = http.from_http(http.HTTPMessage(headers=m["headers"], body=body), fmt)
elif reader == "kafka":
    headers = {k: v.encode() for k, v in m["headers"].items()}
    event = kafka.from_kafka(kafka.KafkaMessage(headers=headers, key=m["key"], value=body), fmt)
elif reader == "rabbitmq":
    headers = {k: v for k, v in m["headers"].items() if k.lower() != "content-type"}
    event = rabbitmq.from_rabbitmq(
        rabbitmq.RabbitMQMessage(headers=headers, content_type=m["content_type"], body=body), fmt)
else:
    event = fmt.read(None, body)
out = {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in event.get_attributes().items()}
data = event.get_data()
# Bytes are JSON the SDK left undecoded; a str would be JSON encoded twice, and stays a str.
out["data"] = json.loads(data) if isinstance(data, bytes) else data
print(json.dumps(out))
"#;

/// The CloudEvent in `received` as the SDK reads it: its attributes and `data`.
pub fn read(binding: Option<Binding>, mode: ContentMode, received: &Received) -> Value {
    let python = std::env::var("OUTBOX_TEST_PYTHON").expect(
        "OUTBOX_TEST_PYTHON names a Python with the cloudevents SDK: run the tests under \
         `scripts/servers.sh start` (it makes the venv)",
    );
    let reader = match (binding, mode) {
        (Some(Binding::Http | Binding::Nats), _) => "http",
        (Some(Binding::Kafka), _) => "kafka",
        (Some(Binding::RabbitMq), _) => "rabbitmq",
        (None, ContentMode::Structured) => "json",
        (None, ContentMode::Binary) => panic!("binary mode needs a binding"),
    };
    let headers: serde_json::Map<String, Value> = received
        .headers
        .iter()
        .map(|(k, v)| (k.clone(), Value::String(v.clone())))
        .collect();
    let input = json!({
        "reader": reader,
        "headers": headers,
        "content_type": received.header("content-type"),
        "key": received.ordering_key,
        "body_b64": base64::engine::general_purpose::STANDARD.encode(&received.payload),
    });
    let mut child = std::process::Command::new(&python)
        .args(["-c", READER])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin
            .write_all(input.to_string().as_bytes())
            .expect("the SDK reader reads its input");
    }
    let output = child.wait_with_output().expect("the SDK reader ends");
    assert!(
        output.status.success(),
        "the cloudevents SDK could not read the message ({reader}): {}\ninput: {input}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("the reader prints JSON")
}
