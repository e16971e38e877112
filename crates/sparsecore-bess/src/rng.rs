//! numpy's `default_rng(seed)`: SeedSequence, PCG64 (XSL-RR 128/64) and the three draw types
//! besskge uses (`integers(1 << 63)`, `integers(1 << 31)`, `permutation`), bit for bit
//! (`shared/bess/SPEC.md`, section 1).
//!
//! Why our own and not a crate: besskge's shardings and batches are a pure function of numpy's
//! stream, including two details no general-purpose PCG crate reproduces: SeedSequence's
//! hash-mixing of arbitrary-precision seeds, and the persistent half-word buffer that numpy's
//! 32-bit draws share with each other across calls (SPEC 1.4).

use sparsecore_prep::isa::{Baseline, V3};

/// Seed words of a non-negative integer: its little-endian base-2^32 digits, at least one
/// (SPEC 1.1). `0 → [0]`, `2^32 + 1 → [1, 1]`.
#[must_use]
pub fn seed_words(seed: u128) -> Vec<u32> {
    let mut words = Vec::new();
    let mut s = seed;
    loop {
        words.push(s as u32);
        s >>= 32;
        if s == 0 {
            break;
        }
    }
    words
}

const INIT_A: u32 = 0x43b0_d7e5;
const MULT_A: u32 = 0x931e_8875;
const INIT_B: u32 = 0x8b51_f9dd;
const MULT_B: u32 = 0x58f3_8ded;
const MIX_L: u32 = 0xca01_f9dd;
const MIX_R: u32 = 0x4973_f715;
const POOL: usize = 4;

/// numpy's `SeedSequence(entropy)` with no spawn key, reduced to what `PCG64` asks of it: four
/// u64 state words (SPEC 1.2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeedSequence {
    pool: [u32; POOL],
}

impl SeedSequence {
    /// Mixes the entropy words (little-endian base-2^32 digits of the seed; an empty slice is
    /// the seed 0).
    #[must_use]
    pub fn from_words(words: &[u32]) -> Self {
        let mut hc = INIT_A;
        let mut hashmix = |v: u32| -> u32 {
            let mut v = v ^ hc;
            hc = hc.wrapping_mul(MULT_A);
            v = v.wrapping_mul(hc);
            v ^ (v >> 16)
        };
        let mix = |x: u32, y: u32| -> u32 {
            let r = MIX_L.wrapping_mul(x).wrapping_sub(MIX_R.wrapping_mul(y));
            r ^ (r >> 16)
        };
        let mut pool = [0u32; POOL];
        for (i, p) in pool.iter_mut().enumerate() {
            *p = hashmix(words.get(i).copied().unwrap_or(0));
        }
        for src in 0..POOL {
            for dst in 0..POOL {
                if src != dst {
                    let h = hashmix(pool[src]);
                    pool[dst] = mix(pool[dst], h);
                }
            }
        }
        for &w in words.iter().skip(POOL) {
            for p in pool.iter_mut() {
                let h = hashmix(w);
                *p = mix(*p, h);
            }
        }
        SeedSequence { pool }
    }

    /// The first four u64 words of `generate_state` (what `PCG64` consumes).
    #[must_use]
    pub fn state_u64(&self) -> [u64; 4] {
        let mut hb = INIT_B;
        let mut out32 = [0u32; 8];
        for (i, o) in out32.iter_mut().enumerate() {
            let mut v = self.pool[i % POOL] ^ hb;
            hb = hb.wrapping_mul(MULT_B);
            v = v.wrapping_mul(hb);
            *o = v ^ (v >> 16);
        }
        std::array::from_fn(|j| u64::from(out32[2 * j]) | (u64::from(out32[2 * j + 1]) << 32))
    }
}

/// Outputs generated per [`Pcg64::fill_u64`] call by the bulk draws (a stack buffer).
const FILL_BLOCK: usize = 256;

/// The buffer of [`NumpyRng::fill_integers_31`]'s short runs.
const SMALL_FILL_BLOCK: usize = 64;

const PCG_MULT: u128 = 0x2360_ed05_1fc6_5da4_4385_df64_9fcc_f645;
/// `PCG_MULT` squared, cubed and to the fourth (mod 2^128): the multipliers of 2, 3 and 4
/// steps, constants so that a short [`Pcg64::fill_u64`] does not recompute them.
const PCG_MULT_2: u128 = PCG_MULT.wrapping_mul(PCG_MULT);
const PCG_MULT_3: u128 = PCG_MULT_2.wrapping_mul(PCG_MULT);
const PCG_MULT_4: u128 = PCG_MULT_2.wrapping_mul(PCG_MULT_2);

/// numpy's `PCG64` bit generator (XSL-RR 128/64), stepped before each output (SPEC 1.3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pcg64 {
    state: u128,
    inc: u128,
}

