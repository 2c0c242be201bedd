// The per-head RMSNorm and partial NeoX RoPE of one (token, head) row held by one warp, value d = lane + 32 m in
// v[m]: head_norm_kernel's arithmetic (kernels/norm_rope.cu), shared with attention.cu's one-token attention layer
// (attn_decode_kernel), which norms and rotates its own q and k rows, so both give the same bits. Every lane of the
// warp calls these (they shuffle). kernels/loader.py pastes this file in place of its #include; the CPU simulations
// include it as a file (after <math.h>).
#ifndef SPECSPLIT_HEAD_NORM_CUH
#define SPECSPLIT_HEAD_NORM_CUH

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__) || defined(__HIPCC_RTC__)
#define HN_SHFL_XOR(v, m) __shfl_xor((v), (m), 32)
#define HN_SYNCWARP()                    \
    do {                                 \
        __threadfence_block();           \
        __builtin_amdgcn_wave_barrier(); \
    } while (0)
#else
#define HN_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#define HN_SYNCWARP() __syncwarp()
#endif

namespace hn {

// v *= w / rms(v) over the row's D values (w null: no weight); the squares added per lane in m order, then a
// butterfly across the warp.
template <int D>
static __device__ __forceinline__ void rms_weight(float (&v)[D / 32], int lane, const float* w, float eps) {
    float ss = 0.0f;
#pragma unroll
    for (int m = 0; m < D / 32; ++m) ss += v[m] * v[m];
    for (int s = 16; s >= 1; s >>= 1) ss += HN_SHFL_XOR(ss, s);
    const float inv = 1.0f / sqrtf(ss / (float)D + eps);
#pragma unroll
    for (int m = 0; m < D / 32; ++m) v[m] *= inv * (w != nullptr ? w[lane + 32 * m] : 1.0f);
}

// NeoX RoPE on dims < n_rot at angle p * inv_freq[i] (dim i pairs with i + n_rot / 2); buf: this warp's D floats of
// shared memory, through which a lane reads its partner dims' values.
template <int D>
static __device__ __forceinline__ void rope(float (&v)[D / 32], int lane, float* buf, int n_rot, float p,
                                            const float* inv_freq) {
    if (n_rot <= 0) return;
#pragma unroll
    for (int m = 0; m < D / 32; ++m) buf[lane + 32 * m] = v[m];
    HN_SYNCWARP();
    const int half = n_rot >> 1;
#pragma unroll
    for (int m = 0; m < D / 32; ++m) {
        const int i = lane + 32 * m;
        if (i < n_rot) {
            const int f = i < half ? i : i - half;
            const float ang = p * inv_freq[f];
            const float c = cosf(ang), sn = sinf(ang);
            v[m] = i < half ? v[m] * c - buf[i + half] * sn : v[m] * c + buf[i - half] * sn;
        }
    }
    HN_SYNCWARP();  // buf may be written again right after (the next row of this warp)
}

}  // namespace hn

#endif  // SPECSPLIT_HEAD_NORM_CUH
