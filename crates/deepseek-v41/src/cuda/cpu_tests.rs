//! CPU-path tests of the CUDA ops' reference implementations (no GPU needed; the GPU tests are
//! in the repository's `tests/cuda_insert.rs`).

use candle_core::{DType, Device, Module, Result, Tensor};

use super::{index_key_insert, q_rope, q_rope_inplace, window_insert};
use crate::nn::rms_norm::RmsNorm;
use crate::nn::rope::{apply_rope_tail, RopeKind, RopeTable};
use crate::quant::{fake_quant, QatFormat};

fn rows(t: usize, d: usize, seed: f32) -> Result<Tensor> {
    let v: Vec<f32> = (0..t * d).map(|i| (i as f32 * 0.37 + seed).sin() * 3.0).collect();
    Tensor::from_vec(v, (t, d), &Device::Cpu)?.to_dtype(DType::BF16)
}

fn u16s(t: &Tensor) -> Result<Vec<u16>> {
    Ok(t.flatten_all()?.to_vec1::<half::bf16>()?.iter().map(|x| x.to_bits()).collect())
}

#[test]
fn window_insert_scatters_reference_rows_into_a_cache_view() -> Result<()> {
    let (t, d) = (3, 64);
    let kv = rows(t, d, 0.5)?;
    let table = RopeTable::new(16, &RopeKind::Plain { theta: 10000.0 }, &Device::Cpu)?;
    let (cos, sin) = table.cos_sin(&[5, 9, 11])?;
    let big = Tensor::full(f32::NAN, (10, d), &Device::Cpu)?.to_dtype(DType::BF16)?;
    let cache = big.narrow(0, 2, 6)?;
    let slots = Tensor::new(&[4i64, -1, 0], &Device::Cpu)?;
    window_insert(&cache, &kv, &cos, &sin, &slots, true)?;
    let want = fake_quant(&apply_rope_tail(&kv, &cos, &sin)?, QatFormat::Fp8Ue8m0B32)?;
    assert_eq!(u16s(&big.get(6)?)?, u16s(&want.get(0)?)?);
    assert_eq!(u16s(&big.get(2)?)?, u16s(&want.get(2)?)?);
    let nan_rows: Vec<usize> = (0..10)
        .filter(|&r| big.get(r).unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()[0].is_nan())
        .collect();
    assert_eq!(nan_rows, vec![0, 1, 3, 4, 5, 7, 8, 9]);
    Ok(())
}

#[test]
fn duplicate_slots_are_rejected_on_the_cpu() -> Result<()> {
    let kv = rows(2, 64, 1.0)?;
    let table = RopeTable::new(16, &RopeKind::Plain { theta: 10000.0 }, &Device::Cpu)?;
    let (cos, sin) = table.cos_sin(&[1, 2])?;
    let cache = Tensor::zeros((4, 64), DType::BF16, &Device::Cpu)?;
    let slots = Tensor::new(&[3i64, 3], &Device::Cpu)?;
    let err = window_insert(&cache, &kv, &cos, &sin, &slots, false).unwrap_err().to_string();
    assert!(err.contains("slot 3"), "{err}");
    Ok(())
}

#[test]
fn index_key_insert_is_norm_rope_quant() -> Result<()> {
    let (g, d) = (2, 128);
    let k = rows(g, d, 2.0)?;
    let w = Tensor::from_vec((0..d).map(|i| 0.5 + i as f32 / d as f32).collect::<Vec<_>>(), d, &Device::Cpu)?;
    let table = RopeTable::new(64, &RopeKind::Plain { theta: 160000.0 }, &Device::Cpu)?;
    let (cos, sin) = table.cos_sin(&[0, 6])?;
    let cache = Tensor::zeros((2, d), DType::BF16, &Device::Cpu)?;
    index_key_insert(&cache, &k, &w, 1e-20, &cos, &sin, &Tensor::new(&[1i64, 0], &Device::Cpu)?, true)?;
    let normed = RmsNorm::from_weight(w, 1e-20)?.forward(&k)?;
    let want = fake_quant(&apply_rope_tail(&normed, &cos, &sin)?, QatFormat::Fp4Ue8m0B32)?;
    assert_eq!(u16s(&cache.get(1)?)?, u16s(&want.get(0)?)?);
    assert_eq!(u16s(&cache.get(0)?)?, u16s(&want.get(1)?)?);
    Ok(())
}

