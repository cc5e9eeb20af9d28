//! One real-size V4.1-Flash decoder layer end to end on CUDA (issue 22, deliverable 4): a
//! Flash-width checkpoint (`synthetic_checkpoint --flash-shapes`, all 384 experts) loaded through
//! the real loader (`Pretrained::load_with`, native FP8 / MXFP4 weights), then for each layer of
//! the checkpoint (each kind: window-only, window-only + Engram, ratio-2 kv + index source, top-k
//! reuse, and with `--layer-ids …,20` the ratio-1 kv + index source that publishes the candidate
//! blocks) and each B the decode step of B sequences (one token each, every sequence at
//! `--context` tokens), per phase and whole, graph-replayed; then a `--prefill`-token prefill.
//!
//! ```text
//! cargo build --release --features cuda --example bench_flash_layer --example synthetic_checkpoint
//! synthetic_checkpoint /tmp/v41-flash --flash-shapes --layers 4      # or --layer-ids 0,1,2,3,20
//! bench_flash_layer --model /tmp/v41-flash [--batch 1,64,256] [--context 131072] [--prefill 4096]
//!     [--keys bf16,packed-kv] [--engram-placement auto|device|host] [--layers 0,1,2,3] [--reps 5] [--eager-only] [--census]
//! bench_flash_layer --model /tmp/v41-flash-small --cpu --batch 1,3 --context 1024 --prefill 64   # logic check, no GPU
//! ```
//!
//! The step (`support/flash_layer_step.rs`): the layer's own modules in the order of
//! `DecoderLayer::forward` around the library's batched attention step
//! (`attention::decode_batch`, through `support/batched_step.rs`; the
//! caches of the B sequences in pooled device tensors, random rows, in the formats of `--keys`;
//! the top-k reuse layer reads its index source's top-k of the same step). Phases:
//!
//! | phase | what | timed |
//! |---|---|---|
//! | engram hash | the hash ids of B tokens (`EngramHasher::hash`, one call per sequence) | host, eager |
//! | engram gather | device table: `index_select` of the B·24 rows; host table (`HostRows`): gather of the stored rows into pinned staging, one copy, decode | device: graph; host: eager (host work) |
//! | engram | gather (device table) + `wkv` + the gate (`Engram::forward_rows`) | graph |
//! | mhc+norms | both sublayers' mixes, collapses, `attn_norm` / `ffn_norm`, posts | graph |
//! | attention | the batched step, and its parts projections / inserts / selection / attention / output | graph |
//! | routing, shared, experts | `Gate::route_device`, the shared expert, `moe_experts_device` (routed experts + combine) | graph |
//! | moe | `Moe::forward` inside `cuda::with_device_routing` (the step's MoE: the three above) | graph (eager if it leaves the device) |
//! | layer | the whole step captured as one graph (the Engram rows of a host table staged before the replay) and back-to-back eager calls | graph, eager |
//!
//! An Engram layer is also measured with its table in the other place (a second `Engram` loaded
//! through the same checkpoint: `Engram::load` with `EngramPlacement::Host` / `Device`), when it
//! fits. Bytes the step must read: the attention weights, both mHC `hc_*_fn`, the router, the
//! shared expert, the touched experts (distinct experts of the step's routing, codes + scales),
//! the Engram `wkv` and rows, and per sequence the cache rows read (128 window rows, the 512
//! top-k compressed rows, the kv source's E index keys scanned; bf16 or packed sizes); roofline =
//! bytes / `--hbm-gbps` (4.26 TB/s, the H200 figure of issue 22; on an H100, 3.35 TB/s nominal,
//! `--hbm-gbps 3350`; docs/perf.md "FP8 linear" measured ~2.7 TB/s there for 42 MB reads). Device
//! memory: what loading added, the caches per B, and the memory pool's high-water mark.
//!
//! Prefill (`--prefill T`, one sequence from position 0, all layers of the checkpoint in order on
//! one `SequenceCache`, eager, CUDA events around each call): the MoE alone (`Moe::forward`
//! of T tokens inside `cuda::with_device_routing`: the streaming expert kernels up to 8 slots per
//! expert on average, the grouped `wgmma` GEMM above), the attention alone (`Attention::forward`) and
//! the whole layer (`DecoderLayer::forward`).
//!
//! `--cpu` loads on the CPU and runs every step once through the CPU paths (no timings; the MoE
//! takes the host path): a logic check of the composition, e.g. on a checkpoint written with
//! `--flash-shapes --layers 4 --experts 6 --engram-rows 65536`.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use deepseek_v41::config::{AttentionRole, Config};
use deepseek_v41::cuda::{decode_device, with_device_routing, SparseAttentionKernel};
use deepseek_v41::loader::{var_builder_with, QuantizedWeights, ReleaseCheckpoint};
use deepseek_v41::model::{DecoderLayer, Engram, EngramHasher, EngramHistory, EngramLocation, EngramOptions, EngramPlacement, LoadOptions, Pretrained};
use deepseek_v41::nn::linear::NamedLinears;
use deepseek_v41::tokenizer::{engram_token_map, Tokenizer};
use deepseek_v41::Numerics;

