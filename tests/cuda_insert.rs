//! GPU tests of the fused CUDA cache inserts and the query RoPE (`deepseek_v41::cuda`).
//!
//! Every test runs the op on the GPU and the same op on the CPU (the crate's reference: RoPE
//! from `nn::rope`, RMSNorm from `nn::rms_norm`, fake quant from `quant::fake_quant`) over fresh
//! random data and compares every element of the result BIT FOR BIT, caches included: both
//! caches start poisoned with NaN, so a slot the kernel must not write has to come back NaN.
//!
//! These tests need a CUDA device and FAIL without one (so a pass proves they ran on the GPU).
//! Build: `cargo test --release --features cuda --test cuda_insert` (see docs/cuda.md).

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor, D};
use deepseek_v41::cuda::{
    compressed_insert, index_key_insert, keep_last_writer, packed_insert, q_rope, q_rope_inplace, window_insert,
    PackedLayout,
};
use deepseek_v41::nn::rope::{RopeKind, RopeTable};
use deepseek_v41::quant::{fake_quant, QatFormat};
use half::bf16;

// ------------------------------------------------------------------------------------ helpers

fn gpu() -> Device {
    Device::new_cuda(0).expect("tests/cuda_insert.rs needs a CUDA device (none found): these tests must run on a GPU")
}

#[path = "support/rng.rs"]
#[allow(dead_code)]
mod rng;
use rng::Rng;

/// `[rows, width]` bf16 random values whose magnitude changes per 16-element run (factors
/// 2^-20 .. 2^8), so that the quant scales vary, tiny blocks hit the amax floors and large ones
/// saturate nothing but use the top of the range.
fn random_rows(rng: &mut Rng, rows: usize, width: usize, device: &Device) -> Result<Tensor> {
    let mut v = Vec::with_capacity(rows * width);
    for _ in 0..rows {
        for _ in 0..width.div_ceil(16) {
            let e = rng.below(29) as i32 - 20;
            let scale = 2f32.powi(e);
            for _ in 0..16 {
                v.push(rng.normal() * scale);
            }
        }
        v.truncate(v.len() - (width.div_ceil(16) * 16 - width));
    }
    Ok(Tensor::from_vec(v, (rows, width), &Device::Cpu)?.to_dtype(DType::BF16)?.to_device(device)?)
}

/// A `[slots, width]` bf16 cache filled with NaN.
fn poisoned(slots: usize, width: usize, device: &Device) -> Result<Tensor> {
    Ok(Tensor::full(f32::NAN, (slots, width), &Device::Cpu)?.to_dtype(DType::BF16)?.to_device(device)?)
}

/// Runs `op(cache, inputs)` twice: on the CPU with a cache from `poison(&Device::Cpu)` and the
/// `cpu` inputs, then on the GPU `dev` with a cache from `poison(dev)` and the `gpu` inputs (the
/// same tensors moved there, possibly as views); returns (GPU cache, CPU cache).
fn run_on_both(
    dev: &Device,
    poison: impl Fn(&Device) -> Result<Tensor>,
    cpu: &[&Tensor],
    gpu: &[Tensor],
    op: impl Fn(&Tensor, &[&Tensor]) -> candle_core::Result<()>,
) -> Result<(Tensor, Tensor)> {
    let cache_cpu = poison(&Device::Cpu)?;
    op(&cache_cpu, cpu)?;
    let cache_gpu = poison(dev)?;
    op(&cache_gpu, &gpu.iter().collect::<Vec<_>>())?;
    Ok((cache_gpu, cache_cpu))
}

/// Copies of `tensors` on `dev`.
fn to_dev(tensors: &[&Tensor], dev: &Device) -> Result<Vec<Tensor>> {
    tensors.iter().map(|t| Ok(t.to_device(dev)?)).collect()
}

fn bits(t: &Tensor) -> Result<Vec<u16>> {
    Ok(t.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<bf16>()?.iter().map(|x| x.to_bits()).collect())
}

/// Asserts bit equality of two bf16 tensors, reporting the first mismatches with their index.
fn assert_same_bits(gpu: &Tensor, cpu: &Tensor, what: &str) -> Result<()> {
    compare_bits(gpu, cpu, what, false)
}

/// As [`assert_same_bits`], but any two NaNs are equal (NaN payloads and signs differ between
/// the CPU and the GPU when a NaN is created, e.g. by inf / inf).
fn assert_same_bits_nan_eq(gpu: &Tensor, cpu: &Tensor, what: &str) -> Result<()> {
    compare_bits(gpu, cpu, what, true)
}

fn compare_bits(gpu: &Tensor, cpu: &Tensor, what: &str, nan_eq: bool) -> Result<()> {
    ensure!(gpu.dims() == cpu.dims(), "{what}: shapes {:?} vs {:?}", gpu.shape(), cpu.shape());
    let (g, c) = (bits(gpu)?, bits(cpu)?);
    let is_nan = |b: u16| bf16::from_bits(b).is_nan();
    let differ = |a: u16, b: u16| a != b && !(nan_eq && is_nan(a) && is_nan(b));
    let width = *gpu.dims().last().unwrap_or(&1);
    let bad: Vec<String> = g
        .iter()
        .zip(&c)
        .enumerate()
        .filter(|(_, (a, b))| differ(**a, **b))
        .take(8)
        .map(|(i, (a, b))| {
            format!(
                "[{}, {}]: gpu {:#06x} ({}) cpu {:#06x} ({})",
                i / width,
                i % width,
                a,
                bf16::from_bits(*a),
                b,
                bf16::from_bits(*b)
            )
        })
        .collect();
    let count = g.iter().zip(&c).filter(|(a, b)| differ(**a, **b)).count();
    ensure!(count == 0, "{what}: {count} of {} elements differ, first: {}", g.len(), bad.join("; "));
    Ok(())
}

