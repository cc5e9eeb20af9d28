//! GPU tests of the lightning-indexer kernels (`kernels/indexer_scores.cu`,
//! `kernels/indexer_select.cu`, `kernels/indexer_topk.cu`) through `deepseek_v41::cuda::{masked_index_scores, index_topk,
//! candidate_blocks, index_select}` against their CPU paths (the crate's reference
//! `attention::indexer::{index_scores, top_k, candidate_blocks}`).
//!
//! Data: fresh random values (never zeros), queries and keys fake-quantized with Q3 like the
//! model's (spec §2.3) unless stated; outputs' memory poisoned beforehand (NaN scores, i64
//! 0x5a5a.. ids) so an unwritten element shows. Scores of fake-quantized data must match the
//! CPU bit for bit (at most 1 in 1000 may differ by one bf16 ulp: the f32 order of the dot
//! product); plain bf16 data within 1% of the row's largest |score|. Top-k and candidate blocks
//! must be identical, including TIES: bf16 rows of 70K random values hold many equal scores, and
//! rows drawn from a handful of values or all equal are tested on purpose; both sides use
//! "descending score, ties → lower id", so the sets must agree exactly.
//!
//! The one-read top-k kernel (`kernels/indexer_topk.cu`, rows of at most 64K entries) is checked on
//! 64K rows with its fallbacks (overflowing candidate lists, a sampled threshold above the k-th
//! key) and length edges.
//!
//! `index_select` is checked against the CPU (with several score-scratch budgets) on ties at a
//! histogram bin edge, −inf (masked, past-cache) entries completing the top-k, short rows and the
//! prefill and balanced decode kernels; keys through a page table (the batched decode step's
//! paged pools) against the CPU path.
//!
//! These tests need a CUDA device and FAIL without one.
//! Build: `cargo test --release --features cuda --test cuda_indexer`.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::attention::indexer::{CandidateShape, Candidates};
use deepseek_v41::cuda::{
    candidate_blocks, index_select, index_select_with_options, index_topk, masked_index_scores,
    IndexKeys, KeySource, SelectOptions, Visibility,
};
use half::bf16;

#[path = "support/rng.rs"]
#[allow(dead_code)]
mod rng;
use rng::Rng;

#[path = "support/indexer_data.rs"]
mod data;
use data::*;

#[test]
fn scores_match_the_cpu_on_bf16_rows_with_visibility_edges() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(11);
    for &(h, n) in &[(32usize, 1000usize), (2, 37), (20, 8), (17, 300)] {
        let counts = [0u32, 1, n as u32, n as u32 + 9, (n / 2) as u32, 5];
        let t = counts.len();
        let (q, w, keys) = (fq(&mut rng, &[t, h, D])?, weights(&mut rng, t, h)?, fq(&mut rng, &[n, D])?);
        let vis_cpu = Tensor::new(&counts[..], &Device::Cpu)?;
        let vis_gpu = vis_cpu.to_device(&dev)?;
        let cpu_src = KeySource { keys: IndexKeys::Rows(&keys), base: None, pages: None, entries: n, visibility: Visibility::Counts(&vis_cpu) };
        let want = masked_index_scores(&q, &w, &cpu_src, None)?;
        let (qg, wg, kg) = (q.to_device(&dev)?, w.to_device(&dev)?, keys.to_device(&dev)?);
        poison(&dev, t * n)?;
        let gsrc = KeySource { keys: IndexKeys::Rows(&kg), base: None, pages: None, entries: n, visibility: Visibility::Counts(&vis_gpu) };
        let got = masked_index_scores(&qg, &wg, &gsrc, None)?;
        assert_scores_exact(&format!("H{h} N{n} counts"), &got, &want)?;
        // Visible 0 → all −inf; visible N → no −inf.
        let g = bits(&got)?;
        ensure!(g[..n].iter().all(|&b| b == 0xff80), "visible 0 must give -inf");
        ensure!(g[2 * n..3 * n].iter().all(|&b| b != 0xff80), "visible N must give finite scores");
        // The causal rule (one sequence at start 7, ratio 2) against the CPU.
        let causal = Visibility::Causal { start: 2 * n - 4, ratio: 2 };
        let want = masked_index_scores(&q, &w, &KeySource { visibility: causal, ..cpu_src }, None)?;
        let got = masked_index_scores(&qg, &wg, &KeySource { visibility: causal, ..gsrc }, None)?;
        assert_scores_exact(&format!("H{h} N{n} causal"), &got, &want)?;
    }
    Ok(())
}

#[test]
fn scores_of_plain_bf16_data_are_close() -> Result<()> {
    // Not fake-quantized: the dot products' f32 order differs, a few bf16 roundings flip.
    let dev = gpu();
    let mut rng = Rng(12);
    let (t, h, n) = (4, 32, 777);
    let q = normal(&mut rng, &[t, h, D], 1.0)?.to_dtype(DType::BF16)?;
    let keys = normal(&mut rng, &[n, D], 1.0)?.to_dtype(DType::BF16)?;
    let w = weights(&mut rng, t, h)?;
    let want = masked_index_scores(&q, &w, &KeySource::sequence(IndexKeys::Rows(&keys), 10_000, 1)?, None)?;
    let kg = keys.to_device(&dev)?;
    let got = masked_index_scores(&q.to_device(&dev)?, &w.to_device(&dev)?, &KeySource::sequence(IndexKeys::Rows(&kg), 10_000, 1)?, None)?;
    let (g, c) = (got.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.to_vec2::<f32>()?, want.to_dtype(DType::F32)?.to_vec2::<f32>()?);
    let (mut exact, mut total) = (0, 0);
    for (gr, cr) in g.iter().zip(&c) {
        let scale = cr.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (a, b) in gr.iter().zip(cr) {
            ensure!((a - b).abs() <= 0.01 * scale, "plain scores: gpu {a} cpu {b} (row max {scale})");
            exact += (a == b) as usize;
            total += 1;
        }
    }
    ensure!(exact * 10 >= total * 9, "plain scores: only {exact} of {total} exact");
    Ok(())
}

