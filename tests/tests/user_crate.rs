//! A crate outside this workspace, written as the README's "Using accel-rs
//! from your own crate" says (the dependency and the `[patch.crates-io]`
//! lines for the patched candle crates, since cargo applies patches only at
//! the top of the user's workspace), builds against this checkout and
//! trains candle-transformers' BERT, Llama, Qwen3, Qwen3-MoE, Gemma 3,
//! Mixtral, Mistral, Qwen2, Phi-3, Gemma 2, StarCoder2, OLMo 2, StableLM,
//! OLMo, Helium, Phi-2, Qwen2-MoE, Falcon, DistilBERT, ModernBERT and T5
//! (`main.rs`); Gemma, GLM-4, DeepSeek-V2, Granite, Mamba and XLM-RoBERTa
//! (`more.rs`); MixFormer (Phi-1.5), Stella v5, Nomic BERT, Jina BERT,
//! ChatGLM3, GLM-4 (new layout), CodeGeeX4, LFM2, GPT-BigCode, llama2.c,
//! RecurrentGemma and Granite-MoE-Hybrid (`rest.rs`); and Gemma 4 (text),
//! Based, RWKV v5 and v6, Mamba 2, Marian, DeBERTa v2, SmolLM3, Yi and MPT (`rest2.rs`), in
//! fp32 and bf16: every parameter gets a gradient at every step, every loss
//! is finite and falls (`tests/user_crate/src/main.rs` checks and prints
//! them). The same build's `--infer` run gives, bit for bit, what candle-nn and
//! candle-transformers as published give in inference, wherever those run
//! (`tests/fixtures/zoo/`, written by `scripts/zoo_unpatched_outputs.sh`).
//!
//! The crate is copied to a temporary folder outside the repository, with
//! the checkout's paths where a user writes `git = "..."`. It builds into
//! this build's target folder with the workspace's `Cargo.lock`, offline, so
//! the dependencies the workspace compiled are reused.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap()
}

/// The target folder this test was built in (`TARGET/debug/deps/user_crate-*`).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.ancestors().nth(3).unwrap().to_path_buf()
}

#[test]
fn a_crate_outside_the_workspace_trains_candle_transformers_bert_and_llama() {
    let repo = repo();
    let crate_dir = tempfile::tempdir().unwrap();
    let dir = crate_dir.path();
    assert!(
        !dir.starts_with(&repo),
        "the scratch crate must sit outside the repository"
    );
    let template = std::fs::read_to_string(repo.join("tests/user_crate/Cargo.toml.in")).unwrap();
    std::fs::write(
        dir.join("Cargo.toml"),
        template.replace("@ACCEL_RS@", &repo.display().to_string()),
    )
    .unwrap();
    std::fs::create_dir(dir.join("src")).unwrap();
    for file in std::fs::read_dir(repo.join("tests/user_crate/src")).unwrap() {
        let file = file.unwrap().path();
        std::fs::copy(&file, dir.join("src").join(file.file_name().unwrap())).unwrap();
    }
    std::fs::copy(repo.join("Cargo.lock"), dir.join("Cargo.lock")).unwrap();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["run", "--offline", "--quiet"])
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", target_dir())
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "the user crate failed:\n{stdout}\n{stderr}"
    );
    assert!(
        !stderr.contains("no backward"),
        "the start-up probe warned: the patch did not reach the user crate\n{stderr}"
    );
    let runs: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let seen: Vec<(String, String, u64)> = runs
        .iter()
        .map(|r| {
            (
                r["model"].as_str().unwrap().to_string(),
                r["precision"].as_str().unwrap().to_string(),
                r["params"].as_u64().unwrap(),
            )
        })
        .collect();
    let want = [
        ("bert", "no", 39),
        ("bert", "bf16", 39),
        ("llama", "no", 21),
        ("llama", "bf16", 21),
        ("qwen3", "no", 25),
        ("qwen3", "bf16", 25),
        ("qwen3_moe", "no", 45),
        ("qwen3_moe", "bf16", 45),
        ("gemma3", "no", 28),
        ("gemma3", "bf16", 28),
        ("mixtral", "no", 41),
        ("mixtral", "bf16", 41),
        ("mistral", "no", 21),
        ("mistral", "bf16", 21),
        ("qwen2", "no", 26),
        ("qwen2", "bf16", 26),
        ("distilbert", "no", 38),
        ("distilbert", "bf16", 38),
        ("modernbert", "no", 17),
        ("modernbert", "bf16", 17),
        ("phi3", "no", 15),
        ("phi3", "bf16", 15),
        ("gemma2", "no", 24),
        ("gemma2", "bf16", 24),
        ("starcoder2", "no", 35),
        ("starcoder2", "bf16", 35),
        ("olmo2", "no", 25),
        ("olmo2", "bf16", 25),
        ("stable_lm", "no", 32),
        ("stable_lm", "bf16", 32),
        ("t5", "no", 48),
        ("t5", "bf16", 48),
        ("olmo", "no", 16),
        ("olmo", "bf16", 16),
        ("helium", "no", 21),
        ("helium", "bf16", 21),
        ("phi", "no", 33),
        ("phi", "bf16", 33),
        ("qwen2_moe", "no", 55),
        ("qwen2_moe", "bf16", 55),
        ("falcon", "no", 16),
        ("falcon", "bf16", 16),
        ("gemma", "no", 20),
        ("gemma", "bf16", 20),
        ("glm4", "no", 17),
        ("glm4", "bf16", 17),
        ("deepseek2", "no", 40),
        ("deepseek2", "bf16", 40),
        ("granite", "no", 21),
        ("granite", "bf16", 21),
        ("mamba", "no", 22),
        ("mamba", "bf16", 22),
        ("xlm_roberta", "no", 41),
        ("xlm_roberta", "bf16", 41),
        ("mixformer", "no", 25),
        ("mixformer", "bf16", 25),
        ("stella_en_v5", "no", 28),
        ("stella_en_v5", "bf16", 28),
        ("nvembed_v2", "no", 36),
        ("nvembed_v2", "bf16", 36),
        ("nomic_bert", "no", 24),
        ("nomic_bert", "bf16", 24),
        ("jina_bert", "no", 36),
        ("jina_bert", "bf16", 36),
        ("chatglm", "no", 17),
        ("chatglm", "bf16", 17),
        ("codegeex4_9b", "no", 17),
        ("codegeex4_9b", "bf16", 17),
        ("glm4_new", "no", 29),
        ("glm4_new", "bf16", 29),
        ("lfm2", "no", 22),
        ("lfm2", "bf16", 22),
        ("bigcode", "no", 28),
        ("bigcode", "bf16", 28),
        ("llama2_c", "no", 21),
        ("llama2_c", "bf16", 21),
        ("recurrent_gemma", "no", 36),
        ("recurrent_gemma", "bf16", 36),
        ("granitemoehybrid", "no", 18),
        ("granitemoehybrid", "bf16", 18),
        ("gemma4", "no", 29),
        ("gemma4", "bf16", 29),
        ("based", "no", 25),
        ("based", "bf16", 25),
        ("rwkv_v5", "no", 50),
        ("rwkv_v5", "bf16", 50),
        ("rwkv_v6", "no", 62),
        ("rwkv_v6", "bf16", 62),
        ("rwkv_v7", "no", 69),
        ("rwkv_v7", "bf16", 69),
        ("mamba2", "no", 20),
        ("mamba2", "bf16", 20),
        ("marian", "no", 86),
        ("marian", "bf16", 86),
        ("debertav2", "no", 42),
        ("debertav2", "bf16", 42),
        ("smollm3", "no", 21),
        ("smollm3", "bf16", 21),
        ("yi", "no", 21),
        ("yi", "bf16", 21),
        ("mpt", "no", 14),
        ("mpt", "bf16", 14),
    ];
    let want: Vec<(String, String, u64)> = want
        .iter()
        .map(|(m, p, n)| (m.to_string(), p.to_string(), *n))
        .collect();
    assert_eq!(seen, want, "{stdout}");
    inference_equals_the_published_crates(dir);
}

