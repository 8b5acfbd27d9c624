//! Blocking writes (a file, standard output) fed by async senders, one thread at a time.

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

/// How a [`GroupWriter`] writes one buffer into its target.
type WriteFn<T> = dyn Fn(&mut T, &[u8]) -> Result<(), String> + Send + Sync;

/// Whether the target takes a buffer of this many bytes now, without blocking.
type TakesNowFn<T> = dyn Fn(&mut T, usize) -> bool + Send + Sync;

/// Writes buffers into a blocking target with at most one thread at a time.
///
/// A sender queues its buffer and awaits the outcome without holding a thread. One blocking
/// task writes: it takes every buffer queued when it starts, writes them as one (for the
/// file, one `write` and one `fdatasync`: a group commit), answers each sender, and goes on
/// until the queue is empty. Buffers are written in the order they were queued.
///
/// Why not a blocking task per buffer: each would wait on the target's lock on a thread of
/// its own. With thousands of events in flight in small batches, that started hundreds of
/// threads (tokio allows 512), each with its stack and its allocator heap: a WAL-capture
/// drain of 600,000 rows to a file peaked at 376 MB.
///
/// A target that can tell when a write would not block (a pipe with room,
/// [`GroupWriter::writing_inline_when`]) is written on the sender's thread while nothing is
/// queued: handing each batch to a thread and back cost more than the write itself.
pub struct GroupWriter<T> {
    target: Arc<Mutex<T>>,
    queue: Arc<Mutex<Queue>>,
    write: Arc<WriteFn<T>>,
    takes_now: Option<Arc<TakesNowFn<T>>>,
}

impl<T> Clone for GroupWriter<T> {
    fn clone(&self) -> Self {
        GroupWriter {
            target: self.target.clone(),
            queue: self.queue.clone(),
            write: self.write.clone(),
            takes_now: self.takes_now.clone(),
        }
    }
}

#[derive(Default)]
struct Queue {
    waiting: Vec<Waiting>,
    /// A blocking task is writing: what is queued meanwhile is its to take.
    writing: bool,
}

struct Waiting {
    buffer: Vec<u8>,
    written: oneshot::Sender<Result<(), String>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Writes run with panics caught (`write_caught`), so neither lock is poisoned by them;
    // should one be, its data is still the best there is.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl<T: Send + 'static> GroupWriter<T> {
    pub fn new(
        target: T,
        write: impl Fn(&mut T, &[u8]) -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        GroupWriter {
            target: Arc::new(Mutex::new(target)),
            queue: Arc::default(),
            write: Arc::new(write),
            takes_now: None,
        }
    }

    /// Writes a buffer on the sender's thread, at once, when no write is queued or under way
    /// and `takes_now` says the target takes it without blocking; others go to the thread.
    pub fn writing_inline_when(
        mut self,
        takes_now: impl Fn(&mut T, usize) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.takes_now = Some(Arc::new(takes_now));
        self
    }

    /// The target, under the lock the writes take (for health checks).
    pub fn target(&self) -> &Arc<Mutex<T>> {
        &self.target
    }

    /// Queues `buffer` now; the future resolves with the outcome of the write that carried
    /// it. Call it from within a tokio runtime.
    pub fn write(&self, buffer: Vec<u8>) -> impl Future<Output = Result<(), String>> + Send {
        let (written, outcome) = oneshot::channel();
        let start_writer = {
            let mut queue = lock(&self.queue);
            if let Some(outcome) = self.write_inline(&queue, &buffer) {
                return futures::future::Either::Left(std::future::ready(outcome));
            }
            queue.waiting.push(Waiting { buffer, written });
            !std::mem::replace(&mut queue.writing, true)
        };
        if start_writer {
            let writer = Writer {
                group: self.clone(),
                finished: false,
            };
            // Without a thread to run on (a thread limit), the writer is dropped unrun and
            // says so to the queued senders; the next buffer tries again.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                tokio::task::spawn_blocking(move || writer.run())
            }));
        }
        futures::future::Either::Right(async move {
            outcome.await.unwrap_or_else(|_| {
                Err(
                    "the writer thread could not run (a thread limit, or the runtime is \
                     stopping); the batch is retried"
                        .to_string(),
                )
            })
        })
    }

    /// Writes `buffer` here and now if nothing is queued or being written (so buffers stay
    /// in order), the target is free, and it takes the buffer without blocking. The queue's
    /// lock is held throughout, so no sender queues behind a write it would overtake.
    fn write_inline(&self, queue: &Queue, buffer: &[u8]) -> Option<Result<(), String>> {
        let takes_now = self.takes_now.as_ref()?;
        if queue.writing || !queue.waiting.is_empty() {
            return None;
        }
        // `try_lock`: the writer thread locks the target before the queue, so waiting here
        // could deadlock; a target held (a health check) means the thread's way.
        let mut target = match self.target.try_lock() {
            Ok(target) => target,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        if !takes_now(&mut target, buffer.len()) {
            return None;
        }
        Some(write_caught(&*self.write, &mut target, buffer))
    }

    /// Buffers queued and not yet taken by a write.
    #[cfg(test)]
    pub fn queued(&self) -> usize {
        lock(&self.queue).waiting.len()
    }
}

