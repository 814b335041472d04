//! The Trainer end to end on a tiny linear regression: the loss falls,
//! logging / evaluation / checkpoints happen at the right steps, a resumed run
//! ends on the same bits as an uninterrupted one, and the batch-size finder
//! steps down as Accelerate's.

use std::collections::BTreeMap;
use std::path::Path;

use accel_core::data::TensorDataset;
use accel_core::nn::{AnyBlock, Block, Model};
use accel_core::trainer::{IntervalStrategy, Predictions, TrainModel, Trainer, TrainingArguments};
use accel_core::{find_executable_batch_size, Error, Result};
use candle_core::{Device, Tensor};
use candle_nn::{Linear, Module, VarBuilder};

/// y = x · w + b, squared error.
/// A linear regression as one block, so it also runs sharded.
struct Regression(Block<Dyn>);

type Dyn = Box<dyn Module + Send + Sync>;

impl Model for Regression {
    fn blocks(&self) -> Vec<&dyn AnyBlock> {
        vec![&self.0]
    }
}

impl TrainModel for Regression {
    type Batch = Vec<Tensor>;

    fn loss(&self, b: &Vec<Tensor>) -> Result<Tensor> {
        Ok(self
            .0
            .forward_hidden(&b[0])?
            .sub(&b[1])?
            .sqr()?
            .mean_all()?)
    }

    fn sample_losses(&self, b: &Vec<Tensor>, _n: usize) -> Result<Tensor> {
        Ok(self
            .0
            .forward_hidden(&b[0])?
            .sub(&b[1])?
            .sqr()?
            .squeeze(1)?)
    }

    fn predictions(&self, b: &Vec<Tensor>) -> Result<Option<Predictions>> {
        Ok(Some(Predictions {
            predictions: self.0.forward_hidden(&b[0])?,
            labels: b[1].clone(),
        }))
    }
}

fn build(vb: VarBuilder<'static>) -> Result<Regression> {
    let block = Block::new(&vb, "", "Linear", |vb| {
        Ok(Box::new(candle_nn::linear(3, 1, vb)?) as Dyn)
    })?;
    Ok(Regression(block))
}

/// `n` samples of a fixed linear function of deterministic inputs.
fn dataset(n: usize, offset: usize) -> TensorDataset {
    let xs: Vec<f32> = (0..n * 3)
        .map(|i| (((i + offset * 3) as f32) * 0.37).sin())
        .collect();
    let ys: Vec<f32> = xs
        .chunks(3)
        .map(|r| 2.0 * r[0] - 1.0 * r[1] + 0.5 * r[2] + 0.3)
        .collect();
    let x = Tensor::from_vec(xs, (n, 3), &Device::Cpu).unwrap();
    let y = Tensor::from_vec(ys, (n, 1), &Device::Cpu).unwrap();
    TensorDataset::new(vec![x, y]).unwrap()
}

fn args(dir: &Path) -> TrainingArguments {
    let mut a = TrainingArguments::new(dir)
        .with_batch_size(8)
        .with_learning_rate(0.05);
    a.use_cpu = true;
    a.disable_tqdm = true;
    a.save_strategy = IntervalStrategy::No;
    a
}

/// Each line of `metrics.jsonl` as (step, value names).
fn log_lines(dir: &Path) -> Vec<(u64, Vec<String>, serde_json::Value)> {
    let text = std::fs::read_to_string(dir.join("trainer/metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let names = v["values"].as_object().unwrap().keys().cloned().collect();
            (v["step"].as_u64().unwrap(), names, v["values"].clone())
        })
        .collect()
}

fn steps_with(lines: &[(u64, Vec<String>, serde_json::Value)], key: &str) -> Vec<u64> {
    lines
        .iter()
        .filter(|(_, names, _)| names.iter().any(|n| n == key))
        .map(|(s, _, _)| *s)
        .collect()
}

fn weight_bits(t: &Trainer<Regression, TensorDataset>) -> BTreeMap<String, Vec<u32>> {
    t.parameters()
        .master_weights()
        .into_iter()
        .map(|(n, w)| {
            let bits = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            (n, bits.iter().map(|x| x.to_bits()).collect())
        })
        .collect()
}

#[test]
fn the_training_loss_falls() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let a = args(dir.path()).with_max_steps(60).with_logging_steps(10);
    let mut t = Trainer::new(a, build, dataset(64, 0), None)?;
    assert_eq!(t.steps_per_epoch(), 8);
    let out = t.train()?;
    assert_eq!(out.global_step, 60);
    let losses: Vec<f64> = log_lines(dir.path())
        .iter()
        .filter_map(|(_, _, v)| v.get("loss").and_then(|l| l.as_f64()))
        .collect();
    assert_eq!(losses.len(), 6);
    assert!(
        losses[5] < losses[0] * 0.2,
        "loss did not fall enough: {losses:?}"
    );
    assert!(out.training_loss.is_finite());
    Ok(())
}

