//! Building a model without memory for its weights, Accelerate's
//! `init_empty_weights` for candle: the model records what it asks for and
//! gets placeholders, so a model of any size can be described and planned.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::{SimpleBackend, VarBuilder};

use crate::dtype::DTypeName;
use crate::error::Result;
use crate::tree::ModuleTree;

/// One tensor a model asked for while being built on [`EmptyWeights`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmptyTensor {
    /// Full dotted name, e.g. `model.layers.0.mlp.weight`.
    pub name: String,
    /// The shape the model asked for.
    pub shape: Vec<usize>,
    /// The dtype the model asked for.
    pub dtype: DType,
}

/// A candle `SimpleBackend` that hands out placeholders instead of weights and
/// records every request, in request order.
///
/// Where PyTorch puts an empty model on the `meta` device, candle has no such
/// device; a placeholder here is one zero element broadcast to the requested
/// shape (see [`placeholder`]), so it has the right shape, dtype and device
/// and costs one element of memory. The model can be sized and planned
/// ([`EmptyWeights::tree`], then `infer_auto_device_map`) but must not be run:
/// every weight reads as zeros, and operations on a broadcast 40 GB tensor
/// would materialise it.
///
/// Clones share the record, so keep one to read it after handing a clone to
/// `VarBuilder::from_backend` (or use [`EmptyWeights::var_builder`]).
#[derive(Clone, Default)]
pub struct EmptyWeights {
    records: Arc<Mutex<Vec<EmptyTensor>>>,
    known: Option<Arc<HashSet<String>>>,
    described: Option<Describer>,
}

/// Reads a tensor asked for without a shape (a quantized weight's JSON state,
/// its code book), in `dtype`, when the source holds it.
pub type Describer = Arc<dyn Fn(&str, DType) -> Option<Tensor> + Send + Sync>;

impl std::fmt::Debug for EmptyWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmptyWeights")
            .field("records", &self.records)
            .field("known", &self.known.as_ref().map(|k| k.len()))
            .field("described", &self.described.is_some())
            .finish()
    }
}

/// A tensor of `shape` backed by one zero element: what an empty model holds,
/// and what a model built for FSDP holds instead of its parameters. The one
/// definition in the workspace, so [`crate::is_placeholder`] recognises every
/// tensor any crate makes this way.
///
/// Returns candle's error so `VarBuilder` backends (which must) can use it as
/// it is; `?` turns it into any crate's error.
///
/// # Errors
/// When the device cannot allocate one element.
pub fn placeholder(
    shape: impl Into<Shape>,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<Tensor> {
    Tensor::zeros((), dtype, device)?.broadcast_as(shape)
}

/// Starts an empty model: the recorder and a `VarBuilder` over it, whose
/// default dtype and device are `dtype` and `device`.
pub fn init_empty_weights(dtype: DType, device: &Device) -> (EmptyWeights, VarBuilder<'static>) {
    let weights = EmptyWeights::new();
    let vb = weights.var_builder(dtype, device);
    (weights, vb)
}

impl EmptyWeights {
    /// A recorder that claims to hold every tensor (`contains_tensor` is
    /// always true), so optional weights are created too.
    pub fn new() -> Self {
        Self::default()
    }

    /// A recorder whose `contains_tensor` answers from `names` (e.g. a
    /// checkpoint's names), so a model that probes for optional weights builds
    /// the variant the checkpoint holds.
    pub fn with_known_names<S: Into<String>>(names: impl IntoIterator<Item = S>) -> Self {
        EmptyWeights {
            records: Arc::default(),
            known: Some(Arc::new(names.into_iter().map(Into::into).collect())),
            described: None,
        }
    }

    /// The same recorder reading what is asked for without a shape with
    /// `describe` (its value is handed out and recorded with its shape): the
    /// small tensors that describe others, such as a quantized weight's
    /// state, which an empty model needs to know its parts' shapes.
    pub fn with_describer(mut self, describe: Describer) -> Self {
        self.described = Some(describe);
        self
    }

    /// A `VarBuilder` that builds on this recorder.
    pub fn var_builder(&self, dtype: DType, device: &Device) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(self.clone()), dtype, device.clone())
    }

    /// The tensors requested so far, each once, in first-request order.
    pub fn tensors(&self) -> Vec<EmptyTensor> {
        self.records
            .lock()
            .expect("EmptyWeights lock poisoned")
            .clone()
    }

    /// The model as a [`ModuleTree`]: modules implied by the dotted names
    /// (classes unknown), tensors as parameters in request order, which is the
    /// order the model built its layers.
    ///
    /// # Errors
    /// [`crate::Error::NoTorchDtype`] for a dtype torch lacks,
    /// [`crate::Error::DuplicateName`] for a name used as tensor and module.
    pub fn tree(&self) -> Result<ModuleTree> {
        let tensors = self
            .tensors()
            .into_iter()
            .map(|t| Ok((t.name, t.shape, DTypeName::try_from(t.dtype)?)))
            .collect::<Result<Vec<_>>>()?;
        ModuleTree::from_tensors(tensors)
    }

    /// Records a request; asking again for a name with the same shape and
    /// dtype (shared weights) is fine, with a different one it is an error.
    fn record(&self, name: &str, shape: &Shape, dtype: DType) -> candle_core::Result<()> {
        let mut records = self.records.lock().expect("EmptyWeights lock poisoned");
        match records.iter().find(|t| t.name == name) {
            Some(t) if t.shape == shape.dims() && t.dtype == dtype => Ok(()),
            Some(t) => Err(candle_core::Error::Msg(format!(
                "init_empty_weights: `{name}` requested as {:?} {dtype:?} after {:?} {:?}",
                shape.dims(),
                t.shape,
                t.dtype
            ))),
            None => {
                records.push(EmptyTensor {
                    name: name.to_string(),
                    shape: shape.dims().to_vec(),
                    dtype,
                });
                Ok(())
            }
        }
    }
}

