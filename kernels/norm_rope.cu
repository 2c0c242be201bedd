// Row norms, per-head q/k norm + partial NeoX RoPE, and the elementwise gates of a Qwen3 / Qwen3.5 block.
// NumPy twins: services/engine/layers.py (rms_norm, rope_neox, silu, sigmoid) as used by models/qwen35.py.
//
// Element types are template codes: 0 = f32, 1 = f16, 2 = bf16 (raw bits in memory); all arithmetic is f32.
// Kernels (launchers and shapes in kernels/norm_rope.py):
//  * rms_norm_kernel: y = rms_norm(x [+ r]) * w per row (one block of 256 threads per row); with the
//    residual it also writes s = x + r, the new residual stream.
//  * head_norm_kernel: one warp per (token, head) row of D values (D <= 256, a multiple of 32): RMSNorm
//    with a per-dim weight, then either partial NeoX RoPE at a per-token position read from a DEVICE buffer
//    (so a captured CUDA graph replays with new positions) or a SiLU gate (DeltaNet: rms_norm(o) * silu(z)).
//    Two independent jobs per launch (q and k), each with its own strides, so q can be read in place from
//    the interleaved q|gate projection.
//  * silu_mul_kernel: y = silu(g) * u; gate_mul_kernel: y = x * sigmoid(gate) (gate strided per head).
// Includes no header: only what NVRTC (or hipRTC) provides built in. Inline PTX only behind SS_PTX with a
// portable fallback (software fp16), so the same source builds for HIP and for the CPU simulation.

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__) || defined(__HIPCC_RTC__)
#define SS_HIP 1
#else
#define SS_HIP 0
#endif

#if !SS_HIP && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 530) && !defined(SPECSPLIT_PORTABLE)
#define SS_PTX 1
#else
#define SS_PTX 0
#endif

#define SS_DEV static __device__ __forceinline__
#include "pdl.cuh"
#include "head_norm.cuh"

#if SS_HIP
#define SS_SYNCWARP()                    \
    do {                                 \
        __threadfence_block();           \
        __builtin_amdgcn_wave_barrier(); \
    } while (0)
#define SS_SHFL_XOR(v, m) __shfl_xor((v), (m), 32)
#else
#define SS_SYNCWARP() __syncwarp()
#define SS_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#endif

namespace ssn {

// ---------------------------------------------------------------------------------------------
// Element loads / stores with conversion (f16 and bf16 travel as raw 16-bit patterns).

SS_DEV float bits_f(u32 u) { return __uint_as_float(u); }
SS_DEV u32 f_bits(float f) { return __float_as_uint(f); }

SS_DEV float h2f(u32 h) {
#if SS_PTX
    float f;
    const u16 hs = (u16)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(hs));
    return f;
#else
    const u32 sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0) {
        const float v = (float)m * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (e == 31) return bits_f(sign | 0x7F800000u | (m << 13));
    return bits_f(sign | ((e + 112u) << 23) | (m << 13));
#endif
}

SS_DEV u32 f2h(float f) {  // round to nearest even, like cvt.rn.f16.f32
#if SS_PTX
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return (u32)h;
#else
    const u32 x = f_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return sign | 0x7E00u;
    if (ax >= 0x477FF000u) return sign | 0x7C00u;
    if (ax < 0x38800000u) {
        if (ax < 0x33000000u) return sign;
        const u32 e = ax >> 23, m = (ax & 0x7FFFFFu) | 0x800000u, shift = 126u - e;
        u32 q = m >> shift;
        const u32 rem = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
        if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
        return sign | q;
    }
    u32 h = (ax >> 13) - (112u << 10);
    const u32 rem = ax & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return sign | h;
#endif
}

SS_DEV u32 f2bf(float f) {  // round to nearest even; NaN stays NaN
    const u32 x = f_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
    return (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
}

template <int TY>
SS_DEV float ld(const void* p, i64 i) {
    if constexpr (TY == 0) return ((const float*)p)[i];
    if constexpr (TY == 1) return h2f(((const u16*)p)[i]);
    if constexpr (TY == 2) return bits_f((u32)((const u16*)p)[i] << 16);
    return 0.0f;
}

template <int TY>
SS_DEV void st(void* p, i64 i, float v) {
    if constexpr (TY == 0) ((float*)p)[i] = v;
    if constexpr (TY == 1) ((u16*)p)[i] = (u16)f2h(v);
    if constexpr (TY == 2) ((u16*)p)[i] = (u16)f2bf(v);
}

SS_DEV float warp_sum(float v) {
    for (int m = 16; m >= 1; m >>= 1) v += SS_SHFL_XOR(v, m);
    return v;
}

SS_DEV float silu(float x) { return x / (1.0f + expf(-x)); }
SS_DEV float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

constexpr int NORM_THREADS = 256;
constexpr int HEAD_WARPS = 4;  // warps (rows) per block of head_norm_kernel

}  // namespace ssn

// ---------------------------------------------------------------------------------------------
// y[row] = (x + r)[row] / sqrt(mean((x + r)^2) + eps) * w; with RES also s[row] = x + r.
// grid = rows, block = NORM_THREADS. w (f32, n values) may be null (no weight).

