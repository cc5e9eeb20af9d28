//! Test data and comparisons of `tests/cuda_indexer.rs`: Q3 fake-quantized queries / keys, head
//! weights, packed MXFP4 key pages, wide-scaled key sources with per-query bases, kept-candidate
//! rows, output poisoning, the bit-exact / identical-ids assertions, `index_select` against the
//! CPU at several scratch budgets, and the integer tensor-core path's data.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::attention::indexer::Candidates;
use deepseek_v41::cuda::{index_select, index_select_with_options, IndexKeys, KeySource, PackedLayout, SelectOptions, Visibility};
use deepseek_v41::quant::fake_quant::{fake_quant, QatFormat};
use deepseek_v41::quant::packed::pack_row;
use half::bf16;

use crate::rng::Rng;

pub(crate) const D: usize = 128;

pub(crate) fn gpu() -> Device {
    Device::new_cuda(0).expect("tests/cuda_indexer.rs needs a CUDA device (none found)")
}


pub(crate) fn normal(rng: &mut Rng, shape: &[usize], amp: f32) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| amp * rng.normal()).collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

/// Q3 fake-quantized random values `shape` (last dim 128), bf16 on the CPU.
pub(crate) fn fq(rng: &mut Rng, shape: &[usize]) -> Result<Tensor> {
    Ok(fake_quant(&normal(rng, shape, 1.0)?, QatFormat::Fp4Ue8m0B32)?.to_dtype(DType::BF16)?)
}

/// Head weights `[T, H]` f32 with bf16 values, both signs.
pub(crate) fn weights(rng: &mut Rng, t: usize, h: usize) -> Result<Tensor> {
    Ok(normal(rng, &[t, h], 0.05)?.to_dtype(DType::BF16)?.to_dtype(DType::F32)?)
}

/// A packed MXFP4 cache holding `keys` `[N, 128]` at slots 0..N (pages of `page_size`).
pub(crate) fn pack(keys: &Tensor, page_size: usize, dev: &Device) -> Result<(Tensor, PackedLayout)> {
    let layout = PackedLayout::new(QatFormat::Fp4Ue8m0B32, D, page_size)?;
    let rows = keys.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let pages = rows.len().div_ceil(page_size).max(1);
    let mut bytes = vec![0u8; pages * layout.page_bytes()];
    for (s, row) in rows.iter().enumerate() {
        let (data, scales) = pack_row(QatFormat::Fp4Ue8m0B32, row)?;
        let base = (s / page_size) * layout.page_bytes();
        let r = s % page_size;
        bytes[base + r * 64..][..64].copy_from_slice(&data);
        bytes[base + page_size * 64 + r * 4..][..4].copy_from_slice(&scales);
    }
    Ok((Tensor::from_vec(bytes, (pages, layout.page_bytes()), &Device::Cpu)?.to_device(dev)?, layout))
}

/// Keys of `rows` fake-quantized rows, each scaled by a power of two in 2^-40..2^40 (scale bytes
/// on both sides of 128), packed in pages of `page` on the GPU, with per-query key bases and
/// visible counts: the sources of the same queries on the CPU and on the GPU.
pub(crate) struct WideScaledKeys {
    pub(crate) cache: Tensor,
    pub(crate) cache_cpu: Tensor,
    pub(crate) layout: PackedLayout,
    pub(crate) base_c: Tensor,
    pub(crate) vis_c: Tensor,
    pub(crate) base_g: Tensor,
    pub(crate) vis_g: Tensor,
}

impl WideScaledKeys {
    pub(crate) fn new(rng: &mut Rng, rows: usize, page: usize, bases: &[u32], counts: &[u32], dev: &Device) -> Result<Self> {
        let k = fq(rng, &[rows, D])?;
        let pow: Vec<f32> = (0..rows).map(|_| 2f32.powi(rng.below(81) as i32 - 40)).collect();
        let keys = k.to_dtype(DType::F32)?.broadcast_mul(&Tensor::from_vec(pow, (rows, 1), &Device::Cpu)?)?.to_dtype(DType::BF16)?;
        let (cache, layout) = pack(&keys, page, dev)?;
        let cache_cpu = cache.to_device(&Device::Cpu)?;
        let (base_c, vis_c) = (Tensor::new(bases, &Device::Cpu)?, Tensor::new(counts, &Device::Cpu)?);
        let (base_g, vis_g) = (base_c.to_device(dev)?, vis_c.to_device(dev)?);
        Ok(Self { cache, cache_cpu, layout, base_c, vis_c, base_g, vis_g })
    }

