//! numpy inputs as the reference takes them: dense 2-D arrays (read in place) and 1-D object
//! arrays of per-sample 1-D arrays (gathered into one flat buffer, since the crate's ragged view
//! wants contiguous ids).
//!
//! Reading a ragged batch touches one Python object per sample, so this is the Python-facing
//! hot loop: a criteo batch has 26 × 16,384 rows. Going through rust-numpy's checked API costs a
//! dynamic borrow per row; instead each row's `PyArrayObject` fields (data, length, stride,
//! dtype) are read directly while the GIL is held, and the values copied out. That is the only
//! unsafe code here, in [`row_of`] and [`copy_row`].

use numpy::npyffi::PyArrayObject;
use numpy::{PyArray2, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray2, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use sparsecore_prep::input::{DenseInput, RaggedInput, SampleSource};

/// One feature's local batch, owned (ragged, gathered) or borrowed from numpy (dense).
pub enum FeatureData<'py> {
    /// Ragged rows gathered into `ids` with row splits, and weights beside them.
    Ragged { ids: Vec<i32>, splits: Vec<i32>, weights: Option<Vec<f32>> },
    /// A dense `[batch, valency]` array of i32 ids.
    DenseI32 { ids: PyReadonlyArray2<'py, i32>, weights: Option<PyReadonlyArray2<'py, f32>> },
    /// A dense `[batch, valency]` array of i64 ids.
    DenseI64 { ids: PyReadonlyArray2<'py, i64>, weights: Option<PyReadonlyArray2<'py, f32>> },
}

