//! Generation on the batched decode step: the prompt is prefilled by `Model::forward` on the
//! caller's cache, which is then loaded into a one-sequence [`ModelDecodeStep`]; every later
//! token is one `update` and one step, eager or — on CUDA — replayed from a CUDA graph captured
//! at the first step ([`crate::model::GraphedDecodeStep`], feature `cuda`; `docs/architecture.md`,
//! "The whole-model decode step"). Replayed steps follow each other on the device
//! ([`crate::model::GraphedDecodeStep::step_next_ids`]): the next step is enqueued before the
//! last one's token is read back, so the host's part of a step overlaps the GPU; a step enqueued
//! past an EOS is discarded (its draw not counted).

use candle_core::Result;

use super::Sampler;
use crate::attention::BatchStorage;
use crate::config::Config;
use crate::model::{Model, ModelCache, ModelDecodeStep};
use crate::sampling::SamplingBatch;

/// [`super::generate`] on the batched decode step (see the module docs): `model` built from
/// `config`, its decode steps replayed from a CUDA graph when `graph` is set.
#[derive(Debug, Clone, Copy)]
pub struct SteppedGeneration<'a> {
    /// The model.
    pub model: &'a Model,
    /// Its config (the step's layer kinds and cache geometry).
    pub config: &'a Config,
    /// Capture the first decode step into a CUDA graph and replay it (CUDA only).
    pub graph: bool,
}

impl SteppedGeneration<'_> {
    /// [`super::generate`]'s contract — the same token budget, EOS and sampler draws (draw t at
    /// step t). On the CPU the tokens are [`super::generate`]'s (the step's logits are
    /// `Model::forward_batch`'s bit for bit, `tests/generate.rs`); on CUDA the step's kernels sum
    /// in another order than `Model::forward`'s, so a token may differ at a near-tie of the
    /// logits (`tests/cuda_model_decode_step.rs`).
    ///
    /// `cache` holds the prompt afterwards: the decoded tokens' state lives in the step, which
    /// is dropped at the end. Errors as [`super::generate`] does; for `graph` off CUDA (after the
    /// prefill and the first draw); and when the model cannot run as the step ([`ModelDecodeStep::new`]; with `graph` also
    /// [`crate::model::GraphedDecodeStep::capture`]: activations other than bf16, routed experts
    /// that are not MXFP4) — then only the prefill has run.
    pub fn generate(
        &self,
        cache: &mut ModelCache,
        prompt: &[u32],
        max_new: usize,
        sampler: &mut Sampler,
        eos: Option<u32>,
        mut on_token: impl FnMut(u32) -> Result<()>,
    ) -> Result<Vec<u32>> {
        let model = self.model;
        let (first, device) = super::prefill(model, cache, prompt, max_new, sampler)?;
        if self.graph && !device.is_cuda() {
            candle_core::bail!("SteppedGeneration: graph replay needs a CUDA device, the model runs on {device:?} (set graph to false)")
        }
        let mut out = Vec::new();
        let Some(mut next) = first else { return Ok(out) };
        let mut pos = cache.seq_len();
        let mut eager: Option<(ModelDecodeStep, SamplingBatch)> = None;
        loop {
            out.push(next);
            on_token(next)?;
            if Some(next) == eos || out.len() == max_new {
                return Ok(out);
            }
            let (step, batch) = match eager.as_mut() {
                Some((step, batch)) => {
                    step.update(&[next], &[pos])?;
                    batch.set_steps(&[sampler.step])?;
                    (step, batch)
                }
                None => {
                    // The first decode step builds the step over the prefilled cache.
                    let mut step = ModelDecodeStep::new(self.config, model, 1, pos + max_new, BatchStorage::uniform(cache.attention.storage()), &device)?;
                    step.load(0, cache)?;
                    let batch = SamplingBatch::new(vec![sampler.params], vec![sampler.step], &device)?;
                    #[cfg(feature = "cuda")]
                    if self.graph {
                        // Captured at this step; the later ones follow it on the device.
                        let mut g = crate::model::GraphedDecodeStep::capture(step, batch, &[next], &[pos])?;
                        sampler.step += 1;
                        return follow(&mut g, out, pos, max_new, sampler, eos, &mut on_token);
                    }
                    step.update(&[next], &[pos])?;
                    let (step, batch) = eager.insert((step, batch));
                    (step, batch)
                }
            };
            next = step.forward_sampled(batch)?.1.to_vec1::<u32>()?[0];
            sampler.step += 1;
            pos += 1;
        }
    }
}

/// The replayed steps after the first: `g` has run the step at `pos` whose token is not read
/// yet (draw `sampler.step − 1`). Each later step follows the last on the device
/// ([`crate::model::GraphedDecodeStep::step_next_ids`]) and is enqueued before the last one's token
/// is read back when the budget allows a token after it; a step enqueued past an EOS is left
/// unread (the device drained, its draw given back). A model whose steps cannot follow on the
/// device (Engram tables in host memory) gives each token back to `step`.
#[cfg(feature = "cuda")]
fn follow(
    g: &mut crate::model::GraphedDecodeStep,
    mut out: Vec<u32>,
    mut pos: usize,
    max_new: usize,
    sampler: &mut Sampler,
    eos: Option<u32>,
    on_token: &mut impl FnMut(u32) -> Result<()>,
) -> Result<Vec<u32>> {
    let followed = g.inner().next_unavailable().is_none();
    let device = g.inner().device().clone();
    loop {
        let more = out.len() + 1 < max_new;
        let id = if followed && more {
            let id = g.step_next_ids(&[sampler.step])?[0];
            sampler.step += 1;
            id
        } else {
            g.ids()?.to_vec1::<u32>()?[0]
        };
        out.push(id);
        on_token(id)?;
        if Some(id) == eos || out.len() == max_new {
            if followed && more {
                // The step after this one ran for nothing.
                device.synchronize()?;
                sampler.step -= 1;
            }
            return Ok(out);
        }
        if !followed {
            pos += 1;
            g.step(&[id], &[pos], &[sampler.step])?;
            sampler.step += 1;
        }
    }
}
