// CPU simulation of kernels/quant_gemv.cu for machines without a GPU (tests/test_kernels_quant_gemv.py).
//
// g++ -std=c++17 -DGEMV_SOURCE='"path"' -DQMM_SOURCE='"path"': both .cu files compile as plain C++ (no
// __CUDA_ARCH__, so inline PTX takes its portable path: software fp16 conversion, byte permutes in C++). Every
// thread of a block is a fiber (tests/cuda_sim.h block mode), so the kernel's __syncthreads and xor shuffles run
// for real. x is packed by quant_matmul.cu's own pack_x_kernel, so the test checks the layout the GPU sees. With
// -DSPECSPLIT_SIM_BULK the ring kernel takes its sm_90 path (kernels/bulk.cuh simulates its bulk copies and mbarriers).
#define SIM_BLOCK
#include <cmath>
#include <utility>
#include <vector>

#include "cuda_sim.h"

alignas(16) uint4 ss_smem[16];  // quant_matmul.cu's kernels are not run here (pack_x_kernel uses no shared memory)
alignas(16) uint4 gv_smem[(232 * 1024) / 16];

#ifdef SPECSPLIT_SIM_BULK
#define __cluster_dims__(...)  // (the cluster kernel compiles; no test launches it: kernels/bulk.cuh)
#endif
#include QMM_SOURCE
#include GEMV_SOURCE

#if SS_SIM_BULK
// built with -DSPECSPLIT_SIM_BULK: the ring kernel takes its sm_90 bulk-copy path, its copies and mbarriers simulated in
// kernels/bulk.cuh on the block's shared memory
namespace bk {
char* sim_smem_base() { return reinterpret_cast<char*>(gv_smem); }
int sim_bulk_error = 0;
}  // namespace bk
#endif
// 1 where this build runs the bulk-copy path
extern "C" int sim_bulk() { return SS_SIM_BULK; }

struct Args {
    const u8* W;
    long long row_bytes;
    int N, K;
    const uint4* xp;
    int tpad;
    float* y;
    int accumulate;
    long long ldy;
    const uint4* xq;  // PackedX.q16 or null
};
static Args ga;
static void (*g_body)() = nullptr;

// Runs g_body on `blocks` blocks of 32 kw threads, in the order of sim::block_order(blocks, order_seed) (0: grid
// order), each on shared memory poisoned first (stale shared memory must not matter); returns the simulation errors.
static int run_blocks(unsigned blocks, int kw, unsigned long long order_seed) {
    const std::vector<unsigned> order = sim::block_order(blocks, order_seed);
    int errors = 0;
    sim::gdim = {blocks, 1, 1};
    sim::bdim = {32u * (unsigned)kw, 1, 1};
#if SS_SIM_BULK
    bk::sim_bulk_error = 0;
    bk::sim_bulk_reset(2 * order_seed + 1);  // which bulk copies land late: seeded like the block order
#endif
    for (unsigned b : order) {
        sim::bid = {b, 0, 0};
        std::memset(gv_smem, 0xA5, sizeof(gv_smem));
        errors += simb::run_block(32 * kw, g_body);
#if SS_SIM_BULK
        errors += bk::sim_bulk_leftover();  // a copy nobody waited for
#endif
    }
#if SS_SIM_BULK
    errors += bk::sim_bulk_error;
#endif
    return errors;
}

// PD = 0: gemv_kernel (one block per tile); 1, 2: gemv_persist_kernel with that prefetch depth
template <int QT, int NT, int PD>
static void body() {
    if constexpr (PD == 0 || QT == 1)
        gemv_kernel<QT, NT>(ga.W, ga.row_bytes, ga.N, ga.K, ga.xp, ga.tpad, ga.y, ga.accumulate, ga.ldy, ga.xq);
    else
        gemv_persist_kernel<QT, NT, PD>(ga.W, ga.row_bytes, ga.N, ga.K, ga.xp, ga.tpad, ga.y, ga.accumulate,
                                        ga.ldy, ga.xq);
}

