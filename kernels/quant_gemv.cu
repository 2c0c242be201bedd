// Small-width fused dequantize + matrix-vector product on the v2 device layout:  y[T, N] (+)= x[T, K] @ W[N, K]^T
// for T = 1..16 on CUDA cores, streaming the weights with 16-byte read-only loads.
//
// Same inputs as qmv_kernel in quant_matmul.cu: W in `device_layout()` (per 16-row tile and 256-value chunk one
// contiguous block [16 rows' quants][16 rows' side data]; F16 / Q8_0 full chunks with 16-byte units swizzled),
// x packed by pack_x_kernel (fp16, tokens padded to 8, the v2 order). Types: F16 (1), Q8_0 (8), Q4_K (12), Q6_K (14).
//
// Design (docs/gpu_quant_matmul.md, "gemv"):
//  * Block = one 16-row tile x KW warps (blockDim.x = 32 KW); warp w owns chunks [w n / KW, (w+1) n / KW) of K.
//    Grid = one block per tile. No atomics: the warps' partial sums meet in shared memory and are added in
//    warp order, so results are bitwise reproducible.
//  * Persistent variant (gemv_persist_kernel, quantized types): a few blocks per SM, each staging x once and
//    walking tiles b, b + G, ...; each warp's loads run 1-2 chunks ahead of its arithmetic, across tile ends.
//    Same sums in the same order as gemv_kernel at the same KW: bitwise equal outputs.
//  * Split-K variant (gemv_splitk_kernel, all types): S blocks per tile, each staging only its K range of x; the
//    warps' sums go to a global scratch and the tile's last block to arrive (per-tile counter, self-resetting) adds
//    them in warp order: bitwise gemv_kernel's output with S KW warps, graph-replayable with no memset.
//  * x is staged once per block in shared memory, in natural value order (chunk, token, 16-byte unit of 8 values):
//    copied from the pack's own int16 staging when it wrote one (xq = PackedX.q16, kernels/xq16.cuh), else computed.
//    F16 weights: x as fp16, products in fp32 FMAs. Quantized weights (Q8_0, Q4_K, Q6_K): x as int16 with one
//    fp32 scale per 16 values (s = max |x| / 32767 of the group), plus (Q4_K, Q6_K) the group's fp32 sum X; the
//    dot products are integer dp2a (two int16 x times two 8-bit quants per instruction, exact int32 sums per
//    group of 16), then per group acc += (a s) float(sum) - b X with a, b the weights' per-group scale and offset:
//      Q8_0  d q            a = d,       b = 0
//      Q4_K  d sc q - dmin m  a = d sc,  b = dmin m
//      Q6_K  d sc (q - 32)  a = d sc,    b = 32 d sc
//  * Lane = 4 j + r: it owns rows r, r+4, r+8, r+12 of the tile and, in every chunk, the same 32 values of each
//    (so its x words per token are read once and used for 4 rows). Per row and chunk its weights are one 16-byte
//    unit (Q4_K: qs; Q6_K: ql, plus a qh unit), two (Q8_0) or four (F16): one warp load instruction reads
//    4 rows x 128 contiguous bytes. The next chunk's loads are issued before the current one is computed.
//  * Rounding: x is fp16 (as for v2); for the quantized types each x_i is then replaced by s round(x_i / s), an
//    error <= s / 2 = 2^-16 max|x| of its group of 16 (below the fp16 rounding of every value within 1/32 of that
//    maximum). Weights are exact (no fp16 rounding of d sc q as in v2), sums exact in int32, the rest fp32.
//
// Portable: every inline PTX has a plain C++ fallback (SS_PTX == 0: HIP, pre-sm_80, -DSPECSPLIT_PORTABLE, and the
// CPU simulation in tests/cuda_sim_gemv.cpp). Includes only xq16.cuh, bulk.cuh, half.cuh and pdl.cuh of this folder
// (kernels/loader.py pastes them in), nothing that NVRTC / hipRTC do not provide built in.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;
typedef long long i64;

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__) || defined(__HIPCC_RTC__)
#define SS_HIP 1
#else
#define SS_HIP 0
#endif

#if !SS_HIP && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800) && !defined(SPECSPLIT_PORTABLE)
#define SS_PTX 1
#else
#define SS_PTX 0
#endif

#define GV_DEV static __device__ __forceinline__
#if defined(__CUDACC__) || SS_HIP
#define GV_BOUNDS(threads) __launch_bounds__(threads)
#define GV_LDG(p) __ldg(p)
#else
#define GV_BOUNDS(threads)  // CPU simulation
#define GV_LDG(p) (*(p))
#endif

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(__CUDA_ARCH__) || SS_HIP
#define GV_SQRTF(v) sqrtf(v)
#else  // CPU simulation: no math header is included first
#define GV_SQRTF(v) __builtin_sqrtf(v)
#endif

#if SS_HIP
#define GV_SHFL_XOR(v, m) __shfl_xor((v), (m), 32)
#else
#define GV_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#endif

#include "xq16.cuh"
#include "bulk.cuh"
#include "half.cuh"
#include "bits.cuh"
#include "pdl.cuh"

