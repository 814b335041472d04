//! Tests of [`CheckpointSource`].

use super::*;
use crate::checkpoint::test_files::{write, write_sharded};
use candle_nn::var_builder::VarBuilder;

fn cpu() -> Device {
    Device::Cpu
}

fn two_shards(dir: &Path) -> PathBuf {
    let a = Tensor::new(&[[1f32, 2.], [3., 4.]], &cpu()).unwrap();
    let b = Tensor::new(&[5f32, 6.], &cpu()).unwrap();
    let c = Tensor::new(&[7u32], &cpu()).unwrap();
    write_sharded(
        dir,
        &[
            (
                "model-00001-of-00002.safetensors",
                vec![("l.weight", a), ("l.bias", b)],
            ),
            ("model-00002-of-00002.safetensors", vec![("steps", c)]),
        ],
    )
}

#[test]
fn a_sharded_folder_is_found_through_its_index_and_located_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let index = two_shards(dir.path());
    let source = CheckpointSource::open(dir.path()).unwrap();
    assert_eq!(source.index().unwrap().path(), index);
    assert_eq!(
        source.names().collect::<Vec<_>>(),
        ["l.bias", "l.weight", "steps"]
    );
    let files: Vec<_> = source.files().map(Path::to_path_buf).collect();
    assert_eq!(
        files,
        [
            dir.path().join("model-00001-of-00002.safetensors"),
            dir.path().join("model-00002-of-00002.safetensors")
        ]
    );
    let at = source.locate("steps").unwrap();
    assert_eq!(at.file, files[1]);
    assert_eq!((at.shape(), at.dtype()), (&[1usize][..], Some(DType::U32)));
    // The byte range really holds the tensor: read it back from the file.
    let bytes = std::fs::read(at.file).unwrap();
    let range = at.byte_range.start as usize..at.byte_range.end as usize;
    assert_eq!(&bytes[range], &7u32.to_le_bytes());
    // Opening the index file itself is the same checkpoint.
    assert_eq!(CheckpointSource::open(&index).unwrap().len(), 3);
}

#[test]
fn tensors_convert_on_the_way_out_exactly_as_candle_would() {
    let dir = tempfile::tempdir().unwrap();
    let w = Tensor::new(&[1.0f32 / 3.0, -0.0, 65504.0, 1e-8, f32::NAN], &cpu()).unwrap();
    let path = write(&dir.path().join("m.safetensors"), &[("w", w.clone())]);
    let source = CheckpointSource::open(&path).unwrap();
    for dtype in [DType::BF16, DType::F16, DType::F64, DType::F32] {
        let got = source.tensor("w", &cpu(), Some(dtype)).unwrap();
        let want = w.to_dtype(dtype).unwrap();
        assert_eq!(got.dtype(), dtype);
        let bits = |t: &Tensor| t.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
        let (g, e) = (bits(&got), bits(&want));
        assert!(
            g.iter().zip(&e).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{dtype:?}: {g:?} vs {e:?}"
        );
    }
    assert_eq!(
        source.tensor("w", &cpu(), None).unwrap().dtype(),
        DType::F32
    );
}

#[test]
fn a_model_builds_straight_from_the_checkpoint_and_a_wrong_shape_names_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    two_shards(dir.path());
    let source = CheckpointSource::open(dir.path()).unwrap();
    let vb = VarBuilder::from_backend(Box::new(source), DType::F16, cpu());
    let linear = candle_nn::linear(2, 2, vb.pp("l")).unwrap();
    assert_eq!(linear.weight().dtype(), DType::F16);
    assert_eq!(
        linear
            .bias()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap(),
        vec![5., 6.]
    );
    let err = candle_nn::linear(3, 2, vb.pp("l")).unwrap_err().to_string();
    let shard = dir.path().join("model-00001-of-00002.safetensors");
    assert!(
        err.contains(&format!(
            "{}: tensor `l.weight` has shape [2, 2], expected [2, 3]",
            shard.display()
        )),
        "{err}"
    );
    let err = candle_nn::linear(2, 2, vb.pp("nope"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("no tensor named `nope.weight`"), "{err}");
}

