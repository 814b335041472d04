//! The safe storage-access helpers.

use candle_core::{DType, Device, Tensor, Var};

use super::{tf32, vals};
use crate::{with_slice, with_slice_mut, AdamWParams, Error};

#[test]
fn with_slice_mut_writes_through_clones_and_vars() {
    let var = Var::from_tensor(&tf32(&[1.0, 2.0, 3.0], &[3])).unwrap();
    let alias = var.as_tensor().clone();
    with_slice_mut::<f32, _>(&alias, "test", |s| {
        s.iter_mut().for_each(|v| *v *= 10.0);
        Ok(())
    })
    .unwrap();
    assert_eq!(vals(var.as_tensor()), [10.0, 20.0, 30.0]);
}

#[test]
fn with_slice_sees_only_the_view() {
    // A narrowed tensor is contiguous with a storage offset.
    let t = tf32(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], &[3, 2]);
    let view = t.narrow(0, 1, 2).unwrap();
    let sum = with_slice::<f32, _>(&view, "test", |s| Ok(s.iter().sum::<f32>())).unwrap();
    assert_eq!(sum, 2.0 + 3.0 + 4.0 + 5.0);
    with_slice_mut::<f32, _>(&view, "test", |s| {
        s[0] = -1.0;
        Ok(())
    })
    .unwrap();
    assert_eq!(vals(&t), [0.0, 1.0, -1.0, 3.0, 4.0, 5.0]);
}

#[test]
fn nested_access_mutates_several_tensors() {
    let (a, b, c) = (
        tf32(&[1.0, 2.0], &[2]),
        tf32(&[3.0, 4.0], &[2]),
        tf32(&[5.0, 6.0], &[2]),
    );
    let r = with_slice_mut::<f32, _>(&a, "outer", |a| {
        with_slice_mut::<f32, _>(&b, "middle", |b| {
            with_slice::<f32, _>(&c, "inner", |c| {
                for i in 0..2 {
                    a[i] += c[i];
                    b[i] *= c[i];
                }
                Ok(a[0] + b[1])
            })
        })
    })
    .unwrap();
    assert_eq!(vals(&a), [6.0, 8.0]);
    assert_eq!(vals(&b), [15.0, 24.0]);
    assert_eq!(r, 6.0 + 24.0);
}

#[test]
fn errors_inside_closures_propagate() {
    let (a, b) = (tf32(&[1.0], &[1]), tf32(&[2.0], &[1]));
    let err = with_slice_mut::<f32, ()>(&a, "outer", |_| {
        with_slice_mut::<f32, ()>(&b, "inner", |_| Err(Error::NotCompiled { feature: "cuda" }))
    })
    .unwrap_err();
    assert!(
        matches!(err, Error::NotCompiled { feature: "cuda" }),
        "{err}"
    );
    // The locks were released: both tensors are usable again.
    assert_eq!(vals(&(&a + &b).unwrap()), [3.0]);
}

#[test]
fn rejects_wrong_dtype_and_strided_views() {
    let t = tf32(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let err = with_slice::<half::bf16, ()>(&t, "op", |_| Ok(())).unwrap_err();
    assert!(
        matches!(
            err,
            Error::DTypeMismatch {
                expected: DType::BF16,
                got: DType::F32,
                ..
            }
        ),
        "{err}"
    );
    let tt = t.t().unwrap();
    let err = with_slice_mut::<f32, ()>(&tt, "op", |_| Ok(())).unwrap_err();
    assert!(
        matches!(err, Error::RequiresContiguous { op: "op", .. }),
        "{err}"
    );
}

#[test]
fn other_element_types_work() {
    let t = Tensor::new(&[1u32, 2, 3], &Device::Cpu).unwrap();
    with_slice_mut::<u32, _>(&t, "u32", |s| {
        s[2] = 7;
        Ok(())
    })
    .unwrap();
    assert_eq!(t.to_vec1::<u32>().unwrap(), [1, 2, 7]);
}

#[test]
fn aliased_written_tensors_are_refused_not_deadlocked() {
    let p = tf32(&[1.0, 2.0], &[2]);
    let g = tf32(&[0.1, 0.2], &[2]);
    let v = tf32(&[0.0, 0.0], &[2]);
    // exp_avg is a clone of the param: same storage.
    let r = crate::adamw_step(
        std::slice::from_ref(&p),
        std::slice::from_ref(&g),
        std::slice::from_ref(&p),
        std::slice::from_ref(&v),
        1,
        &AdamWParams::default(),
    );
    assert!(matches!(r, Err(Error::AliasedStorage { .. })), "{r:?}");
    // Two views of one flat buffer written in the same call.
    let flat = tf32(&[1.0, 2.0, 3.0, 4.0], &[4]);
    let views = [flat.narrow(0, 0, 2).unwrap(), flat.narrow(0, 2, 2).unwrap()];
    let r = crate::scale_in_place(&views, 2.0);
    assert!(
        matches!(&r, Err(Error::AliasedStorage { first, second, .. }) if first == "tensors[0]" && second == "tensors[1]")
    );
    assert_eq!(
        vals(&flat),
        [1.0, 2.0, 3.0, 4.0],
        "nothing written on refusal"
    );
    // Reading views of one buffer is fine, e.g. gradients from a flat buffer.
    let dst = [tf32(&[0.0; 2], &[2]), tf32(&[0.0; 2], &[2])];
    crate::add_in_place(&dst, &views).unwrap();
    assert_eq!(vals(&dst[1]), [3.0, 4.0]);
}

#[test]
fn long_lists_lock_in_groups() {
    // Far more tensors than one lock group, on a small test-thread stack.
    let ts: Vec<Tensor> = (0..1000).map(|i| tf32(&[i as f32; 3], &[3])).collect();
    std::thread::Builder::new()
        .stack_size(256 * 1024)
        .spawn(move || {
            crate::scale_in_place(&ts, 2.0).unwrap();
            for (i, t) in ts.iter().enumerate() {
                assert_eq!(vals(t), [2.0 * i as f32; 3]);
            }
        })
        .unwrap()
        .join()
        .unwrap();
}
