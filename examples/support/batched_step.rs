//! The batched decode step of one V4.1 attention layer, composed from the crate's device ops:
//! B sequences, one token each, their caches in pooled device tensors (include it with
//! `#[path = "support/batched_step.rs"] mod batched_step;` next to `support/batched_layer.rs`).
//! Used by `examples/bench_batched_decode.rs` (one random ratio-2 source layer) and
//! `examples/bench_flash_layer.rs` (the layers of a loaded checkpoint).
//!
//! `Attention::forward` takes one sequence's `SequenceCache`, so the step is composed here:
//!
//! | phase | ops (B sequences, one token each) |
//! |---|---|
//! | projections | `wq_a` + `q_norm`, `wkv` + `kv_norm`, `wq_b`: `[B, hidden]` GEMMs through `nn::Linear` (FP8 activation quant kernel) |
//! | inserts | `q_rope_inplace`; `window_insert` into the pool `[B·128, 512]` (slot `b·128 + p mod 128`); kv sources: compressor `wkv`/`wgate` (f32) for all B, softmax pooling of the closing sequences with their carried half, `compressor.norm`, `indexer.wk`; `compressed_insert` / `index_key_insert` (or `packed_insert`) into `[B·E, 512]` / `[B·E, 128]` pools at `b·E + j`; the openers' projections scattered into the carry |
//! | selection | index sources: `indexer.wq_b`, index-query RoPE + FP4 fake quant, head weights, `index_select` (k = 512, key base `b·E`, per-sequence visible counts), top-k shifted to pool rows (−1 kept); reuse layers: the top-k their index source published; window-only layers: none |
//! | attention | `SparseAttentionInputs::forward` over the window pool (128 absolute rows per sequence) + the kv source's compressed pool (top-k rows) |
//! | output | inverse RoPE, grouped `wo_a` (`nn::GroupedLinear`), `wo_b` |
//!
//! Positions: with `all_close = false` (the steady state: every sequence closes a group every
//! other step) the ceil(B/2) even-numbered sequences sit at position `context − 1` (they close
//! group E − 1, visible E entries) and the odd ones at `context − 2` (open a group, E − 1
//! visible); `all_close` puts every sequence at `context − 1`. Every step repeats the same
//! positions (it rewrites the same cache rows), so it can be replayed from a CUDA graph.
//!
//! Cache formats ([`CacheFormat`]): `bf16` (all rows bf16), `packed` (index keys in MXFP4 68 B
//! rows, KV rows bf16), `packed-kv` (window rows 528 B (A), compressed rows 288 B (B), index
//! keys 68 B (E), spec §7.2; inserted with `packed_insert`, read by the attention kernel as
//! `KvRows::Packed`). Pools are filled with random rows (not zeros), written once.
#![allow(dead_code)]

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Module, Tensor};
use deepseek_v41::cuda::{
    compressed_insert, fake_quant_device, index_key_insert, index_select, packed_insert, q_rope_inplace, window_insert, IndexKeys,
    KeySource, KvRows, PackedLayout, SparseAttentionInputs, SparseAttentionKernel, SparseAttentionOptions, Visibility,
};
use deepseek_v41::quant::QatFormat;

use crate::batched_layer::{LayerKind, Weights};

/// Tokens per page of the packed pools.
pub const PAGE: usize = 64;
/// Phase names, in step order.
pub const PHASES: [&str; 5] = ["projections", "inserts", "selection", "attention", "output"];

/// Cache formats of a run.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum CacheFormat {
    /// bf16 rows everywhere.
    Bf16,
    /// MXFP4 index keys, bf16 KV rows.
    Packed,
    /// Packed window (A), compressed (B) and index-key (E) rows.
    PackedKv,
}

