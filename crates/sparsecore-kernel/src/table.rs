//! The stacked, sharded table layout (SPEC 4).
//!
//! A stack of vocabulary `V` (Σ padded member vocabularies) and dim `D` is split into `N` shards
//! of `R = V / N` rows. Vocabulary row `v` of a member table with rotation `r` and in-shard
//! offset `o` lives in shard `(v mod N + r) mod N` at row `v div N + o`; shard `g` belongs to
//! device `g / S`, which holds its `S` shards SparseCore-major. The rows addressed this way are
//! exactly the (partition, embedding id) pairs of the buffers.

use ndarray::{Array2, ArrayView2};

use crate::error::{KernelError, PlanItem, Result, Subject};
use sparsecore_prep::spec::{Plan, StackPlan};

/// One stack's table in the kernels' layout: `[N · R, D]`, shard-major.
#[derive(Debug, Clone, PartialEq)]
pub struct StackedTable {
    /// Stack name.
    pub stack: String,
    /// N: shards (global SparseCores).
    pub num_shards: usize,
    /// R: rows per shard.
    pub rows_per_shard: usize,
    /// D: the stack's padded embedding dim.
    pub dim: usize,
    /// `[N · R, D]`; padding rows and columns are 0.
    pub data: Array2<f32>,
}

fn stack_of<'p>(plan: &'p Plan, stack: &str) -> Result<&'p StackPlan> {
    plan.stack(stack)
        .ok_or_else(|| KernelError::plan(PlanItem::Stack, stack, "not in the plan"))
}

impl StackedTable {
    /// Builds a stack from its member tables, in the stack's table order (`StackPlan::tables`),
    /// each `[vocabulary_size, embedding_dim]` as in the config.
    pub fn from_tables(plan: &Plan, stack: &str, tables: &[ArrayView2<'_, f32>]) -> Result<Self> {
        let sp = stack_of(plan, stack)?;
        if tables.len() != sp.tables.len() {
            return Err(KernelError::plan(
                PlanItem::Stack,
                stack,
                format!(
                    "{} tables given for {} member tables",
                    tables.len(),
                    sp.tables.len()
                ),
            ));
        }
        let n = plan.layout.num_partitions();
        let v = sp.stack_vocab_size as usize;
        let d = sp.stack_embedding_dim as usize;
        let r = v / n;
        // Every shape first, then the stacked table, asked of the allocator rather than
        // assumed: a config's vocabulary can describe more than memory holds.
        for (&t, table) in sp.tables.iter().zip(tables) {
            let f = member(plan, sp, t)?;
            let (vocab, dim) = (f.vocabulary_size as usize, table_dim(plan, t));
            if table.dim() != (vocab, dim) {
                return Err(KernelError::plan(
                    PlanItem::Table,
                    &f.table,
                    format!("array of shape {:?}, expected [vocabulary_size, embedding_dim] = [{vocab}, {dim}]", table.dim()),
                ));
            }
        }
        let too_large = || {
            KernelError::plan(
                PlanItem::Stack,
                stack,
                format!("a stacked table of {v} x {d} floats does not fit in memory"),
            )
        };
        let len = v.checked_mul(d).ok_or_else(too_large)?;
        let mut zeros: Vec<f32> = Vec::new();
        zeros.try_reserve_exact(len).map_err(|_| too_large())?;
        zeros.resize(len, 0.0);
        let mut data = Array2::from_shape_vec((v, d), zeros).map_err(|_| too_large())?;
        for (&t, table) in sp.tables.iter().zip(tables) {
            let f = member(plan, sp, t)?;
            let dim = table_dim(plan, t);
            for (row, values) in table.outer_iter().enumerate() {
                let p = physical_row(
                    n,
                    r,
                    f.shard_rotation as usize,
                    f.row_offset_in_shard as usize,
                    row,
                );
                data.row_mut(p)
                    .slice_mut(ndarray::s![..dim])
                    .assign(&values);
            }
        }
        Ok(StackedTable {
            stack: stack.to_string(),
            num_shards: n,
            rows_per_shard: r,
            dim: d,
            data,
        })
    }

    /// Reads member table `table` (a config table index) back out: the exact inverse of
    /// [`StackedTable::from_tables`].
    pub fn table(&self, plan: &Plan, table: usize) -> Result<Array2<f32>> {
        let sp = stack_of(plan, &self.stack)?;
        let f = member(plan, sp, table)?;
        let (vocab, dim) = (f.vocabulary_size as usize, table_dim(plan, table));
        let mut out = Array2::<f32>::zeros((vocab, dim));
        for (row, mut values) in out.outer_iter_mut().enumerate() {
            let p = physical_row(
                self.num_shards,
                self.rows_per_shard,
                f.shard_rotation as usize,
                f.row_offset_in_shard as usize,
                row,
            );
            values.assign(&self.data.row(p).slice(ndarray::s![..dim]));
        }
        Ok(out)
    }

    /// Device `d`'s operand: its `S` shards, SparseCore-major, `[S · R, D]` (shard `g` belongs to
    /// device `g / S`). `S` must divide the `N` shards and `d` be below `N / S`.
    pub fn device(&self, d: usize, sc_per_device: usize) -> Result<ArrayView2<'_, f32>> {
        let n = self.num_shards;
        if sc_per_device == 0 || !n.is_multiple_of(sc_per_device) {
            let reason = format!(
                "must divide the {n} shards of stack `{}` (N = G · S)",
                self.stack
            );
            return Err(KernelError::parameter(
                "sc_per_device",
                sc_per_device,
                reason,
            ));
        }
        let devices = n / sc_per_device;
        if d >= devices {
            return Err(KernelError::parameter(
                "device",
                d,
                format!("must be below the {devices} devices of stack `{}` ({n} shards, {sc_per_device} per device)", self.stack),
            ));
        }
        self.rows(d * sc_per_device, sc_per_device)
    }

