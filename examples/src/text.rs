//! Text data for the character-level GPT demo and the GPT benchmark.
//!
//! [`CORPUS`] (about 80 KB of plain ASCII English, 75 distinct
//! characters) is embedded at compile time so the examples run offline
//! with no download step. All of it is public domain text, published
//! before 1900:
//! * King James Bible (1611): Genesis 1-3, Psalms 1, 23 and 121,
//!   Ecclesiastes 3, 1 Corinthians 13, passages of Matthew 5-7;
//! * Shakespeare: twelve sonnets and speeches from nine plays;
//! * the US Declaration of Independence (1776), the Constitution's
//!   preamble and the Bill of Rights, Lincoln's Gettysburg Address (1863)
//!   and Second Inaugural Address (1865);
//! * eighteen of Aesop's fables in 19th-century English (after Joseph
//!   Jacobs, 1894);
//! * poems by Blake, Shelley, Wordsworth, Burns, Tennyson, Whitman,
//!   Carroll and Poe, and the openings of novels by Austen, Dickens,
//!   Melville and Carroll.
//!
//! The passages were written out from memory, so small departures from any
//! particular printed edition are expected and do not matter for training.

use std::collections::BTreeMap;

use candle_core::{bail, Result};

use accel_core::rng::SplitMix64;

/// The embedded public-domain English corpus (see the module docs).
pub const CORPUS: &str = include_str!("../data/corpus.txt");

/// A character-level tokenizer: every distinct character of the training
/// text gets an id, in sorted order so the ids do not depend on where a
/// character first appears.
#[derive(Debug, Clone)]
pub struct CharTokenizer {
    chars: Vec<char>,
    ids: BTreeMap<char, u32>,
}

impl CharTokenizer {
    /// Builds the vocabulary from the distinct characters of `text`.
    pub fn new(text: &str) -> Self {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        let ids = chars
            .iter()
            .enumerate()
            .map(|(i, &c)| (c, i as u32))
            .collect();
        Self { chars, ids }
    }

    /// Number of distinct characters, i.e. the model's vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.chars.len()
    }

    /// The characters in id order.
    pub fn chars(&self) -> &[char] {
        &self.chars
    }

    /// Maps `text` to ids; fails on a character the vocabulary lacks, because
    /// silently dropping it would shift every later training target.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        text.chars()
            .map(|c| match self.ids.get(&c) {
                Some(&id) => Ok(id),
                None => bail!("character {c:?} is not in the tokenizer vocabulary"),
            })
            .collect()
    }

    /// Maps ids back to text. An id outside the vocabulary becomes U+FFFD so
    /// that decoding a sample never fails halfway through.
    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter()
            .map(|&id| {
                self.chars
                    .get(id as usize)
                    .copied()
                    .unwrap_or(char::REPLACEMENT_CHARACTER)
            })
            .collect()
    }
}

/// Next-token training pairs cut from `tokens`.
///
/// Window `w` starts at `w * stride`; its inputs are `block_size` tokens and
/// its targets the same span shifted one token to the right. Only windows
/// whose last target lies inside `tokens` are produced. Returns the inputs
/// and targets flattened row-major (`count * block_size` each) and `count`,
/// ready for `Tensor::from_vec(inputs, (count, block_size), dev)`.
///
/// # Panics
/// If `block_size` or `stride` is zero.
pub fn windows(tokens: &[u32], block_size: usize, stride: usize) -> (Vec<u32>, Vec<u32>, usize) {
    assert!(block_size > 0, "block_size must be positive");
    assert!(stride > 0, "stride must be positive");
    let count = if tokens.len() > block_size {
        (tokens.len() - block_size - 1) / stride + 1
    } else {
        0
    };
    let mut inputs = Vec::with_capacity(count * block_size);
    let mut targets = Vec::with_capacity(count * block_size);
    for w in 0..count {
        let start = w * stride;
        inputs.extend_from_slice(&tokens[start..start + block_size]);
        targets.extend_from_slice(&tokens[start + 1..start + block_size + 1]);
    }
    (inputs, targets, count)
}

/// `n` pseudo-random token ids in `[0, vocab)`, identical for a given seed on
/// every platform; the benchmark uses them so that PyTorch and accel-rs can
/// be fed the very same batches.
///
/// # Panics
/// If `vocab` is zero.
pub fn synthetic_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    assert!(vocab > 0, "vocab must be positive");
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_round_trips_text_and_sorts_its_vocabulary() {
        let tok = CharTokenizer::new("hello world");
        assert_eq!(tok.chars(), &[' ', 'd', 'e', 'h', 'l', 'o', 'r', 'w']);
        assert_eq!(tok.vocab_size(), 8);
        let ids = tok.encode("hello world").unwrap();
        assert_eq!(ids, vec![3, 2, 4, 4, 5, 0, 7, 5, 6, 4, 1]);
        assert_eq!(tok.decode(&ids), "hello world");
    }

    #[test]
    fn tokenizer_rejects_unknown_characters_and_decodes_bad_ids_as_replacement() {
        let tok = CharTokenizer::new("ab");
        assert!(tok.encode("abc").is_err());
        assert_eq!(tok.decode(&[0, 9, 1]), "a\u{FFFD}b");
    }

    #[test]
    fn corpus_round_trips_through_its_own_tokenizer() {
        let tok = CharTokenizer::new(CORPUS);
        assert!(CORPUS.len() >= 40_000, "corpus is {} bytes", CORPUS.len());
        assert!(CORPUS.is_ascii());
        assert_eq!(tok.vocab_size(), 75);
        let ids = tok.encode(CORPUS).unwrap();
        assert_eq!(tok.decode(&ids), CORPUS);
    }

    #[test]
    fn windows_shift_targets_by_one_token() {
        let tokens: Vec<u32> = (0..10).collect();
        let (x, y, n) = windows(&tokens, 4, 3);
        // Starts 0, 3 fit (last target index 4 and 7); start 6 needs index 10.
        assert_eq!(n, 2);
        assert_eq!(x, vec![0, 1, 2, 3, 3, 4, 5, 6]);
        assert_eq!(y, vec![1, 2, 3, 4, 4, 5, 6, 7]);
    }

    #[test]
    fn windows_use_the_last_token_when_it_fits_exactly() {
        let tokens: Vec<u32> = (0..9).collect();
        let (x, y, n) = windows(&tokens, 4, 4);
        assert_eq!(n, 2);
        assert_eq!(&x[4..], &[4, 5, 6, 7]);
        assert_eq!(&y[4..], &[5, 6, 7, 8]);
    }

    #[test]
    fn windows_of_a_too_short_input_are_empty() {
        let (x, y, n) = windows(&[1, 2, 3], 3, 1);
        assert_eq!((x.len(), y.len(), n), (0, 0, 0));
    }

    #[test]
    fn synthetic_tokens_are_deterministic_per_seed_and_in_range() {
        let a = synthetic_tokens(1000, 37, 1);
        assert_eq!(a, synthetic_tokens(1000, 37, 1));
        assert_ne!(a, synthetic_tokens(1000, 37, 2));
        assert!(a.iter().all(|&t| t < 37));
        // Every id shows up: the stream is not stuck in a corner.
        let mut seen = [false; 37];
        a.iter().for_each(|&t| seen[t as usize] = true);
        assert!(seen.iter().all(|&s| s));
    }
}