template <int TI, int TO, int RES>
__global__ __launch_bounds__(256) void rms_norm_kernel(const void* __restrict__ x, const void* __restrict__ r,
                                                       void* __restrict__ s, const float* __restrict__ w,
                                                       void* __restrict__ y, int n, float eps) {
    using namespace ssn;
    static __shared__ float red[NORM_THREADS / 32];
    const int tid = (int)threadIdx.x;
    const i64 base = (i64)blockIdx.x * n;
    float ss = 0.0f;
    for (int i = tid; i < n; i += NORM_THREADS) {
        float v = ld<TI>(x, base + i);
        if constexpr (RES != 0) {
            v += ld<TI>(r, base + i);
            st<TI>(s, base + i, v);
        }
        ss += v * v;
    }
    ss = warp_sum(ss);
    if ((tid & 31) == 0) red[tid >> 5] = ss;
    __syncthreads();
    float tot = 0.0f;
    for (int k = 0; k < NORM_THREADS / 32; ++k) tot += red[k];
    const float inv = 1.0f / sqrtf(tot / (float)n + eps);
    for (int i = tid; i < n; i += NORM_THREADS) {
        float v = ld<TI>(x, base + i);
        if constexpr (RES != 0) v += ld<TI>(r, base + i);
        v *= inv;
        if (w != nullptr) v *= w[i];
        st<TO>(y, base + i, v);
    }
}

// ---------------------------------------------------------------------------------------------
// Per-head RMSNorm (+ RoPE or SiLU gate), one warp per (token, head) row of D values.
// Rows 0 .. T*H0-1 belong to job 0, the next T*H1 to job 1 (H1 = 0: one job). For job j, row (t, h):
//   in  = xj[t * xj_tok + h * xj_head + d],  out = yj[(t * Hj + h) * D + d]  (y contiguous [T, Hj, D]).
// MODE 0: y = norm(x) * w, then NeoX RoPE on dims < n_rot at angle pos[t] * inv_freq[i] (n_rot = 0: none).
// MODE 1: y = norm(x) * w * silu(z), z contiguous [T, H0, D] (job 0 only).
// grid = ceil(rows / HEAD_WARPS), block = 32 * HEAD_WARPS.

template <int TI, int TO, int D, int MODE>
__global__ __launch_bounds__(128) void head_norm_kernel(
    const void* __restrict__ x0, i64 x0_tok, i64 x0_head, int H0, const float* __restrict__ w0, void* __restrict__ y0,
    const void* __restrict__ x1, i64 x1_tok, i64 x1_head, int H1, const float* __restrict__ w1, void* __restrict__ y1,
    int T, const void* __restrict__ z, const int* __restrict__ pos, const float* __restrict__ inv_freq, int n_rot,
    float eps) {
    SS_PDL_ENTRY();  // kernels/pdl.cuh: a narrow step's attention chain launches early under PDL, waits here
    using namespace ssn;
    constexpr int V = D / 32;  // values per lane: d = lane + 32 * m
    static __shared__ float buf[HEAD_WARPS][D];
    const int lane = (int)(threadIdx.x & 31u), wid = (int)(threadIdx.x >> 5);
    int row = (int)blockIdx.x * HEAD_WARPS + wid;
    const bool job1 = row >= T * H0;
    if (job1) row -= T * H0;
    const int H = job1 ? H1 : H0;
    if (row >= T * H) return;  // whole warp: no barrier below spans warps
    const int t = row / H, h = row % H;
    const void* x = job1 ? x1 : x0;
    const i64 xo = (i64)t * (job1 ? x1_tok : x0_tok) + (i64)h * (job1 ? x1_head : x0_head);
    const float* w = job1 ? w1 : w0;
    void* y = job1 ? y1 : y0;
    const i64 yo = (i64)row * D;

    float v[V];
#pragma unroll
    for (int m = 0; m < V; ++m) v[m] = ld<TI>(x, xo + lane + 32 * m);
    hn::rms_weight<D>(v, lane, w, eps);  // kernels/head_norm.cuh (attention.cu's one-token layer shares it)

    if constexpr (MODE == 1) {
#pragma unroll
        for (int m = 0; m < V; ++m) st<TO>(y, yo + lane + 32 * m, v[m] * silu(ld<TI>(z, yo + lane + 32 * m)));
        return;
    }
    hn::rope<D>(v, lane, buf[wid], n_rot, n_rot > 0 ? (float)pos[t] : 0.0f, inv_freq);
#pragma unroll
    for (int m = 0; m < V; ++m) st<TO>(y, yo + lane + 32 * m, v[m]);
}

// ---------------------------------------------------------------------------------------------
// y[t, i] = silu(g[t * g_ld + i]) * u[t * u_ld + i], y contiguous [T, n]. Grid-stride loop.

template <int TI, int TO>
__global__ __launch_bounds__(256) void silu_mul_kernel(const void* __restrict__ g, i64 g_ld, const void* __restrict__ u,
                                                       i64 u_ld, void* __restrict__ y, int T, int n) {
    using namespace ssn;
    const i64 total = (i64)T * n;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (i64)gridDim.x * blockDim.x) {
        const i64 t = k / n, i = k - t * n;
        st<TO>(y, k, silu(ld<TI>(g, t * g_ld + i)) * ld<TI>(u, t * u_ld + i));
    }
}

// y[t, h, d] = x[t, h, d] * sigmoid(gate[t * g_tok + h * g_head + d]); x, y contiguous [T, H, D].

template <int TI, int TG, int TO>
__global__ __launch_bounds__(256) void gate_mul_kernel(const void* __restrict__ x, const void* __restrict__ gate,
                                                       i64 g_tok, i64 g_head, void* __restrict__ y, int T, int H,
                                                       int D) {
    using namespace ssn;
    const i64 total = (i64)T * H * D;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (i64)gridDim.x * blockDim.x) {
        const i64 d = k % D, th = k / D, h = th % H, t = th / H;
        st<TO>(y, k, ld<TI>(x, k) * sigmoid(ld<TG>(gate, t * g_tok + h * g_head + d)));
    }
}
