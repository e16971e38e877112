//! Outputs compared with the reference's, bit for bit: the golden cases (the repository's own
//! under `testdata/`, and the shared sets in `../shared` when they are beside the checkout),
//! the multi-host cases, the Arrow cases, the cases run from their resolved stacking, and the
//! oracle model against the same cases.
//!
//! One test binary; each former test file is a module (`cargo test --test reference --
//! golden::` runs one of them).

// The multi-host cases run over the TCP all-reduce too: without the `tcp` feature, not at all.
#[cfg(feature = "tcp")]
#[path = "../allreduce_wire/mod.rs"]
mod allreduce_wire;
#[path = "../common/mod.rs"]
mod common;

mod arrow_cases;
mod golden;
#[cfg(feature = "tcp")]
mod golden_mh;
mod oracle;
mod resolved_plan;
