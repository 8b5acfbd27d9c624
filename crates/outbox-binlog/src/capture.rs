//! The reader, the acknowledgement rule and the seat, together: what a binlog capture store
//! reads through.
//!
//! Contract of [`Capture`]:
//! - Only the active reader of an outbox captures ([`Started::Held`] otherwise).
//! - It reads from the position the seat stored. A seat that never stored one starts at the
//!   server's current position and stores it before reading, in one transaction with the
//!   adoption of the rows already in the table (which the log from there does not carry), so
//!   that whatever is written after the first start is read by every later start, however
//!   soon it crashes, and what was there before is adopted exactly when the position is.
//! - A row holds the stored position back until it is settled; [`Capture::store`] stores
//!   the furthest position the settled rows allow (and renews the seat's lease). A crash
//!   means reading again from there: redelivery, never loss.
//! - [`Capture::next`] is cancel-safe: wrap it in a timeout to call `store` while the log is
//!   quiet, at least every third of the seat's lease.

use crate::seat::{ActiveReader, SeatConfig, Taken};
use crate::{current_position, BinlogConfig, BinlogPosition, BinlogReader, Output, Positions};
use crate::{Result, UnknownRow};

/// The outcome of starting a capture.
#[derive(Debug)]
pub enum Started {
    Active(Box<Capture>),
    /// Another relay is the active reader.
    Held {
        holder: String,
    },
}

/// An active reader's capture of one outbox.
pub struct Capture {
    reader: BinlogReader,
    seat: ActiveReader,
    positions: Positions,
    /// Rows the first start's adoption adopted as dead letters.
    adopted_dead: u64,
}

impl std::fmt::Debug for Capture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capture")
            .field("seat", &self.seat)
            .field("storable", self.positions.storable())
            .finish()
    }
}

impl Capture {
    /// Takes the seat and starts reading where it says, running `adoption` with the first
    /// position stored (see the module's contract).
    pub async fn start(
        binlog: &BinlogConfig,
        seat: &SeatConfig,
        adoption: &[String],
    ) -> Result<Started> {
        let mut seat = match ActiveReader::take(seat).await? {
            Taken::Active(seat) => seat,
            Taken::Held { holder } => return Ok(Started::Held { holder }),
        };
        let mut adopted_dead = 0;
        let resumed = match seat.stored() {
            Some(stored) => resume(stored, seat.stored_server_id(), seat.server_id())?,
            None => {
                let current = current_position(&binlog.url).await?;
                adopted_dead = seat.store_first(&current, adoption).await?;
                Resume::At(current)
            }
        };
        let (reader, from) = match resumed {
            Resume::At(from) => (BinlogReader::start(binlog, &from).await?, from),
            Resume::AfterGtid(gtid) => {
                tracing::info!(
                    %gtid,
                    stored_by = seat.stored_server_id(),
                    server = seat.server_id(),
                    "the stored position is another server's log: going on after its GTID state"
                );
                let reader = BinlogReader::start_after_gtid(binlog, &gtid).await?;
                // Nothing of this server's log is known yet: its first transaction's end is
                // the first place that may be stored.
                let from = BinlogPosition {
                    file: String::new(),
                    offset: 0,
                    gtid: Some(gtid),
                };
                (reader, from)
            }
        };
        Ok(Started::Active(Box::new(Capture {
            reader,
            seat,
            positions: Positions::new(from),
            adopted_dead,
        })))
    }

    /// When the seat's lease runs from, as this start left it ([`ActiveReader::lease_from`]).
    pub fn lease_from(&self) -> std::time::Instant {
        self.seat.lease_from()
    }

    /// How many rows this start's adoption adopted as dead letters (none but at the first
    /// start): the run counts them, as it counts its own.
    pub fn adopted_dead(&self) -> u64 {
        self.adopted_dead
    }

    /// The next output ([`BinlogReader::next`]); each row is unsettled until
    /// [`Capture::settle`] is called with its [`ordinal`](crate::Row::ordinal).
    pub async fn next(&mut self) -> Result<Option<Output>> {
        let output = self.reader.next().await?;
        match &output {
            Some(Output::Row(row)) => self.positions.row(row.ordinal()),
            Some(Output::Committed { next, .. }) => self.positions.committed(next),
            Some(Output::RolledBack { next, .. }) => self.positions.rolled_back(next),
            None => {}
        }
        Ok(output)
    }

    /// Row `ordinal` is settled: delivered, durably parked, or dead-lettered.
    pub fn settle(&mut self, ordinal: u64) -> std::result::Result<(), UnknownRow> {
        self.positions.settle(ordinal)
    }

    /// How far the oldest transaction not stored past got ([`Positions::front`]).
    pub fn front(&self) -> Option<crate::positions::Front> {
        self.positions.front()
    }

