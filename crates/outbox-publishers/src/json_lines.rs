//! JSON-lines sinks: stdout and an append-only file that is fsynced before events are acked.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_core::{Event, Outcome, PublishError, PublishErrorKind};

use crate::sink::{Routed, Sink};
use serde::Serialize;

/// One output line. Field names are part of the sink's format.
#[derive(Serialize)]
struct Line<'a> {
    event_id: &'a uuid_string::UuidStr,
    sequence_id: i64,
    destination: &'a str,
    partition_key: Option<&'a str>,
    event_type: &'a str,
    payload: &'a outbox_core::Payload,
    headers: &'a outbox_core::Headers,
    mutation_id: Option<&'a str>,
    rejected: bool,
    attempts: u32,
    created_at: String,
}

mod uuid_string {
    /// Serializes a UUID through its Display form without an intermediate String.
    pub struct UuidStr(pub outbox_core::EventId);
    impl serde::Serialize for UuidStr {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.collect_str(&self.0.hyphenated())
        }
    }
}

/// Appends the JSON line for `event` (with a trailing newline) to `out`.
pub fn encode_line(event: &Event, out: &mut Vec<u8>) -> Result<(), PublishError> {
    let id = uuid_string::UuidStr(event.event_id);
    let line = Line {
        event_id: &id,
        sequence_id: event.sequence_id,
        destination: &event.destination,
        partition_key: event.partition_key.as_deref(),
        event_type: &event.event_type,
        payload: &event.payload,
        headers: &event.headers,
        mutation_id: event.mutation_id.as_deref(),
        rejected: event.rejected,
        attempts: event.attempts,
        created_at: humantime::format_rfc3339_micros(event.created_at).to_string(),
    };
    serde_json::to_writer(&mut *out, &line).map_err(|e| {
        PublishError::new(PublishErrorKind::Encoding, "cannot encode event as JSON").with_source(e)
    })?;
    out.push(b'\n');
    Ok(())
}

/// Encodes a batch; events that cannot be encoded get a permanent error and are left out.
fn encode_batch(batch: &[Routed]) -> (Vec<u8>, Vec<Option<PublishError>>) {
    let mut buffer = Vec::with_capacity(batch.len() * 256);
    let errors = batch
        .iter()
        .map(|Routed { event, .. }| {
            let mark = buffer.len();
            encode_line(event, &mut buffer)
                .err()
                .inspect(|_| buffer.truncate(mark))
        })
        .collect();
    (buffer, errors)
}

/// Turns the result of one write of the whole batch into one outcome per event.
fn outcomes(
    errors: Vec<Option<PublishError>>,
    written: &Result<(), std::io::Error>,
    what: &str,
) -> Vec<Outcome> {
    errors
        .into_iter()
        .map(|encode_error| match (encode_error, written) {
            (Some(e), _) => Err(e),
            (None, Ok(())) => Ok(()),
            (None, Err(io)) => Err(PublishError::new(
                PublishErrorKind::Io,
                format!("writing to {what}: {io}"),
            )),
        })
        .collect()
}

/// Writes JSON lines to standard output and flushes after each batch.
#[derive(Default)]
pub struct StdoutSink {
    lock: Arc<Mutex<()>>,
}

impl StdoutSink {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Sink for StdoutSink {
    fn describe(&self) -> String {
        "stdout".into()
    }

    fn send(&self, batch: Vec<Routed>) -> BoxFuture<'static, Vec<Outcome>> {
        let lock = self.lock.clone();
        async move {
            let (buffer, errors) = encode_batch(&batch);
            let written = tokio::task::spawn_blocking(move || {
                let _guard = lock.lock().unwrap_or_else(|p| p.into_inner());
                let mut out = std::io::stdout().lock();
                out.write_all(&buffer)?;
                out.flush()
            })
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)));
            outcomes(errors, &written, "stdout")
        }
        .boxed()
    }

    fn health(&self) -> BoxFuture<'static, Result<(), PublishError>> {
        async { Ok(()) }.boxed()
    }
}

/// Appends JSON lines to a file; each batch is written, flushed and fsynced before any of
/// its events is reported delivered.
pub struct FileSink {
    path: PathBuf,
    file: Arc<Mutex<File>>,
}

impl FileSink {
    pub fn open(path: impl AsRef<Path>) -> Result<Self, PublishError> {
        let path = path.as_ref().to_path_buf();
        let io_error = |e: std::io::Error| {
            PublishError::new(
                PublishErrorKind::Io,
                format!(
                    "cannot open sink file {}: {e} (check that the directory exists and is writable)",
                    path.display()
                ),
            )
        };
        let mut file = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(&path)
            .map_err(io_error)?;
        terminate_torn_line(&mut file).map_err(io_error)?;
        Ok(FileSink {
            path,
            file: Arc::new(Mutex::new(file)),
        })
    }
}

