//! The reference's NPZ stats dumps (`NPZFileFDOClient`, SPEC 7.3): a zip of `.npy` arrays
//! named `<stack>_max_ids`, `<stack>_max_unique_ids`, `<stack>_required_buffer_size` and
//! `<stack>_id_drop_counters`, int64, one row per recorded step.
//!
//! The `.npy` format itself (header dictionary, versions 1.0-3.0, byte orders, Fortran order) is
//! ndarray-npy's; this module only chooses the element type, checks a declared shape against the
//! bytes that are there before anything is allocated for it, and reads and writes the zip
//! container itself (with `zip`) so that the same check covers its members (ndarray-npy's
//! `NpzReader` allocates what a member's header declares before reading its data).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::Path;

use ndarray::{ArrayViewD, IxDyn, ShapeBuilder};
use ndarray_npy::npy::header::{Header, ReadHeaderError};
use ndarray_npy::{ReadableElement, WriteNpyExt};
use py_literal::Value as PyValue;

use crate::error::{Error, NpzBound, Result};

use super::{FdoStats, LayoutKey};

/// The reference's key suffixes, in its field order.
pub(crate) const SUFFIXES: [&str; 4] = [
    "_max_ids",
    "_max_unique_ids",
    "_required_buffer_size",
    "_id_drop_counters",
];

/// The `.npy` magic string.
const MAGIC: &[u8] = b"\x93NUMPY";

/// numpy's own limit on dimensions (`NPY_MAXDIMS` of numpy 2); more is a malformed file.
const MAX_NDIM: usize = 64;

/// The most a `.npy` header may take, after its fixed 10 or 12 bytes. numpy's `np.load` refuses
/// headers above 10000 bytes unless told otherwise, and one of 64 dimensions of 20 digits each
/// takes under 2 KiB; this bound only keeps a hostile declared length from being read.
pub const MAX_NPY_HEADER_BYTES: u64 = 1 << 16;

/// The most one member of a stats `.npz` may decompress to. A stats array holds one count per
/// partition (or SparseCore) and recorded step; this is far above any real dump, and it bounds
/// what a member whose header declares a huge array can make [`read_npz`] allocate.
pub const MAX_STATS_MEMBER_BYTES: u64 = 1 << 30;

fn bad(path: &str, what: String) -> Error {
    Error::data(path, what)
}

/// A zip error's text, with the I/O error behind it (zip's own text for that is only "i/o error").
fn zip_problem(e: zip::result::ZipError) -> String {
    match e {
        zip::result::ZipError::Io(io) => format!("i/o error: {io}"),
        other => other.to_string(),
    }
}

/// One int64 array: its shape and values (row-major).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NpyArray {
    /// Shape (empty for a scalar).
    pub shape: Vec<usize>,
    /// Values, row-major.
    pub data: Vec<i64>,
}

impl NpyArray {
    /// Column-wise max over rows (a 1-D or 0-d array is returned as is, flattened). An array
    /// without values (no rows, or a zero-width row) gives no values: its row width is only a
    /// declared shape, never backed by data, so it must not size an allocation.
    pub fn max_over_rows(&self) -> Vec<i64> {
        if self.shape.len() < 2 || self.data.is_empty() {
            return self.data.clone();
        }
        // A decoded array has every dimension at least 1 here, so `cols <= data.len()`; the
        // `min` keeps a hand-built array with a shape its data does not match just as bounded.
        let cols: usize = self.shape[1..]
            .iter()
            .fold(1usize, |a, &d| a.saturating_mul(d))
            .min(self.data.len());
        let mut out = vec![i64::MIN; cols];
        for row in self.data.chunks(cols.max(1)) {
            for (o, &v) in out.iter_mut().zip(row) {
                *o = (*o).max(v);
            }
        }
        out
    }

    /// The array as an ndarray view. Every decoded array and every array of
    /// [`stats_to_arrays`] has a shape that matches its data; a hand-built one whose shape does
    /// not (or has more than 64 dimensions) is viewed as the 1-D array of its data.
    fn view(&self) -> ArrayViewD<'_, i64> {
        ArrayViewD::from_shape(IxDyn(&self.shape), &self.data)
            .ok()
            .filter(|v| v.len() == self.data.len() && v.ndim() <= MAX_NDIM)
            .unwrap_or_else(|| ndarray::ArrayView1::from(&self.data[..]).into_dyn())
    }
}

/// `text` on one line, cut to `max` characters: a parse error quotes the header, which can be
/// megabytes long in a hostile file.
fn one_line(text: &str, max: usize) -> String {
    let squashed = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match squashed.char_indices().nth(max) {
        Some((cut, _)) => format!("{}...", &squashed[..cut]),
        None => squashed,
    }
}

