//! `accel config`: the questionnaire that writes `default_config.yaml`, and
//! `accel config default` (Accelerate's `write_basic_config`).

use std::io::{BufRead, Write};
use std::path::PathBuf;

use accel_core::config::cuda_device_count;
use accel_core::{Error, Result};

use crate::config_file::{default_config_path, write_basic_config, ClusterConfig, FsdpFileConfig};

/// Flags of `accel config`.
#[derive(Debug, Clone, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct ConfigArgs {
    /// `default`: write a basic file without questions.
    #[command(subcommand)]
    pub command: Option<ConfigCommand>,
    /// Where to save (default `$HF_HOME/accelerate/default_config.yaml`).
    #[arg(long = "config_file", visible_alias = "config-file")]
    pub config_file: Option<PathBuf>,
    /// Take every default answer without reading stdin.
    #[arg(long = "non-interactive", visible_alias = "non_interactive")]
    pub non_interactive: bool,
}

/// Subcommands of `accel config`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum ConfigCommand {
    /// Write a single-machine file using every GPU (or the CPU), as `write_basic_config`.
    Default(ConfigDefaultArgs),
}

/// Flags of `accel config default`.
#[derive(Debug, Clone, clap::Args)]
pub struct ConfigDefaultArgs {
    /// `no`, `fp16` or `bf16`.
    #[arg(
        long = "mixed_precision",
        visible_alias = "mixed-precision",
        default_value = "no"
    )]
    pub mixed_precision: String,
    /// Where to save (default `$HF_HOME/accelerate/default_config.yaml`).
    #[arg(long = "config_file", visible_alias = "config-file")]
    pub config_file: Option<PathBuf>,
}

/// Runs `accel config`, reading answers from `input` and writing questions to
/// `output`; returns the line to print at the end.
///
/// # Errors
/// When a required answer is missing at end of input, or saving fails.
pub fn config_command(
    args: &ConfigArgs,
    input: &mut dyn BufRead,
    output: &mut dyn Write,
) -> Result<String> {
    if let Some(ConfigCommand::Default(d)) = &args.command {
        let path = d.config_file.clone().unwrap_or_else(default_config_path);
        return Ok(match write_basic_config(&d.mixed_precision, &path)? {
            Some(_) => format!("accel-rs configuration saved at {}", path.display()),
            None => format!(
                "Configuration already exists at {}, will not override. Run `accel config` or pass another --config_file.",
                path.display()
            ),
        });
    }
    let path = args.config_file.clone().unwrap_or_else(default_config_path);
    let config = if args.non_interactive {
        ask_config(&mut std::io::empty(), &mut std::io::sink())?
    } else {
        ask_config(input, output)?
    };
    config.save(&path)?;
    Ok(format!(
        "accel-rs configuration saved at {}",
        path.display()
    ))
}

/// Asks Accelerate's questions for a local machine (a subset: distributed
/// type NO / MULTI_CPU / MULTI_GPU / FSDP, machines, ranks, address, port,
/// CPU, processes, GPU ids, precision and the FSDP settings). An empty answer
/// or the end of input takes the default shown in brackets.
///
/// # Errors
/// [`Error::Usage`] when a question without a default gets no answer.
pub fn ask_config(input: &mut dyn BufRead, output: &mut dyn Write) -> Result<ClusterConfig> {
    let mut p = Prompter { input, output };
    let compute_environment = p.choice(
        "In which compute environment are you running?",
        &["LOCAL_MACHINE"],
        0,
    )?;
    let mut c = ClusterConfig {
        compute_environment,
        ..ClusterConfig::default()
    };
    c.distributed_type = p.choice(
        "Which type of machine are you using?",
        &["NO", "MULTI_CPU", "MULTI_GPU", "FSDP"],
        0,
    )?;
    let distributed = c.distributed_type != "NO";
    if distributed {
        c.num_machines = p.parse(
            "How many different machines will you use (more than 1 for multi-node training)?",
            Some(1),
        )?;
        if c.num_machines > 1 {
            c.machine_rank = p.parse("What is the rank of this machine?", Some(0))?;
            c.main_process_ip = Some(p.text(
                "What is the IP address of the machine that will host the main process?",
                None,
            )?);
            c.main_process_port = Some(p.parse(
                "What is the port you will use to communicate with the main process?",
                Some(29500),
            )?);
            c.same_network =
                Some(p.yes_no("Are all the machines on the same local network?", true)?);
        }
        c.debug = p.yes_no(
            "Should distributed operations be checked while running for errors?",
            false,
        )?;
    }
    c.use_cpu = c.distributed_type == "MULTI_CPU"
        || p.yes_no(
            "Do you want to run your training on CPU only (even if a GPU is available)?",
            false,
        )?;
    if c.distributed_type == "FSDP" {
        c.fsdp_config = Some(ask_fsdp(&mut p)?);
    }
    c.num_processes = Some(if distributed {
        let default = if c.use_cpu {
            1
        } else {
            cuda_device_count().max(1) as i64
        };
        let what = if c.use_cpu { "processes" } else { "GPU(s)" };
        p.parse(
            &format!("How many {what} should be used for distributed training?"),
            Some(default),
        )?
    } else {
        1
    });
    if !c.use_cpu {
        c.gpu_ids = Some(p.text(
            "What GPU(s) (by id) should be used for training on this machine as a comma-separated list?",
            Some("all"),
        )?);
    }
    c.mixed_precision = Some(p.choice(
        "Do you wish to use mixed precision?",
        &["no", "fp16", "bf16"],
        0,
    )?);
    Ok(c)
}

