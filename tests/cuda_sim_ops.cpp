// CPU simulation of kernels/norm_rope.cu, attention.cu and sampling.cu (tests/test_kernels_ops_sim.py), and of
// the fused pieces of quant_matmul.cu (pack prologues, accumulating epilogue) and deltanet.cu (conv that keeps
// its raw rows) for tests/test_kernels_cpu_sim.py and test_kernels_ops_sim.py.
//
// Built once per source: g++ -std=c++17 -DOPS_FAMILY=<1 norm_rope | 2 attention | 3 sampling | 4 quant_matmul
// | 5 deltanet> -DOPS_SOURCE='"path"'. The .cu file compiles as plain C++ (no __CUDA_ARCH__: the portable path, software
// fp16 and the warp-shuffle mma emulation) with every thread of a block a fiber (tests/cuda_sim.h block
// mode), so __syncthreads, shared memory, shuffles, the fragment layouts, swizzles, masks, splits and the
// two-pass reductions all run for real; only the inline-PTX leaf instructions are left to the GPU test.
#define SIM_BLOCK
#include <math.h>

#include <algorithm>
#include <functional>

#include "cuda_sim.h"

alignas(16) uint4 ssa_smem[(232 * 1024) / 16];  // attention.cu's dynamic shared memory
#if OPS_FAMILY == 4
#define ss_smem ssa_smem  // quant_matmul.cu's dynamic shared memory: the same buffer, reset per block
#endif
#if OPS_FAMILY == 5
#define dn_smem ssa_smem  // deltanet.cu's (its tree plan kernel names it; tests/cuda_sim_deltanet.cpp drives those)
#endif

#include OPS_SOURCE

static std::function<void()> g_body;
static void trampoline() { g_body(); }

// sim_smem_high: with tracking on, one past the highest byte of the dynamic shared memory any block of the launches
// since changed from the 0xA5 it starts on (a kernel must stay within what its launcher reserves)
static bool g_track_smem = false;
static long long g_smem_high = 0;

static void note_smem_high() {
    if (!g_track_smem) return;
    const unsigned char* b = reinterpret_cast<const unsigned char*>(ssa_smem);
    long long i = (long long)sizeof(ssa_smem);
    while (i > g_smem_high && b[i - 1] == 0xA5) --i;
    if (i > g_smem_high) g_smem_high = i;
}

// track != 0: start tracking from zero; returns the high-water mark so far (and stops tracking when track is 0)
extern "C" long long sim_smem_high(int track) {
    const long long high = g_smem_high;
    g_track_smem = track != 0;
    if (track) g_smem_high = 0;
    return high;
}

// Runs g_body as every block of a (gx, gy, gz) grid of `threads` threads; returns the simulation errors.
static int launch(unsigned gx, unsigned gy, unsigned gz, unsigned threads) {
    int errors = 0;
    sim::gdim = {gx, gy, gz};
    sim::bdim = {threads, 1, 1};
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                sim::bid = {x, y, z};
                std::memset(ssa_smem, 0xA5, sizeof(ssa_smem));  // stale shared memory must not matter
                errors += simb::run_block((int)threads, trampoline);
                note_smem_high();
            }
    return errors;
}

// As launch(), the blocks in another order: 0 as launch() does, 1 the reverse, 2 a fixed shuffle. Kernels whose
// last block to arrive finishes a row's work must not depend on which block that is.
static int launch_ordered(unsigned gx, unsigned gy, unsigned threads, int order, unsigned gz = 1) {
    std::vector<unsigned> ids = sim::block_order(gx * gy * gz, order == 2 ? 0x9E3779B97F4A7C15ull : 0ull);
    if (order == 1) std::reverse(ids.begin(), ids.end());
    int errors = 0;
    sim::gdim = {gx, gy, gz};
    sim::bdim = {threads, 1, 1};
    for (unsigned id : ids) {
        sim::bid = {id % gx, id / gx % gy, id / (gx * gy)};
        std::memset(ssa_smem, 0xA5, sizeof(ssa_smem));
        errors += simb::run_block((int)threads, trampoline);
    }
    return errors;
}

