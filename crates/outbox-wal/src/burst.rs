//! How the reader cuts the stream into bursts: each burst goes to the engine as one item,
//! and one item is one wake-up, one claim and one publish. A burst cut too small makes the
//! relay pay that round per event; one held too long delays what it carries.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::FutureExt;

use crate::assemble::Output;
use crate::budget::{output_bytes, Charge, MemoryBudget};
use crate::client::{WalError, WalStream};

/// The most outputs the reader hands over in one item.
pub(crate) const READ_BURST: usize = 1024;

/// How long ago the transactions a burst carries must have committed before the reader
/// waits for a fuller burst, and how long it waits (once per burst). The age is the signal
/// because pgoutput gives no server WAL end while streaming: its XLogData header carries the
/// record's own position (or 0) there. A relay clock ahead of the server's by more than this
/// costs at most one wait per burst.
const LINGER_WHEN_LAGGING: Duration = Duration::from_millis(20);
const READ_LINGER: Duration = Duration::from_millis(1);

/// How long, from a burst's first message, the reader waits for the rest of a transaction
/// it has begun before it hands over what it has. pgoutput sends a transaction only once it
/// has committed, all of it at once, so the rest is on its way: without this wait a reader
/// quicker than the replication client cut a transaction of ten events into ten bursts, and
/// at 10,000 events/s the relay fell behind doing a claim and a publish per event. The bound
/// is for a walsender that sends slowly mid-transaction (one decoding a large transaction
/// spilled to disk): however slowly messages come, a burst waits for them this long at most
/// (and [`READ_LINGER`] more when lagging).
const REST_OF_TRANSACTION: Duration = Duration::from_millis(5);

/// How long after a burst is handed over the next one may start, under a steady stream.
/// Each burst costs a wake-up, a claim, a publish and a settle whatever it carries: at
/// 10,000 events/s in 10-event transactions the reader otherwise cut a burst every half a
/// millisecond or so, and the relay spent more CPU per event than `pg_recvlogical` reading
/// the same slot. What comes meanwhile waits in the socket: this long, as tokio's timer
/// rounds it, which is about 2 ms in practice (it rounds the deadline up to its next
/// millisecond tick, then sleeps whole milliseconds from the start of the current one;
/// BENCHMARKS.md, "What a burst costs"). That wait is most of the relay's latency over
/// `pg_recvlogical`'s; a shorter one costs CPU in more bursts. A burst's worth of bytes
/// waiting in the socket ends the wait sooner ([`WalStream::next_not_before`]). A stream
/// that was quiet this long since the last burst is read at once, so a lone transaction
/// waits for nothing.
pub(crate) const BURST_PACE: Duration = Duration::from_millis(1);

/// When the reader may start its next burst: [`BURST_PACE`] after the last one was handed
/// over, unless that one was cut by being behind the server (full, or the memory budget
/// full): reading on at once then keeps the backlog moving through this process's budget
/// instead of waiting in the server's WAL. Pure state, so the rule is tested without a
/// stream.
#[derive(Debug, Default)]
pub(crate) struct BurstPace {
    not_before: Option<tokio::time::Instant>,
}

impl BurstPace {
    /// A burst was handed over at `now`; `behind`: it ended full, or with the memory
    /// budget full, not because the stream had nothing more ready.
    pub(crate) fn handed_over(&mut self, behind: bool, now: tokio::time::Instant) {
        self.not_before = (!behind).then(|| now + BURST_PACE);
    }

    /// The instant before which the next burst must not start, if it is still ahead.
    pub(crate) fn wait_until(&self, now: tokio::time::Instant) -> Option<tokio::time::Instant> {
        self.not_before.filter(|at| *at > now)
    }
}

/// What a burst is read from: the replication stream, or a test's script.
pub(crate) trait OutputSource {
    /// The next output; `Ok(None)` when the stream ended. Dropping the future before it is
    /// ready loses nothing.
    fn next_output(&mut self) -> impl Future<Output = Result<Option<Output>, WalError>> + Send;
}

impl OutputSource for WalStream {
    fn next_output(&mut self) -> impl Future<Output = Result<Option<Output>, WalError>> + Send {
        self.next()
    }
}

/// An output and the memory it holds ([`crate::budget`]) until capture lets go of it.
pub(crate) struct ChargedOutput {
    pub(crate) output: Output,
    pub(crate) memory: Charge,
}

impl ChargedOutput {
    fn new(output: Output, memory: &Arc<MemoryBudget>) -> Self {
        let memory = memory.charge(output_bytes(&output));
        ChargedOutput { output, memory }
    }
}

