//! Starting again after a failure: the restart number `accel launch`
//! (or torchrun) gives each start, and resuming from the newest automatic
//! checkpoint every rank can read.

use std::path::PathBuf;

use accel_dist::CommunicatorExt;

use super::Accelerator;
use crate::checkpoint;
use crate::{Error, Result};

impl Accelerator {
    /// The restart number of this start of the job: torchrun's and `accel
    /// launch --max_restarts`'s `TORCHELASTIC_RESTART_COUNT`, 0 on a first
    /// start (or without a launcher).
    ///
    /// # Errors
    /// [`Error::Config`] when the variable is set but not a number.
    pub fn restart_count(&self) -> Result<usize> {
        let var = accel_dist::launch::ENV_RESTART_COUNT;
        match std::env::var(var) {
            Err(_) => Ok(0),
            Ok(v) => v.trim().parse().map_err(|_| Error::Config {
                key: var.into(),
                reason: format!("{v:?} is not a restart number"),
            }),
        }
    }

    /// On a restart of the job ([`Self::restart_count`] above 0), restores
    /// the newest automatic checkpoint that loads, as `load_state(None)`
    /// does; a checkpoint that does not load (cut short, or a file broken)
    /// is skipped with a warning naming it and why. Returns the folder
    /// restored, or `None` on a first start, without automatic checkpoint
    /// naming, or when no checkpoint was written before the failure (the
    /// job then starts over, which is the same run again).
    ///
    /// Every rank must call it.
    ///
    /// # Errors
    /// Reading the checkpoints folder; or, with checkpoints present, when
    /// none of them loads.
    pub fn load_state_on_restart(&mut self) -> Result<Option<PathBuf>> {
        let restart = self.restart_count()?;
        if restart == 0 || !self.config.project.automatic_checkpoint_naming {
            return Ok(None);
        }
        let found = self.checkpoints_on_every_rank(restart)?;
        if found.is_empty() {
            self.print(format!(
                "restart {restart}: no checkpoint in {} yet; starting over",
                self.checkpoints_dir().display()
            ));
            return Ok(None);
        }
        let mut last_error = None;
        for (_, dir) in found.into_iter().rev() {
            match self.load_state(Some(&dir)) {
                Ok(dir) => {
                    self.print(format!("restart {restart}: resumed from {}", dir.display()));
                    return Ok(Some(dir));
                }
                Err(e) => {
                    let msg = format!("restart {restart}: skipping {}: {e}", dir.display());
                    if self.is_main_process() {
                        eprintln!("warning: {msg}");
                    }
                    tracing::warn!("{msg}");
                    last_error = Some(e);
                }
            }
        }
        Err(last_error.expect("at least one checkpoint was tried"))
    }

    /// The automatic checkpoints every rank can read, oldest first: where
    /// machines keep their own copies (`save_on_each_node`, or a machine
    /// that missed a save before it failed), a checkpoint one rank lacks
    /// would make the ranks load different steps. Each one skipped is said.
    fn checkpoints_on_every_rank(&self, restart: usize) -> Result<Vec<(u64, PathBuf)>> {
        let found = checkpoint::list_checkpoints(self.checkpoints_dir())?;
        if self.num_processes() == 1 {
            return Ok(found);
        }
        let mine: Vec<u64> = found.iter().map(|(n, _)| *n).collect();
        let all: Vec<Vec<u64>> = self.comm().gather_object(&mine)?;
        let mut kept = vec![];
        for (n, dir) in found {
            match all.iter().position(|theirs| !theirs.contains(&n)) {
                None => kept.push((n, dir)),
                Some(rank) => self.print(format!(
                    "restart {restart}: skipping {}: rank {rank} cannot read it",
                    dir.display()
                )),
            }
        }
        Ok(kept)
    }
}
