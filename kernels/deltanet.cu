// Gated DeltaNet kernels for decode, speculative trees and prefill (Qwen3.5 / Qwen3.6 linear-attention layers).
//
// NumPy twins (services/engine): layers.conv_window_ids + layers.causal_conv (conv_silu_kernel),
// models/qwen35._deltanet's l2-norm / scale / gate lines (qk_norm_gate_kernel), layers.gated_delta_rule_tree
// (gdr_tree_walk_kernel's outputs; a chain or a prompt is a tree whose parents are t - 1), kernels/deltanet.py
// walk_plan (gdr_tree_plan_kernel), state.SequenceState.commit (gdr_commit_kernel + conv_commit_kernel).
// Launchers and layouts: kernels/deltanet.py.
//
// Graph replay: the token count, the parent list, the plan and the accepted node are read from device memory, the
// grids are sized for T_max, so one captured launch serves every tree shape up to T_max.
//
// Tree step and commit layout. Each column j of a head's state S (dk x dv) evolves on its own: with
// a = exp(g), S_j <- a S_j + k (beta (v_j - a k.S_j)), out_j = q.S_j. So a warp owns CW columns of one
// value head: lane = (row group rg = lane / CW, column c = lane % CW) keeps R = dk * CW / 32 consecutive rows
// of its column in registers, the dot products over dk are a per-lane FMA chain plus log2(32 / CW) xor
// shuffles, and no __syncthreads is needed (warps of a block are independent). CW = 8 makes each load or store of
// a state row a full 32-byte sector. Later tokens' q/k/v/g/beta are loaded while token t computes: a cp.async ring
// of D token slots per warp in shared memory.
//
// The per-node checkpoint kernels (gdr_tree_kernel, gdr_tree_staged_kernel, ssm_commit_kernel) that the walk and
// the commit by replay replaced are in git history (commit 3a971f3); docs/gpu_deltanet.md has the measurements.
//
// Includes only pdl.cuh, half.cuh and xq16.cuh of this folder, else what NVRTC (or hipRTC) provides built in.
// Inline PTX (fp16 conversion, cp.async) has a portable fallback (SPECSPLIT_PORTABLE, HIP, pre-sm_80, the CPU
// simulation): software fp16, plain copies.

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

// pdl.cuh: pasted in by kernels/loader.py, found beside this file by the CPU simulation
#include "pdl.cuh"

#ifdef DN_TRACE
// Diagnostic (bench/walk_trace.py): clock64 stamps of block 0's first lane at points of each walk token; a stamp
// waits for a value of the phase before it (a mov reading it), so it marks when that value was ready.
extern "C" __device__ long long dn_trace[256 * 8];
#define DN_STAMP(i, slot, dep)                                                                         \
    do {                                                                                               \
        if (blockIdx.x == 0 && threadIdx.x == 0 && (i) < 256) {                                        \
            unsigned int dn_d_;                                                                        \
            asm volatile("mov.b32 %0, %1;" : "=r"(dn_d_) : "r"(__float_as_uint(dep)));                 \
            long long dn_t_;                                                                           \
            asm volatile("mov.u64 %0, %%clock64;" : "=l"(dn_t_) : "r"(dn_d_) : "memory");              \
            dn_trace[(i) * 8 + (slot)] = dn_t_;                                                        \
        }                                                                                              \
    } while (0)
#else
#define DN_STAMP(i, slot, dep)
#endif

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__) || defined(__HIPCC_RTC__)
#define DN_HIP 1
#else
#define DN_HIP 0
#endif

#if !DN_HIP && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 530) && !defined(SPECSPLIT_PORTABLE)
#define DN_PTX 1
#else
#define DN_PTX 0
#endif

#if !DN_HIP && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800) && !defined(SPECSPLIT_PORTABLE)
#define DN_ASYNC 1
#else
#define DN_ASYNC 0
#endif

// half.cuh (fp16 rounding and SiLU as the packs do them) and xq16.cuh (the gemv's int16 staging): the one-token
// layer's output norm writes ssm_out's staging with the same bits as quant_matmul.cu's norm pack
#define SS_PTX DN_PTX
#include "half.cuh"
#include "xq16.cuh"

#if DN_HIP
#define DN_SYNCWARP() __builtin_amdgcn_wave_barrier()
#define DN_SHFL_XOR(v, m) __shfl_xor((v), (m), 32)
#else
#define DN_SYNCWARP() __syncwarp()
#define DN_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#endif

#define DN_DEV static __device__ __forceinline__
#define DN_MEM __device__ __forceinline__  // member functions

namespace dn {

// IEEE binary16 bits -> float (exact; subnormals, inf, NaN).
DN_DEV float h2f(u32 h) {
#if DN_PTX
    float f;
    const u16 hs = (u16)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(hs));
    return f;
#else
    const u32 sign = (h & 0x8000u) << 16;
    const u32 e = (h >> 10) & 0x1Fu;
    const u32 m = h & 0x3FFu;
    if (e == 0) {
        const float v = (float)m * 5.9604644775390625e-8f;  // m * 2^-24
        return sign ? -v : v;
    }
    if (e == 31) return __uint_as_float(sign | 0x7F800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
#endif
}

DN_DEV float load1(const float* p) { return *p; }
DN_DEV float load1(const u16* p) { return h2f(*p); }

// N consecutive inputs (N a multiple of 4 for float, 8 for half; 16-byte aligned) kept as raw 16-byte words,
// so a prefetch does not wait for its data until get() is called.
template <typename TIn, int N>
struct Vec;

template <int N>
struct Vec<float, N> {
    uint4 w[N / 4];
    DN_MEM void load(const float* p) {
#pragma unroll
        for (int i = 0; i < N / 4; ++i) w[i] = reinterpret_cast<const uint4*>(p)[i];
    }
    DN_MEM void get(float (&d)[N]) const {
#pragma unroll
        for (int i = 0; i < N / 4; ++i) {
            d[4 * i + 0] = __uint_as_float(w[i].x);
            d[4 * i + 1] = __uint_as_float(w[i].y);
            d[4 * i + 2] = __uint_as_float(w[i].z);
            d[4 * i + 3] = __uint_as_float(w[i].w);
        }
    }
};

template <int N>
struct Vec<u16, N> {
    uint4 w[N / 8];
    DN_MEM void load(const u16* p) {
#pragma unroll
        for (int i = 0; i < N / 8; ++i) w[i] = reinterpret_cast<const uint4*>(p)[i];
    }
    DN_MEM void get(float (&d)[N]) const {
#pragma unroll
        for (int i = 0; i < N / 8; ++i) {
            const u32 a[4] = {w[i].x, w[i].y, w[i].z, w[i].w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                d[8 * i + 2 * j] = h2f(a[j] & 0xFFFFu);
                d[8 * i + 2 * j + 1] = h2f(a[j] >> 16);
            }
        }
    }
};

DN_DEV float silu(float x) { return x / (1.0f + expf(-x)); }
DN_DEV float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
// log(1 + e^x) without overflow, as np.logaddexp(0, x)
DN_DEV float softplus(float x) { return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))); }

// Parent of token t: the device list, or t - 1 (a chain) when there is none. Anything but -1..t-1 reads as
// -1 (the committed state), so a corrupt list cannot make a kernel read outside its buffers.
DN_DEV int parent_of(const int* parents, int t) {
    const int p = parents ? parents[t] : t - 1;
    return (p >= -1 && p < t) ? p : -1;
}

