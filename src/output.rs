//! The output buffers: per stack, CSR-wrapped COO arrays for every local device, plus stats.
//!
//! An [`Output`] is meant to be kept and passed to every call: buffers are resized only when
//! the plan's sizes change, so steady-state batches reuse the same memory.
//!
//! A call that fails leaves the [`Output`] empty ([`Output::clear`]): no stacks, so nothing
//! half-written can be fed to a device, while the memory is kept for the next batch.
//!
//! **Cost that follows the ids.** A COO buffer is sized for the worst batch the limits allow
//! (an untuned config's buffer is megabytes per stack), while a batch usually writes a small
//! part of it. Every slot past a segment's final cursor holds the padding triple, so a reused
//! buffer only needs the padding re-written where the previous batch wrote further than this
//! one: each stack keeps, per SparseCore segment, how far its buffers were last written (its
//! *tail extent*), and the writers pad only `[cursor, extent)`. A buffer that is new, resized,
//! or replaced by the caller (a different allocation or length in a public field) counts as
//! written in full, so its first batch pads the whole tail.
//!
//! **Memory that follows the ids.** With [`TailFill::Zeros`] the tail holds zeros instead of the
//! padding triple, and new buffers come zeroed from the allocator (fresh pages from the OS, for
//! large ones): a page that no batch writes is never touched, so a caller that keeps many
//! outputs (a loader's prefetch queue) holds only the memory the batches wrote.

use std::fmt;

use ndarray::ArrayView2;

use crate::error::{Error, Result};
use crate::fill::TailFill;
use crate::spec::{Plan, StackPlan};
use crate::stats::StackStats;

/// The buffers of one stack, device-major (`[L, RP]` and `[L, C]`, flattened).
///
/// The arrays are public to read and to move out. The next batch re-pads a segment's tail only
/// where the last batch wrote, so a caller that changes the arrays in place past a segment's
/// final row pointer and then passes the same [`Output`] on calls
/// [`StackOutput::mark_written`] first. (Replacing an array, or moving it out, needs nothing.)
#[derive(Debug, Clone, Default)]
pub struct StackOutput {
    /// Stack name.
    pub name: String,
    /// `[L * RP]`: per device, per SparseCore, `rpb` partition end offsets.
    pub row_pointers: Vec<i32>,
    /// `[L * C]`: shard-local embedding row of each entry (`i32::MAX` for padding).
    pub embedding_ids: Vec<i32>,
    /// `[L * C]`: SparseCore-local sample of each entry (`i32::MAX` for padding).
    pub sample_ids: Vec<i32>,
    /// `[L * C]`: combined gain of each entry (NaN `0x7fc00000` for padding).
    pub gains: Vec<f32>,
    /// FDO statistics of the batch.
    pub stats: StackStats,
    local_devices: usize,
    row_pointers_per_device: usize,
    coo_buffer_size_per_device: usize,
    /// What the slots past each segment's final cursor hold.
    pub(crate) tail_fill: TailFill,
    /// Per SparseCore segment (device-major), the segment-relative end of what the last batch
    /// wrote: every slot of the segment at or past it holds the tail fill.
    pub(crate) tail_extents: Vec<u32>,
    /// The (address, length) of `embedding_ids`, `sample_ids` and `gains` that `tail_extents`
    /// describes; other arrays (the fields are public) are treated as written in full.
    tail_arrays: [(usize, usize); 3],
}

impl StackOutput {
    /// Where each COO array's memory is and how long it is: what `tail_extents` are valid for.
    fn coo_arrays(&self) -> [(usize, usize); 3] {
        fn identity<T>(v: &[T]) -> (usize, usize) {
            (v.as_ptr() as usize, v.len())
        }
        [
            identity(&self.embedding_ids),
            identity(&self.sample_ids),
            identity(&self.gains),
        ]
    }