impl Pcg64 {
    /// Seeds from SeedSequence output.
    #[must_use]
    pub fn from_seed_state(s: [u64; 4]) -> Self {
        let initstate = (u128::from(s[0]) << 64) | u128::from(s[1]);
        let initseq = (u128::from(s[2]) << 64) | u128::from(s[3]);
        let inc = (initseq << 1) | 1;
        let mut state: u128 = 0;
        state = state.wrapping_mul(PCG_MULT).wrapping_add(inc);
        state = state.wrapping_add(initstate);
        state = state.wrapping_mul(PCG_MULT).wrapping_add(inc);
        Pcg64 { state, inc }
    }

    /// The next 64-bit output.
    #[inline(always)]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_mul(PCG_MULT).wrapping_add(self.inc);
        Self::output(self.state)
    }

    /// Fills `out` with the next `out.len()` outputs: exactly what as many calls of
    /// [`Self::next_u64`] return, and the same state afterwards.
    ///
    /// Why: one step is a 128-bit multiply-add on the previous state, a serial chain whose
    /// latency (not the multiplier's throughput) bounds a loop of `next_u64`. Four lanes each
    /// jump four steps at a time (`s[i+4] = s[i]·M⁴ + inc·(M³+M²+M+1)`, the same LCG), so four
    /// independent chains are in flight and the same sequence comes out faster.
    ///
    /// Where the CPU has AVX2 (and `SPARSECORE_PREP_ISA` allows it: [`V3::detect`]), eight
    /// lanes in AVX2 vectors make the same outputs.
    pub fn fill_u64(&mut self, out: &mut [u64]) {
        #[cfg(target_arch = "x86_64")]
        if let Some(v3) = V3::detect() {
            return v3.fill(self, out);
        }
        self.fill_u64_inline(out);
    }

    /// [`Self::fill_u64`], inlined into its caller: the negatives' draw loop, compiled a second
    /// time for x86-64-v3, then multiplies with `mulx` (a function that is not inlined keeps
    /// its baseline code).
    #[inline(always)]
    fn fill_u64_inline(&mut self, out: &mut [u64]) {
        let (m1, m2, m3, m4) = (PCG_MULT, PCG_MULT_2, PCG_MULT_3, PCG_MULT_4);
        let c1 = self.inc;
        let c2 = c1.wrapping_mul(m1).wrapping_add(c1);
        let c3 = c2.wrapping_mul(m1).wrapping_add(c1);
        let c4 = c3.wrapping_mul(m1).wrapping_add(c1);
        let s = self.state;
        let mut lanes = [
            s.wrapping_mul(m1).wrapping_add(c1),
            s.wrapping_mul(m2).wrapping_add(c2),
            s.wrapping_mul(m3).wrapping_add(c3),
            s.wrapping_mul(m4).wrapping_add(c4),
        ];
        let mut chunks = out.chunks_exact_mut(4);
        for chunk in &mut chunks {
            for (o, l) in chunk.iter_mut().zip(lanes.iter_mut()) {
                *o = Self::output(*l);
                self.state = *l;
                *l = l.wrapping_mul(m4).wrapping_add(c4);
            }
        }
        for o in chunks.into_remainder() {
            *o = self.next_u64();
        }
    }

    /// [`Self::fill_u64`] in AVX2 vectors: eight lanes, two vectors of four, each jumping
    /// eight steps at a time (see [`V3`]'s [`Fill`]).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    #[inline]
    fn fill_u64_avx2(&mut self, out: &mut [u64]) {
        use core::arch::x86_64::{_mm256_extract_epi64, _mm256_set_epi64x, _mm256_storeu_si256};
        // Setting the lanes up costs about a dozen outputs.
        if out.len() < 32 {
            return self.fill_u64_inline(out);
        }
        // The next eight states, and the jump of eight steps: `M^8` and `inc·(M^7 + … + 1)`.
        let mut next = [0u128; 8];
        let (mut s, mut c) = (self.state, 0u128);
        for n in &mut next {
            s = s.wrapping_mul(PCG_MULT).wrapping_add(self.inc);
            *n = s;
            c = c.wrapping_mul(PCG_MULT).wrapping_add(self.inc);
        }
        let step = avx2::Step::new(PCG_MULT_4.wrapping_mul(PCG_MULT_4), c);
        let lanes = |n: &[u128]| avx2::Lanes {
            hi: _mm256_set_epi64x(
                (n[3] >> 64) as i64,
                (n[2] >> 64) as i64,
                (n[1] >> 64) as i64,
                (n[0] >> 64) as i64,
            ),
            lo: _mm256_set_epi64x(n[3] as i64, n[2] as i64, n[1] as i64, n[0] as i64),
        };
        let (mut a, mut b) = (lanes(&next[..4]), lanes(&next[4..]));
        let mut last = b;
        let mut chunks = out.chunks_exact_mut(8);
        for chunk in &mut chunks {
            let (lo, hi) = chunk.split_at_mut(4);
            // SAFETY: each half of the chunk is four `u64`s, the 32 bytes an unaligned store
            // writes.
            #[allow(unsafe_code)]
            unsafe {
                _mm256_storeu_si256(lo.as_mut_ptr().cast(), avx2::output(a));
                _mm256_storeu_si256(hi.as_mut_ptr().cast(), avx2::output(b));
            }
            last = b;
            (a, b) = (step.apply(a), step.apply(b));
        }
        // The state of the last output made (at least one chunk was).
        self.state = (u128::from(_mm256_extract_epi64::<3>(last.hi) as u64) << 64)
            | u128::from(_mm256_extract_epi64::<3>(last.lo) as u64);
        for o in chunks.into_remainder() {
            *o = self.next_u64();
        }
    }

    #[inline(always)]
    fn output(state: u128) -> u64 {
        let x = ((state >> 64) as u64) ^ (state as u64);
        x.rotate_right((state >> 122) as u32)
    }

    /// The internal `(state, inc)`, for tests against numpy's `bit_generator.state`.
    #[must_use]
    pub fn state(&self) -> (u128, u128) {
        (self.state, self.inc)
    }
}

