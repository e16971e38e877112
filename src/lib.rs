//! # sparsecore-prep
//!
//! The host-side input stage in front of TPU SparseCore embedding lookups. It turns each batch
//! of ragged, dense, sparse-COO or Arrow ids into the per-SparseCore CSR-wrapped COO buffers
//! (`row_pointers`, `embedding_ids`, `sample_ids`, `gains`) and FDO statistics that Google's
//! jax-tpu-embedding produces, bit for bit, with typed errors where the reference aborts.
//!
//! ```
//! use sparsecore_prep::{Config, Output, Preprocessor, input::RaggedInput};
//!
//! let config = Config::from_json(r#"{
//!   "config": {"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 4},
//!   "tables": [{"name": "t0", "vocabulary_size": 1000, "embedding_dim": 16, "combiner": "sum",
//!               "max_ids_per_partition": 16, "max_unique_ids_per_partition": 16}],
//!   "features": [{"name": "f0", "table": "t0"}]
//! }"#)?;
//! let mut prep = Preprocessor::new(config)?;
//!
//! // 8 samples: sample r holds ids [r, r + 100].
//! let ids: Vec<i32> = (0..8).flat_map(|r| [r, r + 100]).collect();
//! let splits: Vec<i32> = (0..=8).map(|r| 2 * r).collect();
//! let f0 = RaggedInput::from_i32("f0", &ids, &splits)?;
//!
//! let mut out = Output::new(); // reuse it for every batch
//! prep.run(&[&f0], &mut out)?;
//! let t0 = out.stack("t0").unwrap();
//! assert_eq!(t0.coo_buffer_size_per_device(), 16 * 4 * 4); // roundup(max_ids, 8) * S * N
//! assert_eq!(t0.stats.dropped_id_count, 0);
//! // SparseCore 0 got samples 0 and 1: ids 0, 1, 100, 101 go to partitions 0, 1, 0, 1.
//! assert_eq!(&t0.row_pointers[..8], &[2, 10, 16, 16, 16, 16, 16, 16]);
//! assert_eq!(&t0.embedding_ids[..2], &[0, 25]); // local rows 0/4 and 100/4
//! # Ok::<(), sparsecore_prep::Error>(())
//! ```
//!
//! The pipeline, one module per stage (see `ARCHITECTURE.md`), data flowing one way:
//! [`spec`] (config, stacking plan, buffer sizes) → [`input`] (zero-copy views) → extract
//! (slicing, column ids, gains, sort keys) → group (sort, de-duplication, limits, stats) → fill
//! (CSR-wrapped COO segments) → [`Output`] and [`StackStats`]; [`fdo`] merges statistics and
//! tunes limits. [`Preprocessor`] drives the stages in parallel. The stages themselves are
//! internal; the `internals` cargo feature exposes them for this repository's stage benches
//! only, with no stability promise.
//!
//! Side systems live in crates beside this one: `sparsecore-kernel` (the CPU backend and
//! dynamic tables), `sparsecore-cli` (the `sparsecore-prep` command) and `sparsecore-testkit`.

#![deny(missing_docs)]
#![deny(unsafe_code)]

// At the bottom of the flow: errors, instruction-set dispatch, and the contracts that stages
// share (the key and its layout, the gain rules, buffer reuse).
mod error;
mod fields;
mod gain;
pub mod isa;
pub mod parallel;
mod reuse;
// Pipeline internals are crate-private, or public under the unstable `internals` feature (for
// this repository's stage benches). Declared one by one, not by a macro, so that rustfmt
// reaches their files.
#[cfg(feature = "internals")]
pub mod key;
#[cfg(not(feature = "internals"))]
mod key;

pub mod input;
pub mod spec;

// The pipeline stages and the keys they hand on (their flow order: ARCHITECTURE.md).
#[cfg(feature = "internals")]
pub mod extract;
#[cfg(not(feature = "internals"))]
mod extract;
#[cfg(feature = "internals")]
pub mod extracted;
#[cfg(not(feature = "internals"))]
mod extracted;
#[cfg(feature = "internals")]
pub mod fill;
#[cfg(not(feature = "internals"))]
mod fill;
#[cfg(feature = "internals")]
pub mod group;
#[cfg(not(feature = "internals"))]
mod group;
mod output;
mod stats;

// The driver and what sits on top of it.
pub mod allreduce;
pub mod balance;
pub mod fdo;
pub mod io;
mod preprocess;

pub use allreduce::{AllReduce, InProcessAllReduce, LocalAllReduce};
#[cfg(feature = "tcp")]
pub use allreduce::{AllReduceCounters, TcpAllReduce, TcpAllReduceBuilder};
pub use error::{BatchCount, ConfigItem, Error, LimitKind, NpzBound, Result};
pub use fdo::FdoStats;
pub use fill::TailFill;
pub use group::bucket::BucketFn;
pub use input::{
    features_from_record_batch, ArrowListInput, CooInput, DenseInput, RaggedInput, SampleSource,
};
pub use output::{Output, StackOutput};
pub use preprocess::{Preprocessor, PreprocessorBuilder, SMALL_BATCH_IDS};
pub use spec::{Config, Plan};
pub use stats::StackStats;

/// README.md's Rust examples, compiled and run as doctests so that they keep working verbatim.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
