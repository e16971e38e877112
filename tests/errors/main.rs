//! Errors: every error path once (`errors`), hostile inputs pushed against each of them
//! (`hostile`), and the defects found by review (`regressions`) and by the fuzz targets
//! (`fuzz_regressions`), each kept fixed.
//!
//! One test binary; each former test file is a module. `hostile` installs this binary's global
//! allocator, which counts allocations per thread (so the modules' tests, running in parallel,
//! do not see each other's). `tests/alloc.rs`, whose allocator counts for the whole process,
//! stays a binary of its own.

#[path = "../common/mod.rs"]
mod common;
#[path = "../one_table/mod.rs"]
mod one_table;

mod errors;
mod fuzz_regressions;
mod hostile;
mod regressions;
