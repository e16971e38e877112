//! Balanced entity sharding (BESS) for knowledge-graph embeddings on SparseCores.
//!
//! Graphcore's BESS (the `besskge` library) shards the entity table randomly into `n` equal
//! shards, partitions triples `(head, relation, tail)` by the shard pair of their head and tail,
//! builds every batch from the same number of triples of each of the `n²` shard pairs, and draws
//! negatives equally from every shard. Every worker then gathers the same number of rows. On
//! SparseCores the per-partition limits and COO buffers are sized by the busiest
//! (SparseCore, partition) cell, so a batch that loads every cell equally needs the smallest
//! buffers and never drops ids.
//!
//! This crate reproduces besskge's host side bit for bit (`shared/bess/SPEC.md`):
//! - [`rng`]: numpy's SeedSequence + PCG64 and the draws besskge makes;
//! - [`sharding`]: [`Sharding`] (`Sharding.create`, `.npz` import/export);
//! - [`partition`]: [`PartitionedTriples`] (`PartitionedTripleSet`);
//! - [`batch`]: [`BatchSampler`] (Random, Rigid);
//! - [`negative`]: [`NegativeSampler`] (Random, TypeBased, TripleBased);
//!
//! and lays it out for SparseCores ([`layout`]).

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
pub use negative::{Corruption, NegativeOutput, NegativeSampler, RandomNegative, TripleBasedNegative, TypeBasedNegative};
pub use partition::{PartitionBuilder, PartitionMode, PartitionedTriples, Triples};
pub use rng::{seed_words, NumpyRng};
pub use sharding::Sharding;
pub use layout::{cell_loads, SparseCoreLayout};
pub use stream::{BessStream, BessStreamBuilder, CellCounts, NegativeKind, StreamBatch, StreamSampler};
