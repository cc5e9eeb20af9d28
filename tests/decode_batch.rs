//! The batched decode step of one attention layer (`attention::decode_batch`) on the CPU, for
//! every layer of the tiny config (window-only, ratio-2 kv + index sources, top-k reuse, the
//! ratio-1 candidate source, the ratio-1 `Reindex` candidate consumer, their reuse layers): B
//! sequences at different positions (before their first compressed entry, closing a compressor
//! group, opening one, inside and past the window, with more entries than the candidate blocks
//! keep), several steps in a row, equal bit for bit to each sequence's `Attention::forward`
//! alone — outputs, the index sources' top-k, the published candidate blocks and the cache rows —
//! for bf16 pools, packed index keys and all-packed pools (the ops' CPU references; every product
//! multiplies each sequence's row as its own call does). A step built once and fed by
//! `DecodeStepInputs::update` (what a graph replay does) equals fresh objects per step; a step
//! repeated at the same positions changes nothing; bad inputs are typed errors naming the value.
//! The kv sources' entries live in pages shared by the batch: sequences whose pages interleave,
//! a released row loaded with a new sequence, a full page pool (`PoolFull`, nothing changed)
//! — still bit for bit each sequence alone.
//!
//! Runs in every build (`cargo test --release --test decode_batch`): without the `cuda` feature
//! the step's ops are their CPU references (bf16 pools; the packed cases need the feature), with
//! it the `cuda` ops run their CPU paths (`--features cuda`, no GPU needed).

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::attention::{
    BatchStorage, BatchedLayerCache, CacheStorage, DecodeLayer, DecodeLayerKind, DecodeStep, DecodeStepError, PageTable, Published, SequenceCache,
};
use deepseek_v41::config::{CandidateRole, Config};

#[path = "support/rng.rs"]
#[allow(dead_code)]
mod rng;
use rng::Rng;

#[path = "support/decode_batch_run.rs"]
#[allow(dead_code)]
mod run;
use run::{bits, entry_ids, entry_slots, forward, layer_inputs, one_at_a_time, pool_slots, positions, prefill, random_layers, Batch};

