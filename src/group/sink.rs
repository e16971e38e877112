//! The protocol between the grouping walk and whatever receives its kept entries: an
//! [`EntrySink`]. The fill stage's `SegmentWriter` is one (the common path, which never
//! materialises entries); an entry list is another (minibatching's first pass, tests), and the
//! driver's stats-only runs use one that discards.

use crate::gain::merge;
use crate::key::KeyWord;

/// One de-duplicated, kept entry, ready for the fill stage.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Entry {
    /// Stacked column id: partition in the low `log2 N` bits, local embedding id above.
    pub col: u32,
    /// Device-level sample row.
    pub row: u32,
    /// Combined gain.
    pub gain: f32,
}

/// Where the grouping walk sends kept entries: a `Vec` (stats runs, tests) or a COO segment
/// written directly (the fill stage's `SegmentWriter`), so that the common path never
/// materialises the entries.
pub trait EntrySink {
    /// Appends a kept entry.
    fn push(&mut self, entry: Entry);
    /// Appends a kept entry given as partition and local embedding id (the column's two
    /// halves, which is how the walk has it); sinks that need only the halves override this.
    #[inline(always)]
    fn push_parts(&mut self, partition: u32, local: u32, nbits: u32, row: u32, gain: f32) {
        self.push(Entry {
            col: (local << nbits) | partition,
            row,
            gain,
        });
    }
    /// Adds a duplicate's gain to the last appended entry.
    fn add_to_last(&mut self, gain: f32);
    /// Announces that the entries pushed next belong to `partition` (partitions arrive in
    /// order), for sinks that track the partition themselves. By value, so that a sink held in
    /// registers by the walk stays there.
    #[inline(always)]
    fn start_partition(self, _partition: u32) -> Self
    where
        Self: Sized,
    {
        self
    }
    /// Appends an entry of the partition last announced by
    /// [`EntrySink::start_partition`] (which is also passed, for sinks that do not track it).
    #[inline(always)]
    fn push_local(&mut self, partition: u32, local: u32, nbits: u32, row: u32, gain: f32) {
        self.push_parts(partition, local, nbits, row, gain);
    }
    /// How many more entries of the current partition can certainly be appended without
    /// overflowing, which is what lets the walk call [`EntrySink::walk_block`].
    #[inline(always)]
    fn room(&self) -> usize {
        usize::MAX
    }
    /// Walks `keys`, sorted keys of one partition (as [`Block`] describes them), continuing
    /// after the key `last`: a key equal to the one before it merges its gain into that entry,
    /// any other appends an entry. `gain` gives an element's gain from the element and its
    /// payload (unused when `block.unit`). Called with at most [`EntrySink::room`] keys.
    /// Returns the last key, and how many entries and distinct columns the block added.
    ///
    /// About a third of the keys of real batches are duplicates, in no pattern a branch
    /// predictor can learn, so sinks that can merge without a branch override this.
    #[inline(always)]
    fn walk_block<K: KeyWord>(
        &mut self,
        keys: &[K],
        block: Block,
        last: u64,
        gain: impl Fn(u64, u32) -> f32,
    ) -> (u64, u32, u32)
    where
        Self: Sized,
    {
        walk_block_plain(self, keys, block, last, gain)
    }
}

/// A run of one partition's sorted keys, as [`EntrySink::walk_block`] reads them.
#[derive(Debug, Clone, Copy)]
pub struct Block {
    /// ORed into every element's key (a chunk's top bits).
    pub high: u64,
    /// Shift from an element to its key (32 when a gain is packed below the key).
    pub element_shift: u32,
    /// Bits of the payload.
    pub data_bits: u32,
    /// Mask of the local id, once shifted down by `data_bits`.
    pub local_mask: u64,
    /// log2 N.
    pub nbits: u32,
    /// The partition of every key.
    pub partition: u32,
    /// Row of payload 0: a key's row is `row_lo + payload`.
    pub row_lo: u32,
    /// Every gain is 1.0 (the sum combiner without weights).
    pub unit: bool,
}

/// [`EntrySink::walk_block`] through `push_local` and `add_to_last`.
#[inline(always)]
pub fn walk_block_plain<S: EntrySink, K: KeyWord>(
    sink: &mut S,
    keys: &[K],
    b: Block,
    mut last: u64,
    gain: impl Fn(u64, u32) -> f32,
) -> (u64, u32, u32) {
    let dmask = (1u64 << b.data_bits) - 1;
    let (mut ids, mut unique) = (0u32, 0u32);
    for &k in keys {
        let element = k.to_u64();
        let key = (element >> b.element_shift) | b.high;
        let data = (key & dmask) as u32;
        let g = if b.unit { 1.0 } else { gain(element, data) };
        if key == last {
            sink.add_to_last(g);
            continue;
        }
        ids += 1;
        unique += ((key ^ last) >> b.data_bits != 0) as u32;
        sink.push_local(
            b.partition,
            ((key >> b.data_bits) & b.local_mask) as u32,
            b.nbits,
            b.row_lo + data,
            g,
        );
        last = key;
    }
    (last, ids, unique)
}

impl EntrySink for Vec<Entry> {
    #[inline(always)]
    fn push(&mut self, entry: Entry) {
        Vec::push(self, entry);
    }
    #[inline(always)]
    fn add_to_last(&mut self, gain: f32) {
        if let Some(last) = self.last_mut() {
            last.gain = merge(last.gain, gain);
        }
    }
}

/// A pass-1 entry under minibatching: the merged pair and how many raw occurrences merged into
/// it (pass 2 drops whole pairs, and counts every occurrence it drops).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CountedEntry {
    /// The merged entry.
    pub entry: Entry,
    /// Raw occurrences merged into it.
    pub count: u32,
}

impl EntrySink for Vec<CountedEntry> {
    #[inline(always)]
    fn push(&mut self, entry: Entry) {
        Vec::push(self, CountedEntry { entry, count: 1 });
    }
    #[inline(always)]
    fn add_to_last(&mut self, gain: f32) {
        if let Some(last) = self.last_mut() {
            last.entry.gain = merge(last.entry.gain, gain);
            last.count += 1;
        }
    }
}
