//! WAL capture's memory budget ([`outbox_core::memory`]) and what its outputs cost in it.

pub use outbox_core::memory::{event_bytes, Charge, MemoryBudget, EVENT_OVERHEAD};

use crate::assemble::Output;

/// What WAL capture holds by default: events read ahead of the engine and events in flight
/// together. 32 MiB is some 100,000 events of a typical few hundred bytes, more than the
/// engine keeps in flight (10,000), so small events never wait for it; 32 events of 1 MiB.
pub const DEFAULT_MEMORY_BUDGET: usize = crate::settings::DEFAULT_MEMORY_MIB as usize * 1024 * 1024;

/// What one output costs while capture holds it: an event's payload, strings and headers
/// and a fixed overhead; nothing for a marker.
pub fn output_bytes(output: &Output) -> usize {
    match output {
        Output::Event {
            event: Ok(event), ..
        } => event_bytes(&event.event),
        Output::Event {
            event: Err(undecodable),
            ..
        } => {
            EVENT_OVERHEAD
                + undecodable.raw.len()
                + undecodable.reason.len()
                + undecodable.destination.as_ref().map_or(0, String::len)
                + undecodable.partition_key.as_ref().map_or(0, String::len)
        }
        Output::Committed { .. } | Output::Idle { .. } | Output::Skipped { .. } => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marker_costs_nothing() {
        let idle = Output::Idle {
            wal_end: crate::lsn::Lsn(1),
        };
        assert_eq!(output_bytes(&idle), 0);
    }
}
