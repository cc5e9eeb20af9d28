//! Module-level goldens (`modules/golden.safetensors`): number formats, RoPE tables, sparse
//! attention, the indexer, Sinkhorn and the Engram layout — each checked without running a model.
//! Tensor groups are recognised by name prefix; a group this checker does not know is skipped
//! with a reason rather than ignored.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;

use super::compare::{Report, Tolerance};
use super::{declared_token_map, GoldenSet};
use crate::attention::indexer::{index_scores, mask_invisible, top_k, IndexKeyProjection, Indexer};
use crate::attention::sparse_attention;
use crate::config::{CandidateRole, Config};
use crate::model::{split_sinkhorn, EngramHasher, EngramLayout, TokenMap};
use crate::nn::{RopeKind, RopeTable};
use crate::numerics::Numerics;

type Golden = HashMap<String, Tensor>;

fn get<'a>(g: &'a Golden, name: &str) -> Result<&'a Tensor> {
    g.get(name).ok_or_else(|| candle_core::Error::Msg(format!("module golden lacks `{name}`")))
}

/// Checks every module golden of the set.
pub fn check_modules(set: &GoldenSet, path: &Path, device: &Device, report: &mut Report) -> Result<()> {
    let g = candle_core::safetensors::load(path, device)?;
    let cfg = Config::from_file(set.root.join("config.json"))?;
    let mut done: BTreeSet<String> = BTreeSet::new();
    let mut mark = |prefix: &str| {
        for k in g.keys().filter(|k| k.starts_with(prefix)) {
            done.insert(k.clone());
        }
    };
    if g.keys().any(|k| k.starts_with("rope.")) {
        check_rope(&cfg, &g, report)?;
        mark("rope.");
    }
    if g.contains_key("sparse_attn.out") {
        check_sparse_attention(&g, report)?;
        mark("sparse_attn.");
    }
    for layer in indexer_layers(&g) {
        check_indexer(&cfg, layer, &g, report)?;
        mark(&format!("indexer.L{layer}."));
    }
    for prefix in super::module_formats::check_fake_quant(&g, report)? {
        mark(&prefix);
    }
    for prefix in super::module_formats::check_dequant(&g, &set.root.join("model.safetensors"), report)? {
        mark(&prefix);
    }
    if g.contains_key("hc_split_sinkhorn.mixes") {
        check_sinkhorn(&cfg, &g, report)?;
        mark("hc_split_sinkhorn.");
    }
    if let Some(e) = &cfg.engram {
        if check_engram_layout(set, e, &g, report)? {
            mark("engram.");
        }
    }
    let mut rest: Vec<&String> = g.keys().filter(|k| !done.contains(*k)).collect();
    rest.sort();
    for k in rest {
        if k.ends_with("_margin") {
            println!("NOTE modules/{k}: decision margin (metadata of the golden set, not an output)");
        } else {
            report.skip(&format!("modules/{k}"), "no module check for this group yet");
        }
    }
    Ok(())
}

fn check_sinkhorn(cfg: &Config, g: &Golden, report: &mut Report) -> Result<()> {
    let c = split_sinkhorn(
        get(g, "hc_split_sinkhorn.mixes")?,
        get(g, "hc_split_sinkhorn.scale")?,
        get(g, "hc_split_sinkhorn.base")?,
        cfg.hc_mult,
        cfg.hc_sinkhorn_iters,
        cfg.hc_eps,
    )?;
    for (n, t) in [("pre", &c.pre), ("post", &c.post), ("comb", &c.comb)] {
        report.check(&format!("modules/hc_split_sinkhorn.{n}"), t, get(g, &format!("hc_split_sinkhorn.{n}"))?, Tolerance::Abs(1e-6))?;
    }
    Ok(())
}

