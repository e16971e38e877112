//! The reference's CSV stats dumps (`CSVFileFDOClient`, SPEC 7.4): a `key,values` header, then
//! one row per array (or per matrix row) with the values space-separated.

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::{Error, Result};

use super::npz::{stats_from_arrays, stats_to_arrays, NpyArray};
use super::{FdoStats, LayoutKey};

/// Parses CSV text into arrays; rows with the same key are stacked into a matrix.
pub fn parse(text: &str, source: &str) -> Result<BTreeMap<String, NpyArray>> {
    let bad = |reason: String| Error::data(source, reason);
    let mut lines = text.lines();
    match lines.next().map(str::trim) {
        Some("key,values") => {}
        other => {
            return Err(bad(format!(
                "expected the header `key,values`, got {other:?}"
            )))
        }
    }
    let mut rows: BTreeMap<String, Vec<Vec<i64>>> = BTreeMap::new();
    for (i, line) in lines.enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let (key, values) = line
            .split_once(',')
            .ok_or_else(|| bad(format!("line {}: no comma", i + 2)))?;
        let vals = values
            .split_whitespace()
            .map(|v| {
                v.parse::<i64>()
                    .map_err(|_| bad(format!("line {}: {v:?} is not an integer", i + 2)))
            })
            .collect::<Result<Vec<_>>>()?;
        // The key is kept verbatim: stack names may start or end with spaces.
        rows.entry(key.to_string()).or_default().push(vals);
    }
    rows.into_iter()
        .map(|(k, rs)| {
            let arr = if rs.len() == 1 {
                NpyArray {
                    shape: vec![rs[0].len()],
                    data: rs[0].clone(),
                }
            } else {
                let cols = rs[0].len();
                if rs.iter().any(|r| r.len() != cols) {
                    return Err(bad(format!("rows of {k} have different lengths")));
                }
                NpyArray {
                    shape: vec![rs.len(), cols],
                    data: rs.concat(),
                }
            };
            Ok((k, arr))
        })
        .collect()
}

/// Renders arrays as CSV.
pub fn render(arrays: &BTreeMap<String, NpyArray>) -> String {
    let mut out = String::from("key,values\n");
    for (k, a) in arrays {
        let cols = if a.shape.len() >= 2 {
            a.shape[1..].iter().product::<usize>().max(1)
        } else {
            a.data.len().max(1)
        };
        for row in a.data.chunks(cols) {
            out.push_str(k);
            out.push(',');
            out.push_str(
                &row.iter()
                    .map(|v| v.to_string())
                    .collect::<Vec<_>>()
                    .join(" "),
            );
            out.push('\n');
        }
    }
    out
}

/// Reads a reference `.csv` stats file.
pub fn import(path: &Path, layout: LayoutKey) -> Result<FdoStats> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        context: format!("reading {name}"),
        source,
    })?;
    stats_from_arrays(layout, &parse(&text, &name)?, &name)
}

/// Whether `key` reads back unchanged from a CSV line: it holds no comma (the key/values
/// separator) and no line break.
pub fn representable(key: &str) -> bool {
    !key.contains([',', '\n', '\r'])
}

/// Writes stats as a reference `.csv` file. A stack whose name cannot be a CSV key (see
/// [`representable`]) is refused rather than written as a file that reads back differently.
pub fn export(path: &Path, stats: &FdoStats) -> Result<()> {
    if let Some(name) = stats.stacks.keys().find(|k| !representable(k)) {
        return Err(Error::data(
            path.display().to_string(),
            format!("stack name {name:?} cannot be a CSV key: it contains a comma or a line break"),
        ));
    }
    super::write_atomic(path, render(&stats_to_arrays(stats)).as_bytes())
}