impl CacheFormat {
    /// Parses `bf16`, `packed` (or `mxfp4`), `packed-kv`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "bf16" => Ok(CacheFormat::Bf16),
            "packed" | "mxfp4" => Ok(CacheFormat::Packed),
            "packed-kv" => Ok(CacheFormat::PackedKv),
            o => bail!("--keys: unknown format {o:?} (bf16, packed, packed-kv)"),
        }
    }
    /// Bytes of one index key.
    pub fn row_bytes(self) -> f64 {
        match self {
            CacheFormat::Bf16 => 256.0,
            CacheFormat::Packed | CacheFormat::PackedKv => 68.0,
        }
    }
    /// Bytes of one window row and of one compressed row.
    pub fn kv_row_bytes(self, hd: usize) -> (f64, f64) {
        match self {
            CacheFormat::PackedKv => (528.0, 288.0),
            _ => ((hd * 2) as f64, (hd * 2) as f64),
        }
    }
    pub fn packed_keys(self) -> bool {
        self != CacheFormat::Bf16
    }
    pub fn name(self) -> &'static str {
        match self {
            CacheFormat::Bf16 => "bf16",
            CacheFormat::Packed => "mxfp4 packed",
            CacheFormat::PackedKv => "all packed",
        }
    }
}

/// `[rows, dim]` bf16 filled with random values in chunks (bounded temporary memory).
pub fn random_rows(rows: usize, dim: usize, dev: &Device) -> Result<Tensor> {
    let t = Tensor::zeros((rows, dim), DType::BF16, dev)?;
    let chunk = ((1usize << 28) / dim).max(1);
    for r in (0..rows).step_by(chunk) {
        let n = chunk.min(rows - r);
        t.slice_set(&Tensor::randn(0f32, 0.5, (n, dim), dev)?.to_dtype(DType::BF16)?, 0, r)?;
    }
    Ok(t)
}

/// A packed pool of `rows` rows of `dim` values in `format`, pages of [`PAGE`] tokens: random
/// codes below `code_max` (e4m3: 0x00..0x3f = 0..1.875) and random scale bytes in `scales`
/// (UE8M0 126..128 = 2^-1..2^1; e4m3 0x30..0x40 = 2^-1..2^0).
pub fn random_pages(format: QatFormat, dim: usize, rows: usize, code_max: f32, scales: (f32, f32), dev: &Device) -> Result<(Tensor, PackedLayout)> {
    let layout = PackedLayout::new(format, dim, PAGE)?;
    let pages = rows.div_ceil(PAGE);
    let t = layout.zeros(pages, dev)?;
    let chunk = ((1usize << 28) / layout.page_bytes()).max(1);
    for p in (0..pages).step_by(chunk) {
        let n = chunk.min(pages - p);
        let data = Tensor::rand(0f32, code_max, (n, PAGE * layout.row_data_bytes()), dev)?.floor()?.to_dtype(DType::U8)?;
        let sc = Tensor::rand(scales.0, scales.1, (n, PAGE * layout.row_scale_bytes()), dev)?.floor()?.to_dtype(DType::U8)?;
        t.slice_set(&Tensor::cat(&[data, sc], 1)?.contiguous()?, 0, p)?;
    }
    Ok((t, layout))
}

/// The window pool of one layer for B sequences: `[B·W, 512]` bf16 rows (slot `b·W + p mod W`)
/// and / or the same slots packed in format A, as the formats of the run need.
pub struct WindowPool {
    pub win: Option<Tensor>,
    pub win_packed: Option<(Tensor, PackedLayout)>,
}

impl WindowPool {
    pub fn new(b: usize, window: usize, hd: usize, fmts: &[CacheFormat], dev: &Device) -> Result<Self> {
        let bf16_kv = fmts.iter().any(|&f| f != CacheFormat::PackedKv);
        let packed_kv = fmts.contains(&CacheFormat::PackedKv);
        Ok(Self {
            win: bf16_kv.then(|| random_rows(b * window, hd, dev)).transpose()?,
            win_packed: packed_kv.then(|| random_pages(QatFormat::Fp8Ue8m0B32, hd, b * window, 63.99, (120.0, 127.99), dev)).transpose()?,
        })
    }

