//! The quantized linear op and layer: fused against composed, against a
//! dense layer on the dequantized weight, and under a LoRA adapter.

use accel_bigmodel::quant::{BnbQuantizationConfig, QuantType, QuantizeOnLoad};
use accel_bigmodel::CheckpointSource;
use candle_core::{Device, Var};
use candle_nn::VarBuilder;

use super::*;
use crate::layers::{linear_b_with, LoraSpec, QuantSpec};
use crate::ops::testing::randn;

/// A checkpoint of one linear layer `m` (weight `[out, inp]`, bias) loaded
/// quantized as `config` says.
fn quantized_source(
    dir: &std::path::Path,
    out: usize,
    inp: usize,
    config: BnbQuantizationConfig,
) -> Result<(CheckpointSource, Tensor)> {
    let w = (randn(&[out, inp], 3, 0.2)?).to_dtype(DType::F32)?;
    let b = randn(&[out], 4, 0.1)?;
    let path = dir.join("model.safetensors");
    candle_core::safetensors::save(
        &[
            ("m.weight".to_string(), w.clone()),
            ("m.bias".to_string(), b),
        ]
        .into_iter()
        .collect(),
        &path,
    )?;
    let source = CheckpointSource::open(&path)
        .map_err(candle_core::Error::wrap)?
        .with_quantization(QuantizeOnLoad::new(config).map_err(candle_core::Error::wrap)?)
        .map_err(candle_core::Error::wrap)?;
    Ok((source, w))
}

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()
}

fn configs() -> Vec<BnbQuantizationConfig> {
    let mut nf4 = BnbQuantizationConfig::four_bit(QuantType::Nf4);
    nf4.bnb_4bit_use_double_quant = true;
    vec![
        nf4,
        BnbQuantizationConfig::four_bit(QuantType::Fp4),
        BnbQuantizationConfig::eight_bit(),
    ]
}

/// A layer built on a quantizing source is quantized, and computes what a
/// dense layer on its dequantized weight computes, forward and backward,
/// on the fused path and the composed one.
#[test]
fn a_quantized_layer_is_the_dense_layer_of_its_dequantized_weight() -> Result<()> {
    let dir = tempfile::tempdir()?;
    for config in configs() {
        let (source, _) = quantized_source(dir.path(), 48, 96, config.clone())?;
        let vb = VarBuilder::from_backend(Box::new(source), DType::F32, Device::Cpu);
        let layer = linear_b_with(96, 48, true, vb.pp("m"), None, None)?;
        let q = layer.quantized().expect("the source quantizes m").clone();
        assert_eq!(q.dims(), (48, 96));
        let dense = q.dequantize()?;
        let composed = composed_dequantize(&q.tensors, &Device::Cpu)?;
        assert_eq!(max_diff(&dense, &composed)?, 0.0, "{config:?}");
        for rows in [3, 40] {
            let x = Var::from_tensor(&randn(&[2, rows, 96], 5, 1.0)?)?;
            let y = layer.forward_act(&x, Some(Activation::Silu))?;
            let want = crate::ops::linear(&x, &dense, layer.bias(), Some(Activation::Silu))?;
            assert!(max_diff(&y, &want)? < 1e-4, "{config:?} {rows}: y");
            let g = randn(&[2, rows, 48], 6, 1.0)?;
            let gx = (&y * &g)?.sum_all()?.backward()?;
            let gw = (&want * &g)?.sum_all()?.backward()?;
            let (a, b) = (
                gx.get(x.as_tensor()).unwrap(),
                gw.get(x.as_tensor()).unwrap(),
            );
            assert!(max_diff(a, b)? < 1e-4, "{config:?} {rows}: dx");
            // Frozen: no gradient reaches the codes.
            assert!(gx.get(q.packed()).is_none());
        }
    }
    Ok(())
}

/// bf16 inputs through an f32-computing quantized layer and f32 inputs
/// through a bf16-computing one come back in their own dtype, computed as
/// bitsandbytes computes them (inputs cast to the compute dtype).
#[test]
fn the_compute_dtype_is_taken_and_left() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (source, _) = quantized_source(dir.path(), 32, 64, configs()[0].clone())?;
    let vb = VarBuilder::from_backend(Box::new(source), DType::F32, Device::Cpu);
    let mut config = configs()[0].clone();
    config.bnb_4bit_compute_dtype = DType::BF16;
    let spec = QuantSpec::new(config);
    let layer = linear_b_with(64, 32, false, vb.pp("m"), None, Some(&spec))?;
    let q = layer.quantized().unwrap();
    let x = randn(&[5, 64], 8, 1.0)?;
    let y = layer.forward_act(&x, None)?;
    assert_eq!(y.dtype(), DType::F32);
    let dense = q.dequantize()?.to_dtype(DType::BF16)?;
    let want = x.to_dtype(DType::BF16)?.matmul(&dense.t()?)?;
    // bf16 products: the same bf16 operands, f32 sums in another order.
    assert!(max_diff(&y, &want)? < 2e-2, "{}", max_diff(&y, &want)?);
    assert_eq!(
        layer.forward_act(&x.to_dtype(DType::BF16)?, None)?.dtype(),
        DType::BF16
    );
    Ok(())
}

