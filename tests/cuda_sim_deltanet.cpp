// CPU simulation of kernels/deltanet.cu for machines without a GPU (tests/test_kernels_deltanet_sim.py).
//
// The .cu file is compiled as plain C++ (g++ -std=c++17 -DDN_SOURCE='"path"') on the fiber simulator of
// tests/cuda_sim.h: no __CUDA_ARCH__, so the fp16 conversion takes its software path; everything else (index
// arithmetic, parent walks, register layouts, the xor-shuffle reductions, prefetching, in-place commits) is the
// code the GPU runs. The deltanet kernels use no __syncthreads, so warps may run one after another (each works in its
// own part of the dynamic shared memory).
#include <cmath>

#include "cuda_sim.h"

// deltanet.cu reduces with xor shuffles; cuda_sim.h has the indexed form (kept here so cuda_sim.h is untouched)
namespace sim {
static inline float shfl_xor(float v, int m) { return __uint_as_float(shfl(__float_as_uint(v), cur ^ m)); }
}  // namespace sim
#define __shfl_xor_sync(mask, v, m) sim::shfl_xor((v), (m))

// dynamic shared memory of the walk / commit / plan kernels (warps of a block run one after another,
// each on its own part of it)
constexpr size_t SIM_SMEM = 227 * 1024;
alignas(16) uint4 dn_smem[SIM_SMEM / 16];
extern "C" size_t sim_smem_bytes() { return SIM_SMEM; }
static void stale_smem() { std::memset(dn_smem, 0xA5, sizeof(dn_smem)); }  // garbage, not zeros

// Warps run one after another here, so a block-wide barrier cannot be honoured: the kernels that use one
// (gdr_decode_kernel) run on tests/cuda_sim_deltanet_block.cpp, and reaching one here is a simulation error.
static void no_block_barrier() {
    ++sim::errors;
    std::fprintf(stderr, "cuda_sim_deltanet: __syncthreads in warp mode (use the block-mode harness)\n");
}
#define __syncthreads() no_block_barrier()

#include DN_SOURCE

typedef void (*Body)();
static Body body;

// One launch: every block of the grid, each block's warps in turn.
static int launch(sim_dim3 grid, unsigned threads, Body fn) {
    sim::errors = 0;
    sim::gdim = grid;
    sim::bdim = {threads, 1, 1};
    sim::lane_fn = fn;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                sim::bid = {bx, by, bz};
                for (unsigned w = 0; w < (threads + 31) / 32; ++w) sim::run_warp(32u * w);
            }
    return sim::errors;
}

// One entry per kernel: the grid and block of the launch, then exactly the kernel's own parameters (so the same
// calls serve the direct tests and kernels/deltanet.py run on a NumPy-backed stand-in for CuPy).
static sim_dim3 g2(int gx, int gy) { return {(unsigned)gx, (unsigned)gy, 1}; }

// ---- conv
struct ConvArgs { const void* raw; i64 ld_raw; const float* window; const float* w; const int* parents;
                  const int* n_tokens; int t_max, C; float* out; i64 ld_out; int early; };
static ConvArgs ca;
template <typename TIn>
static void conv_lane() {
    conv_silu_kernel<TIn, 4>((const TIn*)ca.raw, ca.ld_raw, ca.window, ca.w, ca.parents, ca.n_tokens, ca.t_max,
                             ca.C, ca.out, ca.ld_out, ca.early);
}
extern "C" int sim_conv(int f16, int gx, int gy, int block, const void* raw, i64 ld_raw, const float* window,
                        const float* w, const int* parents, const int* n_tokens, int t_max, int C, float* out,
                        i64 ld_out, int early) {
    ca = {raw, ld_raw, window, w, parents, n_tokens, t_max, C, out, ld_out, early};
    return launch(g2(gx, gy), block, f16 ? conv_lane<u16> : conv_lane<float>);
}

