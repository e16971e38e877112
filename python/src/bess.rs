//! `sparsecore_prep.bess`: the `sparsecore-bess` crate (balanced entity sharding, shard-pair
//! batches, balanced negatives, and their SparseCore layout) for Python, numpy arrays out.
//!
//! Why a thin layer: every algorithm is the crate's, so Python gets the same bit-exact
//! sharding, partitions and draws as the Rust API and the CLI (the reference cases check both).
//! This module only converts: ids in as any integer numpy array, sequence or Arrow columns;
//! arrays out as numpy (int32 where besskge returns int32, int64 for tables); record batches out
//! as pyarrow; and every `BessError` as the Python class of the same name in
//! `sparsecore_prep.bess` (defined there, in Python, so that they pickle).

use std::sync::Arc;

use ndarray::{Array2, ArrayD, IxDyn};
use numpy::{PyArray1, PyArrayDyn, PyArrayMethods, PyUntypedArrayMethods, ToPyArray};
use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use sparsecore_bess::negative::PaddedNegatives;
use sparsecore_bess::{
    BatchOptions, BatchSampler, BessError, BessStream, Corruption, NegativeKind, NegativeSampler,
    NumpyRng, PartitionMode, PartitionedTriples, RandomNegative, SamplerKind, Sharding,
    StreamSampler, TripleBasedNegative, Triples, TypeBasedNegative,
};

use crate::arrow_output::to_pyarrow;
use crate::{arrow_input, errors};

// ---------------------------------------------------------------------------------------------
// Errors

/// `class(message, **fields)` of `sparsecore_prep.bess` (the base `BessError` if the class
/// cannot be found, which only a broken installation causes).
fn raise<'py>(
    py: Python<'py>,
    class: &str,
    message: String,
    fields: &[(&str, Option<Bound<'py, PyAny>>)],
) -> PyErr {
    let made = (|| -> PyResult<Bound<'py, PyAny>> {
        let kwargs = PyDict::new(py);
        for (name, value) in fields {
            if let Some(value) = value {
                kwargs.set_item(name, value)?;
            }
        }
        py.import("sparsecore_prep.bess")?
            .getattr(class)?
            .call((message.as_str(),), Some(&kwargs))
    })();
    match made {
        Ok(exc) => PyErr::from_value(exc),
        Err(_) => pyo3::exceptions::PyValueError::new_err(message),
    }
}

fn f<'py, T: IntoPyObject<'py>>(py: Python<'py>, v: T) -> Option<Bound<'py, PyAny>> {
    errors::field(py, v)
}

/// The keyword fields of an error class from the variant's bindings of the same names:
/// `fields!(py; column, row)` is `&[("column", f(py, column)), ("row", f(py, row))]`.
macro_rules! fields {
    ($py:ident; $($name:ident),*) => {
        &[$((stringify!($name), f($py, $name))),*]
    };
}

/// Maps the crate's error to its Python class, keeping the message and the facts as fields.
/// Pipeline errors (`BessError::Prep`) become the pipeline's own classes.
pub fn to_py(py: Python<'_>, e: BessError) -> PyErr {
    let message = e.to_string();
    match e {
        BessError::EntityOutOfRange {
            column,
            row,
            value,
            n_entity,
        } => raise(
            py,
            "EntityOutOfRangeError",
            message,
            fields!(py; column, row, value, n_entity),
        ),
        BessError::RelationOutOfRange {
            column,
            row,
            value,
            n_relation,
        } => raise(
            py,
            "RelationOutOfRangeError",
            message,
            fields!(py; column, row, value, n_relation),
        ),
        BessError::LengthMismatch {
            column,
            got,
            other,
            expected,
        } => raise(
            py,
            "LengthMismatchError",
            message,
            fields!(py; column, got, other, expected),
        ),
        BessError::MissingColumn { column } => {
            raise(py, "MissingColumnError", message, fields!(py; column))
        }
        BessError::ColumnType { column, found } => {
            raise(py, "ColumnTypeError", message, fields!(py; column, found))
        }
        BessError::NullValue { column, row } => {
            raise(py, "NullValueError", message, fields!(py; column, row))
        }
        BessError::EmptyPartition { sampler, partition } => raise(
            py,
            "EmptyPartitionError",
            message,
            fields!(py; sampler, partition),
        ),
        // Python's attribute keeps besskge's name `ppp`.
        BessError::ZeroTriplesPerBlock {
            shard_bs,
            positive_per_partition: ppp,
            n_shard,
            duplicate_batch,
            corruption,
            minimum,
        } => raise(
            py,
            "ZeroTriplesPerBlockError",
            message,
            fields!(py; shard_bs, ppp, n_shard, duplicate_batch, corruption, minimum),
        ),
        BessError::ShardCountMismatch {
            n_shard,
            num_sparsecores,
            global_devices,
            sc_per_device,
        } => raise(
            py,
            "ShardCountMismatchError",
            message,
            fields!(py; n_shard, num_sparsecores, global_devices, sc_per_device),
        ),
        BessError::InvalidParameter {
            name,
            value,
            reason,
        } => raise(
            py,
            "InvalidParameterError",
            message,
            fields!(py; name, value, reason),
        ),
        BessError::ShardingFile { path, reason } => {
            raise(py, "ShardingFileError", message, fields!(py; path, reason))
        }
        BessError::TooLarge {
            what,
            bytes,
            reason,
        } => raise(
            py,
            "TooLargeError",
            message,
            fields!(py; what, bytes, reason),
        ),
        BessError::Io { context, .. } => {
            let err = raise(py, "BessIOError", message.clone(), fields!(py; context));
            if err.is_instance_of::<PyOSError>(py) {
                err
            } else {
                PyOSError::new_err(message)
            }
        }
        BessError::Prep(e) => pipeline_error(py, e),
        _ => raise(py, "BessError", message, &[]),
    }
}

/// A pipeline error raised inside a BESS call: the pipeline's class (`ConfigError`, ...) as
/// `bess.Pipeline<class>`, a subclass of both that class and `BessError`, with its message and
/// fields (the pipeline's class itself if that cannot be made).
fn pipeline_error(py: Python<'_>, e: sparsecore_prep::Error) -> PyErr {
    let err = errors::to_py(py, e);
    let made = (|| -> PyResult<Bound<'_, PyAny>> {
        let value = err.value(py);
        let name = value.get_type().name()?.to_string();
        let class = py
            .import("sparsecore_prep.bess")?
            .getattr(format!("Pipeline{name}"))?;
        let fields = value.call_method0("field_values")?;
        class.call((value.getattr("message")?,), Some(fields.cast::<PyDict>()?))
    })();
    match made {
        Ok(exc) => PyErr::from_value(exc),
        Err(_) => err,
    }
}

/// An `InvalidParameterError` raised by this binding (a check the crate leaves to its callers).
fn param(
    py: Python<'_>,
    name: &'static str,
    value: impl std::fmt::Display,
    reason: impl Into<String>,
) -> PyErr {
    to_py(
        py,
        BessError::InvalidParameter {
            name,
            value: value.to_string(),
            reason: reason.into(),
        },
    )
}

trait OrPy<T> {
    fn py(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> OrPy<T> for Result<T, BessError> {
    fn py(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, e))
    }
}

