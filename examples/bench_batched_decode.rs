//! Batched decode step of one V4.1-Flash attention layer on CUDA (issue 6, deliverable 4): the
//! latency of one decode step of B sequences at once (B = 1, 64, 256 by default), each at a
//! `--context` of 128K tokens, with a per-phase breakdown, tokens/s and the step's roofline.
//!
//! ```text
//! cargo build --release --features cuda --example bench_batched_decode
//! bench_batched_decode [--batch 1,64,256] [--context 131072] [--steps 10] [--keys bf16,packed,packed-kv]
//!     [--closing half|all] [--rep-ms 50] [--graph]
//! ```
//!
//! `Attention::forward` takes one sequence's `SequenceCache`, so the batched step is composed
//! here from the crate's device ops, with the caches of all B sequences in pooled device tensors:
//!
//! | phase | ops (B sequences, one token each) |
//! |---|---|
//! | projections | `wq_a` + `q_norm`, `wkv` + `kv_norm`, `wq_b`: `[B, hidden]` GEMMs through `nn::Linear` (FP8 activation quant kernel) |
//! | inserts | `q_rope_inplace`; `window_insert` into the pool `[B·128, 512]` (slot `b·128 + p mod 128`); compressor `wkv`/`wgate` (f32) for all B, softmax pooling of the closing sequences with their carried half, `compressor.norm`, `indexer.wk`; `compressed_insert` / `index_key_insert` (or `packed_insert`) into `[B·E, 512]` / `[B·E, 128]` pools at `b·E + j`; the openers' projections scattered into the carry |
//! | selection | `indexer.wq_b`, index-query RoPE + FP4 fake quant, head weights, `index_select` (k = 512, key base `b·E`, per-sequence visible counts), top-k shifted to pool rows (−1 kept) |
//! | attention | `sparse_attention_two_source` over the window pool (128 absolute rows per sequence) + the compressed pool (top-k rows) |
//! | output | inverse RoPE, grouped `wo_a` (batched matmul), `wo_b` |
//!
//! Layer: the first ratio-2 kv + index source of the config (layer 2 of V4.1-Flash); random
//! bf16 weights ([`RandomWeights`]); E = context / 2 compressed entries and index keys per
//! sequence, random (not zeros), written once. Positions: with `--closing half` (default, the
//! steady state: every sequence closes a group every other step) the ceil(B/2) even-numbered
//! sequences sit at position `context − 1` (they close group E − 1 this step, visible E entries)
//! and the odd ones at `context − 2` (open a group, E − 1 visible); `--closing all` puts every
//! sequence at `context − 1` (worst case: B compressor groups closing in one step). Every
//! measured step repeats the same positions (it rewrites the same cache rows), so the step can
//! be replayed from a graph; the timing is that of a real step.
//!
//! `--cpu` runs only the sanity check through the ops' CPU reference paths (no timings): a logic
//! check of the composition on a machine without a GPU.
//!
//! Timing (CUDA events on candle's stream, after warm-up):
//! * `events`: per step, one event per phase boundary, the device synchronized only after the
//!   step; the median over `--steps` steps. A phase's time includes its host-side launch work
//!   whenever the host is slower than the GPU (small B).
//! * `step`: back-to-back steps without any synchronization inside ([`Timer::calls`]).
//! * `graph`: the whole step captured into a CUDA graph and replayed (GPU time only), and each
//!   phase alone captured and replayed (the GPU-only breakdown).
//!
//! Roofline: the weights read once per step plus, per sequence, the 128 window rows and 512
//! top-k rows of 1 KB and the E index keys scanned (256 B bf16 / 68 B packed), at 4.17 TB/s.
//! Cache formats (`--keys`): `bf16` (all rows bf16), `packed` (index keys in MXFP4 68 B rows, KV
//! rows bf16), `packed-kv` (everything in the V4.1 packed formats: window rows 528 B (A),
//! compressed rows 288 B (B), index keys 68 B (E); inserted with `packed_insert`, read by the
//! attention kernel as `KvRows::Packed`). The bf16 KV pools are only allocated when a format
//! needs them, so `--keys packed-kv` alone shows the packed caches' memory.
//! Not measured here: the MoE / other layers, the host-side scheduling of a serving loop.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::{DType, Device, Module, Tensor};
use clap::{Parser, ValueEnum};
use deepseek_v41::config::{AttentionRole, Config};
use deepseek_v41::cuda::{
    compressed_insert, fake_quant_device, index_key_insert, index_select, packed_insert, q_rope_inplace, window_insert,
    IndexKeys, KeySource, KvRows, PackedLayout, SparseAttentionInputs, SparseAttentionKernel, SparseAttentionOptions,
    Visibility,
};
use deepseek_v41::quant::QatFormat;

