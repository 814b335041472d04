//! Synthetic, learnable classification data shaped like MNIST.
//!
//! The MLP benchmark and tests need images-and-labels without a download.
//! Each class is a Gaussian blob around its own centre; a linear layer can
//! already separate them, so a training loop that works shows a falling
//! loss within a few steps.

use accel_core::rng::SplitMix64;

/// Seed of the class centres. It is fixed, not derived from the caller's
/// seed, so that a training set and an evaluation set drawn with different
/// seeds share the same classes and the evaluation accuracy means something.
const CENTRE_SEED: u64 = 0x00C0_FFEE;

/// Standard deviation of the class centres around the origin. Together with
/// unit noise it puts neighbouring centres several noise widths apart in
/// 784 dimensions, yet no single pixel gives a class away.
const CENTRE_SCALE: f64 = 0.5;

/// `n` samples of dimension `dim` spread over `classes` classes.
///
/// Returns the features row-major (`n * dim` values, one sample per row) and
/// one label in `[0, classes)` per sample. Sample `i` is its class centre
/// plus independent N(0, 1) noise; labels are drawn uniformly. The same
/// arguments always give the same data; another `seed` gives other samples
/// around the same centres.
///
/// # Panics
/// If `classes` is zero.
pub fn synthetic_classification(
    n: usize,
    dim: usize,
    classes: usize,
    seed: u64,
) -> (Vec<f32>, Vec<u32>) {
    assert!(classes > 0, "classes must be positive");
    let mut centre_rng = SplitMix64::new(CENTRE_SEED ^ ((dim as u64) << 32) ^ classes as u64);
    let centres: Vec<f64> = (0..classes * dim)
        .map(|_| CENTRE_SCALE * centre_rng.next_normal())
        .collect();
    let mut rng = SplitMix64::new(seed);
    let mut features = Vec::with_capacity(n * dim);
    let mut labels = Vec::with_capacity(n);
    for _ in 0..n {
        let label = rng.below(classes as u64) as usize;
        let centre = &centres[label * dim..(label + 1) * dim];
        features.extend(centre.iter().map(|&c| (c + rng.next_normal()) as f32));
        labels.push(label as u32);
    }
    (features, labels)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_classification_has_the_requested_shapes() {
        let (x, y) = synthetic_classification(10, 784, 10, 0);
        assert_eq!(x.len(), 7840);
        assert_eq!(y.len(), 10);
        assert!(y.iter().all(|&l| l < 10));
        assert!(x.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn synthetic_classification_is_deterministic_for_a_seed_and_differs_for_another() {
        let a = synthetic_classification(50, 16, 4, 3);
        assert_eq!(a, synthetic_classification(50, 16, 4, 3));
        let b = synthetic_classification(50, 16, 4, 4);
        assert_ne!(a.0, b.0);
        assert_ne!(a.1, b.1);
    }

    #[test]
    fn nearest_centre_classifies_samples_of_another_seed() {
        // Estimate the centres from one seed and classify another: the blobs
        // must be shared across seeds and separable.
        let (dim, classes) = (64, 5);
        let (x, y) = synthetic_classification(2000, dim, classes, 1);
        let mut sums = vec![0f64; classes * dim];
        let mut counts = vec![0usize; classes];
        for (row, &l) in x.chunks(dim).zip(&y) {
            counts[l as usize] += 1;
            for (s, &v) in sums[l as usize * dim..].iter_mut().zip(row) {
                *s += v as f64;
            }
        }
        let (xt, yt) = synthetic_classification(500, dim, classes, 2);
        let mut correct = 0;
        for (row, &l) in xt.chunks(dim).zip(&yt) {
            let dist = |c: usize| -> f64 {
                row.iter()
                    .enumerate()
                    .map(|(j, &v)| (v as f64 - sums[c * dim + j] / counts[c] as f64).powi(2))
                    .sum()
            };
            let best = (0..classes)
                .min_by(|&a, &b| dist(a).total_cmp(&dist(b)))
                .unwrap();
            correct += usize::from(best == l as usize);
        }
        assert!(correct >= 475, "{correct}/500 correct");
    }
}