fn shape_text(shape: &[usize]) -> String {
    match shape {
        [d] => format!("({d},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// The number of values of a shape, if ndarray can hold it: the product of the non-zero lengths
/// fits in isize (a shape such as (0, 2^62, 2^62) holds no values but could not be written back).
fn value_count(shape: &[usize]) -> Option<usize> {
    shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d.max(1)))
        .filter(|&n| n <= isize::MAX as usize)?;
    Some(shape.iter().product())
}

/// The dtype as read (`|` on a multi-byte integer, "byte order not applicable", is read as
/// little-endian) and its width in bytes, for the int64 and int32 this module reads.
fn int_descr(descr: &PyValue) -> Option<(PyValue, usize)> {
    let descr = match descr {
        PyValue::String(s) if s.starts_with('|') => PyValue::String(s.replacen('|', "<", 1)),
        other => other.clone(),
    };
    let width = match &descr {
        PyValue::String(s) if s == "<i8" || s == ">i8" => 8,
        PyValue::String(s) if s == "<i4" || s == ">i4" => 4,
        _ => return None,
    };
    Some((descr, width))
}

/// Encodes an int64 array as `.npy` (little-endian, C order; format 1.0 as numpy writes it).
pub fn encode_npy(a: &NpyArray) -> Vec<u8> {
    let mut out = Vec::with_capacity(128 + 8 * a.data.len());
    // Writing to memory cannot fail: no I/O error, int64 values always encode, and the header
    // of at most 64 dimensions (`view`) is far below the format's 4 GiB limit.
    a.view()
        .write_npy(&mut out)
        .expect("an .npy of at most 64 dimensions encodes into memory");
    out
}

/// Decodes a `.npy` holding int64 or int32 (either byte order, C or Fortran order; a Fortran
/// order array comes back in row-major order, as `np.load` gives it). The declared shape is
/// checked against the data bytes before anything is allocated for it, and bytes after the
/// data are ignored (as `np.load` ignores them).
pub fn decode_npy(bytes: &[u8], name: &str) -> Result<NpyArray> {
    if !bytes.starts_with(MAGIC) {
        return Err(bad(
            name,
            "not a .npy array (no \\x93NUMPY magic string)".into(),
        ));
    }
    // Formats 2.0 and 3.0 declare the header length in 32 bits, and ndarray-npy allocates it
    // before reading: refuse a length the bytes do not have.
    if let (Some(2 | 3), Some(len)) = (bytes.get(6), bytes.get(8..12)) {
        let declared = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
        if declared > bytes.len() - 12 {
            return Err(bad(
                name,
                format!(
                    "not a .npy array: truncated header ({declared} bytes declared, {} there)",
                    bytes.len() - 12
                ),
            ));
        }
    }
    let mut body = bytes;
    let header = Header::from_reader(&mut body).map_err(|e| match e {
        ReadHeaderError::Io(_) => bad(name, "not a .npy array: truncated header".into()),
        ReadHeaderError::Parse(e) => bad(
            name,
            format!(
                "not a .npy array: bad header: {}",
                one_line(&e.to_string(), 300)
            ),
        ),
    })?;
    let shape = header.shape;
    if shape.len() > MAX_NDIM {
        return Err(bad(
            name,
            format!(
                "{} dimensions (numpy allows at most {MAX_NDIM})",
                shape.len()
            ),
        ));
    }
    let too_large = || bad(name, format!("shape {} is too large", shape_text(&shape)));
    let count = value_count(&shape).ok_or_else(too_large)?;
    let Some((descr, width)) = int_descr(&header.type_descriptor) else {
        return Err(bad(
            name,
            format!(
                "dtype {} is not int64 or int32",
                one_line(&header.type_descriptor.to_string(), 100)
            ),
        ));
    };
    let need = count.checked_mul(width).ok_or_else(too_large)?;
    if body.len() < need {
        return Err(bad(
            name,
            format!("{} data bytes for {count} values", body.len()),
        ));
    }
    let data_bytes = &body[..need];
    let read_err = |e: ndarray_npy::ReadDataError| bad(name, format!("reading the data: {e}"));
    let data: Vec<i64> = if width == 8 {
        i64::read_to_end_exact_vec(data_bytes, &descr, count).map_err(read_err)?
    } else {
        i32::read_to_end_exact_vec(data_bytes, &descr, count)
            .map_err(read_err)?
            .into_iter()
            .map(i64::from)
            .collect()
    };
    let data = if header.layout.is_fortran() && count > 0 {
        let view = ArrayViewD::from_shape(IxDyn(&shape).f(), &data)
            .map_err(|e| bad(name, format!("shape {}: {e}", shape_text(&shape))))?;
        view.iter().copied().collect()
    } else {
        data
    };
    Ok(NpyArray { shape, data })
}

/// Reads the `.npy` bytes of one `.npz` member for [`decode_npy`]: its header, then exactly the
/// data bytes the header declares, never more. `size` is what the zip says the member
/// decompresses to; a member above `limit`, with a header above [`MAX_NPY_HEADER_BYTES`], or
/// larger than its header declares is refused before its data is inflated, since deflate lets a
/// small file declare and hold gigabytes. Whatever else is wrong (no magic string, a bad header,
/// a dtype other than int64 or int32, too few data bytes) is left to [`decode_npy`] to name: for
/// such a member only the bytes up to the end of its header are read.
pub fn read_npy_member(
    mut member: impl Read,
    size: u64,
    limit: u64,
    file: &str,
    key: &str,
) -> Result<Vec<u8>> {
    let refuse = |size: u64, bound: NpzBound, limit: u64| Error::NpzMemberTooLarge {
        file: file.into(),
        member: key.into(),
        size,
        bound,
        limit,
    };
    if size > limit {
        return Err(refuse(size, NpzBound::Member, limit));
    }
    let io = |source| Error::Io {
        context: format!("reading {file}/{key}"),
        source,
    };
    let mut bytes = Vec::new();
    let mut read_up_to = |bytes: &mut Vec<u8>, end: u64| -> Result<()> {
        let more = end.saturating_sub(bytes.len() as u64);
        (&mut member)
            .take(more)
            .read_to_end(bytes)
            .map(|_| ())
            .map_err(io)
    };
    // The fixed part: magic string, version, header length (2 bytes in format 1.0, 4 after).
    read_up_to(&mut bytes, 12)?;
    let header_end = match (bytes.starts_with(MAGIC), bytes.get(6)) {
        (true, Some(1)) if bytes.len() >= 10 => {
            10 + u64::from(u16::from_le_bytes([bytes[8], bytes[9]]))
        }
        (true, Some(2 | 3)) if bytes.len() >= 12 => {
            12 + u64::from(u32::from_le_bytes([
                bytes[8], bytes[9], bytes[10], bytes[11],
            ]))
        }
        _ => return Ok(bytes),
    };
    let header_len = header_end - if bytes[6] == 1 { 10 } else { 12 };
    if header_len > MAX_NPY_HEADER_BYTES {
        return Err(refuse(header_len, NpzBound::Header, MAX_NPY_HEADER_BYTES));
    }
    read_up_to(&mut bytes, header_end)?;
    let header = match Header::from_reader(&mut &bytes[..]) {
        Ok(h) if h.shape.len() <= MAX_NDIM => h,
        _ => return Ok(bytes),
    };
    let data = value_count(&header.shape)
        .zip(int_descr(&header.type_descriptor))
        .and_then(|(n, (_, w))| n.checked_mul(w));
    let Some(declared) = data.and_then(|d| header_end.checked_add(d as u64)) else {
        return Ok(bytes);
    };
    if size > declared {
        return Err(refuse(size, NpzBound::Declared, declared));
    }
    read_up_to(&mut bytes, declared)?;
    // One more read: zip checks the member's CRC when it reaches the end, and a reader that
    // does not stop at the declared size must not make a longer member pass.
    let mut past = [0u8; 1];
    if member.read(&mut past).map_err(io)? != 0 {
        return Err(refuse(declared + 1, NpzBound::Declared, declared));
    }
    Ok(bytes)
}

/// Reads every array of an `.npz` file. A member may decompress to at most
/// [`MAX_STATS_MEMBER_BYTES`], and to no more than its `.npy` header declares.
pub fn read_npz(path: &Path) -> Result<BTreeMap<String, NpyArray>> {
    let name = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|source| Error::Io {
        context: format!("opening {name}"),
        source,
    })?;
    let mut zip = zip::ZipArchive::new(file)
        .map_err(|e| bad(&name, format!("not a zip archive: {}", zip_problem(e))))?;
    let mut out = BTreeMap::new();
    for i in 0..zip.len() {
        let f = zip
            .by_index(i)
            .map_err(|e| bad(&name, format!("member {i}: {}", zip_problem(e))))?;
        let member = f
            .name()
            .map_err(|e| bad(&name, format!("member {i}: {}", zip_problem(e))))?
            .into_owned();
        // np.load's names: a single `.npy` suffix is dropped.
        let key = member.strip_suffix(".npy").unwrap_or(&member).to_string();
        let size = f.size();
        let bytes = read_npy_member(f, size, MAX_STATS_MEMBER_BYTES, &name, &key)?;
        out.insert(key.clone(), decode_npy(&bytes, &format!("{name}/{key}"))?);
    }
    Ok(out)
}

