// CPU simulation of kernels/quant_matmul.cu's qmw_kernel (the wide-token kernel) for machines without a GPU
// (tests/test_kernels_quant_wide_sim.py).
//
// g++ -std=c++17 -DQMM_SOURCE='"path"': the .cu file compiles as plain C++ (no __CUDA_ARCH__, so it takes its portable
// path: software fp16, shuffle mma emulation, synchronous copies standing in for cp.async, __syncthreads pipeline).
// Every thread of a block is a fiber (tests/cuda_sim.h block mode): the kernel's __syncthreads and shuffles run for
// real. The stream-K protocol (per-warp arrival counters, the last warp adding the pieces) is exercised by running a
// launch's blocks one at a time in grid order and in seeded permutations (any piece of a row block can be the last to
// arrive), and several at a time interleaved (simb::run_grid: a block paused between storing its piece and counting
// itself in, or between counting and reading the others', while others run). qmv_kernel (v2) runs here too, as the
// bitwise reference for row blocks one block covers.
// With -DSPECSPLIT_SIM_BULK the kernels take their sm_90 path instead (kernels/bulk.cuh simulates its bulk copies,
// mbarriers and reduce-adds): qmw_kernel with its producer warp, mbarrier stage rings, y tiles.
#define SIM_BLOCK
#include <utility>
#include <vector>

#include "cuda_sim.h"

constexpr int SMEM_WORDS = (232 * 1024) / 16;
constexpr int MAX_RESIDENT = 8;
alignas(16) uint4 ss_smem[SMEM_WORDS];                      // shared memory of the block running (sequential mode)
alignas(16) static uint4 resident_smem[MAX_RESIDENT - 1][SMEM_WORDS];  // places 1.. of grid mode (place 0: ss_smem)
// The kernels' `extern __shared__ uint4 ss_smem[]` is this pointer's target: ss_smem itself, or in grid mode the
// shared memory of the resident block about to run.
static uint4 (*sim_smem)[] = reinterpret_cast<uint4 (*)[]>(&ss_smem);
#define ss_smem (*sim_smem)
#include QMM_SOURCE
#undef ss_smem

#if SS_SIM_BULK
// built with -DSPECSPLIT_SIM_BULK: the kernels take their sm_90 bulk-copy path, its copies and mbarriers simulated
// in kernels/bulk.cuh on the running block's shared memory
namespace bk {
char* sim_smem_base() { return reinterpret_cast<char*>(*sim_smem); }
int sim_bulk_error = 0;
}  // namespace bk
#endif
// 1 where this build runs the bulk-copy path (and qmw_kernel's producer warp)
extern "C" int sim_bulk() { return SS_SIM_BULK; }

static struct {
    const u8* W;
    long long row_bytes;
    int N, K;
    const uint4* xp;
    int T;
    float* y;
    int stages, accumulate;
    long long ldy;
    float* part;
    unsigned int* counters;
} wa;
static void (*g_body)() = nullptr;
static int sim_peek = 1;  // qmw_kernel's peek (sim_wide_peek)

template <int QT, int NT, int MT>
static void qmw_body() {
    qmw_kernel<QT, NT, MT>(wa.W, wa.row_bytes, wa.N, wa.K, wa.xp, wa.T, wa.y, wa.stages, wa.accumulate, wa.ldy, wa.part,
                           wa.counters, 1, 1, sim_peek);  // (a producer warp and the y tile: the bulk-copy path's only,
                                                          // ignored by the portable build)
}

// qmw_kernel<QT, NT, 2, 1>: the SwiGLU launch of a stacked [gate | up] (sim_wide_swiglu), y its packed output
template <int QT, int NT>
static void qmw_swiglu_body() {
    qmw_kernel<QT, NT, 2, 1>(wa.W, wa.row_bytes, wa.N, wa.K, wa.xp, wa.T, wa.y, wa.stages, 0, 0, wa.part, wa.counters, 1,
                             0, sim_peek);
}
static int sim_swiglu = 0;

template <int QT>
static void (*pick_swiglu(int nt))() {
    switch (nt) {
        case 1: return qmw_swiglu_body<QT, 1>;
        case 2: return qmw_swiglu_body<QT, 2>;
        case 3: return qmw_swiglu_body<QT, 3>;
        case 4: return qmw_swiglu_body<QT, 4>;
        case 5: return qmw_swiglu_body<QT, 5>;
        case 6: return qmw_swiglu_body<QT, 6>;
        case 7: return qmw_swiglu_body<QT, 7>;
        case 8: return qmw_swiglu_body<QT, 8>;
    }
    return nullptr;
}

