//! A window's samples as balancing sees them: where each comes from, their ids per cell, and
//! the shape those cells are laid out in.

/// Where one output row comes from: input batch `batch`, row `row` (both within the window).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct SampleRef {
    /// Index of the input batch in the window.
    pub batch: usize,
    /// Row within that batch.
    pub row: usize,
}

/// Every sample's (cell, ids) pairs, stored flat: sample i owns `cells[start[i]..start[i + 1]]`,
/// stack by stack in stack order (the swap pass finds one stack's entries by bisection).
#[derive(Debug, Default)]
pub(super) struct SampleCounts {
    pub(super) refs: Vec<SampleRef>,
    pub(super) start: Vec<usize>,
    pub(super) cells: Vec<(u32, u32)>,
    /// Largest ids / limit over the sample's cells.
    pub(super) peak: Vec<f64>,
}

/// The shape the counts are laid out in.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shape {
    /// Slices (local SparseCores) per batch.
    pub(super) slices: usize,
    pub(super) sc_per_device: usize,
    pub(super) partitions: usize,
    pub(super) stacks: usize,
}

impl Shape {
    pub(super) fn cells(&self) -> usize {
        self.stacks * self.partitions
    }
}
