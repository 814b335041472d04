//! `tokenizer.json` through the `tokenizers` crate (the library transformers'
//! fast tokenizers are), checked against the model's vocabulary.

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// A token's characters in the encoded text: `[start, end)`, counted in
/// characters, not bytes.
pub type CharSpan = (usize, usize);

/// A Hugging Face fast tokenizer read from `tokenizer.json`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl Tokenizer {
    /// Reads a `tokenizer.json` file, or the one in a checkpoint folder,
    /// without the padding and truncation the file may set (as transformers
    /// loads it; set them on a clone of [`Tokenizer::inner`] to batch).
    ///
    /// # Errors
    /// [`Error::Tokenizer`] naming the file when it is missing or invalid.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let path = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        let err = |e: tokenizers::Error| Error::Tokenizer {
            path: path.clone(),
            reason: e.to_string(),
        };
        let mut inner = tokenizers::Tokenizer::from_file(&path).map_err(err)?;
        // transformers' `tokenizer(text)` neither pads nor truncates unless
        // asked, whatever the file says (sentence-transformers' exports pad
        // and truncate to 128), so [`Tokenizer::encode`] does not either.
        inner.with_padding(None);
        inner.with_truncation(None).map_err(err)?;
        Ok(Self { inner, path })
    }

    /// Reads the tokenizer of a checkpoint folder and checks that every id
    /// it can produce has an embedding in a model of `model_vocab` tokens.
    ///
    /// # Errors
    /// As [`Tokenizer::from_file`]; [`Error::VocabMismatch`].
    pub fn for_model(dir: impl AsRef<Path>, model_vocab: usize) -> Result<Self> {
        let tok = Self::from_file(dir)?;
        tok.check_vocab(model_vocab)?;
        Ok(tok)
    }

    /// Fails when the tokenizer can produce an id `>= model_vocab` (a
    /// tokenizer from another model: its ids would index past the embedding).
    ///
    /// # Errors
    /// [`Error::VocabMismatch`] naming the file.
    pub fn check_vocab(&self, model_vocab: usize) -> Result<()> {
        let n = self.vocab_size();
        if n > model_vocab {
            return Err(Error::VocabMismatch {
                path: self.path.clone(),
                tokenizer_vocab: n,
                model_vocab,
            });
        }
        Ok(())
    }

    /// One past the largest id the tokenizer can produce (added tokens included).
    pub fn vocab_size(&self) -> usize {
        self.inner
            .get_vocab(true)
            .values()
            .map(|&id| id as usize + 1)
            .max()
            .unwrap_or(0)
    }

    /// The file the tokenizer was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Token ids of `text`, with the tokenizer's special tokens (BOS, ...)
    /// when `add_special_tokens`, as `tokenizer(text)` in Python.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] naming the file.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| self.err(e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of `text` and each token's range of characters (not bytes)
    /// in it, as Python's `char_to_token` sees them: what chat templates map
    /// their assistant spans through.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] naming the file.
    pub fn encode_with_char_offsets(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<(Vec<u32>, Vec<CharSpan>)> {
        let enc = self
            .inner
            .encode_char_offsets(text, add_special_tokens)
            .map_err(|e| self.err(e))?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    /// Text of `ids`, skipping special tokens when asked.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] naming the file.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| self.err(e))
    }

    /// The underlying `tokenizers` tokenizer (padding, batches, offsets).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    fn err(&self, e: tokenizers::Error) -> Error {
        Error::Tokenizer {
            path: self.path.clone(),
            reason: e.to_string(),
        }
    }
}
