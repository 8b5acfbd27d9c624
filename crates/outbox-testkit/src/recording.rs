//! A publisher that records what it receives and fails on command, for engine tests.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_core::{Event, Outcome, PublishError, PublishErrorKind, Publisher};

#[derive(Default)]
struct State {
    delivered: Vec<Arc<Event>>,
    attempts: Vec<i64>,
    /// Remaining failures to inject per event_type, and what they say.
    failures: HashMap<String, (usize, PublishErrorKind, String)>,
    /// Keys of every batch, to check that a batch never holds a key twice.
    batches: Vec<Vec<String>>,
    /// Takes runs of a key per batch, as a file does ([`RecordingPublisher::storing_a_prefix`]).
    runs: bool,
    /// Events not stored because an earlier event of their key in the batch failed.
    held_back: usize,
}

/// Records every confirmed event in publish order.
#[derive(Clone)]
pub struct RecordingPublisher {
    state: Arc<Mutex<State>>,
    /// Event types whose batches wait before they are answered ([`RecordingPublisher::hold`]).
    held: Arc<tokio::sync::watch::Sender<HashSet<String>>>,
}

impl Default for RecordingPublisher {
    fn default() -> Self {
        RecordingPublisher {
            state: Arc::default(),
            held: Arc::new(tokio::sync::watch::channel(HashSet::new()).0),
        }
    }
}

impl RecordingPublisher {
    pub fn new() -> Self {
        Self::default()
    }

    /// A publisher that takes runs of a key in a batch and keeps the promise of
    /// [`Publisher::max_events_per_key`]: once an event of a key fails, it stores no later
    /// event of that key from the batch (they fail as well).
    pub fn storing_a_prefix() -> Self {
        let publisher = Self::default();
        publisher.state.lock().unwrap().runs = true;
        publisher
    }

    /// Makes the next `times` publishes of `event_type` fail with `kind`.
    pub fn fail(&self, event_type: &str, times: usize, kind: PublishErrorKind) {
        self.fail_saying(event_type, times, kind, "injected failure");
    }

    /// As [`fail`](Self::fail), the error saying `message` (a sink's error can quote what a
    /// broker or receiver answered, whatever bytes that holds).
    pub fn fail_saying(
        &self,
        event_type: &str,
        times: usize,
        kind: PublishErrorKind,
        message: &str,
    ) {
        self.state
            .lock()
            .unwrap()
            .failures
            .insert(event_type.to_string(), (times, kind, message.to_string()));
    }

    /// Holds every batch with an event of `event_type` unanswered (in flight) until
    /// [`release`](Self::release)d; other batches are answered meanwhile. The engine sends
    /// held types apart ([`Publisher::send_group`]), as a router does a slow sink's events.
    pub fn hold(&self, event_type: &str) {
        self.held.send_modify(|held| {
            held.insert(event_type.to_string());
        });
    }

    /// Answers the batches held for `event_type`, and no longer holds any.
    pub fn release(&self, event_type: &str) {
        self.held.send_modify(|held| {
            held.remove(event_type);
        });
    }

    /// Batches held unanswered now.
    pub fn holding(&self) -> usize {
        self.held.receiver_count()
    }

    /// Confirmed events, in the order they were confirmed.
    pub fn delivered(&self) -> Vec<Arc<Event>> {
        self.state.lock().unwrap().delivered.clone()
    }

    /// Every attempt's sequence_id, successful or not.
    pub fn attempts(&self) -> Vec<i64> {
        self.state.lock().unwrap().attempts.clone()
    }

    pub fn batches(&self) -> Vec<Vec<String>> {
        self.state.lock().unwrap().batches.clone()
    }

    /// How many events a run-taking publisher did not store because an earlier event of
    /// their key in the same batch failed: more than none shows a failure fell inside a run.
    pub fn held_back(&self) -> usize {
        self.state.lock().unwrap().held_back
    }
}

impl Publisher for RecordingPublisher {
    fn describe(&self) -> String {
        "recording".into()
    }

    fn publish(&self, batch: Vec<Arc<Event>>) -> BoxFuture<'static, Vec<Outcome>> {
        let types: Vec<String> = batch.iter().map(|e| e.event_type.clone()).collect();
        let held = move |held: &HashSet<String>| types.iter().any(|t| held.contains(t));
        if !held(&self.held.borrow()) {
            let outcomes = self.answer(batch);
            return async move { outcomes }.boxed();
        }
        let mut released = self.held.subscribe();
        let this = self.clone();
        async move {
            let _ = released.wait_for(|h| !held(h)).await;
            drop(released);
            this.answer(batch)
        }
        .boxed()
    }

    /// Held types are a sink of their own, as a slow receiver behind a router is.
    fn has_send_groups(&self) -> bool {
        true
    }

    fn send_group(&self, event: &Event) -> u64 {
        u64::from(self.held.borrow().contains(&event.event_type))
    }

    fn max_events_per_key(&self) -> usize {
        if self.state.lock().unwrap().runs {
            usize::MAX
        } else {
            1
        }
    }

    fn health(&self) -> BoxFuture<'static, Result<(), PublishError>> {
        async { Ok(()) }.boxed()
    }
}

impl RecordingPublisher {
    /// Records `batch` and answers it.
    fn answer(&self, batch: Vec<Arc<Event>>) -> Vec<Outcome> {
        let mut state = self.state.lock().unwrap();
        state
            .batches
            .push(batch.iter().map(|e| e.ordering_key().to_string()).collect());
        let mut failed_keys = std::collections::HashSet::new();
        let outcomes = batch
            .into_iter()
            .map(|event| {
                state.attempts.push(event.sequence_id);
                let key = event.ordering_key().to_string();
                if failed_keys.contains(&key) {
                    state.held_back += 1;
                    return Err(PublishError::new(
                        PublishErrorKind::NotSent,
                        "an earlier event of its key failed",
                    ));
                }
                let runs = state.runs;
                if let Some((left, kind, message)) = state.failures.get_mut(&event.event_type) {
                    if *left > 0 {
                        *left -= 1;
                        if runs {
                            failed_keys.insert(key);
                        }
                        return Err(PublishError::new(*kind, message.clone()));
                    }
                }
                state.delivered.push(event);
                Ok(())
            })
            .collect();
        outcomes
    }
}
