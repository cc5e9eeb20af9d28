//! Token selection and the generation loop: greedy (temperature 0) or temperature + top-p
//! sampling with a seed ([`crate::sampling`]: the same algorithm and the same tokens on every
//! device), prefill of the prompt then one token per step on the caller's cache, stopping at EOS
//! or after a token budget; [`SteppedGeneration`] runs the decode steps on the batched decode
//! step, on CUDA replayed from a CUDA graph.

use candle_core::{DType, Device, Result, Tensor, D};

use crate::input::{check_context, check_sampling, InputError};
use crate::model::{BatchItem, Model, ModelCache};
use crate::sampling::{argmax_ref, sample_batch, SamplingBatch, SamplingParams};

mod stepped;
pub use stepped::SteppedGeneration;

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0 = greedy (argmax, lowest id on ties).
    pub temperature: f64,
    /// Nucleus mass in (0, 1]; 1 = no truncation.
    pub top_p: f64,
    /// Seed of the draws: draw t of a [`Sampler`] depends on `(seed, t)` only
    /// ([`crate::sampling`]).
    pub seed: u64,
}

impl Sampling {
    /// Greedy decoding.
    pub const GREEDY: Sampling = Sampling { temperature: 0.0, top_p: 1.0, seed: 0 };

    /// Temperature finite and ≥ 0, top_p in (0, 1]: cheap, so callers can check before loading
    /// a model.
    pub fn validate(&self) -> std::result::Result<(), InputError> {
        check_sampling(self.temperature, self.top_p)
    }

    /// These settings as the sampler's f32 [`SamplingParams`] (no top-k): a temperature beyond
    /// f32 becomes `f32::MAX`, a positive `top_p` below f32's smallest the smallest positive f32
    /// (a temperature below it rounds to 0: greedy).
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: (self.temperature as f32).min(f32::MAX),
            top_k: 0,
            top_p: if self.top_p > 0.0 { (self.top_p as f32).max(f32::from_bits(1)) } else { self.top_p as f32 },
            seed: self.seed,
        }
    }
}

/// Picks tokens from logits, one draw per call: draw t (counted from 0) is the [`crate::sampling`]
/// algorithm at step t with the settings' seed, so a seed gives the same tokens on the CPU and on
/// a CUDA device. (A seed's tokens differ from those of earlier versions of this crate, which drew
/// from a `StdRng` stream.)
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    step: u64,
}

impl Sampler {
    /// Validates the settings ([`Sampling::validate`]).
    pub fn new(cfg: Sampling) -> Result<Self> {
        cfg.validate()?;
        Ok(Self { params: cfg.params(), step: 0 })
    }

    /// The draws made so far (the next token is draw `step`).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The next token from `logits` `[vocab]` (any float dtype), through
    /// [`crate::sampling::sample_batch`] (the logits are read to the host).
    pub fn sample(&mut self, logits: &Tensor) -> Result<u32> {
        if logits.dims1()? == 0 {
            candle_core::bail!("sample: empty logits")
        }
        let batch = SamplingBatch::new(vec![self.params], vec![self.step], logits.device())?;
        let id = sample_batch(&logits.unsqueeze(0)?, &batch)?.to_vec1::<u32>()?[0];
        self.step += 1;
        Ok(id)
    }
}

/// Index of the largest value, lowest index on ties, NaN counted as −inf (the sampler's greedy
/// choice, [`crate::sampling::argmax_ref`]).
pub fn argmax(v: &[f32]) -> u32 {
    argmax_ref(v)
}

/// Generates up to `max_new` tokens after `prompt` (ids, BOS included), calling `on_token` for
/// each new token as soon as it is chosen; stops after `eos` (which is passed to `on_token`).
/// Returns the new ids.
///
/// Errors before any work if `prompt` is empty or holds an id outside the vocabulary, or if the
/// cached tokens, the prompt and `max_new` do not fit in the model's `max_position_embeddings`
/// ([`InputError`]); nothing is reserved up front, so any `max_new` is safe to pass.
pub fn generate(
    model: &Model,
    cache: &mut ModelCache,
    prompt: &[u32],
    max_new: usize,
    sampler: &mut Sampler,
    eos: Option<u32>,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Vec<u32>> {
    let (mut next, _) = prefill(model, cache, prompt, max_new, sampler)?;
    let mut out = Vec::new();
    while let Some(id) = next {
        out.push(id);
        on_token(id)?;
        if Some(id) == eos || out.len() == max_new {
            break;
        }
        next = Some(sample_last(sampler, &model.forward(&[id], cache)?)?);
    }
    Ok(out)
}

/// [`generate`]'s checks, the prompt's forward call on `cache` and the first token drawn from its
/// last logits row (`None`, after the forward call, when `max_new` is 0); with the logits' device.
fn prefill(model: &Model, cache: &mut ModelCache, prompt: &[u32], max_new: usize, sampler: &mut Sampler) -> Result<(Option<u32>, Device)> {
    model.check_tokens(prompt)?;
    check_context(cache.seq_len() + prompt.len(), max_new, model.max_positions())?;
    let logits = model.forward(prompt, cache)?;
    let first = if max_new == 0 { None } else { Some(sample_last(sampler, &logits)?) };
    Ok((first, logits.device().clone()))
}

/// The next token from the last row of `logits` `[T, vocab]`.
fn sample_last(sampler: &mut Sampler, logits: &Tensor) -> Result<u32> {
    sampler.sample(&logits.narrow(0, logits.dim(0)? - 1, 1)?.squeeze(0)?)
}

/// One sequence of [`generate_batch`] / [`generate_batch_greedy`].
#[derive(Debug)]
pub struct BatchRequest<'a> {
    /// The prompt (ids, BOS included), prefilled in one chunk.
    pub prompt: &'a [u32],
    /// The sequence's cache (continued from its current length).
    pub cache: &'a mut ModelCache,
    /// The new-token budget.
    pub max_new: usize,
    /// The step at which the sequence joins the batch (0: the first call); its prompt then
    /// shares a call with the decode tokens of the sequences already running.
    pub join_step: usize,
}