/// Writes arrays as an uncompressed `.npz` (what `np.savez` writes).
pub fn write_npz(path: &Path, arrays: &BTreeMap<String, NpyArray>) -> Result<()> {
    let name = path.display().to_string();
    let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    // np.savez stores its members uncompressed, as `<key>.npy`.
    let options =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for (k, a) in arrays {
        let problem = |what: String| bad(&name, format!("writing {k}: {what}"));
        zip.start_file(format!("{k}.npy"), options)
            .map_err(|e| problem(zip_problem(e)))?;
        zip.write_all(&encode_npy(a))
            .map_err(|e| problem(e.to_string()))?;
    }
    let buf = zip.finish().map_err(|e| bad(&name, zip_problem(e)))?;
    super::write_atomic(path, &buf.into_inner())
}

/// Splits a reference key into (stack, field index) by its suffix.
pub fn split_key(key: &str) -> Option<(&str, usize)> {
    SUFFIXES
        .iter()
        .enumerate()
        .find_map(|(i, s)| key.strip_suffix(s).map(|stack| (stack, i)))
}

/// Builds stats from reference-style arrays: multi-row arrays are max-reduced over rows, as the
/// reference's `load` does. Unknown keys are refused (as the reference refuses them).
pub fn stats_from_arrays(
    layout: LayoutKey,
    arrays: &BTreeMap<String, NpyArray>,
    source: &str,
) -> Result<FdoStats> {
    let mut stats = FdoStats::new(layout);
    for (key, a) in arrays {
        let (stack, field) =
            split_key(key).ok_or_else(|| bad(source, format!("Unexpected key: {key}")))?;
        let st = stats.stacks.entry(stack.to_string()).or_default();
        let v = a.max_over_rows();
        // The stats hold 32-bit counts, as the reference's do: a larger one is a damaged file.
        let ints = || {
            v.iter()
                .map(|&x| {
                    i32::try_from(x).map_err(|_| {
                        bad(
                            source,
                            format!("`{key}` holds {x}, past the 32-bit counts stats hold"),
                        )
                    })
                })
                .collect::<Result<Vec<_>>>()
        };
        match field {
            0 => st.max_ids_per_partition = ints()?,
            1 => st.max_unique_ids_per_partition = ints()?,
            2 => st.required_buffer_size_per_sc = ints()?,
            _ => st.dropped_id_count = v.iter().copied().max().unwrap_or(0).max(0) as u64,
        }
        stats.batches = stats.batches.max(if a.shape.len() >= 2 {
            a.shape[0] as u64
        } else {
            1
        });
    }
    // The reference's `set_required_buffer_size_per_device(table, size, S)` stores S values (each
    // SparseCore's share of one device's size) whatever L is; every local device needs that size,
    // so they stand for each of the L devices.
    let (l, s) = (layout.local_device_count, layout.num_sc_per_device);
    if l > 1 {
        for st in stats.stacks.values_mut() {
            if st.required_buffer_size_per_sc.len() == s {
                st.required_buffer_size_per_sc = st.required_buffer_size_per_sc.repeat(l);
            }
        }
    }
    stats.validate()?;
    Ok(stats)
}

