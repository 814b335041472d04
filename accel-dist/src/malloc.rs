//! glibc `malloc` settings for training loops.
//!
//! Why: a candle training step allocates and frees the same large buffers
//! every step (activations, gradients, the zeros candle's backward adds
//! gradients into). With glibc's defaults, buffers above the dynamic mmap
//! threshold come from fresh `mmap`s, and freed memory at the top of the
//! heap is handed back to the kernel once it exceeds the trim threshold; the
//! next step then faults every page in again, zeroed, with TLB shootdowns
//! across the pool threads. Measured on the 784-512-512-10 MLP (batch 64,
//! 2 cores): backward 3.6-5.9 ms and candle's AdamW 25 ms per step with the
//! defaults, 1.35 ms and 2.8 ms with both settings below; either one alone
//! does not help (`examples/profile_gpt.rs`, 3 Dec 2026).
//!
//! [`tune_for_training`] sets `M_MMAP_THRESHOLD` to its largest value
//! (32 MiB on 64-bit glibc: larger buffers still map and unmap) and
//! `M_TRIM_THRESHOLD` to 1 GiB, so the heap keeps what a step freed for
//! the next. The cost is resident memory: up to 1 GiB freed at the top of
//! the heap stays mapped. It acts only on Linux with glibc, and does
//! nothing when the user chose: `ACCEL_MALLOC_TUNING=0`, or any of glibc's
//! own `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, `GLIBC_TUNABLES`.
//! The Accelerator applies it at construction and says so at start-up.
#![allow(unsafe_code)]

/// The variable that turns the tuning off (`0`).
pub const ENV_MALLOC_TUNING: &str = "ACCEL_MALLOC_TUNING";

/// glibc's largest mmap threshold on 64-bit targets (`4 * 1024 * 1024 * sizeof(long)`).
pub const MMAP_THRESHOLD: usize = 32 << 20;
/// The trim threshold set: freed memory kept at the top of the heap.
pub const TRIM_THRESHOLD: usize = 1 << 30;

/// What [`tune_for_training`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MallocTuning {
    /// Both thresholds were set.
    Applied,
    /// Left alone because the user set this variable.
    UserChoice(&'static str),
    /// Not glibc on Linux: nothing to do.
    Unsupported,
    /// glibc refused a setting (named).
    Refused(&'static str),
}

/// The variables that mean the user chose the allocator settings.
const USER_VARS: [&str; 4] = [
    ENV_MALLOC_TUNING,
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "GLIBC_TUNABLES",
];

/// Which user variable (looked up by `var`) leaves the allocator alone.
fn user_choice(var: impl Fn(&str) -> Option<String>) -> Option<&'static str> {
    USER_VARS.into_iter().find(|&name| match var(name) {
        Some(v) if name == ENV_MALLOC_TUNING => v.trim() == "0",
        Some(_) => true,
        None => false,
    })
}

/// Sets glibc's mmap and trim thresholds for a training process (see the
/// module docs); process-wide, idempotent.
pub fn tune_for_training() -> MallocTuning {
    if let Some(var) = user_choice(|n| std::env::var(n).ok()) {
        return MallocTuning::UserChoice(var);
    }
    set_thresholds()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_thresholds() -> MallocTuning {
    // SAFETY: `mallopt` only changes allocator parameters; glibc takes its
    // own lock, so it may run while other threads allocate. Both values are
    // within the ranges glibc accepts (it returns 0 otherwise, checked).
    let mmap = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int) };
    if mmap != 1 {
        return MallocTuning::Refused("M_MMAP_THRESHOLD");
    }
    // SAFETY: as above.
    let trim = unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD as libc::c_int) };
    if trim != 1 {
        return MallocTuning::Refused("M_TRIM_THRESHOLD");
    }
    MallocTuning::Applied
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_thresholds() -> MallocTuning {
    MallocTuning::Unsupported
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_setting_wins_and_zero_turns_the_tuning_off() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |n: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == n)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(user_choice(env(&[])), None);
        assert_eq!(user_choice(env(&[(ENV_MALLOC_TUNING, "1")])), None);
        assert_eq!(
            user_choice(env(&[(ENV_MALLOC_TUNING, "0")])),
            Some(ENV_MALLOC_TUNING)
        );
        assert_eq!(
            user_choice(env(&[("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")])),
            Some("GLIBC_TUNABLES")
        );
        assert_eq!(
            user_choice(env(&[("MALLOC_TRIM_THRESHOLD_", "1")])),
            Some("MALLOC_TRIM_THRESHOLD_")
        );
    }

    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_takes_both_thresholds() {
        // Idempotent: a second call sets the same values.
        assert_eq!(set_thresholds(), MallocTuning::Applied);
        assert_eq!(set_thresholds(), MallocTuning::Applied);
    }
}
