//! The data loader: batches of a [`Dataset`] in a seedable order, with a saved
//! position so a run resumes mid-epoch on the very next batch.

use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use super::prefetch::Prefetch;
use super::shard::{remainder, shard_batches, sharded_len, ShardConfig};
use super::{batch_indices, Dataset};
use crate::accumulation::GradientState;
use crate::{Error, Result};

/// How batches are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DataLoaderConfig {
    /// Samples per batch.
    pub batch_size: usize,
    /// Reshuffle every epoch.
    pub shuffle: bool,
    /// Drop the last batch when it is short.
    pub drop_last: bool,
    /// Seed of the shuffle; `None` takes the Accelerator's seed at prepare time.
    pub seed: Option<u64>,
    /// Background threads preparing batches ahead of the loop (PyTorch's
    /// `num_workers`); 0 makes each batch when the loop asks for it.
    #[serde(default)]
    pub num_workers: usize,
    /// Batches each worker keeps ready (PyTorch's `prefetch_factor`).
    #[serde(default = "two")]
    pub prefetch_factor: usize,
}

fn two() -> usize {
    2
}

impl DataLoaderConfig {
    /// `batch_size` samples per batch, in order, keeping the short last batch.
    pub fn new(batch_size: usize) -> Self {
        Self {
            batch_size,
            shuffle: false,
            drop_last: false,
            seed: None,
            num_workers: 0,
            prefetch_factor: 2,
        }
    }

    /// Prepares batches on `workers` background threads, each `prefetch`
    /// batches ahead (the batches and their order do not change).
    pub fn with_workers(mut self, workers: usize, prefetch: usize) -> Self {
        self.num_workers = workers;
        self.prefetch_factor = prefetch;
        self
    }

    /// Reshuffles every epoch.
    pub fn with_shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// Drops a short last batch.
    pub fn with_drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Fixes the shuffle seed.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }
}

/// Where a loader is: the epoch, and how many of its batches were handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LoaderPosition {
    /// Passes completed (Accelerate's `iteration`, the sampler's epoch).
    pub epoch: u64,
    /// Batches of the current epoch already yielded.
    pub batch: usize,
    /// The shuffle seed.
    pub seed: u64,
}

/// Batches of a dataset, in a seedable order that every epoch reshuffles.
///
/// Prepared by the Accelerator, it marks the last batch of each pass (so
/// gradient accumulation syncs there) and its position is saved by
/// `save_state`, so after `load_state` iteration resumes at the next batch.
pub struct DataLoader<D: Dataset> {
    dataset: Arc<D>,
    config: DataLoaderConfig,
    position: Arc<Mutex<LoaderPosition>>,
    grad_state: Option<GradientState>,
    shard: ShardConfig,
}

impl<D: Dataset> DataLoader<D> {
    /// A loader over `dataset`.
    pub fn new(dataset: D, config: DataLoaderConfig) -> Self {
        let position = LoaderPosition {
            seed: config.seed.unwrap_or(0),
            ..Default::default()
        };
        Self {
            dataset: Arc::new(dataset),
            config,
            position: Arc::new(Mutex::new(position)),
            grad_state: None,
            shard: ShardConfig::default(),
        }
    }

    /// Hands this loader to the Accelerator: its gradient state, the seed
    /// when none was set, and which share of each epoch this process draws.
    pub(crate) fn attach(
        &mut self,
        grad_state: GradientState,
        default_seed: u64,
        shard: ShardConfig,
    ) -> Arc<Mutex<LoaderPosition>> {
        if self.config.seed.is_none() {
            self.lock().seed = default_seed;
        }
        self.grad_state = Some(grad_state);
        self.shard = shard;
        self.position.clone()
    }

    fn lock(&self) -> MutexGuard<'_, LoaderPosition> {
        self.position.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The dataset.
    pub fn dataset(&self) -> &D {
        &self.dataset
    }

    /// The settings.
    pub fn config(&self) -> &DataLoaderConfig {
        &self.config
    }

