//! The Trainer on an HF folder (`HfLm`) with settings from the command line,
//! for the multi-process tests of `TrainingArguments::deepspeed` and
//! `fsdp`: prints, from the main process, one JSON line with the loss and
//! learning rate of every step.
//!
//! ```text
//! trainer_worker MODEL_DIR IDS_JSON OUT_DIR STEPS [--deepspeed PATH] [--fsdp WORDS] [--fsdp-config JSON|PATH]
//!     [--ddp-timeout SECS] [--ddp-backend NAME] [--dataloader-num-workers N] [--save]
//! ```

use accel_core::data::TensorDataset;
use accel_core::models::ModelConfig;
use accel_core::trainer::{IntervalStrategy, Trainer, TrainingArguments};
use accel_examples::hf::HfLm;
use anyhow::{Context, Result};
use candle_core::{Device, Tensor};

fn main() -> Result<()> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let [model, ids, out, steps] = [0, 1, 2, 3].map(|i| argv.get(i).cloned().unwrap_or_default());
    let opt = |name: &str| {
        argv.iter()
            .position(|a| a == name)
            .and_then(|i| argv.get(i + 1).cloned())
    };
    let rows: Vec<Vec<u32>> = serde_json::from_str(&std::fs::read_to_string(&ids)?)?;
    let t = Tensor::from_vec(rows.concat(), (rows.len(), rows[0].len()), &Device::Cpu)?;
    let mut args = TrainingArguments::new(&out)
        .with_max_steps(steps.parse().context("STEPS")?)
        .with_batch_size(1)
        .with_learning_rate(1e-2)
        .with_logging_steps(1)
        .with_save_strategy(IntervalStrategy::No, 0);
    args.gradient_accumulation_steps = 2;
    args.warmup_steps = 2;
    args.weight_decay = 0.01;
    args.use_cpu = true;
    args.disable_tqdm = true;
    args.report_to = vec!["jsonl".into()];
    args.run_name = "run".into();
    if let Some(ds) = opt("--deepspeed") {
        args.deepspeed = Some(serde_json::Value::String(ds));
    }
    if let Some(t) = opt("--ddp-timeout") {
        args.ddp_timeout = Some(t.parse().context("--ddp-timeout")?);
    }
    if let Some(n) = opt("--dataloader-num-workers") {
        args.dataloader_num_workers = n.parse().context("--dataloader-num-workers")?;
    }
    if let Some(b) = opt("--ddp-backend") {
        args.ddp_backend = Some(b);
    }
    if let Some(words) = opt("--fsdp") {
        args.fsdp = words;
    }
    if let Some(c) = opt("--fsdp-config") {
        // A JSON object, or the path of a file holding one.
        let v = if c.trim_start().starts_with('{') {
            serde_json::from_str(&c)?
        } else {
            serde_json::Value::String(c)
        };
        args.fsdp_config = serde_json::from_value(v)?;
    }
    let cfg = ModelConfig::from_path(&model)?;
    let data = TensorDataset::new(vec![t])?;
    let mut trainer = Trainer::from_pretrained(args, &model, |vb| HfLm::new(&cfg, vb), data, None)?;
    trainer.train()?;
    if argv.iter().any(|a| a == "--save") {
        trainer.save_model(std::path::Path::new(&out).join("model"))?;
    }
    // This rank's fp32 pieces (what the optimizer steps and keeps state for)
    // against the whole model, gathered (every rank takes part).
    let pieces = trainer.parameters().num_parameters();
    let full: usize = trainer
        .parameters()
        .full_weights()?
        .iter()
        .map(|(_, t)| t.elem_count())
        .sum();
    if trainer.accelerator().is_main_process() {
        let log = std::fs::read_to_string(std::path::Path::new(&out).join("run/metrics.jsonl"))?;
        let (mut losses, mut lrs) = (vec![], vec![]);
        for line in log.lines() {
            let v: serde_json::Value = serde_json::from_str(line)?;
            let v = &v["values"];
            if let (Some(l), Some(lr)) = (v["loss"].as_f64(), v["learning_rate"].as_f64()) {
                losses.push(l);
                lrs.push(lr);
            }
        }
        let config = trainer.accelerator().config();
        let sharding = config.fsdp.as_ref().map(|p| p.sharding_strategy.name());
        let offload = config.fsdp.as_ref().is_some_and(|p| p.cpu_offload);
        println!(
            "{}",
            serde_json::json!({"losses": losses, "lrs": lrs, "sharding": sharding, "offload": offload, "pieces": pieces, "full": full, "world": trainer.accelerator().num_processes()})
        );
    }
    Ok(())
}
