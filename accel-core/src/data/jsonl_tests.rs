use std::path::{Path, PathBuf};

use super::*;

/// The Llama fixture's tokenizer (128 tokens).
fn tokenizer() -> Tokenizer {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf/llama");
    Tokenizer::from_file(dir).unwrap()
}

fn file(dir: &tempfile::TempDir, lines: &[&str]) -> PathBuf {
    let path = dir.path().join("train.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

fn rows(ds: &JsonlDataset) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let all: Vec<usize> = (0..ds.len()).collect();
    let b = ds.get_batch(&all).unwrap();
    (b[0].to_vec2().unwrap(), b[1].to_vec2().unwrap())
}

const EOS: u32 = 2;

fn opts(seq_len: usize, packing: bool) -> JsonlOptions {
    JsonlOptions {
        seq_len,
        packing,
        eos_token_id: Some(EOS),
        pad_token_id: 0,
        chat: None,
    }
}

#[test]
fn text_examples_tokenize_as_transformers_and_pack_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    // transformers: AutoTokenizer.from_pretrained(fixture)("the quick brown fox")
    // gives [76, 120, 115, 103] (this tokenizer adds no BOS).
    let fox = [76u32, 120, 115, 103];
    let path = file(
        &dir,
        &[
            r#"{"text": "the quick brown fox"}"#,
            "",
            r#"{"text": "the quick brown fox"}"#,
            r#"{"text": "the quick brown fox"}"#,
        ],
    );
    let ds = JsonlDataset::open(&path, &tokenizer(), &opts(4, true), &Device::Cpu).unwrap();
    assert_eq!(ds.examples(), 3);
    // 3 x (4 tokens + EOS) = 15 tokens: three windows of 4, the tail of 3 dropped.
    let stream: Vec<u32> = fox.iter().copied().chain([EOS]).cycle().take(12).collect();
    let (ids, labels) = rows(&ds);
    assert_eq!(ids.concat(), stream);
    assert_eq!(
        labels, ids,
        "the loss looks at every token of a text example"
    );
}

#[test]
fn a_prompt_is_ignored_by_the_loss_and_the_completion_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let path = file(
        &dir,
        &[r#"{"prompt": "the quick", "completion": " brown fox"}"#],
    );
    let tok = tokenizer();
    let prompt = tok.encode("the quick", true).unwrap();
    let completion = tok.encode(" brown fox", false).unwrap();
    let n = prompt.len() + completion.len() + 1;
    let ds = JsonlDataset::open(&path, &tok, &opts(n, true), &Device::Cpu).unwrap();
    let (ids, labels) = rows(&ds);
    let want: Vec<u32> = prompt
        .iter()
        .chain(&completion)
        .copied()
        .chain([EOS])
        .collect();
    assert_eq!(ids, vec![want]);
    let mut want_labels = vec![IGNORE; prompt.len()];
    want_labels.extend(&completion);
    want_labels.push(EOS);
    assert_eq!(labels, vec![want_labels]);
}

