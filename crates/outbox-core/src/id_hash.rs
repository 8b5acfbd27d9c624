//! Maps keyed by [`SequenceId`], for the ones every event passes through several times
//! (the engine's lanes, a capture's holdings), and by a WAL stream position (integers too).
//!
//! The standard map's SipHash costs about as much as the rest of such a lookup, and an
//! event goes through a dozen of them between its read and its settle. A sequence id is
//! one integer, so a finalizer of two multiplications mixes it well enough, whatever its pattern
//! (WAL positions share their low bits). The multiplier's seed is random per map, as the
//! standard map's keys are, so a writer who picks row ids cannot aim them at one bucket.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hasher};

use crate::SequenceId;

/// A map keyed by sequence id, hashed by [`IdHasher`].
pub type IdMap<V> = HashMap<SequenceId, V, BuildIdHasher>;

/// A set of sequence ids, hashed by [`IdHasher`].
pub type IdSet = HashSet<SequenceId, BuildIdHasher>;

/// Makes the [`IdHasher`]s of one map, all with the map's random seed.
#[derive(Clone, Debug)]
pub struct BuildIdHasher {
    seed: u64,
}

impl Default for BuildIdHasher {
    fn default() -> Self {
        // `RandomState` draws its keys from the system's randomness once per thread and
        // steps them for each new state: a fresh seed per map at no system call.
        BuildIdHasher {
            seed: RandomState::new().hash_one(0x6f75_7462_6f78_u64),
        }
    }
}

impl BuildHasher for BuildIdHasher {
    type Hasher = IdHasher;

    fn build_hasher(&self) -> IdHasher {
        IdHasher { state: self.seed }
    }
}

/// Hashes integers with MurmurHash3's 64-bit finalizer over the value mixed with the seed:
/// every input bit reaches every output bit, so the map's bucket (the hash's low bits) and
/// its tag (the top seven) both vary with any bit of the id.
#[derive(Clone, Debug)]
pub struct IdHasher {
    state: u64,
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

impl Hasher for IdHasher {
    fn write_u64(&mut self, n: u64) {
        self.state = mix(self.state ^ n);
    }

    fn write_i64(&mut self, n: i64) {
        self.write_u64(n as u64);
    }

    /// A WAL position's 32-bit transaction id.
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n) ^ (1 << 32));
    }

    /// Any other input, eight bytes at a time.
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word) ^ chunk.len() as u64);
        }
    }

    fn finish(&self) -> u64 {
        self.state
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The map's bucket is the hash's low bits, its tag the top seven: ids that differ only
    /// in bits the hash drops would share both.
    fn spread(ids: impl Iterator<Item = SequenceId>, bits: u32, top: bool) -> usize {
        let build = BuildIdHasher::default();
        let slots: HashSet<u64> = ids
            .map(|id| {
                let hash = build.hash_one(id);
                if top {
                    hash >> (64 - bits)
                } else {
                    hash & ((1 << bits) - 1)
                }
            })
            .collect();
        slots.len()
    }

    #[test]
    fn ids_with_common_low_bits_still_spread_over_buckets_and_tags() {
        // WAL positions 8-byte aligned and 4 KiB apart, row ids, and ids far apart.
        let patterns: [(&str, Vec<SequenceId>); 3] = [
            (
                "aligned",
                (0..4096).map(|i| 0x1_6b00_0000 + i * 4096).collect(),
            ),
            ("sequential", (1..=4096).collect()),
            ("high bits", (0..4096).map(|i| i << 40).collect()),
        ];
        for (name, ids) in patterns {
            // 4,096 ids into 4,096 buckets: a fair hash fills about 63% of them.
            let buckets = spread(ids.iter().copied(), 12, false);
            assert!(buckets > 2400, "{name}: {buckets} of 4096 buckets");
            let tags = spread(ids.iter().copied(), 7, true);
            assert!(tags > 120, "{name}: {tags} of 128 tags");
        }
    }

    #[test]
    fn each_map_draws_its_own_seed() {
        let (a, b) = (BuildIdHasher::default(), BuildIdHasher::default());
        assert_ne!(a.hash_one(1_i64), b.hash_one(1_i64));
    }

    #[test]
    fn a_map_finds_what_it_holds() {
        let mut map: IdMap<i64> = IdMap::default();
        for id in (0..10_000).map(|i| i * 4096) {
            map.insert(id, -id);
        }
        assert!((0..10_000).all(|i| map.get(&(i * 4096)) == Some(&(-i * 4096))));
        assert_eq!(map.get(&1), None);
    }
}
