//! A frozen layer's input is freed before the backward pass: the gradient of
//! `x` through a frozen weight reads the weight, not `x`, so the graph keeps
//! `x`'s node without its values (`Tensor::release_input_values`, a
//! candle-core patch). Every allocation of the process is counted (its own
//! binary, so no other test allocates meanwhile): dropping the last handle
//! to such an input must give its bytes back while the graph is alive, and
//! the gradients must equal those of the same graph with the input kept.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Mutex;

use accel_nn::layers::linear_b_with;
use accel_nn::ops;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::VarBuilder;

/// The system allocator, counting the bytes live.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
/// The tests measure one at a time (the harness runs them on threads).
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

// SAFETY: every call is forwarded unchanged to `System`, which upholds
// `GlobalAlloc`'s contract; the wrapper only reads the requested sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc` is passed on as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: the caller's contract for `realloc` is passed on as is.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The bytes `drop(t)` gives back.
fn freed_by_dropping(t: Tensor) -> isize {
    let before = LIVE.load(Ordering::SeqCst);
    drop(t);
    before - LIVE.load(Ordering::SeqCst)
}

fn values(rows: usize, cols: usize, seed: f64, dtype: DType) -> Result<Tensor> {
    Tensor::arange(0u32, (rows * cols) as u32, &Device::Cpu)?
        .to_dtype(DType::F32)?
        .affine(0.37, seed)?
        .sin()?
        .reshape((rows, cols))?
        .to_dtype(dtype)
}

const ROWS: usize = 256;
const D: usize = 128;
const FFN: usize = 384;

/// A Llama MLP after its norm, `down(swiglu(gate(h), up(h)))` with
/// `h = rms_norm(x)`: what `drop` of `h` and of the SwiGLU output give back
/// with the graph alive, and the gradient of `x`. `trainable` makes the
/// three weights variables (their gradients then need the inputs).
fn mlp(dtype: DType, trainable: bool) -> Result<(isize, isize, Tensor)> {
    let weight = |rows, cols, seed| -> Result<Tensor> {
        let w = values(rows, cols, seed, dtype)?.affine(0.1, 0.0)?;
        Ok(if trainable {
            Var::from_tensor(&w)?.as_tensor().clone()
        } else {
            w
        })
    };
    let (wg, wu, wd) = (
        weight(FFN, D, 1.0)?,
        weight(FFN, D, 2.0)?,
        weight(D, FFN, 3.0)?,
    );
    let g = values(1, D, 4.0, dtype)?.reshape(D)?;
    let x = Var::from_tensor(&values(ROWS, D, 0.0, dtype)?)?;
    let h = ops::rms_norm(x.as_tensor(), &g, 1e-6)?.reshape((1, ROWS, D))?;
    let gate = ops::linear(&h, &wg, None, None)?;
    let up = ops::linear(&h, &wu, None, None)?;
    let a = ops::swiglu(&gate, &up)?;
    drop((gate, up));
    let y = ops::linear(&a, &wd, None, None)?;
    let freed_h = freed_by_dropping(h);
    let freed_a = freed_by_dropping(a);
    let grads = y.sqr()?.sum_all()?.backward()?;
    let dx = grads.get(x.as_tensor()).expect("x has a gradient").clone();
    Ok((freed_h, freed_a, dx))
}

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()
}

#[test]
fn frozen_layers_inputs_are_freed_before_the_backward_f32() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().unwrap();
    let (h_bytes, a_bytes) = ((ROWS * D * 4) as isize, (ROWS * FFN * 4) as isize);
    let (freed_h, freed_a, dx) = mlp(DType::F32, false)?;
    assert!(freed_h >= h_bytes, "h: {freed_h} bytes freed of {h_bytes}");
    assert!(freed_a >= a_bytes, "a: {freed_a} bytes freed of {a_bytes}");
    // Trainable weights need their inputs: nothing is freed, and the input
    // gradient is the same, bit for bit (the same product computes it).
    let (kept_h, kept_a, dx_kept) = mlp(DType::F32, true)?;
    assert!(
        kept_h < h_bytes / 2 && kept_a < a_bytes / 2,
        "{kept_h} {kept_a}"
    );
    assert_eq!(max_diff(&dx, &dx_kept)?, 0.0);
    Ok(())
}

