//! `Preprocessor.balance`: the crate's balancer (`sparsecore_prep::balance`) over pyarrow
//! record batches, window by window as `sparsecore-prep balance --window W` runs it.
//!
//! Why here and not in Python: the balancer counts each sample's ids exactly as the pipeline
//! does and moves every column's rows in one pass per column; the batches cross the boundary through
//! the Arrow C data interface both ways, so nothing is copied but the reordering itself.

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use sparsecore_prep::balance::{Balancer, IdLoad, Refinement};
use sparsecore_prep::Config;

use crate::arrow_input;
use crate::arrow_output::to_pyarrow;
use crate::errors::{field, raise, to_py, Class};

fn load<'py>(py: Python<'py>, l: &IdLoad) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("max_ids_per_partition", l.max_ids_per_partition)?;
    d.set_item("required_buffer", l.required_buffer)?;
    Ok(d)
}

/// Balances `batches` (Arrow record batches or tables of one schema) in windows of `window`
/// consecutive batches (the last may be shorter). Returns the reordered batches (pyarrow, one
/// per input batch, same sizes and schema), the permutation (int64: output row `j`, counting
/// rows over all batches in order, is input row `permutation[j]`) and one report dict per
/// window (`batches`, `reordered`, `outcome` and `outcome_stack` (why the input order was
/// kept, [`sparsecore_prep::balance::Outcome`]), `stacks`: name, before and after
/// (`max_ids_per_partition`, `required_buffer`), `lower_bound`). `refine` is `"worst-cell"`, `"every-stack"` or
/// `"unique-ids"` ([`Refinement`]).
#[pyfunction]
#[pyo3(name = "_balance")]
pub fn balance_batches<'py>(
    py: Python<'py>,
    config_json: &str,
    batches: &Bound<'py, PyAny>,
    window: usize,
    refine: &str,
) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyAny>, Bound<'py, PyList>)> {
    if window == 0 {
        return Err(raise(
            py,
            Class::Config,
            "balance: window must be at least 1 batch, got 0".into(),
            &[("field", field(py, "window"))],
        ));
    }
    let refinement = match refine {
        "worst-cell" => Refinement::WorstCell,
        "every-stack" => Refinement::EveryStack,
        "unique-ids" => Refinement::UniqueIds,
        other => {
            let message = format!("balance: refine must be \"worst-cell\", \"every-stack\" or \"unique-ids\", got {other:?}");
            return Err(raise(
                py,
                Class::Config,
                message,
                &[("field", field(py, "refine"))],
            ));
        }
    };
    let config = Config::from_json(config_json).map_err(|e| to_py(py, e))?;
    let mut input = Vec::new();
    for b in batches.try_iter()? {
        input.push(arrow_input::record_batch(&b?)?);
    }
    // Every window is balanced before anything is returned: a bad window raises and hands back
    // nothing, as the CLI writes nothing.
    let balanced = py
        .detach(|| {
            let mut balancer = Balancer::new(config)?.refinement(refinement);
            input
                .chunks(window)
                .map(|w| balancer.balance(w))
                .collect::<Result<Vec<_>, _>>()
        })
        .map_err(|e| to_py(py, e))?;
    let mut starts = Vec::with_capacity(input.len() + 1);
    starts.push(0usize);
    for b in &input {
        starts.push(starts.last().copied().unwrap_or(0) + b.num_rows());
    }
    let mut permutation: Vec<i64> = Vec::with_capacity(starts.last().copied().unwrap_or(0));
    let out = PyList::empty(py);
    let reports = PyList::empty(py);
    for (w, bal) in balanced.into_iter().enumerate() {
        let first = w * window;
        for rows in &bal.permutation {
            permutation.extend(
                rows.iter()
                    .map(|r| (starts[first + r.batch] + r.row) as i64),
            );
        }
        for b in bal.batches {
            out.append(to_pyarrow(py, b)?)?;
        }
        let r = &bal.report;
        let stacks = PyList::empty(py);
        for (k, name) in r.stacks.iter().enumerate() {
            let s = PyDict::new(py);
            s.set_item("name", name)?;
            s.set_item(
                "before",
                load(py, &r.before.get(k).copied().unwrap_or_default())?,
            )?;
            s.set_item(
                "after",
                load(py, &r.after.get(k).copied().unwrap_or_default())?,
            )?;
            s.set_item(
                "lower_bound",
                r.lower_bound.get(k).copied().unwrap_or_default(),
            )?;
            stacks.append(s)?;
        }
        let d = PyDict::new(py);
        d.set_item("batches", r.batches)?;
        d.set_item("reordered", r.reordered())?;
        d.set_item("outcome", r.outcome.name())?;
        d.set_item(
            "outcome_stack",
            r.outcome.stack_index().and_then(|k| r.stacks.get(k)),
        )?;
        d.set_item("stacks", stacks)?;
        reports.append(d)?;
    }
    Ok((out, PyArray1::from_vec(py, permutation).into_any(), reports))
}
