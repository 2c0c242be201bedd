// CPU simulation of kernels/quant_matmul.cu for machines without a GPU (tests/test_kernels_cpu_sim.py).
//
// The .cu file is compiled as plain C++ (g++ -std=c++17 -DQMM_SOURCE='"path"'): without __CUDA_ARCH__ it
// takes its portable path (software fp16, warp-shuffle mma emulation, synchronous copies), so this checks
// every layout, index and dequantization detail the GPU build shares with it; only the inline-PTX leaf
// operations (cvt, f16x2 arithmetic, mma.sync, cp.async) are left to the GPU test.
#include "cuda_sim.h"

alignas(16) uint4 ss_smem[(232 * 1024) / 16];

#include QMM_SOURCE


struct QmmArgs { const u8* W; long long row_bytes; int N, K; const uint4* xp; int T; float* y; };
static QmmArgs qa;

template <int QT, int NT>
static void qmm_lane() { qmm_kernel<QT, NT>(qa.W, qa.row_bytes, qa.N, qa.K, qa.xp, qa.T, qa.y); }

template <int QT>
static sim::LaneFn pick_nt(int nt) {
    switch (nt) {
        case 1: return qmm_lane<QT, 1>;
        case 2: return qmm_lane<QT, 2>;
        case 3: return qmm_lane<QT, 3>;
        case 4: return qmm_lane<QT, 4>;
        case 5: return qmm_lane<QT, 5>;
        case 6: return qmm_lane<QT, 6>;
        case 7: return qmm_lane<QT, 7>;
        case 8: return qmm_lane<QT, 8>;
    }
    return nullptr;
}

extern "C" int sim_qmm(int qt, int nt, const unsigned char* W, long long row_bytes, int N, int K, const void* xp,
                       int T, float* y, int splits) {
    sim::LaneFn fn = nullptr;
    switch (qt) {
        case 1: fn = pick_nt<1>(nt); break;
        case 8: fn = pick_nt<8>(nt); break;
        case 12: fn = pick_nt<12>(nt); break;
        case 14: fn = pick_nt<14>(nt); break;
    }
    if (!fn) return -1;
    qa = {W, row_bytes, N, K, (const uint4*)xp, T, y};
    sim::lane_fn = fn;
    sim::errors = 0;
    const int grid_x = (N + 127) / 128;
    sim::gdim = {(unsigned)grid_x, (unsigned)splits, 1};
    sim::bdim = {128, 1, 1};
    for (int by = 0; by < splits; ++by)
        for (int bx = 0; bx < grid_x; ++bx) {
            sim::bid = {(unsigned)bx, (unsigned)by, 0};
            std::memset(ss_smem, 0xA5, sizeof(ss_smem));
            for (int w = 0; w < 4; ++w) sim::run_warp(32u * w);
        }
    return sim::errors;
}

extern "C" void sim_pack(int in_f32, const void* x, long long ldx, int T, int K, int tpad, void* xp) {
    sim::gdim = {1, 1, 1};
    sim::bdim = {1, 1, 1};
    sim::bid = {0, 0, 0};
    sim::cur = 0;
    sim::tids[0] = {0, 0, 0};
    if (in_f32)
        pack_x_kernel<1>(x, ldx, T, K, tpad, (uint4*)xp);
    else
        pack_x_kernel<0>(x, ldx, T, K, tpad, (uint4*)xp);
}
