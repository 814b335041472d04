//! The capture plan: from what one eager training step did on the device,
//! whether the step can be captured as a CUDA graph and replayed, and which
//! buffers play which part.
//!
//! A pure function over a recorded trace, so every rule is tested without a
//! GPU. The rules are what a replay needs to give the eager step's results:
//!
//! * all work on the capture stream, or on side streams joined back into it
//!   before the step ends (capture follows the joins);
//! * no host read inside the step: a replay does not stop to hand the host a
//!   value (fp16's inf check and the skipped step must be decided on the
//!   device, the learning rate read from a device scalar);
//! * no collective that cannot be captured (the backend says which);
//! * no persistent buffer allocated inside the step: parameters, gradient
//!   accumulators and optimizer state must exist before capture (the warm-up
//!   steps create lazy state) and are updated in place;
//! * no parameter replaced by a new buffer (a `Var` set to another tensor);
//! * the next batch has the shapes and dtypes the step was captured with.
//!
//! What breaks a rule is a [`Fallback`] naming the cause; the step then runs
//! eagerly, with one warning, never a wrong result.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// A device buffer, as the recorder numbers them.
pub type BufId = u64;
/// A stream, as the recorder numbers them.
pub type StreamId = u32;

/// One thing the step did on the device, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A buffer was allocated (from the stream-ordered pool).
    Alloc {
        /// The buffer.
        buf: BufId,
        /// Its size.
        bytes: usize,
    },
    /// A buffer was freed.
    Free {
        /// The buffer.
        buf: BufId,
    },
    /// A kernel (or a device-side copy) was enqueued.
    Launch {
        /// The kernel, for messages.
        name: String,
        /// The stream it was enqueued on.
        stream: StreamId,
        /// The buffers it reads.
        reads: Vec<BufId>,
        /// The buffers it writes.
        writes: Vec<BufId>,
    },
    /// `to` waits for the work enqueued so far on `from` (an event join).
    Join {
        /// The stream waited for.
        from: StreamId,
        /// The stream that waits.
        to: StreamId,
    },
    /// The host read a device value (a `to_scalar`, `to_vec`, device-to-host
    /// copy or stream synchronisation).
    HostRead {
        /// Which value, for the warning.
        what: String,
    },
    /// A collective on the communicator.
    Collective {
        /// The collective.
        name: String,
        /// Whether the backend can capture it.
        capturable: bool,
    },
    /// A parameter was replaced by another buffer.
    ParameterReplaced {
        /// The parameter.
        name: String,
    },
}

/// The shapes and dtypes of the step's inputs, compared before each replay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Signature(
    /// Each input's shape and dtype name.
    pub Vec<(Vec<usize>, String)>,
);

/// One recorded eager step.
#[derive(Clone, Debug)]
pub struct StepTrace {
    /// The stream the graph would be captured on.
    pub capture_stream: StreamId,
    /// The buffers alive before the step (parameters, gradients, optimizer
    /// state, the input buffers).
    pub alive_before: BTreeSet<BufId>,
    /// The buffers the batch is copied into before each replay.
    pub inputs: Vec<BufId>,
    /// The buffers the step hands back (the loss).
    pub outputs: Vec<BufId>,
    /// What happened, in order.
    pub events: Vec<Event>,
}

/// Why a step runs eagerly instead of as a graph.
#[derive(Clone, Debug, PartialEq)]
pub enum Fallback {
    /// The host read a device value inside the step.
    HostRead {
        /// Which value.
        what: String,
    },
    /// A collective the backend cannot capture.
    Collective {
        /// The collective.
        name: String,
    },
    /// Work on a side stream that was not joined back before the step ended.
    UnjoinedStream {
        /// The side stream.
        stream: StreamId,
        /// Its last kernel not joined back.
        kernel: String,
    },
    /// A buffer allocated inside the step outlives it without being an
    /// output: state created lazily, which a replay would not create again.
    PersistentAllocation {
        /// The buffer.
        buf: BufId,
        /// Its size.
        bytes: usize,
    },
    /// A parameter was replaced by another buffer.
    ParameterReplaced {
        /// The parameter.
        name: String,
    },
    /// An input buffer was not alive before the step (the batch must be
    /// copied into fixed buffers).
    InputNotPreallocated {
        /// The buffer.
        buf: BufId,
    },
    /// A kernel used a buffer that was neither alive before the step nor
    /// allocated in it (a use after free, or a recorder gap).
    UnknownBuffer {
        /// The buffer.
        buf: BufId,
        /// The kernel that used it.
        kernel: String,
    },
    /// The batch's shapes or dtypes differ from the captured ones.
    ShapeChanged {
        /// What the step was captured for.
        captured: Signature,
        /// What the batch is now.
        now: Signature,
    },
}

