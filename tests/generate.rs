//! The embedded default model (`models/v41-shakespeare-tiny`) against the reference: its prefill
//! logits, and its greedy continuations in the reference's own terms (`tests/support/greedy.rs`:
//! equal token for token until a near-tie of the reference, where our token must be in its
//! top-5).

use anyhow::Result;
use candle_core::{DType, Device};
use deepseek_v41::golden::{compare, Tolerance};
use deepseek_v41::model::Pretrained;
use deepseek_v41::Numerics;

#[path = "support/greedy.rs"]
mod greedy;
use greedy::{check_free_running, Step, NEAR_TIE};

#[test]
fn prefill_logits_match_the_reference() -> Result<()> {
    let dir = greedy::model_dir();
    let p = Pretrained::load_dir(&dir, Numerics::REFERENCE, DType::BF16, &Device::Cpu)?;
    let golden = greedy::load_golden(&dir)?;
    let logits = candle_core::safetensors::load(dir.join("golden_prefill_logits.safetensors"), &Device::Cpu)?;
    for (i, g) in golden.prompts.iter().enumerate() {
        let mut cache = p.new_cache()?;
        let ours = p.model.forward(&g.prompt_ids, &mut cache)?;
        let o = compare(&format!("prompt{i} logits"), &ours, &logits[&format!("prompt{i}")], Tolerance::RelFro { rel_fro: 3e-2, max_abs: Some(0.3) })?;
        println!("{o}");
        assert!(o.pass, "{o}");
    }
    Ok(())
}

#[test]
fn greedy_continuations_match_the_reference_up_to_its_near_ties() -> Result<()> {
    for line in greedy::run(&Device::Cpu)? {
        println!("{line}");
    }
    Ok(())
}

/// The criterion can fail: a flip at a wide reference margin, or to a token outside the
/// reference's top-5, or a length mismatch.
#[test]
fn the_greedy_criterion_rejects_real_differences() {
    let step = |margin: f32| Step { top: vec![(5, 9.0), (6, 9.0 - margin), (7, 8.0), (8, 7.5), (9, 7.0)], margin };
    let want = [1, 2, 5];
    let steps = vec![step(2.0), step(1.0), step(0.1)];
    assert!(check_free_running(&[1, 2, 5], &want, &steps).is_ok());
    assert!(check_free_running(&[1, 2, 6], &want, &steps).is_ok(), "a near-tie flip to a top-5 token");
    assert!(check_free_running(&[1, 2, 42], &want, &steps).is_err(), "not in the top-5");
    assert!(check_free_running(&[1, 3, 5], &want, &steps).is_err(), "a flip at margin 1.0 >= {NEAR_TIE}");
    assert!(check_free_running(&[1, 2], &want, &steps).is_err());
}

/// `SteppedGeneration` (the batched decode step of one sequence after `Model::forward`'s
/// prefill) gives `generate`'s tokens on the CPU, greedy and sampled, to the budget or EOS; the
/// prompt's cache is left holding the prompt only.
#[test]
fn stepped_generation_gives_generates_tokens() -> Result<()> {
    use deepseek_v41::generation::{generate, Sampler, Sampling, SteppedGeneration};
    let dir = greedy::model_dir();
    let p = Pretrained::load_dir(&dir, Numerics::REFERENCE, DType::BF16, &Device::Cpu)?;
    let prompt = p.tokenizer.encode("ROMEO:\nBut soft, what light", true)?;
    let stepped = SteppedGeneration { model: &p.model, config: &p.config, graph: false };
    for sampling in [Sampling::GREEDY, Sampling { temperature: 0.9, top_p: 0.95, seed: 5 }] {
        let mut want_cache = p.new_cache()?;
        let want = generate(&p.model, &mut want_cache, &prompt, 40, &mut Sampler::new(sampling)?, None, |_| Ok(()))?;
        let mut cache = p.new_cache()?;
        let mut streamed = Vec::new();
        let got = stepped.generate(&mut cache, &prompt, 40, &mut Sampler::new(sampling)?, None, |id| {
            streamed.push(id);
            Ok(())
        })?;
        assert_eq!(got, want, "{sampling:?}");
        assert_eq!(streamed, got);
        assert_eq!(cache.seq_len(), prompt.len());
        // EOS: stop right after the 11th token, taken as the end.
        let eos = want[10];
        let first = want.iter().position(|&t| t == eos).unwrap_or(10);
        let stopped = stepped.generate(&mut p.new_cache()?, &prompt, 40, &mut Sampler::new(sampling)?, Some(eos), |_| Ok(()))?;
        assert_eq!(stopped, want[..=first], "{sampling:?} with EOS {eos}");
    }
    // On the CPU graph replay is refused.
    let refused = SteppedGeneration { graph: true, ..stepped }.generate(&mut p.new_cache()?, &prompt, 4, &mut Sampler::new(Sampling::GREEDY)?, None, |_| Ok(()));
    assert!(refused.unwrap_err().to_string().contains("needs a CUDA device"));
    Ok(())
}