#[path = "support/bench.rs"]
mod bench;
#[path = "support/batched_layer.rs"]
mod batched_layer;
use batched_layer::Weights;
use bench::{gib, median, PoolPeak, Timer, HBM_READ_GBPS};

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value = "tests/fixtures/deepseek-v41-flash/config.json")]
    config: PathBuf,
    /// Batch sizes (sequences decoded in one step).
    #[arg(long, value_delimiter = ',', default_value = "1,64,256")]
    batch: Vec<usize>,
    /// Context length of every sequence (even, at least 2·top-k).
    #[arg(long, default_value_t = 131072)]
    context: usize,
    /// Measured steps of the event breakdown, and repetitions of the other timings (median).
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Warm-up steps.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Target milliseconds of one repetition of the back-to-back / graph timings.
    #[arg(long, default_value_t = 50.0)]
    rep_ms: f64,
    /// Cache formats to run: `bf16` (bf16 rows everywhere), `packed` (MXFP4 68 B index keys,
    /// bf16 KV rows), `packed-kv` (window / compressed / index-key rows all packed: 528 / 288 / 68 B).
    #[arg(long, value_delimiter = ',', default_value = "bf16,packed")]
    keys: Vec<String>,
    /// `half`: every other sequence closes a compressor group this step; `all`: every sequence.
    #[arg(long, default_value = "half")]
    closing: String,
    /// Also time the step replayed from a CUDA graph (with Candle's host-upload cache on, see
    /// `run_format`). Off by default: a failed replay poisons the CUDA context, so it runs last
    /// in a separate invocation (without the upload cache the replay hit
    /// CUDA_ERROR_ILLEGAL_ADDRESS).
    #[arg(long)]
    graph: bool,
    /// Run only the sanity check of every (B, format) on the CPU (the ops' reference paths; a
    /// logic check of the composition without a GPU, e.g. `--cpu --batch 1,3 --context 1024`).
    #[arg(long)]
    cpu: bool,
    /// The sparse attention kernel.
    #[arg(long, value_enum, default_value_t = AttentionKernel::Auto)]
    attention_kernel: AttentionKernel,
}

/// `--attention-kernel`: which [`SparseAttentionKernel`] the step's attention asks for.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum AttentionKernel {
    /// The launcher's choice.
    Auto,
    /// The head-split kernel's ping-pong loop (`SparseAttentionKernel::HeadSplitPingPong`; bf16
    /// rows).
    PingPong,
    /// The head-split kernel's two-stage loop (`SparseAttentionKernel::HeadSplit`).
    HeadSplit,
    /// The dims-split pair (`SparseAttentionKernel::DimSplitPair`; bf16 rows; Auto's choice up to B ≈ 66).
    DimSplit,
}

impl From<AttentionKernel> for SparseAttentionKernel {
    fn from(k: AttentionKernel) -> Self {
        match k {
            AttentionKernel::Auto => SparseAttentionKernel::Auto,
            AttentionKernel::PingPong => SparseAttentionKernel::HeadSplitPingPong,
            AttentionKernel::HeadSplit => SparseAttentionKernel::HeadSplit,
            AttentionKernel::DimSplit => SparseAttentionKernel::DimSplitPair,
        }
    }
}

/// Tokens per page of the packed index-key pool.
const PAGE: usize = 64;
/// Phase names, in step order.
const PHASES: [&str; 5] = ["projections", "inserts", "selection", "attention", "output"];

/// Cache formats of a run.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum CacheFormat {
    /// bf16 rows everywhere.
    Bf16,
    /// MXFP4 index keys, bf16 KV rows.
    Packed,
    /// Packed window (A), compressed (B) and index-key (E) rows.
    PackedKv,
}

impl CacheFormat {
    /// Bytes of one index key.
    fn row_bytes(self) -> f64 {
        match self {
            CacheFormat::Bf16 => 256.0,
            CacheFormat::Packed | CacheFormat::PackedKv => 68.0,
        }
    }
    /// Bytes of one window row and of one compressed row.
    fn kv_row_bytes(self, hd: usize) -> (f64, f64) {
        match self {
            CacheFormat::PackedKv => (528.0, 288.0),
            _ => ((hd * 2) as f64, (hd * 2) as f64),
        }
    }
    fn packed_keys(self) -> bool {
        self != CacheFormat::Bf16
    }
    fn name(self) -> &'static str {
        match self {
            CacheFormat::Bf16 => "bf16",
            CacheFormat::Packed => "mxfp4 packed",
            CacheFormat::PackedKv => "all packed",
        }
    }
}