    fn prepare(
        &mut self,
        plan: &Plan,
        stack: &StackPlan,
        buffers: bool,
        tail_fill: TailFill,
    ) -> Result<()> {
        let l = plan.layout.local_devices;
        // A stats-only run writes no buffers: their sizes read as 0, so that the views and
        // the kernels see consistent (empty) arrays.
        let (rp, c) = if buffers {
            (
                stack.row_pointers_per_device,
                stack.coo_buffer_size_per_device,
            )
        } else {
            (0, 0)
        };
        // A valid config can still ask for more than any machine has (L * C grows with the
        // device count): reserve every array first, fallibly, and only then write, so that an
        // impossible size is an error instead of an allocation abort, and no page is touched.
        let too_large = |array: &'static str, elements: Option<usize>| Error::OutputTooLarge {
            stack: stack.name.clone(),
            array,
            local_devices: l,
            elements: elements.map_or(u64::MAX, |e| e as u64),
        };
        let per_device = |array, n: usize| l.checked_mul(n).ok_or_else(|| too_large(array, None));
        let rp_len = per_device("row_pointers", rp)?;
        let c_len = per_device("embedding_ids", c)?;
        let p_len = per_device("max_ids_per_partition", plan.layout.num_partitions())?;
        // The COO arrays first (`L * C`, usually the largest), so that an impossible size fails
        // before anything else is reserved.
        let mut fresh = [false; 3];
        let reserved = reserve_zeroed(&mut self.embedding_ids, c_len, "embedding_ids")
            .map(|f| fresh[0] = f)
            .and_then(|()| reserve_zeroed(&mut self.sample_ids, c_len, "sample_ids"))
            .map(|f| fresh[1] = f)
            .and_then(|()| reserve_zeroed(&mut self.gains, c_len, "gains"))
            .map(|f| fresh[2] = f)
            .and_then(|()| reserve(&mut self.row_pointers, rp_len, "row_pointers"))
            .and_then(|()| {
                reserve(
                    &mut self.stats.max_ids_per_partition,
                    p_len,
                    "max_ids_per_partition",
                )
            })
            .and_then(|()| {
                reserve(
                    &mut self.stats.max_unique_ids_per_partition,
                    p_len,
                    "max_unique_ids_per_partition",
                )
            });
        if let Err((array, len)) = reserved {
            return Err(too_large(array, Some(len)));
        }
        if self.name != stack.name {
            self.name.clone_from(&stack.name);
        }
        let segments = l * plan.layout.sc_per_device;
        let cs = if segments == 0 {
            0
        } else {
            c / plan.layout.sc_per_device
        };
        let reshaped = (self.local_devices, self.coo_buffer_size_per_device) != (l, c);
        self.local_devices = l;
        self.row_pointers_per_device = rp;
        self.coo_buffer_size_per_device = c;
        let (rp, c) = (l * rp, l * c);
        self.row_pointers.resize(rp, 0);
        self.embedding_ids.resize(c, 0);
        self.sample_ids.resize(c, 0);
        self.gains.resize(c, 0.0);
        let arrays = self.coo_arrays();
        if reshaped
            || arrays != self.tail_arrays
            || self.tail_extents.len() != segments
            || tail_fill != self.tail_fill
        {
            // Zeroed new arrays already hold a zero tail; of any other, nothing is known, and
            // the first batch fills their tails in full.
            let clean = tail_fill == TailFill::Zeros && fresh.iter().all(|&f| f);
            self.tail_extents.clear();
            self.tail_extents
                .resize(segments, if clean { 0 } else { cs as u32 });
            self.tail_arrays = arrays;
            self.tail_fill = tail_fill;
        }
        self.stats
            .reset(l * plan.layout.num_partitions(), plan.layout.local_scs());
        Ok(())
    }

    /// Declares every slot of the COO arrays possibly changed, so that the next batch pads
    /// their tails in full instead of only where the last batch wrote.
    pub fn mark_written(&mut self) {
        self.tail_arrays = [(0, 0); 3];
    }

    /// Per SparseCore segment (device-major), how far the last batch wrote the COO arrays:
    /// every slot of a segment at or past its extent holds the tail fill ([`TailFill`]).
    pub fn tail_extents(&self) -> &[u32] {
        &self.tail_extents
    }

    /// For a caller that moves the COO arrays out and hands them back later (a buffer pool):
    /// declares that the arrays now in `embedding_ids`, `sample_ids` and `gains` hold the tail
    /// fill at or past `extents` (what [`StackOutput::tail_extents`] said when they were moved
    /// out, if nothing wrote into them since), so that the next batch fills only up to there.
    /// Ignored, leaving the arrays to be filled in full, when `extents` or the arrays do not fit
    /// this stack's shape.
    pub fn restore_tail_extents(&mut self, extents: &[u32]) {
        let c = self.local_devices * self.coo_buffer_size_per_device;
        if c == 0 || extents.is_empty() {
            return;
        }
        // Segments split the arrays evenly: L * S of `cs` slots.
        let cs = c / extents.len();
        let arrays = self.coo_arrays();
        if extents.len() != self.tail_extents.len()
            || arrays.iter().any(|&(_, len)| len != c)
            || extents.iter().any(|&e| e as usize > cs)
        {
            return;
        }
        self.tail_extents.copy_from_slice(extents);
        self.tail_arrays = arrays;
    }

    /// Local devices (L).
    pub fn local_devices(&self) -> usize {
        self.local_devices
    }

    /// Row pointers per device (RP).
    pub fn row_pointers_per_device(&self) -> usize {
        self.row_pointers_per_device
    }

    /// COO buffer size per device (C); 0 after a stats-only run.
    pub fn coo_buffer_size_per_device(&self) -> usize {
        self.coo_buffer_size_per_device
    }

    /// Row pointers as `[L, RP]` (the reference's `has_leading_dimension=True` shape).
    pub fn row_pointers_2d(&self) -> ArrayView2<'_, i32> {
        view2(
            &self.row_pointers,
            self.local_devices,
            self.row_pointers_per_device,
        )
    }

    /// Embedding ids as `[L, C]`.
    pub fn embedding_ids_2d(&self) -> ArrayView2<'_, i32> {
        view2(
            &self.embedding_ids,
            self.local_devices,
            self.coo_buffer_size_per_device,
        )
    }

    /// Sample ids as `[L, C]`.
    pub fn sample_ids_2d(&self) -> ArrayView2<'_, i32> {
        view2(
            &self.sample_ids,
            self.local_devices,
            self.coo_buffer_size_per_device,
        )
    }

    /// Gains as `[L, C]`.
    pub fn gains_2d(&self) -> ArrayView2<'_, f32> {
        view2(
            &self.gains,
            self.local_devices,
            self.coo_buffer_size_per_device,
        )
    }
}

