//! The batched decode step of one V4.1 attention layer for the benchmarks: B sequences, one
//! token each, run by the library step (`deepseek_v41::attention::decode_batch`, whose module
//! docs list the ops of each phase) over pooled device tensors that this file fills with random
//! rows (include it with `#[path = "support/batched_step.rs"] mod batched_step;` next to
//! `support/batched_layer.rs`). Used by `examples/bench_batched_decode.rs` (one random ratio-2
//! source layer) and `examples/bench_flash_layer.rs` (the layers of a loaded checkpoint).
//!
//! What stays here is the benchmarks' part: the cache formats of a run ([`CacheFormat`]), the
//! random pools shared by the formats of a run ([`WindowPool`], [`SourcePools`]; the library
//! caches of a format are views of them, [`StepCaches`]), the positions ([`Inputs`]) and a sanity
//! check of one step ([`Step::sanity`]).
//!
//! Positions: with `all_close = false` (the steady state: every sequence closes a group every
//! other step) the ceil(B/2) even-numbered sequences sit at position `context − 1` (they close
//! group E − 1, visible E entries) and the odd ones at `context − 2` (open a group, E − 1
//! visible); `all_close` puts every sequence at `context − 1`. The step inputs are updated once
//! (`DecodeStepInputs::update`); every step repeats the same positions (it rewrites the same
//! cache rows, and a repeated step changes nothing), so it can be replayed from a CUDA graph.
//!
//! Cache formats ([`CacheFormat`]): `bf16` (all rows bf16), `packed` (index keys in MXFP4 68 B
//! rows, KV rows bf16), `packed-kv` (window rows 528 B (A), compressed rows 288 B (B), index
//! keys 68 B (E), spec §7.2). Pools are filled with random rows (not zeros), written once.
#![allow(dead_code)]

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::attention::{
    BatchStorage, BatchedLayerCache, BatchedSource, DecodeLayer, DecodeStep, DecodeStepInputs, PoolRows, Published, StepOptions,
};
use deepseek_v41::cuda::{PackedLayout, SparseAttentionKernel};
use deepseek_v41::quant::QatFormat;

pub use deepseek_v41::attention::Projections as Proj;

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
    /// The library's storage of each pool.
    pub fn storage(self) -> BatchStorage {
        match self {
            CacheFormat::Bf16 => BatchStorage::BF16,
            CacheFormat::Packed => BatchStorage::PACKED_KEYS,
            CacheFormat::PackedKv => BatchStorage::PACKED,
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
    /// The pool `fmt` reads.
    pub fn rows(&self, fmt: CacheFormat) -> Result<PoolRows> {
        Ok(match (&self.win, &self.win_packed) {
            (_, Some((t, l))) if fmt == CacheFormat::PackedKv => PoolRows::Packed(t.clone(), *l),
            (Some(t), _) if fmt != CacheFormat::PackedKv => PoolRows::Bf16(t.clone()),
            _ => bail!("no window pool for {}", fmt.name()),
        })
    }

    pub fn new(b: usize, window: usize, hd: usize, fmts: &[CacheFormat], dev: &Device) -> Result<Self> {
        let bf16_kv = fmts.iter().any(|&f| f != CacheFormat::PackedKv);
        let packed_kv = fmts.contains(&CacheFormat::PackedKv);
        Ok(Self {
            win: bf16_kv.then(|| random_rows(b * window, hd, dev)).transpose()?,
            // Each sequence's ring starts on a page (the library's region stride).
            win_packed: packed_kv
                .then(|| random_pages(QatFormat::Fp8Ue8m0B32, hd, b * window.div_ceil(PAGE) * PAGE, 63.99, (120.0, 127.99), dev))
                .transpose()?,
        })
    }

    /// Device bytes held.
    pub fn bytes(&self) -> u64 {
        tensor_bytes(self.win.as_ref()) + tensor_bytes(self.win_packed.as_ref().map(|p| &p.0))
    }
}

/// The compressed entries and index keys of one kv source for B sequences, `e` per sequence
/// (`ceil(e / PAGE)` pages each, taken by the step's updates in sequence order), in the formats
/// of the run.
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
    /// `[B, 512]` f32 random carried projections (kv, gate score).
    pub carry_kv: Tensor,
    pub carry_score: Tensor,
}

