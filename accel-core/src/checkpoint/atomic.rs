//! Atomic checkpoint folders and the `checkpoint_{n}` rotation.
//!
//! A checkpoint is written into a hidden sibling folder and renamed into
//! place only once every file is fsynced, so a crash mid-save never leaves a
//! half-written `checkpoint_{n}` that a resume would pick up. Hidden names:
//!
//! - `.{name}.tmp-{pid}-{nanos}`: a folder being written ([`AtomicDir`]);
//! - `.{name}.old-{pid}`: the previous `{name}` while it is being replaced;
//! - `.{name}.del-{pid}-{nanos}`: a folder being deleted by
//!   [`enforce_total_limit`] (renamed first so a crash mid-delete cannot leave
//!   a partial `checkpoint_{n}` behind).
//!
//! [`clean_stale_temps`] tidies up after crashed processes.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::fs_util::{fsync_dir, parent_or_dot, sync_tree};
use crate::{Error, Result};

fn nanos() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// A folder that appears at its final path all at once, or not at all.
///
/// ```no_run
/// # fn main() -> accel_core::Result<()> {
/// use accel_core::checkpoint::AtomicDir;
/// let dir = AtomicDir::begin("out/checkpoints/checkpoint_3")?;
/// std::fs::write(dir.path().join("step.json"), "3").unwrap();
/// let final_path = dir.commit()?; // out/checkpoints/checkpoint_3
/// # Ok(()) }
/// ```
///
/// Dropping it without [`AtomicDir::commit`] (an error, a panic) removes the
/// temporary folder and leaves any existing final folder untouched.
#[derive(Debug)]
pub struct AtomicDir {
    final_dir: PathBuf,
    /// `None` once committed, so `Drop` never deletes a published folder.
    tmp: Option<PathBuf>,
}

impl AtomicDir {
    /// Creates the temporary folder `.{name}.tmp-{pid}-{nanos}` next to
    /// `final_dir` (same parent, hence same file system, so the final rename
    /// is atomic). Creates the parent if needed.
    pub fn begin(final_dir: impl AsRef<Path>) -> Result<Self> {
        let final_dir = final_dir.as_ref().to_path_buf();
        let name = final_dir
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| {
                Error::Usage(format!(
                    "checkpoint folder {} has no usable name",
                    final_dir.display()
                ))
            })?;
        let parent = parent_or_dot(&final_dir);
        fs::create_dir_all(parent).map_err(|e| Error::io("creating folder", parent, e))?;
        let tmp = parent.join(format!(".{name}.tmp-{}-{}", std::process::id(), nanos()));
        fs::create_dir(&tmp).map_err(|e| Error::io("creating folder", &tmp, e))?;
        Ok(Self {
            final_dir,
            tmp: Some(tmp),
        })
    }

    /// The temporary folder to write the checkpoint's files into.
    pub fn path(&self) -> &Path {
        self.tmp.as_deref().expect("AtomicDir used after commit")
    }

    /// Where the folder will be once committed.
    pub fn final_path(&self) -> &Path {
        &self.final_dir
    }

    /// Publishes the folder: fsyncs every file and folder inside, renames it
    /// to the final path, fsyncs the parent. Returns the final path.
    ///
    /// If the final folder already exists it is first renamed to
    /// `.{name}.old-{pid}` and deleted once the new one is in place. Between
    /// those two renames (microseconds) the final path does not exist; a crash
    /// exactly then leaves the previous contents in `.{name}.old-{pid}`, which
    /// [`clean_stale_temps`] renames back.
    pub fn commit(mut self) -> Result<PathBuf> {
        let tmp = self.path().to_path_buf();
        sync_tree(&tmp)?;
        let parent = parent_or_dot(&self.final_dir).to_path_buf();
        let name = self
            .final_dir
            .file_name()
            .expect("checked in begin")
            .to_string_lossy()
            .into_owned();
        let old = parent.join(format!(".{name}.old-{}", std::process::id()));
        let had_old = fs::symlink_metadata(&self.final_dir).is_ok();
        if had_old {
            if old.exists() {
                remove_any(&old)?;
            }
            fs::rename(&self.final_dir, &old)
                .map_err(|e| Error::io("moving aside", &self.final_dir, e))?;
        }
        if let Err(e) = fs::rename(&tmp, &self.final_dir) {
            if had_old {
                // Put the previous checkpoint back; the new one is still in tmp
                // and Drop removes it.
                let _ = fs::rename(&old, &self.final_dir);
            }
            return Err(Error::io("renaming into place", &self.final_dir, e));
        }
        self.tmp = None;
        fsync_dir(&parent)?;
        if had_old {
            // The new checkpoint is durable; failing to delete the old copy
            // only wastes space, so it is not an error.
            if let Err(e) = remove_any(&old) {
                tracing::warn!(error = %e, "could not remove the replaced checkpoint folder");
            }
        }
        Ok(self.final_dir.clone())
    }
}

impl Drop for AtomicDir {
    fn drop(&mut self) {
        if let Some(tmp) = self.tmp.take() {
            if let Err(e) = fs::remove_dir_all(&tmp) {
                tracing::warn!(path = %tmp.display(), error = %e, "could not remove uncommitted checkpoint folder");
            }
        }
    }
}

