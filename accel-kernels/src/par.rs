//! Data parallelism on candle's CPU thread pool, for these kernels and
//! accel-nn's.
//!
//! Why candle's pool and not rayon's: candle runs its own element-wise ops
//! (a model's residual adds, and the zero fill and add of every gradient in
//! its backward) on that pool, whose workers spin for a while after each op
//! before they park. Work on a second pool then shares the cores with a
//! spinning worker; on candle's it runs on the threads that would spin.
//! Measured on 2 cores (`bench_train`, rows alternating in one run): the
//! GPT training step's kernels moved from rayon took its forward+backward
//! from 245-256 to 206-211 ms, and the optimizer pass moved likewise took
//! the MLP from 376 to 431-443 steps/s.
//!
//! `CANDLE_NUM_THREADS` sets the pool's size, else `RAYON_NUM_THREADS`,
//! else the physical cores (candle's rule). A call made from inside a
//! parallel section (a kernel calling another) runs on the calling thread:
//! candle's pool is not re-entrant.

use std::cell::Cell;
use std::sync::Mutex;

thread_local! {
    /// Set while this thread runs a part of a parallel section.
    static INSIDE: Cell<bool> = const { Cell::new(false) };
    /// A thread count imposed on this thread by [`with_threads`] (0: none).
    static IMPOSED: Cell<usize> = const { Cell::new(0) };
}

/// Threads a parallel section started here runs on (1 inside one already).
pub fn threads() -> usize {
    if INSIDE.with(Cell::get) {
        return 1;
    }
    match IMPOSED.with(Cell::get) {
        0 => candle_core::utils::barrier_pool().n_workers() + 1,
        n => n,
    }
}

/// Runs `f` as if the pool had `n` threads: serially for 1; for any other
/// `n` work is split as it would be for `n` threads (and runs on the pool's
/// real threads). For tests and benchmarks that compare thread counts.
pub fn with_threads<R>(n: usize, f: impl FnOnce() -> R) -> R {
    struct Restore(usize);
    impl Drop for Restore {
        fn drop(&mut self) {
            IMPOSED.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(IMPOSED.with(|c| c.replace(n)));
    f()
}

/// Runs `f(i)` for every `i < n` over the pool's threads and returns when
/// all are done. Items are handed out from a shared cursor, so a thread the
/// OS preempts does not hold the others back.
///
/// A panic in `f` is caught on its thread and re-raised here, after the
/// section: unwinding through candle's pool would poison the lock it takes
/// per call, and every later element-wise op of the process would panic.
pub fn for_each(n: usize, f: impl Fn(usize) + Sync) {
    if n <= 1 || threads() <= 1 {
        (0..n).for_each(f);
        return;
    }
    let panicked = Mutex::new(None);
    candle_core::utils::barrier_pool().execute_chunked(n, |range| {
        let _inside = Inside::enter();
        let run = std::panic::AssertUnwindSafe(|| range.for_each(&f));
        if let Err(payload) = std::panic::catch_unwind(run) {
            let mut first = panicked.lock().unwrap_or_else(|e| e.into_inner());
            first.get_or_insert(payload);
        }
    });
    let payload = panicked.into_inner().unwrap_or_else(|e| e.into_inner());
    if let Some(payload) = payload {
        std::panic::resume_unwind(payload)
    }
}

/// `f(item)` for every item, in parallel, results in the items' order.
pub fn map<T: Send, R: Send>(items: Vec<T>, f: impl Fn(T) -> R + Sync) -> Vec<R> {
    let slots: Vec<Mutex<Option<T>>> = items.into_iter().map(|t| Mutex::new(Some(t))).collect();
    let out: Vec<Mutex<Option<R>>> = slots.iter().map(|_| Mutex::new(None)).collect();
    for_each(slots.len(), |i| {
        let item = take(&slots[i]).expect("each item is taken once");
        let r = f(item);
        *out[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
    });
    out.iter()
        .map(|slot| take(slot).expect("every item ran"))
        .collect()
}

fn take<T>(slot: &Mutex<Option<T>>) -> Option<T> {
    slot.lock().unwrap_or_else(|e| e.into_inner()).take()
}

/// Marks this thread as inside a parallel section until dropped (also when
/// `f` panics, so a caught panic does not leave the thread serial).
struct Inside(bool);

impl Inside {
    fn enter() -> Self {
        Self(INSIDE.with(|c| c.replace(true)))
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        INSIDE.with(|c| c.set(self.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_keeps_the_order_and_nested_sections_run_inline() {
        let out = map((0..100).collect(), |i: usize| {
            // A nested section runs on this thread instead of deadlocking.
            let inner = map(vec![1, 2, 3], |x: usize| x * i);
            inner.iter().sum::<usize>()
        });
        assert_eq!(out, (0..100).map(|i| 6 * i).collect::<Vec<_>>());
        assert_eq!(with_threads(1, threads), 1);
        assert_eq!(with_threads(5, threads), 5);
    }

    #[test]
    fn a_panic_in_a_parallel_section_reaches_the_caller_and_leaves_the_pool_working() {
        let caught = std::panic::catch_unwind(|| {
            with_threads(2, || for_each(64, |i| assert!(i != 40, "item {i} failed")))
        });
        let msg = caught.unwrap_err();
        let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains("item 40 failed"), "{msg}");
        // candle's own parallel ops and ours still run afterwards.
        let dev = candle_core::Device::Cpu;
        let t = candle_core::Tensor::ones(1 << 20, candle_core::DType::F32, &dev).unwrap();
        let sum = (&t + &t).unwrap().sum_all().unwrap();
        assert_eq!(sum.to_scalar::<f32>().unwrap(), 2.0 * (1 << 20) as f32);
        assert_eq!(map(vec![1, 2], |x: i32| x + 1), vec![2, 3]);
    }
}
