//! [`MappedFiles`]: the mappings a checkpoint source and the loaders made
//! from it take tensors from.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Tensor};

use super::MappedRegion;

/// Files mapped for tensors over their pages, each opened on first use and
/// kept while this lives. A [`crate::CheckpointSource`] and every
/// [`crate::OffloadedWeightsLoader`] made from it share one, so a shard is
/// mapped once however many of them read it.
#[derive(Debug, Default)]
pub(crate) struct MappedFiles {
    // `None`: the file cannot be mapped (no allocator, turned off, or it
    // could not be opened: reading it then reports why).
    regions: Mutex<BTreeMap<PathBuf, Option<Arc<MappedRegion>>>>,
}

impl MappedFiles {
    /// The mapping of `path`, opened on first use.
    fn region(&self, path: &Path) -> Option<Arc<MappedRegion>> {
        if !super::enabled() {
            return None;
        }
        let mut regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        let region = regions
            .entry(path.to_path_buf())
            .or_insert_with(|| MappedRegion::open(path).ok().flatten());
        region.clone()
    }

    /// Whether tensors of `path` are handed out over its pages.
    pub(crate) fn maps(&self, path: &Path) -> bool {
        self.region(path).is_some()
    }

    /// The `dtype` tensor of `shape` stored at byte `offset` of `path`, over
    /// the file's pages; `None` where [`MappedRegion::tensor`] refuses it or
    /// the file cannot be mapped.
    pub(crate) fn tensor(
        &self,
        path: &Path,
        offset: u64,
        dtype: DType,
        shape: &[usize],
    ) -> Option<Tensor> {
        self.region(path)?.tensor(offset, dtype, shape)
    }
}
