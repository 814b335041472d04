//! Reduction operators and the element types collectives move.

use bytemuck::Pod;
use candle_core::DType;
use half::{bf16, f16};

use crate::{Error, Result};

/// How [`all_reduce`](crate::Communicator::all_reduce) and
/// [`reduce_scatter`](crate::Communicator::reduce_scatter) combine the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum (wrapping for integers).
    Sum,
    /// Element-wise sum divided by the world size; floats only (PyTorch's `AVG`).
    #[doc(alias = "Avg")]
    Mean,
    /// Element-wise maximum (for floats, a NaN loses against a number, as in `f32::max`).
    Max,
    /// Element-wise minimum (for floats, a NaN loses against a number, as in `f32::min`).
    Min,
    /// Element-wise product (wrapping for integers).
    Product,
}

impl ReduceOp {
    /// PyTorch's name for [`ReduceOp::Mean`].
    pub const AVG: ReduceOp = ReduceOp::Mean;

    /// The code sent on the wire so peers can check they reduce alike.
    pub(crate) fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Mean => 1,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
            ReduceOp::Product => 4,
        }
    }
}

/// An element type the collectives can move and reduce.
///
/// Implemented for `f32`, `f64`, `bf16`, `f16`, `u32`, `i64` and `u8`, the
/// candle dtypes a training loop communicates. Half-precision values are
/// reduced in f32 and rounded once per step, as NCCL does.
pub(crate) trait Element: Pod + Send + Sync + PartialOrd + 'static {
    /// The matching candle dtype.
    const DTYPE: DType;
    /// Whether [`ReduceOp::Mean`] is defined.
    const IS_FLOAT: bool;
    /// `dst[i] = dst[i] (op) src[i]`; `Mean` accumulates like `Sum`.
    fn reduce(dst: &mut [Self], src: &[Self], op: ReduceOp);
    /// Divides every element by `n` (the second half of `Mean`).
    fn divide(buf: &mut [Self], n: usize);
}

/// Writes the element-wise loop once per operator so each one vectorizes.
macro_rules! reduce_loops {
    ($dst:ident, $src:ident, $op:ident, $sum:expr, $prod:expr, $max:expr, $min:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Mean => {
                for (d, s) in $dst.iter_mut().zip($src) {
                    *d = $sum(*d, *s);
                }
            }
            ReduceOp::Product => {
                for (d, s) in $dst.iter_mut().zip($src) {
                    *d = $prod(*d, *s);
                }
            }
            ReduceOp::Max => {
                for (d, s) in $dst.iter_mut().zip($src) {
                    *d = $max(*d, *s);
                }
            }
            ReduceOp::Min => {
                for (d, s) in $dst.iter_mut().zip($src) {
                    *d = $min(*d, *s);
                }
            }
        }
    };
}

macro_rules! float_element {
    ($t:ty, $dtype:ident) => {
        impl Element for $t {
            const DTYPE: DType = DType::$dtype;
            const IS_FLOAT: bool = true;
            fn reduce(dst: &mut [Self], src: &[Self], op: ReduceOp) {
                reduce_loops!(
                    dst,
                    src,
                    op,
                    |a: $t, b: $t| a + b,
                    |a: $t, b: $t| a * b,
                    <$t>::max,
                    <$t>::min
                )
            }
            fn divide(buf: &mut [Self], n: usize) {
                let inv = 1.0 / n as $t;
                for x in buf {
                    *x *= inv;
                }
            }
        }
    };
}

macro_rules! half_element {
    ($t:ty, $dtype:ident) => {
        impl Element for $t {
            const DTYPE: DType = DType::$dtype;
            const IS_FLOAT: bool = true;
            fn reduce(dst: &mut [Self], src: &[Self], op: ReduceOp) {
                let f = |x: $t| x.to_f32();
                let h = <$t>::from_f32;
                reduce_loops!(
                    dst,
                    src,
                    op,
                    |a, b| h(f(a) + f(b)),
                    |a, b| h(f(a) * f(b)),
                    |a, b| h(f32::max(f(a), f(b))),
                    |a, b| h(f32::min(f(a), f(b)))
                )
            }
            fn divide(buf: &mut [Self], n: usize) {
                let n = n as f32;
                for x in buf {
                    *x = <$t>::from_f32(x.to_f32() / n);
                }
            }
        }
    };
}