/// Greedy generation of several sequences in batched forwards: [`generate_batch`] with
/// [`Sampling::GREEDY`] for every request; on the CPU the same as [`generate`] of each request
/// alone (`tests/batched.rs`).
pub fn generate_batch_greedy(model: &Model, requests: &mut [BatchRequest], eos: Option<u32>) -> Result<Vec<Vec<u32>>> {
    let greedy = vec![Sampling::GREEDY; requests.len()];
    generate_batch(model, requests, &greedy, eos)
}

/// Generation of several sequences in batched forwards ([`Model::forward_batch`]): at every step
/// one call holds the decode token of each running sequence and the prompt of each sequence
/// joining at that step; one [`sample_batch`] then picks every running sequence's next token
/// (on a CUDA device only the ids come back), request i with `sampling[i]` at step = its count of
/// new tokens so far; a sequence leaves after `eos` or its `max_new` tokens. Returns each
/// request's new ids; on the CPU the same as [`generate`] of each request alone with a
/// [`Sampler`] of `sampling[i]` (`tests/batched.rs`).
///
/// Errors before any work for a request whose prompt is empty or holds an id outside the
/// vocabulary, or whose cache, prompt and `max_new` do not fit the model's
/// `max_position_embeddings`, or whose sampling settings are invalid ([`InputError`]), and when
/// `sampling` does not hold one entry per request.
pub fn generate_batch(model: &Model, requests: &mut [BatchRequest], sampling: &[Sampling], eos: Option<u32>) -> Result<Vec<Vec<u32>>> {
    if sampling.len() != requests.len() {
        candle_core::bail!("generate_batch: {} sampling settings for {} requests: give one per request", sampling.len(), requests.len())
    }
    for (r, s) in requests.iter().zip(sampling) {
        model.check_tokens(r.prompt)?;
        check_context(r.cache.seq_len() + r.prompt.len(), r.max_new, model.max_positions())?;
        s.validate()?;
    }
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); requests.len()];
    let mut done: Vec<bool> = requests.iter().map(|r| r.max_new == 0).collect();
    let mut step = 0;
    while done.iter().any(|d| !d) {
        // (request, whether this call holds its prompt)
        let mut running = Vec::new();
        let mut items = Vec::new();
        for (i, r) in requests.iter_mut().enumerate() {
            if done[i] || r.join_step > step {
                continue;
            }
            let tokens = match out[i].last() {
                Some(t) => std::slice::from_ref(t),
                None if r.join_step == step => r.prompt,
                None => candle_core::bail!("generate_batch: request {i} missed its join step {}", r.join_step),
            };
            running.push(i);
            // The default logit rows: each item's last token, one row per item in batch order.
            items.push(BatchItem::new(tokens, r.cache));
        }
        if !items.is_empty() {
            let logits = model.forward_batch(&mut items)?.logits;
            drop(items);
            let params = running.iter().map(|&i| sampling[i].params()).collect();
            let steps = running.iter().map(|&i| out[i].len() as u64).collect();
            let batch = SamplingBatch::new(params, steps, logits.device())?;
            let ids = sample_batch(&logits, &batch)?.to_vec1::<u32>()?;
            for (&i, next) in running.iter().zip(ids) {
                out[i].push(next);
                done[i] = Some(next) == eos || out[i].len() == requests[i].max_new;
            }
        }
        step += 1;
    }
    Ok(out)
}

/// Log-softmax of `logits` `[.., vocab]` (f32).
pub fn log_softmax(logits: &Tensor) -> Result<Tensor> {
    candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, D::Minus1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn greedy_takes_the_lowest_of_tied_maxima_and_sampling_respects_top_p() -> Result<()> {
        let l = Tensor::new(&[1.0f32, 3.0, 3.0, -1.0], &Device::Cpu)?;
        assert_eq!(Sampler::new(Sampling::GREEDY)?.sample(&l)?, 1);
        // With a tiny nucleus only the best token can be drawn.
        let mut s = Sampler::new(Sampling { temperature: 1.0, top_p: 0.01, seed: 3 })?;
        let l = Tensor::new(&[0.0f32, 5.0, 1.0], &Device::Cpu)?;
        for _ in 0..20 {
            assert_eq!(s.sample(&l)?, 1);
        }
        // Same seed, same draws.
        let draw = |seed| -> Result<Vec<u32>> {
            let mut s = Sampler::new(Sampling { temperature: 1.0, top_p: 1.0, seed })?;
            (0..16).map(|_| s.sample(&Tensor::new(&[0.0f32, 0.1, 0.2, 0.3], &Device::Cpu)?)).collect()
        };
        assert_eq!(draw(7)?, draw(7)?);
        assert!(Sampler::new(Sampling { temperature: -1.0, top_p: 1.0, seed: 0 }).is_err());
        assert!(Sampler::new(Sampling { temperature: 1.0, top_p: 0.0, seed: 0 }).is_err());
        Ok(())
    }
}
