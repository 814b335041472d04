//! A pre-quantized checkpoint's weights read back whole: the parts of each
//! quantized module, checked against each other, and the weight they
//! dequantize to (for merging an adapter or writing the model out in full
//! precision).

use candle_core::{DType, Device, Tensor};

use super::blockwise::{NestedAbsmax, NESTED_BLOCKSIZE};
use super::int8::int8_dequant;
use super::state::{names, quant_state_name, Packed4bit, State4bit};
use super::QuantType;
use crate::error::{Error, Result};
use crate::CheckpointSource;

/// The weight `{module}.weight` of a pre-quantized checkpoint, dequantized
/// to f32 (bitsandbytes' `dequantize_4bit` / `int8_vectorwise_dequant`),
/// with the dtype it was quantized from (f32 for 8 bits, which keeps none);
/// `None` when the module is not quantized there.
///
/// # Errors
/// A part missing, of the wrong dtype or size, or a state that does not
/// parse, naming the tensor.
pub fn dequantize_stored(
    source: &CheckpointSource,
    module: &str,
) -> Result<Option<(Tensor, DType)>> {
    let weight = format!("{module}.weight");
    for qt in [QuantType::Nf4, QuantType::Fp4] {
        let state_name = format!("{weight}.{}", quant_state_name(qt));
        if source.contains(&state_name) {
            let p = read_4bit(source, &weight, &state_name)?;
            let v = p.dequantize();
            let t = Tensor::from_vec(v, p.state.shape.as_slice(), &Device::Cpu)?;
            return Ok(Some((t, p.state.dtype)));
        }
    }
    let scb = format!("{module}.{}", names::SCB);
    if source.contains(&scb) {
        let bytes = bytes_of(source, &weight, DType::U8)?;
        let row_max = f32s(source, &scb)?;
        let cols = if row_max.is_empty() {
            0
        } else {
            bytes.len() / row_max.len()
        };
        if cols * row_max.len() != bytes.len() {
            return Err(bad(
                &weight,
                format!("{} int8 codes for {} rows", bytes.len(), row_max.len()),
            ));
        }
        let codes: Vec<i8> = bytes.iter().map(|&b| b as i8).collect();
        let t = Tensor::from_vec(
            int8_dequant(&codes, &row_max, cols),
            (row_max.len(), cols),
            &Device::Cpu,
        )?;
        return Ok(Some((t, DType::F32)));
    }
    Ok(None)
}

/// The 4-bit parts of `weight`, checked against its state.
fn read_4bit(source: &CheckpointSource, weight: &str, state_name: &str) -> Result<Packed4bit> {
    let json = bytes_of(source, state_name, DType::U8)?;
    let state = State4bit::from_json(&json, state_name)?;
    let (n, blocks) = (state.numel(), state.blocks());
    let packed = bytes_of(source, weight, DType::U8)?;
    if packed.len() != n.div_ceil(2) {
        return Err(bad(
            weight,
            format!(
                "{} packed bytes for a {:?} weight (want {})",
                packed.len(),
                state.shape,
                n.div_ceil(2)
            ),
        ));
    }
    let absmax_name = format!("{weight}.{}", names::ABSMAX);
    let (absmax, nested) = match state.nested {
        None => (f32s(source, &absmax_name)?, None),
        Some((_, offset)) => {
            let codes = bytes_of(source, &absmax_name, DType::U8)?;
            let nested = f32s(source, &format!("{weight}.{}", names::NESTED_ABSMAX))?;
            if nested.len() != blocks.div_ceil(NESTED_BLOCKSIZE) {
                return Err(bad(
                    weight,
                    format!("{} nested maxima for {blocks} blocks", nested.len()),
                ));
            }
            (
                vec![],
                Some(NestedAbsmax {
                    codes,
                    absmax: nested,
                    offset,
                }),
            )
        }
    };
    let have = nested.as_ref().map_or(absmax.len(), |n| n.codes.len());
    if have != blocks {
        return Err(bad(
            &absmax_name,
            format!(
                "{have} block maxima for {blocks} blocks of {}",
                state.blocksize
            ),
        ));
    }
    Ok(Packed4bit {
        state,
        packed,
        absmax,
        nested,
    })
}

fn bad(tensor: &str, reason: String) -> Error {
    Error::BadQuantState {
        tensor: tensor.to_string(),
        reason,
    }
}

fn bytes_of(source: &CheckpointSource, name: &str, dtype: DType) -> Result<Vec<u8>> {
    let t = source.tensor(name, &Device::Cpu, Some(dtype))?;
    Ok(t.flatten_all()?.to_vec1::<u8>()?)
}

fn f32s(source: &CheckpointSource, name: &str) -> Result<Vec<f32>> {
    let t = source.tensor(name, &Device::Cpu, Some(DType::F32))?;
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}
