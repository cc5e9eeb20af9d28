//! Golden checks of the decoder's non-attention parts (mHC, MoE, Engram) against the v41-tiny
//! golden set produced by the official reference (`tests/fixtures/v41-tiny`, README there).
//!
//! Attention is teacher-forced: the golden `L{l}.attn_out` / `L{l}.ffn_out` stand in for the
//! sublayer outputs, so the whole mHC stream, the Engram injection and the final head can be
//! checked without an attention implementation.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, IndexOp, Module, Tensor, D};
use candle_nn::VarBuilder;
use deepseek_v41::config::{Config, EngramConfig};
use deepseek_v41::loader::{var_builder, ReleaseCheckpoint};
use deepseek_v41::model::{
    collapse, post, split_sinkhorn, Engram, EngramHasher, EngramLayout, HcMix, HcSublayer, Moe,
    TokenMap,
};
use deepseek_v41::nn::{RmsNorm, RowGroups};
use deepseek_v41::Numerics;

fn fixtures() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/v41-tiny"
    ))
}

fn golden(case: &str) -> Result<HashMap<String, Tensor>> {
    let p = fixtures().join(case).join("golden.safetensors");
    candle_core::safetensors::load(&p, &Device::Cpu).with_context(|| format!("loading {p:?}"))
}

fn get<'a>(g: &'a HashMap<String, Tensor>, name: &str) -> Result<&'a Tensor> {
    g.get(name)
        .with_context(|| format!("golden tensor {name} missing"))
}

