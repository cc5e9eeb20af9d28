//! Token selection and the generation loop: greedy (temperature 0) or temperature + top-p
//! sampling with a seeded RNG, prefill of the prompt then one token per step on the caller's
//! cache, stopping at EOS or after a token budget.

use candle_core::{DType, Result, Tensor, D};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::input::{check_context, check_sampling, InputError};
use crate::model::{BatchItem, Model, ModelCache};

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0 = greedy (argmax, lowest id on ties).
    pub temperature: f64,
    /// Nucleus mass in (0, 1]; 1 = no truncation.
    pub top_p: f64,
    /// Seed of the sampling RNG.
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
}

/// Picks tokens from logits.
#[derive(Debug)]
pub struct Sampler {
    cfg: Sampling,
    rng: StdRng,
}

impl Sampler {
    /// Validates the settings ([`Sampling::validate`]).
    pub fn new(cfg: Sampling) -> Result<Self> {
        cfg.validate()?;
        Ok(Self { cfg, rng: StdRng::seed_from_u64(cfg.seed) })
    }

    /// The next token from `logits` `[vocab]` (any float dtype).
    pub fn sample(&mut self, logits: &Tensor) -> Result<u32> {
        let l = logits.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        if l.is_empty() {
            candle_core::bail!("sample: empty logits")
        }
        if self.cfg.temperature == 0.0 {
            return Ok(argmax(&l));
        }
        let t = self.cfg.temperature as f32;
        let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut p: Vec<(u32, f32)> = l.iter().enumerate().map(|(i, &x)| (i as u32, ((x - m) / t).exp())).collect();
        // A strict total order (ids break ties), so the unstable sort gives the one sorted order.
        p.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let z: f32 = p.iter().map(|x| x.1).sum();
        let mut kept = 0;
        let mut mass = 0f32;
        for (_, w) in &p {
            mass += w / z;
            kept += 1;
            if mass as f64 >= self.cfg.top_p {
                break;
            }
        }
        p.truncate(kept);
        let total: f32 = p.iter().map(|x| x.1).sum();
        let mut u = self.rng.random::<f32>() * total;
        for (id, w) in &p {
            if u < *w {
                return Ok(*id);
            }
            u -= w;
        }
        Ok(p[p.len() - 1].0)
    }
}

/// Index of the largest value, lowest index on ties.
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
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
    model.check_tokens(prompt)?;
    check_context(cache.seq_len() + prompt.len(), max_new, model.max_positions())?;
    let mut out = Vec::new();
    let mut logits = model.forward(prompt, cache)?;
    while out.len() < max_new {
        let last = logits.narrow(0, logits.dim(0)? - 1, 1)?.squeeze(0)?;
        let next = sampler.sample(&last)?;
        out.push(next);
        on_token(next)?;
        if Some(next) == eos || out.len() == max_new {
            break;
        }
        logits = model.forward(&[next], cache)?;
    }
    Ok(out)
}

/// One sequence of [`generate_batch_greedy`].
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

/// Greedy generation of several sequences in batched forwards ([`Model::forward_batch`]): at
/// every step one call holds the decode token of each running sequence and the prompt of each
/// sequence joining at that step; a sequence leaves after `eos` or its `max_new` tokens. Returns
/// each request's new ids; on the CPU the same as [`generate`] with [`Sampling::GREEDY`] of each
/// request alone (`tests/batched.rs`).
///
/// Errors before any work for a request whose prompt is empty or holds an id outside the
/// vocabulary, or whose cache, prompt and `max_new` do not fit the model's
/// `max_position_embeddings` ([`InputError`]).
pub fn generate_batch_greedy(model: &Model, requests: &mut [BatchRequest], eos: Option<u32>) -> Result<Vec<Vec<u32>>> {
    for r in requests.iter() {
        model.check_tokens(r.prompt)?;
        check_context(r.cache.seq_len() + r.prompt.len(), r.max_new, model.max_positions())?;
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
                None => candle_core::bail!("generate_batch_greedy: request {i} missed its join step {}", r.join_step),
            };
            running.push(i);
            items.push(BatchItem::new(tokens, r.cache));
        }
        if !items.is_empty() {
            let logits = model.forward_batch(&mut items)?;
            drop(items);
            for (j, &i) in running.iter().enumerate() {
                let next = argmax(&logits.last(j)?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
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
