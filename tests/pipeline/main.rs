//! The pipeline's behaviour on generated inputs: properties against a naive model,
//! minibatching, concurrency, balancing, key hashing, the TCP all-reduce, FDO, output files and
//! the bench workloads.
//!
//! One test binary; each former test file is a module (`cargo test --test pipeline --
//! properties::` runs one of them).

#[cfg(feature = "tcp")]
#[path = "../allreduce_wire/mod.rs"]
mod allreduce_wire;

#[cfg(feature = "tcp")]
mod allreduce;
mod balance;
mod balance_apply;
mod bench_paths;
mod concurrency;
mod fdo;
mod hash;
mod minibatch;
mod output_file;
mod properties;