    /// The rows (by ordinal) that a reader started at the position [`Capture::store`] would
    /// store now reads none of ([`Positions::behind_storable`]).
    pub fn behind_storable(&self) -> u64 {
        self.positions.behind_storable()
    }

    /// Stores the furthest position the settled rows allow, or renews the seat's lease when
    /// it has not moved. Fails with [`crate::BinlogError::Fenced`] (or a connection error)
    /// once another relay took the seat: this one must stop.
    pub async fn store(&mut self) -> Result<BinlogPosition> {
        if let Some(boundary) = self.reader.boundary() {
            self.positions.passed(&boundary);
        }
        let storable = self.positions.storable().clone();
        // An empty file: started after a GTID, nothing of this server's log stored yet.
        if self.seat.stored() == Some(&storable) || storable.file.is_empty() {
            self.seat.renew().await?;
        } else {
            self.seat.store(&storable).await?;
        }
        Ok(storable)
    }

    /// Where the log has been read to ([`BinlogReader::read_to`]).
    pub fn read_to(&self) -> BinlogPosition {
        self.reader.read_to()
    }

    /// Whether outputs read are still to be handed out ([`BinlogReader::buffered_rows`]):
    /// the rows a transaction held behind a savepoint (or an XA transaction's) go out after
    /// its end was read.
    pub fn handing_out(&self) -> bool {
        self.reader.buffered_rows() > 0
    }

    /// See [`BinlogReader::set_silence`].
    pub fn set_silence(&mut self, silence: std::time::Duration) {
        self.reader.set_silence(silence);
    }

    /// When the server logged the last transaction event read
    /// ([`BinlogReader::logged_at`]).
    pub fn logged_at(&self) -> Option<std::time::SystemTime> {
        self.reader.logged_at()
    }

    /// Whether everything written is read ([`BinlogReader::caught_up`]).
    pub fn caught_up(&self) -> bool {
        self.reader.caught_up()
    }

    /// Whether the server is MariaDB ([`BinlogReader::mariadb`]).
    pub fn mariadb(&self) -> bool {
        self.reader.mariadb()
    }

    /// The epoch the seat was taken at: writes elsewhere fence on it.
    pub fn epoch(&self) -> i64 {
        self.seat.epoch()
    }

    /// Stores what may be stored and gives the seat up.
    pub async fn leave(mut self) -> Result<()> {
        self.store().await?;
        self.seat.leave().await
    }
}

/// How a reader goes on from a stored position.
#[derive(Debug, PartialEq, Eq)]
pub enum Resume {
    /// At the position's file and offset: the server that stored it.
    At(BinlogPosition),
    /// After the position's GTID state: another server (a promoted replica), whose files
    /// and offsets are its own.
    AfterGtid(String),
}

/// Where to go on from `stored`, stored by the server `stored_by` (`None`: stored before
/// the relay kept it, taken as this one), when the server is `server`. A position in
/// another server's log without a GTID state (GTIDs off, or a position stored before the
/// relay kept one) is refused: its file and offset mean nothing here. So is an empty
/// state, which would mean the other server's whole history.
pub fn resume(stored: &BinlogPosition, stored_by: Option<u64>, server: u64) -> Result<Resume> {
    match stored_by {
        Some(by) if by != server => match &stored.gtid {
            Some(gtid) if !gtid.trim().is_empty() => Ok(Resume::AfterGtid(gtid.clone())),
            _ => Err(crate::BinlogError::OtherServer {
                position: stored.clone(),
                stored_by: by,
                server,
            }),
        },
        _ => Ok(Resume::At(stored.clone())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(gtid: Option<&str>) -> BinlogPosition {
        BinlogPosition {
            file: "mariadb-bin.000007".into(),
            offset: 1234,
            gtid: gtid.map(str::to_string),
        }
    }

    #[test]
    fn the_server_that_stored_a_position_goes_on_at_its_file_and_offset() {
        for stored_by in [Some(1), None] {
            assert_eq!(
                resume(&stored(Some("0-1-9")), stored_by, 1).unwrap(),
                Resume::At(stored(Some("0-1-9")))
            );
        }
    }

    #[test]
    fn another_server_goes_on_after_the_gtid_state_or_refuses_without_one() {
        assert_eq!(
            resume(&stored(Some("0-1-9")), Some(1), 2).unwrap(),
            Resume::AfterGtid("0-1-9".into())
        );
        let mysql = "3e11fa47-71ca-11e1-9e33-c80aa9429562:1-77";
        assert_eq!(
            resume(&stored(Some(mysql)), Some(1), 2).unwrap(),
            Resume::AfterGtid(mysql.into())
        );
        for without in [None, Some(""), Some(" ")] {
            let refused = resume(&stored(without), Some(1), 2)
                .unwrap_err()
                .to_string();
            assert!(
                refused.contains("server 1") && refused.contains("server 2"),
                "{refused}"
            );
        }
    }
}
