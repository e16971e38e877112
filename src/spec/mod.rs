//! Stage 0: the config (SPEC Part 1, section 1.1) and the stacking planner.
//!
//! A [`Config`] is what users write; a [`Plan`] is what the pipeline runs. The planner turns one
//! into the other once per batch shape: it decides which features share a stack, where each
//! feature's samples sit in the stacked batch (`row_offset`), where its table sits in each shard
//! (`col_offset`, `col_shift`), and how large every output buffer is. It reproduces the
//! reference's `prepare_feature_specs_for_training` ("feature" stacking) and `auto_stack_tables`
//! ("auto" stacking) exactly, because those numbers decide every output byte.

mod config;
mod plan;

pub use config::{
    Config, FeatureConfig, HashConfig, Options, StackLimits, Stacking, TableConfig,
    CONFIG_FORMAT_VERSION,
};
pub use plan::{
    Combiner, DeviceLayout, FeaturePlan, Placement, Plan, ResolvedStack, StackPlan,
    ACTIVATION_MEM_BYTES_LIMIT, MAX_SPARSECORES,
};

/// Alignment unit of partitions inside a COO buffer, in elements (`TPU_VECTOR_REGISTER_ALIGNMENT_SIZE`).
pub const ALIGNMENT: usize = 8;

/// Number of minibatching buckets (SPEC 5). The reference keeps a key's bucket in its top 6 bits;
/// our keys have no bucket field, since minibatching buckets the merged entries (`group::bucket`).
pub const MAX_MINIBATCHING_BUCKETS: usize = 64;

/// Bits of the sort key's payload field (sample row or extraction index).
pub(crate) const DATA_BITS: u32 = 26;

/// Largest payload the sort key holds: 2^26 - 1 samples (or ids, with weights) per device.
pub(crate) const DATA_MASK: u64 = (1 << DATA_BITS) - 1;

/// Padding value of `embedding_ids` and `sample_ids` (`INT_MAX`).
pub const PAD_ID: i32 = i32::MAX;

/// Bit pattern of the padding gain: the quiet NaN `nanf("")` of glibc.
pub const PAD_GAIN_BITS: u32 = 0x7fc0_0000;

/// Rounds `x` up to a multiple of `m` (`m > 0`), saturating at `u64::MAX`.
#[inline]
pub(crate) const fn round_up(x: u64, m: u64) -> u64 {
    x.div_ceil(m).saturating_mul(m)
}