#define CASE3(A, B, C, CALL) \
    if (a == A && b == B && c == C) { CALL; }

#if OPS_FAMILY == 1
extern "C" int sim_rms_norm(int ti, int to, int res, const void* x, const void* r, void* s, const float* w, void* y,
                            int rows, int n, float eps) {
    const int a = ti, b = to, c = res;
    g_body = nullptr;
    CASE3(0, 0, 0, (g_body = [=] { rms_norm_kernel<0, 0, 0>(x, r, s, w, y, n, eps); }))
    CASE3(0, 0, 1, (g_body = [=] { rms_norm_kernel<0, 0, 1>(x, r, s, w, y, n, eps); }))
    CASE3(0, 1, 1, (g_body = [=] { rms_norm_kernel<0, 1, 1>(x, r, s, w, y, n, eps); }))
    CASE3(1, 1, 0, (g_body = [=] { rms_norm_kernel<1, 1, 0>(x, r, s, w, y, n, eps); }))
    CASE3(1, 1, 1, (g_body = [=] { rms_norm_kernel<1, 1, 1>(x, r, s, w, y, n, eps); }))
    CASE3(2, 0, 1, (g_body = [=] { rms_norm_kernel<2, 0, 1>(x, r, s, w, y, n, eps); }))
    CASE3(0, 2, 0, (g_body = [=] { rms_norm_kernel<0, 2, 0>(x, r, s, w, y, n, eps); }))
    if (!g_body) return -1;
    return launch(rows, 1, 1, 256);
}

extern "C" int sim_head_norm(int ti, int to, int D, int mode, const void* x0, long long x0_tok, long long x0_head,
                             int H0, const float* w0, void* y0, const void* x1, long long x1_tok, long long x1_head,
                             int H1, const float* w1, void* y1, int T, const void* z, const int* pos,
                             const float* inv_freq, int n_rot, float eps) {
    g_body = nullptr;
#define HN(TI, TO, DD, MODE)                                                                                  \
    if (ti == TI && to == TO && D == DD && mode == MODE)                                                      \
        g_body = [=] {                                                                                        \
            head_norm_kernel<TI, TO, DD, MODE>(x0, x0_tok, x0_head, H0, w0, y0, x1, x1_tok, x1_head, H1, w1, y1, \
                                               T, z, pos, inv_freq, n_rot, eps);                              \
        };
    HN(0, 0, 64, 0)
    HN(0, 0, 128, 0)
    HN(0, 0, 256, 0)
    HN(1, 1, 256, 0)
    HN(0, 1, 96, 0)
    HN(0, 0, 128, 1)
    HN(1, 0, 64, 1)
#undef HN
    if (!g_body) return -1;
    const int rows = T * (H0 + H1);
    return launch((rows + 3) / 4, 1, 1, 128);
}

extern "C" int sim_silu_mul(int ti, int to, const void* g, long long g_ld, const void* u, long long u_ld, void* y,
                            int T, int n, int blocks) {
    g_body = nullptr;
    if (ti == 0 && to == 0) g_body = [=] { silu_mul_kernel<0, 0>(g, g_ld, u, u_ld, y, T, n); };
    if (ti == 1 && to == 1) g_body = [=] { silu_mul_kernel<1, 1>(g, g_ld, u, u_ld, y, T, n); };
    if (!g_body) return -1;
    return launch(blocks, 1, 1, 64);
}

