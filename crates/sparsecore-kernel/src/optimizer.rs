//! The backward pass with a fused optimizer update (SPEC 6.3): the gradient of every table row
//! referenced by a valid slot, accumulated over all slots (duplicates across samples included),
//! then one per-row optimizer step. Rows never referenced are unchanged.

use std::collections::BTreeMap;

use ndarray::{Array1, Array2, ArrayView2};

use super::forward::for_each_slot;
use super::StackedTable;
use crate::error::{KernelError, PlanItem, Result, Subject};
use sparsecore_prep::spec::Plan;
use sparsecore_prep::StackOutput;

/// An optimizer and its hyper-parameters (SPEC 6.3, with the reference's defaults in the docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Optimizer {
    /// `w -= lr · g`.
    Sgd {
        /// Learning rate (0.001).
        lr: f32,
    },
    /// `a += g²; w -= lr · g / √a` (accumulator starts at 0.1).
    Adagrad {
        /// Learning rate.
        lr: f32,
    },
    /// Adagrad with momentum (slots: accumulator 0.1, momentum 0).
    AdagradMomentum {
        /// Learning rate.
        lr: f32,
        /// μ (0.9).
        momentum: f32,
        /// β₂ (1.0: plain sum of squares).
        beta2: f32,
        /// ε (1e-10).
        epsilon: f32,
        /// k (2.0): the accumulator's root.
        exponent: f32,
        /// Nesterov momentum.
        use_nesterov: bool,
    },
    /// Adam (slots m, v start at 0), with the bias corrections of step `step` folded in as the
    /// reference does: `α = lr·√(1−β₂ᵗ)/(1−β₁ᵗ)`, `ε̂ = ε·√(1−β₂ᵗ)`, `t = step + 1`.
    Adam {
        /// Learning rate.
        lr: f32,
        /// β₁ (0.9).
        beta1: f32,
        /// β₂ (0.999).
        beta2: f32,
        /// ε (1e-8).
        epsilon: f32,
        /// The step (0-based).
        step: u32,
    },
    /// FTRL (slots: accumulator 0.1, linear 0).
    Ftrl {
        /// λ, the learning rate (0.01).
        lr: f32,
        /// k (−0.5).
        lr_power: f32,
        /// γ₁ (0).
        l1: f32,
        /// γ₂ (0).
        l2: f32,
        /// β (0).
        beta: f32,
        /// The reference's `multiply_linear_by_learning_rate`.
        multiply_linear_by_lr: bool,
    },
    /// LaProp (slots mu, nu start at 0); `decay = b2·(1 − b2^step)/(1 − b2^(step+1))`.
    Laprop {
        /// Learning rate.
        lr: f32,
        /// b1 (0.9).
        b1: f32,
        /// b2 (0.95).
        b2: f32,
        /// eps (1e-30).
        eps: f32,
        /// The step, or `None` (then `decay = b2`).
        step: Option<u32>,
    },
}