#[test]
fn packed_keys_score_like_bf16_rows_with_per_query_bases() -> Result<()> {
    // Batched decode: each query has its own keys in one shared packed cache (slots base[t]..).
    let dev = gpu();
    let mut rng = Rng(13);
    let (h, n, page) = (32, 300, 64);
    let bases = [0u32, 300, 600, 905, 1210];
    let counts = [300u32, 299, 1, 0, 290];
    let t = bases.len();
    let rows = 1210 + 300 - 10; // the last query's rows end 10 short of N: those are invisible
    let (q, w, keys) = (fq(&mut rng, &[t, h, D])?, weights(&mut rng, t, h)?, fq(&mut rng, &[rows, D])?);
    let (cache, layout) = pack(&keys, page, &dev)?;
    let (base_c, vis_c) = (Tensor::new(&bases[..], &Device::Cpu)?, Tensor::new(&counts[..], &Device::Cpu)?);
    let (base_g, vis_g) = (base_c.to_device(&dev)?, vis_c.to_device(&dev)?);
    let cpu_src = KeySource { keys: IndexKeys::Rows(&keys), base: Some(&base_c), pages: None, entries: n, visibility: Visibility::Counts(&vis_c) };
    let want = masked_index_scores(&q, &w, &cpu_src, None)?;
    let (qg, wg, kg) = (q.to_device(&dev)?, w.to_device(&dev)?, keys.to_device(&dev)?);
    poison(&dev, t * n)?;
    let packed = KeySource { keys: IndexKeys::Packed { cache: &cache, layout }, base: Some(&base_g), pages: None, entries: n, visibility: Visibility::Counts(&vis_g) };
    let got_packed = masked_index_scores(&qg, &wg, &packed, None)?;
    assert_scores_exact("packed keys", &got_packed, &want)?;
    let rows_src = KeySource { keys: IndexKeys::Rows(&kg), ..packed };
    let got_rows = masked_index_scores(&qg, &wg, &rows_src, None)?;
    ensure!(bits(&got_rows)? == bits(&got_packed)?, "packed and bf16 keys must score identically on the GPU");
    // The CPU path reads packed keys through the layout's unpack: same reference.
    let cache_cpu = cache.to_device(&Device::Cpu)?;
    let cpu_packed = KeySource { keys: IndexKeys::Packed { cache: &cache_cpu, layout }, ..cpu_src };
    ensure!(bits(&masked_index_scores(&q, &w, &cpu_packed, None)?)? == bits(&want)?, "CPU packed path");
    Ok(())
}

/// Packed keys through the kernel's register dequantization: rows scaled by 2^-40..2^40 (block
/// scale bytes far below and above 128, the one- and two-multiply paths), page sizes that are
/// not powers of two (the page division), H = 32 / 7 / 2 (full and partial head sums, one or
/// two m-tiles), key counts off the 32-key tile, and visible entries past the cache's last slot
/// (−inf without a read).
#[test]
fn packed_keys_with_wide_scales_odd_pages_and_head_counts() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(23);
    for &(h, page, n) in &[(32usize, 20usize, 301usize), (7, 12, 77), (2, 4, 45), (32, 36, 1000)] {
        let t = 5;
        let rows = 4 * n + 3; // capacity rounds up to whole pages; the last query runs past it
        let bases: Vec<u32> = vec![0, n as u32, 2 * n as u32 + 1, 3 * n as u32, (rows - n / 2) as u32];
        let counts: Vec<u32> = vec![n as u32, (n - 31) as u32, 0, 33, n as u32];
        let keys = WideScaledKeys::new(&mut rng, rows, page, &bases, &counts, &dev)?;
        let (q, w) = (fq(&mut rng, &[t, h, D])?, weights(&mut rng, t, h)?);
        let want = masked_index_scores(&q, &w, &keys.source(n, false), None)?;
        poison(&dev, t * n)?;
        let got = masked_index_scores(&q.to_device(&dev)?, &w.to_device(&dev)?, &keys.source(n, true), None)?;
        let what = format!("H{h} page {page} N{n}");
        assert_scores_exact(&what, &got, &want)?;
        // Entries whose slot lies past the cache's capacity are -inf (never read).
        let capacity = rows.div_ceil(page) * page;
        let g = bits(&got)?;
        let last = &g[4 * n..5 * n];
        let inside = capacity - (rows - n / 2);
        ensure!(inside < n && last[inside..].iter().all(|&b| b == 0xff80), "{what}: slots past the cache must be -inf");
        ensure!(last[..inside].iter().all(|&b| b != 0xff80 && b & 0x7f80 != 0x7f80), "{what}: slots inside must be finite");
        ensure!(g[2 * n..3 * n].iter().all(|&b| b == 0xff80), "{what}: visible 0 must give -inf");
        // The wide scales really reach both sides of 2^1 (scale byte 128).
        let sc = keys.cache_cpu.flatten_all()?.to_vec1::<u8>()?;
        let scale_bytes: Vec<u8> = (0..rows.div_ceil(page))
            .flat_map(|pg| sc[pg * keys.layout.page_bytes() + page * 64..][..page * 4].to_vec())
            .collect();
        ensure!(scale_bytes.iter().any(|&e| e > 140) && scale_bytes.iter().any(|&e| e < 100), "{what}: scales not wide");
    }
    Ok(())
}

#[test]
fn candidate_masks_restrict_consumer_scores() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(14);
    let (t, h, n, block, n_keep) = (6, 32, 203, 8, 7);
    let (q, w, keys) = (fq(&mut rng, &[t, h, D])?, weights(&mut rng, t, h)?, fq(&mut rng, &[n, D])?);
    let n_blocks = n.div_ceil(block);
    let mut kept = Vec::new();
    for ti in 0..t {
        let mut row: Vec<i64> = (0..n_keep).map(|_| rng.below(n_blocks) as i64).collect();
        row.sort_unstable();
        row.dedup();
        if ti == 0 {
            row.clear(); // nothing allowed
        }
        row.resize(n_keep, -1);
        kept.extend(row);
    }
    let kept = Tensor::from_vec(kept, (t, n_keep), &Device::Cpu)?;
    let c_cpu = Candidates { block, kept: kept.clone() };
    let c_gpu = Candidates { block, kept: kept.to_device(&dev)? };
    let want = masked_index_scores(&q, &w, &KeySource::sequence(IndexKeys::Rows(&keys), 2 * n - 3, 2)?, Some(&c_cpu))?;
    let kg = keys.to_device(&dev)?;
    poison(&dev, t * n)?;
    let gsrc = KeySource::sequence(IndexKeys::Rows(&kg), 2 * n - 3, 2)?;
    let got = masked_index_scores(&q.to_device(&dev)?, &w.to_device(&dev)?, &gsrc, Some(&c_gpu))?;
    assert_scores_exact("candidate mask", &got, &want)?;
    ensure!(bits(&got)?[..n].iter().all(|&b| b == 0xff80), "no kept block: all -inf");
    Ok(())
}

