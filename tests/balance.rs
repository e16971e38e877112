//! Balancing a window of record batches (src/balance.rs): the permutation is a bijection, every
//! column moves with its row, no batch gets worse, the result is deterministic, and bad windows
//! are typed errors.

use arrow_array::RecordBatch;
use sparsecore_prep::balance::{apply, balance, SampleRef};
use sparsecore_prep::{features_from_record_batch, Config, Error, Output, Preprocessor, SampleSource};
use sparsecore_testkit::workload::{generate, Profile, WorkloadSpec};

fn workload(profile: Profile, batch: usize, batches: usize, layout: (usize, usize, usize)) -> (Config, Vec<RecordBatch>) {
    let mut spec = WorkloadSpec::new(profile);
    spec.batch_size = batch;
    spec.num_batches = batches;
    spec.layout = layout;
    let w = generate(&spec).unwrap();
    (w.config, w.batches)
}

/// Worst max_ids over the stacks of one batch, from the pipeline's statistics.
fn worst_max_ids(config: &Config, batch: &RecordBatch) -> i32 {
    let mut prep = Preprocessor::new(config.clone()).unwrap();
    let features = features_from_record_batch(config, batch).unwrap();
    let inputs: Vec<&dyn SampleSource> = features.iter().map(|f| f as &dyn SampleSource).collect();
    let mut out = Output::new();
    prep.run_stats(&inputs, &mut out).unwrap();
    out.stacks.iter().map(|s| s.stats.max_ids()).max().unwrap()
}

#[test]
fn permutation_is_a_bijection_and_columns_move_together() {
    let (config, window) = workload(Profile::LargeVocab, 512, 4, (1, 1, 4));
    let balanced = balance(&config, &window).unwrap();
    let mut seen: Vec<SampleRef> = balanced.permutation.iter().flatten().copied().collect();
    seen.sort();
    let all: Vec<SampleRef> =
        window.iter().enumerate().flat_map(|(b, rb)| (0..rb.num_rows()).map(move |row| SampleRef { batch: b, row })).collect();
    assert_eq!(seen, all, "every sample of the window appears exactly once");
    for (k, (out, perm)) in balanced.batches.iter().zip(&balanced.permutation).enumerate() {
        assert_eq!(out.num_rows(), window[k].num_rows());
        assert_eq!(out.schema(), window[k].schema());
        for (i, r) in perm.iter().enumerate() {
            for c in 0..out.num_columns() {
                assert_eq!(out.column(c).slice(i, 1).to_data(), window[r.batch].column(c).slice(r.row, 1).to_data(), "batch {k} row {i} column {c}");
            }
        }
    }
    // The returned batches are exactly the window with the permutation applied.
    assert_eq!(apply(&window, &balanced.permutation).unwrap(), balanced.batches);
}

#[test]
fn no_batch_gets_worse_and_large_vocab_gets_better() {
    let (config, window) = workload(Profile::LargeVocab, 512, 8, (1, 1, 4));
    for w in [1usize, 4, 8] {
        let mut before = 0;
        let mut after = 0;
        for chunk in window.chunks(w) {
            let balanced = balance(&config, chunk).unwrap();
            // W = 1: each batch against itself; W > 1: against the window's worst input batch.
            let window_worst = chunk.iter().map(|b| worst_max_ids(&config, b)).max().unwrap();
            for (input, output) in chunk.iter().zip(&balanced.batches) {
                let (b, a) = (worst_max_ids(&config, input), worst_max_ids(&config, output));
                let bound = if w == 1 { b } else { window_worst };
                assert!(a <= bound, "W = {w}: a batch got worse ({bound} -> {a})");
                before = before.max(b);
                after = after.max(a);
            }
            let report = &balanced.report;
            assert_eq!(report.batches, chunk.len());
            assert_eq!(report.stacks.len(), report.before.len());
        }
        assert!(after < before, "W = {w}: balancing large-vocab should lower the worst cell ({before} -> {after})");
    }
}

#[test]
fn balancing_is_deterministic() {
    let (config, window) = workload(Profile::Criteo, 256, 2, (1, 1, 4));
    let a = balance(&config, &window).unwrap();
    let b = balance(&config, &window).unwrap();
    assert_eq!(a.permutation, b.permutation);
    assert_eq!(a.report, b.report);
}

#[test]
fn bad_windows_are_typed_errors() {
    let (config, window) = workload(Profile::LargeVocab, 64, 2, (1, 1, 4));
    // Different schemas: drop a column from the second batch.
    let narrower = window[1].project(&(1..window[1].num_columns()).collect::<Vec<_>>()).unwrap();
    let e = balance(&config, &[window[0].clone(), narrower.clone()]).unwrap_err();
    assert!(matches!(e, Error::InvalidInput { .. }) && e.to_string().contains("schema"), "{e}");
    // A column the config needs is missing.
    let e = balance(&config, &[narrower]).unwrap_err();
    assert!(matches!(e, Error::MissingColumn { .. }), "{e:?}");
    // An empty window is nothing to do.
    assert!(balance(&config, &[]).unwrap().batches.is_empty());
}

