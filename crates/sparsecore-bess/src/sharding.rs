//! Random, balanced sharding of the entity table (besskge's `Sharding.create`, SPEC section 2),
//! and its `.npz` form.
//!
//! Why random and equal: every shard holds `ceil(E / n)` slots, so every worker stores (and,
//! with shard-pair batches, gathers) the same number of rows; a random permutation keeps
//! high-degree entities from piling up on one shard.

use std::collections::BTreeMap;
use std::path::Path;

use ndarray::Array2;
use sparsecore_prep::fdo::npz::{
    decode_npy, read_npy_member, write_npz, NpyArray, MAX_NPY_HEADER_BYTES,
};

use crate::error::{BessError, Result};
use crate::rng::NumpyRng;

/// A mapping of entities to shards and local ids, and back (besskge's `Sharding`).
///
/// Field names are besskge's, so that [`Sharding::save_npz`] / [`Sharding::load_npz`] exchange
/// files with `Sharding.save` / `Sharding.load`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sharding {
    /// Number of shards `n`.
    pub n_shard: usize,
    /// `[E]`: the shard of each entity.
    pub entity_to_shard: Vec<i64>,
    /// `[E]`: the local id of each entity on its shard.
    pub entity_to_idx: Vec<i64>,
    /// `[n, M]`: the global id at (shard, local id); ids `>= E` are padding.
    pub shard_and_idx_to_entity: Array2<i64>,
    /// `[n]`: real entities per shard.
    pub shard_counts: Vec<i64>,
    /// `[n, T]`: entities of each type per shard (typed shardings only).
    pub entity_type_counts: Option<Array2<i64>>,
    /// `[n, T]`: first local id of each type per shard (typed shardings only).
    pub entity_type_offsets: Option<Array2<i64>>,
}

/// Most shards a sharding may have (far above any SparseCore count; a bound on memory).
pub const MAX_SHARDS: usize = 1 << 24;

/// The most one member of a sharding `.npz` may decompress to: the largest array a valid
/// sharding holds, `shard_and_idx_to_entity` of `n · ceil(E / n) < E + n` int64 slots with
/// `E <= i32::MAX` and `n <= MAX_SHARDS`, plus its `.npy` header.
pub const MAX_SHARDING_MEMBER_BYTES: u64 =
    (i32::MAX as u64 + MAX_SHARDS as u64) * 8 + 12 + MAX_NPY_HEADER_BYTES;

/// `type(x)` = number of offsets `<= x`, minus one (numpy's `digitize(x, offsets) - 1`).
pub(crate) fn type_of(offsets: &[i64], x: i64) -> i64 {
    offsets.partition_point(|&o| o <= x) as i64 - 1
}

/// Checks that type offsets are usable: non-empty, starting at 0, non-decreasing, none past
/// `n_entity`. An offset past it would put the padding slots (ids `E..`) in an earlier type,
/// whose count would then include them while the last type's went negative (besskge takes
/// every padding slot off the last type), a sharding [`Sharding::validate`] refuses.
pub(crate) fn check_type_offsets(offsets: &[i64], n_entity: usize) -> Result<()> {
    if offsets.first() != Some(&0) || offsets.windows(2).any(|w| w[0] > w[1]) {
        return Err(BessError::param(
            "type_offsets",
            format!("{offsets:?}"),
            "must be a non-empty, non-decreasing list starting at 0",
        ));
    }
    if let Some((i, &o)) = offsets
        .iter()
        .enumerate()
        .find(|&(_, &o)| o as u64 > n_entity as u64)
    {
        return Err(BessError::param(
            "type_offsets",
            format!("{offsets:?}"),
            format!(
                "offset {i} is {o}, past n_entity = {n_entity} (types are ranges of entity ids)"
            ),
        ));
    }
    Ok(())
}

