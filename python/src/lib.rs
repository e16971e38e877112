//! `sparsecore_prep._native`: the Rust half of the Python package.
//!
//! The Python half (`python/sparsecore_prep/`: `_pytree.py`, `_specs.py`, `_results.py` and the
//! other private modules that `__init__.py` re-exports) flattens pytrees, reads the reference's
//! `FeatureSpec`s and builds the result objects; this module does everything that
//! touches ids: it reads numpy and Arrow memory in place (or gathers ragged rows into one flat
//! buffer), runs the crate's pipeline with the GIL released, and hands the output buffers to
//! numpy without copying them.
//!
//! `allreduce` connects hosts for multi-host minibatching: our TCP all-reduce as a class, and
//! any Python object with `all_reduce_or` as the pipeline's `AllReduce` (called with the GIL
//! re-acquired).
//!
//! Unsafe code is confined to `numpy_input` (reading the rows of ragged object arrays through
//! numpy's C structs, which is what makes a 400,000-row batch cost microseconds rather than
//! tens of milliseconds), `arrow_input` (importing Arrow C data interface capsules) and
//! `pool` (numpy arrays that view a buffer owned by their base object, so that the memory can
//! be reused by the next call). The library crate itself keeps `#![deny(unsafe_code)]`.

mod allreduce;
mod arrow_input;
mod arrow_output;
mod balance;
mod bess;
mod errors;
mod kernels;
mod numpy_input;
mod pool;
mod prep;
mod specs;
mod threads;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // The bounds below which a call runs, and gathers ragged rows, on the calling thread (the
    // tests check that they reach the pool above them).
    m.add("SMALL_BATCH_IDS", sparsecore_prep::SMALL_BATCH_IDS)?;
    m.add(
        "GATHER_ON_CALLER_MAX_ROWS",
        numpy_input::GATHER_ON_CALLER_MAX_ROWS,
    )?;
    m.add_class::<prep::NativePreprocessor>()?;
    m.add_class::<prep::NativeFdoStats>()?;
    m.add_class::<prep::NativeDropIn>()?;
    m.add_class::<pool::PooledBuffer>()?;
    m.add_class::<allreduce::NativeTcpAllReduce>()?;
    m.add_class::<kernels::NativeKernels>()?;
    m.add_function(wrap_pyfunction!(prep::preprocess_resolved, m)?)?;
    m.add_function(wrap_pyfunction!(specs::spec_tuples, m)?)?;
    // `Preprocessor.balance` (private: the public names of `_native` are the ones
    // `_native.pyi` declares).
    m.add_function(wrap_pyfunction!(balance::balance_batches, m)?)?;
    // `sparsecore_prep.bess` re-exports these (a private submodule: the public names of
    // `_native` are the ones `_native.pyi` declares).
    let bess_module = PyModule::new(m.py(), "_bess")?;
    bess::register(&bess_module)?;
    m.add_submodule(&bess_module)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