DN_DEV int token_count(const int* n_tokens, int t_max) {
    if (!n_tokens) return t_max;
    const int n = *n_tokens;
    return n < 0 ? 0 : (n > t_max ? t_max : n);
}

// One token's state update on a lane's R rows of one state column: decay, then the delta rule,
// S_j <- a S_j + k (beta (v_j - a k.S_j)) with a = exp(g). The tree step and the commit's replay of an accepted path
// both run it, so a replayed state equals the tree step's state for that node bit for bit (same layout CW, same
// order).
template <int R, int CW>
DN_DEV void state_update(float (&s)[R], const float (&kk)[R], float v, float g, float b) {
    const float a = expf(g);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < R; ++r) {
        s[r] *= a;
        acc[r & 3] += s[r] * kk[r];
    }
    float kv = (acc[0] + acc[1]) + (acc[2] + acc[3]);
#pragma unroll
    for (int m = CW; m < 32; m <<= 1) kv += DN_SHFL_XOR(kv, m);
    const float delta = b * (v - kv);
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] += kk[r] * delta;
}

// state_update, then the output q.S_j reduced over the warp's row groups (every lane of the column gets it). The
// output's products come after the update, off the chain from one token's state to the next (a chain or a prefill
// runs at the speed of that chain).
template <int R, int CW>
DN_DEV float token_update(float (&s)[R], const float (&kk)[R], const float (&qq)[R], float v, float g, float b) {
    state_update<R, CW>(s, kk, v, g, b);
    float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < R; ++r) o[r & 3] += s[r] * qq[r];
    float ov = (o[0] + o[1]) + (o[2] + o[3]);
#pragma unroll
    for (int m = CW; m < 32; m <<= 1) ov += DN_SHFL_XOR(ov, m);
    return ov;
}

// A tree leaf's output read off its parent's state without changing it: q.S_j of the updated state as
// a (q.S_j) + (q.k) delta_j from products on the state before the update (token_update's value up to rounding; the
// next child then still finds the parent's state in registers: no save and reload around the leaf).
template <int R, int CW>
DN_DEV float token_output(const float (&s)[R], const float (&kk)[R], const float (&qq)[R], float v, float g,
                          float b) {
    const float a = expf(g);
    float ks[4] = {0.0f, 0.0f, 0.0f, 0.0f}, qs[4] = {0.0f, 0.0f, 0.0f, 0.0f}, qk[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < R; ++r) {
        ks[r & 3] = fmaf(s[r], kk[r], ks[r & 3]);
        qs[r & 3] = fmaf(s[r], qq[r], qs[r & 3]);
        qk[r & 3] = fmaf(kk[r], qq[r], qk[r & 3]);
    }
    float k_s = (ks[0] + ks[1]) + (ks[2] + ks[3]), q_s = (qs[0] + qs[1]) + (qs[2] + qs[3]);
    float q_k = (qk[0] + qk[1]) + (qk[2] + qk[3]);
#pragma unroll
    for (int m = CW; m < 32; m <<= 1) {
        k_s += DN_SHFL_XOR(k_s, m);
        q_s += DN_SHFL_XOR(q_s, m);
        q_k += DN_SHFL_XOR(q_k, m);
    }
    const float delta = b * fmaf(-a, k_s, v);
    return fmaf(q_k, delta, a * q_s);
}

// global -> shared copies of 4 or 16 bytes: cp.async (sm_80+) so that loads run several tokens ahead without
// holding registers; elsewhere (HIP, older GPUs, SPECSPLIT_PORTABLE, the CPU simulation) a plain copy.
template <int N>
DN_DEV void cp_async(void* smem, const void* gmem) {
#if DN_ASYNC
    u32 sa;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }\n" : "=r"(sa) : "l"(smem));
    if (N == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(gmem) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(sa), "l"(gmem) : "memory");
#else
    if (N == 16)
        *(uint4*)smem = *(const uint4*)gmem;
    else
        *(u32*)smem = *(const u32*)gmem;
#endif
}

