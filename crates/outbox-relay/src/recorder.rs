//! The metrics recorder: Prometheus, with each outbox's name as a label.
//!
//! The threads of an `[[outboxes]]` entry's runtime carry the outbox's name
//! ([`label_thread`]), so every metric recorded on them, by the engine, the stores, the sinks
//! or the console, gets an `outbox` label without any of them knowing.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Duration;

use metrics::{
    Counter, Gauge, Histogram, Key, KeyName, Label, Metadata, Recorder, SharedString, Unit,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Installs the process's recorder; the handle renders `/metrics`.
pub fn install() -> anyhow::Result<PrometheusHandle> {
    let latency = [
        0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ];
    let sizes = [
        1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 5000.0,
    ];
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(outbox_engine::metrics::COMMIT_TO_CONFIRM.into()),
            &latency,
        )?
        .set_buckets_for_metric(Matcher::Suffix("_batch_size".into()), &sizes)?
        .build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(OutboxLabel(recorder))
        .map_err(|e| anyhow::anyhow!("installing the metrics recorder: {e}"))?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(Duration::from_secs(5));
        loop {
            ticker.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

thread_local! {
    /// The outbox whose runtime this thread belongs to.
    static OUTBOX: RefCell<Option<Arc<str>>> = const { RefCell::new(None) };
}

/// The metrics label naming an outbox.
pub const OUTBOX_LABEL: &str = "outbox";

/// A recorder that adds `outbox="NAME"` to every metric registered on a thread of that
/// outbox's runtime. Threads of no outbox (the single-outbox relay) record as they are.
pub struct OutboxLabel<R>(pub R);

fn with_outbox_label(key: &Key) -> Option<Key> {
    OUTBOX.with(|outbox| {
        outbox
            .borrow()
            .as_ref()
            .map(|name| key.with_extra_labels(vec![Label::new(OUTBOX_LABEL, name.to_string())]))
    })
}

impl<R: Recorder> Recorder for OutboxLabel<R> {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.0.describe_counter(key, unit, description)
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.0.describe_gauge(key, unit, description)
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.0.describe_histogram(key, unit, description)
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        match with_outbox_label(key) {
            Some(key) => self.0.register_counter(&key, metadata),
            None => self.0.register_counter(key, metadata),
        }
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        match with_outbox_label(key) {
            Some(key) => self.0.register_gauge(&key, metadata),
            None => self.0.register_gauge(key, metadata),
        }
    }

    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        match with_outbox_label(key) {
            Some(key) => self.0.register_histogram(&key, metadata),
            None => self.0.register_histogram(key, metadata),
        }
    }
}

/// Runs `f` with this thread's metrics labelled as outbox `name` (for the few metrics the
/// shared HTTP server records on an outbox's behalf).
pub fn labelled<T>(name: &str, f: impl FnOnce() -> T) -> T {
    let before = OUTBOX.with(|o| o.replace(Some(Arc::from(name))));
    let result = f();
    OUTBOX.with(|o| *o.borrow_mut() = before);
    result
}

/// Labels every metric recorded on this thread from now on as outbox `name`.
pub fn label_thread(name: Arc<str>) {
    OUTBOX.with(|o| *o.borrow_mut() = Some(name));
}