fn input_ids(case: &str) -> Result<Vec<u32>> {
    let p = fixtures().join(case).join("inputs.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p)?)?;
    let ids = v["input_ids"].as_array().context("input_ids")?;
    ids.iter()
        .map(|x| Ok(x.as_u64().context("input id")? as u32))
        .collect()
}

fn checkpoint() -> Result<(ReleaseCheckpoint, VarBuilder<'static>)> {
    let ckpt = ReleaseCheckpoint::open(&[fixtures().join("model.safetensors")])?;
    let vb = var_builder(ckpt.clone(), DType::BF16, &Device::Cpu);
    Ok((ckpt, vb))
}

/// The config of `case` (the HF `config.json` of the case folder).
fn case_config(case: &str) -> Result<Config> {
    Ok(Config::from_file(
        fixtures().join(case).join("config.json"),
    )?)
}

fn tiny_engram() -> Result<EngramConfig> {
    case_config("prefill_full")?
        .engram
        .context("the tiny config has an Engram section")
}

fn max_abs(a: &Tensor, b: &Tensor) -> Result<f32> {
    let d = (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?.abs()?;
    Ok(d.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

fn rel_frob(a: &Tensor, b: &Tensor) -> Result<f32> {
    let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
    let num = (&a - &b)?.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?;
    let den = b.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?;
    Ok(num / den)
}

fn i64s(t: &Tensor) -> Result<Vec<i64>> {
    Ok(t.flatten_all()?.to_dtype(DType::I64)?.to_vec1::<i64>()?)
}

// ---------------------------------------------------------------- mHC

#[test]
fn sinkhorn_module_golden() -> Result<()> {
    let g = golden("modules")?;
    let c = split_sinkhorn(
        get(&g, "hc_split_sinkhorn.mixes")?,
        get(&g, "hc_split_sinkhorn.scale")?,
        get(&g, "hc_split_sinkhorn.base")?,
        4,
        20,
        1e-6,
    )?;
    for (name, ours) in [("pre", &c.pre), ("post", &c.post), ("comb", &c.comb)] {
        let err = max_abs(ours, get(&g, &format!("hc_split_sinkhorn.{name}"))?)?;
        ensure!(err <= 1e-6, "split_sinkhorn {name}: max abs error {err}");
    }
    // Near doubly stochastic: the last step normalizes columns exactly, rows to within ~eps.
    let cols = c.comb.sum(1)?;
    let rows = c.comb.sum(2)?;
    ensure!(max_abs(&cols, &cols.ones_like()?)? < 1e-5, "column sums");
    ensure!(
        max_abs(&rows, &rows.ones_like()?)? < 0.05,
        "row sums: {rows}"
    );
    // With many more iterations the rows converge too (Sinkhorn, not just a column scaling).
    let long = split_sinkhorn(
        get(&g, "hc_split_sinkhorn.mixes")?,
        get(&g, "hc_split_sinkhorn.scale")?,
        get(&g, "hc_split_sinkhorn.base")?,
        4,
        500,
        1e-6,
    )?;
    let rows = long.comb.sum(2)?;
    ensure!(
        max_abs(&rows, &rows.ones_like()?)? < 1e-4,
        "row sums after 500 iterations: {rows}"
    );
    // Negative control: stopping after fewer iterations changes comb beyond the tolerance.
    let short = split_sinkhorn(
        get(&g, "hc_split_sinkhorn.mixes")?,
        get(&g, "hc_split_sinkhorn.scale")?,
        get(&g, "hc_split_sinkhorn.base")?,
        4,
        2,
        1e-6,
    )?;
    ensure!(
        max_abs(&short.comb, get(&g, "hc_split_sinkhorn.comb")?)? > 1e-4,
        "iteration count has no effect"
    );
    Ok(())
}

/// Per-layer mHC weights and norms.
struct LayerParts {
    attn_mix: HcMix,
    ffn_mix: HcMix,
    attn_norm: RmsNorm,
    ffn_norm: RmsNorm,
}

fn layer_parts(cfg: &Config, vb: &VarBuilder, l: usize) -> Result<LayerParts> {
    let vb = vb.pp("layers").pp(l);
    let d = cfg.hidden_size;
    Ok(LayerParts {
        attn_mix: HcMix::new(cfg, vb.clone(), HcSublayer::Attn)?,
        ffn_mix: HcMix::new(cfg, vb.clone(), HcSublayer::Ffn)?,
        attn_norm: RmsNorm::new(d, cfg.rms_norm_eps, vb.pp("attn_norm"))?,
        ffn_norm: RmsNorm::new(d, cfg.rms_norm_eps, vb.pp("ffn_norm"))?,
    })
}

fn check_coeffs(
    g: &HashMap<String, Tensor>,
    l: usize,
    site: &str,
    c: &deepseek_v41::model::HcCoeffs,
) -> Result<()> {
    for (name, ours) in [("pre", &c.pre), ("post", &c.post), ("comb", &c.comb)] {
        let key = format!("L{l}.hc_{site}_{name}");
        let err = max_abs(ours, get(g, &key)?)?;
        eprintln!("{key}: max abs error {err:.3e}");
        ensure!(err <= 1e-3, "{key}: max abs error {err}");
    }
    Ok(())
}

/// Runs the whole mHC stream of `prefill_full` with the golden attention and MoE outputs as the
/// sublayer outputs; checks every sublayer's coefficients and inputs, the Engram output of
/// layer 1 and the logits.
#[test]
fn mhc_stream_teacher_forced() -> Result<()> {
    let cfg = case_config("prefill_full")?;
    let (_ckpt, vb) = checkpoint()?;
    let g = golden("prefill_full")?;
    let ids = input_ids("prefill_full")?;
    let t = ids.len();
    let (d, hc) = (cfg.hidden_size, cfg.hc_mult);
    let embed = vb.get_with_hints_dtype(
        (cfg.vocab_size, d),
        "embed.weight",
        Default::default(),
        DType::BF16,
    )?;
    let h0 = embed.index_select(&Tensor::from_slice(&ids, t, &Device::Cpu)?, 0)?;
    let mut x = h0.unsqueeze(1)?.repeat((1, hc, 1))?;
    let mut p_in = Tensor::cat(
        &[
            Tensor::ones((t, 1), DType::F32, &Device::Cpu)?,
            Tensor::zeros((t, hc - 1), DType::F32, &Device::Cpu)?,
        ],
        1,
    )?;

    let ecfg = cfg.engram.clone().context("engram")?;
    let hasher = EngramHasher::new(&ecfg, TokenMap::div2(cfg.vocab_size))?;
    let hash = hasher.hash(&ids, &mut hasher.new_history())?;

    for l in 0..cfg.num_hidden_layers {
        let parts = layer_parts(&cfg, &vb, l)?;
        if ecfg.layer_ids.contains(&l) {
            let engram = Engram::new(
                &cfg,
                l,
                Numerics::REFERENCE,
                vb.pp("layers").pp(l).pp("engram"),
            )?;
            let injected = engram.forward(&x, &hash.tensor(l, &Device::Cpu)?)?;
            if let Some(want) = g.get(&format!("L{l}.engram_out")) {
                let err = rel_frob(&injected, want)?;
                eprintln!("L{l}.engram_out: rel Frobenius {err:.3e}");
                ensure!(err <= 1e-3, "L{l}.engram_out: rel Frobenius {err}");
                // Negative control: skipping the injection is visibly wrong.
                ensure!(
                    rel_frob(&x, want)? > 1e-2,
                    "L{l}: Engram injection has no effect"
                );
            }
            x = injected;
        }
        let a = parts.attn_mix.mixes(&x)?;
        check_coeffs(&g, l, "attn", &a)?;
        let h = parts.attn_norm.forward(&collapse(&x, &p_in)?)?;
        let err = rel_frob(&h, get(&g, &format!("L{l}.attn_in"))?)?;
        eprintln!("L{l}.attn_in: rel Frobenius {err:.3e}");
        ensure!(err <= 1e-3, "L{l}.attn_in: rel Frobenius {err}");
        if l == 1 {
            // Negative control for the staggered wiring: the same sublayer's pre is wrong.
            let same = parts.attn_norm.forward(&collapse(&x, &a.pre)?)?;
            ensure!(
                rel_frob(&same, get(&g, "L1.attn_in")?)? > 1e-2,
                "same-sublayer pre matches attn_in"
            );
        }

        let y = get(&g, &format!("L{l}.attn_out"))?.to_dtype(DType::BF16)?;
        let x1 = post(&y, &x, &a.post, &a.comb)?;
        let f = parts.ffn_mix.mixes(&x1)?;
        check_coeffs(&g, l, "ffn", &f)?;
        let h2 = parts.ffn_norm.forward(&collapse(&x1, &a.pre)?)?;
        let err = rel_frob(&h2, get(&g, &format!("L{l}.ffn_in"))?)?;
        eprintln!("L{l}.ffn_in: rel Frobenius {err:.3e}");
        ensure!(err <= 1e-3, "L{l}.ffn_in: rel Frobenius {err}");
        if l == 1 {
            // Negative control for the Post indexing: the residual on comb's second index (at
            // layer 0 the copies are still equal, so the control needs a later layer).
            let wrong = post(&y, &x, &a.post, &a.comb.transpose(1, 2)?.contiguous()?)?;
            let wrong_in = parts.ffn_norm.forward(&collapse(&wrong, &a.pre)?)?;
            let bad = rel_frob(&wrong_in, get(&g, "L1.ffn_in")?)?;
            eprintln!("L1 transposed-comb control: rel Frobenius {bad:.3e}");
            ensure!(bad > 1e-3, "transposed comb matches ffn_in (rel {bad})");
        }

        let z = get(&g, &format!("L{l}.ffn_out"))?.to_dtype(DType::BF16)?;
        x = post(&z, &x1, &f.post, &f.comb)?;
        p_in = f.pre;
    }
    let norm = RmsNorm::new(d, cfg.rms_norm_eps, vb.pp("norm"))?;
    let h = norm.forward(&collapse(&x, &p_in)?)?.to_dtype(DType::F32)?;
    let head = vb.get_with_hints_dtype(
        (cfg.vocab_size, d),
        "head.weight",
        Default::default(),
        DType::F32,
    )?;
    let logits = h.matmul(&head.t()?)?;
    let want = get(&g, "logits")?;
    let (rel, abs) = (rel_frob(&logits, want)?, max_abs(&logits, want)?);
    eprintln!("logits: rel Frobenius {rel:.3e}, max abs {abs:.3e}");
    ensure!(
        rel <= 1e-3 && abs <= 1e-2,
        "logits: rel Frobenius {rel}, max abs {abs}"
    );
    Ok(())
}

// ---------------------------------------------------------------- MoE

fn check_moe_case(
    case: &str,
    cfg: &Config,
    ffn_in_case: &str,
    layers: std::ops::Range<usize>,
    check_out: bool,
) -> Result<()> {
    let (_ckpt, vb) = checkpoint()?;
    let g = golden(case)?;
    let gin = if ffn_in_case == case {
        None
    } else {
        Some(golden(ffn_in_case)?)
    };
    let gin = gin.as_ref().unwrap_or(&g);
    for l in layers {
        let moe = Moe::new(cfg, Numerics::REFERENCE, vb.pp("layers").pp(l).pp("ffn"))?;
        let x = get(gin, &format!("L{l}.ffn_in"))?.to_dtype(DType::BF16)?;
        let out = moe.forward(&x)?;
        let want_ids = i64s(get(&g, &format!("L{l}.moe_ids"))?)?;
        ensure!(i64s(&out.ids)? == want_ids, "{case} L{l}: moe_ids differ");
        let want_w = get(&g, &format!("L{l}.moe_weights"))?;
        let werr = ((&out.weights - want_w)?.abs()? / want_w.abs()?)?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        ensure!(
            werr <= 1e-6,
            "{case} L{l}: moe_weights max rel error {werr}"
        );
        if check_out {
            let err = rel_frob(&out.out, get(&g, &format!("L{l}.ffn_out"))?)?;
            eprintln!("{case} L{l}: ffn_out rel Frobenius {err:.3e}, weights max rel {werr:.3e}");
            ensure!(err <= 1e-3, "{case} L{l}: ffn_out rel Frobenius {err}");
        }
    }
    Ok(())
}

#[test]
fn moe_every_layer_prefill_full() -> Result<()> {
    let cfg = case_config("prefill_full")?;
    check_moe_case(
        "prefill_full",
        &cfg,
        "prefill_full",
        0..cfg.num_hidden_layers,
        true,
    )
}

/// swiglu_limit 0.5: only layer 0's MoE input is the same as in `prefill_full` (later layers see
/// the clamped outputs of earlier ones), so only its routing is checkable without attention.
#[test]
fn moe_swiglu_case_layer0_routing() -> Result<()> {
    let cfg = case_config("prefill_full_swiglu")?;
    ensure!(
        cfg.swiglu_limit == 0.5,
        "swiglu case config: limit {}",
        cfg.swiglu_limit
    );
    check_moe_case("prefill_full_swiglu", &cfg, "prefill_full", 0..1, false)
}

/// Negative controls: without activation quantization, or with the 0.5 clamp, layer 0's MoE
/// output departs from the golden beyond the tolerance.
#[test]
fn moe_negative_controls() -> Result<()> {
    let (_ckpt, vb) = checkpoint()?;
    let g = golden("prefill_full")?;
    let x = get(&g, "L0.ffn_in")?.to_dtype(DType::BF16)?;
    let want = get(&g, "L0.ffn_out")?;
    let plain = Moe::new(
        &case_config("prefill_full")?,
        Numerics::PLAIN,
        vb.pp("layers.0.ffn"),
    )?
    .forward(&x)?;
    let e_plain = rel_frob(&plain.out, want)?;
    ensure!(
        e_plain > 1e-2,
        "activation quant has no visible effect (rel {e_plain})"
    );
    let clamped = Moe::new(
        &case_config("prefill_full_swiglu")?,
        Numerics::REFERENCE,
        vb.pp("layers.0.ffn"),
    )?
    .forward(&x)?;
    let e_clamp = rel_frob(&clamped.out, want)?;
    eprintln!("L0 MoE controls: plain numerics rel {e_plain:.3e}, clamp 0.5 rel {e_clamp:.3e}");
    ensure!(
        e_clamp > 1e-2,
        "swiglu clamp 0.5 has no visible effect (rel {e_clamp})"
    );
    Ok(())
}

// ---------------------------------------------------------------- Engram

#[test]
fn engram_layout_module_golden() -> Result<()> {
    let g = golden("modules")?;
    let layout = EngramLayout::new(&tiny_engram()?)?;
    let primes: Vec<i64> = layout
        .layers()
        .iter()
        .flat_map(|l| l.primes.iter().map(|&p| p as i64))
        .collect();
    let offsets: Vec<i64> = layout
        .layers()
        .iter()
        .flat_map(|l| l.offsets.iter().map(|&p| p as i64))
        .collect();
    let mults: Vec<i64> = layout
        .layers()
        .iter()
        .flat_map(|l| l.multipliers.iter().map(|&p| p as i64))
        .collect();
    ensure!(
        primes == i64s(get(&g, "engram.primes")?)?,
        "primes {primes:?}"
    );
    ensure!(
        offsets == i64s(get(&g, "engram.offsets")?)?,
        "offsets {offsets:?}"
    );
    ensure!(
        mults == i64s(get(&g, "engram.multipliers")?)?,
        "multipliers {mults:?}"
    );
    let map = TokenMap::div2(512);
    let want_map = i64s(get(&g, "engram.token_map")?)?;
    let ours: Vec<i64> = (0..512u32)
        .map(|i| map.get(i).map(|c| c as i64))
        .collect::<candle_core::Result<_>>()?;
    ensure!(ours == want_map, "token map");
    let hasher = EngramHasher::new(&tiny_engram()?, map)?;
    ensure!(
        vec![hasher.pad_compressed() as i64] == i64s(get(&g, "engram.pad_id_compressed")?)?,
        "pad id"
    );
    Ok(())
}

/// Hash ids of `case`, computed in the chunks `chunks` (lengths) through one history.
fn check_hashes(case: &str, chunks: &[usize]) -> Result<()> {
    let g = golden(case)?;
    let ids = input_ids(case)?;
    ensure!(
        chunks.iter().sum::<usize>() == ids.len(),
        "chunks do not cover the prompt"
    );
    let hasher = EngramHasher::new(&tiny_engram()?, TokenMap::div2(512))?;
    let mut history = hasher.new_history();
    let mut got: HashMap<usize, Vec<i64>> = HashMap::new();
    let mut start = 0;
    for &n in chunks {
        let h = hasher.hash(&ids[start..start + n], &mut history)?;
        for l in [1usize, 5] {
            got.entry(l)
                .or_default()
                .extend(h.layer(l).context("layer")?.iter().map(|&v| v as i64));
        }
        start += n;
    }
    for l in [1usize, 5] {
        let want = i64s(get(&g, &format!("L{l}.engram_hash"))?)?;
        ensure!(
            got[&l] == want,
            "{case} L{l}: engram_hash differs (chunks {chunks:?})"
        );
    }
    Ok(())
}

#[test]
fn engram_hash_full_chunked_decode() -> Result<()> {
    check_hashes("prefill_full", &[40])?;
    check_hashes("prefill_chunked", &[23, 17])?;
    let mut steps = vec![23];
    steps.extend(std::iter::repeat_n(1, 17));
    check_hashes("prefill_decode", &steps)?;
    // Negative control: restarting the history at the chunk boundary changes the hashes.
    let g = golden("prefill_full")?;
    let ids = input_ids("prefill_full")?;
    let hasher = EngramHasher::new(&tiny_engram()?, TokenMap::div2(512))?;
    let tail = hasher.hash(&ids[23..], &mut hasher.new_history())?;
    let want = i64s(&get(&g, "L1.engram_hash")?.i(23..)?)?;
    let got: Vec<i64> = tail
        .layer(1)
        .context("layer 1")?
        .iter()
        .map(|&v| v as i64)
        .collect();
    ensure!(
        got != want,
        "a fresh history reproduces the continued hashes"
    );
    Ok(())
}

#[test]
fn engram_table_rows_checkpoint_equals_resident() -> Result<()> {
    let cfg = case_config("prefill_full")?;
    let (ckpt, vb) = checkpoint()?;
    let g = golden("prefill_full")?;
    let ids = input_ids("prefill_full")?;
    let hasher = EngramHasher::new(&tiny_engram()?, TokenMap::div2(512))?;
    let hash = hasher
        .hash(&ids, &mut hasher.new_history())?
        .tensor(1, &Device::Cpu)?;
    let x = get(&g, "L1.engram_out")?.to_dtype(DType::BF16)?; // any stream of the right shape
    let vbl = vb.pp("layers.1.engram");
    let engram = Engram::new(&cfg, 1, Numerics::REFERENCE, vbl.clone())?;
    let resident = engram.forward(&x, &hash)?;
    // The rows gathered ahead of the layer (as for a table in host memory), then the rest.
    let t = ids.len();
    let rows = engram.table().rows(&hash.flatten_all()?, &Device::Cpu)?.reshape((t, ()))?;
    let ahead = engram.forward_rows(&x, &rows, &RowGroups::whole(t))?;
    ensure!(max_abs(&resident, &ahead)? == 0.0, "forward_rows of the looked-up rows differs from forward");
    ensure!(
        engram.forward_rows(&x, &rows.narrow(1, 0, rows.dim(1)? - 1)?, &RowGroups::whole(t)).is_err(),
        "forward_rows takes rows of the wrong width"
    );
    let table =
        deepseek_v41::model::EngramTable::Rows(Box::new(ckpt.row_table("layers.1.engram.embed.weight")?));
    let rowwise =
        Engram::with_table(&cfg, 1, Numerics::REFERENCE, vbl, table)?.forward(&x, &hash)?;
    ensure!(
        max_abs(&resident, &rowwise)? == 0.0,
        "row-wise table lookup differs from the resident table"
    );
    ensure!(
        resident.dims() == [ids.len(), cfg.hc_mult, cfg.hidden_size]
            && resident.dim(D::Minus1)? == 256
    );
    Ok(())
}

/// The released config: its Engram section yields the spec §9.2 tables and §9.3 multipliers.
#[test]
fn engram_layout_real_config() -> Result<()> {
    let p = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/deepseek-v41-flash/config.json"
    ));
    let cfg = Config::from_file(p)?;
    let layout = EngramLayout::new(cfg.engram.as_ref().context("engram")?)?;
    let l = layout.layers();
    ensure!(l.len() == 2 && l[0].layer == 1 && l[1].layer == 14);
    ensure!(
        l[0].num_rows() == 384006168 && l[1].num_rows() == 384016682,
        "prime sums"
    );
    ensure!(
        l[0].primes[0] == 16000057 && l[1].primes[0] == 16000477,
        "first primes"
    );
    ensure!(
        l[0].multipliers
            == [
                76632096046245,
                4839876093313,
                35959672319349,
                73987337458391
            ]
    );
    ensure!(
        l[1].multipliers
            == [
                67716810739261,
                51510806800915,
                30921347202721,
                82619226485591
            ]
    );
    Ok(())
}

/// Every mHC, MoE and Engram tensor of the tiny checkpoint is consumed by these modules.
#[test]
fn modules_account_for_their_tensors() -> Result<()> {
    let cfg = case_config("prefill_full")?;
    let (ckpt, vb) = checkpoint()?;
    for l in 0..cfg.num_hidden_layers {
        let vbl = vb.pp("layers").pp(l);
        HcMix::new(&cfg, vbl.clone(), HcSublayer::Attn)?;
        HcMix::new(&cfg, vbl.clone(), HcSublayer::Ffn)?;
        Moe::new(&cfg, Numerics::REFERENCE, vbl.pp("ffn"))?;
        if cfg
            .engram
            .as_ref()
            .is_some_and(|e| e.layer_ids.contains(&l))
        {
            Engram::new(&cfg, l, Numerics::REFERENCE, vbl.pp("engram"))?;
        }
    }
    let unused: Vec<String> = ckpt
        .unused_names(&[])
        .into_iter()
        .filter(|n| n.contains(".hc_") || n.contains(".ffn.") || n.contains(".engram."))
        .collect();
    ensure!(unused.is_empty(), "unused: {unused:?}");
    Ok(())
}