impl Sharding {
    /// `Sharding.create(n_entity, n_shard, seed, type_offsets)`: shards of `M = ceil(E / n)`
    /// slots filled from `permutation(n * M)` of `default_rng(seed)`, each row sorted.
    ///
    /// `seed_words` are the seed's little-endian 32-bit digits ([`crate::rng::seed_words`]).
    pub fn create(
        n_entity: usize,
        n_shard: usize,
        seed_words: &[u32],
        type_offsets: Option<&[i64]>,
    ) -> Result<Self> {
        if n_shard == 0 {
            return Err(BessError::param("n_shard", 0, "must be at least 1"));
        }
        if n_shard > MAX_SHARDS {
            return Err(BessError::param(
                "n_shard",
                n_shard,
                format!("must be at most {MAX_SHARDS}"),
            ));
        }
        if n_entity == 0 {
            return Err(BessError::param("n_entity", 0, "must be at least 1"));
        }
        if n_entity > i32::MAX as usize {
            return Err(BessError::param(
                "n_entity",
                n_entity,
                "must fit in int32 (besskge's id type)",
            ));
        }
        if let Some(o) = type_offsets {
            check_type_offsets(o, n_entity)?;
        }
        let m = n_entity.div_ceil(n_shard);
        let mut rng = NumpyRng::from_words(seed_words);
        let perm = rng.permutation(n_shard * m);
        let mut table = Array2::<i64>::zeros((n_shard, m));
        let mut entity_to_shard = vec![0i64; n_entity];
        let mut entity_to_idx = vec![0i64; n_entity];
        let mut shard_counts = vec![0i64; n_shard];
        for s in 0..n_shard {
            let mut row: Vec<usize> = perm[s * m..(s + 1) * m].to_vec();
            row.sort_unstable();
            for (i, &e) in row.iter().enumerate() {
                table[[s, i]] = e as i64;
                if e < n_entity {
                    entity_to_shard[e] = s as i64;
                    entity_to_idx[e] = i as i64;
                    shard_counts[s] += 1;
                }
            }
        }
        let (entity_type_counts, entity_type_offsets) = match type_offsets {
            None => (None, None),
            Some(offsets) => {
                let t = offsets.len();
                let mut counts = Array2::<i64>::zeros((n_shard, t));
                for s in 0..n_shard {
                    for &e in table.row(s) {
                        let ty = type_of(offsets, e);
                        counts[[s, ty as usize]] += 1;
                    }
                }
                let mut offs = Array2::<i64>::zeros((n_shard, t));
                for s in 0..n_shard {
                    for k in 1..t {
                        offs[[s, k]] = offs[[s, k - 1]] + counts[[s, k - 1]];
                    }
                    counts[[s, t - 1]] -= m as i64 - shard_counts[s];
                }
                (Some(counts), Some(offs))
            }
        };
        Ok(Sharding {
            n_shard,
            entity_to_shard,
            entity_to_idx,
            shard_and_idx_to_entity: table,
            shard_counts,
            entity_type_counts,
            entity_type_offsets,
        })
    }

    /// Number of entities `E`.
    #[must_use]
    pub fn n_entity(&self) -> usize {
        self.entity_to_shard.len()
    }

    /// Slots per shard `M = ceil(E / n)`.
    #[must_use]
    pub fn max_entity_per_shard(&self) -> usize {
        self.shard_and_idx_to_entity.ncols()
    }

    /// Shard and local id of entity `e`, or the typed error naming `column` and `row`.
    pub fn locate(&self, e: i64, column: &str, row: usize) -> Result<(usize, usize)> {
        if e < 0 || e as usize >= self.n_entity() {
            return Err(BessError::EntityOutOfRange {
                column: column.to_string(),
                row,
                value: e,
                n_entity: self.n_entity(),
            });
        }
        Ok((
            self.entity_to_shard[e as usize] as usize,
            self.entity_to_idx[e as usize] as usize,
        ))
    }

