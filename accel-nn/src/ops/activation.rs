//! Activations with fused CPU forward/backward, and [`Activation`], the
//! enum HF configs name them by.

use candle_core::{bail, DType, Result, Tensor};
use serde::Deserialize;

use super::{fused, fused_cuda, upcast};
use crate::kernels::{self, Act};

/// A pointwise activation as named in Hugging Face configs
/// (`hidden_act`), so a model can take it straight from `config.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Activation {
    /// Exact GELU, `x * Phi(x)` (PyTorch `gelu`, HF `"gelu"`).
    #[serde(rename = "gelu")]
    Gelu,
    /// GELU's tanh approximation (GPT-2's `"gelu_new"`, PyTorch
    /// `approximate="tanh"`, HF `"gelu_pytorch_tanh"`).
    #[serde(alias = "gelu_new", alias = "gelu_pytorch_tanh", rename = "gelu_tanh")]
    GeluTanh,
    /// `x * sigmoid(x)` (HF `"silu"` and `"swish"`, Llama's MLP).
    #[serde(alias = "swish", rename = "silu")]
    Silu,
    /// `max(x, 0)`.
    #[serde(rename = "relu")]
    Relu,
}

impl Activation {
    /// Applies the activation (fused on CPU, composed elsewhere).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if fused(x) {
            kernels::pointwise(x, self.kernel())
        } else if CUDA_ACTIVATIONS_CHECKED && fused_cuda(x) {
            kernels::pointwise(&x.to_dtype(DType::F32)?, self.kernel())?.to_dtype(x.dtype())
        } else {
            composed_activation(x, Some(*self))
        }
    }

    /// The kernel-side name of the same function.
    pub(crate) fn kernel(self) -> Act {
        match self {
            Activation::Gelu => Act::Gelu,
            Activation::GeluTanh => Act::GeluTanh,
            Activation::Silu => Act::Silu,
            Activation::Relu => Act::Relu,
        }
    }
}

impl candle_core::Module for Activation {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Activation::forward(self, x)
    }
}

/// Exact (erf) GELU, PyTorch's default `gelu`.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    Activation::Gelu.forward(x)
}

/// Tanh-approximated GELU (HF `gelu_new` / `gelu_pytorch_tanh`).
pub fn gelu_tanh(x: &Tensor) -> Result<Tensor> {
    Activation::GeluTanh.forward(x)
}

/// SiLU / swish, `x * sigmoid(x)`.
pub fn silu(x: &Tensor) -> Result<Tensor> {
    Activation::Silu.forward(x)
}

/// ReLU; candle's own has a backward too, this one also computes half
/// inputs in f32 like the other activations here.
pub fn relu(x: &Tensor) -> Result<Tensor> {
    Activation::Relu.forward(x)
}

/// Whether CUDA tensors take the activation and SwiGLU kernels of `act.cu`.
/// Off until a GPU run of `scripts/gpu_check.sh` has passed
/// `cuda_activations_match_...` and `cuda_swiglu_matches_...` (below); the
/// kernels compile in CI but have never run.
const CUDA_ACTIVATIONS_CHECKED: bool = false;

/// `silu(gate) * up`, the gated MLP of Llama-style models, in one pass.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.dims() != up.dims() {
        bail!(
            "swiglu: gate {:?} and up {:?} differ",
            gate.dims(),
            up.dims()
        )
    }
    if fused(gate) && gate.dtype() == up.dtype() {
        kernels::swiglu(gate, up)
    } else if CUDA_ACTIVATIONS_CHECKED && fused_cuda(gate) && gate.dtype() == up.dtype() {
        kernels::swiglu(&gate.to_dtype(DType::F32)?, &up.to_dtype(DType::F32)?)?
            .to_dtype(gate.dtype())
    } else {
        composed_swiglu(gate, up)
    }
}

/// Composed activation (`None` is the identity), in f32 for half inputs.
pub fn composed_activation(x: &Tensor, act: Option<Activation>) -> Result<Tensor> {
    let Some(act) = act else {
        return Ok(x.clone());
    };
    let dtype = x.dtype();
    let x = upcast(x)?;
    let y = match act {
        Activation::Gelu => x.gelu_erf()?,
        Activation::GeluTanh => x.gelu()?,
        Activation::Silu => x.silu()?,
        Activation::Relu => x.relu()?,
    };
    y.to_dtype(dtype)
}

