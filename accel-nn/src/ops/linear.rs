//! `act(x @ w^T + b)` for inputs of any rank, fused on CPU.

use candle_core::{bail, DType, Result, Tensor};

use super::activation::composed_activation;
use super::{fused, Activation};
use crate::kernels::{self, Act};

/// PyTorch `nn.Linear` followed by an optional activation: `x [.., in]`,
/// weight `[out, in]`, bias `[out]`, result `[.., out]`.
///
/// On CPU this is one op (gemm with the bias fused in, activation and its
/// backward in the same pass). In bf16 its products take the bf16 operands
/// with f32 sums on CPUs with AMX tiles (`kernels/raw/amx/`, reading the
/// bf16 tensors as they lie) or AVX-512 BF16 (`kernels/gemm_bf16.rs`; twice
/// the f32 rate), else they are computed in f32, since candle's CPU gemm has
/// no bf16 kernel.
pub fn linear(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    act: Option<Activation>,
) -> Result<Tensor> {
    let (out, inp) = w.dims2()?;
    let Some((&last, lead)) = x.dims().split_last() else {
        bail!("linear: x must have at least one dimension")
    };
    if last != inp || b.is_some_and(|b| b.dims() != [out]) {
        bail!(
            "linear: x {:?}, weight {:?}, bias {:?} do not fit",
            x.dims(),
            w.dims(),
            b.map(|b| b.dims().to_vec())
        )
    }
    if !(fused(x) && x.dtype() == w.dtype()) {
        return composed_linear(x, w, b, act);
    }
    let n: usize = lead.iter().product();
    let act = act.map_or(Act::None, Activation::kernel);
    if x.rank() == 2 {
        // No reshape node in the graph for the common 2-D case.
        return kernels::linear(x, w, b, act);
    }
    let y = kernels::linear(&x.reshape((n, inp))?, w, b, act)?;
    let mut dims = lead.to_vec();
    dims.push(out);
    y.reshape(dims)
}

/// Composed linear: a batched matmul against the transposed weight (a
/// strided view, no copy), bias broadcast, then the composed activation.
pub fn composed_linear(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    act: Option<Activation>,
) -> Result<Tensor> {
    let dtype = x.dtype();
    let cpu_bf16 = dtype == DType::BF16 && x.device().is_cpu();
    let compute = if cpu_bf16 { DType::F32 } else { dtype };
    let (x, w) = (x.to_dtype(compute)?, w.to_dtype(compute)?);
    let (out, inp) = w.dims2()?;
    let lead = &x.dims()[..x.rank() - 1];
    let n: usize = lead.iter().product();
    let y = x.reshape((n, inp))?.matmul(&w.t()?)?;
    let y = match b {
        Some(b) => y.broadcast_add(&b.to_dtype(compute)?)?,
        None => y,
    };
    let mut dims = lead.to_vec();
    dims.push(out);
    composed_activation(&y.reshape(dims)?, act)?.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::*;

    #[test]
    fn linear_matches_composed_for_every_activation_and_rank() -> Result<()> {
        let acts = [
            None,
            Some(Activation::Relu),
            Some(Activation::Gelu),
            Some(Activation::GeluTanh),
            Some(Activation::Silu),
        ];
        for (i, act) in acts.into_iter().enumerate() {
            check_op(
                &[vec![2, 5, 12], vec![7, 12], vec![7]],
                30 + i as u64,
                &|xs| linear(&xs[0], &xs[1], Some(&xs[2]), act),
                &|xs| composed_linear(&xs[0], &xs[1], Some(&xs[2]), act),
            )?;
        }
        check_op(
            &[vec![9, 12], vec![7, 12]],
            40,
            &|xs| linear(&xs[0], &xs[1], None, None),
            &|xs| xs[0].matmul(&xs[1].t()?),
        )
    }

    #[test]
    fn bf16_linear_matches_f32_on_the_same_values_forward_and_backward() -> Result<()> {
        // 300 rows: past the skinny forward, so every product is a gemm
        // (bf16 products where the CPU has them); 20 rows, fewer than the
        // outputs: AMX's transposed forward, and the skinny one elsewhere.
        // The f32 reference runs the composed ops on the very same bf16
        // values.
        for rows in [300, 20] {
            bf16_linear_matches_f32(rows)?;
        }
        Ok(())
    }

    fn bf16_linear_matches_f32(rows: usize) -> Result<()> {
        let bf = |shape: &[usize], seed| -> Result<candle_core::Var> {
            candle_core::Var::from_tensor(&randn(shape, seed, 1.0)?.to_dtype(DType::BF16)?)
        };
        let (x, w, b) = (bf(&[rows, 70], 1)?, bf(&[90, 70], 2)?, bf(&[90], 3)?);
        let up = |v: &candle_core::Var| -> Result<candle_core::Var> {
            candle_core::Var::from_tensor(&v.to_dtype(DType::F32)?)
        };
        let (x32, w32, b32) = (up(&x)?, up(&w)?, up(&b)?);
        let g = randn(&[rows, 90], 4, 1.0)?;
        let y = linear(&x, &w, Some(&b), Some(Activation::Silu))?;
        let y32 = composed_linear(&x32, &w32, Some(&b32), Some(Activation::Silu))?;
        let grads = (y.to_dtype(DType::F32)? * &g)?.sum_all()?.backward()?;
        let grads32 = (&y32 * &g)?.sum_all()?.backward()?;
        let close = |a: &Tensor, want: &Tensor, what: &str| -> Result<()> {
            let a = a.to_dtype(DType::F32)?;
            let err = (&a - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
            // bf16 results: 8 bits of mantissa, plus the gradient rounded to
            // bf16 before its products.
            assert!(
                err <= 1.6e-2 * scale,
                "{rows} rows, {what}: max error {err} at scale {scale}"
            );
            Ok(())
        };
        close(&y, &y32, "y")?;
        for (v, v32, what) in [(&x, &x32, "dx"), (&w, &w32, "dw"), (&b, &b32, "db")] {
            let (g, g32) = (
                grads.get(v.as_tensor()).unwrap(),
                grads32.get(v32.as_tensor()).unwrap(),
            );
            assert_eq!(g.dtype(), DType::BF16, "{what}");
            close(g, g32, what)?;
        }
        Ok(())
    }

    #[test]
    fn linear_skips_the_input_gradient_of_plain_data() -> Result<()> {
        let x = Tensor::ones((4, 3), DType::F32, &candle_core::Device::Cpu)?;
        let w = candle_core::Var::from_tensor(&randn(&[2, 3], 1, 1.0)?)?;
        let grads = linear(&x, &w, None, None)?.sum_all()?.backward()?;
        assert!(grads.get(&x).is_none());
        // d(sum(x w^T))/dw = column sums of x = 4 everywhere.
        assert_eq!(
            grads.get(w.as_tensor()).unwrap().to_vec2::<f32>()?,
            vec![vec![4f32; 3]; 2]
        );
        Ok(())
    }
}
