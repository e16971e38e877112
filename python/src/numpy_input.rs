//! numpy inputs as the reference takes them: dense 2-D arrays (read in place) and 1-D object
//! arrays of per-sample 1-D arrays (gathered into one flat buffer, since the crate's ragged view
//! wants contiguous ids, or read in place when the rows already are one block).
//!
//! Reading a ragged batch touches one Python object per sample, so this is the Python-facing
//! hot loop: a criteo batch has 26 × 16,384 rows. Going through rust-numpy's checked API costs a
//! dynamic borrow per row; instead each row's `PyArrayObject` fields (data, length, stride,
//! dtype) are read directly, on rayon's workers while the calling thread holds the GIL
//! ([`gather_all`]), and the values copied out. The unsafe code is that reading ([`row_of`],
//! [`probe`], [`holds`]), the copies from the memory it found ([`copy_row`], [`copy_spans`]),
//! and the ids read in place ([`FeatureData::RaggedInPlace`]).

use numpy::npyffi::PyArrayObject;
use numpy::{
    PyArray2, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray2, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use sparsecore_prep::input::{DenseInput, RaggedInput, SampleSource};

use crate::errors;

/// One feature's local batch, owned (ragged, gathered) or borrowed from numpy (dense).
pub enum FeatureData<'py> {
    /// Ragged rows gathered into `ids` with row splits, and weights beside them.
    Ragged {
        ids: Vec<i32>,
        splits: Vec<i32>,
        weights: Option<Vec<f32>>,
    },
    /// Ragged rows whose int32 ids are already one block of memory (consecutive slices of one
    /// array), read in place: `len` ids at `addr`, inside the buffer of the numpy array
    /// `_owner`, which this holds a reference to, so that the memory outlives the call even if
    /// another thread replaces the rows while the GIL is released.
    RaggedInPlace {
        addr: usize,
        len: usize,
        _owner: Py<PyAny>,
        splits: Vec<i32>,
        weights: Option<Vec<f32>>,
    },
    /// A dense `[batch, valency]` array of i32 ids.
    DenseI32 {
        ids: PyReadonlyArray2<'py, i32>,
        weights: Option<PyReadonlyArray2<'py, f32>>,
    },
    /// A dense `[batch, valency]` array of i64 ids.
    DenseI64 {
        ids: PyReadonlyArray2<'py, i64>,
        weights: Option<PyReadonlyArray2<'py, f32>>,
    },
}

impl FeatureData<'_> {
    /// The crate's view of this feature. `name` labels errors.
    pub fn source<'a>(&'a self, name: &str) -> sparsecore_prep::Result<Box<dyn SampleSource + 'a>> {
        Ok(match self {
            FeatureData::Ragged {
                ids,
                splits,
                weights,
            } => ragged_source(name, ids, splits, weights)?,
            FeatureData::RaggedInPlace {
                addr,
                len,
                _owner: _,
                splits,
                weights,
            } => {
                // SAFETY: `gather_raw` checked that these `len` aligned int32s lie inside the
                // buffer of the array `_owner`, which is alive as long as `self` (it holds a
                // reference), and an array's buffer lives as long as the array.
                let ids = unsafe { std::slice::from_raw_parts(*addr as *const i32, *len) };
                ragged_source(name, ids, splits, weights)?
            }
            FeatureData::DenseI32 { ids, weights } => {
                let input = DenseInput::from_i32(ids.as_array());
                match weights {
                    Some(w) => Box::new(input.with_weights(name, w.as_array())?),
                    None => Box::new(input),
                }
            }
            FeatureData::DenseI64 { ids, weights } => {
                let input = DenseInput::from_i64(ids.as_array());
                match weights {
                    Some(w) => Box::new(input.with_weights(name, w.as_array())?),
                    None => Box::new(input),
                }
            }
        })
    }
}

/// The crate's view of gathered ragged ids, row splits and weights.
fn ragged_source<'a>(
    name: &str,
    ids: &'a [i32],
    splits: &'a [i32],
    weights: &'a Option<Vec<f32>>,
) -> sparsecore_prep::Result<Box<dyn SampleSource + 'a>> {
    let input = RaggedInput::from_i32(name, ids, splits)?;
    Ok(match weights {
        Some(w) => Box::new(input.with_weights(name, w)?),
        None => Box::new(input),
    })
}