/// Why a burst ended, besides being full or having nothing more ready.
pub(crate) enum BurstEnd {
    /// Nothing more is ready now (or the burst is full): read on.
    More,
    /// The server ended the stream.
    Ended,
    Failed(WalError),
}

/// Reads one burst, starting with `first`: everything the stream has ready, the rest of a
/// transaction it has begun (until [`REST_OF_TRANSACTION`] after `first`), and, when the
/// burst's transactions committed long ago, one short wait for more. At most
/// [`READ_BURST`] outputs, and none once `memory` is full: each output is charged to it as
/// it is read.
pub(crate) async fn read_burst(
    stream: &mut impl OutputSource,
    first: Output,
    memory: &Arc<MemoryBudget>,
) -> (Vec<ChargedOutput>, BurstEnd) {
    let rest_until = tokio::time::Instant::now() + REST_OF_TRANSACTION;
    let mut burst = vec![ChargedOutput::new(first, memory)];
    let mut lingered = false;
    while burst.len() < READ_BURST && memory.room() > 0 {
        let mut next = stream.next_output().now_or_never();
        if next.is_none() && mid_transaction(&burst) {
            next = tokio::time::timeout_at(rest_until, stream.next_output())
                .await
                .ok();
        }
        // Behind the writers, one short wait lets the client read on without a wake-up per
        // message, for a fuller burst; caught up, nothing waits.
        if next.is_none() && !lingered && lagging(&burst) {
            lingered = true;
            tokio::time::sleep(READ_LINGER).await;
            next = stream.next_output().now_or_never();
        }
        match next {
            None => break,
            Some(Ok(Some(output))) => burst.push(ChargedOutput::new(output, memory)),
            Some(Ok(None)) => return (burst, BurstEnd::Ended),
            Some(Err(e)) => return (burst, BurstEnd::Failed(e)),
        }
    }
    (burst, BurstEnd::More)
}

/// The burst ends inside a transaction: its last output is one of the transaction's events.
fn mid_transaction(burst: &[ChargedOutput]) -> bool {
    matches!(
        burst.last(),
        Some(ChargedOutput {
            output: Output::Event { .. },
            ..
        })
    )
}

/// Whether the last transaction in `burst` committed more than [`LINGER_WHEN_LAGGING`] ago.
fn lagging(burst: &[ChargedOutput]) -> bool {
    commit_age(burst.iter().rev().map(|c| &c.output)).is_some_and(|age| age > LINGER_WHEN_LAGGING)
}

