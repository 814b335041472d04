//! `accel launch`: start one process per rank with torchrun's environment
//! variables, prefix their output with the rank, and stop the job when a rank fails.
//!
//! Split in two, as ripgrep splits its arguments: [`plan`] is a pure function
//! from settings to the exact processes and environments (unit-tested), and
//! [`run`] executes a plan.

mod elastic;
mod plan;
mod spawn;

pub use elastic::{run_elastic, Elastic, DEFAULT_LEASE_TTL};
pub use plan::{plan, LaunchConfig, LaunchPlan, RankProcess};
pub use spawn::{run, RunOptions, ENV_MAX_RESTARTS, ENV_RESTART_COUNT};