/// Rows of `cache` (CPU copy) that are entirely NaN / entirely non-NaN, as sets of row indices.
fn nan_rows(cache: &Tensor) -> Result<(Vec<usize>, Vec<usize>)> {
    let (s, w) = cache.dims2()?;
    let v = cache.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let (mut all_nan, mut none_nan) = (Vec::new(), Vec::new());
    for r in 0..s {
        let row = &v[r * w..(r + 1) * w];
        if row.iter().all(|x| x.is_nan()) {
            all_nan.push(r);
        } else if row.iter().all(|x| !x.is_nan()) {
            none_nan.push(r);
        }
    }
    Ok((all_nan, none_nan))
}

/// cos/sin `[positions.len(), rope_dim/2]` f32 from the crate's table, on the CPU.
fn cos_sin(table: &RopeTable, positions: &[usize]) -> Result<(Tensor, Tensor)> {
    Ok(table.cos_sin(positions)?)
}

fn yarn_table(rope_dim: usize) -> Result<RopeTable> {
    let scaling = deepseek_v41::config::YarnScaling {
        factor: 16.0,
        original_max_position_embeddings: 65536,
        beta_fast: 32.0,
        beta_slow: 1.0,
    };
    Ok(RopeTable::new(rope_dim, &RopeKind::Yarn { theta: 160000.0, scaling }, &Device::Cpu)?)
}

fn plain_table(rope_dim: usize) -> Result<RopeTable> {
    Ok(RopeTable::new(rope_dim, &RopeKind::Plain { theta: 10000.0 }, &Device::Cpu)?)
}

fn i64_tensor(v: &[i64], device: &Device) -> Result<Tensor> {
    Ok(Tensor::from_vec(v.to_vec(), v.len(), device)?)
}

/// Sequences packed into one call: per sequence (start position, token count).
struct Batch {
    positions: Vec<usize>,
    seq_of_token: Vec<usize>,
}

fn batch(seqs: &[(usize, usize)]) -> Batch {
    let mut positions = Vec::new();
    let mut seq_of_token = Vec::new();
    for (s, &(start, len)) in seqs.iter().enumerate() {
        for p in start..start + len {
            positions.push(p);
            seq_of_token.push(s);
        }
    }
    Batch { positions, seq_of_token }
}

// ------------------------------------------------------------------------------- window insert

/// Runs window_insert for a batch of sequences, each with its own ring of `window` rows
/// (sequence s owns cache rows [s*W, (s+1)*W), slot = s*W + p mod W, the last writer of a slot
/// wins), on GPU and CPU, and compares the whole caches bit for bit.
fn check_window(seed: u64, d: usize, rope_dim: usize, window: usize, seqs: &[(usize, usize)], fq: bool) -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(seed);
    let b = batch(seqs);
    let t = b.positions.len();
    let slots_n = seqs.len() * window;
    let mut slots: Vec<i64> =
        b.positions.iter().zip(&b.seq_of_token).map(|(&p, &s)| (s * window + p % window) as i64).collect();
    keep_last_writer(&mut slots);

    let kv = random_rows(&mut rng, t, d, &Device::Cpu)?;
    let table = plain_table(rope_dim)?;
    let (cos, sin) = cos_sin(&table, &b.positions)?;
    let slots_cpu = i64_tensor(&slots, &Device::Cpu)?;

    let inputs = [&kv, &cos, &sin, &slots_cpu];
    let (cache_gpu, cache_cpu) =
        run_on_both(&dev, |dv| poisoned(slots_n, d, dv), &inputs, &to_dev(&inputs, &dev)?, |c, x| {
            window_insert(c, x[0], x[1], x[2], x[3], fq)
        })?;

    let what = format!("window_insert d={d} r={rope_dim} W={window} seqs={seqs:?} fq={fq}");
    assert_same_bits(&cache_gpu, &cache_cpu, &what)?;

    // Written slots are complete rows, every other slot is still poisoned.
    let written: std::collections::BTreeSet<usize> = slots.iter().filter(|&&s| s >= 0).map(|&s| s as usize).collect();
    let (all_nan, none_nan) = nan_rows(&cache_gpu)?;
    ensure!(none_nan.iter().copied().collect::<std::collections::BTreeSet<_>>() == written, "{what}: written rows");
    ensure!(all_nan.len() + written.len() == slots_n, "{what}: a row is partially written");

    // Negative control: the stored rows are the RoPE'd (and quantized) rows, not the input
    // (position 0 rotates by angle 0, so take a written token at a later position).
    let first_slot = (0..t).find(|&i| slots[i] >= 0 && b.positions[i] > 0).context("no slot written past position 0")?;
    let stored = cache_cpu.get(slots[first_slot] as usize)?;
    let raw = kv.get(first_slot)?;
    ensure!(bits(&stored)? != bits(&raw)?, "{what}: the stored row equals the raw input row");
    if fq {
        let requant = fake_quant(&stored, QatFormat::Fp8Ue8m0B32)?;
        assert_same_bits(&requant, &stored, &format!("{what}: stored rows are Q1 fixed points"))?;
    }
    Ok(())
}

#[test]
fn window_insert_decode_single_token_last_slot() -> Result<()> {
    // T = 1, position 127 -> the last slot of a 128-row ring; V4.1 shapes.
    check_window(1, 512, 64, 128, &[(127, 1)], true)
}

#[test]
fn window_insert_decode_batch_of_sequences() -> Result<()> {
    // One decode token for each of 37 sequences at scattered (large) positions.
    let seqs: Vec<(usize, usize)> = (0..37).map(|s| (s * 7919 % 100_003 + 5 * s, 1)).collect();
    check_window(2, 512, 64, 128, &seqs, true)
}