namespace gv {

constexpr int CHUNK = 256;
constexpr int MAX_KW = 8;  // warps per block (launch bound 256 threads)

// ---------------------------------------------------------------------------------------------
// Bit helpers

GV_DEV float as_float(u32 u) { return __uint_as_float(u); }

using hf::h2f;  // kernels/half.cuh: the packs' conversions and SiLU (quant_matmul.cu)
using hf::f2h;
using hf::silu;
using bits::byte_perm;  // kernels/bits.cuh

// c + a.s16[0] * b.x8[0] + a.s16[1] * b.x8[1]  (lo: bytes 0, 1 of b; hi: bytes 2, 3); the bytes x8 signed (Q8_0's
// quants) or, UB, unsigned: Q4_K's high nibbles stay in place (16 q, 0..240) so no shift unpacks them
template <bool UB = false>
GV_DEV int dp2a_lo(u32 a, u32 b, int c) {
#if SS_PTX
    int d;
    if constexpr (UB)
        asm("dp2a.lo.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    else
        asm("dp2a.lo.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#else
    const int b0 = UB ? (int)(b & 0xFFu) : (int)(signed char)(b & 0xFFu);
    const int b1 = UB ? (int)((b >> 8) & 0xFFu) : (int)(signed char)((b >> 8) & 0xFFu);
    return c + (int)(short)(a & 0xFFFFu) * b0 + (int)(short)(a >> 16) * b1;
#endif
}
template <bool UB = false>
GV_DEV int dp2a_hi(u32 a, u32 b, int c) {
#if SS_PTX
    int d;
    if constexpr (UB)
        asm("dp2a.hi.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    else
        asm("dp2a.hi.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#else
    const int b2 = UB ? (int)((b >> 16) & 0xFFu) : (int)(signed char)((b >> 16) & 0xFFu);
    const int b3 = UB ? (int)(b >> 24) : (int)(signed char)(b >> 24);
    return c + (int)(short)(a & 0xFFFFu) * b2 + (int)(short)(a >> 16) * b3;
#endif
}

// (a & b) ^ c as one LOP3 (ptxas keeps two immediates apart in two)
GV_DEV u32 lop3_and_xor(u32 a, u32 b, u32 c) {
#if SS_PTX
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0x6A;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#else
    return (a & b) ^ c;
#endif
}

GV_DEV uint4 ldg16(const u8* p) { return GV_LDG((const uint4*)p); }
GV_DEV u32 ldg_u16(const u8* p) { return (u32)GV_LDG((const u16*)p); }
GV_DEV u32 ldg_u8(const u8* p) { return (u32)GV_LDG(p); }
// The same reads from global memory (read-only path) or, SMEM, from a copy in shared memory (the ring kernel)
template <bool SMEM>
GV_DEV uint4 ld16(const u8* p) {
    if constexpr (SMEM) return *(const uint4*)p;
    else return ldg16(p);
}
template <bool SMEM>
GV_DEV u32 ld_u16(const u8* p) {
    if constexpr (SMEM) return (u32) * (const u16*)p;
    else return ldg_u16(p);
}
template <bool SMEM>
GV_DEV u32 ld_u8(const u8* p) {
    if constexpr (SMEM) return (u32)*p;
    else return ldg_u8(p);
}

GV_DEV float shfl_xor(float v, int m) { return GV_SHFL_XOR(v, m); }

// A float that another block of this launch wrote before its __threadfence: read at L2 (ld.global.cg), never from
// a line this SM's L1 may still hold, and never through the read-only path (__ldg assumes launch-long constants).
GV_DEV float ld_partial(const float* p) {
#if SS_PTX
    return __ldcg(p);
#else
    return *(const volatile float*)p;
#endif
}


// ---------------------------------------------------------------------------------------------
// Per type: bytes per row of a full chunk (quants MAIN + side data SIDE); whether x is staged as int16 with group
// scales (INT) and with group sums (SUMS: the K-quants' offsets); the raw words one lane loads per chunk.

template <int QT>
struct Lay;
template <>
struct Lay<1> {
    static constexpr int MAIN = 512, SIDE = 0;
    static constexpr bool INT = false, SUMS = false;
};
template <>
struct Lay<8> {
    static constexpr int MAIN = 256, SIDE = 16;
    static constexpr bool INT = true, SUMS = false;
};
template <>
struct Lay<12> {
    static constexpr int MAIN = 144, SIDE = 0;
    static constexpr bool INT = true, SUMS = true;
};
template <>
struct Lay<13> {  // Q5_K: Q4_K's header, qh[32], then Q4_K's qs
    static constexpr int MAIN = 176, SIDE = 0;
    static constexpr bool INT = true, SUMS = true;
};
template <>
struct Lay<14> {
    static constexpr int MAIN = 192, SIDE = 18;
    static constexpr bool INT = true, SUMS = true;
};
template <>
struct Lay<23> {  // IQ4_XS: qs | {f16 d; u16 scales_h; u8 scales_l[4]} (quant_matmul.device_layout); signed codebook
    static constexpr int MAIN = 128, SIDE = 8;   // values, one scale a 32 values, no offsets
    static constexpr bool INT = true, SUMS = false;
};
template <>
struct Lay<11> {  // Q3_K: hmask[32] qs[64] | scales[12] d (quant_matmul.device_layout); its "- 4" is inside each
    static constexpr int MAIN = 96, SIDE = 14;    // quant (signed bytes -4..3), so no offsets
    static constexpr bool INT = true, SUMS = false;
};
template <>
struct Lay<2> {  // Q4_0: the 8 blocks' qs (8-byte pieces swizzled: load_raw, xunit) | their d's; signed 16 (q - 8)
    static constexpr int MAIN = 128, SIDE = 16;
    static constexpr bool INT = true, SUMS = false;
};
template <>
struct Lay<20> : Lay<2> {};  // IQ4_NL: Q4_0's layout; signed codebook values

template <int QT>
struct Raw;
template <>
struct Raw<12> {  // Q4_K: qs unit j and the 16-byte header (d, dmin, scales) of each row
    uint4 q[4], h[4];
};
template <>
struct Raw<13> {  // Q5_K: qs unit j, the header, and qh unit j & 1 (the fifth bits of the same values)
    uint4 q[4], h[4], b[4];
};
template <>
struct Raw<23> {  // IQ4_XS: qs unit j (sub-block j), d | scales_h << 16, scales_l[j / 2]
    uint4 q[4];
    u32 d[4], s[4];
};
template <>
struct Raw<11> {  // Q3_K: qs unit j / 2, hmask unit (j / 2) & 1, the runs' scale bytes (low nibbles, top bits), d
    uint4 q[4], h[4];
    u32 s[4], d[4];
};
template <>
struct Raw<2> {  // Q4_0: qs unit j (block j), its d
    uint4 q[4];
    u32 d[4];
};
template <>
struct Raw<20> : Raw<2> {};  // IQ4_NL: as Q4_0
template <>
struct Raw<14> {  // Q6_K: ql unit j, qh unit, two int8 scales, d
    uint4 l[4], h[4];
    u32 s[4], d[4];
};
template <>
struct Raw<8> {  // Q8_0: logical units j and 8 + j, the d of their blocks
    uint4 a[4], b[4];
    u32 d[4];
};
template <>
struct Raw<1> {  // F16: logical units j, j + 8, j + 16, j + 24
    uint4 u[4][4];
};

// x units (16 bytes = 8 values, natural order within a chunk) lane j uses: its k-th 8 values are x unit
// xunit(j, k / 8). For the quantized types units come in pairs (u, u + 1) = one 16-value group: its values
// 0..15 ("low run") and 16..31 ("high run") are the two groups whose scale / offset it applies. r4: the lane's rows'
// r & 3 (Q4_0 / IQ4_NL: odd rows hold each qs unit's halves swapped, so their lanes take the x units swapped).
template <int QT>
GV_DEV int xunit(int j, int k, int r4 = 0) {
    if constexpr (QT == 12 || QT == 13) {  // qs bytes 16j..16j+15: low nibbles values 64(j/2) + 16(j&1) + b, high + 32
        const int base = 8 * (j >> 1) + 2 * (j & 1);
        return base + (k & 1) + 4 * (k >> 1);
    } else if constexpr (QT == 14) {  // j = 4hh + 2c + s: values 128hh + 32c + 16s + b, and + 64
        const int base = 16 * (j >> 2) + 4 * ((j >> 1) & 1) + 2 * (j & 1);
        return base + (k & 1) + 8 * (k >> 1);
    } else if constexpr (QT == 8) {  // logical units j (values 16j..) and 8 + j (values 128 + 16j..)
        return 2 * j + (k & 1) + 16 * (k >> 1);
    } else if constexpr (QT == 23) {  // qs bytes 16j..16j+15: low nibbles values 32j + b, high ones 32j + 16 + b
        return 4 * j + k;
    } else if constexpr (QT == 11) {  // qs unit 2h + p (h, p = bits 2, 1 of j), bit pair s = 2 (j & 1) (low run) and
        // s + 1 (high): values 128h + 32s + 16p + b and + 32
        const int base = 16 * (j >> 2) + 8 * (j & 1) + 2 * ((j >> 1) & 1);
        return base + (k & 1) + 4 * (k >> 1);
    } else if constexpr (QT == 2 || QT == 20) {  // as IQ4_XS's, bytes 8..15 of the unit first in odd rows
        return 4 * j + (k ^ (r4 & 1));
    } else {  // F16: logical unit j + 8k
        return j + 8 * k;
    }
}

template <int QT, bool SMEM = false>
GV_DEV void load_raw(Raw<QT>& w, const u8* blk, int r4, int j) {
    using L = Lay<QT>;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = r4 + 4 * i;
        const u8* row = blk + r * L::MAIN;
        if constexpr (QT == 12) {
            w.q[i] = ld16<SMEM>(row + 16 + 16 * j);
            w.h[i] = ld16<SMEM>(row);
        } else if constexpr (QT == 13) {
            w.q[i] = ld16<SMEM>(row + 48 + 16 * j);
            w.h[i] = ld16<SMEM>(row);
            w.b[i] = ld16<SMEM>(row + 16 + 16 * (j & 1));
        } else if constexpr (QT == 14) {
            const int hh = j >> 2, c = (j >> 1) & 1, s = j & 1;
            w.l[i] = ld16<SMEM>(row + 16 * j);
            w.h[i] = ld16<SMEM>(row + 128 + 32 * hh + 16 * s);
            const u8* side = blk + 16 * L::MAIN + r * L::SIDE;
            w.s[i] = ld_u8<SMEM>(side + 8 * hh + 2 * c + s) | (ld_u8<SMEM>(side + 8 * hh + 4 + 2 * c + s) << 8);
            w.d[i] = ld_u16<SMEM>(side + 16);
        } else if constexpr (QT == 2 || QT == 20) {
            // qs unit j (block j) of row r at unit j ^ [0, 2, 5, 7][r & 3] (quant_matmul.device_layout: 8-byte piece s
            // at s ^ 5 (r & 3), so the unit's halves come swapped in odd rows); the d of block j
            w.q[i] = ld16<SMEM>(row + 16 * (j ^ ((5 * (r & 3)) >> 1)));
            w.d[i] = ld_u16<SMEM>(blk + 16 * L::MAIN + r * L::SIDE + 2 * j);
        } else if constexpr (QT == 23) {
            w.q[i] = ld16<SMEM>(row + 16 * j);
            const u8* side = blk + 16 * L::MAIN + r * L::SIDE;
            w.d[i] = ld_u16<SMEM>(side) | (ld_u16<SMEM>(side + 2) << 16);
            w.s[i] = ld_u8<SMEM>(side + 4 + (j >> 1));
        } else if constexpr (QT == 11) {
            // the runs' sub-blocks 8h + 2s + p: low nibbles in scales[4 (j & 1) + p] and [+ 2], top bits in scales[8 +
            // p] and [10 + p]: a 16-bit word each in the side bytes' order (quant_matmul.Q3K_SIDE)
            const int p = (j >> 1) & 1;
            w.q[i] = ld16<SMEM>(row + 32 + 16 * (j >> 1));
            w.h[i] = ld16<SMEM>(row + 16 * p);
            const u8* side = blk + 16 * L::MAIN + r * L::SIDE;
            w.s[i] = ld_u16<SMEM>(side + 4 * (j & 1) + 2 * p) | (ld_u16<SMEM>(side + 8 + 2 * p) << 16);
            w.d[i] = ld_u16<SMEM>(side + 12);
        } else if constexpr (QT == 8) {
            w.a[i] = ld16<SMEM>(row + 16 * (j ^ (r & 7)));
            w.b[i] = ld16<SMEM>(row + 16 * ((8 + j) ^ ((r + 2) & 7)));
            const u8* side = blk + 16 * L::MAIN + r * L::SIDE;
            w.d[i] = ld_u16<SMEM>(side + 2 * (j >> 1)) | (ld_u16<SMEM>(side + 8 + 2 * (j >> 1)) << 16);
        } else {
#pragma unroll
            for (int m = 0; m < 4; ++m) w.u[i][m] = ld16<SMEM>(row + 16 * ((j + 8 * m) ^ ((r + 2 * m) & 7)));
        }
    }
}

// Per row of a chunk, quantized types: scale a and offset b of the low / high run (value = a q - b).
struct Coef {
    float a0, b0, a1, b1;
};

template <int QT>
GV_DEV Coef coef(const Raw<QT>& w, int i, int j) {
    Coef c;
    if constexpr (QT == 12 || QT == 13) {  // (Q5_K's header is Q4_K's)
        // sub-blocks s = 2g, 2g + 1 (g = j / 2): scale / min bytes (kquants._scale_min_k4), all four decoded at once.
        // One byte permute gathers the pair's scale bytes (y) and min bytes (z), another the pair's bytes of w next
        // to themselves shifted down a nibble, so v's bytes are sc(2g), sc(2g + 1), mn(2g), mn(2g + 1) after one
        // mask (g < 2: the low 6 bits) or two (g >= 2: 4 bits of w, the top 2 of y / z); the masks and the shift
        // are the lane's constants, so no lane computes both forms and selects.
        const uint4 hd = w.h[i];
        const int g = j >> 1;
        const bool lo = g < 2;
        const u32 sel = (g & 1) ? 0x7632u : 0x5410u;  // bytes 2 (g & 1), + 1 of the first word, then of the second
        const u32 yz = byte_perm(hd.y, hd.z, sel), nib = byte_perm(hd.w, hd.w >> 4, sel);
        const u32 v = (nib & (lo ? 0u : 0x0F0F0F0Fu)) | ((yz >> (lo ? 0 : 2)) & (lo ? 0x3F3F3F3Fu : 0x30303030u));
        // d q as fma(d, 2^23 + q, -2^23 d): the byte permute puts q in a float's mantissa, so no integer to float
        // conversion; one rounding of the exact d q, so bitwise d * (float)q
        const float d = h2f(hd.x), dmin = h2f(hd.x >> 16);
        const float dm = d * -8388608.f, mm = dmin * -8388608.f;
        c.a0 = fmaf(d, as_float(byte_perm(v, 0x4B000000u, 0x7440u)), dm);
        c.a1 = fmaf(d, as_float(byte_perm(v, 0x4B000000u, 0x7441u)), dm);
        c.b0 = fmaf(dmin, as_float(byte_perm(v, 0x4B000000u, 0x7442u)), mm);
        c.b1 = fmaf(dmin, as_float(byte_perm(v, 0x4B000000u, 0x7443u)), mm);
    } else if constexpr (QT == 2) {  // 16 (q - 8) bytes (qbytes): d / 16, exact
        c.a0 = c.a1 = h2f(w.d[i]) * 0.0625f;
        c.b0 = c.b1 = 0.f;
    } else if constexpr (QT == 20) {
        c.a0 = c.a1 = h2f(w.d[i]);
        c.b0 = c.b1 = 0.f;
    } else if constexpr (QT == 23) {
        // sub-block j's 6-bit scale: nibble j & 1 of scales_l[j / 2] and bits 2j, 2j + 1 of scales_h, stored + 32
        const u32 ls = ((w.s[i] >> (4 * (j & 1))) & 0xFu) | (((w.d[i] >> (16 + 2 * j)) & 3u) << 4);
        c.a0 = c.a1 = h2f(w.d[i]) * (float)((int)ls - 32);
        c.b0 = c.b1 = 0.f;
    } else if constexpr (QT == 11) {
        // 6-bit scales stored + 32: nibble h = j >> 2 of s's bytes 0 / 1, bits 2 (2h + (j & 1)) of bytes 2 / 3
        const u32 s = w.s[i], n4 = 4u * (u32)(j >> 2), t2 = 2u * (u32)(2 * (j >> 2) + (j & 1));
        const u32 sc0 = ((s >> n4) & 0xFu) | (((s >> (16u + t2)) & 3u) << 4);
        const u32 sc1 = ((s >> (8u + n4)) & 0xFu) | (((s >> (24u + t2)) & 3u) << 4);
        const float d = h2f(w.d[i]);
        c.a0 = d * (float)((int)sc0 - 32);
        c.a1 = d * (float)((int)sc1 - 32);
        c.b0 = c.b1 = 0.f;
    } else if constexpr (QT == 14) {
        const float d = h2f(w.d[i]);
        c.a0 = d * (float)(int)(signed char)(w.s[i] & 0xFFu);
        c.a1 = d * (float)(int)(signed char)(w.s[i] >> 8);
        c.b0 = 32.0f * c.a0;
        c.b1 = 32.0f * c.a1;
    } else {
        c.a0 = h2f(w.d[i]);
        c.a1 = h2f(w.d[i] >> 16);
        c.b0 = c.b1 = 0.f;
    }
    return c;
}

// The 32 quants of row i as bytes, 4 per word in the order of the lane's x values: q[0..3] the low run,
// q[4..7] the high run (Q4_K nibbles 0..15 low, 16 x 0..15 high: left in place, the 1 / 16 goes into the high run's x
// scale; Q6_K 0..63; Q8_0 signed).
template <int QT>
GV_DEV void qbytes(const Raw<QT>& w, int i, int j, u32 (&q)[8]) {
    if constexpr (QT == 12) {
        const u32 ws[4] = {w.q[i].x, w.q[i].y, w.q[i].z, w.q[i].w};
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            q[m] = ws[m] & 0x0F0F0F0Fu;
            q[4 + m] = ws[m] & 0xF0F0F0F0u;
        }
    } else if constexpr (QT == 13) {
        // Q5_K: the fifth bit of value l of sub-block 2g (the low nibbles) / 2g + 1 (the high ones), g = j / 2, is bit
        // 2g / 2g + 1 of qh byte l, the byte at the same place in qh unit j & 1 as the value's qs byte in unit j; the
        // high run shifted down (31 would not fit a byte as 16 q)
        const int g2 = 2 * (j >> 1);
        const u32 ws[4] = {w.q[i].x, w.q[i].y, w.q[i].z, w.q[i].w};
        const u32 hs[4] = {w.b[i].x, w.b[i].y, w.b[i].z, w.b[i].w};
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            q[m] = (ws[m] & 0x0F0F0F0Fu) | (((hs[m] >> g2) & 0x01010101u) << 4);
            q[4 + m] = ((ws[m] >> 4) & 0x0F0F0F0Fu) | (((hs[m] >> (g2 + 1)) & 0x01010101u) << 4);
        }
    } else if constexpr (QT == 23 || QT == 20) {
        // the codebook's int8 values (signed: dot16<false>): low nibbles the low run, high nibbles the high run
        const u32 ws[4] = {w.q[i].x, w.q[i].y, w.q[i].z, w.q[i].w};
#pragma unroll
        for (int m = 0; m < 4; ++m) bits::iq4_lookup_runs(ws[m], q[m], q[4 + m]);
    } else if constexpr (QT == 11) {
        // Q3_K: bit pairs s = 2 (j & 1) (low run) and s + 1 (high) of the qs unit's bytes, hmask bits 4h + s of the
        // hmask unit's bytes at the same places (h = j >> 2); signed bytes q - 4 (1 - hbit) in -4..3 (dot16<false>):
        // q's two bits under a top of ones where the hmask bit is clear (0xFC - 0xFC hbit: no borrow between bytes).
        // The high run's bytes stay in place as 4 (q - 4 (1 - hbit)) in -16..12 (0xF0 - 0x78 (2 hbit)); chunk_int folds
        // the 1 / 4 into that run's x scale as Q4_K's 1 / 16: 8 instructions a word instead of 10
        const u32 sq = 4u * (u32)(j & 1), sh = 4u * (u32)(j >> 2) + sq / 2u;
        const u32 ws[4] = {w.q[i].x, w.q[i].y, w.q[i].z, w.q[i].w};
        const u32 hs[4] = {w.h[i].x, w.h[i].y, w.h[i].z, w.h[i].w};
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const u32 qq = ws[m] >> sq, hb = hs[m] >> sh;
            q[m] = (qq & 0x03030303u) | (0xFCFCFCFCu - (hb & 0x01010101u) * 0xFCu);
            q[4 + m] = (qq & 0x0C0C0C0Cu) | (0xF0F0F0F0u - (hb & 0x02020202u) * 0x78u);
        }
    } else if constexpr (QT == 2) {
        // signed 16 (q - 8): (q ^ 8) in a byte's top nibble is q - 8 in two's complement, so one LOP3 a run (and the
        // low run's shift) where q - 8 itself would take a borrow-free subtraction and a sign extension; coef has
        // the 1 / 16. (Unsigned q with the x sums' offset -8 d X, as Q4_K's, saves the shift but adds two FFMA a row
        // and token, and subtracts two sums of the same size.)
        const u32 ws[4] = {w.q[i].x, w.q[i].y, w.q[i].z, w.q[i].w};
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            q[m] = lop3_and_xor(ws[m] << 4, 0xF0F0F0F0u, 0x80808080u);
            q[4 + m] = lop3_and_xor(ws[m], 0xF0F0F0F0u, 0x80808080u);
        }
    } else if constexpr (QT == 14) {
        const int c2 = 2 * ((j >> 1) & 1);  // qh bit pair 2c (low nibbles) / 4 + 2c (high nibbles)
        const u32 ls[4] = {w.l[i].x, w.l[i].y, w.l[i].z, w.l[i].w};
        const u32 hs[4] = {w.h[i].x, w.h[i].y, w.h[i].z, w.h[i].w};
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            q[m] = (ls[m] & 0x0F0F0F0Fu) | ((hs[m] << (4 - c2)) & 0x30303030u);
            q[4 + m] = ((ls[m] >> 4) & 0x0F0F0F0Fu) | ((hs[m] >> c2) & 0x30303030u);
        }
    } else {
        q[0] = w.a[i].x, q[1] = w.a[i].y, q[2] = w.a[i].z, q[3] = w.a[i].w;
        q[4] = w.b[i].x, q[5] = w.b[i].y, q[6] = w.b[i].z, q[7] = w.b[i].w;
    }
}

