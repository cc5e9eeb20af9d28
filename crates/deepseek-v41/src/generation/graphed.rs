//! Generation with the decode steps replayed from a CUDA graph (feature `cuda`): the prompt is
//! prefilled by `Model::forward` on the caller's cache, which is then loaded into a one-sequence
//! [`ModelDecodeStep`] captured once ([`GraphedDecodeStep`]); every later token is one update,
//! one graph launch and one id read back (`docs/architecture.md`, "The whole-model decode step").

use candle_core::Result;

use super::Sampler;
use crate::attention::BatchStorage;
use crate::config::Config;
use crate::input::check_context;
use crate::model::{GraphedDecodeStep, Model, ModelCache, ModelDecodeStep};
use crate::sampling::SamplingBatch;

/// [`super::generate`] with the decode steps replayed from a CUDA graph: the same arguments plus
/// the model's `cfg`, the same token budget, EOS and sampler draws (draw t at step t). The step
/// runs the batched decode kernels, not `Model::forward`'s, so its logits equal the eager path's
/// up to the order of f32 sums (`tests/cuda_model_decode_step.rs`); a token may differ only at a
/// near-tie of the logits.
///
/// `cache` holds the prompt afterwards (the decoded tokens' state lives in the step, which is
/// dropped at the end). Errors as [`super::generate`] does, and when the model cannot run as a
/// captured step on the cache's device ([`ModelDecodeStep::new`], [`GraphedDecodeStep::capture`]:
/// e.g. a CPU cache, Engram tables in host memory, routed experts that are not MXFP4); then only
/// the prefill has run.
#[allow(clippy::too_many_arguments)]
pub fn generate_graphed(
    model: &Model,
    cfg: &Config,
    cache: &mut ModelCache,
    prompt: &[u32],
    max_new: usize,
    sampler: &mut Sampler,
    eos: Option<u32>,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Vec<u32>> {
    model.check_tokens(prompt)?;
    check_context(cache.seq_len() + prompt.len(), max_new, model.max_positions())?;
    let logits = model.forward(prompt, cache)?;
    let mut out = Vec::new();
    if max_new == 0 {
        return Ok(out);
    }
    let mut next = sampler.sample(&logits.narrow(0, logits.dim(0)? - 1, 1)?.squeeze(0)?)?;
    let device = logits.device().clone();
    let storage = BatchStorage::uniform(cache.attention.storage());
    let mut pos = cache.seq_len();
    let mut graphed: Option<GraphedDecodeStep> = None;
    loop {
        out.push(next);
        on_token(next)?;
        if Some(next) == eos || out.len() == max_new {
            return Ok(out);
        }
        let ids = match graphed.as_mut() {
            // The first decode step: the step over the prefilled cache, captured (it runs once).
            None => {
                let mut step = ModelDecodeStep::new(cfg, model, 1, pos + max_new, storage, &device)?;
                step.load(0, cache)?;
                let batch = SamplingBatch::new(vec![sampler.params], vec![sampler.step], &device)?;
                graphed.insert(GraphedDecodeStep::capture(step, batch, &[next], &[pos])?).ids().to_vec1::<u32>()?
            }
            Some(g) => g.step_ids(&[next], &[pos], &[sampler.step])?,
        };
        sampler.step += 1;
        next = ids[0];
        pos += 1;
    }
}