#[test]
fn window_insert_prefill_wraps_and_odd_lengths() -> Result<()> {
    // Several sequences in one call: odd lengths, one exactly filling the ring, one wrapping it
    // more than twice (only its last 128 tokens may remain), one continuing after a wrap.
    let seqs = [(0, 1), (3, 7), (0, 128), (0, 301), (1000, 129), (65_531, 13)];
    check_window(3, 512, 64, 128, &seqs, true)?;
    check_window(4, 512, 64, 128, &seqs, false)
}

#[test]
fn window_insert_tiny_shapes() -> Result<()> {
    // The v41-tiny configuration: head_dim 128, rope 64, window 8; and the other head dims.
    check_window(5, 128, 64, 8, &[(0, 5), (6, 9), (17, 1)], true)?;
    check_window(6, 64, 32, 8, &[(2, 11)], true)?;
    check_window(7, 256, 64, 16, &[(0, 33)], true)?;
    check_window(8, 512, 512, 4, &[(9, 3)], true)
}

#[test]
fn window_insert_skips_padding_and_out_of_range_slots() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(9);
    let (t, d, s) = (6, 512, 8);
    let kv = random_rows(&mut rng, t, d, &Device::Cpu)?;
    let (cos, sin) = cos_sin(&plain_table(64)?, &[3, 4, 5, 6, 7, 8])?;
    let slots = [2i64, -1, 7, 8, i64::MAX, 0];
    let slots_cpu = i64_tensor(&slots, &Device::Cpu)?;
    let inputs = [&kv, &cos, &sin, &slots_cpu];
    let (cache_gpu, cache_cpu) = run_on_both(&dev, |dv| poisoned(s, d, dv), &inputs, &to_dev(&inputs, &dev)?, |c, x| {
        window_insert(c, x[0], x[1], x[2], x[3], true)
    })?;
    assert_same_bits(&cache_gpu, &cache_cpu, "window_insert with skipped slots")?;
    let (all_nan, none_nan) = nan_rows(&cache_gpu)?;
    ensure!(none_nan == vec![0, 2, 7], "written rows {none_nan:?}");
    ensure!(all_nan == vec![1, 3, 4, 5, 6], "poisoned rows {all_nan:?}");
    Ok(())
}

#[test]
fn window_insert_strided_source_and_cache_view() -> Result<()> {
    // kv as the narrow of a fused [T, 1280 + 512] projection; the cache as rows of a larger
    // [2 * 64, 512] buffer (layer 1's half).
    let dev = gpu();
    let mut rng = Rng(10);
    let (t, d) = (19, 512);
    let fused = random_rows(&mut rng, t, 1280 + d, &Device::Cpu)?;
    let kv = fused.narrow(1, 1280, d)?;
    let positions: Vec<usize> = (40..40 + t).collect();
    let (cos, sin) = cos_sin(&plain_table(64)?, &positions)?;
    let slots: Vec<i64> = positions.iter().map(|&p| (p % 64) as i64).collect();
    let slots_cpu = i64_tensor(&slots, &Device::Cpu)?;

    let mut gpu_inputs = vec![fused.to_device(&dev)?.narrow(1, 1280, d)?];
    gpu_inputs.extend(to_dev(&[&cos, &sin, &slots_cpu], &dev)?);
    let (big_gpu, big_cpu) =
        run_on_both(&dev, |dv| poisoned(128, d, dv), &[&kv, &cos, &sin, &slots_cpu], &gpu_inputs, |c, x| {
            window_insert(&c.narrow(0, 64, 64)?, x[0], x[1], x[2], x[3], true)
        })?;
    assert_same_bits(&big_gpu, &big_cpu, "window_insert into a cache view")?;
    let (all_nan, _) = nan_rows(&big_gpu)?;
    ensure!((0..64).all(|r| all_nan.contains(&r)), "rows of the other half were written");
    Ok(())
}

// --------------------------------------------------------------------------- compressed insert

/// Compressed entries of several sequences: sequence s owns entry rows [s*N, (s+1)*N); each of
/// its tokens p that closes a group ((p+1) mod r == 0) writes entry j = p div r with RoPE at
/// j*r. Open groups write nothing.
fn check_compressed(seed: u64, d: usize, ratio: usize, entries_per_seq: usize, seqs: &[(usize, usize)]) -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(seed);
    let b = batch(seqs);
    let (mut pos, mut slots) = (Vec::new(), Vec::new());
    for (&p, &s) in b.positions.iter().zip(&b.seq_of_token) {
        if (p + 1) % ratio == 0 {
            let j = p / ratio;
            pos.push(j * ratio);
            slots.push((s * entries_per_seq + j) as i64);
        }
    }
    let g = pos.len();
    ensure!(pos.iter().all(|&p| p / ratio < entries_per_seq), "test setup: entries overflow a sequence's rows");
    let latent = random_rows(&mut rng, g, d, &Device::Cpu)?;
    let (cos, sin) = cos_sin(&yarn_table(64)?, &pos)?;
    let slots_cpu = i64_tensor(&slots, &Device::Cpu)?;
    let n = seqs.len() * entries_per_seq;
    let what = format!("compressed_insert d={d} r={ratio} seqs={seqs:?}");
    for fq in [true, false] {
        let inputs = [&latent, &cos, &sin, &slots_cpu];
        let (cache_gpu, cache_cpu) =
            run_on_both(&dev, |dv| poisoned(n, d, dv), &inputs, &to_dev(&inputs, &dev)?, |c, x| {
                compressed_insert(c, x[0], x[1], x[2], x[3], fq)
            })?;
        assert_same_bits(&cache_gpu, &cache_cpu, &format!("{what} fq={fq}"))?;
        let (all_nan, none_nan) = nan_rows(&cache_gpu)?;
        ensure!(none_nan.len() == g && all_nan.len() == n - g, "{what}: written rows {none_nan:?}");
        if fq && g > 0 {
            let row = cache_cpu.get(slots[g - 1] as usize)?;
            assert_same_bits(&fake_quant(&row, QatFormat::Fp4E4m3B16)?, &row, &format!("{what}: Q2 fixed point"))?;
        }
    }
    Ok(())
}

