use std::collections::HashMap;

use super::setting::{read_setting, NOT_A_WORD, NO_ALLOCATOR};
use super::*;

/// A safetensors file of `w` (f32, 3 x 1024: 12 KiB, so it spans whole
/// pages) and `b` (bf16, 5), with each tensor's byte offset in the file.
fn write_file(dir: &Path) -> (std::path::PathBuf, Tensor, Tensor, HashMap<String, u64>) {
    let w = Tensor::arange(0f32, 3072., &Device::Cpu)
        .unwrap()
        .affine(0.25, -3.0)
        .unwrap()
        .reshape((3, 1024))
        .unwrap();
    let b = Tensor::new(&[1.5f32, -2.0, 3.25, 0.0, 7.0], &Device::Cpu)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let path = dir.join("m.safetensors");
    let map: HashMap<String, Tensor> =
        [("w".to_string(), w.clone()), ("b".to_string(), b.clone())].into();
    candle_core::safetensors::save(&map, &path).unwrap();
    let header = crate::SafetensorsHeader::read(&path).unwrap();
    let offsets = ["w", "b"]
        .iter()
        .map(|n| (n.to_string(), header.byte_range(n).unwrap().start))
        .collect();
    (path, w, b, offsets)
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

fn live_in(region: &MappedRegion) -> usize {
    REGISTRY[region.slot].lock().live.len()
}

#[test]
fn the_unit_tests_run_with_the_allocator_installed() {
    assert!(INSTALLED.load(Ordering::Relaxed));
}

#[test]
fn a_mapped_tensor_holds_the_file_values_without_a_copy_and_is_released_when_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let (path, w, b, at) = write_file(dir.path());
    let region = MappedRegion::open(&path)
        .unwrap()
        .expect("mapping is enabled");
    let mw = region.tensor(at["w"], DType::F32, &[3, 1024]).unwrap();
    let mb = region.tensor(at["b"], DType::BF16, &[5]).unwrap();
    assert_eq!(bits(&mw), bits(&w));
    assert_eq!(bits(&mb), bits(&b));
    assert!(is_mapped(&mw) && is_mapped(&mb));
    assert!(!is_mapped(&w));
    // Its storage is the file's bytes inside the mapping.
    let key = accel_kernels::storage_key(&mw).unwrap();
    assert_eq!(key, region.base + at["w"] as usize);
    assert_eq!(live_in(&region), 2);
    // The same bytes are never handed out twice while live...
    assert!(region.tensor(at["w"], DType::F32, &[3, 1024]).is_none());
    let view = mw.narrow(0, 1, 1).unwrap();
    drop(mw);
    // ...and a view keeps the storage alive.
    assert_eq!(live_in(&region), 2);
    assert_eq!(bits(&view), bits(&w.narrow(0, 1, 1).unwrap()));
    drop(view);
    assert_eq!(live_in(&region), 1);
    // (While `b` lives, the page `w` shares with it stays unclaimable:
    // `w` might have written to it.)
    drop(mb);
    assert_eq!(live_in(&region), 0);
    let again = region.tensor(at["w"], DType::F32, &[3, 1024]).unwrap();
    assert_eq!(bits(&again), bits(&w));
}

#[test]
fn out_of_range_misaligned_and_overlapping_requests_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _, _, at) = write_file(dir.path());
    let region = MappedRegion::open(&path).unwrap().unwrap();
    let len = region.len as u64;
    assert!(
        region.tensor(len - 4, DType::F32, &[2]).is_none(),
        "past the end"
    );
    assert!(
        region.tensor(at["w"] + 1, DType::F32, &[4]).is_none(),
        "misaligned"
    );
    let head = region.tensor(at["w"], DType::F32, &[8]).unwrap();
    assert!(
        region.tensor(at["w"] + 28, DType::F32, &[2]).is_none(),
        "overlaps the head"
    );
    let next = region.tensor(at["w"] + 32, DType::F32, &[2]).unwrap();
    assert_eq!(next.to_vec1::<f32>().unwrap(), vec![-1.0, -0.75]);
    drop(head);
    assert_eq!(live_in(&region), 1);
}

#[test]
fn writes_to_a_mapped_tensor_stay_in_the_process_and_die_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let (path, w, _, at) = write_file(dir.path());
    let before = std::fs::read(&path).unwrap();
    let region = MappedRegion::open(&path).unwrap().unwrap();
    let var = region.tensor(at["w"], DType::F32, &[3, 1024]).unwrap();
    accel_kernels::with_slice_mut::<f32, ()>(&var, "test", |s| {
        s.fill(9.0);
        Ok(())
    })
    .unwrap();
    assert!(var
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .all(|v| *v == 9.0));
    assert_eq!(
        std::fs::read(&path).unwrap(),
        before,
        "the file is unchanged"
    );
    // `b` shares a page with `w`: while it lives, that written page cannot
    // be dropped, so no tensor may be handed out over it.
    let b = region.tensor(at["b"], DType::BF16, &[5]).unwrap();
    drop(var);
    assert!(region.tensor(at["w"], DType::F32, &[3, 1024]).is_none());
    drop(b);
    // The written pages were dropped with the tensors: the next one over the
    // same bytes sees the file again.
    let fresh = region.tensor(at["w"], DType::F32, &[3, 1024]).unwrap();
    assert_eq!(bits(&fresh), bits(&w));
}

