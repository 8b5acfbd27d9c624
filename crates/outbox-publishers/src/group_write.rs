//! Blocking writes (a file, standard output) fed by async senders, one thread at a time.

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

/// How a [`GroupWriter`] writes one buffer into its target.
type WriteFn<T> = dyn Fn(&mut T, &[u8]) -> Result<(), String> + Send + Sync;

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
pub struct GroupWriter<T> {
    target: Arc<Mutex<T>>,
    queue: Arc<Mutex<Queue>>,
    write: Arc<WriteFn<T>>,
}

impl<T> Clone for GroupWriter<T> {
    fn clone(&self) -> Self {
        GroupWriter {
            target: self.target.clone(),
            queue: self.queue.clone(),
            write: self.write.clone(),
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
    // A panic while holding it is reported to the senders (see `StopWriting`); the data is
    // still the best there is.
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
        }
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
            queue.waiting.push(Waiting { buffer, written });
            !std::mem::replace(&mut queue.writing, true)
        };
        if start_writer {
            let writer = self.clone();
            tokio::task::spawn_blocking(move || writer.write_queued());
        }
        async move {
            outcome.await.unwrap_or_else(|_| {
                Err("the writer thread failed (a bug); the batch is retried".to_string())
            })
        }
    }

    /// Buffers queued and not yet taken by a write.
    #[cfg(test)]
    pub fn queued(&self) -> usize {
        lock(&self.queue).waiting.len()
    }

    fn write_queued(&self) {
        let _stop = StopWriting(self);
        loop {
            // The target first, then the queue: what was queued while an earlier write (or a
            // health check) held the target goes out in this one write.
            let mut target = lock(&self.target);
            let taken = {
                let mut queue = lock(&self.queue);
                if queue.waiting.is_empty() {
                    queue.writing = false;
                    return;
                }
                std::mem::take(&mut queue.waiting)
            };
            let outcome = match taken.as_slice() {
                [one] => (self.write)(&mut target, &one.buffer),
                many => {
                    let buffers: Vec<&[u8]> = many.iter().map(|w| w.buffer.as_slice()).collect();
                    (self.write)(&mut target, &buffers.concat())
                }
            };
            drop(target);
            for waiting in taken {
                // A sender that went away (its publish was cancelled at shutdown) needs no
                // answer.
                let _ = waiting.written.send(outcome.clone());
            }
        }
    }
}

/// Should a write panic, its senders hear of it (their channels close as the taken buffers
/// drop), and the buffers queued meanwhile get a new writer rather than wait for one that is
/// gone.
struct StopWriting<'a, T: Send + 'static>(&'a GroupWriter<T>);

impl<T: Send + 'static> Drop for StopWriting<'_, T> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let mut queue = lock(&self.0.queue);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) if !queue.waiting.is_empty() => {
                let writer = self.0.clone();
                runtime.spawn_blocking(move || writer.write_queued());
            }
            // No buffer is queued (the next one starts a writer), or no runtime is left to
            // run one: the queued senders' channels close.
            _ => {
                queue.writing = false;
                queue.waiting.clear();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A runtime with one worker that counts the threads it starts (the blocking pool's too).
    fn counting_runtime() -> (tokio::runtime::Runtime, Arc<AtomicUsize>) {
        let started = Arc::new(AtomicUsize::new(0));
        let count = started.clone();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .on_thread_start(move || {
                count.fetch_add(1, Ordering::SeqCst);
            })
            .enable_all()
            .build()
            .unwrap();
        (runtime, started)
    }

    /// Holds the target's lock on a thread of its own (a slow `fdatasync`) until the returned
    /// sender is used or dropped.
    fn hold(
        target: Arc<Mutex<Vec<Vec<u8>>>>,
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

    #[test]
    fn buffers_waiting_for_a_slow_write_hold_no_thread_and_share_the_next_write() {
        let (runtime, started) = counting_runtime();
        let writer = GroupWriter::new(Vec::<Vec<u8>>::new(), |writes, buffer| {
            writes.push(buffer.to_vec());
            Ok(())
        });
        let (release, holder) = hold(writer.target().clone());
        runtime.block_on(async {
            let before = started.load(Ordering::SeqCst);
            let sends: Vec<_> = (0..50u8)
                .map(|i| tokio::spawn(writer.write(vec![i])))
                .collect();
            // The first buffer's writer waits for the target; every buffer queues meanwhile.
            while writer.queued() < 50 {
                tokio::task::yield_now().await;
            }
            assert!(
                started.load(Ordering::SeqCst) - before <= 1,
                "one writer thread, not one per waiting buffer: {} started",
                started.load(Ordering::SeqCst) - before
            );
            release.send(()).unwrap();
            for send in sends {
                assert_eq!(send.await.unwrap(), Ok(()));
            }
        });
        holder.join().unwrap();
        let writes = writer.target().lock().unwrap().clone();
        assert_eq!(writes.len(), 1, "one write for the 50");
        assert_eq!(
            writes.concat(),
            (0..50u8).collect::<Vec<_>>(),
            "in the order queued"
        );
    }

    #[test]
    fn a_write_that_panics_fails_its_senders_and_the_next_buffer_gets_a_new_writer() {
        let (runtime, _) = counting_runtime();
        let writer = GroupWriter::new((), |_, buffer| {
            assert_ne!(buffer, b"boom", "a writer bug");
            Ok(())
        });
        runtime.block_on(async {
            let failed = writer.write(b"boom".to_vec()).await;
            assert!(failed.unwrap_err().contains("writer thread failed"));
            assert_eq!(writer.write(b"fine".to_vec()).await, Ok(()));
        });
    }
}
