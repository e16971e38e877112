//! Reading the reference's `FeatureSpec`s for the drop-in call: `sparsecore_prep/_specs.py`'s
//! `_spec_tuple_fast` in Rust, for every feature of every call.
//!
//! The spec tuples are the drop-in cache's key (a spec changed in place, as FDO changes limits,
//! must be seen), so every call reads every attribute; done from Rust, that is a dozen
//! attribute look-ups a feature without a Python frame, and the tuples reuse the attribute
//! values' own `str` and `int` objects. Anything unusual (an attribute missing or raising, a
//! value that is not exactly a `str` or a non-negative `int`, a shape that is not a list or
//! tuple of such ints, a product past `u64`) makes [`spec_tuples`] return None, and the Python
//! code reads the specs itself: it accepts what `operator.index` and `str` accept, and names
//! the spec and the attribute in its errors.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList, PyString, PyTuple};

/// Why a spec was left to the Python code (never shown: the Python code gives the reason).
struct Unusual;

type Read<T> = Result<T, Unusual>;

fn attr<'py>(obj: &Bound<'py, PyAny>, name: &Bound<'py, PyString>) -> Read<Bound<'py, PyAny>> {
    obj.getattr(name).map_err(|_| Unusual)
}

/// `getattr(obj, name, None)`, as None for a missing attribute (Unusual for another exception,
/// whose handling the Python code decides).
fn attr_or_none<'py>(
    obj: &Bound<'py, PyAny>,
    name: &Bound<'py, PyString>,
) -> Read<Option<Bound<'py, PyAny>>> {
    match obj.getattr(name) {
        Ok(v) if v.is_none() => Ok(None),
        Ok(v) => Ok(Some(v)),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyAttributeError>(obj.py()) => Ok(None),
        Err(_) => Err(Unusual),
    }
}

/// An exact `str` (what `str(value)` returns unchanged).
fn text<'py>(value: Bound<'py, PyAny>) -> Read<Bound<'py, PyAny>> {
    if value.is_exact_instance_of::<PyString>() {
        Ok(value)
    } else {
        Err(Unusual)
    }
}

/// An exact non-negative `int` below 2**64 (what `_nonneg` returns unchanged), and its value.
fn count<'py>(value: Bound<'py, PyAny>) -> Read<(Bound<'py, PyAny>, u64)> {
    if !value.is_exact_instance_of::<PyInt>() {
        return Err(Unusual);
    }
    let n = value.extract::<u64>().map_err(|_| Unusual)?;
    Ok((value, n))
}

/// One spec's `((name, table, vocabulary_size, embedding_dim, global_batch), (stack, row_offset,
/// col_offset, col_shift), (combiner, max_ids, max_unique_ids, suggested_coo_buffer_size))`.
fn spec_tuple<'py>(spec: &Bound<'py, PyAny>) -> Read<Bound<'py, PyTuple>> {
    let py = spec.py();
    let table = attr(spec, intern!(py, "table_spec"))?;
    let stacked = attr(&table, intern!(py, "stacked_table_spec"))?;
    // The reference's FeatureSpec keeps the transformation in `_id_transformation` (None until
    // stacking sets it), and its `id_transformation` property asserts that it is set: the
    // property is read only from specs without the field.
    let transform = match spec.getattr(intern!(py, "_id_transformation")) {
        Ok(t) if t.is_none() => None,
        Ok(t) => Some(t),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyAttributeError>(py) => {
            attr_or_none(spec, intern!(py, "id_transformation"))?
        }
        Err(_) => return Err(Unusual),
    };
    let zero = || {
        0u64.into_pyobject(py)
            .map(|v| v.into_any())
            .map_err(|_| Unusual)
    };
    let (row_offset, col_offset, col_shift) = match &transform {
        None => (zero()?, zero()?, zero()?),
        Some(t) => (
            count(attr(t, intern!(py, "row_offset"))?)?.0,
            count(attr(t, intern!(py, "col_offset"))?)?.0,
            count(attr(t, intern!(py, "col_shift"))?)?.0,
        ),
    };
    let shape = match attr_or_none(spec, intern!(py, "output_shape"))? {
        Some(s) => Some(s),
        None => attr_or_none(spec, intern!(py, "input_shape"))?,
    };
    let global_batch = match shape {
        None => 0,
        Some(shape) => global_batch(&shape)?,
    };
    let dim = match attr_or_none(&table, intern!(py, "embedding_dim"))? {
        None => zero()?,
        Some(d) => count(d)?.0,
    };
    let suggested = match attr(
        &stacked,
        intern!(py, "suggested_coo_buffer_size_per_device"),
    )? {
        s if s.is_none() => s,
        s => count(s)?.0,
    };
    let setting = attr(&table, intern!(py, "setting_in_stack"))?;
    let tuple = |items: Vec<Bound<'py, PyAny>>| PyTuple::new(py, items).map_err(|_| Unusual);
    let feature = tuple(vec![
        text(attr(spec, intern!(py, "name"))?)?,
        text(attr(&table, intern!(py, "name"))?)?,
        count(attr(&table, intern!(py, "vocabulary_size"))?)?.0,
        dim,
        global_batch
            .into_pyobject(py)
            .map_err(|_| Unusual)?
            .into_any(),
    ])?;
    let placement = tuple(vec![
        text(attr(&setting, intern!(py, "stack_name"))?)?,
        row_offset,
        col_offset,
        col_shift,
    ])?;
    let limits = tuple(vec![
        text(attr(&stacked, intern!(py, "combiner"))?)?,
        count(attr(&stacked, intern!(py, "max_ids_per_partition"))?)?.0,
        count(attr(&stacked, intern!(py, "max_unique_ids_per_partition"))?)?.0,
        suggested,
    ])?;
    tuple(vec![
        feature.into_any(),
        placement.into_any(),
        limits.into_any(),
    ])
}

/// The product of all dimensions but the last (the only one for a 1-D shape; 0 for an empty
/// one), of a list or tuple of exact ints.
fn global_batch(shape: &Bound<'_, PyAny>) -> Read<u64> {
    let dims: Vec<u64> = if let Ok(list) = shape.cast::<PyList>() {
        list.iter()
            .map(|d| count(d).map(|c| c.1))
            .collect::<Read<_>>()?
    } else if let Ok(tuple) = shape.cast::<PyTuple>() {
        tuple
            .iter()
            .map(|d| count(d).map(|c| c.1))
            .collect::<Read<_>>()?
    } else {
        return Err(Unusual);
    };
    match dims.len() {
        0 => Ok(0),
        1 => Ok(dims[0]),
        n => dims[..n - 1]
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or(Unusual),
    }
}

/// The spec tuples of `leaves` as one tuple (the drop-in cache's key), or None when a spec
/// needs the Python code (see the module docs).
#[pyfunction]
pub fn spec_tuples<'py>(
    py: Python<'py>,
    leaves: &Bound<'py, PyList>,
) -> PyResult<Option<Bound<'py, PyTuple>>> {
    let mut out = Vec::with_capacity(leaves.len());
    for spec in leaves.iter() {
        match spec_tuple(&spec) {
            Ok(t) => out.push(t),
            Err(Unusual) => return Ok(None),
        }
    }
    PyTuple::new(py, out).map(Some)
}
