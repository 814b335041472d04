//! Fused optimizer steps: AdamW and SGD, one pass over every parameter.
//!
//! Each element goes through exactly the operations of PyTorch's
//! single-tensor implementation, in the same order and in f32, with no
//! fused multiply-adds (Rust never contracts `a * b + c` on its own), so
//! the result is reproducible bit for bit against a plain scalar loop.

use super::{map_bundles, read_float_as_f32, Plan};
use crate::hyperparams::{AdamWScalars, SgdScalars};
use crate::slices::FloatSlice;

/// The operands of AdamW for one run of elements: param, exp_avg,
/// exp_avg_sq (written) and grad (read).
pub(crate) type AdamWPiece<'a> = (&'a mut [f32], &'a mut [f32], &'a mut [f32], FloatSlice<'a>);

/// The operands of SGD for one run of elements: param and momentum buffer
/// (written; no buffer without momentum) and grad (read).
pub(crate) type SgdPiece<'a> = (&'a mut [f32], (Option<&'a mut [f32]>, FloatSlice<'a>));

/// One AdamW update of `p`, `m` (exp_avg), `v` (exp_avg_sq) from `g`, all
/// of equal length.
pub(crate) fn adamw_f32(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], s: &AdamWScalars) {
    let (apply_decay, decay) = (s.decay.is_some(), s.decay.unwrap_or(1.0));
    // `torch.lerp` switches formula at |weight| = 0.5 to stay accurate.
    let small_weight = s.w1.abs() < 0.5;
    let one_minus_w1 = 1.0 - s.w1;
    for (((p, m), v), &g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
        let mut pv = *p;
        if apply_decay {
            pv *= decay;
        }
        // exp_avg.lerp_(grad, 1 - beta1)
        let mv = if small_weight {
            *m + s.w1 * (g - *m)
        } else {
            g - (g - *m) * one_minus_w1
        };
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        let vv = *v * s.beta2 + s.c2 * g * g;
        // (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        let denom = vv.sqrt() / s.bc2_sqrt + s.eps;
        // param.addcdiv_(exp_avg, denom, value=-step_size)
        *p = pv - s.step_size * mv / denom;
        *m = mv;
        *v = vv;
    }
}

/// Fused AdamW over every (param, exp_avg, exp_avg_sq, grad) piece of the
/// list in one pass; gradients of any float type are widened on the fly.
pub(crate) fn adamw(pieces: Vec<AdamWPiece<'_>>, s: &AdamWScalars, plan: Plan) {
    map_bundles(pieces, plan, |bundle| {
        for (p, m, v, g) in bundle {
            read_float_as_f32(g, |off, gb| {
                let r = off..off + gb.len();
                adamw_f32(&mut p[r.clone()], &mut m[r.clone()], &mut v[r], gb, s);
            });
        }
    });
}

/// One SGD update of `p` from `g`, with the momentum buffer `buf` when
/// momentum is on.
pub(crate) fn sgd_f32(p: &mut [f32], mut buf: Option<&mut [f32]>, g: &[f32], s: &SgdScalars) {
    for (i, (p, &g)) in p.iter_mut().zip(g).enumerate() {
        let mut d = g;
        if let Some(wd) = s.weight_decay {
            // grad = grad.add(param, alpha=weight_decay)
            d += wd * *p;
        }
        if let (Some(mom), Some(buf)) = (s.momentum, buf.as_deref_mut()) {
            // First step: buf = grad.clone(); later: buf.mul_(momentum)
            // .add_(grad, alpha=1 - dampening).
            let b = if s.first {
                d
            } else {
                buf[i] * mom + s.one_minus_dampening * d
            };
            buf[i] = b;
            d = if s.nesterov { d + mom * b } else { b };
        }
        // param.add_(grad, alpha=-lr)
        *p -= s.lr * d;
    }
}

/// Fused SGD over every (param, momentum buffer, grad) piece of the list.
pub(crate) fn sgd(pieces: Vec<SgdPiece<'_>>, s: &SgdScalars, plan: Plan) {
    map_bundles(pieces, plan, |bundle| {
        for (p, (mut buf, g)) in bundle {
            read_float_as_f32(g, |off, gb| {
                let r = off..off + gb.len();
                let b = buf.as_deref_mut().map(|b| &mut b[r.clone()]);
                sgd_f32(&mut p[r], b, gb, s);
            });
        }
    });
}
