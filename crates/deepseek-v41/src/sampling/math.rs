//! The arithmetic of the sampling algorithm ([`super`]), written once here and mirrored
//! operation for operation by `kernels/sampling.cu`: the counter-based random bits (SplitMix64),
//! the logits' order key, and the `exp` / `ln` the draw and the nucleus mass use.
//!
//! Every float operation below is one IEEE-754 binary32 add, subtract, multiply or divide in round
//! to nearest, a `floor`, or an exact conversion, in a fixed order; the constants are given by
//! their bits. Rust never contracts `a * b + c` into a fused multiply-add, and the kernel spells
//! every operation as an `__f*_rn` intrinsic, which nvcc never contracts either, so both sides
//! compute the same bits — where a library `expf` / `logf` (the platform's libm on the host,
//! CUDA's on the device) may differ by an ulp. The polynomials are the textbook series (Taylor
//! for `exp`, the `atanh` series for `ln`), accurate to a few ulps, which is all sampling needs:
//! the point is that both devices agree, not that the last bit is correctly rounded.

/// An upper bound of every Gumbel value [`gumbel`] returns (at most `33 ln 2 ≈ 22.9`): an element
/// whose scaled logit is below the best score minus this bound cannot win the draw.
pub(crate) const GUMBEL_BOUND: f32 = 24.0;

/// Scaled logits below this have no nucleus mass: `exp(-28) · 2^40 < 1` ([`mass`]).
pub(crate) const MASS_CUTOFF: f32 = -28.0;

/// Fraction bits of the fixed-point nucleus mass ([`mass`]): the largest element weighs `2^40`.
pub(crate) const MASS_FRACTION_BITS: i32 = 40;

/// SplitMix64's increment (the golden ratio in 64 bits).
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;
/// Mixed into the seed so that seed 0 does not start the stream at SplitMix64's state 0 (the
/// first 64 bits of π's fraction).
const SEED_SALT: u64 = 0x243f_6a88_85a3_08d3;

const LN2_HI: f32 = f32::from_bits(0x3f31_7200); // 0.693145751953125, 15 significant bits
const LN2_LO: f32 = f32::from_bits(0x35bf_be8e); // ln 2 − LN2_HI
const LOG2E: f32 = f32::from_bits(0x3fb8_aa3b);
const SQRT2_BITS: u32 = 0x3fb5_04f3;
// 2 atanh(s) = 2 s + 2/3 s³ + 2/5 s⁵ + 2/7 s⁷ + 2/9 s⁹ (|s| <= 0.172: next term < 4e-10 of s).
const C3: f32 = f32::from_bits(0x3f2a_aaab);
const C5: f32 = f32::from_bits(0x3ecc_cccd);
const C7: f32 = f32::from_bits(0x3e92_4925);
const C9: f32 = f32::from_bits(0x3e63_8e39);
// exp(r) = Σ r^n / n!, n <= 7 (|r| <= 0.35: next term < 1e-8).
const E3: f32 = f32::from_bits(0x3e2a_aaab);
const E4: f32 = f32::from_bits(0x3d2a_aaab);
const E5: f32 = f32::from_bits(0x3c08_8889);
const E6: f32 = f32::from_bits(0x3ab6_0b61);
const E7: f32 = f32::from_bits(0x3950_0d01);
/// 2^-33.
const TWO_M33: f32 = f32::from_bits((127 - 33) << 23);
/// 2^40.
const TWO_40: f32 = f32::from_bits((127 + MASS_FRACTION_BITS as u32) << 23);