/// Score rows `[T, N]` bf16 with many ties: random bf16 normals, a handful of values, all equal,
/// −inf stretches.
fn tie_rows(rng: &mut Rng, t: usize, n: usize) -> Result<Tensor> {
    let mut v = Vec::with_capacity(t * n);
    for ti in 0..t {
        for j in 0..n {
            let x = match ti % 4 {
                0 => rng.normal(),
                1 => [0.0, 0.5, -1.0, 2.0][rng.below(4)],
                2 => 1.0,
                _ => {
                    if (j / 100) % 3 == 0 {
                        f32::NEG_INFINITY
                    } else {
                        (rng.below(50) as f32 - 25.0) * 0.125
                    }
                }
            };
            v.push(bf16::from_f32(x));
        }
    }
    Ok(Tensor::from_vec(v, (t, n), &Device::Cpu)?)
}

#[test]
fn topk_matches_the_reference_with_ties_padding_and_short_rows() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(15);
    for &(n, k) in &[(70_000usize, 512usize), (513, 512), (512, 512), (100, 512), (37, 4), (1, 4), (4000, 1)] {
        let t = 8;
        let scores = tie_rows(&mut rng, t, n)?;
        let counts: Vec<u32> = (0..t as u32).map(|i| match i {
            0 => n as u32,
            1 => 0,
            2 => 1,
            3 => n as u32 + 5,
            _ => rng.below(n + 1) as u32,
        }).collect();
        let vis_c = Tensor::new(counts.as_slice(), &Device::Cpu)?;
        let want = index_topk(&scores, &Visibility::Counts(&vis_c), k)?;
        let sg = scores.to_device(&dev)?;
        let vis_g = vis_c.to_device(&dev)?;
        poison(&dev, t * k)?;
        let got = index_topk(&sg, &Visibility::Counts(&vis_g), k)?;
        assert_ids_equal(&format!("top-k N{n} k{k}"), &got, &want)?;
        // Causal rule too.
        let causal = Visibility::Causal { start: n / 2, ratio: 1 };
        assert_ids_equal(&format!("top-k N{n} k{k} causal"), &index_topk(&sg, &causal, k)?, &index_topk(&scores, &causal, k)?)?;
        // Negative control: the top-k of the visible-0 row is all −1, of the visible-1 row [0, -1..].
        let g = ids(&got)?;
        ensure!(g[1].iter().all(|&i| i == -1), "visible 0: {:?}", &g[1][..4.min(k)]);
        ensure!(g[2][0] == 0 && g[2][1..].iter().all(|&i| i == -1), "visible 1");
    }
    Ok(())
}

#[test]
fn candidate_blocks_match_the_reference() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(16);
    for &(n, block, n_keep) in &[(65_531usize, 8usize, 2048usize), (203, 8, 2048), (40, 2, 3), (4001, 8, 100), (9, 8, 1)] {
        let t = 8;
        let scores = tie_rows(&mut rng, t, n)?;
        let counts: Vec<u32> = (0..t as u32).map(|i| match i {
            0 => n as u32,
            1 => 0,
            2 => 1,
            3 => n as u32 - 1, // newest block partial
            _ => rng.below(n + 1) as u32,
        }).collect();
        let vis_c = Tensor::new(counts.as_slice(), &Device::Cpu)?;
        let want = candidate_blocks(&scores, &Visibility::Counts(&vis_c), block, n_keep)?;
        let sg = scores.to_device(&dev)?;
        let vis_g = vis_c.to_device(&dev)?;
        poison(&dev, t * n_keep)?;
        let got = candidate_blocks(&sg, &Visibility::Counts(&vis_g), block, n_keep)?;
        assert_ids_equal(&format!("blocks N{n} B{block} keep{n_keep}"), &got, &want)?;
        let g = ids(&got)?;
        ensure!(g[1].iter().all(|&b| b == -1), "visible 0 keeps nothing");
        ensure!(g[2][0] == 0, "visible 1 pins block 0");
        let pinned = ((counts[3] - 1) as usize / block) as i64;
        ensure!(g[3].contains(&pinned), "the newest partial block {pinned} is pinned");
    }
    Ok(())
}

#[test]
fn index_select_matches_the_reference_end_to_end() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(17);
    // Prefill chunk of one sequence (Flash shapes, small N), candidate source then consumer,
    // with a scratch small enough to force several query chunks.
    let (t, h, n, k) = (40, 32, 3001, 512);
    let start = 2 * n - t + 1;
    let (q, w, keys) = (fq(&mut rng, &[t, h, D])?, weights(&mut rng, t, h)?, fq(&mut rng, &[n, D])?);
    let shape = CandidateShape { block: 8, n_keep: 64 };
    let cpu_src = KeySource::sequence(IndexKeys::Rows(&keys), start, 2)?;
    let want = index_select(&q, &w, &cpu_src, k, None, Some(shape))?;
    let (qg, wg, kg) = (q.to_device(&dev)?, w.to_device(&dev)?, keys.to_device(&dev)?);
    let gsrc = KeySource::sequence(IndexKeys::Rows(&kg), start, 2)?;
    for scratch in [1usize << 28, 2 * 3008 * 7] {
        poison(&dev, t * k)?;
        let opts = SelectOptions { scratch_bytes: scratch };
        let got = index_select_with_options(&qg, &wg, &gsrc, k, None, Some(shape), &opts)?;
        assert_ids_equal(&format!("select topk (scratch {scratch})"), &got.topk, &want.topk)?;
        let (gc, wc) = (got.candidates.as_ref().unwrap(), want.candidates.as_ref().unwrap());
        assert_ids_equal("select candidate blocks", &gc.kept, &wc.kept)?;
    }
    // A consumer of those candidates (another layer's queries, same keys).
    let (q2, w2) = (fq(&mut rng, &[t, h, D])?, weights(&mut rng, t, h)?);
    let wc = want.candidates.unwrap();
    let want2 = index_select(&q2, &w2, &cpu_src, k, Some(&wc), None)?;
    let gc = Candidates { block: wc.block, kept: wc.kept.to_device(&dev)? };
    let opts2 = SelectOptions { scratch_bytes: 2 * 3008 * 3 };
    let got2 = index_select_with_options(&q2.to_device(&dev)?, &w2.to_device(&dev)?, &gsrc, k, Some(&gc), None, &opts2)?;
    assert_ids_equal("consumer topk", &got2.topk, &want2.topk)?;
    ensure!(got2.candidates.is_none(), "a consumer publishes nothing");
    // Batched decode over packed keys: each query its own keys.
    let (b, nk) = (6, 700);
    let keys = fq(&mut rng, &[b * nk, D])?;
    let (cache, layout) = pack(&keys, 64, &dev)?;
    let (q, w) = (fq(&mut rng, &[b, h, D])?, weights(&mut rng, b, h)?);
    let bases: Vec<u32> = (0..b as u32).map(|i| i * nk as u32).collect();
    let counts: Vec<u32> = vec![700, 513, 512, 100, 1, 0];
    let (base_c, vis_c) = (Tensor::new(bases.as_slice(), &Device::Cpu)?, Tensor::new(counts.as_slice(), &Device::Cpu)?);
    let cpu = KeySource { keys: IndexKeys::Rows(&keys), base: Some(&base_c), pages: None, entries: nk, visibility: Visibility::Counts(&vis_c) };
    let want = index_select(&q, &w, &cpu, k, None, None)?;
    let (base_g, vis_g) = (base_c.to_device(&dev)?, vis_c.to_device(&dev)?);
    let gsrc = KeySource { keys: IndexKeys::Packed { cache: &cache, layout }, base: Some(&base_g), pages: None, entries: nk, visibility: Visibility::Counts(&vis_g) };
    poison(&dev, b * k)?;
    let got = index_select(&q.to_device(&dev)?, &w.to_device(&dev)?, &gsrc, k, None, None)?;
    assert_ids_equal("batched decode over packed keys", &got.topk, &want.topk)?;
    let g = ids(&got.topk)?;
    ensure!(g[3][..100] == (0..100).collect::<Vec<i64>>()[..] && g[3][100] == -1, "short context: every visible entry");
    Ok(())
}

