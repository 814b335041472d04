//! How the parameters of one sharded unit are split between ranks and laid
//! out in the buffers the collectives move.
//!
//! Each parameter is sharded on its own (PyTorch FSDP2's per-parameter
//! sharding, not FSDP1's one flat parameter per unit): flattened, it is cut
//! into `world` chunks of `ceil(numel / world)` elements and rank `r` keeps
//! chunk `r` (the last chunks may be short or empty). Keeping parameters
//! apart keeps their names, so per-name optimizer settings (no weight decay
//! on biases) and state dicts work on shards exactly as on full tensors, and
//! a shard's optimizer maths is element for element the unsharded one.
//!
//! For the wire, a rank packs its pieces, each padded to its chunk size,
//! into one buffer of [`ShardLayout::per_rank`] elements; an all-gather of
//! those buffers gives `[world][per_rank]`, from which each full parameter is
//! cut out (`unpack_gathered`). Gradients travel the other way: the full
//! gradients are packed as `[world][per_rank]` and reduce-scattered, leaving
//! each rank the packed sum of its own pieces.

use std::ops::Range;

use candle_core::{DType, Device, Shape, Tensor};

use crate::{Communicator, Error, ReduceOp, Result};

/// The elements `rank` holds of a flattened parameter of `numel` elements
/// split between `world` ranks: chunk `rank` of `ceil(numel / world)`.
pub fn piece_range(numel: usize, world: usize, rank: usize) -> Range<usize> {
    let chunk = numel.div_ceil(world.max(1));
    (rank * chunk).min(numel)..((rank + 1) * chunk).min(numel)
}

/// One parameter of a unit: its name, shape and place in the packed buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardSlot {
    /// Full parameter name (`h.0.attn.c_attn.weight`).
    pub name: String,
    /// Shape of the full parameter.
    pub shape: Shape,
    /// Elements of the full parameter.
    pub numel: usize,
    /// Elements of one rank's chunk, `ceil(numel / world)`.
    pub chunk: usize,
    /// Where this parameter's chunk starts in a rank's packed buffer.
    pub offset: usize,
}

/// The split of a unit's parameters between the ranks of a group.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardLayout {
    world: usize,
    rank: usize,
    slots: Vec<ShardSlot>,
    per_rank: usize,
}

