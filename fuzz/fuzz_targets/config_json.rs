//! Arbitrary bytes as a config: `Config::from_json` → the planner → (when the buffers are
//! small) one batch through the preprocessor. Everything must be `Ok` or a typed `Err`; an `Ok`
//! plan must satisfy the planner's invariants, and a batch must give the same bytes on one and
//! two threads.

#![no_main]

use fuzz_common::{output_bytes, run_deterministic, OUTPUT_BUDGET_BYTES};
use libfuzzer_sys::fuzz_target;
use sparsecore_prep::input::{RaggedInput, SampleSource};
use sparsecore_prep::{Config, Plan, Preprocessor};

/// The planner's promises (ARCHITECTURE.md, SPEC 3.2): every feature in exactly one stack,
/// stacked rows contiguous, buffer sizes aligned and addressable by 32-bit offsets.
fn check_plan(config: &Config, plan: &Plan) {
    let layout = plan.layout;
    let n = layout.num_partitions() as u64;
    let s = layout.sc_per_device;
    assert_eq!(plan.features.len(), config.features.len());
    for (i, f) in plan.features.iter().enumerate() {
        assert!(
            f.stack < plan.stacks.len(),
            "feature {} has no stack",
            f.name
        );
        assert!(
            plan.stacks[f.stack].features.contains(&i),
            "stack of {} does not list it",
            f.name
        );
        assert!(
            f.padded_vocab_size >= f.vocabulary_size && f.padded_vocab_size % (8 * n) == 0,
            "{f:?}"
        );
        assert!(f.col_offset <= i32::MAX as u32, "{f:?}");
    }
    for stack in &plan.stacks {
        let c = stack.coo_buffer_size_per_device;
        assert!(
            c > 0 && c < i32::MAX as usize && c % (8 * s) == 0,
            "stack {}: C = {c}",
            stack.name
        );
        let mb = if plan.enable_minibatching { 64 } else { 1 };
        assert_eq!(
            stack.row_pointers_per_device,
            layout.row_pointers_per_segment() * s * mb
        );
        // Column ids fit 32 bits and rows per shard an i32; a table starts below 2^31.
        assert!(
            stack.stack_vocab_size <= (1u64 << 32).min((1u64 << 31) * n),
            "stack {}: vocab {}",
            stack.name,
            stack.stack_vocab_size
        );
        let mut offset = 0u64;
        let mut members = stack.features.clone();
        members.sort_by_key(|&f| plan.features[f].row_offset);
        assert_eq!(
            members, stack.features,
            "stack {}: features not in row-offset order",
            stack.name
        );
        for &f in &stack.features {
            let fp = &plan.features[f];
            assert_eq!(
                fp.stack,
                plan.stacks
                    .iter()
                    .position(|x| x.name == stack.name)
                    .unwrap()
            );
            assert_eq!(
                fp.row_offset, offset,
                "stack {}: rows of {} are not contiguous",
                stack.name, fp.name
            );
            offset += fp.global_batch_size as u64;
        }
        assert_eq!(offset, stack.total_sample_count);
    }
    let _ = plan.resolved();
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let Ok(config) = Config::from_json(&text) else {
        return;
    };
    let again = Config::from_json(&config.to_json()).expect("a config we wrote parses");
    assert_eq!(again, config, "JSON round trip changed the config");

    let n = config.features.len();
    let nominal = Plan::new(&config, &vec![0; n]);
    if let Ok(plan) = &nominal {
        check_plan(&config, plan);
    }
    let built = Preprocessor::builder(config.clone()).build();
    let o = &config.config;
    let needs_all_reduce = o.enable_minibatching && o.local_device_count < o.global_device_count;
    match (&nominal, &built) {
        (Err(e), Ok(_)) => panic!("build accepted a config the planner refuses: {e}"),
        (Ok(_), Err(e)) if !needs_all_reduce => {
            panic!("build refused a config the planner accepts: {e}")
        }
        _ => {}
    }

    // The smallest batch every stack accepts: L * S samples per feature.
    let local = o.local_device_count.saturating_mul(o.num_sc_per_device);
    let Ok(plan) = Plan::for_local_batches(&config, &vec![local; n]) else {
        return;
    };
    check_plan(&config, &plan);
    if n > 16 || local > 256 || needs_all_reduce || output_bytes(&plan) > OUTPUT_BUDGET_BYTES {
        return;
    }
    // Two ids per sample, spread over the vocabulary, so that every stack has work.
    let columns: Vec<(Vec<i64>, Vec<i64>)> = plan
        .features
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let v = f.vocabulary_size as i64;
            let ids = (0..local as i64)
                .flat_map(|r| [(r * 7 + i as i64) % v, (r * 13 + 1) % v])
                .collect();
            let splits = (0..=local as i64).map(|r| 2 * r).collect();
            (ids, splits)
        })
        .collect();
    let sources: Vec<RaggedInput<'_>> = config
        .features
        .iter()
        .zip(&columns)
        .map(|(f, (ids, splits))| {
            RaggedInput::from_i64(&f.name, ids, splits).expect("valid row splits")
        })
        .collect();
    let inputs: Vec<&dyn SampleSource> = sources.iter().map(|s| s as &dyn SampleSource).collect();
    let _ = run_deterministic(&config, |b| b, 0, &inputs);
});
