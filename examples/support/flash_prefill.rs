//! The prefill part of `examples/bench_flash_layer.rs` (include it with
//! `#[path = "support/flash_prefill.rs"] mod flash_prefill;` next to `bench.rs` and
//! `flash_layer_step.rs`): T tokens of one sequence from position 0, eager, CUDA events around
//! each call (the host clock on the CPU), medians: the MoE alone (`Moe::forward` inside
//! `cuda::with_device_routing`), then every layer in order on one cache, the attention alone
//! (`Attention::forward`) and the whole layer (`DecoderLayer::forward`).

use std::collections::BTreeMap;

use anyhow::{bail, Result};
use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::{DType, Device, Tensor};
use deepseek_v41::attention::SequenceCache;
use deepseek_v41::config::{AttentionRole, Config};
use deepseek_v41::cuda::with_device_routing;
use deepseek_v41::model::{EngramHasher, Pretrained};

use crate::bench::{eager_ms, median, timed};
use crate::flash_layer_step::{finite_max, LayerStep};

/// What a prefill run needs.
pub struct Prefill<'a> {
    /// Tokens of the sequence.
    pub tokens: usize,
    /// Repetitions (medians).
    pub reps: usize,
    pub cfg: &'a Config,
    pub dev: &'a Device,
    /// The device's stream (events); `None` on the CPU.
    pub stream: Option<&'a CudaStream>,
    /// Token ids are drawn below it.
    pub vocab: u32,
    /// The Engram hasher of the model, if it has Engram layers.
    pub hasher: Option<&'a EngramHasher>,
}

impl Prefill<'_> {
    /// Prints the MoE, attention and whole-layer prefill tables of `model`'s layers `run` (the
    /// MoE) and of all its layers in order (attention, whole layer).
    pub fn run(&self, model: &Pretrained, run: &[usize]) -> Result<()> {
        let (cfg, dev, stream, t) = (self.cfg, self.dev, self.stream, self.tokens);
        let layers = model.model.layers();
        let reps = self.reps.max(1);
        let (d, hc) = (cfg.hidden_size, cfg.hc_mult);
        println!("\n## prefill, {t} tokens of one sequence from position 0 (eager, median of {reps}; ms)\n");
        let slots = t * cfg.num_experts_per_tok;
        let how = if slots <= 8 * cfg.n_routed_experts { "the streaming expert kernels" } else { "the grouped wgmma GEMM" };
        println!("MoE ({slots} slots over {} experts: {how}):\n", cfg.n_routed_experts);
        println!("| layer | MoE ms | tokens/s |");
        println!("|---|---|---|");
        for &l in run {
            let x = (Tensor::randn(0f32, 1.0, (t, d), dev)?).to_dtype(DType::BF16)?;
            let moe = layers[l].moe()?;
            match eager_ms(stream, reps, || Ok(with_device_routing(|| moe.forward(&x)).map(|_| ())?)) {
                Ok(ms) => println!("| {l} | {ms:.2} | {:.0} |", t as f64 / ms * 1e3),
                Err(e) => println!("| {l} | error: {e:#} | |"),
            }
        }
        // Attention alone, then whole layers, every layer in order on one cache per pass (the
        // sources publish to later layers within the call).
        let hs = (0..layers.len()).map(|_| Tensor::randn(0f32, 1.0, (t, d), dev)?.to_dtype(DType::BF16)).collect::<candle_core::Result<Vec<_>>>()?;
        let tokens: Vec<u32> = (0..t).map(|i| (i as u32).wrapping_mul(2_654_435_761) % self.vocab).collect();
        let ids = match self.hasher {
            Some(h) => Some(h.hash(&tokens, &mut h.new_history())?),
            None => None,
        };
        let mut hashes = BTreeMap::new();
        for dl in layers {
            if let (Some(e), Some(ids)) = (dl.engram(), &ids) {
                hashes.insert(dl.layer(), ids.tensor(dl.layer(), &e.table().ids_device(dev))?);
            }
        }
        let n = layers.len();
        let (mut attn, mut whole) = (vec![Vec::new(); n], vec![Vec::new(); n]);
        let mut last_max = 0f32;
        for rep in 0..=reps {
            let mut cache = SequenceCache::new(cfg, DType::BF16, dev)?;
            for (l, dl) in layers.iter().enumerate() {
                let ms = timed(stream, || Ok(dl.attention().forward(&hs[l], 0, &mut cache).map(|_| ())?))?;
                if rep > 0 {
                    attn[l].push(ms);
                }
            }
            let mut cache = SequenceCache::new(cfg, DType::BF16, dev)?;
            let (mut x, mut p) = LayerStep::random_inputs(t, hc, d, dev)?;
            for (l, dl) in layers.iter().enumerate() {
                let ms = timed(stream, || {
                    (x, p) = with_device_routing(|| dl.forward(&x, &p, 0, hashes.get(&l), &mut cache))?;
                    Ok(())
                })?;
                if rep > 0 {
                    whole[l].push(ms);
                }
            }
            let (finite, max) = finite_max(&x)?;
            if !finite {
                bail!("prefill: the stream after the last layer is not finite")
            }
            last_max = max;
        }
        println!("\nAttention (`Attention::forward`) and whole layer (`DecoderLayer::forward`: Engram, mHC, attention, MoE); stream max |x| after the last layer {last_max:.3}:\n");
        println!("| layer | kind | attention ms | layer ms | layer tokens/s |");
        println!("|---|---|---|---|---|");
        for (l, dl) in layers.iter().enumerate() {
            let w = median(whole[l].clone());
            let kind = match dl.attention().role() {
                AttentionRole::WindowOnly => "window-only".to_string(),
                AttentionRole::Compressed { ratio, topk, .. } => format!("ratio {ratio}, {topk:?}"),
            };
            println!("| {l} | {kind}{} | {:.2} | {w:.2} | {:.0} |", if dl.engram().is_some() { " + Engram" } else { "" }, median(attn[l].clone()), t as f64 / w * 1e3);
        }
        Ok(())
    }
}