/// A crash mid-write can leave a partial last line; end it so the next line stays whole.
fn terminate_torn_line(file: &mut File) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    if file.metadata()?.len() == 0 {
        return Ok(());
    }
    file.seek(SeekFrom::End(-1))?;
    let mut last = [0u8; 1];
    file.read_exact(&mut last)?;
    if last[0] != b'\n' {
        file.write_all(b"\n")?;
        file.sync_data()?;
    }
    Ok(())
}

impl Sink for FileSink {
    fn describe(&self) -> String {
        format!("file:{}", self.path.display())
    }

    fn send(&self, batch: Vec<Routed>) -> BoxFuture<'static, Vec<Outcome>> {
        let file = self.file.clone();
        let what = self.path.display().to_string();
        async move {
            let (buffer, errors) = encode_batch(&batch);
            let written = tokio::task::spawn_blocking(move || {
                let mut file = file.lock().unwrap_or_else(|p| p.into_inner());
                file.write_all(&buffer)?;
                file.flush()?;
                file.sync_data()
            })
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)));
            outcomes(errors, &written, &what)
        }
        .boxed()
    }

    fn health(&self) -> BoxFuture<'static, Result<(), PublishError>> {
        let path = self.path.clone();
        async move {
            std::fs::metadata(&path).map(|_| ()).map_err(|e| {
                PublishError::new(
                    PublishErrorKind::Io,
                    format!("sink file {} is not accessible: {e}", path.display()),
                )
            })
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::{Headers, Payload};
    use std::time::{Duration, UNIX_EPOCH};

    fn event(seq: i64, payload: &str) -> Routed {
        Routed {
            target: String::new(),
            event: Arc::new(Event {
                sequence_id: seq,
                event_id: uuid::Uuid::from_u128(seq as u128),
                destination: "orders".into(),
                partition_key: Some("c-1".into()),
                event_type: "created".into(),
                payload: Payload::from_json_text(payload.into()).unwrap(),
                headers: Headers::from([("trace".to_string(), "t1".to_string())]),
                mutation_id: Some("m-1".into()),
                rejected: false,
                attempts: 2,
                max_attempts: None,
                created_at: UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_456),
            }),
        }
    }

    #[test]
    fn line_carries_every_field_and_the_payload_verbatim() {
        let mut out = Vec::new();
        encode_line(&event(7, r#"{"total": 12.50}"#).event, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.ends_with('\n'));
        assert!(text.contains(r#""payload":{"total": 12.50}"#), "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["event_id"], "00000000-0000-0000-0000-000000000007");
        assert_eq!(v["sequence_id"], 7);
        assert_eq!(v["destination"], "orders");
        assert_eq!(v["partition_key"], "c-1");
        assert_eq!(v["event_type"], "created");
        assert_eq!(v["headers"]["trace"], "t1");
        assert_eq!(v["mutation_id"], "m-1");
        assert_eq!(v["rejected"], false);
        assert_eq!(v["attempts"], 2);
        assert_eq!(v["created_at"], "2023-11-14T22:13:20.123456Z");
    }

    #[tokio::test]
    async fn file_sink_appends_and_reports_each_event() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        let sink = FileSink::open(&path).unwrap();
        let outcomes = sink.send(vec![event(1, "1"), event(2, "[2]")]).await;
        assert!(outcomes.iter().all(|o| o.is_ok()));
        sink.send(vec![event(3, "null")]).await;
        let text = std::fs::read_to_string(&path).unwrap();
        let seqs: Vec<i64> = text
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["sequence_id"]
                    .as_i64()
                    .unwrap()
            })
            .collect();
        assert_eq!(seqs, vec![1, 2, 3]);
    }

    #[tokio::test]
    async fn a_torn_last_line_is_terminated_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        std::fs::write(&path, "{\"sequence_id\":1}\n{\"seq").unwrap();
        let sink = FileSink::open(&path).unwrap();
        sink.send(vec![event(2, "2")]).await;
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[1], "{\"seq");
        assert!(serde_json::from_str::<serde_json::Value>(lines[2]).is_ok());
    }

    #[tokio::test]
    async fn unknown_sinks_name_the_choices() {
        let err = crate::from_uri("kafka-ish://x").await.err().unwrap();
        assert!(
            err.to_string().contains("use stdout, file:PATH, nats://"),
            "{err}"
        );
        assert!(crate::from_uri("file:").await.is_err());
    }
}