template <int QT, int PD>
static void (*pick_nt(int nt))() {
    switch (nt) {
        case 1: return body<QT, 1, PD>;
        case 2: return body<QT, 2, PD>;
        case 3: return body<QT, 3, PD>;
        case 4: return body<QT, 4, PD>;
        case 5: return body<QT, 5, PD>;
        case 8: return body<QT, 8, PD>;
        case 11: return body<QT, 11, PD>;
        case 16: return body<QT, 16, PD>;
#ifdef SIM_ALL_WIDTHS  // every width 1..16 (a slower build, for running the GPU tests on a CuPy stand-in)
        case 6: return body<QT, 6, PD>;
        case 7: return body<QT, 7, PD>;
        case 9: return body<QT, 9, PD>;
        case 10: return body<QT, 10, PD>;
        case 12: return body<QT, 12, PD>;
        case 13: return body<QT, 13, PD>;
        case 14: return body<QT, 14, PD>;
        case 15: return body<QT, 15, PD>;
#endif
    }
    return nullptr;
}

template <int QT>
static void (*pick(int nt, int pd))() {
    if (pd == 1) return pick_nt<QT, 1>(nt);
    if (pd == 2) return pick_nt<QT, 2>(nt);
    return pd == 0 ? pick_nt<QT, 0>(nt) : nullptr;
}

// Q4_0 and IQ4_NL (not dispatched to these kernels yet): the widths their tests use only, so the library's every
// build does not pay their full instantiation
template <int QT>
static void (*pick_few(int nt, int pd))() {
    if (pd < 0 || pd > 2 || nt < 1 || nt > 3) return nullptr;
    static void (*const bodies[3][3])() = {{body<QT, 1, 0>, body<QT, 2, 0>, body<QT, 3, 0>},
                                           {body<QT, 1, 1>, body<QT, 2, 1>, body<QT, 3, 1>},
                                           {body<QT, 1, 2>, body<QT, 2, 2>, body<QT, 3, 2>}};
    return bodies[pd][nt - 1];
}

// One launch of `grid` blocks (0: ceil(N / 16), one per tile) of 32 kw threads, one after another; pd = 0: the
// per-tile kernel, 1 / 2: the persistent one with that prefetch depth (F16 has none: pd must be 0). Returns the
// simulation errors, or -1 for an instantiation this harness does not hold. ldy: y's row stride in floats. xq: the
// pack's int16 staging (PackedX.q16) or null.
extern "C" int sim_gemv(int qt, int nt, const unsigned char* W, long long row_bytes, int N, int K, const void* xp,
                        int tpad, float* y, int accumulate, int kw, int pd, int grid, long long ldy, const void* xq) {
    switch (qt) {
        case 1: g_body = pd == 0 ? pick<1>(nt, 0) : nullptr; break;
        case 8: g_body = pick<8>(nt, pd); break;
        case 12: g_body = pick<12>(nt, pd); break;
        case 13: g_body = pick<13>(nt, pd); break;
        case 23: g_body = pick<23>(nt, pd); break;
        case 11: g_body = pick<11>(nt, pd); break;
        case 2: g_body = pick_few<2>(nt, pd); break;
        case 20: g_body = pick_few<20>(nt, pd); break;
        case 14: g_body = pick<14>(nt, pd); break;
        default: g_body = nullptr;
    }
    if (!g_body || kw < 1 || kw > gv::MAX_KW) return -1;
    ga = {W, row_bytes, N, K, (const uint4*)xp, tpad, y, accumulate, ldy, (const uint4*)xq};
    return run_blocks(grid > 0 ? (unsigned)grid : (unsigned)((N + 15) / 16), kw, 0);
}

// Split-K kernel (gemv_splitk_kernel): ceil(N / 16) * splits blocks of 32 kw threads. order_seed = 0: blocks in
// grid order (a tile's split S - 1 arrives last); otherwise a pseudo-random permutation of all blocks (Fisher-Yates
// on a 64-bit LCG seeded with it), so any split of a tile may be the last to arrive and tiles interleave. part /
// counters: the launcher's scratch (partial sums, per-tile arrival counters that must be zero and are left zero).
static struct {
    int splits;
    float* part;
    unsigned int* counters;
} sa;