    /// Writes the sharding as besskge's `Sharding.save` does (`np.savez` of the dataclass
    /// fields, int64). An untyped sharding omits the two type fields: besskge writes them as
    /// pickled `None`, which its own `Sharding.load` cannot read back without `allow_pickle`;
    /// load ours in Python with
    /// `Sharding(n_shard=int(d.pop("n_shard")), entity_type_counts=None, entity_type_offsets=None, **d)`.
    pub fn save_npz(&self, path: impl AsRef<Path>) -> Result<()> {
        let mut arrays = BTreeMap::new();
        arrays.insert(
            "n_shard".to_string(),
            NpyArray {
                shape: vec![],
                data: vec![self.n_shard as i64],
            },
        );
        arrays.insert(
            "entity_to_shard".into(),
            NpyArray {
                shape: vec![self.n_entity()],
                data: self.entity_to_shard.clone(),
            },
        );
        arrays.insert(
            "entity_to_idx".into(),
            NpyArray {
                shape: vec![self.n_entity()],
                data: self.entity_to_idx.clone(),
            },
        );
        let a2 = |a: &Array2<i64>| NpyArray {
            shape: a.shape().to_vec(),
            data: a.iter().copied().collect(),
        };
        arrays.insert(
            "shard_and_idx_to_entity".into(),
            a2(&self.shard_and_idx_to_entity),
        );
        arrays.insert(
            "shard_counts".into(),
            NpyArray {
                shape: vec![self.n_shard],
                data: self.shard_counts.clone(),
            },
        );
        if let (Some(c), Some(o)) = (&self.entity_type_counts, &self.entity_type_offsets) {
            arrays.insert("entity_type_counts".into(), a2(c));
            arrays.insert("entity_type_offsets".into(), a2(o));
        }
        write_npz(path.as_ref(), &arrays)?;
        Ok(())
    }

    /// Reads a sharding written by besskge's `Sharding.save` (int32 or int64 arrays; type
    /// fields stored as pickled `None`, or absent, mean untyped) or by [`Sharding::save_npz`].
    /// Every array is checked against the others (shapes, ranges, the two directions of the
    /// mapping agree), so a loaded sharding is as valid as a created one.
    pub fn load_npz(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let bad = |reason: String| BessError::ShardingFile {
            path: name.clone(),
            reason,
        };
        let file = std::fs::File::open(path).map_err(|source| BessError::Io {
            context: format!("opening {name}"),
            source,
        })?;
        let mut zip =
            zip::ZipArchive::new(file).map_err(|e| bad(format!("not a zip archive: {e}")))?;
        let mut arrays: BTreeMap<String, NpyArray> = BTreeMap::new();
        for i in 0..zip.len() {
            let f = zip
                .by_index(i)
                .map_err(|e| bad(format!("member {i}: {e}")))?;
            let member = f
                .name()
                .map_err(|e| bad(format!("member {i}: {e}")))?
                .into_owned();
            let key = member.strip_suffix(".npy").unwrap_or(&member).to_string();
            // A deflated member can declare and hold gigabytes in a small file: the header and
            // then only the data it declares are read (an object array's: only its header).
            let size = f.size();
            let bytes = read_npy_member(f, size, MAX_SHARDING_MEMBER_BYTES, &name, &key)?;
            // besskge saves absent type tables as a pickled `None` (an object array).
            let head = &bytes[..bytes.len().min(256)];
            if String::from_utf8_lossy(head).contains("'descr': '|O'") {
                continue;
            }
            // The pipeline's reader names what it reads by the name it was given, here the
            // member's; the message names the file, then the member.
            let array = decode_npy(&bytes, &key).map_err(|e| match e {
                sparsecore_prep::Error::InvalidData { reason, .. } => {
                    bad(format!("member `{key}`: {reason}"))
                }
                other => BessError::Prep(other),
            })?;
            arrays.insert(key.clone(), array);
        }
        Self::from_npy_arrays(arrays).map_err(|e| match e {
            BessError::InvalidParameter {
                name: field,
                value,
                reason,
            } => bad(format!("{field} = {value}: {reason}")),
            other => other,
        })
    }