// sum over 16 values: int16 x pairs xq[0..7] (values 2p, 2p + 1) times the 16 quant bytes of q[0..3] (unsigned: UB)
template <bool UB>
GV_DEV int dot16(const u32* xq, const u32* q) {
    int s = 0;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        s = dp2a_lo<UB>(xq[2 * m], q[m], s);
        s = dp2a_hi<UB>(xq[2 * m + 1], q[m], s);
    }
    return s;
}

// F16: the 32 weights of row i as floats, in the order of the lane's x values
GV_DEV void f16_weights(const Raw<1>& w, int i, float (&f)[32]) {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const u32 ws[4] = {w.u[i][m].x, w.u[i][m].y, w.u[i][m].z, w.u[i][m].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            f[8 * m + 2 * e] = h2f(ws[e]);
            f[8 * m + 2 * e + 1] = h2f(ws[e] >> 16);
        }
    }
}

// One packed x unit (pack order: words (0,2), (1,3), (4,6), (5,7)) -> 8 floats in natural order.
GV_DEV void unit_f(uint4 u, float* f) {
    f[0] = h2f(u.x);
    f[2] = h2f(u.x >> 16);
    f[1] = h2f(u.y);
    f[3] = h2f(u.y >> 16);
    f[4] = h2f(u.z);
    f[6] = h2f(u.z >> 16);
    f[5] = h2f(u.w);
    f[7] = h2f(u.w >> 16);
}

// A 16-value group of x (two packed units) as staged for the quantized types (xq16.cuh): int16 pairs in natural
// order, its scale and its sum.
GV_DEV void quant_group(uint4 u0, uint4 u1, uint4& o0, uint4& o1, float& scale, float& sum) {
    float f[16];
    unit_f(u0, f);
    unit_f(u1, f + 8);
    xq::group16(f, o0, o1, scale, sum);
}

// ---------------------------------------------------------------------------------------------
// Pieces of both kernels

// Stage x chunks [cb0, cb0 + ncb) for one block (staged chunk i = chunk cb0 + i): one thread per 16-value group
// (2 units), in batches of SB groups per thread with all their loads issued first (one L2 latency per batch, not
// per group). Caller syncs.
template <int QT, int NT>
GV_DEV void stage_x(const uint4* __restrict__ xp, int tpad, int K, int cb0, int ncb, uint4* sx, float* sxq,
                    float* sxs) {
    using L = Lay<QT>;
    constexpr int SB = 4;
    const int nthreads = (int)blockDim.x;
    const int ngroups = ncb * NT * 16;
    for (int g0 = (int)threadIdx.x; g0 < ngroups; g0 += SB * nthreads) {
        uint4 v[SB][2];
#pragma unroll
        for (int b = 0; b < SB; ++b) {
            const int gi = g0 + b * nthreads;
            const int cl = gi / (NT * 16);
            const int ch = cb0 + cl;
            const int rem = gi - cl * (NT * 16);
            const int n = rem >> 4, g = rem & 15;
            const int C = K - ch * CHUNK < CHUNK ? K - ch * CHUNK : CHUNK;
            const int m = C >> 5;  // 32-value pairs per packed lane t (8 in a full chunk)
            const uint4* src = xp + (i64)ch * 32 * tpad;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int u = 2 * g + h;  // natural unit: values 8u..8u+7 of the chunk
                v[b][h].x = v[b][h].y = v[b][h].z = v[b][h].w = 0u;
                if (gi < ngroups && u < 4 * m) {
                    const int t = u / m, p = u - t * m;  // packed unit (p, n, t) holds values t (C / 4) + 8p ..
                    v[b][h] = GV_LDG(src + (p * tpad + n) * 4 + t);
                }
            }
        }
#pragma unroll
        for (int b = 0; b < SB; ++b) {
            const int gi = g0 + b * nthreads;
            if (gi < ngroups) {
                const int cn = gi >> 4, g = gi & 15;  // (staged chunk, token) index and group
                if constexpr (L::INT) {
                    float scale, sum;
                    quant_group(v[b][0], v[b][1], sx[cn * 32 + 2 * g], sx[cn * 32 + 2 * g + 1], scale, sum);
                    sxq[cn * 16 + g] = scale;
                    if constexpr (L::SUMS) sxs[cn * 16 + g] = sum;
                } else {
                    sx[cn * 32 + 2 * g] = v[b][0];
                    sx[cn * 32 + 2 * g + 1] = v[b][1];
                }
            }
        }
    }
}