/// Reads one feature (and its weights) from the leaves the reference accepts.
pub fn feature<'py>(
    name: &str,
    ids: &Bound<'py, PyAny>,
    weights: Option<&Bound<'py, PyAny>>,
) -> PyResult<FeatureData<'py>> {
    let py = ids.py();
    let array = ids.cast::<PyUntypedArray>().map_err(|_| {
        errors::input_type(py, name, format!(
            "feature `{name}`: expected a numpy array (2-D ids, or a 1-D object array of per-sample arrays), got {}",
            type_name(ids)
        ))
    })?;
    match array.ndim() {
        2 => dense(name, array, weights),
        1 if array.dtype().kind() == b'O' => ragged(name, array, weights),
        1 => Err(errors::invalid_input(py, name, None, None::<i64>, format!(
            "feature `{name}`: a 1-D array must have dtype=object and hold one 1-D array of ids per sample \
             (got dtype {}); use a 2-D array for fixed valency",
            array.dtype()
        ))),
        n => Err(errors::invalid_input(py, name, None, None::<i64>, format!(
            "feature `{name}`: Only 1D and 2D numpy arrays supported as inputs (got {n} dimensions)"
        ))),
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

fn dense<'py>(
    name: &str,
    array: &Bound<'py, PyUntypedArray>,
    weights: Option<&Bound<'py, PyAny>>,
) -> PyResult<FeatureData<'py>> {
    let weights = match weights {
        None => None,
        Some(w) => {
            let w = w.cast::<PyArray2<f32>>().map_err(|_| {
                errors::input_type(w.py(), name, format!(
                    "feature `{name}`: dense weights must be a 2-D float32 array like the ids, got {}",
                    describe(w)
                ))
            })?;
            Some(w.try_readonly()?)
        }
    };
    if let Ok(a) = array.cast::<PyArray2<i32>>() {
        return Ok(FeatureData::DenseI32 {
            ids: a.try_readonly()?,
            weights,
        });
    }
    if let Ok(a) = array.cast::<PyArray2<i64>>() {
        return Ok(FeatureData::DenseI64 {
            ids: a.try_readonly()?,
            weights,
        });
    }
    Err(errors::input_type(
        array.py(),
        name,
        format!(
            "feature `{name}`: dense ids must be int32 or int64, got dtype {}",
            array.dtype()
        ),
    ))
}

fn describe(obj: &Bound<'_, PyAny>) -> String {
    match obj.cast::<PyUntypedArray>() {
        Ok(a) => format!("a {}-D array of dtype {}", a.ndim(), a.dtype()),
        Err(_) => type_name(obj),
    }
}

/// Where a 1-D array's elements are: `len` elements from address `addr`, `stride` bytes apart.
/// Only ever made from a live array's struct ([`row_of`], [`probe`]).
#[derive(Clone, Copy, Default)]
struct Span {
    addr: usize,
    len: usize,
    stride: isize,
}

/// What a row array's C struct says about its memory and its elements.
struct Row {
    span: Span,
    kind: u8,
    itemsize: usize,
}

/// The memory of a 1-D, native-byte-order numpy array; `None` if `obj` is not a numpy array.
fn row_of(obj: &Bound<'_, PyAny>) -> Option<Result<Row, String>> {
    let a = obj.cast::<PyUntypedArray>().ok()?;
    if a.ndim() != 1 {
        return Some(Err(format!("a {}-D array", a.ndim())));
    }
    let d = a.dtype();
    if !d.is_native_byteorder().unwrap_or(true) {
        return Some(Err(format!("a non-native byte order array ({d})")));
    }
    let ptr: *mut PyArrayObject = a.as_array_ptr();
    // SAFETY: `a` is a live numpy array (the cast checked its type) and we hold the GIL, so its
    // struct is initialised and stays alive while we read it; a 1-D array has one dimension and
    // one stride.
    let (addr, len, stride) = unsafe {
        (
            (*ptr).fields.data as usize,
            *(*ptr).fields.dimensions as usize,
            *(*ptr).fields.strides,
        )
    };
    Some(Ok(Row {
        span: Span { addr, len, stride },
        kind: d.kind(),
        itemsize: d.itemsize(),
    }))
}

