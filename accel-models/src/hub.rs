//! Where users keep their models: a folder, or a model id (`Qwen/Qwen3-0.6B`)
//! resolved as transformers resolves it: from the Hugging Face cache
//! (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`;
//! `models--{org}--{name}/refs/{revision}` naming a commit under
//! `snapshots/`), else downloaded from the Hub (`HF_ENDPOINT`) into that
//! cache with the `hf-hub` crate. `HF_HUB_OFFLINE=1` (or
//! `TRANSFORMERS_OFFLINE=1`) forbids the download.

use std::path::{Path, PathBuf};

use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo, RepoType};

use crate::{Error, Result};

/// The files of a model folder a download fetches besides the weights.
const FOLDER_FILES: [&str; 7] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
];

/// The Hugging Face hub cache directory, as `huggingface_hub` finds it.
pub fn hub_cache_dir() -> PathBuf {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = env("HF_HUB_CACHE") {
        return dir;
    }
    if let Some(home) = env("HF_HOME") {
        return home.join("hub");
    }
    let cache = env("XDG_CACHE_HOME")
        .or_else(|| env("HOME").map(|h| h.join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    cache.join("huggingface").join("hub")
}

/// Whether the environment forbids downloads.
fn offline() -> bool {
    ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"].iter().any(|k| {
        std::env::var(k)
            .is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
    })
}

/// The folder `model` names: itself when it exists; else the id's snapshot
/// at `revision` (`main` by default; a branch, a tag or a commit) in the
/// cache, downloaded first when the cache lacks it and downloads are
/// allowed.
///
/// A folder of `pytorch_model.bin` weights resolves to their safetensors
/// copy, written once beside the cache (see `pickled.rs`).
///
/// # Errors
/// [`Error::ModelNotFound`] naming where it looked: not a folder and not an
/// id, not cached while offline, or a failed download (the Hub's reason); a
/// `.bin` checkpoint that does not read.
pub fn resolve_model(model: &Path, revision: Option<&str>) -> Result<PathBuf> {
    crate::pickled::loadable(&resolve_folder(model, revision)?)
}

/// [`resolve_model`] before a `pytorch_model.bin` folder is converted.
fn resolve_folder(model: &Path, revision: Option<&str>) -> Result<PathBuf> {
    if model.exists() {
        return Ok(model.to_path_buf());
    }
    let id = model.to_string_lossy().to_string();
    let rev = revision.unwrap_or("main").to_string();
    let not_found = |reason: String| Error::ModelNotFound {
        model: id.clone(),
        revision: rev.clone(),
        reason,
    };
    let valid = |s: &str| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    let parts: Vec<&str> = id.split('/').collect();
    if parts.len() > 2 || !parts.iter().all(|p| valid(p)) {
        return Err(not_found(
            "no such folder, and not a model id of the Hugging Face Hub (`org/name`)".into(),
        ));
    }
    let cache_dir = hub_cache_dir();
    let repo = Repo::with_revision(id.clone(), RepoType::Model, rev.clone());
    let repo_dir = cache_dir.join(repo.folder_name());
    if let Some(dir) = cached_snapshot(&repo_dir, &rev) {
        return Ok(dir);
    }
    if offline() {
        return Err(not_found(format!(
            "not in the Hugging Face cache ({}: no snapshot for this revision) and downloads are \
             off (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)",
            repo_dir.display()
        )));
    }
    download(&cache_dir, repo).map_err(|e| {
        not_found(format!(
            "not in the Hugging Face cache ({}) and the download failed: {e}",
            repo_dir.display()
        ))
    })
}

/// `snapshots/{commit}` of a cached repository when it holds a config.
fn cached_snapshot(repo_dir: &Path, revision: &str) -> Option<PathBuf> {
    let is_commit = revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit());
    let commit = if is_commit {
        revision.to_string()
    } else {
        std::fs::read_to_string(repo_dir.join("refs").join(revision))
            .ok()?
            .trim()
            .to_string()
    };
    let dir = repo_dir.join("snapshots").join(commit);
    dir.join("config.json").is_file().then_some(dir)
}

/// Fetches the folder's files and its weights (safetensors, else
/// `pytorch_model.bin`, sharded or not) into the cache; returns the snapshot.
fn download(cache_dir: &Path, repo: Repo) -> std::result::Result<PathBuf, String> {
    let mut builder =
        ApiBuilder::from_cache(Cache::new(cache_dir.to_path_buf())).with_progress(false);
    if let Some(endpoint) = std::env::var("HF_ENDPOINT").ok().filter(|e| !e.is_empty()) {
        builder = builder.with_endpoint(endpoint.trim_end_matches('/').to_string());
    }
    if let Some(token) = std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty()) {
        builder = builder.with_token(Some(token));
    }
    let api = builder.build().map_err(|e| e.to_string())?;
    let repo = api.repo(repo);
    let info = repo.info().map_err(|e| e.to_string())?;
    let files: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
    let has = |f: &str| files.iter().any(|x| x == f);
    if !has("config.json") {
        return Err("the repository has no config.json".into());
    }
    let weights: Vec<&String> = if files.iter().any(|f| f.ends_with(".safetensors")) {
        files
            .iter()
            .filter(|f| f.ends_with(".safetensors") || *f == "model.safetensors.index.json")
            .collect()
    } else {
        files
            .iter()
            .filter(|f| {
                f.starts_with("pytorch_model")
                    && (f.ends_with(".bin") || f.ends_with(".bin.index.json"))
            })
            .collect()
    };
    if weights.is_empty() {
        return Err("the repository has neither safetensors nor pytorch_model.bin weights".into());
    }
    let mut snapshot = None;
    for f in FOLDER_FILES
        .iter()
        .filter(|f| has(f))
        .map(|f| f.to_string())
        .chain(weights.into_iter().cloned())
    {
        let path = repo.get(&f).map_err(|e| format!("{f}: {e}"))?;
        if f == "config.json" {
            snapshot = path.parent().map(Path::to_path_buf);
        }
    }
    snapshot.ok_or_else(|| "config.json landed nowhere".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache laid out as `huggingface_hub` lays it: `refs/main` names the
    /// snapshot; a tag and a commit resolve too; an unknown revision while
    /// offline is an error naming the cache folder.
    #[test]
    fn a_model_id_resolves_from_the_cache_layout() {
        let tmp = tempfile::tempdir().unwrap();
        let repo = tmp.path().join("models--org--tiny");
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let snap = repo.join("snapshots").join(commit);
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::write(snap.join("config.json"), "{}").unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), commit).unwrap();
        std::fs::write(repo.join("refs/v1"), format!("{commit}\n")).unwrap();
        assert_eq!(cached_snapshot(&repo, "main"), Some(snap.clone()));
        assert_eq!(cached_snapshot(&repo, "v1"), Some(snap.clone()));
        assert_eq!(cached_snapshot(&repo, commit), Some(snap));
        assert_eq!(cached_snapshot(&repo, "dev"), None);
    }
}
