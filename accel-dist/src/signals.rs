//! Termination signals observed rather than obeyed, for preemption saves: a
//! scheduler's SIGTERM (SLURM preemption, a spot instance's notice), Ctrl-C's
//! SIGINT, or SIGHUP sets a flag the training loop reads at its next step
//! boundary (`Accelerator::should_stop`); a second signal exits at once.
//!
//! Nothing is installed until a loop asks ([`watch_termination`]), so a
//! program that never checks keeps the default behaviour: the signal ends it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Signals received since [`watch_termination`].
static RECEIVED: AtomicUsize = AtomicUsize::new(0);

/// The exit status of a process stopped by SIGTERM (128 + 15), which a
/// program that saved and stopped on a signal exits with.
pub const TERMINATED_STATUS: i32 = 143;

/// Starts observing SIGTERM, SIGINT and SIGHUP (once per process; later
/// calls return the first call's outcome).
///
/// # Errors
/// When the process already has a handler installed through `ctrlc` (the
/// program's own): signals then keep their effect and nothing is observed.
pub fn watch_termination() -> Result<(), String> {
    static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();
    INSTALLED
        .get_or_init(|| {
            ctrlc::set_handler(|| {
                if RECEIVED.fetch_add(1, Ordering::SeqCst) >= 1 {
                    eprintln!("second termination signal: exiting without waiting for a save");
                    std::process::exit(TERMINATED_STATUS);
                }
            })
            .map_err(|e| format!("cannot observe termination signals: {e}"))
        })
        .clone()
}

/// Whether a termination signal arrived since [`watch_termination`].
pub fn termination_requested() -> bool {
    RECEIVED.load(Ordering::SeqCst) > 0
}
