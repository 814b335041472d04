//! Which parameters a backward reached: the source of the no-gradient
//! report the Accelerator makes after the first backward that reaches a
//! model (a graph cut by an op without backward, a layer the forward
//! bypasses), and the frozen parameters it leaves out.

use super::PreparedModel;

impl PreparedModel {
    /// Trainable parameters that no backward has reached since the model was
    /// prepared, by name. Frozen parameters are not listed.
    pub fn unreached_parameters(&self) -> Vec<String> {
        let g = self.lock();
        (0..g.names.len())
            .filter(|&i| !g.reached[i] && !g.frozen[i])
            .map(|i| g.names[i].clone())
            .collect()
    }

    /// The parameters kept as they are (see
    /// [`Accelerator::prepare_model_frozen`](crate::Accelerator::prepare_model_frozen)), by name.
    pub fn frozen_parameters(&self) -> Vec<String> {
        let g = self.lock();
        (0..g.names.len())
            .filter(|&i| g.frozen[i])
            .map(|i| g.names[i].clone())
            .collect()
    }

    /// Freezes the parameters whose names `frozen` selects.
    pub(crate) fn freeze_where(&self, frozen: &dyn Fn(&str) -> bool) {
        let mut g = self.lock();
        for i in 0..g.names.len() {
            g.frozen[i] = frozen(&g.names[i]);
        }
    }

    /// While the report is still to be made: whether any backward reached
    /// this model, and how many trainable parameters it did not reach.
    pub(crate) fn reach_summary(&self) -> Option<(bool, usize)> {
        let g = self.lock();
        if g.unused_checked {
            return None;
        }
        let any = g.reached.iter().any(|&r| r);
        let unreached = (0..g.names.len())
            .filter(|&i| !g.reached[i] && !g.frozen[i])
            .count();
        Some((any, unreached))
    }

    /// Marks the report as made.
    pub(crate) fn set_unused_checked(&self) {
        self.lock().unused_checked = true;
    }
}
