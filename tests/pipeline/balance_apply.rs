//! Applying a balancing permutation (src/balance/apply.rs): the specialised reorder of list and
//! primitive columns gives exactly what Arrow's `interleave_record_batch` gives (schema, values,
//! validity) on sliced, null-bearing, multi-batch windows, also when it reuses the buffers of
//! an earlier window, and never writes into batches the caller still holds.

use std::sync::Arc;

use arrow_array::builder::{GenericListBuilder, PrimitiveBuilder};
use arrow_array::types::{ArrowPrimitiveType, Float32Type, Float64Type, Int32Type, Int64Type};
use arrow_array::{Array, ArrayRef, OffsetSizeTrait, RecordBatch, StringArray};
use arrow_schema::{Field, Schema};
use proptest::prelude::*;
use sparsecore_prep::balance::{apply, Reorder, SampleRef};

/// A small deterministic generator, so every case is reproducible without proptest.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) as usize) % n.max(1)
    }
}

/// Rows of one column: `None` is a null row; a list row's length comes from `lengths`.
struct Shape {
    rows: usize,
    /// Rows cut off the front (the arrays are sliced, so offsets do not start at 0).
    skip: usize,
    nulls: bool,
    /// Every list row holds exactly one value.
    unit: bool,
    /// List rows hold up to 40 values instead of up to 5 (runs longer than the short-run copy).
    long: bool,
    /// Nulls among the list values (Arrow's path).
    value_nulls: bool,
}

fn list<O: OffsetSizeTrait, T: ArrowPrimitiveType>(rng: &mut Lcg, s: &Shape) -> ArrayRef
where
    T::Native: From<u8>,
{
    let mut b = GenericListBuilder::<O, _>::new(PrimitiveBuilder::<T>::new());
    for _ in 0..s.skip + s.rows {
        if s.nulls && rng.next(5) == 0 {
            b.append(false);
            continue;
        }
        let len = if s.unit {
            1
        } else {
            rng.next(if s.long { 41 } else { 6 })
        };
        for _ in 0..len {
            if s.value_nulls && rng.next(4) == 0 {
                b.values().append_null();
            } else {
                b.values()
                    .append_value(T::Native::from(rng.next(200) as u8));
            }
        }
        b.append(true);
    }
    b.finish().slice(s.skip, s.rows).into_array_ref()
}

fn primitive<T: ArrowPrimitiveType>(rng: &mut Lcg, s: &Shape) -> ArrayRef
where
    T::Native: From<u8>,
{
    let mut b = PrimitiveBuilder::<T>::new();
    for _ in 0..s.skip + s.rows {
        if s.nulls && rng.next(5) == 0 {
            b.append_null();
        } else {
            b.append_value(T::Native::from(rng.next(200) as u8));
        }
    }
    let array: ArrayRef = Arc::new(b.finish());
    array.slice(s.skip, s.rows)
}

trait IntoArrayRef {
    fn into_array_ref(self) -> ArrayRef;
}

impl<A: Array + 'static> IntoArrayRef for A {
    fn into_array_ref(self) -> ArrayRef {
        Arc::new(self)
    }
}