#[test]
fn compressed_insert_ratio_2_group_boundaries() -> Result<()> {
    // Odd lengths leave the last group open; starts at odd positions cut the first group.
    check_compressed(20, 512, 2, 64, &[(0, 1), (0, 2), (1, 1), (5, 9), (0, 64), (31, 33)])
}

#[test]
fn compressed_insert_ratio_1_and_tiny() -> Result<()> {
    check_compressed(21, 512, 1, 160, &[(0, 1), (3, 17), (100, 40)])?;
    check_compressed(22, 128, 2, 16, &[(0, 7), (2, 30)])
}

// ---------------------------------------------------------------------------- index key insert

fn check_index_keys(seed: u64, d: usize, eps: f64, g: usize, slots_n: usize) -> Result<()> {
    check_index_keys_with(seed, d, 64, eps, g, slots_n, false)
}

/// `rope`: the rotated dims; `misaligned_cos`: the GPU cos/sin start 4 bytes past an 8-byte
/// boundary (views into a larger buffer), which the D = 128 quarter-warp path cannot load as
/// float2 (the launcher takes the one-warp path then).
fn check_index_keys_with(
    seed: u64,
    d: usize,
    rope: usize,
    eps: f64,
    g: usize,
    slots_n: usize,
    misaligned_cos: bool,
) -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(seed);
    let k_pre = random_rows(&mut rng, g, d, &Device::Cpu)?;
    let weight = Tensor::from_vec((0..d).map(|_| 0.5 + rng.uniform()).collect::<Vec<f32>>(), d, &Device::Cpu)?
        .to_dtype(DType::BF16)?;
    let ratio = 2;
    let mut order: Vec<usize> = (0..slots_n).collect();
    for i in (1..slots_n).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let slots: Vec<i64> = order[..g].iter().map(|&j| j as i64).collect();
    let pos: Vec<usize> = order[..g].iter().map(|&j| j * ratio).collect();
    let (cos, sin) = cos_sin(&yarn_table(rope)?, &pos)?;
    let slots_cpu = i64_tensor(&slots, &Device::Cpu)?;
    let what = format!("index_key_insert d={d} R={rope} eps={eps} G={g} misaligned_cos={misaligned_cos}");
    let on_gpu = |t: &Tensor| -> Result<Tensor> {
        if !misaligned_cos {
            return Ok(t.to_device(&dev)?);
        }
        let flat = Tensor::cat(&[&Tensor::zeros(1, DType::F32, &Device::Cpu)?, &t.flatten_all()?], 0)?.to_device(&dev)?;
        Ok(flat.narrow(0, 1, t.elem_count())?.reshape(t.shape())?)
    };
    let (cos_gpu, sin_gpu) = (on_gpu(&cos)?, on_gpu(&sin)?);
    for fq in [true, false] {
        let gpu_inputs =
            [k_pre.to_device(&dev)?, weight.to_device(&dev)?, cos_gpu.clone(), sin_gpu.clone(), slots_cpu.to_device(&dev)?];
        let (cache_gpu, cache_cpu) = run_on_both(
            &dev,
            |dv| poisoned(slots_n, d, dv),
            &[&k_pre, &weight, &cos, &sin, &slots_cpu],
            &gpu_inputs,
            |c, x| index_key_insert(c, x[0], x[1], eps, x[2], x[3], x[4], fq),
        )?;
        assert_same_bits(&cache_gpu, &cache_cpu, &format!("{what} fq={fq}"))?;
        let (all_nan, none_nan) = nan_rows(&cache_gpu)?;
        ensure!(none_nan.len() == g && all_nan.len() == slots_n - g, "{what}: written rows");
    }
    Ok(())
}

#[test]
fn index_key_insert_matches_cpu() -> Result<()> {
    check_index_keys(30, 128, 1e-20, 1, 8)?; // one key, decode
    check_index_keys(31, 128, 1e-20, 333, 512)?; // many keys, odd count
    check_index_keys(32, 128, 1e-6, 64, 64)?; // every slot, the last one included
    check_index_keys(33, 512, 1e-20, 17, 40) // another head dim through the same norm path
}

// ------------------------------------------------------------------------------------ q rope