/// How [`NumpyRng::fill_integers_31_with`] makes its 64-bit outputs: the same outputs, by
/// [`Pcg64::fill_u64`]'s scalar lanes ([`Baseline`]) or by AVX2 vectors ([`V3`]); implemented
/// for the two values `sparsecore_prep::dispatch_v3!` hands its copies, so that the x86-64-v3
/// copy of a draw loop takes the AVX2 lanes.
pub(crate) trait Fill: Copy {
    /// Fills `out` as [`Pcg64::fill_u64`] does.
    fn fill(self, bits: &mut Pcg64, out: &mut [u64]);
}

/// [`Fill`] by [`Pcg64::fill_u64`]'s scalar lanes (inlined, so that they take their caller's
/// instruction set).
impl Fill for Baseline {
    #[inline(always)]
    fn fill(self, bits: &mut Pcg64, out: &mut [u64]) {
        bits.fill_u64_inline(out);
    }
}

/// [`Fill`] by eight lanes in AVX2 vectors, which a [`V3`] proves the CPU has (and
/// `SPARSECORE_PREP_ISA` allows).
///
/// Why: a scalar lane's 128-bit multiply-add takes three multiplies and the moves around
/// them; ten 32×32→64 vector multiplies make the same step for four lanes at once, in fewer
/// instructions per output, and AVX2's per-lane variable shifts make the output's rotation
/// one vector step.
#[cfg(target_arch = "x86_64")]
impl Fill for V3 {
    #[inline(always)]
    fn fill(self, bits: &mut Pcg64, out: &mut [u64]) {
        // SAFETY: a `V3` exists only where the CPU has AVX2 (`V3::detect` checked it).
        #[allow(unsafe_code)]
        unsafe {
            bits.fill_u64_avx2(out);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use core::arch::x86_64::{
        __m256i, _mm256_add_epi64, _mm256_and_si256, _mm256_blend_epi32, _mm256_cmpgt_epi64,
        _mm256_mul_epu32, _mm256_or_si256, _mm256_set1_epi64x, _mm256_slli_epi64,
        _mm256_sllv_epi64, _mm256_srli_epi64, _mm256_srlv_epi64, _mm256_sub_epi64,
        _mm256_xor_si256,
    };

    /// Four 128-bit generator states: their high and low words.
    #[derive(Clone, Copy)]
    pub(super) struct Lanes {
        pub(super) hi: __m256i,
        pub(super) lo: __m256i,
    }

    /// `s·m + c` (mod 2^128) per lane, for a multiplier `m` and an increment `c` shared by
    /// the lanes, from 32×32→64 multiplies.
    #[derive(Clone, Copy)]
    pub(super) struct Step {
        /// `m`'s 32-bit digits, low to high, each in every 64-bit lane.
        m: [__m256i; 4],
        c_hi: __m256i,
        c_lo: __m256i,
    }

    impl Step {
        #[target_feature(enable = "avx2")]
        pub(super) fn new(m: u128, c: u128) -> Self {
            let d = |i: u32| _mm256_set1_epi64x(((m >> (32 * i)) as u32).into());
            Step {
                m: [d(0), d(1), d(2), d(3)],
                c_hi: _mm256_set1_epi64x((c >> 64) as i64),
                c_lo: _mm256_set1_epi64x(c as i64),
            }
        }

        #[target_feature(enable = "avx2")]
        #[inline]
        pub(super) fn apply(&self, s: Lanes) -> Lanes {
            let [b0, b1, d0, d1] = self.m;
            let low = _mm256_set1_epi64x(0xffff_ffff);
            let (a1, e1) = (_mm256_srli_epi64::<32>(s.lo), _mm256_srli_epi64::<32>(s.hi));
            // The full product of the low words, `lo·m_lo`, from its four 32-bit partials.
            let (p00, p01, p10, p11) = (
                _mm256_mul_epu32(s.lo, b0),
                _mm256_mul_epu32(s.lo, b1),
                _mm256_mul_epu32(a1, b0),
                _mm256_mul_epu32(a1, b1),
            );
            let mid = _mm256_add_epi64(
                _mm256_add_epi64(_mm256_srli_epi64::<32>(p00), _mm256_and_si256(p01, low)),
                _mm256_and_si256(p10, low),
            );
            let lo = _mm256_blend_epi32::<0b1010_1010>(p00, _mm256_slli_epi64::<32>(mid));
            let hi = _mm256_add_epi64(
                _mm256_add_epi64(p11, _mm256_srli_epi64::<32>(p01)),
                _mm256_add_epi64(_mm256_srli_epi64::<32>(p10), _mm256_srli_epi64::<32>(mid)),
            );
            // The low 64 bits of the cross products `lo·m_hi` and `hi·m_lo`.
            let cross = |x: __m256i, x1: __m256i, y0: __m256i, y1: __m256i| {
                _mm256_add_epi64(
                    _mm256_mul_epu32(x, y0),
                    _mm256_slli_epi64::<32>(_mm256_add_epi64(
                        _mm256_mul_epu32(x, y1),
                        _mm256_mul_epu32(x1, y0),
                    )),
                )
            };
            let (x1, x2) = (cross(s.lo, a1, d0, d1), cross(s.hi, e1, b0, b1));
            let new_lo = _mm256_add_epi64(lo, self.c_lo);
            // All ones where the low add carried (`new_lo < lo` unsigned, as a signed compare
            // with the top bits flipped).
            let sign = _mm256_set1_epi64x(i64::MIN);
            let carry =
                _mm256_cmpgt_epi64(_mm256_xor_si256(lo, sign), _mm256_xor_si256(new_lo, sign));
            let new_hi = _mm256_sub_epi64(
                _mm256_add_epi64(_mm256_add_epi64(hi, x1), _mm256_add_epi64(x2, self.c_hi)),
                carry,
            );
            Lanes {
                hi: new_hi,
                lo: new_lo,
            }
        }
    }

    /// [`super::Pcg64`]'s output of each lane: `(hi ^ lo)` rotated right by `hi >> 58`.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn output(s: Lanes) -> __m256i {
        let x = _mm256_xor_si256(s.hi, s.lo);
        let r = _mm256_srli_epi64::<58>(s.hi);
        // A left shift by 64 (r = 0) gives 0, as the rotation needs.
        _mm256_or_si256(
            _mm256_srlv_epi64(x, r),
            _mm256_sllv_epi64(x, _mm256_sub_epi64(_mm256_set1_epi64x(64), r)),
        )
    }
}

/// numpy's `Generator(PCG64(SeedSequence(seed)))`, i.e. `np.random.default_rng(seed)`, with
/// the draws besskge makes. Each random component (sharding, batch sampler, negative sampler)
/// owns one, seeded independently (SPEC 6.3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumpyRng {
    bits: Pcg64,
    /// The high half of a 64-bit output not yet handed out by [`NumpyRng::next_u32`]. It
    /// persists across calls and steps (SPEC 1.4).
    half: Option<u32>,
}