impl ShardLayout {
    /// Lays out `params` (name and full shape, in a fixed order every rank
    /// agrees on) for rank `rank` of `world`.
    pub fn new(params: &[(String, Shape)], world: usize, rank: usize) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(Error::InvalidRank {
                op: "shard_layout",
                rank,
                world,
            });
        }
        let mut offset = 0;
        let slots = params
            .iter()
            .map(|(name, shape)| {
                let numel = shape.elem_count();
                let chunk = numel.div_ceil(world);
                let slot = ShardSlot {
                    name: name.clone(),
                    shape: shape.clone(),
                    numel,
                    chunk,
                    offset,
                };
                offset += chunk;
                slot
            })
            .collect();
        Ok(Self {
            world,
            rank,
            slots,
            per_rank: offset,
        })
    }

    /// The parameters, in layout order.
    pub fn slots(&self) -> &[ShardSlot] {
        &self.slots
    }

    /// The number of ranks sharing the unit.
    pub fn world(&self) -> usize {
        self.world
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Elements of one rank's packed buffer (pieces padded to their chunks).
    pub fn per_rank(&self) -> usize {
        self.per_rank
    }

    /// The elements of parameter `i` (flattened) that `rank` holds.
    pub fn range_of(&self, i: usize, rank: usize) -> Range<usize> {
        piece_range(self.slots[i].numel, self.world, rank)
    }

    /// The elements of parameter `i` this rank holds.
    pub fn piece_range(&self, i: usize) -> Range<usize> {
        self.range_of(i, self.rank)
    }

    /// This rank's piece of each full parameter in `full` (1-D, contiguous,
    /// not sharing storage with `full`).
    pub fn pieces_of(&self, full: &[Tensor]) -> Result<Vec<Tensor>> {
        self.check_len("pieces_of", full.len())?;
        full.iter()
            .enumerate()
            .map(|(i, t)| {
                self.check_shape("pieces_of", i, t.shape())?;
                let r = self.piece_range(i);
                Ok(t.flatten_all()?.narrow(0, r.start, r.len())?.copy()?)
            })
            .collect()
    }

    /// Packs this rank's `pieces` into one `[per_rank]` buffer of `dtype`,
    /// each padded with zeros to its chunk.
    pub fn pack_local(&self, pieces: &[Tensor], dtype: DType, device: &Device) -> Result<Tensor> {
        self.check_len("pack_local", pieces.len())?;
        let mut parts = Vec::with_capacity(pieces.len());
        for (i, p) in pieces.iter().enumerate() {
            let want = self.piece_range(i).len();
            if p.elem_count() != want {
                return Err(self.bad_piece("pack_local", i, p.elem_count(), want));
            }
            let p = p.flatten_all()?.to_dtype(dtype)?.to_device(device)?;
            let pad = self.slots[i].chunk - want;
            parts.push(if pad > 0 {
                p.pad_with_zeros(0, 0, pad)?
            } else {
                p
            });
        }
        if parts.is_empty() {
            return Ok(Tensor::zeros(0, dtype, device)?);
        }
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// Cuts the full parameters out of an all-gathered `[world * per_rank]` buffer.
    pub fn unpack_gathered(&self, gathered: &Tensor) -> Result<Vec<Tensor>> {
        let want = self.world * self.per_rank;
        if gathered.elem_count() != want {
            return Err(Error::LengthMismatch {
                op: "unpack_gathered",
                what: "the gathered buffer",
                expected: want,
                got: gathered.elem_count(),
            });
        }
        let g = gathered.reshape((self.world, self.per_rank))?;
        self.slots
            .iter()
            .map(|s| {
                if s.numel == 0 {
                    return Ok(Tensor::zeros(
                        &s.shape,
                        gathered.dtype(),
                        gathered.device(),
                    )?);
                }
                let flat = g
                    .narrow(1, s.offset, s.chunk)?
                    .contiguous()?
                    .flatten_all()?;
                Ok(flat.narrow(0, 0, s.numel)?.reshape(&s.shape)?)
            })
            .collect()
    }

    /// Packs full gradients as `[world * per_rank]`, rank `r`'s block holding
    /// the parts of every gradient that rank `r` keeps, for a reduce-scatter.
    pub fn pack_full(&self, full: &[Tensor], dtype: DType) -> Result<Tensor> {
        self.check_len("pack_full", full.len())?;
        let mut parts = Vec::with_capacity(full.len());
        for (i, t) in full.iter().enumerate() {
            self.check_shape("pack_full", i, t.shape())?;
            let s = &self.slots[i];
            if s.chunk == 0 {
                continue;
            }
            let flat = t.flatten_all()?.to_dtype(dtype)?;
            let pad = s.chunk * self.world - s.numel;
            let flat = if pad > 0 {
                flat.pad_with_zeros(0, 0, pad)?
            } else {
                flat
            };
            parts.push(flat.reshape((self.world, s.chunk))?);
        }
        let device = full.first().map_or(Device::Cpu, |t| t.device().clone());
        if parts.is_empty() {
            return Ok(Tensor::zeros(0, dtype, &device)?);
        }
        Ok(Tensor::cat(&parts, 1)?.flatten_all()?)
    }

    /// Splits this rank's reduced `[per_rank]` buffer into its pieces.
    pub fn unpack_local(&self, local: &Tensor) -> Result<Vec<Tensor>> {
        if local.elem_count() != self.per_rank {
            return Err(Error::LengthMismatch {
                op: "unpack_local",
                what: "the reduced buffer",
                expected: self.per_rank,
                got: local.elem_count(),
            });
        }
        (0..self.slots.len())
            .map(|i| {
                let len = self.piece_range(i).len();
                Ok(local.narrow(0, self.slots[i].offset, len)?)
            })
            .collect()
    }

    /// Every full parameter, all-gathered from each rank's `pieces` and cast to `dtype`.
    pub fn all_gather(
        &self,
        comm: &dyn Communicator,
        pieces: &[Tensor],
        dtype: DType,
        device: &Device,
    ) -> Result<Vec<Tensor>> {
        let local = self.pack_local(pieces, dtype, device)?;
        let gathered = if self.per_rank == 0 || self.world == 1 {
            local
        } else {
            comm.all_gather_tensor(&local)?
        };
        self.unpack_gathered(&gathered)
    }

    /// This rank's pieces of the mean over ranks of the full gradients `full`,
    /// reduced in `dtype` (f32 normally).
    pub fn reduce_scatter_mean(
        &self,
        comm: &dyn Communicator,
        full: &[Tensor],
        dtype: DType,
    ) -> Result<Vec<Tensor>> {
        let packed = self.pack_full(full, dtype)?;
        let local = if self.per_rank == 0 || self.world == 1 {
            packed
        } else {
            comm.reduce_scatter_tensor(&packed, ReduceOp::Mean)?
        };
        self.unpack_local(&local)
    }

    fn check_len(&self, op: &'static str, got: usize) -> Result<()> {
        if got != self.slots.len() {
            return Err(Error::LengthMismatch {
                op,
                what: "the tensor list",
                expected: self.slots.len(),
                got,
            });
        }
        Ok(())
    }

    fn check_shape(&self, op: &'static str, i: usize, shape: &Shape) -> Result<()> {
        let s = &self.slots[i];
        if shape.elem_count() != s.numel {
            return Err(Error::BadShape {
                op,
                reason: format!(
                    "parameter {} has shape {:?}, the layout expects {:?}",
                    s.name,
                    shape.dims(),
                    s.shape.dims()
                ),
            });
        }
        Ok(())
    }

    fn bad_piece(&self, op: &'static str, i: usize, got: usize, want: usize) -> Error {
        Error::BadShape {
            op,
            reason: format!(
                "the piece of parameter {} on rank {} has {got} elements, expected {want}",
                self.slots[i].name, self.rank
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> Vec<(String, Shape)> {
        vec![
            ("a.weight".into(), Shape::from((3, 5))),
            ("a.bias".into(), Shape::from(3)),
            ("b.weight".into(), Shape::from(1)),
            ("empty".into(), Shape::from(0)),
        ]
    }

    fn full() -> Vec<Tensor> {
        params()
            .iter()
            .enumerate()
            .map(|(k, (_, s))| {
                let n = s.elem_count();
                let v: Vec<f32> = (0..n).map(|j| (100 * k + j) as f32).collect();
                Tensor::from_vec(v, s, &Device::Cpu).unwrap()
            })
            .collect()
    }

    #[test]
    fn pieces_of_every_rank_concatenate_to_the_parameter() {
        for world in 1..=4 {
            let layouts: Vec<_> = (0..world)
                .map(|r| ShardLayout::new(&params(), world, r).unwrap())
                .collect();
            for (i, t) in full().iter().enumerate() {
                let mut joined = vec![];
                for l in &layouts {
                    let p = l.pieces_of(&full()).unwrap();
                    joined.extend(p[i].to_vec1::<f32>().unwrap());
                }
                assert_eq!(joined, t.flatten_all().unwrap().to_vec1::<f32>().unwrap());
            }
        }
    }

    #[test]
    fn gathered_packs_unpack_to_the_full_parameters() {
        let world = 3;
        let layouts: Vec<_> = (0..world)
            .map(|r| ShardLayout::new(&params(), world, r).unwrap())
            .collect();
        // An all-gather is the concatenation of every rank's packed buffer.
        let packed: Vec<Tensor> = layouts
            .iter()
            .map(|l| {
                l.pack_local(&l.pieces_of(&full()).unwrap(), DType::F32, &Device::Cpu)
                    .unwrap()
            })
            .collect();
        assert_eq!(packed[0].elem_count(), 5 + 1 + 1);
        let gathered = Tensor::cat(&packed, 0).unwrap();
        let back = layouts[1].unpack_gathered(&gathered).unwrap();
        for (b, f) in back.iter().zip(full()) {
            assert_eq!(b.dims(), f.dims());
            assert_eq!(
                b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                f.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            );
        }
    }

    #[test]
    fn reduce_scatter_packing_gives_each_rank_its_own_pieces() {
        let world = 2;
        for rank in 0..world {
            let l = ShardLayout::new(&params(), world, rank).unwrap();
            let packed = l.pack_full(&full(), DType::F32).unwrap();
            // Block `rank` of the packed buffer is what a reduce-scatter leaves this rank.
            let block = packed.narrow(0, rank * l.per_rank(), l.per_rank()).unwrap();
            let mine = l.unpack_local(&block).unwrap();
            let want = l.pieces_of(&full()).unwrap();
            for (m, w) in mine.iter().zip(&want) {
                assert_eq!(m.to_vec1::<f32>().unwrap(), w.to_vec1::<f32>().unwrap());
            }
        }
    }

    #[test]
    fn a_piece_of_the_wrong_length_is_named() {
        let l = ShardLayout::new(&params(), 2, 0).unwrap();
        let mut pieces = l.pieces_of(&full()).unwrap();
        pieces[1] = Tensor::zeros(7, DType::F32, &Device::Cpu).unwrap();
        let err = l
            .pack_local(&pieces, DType::F32, &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("a.bias") && err.contains("expected 2"),
            "{err}"
        );
    }
}