impl FeatureData<'_> {
    /// The crate's view of this feature. `name` labels errors.
    pub fn source<'a>(&'a self, name: &str) -> sparsecore_prep::Result<Box<dyn SampleSource + 'a>> {
        Ok(match self {
            FeatureData::Ragged { ids, splits, weights } => {
                let input = RaggedInput::from_i32(name, ids, splits)?;
                match weights {
                    Some(w) => Box::new(input.with_weights(name, w)?),
                    None => Box::new(input),
                }
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

/// Reads one feature (and its weights) from the leaves the reference accepts.
pub fn feature<'py>(name: &str, ids: &Bound<'py, PyAny>, weights: Option<&Bound<'py, PyAny>>) -> PyResult<FeatureData<'py>> {
    let array = ids.cast::<PyUntypedArray>().map_err(|_| {
        PyTypeError::new_err(format!(
            "feature `{name}`: expected a numpy array (2-D ids, or a 1-D object array of per-sample arrays), got {}",
            type_name(ids)
        ))
    })?;
    match array.ndim() {
        2 => dense(name, array, weights),
        1 if array.dtype().kind() == b'O' => ragged(name, array, weights),
        1 => Err(PyValueError::new_err(format!(
            "feature `{name}`: a 1-D array must have dtype=object and hold one 1-D array of ids per sample \
             (got dtype {}); use a 2-D array for fixed valency",
            array.dtype()
        ))),
        n => Err(PyValueError::new_err(format!(
            "feature `{name}`: Only 1D and 2D numpy arrays supported as inputs (got {n} dimensions)"
        ))),
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

fn dense<'py>(name: &str, array: &Bound<'py, PyUntypedArray>, weights: Option<&Bound<'py, PyAny>>) -> PyResult<FeatureData<'py>> {
    let weights = match weights {
        None => None,
        Some(w) => {
            let w = w.cast::<PyArray2<f32>>().map_err(|_| {
                PyTypeError::new_err(format!(
                    "feature `{name}`: dense weights must be a 2-D float32 array like the ids, got {}",
                    describe(w)
                ))
            })?;
            Some(w.try_readonly()?)
        }
    };
    if let Ok(a) = array.cast::<PyArray2<i32>>() {
        return Ok(FeatureData::DenseI32 { ids: a.try_readonly()?, weights });
    }
    if let Ok(a) = array.cast::<PyArray2<i64>>() {
        return Ok(FeatureData::DenseI64 { ids: a.try_readonly()?, weights });
    }
    Err(PyTypeError::new_err(format!(
        "feature `{name}`: dense ids must be int32 or int64, got dtype {}",
        array.dtype()
    )))
}

fn describe(obj: &Bound<'_, PyAny>) -> String {
    match obj.cast::<PyUntypedArray>() {
        Ok(a) => format!("a {}-D array of dtype {}", a.ndim(), a.dtype()),
        Err(_) => type_name(obj),
    }
}

/// What a row array's C struct says about its memory.
struct Row {
    data: *const u8,
    len: usize,
    stride: isize,
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
    let (data, len, stride) = unsafe { ((*ptr).fields.data as *const u8, *(*ptr).fields.dimensions as usize, *(*ptr).fields.strides) };
    Some(Ok(Row { data, len, stride, kind: d.kind(), itemsize: d.itemsize() }))
}

/// Appends the row's values, converted by `conv`, to `out`.
///
/// `T` must be the row's element type (checked by the callers against kind and itemsize).
fn copy_row<T: Copy, U>(row: &Row, out: &mut Vec<U>, mut conv: impl FnMut(T) -> Option<U>) -> Result<(), T> {
    debug_assert_eq!(row.itemsize, std::mem::size_of::<T>());
    out.reserve(row.len);
    let contiguous = row.stride == std::mem::size_of::<T>() as isize && (row.data as usize) % std::mem::align_of::<T>() == 0;
    if contiguous && row.len > 0 {
        // SAFETY: numpy guarantees `len` elements of `T` at `data` for a live, contiguous array
        // (alignment checked above); the GIL is held and the array referenced, so it is not freed.
        let values = unsafe { std::slice::from_raw_parts(row.data as *const T, row.len) };
        for &v in values {
            out.push(conv(v).ok_or(v)?);
        }
    } else {
        for k in 0..row.len {
            // SAFETY: element k of a live 1-D array is at data + k * stride (numpy's own
            // addressing); read_unaligned copes with any alignment.
            let v = unsafe { std::ptr::read_unaligned(row.data.offset(k as isize * row.stride) as *const T) };
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
    let out_of_range = |v: i128| {
        PyValueError::new_err(format!("feature `{name}`, sample row {r}: id {v} is outside the int32 range of embedding ids"))
    };
    let row = match row_of(obj) {
        Some(Ok(row)) => row,
        Some(Err(what)) => {
            return Err(PyTypeError::new_err(format!(
                "feature `{name}`, sample row {r}: expected a 1-D array of integer ids, got {what}"
            )))
        }
        None => {
            // Not a numpy array: accept any sequence of Python ints (the reference crashes).
            let values: Vec<i64> = obj.extract().map_err(|_| {
                PyTypeError::new_err(format!(
                    "feature `{name}`, sample row {r}: expected a 1-D array of integer ids, got {}",
                    type_name(obj)
                ))
            })?;
            for v in values {
                out.push(narrow(v).ok_or_else(|| out_of_range(v as i128))?);
            }
            return Ok(());
        }
    };
    match (row.kind, row.itemsize) {
        (b'i', 4) => copy_row::<i32, i32>(&row, out, Some).map_err(|v| out_of_range(v as i128)),
        (b'i', 8) => copy_row::<i64, i32>(&row, out, narrow).map_err(|v| out_of_range(v as i128)),
        (b'i', 2) => copy_row::<i16, i32>(&row, out, |v| Some(v as i32)).map_err(|v| out_of_range(v as i128)),
        (b'i', 1) => copy_row::<i8, i32>(&row, out, |v| Some(v as i32)).map_err(|v| out_of_range(v as i128)),
        (b'u', 4) => copy_row::<u32, i32>(&row, out, |v| i32::try_from(v).ok()).map_err(|v| out_of_range(v as i128)),
        (b'u', 8) => copy_row::<u64, i32>(&row, out, |v| i32::try_from(v).ok()).map_err(|v| out_of_range(v as i128)),
        (b'u', 2) => copy_row::<u16, i32>(&row, out, |v| Some(v as i32)).map_err(|v| out_of_range(v as i128)),
        (b'u', 1) => copy_row::<u8, i32>(&row, out, |v| Some(v as i32)).map_err(|v| out_of_range(v as i128)),
        _ => Err(PyTypeError::new_err(format!(
            "feature `{name}`, sample row {r}: ids must be integers, got dtype {}",
            obj.cast::<PyUntypedArray>().map(|a| a.dtype().to_string()).unwrap_or_default()
        ))),
    }
}

/// Appends one sample's weights.
fn push_weights(name: &str, r: usize, obj: &Bound<'_, PyAny>, out: &mut Vec<f32>) -> PyResult<()> {
    let row = match row_of(obj) {
        Some(Ok(row)) => row,
        Some(Err(what)) => {
            return Err(PyTypeError::new_err(format!(
                "feature `{name}`, sample row {r}: expected a 1-D float32 array of weights, got {what}"
            )))
        }
        None => {
            let values: Vec<f64> = obj.extract().map_err(|_| {
                PyTypeError::new_err(format!(
                    "feature `{name}`, sample row {r}: expected a 1-D float32 array of weights, got {}",
                    type_name(obj)
                ))
            })?;
            out.extend(values.into_iter().map(|v| v as f32));
            return Ok(());
        }
    };
    let ok = match (row.kind, row.itemsize) {
        (b'f', 4) => copy_row::<f32, f32>(&row, out, Some).is_ok(),
        (b'f', 8) => copy_row::<f64, f32>(&row, out, |v| Some(v as f32)).is_ok(),
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(PyTypeError::new_err(format!(
            "feature `{name}`, sample row {r}: weights must be float32 (or float64), got dtype {}",
            obj.cast::<PyUntypedArray>().map(|a| a.dtype().to_string()).unwrap_or_default()
        )))
    }
}

fn ragged<'py>(name: &str, array: &Bound<'py, PyUntypedArray>, weights: Option<&Bound<'py, PyAny>>) -> PyResult<FeatureData<'py>> {
    let rows = array.len();
    let too_many = || PyValueError::new_err(format!("feature `{name}`: more than 2147483647 ids in one batch"));
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
                PyTypeError::new_err(format!(
                    "feature `{name}`: ragged ids need ragged weights (a 1-D object array of per-sample float32 arrays), got {}",
                    describe(w)
                ))
            })?;
            if wa.len() != rows {
                return Err(PyValueError::new_err(format!(
                    "feature `{name}`: Batch size mismatch for features and weights: {rows} id rows, {} weight rows",
                    wa.len()
                )));
            }
            let mut values: Vec<f32> = Vec::with_capacity(ids.len());
            for_each_object(name, wa, |r, item| {
                push_weights(name, r, item, &mut values)?;
                let (want, got) = (splits[r + 1] as usize, values.len());
                if got != want {
                    return Err(PyValueError::new_err(format!(
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
    Ok(FeatureData::Ragged { ids, splits, weights })
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
    let (data, len, stride) = unsafe { ((*ptr).fields.data as *const u8, *(*ptr).fields.dimensions as usize, *(*ptr).fields.strides) };
    for k in 0..len {
        // SAFETY: an object array stores one `PyObject*` per element at data + k * stride, each a
        // strong reference held by the array, which is alive for this call.
        let item = unsafe {
            let p = std::ptr::read_unaligned(data.offset(k as isize * stride) as *const *mut pyo3::ffi::PyObject);
            pyo3::Borrowed::from_ptr_or_opt(py, p)
        };
        let item = item.ok_or_else(|| PyValueError::new_err(format!("feature `{name}`, sample row {k}: empty (NULL) object")))?;
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
        let (data, len, stride) = unsafe { ((*ptr).fields.data as *const u8, *(*ptr).fields.dimensions as usize, *(*ptr).fields.strides) };
        Some(RawObjects { data, len, stride })
    }
}

/// Rows up to this long are copied element by element (see `gather_raw`).
const SHORT_ROW: usize = 8;

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

/// One row's memory read straight from its structs, or `None` when the row needs the checked
/// path (not exactly an ndarray, not 1-D, a dtype we do not read here, foreign byte order).
///
/// SAFETY: `p` is an item of a live object array, and no Python code can run meanwhile.
#[inline(always)]
unsafe fn raw_row(p: *mut pyo3::ffi::PyObject, array_type: ArrayType) -> Option<Row> {
    if p.is_null() || (*p).ob_type != array_type.0 {
        return None;
    }
    let a = p as *mut PyArrayObject;
    if (*a).fields.nd != 1 {
        return None;
    }
    let d = &(*(*a).fields.descr).fields;
    let byteorder = d.byteorder as u8;
    if !(byteorder == b'=' || byteorder == b'|' || (cfg!(target_endian = "little") && byteorder == b'<')) {
        return None;
    }
    let kind = d.kind as u8;
    let itemsize = element(kind, d.type_num)?;
    Some(Row { data: (*a).fields.data as *const u8, len: *(*a).fields.dimensions as usize, stride: *(*a).fields.strides, kind, itemsize })
}

/// Gathers one ragged feature without the Python API into `buf` (cleared first, its memory
/// reused); `false` sends it down the checked path (which also produces the precise error).
///
/// SAFETY: as [`raw_row`], for every item of `ids` and `weights`.
unsafe fn gather_raw(ids: RawObjects, weights: Option<RawObjects>, array_type: ArrayType, buf: &mut Gathered) -> bool {
    let item = |o: RawObjects, k: usize| std::ptr::read_unaligned(o.data.offset(k as isize * o.stride) as *const *mut pyo3::ffi::PyObject);
    let (values, splits, weights_out) = buf;
    values.clear();
    splits.clear();
    splits.reserve(ids.len + 1);
    splits.push(0);
    let n = ids.len;
    for k in 0..n {
        let Some(row) = raw_row(item(ids, k), array_type) else { return false };
        let ok = match (row.kind, row.itemsize) {
            (b'i', 4) if row.stride == 4 && (row.data as usize) % 4 == 0 => {
                let src = if row.len > 0 { std::slice::from_raw_parts(row.data as *const i32, row.len) } else { &[][..] };
                if src.len() <= SHORT_ROW {
                    // Most rows of sparse features hold an id or two: a call to memcpy per
                    // row costs more than the copy.
                    values.reserve(SHORT_ROW);
                    for &v in src {
                        values.push(v);
                    }
                } else {
                    values.extend_from_slice(src);
                }
                true
            }
            (b'i', 4) => copy_row::<i32, i32>(&row, values, Some).is_ok(),
            (b'i', 8) => copy_row::<i64, i32>(&row, values, narrow).is_ok(),
            _ => false,
        };
        if !ok {
            return false;
        }
        let Ok(end) = i32::try_from(values.len()) else { return false };
        splits.push(end);
    }
    match weights {
        None => *weights_out = None,
        Some(w) => {
            if w.len != ids.len {
                return false;
            }
            let out = weights_out.get_or_insert_with(Vec::new);
            out.clear();
            out.reserve(values.len());
            for k in 0..w.len {
                let Some(row) = raw_row(item(w, k), array_type) else { return false };
                let ok = match (row.kind, row.itemsize) {
                    (b'f', 4) => copy_row::<f32, f32>(&row, out, Some).is_ok(),
                    (b'f', 8) => copy_row::<f64, f32>(&row, out, |v| Some(v as f32)).is_ok(),
                    _ => false,
                };
                if !ok || out.len() != splits[k + 1] as usize {
                    return false;
                }
            }
        }
    }
    true
}

/// Gathers the ragged features among `leaves` on rayon's pool, into `scratch` (one buffer per
/// leaf, resized to fit; its memory is reused from call to call, so a steady stream of batches
/// does not fault in fresh pages for the gathered ids each time). `None` where a feature needs
/// the checked path (or is not ragged).
///
/// The workers read the object arrays' items and the items' numpy structs without the Python
/// API. That is sound because the calling thread holds the GIL and blocks until they finish:
/// no Python code runs anywhere in the meantime, so nothing can be freed or resized, and every
/// object read is kept alive by `leaves`, which the caller owns.
pub fn gather_all<'py>(
    py: Python<'py>,
    leaves: &[(Option<RawObjects>, Option<RawObjects>)],
    scratch: &mut Vec<Gathered>,
) -> Vec<Option<FeatureData<'py>>> {
    use numpy::PyUntypedArray as Arr;
    use pyo3::type_object::PyTypeInfo;
    use rayon::prelude::*;
    let array_type = ArrayType(Arr::type_object_raw(py));
    scratch.resize_with(leaves.len(), Default::default);
    scratch
        .par_iter_mut()
        .zip(leaves.par_iter())
        .map(|(buf, &(ids, weights))| match ids {
            // SAFETY: see the function's documentation.
            Some(ids) => unsafe { gather_raw(ids, weights, array_type, buf) },
            None => false,
        })
        .collect::<Vec<bool>>()
        .into_iter()
        .zip(scratch.iter_mut())
        .map(|(ok, buf)| {
            ok.then(|| {
                let (ids, splits, weights) = std::mem::take(buf);
                FeatureData::Ragged { ids, splits, weights }
            })
        })
        .collect()
}

/// Hands the buffers of gathered features back to `scratch` for the next call.
pub fn recycle(data: Vec<FeatureData<'_>>, scratch: &mut [Gathered]) {
    for (d, slot) in data.into_iter().zip(scratch.iter_mut()) {
        if let FeatureData::Ragged { ids, splits, weights } = d {
            *slot = (ids, splits, weights);
        }
    }
}

/// A gathered ragged feature: ids, row splits, weights.
pub type Gathered = (Vec<i32>, Vec<i32>, Option<Vec<f32>>);