#[test]
fn growing_a_mapped_vec_moves_it_out_of_the_mapping() {
    let dir = tempfile::tempdir().unwrap();
    let (path, w, _, at) = write_file(dir.path());
    let region = MappedRegion::open(&path).unwrap().unwrap();
    let start = region.base + at["w"] as usize;
    let mut v = region.claim_vec::<f32>(start, 3072).unwrap();
    assert_eq!(v.as_ptr() as usize, start);
    v.push(1.0);
    assert_ne!(v.as_ptr() as usize, start);
    assert_eq!(live_in(&region), 0, "the mapped range was released");
    let want = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(&v[..3072], &want[..]);
    assert_eq!(v[3072], 1.0);
}

#[test]
fn the_file_stays_mapped_until_the_handle_and_every_tensor_are_gone() {
    let dir = tempfile::tempdir().unwrap();
    let (path, w, _, at) = write_file(dir.path());
    let region = MappedRegion::open(&path).unwrap().unwrap();
    let (slot, base) = (region.slot, region.base);
    let t = region.tensor(at["w"], DType::F32, &[3, 1024]).unwrap();
    drop(region);
    // The tensor outlives its handle and still reads the file.
    assert!(REGISTRY[slot].lo.load(Ordering::SeqCst) == base);
    assert_eq!(bits(&t), bits(&w));
    drop(t);
    let state = REGISTRY[slot].lock();
    let reused = REGISTRY[slot].lo.load(Ordering::SeqCst) != base;
    assert!(
        state.map.is_none() || reused,
        "unmapped once the last tensor went"
    );
}

#[test]
fn the_loader_serves_mapped_weights_and_reads_what_it_cannot_map() {
    use crate::offload::WeightSource;
    let dir = tempfile::tempdir().unwrap();
    let (path, w, b, _) = write_file(dir.path());
    let source = crate::CheckpointSource::open(&path).unwrap();
    let same = crate::OffloadedWeightsLoader::from_checkpoint(&source, ["w", "b"], None).unwrap();
    let a = same.load("w", &Device::Cpu).unwrap();
    assert!(is_mapped(&a));
    assert_eq!(bits(&a), bits(&w));
    // Asked again while `a` lives: a copy, not the same bytes twice.
    let c = same.load("w", &Device::Cpu).unwrap();
    assert!(!is_mapped(&c));
    assert_eq!(bits(&c), bits(&w));
    // No staging buffer for what can be mapped.
    let pool = crate::StagingPool::new();
    assert!(same
        .load_staged("b", &[5], DType::BF16, &pool)
        .unwrap()
        .is_none());
    // A conversion is computed, so it is never mapped.
    let cast =
        crate::OffloadedWeightsLoader::from_checkpoint(&source, ["b"], Some(DType::F32)).unwrap();
    let f = cast.load("b", &Device::Cpu).unwrap();
    assert!(!is_mapped(&f));
    assert_eq!(f.dtype(), DType::F32);
    assert_eq!(bits(&f), bits(&b));
}

#[test]
fn a_checkpoint_source_maps_cpu_tensors_in_their_stored_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let (path, w, b, _) = write_file(dir.path());
    let source = crate::CheckpointSource::open(&path).unwrap();
    let mw = source.tensor("w", &Device::Cpu, Some(DType::F32)).unwrap();
    let mb = source.tensor("b", &Device::Cpu, None).unwrap();
    assert!(is_mapped(&mw) && is_mapped(&mb));
    assert_eq!((bits(&mw), bits(&mb)), (bits(&w), bits(&b)));
    let cast = source.tensor("b", &Device::Cpu, Some(DType::F32)).unwrap();
    assert!(!is_mapped(&cast));
    assert_eq!(bits(&cast), bits(&b));
    // The tensors outlive the source that mapped them.
    drop(source);
    assert_eq!(bits(&mw), bits(&w));
}

#[test]
fn threads_claiming_and_dropping_tensors_over_shared_files_see_the_files_values() {
    // Four threads, each opening its own handles to two shared files and
    // taking tensors over them, in different orders, while the others do
    // the same: every tensor handed out holds the file's values and the
    // same bytes are never handed out twice at once.
    let dir = tempfile::tempdir().unwrap();
    let sub = |i: usize| {
        let d = dir.path().join(i.to_string());
        std::fs::create_dir(&d).unwrap();
        write_file(&d)
    };
    let files = [sub(0), sub(1)];
    std::thread::scope(|s| {
        for t in 0..4 {
            let files = &files;
            s.spawn(move || {
                for round in 0..50 {
                    let (path, w, b, at) = &files[(t + round) % 2];
                    let region = MappedRegion::open(path).unwrap().unwrap();
                    let mw = region.tensor(at["w"], DType::F32, &[3, 1024]);
                    let mb = region.tensor(at["b"], DType::BF16, &[5]);
                    if let Some(mw) = &mw {
                        assert_eq!(bits(mw), bits(w));
                        assert!(region.tensor(at["w"], DType::F32, &[3, 1024]).is_none());
                        // Grow the storage of a copy: the mapping is untouched.
                        let grown = mw.pad_with_zeros(0, 0, 1).unwrap();
                        assert_eq!(grown.dims(), [4, 1024]);
                    }
                    if let Some(mb) = &mb {
                        assert_eq!(bits(mb), bits(b));
                    }
                    drop((mw, mb, region));
                }
            });
        }
    });
}

#[test]
fn the_setting_turns_mapping_off_and_names_what_cannot_act() {
    assert_eq!(read_setting(None, true), (true, None));
    assert_eq!(read_setting(Some(" OFF "), true), (false, None));
    assert_eq!(read_setting(Some("0"), false), (false, None));
    assert_eq!(read_setting(Some("1"), true), (true, None));
    assert_eq!(read_setting(Some("yes"), false), (true, Some(NO_ALLOCATOR)));
    assert_eq!(read_setting(Some("maybe"), true), (true, Some(NOT_A_WORD)));
}