/// The pooled caches of B sequences.
struct Pools {
    /// `[B·W, 512]` bf16 window rows (slot `b·W + p mod W`; bf16-KV runs only).
    win: Option<Tensor>,
    /// `[B·E, 512]` bf16 compressed entries (row `b·E + j`; bf16-KV runs only).
    comp: Option<Tensor>,
    /// Packed window rows (format A) and compressed rows (format B), same slots (packed-KV runs).
    win_packed: Option<(Tensor, PackedLayout)>,
    comp_packed: Option<(Tensor, PackedLayout)>,
    /// `[B·E, 128]` bf16 index keys (bf16 runs only).
    keys: Option<Tensor>,
    /// `[B·E / PAGE, PAGE·68]` u8 packed index keys (packed runs only).
    packed: Option<(Tensor, PackedLayout)>,
}

/// The step's per-token inputs, all on the device (built once: the step itself copies nothing
/// from the host, so it can be captured into a graph).
struct Inputs {
    b: usize,
    /// Entries per sequence (pool stride).
    e: usize,
    /// `[B, hidden]` bf16.
    x: Tensor,
    /// `[B, R/2]` f32 angles of each sequence's position; `sin_neg` = −sin (inverse RoPE).
    cos: Tensor,
    sin: Tensor,
    sin_neg: Tensor,
    /// `[B]` i64 window slots.
    win_slots: Tensor,
    /// `[B, W]` i64 absolute window pool rows.
    idx_window: Tensor,
    /// `[G]` u32 sequences closing a group; `[G, R/2]` angles at `j·r`; `[G]` i64 pool rows.
    closers: Tensor,
    c_cos: Tensor,
    c_sin: Tensor,
    c_slots: Tensor,
    /// `[O]` u32 sequences opening a group and `[O, 512]` u32 their row ids (scatter index).
    openers: Option<(Tensor, Tensor)>,
    /// `[B, 512]` f32 carried compressor projections (kv, gate score).
    carry_kv: Tensor,
    carry_score: Tensor,
    /// `[B]` u32 key base `b·E`, `[B, 1]` i64 the same, `[B]` u32 visible entries.
    base: Tensor,
    base_i64: Tensor,
    counts: Tensor,
    /// `[B, k]` i64 zeros and −1 (top-k shift).
    zeros: Tensor,
    neg_one: Tensor,
}

fn randn(shape: (usize, usize), dev: &Device) -> Result<Tensor> {
    Ok(Tensor::randn(0f32, 0.5, shape, dev)?.to_dtype(DType::BF16)?)
}

/// `[rows, dim]` bf16 filled with random values in chunks (bounded temporary memory).
fn random_rows(rows: usize, dim: usize, dev: &Device) -> Result<Tensor> {
    let t = Tensor::zeros((rows, dim), DType::BF16, dev)?;
    let chunk = ((1usize << 28) / dim).max(1);
    for r in (0..rows).step_by(chunk) {
        t.slice_set(&randn((chunk.min(rows - r), dim), dev)?, 0, r)?;
    }
    Ok(t)
}

