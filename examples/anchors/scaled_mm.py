"""Torch anchors of examples/bench_fp8_linear.rs (issue 21): cuBLASLt FP8 GEMMs
(`torch._scaled_mm`, e4m3 x e4m3 -> bf16, row-wise and tensor-wise f32 scales) and the bf16
`torch.mm`, at the same V4.1-Flash shapes and m, timed the same way: each call graph-captured over
enough weight copies to exceed 4x the L2 cache (weights from HBM, activations hot), replayed,
CUDA events, median of the repetitions.

    /opt/torch/.venv/bin/python examples/anchors/scaled_mm.py [--m 1,16,64,256,4096] [--reps 9]

cuBLASLt's FP8 GEMM needs m to be a multiple of 16: smaller m run padded to 16 (noted).
"""
import argparse
import math

import torch

SHAPES = [("wq_a", 5120, 1280), ("wq_b", 1280, 32768), ("wo_b", 8192, 5120), ("w13", 5120, 2304), ("w2", 2304, 5120)]
HBM_GBPS = 4260.0


def rotation_sets(nbytes, l2, max_sets=8):
    return max(1, min(max_sets, math.ceil(4 * l2 / max(nbytes, 1))))


def timed(fn, sets, reps, rep_ms=10.0):
    """Median ms per call of fn(s) for s in 0..sets, graph-replayed."""
    for s in range(sets):
        fn(s)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for s in range(sets):
            fn(s)  # warm-up on the capture stream
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=stream):
            for s in range(sets):
                fn(s)
    torch.cuda.synchronize()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.record()
    g.replay()
    en.record()
    torch.cuda.synchronize()
    iters = max(2, min(2000, int(rep_ms / max(st.elapsed_time(en), 1e-4))))
    samples = []
    for _ in range(reps):
        st.record()
        for _ in range(iters):
            g.replay()
        en.record()
        torch.cuda.synchronize()
        samples.append(st.elapsed_time(en) / iters / sets)
    samples.sort()
    return samples[len(samples) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,16,64,256,4096")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    args = ap.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(0)
    l2 = props.L2_cache_size
    print(f"torch {torch.__version__}, {props.name}, L2 {l2 >> 20} MB")
    print("\n| shape | m | anchor | us | weight GB/s | % of HBM | TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    f8 = torch.float8_e4m3fn
    for name, k, n in SHAPES:
        if name not in args.shapes.split(","):
            continue
        sets8 = rotation_sets(n * k, l2)
        sets16 = rotation_sets(2 * n * k, l2)
        w8 = [(torch.randn(n, k, device=dev) * 4).to(f8) for _ in range(sets8)]
        w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(sets16)]
        sb_row = torch.rand(1, n, device=dev, dtype=torch.float32) + 0.5
        sb_t = torch.tensor(0.75, device=dev, dtype=torch.float32)
        for m in ms:
            mp = max(16, (m + 15) // 16 * 16)
            note = "" if mp == m else f" (m padded to {mp})"
            x8 = (torch.randn(mp, k, device=dev) * 4).to(f8)
            x16 = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            sa_row = torch.rand(mp, 1, device=dev, dtype=torch.float32) + 0.5
            sa_t = torch.tensor(1.25, device=dev, dtype=torch.float32)
            flops = 2.0 * m * n * k
            rows = []
            try:
                t = timed(lambda s: torch._scaled_mm(x8, w8[s].t(), scale_a=sa_row, scale_b=sb_row, out_dtype=torch.bfloat16), sets8, args.reps)
                rows.append(("FP8 _scaled_mm row-wise" + note, t, n * k))
            except Exception as e:  # noqa: BLE001
                print(f"| {name} | {m} | FP8 row-wise failed: {e} | | | | |")
            try:
                t = timed(lambda s: torch._scaled_mm(x8, w8[s].t(), scale_a=sa_t, scale_b=sb_t, out_dtype=torch.bfloat16), sets8, args.reps)
                rows.append(("FP8 _scaled_mm tensor-wise" + note, t, n * k))
            except Exception as e:  # noqa: BLE001
                print(f"| {name} | {m} | FP8 tensor-wise failed: {e} | | | | |")
            t = timed(lambda s: torch.mm(x16, w16[s].t()), sets16, args.reps)
            rows.append(("bf16 torch.mm", t, 2 * n * k))
            for what, t, wbytes in rows:
                gb = wbytes / (t * 1e-3) / 1e9
                print(f"| {name} | {m} | {what} | {t * 1e3:.1f} | {gb:.0f} | {100 * gb / HBM_GBPS:.0f} % | {flops / (t * 1e-3) / 1e12:.1f} |")
            del x8, x16


if __name__ == "__main__":
    main()
