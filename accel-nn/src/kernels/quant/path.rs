//! Which instructions the products through a 4-bit weight use, detected per
//! CPU and forced per thread, so that `bench_quant` times the AVX2 kernels
//! (what CPUs without AVX-512 run) beside the AVX-512 ones on one machine.

use super::super::forced::{forced, with_forced};
use super::super::raw::quant::Simd;

/// The instruction set of the 4-bit products.
///
/// Only the code expansion and the products straight off the codes change
/// with it (and the bf16-operand products, which need AVX-512 BF16, run
/// only under [`QuantPath::Avx512`]); the dense tiles go through `gemm`,
/// which picks its own kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantPath {
    /// Sixteen codes a permute.
    Avx512,
    /// AVX2 and FMA: eight codes a permute pair.
    Avx2,
    /// Plain loops.
    Portable,
}

impl QuantPath {
    /// Every path, widest first.
    pub const ALL: [QuantPath; 3] = [QuantPath::Avx512, QuantPath::Avx2, QuantPath::Portable];

    /// Its name in benchmark output.
    pub fn name(self) -> &'static str {
        match self {
            QuantPath::Avx512 => "avx512",
            QuantPath::Avx2 => "avx2",
            QuantPath::Portable => "portable",
        }
    }

    /// Whether this CPU has the instructions.
    pub fn available(self) -> bool {
        self.simd().available()
    }

    pub(crate) fn simd(self) -> Simd {
        match self {
            QuantPath::Avx512 => Simd::Avx512,
            QuantPath::Avx2 => Simd::Avx2,
            QuantPath::Portable => Simd::Scalar,
        }
    }
}

thread_local! {
    /// A path forced on this thread by [`with_quant_path`].
    static FORCED: std::cell::Cell<Option<QuantPath>> = const { std::cell::Cell::new(None) };
}

/// The path quantized linear layers called on this thread take: the widest
/// this CPU has, unless forced.
pub fn quant_path() -> QuantPath {
    forced(&FORCED).unwrap_or_else(|| {
        *QuantPath::ALL
            .iter()
            .find(|p| p.available())
            .expect("the portable path is always available")
    })
}

/// Runs `f` with the quantized linear layers it calls on this thread taking
/// `path` (benchmarks and tests compare the paths in one process with it).
///
/// # Errors
/// A path this CPU lacks, named.
pub fn with_quant_path<R>(path: QuantPath, f: impl FnOnce() -> R) -> crate::Result<R> {
    if !path.available() {
        return Err(crate::Error::PathUnavailable { path: path.name() });
    }
    Ok(with_forced(&FORCED, path, f))
}
