# Which summation order cuBLAS's f32 batched GEMM uses for K = hc (the mHC post's comb product):
# compares torch.matmul on CUDA (TF32 off) with emulated orders, bit for bit. Run: /opt/torch/.venv/bin/python
# examples/anchors/mhc_comb_order.py (docs/gpu-runs/2026-12-06-verify-b/).
import torch, numpy as np
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
def f32(x): return np.float32(x)
def fma(a, b, c):  # exact a*b in f64 (48 bits), + c, then one rounding to f32 (double rounding rare)
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)
def mul(a, b): return (a.astype(np.float64) * b.astype(np.float64)).astype(np.float32)
def add(a, b): return (a.astype(np.float64) + b.astype(np.float64)).astype(np.float32)
rng = np.random.default_rng(0)
for (T, hc, d) in [(1, 4, 192), (6, 4, 50), (1, 4, 5120), (64, 4, 5120), (256, 4, 5120), (7, 8, 640), (2, 3, 1)]:
    x = (rng.standard_normal((T, hc, d)) * (2.0 ** rng.integers(-6, 6, (T, hc, 1)))).astype(np.float32)
    comb = rng.random((T, hc, hc)).astype(np.float32)
    comb_t = np.ascontiguousarray(np.transpose(comb, (0, 2, 1)))
    got = torch.matmul(torch.from_numpy(comb_t).cuda(), torch.from_numpy(x).cuda()).cpu().numpy()
    a = [comb_t[:, :, i:i+1] for i in range(hc)]  # [T, hc(j), 1]
    b = [x[:, i:i+1, :] for i in range(hc)]        # [T, 1, d]
    cands = {}
    acc = mul(a[0], b[0])
    for i in range(1, hc): acc = fma(a[i], b[i], acc)
    cands['fma asc'] = acc
    acc = mul(a[hc-1], b[hc-1])
    for i in range(hc-2, -1, -1): acc = fma(a[i], b[i], acc)
    cands['fma desc'] = acc
    acc = mul(a[0], b[0])
    for i in range(1, hc): acc = add(acc, mul(a[i], b[i]))
    cands['mul+add asc'] = acc
    if hc % 2 == 0:
        e = mul(a[0], b[0]); o = mul(a[1], b[1])
        for i in range(2, hc, 2): e = fma(a[i], b[i], e); o = fma(a[i+1], b[i+1], o)
        cands['even/odd fma'] = add(e, o)
        p = [mul(a[i], b[i]) for i in range(hc)]
        while len(p) > 1: p = [add(p[k], p[k+1]) for k in range(0, len(p), 2)]
        cands['tree of products'] = p[0]
        if hc == 4:
            cands['pair fma'] = add(fma(a[1], b[1], mul(a[0], b[0])), fma(a[3], b[3], mul(a[2], b[2])))
            cands['pair fma rev'] = add(fma(a[3], b[3], mul(a[2], b[2])), fma(a[1], b[1], mul(a[0], b[0])))
    n = got.size
    res = ", ".join(f"{k}: {int((v.view(np.uint32) != got.view(np.uint32)).sum())}" for k, v in cands.items())
    print(f"T {T} hc {hc} d {d} ({n} values) differing: {res}")
