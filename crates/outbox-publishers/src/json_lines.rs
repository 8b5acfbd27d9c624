//! JSON-lines sinks: stdout and an append-only file that is fsynced before events are acked.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_core::{Event, Outcome, PublishError, PublishErrorKind};

use crate::error::SinkSetupError;
use crate::group_write::GroupWriter;
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
    created_at: outbox_core::time::Rfc3339Micros,
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
    // Stores refuse such rows already; a time RFC 3339 cannot write fails this event only.
    let created_at = outbox_core::time::Rfc3339Micros::of(event.created_at)
        .map_err(|problem| PublishError::new(PublishErrorKind::Encoding, problem))?;
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
        created_at,
    };
    serde_json::to_writer(&mut *out, &line).map_err(|e| {
        PublishError::new(PublishErrorKind::Encoding, "cannot encode event as JSON").with_source(e)
    })?;
    out.push(b'\n');
    Ok(())
}

/// Makes the JSON line `line` (ending in its newline) one line: a payload kept verbatim may
/// be JSON written over several lines (a `TEXT` column holding pretty-printed JSON), whose
/// line breaks would split the event for every line-based reader. In JSON a raw line break
/// is whitespace between tokens (inside a string it is escaped), so a space stands for it.
fn one_line(line: &mut [u8]) {
    let Some((_, body)) = line.split_last_mut() else {
        return;
    };
    // Almost every line has none: two memchr scans, not a byte-by-byte loop, on that path.
    if !body.contains(&b'\n') && !body.contains(&b'\r') {
        return;
    }
    for byte in body.iter_mut().filter(|b| matches!(b, b'\n' | b'\r')) {
        *byte = b' ';
    }
}

/// About how many bytes `event`'s line takes: its variable fields, and the rest (the field
/// names, the ids, the time) in a bound.
fn line_size_hint(event: &Event) -> usize {
    const FIXED: usize = 256;
    event.payload.as_bytes().len()
        + event.destination.len()
        + event.event_type.len()
        + event.partition_key.as_deref().map_or(0, str::len)
        + FIXED
}

/// Encodes a batch; events that cannot be encoded get a permanent error and are left out,
/// and so are the later events of their keys (not sent: written after the failed one, they
/// were written again when the engine sent them again behind it).
fn encode_batch(batch: &[Routed]) -> (Vec<u8>, Vec<Option<PublishError>>) {
    // Sized once: grown line by line, the buffer was copied again at each doubling.
    let size = batch.iter().map(|r| line_size_hint(&r.event)).sum();
    let mut buffer = Vec::with_capacity(size);
    let mut failed_keys: std::collections::HashSet<&str> = std::collections::HashSet::new();
    let errors = batch
        .iter()
        .map(
            |Routed {
                 event, cloudevents, ..
             }| {
                if !failed_keys.is_empty() && failed_keys.contains(event.ordering_key()) {
                    return Some(PublishError::new(
                        PublishErrorKind::NotSent,
                        "an earlier event of its key failed in this batch",
                    ));
                }
                let mark = buffer.len();
                if *cloudevents == Some(crate::cloudevents::ContentMode::Structured) {
                    // A structured CloudEvent is the whole line: its envelope is the payload.
                    buffer.extend_from_slice(event.payload.as_bytes());
                    buffer.push(b'\n');
                    one_line(&mut buffer[mark..]);
                    return None;
                }
                let error = encode_line(event, &mut buffer).err();
                match error {
                    Some(_) => {
                        buffer.truncate(mark);
                        failed_keys.insert(event.ordering_key());
                    }
                    None => one_line(&mut buffer[mark..]),
                }
                error
            },
        )
        .collect();
    (buffer, errors)
}

/// Encodes `batch` and writes it with `writer`: one outcome per event.
fn encode_and_write<T: Send + 'static>(
    writer: &GroupWriter<T>,
    batch: Vec<Routed>,
) -> BoxFuture<'static, Vec<Outcome>> {
    let writer = writer.clone();
    async move {
        let (buffer, errors) = encode_batch(&batch);
        let written = writer.write(buffer).await;
        outcomes(errors, &written)
    }
    .boxed()
}

/// Turns the result of one write of the whole batch (a failure is its complete report)
/// into one outcome per event.
fn outcomes(errors: Vec<Option<PublishError>>, written: &Result<(), String>) -> Vec<Outcome> {
    errors
        .into_iter()
        .map(|encode_error| match (encode_error, written) {
            (Some(e), _) => Err(e),
            (None, Ok(())) => Ok(()),
            (None, Err(report)) => Err(PublishError::new(PublishErrorKind::Io, report.clone())),
        })
        .collect()
}