    /// Batches per epoch for this process.
    pub fn len(&self) -> usize {
        let (n, bs) = (self.dataset.len(), self.config.batch_size.max(1));
        let global = if self.config.drop_last {
            n / bs
        } else {
            n.div_ceil(bs)
        };
        if self.shard.num_processes == 1 {
            return global;
        }
        sharded_len(global, bs, self.config.drop_last, &self.shard).unwrap_or(0)
    }

    /// True when an epoch has no batch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Completed passes; the next `iter` draws this epoch's order.
    pub fn epoch(&self) -> u64 {
        self.lock().epoch
    }

    /// The current position.
    pub fn position(&self) -> LoaderPosition {
        *self.lock()
    }

    /// Moves to the start of `epoch`.
    pub fn set_epoch(&mut self, epoch: u64) {
        let mut p = self.lock();
        p.epoch = epoch;
        p.batch = 0;
    }

    /// Skips the first `n` batches of the current epoch (Accelerate's
    /// `skip_first_batches`, for resuming from a step count).
    pub fn skip_first_batches(&mut self, n: usize) {
        self.lock().batch = n;
    }

    /// Iterates over the rest of the current epoch; when it is exhausted the
    /// loader moves to the next epoch.
    pub fn iter(&self) -> LoaderIter<'_, D> {
        let p = *self.lock();
        let c = &self.config;
        let global = batch_indices(
            self.dataset.len(),
            c.batch_size,
            c.shuffle,
            p.seed,
            p.epoch,
            c.drop_last,
        );
        // Every process draws the same global order (same seed) and keeps its share.
        let (batches, error) = if self.shard.num_processes == 1 {
            (global, None)
        } else {
            match shard_batches(&global, c.batch_size, c.drop_last, &self.shard) {
                Ok(b) => (b, None),
                Err(e) => (vec![], Some(e)),
            }
        };
        if let Some(g) = &self.grad_state {
            g.enter_dataloader();
            let rem = remainder(self.dataset.len(), c.batch_size, c.drop_last, &self.shard);
            g.set_remainder(rem.unwrap_or(0));
        }
        LoaderIter {
            loader: self,
            batches: Arc::new(batches),
            next: p.batch,
            done: false,
            error,
            prefetch: None,
        }
    }
}

impl<'a, D: Dataset> IntoIterator for &'a DataLoader<D> {
    type Item = Result<D::Batch>;
    type IntoIter = LoaderIter<'a, D>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// Iterator over the batches of one epoch.
pub struct LoaderIter<'a, D: Dataset> {
    loader: &'a DataLoader<D>,
    batches: Arc<Vec<Vec<usize>>>,
    next: usize,
    done: bool,
    error: Option<Error>,
    /// The workers, started at the first batch when `num_workers > 0`.
    prefetch: Option<Prefetch<D::Batch>>,
}

impl<D: Dataset> Iterator for LoaderIter<'_, D> {
    type Item = Result<D::Batch>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        if let Some(e) = self.error.take() {
            self.done = true;
            return Some(Err(e));
        }
        if self.next >= self.batches.len() {
            self.done = true;
            let mut p = self.loader.lock();
            p.epoch += 1;
            p.batch = 0;
            return None;
        }
        let i = self.next;
        self.next += 1;
        self.loader.lock().batch = self.next;
        if let Some(g) = &self.loader.grad_state {
            g.mark_end_of_dataloader(self.next == self.batches.len());
        }
        let workers = self.loader.config.num_workers;
        if workers == 0 {
            return Some(self.loader.dataset.get_batch(&self.batches[i]));
        }
        let depth = self.loader.config.prefetch_factor;
        let (dataset, batches) = (&self.loader.dataset, &self.batches);
        let prefetch = self.prefetch.get_or_insert_with(|| {
            Prefetch::start(dataset.clone(), batches.clone(), i, (workers, depth))
        });
        Some(prefetch.next())
    }
}