// Stage x chunks [cb0, cb0 + ncb) as stage_x does, but from xq when given (quantized types: PackedX.q16, the pack
// kernel's copy of exactly what stage_x computes, for nch chunks of NT tokens): a plain copy, 16-byte loads all
// issued before the stores. Caller syncs.
template <int QT, int NT>
GV_DEV void stage(const uint4* __restrict__ xq, const uint4* __restrict__ xp, int tpad, int K, int cb0, int ncb,
                  uint4* sx, float* sxq, float* sxs) {
    using L = Lay<QT>;
    if constexpr (L::INT) {
        if (xq != nullptr) {
            constexpr int SB = 8;
            const int nch = (K + CHUNK - 1) / CHUNK;
            const int nu = ncb * NT * 32, ns = ncb * NT * 4;  // 16-byte units of x, of scales (and of sums)
            const int total = nu + (L::SUMS ? 2 : 1) * ns;
            const uint4* const qu = xq + (i64)cb0 * NT * 32;
            const uint4* const qs = xq + (i64)nch * NT * 32 + (i64)cb0 * NT * 4;
            const uint4* const qm = qs + (i64)nch * NT * 4;
            const int nthreads = (int)blockDim.x;
            for (int i0 = (int)threadIdx.x; i0 < total; i0 += SB * nthreads) {
                uint4 v[SB];
#pragma unroll
                for (int b = 0; b < SB; ++b) {
                    const int i = i0 + b * nthreads;
                    if (i < total) v[b] = GV_LDG(i < nu ? qu + i : i < nu + ns ? qs + (i - nu) : qm + (i - nu - ns));
                }
#pragma unroll
                for (int b = 0; b < SB; ++b) {
                    const int i = i0 + b * nthreads;
                    if (i < nu) sx[i] = v[b];
                    else if (i < nu + ns) ((uint4*)sxq)[i - nu] = v[b];
                    else if (i < total) ((uint4*)sxs)[i - nu - ns] = v[b];
                }
            }
            return;
        }
    }
    stage_x<QT, NT>(xp, tpad, K, cb0, ncb, sx, sxq, sxs);
}

// One full chunk c of a quantized type (the raw words in w): acc[i][n] += row i of the lane . token n.
template <int QT, int NT>
GV_DEV void chunk_int(const Raw<QT>& w, int c, int j, const int (&xu)[4], const uint4* sx, const float* sxq,
                      const float* sxs, float (&acc)[4][NT]) {
    using L = Lay<QT>;
    constexpr int TB = NT < 4 ? NT : 4;  // tokens whose x words are live at once
    Coef cf[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) cf[i] = coef<QT>(w, i, j);
#pragma unroll
    for (int n0 = 0; n0 < NT; n0 += TB) {
        u32 xq[TB][16];
        float xs[TB][2], xsum[TB][2];
#pragma unroll
        for (int nn = 0; nn < TB; ++nn) {
            if (n0 + nn < NT) {
                const int cn = c * NT + n0 + nn;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const uint4 u = sx[cn * 32 + xu[k]];
                    xq[nn][4 * k] = u.x, xq[nn][4 * k + 1] = u.y, xq[nn][4 * k + 2] = u.z, xq[nn][4 * k + 3] = u.w;
                }
                xs[nn][0] = sxq[cn * 16 + (xu[0] >> 1)];
                // Q4_K's high run is 16 q (qbytes): 1 / 16 here, once a token, rather than a shift a quant word
                // (Q3_K's 4 q: 1 / 4). Exact (a power of two), so a1 xs s is bitwise what it was with the nibbles
                // shifted down.
                xs[nn][1] = sxq[cn * 16 + (xu[2] >> 1)] * (QT == 12 ? 0.0625f : QT == 11 ? 0.25f : 1.f);
                if constexpr (L::SUMS) {
                    xsum[nn][0] = sxs[cn * 16 + (xu[0] >> 1)];
                    xsum[nn][1] = sxs[cn * 16 + (xu[2] >> 1)];
                }
            }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            u32 q[8];
            qbytes<QT>(w, i, j, q);
#pragma unroll
            for (int nn = 0; nn < TB; ++nn) {
                if (n0 + nn < NT) {
                    // unsigned quant bytes (the signed: Q8_0, IQ4_XS, IQ4_NL, Q3_K, Q4_0)
                    constexpr bool UB = QT != 8 && QT != 23 && QT != 11 && QT != 2 && QT != 20;
                    const int s0 = dot16<UB>(xq[nn], q), s1 = dot16<UB>(xq[nn] + 8, q + 4);
                    float a = acc[i][n0 + nn];
                    a = fmaf(cf[i].a0 * xs[nn][0], (float)s0, a);
                    a = fmaf(cf[i].a1 * xs[nn][1], (float)s1, a);
                    if constexpr (L::SUMS) {
                        a = fmaf(-cf[i].b0, xsum[nn][0], a);
                        a = fmaf(-cf[i].b1, xsum[nn][1], a);
                    }
                    acc[i][n0 + nn] = a;
                }
            }
        }
    }
}

// Tail chunk c (F16 / Q8_0 / Q4_0 / IQ4_NL with K % 256 = 32m) of the tile at wt, staged as x chunk cx: rows of C =
// 32m values, not swizzled; lane j takes 8-value units j, j + 8, ... of its 4 rows. Q8_0: quants [16][C] then d
// [16][m]; Q4_0 / IQ4_NL: qs [16][C / 2] then d [16][m]; F16: halves [16][C].
template <int QT, int NT>
GV_DEV void tail_chunk(const u8* wt, int c, int cx, int K, int r4, int j, const uint4* sx, const float* sxq,
                       float (&acc)[4][NT]) {
    constexpr int BLK = 16 * (Lay<QT>::MAIN + Lay<QT>::SIDE);
    const int C = K - c * CHUNK;
    const int m = C >> 5;
    const u8* tb = wt + (i64)c * BLK;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = r4 + 4 * i;
        for (int u = j; u < 4 * m; u += 8) {
            if constexpr (QT == 2 || QT == 20) {
                // unit u: nibble (u >> 1) & 1 of qs bytes 8 (u & 1) .. of block u / 4, as signed bytes (qbytes')
                const uint2 raw = GV_LDG((const uint2*)(tb + r * (C >> 1) + 16 * (u >> 2) + 8 * (u & 1)));
                const u32 sh = 4u * (u32)((u >> 1) & 1);
                u32 q0 = (raw.x >> sh) & 0x0F0F0F0Fu, q1 = (raw.y >> sh) & 0x0F0F0F0Fu;
                float d = h2f(ldg_u16(tb + 16 * (C >> 1) + r * 2 * m + 2 * (u >> 2)));
                if constexpr (QT == 2) {
                    q0 = lop3_and_xor(q0 << 4, 0xF0F0F0F0u, 0x80808080u);
                    q1 = lop3_and_xor(q1 << 4, 0xF0F0F0F0u, 0x80808080u);
                    d *= 0.0625f;
                } else {
                    q0 = bits::iq4_lookup(q0);
                    q1 = bits::iq4_lookup(q1);
                }
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    const uint4 xv = sx[(cx * NT + n) * 32 + u];
                    int s = dp2a_lo(xv.x, q0, 0);
                    s = dp2a_hi(xv.y, q0, s);
                    s = dp2a_lo(xv.z, q1, s);
                    s = dp2a_hi(xv.w, q1, s);
                    acc[i][n] = fmaf(d * sxq[(cx * NT + n) * 16 + (u >> 1)], (float)s, acc[i][n]);
                }
            } else if constexpr (QT == 8) {
                const uint2 q = GV_LDG((const uint2*)(tb + r * C + 8 * u));
                const float d = h2f(ldg_u16(tb + 16 * C + r * 2 * m + 2 * (u >> 2)));
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    const uint4 xv = sx[(cx * NT + n) * 32 + u];
                    int s = dp2a_lo(xv.x, q.x, 0);
                    s = dp2a_hi(xv.y, q.x, s);
                    s = dp2a_lo(xv.z, q.y, s);
                    s = dp2a_hi(xv.w, q.y, s);
                    acc[i][n] = fmaf(d * sxq[(cx * NT + n) * 16 + (u >> 1)], (float)s, acc[i][n]);
                }
            } else {
                float wf[8];
                const uint4 h = ldg16(tb + r * 2 * C + 16 * u);
                const u32 hs[4] = {h.x, h.y, h.z, h.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    wf[2 * e] = h2f(hs[e]);
                    wf[2 * e + 1] = h2f(hs[e] >> 16);
                }
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    float xf[8];
                    unit_f(sx[(cx * NT + n) * 32 + u], xf);
                    float s = 0.f;
#pragma unroll
                    for (int e = 0; e < 8; ++e) s = fmaf(xf[e], wf[e], s);
                    acc[i][n] += s;
                }
            }
        }
    }
}

// Lanes j = 0..7 of a row (lane = 4 j + r4) add up their partial sums: every one ends with the row's warp sum.
template <int NT>
GV_DEV void row_butterfly(float (&acc)[4][NT]) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            float v = acc[i][n];
            v += shfl_xor(v, 4);
            v += shfl_xor(v, 8);
            v += shfl_xor(v, 16);
            acc[i][n] = v;
        }
}

// After row_butterfly, lanes j == 0 (lane r4 < 4) of warp w hold rows r4, r4 + 4, .. of the tile: each stores them into
// red[w][16][NT] (rows in order, tokens inner), where the block's warps meet.
template <int NT>
GV_DEV void store_warp_sums(const float (&acc)[4][NT], float* red, int w, int r4) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int n = 0; n < NT; ++n) red[(w * 16 + r4 + 4 * i) * NT + n] = acc[i][n];
}