fn check_q_rope(seed: u64, t: usize, h: usize, d: usize, rope_dim: usize, norm: Option<f64>) -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(seed);
    let q = random_rows(&mut rng, t * h, d, &Device::Cpu)?.reshape((t, h, d))?;
    let positions: Vec<usize> = (0..t).map(|_| rng.below(1 << 20)).collect();
    let (cos, sin) = cos_sin(&plain_table(rope_dim)?, &positions)?;
    let (qg, cg, sg) = (q.to_device(&dev)?, cos.to_device(&dev)?, sin.to_device(&dev)?);
    let what = format!("q_rope T={t} H={h} D={d} R={rope_dim} norm={norm:?}");

    let out_cpu = q_rope(&q, &cos, &sin, norm)?;
    let out_gpu = q_rope(&qg, &cg, &sg, norm)?;
    assert_same_bits(&out_gpu.reshape((t * h, d))?, &out_cpu.reshape((t * h, d))?, &format!("{what} out of place"))?;
    assert_same_bits(&qg.reshape((t * h, d))?, &q.reshape((t * h, d))?, &format!("{what}: input untouched"))?;

    let q_in = q.copy()?;
    q_rope_inplace(&q_in, &cos, &sin, norm)?;
    assert_same_bits(&q_in.reshape((t * h, d))?, &out_cpu.reshape((t * h, d))?, &format!("{what} cpu in place"))?;
    let qg_in = qg.copy()?;
    q_rope_inplace(&qg_in, &cg, &sg, norm)?;
    assert_same_bits(&qg_in.reshape((t * h, d))?, &out_cpu.reshape((t * h, d))?, &format!("{what} gpu in place"))?;

    // Negative control: RoPE changed the tail and (without norm) left the head dims alone.
    let tail = |x: &Tensor| -> Result<Vec<u16>> { bits(&x.narrow(D::Minus1, d - rope_dim, rope_dim)?.contiguous()?) };
    ensure!(tail(&out_cpu)? != tail(&q)?, "{what}: RoPE did not change the rotated dims");
    if norm.is_none() && rope_dim < d {
        let head = |x: &Tensor| -> Result<Vec<u16>> { bits(&x.narrow(D::Minus1, 0, d - rope_dim)?.contiguous()?) };
        ensure!(head(&out_gpu)? == head(&q)?, "{what}: the non-rotated dims changed");
    }
    Ok(())
}

#[test]
fn q_rope_flash_shapes() -> Result<()> {
    check_q_rope(40, 1, 64, 512, 64, None)?; // decode, V4.1-Flash
    check_q_rope(41, 37, 64, 512, 64, None)?;
    check_q_rope(42, 5, 4, 512, 64, None)
}

#[test]
fn q_rope_tiny_shapes_and_norm() -> Result<()> {
    check_q_rope(43, 9, 4, 128, 64, None)?; // v41-tiny
    check_q_rope(44, 3, 4, 128, 64, Some(1e-6))?; // V4.0-style weightless q norm
    check_q_rope(45, 11, 64, 512, 64, Some(1e-20))?;
    check_q_rope(46, 2, 4, 64, 6, None) // rope_dim not a multiple of 8: the 2-element tail path
}

#[test]
fn q_rope_inplace_on_a_head_view() -> Result<()> {
    // In place on q viewed from a [T, H * D] projection (strided heads) and on a narrow of the
    // heads (non-contiguous view): only that view may change.
    let dev = gpu();
    let mut rng = Rng(47);
    let (t, h, d) = (7, 8, 512);
    let flat = random_rows(&mut rng, t, h * d, &Device::Cpu)?;
    let positions: Vec<usize> = (0..t).map(|i| 1000 + 3 * i).collect();
    let (cos, sin) = cos_sin(&plain_table(64)?, &positions)?;
    // The GPU copy and the pristine copy are taken before the CPU rotation: `cpu` is a reshape
    // of `flat` and shares its storage, so rotating it in place also rotates `flat`.
    let gflat = flat.to_device(&dev)?;
    let original = flat.copy()?.reshape((t, h, d))?;
    let cpu = flat.reshape((t, h, d))?;
    q_rope_inplace(&cpu.narrow(1, 2, 4)?, &cos, &sin, None)?;
    let g = gflat.reshape((t, h, d))?;
    q_rope_inplace(&g.narrow(1, 2, 4)?, &cos.to_device(&dev)?, &sin.to_device(&dev)?, None)?;
    assert_same_bits(&g.reshape((t * h, d))?, &cpu.reshape((t * h, d))?, "q_rope_inplace on a head narrow")?;
    let heads = |x: &Tensor, first: usize, n: usize| -> Result<Vec<u16>> {
        bits(&x.narrow(1, first, n)?.contiguous()?)
    };
    ensure!(heads(&g, 0, 2)? == heads(&original, 0, 2)?, "heads before the view changed");
    ensure!(heads(&g, 6, 2)? == heads(&original, 6, 2)?, "heads after the view changed");
    // The CPU in-place path on the view equals the out-of-place op on that view.
    let expected = q_rope(&original.narrow(1, 2, 4)?, &cos, &sin, None)?.reshape((t * 4, d))?;
    assert_same_bits(&cpu.narrow(1, 2, 4)?.reshape((t * 4, d))?, &expected, "cpu in place vs out of place")?;
    // Negative control: the view itself was rotated.
    ensure!(heads(&g, 2, 4)? != heads(&original, 2, 4)?, "the view was not rotated");
    Ok(())
}

// ------------------------------------------------------------------------------ packed caches