extern "C" int sim_gate_mul(int ti, int tg, int to, const void* x, const void* gate, long long g_tok,
                            long long g_head, void* y, int T, int H, int D, int blocks) {
    const int a = ti, b = tg, c = to;
    g_body = nullptr;
    CASE3(0, 0, 0, (g_body = [=] { gate_mul_kernel<0, 0, 0>(x, gate, g_tok, g_head, y, T, H, D); }))
    CASE3(1, 0, 1, (g_body = [=] { gate_mul_kernel<1, 0, 1>(x, gate, g_tok, g_head, y, T, H, D); }))
    if (!g_body) return -1;
    return launch(blocks, 1, 1, 64);
}
#endif

#if OPS_FAMILY == 2
// KV kinds: 0 f16, 1 Q8_0, 2 TQ3_0 (kk for K, kv for V)
extern "C" int sim_kv_store(int kk, int kv, int ti, const void* k, const void* v, unsigned char* kc,
                            unsigned char* vc, const int* s_len, int T, int Hkv, int D, long long ctx) {
    g_body = nullptr;
#define KS(KK, KV, TI) \
    if (kk == KK && kv == KV && ti == TI) g_body = [=] { kv_store_kernel<KK, KV, TI>(k, v, kc, vc, s_len, T, Hkv, D, ctx); };
    KS(0, 0, 0)
    KS(0, 0, 1)
    KS(1, 1, 0)
    KS(2, 2, 0)
    KS(2, 2, 1)
    KS(1, 2, 0)
    KS(0, 2, 0)
    KS(0, 2, 1)
    KS(2, 0, 0)
    KS(0, 1, 0)
#undef KS
    if (!g_body) return -1;
    return launch(3, 1, 1, 64);  // a small grid: the grid-stride loop covers the rest
}

// kv_move_rows_kernel over n_buf buffers (bases: host pointers) of Hkv heads, `threads` a block.
extern "C" int sim_kv_move_rows(const unsigned long long* bases, const int* units, int n_buf, int Hkv, long long ctx,
                                const long long* dst, const long long* src, const int* count, int threads) {
    g_body = [=] { kv_move_rows_kernel(bases, units, ctx, dst, src, count); };
    return launch((unsigned)Hkv, (unsigned)n_buf, 1, (unsigned)threads);
}

// attn_decode_kernel over an (ns, Hkv, G) grid, its blocks in launch_ordered's `order`.
extern "C" int sim_attn_decode(int kk, int kv, int D, int ti, int G, const void* q, long long q_head,
                               const void* gate, long long g_head, const void* k, const void* v, long long kv_head,
                               const float* q_w, const float* k_w, const int* pos, const float* inv_freq, int n_rot,
                               float eps, unsigned char* kc, unsigned char* vc, const int* s_len, long long ctx,
                               float scale_log2, float* ws_o, float* ws_ml, unsigned int* counters, float* out,
                               void* q16, int ns, int Hkv, int order) {
    g_body = nullptr;
#define AD(KK, KV, DD, TI)                                                                                         \
    if (kk == KK && kv == KV && D == DD && ti == TI)                                                               \
        g_body = [=] {                                                                                           \
            attn_decode_kernel<KK, KV, DD, TI>(q, q_head, gate, g_head, k, v, kv_head, q_w, k_w, pos, inv_freq, n_rot, \
                                               eps, kc, vc, s_len, ctx, scale_log2, ws_o, ws_ml, counters, out,   \
                                               (uint4*)q16);                                                      \
        };
    AD(1, 2, 256, 0)
    AD(0, 0, 128, 0)
    AD(2, 2, 64, 1)
    AD(2, 0, 128, 0)
    AD(0, 1, 256, 1)
#undef AD
    if (!g_body) return -1;
    return launch_ordered((unsigned)ns, (unsigned)Hkv, 128, order, (unsigned)G);
}

