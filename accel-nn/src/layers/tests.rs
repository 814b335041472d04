//! Layers end to end: a small model built only from these layers trains
//! every parameter in every dtype, matches the same model composed from
//! candle ops, and decodes with a KV cache like a full forward.

use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};

use super::*;
use crate::ops::{self, composed, AttentionMask};

const VOCAB: usize = 11;
const D: usize = 16;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HD: usize = D / HEADS;

/// Embedding -> LayerNorm -> GQA attention with rope -> RmsNorm -> SwiGLU
/// MLP -> Linear head, with residuals.
struct Tiny {
    emb: Embedding,
    ln: LayerNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    rms: RmsNorm,
    mlp: SwiGluMlp,
    head: Linear,
    rope: RotaryEmbedding,
}

impl Tiny {
    fn new(vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            emb: embedding(VOCAB, D, vb.pp("emb"))?,
            ln: layer_norm(D, 1e-5, vb.pp("ln"))?,
            q: linear(D, D, vb.pp("q"))?,
            k: linear_no_bias(D, KV_HEADS * HD, vb.pp("k"))?,
            v: linear_b(D, KV_HEADS * HD, true, vb.pp("v"))?,
            o: linear_no_bias(D, D, vb.pp("o"))?,
            rms: rms_norm(D, 1e-6, vb.pp("rms"))?,
            mlp: swiglu_mlp(D, 24, false, vb.pp("mlp"))?,
            head: linear(D, VOCAB, vb.pp("head"))?,
            rope: RotaryEmbedding::new(HD, 32, 10_000.0, None, vb.device())?,
        })
    }

    /// Splits `[b, t, n * HD]` into heads `[b, n, t, HD]`.
    fn heads(x: &Tensor, n: usize) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        x.reshape((b, t, n, HD))?.transpose(1, 2)
    }

    /// Logits for `ids [b, t]`; `offset` and `cache` for incremental decoding.
    fn forward(&self, ids: &Tensor, cache: Option<&mut KvCache>) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let x = self.emb.forward(ids)?;
        let h = self.ln.forward(&x)?;
        let q = Self::heads(&self.q.forward(&h)?, HEADS)?;
        let k = Self::heads(&self.k.forward(&h)?, KV_HEADS)?;
        let v = Self::heads(&self.v.forward(&h)?, KV_HEADS)?;
        let offset = cache.as_ref().map_or(0, |c| c.len());
        let (q, k) = self.rope.apply(&q, &k, offset)?;
        let (k, v) = match cache {
            Some(c) => c.append(&k, &v)?,
            None => (k, v),
        };
        let mask = AttentionMask::Causal { offset };
        let a = ops::scaled_dot_product_attention(&q, &k, &v, &mask, 1.0 / (HD as f64).sqrt())?;
        let a = a.transpose(1, 2)?.reshape((b, t, D))?;
        let x = (x + self.o.forward(&a)?)?;
        let x = (&x + self.mlp.forward(&self.rms.forward(&x)?)?)?;
        self.head.forward(&x)
    }

    /// The same model from `ops::composed` and plain candle ops only.
    fn forward_composed(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let lin = |l: &Linear, x: &Tensor| composed::linear(x, l.weight(), l.bias(), None);
        let x = self.emb.forward(ids)?;
        let h = composed::layer_norm(&x, self.ln.weight(), self.ln.bias(), 1e-5)?;
        let q = Self::heads(&lin(&self.q, &h)?, HEADS)?;
        let k = Self::heads(&lin(&self.k, &h)?, KV_HEADS)?;
        let v = Self::heads(&lin(&self.v, &h)?, KV_HEADS)?;
        let cos = self.rope.cos().narrow(0, 0, t)?;
        let sin = self.rope.sin().narrow(0, 0, t)?;
        let (q, k) = (
            composed::rope(&q, &cos, &sin, false)?,
            composed::rope(&k, &cos, &sin, false)?,
        );
        let mask = AttentionMask::Causal { offset: 0 };
        let a =
            composed::scaled_dot_product_attention(&q, &k, &v, &mask, 1.0 / (HD as f64).sqrt())?;
        let a = a.transpose(1, 2)?.reshape((b, t, D))?;
        let x = (x + lin(&self.o, &a)?)?;
        let r = composed::rms_norm(&x, self.rms.weight(), 1e-6)?;
        let m = self.mlp.forward_composed(&r)?;
        let x = (&x + m)?;
        lin(&self.head, &x)
    }
}

impl SwiGluMlp {
    /// The composed form, for the test above.
    fn forward_composed(&self, x: &Tensor) -> Result<Tensor> {
        let lin = |l: &Linear, x: &Tensor| composed::linear(x, l.weight(), l.bias(), None);
        let h = composed::swiglu(&lin(self.gate_proj(), x)?, &lin(self.up_proj(), x)?)?;
        lin(self.down_proj(), &h)
    }
}

fn ids() -> Result<Tensor> {
    Tensor::new(&[[1u32, 4, 2, 9, 0, 3], [7, 7, 1, 10, 5, 2]], &Device::Cpu)
}

fn targets() -> Result<Tensor> {
    Tensor::new(
        &[[4i64, 2, 9, 0, 3, -100], [7, 1, 10, 5, 2, -100]],
        &Device::Cpu,
    )
}

