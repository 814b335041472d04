//! `accel launch`: run a program on several processes.

use std::ffi::OsString;
use std::time::Duration;

use accel_dist::launch::{self, LaunchConfig, RunOptions};

use crate::Result;

/// Flags of `accel launch` (Accelerate's names, which use underscores; the
/// dashed spellings are accepted too).
#[derive(Debug, Clone, clap::Args)]
pub struct LaunchArgs {
    /// Processes in the whole job, over all machines.
    #[arg(
        long = "num_processes",
        visible_alias = "num-processes",
        default_value_t = 1
    )]
    pub num_processes: usize,
    /// Machines taking part.
    #[arg(
        long = "num_machines",
        visible_alias = "num-machines",
        default_value_t = 1
    )]
    pub num_machines: usize,
    /// This machine's index (0 hosts the rendezvous).
    #[arg(
        long = "machine_rank",
        visible_alias = "machine-rank",
        default_value_t = 0
    )]
    pub machine_rank: usize,
    /// Address of machine 0.
    #[arg(long = "main_process_ip", visible_alias = "main-process-ip")]
    pub main_process_ip: Option<String>,
    /// Port of the rendezvous on machine 0 (a free one on a single machine when unset).
    #[arg(long = "main_process_port", visible_alias = "main-process-port")]
    pub main_process_port: Option<u16>,
    /// Train on the CPU.
    #[arg(long)]
    pub cpu: bool,
    /// Seconds a collective waits for a missing rank before failing.
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Do not prefix output lines with the rank.
    #[arg(long)]
    pub no_prefix: bool,
    /// The program to run, then its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    pub command: Vec<OsString>,
}

impl LaunchArgs {
    /// The launcher settings these flags describe.
    pub fn to_config(&self) -> LaunchConfig {
        let mut c = LaunchConfig::local(self.num_processes, self.command[0].clone());
        c.args = self.command[1..].to_vec();
        c.num_machines = self.num_machines;
        c.machine_rank = self.machine_rank;
        c.main_process_ip = self.main_process_ip.clone();
        c.main_process_port = self.main_process_port;
        c.cpu = self.cpu;
        c.timeout = self.timeout.map(Duration::from_secs_f64);
        c.job_token = std::env::var(accel_dist::process::ENV_JOB_TOKEN).ok();
        c
    }
}

/// Starts the ranks and waits; the error names the first rank that failed.
pub fn launch(args: &LaunchArgs) -> Result<()> {
    let plan = launch::plan(&args.to_config())?;
    let options = RunOptions {
        prefix_output: !args.no_prefix,
        ..Default::default()
    };
    launch::run(&plan, &options)?;
    Ok(())
}