DN_DEV void cp_async_commit() {
#if DN_ASYNC
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
DN_DEV void cp_async_wait() {  // until at most N of this thread's groups are in flight
#if DN_ASYNC
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// The lane layout of the tree step and the commit's replay (they must agree: the order of the sums is the
// layout's). A block of nw warps owns nw * CW consecutive state columns of value head h; a lane holds rows
// row0 .. row0 + R - 1 of column col. Blocks with h >= Hv have nothing to do.
template <int DK, int CW>
struct Lanes {
    static_assert(32 % CW == 0 && CW >= 1, "CW must divide 32");
    static constexpr int RG = 32 / CW;  // row groups per warp
    static_assert(DK % (RG * 8) == 0, "rows per lane must be a multiple of 8");
    static constexpr int R = DK / RG;  // rows per lane
    int lane, warp, h, col, row0;
    DN_MEM explicit Lanes(int DV) {
        lane = threadIdx.x & 31;
        warp = threadIdx.x >> 5;
        const int cols_per_block = (blockDim.x >> 5) * CW;
        const int blocks_per_head = DV / cols_per_block;
        h = blockIdx.x / blocks_per_head;
        col = (blockIdx.x % blocks_per_head) * cols_per_block + warp * CW + lane % CW;
        row0 = (lane / CW) * R;
    }
};

// R rows of a lane's state column, p[r * stride] (DV in global memory, 32 in a shared-memory stack slot).
template <int R>
DN_DEV void load_rows(float (&s)[R], const float* p, i64 stride) {
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = p[(i64)r * stride];
}

template <int R>
DN_DEV void store_rows(float* p, i64 stride, const float (&s)[R]) {
#pragma unroll
    for (int r = 0; r < R; ++r) p[(i64)r * stride] = s[r];
}

// One token's inputs in a ring slot: the k row (then, with Q, the q row) of the warp's key head, each lane's
// 4-byte v word (a half v element travels as the aligned pair holding it), g and beta (16 bytes: slots stay
// 16-byte aligned).
template <typename TIn, int DK, bool Q>
struct Slot {
    static constexpr int ROWS_BYTES = (Q ? 2 : 1) * DK * (int)sizeof(TIn);
    static constexpr int CHUNKS = ROWS_BYTES / 16;
    static constexpr int V_OFF = ROWS_BYTES;  // 32 u32: lane l's v word
    static constexpr int GB_OFF = V_OFF + 128;
    static constexpr int BYTES = GB_OFF + 16;
    static_assert(ROWS_BYTES % 16 == 0, "k and q rows must be whole 16-byte chunks");

    // The warp's copies of one token into `slot`; vrow: the token's v row of head h (v + t * ld_v + h * DV).
    static DN_MEM void fill(char* slot, int lane, int col, const TIn* krow, const TIn* qrow, const TIn* vrow,
                            const float* g, const float* beta) {
        for (int c = lane; c < CHUNKS; c += 32) {
            const char* src =
                Q && c >= CHUNKS / 2 ? (const char*)qrow + 16 * (c - CHUNKS / 2) : (const char*)krow + 16 * c;
            cp_async<16>(slot + 16 * c, src);
        }
        cp_async<4>(slot + V_OFF + 4 * lane, vrow + (sizeof(TIn) == 2 ? (col & ~1) : col));
        if (lane == 0) cp_async<4>(slot + GB_OFF, g);
        if (lane == 1) cp_async<4>(slot + GB_OFF + 4, beta);
    }
    template <int R>
    static DN_MEM void k_row(const char* slot, int row0, float (&kk)[R]) {
        Vec<TIn, R> x;
        x.load((const TIn*)slot + row0);
        x.get(kk);
    }
    template <int R>
    static DN_MEM void q_row(const char* slot, int row0, float (&qq)[R]) {
        static_assert(Q, "this slot holds no q row");
        Vec<TIn, R> x;
        x.load((const TIn*)slot + DK + row0);
        x.get(qq);
    }
    static DN_MEM float v(const char* slot, int lane, int col) {
        const u32 w = *(const u32*)(slot + V_OFF + 4 * lane);
        return sizeof(TIn) == 2 ? h2f((col & 1) ? (w >> 16) : (w & 0xFFFFu)) : __uint_as_float(w);
    }
    static DN_MEM float g(const char* slot) { return *(const float*)(slot + GB_OFF); }
    static DN_MEM float beta(const char* slot) { return *(const float*)(slot + GB_OFF + 4); }
};

// The ring protocol: slot i % D holds the i-th token a warp processes. ring_start issues tokens 0..D-2; before
// token i computes, ring_next waits for its copies (at most D - 2 younger groups still in flight), syncs the warp
// (every lane's copies have landed, every lane is done with slot (i - 1) % D) and issues token i + D - 1 into that
// slot. issue(j) copies token j if there is one; each call is one commit group, empty or not, so the count the
// wait relies on holds to the end.
template <int D, typename Issue>
DN_DEV void ring_start(Issue&& issue) {
    static_assert(D >= 2, "the ring needs at least two slots");
#pragma unroll
    for (int j = 0; j < D - 1; ++j) {
        issue(j);
        cp_async_commit();
    }
}

template <int D, typename Issue>
DN_DEV void ring_next(int i, Issue&& issue) {
    cp_async_wait<D - 2>();
    DN_SYNCWARP();
    issue(i + D - 1);
    cp_async_commit();
}
}  // namespace dn

// ---------------------------------------------------------------------------------------------
// Causal depthwise conv + SiLU over new tokens whose windows follow their parent chains.
// raw: (T_max, C) pre-conv rows (row stride ld_raw); window: (KW-1, C) f32 committed raw rows, oldest first;
// w: (C, KW) f32; out: (T_max, C) f32 (row stride ld_out). Grid (ceil(C / blockDim.x), min(T_max, 65535)).
// conv_silu_rows_kernel also copies each token's raw row to rows_out (f32, row stride ld_rows) as it reads it:
// the pre-conv rows commit() gathers, kept without a copy launch of their own (raw may then be a strided view of
// the input projection).
namespace dn {
// The rows token t's conv taps read, newest first (the token, its parent, ...; when the chain ends, the committed
// window rows, newest first): src[k] >= 0 a raw row, else window row -1 - src[k]. Every channel of a token shares
// them: a thread walks once and then requests all of its taps at once (conv_loads).
template <int KW>
DN_DEV void conv_taps(const int* __restrict__ parents, int t, int (&src)[KW]) {
    int cur = t, wrow = KW - 2;
#pragma unroll
    for (int k = KW - 1; k >= 0; --k) {
        if (cur >= 0) {
            src[k] = cur;
            cur = parent_of(parents, cur);
        } else {
            src[k] = -1 - wrow;
            --wrow;
        }
    }
}

// channel c's taps at the rows conv_taps chose (v[KW - 1]: the token's own raw value)
template <typename TIn, int KW>
DN_DEV void conv_loads(const TIn* __restrict__ raw, i64 ld_raw, const float* __restrict__ window,
                       const int (&src)[KW], int c, int C, float (&v)[KW]) {
#pragma unroll
    for (int k = 0; k < KW; ++k)
        v[k] = src[k] >= 0 ? load1(raw + (i64)src[k] * ld_raw + c) : window[(i64)(-1 - src[k]) * C + c];
}

// silu of the conv: the taps added newest first
template <int KW>
DN_DEV float conv_silu_of(const float (&wk)[KW], const float (&v)[KW]) {
    float acc = 0.0f;
#pragma unroll
    for (int k = KW - 1; k >= 0; --k) acc += wk[k] * v[k];
    return silu(acc);
}

// What a conv thread reads that was committed before the step: its channel's weights and, for its first token
// (t = blockIdx.y), that token's taps in the committed window (src < 0); the kernels load it ahead of the grid
// dependency wait when the launcher says `early` (a PDL launch captured into a step's graph, as the tree walk's
// state: the window and the parent list come from before the graph).
template <int KW>
struct ConvPre {
    float wk[KW], v[KW];
    int src[KW];
    DN_MEM void load(const float* __restrict__ w, const float* __restrict__ window, const int* __restrict__ parents,
                     int c, int C) {
        if (c >= C) return;
#pragma unroll
        for (int k = 0; k < KW; ++k) wk[k] = w[(i64)c * KW + k];
        conv_taps<KW>(parents, (int)blockIdx.y, src);
#pragma unroll
        for (int k = 0; k < KW; ++k)
            if (src[k] < 0) v[k] = window[(i64)(-1 - src[k]) * C + c];
    }
};

template <typename TIn, int KW, bool ROWS>
DN_DEV void conv_silu_body(const TIn* __restrict__ raw, i64 ld_raw, const float* __restrict__ window,
                           const int* __restrict__ parents, const int* __restrict__ n_tokens, int t_max, int C,
                           float* __restrict__ out, i64 ld_out, float* __restrict__ rows_out, i64 ld_rows,
                           const ConvPre<KW>& pre) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int T = token_count(n_tokens, t_max);
    for (int t = blockIdx.y; t < T; t += gridDim.y) {
        int src[KW];
        float v[KW];
        if (t == (int)blockIdx.y) {  // the first token: its window taps are loaded (pre), its raw ones now
#pragma unroll
            for (int k = 0; k < KW; ++k) {
                src[k] = pre.src[k];
                v[k] = src[k] >= 0 ? load1(raw + (i64)src[k] * ld_raw + c) : pre.v[k];
            }
        } else {
            conv_taps<KW>(parents, t, src);
            conv_loads<TIn, KW>(raw, ld_raw, window, src, c, C, v);
        }
        if constexpr (ROWS) rows_out[(i64)t * ld_rows + c] = v[KW - 1];  // the token's own row, once per (t, c)
        out[(i64)t * ld_out + c] = conv_silu_of<KW>(pre.wk, v);
    }
}
}  // namespace dn

template <typename TIn, int KW>
__global__ void conv_silu_kernel(const TIn* __restrict__ raw, i64 ld_raw, const float* __restrict__ window,
                                 const float* __restrict__ w, const int* __restrict__ parents,
                                 const int* __restrict__ n_tokens, int t_max, int C, float* __restrict__ out,
                                 i64 ld_out, int early) {
    SS_GRID_LAUNCH_DEPENDENTS();  // kernels/pdl.cuh: the per-layer chain launches early under PDL
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    dn::ConvPre<KW> pre;
    if (early) pre.load(w, window, parents, c, C);
    SS_GRID_WAIT();  // the raw rows come from the input projection
    if (!early) pre.load(w, window, parents, c, C);
    dn::conv_silu_body<TIn, KW, false>(raw, ld_raw, window, parents, n_tokens, t_max, C, out, ld_out, nullptr, 0,
                                       pre);
}

