//! Argument helpers that several subcommands share: the value parsers of `--layout L/G/S` and
//! `--shard i/N`, and the `--threads` help.

/// The `--threads` help of every subcommand that preprocesses, naming the library's bound for
/// batches small enough to run on the calling thread.
pub fn threads_help() -> String {
    format!(
        "Worker threads (default: one per CPU); a batch of fewer than {} ids runs on the \
         calling thread",
        sparsecore_prep::SMALL_BATCH_IDS
    )
}

/// Parses `L/G/S`.
pub fn parse_layout(s: &str) -> std::result::Result<(usize, usize, usize), String> {
    let parts: Vec<&str> = s.split('/').collect();
    let nums: Vec<usize> = parts.iter().filter_map(|p| p.trim().parse().ok()).collect();
    match nums.as_slice() {
        [l, g, sc] if parts.len() == 3 && *l > 0 && *g > 0 && *sc > 0 => Ok((*l, *g, *sc)),
        _ => Err(format!(
            "expected L/G/S (three integers, each at least 1), got {s:?}"
        )),
    }
}

/// Parses `i/N` with `i < N`.
pub fn parse_shard(s: &str) -> std::result::Result<(usize, usize), String> {
    let (i, n) = s
        .split_once('/')
        .ok_or_else(|| format!("expected i/N, got {s:?}"))?;
    let (i, n): (usize, usize) = (
        i.trim()
            .parse()
            .map_err(|_| format!("bad shard index in {s:?}"))?,
        n.trim()
            .parse()
            .map_err(|_| format!("bad shard count in {s:?}"))?,
    );
    if n == 0 || i >= n {
        return Err(format!("shard {i}/{n}: need 0 <= i < N"));
    }
    Ok((i, n))
}
