//! The embedded model's greedy acceptance (`tests/support/greedy.rs`) on CUDA, with the decode
//! device `generate --device cuda` uses: the same criterion as on the CPU.
//!
//! This test needs a CUDA device and FAILS without one.
//! Build: `cargo test --release --features cuda --test cuda_greedy`.

#[path = "support/greedy.rs"]
mod greedy;

#[test]
fn greedy_continuations_on_cuda_match_the_reference_up_to_its_near_ties() -> anyhow::Result<()> {
    let dev = deepseek_v41::cuda::decode_device(0)?;
    for line in greedy::run(&dev)? {
        println!("{line}");
    }
    Ok(())
}

/// The same with the MoE on the device: the routing kernel and the grouped expert kernels
/// (`cuda::with_device_routing`; no host read in a layer's MoE).
#[test]
fn greedy_continuations_with_the_moe_on_the_device() -> anyhow::Result<()> {
    let dev = deepseek_v41::cuda::decode_device(0)?;
    for line in deepseek_v41::cuda::with_device_routing(|| greedy::run(&dev))? {
        println!("{line}");
    }
    Ok(())
}