    /// Device bytes held.
    pub fn bytes(&self) -> u64 {
        tensor_bytes(self.win.as_ref()) + tensor_bytes(self.win_packed.as_ref().map(|p| &p.0))
    }
}

/// The compressed entries and index keys of one kv source for B sequences, `e` per sequence
/// (row `b·e + j`), in the formats of the run.
pub struct SourcePools {
    /// Entries per sequence (pool stride).
    pub e: usize,
    /// `[B·E, 512]` bf16 compressed entries (bf16-KV runs only).
    pub comp: Option<Tensor>,
    /// Packed compressed rows (format B), same slots (packed-KV runs).
    pub comp_packed: Option<(Tensor, PackedLayout)>,
    /// `[B·E, 128]` bf16 index keys (bf16 runs only).
    pub keys: Option<Tensor>,
    /// `[B·E / PAGE, PAGE·68]` u8 packed index keys (packed runs only).
    pub packed: Option<(Tensor, PackedLayout)>,
}

impl SourcePools {
    pub fn new(b: usize, e: usize, hd: usize, di: usize, fmts: &[CacheFormat], dev: &Device) -> Result<Self> {
        let bf16_kv = fmts.iter().any(|&f| f != CacheFormat::PackedKv);
        let packed_kv = fmts.contains(&CacheFormat::PackedKv);
        Ok(Self {
            e,
            comp: bf16_kv.then(|| random_rows(b * e, hd, dev)).transpose().context("compressed pool")?,
            comp_packed: packed_kv
                .then(|| random_pages(QatFormat::Fp4E4m3B16, hd, b * e, 255.99, (48.0, 63.99), dev))
                .transpose()
                .context("packed compressed pool")?,
            keys: fmts.contains(&CacheFormat::Bf16).then(|| random_rows(b * e, di, dev)).transpose().context("index-key pool")?,
            packed: fmts
                .iter()
                .any(|f| f.packed_keys())
                .then(|| random_pages(QatFormat::Fp4Ue8m0B32, di, b * e, 255.99, (126.0, 128.99), dev))
                .transpose()
                .context("packed pool")?,
        })
    }

    /// Device bytes held.
    pub fn bytes(&self) -> u64 {
        tensor_bytes(self.comp.as_ref())
            + tensor_bytes(self.comp_packed.as_ref().map(|p| &p.0))
            + tensor_bytes(self.keys.as_ref())
            + tensor_bytes(self.packed.as_ref().map(|p| &p.0))
    }
}