struct ConvRowsArgs { ConvArgs c; float* rows_out; i64 ld_rows; };
static ConvRowsArgs cra;
template <typename TIn>
static void conv_rows_lane() {
    const ConvArgs& a = cra.c;
    conv_silu_rows_kernel<TIn, 4>((const TIn*)a.raw, a.ld_raw, a.window, a.w, a.parents, a.n_tokens, a.t_max, a.C,
                                  a.out, a.ld_out, cra.rows_out, cra.ld_rows, a.early);
}
extern "C" int sim_conv_rows(int f16, int gx, int gy, int block, const void* raw, i64 ld_raw, const float* window,
                             const float* w, const int* parents, const int* n_tokens, int t_max, int C, float* out,
                             i64 ld_out, float* rows_out, i64 ld_rows, int early) {
    cra = {{raw, ld_raw, window, w, parents, n_tokens, t_max, C, out, ld_out, early}, rows_out, ld_rows};
    return launch(g2(gx, gy), block, f16 ? conv_rows_lane<u16> : conv_rows_lane<float>);
}

// ---- q/k norm + gates
struct NormArgs { float* qk; i64 ld; int Hk; float q_scale, eps; const void* alpha; const void* b; i64 ld_ab;
                  const float* ssm_a; const float* dt; int Hv; float* g; float* beta; i64 ld_gb; const int* n_tokens;
                  int t_max; };
static NormArgs na;
template <typename TIn, int DK>
static void norm_lane() {
    qk_norm_gate_kernel<TIn, DK>(na.qk, na.ld, na.Hk, na.q_scale, na.eps, (const TIn*)na.alpha, (const TIn*)na.b,
                                 na.ld_ab, na.ssm_a, na.dt, na.Hv, na.g, na.beta, na.ld_gb, na.n_tokens, na.t_max);
}
extern "C" int sim_norm(int f16, int dk, int gx, int gy, int block, float* qk, i64 ld, int Hk, float q_scale,
                        float eps, const void* alpha, const void* b, i64 ld_ab, const float* ssm_a, const float* dt,
                        int Hv, float* g, float* beta, i64 ld_gb, const int* n_tokens, int t_max) {
    na = {qk, ld, Hk, q_scale, eps, alpha, b, ld_ab, ssm_a, dt, Hv, g, beta, ld_gb, n_tokens, t_max};
    Body fn = nullptr;
    if (dk == 128) fn = f16 ? norm_lane<u16, 128> : norm_lane<float, 128>;
    if (dk == 64) fn = f16 ? norm_lane<u16, 64> : norm_lane<float, 64>;
    if (!fn) return -1;
    return launch(g2(gx, gy), block, fn);
}

// ---- conv + q/k norm + gates in one launch
struct ConvNormArgs { const void* raw; i64 ld_raw; const float* window; const float* w; const int* parents;
                      const int* n_tokens; int t_max, C; float* out; i64 ld_out; float* rows_out; i64 ld_rows; int Hk;
                      float q_scale, eps; const void* alpha; const void* b; i64 ld_ab; const float* ssm_a;
                      const float* dt; int Hv; float* g; float* beta; i64 ld_gb; };
static ConvNormArgs cna;
template <typename TIn, int DK, int ROWS>
static void conv_norm_lane() {
    conv_qk_norm_gate_kernel<TIn, 4, DK, ROWS>((const TIn*)cna.raw, cna.ld_raw, cna.window, cna.w, cna.parents,
                                               cna.n_tokens, cna.t_max, cna.C, cna.out, cna.ld_out, cna.rows_out,
                                               cna.ld_rows, cna.Hk, cna.q_scale, cna.eps, (const TIn*)cna.alpha,
                                               (const TIn*)cna.b, cna.ld_ab, cna.ssm_a, cna.dt, cna.Hv, cna.g, cna.beta,
                                               cna.ld_gb);
}
extern "C" int sim_conv_norm(int f16, int dk, int rows, int gx, int gy, int block, const void* raw, i64 ld_raw,
                             const float* window, const float* w, const int* parents, const int* n_tokens, int t_max,
                             int C, float* out, i64 ld_out, float* rows_out, i64 ld_rows, int Hk, float q_scale,
                             float eps, const void* alpha, const void* b, i64 ld_ab, const float* ssm_a,
                             const float* dt, int Hv, float* g, float* beta, i64 ld_gb) {
    cna = {raw, ld_raw, window, w, parents, n_tokens, t_max, C, out, ld_out, rows_out, ld_rows, Hk, q_scale, eps,
           alpha, b, ld_ab, ssm_a, dt, Hv, g, beta, ld_gb};
    Body fn = nullptr;
#define DN_PICK_CN(dk_, rows_) \
    if (dk == dk_ && rows == rows_) fn = f16 ? conv_norm_lane<u16, dk_, rows_> : conv_norm_lane<float, dk_, rows_>;
    DN_PICK_CN(128, 0)
    DN_PICK_CN(128, 1)
    DN_PICK_CN(64, 0)
    DN_PICK_CN(64, 1)
#undef DN_PICK_CN
    if (!fn) return -1;
    return launch(g2(gx, gy), block, fn);
}

