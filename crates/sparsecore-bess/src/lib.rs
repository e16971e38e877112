//! Balanced entity sharding (BESS) for knowledge-graph embeddings on SparseCores.
//!
//! Graphcore's BESS (the `besskge` library) shards the entity table randomly into `n` equal
//! shards, partitions triples `(head, relation, tail)` by the shard pair of their head and tail,
//! builds every batch from the same number of triples of each of the `n²` shard pairs, and draws
//! negatives equally from every shard, so every worker gathers the same number of rows. The
//! SparseCore pipeline sizes its per-partition limits and COO buffers by the busiest
//! (SparseCore, partition) cell: a batch that loads every cell exactly equally needs the
//! smallest buffers and never drops ids. This crate brings the two together.
//!
//! **besskge, bit for bit** (`shared/bess/SPEC.md`; `tests/bess/bess_cases.rs` checks the
//! reference cases):
//! - [`rng`]: numpy's `default_rng` (SeedSequence + PCG64) and the draws besskge makes, because
//!   its shardings and batches are a pure function of numpy's stream;
//! - [`sharding`]: [`Sharding`] (`Sharding.create`, and its `.npz` so a besskge sharding can be
//!   reused);
//! - [`partition`]: [`PartitionedTriples`] (`PartitionedTripleSet`, stable order);
//! - [`batch`]: [`BatchSampler`] (Random; Rigid exact without shuffling, shuffled by our own
//!   seeded generator);
//! - [`negative`]: [`NegativeSampler`] (Random, TypeBased, TripleBased).
//!
//! **On SparseCores**:
//! - [`layout`]: [`SparseCoreLayout`] — shard `s` *is* global SparseCore `s` (`n = N = G·S`),
//!   through the physical id `local·N + ((s − col_shift) mod N)`, and SparseCore `g` takes block
//!   `(i, (i + g + t) mod n)` of every head shard `i` in step `t`;
//! - [`stream`]: [`BessStream`] — Arrow record batches for the unchanged
//!   [`sparsecore_prep::Preprocessor`] and the [`sparsecore_prep::Config`] whose limits are the
//!   exact per-cell counts, computed before the first batch.
//!
//! [`error::BessError`] is the one error type: every bad input is a typed error naming the
//! column and the value. [`synth`] makes uniform and power-law graphs for tests and
//! measurements.
//!
//! ```
//! use sparsecore_bess::{synth, BessStream, Corruption};
//! use sparsecore_prep::{Output, Preprocessor};
//!
//! // 4 SparseCores (L = G = 1, S = 4), so 4 shards; 8 triples per SparseCore (2 per shard
//! // pair), 3 tail negatives from every shard.
//! let mut stream = BessStream::builder()
//!     .triples(synth::uniform(1000, 10, 20_000, 1))
//!     .n_entity(1000)
//!     .devices(1, 1, 4)
//!     .shard_batch_size(8)
//!     .negatives(3)
//!     .corruption(Corruption::T)
//!     .seed(1234)
//!     .steps(2)
//!     .build()?;
//! // Every (SparseCore, partition) cell gets 2 heads, 2 tails and 3 negatives.
//! assert_eq!(stream.counts().max_ids_per_partition, 7);
//! let mut prep = Preprocessor::new(stream.config().clone())?;
//! let mut out = Output::new();
//! for batch in &mut stream {
//!     prep.run_record_batch(&batch?.record_batch, &mut out)?;
//!     let stats = &out.stack("entities").unwrap().stats;
//!     assert!(stats.max_ids_per_partition.iter().all(|&m| m == 7)); // max = min
//!     assert_eq!(stats.dropped_id_count, 0);
//! }
//! # Ok::<(), sparsecore_bess::BessError>(())
//! ```

#![deny(missing_docs)]
#![deny(unsafe_code)]

pub mod batch;
pub mod error;
pub mod layout;
pub mod negative;
pub mod partition;
pub mod rng;
pub mod sharding;
pub mod stream;
pub mod synth;

pub use batch::{Batch, BatchOptions, BatchSampler, Geometry, SamplerKind};
pub use error::{BessError, Result};
pub use layout::{cell_loads, SparseCoreLayout};
pub use negative::{
    Corruption, NegativeOutput, NegativeSampler, RandomNegative, TripleBasedNegative,
    TypeBasedNegative,
};
pub use partition::{PartitionBuilder, PartitionMode, PartitionedTriples, Triples};
pub use rng::{seed_words, NumpyRng};
pub use sharding::Sharding;
pub use stream::{
    BessStream, BessStreamBuilder, CellCounts, NegativeKind, StreamBatch, StreamSampler,
};
