//! The Engram module (spec §9.5): looks up the n-gram rows of each position, projects them into
//! one key per hc copy plus a shared value, and adds the value into every copy of the residual
//! stream with a per-copy gate. Applied before the layer's mixes (spec §3.2 step 1).
//!
//! The hash ids come from [`super::engram_hash::EngramHasher`]. The table is resident on the
//! model's device or read by rows from the checkpoint in host memory
//! ([`super::engram_placement`], [`super::engram_host`]). Text only: the reference's zero gate
//! for image tokens (spec §9.5 step 4) is not implemented.

use candle_core::{DType, Result, Tensor, D};
use candle_nn::VarBuilder;

use super::engram_host::HostRows;
use super::engram_placement::{EngramLocation, EngramOptions, EngramTableInfo};
use crate::config::Config;
use crate::loader::RowTable;
use crate::nn::linear::{named, NamedLinears};
use crate::nn::{Linear, LinearKind, RowGroups};
use crate::numerics::Numerics;

/// Floor of `|dot|` under the signed square root of the gate.
const GATE_CLAMP: f64 = 1e-6;

/// Where the Engram table rows come from.
#[derive(Clone)]
pub enum EngramTable {
    /// The whole dequantized table `[rows, head_dim]` bf16 in memory (small models).
    Resident(Tensor),
    /// Rows read and dequantized on the host on lookup from the checkpoint:
    /// `ckpt.row_table("layers.N.engram.embed.weight")`, then copied to the device.
    Rows(Box<RowTable>),
    /// Rows gathered from the checkpoint in their stored form on lookup, copied to the device
    /// in one copy and decoded there ([`HostRows`]; what [`EngramLocation::Host`] builds for the
    /// released ~384M-row FP8 tables).
    Host(Box<HostRows>),
}

impl std::fmt::Debug for EngramTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EngramTable::Resident(t) => write!(f, "EngramTable::Resident({:?})", t.shape()),
            EngramTable::Rows(r) => write!(f, "EngramTable::Rows({})", r.name()),
            EngramTable::Host(h) => write!(f, "EngramTable::{h:?}"),
        }
    }
}

impl EngramTable {
    /// The rows `ids` (`[N]` u32) as `[N, head_dim]` bf16 on `device`.
    pub fn rows(&self, ids: &Tensor, device: &candle_core::Device) -> Result<Tensor> {
        match self {
            EngramTable::Resident(t) => t
                .index_select(&ids.to_device(t.device())?, 0)?
                .to_device(device),
            EngramTable::Rows(r) => r
                .lookup(&ids.to_device(&candle_core::Device::Cpu)?, DType::BF16)?
                .to_device(device),
            EngramTable::Host(h) => h.rows(&ids.flatten_all()?.to_dtype(DType::U32)?.to_vec1::<u32>()?)?.to_device(device),
        }
    }

    /// The table read by rows in their stored form ([`EngramTable::Host`]), whose gathers can run
    /// ahead of the layer ([`HostRows::gather`]).
    pub fn host_rows(&self) -> Option<&HostRows> {
        match self {
            EngramTable::Host(h) => Some(h),
            _ => None,
        }
    }

    /// `[rows, width]` of the table.
    pub fn dims(&self) -> (usize, usize) {
        match self {
            EngramTable::Resident(t) => (t.dims().first().copied().unwrap_or(0), t.dims().get(1).copied().unwrap_or(0)),
            EngramTable::Rows(r) => (r.num_rows(), r.width()),
            EngramTable::Host(h) => (h.table().num_rows(), h.table().width()),
        }
    }

    /// Where the table is: a resident tensor on its device, or rows read from the checkpoint in
    /// host memory ([`EngramTable::Rows`] and [`EngramTable::Host`]).
    pub fn location(&self) -> EngramLocation {
        match self {
            EngramTable::Resident(_) => EngramLocation::Device,
            EngramTable::Rows(_) | EngramTable::Host(_) => EngramLocation::Host,
        }
    }