impl Optimizer {
    /// Slot variables and their initial values.
    pub fn slot_inits(&self) -> &'static [f32] {
        match self {
            Optimizer::Sgd { .. } => &[],
            Optimizer::Adagrad { .. } => &[0.1],
            Optimizer::AdagradMomentum { .. } => &[0.1, 0.0],
            Optimizer::Adam { .. } | Optimizer::Laprop { .. } => &[0.0, 0.0],
            Optimizer::Ftrl { .. } => &[0.1, 0.0],
        }
    }

    /// Names of the slot variables, in [`Optimizer::slot_inits`] order (they name the slots of
    /// dynamic tables in shared stores).
    pub fn slot_names(&self) -> &'static [&'static str] {
        match self {
            Optimizer::Sgd { .. } => &[],
            Optimizer::Adagrad { .. } => &["accumulator"],
            Optimizer::AdagradMomentum { .. } => &["accumulator", "momentum"],
            Optimizer::Adam { .. } => &["m", "v"],
            Optimizer::Laprop { .. } => &["mu", "nu"],
            Optimizer::Ftrl { .. } => &["accumulator", "linear"],
        }
    }

    fn hyper(&self) -> Vec<(&'static str, f32)> {
        match *self {
            Optimizer::Sgd { lr } | Optimizer::Adagrad { lr } => vec![("lr", lr)],
            Optimizer::AdagradMomentum {
                lr,
                momentum,
                beta2,
                epsilon,
                exponent,
                ..
            } => {
                vec![
                    ("lr", lr),
                    ("momentum", momentum),
                    ("beta2", beta2),
                    ("epsilon", epsilon),
                    ("exponent", exponent),
                ]
            }
            Optimizer::Adam {
                lr,
                beta1,
                beta2,
                epsilon,
                ..
            } => vec![
                ("lr", lr),
                ("beta1", beta1),
                ("beta2", beta2),
                ("epsilon", epsilon),
            ],
            Optimizer::Ftrl {
                lr,
                lr_power,
                l1,
                l2,
                beta,
                ..
            } => {
                vec![
                    ("lr", lr),
                    ("lr_power", lr_power),
                    ("l1", l1),
                    ("l2", l2),
                    ("beta", beta),
                ]
            }
            Optimizer::Laprop {
                lr, b1, b2, eps, ..
            } => vec![("lr", lr), ("b1", b1), ("b2", b2), ("eps", eps)],
        }
    }

    /// Rejects non-finite hyper-parameters (and a zero FTRL learning rate, a divisor).
    pub fn validate(&self) -> Result<()> {
        for (name, v) in self.hyper() {
            if !v.is_finite() {
                return Err(KernelError::parameter(
                    "optimizer",
                    format!("{name} = {v}"),
                    "hyper-parameters must be finite",
                ));
            }
        }
        if let Optimizer::Ftrl { lr, .. } = self {
            if *lr == 0.0 {
                return Err(KernelError::parameter(
                    "optimizer",
                    "lr = 0",
                    "FTRL divides by its learning rate",
                ));
            }
        }
        Ok(())
    }

    /// One step on one row: `w` and `slots` updated in place from the gradient `g`.
    pub fn apply(&self, g: &[f32], w: &mut [f32], slots: &mut [&mut [f32]]) {
        match *self {
            Optimizer::Sgd { lr } => {
                for (w, g) in w.iter_mut().zip(g) {
                    *w -= lr * g;
                }
            }
            Optimizer::Adagrad { lr } => {
                // Zipped iterators, not indices: no bounds checks, so the loop vectorises (the
                // same operations in the same order, so the same bits).
                for ((w, a), &g) in w.iter_mut().zip(slots[0].iter_mut()).zip(g) {
                    *a += g * g;
                    *w -= lr * g / a.sqrt();
                }
            }
            Optimizer::AdagradMomentum {
                lr,
                momentum,
                beta2,
                epsilon,
                exponent,
                use_nesterov,
            } => {
                let (a, rest) = slots.split_at_mut(1);
                let (a, m) = (&mut a[0], &mut rest[0]);
                for i in 0..w.len() {
                    a[i] = if beta2 == 1.0 {
                        a[i] + g[i] * g[i]
                    } else {
                        beta2 * a[i] + (1.0 - beta2) * g[i] * g[i]
                    };
                    let s = (a[i] + epsilon).powf(-1.0 / exponent) * g[i];
                    m[i] = momentum * m[i] + s;
                    let u = if use_nesterov {
                        momentum * m[i] + s
                    } else {
                        m[i]
                    };
                    w[i] -= lr * u;
                }
            }
            Optimizer::Adam {
                lr,
                beta1,
                beta2,
                epsilon,
                step,
            } => {
                let t = u64::from(step) + 1;
                let c2 = (1.0 - pow_steps(beta2, t)).sqrt();
                let alpha = lr * c2 / (1.0 - pow_steps(beta1, t));
                let eps = epsilon * c2;
                let (m, rest) = slots.split_at_mut(1);
                let (m, v) = (&mut m[0], &mut rest[0]);
                for i in 0..w.len() {
                    m[i] += (1.0 - beta1) * (g[i] - m[i]);
                    v[i] += (1.0 - beta2) * (g[i] * g[i] - v[i]);
                    w[i] -= alpha * m[i] / (v[i].sqrt() + eps);
                }
            }
            Optimizer::Ftrl {
                lr,
                lr_power,
                l1,
                l2,
                beta,
                multiply_linear_by_lr,
            } => {
                let (acc, rest) = slots.split_at_mut(1);
                let (acc, lin) = (&mut acc[0], &mut rest[0]);
                for i in 0..w.len() {
                    let a_new = acc[i] + g[i] * g[i];
                    let p_old = acc[i].powf(-lr_power);
                    let p_new = a_new.powf(-lr_power);
                    let dp = p_new - p_old;
                    lin[i] = if multiply_linear_by_lr {
                        lin[i] + lr * g[i] - dp * w[i]
                    } else {
                        lin[i] + g[i] - (dp / lr) * w[i]
                    };
                    let l1s = l1 * if multiply_linear_by_lr { lr } else { 1.0 };
                    let num = if l1 == 0.0 {
                        -lin[i]
                    } else {
                        lin[i].clamp(-l1s, l1s) - lin[i]
                    };
                    let den = if multiply_linear_by_lr {
                        p_new + 2.0 * lr * l2 + beta
                    } else {
                        (p_new + beta) / lr + 2.0 * l2
                    };
                    w[i] = num / den;
                    acc[i] = a_new;
                }
            }
            Optimizer::Laprop {
                lr,
                b1,
                b2,
                eps,
                step,
            } => {
                let decay = match step {
                    None => b2,
                    Some(s) => {
                        b2 * (1.0 - pow_steps(b2, u64::from(s)))
                            / (1.0 - pow_steps(b2, u64::from(s) + 1))
                    }
                };
                let (mu, rest) = slots.split_at_mut(1);
                let (mu, nu) = (&mut mu[0], &mut rest[0]);
                for i in 0..w.len() {
                    let q = g[i] * g[i] + eps;
                    nu[i] = decay * nu[i] + (1.0 - decay) * q;
                    let u = g[i] / nu[i].sqrt();
                    mu[i] = b1 * mu[i] + (1.0 - b1 * b1).sqrt() * u;
                    w[i] -= lr * mu[i];
                }
            }
        }
    }
}

