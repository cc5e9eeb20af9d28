// Hopper (sm_90a) PTX primitives of the sparse attention kernels (kernels/sparse_attention*.cu),
// the FP8 GEMM (kernels/fp8_gemm.cu) and the MoE expert kernels (kernels/moe_experts*.cu):
// cp.async gathers, proxy / cluster fences and barriers, mbarriers, TMA bulk copies within a
// cluster, setmaxnreg, programmatic dependent launch, the wgmma descriptors, fences and products
// (the register-A products: dsv41_wgmma_rs.cuh).
// Thin inline wrappers: each states the PTX it emits; the layouts they assume are described where
// they are used (the kernel's header comment and its swizzle helpers).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace dsv41_ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
    const int n = valid ? 16 : 0;  // 0: zero-fill, nothing read
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
// 4-byte cp.async (L1-allocating .ca: the only form for sizes below 16).
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
// Same with zero fill: !valid reads nothing and writes 4 zero bytes.
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
// cp_async16 with an L2 prefetch of the surrounding 256 bytes (fewer, larger DRAM requests).
__device__ __forceinline__ void cp_async16_l2(uint32_t dst, const void* src, bool valid) {
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
// Same without the zero-fill operand (the 16 bytes always read).
__device__ __forceinline__ void cp_async16_l2(uint32_t dst, const void* src) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed cp.async groups are pending (oldest first).
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// Waits for ALL of this thread's cp.async copies, also those not committed to a group
// (cp.async.wait_group 0 would skip uncommitted ones: the packed-row producer relies on this).
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// Shared memory written by this thread (generic proxy) becomes visible to wgmma (async proxy)
// after this fence and a barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Cluster-wide barrier with release / acquire semantics (shared::cluster writes visible after).
__device__ __forceinline__ void cluster_sync_all() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// mbarriers (stage hand-over between the producer warpgroup and the compute warpgroups).
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// One arrival on `bar` once all cp.async issued so far by this thread have landed (the
// barrier's expected count includes it: .noinc).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred P1;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
        "@!P1 bra WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// Split cluster barrier (all threads of the cluster, .aligned: whole warps): arrive (release:
// this thread's earlier shared / global writes and reads are ordered before) and wait (acquire).
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
// Makes this thread's mbarrier.init visible to the other CTAs of the cluster (their bulk copies
// complete transactions on it) once a cluster barrier follows.
__device__ __forceinline__ void fence_mbar_init_cluster() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// One arrival on `bar` that also expects `bytes` more transaction bytes in the current phase
// (the phase completes when the arrivals are done and those bytes have landed).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Shared::cta address -> the shared::cluster address of the same offset in CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t mapa_shared(uint32_t addr, uint32_t rank) {
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
// Bulk copy (TMA engine) of `bytes` (multiple of 16, 16-byte aligned) from this CTA's shared
// memory `src` to shared::cluster address `dst` of another CTA; completes `bytes` transactions on
// that CTA's mbarrier `bar` (a shared::cluster address too). The source must have been written
// before a fence.proxy.async (generic -> async proxy).
__device__ __forceinline__ void bulk_copy_to_cluster(uint32_t dst, uint32_t src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "r"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
// Asynchronous stores into another CTA's shared memory (st.async, shared::cluster addresses from
// mapa_shared): each completes its bytes as transactions on that CTA's mbarrier `bar` (also a
// shared::cluster address); the sender never waits.
__device__ __forceinline__ void st_async_b32(uint32_t dst, uint32_t v, uint32_t bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(dst), "r"(v), "r"(bar) : "memory");
}
__device__ __forceinline__ void st_async_v4(uint32_t dst, float4 v, uint32_t bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(dst), "f"(v.x),
                 "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar)
                 : "memory");
}
// mbar_wait for a barrier whose transactions come from other CTAs of the cluster (acquire at
// cluster scope: their stores are visible after it).
__device__ __forceinline__ void mbar_wait_cluster(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred P1;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 P1, [%0], %1;\n"
        "@!P1 bra WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R)); }
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R)); }

// Programmatic dependent launch: wait for the previous grid's memory (no-op without the launch
// attribute) / let the next grid launch once every CTA of this one got here.
__device__ __forceinline__ void grid_dep_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void grid_dep_launch() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

// Four 8 x 8 b16 matrices of a warp, stored transposed (stmatrix .trans): register k of lane l
// holds row l / 4, columns 2 (l % 4) .. +1 of matrix k (the mma / wgmma accumulator fragment after
// packing pairs); lane l gives the shared address of memory row l % 8 of matrix l / 8, which
// receives column l % 8 of the matrix (8 b16 = 16 bytes, 16-byte aligned).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}

