//! The stream's record batches against an independent oracle, column by column, row by row.
//!
//! For every step the oracle rebuilds what the record batch must hold from the crate's
//! lower-level public pieces, which `bess_cases` checks value for value against
//! besskge's reference outputs, and from the documented SparseCore layout (`src/layout.rs`,
//! `src/stream/mod.rs`), written out plainly here:
//! - [`Sharding::create`] and [`PartitionedTriples`] (`ht_shardpair`, `n_relation` = largest
//!   relation + 1, the stream's default) give the sorted triples, with local ids;
//! - the positives' `sample_idx` `[i][j][q]` (and Rigid's mask) come from [`BatchSampler::sample`]
//!   (Random; Rigid without shuffle). Rigid **with** shuffle is not a besskge target (its
//!   upstream order comes from torch's RNG, SPEC section 0); [`SamplerKind::Rigid`] documents our
//!   order: epoch `e` reads positions through the `e`-th Fisher–Yates order (Lemire's bounded
//!   draws) of `len` positions from `default_rng(batch seed)`'s 64-bit outputs. The oracle
//!   computes that with its own plain [`epoch_order`] from [`NumpyRng::next_u64`] (checked
//!   against numpy) and SPEC 4.4's `offsets[p] + pos mod counts[p]`, `mask = pos < counts[p]`,
//!   without the batch sampler;
//! - the layout: global SparseCore `g` takes block `(i, (i + g + t) mod n)` of every head shard
//!   `i` in step `t`; shard `s`'s local id `x` is the physical id `x·N + ((s − col_shift) mod N)`;
//!   this host's local SparseCore `k` is global SparseCore `host·L·S + k`, and owns rows
//!   `k·R .. (k+1)·R`;
//! - the negatives: the negative sampler ([`NegativeSampler::sample`]; Random with the stream's
//!   `flat_negatives`, TypeBased per triple, TripleBased with `mask_on_gather`; `local_sampling`
//!   false, so axis 1 is the shard drawn from and axis 2 the SparseCore using them) called with
//!   the SparseCore-major `sample_idx` `[g][i][q]` of the slices. Row `row < n·B·K` of slice `g`
//!   holds `negative[0][row / (B·K)][g][(row / K) mod B][row mod K]`, on shard `row / (B·K)`;
//!   `B` and `K` are read off the sampler's output shape.
//!
//! Every column (head, tail, relation, triple_mask, triple_idx, negative, negative_mask,
//! negative_shard, negative_triple, negative_side), the schema, the annotations kept in
//! `StreamBatch` and the precomputed [`CellCounts`] are compared. The stream's own
//! column-writing code (`src/stream/columns.rs`) is not called. Nothing had to be left to
//! invariants: every value of every batch is recomputed.
//!
//! The configurations cover every batch sampler, every negative sampler kind, flat and
//! per-triple lists, `h`/`t`/`ht` corruption, no negatives, annotations on and off, one host and
//! the second of two, a skewed and a uniform graph, Rigid across epoch boundaries, a non-zero
//! `col_shift` with inverse triples, and steps large enough to draw on several threads.

use std::sync::Arc;

use arrow_array::{
    Array, ArrayRef, BooleanArray, Int32Array, Int64Array, Int8Array, ListArray, RecordBatch,
};
use arrow_schema::{DataType, Field};
use ndarray::{Array2, ArrayD, IxDyn};
use sparsecore_bess::{
    seed_words, synth, BatchOptions, BatchSampler, BessStream, CellCounts, Corruption,
    NegativeKind, NegativeOutput, NegativeSampler, NumpyRng, PartitionMode, PartitionedTriples,
    RandomNegative, SamplerKind, Sharding, StreamSampler, TripleBasedNegative, Triples,
    TypeBasedNegative,
};

/// One stream configuration.
#[derive(Clone)]
struct Case {
    name: String,
    triples: Triples,
    n_entity: usize,
    devices: (usize, usize, usize),
    host: usize,
    col_shift: u32,
    inverse: bool,
    shard_bs: usize,
    sampler: StreamSampler,
    kind: NegativeKind,
    negatives: usize,
    flat: bool,
    corruption: Corruption,
    annotations: bool,
    seeds: (u64, u64, u64),
    steps: usize,
}

