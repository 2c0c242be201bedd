// CPU simulation of kernels/quant_matmul.cu for machines without a GPU (tests/test_kernels_cpu_sim.py).
//
// The .cu file is compiled as plain C++ (g++ -std=c++17 -DQMM_SOURCE='"path"'): without __CUDA_ARCH__ it
// takes its portable path (software fp16, warp-shuffle mma emulation, synchronous copies), so this checks
// every layout, index and dequantization detail the GPU build shares with it; only the inline-PTX leaf
// operations (cvt, f16x2 arithmetic, mma.sync, cp.async, bulk copies) are left to the GPU test. Every thread
// of a block is a fiber (tests/cuda_sim.h block mode): qmv_kernel's __syncthreads run for real.
#define SIM_BLOCK
#include "cuda_sim.h"

alignas(16) uint4 ss_smem[(232 * 1024) / 16];

#include QMM_SOURCE

static void (*g_body)() = nullptr;

// Runs g_body as every block of a (gx, gy) grid of `threads` threads; returns the simulation errors.
static int launch(unsigned gx, unsigned gy, unsigned threads) {
    int errors = 0;
    sim::gdim = {gx, gy, 1};
    sim::bdim = {threads, 1, 1};
    for (unsigned by = 0; by < gy; ++by)
        for (unsigned bx = 0; bx < gx; ++bx) {
            sim::bid = {bx, by, 0};
            std::memset(ss_smem, 0xA5, sizeof(ss_smem));  // stale shared memory must not matter
            errors += simb::run_block((int)threads, g_body);
        }
    return errors;
}

struct QmmArgs { const u8* W; long long row_bytes; int N, K; const uint4* xp; int T; float* y; int stages; };
static QmmArgs qa;

template <int QT, int NT>
static void qmm_body() { qmm_kernel<QT, NT>(qa.W, qa.row_bytes, qa.N, qa.K, qa.xp, qa.T, qa.y); }

template <int QT, int NT, int MT>
static void qmv_body() { qmv_kernel<QT, NT, MT>(qa.W, qa.row_bytes, qa.N, qa.K, qa.xp, qa.T, qa.y, qa.stages); }

template <int QT>
static void (*pick_qmm(int nt))() {
    switch (nt) {
        case 1: return qmm_body<QT, 1>;
        case 2: return qmm_body<QT, 2>;
        case 3: return qmm_body<QT, 3>;
        case 4: return qmm_body<QT, 4>;
        case 5: return qmm_body<QT, 5>;
        case 6: return qmm_body<QT, 6>;
        case 7: return qmm_body<QT, 7>;
        case 8: return qmm_body<QT, 8>;
    }
    return nullptr;
}

template <int QT, int MT>
static void (*pick_qmv_nt(int nt))() {
    switch (nt) {
        case 1: return qmv_body<QT, 1, MT>;
        case 2: return qmv_body<QT, 2, MT>;
        case 3: return qmv_body<QT, 3, MT>;
        case 4: return qmv_body<QT, 4, MT>;
        case 5: return qmv_body<QT, 5, MT>;
        case 6: return qmv_body<QT, 6, MT>;
        case 7: return qmv_body<QT, 7, MT>;
        case 8: return qmv_body<QT, 8, MT>;
    }
    return nullptr;
}

template <int QT>
static void (*pick_qmv(int nt, int mt))() {
    return mt == 1 ? pick_qmv_nt<QT, 1>(nt) : pick_qmv_nt<QT, 2>(nt);
}

// v1: W in GGUF rows; y zeroed by the caller when splits > 1.
extern "C" int sim_qmm(int qt, int nt, const unsigned char* W, long long row_bytes, int N, int K, const void* xp,
                       int T, float* y, int splits) {
    switch (qt) {
        case 1: g_body = pick_qmm<1>(nt); break;
        case 8: g_body = pick_qmm<8>(nt); break;
        case 12: g_body = pick_qmm<12>(nt); break;
        case 14: g_body = pick_qmm<14>(nt); break;
        default: g_body = nullptr;
    }
    if (!g_body) return -1;
    qa = {W, row_bytes, N, K, (const uint4*)xp, T, y, 0};
    return launch((unsigned)((N + 127) / 128), (unsigned)splits, 128);
}

// v2: W in device_layout(); grid_x persistent blocks (each loops over row groups), kw warps per block.
extern "C" int sim_qmv(int qt, int nt, int mt, int kw, int stages, const unsigned char* W, long long row_bytes, int N,
                       int K, const void* xp, int T, float* y, int splits, int grid_x) {
    switch (qt) {
        case 1: g_body = pick_qmv<1>(nt, mt); break;
        case 8: g_body = pick_qmv<8>(nt, mt); break;
        case 12: g_body = pick_qmv<12>(nt, mt); break;
        case 13: g_body = pick_qmv<13>(nt, mt); break;
        case 23: g_body = pick_qmv<23>(nt, mt); break;
        case 11: g_body = pick_qmv<11>(nt, mt); break;
        case 2: g_body = pick_qmv<2>(nt, mt); break;
        case 20: g_body = pick_qmv<20>(nt, mt); break;
        case 14: g_body = pick_qmv<14>(nt, mt); break;
        default: g_body = nullptr;
    }
    if (!g_body || kw < 1 || kw > 8 || grid_x < 1) return -1;
    qa = {W, row_bytes, N, K, (const uint4*)xp, T, y, stages};
    return launch((unsigned)grid_x, (unsigned)splits, 32u * (unsigned)kw);
}

#include "cuda_sim_pack.h"