#[path = "support/repo_files.rs"]
mod repo_files;
#[path = "support/bench.rs"]
mod bench;
#[path = "support/batched_layer.rs"]
mod batched_layer;
#[path = "support/batched_step.rs"]
mod batched_step;
#[path = "support/flash_layer_step.rs"]
mod flash_layer_step;
#[path = "support/flash_prefill.rs"]
mod flash_prefill;
use batched_layer::{LayerKind, Weights};
use batched_step::{CacheFormat, Inputs, SourcePools, Step, StepCaches, WindowPool, PAGE, PHASES};
use bench::{gib, median, PoolPeak, Timer};
use flash_layer_step::{check_same_rows, finite_max, random_topk, EngramPart, EngramRows, LayerStep, MHC_PARTS};

#[derive(Parser, Debug)]
#[command(about = "One real-size V4.1-Flash decoder layer: batched decode step per phase, and prefill")]
struct Args {
    /// A Flash-width checkpoint folder (`synthetic_checkpoint --flash-shapes`).
    #[arg(long)]
    model: PathBuf,
    /// Batch sizes (sequences decoded in one step).
    #[arg(long, value_delimiter = ',', default_value = "1,64,256")]
    batch: Vec<usize>,
    /// Context length of every sequence.
    #[arg(long, default_value_t = 131072)]
    context: usize,
    /// Tokens of the prefill (0: none).
    #[arg(long, default_value_t = 4096)]
    prefill: usize,
    /// Cache formats: `bf16`, `packed` (MXFP4 index keys), `packed-kv` (window / compressed /
    /// index-key rows all packed: 528 / 288 / 68 B).
    #[arg(long, value_delimiter = ',', default_value = "bf16,packed-kv")]
    keys: Vec<String>,
    /// Where the model keeps its Engram tables (`model::EngramPlacement`; auto: on the device up
    /// to 1 GiB as bf16). The other place is measured as well when it fits.
    #[arg(long, default_value = "auto")]
    engram_placement: String,
    /// The checkpoint's layers to run (default: all; every layer is loaded).
    #[arg(long, value_delimiter = ',')]
    layers: Option<Vec<usize>>,
    /// `half`: every other sequence closes a compressor group this step; `all`: every sequence.
    #[arg(long, default_value = "half")]
    closing: String,
    /// Repetitions (median).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Warm-up calls before timing.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Target milliseconds of one repetition.
    #[arg(long, default_value_t = 20.0)]
    rep_ms: f64,
    /// Repetitions of each prefill call.
    #[arg(long, default_value_t = 3)]
    prefill_reps: usize,
    /// No CUDA graphs: eager timings only.
    #[arg(long)]
    eager_only: bool,
    /// Print the whole-layer graph's nodes by kernel (most frequent first) for each layer and B.
    #[arg(long)]
    census: bool,
    /// HBM read bandwidth of the roofline (GB/s).
    #[arg(long, default_value_t = 4260.0)]
    hbm_gbps: f64,
    /// Load on the CPU and run each step once (no timings): a logic check without a GPU.
    #[arg(long)]
    cpu: bool,
}

/// Timings (ms) of one (layer, B, format).
struct Row {
    layer: usize,
    kind: String,
    b: usize,
    fmt: CacheFormat,
    /// `(phase, ms, how)` in step order.
    phases: Vec<(String, Option<f64>, &'static str)>,
    /// Attention parts (graph).
    attn_parts: [Option<f64>; 5],
    /// mHC parts (graph), `MHC_PARTS`.
    mhc_parts: [Option<f64>; 4],
    graph: Option<f64>,
    eager: Option<f64>,
    /// Host work outside the graph (Engram hash, host-table gather).
    host_ms: f64,
    bytes: f64,
    touched: f64,
    roofline: f64,
}

impl Row {
    fn best(&self) -> Option<f64> {
        self.graph.or(self.eager).map(|t| t + self.host_ms)
    }
}

/// The Engram measurements of one (layer, B, table place).
struct EngramRow {
    layer: usize,
    b: usize,
    place: EngramLocation,
    hash_ms: f64,
    gather: Option<f64>,
    gather_how: &'static str,
    mix: Option<f64>,
}

/// Everything a (layer, B) run needs besides the format.
struct LayerRun<'a> {
    dl: &'a DecoderLayer,
    w: &'a Weights,
    /// A reuse layer's kv source (the step reads its compressed pools).
    kv_w: Option<&'a Weights>,
    s: Inputs,
    win: WindowPool,
    /// The other Engram placement's module (measured besides the model's own).
    other_engram: Option<&'a Engram>,
}

struct Bench<'a> {
    args: &'a Args,
    cfg: &'a Config,
    dev: Device,
    timer: Option<Timer>,
    hasher: Option<EngramHasher>,
    vocab: u32,
}