fn ask_fsdp(p: &mut Prompter<'_>) -> Result<FsdpFileConfig> {
    let mut f = FsdpFileConfig::default();
    let version: u8 = p.parse("What should be your FSDP version?", Some(2))?;
    f.fsdp_version = Some(version);
    if version == 2 {
        let r = p.yes_no("Do you want to enable resharding after forward?", true)?;
        f.fsdp_reshard_after_forward = Some(r.into());
    } else {
        let s = p.choice(
            "What should be your sharding strategy?",
            &[
                "FULL_SHARD",
                "SHARD_GRAD_OP",
                "NO_SHARD",
                "HYBRID_SHARD",
                "HYBRID_SHARD_ZERO2",
            ],
            0,
        )?;
        f.fsdp_reshard_after_forward = Some(s.into());
    }
    f.fsdp_offload_params = Some(p.yes_no(
        "Do you want to offload parameters and gradients to CPU?",
        false,
    )?);
    let policy = p.choice(
        "What should be your auto wrap policy?",
        &["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"],
        0,
    )?;
    if policy == "TRANSFORMER_BASED_WRAP" {
        let cls = p.text(
            "Specify the comma-separated list of layer names to wrap (empty: none)",
            Some(""),
        )?;
        f.fsdp_transformer_layer_cls_to_wrap = Some(cls).filter(|s| !s.is_empty());
    } else if policy == "SIZE_BASED_WRAP" {
        f.fsdp_min_num_params = Some(p.parse(
            "What should be your FSDP's minimum number of parameters for Default Auto Wrapping Policy?",
            Some(100_000_000),
        )?);
    }
    f.fsdp_auto_wrap_policy = Some(policy);
    if version == 1 {
        f.fsdp_backward_prefetch = Some(p.choice(
            "What should be your FSDP's backward prefetch policy?",
            &["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"],
            0,
        )?);
    }
    f.fsdp_state_dict_type = Some(p.choice(
        "What should be your FSDP's state dict type?",
        &["SHARDED_STATE_DICT", "FULL_STATE_DICT"],
        0,
    )?);
    if version == 1 {
        f.fsdp_forward_prefetch = Some(p.yes_no(
            "Do you want to enable FSDP's forward prefetch policy?",
            false,
        )?);
        f.fsdp_use_orig_params = Some(p.yes_no(
            "Do you want to enable FSDP's `use_orig_params` feature?",
            true,
        )?);
    }
    let cre = p.yes_no(
        "Do you want to enable CPU RAM efficient model loading?",
        true,
    )?;
    f.fsdp_cpu_ram_efficient_loading = Some(cre);
    // Accelerate requires sync_module_states with RAM-efficient loading, so it only asks otherwise.
    f.fsdp_sync_module_states = Some(
        cre || (version == 1
            && p.yes_no(
                "Do you want each FSDP unit to broadcast parameters from rank 0 at the start?",
                true,
            )?),
    );
    f.fsdp_activation_checkpointing =
        Some(p.yes_no("Do you want to enable activation checkpointing?", false)?);
    Ok(f)
}

/// Questions on a writer, answers from a reader; the end of input takes defaults.
struct Prompter<'a> {
    input: &'a mut dyn BufRead,
    output: &'a mut dyn Write,
}

