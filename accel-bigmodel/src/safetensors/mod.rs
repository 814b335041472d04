//! The safetensors format as a loader needs it: validated headers, memory-mapped
//! files and shard indexes, with errors that name the file, tensor and offsets.
//!
//! accel-core's checkpoint module reads its files through this module too, so a
//! damaged file gets the same precise reason whichever layer opens it.

mod header;
mod index;
mod mmap;

pub use header::{candle_dtype, HeaderEntry, SafetensorsHeader, MAX_HEADER_LEN};
pub use index::{CheckpointFiles, WeightIndex, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME};
pub use mmap::MmapFile;