#[test]
fn per_sample_activations_unpermuted_equal_the_original_batch() {
    use ndarray::Array2;
    use sparsecore_kernel::{feature_activations, sparse_dense_matmul, StackedTable};
    let (config, window) = workload(Profile::ModerateMultivalency, 256, 1, (1, 1, 4));
    let balanced = balance(&config, &window).unwrap();
    assert!(balanced.report.reordered, "the test needs a batch that balancing reorders");
    // Deterministic tables: row r of table t holds small exact values.
    let tables: Vec<Array2<f32>> = config
        .tables
        .iter()
        .enumerate()
        .map(|(t, tc)| {
            Array2::from_shape_fn((tc.vocabulary_size as usize, tc.embedding_dim as usize), |(r, c)| ((r * 7 + c * 3 + t) % 17) as f32 / 8.0)
        })
        .collect();
    let activations = |batch: &RecordBatch| {
        let mut prep = Preprocessor::new(config.clone()).unwrap();
        let mut out = Output::new();
        prep.run_record_batch(batch, &mut out).unwrap();
        let plan = prep.plan().unwrap().clone();
        let mut per_feature = Vec::new();
        for (stack, so) in plan.stacks.iter().zip(&out.stacks) {
            let views: Vec<_> = stack.tables.iter().map(|&t| tables[t].view()).collect();
            let stacked = StackedTable::from_tables(&plan, &stack.name, &views).unwrap();
            let acts = sparse_dense_matmul(&plan, so, out.num_minibatches, &stacked).unwrap();
            for &f in &stack.features {
                per_feature.push((f, feature_activations(&plan, f, acts[0].view()).unwrap()));
            }
        }
        per_feature.sort_by_key(|(f, _)| *f);
        per_feature
    };
    let original = activations(&window[0]);
    let moved = activations(&balanced.batches[0]);
    for ((f, a), (_, b)) in original.iter().zip(&moved) {
        for (i, from) in balanced.permutation[0].iter().enumerate() {
            let (x, y) = (b.row(i), a.row(from.row));
            assert!(x.iter().zip(y.iter()).all(|(p, q)| p.to_bits() == q.to_bits()), "feature {f}: output row {i} (input row {})", from.row);
        }
    }
}

/// The report's loads are counted from the samples, not by the pipeline; they must equal the
/// pipeline's statistics for the same batches, before and after, on every profile, and no
/// order may beat the reported lower bound.
#[test]
fn counted_loads_equal_the_pipeline_statistics() {
    use sparsecore_prep::balance::{lower_bound, measure};
    for profile in [Profile::Criteo, Profile::Long, Profile::LargeVocab, Profile::HighMultivalency, Profile::ModerateMultivalency] {
        for layout in [(1, 1, 4), (1, 4, 4), (2, 2, 2)] {
            let batch = 32 * layout.0 * layout.2;
            let (config, window) = workload(profile, batch, 4, layout);
            for w in [1usize, 4] {
                for chunk in window.chunks(w) {
                    let balanced = balance(&config, chunk).unwrap();
                    let report = &balanced.report;
                    let (before, after) = (measure(&config, chunk).unwrap(), measure(&config, &balanced.batches).unwrap());
                    assert_eq!(report.before.len(), before.len());
                    for (k, name) in report.stacks.iter().enumerate() {
                        let what = format!("{} {layout:?} W = {w} stack {name}", profile.name());
                        assert_eq!(report.before[k].max_ids_per_partition, before[k].max_ids_per_partition, "{what}: before");
                        assert_eq!(report.before[k].required_buffer, before[k].required_buffer, "{what}: before");
                        assert_eq!(report.after[k].max_ids_per_partition, after[k].max_ids_per_partition, "{what}: after");
                        assert_eq!(report.after[k].required_buffer, after[k].required_buffer, "{what}: after");
                        assert!(report.lower_bound[k] as i32 <= after[k].max_ids_per_partition, "{what}: bound above the result");
                        assert!(report.lower_bound[k] > 0, "{what}: a bound of 0 on a stack with ids");
                    }
                    assert_eq!(lower_bound(&config, chunk).unwrap(), report.lower_bound);
                }
            }
        }
    }
}

/// The test kit's configs carry limits equal to the largest counts its batches produce, so every
/// input batch fits them exactly. Balanced batches must still fit: before the unique-id guard,
/// `long` at W = 4 raised a stack's max unique ids from 671 to 681 and preprocessing failed.
#[test]
fn balanced_batches_fit_limits_their_inputs_fit() {
    for profile in [Profile::Criteo, Profile::Long, Profile::LargeVocab, Profile::ModerateMultivalency] {
        for layout in [(1, 1, 4), (1, 4, 4)] {
            let (config, window) = workload(profile, 128 * layout.0 * layout.2, 4, layout);
            let mut prep = Preprocessor::new(config.clone()).unwrap();
            let mut out = Output::new();
            for b in &window {
                prep.run_record_batch(b, &mut out).unwrap();
            }
            for w in [1usize, 4] {
                for chunk in window.chunks(w) {
                    let balanced = balance(&config, chunk).unwrap();
                    for (k, b) in balanced.batches.iter().enumerate() {
                        prep.run_record_batch(b, &mut out).unwrap_or_else(|e| {
                            panic!("{} {layout:?} W = {w}: balanced batch {k} no longer fits: {e}", profile.name())
                        });
                    }
                }
            }
        }
    }
}
