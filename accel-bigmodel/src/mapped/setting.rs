//! `ACCEL_MMAP_WEIGHTS`, and whether loads map tensors at all.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// Whether loads map tensors: [`super::MappedAlloc`] is the global allocator and
/// `ACCEL_MMAP_WEIGHTS` does not turn it off (`0`, `false`, `no`, `off`).
///
/// The variable is read once, at the first load (loaders ask for every
/// weight of every offloaded block on every forward). A setting that asks
/// for mapping where it cannot act (no allocator) or that is not a yes/no
/// word is named in a warning, once.
pub fn enabled() -> bool {
    static SETTING: OnceLock<Option<String>> = OnceLock::new();
    static WARNED: AtomicBool = AtomicBool::new(false);
    let installed = super::INSTALLED.load(Ordering::Relaxed);
    let setting = SETTING.get_or_init(|| std::env::var("ACCEL_MMAP_WEIGHTS").ok());
    let (on, notice) = read_setting(setting.as_deref(), installed);
    if let Some(notice) = notice {
        if !WARNED.swap(true, Ordering::Relaxed) {
            let value = setting.as_deref().unwrap_or_default();
            tracing::warn!("ACCEL_MMAP_WEIGHTS={value} {notice}");
        }
    }
    installed && on
}

pub(super) const NO_ALLOCATOR: &str = "has no effect: this program does not install \
    accel_bigmodel::MappedAlloc as its global allocator, so weights are read into memory";
pub(super) const NOT_A_WORD: &str =
    "is not 0/1, false/true, no/yes or off/on; weights are mapped where possible";

/// `ACCEL_MMAP_WEIGHTS` read: whether it lets loads map, and what to warn.
pub(super) fn read_setting(value: Option<&str>, installed: bool) -> (bool, Option<&'static str>) {
    let word = value.map(|v| v.trim().to_ascii_lowercase());
    match word.as_deref() {
        None => (true, None),
        Some("0" | "false" | "no" | "off") => (false, None),
        Some("1" | "true" | "yes" | "on") => (true, (!installed).then_some(NO_ALLOCATOR)),
        Some(_) => (true, Some(NOT_A_WORD)),
    }
}
