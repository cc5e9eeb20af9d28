//! Test data and comparisons of `tests/cuda_indexer.rs`: Q3 fake-quantized queries / keys, head
//! weights, packed MXFP4 key pages, wide-scaled key sources with per-query bases, kept-candidate
//! rows, output poisoning, and the bit-exact / identical-ids assertions.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::attention::indexer::Candidates;
use deepseek_v41::cuda::{IndexKeys, KeySource, PackedLayout, Visibility};
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
