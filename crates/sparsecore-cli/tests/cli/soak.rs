//! A short soak: the real `sparsecore-prep soak` loop (one preprocessor, one reused output,
//! random batches of varying shapes, every third one checked against the oracle model, RSS
//! watched) for 5 seconds, or `SPARSECORE_SOAK_MINUTES` minutes (`0.33` is a 20-second run).
//! The long run is `cargo run --release -- soak --minutes 10` (RELIABILITY.md, "Soak").

use std::process::Command;

/// The `X/Y` after `label` in `text`.
fn fraction_after(text: &str, label: &str) -> Option<(u64, u64)> {
    let rest = &text[text.find(label)? + label.len()..];
    let word = rest.split_whitespace().next()?;
    let (a, b) = word.split_once('/')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

#[test]
fn soak_short() {
    let minutes = std::env::var("SPARSECORE_SOAK_MINUTES").unwrap_or_else(|_| "0.08".into());
    let out = Command::new(env!("CARGO_BIN_EXE_sparsecore-prep"))
        .args([
            "soak",
            "--minutes",
            &minutes,
            "--seed",
            "7",
            "--threads",
            "2",
            "--check-every",
            "3",
        ])
        .output()
        .expect("the binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}");
    assert!(out.status.success(), "soak failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("soak: OK"), "{stdout}");
    let (passed, checks) = fraction_after(&stdout, "checks passed").expect("a checks line");
    assert!(
        checks >= 10 && passed == checks,
        "checks passed {passed}/{checks}"
    );
}
