// fp16 <-> fp32 as the kernels round them (PTX cvt where inline PTX is allowed, else software IEEE binary16 with
// round-to-nearest-even) and the activations' SiLU: shared by quant_matmul.cu (the packs) and quant_gemv.cu (the gemv
// kernels and the gate|up ring's SwiGLU staging), so both give the same bits. The includer defines SS_PTX first.
// kernels/loader.py pastes this file in place of its #include.
#ifndef SPECSPLIT_HALF_CUH
#define SPECSPLIT_HALF_CUH

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(__CUDA_ARCH__) || defined(__HIPCC__) || \
    defined(__HIPCC_RTC__)
#define HF_EXPF(v) expf(v)
#else
#define HF_EXPF(v) __builtin_expf(v)  // CPU simulation: no math header is included
#endif

namespace hf {

// Software IEEE binary16 -> binary32 (exact, handles subnormals, inf and NaN). Out of line: the portable path only.
static __device__ __noinline__ float h2f_soft(unsigned int h) {
    const unsigned int sign = (h & 0x8000u) << 16;
    const unsigned int e = (h >> 10) & 0x1Fu;
    const unsigned int m = h & 0x3FFu;
    if (e == 0) {
        const float v = (float)m * 5.9604644775390625e-8f;  // m * 2^-24, exact
        return sign ? -v : v;
    }
    if (e == 31) return __uint_as_float(sign | 0x7F800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

// Software binary32 -> binary16, round to nearest even (like cvt.rn.f16.f32).
static __device__ __noinline__ unsigned int f2h_soft(float f) {
    const unsigned int x = __float_as_uint(f);
    const unsigned int sign = (x >> 16) & 0x8000u;
    const unsigned int ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return sign | 0x7E00u;   // NaN
    if (ax >= 0x477FF000u) return sign | 0x7C00u;  // rounds to >= 65520: inf
    if (ax < 0x38800000u) {                        // below 2^-14: subnormal half or zero
        if (ax < 0x33000000u) return sign;         // <= 2^-25 rounds to zero (2^-25 is a tie -> even)
        const unsigned int e = ax >> 23;                    // 102..112
        const unsigned int m = (ax & 0x7FFFFFu) | 0x800000u;
        const unsigned int shift = 126u - e;                // 14..24
        unsigned int q = m >> shift;
        const unsigned int rem = m & ((1u << shift) - 1u);
        const unsigned int halfway = 1u << (shift - 1u);
        if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
        return sign | q;
    }
    unsigned int h = (ax >> 13) - (112u << 10);
    const unsigned int rem = ax & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return sign | h;
}

static __device__ __forceinline__ float h2f(unsigned int h) {  // the low 16 bits of h
#if SS_PTX
    float f;
    const unsigned short hs = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(hs));
    return f;
#else
    return h2f_soft(h & 0xFFFFu);
#endif
}

static __device__ __forceinline__ unsigned int f2h(float f) {
#if SS_PTX
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return (unsigned int)h;
#else
    return f2h_soft(f);
#endif
}

// CUDA: the fast exponential and divide, ~5 instructions against ~24 for expf and an IEEE divide (the SwiGLU writers
// of the wide kernel form 48 a lane at a row block's end, where one block a SM leaves nothing to hide them:
// docs/gpu_quant_matmul.md, session 29); a few ulp of float32, far below the fp16 the value is rounded to. The
// condition reads no includer's macro (SS_PTX starts at sm_53 in deltanet.cu, at sm_80 elsewhere), so the packs, the
// ring's staging, the wide SwiGLU launch and decode_step's norm keep giving each other's bits; HIP, the portable
// build and the CPU simulations keep the accurate form.
#if defined(__CUDA_ARCH__) && !defined(__HIP_PLATFORM_AMD__) && !defined(__HIPCC__) && !defined(__HIPCC_RTC__) && \
    !defined(SPECSPLIT_PORTABLE)
#define HF_FAST_SILU 1
#else
#define HF_FAST_SILU 0
#endif
static __device__ __forceinline__ float silu(float v) {
#if HF_FAST_SILU
    return __fdividef(v, 1.0f + __expf(-v));
#else
    return v / (1.0f + HF_EXPF(-v));
#endif
}

}  // namespace hf

#endif  // SPECSPLIT_HALF_CUH