/// `engram.{primes, offsets, multipliers, pad_id_compressed, token_map}`; returns whether the
/// group was present.
fn check_engram_layout(set: &GoldenSet, cfg: &crate::config::EngramConfig, g: &Golden, report: &mut Report) -> Result<bool> {
    let Some(primes_g) = g.get("engram.primes") else { return Ok(false) };
    let layout = EngramLayout::new(cfg)?;
    let dev = primes_g.device();
    let collect = |f: &dyn Fn(&crate::model::EngramLayerLayout) -> Vec<u64>| -> Result<Tensor> {
        let v: Vec<i64> = layout.layers().iter().flat_map(|l| f(l)).map(|x| x as i64).collect();
        Tensor::new(v, dev)
    };
    let exact = Tolerance::Exact;
    let as_i64 = |t: &Tensor| t.to_dtype(DType::I64)?.flatten_all();
    report.check("modules/engram.primes", &collect(&|l| l.primes.clone())?, &as_i64(primes_g)?, exact)?;
    report.check("modules/engram.offsets", &collect(&|l| l.offsets.clone())?, &as_i64(get(g, "engram.offsets")?)?, exact)?;
    report.check("modules/engram.multipliers", &collect(&|l| l.multipliers.clone())?, &as_i64(get(g, "engram.multipliers")?)?, exact)?;
    if let (Some(map), Some(pad)) = (g.get("engram.token_map"), g.get("engram.pad_id_compressed")) {
        let map_v: Vec<u32> = map.to_dtype(DType::I64)?.to_vec1::<i64>()?.into_iter().map(|x| x as u32).collect();
        let hasher = EngramHasher::new(cfg, TokenMap::new(map_v)?)?;
        let ours = Tensor::new(&[hasher.pad_compressed() as i64], dev)?;
        report.check("modules/engram.pad_id_compressed", &ours, &as_i64(pad)?, exact)?;
        // The map the cases declare (their inputs.json) must be the one the set stores.
        let vocab = map.dim(0)?;
        let declared = set.cases.first().map(|c| set.load_inputs(c)).transpose()?.and_then(|i| declared_token_map(&i, vocab));
        match declared {
            Some(d) => {
                let v: Vec<i64> = (0..vocab as u32).map(|t| d.get(t).map(|c| c as i64)).collect::<Result<_>>()?;
                report.check("modules/engram.token_map", &Tensor::new(v, dev)?, &as_i64(map)?, exact)?;
            }
            None => println!("NOTE modules/engram.token_map: the cases declare no known map; the set's map is used as input"),
        }
    }
    Ok(true)
}

fn check_rope(cfg: &Config, g: &Golden, report: &mut Report) -> Result<()> {
    for (kind_name, ratio) in [("ratio0", 0usize), ("compressed", 1)] {
        let p = format!("rope.{kind_name}");
        let Some(cos_g) = g.get(&format!("{p}.cos")) else { continue };
        let n = cos_g.dim(0)?;
        let rd = 2 * cos_g.dim(1)?;
        let table = RopeTable::new(rd, &RopeKind::for_ratio(cfg, ratio), cos_g.device())?;
        let positions: Vec<usize> = (0..n).collect();
        let (cos, sin) = table.cos_sin(&positions)?;
        let ulp1 = Tolerance::Ulps { ulps: 1.0, mantissa_bits: 7 };
        report.check(&format!("modules/{p}.cos"), &cos, cos_g, Tolerance::Abs(1.2e-7))?;
        report.check(&format!("modules/{p}.sin"), &sin, get(g, &format!("{p}.sin"))?, Tolerance::Abs(1.2e-7))?;
        let x = get(g, &format!("{p}.apply_in"))?;
        let (_, np, h, d) = x.dims4()?;
        // The rotation runs in f32 on bf16 inputs and rounds to bf16, as the reference does.
        let x3 = x.reshape((np, h, d))?.to_dtype(DType::BF16)?;
        let out = table.apply(&x3, &positions[..np], false)?;
        let out_g = get(g, &format!("{p}.apply_out"))?.reshape((np, h, d))?;
        report.check(&format!("modules/{p}.apply_out"), &out, &out_g, ulp1)?;
        let back = table.apply(&out_g.to_dtype(DType::BF16)?, &positions[..np], true)?;
        report.check(
            &format!("modules/{p}.apply_inverse_of_out"),
            &back,
            &get(g, &format!("{p}.apply_inverse_of_out"))?.reshape((np, h, d))?,
            ulp1,
        )?;
    }
    Ok(())
}

fn check_sparse_attention(g: &Golden, report: &mut Report) -> Result<()> {
    let q = get(g, "sparse_attn.q")?.squeeze(0)?;
    let kv = get(g, "sparse_attn.kv")?.squeeze(0)?;
    let idx = get(g, "sparse_attn.idx")?.squeeze(0)?.to_dtype(DType::I64)?;
    let sink = get(g, "sparse_attn.sink")?;
    let scale = (q.dim(2)? as f32).powf(-0.5);
    let out = sparse_attention(&q.to_dtype(DType::BF16)?, &kv.to_dtype(DType::BF16)?, &idx, sink, scale)?;
    let want = get(g, "sparse_attn.out")?.squeeze(0)?;
    report.check("modules/sparse_attn.out", &out, &want, Tolerance::Ulps { ulps: 1.0, mantissa_bits: 7 })
}

