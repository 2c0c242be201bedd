// x as the gemv kernel (quant_gemv.cu) multiplies it with quantized weights: per 16-value group, int16 values with one
// fp32 scale and the group's fp32 sum. Shared by the gemv kernel (which can quantize x itself) and the pack kernels of
// quant_matmul.cu (which write it once per launch for every gemv block to copy: PackedX.q16, one thread per 8 values
// with its group partner a shuffle away), so both give the same bits. A group is two halves of 8 values: its maximum
// |x| is the larger of theirs, its sum the low half's plus the high half's (each added in value order).
// kernels/loader.py pastes this file in place of its #include; the CPU simulations include it as a file.
#ifndef SPECSPLIT_XQ16_CUH
#define SPECSPLIT_XQ16_CUH

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(__CUDA_ARCH__) || defined(__HIPCC__) || \
    defined(__HIPCC_RTC__)
#define XQ_FMA(a, b, c) __fmaf_rn((a), (b), (c))
#else
#define XQ_FMA(a, b, c) __builtin_fmaf((a), (b), (c))  // CPU simulation: the same single rounding
#endif

namespace xq {

// round(a b) to the nearest int (ties to even) of the exact product, for |a b| < 2^22: one fma adding 1.5 * 2^23
// leaves it in the low mantissa bits (one rounding, whether or not a compiler would have fused a multiply and add)
static __device__ __forceinline__ int rint_mul(float a, float b) {
    return (int)(__float_as_uint(XQ_FMA(a, b, 12582912.0f)) - 0x4B400000u);
}

// max |f| and the sum of f[0..7] (in order). (No fmaxf / fabsf: the CPU simulations include no math header first.)
static __device__ __forceinline__ void stats8(const float* f, float& amax, float& sum) {
    amax = 0.f, sum = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const float a = f[e] < 0.f ? -f[e] : f[e];
        amax = a > amax ? a : amax;
        sum += f[e];
    }
}

static __device__ __forceinline__ float fmax2(float a, float b) { return a > b ? a : b; }

// 1 / the group's scale (0 for an all-zero group), and the scale max |x| / 32767
static __device__ __forceinline__ float inv_scale(float amax) { return amax > 0.f ? 32767.0f / amax : 0.f; }
static __device__ __forceinline__ float scale_of(float amax) { return amax * (1.0f / 32767.0f); }

// f[0..7] as int16 pairs round(f * inv) (values 2p, 2p + 1 in word p)
static __device__ __forceinline__ uint4 quant8(const float* f, float inv) {
    unsigned int w[4];
#pragma unroll
    for (int p = 0; p < 4; ++p)
        w[p] = ((unsigned int)rint_mul(f[2 * p], inv) & 0xFFFFu) | ((unsigned int)rint_mul(f[2 * p + 1], inv) << 16);
    return uint4{w[0], w[1], w[2], w[3]};
}

// One whole group f[0..15]: its two int16 units, scale and sum
static __device__ __forceinline__ void group16(const float* f, uint4& o0, uint4& o1, float& scale, float& sum) {
    float a0, s0, a1, s1;
    stats8(f, a0, s0);
    stats8(f + 8, a1, s1);
    const float amax = fmax2(a0, a1), inv = inv_scale(amax);
    o0 = quant8(f, inv);
    o1 = quant8(f + 8, inv);
    scale = scale_of(amax);
    sum = s0 + s1;
}

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__) || defined(__HIPCC_RTC__)
#define XQ_SHFL(v, src) __shfl((v), (src), 32)
#else
#define XQ_SHFL(v, src) __shfl_sync(0xffffffffu, (v), (src))
#endif

// A group whose 16 values sit one per lane in 16 consecutive lanes of a warp (value r of the group in lane 16 k + r;
// every lane of the warp calls this: it shuffles): the group's staging as group16 makes it from the same values.
// word: this lane's int16 with its odd neighbour's in the high half (the buffer's word r / 2, from even lanes);
// scale and sum (values 0..7 added in order, then 8..15, low + high) on every lane.
static __device__ __forceinline__ void group16_lanes(float f, unsigned int& word, float& scale, float& sum) {
    const int lane = (int)(threadIdx.x & 31u), base = lane & 16;
    float amax = f < 0.f ? -f : f;
#pragma unroll
    for (int m = 1; m < 16; m <<= 1) amax = fmax2(amax, XQ_SHFL(amax, lane ^ m));
    float lo = 0.f, hi = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        lo += XQ_SHFL(f, base + e);
        hi += XQ_SHFL(f, base + 8 + e);
    }
    const int q = rint_mul(f, inv_scale(amax));
    const int qp = XQ_SHFL(q, lane ^ 1);
    word = ((unsigned int)q & 0xFFFFu) | ((unsigned int)qp << 16);
    scale = scale_of(amax);
    sum = lo + hi;
}

// PackedX.q16 for T tokens and nch chunks of 256 values: group g of token n in chunk ch has its two int16 units at
// [(ch T + n) 32 + 2g (+1)] (16-byte units), then scales [nch T 16] and sums [nch T 16] (fp32) after all nch T 32
// units, both at (ch T + n) 16 + g: the order the gemv kernel stages them in shared memory.
static __device__ __forceinline__ float* q16_scales(uint4* q16, int nch, int T) {
    return (float*)(q16 + (long long)nch * T * 32);
}

// Stores what group16_lanes gave lane r (0..15) of group g of token n in chunk ch (r = 0 also the scale and sum).
static __device__ __forceinline__ void put_group16_lanes(uint4* q16, int nch, int T, int ch, int n, int g, int r,
                                                         unsigned int word, float scale, float sum) {
    const long long cn = (long long)ch * T + n;
    if ((r & 1) == 0) ((unsigned int*)(q16 + cn * 32 + 2 * g))[r >> 1] = word;
    if (r == 0) {
        float* const sc = q16_scales(q16, nch, T);
        sc[cn * 16 + g] = scale;
        sc[(long long)nch * T * 16 + cn * 16 + g] = sum;
    }
}

// One 8-value unit uu (values 8 uu .. 8 uu + 7 of chunk ch) of token n, from its values f[0..7]; units uu and uu ^ 1
// (one 16-value group) are lanes l and l ^ 1 of a warp, whose halves' maxima and sums meet by shuffle: every lane
// of the warp calls it, `live` says whether this lane has a unit to write. The low half's lane writes the scale and
// the sum (its 8 values' sum plus the high half's).
static __device__ __forceinline__ void put_unit8(uint4* q16, int nch, int T, int ch, int n, int uu, const float* f,
                                                 bool live) {
    float amax, sum;
    stats8(f, amax, sum);
    const int lane = (int)(threadIdx.x & 31u);
    const float pa = XQ_SHFL(amax, lane ^ 1), ps = XQ_SHFL(sum, lane ^ 1);
    if (!live) return;
    amax = fmax2(amax, pa);
    const long long cn = (long long)ch * T + n;
    q16[cn * 32 + uu] = quant8(f, inv_scale(amax));
    if ((uu & 1) == 0) {
        float* const sc = q16_scales(q16, nch, T);
        sc[cn * 16 + (uu >> 1)] = scale_of(amax);
        sc[(long long)nch * T * 16 + cn * 16 + (uu >> 1)] = sum + ps;
    }
}

}  // namespace xq

#endif  // SPECSPLIT_XQ16_CUH