/// Packs `t` rows into a paged cache of `pages` pages on GPU and CPU (caches poisoned with 0xAB
/// bytes) and compares every byte; then checks that the unpacked GPU rows equal what the bf16
/// insert of the same format stores, and that bytes of unwritten slots are still poison.
fn check_packed(seed: u64, fmt: QatFormat, d: usize, page: usize, pages: usize, t: usize, norm: bool) -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(seed);
    let layout = PackedLayout::new(fmt, d, page)?;
    let n = page * pages;
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let mut slots: Vec<i64> = order[..t].iter().map(|&s| s as i64).collect();
    if t > 2 {
        slots[t / 2] = -1; // one padding token
    }
    let rows = random_rows(&mut rng, t, d, &Device::Cpu)?;
    let positions: Vec<usize> = (0..t).map(|_| rng.below(1 << 18)).collect();
    let (cos, sin) = cos_sin(&yarn_table(64)?, &positions)?;
    let weight = Tensor::from_vec((0..d).map(|_| 0.25 + rng.uniform()).collect::<Vec<f32>>(), d, &Device::Cpu)?;
    let slots_cpu = i64_tensor(&slots, &Device::Cpu)?;
    let what = format!("packed_insert {fmt} d={d} page={page} pages={pages} T={t}");

    let poison = |device: &Device| -> Result<Tensor> {
        Ok(Tensor::full(0xABu8, (pages, layout.page_bytes()), &Device::Cpu)?.to_device(device)?)
    };
    let inputs = [&rows, &cos, &sin, &slots_cpu, &weight];
    let gpu_inputs = to_dev(&inputs, &dev)?;
    let (cache_gpu, cache_cpu) = run_on_both(&dev, poison, &inputs, &gpu_inputs, |c, x| {
        packed_insert(c, &layout, x[0], x[1], x[2], x[3], norm.then_some((x[4], 1e-20)))
    })?;
    let (g, c) = (cache_gpu.flatten_all()?.to_vec1::<u8>()?, cache_cpu.flatten_all()?.to_vec1::<u8>()?);
    let diff: Vec<usize> = (0..g.len()).filter(|&i| g[i] != c[i]).take(8).collect();
    ensure!(diff.is_empty(), "{what}: bytes differ at {diff:?}");
    let poisoned_bytes = g.iter().filter(|&&b| b == 0xAB).count();
    let written = slots.iter().filter(|&&s| s >= 0).count();
    ensure!(poisoned_bytes >= (n - written) * layout.row_bytes(), "{what}: bytes of unwritten slots were changed");

    // The packed rows are the bf16 inserts' rows (format E: the index-key insert, with k_norm).
    if fmt == QatFormat::Fp4Ue8m0B32 && !norm {
        return Ok(());
    }
    let used: Vec<usize> = slots.iter().filter(|&&s| s >= 0).map(|&s| s as usize).collect();
    let unpacked = layout.unpack(&cache_gpu, &used)?;
    let bf16_cache = poisoned(n, d, &dev)?;
    let [r, c, s, sl, weight_gpu] = &gpu_inputs[..] else { unreachable!("five inputs") };
    match fmt {
        QatFormat::Fp8Ue8m0B32 => window_insert(&bf16_cache, r, c, s, sl, true)?,
        QatFormat::Fp4E4m3B16 => compressed_insert(&bf16_cache, r, c, s, sl, true)?,
        QatFormat::Fp4Ue8m0B32 => index_key_insert(&bf16_cache, r, weight_gpu, 1e-20, c, s, sl, true)?,
    }
    let idx = Tensor::from_vec(used.iter().map(|&u| u as u32).collect::<Vec<_>>(), used.len(), &dev)?;
    let want = bf16_cache.index_select(&idx, 0)?;
    assert_same_bits(&unpacked.to_dtype(DType::BF16)?, &want, &format!("{what}: unpacked vs bf16 insert"))?;
    Ok(())
}

#[test]
fn packed_window_rows_format_a() -> Result<()> {
    check_packed(50, QatFormat::Fp8Ue8m0B32, 512, 32, 5, 77, false)?; // 528 B rows, 32-token pages
    check_packed(51, QatFormat::Fp8Ue8m0B32, 512, 1, 3, 1, false) // decode, one-token pages
}

#[test]
fn packed_compressed_rows_format_b() -> Result<()> {
    check_packed(52, QatFormat::Fp4E4m3B16, 512, 16, 4, 63, false)?; // 288 B rows (the bf16-pair kernel)
    check_packed(57, QatFormat::Fp4E4m3B16, 512, 12, 5, 50, false) // pages of 12: the generic kernel
}

#[test]
fn packed_index_rows_format_e() -> Result<()> {
    check_packed(53, QatFormat::Fp4Ue8m0B32, 128, 64, 3, 150, true)?; // 68 B rows with k_norm
    check_packed(54, QatFormat::Fp4Ue8m0B32, 128, 4, 2, 7, true)?;
    check_packed(60, QatFormat::Fp4Ue8m0B32, 128, 12, 5, 50, true) // pages of 12: the division store path
}

#[test]
fn index_key_and_format_e_paths() -> Result<()> {
    // The one-warp-per-key path for shapes the quarter-warp path does not take.
    check_index_keys_with(35, 128, 32, 1e-20, 100, 128, false)?; // R = 32
    check_index_keys_with(36, 128, 64, 1e-20, 100, 128, true)?; // cos/sin not 8-byte aligned
    // Prefill sizes: more row sets than the persistent grid has warps (each warp walks several).
    check_index_keys(37, 128, 1e-20, 40000, 40960)?;
    check_packed(58, QatFormat::Fp4Ue8m0B32, 128, 64, 700, 40000, true)?;
    // Format E without the norm.
    check_packed(59, QatFormat::Fp4Ue8m0B32, 128, 16, 8, 100, false)
}

/// Format A rows with NaN elements: lanes holding a NaN quotient take the bit path instead of
/// the hardware conversion. Bytes must match the CPU except the sign bit of NaN codes (the
/// NaN's sign differs by device). (No inf: an infinite block amax has no UE8M0 scale byte, and
/// the CPU packer rejects it.)
#[test]
fn packed_format_a_with_nan_values() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(64);
    let t = 300;
    let positions: Vec<usize> = (0..t).map(|_| rng.below(1 << 16)).collect();
    let (cos, sin) = cos_sin(&yarn_table(64)?, &positions)?;
    let slots_cpu = i64_tensor(&(0..t as i64).collect::<Vec<_>>(), &Device::Cpu)?;
    let layout = PackedLayout::new(QatFormat::Fp8Ue8m0B32, 512, 16)?;
    let mut v = random_rows(&mut rng, t, 512, &Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    for r in 0..t {
        for _ in 0..2 {
            v[r * 512 + rng.below(512 - 64)] = f32::NAN;
        }
    }
    let rows = Tensor::from_vec(v, (t, 512), &Device::Cpu)?.to_dtype(DType::BF16)?;
    let cpu_cache = Tensor::full(0xABu8, (t.div_ceil(16), layout.page_bytes()), &Device::Cpu)?;
    let gpu_cache = cpu_cache.to_device(&dev)?;
    packed_insert(&cpu_cache, &layout, &rows, &cos, &sin, &slots_cpu, None)?;
    let (c, s, sl) = (cos.to_device(&dev)?, sin.to_device(&dev)?, slots_cpu.to_device(&dev)?);
    packed_insert(&gpu_cache, &layout, &rows.to_device(&dev)?, &c, &s, &sl, None)?;
    let (g, cc) = (gpu_cache.flatten_all()?.to_vec1::<u8>()?, cpu_cache.flatten_all()?.to_vec1::<u8>()?);
    let nan_code = |b: u8| b & 0x7f == 0x7f;
    let diff: Vec<usize> =
        (0..g.len()).filter(|&i| if nan_code(cc[i]) { !nan_code(g[i]) } else { g[i] != cc[i] }).take(8).collect();
    ensure!(diff.is_empty(), "packed A with NaN: bytes differ at {diff:?}");
    ensure!(cc.iter().filter(|&&b| b & 0x7f == 0x7f).count() >= t, "packed A with NaN: too few NaN codes");
    Ok(())
}