fn bytes_of(l: NamedLinears) -> f64 {
    l.iter().map(|(_, l)| l.weight().bytes() as f64).sum()
}

fn fmt_ms(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |v| format!("{:.1}", v * 1e3))
}

impl Bench<'_> {
    fn graph(&self, what: &str, f: impl FnMut() -> Result<()>) -> Option<f64> {
        let timer = self.timer.as_ref()?;
        if self.args.eager_only {
            return None;
        }
        match timer.graph(1, f) {
            Ok(v) => Some(v),
            Err(e) => {
                println!("    graph of {what}: error: {e:#}");
                None
            }
        }
    }

    fn eager(&self, what: &str, f: impl FnMut() -> Result<()>) -> Option<f64> {
        match self.timer.as_ref()?.calls(f) {
            Ok(v) => Some(v),
            Err(e) => {
                println!("    eager {what}: error: {e:#}");
                None
            }
        }
    }

    /// The Engram hash ids of `b` single-token steps (random tokens, histories of 3 earlier
    /// tokens) for `layer`, `[b·cols]`, and the median host time of hashing them (ms).
    fn engram_ids(&self, layer: usize, b: usize) -> Result<(Vec<u32>, f64)> {
        let h = self.hasher.as_ref().context("an Engram layer without a hasher")?;
        let tok = |i: usize| (i as u32).wrapping_mul(2_654_435_761) % self.vocab;
        let mut hist: Vec<EngramHistory> = (0..b).map(|_| h.new_history()).collect();
        for (s, hi) in hist.iter_mut().enumerate() {
            h.hash(&[tok(4 * s), tok(4 * s + 1), tok(4 * s + 2)], hi)?;
        }
        let mut times = Vec::new();
        let mut ids = Vec::new();
        for _ in 0..self.args.reps.max(1) {
            let mut hs = hist.clone();
            let t = Instant::now();
            let out = hs.iter_mut().enumerate().map(|(s, hi)| h.hash(&[tok(4 * s + 3)], hi)).collect::<candle_core::Result<Vec<_>>>()?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
            ids = out.iter().map(|o| o.layer(layer).map(|v| v.to_vec()).context("not an Engram layer")).collect::<Result<Vec<_>>>()?.concat();
        }
        Ok((ids, median(times)))
    }

    /// The rows part of an Engram module for `ids` (`[b·cols]`): the ids on the device for a
    /// device table, the rows gathered and copied now for a host table.
    fn engram_part<'e>(&self, e: &'e Engram, ids: &[u32], b: usize) -> Result<EngramPart<'e>> {
        let rows = match e.table().location() {
            EngramLocation::Device => EngramRows::DeviceIds(Tensor::from_slice(ids, ids.len(), &self.dev)?),
            EngramLocation::Host => {
                let cpu_ids = Tensor::from_slice(ids, ids.len(), &Device::Cpu)?;
                EngramRows::Staged(e.table().rows(&cpu_ids, &self.dev)?.reshape((b, ()))?)
            }
        };
        Ok(EngramPart { module: e, rows })
    }

    /// The eager gather of a host table's rows for `ids` (host gather into pinned staging, one
    /// copy, decode on the device); `None` for a device table.
    fn host_gather(&self, part: &EngramPart, ids: &[u32]) -> Result<Option<f64>> {
        let EngramRows::Staged(_) = &part.rows else { return Ok(None) };
        let cpu_ids = Tensor::from_slice(ids, ids.len(), &Device::Cpu)?;
        Ok(self.eager("engram host gather", || Ok(part.module.table().rows(&cpu_ids, &self.dev).map(|_| ())?)))
    }

    /// The gather (`host`: [`Bench::host_gather`]'s eager time; a device table's `index_select`
    /// graph-replayed) and the whole Engram of `part` for the stream `x` (graph:
    /// `forward_rows`, with the gather for a device table).
    fn engram_times(&self, part: &EngramPart, x: &Tensor, host: Option<f64>) -> (Option<f64>, &'static str, Option<f64>) {
        let (gather, how) = match &part.rows {
            EngramRows::DeviceIds(ids) => (self.graph("engram gather", || Ok(part.module.table().rows(ids, &self.dev).map(|_| ())?)), "graph"),
            EngramRows::Staged(_) => (host, "eager (host gather + copy)"),
        };
        (gather, how, self.graph("engram", || part.forward(x).map(|_| ())))
    }

    /// Measures one (layer, B, format); prints a line per phase as it goes.
    fn run_layer(&self, lr: &LayerRun, src: Option<&SourcePools>, fmt: CacheFormat, published: &mut HashMap<usize, Tensor>, erows: &mut Vec<EngramRow>) -> Result<Row> {
        let (cfg, w, dl, b) = (self.cfg, lr.w, lr.dl, lr.s.b);
        let reuse_topk = match w.kind {
            LayerKind::Reuse { index_source, .. } => Some(match published.get(&index_source) {
                Some(t) => t.clone(),
                None => {
                    println!("    layer {}: its index source {index_source} is not run: random top-k rows", dl.layer());
                    random_topk(&lr.s, w.topk, &self.dev)?
                }
            }),
            _ => None,
        };
        let kernel = SparseAttentionKernel::Auto;
        let layer = w.decode_layer()?;
        let kv_layer = lr.kv_w.map(|k| k.decode_layer()).transpose()?;
        let caches = StepCaches::new(&layer, &lr.win, src, kv_layer.as_ref(), fmt, &lr.s)?;
        let step = Step::new(w, &layer, &caches, &lr.s, fmt, kernel, reuse_topk.as_ref())?;
        let (x, p_in) = LayerStep::random_inputs(b, cfg.hc_mult, cfg.hidden_size, &self.dev)?;
        // Engram: the ids of this step, the model's module and the other placement's.
        let mut engram_ids = (Vec::new(), 0.0);
        let mut parts = Vec::new();
        if let Some(e) = dl.engram() {
            engram_ids = self.engram_ids(dl.layer(), b)?;
            for m in std::iter::once(e).chain(lr.other_engram) {
                parts.push(self.engram_part(m, &engram_ids.0, b)?);
            }
        }
        let mut engram_note = String::new();
        if let [own, other] = parts.as_slice() {
            check_same_rows(own, other, b)?;
            engram_note = format!("; Engram rows of the {} table = the {} table's, bit for bit", other.module.table().location(), own.module.table().location());
        }
        let mut parts = parts.into_iter();
        let engram = parts.next();
        let other = parts.next();
        let ls = LayerStep { layer: dl, attn: step, engram, x, p_in };
        // One eager run: sanity, the intermediates the phases start from, the routing.
        let xe = ls.engram(&ls.x)?;
        let (a, h) = ls.pre_attention(&xe)?;
        let (attn_sanity, topk) = ls.attn.sanity(&h)?;
        if let (LayerKind::Source, Some(t)) = (w.kind, topk) {
            published.insert(dl.layer(), t);
        }
        let y = ls.attn.run(&h)?;
        let m = ls.post_attention(&y, &xe, &a)?;
        let z = ls.moe(&m.h2)?;
        let (out, _) = ls.run()?;
        let (finite, max) = finite_max(&out)?;
        if !finite || max == 0.0 {
            bail!("layer output: finite {finite}, max |x| {max}")
        }
        let on_device = ls.moe_on_device(cfg.num_experts_per_tok);
        let ids = match (&self.timer, &on_device) {
            (Some(_), Ok(())) => ls.route(&m.h2)?.ids,
            _ => with_device_routing(|| dl.moe()?.forward(&m.h2))?.ids,
        };
        let mut touched_ids = ids.flatten_all()?.to_vec1::<u32>()?;
        touched_ids.sort_unstable();
        touched_ids.dedup();
        let touched = touched_ids.len() as f64;
        println!(
            "  layer {} B = {b} ({}): attention {attn_sanity}; layer output max |x| = {max:.3}; {touched} experts touched{engram_note}",
            dl.layer(),
            fmt.name()
        );
        let bytes = self.step_bytes(lr, fmt, touched)?;
        let mut row = Row {
            layer: dl.layer(),
            kind: describe(dl, w),
            b,
            fmt,
            phases: Vec::new(),
            attn_parts: [None; 5],
            mhc_parts: [None; 4],
            graph: None,
            eager: None,
            host_ms: engram_ids.1,
            bytes,
            touched,
            roofline: bytes / (self.args.hbm_gbps * 1e9) * 1e3,
        };
        if self.timer.is_none() {
            return Ok(row);
        }
        row.eager = self.eager("layer", || ls.run().map(|_| ()));
        let host = ls.engram.iter().chain(&other).map(|p| self.host_gather(p, &engram_ids.0)).collect::<Result<Vec<_>>>()?;
        // Candle uploads small host buffers (dims, strides) per call; with its upload cache on,
        // the warm-up call before each capture keeps them on the device for the replay
        // (bench_batched_decode.rs, `run_format`).
        let _uploads = self.dev.as_cuda_device()?.enable_cuda_graph_htod_cache();
        for (i, part) in ls.engram.iter().chain(&other).enumerate() {
            let (gather, gather_how, mix) = self.engram_times(part, &ls.x, host[i]);
            let place = part.module.table().location();
            if i == 0 {
                row.phases.push(("engram".into(), mix, "graph"));
                if place == EngramLocation::Host {
                    row.host_ms += gather.unwrap_or(0.0);
                }
            }
            erows.push(EngramRow { layer: dl.layer(), b, place, hash_ms: engram_ids.1, gather, gather_how, mix });
        }
        let mut ph = |name: &str, ms: Option<f64>, how: &'static str| row.phases.push((name.to_string(), ms, how));
        ph("mhc+norms", self.graph("mhc", || ls.mhc(&xe, &y, &z).map(|_| ())), "graph");
        ph("attention", self.graph("attention", || ls.attn.run(&h).map(|_| ())), "graph");
        match &on_device {
            Ok(()) => {
                let r = ls.route(&m.h2)?;
                let sh = ls.shared(&m.h2)?;
                ph("routing", self.graph("routing", || ls.route(&m.h2).map(|_| ())), "graph");
                ph("shared expert", self.graph("shared expert", || ls.shared(&m.h2).map(|_| ())), "graph");
                ph("experts+combine", self.graph("experts", || ls.experts(&m.h2, &r, sh.as_ref()).map(|_| ())), "graph");
                ph("moe", self.graph("moe", || ls.moe(&m.h2).map(|_| ())), "graph");
                row.graph = self.graph("the whole layer", || ls.run().map(|_| ()));
                if let (true, Some(t)) = (self.args.census, self.timer.as_ref()) {
                    match t.census(|| ls.run().map(|_| ())) {
                        Ok(c) => {
                            println!("    whole-layer graph: {} nodes by kernel:", c.iter().map(|n| n.1).sum::<usize>());
                            c.iter().for_each(|(name, n)| println!("      {n:5}  {name}"));
                        }
                        Err(e) => println!("    whole-layer census: error: {e:#}"),
                    }
                }
            }
            Err(why) => {
                println!("    moe eager, whole-layer graph: no ({why})");
                ph("moe", self.eager("moe", || ls.moe(&m.h2).map(|_| ())), "eager");
            }
        }
        let pr = ls.attn.projections(&h)?;
        let idx = ls.attn.selection(&pr)?;
        let o = ls.attn.attention(&pr, idx.as_ref())?;
        let st = &ls.attn;
        row.attn_parts = [
            self.graph(PHASES[0], || st.projections(&h).map(|_| ())),
            self.graph(PHASES[1], || st.inserts(&pr)),
            self.graph(PHASES[2], || st.selection(&pr).map(|_| ())),
            self.graph(PHASES[3], || st.attention(&pr, idx.as_ref()).map(|_| ())),
            self.graph(PHASES[4], || st.output(&o).map(|_| ())),
        ];
        let mp = ls.mhc_parts(&xe, &y)?;
        row.mhc_parts = [
            self.graph(MHC_PARTS[0], || ls.part_mixes(&mp)),
            self.graph(MHC_PARTS[1], || ls.part_product(&mp)),
            self.graph(MHC_PARTS[2], || ls.part_collapse_norm(&mp)),
            self.graph(MHC_PARTS[3], || ls.part_post(&mp)),
        ];
        println!(
            "    {}; layer graph {} us, eager {} us, host {:.1} us",
            row.phases.iter().map(|(n, v, how)| format!("{n} {} us ({how})", fmt_ms(*v))).collect::<Vec<_>>().join(", "),
            fmt_ms(row.graph),
            fmt_ms(row.eager),
            row.host_ms * 1e3
        );
        Ok(row)
    }

    /// Bytes one step of `lr` must read (see the module docs).
    fn step_bytes(&self, lr: &LayerRun, fmt: CacheFormat, touched: f64) -> Result<f64> {
        let (cfg, w, dl, b) = (self.cfg, lr.w, lr.dl, lr.s.b);
        let hc = cfg.hc_mult;
        let mhc = 2.0 * ((2 + hc) * hc * hc * cfg.hidden_size * 4) as f64;
        let moe = dl.moe()?;
        let router = bytes_of(moe.linears().into_iter().filter(|(n, _)| n == "gate").collect());
        let shared = moe.shared_expert().map_or(0.0, |s| bytes_of(s.linears()));
        let expert = moe.experts().first().map_or(0.0, |e| bytes_of(e.linears()));
        let engram = dl.engram().map_or(0.0, |e| {
            let cols = cfg.engram.as_ref().map_or(0, |c| (c.max_ngram_size - 1) * c.n_heads * c.head_dim);
            bytes_of(e.linears()) + (b * cols * 2) as f64
        });
        let (win_row, comp_row) = fmt.kv_row_bytes(w.hd);
        let mut per_seq = w.window as f64 * win_row;
        if w.kind.compressed() {
            per_seq += w.topk as f64 * comp_row;
        }
        if w.kind == LayerKind::Source {
            per_seq += lr.s.e as f64 * fmt.row_bytes();
        }
        Ok(w.bytes() + mhc + router + shared + touched * expert + engram + b as f64 * per_seq)
    }
}