static int sim_v2_ytile = 0;  // qmv_kernel's y tile (sim_v2_ytile): its bulk reduce-adds (the bulk-copy path only)

template <int QT, int NT, int MT>
static void qmv_body() {
    qmv_kernel<QT, NT, MT>(wa.W, wa.row_bytes, wa.N, wa.K, wa.xp, wa.T, wa.y, wa.stages, wa.accumulate, wa.ldy,
                           sim_v2_ytile);
}

template <int QT, int MT, bool WIDE>
static void (*pick_nt(int nt))() {
    switch (nt) {
        case 1: return WIDE ? qmw_body<QT, 1, MT> : qmv_body<QT, 1, MT>;
        case 2: return WIDE ? qmw_body<QT, 2, MT> : qmv_body<QT, 2, MT>;
        case 3: return WIDE ? qmw_body<QT, 3, MT> : qmv_body<QT, 3, MT>;
        case 4: return WIDE ? qmw_body<QT, 4, MT> : qmv_body<QT, 4, MT>;
        case 5: return WIDE ? qmw_body<QT, 5, MT> : qmv_body<QT, 5, MT>;
        case 6: return WIDE ? qmw_body<QT, 6, MT> : qmv_body<QT, 6, MT>;
        case 7: return WIDE ? qmw_body<QT, 7, MT> : qmv_body<QT, 7, MT>;
        case 8: return WIDE ? qmw_body<QT, 8, MT> : qmv_body<QT, 8, MT>;
    }
    return nullptr;
}

// Q5_K, IQ4_XS, Q4_0 and IQ4_NL (the types whose wide launches the dispatch does not take yet, or took last): the
// token-tile counts their tests use
// only, so the library's every build does not pay their full instantiation
template <int QT, int MT, bool WIDE>
static void (*pick_nt_few(int nt))() {
    switch (nt) {
        case 2: return WIDE ? qmw_body<QT, 2, MT> : qmv_body<QT, 2, MT>;
        case 3: return WIDE ? qmw_body<QT, 3, MT> : qmv_body<QT, 3, MT>;
        case 6: return WIDE ? qmw_body<QT, 6, MT> : qmv_body<QT, 6, MT>;
    }
    return nullptr;
}

template <bool WIDE>
static void (*pick(int qt, int nt, int mt))() {
    if (mt != 1 && mt != 2) return nullptr;
    if (WIDE && sim_swiglu) {
        if (mt != 2) return nullptr;
        switch (qt) {
            case 12: return pick_swiglu<12>(nt);
            case 14: return pick_swiglu<14>(nt);
        }
        return nullptr;
    }
    switch (qt) {
        case 1: return mt == 1 ? pick_nt<1, 1, WIDE>(nt) : pick_nt<1, 2, WIDE>(nt);
        case 8: return mt == 1 ? pick_nt<8, 1, WIDE>(nt) : pick_nt<8, 2, WIDE>(nt);
        case 12: return mt == 1 ? pick_nt<12, 1, WIDE>(nt) : pick_nt<12, 2, WIDE>(nt);
#ifndef SS_SIM_BASE_TYPES  // (a build for a test of F16 / Q8_0 / Q4_K / Q6_K only: a third less to compile)
        case 13: return mt == 1 ? pick_nt_few<13, 1, WIDE>(nt) : pick_nt_few<13, 2, WIDE>(nt);
        case 23: return mt == 1 ? pick_nt_few<23, 1, WIDE>(nt) : pick_nt_few<23, 2, WIDE>(nt);
        case 11: return mt == 1 ? pick_nt_few<11, 1, WIDE>(nt) : pick_nt_few<11, 2, WIDE>(nt);  // Q3_K (session 41)
        case 2: return mt == 1 ? pick_nt_few<2, 1, WIDE>(nt) : pick_nt_few<2, 2, WIDE>(nt);
        case 20: return mt == 1 ? pick_nt_few<20, 1, WIDE>(nt) : pick_nt_few<20, 2, WIDE>(nt);
#endif
        case 14: return mt == 1 ? pick_nt<14, 1, WIDE>(nt) : pick_nt<14, 2, WIDE>(nt);
    }
    return nullptr;
}

static uint4* place_smem(int slot) { return slot == 0 ? ss_smem : resident_smem[slot - 1]; }

