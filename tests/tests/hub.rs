//! Model ids: `hf_logits --model org/name` downloads the folder from a Hub
//! (a loopback server speaking the Hub's protocol: `/api/models/.../revision/...`
//! and `resolve/` with ranges, as huggingface_hub and hf-hub use it) into the
//! Hugging Face cache layout, gives the folder's logits, then resolves from
//! that cache offline; a missing id or revision offline is an error naming
//! the cache folder it looked in.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

const HF_LOGITS: &str = env!("CARGO_BIN_EXE_hf_logits_worker");
const COMMIT: &str = "5f1c4ab2e3d4c5b6a7980123456789abcdef0123";

/// Serves the files of `dir` as repository `org/tiny` at revision `main`.
fn serve(dir: PathBuf) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let dir = dir.clone();
            std::thread::spawn(move || {
                let _ = handle(conn, &dir);
            });
        }
    });
    format!("http://{addr}")
}

/// One keep-alive connection: each request answered from `dir`.
fn handle(conn: TcpStream, dir: &Path) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut out = conn;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
        // `Range: bytes=a-b` (the probe: 0-0) or `bytes=a-` (the download).
        let mut range: (usize, Option<usize>) = (0, None);
        loop {
            let mut h = String::new();
            reader.read_line(&mut h)?;
            if h.trim().is_empty() {
                break;
            }
            if let Some(v) = h.to_ascii_lowercase().strip_prefix("range: bytes=") {
                let (a, b) = v.trim().split_once('-').unwrap_or(("0", ""));
                range = (a.parse().unwrap_or(0), b.parse().ok());
            }
        }
        let files: Vec<String> = std::fs::read_dir(dir)?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            .filter(|f| f != "reference.json")
            .collect();
        let (status, headers, body) = if path == "/api/models/org/tiny/revision/main" {
            let siblings: Vec<Value> = files
                .iter()
                .map(|f| serde_json::json!({ "rfilename": f }))
                .collect();
            let body = serde_json::json!({ "sha": COMMIT, "siblings": siblings }).to_string();
            ("200 OK", String::new(), body.into_bytes())
        } else if let Some(file) = path.strip_prefix("/org/tiny/resolve/main/") {
            match std::fs::read(dir.join(file)) {
                Ok(bytes) => {
                    let start = range.0.min(bytes.len());
                    let end = range.1.map_or(bytes.len(), |b| (b + 1).min(bytes.len()));
                    let headers = format!(
                        "etag: \"{}-{}\"\r\nx-repo-commit: {COMMIT}\r\ncontent-range: bytes {start}-{}/{}\r\n",
                        file.replace('.', "-"),
                        bytes.len(),
                        end.saturating_sub(1),
                        bytes.len()
                    );
                    ("206 Partial Content", headers, bytes[start..end].to_vec())
                }
                Err(_) => ("404 Not Found", String::new(), vec![]),
            }
        } else {
            ("404 Not Found", String::new(), vec![])
        };
        write!(
            out,
            "HTTP/1.1 {status}\r\n{headers}content-length: {}\r\n\r\n",
            body.len()
        )?;
        out.write_all(&body)?;
        out.flush()?;
    }
}

fn hf_logits(model: &str, home: &Path, env: &[(&str, &str)]) -> (bool, String, String) {
    let mut cmd = Command::new(HF_LOGITS);
    cmd.args(["--model", model, "--input-ids", "1,17,42"])
        .env("HF_HOME", home)
        .env_remove("HF_HUB_CACHE")
        .env_remove("HF_HUB_OFFLINE")
        .env_remove("TRANSFORMERS_OFFLINE")
        .env_remove("HF_ENDPOINT");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let mut stdout = String::new();
    out.stdout.as_slice().read_to_string(&mut stdout).unwrap();
    (
        out.status.success(),
        stdout,
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn a_model_id_downloads_into_the_cache_then_resolves_offline() {
    let fixture = accel_tests::hf_fixture("qwen3");
    let endpoint = serve(fixture.clone());
    let home = tempfile::tempdir().unwrap();
    let local = hf_logits(&fixture.display().to_string(), home.path(), &[]);
    assert!(local.0, "{}", local.2);
    let (ok, out, err) = hf_logits("org/tiny", home.path(), &[("HF_ENDPOINT", &endpoint)]);
    assert!(ok, "{err}");
    let logits = |s: &str| serde_json::from_str::<Value>(s).unwrap()["logits"].clone();
    assert_eq!(logits(&out), logits(&local.1));
    // huggingface_hub's layout: refs/main names the snapshot.
    let repo = home.path().join("hub/models--org--tiny");
    let main = std::fs::read_to_string(repo.join("refs/main")).unwrap();
    assert_eq!(main.trim(), COMMIT);
    assert!(repo
        .join("snapshots")
        .join(COMMIT)
        .join("config.json")
        .is_file());
    // Offline, from the cache alone.
    let (ok, out, err) = hf_logits("org/tiny", home.path(), &[("HF_HUB_OFFLINE", "1")]);
    assert!(ok, "{err}");
    assert_eq!(logits(&out), logits(&local.1));
    // Offline, an id or revision the cache lacks: named, with where it looked.
    let (ok, _, err) = hf_logits("org/other", home.path(), &[("HF_HUB_OFFLINE", "1")]);
    assert!(!ok);
    assert!(
        err.contains("org/other") && err.contains("models--org--other"),
        "{err}"
    );
    let mut cmd = Command::new(HF_LOGITS);
    cmd.args([
        "--model",
        "org/tiny",
        "--revision",
        "v2",
        "--input-ids",
        "1",
    ])
    .env("HF_HOME", home.path())
    .env("HF_HUB_OFFLINE", "1");
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("revision v2"),
        "{err}"
    );
}

/// A folder of `pytorch_model.bin` shards written by `torch.save` (with
/// their index) gives the logits of the same weights in safetensors; the
/// converted copy lands beside the Hugging Face cache and is reused.
#[test]
fn pytorch_model_bin_shards_give_the_safetensors_logits() {
    let home = tempfile::tempdir().unwrap();
    let model = |name: &str| accel_tests::hf_fixture(name).display().to_string();
    let (ok, want, err) = hf_logits(&model("qwen3"), home.path(), &[]);
    assert!(ok, "{err}");
    let (ok, got, err) = hf_logits(&model("qwen3_bin"), home.path(), &[]);
    assert!(ok, "{err}");
    let logits = |s: &str| serde_json::from_str::<Value>(s).unwrap()["logits"].clone();
    assert_eq!(logits(&got), logits(&want));
    let converted = home.path().join("accel/converted");
    let copies: Vec<_> = std::fs::read_dir(&converted).unwrap().flatten().collect();
    assert_eq!(copies.len(), 1, "{converted:?}");
    let copy = copies[0].path();
    assert!(copy.join("model.safetensors.index.json").is_file());
    let stamp = std::fs::metadata(copy.join("config.json"))
        .unwrap()
        .modified()
        .unwrap();
    let (ok, again, _) = hf_logits(&model("qwen3_bin"), home.path(), &[]);
    assert!(ok);
    assert_eq!(logits(&again), logits(&want));
    let later = std::fs::metadata(copy.join("config.json"))
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(stamp, later, "the copy was made again");
}
