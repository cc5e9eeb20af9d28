//! What loading a model will place where, from its [`Config`] and the load options alone — no
//! checkpoint is read ([`LoadPlan`]; `generate --dry-run`, `docs/perf.md` "Loading").
//!
//! The plan lists every text-model tensor of a release checkpoint (spec §12.1; MTP and vision
//! tensors are not loaded, spec §10) with the bytes it is stored in and the bytes the model holds
//! once loaded, as the modules load them (`docs/architecture.md` "Where the weights live"):
//!
//! | tensor | CPU | CUDA, `Native`, bf16 | CUDA, `Dequantized` or f32 |
//! |---|---|---|---|
//! | quantized linears stored FP8 32×32 (`wq_a`, `wq_b`, `wkv`, `wo_b`, `indexer.wq_b`, `engram.wkv`, shared experts) | f32 | FP8 codes + scales | activation dtype |
//! | routed experts stored MXFP4 | f32 | MXFP4 codes + scales (`in` a multiple of 32) | activation dtype |
//! | grouped `wo_a` (each group whole 32-row blocks) | f32 | FP8 codes + scales | activation dtype |
//! | plain linears (`compressor.wkv` of ratio 1, `indexer.wk`, `weights_proj`) | f32 | activation dtype | activation dtype |
//! | f32 linears (`head`, `ffn.gate`, ratio-2 `compressor.wkv` / `wgate`) | f32 | f32 | f32 |
//! | norms, mHC, sinks, router biases, Engram `q_weight` / `k_weight` | f32 | f32 | f32 |
//! | embedding | activation dtype | activation dtype | activation dtype |
//! | Engram tables ([`engram_table_place`]) | bf16 or mapped | bf16 or mapped | bf16 or mapped |
//!
//! The held bytes of the tensors placed on the device are, to the byte, what
//! [`super::ReleaseCheckpoint::placed_bytes`] records while the model loads (tested on the CPU in
//! `tests/load_plan.rs`, on CUDA in `tests/cuda_load_plan.rs` and by `load_report`). Stored bytes
//! assume the release's storage (spec §2.4): FP8 32×32 for the quantized linears, MXFP4 routed
//! experts, FP8 rows with 1×32 scales for the Engram tables, bf16 for the plain weights, f32 for
//! sinks, mHC and router biases; all bf16 when the config has no `quantization_config`.
//!
//! The plan also gives the caches' bytes ([`CachePlan`]).

use candle_core::{DType, Device};

use super::dequant::{blocks, BLOCK};
use super::native::QuantizedWeights;
use crate::attention::storage::{CacheKind, CacheStorage, PACKED_PAGE_TOKENS};
use crate::config::{AttentionRole, Config};
use crate::model::{EngramLocation, EngramPlacement};

#[path = "plan_display.rs"]
mod display;

/// The device kind a plan is made for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanDevice {
    /// The CPU: every linear weight dense f32 (the reference).
    Cpu,
    /// A CUDA device (the plan does not need one, nor the `cuda` feature: it says what a CUDA
    /// build places).
    Cuda,
}

impl PlanDevice {
    /// The kind of `device` (any non-CPU device is planned as CUDA).
    pub fn of(device: &Device) -> Self {
        if device.is_cpu() {
            Self::Cpu
        } else {
            Self::Cuda
        }
    }

    /// `"cpu"` or `"cuda"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
        }
    }
}

/// The options a load runs with (those of `Pretrained::load_with`: its dtype and device, and its
/// [`crate::model::LoadOptions`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanOptions {
    /// The activation dtype (bf16 or f32).
    pub dtype: DType,
    /// Where the model runs.
    pub device: PlanDevice,
    /// How the quantized weights are held (takes effect on CUDA with bf16 activations only).
    pub quantized: QuantizedWeights,
    /// Where the Engram tables go ([`engram_table_place`]).
    pub engram: EngramPlacement,
}

impl PlanOptions {
    /// The dtype the dense linear weights are held in: f32 on the CPU, the activation dtype
    /// elsewhere (`nn::linear::compute_dtype`).
    pub fn compute_dtype(&self) -> DType {
        match self.device {
            PlanDevice::Cpu => DType::F32,
            PlanDevice::Cuda => self.dtype,
        }
    }