impl SourcePools {
    pub fn new(b: usize, e: usize, hd: usize, di: usize, fmts: &[CacheFormat], dev: &Device) -> Result<Self> {
        let bf16_kv = fmts.iter().any(|&f| f != CacheFormat::PackedKv);
        let packed_kv = fmts.contains(&CacheFormat::PackedKv);
        // The library's default page pool: `ceil(e / PAGE)` pages per sequence (the step's
        // updates take them in sequence order: sequence b's entries lie at `b·E' + j`, E' = ceil(e / PAGE)·PAGE).
        let rows = b * e.div_ceil(PAGE) * PAGE;
        Ok(Self {
            e,
            comp: bf16_kv.then(|| random_rows(rows, hd, dev)).transpose().context("compressed pool")?,
            comp_packed: packed_kv
                .then(|| random_pages(QatFormat::Fp4E4m3B16, hd, rows, 255.99, (48.0, 63.99), dev))
                .transpose()
                .context("packed compressed pool")?,
            keys: fmts.contains(&CacheFormat::Bf16).then(|| random_rows(rows, di, dev)).transpose().context("index-key pool")?,
            packed: fmts
                .iter()
                .any(|f| f.packed_keys())
                .then(|| random_pages(QatFormat::Fp4Ue8m0B32, di, rows, 255.99, (126.0, 128.99), dev))
                .transpose()
                .context("packed pool")?,
            carry_kv: Tensor::randn(0f32, 1.0, (b, hd), dev)?,
            carry_score: Tensor::randn(0f32, 1.0, (b, hd), dev)?,
        })
    }

    /// The library's view of these pools in `fmt`.
    pub fn source(&self, fmt: CacheFormat) -> Result<BatchedSource> {
        let compressed = match (&self.comp, &self.comp_packed) {
            (_, Some((t, l))) if fmt == CacheFormat::PackedKv => PoolRows::Packed(t.clone(), *l),
            (Some(t), _) if fmt != CacheFormat::PackedKv => PoolRows::Bf16(t.clone()),
            _ => bail!("no compressed pool for {}", fmt.name()),
        };
        let index_keys = match (fmt.packed_keys(), &self.keys, &self.packed) {
            (false, Some(t), _) => PoolRows::Bf16(t.clone()),
            (true, _, Some((t, l))) => PoolRows::Packed(t.clone(), *l),
            _ => bail!("no {} index-key pool", fmt.name()),
        };
        Ok(BatchedSource { entries: self.e, compressed, index_keys, carry_kv: self.carry_kv.clone(), carry_score: self.carry_score.clone() })
    }

    /// Device bytes held.
    pub fn bytes(&self) -> u64 {
        tensor_bytes(self.comp.as_ref())
            + tensor_bytes(self.comp_packed.as_ref().map(|p| &p.0))
            + tensor_bytes(self.keys.as_ref())
            + tensor_bytes(self.packed.as_ref().map(|p| &p.0))
            + tensor_bytes(Some(&self.carry_kv))
            + tensor_bytes(Some(&self.carry_score))
    }
}

fn tensor_bytes(t: Option<&Tensor>) -> u64 {
    t.map_or(0, |t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
}

/// The positions of a run and the layer input (see the module docs for the positions).
pub struct Inputs {
    pub b: usize,
    /// Entries per sequence of the kv source (0 for window-only layers).
    pub e: usize,
    /// The compress ratio (0: window-only).
    pub ratio: usize,
    /// `[B, hidden]` bf16 random layer input (the attn-normed activation).
    pub x: Tensor,
    /// Each sequence's position.
    pub positions: Vec<usize>,
}

impl Inputs {
    /// The positions of layer `w` for `b` sequences at `ctx` tokens of context.
    pub fn new(w: &Weights, hidden: usize, b: usize, ctx: usize, all_close: bool, dev: &Device) -> Result<Self> {
        let closes = |s: usize| all_close || s.is_multiple_of(2);
        let positions = (0..b).map(|s| if closes(s) { ctx - 1 } else { ctx - 2 }).collect();
        Ok(Self {
            b,
            e: ctx.checked_div(w.ratio).unwrap_or(0),
            ratio: w.ratio,
            x: Tensor::randn(0f32, 0.5, (b, hidden), dev)?.to_dtype(DType::BF16)?,
            positions,
        })
    }

    /// Sequences closing a compressor group this step (0 for window-only layers).
    pub fn closers(&self) -> usize {
        if self.ratio == 0 {
            return 0;
        }
        self.positions.iter().filter(|&&p| (p + 1) % self.ratio == 0).count()
    }

    /// Pool rows between two sequences' entries (whole pages: the updates take each sequence's
    /// pages in sequence order from a fresh pool).
    pub fn entry_stride(&self) -> usize {
        self.e.div_ceil(PAGE) * PAGE
    }

    /// Entries each sequence sees this step.
    pub fn visible(&self) -> Vec<usize> {
        self.positions.iter().map(|&p| (p + 1).checked_div(self.ratio).unwrap_or(0).min(self.e)).collect()
    }
}

/// The library caches and step inputs of one layer in one format: views of the run's pools.
pub struct StepCaches {
    pub own: BatchedLayerCache,
    /// A reuse layer's kv source.
    pub kv: Option<BatchedLayerCache>,
    pub inputs: DecodeStepInputs,
}

impl StepCaches {
    /// The caches of `layer` in `fmt` over the window pool `win` and the kv source's pools `src`
    /// (its own for a source; for a reuse layer the pools of its kv source, whose layer is
    /// `kv_layer`), and the step inputs at `s`'s positions.
    pub fn new(layer: &DecodeLayer, win: &WindowPool, src: Option<&SourcePools>, kv_layer: Option<&DecodeLayer>, fmt: CacheFormat, s: &Inputs) -> Result<Self> {
        let src_of = || src.context("no compressed pools for a compressed layer")?.source(fmt);
        let (own, kv) = match LayerKind::of(layer)? {
            LayerKind::WindowOnly => (BatchedLayerCache::from_parts(layer, s.b, win.rows(fmt)?, None)?, None),
            LayerKind::Source => (BatchedLayerCache::from_parts(layer, s.b, win.rows(fmt)?, Some(src_of()?))?, None),
            LayerKind::Reuse { kv_source, .. } => {
                let kl = kv_layer.with_context(|| format!("layer {}: no layer for its kv source {kv_source}", layer.layer()))?;
                // The kv source's window pool is not read by a reuse layer: this layer's serves.
                let kv = BatchedLayerCache::from_parts(kl, s.b, win.rows(fmt)?, Some(src_of()?))?;
                (BatchedLayerCache::from_parts(layer, s.b, win.rows(fmt)?, None)?, Some(kv))
            }
        };
        let inputs = DecodeStepInputs::new(layer, &own, kv.as_ref())?;
        inputs.update(&s.positions)?;
        Ok(Self { own, kv, inputs })
    }
}

/// One decode step of B sequences, phase by phase (the library step and what the benchmarks
/// read besides).
pub struct Step<'a> {
    pub w: &'a Weights,
    pub inner: DecodeStep<'a>,
    pub s: &'a Inputs,
    pub fmt: CacheFormat,
    /// Reuse layers: `[B, k]` i64 pool rows their index source selected this step.
    pub reuse_topk: Option<&'a Tensor>,
}

