//! [`QuantizedWeight`]: the frozen 4-bit or 8-bit weight a [`super::Linear`]
//! holds when its module was quantized, read from a weight source that holds
//! bitsandbytes' parts (a pre-quantized checkpoint, or one quantized on load).

use std::sync::Arc;

use accel_bigmodel::quant::{
    names, quant_state_name, BnbQuantizationConfig, QuantMethod, QuantType, State4bit,
    NESTED_BLOCKSIZE,
};
use candle_core::{bail, DType, Result, Tensor};
use candle_nn::{Init, VarBuilder};

use crate::kernels::{QuantTensors, Store};

/// A model's quantization as its layers see it: the bitsandbytes settings
/// it was loaded with (from `config.json`'s `quantization_config`, or asked
/// for on load). A 4-bit layer computes in `bnb_4bit_compute_dtype` (inputs
/// cast to it, outputs back); an 8-bit layer in its input's dtype.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantSpec {
    config: Arc<BnbQuantizationConfig>,
}

impl QuantSpec {
    /// The spec of a model loaded as `config` says.
    pub fn new(config: BnbQuantizationConfig) -> Self {
        Self {
            config: Arc::new(config),
        }
    }

    /// The settings.
    pub fn config(&self) -> &BnbQuantizationConfig {
        &self.config
    }

    /// The dtype quantized layers multiply in (`None`: the input's).
    pub fn compute_dtype(&self) -> Option<DType> {
        match self.config.method() {
            Ok(QuantMethod::FourBit) => Some(self.config.bnb_4bit_compute_dtype),
            _ => None,
        }
    }
}

/// A quantized, frozen linear weight `[out, in]`: bitsandbytes' 4-bit blocks
/// (NF4/FP4, with or without double quantization) or LLM.int8 rows.
///
/// Its tensors are the model's parameters as transformers names them
/// (`weight` holds the packed codes; `weight.absmax`, ... or `SCB` beside
/// it), so checkpoints, offload and saving treat them as any other; the
/// products dequantize tiles of it as they go (see `ops::quantized_linear`).
#[derive(Debug, Clone)]
pub struct QuantizedWeight {
    pub(crate) tensors: Arc<QuantTensors>,
    pub(crate) state: Option<State4bit>,
    pub(crate) compute_dtype: Option<DType>,
}

impl QuantizedWeight {
    /// The quantized weight of the linear layer at `vb` (`[out, inp]`), when
    /// the source holds one: a `weight.quant_state.bitsandbytes__*` tensor
    /// (4 bits) or an `SCB` (8 bits) beside the weight.
    ///
    /// # Errors
    /// A state that does not parse, or parts whose shapes or dtypes do not
    /// fit the layer, each naming the tensor.
    pub fn from_var_builder(
        vb: &VarBuilder,
        out: usize,
        inp: usize,
        spec: Option<&QuantSpec>,
    ) -> Result<Option<Self>> {
        let compute_dtype = spec.and_then(QuantSpec::compute_dtype);
        let name = |s: &str| format!("{}.{s}", vb.prefix());
        for qt in [QuantType::Nf4, QuantType::Fp4] {
            let state_name = format!("weight.{}", quant_state_name(qt));
            if !vb.contains_tensor(&state_name) {
                continue;
            }
            let json = vb.get_unchecked_dtype(&state_name, DType::U8)?;
            let state = if accel_bigmodel::is_placeholder(&json) {
                // A layer built on placeholders (before its weights are
                // placed, or an FSDP unit's before gathering) only needs
                // the parts' shapes; it is rebuilt on the real tensors.
                placeholder_state(qt, out, inp, vb.contains_tensor("weight.nested_absmax"))
            } else {
                State4bit::from_json(&json.to_vec1::<u8>()?, &name(&state_name))
                    .map_err(candle_core::Error::wrap)?
            };
            if state.shape != [out, inp] || state.quant_type != qt {
                bail!(
                    "{}: the quantized weight is {:?} {}, the layer [{out}, {inp}]",
                    name(&state_name),
                    state.shape,
                    state.quant_type.name()
                )
            }
            return Ok(Some(Self::four_bit(vb, state, compute_dtype)?));
        }
        if vb.contains_tensor(names::SCB) {
            if vb.contains_tensor(names::WEIGHT_FORMAT) {
                let f = vb.get_unchecked_dtype(names::WEIGHT_FORMAT, DType::U8)?;
                let f = f.flatten_all()?.to_vec1::<u8>()?;
                if f != [0] {
                    bail!(
                        "{}: weight format {f:?}; only 0 (row-major) is supported",
                        name(names::WEIGHT_FORMAT)
                    )
                }
            }
            let get = |n: &str, shape: &[usize], dtype| {
                vb.get_with_hints_dtype(shape, n, Init::Const(0.0), dtype)
            };
            let tensors = QuantTensors::EightBit {
                codes: get("weight", &[out, inp], DType::U8)?,
                row_max: get(names::SCB, &[out], DType::F32)?,
                out,
                inp,
            };
            return Ok(Some(Self {
                tensors: Arc::new(tensors),
                state: None,
                compute_dtype,
            }));
        }
        Ok(None)
    }