/// Quant blocks whose Q3 scale exceeds 2^119 take the f32 element path of the quarter-warp
/// kernels (their bf16-pair path needs 64 * 2^(k+2) finite): index keys whose norm weight is
/// 2^120 on the first block (scales up to 2^122, both paths across the rows), and
/// format E rows of magnitudes up to ~2^124 without the norm; bit for bit against the CPU.
#[test]
fn row128_keys_with_huge_scales() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(71);
    let t = 200;
    let positions: Vec<usize> = (0..t).map(|_| rng.below(1 << 16)).collect();
    let (cos, sin) = cos_sin(&yarn_table(64)?, &positions)?;
    let slots_cpu = i64_tensor(&(0..t as i64).collect::<Vec<_>>(), &Device::Cpu)?;
    let (c, s, sl) = (cos.to_device(&dev)?, sin.to_device(&dev)?, slots_cpu.to_device(&dev)?);
    let huge = 2f32.powi(120);
    let weight =
        Tensor::from_vec((0..128).map(|i| if i < 32 { huge } else { 0.5 + rng.uniform() }).collect::<Vec<f32>>(), 128, &Device::Cpu)?;
    let rows = random_rows(&mut rng, t, 128, &Device::Cpu)?;
    let (cache_cpu, cache_gpu) = (poisoned(t, 128, &Device::Cpu)?, poisoned(t, 128, &dev)?);
    index_key_insert(&cache_cpu, &rows, &weight, 1e-20, &cos, &sin, &slots_cpu, true)?;
    index_key_insert(&cache_gpu, &rows.to_device(&dev)?, &weight.to_device(&dev)?, 1e-20, &c, &s, &sl, true)?;
    assert_same_bits(&cache_gpu, &cache_cpu, "index keys with scales near 2^120")?;
    let big = cache_cpu.to_dtype(DType::F32)?.abs()?.max_keepdim(1)?.flatten_all()?.to_vec1::<f32>()?;
    ensure!(big.iter().any(|&v| v > 2f32.powi(122)) && big.iter().any(|&v| v < 2f32.powi(121)), "scales: {big:?}");

    let layout = PackedLayout::new(QatFormat::Fp4Ue8m0B32, 128, 16)?;
    let rows = (random_rows(&mut rng, t, 128, &Device::Cpu)?.to_dtype(DType::F32)? * 2f64.powi(115))?.to_dtype(DType::BF16)?;
    let cpu_cache = Tensor::full(0xABu8, (t.div_ceil(16), layout.page_bytes()), &Device::Cpu)?;
    let gpu_cache = cpu_cache.to_device(&dev)?;
    packed_insert(&cpu_cache, &layout, &rows, &cos, &sin, &slots_cpu, None)?;
    packed_insert(&gpu_cache, &layout, &rows.to_device(&dev)?, &c, &s, &sl, None)?;
    let (g, cc) = (gpu_cache.flatten_all()?.to_vec1::<u8>()?, cpu_cache.flatten_all()?.to_vec1::<u8>()?);
    let diff: Vec<usize> = (0..g.len()).filter(|&i| g[i] != cc[i]).take(8).collect();
    ensure!(diff.is_empty(), "packed E of huge rows: bytes differ at {diff:?}");
    Ok(())
}

// --------------------------------------------------------------------- large calls, specials

#[test]
fn inserts_with_thousands_of_rows() -> Result<()> {
    // Many blocks of the row kernels (several rows per warp, a partial last warp).
    check_window(10, 512, 64, 8192, &[(0, 5000), (17, 3)], true)?;
    check_compressed(23, 512, 2, 2048, &[(0, 4001)])?;
    check_index_keys(34, 128, 1e-20, 3001, 4096)?;
    check_packed(55, QatFormat::Fp8Ue8m0B32, 512, 64, 40, 2500, false)?;
    check_packed(56, QatFormat::Fp4E4m3B16, 512, 64, 40, 2100, false)?;
    check_packed(57, QatFormat::Fp4Ue8m0B32, 128, 64, 40, 2300, true)
}

/// `[rows, d]` random rows with special values written into the unrotated dims [0, d - 64):
/// signed zeros, bf16 subnormals, values at the quant grids' tie points and huge magnitudes;
/// with `non_finite`, also +-inf and NaN.
fn special_rows(rng: &mut Rng, rows: usize, d: usize, non_finite: bool) -> Result<Tensor> {
    let mut v = random_rows(rng, rows, d, &Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let mut specials = vec![0.0, -0.0, 1e-40, -3e-39, 0.25, -0.75, 2.5, 5.0, 448.0, -464.0, 6.5e4, -1e30, 3.0e38];
    if non_finite {
        specials.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN]);
    }
    for r in 0..rows {
        for _ in 0..6 {
            v[r * d + rng.below(d - 64)] = specials[rng.below(specials.len())];
        }
    }
    Ok(Tensor::from_vec(v, (rows, d), &Device::Cpu)?.to_dtype(DType::BF16)?)
}

