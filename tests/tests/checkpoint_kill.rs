//! Killing a process while it saves checkpoints never leaves a partial one:
//! every `checkpoint_*` folder that exists loads completely.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use accel_core::{Accelerator, AcceleratorConfig, ProjectConfiguration};
use accel_tests::TinyJob;

#[test]
fn killing_the_process_mid_save_leaves_only_complete_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    for round in 0..4u64 {
        let mut child = Command::new(env!("CARGO_BIN_EXE_train_worker"))
            .arg("--dir")
            .arg(dir.path())
            .args(["--steps", "0", "--save-forever"])
            .args(if round > 0 { vec!["--resume"] } else { vec![] })
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Let it save a few checkpoints, then kill it at a varying moment.
        let deadline = Instant::now() + Duration::from_secs(60);
        let ckpts = dir.path().join("checkpoints");
        let target = newest(&ckpts).map_or(1, |b| b + 2);
        while newest(&ckpts).is_none_or(|n| n < target) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(7 * round));
        child.kill().unwrap();
        child.wait().unwrap();

        let listed: Vec<_> = std::fs::read_dir(&ckpts)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with("checkpoint_"))
            .collect();
        assert!(!listed.is_empty());
        assert!(listed.len() <= 3, "total_limit 3 exceeded: {listed:?}");
        for name in listed {
            let mut acc = Accelerator::new(
                AcceleratorConfig::default()
                    .with_seed(5)
                    .with_gradient_accumulation_steps(2)
                    .with_project(ProjectConfiguration::automatic(dir.path())),
            )
            .unwrap();
            let _job = TinyJob::new(&mut acc, 600, 4, accel_tests::cosine()).unwrap();
            acc.load_state(Some(&ckpts.join(&name)))
                .unwrap_or_else(|e| panic!("round {round}: {name} does not load: {e}"));
        }
    }
}

/// The number of the newest complete checkpoint folder.
fn newest(dir: &std::path::Path) -> Option<u64> {
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_string_lossy()
                .strip_prefix("checkpoint_")?
                .parse()
                .ok()
        })
        .max()
}
