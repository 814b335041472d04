//! Replicated data parallel (DDP): every rank holds the whole model, and
//! the gradient buffers are averaged in buckets at the end of an
//! accumulation cycle.

use std::sync::Arc;

use accel_dist::ddp::{CommHook, GradBuckets};
use accel_dist::Communicator;

use super::{PreparedModel, SyncStrategy};
use crate::Result;

/// The way of running of a replicated model at more than one rank.
pub(crate) struct Replicated {
    /// Every rank of the job.
    pub comm: Arc<dyn Communicator>,
    /// The model's parameters grouped for the all-reduce (`ddp_bucket_cap_mb`).
    pub buckets: GradBuckets,
    /// What is done to each bucket around the all-reduce (e.g. fp16 compression).
    pub hook: CommHook,
    /// `find_unused_parameters`: parameters that no rank's backward reached
    /// are found (one more all-reduce, of a flag per parameter) and keep no
    /// gradient, so the optimizer leaves them alone (no weight decay, no
    /// moment update), as PyTorch's DDP leaves their `grad` untouched.
    pub find_unused: bool,
}

impl std::fmt::Debug for Replicated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replicated")
            .field("world_size", &self.comm.world_size())
            .finish_non_exhaustive()
    }
}

impl SyncStrategy for Replicated {
    /// Averages over all ranks only when the cycle ends (`no_sync` before),
    /// or on every micro-batch with `sync_each_batch`: averaging the
    /// accumulated buffer again keeps the already averaged part.
    fn reduce(&self, model: &PreparedModel, reduce_now: bool) -> Result<()> {
        if reduce_now {
            model.all_reduce_grads(&*self.comm, &self.buckets, self.hook, self.find_unused)?;
        }
        Ok(())
    }
}