impl SimpleBackend for EmptyWeights {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        _init: candle_nn::Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        self.record(name, &shape, dtype)?;
        placeholder(shape, dtype, device)
    }

    fn get_unchecked(
        &self,
        name: &str,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        if let Some(t) = self.described.as_ref().and_then(|d| d(name, dtype)) {
            self.record(name, t.shape(), dtype)?;
            return t.to_device(device);
        }
        // Without a shape there is nothing to record or to broadcast to.
        Err(candle_core::Error::Msg(format!(
            "init_empty_weights: `{name}` was requested without a shape; an empty model can only hand out tensors whose shape the model states"
        )))
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.known.as_ref().is_none_or(|known| known.contains(name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{CpuStorage, Storage};

    #[test]
    fn a_placeholder_holds_one_element_whatever_its_shape() {
        let t = placeholder((100_000, 100_000), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(t.dims(), &[100_000, 100_000]);
        let (storage, layout) = t.storage_and_layout();
        match &*storage {
            Storage::Cpu(CpuStorage::F32(v)) => assert_eq!(v.len(), 1),
            other => panic!("unexpected storage {:?}", other.dtype()),
        }
        assert_eq!(layout.stride(), &[0, 0]);
    }

    #[test]
    fn requests_are_recorded_once_in_order_and_conflicts_refused() {
        let (weights, vb) = init_empty_weights(DType::BF16, &Device::Cpu);
        let emb = candle_nn::embedding(10, 4, vb.pp("wte")).unwrap();
        candle_nn::linear(4, 8, vb.pp("h.0")).unwrap();
        // Tied head: the same weight asked for again.
        vb.pp("wte").get((10, 4), "weight").unwrap();
        assert_eq!(emb.embeddings().dtype(), DType::BF16);
        let names: Vec<_> = weights.tensors().into_iter().map(|t| t.name).collect();
        assert_eq!(names, ["wte.weight", "h.0.weight", "h.0.bias"]);
        let err = vb.pp("wte").get((4, 10), "weight").unwrap_err().to_string();
        assert!(
            err.contains("`wte.weight` requested as [4, 10] BF16 after [10, 4] BF16"),
            "{err}"
        );
        assert!(vb.get_unchecked("x").is_err());
        let tree = weights.tree().unwrap();
        assert_eq!(
            tree.tensor(tree.tensor_id("h.0.bias").unwrap()).dtype,
            DTypeName::BFLOAT16
        );
    }

    #[test]
    fn known_names_decide_which_optional_weights_exist() {
        let weights = EmptyWeights::with_known_names(["l.weight"]);
        let vb = weights.var_builder(DType::F32, &Device::Cpu);
        assert!(vb.contains_tensor("l.weight"));
        assert!(!vb.contains_tensor("l.bias"));
        assert!(EmptyWeights::new()
            .var_builder(DType::F32, &Device::Cpu)
            .contains_tensor("any"));
    }
}