    fn from_npy_arrays(mut arrays: BTreeMap<String, NpyArray>) -> Result<Self> {
        let mut take = |k: &'static str| arrays.remove(k);
        let need = |k: &'static str, a: Option<NpyArray>| {
            a.ok_or_else(|| BessError::param(k, "missing", "required field"))
        };
        let n_shard_a = need("n_shard", take("n_shard"))?;
        let e2s = need("entity_to_shard", take("entity_to_shard"))?;
        let e2i = need("entity_to_idx", take("entity_to_idx"))?;
        let table = need("shard_and_idx_to_entity", take("shard_and_idx_to_entity"))?;
        let counts = need("shard_counts", take("shard_counts"))?;
        let tc = take("entity_type_counts");
        let to = take("entity_type_offsets");
        // besskge's arrays are 1-D: a 2-D one flattened would be read as another sharding.
        for (k, a) in [
            ("entity_to_shard", &e2s),
            ("entity_to_idx", &e2i),
            ("shard_counts", &counts),
        ] {
            if a.shape.len() != 1 {
                return Err(BessError::param(
                    k,
                    format!("an array of shape {:?}", a.shape),
                    "must be 1-D",
                ));
            }
        }
        let [n] = n_shard_a.data[..] else {
            return Err(BessError::param(
                "n_shard",
                format!("{:?}", n_shard_a.data),
                "must be one integer",
            ));
        };
        let to2 = |k: &'static str, a: NpyArray| -> Result<Array2<i64>> {
            match a.shape[..] {
                [r, c] => Array2::from_shape_vec((r, c), a.data)
                    .map_err(|e| BessError::param(k, "array", e.to_string())),
                _ => Err(BessError::param(
                    k,
                    format!("shape {:?}", a.shape),
                    "must be 2-D",
                )),
            }
        };
        let s = Sharding {
            n_shard: usize::try_from(n)
                .map_err(|_| BessError::param("n_shard", n, "must be non-negative"))?,
            entity_to_shard: e2s.data,
            entity_to_idx: e2i.data,
            shard_and_idx_to_entity: to2("shard_and_idx_to_entity", table)?,
            shard_counts: counts.data,
            entity_type_counts: tc.map(|a| to2("entity_type_counts", a)).transpose()?,
            entity_type_offsets: to.map(|a| to2("entity_type_offsets", a)).transpose()?,
        };
        s.validate()?;
        Ok(s)
    }

    /// Checks that the fields describe one consistent sharding.
    pub fn validate(&self) -> Result<()> {
        let n = self.n_shard;
        let e = self.n_entity();
        let (rows, m) = self.shard_and_idx_to_entity.dim();
        if n == 0 || rows != n {
            return Err(BessError::param(
                "shard_and_idx_to_entity",
                format!("{rows} rows"),
                format!("must have n_shard = {n} >= 1 rows"),
            ));
        }
        if self.entity_to_idx.len() != e {
            return Err(BessError::LengthMismatch {
                column: "entity_to_idx".into(),
                got: self.entity_to_idx.len(),
                other: "entity_to_shard".into(),
                expected: e,
            });
        }
        if self.shard_counts.len() != n {
            return Err(BessError::param(
                "shard_counts",
                format!("{} values", self.shard_counts.len()),
                format!("must have n_shard = {n}"),
            ));
        }
        if e == 0 || n.checked_mul(m).is_none_or(|slots| slots < e) {
            return Err(BessError::param(
                "shard_and_idx_to_entity",
                format!("({n}, {m})"),
                format!("cannot hold {e} entities"),
            ));
        }
        let mut real = vec![0i64; n];
        for ent in 0..e {
            let (s, i) = (self.entity_to_shard[ent], self.entity_to_idx[ent]);
            if s < 0
                || s as usize >= n
                || i < 0
                || i as usize >= m
                || self.shard_and_idx_to_entity[[s as usize, i as usize]] != ent as i64
            {
                return Err(BessError::param(
                    "entity_to_shard",
                    format!("entity {ent} -> ({s}, {i})"),
                    "does not match shard_and_idx_to_entity",
                ));
            }
            real[s as usize] += 1;
        }
        if real != self.shard_counts {
            return Err(BessError::param(
                "shard_counts",
                format!("{:?}", self.shard_counts),
                format!("the table holds {real:?}"),
            ));
        }
        match (&self.entity_type_counts, &self.entity_type_offsets) {
            (None, None) => {}
            (Some(c), Some(o)) if c.nrows() == n && c.dim() == o.dim() && c.ncols() >= 1 => {
                for s in 0..n {
                    for t in 0..c.ncols() {
                        let (cnt, off) = (c[[s, t]], o[[s, t]]);
                        if cnt < 0
                            || off < 0
                            || off.checked_add(cnt).is_none_or(|end| end > m as i64)
                        {
                            return Err(BessError::param(
                                "entity_type_counts",
                                format!("shard {s} type {t}: {cnt} at {off}"),
                                format!("outside the shard's {m} slots"),
                            ));
                        }
                    }
                }
            }
            _ => {
                return Err(BessError::param(
                    "entity_type_counts",
                    "shape",
                    "entity_type_counts and entity_type_offsets must both be given, (n_shard, T)",
                ))
            }
        }
        Ok(())
    }
}