/// Our stats as reference-style arrays (one recorded step: 1-D arrays, scalar drop counter).
pub fn stats_to_arrays(stats: &FdoStats) -> BTreeMap<String, NpyArray> {
    let mut out = BTreeMap::new();
    for (name, st) in &stats.stacks {
        let vec1 = |v: &[i32]| NpyArray {
            shape: vec![v.len()],
            data: v.iter().map(|&x| x as i64).collect(),
        };
        out.insert(format!("{name}_max_ids"), vec1(&st.max_ids_per_partition));
        out.insert(
            format!("{name}_max_unique_ids"),
            vec1(&st.max_unique_ids_per_partition),
        );
        out.insert(
            format!("{name}_required_buffer_size"),
            vec1(&st.required_buffer_size_per_sc),
        );
        out.insert(
            format!("{name}_id_drop_counters"),
            NpyArray {
                shape: vec![],
                data: vec![st.dropped_id_count as i64],
            },
        );
    }
    out
}

/// Reads a reference `.npz` stats file.
pub fn import(path: &Path, layout: LayoutKey) -> Result<FdoStats> {
    stats_from_arrays(layout, &read_npz(path)?, &path.display().to_string())
}

/// Writes stats as a reference `.npz` file.
pub fn export(path: &Path, stats: &FdoStats) -> Result<()> {
    write_npz(path, &stats_to_arrays(stats))
}