/// Writes JSON lines to standard output and flushes after each write; batches sent while
/// one is written go out together with the next (see `GroupWriter`). Every stdout sink of
/// the process (two routes, or `[[outboxes]]`) shares one writer, so that a batch written
/// inline never waits for another sink's write to the same stdout.
pub struct StdoutSink {
    writer: GroupWriter<()>,
}

impl Default for StdoutSink {
    fn default() -> Self {
        static STDOUT: std::sync::OnceLock<GroupWriter<()>> = std::sync::OnceLock::new();
        let writer = STDOUT.get_or_init(|| {
            GroupWriter::new((), |(), buffer| {
                let mut out = std::io::stdout().lock();
                out.write_all(buffer)
                    .and_then(|()| out.flush())
                    .map_err(|e| format!("writing to stdout: {e}"))
            })
            // Piped into a consumer (`run --sink stdout | …`) that keeps up, a batch is
            // written at once; a terminal, a file or a reader behind is the thread's.
            .writing_inline_when({
                let stdout_is_pipe = is_pipe(&std::io::stdout());
                move |(), len| stdout_is_pipe && empty_pipe_takes(&std::io::stdout(), len)
            })
        });
        StdoutSink {
            writer: writer.clone(),
        }
    }
}

/// Whether `fd` is a pipe (or FIFO): the one target whose room for a write can be known.
#[cfg(target_os = "linux")]
pub(crate) fn is_pipe(fd: &impl std::os::fd::AsFd) -> bool {
    use rustix::fs::{fstat, FileType};
    fstat(fd).is_ok_and(|stat| FileType::from_raw_mode(stat.st_mode) == FileType::Fifo)
}

/// Whether the pipe `fd` is empty and holds `len` bytes with a page to spare, so that
/// writing them cannot block the runtime's thread. Only an empty pipe is judged: a pipe's
/// room is counted in page-sized slots, and a pipe holding a few bytes in each of its slots
/// is full while `FIONREAD` reports most of its bytes free.
#[cfg(target_os = "linux")]
pub(crate) fn empty_pipe_takes(fd: &impl std::os::fd::AsFd, len: usize) -> bool {
    let (Ok(size), Ok(0)) = (
        rustix::pipe::fcntl_getpipe_size(fd),
        rustix::io::ioctl_fionread(fd),
    ) else {
        return false;
    };
    len.saturating_add(rustix::param::page_size()) <= size
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn is_pipe(_fd: &impl std::os::fd::AsFd) -> bool {
    false
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn empty_pipe_takes(_fd: &impl std::os::fd::AsFd, _len: usize) -> bool {
    false
}

impl StdoutSink {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Sink for StdoutSink {
    /// A send is one buffer, written in order: a failed write leaves at most a prefix.
    fn stores_a_prefix(&self) -> bool {
        true
    }

    fn messaging_system(&self) -> Option<&'static str> {
        Some("stdout")
    }

    fn describe(&self) -> String {
        "stdout".into()
    }

    fn send(&self, batch: Vec<Routed>) -> BoxFuture<'static, Vec<Outcome>> {
        encode_and_write(&self.writer, batch)
    }

    fn health(&self) -> BoxFuture<'static, Result<(), PublishError>> {
        async { Ok(()) }.boxed()
    }
}

/// The mode of a sink file the relay creates: events carry business data, so only the
/// relay's user may read them. A file that exists keeps its mode (create it beforehand to
/// share it, e.g. 0640 for a log shipper's group), and a file recreated after a rotation
/// or a removal takes the mode of the file it replaces.
pub const FILE_MODE: u32 = 0o600;

/// How often one batch is written again because the file left its path while it was
/// written (rotated twice in a row); after that the batch fails and the engine retries it.
const WRITES_PER_BATCH: usize = 3;

/// Appends JSON lines to a file; each batch is written, flushed and fsynced before any of
/// its events is reported delivered.
///
/// Events are acked only when the file written is the file at the path, checked (device
/// and inode) before and after each write: a file removed or replaced (logrotate) is
/// reopened by path and created again, and a batch written into a file that left the path
/// meanwhile is written again. A removed directory is not recreated: batches fail (and are
/// retried) and [`Sink::health`] fails, naming the directory, until it is back.
///
/// Batches sent while a write is under way wait, and the next write takes all of them with
/// one `fdatasync` (group commit, see `GroupWriter`): the engine keeps many small batches
/// in flight, and a flush per batch would make the disk's flush rate the relay's event rate.
pub struct FileSink {
    path: PathBuf,
    writer: GroupWriter<OpenFile>,
}

