//! An evaluation process driven by the integration tests: iterates a
//! prepared loader over sample ids, gathers them with `gather_for_metrics`
//! and pads a per-rank tensor with `pad_across_processes`, writing what the
//! main process saw as JSON.

use std::path::PathBuf;

use accel_core::data::{DataLoader, DataLoaderConfig, TensorDataset};
use accel_core::{Accelerator, AcceleratorConfig};
use anyhow::Result;
use candle_core::{Device, Tensor};
use clap::Parser;

#[derive(Parser)]
struct Args {
    /// Samples in the dataset.
    #[arg(long)]
    samples: u32,
    /// Batch size per process.
    #[arg(long)]
    batch_size: usize,
    /// Where the main process writes its JSON.
    #[arg(long)]
    out: PathBuf,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mut acc = Accelerator::new(
        AcceleratorConfig::default()
            .with_seed(3)
            .with_device(Device::Cpu),
    )?;
    let ids = Tensor::arange(0u32, args.samples, &Device::Cpu)?;
    let loader = acc.prepare_data_loader(DataLoader::new(
        TensorDataset::new(vec![ids])?,
        DataLoaderConfig::new(args.batch_size).with_shuffle(true),
    ));
    let mut seen: Vec<u32> = vec![];
    let mut local_batches = 0;
    for batch in loader.iter() {
        let batch = batch?;
        local_batches += 1;
        seen.extend(acc.gather_for_metrics(&batch[0])?.to_vec1::<u32>()?);
    }
    // Rank r holds r + 1 values; padding brings every rank to the longest.
    let r = acc.process_index() as u32;
    let mine = Tensor::full(r, (r + 1) as usize, &Device::Cpu)?;
    let padded = acc.pad_across_processes(&mine, 0, 99.0, false)?;
    let gathered = acc.gather(&padded)?.to_vec1::<u32>()?;
    let batches = acc
        .gather(&Tensor::new(&[local_batches as u32], &Device::Cpu)?)?
        .to_vec1::<u32>()?;
    if acc.is_main_process() {
        let out = serde_json::json!({ "seen": seen, "padded": gathered, "batches": batches });
        std::fs::write(&args.out, out.to_string())?;
    }
    Ok(())
}