/// The one blocking task that writes: it writes until the queue is empty.
struct Writer<T: Send + 'static> {
    group: GroupWriter<T>,
    finished: bool,
}

impl<T: Send + 'static> Writer<T> {
    fn run(mut self) {
        let group = &self.group;
        loop {
            // The target first, then the queue: what was queued while an earlier write (or a
            // health check) held the target goes out in this one write.
            let mut target = lock(&group.target);
            let mut taken: Vec<Waiting> = {
                let mut queue = lock(&group.queue);
                if queue.waiting.is_empty() {
                    queue.writing = false;
                    self.finished = true;
                    return;
                }
                std::mem::take(&mut queue.waiting)
            };
            // A sender that went away (its publish timed out, or was cancelled at shutdown)
            // can never be acked: its buffer is not written, so that a stuck disk does not
            // collect one copy of a batch per retry.
            taken.retain(|w| !w.written.is_closed());
            let outcome = match taken.as_slice() {
                [] => continue,
                [one] => write_caught(&*group.write, &mut target, &one.buffer),
                many => {
                    let buffers: Vec<&[u8]> = many.iter().map(|w| w.buffer.as_slice()).collect();
                    write_caught(&*group.write, &mut target, &buffers.concat())
                }
            };
            drop(target);
            for waiting in taken {
                let _ = waiting.written.send(outcome.clone());
            }
        }
    }
}

/// A writer dropped before it emptied the queue (never run, because the runtime is stopping
/// or no thread could start) lets the next buffer start another, and closes the channels of
/// the buffers it leaves, rather than have every later send wait for it.
impl<T: Send + 'static> Drop for Writer<T> {
    fn drop(&mut self) {
        if !self.finished {
            let mut queue = lock(&self.group.queue);
            queue.writing = false;
            queue.waiting.clear();
        }
    }
}