fn remove_any(path: &Path) -> Result<()> {
    let is_dir = fs::symlink_metadata(path)
        .map(|m| m.is_dir())
        .unwrap_or(false);
    let r = if is_dir {
        fs::remove_dir_all(path)
    } else {
        fs::remove_file(path)
    };
    r.map_err(|e| Error::io("removing", path, e))
}

/// The path of checkpoint number `n` inside `checkpoints_dir`, as Accelerate
/// names it: `checkpoint_{n}`.
pub fn checkpoint_path(checkpoints_dir: impl AsRef<Path>, n: u64) -> PathBuf {
    checkpoints_dir.as_ref().join(format!("checkpoint_{n}"))
}

/// The `checkpoint_{n}` folders in `checkpoints_dir`, sorted by `n` as a
/// number (so `checkpoint_10` comes after `checkpoint_9`). Hidden temporary
/// folders and other entries are ignored; a missing folder gives an empty list.
pub fn list_checkpoints(checkpoints_dir: impl AsRef<Path>) -> Result<Vec<(u64, PathBuf)>> {
    let dir = checkpoints_dir.as_ref();
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("listing", dir, e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("listing", dir, e))?;
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        let Some(digits) = name.strip_prefix("checkpoint_") else {
            continue;
        };
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(n) = digits.parse::<u64>() else {
            continue;
        };
        if entry.path().is_dir() {
            found.push((n, entry.path()));
        }
    }
    found.sort();
    Ok(found)
}

/// Deletes the oldest checkpoints so that, after the next save, at most
/// `total_limit` remain: Accelerate removes
/// `folders[: len(folders) + 1 - total_limit]` sorted by number. Returns the
/// removed folders, oldest first. Call on the main process only, before saving.
pub fn enforce_total_limit(
    checkpoints_dir: impl AsRef<Path>,
    total_limit: usize,
) -> Result<Vec<PathBuf>> {
    let dir = checkpoints_dir.as_ref();
    let folders = list_checkpoints(dir)?;
    if folders.len() < total_limit {
        return Ok(Vec::new());
    }
    let excess = folders.len() + 1 - total_limit;
    let mut removed = Vec::new();
    for (_, path) in folders.into_iter().take(excess) {
        tracing::info!(path = %path.display(), total_limit, "deleting old checkpoint to respect total_limit");
        let name = path
            .file_name()
            .expect("listed entry")
            .to_string_lossy()
            .into_owned();
        let doomed = dir.join(format!(".{name}.del-{}-{}", std::process::id(), nanos()));
        fs::rename(&path, &doomed).map_err(|e| Error::io("moving aside", &path, e))?;
        remove_any(&doomed)?;
        removed.push(path);
    }
    fsync_dir(dir)?;
    Ok(removed)
}

/// What a hidden leftover is, parsed from its name.
#[derive(Debug, PartialEq, Eq)]
enum Leftover<'a> {
    /// `.{name}.tmp-...`, `{file}.tmp-...` or `.{name}.del-...`: garbage.
    Garbage,
    /// `.{name}.old-...`: the previous `{name}`, to restore if `{name}` is gone.
    Old(&'a str),
}

/// Parses `{base}.{tmp|old|del}-{pid}[-{nanos}]`; `None` for anything else or
/// for leftovers of this very process (they may be in use right now).
fn leftover(name: &str) -> Option<Leftover<'_>> {
    let (idx, kind) = [".tmp-", ".old-", ".del-"]
        .iter()
        .filter_map(|k| name.rfind(k).map(|i| (i, *k)))
        .max_by_key(|(i, _)| *i)?;
    let base = &name[..idx];
    let mut ids = name[idx + kind.len()..].splitn(2, '-');
    let pid: u32 = ids.next()?.parse().ok()?;
    if let Some(nanos) = ids.next() {
        nanos.parse::<u128>().ok()?;
    }
    if pid == std::process::id() || base.is_empty() {
        return None;
    }
    match kind {
        ".old-" => Some(Leftover::Old(base.strip_prefix('.')?)),
        _ => Some(Leftover::Garbage),
    }
}

/// Removes what crashed saves left in `dir`: `.tmp-` folders and files, and
/// `.del-` folders; a `.{name}.old-{pid}` folder is renamed back to `{name}`
/// when `{name}` is missing (the crash hit between the two renames of
/// [`AtomicDir::commit`]), otherwise removed. Leftovers named with this
/// process's pid are skipped since they may be in use. Call it on the main
/// process before saving, never while another process saves into `dir`.
/// Returns the paths removed or restored.
pub fn clean_stale_temps(dir: impl AsRef<Path>) -> Result<Vec<PathBuf>> {
    let dir = dir.as_ref();
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("listing", dir, e)),
    };
    let mut touched = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("listing", dir, e))?;
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        let path = entry.path();
        match leftover(&name) {
            None => continue,
            Some(Leftover::Old(original)) if !dir.join(original).exists() => {
                tracing::warn!(path = %path.display(), "restoring checkpoint folder left aside by a crashed save");
                fs::rename(&path, dir.join(original))
                    .map_err(|e| Error::io("restoring", &path, e))?;
            }
            Some(_) => {
                tracing::info!(path = %path.display(), "removing leftover of a crashed save");
                remove_any(&path)?;
            }
        }
        touched.push(path);
    }
    if !touched.is_empty() {
        fsync_dir(dir)?;
    }
    touched.sort();
    Ok(touched)
}

#[cfg(test)]
#[path = "atomic_tests.rs"]
mod tests;
