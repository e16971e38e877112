//! Measures balancing (src/balance.rs) side by side with the input order, for BENCHMARKS.md:
//! for every workload profile at layouts 1/1/4 and 1/4/4 and windows W = 1, 4 and 8, the worst
//! `max_ids_per_partition` over 8 batches before and after, its lower bound, and the time to
//! balance as a share of the time to preprocess the same batches.
//!
//! The limits are the test kit's doubled (headroom 2). `cargo run --release --example
//! balance_report [-- SAMPLES_PER_SPARSECORE]` (default 128).

use std::time::Instant;

use arrow_array::RecordBatch;
use sparsecore_prep::balance::{balance, Balancer};
use sparsecore_prep::fdo::{tune, FdoStats};
use sparsecore_prep::{features_from_record_batch, Config, Output, Preprocessor, SampleSource};

/// `fdo tune` (headroom 1.0) on the stats of `batches`: the tuned limits and buffer sizes,
/// summed over the tables (max ids, max unique ids, COO buffer per device).
fn tuned(config: &Config, batches: &[RecordBatch]) -> sparsecore_prep::Result<(u64, u64, u64)> {
    let mut prep = Preprocessor::builder(config.clone()).threads(1).build()?;
    let mut out = Output::new();
    let mut stats: Option<FdoStats> = None;
    for b in batches {
        let features = features_from_record_batch(config, b)?;
        let inputs: Vec<&dyn SampleSource> = features.iter().map(|f| f as _).collect();
        prep.run_stats(&inputs, &mut out)?;
        let plan = prep.plan().expect("planned").clone();
        stats.get_or_insert_with(|| FdoStats::new(plan.layout)).record(&plan, &out)?;
    }
    let Some(stats) = stats else { return Ok((0, 0, 0)) };
    let (config, _) = tune(config, &stats, 1.0)?;
    Ok(config.tables.iter().fold((0, 0, 0), |(a, b, c), t| {
        (a + t.max_ids_per_partition, b + t.max_unique_ids_per_partition, c + t.suggested_coo_buffer_size_per_device.unwrap_or(0))
    }))
}
use sparsecore_testkit::workload::{generate, Profile, WorkloadSpec};

/// The test kit's limits equal its batches' largest counts; a tuned config has headroom (`fdo
/// tune --headroom`), without which no reordered batch could keep every stack within its limits
/// and balancing would keep the input order. Doubles them.
fn with_headroom(config: &mut Config) {
    for t in &mut config.tables {
        t.max_ids_per_partition *= 2;
        t.max_unique_ids_per_partition *= 2;
        t.suggested_coo_buffer_size_per_device = t.suggested_coo_buffer_size_per_device.map(|b| b * 2);
    }
}

fn main() -> sparsecore_prep::Result<()> {
    let per_sc: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(128);
    println!("| profile | L/G/S | W | worst max_ids before | after | change | lower bound | gap to bound | balance time / preprocess time |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for profile in [Profile::Criteo, Profile::Long, Profile::LargeVocab, Profile::HighMultivalency, Profile::ModerateMultivalency] {
        for layout in [(1, 1, 4), (1, 4, 4)] {
            let mut spec = WorkloadSpec::new(profile);
            spec.layout = layout;
            spec.batch_size = per_sc * layout.0 * layout.2;
            spec.num_batches = 8;
            let mut w = generate(&spec)?;
            with_headroom(&mut w.config);
            let mut prep = Preprocessor::builder(w.config.clone()).threads(1).build()?;
            let mut out = Output::new();
            let worst = |prep: &mut Preprocessor, out: &mut Output, batches: &[arrow_array::RecordBatch]| -> sparsecore_prep::Result<i32> {
                let mut m = 0;
                for b in batches {
                    let features = sparsecore_prep::features_from_record_batch(&w.config, b)?;
                    let inputs: Vec<&dyn sparsecore_prep::SampleSource> = features.iter().map(|f| f as _).collect();
                    prep.run_stats(&inputs, out)?;
                    m = m.max(out.stacks.iter().map(|s| s.stats.max_ids()).max().unwrap_or(0));
                }
                Ok(m)
            };
            // Both timings are the fastest of 5 passes over the same 8 batches, after a warm-up
            // pass, on one thread: the noisy VM makes a single pass meaningless.
            let fastest = |f: &mut dyn FnMut() -> sparsecore_prep::Result<()>| -> sparsecore_prep::Result<f64> {
                f()?;
                let mut best = f64::INFINITY;
                for _ in 0..5 {
                    let t = Instant::now();
                    f()?;
                    best = best.min(t.elapsed().as_secs_f64());
                }
                Ok(best)
            };
            let preprocess = fastest(&mut || {
                for b in &w.batches {
                    prep.run_record_batch(b, &mut out).or_else(|e| match e {
                        sparsecore_prep::Error::LimitExceeded { .. } => Ok(()),
                        e => Err(e),
                    })?;
                }
                Ok(())
            })?;
            let before = worst(&mut prep, &mut out, &w.batches)?;
            for window in [1usize, 4, 8] {
                let mut balancer = Balancer::new(w.config.clone())?;
                let mut balanced = Vec::new();
                let mut bound = 0u32;
                let cost = fastest(&mut || {
                    balanced.clear();
                    bound = 0;
                    for chunk in w.batches.chunks(window) {
                        let b = balancer.balance(chunk)?;
                        bound = bound.max(b.report.lower_bound.iter().copied().max().unwrap_or(0));
                        balanced.extend(b.batches);
                    }
                    Ok(())
                })?;
                let after = worst(&mut prep, &mut out, &balanced)?;
                println!(
                    "| {} | {}/{}/{} | {window} | {before} | {after} | {:+.1}% | {bound} | {:.2}% | {:.0}% |",
                    profile.name(),
                    layout.0,
                    layout.1,
                    layout.2,
                    100.0 * (after as f64 / before as f64 - 1.0),
                    100.0 * (after as f64 / bound.max(1) as f64 - 1.0),
                    100.0 * cost / preprocess,
                );
            }
        }
    }
    println!();
    println!("`fdo tune --headroom 1.0` on the stats of the same 8 batches, summed over the tables:");
    println!();
    println!("| profile | L/G/S | W | Σ max_ids before → after | Σ max_unique before → after | Σ buffer/device before → after |");
    println!("|---|---|---|---|---|---|");
    for profile in [Profile::Criteo, Profile::Long, Profile::LargeVocab, Profile::HighMultivalency, Profile::ModerateMultivalency] {
        for layout in [(1, 1, 4), (1, 4, 4)] {
            let mut spec = WorkloadSpec::new(profile);
            spec.layout = layout;
            spec.batch_size = per_sc * layout.0 * layout.2;
            spec.num_batches = 8;
            let mut w = generate(&spec)?;
            with_headroom(&mut w.config);
            let before = tuned(&w.config, &w.batches)?;
            for window in [1usize, 4, 8] {
                let mut balanced = Vec::new();
                for chunk in w.batches.chunks(window) {
                    balanced.extend(balance(&w.config, chunk)?.batches);
                }
                let after = tuned(&w.config, &balanced)?;
                println!(
                    "| {} | {}/{}/{} | {window} | {} → {} | {} → {} | {} → {} |",
                    profile.name(),
                    layout.0,
                    layout.1,
                    layout.2,
                    before.0,
                    after.0,
                    before.1,
                    after.1,
                    before.2,
                    after.2
                );
            }
        }
    }
    Ok(())
}