extern "C" int sim_attn_partial(int kk, int kv, int D, int tq, int kw, int ds, const void* q, const unsigned char* kc,
                                const unsigned char* vc, const int* s_len, const unsigned long long* mask,
                                int window, int T, int H, int Hkv, long long ctx, float scale_log2, float* ws_o,
                                float* ws_ml, int gx, int splits) {
    g_body = nullptr;
#define AP1(KK, KV, DD, TQ, KW, DS)                                                                                  \
    if (kk == KK && kv == KV && D == DD && tq == TQ && kw == KW && ds == DS)                                         \
        g_body = [=] {                                                                                               \
            attn_partial_kernel<KK, KV, DD, TQ, KW, DS>(q, kc, vc, s_len, mask, window, T, H, Hkv, ctx, scale_log2,   \
                                                        ws_o, ws_ml);                                                 \
        };
// the launcher's warp split (attention.dim_split: dims at KW = 4, keys elsewhere); the other one below for the
// cases test_attention_warp_splits runs both ways
#define AP(KK, KV, DD, TQ, KW) AP1(KK, KV, DD, TQ, KW, ((KW) == 4 ? 1 : 0))
    AP1(1, 2, 256, 1, 4, 0)
    AP1(0, 0, 256, 0, 4, 0)
    AP1(2, 2, 64, 0, 4, 0)
    AP1(2, 2, 128, 0, 4, 0)
    AP1(1, 2, 256, 1, 2, 1)
    AP1(0, 2, 128, 0, 2, 1)
    AP1(1, 1, 64, 0, 2, 1)
    AP(0, 0, 64, 0, 4)
    AP(1, 1, 64, 0, 4)
    AP(0, 0, 64, 1, 1)
    AP(0, 0, 64, 0, 2)
    AP(0, 0, 128, 0, 4)
    AP(1, 1, 128, 0, 1)
    AP(0, 0, 64, 0, 1)
    AP(0, 0, 256, 0, 4)
    AP(1, 1, 256, 1, 2)
    AP(1, 1, 256, 0, 1)
    AP(2, 2, 64, 0, 4)
    AP(2, 2, 128, 0, 1)
    AP(2, 2, 256, 0, 2)
    AP(1, 2, 256, 1, 4)
    AP(1, 2, 256, 1, 2)
    AP(1, 2, 256, 1, 1)
    AP(2, 0, 64, 1, 2)
    AP(2, 2, 128, 0, 4)
    AP(0, 2, 128, 0, 2)
    AP(1, 1, 64, 0, 1)
    AP(1, 1, 64, 0, 2)
    AP(2, 2, 64, 0, 1)
    AP(2, 2, 64, 0, 2)
    AP(1, 2, 64, 0, 1)
    AP(1, 2, 64, 0, 2)
    AP(1, 2, 64, 0, 4)
    AP(0, 0, 64, 1, 2)
    AP(0, 0, 64, 1, 4)
    AP(1, 2, 64, 1, 2)
    AP(1, 2, 128, 1, 4)
    AP(2, 2, 64, 2, 4)
#undef AP
#undef AP1
    if (!g_body) return -1;
    return launch(gx, Hkv, splits, 128);
}

// deq_tile on one raw tile of KT rows of `kind` (1 Q8_0, 2 TQ3_0; raw readable 16 bytes past the tile, as the
// kernel's shared memory is) by a block of 128 threads, the TQ3_0 pair tables filled first as the kernel does: the
// swizzled f16 tile and (TQ3_0) the group norms (tests/test_kernels_ops_sim.py test_deq_tile_bits)
extern "C" int sim_deq_tile(int kind, int D, const unsigned char* raw, unsigned short* out, float* nrm, int key0,
                            int n) {
    static uint32_t lut[ssa::TQ3_LUT_WORDS];
    g_body = nullptr;
#define DQ(KIND, DD)                                                                                                 \
    if (kind == KIND && D == DD)                                                                                     \
        g_body = [=] {                                                                                               \
            const int tid = (int)threadIdx.x;                                                                        \
            if (KIND == 2) ssa::tq3_lut_fill(lut, tid, 128);                                                         \
            __syncthreads();                                                                                         \
            ssa::deq_tile<KIND, DD>(raw, out, nrm, lut, key0, n, tid, 128);                                          \
        };
    DQ(1, 64) DQ(1, 128) DQ(1, 256) DQ(2, 64) DQ(2, 128) DQ(2, 256)
#undef DQ
    if (!g_body) return -1;
    return launch(1, 1, 1, 128);
}