#[test]
fn logging_evaluation_and_saving_happen_at_their_steps() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let mut a = args(dir.path())
        .with_max_steps(10)
        .with_logging_steps(2)
        .with_eval_strategy(IntervalStrategy::Steps, 5)
        .with_save_strategy(IntervalStrategy::Steps, 3);
    a.save_total_limit = Some(2);
    // 32 samples in batches of 8: 4 optimizer steps an epoch, 10 steps = 2.5 epochs.
    let mut t = Trainer::new(a, build, dataset(32, 0), Some(dataset(10, 100)))?;
    t.train()?;
    let lines = log_lines(dir.path());
    assert_eq!(steps_with(&lines, "loss"), [2, 4, 6, 8, 10]);
    assert_eq!(steps_with(&lines, "eval_loss"), [5, 10]);
    assert_eq!(steps_with(&lines, "train_loss"), [10]);
    let epoch = lines[0].2["epoch"].as_f64().unwrap();
    assert_eq!(epoch, 0.5);

    // Saves at steps 3, 6, 9 are checkpoint_0..2; the limit keeps the newest two.
    let ckpts = dir.path().join("checkpoints");
    let mut names: Vec<String> = std::fs::read_dir(&ckpts)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["checkpoint_1", "checkpoint_2"]);
    let state =
        std::fs::read_to_string(ckpts.join("checkpoint_2/custom_checkpoint_0.json")).unwrap();
    let state: serde_json::Value = serde_json::from_str(&state).unwrap();
    assert_eq!(state["global_step"], 9);
    Ok(())
}

#[test]
fn epoch_strategies_act_at_every_pass() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let mut a = args(dir.path())
        .with_logging_steps(0)
        .with_save_strategy(IntervalStrategy::Epoch, 0);
    a.eval_strategy = IntervalStrategy::Epoch;
    a.num_train_epochs = 2.0;
    // 20 samples in batches of 8: 3 steps an epoch (the short batch counts).
    let mut t = Trainer::new(a, build, dataset(20, 0), Some(dataset(6, 50)))?;
    let out = t.train()?;
    assert_eq!(out.global_step, 6);
    assert_eq!(steps_with(&log_lines(dir.path()), "eval_loss"), [3, 6]);
    assert!(dir.path().join("checkpoints/checkpoint_1").is_dir());
    Ok(())
}

#[test]
fn evaluate_averages_over_samples_and_feeds_compute_metrics() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let mut a = args(dir.path());
    a.per_device_eval_batch_size = 4;
    let eval = dataset(10, 7);
    let t = Trainer::new(a, build, dataset(16, 0), Some(eval.clone()))?;
    let mut t = t.with_compute_metrics(|p: &Predictions| {
        let n = p.predictions.dim(0)? as f64;
        let mae = (p
            .predictions
            .sub(&p.labels)?
            .abs()?
            .sum_all()?
            .to_scalar::<f32>()? as f64)
            / n;
        Ok(BTreeMap::from([("mae".into(), mae), ("n".into(), n)]))
    });
    let m = t.evaluate()?;
    // Batches of 4, 4, 2: a mean of batch means would weight the last two
    // samples double; the mean over the 10 samples must not.
    let all = accel_core::data::Dataset::get_batch(&eval, &(0..10).collect::<Vec<_>>())?;
    let expected = t.model().loss(&all)?.to_scalar::<f32>()? as f64;
    assert!(
        (m["eval_loss"] - expected).abs() < 1e-6,
        "{m:?} vs {expected}"
    );
    assert_eq!(m["eval_n"], 10.0);
    assert!(m["eval_mae"] > 0.0);
    Ok(())
}

fn resumable_args(dir: &Path) -> TrainingArguments {
    // 40 samples, batches of 4, 2 micro-batches a step: 5 steps an epoch, so
    // checkpoints at steps 4 and 8 fall in the middle of epochs 0 and 1.
    let mut a = args(dir)
        .with_max_steps(12)
        .with_logging_steps(2)
        .with_save_strategy(IntervalStrategy::Steps, 4)
        .with_batch_size(4);
    a.gradient_accumulation_steps = 2;
    a.lr_scheduler_type = accel_core::trainer::SchedulerType::Cosine;
    a.warmup_ratio = 0.2;
    a
}

