//! Typed views of host memory that collectives read and write.
//!
//! The [`Communicator`](crate::Communicator) trait is used as a trait object,
//! so its methods cannot be generic over the element type; these enums carry
//! the type instead. `From` conversions keep call sites short:
//! `comm.all_reduce((&mut grads[..]).into(), ReduceOp::Sum)`.

use candle_core::DType;
use half::{bf16, f16};

/// A read-only slice of one of the supported element types.
#[derive(Clone, Copy, Debug)]
pub enum Buffer<'a> {
    /// 32-bit floats.
    F32(&'a [f32]),
    /// 64-bit floats.
    F64(&'a [f64]),
    /// bfloat16.
    BF16(&'a [bf16]),
    /// IEEE half precision.
    F16(&'a [f16]),
    /// Unsigned 32-bit integers.
    U32(&'a [u32]),
    /// Signed 64-bit integers.
    I64(&'a [i64]),
    /// Bytes.
    U8(&'a [u8]),
}

/// A writable slice of one of the supported element types.
#[derive(Debug)]
pub enum BufferMut<'a> {
    /// 32-bit floats.
    F32(&'a mut [f32]),
    /// 64-bit floats.
    F64(&'a mut [f64]),
    /// bfloat16.
    BF16(&'a mut [bf16]),
    /// IEEE half precision.
    F16(&'a mut [f16]),
    /// Unsigned 32-bit integers.
    U32(&'a mut [u32]),
    /// Signed 64-bit integers.
    I64(&'a mut [i64]),
    /// Bytes.
    U8(&'a mut [u8]),
}

/// Runs `$body` with `$b` bound to the typed slice inside a buffer enum.
macro_rules! with_buffer {
    ($enum:ident, $buf:expr, $b:ident => $body:expr) => {
        match $buf {
            $crate::buffer::$enum::F32($b) => $body,
            $crate::buffer::$enum::F64($b) => $body,
            $crate::buffer::$enum::BF16($b) => $body,
            $crate::buffer::$enum::F16($b) => $body,
            $crate::buffer::$enum::U32($b) => $body,
            $crate::buffer::$enum::I64($b) => $body,
            $crate::buffer::$enum::U8($b) => $body,
        }
    };
}
pub(crate) use with_buffer;

/// Runs `$body` with an input and an output slice of the same element type,
/// or evaluates `$mismatch` when their dtypes differ.
macro_rules! with_buffer_pair {
    ($input:expr, $output:expr, ($i:ident, $o:ident) => $body:expr, $mismatch:expr) => {{
        use $crate::buffer::{Buffer as B, BufferMut as M};
        match ($input, $output) {
            (B::F32($i), M::F32($o)) => $body,
            (B::F64($i), M::F64($o)) => $body,
            (B::BF16($i), M::BF16($o)) => $body,
            (B::F16($i), M::F16($o)) => $body,
            (B::U32($i), M::U32($o)) => $body,
            (B::I64($i), M::I64($o)) => $body,
            (B::U8($i), M::U8($o)) => $body,
            _ => $mismatch,
        }
    }};
}
pub(crate) use with_buffer_pair;

impl Buffer<'_> {
    /// The candle dtype of the elements.
    pub fn dtype(&self) -> DType {
        with_buffer!(Buffer, self, b => dtype_of(b))
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        with_buffer!(Buffer, self, b => b.len())
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements as raw bytes, in native byte order.
    pub fn as_bytes(&self) -> &[u8] {
        with_buffer!(Buffer, self, b => bytemuck::cast_slice(b))
    }
}

impl<'a> BufferMut<'a> {
    /// The candle dtype of the elements.
    pub fn dtype(&self) -> DType {
        with_buffer!(BufferMut, self, b => dtype_of(b))
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        with_buffer!(BufferMut, self, b => b.len())
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A shorter-lived copy of this view, so the buffer can be used again afterwards.
    pub fn reborrow(&mut self) -> BufferMut<'_> {
        with_buffer!(BufferMut, self, b => (&mut **b).into())
    }

    /// A read-only view of the same elements.
    pub fn as_buffer(&self) -> Buffer<'_> {
        with_buffer!(BufferMut, self, b => (&**b).into())
    }
}

fn dtype_of<T: crate::reduce::Element>(_: &[T]) -> DType {
    T::DTYPE
}

macro_rules! buffer_from {
    ($t:ty, $variant:ident) => {
        impl<'a> From<&'a [$t]> for Buffer<'a> {
            fn from(s: &'a [$t]) -> Self {
                Buffer::$variant(s)
            }
        }
        impl<'a> From<&'a mut [$t]> for Buffer<'a> {
            fn from(s: &'a mut [$t]) -> Self {
                Buffer::$variant(s)
            }
        }
        impl<'a> From<&'a Vec<$t>> for Buffer<'a> {
            fn from(s: &'a Vec<$t>) -> Self {
                Buffer::$variant(s)
            }
        }
        impl<'a> From<&'a mut [$t]> for BufferMut<'a> {
            fn from(s: &'a mut [$t]) -> Self {
                BufferMut::$variant(s)
            }
        }
        impl<'a> From<&'a mut Vec<$t>> for BufferMut<'a> {
            fn from(s: &'a mut Vec<$t>) -> Self {
                BufferMut::$variant(s)
            }
        }
    };
}

buffer_from!(f32, F32);
buffer_from!(f64, F64);
buffer_from!(bf16, BF16);
buffer_from!(f16, F16);
buffer_from!(u32, U32);
buffer_from!(i64, I64);
buffer_from!(u8, U8);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_keep_dtype_and_length() {
        let mut v = vec![1.0f32, 2.0, 3.0];
        let mut m: BufferMut = (&mut v).into();
        assert_eq!(m.dtype(), DType::F32);
        assert_eq!(m.len(), 3);
        assert_eq!(m.reborrow().len(), 3);
        assert_eq!(m.as_buffer().as_bytes().len(), 12);
        let ints = [7i64];
        assert_eq!(Buffer::from(&ints[..]).dtype(), DType::I64);
        assert!(Buffer::U8(&[]).is_empty());
    }
}