/// A column of every specialised type, and two that take Arrow's path (strings, and a list
/// whose values have nulls).
fn batch(rng: &mut Lcg, rows: usize, skip: usize, nulls: bool) -> RecordBatch {
    let s = |unit, value_nulls| Shape {
        rows,
        skip,
        nulls,
        unit,
        long: false,
        value_nulls,
    };
    let columns: Vec<(&str, ArrayRef)> = vec![
        ("ids64", list::<i32, Int64Type>(rng, &s(false, false))),
        ("ids32", list::<i32, Int32Type>(rng, &s(false, false))),
        (
            "long",
            list::<i32, Int64Type>(
                rng,
                &Shape {
                    long: true,
                    ..s(false, false)
                },
            ),
        ),
        (
            "large_long",
            list::<i64, Float32Type>(
                rng,
                &Shape {
                    long: true,
                    ..s(false, false)
                },
            ),
        ),
        ("w32", list::<i32, Float32Type>(rng, &s(false, false))),
        ("w64", list::<i32, Float64Type>(rng, &s(false, false))),
        ("single", list::<i32, Int64Type>(rng, &s(true, false))),
        ("large", list::<i64, Int64Type>(rng, &s(false, false))),
        ("large_single", list::<i64, Int32Type>(rng, &s(true, false))),
        ("value_nulls", list::<i32, Int64Type>(rng, &s(false, true))),
        ("i32", primitive::<Int32Type>(rng, &s(false, false))),
        ("i64", primitive::<Int64Type>(rng, &s(false, false))),
        ("f32", primitive::<Float32Type>(rng, &s(false, false))),
        ("f64", primitive::<Float64Type>(rng, &s(false, false))),
        (
            "name",
            Arc::new(StringArray::from_iter(
                (0..rows).map(|i| (!nulls || i % 3 != 0).then(|| format!("k{i}"))),
            )),
        ),
    ];
    let schema = Schema::new(
        columns
            .iter()
            .map(|(n, a)| Field::new(*n, a.data_type().clone(), true))
            .collect::<Vec<_>>(),
    );
    RecordBatch::try_new(
        Arc::new(schema),
        columns.into_iter().map(|(_, a)| a).collect(),
    )
    .unwrap()
}

/// A shuffle of every row of the window into batches of the input sizes.
fn shuffle(rng: &mut Lcg, window: &[RecordBatch]) -> Vec<Vec<SampleRef>> {
    let mut all: Vec<SampleRef> = window
        .iter()
        .enumerate()
        .flat_map(|(b, rb)| (0..rb.num_rows()).map(move |row| SampleRef { batch: b, row }))
        .collect();
    for i in (1..all.len()).rev() {
        all.swap(i, rng.next(i + 1));
    }
    let mut rest = all.as_slice();
    window
        .iter()
        .map(|rb| {
            let (head, tail) = rest.split_at(rb.num_rows());
            rest = tail;
            head.to_vec()
        })
        .collect()
}

fn expected(window: &[RecordBatch], permutation: &[Vec<SampleRef>]) -> Vec<RecordBatch> {
    let sources: Vec<&RecordBatch> = window.iter().collect();
    permutation
        .iter()
        .map(|rows| {
            let index: Vec<(usize, usize)> = rows.iter().map(|r| (r.batch, r.row)).collect();
            arrow_select::interleave::interleave_record_batch(&sources, &index).unwrap()
        })
        .collect()
}

/// Equal as `interleave` builds it: same schema, same array data, and a validity buffer
/// exactly where it has one.
fn assert_same(got: &[RecordBatch], want: &[RecordBatch], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.schema(), w.schema(), "{what}: batch {k}");
        for c in 0..w.num_columns() {
            let (g, w) = (g.column(c), w.column(c));
            assert_eq!(g.to_data(), w.to_data(), "{what}: batch {k} column {c}");
            assert_eq!(
                g.nulls(),
                w.nulls(),
                "{what}: batch {k} column {c} validity"
            );
            assert_eq!(g.data_type(), w.data_type(), "{what}: batch {k} column {c}");
        }
    }
}

#[test]
fn specialised_columns_equal_interleave() {
    let mut rng = Lcg(7);
    for (sizes, skip, nulls) in [
        (&[40][..], 0, false),
        (&[40][..], 3, true),
        (&[24, 24, 24][..], 5, true),
        (&[16, 32][..], 1, false),
    ] {
        let window: Vec<RecordBatch> = sizes
            .iter()
            .map(|&n| batch(&mut rng, n, skip, nulls))
            .collect();
        let permutation = shuffle(&mut rng, &window);
        let what = format!("sizes {sizes:?} skip {skip} nulls {nulls}");
        assert_same(
            &apply(&window, &permutation).unwrap(),
            &expected(&window, &permutation),
            &what,
        );
        // Rows taken twice, and an empty output batch, are Arrow's to define too.
        let odd = vec![
            vec![
                SampleRef { batch: 0, row: 2 },
                SampleRef { batch: 0, row: 2 },
                SampleRef {
                    batch: sizes.len() - 1,
                    row: 0,
                },
            ],
            vec![],
        ];
        assert_same(
            &apply(&window, &odd).unwrap(),
            &expected(&window, &odd),
            &format!("{what}, repeated rows"),
        );
    }
}

