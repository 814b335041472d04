//! A stderr log for programs: `accel` and the examples call [`init_logging`].
//!
//! The libraries report through `tracing` (a refused connection to the
//! store, a setting with no effect, a skipped checkpoint); without a
//! subscriber those reports go nowhere. `init_logging` prints warnings and
//! errors by default, and whatever `RUST_LOG` asks for when it is set
//! (`RUST_LOG=accel_dist=debug`, `RUST_LOG=info`).

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Installs a stderr subscriber at `warn`, or at the level `RUST_LOG` sets.
///
/// Does nothing when the program already installed one. A `RUST_LOG` that
/// does not parse is reported and the default level is used.
pub fn init_logging() {
    let filter = match std::env::var("RUST_LOG") {
        Ok(spec) => EnvFilter::try_new(&spec).unwrap_or_else(|e| {
            eprintln!("warning: RUST_LOG={spec:?} does not parse ({e}); logging warnings only");
            EnvFilter::new("warn")
        }),
        Err(_) => EnvFilter::new("warn"),
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours only on a terminal: logs captured to a file stay plain text.
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .try_init();
}
