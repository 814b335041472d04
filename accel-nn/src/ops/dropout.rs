//! Dropout on candle's device RNG.

use candle_core::{bail, DType, Result, Tensor};

/// Zeroes each element with probability `p` and scales the rest by
/// `1 / (1 - p)` when `train`; the identity otherwise (and when `p == 0`).
/// `p` is f32 as in `candle_nn::ops::dropout`.
///
/// The mask comes from `Tensor::rand`, candle's device RNG: on CUDA
/// `Device::set_seed` makes it reproducible; candle 0.11's CPU RNG is
/// thread-local and cannot be seeded, so use
/// [`crate::layers::Dropout::with_seed`] for reproducible CPU runs.
pub fn dropout(x: &Tensor, p: f32, train: bool) -> Result<Tensor> {
    if !(0.0..1.0).contains(&p) {
        bail!("dropout: probability must be in [0, 1), got {p}")
    }
    if !train || p == 0.0 {
        return Ok(x.clone());
    }
    let keep = Tensor::rand(0f32, 1f32, x.shape(), x.device())?.ge(p as f64)?;
    apply_mask(x, &keep, p)
}

/// `x * keep / (1 - p)` with `keep` a u8 mask of `x`'s shape; the one
/// product is also the backward (gradient times the same mask).
pub(crate) fn apply_mask(x: &Tensor, keep: &Tensor, p: f32) -> Result<Tensor> {
    let scale = (keep.to_dtype(DType::F32)? * (1.0 / (1.0 - p as f64)))?.to_dtype(x.dtype())?;
    x * scale
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn dropout_scales_kept_elements_and_routes_gradients_through_the_mask() -> Result<()> {
        let x = Var::from_tensor(&Tensor::ones((64, 64), DType::F32, &Device::Cpu)?)?;
        let y = dropout(&x, 0.25, true)?;
        let v: Vec<f32> = y.flatten_all()?.to_vec1()?;
        let kept = v.iter().filter(|&&e| e != 0.0).count() as f64 / v.len() as f64;
        assert!((kept - 0.75).abs() < 0.05, "kept {kept}");
        assert!(v.iter().all(|&e| e == 0.0 || (e - 1.0 / 0.75).abs() < 1e-6));
        let g = y.sum_all()?.backward()?;
        let g: Vec<f32> = g.get(x.as_tensor()).unwrap().flatten_all()?.to_vec1()?;
        assert_eq!(
            g, v,
            "the gradient of sum(dropout(x)) at ones is the mask itself"
        );
        let same = dropout(&x, 0.25, false)?;
        assert_eq!(same.flatten_all()?.to_vec1::<f32>()?, vec![1f32; 4096]);
        assert!(dropout(&x, 1.0, true).is_err());
        let h = dropout(&x.to_dtype(DType::BF16)?, 0.5, true)?;
        assert_eq!(h.dtype(), DType::BF16);
        Ok(())
    }
}