#[test]
fn reused_buffers_give_the_same_batches_and_spare_held_ones() {
    let mut rng = Lcg(11);
    let mut reorder = Reorder::default();
    let mut held = Vec::new();
    for round in 0..6 {
        let window: Vec<RecordBatch> = (0..3)
            .map(|_| {
                let (rows, skip) = (20 + rng.next(20), rng.next(4));
                batch(&mut rng, rows, skip, round % 2 == 0)
            })
            .collect();
        let permutation = shuffle(&mut rng, &window);
        let want = expected(&window, &permutation);
        let got = reorder.apply(&window, &permutation).unwrap();
        assert_same(&got, &want, &format!("round {round}"));
        // Every other round's batches stay held while later windows are reordered.
        if round % 2 == 0 {
            held.push((got, want));
        }
    }
    for (i, (got, want)) in held.iter().enumerate() {
        assert_same(got, want, &format!("held window {i}"));
    }
}

#[test]
fn rows_outside_the_window_are_typed_errors() {
    let mut rng = Lcg(3);
    let window = vec![batch(&mut rng, 8, 0, false)];
    for bad in [
        SampleRef { batch: 1, row: 0 },
        SampleRef { batch: 0, row: 8 },
    ] {
        let e = apply(&window, &[vec![bad]]).unwrap_err();
        let named = format!(
            "permutation: it names row {} of batch {}, which does not exist",
            bad.row, bad.batch
        );
        assert!(
            matches!(e, sparsecore_prep::Error::InvalidData { .. }) && e.to_string() == named,
            "{e:?}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn any_window_equals_interleave(seed in any::<u64>(), batches in 1usize..4, rows in 0usize..30, skip in 0usize..5, nulls in any::<bool>()) {
        let mut rng = Lcg(seed);
        let window: Vec<RecordBatch> = (0..batches)
            .map(|_| {
                let rows = rows + rng.next(3);
                batch(&mut rng, rows, skip, nulls)
            })
            .collect();
        let permutation = shuffle(&mut rng, &window);
        let mut reorder = Reorder::default();
        let want = expected(&window, &permutation);
        assert_same(&reorder.apply(&window, &permutation).unwrap(), &want, "first");
        // Again, into the buffers of the first (dropped) result.
        assert_same(&reorder.apply(&window, &permutation).unwrap(), &want, "reused");
    }
}

/// Where a column's values live: the list values' buffer, or the primitive values'.
fn values_ptr(column: &ArrayRef) -> *const u8 {
    let data = column.to_data();
    match data.child_data().first() {
        Some(child) => child.buffers()[0].as_ptr(),
        None => data.buffers()[0].as_ptr(),
    }
}

#[test]
fn dropped_batches_lend_their_buffers_to_the_next_window() {
    let mut rng = Lcg(5);
    let window: Vec<RecordBatch> = (0..2).map(|_| batch(&mut rng, 64, 0, true)).collect();
    let permutation = shuffle(&mut rng, &window);
    let mut reorder = Reorder::default();
    let first = reorder.apply(&window, &permutation).unwrap();
    let names = [
        "ids64",
        "ids32",
        "long",
        "w32",
        "single",
        "large",
        "large_long",
        "i64",
        "f64",
    ];
    let before: Vec<*const u8> = names
        .iter()
        .map(|n| values_ptr(first[1].column_by_name(n).unwrap()))
        .collect();
    drop(first);
    let second = reorder.apply(&window, &permutation).unwrap();
    let after: Vec<*const u8> = names
        .iter()
        .map(|n| values_ptr(second[1].column_by_name(n).unwrap()))
        .collect();
    assert_eq!(before, after, "columns {names:?}");
    assert_same(&second, &expected(&window, &permutation), "reused");
}
