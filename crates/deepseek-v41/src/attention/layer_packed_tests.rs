//! The fused layer on packed caches (formats A / B / E) against bf16 caches, on the CPU (the ops'
//! references): bit-identical outputs, top-k sets, window rows and cache contents over prefills
//! longer than the window, chunked prefills and decode, with growth of the paged stores over
//! several pages; packed storage with the fake quant off is refused.

use candle_core::{DType, Device, Result, Tensor};

use super::Attention;
use crate::attention::storage::PACKED_PAGE_TOKENS;
use crate::attention::{CacheStorage, SequenceCache, Trace};
use crate::config::Config;
use crate::nn::RandomWeights;
use crate::numerics::Numerics;

fn layers(cfg: &Config, numerics: Numerics) -> Result<Vec<Attention>> {
    let vb = RandomWeights::new(23).var_builder(DType::BF16, &Device::Cpu);
    (0..cfg.num_hidden_layers).map(|l| Attention::new(cfg, l, numerics, vb.pp("layers").pp(l).pp("attn"))).collect()
}

/// Every layer over `calls` (chunk lengths) on a cache in `storage` (through `forward`, which
/// takes the fused path for a packed cache, or `forward_fused`); returns each layer's outputs,
/// then every traced tensor (window rows, top-k, candidate blocks) and the final cache contents
/// (ring rows, compressed entries, index keys) by name.
fn run(storage: CacheStorage, via_forward: bool, calls: &[usize], xs: &[Tensor]) -> Result<Vec<(String, Tensor)>> {
    let cfg = crate::test_util::tiny_config();
    let layers = layers(&cfg, Numerics::REFERENCE)?;
    let mut cache = SequenceCache::with_storage(&cfg, storage, DType::BF16, &Device::Cpu)?;
    assert_eq!(cache.storage(), storage);
    cache.set_trace(Some(Trace::new()));
    let mut outs = vec![Vec::new(); layers.len()];
    let mut start = 0;
    for &n in calls {
        for (l, a) in layers.iter().enumerate() {
            let x = xs[l].narrow(0, start, n)?;
            let y = if via_forward { a.forward(&x, start, &mut cache)? } else { a.forward_fused(&x, start, &mut cache, &mut |_| {})? };
            outs[l].push(y);
        }
        start += n;
    }
    let mut named = Vec::new();
    for (l, o) in outs.iter().enumerate() {
        named.push((format!("L{l}.out"), Tensor::cat(o, 0)?));
    }
    let trace = cache.trace().expect("trace installed");
    let mut names: Vec<String> = trace.names().map(str::to_string).collect();
    names.sort();
    for name in names {
        if let Some(t) = trace.concat(&name)? {
            named.push((name, t));
        }
    }
    for l in 0..cfg.num_hidden_layers {
        let state = cache.layer(l)?;
        assert_eq!(state.window.storage(), storage, "layer {l} window");
        named.push((format!("L{l}.ring"), state.window.ring_rows()?));
        if let Some(src) = &state.source {
            assert_eq!((src.compressed.storage(), src.index_keys.storage()), (storage, storage), "layer {l} source");
            named.push((format!("L{l}.compressed"), src.compressed.rows()?));
            named.push((format!("L{l}.index_keys"), src.index_keys.rows()?));
        }
    }
    Ok(named)
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
}

