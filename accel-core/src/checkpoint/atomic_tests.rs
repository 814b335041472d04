//! Tests of atomic checkpoint folders and checkpoint rotation.

use super::*;

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

#[test]
fn temp_folder_is_a_hidden_sibling_of_the_final_one() {
    let root = tempfile::tempdir().unwrap();
    let d = AtomicDir::begin(root.path().join("checkpoint_0")).unwrap();
    let tmp_name = d.path().file_name().unwrap().to_str().unwrap().to_string();
    let prefix = format!(".checkpoint_0.tmp-{}-", std::process::id());
    assert!(tmp_name.starts_with(&prefix), "{tmp_name}");
    assert_eq!(d.path().parent().unwrap(), root.path());
    assert_eq!(d.final_path(), root.path().join("checkpoint_0"));
}

#[test]
fn drop_without_commit_leaves_no_final_folder_and_no_temp() {
    let root = tempfile::tempdir().unwrap();
    let final_dir = root.path().join("checkpoint_0");
    {
        let d = AtomicDir::begin(&final_dir).unwrap();
        fs::write(d.path().join("model.safetensors"), b"partial").unwrap();
    }
    assert!(!final_dir.exists());
    assert!(names(root.path()).is_empty());
}

#[test]
fn commit_publishes_nested_files() {
    let root = tempfile::tempdir().unwrap();
    let final_dir = root.path().join("ckpts").join("checkpoint_1");
    let d = AtomicDir::begin(&final_dir).unwrap();
    fs::create_dir(d.path().join("sub")).unwrap();
    fs::write(d.path().join("sub").join("a.json"), b"1").unwrap();
    fs::write(d.path().join("b.json"), b"2").unwrap();
    assert_eq!(d.commit().unwrap(), final_dir);
    assert_eq!(
        fs::read(final_dir.join("sub").join("a.json")).unwrap(),
        b"1"
    );
    assert_eq!(fs::read(final_dir.join("b.json")).unwrap(), b"2");
    assert_eq!(names(&root.path().join("ckpts")), vec!["checkpoint_1"]);
}

#[test]
fn commit_replaces_an_existing_folder_entirely() {
    let root = tempfile::tempdir().unwrap();
    let final_dir = root.path().join("checkpoint_2");
    fs::create_dir(&final_dir).unwrap();
    fs::write(final_dir.join("old_only.bin"), b"old").unwrap();
    fs::write(final_dir.join("shared.json"), b"old").unwrap();
    let d = AtomicDir::begin(&final_dir).unwrap();
    fs::write(d.path().join("shared.json"), b"new").unwrap();
    d.commit().unwrap();
    assert_eq!(names(&final_dir), vec!["shared.json"]);
    assert_eq!(fs::read(final_dir.join("shared.json")).unwrap(), b"new");
    // Neither the temp nor the `.old-` copy survives.
    assert_eq!(names(root.path()), vec!["checkpoint_2"]);
}

#[test]
fn list_checkpoints_sorts_numerically_and_skips_others() {
    let root = tempfile::tempdir().unwrap();
    for n in [
        "checkpoint_10",
        "checkpoint_9",
        "checkpoint_0",
        "checkpoint_x",
        "checkpoint_",
        ".checkpoint_11.tmp-1-2",
    ] {
        fs::create_dir(root.path().join(n)).unwrap();
    }
    fs::write(root.path().join("checkpoint_12"), b"a file, not a folder").unwrap();
    let got: Vec<(u64, String)> = list_checkpoints(root.path())
        .unwrap()
        .into_iter()
        .map(|(n, p)| (n, p.file_name().unwrap().to_str().unwrap().to_string()))
        .collect();
    assert_eq!(
        got,
        vec![
            (0, "checkpoint_0".to_string()),
            (9, "checkpoint_9".to_string()),
            (10, "checkpoint_10".to_string())
        ]
    );
    assert!(list_checkpoints(root.path().join("absent"))
        .unwrap()
        .is_empty());
    assert_eq!(
        checkpoint_path(root.path(), 7),
        root.path().join("checkpoint_7")
    );
}

#[test]
fn enforce_total_limit_keeps_room_for_the_next_save() {
    let root = tempfile::tempdir().unwrap();
    for n in [1, 2, 3, 10, 20] {
        fs::create_dir(checkpoint_path(root.path(), n)).unwrap();
    }
    // 5 present, limit 3: remove 5 + 1 - 3 = 3 oldest.
    let removed = enforce_total_limit(root.path(), 3).unwrap();
    assert_eq!(
        removed,
        vec![
            checkpoint_path(root.path(), 1),
            checkpoint_path(root.path(), 2),
            checkpoint_path(root.path(), 3)
        ]
    );
    assert_eq!(names(root.path()), vec!["checkpoint_10", "checkpoint_20"]);
    // 2 present, limit 3: the next save makes 3, nothing to remove.
    assert!(enforce_total_limit(root.path(), 3).unwrap().is_empty());
    assert_eq!(enforce_total_limit(root.path(), 1).unwrap().len(), 2);
    assert!(names(root.path()).is_empty());
}

#[test]
fn clean_stale_temps_removes_crash_leftovers_and_restores_old_folders() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let other = 999_999_999u32; // not this process
    for n in [
        format!(".checkpoint_3.tmp-{other}-123"),
        format!(".checkpoint_1.del-{other}-5"),
        format!(".checkpoint_4.old-{other}"),
        format!(".checkpoint_5.old-{other}"),
        format!(".checkpoint_6.tmp-{}-1", std::process::id()),
        "checkpoint_5".to_string(),
        "checkpoint_7".to_string(),
    ] {
        fs::create_dir(r.join(n)).unwrap();
    }
    fs::write(r.join(format!("model.safetensors.tmp-{other}")), b"x").unwrap();
    fs::write(r.join("notes.tmp-later"), b"keep").unwrap();
    let touched = clean_stale_temps(r).unwrap();
    assert_eq!(touched.len(), 5);
    assert_eq!(
        names(r),
        vec![
            format!(".checkpoint_6.tmp-{}-1", std::process::id()),
            "checkpoint_4".to_string(),
            "checkpoint_5".to_string(),
            "checkpoint_7".to_string(),
            "notes.tmp-later".to_string(),
        ]
    );
}
