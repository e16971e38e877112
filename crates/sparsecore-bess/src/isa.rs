//! Runtime choice of instruction set for the uniform negatives' draws, as `sparsecore-prep`
//! makes it for its own hot loops (its `isa` module is private to it, hence this copy).
//!
//! The crate is built for the baseline x86-64 (SSE2), so that one binary or wheel runs on any
//! x86-64 machine. The negatives' draw loop is also compiled for x86-64-v3 (AVX2, BMI1/2, FMA,
//! LZCNT, POPCNT) and picked at run time: twice as many draws per vector in the reduction and
//! the id mapping, and the generator's lanes in AVX2 vectors (`rng::Avx2`). Both versions make
//! the same draws, bit for bit: the same integer arithmetic, and the vector generator's outputs
//! are the scalar one's (tested).

/// Whether the x86-64-v3 version runs: the CPU has the features, and the environment variable
/// `SPARSECORE_PREP_ISA` is not `baseline` (the same switch as `sparsecore-prep`'s, which forces
/// the baseline code; read once per process).
#[inline(always)]
pub(crate) fn v3() -> bool {
    use std::sync::atomic::{AtomicU8, Ordering};
    // 0: not decided yet, 1: baseline, 2: v3.
    static CHOICE: AtomicU8 = AtomicU8::new(0);
    match CHOICE.load(Ordering::Relaxed) {
        0 => {
            let v3 = cpu_has_v3() && std::env::var("SPARSECORE_PREP_ISA").map_or(true, |v| v != "baseline");
            CHOICE.store(if v3 { 2 } else { 1 }, Ordering::Relaxed);
            v3
        }
        c => c == 2,
    }
}

fn cpu_has_v3() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("bmi1")
            && std::is_x86_feature_detected!("bmi2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("lzcnt")
            && std::is_x86_feature_detected!("popcnt")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}
