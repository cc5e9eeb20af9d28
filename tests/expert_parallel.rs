//! Expert parallelism on the CPU (issue 25, `deepseek_v41::parallel`): ranks as threads of one
//! process ([`LocalGroup`]), each holding `E / N` routed experts of the tiny reference model's
//! MoE layers and its own sequences' tokens; the concatenation of the ranks' outputs must equal,
//! bit for bit, one `Moe` running every sequence as one batch — at N = 1, 2, 4, 8 and with a rank
//! that has no tokens.

use std::path::PathBuf;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use deepseek_v41::config::Config;
use deepseek_v41::loader::QuantizedWeights;
use deepseek_v41::model::BatchItem;
use deepseek_v41::loader::{var_builder, ReleaseCheckpoint};
use deepseek_v41::model::Moe;
use deepseek_v41::nn::RowGroups;
use deepseek_v41::parallel::{run_local_ranks, Collective, ExpertPlacement, LocalGroup, ShardedMoe};
use deepseek_v41::Numerics;

#[path = "support/deal.rs"]
mod deal;
use deal::sharded_with;

fn fixtures() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/v41-tiny"))
}

fn setup() -> Result<(Config, VarBuilder<'static>, Tensor)> {
    let cfg = Config::from_file(fixtures().join("prefill_full").join("config.json"))?;
    let ckpt = ReleaseCheckpoint::open(&[fixtures().join("model.safetensors")])?;
    let vb = var_builder(ckpt, DType::BF16, &Device::Cpu);
    let g = candle_core::safetensors::load(fixtures().join("prefill_full").join("golden.safetensors"), &Device::Cpu)?;
    let x = g.get("L0.ffn_in").context("L0.ffn_in")?.clone();
    Ok((cfg, vb, x))
}

fn bits(t: &Tensor) -> Result<Vec<u16>> {
    Ok(t.to_dtype(DType::BF16)?.flatten_all()?.to_vec1::<half::bf16>()?.iter().map(|v| v.to_bits()).collect())
}

/// The ranks' outputs for `layer`, the sequences `lens` (rows of `x` in order) dealt to the ranks
/// as `deal` (sequence counts per rank, in order), concatenated in rank order.
fn sharded(cfg: &Config, vb: &VarBuilder<'static>, layer: usize, x: &Tensor, lens: &[usize], deal: &[usize]) -> Result<Tensor> {
    Ok(sharded_with(cfg, vb, layer, x, lens, deal, |moe, xr, groups, comm| moe.forward(xr, groups, comm))?)
}

#[test]
fn ranks_equal_one_batch_bit_for_bit() -> Result<()> {
    let (cfg, vb, x) = setup()?;
    let x = x.to_dtype(DType::BF16)?;
    let t = x.dim(0)?;
    // Eight sequences of different lengths (one token each for some: the decode shape).
    let lens = [7usize, 1, 5, 1, 9, 3, 1, t - 27];
    let groups = RowGroups::from_lens(lens);
    for layer in 0..3 {
        let single = Moe::new(&cfg, Numerics::REFERENCE, vb.pp("layers").pp(layer).pp("ffn"))?.forward_grouped(&x, &groups)?.out;
        let want = bits(&single)?;
        for deal in [vec![8], vec![3, 5], vec![2, 2, 2, 2], vec![1; 8], vec![4, 0, 4]] {
            let got = bits(&sharded(&cfg, &vb, layer, &x, &lens, &deal)?)?;
            let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
            ensure!(got.len() == want.len() && differ == 0, "layer {layer}, sequences per rank {deal:?}: {differ} of {} outputs differ", want.len());
        }
    }
    Ok(())
}

