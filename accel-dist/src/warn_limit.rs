//! Warnings about strays and refused connections, at most one per
//! [`WARN_EVERY`]: a flood of strays must not become a flood of log lines.
//! The first is printed at once; the next one printed says how many were
//! held back, and [`Warnings::flush`] says it when the flood is over.

use std::time::{Duration, Instant};

/// The least time between two printed warnings of one limiter.
pub(crate) const WARN_EVERY: Duration = Duration::from_secs(5);

/// One rate limiter (the store's; each rank's mesh listener).
#[derive(Default)]
pub(crate) struct Warnings {
    last: Option<Instant>,
    held_back: usize,
}

impl Warnings {
    /// Prints `msg` as a warning unless one was printed in the last
    /// [`WARN_EVERY`].
    pub(crate) fn warn(&mut self, msg: String) {
        if let Some(line) = self.admit(Instant::now(), msg) {
            tracing::warn!("{line}");
        }
    }

    /// What [`Self::warn`] prints at `now`, if anything.
    fn admit(&mut self, now: Instant, msg: String) -> Option<String> {
        if self.last.is_some_and(|t| now < t + WARN_EVERY) {
            self.held_back += 1;
            return None;
        }
        self.last = Some(now);
        Some(match std::mem::take(&mut self.held_back) {
            0 => msg,
            n => format!("{msg} ({n} more such warnings held back)"),
        })
    }

    /// Says how many warnings were held back since the last one printed,
    /// if any (`what` names them), and starts afresh.
    pub(crate) fn flush(&mut self, what: &str) {
        if let Some(line) = self.drain(what) {
            tracing::warn!("{line}");
        }
    }

    /// [`Self::flush`] once the period of the last printed warning is over
    /// (called from a loop, so that the count of a flood that stopped is
    /// printed without waiting for another warning).
    pub(crate) fn tick(&mut self, what: &str) {
        if self.held_back > 0 && self.last.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
            self.flush(what);
        }
    }

    fn drain(&mut self, what: &str) -> Option<String> {
        self.last = None;
        match std::mem::take(&mut self.held_back) {
            0 => None,
            n => Some(format!("{n} more {what} warnings were held back")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_warning_per_period_and_the_held_back_are_counted() {
        let mut w = Warnings::default();
        let t0 = Instant::now();
        assert_eq!(w.admit(t0, "a".into()).as_deref(), Some("a"));
        assert_eq!(w.admit(t0 + Duration::from_secs(1), "b".into()), None);
        assert_eq!(w.admit(t0 + Duration::from_secs(4), "c".into()), None);
        let later = t0 + WARN_EVERY;
        assert_eq!(
            w.admit(later, "d".into()).as_deref(),
            Some("d (2 more such warnings held back)")
        );
        assert_eq!(w.admit(later, "e".into()), None);
        assert_eq!(
            w.drain("stray").as_deref(),
            Some("1 more stray warnings were held back")
        );
        assert_eq!(w.drain("stray"), None);
        // After a flush the next warning prints at once.
        assert_eq!(w.admit(later, "f".into()).as_deref(), Some("f"));
    }
}
