//! A multi-layer perceptron classifier, the "hello world" model of the
//! examples and of the MLP benchmark.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use accel_core::prelude::{Activations, AnyBlock, Block, BlockForward, Model};
use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;

use accel_core::nn::ops::{self, composed, Activation};

/// One layer `layers.{i}`: `act(x @ w^T + b)`.
struct Dense {
    w: Tensor,
    b: Tensor,
    act: Option<Activation>,
    fused: Arc<AtomicBool>,
}

impl BlockForward for Dense {
    fn forward(&self, x: &Activations) -> Result<Tensor> {
        let fused = self.fused.load(Ordering::Relaxed) && self.w.device().is_cpu();
        if fused {
            ops::linear(&x.hidden, &self.w, Some(&self.b), self.act)
        } else {
            composed::linear(&x.hidden, &self.w, Some(&self.b), self.act)
        }
    }
}

/// Fully connected layers with ReLU between them (none after the last),
/// producing logits; each layer is a [`Block`], so the same struct runs
/// plain, sharded or offloaded.
///
/// Parameters are named like a PyTorch `nn.Sequential` of `nn.Linear`
/// layers stored under `layers`: `layers.{i}.weight` with shape
/// `[out, in]` and `layers.{i}.bias` with shape `[out]`, so checkpoints map
/// one to one onto the PyTorch reference model.
pub struct Mlp {
    layers: Vec<Block<Dense>>,
    fused: Arc<AtomicBool>,
}

impl std::fmt::Debug for Mlp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mlp")
            .field("layers", &self.layers.len())
            .finish()
    }
}

impl Mlp {
    /// Builds the layers `sizes[0] -> sizes[1] -> ... -> sizes[n-1]`, e.g.
    /// `[784, 512, 512, 10]`, initialised like PyTorch `nn.Linear`
    /// (uniform in ±1/sqrt(fan_in) for weights and biases).
    pub fn new(sizes: &[usize], vb: VarBuilder) -> Result<Self> {
        if sizes.len() < 2 {
            candle_core::bail!("an Mlp needs at least an input and an output size, got {sizes:?}")
        }
        let fused = Arc::new(AtomicBool::new(vb.device().is_cpu()));
        let n = sizes.len() - 1;
        let layers = sizes
            .windows(2)
            .enumerate()
            .map(|(i, io)| {
                let (inp, out, fused) = (io[0], io[1], fused.clone());
                let act = (i + 1 < n).then_some(Activation::Relu);
                let name = format!("layers.{i}");
                Ok(Block::new(&vb, &name, "Linear", move |vb| {
                    let l = candle_nn::linear(inp, out, vb)?;
                    Ok(Dense {
                        w: l.weight().clone(),
                        b: l.bias().expect("linear has a bias").clone(),
                        act,
                        fused: fused.clone(),
                    })
                })?)
            })
            .collect::<Result<_>>()?;
        Ok(Self { layers, fused })
    }

    /// Number of linear layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Chooses between the fused CPU linear+ReLU kernel (the default on CPU)
    /// and composed candle ops (the only choice on other devices, where
    /// asking for fused kernels is ignored).
    pub fn set_fused_kernels(&mut self, fused: bool) {
        self.fused.store(fused, Ordering::Relaxed);
    }

    /// Logits `[batch, sizes[n-1]]` for inputs `x [batch, sizes[0]]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = Activations::new(x.clone());
        for layer in &self.layers {
            x.hidden = layer.forward(&x)?;
        }
        Ok(x.hidden)
    }

    /// Mean cross entropy of the logits for `x` against `labels [batch]`
    /// (u32 class ids), computed in f32 whatever the parameter dtype.
    pub fn loss(&self, x: &Tensor, labels: &Tensor) -> Result<Tensor> {
        ops::cross_entropy(&self.forward(x)?, labels)
    }
}

impl Model for Mlp {
    fn blocks(&self) -> Vec<&dyn AnyBlock> {
        self.layers.iter().map(|l| l as &dyn AnyBlock).collect()
    }
}

impl candle_nn::Module for Mlp {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        Mlp::forward(self, xs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use candle_nn::VarMap;

    #[test]
    fn mlp_forward_gives_one_logit_per_class_and_pytorch_parameter_names() -> Result<()> {
        let map = VarMap::new();
        let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
        let mlp = Mlp::new(&[784, 512, 512, 10], vb)?;
        assert_eq!(mlp.num_layers(), 3);
        let x = Tensor::zeros((4, 784), DType::F32, &Device::Cpu)?;
        assert_eq!(mlp.forward(&x)?.dims(), &[4, 10]);

        let data = map.data().lock().unwrap();
        let mut names: Vec<(String, Vec<usize>)> = data
            .iter()
            .map(|(k, v)| (k.clone(), v.dims().to_vec()))
            .collect();
        names.sort();
        let expected = [
            ("layers.0.bias", vec![512]),
            ("layers.0.weight", vec![512, 784]),
            ("layers.1.bias", vec![512]),
            ("layers.1.weight", vec![512, 512]),
            ("layers.2.bias", vec![10]),
            ("layers.2.weight", vec![10, 512]),
        ];
        let expected: Vec<(String, Vec<usize>)> = expected
            .iter()
            .map(|(k, d)| (k.to_string(), d.clone()))
            .collect();
        assert_eq!(names, expected);
        Ok(())
    }

    #[test]
    fn mlp_loss_falls_when_trained_on_synthetic_blobs() -> Result<()> {
        use candle_nn::{Optimizer, SGD};
        let dev = Device::Cpu;
        let map = VarMap::new();
        let vb = VarBuilder::from_varmap(&map, DType::F32, &dev);
        let mlp = Mlp::new(&[32, 16, 4], vb)?;
        let (x, y) = crate::mnist_like::synthetic_classification(256, 32, 4, 0);
        let x = Tensor::from_vec(x, (256, 32), &dev)?;
        let y = Tensor::from_vec(y, 256, &dev)?;
        let mut opt = SGD::new(map.all_vars(), 0.1)?;
        let first = mlp.loss(&x, &y)?.to_scalar::<f32>()?;
        for _ in 0..30 {
            opt.backward_step(&mlp.loss(&x, &y)?)?;
        }
        let last = mlp.loss(&x, &y)?.to_scalar::<f32>()?;
        assert!(last < 0.5 * first, "loss went from {first} to {last}");
        Ok(())
    }

    #[test]
    fn mlp_runs_in_bf16_and_keeps_the_loss_in_f32() -> Result<()> {
        let dev = Device::Cpu;
        let map = VarMap::new();
        let vb = VarBuilder::from_varmap(&map, DType::BF16, &dev);
        let mlp = Mlp::new(&[8, 8, 3], vb)?;
        let x = Tensor::ones((2, 8), DType::BF16, &dev)?;
        let y = Tensor::new(&[0u32, 2], &dev)?;
        let logits = mlp.forward(&x)?;
        assert_eq!(logits.dtype(), DType::BF16);
        let loss = mlp.loss(&x, &y)?;
        assert_eq!(loss.dtype(), DType::F32);
        let grads = loss.backward()?;
        for var in map.all_vars() {
            assert!(grads.get(var.as_tensor()).is_some());
        }
        Ok(())
    }
}