    /// The source of `n` entries per query: on the CPU, or on the GPU.
    pub(crate) fn source(&self, n: usize, gpu: bool) -> KeySource<'_> {
        let (cache, base, vis) =
            if gpu { (&self.cache, &self.base_g, &self.vis_g) } else { (&self.cache_cpu, &self.base_c, &self.vis_c) };
        KeySource { keys: IndexKeys::Packed { cache, layout: self.layout }, base: Some(base), pages: None, entries: n, visibility: Visibility::Counts(vis) }
    }
}

/// Random kept-candidate rows as the `Candidates` contract has them (ascending, distinct, −1
/// padded): `t` rows of at most `n_keep` of `n_blocks` blocks of `block` entries, on the CPU and on
/// `dev`.
pub(crate) fn random_candidates(rng: &mut Rng, t: usize, n_keep: usize, n_blocks: usize, block: usize, dev: &Device) -> Result<(Candidates, Candidates)> {
    let mut kept = Vec::with_capacity(t * n_keep);
    for _ in 0..t {
        let mut row: Vec<i64> = (0..n_keep).map(|_| rng.below(n_blocks) as i64).collect();
        row.sort_unstable();
        row.dedup();
        row.resize(n_keep, -1);
        kept.extend(row);
    }
    let kept = Tensor::from_vec(kept, (t, n_keep), &Device::Cpu)?;
    Ok((Candidates { block, kept: kept.clone() }, Candidates { block, kept: kept.to_device(dev)? }))
}

/// Allocates and frees poisoned buffers so fresh outputs likely reuse them.
pub(crate) fn poison(dev: &Device, elems: usize) -> Result<()> {
    let a = Tensor::full(f32::NAN, elems, dev)?.to_dtype(DType::BF16)?;
    let b = Tensor::full(0x5a5a_5a5a_5a5a_5a5ai64, elems, dev)?;
    let c = Tensor::full(f32::NAN, elems, dev)?;
    dev.synchronize()?;
    drop((a, b, c));
    Ok(())
}

pub(crate) fn bits(t: &Tensor) -> Result<Vec<u16>> {
    Ok(t.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<bf16>()?.iter().map(|x| x.to_bits()).collect())
}

pub(crate) fn ulps(a: u16, b: u16) -> u32 {
    let key = |x: u16| if x & 0x8000 != 0 { 0x8000 - (x & 0x7fff) as i32 } else { 0x8000 + x as i32 };
    (key(a) - key(b)).unsigned_abs()
}

/// GPU scores equal to the CPU's: bit-exact except ≤ 1/1000 one-ulp differences.
pub(crate) fn assert_scores_exact(what: &str, gpu: &Tensor, cpu: &Tensor) -> Result<()> {
    ensure!(gpu.dims() == cpu.dims(), "{what}: shapes {:?} vs {:?}", gpu.shape(), cpu.shape());
    let (g, c) = (bits(gpu)?, bits(cpu)?);
    let mut off = 0usize;
    for (i, (&a, &b)) in g.iter().zip(&c).enumerate() {
        if a != b {
            ensure!(ulps(a, b) <= 1, "{what}: element {i}: gpu {:#06x} cpu {:#06x}", a, b);
            off += 1;
        }
    }
    ensure!(off * 1000 <= g.len(), "{what}: {off} of {} scores differ by one ulp", g.len());
    println!("{what}: {} scores, {off} one-ulp differences", g.len());
    Ok(())
}

