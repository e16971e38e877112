//! The CPU backend's tests: the forward pass, the backward pass with each optimizer, the
//! borrowed parallel passes, host tables, dynamic tables, and end-to-end training.
//!
//! One test binary; each former test file is a module (`cargo test -p sparsecore-kernel --test
//! kernel -- optimizer::` runs one of them).

#[path = "../reference/mod.rs"]
mod reference;

mod buffers;
mod dynamic;
mod host_table;
mod kernel;
mod optimizer;
mod train_ctr;