#[test]
fn resuming_ends_on_the_same_weights_as_an_uninterrupted_run() -> Result<()> {
    let full = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(resumable_args(full.path()), build, dataset(40, 0), None)?;
    t.train()?;
    let expected = weight_bits(&t);
    let full_log = log_lines(full.path());
    drop(t);

    // From an explicit folder (step 4), into a fresh run folder.
    let resumed = tempfile::tempdir().unwrap();
    let ckpt = full.path().join("checkpoints/checkpoint_0");
    let a = resumable_args(resumed.path()).with_resume_from_checkpoint(ckpt.to_str().unwrap());
    let mut t = Trainer::new(a, build, dataset(40, 0), None)?;
    let out = t.train()?;
    assert_eq!(out.global_step, 12);
    assert_eq!(weight_bits(&t), expected);
    // The resumed run logs the same losses from step 6 on, and saves its
    // checkpoints (steps 8 and 12) under fresh numbers.
    let log = log_lines(resumed.path());
    assert_eq!(steps_with(&log, "loss"), [6, 8, 10, 12]);
    for (step, _, v) in log.iter().filter(|l| l.2.get("loss").is_some()) {
        let same = full_log
            .iter()
            .find(|l| l.0 == *step && l.2.get("loss").is_some());
        assert_eq!(same.unwrap().2["loss"], v["loss"], "loss at step {step}");
    }
    assert!(resumed.path().join("checkpoints/checkpoint_1").is_dir());

    // "latest": the newest checkpoint of the run folder (step 8).
    let latest = tempfile::tempdir().unwrap();
    copy_dir(
        &full.path().join("checkpoints/checkpoint_1"),
        &latest.path().join("checkpoints/checkpoint_1"),
    );
    let a = resumable_args(latest.path()).with_resume_from_checkpoint("latest");
    let mut t = Trainer::new(a, build, dataset(40, 0), None)?;
    t.train()?;
    assert_eq!(weight_bits(&t), expected);
    assert!(latest.path().join("checkpoints/checkpoint_2").is_dir());
    Ok(())
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn the_batch_size_finder_steps_down_by_a_tenth_until_training_fits() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let mut tried = vec![];
    // A memory cap of 80 samples a batch, enforced by the caller as an OOM.
    let out = find_executable_batch_size(128, |bs| {
        tried.push(bs);
        if bs > 80 {
            return Err(Error::OutOfMemory {
                what: format!("batch of {bs} samples exceeds the cap of 80"),
            });
        }
        let mut a = args(dir.path()).with_max_steps(2).with_batch_size(bs);
        a.report_to = vec!["none".into()];
        Trainer::new(a, build, dataset(200, 0), None)?.train()
    })?;
    assert_eq!(tried, [128, 115, 103, 92, 82, 73]);
    assert_eq!(out.global_step, 2);
    Ok(())
}

/// A model whose weights are outside any block: FSDP could not reach them.
struct Loose(Linear);

impl Model for Loose {}

impl TrainModel for Loose {
    type Batch = Vec<Tensor>;

    fn loss(&self, b: &Vec<Tensor>) -> Result<Tensor> {
        Ok(self.0.forward(&b[0])?.sub(&b[1])?.sqr()?.mean_all()?)
    }
}

#[test]
fn trainer_with_fsdp_trains_the_same_model_like_without_and_weights_outside_blocks_are_refused() {
    let plain_dir = tempfile::tempdir().unwrap();
    let mut plain = Trainer::new(
        args(plain_dir.path()).with_max_steps(12),
        build,
        dataset(64, 0),
        None,
    )
    .unwrap();
    let want = plain.train().unwrap();
    let want_weights = plain.parameters().full_weights().unwrap();

    let dir = tempfile::tempdir().unwrap();
    let mut a = args(dir.path()).with_max_steps(12);
    a.fsdp = "full_shard".into();
    a.accelerator_config.non_blocking = true;
    let mut sharded = Trainer::new(a.clone(), build, dataset(64, 0), None).unwrap();
    assert!(sharded.parameters().is_sharded());
    let got = sharded.train().unwrap();
    assert_eq!(got.global_step, 12);
    assert!(
        (got.training_loss - want.training_loss).abs() < 1e-6,
        "{got:?} vs {want:?}"
    );
    let got_weights = sharded.parameters().full_weights().unwrap();
    for ((n, w), (m, g)) in want_weights.iter().zip(&got_weights) {
        assert_eq!(n, m);
        let d = (w - g)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(d < 1e-6, "{n}: {d}");
    }

    let other = tempfile::tempdir().unwrap();
    a.output_dir = other.path().to_path_buf();
    let loose =
        |vb: VarBuilder<'static>| -> Result<Loose> { Ok(Loose(candle_nn::linear(3, 1, vb)?)) };
    let err = match Trainer::new(a, loose, dataset(64, 0), None) {
        Ok(_) => panic!("weights outside blocks must be refused under FSDP"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("`weight` is in no block"), "{err}");
}