struct OpenFile {
    file: File,
    /// Why the last write failed, until a write succeeds: a full disk or a failing device
    /// shows only when written to, so health reports it from here (the engine's retries
    /// write again within --retry-max-delay).
    last_failure: Option<String>,
    /// A failed write left part of a line that could not be cut off.
    maybe_torn: bool,
    /// Writes (each with its `fdatasync`) so far.
    writes: u64,
}

/// Whether `file` is a regular file. Anything else (`/dev/null`, a FIFO, a terminal) has
/// nothing to make durable and no length to cut back to: `fdatasync` on a character device
/// fails with EINVAL, so a sink to `/dev/null` once failed every batch and retried for good
/// while `check` called it reachable.
fn is_regular(file: &File) -> bool {
    file.metadata().is_ok_and(|m| m.file_type().is_file())
}

impl FileSink {
    /// Opens (or creates) the file. A file that cannot be opened at start-up (a missing
    /// directory, no permission) is the configuration's to fix.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, SinkSetupError> {
        let path = path.as_ref().to_path_buf();
        let file = match open_appending(&path, FILE_MODE) {
            Ok(file) => file,
            // A FIFO whose consumer has not started: each batch opens it again, and fails
            // (retried, and shown by health) until one has.
            Err(e) if is_unread_fifo(&e) => File::open("/dev/null").map_err(|e| {
                SinkSetupError::config(io_report("cannot open", Path::new("/dev/null"), &e))
            })?,
            Err(e) => return Err(SinkSetupError::config(io_report("cannot open", &path, &e))),
        };
        if is_regular(&file) {
            // A file created here: its directory entry must survive a crash, like the lines
            // each write makes durable (only a rotation's new file synced it).
            File::open(directory_of(&path))
                .and_then(|d| d.sync_all())
                .map_err(|e| {
                    SinkSetupError::config(io_report("cannot sync the directory of", &path, &e))
                })?;
        }
        let open = OpenFile {
            file,
            last_failure: None,
            maybe_torn: false,
            writes: 0,
        };
        let at = path.clone();
        Ok(FileSink {
            path,
            writer: GroupWriter::new(open, move |open: &mut OpenFile, buffer| {
                open.write_batch(buffer, &at)
            }),
        })
    }
}

fn open_appending(path: &Path, mode: u32) -> std::io::Result<File> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    if std::fs::metadata(path).is_ok_and(|m| m.file_type().is_fifo()) {
        return open_fifo(path);
    }
    let mut file = OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .mode(mode)
        .open(path)?;
    terminate_torn_line(&mut file)?;
    Ok(file)
}

/// Opens a FIFO for writing only, failing while no process reads it ([`is_unread_fifo`]):
/// opened for reading too (as a file is, to mend a torn line), the relay was a reader of its
/// own FIFO, and its writes went into the pipe's buffer with no consumer to take them,
/// acked, then lost with the pipe at the relay's restart. Once open, a write blocks as a
/// pipe's does; one made after the consumer left fails (`EPIPE`) and is retried.
fn open_fifo(path: &Path) -> std::io::Result<File> {
    use rustix::fs::OFlags;
    use std::os::unix::fs::OpenOptionsExt;
    let file = OpenOptions::new()
        .write(true)
        .custom_flags(OFlags::NONBLOCK.bits() as i32)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(code) if code == rustix::io::Errno::NXIO.raw_os_error() => {
                std::io::Error::new(std::io::ErrorKind::NotConnected, UnreadFifo)
            }
            _ => e,
        })?;
    rustix::fs::fcntl_setfl(&file, OFlags::empty())?;
    Ok(file)
}

/// A FIFO no process has open for reading.
#[derive(Debug)]
struct UnreadFifo;

impl std::fmt::Display for UnreadFifo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a FIFO no process reads: start its consumer (events wait in the outbox)")
    }
}

impl std::error::Error for UnreadFifo {}

fn is_unread_fifo(e: &std::io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<UnreadFifo>())
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