    /// The device the lookups' ids are best given on: the CPU for the tables read from the
    /// checkpoint (their ids are used on the host, so ids made there need no device round trip),
    /// `model` for a resident table.
    pub fn ids_device(&self, model: &candle_core::Device) -> candle_core::Device {
        match self {
            EngramTable::Resident(_) => model.clone(),
            EngramTable::Rows(_) | EngramTable::Host(_) => candle_core::Device::Cpu,
        }
    }
}

/// The Engram of one layer: `layers.N.engram.{embed, wkv, q_weight, k_weight}`.
#[derive(Debug, Clone)]
pub struct Engram {
    /// The backbone layer.
    layer: usize,
    /// The `[rows, head_dim]` table (dequantized rows are bf16).
    table: EngramTable,
    /// `[(hc+1)·D, cols·head_dim]`, quantized linear.
    wkv: Linear,
    /// `[hc, D]` f32: `q_weight ⊙ k_weight`.
    qk_weight: Tensor,
    hc: usize,
    dim: usize,
    n_cols: usize,
    eps: f64,
}

impl Engram {
    /// Loads Engram layer `layer` (its index in `engram_layer_ids` gives the table size) from
    /// `vb` = `layers.N.engram`: `embed.weight` `[rows, head_dim]` (FP8 with a 1×32 scale in the
    /// release; the whole table is taken dequantized and held in bf16), `wkv.weight`
    /// `[(hc+1)·D, cols·head_dim]` (FP8), `q_weight` and `k_weight` `[hc, D]` (bf16).
    ///
    /// Holding the whole table suits small models only: the released tables have ~384M rows
    /// (~100 GB each in FP8); use [`Engram::load`] (placement [`EngramPlacement::Auto`] or
    /// [`EngramPlacement::Host`]) there.
    ///
    /// [`EngramPlacement::Auto`]: super::EngramPlacement::Auto
    /// [`EngramPlacement::Host`]: super::EngramPlacement::Host
    pub fn new(cfg: &Config, layer: usize, numerics: Numerics, vb: VarBuilder) -> Result<Self> {
        let table = Self::resident_table(cfg, layer, &vb)?;
        Self::with_table(cfg, layer, numerics, vb, table)
    }

    /// As [`Engram::new`], with the table placed as `opts` says
    /// ([`super::EngramPlacement::resolve`] on the config's table size): resident as in
    /// [`Engram::new`], or [`EngramTable::Host`] rows of `<vb prefix>.embed.weight` in
    /// `opts.checkpoint` (the checkpoint `vb` reads), of which nothing is read now.
    pub fn load(cfg: &Config, layer: usize, numerics: Numerics, vb: VarBuilder, opts: &EngramOptions) -> Result<Self> {
        let (rows, head_dim, _) = Self::table_shape(cfg, layer)?;
        let table = match (opts.placement.resolve(rows, head_dim, opts.checkpoint.is_some())?, &opts.checkpoint) {
            (EngramLocation::Host, Some(ckpt)) => {
                let rows = ckpt.row_table(&format!("{}.embed.weight", vb.prefix()))?;
                EngramTable::Host(Box::new(HostRows::new(rows, vb.device())?))
            }
            _ => Self::resident_table(cfg, layer, &vb)?,
        };
        Self::with_table(cfg, layer, numerics, vb, table)
    }

    /// The whole table `embed.weight`, dequantized, bf16, on `vb`'s device.
    fn resident_table(cfg: &Config, layer: usize, vb: &VarBuilder) -> Result<EngramTable> {
        let (rows, head_dim, _) = Self::table_shape(cfg, layer)?;
        let table = vb
            .pp("embed")
            .get_with_hints_dtype((rows, head_dim), "weight", Default::default(), DType::BF16)
            .map_err(|e| {
                e.context(format!(
                    "Engram layer {layer}: loading its whole [{rows}, {head_dim}] table to keep it on the device; \
                     a large table is read by rows with EngramPlacement::Auto or Host and the checkpoint (Model::with_engram, Pretrained)"
                ))
            })?;
        Ok(EngramTable::Resident(table))
    }

