//! Fake quant against the official reference's goldens (`fq.*`) and internal consistency.

use candle_core::{DType, Device, Tensor};

use super::*;
use crate::quant::formats::{pow2, round_to_e4m3};
use crate::quant::packed::{pack_row, unpack_row};
use crate::quant::test_golden::{f32_rows, modules, u8_rows};

const ALL: [QatFormat; 3] = [QatFormat::Fp8Ue8m0B32, QatFormat::Fp4E4m3B16, QatFormat::Fp4Ue8m0B32];

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Deterministic bf16-exact values over many binades (sign, zeros and ties included).
fn sample(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|i| {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let block_mag = ((i / 16) as i32 * 7 + seed as i32) % 40 - 25; // shared per ~block
            let m = ((s >> 16) & 0xff) as f32 / 64.0 - 2.0; // [-2, 2) in steps of 1/64
            let v = m * pow2(block_mag);
            if s.is_multiple_of(29) {
                -0.0
            } else {
                half::bf16::from_f32(v).to_f32()
            }
        })
        .collect()
}

#[test]
fn golden_fq_values_scales_and_codes() -> anyhow::Result<()> {
    let g = modules()?;
    for fmt in ALL {
        let pre = format!("fq.{}", fmt.name());
        let input = f32_rows(&g, &format!("{pre}.in"))?;
        let out = f32_rows(&g, &format!("{pre}.out"))?;
        let scale = f32_rows(&g, &format!("{pre}.scale"))?;
        let codes = u8_rows(&g, &format!("{pre}.{}", if fmt.is_fp4() { "packed_e2m1" } else { "codes_e4m3" }))?;
        assert!(input.len() >= 11 && input[0].len() == fmt.block(), "{pre}: one row per block");
        for (r, x) in input.iter().enumerate() {
            let ctx = format!("{pre} row {r}");
            let q = quantize_block(fmt, x);
            assert_eq!(q.scale.to_bits(), scale[r][0].to_bits(), "{ctx}: scale {} vs {}", q.scale, scale[r][0]);
            assert_eq!(bits(&q.dequantize()), bits(&out[r]), "{ctx}: dequantized block");
            let mut y = x.clone();
            fake_quant_slice(fmt, &mut y)?;
            assert_eq!(bits(&y), bits(&out[r]), "{ctx}: fake_quant_slice");
            let (data, sb) = pack_row(fmt, x)?;
            assert_eq!(data, codes[r], "{ctx}: packed codes");
            assert_eq!(fmt.decode_scale(sb[0]).to_bits(), scale[r][0].to_bits(), "{ctx}: scale byte");
            assert_eq!(bits(&unpack_row(fmt, &data, &sb)?), bits(&out[r]), "{ctx}: unpacked");
        }
        // The tensor API, in f32 and in bf16 (inputs are bf16 values, outputs exact in bf16).
        let t = crate::quant::test_golden::get(&g, &format!("{pre}.in"))?;
        let want = crate::quant::test_golden::get(&g, &format!("{pre}.out"))?.flatten_all()?.to_vec1::<f32>()?;
        for dt in [DType::F32, DType::BF16] {
            let y = fake_quant(&t.to_dtype(dt)?, fmt)?;
            assert_eq!(y.dtype(), dt);
            assert_eq!(y.dims(), t.dims());
            let y = y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            assert_eq!(bits(&y), bits(&want), "{pre}: fake_quant tensor {dt:?}");
        }
    }
    Ok(())
}

/// Negative controls: rules the spec's body text suggests but the reference does not follow.
#[test]
fn golden_rejects_alternative_rules() -> anyhow::Result<()> {
    let g = modules()?;
    // Q1 floor on amax/448 (V-KVF) instead of amax: the all-zero block would get 2^-13, not 2^-22.
    let scale = f32_rows(&g, "fq.fp8_ue8m0_b32.scale")?;
    let input = f32_rows(&g, "fq.fp8_ue8m0_b32.in")?;
    let zero_row = input.iter().position(|r| r.iter().all(|v| *v == 0.0)).expect("an all-zero block");
    assert_eq!(scale[zero_row][0], pow2(-22));
    assert_ne!(scale[zero_row][0], pow2(crate::quant::formats::ceil_log2(1e-4)));
    // "-0 becomes +0" (spec §2.3 body) versus code 8 / -0.0 (§0.1b.7): the golden keeps -0.0.
    let out = f32_rows(&g, "fq.fp4_e4m3_b16.out")?;
    assert!(out.iter().flatten().any(|v| *v == 0.0 && v.is_sign_negative()));
    Ok(())
}

#[test]
fn quantize_dequantize_equals_fake_quant() {
    for fmt in ALL {
        for seed in 0..40 {
            let x = sample(fmt.block(), seed);
            let mut y = x.clone();
            fake_quant_block(fmt, &mut y);
            let q = quantize_block(fmt, &x);
            assert_eq!(bits(&q.dequantize()), bits(&y), "{fmt} seed {seed}");
            assert!(q.codes.iter().all(|&c| !fmt.is_fp4() || c < 16));
            // Scale in the scale format, and idempotence of the fake quant.
            assert_eq!(fmt.decode_scale(fmt.encode_scale(q.scale).unwrap()), q.scale);
            let mut z = y.clone();
            fake_quant_block(fmt, &mut z);
            assert_eq!(bits(&z), bits(&y), "{fmt} seed {seed}: idempotent");
        }
    }
}

