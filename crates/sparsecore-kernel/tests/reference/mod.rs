//! An independent reference for one optimizer step on one row, in f64, shared by the kernel's
//! test modules.
//!
//! Written from the reference's published formulas, not from `src/optimizer.rs`: the row-wise
//! update functions of jax-tpu-embedding's `sparse_dense_matmul_grad_with_*` primitives, with
//! the hyper-parameters of its `*OptimizerSpec.get_hyperparameters(step)` (Adam's bias
//! correction, LaProp's decay rate) and the slot initial values of its specs' defaults; the
//! same formulas as `numpy_step` in python/tests/test_kernels.py, except FTRL with
//! `multiply_linear_by_lr` (and its L1 clip at l1·λ), which `numpy_step` lacks and which
//! follows the primitive's code. Only the `Optimizer` enum's fields are read here; no kernel code
//! computes anything.

use sparsecore_kernel::Optimizer;

/// The f32 initial value of each slot, in `slot_names` order (what a fresh slot array must
/// hold, to the bit): Adagrad's accumulator 0.1; AdagradMomentum's accumulator 0.1 and momentum
/// 0; Adam's m and v 0; FTRL's accumulator 0.1 and linear 0; LaProp's mu and nu 0 (the specs'
/// defaults, `jax.nn.initializers.constant` of f32 slot arrays).
pub fn initial_slot_values(opt: &Optimizer) -> Vec<f32> {
    match opt {
        Optimizer::Sgd { .. } => vec![],
        Optimizer::Adagrad { .. } => vec![0.1],
        Optimizer::AdagradMomentum { .. } | Optimizer::Ftrl { .. } => vec![0.1, 0.0],
        Optimizer::Adam { .. } | Optimizer::Laprop { .. } => vec![0.0, 0.0],
    }
}

/// The initial slots of a row of `dim` values, in f64: the f32 values exactly (0.1f32 =
/// 0.100000001490116), as the reference's f32 slot arrays hold them.
pub fn initial_slots(opt: &Optimizer, dim: usize) -> Vec<Vec<f64>> {
    initial_slot_values(opt)
        .into_iter()
        .map(|v| vec![f64::from(v); dim])
        .collect()
}

