//! What the Trainer keeps across a checkpoint, and the dataset adapter that
//! tells it how many samples each batch holds.

use serde::{Deserialize, Serialize};

use crate::checkpoint::{Checkpointable, StateDict};
use crate::data::Dataset;
use crate::{Error, Result};

/// The Trainer's progress, saved with every checkpoint (as transformers'
/// `trainer_state.json`) as `custom_checkpoint_0.json`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps taken.
    pub global_step: u64,
    /// Sum of the micro-batch losses since the last log (so a resumed run
    /// logs the same averages as an uninterrupted one).
    pub window_loss: f64,
    /// Micro-batches in that sum.
    pub window_batches: u64,
}

impl Checkpointable for TrainerState {
    fn state_dict(&self) -> Result<StateDict> {
        Ok(StateDict::from_meta(
            serde_json::to_value(self).expect("trainer state serializes"),
        ))
    }

    fn load_state_dict(&mut self, state: StateDict) -> Result<()> {
        *self = serde_json::from_value(state.meta).map_err(|e| Error::Config {
            key: "custom_checkpoint_0 (trainer state)".into(),
            reason: e.to_string(),
        })?;
        Ok(())
    }
}

/// A dataset whose batches also carry their sample count, so evaluation can
/// weight a batch's mean loss by its size without knowing the batch type.
pub(crate) struct Counted<D>(pub D);

impl<D: Dataset> Dataset for Counted<D> {
    type Batch = (usize, D::Batch);

    fn len(&self) -> usize {
        self.0.len()
    }

    fn get_batch(&self, indices: &[usize]) -> Result<Self::Batch> {
        Ok((indices.len(), self.0.get_batch(indices)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trainer_state_round_trips_through_a_state_dict() {
        let s = TrainerState {
            global_step: 12,
            window_loss: 0.75,
            window_batches: 3,
        };
        let mut back = TrainerState::default();
        back.load_state_dict(s.state_dict().unwrap()).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn a_state_without_the_fields_is_rejected() {
        let mut s = TrainerState::default();
        let bad = StateDict::from_meta(serde_json::json!({"step": 1}));
        assert!(s.load_state_dict(bad).is_err());
    }
}