impl fmt::Display for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::HostRead { what } => {
                write!(f, "the step reads a device value on the host ({what})")
            }
            Self::Collective { name } => {
                write!(
                    f,
                    "the collective {name} cannot be captured by this backend"
                )
            }
            Self::UnjoinedStream { stream, kernel } => write!(
                f,
                "{kernel} runs on stream {stream}, which is not joined back before the step ends"
            ),
            Self::PersistentAllocation { buf, bytes } => write!(
                f,
                "buffer {buf} ({bytes} bytes) is allocated in the step and outlives it: state \
                 created lazily (run a warm-up step first)"
            ),
            Self::ParameterReplaced { name } => {
                write!(f, "parameter {name} was replaced by another tensor")
            }
            Self::InputNotPreallocated { buf } => {
                write!(f, "input buffer {buf} did not exist before the step")
            }
            Self::UnknownBuffer { buf, kernel } => {
                write!(
                    f,
                    "{kernel} uses buffer {buf}, which is not alive in the step"
                )
            }
            Self::ShapeChanged { captured, now } => write!(
                f,
                "the batch is {:?}, the step was captured for {:?}",
                now.0, captured.0
            ),
        }
    }
}

/// What a capture needs to know about the step's buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CapturePlan {
    /// Filled from the batch before each replay.
    pub inputs: Vec<BufId>,
    /// Handed back after each replay.
    pub outputs: Vec<BufId>,
    /// Alive across steps and updated in place (parameters, gradients,
    /// optimizer state): allocated outside the graph.
    pub persistent: Vec<BufId>,
    /// Allocated and freed inside the step: the graph's own memory.
    pub temporaries: Vec<BufId>,
    /// Kernels the graph replays.
    pub launches: usize,
    /// Streams the step used besides the capture stream (all joined back).
    pub side_streams: Vec<StreamId>,
}

