//! The low-bit number formats of V4.1: e4m3 (fp8, "fn" variant: no infinities, 0x7f/0xff NaN),
//! e2m1 (fp4) and e8m0 (power-of-two scales), with exact encoders and decoders (spec §2.3, §2.4).
//!
//! Every function here is exact: rounding works on the f32 bits or divides by powers of two, so
//! no approximate arithmetic can misplace a tie.

use candle_core::Result;

/// e2m1 magnitudes of codes 0..7 (bit 3 is the sign).
pub const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Largest finite e4m3fn magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// Largest e2m1 magnitude.
pub const E2M1_MAX: f32 = 6.0;

/// Decodes one e4m3fn byte (bias 7, subnormals, 0x7f / 0xff = NaN, max 448).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((b >> 3) & 0x0f) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0f && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    let mag = if exp == 0 { man / 8.0 * pow2(-6) } else { (1.0 + man / 8.0) * pow2(exp - 7) };
    sign * mag
}

/// Decodes one e2m1 code (low 4 bits; bit 3 = sign, code 8 = -0.0).
pub fn e2m1_to_f32(code: u8) -> f32 {
    let mag = E2M1_VALUES[(code & 0x07) as usize];
    if code & 0x08 != 0 {
        -mag
    } else {
        mag
    }
}

/// Decodes one e8m0 byte: 2^(b - 127); 255 is NaN.
pub fn e8m0_to_f32(b: u8) -> f32 {
    if b == 0xff {
        return f32::NAN;
    }
    pow2(b as i32 - 127)
}

/// `2^e` exactly, built from the bits: subnormal for `e` in -149..=-127, `0.0` below -149,
/// `+inf` above 127.
pub fn pow2(e: i32) -> f32 {
    if e > 127 {
        f32::INFINITY
    } else if e >= -126 {
        f32::from_bits(((e + 127) as u32) << 23)
    } else if e >= -149 {
        f32::from_bits(1u32 << (e + 149))
    } else {
        0.0
    }
}

/// Rounds `x` to the nearest e4m3fn value (ties to even), saturating at ±448. NaN stays NaN;
/// the sign of zero is kept.
pub fn round_to_e4m3(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let a = x.abs();
    if a >= E4M3_MAX {
        return E4M3_MAX.copysign(x);
    }
    if a == 0.0 {
        return x;
    }
    // Normal e4m3 exponents go down to -6; below that the quantum stays 2^-9 (subnormals).
    // Dividing and multiplying by the power-of-two quantum is exact (no overflow: a < 448).
    let e = ((a.to_bits() >> 23) as i32 - 127).max(-6);
    let quantum = pow2(e - 3);
    let q = (a / quantum).round_ties_even() * quantum;
    q.min(E4M3_MAX).copysign(x)
}

/// Encodes `x` as an e4m3fn byte: round to nearest, ties to even, saturating at ±448 (as
/// [`round_to_e4m3`]); NaN gives 0x7f (0xff if its sign bit is set). The sign of zero is kept
/// (-0.0 and negative values rounding to zero give 0x80).
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    if x.is_nan() {
        return sign | 0x7f;
    }
    let a = round_to_e4m3(x).abs();
    if a == 0.0 {
        return sign;
    }
    let bits = a.to_bits();
    // a >= 2^-9 here, a normal f32.
    let e = (bits >> 23) as i32 - 127;
    if e < -6 {
        // e4m3 subnormal: a = m · 2^-9 with m in 1..=7, exact.
        return sign | (a * 512.0) as u8;
    }
    let man = ((bits >> 20) & 0x7) as u8;
    sign | (((e + 7) as u8) << 3) | man
}

/// Encodes `x` as an e2m1 code (bit 3 = sign): round to nearest with ties to the even code,
/// saturating at ±6. Ties at 0.25, 1.25, 2.5 and 5 go down; 0.75, 1.75 and 3.5 go up. The sign
/// bit is always kept, so -0.0 and negative values rounding to zero give code 8 (spec §0.1b.7).
/// e2m1 has no NaN: NaN saturates to code 7 (with its sign bit).
pub fn f32_to_e2m1(x: f32) -> u8 {
    let sign: u8 = if x.is_sign_negative() { 0x08 } else { 0 };
    let a = x.abs();
    let mag = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    sign | mag
}

/// Rounds `x` to the nearest e2m1 value as [`f32_to_e2m1`] does (negative values rounding to
/// zero give -0.0).
pub fn round_to_e2m1(x: f32) -> f32 {
    e2m1_to_f32(f32_to_e2m1(x))
}

/// Encodes a power-of-two scale `2^k` (k in -127..=127) as its e8m0 byte `k + 127`; NaN gives
/// 255. Anything else (zero, negative, infinite, not a power of two, out of range) is an error.
pub fn f32_to_e8m0(x: f32) -> Result<u8> {
    if x.is_nan() {
        return Ok(0xff);
    }
    if !(x > 0.0 && x.is_finite()) {
        candle_core::bail!("f32_to_e8m0: scale {x:e} is not a positive finite power of two");
    }
    let k = ceil_log2(x);
    if !(-127..=127).contains(&k) || pow2(k) != x {
        candle_core::bail!("f32_to_e8m0: scale {x:e} is not a power of two in 2^-127..=2^127");
    }
    Ok((k + 127) as u8)
}

/// `ceil(log2(v))` for a positive finite f32, exactly from the bits (spec §2.3): subnormals
/// included. Reproduces the reference's `fast_round_scale`.
pub fn ceil_log2(v: f32) -> i32 {
    let bits = v.to_bits();
    let exp = ((bits >> 23) & 0xff) as i32;
    let man = bits & 0x7f_ffff;
    if exp == 0 {
        // Subnormal: v = man · 2^-149.
        let bit_len = 32 - man.leading_zeros() as i32;
        let floor = bit_len - 1 - 149;
        return if man.is_power_of_two() { floor } else { floor + 1 };
    }
    exp - 127 + (man != 0) as i32
}

#[cfg(test)]
#[path = "formats_tests.rs"]
mod tests;