/// The user crate's `--infer` run (`tests/user_crate/src/infer.rs`: inference through each
/// model whose candle-nn or candle-transformers code is patched, with weights fixed by name)
/// against the same code built on candle-nn and candle-transformers as published
/// (`scripts/zoo_unpatched_outputs.sh` wrote the fixtures): bit for bit wherever the published
/// crates run; where they fail (an error, or NaN outputs) the patched ones must give finite ones.
fn inference_equals_the_published_crates(dir: &Path) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["run", "--offline", "--quiet", "--", "--infer"])
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", target_dir())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the user crate's --infer failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // candle's f32 matmul is the gemm crate's, whose microkernels sum in another order on AVX-512
    // than on AVX2: the fixture written on this kind of CPU.
    let Some(isa) = gemm_isa() else {
        eprintln!("no fixture of the published crates' bits for this CPU (x86-64 with AVX2 or AVX-512 only)");
        return;
    };
    let fixture = repo().join(format!("tests/fixtures/zoo/unpatched_outputs_{isa}.jsonl"));
    let lines = |text: &str| -> Vec<serde_json::Value> {
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let published = lines(&std::fs::read_to_string(&fixture).unwrap());
    let patched = lines(&stdout);
    let key = |v: &serde_json::Value| format!("{} {}", v["model"], v["dtype"]);
    assert_eq!(
        published.iter().map(key).collect::<Vec<_>>(),
        patched.iter().map(key).collect::<Vec<_>>(),
        "the models of {} and of --infer",
        fixture.display()
    );
    let (mut bitwise, mut fixed) = (0, 0);
    for (old, new) in published.iter().zip(&patched) {
        let what = key(old);
        assert!(
            new.get("error").is_none(),
            "{what}: the patched crates fail: {new}"
        );
        let finite = new["outputs"]
            .as_array()
            .unwrap()
            .iter()
            .all(|o| o["finite"] == true);
        if old.get("error").is_some()
            || old["outputs"]
                .as_array()
                .unwrap()
                .iter()
                .any(|o| o["finite"] != true)
        {
            // What the patches fix: a bf16 dtype mismatch, a KV cache's in-place write, a batch
            // the published rotary could not take, NaN scores.
            assert!(
                finite,
                "{what}: published {old}, patched gives non-finite values: {new}"
            );
            fixed += 1;
            continue;
        }
        assert_eq!(
            old["outputs"], new["outputs"],
            "{what}: not the published crates' bits"
        );
        bitwise += 1;
    }
    // ISA-independent counts: a fixture regenerated with other models says so here.
    assert_eq!((bitwise, fixed), (25, 17), "{stdout}");
}

/// Which fixture's bits this CPU gives: gemm's AVX-512 kernels (pulp's `x86-v4` level), its
/// AVX2 ones (`x86-v3`), or neither (no fixture).
fn gemm_isa() -> Option<&'static str> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f")
            && has!("avx512bw")
            && has!("avx512cd")
            && has!("avx512dq")
            && has!("avx512vl")
        {
            return Some("avx512");
        }
        if has!("avx2") && has!("fma") {
            return Some("avx2");
        }
    }
    None
}
