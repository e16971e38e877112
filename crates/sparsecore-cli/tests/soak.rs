//! A short soak: the real `sparsecore-prep soak` loop (one preprocessor, one reused output,
//! random batches of varying shapes, every third one checked against the oracle model, RSS
//! watched) for about 20 seconds.
//!
//! Ignored by default because it is time-bound; run it with
//! `cargo test --test soak -- --ignored`. The long run is
//! `cargo run --release -- soak --minutes 10` (RELIABILITY.md, "Soak").

use std::process::Command;

/// The `X/Y` after `label` in `text`.
fn fraction_after(text: &str, label: &str) -> Option<(u64, u64)> {
    let rest = &text[text.find(label)? + label.len()..];
    let word = rest.split_whitespace().next()?;
    let (a, b) = word.split_once('/')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

#[test]
#[ignore = "time-bound (about 20 s); run with --ignored"]
fn soak_short() {
    let out = Command::new(env!("CARGO_BIN_EXE_sparsecore-prep"))
        .args(["soak", "--minutes", "0.33", "--seed", "7", "--threads", "2", "--check-every", "3"])
        .output()
        .expect("the binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}");
    assert!(out.status.success(), "soak failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("soak: OK"), "{stdout}");
    let (passed, checks) = fraction_after(&stdout, "checks passed").expect("a checks line");
    assert!(checks >= 10 && passed == checks, "checks passed {passed}/{checks}");
}