impl<'a> Step<'a> {
    pub fn new(
        w: &'a Weights,
        layer: &'a DecodeLayer<'a>,
        caches: &'a StepCaches,
        s: &'a Inputs,
        fmt: CacheFormat,
        kernel: SparseAttentionKernel,
        reuse_topk: Option<&'a Tensor>,
    ) -> Result<Self> {
        let inner = DecodeStep::new(layer, &caches.own, caches.kv.as_ref(), &caches.inputs)?.with_options(StepOptions { kernel, num_splits: None });
        Ok(Self { w, inner, s, fmt, reuse_topk })
    }

    pub fn projections(&self, x: &Tensor) -> Result<Proj> {
        Ok(self.inner.projections(x)?)
    }

    pub fn inserts(&self, pr: &Proj) -> Result<()> {
        Ok(self.inner.inserts(pr)?)
    }

    /// `[B, k]` i64 compressed pool rows (−1 = none); `None` for a window-only layer.
    pub fn selection(&self, pr: &Proj) -> Result<Option<Tensor>> {
        Ok(self.inner.selection(pr, Published { topk: self.reuse_topk, candidates: None })?.topk)
    }

    /// `[B, H, 512]` bf16.
    pub fn attention(&self, pr: &Proj, idx: Option<&Tensor>) -> Result<Tensor> {
        Ok(self.inner.attention(pr, idx)?)
    }

    /// [`Step::attention`] with `splits` KV splits (None: the launcher's choice).
    pub fn attention_with(&self, pr: &Proj, idx: Option<&Tensor>, splits: Option<usize>) -> Result<Tensor> {
        let step = self.inner.clone().with_options(StepOptions { kernel: SparseAttentionKernel::Auto, num_splits: splits });
        Ok(step.attention(pr, idx)?)
    }

    /// `[B, hidden]` bf16.
    pub fn output(&self, o: &Tensor) -> Result<Tensor> {
        Ok(self.inner.output(o)?)
    }

    /// The whole step for the layer input `x` `[B, hidden]` bf16; returns `[B, hidden]` bf16.
    pub fn run(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.inner.forward(x, Published { topk: self.reuse_topk, candidates: None })?.y)
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
        let Some(idx) = &idx else {
            return Ok((format!("output finite, max |y| = {max:.3}; window only"), None));
        };
        let counts = s.visible();
        let (mut valid, mut missing) = (0usize, 0usize);
        for (b, row) in idx.to_vec2::<i64>()?.iter().enumerate() {
            let lo = (b * s.entry_stride()) as i64;
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
        if missing > 0 && counts.iter().all(|&c| c >= w.topk) {
            bail!("{missing} top-k slots empty although every sequence sees >= {} entries", w.topk)
        }
        Ok((format!("output finite, max |y| = {max:.3}; top-k: {valid} rows in range, {missing} empty"), Some(idx.clone())))
    }
}
