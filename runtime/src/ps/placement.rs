//! Which server owns which shard: rendezvous (highest-random-weight)
//! hashing, so every process that knows the set of servers computes the
//! same owners without asking anyone, and a server added or removed moves
//! only the shards it takes or gives up (about 1/N of them).

use super::table::{SHARDS, mix};

/// The owners of every shard among `servers` (their ids), by shard.
pub fn owners(servers: &[u64]) -> Vec<u64> {
    (0..SHARDS).map(|shard| owner(servers, shard)).collect()
}

/// The server among `servers` that owns `shard` (`servers` must not be empty).
pub fn owner(servers: &[u64], shard: u32) -> u64 {
    ranked(servers, shard)[0]
}

/// `servers` in the order they hold `shard`: its owner first, then the
/// server that takes it over if the owner goes (a replica's place).
pub fn ranked(servers: &[u64], shard: u32) -> Vec<u64> {
    assert!(!servers.is_empty(), "a shard needs a server");
    let mut by: Vec<(u64, u64)> = servers.iter().map(|&s| (weight(s, shard), s)).collect();
    by.sort_unstable_by(|a, b| b.cmp(a));
    by.into_iter().map(|(_, s)| s).collect()
}

fn weight(server: u64, shard: u32) -> u64 {
    mix(mix(server) ^ shard as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_spread_evenly_and_a_new_server_takes_only_its_share() {
        let three = owners(&[1, 2, 3]);
        for s in [1, 2, 3] {
            let n = three.iter().filter(|&&o| o == s).count();
            assert!((260..425).contains(&n), "server {s}: {n} of {SHARDS}");
        }
        let four = owners(&[1, 2, 3, 4]);
        let moved: Vec<usize> = (0..SHARDS as usize).filter(|&i| three[i] != four[i]).collect();
        assert!(moved.iter().all(|&i| four[i] == 4), "a shard moved between old servers");
        assert!((180..340).contains(&moved.len()), "{} moved", moved.len());
        // Removing it again gives every shard back to where it was.
        assert_eq!(owners(&[3, 1, 2]), three, "the order servers are listed in does not matter");
    }

    #[test]
    fn the_next_in_rank_is_the_owner_once_the_first_is_gone() {
        for shard in 0..64 {
            let r = ranked(&[10, 20, 30], shard);
            let rest: Vec<u64> = [10, 20, 30].into_iter().filter(|&s| s != r[0]).collect();
            assert_eq!(owner(&rest, shard), r[1]);
        }
    }
}