template <typename TIn, int KW>
__global__ void conv_silu_rows_kernel(const TIn* __restrict__ raw, i64 ld_raw, const float* __restrict__ window,
                                      const float* __restrict__ w, const int* __restrict__ parents,
                                      const int* __restrict__ n_tokens, int t_max, int C, float* __restrict__ out,
                                      i64 ld_out, float* __restrict__ rows_out, i64 ld_rows, int early) {
    SS_GRID_LAUNCH_DEPENDENTS();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    dn::ConvPre<KW> pre;
    if (early) pre.load(w, window, parents, c, C);
    SS_GRID_WAIT();
    if (!early) pre.load(w, window, parents, c, C);
    dn::conv_silu_body<TIn, KW, true>(raw, ld_raw, window, parents, n_tokens, t_max, C, out, ld_out, rows_out,
                                      ld_rows, pre);
}

// ---------------------------------------------------------------------------------------------
namespace dn {
// A q or k head held by a warp, PER values a lane (lane l: values l, l + 32, ...): x / sqrt(sum(x^2) + eps), times
// q_scale for a q head; the sum in lane order, then an xor butterfly
template <int PER>
DN_DEV void l2_normalize(float (&x)[PER], float eps, bool q, float q_scale) {
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; ++i) ss += x[i] * x[i];
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) ss += DN_SHFL_XOR(ss, m);
    float scale = 1.0f / sqrtf(ss + eps);
    if (q) scale *= q_scale;
#pragma unroll
    for (int i = 0; i < PER; ++i) x[i] = x[i] * scale;
}

// Token t's gates, the block's threads over the Hv value heads: g = ssm_a * softplus(alpha + dt_bias),
// beta = sigmoid(b)
template <typename TIn>
DN_DEV void write_gates(const TIn* __restrict__ alpha, const TIn* __restrict__ b, i64 ld_ab,
                        const float* __restrict__ ssm_a, const float* __restrict__ dt_bias, int Hv,
                        float* __restrict__ g_out, float* __restrict__ beta_out, i64 ld_gb, int t) {
    for (int h = threadIdx.x; h < Hv; h += blockDim.x) {
        const float a = load1(alpha + (i64)t * ld_ab + h);
        const float bb = load1(b + (i64)t * ld_ab + h);
        g_out[(i64)t * ld_gb + h] = ssm_a[h] * softplus(a + dt_bias[h]);
        beta_out[(i64)t * ld_gb + h] = sigmoid(bb);
    }
}
}  // namespace dn

// In place on the conv output: q and k heads (2 * Hk vectors of DK at the start of each row, q first) get
// x * rsqrt(sum(x^2) + eps), q also * q_scale; and per value head g = ssm_a * softplus(alpha + dt_bias),
// beta = sigmoid(b) into g_out / beta_out (T_max, Hv). One warp per head vector; grid
// (ceil(2 Hk / warps per block), T_max); the first block column also does the gates.
template <typename TIn, int DK>
__global__ void qk_norm_gate_kernel(float* __restrict__ qk, i64 ld, int Hk, float q_scale, float eps,
                                    const TIn* __restrict__ alpha, const TIn* __restrict__ b, i64 ld_ab,
                                    const float* __restrict__ ssm_a, const float* __restrict__ dt_bias, int Hv,
                                    float* __restrict__ g_out, float* __restrict__ beta_out, i64 ld_gb,
                                    const int* __restrict__ n_tokens, int t_max) {
    static_assert(DK % 128 == 0 || DK == 64 || DK == 32, "DK must be 32, 64 or a multiple of 128");
    SS_PDL_ENTRY();
    constexpr int PER = DK / 32;  // values per lane
    const int T = dn::token_count(n_tokens, t_max);
    const int lane = threadIdx.x & 31;
    const int vi = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    for (int t = blockIdx.y; t < T; t += gridDim.y) {
        if (vi < 2 * Hk) {
            float* p = qk + (i64)t * ld + (i64)vi * DK;
            float x[PER];
#pragma unroll
            for (int i = 0; i < PER; ++i) x[i] = p[lane + 32 * i];  // lane-strided: coalesced for any DK
            dn::l2_normalize<PER>(x, eps, vi < Hk, q_scale);
#pragma unroll
            for (int i = 0; i < PER; ++i) p[lane + 32 * i] = x[i];
        }
        if (blockIdx.x == 0) dn::write_gates<TIn>(alpha, b, ld_ab, ssm_a, dt_bias, Hv, g_out, beta_out, ld_gb, t);
    }
}

// conv_silu(_rows)_kernel and qk_norm_gate_kernel in one launch (a DeltaNet layer's chain: one kernel boundary
// fewer). One warp per DK channels, lane l computing channels l, l + 32, ... of its group (conv_silu's arithmetic,
// the taps' rows walked once per token: conv_taps), so a q / k head (groups 0 .. 2 Hk - 1: q heads, then k heads)
// is normalised by its warp's reduction (l2_normalize, as qk_norm_gate_kernel), and the block column 0 writes the
// gates (write_gates): every output bit for bit the two launches'. raw and alpha / b share TIn (columns of one
// input projection). rows_out may be null (ROWS = 0). Grid (ceil(C / (DK warps)), min(T_max, 65535)); requires
// C >= 2 Hk DK.
template <typename TIn, int KW, int DK, int ROWS>
__global__ void conv_qk_norm_gate_kernel(const TIn* __restrict__ raw, i64 ld_raw, const float* __restrict__ window,
                                         const float* __restrict__ w, const int* __restrict__ parents,
                                         const int* __restrict__ n_tokens, int t_max, int C, float* __restrict__ out,
                                         i64 ld_out, float* __restrict__ rows_out, i64 ld_rows, int Hk, float q_scale,
                                         float eps, const TIn* __restrict__ alpha, const TIn* __restrict__ b,
                                         i64 ld_ab, const float* __restrict__ ssm_a, const float* __restrict__ dt_bias,
                                         int Hv, float* __restrict__ g_out, float* __restrict__ beta_out,
                                         i64 ld_gb) {
    static_assert(DK % 128 == 0 || DK == 64 || DK == 32, "DK must be 32, 64 or a multiple of 128");
    SS_PDL_ENTRY();
    constexpr int PER = DK / 32;  // channels per lane
    const int T = dn::token_count(n_tokens, t_max);
    const int lane = threadIdx.x & 31;
    const int grp = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int c0 = grp * DK;
    float wk[PER][KW];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int c = c0 + lane + 32 * i;
#pragma unroll
        for (int k = 0; k < KW; ++k) wk[i][k] = c < C ? w[(i64)c * KW + k] : 0.0f;
    }
    for (int t = blockIdx.y; t < T; t += gridDim.y) {
        if (c0 < C) {
            int src[KW];
            dn::conv_taps<KW>(parents, t, src);
            float v[PER][KW];  // every tap of every channel requested before any is used
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                const int c = c0 + lane + 32 * i;
                if (c < C) {
                    dn::conv_loads<TIn, KW>(raw, ld_raw, window, src, c, C, v[i]);
                    if (ROWS != 0) rows_out[(i64)t * ld_rows + c] = v[i][KW - 1];  // the token's own row
                } else {
#pragma unroll
                    for (int k = 0; k < KW; ++k) v[i][k] = 0.0f;
                }
            }
            float x[PER];
#pragma unroll
            for (int i = 0; i < PER; ++i) x[i] = dn::conv_silu_of<KW>(wk[i], v[i]);
            if (grp < 2 * Hk) dn::l2_normalize<PER>(x, eps, grp < Hk, q_scale);  // a q or k head (warp-uniform)
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                const int c = c0 + lane + 32 * i;
                if (c < C) out[(i64)t * ld_out + c] = x[i];
            }
        }
        if (blockIdx.x == 0) dn::write_gates<TIn>(alpha, b, ld_ab, ssm_a, dt_bias, Hv, g_out, beta_out, ld_gb, t);
    }
}

