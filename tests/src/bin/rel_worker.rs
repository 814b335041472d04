//! A process driven by the reliability tests (`tests/tests/reliability.rs`):
//! each mode checks one promise the Accelerator makes across ranks and
//! writes what it saw as JSON to `--out/rank{r}.json`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use accel_core::data::{DataLoader, DataLoaderConfig, TensorDataset};
use accel_core::dist::CommunicatorExt;
use accel_core::{
    Accelerator, AcceleratorConfig, GradientAccumulationPlugin, PrecisionType, ProjectConfiguration,
};
use accel_tests::TinyJob;
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use clap::{Parser, ValueEnum};
use serde_json::json;

#[derive(Clone, Copy, ValueEnum)]
enum Mode {
    /// Report the precision the Accelerator resolved.
    Precision,
    /// Report the samples each rank saw per epoch of a shuffled loader, unseeded.
    Coverage,
    /// Train the tiny job with accumulation 2; report whether the gradients
    /// after the first (non-sync) micro-batch are the same on every rank.
    Accumulate,
    /// Prepare a plain model (`prepare_model`) and report the outcome.
    PlainModel,
    /// Save, make the main process's next save fail, and report every rank's outcome.
    FailedSave,
    /// Report the random state before and after `synchronize_rng_states`.
    RngSync,
    /// Train six steps of a model whose forward bypasses a layer; report
    /// the outcome, the parameters no backward reached and whether the
    /// bypassed layer's weights changed.
    Unused,
}

#[derive(Parser)]
struct Args {
    #[arg(long, value_enum)]
    mode: Mode,
    /// Folder for `rank{r}.json` (and run files).
    #[arg(long)]
    out: PathBuf,
    /// Explicit precision (unset: the launcher's).
    #[arg(long)]
    mixed_precision: Option<PrecisionType>,
    /// Samples of the coverage dataset.
    #[arg(long, default_value_t = 24)]
    samples: usize,
    /// Reduce gradients on every micro-batch (accumulate mode).
    #[arg(long)]
    sync_each_batch: bool,
    /// Optimizer steps (accumulate mode).
    #[arg(long, default_value_t = 4)]
    steps: u64,
    /// Accept parameters without a gradient (unused mode).
    #[arg(long)]
    find_unused: bool,
    /// Freeze the bypassed layer (unused mode).
    #[arg(long)]
    freeze_skipped: bool,
    /// Take a loss that depends on no parameter of the model (unused mode).
    #[arg(long)]
    detached: bool,
    /// Pass the bypassed layer's output through an op without a backward (unused mode).
    #[arg(long)]
    cut: bool,
}

/// An op without a backward: the identity, named so the no-gradient report can say where the
/// graph was cut.
struct CutOp;

impl candle_core::CustomOp1 for CutOp {
    fn name(&self) -> &'static str {
        "rel-worker-cut"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        Ok((s.clone(), l.shape().clone()))
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let (rank, result) = match args.mode {
        Mode::Precision => precision(&args)?,
        Mode::Coverage => coverage(&args)?,
        Mode::Accumulate => accumulate(&args)?,
        Mode::PlainModel => plain_model()?,
        Mode::FailedSave => failed_save(&args)?,
        Mode::RngSync => rng_sync()?,
        Mode::Unused => unused(&args)?,
    };
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(
        args.out.join(format!("rank{rank}.json")),
        result.to_string(),
    )?;
    Ok(())
}

fn cpu() -> AcceleratorConfig {
    AcceleratorConfig::default().with_device(Device::Cpu)
}

fn precision(args: &Args) -> Result<(usize, serde_json::Value)> {
    let mut config = cpu();
    config.mixed_precision = args.mixed_precision;
    let acc = Accelerator::new(config)?;
    let dtype = format!("{:?}", acc.compute_dtype());
    // Rank 0 hosts the store: nobody leaves before everyone is done.
    acc.wait_for_everyone()?;
    Ok((
        acc.process_index(),
        json!({ "precision": acc.mixed_precision().to_string(), "dtype": dtype }),
    ))
}