#[test]
fn q_rope_in_place_equals_out_of_place() -> Result<()> {
    let q = rows(3 * 4, 128, 3.0)?.reshape((3, 4, 128))?;
    let table = RopeTable::new(64, &RopeKind::Plain { theta: 10000.0 }, &Device::Cpu)?;
    let (cos, sin) = table.cos_sin(&[7, 8, 100])?;
    let out = q_rope(&q, &cos, &sin, None)?;
    assert_eq!(u16s(&out)?, u16s(&apply_rope_tail(&q, &cos, &sin)?)?);
    let q2 = q.copy()?;
    q_rope_inplace(&q2, &cos, &sin, None)?;
    assert_eq!(u16s(&q2)?, u16s(&out)?);
    Ok(())
}

#[test]
fn packed_layout_pack_then_unpack_is_the_fake_quant() -> Result<()> {
    // 11 rows over pages of 8 / 4 tokens (the last page part-filled), formats A and B.
    for (fmt, page, pages) in [(QatFormat::Fp8Ue8m0B32, 8, 2), (QatFormat::Fp4E4m3B16, 4, 3)] {
        let layout = super::PackedLayout::new(fmt, 64, page)?;
        let x = rows(11, 64, 0.25)?;
        let cache = layout.pack(&x)?;
        assert_eq!(cache.dims(), [pages, layout.page_bytes()]);
        let slots: Vec<usize> = (0..11).collect();
        let back = layout.unpack(&cache, &slots)?.to_dtype(DType::BF16)?;
        assert_eq!(u16s(&back)?, u16s(&fake_quant(&x, fmt)?)?, "{fmt}");
        assert!(layout.pack(&rows(2, 32, 0.0)?).is_err(), "a row width other than head_dim must be refused");
    }
    Ok(())
}

#[test]
fn sparse_attention_over_packed_rows_equals_the_dequantized_rows_on_the_cpu() -> Result<()> {
    use super::{KvRows, PackedLayout, SparseAttentionInputs, SparseAttentionOptions};
    let (a, b) = (PackedLayout::new(QatFormat::Fp8Ue8m0B32, 64, 8)?, PackedLayout::new(QatFormat::Fp4E4m3B16, 64, 4)?);
    let (kw, kc) = (rows(7, 64, 1.5)?, rows(12, 64, 2.5)?);
    let (pw, pc) = (a.pack(&kw)?, b.pack(&kc)?);
    let q = rows(2 * 4, 64, 3.5)?.reshape((2, 4, 64))?;
    let iw = Tensor::new(&[[0i64, 6, -1], [2, 2, 5]], &Device::Cpu)?;
    let ic = Tensor::new(&[[11i64, -1], [0, 3]], &Device::Cpu)?;
    let sink = Tensor::new(&[0.5f32, f32::NEG_INFINITY, -1.0, 2.0], &Device::Cpu)?;
    let run = |window, extra| {
        SparseAttentionInputs { q: &q, window, idx_window: &iw, extra, idx_extra: &ic, sink: &sink, scale: 0.125 }
            .forward(SparseAttentionOptions::default())
    };
    let (packed, _) = run(KvRows::Packed(&pw, a), KvRows::Packed(&pc, b))?;
    let (dw, dc) = (fake_quant(&kw, a.format())?, fake_quant(&kc, b.format())?);
    let (plain, _) = run(KvRows::Bf16(&dw), KvRows::Bf16(&dc))?;
    assert_eq!(u16s(&packed)?, u16s(&plain)?);
    // Index-key rows (format E) are not attention rows.
    let e = PackedLayout::new(QatFormat::Fp4Ue8m0B32, 64, 8)?;
    let err = run(KvRows::Packed(&e.zeros(1, &Device::Cpu)?, e), KvRows::Bf16(&dc)).unwrap_err().to_string();
    assert!(err.contains("window") && err.contains("format A"), "{err}");
    Ok(())
}