/// `index_select` in batched decode: fresh random keys per query (one packed and one bf16
/// cache), visibility 0 / 1 / < k / = k / > k, a query whose rows end 352 entries into its 4000
/// visible ones (3648 −inf entries past the cache: the top-k must take 160 of
/// them, lowest ids first), and the same with a consumer's candidate mask that leaves fewer than
/// k finite scores (the rest of the top-k are masked −inf entries, lowest ids first).
#[test]
fn select_in_batched_decode_with_masks_and_short_rows() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(31);
    let (h, nk, k) = (32, 4000, 512);
    let counts: Vec<u32> = vec![4000, 3999, 513, 512, 100, 1, 0, 4000];
    let b = counts.len();
    let rows = (b - 1) * nk + 352; // whole pages of 64: the packed cache holds exactly these rows
    let keys = fq(&mut rng, &[rows, D])?;
    let (cache, layout) = pack(&keys, 64, &dev)?;
    let (q, w) = (fq(&mut rng, &[b, h, D])?, weights(&mut rng, b, h)?);
    let bases: Vec<u32> = (0..b as u32).map(|i| i * nk as u32).collect();
    let (base_c, vis_c) = (Tensor::new(bases.as_slice(), &Device::Cpu)?, Tensor::new(counts.as_slice(), &Device::Cpu)?);
    let (base_g, vis_g) = (base_c.to_device(&dev)?, vis_c.to_device(&dev)?);
    let cpu = KeySource { keys: IndexKeys::Rows(&keys), base: Some(&base_c), pages: None, entries: nk, visibility: Visibility::Counts(&vis_c) };
    let kg = keys.to_device(&dev)?;
    let packed = KeySource { keys: IndexKeys::Packed { cache: &cache, layout }, base: Some(&base_g), pages: None, entries: nk, visibility: Visibility::Counts(&vis_g) };
    let rows_src = KeySource { keys: IndexKeys::Rows(&kg), ..packed };
    // Consumer mask: 8 blocks of 16 entries per query (128 finite scores at most).
    let (block, n_keep) = (16usize, 8usize);
    let (c_cpu, c_gpu) = random_candidates(&mut rng, b, n_keep, nk / block, block, &dev)?;
    for (name, src) in [("packed", &packed), ("bf16 rows", &rows_src)] {
        let g = select_with_scratches(&dev, &format!("decode {name}"), &q, &w, &cpu, src, k, None, &[1 << 28, 2 * 4000 * 3])?;
        ensure!(g[6].iter().all(|&i| i == -1), "visible 0: all -1");
        ensure!(g[5][0] == 0 && g[5][1..].iter().all(|&i| i == -1), "visible 1: [0, -1, ..]");
        ensure!(g[4][..100] == (0..100).collect::<Vec<i64>>()[..] && g[4][100] == -1, "visible 100: all of them");
        // The last query: 352 finite scores, then −inf past the cache: 352..511 complete the top-k.
        ensure!(g[7] == (0..512).collect::<Vec<i64>>(), "past-cache query: its 352 finite entries, then the lowest -inf ids");
        let gm = select_with_scratches(&dev, &format!("decode {name} masked"), &q, &w, &cpu, src, k, Some((&c_cpu, &c_gpu)), &[1 << 28])?;
        ensure!(gm[0].len() == k && gm[0].iter().all(|&i| i >= 0), "masked: still k ids (masked -inf entries fill up)");
    }
    Ok(())
}

