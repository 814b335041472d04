//! A cut graph is never silent. Two checks:
//!
//! * at start-up, a one-op probe that candle-nn's fused norm has a backward
//!   in this build. Upstream candle-nn 0.11 builds its fused norms, softmax
//!   and rotary embeddings without one, so every parameter below them gets
//!   no gradient while the loss still falls (candle #2168); this workspace
//!   patches candle-nn, but cargo applies a patch only at the top of the
//!   user's workspace, so a user's crate may still build the upstream one.
//! * after the first backward that reaches a prepared model (or the fourth
//!   that reaches none of it: a loss that depends on none of its
//!   parameters), its trainable parameters that received no gradient are
//!   named: a warning in one
//!   process; at more than one rank an error, as PyTorch's DDP, unless
//!   `DdpConfig::find_unused_parameters` accepts them.

use std::sync::OnceLock;

use accel_dist::ReduceOp;
use candle_core::{Device, Tensor, Var};

use super::Accelerator;
use crate::{Error, Result};

/// How many parameter names a report lists before "and N more".
const NAMES_SHOWN: usize = 5;

/// Backwards after which a model that no backward has reached is reported
/// whole: its loss may depend on none of its parameters (a graph cut above
/// all of them). Models that take turns (a GAN's two) are reached sooner.
const REACH_WITHIN: u64 = 4;

/// The lines a user's `Cargo.toml` needs for the patched candle crates.
pub(crate) const PATCH_LINES: &str = "[patch.crates-io]\n\
     candle-core = { git = \"<accel-rs repository>\" }\n\
     candle-nn = { git = \"<accel-rs repository>\" }\n\
     candle-transformers = { git = \"<accel-rs repository>\" }";

/// True when `op` applied to a small variable passes a gradient back to it.
pub(crate) fn passes_gradient(op: impl Fn(&Tensor) -> candle_core::Result<Tensor>) -> bool {
    let run = || -> candle_core::Result<bool> {
        let x = Var::new(&[[1f32, 2.0, 4.0]], &Device::Cpu)?;
        let w = Tensor::new(&[1f32, 2.0, 3.0], &Device::Cpu)?;
        let grads = op(x.as_tensor())?
            .broadcast_mul(&w)?
            .sum_all()?
            .backward()?;
        Ok(grads.get(x.as_tensor()).is_some())
    };
    run().unwrap_or(false)
}

/// The one-op probe: does candle-nn's fused `layer_norm` pass a gradient back?
fn fused_norm_passes_gradient() -> bool {
    passes_gradient(|x| {
        let (w, b) = (x.ones_like()?.squeeze(0)?, x.zeros_like()?.squeeze(0)?);
        candle_nn::ops::layer_norm(x, &w, &b, 1e-5)
    })
}

/// The start-up warning when candle-nn's fused ops have no backward here.
pub(crate) fn candle_nn_notice(fused_norm_has_backward: bool) -> Option<String> {
    (!fused_norm_has_backward).then(|| {
        format!(
            "this build's candle-nn has no backward for its fused layer_norm, rms_norm, \
             softmax_last_dim and rope ops: models built on them (candle-transformers' BERT, \
             Llama, ...) train only the parameters above them. Add the patched candle crates to \
             the top-level Cargo.toml of your workspace:\n{PATCH_LINES}"
        )
    })
}

/// Runs the probe once per process and warns when it fails.
pub(crate) fn check_candle_nn_backward() {
    static CHECKED: OnceLock<()> = OnceLock::new();
    CHECKED.get_or_init(|| {
        let ok = fused_norm_passes_gradient();
        if let Some(msg) = candle_nn_notice(ok) {
            crate::notice::warn(&msg);
        }
    });
}

/// The names in `names`, the first few, then how many more.
fn listed(names: &[String]) -> String {
    let shown = names[..names.len().min(NAMES_SHOWN)].join(", ");
    match names.len().saturating_sub(NAMES_SHOWN) {
        0 => shown,
        more => format!("{shown} and {more} more"),
    }
}

/// The sentence naming the ops without a backward that the forwards so far
/// applied to tensors carrying a gradient (`cuts`: each op's name and count,
/// from the patched candle-core's `cuts::recorded`); empty without any.
fn cuts_sentence(cuts: &[(&str, u64)]) -> String {
    if cuts.is_empty() {
        return String::new();
    }
    let named: Vec<String> = cuts
        .iter()
        .map(|(name, n)| format!("`{name}` ({n} time{})", if *n == 1 { "" } else { "s" }))
        .collect();
    format!(
        " The graph was cut by ops without a backward applied to tensors that carry a \
         gradient: {}.",
        named.join(", ")
    )
}

