//! Metric names (the destination label guard, shared with WAL capture, is in
//! `outbox_core::metric_labels`).

pub const PUBLISHED: &str = "outbox_events_published_total";
pub const RETRIED: &str = "outbox_events_retried_total";
pub use outbox_core::metric_labels::DEAD_LETTERED;
pub const COMMIT_TO_CONFIRM: &str = "outbox_commit_to_confirm_seconds";
pub const CLAIM_BATCH: &str = "outbox_claim_batch_size";
pub const PUBLISH_BATCH: &str = "outbox_publish_batch_size";
pub const IN_FLIGHT: &str = "outbox_in_flight_events";
pub const FENCED: &str = "outbox_fenced_operations_total";
pub const BACKLOG: &str = "outbox_backlog_events";
pub const RETRYING: &str = "outbox_retrying_events";
pub const DEAD: &str = "outbox_dead_letter_events";
pub const OLDEST_AGE: &str = "outbox_oldest_pending_age_seconds";
pub const STORE_ERRORS: &str = "outbox_store_errors_total";
pub const LAST_SUCCESS: &str = "outbox_last_success_timestamp_seconds";
pub const TROUBLES: &str = "outbox_health_problems";

/// Registers descriptions so `/metrics` explains itself.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(PUBLISHED, "Events confirmed by the sink, by destination.");
    describe_counter!(
        RETRIED,
        "Failed publishes scheduled for a retry, by destination."
    );
    describe_counter!(
        DEAD_LETTERED,
        "Events moved to the dead letters, by destination."
    );
    describe_histogram!(
        COMMIT_TO_CONFIRM,
        Unit::Seconds,
        "Time from the event's insert (created_at) to the sink's confirmation."
    );
    describe_histogram!(CLAIM_BATCH, "Rows returned by each claim.");
    describe_histogram!(
        PUBLISH_BATCH,
        "Events handed to the sink in one publish call."
    );
    describe_gauge!(IN_FLIGHT, "Rows this node leases and has not settled.");
    describe_counter!(
        FENCED,
        "Acks or updates refused because this node no longer held the lease."
    );
    describe_gauge!(BACKLOG, "Pending events in the outbox.");
    describe_gauge!(RETRYING, "Pending events that failed at least once.");
    describe_gauge!(DEAD, "Events in the dead letters.");
    describe_gauge!(
        OLDEST_AGE,
        Unit::Seconds,
        "How long the oldest pending event has waited to go out: since it became due (an event scheduled for later has not waited yet), or since its creation once it failed."
    );
    describe_counter!(STORE_ERRORS, "Failed database operations, by operation.");
    describe_gauge!(
        LAST_SUCCESS,
        Unit::Seconds,
        "Unix time of the last success of each check (claim, settle, heartbeat, partition leases, backlog, publish); alert on time() minus this."
    );
    describe_gauge!(
        TROUBLES,
        "Problems /readyz reports right now (failing checks, database waits past 10 s, assigned partitions not held)."
    );
}