// wgmma (sm_90a): shared-memory matrix descriptors and the kernel's two warpgroup products
// (PTX ISA, asynchronous warpgroup level matrix shared memory layout).
// Descriptor of a 128-byte-swizzled operand at shared address `addr` (the pattern repeats on
// 1024-byte boundaries, base offset 0): lbo / sbo in bytes (K-major: lbo unused, sbo = 8-row
// group stride; MN-major: lbo = stride of 64-element MN blocks, sbo = 8-row K group stride).
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (static_cast<uint64_t>((lbo & 0x3FFFFu) >> 4) << 16) |
           (static_cast<uint64_t>((sbo & 0x3FFFFu) >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Waits until at most N of this warpgroup's committed wgmma groups are pending (groups complete in
// commit order).
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Pins accumulator registers in program order around the asynchronous products.
template <int N>
__device__ __forceinline__ void wg_fence_regs(float* d) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The accumulator operands of the wgmma wrappers (here and in dsv41_wgmma_rs.cuh): an asm
// statement's operand list is fixed text, so the wrappers compose theirs from these instead of a
// template over N. DSV41_WG_ACC_STR(n): the placeholders "%0, %1, ..., %(n - 1)" (the first n
// operands); DSV41_WG_ACC_OPS(n): the operands "+f"(d[0]), ..., "+f"(d[n - 1]) (a float* d in
// scope); n a multiple of 8 up to 128.
#define DSV41_WG_ACC_STR(n) DSV41_WG_ACC_S##n
#define DSV41_WG_ACC_OPS(n) DSV41_WG_ACC_D##n
#define DSV41_WG_ACC_S8 "%0, %1, %2, %3, %4, %5, %6, %7"
#define DSV41_WG_ACC_S16 DSV41_WG_ACC_S8 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define DSV41_WG_ACC_S24 DSV41_WG_ACC_S16 ", %16, %17, %18, %19, %20, %21, %22, %23"
#define DSV41_WG_ACC_S32 DSV41_WG_ACC_S24 ", %24, %25, %26, %27, %28, %29, %30, %31"
#define DSV41_WG_ACC_S40 DSV41_WG_ACC_S32 ", %32, %33, %34, %35, %36, %37, %38, %39"
#define DSV41_WG_ACC_S48 DSV41_WG_ACC_S40 ", %40, %41, %42, %43, %44, %45, %46, %47"
#define DSV41_WG_ACC_S56 DSV41_WG_ACC_S48 ", %48, %49, %50, %51, %52, %53, %54, %55"
#define DSV41_WG_ACC_S64 DSV41_WG_ACC_S56 ", %56, %57, %58, %59, %60, %61, %62, %63"
#define DSV41_WG_ACC_S72 DSV41_WG_ACC_S64 ", %64, %65, %66, %67, %68, %69, %70, %71"
#define DSV41_WG_ACC_S80 DSV41_WG_ACC_S72 ", %72, %73, %74, %75, %76, %77, %78, %79"
#define DSV41_WG_ACC_S88 DSV41_WG_ACC_S80 ", %80, %81, %82, %83, %84, %85, %86, %87"
#define DSV41_WG_ACC_S96 DSV41_WG_ACC_S88 ", %88, %89, %90, %91, %92, %93, %94, %95"
#define DSV41_WG_ACC_S104 DSV41_WG_ACC_S96 ", %96, %97, %98, %99, %100, %101, %102, %103"
#define DSV41_WG_ACC_S112 DSV41_WG_ACC_S104 ", %104, %105, %106, %107, %108, %109, %110, %111"
#define DSV41_WG_ACC_S120 DSV41_WG_ACC_S112 ", %112, %113, %114, %115, %116, %117, %118, %119"
#define DSV41_WG_ACC_S128 DSV41_WG_ACC_S120 ", %120, %121, %122, %123, %124, %125, %126, %127"
#define DSV41_WG_D8(i) \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define DSV41_WG_ACC_D8 DSV41_WG_D8(0)
#define DSV41_WG_ACC_D16 DSV41_WG_ACC_D8, DSV41_WG_D8(8)
#define DSV41_WG_ACC_D24 DSV41_WG_ACC_D16, DSV41_WG_D8(16)
#define DSV41_WG_ACC_D32 DSV41_WG_ACC_D24, DSV41_WG_D8(24)
#define DSV41_WG_ACC_D40 DSV41_WG_ACC_D32, DSV41_WG_D8(32)
#define DSV41_WG_ACC_D48 DSV41_WG_ACC_D40, DSV41_WG_D8(40)
#define DSV41_WG_ACC_D56 DSV41_WG_ACC_D48, DSV41_WG_D8(48)
#define DSV41_WG_ACC_D64 DSV41_WG_ACC_D56, DSV41_WG_D8(56)
#define DSV41_WG_ACC_D72 DSV41_WG_ACC_D64, DSV41_WG_D8(64)
#define DSV41_WG_ACC_D80 DSV41_WG_ACC_D72, DSV41_WG_D8(72)
#define DSV41_WG_ACC_D88 DSV41_WG_ACC_D80, DSV41_WG_D8(80)
#define DSV41_WG_ACC_D96 DSV41_WG_ACC_D88, DSV41_WG_D8(88)
#define DSV41_WG_ACC_D104 DSV41_WG_ACC_D96, DSV41_WG_D8(96)
#define DSV41_WG_ACC_D112 DSV41_WG_ACC_D104, DSV41_WG_D8(104)
#define DSV41_WG_ACC_D120 DSV41_WG_ACC_D112, DSV41_WG_D8(112)
#define DSV41_WG_ACC_D128 DSV41_WG_ACC_D120, DSV41_WG_D8(120)

// d[0..15] += A (64 x 16, smem descriptor a) * B (16 x 32, smem descriptor b), bf16 -> f32;
// TA / TB = 0: the operand is K-major, 1: MN-major (transposed); accumulator layout: d[4i + c]
// at row 16 (warp % 4) + lane / 4 + 8 (c / 2), column 8i + 2 (lane % 4) + c % 2.
template <int TA, int TB>
__device__ __forceinline__ void wg_m64n32k16(float* d, uint64_t a, uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {" DSV41_WG_ACC_STR(16) "}, %16, %17, p, 1, 1, %19, %20;\n}\n"
        : DSV41_WG_ACC_OPS(16)
        : "l"(a), "l"(b), "r"(1), "n"(TA), "n"(TB));
}