impl Prompter<'_> {
    /// One answer line, or `None` at the end of input.
    fn line(&mut self, question: &str, default: Option<&str>) -> Result<Option<String>> {
        let shown = default.map(|d| format!(" [{d}]")).unwrap_or_default();
        let io = |e| Error::io("writing", "<stdout>", e);
        write!(self.output, "{question}{shown}: ").map_err(io)?;
        self.output.flush().map_err(io)?;
        let mut buf = String::new();
        let n = self
            .input
            .read_line(&mut buf)
            .map_err(|e| Error::io("reading", "<stdin>", e))?;
        if n == 0 {
            writeln!(self.output).map_err(io)?;
            return Ok(None);
        }
        Ok(Some(buf.trim().to_string()))
    }

    /// Asks until `accept` takes the answer; empty or end of input gives the default.
    fn ask<T>(
        &mut self,
        question: &str,
        default: Option<&str>,
        accept: impl Fn(&str) -> Option<T>,
    ) -> Result<T> {
        loop {
            let answer = self.line(question, default)?;
            let eof = answer.is_none();
            let text = match answer.filter(|a| !a.is_empty()) {
                Some(a) => a,
                None => match default {
                    Some(d) => d.to_string(),
                    None if eof => {
                        accel_core::bail!(
                            "accel config: no answer to {question:?} (it has no default)"
                        )
                    }
                    None => continue,
                },
            };
            if let Some(v) = accept(&text) {
                return Ok(v);
            }
            if eof {
                accel_core::bail!("accel config: the default of {question:?} is invalid");
            }
            writeln!(self.output, "Invalid answer {text:?}, please try again.")
                .map_err(|e| Error::io("writing", "<stdout>", e))?;
        }
    }

    fn text(&mut self, question: &str, default: Option<&str>) -> Result<String> {
        self.ask(question, default, |s| Some(s.to_string()))
    }

    fn parse<T: std::str::FromStr + ToString>(
        &mut self,
        question: &str,
        default: Option<T>,
    ) -> Result<T> {
        let d = default.map(|d| d.to_string());
        self.ask(question, d.as_deref(), |s| s.parse().ok())
    }

    fn yes_no(&mut self, question: &str, default: bool) -> Result<bool> {
        let d = if default { "YES/no" } else { "yes/NO" };
        self.ask(question, Some(d), |s| {
            match s.to_ascii_lowercase().as_str() {
                "yes/no" => Some(default),
                "y" | "yes" | "true" | "1" => Some(true),
                "n" | "no" | "false" | "0" => Some(false),
                _ => None,
            }
        })
    }

    /// One of `options`, by name (any case) or index.
    fn choice(&mut self, question: &str, options: &[&str], default: usize) -> Result<String> {
        let q = format!("{question} ({})", options.join(", "));
        self.ask(&q, Some(options[default]), |s| {
            let by_index = s.parse::<usize>().ok().and_then(|i| options.get(i));
            let by_name = options.iter().find(|o| o.eq_ignore_ascii_case(s));
            by_index.or(by_name).map(|o| o.to_string())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(answers: &str) -> Result<(ClusterConfig, String)> {
        let mut out = Vec::new();
        let c = ask_config(&mut answers.as_bytes(), &mut out)?;
        Ok((c, String::from_utf8(out).unwrap()))
    }

    #[test]
    fn end_of_input_takes_every_default() -> Result<()> {
        let (c, text) = run("")?;
        assert_eq!(c.distributed_type, "NO");
        assert_eq!(c.num_processes, Some(1));
        assert_eq!(c.mixed_precision.as_deref(), Some("no"));
        assert!(
            text.contains("Which type of machine are you using?"),
            "{text}"
        );
        Ok(())
    }

    #[test]
    fn a_bad_answer_is_asked_again() -> Result<()> {
        let (c, text) = run("\nMULTI_TPU\nmulti_cpu\n1\n\n3\nbf16\n")?;
        assert!(text.contains("Invalid answer \"MULTI_TPU\""), "{text}");
        assert_eq!(c.distributed_type, "MULTI_CPU");
        assert!(c.use_cpu);
        assert_eq!(c.num_processes, Some(3));
        assert_eq!(c.mixed_precision.as_deref(), Some("bf16"));
        Ok(())
    }

    #[test]
    fn a_multi_node_address_has_no_default() {
        let e = run("\nMULTI_GPU\n2\n1\n").unwrap_err().to_string();
        assert!(e.contains("IP address"), "{e}");
    }
}