// ---------------------------------------------------------------------------------------------
// The tree step: a walk of the tree without per-node states (kernels/deltanet.py gated_delta_tree).
//
// The walk visits the nodes in depth-first order, each node's children light first and the heaviest (largest
// subtree) last; among the light ones the leaves come first. A light leaf is evaluated on its parent's state without
// changing it (read-only: its output needs no update, token_output), so the next child still finds the parent's
// state in registers. A node's first visited child that changes the state continues from the state in registers;
// only a node with a light child that is not a leaf saves its state, to a per-warp stack in shared memory, and its
// later children reload it from there; its last (heavy) child frees the slot. A light child's subtree holds at
// most half of its parent's, so at most floor(log2(T + 1)) - 1 states are saved at once (5 for T <= 126): the
// stack fits in shared memory and nothing but the outputs goes to global memory. Roots reload the committed s0.
// (A DDTree is mostly a chain with leaves beside it: its walk saves and reloads nothing.)
//
// The visit order is computed once per step (all layers share it) by gdr_tree_plan_kernel into `plan`:
// plan[i] = node | ro << 15 | load << 16 | save << 24 for the i-th visited node, ro = 1 for a light leaf evaluated
// read-only, load 0 = the state in registers (the parent's: visited just before, or before it only read-only
// leaves), 1 = s0, 2 + j = stack slot j; save 0 = none, 1 + j = into stack slot j.
namespace dn {
constexpr int PLAN_MAX = 1024;  // nodes of a planned tree (the heavy-child key packs an index into 16 bits)
constexpr int PLAN_HELD = 0, PLAN_S0 = 1;
constexpr int PLAN_RO = 1 << 15, PLAN_NODE = PLAN_RO - 1;
template <bool B>
struct Flag {  // a compile-time bool for generic lambdas (no <type_traits> under NVRTC)
    static constexpr bool value = B;
};
}  // namespace dn

// One warp (blockDim.x == 32) computes the walk of the tree given by `parents` (entries outside -1..t-1 read as
// roots, as everywhere here). Dynamic shared memory: 9 * t_max ints. Every step is parallel over nodes (a lane
// per node) except walks up the ancestors, which are as long as the tree is deep.
__global__ void __launch_bounds__(32) gdr_tree_plan_kernel(const int* __restrict__ parents,
                                                            const int* __restrict__ n_tokens, int t_max,
                                                            int* __restrict__ plan) {
    extern __shared__ uint4 dn_smem[];
    const int lane = threadIdx.x;
    const int T = dn::token_count(n_tokens, t_max > dn::PLAN_MAX ? dn::PLAN_MAX : t_max);
    int* par = (int*)dn_smem;
    u32* size = (u32*)(par + t_max);  // nodes in the subtree
    u32* nch = size + t_max;          // children
    u32* hkey = nch + t_max;          // heavy child: max of size << 16 | (0xFFFF - index)
    u32* nro = hkey + t_max;          // read-only children (light leaves)
    u32* nnl = nro + t_max;           // light children that are not leaves (the node saves when there is one)
    int* off = (int*)(nnl + t_max);   // nodes visited between the parent and this node
    int* pos = off + t_max;           // place in the walk
    int* slot = pos + t_max;          // stack slot this node saves to (= saved ancestors still live at its visit)
    for (int t = lane; t < T; t += 32) {
        par[t] = dn::parent_of(parents, t);
        size[t] = 1u;
        nch[t] = 0u;
        hkey[t] = 0u;
        nro[t] = 0u;
        nnl[t] = 0u;
    }
    DN_SYNCWARP();
    for (int t = lane; t < T; t += 32) {
        const int p = par[t];
        if (p >= 0) atomicAdd(&nch[p], 1u);
        for (int a = p; a >= 0; a = par[a]) atomicAdd(&size[a], 1u);
    }
    DN_SYNCWARP();
    for (int t = lane; t < T; t += 32) {
        const int p = par[t];
        if (p >= 0) atomicMax(&hkey[p], (size[t] << 16) | (0xFFFFu - (u32)t));
    }
    DN_SYNCWARP();
    auto heavy = [&](int p) { return p >= 0 ? (int)(0xFFFFu - (hkey[p] & 0xFFFFu)) : -1; };
    auto read_only = [&](int t) { return par[t] >= 0 && nch[t] == 0u && t != heavy(par[t]); };
    for (int t = lane; t < T; t += 32) {
        const int p = par[t];
        if (p >= 0 && t != heavy(p)) atomicAdd(nch[t] == 0u ? &nro[p] : &nnl[p], 1u);
    }
    DN_SYNCWARP();
    for (int n = lane; n < T; n += 32) {
        // siblings visited before n: a root, the roots of lower index; a read-only leaf, the read-only siblings of
        // lower index; another light child, every read-only sibling and the other light ones of lower index; the
        // heavy child, all light ones. Siblings come after their parent, so the scans start there.
        const int p = par[n], h = heavy(p);
        const bool ro = read_only(n);
        int o = 0;
        for (int t = p + 1; t < T; ++t) {
            if (par[t] != p || t == h || t == n) continue;
            if (p < 0 || ro) {
                if (t < n && (p < 0 || read_only(t))) o += (int)size[t];
            } else if (n == h || read_only(t) || t < n) {
                o += (int)size[t];
            }
        }
        off[n] = o;
    }
    DN_SYNCWARP();
    for (int n = lane; n < T; n += 32) {
        int ps = off[n], sl = 0;
        for (int c = n, a = par[n]; a >= 0; c = a, a = par[a]) {
            ps += off[a] + 1;
            if (nnl[a] > 0u && c != heavy(a)) ++sl;  // a's slot is live while its light children are walked
        }
        pos[n] = ps;
        slot[n] = sl;
    }
    DN_SYNCWARP();
    for (int n = lane; n < T; n += 32) {
        const int p = par[n];
        const bool ro = read_only(n);
        int load;
        if (p < 0)
            load = pos[n] == 0 ? dn::PLAN_HELD : dn::PLAN_S0;
        else if (ro || pos[n] == pos[p] + 1 + (int)nro[p])  // only read-only leaves since the parent
            load = dn::PLAN_HELD;
        else
            load = 2 + slot[p];
        const int save = nnl[n] > 0u ? 1 + slot[n] : 0;
        plan[pos[n]] = n | (ro ? dn::PLAN_RO : 0) | (load << 16) | (save << 24);
    }
}

// Per-warp shared memory of gdr_tree_walk_kernel: the token ring, the state stack, the plan.
template <typename TIn, int DK, int CW, int D>
struct WalkSmem {
    static constexpr int RING = D * dn::Slot<TIn, DK, true>::BYTES;
    static constexpr int STATE = DK * CW * 4;  // one saved state of the warp's columns
    static DN_MEM i64 bytes(int n_slots, int plan_ints) { return RING + (i64)n_slots * STATE + 16 * ((plan_ints + 3) / 4); }
};

