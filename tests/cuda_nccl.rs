//! The NCCL collective (`parallel::NcclRank`, feature `nccl`) on the GPUs of this machine: rows
//! and bytes reach every rank by source (one GPU: a group of one, every message to itself), and
//! at one rank an expert-parallel MoE layer and the whole embedded model over NCCL equal the same
//! over the in-process group bit for bit.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use candle_core::cuda_backend::cudarc::driver::CudaContext;
use candle_core::{DType, Device, Tensor};
use half::bf16;
use deepseek_v41::loader::{var_builder, QuantizedWeights, ReleaseCheckpoint};
use deepseek_v41::model::Pretrained;
use deepseek_v41::nn::RowGroups;
use deepseek_v41::parallel::{run_ranks, Collective, ExpertPlacement, LocalGroup, NcclRank, ShardedMoe};
use deepseek_v41::{Config, Numerics};

fn gpus() -> Result<Vec<Device>> {
    let n = CudaContext::device_count().context("tests/cuda_nccl.rs needs CUDA devices: these tests must run on a GPU")? as usize;
    ensure!(n >= 1, "no CUDA device");
    Ok((0..n).map(Device::new_cuda).collect::<candle_core::Result<_>>()?)
}

fn bits(t: &Tensor) -> Result<Vec<u16>> {
    Ok(t.to_dtype(DType::BF16)?.flatten_all()?.to_vec1::<half::bf16>()?.iter().map(|v| v.to_bits()).collect())
}

/// Rank r sends rank d `(r + d) % 3` rows of 64 values and `r + d` bytes (some messages empty);
/// every rank gets them by source, values and shapes intact, over several calls.
#[test]
fn rows_and_bytes_reach_every_rank() -> Result<()> {
    let devices = gpus()?;
    let world = devices.len();
    let group: Vec<Arc<NcclRank>> = NcclRank::group(&devices)?.into_iter().map(Arc::new).collect();
    let got = run_ranks(group, |c| {
        let dev = &devices[c.rank()];
        let mut seen = Vec::new();
        for call in 0..3usize {
            let rows = (0..world)
                .map(|d| {
                    let n = (c.rank() + d + call) % 3;
                    // Built as bf16 on the host: a cast of zero rows would launch an empty grid.
                    let v: Vec<bf16> = (0..n * 64).map(|i| bf16::from_f32(((c.rank() * 7 + d * 3 + call + i) % 251) as f32)).collect();
                    Tensor::from_vec(v, (n, 64), dev)
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            let bytes = (0..world).map(|d| vec![(c.rank() * 16 + d) as u8; c.rank() + d + call]).collect();
            seen.push((c.all_to_all_rows(rows, 64, dev)?, c.all_to_all(bytes)?));
        }
        Ok(seen)
    })?;
    for (r, calls) in got.iter().enumerate() {
        for (call, (rows, bytes)) in calls.iter().enumerate() {
            for s in 0..world {
                let n = (s + r + call) % 3;
                ensure!(rows[s].dims() == [n, 64], "rank {r} call {call} from {s}: rows {:?}", rows[s].dims());
                if n > 0 {
                    let want: Vec<f32> = (0..n * 64).map(|i| ((s * 7 + r * 3 + call + i) % 251) as f32).collect();
                    ensure!(rows[s].to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()? == want, "rank {r} call {call} from {s}: row values");
                }
                ensure!(bytes[s] == vec![(s * 16 + r) as u8; s + r + call], "rank {r} call {call} from {s}: bytes");
            }
        }
    }
    Ok(())
}

/// At one rank: a MoE layer of the tiny reference model over NCCL equals it over the in-process
/// group bit for bit, and so does the embedded model's forward (prefill and a decode step).
#[test]
fn one_rank_over_nccl_equals_the_local_group() -> Result<()> {
    let dev = Device::new_cuda(0)?;
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/v41-tiny");
    let cfg = Config::from_file(fixtures.join("prefill_full").join("config.json"))?;
    let vb = var_builder(ReleaseCheckpoint::open(&[fixtures.join("model.safetensors")])?, DType::BF16, &dev);
    let g = candle_core::safetensors::load(fixtures.join("prefill_full").join("golden.safetensors"), &dev)?;
    let x = g.get("L0.ffn_in").context("L0.ffn_in")?.to_dtype(DType::BF16)?;
    let groups = RowGroups::whole(x.dim(0)?);
    let moe = ShardedMoe::new(&cfg, Numerics::REFERENCE, vb.pp("layers").pp(0).pp("ffn"), ExpertPlacement::single(cfg.n_routed_experts))?;
    let local = moe.forward(&x, &groups, &LocalGroup::ranks(1).pop().context("one rank")?)?;
    let nccl = NcclRank::group(std::slice::from_ref(&dev))?.pop().context("one rank")?;
    ensure!(bits(&moe.forward(&x, &groups, &nccl)?)? == bits(&local)?, "the MoE layer over NCCL differs from the local group");

    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/v41-shakespeare-tiny");
    let single = Pretrained::load_dir(&dir, Numerics::REFERENCE, DType::BF16, &Device::Cpu)?;
    let ids = single.tokenizer.encode("KING RICHARD III: Now is the winter of our discontent", true)?;
    let logits = |comm: Arc<dyn Collective>| -> Result<Vec<Vec<u16>>> {
        let ckpt = ReleaseCheckpoint::open_dir(&dir)?;
        let p = Pretrained::load_rank(single.config.clone(), single.tokenizer.clone(), ckpt, Numerics::REFERENCE, DType::BF16, &dev, QuantizedWeights::default(), comm)?;
        let mut cache = p.new_cache()?;
        let mut out = vec![bits(&p.model.forward(&ids[..ids.len() - 1], &mut cache)?)?];
        out.push(bits(&p.model.forward(&ids[ids.len() - 1..], &mut cache)?)?);
        p.model.serve_until_done()?;
        Ok(out)
    };
    let want = logits(Arc::new(LocalGroup::ranks(1).pop().context("one rank")?))?;
    let got = logits(Arc::new(NcclRank::group(std::slice::from_ref(&dev))?.pop().context("one rank")?))?;
    ensure!(got == want, "the embedded model over NCCL differs from the local group");
    Ok(())
}