fn indexer_layers(g: &Golden) -> Vec<usize> {
    let mut v: Vec<usize> = g
        .keys()
        .filter_map(|k| k.strip_prefix("indexer.L")?.split('.').next()?.parse().ok())
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// FP8 32x32-block weight from golden bytes (`[out, in]` e4m3, `[ceil(out/32), ceil(in/32)]` e8m0).
fn fp8_weight(w: &Tensor, s: &Tensor) -> Result<Tensor> {
    let (o, i) = w.dims2()?;
    let wb = w.to_dtype(DType::U8)?.flatten_all()?.to_vec1::<u8>()?;
    let sb = s.to_dtype(DType::U8)?.flatten_all()?.to_vec1::<u8>()?;
    let v = crate::loader::dequant::dequant_fp8_block32(&wb, &sb, o, i)?;
    Tensor::from_vec(v, (o, i), w.device())
}

fn check_indexer(cfg: &Config, layer: usize, g: &Golden, report: &mut Report) -> Result<()> {
    let p = format!("indexer.L{layer}");
    let dev = get(g, &format!("{p}.x"))?.device().clone();
    let ratio = match cfg.layers.get(layer).map(|r| r.attention) {
        Some(crate::config::AttentionRole::Compressed { ratio, .. }) => ratio,
        _ => candle_core::bail!("module golden {p}: layer {layer} is not a compressed layer in the set's config"),
    };
    let mut ws = HashMap::new();
    ws.insert("wq_b.weight".to_string(), fp8_weight(get(g, &format!("{p}.wq_b.weight_e4m3"))?, get(g, &format!("{p}.wq_b.scale_e8m0"))?)?);
    for n in ["weights_proj.weight", "wk.weight", "k_norm.weight"] {
        ws.insert(n.to_string(), get(g, &format!("{p}.{n}"))?.clone());
    }
    let vb = VarBuilder::from_tensors(ws, DType::BF16, &dev);
    let numerics = Numerics::REFERENCE;
    let indexer = Indexer::new(cfg, ratio, CandidateRole::None, numerics, vb.clone())?;
    let keys = IndexKeyProjection::new(cfg, numerics, vb)?;
    let rope = RopeTable::new(cfg.qk_rope_head_dim, &RopeKind::for_ratio(cfg, ratio), &dev)?;
    let x = get(g, &format!("{p}.x"))?.to_dtype(DType::BF16)?;
    let qr = get(g, &format!("{p}.qr"))?.to_dtype(DType::BF16)?;
    let latent = get(g, &format!("{p}.latent"))?.to_dtype(DType::BF16)?;
    let k = keys.keys(&latent, 0, ratio, &rope)?;
    report.check(&format!("modules/{p}.index_k"), &k, get(g, &format!("{p}.index_k"))?, Tolerance::Ulps { ulps: 0.0, mantissa_bits: 7 })?;
    let positions: Vec<usize> = (0..x.dim(0)?).collect();
    let q = indexer.queries(&qr, &positions, &rope)?;
    let w = indexer.head_weights(&x)?;
    let scores: Vec<Vec<f32>> = index_scores(&q, &w, get(g, &format!("{p}.index_k"))?)?
        .into_iter()
        .zip(&positions)
        .map(|(row, &pos)| mask_invisible(row, (pos + 1) / ratio))
        .collect();
    let topk: Vec<Vec<i64>> = scores.iter().zip(&positions).map(|(s, &pos)| top_k(s, cfg.index_topk, (pos + 1) / ratio)).collect();
    let scores = Tensor::new(scores, &dev)?;
    report.check(&format!("modules/{p}.score"), &scores, get(g, &format!("{p}.score"))?, Tolerance::Ulps { ulps: 1.0, mantissa_bits: 7 })?;
    report.check(&format!("modules/{p}.topk"), &Tensor::new(topk, &dev)?, get(g, &format!("{p}.topk"))?, Tolerance::IdSets)?;
    Ok(())
}
