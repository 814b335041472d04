//! Where a forward cut the graph (accel-rs patch, docs/design/candle-core-patch.md).
//!
//! An op without a backward (`apply_op*_no_bwd`) applied to a tensor that carries a gradient
//! stops every gradient below it, and nothing fails: the parameters above still train (upstream
//! candle-nn's fused norms and rotary embeddings did exactly that). Each such cut is counted here
//! by the op's name, so a report of parameters that got no gradient can say which ops cut them
//! off. Ops run inside `Tensor::backward` (a backward pass builds its gradients with the same
//! calls) are not cuts and are not counted. `detach` is not counted: code detaches on purpose
//! (a softmax's stabilising maximum, recomputed blocks), so a count would not point at a fault.

use std::cell::Cell;
use std::sync::Mutex;

/// Distinct names kept; later new names are dropped (their count is lost, not the others').
const KEPT: usize = 32;

static CUTS: Mutex<Vec<(&'static str, u64)>> = Mutex::new(Vec::new());

thread_local! {
    static IN_BACKWARD: Cell<bool> = const { Cell::new(false) };
}

/// Counts a cut by `name`, unless the calling thread is inside a backward pass.
pub(crate) fn record(name: &'static str) {
    if IN_BACKWARD.with(Cell::get) {
        return;
    }
    let mut cuts = CUTS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, count)) = cuts.iter_mut().find(|(n, _)| *n == name) {
        *count += 1;
    } else if cuts.len() < KEPT {
        cuts.push((name, 1));
    }
}

/// The cuts counted since the process started or [`clear`] was last called: each op's name and
/// how many times it cut, in the order first seen.
pub fn recorded() -> Vec<(&'static str, u64)> {
    CUTS.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Forgets the counted cuts.
pub fn clear() {
    CUTS.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

/// Marks the calling thread as inside a backward pass until dropped.
pub(crate) struct BackwardScope {
    outer: bool,
}

impl BackwardScope {
    pub(crate) fn enter() -> Self {
        Self {
            outer: IN_BACKWARD.with(|b| b.replace(true)),
        }
    }
}

impl Drop for BackwardScope {
    fn drop(&mut self) {
        IN_BACKWARD.with(|b| b.set(self.outer));
    }
}
