//! What the workspace's patched candle-core (`vendor/candle-core`, the first gradient of a node stored
//! as it is instead of added into fresh zeros) must keep from candle's own backward: sums of
//! gradients over fan-in, and gradients that each own a contiguous storage from their first
//! element, since the Accelerator adopts them as accumulators and the kernels write them in place.

use accel_core::kernels::storage_key;
use candle_core::{CpuStorage, CustomOp2, Device, Layout, Result, Shape, Tensor, Var};

fn var(v: &[f32]) -> Result<Var> {
    Var::from_vec(v.to_vec(), v.len(), &Device::Cpu)
}

fn vals(t: &Tensor) -> Vec<f32> {
    t.to_vec1::<f32>().unwrap()
}

/// Owns a contiguous storage from its first element, shared with no other gradient of `ts`.
fn assert_own_storage(ts: &[&Tensor]) {
    for (i, t) in ts.iter().enumerate() {
        assert!(t.is_contiguous(), "gradient {i} is strided");
        assert_eq!(
            t.layout().start_offset(),
            0,
            "gradient {i} is a view into a buffer"
        );
        let key = storage_key(t).expect("a CPU gradient has a storage");
        for (j, u) in ts.iter().enumerate().skip(i + 1) {
            assert_ne!(
                Some(key),
                storage_key(u),
                "gradients {i} and {j} share a storage"
            );
        }
    }
}

#[test]
fn gradients_sum_over_fan_in() -> Result<()> {
    let w = var(&[1.0, -2.0, 3.0])?;
    // w reaches the loss three times: twice through one Add, once through a Mul.
    let y = ((w.as_tensor() + w.as_tensor())? + (w.as_tensor() * 4.0)?)?;
    let grads = y.sum_all()?.backward()?;
    assert_eq!(vals(grads.get(w.as_tensor()).unwrap()), [6.0, 6.0, 6.0]);
    // Subtraction as the first gradient: d(-w)/dw.
    let grads = (w.as_tensor().zeros_like()? - w.as_tensor())?
        .sum_all()?
        .backward()?;
    assert_eq!(vals(grads.get(w.as_tensor()).unwrap()), [-1.0, -1.0, -1.0]);
    Ok(())
}

#[test]
fn the_two_inputs_of_an_add_get_gradients_of_their_own() -> Result<()> {
    let (a, b) = (var(&[1.0, 2.0])?, var(&[3.0, 4.0])?);
    // candle hands both inputs of an Add the same gradient tensor.
    let grads = (a.as_tensor() + b.as_tensor())?.sum_all()?.backward()?;
    let (ga, gb) = (
        grads.get(a.as_tensor()).unwrap(),
        grads.get(b.as_tensor()).unwrap(),
    );
    assert_own_storage(&[ga, gb]);
    assert_eq!((vals(ga), vals(gb)), (vec![1.0, 1.0], vec![1.0, 1.0]));
    Ok(())
}

#[test]
fn a_transposed_use_gives_a_contiguous_gradient() -> Result<()> {
    let w = Var::from_vec((0..6).map(|x| x as f32).collect(), (2, 3), &Device::Cpu)?;
    let c = Tensor::new(&[[1f32, 10.0], [100.0, 1000.0], [1e4, 1e5]], &Device::Cpu)?;
    let grads = (w.as_tensor().t()? * &c)?.sum_all()?.backward()?;
    let g = grads.get(w.as_tensor()).unwrap();
    assert_own_storage(&[g]);
    assert_eq!(g.to_vec2::<f32>()?, c.t()?.to_vec2::<f32>()?);
    Ok(())
}

/// `x * y` whose backward returns its two gradients as views of one buffer, as accel-nn's CUDA
/// norm backward does.
struct PackedGrads;

impl CustomOp2 for PackedGrads {
    fn name(&self) -> &'static str {
        "packed-grads"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, y) = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(y)) => (x, y),
            _ => candle_core::bail!("f32 only"),
        };
        let (x, y) = (&x[l1.start_offset()..], &y[l2.start_offset()..]);
        let n = l1.shape().elem_count();
        let out = (0..n).map(|i| x[i] * y[i]).collect();
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        y: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let n = x.elem_count();
        let packed = Tensor::cat(&[(grad * y)?, (grad * x)?], 0)?;
        Ok((Some(packed.narrow(0, 0, n)?), Some(packed.narrow(0, n, n)?)))
    }
}