#[test]
fn packed_caches_give_bit_identical_layers_on_the_cpu() -> Result<()> {
    let cfg = crate::test_util::tiny_config();
    let w = cfg.sliding_window;
    // Ratio-1 sources hold n entries: more than two pages, so the paged stores grow twice.
    let n = 2 * PACKED_PAGE_TOKENS + 13;
    let xs = (0..cfg.num_hidden_layers)
        .map(|_| Tensor::randn(0f32, 1.0, (n, cfg.hidden_size), &Device::Cpu)?.to_dtype(DType::BF16))
        .collect::<Result<Vec<_>>>()?;
    let mut decode = vec![w + 3];
    decode.resize(decode.len() + n - decode[0], 1);
    let chunked = vec![5, 2 * w + 1, PACKED_PAGE_TOKENS + 3, n - 9 - 2 * w - PACKED_PAGE_TOKENS];
    for (what, calls) in [("full", vec![n]), ("chunked", chunked), ("decode", decode)] {
        let want = run(CacheStorage::Bf16, false, &calls, &xs)?;
        for via_forward in [false, true] {
            let got = run(CacheStorage::Packed, via_forward, &calls, &xs)?;
            let names = |v: &[(String, Tensor)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
            assert_eq!(names(&got), names(&want), "{what}: produced tensors differ");
            for ((name, g), (_, r)) in got.iter().zip(&want) {
                assert_eq!(g.dims(), r.dims(), "{what}: {name}");
                let (gb, rb) = (bits(g)?, bits(r)?);
                let differ = gb.iter().zip(&rb).filter(|(a, b)| a != b).count();
                assert_eq!(differ, 0, "{what} (forward: {via_forward}): {name}: {differ} of {} values differ", gb.len());
            }
        }
        // The runs saw top-k sets, candidate blocks and non-trivial outputs.
        assert!(want.iter().filter(|(n, _)| n.ends_with(".topk")).count() >= 4, "{what}: too few top-k traces");
        assert!(want.iter().any(|(n, _)| n.ends_with(".cand_blocks")), "{what}: no candidate blocks");
        let out = want.iter().find(|(n, _)| n == "L4.out").expect("L4 output");
        assert!(bits(&out.1)?.iter().any(|&b| b != 0), "{what}: all-zero output");
        // The compressed entries filled more than two pages.
        let entries = want.iter().find(|(n, _)| n == "L4.compressed").expect("L4 entries");
        assert_eq!(entries.1.dim(0)?, n, "{what}: ratio-1 source entries");
    }
    Ok(())
}

#[test]
fn packed_storage_differs_from_unquantized_rows_and_needs_the_fake_quant() -> Result<()> {
    let cfg = crate::test_util::tiny_config();
    let x = Tensor::randn(0f32, 1.0, (3, cfg.hidden_size), &Device::Cpu)?.to_dtype(DType::BF16)?;
    // Fake quant off: refused with an error naming the setting, for both entry points.
    let plain = Numerics { cache_fake_quant: false, ..Numerics::REFERENCE };
    let l0 = &layers(&cfg, plain)?[0];
    let mut cache = SequenceCache::with_storage(&cfg, CacheStorage::Packed, DType::BF16, &Device::Cpu)?;
    for err in [l0.forward(&x, 0, &mut cache).unwrap_err(), l0.forward_fused(&x, 0, &mut cache, &mut |_| {}).unwrap_err()] {
        assert!(err.to_string().contains("cache_fake_quant"), "{err}");
    }
    // Negative control: with the fake quant off the bf16 window rows are not fake quantized, so
    // they differ from what a packed cache (always quantized) would hold.
    let mut bf16 = SequenceCache::new(&cfg, DType::BF16, &Device::Cpu)?;
    l0.forward(&x, 0, &mut bf16)?;
    let l0q = &layers(&cfg, Numerics::REFERENCE)?[0];
    l0q.forward(&x, 0, &mut cache)?;
    let (a, b) = (bits(&bf16.layer(0)?.window.ring_rows()?)?, bits(&cache.layer(0)?.window.ring_rows()?)?);
    assert_ne!(a, b, "packed ring equals the unquantized ring");
    // The packed ring holds 132 B per 128-wide row, not bf16 rows; the reference-path entry
    // points refuse it.
    assert_eq!(cache.layer(0)?.window.ring().dtype(), DType::U8);
    let err = cache.restore_layer(0, 3, &Tensor::zeros((cfg.sliding_window, cfg.head_dim), DType::BF16, &Device::Cpu)?, None);
    assert!(err.unwrap_err().to_string().contains("packed storage"));
    Ok(())
}
