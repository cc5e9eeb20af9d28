//! The cache pool (`attention::CachePool`) on the embedded Shakespeare model, CPU: sequences
//! whose window rings live in the pool give bit for bit the logits and rings of private caches
//! in batched forwards; a full pool refuses a new sequence with a typed error and every admitted
//! sequence runs on unharmed; a finished sequence's pages are reused, zeroed. With the `cuda`
//! feature the same for packed (format A) rings, still on the CPU.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use deepseek_v41::attention::{CachePool, CacheStorage, PoolError};
use deepseek_v41::model::{BatchItem, ModelCache, Pretrained};
use deepseek_v41::Numerics;

/// The embedded model (`models/v41-shakespeare-tiny`).
fn load() -> Result<Pretrained> {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/v41-shakespeare-tiny");
    Ok(Pretrained::load_dir(&dir, Numerics::REFERENCE, DType::BF16, &Device::Cpu)?)
}

/// Prompt i: BOS then `5 + 9·i` ids (some past the 32-token window).
fn prompt(i: usize) -> Vec<u32> {
    let mut v = vec![0];
    v.extend((0..5 + 9 * i).map(|j| (17 + 31 * j + 7 * i) as u32 % 4000 + 3));
    v
}

fn bits(t: &Tensor) -> Result<Vec<Vec<f32>>> {
    Ok(t.to_dtype(DType::F32)?.to_vec2::<f32>()?)
}

/// Runs `steps` batched calls over `caches` (the prompts, then one decode token per step) and
/// returns every call's logits.
fn run(p: &Pretrained, caches: &mut [ModelCache], first: usize, steps: usize) -> Result<Vec<Vec<Vec<f32>>>> {
    let mut out = Vec::new();
    for s in 0..steps {
        let chunks: Vec<Vec<u32>> = (0..caches.len())
            .map(|i| if caches[i].seq_len() == 0 { prompt(first + i) } else { vec![(100 + 13 * (first + i) + 7 * s) as u32] })
            .collect();
        let mut items: Vec<BatchItem> = chunks.iter().zip(caches.iter_mut()).map(|(t, c)| BatchItem::new(t, c)).collect();
        out.push(bits(&p.model.forward_batch(&mut items)?.logits)?);
    }
    Ok(out)
}

/// Every layer's ring rows of `c`.
fn rings(c: &ModelCache, layers: usize) -> Result<Vec<Vec<Vec<f32>>>> {
    (0..layers).map(|l| bits(&c.attention.layer(l)?.window.ring_rows()?)).collect()
}

fn pooled_equals_private(storage: CacheStorage) -> Result<()> {
    let p = load()?;
    let layers = p.config.layers.len();
    let pool = CachePool::new(&p.config, storage, DType::BF16, &Device::Cpu, 4)?;
    let mut pooled: Vec<ModelCache> = (0..4).map(|_| ModelCache::admit(&pool)).collect::<candle_core::Result<_>>()?;
    let mut private: Vec<ModelCache> = (0..4).map(|_| p.new_cache_with(storage)).collect::<candle_core::Result<_>>()?;
    let occ = pool.occupancy();
    assert_eq!((occ.used_pages, occ.total_pages, occ.sequences), (4 * layers, 4 * layers, 4));
    assert_eq!(run(&p, &mut pooled, 0, 6)?, run(&p, &mut private, 0, 6)?);
    for (a, b) in pooled.iter().zip(&private) {
        assert_eq!(rings(a, layers)?, rings(b, layers)?);
    }
    // Page tables: distinct pages, one per layer.
    let mut pages: Vec<usize> = pooled.iter().flat_map(|c| c.pool_pages().unwrap().to_vec()).collect();
    pages.sort();
    pages.dedup();
    assert_eq!(pages.len(), 4 * layers);
    Ok(())
}

/// Pooled caches run bit for bit like private ones (logits of every call, final rings).
#[test]
fn pooled_caches_run_like_private_ones() -> Result<()> {
    pooled_equals_private(CacheStorage::Bf16)
}

/// The same with packed (format A) rings in the pool.
#[cfg(feature = "cuda")]
#[test]
fn packed_pooled_caches_run_like_private_ones() -> Result<()> {
    pooled_equals_private(CacheStorage::Packed)
}

/// A full pool refuses a sequence with `PoolError::Full`; the admitted sequences go on exactly
/// like private caches.
#[test]
fn a_full_pool_is_an_error_and_harms_no_sequence() -> Result<()> {
    let p = load()?;
    let layers = p.config.layers.len();
    let pool = CachePool::new(&p.config, CacheStorage::Bf16, DType::BF16, &Device::Cpu, 2)?;
    let mut pooled: Vec<ModelCache> = (0..2).map(|_| ModelCache::admit(&pool)).collect::<candle_core::Result<_>>()?;
    let mut private: Vec<ModelCache> = (0..2).map(|_| p.new_cache()).collect::<candle_core::Result<_>>()?;
    assert_eq!(run(&p, &mut pooled, 0, 2)?, run(&p, &mut private, 0, 2)?);
    let err = ModelCache::admit(&pool).unwrap_err();
    let full = PoolError::Full { needed: layers, free: 0, total: 2 * layers };
    assert!(err.to_string().starts_with(&full.to_string()), "{err}");
    assert_eq!(pool.occupancy().sequences, 2);
    assert_eq!(run(&p, &mut pooled, 0, 3)?, run(&p, &mut private, 0, 3)?);
    for (a, b) in pooled.iter().zip(&private) {
        assert_eq!(a.seq_len(), b.seq_len());
        assert_eq!(rings(a, layers)?, rings(b, layers)?);
    }
    Ok(())
}

/// A finished (dropped) sequence gives its pages back; the next sequence reuses them, zeroed, and
/// runs like a fresh private cache.
#[test]
fn finished_sequences_give_their_pages_back() -> Result<()> {
    let p = load()?;
    let layers = p.config.layers.len();
    let pool = CachePool::new(&p.config, CacheStorage::Bf16, DType::BF16, &Device::Cpu, 1)?;
    let mut first = vec![ModelCache::admit(&pool)?];
    run(&p, &mut first, 3, 4)?;
    let pages = first[0].pool_pages().unwrap().to_vec();
    assert!(ModelCache::admit(&pool).is_err());
    // A clone shares the pages: they come back only when the last one is dropped.
    let clone = first[0].clone();
    drop(first);
    assert_eq!(pool.occupancy().used_pages, layers);
    drop(clone);
    assert_eq!((pool.occupancy().used_pages, pool.occupancy().sequences), (0, 0));
    let mut again = vec![ModelCache::admit(&pool)?];
    assert_eq!(again[0].pool_pages().unwrap(), pages.as_slice());
    let mut private = vec![p.new_cache()?];
    assert_eq!(rings(&again[0], layers)?, rings(&private[0], layers)?, "reused pages are zeroed");
    assert_eq!(run(&p, &mut again, 1, 4)?, run(&p, &mut private, 1, 4)?);
    Ok(())
}