// ---------------------------------------------------------------------------------------------
// Conversions

/// The seed's little-endian 32-bit words: a non-negative Python int of any size, or the words
/// themselves (a sequence of ints below 2^32, as the reference cases give them).
fn seed_words_of(py: Python<'_>, seed: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if let Ok(words) = seed.extract::<Vec<u64>>() {
        if let Some(&w) = words.iter().find(|&&w| w > u64::from(u32::MAX)) {
            return Err(param(py, "seed", w, "seed words must be below 2^32"));
        }
        return Ok(if words.is_empty() {
            vec![0]
        } else {
            words.into_iter().map(|w| w as u32).collect()
        });
    }
    // Any integer (numpy's too) through `operator.index`; not bools, floats or strings.
    let index = py.import("operator")?.getattr("index")?;
    let seed = match index.call1((seed,)) {
        Ok(i) if !seed.is_instance_of::<pyo3::types::PyBool>() => i,
        _ => {
            return Err(param(
                py,
                "seed",
                seed.repr()?,
                "must be a non-negative int or a list of 32-bit words",
            ))
        }
    };
    let seed = &seed;
    if seed.lt(0)? {
        return Err(param(py, "seed", seed.repr()?, "must be non-negative"));
    }
    let bits: usize = seed.call_method0("bit_length")?.extract()?;
    let nbytes = bits.div_ceil(32).max(1) * 4;
    let bytes: Vec<u8> = seed
        .call_method1("to_bytes", (nbytes, "little"))?
        .extract()?;
    Ok(bytes
        .chunks(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// A u64 seed (the stream builder's seeds).
fn seed_u64(py: Python<'_>, name: &'static str, seed: &Bound<'_, PyAny>) -> PyResult<u64> {
    seed.extract::<u64>().map_err(|_| {
        param(
            py,
            name,
            seed.repr().map(|r| r.to_string()).unwrap_or_default(),
            "must be an int in 0 ..= 2^64 - 1",
        )
    })
}

/// Any integer array-like as (shape, int64 values in C order); floats, bools and objects are a
/// `ColumnTypeError` naming `column`.
fn int_values(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    column: &str,
) -> PyResult<(Vec<usize>, Vec<i64>)> {
    let np = py.import("numpy")?;
    let a = np.call_method1("asarray", (obj,))?;
    let dtype = a.getattr("dtype")?;
    let kind: String = dtype.getattr("kind")?.extract()?;
    if kind != "i" && kind != "u" {
        return Err(to_py(
            py,
            BessError::ColumnType {
                column: column.to_string(),
                found: format!("numpy {}", dtype.str()?),
            },
        ));
    }
    if kind == "u" && a.getattr("size")?.extract::<usize>()? > 0 {
        // uint64 values above i64::MAX would wrap to negative ids: refuse them by value.
        let max: u128 = a.call_method0("max")?.extract()?;
        if max > i64::MAX as u128 {
            return Err(param(
                py,
                "ids",
                format!("column `{column}`: {max}"),
                "ids must fit in int64",
            ));
        }
    }
    let a = np.call_method1("ascontiguousarray", (a, "int64"))?;
    let a = a.cast::<PyArrayDyn<i64>>().map_err(PyErr::from)?;
    let ro = a.readonly();
    let shape = ro.shape().to_vec();
    let values = ro
        .as_slice()
        .map(<[i64]>::to_vec)
        .unwrap_or_else(|_| ro.as_array().iter().copied().collect());
    Ok((shape, values))
}

fn int_vec(py: Python<'_>, obj: &Bound<'_, PyAny>, column: &str) -> PyResult<Vec<i64>> {
    let (shape, v) = int_values(py, obj, column)?;
    if shape.len() != 1 {
        return Err(param(
            py,
            "ids",
            format!("column `{column}` of shape {shape:?}"),
            "must be 1-D",
        ));
    }
    Ok(v)
}

fn int_2d(py: Python<'_>, obj: &Bound<'_, PyAny>, column: &str) -> PyResult<Array2<i64>> {
    let (shape, v) = int_values(py, obj, column)?;
    match shape[..] {
        [r, c] => {
            Array2::from_shape_vec((r, c), v).map_err(|e| param(py, "ids", column, e.to_string()))
        }
        [c] => {
            Array2::from_shape_vec((1, c), v).map_err(|e| param(py, "ids", column, e.to_string()))
        }
        _ => Err(param(
            py,
            "ids",
            format!("column `{column}` of shape {shape:?}"),
            "must be 2-D (rows, k) or 1-D (one shared list)",
        )),
    }
}

fn opt_offsets(py: Python<'_>, obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<i64>>> {
    obj.filter(|o| !o.is_none())
        .map(|o| int_vec(py, o, "type_offsets"))
        .transpose()
}

fn opt_2d(
    py: Python<'_>,
    obj: Option<&Bound<'_, PyAny>>,
    column: &str,
) -> PyResult<Option<Array2<i64>>> {
    obj.filter(|o| !o.is_none())
        .map(|o| int_2d(py, o, column))
        .transpose()
}

fn np_vec<'py>(py: Python<'py>, v: &[i64]) -> Bound<'py, PyAny> {
    PyArray1::from_slice(py, v).into_any()
}

fn np_nd<'py, T: numpy::Element + Copy, D: ndarray::Dimension>(
    py: Python<'py>,
    a: &ndarray::Array<T, D>,
) -> Bound<'py, PyAny> {
    a.to_pyarray(py).into_any()
}

fn np_opt<'py, T: numpy::Element + Copy, D: ndarray::Dimension>(
    py: Python<'py>,
    a: &Option<ndarray::Array<T, D>>,
) -> Option<Bound<'py, PyAny>> {
    a.as_ref().map(|a| np_nd(py, a))
}

