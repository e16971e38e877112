//! The reference's NPZ stats dumps (`NPZFileFDOClient`, SPEC 7.3): a zip of `.npy` arrays
//! named `<stack>_max_ids`, `<stack>_max_unique_ids`, `<stack>_required_buffer_size` and
//! `<stack>_id_drop_counters`, int64, one row per recorded step.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::Path;

use crate::error::{Error, Result};

use super::{FdoStats, LayoutKey};

/// The reference's key suffixes, in its field order.
pub const SUFFIXES: [&str; 4] = ["_max_ids", "_max_unique_ids", "_required_buffer_size", "_id_drop_counters"];

fn bad(path: &str, what: String) -> Error {
    Error::InvalidInput { feature: path.to_string(), reason: what }
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
        let cols: usize = self.shape[1..].iter().fold(1usize, |a, &d| a.saturating_mul(d)).min(self.data.len());
        let mut out = vec![i64::MIN; cols];
        for row in self.data.chunks(cols.max(1)) {
            for (o, &v) in out.iter_mut().zip(row) {
                *o = (*o).max(v);
            }
        }
        out
    }
}

/// Encodes an int64 array as `.npy` (format 1.0, little-endian).
pub fn encode_npy(a: &NpyArray) -> Vec<u8> {
    let shape = match a.shape.len() {
        0 => "()".to_string(),
        1 => format!("({},)", a.shape[0]),
        _ => format!("({})", a.shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")),
    };
    let mut header = format!("{{'descr': '<i8', 'fortran_order': False, 'shape': {shape}, }}");
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - total % 64) % 64));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + 8 * a.data.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for v in &a.data {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Decodes a `.npy` holding little-endian int64 or int32 (C order).
pub fn decode_npy(bytes: &[u8], name: &str) -> Result<NpyArray> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(bad(name, "not a .npy array".into()));
    }
    let (hlen, hstart) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        v => return Err(bad(name, format!("unsupported .npy version {v}"))),
    };
    let header = bytes
        .get(hstart..hstart + hlen)
        .and_then(|h| std::str::from_utf8(h).ok())
        .ok_or_else(|| bad(name, "truncated .npy header".into()))?;
    let field = |key: &str| -> Option<&str> {
        let i = header.find(&format!("'{key}'"))?;
        let rest = header[i + key.len() + 2..].trim_start().strip_prefix(':')?.trim_start();
        Some(rest)
    };
    let descr = field("descr").and_then(|r| r.split('\'').nth(1)).ok_or_else(|| bad(name, "no descr".into()))?;
    let width = match descr {
        "<i8" | "|i8" => 8,
        "<i4" | "|i4" => 4,
        other => return Err(bad(name, format!("dtype {other} is not int64 or int32"))),
    };
    if field("fortran_order").is_some_and(|r| r.starts_with("True")) {
        return Err(bad(name, "Fortran-order arrays are not supported".into()));
    }
    let shape_text = field("shape").and_then(|r| r.strip_prefix('(')).and_then(|r| r.split(')').next()).ok_or_else(|| bad(name, "no shape".into()))?;
    let shape: Vec<usize> = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<usize>().map_err(|_| bad(name, format!("bad shape ({shape_text})"))))
        .collect::<Result<_>>()?;
    let count = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad(name, format!("shape ({shape_text}) is too large")))?;
    let body = &bytes[hstart + hlen..];
    if count.checked_mul(width).is_none_or(|need| body.len() < need) {
        return Err(bad(name, format!("{} data bytes for {count} values", body.len())));
    }
    let data = body[..count * width]
        .chunks_exact(width)
        .map(|c| if width == 8 { i64::from_le_bytes(c.try_into().unwrap()) } else { i32::from_le_bytes(c.try_into().unwrap()) as i64 })
        .collect();
    Ok(NpyArray { shape, data })
}

