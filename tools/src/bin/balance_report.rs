//! Measures balancing (src/balance/) side by side with the input order, for BENCHMARKS.md:
//! for every workload profile at layouts 1/1/4 and 1/4/4 and windows W = 1, 4 and 8, the worst
//! `max_ids_per_partition` over 8 batches before and after, its lower bound, and the time to
//! balance as a share of the time to preprocess the same batches.
//!
//! The limits are the test kit's doubled (headroom 2). `cargo run --release -p
//! sparsecore-tools --bin balance_report [-- SAMPLES_PER_SPARSECORE]` (default 128).
//!
//! `-- --input FILE.arrow --config CONFIG.json [--label NAME]` measures one workload file instead
//! (every record batch of an Arrow IPC file, its config's limits as they are), for example one
//! written by the reference benchmark's generator, `../shared/peer/make_workload.py`, whose random
//! stream differs from the test kit's.
//!
//! `-- --every-stack` balances with `Refinement::EveryStack` instead of the default, and
//! `-- --unique-ids` with `Refinement::UniqueIds`.

use std::time::Instant;

use arrow_array::RecordBatch;
use sparsecore_prep::balance::{Balancer, Refinement};
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
        stats
            .get_or_insert_with(|| FdoStats::new(plan.layout))
            .record(&plan, &out)?;
    }
    let Some(stats) = stats else {
        return Ok((0, 0, 0));
    };
    let (config, _) = tune(config, &stats, 1.0)?;
    Ok(config.tables.iter().fold((0, 0, 0), |(a, b, c), t| {
        (
            a + t.max_ids_per_partition,
            b + t.max_unique_ids_per_partition,
            c + t.suggested_coo_buffer_size_per_device.unwrap_or(0),
        )
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
        t.suggested_coo_buffer_size_per_device =
            t.suggested_coo_buffer_size_per_device.map(|b| b * 2);
    }
}

/// Both timings are the fastest of 5 passes over the same batches, after a warm-up pass, on one
/// thread: the noisy VM makes a single pass meaningless.
fn fastest(f: &mut dyn FnMut() -> sparsecore_prep::Result<()>) -> sparsecore_prep::Result<f64> {
    f()?;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// The largest `max_ids_per_partition` of any stack in any of `batches`, from the pipeline.
fn worst(
    prep: &mut Preprocessor,
    config: &Config,
    out: &mut Output,
    batches: &[RecordBatch],
) -> sparsecore_prep::Result<i32> {
    let mut m = 0;
    for b in batches {
        let features = features_from_record_batch(config, b)?;
        let inputs: Vec<&dyn SampleSource> = features.iter().map(|f| f as _).collect();
        prep.run_stats(&inputs, out)?;
        m = m.max(
            out.stacks
                .iter()
                .map(|s| s.stats.max_ids())
                .max()
                .unwrap_or(0),
        );
    }
    Ok(m)
}

/// One row per window size of the first table: before and after, the bound, and the cost.
fn load_rows(
    name: &str,
    layout: &str,
    config: &Config,
    batches: &[RecordBatch],
    refinement: Refinement,
) -> sparsecore_prep::Result<()> {
    let mut prep = Preprocessor::builder(config.clone()).threads(1).build()?;
    let mut out = Output::new();
    let preprocess = fastest(&mut || {
        for b in batches {
            prep.run_record_batch(b, &mut out).or_else(|e| match e {
                sparsecore_prep::Error::LimitExceeded { .. } => Ok(()),
                e => Err(e),
            })?;
        }
        Ok(())
    })?;
    let before = worst(&mut prep, config, &mut out, batches)?;
    for window in [1usize, 4, 8] {
        let mut balancer = Balancer::new(config.clone())?.refinement(refinement);
        let mut balanced = Vec::new();
        let mut bound = 0u32;
        let cost = fastest(&mut || {
            balanced.clear();
            bound = 0;
            for chunk in batches.chunks(window) {
                let b = balancer.balance(chunk)?;
                bound = bound.max(b.report.lower_bound.iter().copied().max().unwrap_or(0));
                balanced.extend(b.batches);
            }
            Ok(())
        })?;
        let after = worst(&mut prep, config, &mut out, &balanced)?;
        println!(
            "| {name} | {layout} | {window} | {before} | {after} | {:+.1}% | {bound} | {:.2}% | {:.0}% |",
            100.0 * (after as f64 / before as f64 - 1.0),
            100.0 * (after as f64 / bound.max(1) as f64 - 1.0),
            100.0 * cost / preprocess,
        );
    }
    Ok(())
}

/// One row per window size of the second table: tuned limits and buffers before and after.
fn fdo_rows(
    name: &str,
    layout: &str,
    config: &Config,
    batches: &[RecordBatch],
    refinement: Refinement,
) -> sparsecore_prep::Result<()> {
    let before = tuned(config, batches)?;
    for window in [1usize, 4, 8] {
        let mut balancer = Balancer::new(config.clone())?.refinement(refinement);
        let mut balanced = Vec::new();
        for chunk in batches.chunks(window) {
            balanced.extend(balancer.balance(chunk)?.batches);
        }
        let after = tuned(config, &balanced)?;
        println!(
            "| {name} | {layout} | {window} | {} → {} | {} → {} | {} → {} |",
            before.0, after.0, before.1, after.1, before.2, after.2
        );
    }
    Ok(())
}

const LOAD_HEADER: &str = "| profile | L/G/S | W | worst max_ids before | after | change | lower bound | gap to bound | balance time / preprocess time |\n|---|---|---|---|---|---|---|---|---|";
const FDO_HEADER: &str =
    "| profile | L/G/S | W | Σ max_ids before → after | Σ max_unique before → after | Σ buffer/device before → after |\n|---|---|---|---|---|---|";

/// The batches of an Arrow IPC file and its config.
fn read_workload(
    input: &str,
    config: &str,
) -> Result<(Config, Vec<RecordBatch>), Box<dyn std::error::Error>> {
    let config = Config::from_path(config)?;
    let reader = arrow_ipc::reader::FileReader::try_new(std::fs::File::open(input)?, None)?;
    let batches = reader.collect::<Result<Vec<_>, _>>()?;
    Ok((config, batches))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let refinement = if args.iter().any(|a| a == "--unique-ids") {
        Refinement::UniqueIds
    } else if args.iter().any(|a| a == "--every-stack") {
        Refinement::EveryStack
    } else {
        Refinement::WorstCell
    };
    if let (Some(input), Some(config)) = (flag("--input"), flag("--config")) {
        let (config, batches) = read_workload(&input, &config)?;
        let label = flag("--label").unwrap_or(input);
        let o = &config.config;
        let layout = format!(
            "{}/{}/{}",
            o.local_device_count, o.global_device_count, o.num_sc_per_device
        );
        println!("{LOAD_HEADER}");
        load_rows(&label, &layout, &config, &batches, refinement)?;
        println!("\n{FDO_HEADER}");
        fdo_rows(&label, &layout, &config, &batches, refinement)?;
        return Ok(());
    }
    let per_sc: usize = args.iter().find_map(|a| a.parse().ok()).unwrap_or(128);
    let workloads = || {
        [
            Profile::Criteo,
            Profile::Long,
            Profile::LargeVocab,
            Profile::HighMultivalency,
            Profile::ModerateMultivalency,
        ]
        .into_iter()
        .flat_map(|profile| [(1, 1, 4), (1, 4, 4)].map(|layout| (profile, layout)))
    };
    let generated = |profile: Profile,
                     layout: (usize, usize, usize)|
     -> sparsecore_prep::Result<(Config, Vec<RecordBatch>)> {
        let mut spec = WorkloadSpec::new(profile);
        spec.layout = layout;
        spec.batch_size = per_sc * layout.0 * layout.2;
        spec.num_batches = 8;
        let mut w = generate(&spec)?;
        with_headroom(&mut w.config);
        Ok((w.config, w.batches))
    };
    println!("{LOAD_HEADER}");
    for (profile, layout) in workloads() {
        let (config, batches) = generated(profile, layout)?;
        load_rows(
            profile.name(),
            &format!("{}/{}/{}", layout.0, layout.1, layout.2),
            &config,
            &batches,
            refinement,
        )?;
    }
    println!(
        "\n`fdo tune --headroom 1.0` on the stats of the same 8 batches, summed over the tables:\n"
    );
    println!("{FDO_HEADER}");
    for (profile, layout) in workloads() {
        let (config, batches) = generated(profile, layout)?;
        fdo_rows(
            profile.name(),
            &format!("{}/{}/{}", layout.0, layout.1, layout.2),
            &config,
            &batches,
            refinement,
        )?;
    }
    Ok(())
}