/// The directory a sink file lives in (`.` for a bare file name).
fn directory_of(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

fn same_file(a: &std::fs::Metadata, b: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    (a.dev(), a.ino()) == (b.dev(), b.ino())
}

/// The report of an I/O failure on the sink file, with what the operator can do about it.
fn io_report(action: &str, path: &Path, e: &std::io::Error) -> String {
    use std::io::ErrorKind;
    let fix = match e.kind() {
        ErrorKind::StorageFull | ErrorKind::QuotaExceeded => {
            "free space on its filesystem (or raise the quota)"
        }
        // EFBIG: past the process's file-size limit (SIGXFSZ is ignored for it).
        ErrorKind::FileTooLarge => {
            "the file reached the relay's file-size limit (ulimit -f, systemd's LimitFSIZE): \
             raise the limit, or rotate the file"
        }
        ErrorKind::PermissionDenied => "let the relay's user write the file and its directory",
        ErrorKind::ReadOnlyFilesystem => "remount its filesystem read-write or choose another path",
        ErrorKind::NotFound | ErrorKind::NotADirectory => "create its directory",
        ErrorKind::IsADirectory => "the path is a directory: give a file path",
        _ => "check the file and its filesystem",
    };
    format!("{action} sink file {}: {e}; {fix}", path.display())
}

/// [`io_report`] for a failure while running, when the events wait in the outbox. Each
/// failure is an attempt, as a broker's outage is: said, where it promised retries without
/// end while `max_attempts` dead-lettered each key's oldest event.
fn retried_report(action: &str, path: &Path, e: &std::io::Error) -> String {
    format!(
        "{}; the events stay in the outbox and are retried, each failure counting as an \
         attempt (dead-lettered after max_attempts)",
        io_report(action, path, e)
    )
}

impl OpenFile {
    /// Makes `file` the file now at `path`: reopens it when it was replaced and creates it
    /// again when it was removed. Fails, naming the fix, when its directory is gone.
    fn follow_path(&mut self, path: &Path) -> Result<(), String> {
        let open = self
            .file
            .metadata()
            .map_err(|e| retried_report("cannot inspect the open", path, &e))?;
        let dir = directory_of(path);
        match std::fs::metadata(path) {
            Ok(at_path) if same_file(&open, &at_path) => return Ok(()),
            // Opened again for each batch until its consumer has it open (`FileSink::open`).
            Ok(at_path) if std::os::unix::fs::FileTypeExt::is_fifo(&at_path.file_type()) => {}
            Ok(_) => tracing::info!(path = %path.display(), "the sink file was replaced (rotated); appending to the new file"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !dir.is_dir() => {
                return Err(format!(
                    "sink file {}: its directory {} no longer exists; create it (mkdir -p {}) and delivery resumes; events stay in the outbox until then",
                    path.display(),
                    dir.display(),
                    dir.display()
                ))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                tracing::warn!(path = %path.display(), "the sink file was removed; creating it again")
            }
            Err(e) => return Err(retried_report("cannot inspect", path, &e)),
        }
        use std::os::unix::fs::PermissionsExt;
        // The mode of the file it replaces; not of `/dev/null`, which stands for a FIFO
        // not read yet.
        let mode = match is_regular(&self.file) {
            true => open.permissions().mode() & 0o777,
            false => FILE_MODE,
        };
        self.file =
            open_appending(path, mode).map_err(|e| retried_report("cannot reopen", path, &e))?;
        self.maybe_torn = false;
        // The new directory entry must survive a crash, like the lines written into it.
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| retried_report("cannot sync the directory of", path, &e))
    }

    /// Whether the open file is still the one at `path`.
    fn is_at(&self, path: &Path) -> bool {
        match (self.file.metadata(), std::fs::metadata(path)) {
            (Ok(open), Ok(at_path)) => same_file(&open, &at_path),
            _ => false,
        }
    }

    /// Appends `buffer` and fsyncs; on failure cuts off what part of it reached the file,
    /// so that the retry starts on a line of its own.
    fn append(&mut self, buffer: &[u8], path: &Path) -> Result<(), String> {
        if !is_regular(&self.file) {
            // Written is all there is to it: discarded (`/dev/null`), or in the pipe of a
            // FIFO a consumer has open (see `open_fifo`).
            self.writes += 1;
            let result = self
                .append_unsynced(buffer)
                .map_err(|e| retried_report("cannot write to", path, &e));
            self.last_failure = result.as_ref().err().cloned();
            return result;
        }
        // Another writer of the file (a second relay, or an old process during a restart)
        // waits while this batch is written: a failed write is cut back to the length it
        // started from, which must not take that writer's confirmed lines with it.
        self.file
            .lock()
            .map_err(|e| retried_report("cannot lock", path, &e))?;
        let result = self.append_locked(buffer, path);
        let _ = self.file.unlock();
        result
    }

    /// Writes `buffer` to what has no length to cut back to. A write cut short (a FIFO's
    /// consumer that left mid-batch) leaves part of a line in the pipe, which the next
    /// consumer reads: it is ended with a line break before anything more is written, so
    /// that the retried batch's first line is not run into it.
    fn append_unsynced(&mut self, buffer: &[u8]) -> std::io::Result<()> {
        if self.maybe_torn {
            self.file.write_all(b"\n")?;
            self.maybe_torn = false;
        }
        let mut written = 0;
        while written < buffer.len() {
            match self.file.write(&buffer[written..]) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => written += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.maybe_torn = written > 0 && buffer[written - 1] != b'\n';
                    return Err(e);
                }
            }
        }
        self.file.flush()
    }

    fn append_locked(&mut self, buffer: &[u8], path: &Path) -> Result<(), String> {
        if self.maybe_torn {
            terminate_torn_line(&mut self.file)
                .map_err(|e| retried_report("cannot repair the last line of", path, &e))?;
            self.maybe_torn = false;
        }
        let before = self.file.metadata().map(|m| m.len());
        self.writes += 1;
        let written = self
            .file
            .write_all(buffer)
            .and_then(|()| self.file.flush())
            .and_then(|()| self.file.sync_data());
        let result = written.map_err(|e| {
            let cut = before.is_ok_and(|len| self.file.set_len(len).is_ok());
            self.maybe_torn = !cut;
            retried_report("cannot write to", path, &e)
        });
        self.last_failure = result.as_ref().err().cloned();
        result
    }

    /// Writes one batch into the file at `path`, written again if the file left the path
    /// while it was written.
    fn write_batch(&mut self, buffer: &[u8], path: &Path) -> Result<(), String> {
        for _ in 0..WRITES_PER_BATCH {
            self.follow_path(path)?;
            self.append(buffer, path)?;
            if self.is_at(path) {
                return Ok(());
            }
        }
        Err(format!(
            "sink file {} was replaced during each of {WRITES_PER_BATCH} writes of one batch; it is retried",
            path.display()
        ))
    }
}