/// A packed pool of `rows` rows of `dim` values in `format`, pages of [`PAGE`] tokens: random
/// codes below `code_max` (e4m3: 0x00..0x3f = 0..1.875) and random scale bytes in `scales`
/// (UE8M0 126..128 = 2^-1..2^1; e4m3 0x30..0x40 = 2^-1..2^0).
fn random_pages(format: QatFormat, dim: usize, rows: usize, code_max: f32, scales: (f32, f32), dev: &Device) -> Result<(Tensor, PackedLayout)> {
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

/// A packed MXFP4 index-key pool of `rows` rows: random e2m1 codes, scales 2^-1..2^1.
fn random_packed(rows: usize, dev: &Device) -> Result<(Tensor, PackedLayout)> {
    random_pages(QatFormat::Fp4Ue8m0B32, 128, rows, 255.99, (126.0, 128.99), dev)
}

fn inputs(w: &Weights, cfg: &Config, b: usize, ctx: usize, all_close: bool, dev: &Device) -> Result<Inputs> {
    let (e, win, hd, k) = (ctx / w.ratio, w.window, w.hd, w.topk);
    let closes = |s: usize| all_close || s.is_multiple_of(2);
    let pos: Vec<usize> = (0..b).map(|s| if closes(s) { ctx - 1 } else { ctx - 2 }).collect();
    let (cos, sin) = w.rope.cos_sin(&pos)?;
    let win_slots: Vec<i64> = pos.iter().enumerate().map(|(s, p)| (s * win + p % win) as i64).collect();
    let idx_window: Vec<i64> = (0..b * win).map(|i| i as i64).collect();
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
    let counts: Vec<u32> = pos.iter().map(|p| ((p + 1) / w.ratio).min(e) as u32).collect();
    let base: Vec<u32> = (0..b).map(|s| (s * e) as u32).collect();
    let base_i64: Vec<i64> = base.iter().map(|&v| v as i64).collect();
    Ok(Inputs {
        b,
        e,
        x: randn((b, cfg.hidden_size), dev)?,
        sin_neg: sin.neg()?,
        cos,
        sin,
        win_slots: Tensor::new(win_slots, dev)?,
        idx_window: Tensor::from_vec(idx_window, (b, win), dev)?,
        c_slots: Tensor::new(c_slots, dev)?,
        closers: Tensor::new(closers, dev)?,
        c_cos,
        c_sin,
        openers,
        carry_kv: Tensor::randn(0f32, 1.0, (b, hd), dev)?,
        carry_score: Tensor::randn(0f32, 1.0, (b, hd), dev)?,
        base: Tensor::new(base, dev)?,
        base_i64: Tensor::from_vec(base_i64, (b, 1), dev)?,
        counts: Tensor::new(counts, dev)?,
        zeros: Tensor::zeros((b, k), DType::I64, dev)?,
        neg_one: Tensor::full(-1i64, (b, k), dev)?,
    })
}

/// Outputs of the projections phase.
struct Proj {
    /// `[B, q_lora]` bf16.
    qr: Tensor,
    /// `[B, 512]` bf16 (normed window KV).
    kv: Tensor,
    /// `[B, H, 512]` bf16.
    q: Tensor,
}

/// One decode step of B sequences, phase by phase.
struct Step<'a> {
    w: &'a Weights,
    p: &'a Pools,
    s: &'a Inputs,
    fmt: CacheFormat,
    kernel: SparseAttentionKernel,
}