#[test]
fn gradients_returned_as_views_of_one_buffer_are_copied_out() -> Result<()> {
    let (x, y) = (var(&[1.0, 2.0, 3.0])?, var(&[4.0, 5.0, 6.0])?);
    let z = x.as_tensor().apply_op2(y.as_tensor(), PackedGrads)?;
    let grads = z.sum_all()?.backward()?;
    let (gx, gy) = (
        grads.get(x.as_tensor()).unwrap(),
        grads.get(y.as_tensor()).unwrap(),
    );
    assert_own_storage(&[gx, gy]);
    assert_eq!(
        (vals(gx), vals(gy)),
        (vec![4.0, 5.0, 6.0], vec![1.0, 2.0, 3.0])
    );
    Ok(())
}

/// `Var::from_tensor_owned` (the patch that keeps a loaded weight from being held twice): a tensor
/// nothing else holds becomes the variable over its own storage, with no copy; one that shares its
/// storage (another handle, or a view) is copied, so a write through the variable reaches only it.
#[test]
fn an_owned_tensor_becomes_a_variable_without_a_copy() -> Result<()> {
    let t = Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?;
    let key = storage_key(&t);
    let v = Var::from_tensor_owned(t)?;
    assert_eq!(
        storage_key(v.as_tensor()),
        key,
        "a sole owner's storage is taken"
    );
    v.set(&Tensor::new(&[4f32, 5., 6.], &Device::Cpu)?)?;
    assert_eq!(vals(v.as_tensor()), [4., 5., 6.]);
    let g = (v.as_tensor() * 2.0)?.sum_all()?.backward()?;
    assert_eq!(
        vals(g.get(v.as_tensor()).expect("the variable trains")),
        [2., 2., 2.]
    );

    let shared = Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?;
    let v = Var::from_tensor_owned(shared.clone())?;
    assert_ne!(
        storage_key(v.as_tensor()),
        storage_key(&shared),
        "a shared tensor is copied"
    );
    v.set(&Tensor::new(&[7f32, 8., 9.], &Device::Cpu)?)?;
    assert_eq!(vals(&shared), [1., 2., 3.]);

    let whole = Tensor::new(&[1f32, 2., 3., 4.], &Device::Cpu)?;
    let key = storage_key(&whole);
    let v = Var::from_tensor_owned(whole.narrow(0, 1, 2)?)?;
    assert_ne!(storage_key(v.as_tensor()), key, "a view is copied");
    assert_eq!(vals(v.as_tensor()), [2., 3.]);
    Ok(())
}

/// An op without a backward, named for this test only.
struct Cut(&'static str);

impl candle_core::CustomOp1 for Cut {
    fn name(&self) -> &'static str {
        self.0
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((s.clone(), l.shape().clone()))
    }
}

fn cuts_of(name: &str) -> u64 {
    candle_core::cuts::recorded()
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(0, |&(_, count)| count)
}

/// The patched candle-core counts each op without a backward applied to a tensor that carries a
/// gradient (what the no-gradient report names), and nothing else: not the op on a constant, not
/// the calls a backward pass makes.
#[test]
fn ops_without_a_backward_on_tracked_tensors_are_counted_as_cuts() -> Result<()> {
    let v = var(&[1., 2., 3.])?;
    let y = (v.as_tensor() * 2.0)?;
    y.apply_op1_no_bwd(&Cut("test-cut-tracked"))?;
    v.as_tensor().apply_op1_no_bwd(&Cut("test-cut-tracked"))?;
    assert_eq!(cuts_of("test-cut-tracked"), 2);
    Tensor::new(&[1f32], &Device::Cpu)?.apply_op1_no_bwd(&Cut("test-cut-constant"))?;
    assert_eq!(cuts_of("test-cut-constant"), 0);

    /// A differentiable op whose backward applies an op without one to a tracked input.
    struct GradViaCut;
    impl candle_core::CustomOp1 for GradViaCut {
        fn name(&self) -> &'static str {
            "test-grad-via-cut"
        }
        fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
            Ok((s.clone(), l.shape().clone()))
        }
        fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
            arg.apply_op1_no_bwd(&Cut("test-cut-in-backward"))?;
            Ok(Some(grad.clone()))
        }
    }
    let g = y.apply_op1(GradViaCut)?.sum_all()?.backward()?;
    assert_eq!(vals(g.get(v.as_tensor()).unwrap()), [2., 2., 2.]);
    assert_eq!(
        cuts_of("test-cut-in-backward"),
        0,
        "a backward's ops are not cuts"
    );
    Ok(())
}
