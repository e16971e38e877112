//! The per-stack summary table printed by `demo`, `preprocess` and `stats`.

use sparsecore_prep::spec::Plan;
use sparsecore_prep::Output;

/// Ids per stack in one batch, counted from the plan's member features.
pub type StackIds = Vec<u64>;

/// Prints one row per stack: ids, buffer size and use, the largest per-partition counts
/// against their limits, and drops.
pub fn print_summary(plan: &Plan, out: &Output, ids: &StackIds) {
    println!(
        "{:<24} {:>4} {:>9} {:>9} {:>9} {:>6} {:>13} {:>13} {:>8}",
        "stack", "feat", "ids", "C/device", "required", "use%", "max ids/lim", "max uniq/lim", "dropped"
    );
    let s = plan.layout.sc_per_device;
    for ((stack, so), &n) in plan.stacks.iter().zip(&out.stacks).zip(ids) {
        let required = so.stats.required_buffer_size_per_device(s);
        let c = so.coo_buffer_size_per_device();
        println!(
            "{:<24} {:>4} {:>9} {:>9} {:>9} {:>5.1}% {:>13} {:>13} {:>8}",
            truncate(&stack.name, 24),
            stack.features.len(),
            n,
            c,
            required,
            100.0 * required as f64 / c as f64,
            format!("{}/{}", so.stats.max_ids(), stack.max_ids_per_partition),
            format!("{}/{}", so.stats.max_unique_ids(), stack.max_unique_ids_per_partition),
            so.stats.dropped_id_count
        );
    }
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(n - 1).collect();
        t.push('…');
        t
    }
}