// ---- tree walk (plan + shared-memory state stack), its plan, the commit by replay
struct PlanArgs { const int* parents; const int* n_tokens; int t_max; int* plan; };
static PlanArgs pa;
static void plan_lane() { gdr_tree_plan_kernel(pa.parents, pa.n_tokens, pa.t_max, pa.plan); }
extern "C" int sim_plan(int gx, int block, const int* parents, const int* n_tokens, int t_max, int* plan) {
    pa = {parents, n_tokens, t_max, plan};
    stale_smem();
    return launch(g2(gx, 1), block, plan_lane);
}

struct WalkArgs { const void* q; const void* k; i64 ld_qk; const void* v; i64 ld_v; const float* g;
                  const float* beta; i64 ld_gb; int Hk, Hv, DV; const float* s0; const int* plan;
                  const int* n_tokens; int t_max, n_slots; float* s_final; const int* swap; i64 alt; float* out;
                  i64 ld_out; int early; };
static WalkArgs wa;
template <typename TIn, int DK, int CW, int D>
static void walk_lane() {
    gdr_tree_walk_kernel<TIn, DK, CW, D>((const TIn*)wa.q, (const TIn*)wa.k, wa.ld_qk, (const TIn*)wa.v, wa.ld_v,
                                         wa.g, wa.beta, wa.ld_gb, wa.Hk, wa.Hv, wa.DV, wa.s0, wa.plan, wa.n_tokens,
                                         wa.t_max, wa.n_slots, wa.s_final, wa.swap, wa.alt, wa.out, wa.ld_out,
                                         wa.early);
}
#define DN_PICK(F, dk_, cw_, d_) \
    if (dk == dk_ && cw == cw_ && depth == d_) fn = f16 ? F<u16, dk_, cw_, d_> : F<float, dk_, cw_, d_>;
extern "C" int sim_tree_walk(int f16, int dk, int cw, int depth, int gx, int block, const void* q, const void* k,
                             i64 ld_qk, const void* v, i64 ld_v, const float* g, const float* beta, i64 ld_gb,
                             int Hk, int Hv, int DV, const float* s0, const int* plan, const int* n_tokens, int t_max,
                             int n_slots, float* s_final, const int* swap, i64 alt, float* out, i64 ld_out,
                             int early) {
    wa = {q, k, ld_qk, v, ld_v, g, beta, ld_gb, Hk, Hv, DV, s0, plan, n_tokens, t_max, n_slots, s_final, swap, alt, out,
          ld_out, early};
    Body fn = nullptr;
    DN_PICK(walk_lane, 128, 8, 8)
    DN_PICK(walk_lane, 128, 4, 8)
    DN_PICK(walk_lane, 64, 8, 8)
    DN_PICK(walk_lane, 128, 8, 2)
    DN_PICK(walk_lane, 128, 8, 16)
    if (!fn) return -1;
    stale_smem();
    return launch(g2(gx, 1), block, fn);
}

