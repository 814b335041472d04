use std::path::PathBuf;

use super::*;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/chat")
}

/// Every conversation of `tests/fixtures/chat/reference.json` (written by
/// `scripts/make_chat_fixture.py` with transformers' `apply_chat_template`):
/// the same text, token ids and assistant mask, with and without a
/// generation prompt.
#[test]
fn rendering_and_the_assistant_mask_equal_transformers_apply_chat_template() {
    let template = ChatTemplate::from_folder(fixture()).unwrap();
    assert!(template.marks_generation());
    let tokenizer = Tokenizer::from_file(fixture()).unwrap();
    let text = std::fs::read_to_string(fixture().join("reference.json")).unwrap();
    let reference: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases = reference["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 6);
    for (i, case) in cases.iter().enumerate() {
        let prompt = case["add_generation_prompt"].as_bool().unwrap();
        let (text, _) = template.render(&case["messages"], prompt).unwrap();
        assert_eq!(text, case["text"].as_str().unwrap(), "case {i}: text");
        let (ids, mask) = template
            .tokenize(&tokenizer, &case["messages"], prompt)
            .unwrap();
        let want_ids: Vec<u32> = serde_json::from_value(case["input_ids"].clone()).unwrap();
        let want_mask: Vec<u8> = serde_json::from_value(case["assistant_masks"].clone()).unwrap();
        assert_eq!(ids, want_ids, "case {i}: ids");
        let mask: Vec<u8> = mask.into_iter().map(u8::from).collect();
        assert_eq!(mask, want_mask, "case {i}: assistant mask");
        let answered = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["role"] == "assistant");
        assert_eq!(
            mask.contains(&1),
            answered,
            "case {i}: the assistant's tokens are marked"
        );
    }
}

/// The same template without its `{% generation %}` tags: the assistant
/// turns found by rendering growing prefixes are the ones the tags mark.
#[test]
fn a_template_without_generation_tags_finds_the_same_assistant_tokens() {
    let source = std::fs::read_to_string(fixture().join("chat_template.jinja")).unwrap();
    let untagged = source
        .replace("{%- generation %}", "")
        .replace("{%- endgeneration %}", "");
    assert_ne!(untagged, source);
    let tagged = ChatTemplate::from_folder(fixture()).unwrap();
    let plain = ChatTemplate::new(&untagged, &tagged.bos_token, &tagged.eos_token);
    assert!(!plain.marks_generation());
    let tokenizer = Tokenizer::from_file(fixture()).unwrap();
    let text = std::fs::read_to_string(fixture().join("reference.json")).unwrap();
    let reference: serde_json::Value = serde_json::from_str(&text).unwrap();
    for (i, case) in reference["cases"].as_array().unwrap().iter().enumerate() {
        let prompt = case["add_generation_prompt"].as_bool().unwrap();
        let (ids, mask) = plain
            .tokenize(&tokenizer, &case["messages"], prompt)
            .unwrap();
        let want_ids: Vec<u32> = serde_json::from_value(case["input_ids"].clone()).unwrap();
        let want_mask: Vec<u8> = serde_json::from_value(case["assistant_masks"].clone()).unwrap();
        assert_eq!(ids, want_ids, "case {i}: ids");
        let mask: Vec<u8> = mask.into_iter().map(u8::from).collect();
        assert_eq!(mask, want_mask, "case {i}: assistant mask");
    }
}

#[test]
fn generation_tags_become_markers_keeping_their_whitespace_control() {
    let (out, found) =
        rewrite_generation_tags("a{%- generation %}b{% endgeneration -%} c{% if x %}{% endif %}");
    assert!(found);
    assert_eq!(
        out,
        format!("a{{{{- \"{START}\" }}}}b{{{{ \"{END}\" -}}}} c{{% if x %}}{{% endif %}}")
    );
    let t = ChatTemplate::new("{{ bos_token }}{% for m in messages %}{{ m['content'] | upper }}{% generation %}!{% endgeneration %}{% endfor %}", "<s>", "</s>");
    let messages = serde_json::json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]);
    let (text, spans) = t.render(&messages, false).unwrap();
    assert_eq!(text, "<s>HI!YO!");
    assert_eq!(spans, vec![(5, 6), (8, 9)]);
    // Python's string methods, and a boolean printed as Python's Jinja
    // prints it (jinja2: `{{ " xy ".strip().startswith("x") }}` is `True`).
    let t = ChatTemplate::new(
        "{{ messages[0]['content'].strip().startswith('x') }}",
        "",
        "",
    );
    let (text, _) = t
        .render(&serde_json::json!([{"content": " xy "}]), false)
        .unwrap();
    assert_eq!(text, "True");
}

#[test]
fn a_template_that_raises_or_is_missing_is_an_error_naming_the_file() {
    let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "");
    let e = t
        .render(&serde_json::json!([]), false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("roles must alternate"), "{e}");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf/llama");
    let e = ChatTemplate::from_folder(&dir).unwrap_err().to_string();
    assert!(e.contains("no chat template") && e.contains("llama"), "{e}");
}