/// Appends the values of one row, converted by `conv`, to `out`; the first value `conv`
/// rejects is the error.
///
/// `T` must be the row's element type (checked by the callers against kind and itemsize), and
/// the array `span` was read from must stay alive and unchanged meanwhile (the GIL is held, or
/// its holder blocks until the gather is done).
fn copy_row<T: Copy, U>(
    span: &Span,
    out: &mut Vec<U>,
    mut conv: impl FnMut(T) -> Option<U>,
) -> Result<(), T> {
    out.reserve(span.len);
    let contiguous = span.stride == std::mem::size_of::<T>() as isize
        && span.addr.is_multiple_of(std::mem::align_of::<T>());
    if contiguous && span.len > 0 {
        // Element by element: most rows of sparse features hold an id or two, for which a call
        // to memcpy per row costs more than the copy.
        // SAFETY: numpy guarantees `len` elements of `T` at `addr` for a live, contiguous array
        // (alignment checked above), and the array is not freed meanwhile (see above).
        let values = unsafe { std::slice::from_raw_parts(span.addr as *const T, span.len) };
        for &v in values {
            out.push(conv(v).ok_or(v)?);
        }
    } else {
        for k in 0..span.len {
            // SAFETY: element k of a live 1-D array is at addr + k * stride (numpy's own
            // addressing); read_unaligned copes with any alignment.
            let v = unsafe {
                std::ptr::read_unaligned(
                    (span.addr as *const u8).offset(k as isize * span.stride) as *const T
                )
            };
            out.push(conv(v).ok_or(v)?);
        }
    }
    Ok(())
}

fn narrow(v: i64) -> Option<i32> {
    i32::try_from(v).ok()
}

/// Appends one sample's ids.
fn push_ids(name: &str, r: usize, obj: &Bound<'_, PyAny>, out: &mut Vec<i32>) -> PyResult<()> {
    let py = obj.py();
    let out_of_range = |v: i128| {
        errors::invalid_input(
            py,
            name,
            Some(r),
            Some(v),
            format!("feature `{name}`, sample row {r}: id {v} is outside the int32 range of embedding ids"),
        )
    };
    let row = match row_of(obj) {
        Some(Ok(row)) => row,
        Some(Err(what)) => {
            return Err(errors::input_type(
                py,
                name,
                format!(
                "feature `{name}`, sample row {r}: expected a 1-D array of integer ids, got {what}"
            ),
            ))
        }
        None => {
            // Not a numpy array: accept any sequence of Python ints (the reference crashes).
            let values: Vec<i64> = obj.extract().map_err(|_| {
                errors::input_type(
                    py,
                    name,
                    format!(
                    "feature `{name}`, sample row {r}: expected a 1-D array of integer ids, got {}",
                    type_name(obj)
                ),
                )
            })?;
            for v in values {
                out.push(narrow(v).ok_or_else(|| out_of_range(v as i128))?);
            }
            return Ok(());
        }
    };
    match (row.kind, row.itemsize) {
        (b'i', 4) => {
            copy_row::<i32, i32>(&row.span, out, Some).map_err(|v| out_of_range(v as i128))
        }
        (b'i', 8) => {
            copy_row::<i64, i32>(&row.span, out, narrow).map_err(|v| out_of_range(v as i128))
        }
        (b'i', 2) => copy_row::<i16, i32>(&row.span, out, |v| Some(v as i32))
            .map_err(|v| out_of_range(v as i128)),
        (b'i', 1) => copy_row::<i8, i32>(&row.span, out, |v| Some(v as i32))
            .map_err(|v| out_of_range(v as i128)),
        (b'u', 4) => copy_row::<u32, i32>(&row.span, out, |v| i32::try_from(v).ok())
            .map_err(|v| out_of_range(v as i128)),
        (b'u', 8) => copy_row::<u64, i32>(&row.span, out, |v| i32::try_from(v).ok())
            .map_err(|v| out_of_range(v as i128)),
        (b'u', 2) => copy_row::<u16, i32>(&row.span, out, |v| Some(v as i32))
            .map_err(|v| out_of_range(v as i128)),
        (b'u', 1) => copy_row::<u8, i32>(&row.span, out, |v| Some(v as i32))
            .map_err(|v| out_of_range(v as i128)),
        _ => Err(errors::input_type(
            py,
            name,
            format!(
                "feature `{name}`, sample row {r}: ids must be integers, got dtype {}",
                obj.cast::<PyUntypedArray>()
                    .map(|a| a.dtype().to_string())
                    .unwrap_or_default()
            ),
        )),
    }
}