impl NumpyRng {
    /// `default_rng(seed)` from the seed's little-endian 32-bit words ([`seed_words`]).
    #[must_use]
    pub fn from_words(words: &[u32]) -> Self {
        NumpyRng {
            bits: Pcg64::from_seed_state(SeedSequence::from_words(words).state_u64()),
            half: None,
        }
    }

    /// `default_rng(seed)` for a seed below 2^128.
    #[must_use]
    pub fn new(seed: u128) -> Self {
        Self::from_words(&seed_words(seed))
    }

    /// The next raw 64-bit value (does not touch the 32-bit buffer).
    pub fn next_u64(&mut self) -> u64 {
        self.bits.next_u64()
    }

    /// The next raw 32-bit value: the buffered high half if there is one, else the low half
    /// of a new 64-bit value (buffering its high half).
    pub fn next_u32(&mut self) -> u32 {
        if let Some(h) = self.half.take() {
            return h;
        }
        let v = self.bits.next_u64();
        self.half = Some((v >> 32) as u32);
        v as u32
    }

    /// `integers(1 << 63)`: a uniform value in `[0, 2^63)`.
    pub fn integers_63(&mut self) -> u64 {
        self.next_u64() >> 1
    }

    /// `integers(1 << 31)`: a uniform value in `[0, 2^31)`.
    pub fn integers_31(&mut self) -> u32 {
        self.next_u32() >> 1
    }

    /// The raw 64-bit outputs of `out.len()` [`Self::integers_63`] draws (each draw is its
    /// output shifted right by one), made by `gen` straight into `out` (inlined, so that it
    /// takes its caller's instruction set).
    #[inline(always)]
    pub(crate) fn fill_raw_63_with<G: Fill>(&mut self, gen: G, out: &mut [u64]) {
        gen.fill(&mut self.bits, out);
    }

    /// `out[i] = f(integers(1 << 63))` for every `i`, in order: the draws of as many
    /// [`Self::integers_63`] calls, generated by [`Pcg64::fill_u64`].
    pub fn fill_integers_63<T>(&mut self, out: &mut [T], mut f: impl FnMut(u64) -> T) {
        let mut buf = [0u64; FILL_BLOCK];
        for chunk in out.chunks_mut(FILL_BLOCK) {
            let raw = &mut buf[..chunk.len()];
            self.bits.fill_u64(raw);
            for (o, &v) in chunk.iter_mut().zip(raw.iter()) {
                *o = f(v >> 1);
            }
        }
    }

