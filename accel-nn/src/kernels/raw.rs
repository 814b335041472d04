//! The one audited file of `unsafe` in accel-nn.
//!
//! Why it exists: the fused kernels call `gemm` with the strides their data
//! already has (so head splits and weight transposes cost no copies), and
//! `gemm::gemm` takes raw pointers. Everything else (`Vec` allocation
//! without a zero fill, AVX-512/AVX2 dispatch) is here for the same reason:
//! one place to audit. Every entry point is a safe function that checks the
//! bounds the unsafe code relies on, so a shape bug in a kernel is a panic,
//! never an out-of-bounds access.

/// A read-only strided matrix over a slice: element (i, j) lives at
/// `data[off + i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct MatRef<'a> {
    data: &'a [f32],
    off: usize,
    rs: usize,
    cs: usize,
}

impl<'a> MatRef<'a> {
    /// The row-major matrix starting at `data[off]` with row stride `rs`.
    pub(crate) fn rows(data: &'a [f32], off: usize, rs: usize) -> Self {
        Self {
            data,
            off,
            rs,
            cs: 1,
        }
    }

    /// The transpose of the row-major matrix at `data[off]` with row stride `rs`.
    pub(crate) fn rows_t(data: &'a [f32], off: usize, rs: usize) -> Self {
        Self {
            data,
            off,
            rs: 1,
            cs: rs,
        }
    }

    /// Panics unless every element of a `rows x cols` matrix is in bounds.
    fn check(&self, rows: usize, cols: usize, what: &str) {
        if rows == 0 || cols == 0 {
            return;
        }
        let last = self.off + (rows - 1) * self.rs + (cols - 1) * self.cs;
        assert!(
            last < self.data.len(),
            "gemm: {what} [{rows}, {cols}] (offset {}, strides {}, {}) overruns a slice of {}",
            self.off,
            self.rs,
            self.cs,
            self.data.len()
        );
    }
}

/// `dst[m, n] = [dst +] beta * a[m, k] @ b[k, n]`, with `dst` row-major at
/// `dst[dst_off..]` with row stride `dst_rs`.
///
/// Bounds are checked (a panic names the operand) and `dst_rs >= n` is
/// required so no two output elements share a slot; `&mut` already rules
/// out aliasing with `a` and `b`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    dst_off: usize,
    dst_rs: usize,
    accumulate: bool,
    a: MatRef<'_>,
    b: MatRef<'_>,
    beta: f32,
    parallel: bool,
) {
    a.check(m, k, "lhs");
    b.check(k, n, "rhs");
    if m == 0 || n == 0 {
        return;
    }
    assert!(dst_rs >= n, "gemm: dst row stride {dst_rs} < {n} columns");
    let last = dst_off + (m - 1) * dst_rs + n - 1;
    assert!(
        last < dst.len(),
        "gemm: dst [{m}, {n}] overruns {}",
        dst.len()
    );
    let threads = rayon::current_num_threads();
    let par = if parallel && threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // With k == 0 the operands are never read, so their offsets may sit at
    // the end of their slices; point them at the start instead.
    let (a_off, b_off) = if k == 0 { (0, 0) } else { (a.off, b.off) };
    // SAFETY: the checks above keep every element gemm reads (a: m x k,
    // b: k x n) and writes (dst: m x n, distinct slots since dst_rs >= n)
    // inside its slice; `dst` is a unique borrow, so it aliases neither
    // operand. Offsets are in bounds, so `add` stays inside the allocation
    // (or one past it for empty operands, which gemm does not read).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr().add(dst_off),
            1,
            dst_rs as isize,
            accumulate,
            a.data.as_ptr().add(a_off.min(a.data.len())),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr().add(b_off.min(b.data.len())),
            b.cs as isize,
            b.rs as isize,
            1.0,
            beta,
            false,
            false,
            false,
            par,
        )
    }
}

/// A new `m x n` row-major buffer holding `a @ b`.
///
/// gemm overwrites every element when it does not read `dst`, so the
/// buffer is never zero-filled first (that memset showed up at ~3% of a
/// training step).
pub(crate) fn gemm_new(
    (m, n, k): (usize, usize, usize),
    a: MatRef<'_>,
    b: MatRef<'_>,
    parallel: bool,
) -> Vec<f32> {
    if m == 0 || n == 0 {
        return Vec::new();
    }
    a.check(m, k, "lhs");
    b.check(k, n, "rhs");
    let mut out: Vec<f32> = Vec::with_capacity(m * n);
    let threads = rayon::current_num_threads();
    let par = if parallel && threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    let (a_off, b_off) = if k == 0 { (0, 0) } else { (a.off, b.off) };
    // SAFETY: operands checked in bounds above; `out` has capacity m * n,
    // which is exactly the m x n row-major block gemm writes (dst_rs = n).
    // gemm writes every element when read_dst is false (zeros when k == 0),
    // so all m * n elements are initialised before `set_len`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.data.as_ptr().add(a_off.min(a.data.len())),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr().add(b_off.min(b.data.len())),
            b.cs as isize,
            b.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        );
        out.set_len(m * n);
    }
    out
}

/// Defines `pub(super) fn $name($args) -> $ret` that runs `$body`
/// compiled for AVX-512, AVX2 or baseline, whichever the CPU supports.
///
/// Why: the kernels' inner loops are plain Rust over slices, and only a
/// `#[target_feature]` function lets LLVM vectorise them with the wide
/// registers while the binary still runs on older CPUs. The expansion
/// carries `#[allow(unsafe_code)]`: calling a `target_feature` function is
/// unsafe, and is sound here because it happens only after the matching
/// runtime detection.
macro_rules! multiversion {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? $body:block) => {
        $(#[$doc])*
        #[allow(unsafe_code)]
        pub(super) fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn imp($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? { imp($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? { imp($($arg),*) }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU supports the enabled features.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: as above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            imp($($arg),*)
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_reads_strided_operands_and_writes_a_strided_destination() {
        // a = [[1, 2], [3, 4]], b^T stored row-major as [[5, 6], [7, 8]].
        let a = [1.0, 2.0, 3.0, 4.0];
        let bt = [5.0, 6.0, 7.0, 8.0];
        let mut dst = vec![0.0; 6];
        gemm(
            (2, 2, 2),
            &mut dst,
            1,
            3,
            false,
            MatRef::rows(&a, 0, 2),
            MatRef::rows_t(&bt, 0, 2),
            1.0,
            false,
        );
        assert_eq!(dst, vec![0.0, 17.0, 23.0, 0.0, 39.0, 53.0]);
        let new = gemm_new(
            (2, 2, 2),
            MatRef::rows(&a, 0, 2),
            MatRef::rows(&bt, 0, 2),
            true,
        );
        assert_eq!(new, vec![19.0, 22.0, 43.0, 50.0]);
        assert_eq!(
            gemm_new(
                (2, 3, 0),
                MatRef::rows(&[], 0, 0),
                MatRef::rows(&[], 0, 3),
                false
            ),
            vec![0.0; 6]
        );
    }

    #[test]
    #[should_panic(expected = "overruns")]
    fn gemm_refuses_an_operand_shorter_than_its_shape() {
        let a = [1.0; 3];
        let mut dst = vec![0.0; 4];
        gemm(
            (2, 2, 2),
            &mut dst,
            0,
            2,
            false,
            MatRef::rows(&a, 0, 2),
            MatRef::rows(&a, 0, 2),
            1.0,
            false,
        );
    }
}
