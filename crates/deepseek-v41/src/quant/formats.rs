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
