//! Stopping at a step boundary on a termination signal (a preemption).

use accel_dist::CommunicatorExt;

use super::Accelerator;
use crate::Result;

impl Accelerator {
    /// Whether the training loop should save and stop now: true on every
    /// rank once any rank received SIGTERM, SIGINT or SIGHUP (`accel launch`
    /// forwards the launcher's to every rank). Call it at each step
    /// boundary; on true, `save_state` and exit with
    /// [`accel_dist::signals::TERMINATED_STATUS`]. A second signal exits at
    /// once.
    ///
    /// The first call starts observing the signals (before it they keep
    /// their default effect). With several processes it is a collective
    /// (every rank must call it at the same step), so that all ranks agree
    /// on the step they stop after.
    ///
    /// # Errors
    /// A failed collective.
    pub fn should_stop(&mut self) -> Result<bool> {
        if !self.watching_signals {
            self.watching_signals = true;
            if let Err(e) = accel_dist::signals::watch_termination() {
                tracing::warn!("{e}");
                if self.is_main_process() {
                    eprintln!(
                        "warning: {e}; a termination signal will stop the job without a save"
                    );
                }
            }
        }
        let mine = accel_dist::signals::termination_requested();
        if self.num_processes() == 1 {
            return Ok(mine);
        }
        let all: Vec<bool> = self.comm().gather_object(&mine)?;
        Ok(all.into_iter().any(|s| s))
    }
}