fn tiny() -> Result<Config> {
    Ok(Config::from_file(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/v41-tiny/config.json"))?)
}

/// Prefill lengths = the first decode positions: before any entry (0), the first group closing
/// (1), inside the window (4), past it (9, 20; W = 8); from position 6 on, the ratio-1 layers
/// hold more entries than the 3 candidate blocks of 2 keep.
const STARTS: [usize; 5] = [0, 1, 4, 9, 20];
const STEPS: usize = 5;
/// Entries per sequence: the ratio-1 sources hold one per position (up to 25 here).
const ENTRIES: usize = 32;
/// The pools of the replay test: packed keys where the build has them.
#[cfg(feature = "cuda")]
const STORAGE: BatchStorage = BatchStorage::PACKED_KEYS;
#[cfg(not(feature = "cuda"))]
const STORAGE: BatchStorage = BatchStorage::BF16;

/// Runs the scenario in `storage`: every step's batched outputs and top-k against the
/// one-at-a-time ones, bit for bit, then the pools' rows against the sequences' caches.
fn batched_equals_one_at_a_time(storage: BatchStorage) -> Result<()> {
    let (cfg, dev) = (tiny()?, Device::Cpu);
    let layers = random_layers(&cfg, &dev, 17)?;
    let mut rng = Rng(0xdec0de);
    let mut seqs = prefill(&cfg, &layers, &STARTS, &mut rng, &dev)?;
    let b = STARTS.len();
    let batch = Batch::new(&cfg, &layers, b, ENTRIES, storage, &dev)?;
    batch.load(&seqs)?;
    let mut pos = positions(&STARTS, 0, cfg.sliding_window)?;
    let (masked, consumed) = step_and_compare(&cfg, &layers, &batch, &mut seqs, &mut pos, STEPS, &mut rng, &format!("{storage:?}"))?;
    ensure!(consumed > 0 && masked * 2 > consumed, "the candidate blocks restricted {masked} of {consumed} consumer selections");
    check_pools(&cfg, &batch, &seqs)
}

/// `steps` decode steps of `batch` (loaded with `seqs`, at `pos`, both advanced) against each
/// sequence alone, bit for bit: outputs, the index sources' top-k (as entry ids through the page
/// tables) and the published candidate blocks. Returns how many candidate-consumer selections
/// the blocks restricted, of how many.
#[allow(clippy::too_many_arguments)]
fn step_and_compare(
    cfg: &Config,
    layers: &[deepseek_v41::attention::Attention],
    batch: &Batch,
    seqs: &mut [SequenceCache],
    pos: &mut [usize],
    steps: usize,
    rng: &mut Rng,
    what: &str,
) -> Result<(usize, usize)> {
    let b = seqs.len();
    let step_objs = batch.steps()?;
    let (mut masked, mut consumed) = (0, 0);
    for t in 0..steps {
        batch.update(pos)?;
        let xs = layer_inputs(cfg, rng, b, &Device::Cpu)?;
        let got = forward(&step_objs, &xs)?;
        let want = one_at_a_time(cfg, layers, seqs, &xs, pos)?;
        for (l, layer) in batch.layers.iter().enumerate() {
            let y = bits(&got[l].y)?;
            ensure!(y.iter().any(|&v| f32::from_bits(v) != 0.0), "{what}, step {t}, layer {l}: all zeros");
            let h = cfg.hidden_size;
            let pages = batch.pages(l);
            for (s, alone) in want[l].iter().enumerate() {
                ensure!(y[s * h..(s + 1) * h] == bits(&alone.y)?[..], "{what}, step {t}, layer {l}, sequence {s} at {}: outputs differ", pos[s]);
                if let Some(wk) = &alone.topk {
                    let g = &entry_ids(got[l].topk.as_ref().expect("an index source's top-k"), pages)?[s];
                    ensure!(*g == wk.to_vec2::<i64>()?[0], "{what}, step {t}, layer {l}, sequence {s}: top-k {g:?} vs {:?}", wk.to_vec2::<i64>()?);
                }
                if let Some(wc) = &alone.candidates {
                    let gc = got[l].candidates.as_ref().expect("the candidate source's blocks").to_vec2::<i64>()?;
                    ensure!(gc[s] == wc.to_vec2::<i64>()?[0], "{what}, step {t}, layer {l}, sequence {s}: candidate blocks {:?} vs {wc}", gc[s]);
                }
            }
            match (layer.kind(), layer.candidates()) {
                (DecodeLayerKind::Reuse { index_source, .. }, _) => {
                    ensure!(bits(got[l].topk.as_ref().unwrap())? == bits(got[index_source].topk.as_ref().unwrap())?, "{what}, step {t}, layer {l}: reuse top-k")
                }
                (_, CandidateRole::Consume { source }) => {
                    // The consumer's entries lie in the published blocks; count the sequences whose
                    // visible entries the blocks restrict.
                    let blocks = got[source].candidates.as_ref().unwrap().to_vec2::<i64>()?;
                    let block = cfg.candidate_block_size as i64;
                    for (s, ids) in entry_ids(got[l].topk.as_ref().unwrap(), pages)?.iter().enumerate() {
                        ensure!(ids.iter().all(|&j| j < 0 || blocks[s].contains(&(j / block))), "{what}, step {t}, layer {l}, sequence {s}: {ids:?} outside {:?}", blocks[s]);
                        consumed += 1;
                        masked += usize::from(pos[s] + 1 > cfg.candidate_topk_blocks * cfg.candidate_block_size);
                    }
                }
                _ => {}
            }
        }
        pos.iter_mut().for_each(|p| *p += 1);
    }
    Ok((masked, consumed))
}

/// The pools hold the sequences' rows: window rings and, for the sources, entries and keys at
/// the slots of their pages.
fn check_pools(cfg: &Config, batch: &Batch, seqs: &[SequenceCache]) -> Result<()> {
    for (l, c) in batch.caches.iter().enumerate() {
        for (s, seq) in seqs.iter().enumerate() {
            let ring = seq.layer(l)?.window.ring_rows()?;
            let w = cfg.sliding_window;
            let region: Vec<usize> = (s * c.window_stride()..s * c.window_stride() + w).collect();
            ensure!(bits(&pool_slots(c.window_rows(), &region)?)? == bits(&ring)?, "layer {l}, sequence {s}: window ring");
            if let (Some(src), Some(pages), Ok(own)) = (c.source(), c.pages(), seq.source(l)) {
                let n = own.compressed.len();
                ensure!(n > 0 || seq.layer(l)?.next_pos < 2, "sequence {s}: no entries");
                let slots = entry_slots(pages, s, n)?;
                ensure!(bits(&pool_slots(&src.compressed, &slots)?)? == bits(&own.compressed.rows()?)?, "layer {l}, sequence {s}: entries");
                ensure!(bits(&pool_slots(&src.index_keys, &slots)?)? == bits(&own.index_keys.rows()?)?, "layer {l}, sequence {s}: keys");
            }
        }
    }
    Ok(())
}

#[test]
fn bf16_pools_equal_one_sequence_at_a_time() -> Result<()> {
    batched_equals_one_at_a_time(BatchStorage::BF16)
}

#[cfg(feature = "cuda")]
#[test]
fn packed_keys_equal_one_sequence_at_a_time() -> Result<()> {
    batched_equals_one_at_a_time(BatchStorage::PACKED_KEYS)
}

#[cfg(feature = "cuda")]
#[test]
fn packed_pools_equal_one_sequence_at_a_time() -> Result<()> {
    batched_equals_one_at_a_time(BatchStorage::PACKED)
}

/// The same steps through objects built once (x written in place, inputs updated: what a graph
/// replay reads) and through objects built anew each step give the same bits; a step repeated
/// at the same positions with the same input (a warm-up before a capture) gives the same
/// outputs and leaves the pools as one step does.
#[test]
fn a_step_fed_by_update_equals_a_fresh_step() -> Result<()> {
    let (cfg, dev) = (tiny()?, Device::Cpu);
    let layers = random_layers(&cfg, &dev, 29)?;
    let mut rng = Rng(0x5eed);
    let seqs = prefill(&cfg, &layers, &STARTS, &mut rng, &dev)?;
    let b = STARTS.len();
    let kept = Batch::new(&cfg, &layers, b, ENTRIES, STORAGE, &dev)?;
    kept.load(&seqs)?;
    let steps = kept.steps()?;
    let fixed_x = layer_inputs(&cfg, &mut rng, b, &dev)?;
    let fresh_pools = Batch::new(&cfg, &layers, b, ENTRIES, STORAGE, &dev)?;
    fresh_pools.load(&seqs)?;
    let n = layers.len();
    for t in 0..STEPS {
        let pos = positions(&STARTS, t, cfg.sliding_window)?;
        let xs = layer_inputs(&cfg, &mut rng, b, &dev)?;
        kept.update(&pos)?;
        for (f, x) in fixed_x.iter().zip(&xs) {
            f.slice_set(x, 0, 0)?;
        }
        let a = forward(&steps, &fixed_x)?;
        // Fresh inputs and steps over the second set of pools.
        let fresh_layers = layers.iter().map(|a| DecodeLayer::new(&cfg, a)).collect::<candle_core::Result<Vec<_>>>()?;
        let fresh = Batch::over(fresh_layers, fresh_pools.caches.clone())?;
        fresh.update(&pos)?;
        let c = forward(&fresh.steps()?, &xs)?;
        for l in 0..n {
            ensure!(bits(&a[l].y)? == bits(&c[l].y)?, "step {t}, layer {l}: kept objects vs fresh objects");
        }
        if t == 2 {
            // Repeated: same outputs, same pools afterwards (compared at the next step).
            let again = forward(&steps, &fixed_x)?;
            for l in 0..n {
                ensure!(bits(&a[l].y)? == bits(&again[l].y)?, "step {t}, layer {l}: repeated step");
            }
        }
    }
    // Negative control: the same state stepped at other positions gives other outputs.
    let (one, two) = (Batch::new(&cfg, &layers, b, ENTRIES, BatchStorage::BF16, &dev)?, Batch::new(&cfg, &layers, b, ENTRIES, BatchStorage::BF16, &dev)?);
    one.load(&seqs)?;
    two.load(&seqs)?;
    let xs = layer_inputs(&cfg, &mut rng, b, &dev)?;
    one.update(&STARTS)?;
    two.update(&STARTS.map(|p| p + 2))?;
    let (y1, y2) = (forward(&one.steps()?, &xs)?, forward(&two.steps()?, &xs)?);
    ensure!((0..n).all(|l| bits(&y1[l].y).ok() != bits(&y2[l].y).ok()), "the positions changed nothing");
    Ok(())
}

fn message(e: candle_core::Error) -> String {
    e.to_string()
}

/// Bad batch sizes, positions, tensors and layer / cache / input combinations are errors that
/// name the value; a failed update changes nothing.
#[test]
fn bad_inputs_are_typed_errors() -> Result<()> {
    let (cfg, dev) = (tiny()?, Device::Cpu);
    let layers = random_layers(&cfg, &dev, 3)?;
    let dl: Vec<DecodeLayer> = layers.iter().map(|a| DecodeLayer::new(&cfg, a)).collect::<candle_core::Result<_>>()?;
    let e = message(BatchedLayerCache::zeros(&dl[1], 0, 4, BatchStorage::BF16, &dev).unwrap_err());
    ensure!(e.starts_with(&DecodeStepError::EmptyBatch.to_string()), "{e}");
    let batch = Batch::new(&cfg, &layers, 3, 4, BatchStorage::BF16, &dev)?;
    let (window_inputs, compressed_inputs) = (batch.inputs_of(0), batch.inputs_of(1));
    // Positions: count and capacity (4 entries per sequence: ratio-2 positions up to 8 fit,
    // ratio-1 positions up to 4).
    let e = message(compressed_inputs.update(&[1, 2]).unwrap_err());
    ensure!(e.contains("positions is for 2 sequences") && e.contains("batch has 3"), "{e}");
    batch.update(&[3, 1, 2])?;
    compressed_inputs.update(&[7, 3, 5])?;
    let before = compressed_inputs.positions().to_vec1::<i64>()?;
    let e = message(compressed_inputs.update(&[7, 9, 5]).unwrap_err());
    ensure!(e.contains("sequence 1 at position 9") && e.contains("5 compressed entries") && e.contains("holds 4"), "{e}");
    ensure!(compressed_inputs.positions().to_vec1::<i64>()? == before, "a failed update changed the inputs");
    let e = message(batch.inputs_of(4).update(&[3, 4, 2]).unwrap_err());
    ensure!(e.contains("sequence 1 at position 4") && e.contains("5 compressed entries") && e.contains("below 4"), "{e}");
    window_inputs.update(&[100, 3, 5])?; // window-only layers have no capacity limit
    let e = message(window_inputs.update(&[1, 1 << 31, 5]).unwrap_err());
    ensure!(e.contains("sequence 1 is at position 2147483648"), "{e}");
    // x: dtype and rows.
    let steps = batch.steps()?;
    let x = Tensor::zeros((3, cfg.hidden_size), DType::F32, &dev)?;
    let e = message(steps[0].projections(&x).unwrap_err());
    ensure!(e.contains("x must be BF16 [3, 256]") && e.contains("F32 [3, 256]"), "{e}");
    let e = message(steps[0].projections(&x.narrow(0, 0, 2)?.to_dtype(DType::BF16)?).unwrap_err());
    ensure!(e.contains("got BF16 [2, 256]"), "{e}");
    // A reuse layer without (or with a wrong) top-k, or with another layer's cache.
    let xb = x.to_dtype(DType::BF16)?;
    let pr = steps[2].projections(&xb)?;
    let e = message(steps[2].selection(&pr, Published::default()).unwrap_err());
    ensure!(e.contains("layer 2") && e.contains("top-k of its index source, layer 1"), "{e}");
    let bad = Tensor::zeros((3, 3), DType::I64, &dev)?;
    let e = message(steps[2].selection(&pr, Published { topk: Some(&bad), candidates: None }).unwrap_err());
    ensure!(e.contains("reused top-k must be I64 [3, 4]"), "{e}");
    let e = message(DecodeStep::new(&dl[2], &batch.caches[2], Some(&batch.caches[3]), compressed_inputs).unwrap_err());
    ensure!(e.contains("kv source, layer 1, not the cache of layer 3"), "{e}");
    let e = message(DecodeStep::new(&dl[2], &batch.caches[2], None, compressed_inputs).unwrap_err());
    ensure!(e.contains("pass the cache of its kv source, layer 1"), "{e}");
    // The candidate consumer (layer 6, Reindex over layer 4's keys) without (or with wrong)
    // candidate blocks of layer 4, or without its key owner's cache.
    let pr = steps[6].projections(&xb)?;
    let e = message(steps[6].selection(&pr, Published::default()).unwrap_err());
    ensure!(e.contains("layer 6") && e.contains("candidate blocks of layer 4"), "{e}");
    let e = message(steps[6].selection(&pr, Published { topk: None, candidates: Some(&bad.narrow(1, 0, 2)?) }).unwrap_err());
    ensure!(e.contains("candidate blocks must be I64 [3, 3]"), "{e}");
    let e = message(DecodeStep::new(&dl[6], &batch.caches[6], None, batch.inputs_of(6)).unwrap_err());
    ensure!(e.contains("pass the cache of its kv source, layer 4"), "{e}");
    // Inputs of the wrong kind, ratio or batch, a cache of another layer.
    let e = message(DecodeStep::new(&dl[0], &batch.caches[0], None, compressed_inputs).unwrap_err());
    ensure!(e.contains("layer 0") && e.contains("compressed layer's"), "{e}");
    let e = message(DecodeStep::new(&dl[1], &batch.caches[3], None, compressed_inputs).unwrap_err());
    ensure!(e.contains("built for layer 3"), "{e}");
    let e = message(DecodeStep::new(&dl[4], &batch.caches[4], None, compressed_inputs).unwrap_err());
    ensure!(e.contains("built for ratio 2") && e.contains("the layer has ratio 1"), "{e}");
    let other = BatchedLayerCache::zeros(&dl[0], 2, 4, BatchStorage::BF16, &dev)?;
    let e = message(DecodeStep::new(&dl[0], &other, None, window_inputs).unwrap_err());
    ensure!(e.contains("the step inputs is for 3 sequences, the step's batch has 2"), "{e}");
    // A sequence index outside the batch.
    let seq = deepseek_v41::attention::SequenceCache::new(&cfg, DType::BF16, &dev)?;
    let e = message(batch.caches[1].load_sequence(3, &seq).unwrap_err());
    ensure!(e.contains("sequence index is for 4 sequences"), "{e}");
    // A module of one role with a config giving the layer another.
    let mut other_cfg = cfg.clone();
    other_cfg.layers[4] = cfg.layers[5];
    let e = message(DecodeLayer::new(&other_cfg, &layers[4]).unwrap_err());
    ensure!(e.contains("layer 4") && e.contains("role of layer 4 is not the module's"), "{e}");
    // Packed pools: without the `cuda` feature; with the cache fake quant off.
    #[cfg(not(feature = "cuda"))]
    {
        let e = message(BatchedLayerCache::zeros(&dl[0], 3, 4, BatchStorage::uniform(CacheStorage::Packed), &dev).unwrap_err());
        ensure!(e.contains("`cuda` feature"), "{e}");
    }
    #[cfg(feature = "cuda")]
    {
        use deepseek_v41::attention::DecodeStepInputs;
        let vb = deepseek_v41::nn::RandomWeights::new(3).var_builder(DType::BF16, &dev);
        let plain = deepseek_v41::Numerics { cache_fake_quant: false, ..deepseek_v41::Numerics::REFERENCE };
        let l0 = deepseek_v41::attention::Attention::new(&cfg, 0, plain, vb.pp("layers.0.attn"))?;
        let d0 = DecodeLayer::new(&cfg, &l0)?;
        let packed = BatchedLayerCache::zeros(&d0, 3, 4, BatchStorage::uniform(CacheStorage::Packed), &dev)?;
        let inputs = DecodeStepInputs::new(&d0, &packed, None)?;
        let e = message(DecodeStep::new(&d0, &packed, None, &inputs).unwrap_err());
        ensure!(e.contains("cache_fake_quant"), "{e}");
    }
    Ok(())
}

/// Prefill lengths of the paged scenarios: sequences of the ratio-1 sources past one page of 64
/// entries (125, 127), crossing into their second or third page at different steps (62, 60 at
/// steps 2 and 4, 125 at step 3, 127 at step 1) and one that stays in its first (2); the ratio-2
/// sources cross at steps 2 (127) and 4 (125).
const PAGED_STARTS: [usize; 5] = [125, 2, 62, 60, 127];
const PAGED_STEPS: usize = 6;
/// Entries per sequence of the paged scenarios: 3 pages.
const PAGED_ENTRIES: usize = 192;

/// Sequences whose pages interleave (taken in turn at the load, then one by one as the
/// sequences cross page boundaries at different steps) give, bit for bit, what each sequence
/// alone gives, and the pools hold their rows at the slots of their pages.
#[test]
fn interleaved_pages_equal_one_sequence_at_a_time() -> Result<()> {
    let (cfg, dev) = (tiny()?, Device::Cpu);
    let layers = random_layers(&cfg, &dev, 19)?;
    let storages: &[BatchStorage] = if cfg!(feature = "cuda") { &[BatchStorage::BF16, BatchStorage::PACKED] } else { &[BatchStorage::BF16] };
    for &storage in storages {
        let mut rng = Rng(0x9a9e5);
        let mut seqs = prefill(&cfg, &layers, &PAGED_STARTS, &mut rng, &dev)?;
        let b = PAGED_STARTS.len();
        let batch = Batch::new(&cfg, &layers, b, PAGED_ENTRIES, storage, &dev)?;
        ensure!(batch.caches.iter().filter_map(|c| c.pages()).all(|p| p.used() == 0), "fresh pools hold pages");
        batch.load_interleaved(&seqs)?;
        ensure!(batch.pages_interleaved(), "the load took adjacent pages");
        let before: Vec<usize> = batch.caches.iter().filter_map(|c| c.pages()).map(|p| p.used()).collect();
        let mut pos = positions(&PAGED_STARTS, 0, cfg.sliding_window)?;
        step_and_compare(&cfg, &layers, &batch, &mut seqs, &mut pos, PAGED_STEPS, &mut rng, &format!("{storage:?}, interleaved"))?;
        let after: Vec<usize> = batch.caches.iter().filter_map(|c| c.pages()).map(|p| p.used()).collect();
        ensure!(before.iter().zip(&after).all(|(a, b)| b > a), "pages used before {before:?}, after {after:?}: the steps took none");
        check_pools(&cfg, &batch, &seqs)?;
    }
    Ok(())
}

/// A released row takes a new sequence (into the pages the others left and freed ones): the
/// other sequences' steps stay bit for bit theirs, the new one's is its own.
#[test]
fn a_released_row_takes_a_new_sequence() -> Result<()> {
    let (cfg, dev) = (tiny()?, Device::Cpu);
    let layers = random_layers(&cfg, &dev, 23)?;
    let mut rng = Rng(0x7e1ea5e);
    let mut seqs = prefill(&cfg, &layers, &PAGED_STARTS, &mut rng, &dev)?;
    let b = PAGED_STARTS.len();
    let batch = Batch::new(&cfg, &layers, b, PAGED_ENTRIES, BatchStorage::BF16, &dev)?;
    batch.load(&seqs)?;
    let mut pos = positions(&PAGED_STARTS, 0, cfg.sliding_window)?;
    step_and_compare(&cfg, &layers, &batch, &mut seqs, &mut pos, 2, &mut rng, "before the release")?;
    let used = |batch: &Batch| -> Vec<usize> { batch.caches.iter().filter_map(|c| c.pages()).map(|p| p.used()).collect() };
    let held = used(&batch);
    batch.release(4)?;
    let freed = used(&batch);
    ensure!(held.iter().zip(&freed).all(|(h, f)| f < h) && held[2] - freed[2] == 3, "release returned too few pages: {held:?} → {freed:?}");
    ensure!(batch.caches.iter().filter_map(|c| c.pages()).all(|p| p.pages_of(4).is_empty()), "row 4 still holds pages");
    // A new sequence of 70 tokens in row 4 (longer than a page at ratio 1: two of the freed pages).
    let new = prefill(&cfg, &layers, &[70], &mut rng, &dev)?.remove(0);
    batch.load_one(4, &new)?;
    seqs[4] = new;
    pos[4] = 70;
    step_and_compare(&cfg, &layers, &batch, &mut seqs, &mut pos, 3, &mut rng, "after the load")?;
    ensure!(batch.pages_interleaved(), "no sequence's pages interleave");
    check_pools(&cfg, &batch, &seqs)
}

/// A step whose new entries find no free page is `PoolFull` naming the layer, the sequence and
/// the pages; it changes nothing: the pages, the inputs, and after a finished sequence's release
/// and a new load the other sequences' steps are still bit for bit theirs.
#[test]
fn a_full_page_pool_is_an_error_that_changes_nothing() -> Result<()> {
    let (cfg, dev) = (tiny()?, Device::Cpu);
    let layers = random_layers(&cfg, &dev, 31)?;
    let mut rng = Rng(0xf011);
    // Ratio-1 sources: sequence 0 crosses into its second page at step 2, sequence 2 at step 1;
    // 4 pages for 3 sequences.
    let starts = [62, 3, 62 + 1];
    let mut seqs = prefill(&cfg, &layers, &starts, &mut rng, &dev)?;
    let batch = Batch::paged(&cfg, &layers, 3, 128, 4, BatchStorage::BF16, &dev)?;
    batch.load(&seqs)?;
    let mut pos = starts.to_vec();
    step_and_compare(&cfg, &layers, &batch, &mut seqs, &mut pos, 2, &mut rng, "before the pool fills")?;
    let table = |batch: &Batch| -> Vec<Vec<usize>> {
        batch.caches.iter().filter_map(|c| c.pages()).flat_map(|p| (0..3).map(|s| p.pages_of(s)).collect::<Vec<_>>()).collect()
    };
    let (pages, inputs) = (table(&batch), batch.inputs.iter().map(|i| i.positions().to_vec1::<i64>()).collect::<candle_core::Result<Vec<_>>>()?);
    let e = batch.update(&pos).unwrap_err().to_string();
    let src = (0..cfg.num_hidden_layers).find(|&l| cfg.compress_ratios[l] == 1 && batch.caches[l].pages().is_some()).expect("a ratio-1 kv source");
    ensure!(e.contains(&format!("layer {src}: sequence 0 needs 1 more pages")) && e.contains("has 0 of 4 free") && e.contains("release"), "{e}");
    ensure!(table(&batch) == pages, "the failed update changed the page tables");
    let now = batch.inputs.iter().map(|i| i.positions().to_vec1::<i64>()).collect::<candle_core::Result<Vec<_>>>()?;
    ensure!(now == inputs, "the failed update changed the inputs");
    let occ = batch.caches[src].pages().expect("a kv source").occupancy();
    ensure!((occ.layer, occ.used, occ.total) == (src, 4, 4), "{occ:?}");
    // Sequence 0 is done: its row takes a new short sequence; the others go on as if nothing happened.
    batch.release(0)?;
    let new = prefill(&cfg, &layers, &[9], &mut rng, &dev)?.remove(0);
    batch.load_one(0, &new)?;
    seqs[0] = new;
    pos[0] = 9;
    step_and_compare(&cfg, &layers, &batch, &mut seqs, &mut pos, 2, &mut rng, "after the pool filled")?;
    check_pools(&cfg, &batch, &seqs)?;
    // A load that finds no page is the same error and changes nothing either.
    let long = prefill(&cfg, &layers, &[100], &mut rng, &dev)?.remove(0);
    let before = table(&batch);
    let e = message(batch.caches[src].load_sequence(1, &long).unwrap_err());
    ensure!(e.contains("sequence 1 needs 1 more pages"), "{e}");
    ensure!(table(&batch) == before, "the failed load changed the page tables");
    ensure!(PageTable::PAGE == 64, "the scenarios assume pages of 64 entries");
    Ok(())
}