pub(crate) fn ids(t: &Tensor) -> Result<Vec<Vec<i64>>> {
    Ok(t.to_device(&Device::Cpu)?.to_vec2::<i64>()?)
}

pub(crate) fn assert_ids_equal(what: &str, gpu: &Tensor, cpu: &Tensor) -> Result<()> {
    ensure!(gpu.dims() == cpu.dims(), "{what}: shapes {:?} vs {:?}", gpu.shape(), cpu.shape());
    for (t, (g, c)) in ids(gpu)?.iter().zip(ids(cpu)?).enumerate() {
        ensure!(*g == c, "{what}: token {t}: gpu {:?}.. vs cpu {:?}..", &g[..g.len().min(16)], &c[..c.len().min(16)]);
    }
    Ok(())
}

/// `index_select` on the GPU with scratch budgets `scratches` must give the CPU reference's top-k
/// ids exactly. Returns those ids.
#[allow(clippy::too_many_arguments)]
pub(crate) fn select_with_scratches(
    dev: &Device,
    what: &str,
    q: &Tensor,
    w: &Tensor,
    cpu_src: &KeySource,
    gpu_src: &KeySource,
    k: usize,
    consume: Option<(&Candidates, &Candidates)>,
    scratches: &[usize],
) -> Result<Vec<Vec<i64>>> {
    let want = index_select(q, w, cpu_src, k, consume.map(|c| c.0), None)?;
    let (qg, wg) = (q.to_device(dev)?, w.to_device(dev)?);
    for &scratch_bytes in scratches {
        poison(dev, q.dim(0)? * k.max(2048))?;
        let opts = SelectOptions { scratch_bytes };
        let got = index_select_with_options(&qg, &wg, gpu_src, k, consume.map(|c| c.1), None, &opts)?;
        assert_ids_equal(&format!("{what} (scratch {scratch_bytes})"), &got.topk, &want.topk)?;
    }
    ids(&want.topk)
}

/// Rows (of `D` values) of `t` picked by `pick(row)` multiplied per 32-block: block b times 2^(step·b).
pub(crate) fn spread_blocks(t: Tensor, pick: &dyn Fn(usize) -> bool, step: i32) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let mut v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    for (i, row) in v.chunks_mut(D).enumerate() {
        if pick(i) {
            row.iter_mut().enumerate().for_each(|(d, x)| *x *= 2f32.powi(step * (d / 32) as i32));
        }
    }
    Ok(Tensor::from_vec(v, dims, &Device::Cpu)?.to_dtype(DType::BF16)?)
}

/// Q3 data for the integer tensor-core path and its fallbacks to the bf16 path: queries `[t, h,
/// D]` whose token i has its 32-blocks' scales spread by 6 (block b times 2^(2b): not s8
/// integers, so the token takes the bf16 path) when i % 3 == 0, head weights `[t, h]` 2^45 times
/// larger (past the path's exponent bounds) when i % 5 == 1, and `rows` keys whose row r has its
/// blocks spread by 6 the other way (not s8: a warp iteration of 32 keys that holds one takes the
/// bf16 path) in runs of 96 rows (r / 96 % 3 == 1, so that other iterations of the same tokens
/// take the integer path); the other tokens and keys are ordinary. (The spreads point opposite ways so that no
/// query-key product spans much more than 2^6 across blocks: within that the f32 sums are exact in
/// any order, see kernels/indexer_scores.cu.)
pub(crate) fn integer_path_data(rng: &mut Rng, t: usize, h: usize, rows: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let keys = spread_blocks(fq(rng, &[rows, D])?, &|r| r / 96 % 3 == 1, -2)?;
    let q = spread_blocks(fq(rng, &[t, h, D])?, &|r| (r / h).is_multiple_of(3), 2)?;
    let big_w: Vec<f32> = (0..t * h).map(|i| if (i / h) % 5 == 1 { 2f32.powi(45) } else { 1.0 }).collect();
    let w = (weights(rng, t, h)? * Tensor::from_vec(big_w, (t, h), &Device::Cpu)?)?;
    Ok((q, w, keys))
}