    /// Shard `g`'s rows, `[R, D]`. `g` must be below the `N` shards.
    pub fn shard(&self, g: usize) -> Result<ArrayView2<'_, f32>> {
        if g >= self.num_shards {
            return Err(KernelError::parameter(
                "shard",
                g,
                format!(
                    "must be below the {} shards of stack `{}`",
                    self.num_shards, self.stack
                ),
            ));
        }
        self.rows(g, 1)
    }

    /// The rows of `count` shards from shard `first`. The fields are public, so `data` may hold
    /// fewer rows than `N · R` says: that is an error, not an out-of-bounds slice.
    fn rows(&self, first: usize, count: usize) -> Result<ArrayView2<'_, f32>> {
        let r = self.rows_per_shard;
        match (first.checked_mul(r), (first + count).checked_mul(r)) {
            (Some(lo), Some(hi)) if hi <= self.data.nrows() => Ok(self.data.slice(ndarray::s![lo..hi, ..])),
            _ => Err(KernelError::input(
                Subject::Stack(self.stack.clone()),
                format!(
                    "stacked table data of {} rows, fewer than N · R = {} · {r} (shards {first}..{})",
                    self.data.nrows(),
                    self.num_shards,
                    first + count
                ),
            )),
        }
    }
}

/// The physical row of vocabulary row `v` (SPEC 4: `compute_physical_row_ids`).
#[inline]
fn physical_row(
    n: usize,
    rows_per_shard: usize,
    rotation: usize,
    offset_in_shard: usize,
    v: usize,
) -> usize {
    let shard = (v % n + rotation) % n;
    shard * rows_per_shard + v / n + offset_in_shard
}

/// A feature plan of table `t` in stack `sp` (they all share the table's placement).
fn member<'p>(
    plan: &'p Plan,
    sp: &StackPlan,
    t: usize,
) -> Result<&'p sparsecore_prep::spec::FeaturePlan> {
    sp.features
        .iter()
        .map(|&f| &plan.features[f])
        .find(|f| f.table_index == t)
        .ok_or_else(|| {
            KernelError::plan(
                PlanItem::Stack,
                &sp.name,
                format!("table index {t} is not a member"),
            )
        })
}

fn table_dim(plan: &Plan, t: usize) -> usize {
    plan.features
        .iter()
        .find(|f| f.table_index == t)
        .map_or(0, |f| f.embedding_dim as usize)
}
