//! Which node should own which partition: every node computes the same answer from the same
//! list of live nodes.
//!
//! Rendezvous hashing with a cap: each partition goes to the node that scores highest for
//! it among nodes that have not reached their fair share (`ceil(partitions / nodes)`).
//! Shares are fair, and when a node joins or leaves only about `1 / nodes` of the
//! partitions move.

use std::collections::BTreeMap;

/// FNV-1a, 64 bits: stable across builds and platforms, so nodes running different
/// binaries (a rolling upgrade) still agree.
fn score(node: &str, partition: i32) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in node.bytes().chain([0xff]).chain(partition.to_be_bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    // Mix the low bits so that nearby partitions spread.
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xff51_afd7_ed55_8ccd);
    hash ^ (hash >> 33)
}

/// The partitions each live node should own.
pub fn assign(partition_count: u32, nodes: &[String]) -> BTreeMap<String, Vec<i32>> {
    let mut owned: BTreeMap<String, Vec<i32>> =
        nodes.iter().map(|n| (n.clone(), Vec::new())).collect();
    if nodes.is_empty() {
        return owned;
    }
    let cap = (partition_count as usize).div_ceil(nodes.len());
    for partition in 0..partition_count as i32 {
        let mut ranked: Vec<&String> = nodes.iter().collect();
        ranked.sort_by_key(|n| (std::cmp::Reverse(score(n, partition)), (*n).clone()));
        if let Some(node) = ranked.into_iter().find(|n| owned[*n].len() < cap) {
            owned.get_mut(node).expect("listed").push(partition);
        }
    }
    owned
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("node-{i}")).collect()
    }

    #[test]
    fn every_partition_has_exactly_one_owner_and_shares_are_fair() {
        for n in 1..=7 {
            let a = assign(64, &nodes(n));
            let mut all: Vec<i32> = a.values().flatten().copied().collect();
            all.sort();
            assert_eq!(all, (0..64).collect::<Vec<_>>());
            let cap = 64usize.div_ceil(n);
            assert!(
                a.values()
                    .all(|p| p.len() <= cap && p.len() + cap >= 64 / n),
                "{n} nodes: {a:?}"
            );
        }
    }

    #[test]
    fn a_joining_node_moves_few_partitions() {
        let before = assign(64, &nodes(3));
        let after = assign(64, &nodes(4));
        let moved = (0..64)
            .filter(|p| {
                let owner = |a: &BTreeMap<String, Vec<i32>>| {
                    a.iter()
                        .find(|(_, ps)| ps.contains(p))
                        .map(|(n, _)| n.clone())
                };
                owner(&before) != owner(&after)
            })
            .count();
        assert!(
            moved <= 28,
            "{moved} of 64 partitions moved (about 16 is ideal)"
        );
    }

    #[test]
    fn the_answer_does_not_depend_on_list_order() {
        let mut reversed = nodes(5);
        reversed.reverse();
        assert_eq!(assign(64, &nodes(5)), assign(64, &reversed));
    }
}
