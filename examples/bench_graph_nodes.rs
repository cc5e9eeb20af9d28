//! What one node of a replayed CUDA graph costs, by kind: the measurement behind the decode
//! step's node budget (`docs/perf.md` "The whole-model step captured": a step of ~700 kernels
//! and ~1,500 stream-ordered allocations and frees).
//!
//! ```text
//! cargo build --release --features cuda --example bench_graph_nodes
//! bench_graph_nodes [--ops 512] [--elems 256] [--reps 9]
//! ```
//!
//! Each row captures `--ops` operations back to back on candle's stream into one graph and
//! replays it; the figure is the median µs per operation (graph time / ops), and the same
//! operations launched eagerly for comparison.
//!
//! | row | one operation |
//! |---|---|
//! | kernel in place | candle's `affine_f32` kernel over `--elems` floats, input = output (one kernel node) |
//! | candle op | `Tensor::affine` on the previous result: a kernel, the allocation of its output and the free of its input (three nodes) |
//! | alloc + free | an allocation of `--elems` floats dropped at once (two nodes, no kernel) |
//! | copy | a device-to-device copy of `--elems` floats (one memcpy node) |

use anyhow::Result;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::kernels;
use candle_core::{DType, Tensor};
use clap::Parser;

#[path = "support/bench.rs"]
mod bench;

#[derive(Parser)]
#[command(about = "Cost of one CUDA graph node by kind (kernel, allocation, free, copy)")]
struct Args {
    /// Operations per graph.
    #[arg(long, default_value_t = 512)]
    ops: usize,
    /// f32 elements each operation touches.
    #[arg(long, default_value_t = 256)]
    elems: usize,
    #[command(flatten)]
    bench: bench::BenchArgs,
}

fn main() -> Result<()> {
    let args: Args = bench::parse_args(&[("rep_ms", "5")]);
    anyhow::ensure!(args.ops >= 1 && args.elems >= 1, "--ops and --elems must be at least 1");
    let (dev, stream) = bench::cuda_device("bench_graph_nodes")?;
    let timer = args.bench.timer(stream.clone());
    let cdev = dev.as_cuda_device()?;
    let (ops, n) = (args.ops, args.elems);

    let buf = stream.alloc_zeros::<f32>(n)?;
    let mut dst = stream.alloc_zeros::<f32>(n)?;
    // The kernel's input and output: one raw pointer (no per-launch guard or event).
    let buf_ptr: u64 = {
        let (p, _guard) = buf.device_ptr(&stream);
        p
    };
    let affine = cdev.get_or_load_func("affine_f32", &kernels::AFFINE)?;
    let cfg = LaunchConfig::for_num_elems(n as u32);
    let mut kernel_in_place = || -> Result<()> {
        for _ in 0..ops {
            let (numel, dims, mul, add) = (n, 1usize, 1.0f32, 0.0f32);
            let info: u64 = 0; // contiguous: no dims / strides array
            let mut b = stream.launch_builder(&affine);
            b.arg(&numel).arg(&dims).arg(&info);
            b.arg(&buf_ptr).arg(&buf_ptr).arg(&mul).arg(&add);
            // SAFETY: affine_f32(numel, num_dims, info, inp, out, mul, add) over n floats; a null
            // info means contiguous; in place is elementwise-safe.
            unsafe { b.launch(cfg) }?;
        }
        Ok(())
    };
    let x0 = Tensor::ones(n, DType::F32, &dev)?;
    let mut candle_op = || -> Result<()> {
        let mut x = x0.clone();
        for _ in 0..ops {
            x = x.affine(1.0, 0.0)?;
        }
        Ok(())
    };
    let mut alloc_free = || -> Result<()> {
        for _ in 0..ops {
            // SAFETY: never read.
            let s = unsafe { stream.alloc::<f32>(n) }?;
            drop(s);
        }
        Ok(())
    };
    let mut copy = || -> Result<()> {
        for _ in 0..ops {
            stream.memcpy_dtod(&buf, &mut dst)?;
        }
        Ok(())
    };

    println!("{ops} operations per graph, {n} f32 elements each; µs per operation (median of {} reps)", args.bench.reps);
    println!("| operation | graph replay | eager |");
    println!("|---|---|---|");
    let rows: [(&str, &mut dyn FnMut() -> Result<()>); 4] = [
        ("kernel in place", &mut kernel_in_place),
        ("candle op (kernel + alloc + free)", &mut candle_op),
        ("alloc + free", &mut alloc_free),
        ("copy", &mut copy),
    ];
    for (name, f) in rows {
        let graph = timer.graph(1, &mut *f)? * 1e3 / ops as f64;
        let eager = timer.calls(&mut *f)? * 1e3 / ops as f64;
        println!("| {name} | {graph:.3} | {eager:.3} |");
    }
    Ok(())
}
