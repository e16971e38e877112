//! The BESS crate's tests: besskge's reference cases, SPEC.md's worked examples, the stream
//! against an independent oracle, the SparseCore layout through the pipeline, errors, and
//! hostile sharding files.
//!
//! One test binary; each former test file is a module (`cargo test -p sparsecore-bess --test
//! bess -- stream_oracle::` runs one of them).

#[path = "../common/mod.rs"]
mod common;

mod bess_cases;
mod errors;
mod hostile_npz;
mod layout;
mod spec_examples;
mod stream_oracle;