// The tree step: walks the tree in `plan` order with the state stack in shared memory (n_slots states per warp);
// writes out[t, h, :] for every token t < T = *n_tokens <= t_max and, with no plan (a chain: decode, prefill, a
// chain verify), the last token's state to s_final (may be s0 itself). plan == nullptr: tokens 0..T-1 in order
// from s0. Plan entries are clamped (node < T, slots < n_slots, else the reload reads s0 and the save is skipped),
// so a corrupt plan cannot make the kernel leave its buffers.
// q, k: rows of Hk * DK values (row stride ld_qk), value head h reads key head h % Hk; v: rows of Hv * DV
// (ld_v); g, beta: (T_max, Hv) f32 (ld_gb); s0: (Hv, DK, DV) f32 committed state; out: (T_max, Hv * DV) f32
// (ld_out). Block = NW warps = NW * CW columns of one head; grid = Hv * DV / (NW * CW).
// swap (device int, may be null): when *swap != 0 the committed state is s0 + alt and the final state goes to
// s_final - alt. A state kept as two halves of one buffer (s0 one, s_final the other, alt the distance) then trades
// the halves' roles at a chain's commit by flipping *swap, instead of copying the final state over the committed
// one; the launch (and a graph that captured it) stays the same.
// Dynamic shared memory: warps * WalkSmem::bytes(n_slots, plan ? t_max : 0).
template <typename TIn, int DK, int CW, int D>
__global__ void __launch_bounds__(128) gdr_tree_walk_kernel(
    const TIn* __restrict__ q, const TIn* __restrict__ k, i64 ld_qk, const TIn* __restrict__ v, i64 ld_v,
    const float* __restrict__ g, const float* __restrict__ beta, i64 ld_gb, int Hk, int Hv, int DV,
    const float* s0, const int* __restrict__ plan, const int* __restrict__ n_tokens, int t_max, int n_slots,
    float* s_final, const int* __restrict__ swap, i64 alt, float* __restrict__ out, i64 ld_out, int early) {
    typedef dn::Lanes<DK, CW> LN;
    constexpr int R = LN::R;
    typedef dn::Slot<TIn, DK, true> SL;
    typedef WalkSmem<TIn, DK, CW, D> WS;
    extern __shared__ uint4 dn_smem[];
    const LN ln(DV);
    const int lane = ln.lane, h = ln.h, col = ln.col, row0 = ln.row0;
    SS_GRID_LAUNCH_DEPENDENTS();  // kernels/pdl.cuh: the per-layer chain launches early under PDL
    if (h >= Hv) return;
    const i64 own = (i64)h * DK * DV + (i64)row0 * DV + col;  // this lane's first element in an (Hv, DK, DV)
    float s[R];
    auto load_committed = [&] {
        if (swap && *swap) {  // a ping-pong state after an odd number of chain commits: the halves trade roles
            s0 += alt;
            if (s_final) s_final -= alt;
        }
        dn::load_rows(s, s0 + own, DV);
    };
    // early (the launcher: a launch captured into a step's graph): the committed state and swap come from launches
    // before the graph, never from a kernel this one can overlap, so its load runs ahead of the grid dependency wait
    // (under the conv and q/k norm launches before it)
    if (early) load_committed();
    SS_GRID_WAIT();
    if (!early) load_committed();
    const int hk = h % Hk;
    const int T = dn::token_count(n_tokens, t_max);
    char* ring = (char*)dn_smem + (i64)ln.warp * WS::bytes(n_slots, plan ? t_max : 0);
    float* stack = (float*)(ring + WS::RING);  // [slot][row][lane]: conflict-free
    int* pl = (int*)(ring + WS::RING + (i64)n_slots * WS::STATE);

    if (plan) {
        for (int i = lane; i < T; i += 32) pl[i] = plan[i];
        DN_SYNCWARP();
    }
    auto node_at = [&](int i) {
        if (!plan) return i;
        const int n = pl[i] & dn::PLAN_NODE;
        return n < T ? n : T - 1;
    };
    auto issue = [&](int i) {  // the i-th visited token's inputs into slot i % D
        if (i < T) {
            const int t = node_at(i);
            SL::fill(ring + (i % D) * SL::BYTES, lane, col, k + (i64)t * ld_qk + hk * DK, q + (i64)t * ld_qk + hk * DK,
                     v + (i64)t * ld_v + (i64)h * DV, g + (i64)t * ld_gb + h, beta + (i64)t * ld_gb + h);
        }
    };
    dn::ring_start<D>(issue);
    // the token loop, compiled apart for a chain (no plan: no reload, save or leaf branch in it; prefill and decode
    // run this one: a 4096-token prefill's recurrence 0.82x the time of one loop serving both) and for a planned tree
    auto walk = [&](auto tree) {
        constexpr bool TREE = decltype(tree)::value;
        for (int i = 0; i < T; ++i) {
            DN_STAMP(i, 0, s[R - 1]);
            dn::ring_next<D>(i, issue);
            DN_STAMP(i, 1, 0.0f);
            const char* slot = ring + (i % D) * SL::BYTES;
            float kk[R], qq[R];
            SL::k_row(slot, row0, kk);
            SL::q_row(slot, row0, qq);
            DN_STAMP(i, 2, kk[R - 1] + qq[R - 1]);
            const int code = TREE ? pl[i] : 0;
            const int t = node_at(i);
            const int load = (code >> 16) & 0xFF, save = (code >> 24) & 0xFF;
            if (load != dn::PLAN_HELD) {  // one generic load path: a stack slot (shared) or s0 (global)
                const bool from_stack = load >= 2 && load - 2 < n_slots;
                dn::load_rows(s, from_stack ? stack + (i64)(load - 2) * R * 32 + lane : s0 + own,
                              from_stack ? 32 : DV);
            }
            DN_STAMP(i, 3, s[0] + s[R - 1]);
            float ov;
            if (TREE && (code & dn::PLAN_RO)) {  // a light leaf: its output on the held (parent's) state, kept
                ov = dn::token_output<R, CW>(s, kk, qq, SL::v(slot, lane, col), SL::g(slot), SL::beta(slot));
            } else {
                ov = dn::token_update<R, CW>(s, kk, qq, SL::v(slot, lane, col), SL::g(slot), SL::beta(slot));
            }
            DN_STAMP(i, 4, ov);
            if (save >= 1 && save - 1 < n_slots) dn::store_rows(stack + (i64)(save - 1) * R * 32 + lane, 32, s);
            if (lane < CW) out[(i64)t * ld_out + (i64)h * DV + col] = ov;
            DN_STAMP(i, 5, s[R - 1]);
#ifdef DN_TRACE
            if (blockIdx.x == 0 && threadIdx.x == 0 && i < 256) dn_trace[i * 8 + 6] = load | (save << 8);
#endif
        }
    };
    if (plan)
        walk(dn::Flag<true>());
    else
        walk(dn::Flag<false>());
    if (s_final && T > 0 && !plan) dn::store_rows(s_final + own, DV, s);
}