impl Case {
    fn new(name: String, triples: Triples, n_entity: usize) -> Self {
        Case {
            name,
            triples,
            n_entity,
            devices: (1, 1, 4),
            host: 0,
            col_shift: 0,
            inverse: false,
            shard_bs: 12,
            sampler: StreamSampler::Random,
            kind: NegativeKind::Random,
            negatives: 0,
            flat: true,
            corruption: Corruption::T,
            annotations: false,
            seeds: (1, 2, 3),
            steps: 3,
        }
    }

    fn stream(&self) -> BessStream {
        BessStream::builder()
            .triples(self.triples.clone())
            .n_entity(self.n_entity)
            .devices(self.devices.0, self.devices.1, self.devices.2)
            .host(self.host)
            .col_shift(self.col_shift)
            .inverse_triples(self.inverse)
            .shard_batch_size(self.shard_bs)
            .sampler(self.sampler)
            .negative_sampler(self.kind.clone())
            .negatives(self.negatives)
            .flat_negatives(self.flat)
            .corruption(self.corruption)
            .annotations(self.annotations)
            .seeds(self.seeds.0, self.seeds.1, self.seeds.2)
            .steps(self.steps)
            .build()
            .unwrap_or_else(|e| panic!("{}: building the stream: {e}", self.name))
    }
}

/// One value of a column.
#[derive(Debug, Clone, PartialEq)]
enum Cell {
    Null,
    Int(i64),
    Bool(bool),
    Ids(Vec<i64>),
}

/// A column's values, whatever its Arrow type.
fn cells(col: &ArrayRef) -> Vec<Cell> {
    let any = col.as_any();
    let null_or = |i: usize, c: Cell| if col.is_null(i) { Cell::Null } else { c };
    match col.data_type() {
        DataType::List(_) => {
            let a = any.downcast_ref::<ListArray>().expect("list");
            (0..a.len())
                .map(|i| {
                    let v = a.value(i);
                    null_or(
                        i,
                        Cell::Ids(
                            v.as_any()
                                .downcast_ref::<Int64Array>()
                                .expect("int64 lists")
                                .iter()
                                .map(|x| x.expect("no null id"))
                                .collect(),
                        ),
                    )
                })
                .collect()
        }
        DataType::Int64 => any
            .downcast_ref::<Int64Array>()
            .expect("int64")
            .values()
            .iter()
            .enumerate()
            .map(|(i, &v)| null_or(i, Cell::Int(v)))
            .collect(),
        DataType::Int32 => any
            .downcast_ref::<Int32Array>()
            .expect("int32")
            .values()
            .iter()
            .enumerate()
            .map(|(i, &v)| null_or(i, Cell::Int(i64::from(v))))
            .collect(),
        DataType::Int8 => any
            .downcast_ref::<Int8Array>()
            .expect("int8")
            .values()
            .iter()
            .enumerate()
            .map(|(i, &v)| null_or(i, Cell::Int(i64::from(v))))
            .collect(),
        DataType::Boolean => {
            let a = any.downcast_ref::<BooleanArray>().expect("bool");
            (0..a.len())
                .map(|i| null_or(i, Cell::Bool(a.value(i))))
                .collect()
        }
        other => panic!("unexpected column type {other:?}"),
    }
}

fn id_list() -> DataType {
    DataType::List(Arc::new(Field::new_list_field(DataType::Int64, false)))
}

/// Rigid shuffle's order of an epoch as [`SamplerKind::Rigid`] documents it, written out
/// plainly: for `i` from `len − 1` down to 1, draw 64-bit outputs `x` until the low word of
/// `x·(i+1)` is at least `2^64 mod (i+1)`, and swap `i` with the high word.
fn epoch_order(rng: &mut NumpyRng, len: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    for i in (1..len).rev() {
        let b = i as u128 + 1;
        let threshold = (1u128 << 64) % b;
        let j = loop {
            let product = u128::from(rng.next_u64()) * b;
            if product % (1u128 << 64) >= threshold {
                break product >> 64;
            }
        };
        order.swap(i, j as usize);
    }
    order
}

/// Where the oracle's positives come from.
enum Positives {
    /// besskge's Random sampler, or its Rigid sampler without shuffle.
    Sampler(Box<BatchSampler>),
    /// Rigid with shuffle, as [`SamplerKind::Rigid`] documents it.
    Shuffled {
        rng: NumpyRng,
        epoch: Option<usize>,
        perm: Vec<usize>,
        len: usize,
    },
}

