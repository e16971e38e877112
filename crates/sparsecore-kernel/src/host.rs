//! Host embedding tables split across replicas, as IPU host embeddings do: `Token` splits the
//! rows (row r on replica r mod R), `Encoding` splits the columns (⌈D/R⌉ per replica, the last
//! padded). Lookups and optimizer updates through either split equal the unsplit table's
//! exactly, because every operation is per row and per element.

use std::collections::BTreeMap;

use ndarray::{s, Array1, Array2, ArrayView2};

use super::optimizer::{Optimizer, Slots};
use crate::error::{KernelError, Result, Subject};

/// How a table is split across replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Partition {
    /// Rows: row `r` lives on replica `r mod R`, at index `r div R`.
    Token,
    /// Columns: replica `k` holds columns `[k·c, (k+1)·c)`, `c = ⌈D/R⌉`, zero-padded.
    Encoding,
}

/// A `[rows, dim]` table (and its optimizer slots) split across `R` replicas.
#[derive(Debug, Clone, PartialEq)]
pub struct PartitionedTable {
    /// The split.
    pub partition: Partition,
    rows: usize,
    dim: usize,
    /// Per replica: the table part, then one part per slot variable.
    replicas: Vec<Vec<Array2<f32>>>,
}

impl PartitionedTable {
    /// Splits `table` and `slots` (same shape as `table`) over `replicas` replicas.
    pub fn new<'a>(
        table: ArrayView2<'a, f32>,
        slots: &'a Slots,
        partition: Partition,
        replicas: usize,
    ) -> Result<Self> {
        if replicas == 0 {
            return Err(KernelError::parameter("replicas", 0, "must be at least 1"));
        }
        if slots.values.iter().any(|s| s.dim() != table.dim()) {
            return Err(KernelError::parameter(
                "slots",
                slots.values.len(),
                "slots must have the table's shape",
            ));
        }
        let (rows, dim) = table.dim();
        let arrays: Vec<ArrayView2<'a, f32>> = std::iter::once(table)
            .chain(slots.values.iter().map(|s| s.view()))
            .collect();
        let parts = (0..replicas)
            .map(|k| {
                arrays
                    .iter()
                    .map(|a| match partition {
                        Partition::Token => {
                            let mine: Vec<usize> = (k..rows).step_by(replicas).collect();
                            let mut p = Array2::<f32>::zeros((mine.len(), dim));
                            for (i, &r) in mine.iter().enumerate() {
                                p.row_mut(i).assign(&a.row(r));
                            }
                            p
                        }
                        Partition::Encoding => {
                            let c = dim.div_ceil(replicas);
                            let (lo, hi) = ((k * c).min(dim), ((k + 1) * c).min(dim));
                            let mut p = Array2::<f32>::zeros((rows, c));
                            p.slice_mut(s![.., ..hi - lo])
                                .assign(&a.slice(s![.., lo..hi]));
                            p
                        }
                    })
                    .collect()
            })
            .collect();
        Ok(PartitionedTable {
            partition,
            rows,
            dim,
            replicas: parts,
        })
    }

    /// Replicas.
    pub fn replicas(&self) -> usize {
        self.replicas.len()
    }

    /// Row `r` of array `a` (0 = the table, 1.. = slots), gathered from the replicas.
    fn gather(&self, a: usize, r: usize) -> Array1<f32> {
        let n = self.replicas.len();
        match self.partition {
            Partition::Token => self.replicas[r % n][a].row(r / n).to_owned(),
            Partition::Encoding => {
                let c = self.dim.div_ceil(n);
                let mut out = Array1::zeros(self.dim);
                for (k, rep) in self.replicas.iter().enumerate() {
                    let (lo, hi) = ((k * c).min(self.dim), ((k + 1) * c).min(self.dim));
                    out.slice_mut(s![lo..hi])
                        .assign(&rep[a].slice(s![r, ..hi - lo]));
                }
                out
            }
        }
    }

    /// The table's row `r` (a lookup).
    pub fn row(&self, r: usize) -> Result<Array1<f32>> {
        if r >= self.rows {
            return Err(KernelError::input(
                Subject::HostTable,
                format!("row {r} is outside the table of {} rows", self.rows),
            ));
        }
        Ok(self.gather(0, r))
    }

    /// One optimizer step on every row with a gradient, each replica updating its own part.
    ///
    /// Errors, before any row changes: non-finite hyper-parameters, slots that are not the
    /// optimizer's (the table was split with another optimizer's slots), a row outside the
    /// table or a gradient of another length.
    pub fn apply_gradients(
        &mut self,
        grads: &BTreeMap<usize, Array1<f32>>,
        optimizer: &Optimizer,
    ) -> Result<()> {
        optimizer.validate()?;
        let names = optimizer.slot_names();
        let have = self.replicas.first().map_or(0, |r| r.len() - 1);
        if have != names.len() {
            return Err(KernelError::input(
                Subject::HostTable,
                format!(
                    "split with {have} slot variables, but the optimizer needs {} ({})",
                    names.len(),
                    if names.is_empty() {
                        "none".to_string()
                    } else {
                        names.join(", ")
                    }
                ),
            ));
        }
        if let Some((&r, g)) = grads
            .iter()
            .find(|(&r, g)| r >= self.rows || g.len() != self.dim)
        {
            return Err(KernelError::input(
                Subject::HostTable,
                format!(
                    "gradient for row {r} of length {} does not fit {}x{}",
                    g.len(),
                    self.rows,
                    self.dim
                ),
            ));
        }
        let n = self.replicas.len();
        let c = self.dim.div_ceil(n);
        for (&r, g) in grads {
            if r >= self.rows || g.len() != self.dim {
                return Err(KernelError::input(
                    Subject::HostTable,
                    format!(
                        "gradient for row {r} of length {} does not fit {}x{}",
                        g.len(),
                        self.rows,
                        self.dim
                    ),
                ));
            }
            // A strided view of a caller's array is copied; a contiguous one is read in place.
            let g: std::borrow::Cow<'_, [f32]> = match g.as_slice() {
                Some(g) => g.into(),
                None => g.to_vec().into(),
            };
            match self.partition {
                Partition::Token => step(&mut self.replicas[r % n], r / n, &g, optimizer),
                Partition::Encoding => {
                    for (k, rep) in self.replicas.iter_mut().enumerate() {
                        let (lo, hi) = ((k * c).min(self.dim), ((k + 1) * c).min(self.dim));
                        // The replica's columns of the gradient, zero-padded like its part.
                        let mut part = vec![0.0f32; c];
                        part[..hi - lo].copy_from_slice(&g[lo..hi]);
                        step(rep, r, &part, optimizer);
                    }
                }
            }
        }
        Ok(())
    }

    /// The whole table (array 0) or slot `a - 1`, reassembled. `a` must be below one plus the
    /// number of slot variables the table was split with.
    pub fn to_dense(&self, a: usize) -> Result<Array2<f32>> {
        let arrays = self.replicas.first().map_or(0, Vec::len);
        if a >= arrays {
            let reason = match arrays {
                0 | 1 => {
                    "must be 0 (the table): the table was split without slot variables".to_string()
                }
                _ => format!(
                    "must be below {arrays}: 0 is the table, 1..={} its slot variables",
                    arrays - 1
                ),
            };
            return Err(KernelError::parameter("array", a, reason));
        }
        let mut out = Array2::zeros((self.rows, self.dim));
        for r in 0..self.rows {
            out.row_mut(r).assign(&self.gather(a, r));
        }
        Ok(out)
    }
}

fn step(parts: &mut [Array2<f32>], row: usize, g: &[f32], optimizer: &Optimizer) {
    let (table, slots) = parts.split_first_mut().expect("the table part exists");
    let mut w = table.row_mut(row);
    let mut slot_rows: Vec<&mut [f32]> = slots
        .iter_mut()
        .map(|s| s.row_mut(row).into_slice().expect("row-major"))
        .collect();
    optimizer.apply(g, w.as_slice_mut().expect("row-major"), &mut slot_rows);
}
