//! The low-bit number formats of V4.1: e4m3 (fp8, "fn" variant: no infinities, 0x7f/0xff NaN),
//! e2m1 (fp4) and e8m0 (power-of-two scales).

/// e2m1 magnitudes of codes 0..7 (bit 3 is the sign).
pub const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Decodes one e4m3fn byte (bias 7, subnormals, 0x7f / 0xff = NaN, max 448).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((b >> 3) & 0x0f) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0f && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    let mag = if exp == 0 { man / 8.0 * 2f32.powi(-6) } else { (1.0 + man / 8.0) * 2f32.powi(exp - 7) };
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
    // 2^(b-127) is exactly the f32 whose biased exponent is b (b = 0 is 2^-127, a subnormal).
    if b == 0 {
        f32::from_bits(0x0040_0000)
    } else {
        f32::from_bits((b as u32) << 23)
    }
}

/// Rounds `x` to the nearest e4m3fn value (ties to even), saturating at ±448. NaN stays NaN.
/// Exact: works on the f32 exponent, no approximate division.
pub fn round_to_e4m3(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let a = x.abs();
    if a >= 448.0 {
        return 448.0f32.copysign(x);
    }
    if a == 0.0 {
        return 0.0f32.copysign(x);
    }
    // Normal e4m3 exponents go down to -6; below that the quantum stays 2^-9 (subnormals).
    let e = ((a.to_bits() >> 23) as i32 - 127).max(-6);
    let quantum = 2f32.powi(e - 3);
    let q = (a / quantum).round_ties_even() * quantum;
    q.min(448.0).copysign(x)
}

/// `ceil(log2(v))` for a positive finite f32, exactly from the bits (spec §2.3).
pub fn ceil_log2(v: f32) -> i32 {
    let bits = v.to_bits();
    let exp = ((bits >> 23) & 0xff) as i32;
    let man = bits & 0x7f_ffff;
    if exp == 0 {
        // Subnormal: v = man · 2^-149.
        let lz = 32 - man.leading_zeros() as i32; // bit length
        let floor = lz - 1 - 149;
        return if man.is_power_of_two() { floor } else { floor + 1 };
    }
    exp - 127 + (man != 0) as i32
}