impl PartialEq for StackOutput {
    /// Compares the batches' values; what is known about the buffers' memory is not part of it.
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
            && self.row_pointers == other.row_pointers
            && self.embedding_ids == other.embedding_ids
            && self.sample_ids == other.sample_ids
            && self.gains == other.gains
            && self.stats == other.stats
            && self.local_devices == other.local_devices
            && self.row_pointers_per_device == other.row_pointers_per_device
            && self.coo_buffer_size_per_device == other.coo_buffer_size_per_device
    }
}

/// A `[rows, cols]` view, or an empty one when the (public, so editable) buffer does not have
/// that length.
fn view2<T>(v: &[T], rows: usize, cols: usize) -> ArrayView2<'_, T> {
    match rows.checked_mul(cols) {
        Some(n) if n == v.len() => ArrayView2::from_shape((rows, cols), v)
            .unwrap_or_else(|_| ArrayView2::from_shape((0, 0), &v[..0]).expect("empty view")),
        _ => ArrayView2::from_shape((0, 0), &v[..0]).expect("empty view"),
    }
}

/// Makes room for `len` elements of a COO array: within its capacity if it has room (returns
/// false), else as a new zeroed allocation of length `len` (returns true), whose pages the
/// allocator has not touched when it maps them fresh. On failure, names the array.
fn reserve_zeroed<T: bytemuck::Zeroable>(
    v: &mut Vec<T>,
    len: usize,
    array: &'static str,
) -> Result<bool, (&'static str, usize)> {
    if v.capacity() >= len {
        return Ok(false);
    }
    // Drop the old allocation first: the two need not coexist.
    *v = Vec::new();
    *v = bytemuck::allocation::try_zeroed_vec(len).map_err(|()| (array, len))?;
    Ok(true)
}