#[test]
fn a_missing_shard_names_the_shard_and_the_index() {
    let dir = tempfile::tempdir().unwrap();
    let index = two_shards(dir.path());
    let shard = dir.path().join("model-00002-of-00002.safetensors");
    std::fs::remove_file(&shard).unwrap();
    match CheckpointSource::open(dir.path()).unwrap_err() {
        Error::MissingFile { path, what } => {
            assert_eq!(path, shard);
            assert_eq!(
                what,
                format!(
                    "shard listed in {} for 1 tensor(s), e.g. `steps`",
                    index.display()
                )
            );
        }
        other => panic!("{other}"),
    }
}

#[test]
fn an_index_entry_its_shard_lacks_names_tensor_shard_and_index() {
    let dir = tempfile::tempdir().unwrap();
    let index = two_shards(dir.path());
    let text = std::fs::read_to_string(&index).unwrap();
    std::fs::write(
        &index,
        text.replace("\"steps\": \"model-00002", "\"steps\": \"model-00001"),
    )
    .unwrap();
    match CheckpointSource::open(dir.path()).unwrap_err() {
        Error::Safetensors {
            path,
            tensor,
            reason,
        } => {
            assert_eq!(path, dir.path().join("model-00001-of-00002.safetensors"));
            assert_eq!(tensor.as_deref(), Some("steps"));
            assert_eq!(
                reason,
                format!(
                    "{} maps tensor `steps` to this shard, but the shard does not hold it",
                    index.display()
                )
            );
        }
        other => panic!("{other}"),
    }
}

#[test]
fn folders_without_or_with_several_indexes_and_pickles_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let err = CheckpointSource::open(dir.path()).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "{}: not a folder containing a `.index.json` file or a model.safetensors file",
            dir.path().display()
        )
    );
    two_shards(dir.path());
    std::fs::write(dir.path().join("other.safetensors.index.json"), "{}").unwrap();
    let err = CheckpointSource::open(dir.path()).unwrap_err();
    assert!(
        err.to_string().ends_with(
            "folder contains more than one `.index.json` file, delete the irrelevant ones."
        ),
        "{err}"
    );
    let bin = dir.path().join("pytorch_model.bin");
    std::fs::write(&bin, b"pickle").unwrap();
    assert!(matches!(
        CheckpointSource::open(&bin).unwrap_err(),
        Error::InvalidCheckpoint { path, .. } if path == bin
    ));
    let nothing = dir.path().join("nothing");
    assert!(matches!(
        CheckpointSource::open(&nothing).unwrap_err(),
        Error::MissingFile { path, .. } if path == nothing
    ));
}

/// The resident KiB of the mappings of `path` (`/proc/self/smaps`), or
/// `None` where the kernel does not tell.
fn mapped_rss_kib(path: &Path) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let name = path.canonicalize().ok()?.display().to_string();
    let mut total = 0;
    let mut inside = false;
    for line in smaps.lines() {
        if line.contains('-') && line.split_whitespace().count() >= 5 && !line.ends_with(" kB") {
            inside = line.ends_with(&name);
        } else if inside {
            if let Some(kib) = line.strip_prefix("Rss:") {
                total += kib
                    .trim()
                    .trim_end_matches(" kB")
                    .trim()
                    .parse::<u64>()
                    .ok()?;
            }
        }
    }
    Some(total)
}

/// Tensors copied out of a checkpoint (converted to another dtype) leave
/// none of the file's pages resident: loading never holds a model twice.
#[test]
fn converted_tensors_leave_no_file_pages_resident() {
    let dir = tempfile::tempdir().unwrap();
    let tensors: Vec<(&str, Tensor)> = ["a", "b", "c", "d"]
        .into_iter()
        .map(|n| (n, Tensor::ones((512, 512), DType::F32, &cpu()).unwrap()))
        .collect();
    let path = write(&dir.path().join("m.safetensors"), &tensors);
    let source = CheckpointSource::open(&path).unwrap();
    let Some(before) = mapped_rss_kib(&path) else {
        return; // no /proc/self/smaps here
    };
    let copies: Vec<Tensor> = ["a", "b", "c", "d"]
        .iter()
        .map(|n| source.tensor(n, &cpu(), Some(DType::BF16)).unwrap())
        .collect();
    assert_eq!(copies.len(), 4);
    let after = mapped_rss_kib(&path).unwrap();
    // 4 MiB were read; at most the header's page may stay.
    assert!(
        after <= before.max(8),
        "{after} KiB of the file stay resident (before: {before})"
    );
}
