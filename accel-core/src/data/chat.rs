//! Chat examples: a model's Hugging Face chat template (Jinja) rendered as
//! transformers' `apply_chat_template` renders it, and the assistant tokens
//! the loss trains on, as its `return_assistant_tokens_mask` marks them.
//!
//! The template comes from the folder's `chat_template.jinja`, or the
//! `chat_template` of its `tokenizer_config.json` (a string, or the
//! `default` of a list of named templates). It is rendered with minijinja
//! set up as transformers sets up Jinja: `trim_blocks`, `lstrip_blocks`,
//! Python's string methods, `raise_exception`, `bos_token`/`eos_token`.
//! Assistant spans are the text a template wraps in `{% generation %}` …
//! `{% endgeneration %}` (transformers' extension; here the tags are
//! rewritten into markers before rendering), or for a template without the
//! tags what each assistant turn adds to the render (see
//! [`ChatTemplate::render`]); a token belongs to the assistant from the
//! token holding a span's first character to the one holding its last, as
//! transformers counts them.

use std::path::{Path, PathBuf};

use accel_models::Tokenizer;
use minijinja::{context, Environment, ErrorKind};

use crate::{Error, Result};

/// Marks the start and the end of a `{% generation %}` span in rendered text
/// (private-use characters no template writes).
const START: char = '\u{F8F0}';
const END: char = '\u{F8F1}';

/// A chat template and the special tokens it may print.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    /// The template with its generation tags rewritten into markers.
    source: String,
    /// Whether the template marks assistant spans at all.
    marks_generation: bool,
    bos_token: String,
    eos_token: String,
    path: PathBuf,
}

/// A special token in `tokenizer_config.json`: a string, or `{"content": ...}`.
fn token_string(v: Option<&serde_json::Value>) -> String {
    match v {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Object(o)) => o
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

/// Rewrites `{% generation %}` / `{% endgeneration %}` (with any whitespace
/// control) into expressions printing the markers, keeping the tags' `-`
/// and `+` so whitespace around them is trimmed as before.
fn rewrite_generation_tags(template: &str) -> (String, bool) {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    let mut found = false;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(close) = tag.find("%}") else {
            out.push_str(tag);
            return (out, found);
        };
        let inner = &tag[2..close];
        let (left, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, right) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[body.len() - 1..]),
            None => (body, ""),
        };
        let marker = match body.trim() {
            "generation" => Some(START),
            "endgeneration" => Some(END),
            _ => None,
        };
        match marker {
            Some(m) => {
                found = true;
                out.push_str(&format!("{{{{{left} \"{m}\" {right}}}}}"));
            }
            None => out.push_str(&tag[..close + 2]),
        }
        rest = &tag[close + 2..];
    }
    out.push_str(rest);
    (out, found)
}

impl ChatTemplate {
    /// A template with the special tokens it prints.
    pub fn new(template: &str, bos_token: &str, eos_token: &str) -> Self {
        let (source, marks_generation) = rewrite_generation_tags(template);
        Self {
            source,
            marks_generation,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            path: PathBuf::from("<template>"),
        }
    }