/// Appends one sample's weights.
fn push_weights(name: &str, r: usize, obj: &Bound<'_, PyAny>, out: &mut Vec<f32>) -> PyResult<()> {
    let row = match row_of(obj) {
        Some(Ok(row)) => row,
        Some(Err(what)) => {
            return Err(errors::input_type(obj.py(), name, format!(
                "feature `{name}`, sample row {r}: expected a 1-D float32 array of weights, got {what}"
            )))
        }
        None => {
            let values: Vec<f64> = obj.extract().map_err(|_| {
                errors::input_type(obj.py(), name, format!(
                    "feature `{name}`, sample row {r}: expected a 1-D float32 array of weights, got {}",
                    type_name(obj)
                ))
            })?;
            out.extend(values.into_iter().map(|v| v as f32));
            return Ok(());
        }
    };
    let ok = match (row.kind, row.itemsize) {
        (b'f', 4) => copy_row::<f32, f32>(&row.span, out, Some).is_ok(),
        (b'f', 8) => copy_row::<f64, f32>(&row.span, out, |v| Some(v as f32)).is_ok(),
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(errors::input_type(
            obj.py(),
            name,
            format!(
            "feature `{name}`, sample row {r}: weights must be float32 (or float64), got dtype {}",
            obj.cast::<PyUntypedArray>().map(|a| a.dtype().to_string()).unwrap_or_default()
        ),
        ))
    }
}

fn ragged<'py>(
    name: &str,
    array: &Bound<'py, PyUntypedArray>,
    weights: Option<&Bound<'py, PyAny>>,
) -> PyResult<FeatureData<'py>> {
    let rows = array.len();
    let py = array.py();
    let too_many = || {
        errors::invalid_input(
            py,
            name,
            None,
            None::<i64>,
            format!("feature `{name}`: more than 2147483647 ids in one batch"),
        )
    };
    let mut ids: Vec<i32> = Vec::new();
    let mut splits: Vec<i32> = Vec::with_capacity(rows + 1);
    splits.push(0);
    for_each_object(name, array, |r, item| {
        push_ids(name, r, item, &mut ids)?;
        splits.push(i32::try_from(ids.len()).map_err(|_| too_many())?);
        Ok(())
    })?;
    let weights = match weights {
        None => None,
        Some(w) => {
            let wa = w.cast::<PyUntypedArray>().ok().filter(|a| a.ndim() == 1 && a.dtype().kind() == b'O').ok_or_else(|| {
                errors::input_type(py, name, format!(
                    "feature `{name}`: ragged ids need ragged weights (a 1-D object array of per-sample float32 arrays), got {}",
                    describe(w)
                ))
            })?;
            if wa.len() != rows {
                return Err(errors::invalid_input(py, name, None, None::<i64>, format!(
                    "feature `{name}`: Batch size mismatch for features and weights: {rows} id rows, {} weight rows",
                    wa.len()
                )));
            }
            let mut values: Vec<f32> = Vec::with_capacity(ids.len());
            for_each_object(name, wa, |r, item| {
                push_weights(name, r, item, &mut values)?;
                let (want, got) = (splits[r + 1] as usize, values.len());
                if got != want {
                    return Err(errors::invalid_input(py, name, Some(r), None::<i64>, format!(
                        "feature `{name}`, sample row {r}: {} weights for {} ids (the weights must have the ids' shape)",
                        got - splits[r] as usize,
                        want - splits[r] as usize
                    )));
                }
                Ok(())
            })?;
            Some(values)
        }
    };
    Ok(FeatureData::Ragged {
        ids,
        splits,
        weights,
    })
}

/// Calls `f` on every item of a 1-D object array, in order, whatever its strides. Reading the
/// item pointers straight from the array's buffer avoids numpy's per-item iterator.
fn for_each_object<'py>(
    name: &str,
    array: &Bound<'py, PyUntypedArray>,
    mut f: impl FnMut(usize, &Bound<'py, PyAny>) -> PyResult<()>,
) -> PyResult<()> {
    let py = array.py();
    let ptr: *mut PyArrayObject = array.as_array_ptr();
    // SAFETY: a live 1-D numpy array under the GIL (checked by the caller: ndim 1, dtype object).
    let (data, len, stride) = unsafe {
        (
            (*ptr).fields.data as *const u8,
            *(*ptr).fields.dimensions as usize,
            *(*ptr).fields.strides,
        )
    };
    for k in 0..len {
        // SAFETY: an object array stores one `PyObject*` per element at data + k * stride, each a
        // strong reference held by the array, which is alive for this call.
        let item = unsafe {
            let p = std::ptr::read_unaligned(
                data.offset(k as isize * stride) as *const *mut pyo3::ffi::PyObject
            );
            pyo3::Borrowed::from_ptr_or_opt(py, p)
        };
        let item = item.ok_or_else(|| {
            errors::invalid_input(
                py,
                name,
                Some(k),
                None::<i64>,
                format!("feature `{name}`, sample row {k}: empty (NULL) object"),
            )
        })?;
        f(k, &item)?;
    }
    Ok(())
}