    /// The 4-bit parts of `state` from `vb`.
    fn four_bit(vb: &VarBuilder, state: State4bit, compute_dtype: Option<DType>) -> Result<Self> {
        let (out, inp) = (state.shape[0], state.shape[1]);
        let n = out * inp;
        let blocks = state.blocks();
        let get = |n: &str, shape: &[usize], dtype| {
            vb.get_with_hints_dtype(shape, n, Init::Const(0.0), dtype)
        };
        let quant_map =
            vb.get_unchecked_dtype(&format!("weight.{}", names::QUANT_MAP), DType::F32)?;
        check_codes(
            &quant_map,
            state.quant_type.codes(),
            &vb.prefix(),
            names::QUANT_MAP,
        )?;
        let packed = get("weight", &[n.div_ceil(2), 1], DType::U8)?;
        let (absmax, nested) = match state.nested {
            None => (
                get(&format!("weight.{}", names::ABSMAX), &[blocks], DType::F32)?,
                None,
            ),
            Some((_, offset)) => {
                let map = vb.get_unchecked_dtype(
                    &format!("weight.{}", names::NESTED_QUANT_MAP),
                    DType::F32,
                )?;
                let dynamic = accel_bigmodel::quant::dynamic_map();
                check_codes(&map, &dynamic, &vb.prefix(), names::NESTED_QUANT_MAP)?;
                let nested = get(
                    &format!("weight.{}", names::NESTED_ABSMAX),
                    &[blocks.div_ceil(NESTED_BLOCKSIZE)],
                    DType::F32,
                )?;
                let codes = get(&format!("weight.{}", names::ABSMAX), &[blocks], DType::U8)?;
                (codes, Some((nested, offset)))
            }
        };
        let tensors = QuantTensors::FourBit {
            packed,
            absmax,
            nested,
            codes: state.quant_type.codes(),
            blocksize: state.blocksize,
            store: Store::of(state.dtype),
            out,
            inp,
        };
        Ok(Self {
            tensors: Arc::new(tensors),
            state: Some(state),
            compute_dtype,
        })
    }

    /// `(out, in)`.
    pub fn dims(&self) -> (usize, usize) {
        self.tensors.dims()
    }

    /// The 4-bit state (type, block size, dtype quantized from), or `None`
    /// for an 8-bit weight.
    pub fn state(&self) -> Option<&State4bit> {
        self.state.as_ref()
    }

    /// The dtype its products run in, when set.
    pub fn compute_dtype(&self) -> Option<DType> {
        self.compute_dtype
    }

    /// The tensor of the packed codes (u8): what the layer's `weight` names.
    pub fn packed(&self) -> &Tensor {
        match &*self.tensors {
            QuantTensors::FourBit { packed, .. } => packed,
            QuantTensors::EightBit { codes, .. } => codes,
        }
    }

    /// The weight dequantized to f32 on the CPU (bitsandbytes'
    /// `dequantize_4bit` / `int8_vectorwise_dequant`): for merging an
    /// adapter into it or writing it out in full precision.
    ///
    /// # Errors
    /// Parts that are not on the CPU.
    pub fn dequantize(&self) -> Result<Tensor> {
        self.tensors.dequantize()
    }
}

/// The state a layer on placeholders assumes: transformers' block size (the
/// parts' shapes follow from it), no values.
fn placeholder_state(quant_type: QuantType, out: usize, inp: usize, nested: bool) -> State4bit {
    State4bit {
        quant_type,
        blocksize: accel_bigmodel::quant::BLOCKSIZE,
        dtype: DType::F32,
        shape: vec![out, inp],
        nested: nested.then_some((NESTED_BLOCKSIZE, 0.0)),
    }
}

/// Checks a stored code book against the one its type implies (nothing to
/// check on a placeholder).
fn check_codes(t: &Tensor, want: &[f32], prefix: &str, what: &str) -> Result<()> {
    if accel_bigmodel::is_placeholder(t) {
        return Ok(());
    }
    let got = t.flatten_all()?.to_vec1::<f32>()?;
    let same = got.len() == want.len() && got.iter().zip(want).all(|(a, b)| a == b);
    if !same {
        bail!(
            "{prefix}.weight.{what}: the stored code book ({} values) is not bitsandbytes' for \
             this type",
            got.len()
        )
    }
    Ok(())
}
