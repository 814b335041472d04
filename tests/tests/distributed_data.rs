//! Distributed data loading across real processes: every rank draws its
//! share of one seeded order, `even_batches` pads the last step, and
//! `gather_for_metrics` hands back each sample exactly once.

use accel_core::dist::launch::{plan, run, LaunchConfig, RunOptions};
use serde_json::Value;

fn eval(world: usize, samples: u32, batch: usize) -> Value {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.json");
    let mut config = LaunchConfig::local(world, env!("CARGO_BIN_EXE_eval_worker"));
    config.args = vec![
        "--samples".into(),
        samples.to_string().into(),
        "--batch-size".into(),
        batch.to_string().into(),
        "--out".into(),
        out.clone().into_os_string(),
    ];
    config.timeout = Some(std::time::Duration::from_secs(60));
    run(&plan(&config).unwrap(), &RunOptions::default()).unwrap();
    serde_json::from_str(&std::fs::read_to_string(out).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

#[test]
fn gather_for_metrics_returns_every_sample_once_at_two_and_three_ranks() {
    for (world, samples, batch) in [(2, 23, 4), (3, 23, 4), (3, 24, 4), (2, 5, 4)] {
        let v = eval(world, samples, batch);
        let mut seen = ids(&v["seen"]);
        seen.sort_unstable();
        assert_eq!(
            seen,
            (0..samples as u64).collect::<Vec<_>>(),
            "world {world}, {samples} samples"
        );
        // even_batches: every rank ran the same number of steps.
        let batches = ids(&v["batches"]);
        assert!(batches.iter().all(|&b| b == batches[0]), "{batches:?}");
        assert_eq!(
            batches[0],
            (samples as u64).div_ceil((world * batch) as u64)
        );
    }
}

#[test]
fn pad_across_processes_pads_to_the_longest_rank() {
    let v = eval(3, 6, 2);
    assert_eq!(ids(&v["padded"]), vec![0, 99, 99, 1, 1, 99, 2, 2, 2]);
}