    /// Whether quantized linears keep their stored format (`nn::LinearWeight::load`: CUDA, bf16,
    /// [`QuantizedWeights::Native`]).
    pub fn native(&self) -> bool {
        self.device == PlanDevice::Cuda && self.dtype == DType::BF16 && self.quantized == QuantizedWeights::Native
    }
}

/// What a plan's row is part of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Component {
    /// `ffn.experts.E.w{1,2,3}`.
    RoutedExperts,
    /// `ffn.shared_experts.w{1,2,3}`.
    SharedExperts,
    /// `ffn.gate.{weight, bias, bias_vl}`.
    Router,
    /// `attn.{wq_a, wq_b, wkv, wo_a, wo_b, attn_sink}` of the layers of one compress ratio (0:
    /// window only).
    Attention {
        /// The layers' compress ratio.
        ratio: usize,
    },
    /// `attn.compressor.*` and `attn.indexer.*` (kv and index sources).
    CompressorIndexer,
    /// `hc_{attn,ffn}_{fn,base,scale}`.
    Mhc,
    /// Every RMSNorm weight (`*norm.weight`).
    Norms,
    /// `embed.weight`.
    Embedding,
    /// `head.weight`.
    Head,
    /// `engram.embed.weight`.
    EngramTables,
    /// `engram.{wkv, q_weight, k_weight}`.
    Engram,
}

impl std::fmt::Display for Component {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::RoutedExperts => f.write_str("routed experts"),
            Self::SharedExperts => f.write_str("shared experts"),
            Self::Router => f.write_str("router"),
            Self::Attention { ratio: 0 } => f.write_str("attention, window only"),
            Self::Attention { ratio } => write!(f, "attention, ratio {ratio}"),
            Self::CompressorIndexer => f.write_str("compressor + indexer"),
            Self::Mhc => f.write_str("mHC"),
            Self::Norms => f.write_str("norms"),
            Self::Embedding => f.write_str("embedding"),
            Self::Head => f.write_str("head"),
            Self::EngramTables => f.write_str("Engram tables"),
            Self::Engram => f.write_str("Engram wkv, q, k"),
        }
    }
}

/// How a loaded tensor is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Held {
    /// A dense tensor of this dtype.
    Dense(DType),
    /// FP8 e4m3 codes + e8m0 32×32 block scales as stored.
    Fp8,
    /// MXFP4 packed e2m1 codes + e8m0 row scales as stored.
    Mxfp4,
    /// Not loaded: rows read from the memory-mapped checkpoint on lookup.
    Mapped,
}

impl std::fmt::Display for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Dense(DType::BF16) => f.write_str("bf16"),
            Self::Dense(DType::F32) => f.write_str("f32"),
            Self::Dense(d) => write!(f, "{d:?}"),
            Self::Fp8 => f.write_str("FP8"),
            Self::Mxfp4 => f.write_str("MXFP4"),
            Self::Mapped => f.write_str("mapped FP8 rows"),
        }
    }
}

/// Where a tensor's held bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Place {
    /// On the model's device (the CPU's memory for a CPU load).
    Device,
    /// In host memory: the checkpoint's pages, mapped (file-backed, in the page cache).
    HostMapped,
}

/// One tensor of the plan.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedTensor {
    /// Checkpoint name (`layers.3.attn.wq_a.weight`).
    pub name: String,
    /// What it is part of.
    pub component: Component,
    /// Logical shape.
    pub shape: Vec<usize>,
    /// Bytes in the checkpoint (weight plus scale), in the release's storage (module docs).
    pub stored_bytes: u64,
    /// How it is held once loaded.
    pub held: Held,
    /// Bytes held ([`Held::Mapped`]: the stored bytes, in the page cache).
    pub held_bytes: u64,
    /// Where the held bytes live.
    pub place: Place,
    /// Whether it is the weight of a linear (`Model::linears`, held as `nn::LinearWeight`).
    pub linear: bool,
}