#[test]
fn fake_quant_values_exact_in_bf16() -> anyhow::Result<()> {
    for fmt in ALL {
        let x = sample(512, 7);
        let t = Tensor::from_vec(x, (4, 128), &Device::Cpu)?;
        let y = fake_quant(&t, fmt)?.flatten_all()?.to_vec1::<f32>()?;
        for v in y {
            assert_eq!(half::bf16::from_f32(v).to_f32().to_bits(), v.to_bits(), "{fmt}: {v:e}");
        }
    }
    // Q3 at the floor: 0.5 · 2^-126 = 2^-127 is subnormal in f32 and bf16 and still exact.
    let mut tiny = vec![0f32; 32];
    tiny[0] = pow2(-127);
    tiny[1] = -3.0 * pow2(-127);
    fake_quant_slice(QatFormat::Fp4Ue8m0B32, &mut tiny)?;
    assert_eq!(tiny[0], pow2(-127));
    assert_eq!(tiny[1], -3.0 * pow2(-127));
    Ok(())
}

#[test]
fn scale_rules() {
    // Q2: e4m3 of amax/6, floored at 2^-9, saturating at 448.
    assert_eq!(QatFormat::Fp4E4m3B16.scale(0.0), pow2(-9));
    assert_eq!(QatFormat::Fp4E4m3B16.scale(6.75), 1.125);
    assert_eq!(QatFormat::Fp4E4m3B16.scale(1e6), 448.0);
    assert_eq!(QatFormat::Fp4E4m3B16.scale(0.0874), round_to_e4m3(0.0874 / 6.0));
    // Q1 and Q3: powers of two, ceil.
    assert_eq!(QatFormat::Fp8Ue8m0B32.scale(448.0), 1.0);
    assert_eq!(QatFormat::Fp8Ue8m0B32.scale(448.5), 2.0);
    assert_eq!(QatFormat::Fp8Ue8m0B32.scale(0.0), pow2(-22));
    assert_eq!(QatFormat::Fp4Ue8m0B32.scale(6.0), 1.0);
    assert_eq!(QatFormat::Fp4Ue8m0B32.scale(6.01), 2.0);
    assert_eq!(QatFormat::Fp4Ue8m0B32.scale(0.0), pow2(-126));
    assert_eq!(
        [QatFormat::Fp8Ue8m0B32.block(), QatFormat::Fp4E4m3B16.block(), QatFormat::Fp4Ue8m0B32.block()],
        [32, 16, 32]
    );
}

#[test]
fn division_not_reciprocal() -> anyhow::Result<()> {
    // Q2 with s = 15 · 2^-9 (not a power of two): x = 2.5 · s is an exact tie under x / s and
    // rounds down to 2 · s; x · (1/s) = 2.5000002 would round up to 3 · s.
    let s = 15.0 * pow2(-9);
    let mut x = vec![0f32; 16];
    x[0] = 6.0 * s; // amax: s = e4m3(amax / 6)
    x[1] = 2.5 * s;
    assert_ne!(x[1] * (1.0 / s), 2.5, "the case must separate division from reciprocal");
    fake_quant_slice(QatFormat::Fp4E4m3B16, &mut x)?;
    assert_eq!(x[0], 6.0 * s);
    assert_eq!(x[1], 2.0 * s);
    Ok(())
}

#[test]
fn shape_errors_name_shape_and_format() -> anyhow::Result<()> {
    let t = Tensor::zeros((3, 24), DType::BF16, &Device::Cpu)?;
    let err = fake_quant(&t, QatFormat::Fp4E4m3B16).unwrap_err().to_string();
    assert!(err.contains("fp4_e4m3_b16") && err.contains("[3, 24]") && err.contains("16"), "{err}");
    assert!(fake_quant(&t.narrow(1, 0, 16)?, QatFormat::Fp4E4m3B16).is_ok());
    assert!(fake_quant(&t.narrow(1, 0, 16)?, QatFormat::Fp8Ue8m0B32).is_err());
    let mut v = vec![0f32; 20];
    assert!(fake_quant_slice(QatFormat::Fp4E4m3B16, &mut v).is_err());
    assert!(fake_quant(&Tensor::new(1f32, &Device::Cpu)?, QatFormat::Fp8Ue8m0B32).is_err());
    Ok(())
}

#[test]
fn higher_rank_tensor_is_blockwise_on_last_dim() -> anyhow::Result<()> {
    let x = sample(2 * 3 * 64, 3);
    let t = Tensor::from_vec(x.clone(), (2, 3, 64), &Device::Cpu)?;
    for fmt in ALL {
        let got = fake_quant(&t, fmt)?.flatten_all()?.to_vec1::<f32>()?;
        let mut want = x.clone();
        fake_quant_slice(fmt, &mut want)?;
        assert_eq!(bits(&got), bits(&want), "{fmt}");
    }
    Ok(())
}