/// A decode batch of 70 queries over packed keys (the balanced scores kernel takes batches of 64
/// to 1024 queries): fresh random keys per query, visibility from 0 to N, a query whose rows end
/// inside its visible entries (past the cache: −inf),
/// scores bit-exact and top-k ids identical to the CPU.
#[test]
fn balanced_decode_batch_matches_the_cpu() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(34);
    let (b, h, nk, k) = (70usize, 32usize, 1500usize, 512usize);
    // The last query's rows end ~300 entries in; whole pages of 64, so the packed cache holds
    // exactly these rows.
    let rows = ((b - 1) * nk + 300).div_ceil(64) * 64;
    let inside = rows - (b - 1) * nk;
    let keys = fq(&mut rng, &[rows, D])?;
    let (cache, layout) = pack(&keys, 64, &dev)?;
    let (q, w) = (fq(&mut rng, &[b, h, D])?, weights(&mut rng, b, h)?);
    let bases: Vec<u32> = (0..b as u32).map(|i| i * nk as u32).collect();
    let counts: Vec<u32> = (0..b)
        .map(|i| match i {
            0 => 0,
            1 => 1,
            2 => 511,
            3 => 512,
            _ if i == b - 1 => nk as u32,
            _ => rng.below(nk + 1) as u32,
        })
        .collect();
    let (base_c, vis_c) = (Tensor::new(bases.as_slice(), &Device::Cpu)?, Tensor::new(counts.as_slice(), &Device::Cpu)?);
    let (base_g, vis_g) = (base_c.to_device(&dev)?, vis_c.to_device(&dev)?);
    let cpu = KeySource { keys: IndexKeys::Rows(&keys), base: Some(&base_c), pages: None, entries: nk, visibility: Visibility::Counts(&vis_c) };
    let gsrc = KeySource { keys: IndexKeys::Packed { cache: &cache, layout }, base: Some(&base_g), pages: None, entries: nk, visibility: Visibility::Counts(&vis_g) };
    let want = masked_index_scores(&q, &w, &cpu, None)?;
    poison(&dev, b * nk)?;
    let got = masked_index_scores(&q.to_device(&dev)?, &w.to_device(&dev)?, &gsrc, None)?;
    assert_scores_exact("balanced decode batch", &got, &want)?;
    let g = bits(&got)?;
    ensure!(g[(b - 1) * nk + inside..].iter().all(|&x| x == 0xff80), "past the cache: -inf");
    ensure!(g[(b - 1) * nk..(b - 1) * nk + inside].iter().all(|&x| x != 0xff80), "inside the cache: finite");
    let ids = select_with_scratches(&dev, "balanced decode batch", &q, &w, &cpu, &gsrc, k, None, &[1 << 28, 2 * 1504 * 9])?;
    ensure!(ids[0].iter().all(|&i| i == -1) && ids[1][0] == 0, "visible 0 / 1");
    Ok(())
}

/// A decode batch of `b` queries with their own `nk` keys each on [`integer_path_data`]: scores
/// bit-exact and top-k ids identical to the CPU.
fn decode_integer_path_case(seed: u64, b: usize, nk: usize, what: &str) -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(seed);
    let (h, k) = (32usize, 512usize);
    let (q, w, keys) = integer_path_data(&mut rng, b, h, b * nk)?;
    let (cache, layout) = pack(&keys, 64, &dev)?;
    let bases: Vec<u32> = (0..b as u32).map(|i| i * nk as u32).collect();
    let counts: Vec<u32> = (0..b).map(|_| (nk - rng.below(60)) as u32).collect();
    let (base_c, vis_c) = (Tensor::new(bases.as_slice(), &Device::Cpu)?, Tensor::new(counts.as_slice(), &Device::Cpu)?);
    let (base_g, vis_g) = (base_c.to_device(&dev)?, vis_c.to_device(&dev)?);
    let cpu = KeySource { keys: IndexKeys::Rows(&keys), base: Some(&base_c), pages: None, entries: nk, visibility: Visibility::Counts(&vis_c) };
    let gsrc = KeySource { keys: IndexKeys::Packed { cache: &cache, layout }, base: Some(&base_g), pages: None, entries: nk, visibility: Visibility::Counts(&vis_g) };
    let want = masked_index_scores(&q, &w, &cpu, None)?;
    let g = bits(&want)?;
    let finite = g.iter().filter(|&&x| x & 0x7f80 != 0x7f80 && x & 0x7fff != 0).count();
    ensure!(finite > b * (nk - 60) / 2, "{what}: the data must give mostly finite nonzero scores, got {finite}");
    poison(&dev, b * nk)?;
    let got = masked_index_scores(&q.to_device(&dev)?, &w.to_device(&dev)?, &gsrc, None)?;
    assert_scores_exact(what, &got, &want)?;
    select_with_scratches(&dev, what, &q, &w, &cpu, &gsrc, k, None, &[1 << 28])?;
    Ok(())
}

/// The balanced decode kernel's integer tensor-core path and its fallbacks (one batch of 66
/// queries, see [`integer_path_data`]).
#[test]
fn balanced_decode_integer_path_and_its_fallbacks_match_the_cpu() -> Result<()> {
    decode_integer_path_case(43, 66, 700, "balanced: integer path and fallbacks")
}

/// The (token, chunk) grid kernel (decode batches below 64 queries; the bf16 path, its integer
/// path was slower, docs/cuda.md "indexer_scores: tried and not kept") on the same data: 7 queries and 5 with longer
/// rows (every kind of token of [`integer_path_data`]).
#[test]
fn grid_decode_on_integer_path_data_matches_the_cpu() -> Result<()> {
    decode_integer_path_case(44, 7, 700, "grid B=7 on integer-path data")?;
    decode_integer_path_case(45, 5, 3000, "grid B=5 on integer-path data")
}

/// The prefill kernel (4 tokens per CTA sharing the keys: launches of >= 528 tokens without
/// per-query bases; the bf16 path) on [`integer_path_data`]: 530 tokens (a last CTA with 2), causal ratio 2,
/// H = 32 without a mask (the kernel compiled for it) and H = 7 with a consumer mask (its general
/// form); scores bit-exact.
#[test]
fn prefill_on_integer_path_data_matches_the_cpu() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(46);
    let (t, n, start) = (530usize, 650usize, 800usize);
    for &(h, masked) in &[(32usize, false), (7, true)] {
        let (q, w, keys) = integer_path_data(&mut rng, t, h, n)?;
        let (cache, layout) = pack(&keys, 64, &dev)?;
        let cpu = KeySource { entries: n, ..KeySource::sequence(IndexKeys::Rows(&keys), start, 2)? };
        let gsrc = KeySource { entries: n, ..KeySource::sequence(IndexKeys::Packed { cache: &cache, layout }, start, 2)? };
        let (block, n_keep) = (8usize, 40usize);
        let (c_cpu, c_gpu) = random_candidates(&mut rng, t, n_keep, n.div_ceil(block), block, &dev)?;
        let want = masked_index_scores(&q, &w, &cpu, masked.then_some(&c_cpu))?;
        let what = format!("prefill H{h} masked {masked}");
        let finite = bits(&want)?.iter().filter(|&&x| x & 0x7f80 != 0x7f80 && x & 0x7fff != 0).count();
        ensure!(finite > if masked { t * 100 } else { t * 400 / 2 }, "{what}: {finite} finite nonzero scores");
        poison(&dev, t * n)?;
        let got = masked_index_scores(&q.to_device(&dev)?, &w.to_device(&dev)?, &gsrc, masked.then_some(&c_gpu))?;
        assert_scores_exact(&what, &got, &want)?;
    }
    Ok(())
}