template <int QT, int NT>
static void split_body() {
    gemv_splitk_kernel<QT, NT>(ga.W, ga.row_bytes, ga.N, ga.K, ga.xp, ga.tpad, ga.y, ga.accumulate, ga.ldy, sa.splits,
                               sa.part, sa.counters, ga.xq);
}

template <int QT>
static void (*pick_split(int nt))() {
    switch (nt) {
        case 1: return split_body<QT, 1>;
        case 2: return split_body<QT, 2>;
        case 3: return split_body<QT, 3>;
        case 5: return split_body<QT, 5>;
    }
    return nullptr;
}

extern "C" int sim_gemv_split(int qt, int nt, const unsigned char* W, long long row_bytes, int N, int K,
                              const void* xp, int tpad, float* y, int accumulate, int kw, int splits, long long ldy,
                              float* part, unsigned int* counters, unsigned long long order_seed, const void* xq) {
    switch (qt) {
        case 1: g_body = pick_split<1>(nt); break;
        case 8: g_body = pick_split<8>(nt); break;
        case 12: g_body = pick_split<12>(nt); break;
        case 13: g_body = pick_split<13>(nt); break;
        case 23: g_body = pick_split<23>(nt); break;
        case 11: g_body = pick_split<11>(nt); break;
        case 2: g_body = nt == 1 ? split_body<2, 1> : nt == 2 ? split_body<2, 2> : nullptr; break;
        case 20: g_body = nt == 1 ? split_body<20, 1> : nt == 2 ? split_body<20, 2> : nullptr; break;
        case 14: g_body = pick_split<14>(nt); break;
        default: g_body = nullptr;
    }
    if (!g_body || kw < 1 || kw > gv::MAX_KW || splits < 1) return -1;
    ga = {W, row_bytes, N, K, (const uint4*)xp, tpad, y, accumulate, ldy, (const uint4*)xq};
    sa = {splits, part, counters};
    return run_blocks((unsigned)((N + 15) / 16) * (unsigned)splits, kw, order_seed);
}

// Ring kernel (gemv_ring_kernel): ceil(N / 16) blocks of 32 kw threads with `stages` slots per warp, blocks in the
// order of sim::block_order(order_seed). x comes only from xq (PackedX.q16, or a staged norm).
// in_ssq / stage_*: the staged norms (null: none).
static int g_stages = 1;
static struct {
    const float* in_ssq;
    float eps;
    const float* w;
    void* q16;
    float* ssq;
} gs;

template <int QT, int NT, int SWIGLU>
static void ring_body() {
    gemv_ring_kernel<QT, NT, SWIGLU>(ga.W, ga.row_bytes, ga.N, ga.K, ga.y, ga.accumulate, ga.ldy, ga.xq, g_stages,
                                     gs.in_ssq, gs.eps, gs.w, (uint4*)gs.q16, gs.ssq);
}

template <int QT, int SWIGLU = 0>
static void (*pick_ring(int nt))() {
    switch (nt) {
        case 1: return ring_body<QT, 1, SWIGLU>;
        case 2: return ring_body<QT, 2, SWIGLU>;
        case 3: return ring_body<QT, 3, SWIGLU>;
    }
    return nullptr;
}

extern "C" int sim_gemv_ring(int qt, int nt, const unsigned char* W, long long row_bytes, int N, int K, float* y,
                             int accumulate, int kw, int stages, long long ldy, unsigned long long order_seed,
                             const void* xq, const float* in_ssq, float eps, const float* stage_w, void* stage_q16,
                             float* stage_ssq) {
    switch (qt) {
        case 8: g_body = pick_ring<8>(nt); break;
        case 12: g_body = pick_ring<12>(nt); break;
        case 13: g_body = pick_ring<13>(nt); break;
        case 23: g_body = pick_ring<23>(nt); break;
        case 11: g_body = pick_ring<11>(nt); break;
        case 2: g_body = pick_ring<2>(nt); break;
        case 20: g_body = pick_ring<20>(nt); break;
        case 14: g_body = pick_ring<14>(nt); break;
        default: g_body = nullptr;
    }
    if (!g_body || kw < 1 || kw > gv::MAX_KW || stages < 1 || !xq) return -1;
    ga = {W, row_bytes, N, K, nullptr, 0, y, accumulate, ldy, (const uint4*)xq};
    g_stages = stages;
    gs = {in_ssq, eps, stage_w, stage_q16, stage_ssq};
    return run_blocks((unsigned)((N + 15) / 16), kw, order_seed);
}

