//! Exhaustive checks of the format codecs against independent table-based references.

use super::*;

/// Every finite non-negative e4m3 value, ascending, from a direct formula (not the decoder):
/// byte b = (e << 3) | m; e = 0: m · 2^-9; else (8 + m) · 2^(e - 10).
fn e4m3_table() -> Vec<f64> {
    (0u8..=0x7e)
        .map(|b| {
            let (e, m) = ((b >> 3) as i32, (b & 7) as f64);
            if e == 0 {
                m * 2f64.powi(-9)
            } else {
                (8.0 + m) * 2f64.powi(e - 10)
            }
        })
        .collect()
}

/// Nearest table entry to |x| (ties to the even index, i.e. even mantissa), saturating.
fn ref_round_e4m3(table: &[f64], x: f32) -> f32 {
    let a = x.abs() as f64;
    let i = match table.iter().position(|&v| v > a) {
        None => table.len() - 1,
        Some(0) => 0,
        Some(j) => {
            let (lo, hi) = (table[j - 1], table[j]);
            let (dlo, dhi) = (a - lo, hi - a);
            if dlo < dhi || (dlo == dhi && (j - 1) % 2 == 0) {
                j - 1
            } else {
                j
            }
        }
    };
    (table[i] as f32).copysign(x)
}

/// Nearest e2m1 magnitude by distance (ties to the even code), saturating at 6.
fn ref_round_e2m1(x: f32) -> f32 {
    let a = (x.abs() as f64).min(6.0);
    let mut best = 0usize;
    for (c, &v) in E2M1_VALUES.iter().enumerate() {
        let (d, db) = ((a - v as f64).abs(), (a - E2M1_VALUES[best] as f64).abs());
        if d < db || (d == db && c % 2 == 0) {
            best = c;
        }
    }
    E2M1_VALUES[best].copysign(x)
}

/// Smallest k with 2^k >= v, by search in f64 (exact for every f32 power of two).
fn ref_ceil_log2(v: f32) -> i32 {
    let v = v as f64;
    let mut k = -150;
    while 2f64.powi(k) < v {
        k += 1;
    }
    k
}

fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[test]
fn e4m3_decoder_matches_formula() {
    let table = e4m3_table();
    for b in 0u8..=0x7e {
        assert_eq!(e4m3_to_f32(b) as f64, table[b as usize], "byte {b:#04x}");
        assert!(same(e4m3_to_f32(b | 0x80), -(table[b as usize] as f32)), "byte {:#04x}", b | 0x80);
    }
    assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
    assert_eq!(e4m3_to_f32(0x7e), 448.0);
    assert_eq!(e4m3_to_f32(0x38), 1.0);
    assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    assert!(table.windows(2).all(|w| w[0] < w[1]));
}

#[test]
fn e4m3_every_byte_round_trips() {
    for b in 0u8..=0xff {
        if b & 0x7f == 0x7f {
            assert_eq!(f32_to_e4m3(e4m3_to_f32(b)) & 0x7f, 0x7f, "NaN byte {b:#04x}");
            continue;
        }
        let v = e4m3_to_f32(b);
        assert_eq!(f32_to_e4m3(v), b, "byte {b:#04x} value {v}");
        assert!(same(round_to_e4m3(v), v), "byte {b:#04x}");
    }
}

#[test]
fn round_to_e4m3_midpoints_and_neighbours() {
    let table = e4m3_table();
    let mut probes = Vec::new();
    for w in table.windows(2) {
        let mid = ((w[0] + w[1]) / 2.0) as f32; // exact: both are short dyadics
        assert_eq!(mid as f64, (w[0] + w[1]) / 2.0);
        probes.extend([mid, mid.next_up(), mid.next_down(), w[0] as f32, w[1] as f32]);
    }
    probes.extend([448.0, 449.0, 464.0, 465.0, 480.0, 1e9, f32::MAX, f32::INFINITY]);
    // f32 subnormals and tiny normals (all round to 0).
    probes.extend([f32::from_bits(1), f32::from_bits(0x7f_ffff), f32::MIN_POSITIVE, 2f32.powi(-10)]);
    for x in probes {
        for x in [x, -x] {
            let (got, want) = (round_to_e4m3(x), ref_round_e4m3(&table, x));
            assert!(same(got, want), "x = {x:e}: got {got:e}, want {want:e}");
            assert!(same(e4m3_to_f32(f32_to_e4m3(x)), want), "encode x = {x:e}");
        }
    }
    // Ties to even, spelled out: 1 + 1/16 -> 1, 1 + 3/16 -> 1.25, 2^-10 -> 0, 3 · 2^-10 -> 2^-8.
    assert_eq!(round_to_e4m3(1.0625), 1.0);
    assert_eq!(round_to_e4m3(1.1875), 1.25);
    assert!(same(round_to_e4m3(-(2f32.powi(-10))), -0.0));
    assert_eq!(round_to_e4m3(3.0 * 2f32.powi(-10)), 2f32.powi(-8));
    assert_eq!(f32_to_e4m3(-1e-30), 0x80);
}

#[test]
fn round_to_e4m3_sweep() {
    let table = e4m3_table();
    // Every 997th f32 bit pattern from 0 to 480 (~1.1M probes): every binade, subnormals included.
    let top = 480f32.to_bits();
    let mut bits = 0u32;
    while bits <= top {
        let x = f32::from_bits(bits);
        let (got, want) = (round_to_e4m3(x), ref_round_e4m3(&table, x));
        assert!(same(got, want), "x = {x:e}: got {got:e}, want {want:e}");
        bits += 997;
    }
}

