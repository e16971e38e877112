//! CPU backend: what the SparseCore kernels do with the buffers (SPEC 4 and 6), so that the whole
//! path (input → buffers → activations) runs and is tested without a TPU.
//!
//! - [`StackedTable`]: a stack's tables in the row-sharded, rotated, stacked layout the kernels
//!   read (SPEC 4), built from per-table dense arrays and read back exactly.
//! - [`sparse_dense_matmul`]: the forward pass over one stack's buffers (SPEC 6.2), every
//!   minibatch included, [`feature_activations`] to take one feature's rows back out, and
//!   [`stack_feature_gradients`], its adjoint, to stack per-feature gradients back.
//! - [`apply_gradients`]: the backward pass (row gradients accumulated over every slot that
//!   references a row) and one step of SGD, Adagrad, Adagrad-momentum, Adam, FTRL or LaProp
//!   (SPEC 6.3), with the optimizer's [`Slots`] stored beside the table rows.
//! - [`sparse_dense_matmul_into`] and [`apply_gradients_into`]: the same two passes over
//!   borrowed buffers ([`StackBuffers`]) and tables, in parallel, writing into the caller's
//!   arrays (the Python bindings' path), with the reference's `embedding_var_limits`.
//! - [`PartitionedTable`]: a host table split across replicas by rows (`Token`) or columns
//!   (`Encoding`), whose lookups and updates equal the unsplit table's exactly.
//! - [`dynamic`]: tables keyed by raw keys, created lazily, with slots beside each row, in memory
//!   or in a Redis server shared by workers, and the forward/backward path over them.
//!
//! Every call returns [`KernelError`], the crate's one error type; the pipeline's errors pass
//! through it (`From<sparsecore_prep::Error>`), so `?` works across both crates.

#![deny(missing_docs)]

mod buffers;
pub mod dynamic;
pub mod error;
mod forward;
mod host;
mod optimizer;
mod segments;
mod table;

pub use buffers::{apply_gradients_into, sparse_dense_matmul_into, StackBuffers};
pub use error::{KernelError, PlanItem, Result, StoreErrorKind, Subject};
pub use forward::{feature_activations, sparse_dense_matmul, stack_feature_gradients};
pub use host::{Partition, PartitionedTable};
pub use optimizer::{apply_gradients, row_gradients, Optimizer, Slots};
pub use table::StackedTable;