/// Puts the arrays that are there into `d` under their names, in order.
fn set_arrays<'py, const N: usize>(
    d: &Bound<'py, PyDict>,
    arrays: [(&str, Option<Bound<'py, PyAny>>); N],
) -> PyResult<()> {
    for (name, a) in arrays {
        if let Some(a) = a {
            d.set_item(name, a)?;
        }
    }
    Ok(())
}

fn corruption(py: Python<'_>, s: &str) -> PyResult<Corruption> {
    Corruption::parse(s).py(py)
}

/// Triples from an Arrow record batch / table (columns head, relation, tail), a mapping with
/// those keys, or a sequence `(head, relation, tail)`; or an `(N, 3)` integer array.
fn triples_of(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Triples> {
    if obj.hasattr("__arrow_c_array__")? || obj.hasattr("__arrow_c_stream__")? {
        let rb = arrow_input::record_batch(obj)?;
        return Triples::from_record_batch(&rb).py(py);
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        let col = |name: &str| -> PyResult<Vec<i64>> {
            let v = d.get_item(name)?.ok_or_else(|| {
                to_py(
                    py,
                    BessError::MissingColumn {
                        column: name.to_string(),
                    },
                )
            })?;
            int_vec(py, &v, name)
        };
        return Triples::new(col("head")?, col("relation")?, col("tail")?).py(py);
    }
    if obj.is_instance_of::<PyTuple>() || obj.is_instance_of::<PyList>() {
        let items: Vec<Bound<'_, PyAny>> = obj.try_iter()?.collect::<PyResult<_>>()?;
        if items.len() == 3 {
            return Triples::new(
                int_vec(py, &items[0], "head")?,
                int_vec(py, &items[1], "relation")?,
                int_vec(py, &items[2], "tail")?,
            )
            .py(py);
        }
    }
    let (shape, v) = int_values(py, obj, "triples")?;
    match shape[..] {
        [_, 3] => Ok(Triples::from_rows(&v.chunks(3).map(|c| [c[0], c[1], c[2]]).collect::<Vec<_>>())),
        _ => Err(param(py, "triples", format!("shape {shape:?}"), "give an Arrow batch with head/relation/tail, (head, relation, tail) arrays, or an (N, 3) array")),
    }
}

// ---------------------------------------------------------------------------------------------
// The generator

/// The seed's little-endian base-2^32 digits, which is what numpy's SeedSequence consumes.
#[pyfunction]
pub fn seed_words(py: Python<'_>, seed: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    seed_words_of(py, seed)
}

/// numpy's `default_rng(seed)` (SeedSequence + PCG64), bit for bit, with the draws besskge
/// makes. `seed`: a non-negative int of any size, or its 32-bit words.
#[pyclass(module = "sparsecore_prep.bess", name = "NumpyRng")]
pub struct PyNumpyRng {
    rng: NumpyRng,
}

#[pymethods]
impl PyNumpyRng {
    #[new]
    fn new(py: Python<'_>, seed: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(PyNumpyRng {
            rng: NumpyRng::from_words(&seed_words_of(py, seed)?),
        })
    }

    /// `size` raw 64-bit outputs (`bit_generator.random_raw(size)`), uint64.
    fn random_raw<'py>(&mut self, py: Python<'py>, size: usize) -> PyResult<Bound<'py, PyAny>> {
        let mut v: Vec<u64> = draws(size)?;
        v.extend((0..size).map(|_| self.rng.next_u64()));
        Ok(PyArray1::from_vec(py, v).into_any())
    }

    /// `integers(high, size=size)` for the two bounds besskge draws with: `2**63` (the batch
    /// sampler) and `2**31` (the negative samplers, which share numpy's buffered 32-bit
    /// half-words across calls). int64.
    fn integers<'py>(
        &mut self,
        py: Python<'py>,
        high: u64,
        size: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let mut v: Vec<i64> = match high {
            h if h == 1 << 63 || h == 1 << 31 => draws(size)?,
            _ => {
                return Err(param(
                    py,
                    "high",
                    high,
                    "only 2**63 and 2**31 (the bounds besskge draws with) are implemented",
                ))
            }
        };
        if high == 1 << 63 {
            v.extend((0..size).map(|_| self.rng.integers_63() as i64));
        } else {
            v.extend((0..size).map(|_| i64::from(self.rng.integers_31())));
        }
        Ok(PyArray1::from_vec(py, v).into_any())
    }

    /// `permutation(m)`, int64.
    fn permutation<'py>(&mut self, py: Python<'py>, m: usize) -> PyResult<Bound<'py, PyAny>> {
        // The generator's own vector of `m` positions is the same size: asked for first.
        drop(draws::<usize>(m)?);
        let v: Vec<i64> = self
            .rng
            .permutation(m)
            .into_iter()
            .map(|x| x as i64)
            .collect();
        Ok(PyArray1::from_vec(py, v).into_any())
    }
}

/// An empty vector with room for `size` draws, or Python's `MemoryError` (numpy's answer to
/// the same call) where the allocator refuses it, rather than an abort.
fn draws<T>(size: usize) -> PyResult<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(size).map_err(|_| {
        pyo3::exceptions::PyMemoryError::new_err(format!("cannot allocate {size} draws"))
    })?;
    Ok(v)
}

// ---------------------------------------------------------------------------------------------
// Sharding

/// A random, balanced mapping of entities to shards and local ids (besskge's `Sharding`).
#[pyclass(module = "sparsecore_prep.bess", name = "Sharding", frozen)]
pub struct PySharding {
    pub(crate) inner: Arc<Sharding>,
}