/// Decides whether `trace` can be captured, and how.
///
/// # Errors
/// The first [`Fallback`] in the trace's order.
pub fn plan(trace: &StepTrace) -> Result<CapturePlan, Fallback> {
    for &buf in &trace.inputs {
        if !trace.alive_before.contains(&buf) {
            return Err(Fallback::InputNotPreallocated { buf });
        }
    }
    let mut alive: BTreeSet<BufId> = trace.alive_before.clone();
    let mut allocated: BTreeMap<BufId, usize> = BTreeMap::new();
    let mut temporaries = Vec::new();
    let mut touched_before: BTreeSet<BufId> = BTreeSet::new();
    // Per side stream: the last kernel not yet joined back into the capture stream.
    let mut pending: BTreeMap<StreamId, String> = BTreeMap::new();
    let mut side_streams = BTreeSet::new();
    let mut launches = 0;
    for event in &trace.events {
        match event {
            Event::Alloc { buf, bytes } => {
                alive.insert(*buf);
                allocated.insert(*buf, *bytes);
            }
            Event::Free { buf } => {
                alive.remove(buf);
                if allocated.remove(buf).is_some() {
                    temporaries.push(*buf);
                }
            }
            Event::Launch {
                name,
                stream,
                reads,
                writes,
            } => {
                launches += 1;
                for &buf in reads.iter().chain(writes) {
                    if !alive.contains(&buf) {
                        let kernel = name.clone();
                        return Err(Fallback::UnknownBuffer { buf, kernel });
                    }
                    if trace.alive_before.contains(&buf) {
                        touched_before.insert(buf);
                    }
                }
                if *stream != trace.capture_stream {
                    side_streams.insert(*stream);
                    pending.insert(*stream, name.clone());
                }
            }
            Event::Join { from, to } => {
                if *to == trace.capture_stream {
                    pending.remove(from);
                } else if let Some(kernel) = pending.get(from).cloned() {
                    // Joined into another side stream: pending there now.
                    pending.insert(*to, kernel);
                    pending.remove(from);
                }
            }
            Event::HostRead { what } => return Err(Fallback::HostRead { what: what.clone() }),
            Event::Collective { name, capturable } => {
                if !capturable {
                    return Err(Fallback::Collective { name: name.clone() });
                }
                launches += 1;
            }
            Event::ParameterReplaced { name } => {
                return Err(Fallback::ParameterReplaced { name: name.clone() })
            }
        }
    }
    if let Some((&stream, kernel)) = pending.iter().next() {
        let kernel = kernel.clone();
        return Err(Fallback::UnjoinedStream { stream, kernel });
    }
    for (&buf, &bytes) in &allocated {
        if !trace.outputs.contains(&buf) {
            return Err(Fallback::PersistentAllocation { buf, bytes });
        }
    }
    let persistent = touched_before
        .into_iter()
        .filter(|b| !trace.inputs.contains(b))
        .collect();
    Ok(CapturePlan {
        inputs: trace.inputs.clone(),
        outputs: trace.outputs.clone(),
        persistent,
        temporaries,
        launches,
        side_streams: side_streams.into_iter().collect(),
    })
}