/// The memory of a 1-D object array, for reading its items off the Python thread.
#[derive(Clone, Copy)]
pub struct RawObjects {
    data: *const u8,
    len: usize,
    stride: isize,
}

// SAFETY: only read while the thread that owns the GIL blocks in `gather_all` (see there).
unsafe impl Send for RawObjects {}
unsafe impl Sync for RawObjects {}

/// numpy's array type, compared by pointer on worker threads.
#[derive(Clone, Copy)]
struct ArrayType(*mut pyo3::ffi::PyTypeObject);
unsafe impl Send for ArrayType {}
unsafe impl Sync for ArrayType {}

impl RawObjects {
    /// A 1-D object array's item buffer, or `None` for anything else.
    pub fn of(obj: &Bound<'_, PyAny>) -> Option<Self> {
        let a = obj.cast::<PyUntypedArray>().ok()?;
        if a.ndim() != 1 || a.dtype().kind() != b'O' {
            return None;
        }
        let ptr: *mut PyArrayObject = a.as_array_ptr();
        // SAFETY: a live 1-D numpy array, read under the GIL.
        let (data, len, stride) = unsafe {
            (
                (*ptr).fields.data as *const u8,
                *(*ptr).fields.dimensions as usize,
                *(*ptr).fields.strides,
            )
        };
        Some(RawObjects { data, len, stride })
    }
}

/// Element kind and size from a dtype's `kind` and `type_num` (the fields numpy 1 and 2 share).
#[inline(always)]
fn element(kind: u8, type_num: i32) -> Option<usize> {
    let long = std::mem::size_of::<std::ffi::c_long>();
    Some(match (kind, type_num) {
        (b'i', 1) | (b'u', 2) => 1,
        (b'i', 3) | (b'u', 4) => 2,
        (b'i', 5) | (b'u', 6) | (b'f', 11) => 4,
        (b'i', 7) | (b'u', 8) => long,
        (b'i', 9) | (b'u', 10) | (b'f', 12) => 8,
        _ => return None,
    })
}

/// A dtype's element kind and size, if its values can be read in native byte order.
///
/// SAFETY: `descr` is a live dtype object, and no Python code can run meanwhile.
unsafe fn native_element(descr: *mut numpy::npyffi::PyArray_Descr) -> Option<(u8, usize)> {
    let d = &(*descr).fields;
    let byteorder = d.byteorder as u8;
    if !(byteorder == b'='
        || byteorder == b'|'
        || (cfg!(target_endian = "little") && byteorder == b'<'))
    {
        return None;
    }
    let kind = d.kind as u8;
    element(kind, d.type_num).map(|size| (kind, size))
}

/// What the first pass of [`gather_raw`] found of all rows of one object array.
struct Probe {
    /// Element size, the same for every row (and the kind, which `accept` checked).
    itemsize: usize,
    /// The rows' element count.
    total: usize,
    /// Every row contiguous, aligned, and starting where the previous one ends: the rows are
    /// consecutive slices of one buffer (as `np.split` or slicing one flat array gives), so
    /// their values are one block of memory.
    chained: bool,
    /// The first row's `base` object (the array whose memory a view shares), or null.
    base: *mut pyo3::ffi::PyObject,
}