namespace dn {

// One warp: rms_norm(o) * nw * silu(z) of value head h's DV outputs o (shared memory), rounded to fp16, written as
// its DV / 16 groups of the gemv's int16 staging (PackedX.q16 of one token, Hv DV values in Hv DV / 256 chunks):
// pack_rms_kernel's per-head arithmetic and xq::put_unit8 (put_q16's), lane u < DV / 8 taking values 8 u .. 8 u + 7.
template <typename TIn>
DN_DEV void head_norm_q16(const float* o, const TIn* z, const float* nw, float eps, int DV, int h, int Hv,
                          uint4* q16) {
    const int lane = threadIdx.x & 31;
    float sq = 0.0f;
    for (int d = lane; d < DV; d += 32) {
        const float v = o[d];
        sq += v * v;
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) sq += DN_SHFL_XOR(sq, m);
    const float inv = 1.0f / sqrtf(sq / (float)DV + eps);
    const bool has = lane < DV / 8;
    float f[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const int d = 8 * lane + e;
        float v = 0.0f;
        if (has) {
            v = o[d] * (inv * nw[d]);
            v *= hf::silu(load1(z + d));
        }
        f[e] = hf::h2f(hf::f2h(v));
    }
    const int k = h * DV + 8 * lane;  // the unit's first value in the row of Hv DV
    xq::put_unit8(q16, Hv * DV / 256, 1, k >> 8, 0, (k & 255) >> 3, f, has);
}

}  // namespace dn

// ---------------------------------------------------------------------------------------------
// One decode token of a DeltaNet layer in one launch: the conv + SiLU of its qkv row, the q / k l2 norms, the gates
// and the state update (conv_silu_rows_kernel, qk_norm_gate_kernel and gdr_tree_walk_kernel on a one-token chain,
// bit for bit: the same functions in the same order). Block = NW = 2..16 warps on NW * CW columns of value head h
// (the walk's Lanes layout; grid = Hv * DV / (NW * CW)); every block computes the conv of its key head's q and k
// channels and of its own v columns (a key head's q and k are recomputed by each of its value heads' blocks: the
// price of two kernel boundaries fewer), warp 0 / 1 normalise q / k, then each lane updates its state rows.
// raw: the token's qkv projection row (C = 2 Hk DK + Hv DV channels: q heads, k heads, v heads); window (KW - 1, C)
// and w (C, KW) as conv_silu_kernel's; rows_out (C) f32 or null receives the raw row (the commit's conv window
// reads it), each channel written by one block; alpha, b: the token's Hv gate projections; s0 / s_final / swap /
// alt / out as gdr_tree_walk_kernel's for a chain of one token; early: the state, conv weights and window taps are
// read before the grid dependency wait (a PDL launch captured into a graph).
// q16 non-null (a block per value head: NW CW = DV <= 256, DV a multiple of 16, Hv DV of 256): the layer's output
// norm too, rms_norm(o_h) * norm_w * silu(z_h) per head, rounded to fp16 and written as ssm_out's int16 staging
// (PackedX.q16 of [1, Hv DV]) with the bits of quant_matmul.cu's pack_rms_kernel (its per-head sums: lane l adds
// d = l, l + 32, ..., then the warp's xor tree), so no pack launch runs between this kernel and the product.
// z: the token's gate row (Hv DV, raw's type); norm_w: DV floats.
// Dynamic shared memory: (2 DK + NW CW + 2) floats, (2 DK + 2 NW CW + 2) with q16.
template <typename TIn, int DK, int CW, int KW>
__global__ void __launch_bounds__(512) gdr_decode_kernel(
    const TIn* __restrict__ raw, const float* __restrict__ window, const float* __restrict__ w,
    float* __restrict__ rows_out, const TIn* __restrict__ alpha, const TIn* __restrict__ b,
    const float* __restrict__ ssm_a, const float* __restrict__ dt_bias, int Hk, int Hv, int DV, int C, float q_scale,
    float eps, const float* s0, float* s_final, const int* __restrict__ swap, i64 alt, float* __restrict__ out,
    const TIn* __restrict__ z, const float* __restrict__ norm_w, float norm_eps, uint4* __restrict__ q16, int early) {
    typedef dn::Lanes<DK, CW> LN;
    constexpr int R = LN::R;
    constexpr int PER = DK / 32;
    constexpr int MAXS = 2 * DK / 64 + 1;  // conv channels a thread takes (NW >= 2 warps, CW <= 32 columns a warp)
    extern __shared__ uint4 dn_smem[];
    float* const xs = (float*)dn_smem;  // q then k of the key head (2 DK), the block's v columns, g, beta
    const LN ln(DV);
    const int lane = ln.lane, h = ln.h, col = ln.col, row0 = ln.row0;
    const int tid = (int)threadIdx.x, nthr = (int)blockDim.x, ncols = nthr / 32 * CW;
    SS_GRID_LAUNCH_DEPENDENTS();  // kernels/pdl.cuh
    if (h >= Hv) return;  // (the whole block)
    const int hk = h % Hk, col0 = col - ln.warp * CW - lane % CW;  // the block's first column
    const int n_ch = 2 * DK + ncols;
    // channel of conv slot i: q channels of key head hk, its k channels, the block's v columns
    auto channel = [&](int i) {
        return i < DK ? hk * DK + i : i < 2 * DK ? Hk * DK + hk * DK + i - DK : 2 * Hk * DK + h * DV + col0 + i - 2 * DK;
    };
    float s[R];
    float wk[MAXS][KW], tap[MAXS][KW];
    auto load_committed = [&] {
        if (swap && *swap) {  // the ping-pong halves trade roles (gdr_tree_walk_kernel)
            s0 += alt;
            if (s_final) s_final -= alt;
        }
        dn::load_rows(s, s0 + (i64)h * DK * DV + (i64)row0 * DV + col, DV);
#pragma unroll
        for (int j = 0; j < MAXS; ++j) {
            const int i = tid + j * nthr;
            if (i < n_ch) {
                const int c = channel(i);
#pragma unroll
                for (int k = 0; k < KW; ++k) wk[j][k] = w[(i64)c * KW + k];
#pragma unroll
                for (int k = 0; k < KW - 1; ++k) tap[j][k] = window[(i64)k * C + c];  // oldest first
            }
        }
    };
    if (early) load_committed();
    SS_GRID_WAIT();  // the raw row and the gate projections come from the input projection
    if (!early) load_committed();
    const bool qk_writer = h < Hk && col0 == 0;  // one block writes each q / k channel's raw value
#pragma unroll
    for (int j = 0; j < MAXS; ++j) {
        const int i = tid + j * nthr;
        if (i < n_ch) {
            const int c = channel(i);
            tap[j][KW - 1] = dn::load1(raw + c);
            if (rows_out && (i >= 2 * DK || qk_writer)) rows_out[c] = tap[j][KW - 1];
            xs[i] = dn::conv_silu_of<KW>(wk[j], tap[j]);
        }
    }
    if (tid == 0) {
        xs[n_ch] = ssm_a[h] * dn::softplus(dn::load1(alpha + h) + dt_bias[h]);
        xs[n_ch + 1] = dn::sigmoid(dn::load1(b + h));
    }
    __syncthreads();
    if (ln.warp < 2) {  // warp 0: the q head, warp 1: the k head (qk_norm_gate_kernel's lanes and sums)
        float x[PER];
        float* const p = xs + ln.warp * DK;
#pragma unroll
        for (int i = 0; i < PER; ++i) x[i] = p[lane + 32 * i];
        dn::l2_normalize<PER>(x, eps, ln.warp == 0, q_scale);
#pragma unroll
        for (int i = 0; i < PER; ++i) p[lane + 32 * i] = x[i];
    }
    __syncthreads();
    float kk[R], qq[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        qq[r] = xs[row0 + r];
        kk[r] = xs[DK + row0 + r];
    }
    const float ov = dn::token_update<R, CW>(s, kk, qq, xs[2 * DK + col - col0], xs[n_ch], xs[n_ch + 1]);
    if (lane < CW) out[(i64)h * DV + col] = ov;
    if (s_final) dn::store_rows(s_final + (i64)h * DK * DV + (i64)row0 * DV + col, DV, s);
    if (q16 == nullptr || ncols != DV) return;  // (the whole block)
    float* const ob = xs + n_ch + 2;  // the head's DV outputs
    if (lane < CW) ob[col] = ov;
    __syncthreads();
    if (ln.warp == 0) dn::head_norm_q16(ob, z + (i64)h * DV, norm_w, norm_eps, DV, h, Hv, q16);
}