impl Step<'_> {
    fn projections(&self) -> Result<Proj> {
        let (w, s) = (self.w, self.s);
        let qr = w.q_norm.forward(&w.wq_a.forward(&s.x)?)?;
        let kv = w.kv_norm.forward(&w.wkv.forward(&s.x)?)?;
        let q = w.wq_b.forward(&qr)?.reshape((s.b, w.h, w.hd))?;
        Ok(Proj { qr, kv, q })
    }

    fn inserts(&self, pr: &Proj) -> Result<()> {
        let (w, s, p) = (self.w, self.s, self.p);
        q_rope_inplace(&pr.q, &s.cos, &s.sin, None)?;
        match (&p.win, &p.win_packed) {
            (_, Some((cache, layout))) if self.fmt == CacheFormat::PackedKv => {
                packed_insert(cache, layout, &pr.kv, &s.cos, &s.sin, &s.win_slots, None)?
            }
            (Some(win), _) => window_insert(win, &pr.kv, &s.cos, &s.sin, &s.win_slots, true)?,
            _ => bail!("no window pool for {}", self.fmt.name()),
        }
        // Compressor (ratio 2): projections of every sequence, pooling of the closing groups.
        let ckv = w.c_wkv.forward(&s.x)?;
        let cs = w.c_wgate.forward(&s.x)?;
        let pair = |carry: &Tensor, cur: &Tensor| -> Result<Tensor> {
            Ok(Tensor::stack(&[carry.index_select(&s.closers, 0)?, cur.index_select(&s.closers, 0)?], 1)?)
        };
        let alpha = candle_nn::ops::softmax(&pair(&s.carry_score, &cs)?, 1)?;
        let pooled = (alpha * pair(&s.carry_kv, &ckv)?)?.sum(1)?.to_dtype(DType::BF16)?;
        let latent = w.c_norm.forward(&pooled)?;
        let k_pre = w.keys.project(&latent)?;
        match (&p.comp, &p.comp_packed) {
            (_, Some((cache, layout))) if self.fmt == CacheFormat::PackedKv => {
                packed_insert(cache, layout, &latent, &s.c_cos, &s.c_sin, &s.c_slots, None)?
            }
            (Some(comp), _) => compressed_insert(comp, &latent, &s.c_cos, &s.c_sin, &s.c_slots, true)?,
            _ => bail!("no compressed pool for {}", self.fmt.name()),
        }
        let norm = w.keys.k_norm();
        match (self.fmt.packed_keys(), &p.keys, &p.packed) {
            (false, Some(keys), _) => {
                index_key_insert(keys, &k_pre, norm.weight(), norm.eps(), &s.c_cos, &s.c_sin, &s.c_slots, true)?
            }
            (true, _, Some((cache, layout))) => {
                packed_insert(cache, layout, &k_pre, &s.c_cos, &s.c_sin, &s.c_slots, Some((norm.weight(), norm.eps())))?
            }
            _ => bail!("no {} index-key pool", self.fmt.name()),
        }
        if let Some((ids, rows)) = &s.openers {
            s.carry_kv.scatter_set(rows, &ckv.index_select(ids, 0)?, 0)?;
            s.carry_score.scatter_set(rows, &cs.index_select(ids, 0)?, 0)?;
        }
        Ok(())
    }

    /// `[B, k]` i64 compressed pool rows (−1 = none).
    fn selection(&self, pr: &Proj) -> Result<Tensor> {
        let (w, s, p) = (self.w, self.s, self.p);
        let iq = w.iq_b.forward(&pr.qr)?.reshape((s.b, w.hi, w.di))?;
        q_rope_inplace(&iq, &s.cos, &s.sin, None)?;
        let iq = fake_quant_device(&iq, QatFormat::Fp4Ue8m0B32)?;
        let scale = (w.di as f64).powf(-0.5) * (w.hi as f64).powf(-0.5);
        let hw = (w.w_proj.forward(&s.x)?.to_dtype(DType::F32)? * scale)?.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
        let keys = match (self.fmt.packed_keys(), &p.keys, &p.packed) {
            (false, Some(k), _) => IndexKeys::Rows(k),
            (true, _, Some((cache, layout))) => IndexKeys::Packed { cache, layout: *layout },
            _ => bail!("no {} index-key pool", self.fmt.name()),
        };
        let src = KeySource { keys, base: Some(&s.base), entries: s.e, visibility: Visibility::Counts(&s.counts) };
        let topk = index_select(&iq, &hw, &src, w.topk, None, None)?.topk;
        Ok(topk.ge(&s.zeros)?.where_cond(&topk.broadcast_add(&s.base_i64)?, &s.neg_one)?)
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
    fn attention(&self, pr: &Proj, idx: &Tensor) -> Result<Tensor> {
        self.attention_with(pr, idx, None)
    }

    /// [`Step::attention`] with `splits` KV splits (None: the launcher's choice).
    fn attention_with(&self, pr: &Proj, idx: &Tensor, splits: Option<usize>) -> Result<Tensor> {
        let p = self.p;
        let inputs = SparseAttentionInputs {
            q: &pr.q,
            window: self.kv_rows(&p.win, &p.win_packed)?,
            idx_window: &self.s.idx_window,
            extra: self.kv_rows(&p.comp, &p.comp_packed)?,
            idx_extra: idx,
            sink: &self.w.sink,
            scale: (self.w.hd as f32).powf(-0.5),
        };
        Ok(inputs.forward(SparseAttentionOptions { num_splits: splits, kernel: if splits.is_some() { SparseAttentionKernel::Auto } else { self.kernel } })?.0)
    }

    /// `[B, hidden]` bf16.
    fn output(&self, o: &Tensor) -> Result<Tensor> {
        let (w, s) = (self.w, self.s);
        q_rope_inplace(o, &s.cos, &s.sin_neg, None)?;
        let o = o.reshape((s.b, w.g, w.h / w.g * w.hd))?.transpose(0, 1)?.contiguous()?;
        let z = o.matmul(&w.wo_a.transpose(1, 2)?)?.transpose(0, 1)?;
        Ok(w.wo_b.forward(&z.flatten_from(1)?)?)
    }

    fn run(&self) -> Result<Tensor> {
        let pr = self.projections()?;
        self.inserts(&pr)?;
        let idx = self.selection(&pr)?;
        let o = self.attention(&pr, &idx)?;
        self.output(&o)
    }
}

/// Timings of one (B, key format) run, milliseconds.
struct Row {
    b: usize,
    fmt: CacheFormat,
    events: [f64; 5],
    step: f64,
    graph: Option<f64>,
    phase_graph: [Option<f64>; 5],
    roofline: f64,
    /// Device memory (candle's pool): held by pools + step inputs, and the high-water mark of
    /// the timed steps (both formats of this B), bytes.
    mem: Option<(u64, u64)>,
}

/// Finite, not-all-zero output, and top-k rows inside each sequence's visible pool range.
fn sanity(step: &Step) -> Result<String> {
    let (s, w) = (step.s, step.w);
    let pr = step.projections()?;
    step.inserts(&pr)?;
    let idx = step.selection(&pr)?;
    let o = step.attention(&pr, &idx)?;
    let out = step.output(&o)?;
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
            bad(&step.attention_with(&pr, &idx, Some(1))?)?
        )
    }
    let max = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    if max == 0.0 {
        bail!("output is all zeros")
    }
    let counts = s.counts.to_vec1::<u32>()?;
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
    Ok(format!("output finite, max |y| = {max:.3}; top-k: {valid} rows in range, {missing} empty"))
}