    /// The template of a Hugging Face folder (see the module docs).
    ///
    /// # Errors
    /// [`Error::Dataset`] naming the file when the folder has no template or
    /// its `tokenizer_config.json` is not JSON.
    pub fn from_folder(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config_path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| Error::Dataset {
                path: config_path.clone(),
                line: 0,
                reason: format!("not JSON: {e}"),
            })?,
            Err(_) => serde_json::Value::Null,
        };
        let jinja = dir.join("chat_template.jinja");
        let (template, path) = if let Ok(text) = std::fs::read_to_string(&jinja) {
            (text, jinja)
        } else {
            let t = match config.get("chat_template") {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template")?.as_str().map(String::from)),
                _ => None,
            };
            let t = t.ok_or_else(|| Error::Dataset {
                path: dir.to_path_buf(),
                line: 0,
                reason: "no chat template (chat_template.jinja, or chat_template in \
                         tokenizer_config.json) for chat examples"
                    .into(),
            })?;
            (t, config_path)
        };
        let mut t = Self::new(
            &template,
            &token_string(config.get("bos_token")),
            &token_string(config.get("eos_token")),
        );
        t.path = path;
        Ok(t)
    }

    /// The file the template was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the template marks assistant turns with `{% generation %}`;
    /// without, no token can be told to be the assistant's.
    pub fn marks_generation(&self) -> bool {
        self.marks_generation
    }

    /// The rendered text of `messages` (a JSON array of `{"role", "content"}`)
    /// and the character spans of its `{% generation %}` blocks.
    ///
    /// # Errors
    /// A template that does not render (syntax, `raise_exception`), with
    /// minijinja's reason.
    ///
    /// A template without generation tags gets its assistant spans by
    /// rendering growing prefixes of the conversation: an assistant turn is
    /// what rendering it adds to the conversation before it with the
    /// generation prompt, up to its last non-blank character (its
    /// end-of-turn token included). That needs a template whose render of a
    /// prefix is a prefix of the whole render; one that is not (a template
    /// that rewrites earlier turns) is an error naming the turn.
    pub fn render(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
    ) -> Result<(String, Vec<(usize, usize)>)> {
        let (text, spans) = self.render_marked(messages, add_generation_prompt)?;
        if self.marks_generation {
            return Ok((text, spans));
        }
        let Some(turns) = messages.as_array() else {
            return Ok((text, spans));
        };
        let mut spans = vec![];
        for (i, m) in turns.iter().enumerate() {
            if m.get("role").and_then(|r| r.as_str()) != Some("assistant") {
                continue;
            }
            let before = serde_json::Value::Array(turns[..i].to_vec());
            let upto = serde_json::Value::Array(turns[..=i].to_vec());
            let (prompt, _) = self.render_marked(&before, true)?;
            let (with_turn, _) = self.render_marked(&upto, false)?;
            if !with_turn.starts_with(&prompt) || !text.starts_with(&with_turn) {
                return Err(Error::Dataset {
                    path: self.path.clone(),
                    line: 0,
                    reason: format!(
                        "the chat template has no {{% generation %}} tags and renders message {i} \
                         (an assistant turn) differently once later messages follow, so its \
                         tokens cannot be found; use a template with generation tags"
                    ),
                });
            }
            let start = prompt.chars().count();
            let end = start + with_turn[prompt.len()..].trim_end().chars().count();
            spans.push((start, end));
        }
        Ok((text, spans))
    }

    /// The render and the spans of its `{% generation %}` blocks.
    fn render_marked(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
    ) -> Result<(String, Vec<(usize, usize)>)> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| Error::Usage(format!("chat template syntax: {e}")))?;
        env.set_syntax(syntax);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        let fail = |e: minijinja::Error| Error::Dataset {
            path: self.path.clone(),
            line: 0,
            reason: format!("the chat template does not render: {e:#}"),
        };
        let tmpl = env.template_from_str(&self.source).map_err(fail)?;
        let raw = tmpl
            .render(context! {
                messages => minijinja::Value::from(minijinja::value::Serde(messages)),
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(fail)?;
        let (mut text, mut spans, mut open) = (String::with_capacity(raw.len()), vec![], None);
        let mut chars = 0;
        for c in raw.chars() {
            match c {
                START => open = Some(chars),
                END => {
                    if let Some(s) = open.take() {
                        spans.push((s, chars));
                    }
                }
                c => {
                    text.push(c);
                    chars += 1;
                }
            }
        }
        Ok((text, spans))
    }

    /// Token ids of the rendered `messages` (no special tokens added: the
    /// template prints them) and which of them are the assistant's.
    ///
    /// # Errors
    /// As [`ChatTemplate::render`]; a tokenizer error.
    pub fn tokenize(
        &self,
        tokenizer: &Tokenizer,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
    ) -> Result<(Vec<u32>, Vec<bool>)> {
        let (text, spans) = self.render(messages, add_generation_prompt)?;
        let (ids, offsets) = tokenizer.encode_with_char_offsets(&text, false)?;
        let token_at = |c: usize| offsets.iter().position(|&(s, e)| s <= c && c < e);
        let mut mask = vec![false; ids.len()];
        for (start, end) in spans {
            if end <= start {
                continue;
            }
            let Some(first) = token_at(start) else {
                break;
            };
            let last = token_at(end - 1).map_or(ids.len(), |t| t + 1);
            mask[first..last].iter_mut().for_each(|m| *m = true);
        }
        Ok((ids, mask))
    }
}

#[cfg(test)]
#[path = "chat_tests.rs"]
mod tests;
