//! Which instructions the linear layers multiply bf16 tensors with, chosen
//! per CPU by measurement (`bench_linear --dtype bf16` times every path this
//! CPU has side by side and prints which one is the default), and forced per
//! thread for such comparisons.

use super::forced::{forced, with_forced};
use super::raw::{amx, bf16_tile_available};

/// How the linear layers multiply bf16 tensors on this CPU.
///
/// The default is the fastest this CPU has, as `bench_linear --dtype bf16`
/// measures each available path side by side and prints it (BENCHMARKS.md
/// quotes each CPU kind): AMX tiles where present, else `vdpbf16ps` on the
/// weight as it lies, else the f32 kernels on converted values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Path {
    /// AMX tiles, reading bf16 tensors as they lie.
    Amx,
    /// AVX-512 BF16's `vdpbf16ps`: a bf16 weight packed as it lies (from 9
    /// rows; fewer take the f32 skinny kernels).
    Avx512Bf16,
    /// bf16 values converted to f32 and multiplied with f32 FMAs.
    F32,
}

impl Bf16Path {
    /// Every path, fastest first where available.
    pub const ALL: [Bf16Path; 3] = [Bf16Path::Amx, Bf16Path::Avx512Bf16, Bf16Path::F32];

    /// Its name in benchmark output.
    pub fn name(self) -> &'static str {
        match self {
            Bf16Path::Amx => "amx",
            Bf16Path::Avx512Bf16 => "avx512_bf16",
            Bf16Path::F32 => "f32",
        }
    }

    /// Whether this CPU has the instructions.
    pub fn available(self) -> bool {
        match self {
            Bf16Path::Amx => amx::available(),
            Bf16Path::Avx512Bf16 => bf16_tile_available(),
            Bf16Path::F32 => true,
        }
    }
}

thread_local! {
    /// A path forced on this thread by [`with_bf16_path`].
    static FORCED: std::cell::Cell<Option<Bf16Path>> = const { std::cell::Cell::new(None) };
}

/// The path bf16 linear layers called on this thread take.
pub fn bf16_path() -> Bf16Path {
    forced(&FORCED).unwrap_or_else(|| {
        *Bf16Path::ALL
            .iter()
            .find(|p| p.available())
            .expect("the f32 path is always available")
    })
}

/// Runs `f` with the bf16 linear layers it calls on this thread taking
/// `path` (benchmarks compare the paths in one process with it).
///
/// # Errors
/// A path this CPU lacks, named.
pub fn with_bf16_path<R>(path: Bf16Path, f: impl FnOnce() -> R) -> crate::Result<R> {
    if !path.available() {
        return Err(crate::Error::PathUnavailable { path: path.name() });
    }
    Ok(with_forced(&FORCED, path, f))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let v = ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2000) as f32;
                half::bf16::from_f32(v / 1000.0 - 1.0).to_f32()
            })
            .collect()
    }

    /// Every path this CPU has gives the bf16 linear's product and input
    /// gradient within bf16 rounding of the f32 ones; a path it lacks is
    /// an error naming it, and the default is restored after.
    #[test]
    fn each_available_bf16_path_computes_the_same_linear() {
        use candle_core::{Device, Tensor, Var};
        let (n, inp, out) = (24, 40, 36);
        let x = Tensor::from_vec(data(n * inp, 1), (n, inp), &Device::Cpu).unwrap();
        let w = Tensor::from_vec(data(out * inp, 2), (out, inp), &Device::Cpu).unwrap();
        let run = |dtype| {
            let x = Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap();
            let w = w.to_dtype(dtype).unwrap();
            let y = crate::ops::linear(x.as_tensor(), &w, None, None).unwrap();
            let g = y.sum_all().unwrap().backward().unwrap();
            let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            (f(&y), f(g.get(x.as_tensor()).unwrap()))
        };
        let want = run(DType::F32);
        let default = bf16_path();
        for p in Bf16Path::ALL {
            match with_bf16_path(p, || run(DType::BF16)) {
                Ok((y, dx)) => {
                    for (a, b) in [(y, &want.0), (dx, &want.1)] {
                        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
                        let d = d.to_scalar::<f32>().unwrap();
                        assert!(d < 0.25, "{}: {d}", p.name());
                    }
                }
                Err(e) => {
                    assert!(!p.available());
                    assert!(e.to_string().contains(p.name()), "{e}");
                }
            }
            assert_eq!(bf16_path(), default);
        }
    }
}