#[test]
fn frozen_layers_inputs_are_freed_before_the_backward_bf16() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().unwrap();
    let (h_bytes, a_bytes) = ((ROWS * D * 2) as isize, (ROWS * FFN * 2) as isize);
    let (freed_h, freed_a, dx) = mlp(DType::BF16, false)?;
    assert!(freed_h >= h_bytes, "h: {freed_h} bytes freed of {h_bytes}");
    assert!(freed_a >= a_bytes, "a: {freed_a} bytes freed of {a_bytes}");
    let (_, _, dx_kept) = mlp(DType::BF16, true)?;
    // Frozen bf16 weights take the products that read bf16 gradients as
    // they lie; trainable ones round differently.
    let scale = dx_kept
        .abs()?
        .max_all()?
        .to_dtype(DType::F32)?
        .to_scalar::<f32>()?;
    assert!(max_diff(&dx, &dx_kept)? <= 0.02 * scale);
    Ok(())
}

/// An input made by an op whose backward reads its own output (`exp`) stays:
/// its node is handed to that backward.
#[test]
fn an_input_whose_backward_reads_it_is_kept() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().unwrap();
    let x = Var::from_tensor(&values(ROWS, D, 0.0, DType::F32)?.affine(0.1, 0.0)?)?;
    let w = values(FFN, D, 1.0, DType::F32)?;
    let e = x.as_tensor().exp()?;
    let y = ops::linear(&e, &w, None, None)?;
    let bytes = (ROWS * D * 4) as isize;
    let freed = freed_by_dropping(e);
    assert!(freed < bytes / 2, "{freed} bytes freed");
    let grads = y.sum_all()?.backward()?;
    let dx = grads.get(x.as_tensor()).expect("x has a gradient");
    // d/dx sum(exp(x) w^T) = exp(x) * (column sums of w).
    let want = x.as_tensor().exp()?.broadcast_mul(&w.sum_keepdim(0)?)?;
    assert!(max_diff(dx, &want)? < 1e-4);
    Ok(())
}

/// A quantized layer (NF4): the SwiGLU output feeding it is freed too.
#[test]
fn quantized_layers_inputs_are_freed_before_the_backward() -> Result<()> {
    use accel_bigmodel::quant::{BnbQuantizationConfig, QuantType, QuantizeOnLoad};
    use accel_bigmodel::CheckpointSource;
    let _one = ONE_AT_A_TIME.lock().unwrap();
    let dir = tempfile::tempdir().map_err(candle_core::Error::wrap)?;
    let path = dir.path().join("model.safetensors");
    let w = values(D, FFN, 3.0, DType::F32)?.affine(0.1, 0.0)?;
    candle_core::safetensors::save(&[("down.weight".to_string(), w)].into(), &path)?;
    let config = BnbQuantizationConfig::four_bit(QuantType::Nf4);
    let source = CheckpointSource::open(&path)
        .map_err(candle_core::Error::wrap)?
        .with_quantization(QuantizeOnLoad::new(config).map_err(candle_core::Error::wrap)?)
        .map_err(candle_core::Error::wrap)?;
    let vb = VarBuilder::from_backend(Box::new(source), DType::F32, Device::Cpu);
    let down = linear_b_with(FFN, D, false, vb.pp("down"), None, None)?;
    assert!(down.quantized().is_some());
    let x = Var::from_tensor(&values(ROWS, FFN, 0.0, DType::F32)?)?;
    let a = ops::silu(x.as_tensor())?;
    let y = candle_core::Module::forward(&down, &a)?;
    let bytes = (ROWS * FFN * 4) as isize;
    let freed = freed_by_dropping(a);
    assert!(freed >= bytes, "{freed} bytes freed of {bytes}");
    let grads = y.sum_all()?.backward()?;
    assert!(grads.get(x.as_tensor()).is_some());
    Ok(())
}
