//! One balancing or preprocessing workload, run a given number of passes, for callgrind and
//! perf: what `balance_report` measures for one row, without its other rows and timing loops.
//!
//! `cargo run --release -p sparsecore-tools --bin balance_profile -- PROFILE HOSTS WINDOW PASSES MODE [every-stack|unique-ids]`
//! - PROFILE: a test kit profile (`criteo`, `long`, `large-vocab`, `high-multivalency`,
//!   `moderate-multivalency`); layout 1/HOSTS/4, 128 samples per SparseCore, 8 batches, the
//!   limits doubled as in `balance_report`;
//! - MODE `balance`: [`Balancer::balance`] over windows of WINDOW batches, PASSES times; it
//!   prints a hash of every window's permutation and report, so that a change meant only to
//!   be faster can show it returns the same orders;
//! - MODE `preprocess`: the pipeline on the same batches, PASSES times, one thread;
//! - `every-stack`, `unique-ids`: balance with [`Refinement::EveryStack`] or
//!   [`Refinement::UniqueIds`].
//!
//! Instructions per pass are (PASSES = 2) − (PASSES = 0), halved: that removes generating the
//! batches and planning. For example
//! `valgrind --tool=callgrind --toggle-collect='*Balancer*balance*' target/release/balance_profile criteo 1 1 2 balance`.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use sparsecore_prep::balance::{Balancer, Refinement};
use sparsecore_prep::{Output, Preprocessor};
use sparsecore_testkit::workload::{generate, Profile, WorkloadSpec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (args, refinement) = match args.as_slice() {
        [rest @ .., last] if last == "every-stack" => (rest, Refinement::EveryStack),
        [rest @ .., last] if last == "unique-ids" => (rest, Refinement::UniqueIds),
        all => (all, Refinement::WorstCell),
    };
    let [profile, hosts, window, passes, mode] = args else {
        return Err("usage: balance_profile PROFILE HOSTS WINDOW PASSES balance|preprocess [every-stack|unique-ids]".into());
    };
    let profile: Profile = profile.parse()?;
    let (hosts, window, passes): (usize, usize, usize) =
        (hosts.parse()?, window.parse()?, passes.parse()?);
    let mut spec = WorkloadSpec::new(profile);
    spec.layout = (1, hosts, 4);
    spec.batch_size = 128 * 4;
    spec.num_batches = 8;
    let mut workload = generate(&spec)?;
    // As balance_report: doubled limits, so that a reordered window can fit them.
    for t in &mut workload.config.tables {
        t.max_ids_per_partition *= 2;
        t.max_unique_ids_per_partition *= 2;
        t.suggested_coo_buffer_size_per_device =
            t.suggested_coo_buffer_size_per_device.map(|b| b * 2);
    }
    let (config, batches) = (workload.config, workload.batches);
    match mode.as_str() {
        "balance" => {
            let mut balancer = Balancer::new(config)?.refinement(refinement);
            let mut hasher = DefaultHasher::new();
            for _ in 0..passes {
                for chunk in batches.chunks(window) {
                    let balanced = balancer.balance(chunk)?;
                    format!("{:?}{:?}", balanced.permutation, balanced.report).hash(&mut hasher);
                }
            }
            println!("orders and reports: {:016x}", hasher.finish());
        }
        "preprocess" => {
            let mut prep = Preprocessor::builder(config).threads(1).build()?;
            let mut out = Output::new();
            for _ in 0..passes {
                for b in &batches {
                    prep.run_record_batch(b, &mut out)?;
                }
            }
        }
        other => return Err(format!("MODE is balance or preprocess, not {other}").into()),
    }
    Ok(())
}