/// A rank reads only its own experts' tensors from the checkpoint (with the router and the shared
/// expert): for 8 experts over 3 ranks, rank r's names under `experts.` are exactly its range's.
#[test]
fn a_rank_reads_only_its_experts() -> Result<()> {
    let cfg = Config::from_file(fixtures().join("prefill_full").join("config.json"))?;
    for rank in 0..3 {
        let ckpt = ReleaseCheckpoint::open(&[fixtures().join("model.safetensors")])?;
        let vb = var_builder(ckpt.clone(), DType::BF16, &Device::Cpu);
        let placement = ExpertPlacement::new(cfg.n_routed_experts, 3, rank)?;
        ShardedMoe::new(&cfg, Numerics::REFERENCE, vb.pp("layers").pp(2).pp("ffn"), placement)?;
        let used = ckpt.used_names();
        let experts: std::collections::BTreeSet<usize> = used
            .iter()
            .filter_map(|n| n.strip_prefix("layers.2.ffn.experts.")?.split('.').next()?.parse().ok())
            .collect();
        let want: std::collections::BTreeSet<usize> = placement.range().collect();
        ensure!(experts == want, "rank {rank}: read the experts {experts:?}, holds {want:?}");
        ensure!(used.iter().any(|n| n.starts_with("layers.2.ffn.gate.")) && used.iter().any(|n| n.starts_with("layers.2.ffn.shared_experts.")), "rank {rank}: router or shared expert not read: {used:?}");
        ensure!(used.iter().all(|n| n.starts_with("layers.2.ffn.")), "rank {rank}: read outside the layer: {used:?}");
    }
    Ok(())
}

/// The bit-for-bit check can fail: a rank given another layer's experts (a wrong shard) differs.
#[test]
fn a_wrong_shard_is_seen() -> Result<()> {
    let (cfg, vb, x) = setup()?;
    let x = x.to_dtype(DType::BF16)?;
    let groups = RowGroups::whole(x.dim(0)?);
    let want = bits(&Moe::new(&cfg, Numerics::REFERENCE, vb.pp("layers").pp(0).pp("ffn"))?.forward_grouped(&x, &groups)?.out)?;
    let outs = run_local_ranks(2, |comm| {
        let layer = if comm.rank() == 1 { 1 } else { 0 };
        let placement = ExpertPlacement::new(cfg.n_routed_experts, 2, comm.rank())?;
        let moe = ShardedMoe::new(&cfg, Numerics::REFERENCE, vb.pp("layers").pp(layer).pp("ffn"), placement)?;
        let (xr, g) = if comm.rank() == 0 { (x.clone(), groups.clone()) } else { (x.narrow(0, 0, 0)?, RowGroups::from_lens([])) };
        moe.forward(&xr, &g, &comm)
    })?;
    let got = bits(&outs[0])?;
    ensure!(got != want, "rank 1 holding layer 1's experts gave layer 0's output");
    Ok(())
}

/// A placement that does not match the group is an error naming both, not a hang.
#[test]
fn a_mismatched_group_is_an_error() -> Result<()> {
    let (cfg, vb, x) = setup()?;
    let comm = LocalGroup::ranks(1).pop().context("one rank")?;
    let moe = ShardedMoe::new(&cfg, Numerics::REFERENCE, vb.pp("layers").pp(0).pp("ffn"), ExpertPlacement::new(cfg.n_routed_experts, 2, 0)?)?;
    let err = moe.forward(&x.to_dtype(DType::BF16)?, &RowGroups::whole(x.dim(0)?), &comm).unwrap_err().to_string();
    ensure!(err.contains("rank 0 of 1") && err.contains("rank 0 of 2"), "{err}");
    Ok(())
}

/// The whole embedded model (`models/v41-shakespeare-tiny`) as 3 ranks, each holding a third of
/// every layer's routed experts and forwarding its share of 6 sequences (a prefill chunk, then a
/// second call with one decode token each; a rank without sequences joins with
/// `Model::join_idle`): every sequence's logits equal, bit for bit, those of one model
/// forwarding all 6 in one batch. `DecoderLayer::moe` of a rank's layer is an error.
#[test]
fn whole_model_ranks_equal_one_batch() -> Result<()> {
    whole_model_case([2, 2, 2])?;
    whole_model_case([3, 0, 3])
}