impl<D: Dataset> Drop for LoaderIter<'_, D> {
    fn drop(&mut self) {
        if let Some(g) = &self.loader.grad_state {
            g.leave_dataloader();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::TensorDataset;
    use candle_core::{Device, Tensor};

    fn loader(n: u32, bs: usize) -> DataLoader<TensorDataset> {
        let x = Tensor::arange(0u32, n, &Device::Cpu).unwrap();
        DataLoader::new(
            TensorDataset::new(vec![x]).unwrap(),
            DataLoaderConfig::new(bs),
        )
    }

    fn ids(b: Result<Vec<Tensor>>) -> Vec<u32> {
        b.unwrap()[0].to_vec1().unwrap()
    }

    #[test]
    fn an_exhausted_pass_moves_to_the_next_epoch() {
        let l = loader(5, 2);
        let got: Vec<Vec<u32>> = l.iter().map(ids).collect();
        assert_eq!(got, vec![vec![0, 1], vec![2, 3], vec![4]]);
        assert_eq!(l.epoch(), 1);
        assert_eq!(l.position().batch, 0);
    }

    #[test]
    fn a_pass_broken_off_resumes_at_the_next_batch() {
        let l = loader(6, 2);
        let first = l.iter().next().map(ids).unwrap();
        assert_eq!(first, vec![0, 1]);
        let rest: Vec<Vec<u32>> = l.iter().map(ids).collect();
        assert_eq!(rest, vec![vec![2, 3], vec![4, 5]]);
    }

    #[test]
    fn skip_first_batches_skips_within_the_epoch() {
        let mut l = loader(6, 2);
        l.skip_first_batches(2);
        let rest: Vec<Vec<u32>> = l.iter().map(ids).collect();
        assert_eq!(rest, vec![vec![4, 5]]);
    }

    #[test]
    fn workers_give_the_same_batches_in_the_same_order_and_resume_mid_pass() {
        let x = Tensor::arange(0u32, 23, &Device::Cpu).unwrap();
        let make = |workers: usize| {
            DataLoader::new(
                TensorDataset::new(vec![x.clone()]).unwrap(),
                DataLoaderConfig::new(3)
                    .with_shuffle(true)
                    .with_seed(5)
                    .with_workers(workers, 2),
            )
        };
        let plain = make(0);
        let want: Vec<Vec<Vec<u32>>> = (0..2).map(|_| plain.iter().map(ids).collect()).collect();
        for workers in [1, 2, 3] {
            let l = make(workers);
            let got: Vec<Vec<Vec<u32>>> = (0..2).map(|_| l.iter().map(ids).collect()).collect();
            assert_eq!(got, want, "{workers} workers");
            // Broken off after two batches, the next pass picks up at the third.
            let l = make(workers);
            let first: Vec<Vec<u32>> = l.iter().take(2).map(ids).collect();
            let rest: Vec<Vec<u32>> = l.iter().map(ids).collect();
            assert_eq!(
                [first, rest].concat(),
                want[0],
                "{workers} workers, resumed"
            );
        }
    }

    #[test]
    fn a_workers_error_reaches_the_loop_at_its_batch() {
        struct Failing;
        impl Dataset for Failing {
            type Batch = usize;
            fn len(&self) -> usize {
                6
            }
            fn get_batch(&self, indices: &[usize]) -> Result<usize> {
                if indices.contains(&4) {
                    return Err(Error::Usage("sample 4 is corrupt".into()));
                }
                Ok(indices[0])
            }
        }
        let l = DataLoader::new(Failing, DataLoaderConfig::new(2).with_workers(2, 1));
        let got: Vec<std::result::Result<usize, String>> =
            l.iter().map(|b| b.map_err(|e| e.to_string())).collect();
        assert_eq!(got[..2], [Ok(0), Ok(2)]);
        assert!(got[2].as_ref().unwrap_err().contains("sample 4"), "{got:?}");
    }

    #[test]
    fn the_last_batch_is_flagged_to_the_gradient_state() {
        let mut l = loader(4, 2);
        let gs = GradientState::new(Default::default());
        l.attach(gs.clone(), 0, ShardConfig::default());
        let mut flags = vec![];
        for b in l.iter() {
            b.unwrap();
            flags.push(gs.end_of_dataloader());
        }
        assert_eq!(flags, vec![false, true]);
        assert!(!gs.end_of_dataloader());
    }
}