fn run_format(step: &Step, timer: &Timer, args: &Args, w_bytes: f64) -> Result<Row> {
    let stream = &timer.stream;
    println!("  sanity ({}): {}", step.fmt.name(), sanity(step)?);
    for _ in 0..args.warmup {
        step.run()?;
    }
    // Event breakdown: one event per phase boundary, synchronized after the step.
    let mut per_phase = vec![Vec::new(); PHASES.len()];
    for _ in 0..args.steps.max(1) {
        stream.synchronize()?;
        let ev = || stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
        let mut evs = vec![ev()?];
        let pr = step.projections()?;
        evs.push(ev()?);
        step.inserts(&pr)?;
        evs.push(ev()?);
        let idx = step.selection(&pr)?;
        evs.push(ev()?);
        let o = step.attention(&pr, &idx)?;
        evs.push(ev()?);
        step.output(&o)?;
        evs.push(ev()?);
        stream.synchronize()?;
        for (i, pair) in evs.windows(2).enumerate() {
            per_phase[i].push(pair[0].elapsed_ms(&pair[1])? as f64);
        }
    }
    let mut events = [0.0; 5];
    for (e, v) in events.iter_mut().zip(per_phase) {
        *e = median(v);
    }
    let step_ms = timer.calls(|| step.run().map(|_| ()))?;
    let mut graph = None;
    let mut phase_graph = [None; 5];
    if args.graph {
        // Candle uploads the dims / strides of strided ops from host memory on every call; in a
        // capture such an upload would be recorded as a copy from a host buffer freed right
        // after (replay then reads garbage: CUDA_ERROR_ILLEGAL_ADDRESS). With Candle's upload
        // cache on, the warm-up call before each capture stores those small uploads on the
        // device and the capture reuses them (an uncached upload during capture is an error).
        let _uploads = step.s.x.device().as_cuda_device()?.enable_cuda_graph_htod_cache();
        let report = |what: &str, r: Result<f64>| match r {
            Ok(v) => Some(v),
            Err(e) => {
                println!("  graph of {what} ({}): error: {e:#}", step.fmt.name());
                None
            }
        };
        graph = report("the step", timer.graph(1, || step.run().map(|_| ())));
        let pr = step.projections()?;
        let idx = step.selection(&pr)?;
        let o = step.attention(&pr, &idx)?;
        phase_graph = [
            report(PHASES[0], timer.graph(1, || step.projections().map(|_| ()))),
            report(PHASES[1], timer.graph(1, || step.inserts(&pr))),
            report(PHASES[2], timer.graph(1, || step.selection(&pr).map(|_| ()))),
            report(PHASES[3], timer.graph(1, || step.attention(&pr, &idx).map(|_| ()))),
            report(PHASES[4], timer.graph(1, || step.output(&o).map(|_| ()))),
        ];
    }
    let s = step.s;
    let (win_row, comp_row) = step.fmt.kv_row_bytes(step.w.hd);
    let per_seq = step.w.window as f64 * win_row + step.w.topk as f64 * comp_row + s.e as f64 * step.fmt.row_bytes();
    let roofline = (w_bytes + s.b as f64 * per_seq) / (HBM_READ_GBPS * 1e9) * 1e3;
    Ok(Row { b: s.b, fmt: step.fmt, events, step: step_ms, graph, phase_graph, roofline, mem: None })
}

fn mem_used_gib(dev: &Device) -> f64 {
    if !dev.is_cuda() {
        return f64::NAN;
    }
    match candle_core::cuda_backend::cudarc::driver::result::mem_get_info() {
        Ok((free, total)) => (total - free) as f64 / (1u64 << 30) as f64,
        Err(_) => f64::NAN,
    }
}