struct ReplayArgs { const void* k; const void* v; i64 ld_kv, ld_layer_kv; const float* g; const float* beta;
                    i64 ld_gb, ld_layer_gb; int Hk, Hv, DV; float* state; i64 ld_layer_state; const int* parents;
                    const int* accepted; int t_max; const int* swap; i64 alt; };
static ReplayArgs ra;
template <typename TIn, int DK, int CW, int D>
static void replay_lane() {
    gdr_commit_kernel<TIn, DK, CW, D>((const TIn*)ra.k, (const TIn*)ra.v, ra.ld_kv, ra.ld_layer_kv, ra.g,
                                      ra.beta, ra.ld_gb, ra.ld_layer_gb, ra.Hk, ra.Hv, ra.DV, ra.state,
                                      ra.ld_layer_state, ra.parents, ra.accepted, ra.t_max, ra.swap, ra.alt);
}
extern "C" int sim_commit_replay(int f16, int dk, int cw, int depth, int gx, int gy, int block, const void* k,
                                 const void* v, i64 ld_kv, i64 ld_layer_kv, const float* g, const float* beta,
                                 i64 ld_gb, i64 ld_layer_gb, int Hk, int Hv, int DV, float* state,
                                 i64 ld_layer_state, const int* parents, const int* accepted, int t_max,
                                 const int* swap, i64 alt) {
    ra = {k, v, ld_kv, ld_layer_kv, g, beta, ld_gb, ld_layer_gb, Hk, Hv, DV, state, ld_layer_state, parents,
          accepted, t_max, swap, alt};
    Body fn = nullptr;
    DN_PICK(replay_lane, 128, 8, 8)
    DN_PICK(replay_lane, 128, 4, 8)
    DN_PICK(replay_lane, 64, 8, 8)
    DN_PICK(replay_lane, 128, 8, 2)
    DN_PICK(replay_lane, 128, 8, 16)
    if (!fn) return -1;
    stale_smem();
    return launch(g2(gx, gy), block, fn);
}

// ---- commit of the conv window
struct ConvCommitArgs { float* window; i64 win_ls; const void* raw; i64 ld_raw; i64 raw_ls; const int* parents;
                        const int* accepted; int t_max, C; };
static ConvCommitArgs cc;
template <typename TIn>
static void conv_commit_lane() {
    conv_commit_kernel<TIn, 4>(cc.window, cc.win_ls, (const TIn*)cc.raw, cc.ld_raw, cc.raw_ls, cc.parents,
                               cc.accepted, cc.t_max, cc.C);
}
extern "C" int sim_conv_commit(int f16, int gx, int gy, int block, float* window, i64 win_ls, const void* raw,
                               i64 ld_raw, i64 raw_ls, const int* parents, const int* accepted, int t_max, int C) {
    cc = {window, win_ls, raw, ld_raw, raw_ls, parents, accepted, t_max, C};
    return launch(g2(gx, gy), block, f16 ? conv_commit_lane<u16> : conv_commit_lane<float>);
}

// the shared-memory layouts the kernels use, for the launchers' byte counts to be checked against
extern "C" long long sim_walk_smem(int f16, int dk, int cw, int depth, int n_slots, int plan_ints) {
#define DN_WS(dk_, cw_, d_) \
    if (dk == dk_ && cw == cw_ && depth == d_) \
        return f16 ? WalkSmem<u16, dk_, cw_, d_>::bytes(n_slots, plan_ints) : WalkSmem<float, dk_, cw_, d_>::bytes(n_slots, plan_ints);
    DN_WS(128, 8, 8) DN_WS(128, 4, 8) DN_WS(64, 8, 8) DN_WS(128, 8, 2)
    return -1;
}
extern "C" long long sim_commit_smem(int f16, int dk, int depth, int t_max) {
#define DN_CS(dk_, d_) \
    if (dk == dk_ && depth == d_) return f16 ? CommitSmem<u16, dk_, d_>::bytes(t_max) : CommitSmem<float, dk_, d_>::bytes(t_max);
    DN_CS(128, 8) DN_CS(64, 8) DN_CS(128, 2)
    return -1;
}