extern "C" int sim_attn_combine(int to, int tg, int rg, const float* ws_o, const float* ws_ml, int splits, int T,
                                int H, int Hkv, int D, const void* gate, long long g_tok, long long g_head, void* out,
                                void* q16) {
    g_body = nullptr;
#define AC(TO, TG, RG)                                                                                          \
    if (to == TO && tg == TG && rg == RG)                                                                       \
        g_body = [=] {                                                                                          \
            attn_combine_kernel<TO, TG, RG>(ws_o, ws_ml, splits, T, H, Hkv, D, gate, g_tok, g_head, out,      \
                                            (uint4*)q16);                                                      \
        };
    AC(0, 0, 0)
    AC(1, 1, 0)
    AC(0, 0, 64)
    AC(0, 0, 128)
    AC(1, 1, 128)
#undef AC
    if (!g_body) return -1;
    return launch(H * T, 1, 1, COMB_THREADS);
}
#endif

#if OPS_FAMILY == 3
extern "C" int sim_argmax(int ti, const void* x, long long ld, int rows, int n, int chunks, int chunk,
                          unsigned long long* part, int* idx, float* val, int* next_tok, int* next_pos, int* s_len,
                          int* swap) {
    g_body = nullptr;
    if (ti == 0) g_body = [=] { argmax_partial_kernel<0>(x, ld, n, chunk, part); };
    if (ti == 1) g_body = [=] { argmax_partial_kernel<1>(x, ld, n, chunk, part); };
    if (!g_body) return -1;
    int err = launch(chunks, rows, 1, 256);
    g_body = [=] { argmax_final_kernel(part, chunks, rows, idx, val, next_tok, next_pos, s_len, swap); };
    return err + launch((rows + 3) / 4, 1, 1, 128);
}

extern "C" int sim_topk(int ti, int k, const void* x, long long ld, int rows, int n, int chunks, int chunk,
                        float inv_temp, float* ms, float* pv, int* pi, float* logp, int* ids) {
    g_body = nullptr;
#define TK(TI, K)                                                                                        \
    if (ti == TI && k == K) {                                                                            \
        g_body = [=] { topk_partial_kernel<TI, K>(x, ld, n, chunk, inv_temp, ms, pv, pi); };             \
        int err = launch(chunks, rows, 1, 256);                                                          \
        g_body = [=] { topk_final_kernel<K>(ms, pv, pi, chunks, logp, ids); };                           \
        return err + launch(rows, 1, 1, 256);                                                            \
    }
    TK(0, 1)
    TK(0, 3)
    TK(0, 8)
    TK(1, 4)
#undef TK
    return -1;
}

// kernels/sampling.py token_logprobs' two launches, one at a time (the launcher's own argument tuples).
extern "C" int sim_topk_partial20(const void* x, long long ld, int rows, int n, int chunks, int chunk,
                                  float inv_temp, float* ms, float* pv, int* pi) {
    g_body = [=] { topk_partial_kernel<0, 20>(x, ld, n, chunk, inv_temp, ms, pv, pi); };
    return launch(chunks, rows, 1, 256);
}

extern "C" int sim_topk_token_final20(int rows, const float* ms, const float* pv, const int* pi, int chunks,
                                      float* logp, int* ids, const float* x, long long ld, const int* tok,
                                      float inv_temp, float* out_tok) {
    g_body = [=] { topk_token_final_kernel<20>(ms, pv, pi, chunks, logp, ids, x, ld, tok, inv_temp, out_tok); };
    return launch(rows, 1, 1, 256);
}