/// Where an Engram table of `rows × head_dim` lives under `placement`, by the model's rule for a
/// load from a checkpoint ([`EngramPlacement::with_checkpoint`]): on the device, dequantized to
/// bf16; or in host memory, its stored rows read from the memory-mapped checkpoint per call
/// (`model::HostRows`; the released tables have ~384M rows, ~101 GB each).
/// [`EngramPlacement::Auto`] keeps a table on the device when it takes at most
/// [`crate::model::AUTO_DEVICE_MAX_BYTES`] (1 GiB) as bf16.
pub fn engram_table_place(rows: usize, head_dim: usize, placement: EngramPlacement) -> Place {
    match placement.with_checkpoint(rows, head_dim) {
        EngramLocation::Device => Place::Device,
        EngramLocation::Host => Place::HostMapped,
    }
}

/// The caches of one sequence (spec §7; `attention::storage`): fixed window rings, and the
/// compressed entries plus index keys that grow with the sequence.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CachePlan {
    /// Layers (one window ring each).
    pub layers: usize,
    /// Rows per window ring (`sliding_window`).
    pub window: usize,
    /// Every layer's window ring, rows in the activation dtype.
    pub window_bytes_rows: u64,
    /// Every layer's window ring, packed (format A, whole pages).
    pub window_bytes_packed: u64,
    /// Compressed entries plus index keys per token over all kv sources (each adds one entry per
    /// `ratio` tokens), rows in the activation dtype.
    pub per_token_rows: f64,
    /// The same, packed (formats B and E).
    pub per_token_packed: f64,
}

impl CachePlan {
    /// The caches of `cfg` with rows in `dtype`.
    pub fn new(cfg: &Config, dtype: DType) -> Self {
        let (hd, ihd, w) = (cfg.head_dim, cfg.index_head_dim, cfg.sliding_window);
        let rows = |width: usize| (width * dtype.size_in_bytes()) as f64;
        let packed = |kind, width| CacheStorage::Packed.row_bytes(kind, width) as f64;
        let (mut per_token_rows, mut per_token_packed) = (0.0, 0.0);
        for role in &cfg.layers {
            if let AttentionRole::Compressed { ratio, kv_source, .. } = role.attention {
                if kv_source == role.layer && ratio > 0 {
                    per_token_rows += (rows(hd) + rows(ihd)) / ratio as f64;
                    per_token_packed += (packed(CacheKind::Compressed, hd) + packed(CacheKind::IndexKeys, ihd)) / ratio as f64;
                }
            }
        }
        let n = cfg.layers.len() as u64;
        let ring_packed = w.div_ceil(PACKED_PAGE_TOKENS) * PACKED_PAGE_TOKENS * CacheStorage::Packed.row_bytes(CacheKind::Window, hd);
        Self {
            layers: cfg.layers.len(),
            window: w,
            window_bytes_rows: n * (w * hd * dtype.size_in_bytes()) as u64,
            window_bytes_packed: n * ring_packed as u64,
            per_token_rows,
            per_token_packed,
        }
    }
}

/// Every tensor a load places, with its bytes and place, and the caches' bytes (module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct LoadPlan {
    /// The options planned for.
    pub options: PlanOptions,
    /// Backbone layers.
    pub layers: usize,
    /// Routed experts per layer.
    pub experts: usize,
    /// Every tensor, in the order the model loads them (embedding, layers, final norm, head).
    pub tensors: Vec<PlannedTensor>,
    /// The caches of one sequence.
    pub cache: CachePlan,
}

/// One row of [`LoadPlan::components`]: a component's tensors summed.
#[derive(Debug, Clone, PartialEq)]
pub struct ComponentPlan {
    /// The component.
    pub component: Component,
    /// Its tensors.
    pub tensors: usize,
    /// Their stored bytes.
    pub stored_bytes: u64,
    /// Held bytes on the device.
    pub device_bytes: u64,
    /// Held bytes in host memory (mapped).
    pub host_bytes: u64,
    /// The forms they are held in, by first appearance.
    pub held: Vec<Held>,
}

/// How a tensor is stored in the release (for the stored bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stored {
    Bf16,
    F32,
    Fp8Block32,
    Fp8Rows,
    Mxfp4,
}