/// Reserves room for `len` elements without writing any; on failure, names the array.
fn reserve<T>(
    v: &mut Vec<T>,
    len: usize,
    array: &'static str,
) -> Result<(), (&'static str, usize)> {
    v.try_reserve_exact(len.saturating_sub(v.len()))
        .map_err(|_| (array, len))
}

/// Everything one batch produces.
///
/// Either a whole batch or nothing: after a successful call every stack holds that batch's
/// buffers and statistics; after a failed call the output is empty (`stacks` is empty and
/// `num_minibatches` is 0, so it compares equal to [`Output::new`]), never a half-written or
/// stale batch. The buffers' memory is kept aside either way, so the next batch of the same
/// shape allocates nothing.
#[derive(Default)]
pub struct Output {
    /// One entry per stack, in plan order. Empty after a failed call.
    pub stacks: Vec<StackOutput>,
    /// Minibatches in the buffers (1 without minibatching); 0 after a failed call.
    pub num_minibatches: usize,
    /// Stacks put aside by [`Output::clear`], reused (memory and all) by the next batch.
    spare: Vec<StackOutput>,
    /// What the buffers' tails hold.
    tail_fill: TailFill,
}

impl Output {
    /// An empty output whose tails hold the padding triple; the first call sizes it.
    pub fn new() -> Self {
        Self::default()
    }

    /// This output with `fill` in the buffers' tails from the next batch on.
    #[must_use]
    pub fn with_tail_fill(mut self, fill: TailFill) -> Self {
        self.tail_fill = fill;
        self
    }

    /// What the buffers' tails hold.
    pub fn tail_fill(&self) -> TailFill {
        self.tail_fill
    }

    /// The stack named `name`.
    pub fn stack(&self, name: &str) -> Option<&StackOutput> {
        self.stacks.iter().find(|s| s.name == name)
    }

    /// Empties the output (no stacks, `num_minibatches` 0) but keeps the buffers' memory for
    /// the next batch. This is the state every failed preprocessing call leaves, so that a
    /// caller looping over `stacks` after an ignored error feeds nothing rather than garbage.
    pub fn clear(&mut self) {
        // Reversed so that `prepare` pops them back in plan order (stack i gets its own buffers).
        self.spare.extend(self.stacks.drain(..).rev());
        self.num_minibatches = 0;
    }

    /// Sizes every buffer for `plan`, reusing allocations. Without `buffers` (a stats-only
    /// run) the four arrays are left empty and only the statistics are sized.
    ///
    /// Fails with [`Error::OutputTooLarge`] when an array cannot be allocated; the caller then
    /// clears the output.
    pub(crate) fn prepare(&mut self, plan: &Plan, buffers: bool) -> Result<()> {
        let n = plan.stacks.len();
        if self.stacks.len() > n {
            self.spare.extend(self.stacks.drain(n..).rev());
        }
        while self.stacks.len() < n {
            let stack = self.spare.pop().unwrap_or_default();
            self.stacks.push(stack);
        }
        for (out, stack) in self.stacks.iter_mut().zip(&plan.stacks) {
            if let Err(e) = out.prepare(plan, stack, buffers, self.tail_fill) {
                // The same shape would fail again: hold on to no memory (earlier stacks may
                // have reserved a lot of it).
                *self = Output::new().with_tail_fill(self.tail_fill);
                return Err(e);
            }
        }
        self.num_minibatches = 1;
        Ok(())
    }
}

impl Clone for Output {
    /// Clones the batch (not the spare memory kept for the next one).
    fn clone(&self) -> Self {
        Output {
            stacks: self.stacks.clone(),
            num_minibatches: self.num_minibatches,
            spare: Vec::new(),
            tail_fill: self.tail_fill,
        }
    }
}

impl PartialEq for Output {
    /// Compares the batches; memory kept for reuse is not part of the value.
    fn eq(&self, other: &Self) -> bool {
        self.stacks == other.stacks && self.num_minibatches == other.num_minibatches
    }
}

impl fmt::Debug for Output {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Output")
            .field("stacks", &self.stacks)
            .field("num_minibatches", &self.num_minibatches)
            .finish_non_exhaustive()
    }
}