/// The first pass over an object array: each row's span into `spans`, and the running element
/// count after each row into `ends` (`ends[k]` for row `k`, wrapping past `i32::MAX`, which
/// the caller rejects by `total`). `None` for anything the checked path must see: a row that
/// is not exactly a 1-D ndarray, a dtype `accept` rejects or that differs from the first row's.
///
/// This pass reads each row's object and shape once and copies nothing, so that the copy that
/// follows knows the total (one reservation, no capacity checks per row) and whether the rows
/// are one block of memory. The objects and their shapes are tens of megabytes per batch
/// (a numpy array is about 100 bytes, plus its shape), so reading them once is most of the cost.
///
/// SAFETY: `o` is a live object array whose items no Python code can change meanwhile.
unsafe fn probe(
    o: RawObjects,
    array_type: ArrayType,
    accept: impl Fn(u8, usize) -> bool,
    spans: &mut Vec<Span>,
    ends: &mut [i32],
) -> Option<Probe> {
    debug_assert_eq!(ends.len(), o.len);
    spans.clear();
    spans.resize(o.len, Span::default());
    // The dtype object the rows were checked against: rows sliced from one array share it, so
    // a pointer comparison stands for reading and checking the dtype of every row.
    let mut descr: *mut numpy::npyffi::PyArray_Descr = std::ptr::null_mut();
    let (mut kind, mut itemsize) = (0u8, 1usize);
    let (mut total, mut next, mut chained) = (0usize, 0usize, true);
    let mut base = std::ptr::null_mut();
    let at = |k: usize| {
        std::ptr::read_unaligned(
            o.data.offset(k as isize * o.stride) as *const *mut pyo3::ffi::PyObject
        )
    };
    for (k, (span, end)) in spans.iter_mut().zip(ends.iter_mut()).enumerate() {
        let p = at(k);
        if p.is_null() || (*p).ob_type != array_type.0 {
            return None;
        }
        let f = &(*(p as *mut PyArrayObject)).fields;
        if f.nd != 1 {
            return None;
        }
        if f.descr != descr {
            let (kd, size) = native_element(f.descr)?;
            if !accept(kd, size) || (!descr.is_null() && (kd, size) != (kind, itemsize)) {
                return None;
            }
            (descr, kind, itemsize) = (f.descr, kd, size);
        }
        let (addr, len, stride) = (f.data as usize, *f.dimensions as usize, *f.strides);
        if k == 0 {
            base = f.base;
        }
        // (`itemsize` is a power of two.)
        chained &=
            (k == 0 || addr == next) && stride == itemsize as isize && addr & (itemsize - 1) == 0;
        next = addr.wrapping_add(len.wrapping_mul(itemsize));
        total = total.wrapping_add(len);
        *span = Span { addr, len, stride };
        *end = total as i32;
    }
    Some(Probe {
        itemsize,
        total,
        chained,
        base,
    })
}

/// Whether `bytes` bytes at `addr` lie inside the buffer of `base`, a 1-D contiguous numpy
/// array (so that a reference to `base` keeps them alive).
///
/// SAFETY: `base` is null or a live object, and no Python code can run meanwhile.
unsafe fn holds(
    base: *mut pyo3::ffi::PyObject,
    addr: usize,
    bytes: usize,
    array_type: ArrayType,
) -> bool {
    if base.is_null() || (*base).ob_type != array_type.0 {
        return false;
    }
    let f = &(*(base as *mut PyArrayObject)).fields;
    if f.nd != 1 {
        return false;
    }
    let Some((_, size)) = native_element(f.descr) else {
        return false;
    };
    let (start, len) = (f.data as usize, *f.dimensions as usize);
    *f.strides == size as isize
        && len
            .checked_mul(size)
            .and_then(|n| start.checked_add(n))
            .is_some_and(|end| start <= addr && addr.checked_add(bytes).is_some_and(|e| e <= end))
}

/// Appends the values of `spans` (elements of type `T`), converted by `conv`, to `out`, which
/// has room for `total` more; `false` if `conv` rejects a value.
///
/// SAFETY: every span is `len` elements of `T`, `stride` bytes apart, in live memory that
/// nothing writes meanwhile; when `chained`, the spans are consecutive and aligned (see
/// [`Probe::chained`]).
unsafe fn copy_spans<T: Copy, U: Copy + Default>(
    spans: &[Span],
    total: usize,
    chained: bool,
    out: &mut Vec<U>,
    conv: impl Fn(T) -> Option<U>,
) -> bool {
    debug_assert!(out.capacity() - out.len() >= total);
    if chained && total > 0 {
        // One block: check, then convert in one loop (a memcpy when `T` is `U`).
        let src = std::slice::from_raw_parts(spans[0].addr as *const T, total);
        if !src.iter().all(|&v| conv(v).is_some()) {
            return false;
        }
        out.extend(src.iter().map(|&v| conv(v).unwrap_or_default()));
        return true;
    }
    spans.iter().all(|s| copy_row(s, out, &conv).is_ok())
}

