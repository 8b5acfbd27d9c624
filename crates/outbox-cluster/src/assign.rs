//! Which node should own which partition: every node computes the same answer from the same
//! list of live nodes.
//!
//! Rendezvous hashing with a cap: each partition goes to the node that scores highest for
//! it among nodes that have not reached their fair share (`ceil(partitions / nodes)`).
//! Shares are fair, and when a node joins or leaves only about `1 / nodes` of the
//! partitions move.

use std::collections::BTreeMap;

/// A node's score for a partition is FNV-1a (64 bits: stable across builds and platforms,
/// so nodes running different binaries, a rolling upgrade, still agree) over its name, a
/// separator and the partition, mixed. This is its state after the name and the
/// separator: the part that does not depend on the partition, computed once per node and
/// round.
fn node_state(node: &str) -> u64 {
    node.bytes()
        .chain([0xff])
        .fold(0xcbf2_9ce4_8422_2325, fnv_step)
}

fn fnv_step(hash: u64, byte: u8) -> u64 {
    (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
}

/// The node's score for `partition`, from its [`node_state`].
fn finish(state: u64, partition: i32) -> u64 {
    let mut hash = partition.to_be_bytes().into_iter().fold(state, fnv_step);
    // Mix the low bits so that nearby partitions spread.
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xff51_afd7_ed55_8ccd);
    hash ^ (hash >> 33)
}

/// The partitions each live node should own. Each partition goes to the highest-scoring
/// node below the cap, ties to the first name: one pass over the nodes per partition, with
/// each node's hash state computed once (sorting every node by score, per partition, cost
/// half a second a round at 4,096 partitions and 50 nodes).
pub fn assign(partition_count: u32, nodes: &[String]) -> BTreeMap<String, Vec<i32>> {
    let mut owned: BTreeMap<String, Vec<i32>> =
        nodes.iter().map(|n| (n.clone(), Vec::new())).collect();
    if nodes.is_empty() {
        return owned;
    }
    let cap = (partition_count as usize).div_ceil(nodes.len());
    let states: Vec<u64> = nodes.iter().map(|n| node_state(n)).collect();
    let mut shares: Vec<Vec<i32>> = vec![Vec::new(); nodes.len()];
    for partition in 0..partition_count as i32 {
        let best = (0..nodes.len())
            .filter(|&i| shares[i].len() < cap)
            .max_by(|&a, &b| {
                finish(states[a], partition)
                    .cmp(&finish(states[b], partition))
                    .then_with(|| nodes[b].cmp(&nodes[a]))
            });
        if let Some(i) = best {
            shares[i].push(partition);
        }
    }
    // Node ids are the nodes table's key: each is listed once.
    for (node, share) in nodes.iter().zip(shares) {
        owned.insert(node.clone(), share);
    }
    owned
}

#[cfg(test)]
mod tests {
    use super::*;

    fn score(node: &str, partition: i32) -> u64 {
        finish(node_state(node), partition)
    }

    /// The assignment as first written (every node ranked by score, per partition): the
    /// one-pass form must give every partition the same owner, or nodes of two versions
    /// would disagree during an upgrade.
    fn ranked_assign(partition_count: u32, nodes: &[String]) -> BTreeMap<String, Vec<i32>> {
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

    #[test]
    fn the_one_pass_assignment_gives_every_partition_the_ranked_owner() {
        for (count, n) in [(64, 1), (64, 3), (64, 7), (4096, 10), (100, 33), (7, 9)] {
            let listed: Vec<String> = (0..n).map(|i| format!("host-{i}.pod-{}", i * 7)).collect();
            assert_eq!(
                assign(count, &listed),
                ranked_assign(count, &listed),
                "{count}/{n}"
            );
        }
    }

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