    /// `out[i] = f(integers(1 << 31))` for every `i`, in order: the draws of as many
    /// [`Self::integers_31`] calls, including the half-word buffer they share (SPEC 1.4), the
    /// 64-bit outputs generated by [`Pcg64::fill_u64`].
    #[inline(always)]
    pub fn fill_integers_31<T>(&mut self, out: &mut [T], f: impl FnMut(u32) -> T) {
        self.fill_integers_31_with(Baseline, out, f);
    }

    /// [`Self::fill_integers_31`] with the 64-bit outputs made by `gen` (the same outputs
    /// either way).
    #[inline(always)]
    pub(crate) fn fill_integers_31_with<T, G: Fill>(
        &mut self,
        gen: G,
        out: &mut [T],
        mut f: impl FnMut(u32) -> T,
    ) {
        let mut rest = out;
        if let (Some(first), Some(h)) = (rest.first_mut(), self.half) {
            *first = f(h >> 1);
            self.half = None;
            rest = &mut rest[1..];
        }
        // Two draws per 64-bit output, low half first. Large runs go through a block-sized
        // buffer, the rest through a small one: callers fill many short runs (a few negatives
        // per block), and zeroing the large buffer would cost more than drawing them. The
        // draws are split into their 31-bit values first, so that `f` runs over a plain slice
        // (a loop the compiler vectorizes when `f` is arithmetic).
        // A function rather than a closure, so that it can be inlined by force (see
        // `Pcg64::fill_u64_inline`).
        #[inline(always)]
        fn pairs<T, G: Fill>(
            gen: G,
            bits: &mut Pcg64,
            f: &mut impl FnMut(u32) -> T,
            run: &mut [T],
            buf: &mut [u64],
            draws: &mut [u32],
        ) {
            let k = run.len() / 2;
            gen.fill(bits, &mut buf[..k]);
            for (d, &v) in draws.chunks_exact_mut(2).zip(&buf[..k]) {
                d[0] = (v as u32) >> 1;
                d[1] = ((v >> 32) as u32) >> 1;
            }
            for (o, &x) in run.iter_mut().zip(&draws[..2 * k]) {
                *o = f(x);
            }
        }
        let mut large = rest.chunks_exact_mut(2 * FILL_BLOCK);
        if large.len() > 0 {
            let (mut buf, mut draws) = ([0u64; FILL_BLOCK], [0u32; 2 * FILL_BLOCK]);
            for chunk in &mut large {
                pairs(gen, &mut self.bits, &mut f, chunk, &mut buf, &mut draws);
            }
        }
        let (mut small_buf, mut small_draws) =
            ([0u64; SMALL_FILL_BLOCK], [0u32; 2 * SMALL_FILL_BLOCK]);
        let mut small = large.into_remainder().chunks_mut(2 * SMALL_FILL_BLOCK);
        let mut tail: &mut [T] = &mut [];
        for chunk in &mut small {
            pairs(
                gen,
                &mut self.bits,
                &mut f,
                chunk,
                &mut small_buf,
                &mut small_draws,
            );
            tail = chunk;
        }
        if tail.len() % 2 == 1 {
            let v = self.next_u32();
            tail[tail.len() - 1] = f(v >> 1);
        }
    }

    /// numpy's `random_interval(max)`: a uniform value in `[0, max]` by masked rejection.
    pub fn bounded(&mut self, max: u64) -> u64 {
        if max == 0 {
            return 0;
        }
        let mut mask = max;
        for s in [1, 2, 4, 8, 16, 32] {
            mask |= mask >> s;
        }
        if max <= u64::from(u32::MAX) {
            let mask = mask as u32;
            loop {
                let v = self.next_u32() & mask;
                if u64::from(v) <= max {
                    return u64::from(v);
                }
            }
        }
        loop {
            let v = self.next_u64() & mask;
            if v <= max {
                return v;
            }
        }
    }

    /// `permutation(m)`: Fisher-Yates from the top index down over `0..m`.
    pub fn permutation(&mut self, m: usize) -> Vec<usize> {
        let mut a: Vec<usize> = (0..m).collect();
        for i in (1..m).rev() {
            let j = self.bounded(i as u64) as usize;
            a.swap(i, j);
        }
        a
    }
}

/// Exact `x mod d` by multiplication (Lemire, Kaser and Kurz, "Faster remainder by direct
/// computation", 2019) for a divisor fixed across many draws: besskge reduces every draw modulo
/// a partition's or shard's size, and a hardware division costs more than the draw itself.
/// Exact for every 64-bit `x` and every `d` in `1 ..= 2^32` (the multiplier has 128 ≥ 64 + 32
/// bits); larger divisors fall back to a division.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FastMod {
    d: u64,
    m: u128,
    /// Lemire's 64-bit multiplier for 32-bit numerators (exact for `d < 2^32`), 0 if unused.
    m32: u64,
    /// [`Self::reduce_u31`]'s multiplier, shift and divisor.
    m31: u32,
    s31: u32,
    d31: u32,
    /// [`Self::reduce_u63`]'s multiplier, shift (of the high word) and divisor.
    m63: u64,
    s63: u32,
    d63: u64,
}