fn tensor_bytes(t: Option<&Tensor>) -> u64 {
    t.map_or(0, |t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
}

/// The inputs of layers that read compressed entries: `[B]` u32 key base `b·E`, `[B, 1]` i64
/// the same, `[B]` u32 visible entries, `[B, k]` i64 zeros and −1 (top-k shift).
pub struct CompressedInputs {
    pub base: Tensor,
    pub base_i64: Tensor,
    pub counts: Tensor,
    pub zeros: Tensor,
    pub neg_one: Tensor,
}

/// The compressor inputs of a kv source: `[G]` u32 sequences closing a group, `[G, R/2]` angles
/// at `j·r`, `[G]` i64 pool rows; `[O]` u32 sequences opening a group and `[O, 512]` u32 their
/// row ids (scatter index); `[B, 512]` f32 carried projections (kv, gate score).
pub struct ClosingInputs {
    pub closers: Tensor,
    pub c_cos: Tensor,
    pub c_sin: Tensor,
    pub c_slots: Tensor,
    pub openers: Option<(Tensor, Tensor)>,
    pub carry_kv: Tensor,
    pub carry_score: Tensor,
}

/// The step's per-token inputs, all on the device (built once: the step itself copies nothing
/// from the host, so it can be captured into a graph).
pub struct Inputs {
    pub b: usize,
    /// Entries per sequence of the kv source (0 for window-only layers).
    pub e: usize,
    /// `[B, hidden]` bf16 random layer input (the attn-normed activation).
    pub x: Tensor,
    /// `[B, R/2]` f32 angles of each sequence's position; `sin_neg` = −sin (inverse RoPE).
    pub cos: Tensor,
    pub sin: Tensor,
    pub sin_neg: Tensor,
    /// `[B]` i64 window slots.
    pub win_slots: Tensor,
    /// `[B, W]` i64 absolute window pool rows; `[B, 0]` i64 (no compressed rows).
    pub idx_window: Tensor,
    pub no_extra: Tensor,
    /// Layers that read compressed entries.
    pub comp: Option<CompressedInputs>,
    /// Kv sources.
    pub closing: Option<ClosingInputs>,
}

impl Inputs {
    /// The inputs of layer `w` for `b` sequences at `ctx` tokens of context (see the module
    /// docs for the positions).
    pub fn new(w: &Weights, hidden: usize, b: usize, ctx: usize, all_close: bool, dev: &Device) -> Result<Self> {
        let (win, hd, k) = (w.window, w.hd, w.topk);
        let closes = |s: usize| all_close || s.is_multiple_of(2);
        let pos: Vec<usize> = (0..b).map(|s| if closes(s) { ctx - 1 } else { ctx - 2 }).collect();
        let (cos, sin) = w.rope.cos_sin(&pos)?;
        let win_slots: Vec<i64> = pos.iter().enumerate().map(|(s, p)| (s * win + p % win) as i64).collect();
        let idx_window = Tensor::from_vec((0..b * win).map(|i| i as i64).collect::<Vec<_>>(), (b, win), dev)?;
        let e = ctx.checked_div(w.ratio).unwrap_or(0);
        let comp = if w.kind.compressed() {
            let counts: Vec<u32> = pos.iter().map(|p| ((p + 1) / w.ratio).min(e) as u32).collect();
            let base: Vec<u32> = (0..b).map(|s| (s * e) as u32).collect();
            let base_i64: Vec<i64> = base.iter().map(|&v| v as i64).collect();
            Some(CompressedInputs {
                base: Tensor::new(base, dev)?,
                base_i64: Tensor::from_vec(base_i64, (b, 1), dev)?,
                counts: Tensor::new(counts, dev)?,
                zeros: Tensor::zeros((b, k), DType::I64, dev)?,
                neg_one: Tensor::full(-1i64, (b, k), dev)?,
            })
        } else {
            None
        };
        let closing = if w.kind == LayerKind::Source {
            let closers: Vec<u32> = (0..b).filter(|&s| closes(s)).map(|s| s as u32).collect();
            let openers: Vec<u32> = (0..b).filter(|&s| !closes(s)).map(|s| s as u32).collect();
            let c_pos: Vec<usize> = closers.iter().map(|&s| pos[s as usize] / w.ratio * w.ratio).collect();
            let (c_cos, c_sin) = w.rope.cos_sin(&c_pos)?;
            let c_slots: Vec<i64> = closers.iter().map(|&s| (s as usize * e + pos[s as usize] / w.ratio) as i64).collect();
            let openers = if openers.is_empty() {
                None
            } else {
                let rows: Vec<u32> = (0..openers.len()).flat_map(|i| std::iter::repeat_n(openers[i], hd)).collect();
                let o = openers.len();
                Some((Tensor::new(openers, dev)?, Tensor::from_vec(rows, (o, hd), dev)?))
            };
            Some(ClosingInputs {
                c_slots: Tensor::new(c_slots, dev)?,
                closers: Tensor::new(closers, dev)?,
                c_cos,
                c_sin,
                openers,
                carry_kv: Tensor::randn(0f32, 1.0, (b, hd), dev)?,
                carry_score: Tensor::randn(0f32, 1.0, (b, hd), dev)?,
            })
        } else {
            None
        };
        Ok(Self {
            b,
            e,
            x: Tensor::randn(0f32, 0.5, (b, hidden), dev)?.to_dtype(DType::BF16)?,
            sin_neg: sin.neg()?,
            cos,
            sin,
            win_slots: Tensor::new(win_slots, dev)?,
            no_extra: idx_window.narrow(1, 0, 0)?,
            idx_window,
            comp,
            closing,
        })
    }

    /// Sequences closing a compressor group this step (0 for other layers).
    pub fn closers(&self) -> usize {
        self.closing.as_ref().map_or(0, |c| c.closers.elem_count())
    }
}

/// Outputs of the projections phase.
pub struct Proj {
    /// `[B, hidden]` bf16: the layer input.
    pub x: Tensor,
    /// `[B, q_lora]` bf16.
    pub qr: Tensor,
    /// `[B, 512]` bf16 (normed window KV).
    pub kv: Tensor,
    /// `[B, H, 512]` bf16.
    pub q: Tensor,
}

/// One decode step of B sequences, phase by phase.
pub struct Step<'a> {
    pub w: &'a Weights,
    pub win: &'a WindowPool,
    /// The kv source's pools (its own for a source, its kv source's for a reuse layer).
    pub src: Option<&'a SourcePools>,
    pub s: &'a Inputs,
    pub fmt: CacheFormat,
    pub kernel: SparseAttentionKernel,
    /// Reuse layers: `[B, k]` i64 pool rows their index source selected this step.
    pub reuse_topk: Option<&'a Tensor>,
}