    /// As [`Engram::new`], with the table rows taken from `table` instead of `embed.weight`;
    /// errors unless `table` is `[rows, head_dim]` for this layer.
    pub fn with_table(
        cfg: &Config,
        layer: usize,
        numerics: Numerics,
        vb: VarBuilder,
        table: EngramTable,
    ) -> Result<Self> {
        let (rows, head_dim, n_cols) = Self::table_shape(cfg, layer)?;
        let found = match &table {
            EngramTable::Resident(t) => t.dims().to_vec(),
            table => {
                let (r, w) = table.dims();
                vec![r, w]
            }
        };
        if found != [rows, head_dim] {
            candle_core::bail!(
                "Engram layer {layer}: table {found:?}, expected [{rows}, {head_dim}]"
            )
        }
        let (hc, dim) = (cfg.hc_mult, cfg.hidden_size);
        let hints = Default::default();
        let wkv = Linear::new(
            n_cols * head_dim,
            (hc + 1) * dim,
            LinearKind::Quantized,
            numerics,
            vb.pp("wkv"),
        )?;
        let q = vb.get_with_hints_dtype((hc, dim), "q_weight", hints, DType::F32)?;
        let k = vb.get_with_hints_dtype((hc, dim), "k_weight", hints, DType::F32)?;
        Ok(Self {
            layer,
            table,
            wkv,
            qk_weight: (q * k)?,
            hc,
            dim,
            n_cols,
            eps: cfg.rms_norm_eps,
        })
    }

    /// `(rows, head_dim, ids per token)` of layer `layer`'s table, or an error when it is not an
    /// Engram layer.
    fn table_shape(cfg: &Config, layer: usize) -> Result<(usize, usize, usize)> {
        let Some(ecfg) = &cfg.engram else {
            candle_core::bail!("Engram: the config has no Engram section")
        };
        let Some(i) = ecfg.layer_ids.iter().position(|&l| l == layer) else {
            candle_core::bail!(
                "Engram: layer {layer} is not in engram_layer_ids {:?}",
                ecfg.layer_ids
            )
        };
        let Some(&rows) = ecfg.num_embeddings.get(i) else {
            candle_core::bail!("Engram: no engram_num_embeddings entry for layer {layer}")
        };
        Ok((
            rows,
            ecfg.head_dim,
            ecfg.max_ngram_size.saturating_sub(1) * ecfg.n_heads,
        ))
    }

    /// `x`: the stream `[T, hc, D]` (bf16); `ids`: the layer's hash ids `[T, cols]` u32 (table
    /// rows, offsets included). Returns `[T, hc, D]` in `x`'s dtype:
    /// `x[k] + σ(signed_sqrt(dot_k))·value` with, in f32,
    /// `dot_k = Σ_d x[k]·qw[k]·kw[k]·key[k] · rsqrt(mean(x[k]²)+eps) · rsqrt(mean(key[k]²)+eps) / sqrt(D)`.
    pub fn forward(&self, x: &Tensor, ids: &Tensor) -> Result<Tensor> {
        self.forward_grouped(x, ids, &RowGroups::whole(x.dim(0)?))
    }

    /// [`Engram::forward`] of a stream holding the tokens of several sequences split as
    /// `groups`: on the CPU each sequence's rows are bit for bit those of its own call
    /// ([`Linear::forward_grouped`]).
    pub fn forward_grouped(&self, x: &Tensor, ids: &Tensor, groups: &RowGroups) -> Result<Tensor> {
        let (t, hc, d) = x.dims3()?;
        if hc != self.hc || d != self.dim || ids.dims() != [t, self.n_cols] {
            candle_core::bail!(
                "Engram: stream {:?} / ids {:?} do not fit hc {}, D {}, {} ids per token",
                x.shape(),
                ids.shape(),
                self.hc,
                self.dim,
                self.n_cols
            )
        }
        let rows = self
            .table
            .rows(&ids.flatten_all()?, x.device())?
            .reshape((t, ()))?;
        self.forward_rows(x, &rows, groups)
    }