/// Reads every array of an `.npz` file.
pub fn read_npz(path: &Path) -> Result<BTreeMap<String, NpyArray>> {
    let name = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|source| Error::Io { context: format!("opening {name}"), source })?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| bad(&name, format!("not a zip archive: {e}")))?;
    let mut out = BTreeMap::new();
    for i in 0..zip.len() {
        let mut f = zip.by_index(i).map_err(|e| bad(&name, e.to_string()))?;
        let key = f.name().strip_suffix(".npy").unwrap_or(f.name()).to_string();
        let mut bytes = Vec::new();
        f.read_to_end(&mut bytes).map_err(|source| Error::Io { context: format!("reading {name}/{key}"), source })?;
        out.insert(key.clone(), decode_npy(&bytes, &format!("{name}/{key}"))?);
    }
    Ok(out)
}

/// Writes arrays as an uncompressed `.npz` (what `np.savez` writes).
pub fn write_npz(path: &Path, arrays: &BTreeMap<String, NpyArray>) -> Result<()> {
    let mut buf = std::io::Cursor::new(Vec::new());
    {
        let mut zip = zip::ZipWriter::new(&mut buf);
        let opts = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
        for (k, a) in arrays {
            zip.start_file(format!("{k}.npy"), opts).map_err(|e| bad(&path.display().to_string(), e.to_string()))?;
            zip.write_all(&encode_npy(a)).map_err(|source| Error::Io { context: format!("writing {}", path.display()), source })?;
        }
        zip.finish().map_err(|e| bad(&path.display().to_string(), e.to_string()))?;
    }
    super::write_atomic(path, &buf.into_inner())
}

/// Splits a reference key into (stack, field index) by its suffix.
pub fn split_key(key: &str) -> Option<(&str, usize)> {
    SUFFIXES.iter().enumerate().find_map(|(i, s)| key.strip_suffix(s).map(|stack| (stack, i)))
}

/// Builds stats from reference-style arrays: multi-row arrays are max-reduced over rows, as the
/// reference's `load` does. Unknown keys are refused (as the reference refuses them).
pub fn stats_from_arrays(layout: LayoutKey, arrays: &BTreeMap<String, NpyArray>, source: &str) -> Result<FdoStats> {
    let mut stats = FdoStats::new(layout);
    for (key, a) in arrays {
        let (stack, field) = split_key(key).ok_or_else(|| bad(source, format!("Unexpected key: {key}")))?;
        let st = stats.stacks.entry(stack.to_string()).or_default();
        let v = a.max_over_rows();
        let ints = || v.iter().map(|&x| x.clamp(i32::MIN as i64, i32::MAX as i64) as i32).collect::<Vec<_>>();
        match field {
            0 => st.max_ids_per_partition = ints(),
            1 => st.max_unique_ids_per_partition = ints(),
            2 => st.required_buffer_size_per_sc = ints(),
            _ => st.dropped_id_count = v.iter().copied().max().unwrap_or(0).max(0) as u64,
        }
        stats.batches = stats.batches.max(if a.shape.len() >= 2 { a.shape[0] as u64 } else { 1 });
    }
    Ok(stats)
}

/// Our stats as reference-style arrays (one recorded step: 1-D arrays, scalar drop counter).
pub fn stats_to_arrays(stats: &FdoStats) -> BTreeMap<String, NpyArray> {
    let mut out = BTreeMap::new();
    for (name, st) in &stats.stacks {
        let vec1 = |v: &[i32]| NpyArray { shape: vec![v.len()], data: v.iter().map(|&x| x as i64).collect() };
        out.insert(format!("{name}_max_ids"), vec1(&st.max_ids_per_partition));
        out.insert(format!("{name}_max_unique_ids"), vec1(&st.max_unique_ids_per_partition));
        out.insert(format!("{name}_required_buffer_size"), vec1(&st.required_buffer_size_per_sc));
        out.insert(format!("{name}_id_drop_counters"), NpyArray { shape: vec![], data: vec![st.dropped_id_count as i64] });
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