/// The balanced decode kernel (batches of 64+ queries) on the cases of the test above: H = 32 / 7 /
/// 2 (the kernel compiled for H = 32 without a mask, and its general form), rows scaled by
/// 2^-40..2^40 (scale bytes on both sides of 128: the warp-wide two-multiply path), page sizes
/// that are not powers of two, a query with nothing visible, and with H = 32 a consumer mask
/// (blocks of 8 entries) as well.
#[test]
fn balanced_decode_with_few_heads_wide_scales_and_masks() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(41);
    for &(h, page, n, masked) in &[(32usize, 20usize, 301usize, false), (32, 20, 301, true), (7, 12, 77, false), (2, 4, 45, false)] {
        let b = 66;
        let rows = b * n;
        let bases: Vec<u32> = (0..b as u32).map(|i| i * n as u32).collect();
        let counts: Vec<u32> = (0..b).map(|i| if i == 1 { 0 } else { (n - rng.below(40)) as u32 }).collect();
        let keys = WideScaledKeys::new(&mut rng, rows, page, &bases, &counts, &dev)?;
        let (q, w) = (fq(&mut rng, &[b, h, D])?, weights(&mut rng, b, h)?);
        let (block, n_keep) = (8usize, 12usize);
        let (c_cpu, c_gpu) = random_candidates(&mut rng, b, n_keep, n.div_ceil(block), block, &dev)?;
        let want = masked_index_scores(&q, &w, &keys.source(n, false), masked.then_some(&c_cpu))?;
        poison(&dev, b * n)?;
        let got = masked_index_scores(&q.to_device(&dev)?, &w.to_device(&dev)?, &keys.source(n, true), masked.then_some(&c_gpu))?;
        let what = format!("balanced H{h} page {page} N{n} masked {masked}");
        assert_scores_exact(&what, &got, &want)?;
        let g = bits(&got)?;
        ensure!(g[n..2 * n].iter().all(|&x| x == 0xff80), "{what}: visible 0 must give -inf");
        let finite = g.iter().filter(|&&x| x & 0x7f80 != 0x7f80).count();
        ensure!(finite > if masked { b } else { (b - 1) * (n - 40) }, "{what}: {finite} finite scores");
    }
    Ok(())
}

/// Ties at a bin edge: one head, q = e0 and w = 1, so a score is max(K[j, 0], 0) exactly; the keys
/// take the values 12, 6, 3 and 2.0 (the lowest value of its first-digit bin [2, 2.5): the
/// k-th largest key sits on the bin's lower edge) above 1.5, 1 and 0 (lower bins): 450 scores
/// above 2.0 and 300 ties at 2.0, of which the 62 lowest ids
/// complete the top 512. A second query sees a prefix (12 345 entries), a third has all keys equal
/// (every warp's candidate list overflows: the selection walks its row segment again).
#[test]
fn select_with_ties_at_a_bin_edge() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(32);
    let (n, k) = (20_000usize, 512usize);
    let mut first = vec![0f32; 2 * n];
    let mut plan: Vec<f32> = [(12.0, 100), (6.0, 150), (3.0, 200), (2.0, 300)]
        .iter()
        .flat_map(|&(v, c)| std::iter::repeat_n(v, c))
        .collect();
    plan.resize(n, 0.0);
    for (j, v) in plan.iter_mut().enumerate().skip(750) {
        *v = [1.5, 1.0, -1.0][j % 3];
    }
    for i in (1..n).rev() {
        plan.swap(i, rng.below(i + 1));
    }
    first[..n].copy_from_slice(&plan);
    first[n..].iter_mut().for_each(|v| *v = 2.0); // region 2: all equal
    let mut kv = vec![0f32; 2 * n * D];
    for (j, &v) in first.iter().enumerate() {
        kv[j * D] = v;
    }
    let keys = Tensor::from_vec(kv, (2 * n, D), &Device::Cpu)?.to_dtype(DType::BF16)?;
    let (cache, layout) = pack(&keys, 64, &dev)?;
    let cache_cpu = cache.to_device(&Device::Cpu)?;
    let mut qv = vec![0f32; 3 * D];
    for t in 0..3 {
        qv[t * D] = 1.0;
    }
    let q = Tensor::from_vec(qv, (3, 1, D), &Device::Cpu)?.to_dtype(DType::BF16)?;
    let w = Tensor::ones((3, 1), DType::F32, &Device::Cpu)?;
    let bases = [0u32, 0, n as u32];
    let counts = [n as u32, 12_345, n as u32];
    let (base_c, vis_c) = (Tensor::new(&bases[..], &Device::Cpu)?, Tensor::new(&counts[..], &Device::Cpu)?);
    let (base_g, vis_g) = (base_c.to_device(&dev)?, vis_c.to_device(&dev)?);
    let cpu = KeySource { keys: IndexKeys::Packed { cache: &cache_cpu, layout }, base: Some(&base_c), pages: None, entries: n, visibility: Visibility::Counts(&vis_c) };
    let gsrc = KeySource { keys: IndexKeys::Packed { cache: &cache, layout }, base: Some(&base_g), pages: None, entries: n, visibility: Visibility::Counts(&vis_g) };
    // The data are what the test claims: exact scores, 62 of 300 ties at 2.0 taken.
    let s = masked_index_scores(&q, &w, &cpu, None)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    ensure!(s[0].iter().zip(&plan).all(|(&a, &v)| a == v.max(0.0)), "scores are max(K[j, 0], 0)");
    let g = select_with_scratches(&dev, "ties at a bin edge", &q, &w, &cpu, &gsrc, k, None, &[1 << 28])?;
    let twos: Vec<i64> = (0..n).filter(|&j| plan[j] == 2.0).map(|j| j as i64).collect();
    let taken: Vec<i64> = g[0].iter().copied().filter(|&j| plan[j as usize] == 2.0).collect();
    ensure!(taken[..] == twos[..62], "ties at 2.0: the 62 lowest ids, got {} of them", taken.len());
    ensure!(g[2] == (0..k as i64).collect::<Vec<_>>(), "all equal: ids 0..k");
    // Bf16 rows of the same keys score identically.
    let kg = keys.to_device(&dev)?;
    let rows_src = KeySource { keys: IndexKeys::Rows(&kg), ..gsrc };
    select_with_scratches(&dev, "ties at a bin edge, bf16 rows", &q, &w, &cpu, &rows_src, k, None, &[1 << 28])?;
    Ok(())
}