fn whole_model_case(deal: [usize; 3]) -> Result<()> {
    use deepseek_v41::loader::var_builder_with;
    use deepseek_v41::model::{EngramOptions, Model, ModelCache, Pretrained};
    use deepseek_v41::tokenizer::engram_token_map;
    use std::sync::Arc;

    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/v41-shakespeare-tiny");
    let single = Pretrained::load_dir(&dir, Numerics::REFERENCE, DType::BF16, &Device::Cpu)?;
    let ids = single.tokenizer.encode("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak.", true)?;
    ensure!(ids.len() >= 24, "the text encodes to {} tokens", ids.len());
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| ids[..3 + 3 * i].to_vec()).collect();
    let next: Vec<[u32; 1]> = (0..6).map(|i| [ids[ids.len() - 1 - i]]).collect();
    // One process, one batch.
    let mut caches: Vec<ModelCache> = (0..6).map(|_| single.new_cache()).collect::<candle_core::Result<_>>()?;
    let mut want = Vec::new();
    for chunk in [false, true] {
        let mut items: Vec<BatchItem> =
            caches.iter_mut().enumerate().map(|(i, c)| BatchItem::new(if chunk { &next[i][..] } else { &prompts[i][..] }, c)).collect();
        let out = single.model.forward_batch(&mut items)?;
        want.push((0..6).map(|i| bits(&out.item(i)?)).collect::<Result<Vec<_>>>()?);
    }
    ensure!(single.model.join_idle().is_err(), "a model that is not expert-parallel joined an exchange");
    // Three ranks, `deal` sequences each.
    let first: Vec<usize> = deal.iter().scan(0, |acc, &n| Some(std::mem::replace(acc, *acc + n))).collect();
    let cfg = single.config.clone();
    let token_map = engram_token_map(&single.tokenizer)?;
    let got = run_local_ranks(3, |comm| -> candle_core::Result<Vec<Vec<Vec<u16>>>> {
        let r = comm.rank();
        let placement = ExpertPlacement::new(cfg.n_routed_experts, 3, r)?;
        let ckpt = ReleaseCheckpoint::open_dir(&dir)?;
        let vb = var_builder_with(ckpt, DType::BF16, &Device::Cpu, QuantizedWeights::default());
        let model = Model::expert_parallel(&cfg, Numerics::REFERENCE, Some(token_map.clone()), vb, &EngramOptions::default(), placement, Arc::new(comm))?;
        if model.layers()[0].moe().is_ok() {
            candle_core::bail!("rank {r}: a sharded layer handed out a whole MoE")
        }
        let (n, s0) = (deal[r], first[r]);
        let mut caches: Vec<ModelCache> = (0..n).map(|_| ModelCache::new(&cfg, DType::BF16, &Device::Cpu)).collect::<candle_core::Result<_>>()?;
        let mut logits = vec![Vec::new(); n];
        for chunk in [false, true] {
            if n == 0 {
                model.join_idle()?;
                continue;
            }
            let mut items: Vec<BatchItem> =
                caches.iter_mut().enumerate().map(|(j, c)| BatchItem::new(if chunk { &next[s0 + j][..] } else { &prompts[s0 + j][..] }, c)).collect();
            let out = model.forward_batch(&mut items)?;
            for (j, l) in logits.iter_mut().enumerate() {
                l.push(bits(&out.item(j)?).map_err(|e| candle_core::Error::Msg(e.to_string()))?);
            }
        }
        model.serve_until_done()?;
        Ok(logits)
    })?;
    for (r, g) in got.into_iter().enumerate() {
        for (j, per_call) in g.iter().enumerate() {
            for (call, l) in per_call.iter().enumerate() {
                ensure!(*l == want[call][first[r] + j], "ranks {deal:?}: rank {r} sequence {j} call {call}: logits differ from the one-batch forward");
            }
        }
    }
    Ok(())
}

/// The exchange carries bf16: an f32 input is an error naming the dtype, not a silent rounding.
#[test]
fn a_non_bf16_input_is_an_error() -> Result<()> {
    let (cfg, vb, x) = setup()?;
    let comm = LocalGroup::ranks(1).pop().context("one rank")?;
    let moe = ShardedMoe::new(&cfg, Numerics::REFERENCE, vb.pp("layers").pp(0).pp("ffn"), ExpertPlacement::single(cfg.n_routed_experts))?;
    let err = moe.forward(&x.to_dtype(DType::F32)?, &RowGroups::whole(x.dim(0)?), &comm).unwrap_err().to_string();
    ensure!(err.contains("F32") && err.contains("bf16"), "{err}");
    Ok(())
}