/// Checks the next batch against the captured one.
///
/// # Errors
/// [`Fallback::ShapeChanged`] when any shape or dtype differs.
pub fn same_signature(captured: &Signature, now: &Signature) -> Result<(), Fallback> {
    match captured == now {
        true => Ok(()),
        false => Err(Fallback::ShapeChanged {
            captured: captured.clone(),
            now: now.clone(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAIN: StreamId = 0;
    const SIDE: StreamId = 1;

    fn launch(name: &str, stream: StreamId, reads: &[BufId], writes: &[BufId]) -> Event {
        Event::Launch {
            name: name.into(),
            stream,
            reads: reads.to_vec(),
            writes: writes.to_vec(),
        }
    }

    /// A training step: input 1 and parameter 2 alive before, gradient 3 and
    /// Adam state 4 alive before; activations 10-11 temporary; loss 12 out.
    fn step(extra: Vec<Event>) -> StepTrace {
        let mut events = vec![
            Event::Alloc { buf: 10, bytes: 64 },
            launch("linear_fwd", MAIN, &[1, 2], &[10]),
            Event::Alloc { buf: 12, bytes: 4 },
            launch("loss", MAIN, &[10], &[12]),
            Event::Alloc { buf: 11, bytes: 64 },
            launch("loss_bwd", MAIN, &[10, 12], &[11]),
            launch("linear_bwd", MAIN, &[1, 11], &[3]),
            Event::Free { buf: 10 },
            Event::Free { buf: 11 },
            launch("adamw", MAIN, &[3], &[2, 4]),
        ];
        events.extend(extra);
        StepTrace {
            capture_stream: MAIN,
            alive_before: [1, 2, 3, 4].into(),
            inputs: vec![1],
            outputs: vec![12],
            events,
        }
    }

    #[test]
    fn a_plain_step_is_planned_with_each_buffer_in_its_part() {
        let p = plan(&step(vec![])).unwrap();
        assert_eq!(p.inputs, [1]);
        assert_eq!(p.outputs, [12]);
        assert_eq!(p.persistent, [2, 3, 4]);
        assert_eq!(p.temporaries, [10, 11]);
        assert_eq!(p.launches, 5);
        assert!(p.side_streams.is_empty());
    }

    #[test]
    fn side_streams_are_captured_when_joined_back_and_refused_when_not() {
        let joined = step(vec![
            Event::Join {
                from: MAIN,
                to: SIDE,
            },
            launch("grad_allreduce_copy", SIDE, &[3], &[3]),
            Event::Join {
                from: SIDE,
                to: MAIN,
            },
        ]);
        assert_eq!(plan(&joined).unwrap().side_streams, [SIDE]);
        // Joined through a second side stream still counts.
        let chained = step(vec![
            launch("copy", SIDE, &[3], &[3]),
            Event::Join { from: SIDE, to: 2 },
            Event::Join { from: 2, to: MAIN },
        ]);
        assert!(plan(&chained).is_ok());
        let loose = step(vec![launch("grad_copy", SIDE, &[3], &[3])]);
        let err = plan(&loose).unwrap_err();
        assert_eq!(
            err,
            Fallback::UnjoinedStream {
                stream: SIDE,
                kernel: "grad_copy".into()
            }
        );
        assert!(err.to_string().contains("not joined back"), "{err}");
    }

    #[test]
    fn every_fallback_cause_is_named() {
        let cases: Vec<(StepTrace, Fallback, &str)> = vec![
            (
                step(vec![Event::HostRead {
                    what: "GradScaler found_inf".into(),
                }]),
                Fallback::HostRead {
                    what: "GradScaler found_inf".into(),
                },
                "reads a device value on the host (GradScaler found_inf)",
            ),
            (
                step(vec![Event::Collective {
                    name: "all_reduce".into(),
                    capturable: false,
                }]),
                Fallback::Collective {
                    name: "all_reduce".into(),
                },
                "all_reduce cannot be captured",
            ),
            (
                step(vec![
                    Event::Alloc {
                        buf: 20,
                        bytes: 256,
                    },
                    launch("adam_state_init", MAIN, &[], &[20]),
                ]),
                Fallback::PersistentAllocation {
                    buf: 20,
                    bytes: 256,
                },
                "run a warm-up step first",
            ),
            (
                step(vec![Event::ParameterReplaced {
                    name: "lm_head.weight".into(),
                }]),
                Fallback::ParameterReplaced {
                    name: "lm_head.weight".into(),
                },
                "lm_head.weight was replaced",
            ),
            (
                step(vec![launch("stale", MAIN, &[10], &[])]),
                Fallback::UnknownBuffer {
                    buf: 10,
                    kernel: "stale".into(),
                },
                "stale uses buffer 10",
            ),
        ];
        for (trace, want, text) in cases {
            let got = plan(&trace).unwrap_err();
            assert_eq!(got, want);
            assert!(got.to_string().contains(text), "{got}");
        }
        // A capturable collective is part of the graph.
        let nccl = step(vec![Event::Collective {
            name: "all_reduce".into(),
            capturable: true,
        }]);
        assert_eq!(plan(&nccl).unwrap().launches, 6);
        // The batch must land in buffers that exist before the step.
        let mut fresh_input = step(vec![]);
        fresh_input.inputs = vec![99];
        assert_eq!(
            plan(&fresh_input).unwrap_err(),
            Fallback::InputNotPreallocated { buf: 99 }
        );
    }

    #[test]
    fn the_first_cause_in_step_order_is_the_one_reported() {
        let trace = step(vec![
            Event::HostRead {
                what: "loss.to_scalar".into(),
            },
            Event::ParameterReplaced { name: "w".into() },
        ]);
        assert!(matches!(plan(&trace), Err(Fallback::HostRead { .. })));
    }

    #[test]
    fn a_changed_batch_shape_or_dtype_is_a_fallback() {
        let captured = Signature(vec![(vec![8, 1024], "u32".into())]);
        assert!(same_signature(&captured, &captured.clone()).is_ok());
        for now in [
            Signature(vec![(vec![8, 512], "u32".into())]),
            Signature(vec![(vec![8, 1024], "i64".into())]),
            Signature(vec![]),
        ] {
            let err = same_signature(&captured, &now).unwrap_err();
            assert!(err.to_string().contains("was captured for"), "{err}");
        }
    }
}
