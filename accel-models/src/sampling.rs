//! How `generate` picks each next token, as transformers' `generate` does:
//! the repetition penalty on the scores, then (sampling) temperature, top-k
//! and top-p, and a draw from the remaining distribution; greedy otherwise.

use crate::error::bail_input;
use crate::Result;

/// transformers' `GenerationConfig` fields that choose the next token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// Draw from the distribution (`do_sample`); else the argmax.
    pub do_sample: bool,
    /// Scores divided by it before the softmax (`temperature`, > 0).
    pub temperature: f64,
    /// Keep the `k` largest scores (`top_k`; `None` or 0: all).
    pub top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability reaches `p` (`top_p`).
    pub top_p: Option<f64>,
    /// Scores of tokens already in the sequence divided by it when positive,
    /// multiplied when negative (`repetition_penalty`, > 0).
    pub repetition_penalty: Option<f64>,
    /// Seed of the draws: the same seed gives the same tokens.
    pub seed: u64,
}

impl Default for Sampling {
    /// Greedy decoding.
    fn default() -> Self {
        Self {
            do_sample: false,
            temperature: 1.0,
            top_k: None,
            top_p: None,
            repetition_penalty: None,
            seed: 0,
        }
    }
}

impl Sampling {
    /// Refuses values transformers refuses.
    ///
    /// # Errors
    /// A temperature or penalty that is not positive, a `top_p` outside
    /// `(0, 1]`, each naming the setting.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            bail_input!(
                "temperature",
                "{} must be a positive number",
                self.temperature
            );
        }
        if let Some(p) = self.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            bail_input!("top_p", "{p} must be in (0, 1]");
        }
        if let Some(r) = self
            .repetition_penalty
            .filter(|r| !(*r > 0.0 && r.is_finite()))
        {
            bail_input!("repetition_penalty", "{r} must be a positive number");
        }
        Ok(())
    }
}

/// Picks tokens one at a time from a sequence's last scores.
#[derive(Debug)]
pub(crate) struct Sampler {
    cfg: Sampling,
    state: u64,
}

impl Sampler {
    pub fn new(cfg: &Sampling) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            state: cfg.seed,
            cfg: cfg.clone(),
        })
    }

    /// The next token after `seq` (prompt and tokens so far) from `scores`.
    pub fn next(&mut self, mut scores: Vec<f32>, seq: &[u32]) -> u32 {
        if let Some(r) = self.cfg.repetition_penalty {
            let r = r as f32;
            let mut seen = seq.to_vec();
            seen.sort_unstable();
            seen.dedup();
            for &t in &seen {
                if let Some(s) = scores.get_mut(t as usize) {
                    *s = if *s < 0.0 { *s * r } else { *s / r };
                }
            }
        }
        if !self.cfg.do_sample {
            return argmax(&scores);
        }
        let inv_t = 1.0 / self.cfg.temperature as f32;
        scores.iter_mut().for_each(|s| *s *= inv_t);
        if let Some(k) = self.cfg.top_k.filter(|&k| k > 0 && k < scores.len()) {
            // Everything below the k-th largest score goes (ties kept, as torch).
            let mut sorted = scores.clone();
            sorted.sort_unstable_by(|a, b| b.total_cmp(a));
            let kth = sorted[k - 1];
            scores
                .iter_mut()
                .filter(|s| **s < kth)
                .for_each(|s| *s = f32::NEG_INFINITY);
        }
        let mut probs = softmax(&scores);
        if let Some(p) = self.cfg.top_p.filter(|&p| p < 1.0) {
            // Ascending order: drop the tokens whose cumulative probability is
            // at most 1 - p, keeping at least the most likely one.
            let mut order: Vec<usize> = (0..probs.len()).collect();
            order.sort_by(|&a, &b| probs[a].total_cmp(&probs[b]));
            let mut cum = 0.0f32;
            let last = order.len() - 1;
            for (rank, &i) in order.iter().enumerate() {
                cum += probs[i];
                if cum <= (1.0 - p) as f32 && rank < last {
                    scores[i] = f32::NEG_INFINITY;
                }
            }
            probs = softmax(&scores);
        }
        let u = self.uniform() as f32;
        let mut cum = 0.0;
        for (i, &pi) in probs.iter().enumerate() {
            cum += pi;
            if u < cum {
                return i as u32;
            }
        }
        // Rounding left `u` past the last sum: the last token with mass.
        probs.iter().rposition(|&p| p > 0.0).unwrap_or(0) as u32
    }

    /// A uniform draw in `[0, 1)` (SplitMix64).
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Index of the first maximum (as `torch.argmax`).
pub(crate) fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

fn softmax(scores: &[f32]) -> Vec<f32> {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f32 = e.iter().sum();
    e.into_iter().map(|x| x / sum).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampling() -> Sampling {
        Sampling {
            do_sample: true,
            seed: 7,
            ..Sampling::default()
        }
    }

    /// The same seed draws the same tokens; another seed others; draws
    /// follow the probabilities.
    #[test]
    fn seeded_draws_repeat_and_follow_the_distribution() {
        let scores = vec![0.0f32, 1.0, 2.0, 3.0];
        let draw = |seed| {
            let mut s = Sampler::new(&Sampling { seed, ..sampling() }).unwrap();
            (0..2000)
                .map(|_| s.next(scores.clone(), &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(1), draw(1));
        assert_ne!(draw(1), draw(2));
        let counts = draw(3).iter().fold([0usize; 4], |mut c, &t| {
            c[t as usize] += 1;
            c
        });
        let p = softmax(&scores);
        for (c, p) in counts.iter().zip(p) {
            assert!((*c as f32 / 2000.0 - p).abs() < 0.04, "{counts:?}");
        }
    }

    /// transformers' warpers: top-k keeps the k best, top-p the smallest
    /// head reaching p, the repetition penalty divides positive scores and
    /// multiplies negative ones of tokens already in the sequence.
    #[test]
    fn top_k_top_p_and_the_repetition_penalty() {
        let scores = vec![5.0f32, 4.0, -1.0, 3.0, 0.0];
        let mut k = Sampler::new(&Sampling {
            top_k: Some(2),
            ..sampling()
        })
        .unwrap();
        assert!((0..500).all(|_| k.next(scores.clone(), &[]) < 2));
        // softmax ~ [0.66, 0.24, 0.002, 0.09, 0.004]: p = 0.8 keeps two.
        let mut p = Sampler::new(&Sampling {
            top_p: Some(0.8),
            ..sampling()
        })
        .unwrap();
        assert!((0..500).all(|_| p.next(scores.clone(), &[]) < 2));
        let greedy = Sampling {
            repetition_penalty: Some(2.0),
            ..Sampling::default()
        };
        let mut g = Sampler::new(&greedy).unwrap();
        // 5 / 2 = 2.5 < 3 and 4 / 2 = 2: token 3 wins; -1 * 2 stays low.
        assert_eq!(g.next(scores.clone(), &[0, 1, 2]), 3);
        assert_eq!(g.next(scores, &[]), 0);
        let bad = Sampling {
            temperature: 0.0,
            ..sampling()
        };
        assert!(Sampler::new(&bad)
            .unwrap_err()
            .to_string()
            .contains("temperature"));
    }
}
