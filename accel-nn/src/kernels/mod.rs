//! Fused CPU kernels with hand-written backward passes.
