//! One process holding the whole model: nothing to keep in step.

use super::SyncStrategy;

/// The way of running of a model on one process (world size 1): every
/// provided method of [`SyncStrategy`] as it is.
#[derive(Debug)]
pub(crate) struct SingleProcess;

impl SyncStrategy for SingleProcess {}