/// QLoRA: adapters on a quantized layer train (both get gradients that
/// match the dense layer's), the base gets none.
#[test]
fn lora_adapters_on_a_quantized_layer_get_the_dense_layer_s_gradients() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (source, _) = quantized_source(dir.path(), 32, 64, configs()[0].clone())?;
    let mut c = accel_bigmodel::lora::LoraConfig::new(
        4,
        accel_bigmodel::lora::LoraTargets::parse("m").unwrap(),
    );
    c.alpha = 8.0;
    let spec = LoraSpec::new(c);
    let varmap = candle_nn::VarMap::new();
    // Adapters from a VarMap, the base from the quantizing source.
    let base = VarBuilder::from_backend(Box::new(source), DType::F32, Device::Cpu);
    let layer = linear_b_with(64, 32, true, base.pp("m"), None, None)?;
    let adapters = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let layer = layer.with_lora(Some(&spec), &adapters.pp("m"))?;
    let lora = layer.lora().unwrap();
    let b = Var::from_tensor(&randn(&[32, 4], 9, 0.5)?)?;
    varmap.data().lock().unwrap()["m.lora_B.weight"].set(b.as_tensor())?;
    let x = randn(&[6, 64], 10, 1.0)?;
    let y = layer.forward_act(&x, None)?;
    let dense = crate::layers::Linear::new(
        layer.quantized().unwrap().dequantize()?,
        layer.bias().cloned(),
    )
    .with_lora(Some(&spec), &adapters.pp("m"))?;
    let want = dense.forward_act(&x, None)?;
    assert!(max_diff(&y, &want)? < 1e-4);
    let g1 = y.sqr()?.sum_all()?.backward()?;
    let g2 = want.sqr()?.sum_all()?.backward()?;
    for t in [lora.a(), lora.b()] {
        let (a, b) = (g1.get(t).expect("adapter gradient"), g2.get(t).unwrap());
        assert!(max_diff(a, b)? < 1e-3 * b.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0));
    }
    assert!(g1.get(layer.quantized().unwrap().packed()).is_none());
    Ok(())
}

/// `quant.cu`'s products on a GPU against the CPU kernels: 4-bit (NF4 with
/// double quantization, FP4) and 8-bit weights whose rows straddle blocks,
/// f32 and bf16 inputs, 3 rows (the few-row kernel off the codes) and 40
/// (bands and cuBLAS), forward and the input's gradient; and the banded
/// products with bands of a few rows or columns against one band. What
/// must pass before `CUDA_QUANT_CHECKED`.
#[test]
#[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
fn cuda_quantized_linear_matches_the_cpu_kernel() -> Result<()> {
    use candle_core::backend::BackendStorage;
    let gpu = accel_kernels::cuda_device(0)
        .unwrap_or_else(|e| panic!("needs a CUDA device (build with --features cuda): {e}"));
    let cpu = Device::Cpu;
    let dir = tempfile::tempdir()?;
    for config in configs() {
        let (source, _) = quantized_source(dir.path(), 96, 160, config.clone())?;
        let vb = VarBuilder::from_backend(Box::new(source), DType::F32, Device::Cpu);
        let layer = linear_b_with(160, 96, false, vb.pp("m"), None, None)?;
        let q = layer.quantized().expect("the source quantizes m");
        let on_gpu = std::sync::Arc::new(q.tensors.to_device(&gpu)?);
        for dtype in [DType::F32, DType::BF16] {
            for rows in [3, 40] {
                let x = randn(&[rows, 160], 11, 1.0)?.to_dtype(dtype)?;
                let dy = randn(&[rows, 96], 12, 1.0)?.to_dtype(dtype)?;
                let run = |dev: &Device, w| -> Result<(Tensor, Tensor)> {
                    let v = Var::from_tensor(&x.to_device(dev)?)?;
                    let y = kernels::quantized_linear(v.as_tensor(), w)?;
                    let g = (&y * dy.to_device(dev)?)?.sum_all()?.backward()?;
                    let dx = g.get(v.as_tensor()).expect("a gradient").to_device(&cpu)?;
                    Ok((y.to_device(&cpu)?, dx))
                };
                let (want, got) = (run(&cpu, &q.tensors)?, run(&gpu, &on_gpu)?);
                // bf16: both sides round the same weight and inputs, then sum
                // in f32 in different orders and round the result.
                let tol = if dtype == DType::F32 { 1e-4 } else { 3e-2 };
                for (name, (g, w)) in [("y", (&got.0, &want.0)), ("dx", (&got.1, &want.1))] {
                    let scale = w
                        .to_dtype(DType::F32)?
                        .abs()?
                        .max_all()?
                        .to_scalar::<f32>()?;
                    let err = max_diff(g, w)? / scale.max(1e-6);
                    assert!(
                        err < tol,
                        "{config:?} {dtype:?} {rows} rows: {name} off by {err}"
                    );
                }
            }
        }
        // Bands of 500 elements (5 rows forward, 5 columns backward) give the
        // products of one band.
        let x = randn(&[40, 160], 13, 1.0)?.to_device(&gpu)?;
        let dy = randn(&[40, 96], 14, 1.0)?.to_device(&gpu)?;
        let on = |t: &Tensor, tile: usize, grad: bool| -> Result<Vec<f32>> {
            let (s, l) = t.storage_and_layout();
            let candle_core::Storage::Cuda(s) = &*s else {
                unreachable!("on the GPU")
            };
            let out = on_gpu.with_cuda(|w| {
                if grad {
                    accel_kernels::cuda::quantized_matmul_grad((s, l), w, tile)
                } else {
                    accel_kernels::cuda::quantized_matmul((s, l), w, tile)
                }
            })?;
            Ok(out.to_cpu_storage()?.as_slice::<f32>()?.to_vec())
        };
        for (t, grad) in [(&x, false), (&dy, true)] {
            let (one, banded) = (on(t, 1 << 24, grad)?, on(t, 500, grad)?);
            let err = one
                .iter()
                .zip(&banded)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(err < 1e-4, "{config:?} grad {grad}: banded off by {err}");
        }
    }
    Ok(())
}