#[allow(clippy::too_many_arguments)]
fn run_batch(
    w: &Weights,
    cfg: &Config,
    b: usize,
    args: &Args,
    fmts: &[CacheFormat],
    timer: Option<&Timer>,
    dev: &Device,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let ctx = args.context;
    let e = ctx / w.ratio;
    let pool = timer.map(|t| PoolPeak::new(&t.stream)).transpose()?;
    let t0 = std::time::Instant::now();
    let bf16_kv = fmts.iter().any(|&f| f != CacheFormat::PackedKv);
    let packed_kv = fmts.contains(&CacheFormat::PackedKv);
    let pools = Pools {
        win: bf16_kv.then(|| random_rows(b * w.window, w.hd, dev)).transpose()?,
        comp: bf16_kv.then(|| random_rows(b * e, w.hd, dev)).transpose().context("compressed pool")?,
        win_packed: packed_kv
            .then(|| random_pages(QatFormat::Fp8Ue8m0B32, w.hd, b * w.window, 63.99, (120.0, 127.99), dev))
            .transpose()?,
        comp_packed: packed_kv
            .then(|| random_pages(QatFormat::Fp4E4m3B16, w.hd, b * e, 255.99, (48.0, 63.99), dev))
            .transpose()
            .context("packed compressed pool")?,
        keys: fmts.contains(&CacheFormat::Bf16).then(|| random_rows(b * e, w.di, dev)).transpose().context("index-key pool")?,
        packed: fmts.iter().any(|f| f.packed_keys()).then(|| random_packed(b * e, dev)).transpose().context("packed pool")?,
    };
    let s = inputs(w, cfg, b, ctx, args.closing == "all", dev)?;
    dev.synchronize()?;
    let held = pool.as_ref().map(|p| -> Result<u64> {
        let held = p.used()?;
        p.reset()?;
        Ok(held)
    }).transpose()?;
    let first_row = rows.len();
    println!(
        "B = {b}: pools filled in {:.1} s (compressed {:.2} GiB bf16 / {:.2} GiB packed, window {:.1} / {:.1} MiB, {} closing); device memory in use {:.1} GiB",
        t0.elapsed().as_secs_f64(),
        if bf16_kv { (b * e * w.hd * 2) as f64 / (1u64 << 30) as f64 } else { 0.0 },
        if packed_kv { (b * e * 288) as f64 / (1u64 << 30) as f64 } else { 0.0 },
        if bf16_kv { (b * w.window * w.hd * 2) as f64 / (1u64 << 20) as f64 } else { 0.0 },
        if packed_kv { (b * w.window * 528) as f64 / (1u64 << 20) as f64 } else { 0.0 },
        s.closers.dim(0)?,
        mem_used_gib(dev)
    );
    for &fmt in fmts {
        let step = Step { w, p: &pools, s: &s, fmt, kernel: args.attention_kernel.into() };
        let Some(timer) = timer else {
            match sanity(&step) {
                Ok(m) => println!("  sanity ({}): {m}", fmt.name()),
                Err(e) => println!("  B = {b}, keys {}: error: {e:#}", fmt.name()),
            }
            continue;
        };
        match run_format(&step, timer, args, w.bytes()) {
            Ok(r) => {
                println!(
                    "  {}: events {:.3} ms, step {:.3} ms, graph {}",
                    fmt.name(),
                    r.events.iter().sum::<f64>(),
                    r.step,
                    r.graph.map_or("n/a".into(), |g| format!("{g:.3} ms"))
                );
                rows.push(r)
            }
            Err(e) => println!("  B = {b}, keys {}: error: {e:#}", fmt.name()),
        }
    }
    if let (Some(p), Some(held)) = (&pool, held) {
        dev.synchronize()?;
        let peak = p.peak()?;
        println!("  device memory (pool high-water mark): {:.2} GiB held by pools, weights and inputs, {:.2} GiB peak during the steps", gib(held), gib(peak));
        rows[first_row..].iter_mut().for_each(|r| r.mem = Some((held, peak)));
    }
    Ok(())
}

