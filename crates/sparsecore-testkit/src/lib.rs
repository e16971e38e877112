//! The test kit of sparsecore-prep, shared by its tests, benches, fuzz targets and the CLI's
//! `generate` and `soak`. Not part of the library: nothing here is compiled into a user's build
//! of `sparsecore-prep`.
//!
//! - [`case`]: golden cases (the reference's `input.json` schema) with inline data.
//! - [`workload`]: synthetic Arrow workloads of the five profiles the reference's peer tools
//!   generate, with configs.
//! - [`model`]: the oracle, a slow re-implementation of the pipeline written from the spec text.
//! - [`redis_server`] and [`fault_proxy`]: a private `redis-server` per test and a TCP proxy
//!   that injects faults, for the dynamic-table tests and benches.
//! - [`sets`]: where the reference cases are: `testdata/` and the shared sets in `../shared`.
//! - [`TempDir`]: scratch directories removed on drop.

#![deny(missing_docs)]

pub mod case;
pub mod fault_proxy;
pub mod model;
pub mod redis_server;
pub mod sets;
mod tempdir;
pub mod workload;

pub use tempdir::TempDir;