/// The report for `unreached`, the trainable parameters of model `model`
/// that no backward reached at this rank; `never` when no backward reached
/// the model at all within [`REACH_WITHIN`]; `cuts` the ops that cut the
/// graph in this process's forwards (see [`cuts_sentence`]).
pub(crate) fn unused_report(
    model: usize,
    rank: usize,
    unreached: &[String],
    never: bool,
    cuts: &[(&str, u64)],
) -> String {
    let when = if never {
        format!("in {REACH_WITHIN} backwards, none of which reached the model,")
    } else {
        "in its first backward".to_string()
    };
    format!(
        "{} trainable parameter(s) of prepared model {model} received no gradient {when} at rank \
         {rank}: {}. A layer the forward skips, or an op without backward cutting the graph, \
         leaves them untrained. Freeze them on purpose with `prepare_model_frozen`; at more than \
         one rank, `DdpConfig::find_unused_parameters` (`ddp_find_unused_parameters`) accepts them.{}",
        unreached.len(),
        listed(unreached),
        cuts_sentence(cuts)
    )
}

impl Accelerator {
    /// After a backward: the no-gradient report of each model that a
    /// backward reached for the first time (at any rank), or that none
    /// reached in [`REACH_WITHIN`] backwards. At more than one rank every
    /// rank takes part in one small all-reduce per backward until every
    /// model was reported, so all of them decide alike.
    pub(super) fn report_unused_parameters(&mut self) -> Result<()> {
        self.backwards += 1;
        let pending: Vec<(usize, (bool, usize))> = (self.models.iter().enumerate())
            .filter_map(|(i, m)| Some((i, m.reach_summary()?)))
            .collect();
        if pending.is_empty() {
            return Ok(());
        }
        let mut seen: Vec<f64> = pending
            .iter()
            .flat_map(|(_, (any, n))| [f64::from(u8::from(*any)), *n as f64])
            .collect();
        if self.num_processes() > 1 {
            self.comm
                .all_reduce((&mut seen[..]).into(), ReduceOp::Max)?;
        }
        let mut error = None;
        for (k, (i, _)) in pending.into_iter().enumerate() {
            let (reached_somewhere, most_unreached) = (seen[2 * k] > 0.0, seen[2 * k + 1]);
            if !reached_somewhere && self.backwards < REACH_WITHIN {
                continue;
            }
            let model = &self.models[i];
            model.set_unused_checked();
            if most_unreached == 0.0 {
                continue;
            }
            let unreached = model.unreached_parameters();
            let (rank, never) = (self.process_index(), !reached_somewhere);
            let report =
                || unused_report(i, rank, &unreached, never, &candle_core::cuts::recorded());
            let strict = self.num_processes() > 1 && !self.config.ddp.find_unused_parameters;
            if strict {
                error.get_or_insert(Error::UnusedParameters {
                    rank,
                    report: if unreached.is_empty() {
                        format!(
                            "prepared model {i}: another rank's backward left up to \
                             {most_unreached} trainable parameter(s) without a gradient \
                             (see its error); at more than one rank that is an error unless \
                             `DdpConfig::find_unused_parameters` accepts it"
                        )
                    } else {
                        report()
                    },
                });
            } else if !unreached.is_empty() {
                crate::notice::warn(&report());
            }
        }
        error.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_sees_this_workspaces_patched_candle_nn_backward() {
        let fused = fused_norm_passes_gradient();
        assert!(
            fused,
            "the patched candle-nn's layer_norm passes a gradient"
        );
        assert_eq!(candle_nn_notice(fused), None);
        // A cut graph, as upstream's no-backward ops make one.
        assert!(!passes_gradient(|x| Ok(x.detach())));
        let msg = candle_nn_notice(false).expect("a warning");
        assert!(msg.contains("[patch.crates-io]") && msg.contains("candle-nn = { git"));
    }

    #[test]
    fn a_report_names_the_first_parameters_and_counts_the_rest() {
        let names: Vec<String> = (0..7).map(|i| format!("layer.{i}.weight")).collect();
        let msg = unused_report(0, 1, &names, false, &[]);
        assert!(
            msg.starts_with("7 trainable parameter(s) of prepared model 0"),
            "{msg}"
        );
        assert!(msg.contains("at rank 1: layer.0.weight, layer.1.weight, layer.2.weight, layer.3.weight, layer.4.weight and 2 more."), "{msg}");
        assert_eq!(listed(&names[..2]), "layer.0.weight, layer.1.weight");
        assert!(!msg.contains("was cut by"), "{msg}");
        let msg = unused_report(0, 0, &names, false, &[("rotary-emb", 4), ("layer-norm", 1)]);
        assert!(
            msg.ends_with(
                "The graph was cut by ops without a backward applied to tensors that carry a \
                 gradient: `rotary-emb` (4 times), `layer-norm` (1 time)."
            ),
            "{msg}"
        );
    }
}