#[test]
fn without_packing_each_example_is_truncated_or_padded_to_a_window() {
    let dir = tempfile::tempdir().unwrap();
    let path = file(
        &dir,
        &[r#"{"text": "the quick brown fox"}"#, r#"{"text": "the"}"#],
    );
    let tok = tokenizer();
    let the = tok.encode("the", true).unwrap();
    let ds = JsonlDataset::open(&path, &tok, &opts(3, false), &Device::Cpu).unwrap();
    let (ids, labels) = rows(&ds);
    assert_eq!(ids[0], vec![76, 120, 115]);
    assert_eq!(labels[0], ids[0]);
    let mut short: Vec<u32> = the.iter().copied().chain([EOS]).collect();
    let real = short.len();
    short.resize(3, 0);
    assert_eq!(ids[1], short);
    assert!(
        labels[1][real..].iter().all(|&l| l == IGNORE),
        "{:?}",
        labels[1]
    );
}

#[test]
fn a_bad_line_is_an_error_naming_the_file_and_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let good = r#"{"text": "the quick brown fox"}"#;
    for (bad, want) in [
        (r#"{"text": "unterminated"#, "not JSON"),
        (r#"{"txt": "typo"}"#, "expected {\"text\": string}"),
        (r#"{"text": 3}"#, "expected {\"text\": string}"),
        (
            r#"{"prompt": "only a prompt"}"#,
            "expected {\"text\": string}",
        ),
        (
            r#"{"messages": [{"role": "user", "content": "hi"}]}"#,
            "need the model's chat template",
        ),
    ] {
        let path = file(&dir, &[good, bad, good]);
        let e = JsonlDataset::open(&path, &tokenizer(), &opts(4, true), &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("{}, line 2: ", path.display())) && e.contains(want),
            "{bad}: {e}"
        );
    }
}

#[test]
fn an_empty_dataset_or_one_shorter_than_a_window_is_an_error_saying_so() {
    let dir = tempfile::tempdir().unwrap();
    let empty = file(&dir, &["", "  "]);
    let e = JsonlDataset::open(&empty, &tokenizer(), &opts(4, true), &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("train.jsonl: the dataset has no examples"),
        "{e}"
    );
    let short = file(&dir, &[r#"{"text": "the quick"}"#]);
    let e = JsonlDataset::open(&short, &tokenizer(), &opts(64, true), &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(
            "train.jsonl: the dataset's 1 example(s) hold fewer tokens than one window of 64"
        ),
        "{e}"
    );
    let e = JsonlDataset::open(
        dir.path().join("missing.jsonl"),
        &tokenizer(),
        &opts(4, true),
        &Device::Cpu,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("missing.jsonl"), "{e}");
}

#[test]
fn a_held_out_split_is_seeded_disjoint_and_complete() {
    let dir = tempfile::tempdir().unwrap();
    let lines: Vec<String> = (0..20)
        .map(|i| format!(r#"{{"text": "the quick brown fox {i}"}}"#))
        .collect();
    let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
    let path = file(&dir, &lines);
    let ds = JsonlDataset::open(&path, &tokenizer(), &opts(4, false), &Device::Cpu).unwrap();
    assert_eq!(ds.len(), 20);
    let (all, _) = rows(&ds);
    let (train, eval) = ds.clone().split(0.1, 7).unwrap();
    assert_eq!((train.len(), eval.len()), (18, 2));
    let (again_train, _) = ds.clone().split(0.1, 7).unwrap();
    assert_eq!(
        rows(&again_train),
        rows(&train),
        "the same seed holds out the same windows"
    );
    let (mut joined, _) = rows(&train);
    joined.extend(rows(&eval).0);
    joined.sort();
    let mut all_sorted = all;
    all_sorted.sort();
    assert_eq!(joined, all_sorted);
    assert!(ds.clone().split(1.0, 7).is_err());
    let e = ds.split(0.99, 7).unwrap_err().to_string();
    assert!(e.contains("leaves none of the 20 windows"), "{e}");
}

/// Chat examples train on the assistant's tokens only: the labels are the
/// ids where transformers' `apply_chat_template` marks the assistant
/// (`tests/fixtures/chat/reference.json`), ignored elsewhere, and no EOS is
/// added (the template ends the turns).
#[test]
fn chat_examples_train_on_the_assistant_tokens_as_transformers_marks_them() {
    let chat_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/chat");
    let text = std::fs::read_to_string(chat_dir.join("reference.json")).unwrap();
    let reference: serde_json::Value = serde_json::from_str(&text).unwrap();
    let case = &reference["cases"][0];
    assert_eq!(case["add_generation_prompt"], false);
    let want_ids: Vec<u32> = serde_json::from_value(case["input_ids"].clone()).unwrap();
    let mask: Vec<u8> = serde_json::from_value(case["assistant_masks"].clone()).unwrap();
    let want_labels: Vec<u32> = want_ids
        .iter()
        .zip(&mask)
        .map(|(&id, &m)| if m == 1 { id } else { IGNORE })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let line = serde_json::json!({ "messages": case["messages"] }).to_string();
    let path = file(&dir, &[&line]);
    let options = JsonlOptions {
        chat: Some(super::super::ChatTemplate::from_folder(&chat_dir).unwrap()),
        ..opts(want_ids.len(), true)
    };
    let tok = Tokenizer::from_file(&chat_dir).unwrap();
    let ds = JsonlDataset::open(&path, &tok, &options, &Device::Cpu).unwrap();
    let (ids, labels) = rows(&ds);
    assert_eq!(ids, vec![want_ids]);
    assert_eq!(labels, vec![want_labels]);
    // A template without generation marks whose turns change as later ones
    // follow cannot have its assistant tokens found: an error.
    let plain = JsonlOptions {
        chat: Some(super::super::ChatTemplate::new(
            "{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}{% endfor %}",
            "",
            "",
        )),
        ..opts(4, true)
    };
    let e = JsonlDataset::open(&path, &tok, &plain, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("line 1") && e.contains("generation tags") && e.contains("message 1"),
        "{e}"
    );
}