    /// [`Engram::forward_grouped`] after the table lookup: `rows` `[T, cols·head_dim]` are the
    /// rows of the tokens' ids (`table().rows(ids.flatten_all(), device)`, reshaped), on `x`'s
    /// device; runs `wkv` and the gate ([`engram_mix`]). Lets a caller gather the rows ahead
    /// of the layer (a table in host memory) or time the parts apart.
    pub fn forward_rows(&self, x: &Tensor, rows: &Tensor, groups: &RowGroups) -> Result<Tensor> {
        let (t, _, _) = x.dims3()?;
        let width = self.n_cols * self.table.dims().1;
        if rows.dims() != [t, width] {
            candle_core::bail!("Engram: rows {:?} do not fit {t} tokens x {width} ({} ids per token)", rows.shape(), self.n_cols)
        }
        let kv = self
            .wkv
            .forward_grouped(&rows.to_dtype(x.dtype())?, groups)?
            .to_dtype(DType::F32)?;
        let qk = self.qk_weight.to_device(x.device())?;
        engram_mix(x, &kv, &qk, self.eps)
    }

    /// The table.
    pub fn table(&self) -> &EngramTable {
        &self.table
    }

    /// The table's size and where it lives.
    pub fn table_info(&self) -> EngramTableInfo {
        let (rows, width) = self.table.dims();
        let (bytes, device_extra_bytes) = match &self.table {
            EngramTable::Resident(t) => ((t.elem_count() * t.dtype().size_in_bytes()) as u64, 0),
            EngramTable::Rows(r) => (r.stored_bytes(), 0),
            EngramTable::Host(h) => (h.table().stored_bytes(), h.decoder_bytes()),
        };
        EngramTableInfo { layer: self.layer, rows, width, location: self.table.location(), bytes, device_extra_bytes }
    }

    /// The projection with its checkpoint prefix (`wkv`).
    pub fn linears(&self) -> NamedLinears<'_> {
        named([("wkv", &self.wkv)])
    }
}

/// The Engram gate and residual (the tail of [`Engram::forward`]) for the stream `x`
/// `[T, hc, D]` (bf16), the `wkv` output `kv` `[T, (hc+1)·D]` f32 (hc key rows, then the value
/// row) and `qk` = `q_weight·k_weight` `[hc, D]` f32: in f32,
/// `dot_k = Σ_d x[k]·qk[k]·key[k] · rsqrt(mean(x[k]²)+eps) · rsqrt(mean(key[k]²)+eps) / sqrt(D)`,
/// returns `x[k] + σ(signed_sqrt(dot_k))·value` in `x`'s dtype, `[T, hc, D]`. On a CUDA device
/// one kernel (`cuda::engram_mix_device`, with the `cuda` feature), bit for bit the ops below.
pub fn engram_mix(x: &Tensor, kv: &Tensor, qk: &Tensor, eps: f64) -> Result<Tensor> {
    let (t, hc, d) = x.dims3()?;
    #[cfg(feature = "cuda")]
    if crate::cuda::fused_kernels(x.device()) && crate::cuda::engram_mix_supported(x, kv, qk) {
        return crate::cuda::engram_mix_device(x, kv, qk, eps, GATE_CLAMP);
    }
    let key = kv.narrow(1, 0, hc * d)?.reshape((t, hc, d))?;
    let value = kv.narrow(1, hc * d, d)?.unsqueeze(1)?;
    let h = x.to_dtype(DType::F32)?;
    let rstd = |v: &Tensor| -> Result<Tensor> { (v.sqr()?.mean(D::Minus1)? + eps)?.sqrt()?.recip() };
    let dot = (h.broadcast_mul(qk)? * &key)?.sum(D::Minus1)?;
    let dot = ((dot * rstd(&h)?)? * rstd(&key)?)?.affine(1.0 / (d as f64).sqrt(), 0.0)?;
    let mag = dot.abs()?.maximum(GATE_CLAMP)?.sqrt()?;
    let signed = dot.lt(0.0)?.where_cond(&mag.neg()?, &mag)?;
    let gate = candle_nn::ops::sigmoid(&signed)?.unsqueeze(2)?;
    (h + gate.broadcast_mul(&value)?)?.to_dtype(x.dtype())
}
