"""Torch anchor of examples/bench_moe_experts.rs (issue 22): the routed experts of one
V4.1-Flash MoE layer with bf16 weights through `torch._grouped_mm` (384 experts, top-6, hidden
5120, inter 2304: gate/up in one grouped GEMM, SiLU x up, down), timed as scaled_mm.py times its
anchors: graph-captured over 8 random routings (consecutive calls touch different experts),
replayed, CUDA events, median of the repetitions. Token sort and combine are not included.

    /opt/torch/.venv/bin/python examples/anchors/grouped_mm.py [--b 1,64,256,1024,4096] [--reps 9]
"""
import argparse

import torch

from scaled_mm import timed

HIDDEN, INTER, TOP_K = 5120, 2304, 6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--b", default="1,64,256,1024,4096")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--experts", type=int, default=384)
    args = ap.parse_args()
    dev = torch.device("cuda")
    e = args.experts
    props = torch.cuda.get_device_properties(0)
    print(f"torch {torch.__version__}, {props.name}; {e} bf16 experts (torch._grouped_mm)")
    w13 = torch.randn(e, 2 * INTER, HIDDEN, device=dev, dtype=torch.bfloat16).transpose(-2, -1)
    w2 = torch.randn(e, HIDDEN, INTER, device=dev, dtype=torch.bfloat16).transpose(-2, -1)
    print("\n| B | anchor | us | touched experts | TFLOP/s |")
    print("|---|---|---|---|---|")
    sets = 8
    for b in [int(v) for v in args.b.split(",")]:
        xs, offs, touched = [], [], 0
        for _ in range(sets):
            ids = torch.randn(b, e, device=dev).topk(TOP_K, dim=-1).indices.flatten()
            counts = torch.bincount(ids, minlength=e)
            touched += int((counts > 0).sum())
            order = ids.argsort(stable=True)
            xs.append(torch.randn(b, HIDDEN, device=dev, dtype=torch.bfloat16)[order // TOP_K].contiguous())
            offs.append(counts.cumsum(0).to(torch.int32))

        def step(s):
            h = torch._grouped_mm(xs[s], w13, offs=offs[s])
            g, u = h[:, :INTER], h[:, INTER:]
            return torch._grouped_mm(torch.nn.functional.silu(g) * u, w2, offs=offs[s])

        t = timed(step, sets, args.reps)
        flops = 2.0 * b * TOP_K * 3 * HIDDEN * INTER
        print(f"| {b} | bf16 torch._grouped_mm | {t * 1e3:.1f} | {touched / sets:.1f} | {flops / (t * 1e-3) / 1e12:.1f} |")


if __name__ == "__main__":
    main()