// The exact sampler's kernels (kernels/sampling.py runs them in this order: prep, the select passes, draw_sum,
// then draw_scan or probs); `order`: launch_ordered's block order.
extern "C" int sim_sample_prep(const float* x, long long ldx, const int* rin, int rows, int n, const int* tok, double rp,
                               double fp, double pp, float* zs, long long ldz, unsigned* pm, void* st,
                               const int* bias_ids, const double* bias_vals, int n_bias) {
    const int nch = (n + sxs::CHUNK - 1) / sxs::CHUNK;
    g_body = [=] {
        sample_prep_kernel(x, ldx, rin, n, tok, rp, fp, pp, zs, ldz, pm, (sxs::RowState*)st, bias_ids, bias_vals,
                           n_bias);
    };
    return launch(nch, rows, 1, 256);
}

extern "C" int sim_sample_select(int lane, const float* z, long long ldz, int zsel, const int* rin, int rows, int n,
                                 int level, double temp, int top_k, double top_p, const unsigned* pm, void* st,
                                 unsigned* hcnt, unsigned long long* hlo, unsigned long long* hhi, unsigned* counters,
                                 int order) {
    const int nch = (n + sxs::CHUNK - 1) / sxs::CHUNK;
    sxs::RowState* s = (sxs::RowState*)st;
    if (lane == 0)
        g_body = [=] { sample_select_kernel<0>(z, ldz, zsel, rin, n, level, temp, top_k, top_p, pm, s, hcnt, hlo, hhi,
                                               counters); };
    else
        g_body = [=] { sample_select_kernel<1>(z, ldz, zsel, rin, n, level, temp, top_k, top_p, pm, s, hcnt, hlo, hhi,
                                               counters); };
    return launch_ordered(nch, rows, 256, order);
}

extern "C" int sim_sample_draw_sum(const float* z, long long ldz, int zsel, const int* rin, int rows, int n, double temp,
                                   int lane, double min_p, const double* us, const unsigned* pm, void* st,
                                   double* rmass, unsigned* rties, unsigned* counters, int order) {
    const int nch = (n + sxs::CHUNK - 1) / sxs::CHUNK;
    g_body = [=] { sample_draw_sum_kernel(z, ldz, zsel, rin, n, temp, lane, min_p, us, pm, (sxs::RowState*)st, rmass,
                                          rties, counters); };
    return launch_ordered(nch, rows, 256, order);
}

extern "C" int sim_sample_draw_scan(const float* z, long long ldz, int zsel, const int* rin, int rows, int n,
                                    double temp, int lane, double min_p, const unsigned* pm, const void* st, int* out) {
    g_body = [=] { sample_draw_scan_kernel(z, ldz, zsel, rin, n, temp, lane, min_p, pm, (const sxs::RowState*)st, out); };
    return launch(rows, 1, 1, 256);
}

extern "C" int sim_sample_probs(const float* z, long long ldz, int zsel, const int* rin, int rows, int n, double temp,
                                int lane, double min_p, const unsigned* pm, const void* st, const unsigned* rties,
                                double* out, long long ldo) {
    const int nch = (n + sxs::CHUNK - 1) / sxs::CHUNK;
    g_body = [=] { sample_probs_kernel(z, ldz, zsel, rin, n, temp, lane, min_p, pm, (const sxs::RowState*)st, rties,
                                       out, ldo); };
    return launch(nch, rows, 1, 256);
}

extern "C" int sim_sample_state_bytes() { return (int)sizeof(sxs::RowState); }
#endif

