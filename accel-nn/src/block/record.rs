//! Finding out which tensors a block asks for, so each is fetched from the
//! real weight source exactly once, with its init hints.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};

use crate::Result;

#[derive(Clone)]
struct Request {
    name: String,
    shape: Shape,
    init: Init,
    dtype: DType,
}

/// Hands out placeholders and records every request; answers
/// `contains_tensor` from the real source, so a block that probes for
/// optional weights builds the variant the source holds.
struct Recorder<'a> {
    requests: Arc<Mutex<Vec<Request>>>,
    real: VarBuilder<'a>,
}

impl SimpleBackend for Recorder<'_> {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        init: Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        match requests.iter().find(|r| r.name == name) {
            Some(r) if r.shape != shape => candle_core::bail!(
                "`{name}` requested as {shape:?} after {:?} by the same block",
                r.shape
            ),
            Some(_) => {}
            None => requests.push(Request {
                name: name.to_string(),
                shape: shape.clone(),
                init,
                dtype,
            }),
        }
        Tensor::zeros((), dtype, device)?.broadcast_as(shape)
    }

    fn get_unchecked(
        &self,
        name: &str,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        // No shape to record: fetch it from the real source now. Its value
        // is handed out too, not a placeholder: a tensor read without a shape
        // describes the others (a quantized weight's JSON state says which
        // shapes its parts have).
        let t = self.real.root().get_unchecked_dtype(name, dtype)?;
        self.get(t.shape().clone(), name, Init::Const(0.), dtype, device)?;
        t.to_device(device)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.real.root().contains_tensor(name)
    }
}

/// Runs `build` at `prefix` on a recorder, then fetches every tensor it asked
/// for from `vb` (full names, request order).
pub(super) fn record_and_fetch<B>(
    vb: &VarBuilder,
    prefix: &str,
    build: &dyn Fn(VarBuilder) -> candle_core::Result<B>,
) -> Result<Vec<(String, Tensor)>> {
    let requests = Arc::new(Mutex::new(Vec::new()));
    let recorder = Recorder {
        requests: requests.clone(),
        real: vb.clone(),
    };
    let rec_vb = VarBuilder::from_backend(Box::new(recorder), vb.dtype(), vb.device().clone());
    build(child(&rec_vb, prefix))?;
    drop(rec_vb);
    let requests = requests.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let root = vb.root();
    requests
        .into_iter()
        .map(|r| {
            let t = root.get_with_hints_dtype(r.shape, &r.name, r.init, r.dtype)?;
            Ok((r.name, t))
        })
        .collect()
}

/// `vb` at the full module name `name`. Here, not in module.rs, because
/// module.rs imports this file and the two should not import each other.
pub(super) fn child<'a>(vb: &VarBuilder<'a>, name: &str) -> VarBuilder<'a> {
    let vb = vb.root();
    if name.is_empty() {
        vb
    } else {
        vb.pp(name)
    }
}