impl Stored {
    fn bytes(self, shape: &[usize]) -> u64 {
        let n: usize = shape.iter().product();
        let b = match (self, shape) {
            (Self::Bf16, _) => 2 * n,
            (Self::F32, _) => 4 * n,
            (Self::Fp8Block32, &[o, i]) => o * i + blocks(o) * blocks(i),
            (Self::Fp8Rows, &[o, i]) => o * i + o * blocks(i),
            (Self::Mxfp4, &[o, i]) => o * i / 2 + o * blocks(i),
            _ => 2 * n,
        };
        b as u64
    }
}

/// How a linear computes (`nn::LinearKind`), for the form its weight is held in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Quantized,
    Plain,
    F32,
}

/// Builds the tensor list.
struct Planner<'a> {
    cfg: &'a Config,
    opts: PlanOptions,
    tensors: Vec<PlannedTensor>,
}

impl Planner<'_> {
    fn push(&mut self, name: String, component: Component, shape: &[usize], stored: Stored, held: Held, place: Place) {
        let n: u64 = shape.iter().map(|&d| d as u64).product();
        let stored_bytes = stored.bytes(shape);
        let held_bytes = match (held, shape) {
            (Held::Dense(d), _) => n * d.size_in_bytes() as u64,
            (Held::Fp8, &[o, i]) => (o * i + blocks(o) * blocks(i)) as u64,
            (Held::Mxfp4, &[o, i]) => (o * i / 2 + o * blocks(i)) as u64,
            (Held::Fp8 | Held::Mxfp4, _) => n,
            (Held::Mapped, _) => stored_bytes,
        };
        let linear = false;
        self.tensors.push(PlannedTensor { name, component, shape: shape.to_vec(), stored_bytes, held, held_bytes, place, linear });
    }

    /// A tensor held dense in `dtype`, stored as `stored`.
    fn dense(&mut self, name: String, component: Component, shape: &[usize], stored: Stored, dtype: DType) {
        self.push(name, component, shape, stored, Held::Dense(dtype), Place::Device);
    }

    /// `<prefix>.weight` `[out, in]` of a linear of `kind`, stored as `stored` when the checkpoint
    /// is quantized (bf16 otherwise), held as `nn::LinearWeight::load` holds it.
    fn linear(&mut self, prefix: &str, component: Component, (out, inp): (usize, usize), kind: Kind, stored: Stored) {
        let quantized = self.cfg.quantization.is_some();
        let stored = if kind == Kind::Quantized && !quantized { Stored::Bf16 } else { stored };
        let held = match (kind, stored) {
            (Kind::F32, _) => Held::Dense(DType::F32),
            (Kind::Quantized, Stored::Fp8Block32) if self.opts.native() => Held::Fp8,
            (Kind::Quantized, Stored::Mxfp4) if self.opts.native() && inp.is_multiple_of(BLOCK) => Held::Mxfp4,
            _ => Held::Dense(self.opts.compute_dtype()),
        };
        self.push(format!("{prefix}.weight"), component, &[out, inp], stored, held, Place::Device);
        if let Some(t) = self.tensors.last_mut() {
            t.linear = true;
        }
    }

    fn f32(&mut self, name: String, component: Component, shape: &[usize], stored: Stored) {
        self.dense(name, component, shape, stored, DType::F32);
    }

    fn norm(&mut self, prefix: &str, dim: usize) {
        self.f32(format!("{prefix}.weight"), Component::Norms, &[dim], Stored::Bf16);
    }

    /// `layers.l.attn.*` (`attention::Attention::new`).
    fn attention(&mut self, l: usize, ratio: usize) {
        let c = self.cfg;
        let (d, h, hd, ql) = (c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank);
        let (g, ol) = (c.o_groups, c.o_lora_rank);
        let p = format!("layers.{l}.attn");
        let at = Component::Attention { ratio };
        let fp8 = if c.quantization.is_some() { Stored::Fp8Block32 } else { Stored::Bf16 };
        self.linear(&format!("{p}.wq_a"), at, (ql, d), Kind::Quantized, Stored::Fp8Block32);
        self.norm(&format!("{p}.q_norm"), ql);
        self.linear(&format!("{p}.wq_b"), at, (h * hd, ql), Kind::Quantized, Stored::Fp8Block32);
        self.linear(&format!("{p}.wkv"), at, (hd, d), Kind::Quantized, Stored::Fp8Block32);
        self.norm(&format!("{p}.kv_norm"), hd);
        let wo_a = [g * ol, h.checked_div(g).unwrap_or(0) * hd];
        // `nn::GroupedLinear::new`: FP8 as stored when native and each group is whole 32-row blocks.
        let held = match fp8 {
            Stored::Fp8Block32 if self.opts.native() && (g == 1 || ol.is_multiple_of(BLOCK)) => Held::Fp8,
            _ => Held::Dense(self.opts.compute_dtype()),
        };
        self.push(format!("{p}.wo_a.weight"), at, &wo_a, fp8, held, Place::Device);
        self.linear(&format!("{p}.wo_b"), at, (d, g * ol), Kind::Quantized, Stored::Fp8Block32);
        self.f32(format!("{p}.attn_sink"), at, &[h], Stored::F32);
        let ci = Component::CompressorIndexer;
        if c.is_kv_source(l) {
            let kind = if ratio > 1 { Kind::F32 } else { Kind::Plain };
            self.linear(&format!("{p}.compressor.wkv"), ci, (hd, d), kind, Stored::Bf16);
            if ratio > 1 {
                self.linear(&format!("{p}.compressor.wgate"), ci, (hd, d), Kind::F32, Stored::Bf16);
            }
            self.norm(&format!("{p}.compressor.norm"), hd);
            self.linear(&format!("{p}.indexer.wk"), ci, (c.index_head_dim, hd), Kind::Plain, Stored::Bf16);
            self.norm(&format!("{p}.indexer.k_norm"), c.index_head_dim);
        }
        if c.is_index_source(l) {
            self.linear(&format!("{p}.indexer.wq_b"), ci, (c.index_n_heads * c.index_head_dim, ql), Kind::Quantized, Stored::Fp8Block32);
            self.linear(&format!("{p}.indexer.weights_proj"), ci, (c.index_n_heads, d), Kind::Plain, Stored::Bf16);
        }
    }

    /// `layers.l.ffn.*` (`model::Moe::new`).
    fn moe(&mut self, l: usize) {
        let c = self.cfg;
        let (d, e, mi) = (c.hidden_size, c.n_routed_experts, c.moe_intermediate_size);
        let p = format!("layers.{l}.ffn");
        self.linear(&format!("{p}.gate"), Component::Router, (e, d), Kind::F32, Stored::Bf16);
        self.f32(format!("{p}.gate.bias"), Component::Router, &[e], Stored::F32);
        self.f32(format!("{p}.gate.bias_vl"), Component::Router, &[e], Stored::F32);
        let mxfp4 = if c.quantization.is_some() { Stored::Mxfp4 } else { Stored::Bf16 };
        for x in 0..e {
            self.expert(&format!("{p}.experts.{x}"), Component::RoutedExperts, mi, mxfp4);
        }
        if c.n_shared_experts > 0 {
            self.expert(&format!("{p}.shared_experts"), Component::SharedExperts, mi * c.n_shared_experts, Stored::Fp8Block32);
        }
    }

    /// `w1`, `w3` `[inter, D]` and `w2` `[D, inter]` of an expert (`model::moe::Expert::new`).
    fn expert(&mut self, prefix: &str, component: Component, inter: usize, stored: Stored) {
        let d = self.cfg.hidden_size;
        self.linear(&format!("{prefix}.w1"), component, (inter, d), Kind::Quantized, stored);
        self.linear(&format!("{prefix}.w2"), component, (d, inter), Kind::Quantized, stored);
        self.linear(&format!("{prefix}.w3"), component, (inter, d), Kind::Quantized, stored);
    }

    /// `layers.l.engram.*` (`model::Engram::load`).
    fn engram(&mut self, l: usize) {
        let c = self.cfg;
        let (Some(e), Some(slot)) = (&c.engram, c.engram_slot(l)) else { return };
        let rows = e.num_embeddings.get(slot).copied().unwrap_or(0);
        let (hc, d) = (c.hc_mult, c.hidden_size);
        let p = format!("layers.{l}.engram");
        let table = [rows, e.head_dim];
        let stored = if c.quantization.is_some() { Stored::Fp8Rows } else { Stored::Bf16 };
        match engram_table_place(rows, e.head_dim, self.opts.engram) {
            Place::Device => self.dense(format!("{p}.embed.weight"), Component::EngramTables, &table, stored, DType::BF16),
            Place::HostMapped => self.push(format!("{p}.embed.weight"), Component::EngramTables, &table, stored, Held::Mapped, Place::HostMapped),
        }
        let cols = e.max_ngram_size.saturating_sub(1) * e.n_heads * e.head_dim;
        self.linear(&format!("{p}.wkv"), Component::Engram, ((hc + 1) * d, cols), Kind::Quantized, Stored::Fp8Block32);
        self.f32(format!("{p}.q_weight"), Component::Engram, &[hc, d], Stored::Bf16);
        self.f32(format!("{p}.k_weight"), Component::Engram, &[hc, d], Stored::Bf16);
    }

    /// `layers.l.*` (`model::DecoderLayer::new`).
    fn layer(&mut self, l: usize) {
        let c = self.cfg;
        let (d, hc) = (c.hidden_size, c.hc_mult);
        let ratio = match c.layers[l].attention {
            AttentionRole::WindowOnly => 0,
            AttentionRole::Compressed { ratio, .. } => ratio,
        };
        self.engram(l);
        for s in ["attn", "ffn"] {
            self.f32(format!("layers.{l}.hc_{s}_fn"), Component::Mhc, &[(2 + hc) * hc, hc * d], Stored::F32);
            self.f32(format!("layers.{l}.hc_{s}_base"), Component::Mhc, &[(2 + hc) * hc], Stored::F32);
            self.f32(format!("layers.{l}.hc_{s}_scale"), Component::Mhc, &[3], Stored::F32);
        }
        self.norm(&format!("layers.{l}.attn_norm"), d);
        self.attention(l, ratio);
        self.norm(&format!("layers.{l}.ffn_norm"), d);
        self.moe(l);
    }
}