#if OPS_FAMILY == 4
// pack_rms_kernel (mode 0) or pack_silu_kernel (mode 1) into xp (K * tpad halves); silu: r = the up rows.
// mode 0: blocks = T * slices row blocks + the padding blocks (0: one padding block when T < tpad). q16: also the
// gemv staging (PackedX.q16), or null.
extern "C" int sim_pack_fused(int mode, int in_f32, int res, int gate, const void* x, long long ldx, const void* r,
                              void* s, const void* z, long long ldz, const float* w, int group, float eps, int T, int K,
                              int tpad, void* xp, int blocks, int slices, void* q16) {
    g_body = nullptr;
#define PR(F, R, G)                                                                                         \
    if (mode == 0 && in_f32 == F && res == R && gate == G)                                                  \
        g_body = [=] { pack_rms_kernel<F, R, G>(x, ldx, r, s, z, ldz, w, group, eps, T, K, tpad, (uint4*)xp, slices, \
                                                 (uint4*)q16); };
    PR(1, 0, 0)
    PR(1, 1, 0)
    PR(0, 1, 0)
    PR(1, 0, 1)
    PR(0, 0, 1)
    PR(0, 1, 1)
    PR(1, 1, 1)
#undef PR
    if (mode == 1 && in_f32) g_body = [=] { pack_silu_kernel<1>(x, ldx, r, ldz, T, K, tpad, (uint4*)xp, (uint4*)q16); };
    if (mode == 1 && !in_f32) g_body = [=] { pack_silu_kernel<0>(x, ldx, r, ldz, T, K, tpad, (uint4*)xp, (uint4*)q16); };
    if (!g_body) return -1;
    if (mode == 0 && blocks == 0) blocks = T * slices + (T < tpad ? 1 : 0);
    return mode == 0 ? launch(blocks, 1, 1, 256) : launch(blocks, 1, 1, 64);
}

// embed_rows_kernel<qt>: rows ids[0..T) of a (rows, row_bytes) table decoded into out [T, K] float32.
extern "C" int sim_embed_rows(int qt, const unsigned char* table, long long row_bytes, int rows, const int* ids, int T,
                              int K, float* out) {
    g_body = nullptr;
#define ER(QT) \
    if (qt == QT) g_body = [=] { embed_rows_kernel<QT>(table, row_bytes, rows, ids, K, out); };
    ER(0)
    ER(1)
    ER(8)
    ER(12)
#undef ER
    if (!g_body) return -1;
    return launch((K + 255) / 256, T, 1, 256);
}

// qmv_kernel (v2) on W in device_layout(); accumulate: y += x @ W^T; ldy: y's row stride in floats (0: N).
extern "C" int sim_qmv_acc(int qt, int nt, int mt, int kw, const unsigned char* W, long long row_bytes, int N, int K,
                           const void* xp, int T, float* y, int splits, int grid_x, int accumulate, long long ldy) {
    g_body = nullptr;
#define QV(QT, NT, MT)                                                                                   \
    if (qt == QT && nt == NT && mt == MT)                                                                \
        g_body = [=] { qmv_kernel<QT, NT, MT>(W, row_bytes, N, K, (const uint4*)xp, T, y, 2, accumulate, ldy); };
    QV(12, 1, 1)
    QV(8, 2, 2)
#undef QV
    if (!g_body) return -1;
    return launch(grid_x, splits, 1, 32 * kw);
}
#endif

#if OPS_FAMILY == 5
// conv_silu_rows_kernel<f32 | f16, 4>: the conv and the raw rows copied to rows_out in one launch.
// early: the kernel's weights and window loads before its grid dependency wait (a no-op here: the same results)
extern "C" int sim_conv_rows(int f16, const void* raw, long long ld_raw, const float* window, const float* w,
                             const int* parents, int t_max, int C, float* out, long long ld_out, float* rows_out,
                             long long ld_rows, int early) {
    if (f16)
        g_body = [=] { conv_silu_rows_kernel<u16, 4>((const u16*)raw, ld_raw, window, w, parents, nullptr, t_max, C,
                                                     out, ld_out, rows_out, ld_rows, early); };
    else
        g_body = [=] { conv_silu_rows_kernel<float, 4>((const float*)raw, ld_raw, window, w, parents, nullptr, t_max,
                                                       C, out, ld_out, rows_out, ld_rows, early); };
    return launch((C + 127) / 128, t_max, 1, 128);
}
#endif