/// Composed SwiGLU, in f32 for half inputs.
pub fn composed_swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let dtype = gate.dtype();
    (upcast(gate)?.silu()? * upcast(up)?)?.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::*;

    #[test]
    fn activations_match_composed_and_finite_differences() -> Result<()> {
        for (i, act) in [
            Activation::Gelu,
            Activation::GeluTanh,
            Activation::Silu,
            Activation::Relu,
        ]
        .into_iter()
        .enumerate()
        {
            check_op(
                &[vec![4, 33]],
                10 + i as u64,
                &|xs| act.forward(&xs[0]),
                &|xs| composed_activation(&xs[0], Some(act)),
            )?;
        }
        check_op(
            &[vec![3, 20], vec![3, 20]],
            20,
            &|xs| swiglu(&xs[0], &xs[1]),
            &|xs| composed_swiglu(&xs[0], &xs[1]),
        )
    }

    /// The activation kernels of `act.cu` against the CPU kernel, forward
    /// and gradient, over a range that reaches each formula's tails.
    #[test]
    #[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
    fn cuda_activations_match_the_cpu_kernel_and_its_gradient() -> Result<()> {
        let gpu = accel_kernels::cuda_device(0)
            .unwrap_or_else(|e| panic!("needs a CUDA device (build with --features cuda): {e}"));
        let cpu = candle_core::Device::Cpu;
        let x = randn(&[3, 1000], 70, 4.0)?;
        let dy = randn(&[3, 1000], 71, 1.0)?;
        for act in [Act::None, Act::Relu, Act::GeluTanh, Act::Gelu, Act::Silu] {
            let run = |dev: &candle_core::Device| -> Result<(Tensor, Tensor)> {
                let v = candle_core::Var::from_tensor(&x.to_device(dev)?)?;
                let y = kernels::pointwise(v.as_tensor(), act)?;
                let grads = (&y * dy.to_device(dev)?)?.sum_all()?.backward()?;
                let dx = grads.get(&v).expect("a gradient").to_device(&cpu)?;
                Ok((y.to_device(&cpu)?, dx))
            };
            let ((y, dx), (gy, gdx)) = (run(&cpu)?, run(&gpu)?);
            assert_close(&gy, &y, 1e-5, &format!("{act:?} forward"))?;
            assert_close(&gdx, &dx, 1e-5, &format!("{act:?} gradient"))?;
        }
        Ok(())
    }

    /// The SwiGLU kernels of `act.cu` against the CPU kernel, forward and
    /// both gradients, on sizes that do not fill a block and one that takes
    /// the grid-stride loop; bf16 inputs through the f32 conversion
    /// `ops::swiglu` wraps them in. What must pass before `CUDA_ACTIVATIONS_CHECKED`.
    #[test]
    #[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
    fn cuda_swiglu_matches_the_cpu_kernel_and_its_gradients() -> Result<()> {
        let gpu = accel_kernels::cuda_device(0)
            .unwrap_or_else(|e| panic!("needs a CUDA device (build with --features cuda): {e}"));
        let cpu = candle_core::Device::Cpu;
        for (k, n) in [1usize, 255, 1000, 3 << 21].into_iter().enumerate() {
            let seed = 40 + 4 * k as u64;
            let (g, u, dy) = (
                randn(&[n], seed, 3.0)?,
                randn(&[n], seed + 1, 1.0)?,
                randn(&[n], seed + 2, 1.0)?,
            );
            let run = |dev: &candle_core::Device| -> Result<Vec<Tensor>> {
                let gv = candle_core::Var::from_tensor(&g.to_device(dev)?)?;
                let uv = candle_core::Var::from_tensor(&u.to_device(dev)?)?;
                let y = kernels::swiglu(gv.as_tensor(), uv.as_tensor())?;
                let grads = (&y * dy.to_device(dev)?)?.sum_all()?.backward()?;
                let grad = |v: &candle_core::Var| grads.get(v).expect("a gradient").to_device(&cpu);
                Ok(vec![y.to_device(&cpu)?, grad(&gv)?, grad(&uv)?])
            };
            let (want, got) = (run(&cpu)?, run(&gpu)?);
            for (name, (w, g)) in ["y", "dgate", "dup"].iter().zip(want.iter().zip(&got)) {
                assert_close(g, w, 1e-5, &format!("{name} [{n}]"))?;
            }
        }
        // bf16 on the GPU as `ops::swiglu` would run it, against the CPU's bf16 path.
        let (g, u) = (
            randn(&[4, 96], 60, 3.0)?.to_dtype(DType::BF16)?,
            randn(&[4, 96], 61, 1.0)?.to_dtype(DType::BF16)?,
        );
        let on_gpu = kernels::swiglu(
            &g.to_device(&gpu)?.to_dtype(DType::F32)?,
            &u.to_device(&gpu)?.to_dtype(DType::F32)?,
        )?
        .to_dtype(DType::BF16)?
        .to_device(&cpu)?;
        let want = swiglu(&g, &u)?;
        assert_close(
            &on_gpu.to_dtype(DType::F32)?,
            &want.to_dtype(DType::F32)?,
            1e-2,
            "bf16",
        )
    }

    #[test]
    fn hf_config_names_parse() {
        let parse = |s: &str| serde_json::from_str::<Activation>(&format!("\"{s}\"")).unwrap();
        assert_eq!(parse("gelu"), Activation::Gelu);
        assert_eq!(parse("gelu_new"), Activation::GeluTanh);
        assert_eq!(parse("gelu_pytorch_tanh"), Activation::GeluTanh);
        assert_eq!(parse("silu"), Activation::Silu);
        assert_eq!(parse("swish"), Activation::Silu);
        assert_eq!(parse("relu"), Activation::Relu);
        assert!(serde_json::from_str::<Activation>("\"tanh\"").is_err());
    }

    #[test]
    fn exact_and_tanh_gelu_differ_as_in_pytorch() -> Result<()> {
        // torch.nn.functional.gelu(torch.tensor([1.0, -2.0]))
        //   -> [0.8413447, -0.0455003]; with approximate="tanh"
        //   -> [0.8411920, -0.0454023].
        let x = Tensor::new(&[1f32, -2.0], &candle_core::Device::Cpu)?;
        let want = Tensor::new(&[0.841_344_7f32, -0.045_500_3], &candle_core::Device::Cpu)?;
        assert_close(&gelu(&x)?, &want, 1e-6, "gelu")?;
        let want = Tensor::new(&[0.841_192f32, -0.045_402_3], &candle_core::Device::Cpu)?;
        assert_close(&gelu_tanh(&x)?, &want, 1e-6, "gelu_tanh")
    }
}