fn coverage(args: &Args) -> Result<(usize, serde_json::Value)> {
    let mut acc = Accelerator::new(cpu())?; // no seed: each rank's clock
    let ids: Vec<u32> = (0..args.samples as u32).collect();
    let data = Tensor::from_vec(ids, (args.samples, 1), &Device::Cpu)?;
    let loader = acc.prepare_data_loader(DataLoader::new(
        TensorDataset::new(vec![data])?,
        DataLoaderConfig::new(2).with_shuffle(true),
    ));
    let mut epochs = vec![];
    for _ in 0..2 {
        let mut seen = vec![];
        for batch in loader.iter() {
            seen.extend(batch?[0].flatten_all()?.to_vec1::<u32>()?);
        }
        epochs.push(seen);
    }
    acc.wait_for_everyone()?;
    Ok((acc.process_index(), json!({ "epochs": epochs })))
}

fn accumulate(args: &Args) -> Result<(usize, serde_json::Value)> {
    let plugin = GradientAccumulationPlugin {
        sync_each_batch: args.sync_each_batch,
        ..GradientAccumulationPlugin::with_steps(2)
    };
    let mut acc = Accelerator::new(cpu().with_seed(5).with_gradient_accumulation(plugin))?;
    let schedule = accel_core::scheduler::Schedule::Constant;
    let mut job = TinyJob::new(&mut acc, 600, 4, schedule)?;
    let comm = acc.communicator();
    let (mut done, mut micro) = (0u64, 0usize);
    let mut first_grads_equal = None;
    while done < args.steps {
        for batch in job.loader.iter() {
            let batch = batch?;
            let (model, opt) = (&job.model, &mut job.opt);
            acc.accumulate(|acc| {
                acc.backward(&model.loss(&batch[0], &batch[1])?)?;
                opt.step()?;
                opt.zero_grad();
                Ok(())
            })?;
            if micro == 0 {
                // Gradients after a non-sync micro-batch: averaged already
                // only when every micro-batch is reduced.
                let mine: Vec<Vec<u32>> = job
                    .params
                    .gradients()
                    .iter()
                    .map(|(_, g)| bits(g))
                    .collect::<Result<_>>()?;
                let all = comm.gather_object(&mine)?;
                first_grads_equal = Some(all.iter().all(|g| *g == all[0]));
            }
            micro += 1;
            if acc.sync_gradients() {
                done += 1;
                if done >= args.steps {
                    break;
                }
            }
        }
    }
    let weights: serde_json::Map<String, serde_json::Value> = job
        .params
        .full_weights()?
        .into_iter()
        .map(|(n, t)| Ok((n, json!(bits(&t)?))))
        .collect::<Result<_>>()?;
    // Rank 0 hosts the store: nobody leaves before everyone is done.
    acc.wait_for_everyone()?;
    Ok((
        acc.process_index(),
        json!({ "first_grads_equal": first_grads_equal, "weights": weights }),
    ))
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .map(|x| x.to_bits())
        .collect())
}

fn plain_model() -> Result<(usize, serde_json::Value)> {
    // The FSDP plugin comes from the launcher's ACCELERATE_USE_FSDP / FSDP_*.
    let mut acc = Accelerator::new(cpu().with_seed(1))?;
    let varmap = VarMap::new();
    let _layer = candle_nn::linear(4, 2, acc.var_builder(&varmap))?;
    let outcome = match acc.prepare_model(&varmap) {
        Ok(_) => json!({ "ok": true }),
        Err(e) => json!({ "ok": false, "error": e.to_string() }),
    };
    acc.wait_for_everyone()?;
    Ok((acc.process_index(), outcome))
}