impl FastMod {
    /// The reducer for divisor `d` (0 gives 0, numpy's `x % 0`).
    #[must_use]
    pub fn new(d: u64) -> Self {
        let m = if d <= 1 || d > 1 << 32 {
            0
        } else {
            u128::MAX / u128::from(d) + 1
        };
        let m32 = if d <= 1 || d >= 1 << 32 {
            0
        } else {
            u64::MAX / d + 1
        };
        // `x − ⌊x·m31 / 2^s31⌋·d31`: for d = 0 the quotient is x and d31 = 1 (so 0), for d
        // beyond 2^32 it is 0 (x < d).
        let (m31, s31, d31) = match d {
            0 => (1 << 31, 31, 1),
            1..=0xffff_ffff => {
                let l = u64::BITS - (d - 1).leading_zeros();
                let m = (1u128 << (31 + l)).div_ceil(u128::from(d));
                (u32::try_from(m).unwrap_or(u32::MAX), 31 + l, d as u32)
            }
            _ => (0, 0, 0),
        };
        // The same for 63-bit numerators, with 64-bit multipliers: every `d` fits (l ≤ 64).
        // Stored is the shift of the product's high word, `l` (see `reduce_u63`); beyond 2^63
        // (l = 64) every x < 2^63 is below d, and the multiplier 0 gives the quotient 0.
        let (m63, s63, d63) = if d == 0 {
            (1 << 63, 0, 1)
        } else {
            let l = u64::BITS - (d - 1).leading_zeros();
            let m = (1u128 << (63 + l)).div_ceil(u128::from(d));
            if l == 64 {
                (0, 0, d)
            } else {
                (u64::try_from(m).unwrap_or(u64::MAX), l, d)
            }
        };
        FastMod {
            d,
            m,
            m32,
            m31,
            s31,
            d31,
            m63,
            s63,
            d63,
        }
    }

    /// `x mod d`.
    #[inline]
    #[must_use]
    pub fn reduce(&self, x: u64) -> u64 {
        if self.m == 0 {
            return if self.d > 1 { x % self.d } else { 0 };
        }
        let low = self.m.wrapping_mul(u128::from(x));
        let d = u128::from(self.d);
        // (low * d) >> 128, with low = hi * 2^64 + lo.
        (((low >> 64) * d + (((low as u64) as u128 * d) >> 64)) >> 64) as u64
    }

    /// `x mod d` for a 32-bit `x`: the same value as [`Self::reduce`], with half the
    /// multiplies (the 31-bit negative draws).
    #[inline]
    #[must_use]
    pub fn reduce_u32(&self, x: u32) -> u64 {
        if self.m32 == 0 {
            return self.reduce(u64::from(x));
        }
        ((u128::from(self.m32.wrapping_mul(u64::from(x))) * u128::from(self.d)) >> 64) as u64
    }

    /// `x mod d` for `x < 2^31` (numpy's 31-bit draws), as `u32` (`d < 2^32`, else `x`):
    /// the same value as [`Self::reduce`].
    ///
    /// Why: with `l = ⌈log2 d⌉` and `m = ⌈2^(31+l) / d⌉ < 2^32`, `⌊x·m / 2^(31+l)⌋ = ⌊x / d⌋` for
    /// every `x < 2^31` (Granlund and Montgomery: the error `x·(m·d − 2^(31+l)) / (d·2^(31+l))`
    /// stays below `1/d`). That is one 32×32→64 multiply, a shift and a 32-bit multiply with
    /// no branch, which the compiler vectorizes over a run of draws, where
    /// [`Self::reduce_u32`] needs a 64×64→128 multiply per value.
    #[inline(always)]
    #[must_use]
    pub fn reduce_u31(&self, x: u32) -> u32 {
        debug_assert!(x < 1 << 31);
        let q = ((u64::from(x) * u64::from(self.m31)) >> self.s31) as u32;
        x.wrapping_sub(q.wrapping_mul(self.d31))
    }

    /// `x mod d` for `x < 2^63` (numpy's 63-bit draws, positions, counts): the same value as
    /// [`Self::reduce`], for every `d`, with one 64×64→128 multiply and one 64-bit multiply
    /// where [`Self::reduce`] needs four (the argument of [`Self::reduce_u31`], with
    /// `m = ⌈2^(63+l) / d⌉ < 2^64`). The quotient `⌊x·m / 2^(63+l)⌋` is taken as
    /// `⌊2x·m / 2^(64+l)⌋`: the high word of one 64×64 multiply shifted by `l < 64`, where a
    /// 128-bit shift by a variable count costs several instructions.
    #[inline]
    #[must_use]
    pub fn reduce_u63(&self, x: u64) -> u64 {
        debug_assert!(x < 1 << 63);
        let q = (((u128::from(x << 1) * u128::from(self.m63)) >> 64) as u64) >> self.s63;
        x.wrapping_sub(q.wrapping_mul(self.d63))
    }