// A product whose output is the residual stream can stage the next RMSNorm for the product that reads it (a "staged
// norm"): y = rms_norm(s) * w feeds a ring gemv as s * w with the norm's 1 / rms applied to the consumer's sums
// (W (c z) = c (W z), c a scalar per token). A 16-row tile of this product is one 16-value group of the consumer's
// K, so the tile writes that group's int16 staging (xq16.cuh's layout: units, scale, sum) of z = s * w and the sum
// of s^2 over its rows (ssq[n][tile]); the consumer adds the K / 16 partial sums of its token row (stage_inv: the
// same order in every warp of every block: one value) and scales its outputs by 1 / sqrt(mean + eps). No f16
// rounding of the normalised row (the pack's v2 layout needs it; the staging does not).
struct NormStage {
    const float* w;  // out: the next norm's weight [N] (null: no staging)
    uint4* q16;      //      its int16 staging of s * w (PackedX.q16 layout, N / 256 chunks x NT tokens)
    float* ssq;      //      per-tile sums of s^2, [NT][N / 16]
};

// 1 / rms of each token row from a producer's per-tile sums of squares (ssq [NT][K / 16]); every lane of the warp
// ends with the same values (lane l adds tiles l, l + 32, ... in order, then an xor butterfly: a + b == b + a)
// (loads issued STAGE_BATCH at a time per token, all tokens together: one L2 round trip per batch, not per tile;
// a missing tile adds +0.f, which leaves the sum as it is)
constexpr int STAGE_BATCH = 16;  // K up to 8192 in one round trip
template <int NT>
GV_DEV void stage_inv(const float* __restrict__ ssq, int K, float eps, float (&inv)[NT]) {
    const int lane = (int)(threadIdx.x & 31u), tiles = K >> 4;
    float s[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) s[n] = 0.f;
    for (int t0 = lane; t0 < tiles; t0 += 32 * STAGE_BATCH) {
        float v[NT][STAGE_BATCH];
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int b = 0; b < STAGE_BATCH; ++b) {
                const int t = t0 + 32 * b;
                v[n][b] = t < tiles ? ld_partial(ssq + (i64)n * tiles + t) : 0.f;
            }
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int b = 0; b < STAGE_BATCH; ++b) s[n] += v[n][b];
    }
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int m = 16; m >= 1; m >>= 1) s[n] += shfl_xor(s[n], m);
        inv[n] = 1.0f / GV_SQRTF(s[n] / (float)K + eps);
    }
}

// finish_tile for the ring kernel: outputs times 1 / rms of a staged input norm (one warp: its inv registers; more:
// inv_sm, which warp 0 wrote before the block's barrier here; null: no staged input), and with st.w the staged
// norm of the written values (KW > 1: the launcher refuses a stage with one warp). Thread o < 16 NT owns row o & 15
// and token o >> 4 of the tile, so a group's 16 values sit in 16 lanes of one warp and meet in xor shuffles; wv is
// its row's norm weight, loaded when the kernel started (a load here would add a memory round trip to the tail);
// y_held: accumulating, yv is the output value this thread adds to, loaded after the grid wait (16 NT <= threads).
template <int NT>
GV_DEV void finish_ring(float (&acc)[4][NT], float* red, int row0, int N, float* __restrict__ y, i64 ldy,
                        int accumulate, const float (&inv)[NT], const float* inv_sm, const NormStage& st,
                        float wv, float yv, bool y_held) {
    const int lane = (int)(threadIdx.x & 31u), warp = (int)(threadIdx.x >> 5);
    const int KW = (int)(blockDim.x >> 5), nthreads = (int)blockDim.x;
    const int j = lane >> 2, r4 = lane & 3;
    row_butterfly<NT>(acc);
    if (KW == 1) {
        if (j == 0) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = row0 + r4 + 4 * i;
                if (row < N) {
#pragma unroll
                    for (int n = 0; n < NT; ++n) {
                        float* dst = y + (i64)n * ldy + row;
                        const float v = acc[i][n] * inv[n];
                        *dst = accumulate ? *dst + v : v;
                    }
                }
            }
        }
        return;
    }
    if (j == 0) store_warp_sums<NT>(acc, red, warp, r4);
    __syncthreads();
    float fin = 0.f;  // the value thread o < 16 NT wrote
    for (int o = (int)threadIdx.x; o < 16 * NT; o += nthreads) {
        const int r = o & 15, n = o >> 4;
        float v = 0.f;
        for (int w = 0; w < KW; ++w) v += red[(w * 16 + r) * NT + n];  // warp order: deterministic
        if (inv_sm != nullptr) v *= inv_sm[n];
        const int row = row0 + r;
        if (row < N) {
            float* dst = y + (i64)n * ldy + row;
            fin = accumulate ? (y_held ? yv : *dst) + v : v;
            *dst = fin;
        }
    }
    // whole warps from here (they shuffle); a stage needs N a multiple of 256 and 16 NT <= threads (the launcher)
    if (st.w == nullptr || 16 * NT > nthreads || warp * 32 >= 16 * NT) return;
    const int o = (int)threadIdx.x, r = o & 15, n = o >> 4;
    const bool live = o < 16 * NT;
    const float z = live ? fin * wv : 0.f;
    float amax = z < 0.f ? -z : z, sum = z, sq = fin * fin;
#pragma unroll
    for (int m = 1; m < 16; m <<= 1) {
        amax = xq::fmax2(amax, shfl_xor(amax, m));
        sum += shfl_xor(sum, m);
        sq += shfl_xor(sq, m);
    }
    const int q = xq::rint_mul(z, xq::inv_scale(amax));
    const int qp = (int)GV_SHFL_XOR((unsigned)q, 1);
    if (live) {
        const int t = row0 >> 4, ch = t >> 4, g = t & 15, nch = N >> 8;
        if ((r & 1) == 0)
            ((u32*)(st.q16 + ((i64)ch * NT + n) * 32 + 2 * g))[r >> 1] = ((u32)q & 0xFFFFu) | ((u32)qp << 16);
        if (r == 0) {
            float* const scales = xq::q16_scales(st.q16, nch, NT);
            scales[((i64)ch * NT + n) * 16 + g] = xq::scale_of(amax);
            scales[(i64)nch * NT * 16 + ((i64)ch * NT + n) * 16 + g] = sum;
            st.ssq[(i64)n * (N >> 4) + t] = sq;
        }
    }
}

// End of a tile: lanes j = 0..7 of a row add their sums (butterfly: every lane ends with the same, order-fixed
// total), then KW == 1: lanes j == 0 store; else the warps' sums meet in red ([KW][16][NT]) and are added in warp
// order (deterministic). Block-uniform; with KW > 1 it holds one __syncthreads (red must not be rewritten before
// the adds have read it: the per-tile kernel returns after it, the persistent one alternates two buffers).
// (finish_ring without a staged norm on either side.)
template <int NT>
GV_DEV void finish_tile(float (&acc)[4][NT], float* red, int row0, int N, float* __restrict__ y, i64 ldy,
                        int accumulate) {
    float ones[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) ones[t] = 1.f;
    finish_ring<NT>(acc, red, row0, N, y, ldy, accumulate, ones, nullptr, NormStage{nullptr, nullptr, nullptr}, 0.f,
                    0.f, false);
}

// End of a gate|up tile pair (gemv_ring_kernel<QT, NT, 1>): the SwiGLU of its 16 rows staged for the down product
// that reads it. The gate and up sums are added over the warps exactly as finish_ring adds a tile's (warp order, times
// a staged input norm's 1 / rms), i.e. bitwise the values the ring writes to y for rows 16 p.. and F + 16 p..; thread
// o < 16 NT (row o & 15, token o >> 4: a group's 16 values in 16 lanes) then forms pack_silu_kernel's
// fp16(silu(g) u) and writes it into q16 as put_q16 would: group p of the down product's K = F (PackedX.q16's
// layout), the scale from the 16 values' max |h|, the sum of values 0..7 in order plus that of 8..15 (xq16.cuh
// stats8). So the staging is bitwise the pack's, with no launch, no y round trip and no fp16 pack between them.
// Needs KW > 1 and 16 NT <= threads (the launcher).
template <int NT>
GV_DEV void finish_swiglu(float (&gate)[4][NT], float (&up)[4][NT], float* red, int p, int F, const float* inv_sm,
                          uint4* __restrict__ q16) {
    const int lane = (int)(threadIdx.x & 31u), warp = (int)(threadIdx.x >> 5);
    const int KW = (int)(blockDim.x >> 5);
    const int j = lane >> 2, r4 = lane & 3;
    row_butterfly<NT>(gate);
    row_butterfly<NT>(up);
    if (j == 0) {
        store_warp_sums<NT>(gate, red, warp, r4);
        store_warp_sums<NT>(up, red, KW + warp, r4);
    }
    __syncthreads();
    if (warp * 32 >= 16 * NT) return;  // whole warps from here (they shuffle)
    const int o = (int)threadIdx.x, r = o & 15, n = o >> 4;
    const bool live = o < 16 * NT;
    float h = 0.f;
    if (live) {
        float g = 0.f, u = 0.f;
        for (int w = 0; w < KW; ++w) {  // warp order: finish_ring's sums
            g += red[(w * 16 + r) * NT + n];
            u += red[((KW + w) * 16 + r) * NT + n];
        }
        if (inv_sm != nullptr) g *= inv_sm[n], u *= inv_sm[n];
        h = h2f(f2h(silu(g) * u));
    }
    u32 word;
    float scale, sum;
    xq::group16_lanes(h, word, scale, sum);
    if (live) xq::put_group16_lanes(q16, F >> 8, NT, p >> 4, n, p & 15, r, word, scale, sum);
}

// End of a gate|up tile of a cluster pair (gemv_ring_pair_kernel): block `half` 0 ran gate tile p, block 1 up tile p
// (rows F + 16 p..). Each adds its warps' sums as finish_swiglu adds them (warp order, times a staged input norm's
// 1 / rms); block 1 stores its 16 NT values into block 0's shared memory (recv: red's second half, which block 0
// leaves alone) and after the cluster barrier block 0 stages fp16(silu(g) u) as finish_swiglu does: bitwise its
// staging, with gate|up's own block count and shape. Every thread of both blocks reaches both cluster waits (the
// first pairs with the arrival the kernel made when it started: block 0 is running before block 1 writes into it).
// Needs KW > 1 and 16 NT <= threads (the launcher).
template <int NT>
GV_DEV void finish_pair(float (&acc)[4][NT], float* red, int half, int p, int F, const float* inv_sm,
                        uint4* __restrict__ q16) {
#if SS_BULK
    const int lane = (int)(threadIdx.x & 31u), warp = (int)(threadIdx.x >> 5);
    const int KW = (int)(blockDim.x >> 5);
    const int j = lane >> 2, r4 = lane & 3;
    row_butterfly<NT>(acc);
    if (j == 0) store_warp_sums<NT>(acc, red, warp, r4);
    __syncthreads();
    const int o = (int)threadIdx.x, r = o & 15, n = o >> 4;
    const bool live = o < 16 * NT;
    float v = 0.f;
    if (live) {
        for (int w = 0; w < KW; ++w) v += red[(w * 16 + r) * NT + n];  // warp order: finish_ring's sums
        if (inv_sm != nullptr) v *= inv_sm[n];
    }
    float* const recv = red + KW * 16 * NT;
    bk::cluster_wait();  // block 0 has started (the kernel's first arrival)
    if (half == 1 && live) bk::st_cluster_f32(bk::cluster_map(bk::smem_addr(recv + o), 0u), v);
    bk::cluster_arrive();  // release: block 1's stores, seen by block 0 after its wait
    bk::cluster_wait();
    if (half == 1 || warp * 32 >= 16 * NT) return;  // whole warps from here (they shuffle)
    const float h = live ? h2f(f2h(silu(v) * recv[o])) : 0.f;
    u32 word;
    float scale, sum;
    xq::group16_lanes(h, word, scale, sum);
    if (live) xq::put_group16_lanes(q16, F >> 8, NT, p >> 4, n, p & 15, r, word, scale, sum);
#endif
}

