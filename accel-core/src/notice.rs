//! Warnings a user must see even without a `tracing` subscriber: a training
//! run that silently loses gradients is the worst outcome, so these go to
//! standard error when no subscriber would show them.

/// Warns through `tracing` when a subscriber is installed, else on stderr.
pub(crate) fn warn(msg: &str) {
    if tracing::dispatcher::has_been_set() {
        tracing::warn!("{msg}");
    } else {
        eprintln!("warning: {msg}");
    }
}