/// What one step must yield.
struct Expected {
    columns: Vec<(&'static str, DataType, Vec<Cell>)>,
    sample_idx: Option<ArrayD<i64>>,
    triple_mask: Option<Vec<bool>>,
    negative: Option<NegativeOutput>,
    counts: CellCounts,
}

struct Oracle {
    part: Arc<PartitionedTriples>,
    positives: Positives,
    negative: Option<NegativeSampler>,
    /// N (= shards), local SparseCores, this host's first global SparseCore, SparseCores per
    /// device.
    n: usize,
    local: usize,
    first: usize,
    sc_per_device: usize,
    col_shift: i64,
    positive_per_partition: usize,
    corruption: Corruption,
    annotations: bool,
}

impl Oracle {
    fn new(case: &Case) -> Self {
        let (l, g, s) = case.devices;
        let n = g * s;
        let type_offsets = match &case.kind {
            NegativeKind::TypeBased { type_offsets } => Some(type_offsets.clone()),
            _ => None,
        };
        let sharding = Arc::new(
            Sharding::create(
                case.n_entity,
                n,
                &seed_words(u128::from(case.seeds.0)),
                type_offsets.as_deref(),
            )
            .expect("sharding"),
        );
        let n_relation = case
            .triples
            .relation
            .iter()
            .max()
            .map_or(0, |&r| r as usize + 1);
        let mut pb = PartitionedTriples::builder(sharding, PartitionMode::HtShardPair)
            .n_relation(n_relation)
            .inverse_triples(case.inverse);
        match &case.kind {
            NegativeKind::TypeBased { type_offsets } => pb = pb.type_offsets(type_offsets.clone()),
            NegativeKind::TripleBased {
                neg_heads,
                neg_tails,
            } => {
                if let Some(h) = neg_heads {
                    pb = pb.neg_heads(h.clone());
                }
                if let Some(t) = neg_tails {
                    pb = pb.neg_tails(t.clone());
                }
            }
            NegativeKind::Random => {}
        }
        let part = Arc::new(pb.build(&case.triples).expect("partition"));
        // SPEC 4.1: ceil(shard_bs / n), rounded down to even for "ht".
        let mut ppp = case.shard_bs.div_ceil(n);
        if case.corruption == Corruption::Ht {
            ppp = ppp / 2 * 2;
        }
        let words = seed_words(u128::from(case.seeds.1));
        let sampler = |kind: SamplerKind| {
            let options = BatchOptions {
                shard_bs: case.shard_bs,
                batches_per_step: 1,
                duplicate_batch: false,
                return_triple_idx: true,
                kind,
            };
            let s = BatchSampler::positives_only(part.clone(), options, case.corruption)
                .expect("batch sampler");
            assert_eq!(
                s.geometry().positive_per_partition,
                ppp,
                "{}: ppp",
                case.name
            );
            Positives::Sampler(Box::new(s))
        };
        let positives = match case.sampler {
            StreamSampler::Random => sampler(SamplerKind::Random { seed_words: words }),
            StreamSampler::Rigid { shuffle: false } => {
                sampler(SamplerKind::Rigid { shuffle: None })
            }
            StreamSampler::Rigid { shuffle: true } => {
                // SPEC 4.1: Rigid's `len` pads the longest partition to a multiple of pss = ppp.
                let max = part
                    .triple_counts
                    .iter()
                    .copied()
                    .max()
                    .expect("partitions") as usize;
                Positives::Shuffled {
                    rng: NumpyRng::from_words(&words),
                    epoch: None,
                    perm: Vec::new(),
                    len: max.div_ceil(ppp) * ppp,
                }
            }
        };
        let neg_words = seed_words(u128::from(case.seeds.2));
        let negative = match (&case.kind, case.negatives) {
            (NegativeKind::TripleBased { .. }, _) => Some(NegativeSampler::TripleBased(Box::new(
                TripleBasedNegative::new(&part, case.corruption, true, false)
                    .expect("triple-based"),
            ))),
            (_, 0) => None,
            (NegativeKind::Random, k) => Some(NegativeSampler::Random(
                RandomNegative::new(k, &neg_words, case.corruption, false, case.flat)
                    .expect("random"),
            )),
            (NegativeKind::TypeBased { .. }, k) => Some(NegativeSampler::TypeBased(
                TypeBasedNegative::new(k, &neg_words, case.corruption, false).expect("type-based"),
            )),
        };
        Oracle {
            part,
            positives,
            negative,
            n,
            local: l * s,
            first: case.host * l * s,
            sc_per_device: s,
            col_shift: i64::from(case.col_shift),
            positive_per_partition: ppp,
            corruption: case.corruption,
            annotations: case.annotations,
        }
    }