// One warp's sums over chunks [c0, c1) of the tile at wt (both kernels without persistence): acc[i][n] = row i of
// the lane . token n over the lane's values. x chunk c is staged as chunk c - cx0; `cur` holds chunk c0's weights
// already requested (before x was staged, so the two latencies overlap) when c0 is a full chunk. Full chunks in
// order, then the tail (F16 / Q8_0, owned by the warp whose range ends past the last full chunk).
template <int QT, int NT>
GV_DEV void warp_chunks(Raw<QT>& cur, const u8* wt, int c0, int c1, int K, int cx0, int r4, int j, const uint4* sx,
                        const float* sxq, const float* sxs, float (&acc)[4][NT]) {
    constexpr int BLK = 16 * (Lay<QT>::MAIN + Lay<QT>::SIDE);  // bytes of one full tile block
    constexpr bool PREFETCH = QT != 1;  // F16: 16 loads per lane and chunk are in flight anyway
    constexpr int TB = NT < 2 ? NT : 2;  // F16: tokens whose x values are live at once
    const int nfull = K / CHUNK;
    const int c1f = c1 < nfull ? c1 : nfull;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int n = 0; n < NT; ++n) acc[i][n] = 0.f;

    int xu[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) xu[k] = xunit<QT>(j, k, r4);

    for (int c = c0; c < c1f; ++c) {
        if constexpr (PREFETCH) {
            Raw<QT> nxt;
            if (c + 1 < c1f) load_raw<QT>(nxt, wt + (i64)(c + 1) * BLK, r4, j);
            chunk_int<QT, NT>(cur, c - cx0, j, xu, sx, sxq, sxs, acc);
            cur = nxt;
        } else {
            if (c != c0) load_raw<QT>(cur, wt + (i64)c * BLK, r4, j);  // chunk c0 was requested before staging
#pragma unroll
            for (int n0 = 0; n0 < NT; n0 += TB) {
                float xf[TB][32];
#pragma unroll
                for (int nn = 0; nn < TB; ++nn) {
                    if (n0 + nn < NT) {
                        const uint4* xr = sx + ((c - cx0) * NT + n0 + nn) * 32;
#pragma unroll
                        for (int k = 0; k < 4; ++k) unit_f(xr[xu[k]], &xf[nn][8 * k]);
                    }
                }
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float wf[32];
                    if constexpr (QT == 1) f16_weights(cur, i, wf);
#pragma unroll
                    for (int nn = 0; nn < TB; ++nn) {
                        if (n0 + nn < NT) {
                            float s0 = 0.f, s1 = 0.f;
#pragma unroll
                            for (int e = 0; e < 16; ++e) {
                                s0 = fmaf(xf[nn][e], wf[e], s0);
                                s1 = fmaf(xf[nn][16 + e], wf[16 + e], s1);
                            }
                            acc[i][n0 + nn] += s0 + s1;
                        }
                    }
                }
            }
        }
    }
    if constexpr (QT == 1 || QT == 8 || QT == 2 || QT == 20) {
        if (c1 > nfull) tail_chunk<QT, NT>(wt, nfull, nfull - cx0, K, r4, j, sx, sxq, acc);
    }
}

}  // namespace gv

// y[T, N] (+)= x @ W^T for NT = T tokens (1..16). W: device_layout() (row_bytes = bytes of one GGUF row), 16-byte
// aligned; xp: pack_x_kernel output with tpad = 8 ceil(T / 8) token slots; y: fp32 [T, N] with row stride ldy >= N
// floats (a column slice of a wider output: the stacked projections write in place); accumulate != 0: y +=.
// Grid: ceil(N / 16) blocks of 32 KW threads (KW <= 8). Dynamic shared memory (smem_bytes in kernels/quant_gemv.py):
// nch * NT * 512 bytes of staged x, nch * NT * 64 of group scales (Q8_0, Q4_K, Q6_K) and as much of group sums
// (Q4_K, Q6_K), and KW * 16 * NT * 4 of partial sums when KW > 1; nch = ceil(K / 256). xq: PackedX.q16 (the staging
// of the quantized types, copied) or null (computed here from xp); every variant below takes it last.
template <int QT, int NT>
__global__ void GV_BOUNDS(256) gemv_kernel(const u8* __restrict__ W, long long row_bytes, int N, int K,
                                           const uint4* __restrict__ xp, int tpad, float* __restrict__ y,
                                           int accumulate, long long ldy, const uint4* __restrict__ xq) {
    using namespace gv;
    using L = Lay<QT>;
    constexpr int BLK = 16 * (L::MAIN + L::SIDE);  // bytes of one full tile block
    extern __shared__ uint4 gv_smem[];

    const int lane = (int)(threadIdx.x & 31u);
    const int warp = (int)(threadIdx.x >> 5);
    const int KW = (int)(blockDim.x >> 5);
    const int j = lane >> 2, r4 = lane & 3;
    const int nch = (K + CHUNK - 1) / CHUNK;
    const int nfull = K / CHUNK;
    const int tile = (int)blockIdx.x;
    const u8* const wt = W + (i64)tile * 16 * row_bytes;  // this tile's blocks: chunk c at wt + c * BLK

    uint4* const sx = gv_smem;                                             // [nch][NT][32] units
    float* const sxq = (float*)(gv_smem + (size_t)nch * NT * 32);          // [nch][NT][16] group scales
    float* const sxs = sxq + (L::INT ? (size_t)nch * NT * 16 : 0);         // [nch][NT][16] group sums
    float* const red = sxs + (L::SUMS ? (size_t)nch * NT * 16 : 0);        // [KW][16][NT]

    const int c0 = (int)(((long long)warp * nch) / KW), c1 = (int)(((long long)(warp + 1) * nch) / KW);
    const int c1f = c1 < nfull ? c1 : nfull;  // full chunks of this warp: [c0, c1f)

    // the first chunk's weights are requested before x is staged, so the two latencies overlap
    Raw<QT> cur;
    if (c0 < c1f) load_raw<QT>(cur, wt + (i64)c0 * BLK, r4, j);
    stage<QT, NT>(xq, xp, tpad, K, 0, nch, sx, sxq, sxs);
    __syncthreads();

    float acc[4][NT];
    warp_chunks<QT, NT>(cur, wt, c0, c1, K, 0, r4, j, sx, sxq, sxs, acc);
    finish_tile<NT>(acc, red, 16 * tile, N, y, ldy, accumulate);
}

// Persistent variant for the quantized types (Q8_0, Q4_K, Q6_K): the same sums, added in the same order, so its
// output is bitwise equal to gemv_kernel's at the same KW. Grid: G <= ceil(N / 16) blocks of 32 KW threads; block b
// stages x once and walks tiles b, b + G, b + 2G, ... Each warp's (tile, chunk) items form one stream whose loads
// run PD items (1 or 2) ahead of its arithmetic, across tile ends: the next tile's first chunks are in flight while
// the block adds the last tile's partial sums. The PD + 1 register buffers take turns by a switch on the item's
// phase (fixed names: no register copy waits on a load still in flight). Shared memory as gemv_kernel plus a
// second buffer of partial sums when KW > 1 (2 KW * 16 * NT * 4 bytes), so one __syncthreads per tile suffices.
template <int QT, int NT, int PD>
__global__ void GV_BOUNDS(256) gemv_persist_kernel(const u8* __restrict__ W, long long row_bytes, int N, int K,
                                                   const uint4* __restrict__ xp, int tpad, float* __restrict__ y,
                                                   int accumulate, long long ldy, const uint4* __restrict__ xq) {
    using namespace gv;
    using L = Lay<QT>;
    static_assert(L::INT, "F16 keeps the per-tile kernel");
    static_assert(PD == 1 || PD == 2, "prefetch depth 1 or 2");
    constexpr int BLK = 16 * (L::MAIN + L::SIDE);
    extern __shared__ uint4 gv_smem[];

    const int lane = (int)(threadIdx.x & 31u);
    const int warp = (int)(threadIdx.x >> 5);
    const int KW = (int)(blockDim.x >> 5);
    const int j = lane >> 2, r4 = lane & 3;
    const int nch = (K + CHUNK - 1) / CHUNK;
    const int nfull = K / CHUNK;
    const int ntiles = (N + 15) / 16;
    const int G = (int)gridDim.x, b = (int)blockIdx.x;
    const int my_tiles = b < ntiles ? (ntiles - 1 - b) / G + 1 : 0;
    const i64 tile_bytes = 16 * (i64)row_bytes;

    uint4* const sx = gv_smem;
    float* const sxq = (float*)(gv_smem + (size_t)nch * NT * 32);
    float* const sxs = sxq + (size_t)nch * NT * 16;
    float* const red = sxs + (L::SUMS ? (size_t)nch * NT * 16 : 0);  // [2][KW][16][NT]

    const int c0 = (int)(((long long)warp * nch) / KW), c1 = (int)(((long long)(warp + 1) * nch) / KW);
    const int c1f = c1 < nfull ? c1 : nfull;
    const int items = c1f > c0 ? my_tiles * (c1f - c0) : 0;

    // the next item to request: local tile lt, chunk lc (requests go out in item order)
    int lt = 0, lc = c0;
    auto request = [&](Raw<QT>& r) {
        load_raw<QT>(r, W + (i64)(b + lt * G) * tile_bytes + (i64)lc * BLK, r4, j);
        if (++lc == c1f) lc = c0, ++lt;
    };
    Raw<QT> b0, b1, b2;
    if (items > 0) request(b0);  // the first items before x is staged: the latencies overlap
    if (items > 1) request(b1);
    if (PD == 2 && items > 2) request(b2);
    stage<QT, NT>(xq, xp, tpad, K, 0, nch, sx, sxq, sxs);
    __syncthreads();

    int xu[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) xu[k] = xunit<QT>(j, k, r4);

    int k = 0, phase = 0;  // item index and its buffer (k mod PD + 1)
    for (int ti = 0; ti < my_tiles; ++ti) {
        const int tile = b + ti * G;
        float acc[4][NT];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int n = 0; n < NT; ++n) acc[i][n] = 0.f;
        for (int c = c0; c < c1f; ++c, ++k) {
            const bool more = k + PD + 1 < items;  // the buffer, once used, takes item k + PD + 1
            if (phase == 0) {
                chunk_int<QT, NT>(b0, c, j, xu, sx, sxq, sxs, acc);
                if (more) request(b0);
            } else if (PD == 1 || phase == 1) {
                chunk_int<QT, NT>(b1, c, j, xu, sx, sxq, sxs, acc);
                if (more) request(b1);
            } else {
                chunk_int<QT, NT>(b2, c, j, xu, sx, sxq, sxs, acc);
                if (more) request(b2);
            }
            phase = phase == PD ? 0 : phase + 1;
        }
        if constexpr (QT == 8 || QT == 2 || QT == 20) {
            if (c1 > nfull) tail_chunk<QT, NT>(W + (i64)tile * tile_bytes, nfull, nfull, K, r4, j, sx, sxq, acc);
        }
        finish_tile<NT>(acc, red + (ti & 1) * KW * 16 * NT, 16 * tile, N, y, ldy, accumulate);
    }
}

