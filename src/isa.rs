//! Runtime choice of instruction set for the hot loops.
//!
//! The crate is built for the baseline x86-64 (SSE2), so that one binary or wheel runs on any
//! x86-64 machine. The hot loops where v3 pays are also compiled a second time for x86-64-v3
//! (AVX2, BMI1/2, FMA, LZCNT, POPCNT; every x86 server CPU since 2013-2015) and picked at run
//! time, per call, from the CPU's feature flags (one cached load), all through
//! [`dispatch_v3!`](crate::dispatch_v3): here the radix sort and the split (`group::sort`), the
//! ragged extraction (`extract`) and balancing's bitmap of seen columns (`balance::count`); in
//! the BESS crate its PCG64 draws and row copies. Wider vectors serve the key arithmetic, and
//! shifts by a register count (BMI2) free the count register in the scatter loops
//! (BENCHMARKS.md has the measurements).
//!
//! Both versions run the same source, so their outputs are the same bytes: the vector forms
//! compute the same integer arithmetic, and no floating-point reduction is reordered (gains
//! are summed in the walk, which is not duplicated).
//!
//! Public for the side crates: [`dispatch_v3!`](crate::dispatch_v3) holds the crate's one
//! `unsafe` call of a copy compiled for more features than the build's, behind the run-time
//! check, and [`V3`] lets code that needs the features (AVX2 intrinsics) prove the check was
//! made.

/// Proof that the x86-64-v3 code may run: the CPU has AVX2, BMI1, BMI2, FMA, LZCNT and
/// POPCNT, and the environment variable `SPARSECORE_PREP_ISA` is not `baseline` (which forces
/// the baseline code, to compare the two or to rule one out; read once per process).
///
/// A value exists only where [`V3::detect`] found all of that, so code holding one may call
/// functions compiled for those features. [`dispatch_v3!`](crate::dispatch_v3) hands one to
/// the body of its x86-64-v3 copy (and a [`Baseline`] to its baseline copy).
#[derive(Debug, Clone, Copy)]
pub struct V3(());

impl V3 {
    /// A [`V3`] if the x86-64-v3 code may run (one cached load after the first call).
    #[inline(always)]
    #[must_use]
    pub fn detect() -> Option<V3> {
        chosen().then_some(V3(()))
    }
}

/// What the baseline copy of [`dispatch_v3!`](crate::dispatch_v3) hands its body where the
/// x86-64-v3 copy hands a [`V3`]: no features beyond the build's.
#[derive(Debug, Clone, Copy, Default)]
pub struct Baseline;

/// Whether the x86-64-v3 versions run (see [`V3`]).
#[inline(always)]
fn chosen() -> bool {
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

/// Evaluates a body through a copy of it compiled for x86-64-v3 where the CPU has it
/// ([`isa::V3::detect`](crate::isa::V3::detect)), else through a baseline copy.
///
/// The body is written once, as a function of the listed arguments and of the generic
/// parameters in `<…>` (one bound each there, left out when there are none; more bounds go in
/// a `where` clause after the return type):
///
/// ```
/// /// The sum of `xs`, in the x86-64-v3 copy where the CPU has it.
/// fn sum<T: Into<u64>>(xs: &[T]) -> u64
/// where
///     T: Copy,
/// {
///     sparsecore_prep::dispatch_v3!(<T: Into<u64>> (xs: &[T]) -> u64 where T: Copy {
///         xs.iter().map(|&x| x.into()).sum()
///     })
/// }
/// assert_eq!(sum(&[1u32, 2, 3]), 6);
/// ```
///
/// With `|isa|` before the body, `isa` is bound in it to an [`isa::V3`](crate::isa::V3) in the
/// x86-64-v3 copy and to an [`isa::Baseline`](crate::isa::Baseline) in the baseline one, so
/// that the body can pick, through a trait of the caller's implemented for both, code that
/// needs the features (AVX2 intrinsics) in one copy and portable code in the other:
///
/// ```
/// use sparsecore_prep::isa::{Baseline, V3};
///
/// trait Lanes {
///     fn name(self) -> &'static str;
/// }
/// impl Lanes for V3 {
///     fn name(self) -> &'static str {
///         "v3"
///     }
/// }
/// impl Lanes for Baseline {
///     fn name(self) -> &'static str {
///         "baseline"
///     }
/// }
///
/// let name = sparsecore_prep::dispatch_v3!(() -> &'static str |isa| { isa.name() });
/// assert_eq!(name == "v3", V3::detect().is_some());
/// ```
///
/// The copies are functions nested in the expansion, so the body sees only its arguments (no
/// local of the caller's), and `return` in it leaves the copy. Whatever the body calls must be
/// `#[inline(always)]` (or small enough to be inlined) for the x86-64-v3 copy to reach it: a
/// function that is not inlined keeps its baseline code.
#[macro_export]
macro_rules! dispatch_v3 {
    (
        $(<$($g:ident : $b:path),* $(,)?>)?
        ($($arg:ident : $ty:ty),* $(,)?) -> $ret:ty
        $(where $($w:ident : $wb:path),+ $(,)?)?
        |$isa:ident| $body:block
    ) => {{
        // The copies take the caller's arguments (whose number is the caller's to judge), and
        // `isa`.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,bmi1,bmi2,fma,lzcnt,popcnt")]
        #[allow(clippy::too_many_arguments)]
        fn v3<$($($g: $b),*)?>($isa: $crate::isa::V3, $($arg: $ty),*) -> $ret
        $(where $($w: $wb),+)?
        $body
        #[inline(always)]
        #[allow(clippy::too_many_arguments)]
        fn base<$($($g: $b),*)?>($isa: $crate::isa::Baseline, $($arg: $ty),*) -> $ret
        $(where $($w: $wb),+)?
        $body
        #[inline(always)]
        #[allow(clippy::too_many_arguments)]
        fn dispatch<$($($g: $b),*)?>($($arg: $ty),*) -> $ret
        $(where $($w: $wb),+)?
        {
            #[cfg(target_arch = "x86_64")]
            if let Some(isa) = $crate::isa::V3::detect() {
                // SAFETY: the CPU has every feature `v3` is compiled for (`V3::detect` checked
                // them).
                #[allow(unsafe_code)]
                return unsafe { v3(isa, $($arg),*) };
            }
            base($crate::isa::Baseline, $($arg),*)
        }
        dispatch($($arg),*)
    }};
    (
        $(<$($g:ident : $b:path),* $(,)?>)?
        ($($arg:ident : $ty:ty),* $(,)?) -> $ret:ty
        $(where $($w:ident : $wb:path),+ $(,)?)?
        $body:block
    ) => {
        $crate::dispatch_v3!(
            $(<$($g: $b),*>)? ($($arg: $ty),*) -> $ret $(where $($w: $wb),+)? |_isa| $body
        )
    };
}