    /// Step `step`'s `sample_idx` over `[head shard i][tail shard j][q]`, and Rigid's mask.
    fn positives(&mut self, step: usize) -> (Vec<i64>, Option<Vec<bool>>) {
        let (n, ppp) = (self.n, self.positive_per_partition);
        match &mut self.positives {
            Positives::Sampler(s) => {
                let b = s.sample(step).expect("batch");
                assert_eq!(b.sample_idx.shape(), [1, n, n, ppp]);
                (
                    b.sample_idx.iter().copied().collect(),
                    b.triple_mask.map(|m| m.iter().copied().collect()),
                )
            }
            Positives::Shuffled {
                rng,
                epoch,
                perm,
                len,
            } => {
                let per_epoch = *len / ppp;
                let (e, window) = (step / per_epoch, step % per_epoch);
                assert!(
                    epoch.is_none_or(|x| x <= e),
                    "the oracle draws epochs in order"
                );
                while *epoch != Some(e) {
                    *perm = epoch_order(rng, *len);
                    *epoch = Some(epoch.map_or(0, |x| x + 1));
                }
                let (mut idx, mut mask) = (Vec::new(), Vec::new());
                for (&c, &off) in self
                    .part
                    .triple_counts
                    .iter()
                    .zip(&self.part.triple_offsets)
                {
                    for &pos in &perm[window * ppp..(window + 1) * ppp] {
                        idx.push(off + pos as i64 % c);
                        mask.push((pos as i64) < c);
                    }
                }
                (idx, Some(mask))
            }
        }
    }

    /// The physical id of local id `x` on shard `s`.
    fn phys(&self, s: usize, x: i64) -> i64 {
        let n = self.n as i64;
        x * n + (s as i64 - self.col_shift).rem_euclid(n)
    }