// Split-K variant (all types), for matrices with too few 16-row tiles to fill the GPU at one block per tile
// (5120 rows = 320 tiles on 132 SMs: 2-3 blocks of 4 warps per SM; a warp is bound by its own latency, so the time
// is set by warps in flight). Each tile's K range is split over S = `splits` blocks of KW warps: block b handles
// tile b / S, split s = b % S (a tile's blocks are adjacent, so they run and finish together). Global warp g = s KW +
// warp owns chunks [g nch / (S KW), (g + 1) nch / (S KW)): exactly warp g of gemv_kernel with S KW warps, and the
// block stages only its own chunks of x (shared memory and staging work / S).
// Deterministic reduction without atomics on values: every warp writes its 16 x NT sums (after the lane butterfly)
// to part[tile][g][16][NT] (fp32, scratch of ceil(N / 16) S KW 16 NT floats); the block then counts itself in on
// counters[tile] (a __threadfence by every writer first); the block that arrives last adds the S KW partial sums of
// the tile in g order (the order gemv_kernel adds its warps in: the output is bitwise gemv_kernel's with S KW warps,
// whichever block arrives last) and sets the counter back to 0, so the next launch (or graph replay) on the stream
// finds it zeroed with no memset. counters: ceil(N / 16) u32, zero before the first launch (the launcher does that
// once per scratch buffer). Launches that share a scratch buffer must not run concurrently (one stream).
// Shared memory: 16 bytes (the last-block flag), then staged x, scales and sums for ceil(nch / S) chunks.
template <int QT, int NT>
__global__ void GV_BOUNDS(256) gemv_splitk_kernel(const u8* __restrict__ W, long long row_bytes, int N, int K,
                                                  const uint4* __restrict__ xp, int tpad, float* __restrict__ y,
                                                  int accumulate, long long ldy, int splits, float* part,
                                                  unsigned int* counters, const uint4* __restrict__ xq) {
    using namespace gv;
    using L = Lay<QT>;
    constexpr int BLK = 16 * (L::MAIN + L::SIDE);
    extern __shared__ uint4 gv_smem[];

    const int lane = (int)(threadIdx.x & 31u);
    const int warp = (int)(threadIdx.x >> 5);
    const int KW = (int)(blockDim.x >> 5), nthreads = (int)blockDim.x;
    const int j = lane >> 2, r4 = lane & 3;
    const int nch = (K + CHUNK - 1) / CHUNK;
    const int nfull = K / CHUNK;
    const int S = splits;
    const int tile = (int)blockIdx.x / S, s = (int)blockIdx.x - tile * S;
    const int GW = S * KW;  // warps over the tile's K
    const int g = s * KW + warp;
    const u8* const wt = W + (i64)tile * 16 * row_bytes;

    const int cb0 = (int)(((long long)s * KW * nch) / GW), cb1 = (int)(((long long)(s + 1) * KW * nch) / GW);
    const int ncb = cb1 - cb0;  // this block's chunks, staged as 0 .. ncb - 1
    int* const last = (int*)gv_smem;
    uint4* const sx = gv_smem + 1;
    float* const sxq = (float*)(sx + (size_t)ncb * NT * 32);
    float* const sxs = sxq + (L::INT ? (size_t)ncb * NT * 16 : 0);

    const int c0 = (int)(((long long)g * nch) / GW), c1 = (int)(((long long)(g + 1) * nch) / GW);
    const int c1f = c1 < nfull ? c1 : nfull;

    Raw<QT> cur;
    if (c0 < c1f) load_raw<QT>(cur, wt + (i64)c0 * BLK, r4, j);
    stage<QT, NT>(xq, xp, tpad, K, cb0, ncb, sx, sxq, sxs);
    __syncthreads();

    float acc[4][NT];
    warp_chunks<QT, NT>(cur, wt, c0, c1, K, cb0, r4, j, sx, sxq, sxs, acc);

    // lanes j = 0..7 of a row add up (finish_tile's butterfly), lanes j == 0 publish the warp's sums
    row_butterfly<NT>(acc);
    float* const tp = part + (i64)tile * GW * 16 * NT;
    if (j == 0) {
        store_warp_sums<NT>(acc, tp, g, r4);
        __threadfence();  // the sums are visible device-wide before the block's arrival is counted
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int ticket = atomicAdd(counters + tile, 1u);
        __threadfence();  // (last block) the others' sums are read after their arrivals were seen
        *last = ticket == (unsigned int)(S - 1);
    }
    __syncthreads();
    if (!*last) return;
    for (int o = (int)threadIdx.x; o < 16 * NT; o += nthreads) {
        const int r = o & 15, n = o >> 4;
        float v = 0.f;
        for (int w = 0; w < GW; ++w) v += ld_partial(tp + (w * 16 + r) * NT + n);  // g order: deterministic
        const int row = 16 * tile + r;
        if (row < N) {
            float* dst = y + (i64)n * ldy + row;
            *dst = accumulate ? *dst + v : v;
        }
    }
    if (threadIdx.x == 0) counters[tile] = 0u;  // every block of the tile has counted: ready for the next launch
}

