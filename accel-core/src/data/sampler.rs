//! Which sample indices make each batch of an epoch.

use crate::rng::SplitMix64;

/// The batches of one epoch: a permutation of `0..len` seeded by `seed + epoch`
/// when shuffling (Accelerate's `SeedableRandomSampler` derives its generator
/// the same way, so every rank draws the same order), cut into `batch_size`
/// pieces; the short last one is dropped with `drop_last`.
pub fn batch_indices(
    len: usize,
    batch_size: usize,
    shuffle: bool,
    seed: u64,
    epoch: u64,
    drop_last: bool,
) -> Vec<Vec<usize>> {
    let order: Vec<usize> = if shuffle {
        SplitMix64::new(seed.wrapping_add(epoch)).permutation(len)
    } else {
        (0..len).collect()
    };
    let bs = batch_size.max(1);
    order
        .chunks(bs)
        .filter(|c| !drop_last || c.len() == bs)
        .map(|c| c.to_vec())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_batches_keep_order_and_the_short_tail() {
        let b = batch_indices(7, 3, false, 0, 0, false);
        assert_eq!(b, vec![vec![0, 1, 2], vec![3, 4, 5], vec![6]]);
        assert_eq!(batch_indices(7, 3, false, 0, 0, true).len(), 2);
    }

    #[test]
    fn shuffled_epochs_differ_but_replay_exactly() {
        let e0 = batch_indices(50, 8, true, 42, 0, false);
        assert_eq!(e0, batch_indices(50, 8, true, 42, 0, false));
        assert_ne!(e0, batch_indices(50, 8, true, 42, 1, false));
        let mut all: Vec<usize> = e0.concat();
        all.sort_unstable();
        assert_eq!(all, (0..50).collect::<Vec<_>>());
    }
}