/// Runs one write; a panic in it (a bug) fails that write's buffers alone, with its message.
fn write_caught<T>(write: &WriteFn<T>, target: &mut T, buffer: &[u8]) -> Result<(), String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| write(target, buffer))).unwrap_or_else(
        |panic| {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(format!("the writer panicked (a bug): {message}"))
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A current-thread runtime (its one worker is the caller) that counts the threads its
    /// blocking pool starts.
    fn counting_runtime() -> (tokio::runtime::Runtime, Arc<AtomicUsize>) {
        let started = Arc::new(AtomicUsize::new(0));
        let count = started.clone();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .on_thread_start(move || {
                count.fetch_add(1, Ordering::SeqCst);
            })
            .enable_all()
            .build()
            .unwrap();
        (runtime, started)
    }

    /// Holds `target`'s lock on a thread of its own (a slow `fdatasync`) until the returned
    /// sender is used or dropped.
    fn hold<T: Send + 'static>(
        target: Arc<Mutex<T>>,
    ) -> (std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>) {
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let (held, is_held) = std::sync::mpsc::channel();
        let holder = std::thread::spawn(move || {
            let _target = target.lock().unwrap();
            held.send(()).unwrap();
            let _ = wait.recv();
        });
        is_held.recv().unwrap();
        (release, holder)
    }

    fn recording() -> GroupWriter<Vec<Vec<u8>>> {
        GroupWriter::new(Vec::new(), |writes: &mut Vec<Vec<u8>>, buffer| {
            writes.push(buffer.to_vec());
            Ok(())
        })
    }

    #[test]
    fn buffers_waiting_for_a_slow_write_hold_no_thread_and_share_the_next_write() {
        let (runtime, started) = counting_runtime();
        let writer = recording();
        let (release, holder) = hold(writer.target().clone());
        runtime.block_on(async {
            let sends: Vec<_> = (0..50u8)
                .map(|i| tokio::spawn(writer.write(vec![i])))
                .collect();
            release.send(()).unwrap();
            for send in sends {
                assert_eq!(send.await.unwrap(), Ok(()));
            }
        });
        holder.join().unwrap();
        // Every writer thread counted itself before it answered anyone.
        assert_eq!(
            started.load(Ordering::SeqCst),
            1,
            "one writer thread, not one per waiting buffer"
        );
        let writes = writer.target().lock().unwrap().clone();
        assert_eq!(writes.len(), 1, "one write for the 50");
        assert_eq!(
            writes.concat(),
            (0..50u8).collect::<Vec<_>>(),
            "in the order queued"
        );
    }

    #[test]
    fn a_target_that_takes_a_buffer_now_is_written_without_a_thread() {
        let (runtime, started) = counting_runtime();
        let writer = recording().writing_inline_when(|_, _| true);
        runtime.block_on(async {
            let write = writer.write(b"one".to_vec());
            assert_eq!(
                *writer.target().lock().unwrap(),
                vec![b"one".to_vec()],
                "written before the future was awaited"
            );
            assert_eq!(write.await, Ok(()));
        });
        assert_eq!(started.load(Ordering::SeqCst), 0, "no writer thread");
    }

    #[test]
    fn a_buffer_sent_while_others_wait_for_the_thread_queues_behind_them() {
        // The target has no room for the first buffer (5 bytes), which goes to the one
        // blocking thread, kept busy: the first buffer's writer waits for it with the target
        // free, so the second, which fits, could be written inline and overtake it.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .max_blocking_threads(1)
            .build()
            .unwrap();
        let writer = recording().writing_inline_when(|_, len| len != b"first".len());
        let (release, busy) = std::sync::mpsc::channel::<()>();
        runtime.block_on(async {
            let occupant = tokio::task::spawn_blocking(move || busy.recv());
            let first = writer.write(b"first".to_vec());
            let second = writer.write(b"second".to_vec());
            release.send(()).unwrap();
            assert_eq!(first.await, Ok(()));
            assert_eq!(second.await, Ok(()));
            occupant.await.unwrap().unwrap();
        });
        assert_eq!(
            writer.target().lock().unwrap().concat(),
            b"firstsecond".to_vec(),
            "in the order sent"
        );
    }

    #[test]
    fn a_write_that_panics_fails_its_buffers_alone_and_the_writer_goes_on() {
        let (runtime, _) = counting_runtime();
        let writer = GroupWriter::new((), |_, buffer| {
            assert_ne!(buffer, b"boom", "a writer bug");
            Ok(())
        });
        runtime.block_on(async {
            let failed = writer.write(b"boom".to_vec()).await.unwrap_err();
            assert!(failed.contains("panicked (a bug): "), "{failed}");
            assert!(
                failed.contains("a writer bug"),
                "the panic's message: {failed}"
            );
            assert_eq!(writer.write(b"fine".to_vec()).await, Ok(()));
        });
    }

    #[test]
    fn a_writer_dropped_unrun_by_a_stopped_runtime_lets_the_next_buffer_start_another() {
        let writer = recording();
        // A runtime that has stopped drops the blocking task it is given without running it.
        let stopped = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let handle = stopped.handle().clone();
        stopped.shutdown_background();
        let lost = {
            let _context = handle.enter();
            writer.write(b"lost".to_vec())
        };
        let (runtime, _) = counting_runtime();
        runtime.block_on(async {
            // Bounded, so that a writer that never tells fails the test instead of hanging it.
            let lost = tokio::time::timeout(std::time::Duration::from_secs(30), lost)
                .await
                .expect("the senders of a writer dropped unrun are told")
                .unwrap_err();
            assert!(lost.contains("could not run"), "{lost}");
            assert_eq!(writer.write(b"next".to_vec()).await, Ok(()));
        });
        assert_eq!(*writer.target().lock().unwrap(), vec![b"next".to_vec()]);
    }

    #[test]
    fn a_buffer_whose_sender_went_away_is_not_written() {
        let (runtime, _) = counting_runtime();
        let writer = recording();
        let (release, holder) = hold(writer.target().clone());
        runtime.block_on(async {
            drop(writer.write(b"abandoned".to_vec()));
            let kept = writer.write(b"kept".to_vec());
            release.send(()).unwrap();
            assert_eq!(kept.await, Ok(()));
        });
        holder.join().unwrap();
        assert_eq!(*writer.target().lock().unwrap(), vec![b"kept".to_vec()]);
    }
}