#[test]
fn every_parameter_of_a_model_built_from_these_layers_gets_a_gradient() -> Result<()> {
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let map = VarMap::new();
        let model = Tiny::new(VarBuilder::from_varmap(&map, dtype, &Device::Cpu))?;
        let logits = model.forward(&ids()?, None)?;
        assert_eq!(logits.dtype(), dtype);
        let loss = ops::cross_entropy(&logits, &targets()?)?;
        assert_eq!(loss.dtype(), DType::F32);
        let grads = loss.backward()?;
        let vars = map.all_vars();
        // emb 1, ln 2, q 2, k 1, v 2, o 1, rms 1, mlp 3, head 2.
        assert_eq!(vars.len(), 15, "{dtype:?}");
        let with_grad = vars
            .iter()
            .filter(|v| {
                grads.get(v.as_tensor()).is_some_and(|g| {
                    let s = g
                        .to_dtype(DType::F32)
                        .and_then(|g| g.abs()?.sum_all()?.to_scalar::<f32>());
                    s.is_ok_and(|s| s > 0.0 && s.is_finite())
                })
            })
            .count();
        assert_eq!(
            with_grad,
            vars.len(),
            "{dtype:?}: parameters with a nonzero gradient"
        );
    }
    Ok(())
}

#[test]
fn fused_and_composed_models_agree_in_loss_and_every_gradient() -> Result<()> {
    let map = VarMap::new();
    let model = Tiny::new(VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu))?;
    let fused = ops::cross_entropy(&model.forward(&ids()?, None)?, &targets()?)?;
    let comp = composed::cross_entropy(&model.forward_composed(&ids()?)?, &targets()?)?;
    let (a, b) = (fused.to_scalar::<f32>()?, comp.to_scalar::<f32>()?);
    assert!((a - b).abs() < 1e-5 * b.abs(), "{a} vs {b}");
    let (ga, gb) = (fused.backward()?, comp.backward()?);
    for v in map.all_vars() {
        let (x, y) = (
            ga.get(v.as_tensor()).unwrap(),
            gb.get(v.as_tensor()).unwrap(),
        );
        ops::testing::assert_close(x, y, 1e-4, "gradient")?;
    }
    Ok(())
}

#[test]
fn decoding_with_a_kv_cache_matches_the_full_forward() -> Result<()> {
    let map = VarMap::new();
    let model = Tiny::new(VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu))?;
    let ids = ids()?;
    let full = model.forward(&ids, None)?;
    let mut cache = KvCache::new();
    let first = model.forward(&ids.narrow(1, 0, 4)?, Some(&mut cache))?;
    assert_eq!(cache.len(), 4);
    let mut steps = vec![first];
    for i in 4..6 {
        steps.push(model.forward(&ids.narrow(1, i, 1)?, Some(&mut cache))?);
    }
    assert_eq!(cache.len(), 6);
    ops::testing::assert_close(&Tensor::cat(&steps, 1)?, &full, 1e-5, "cached")?;
    cache.reset();
    assert!(cache.is_empty());
    Ok(())
}

#[test]
fn llama3_rope_scaling_matches_transformers() {
    // transformers' _compute_llama3_parameters for head_dim 128, theta
    // 500000, factor 8, low 1, high 4, original 8192, restated per band:
    let s = Llama3RopeScaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let f = RotaryEmbedding::inv_freq(128, 500_000.0, Some(&s));
    let plain = RotaryEmbedding::inv_freq(128, 500_000.0, None);
    assert_eq!(f.len(), 64);
    let wavelen = |x: f32| 2.0 * std::f64::consts::PI / x as f64;
    for (i, (&g, &p)) in f.iter().zip(&plain).enumerate() {
        let w = wavelen(p);
        if w < 8192.0 / 4.0 {
            assert_eq!(g, p, "high frequency {i} kept");
        } else if w > 8192.0 {
            assert!(
                (g - p / 8.0).abs() <= 1e-6 * p,
                "low frequency {i} divided by factor"
            );
        } else {
            let smooth = (8192.0 / w - 1.0) / 3.0;
            let want = ((1.0 - smooth) * p as f64 / 8.0 + smooth * p as f64) as f32;
            assert!((g - want).abs() <= 1e-6 * want, "medium frequency {i}");
            assert!(g < p && g > p / 8.0);
        }
    }
    assert!((plain[1] as f64 - 500_000f64.powf(-2.0 / 128.0)).abs() < 1e-7);
}

#[test]
fn layer_norm_reads_old_gamma_beta_names_and_candle_configs() -> Result<()> {
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let ln = layer_norm(
        8,
        candle_nn::LayerNormConfig {
            eps: 1e-5,
            remove_mean: false,
            affine: false,
        },
        vb.pp("a"),
    )?;
    assert!(ln.bias().is_none());
    let x = ops::testing::randn(&[3, 8], 1, 1.0)?;
    let want = ops::rms_norm(&x, ln.weight(), 1e-5)?;
    ops::testing::assert_close(&ln.forward(&x)?, &want, 0.0, "remove_mean: false is rms")?;
    let names: Vec<String> = map.data().lock().unwrap().keys().cloned().collect();
    assert_eq!(names, vec!["a.weight".to_string()]);
    Ok(())
}

#[test]
fn seeded_dropout_repeats_and_eval_is_identity() -> Result<()> {
    let x = Var::from_tensor(&Tensor::ones((8, 8), DType::F32, &Device::Cpu)?)?;
    let (a, b) = (Dropout::with_seed(0.5, 7), Dropout::with_seed(0.5, 7));
    let (ya, yb) = (a.forward(&x, true)?, b.forward(&x, true)?);
    assert_eq!(ya.to_vec2::<f32>()?, yb.to_vec2::<f32>()?);
    assert_ne!(ya.to_vec2::<f32>()?, a.forward(&x, true)?.to_vec2::<f32>()?);
    assert_eq!(
        a.forward(&x, false)?.to_vec2::<f32>()?,
        vec![vec![1f32; 8]; 8]
    );
    Ok(())
}