/// A class's `#[pymethods]`, its read-only properties written one a line first:
/// `name: Type = expr;` is `#[getter] fn name<'py>(&self, py: Python<'py>) -> Type`, where
/// `expr` reads `self.inner` as `$inner` (and the GIL token as `$py`). The other methods follow
/// as they are. (`#[pymethods]` expands no macro inside its block, so this one writes the block.)
macro_rules! pymethods_with_getters {
    ($class:ty, |$inner:ident, $py:ident| { $($(#[doc = $doc:tt])* $name:ident: $ret:ty = $value:expr;)* } $($methods:tt)*) => {
        #[pymethods]
        impl $class {
            $(
                $(#[doc = $doc])*
                #[getter]
                #[allow(unused_variables)] // not every getter needs `py`
                fn $name<'py>(&self, $py: Python<'py>) -> $ret {
                    let $inner = &self.inner;
                    $value
                }
            )*

            $($methods)*
        }
    };
}

pymethods_with_getters! { PySharding, |s, py| {
    /// Number of shards `n`.
    n_shard: usize = s.n_shard;
    /// Number of entities `E`.
    n_entity: usize = s.n_entity();
    /// Slots per shard `M = ceil(E / n)`.
    max_entity_per_shard: usize = s.max_entity_per_shard();
    /// `[E]` int64: the shard of each entity.
    entity_to_shard: Bound<'py, PyAny> = np_vec(py, &s.entity_to_shard);
    /// `[E]` int64: the local id of each entity on its shard.
    entity_to_idx: Bound<'py, PyAny> = np_vec(py, &s.entity_to_idx);
    /// `[n, M]` int64: the global id at (shard, local id); ids `>= E` are padding.
    shard_and_idx_to_entity: Bound<'py, PyAny> = np_nd(py, &s.shard_and_idx_to_entity);
    /// `[n]` int64: real entities per shard.
    shard_counts: Bound<'py, PyAny> = np_vec(py, &s.shard_counts);
    /// `[n, T]` int64 entities of each type per shard, or None (untyped).
    entity_type_counts: Option<Bound<'py, PyAny>> = np_opt(py, &s.entity_type_counts);
    /// `[n, T]` int64 first local id of each type per shard, or None (untyped).
    entity_type_offsets: Option<Bound<'py, PyAny>> = np_opt(py, &s.entity_type_offsets);
}
    /// `Sharding.create(n_entity, n_shard, seed, type_offsets)`, bit for bit.
    #[staticmethod]
    #[pyo3(signature = (n_entity, n_shard, seed, type_offsets=None))]
    fn create(py: Python<'_>, n_entity: usize, n_shard: usize, seed: &Bound<'_, PyAny>, type_offsets: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let words = seed_words_of(py, seed)?;
        let offsets = opt_offsets(py, type_offsets)?;
        let s = py.detach(|| Sharding::create(n_entity, n_shard, &words, offsets.as_deref())).py(py)?;
        Ok(PySharding { inner: Arc::new(s) })
    }

    /// Reads a `.npz` written by besskge's `Sharding.save` or by :meth:`save_npz`; every array
    /// is checked against the others.
    #[staticmethod]
    fn load_npz(py: Python<'_>, path: std::path::PathBuf) -> PyResult<Self> {
        Ok(PySharding { inner: Arc::new(py.detach(|| Sharding::load_npz(&path)).py(py)?) })
    }

    /// Writes the sharding as besskge's `Sharding.save` does (int64 arrays).
    fn save_npz(&self, py: Python<'_>, path: std::path::PathBuf) -> PyResult<()> {
        py.detach(|| self.inner.save_npz(&path)).py(py)
    }

    /// A sharding from its arrays (e.g. a besskge `Sharding`'s fields), validated.
    #[staticmethod]
    #[pyo3(signature = (n_shard, entity_to_shard, entity_to_idx, shard_and_idx_to_entity, shard_counts, entity_type_counts=None, entity_type_offsets=None))]
    #[allow(clippy::too_many_arguments)]
    fn from_arrays(
        py: Python<'_>,
        n_shard: usize,
        entity_to_shard: &Bound<'_, PyAny>,
        entity_to_idx: &Bound<'_, PyAny>,
        shard_and_idx_to_entity: &Bound<'_, PyAny>,
        shard_counts: &Bound<'_, PyAny>,
        entity_type_counts: Option<&Bound<'_, PyAny>>,
        entity_type_offsets: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let s = Sharding {
            n_shard,
            entity_to_shard: int_vec(py, entity_to_shard, "entity_to_shard")?,
            entity_to_idx: int_vec(py, entity_to_idx, "entity_to_idx")?,
            shard_and_idx_to_entity: int_2d(py, shard_and_idx_to_entity, "shard_and_idx_to_entity")?,
            shard_counts: int_vec(py, shard_counts, "shard_counts")?,
            entity_type_counts: opt_2d(py, entity_type_counts, "entity_type_counts")?,
            entity_type_offsets: opt_2d(py, entity_type_offsets, "entity_type_offsets")?,
        };
        s.validate().py(py)?;
        Ok(PySharding { inner: Arc::new(s) })
    }

    /// `(shard, local id)` of entity `entity`.
    fn locate(&self, py: Python<'_>, entity: i64) -> PyResult<(usize, usize)> {
        self.inner.locate(entity, "entity", 0).py(py)
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.cast::<PySharding>().is_ok_and(|o| *o.get().inner == *self.inner)
    }

    fn __repr__(&self) -> String {
        format!(
            "Sharding(n_entity={}, n_shard={}, max_entity_per_shard={}, typed={})",
            self.inner.n_entity(),
            self.inner.n_shard,
            self.inner.max_entity_per_shard(),
            self.inner.entity_type_counts.is_some()
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Partitioned triples

/// Triples sorted (stably) by the shards of their head and tail, with local entity ids
/// (besskge's `PartitionedTripleSet`).
#[pyclass(module = "sparsecore_prep.bess", name = "PartitionedTriples", frozen)]
pub struct PyPartitioned {
    inner: Arc<PartitionedTriples>,
}

/// `PartitionedTriples`'s methods, as `pymethods_with_getters!` with the constructors first.
/// They differ only in the arguments the triples are read from and share the partitioning
/// options (`mode`, `n_relation`, `inverse_triples`, `type_offsets`, `neg_heads`, `neg_tails`),
/// written here once: a constructor is given as its attributes, its name, its own arguments
/// (after `py` and `sharding`) and a block that makes the `Triples` from them.
macro_rules! partitioned_pymethods {
    (
        $($(#[$($attr:tt)*])* fn $ctor:ident($py:ident, $sharding:ident, $($arg:ident),+) $triples:tt)+
        getters |$inner:ident, $gpy:ident| $getters:tt
        $($methods:tt)*
    ) => {
        pymethods_with_getters! { PyPartitioned, |$inner, $gpy| $getters
            $(
                $(#[$($attr)*])*
                #[pyo3(signature = ($sharding, $($arg),+, *, mode="ht_shardpair", n_relation=None, inverse_triples=false, type_offsets=None, neg_heads=None, neg_tails=None))]
                #[allow(clippy::too_many_arguments)]
                fn $ctor(
                    $py: Python<'_>,
                    $sharding: PyRef<'_, PySharding>,
                    $($arg: &Bound<'_, PyAny>,)+
                    mode: &str,
                    n_relation: Option<usize>,
                    inverse_triples: bool,
                    type_offsets: Option<&Bound<'_, PyAny>>,
                    neg_heads: Option<&Bound<'_, PyAny>>,
                    neg_tails: Option<&Bound<'_, PyAny>>,
                ) -> PyResult<Self> {
                    let triples: Triples = $triples;
                    let mode = PartitionMode::parse(mode).py($py)?;
                    let mut b = PartitionedTriples::builder($sharding.inner.clone(), mode).inverse_triples(inverse_triples);
                    if let Some(r) = n_relation {
                        b = b.n_relation(r);
                    }
                    if let Some(o) = opt_offsets($py, type_offsets)? {
                        b = b.type_offsets(o);
                    }
                    if let Some(a) = opt_2d($py, neg_heads, "neg_heads")? {
                        b = b.neg_heads(a);
                    }
                    if let Some(a) = opt_2d($py, neg_tails, "neg_tails")? {
                        b = b.neg_tails(a);
                    }
                    let part = $py.detach(|| b.build(&triples)).py($py)?;
                    Ok(PyPartitioned { inner: Arc::new(part) })
                }
            )+

            $($methods)*
        }
    };
}

partitioned_pymethods! {
    /// Partitions triples `(head[i], relation[i], tail[i])` (global ids).
    ///
    /// `mode`: `ht_shardpair` (or `ht`), `h_shard` (`h`), `t_shard` (`t`). `n_relation`: ids are
    /// checked against it, and inverse triples get relation `r + n_relation`. `type_offsets`:
    /// entity types by global id ranges `[0, o1, ...]` (for TypeBased negatives).
    /// `neg_heads` / `neg_tails`: `(N0 or 1, k)` global ids in input order (for TripleBased).
    #[new]
    fn new(py, sharding, head, relation, tail) {
        Triples::new(int_vec(py, head, "head")?, int_vec(py, relation, "relation")?, int_vec(py, tail, "tail")?).py(py)?
    }

    /// From an Arrow record batch or table (any `__arrow_c_array__` / `__arrow_c_stream__`
    /// object) with Int32/Int64 columns `head`, `relation`, `tail`.
    #[staticmethod]
    fn from_arrow(py, sharding, batch) {
        Triples::from_record_batch(&arrow_input::record_batch(batch)?).py(py)?
    }

    getters |p, py| {
        /// The sharding used.
        sharding: PySharding = PySharding { inner: p.sharding.clone() };
        /// `ht_shardpair`, `h_shard` or `t_shard`.
        mode: &'static str = p.mode.as_str();
        /// Whether inverse triples were appended.
        inverse_triples: bool = p.inverse_triples;
        /// Number of shards.
        n_shard: usize = p.n_shard();
        /// Number of partitions (`n²` or `n`).
        n_partitions: usize = p.n_partitions();
        /// `[N, 3]` int64 sorted triples; entity columns are local ids where the mode says so.
        triples: Bound<'py, PyAny> = np_nd(py, &p.triples);
        /// Triples per partition: `[n, n]` for shard pairs, `[n]` otherwise (int64).
        triple_counts: PyResult<Bound<'py, PyAny>> = partition_shaped(py, p, &p.triple_counts);
        /// Exclusive prefix sum of `triple_counts`, same shape.
        triple_offsets: PyResult<Bound<'py, PyAny>> = partition_shaped(py, p, &p.triple_offsets);
        /// `[N]` int64: sorted row `i` is input row `triple_sort_idx[i]`.
        triple_sort_idx: Bound<'py, PyAny> = np_vec(py, &p.triple_sort_idx);
        /// `[N, 2]` head and tail entity types, or None (untyped).
        types: Option<Bound<'py, PyAny>> = np_opt(py, &p.types);
        /// `[1 or N, k]` negative heads in sorted order, or None.
        neg_heads: Option<Bound<'py, PyAny>> = np_opt(py, &p.neg_heads);
        /// `[1 or N, k]` negative tails in sorted order, or None.
        neg_tails: Option<Bound<'py, PyAny>> = np_opt(py, &p.neg_tails);
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "PartitionedTriples({} triples, mode={}, n_shard={}, inverse_triples={})",
            self.inner.len(),
            self.inner.mode.as_str(),
            self.inner.n_shard(),
            self.inner.inverse_triples
        )
    }
}

/// Per-partition counts as numpy: `[n, n]` for shard pairs, `[n]` otherwise.
fn partition_shaped<'py>(
    py: Python<'py>,
    part: &PartitionedTriples,
    v: &[i64],
) -> PyResult<Bound<'py, PyAny>> {
    let n = part.n_shard();
    let a = np_vec(py, v);
    if part.mode == PartitionMode::HtShardPair {
        a.call_method1("reshape", ((n, n),))
    } else {
        Ok(a)
    }
}

// ---------------------------------------------------------------------------------------------
// Negative samplers

/// A negative sampler's output as a dict of numpy arrays (besskge's keys).
fn negative_dict<'py>(
    py: Python<'py>,
    o: &sparsecore_bess::NegativeOutput,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    set_arrays(
        &d,
        [
            ("negative", Some(np_nd(py, &o.negative))),
            ("negative_mask", np_opt(py, &o.mask)),
            ("negative_sort_idx", np_opt(py, &o.sort_idx)),
        ],
    )?;
    Ok(d)
}

fn sample_with(
    py: Python<'_>,
    ns: &mut NegativeSampler,
    part: &PartitionedTriples,
    sample_idx: &Bound<'_, PyAny>,
) -> PyResult<Py<PyDict>> {
    let (shape, v) = int_values(py, sample_idx, "sample_idx")?;
    let idx = ArrayD::from_shape_vec(IxDyn(&shape), v)
        .map_err(|e| param(py, "sample_idx", "shape", e.to_string()))?;
    let out = py.detach(|| ns.sample(part, &idx)).py(py)?;
    Ok(negative_dict(py, &out)?.unbind())
}

/// A negative sampler's class (a `NegativeSampler` inside, which a `BatchSampler` copies):
/// its doc and Python name, the doc of its `sample`, and its own methods (constructor, getters),
/// to which this adds the two all three share, `sample` and `corruption_scheme`.
macro_rules! negative_sampler_class {
    (
        $(#[doc = $doc:tt])* #[pyclass(name = $name:tt)] pub struct $class:ident;
        $(#[doc = $sample_doc:tt])* fn sample;
        $($methods:tt)*
    ) => {
        $(#[doc = $doc])*
        #[pyclass(module = "sparsecore_prep.bess", name = $name)]
        pub struct $class {
            inner: NegativeSampler,
        }

        #[pymethods]
        impl $class {
            $($methods)*

            $(#[doc = $sample_doc])*
            fn sample(&mut self, py: Python<'_>, partitioned: PyRef<'_, PyPartitioned>, sample_idx: &Bound<'_, PyAny>) -> PyResult<Py<PyDict>> {
                sample_with(py, &mut self.inner, &partitioned.inner, sample_idx)
            }

            #[getter]
            fn corruption_scheme(&self) -> &'static str {
                self.inner.corruption().as_str()
            }
        }
    };
}

negative_sampler_class! {
    /// Uniform negatives from every shard (besskge's `RandomShardedNegativeSampler`), bit for bit.
    #[pyclass(name = "RandomNegativeSampler")]
    pub struct PyRandomNegative;

    /// Negatives for `sample_idx` (`(bps, *blk, q)` indices into `partitioned.triples`):
    /// `{"negative": int32 array}` (shapes as besskge's). Advances the generator.
    fn sample;

    /// `n_negative` per shard block; `seed` (int or words); `corruption_scheme` `h`, `t` or
    /// `ht`; `local_sampling` (changes no value, only how a model reads the axes);
    /// `flat_negative_format`: one list per block (two for `ht`) instead of one per triple.
    #[new]
    #[pyo3(signature = (n_negative, seed, corruption_scheme="t", local_sampling=false, flat_negative_format=false))]
    fn new(py: Python<'_>, n_negative: usize, seed: &Bound<'_, PyAny>, corruption_scheme: &str, local_sampling: bool, flat_negative_format: bool) -> PyResult<Self> {
        let words = seed_words_of(py, seed)?;
        let r = RandomNegative::new(n_negative, &words, corruption(py, corruption_scheme)?, local_sampling, flat_negative_format).py(py)?;
        Ok(PyRandomNegative { inner: NegativeSampler::Random(r) })
    }

    #[getter]
    fn n_negative(&self) -> usize {
        match &self.inner {
            NegativeSampler::Random(r) => r.n_negative,
            _ => 0,
        }
    }
}

negative_sampler_class! {
    /// Negatives of the corrupted side's entity type (besskge's `TypeBasedShardedNegativeSampler`).
    /// Needs a typed sharding and partition (`type_offsets`).
    #[pyclass(name = "TypeBasedNegativeSampler")]
    pub struct PyTypeBasedNegative;

    /// Negatives for `sample_idx`; see `RandomNegativeSampler.sample`.
    fn sample;

    /// `local_sampling`: the type comes from the triples processed on the sampling shard (True)
    /// or on the shard that uses the negatives (False).
    #[new]
    #[pyo3(signature = (n_negative, seed, corruption_scheme="t", local_sampling=false))]
    fn new(py: Python<'_>, n_negative: usize, seed: &Bound<'_, PyAny>, corruption_scheme: &str, local_sampling: bool) -> PyResult<Self> {
        let words = seed_words_of(py, seed)?;
        let r = TypeBasedNegative::new(n_negative, &words, corruption(py, corruption_scheme)?, local_sampling).py(py)?;
        Ok(PyTypeBasedNegative { inner: NegativeSampler::TypeBased(r) })
    }
}

negative_sampler_class! {
    /// Given negatives per triple or shared (besskge's `TripleBasedShardedNegativeSampler`),
    /// regrouped by shard and cyclically padded to one length, with a mask. Reads the partitioned
    /// set's `neg_heads` / `neg_tails`.
    #[pyclass(name = "TripleBasedNegativeSampler")]
    pub struct PyTripleBasedNegative;

    /// Negatives (and mask, sort index) for `sample_idx`; see `RandomNegativeSampler.sample`.
    fn sample;

    /// `mask_on_gather`: the mask in the layout of `negative` (True) or
    /// `(bps, n_a, F, n_sn, L)` (False); `return_sort_idx` adds `negative_sort_idx`.
    #[new]
    #[pyo3(signature = (partitioned, corruption_scheme="t", mask_on_gather=false, return_sort_idx=false))]
    fn new(py: Python<'_>, partitioned: PyRef<'_, PyPartitioned>, corruption_scheme: &str, mask_on_gather: bool, return_sort_idx: bool) -> PyResult<Self> {
        let c = corruption(py, corruption_scheme)?;
        let part = partitioned.inner.clone();
        let tb = py.detach(|| TripleBasedNegative::new(&part, c, mask_on_gather, return_sort_idx)).py(py)?;
        Ok(PyTripleBasedNegative { inner: NegativeSampler::TripleBased(Box::new(tb)) })
    }

    /// Whether one shared list is used for every triple.
    #[getter]
    fn flat_negative_format(&self) -> bool {
        self.tb().flat_negative_format
    }
    /// Negatives per list, `k`.
    #[getter]
    fn n_negative(&self) -> usize {
        self.tb().n_negative
    }
    /// Padded length per shard, `L`.
    #[getter]
    fn padded_shard_length(&self) -> usize {
        self.tb().padded_shard_length
    }
    /// Rows of the padded tables (`N`, or 1 for a shared list).
    #[getter]
    fn rows(&self) -> usize {
        let tb = self.tb();
        tb.heads.as_ref().or(tb.tails.as_ref()).map_or(0, |t| t.sort_idx.nrows())
    }
    /// The heads' tables (`h` and `ht`): `{"sort_idx": [N, k] int32, "padded": [N, n, L]
    /// int64, "mask": [N, n, L] bool}`, or None.
    #[getter]
    fn heads<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        padded_dict(py, self.tb().heads.as_ref())
    }
    /// The tails' tables (`t` and `ht`), as `heads`.
    #[getter]
    fn tails<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        padded_dict(py, self.tb().tails.as_ref())
    }
}

fn padded_dict<'py>(
    py: Python<'py>,
    p: Option<&PaddedNegatives>,
) -> PyResult<Option<Bound<'py, PyDict>>> {
    p.map(|p| {
        let d = PyDict::new(py);
        d.set_item("sort_idx", np_nd(py, &p.sort_idx))?;
        d.set_item("padded", np_nd(py, &p.padded))?;
        d.set_item("mask", np_nd(py, &p.mask))?;
        Ok(d)
    })
    .transpose()
}

impl PyTripleBasedNegative {
    fn tb(&self) -> &TripleBasedNegative {
        match &self.inner {
            NegativeSampler::TripleBased(tb) => tb,
            _ => unreachable!("constructed as TripleBased"),
        }
    }
}

fn negative_of(
    py: Python<'_>,
    obj: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<NegativeSampler>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    // A copy of the sampler's current state.
    if let Ok(s) = obj.cast::<PyRandomNegative>() {
        return Ok(Some(s.borrow().inner.clone()));
    }
    if let Ok(s) = obj.cast::<PyTypeBasedNegative>() {
        return Ok(Some(s.borrow().inner.clone()));
    }
    if let Ok(s) = obj.cast::<PyTripleBasedNegative>() {
        return Ok(Some(s.borrow().inner.clone()));
    }
    Err(param(
        py,
        "negative_sampler",
        obj.get_type().name()?,
        "must be a RandomNegativeSampler, TypeBasedNegativeSampler or TripleBasedNegativeSampler",
    ))
}

// ---------------------------------------------------------------------------------------------
// Batch sampler

/// A sharded batch sampler with its negative sampler (besskge's `RandomShardedBatchSampler` /
/// `RigidShardedBatchSampler`): every step takes the same number of triples from every
/// partition.
#[pyclass(module = "sparsecore_prep.bess", name = "BatchSampler")]
pub struct PyBatchSampler {
    inner: BatchSampler,
}

pymethods_with_getters! { PyBatchSampler, |b, py| {
    /// Triples per partition block per batch.
    positive_per_partition: usize = b.geometry().positive_per_partition;
    /// `batches_per_step * positive_per_partition`.
    partition_sample_size: usize = b.geometry().partition_sample_size;
    /// Steps in one epoch.
    steps_per_epoch: usize = b.steps_per_epoch();
    /// Fraction of Rigid's positions over one epoch that are padding.
    rigid_padding_fraction: f64 = b.rigid_padding_fraction();
}

    /// `sampler`: `random` (uniform with replacement in every partition, from
    /// `default_rng(seed)`) or `rigid` (every partition read cyclically at the same positions,
    /// padded, with `triple_mask`). `shuffle` (rigid): shuffle each epoch's positions with
    /// *our* generator seeded by `seed` (besskge uses torch's, which is not reproduced).
    /// `negative_sampler`: one of the three samplers; the batch sampler takes a copy of its
    /// current state.
    #[new]
    #[pyo3(signature = (partitioned, shard_bs, *, sampler="random", seed=None, shuffle=false, batches_per_step=1, duplicate_batch=false, return_triple_idx=false, negative_sampler=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        partitioned: PyRef<'_, PyPartitioned>,
        shard_bs: usize,
        sampler: &str,
        seed: Option<&Bound<'_, PyAny>>,
        shuffle: bool,
        batches_per_step: usize,
        duplicate_batch: bool,
        return_triple_idx: bool,
        negative_sampler: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let words = seed.map(|s| seed_words_of(py, s)).transpose()?;
        let kind = match (sampler, words) {
            ("random", Some(w)) => SamplerKind::Random { seed_words: w },
            ("random", None) => return Err(param(py, "seed", "None", "the random batch sampler needs a seed")),
            ("rigid", w) if !shuffle => {
                let _ = w;
                SamplerKind::Rigid { shuffle: None }
            }
            ("rigid", Some(w)) => SamplerKind::Rigid { shuffle: Some(w) },
            ("rigid", None) => return Err(param(py, "seed", "None", "a shuffled rigid sampler needs a seed")),
            (other, _) => return Err(param(py, "sampler", other, "must be random or rigid")),
        };
        let negative = negative_of(py, negative_sampler)?;
        let part = partitioned.inner.clone();
        let options = BatchOptions { shard_bs, batches_per_step, duplicate_batch, return_triple_idx, kind };
        Ok(PyBatchSampler { inner: BatchSampler::new(part, options, negative).py(py)? })
    }

    /// One call of the sampler (besskge's `__getitem__`): a dict of numpy arrays with
    /// besskge's keys: `head`, `relation`, `tail` (int32, local ids where the mode says so;
    /// `tail` transposed for shard pairs), and where they apply `triple_mask`, `negative`,
    /// `negative_mask`, `negative_sort_idx`, `triple_idx`. Random ignores `step` (its stream
    /// continues); Rigid takes the positions of `step`.
    fn sample(&mut self, py: Python<'_>, step: usize) -> PyResult<Py<PyDict>> {
        let b = py.detach(|| self.inner.sample(step)).py(py)?;
        let d = PyDict::new(py);
        set_arrays(
            &d,
            [
                ("head", Some(np_nd(py, &b.head))),
                ("relation", Some(np_nd(py, &b.relation))),
                ("tail", Some(np_nd(py, &b.tail))),
                ("triple_mask", np_opt(py, &b.triple_mask)),
                ("negative", np_opt(py, &b.negative)),
                ("negative_mask", np_opt(py, &b.negative_mask)),
                ("negative_sort_idx", np_opt(py, &b.negative_sort_idx)),
                ("triple_idx", np_opt(py, &b.triple_idx)),
            ],
        )?;
        Ok(d.unbind())
    }

    fn __getitem__(&mut self, py: Python<'_>, step: usize) -> PyResult<Py<PyDict>> {
        self.sample(py, step)
    }

    /// besskge's `len`: steps per epoch (random) or the padded partition length (rigid).
    fn __len__(&self) -> usize {
        self.inner.len()
    }

}

// ---------------------------------------------------------------------------------------------
// The SparseCore stream

/// BESS batches laid out for SparseCores, as pyarrow record batches.
///
/// Shards are the global SparseCores (``n = N = G * S``): entity (shard ``s``,
/// local id ``i``) gets the physical id ``i * N + ((s - col_shift) mod N)``,
/// which the pipeline sends to partition ``s``; in step ``t`` SparseCore ``g``
/// takes block ``(i, (i + g + t) mod n)`` of every head shard ``i``, so every
/// (SparseCore, partition) cell receives exactly ``ppp`` heads, ``ppp`` tails and
/// ``B * K`` negatives. ``config_json`` is the config (one table ``entities``,
/// features ``head``, ``tail`` and ``negative``) whose limits are those counts;
/// give it to :class:`sparsecore_prep.Preprocessor`.
///
/// Iterating yields one ``pyarrow.RecordBatch`` per step (``steps`` of them;
/// default one epoch). Columns: ``head``, ``tail`` (``List<Int64>`` of one
/// physical id), ``relation`` (Int32), ``triple_mask`` (Bool), and with
/// negatives ``negative`` (``List<Int64>``) and, for TripleBased, ``negative_mask``;
/// with ``annotations=True`` also ``triple_idx``, ``negative_shard``,
/// ``negative_triple``, ``negative_side``.
///
/// Args:
///   triples: a pyarrow RecordBatch / Table (or any Arrow PyCapsule producer)
///     with Int32/Int64 columns ``head``, ``relation``, ``tail``; or a dict with
///     those keys; or ``(head, relation, tail)`` arrays; or an ``(N, 3)`` array.
///     Global entity ids.
///   n_entity: number of entities ``E``.
///   shard_batch_size: positive triples per SparseCore per batch (``shard_bs``).
///   devices: ``(L, G, S)``: local devices, global devices, SparseCores per device.
///   host: which host this stream feeds (``0 .. G / L``).
///   col_shift: the entity table's rotation in its stack.
///   embedding_dim: the table's embedding dimension in the config.
///   negatives: negatives per shard per list, ``K`` (0: no negatives feature).
///   negative_sampler: ``random``, ``type_based`` (needs ``type_offsets``) or
///     ``triple_based`` (needs ``neg_heads`` / ``neg_tails``, ``(N0 or 1, k)``).
///   corruption_scheme: ``h``, ``t`` or ``ht``.
///   flat_negatives: one negative list per SparseCore slice (and side) instead
///     of one per triple (default False: one list per triple, as besskge's
///     ``flat_negative_format`` and the CLI default).
///   sampler: ``random`` or ``rigid``; ``shuffle`` shuffles rigid's positions
///     with our own seeded generator.
///   seed: one seed for the sharding, batch and negative samplers; or
///     ``seeds=(sharding, batch, negative)``.
///   steps: steps to yield, at least 1 (default: one epoch).
///   max_step_bytes: refuse (``TooLargeError``, before anything is drawn) a
///     configuration whose step needs more bytes than this (default: only what
///     the allocator refuses).
///   inverse_triples: append ``(t, r + n_relation, h)``; ``n_relation``
///     defaults to the largest relation id + 1.
///   sharding: reuse a :class:`Sharding` (e.g. a besskge one loaded from
///     ``.npz``) instead of creating one.
///   annotations: add the annotation columns and keep the samplers' arrays
///     (see ``draw_annotated``).
///
#[pyclass(module = "sparsecore_prep.bess", name = "BessStream")]
pub struct PyBessStream {
    inner: BessStream,
    config_json: String,
    rigid: bool,
}

#[pymethods]
impl PyBessStream {
    /// Validates everything and computes the config (see the class docs).
    #[new]
    #[pyo3(signature = (triples, n_entity, shard_batch_size, *, devices=(1, 1, 4), host=0, col_shift=0, embedding_dim=16,
                        negatives=0, negative_sampler="random", type_offsets=None, neg_heads=None, neg_tails=None,
                        corruption_scheme="t", flat_negatives=false, sampler="random", shuffle=false, seed=None, seeds=None,
                        steps=None, max_step_bytes=None, inverse_triples=false, n_relation=None, sharding=None, annotations=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        triples: &Bound<'_, PyAny>,
        n_entity: usize,
        shard_batch_size: usize,
        devices: (usize, usize, usize),
        host: usize,
        col_shift: u32,
        embedding_dim: usize,
        negatives: usize,
        negative_sampler: &str,
        type_offsets: Option<&Bound<'_, PyAny>>,
        neg_heads: Option<&Bound<'_, PyAny>>,
        neg_tails: Option<&Bound<'_, PyAny>>,
        corruption_scheme: &str,
        flat_negatives: bool,
        sampler: &str,
        shuffle: bool,
        seed: Option<&Bound<'_, PyAny>>,
        seeds: Option<(Bound<'_, PyAny>, Bound<'_, PyAny>, Bound<'_, PyAny>)>,
        steps: Option<usize>,
        max_step_bytes: Option<usize>,
        inverse_triples: bool,
        n_relation: Option<usize>,
        sharding: Option<PyRef<'_, PySharding>>,
        annotations: bool,
    ) -> PyResult<Self> {
        let triples = triples_of(py, triples)?;
        let kind = match negative_sampler {
            "random" => NegativeKind::Random,
            "type_based" => NegativeKind::TypeBased {
                type_offsets: opt_offsets(py, type_offsets)?.ok_or_else(|| {
                    param(
                        py,
                        "type_offsets",
                        "None",
                        "the type_based sampler needs type_offsets",
                    )
                })?,
            },
            "triple_based" => NegativeKind::TripleBased {
                neg_heads: opt_2d(py, neg_heads, "neg_heads")?,
                neg_tails: opt_2d(py, neg_tails, "neg_tails")?,
            },
            other => {
                return Err(param(
                    py,
                    "negative_sampler",
                    other,
                    "must be random, type_based or triple_based",
                ))
            }
        };
        let stream_sampler = match sampler {
            "random" => StreamSampler::Random,
            "rigid" => StreamSampler::Rigid { shuffle },
            other => return Err(param(py, "sampler", other, "must be random or rigid")),
        };
        let (l, g, s) = devices;
        let mut b = BessStream::builder()
            .triples(triples)
            .n_entity(n_entity)
            .shard_batch_size(shard_batch_size)
            .devices(l, g, s)
            .host(host)
            .col_shift(col_shift)
            .embedding_dim(embedding_dim)
            .negatives(negatives)
            .negative_sampler(kind)
            .corruption(corruption(py, corruption_scheme)?)
            .flat_negatives(flat_negatives)
            .sampler(stream_sampler)
            .inverse_triples(inverse_triples)
            .annotations(annotations);
        match (seed, seeds) {
            (Some(_), Some(_)) => {
                return Err(param(
                    py,
                    "seeds",
                    "both seed and seeds",
                    "give one seed, or three seeds, not both",
                ))
            }
            (Some(s), None) => b = b.seed(seed_u64(py, "seed", s)?),
            (None, Some((a, bb, c))) => {
                b = b.seeds(
                    seed_u64(py, "seeds", &a)?,
                    seed_u64(py, "seeds", &bb)?,
                    seed_u64(py, "seeds", &c)?,
                )
            }
            (None, None) => {}
        }
        if let Some(t) = steps {
            b = b.steps(t);
        }
        if let Some(bytes) = max_step_bytes {
            b = b.max_step_bytes(bytes);
        }
        if let Some(r) = n_relation {
            b = b.n_relation(r);
        }
        if let Some(sh) = sharding {
            b = b.sharding(sh.inner.clone());
        }
        let inner = py.detach(|| b.build()).py(py)?;
        let config_json = inner.config().to_json();
        Ok(PyBessStream {
            inner,
            config_json,
            rigid: matches!(stream_sampler, StreamSampler::Rigid { .. }),
        })
    }

    /// The config as JSON text, for `sparsecore_prep.Preprocessor(stream.config_json)`.
    #[getter]
    fn config_json(&self) -> &str {
        &self.config_json
    }

    /// The config as a dict (`json.loads(config_json)`); `Preprocessor` takes either.
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        py.import("json")?
            .call_method1("loads", (self.config_json.as_str(),))
    }

    /// The per-cell counts the config's limits are made of.
    #[getter]
    fn counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.inner.counts();
        let d = PyDict::new(py);
        d.set_item("positive_per_partition", c.positive_per_partition)?;
        d.set_item("triples_per_sparsecore", c.triples_per_sparsecore)?;
        d.set_item("positive_ids_per_partition", c.positive_ids_per_partition)?;
        d.set_item("negative_ids_per_partition", c.negative_ids_per_partition)?;
        d.set_item("rows_per_sparsecore", c.rows_per_sparsecore)?;
        d.set_item("max_ids_per_partition", c.max_ids_per_partition)?;
        d.set_item("coo_buffer_size_per_device", c.coo_buffer_size_per_device)?;
        Ok(d)
    }

    /// Steps the stream yields.
    #[getter]
    fn steps(&self) -> usize {
        self.inner.steps()
    }

    /// The bytes a step needs, at least (what `max_step_bytes` is compared with): to size a cap
    /// from a small run before a large one.
    #[getter]
    fn step_bytes(&self) -> u128 {
        self.inner.step_bytes()
    }

    /// N = G·S: the number of SparseCores, and of shards.
    #[getter]
    fn num_sparsecores(&self) -> usize {
        self.inner.layout().num_sparsecores()
    }

    /// The entity sharding.
    #[getter]
    fn sharding(&self) -> PySharding {
        PySharding {
            inner: self.inner.sharding().clone(),
        }
    }

    /// The partitioned triples (`triple_idx` points into them).
    #[getter]
    fn partitioned(&self) -> PyPartitioned {
        PyPartitioned {
            inner: self.inner.partitioned().clone(),
        }
    }

    /// Fraction of Rigid's positions over one epoch that are padding (0 for random).
    #[getter]
    fn rigid_padding_fraction(&self) -> f64 {
        if self.rigid {
            self.inner.batch_sampler().rigid_padding_fraction()
        } else {
            0.0
        }
    }

    /// The physical ids (`local·N + ((shard − col_shift) mod N)`) of global entities, int64.
    fn physical_ids<'py>(
        &self,
        py: Python<'py>,
        entities: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (shape, v) = int_values(py, entities, "entity")?;
        let mut out = Vec::with_capacity(v.len());
        for (row, &e) in v.iter().enumerate() {
            let (s, i) = self.inner.sharding().locate(e, "entity", row).py(py)?;
            out.push(self.inner.layout().physical_id(s, i as i64));
        }
        let a = ArrayD::from_shape_vec(IxDyn(&shape), out)
            .map_err(|e| param(py, "entities", "shape", e.to_string()))?;
        Ok(np_nd(py, &a))
    }

    /// Draws step `step` as a pyarrow record batch (Random continues its stream whatever
    /// `step` is; Rigid takes the positions of `step`).
    fn draw<'py>(&mut self, py: Python<'py>, step: usize) -> PyResult<Bound<'py, PyAny>> {
        let inner = &mut self.inner;
        let b = py.detach(|| inner.draw(step)).py(py)?;
        to_pyarrow(py, b.record_batch)
    }

    /// Draws step `step`: `(record batch, arrays)`, where `arrays` holds the samplers' arrays
    /// (`sample_idx` `[n, n, ppp]` SparseCore-major, `triple_mask` (rigid), `negative`,
    /// `negative_mask`, `negative_sort_idx`); it is empty unless the stream was built with
    /// `annotations=True`.
    fn draw_annotated<'py>(
        &mut self,
        py: Python<'py>,
        step: usize,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyDict>)> {
        let inner = &mut self.inner;
        let b = py.detach(|| inner.draw(step)).py(py)?;
        let d = PyDict::new(py);
        let triple_mask = b
            .triple_mask
            .as_ref()
            .map(|m| PyArray1::from_slice(py, m).into_any());
        set_arrays(
            &d,
            [
                ("sample_idx", np_opt(py, &b.sample_idx)),
                ("triple_mask", triple_mask),
            ],
        )?;
        if let Some(o) = &b.negative {
            for (k, v) in negative_dict(py, o)?.iter() {
                d.set_item(k, v)?;
            }
        }
        Ok((to_pyarrow(py, b.record_batch)?, d))
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// The next step's pyarrow record batch.
    fn __next__<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let inner = &mut self.inner;
        match py.detach(|| inner.next()) {
            None => Ok(None),
            Some(b) => Ok(Some(to_pyarrow(py, b.py(py)?.record_batch)?)),
        }
    }

    fn __len__(&self) -> usize {
        self.inner.steps()
    }
}

/// The classes and functions of `sparsecore_prep.bess`, added to the native module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyNumpyRng>()?;
    m.add_class::<PySharding>()?;
    m.add_class::<PyPartitioned>()?;
    m.add_class::<PyRandomNegative>()?;
    m.add_class::<PyTypeBasedNegative>()?;
    m.add_class::<PyTripleBasedNegative>()?;
    m.add_class::<PyBatchSampler>()?;
    m.add_class::<PyBessStream>()?;
    m.add_function(wrap_pyfunction!(seed_words, m)?)?;
    Ok(())
}