/// `index_select` in a prefill over one sequence's shared keys: 600 queries (the 4-tokens-
/// per-CTA kernel) with causal visibility from 500 to 799 entries around k = 512 (−1 padding
/// below), and the same in chunks of 128 queries (one token per CTA).
#[test]
fn select_in_a_causal_prefill() -> Result<()> {
    let mut rng = Rng(33);
    let dev = gpu();
    let (t, h, n, k) = (600usize, 32usize, 1100usize, 512usize);
    let (q, w, keys) = (fq(&mut rng, &[t, h, D])?, weights(&mut rng, t, h)?, fq(&mut rng, &[n, D])?);
    let start = 999;
    let cpu = KeySource::sequence(IndexKeys::Rows(&keys), start, 2)?;
    let (cache, layout) = pack(&keys, 64, &dev)?;
    let gsrc = KeySource::sequence(IndexKeys::Packed { cache: &cache, layout }, start, 2)?;
    let gsrc = KeySource { entries: n, ..gsrc };
    let stride = n.div_ceil(8) * 8;
    let g = select_with_scratches(&dev, "causal prefill", &q, &w, &cpu, &gsrc, k, None, &[1 << 28, 2 * stride * 128])?;
    ensure!(g[0][..500] == (0..500).collect::<Vec<i64>>()[..] && g[0][500] == -1, "500 visible: all, then -1");
    Ok(())
}

/// Rows of the one-read top-k kernel (`kernels/indexer_topk.cu`, rows of at most 64K entries):
/// kinds of rows x visible lengths x k, `index_topk` on the GPU against the CPU. Kinds: normal
/// scores (bf16: many ties), a handful of values, all equal (the candidate list overflows: the
/// exact fallback), −inf stretches, a row whose sample sees 100 values of 4.0 at the sampled
/// groups' first entries (sampled threshold above the k-th key: fewer than k candidates, the
/// fallback again), descending scores (every entry of the first k ids a candidate), zeros of both
/// signs around the k-th key (a threshold of +0: −0 passes the bf16 compare and must be dropped)
/// and positive NaNs (ordered as `f32::total_cmp`: first; they pass the compare as unordered).
/// Lengths:
/// 64K, 64K − 1 (a partial 8-entry group), 4096 (the sample is the whole row), 4097, 40 000 and
/// 600 (not a multiple of 32), k + 1, k and below; k = 512, 1, 2048 (the kernel's largest) and
/// 2049 (the general kernel).
#[test]
fn one_read_topk_kernel_on_64k_rows_matches_the_reference() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(41);
    let n = 65_536usize;
    let kinds = 8;
    let mut v = Vec::with_capacity(kinds * n);
    for kind in 0..kinds {
        for j in 0..n {
            let x = match kind {
                0 => rng.normal(),
                1 => [0.25, -0.5, 1.0, 3.0][rng.below(4)],
                2 => 1.5,
                3 => {
                    if (j / 1000) % 2 == 0 {
                        f32::NEG_INFINITY
                    } else {
                        0.01 * rng.normal()
                    }
                }
                // Sampled groups of a 64K row: 8 * (x * 8192 / 512) = 128 x.
                4 => {
                    if j % 128 == 0 && j / 128 < 100 {
                        4.0
                    } else {
                        0.1 * rng.normal()
                    }
                }
                5 => 1000.0 - j as f32 * 0.01,
                // ~0.5 % positive, ~1.8 % each +0 and −0, the rest negative: a sampled threshold
                // of exactly +0, whose bf16 compare also passes the −0 entries (false positives).
                6 => match rng.below(1000) {
                    0..=4 => rng.normal().abs() + 0.5,
                    5..=22 => 0.0,
                    23..=40 => -0.0,
                    _ => -(rng.normal().abs() + 0.5),
                },
                // Positive NaNs (above +inf in the total order: in the top k). Negative NaNs are
                // left out: the reference masks invisible entries with −inf, which `total_cmp`
                // ranks above a negative NaN, so it pads with −1 where the kernels (this one and
                // indexer_select.cu's) take the visible negative NaNs (seen on the GPU).
                _ => match rng.below(1000) {
                    0..=9 => f32::NAN,
                    _ => rng.normal(),
                },
            };
            v.push(bf16::from_f32(x));
        }
    }
    let scores = Tensor::from_vec(v, (kinds, n), &Device::Cpu)?;
    let sg = scores.to_device(&dev)?;
    for &k in &[512usize, 1, 2048, 2049] {
        for &len in &[n, n - 1, 4096, 4097, 40_000, 600, k + 1, k, k.saturating_sub(7).max(1)] {
            let counts = vec![len as u32; kinds];
            let vis_c = Tensor::new(counts.as_slice(), &Device::Cpu)?;
            let want = index_topk(&scores, &Visibility::Counts(&vis_c), k)?;
            poison(&dev, kinds * k)?;
            let got = index_topk(&sg, &Visibility::Counts(&vis_c.to_device(&dev)?), k)?;
            assert_ids_equal(&format!("one-read top-k L{len} k{k}"), &got, &want)?;
            if len > k {
                let g = ids(&got)?;
                ensure!(g[2] == (0..k as i64).collect::<Vec<_>>(), "all equal: ids 0..k");
                ensure!(g[5] == (0..k as i64).collect::<Vec<_>>(), "descending: ids 0..k");
            }
        }
    }
    // A batch of mixed lengths and the causal rule (rows of 1 .. 64K entries).
    let causal = Visibility::Causal { start: n - kinds, ratio: 1 };
    assert_ids_equal("one-read top-k causal", &index_topk(&sg, &causal, 512)?, &index_topk(&scores, &causal, 512)?)?;
    Ok(())
}