impl LoadPlan {
    /// The plan of loading a model of `cfg` with `options` (see the module docs). Reads nothing.
    pub fn new(cfg: &Config, options: PlanOptions) -> Self {
        let mut p = Planner { cfg, opts: options, tensors: Vec::new() };
        let (v, d) = (cfg.vocab_size, cfg.hidden_size);
        p.dense("embed.weight".into(), Component::Embedding, &[v, d], Stored::Bf16, options.dtype);
        for l in 0..cfg.layers.len() {
            p.layer(l);
        }
        p.norm("norm", d);
        p.linear("head", Component::Head, (v, d), Kind::F32, Stored::Bf16);
        Self {
            options,
            layers: cfg.layers.len(),
            experts: cfg.n_routed_experts,
            tensors: p.tensors,
            cache: CachePlan::new(cfg, options.dtype),
        }
    }

    /// Held bytes on the model's device.
    pub fn device_bytes(&self) -> u64 {
        self.tensors.iter().filter(|t| t.place == Place::Device).map(|t| t.held_bytes).sum()
    }

    /// Held bytes in host memory (mapped checkpoint pages).
    pub fn host_bytes(&self) -> u64 {
        self.tensors.iter().filter(|t| t.place == Place::HostMapped).map(|t| t.held_bytes).sum()
    }

    /// Stored bytes of every planned tensor (weights plus scales).
    pub fn stored_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.stored_bytes).sum()
    }

    /// The tensors summed per component, in [`Component`] order.
    pub fn components(&self) -> Vec<ComponentPlan> {
        let mut rows: Vec<ComponentPlan> = Vec::new();
        let mut sorted: Vec<&PlannedTensor> = self.tensors.iter().collect();
        sorted.sort_by_key(|t| t.component);
        for t in sorted {
            if rows.last().is_none_or(|r| r.component != t.component) {
                rows.push(ComponentPlan { component: t.component, tensors: 0, stored_bytes: 0, device_bytes: 0, host_bytes: 0, held: Vec::new() });
            }
            let Some(r) = rows.last_mut() else { continue };
            r.tensors += 1;
            r.stored_bytes += t.stored_bytes;
            match t.place {
                Place::Device => r.device_bytes += t.held_bytes,
                Place::HostMapped => r.host_bytes += t.held_bytes,
            }
            if !r.held.contains(&t.held) {
                r.held.push(t.held);
            }
        }
        rows
    }
}