#[test]
fn inserts_of_special_values() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(60);
    let t = 300;
    let positions: Vec<usize> = (0..t).map(|_| rng.below(1 << 16)).collect();
    let (cos, sin) = cos_sin(&yarn_table(64)?, &positions)?;
    let slots: Vec<i64> = (0..t as i64).collect();
    let slots_cpu = i64_tensor(&slots, &Device::Cpu)?;
    let (c, s, sl) = (cos.to_device(&dev)?, sin.to_device(&dev)?, slots_cpu.to_device(&dev)?);
    let weight = Tensor::from_vec((0..128).map(|_| 0.5 + rng.uniform()).collect::<Vec<f32>>(), 128, &Device::Cpu)?;
    let w_gpu = weight.to_device(&dev)?;
    for kind in 0..3 {
        let d = if kind == 2 { 128 } else { 512 };
        // No inf / NaN into the index keys: an inf makes the norm divide inf / inf, a NaN whose
        // sign differs by device (x86 gives -NaN, CUDA +NaN), and Q3 maps a NaN to +-6 * s by
        // that sign, so CPU and GPU legitimately differ there.
        let rows = special_rows(&mut rng, t, d, kind != 2)?;
        let rows_gpu = rows.to_device(&dev)?;
        let (cache_cpu, cache_gpu) = (poisoned(t, d, &Device::Cpu)?, poisoned(t, d, &dev)?);
        match kind {
            0 => {
                window_insert(&cache_cpu, &rows, &cos, &sin, &slots_cpu, true)?;
                window_insert(&cache_gpu, &rows_gpu, &c, &s, &sl, true)?;
            }
            1 => {
                compressed_insert(&cache_cpu, &rows, &cos, &sin, &slots_cpu, true)?;
                compressed_insert(&cache_gpu, &rows_gpu, &c, &s, &sl, true)?;
            }
            _ => {
                index_key_insert(&cache_cpu, &rows, &weight, 1e-20, &cos, &sin, &slots_cpu, true)?;
                index_key_insert(&cache_gpu, &rows_gpu, &w_gpu, 1e-20, &c, &s, &sl, true)?;
            }
        }
        assert_same_bits_nan_eq(&cache_gpu, &cache_cpu, &format!("insert kind {kind} of special values"))?;
    }
    // Packed formats: finite specials (a NaN's code carries its sign, which differs by device).
    for (seed, fmt, d, norm) in
        [(61, QatFormat::Fp8Ue8m0B32, 512, false), (62, QatFormat::Fp4E4m3B16, 512, false), (63, QatFormat::Fp4Ue8m0B32, 128, true)]
    {
        let mut rng = Rng(seed);
        let layout = PackedLayout::new(fmt, d, 16)?;
        let rows = special_rows(&mut rng, t, d, false)?;
        let pages = t.div_ceil(16);
        let cpu_cache = Tensor::full(0xABu8, (pages, layout.page_bytes()), &Device::Cpu)?;
        let gpu_cache = cpu_cache.to_device(&dev)?;
        let w = if d == 128 { Some((&weight, 1e-20)) } else { None };
        packed_insert(&cpu_cache, &layout, &rows, &cos, &sin, &slots_cpu, w)?;
        let wg = if d == 128 { Some((&w_gpu, 1e-20)) } else { None };
        packed_insert(&gpu_cache, &layout, &rows.to_device(&dev)?, &c, &s, &sl, wg)?;
        let (g, cc) = (gpu_cache.flatten_all()?.to_vec1::<u8>()?, cpu_cache.flatten_all()?.to_vec1::<u8>()?);
        let diff: Vec<usize> = (0..g.len()).filter(|&i| g[i] != cc[i]).take(8).collect();
        ensure!(diff.is_empty(), "packed {fmt} special values (norm {norm}): bytes differ at {diff:?}");
    }
    Ok(())
}

// ------------------------------------------------------------------------------------ errors

#[test]
fn errors_name_the_bad_argument() -> Result<()> {
    let dev = gpu();
    let cache = poisoned(4, 512, &dev)?;
    let kv = Tensor::zeros((2, 512), DType::F32, &dev)?;
    let cos = Tensor::zeros((2, 32), DType::F32, &dev)?;
    let slots = i64_tensor(&[0, 1], &dev)?;
    let e = window_insert(&cache, &kv, &cos, &cos, &slots, true).unwrap_err().to_string();
    ensure!(e.contains("bf16") && e.contains("rows"), "unexpected error: {e}");
    let kv = kv.to_dtype(DType::BF16)?;
    let bad_slots = Tensor::zeros(2, DType::U32, &dev)?;
    let e = window_insert(&cache, &kv, &cos, &cos, &bad_slots, true).unwrap_err().to_string();
    ensure!(e.contains("slots") && e.contains("i64"), "unexpected error: {e}");
    let e = window_insert(&cache, &kv, &cos.to_device(&Device::Cpu)?, &cos, &slots, true).unwrap_err().to_string();
    ensure!(e.contains("cos"), "unexpected error: {e}");
    let odd = poisoned(4, 96, &dev)?;
    let e = window_insert(&odd, &kv.narrow(1, 0, 96)?, &cos, &cos, &slots, false).unwrap_err().to_string();
    ensure!(e.contains("head_dim") && e.contains("96"), "unexpected error: {e}");
    Ok(())
}