// d[0..31] = A (64 x 16, smem descriptor a) * B (16 x 64, smem descriptor b) + (accumulate ? d : 0),
// bf16 -> f32, both operands K-major; accumulator layout: d[4i + c] at row 16 (warp % 4) + lane / 4
// + 8 (c / 2), column 8i + 2 (lane % 4) + c % 2 (i = 0..7). accumulate = 0 ignores d's values (no
// register write before the product, which would serialise it behind wgmma still in flight).
__device__ __forceinline__ void wg_m64n64k16(float* d, uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" DSV41_WG_ACC_STR(32) "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : DSV41_WG_ACC_OPS(32)
        : "l"(a), "l"(b), "r"(accumulate));
}

// d[0..127] += A (64 x 16, smem descriptor a) * B (16 x 256, smem descriptor b, MN-major),
// bf16 -> f32 (accumulate = 0: d = A B, the old d ignored); accumulator layout: d[4i + c] at row
// 16 (warp % 4) + lane / 4 + 8 (c / 2), column 8i + 2 (lane % 4) + c % 2.
__device__ __forceinline__ void wg_m64n256k16_kmn(float* d, uint64_t a, uint64_t b, int accumulate = 1) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" DSV41_WG_ACC_STR(128) "}, %128, %129, p, 1, 1, 0, 1;\n}\n"
        : DSV41_WG_ACC_OPS(128)
        : "l"(a), "l"(b), "r"(accumulate));
}

// d[0..63] = A (64 x 32, smem descriptor a) * B (32 x 128, smem descriptor b) + (accumulate ? d : 0),
// e4m3 x e4m3 -> f32 (8-bit operands are K-major only; no transpose immediates); accumulator
// layout as the bf16 forms: d[4i + c] at row 16 (warp % 4) + lane / 4 + 8 (c / 2), column 8i +
// 2 (lane % 4) + c % 2 (i = 0..15). Products of e4m3 values are exact, the sums in f32.
__device__ __forceinline__ void wg_m64n128k32_e4m3(float* d, uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" DSV41_WG_ACC_STR(64) "}, %64, %65, p, 1, 1;\n}\n"
        : DSV41_WG_ACC_OPS(64)
        : "l"(a), "l"(b), "r"(accumulate));
}

}  // namespace dsv41_ptx