/// Ranks loaded from the model folder (`Pretrained::load_rank`: each reads only its experts and
/// passes the strict check) making different numbers of calls — rank 0 a prefill and two decode
/// steps of two sequences, rank 1 one prefill, rank 2 none — then serving until all are done:
/// every sequence's logits are bit for bit its one-at-a-time forward on the whole model.
#[test]
fn ranks_with_different_calls() -> Result<()> {
    use deepseek_v41::loader::ReleaseCheckpoint;
    use deepseek_v41::model::{ModelCache, Pretrained};
    use deepseek_v41::tokenizer::Tokenizer;
    use std::sync::Arc;

    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/v41-shakespeare-tiny");
    let single = Pretrained::load_dir(&dir, Numerics::REFERENCE, DType::BF16, &Device::Cpu)?;
    let ids = single.tokenizer.encode("MENENIUS: What work's, my countrymen, in hand? where go you", true)?;
    ensure!(ids.len() >= 12, "the text encodes to {} tokens", ids.len());
    // Per rank, per sequence: the calls' chunks.
    let plan: Vec<Vec<Vec<&[u32]>>> = vec![
        vec![vec![&ids[..5], &ids[5..6], &ids[6..7]], vec![&ids[2..9], &ids[9..10], &ids[10..11]]],
        vec![vec![&ids[1..4]]],
        vec![],
    ];
    let mut want: Vec<Vec<Vec<Vec<u16>>>> = Vec::new();
    for seqs in &plan {
        let mut per_seq = Vec::new();
        for chunks in seqs {
            let mut cache = single.new_cache()?;
            per_seq.push(
                chunks
                    .iter()
                    .map(|c| {
                        let l = single.model.forward(c, &mut cache)?;
                        bits(&l.narrow(0, c.len() - 1, 1)?)
                    })
                    .collect::<Result<Vec<_>>>()?,
            );
        }
        want.push(per_seq);
    }
    let (cfg, tok) = (single.config.clone(), Tokenizer::from_file(dir.join("tokenizer.json"))?);
    let got = run_local_ranks(3, |comm| -> candle_core::Result<Vec<Vec<Vec<u16>>>> {
        let r = comm.rank();
        let p = Pretrained::load_rank(cfg.clone(), tok.clone(), ReleaseCheckpoint::open_dir(&dir)?, Numerics::REFERENCE, DType::BF16, &Device::Cpu, QuantizedWeights::default(), Arc::new(comm))?;
        let range = ExpertPlacement::new(cfg.n_routed_experts, 3, r)?.range();
        for (name, _) in p.model.linears() {
            if let Some(e) = name.split(".experts.").nth(1).and_then(|t| t.split('.').next()).and_then(|e| e.parse::<usize>().ok()) {
                if !range.contains(&e) {
                    candle_core::bail!("rank {r} holds {name}, outside its experts {range:?}")
                }
            }
        }
        let seqs = &plan[r];
        let mut caches: Vec<ModelCache> = (0..seqs.len()).map(|_| p.new_cache()).collect::<candle_core::Result<_>>()?;
        let calls = seqs.iter().map(|s| s.len()).max().unwrap_or(0);
        let mut out = vec![Vec::new(); seqs.len()];
        for call in 0..calls {
            let mut items: Vec<BatchItem> = caches.iter_mut().zip(seqs).map(|(c, s)| BatchItem::new(s[call], c)).collect();
            let o = p.model.forward_batch(&mut items)?;
            for (j, v) in out.iter_mut().enumerate() {
                v.push(bits(&o.item(j)?).map_err(|e| candle_core::Error::Msg(e.to_string()))?);
            }
        }
        p.model.serve_until_done()?;
        Ok(out)
    })?;
    for (r, (g, w)) in got.iter().zip(&want).enumerate() {
        ensure!(g.len() == w.len(), "rank {r}: {} sequences, {} expected", g.len(), w.len());
        for (j, (gs, ws)) in g.iter().zip(w).enumerate() {
            ensure!(gs.len() == ws.len(), "rank {r} sequence {j}: {} calls, {} expected", gs.len(), ws.len());
            for (call, (gc, wc)) in gs.iter().zip(ws).enumerate() {
                let diff = gc.iter().zip(wc).filter(|(a, b)| a != b).count();
                ensure!(gc.len() == wc.len() && diff == 0, "rank {r} sequence {j} call {call}: {diff} of {} logits differ from the one-at-a-time forward", wc.len());
            }
        }
    }
    Ok(())
}