// Ring variant for the quantized types (Q8_0, Q4_K, Q6_K) with x from PackedX.q16 and K a multiple of 256: the
// per-tile kernel's sums, without its register prefetch and without staging all of x per block. Grid and warps as
// gemv_kernel (one block per tile, warp w owns chunks [w nch / KW, (w + 1) nch / KW)). Each warp streams its chunks
// through its own ring of `stages` shared-memory slots; a slot holds the tile's chunk block (BLK bytes, contiguous
// in the device layout) and the chunk's x as the pack staged it (NT tokens' int16 units, scales, sums: contiguous
// runs of xq). sm_90: lane 0 fills a slot with one bulk copy per run, completing on the slot's mbarrier, `stages`
// chunks ahead of the arithmetic, so a warp keeps stages x SLOT bytes in flight without holding them in registers
// (gemv_kernel's warps are bound by their own latency chain with one chunk in flight: docs/gpu_quant_matmul.md).
// Elsewhere (HIP, sm_80, portable, CPU simulation) the warp's lanes copy the slot themselves. The arithmetic is
// chunk_int in the same chunk order as gemv_kernel's at the same KW: bitwise equal output.
// Dynamic shared memory (ring_smem_bytes in kernels/quant_gemv.py): KW stages SLOT bytes of slots, KW 16 NT 4 of
// partial sums when KW > 1, KW stages 8 of mbarriers, 16 of a staged input norm's 1 / rms (NT <= 4 floats).
// Staged norms (NormStage above): in_ssq non-null: xq is a staged norm (s * w) whose per-tile sums of squares are
// in_ssq, and every output is scaled by its token's 1 / sqrt(mean(s^2) + eps); stage_w non-null: this product's
// output (after accumulate: the residual stream) is staged for the next norm (weight stage_w) into stage_q16 and
// stage_ssq. Both are read / written only after the grid dependency wait.
// SWIGLU = 1: W is a stacked [gate | up] matrix of 2 N rows (N a multiple of 256) and block p runs gate tile p and
// then up tile p (rows N + 16 p..) through the same warps and ring (each warp the same chunks of both), keeping the
// gate sums in registers; instead of writing y it stages fp16(silu(gate) up) for the down product into stage_q16
// (finish_swiglu: bitwise gate|up's ring, then pack_silu_kernel's staging). Grid N / 16; y, accumulate and the
// outgoing norm unused; a staged input norm (in_ssq) as above. Shared memory: red holds both tiles' sums.
// SWIGLU = 2 (gemv_ring_pair_kernel, clusters of two blocks): W as with 1, grid 2 N / 16; block 2 p runs gate tile p
// and block 2 p + 1 up tile p, each as the plain ring runs a tile (gate|up's own shape: the sums are bitwise its), and
// the pair meets in finish_pair, which stages what finish_swiglu stages.
template <int QT, int NT, int SWIGLU>
static __device__ __forceinline__ void gemv_ring_body(const u8* __restrict__ W, long long row_bytes, int N, int K,
                                                      float* __restrict__ y, int accumulate, long long ldy,
                                                      const uint4* __restrict__ xq, int stages,
                                                      const float* __restrict__ in_ssq, float eps,
                                                      const float* __restrict__ stage_w, uint4* __restrict__ stage_q16,
                                                      float* __restrict__ stage_ssq) {
    using namespace gv;
    using namespace bk;
    using L = Lay<QT>;
    static_assert(L::INT, "F16 keeps the per-tile kernel");
    constexpr int BLK = 16 * (L::MAIN + L::SIDE);  // bytes of one full tile block
    constexpr int XU = NT * 512, XS = NT * 64;     // bytes of a chunk's x units, of its scales (and of its sums)
    constexpr int SLOT = BLK + XU + XS * (L::SUMS ? 2 : 1);
    extern __shared__ uint4 gv_smem[];

    const int lane = (int)(threadIdx.x & 31u);
    // the warp index through a shuffle: the compiler then knows it is the same in every lane, so the chunk and slot
    // addresses derived from it live in uniform registers, which the bulk copies take (with a per-lane value ptxas
    // wraps each copy in a loop that moves it to uniform registers lane by lane: ~7 instructions a copy)
    const int warp = __shfl_sync(0xFFFFFFFFu, (int)(threadIdx.x >> 5), 0);
    const int KW = (int)(blockDim.x >> 5);
    const int j = lane >> 2, r4 = lane & 3;
    const int nch = K / CHUNK;
    // SWIGLU: the tile pair (gate rows 16 tile.., up rows N + 16 tile..); 2: half 1 (the cluster's block 1) runs the up
    // tile
    const int half = SWIGLU == 2 ? (int)(blockIdx.x & 1u) : 0;
    const int tile = SWIGLU == 2 ? (int)(blockIdx.x >> 1) : (int)blockIdx.x;
    const int c0 = (int)(((long long)warp * nch) / KW), c1 = (int)(((long long)(warp + 1) * nch) / KW);
    const int n = c1 - c0;                      // this warp's chunks of a tile
    const int items = SWIGLU == 1 ? 2 * n : n;  // SWIGLU 1: the gate tile's, then the up tile's
#if SS_BULK
    if constexpr (SWIGLU == 2) bk::cluster_arrive_relaxed();  // "started" (finish_pair waits for it)
#endif

    u8* const ring = (u8*)gv_smem + (size_t)warp * stages * SLOT;
    float* const red = (float*)((u8*)gv_smem + (size_t)KW * stages * SLOT);  // [1 + (SWIGLU != 0)][KW][16][NT]
    unsigned long long* const bars =
        (unsigned long long*)(red + (KW > 1 ? (1 + (SWIGLU != 0)) * KW * 16 * NT : 0)) + (size_t)warp * stages;
    // chunk c0 + i's runs: weights, x units, scales, sums (each a contiguous, 16-byte aligned run)
    const u8* const wsrc = W + ((i64)tile * 16 + (half ? N : 0)) * row_bytes + (i64)c0 * BLK;
    const u8* const wsrc_up = SWIGLU == 1 ? wsrc + (i64)N * row_bytes : nullptr;
    const uint4* const usrc = xq + (i64)c0 * NT * 32;
    const uint4* const ssrc = xq + (i64)nch * NT * 32 + (i64)c0 * NT * 4;
    const uint4* const msrc = ssrc + (i64)nch * NT * 4;

#if SS_BULK
    const u32 ring_s = smem_addr(ring), bars_s = smem_addr(bars);
    if (n > 0) {
        if (lane == 0) {
            for (int i = 0; i < stages; ++i) mbar_init(bars + i, 1u);
            mbar_fence_init();
        }
        __syncwarp();
    }
    u32 phases = 0u;  // bit s: parity of slot s's next phase
#endif
    // chunk c0 + i into slot: its weights (W_PART), its x (X_PART) or both. The slot's mbarrier expects all of its
    // bytes when the weights are issued, so the x copies may follow later (after the grid dependency wait).
    constexpr int W_PART = 1, X_PART = 2;
    auto issue = [&](int item, int slot, int parts) {
        const bool up = SWIGLU == 1 && item >= n;  // (the up tile's chunks read the same x chunks again)
        const int i = up ? item - n : item;
        const u8* const wsrc_i = up ? wsrc_up : wsrc;
        u8* const dst = ring + (size_t)slot * SLOT;
#if SS_BULK
        (void)dst;
        if (lane == 0) {
            const u32 d = ring_s + (u32)(slot * SLOT), bar = bars_s + 8u * (u32)slot;
            if (parts & W_PART) {
                mbar_expect_tx_s(bar, (u32)SLOT);
                bulk_g2s_once_s(d, wsrc_i + (i64)i * BLK, (u32)BLK, bar);
            }
            if (parts & X_PART) {
                bulk_g2s_s(d + BLK, usrc + (i64)i * NT * 32, (u32)XU, bar);
                bulk_g2s_s(d + BLK + XU, ssrc + (i64)i * NT * 4, (u32)XS, bar);
                if constexpr (L::SUMS) bulk_g2s_s(d + BLK + XU + XS, msrc + (i64)i * NT * 4, (u32)XS, bar);
            }
        }
#else
        uint4* const d = (uint4*)dst;
        if (parts & W_PART) {
            const uint4* const w = (const uint4*)(wsrc_i + (i64)i * BLK);
            for (int u = lane; u < BLK / 16; u += 32) d[u] = GV_LDG(w + u);
        }
        if (parts & X_PART) {
            for (int u = lane; u < XU / 16; u += 32) d[BLK / 16 + u] = GV_LDG(usrc + (i64)i * NT * 32 + u);
            for (int u = lane; u < XS / 16; u += 32) {
                d[(BLK + XU) / 16 + u] = GV_LDG(ssrc + (i64)i * NT * 4 + u);
                if constexpr (L::SUMS) d[(BLK + XU + XS) / 16 + u] = GV_LDG(msrc + (i64)i * NT * 4 + u);
            }
        }
#endif
    };
    // The first slots' weights go out before the grid dependency wait: under programmatic dependent launch they
    // stream while the kernel before this one (the pack of x) still runs. x and y come from earlier kernels.
    const int pre = items < stages ? items : stages;
    for (int i = 0; i < pre; ++i) issue(i, i, W_PART);
    // a staged norm's weight for this thread's row (a launch-long constant, so before the wait too)
    const float wv = stage_w != nullptr && (int)threadIdx.x < 16 * NT && 16 * tile + ((int)threadIdx.x & 15) < N
                         ? stage_w[16 * tile + ((int)threadIdx.x & 15)]
                         : 0.f;
    SS_GRID_LAUNCH_DEPENDENTS();
    SS_GRID_WAIT();
    for (int i = 0; i < pre; ++i) issue(i, i, X_PART);
    // accumulating: the value finish_ring adds to, requested now (y comes from an earlier kernel and nothing else
    // writes it before this block's own store), so the tail holds no memory round trip
    float yv = 0.f;
    if (accumulate && KW > 1 && (int)threadIdx.x < 16 * NT && 16 * NT <= (int)blockDim.x &&
        16 * tile + ((int)threadIdx.x & 15) < N)
        yv = y[(i64)((int)threadIdx.x >> 4) * ldy + 16 * tile + ((int)threadIdx.x & 15)];
    // x is a staged norm: its 1 / rms per token from the partial sums the kernel before wrote, added up by warp 0
    // alone (every warp of every block doing it cost the LM head's 15520 blocks ~30x its L2 reads), shared through
    // inv_sm after the weights
    float inv[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) inv[t] = 1.f;
    float* const inv_sm = in_ssq != nullptr ? (float*)(bars - (size_t)warp * stages + (size_t)KW * stages) : nullptr;
    if (in_ssq != nullptr && warp == 0) {
        stage_inv<NT>(in_ssq, K, eps, inv);
        if (lane == 0) {
#pragma unroll
            for (int t = 0; t < NT; ++t) inv_sm[t] = inv[t];
        }
    }

    int xu[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) xu[k] = xunit<QT>(j, k, r4);
    float acc[4][NT], gate[4][NT];  // SWIGLU: gate holds the gate tile's sums while acc takes the up tile's
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[i][t] = gate[i][t] = 0.f;

    int slot = 0;
    for (int i = 0; i < items; ++i) {
#if SS_BULK
        mbar_wait_s(bars_s + 8u * (u32)slot, (phases >> slot) & 1u);
        phases ^= 1u << slot;
#else
        __syncwarp();  // the lanes' copies of the slot are done
#endif
        const u8* const sb = ring + (size_t)slot * SLOT;
        Raw<QT> w;
        load_raw<QT, true>(w, sb, r4, j);
        chunk_int<QT, NT>(w, 0, j, xu, (const uint4*)(sb + BLK), (const float*)(sb + BLK + XU),
                          (const float*)(sb + BLK + XU + XS), acc);
        __syncwarp();  // every lane has read the slot (its values are used above) before it is refilled
        if (i + stages < items) issue(i + stages, slot, W_PART | X_PART);
        slot = slot + 1 == stages ? 0 : slot + 1;
        if (SWIGLU == 1 && i == n - 1) {
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int t = 0; t < NT; ++t) gate[r][t] = acc[r][t], acc[r][t] = 0.f;
        }
    }
    if constexpr (SWIGLU == 1)
        finish_swiglu<NT>(gate, acc, red, tile, N, inv_sm, stage_q16);
    else if constexpr (SWIGLU == 2)
        finish_pair<NT>(acc, red, half, tile, N, inv_sm, stage_q16);
    else
        finish_ring<NT>(acc, red, 16 * tile, N, y, ldy, accumulate, inv, inv_sm,
                        NormStage{stage_w, stage_q16, stage_ssq}, wv, yv, 16 * NT <= (int)blockDim.x);
}

template <int QT, int NT, int SWIGLU>
__global__ void GV_BOUNDS(256) gemv_ring_kernel(const u8* __restrict__ W, long long row_bytes, int N, int K,
                                                float* __restrict__ y, int accumulate, long long ldy,
                                                const uint4* __restrict__ xq, int stages,
                                                const float* __restrict__ in_ssq, float eps,
                                                const float* __restrict__ stage_w, uint4* __restrict__ stage_q16,
                                                float* __restrict__ stage_ssq) {
    static_assert(SWIGLU == 0 || SWIGLU == 1, "SWIGLU = 2 is gemv_ring_pair_kernel");
    gemv_ring_body<QT, NT, SWIGLU>(W, row_bytes, N, K, y, accumulate, ldy, xq, stages, in_ssq, eps, stage_w,
                                   stage_q16, stage_ssq);
}

#if SS_BULK
// The SwiGLU staging of a stacked [gate | up] matrix by gate|up's own ring launch shape, a tile pair per cluster of two
// blocks (gemv_ring_body with SWIGLU = 2; quant_gemv.gemv_swiglu(pair=True)). sm_90 only: HIP, the portable path and
// the CPU simulation have no clusters (gemv_ring_kernel<QT, NT, 1> stages the same bits there).
template <int QT, int NT>
__global__ void __cluster_dims__(2, 1, 1) GV_BOUNDS(256)
    gemv_ring_pair_kernel(const u8* __restrict__ W, long long row_bytes, int N, int K, const uint4* __restrict__ xq,
                          int stages, const float* __restrict__ in_ssq, float eps, uint4* __restrict__ stage_q16) {
    gemv_ring_body<QT, NT, 2>(W, row_bytes, N, K, nullptr, 0, 0, xq, stages, in_ssq, eps, nullptr, stage_q16,
                              nullptr);
}
#endif