// The gate|up ring with the SwiGLU staging (gemv_ring_kernel<QT, NT, 1>): F / 16 blocks (tile pairs) over a stacked
// [gate | up] matrix of 2 F rows; writes the down product's int16 staging into q16_out. in_ssq: a staged input norm.
extern "C" int sim_gemv_ring_swiglu(int qt, int nt, const unsigned char* W, long long row_bytes, int F, int K, int kw,
                                    int stages, unsigned long long order_seed, const void* xq, const float* in_ssq,
                                    float eps, void* q16_out) {
    switch (qt) {
        case 8: g_body = pick_ring<8, 1>(nt); break;
        case 12: g_body = pick_ring<12, 1>(nt); break;
        case 13: g_body = pick_ring<13, 1>(nt); break;
        case 23: g_body = pick_ring<23, 1>(nt); break;
        case 11: g_body = pick_ring<11, 1>(nt); break;
        case 14: g_body = pick_ring<14, 1>(nt); break;
        default: g_body = nullptr;
    }
    if (!g_body || kw < 1 || kw > gv::MAX_KW || stages < 1 || !xq || !q16_out) return -1;
    ga = {W, row_bytes, F, K, nullptr, 0, nullptr, 0, 0, (const uint4*)xq};
    g_stages = stages;
    gs = {in_ssq, eps, nullptr, q16_out, nullptr};
    return run_blocks((unsigned)(F / 16), kw, order_seed);
}

// pack_silu_kernel<1> (fp32 g and up, rows T x K with stride ld) writing the gemv staging q16 and, unless xp is
// null (the staging alone), the fp16 pack; blocks of 64 threads as sim_pack
static struct {
    const float *g, *u;
    long long ld;
    int T, K, tpad;
    void *xp, *q16;
} ps;

static void pack_silu_body() {
    pack_silu_kernel<1>(ps.g, ps.ld, ps.u, ps.ld, ps.T, ps.K, ps.tpad, (uint4*)ps.xp, (uint4*)ps.q16);
}

extern "C" void sim_pack_silu(const float* g, const float* u, long long ld, int T, int K, int tpad, void* xp,
                              void* q16) {
    ps = {g, u, ld, T, K, tpad, xp, q16};
    const unsigned blocks = 3;
    sim::gdim = {blocks, 1, 1};
    sim::bdim = {64, 1, 1};
    for (unsigned b = 0; b < blocks; ++b) {
        sim::bid = {b, 0, 0};
        simb::run_block(64, pack_silu_body);
    }
}

// pack_x_kernel: blocks of 64 threads (fibers: put_q16 shuffles between unit partners); q16: also the gemv staging
// (PackedX.q16), or null
static struct {
    const void* x;
    int T, K, tpad;
    void *xp, *q16;
} pa;

static void pack_body() { pack_x_kernel<0>(pa.x, (long long)pa.K, pa.T, pa.K, pa.tpad, (uint4*)pa.xp, (uint4*)pa.q16); }

extern "C" void sim_pack(const void* x, int T, int K, int tpad, void* xp, void* q16) {
    pa = {x, T, K, tpad, xp, q16};
    const unsigned blocks = 3;  // fewer than the units: the grid-stride loop runs several rounds
    sim::gdim = {blocks, 1, 1};
    sim::bdim = {64, 1, 1};
    for (unsigned b = 0; b < blocks; ++b) {
        sim::bid = {b, 0, 0};
        simb::run_block(64, pack_body);
    }
}