    /// [`Self::reduce_u63`]'s constants alone, for callers that keep many divisors in a
    /// compact table: 24 of this struct's 64 bytes.
    #[must_use]
    pub(crate) fn u63(&self) -> Mod63 {
        Mod63 {
            m: self.m63,
            s: self.s63,
            d: self.d63,
        }
    }
}

/// [`FastMod::reduce_u63`] for one divisor `d`, and nothing else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mod63 {
    m: u64,
    s: u32,
    d: u64,
}

impl Mod63 {
    /// `x mod d` for `x < 2^63`: [`FastMod::reduce_u63`].
    #[inline(always)]
    pub(crate) fn reduce(self, x: u64) -> u64 {
        let q = (((u128::from(x << 1) * u128::from(self.m)) >> 64) as u64) >> self.s;
        x.wrapping_sub(q.wrapping_mul(self.d))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_sequence_matches_the_worked_examples() {
        assert_eq!(
            SeedSequence::from_words(&[1234]).state_u64(),
            [
                0x5f83044cad3f26a6,
                0xa0d9b3700cea3a6f,
                0xa8647d8b1e3e7527,
                0x687a8e7300372192
            ]
        );
        assert_eq!(
            SeedSequence::from_words(&[0]).state_u64(),
            [
                0xdb2cd7e7b0f478be,
                0xabf4641a2c71ba49,
                0x20c6ed6d9d7b8d41,
                0x2c4099de223c39d4
            ]
        );
    }

    #[test]
    fn pcg64_matches_the_worked_examples() {
        let mut g = Pcg64::from_seed_state(SeedSequence::from_words(&[1234]).state_u64());
        assert_eq!(
            g.state(),
            (
                0x160ad84006fe21eaf69b873d9fe45409,
                0x50c8fb163c7cea4ed0f51ce6006e4325
            )
        );
        assert_eq!(
            [g.next_u64(), g.next_u64(), g.next_u64()],
            [0xfa08fef3fab6bbba, 0x615481f7fce9ac81, 0xec59dd7c2bde3cb4]
        );
        let mut g = NumpyRng::new(0);
        assert_eq!(
            [g.next_u64(), g.next_u64(), g.next_u64()],
            [0xa30febcfd9c2825f, 0x4510bdf882d9d721, 0x0a7d3da94ecde8b8]
        );
    }

    #[test]
    fn draws_match_numpy() {
        let mut g = NumpyRng::new(1234);
        let v: Vec<u64> = (0..4).map(|_| g.integers_63()).collect();
        assert_eq!(
            v,
            [
                9008465316566228445,
                3506686710911391296,
                8515443495629954650,
                2413686584519761735
            ]
        );
        let mut g = NumpyRng::new(1234);
        let v: Vec<u32> = (0..5).map(|_| g.integers_31()).collect();
        assert_eq!(
            v,
            [2103139805, 2097446777, 2121586240, 816464123, 367992410]
        );
        assert_eq!(
            NumpyRng::new(1234).permutation(12),
            [0, 9, 11, 5, 6, 2, 8, 4, 7, 1, 3, 10]
        );
        let mut g = NumpyRng::new(7);
        let v: Vec<u32> = (0..4).map(|_| g.integers_31()).collect();
        assert_eq!(v, [2029167941, 1342382292, 1469265226, 1926751966]);
    }

    #[test]
    fn fast_mod_is_exact() {
        let mut g = NumpyRng::new(99);
        let mut divisors: Vec<u64> = (0..=70)
            .chain([
                255,
                256,
                257,
                1000,
                65535,
                65536,
                65537,
                (1 << 31) - 1,
                1 << 31,
                (1 << 32) - 1,
                1 << 32,
                (1 << 32) + 1,
                u64::MAX,
            ])
            .chain([
                (1 << 62) + 1,
                (1 << 63) - 1,
                1 << 63,
                (1 << 63) + 1,
                u64::MAX - 1,
            ])
            .collect();
        divisors.extend((0..200).map(|_| g.next_u64() >> (g.next_u64() % 40 + 24)));
        for d in divisors {
            let f = FastMod::new(d);
            let mut xs = vec![
                0,
                1,
                d.wrapping_sub(1),
                d,
                d.wrapping_add(1),
                u64::MAX,
                u64::MAX - 1,
                (1 << 63) - 1,
                1 << 63,
            ];
            xs.extend((0..2000).map(|_| g.next_u64()));
            xs.extend((0..2000).map(|_| g.next_u64() >> 1));
            xs.extend((0..2000).map(|_| u64::from(g.next_u32())));
            for x in xs {
                let want = if d == 0 { 0 } else { x % d };
                assert_eq!(f.reduce(x), want, "{x} mod {d}");
                if x < 1 << 63 {
                    assert_eq!(f.reduce_u63(x), want, "{x} mod {d} (63 bits)");
                    assert_eq!(f.u63().reduce(x), want, "{x} mod {d} (63 bits, compact)");
                }
            }
            for x in [(1 << 63) - 1, (1 << 63) - 2, (1 << 62) + 1] {
                assert_eq!(
                    f.reduce_u63(x),
                    if d == 0 { 0 } else { x % d },
                    "{x} mod {d} (63 bits)"
                );
            }
        }
    }

    #[test]
    fn bulk_draws_equal_single_draws() {
        for len in [
            0usize, 1, 2, 3, 4, 5, 7, 8, 255, 256, 257, 511, 512, 513, 1000,
        ] {
            let (mut a, mut b) = (
                Pcg64::from_seed_state(SeedSequence::from_words(&[3]).state_u64()),
                Pcg64::from_seed_state(SeedSequence::from_words(&[3]).state_u64()),
            );
            let mut out = vec![0u64; len];
            a.fill_u64(&mut out);
            let want: Vec<u64> = (0..len).map(|_| b.next_u64()).collect();
            assert_eq!(out, want);
            assert_eq!(a.state(), b.state());
            // The scalar lanes alone (`fill_u64` takes the AVX2 lanes where the CPU has them).
            Baseline.fill(&mut a, &mut out);
            let want: Vec<u64> = (0..len).map(|_| b.next_u64()).collect();
            assert_eq!(out, want);
            assert_eq!(a.state(), b.state());
            // 31-bit draws, starting with and without a buffered half word, then interleaved
            // with single draws.
            for pre in [0usize, 1] {
                let (mut a, mut b) = (NumpyRng::new(11), NumpyRng::new(11));
                for _ in 0..pre {
                    assert_eq!(a.integers_31(), b.integers_31());
                }
                let mut out = vec![0u32; len];
                a.fill_integers_31(&mut out, |v| v);
                let want: Vec<u32> = (0..len).map(|_| b.integers_31()).collect();
                assert_eq!(out, want, "len {len}, pre {pre}");
                assert_eq!(
                    [a.integers_31(), a.integers_31(), a.integers_31()],
                    [b.integers_31(), b.integers_31(), b.integers_31()]
                );
                let mut out = vec![0u64; len];
                a.fill_integers_63(&mut out, |v| v);
                let want: Vec<u64> = (0..len).map(|_| b.integers_63()).collect();
                assert_eq!(out, want);
                assert_eq!(a.integers_31(), b.integers_31());
            }
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn avx2_draws_equal_single_draws() {
        let Some(v3) = V3::detect() else { return };
        for seed in [0u32, 3, 1234] {
            for len in [0usize, 1, 7, 31, 32, 33, 39, 40, 64, 100, 255, 256, 1000] {
                let (mut a, mut b) = (
                    Pcg64::from_seed_state(SeedSequence::from_words(&[seed]).state_u64()),
                    Pcg64::from_seed_state(SeedSequence::from_words(&[seed]).state_u64()),
                );
                let mut out = vec![0u64; len];
                v3.fill(&mut a, &mut out);
                let want: Vec<u64> = (0..len).map(|_| b.next_u64()).collect();
                assert_eq!(out, want, "seed {seed}, len {len}");
                assert_eq!(a.state(), b.state());
            }
        }
    }

    #[test]
    fn fast_mod_u32_is_exact() {
        let mut g = NumpyRng::new(5);
        let mut divisors: Vec<u64> = (0..=70)
            .chain([
                255,
                256,
                257,
                1000,
                65535,
                65536,
                65537,
                (1 << 31) - 1,
                1 << 31,
                (1 << 32) - 1,
                1 << 32,
            ])
            .collect();
        divisors.extend((0..200).map(|_| g.next_u64() >> (g.next_u64() % 32 + 32)));
        divisors.extend([
            (1 << 30) + 1,
            (1 << 31) + 1,
            (1 << 32) - 2,
            3 << 30,
            u64::MAX,
        ]);
        for d in divisors {
            let f = FastMod::new(d);
            let mut xs = vec![
                0,
                1,
                u32::MAX,
                u32::MAX - 1,
                (1 << 31) - 1,
                1 << 31,
                d as u32,
                (d as u32).wrapping_sub(1),
            ];
            xs.extend((0..3000).map(|_| g.next_u32()));
            for &x in &xs {
                assert_eq!(
                    f.reduce_u32(x),
                    if d == 0 { 0 } else { u64::from(x) % d },
                    "{x} mod {d}"
                );
            }
            for x in xs
                .into_iter()
                .map(|x| x >> 1)
                .chain([(1 << 31) - 1, (1 << 31) - 2])
            {
                assert_eq!(
                    u64::from(f.reduce_u31(x)),
                    if d == 0 { 0 } else { u64::from(x) % d },
                    "{x} mod {d} (31 bits)"
                );
            }
        }
    }

    #[test]
    fn seed_words_are_little_endian_digits() {
        assert_eq!(seed_words(0), [0]);
        assert_eq!(seed_words(1234), [1234]);
        assert_eq!(seed_words((1 << 32) + 1), [1, 1]);
        assert_eq!(seed_words(u64::MAX as u128), [u32::MAX, u32::MAX]);
    }
}