macro_rules! int_element {
    ($t:ty, $dtype:ident) => {
        impl Element for $t {
            const DTYPE: DType = DType::$dtype;
            const IS_FLOAT: bool = false;
            fn reduce(dst: &mut [Self], src: &[Self], op: ReduceOp) {
                reduce_loops!(
                    dst,
                    src,
                    op,
                    <$t>::wrapping_add,
                    <$t>::wrapping_mul,
                    Ord::max,
                    Ord::min
                )
            }
            fn divide(buf: &mut [Self], n: usize) {
                // Unreachable through the public API (`check_reduce` rejects
                // integer means); integer division keeps it total anyway.
                for x in buf {
                    *x /= n as $t;
                }
            }
        }
    };
}

float_element!(f32, F32);
float_element!(f64, F64);
half_element!(bf16, BF16);
half_element!(f16, F16);
int_element!(u32, U32);
int_element!(i64, I64);
int_element!(u8, U8);

/// Rejects reductions that are not defined for `T` before any byte moves.
pub(crate) fn check_reduce<T: Element>(op: &'static str, reduce: ReduceOp) -> Result<()> {
    if reduce == ReduceOp::Mean && !T::IS_FLOAT {
        return Err(Error::UnsupportedReduce {
            op,
            reduce,
            dtype: T::DTYPE,
        });
    }
    Ok(())
}

/// The name of a wire dtype code, for error messages.
pub(crate) fn dtype_name(code: u8) -> &'static str {
    match code {
        1 => "u8",
        2 => "u32",
        3 => "i64",
        4 => "bf16",
        5 => "f16",
        6 => "f32",
        7 => "f64",
        _ => "an unknown dtype",
    }
}

/// The name of a wire reduction code, for error messages.
pub(crate) fn reduce_name(code: u8) -> &'static str {
    match code {
        0 => "Sum",
        1 => "Mean",
        2 => "Max",
        3 => "Min",
        4 => "Product",
        _ => "an unknown reduction",
    }
}

/// The wire code of a dtype, so peers can check they send alike.
pub(crate) fn dtype_code(dtype: DType) -> u8 {
    match dtype {
        DType::U8 => 1,
        DType::U32 => 2,
        DType::I64 => 3,
        DType::BF16 => 4,
        DType::F16 => 5,
        DType::F32 => 6,
        DType::F64 => 7,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_operator_combines_floats_element_wise() {
        let src = [4.0f32, -1.0, 2.5];
        for (op, want) in [
            (ReduceOp::Sum, [5.0, 1.0, 5.5]),
            (ReduceOp::Mean, [5.0, 1.0, 5.5]),
            (ReduceOp::Product, [4.0, -2.0, 7.5]),
            (ReduceOp::Max, [4.0, 2.0, 3.0]),
            (ReduceOp::Min, [1.0, -1.0, 2.5]),
        ] {
            let mut dst = [1.0f32, 2.0, 3.0];
            f32::reduce(&mut dst, &src, op);
            assert_eq!(dst, want, "{op:?}");
        }
    }

    #[test]
    fn integers_wrap_instead_of_panicking() {
        let mut dst = [250u8, 3];
        u8::reduce(&mut dst, &[10, 4], ReduceOp::Sum);
        assert_eq!(dst, [4, 7]);
        let mut dst = [i64::MAX];
        i64::reduce(&mut dst, &[2], ReduceOp::Product);
        assert_eq!(dst, [-2]);
    }

    #[test]
    fn half_types_reduce_through_f32() {
        let mut dst = [bf16::from_f32(1.5), bf16::from_f32(-2.0)];
        bf16::reduce(
            &mut dst,
            &[bf16::from_f32(2.0), bf16::from_f32(8.0)],
            ReduceOp::Max,
        );
        assert_eq!(dst, [bf16::from_f32(2.0), bf16::from_f32(8.0)]);
        let mut dst = [f16::from_f32(3.0)];
        f16::divide(&mut dst, 2);
        assert_eq!(dst, [f16::from_f32(1.5)]);
    }

    #[test]
    fn wire_codes_have_names() {
        for op in [
            ReduceOp::Sum,
            ReduceOp::Mean,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Product,
        ] {
            assert_eq!(reduce_name(op.code()), format!("{op:?}"));
        }
        assert_eq!(dtype_name(dtype_code(DType::BF16)), "bf16");
    }

    #[test]
    fn mean_is_rejected_for_integers_only() {
        assert!(check_reduce::<f32>("all_reduce", ReduceOp::Mean).is_ok());
        let err = check_reduce::<u32>("all_reduce", ReduceOp::Mean).unwrap_err();
        assert!(err.to_string().contains("Mean"), "{err}");
    }
}