/// `layer N: <kind>[ + Engram]`.
fn describe(dl: &DecoderLayer, w: &Weights) -> String {
    let kind = match w.kind {
        LayerKind::Reuse { index_source, .. } => format!("top-k reuse of {index_source}"),
        k => k.name().to_string(),
    };
    format!("{kind}{}", if dl.engram().is_some() { " + Engram" } else { "" })
}

/// `total − free` bytes of the device (0 on the CPU).
fn device_used(dev: &Device) -> Result<u64> {
    Ok(match dev {
        Device::Cuda(c) => {
            let (free, total) = c.cuda_stream().context().mem_get_info()?;
            (total - free) as u64
        }
        _ => 0,
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    let placement: EngramPlacement = args.engram_placement.parse().map_err(anyhow::Error::msg)?;
    let fmts = args.keys.iter().map(|k| CacheFormat::parse(k)).collect::<Result<Vec<_>>>()?;
    if !matches!(args.closing.as_str(), "half" | "all") {
        bail!("--closing must be half or all, got {:?}", args.closing)
    }
    let (dev, timer) = if args.cpu {
        (Device::Cpu, None)
    } else {
        // Before loading: no per-buffer events, a memory pool that keeps what it reserved.
        let dev = decode_device(0).context("bench_flash_layer needs a CUDA device (or --cpu)")?;
        let stream = dev.as_cuda_device()?.cuda_stream();
        (dev, Some(Timer { stream, warmup: args.warmup, reps: args.reps.max(1), rep_ms: args.rep_ms }))
    };
    let pool = timer.as_ref().map(|t| PoolPeak::new(&t.stream)).transpose()?;
    let used0 = device_used(&dev)?;

    // Load through the real loader (what `Pretrained::load_dir_with` runs), native weights.
    let t0 = Instant::now();
    let config = Config::from_file(args.model.join("config.json")).with_context(|| format!("reading {}/config.json", args.model.display()))?;
    let tokenizer = Tokenizer::from_file(repo_files::find_tokenizer(&args.model)?)?;
    let ckpt = ReleaseCheckpoint::open_dir(&args.model)?;
    let options = LoadOptions { quantized: QuantizedWeights::Native, engram: placement };
    let model = Pretrained::load_with(config, tokenizer, ckpt.clone(), Numerics::REFERENCE, DType::BF16, &dev, options)?;
    dev.synchronize()?;
    let cfg = &model.config;
    let weights_pool = pool.as_ref().map(|p| p.used()).transpose()?.unwrap_or(0);
    println!(
        "loaded {} in {:.1} s on {}: {} layers, hidden {}, {} routed experts (top-{}), quantized weights native, Engram placement {placement}",
        args.model.display(),
        t0.elapsed().as_secs_f64(),
        if args.cpu { "the CPU" } else { "CUDA" },
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.n_routed_experts,
        cfg.num_experts_per_tok
    );
    println!("device memory after loading: {:.2} GiB added (total - free), {:.2} GiB in candle's pool", gib(device_used(&dev)?.saturating_sub(used0)), gib(weights_pool));
    let placed = ckpt.placed_bytes();
    for dl in model.model.layers() {
        let prefix = format!("layers.{}.", dl.layer());
        let held: u64 = placed.iter().filter(|(n, _)| n.starts_with(&prefix)).map(|(_, b)| b).sum();
        let experts: u64 = placed.iter().filter(|(n, _)| n.starts_with(&format!("{prefix}ffn.experts."))).map(|(_, b)| b).sum();
        println!("  layer {}: {:.3} GB on the device ({:.3} GB routed experts)", dl.layer(), held as f64 / 1e9, experts as f64 / 1e9);
    }
    for t in model.engram_placements() {
        println!("  Engram layer {}: [{} x {}] table on the {} ({:.3} GB there)", t.layer, t.rows, t.width, t.location, t.bytes as f64 / 1e9);
    }

    let hasher = match &cfg.engram {
        Some(e) => Some(EngramHasher::new(e, engram_token_map(&model.tokenizer)?)?),
        None => None,
    };
    let vocab = model.tokenizer.vocab_size().min(cfg.vocab_size) as u32;
    let bench = Bench { args: &args, cfg, dev: dev.clone(), timer, hasher, vocab };
    let layers = model.model.layers();
    let run: Vec<usize> = match &args.layers {
        Some(ls) => {
            if let Some(l) = ls.iter().find(|&&l| l >= layers.len()) {
                bail!("--layers: the checkpoint has layers 0..{}, got {l}", layers.len())
            }
            ls.clone()
        }
        None => (0..layers.len()).collect(),
    };
    // The batched step's weights of each layer run (the loaded modules' tensors).
    let mut ws = BTreeMap::new();
    for &l in &run {
        match Weights::from_attention(cfg, l, layers[l].attention()) {
            Ok(w) => {
                ws.insert(l, w);
            }
            Err(e) => println!("layer {l}: skipped in the decode step: {e:#}"),
        }
    }
    // The kv sources of the reuse layers run (their compressed pools are read).
    let mut kv_ws = BTreeMap::new();
    for w in ws.values() {
        if let LayerKind::Reuse { kv_source, .. } = w.kind {
            if let std::collections::btree_map::Entry::Vacant(v) = kv_ws.entry(kv_source) {
                v.insert(Weights::from_attention(cfg, kv_source, layers[kv_source].attention())?);
            }
        }
    }
    let ctx = args.context;
    if ctx < 2 * cfg.index_topk.max(cfg.sliding_window) || ctx % (2 * PAGE) != 0 {
        bail!("--context {ctx} must be >= {} and a multiple of {}", 2 * cfg.index_topk.max(cfg.sliding_window), 2 * PAGE)
    }
    // The other Engram placement of each Engram layer, when it fits (device: its bf16 table).
    let vb = var_builder_with(ckpt.clone(), DType::BF16, &dev, QuantizedWeights::Native);
    let mut others = BTreeMap::new();
    for &l in &run {
        let Some(e) = layers[l].engram() else { continue };
        let (rows, width) = e.table().dims();
        let other = match e.table().location() {
            EngramLocation::Device => EngramPlacement::Host,
            EngramLocation::Host if (rows * width * 2) as u64 <= (1 << 32) => EngramPlacement::Device,
            EngramLocation::Host => {
                println!("layer {l}: the Engram table ({rows} rows) is not also loaded on the device (over 4 GiB as bf16)");
                continue;
            }
        };
        let opts = EngramOptions::new(other, &ckpt);
        match Engram::load(cfg, l, Numerics::REFERENCE, vb.pp("layers").pp(l).pp("engram"), &opts) {
            Ok(m) => {
                others.insert(l, m);
            }
            Err(e) => println!("layer {l}: the Engram table with placement {other} could not be loaded: {e:#}"),
        }
    }

    let mut rows = Vec::new();
    let mut erows = Vec::new();
    let mut mem = Vec::new();
    for &b in &args.batch {
        if b == 0 {
            continue;
        }
        let t = Instant::now();
        let result = (|| -> Result<()> {
            // The compressed pools of every kv source the layers run read.
            let mut srcs = BTreeMap::new();
            for w in ws.values() {
                let AttentionRole::Compressed { ratio, kv_source, .. } = layers[w.layer].attention().role() else { continue };
                if let std::collections::btree_map::Entry::Vacant(v) = srcs.entry(kv_source) {
                    v.insert(SourcePools::new(b, ctx / ratio, w.hd, w.di, &fmts, &dev)?);
                }
            }
            let mut runs = Vec::new();
            for (&l, w) in &ws {
                let s = Inputs::new(w, cfg.hidden_size, b, ctx, args.closing == "all", &dev)?;
                let win = WindowPool::new(b, w.window, w.hd, &fmts, &dev)?;
                let kv_w = match w.kind {
                    LayerKind::Reuse { kv_source, .. } => kv_ws.get(&kv_source),
                    _ => None,
                };
                runs.push(LayerRun { dl: &layers[l], w, kv_w, s, win, other_engram: others.get(&l) });
            }
            dev.synchronize()?;
            let caches = srcs.values().map(SourcePools::bytes).sum::<u64>() + runs.iter().map(|r| r.win.bytes()).sum::<u64>();
            if let Some(p) = &pool {
                p.reset()?;
            }
            let held = pool.as_ref().map(|p| p.used()).transpose()?.unwrap_or(0);
            println!("\nB = {b}: caches filled in {:.1} s: {:.2} GiB ({} kv source(s), {} window pools)", t.elapsed().as_secs_f64(), gib(caches), srcs.len(), runs.len());
            for &fmt in &fmts {
                let mut published = HashMap::new();
                for r in &runs {
                    let src = match r.w.kind {
                        LayerKind::Source => srcs.get(&r.w.layer),
                        LayerKind::Reuse { kv_source, .. } => srcs.get(&kv_source),
                        LayerKind::WindowOnly => None,
                    };
                    match bench.run_layer(r, src, fmt, &mut published, &mut erows) {
                        Ok(row) => rows.push(row),
                        Err(e) => println!("  layer {} B = {b} ({}): error: {e:#}", r.w.layer, fmt.name()),
                    }
                }
            }
            dev.synchronize()?;
            let peak = pool.as_ref().map(|p| p.peak()).transpose()?.unwrap_or(0);
            mem.push((b, caches, held, peak, device_used(&dev)?));
            Ok(())
        })();
        if let Err(e) = result {
            println!("B = {b}: error: {e:#}");
        }
        dev.synchronize()?;
    }
    report(&bench, &rows, &erows, &mem, weights_pool);
    if args.prefill > 0 {
        let stream = bench.timer.as_ref().map(|t| t.stream.clone());
        let pf = flash_prefill::Prefill { tokens: args.prefill, reps: args.prefill_reps, cfg, dev: &bench.dev, stream: stream.as_deref(), vocab: bench.vocab, hasher: bench.hasher.as_ref() };
        if let Err(e) = pf.run(&model, &run) {
            println!("prefill: error: {e:#}");
        }
    }
    Ok(())
}

/// The summary tables.
fn report(bench: &Bench, rows: &[Row], erows: &[EngramRow], mem: &[(usize, u64, u64, u64, u64)], weights: u64) {
    let args = bench.args;
    if bench.timer.is_none() {
        println!("\n--cpu: every step ran once and passed its checks (no timings)");
        return;
    }
    println!("\n## decode step of one layer, B sequences at {} tokens each (us per step, median)\n", args.context);
    println!("Phases graph-replayed alone (`eager`: not capturable, see the log); layer = the whole step as one CUDA graph");
    println!("(eager: back-to-back calls); host = Engram hash and host-table gather, outside the graph; tokens/s = B / (layer + host).\n");
    println!("| layer | kind | B | caches | engram | mhc+norms | attention | routing | shared | experts+combine | moe | layer (graph) | layer (eager) | host | tokens/s | touched experts | MB read | roofline us | % of roofline |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let ph = |name: &str| {
            r.phases.iter().find(|(n, _, _)| n == name).map_or("-".to_string(), |(_, v, how)| {
                format!("{}{}", fmt_ms(*v), if *how == "eager" { " (eager)" } else { "" })
            })
        };
        let best = r.best();
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} | {} | {:.0} | {:.1} | {:.1} | {} |",
            r.layer,
            r.kind,
            r.b,
            r.fmt.name(),
            ph("engram"),
            ph("mhc+norms"),
            ph("attention"),
            ph("routing"),
            ph("shared expert"),
            ph("experts+combine"),
            ph("moe"),
            fmt_ms(r.graph),
            fmt_ms(r.eager),
            r.host_ms * 1e3,
            best.map_or("n/a".into(), |t| format!("{:.0}", r.b as f64 / t * 1e3)),
            r.touched,
            r.bytes / 1e6,
            r.roofline * 1e3,
            best.map_or("n/a".into(), |t| format!("{:.0}%", r.roofline / t * 100.0)),
        );
    }
    println!("\nwhole-layer graph: {}", whole_graph_summary(rows));
    println!("\nAttention parts (each captured alone, us):\n");
    println!("| layer | B | caches | {} |", PHASES.join(" | "));
    println!("|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!("| {} | {} | {} | {} |", r.layer, r.b, r.fmt.name(), r.attn_parts.iter().map(|v| fmt_ms(*v)).collect::<Vec<_>>().join(" | "));
    }
    println!("\nmHC parts of the attention sublayer (each captured alone, us; the step runs each twice, once per sublayer):\n");
    println!("| layer | B | {} |", MHC_PARTS.join(" | "));
    println!("|---|---|---|---|---|---|");
    for r in rows {
        println!("| {} | {} | {} |", r.layer, r.b, r.mhc_parts.iter().map(|v| fmt_ms(*v)).collect::<Vec<_>>().join(" | "));
    }
    if !erows.is_empty() {
        println!("\nEngram (us): hash of B tokens on the host; gather of the B x 24 rows; wkv + gate (graph; with the gather for a device table):\n");
        println!("| layer | B | table | hash (host) | gather | gather timed | engram (graph) |");
        println!("|---|---|---|---|---|---|---|");
        let mut seen = std::collections::HashSet::new();
        for e in erows.iter().filter(|e| seen.insert((e.layer, e.b, e.place.name()))) {
            println!("| {} | {} | {} | {:.1} | {} | {} | {} |", e.layer, e.b, e.place, e.hash_ms * 1e3, fmt_ms(e.gather), e.gather_how, fmt_ms(e.mix));
        }
    }
    println!(
        "\nroofline = bytes / {:.2} TB/s: attention weights + 2 hc_*_fn + router + shared expert + touched experts x codes and scales + Engram wkv and rows + B x (128 window rows + [compressed layers] 512 top-k rows + [kv sources] E index keys) in the format's sizes",
        args.hbm_gbps / 1e3
    );
    println!("\nDevice memory (GiB): the loaded model {:.2} (candle's pool after loading; every layer, embedding and head)\n", gib(weights));
    println!("| B | caches | held before the steps | peak during the steps | total - free after |");
    println!("|---|---|---|---|---|");
    for &(b, caches, held, peak, used) in mem {
        println!("| {b} | {:.2} | {:.2} | {:.2} | {:.2} |", gib(caches), gib(held), gib(peak), gib(used));
    }
}

/// Whether every row's whole step was captured, and why not where it was not.
fn whole_graph_summary(rows: &[Row]) -> String {
    if rows.iter().all(|r| r.graph.is_some()) {
        let host = rows.iter().any(|r| r.host_ms > 0.0);
        return format!("yes{}", if host { " (the Engram hash and any host-table gather run before the replay, eager)" } else { "" });
    }
    let missing: Vec<String> = rows.iter().filter(|r| r.graph.is_none()).map(|r| format!("layer {} B = {} {}", r.layer, r.b, r.fmt.name())).collect();
    format!("no for {} (see the log: MoE off the device, --eager-only or a capture error)", missing.join(", "))
}
