//! The keys of one SparseCore, as extraction hands them to the sort and the grouping walk: the
//! contract between those stages. Which buffers hold data is fixed by the layout: its
//! [`KeyStorage`] says where the keys are, its [`Gains`] where their gains are. Every buffer is
//! kept (empty) whatever the layout, so that a SparseCore whose layout changes between batches
//! reuses its memory.

use crate::key::{Gains, KeyFormat, KeyStorage};
use crate::reuse::reserve_to;

/// Per-SparseCore extraction output, reused from batch to batch.
#[derive(Debug, Default, Clone)]
pub struct Extracted {
    /// How this SparseCore's keys are packed, stored, and where their gains are.
    pub format: KeyFormat,
    /// [`KeyStorage::Wide`], [`KeyStorage::GainBelowKey`] and [`KeyStorage::GainBesideKey`]:
    /// one `u64` element per extracted id, in extraction order.
    pub wide_keys: Vec<u64>,
    /// [`KeyStorage::Narrow`]: the keys as `u32`, in extraction order.
    pub narrow_keys: Vec<u32>,
    /// [`KeyStorage::GainBesideKey`]: the gain of each key in `wide_keys`.
    pub key_gains: Vec<f32>,
    /// [`Gains::PerIndex`]: (sample row, gain) of each extraction index, kept together so that
    /// the walk's random lookup touches one cache line.
    pub index_rows: Vec<(u32, f32)>,
    /// [`Gains::PerRow`]: the gain of each sample row, indexed by the payload.
    pub row_gains: Vec<f32>,
    /// First row of this SparseCore (`s * bsps`): a row payload `d` is row `first_row + d`.
    pub first_row: u32,
    /// Rows this SparseCore's keys can reference, from `first_row` on: row payloads are below it.
    pub row_span: u32,
    /// Whether payloads never decrease in extraction order, which lets the sort skip them.
    pub payloads_sorted: bool,
}

impl Extracted {
    /// Grows every buffer to at least `other`'s capacity, so that whatever `other` held fits
    /// here without allocating.
    pub fn reserve_like(&mut self, other: &Extracted) {
        reserve_to(&mut self.wide_keys, other.wide_keys.capacity());
        reserve_to(&mut self.index_rows, other.index_rows.capacity());
        reserve_to(&mut self.row_gains, other.row_gains.capacity());
        reserve_to(&mut self.narrow_keys, other.narrow_keys.capacity());
        reserve_to(&mut self.key_gains, other.key_gains.capacity());
    }

    /// Keys extracted.
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        match self.format.storage() {
            KeyStorage::Narrow => self.narrow_keys.len(),
            _ => self.wide_keys.len(),
        }
    }

    /// Appends a key without a gain.
    #[inline(always)]
    pub fn push_key(&mut self, key: u64) {
        match self.format.storage() {
            KeyStorage::Narrow => self.narrow_keys.push(key as u32),
            _ => self.wide_keys.push(key),
        }
    }

    /// Sets the layout and empties the key and gain storage.
    pub fn reset(&mut self, format: KeyFormat, first_row: u32, row_span: u32) {
        self.format = format;
        self.first_row = first_row;
        self.row_span = row_span;
        self.payloads_sorted = true;
        self.wide_keys.clear();
        self.narrow_keys.clear();
        self.key_gains.clear();
        self.index_rows.clear();
        if format.gains == Gains::PerRow {
            self.row_gains.clear();
            self.row_gains.resize(row_span as usize, 0.0);
        }
    }
}
