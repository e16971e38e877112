//! End-to-end tests of the `sparsecore-prep` binary, run as real processes: the commands
//! (`cli`), `balance`, `bess`, `report`, crash hygiene, the Redis backend of dynamic tables and
//! a short soak.
//!
//! One test binary; each former test file is a module (`cargo test -p sparsecore-cli --test
//! cli -- crash::` runs one of them).

#[path = "../support/mod.rs"]
mod support;

mod balance;
mod bess;
mod cli;
mod crash;
mod dynamic_redis;
mod report;
mod soak;