impl Sink for FileSink {
    /// A send is one buffer, written in order: a failed write leaves at most a prefix.
    fn stores_a_prefix(&self) -> bool {
        true
    }

    fn messaging_system(&self) -> Option<&'static str> {
        Some("file")
    }

    fn describe(&self) -> String {
        format!("file:{}", self.path.display())
    }

    fn send(&self, batch: Vec<Routed>) -> BoxFuture<'static, Vec<Outcome>> {
        encode_and_write(&self.writer, batch)
    }

    /// Fails while the file cannot be written at its path: its directory is gone, it cannot
    /// be recreated, or the last write failed (a full disk) and none has succeeded since.
    fn health(&self) -> BoxFuture<'static, Result<(), PublishError>> {
        let state = self.writer.target().clone();
        let path = self.path.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                let mut open = state.lock().unwrap_or_else(|p| p.into_inner());
                open.follow_path(&path)?;
                match &open.last_failure {
                    Some(failure) => Err(format!("the last write failed: {failure}")),
                    None => Ok(()),
                }
            })
            .await
            .unwrap_or_else(|e| Err(format!("the sink file's health check failed: {e}")))
            .map_err(|report| PublishError::new(PublishErrorKind::Io, report))
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::{Headers, Payload};
    use std::sync::Arc;
    use std::time::{Duration, UNIX_EPOCH};

    fn event(seq: i64, payload: &str) -> Routed {
        Routed {
            cloudevents: None,
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

    #[cfg(target_os = "linux")]
    #[test]
    fn only_an_empty_pipe_with_room_is_written_inline_and_a_file_is_no_pipe() {
        use std::io::Read;
        let (mut reader, mut writer) = std::io::pipe().unwrap();
        assert!(is_pipe(&writer));
        assert!(empty_pipe_takes(&writer, 1000), "an empty pipe of 64 KiB");
        let size = rustix::pipe::fcntl_getpipe_size(&writer).unwrap();
        assert!(
            !empty_pipe_takes(&writer, size),
            "a page to spare, whatever the pipe's size"
        );
        // Writes of a little over half a page take a slot each (the kernel merges a write
        // into the last slot only if it fits there), so a pipe of 16 slots is full while
        // FIONREAD counts about half its bytes: the room it reports is not there.
        rustix::fs::fcntl_setfl(&writer, rustix::fs::OFlags::NONBLOCK).unwrap();
        let half_page = rustix::param::page_size() / 2 + 52;
        for _ in 0..size / rustix::param::page_size() {
            writer.write_all(&vec![b'x'; half_page]).unwrap();
        }
        let unread = rustix::io::ioctl_fionread(&writer).unwrap() as usize;
        let blocked = writer.write(&vec![b'z'; half_page]);
        assert!(
            unread < size / 2 + size / 8
                && matches!(&blocked, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "{unread} of {size} bytes unread, and the next write: {blocked:?}"
        );
        assert!(
            !empty_pipe_takes(&writer, half_page),
            "a pipe holding anything is the thread's to write"
        );
        let _ = reader.read(&mut [0; 1]);
        drop(reader);
        let file = tempfile_in_target();
        assert!(!is_pipe(&file), "a regular file goes to the writer thread");
    }

    #[cfg(target_os = "linux")]
    fn tempfile_in_target() -> std::fs::File {
        let path = std::env::temp_dir().join(format!("outbox-pipe-test-{}", std::process::id()));
        let file = std::fs::File::create(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        file
    }

    /// A payload of JSON written over several lines (SQLite keeps a `TEXT` payload as
    /// written) split its event into several lines, which was acked all the same.
    #[test]
    fn a_payload_written_over_several_lines_stays_on_the_events_line() {
        let pretty = "{\r\n  \"note\": \"a\\nb\",\n  \"n\": 1\n}";
        let mut plain = event(1, pretty);
        let mut structured = event(2, pretty);
        structured.cloudevents = Some(crate::cloudevents::ContentMode::Structured);
        plain.target = "t".into();
        let (buffer, errors) = encode_batch(&[plain, structured]);
        assert!(errors.iter().all(Option::is_none));
        let text = String::from_utf8(buffer).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        let v: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
        assert_eq!(
            v["payload"]["note"], "a\nb",
            "the escape inside a string is kept"
        );
        let v: serde_json::Value = serde_json::from_str(lines[1]).unwrap();
        assert_eq!(v["n"], 1);
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

    #[test]
    fn created_at_before_1970_is_written_and_beyond_9999_fails_only_its_event() {
        let mut routed = event(1, "1");
        let e = Arc::get_mut(&mut routed.event).unwrap();
        e.created_at = UNIX_EPOCH - Duration::from_secs(86_400);
        let mut out = Vec::new();
        encode_line(&routed.event, &mut out).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["created_at"], "1969-12-31T00:00:00.000000Z");

        let mut far = event(2, "2");
        Arc::get_mut(&mut far.event).unwrap().created_at =
            UNIX_EPOCH + Duration::from_secs(253_402_300_800);
        let mut other_key = event(3, "3");
        Arc::get_mut(&mut other_key.event).unwrap().partition_key = Some("c-2".into());
        let same_key = event(4, "4");
        let (buffer, errors) = encode_batch(&[far, other_key, same_key]);
        let error = errors[0].as_ref().expect("year 10000 cannot be written");
        assert_eq!(error.kind(), PublishErrorKind::Encoding);
        assert!(
            error.to_string().contains("outside the years 1 to 9999"),
            "{error}"
        );
        assert!(errors[1].is_none());
        // A later event of its key is not written after it (it goes again, behind it).
        let held_back = errors[2].as_ref().expect("held back");
        assert_eq!(held_back.kind(), PublishErrorKind::NotSent);
        assert_eq!(buffer.iter().filter(|b| **b == b'\n').count(), 1);
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
    async fn batches_sent_during_a_write_share_the_next_write_and_its_fdatasync() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        let sink = Arc::new(FileSink::open(&path).unwrap());
        // A write under way (a thread holds the file) while three batches are sent.
        let (release, hold) = std::sync::mpsc::channel::<()>();
        let (held, busy) = std::sync::mpsc::channel();
        let state = sink.writer.target().clone();
        let writer = std::thread::spawn(move || {
            let _file = state.lock().unwrap();
            held.send(()).unwrap();
            hold.recv().unwrap();
        });
        busy.recv().unwrap();
        let sends: Vec<_> = (1..=3)
            .map(|seq| tokio::spawn(sink.send(vec![event(seq, "1")])))
            .collect();
        while sink.writer.queued() < 3 {
            tokio::task::yield_now().await;
        }
        release.send(()).unwrap();
        writer.join().unwrap();
        for send in sends {
            let outcomes = send.await.unwrap();
            assert!(outcomes.iter().all(|o| o.is_ok()), "{outcomes:?}");
        }
        assert_eq!(
            sink.writer.target().lock().unwrap().writes,
            1,
            "one write for the three"
        );
        assert_eq!(
            sequence_ids(&path),
            vec![1, 2, 3],
            "in the order they were sent"
        );
    }

    #[test]
    fn a_structured_cloudevent_is_the_whole_line() {
        let mut routed = event(1, "1");
        routed.event = crate::cloudevents::shape(
            &routed.event,
            &crate::cloudevents::CloudEvents {
                mode: crate::cloudevents::ContentMode::Structured,
                source: crate::Template::destination(),
            },
            None,
        )
        .unwrap();
        routed.cloudevents = Some(crate::cloudevents::ContentMode::Structured);
        let (buffer, errors) = encode_batch(&[routed]);
        assert!(errors[0].is_none());
        let v: serde_json::Value = serde_json::from_slice(&buffer).unwrap();
        assert_eq!(v["specversion"], "1.0");
        assert_eq!(v["data"], 1);
        assert!(v.get("sequence_id").is_none(), "not the relay's line: {v}");
    }

    fn mode_of(path: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    fn sequence_ids(path: &Path) -> Vec<i64> {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["sequence_id"]
                    .as_i64()
                    .unwrap()
            })
            .collect()
    }

    /// A FIFO made in `dir`.
    #[cfg(target_os = "linux")]
    fn fifo_in(dir: &Path) -> std::path::PathBuf {
        let path = dir.join("events.fifo");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &path,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        path
    }

    /// Opens the FIFO at `path` for reading, as its consumer, without waiting for a writer.
    #[cfg(target_os = "linux")]
    fn fifo_consumer(path: &Path) -> std::fs::File {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
            .open(path)
            .unwrap()
    }

    /// Opened for reading too, a FIFO with no consumer took the relay's writes into its
    /// buffer: acked, and lost with the pipe at the relay's restart. Now nothing is written
    /// while no process reads it: retried (and health fails) until its consumer starts, and
    /// after it left.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_fifo_is_written_only_while_a_consumer_reads_it() {
        use std::io::Read;
        let dir = tempfile::tempdir().unwrap();
        let path = fifo_in(dir.path());
        let sink = FileSink::open(&path).unwrap();
        let retried = |outcome: Outcome| {
            let e = outcome.expect_err("no consumer: nothing may be acked");
            assert!(
                matches!(e.disposition(), outbox_core::Disposition::Retry { .. }),
                "{e}"
            );
            e.to_string()
        };
        let said = retried(sink.send(vec![event(1, "1")]).await.remove(0));
        assert!(said.contains("no process reads"), "{said}");
        let health = sink.health().await.expect_err("no consumer");
        assert!(health.to_string().contains("no process reads"), "{health}");
        let consumer = || fifo_consumer(&path);
        let mut reader = consumer();
        assert!(sink.send(vec![event(2, "2")]).await[0].is_ok());
        let mut line = String::new();
        reader.read_to_string(&mut line).unwrap_or_default();
        assert!(line.contains("\"sequence_id\":2"), "{line}");
        drop(reader);
        retried(sink.send(vec![event(3, "3")]).await.remove(0));
        let mut reader = consumer();
        assert!(sink.send(vec![event(4, "4")]).await[0].is_ok());
        let mut line = String::new();
        reader.read_to_string(&mut line).unwrap_or_default();
        assert!(line.contains("\"sequence_id\":4"), "{line}");
        assert!(!line.contains("\"sequence_id\":3"), "{line}");
    }

    /// A FIFO's consumer that leaves mid-batch leaves part of a line in the pipe (the
    /// relay keeps its end open), and the next consumer reads it: the retried batch's
    /// first line ran into it, and neither parsed. The torn line is ended first.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_line_a_fifos_consumer_left_half_read_is_ended_before_the_next_batch() {
        use std::io::Read;
        let dir = tempfile::tempdir().unwrap();
        let path = fifo_in(dir.path());
        let consumer = || fifo_consumer(&path);
        let first = consumer();
        rustix::fs::fcntl_setfl(&first, rustix::fs::OFlags::empty()).unwrap();
        let sink = FileSink::open(&path).unwrap();
        // More than the pipe holds: the write waits for the consumer, which leaves.
        let big = "x".repeat(4096);
        let batch: Vec<Routed> = (1..=64).map(|n| event(n, &format!("\"{big}\""))).collect();
        let leaving = std::thread::spawn(move || {
            let mut first = first;
            let mut some = [0u8; 1000];
            first.read_exact(&mut some).unwrap();
        });
        let outcomes = sink.send(batch).await;
        leaving.join().unwrap();
        assert!(outcomes[0].is_err(), "the consumer left mid-batch");
        // The next consumer reads what the pipe holds, then the next batch's line.
        let second = consumer();
        rustix::fs::fcntl_setfl(&second, rustix::fs::OFlags::empty()).unwrap();
        let reading = std::thread::spawn(move || {
            use std::io::BufRead;
            let mut lines = Vec::new();
            for line in std::io::BufReader::new(second).split(b'\n') {
                let line = String::from_utf8_lossy(&line.unwrap()).into_owned();
                let done = line.contains("\"sequence_id\":100");
                lines.push(line);
                if done {
                    break;
                }
            }
            lines
        });
        assert!(sink.send(vec![event(100, "1")]).await[0].is_ok());
        let lines = reading.join().unwrap();
        let last = lines.last().unwrap();
        let parsed: serde_json::Value = serde_json::from_str(last).unwrap_or_else(|e| {
            panic!("the retried line ran into the torn one ({e}): {last:.120}")
        });
        assert_eq!(parsed["sequence_id"], 100);
    }

    #[tokio::test]
    async fn a_removed_file_is_created_again_and_holds_the_next_batch() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        let sink = FileSink::open(&path).unwrap();
        sink.send(vec![event(1, "1")]).await;
        std::fs::remove_file(&path).unwrap();
        let outcomes = sink.send(vec![event(2, "2"), event(3, "3")]).await;
        assert!(outcomes.iter().all(|o| o.is_ok()), "{outcomes:?}");
        assert_eq!(
            sequence_ids(&path),
            vec![2, 3],
            "acked only once at the path"
        );
        assert!(sink.health().await.is_ok());
    }

    #[tokio::test]
    async fn a_rotated_file_is_reopened_and_the_new_file_gets_the_next_batch() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        let rotated = dir.path().join("events.jsonl.1");
        let sink = FileSink::open(&path).unwrap();
        sink.send(vec![event(1, "1")]).await;
        // logrotate's default: rename, then create an empty file at the path.
        std::fs::rename(&path, &rotated).unwrap();
        std::fs::File::create(&path).unwrap();
        let outcomes = sink.send(vec![event(2, "2")]).await;
        assert!(outcomes.iter().all(|o| o.is_ok()), "{outcomes:?}");
        assert_eq!(sequence_ids(&rotated), vec![1]);
        assert_eq!(sequence_ids(&path), vec![2]);
    }

    #[tokio::test]
    async fn a_removed_directory_fails_batches_and_health_until_it_is_back() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("out");
        std::fs::create_dir(&dir).unwrap();
        let path = dir.join("events.jsonl");
        let sink = FileSink::open(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();

        let outcomes = sink.send(vec![event(1, "1"), event(2, "2")]).await;
        for outcome in &outcomes {
            let error = outcome
                .as_ref()
                .expect_err("nothing is acked into a lost file");
            assert_eq!(error.kind(), PublishErrorKind::Io);
            assert!(matches!(
                error.disposition(),
                outbox_core::Disposition::Retry { .. }
            ));
            let text = error.to_string();
            assert!(
                text.contains(&format!("mkdir -p {}", dir.display())),
                "{text}"
            );
        }
        let unhealthy = sink.health().await.expect_err("the directory is gone");
        assert!(
            unhealthy.to_string().contains("no longer exists"),
            "{unhealthy}"
        );
        assert!(!dir.exists(), "the sink does not recreate a directory");

        std::fs::create_dir(&dir).unwrap();
        sink.health()
            .await
            .expect("healthy once the directory is back");
        let outcomes = sink.send(vec![event(1, "1"), event(2, "2")]).await;
        assert!(outcomes.iter().all(|o| o.is_ok()), "{outcomes:?}");
        assert_eq!(sequence_ids(&path), vec![1, 2]);
    }

    #[tokio::test]
    async fn a_full_disk_fails_the_batch_and_health_until_a_write_succeeds() {
        let sink = FileSink::open("/dev/full").unwrap();
        sink.health().await.expect("nothing written yet");
        let outcomes = sink.send(vec![event(1, "1")]).await;
        let error = outcomes[0].as_ref().expect_err("/dev/full holds nothing");
        assert!(
            error.to_string().contains("free space on its filesystem"),
            "{error}"
        );
        let unhealthy = sink.health().await.expect_err("the last write failed");
        assert!(
            unhealthy.to_string().contains("No space left on device"),
            "{unhealthy}"
        );
    }

    #[tokio::test]
    async fn files_are_created_private_and_existing_modes_are_kept() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let new = dir.path().join("new.jsonl");
        let sink = FileSink::open(&new).unwrap();
        assert_eq!(mode_of(&new), 0o600);
        std::fs::remove_file(&new).unwrap();
        sink.send(vec![event(1, "1")]).await;
        assert_eq!(mode_of(&new), 0o600, "recreated private too");

        let shared = dir.path().join("shared.jsonl");
        std::fs::write(&shared, "").unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o640)).unwrap();
        let sink = FileSink::open(&shared).unwrap();
        assert_eq!(mode_of(&shared), 0o640, "an existing file keeps its mode");
        std::fs::remove_file(&shared).unwrap();
        sink.send(vec![event(1, "1")]).await;
        assert_eq!(
            mode_of(&shared),
            0o640,
            "a recreated file keeps the old one's mode"
        );
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
