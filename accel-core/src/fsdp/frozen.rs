//! A quantized base under FSDP: the packed 4-bit or 8-bit parts of frozen
//! weights (codes, block maxima, code books, JSON states) sharded as bytes.
//!
//! These parts never train and must not pass through the fp32 pieces (a u8
//! code is no float, and an absmax gathered in bf16 would change every value
//! it scales), so each unit keeps them apart: every part is cut into `world`
//! chunks of its raw bytes, each rank keeps its chunk, and a unit's run
//! gathers the bytes back into the dtype and shape the part had. They get no
//! gradient and take no part in the reductions; a rank's share of a 4-bit
//! base is `1 / world` of its packed bytes, as FSDP-QLoRA shards it.

use candle_core::{DType, Device, Shape, Tensor};

use accel_dist::fsdp::ShardLayout;
use accel_dist::Communicator;

use crate::Result;

/// A quantized part drawn for a sharded model: name, full shape, dtype and
/// this rank's chunk of its bytes (a 1-D u8 tensor on the CPU).
pub(crate) type FrozenPiece = (String, Shape, DType, Tensor);

/// The frozen quantized parts of one unit, sharded by bytes.
#[derive(Debug)]
pub(crate) struct FrozenParts {
    /// The parts as byte vectors, split as any parameter is.
    layout: ShardLayout,
    /// Each part's dtype and shape, in layout order.
    kinds: Vec<(DType, Shape)>,
    /// This rank's chunks, in layout order.
    local: Vec<Tensor>,
}

impl FrozenParts {
    /// The unit holding `parts` (in an order every rank agrees on), for rank
    /// `rank` of `world`.
    pub fn new(parts: Vec<FrozenPiece>, world: usize, rank: usize) -> Result<Self> {
        let slots: Vec<(String, Shape)> = parts
            .iter()
            .map(|(n, s, dt, _)| (n.clone(), Shape::from(s.elem_count() * dt.size_in_bytes())))
            .collect();
        let layout = ShardLayout::new(&slots, world, rank)?;
        let (kinds, local) = parts
            .into_iter()
            .map(|(_, s, dt, piece)| ((dt, s), piece))
            .unzip();
        Ok(Self {
            layout,
            kinds,
            local,
        })
    }

    /// True when the unit holds no quantized part.
    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    /// The parts' names.
    pub fn names(&self) -> impl Iterator<Item = String> + '_ {
        self.layout.slots().iter().map(|s| s.name.clone())
    }

    /// Bytes of the chunks this rank keeps.
    pub fn local_bytes(&self) -> usize {
        self.local.iter().map(Tensor::elem_count).sum()
    }

    /// Every part whole, by name, on `device`: one all-gather of the unit's
    /// bytes, which every rank of the group must call at the same point.
    pub fn gather(
        &self,
        comm: &dyn Communicator,
        device: &Device,
    ) -> Result<Vec<(String, Tensor)>> {
        if self.is_empty() {
            return Ok(vec![]);
        }
        let full = self
            .layout
            .all_gather(comm, &self.local, DType::U8, &Device::Cpu)?;
        self.layout
            .slots()
            .iter()
            .zip(&self.kinds)
            .zip(full)
            .map(|((slot, (dtype, shape)), bytes)| {
                let bytes = bytes.to_vec1::<u8>()?;
                let t = Tensor::from_raw_buffer(&bytes, *dtype, shape.dims(), &Device::Cpu)?;
                Ok((slot.name.clone(), t.to_device(device)?))
            })
            .collect()
    }
}

/// The raw little-endian bytes of `t` (any dtype), row-major.
pub(crate) fn tensor_bytes(t: &Tensor) -> candle_core::Result<Vec<u8>> {
    let flat = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::U8 => flat.to_vec1::<u8>()?,
        DType::U32 => le_bytes(flat.to_vec1::<u32>()?, u32::to_le_bytes),
        DType::I64 => le_bytes(flat.to_vec1::<i64>()?, i64::to_le_bytes),
        DType::F32 => le_bytes(flat.to_vec1::<f32>()?, f32::to_le_bytes),
        DType::F64 => le_bytes(flat.to_vec1::<f64>()?, f64::to_le_bytes),
        DType::BF16 => le_bytes(flat.to_vec1::<half::bf16>()?, half::bf16::to_le_bytes),
        DType::F16 => le_bytes(flat.to_vec1::<half::f16>()?, half::f16::to_le_bytes),
        other => candle_core::bail!("a quantized part of dtype {other:?} cannot be sharded"),
    })
}

fn le_bytes<T, const N: usize>(v: Vec<T>, f: fn(T) -> [u8; N]) -> Vec<u8> {
    v.into_iter().flat_map(f).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel_dist::fsdp::piece_range;
    use accel_dist::LocalCommunicator;

    /// Two ranks' chunks of an f32 absmax and odd-length u8 codes gather back
    /// into the very values, dtypes and shapes (one process: the second
    /// rank's chunks are what its layout says it holds).
    #[test]
    fn parts_cut_into_byte_chunks_reassemble_exactly() {
        let absmax = Tensor::new(&[0.5f32, -1.25, 3.0e-8], &Device::Cpu).unwrap();
        let codes = Tensor::new(&[1u8, 2, 3, 4, 5], &Device::Cpu)
            .unwrap()
            .reshape((5, 1))
            .unwrap();
        let parts = |rank: usize| -> Vec<FrozenPiece> {
            [("a.weight.absmax", &absmax), ("a.weight", &codes)]
                .into_iter()
                .map(|(n, t)| {
                    let b = tensor_bytes(t).unwrap();
                    let r = piece_range(b.len(), 2, rank);
                    let piece = Tensor::from_vec(b[r.clone()].to_vec(), r.len(), &Device::Cpu);
                    (n.to_string(), t.shape().clone(), t.dtype(), piece.unwrap())
                })
                .collect()
        };
        let (r0, r1) = (
            FrozenParts::new(parts(0), 2, 0).unwrap(),
            FrozenParts::new(parts(1), 2, 1).unwrap(),
        );
        assert_eq!(r0.local_bytes() + r1.local_bytes(), 12 + 5);
        // The single-process communicator gathers one rank; stitch by hand.
        let one = FrozenParts::new(
            parts(0)
                .into_iter()
                .zip(parts(1))
                .map(|((n, s, d, a), (_, _, _, b))| (n, s, d, Tensor::cat(&[a, b], 0).unwrap()))
                .collect(),
            1,
            0,
        )
        .unwrap();
        let got = one.gather(&LocalCommunicator, &Device::Cpu).unwrap();
        assert_eq!(got[0].0, "a.weight.absmax");
        assert_eq!(
            got[0].1.to_vec1::<f32>().unwrap(),
            absmax.to_vec1::<f32>().unwrap()
        );
        assert_eq!(got[1].1.dims(), &[5, 1]);
        assert_eq!(
            got[1].1.flatten_all().unwrap().to_vec1::<u8>().unwrap(),
            [1, 2, 3, 4, 5]
        );
    }
}