/// How long ago the first transaction of `outputs` committed.
pub(crate) fn commit_age<'a>(outputs: impl IntoIterator<Item = &'a Output>) -> Option<Duration> {
    let committed = outputs.into_iter().find_map(|output| match output {
        Output::Committed { commit_time, .. } => Some(*commit_time),
        _ => None,
    })?;
    SystemTime::now().duration_since(committed).ok()
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;
    use crate::event::{EventPosition, EventSource, Undecodable};
    use crate::lsn::Lsn;

    fn committed(ago: Duration) -> Output {
        Output::Committed {
            commit_lsn: Lsn(1),
            end_lsn: Lsn(2),
            events: 1,
            commit_time: SystemTime::now() - ago,
        }
    }

    fn uncharged(outputs: Vec<Output>) -> Vec<ChargedOutput> {
        outputs
            .into_iter()
            .map(|output| ChargedOutput {
                output,
                memory: Charge::none(),
            })
            .collect()
    }

    fn unbounded() -> Arc<MemoryBudget> {
        MemoryBudget::new(usize::MAX)
    }

    fn event(n: u64) -> Output {
        Output::Event {
            position: EventPosition {
                commit_lsn: Lsn(100),
                ordinal: n,
                xid: 0,
            },
            event: Err(Box::new(Undecodable {
                reason: "a test's".into(),
                source: EventSource::Message { lsn: Lsn(100 + n) },
                event_id: None,
                destination: None,
                partition_key: None,
                raw: String::new(),
            })),
        }
    }

    /// A stream whose outputs come as the replication client's do: none is ready when the
    /// reader asks without waiting. With no `pace`, each comes on the next poll (a moment
    /// later, no timer); with one, `pace` after it is first asked for. A future dropped
    /// before then loses nothing, as the trait asks.
    struct Trickle {
        outputs: VecDeque<Output>,
        pace: Option<Duration>,
        due: Option<tokio::time::Instant>,
    }

    impl OutputSource for Trickle {
        async fn next_output(&mut self) -> Result<Option<Output>, WalError> {
            match self.pace {
                None => tokio::task::yield_now().await,
                Some(pace) => {
                    let due = *self
                        .due
                        .get_or_insert_with(|| tokio::time::Instant::now() + pace);
                    tokio::time::sleep_until(due).await;
                    self.due = None;
                }
            }
            Ok(self.outputs.pop_front())
        }
    }

    #[test]
    fn a_burst_waits_the_pace_after_one_that_caught_up_and_none_after_one_behind() {
        let start = tokio::time::Instant::now();
        let mut pace = BurstPace::default();
        assert_eq!(
            pace.wait_until(start),
            None,
            "the first burst starts at once"
        );
        pace.handed_over(false, start);
        assert_eq!(pace.wait_until(start), Some(start + BURST_PACE));
        let later = start + BURST_PACE / 2;
        assert_eq!(pace.wait_until(later), Some(start + BURST_PACE));
        assert_eq!(
            pace.wait_until(start + BURST_PACE),
            None,
            "a stream quiet for the pace is read at once"
        );
        pace.handed_over(true, later);
        assert_eq!(
            pace.wait_until(later),
            None,
            "behind the server (a full burst, or the budget full), the next is read at once"
        );
    }

    #[test]
    fn a_burst_is_lagging_when_its_last_transaction_committed_over_20_ms_ago() {
        let lagging = |outputs: Vec<Output>| lagging(&uncharged(outputs));
        assert!(lagging(vec![committed(Duration::from_millis(50))]));
        assert!(!lagging(vec![committed(Duration::ZERO)]));
        assert!(
            !lagging(vec![
                committed(Duration::from_secs(1)),
                committed(Duration::ZERO)
            ]),
            "the last transaction counts"
        );
        assert!(!lagging(vec![]), "nothing committed yet says nothing");
    }

    #[tokio::test(start_paused = true)]
    async fn a_transaction_whose_messages_trickle_in_is_one_burst() {
        let rest: VecDeque<Output> = (1..10)
            .map(event)
            .chain([committed(Duration::ZERO), event(0)])
            .collect();
        let mut stream = Trickle {
            outputs: rest,
            pace: None,
            due: None,
        };
        let (burst, end) = read_burst(&mut stream, event(0), &unbounded()).await;
        assert!(matches!(end, BurstEnd::More));
        assert_eq!(burst.len(), 11, "ten events and their commit, in one burst");
        assert!(matches!(
            burst.last().map(|c| &c.output),
            Some(Output::Committed { .. })
        ));
        assert_eq!(
            stream.outputs.len(),
            1,
            "caught up after a commit, the reader does not wait for the next transaction"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_transaction_that_comes_slowly_is_handed_over_in_parts() {
        // 2 ms a message: each within the wait, but the whole transaction far beyond it.
        let mut stream = Trickle {
            outputs: (1..100).map(event).collect(),
            pace: Some(Duration::from_millis(2)),
            due: None,
        };
        let (burst, end) = read_burst(&mut stream, event(0), &unbounded()).await;
        assert!(matches!(end, BurstEnd::More));
        assert_eq!(
            burst.len(),
            3,
            "the messages of the first 5 ms (at 0, 2 and 4 ms), not 2 ms per message for all"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_transaction_that_stalls_goes_over_with_what_has_come() {
        struct Stalled;
        impl OutputSource for Stalled {
            fn next_output(
                &mut self,
            ) -> impl Future<Output = Result<Option<Output>, WalError>> + Send {
                futures::future::pending()
            }
        }
        let mut stream = Stalled;
        let memory = unbounded();
        let read = read_burst(&mut stream, event(0), &memory);
        let (burst, end) = tokio::time::timeout(Duration::from_secs(1), read)
            .await
            .expect("a stalled transaction is handed over, not waited for");
        assert!(matches!(end, BurstEnd::More));
        assert_eq!(burst.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_that_ends_mid_burst_hands_over_what_it_read_and_says_so() {
        let mut stream = Trickle {
            outputs: VecDeque::from([event(1)]),
            pace: None,
            due: None,
        };
        let (burst, end) = read_burst(&mut stream, event(0), &unbounded()).await;
        assert_eq!(burst.len(), 2);
        assert!(matches!(end, BurstEnd::Ended));
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_ends_once_the_memory_budget_is_full_and_charges_what_it_read() {
        let mut stream = Trickle {
            outputs: (1..100).map(event).collect(),
            pace: None,
            due: None,
        };
        let each = output_bytes(&event(0));
        let memory = MemoryBudget::new(each * 3);
        let (burst, end) = read_burst(&mut stream, event(0), &memory).await;
        assert!(matches!(end, BurstEnd::More));
        assert_eq!(burst.len(), 3, "mid-transaction, but the budget is full");
        assert_eq!(memory.held(), each * 3);
        drop(burst);
        assert_eq!(memory.held(), 0, "dropping the burst gives its bytes back");
    }
}
