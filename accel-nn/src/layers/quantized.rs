//! [`QuantizedWeight`]: the frozen 4-bit or 8-bit weight a [`super::Linear`]
//! holds when its module was quantized, read from a weight source that holds
//! bitsandbytes' parts (a pre-quantized checkpoint, or one quantized on load).

use std::sync::Arc;

use accel_bigmodel::quant::{names, quant_state_name, QuantType, State4bit, NESTED_BLOCKSIZE};
use candle_core::{bail, DType, Result, Tensor};
use candle_nn::{Init, VarBuilder};

use crate::kernels::{QuantTensors, Store};

/// How a model's quantized linear layers compute (bitsandbytes'
/// `bnb_4bit_compute_dtype`): inputs are cast to it and outputs back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantSpec {
    /// The dtype of the products; `None` multiplies in the input's dtype.
    pub compute_dtype: Option<DType>,
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
        let compute_dtype = spec.and_then(|s| s.compute_dtype);
        let name = |s: &str| format!("{}.{s}", vb.prefix());
        for qt in [QuantType::Nf4, QuantType::Fp4] {
            let state_name = format!("weight.{}", quant_state_name(qt));
            if !vb.contains_tensor(&state_name) {
                continue;
            }
            let json = vb.get_unchecked_dtype(&state_name, DType::U8)?;
            let state = State4bit::from_json(&json.to_vec1::<u8>()?, &name(&state_name))
                .map_err(candle_core::Error::wrap)?;
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

/// Checks a stored code book against the one its type implies.
fn check_codes(t: &Tensor, want: &[f32], prefix: &str, what: &str) -> Result<()> {
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