// ---------------------------------------------------------------------------------------------
// Commit by replay: state[l] <- the state after the root -> *accepted path of the last tree step, recomputed from
// the committed state by state_update over the path's tokens (k, v, g, beta kept from the step; no q, no
// output), for L layers (gridDim.y) in one launch, in place. Same lane layout, ring and state update as the tree
// step (CW must match its), so the result equals the tree step's state for that node bit for bit.
// parents == nullptr: a chain (path 0..*accepted). *accepted < 0 (nothing accepted) or >= t_max leaves the state
// as it is.
// k: rows of Hk * DK, v: rows of Hv * DV, both views of one buffer's rows (row stride ld_kv, layer stride
// ld_layer_kv, as the conv output rows the tree step read them from); g, beta:
// (T_max, Hv) rows (ld_gb), layer stride ld_layer_gb; state: (Hv, DK, DV) per layer (ld_layer_state); with
// *swap != 0 (swap may be null) the state is the other half of a ping-pong pair, state + alt.
// Dynamic shared memory: warps * CommitSmem::bytes(t_max) (a ring of D slots of k rows, the path, the parents).
template <typename TIn, int DK, int D>
struct CommitSmem {
    static constexpr int RING = D * dn::Slot<TIn, DK, false>::BYTES;
    static DN_MEM i64 bytes(int t_max) { return RING + 2 * 16 * (i64)((t_max + 3) / 4); }
};

template <typename TIn, int DK, int CW, int D>
__global__ void __launch_bounds__(128) gdr_commit_kernel(
    const TIn* __restrict__ k, const TIn* __restrict__ v, i64 ld_kv, i64 ld_layer_kv,
    const float* __restrict__ g, const float* __restrict__ beta, i64 ld_gb, i64 ld_layer_gb, int Hk, int Hv, int DV,
    float* __restrict__ state, i64 ld_layer_state, const int* __restrict__ parents, const int* __restrict__ accepted,
    int t_max, const int* __restrict__ swap, i64 alt) {
    typedef dn::Lanes<DK, CW> LN;
    constexpr int R = LN::R;
    typedef dn::Slot<TIn, DK, false> SL;
    extern __shared__ uint4 dn_smem[];
    const int a = *accepted;
    if (a < 0 || a >= t_max) return;
    const LN ln(DV);
    const int lane = ln.lane, h = ln.h, col = ln.col, row0 = ln.row0;
    if (h >= Hv) return;
    const int hk = h % Hk;
    const i64 layer = blockIdx.y;
    if (swap && *swap) state += alt;  // the committed half of a ping-pong state (see gdr_tree_walk_kernel)
    k += layer * ld_layer_kv;
    v += layer * ld_layer_kv;
    g += layer * ld_layer_gb;
    beta += layer * ld_layer_gb;
    float* st = state + layer * ld_layer_state + (i64)h * DK * DV + (i64)row0 * DV + col;
    char* ring = (char*)dn_smem + (i64)ln.warp * CommitSmem<TIn, DK, D>::bytes(t_max);
    int* path = (int*)(ring + CommitSmem<TIn, DK, D>::RING);
    int* par = path + 4 * ((t_max + 3) / 4);

    float s[R];
    dn::load_rows(s, st, DV);
    int n = a + 1;  // path length; a chain's path is 0..a
    if (parents) {
        for (int i = lane; i <= a; i += 32) par[i] = dn::parent_of(parents, i);
        DN_SYNCWARP();
        n = 0;
        for (int c = a; c >= 0; c = par[c]) ++n;
        int c = a;
        for (int j = n - 1; j >= 0; --j) {
            if (lane == 0) path[j] = c;
            c = par[c];
        }
        DN_SYNCWARP();
    }
    auto issue = [&](int j) {  // the path's j-th token into slot j % D
        if (j < n) {
            const int t = parents ? path[j] : j;
            SL::fill(ring + (j % D) * SL::BYTES, lane, col, k + (i64)t * ld_kv + hk * DK, nullptr,
                     v + (i64)t * ld_kv + (i64)h * DV, g + (i64)t * ld_gb + h, beta + (i64)t * ld_gb + h);
        }
    };
    dn::ring_start<D>(issue);
    for (int j = 0; j < n; ++j) {
        dn::ring_next<D>(j, issue);
        const char* slot = ring + (j % D) * SL::BYTES;
        float kk[R];
        SL::k_row(slot, row0, kk);
        dn::state_update<R, CW>(s, kk, SL::v(slot, lane, col), SL::g(slot), SL::beta(slot));
    }
    dn::store_rows(st, DV, s);
}

// ---------------------------------------------------------------------------------------------
// Commit, conv window: the KW-1 newest rows of [window ; raw rows of the path root .. *accepted], per layer
// (gridDim.y). window: (KW-1, C) f32 per layer, raw: (T_max, C) per layer (row stride ld_raw).
template <typename TIn, int KW>
__global__ void conv_commit_kernel(float* __restrict__ window, i64 win_layer_stride, const TIn* __restrict__ raw,
                                   i64 ld_raw, i64 raw_layer_stride, const int* __restrict__ parents,
                                   const int* __restrict__ accepted, int t_max, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int a = *accepted;
    if (c >= C || a < 0 || a >= t_max) return;
    float* win = window + blockIdx.y * win_layer_stride;
    const TIn* rr = raw + blockIdx.y * raw_layer_stride;
    float old[KW - 1];
#pragma unroll
    for (int j = 0; j < KW - 1; ++j) old[j] = win[(i64)j * C + c];  // all reads before any write (in place)
    int chain[KW - 1];  // the path's nodes, newest first; -1 past its root
    int n = 0, cur = a;
#pragma unroll
    for (int d = 0; d < KW - 1; ++d) {
        chain[d] = cur;
        if (cur >= 0) {
            ++n;
            cur = dn::parent_of(parents, cur);
        }
    }
#pragma unroll
    for (int d = 0; d < KW - 1; ++d) {
        const int j = KW - 2 - d;  // window row that takes the d-th newest row
        float x = 0.0f;
        if (chain[d] >= 0) {
            x = dn::load1(rr + (i64)chain[d] * ld_raw + c);
        } else {
#pragma unroll
            for (int m = 0; m < KW - 1; ++m)  // old[j + n], selected without a run-time register index
                if (m == j + n) x = old[m];
        }
        win[(i64)j * C + c] = x;
    }
}
