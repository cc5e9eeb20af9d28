//! The weights of one V4.1 attention layer (kv + index source) for the batched decode step that
//! `examples/bench_batched_decode.rs` composes from the crate's device ops: the module's
//! checkpoint names, random values ([`RandomWeights`]).

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use deepseek_v41::attention::indexer::IndexKeyProjection;
use deepseek_v41::config::Config;
use deepseek_v41::nn::{Linear, LinearKind, RandomWeights, RmsNorm, RopeKind, RopeTable};
use deepseek_v41::Numerics;

/// The layer's weights (the module's checkpoint names, random values).
pub struct Weights {
    pub wq_a: Linear,
    pub q_norm: RmsNorm,
    pub wq_b: Linear,
    pub wkv: Linear,
    pub kv_norm: RmsNorm,
    /// `[o_groups, o_lora, heads_per_group·head_dim]` bf16.
    pub wo_a: Tensor,
    pub wo_b: Linear,
    /// `[H]` f32.
    pub sink: Tensor,
    pub c_wkv: Linear,
    pub c_wgate: Linear,
    pub c_norm: RmsNorm,
    pub keys: IndexKeyProjection,
    pub iq_b: Linear,
    pub w_proj: Linear,
    pub rope: RopeTable,
    pub h: usize,
    pub hd: usize,
    pub g: usize,
    pub hi: usize,
    pub di: usize,
    pub topk: usize,
    pub window: usize,
    pub ratio: usize,
}

impl Weights {
    pub fn new(cfg: &Config, layer: usize, ratio: usize, dev: &Device) -> Result<Self> {
        let n = Numerics::REFERENCE;
        let vb = RandomWeights::new(1).var_builder(DType::BF16, dev).pp("layers").pp(layer).pp("attn");
        let (d, h, hd, g, ol) = (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank);
        let (hi, di) = (cfg.index_n_heads, cfg.index_head_dim);
        let q = LinearKind::Quantized;
        Ok(Self {
            wq_a: Linear::new(d, cfg.q_lora_rank, q, n, vb.pp("wq_a"))?,
            q_norm: RmsNorm::new(cfg.q_lora_rank, cfg.rms_norm_eps, vb.pp("q_norm"))?,
            wq_b: Linear::new(cfg.q_lora_rank, h * hd, q, n, vb.pp("wq_b"))?,
            wkv: Linear::new(d, hd, q, n, vb.pp("wkv"))?,
            kv_norm: RmsNorm::new(hd, cfg.rms_norm_eps, vb.pp("kv_norm"))?,
            wo_a: vb
                .pp("wo_a")
                .get_with_hints_dtype((g * ol, h / g * hd), "weight", Default::default(), DType::BF16)?
                .reshape((g, ol, h / g * hd))?,
            wo_b: Linear::new(g * ol, d, q, n, vb.pp("wo_b"))?,
            sink: vb.get_with_hints_dtype(h, "attn_sink", Default::default(), DType::F32)?,
            c_wkv: Linear::new(d, hd, LinearKind::F32, n, vb.pp("compressor").pp("wkv"))?,
            c_wgate: Linear::new(d, hd, LinearKind::F32, n, vb.pp("compressor").pp("wgate"))?,
            c_norm: RmsNorm::new(hd, cfg.rms_norm_eps, vb.pp("compressor").pp("norm"))?,
            keys: IndexKeyProjection::new(cfg, n, vb.pp("indexer"))?,
            iq_b: Linear::new(cfg.q_lora_rank, hi * di, q, n, vb.pp("indexer").pp("wq_b"))?,
            w_proj: Linear::new(d, hi, LinearKind::Plain, n, vb.pp("indexer").pp("weights_proj"))?,
            rope: RopeTable::new(cfg.qk_rope_head_dim, &RopeKind::for_ratio(cfg, ratio), dev)?,
            h,
            hd,
            g,
            hi,
            di,
            topk: cfg.index_topk,
            window: cfg.sliding_window,
            ratio,
        })
    }

    /// Bytes of the weights one step reads.
    pub fn bytes(&self) -> f64 {
        let linears = [&self.wq_a, &self.wq_b, &self.wkv, &self.wo_b, &self.c_wkv, &self.c_wgate, &self.iq_b, &self.w_proj];
        linears.into_iter().map(|l| l.weight().bytes() as f64).sum::<f64>()
            + (self.wo_a.elem_count() * self.wo_a.dtype().size_in_bytes()) as f64
            + (self.keys.k_norm().weight().elem_count() + self.di * self.hd) as f64 * 2.0
    }
}