fn fmt_opt(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |v| format!("{v:.3}"))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let (dev, timer) = if args.cpu {
        (Device::Cpu, None)
    } else {
        let dev = Device::new_cuda(0).context("bench_batched_decode needs a CUDA device (or --cpu)")?;
        let cuda = dev.as_cuda_device()?;
        // One stream only: no cross-stream event bookkeeping (it cannot be captured into a graph).
        unsafe { cuda.disable_event_tracking() };
        let stream = cuda.cuda_stream();
        (dev, Some(Timer { stream, warmup: args.warmup, reps: args.steps.max(1), rep_ms: args.rep_ms }))
    };
    let cfg = Config::from_file(&args.config).with_context(|| format!("reading {}", args.config.display()))?;
    let layer = cfg
        .layers
        .iter()
        .position(|r| matches!(r.attention, AttentionRole::Compressed { ratio: 2, kv_source, .. } if kv_source == r.layer))
        .context("no ratio-2 kv source layer")?;
    let fmts: Vec<CacheFormat> = args
        .keys
        .iter()
        .map(|k| match k.as_str() {
            "bf16" => Ok(CacheFormat::Bf16),
            "packed" | "mxfp4" => Ok(CacheFormat::Packed),
            "packed-kv" => Ok(CacheFormat::PackedKv),
            o => bail!("--keys: unknown format {o:?} (bf16, packed, packed-kv)"),
        })
        .collect::<Result<_>>()?;
    if !matches!(args.closing.as_str(), "half" | "all") {
        bail!("--closing must be half or all, got {:?}", args.closing)
    }
    let t = std::time::Instant::now();
    let w = Weights::new(&cfg, layer, 2, &dev)?;
    if args.context % w.ratio != 0 || args.context < 2 * w.topk.max(w.window) || args.context / w.ratio % PAGE != 0 {
        bail!("--context {} must be even, >= {} and a multiple of {}", args.context, 2 * w.topk.max(w.window), w.ratio * PAGE)
    }
    let w_bytes = w.bytes();
    println!(
        "layer {layer} (ratio 2, kv + index source): hidden {}, {} heads x {}, q_lora {}, o_groups {} x o_lora {}, window {}, index {} heads x {}, top-k {}",
        cfg.hidden_size, w.h, w.hd, cfg.q_lora_rank, w.g, cfg.o_lora_rank, w.window, w.hi, w.di, w.topk
    );
    println!(
        "weights (random bf16, compressor f32): {:.1} MB, built in {:.1} s; context {} per sequence ({} entries), closing: {}",
        w_bytes / 1e6,
        t.elapsed().as_secs_f64(),
        args.context,
        args.context / w.ratio,
        args.closing
    );

    let mut rows = Vec::new();
    for &b in &args.batch {
        if b == 0 {
            println!("B = 0: skipped");
            continue;
        }
        if let Err(e) = run_batch(&w, &cfg, b, &args, &fmts, timer.as_ref(), &dev, &mut rows) {
            println!("B = {b}: error: {e:#}");
        }
        // Pools of this B are dropped; let the allocator's frees complete before the next.
        dev.synchronize()?;
    }

    println!("\n## batched decode step, one attention layer, context {} per sequence (ms, median)", args.context);
    println!("\nEvent breakdown (one event per phase boundary, synchronized after each step; host launch time included where the host is the bottleneck), whole step back-to-back and from a CUDA graph:\n");
    println!("| B | caches | projections | inserts | selection | attention | output | sum | step | step (graph) | tokens/s | tokens/s (graph) | roofline | % of roofline (graph) |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let best = r.graph.unwrap_or(r.step);
        println!(
            "| {} | {} | {} | {:.3} | {:.3} | {} | {:.0} | {} | {:.3} | {:.0}% |",
            r.b,
            r.fmt.name(),
            r.events.iter().map(|v| format!("{v:.3}")).collect::<Vec<_>>().join(" | "),
            r.events.iter().sum::<f64>(),
            r.step,
            fmt_opt(r.graph),
            r.b as f64 / r.step * 1e3,
            r.graph.map_or("n/a".into(), |g| format!("{:.0}", r.b as f64 / g * 1e3)),
            r.roofline,
            r.roofline / best * 100.0
        );
    }
    if args.graph {
        println!("\nGPU-only breakdown (each phase alone captured into a CUDA graph and replayed):\n");
        println!("| B | caches | projections | inserts | selection | attention | output | sum |");
        println!("|---|---|---|---|---|---|---|---|");
        for r in &rows {
            let sum: Option<f64> = r.phase_graph.iter().copied().sum();
            println!(
                "| {} | {} | {} | {} |",
                r.b,
                r.fmt.name(),
                r.phase_graph.iter().map(|v| fmt_opt(*v)).collect::<Vec<_>>().join(" | "),
                fmt_opt(sum)
            );
        }
    }
    println!(
        "\nroofline = (weights {:.1} MB once per step + B x (({} window + {} top-k) rows x 1 KB (all packed: 528 B / 288 B) + {} index keys x 256 B bf16 / 68 B packed)) / {:.2} TB/s",
        w_bytes / 1e6,
        w.window,
        w.topk,
        args.context / w.ratio,
        HBM_READ_GBPS / 1e3
    );
    println!("tokens/s: B tokens per step of this one layer.");
    println!("\nDevice memory (high-water mark of candle's CUDA memory pool; weights of this one layer included, CUDA context and cuBLAS workspace not):\n");
    println!("| B | held before the steps (weights, pools, inputs) GiB | peak during the steps GiB | step transient MiB |");
    println!("|---|---|---|---|");
    let mut seen = Vec::new();
    for r in &rows {
        if let (Some((held, peak)), false) = (r.mem, seen.contains(&r.b)) {
            seen.push(r.b);
            println!("| {} | {:.2} | {:.2} | {:.1} |", r.b, gib(held), gib(peak), peak.saturating_sub(held) as f64 / (1u64 << 20) as f64);
        }
    }
    Ok(())
}