/// `index_select` on 64K keys per query (the decode shape of a 128K context; the one-read top-k
/// with a sampled threshold) against the CPU: bf16 rows shared by the queries, visible 64K,
/// 64K − 1, 4097 and 40 000, and a query with zero head weights (every score 0: all equal, the
/// candidate list overflows).
#[test]
fn select_on_64k_keys_matches_the_cpu() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(42);
    let (h, n, k) = (4usize, 65_536usize, 512usize);
    let counts = [n as u32, n as u32 - 1, 4097, 40_000, n as u32];
    let b = counts.len();
    let keys = fq(&mut rng, &[n, D])?;
    let q = fq(&mut rng, &[b, h, D])?;
    let mut wv = weights(&mut rng, b, h)?.to_vec2::<f32>()?;
    wv[b - 1].iter_mut().for_each(|x| *x = 0.0);
    let w = Tensor::new(wv, &Device::Cpu)?;
    let bases = vec![0u32; b];
    let (base_c, vis_c) = (Tensor::new(bases.as_slice(), &Device::Cpu)?, Tensor::new(&counts[..], &Device::Cpu)?);
    let (base_g, vis_g) = (base_c.to_device(&dev)?, vis_c.to_device(&dev)?);
    let cpu = KeySource { keys: IndexKeys::Rows(&keys), base: Some(&base_c), pages: None, entries: n, visibility: Visibility::Counts(&vis_c) };
    let kg = keys.to_device(&dev)?;
    let gsrc = KeySource { keys: IndexKeys::Rows(&kg), base: Some(&base_g), pages: None, entries: n, visibility: Visibility::Counts(&vis_g) };
    let g = select_with_scratches(&dev, "64K keys", &q, &w, &cpu, &gsrc, k, None, &[1 << 28])?;
    ensure!(g[b - 1] == (0..k as i64).collect::<Vec<_>>(), "zero weights: all scores 0, ids 0..k");
    Ok(())
}

#[test]
fn bad_inputs_are_refused_with_clear_errors() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(18);
    let (q, w) = (fq(&mut rng, &[2, 33, D])?.to_device(&dev)?, weights(&mut rng, 2, 33)?.to_device(&dev)?);
    let keys = fq(&mut rng, &[10, D])?.to_device(&dev)?;
    let err = index_select(&q, &w, &KeySource::sequence(IndexKeys::Rows(&keys), 0, 1)?, 4, None, None).unwrap_err();
    ensure!(err.to_string().contains("index heads"), "{err}");
    let q = q.narrow(1, 0, 32)?;
    let w = w.narrow(1, 0, 32)?;
    let src = KeySource { keys: IndexKeys::Rows(&keys), base: None, pages: None, entries: 11, visibility: Visibility::Causal { start: 0, ratio: 1 } };
    let err = index_select(&q, &w, &src, 4, None, None).unwrap_err();
    ensure!(err.to_string().contains("11 entries"), "{err}");
    Ok(())
}

/// Keys through a page table (the batched decode step's paged pools): each query's entries in
/// pages of 64 slots listed in a shuffled order (pages shared between queries, −1 past those a
/// query holds), for packed and bf16 keys, in the grid decode kernel (T = 5) and the balanced one
/// (T = 80): the scores equal the CPU path's (which gathers the same rows) bit for bit, the GPU's
/// packed and bf16 scores are identical, and `index_select`'s top-k equals the CPU's. A negative
/// control: the same keys through the identity table score differently.
#[test]
fn paged_keys_score_and_select_like_the_cpu() -> Result<()> {
    use deepseek_v41::cuda::KeyPages;
    let dev = gpu();
    let mut rng = Rng(61);
    let (h, page, pages, max_pages, k) = (32usize, 64usize, 13usize, 4usize, 96usize);
    let n = max_pages * page;
    let keys = fq(&mut rng, &[pages * page, D])?;
    let (cache, layout) = pack(&keys, page, &dev)?;
    let kg = keys.to_device(&dev)?;
    for t in [5usize, 80] {
        // Query i holds 1..=4 pages (page ids drawn at random, repeats allowed), visible counts
        // from 0 to all of them (entries of the last page partly visible).
        let mut table = vec![-1i64; t * max_pages];
        let mut counts = Vec::with_capacity(t);
        for i in 0..t {
            let held = 1 + rng.below(max_pages);
            for p in 0..held {
                table[i * max_pages + p] = rng.below(pages) as i64;
            }
            counts.push(match i {
                0 => 0,
                1 => (held * page) as u32,
                _ => rng.below(held * page + 1) as u32,
            });
        }
        let (q, w) = (fq(&mut rng, &[t, h, D])?, weights(&mut rng, t, h)?);
        let table_c = Tensor::from_vec(table, (t, max_pages), &Device::Cpu)?;
        let (vis_c, table_g) = (Tensor::new(counts.as_slice(), &Device::Cpu)?, table_c.to_device(&dev)?);
        let vis_g = vis_c.to_device(&dev)?;
        let paged = |table| Some(KeyPages { table, page_size: page });
        let cpu = KeySource { keys: IndexKeys::Rows(&keys), base: None, pages: paged(&table_c), entries: n, visibility: Visibility::Counts(&vis_c) };
        let packed = KeySource { keys: IndexKeys::Packed { cache: &cache, layout }, base: None, pages: paged(&table_g), entries: n, visibility: Visibility::Counts(&vis_g) };
        let rows = KeySource { keys: IndexKeys::Rows(&kg), ..packed };
        let what = format!("paged keys, T = {t}");
        let want = masked_index_scores(&q, &w, &cpu, None)?;
        let (qg, wg) = (q.to_device(&dev)?, w.to_device(&dev)?);
        poison(&dev, t * n)?;
        let got = masked_index_scores(&qg, &wg, &packed, None)?;
        assert_scores_exact(&what, &got, &want)?;
        ensure!(bits(&masked_index_scores(&qg, &wg, &rows, None)?)? == bits(&got)?, "{what}: packed and bf16 keys must score identically");
        let finite = bits(&want)?.iter().filter(|&&b| b != 0xff80).count();
        ensure!(finite > t * page / 2, "{what}: only {finite} visible scores");
        // Negative control: the identity table (rows 0..n) gives other scores.
        let identity = Tensor::from_vec((0..(t * max_pages) as i64).map(|i| i % max_pages as i64).collect::<Vec<_>>(), (t, max_pages), &dev)?;
        let plain = masked_index_scores(&qg, &wg, &KeySource { pages: paged(&identity), ..packed }, None)?;
        ensure!(bits(&plain)? != bits(&got)?, "{what}: the page table changed nothing");
        let ids = select_with_scratches(&dev, &what, &q, &w, &cpu, &packed, k, None, &[1 << 28])?;
        ensure!(ids[0].iter().all(|&i| i == -1), "{what}: visible 0");
        let want_sel = index_select(&q, &w, &cpu, k, None, None)?;
        assert_ids_equal(&format!("{what}, bf16 keys"), &index_select(&qg, &wg, &rows, k, None, None)?.topk, &want_sel.topk)?;
    }
    Ok(())
}
