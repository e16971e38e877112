//! Runtime choice of instruction set for the hot loops.
//!
//! The crate is built for the baseline x86-64 (SSE2), so that one binary or wheel runs on any
//! x86-64 machine. The hot loops where v3 pays are also compiled a second time for x86-64-v3
//! (AVX2, BMI1/2, FMA, LZCNT, POPCNT; every x86 server CPU since 2013-2015) and picked at run
//! time, per call, from the CPU's feature flags (one cached load): the radix sort and the split
//! (`group::sort`), the ragged extraction (`extract`) and balancing's bitmap of seen columns
//! (`balance::count`), through `dispatch_v3!`; and, through [`v3`], the BESS crate's PCG64
//! draws and row copies. Wider vectors serve the key arithmetic, and shifts by a register count
//! (BMI2) free the count register in the scatter loops (BENCHMARKS.md has the measurements).
//!
//! Both versions run the same source, so their outputs are the same bytes: the vector forms
//! compute the same integer arithmetic, and no floating-point reduction is reordered (gains
//! are summed in the walk, which is not duplicated).

/// Whether the x86-64-v3 versions run: the CPU has the features, and the environment
/// variable `SPARSECORE_PREP_ISA` is not `baseline` (which forces the baseline code, to
/// compare the two or to rule one out; read once per process). Public so that the side crates'
/// own v3 copies (the BESS negatives' draws) follow the same choice and the same switch.
#[inline(always)]
pub fn v3() -> bool {
    use std::sync::atomic::{AtomicU8, Ordering};
    // 0: not decided yet, 1: baseline, 2: v3.
    static CHOICE: AtomicU8 = AtomicU8::new(0);
    match CHOICE.load(Ordering::Relaxed) {
        0 => {
            let v3 = cpu_has_v3()
                && std::env::var("SPARSECORE_PREP_ISA").map_or(true, |v| v != "baseline");
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

/// Calls `$body` (an expression over the listed arguments) through a copy of it compiled for
/// x86-64-v3 when [`v3`] says the CPU has it, else directly. `$body`'s callees must be
/// `#[inline(always)]` for the copy to reach them: a function that is not inlined keeps its
/// baseline code.
macro_rules! dispatch_v3 {
    (<$($g:ident : $b:path),*> ($($arg:ident : $ty:ty),*) -> $ret:ty $body:block) => {{
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx2,bmi1,bmi2,fma,lzcnt,popcnt")]
            fn v3<$($g: $b),*>($($arg: $ty),*) -> $ret $body
            if $crate::isa::v3() {
                // SAFETY: the CPU has every feature `v3` was compiled for (checked here).
                #[allow(unsafe_code)]
                return unsafe { v3($($arg),*) };
            }
        }
        #[inline(always)]
        fn base<$($g: $b),*>($($arg: $ty),*) -> $ret $body
        base($($arg),*)
    }};
}
pub(crate) use dispatch_v3;