    fn expect(&mut self, step: usize) -> Expected {
        let (n, ppp) = (self.n, self.positive_per_partition);
        let (idx, mask) = self.positives(step);
        let tail_shard = |g: usize, i: usize| (i + g + step) % n;
        let at = |i: usize, j: usize, q: usize| (i * n + j) * ppp + q;
        // SparseCore-major: [g][i][q], the block (i, tail_shard(g, i)) of every head shard i.
        let (mut si, mut sm) = (Vec::new(), Vec::new());
        for g in 0..n {
            for i in 0..n {
                for q in 0..ppp {
                    si.push(idx[at(i, tail_shard(g, i), q)]);
                    if let Some(m) = &mask {
                        sm.push(m[at(i, tail_shard(g, i), q)]);
                    }
                }
            }
        }
        let si = ArrayD::from_shape_vec(IxDyn(&[n, n, ppp]), si).expect("shape");
        let part = self.part.clone();
        let neg = self.negative.as_mut().map(|ns| {
            ns.sample(
                &part,
                &si.clone()
                    .into_shape_with_order(IxDyn(&[1, n, n, ppp]))
                    .expect("shape"),
            )
            .expect("negatives")
        });
        let flat = match &self.negative {
            Some(NegativeSampler::Random(r)) => r.flat_negative_format,
            Some(NegativeSampler::TripleBased(t)) => t.flat_negative_format,
            _ => false,
        };
        let (b, k) = neg
            .as_ref()
            .map_or((0, 0), |o| (o.negative.shape()[3], o.negative.shape()[4]));
        if let Some(o) = &neg {
            assert_eq!(o.negative.shape(), [1, n, n, b, k]);
        }
        let t = n * ppp;
        let neg_rows = n * b * k;
        let r = t.max(neg_rows);
        let max_ids = 2 * ppp + b * k;
        let counts = CellCounts {
            positive_per_partition: ppp,
            triples_per_sparsecore: t,
            positive_ids_per_partition: 2 * ppp,
            negative_ids_per_partition: b * k,
            rows_per_sparsecore: r,
            max_ids_per_partition: max_ids,
            coo_buffer_size_per_device: self.sc_per_device * n * max_ids.div_ceil(8) * 8,
        };
        let side = |bb: usize| -> i64 {
            match self.corruption {
                Corruption::H => 0,
                Corruption::T => 1,
                // Flat "ht": list 0 holds head negatives, list 1 tail negatives.
                Corruption::Ht if flat => bb as i64,
                // Per triple: heads for the first half of each block, tails for the second.
                Corruption::Ht => i64::from(bb % ppp >= ppp / 2),
            }
        };
        let tr = &self.part.triples;
        let mut c: [Vec<Cell>; 10] = Default::default();
        let [head, tail, relation, triple_mask, triple_idx, negative, negative_mask, negative_shard, negative_triple, negative_side] =
            &mut c;
        for slot in 0..self.local {
            let g = self.first + slot;
            for row in 0..r {
                if row < t {
                    let (i, q) = (row / ppp, row % ppp);
                    let j = tail_shard(g, i);
                    let x = idx[at(i, j, q)];
                    let xu = x as usize;
                    head.push(Cell::Ids(vec![self.phys(i, tr[[xu, 0]])]));
                    tail.push(Cell::Ids(vec![self.phys(j, tr[[xu, 2]])]));
                    relation.push(Cell::Int(tr[[xu, 1]]));
                    triple_mask.push(Cell::Bool(mask.as_ref().is_none_or(|m| m[at(i, j, q)])));
                    triple_idx.push(Cell::Int(x));
                } else {
                    head.push(Cell::Ids(vec![]));
                    tail.push(Cell::Ids(vec![]));
                    relation.push(Cell::Null);
                    triple_mask.push(Cell::Bool(false));
                    triple_idx.push(Cell::Null);
                }
                let Some(o) = &neg else { continue };
                if row < neg_rows {
                    let (x, bb, ii) = (row / (b * k), row / k % b, row % k);
                    negative.push(Cell::Ids(vec![
                        self.phys(x, i64::from(o.negative[[0, x, g, bb, ii]]))
                    ]));
                    negative_mask.push(
                        o.mask
                            .as_ref()
                            .map_or(Cell::Null, |m| Cell::Bool(m[[0, x, g, bb, ii]])),
                    );
                    negative_shard.push(Cell::Int(x as i64));
                    negative_triple.push(Cell::Int(if flat { -1 } else { bb as i64 }));
                    negative_side.push(Cell::Int(side(bb)));
                } else {
                    negative.push(Cell::Ids(vec![]));
                    for col in [
                        &mut *negative_mask,
                        &mut *negative_shard,
                        &mut *negative_triple,
                        &mut *negative_side,
                    ] {
                        col.push(Cell::Null);
                    }
                }
            }
        }
        let [head, tail, relation, triple_mask, triple_idx, negative, negative_mask, negative_shard, negative_triple, negative_side] =
            c;
        let mut columns = vec![
            ("head", id_list(), head),
            ("tail", id_list(), tail),
            ("relation", DataType::Int32, relation),
            ("triple_mask", DataType::Boolean, triple_mask),
        ];
        if self.annotations {
            columns.push(("triple_idx", DataType::Int64, triple_idx));
        }
        if let Some(o) = &neg {
            columns.push(("negative", id_list(), negative));
            if o.mask.is_some() {
                columns.push(("negative_mask", DataType::Boolean, negative_mask));
            }
            if self.annotations {
                columns.push(("negative_shard", DataType::Int32, negative_shard));
                columns.push(("negative_triple", DataType::Int32, negative_triple));
                columns.push(("negative_side", DataType::Int8, negative_side));
            }
        }
        let rigid = mask.is_some();
        Expected {
            columns,
            sample_idx: self.annotations.then_some(si),
            triple_mask: (self.annotations && rigid).then_some(sm),
            negative: if self.annotations { neg } else { None },
            counts,
        }
    }
}

fn compare(case: &str, step: usize, rb: &RecordBatch, want: &Expected) {
    let got: Vec<(String, DataType)> = rb
        .schema()
        .fields()
        .iter()
        .map(|f| (f.name().clone(), f.data_type().clone()))
        .collect();
    let names: Vec<(String, DataType)> = want
        .columns
        .iter()
        .map(|(name, dt, _)| (name.to_string(), dt.clone()))
        .collect();
    assert_eq!(got, names, "{case}: step {step}: the columns");
    let r = want.counts.rows_per_sparsecore;
    for ((name, _, expected), col) in want.columns.iter().zip(rb.columns()) {
        let actual = cells(col);
        assert_eq!(
            actual.len(),
            expected.len(),
            "{case}: step {step}, column `{name}`: rows"
        );
        if let Some(row) = (0..actual.len()).find(|&x| actual[x] != expected[x]) {
            panic!(
                "{case}: step {step}, column `{name}`, row {row} (local SparseCore {}, slice row {}): got {:?}, expected {:?}",
                row / r,
                row % r,
                actual[row],
                expected[row]
            );
        }
    }
}

/// Runs one case: every step of the stream against the oracle. Returns the steps compared.
fn run(case: &Case) -> usize {
    let mut oracle = Oracle::new(case);
    let stream = case.stream();
    let counts = *stream.counts();
    let mut steps = 0;
    for (step, batch) in stream.enumerate() {
        let batch = batch.unwrap_or_else(|e| panic!("{}: step {step}: {e}", case.name));
        let want = oracle.expect(step);
        let name = &case.name;
        assert_eq!(batch.step, step, "{name}: step number");
        assert_eq!(counts, want.counts, "{name}: the precomputed cell counts");
        compare(name, step, &batch.record_batch, &want);
        assert_eq!(
            batch.sample_idx, want.sample_idx,
            "{name}: step {step}: StreamBatch::sample_idx"
        );
        assert_eq!(
            batch.triple_mask, want.triple_mask,
            "{name}: step {step}: StreamBatch::triple_mask"
        );
        assert_eq!(
            batch.negative, want.negative,
            "{name}: step {step}: StreamBatch::negative"
        );
        steps += 1;
    }
    assert_eq!(steps, case.steps, "{}: steps", case.name);
    steps
}

/// The negative configurations: (name, kind, negatives, flat, corruption). `rows` is the
/// number of input triples (for per-triple lists).
fn negative_setups(
    n_entity: usize,
    rows: usize,
) -> Vec<(&'static str, NegativeKind, usize, bool, Corruption)> {
    let e = n_entity as i64;
    let list = |r: usize, k: usize, a: i64, b: i64| {
        Array2::from_shape_fn((r, k), |(x, c)| (x as i64 * a + c as i64 * b) % e)
    };
    let typed = NegativeKind::TypeBased {
        type_offsets: vec![0, 100, 250],
    };
    vec![
        ("none", NegativeKind::Random, 0, true, Corruption::T),
        ("flat", NegativeKind::Random, 3, true, Corruption::T),
        ("per-triple", NegativeKind::Random, 2, false, Corruption::T),
        ("flat-ht", NegativeKind::Random, 3, true, Corruption::Ht),
        (
            "per-triple-ht",
            NegativeKind::Random,
            2,
            false,
            Corruption::Ht,
        ),
        ("typed", typed.clone(), 2, false, Corruption::T),
        ("typed-ht", typed, 2, false, Corruption::Ht),
        (
            "listed",
            NegativeKind::TripleBased {
                neg_heads: None,
                neg_tails: Some(list(1, 12, 0, 23)),
            },
            0,
            true,
            Corruption::T,
        ),
        (
            "listed-ht",
            NegativeKind::TripleBased {
                neg_heads: Some(list(1, 10, 0, 37)),
                neg_tails: Some(list(1, 10, 0, 11)),
            },
            0,
            true,
            Corruption::Ht,
        ),
        (
            "listed-per-triple-h",
            NegativeKind::TripleBased {
                neg_heads: Some(list(rows, 5, 7, 31)),
                neg_tails: None,
            },
            0,
            false,
            Corruption::H,
        ),
    ]
}

fn samplers() -> [(StreamSampler, &'static str); 3] {
    [
        (StreamSampler::Random, "random"),
        (StreamSampler::Rigid { shuffle: false }, "rigid"),
        (StreamSampler::Rigid { shuffle: true }, "rigid-shuffle"),
    ]
}

/// Every batch sampler × every negative setup × annotations × (one host of 4 SparseCores, the
/// second of two hosts of 2), on a skewed and a uniform graph, 3 steps each.
#[test]
fn every_sampler_and_negative_setup_matches_the_oracle() {
    let mut cases = 0;
    for (graph, triples) in [
        ("power law", synth::power_law(300, 4, 3000, 1.0, 5)),
        ("uniform", synth::uniform(300, 4, 3000, 5)),
    ] {
        for (sampler, sname) in samplers() {
            for (neg, kind, negatives, flat, corruption) in negative_setups(300, triples.len()) {
                for annotations in [false, true] {
                    for (l, g, s, host) in [(1, 1, 4, 0), (1, 2, 2, 1)] {
                        let mut c =
                            Case::new(format!("{graph} {sname} {neg} annotations={annotations} devices=({l},{g},{s}) host={host}"), triples.clone(), 300);
                        c.devices = (l, g, s);
                        c.host = host;
                        c.sampler = sampler;
                        c.kind = kind.clone();
                        c.negatives = negatives;
                        c.flat = flat;
                        c.corruption = corruption;
                        c.annotations = annotations;
                        run(&c);
                        cases += 1;
                    }
                }
            }
        }
    }
    assert_eq!(cases, 2 * 3 * 10 * 2 * 2);
}

/// Rigid over more than two epochs: without shuffle the positions wrap (the stream's
/// precomputed table and the sampler path both), with shuffle every epoch draws a new
/// permutation.
#[test]
fn rigid_across_epochs_matches_the_oracle() {
    let triples = synth::uniform(64, 3, 200, 7);
    for (sampler, sname) in [
        (StreamSampler::Rigid { shuffle: false }, "rigid"),
        (StreamSampler::Rigid { shuffle: true }, "rigid-shuffle"),
    ] {
        for negatives in [0, 2] {
            for annotations in [false, true] {
                for (l, g, s, host) in [(1, 1, 4, 0), (1, 2, 2, 1)] {
                    let mut c = Case::new(format!("epochs {sname} negatives={negatives} annotations={annotations} host={host}"), triples.clone(), 64);
                    c.devices = (l, g, s);
                    c.host = host;
                    c.shard_bs = 16;
                    c.sampler = sampler;
                    c.negatives = negatives;
                    c.flat = false;
                    c.annotations = annotations;
                    c.steps = 40;
                    let per_epoch = c.stream().batch_sampler().steps_per_epoch();
                    assert!(
                        c.steps > 2 * per_epoch,
                        "{}: {per_epoch} steps per epoch",
                        c.name
                    );
                    run(&c);
                }
            }
        }
    }
}

/// A rotated entity table (`col_shift`) and inverse triples.
#[test]
fn col_shift_and_inverse_triples_match_the_oracle() {
    let triples = synth::power_law(300, 4, 2000, 0.8, 12);
    let rows = triples.len();
    for (sampler, sname) in samplers() {
        for (neg, kind, negatives, flat, corruption) in negative_setups(300, rows) {
            // Inverse triples need both lists (or neither) for the TripleBased sampler.
            if neg == "listed" || neg == "listed-per-triple-h" {
                continue;
            }
            for (shift, inverse) in [(1u32, true), (6, false)] {
                let mut c = Case::new(
                    format!("{sname} {neg} col_shift={shift} inverse={inverse}"),
                    triples.clone(),
                    300,
                );
                c.devices = (2, 2, 2);
                c.col_shift = shift;
                c.inverse = inverse;
                c.sampler = sampler;
                c.kind = kind.clone();
                c.negatives = negatives;
                c.flat = flat;
                c.corruption = corruption;
                c.annotations = true;
                c.steps = 2;
                run(&c);
            }
        }
    }
}

/// Steps large enough that the batch sampler reduces its draws on every thread, and that the
/// uniform negatives are drawn on a second thread while the positives are.
#[test]
fn large_steps_match_the_oracle() {
    let triples = synth::uniform(300, 4, 3000, 5);
    // 16 partitions · 2048 draws = 2^15.
    let mut c = Case::new("large positives".into(), triples.clone(), 300);
    c.shard_bs = 8192;
    c.negatives = 3;
    c.annotations = true;
    c.steps = 2;
    run(&c);
    // 4 · 4 · 64 lists · 64 negatives = 2^16.
    for annotations in [false, true] {
        let mut c = Case::new(
            format!("large negatives annotations={annotations}"),
            triples.clone(),
            300,
        );
        c.shard_bs = 64;
        c.negatives = 64;
        c.flat = false;
        c.annotations = annotations;
        c.steps = 2;
        run(&c);
    }
}