// Runs g_body as `blocks` blocks of `threads` threads in grid order (order_seed 0) or a pseudo-random permutation
// (Fisher-Yates on a 64-bit LCG seeded with order_seed): one after another (resident 1), or up to `resident` at a time
// interleaved at barriers, atomics and fences (simb::run_grid, seeded with order_seed too), each with its own shared
// memory. Every block starts on shared memory filled with the canary 0xA5. Returns the simulation errors.
static int launch(unsigned blocks, unsigned threads, unsigned long long order_seed, int resident) {
    const std::vector<unsigned> order = sim::block_order(blocks, order_seed);
    int errors = 0;
#if SS_SIM_BULK
    bk::sim_bulk_reset(2 * order_seed + 1);  // which bulk operations land late: seeded like the block order
    auto leftover = [] { return bk::sim_bulk_leftover(); };
#else
    auto leftover = [] { return 0; };
#endif
    sim::gdim = {blocks, 1, 1};
    sim::bdim = {threads, 1, 1};
    if (resident > 1) {
        static unsigned started[MAX_RESIDENT];  // the block each place last held (a new one gets fresh canaries)
        for (int sl = 0; sl < MAX_RESIDENT; ++sl) started[sl] = ~0u;
        errors = simb::run_grid((int)threads, order.data(), (int)blocks, resident, order_seed, g_body,
                                [](int slot, unsigned block) {
                                    if (started[slot] != block) {
                                        started[slot] = block;
                                        std::memset(place_smem(slot), 0xA5, sizeof(ss_smem));
                                    }
                                    sim_smem = reinterpret_cast<uint4 (*)[]>(place_smem(slot));
                                });
        sim_smem = reinterpret_cast<uint4 (*)[]>(&ss_smem);
        return errors + leftover();
    }
    for (unsigned b : order) {
        sim::bid = {b, 0, 0};
        std::memset(ss_smem, 0xA5, sizeof(ss_smem));  // stale shared memory must not matter
        errors += simb::run_block((int)threads, g_body);
        errors += leftover();
    }
    return errors;
}

// qmw_kernel: `blocks` blocks of 32 warps threads, `resident` of them at a time (1: one after another); part /
// counters: the scratch (counters zero, left zero).
extern "C" int sim_qmw(int qt, int nt, int mt, int warps, int stages, const unsigned char* W, long long row_bytes, int N,
                       int K, const void* xp, int T, float* y, int accumulate, long long ldy, float* part,
                       unsigned int* counters, int blocks, unsigned long long order_seed, int resident) {
    g_body = pick<true>(qt, nt, mt);
    if (!g_body || warps < 1 || warps > 8 || blocks < 1 || stages < 2 || stages > 4 || resident < 1 ||
        resident > MAX_RESIDENT)
        return -1;
    wa = {W, row_bytes, N, K, (const uint4*)xp, T, y, stages, accumulate, ldy, part, counters};
#if SS_SIM_BULK
    bk::sim_bulk_error = 0;
    const int errors = launch((unsigned)blocks, 32u * (unsigned)(warps + 1), order_seed, resident);  // + the producer
    return errors + bk::sim_bulk_error;
#else
    return launch((unsigned)blocks, 32u * (unsigned)warps, order_seed, resident);
#endif
}

// qmw_kernel's `peek` for the launches that follow (1 as the launcher's default, 0 the store-count-read path alone)
extern "C" void sim_wide_peek(int peek) { sim_peek = peek; }

// qmw_kernel's SwiGLU instance (SW = 1; Q4_K / Q6_K, MT 2) for the sim_qmw launches that follow: y is then the down
// product's packed x (uint16), N the stacked rows, accumulate ignored
extern "C" void sim_wide_swiglu(int on) { sim_swiglu = on; }

// qmv_kernel's `ytile` for the launches that follow (1: an accumulating launch adds through its warps' y tiles, as the
// launcher's does where the tile fits; ignored by the portable build)
extern "C" void sim_v2_ytile_set(int ytile) { sim_v2_ytile = ytile; }

// qmv_kernel (v2) with kw K-warps, grid_x persistent blocks, no K split across blocks.
extern "C" int sim_qmv(int qt, int nt, int mt, int kw, int stages, const unsigned char* W, long long row_bytes, int N,
                       int K, const void* xp, int T, float* y, int accumulate, long long ldy, int grid_x) {
    g_body = pick<false>(qt, nt, mt);
    if (!g_body || kw < 1 || kw > 8 || grid_x < 1) return -1;
    wa = {W, row_bytes, N, K, (const uint4*)xp, T, y, stages, accumulate, ldy, nullptr, nullptr};
#if SS_SIM_BULK
    bk::sim_bulk_error = 0;
    return launch((unsigned)grid_x, 32u * (unsigned)kw, 0ull, 1) + bk::sim_bulk_error;
#else
    return launch((unsigned)grid_x, 32u * (unsigned)kw, 0ull, 1);
#endif
}

#include "cuda_sim_pack.h"
