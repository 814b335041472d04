//! File-system plumbing shared by the checkpoint writers: atomic file
//! replacement, fsync of files and folders, and JSON text laid out exactly as
//! Python's `json.dumps(..., indent=2)` writes it.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::{Error, Result};

/// The folder holding `path`; `.` for a bare file name, so it can be fsynced.
pub(crate) fn parent_or_dot(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// The temporary sibling a file is written to before being renamed over
/// `path`. Same folder, so the rename is atomic (never crosses file systems);
/// the pid tells [`super::clean_stale_temps`] whose leftover it is.
pub(crate) fn tmp_path_for(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".tmp-{}", std::process::id()));
    PathBuf::from(name)
}

/// Flushes a file's data and metadata to stable storage.
pub(crate) fn fsync_file(path: &Path) -> Result<()> {
    // fsync applies to the inode, so a fresh read-only handle flushes what an
    // earlier (already closed) writer left in the page cache.
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| Error::io("syncing", path, e))
}

/// Flushes a folder's entries (new names, renames) to stable storage.
///
/// Without this a crash right after a rename may bring back the old name.
/// Only meaningful on Unix; elsewhere folders cannot be opened for syncing.
pub(crate) fn fsync_dir(path: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        File::open(path)
            .and_then(|f| f.sync_all())
            .map_err(|e| Error::io("syncing folder", path, e))
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        Ok(())
    }
}

/// Fsyncs every file and folder under `dir` (and `dir` itself), so that a
/// rename of `dir` publishes fully written contents.
pub(crate) fn sync_tree(dir: &Path) -> Result<()> {
    let entries = fs::read_dir(dir).map_err(|e| Error::io("listing", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("listing", dir, e))?;
        let path = entry.path();
        // symlink_metadata: do not follow links out of the checkpoint.
        let kind = fs::symlink_metadata(&path)
            .map_err(|e| Error::io("inspecting", &path, e))?
            .file_type();
        if kind.is_dir() {
            sync_tree(&path)?;
        } else if kind.is_file() {
            fsync_file(&path)?;
        }
    }
    fsync_dir(dir)
}

/// Writes `path` atomically: `write` fills `path.tmp-{pid}`, which is then
/// fsynced, renamed over `path`, and the folder fsynced. Readers see either
/// the old file or the complete new one, never a torn write.
pub(crate) fn atomic_write_with(
    path: &Path,
    write: impl FnOnce(&Path) -> Result<()>,
) -> Result<()> {
    let parent = parent_or_dot(path);
    fs::create_dir_all(parent).map_err(|e| Error::io("creating folder", parent, e))?;
    let tmp = tmp_path_for(path);
    let staged = write(&tmp).and_then(|()| fsync_file(&tmp)).and_then(|()| {
        fs::rename(&tmp, path).map_err(|e| Error::io("renaming into place", path, e))
    });
    if let Err(e) = staged {
        // Best effort: the temp file is garbage now; the original error matters.
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    fsync_dir(parent)
}

/// [`atomic_write_with`] for bytes already in memory.
pub(crate) fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    atomic_write_with(path, |tmp| {
        let mut f = File::create(tmp).map_err(|e| Error::io("creating", tmp, e))?;
        f.write_all(bytes).map_err(|e| Error::io("writing", tmp, e))
    })
}

/// JSON text as Python writes `json.dumps(value, indent=2) + "\n"`.
///
/// Keys come out in the order the value serializes them (use `BTreeMap`s for
/// `sort_keys=True`). Non-ASCII and DEL are escaped as `\uXXXX` like Python's
/// default `ensure_ascii=True`, so files are byte-identical to Accelerate's.
pub(crate) fn python_json<T: Serialize>(value: &T, path: &Path) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(
        &mut out,
        PyFormatter {
            inner: serde_json::ser::PrettyFormatter::with_indent(b"  "),
        },
    );
    value.serialize(&mut ser).map_err(|e| Error::Json {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    out.push(b'\n');
    Ok(out)
}

/// serde_json's pretty layout (same separators as Python with `indent`) plus
/// Python's ASCII-only string escaping.
struct PyFormatter<'a> {
    inner: serde_json::ser::PrettyFormatter<'a>,
}

impl serde_json::ser::Formatter for PyFormatter<'_> {
    fn begin_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.inner.begin_array(w)
    }
    fn end_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.inner.end_array(w)
    }
    fn begin_array_value<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        self.inner.begin_array_value(w, first)
    }
    fn end_array_value<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.inner.end_array_value(w)
    }
    fn begin_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.inner.begin_object(w)
    }
    fn end_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.inner.end_object(w)
    }
    fn begin_object_key<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        self.inner.begin_object_key(w, first)
    }
    fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.inner.begin_object_value(w)
    }
    fn end_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.inner.end_object_value(w)
    }
    fn write_string_fragment<W: ?Sized + Write>(
        &mut self,
        w: &mut W,
        frag: &str,
    ) -> io::Result<()> {
        // serde_json already escapes `"`, `\` and control characters the same
        // way Python does; what is left is anything outside printable ASCII.
        let mut start = 0;
        for (i, c) in frag.char_indices() {
            if (' '..='~').contains(&c) {
                continue;
            }
            w.write_all(&frag.as_bytes()[start..i])?;
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                write!(w, "\\u{unit:04x}")?;
            }
            start = i + c.len_utf8();
        }
        w.write_all(&frag.as_bytes()[start..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn python_json_escapes_non_ascii_like_ensure_ascii() {
        let mut m = BTreeMap::new();
        m.insert("é😀\u{7f}", vec![1, 2]);
        m.insert("a\n", vec![]);
        let text = String::from_utf8(python_json(&m, Path::new("x")).unwrap()).unwrap();
        // Python: json.dumps({"é😀\x7f": [1, 2], "a\n": []}, indent=2, sort_keys=True) + "\n"
        assert_eq!(
            text,
            "{\n  \"a\\n\": [],\n  \"\\u00e9\\ud83d\\ude00\\u007f\": [\n    1,\n    2\n  ]\n}\n"
        );
    }

    #[test]
    fn atomic_write_replaces_the_file_and_leaves_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.txt");
        write_bytes_atomic(&path, b"one").unwrap();
        write_bytes_atomic(&path, b"two").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("f.txt")]);
    }
}