/// `base` to the power of a step count. `powi` (repeated squaring, the bits the kernels have
/// always given) while the count fits its `i32`; past that, where a step of 2^31 or more used to
/// wrap to a negative power, `powf` (any base below 1 has long reached 0 there).
fn pow_steps(base: f32, n: u64) -> f32 {
    match i32::try_from(n) {
        Ok(n) => base.powi(n),
        Err(_) => base.powf(n as f32),
    }
}

/// A stacked table's optimizer slots, stored beside it in the same `[N · R, D]` layout.
#[derive(Debug, Clone, PartialEq)]
pub struct Slots {
    /// One array per slot variable.
    pub values: Vec<Array2<f32>>,
}

impl Slots {
    /// Slots for `table` initialised for `optimizer`.
    pub fn new(table: &StackedTable, optimizer: &Optimizer) -> Self {
        Slots {
            values: optimizer
                .slot_inits()
                .iter()
                .map(|&v| Array2::from_elem(table.data.dim(), v))
                .collect(),
        }
    }
}

/// The gradient of every referenced row: `Σ gains[i] · dact[s·bsps + sample_ids[i]]` over all
/// valid slots of all local devices, keyed by physical row, in ascending row order.
pub fn row_gradients(
    plan: &Plan,
    out: &StackOutput,
    num_minibatches: usize,
    table: &StackedTable,
    activation_grads: &[ArrayView2<'_, f32>],
) -> Result<BTreeMap<usize, Array1<f32>>> {
    if table.stack != out.name {
        return Err(KernelError::plan(
            PlanItem::Stack,
            &out.name,
            format!(
                "the table given is stack `{}`'s, not this stack's",
                table.stack
            ),
        ));
    }
    if activation_grads.len() != plan.layout.local_devices {
        return Err(KernelError::input(
            Subject::Stack(table.stack.clone()),
            format!(
                "{} activation gradients for {} local devices (one per device)",
                activation_grads.len(),
                plan.layout.local_devices
            ),
        ));
    }
    // Exactly the forward pass's shape, `[bsd, D]` per device.
    if let Some(sp) = plan.stack(&table.stack) {
        let bsd = (sp.total_sample_count / plan.layout.global_devices as u64) as usize;
        if let Some((d, g)) = activation_grads
            .iter()
            .enumerate()
            .find(|(_, g)| g.dim() != (bsd, table.dim))
        {
            return Err(KernelError::input(
                Subject::Stack(table.stack.clone()),
                format!("activation gradient of device {d} has shape {:?}, expected the activations' [{bsd}, {}]", g.dim(), table.dim),
            ));
        }
    }
    let mut grads: BTreeMap<usize, Array1<f32>> = BTreeMap::new();
    for_each_slot(
        plan,
        out,
        num_minibatches,
        table,
        |d, act_row, p, e, gain| {
            let dact = &activation_grads[d];
            if act_row >= dact.nrows() || dact.ncols() != table.dim {
                return Err(KernelError::input(
                    Subject::Stack(table.stack.clone()),
                    format!(
                        "activation gradient of device {d} is {:?}, expected [>{act_row}, {}]",
                        dact.dim(),
                        table.dim
                    ),
                ));
            }
            let row = p * table.rows_per_shard + e;
            let g = grads.entry(row).or_insert_with(|| Array1::zeros(table.dim));
            g.scaled_add(gain, &dact.row(act_row));
            Ok(())
        },
    )?;
    Ok(grads)
}

/// Backward pass and one optimizer step on `table` and its `slots`.
///
/// `activation_grads` holds one gradient per local device, each of the activations' shape
/// `[bsd, D]` ([`crate::sparse_dense_matmul`]'s; [`crate::stack_feature_gradients`] builds it
/// from per-feature gradients). Errors, with the table and slots left unchanged: non-finite
/// hyper-parameters (naming the hyper-parameter); slots that are not the optimizer's (naming
/// the stack and the slot variables it needs); activation gradients of the wrong count or shape,
/// a table of another stack or of the wrong shape, ids outside the shard (naming the stack).
pub fn apply_gradients(
    plan: &Plan,
    out: &StackOutput,
    num_minibatches: usize,
    activation_grads: &[ArrayView2<'_, f32>],
    optimizer: &Optimizer,
    table: &mut StackedTable,
    slots: &mut Slots,
) -> Result<()> {
    optimizer.validate()?;
    // Rows are updated as slices: a column-major (Fortran-order) table or slot has none.
    if !table.data.is_standard_layout() || slots.values.iter().any(|s| !s.is_standard_layout()) {
        return Err(KernelError::plan(
            PlanItem::Stack,
            &table.stack,
            "the table and its slot variables must be row-major (C order) arrays",
        ));
    }
    let names = optimizer.slot_names();
    if slots.values.len() != names.len() || slots.values.iter().any(|s| s.dim() != table.data.dim())
    {
        let got: Vec<_> = slots.values.iter().map(|s| s.dim()).collect();
        return Err(KernelError::plan(
            PlanItem::Stack,
            &table.stack,
            format!(
                "the optimizer needs {} slot variables ({}) of the table's shape {:?}, got {} of shapes {got:?} (Slots::new makes them)",
                names.len(),
                if names.is_empty() { "none".to_string() } else { names.join(", ") },
                table.data.dim(),
                slots.values.len()
            ),
        ));
    }
    let grads = row_gradients(plan, out, num_minibatches, table, activation_grads)?;
    for (row, g) in grads {
        let g = g.as_slice().expect("contiguous gradient");
        let mut w = table.data.row_mut(row);
        let w = w.as_slice_mut().expect("row-major table");
        let mut slot_rows: Vec<&mut [f32]> = slots
            .values
            .iter_mut()
            .map(|s| s.row_mut(row).into_slice().expect("row-major slots"))
            .collect();
        optimizer.apply(g, w, &mut slot_rows);
    }
    Ok(())
}
