//! Partitions: how ordering keys are spread over cluster nodes.
//!
//! A key's partition is the first four bytes of its MD5 digest as a big-endian integer,
//! sign bit cleared, modulo the partition count. The PostgreSQL store computes the same
//! value in SQL (`('x' || substr(md5(key), 1, 8))::bit(32)::int & 2147483647) % n`), and a
//! test holds the two to each other.

use md5::{Digest, Md5};

/// Partitions in a new outbox: enough to spread over dozens of nodes, few enough that each
/// node's lease renewal is one small statement.
pub const DEFAULT_PARTITIONS: u32 = 64;

pub fn partition_of(key: &str, count: u32) -> i32 {
    let digest = Md5::digest(key.as_bytes());
    let head = u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]) & 0x7fff_ffff;
    (head % count.max(1)) as i32
}

/// The partitions a node holds, each with the fencing epoch of its lease. Stores apply
/// acks, retries and dead-letters only to rows of partitions the node still holds at these
/// epochs, so a node that lost a partition cannot settle its rows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fence {
    /// The partition count of the outbox.
    pub count: u32,
    pub partitions: Vec<i32>,
    pub epochs: Vec<i64>,
}

impl Fence {
    pub fn holds(&self, partition: i32) -> bool {
        self.partitions.contains(&partition)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_are_stable_and_in_range() {
        assert_eq!(
            partition_of("customer-1", 64),
            partition_of("customer-1", 64)
        );
        for i in 0..1000 {
            let p = partition_of(&format!("k{i}"), 7);
            assert!((0..7).contains(&p));
        }
        // md5("") = d41d8cd9...: 0xd41d8cd9 & 0x7fffffff = 1411222745.
        assert_eq!(
            partition_of("", 1_000_000_007),
            1_411_222_745 % 1_000_000_007
        );
    }
}
