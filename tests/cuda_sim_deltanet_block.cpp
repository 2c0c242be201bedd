// CPU simulation of the kernels of kernels/deltanet.cu that synchronise whole blocks (gdr_decode_kernel: its warps
// share the conv outputs through shared memory between __syncthreads), for tests/test_kernels_deltanet_sim.py.
// Block mode of tests/cuda_sim.h: every thread of a block a fiber, real __syncthreads; blocks one after another.
#define SIM_BLOCK
#include <cmath>

#include "cuda_sim.h"

constexpr size_t SIM_SMEM = 48 * 1024;
alignas(16) uint4 dn_smem[SIM_SMEM / 16];
extern "C" size_t sim_block_smem_bytes() { return SIM_SMEM; }

#include DN_SOURCE

typedef void (*Body)();

// Every block of the grid in turn, each on shared memory filled with garbage (0xA5), all its threads as fibers.
static int launch(int gx, int threads, Body fn) {
    int errors = 0;
    sim::gdim = {(unsigned)gx, 1, 1};
    sim::bdim = {(unsigned)threads, 1, 1};
    for (int bx = 0; bx < gx; ++bx) {
        sim::bid = {(unsigned)bx, 0, 0};
        std::memset(dn_smem, 0xA5, sizeof(dn_smem));
        errors += simb::run_block(threads, fn);
    }
    return errors;
}

struct DecodeArgs { const void* raw; const float* window; const float* w; float* rows_out; const void* alpha;
                    const void* b; const float* ssm_a; const float* dt; int Hk, Hv, DV, C; float q_scale, eps;
                    const float* s0; float* s_final; const int* swap; i64 alt; float* out; const void* z;
                    const float* norm_w; float norm_eps; uint4* q16; int early; };
static DecodeArgs da;
template <typename TIn, int DK, int CW>
static void decode_body() {
    gdr_decode_kernel<TIn, DK, CW, 4>((const TIn*)da.raw, da.window, da.w, da.rows_out, (const TIn*)da.alpha,
                                      (const TIn*)da.b, da.ssm_a, da.dt, da.Hk, da.Hv, da.DV, da.C, da.q_scale,
                                      da.eps, da.s0, da.s_final, da.swap, da.alt, da.out, (const TIn*)da.z,
                                      da.norm_w, da.norm_eps, da.q16, da.early);
}
extern "C" int sim_decode(int f16, int dk, int cw, int gx, int block, const void* raw, const float* window,
                          const float* w, float* rows_out, const void* alpha, const void* b, const float* ssm_a,
                          const float* dt, int Hk, int Hv, int DV, int C, float q_scale, float eps, const float* s0,
                          float* s_final, const int* swap, i64 alt, float* out, const void* z,
                          const float* norm_w, float norm_eps, uint4* q16, int early) {
    da = {raw, window, w, rows_out, alpha, b, ssm_a, dt, Hk, Hv, DV, C, q_scale, eps, s0, s_final, swap, alt, out,
          z, norm_w, norm_eps, q16, early};
    Body fn = nullptr;
#define DN_PICK_DEC(dk_, cw_) \
    if (dk == dk_ && cw == cw_) fn = f16 ? decode_body<u16, dk_, cw_> : decode_body<float, dk_, cw_>;
    DN_PICK_DEC(128, 8)
    DN_PICK_DEC(128, 4)
    DN_PICK_DEC(64, 8)
#undef DN_PICK_DEC
    if (!fn) return -1;
    return launch(gx, block, fn);
}
