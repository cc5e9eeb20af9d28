//! GPU test of `kernels/engram_next.cu` (`cuda::engram_next_device`, the inputs of a decode step
//! that follows the last one on the device) against its CPU reference
//! `model::engram_next::next_ids_ref`, bit for bit: random token maps, hash tables (odd
//! multipliers up to 2^46, bucket sizes up to 2^31, offsets), histories and sampled ids (some
//! past the map, which both read as its last entry), the id buffer poisoned with random values
//! (rows past n must keep them); n = 1, part of the batch and all of it; orders 2..=4 with 1 to 8
//! heads; no Engram layer (tokens only); no row; a geometry past 1024 outputs per row is an error.
//!
//! This test needs a CUDA device and FAILS without one.
//! Build: `cargo test --release --features cuda --test cuda_engram_next`.

use anyhow::{ensure, Result};
use candle_core::{Device, Tensor};
use deepseek_v41::model::engram_next::{next_ids_ref, NextIdsGeometry};

#[path = "support/rng.rs"]
#[allow(dead_code)]
mod rng;
use rng::Rng;

fn gpu() -> Device {
    deepseek_v41::cuda::decode_device(0).expect("tests/cuda_engram_next.rs needs a CUDA device (none found): this test must run on a GPU")
}

fn below(rng: &mut Rng, n: u64) -> u64 {
    rng.next_u64() % n
}

/// One case: the kernel's buffer equals the reference's, poison kept past n.
fn case(rng: &mut Rng, dev: &Device, g: NextIdsGeometry, n: usize, vocab: usize) -> Result<()> {
    let map: Vec<u32> = (0..vocab).map(|_| below(rng, 1 << 20) as u32).collect();
    let mut tables = Vec::new();
    for _ in 0..g.layers {
        tables.extend((0..g.ngram).map(|_| (below(rng, 1 << 45) * 2 + 1) as i64));
        tables.extend((0..g.cols).map(|_| (below(rng, (1 << 31) - 3) + 2) as i64));
        tables.extend((0..g.cols).map(|_| below(rng, 1 << 31) as i64));
    }
    let sampled: Vec<u32> = (0..n).map(|_| if below(rng, 8) == 0 { vocab as u32 + below(rng, 9) as u32 } else { below(rng, vocab as u64) as u32 }).collect();
    let poison: Vec<u32> = (0..g.len()).map(|_| rng.next_u64() as u32).collect();
    let mut want = poison.clone();
    next_ids_ref(&mut want, &sampled, &map, &tables, g);
    let buf = Tensor::new(poison.as_slice(), dev)?;
    let (s, m, t) = (Tensor::new(sampled.as_slice(), dev)?, Tensor::new(map.as_slice(), dev)?, Tensor::new(tables.as_slice(), dev)?);
    deepseek_v41::cuda::engram_next_device(&buf, &s, &m, &t, g)?;
    let got = buf.to_vec1::<u32>()?;
    let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
    ensure!(bad == 0, "{g:?}, n {n}: {bad} of {} values differ from the reference", want.len());
    // Twice more: the history moves on, the reference follows.
    for _ in 0..2 {
        next_ids_ref(&mut want, &sampled, &map, &tables, g);
        deepseek_v41::cuda::engram_next_device(&buf, &s, &m, &t, g)?;
    }
    ensure!(buf.to_vec1::<u32>()? == want, "{g:?}, n {n}: after three steps");
    Ok(())
}

#[test]
fn kernel_equals_the_reference() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0xe6a7);
    for (ngram, heads, layers, batch) in [(3, 8, 2, 7), (4, 8, 2, 64), (2, 1, 1, 3), (4, 3, 3, 5), (3, 8, 2, 1)] {
        let g = NextIdsGeometry { batch, layers, cols: (ngram - 1) * heads, ngram, heads };
        for n in [1, batch.div_ceil(2), batch] {
            case(&mut rng, &dev, g, n, 1000)?;
        }
    }
    // No Engram: only the tokens.
    let g = NextIdsGeometry { batch: 6, layers: 0, cols: 0, ngram: 1, heads: 0 };
    case(&mut rng, &dev, g, 4, 10)?;
    // No row: nothing written.
    let g = NextIdsGeometry { batch: 4, layers: 2, cols: 16, ngram: 3, heads: 8 };
    let buf = Tensor::new(&[7u32; 4 + 2 * 4 * 16 + 4 * 2], &dev)?;
    let empty = Tensor::new(&[0u32; 0], &dev)?;
    deepseek_v41::cuda::engram_next_device(&buf, &empty, &Tensor::new(&[1u32], &dev)?, &Tensor::new(&[1i64; 2 * 35], &dev)?, g)?;
    ensure!(buf.to_vec1::<u32>()?.iter().all(|&v| v == 7), "no row: the buffer changed");
    // Too many outputs per row for one CTA.
    let g = NextIdsGeometry { batch: 1, layers: 3, cols: 400, ngram: 5, heads: 100 };
    let buf = Tensor::new(vec![0u32; g.len()].as_slice(), &dev)?;
    let tab = Tensor::new(vec![3i64; 3 * g.table_width()].as_slice(), &dev)?;
    let e = deepseek_v41::cuda::engram_next_device(&buf, &Tensor::new(&[1u32], &dev)?, &Tensor::new(&[1u32], &dev)?, &tab, g);
    ensure!(e.is_err(), "1200 outputs per row were accepted");
    Ok(())
}