/// One step on row `w` with gradient `g`, updating `w` and `slots` in place, element by element.
///
/// Returns, for the row and then each slot, the scale each new value was computed at: the sum
/// of the magnitudes of the terms added or subtracted to make it. f32 arithmetic loses a few
/// ulps of that scale, not of the result, when terms cancel (FTRL's linear slot subtracts two
/// close powers of the accumulator), so a tolerance for an f32 step is relative to it.
pub fn step(opt: &Optimizer, g: &[f64], w: &mut [f64], slots: &mut [Vec<f64>]) -> Vec<Vec<f64>> {
    assert_eq!(g.len(), w.len());
    assert_eq!(
        slots.len(),
        initial_slots(opt, 0).len(),
        "{opt:?}: slot count"
    );
    assert!(slots.iter().all(|s| s.len() == w.len()));
    let f = f64::from;
    let mut scales = vec![vec![0.0; w.len()]; 1 + slots.len()];
    match *opt {
        // w ← w − λ·g.
        Optimizer::Sgd { lr } => {
            for i in 0..w.len() {
                let d = f(lr) * g[i];
                scales[0][i] = w[i].abs() + d.abs();
                w[i] -= d;
            }
        }
        // A ← A + g²; w ← w − λ·g/√A.
        Optimizer::Adagrad { lr } => {
            for i in 0..w.len() {
                let a = slots[0][i] + g[i] * g[i];
                let d = f(lr) * g[i] / a.sqrt();
                scales[0][i] = w[i].abs() + d.abs();
                scales[1][i] = a;
                w[i] -= d;
                slots[0][i] = a;
            }
        }
        // A ← A + g² when β₂ = 1, else β₂·A + (1 − β₂)·g²; s = (A + ε)^(−1/k)·g; m ← μ·m + s;
        // w ← w − λ·(μ·m + s) with Nesterov momentum, else w − λ·m.
        Optimizer::AdagradMomentum {
            lr,
            momentum,
            beta2,
            epsilon,
            exponent,
            use_nesterov,
        } => {
            let (lr, mu, b2, eps, k) = (f(lr), f(momentum), f(beta2), f(epsilon), f(exponent));
            for i in 0..w.len() {
                let a = if b2 == 1.0 {
                    slots[0][i] + g[i] * g[i]
                } else {
                    b2 * slots[0][i] + (1.0 - b2) * g[i] * g[i]
                };
                let s = (a + eps).powf(-1.0 / k) * g[i];
                let m = mu * slots[1][i] + s;
                let m_scale = (mu * slots[1][i]).abs() + s.abs();
                let (u, u_scale) = if use_nesterov {
                    (mu * m + s, mu * m_scale + s.abs())
                } else {
                    (m, m_scale)
                };
                scales[0][i] = w[i].abs() + lr * u_scale;
                scales[1][i] = a;
                scales[2][i] = m_scale;
                w[i] -= lr * u;
                slots[0][i] = a;
                slots[1][i] = m;
            }
        }
        // t = step + 1; α = λ·√(1 − β₂ᵗ)/(1 − β₁ᵗ); ε̂ = ε·√(1 − β₂ᵗ);
        // m ← β₁·m + (1 − β₁)·g; v ← β₂·v + (1 − β₂)·g²; w ← w − α·m/(√v + ε̂).
        Optimizer::Adam {
            lr,
            beta1,
            beta2,
            epsilon,
            step,
        } => {
            let (b1, b2) = (f(beta1), f(beta2));
            let t = f64::from(step) + 1.0;
            let c2 = (1.0 - b2.powf(t)).sqrt();
            let alpha = f(lr) * c2 / (1.0 - b1.powf(t));
            let eps = f(epsilon) * c2;
            for i in 0..w.len() {
                let m = b1 * slots[0][i] + (1.0 - b1) * g[i];
                let v = b2 * slots[1][i] + (1.0 - b2) * g[i] * g[i];
                let d = alpha * m / (v.sqrt() + eps);
                scales[0][i] = w[i].abs() + d.abs();
                scales[1][i] = (b1 * slots[0][i]).abs() + ((1.0 - b1) * g[i]).abs();
                scales[2][i] = v;
                w[i] -= d;
                slots[0][i] = m;
                slots[1][i] = v;
            }
        }
        // A' = A + g²; p = A^(−k), p' = A'^(−k) (k = lr_power);
        // L ← L + λ·g − (p' − p)·w with multiply_linear_by_lr, else L + g − (p' − p)/λ·w;
        // w ← (clip(L, −γ₁·s, γ₁·s) − L)/d (or −L/d when γ₁ = 0), s = λ or 1,
        // d = p' + 2·λ·γ₂ + β with multiply_linear_by_lr, else (p' + β)/λ + 2·γ₂.
        Optimizer::Ftrl {
            lr,
            lr_power,
            l1,
            l2,
            beta,
            multiply_linear_by_lr,
        } => {
            let (lr, k, l1, l2, beta) = (f(lr), f(lr_power), f(l1), f(l2), f(beta));
            for i in 0..w.len() {
                let a = slots[0][i];
                let a_new = a + g[i] * g[i];
                let (p, p_new) = (a.powf(-k), a_new.powf(-k));
                let (lin, lin_scale, scale, den) = if multiply_linear_by_lr {
                    let lin = slots[1][i] + lr * g[i] - (p_new - p) * w[i];
                    (
                        lin,
                        slots[1][i].abs() + (lr * g[i]).abs() + (p_new + p) * w[i].abs(),
                        lr,
                        p_new + 2.0 * lr * l2 + beta,
                    )
                } else {
                    let lin = slots[1][i] + g[i] - (p_new - p) / lr * w[i];
                    (
                        lin,
                        slots[1][i].abs() + g[i].abs() + (p_new + p) / lr * w[i].abs(),
                        1.0,
                        (p_new + beta) / lr + 2.0 * l2,
                    )
                };
                let num = if l1 == 0.0 {
                    -lin
                } else {
                    lin.clamp(-l1 * scale, l1 * scale) - lin
                };
                w[i] = num / den;
                // The new weight carries the linear slot's error (the clip adds at most γ₁·s).
                scales[0][i] = (lin_scale + l1 * scale) / den.abs();
                scales[1][i] = a_new;
                scales[2][i] = lin_scale;
                slots[0][i] = a_new;
                slots[1][i] = lin;
            }
        }
        // decay = b2 without a step, else b2·(1 − b2^s)/(1 − b2^(s+1));
        // ν ← decay·ν + (1 − decay)·(g² + eps); μ ← b1·μ + √(1 − b1²)·g/√ν; w ← w − λ·μ.
        Optimizer::Laprop {
            lr,
            b1,
            b2,
            eps,
            step,
        } => {
            let (b1, b2) = (f(b1), f(b2));
            let decay = match step {
                None => b2,
                Some(s) => b2 * (1.0 - b2.powf(f64::from(s))) / (1.0 - b2.powf(f64::from(s) + 1.0)),
            };
            for i in 0..w.len() {
                let nu = decay * slots[1][i] + (1.0 - decay) * (g[i] * g[i] + f(eps));
                let u = (1.0 - b1 * b1).sqrt() * (g[i] / nu.sqrt());
                let mu = b1 * slots[0][i] + u;
                let mu_scale = (b1 * slots[0][i]).abs() + u.abs();
                scales[0][i] = w[i].abs() + f(lr) * mu_scale;
                scales[1][i] = mu_scale;
                scales[2][i] = nu;
                w[i] -= f(lr) * mu;
                slots[0][i] = mu;
                slots[1][i] = nu;
            }
        }
    }
    scales
}

/// Whether an f32 result is within `rtol` (relative) plus `atol` (absolute) of the f64 value.
pub fn near(got: f32, want: f64, rtol: f64, atol: f64) -> bool {
    (f64::from(got) - want).abs() <= rtol * want.abs() + atol
}

/// Whether an f32 result is within `rtol` of the f64 value relative to the `scale` it was
/// computed at (from [`step`]; at least the value's own magnitude), plus `atol`.
pub fn near_scaled(got: f32, want: f64, scale: f64, rtol: f64, atol: f64) -> bool {
    (f64::from(got) - want).abs() <= rtol * scale.max(want.abs()) + atol
}
