//! [`find_executable_batch_size`]: retry a job with a smaller batch until it
//! fits in memory, as `accelerate.utils.find_executable_batch_size`.

use crate::{Error, Result};

/// True when `err` means "out of memory": [`Error::OutOfMemory`] (a cap the
/// program enforces itself, e.g. on the CPU) or a device error whose message
/// says so, as candle's CUDA errors do (`CUDA_ERROR_OUT_OF_MEMORY`,
/// "out of memory") and as Accelerate's `should_reduce_batch_size` matches.
pub fn is_out_of_memory(err: &Error) -> bool {
    match err {
        Error::OutOfMemory { .. } => true,
        // Only errors that come from tensor code: a config or file error that
        // happens to quote the words must not shrink the batch.
        Error::Candle(_) | Error::Kernels(_) | Error::Bigmodel(_) => {
            let msg = err.to_string();
            let lower = msg.to_ascii_lowercase();
            msg.contains("CUDA_ERROR_OUT_OF_MEMORY")
                || lower.contains("out of memory")
                || lower.contains("can't allocate memory")
        }
        _ => false,
    }
}

/// The next batch size to try after an out-of-memory failure at `batch_size`:
/// Accelerate's `int(batch_size * 0.9)`.
pub fn reduce_batch_size(batch_size: usize) -> usize {
    (batch_size as f64 * 0.9) as usize
}

/// Calls `f(batch_size)` starting at `starting_batch_size`; while it fails
/// with an out-of-memory error ([`is_out_of_memory`]) it retries with
/// [`reduce_batch_size`] (128, 115, 103, 92, ...). Any other error is returned
/// at once.
///
/// ```
/// use accel_core::{find_executable_batch_size, Error};
/// let mut tried = vec![];
/// let bs = find_executable_batch_size(128, |bs| {
///     tried.push(bs);
///     if bs > 100 {
///         return Err(Error::OutOfMemory { what: format!("batch of {bs}") });
///     }
///     Ok(bs)
/// }).unwrap();
/// assert_eq!(tried, [128, 115, 103, 92]);
/// assert_eq!(bs, 92);
/// ```
///
/// # Errors
/// [`Error::OutOfMemory`] when the batch size reaches 0 (as Accelerate's
/// "No executable batch size found, reached zero."), or the first error of
/// `f` that is not an out-of-memory error.
pub fn find_executable_batch_size<T>(
    starting_batch_size: usize,
    mut f: impl FnMut(usize) -> Result<T>,
) -> Result<T> {
    let mut batch_size = starting_batch_size;
    let mut last = None;
    while batch_size > 0 {
        match f(batch_size) {
            Ok(v) => return Ok(v),
            Err(e) if is_out_of_memory(&e) => {
                tracing::warn!(batch_size, error = %e, "out of memory; retrying with a smaller batch");
                last = Some(e.to_string());
                batch_size = reduce_batch_size(batch_size);
            }
            Err(e) => return Err(e),
        }
    }
    Err(Error::OutOfMemory {
        what: format!(
            "no executable batch size found starting from {starting_batch_size}, reached zero (last error: {})",
            last.as_deref().unwrap_or("none")
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reduction_is_int_of_nine_tenths() {
        let mut seq = vec![128];
        while *seq.last().unwrap() > 80 {
            seq.push(reduce_batch_size(*seq.last().unwrap()));
        }
        // Python: bs = 128; while bs > 80: bs = int(bs * 0.9) -> 115, 103, 92, 82, 73
        assert_eq!(seq, [128, 115, 103, 92, 82, 73]);
        assert_eq!(reduce_batch_size(1), 0);
    }

    #[test]
    fn a_cuda_out_of_memory_message_is_recognised() {
        let e = Error::Candle(candle_core::Error::Msg(
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into(),
        ));
        assert!(is_out_of_memory(&e));
        assert!(!is_out_of_memory(&Error::Usage("out of memory".into())));
    }

    #[test]
    fn other_errors_are_not_retried() {
        let mut calls = 0;
        let r: Result<()> = find_executable_batch_size(64, |_| {
            calls += 1;
            Err(Error::Usage("bad".into()))
        });
        assert!(r.is_err());
        assert_eq!(calls, 1);
    }

    #[test]
    fn it_gives_up_at_zero() {
        let mut tried = vec![];
        let r: Result<()> = find_executable_batch_size(3, |bs| {
            tried.push(bs);
            Err(Error::OutOfMemory {
                what: format!("{bs}"),
            })
        });
        assert_eq!(tried, [3, 2, 1]);
        assert!(matches!(r, Err(Error::OutOfMemory { .. })));
    }
}
