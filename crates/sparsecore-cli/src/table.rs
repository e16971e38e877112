//! The per-stack summary table printed by `demo`, `preprocess`, `stats` and `bench`, and the ids
//! per stack it shows.

use sparsecore_prep::input::SampleSource;
use sparsecore_prep::spec::Plan;
use sparsecore_prep::StackStats;

use super::stdio::outln;

/// One stack's row.
pub struct Row<'a> {
    pub plan_name: &'a str,
    pub features: usize,
    pub ids: u64,
    pub coo_per_device: Option<usize>,
    pub stats: &'a StackStats,
    pub max_ids_limit: u32,
    pub max_unique_limit: u32,
}

/// Rows for every stack of `plan`, from per-stack stats and id counts.
pub fn rows<'a>(
    plan: &'a Plan,
    stats: &'a [&'a StackStats],
    ids: &[u64],
    buffers: bool,
) -> Vec<Row<'a>> {
    plan.stacks
        .iter()
        .zip(stats)
        .zip(ids)
        .map(|((s, st), &n)| Row {
            plan_name: &s.name,
            features: s.features.len(),
            ids: n,
            coo_per_device: buffers.then_some(s.coo_buffer_size_per_device),
            stats: st,
            max_ids_limit: s.max_ids_per_partition,
            max_unique_limit: s.max_unique_ids_per_partition,
        })
        .collect()
}

/// Ids per stack of a batch (duplicates included).
pub fn count_ids(plan: &sparsecore_prep::Plan, inputs: &[&dyn SampleSource]) -> Vec<u64> {
    plan.stacks
        .iter()
        .map(|s| {
            s.features
                .iter()
                .map(|&f| inputs[f].view().num_ids() as u64)
                .sum()
        })
        .collect()
}

/// Prints one row per stack: ids, the buffer and how much of it the batch needs, the largest
/// per-partition counts against their limits, and drops.
pub fn print(rows: &[Row<'_>], sc_per_device: usize) {
    outln!(
        "{:<24} {:>4} {:>10} {:>9} {:>9} {:>6} {:>13} {:>13} {:>8}",
        "stack",
        "feat",
        "ids",
        "C/device",
        "required",
        "use%",
        "max ids/lim",
        "max uniq/lim",
        "dropped"
    );
    for r in rows {
        let required = r.stats.required_buffer_size_per_device(sc_per_device);
        let (c, pct) = match r.coo_per_device {
            Some(c) => (
                c.to_string(),
                format!("{:.1}%", 100.0 * required as f64 / c as f64),
            ),
            None => ("-".to_string(), "-".to_string()),
        };
        outln!(
            "{:<24} {:>4} {:>10} {:>9} {:>9} {:>6} {:>13} {:>13} {:>8}",
            truncate(r.plan_name, 24),
            r.features,
            r.ids,
            c,
            required,
            pct,
            format!("{}/{}", r.stats.max_ids(), r.max_ids_limit),
            format!("{}/{}", r.stats.max_unique_ids(), r.max_unique_limit),
            r.stats.dropped_id_count
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