/// SplitMix64's output function (Steele, Lea, Flood, "Fast splittable pseudorandom number
/// generators", OOPSLA 2014; the variant-13 constants of Stafford's mixers).
pub(crate) fn mix64(z: u64) -> u64 {
    let z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The state from which draw `step` of a sequence seeded `seed` takes its random bits.
pub(crate) fn row_stream(seed: u64, step: u64) -> u64 {
    mix64(mix64(seed ^ SEED_SALT).wrapping_add(step))
}

/// The 32 random bits of element `i`: the high half of SplitMix64's `i`-th output from `stream`.
pub(crate) fn element_bits(stream: u64, i: u32) -> u32 {
    (mix64(stream.wrapping_add((i as u64 + 1).wrapping_mul(GAMMA))) >> 32) as u32
}

/// `2 atanh(s) = ln((1 + s) / (1 − s))` for `|s| <= 1/7`.
fn atanh2(s: f32) -> f32 {
    let z = s * s;
    let mut p = C9;
    p = C7 + z * p;
    p = C5 + z * p;
    p = C3 + z * p;
    p = 2.0 + z * p;
    s * p
}

/// `ln(x)` for a positive normal `x`: `x = 2^e · m` with `m` in `[√½, √2)`, `ln m = 2 atanh((m − 1)
/// / (m + 1))`, `e ln 2` in two parts (`e · LN2_HI` is exact).
pub(crate) fn ln_pos(x: f32) -> f32 {
    let b = x.to_bits();
    let mut e = (b >> 23) as i32 - 127;
    let mut mb = (b & 0x007f_ffff) | 0x3f80_0000;
    if mb > SQRT2_BITS {
        mb -= 0x0080_0000;
        e += 1;
    }
    let m = f32::from_bits(mb);
    let s = (m - 1.0) / (m + 1.0);
    let ef = e as f32;
    ef * LN2_HI + (ef * LN2_LO + atanh2(s))
}

/// An Exp(1) variate `−ln u` from 32 random bits: `u = (2h + 1) · 2^-33` in `(0, 1)`. For `u <
/// 0.75` the logarithm of `u` itself; above, `−ln(1 − v) = 2 atanh(v / (2 − v))` of `v = 1 − u`
/// (exact from the integers), so values near 0 keep their relative precision. In `[2^-33, 22.9]`.
pub(crate) fn exponential(h: u32) -> f32 {
    if h < 0xc000_0000 {
        let u = ((2 * h as u64 + 1) as f32) * TWO_M33;
        -ln_pos(u)
    } else {
        let v = (((1u64 << 33) - 2 * h as u64 - 1) as f32) * TWO_M33;
        atanh2(v / (2.0 - v))
    }
}

/// A standard Gumbel variate `−ln(−ln u)` from 32 random bits, in `[−3.2, 22.9]`.
pub(crate) fn gumbel(h: u32) -> f32 {
    -ln_pos(exponential(h))
}

/// `exp(x)` for `x <= 0` (−inf included), 0 below [`MASS_CUTOFF`]: `x = n ln 2 + r` (Cody–Waite,
/// `n` the nearest integer of `x log2 e`, `|r| <= 0.35`), `exp(r)` by its Taylor polynomial, times
/// `2^n` exactly.
pub(crate) fn exp_nonpos(x: f32) -> f32 {
    if x.is_nan() || x < MASS_CUTOFF {
        return 0.0;
    }
    let n = (x * LOG2E + 0.5).floor();
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = E7;
    p = E6 + r * p;
    p = E5 + r * p;
    p = E4 + r * p;
    p = E3 + r * p;
    p = 0.5 + r * p;
    p = 1.0 + r * p;
    p = 1.0 + r * p;
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// The fixed-point nucleus weight of a scaled logit `x <= 0`: `floor(exp(x) · 2^40)` (the
/// largest logit weighs `2^40`; a row of at most 2^23 entries sums below 2^64). Integer sums are
/// exact in any order, so the kernel's block-wide sums equal the host's sequential ones.
pub(crate) fn mass(x: f32) -> u64 {
    (exp_nonpos(x) * TWO_40) as u64
}

/// The target prefix mass of a nucleus `top_p` over a row of total mass `z`:
/// `ceil(top_p · z)` in f64, within `[1, z]`.
pub(crate) fn nucleus_target(top_p: f32, z: u64) -> u64 {
    ((top_p as f64 * z as f64).ceil() as u64).clamp(1, z.max(1))
}

/// The logit with NaN read as −inf and −0 as +0 (the values the sampler orders and scales).
pub(crate) fn canonical(l: f32) -> f32 {
    if l.is_nan() {
        f32::NEG_INFINITY
    } else if l == 0.0 {
        0.0
    } else {
        l
    }
}

/// A key whose unsigned order is the order of [`canonical`] logits (equal keys: equal values).
pub(crate) fn order_key(l: f32) -> u32 {
    let b = canonical(l).to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// The canonical logit of a key ([`order_key`]'s inverse).
pub(crate) fn key_value(key: u32) -> f32 {
    f32::from_bits(if key & 0x8000_0000 != 0 { key & 0x7fff_ffff } else { !key })
}

/// Larger is better: the key of `score` (or of the logit, for the argmax) above the complemented
/// id, so ties go to the lower id. The kernel's block reductions take the maximum of these.
pub(crate) fn ranked(key: u32, id: u32) -> u64 {
    ((key as u64) << 32) | (u32::MAX - id) as u64
}

/// The id of a [`ranked`] value.
pub(crate) fn ranked_id(r: u64) -> u32 {
    u32::MAX - r as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ln_and_exp_are_accurate() {
        // Relative error against f64 over the ranges the sampler uses.
        let mut worst_ln = 0f64;
        let mut x = 1.1e-10f32;
        while x < 24.0 {
            let want = (x as f64).ln();
            let got = ln_pos(x) as f64;
            worst_ln = worst_ln.max(((got - want) / want.abs().max(1e-3)).abs());
            x *= 1.000_37;
        }
        assert!(worst_ln < 1e-6, "ln: {worst_ln}");
        let mut worst_exp = 0f64;
        let mut x = 0f32;
        while x > MASS_CUTOFF {
            let want = (x as f64).exp();
            worst_exp = worst_exp.max(((exp_nonpos(x) as f64 - want) / want).abs());
            x -= 0.000_97;
        }
        assert!(worst_exp < 1e-6, "exp: {worst_exp}");
        assert_eq!(exp_nonpos(0.0), 1.0);
        assert_eq!(exp_nonpos(-0.0), 1.0);
        assert_eq!(exp_nonpos(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpos(-28.01), 0.0);
        assert_eq!(mass(0.0), 1 << 40);
    }

    #[test]
    fn exponential_covers_both_branches_and_its_extremes() {
        for h in [0u32, 1, 0x7fff_ffff, 0xbfff_ffff, 0xc000_0000, 0xffff_fffe, 0xffff_ffff] {
            let u = (2.0 * h as f64 + 1.0) / 2f64.powi(33);
            let want = -(u - 1.0).ln_1p();
            let got = exponential(h) as f64;
            assert!(((got - want) / want).abs() < 1e-6, "h = {h:#x}: {got} vs {want}");
        }
        assert!(gumbel(0) > -3.2 && gumbel(u32::MAX) < 22.9);
        assert!(gumbel(u32::MAX) < GUMBEL_BOUND);
    }

    #[test]
    fn keys_order_the_canonical_logits() {
        let v = [f32::NEG_INFINITY, -3e38, -1.0, -1e-40, 0.0, 1e-40, 1.0, 3e38, f32::INFINITY];
        for w in v.windows(2) {
            assert!(order_key(w[0]) < order_key(w[1]), "{} < {}", w[0], w[1]);
        }
        assert_eq!(order_key(-0.0), order_key(0.0));
        assert_eq!(order_key(f32::NAN), order_key(f32::NEG_INFINITY));
        for x in v {
            assert_eq!(key_value(order_key(x)).to_bits(), x.to_bits());
        }
        assert_eq!(ranked_id(ranked(7, 12)), 12);
        assert!(ranked(7, 3) > ranked(7, 4) && ranked(8, 4) > ranked(7, 3));
    }

    #[test]
    fn nucleus_target_stays_in_range() {
        assert_eq!(nucleus_target(1e-30, 1 << 40), 1);
        assert_eq!(nucleus_target(1.0, (1 << 60) - 1), (1 << 60) - 1);
        assert_eq!(nucleus_target(0.5, 10), 5);
        assert_eq!(nucleus_target(0.55, 10), 6);
    }
}