#[test]
fn e2m1_ties_and_codes() {
    let ties_down = [(0.25, 0.0), (1.25, 1.0), (2.5, 2.0), (5.0, 4.0)];
    let ties_up = [(0.75, 1.0), (1.75, 2.0), (3.5, 4.0)];
    for (x, want) in ties_down.into_iter().chain(ties_up) {
        assert_eq!(round_to_e2m1(x), want, "x = {x}");
        assert!(same(round_to_e2m1(-x), -want), "x = -{x}");
    }
    for c in 0u8..16 {
        assert_eq!(f32_to_e2m1(e2m1_to_f32(c)), c, "code {c}");
    }
    // Sign kept on zero (spec §0.1b.7): code 8, -0.0.
    assert_eq!(f32_to_e2m1(-0.0), 8);
    assert_eq!(f32_to_e2m1(-0.2), 8);
    assert!(same(round_to_e2m1(-0.25), -0.0));
    assert_eq!(f32_to_e2m1(0.0), 0);
    // Saturation.
    assert_eq!(f32_to_e2m1(7.0), 7);
    assert_eq!(f32_to_e2m1(-1e30), 15);
    assert_eq!(f32_to_e2m1(f32::INFINITY), 7);
}

#[test]
fn e2m1_sweep_against_reference() {
    let mut x = 0f32;
    while x <= 8.0 {
        for p in [x, x.next_up(), x.next_down().max(0.0)] {
            for p in [p, -p] {
                assert!(same(round_to_e2m1(p), ref_round_e2m1(p)), "x = {p:e}");
            }
        }
        x += 1.0 / 64.0;
    }
}

#[test]
fn ceil_log2_exhaustive_powers_and_neighbours() {
    let mut probes = Vec::new();
    for k in -149..=127 {
        let p = pow2(k);
        assert_eq!(p as f64, 2f64.powi(k), "pow2({k})");
        assert_eq!(ceil_log2(p), k, "ceil_log2(2^{k})");
        probes.extend([p, p.next_up(), p.next_down()]);
    }
    probes.extend((1u32..5000).map(f32::from_bits)); // small subnormals
    probes.extend([f32::from_bits(0x7f_ffff), f32::MAX, 1e-4 / 448.0, 6.0 * 2f32.powi(-126) / 6.0]);
    let mut s = 0x1234_5678u32;
    for _ in 0..20000 {
        s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        probes.push(f32::from_bits(s & 0x7f7f_ffff));
    }
    for v in probes.into_iter().filter(|v| *v > 0.0 && v.is_finite()) {
        assert_eq!(ceil_log2(v), ref_ceil_log2(v), "v = {v:e} ({:#010x})", v.to_bits());
    }
}

#[test]
fn pow2_edges() {
    assert_eq!(pow2(-150), 0.0);
    assert_eq!(pow2(128), f32::INFINITY);
    assert_eq!(pow2(-149), f32::from_bits(1));
    assert_eq!(pow2(0), 1.0);
}

#[test]
fn e8m0_encode_decode() -> anyhow::Result<()> {
    for b in 0u8..=254 {
        assert_eq!(f32_to_e8m0(e8m0_to_f32(b))?, b, "byte {b}");
    }
    assert_eq!(e8m0_to_f32(0), f32::from_bits(0x0040_0000));
    assert_eq!(e8m0_to_f32(127), 1.0);
    assert!(e8m0_to_f32(255).is_nan());
    assert_eq!(f32_to_e8m0(f32::NAN)?, 255);
    for bad in [0.0, -1.0, 3.0, 1.5, f32::INFINITY, 2f32.powi(-128), f32::from_bits(1)] {
        assert!(f32_to_e8m0(bad).is_err(), "{bad:e} must be rejected");
    }
    Ok(())
}

/// Spec §2.4 release test vectors (also MANIFEST `dq.*.crafted` row 0).
#[test]
fn spec_release_byte_vectors() {
    let s = e8m0_to_f32(0x73);
    assert_eq!(s, 2f32.powi(-12));
    let fp8: Vec<f32> =
        [0xd8u8, 0x71, 0xf2, 0x79, 0x70, 0x69, 0xf0, 0xe5].iter().map(|&b| e4m3_to_f32(b) * s).collect();
    let want = [-0.00390625, 0.03515625, -0.0390625, 0.0703125, 0.03125, 0.017578125, -0.03125, -0.0126953125];
    assert_eq!(fp8, want);

    let s = e8m0_to_f32(0x78);
    assert_eq!(s, 2f32.powi(-7));
    let fp4: Vec<f32> = [0xa0u8, 0xa8, 0xec, 0x4a, 0xad, 0xaf, 0x42, 0xaa]
        .iter()
        .flat_map(|&b| [e2m1_to_f32(b & 0xf) * s, e2m1_to_f32(b >> 4) * s])
        .collect();
    let want = [
        0.0, -0.0078125, 0.0, -0.0078125, -0.015625, -0.03125, -0.0078125, 0.015625, -0.0234375, -0.0078125, -0.046875,
        -0.0078125, 0.0078125, 0.015625, -0.0078125, -0.0078125,
    ];
    assert_eq!(fp4, want);
}
