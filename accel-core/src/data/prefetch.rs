//! Batches prepared ahead on background threads (PyTorch's
//! `num_workers` / `prefetch_factor`), so that collation, tokenization or
//! whatever `Dataset::get_batch` does overlaps the training step.
//!
//! Why threads and not processes: a `Dataset` here is Rust, shares memory
//! safely and holds no interpreter lock, so a thread per worker does what
//! PyTorch needs worker processes for. Order is kept as PyTorch keeps it:
//! worker `w` makes batches `w, w + W, w + 2W, ...` of the pass, each into
//! its own bounded queue, and the iterator takes them round-robin, so the
//! batches, and the run, are the ones the loop would make without workers.

use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;

use super::Dataset;
use crate::{Error, Result};

/// The workers of one pass over a loader's batches.
pub(super) struct Prefetch<B> {
    queues: Vec<Receiver<Result<B>>>,
    /// The index (in the pass) of the batch [`Prefetch::next`] returns.
    next: usize,
    start: usize,
}

impl<B: Send + 'static> Prefetch<B> {
    /// Starts `workers` threads making `batches[start..]`, each keeping up
    /// to `depth` batches ready.
    pub(super) fn start<D: Dataset<Batch = B>>(
        dataset: Arc<D>,
        batches: Arc<Vec<Vec<usize>>>,
        start: usize,
        (workers, depth): (usize, usize),
    ) -> Self {
        let mut queues = Vec::with_capacity(workers);
        for w in 0..workers {
            let (tx, rx) = sync_channel(depth.max(1));
            let (dataset, batches) = (dataset.clone(), batches.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("accel-data-{w}"))
                .spawn(move || {
                    for i in (start + w..batches.len()).step_by(workers) {
                        // The iterator went away (a pass broken off): stop.
                        if tx.send(dataset.get_batch(&batches[i])).is_err() {
                            return;
                        }
                    }
                });
            if let Err(e) = spawned {
                // No thread: this worker's queue reports the reason in order.
                let (tx, rx) = sync_channel(1);
                let _ = tx.send(Err(Error::Usage(format!(
                    "data loader worker {w} could not start: {e}"
                ))));
                queues.push(rx);
                continue;
            }
            queues.push(rx);
        }
        Self {
            queues,
            next: start,
            start,
        }
    }

    /// The next batch of the pass, waiting for its worker.
    pub(super) fn next(&mut self) -> Result<B> {
        let w = (self.next - self.start) % self.queues.len();
        self.next += 1;
        self.queues[w].recv().unwrap_or_else(|_| {
            Err(Error::Usage(format!(
                "data loader worker {w} stopped without its batch (it panicked)"
            )))
        })
    }
}