impl Step<'_> {
    fn src(&self) -> Result<&SourcePools> {
        self.src.with_context(|| format!("layer {} ({}): no compressed pools", self.w.layer, self.w.kind.name()))
    }

    pub fn projections(&self, x: &Tensor) -> Result<Proj> {
        let (w, b) = (self.w, self.s.b);
        let qr = w.q_norm.forward(&w.wq_a.forward(x)?)?;
        let kv = w.kv_norm.forward(&w.wkv.forward(x)?)?;
        let q = w.wq_b.forward(&qr)?.reshape((b, w.h, w.hd))?;
        Ok(Proj { x: x.clone(), qr, kv, q })
    }

    pub fn inserts(&self, pr: &Proj) -> Result<()> {
        let (w, s) = (self.w, self.s);
        q_rope_inplace(&pr.q, &s.cos, &s.sin, None)?;
        match (&self.win.win, &self.win.win_packed) {
            (_, Some((cache, layout))) if self.fmt == CacheFormat::PackedKv => {
                packed_insert(cache, layout, &pr.kv, &s.cos, &s.sin, &s.win_slots, None)?
            }
            (Some(win), _) => window_insert(win, &pr.kv, &s.cos, &s.sin, &s.win_slots, true)?,
            _ => bail!("no window pool for {}", self.fmt.name()),
        }
        let (Some(c), Some(cl)) = (&w.compressor, &s.closing) else { return Ok(()) };
        let p = self.src()?;
        // Compressor (ratio 2): projections of every sequence, pooling of the closing groups.
        let ckv = c.wkv.forward(&pr.x)?;
        let cs = c.wgate.forward(&pr.x)?;
        let pair = |carry: &Tensor, cur: &Tensor| -> Result<Tensor> {
            Ok(Tensor::stack(&[carry.index_select(&cl.closers, 0)?, cur.index_select(&cl.closers, 0)?], 1)?)
        };
        let alpha = candle_nn::ops::softmax(&pair(&cl.carry_score, &cs)?, 1)?;
        let pooled = (alpha * pair(&cl.carry_kv, &ckv)?)?.sum(1)?.to_dtype(DType::BF16)?;
        let latent = c.norm.forward(&pooled)?;
        let k_pre = c.keys.project(&latent)?;
        match (&p.comp, &p.comp_packed) {
            (_, Some((cache, layout))) if self.fmt == CacheFormat::PackedKv => {
                packed_insert(cache, layout, &latent, &cl.c_cos, &cl.c_sin, &cl.c_slots, None)?
            }
            (Some(comp), _) => compressed_insert(comp, &latent, &cl.c_cos, &cl.c_sin, &cl.c_slots, true)?,
            _ => bail!("no compressed pool for {}", self.fmt.name()),
        }
        let norm = c.keys.k_norm();
        match (self.fmt.packed_keys(), &p.keys, &p.packed) {
            (false, Some(keys), _) => {
                index_key_insert(keys, &k_pre, norm.weight(), norm.eps(), &cl.c_cos, &cl.c_sin, &cl.c_slots, true)?
            }
            (true, _, Some((cache, layout))) => {
                packed_insert(cache, layout, &k_pre, &cl.c_cos, &cl.c_sin, &cl.c_slots, Some((norm.weight(), norm.eps())))?
            }
            _ => bail!("no {} index-key pool", self.fmt.name()),
        }
        if let Some((ids, rows)) = &cl.openers {
            cl.carry_kv.scatter_set(rows, &ckv.index_select(ids, 0)?, 0)?;
            cl.carry_score.scatter_set(rows, &cs.index_select(ids, 0)?, 0)?;
        }
        Ok(())
    }

    /// `[B, k]` i64 compressed pool rows (−1 = none); `None` for a window-only layer.
    pub fn selection(&self, pr: &Proj) -> Result<Option<Tensor>> {
        let (w, s) = (self.w, self.s);
        match w.kind {
            LayerKind::WindowOnly => return Ok(None),
            LayerKind::Reuse { index_source, .. } => {
                let t = self.reuse_topk.with_context(|| format!("layer {}: no top-k of index source {index_source}", w.layer))?;
                return Ok(Some(t.clone()));
            }
            LayerKind::Source => {}
        }
        let (p, c) = (self.src()?, s.comp.as_ref().context("no compressed-layer inputs")?);
        let ix = w.indexer.as_ref().context("an index source without indexer weights")?;
        let iq = ix.iq_b.forward(&pr.qr)?.reshape((s.b, w.hi, w.di))?;
        q_rope_inplace(&iq, &s.cos, &s.sin, None)?;
        let iq = fake_quant_device(&iq, QatFormat::Fp4Ue8m0B32)?;
        let scale = (w.di as f64).powf(-0.5) * (w.hi as f64).powf(-0.5);
        let hw = (ix.w_proj.forward(&pr.x)?.to_dtype(DType::F32)? * scale)?.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
        let keys = match (self.fmt.packed_keys(), &p.keys, &p.packed) {
            (false, Some(k), _) => IndexKeys::Rows(k),
            (true, _, Some((cache, layout))) => IndexKeys::Packed { cache, layout: *layout },
            _ => bail!("no {} index-key pool", self.fmt.name()),
        };
        let src = KeySource { keys, base: Some(&c.base), entries: s.e, visibility: Visibility::Counts(&c.counts) };
        let topk = index_select(&iq, &hw, &src, w.topk, None, None)?.topk;
        Ok(Some(topk.ge(&c.zeros)?.where_cond(&topk.broadcast_add(&c.base_i64)?, &c.neg_one)?))
    }

    /// The KV pool this run's format reads.
    fn kv_rows<'a>(&self, bf16: &'a Option<Tensor>, packed: &'a Option<(Tensor, PackedLayout)>) -> Result<KvRows<'a>> {
        Ok(match (bf16, packed) {
            (_, Some((cache, layout))) if self.fmt == CacheFormat::PackedKv => KvRows::Packed(cache, *layout),
            (Some(t), _) => KvRows::Bf16(t),
            _ => bail!("no KV pool for {}", self.fmt.name()),
        })
    }

    /// `[B, H, 512]` bf16.
    pub fn attention(&self, pr: &Proj, idx: Option<&Tensor>) -> Result<Tensor> {
        self.attention_with(pr, idx, None)
    }

    /// [`Step::attention`] with `splits` KV splits (None: the launcher's choice).
    pub fn attention_with(&self, pr: &Proj, idx: Option<&Tensor>, splits: Option<usize>) -> Result<Tensor> {
        let window = self.kv_rows(&self.win.win, &self.win.win_packed)?;
        let (extra, idx_extra) = match idx {
            Some(idx) => {
                let p = self.src()?;
                (self.kv_rows(&p.comp, &p.comp_packed)?, idx)
            }
            None => (window, &self.s.no_extra),
        };
        let inputs = SparseAttentionInputs {
            q: &pr.q,
            window,
            idx_window: &self.s.idx_window,
            extra,
            idx_extra,
            sink: &self.w.sink,
            scale: (self.w.hd as f32).powf(-0.5),
        };
        let kernel = if splits.is_some() { SparseAttentionKernel::Auto } else { self.kernel };
        Ok(inputs.forward(SparseAttentionOptions { num_splits: splits, kernel })?.0)
    }

    /// `[B, hidden]` bf16.
    pub fn output(&self, o: &Tensor) -> Result<Tensor> {
        let (w, s) = (self.w, self.s);
        q_rope_inplace(o, &s.cos, &s.sin_neg, None)?;
        let z = w.wo_a.forward(&o.reshape((s.b, w.g, w.h / w.g * w.hd))?)?;
        Ok(w.wo_b.forward(&z)?)
    }

    /// The whole step for the layer input `x` `[B, hidden]` bf16; returns `[B, hidden]` bf16.
    pub fn run(&self, x: &Tensor) -> Result<Tensor> {
        let pr = self.projections(x)?;
        self.inserts(&pr)?;
        let idx = self.selection(&pr)?;
        let o = self.attention(&pr, idx.as_ref())?;
        self.output(&o)
    }

    /// Runs the step once on `x` and checks it: finite, not-all-zero output, and top-k rows
    /// inside each sequence's visible pool range. Returns a one-line summary and the top-k
    /// (for the reuse layers of this layer's top-k).
    pub fn sanity(&self, x: &Tensor) -> Result<(String, Option<Tensor>)> {
        let (s, w) = (self.s, self.w);
        let pr = self.projections(x)?;
        self.inserts(&pr)?;
        let idx = self.selection(&pr)?;
        let o = self.attention(&pr, idx.as_ref())?;
        let out = self.output(&o)?;
        let v = out.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        if v.iter().any(|x| !x.is_finite()) {
            let bad = |t: &Tensor| -> Result<usize> {
                Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().filter(|x| !x.is_finite()).count())
            };
            // Tokens with a non-finite attention output (one device→host read, on failure only).
            let per_token = o.to_dtype(DType::F32)?.flatten_from(1)?.to_vec2::<f32>()?;
            let tokens: Vec<usize> = (0..s.b).filter(|&b| per_token[b].iter().any(|x| !x.is_finite())).collect();
            bail!(
                "output has non-finite values ({} in the attention output; tokens {:?}; q {}, one-split attention {})",
                bad(&o)?,
                &tokens[..tokens.len().min(8)],
                bad(&pr.q)?,
                bad(&self.attention_with(&pr, idx.as_ref(), Some(1))?)?
            )
        }
        let max = v.iter().fold(0f32, |m, x| m.max(x.abs()));
        if max == 0.0 {
            bail!("output is all zeros")
        }
        let (Some(idx), Some(c)) = (&idx, &s.comp) else {
            return Ok((format!("output finite, max |y| = {max:.3}; window only"), None));
        };
        let counts = c.counts.to_vec1::<u32>()?;
        let (mut valid, mut missing) = (0usize, 0usize);
        for (b, row) in idx.to_vec2::<i64>()?.iter().enumerate() {
            let lo = (b * s.e) as i64;
            for &j in row {
                if j < 0 {
                    missing += 1;
                } else if j < lo || j >= lo + counts[b] as i64 {
                    bail!("sequence {b}: top-k row {j} outside its visible range [{lo}, {})", lo + counts[b] as i64)
                } else {
                    valid += 1;
                }
            }
        }
        if missing > 0 && counts.iter().all(|&c| c as usize >= w.topk) {
            bail!("{missing} top-k slots empty although every sequence sees >= {} entries", w.topk)
        }
        Ok((format!("output finite, max |y| = {max:.3}; top-k: {valid} rows in range, {missing} empty"), Some(idx.clone())))
    }
}