fn unused(args: &Args) -> Result<(usize, serde_json::Value)> {
    use accel_core::optim::{AdamW, AdamWConfig};
    use candle_nn::Module;
    let mut config = cpu().with_seed(3);
    config.ddp.find_unused_parameters = args.find_unused;
    let mut acc = Accelerator::new(config)?;
    let varmap = VarMap::new();
    let vb = acc.var_builder(&varmap);
    let used = candle_nn::linear(4, 2, vb.pp("used"))?;
    let skipped_layer = candle_nn::linear(4, 2, vb.pp("skipped"))?;
    // With find_unused: a layer only rank 0's loss uses (locally unused at
    // the others, so its averaged gradient must still reach every rank).
    let half = args
        .find_unused
        .then(|| candle_nn::linear(4, 2, vb.pp("half")))
        .transpose()?;
    let model = if args.freeze_skipped {
        acc.prepare_model_frozen(&varmap, |name| name.starts_with("skipped."))?
    } else {
        acc.prepare_model(&varmap)?
    };
    let skipped = |model: &accel_core::PreparedModel| -> Result<Vec<Vec<u32>>> {
        let weights = model.master_weights().into_iter();
        let skipped = weights.filter(|(name, _)| name.starts_with("skipped."));
        skipped.map(|(_, t)| bits(&t)).collect()
    };
    let before = skipped(&model)?;
    let mut opt = acc.prepare_optimizer(&model, AdamW::new(AdamWConfig::default()));
    let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
    let outside = candle_core::Var::ones(3, DType::F32, &Device::Cpu)?;
    let mut outcome = json!({ "ok": true });
    for step in 0..6 {
        let loss = if args.detached {
            outside.as_tensor().sqr()?.mean_all()?
        } else {
            let loss = used.forward(&x)?.sqr()?.mean_all()?;
            let loss = match args.cut {
                true => {
                    let cut = skipped_layer.forward(&x)?.apply_op1_no_bwd(&CutOp)?;
                    (loss + cut.sqr()?.mean_all()?)?
                }
                false => loss,
            };
            match &half {
                Some(h) if acc.process_index() == 0 => {
                    (loss + h.forward(&x)?.sqr()?.mean_all()?)?
                }
                _ => loss,
            }
        };
        if let Err(e) = acc.backward(&loss) {
            outcome = json!({ "ok": false, "error": e.to_string(), "step": step });
            break;
        }
        opt.step()?;
        opt.zero_grad();
    }
    outcome["unreached"] = json!(model.unreached_parameters());
    outcome["skipped_unchanged"] = json!(skipped(&model)? == before);
    if let Some(h) = &half {
        outcome["half"] = json!(bits(h.weight())?);
    }
    Ok((acc.process_index(), outcome))
}

fn failed_save(args: &Args) -> Result<(usize, serde_json::Value)> {
    let project = ProjectConfiguration::automatic(args.out.join("run"));
    let mut acc = Accelerator::new(cpu().with_seed(5).with_project(project))?;
    let mut job = TinyJob::new(&mut acc, 600, 4, accel_tests::cosine())?;
    job.train(&mut acc, 0, 1)?;
    let first = acc.save_state(None)?;
    let next = first.with_file_name("checkpoint_1");
    if acc.is_main_process() {
        // A file where the next checkpoint folder goes: the main process's
        // save fails before the other ranks hear anything from it.
        std::fs::write(&next, "in the way")?;
    }
    acc.wait_for_everyone()?;
    let started = Instant::now();
    let failed = acc.save_state(None);
    let seconds = started.elapsed().as_secs_f64();
    let error = failed.err().map(|e| e.to_string());
    let reloaded = acc.load_state(Some(&first)).map(|_| ());
    // Training goes on: the ranks are still in step.
    job.train(&mut acc, 1, 2)?;
    // Rank 0 hosts the store: nobody leaves before everyone is done.
    acc.wait_for_everyone()?;
    Ok((
        acc.process_index(),
        json!({
            "error": error,
            "seconds": seconds,
            "reload_error": reloaded.err().map(|e| e.to_string()),
            "first": exists(&first),
        }),
    ))
}

fn exists(p: &Path) -> bool {
    p.join("model.safetensors").is_file()
}

fn rng_sync() -> Result<(usize, serde_json::Value)> {
    let mut acc = Accelerator::new(cpu().with_seed(5))?;
    // Different user randomness per rank (device_specific adds the rank).
    acc.set_seed_with(5, true);
    let before = acc.rng().state();
    acc.synchronize_rng_states()?;
    let after = acc.rng().state();
    // Rank 0 hosts the store: nobody leaves before everyone is done.
    acc.wait_for_everyone()?;
    Ok((
        acc.process_index(),
        json!({ "before": before, "after": after, "seed": acc.seed() }),
    ))
}
