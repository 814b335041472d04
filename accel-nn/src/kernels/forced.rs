//! A kernel choice forced on the calling thread while a closure runs
//! (`with_bf16_path`, `with_quant_path`): benchmarks and tests compare the
//! paths of one CPU in one process with it.

use std::cell::Cell;
use std::thread::LocalKey;

/// The value forced on this thread, if any.
pub(crate) fn forced<T: Copy + 'static>(key: &'static LocalKey<Cell<Option<T>>>) -> Option<T> {
    key.with(Cell::get)
}

/// Runs `f` with `value` forced on this thread, restoring what was there
/// before afterwards, also when `f` panics.
pub(crate) fn with_forced<T: Copy + 'static, R>(
    key: &'static LocalKey<Cell<Option<T>>>,
    value: T,
    f: impl FnOnce() -> R,
) -> R {
    struct Restore<T: Copy + 'static> {
        key: &'static LocalKey<Cell<Option<T>>>,
        before: Option<T>,
    }
    impl<T: Copy + 'static> Drop for Restore<T> {
        fn drop(&mut self) {
            self.key.with(|c| c.set(self.before));
        }
    }
    let _restore = Restore {
        key,
        before: key.with(|c| c.replace(Some(value))),
    };
    f()
}