/// Gathers one ragged feature without the Python API into `buf` (its memory reused); `false`
/// sends it down the checked path (which also produces the precise error).
///
/// Two passes: [`probe`] reads every row's object, then the values are copied from the spans
/// it recorded (a few hundred kilobytes, still in cache).
///
/// SAFETY: as [`probe`], for `ids` and `weights`.
unsafe fn gather_raw(
    ids: RawObjects,
    weights: Option<RawObjects>,
    array_type: ArrayType,
    buf: &mut Gathered,
) -> bool {
    thread_local! {
        /// The first pass's per-row record, per thread rather than per feature: it lives only
        /// from one pass to the next, so one buffer stays in this core's cache (a feature's
        /// rows take a few hundred kilobytes), where per-feature buffers would be cold memory
        /// written afresh on every call.
        static SCRATCH: std::cell::RefCell<(Vec<Span>, Vec<i32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    }
    SCRATCH.with_borrow_mut(|(spans, weight_ends)| {
        gather_with(ids, weights, array_type, buf, spans, weight_ends)
    })
}

/// [`gather_raw`] with its scratch.
///
/// SAFETY: as [`gather_raw`].
unsafe fn gather_with(
    ids: RawObjects,
    weights: Option<RawObjects>,
    array_type: ArrayType,
    buf: &mut Gathered,
    spans: &mut Vec<Span>,
    weight_ends: &mut Vec<i32>,
) -> bool {
    let Gathered {
        ids: values,
        splits,
        weights: weights_out,
        in_place,
    } = buf;
    let n = ids.len;
    splits.clear();
    splits.resize(n + 1, 0);
    let int = |kind: u8, size: usize| kind == b'i' && (size == 4 || size == 8);
    let Some(p) = probe(ids, array_type, int, spans, &mut splits[1..]) else {
        return false;
    };
    if p.total > i32::MAX as usize {
        return false;
    }
    values.clear();
    *in_place = None;
    if p.itemsize == 4
        && p.chained
        && p.total > 0
        && holds(p.base, spans[0].addr, p.total * 4, array_type)
    {
        // The ids are one block inside the first row's base array: read in place.
        *in_place = Some((spans[0].addr, p.total, p.base as usize));
    }
    let copied = in_place.is_some() || {
        values.reserve(p.total);
        match p.itemsize {
            4 => copy_spans::<i32, i32>(spans, p.total, p.chained, values, Some),
            _ => copy_spans::<i64, i32>(spans, p.total, p.chained, values, narrow),
        }
    };
    if !copied {
        return false;
    }
    match weights {
        None => *weights_out = None,
        Some(w) => {
            if w.len != n {
                return false;
            }
            let float = |kind: u8, size: usize| kind == b'f' && (size == 4 || size == 8);
            weight_ends.clear();
            weight_ends.resize(n, 0);
            let Some(q) = probe(w, array_type, float, spans, weight_ends) else {
                return false;
            };
            // The weights must have the ids' shape, row by row.
            if weight_ends[..] != splits[1..] {
                return false;
            }
            let out = weights_out.get_or_insert_with(Vec::new);
            out.clear();
            out.reserve(q.total);
            let copied = match q.itemsize {
                4 => copy_spans::<f32, f32>(spans, q.total, q.chained, out, Some),
                _ => copy_spans::<f64, f32>(spans, q.total, q.chained, out, |v| Some(v as f32)),
            };
            if !copied {
                return false;
            }
        }
    }
    true
}

/// Fewer ragged rows than this (over all features) are gathered on the calling thread, where the
/// pool's hand-over would cost more than reading them. It counts rows, not ids, because only the
/// rows are known before reading them: a few very long rows are gathered serially, which costs
/// little when they are slices of one array (read in place) and a copy of their ids otherwise.
pub const GATHER_ON_CALLER_MAX_ROWS: usize = 2048;

/// Gathers the ragged features among `leaves` on `pool` (the package's, see `threads`; `None`:
/// on the calling thread), into `scratch` (one buffer per
/// leaf, resized to fit; its memory is reused from call to call, so a steady stream of batches
/// does not fault in fresh pages for the gathered ids each time). `None` where a feature needs
/// the checked path (or is not ragged).
///
/// The calling thread and the pool's threads (for few rows, the calling thread alone) read the
/// object arrays' items and the items' numpy structs without the Python API. That is sound
/// because the calling thread holds the GIL throughout and runs no Python code until the reads
/// finish (a pool thread that starts after the last feature reads nothing): no Python code runs
/// anywhere in the meantime, so nothing can be freed or resized, and every object read is kept
/// alive by `leaves`, which the caller owns.
pub fn gather_all<'py>(
    py: Python<'py>,
    pool: Option<&rayon::ThreadPool>,
    leaves: &[(Option<RawObjects>, Option<RawObjects>)],
    scratch: &mut Vec<Gathered>,
) -> Vec<Option<FeatureData<'py>>> {
    use numpy::PyUntypedArray as Arr;
    use pyo3::type_object::PyTypeInfo;
    use sparsecore_prep::parallel::run_helped;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;
    let array_type = ArrayType(Arr::type_object_raw(py));
    scratch.resize_with(leaves.len(), Default::default);
    let gather =
        |(buf, &(ids, weights)): (&mut Gathered, &(Option<RawObjects>, Option<RawObjects>))| {
            match ids {
                // SAFETY: see the function's documentation.
                Some(ids) => unsafe { gather_raw(ids, weights, array_type, buf) },
                None => false,
            }
        };
    let rows: usize = leaves
        .iter()
        .filter_map(|(ids, _)| ids.map(|o| o.len))
        .sum();
    // Few rows are gathered on this thread: the pool's hand-over and wake-up would cost more.
    // Otherwise this thread starts on the features at once and the pool's threads take features
    // beside it as they wake (after the caller's idle time they are asleep, see
    // `sparsecore_prep::parallel`).
    let gathered: Vec<bool> = match pool {
        Some(pool) if rows >= GATHER_ON_CALLER_MAX_ROWS => {
            let slots: Vec<Mutex<&mut Gathered>> = scratch.iter_mut().map(Mutex::new).collect();
            let done: Vec<AtomicBool> = leaves.iter().map(|_| AtomicBool::new(false)).collect();
            run_helped(pool, pool.current_num_threads(), leaves.len(), &|k| {
                let mut buf = slots[k].lock().unwrap_or_else(|e| e.into_inner());
                done[k].store(gather((&mut **buf, &leaves[k])), Ordering::Relaxed);
            });
            done.into_iter().map(AtomicBool::into_inner).collect()
        }
        _ => scratch.iter_mut().zip(leaves).map(gather).collect(),
    };
    gathered
        .into_iter()
        .zip(scratch.iter_mut())
        .map(|(ok, buf)| {
            ok.then(|| {
                let (splits, weights) = (std::mem::take(&mut buf.splits), buf.weights.take());
                match buf.in_place.take() {
                    Some((addr, len, owner)) => {
                        // SAFETY: `owner` is the live array `gather_raw` checked, kept alive by
                        // the rows (which `leaves` keeps); this takes a reference of our own,
                        // on the thread that holds the GIL.
                        let owner = unsafe {
                            Bound::from_borrowed_ptr(py, owner as *mut pyo3::ffi::PyObject)
                        }
                        .unbind();
                        FeatureData::RaggedInPlace {
                            addr,
                            len,
                            _owner: owner,
                            splits,
                            weights,
                        }
                    }
                    None => FeatureData::Ragged {
                        ids: std::mem::take(&mut buf.ids),
                        splits,
                        weights,
                    },
                }
            })
        })
        .collect()
}

/// Hands the buffers of gathered features back to `scratch` for the next call.
pub fn recycle(data: Vec<FeatureData<'_>>, scratch: &mut [Gathered]) {
    for (d, slot) in data.into_iter().zip(scratch.iter_mut()) {
        match d {
            FeatureData::Ragged {
                ids,
                splits,
                weights,
            } => (slot.ids, slot.splits, slot.weights) = (ids, splits, weights),
            FeatureData::RaggedInPlace {
                splits, weights, ..
            } => (slot.splits, slot.weights) = (splits, weights),
            _ => {}
        }
    }
}

/// One ragged feature's gathered ids, row splits and weights, kept from call to call.
#[derive(Default)]
pub struct Gathered {
    ids: Vec<i32>,
    splits: Vec<i32>,
    weights: Option<Vec<f32>>,
    /// Set instead of `ids` when the ids are read in place: (address, count, owning array).
    in_place: Option<(usize, usize, usize)>,
}
