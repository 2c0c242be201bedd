// Grouped-query attention of T new tokens (a verify tree, T <= 64) over a KV cache: split-K ("flash
// decoding") with online softmax, fp16 tensor-core products, fp32 accumulation.
// NumPy twin: services/engine/layers.py masked_attention (the KV cache of models/base.py _kv_attention).
//
// KV cache layout (per layer, K and V each of its own kind): head-major [Hkv][ctx][D] rows, each row D f16
// values (kind 0), D/32 GGUF Q8_0 blocks {f16 d; i8 q[32]} of 34 bytes (kind 1) or D/32 TQ3_0 blocks of 14
// bytes (kind 2, services/engine/quants/tq3.py: rotated domain, 3-bit centroid codes, per-group norm).
// ctx is a multiple of KT, so a tile of KT rows of one head is one contiguous run of bytes, 16-byte aligned.
// TQ3_0 K: the kernel rotates each query row once (<Rq, Rk> = <q, k>); TQ3_0 V: the output is a sum of
// rotated rows and attn_combine_kernel inverse-rotates it once (twin: services/engine/kvcache.py attend).
// Rows 0..S-1 are the committed context, rows S..S+T-1 the T new tokens (kv_store_kernel writes them).
// S is read from a device int (s_len[0]) and the tree's ancestor mask from a device array (mask[t] bit u:
// new token u is visible to new token t), so a captured CUDA graph replays with new lengths and trees. window > 0
// (a sliding layer past its window, the DFlash drafter's) hides committed key j from new token t unless
// j >= S - (window - 1) + t, and the splits then cover only the tiles from the first key a token sees.
//
// attn_partial_kernel: grid (ceil(MT / MTB), Hkv, splits), MT = ceil(G*T / 16) m16 tiles of query rows
// (row r = t*G + g reads q head kvh*G + g), block = 4 warps sharing each K/V tile in shared memory, so a
// KV byte is read from memory once per block (once in all when MT <= 4, i.e. G*T <= 64). KW = 4 / MTB
// warps work on each m16 tile: DS = 0, each on its own KT/KW keys of every tile with its own softmax state,
// merged inside the block at the end; DS = 1, each on every key of the tile (the same scores and softmax state
// in each: Q K^T is cheap) for its own D/KW output dims, so a warp holds a KW-th of O's accumulators (registers
// for more blocks a SM) and no merge is left. Decode (MT = 1) thus spreads a tile over 4 warps instead of leaving
// one warp to do all the work. Split z walks its range of KT-key tiles:
//  * cp.async (16 bytes, zero-filled past the last valid key) streams tile i+1 while tile i is computed;
//    f16 rows are stored with their 16-byte chunks XOR-swizzled by (key & 7) (conflict-free fragment
//    loads); Q8_0 and TQ3_0 tiles are dequantized in shared memory first: K to the same layout, V transposed.
//  * S = Q K^T (mma m16n8k16, Q pre-scaled by log2(e)/sqrt(D) and held in fp16), mask, online softmax in
//    the exp2 domain, P (fp16, straight from the S accumulators) x V into fp32 O accumulators.
// The split's (m, l, O) go to a workspace; attn_combine_kernel merges the splits, normalises, optionally
// multiplies by sigmoid(gate) (Qwen3.5's output gate) and writes o [T, H, D].
// Includes no header. Inline PTX (mma.sync, cp.async, cvt) only behind SS_PTX with portable fallbacks
// (software fp16, warp-shuffle mma emulation, synchronous copies) for HIP and the CPU simulation.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef signed char i8;
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

#define SS_DEV static __device__ __forceinline__
#define SS_SOFT static __device__ __noinline__
#include "xq16.cuh"
#include "bits.cuh"
#include "pdl.cuh"

#if SS_HIP
#define SS_SHFL(v, src) __shfl((v), (src), 32)
#define SS_SHFL_XOR(v, m) __shfl_xor((v), (m), 32)
#else
#define SS_SHFL(v, src) __shfl_sync(0xffffffffu, (v), (src))
#define SS_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#endif
#include "head_norm.cuh"

namespace ssa {

constexpr int KT = 32;     // keys per tile
constexpr int MAXW = 4;    // warps per block
constexpr int TQ3_LUT_WORDS = 512;  // TQ3_0 pair tables (tq3_lut_fill; attention.TQ3_LUT_BYTES)
constexpr int QPAD = 8;    // halves of padding per Q row in shared memory
constexpr int MAX_SPLITS = 1024;  // attn_combine_kernel's shared weights
constexpr int DEC_WARPS = 4;      // attn_decode_kernel's warps a block (warp roles: q, k, v, gate)
constexpr int DEC_KPW = KT / DEC_WARPS;  // its keys of a tile a warp
constexpr int DEC_MIN_TILES = 2;         // its committed tiles a split at least (the others' blocks exit)

SS_DEV float bits_f(u32 u) { return __uint_as_float(u); }
SS_DEV u32 f_bits(float f) { return __float_as_uint(f); }
SS_DEV float neg_inf() { return bits_f(0xFF800000u); }

#if !SS_PTX
SS_SOFT float h2f_soft(u32 h) {
    const u32 sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0) {
        const float v = (float)m * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (e == 31) return bits_f(sign | 0x7F800000u | (m << 13));
    return bits_f(sign | ((e + 112u) << 23) | (m << 13));
}

SS_SOFT u32 f2h_soft(float f) {
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
}
#endif

SS_DEV float h2f(u32 h) {
#if SS_PTX
    float f;
    const u16 hs = (u16)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(hs));
    return f;
#else
    return h2f_soft(h & 0xFFFFu);
#endif
}

SS_DEV u32 f2h(float f) {
#if SS_PTX
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return (u32)h;
#else
    return f2h_soft(f);
#endif
}

SS_DEV u32 pack_f2(float lo, float hi) {  // half2(lo, hi), lo in bits 0-15
#if SS_PTX
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return f2h_soft(lo) | (f2h_soft(hi) << 16);
#endif
}

template <int TY>
SS_DEV float ld(const void* p, i64 i) {
    if constexpr (TY == 0) return ((const float*)p)[i];
    if constexpr (TY == 1) return h2f(((const u16*)p)[i]);
    if constexpr (TY == 2) return bits_f((u32)((const u16*)p)[i] << 16);
    return 0.0f;
}

// Eight consecutive values from element i (a multiple of 8) of a 16-byte aligned array, as f32 (zeros when !ok).
template <int TY>
SS_DEV void ld8(const void* p, i64 i, bool ok, float (&x)[8]) {
    uint4 w[2] = {uint4{0u, 0u, 0u, 0u}, uint4{0u, 0u, 0u, 0u}};
    if (ok) {
        if constexpr (TY == 0) {
            w[0] = ((const uint4*)p)[i / 4];
            w[1] = ((const uint4*)p)[i / 4 + 1];
        } else {
            w[0] = ((const uint4*)p)[i / 8];
        }
    }
    const u32 u[8] = {w[0].x, w[0].y, w[0].z, w[0].w, w[1].x, w[1].y, w[1].z, w[1].w};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        if constexpr (TY == 0) x[j] = bits_f(u[j]);
        if constexpr (TY == 1) x[j] = h2f((u[j / 2] >> (16 * (j & 1))) & 0xFFFFu);
        if constexpr (TY == 2) x[j] = bits_f(((u[j / 2] >> (16 * (j & 1))) & 0xFFFFu) << 16);
    }
}

SS_DEV u32 f2bf(float f) {
    const u32 x = f_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
    return (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
}

template <int TY>
SS_DEV void st(void* p, i64 i, float v) {
    if constexpr (TY == 0) ((float*)p)[i] = v;
    if constexpr (TY == 1) ((u16*)p)[i] = (u16)f2h(v);
    if constexpr (TY == 2) ((u16*)p)[i] = (u16)f2bf(v);
}

// ---------------------------------------------------------------------------------------------
// mma.m16n8k16 (fp16 in, fp32 accumulate). Fragment layout (PTX ISA), g = lane / 4, t = lane % 4:
//   a0: A[g][2t..2t+1]  a1: A[g+8][2t..2t+1]  a2: A[g][2t+8..2t+9]  a3: A[g+8][2t+8..2t+9]
//   b0: B[2t..2t+1][g]  b1: B[2t+8..2t+9][g]   c: D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]

#if !SS_PTX
SS_SOFT float hdot2_soft(u32 a, u32 b) {
    return h2f_soft(a & 0xFFFFu) * h2f_soft(b & 0xFFFFu) + h2f_soft(a >> 16) * h2f_soft(b >> 16);
}
struct F4 {
    float v[4];
};
SS_SOFT F4 mma16816_soft(F4 c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    const int lane = (int)(threadIdx.x & 31u);
    const int g = lane >> 2, t = lane & 3;
    for (int j = 0; j < 4; ++j) {
        const u32 ag_lo = SS_SHFL(a0, 4 * g + j), ag_hi = SS_SHFL(a2, 4 * g + j);
        const u32 ah_lo = SS_SHFL(a1, 4 * g + j), ah_hi = SS_SHFL(a3, 4 * g + j);
        const u32 bA_lo = SS_SHFL(b0, 8 * t + j), bA_hi = SS_SHFL(b1, 8 * t + j);
        const u32 bB_lo = SS_SHFL(b0, 8 * t + 4 + j), bB_hi = SS_SHFL(b1, 8 * t + 4 + j);
        c.v[0] += hdot2_soft(ag_lo, bA_lo) + hdot2_soft(ag_hi, bA_hi);
        c.v[1] += hdot2_soft(ag_lo, bB_lo) + hdot2_soft(ag_hi, bB_hi);
        c.v[2] += hdot2_soft(ah_lo, bA_lo) + hdot2_soft(ah_hi, bA_hi);
        c.v[3] += hdot2_soft(ah_lo, bB_lo) + hdot2_soft(ah_hi, bB_hi);
    }
    return c;
}
#endif

SS_DEV void mma16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if SS_PTX
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    F4 in;
    for (int i = 0; i < 4; ++i) in.v[i] = c[i];
    const F4 r = mma16816_soft(in, a0, a1, a2, a3, b0, b1);
    for (int i = 0; i < 4; ++i) c[i] = r.v[i];
#endif
}

// The 32-bit shared-memory address of a pointer into shared memory (PTX path; 0 elsewhere). An opaque conversion
// that the compiler may hoist but not fold back into 64-bit generic arithmetic: ldsm4's addresses stay 32-bit
// additions to it.
SS_DEV u32 smem_s(const void* p) {
#if SS_PTX
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n" : "=r"(a) : "l"(p));
    return a;
#else
    (void)p;
    return 0u;
#endif
}

// 16-byte global -> shared copy into smem_dst (dst_s: its 32-bit shared address, smem_s; the PTX path's); valid ==
// false writes zeros and reads nothing.
SS_DEV void cp16(void* smem_dst, u32 dst_s, const void* gmem_src, bool valid) {
#if SS_PTX
    (void)smem_dst;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_s), "l"(gmem_src), "r"(valid ? 16 : 0)
                 : "memory");
#else
    (void)dst_s;
    if (valid)
        *(uint4*)smem_dst = *(const uint4*)gmem_src;
    else
        *(uint4*)smem_dst = uint4{0u, 0u, 0u, 0u};
#endif
}

SS_DEV void cp_commit() {
#if SS_PTX
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

SS_DEV void cp_wait_prev() {  // all but the most recent group have landed
#if SS_PTX
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
#endif
}

SS_DEV void cp_wait_all() {
#if SS_PTX
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

// A float another block of this launch wrote before its __threadfence: read at L2, never from a line this SM's L1
// may hold (quant_gemv.cu's ld_partial).
SS_DEV float ld_cg(const float* p) {
#if SS_PTX
    return __ldcg(p);
#else
    return *(const volatile float*)p;
#endif
}

// ldmatrix .x4: four 8x8 b16 matrices from shared memory in one instruction. Lane l gives the row address
// base + off (off in halves, 16-byte aligned; base_s = smem_s(base)) of row l % 8 of matrix l / 8. Lane (g = l / 4,
// t = l % 4) gets r[j] = matrix j's row g, columns 2t, 2t+1 (TR: its transpose, rows 2t, 2t+1 of column g): exactly
// an mma A / B fragment register. The portable path gathers the same words through shuffles of the row offsets.
template <bool TR>
SS_DEV void ldsm4(u32 (&r)[4], const u16* base, u32 base_s, u32 off) {
#if SS_PTX
    (void)base;
    const u32 a = base_s + 2u * off;
    if constexpr (TR)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
#else
    (void)base_s;
    const int lane = (int)(threadIdx.x & 31u), g = lane >> 2, t = lane & 3;
    for (int j = 0; j < 4; ++j) {
        if constexpr (TR) {
            const u32 o0 = SS_SHFL(off, 8 * j + 2 * t), o1 = SS_SHFL(off, 8 * j + 2 * t + 1);
            r[j] = (u32)base[o0 + g] | ((u32)base[o1 + g] << 16);
        } else {
            const u32 o = SS_SHFL(off, 8 * j + g);
            r[j] = *(const u32*)(base + o + 2 * t);
        }
    }
#endif
}

SS_DEV bool warp_all(bool p) {  // every lane of the (converged) warp has p
#if SS_PTX
    return __all_sync(0xffffffffu, p) != 0;
#else
    int v = p ? 1 : 0;
    for (int m = 1; m < 32; m <<= 1) v &= SS_SHFL_XOR(v, m);
    return v != 0;
#endif
}

// f16 tile [KT][D] with 16-byte chunk c of row `key` stored at chunk c ^ (key & 7).
template <int D>
SS_DEV int swz(int key, int d) {
    return key * D + ((((d >> 3) ^ (key & 7))) << 3) + (d & 7);
}

// ---------------------------------------------------------------------------------------------
// TQ3_0 (services/engine/quants/tq3.py): 14-byte blocks {f16 norm; u8 qs[8] (2 low index bits each);
// u8 signs[4] (the third bit)}, value = centroid[idx] * norm in the rotated domain; rotation groups of
// 128 values (64 when D = 64): y = D2 H D1 x / sqrt(g). Constants from tq3.py (sign bit set = -1).

SS_DEV float tq3_centroid(u32 idx) {  // Lloyd-Max levels for N(0, 1/128), symmetric
    const u32 j = idx >= 4u ? idx - 4u : 3u - idx;
    const float m = j == 0u ? 0.021460f : j == 1u ? 0.065717f : j == 2u ? 0.117832f : 0.190685f;
    return idx >= 4u ? m : -m;
}

SS_DEV float tq3_sign1(int i) {
    const u32 w = i < 32 ? 0xe46a0359u : i < 64 ? 0x42f85949u : i < 96 ? 0xa4c63bbbu : 0x49f250a9u;
    return (w >> (i & 31)) & 1u ? -1.0f : 1.0f;
}

SS_DEV float tq3_sign2(int i) {
    const u32 w = i < 32 ? 0x16acee90u : i < 64 ? 0x3f628fdcu : i < 96 ? 0xb7a5357au : 0xbea56562u;
    return (w >> (i & 31)) & 1u ? -1.0f : 1.0f;
}

// 1/sqrt(g) as tq3.py's float32 rotation matrix holds it
template <int G>
SS_DEV float tq3_rscale() {
    return G == 128 ? 0.0883883461f : 0.125f;
}

// Nearest centroid of a rotated unit-vector coordinate: the count of midpoints <= y (np.searchsorted
// side="right"); 64-value groups compare against the midpoints scaled by sqrt(2) (tq3._MIDS[64]).
template <int G>
SS_DEV u32 tq3_code(float y) {
    const float a = G == 128 ? 0.043589f : 0.0616441555f;
    const float b = G == 128 ? 0.091775f : 0.129789457f;
    const float c = G == 128 ? 0.154259f : 0.218155161f;
    return (u32)(y >= -c) + (u32)(y >= -b) + (u32)(y >= -a) + (u32)(y >= 0.0f) + (u32)(y >= a) + (u32)(y >= b) +
           (u32)(y >= c);
}

using bits::byte_perm;  // kernels/bits.cuh
using bits::funnel_r;

// half2 (centroid[i0], centroid[i1]) from low4 = low2(i0) | low2(i1) << 2 and h2 = hi(i0) | hi(i1) << 1, all in
// integer ops (no float conversion): |centroid| rank j = low2 ^ (negative ? 3 : 0) picks the fp16 bits of the
// magnitude from a 4-half table with one byte permute, and the sign bit is ORed in.
SS_DEV u32 tq3_pair_h2(u32 low4, u32 h2) {
    const u32 neg = h2 ^ 3u;  // bit set: index < 4, a negative centroid
    const u32 jj = low4 ^ ((neg & 1u) * 3u | (neg & 2u) * 6u);
    const u32 sel = ((jj & 3u) | ((jj & 12u) << 6)) * 0x22u + 0x1010u;
    return byte_perm(0x2c35257eu, 0x321a2f8bu, sel) | ((neg & 1u) << 15) | ((neg & 2u) << 30);
}

// TQ3_0's Walsh-Hadamard butterfly over GR-value groups of rows whose lane l holds values [E l, E l + E): stages
// below E in registers, the others across lanes (a group is GR / E consecutive lanes), each the serial butterfly's
// sums and differences, bit for bit (E = GR: one thread's whole group, tq3_quantize_group's).
template <int GR, int E>
SS_DEV void wht_lanes(float (&y)[E], int lane) {
#pragma unroll
    for (int h = 1; h < E; h *= 2) {
#pragma unroll
        for (int j = 0; j < E; ++j) {
            if (j & h) continue;
            const float a = y[j], b = y[j + h];
            y[j] = a + b;
            y[j + h] = a - b;
        }
    }
#pragma unroll
    for (int m = 1; m * E < GR; m *= 2) {
#pragma unroll
        for (int j = 0; j < E; ++j) {
            const float p = SS_SHFL_XOR(y[j], m);
            y[j] = (lane & m) ? p - y[j] : y[j] + p;
        }
    }
}

// A query row rotated as TQ3_0 stores its keys (lane l holds values [E l, E l + E) of GR-value groups): signs,
// Walsh-Hadamard butterfly, signs and scale; <Rq, Rk> = <q, k>, so rotated keys are scored without unrotating them.
template <int GR, int E>
SS_DEV void tq3_rotate_lanes(float (&x)[E], int lane) {
#pragma unroll
    for (int j = 0; j < E; ++j) x[j] *= tq3_sign1((lane * E + j) % GR);
    wht_lanes<GR, E>(x, lane);
#pragma unroll
    for (int j = 0; j < E; ++j) x[j] *= tq3_sign2((lane * E + j) % GR) * tq3_rscale<GR>();
}

// Quantize one G-value group (src values off .. off + G - 1) into G / 32 blocks at dst (2-byte aligned):
// norm, unit vector, in-register Walsh-Hadamard butterfly, nearest centroid, corrected norm in f16.
template <int G, int TI>
SS_DEV void tq3_quantize_group(const void* src, i64 off, u8* dst) {
    float y[G];
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < G; ++i) {
        y[i] = ld<TI>(src, off + i);
        ss += y[i] * y[i];
    }
    const float nrm = sqrtf(ss);
    const float inv = nrm > 1e-10f ? 1.0f / nrm : 0.0f;
#pragma unroll
    for (int i = 0; i < G; ++i) y[i] = y[i] * inv * tq3_sign1(i);
    wht_lanes<G, G>(y, 0);
    u32 lo[G / 16], hi[G / 32];  // 2 low bits: 16 values a word; the high bit: 32 a word
#pragma unroll
    for (int w = 0; w < G / 16; ++w) lo[w] = 0u;
#pragma unroll
    for (int w = 0; w < G / 32; ++w) hi[w] = 0u;
    float r2 = 0.0f;
#pragma unroll
    for (int i = 0; i < G; ++i) {
        const u32 c = tq3_code<G>(y[i] * tq3_sign2(i) * tq3_rscale<G>());
        const float cv = tq3_centroid(c);
        r2 += cv * cv;
        lo[i >> 4] |= (c & 3u) << (2 * (i & 15));
        hi[i >> 5] |= (c >> 2) << (i & 31);
    }
    const float recon = sqrtf(r2);
    const u32 h = f2h(recon > 1e-10f ? nrm / recon : nrm);
#pragma unroll
    for (int b = 0; b < G / 32; ++b) {  // 16-bit stores only (see kv_store_kernel)
        u16* blk = (u16*)(dst + 14 * b);
        blk[0] = (u16)h;
        blk[1] = (u16)(lo[2 * b] & 0xFFFFu);
        blk[2] = (u16)(lo[2 * b] >> 16);
        blk[3] = (u16)(lo[2 * b + 1] & 0xFFFFu);
        blk[4] = (u16)(lo[2 * b + 1] >> 16);
        blk[5] = (u16)(hi[b] & 0xFFFFu);
        blk[6] = (u16)(hi[b] >> 16);
    }
}

// KV kinds: 0 f16, 1 Q8_0, 2 TQ3_0 (K and V chosen independently).
template <int KIND, int D>
struct Row {
    static constexpr int RB = KIND == 0 ? 2 * D : KIND == 1 ? D / 32 * 34 : D / 32 * 14;  // bytes per row
    static constexpr int BB = KIND == 1 ? 34 : 14;                                        // bytes per block
};

template <int KK, int KV, int D>
struct Layout {
    static constexpr int RBK = Row<KK, D>::RB, RBV = Row<KV, D>::RB;
    static constexpr int TK = KT * RBK, TV = KT * RBV;    // bytes of one K, one V tile
    static constexpr int STAGE = TK + TV;                  // K then V
    static constexpr int DEQK = KK == 0 ? 0 : KT * D * 2;  // quantized K: swizzled f16 tile
    static constexpr int DEQV = KV == 0 ? 0 : KT * D * 2;  // quantized V: the same layout (ldmatrix .trans reads it)
    static constexpr int NG = D % 128 == 0 ? D / 128 : D / 64;  // TQ3_0 rotation groups per row
    static constexpr int NRMK = KK == 2 ? KT * NG * 4 : 0;     // TQ3_0 K: f32 norm per (key, group)
    static constexpr int NRMV = KV == 2 ? KT * NG * 4 : 0;
    static constexpr int LUT = KK == 2 || KV == 2 ? TQ3_LUT_WORDS * 4 : 0;  // TQ3_0's pair tables (deq_tile)
    static constexpr int USED = 2 * STAGE + DEQK + DEQV + NRMK + NRMV + LUT;
    static constexpr int PARK = (MAXW - 1) * 16 * (D + 2) * 4;  // the key slices' parked partials (KW = 4)
    static constexpr int WORK = USED > PARK ? USED : PARK;
    static constexpr int QROW = D + QPAD;                  // halves per Q row
    static_assert(TK % 16 == 0 && TV % 16 == 0, "tile bytes must be a multiple of 16");
};

// half2 (d * q0, d * q1) of the Q8_0 pair in half `hi` of x (its bytes XORed with 0x80 already: q + 128 as unsigned
// bytes; d2 = the f16 scale in both halves, dsc = it as f32). The product of an f16 scale and an 8-bit integer is
// exact in f32, so one rounding to f16 gives the same bits either way; the PTX path stays in half2 (no int-to-float
// conversions, a quarter-rate unit): 0x64XX is the f16 1024 + XX, so bytes q + 128 under 0x64 minus 1152 are q.
SS_DEV u32 q8_pair_h2(u32 x, int hi, u32 d2, float dsc) {
#if SS_PTX
    (void)dsc;
    const u32 h = byte_perm(x, 0x64646464u, hi ? 0x4342u : 0x4140u);
    u32 v, r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(v) : "r"(h), "r"(0x64806480u));
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(v), "r"(d2));
    return r;
#else
    (void)d2;
    const u32 pair = (x >> (16 * hi)) ^ 0x8080u;
    return pack_f2(dsc * (float)(i8)(pair & 0xFFu), dsc * (float)(i8)((pair >> 8) & 0xFFu));
#endif
}

// TQ3_0 pair tables (deq_tile): entry i of table e (0, 1) is tq3_pair_h2(i & 15, (i >> (4 + 2 e)) & 3), i < 256: the
// pair's two low-bit pairs in the index's low nibble and its sign bits at bits 4-5 (pairs 0, 2 of a byte of signs)
// or 6-7 (pairs 1, 3): a byte of index per pair, built four at a time (TQ3_LUT_WORDS words).
SS_DEV void tq3_lut_fill(u32* lut, int tid, int nthreads) {
    for (int i = tid; i < TQ3_LUT_WORDS; i += nthreads)
        lut[i] = tq3_pair_h2((u32)i & 15u, ((u32)i >> (i < 256 ? 4 : 6)) & 3u);
}

// Decode the KT rows of one Q8_0 / TQ3_0 tile to f16, swizzled like the f16 cache's tiles (K and V alike: P x V
// reads V with ldmatrix .trans). Q8_0: the values (rows past n become zeros). TQ3_0: the bare centroids, and the
// group norms (0 past n) into nrm[key * NG + group]: the kernel applies them in f32 to the partial scores / the
// softmax weights, so decoding needs no float arithmetic. Work unit (key, 32-value block b): the 8 lanes of a
// quarter warp take 8 consecutive keys of one block, so their 16-byte stores hit 8 different bank groups. A block
// starts 2-byte aligned (rows are 4-byte aligned, blocks 34 / 14 bytes): its bytes are read as aligned words
// funnel-shifted by 16 bits where it starts mid-word, so every pair of values is a half of one word. TQ3_0 pairs come
// from the tables above (lut: TQ3_LUT_WORDS words, tq3_lut_fill), four indices a word of bytes: the low-bit nibbles
// spread to bytes, the sign bits of the byte's pairs ORed above them.
template <int KIND, int D>
SS_DEV void deq_tile(const u8* raw, u16* out, float* nrm, const u32* lut, int key0, int n, int tid, int nthreads) {
    constexpr int NB = D / 32, RB = Row<KIND, D>::RB, BB = Row<KIND, D>::BB;
    constexpr int GR = D % 128 == 0 ? 128 : 64;
    constexpr int NW = KIND == 1 ? 9 : 4;  // words of the block's byte stream (34 / 14 bytes)
    static_assert(RB % 4 == 0 && BB % 4 == 2, "rows 4-byte aligned, blocks 2 bytes off every other one");
    for (int u = tid; u < KT * NB; u += nthreads) {
        const int key = (u & 7) | ((u / (8 * NB)) << 3), b = (u >> 3) % NB;
        const int off = key * RB + BB * b;
        const u32* src = (const u32*)(raw + (off & ~3));
        const u32 sh = (u32)(off & 2) * 8u;  // 0 or 16
        const bool ok = key0 + key < n;
        u32 w[NW];  // bytes 4k .. 4k + 3 of the block
        {
            u32 a[NW + 1];
#pragma unroll
            for (int k = 0; k <= NW; ++k) a[k] = src[k];
#pragma unroll
            for (int k = 0; k < NW; ++k) w[k] = funnel_r(a[k], a[k + 1], sh);
        }
        const u32 dbits = w[0] & 0xFFFFu;
        const float dsc = ok ? h2f(dbits) : 0.0f;  // Q8_0 scale or TQ3_0 norm
        if constexpr (KIND == 2) {
            if ((32 * b) % GR == 0) nrm[key * (D / GR) + 32 * b / GR] = dsc;
        }
        if constexpr (KIND == 1) {
            // values q (bytes 2 .. 33): pair j of group c is half (1 + j) & 1 of word (1 + 4 c + j) / 2; a key past n
            // decodes as +0 (q = 0, d = 0)
            const u32 d2 = ok ? dbits * 0x10001u : 0u;
#pragma unroll
            for (int k = 0; k < NW; ++k) w[k] = ok ? w[k] ^ 0x80808080u : 0x80808080u;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                u32 v[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) v[j] = q8_pair_h2(w[(1 + 4 * c + j) >> 1], (1 + j) & 1, d2, dsc);
                *(uint4*)(out + swz<D>(key, 32 * b + 8 * c)) = uint4{v[0], v[1], v[2], v[3]};
            }
        } else {
            // group c (values 8c .. 8c + 7): low bits in qs bytes 2c, 2c + 1 (block bytes 2 + 2c, 3 + 2c: half (1 + c) & 1
            // of word (1 + c) / 2), sign bits in byte 10 + c
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const u32 lw = w[(1 + c) >> 1], sw8 = w[(10 + c) >> 2];
                const u32 y = byte_perm(lw, 0u, (1 + c) & 1 ? 0x4342u : 0x4140u);  // qs bytes at bytes 0 and 2
                const u32 nib = (y | (y << 4)) & 0x0F0F0F0Fu;                       // low-bit nibble j in byte j
                const u32 sb = (u32)((10 + c) & 3) * 0x1111u;
                const u32 r = byte_perm(sw8, 0u, sb);                   // the signs byte in every byte
                const u32 sg = byte_perm(r << 4, r, 0x7610u);          // bytes 0, 1: signs << 4; bytes 2, 3: signs
                const u32 idx = (sg & 0xF0F0F0F0u) | nib;               // pair j's index in byte j
                u32 v[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) v[j] = lut[256 * (j & 1) + ((idx >> (8 * j)) & 0xFFu)];
                *(uint4*)(out + swz<D>(key, 32 * b + 8 * c)) = uint4{v[0], v[1], v[2], v[3]};
            }
        }
    }
}


// ---------------------------------------------------------------------------------------------
// The one-token layer's row helpers (attn_decode_kernel): lane l of a warp holds values [E l, E l + E) of a row,
// E = D / 32.

// This lane's values of a stored row of kind KIND (raw bytes, e.g. in shared memory) as f32: f16 values, Q8_0
// d q, TQ3_0 centroid * norm (the rotated domain, as attention reads it).
template <int KIND, int D>
SS_DEV void row_values(const u8* row, int lane, float (&x)[D / 32]) {
    constexpr int E = D / 32;
    const int v0 = lane * E;
    if constexpr (KIND == 0) {
#pragma unroll
        for (int j = 0; j < E; ++j) x[j] = h2f(((const u16*)row)[v0 + j]);
    } else if constexpr (KIND == 1) {
        const u8* blk = row + (v0 / 32) * 34;
        const float d = h2f(*(const u16*)blk);
#pragma unroll
        for (int j = 0; j < E; ++j) x[j] = d * (float)(i8)blk[2 + v0 % 32 + j];
    } else {
        const u8* blk = row + (v0 / 32) * 14;
        const float nrm = h2f(*(const u16*)blk);
#pragma unroll
        for (int j = 0; j < E; ++j) {
            const int i = v0 % 32 + j;
            const u32 c = ((u32)(blk[2 + i / 4] >> (2 * (i & 3))) & 3u) | ((((u32)blk[10 + i / 8] >> (i & 7)) & 1u) << 2);
            x[j] = tq3_centroid(c) * nrm;
        }
    }
}

// Stores the warp's row x as kind KIND at dst (when `write`: the row lies inside the cache) and hands back in x the
// values as stored (row_values' of them). f16 and Q8_0: store_unit's arithmetic, bit for bit. TQ3_0: its group's
// two sums (squares of x, of the centroids) added as a lane butterfly instead of in value order, so a norm may
// differ by a rounding and a value within float32 rounding of a centroid midpoint by one code (as tq3.py's matrix
// product does from the butterfly); 16-bit stores only (store_unit's note).
template <int KIND, int D>
SS_DEV void store_row(float (&x)[D / 32], u8* dst, int lane, bool write) {
    constexpr int E = D / 32, LB = 32 / E;  // LB: lanes of a 32-value block
    const int v0 = lane * E;
    if constexpr (KIND == 0) {
#pragma unroll
        for (int j = 0; j < E; ++j) {
            const u32 h = f2h(x[j]);
            if (write) ((u16*)dst)[v0 + j] = (u16)h;
            x[j] = h2f(h);
        }
    } else if constexpr (KIND == 1) {
        float amax = 0.0f;
#pragma unroll
        for (int j = 0; j < E; ++j) amax = fmaxf(amax, fabsf(x[j]));
#pragma unroll
        for (int m = 1; m < LB; m <<= 1) amax = fmaxf(amax, SS_SHFL_XOR(amax, m));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        const u32 hd = f2h(d);
        const float ds = h2f(hd);
        u16* blk = (u16*)(dst + (v0 / 32) * 34);
        if (write && lane % LB == 0) blk[0] = (u16)hd;
#pragma unroll
        for (int j = 0; j < E; j += 2) {
            const int q0 = (int)roundf(x[j] * id), q1 = (int)roundf(x[j + 1] * id);
            if (write) blk[1 + (v0 % 32 + j) / 2] = (u16)((u32)(u8)(i8)q0 | ((u32)(u8)(i8)q1 << 8));
            x[j] = ds * (float)(i8)q0;
            x[j + 1] = ds * (float)(i8)q1;
        }
    } else {
        constexpr int GR = D % 128 == 0 ? 128 : 64, GL = GR / E;  // rotation group, its lanes
        const int i0 = v0 % GR;
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < E; ++j) ss += x[j] * x[j];
#pragma unroll
        for (int m = 1; m < GL; m <<= 1) ss += SS_SHFL_XOR(ss, m);
        const float nrm = sqrtf(ss);
        const float inv = nrm > 1e-10f ? 1.0f / nrm : 0.0f;
#pragma unroll
        for (int j = 0; j < E; ++j) x[j] = x[j] * inv * tq3_sign1(i0 + j);
        wht_lanes<GR, E>(x, lane);
        u32 c[E], lo = 0u, hi = 0u;
        float r2 = 0.0f;
#pragma unroll
        for (int j = 0; j < E; ++j) {
            c[j] = tq3_code<GR>(x[j] * tq3_sign2(i0 + j) * tq3_rscale<GR>());
            const float cv = tq3_centroid(c[j]);
            r2 += cv * cv;
            lo |= (c[j] & 3u) << (2 * j);
            hi |= (c[j] >> 2) << j;
        }
#pragma unroll
        for (int m = 1; m < GL; m <<= 1) r2 += SS_SHFL_XOR(r2, m);
        const float recon = sqrtf(r2);
        const u32 h = f2h(recon > 1e-10f ? nrm / recon : nrm);
        const int lead = lane & ~(LB - 1);  // the 32-value block's codes meet in its first lane
        u64 lo64 = 0u;
        u32 hi32 = 0u;
#pragma unroll
        for (int i = 0; i < LB; ++i) {
            lo64 |= (u64)(u32)SS_SHFL((int)lo, lead + i) << (2 * E * i);
            hi32 |= (u32)SS_SHFL((int)hi, lead + i) << (E * i);
        }
        if (write && lane == lead) {
            u16* blk = (u16*)(dst + (v0 / 32) * 14);
            blk[0] = (u16)h;
#pragma unroll
            for (int w = 0; w < 4; ++w) blk[1 + w] = (u16)(lo64 >> (16 * w));
            blk[5] = (u16)(hi32 & 0xFFFFu);
            blk[6] = (u16)(hi32 >> 16);
        }
        const float ns = h2f(h);
#pragma unroll
        for (int j = 0; j < E; ++j) x[j] = tq3_centroid(c[j]) * ns;
    }
}

}  // namespace ssa

// One store unit of one side: a value (f16), a 32-value block (Q8_0, quantized like ggml's
// quantize_row_q8_0_ref) or a rotation group (TQ3_0, like tq3.quantize_tq3_0) of row (t, h) -> cache row S + t.
template <int KIND, int TI>
SS_DEV void store_unit(const void* src, u8* dst, i64 w, int Hkv, int D, i64 S, i64 ctx) {
    using namespace ssa;
    if constexpr (KIND == 0) {
        const i64 d = w % D, th = w / D, h = th % Hkv, t = th / Hkv;
        if (S + t >= ctx) return;
        ((u16*)dst)[(h * ctx + S + t) * D + d] = (u16)f2h(ld<TI>(src, w));
    } else if constexpr (KIND == 1) {
        const int nb = D / 32;
        const i64 b = w % nb, th = w / nb, h = th % Hkv, t = th / Hkv;
        if (S + t >= ctx) return;
        float x[32];
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) {
            x[i] = ld<TI>(src, th * D + b * 32 + i);
            amax = fmaxf(amax, fabsf(x[i]));
        }
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        u8* blk = dst + ((h * ctx + S + t) * nb + b) * 34;
        // 16-bit stores (blk is 2-byte aligned): on sm_90 a byte store of the inline-asm cvt result lost
        // its value (seen on an H200: the scale's low byte read back 0), a u16 store of it does not.
        ((u16*)blk)[0] = (u16)f2h(d);
        for (int i = 0; i < 32; i += 2) {
            const u32 q0 = (u32)(u8)(i8)(int)roundf(x[i] * id), q1 = (u32)(u8)(i8)(int)roundf(x[i + 1] * id);
            ((u16*)blk)[1 + i / 2] = (u16)(q0 | (q1 << 8));
        }
    } else {
        const int G = D % 128 == 0 ? 128 : 64, ng = D / G;
        const i64 gi = w % ng, th = w / ng, h = th % Hkv, t = th / Hkv;
        if (S + t >= ctx) return;
        u8* grp = dst + (h * ctx + S + t) * (D / 32 * 14) + gi * (G / 32 * 14);
        if (G == 128)
            tq3_quantize_group<128, TI>(src, th * D + gi * G, grp);
        else
            tq3_quantize_group<64, TI>(src, th * D + gi * G, grp);
    }
}

template <int KIND>
SS_DEV i64 store_units_per_row(int D) {
    return KIND == 0 ? D : KIND == 1 ? D / 32 : D / (D % 128 == 0 ? 128 : 64);
}

// Write this step's K/V rows (k, v: [T, Hkv, D] of type TI) into cache rows s_len[0] + t, K as kind KK and V
// as kind KV (0 f16, 1 Q8_0, 2 TQ3_0). Grid-stride over the store units of both sides.
template <int KK, int KV, int TI>
__global__ __launch_bounds__(256) void kv_store_kernel(const void* __restrict__ k, const void* __restrict__ v,
                                                       u8* __restrict__ kc, u8* __restrict__ vc,
                                                       const int* __restrict__ s_len, int T, int Hkv, int D,
                                                       i64 ctx) {
    SS_PDL_ENTRY();  // kernels/pdl.cuh: a narrow step's attention chain launches early under PDL, waits here
    const i64 S = s_len[0];
    const i64 per_k = (i64)T * Hkv * store_units_per_row<KK>(D), per_v = (i64)T * Hkv * store_units_per_row<KV>(D);
    for (i64 u = (i64)blockIdx.x * blockDim.x + threadIdx.x; u < per_k + per_v; u += (i64)gridDim.x * blockDim.x) {
        if (u < per_k)
            store_unit<KK, TI>(k, kc, u, Hkv, D, S, ctx);
        else
            store_unit<KV, TI>(v, vc, u - per_k, Hkv, D, S, ctx);
    }
}

template <int KK, int KV, int D, int TQ, int KW, int DS>
__global__ __launch_bounds__(128, DS && KW > 1 ? 3 : 2) void attn_partial_kernel(
    const void* __restrict__ q, const u8* __restrict__ kc, const u8* __restrict__ vc, const int* __restrict__ s_len,
    const u64* __restrict__ mask, int window, int T, int H, int Hkv, i64 ctx, float scale_log2,
    float* __restrict__ ws_o, float* __restrict__ ws_ml) {
    SS_PDL_ENTRY();
    using namespace ssa;
    using L = Layout<KK, KV, D>;
    extern __shared__ uint4 ssa_smem[];
    u8* smem = (u8*)ssa_smem;
    u8* stages = smem;                                        // 2 stages of raw K, V tiles
    u16* deq_k = (u16*)(smem + 2 * L::STAGE);                 // quantized K: its f16 tile
    u16* deq_v = (u16*)(smem + 2 * L::STAGE + L::DEQK);       // quantized V: its f16 V^T tile
    float* nrm_k = (float*)(smem + 2 * L::STAGE + L::DEQK + L::DEQV);  // TQ3_0 K / V: norms [KT][NG]
    float* nrm_v = (float*)(smem + 2 * L::STAGE + L::DEQK + L::DEQV + L::NRMK);
    u32* lut = (u32*)(smem + 2 * L::STAGE + L::DEQK + L::DEQV + L::NRMK + L::NRMV);  // TQ3_0: the pair tables
    constexpr int NG = L::NG, GR = D / NG;
    u16* qs_all = (u16*)(smem + L::WORK);                     // Q rows, one m16 tile per MTB

    constexpr int MTB = MAXW / KW;   // m16 tiles per block; KW warps share each, a key slice (DS: dim slice) each
    constexpr int KPW = DS ? KT : KT / KW;  // keys of each tile per warp: 32, 16 or 8
    constexpr int NTW = KPW / 8;            // n8 score tiles per warp
    constexpr int DW = DS ? D / KW : D;     // output dims per warp
    static_assert(!DS || DW % 16 == 0, "a warp's dims are whole x4 ldmatrix pairs of n8 tiles");
    constexpr int NGW = KV == 2 && DW > GR ? NG : 1;  // TQ3_0 V groups a warp's dims span (1: within one)
    static_assert(KV != 2 || DW > GR || GR % DW == 0, "a warp's dims lie in one TQ3_0 group or span whole groups");
    const int nthreads = (int)blockDim.x;
    const int tid = (int)threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int kvh = (int)blockIdx.y, z = (int)blockIdx.z, splits = (int)gridDim.z;
    const int G = H / Hkv, R = G * T;                // query rows of this KV head
    const int mtl = wid / KW, ks = wid % KW;         // m16 tile within the block, key slice
    const int mt = (int)blockIdx.x * MTB + mtl;      // this warp's m16 tile
    const bool active = mt * 16 < R;
    const int S = s_len[0], n = S + T;
    // window > 0 (a sliding layer whose window cuts the context): new token t sees the committed keys from
    // S - (window - 1) + t on, so the splits cover the tiles from the first key any token sees
    const int wlo = window > 0 ? S - (window - 1) : 0;
    const int t0 = wlo > 0 ? wlo / KT : 0;
    const int ntiles = (n + KT - 1) / KT;
    const int per = (ntiles - t0 + splits - 1) / splits;
    const int tb = t0 + z * per, te = tb + per < ntiles ? tb + per : ntiles;

    const u8* kbase = kc + (i64)kvh * ctx * L::RBK;
    const u8* vbase = vc + (i64)kvh * ctx * L::RBV;
    const u32 stages_s = smem_s(stages);
    // A tile's copy: the block's threads (a compile-time count) take 16-byte chunks c = tid + NTH i, from a source
    // pointer formed once a tile into 32-bit shared destinations (no 64-bit address arithmetic a chunk but the source's
    // add; not unrolled, which would cost the kernel registers).
    auto issue = [&](int tile, int stage) {
        constexpr int NTH = 32 * MAXW;  // the launch's block (attention.py)
        u8* dk = stages + stage * L::STAGE;
        u8* dv = dk + L::TK;
        const u32 dk_s = stages_s + (u32)(stage * L::STAGE), dv_s = dk_s + (u32)L::TK;
        const u8* ksrc = kbase + (i64)tile * L::TK;
        const u8* vsrc = vbase + (i64)tile * L::TV;
        const int nvalid = n - tile * KT;  // > 0 for every tile we load
        constexpr int CH = (L::TK > L::TV ? L::TK : L::TV) / 16;
#pragma unroll 1
        for (int i = 0; i < (CH + NTH - 1) / NTH; ++i) {
            const int c = tid + NTH * i;
            if (16 * c < L::TK) {
                int dst = 16 * c;
                if constexpr (KK == 0) {  // f16: swizzle 16-byte chunks within each row
                    const int key = c / (L::RBK / 16), ch = c % (L::RBK / 16);
                    dst = key * L::RBK + 16 * (ch ^ (key & 7));
                }
                cp16(dk + dst, dk_s + (u32)dst, ksrc + 16 * c, 16 * c < nvalid * L::RBK);
            }
            if (16 * c < L::TV) {
                int dst = 16 * c;
                if constexpr (KV == 0) {
                    const int key = c / (L::RBV / 16), ch = c % (L::RBV / 16);
                    dst = key * L::RBV + 16 * (ch ^ (key & 7));
                }
                cp16(dv + dst, dv_s + (u32)dst, vsrc + 16 * c, 16 * c < nvalid * L::RBV);
            }
        }
    };
    // The split's first two tiles stream in while the query rows are loaded (one commit group per tile, empty
    // groups included, so "all but the newest group landed" always means "tile it landed").
    if (tb < te) issue(tb, 0);
    cp_commit();
    if (tb + 1 < te) issue(tb + 1, 1);
    cp_commit();
    if constexpr (L::LUT != 0) tq3_lut_fill(lut, tid, nthreads);  // (the tile loop's first barrier publishes them)

    // The m16 tile's 16 query rows, pre-scaled, as fp16 (key slice 0 loads them; the first barrier of the
    // tile loop publishes them to the tile's other warps). The loads of several rows are issued before any is
    // used: a row at a time would chain 16 global round trips.
    u16* qs = qs_all + mtl * 16 * L::QROW;
    if (ks == 0) {
        auto q_base = [&](int rl, bool& ok) -> i64 {  // element offset of row rl of the tile in q [T, H, D]
            const int r = mt * 16 + rl;
            ok = active && r < R;
            return ok ? ((i64)(r / G) * H + kvh * G + r % G) * D : 0;
        };
        if constexpr (KK == 2) {
            // TQ3_0 keys stay rotated: rotate the query row instead (<Rq, Rk> = <q, k>). Lane l holds values
            // l*E .. l*E+E-1 (wht_lanes).
            constexpr int E = D / 32, GR = D % 128 == 0 ? 128 : 64, RB = 4;
            for (int r0 = 0; r0 < 16; r0 += RB) {
                float x[RB][E];
                bool ok[RB];
#pragma unroll
                for (int rr = 0; rr < RB; ++rr) {
                    const i64 base = q_base(r0 + rr, ok[rr]);
#pragma unroll
                    for (int j = 0; j < E; ++j) x[rr][j] = ok[rr] ? ld<TQ>(q, base + lane * E + j) : 0.0f;
                }
#pragma unroll
                for (int rr = 0; rr < RB; ++rr) {
                    tq3_rotate_lanes<GR, E>(x[rr], lane);
#pragma unroll
                    for (int j = 0; j < E; ++j)
                        qs[(r0 + rr) * L::QROW + lane * E + j] = (u16)(ok[rr] ? f2h(x[rr][j] * scale_log2) : 0u);
                }
            }
        } else {
            // unit u = (row u / (D / 8), 8 values at 8 * (u % (D / 8))): one 16-byte store of fp16 each
            constexpr int NU = 16 * D / 8 / 32, UB = NU < 8 ? NU : 8;  // units per lane, per batch
            for (int u0 = 0; u0 < NU; u0 += UB) {
                float x[UB][8];
                bool ok[UB];
#pragma unroll
                for (int k = 0; k < UB; ++k) {
                    const int u = (u0 + k) * 32 + lane, rl = u / (D / 8), d0 = 8 * (u % (D / 8));
                    const i64 base = q_base(rl, ok[k]) + d0;
                    ld8<TQ>(q, base, ok[k], x[k]);
                }
#pragma unroll
                for (int k = 0; k < UB; ++k) {
                    const int u = (u0 + k) * 32 + lane, rl = u / (D / 8), d0 = 8 * (u % (D / 8));
                    u32 w[4];
#pragma unroll
                    for (int j = 0; j < 4; ++j) w[j] = pack_f2(x[k][2 * j] * scale_log2, x[k][2 * j + 1] * scale_log2);
                    *(uint4*)(qs + rl * L::QROW + d0) = uint4{w[0], w[1], w[2], w[3]};
                }
            }
        }
    }
    // Row state: rows g and g+8 of the tile.
    int tok[2], klo[2];
    bool rok[2];
    u64 mbits[2];
    float m_run[2], l_run[2];
    for (int i = 0; i < 2; ++i) {
        const int r = mt * 16 + g + 8 * i;
        rok[i] = active && r < R;
        tok[i] = rok[i] ? r / G : 0;
        klo[i] = window > 0 ? wlo + tok[i] : 0;  // the row's first visible committed key
        mbits[i] = rok[i] ? mask[tok[i]] : 0ull;
        m_run[i] = neg_inf();
        l_run[i] = 0.0f;
    }
    float o[DW / 8][4];  // this warp's DW output dims: n8 dim tiles nd0w .. nd0w + DW / 8 - 1 of the row
#pragma unroll
    for (int nd = 0; nd < DW / 8; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.0f;
    const int nd0w = DS ? ks * (DW / 8) : 0;

    // Per-lane ldmatrix row offsets (halves). Every fragment row below is a key row kw0 + 8x + (lane & 7) of a
    // swizzled tile, so its chunk swizzle is (lane & 7): chunk c of it sits at chunk c ^ r8.
    const int r8 = lane & 7, j4 = lane >> 3;
    const u32 q_off = (u32)((r8 + 8 * (j4 & 1)) * L::QROW + 8 * (j4 >> 1));  // A: rows 0-7 / 8-15, cols +0 / +8
    constexpr int NC = NTW >= 4 ? 1 : 4 / NTW;  // independent accumulator chains of the Q K^T k-loop
    const u32 qs_s = smem_s(qs);
    // K B fragments (NTW >= 2): row key = kw0 + 16 p + 8 (j4 / 2) + r8, chunk (2 kk + (j4 & 1)) ^ r8 of it; kofs[m]
    // is its offset at p = 0 for the kk with kk / 4 = 0 and kk % 4 = m (p and kk / 4 add compile-time offsets once the
    // k-loop is unrolled)
    u32 kofs[4];
    {
        const int key = (DS ? 0 : ks * KPW) + 8 * (j4 >> 1) + r8, cb = (j4 & 1) ^ r8;
#pragma unroll
        for (int m = 0; m < 4; ++m) kofs[m] = (u32)(key * D + (((2 * m) ^ cb) << 3));
    }

    for (int it = tb; it < te; ++it) {
        const int stage = (it - tb) & 1;
        cp_wait_prev();
        __syncthreads();
        const int key0 = it * KT;
        // Q8_0 / TQ3_0 tiles are dequantized to f16 in shared memory (keys past n become zeros: their
        // bytes may be stale); f16 tiles are used where they landed.
        const u8* raw = stages + stage * L::STAGE;
        if constexpr (KK != 0) deq_tile<KK, D>(raw, deq_k, nrm_k, lut, key0, n, tid, nthreads);
        if constexpr (KV != 0) deq_tile<KV, D>(raw + L::TK, deq_v, nrm_v, lut, key0, n, tid, nthreads);
        if constexpr (KK != 0 || KV != 0) __syncthreads();
        const u16* kt = KK != 0 ? (const u16*)deq_k : (const u16*)raw;
        const u16* vt = KV != 0 ? (const u16*)deq_v : (const u16*)(raw + L::TK);
        const u32 kt_s = smem_s(kt), vt_s = smem_s(vt);

        if (active) {
            const int kw0 = DS ? 0 : ks * KPW;  // this warp's first key within the tile
            // acc[c] += Q[:, 16kk..16kk+15] K^T for kk = kb .. kb + NC - 1 (chain c = kk - kb), this warp's keys.
            // K B fragments by ldmatrix: NTW >= 2: one x4 = (b0, b1) of two n8 key tiles; NTW == 1: of two kk.
            auto qk = [&](int kb, float(&acc)[NC][NTW][4]) {
                if constexpr (NTW >= 2) {
#pragma unroll
                    for (int c = 0; c < NC; ++c) {
                        const int kk = kb + c;
                        u32 a[4];
                        ldsm4<false>(a, qs, qs_s, q_off + 16 * kk);
#pragma unroll
                        for (int p = 0; p < NTW / 2; ++p) {
                            // chunk (2 kk + (j4 & 1)) ^ r8 of the key row: 2 kk's low bit is clear, so it is
                            // 8 (kk / 4) + ((2 (kk % 4)) ^ cb), a compile-time part and one of 4 lane constants
                            u32 b[4];
                            ldsm4<false>(b, kt, kt_s, kofs[kk & 3] + (u32)(16 * p * D + 64 * (kk >> 2)));
                            mma16816(acc[c][2 * p], a[0], a[1], a[2], a[3], b[0], b[1]);
                            mma16816(acc[c][2 * p + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
                        }
                    }
                } else {
#pragma unroll
                    for (int c = 0; c < NC; c += 2) {  // NC = 4: kk and kk + 1 share one K ldmatrix
                        const int kk = kb + c;
                        u32 a[4], a1[4], b[4];
                        ldsm4<false>(a, qs, qs_s, q_off + 16 * kk);
                        ldsm4<false>(a1, qs, qs_s, q_off + 16 * (kk + 1));
                        ldsm4<false>(b, kt, kt_s, (u32)((kw0 + r8) * D + (((2 * kk + j4) ^ r8) << 3)));
                        mma16816(acc[c][0], a[0], a[1], a[2], a[3], b[0], b[1]);
                        mma16816(acc[c + 1][0], a1[0], a1[1], a1[2], a1[3], b[2], b[3]);
                    }
                }
            };
            float s[NTW][4];
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
            auto qk_range = [&](int kb0, int kb1, float(&out)[NTW][4], const float* scale_n, int gi) {
                float acc[NC][NTW][4];
#pragma unroll
                for (int c = 0; c < NC; ++c)
#pragma unroll
                    for (int nt = 0; nt < NTW; ++nt) acc[c][nt][0] = acc[c][nt][1] = acc[c][nt][2] = acc[c][nt][3] = 0.0f;
#pragma unroll
                for (int kb = kb0; kb < kb1; kb += NC) qk(kb, acc);  // (constant bounds: kk is known)
#pragma unroll
                for (int nt = 0; nt < NTW; ++nt) {
                    float n0 = 1.0f, n1 = 1.0f;
                    if (scale_n != nullptr) {  // TQ3_0 K: the group norms of this lane's two keys
                        const int key = kw0 + 8 * nt + 2 * t4;
                        n0 = scale_n[key * NG + gi];
                        n1 = scale_n[(key + 1) * NG + gi];
                    }
#pragma unroll
                    for (int c = 0; c < NC; ++c) {
                        out[nt][0] += n0 * acc[c][nt][0];
                        out[nt][1] += n1 * acc[c][nt][1];
                        out[nt][2] += n0 * acc[c][nt][2];
                        out[nt][3] += n1 * acc[c][nt][3];
                    }
                }
            };
            if constexpr (KK == 2) {
                // TQ3_0 K holds bare centroids: score = sum over groups of norm[key][group] * <q_g, c_g>
#pragma unroll
                for (int gi = 0; gi < NG; ++gi) qk_range(gi * GR / 16, (gi + 1) * GR / 16, s, nrm_k, gi);
            } else {
                qk_range(0, D / 16, s, nullptr, 0);
            }
            // Mask (only a tile that reaches the new keys or past n, or a window's bounds, needs one: every other
            // committed key is visible, and rows past R hold zero queries whose results are never written), then
            // online softmax in the exp2 domain for rows g (i = 0) and g + 8 (i = 1). The running max moves only
            // when a tile's max exceeds it by more than 8 (weights stay <= 2^8, exact enough in fp16), so most tiles
            // skip rescaling O.
            const bool edge = key0 + KT > S || (window > 0 && key0 < wlo + T - 1);
            float alpha[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                float mx = neg_inf();
#pragma unroll
                for (int nt = 0; nt < NTW; ++nt) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float& sv = s[nt][2 * i + e];
                        if (edge) {
                            const int j = key0 + kw0 + 8 * nt + 2 * t4 + e;
                            const bool vis =
                                rok[i] && (j < S ? j >= klo[i] : (j < n && ((mbits[i] >> (j - S)) & 1ull)));
                            sv = vis ? sv : neg_inf();
                        }
                        mx = fmaxf(mx, sv);
                    }
                }
                mx = fmaxf(mx, SS_SHFL_XOR(mx, 1));
                mx = fmaxf(mx, SS_SHFL_XOR(mx, 2));
                const float m_new = mx > m_run[i] + 8.0f ? mx : m_run[i];
                const float m_use = m_new == neg_inf() ? 0.0f : m_new;
                alpha[i] = m_new == m_run[i] ? 1.0f : exp2f(m_run[i] - m_use);
                m_run[i] = m_new;
                float sum = 0.0f;
#pragma unroll
                for (int nt = 0; nt < NTW; ++nt) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float& sv = s[nt][2 * i + e];
                        sv = exp2f(sv - m_use);
                        sum += sv;
                    }
                }
                l_run[i] = l_run[i] * alpha[i] + sum;
            }
            if (!warp_all(alpha[0] == 1.0f && alpha[1] == 1.0f)) {
#pragma unroll
                for (int nd = 0; nd < DW / 8; ++nd) {
                    o[nd][0] *= alpha[0];
                    o[nd][1] *= alpha[0];
                    o[nd][2] *= alpha[1];
                    o[nd][3] *= alpha[1];
                }
            }
            // P x V, 16 keys per mma; a warp with 8 keys (KW = 4) fills the upper k half with zeros. V B fragments
            // by ldmatrix .trans of the swizzled [key][dim] tile: one x4 = (b0, b1) of two n8 dim tiles (16 keys),
            // or b0 of four (8 keys).
#pragma unroll
            for (int k2 = 0; k2 < (NTW + 1) / 2; ++k2) {
                constexpr bool HALF = NTW == 1;
                constexpr int UP = HALF ? 0 : 1;
                const int k0 = kw0 + 16 * k2;
                u32 af[NGW][4];
                if constexpr (KV == 2) {
                    // TQ3_0 V holds bare centroids: scale the weights by each key's group norm instead, one set
                    // of A fragments per group, each multiplying that group's D / NG output columns (DS: the one
                    // group of the warp's dims)
                    const int kl = k0 + 2 * t4;
#pragma unroll
                    for (int gl = 0; gl < NGW; ++gl) {
                        const int gi = NGW == 1 ? (8 * nd0w) / GR : gl;
                        const float na = nrm_v[kl * NG + gi], nb = nrm_v[(kl + 1) * NG + gi];
                        const float nc = HALF ? 0.0f : nrm_v[(kl + 8) * NG + gi];
                        const float nd8 = HALF ? 0.0f : nrm_v[(kl + 9) * NG + gi];
                        af[gl][0] = pack_f2(s[2 * k2][0] * na, s[2 * k2][1] * nb);
                        af[gl][1] = pack_f2(s[2 * k2][2] * na, s[2 * k2][3] * nb);
                        af[gl][2] = HALF ? 0u : pack_f2(s[2 * k2 + UP][0] * nc, s[2 * k2 + UP][1] * nd8);
                        af[gl][3] = HALF ? 0u : pack_f2(s[2 * k2 + UP][2] * nc, s[2 * k2 + UP][3] * nd8);
                    }
                } else {
                    af[0][0] = pack_f2(s[2 * k2][0], s[2 * k2][1]);
                    af[0][1] = pack_f2(s[2 * k2][2], s[2 * k2][3]);
                    af[0][2] = HALF ? 0u : pack_f2(s[2 * k2 + UP][0], s[2 * k2 + UP][1]);
                    af[0][3] = HALF ? 0u : pack_f2(s[2 * k2 + UP][2], s[2 * k2 + UP][3]);
#pragma unroll
                    for (int gl = 1; gl < NGW; ++gl)
#pragma unroll
                        for (int e = 0; e < 4; ++e) af[gl][e] = af[0][e];
                }
                constexpr int NDS = HALF ? 4 : 2;  // n8 dim tiles per ldmatrix
#pragma unroll
                for (int ndl = 0; ndl < DW / 8; ndl += NDS) {
                    const int nd0 = nd0w + ndl;  // the n8 dim tile in the row
                    const int gi = NGW == 1 ? 0 : nd0 / (GR / 8);
                    const int key = HALF ? k0 + r8 : k0 + 8 * (j4 & 1) + r8;
                    const int chunk = HALF ? nd0 + j4 : nd0 + (j4 >> 1);
                    u32 b[4];
                    ldsm4<true>(b, vt, vt_s, (u32)(key * D + ((chunk ^ r8) << 3)));
                    if constexpr (HALF) {
#pragma unroll
                        for (int j = 0; j < 4; ++j) mma16816(o[ndl + j], af[gi][0], af[gi][1], 0u, 0u, b[j], 0u);
                    } else {
                        mma16816(o[ndl], af[gi][0], af[gi][1], af[gi][2], af[gi][3], b[0], b[1]);
                        mma16816(o[ndl + 1], af[gi][0], af[gi][1], af[gi][2], af[gi][3], b[2], b[3]);
                    }
                }
            }
        }
        __syncthreads();  // the stage (and the dequantized tile) is rewritten next
        if (it + 2 < te) issue(it + 2, stage);
        cp_commit();
    }

#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l_run[i] += SS_SHFL_XOR(l_run[i], 1);
        l_run[i] += SS_SHFL_XOR(l_run[i], 2);
    }
    if constexpr (KW > 1 && !DS) {
        // Merge the KW key slices of each m16 tile inside the block (fewer partials for the combine to read):
        // slices 1.. park (O, m, l) in the now idle stage buffers, slice 0 folds them into its own.
        constexpr int PR = D + 2;  // floats per parked row: O[0..D), m, l
        static_assert(MTB * (KW - 1) * 16 * PR * 4 <= L::WORK, "parked partials exceed the work area");
        float* park = (float*)smem;
        if (ks > 0 && active) {
            float* mine = park + (mtl * (KW - 1) + ks - 1) * 16 * PR;
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                float* rowp = mine + (g + 8 * i) * PR;
#pragma unroll
                for (int nd = 0; nd < D / 8; ++nd) {
                    rowp[8 * nd + 2 * t4] = o[nd][2 * i];
                    rowp[8 * nd + 2 * t4 + 1] = o[nd][2 * i + 1];
                }
                if (t4 == 0) {
                    rowp[D] = m_run[i];
                    rowp[D + 1] = l_run[i];
                }
            }
        }
        __syncthreads();
        if (ks > 0) return;
        if (active) {
            for (int sl = 1; sl < KW; ++sl) {
                const float* other = park + (mtl * (KW - 1) + sl - 1) * 16 * PR;
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const float* rowp = other + (g + 8 * i) * PR;
                    const float m2 = rowp[D], l2 = rowp[D + 1];
                    const float mm = fmaxf(m_run[i], m2);
                    const float mu = mm == neg_inf() ? 0.0f : mm;
                    const float a = exp2f(m_run[i] - mu), b = exp2f(m2 - mu);
                    l_run[i] = l_run[i] * a + l2 * b;
                    m_run[i] = mm;
#pragma unroll
                    for (int nd = 0; nd < D / 8; ++nd) {
                        o[nd][2 * i] = o[nd][2 * i] * a + rowp[8 * nd + 2 * t4] * b;
                        o[nd][2 * i + 1] = o[nd][2 * i + 1] * a + rowp[8 * nd + 2 * t4 + 1] * b;
                    }
                }
            }
        }
    }
    if (!active) return;
    const i64 rows_all = (i64)Hkv * R;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (!rok[i]) continue;
        const i64 row = (i64)z * rows_all + (i64)kvh * R + mt * 16 + g + 8 * i;
        if (t4 == 0 && ks == 0) {  // (DS: every warp of the tile holds the same m and l)
            ws_ml[2 * row] = m_run[i];
            ws_ml[2 * row + 1] = l_run[i];
        }
        if (tb < te) {
            float* dst = ws_o + row * D + 8 * nd0w + 2 * t4;
#pragma unroll
            for (int nd = 0; nd < DW / 8; ++nd) {
                dst[8 * nd] = o[nd][2 * i];
                dst[8 * nd + 1] = o[nd][2 * i + 1];
            }
        }
    }
}

// o[t, h, d] = sum_z 2^(m_z - M) O_z / sum_z 2^(m_z - M) l_z, inverse-rotated in RG-value groups when V is
// TQ3_0 (RG = 128 or 64; 0 otherwise), times sigmoid(gate) when gate != null.
// grid = Hkv * G * T rows (kernel row order), block = COMB_THREADS threads, D <= COMB_THREADS; splits <= MAX_SPLITS.
// The split weights are computed once per block into shared memory. The O sum is the block's latency chain (a decode
// token has only H rows, i.e. blocks, for hundreds of splits): thread (slice s, column c) adds 4 values (one 16-byte
// load) of the splits s, s + NS, ... (NS = COMB_THREADS / (D / 4) slices), COMB_LOADS loads in flight, and the slices'
// partial sums meet in shared memory, added in slice order: one memory round trip per NS COMB_LOADS splits.
// q16 non-null: also the output projection's int16 staging of the fp16-rounded o [T, H D] (PackedX.q16, as
// pack_x_kernel writes it from `out`: a gemv ring reads it with no pack launch between), D % 32 == 0 and
// H D % 256 == 0 (the launcher): a group's 16 values are 16 lanes of a warp.
constexpr int COMB_THREADS = 256;
constexpr int COMB_LOADS = 8;
struct alignas(16) CF4 {  // 4 floats, one 16-byte load (float4 without CUDA's vector types: the CPU simulation)
    float x, y, z, w;
};
template <int TO, int TG, int RG>
__global__ __launch_bounds__(COMB_THREADS) void attn_combine_kernel(const float* __restrict__ ws_o,
                                                                    const float* __restrict__ ws_ml, int splits,
                                                                    int T, int H, int Hkv, int D,
                                                                    const void* __restrict__ gate, i64 g_tok,
                                                                    i64 g_head, void* __restrict__ out,
                                                                    uint4* __restrict__ q16) {
    SS_PDL_ENTRY();
    using namespace ssa;
    static __shared__ float wsh[MAX_SPLITS];
    static __shared__ float red[2][COMB_THREADS / 32];
    static __shared__ CF4 part4[COMB_THREADS];  // [NS][D] floats
    float* const part = (float*)part4;
    const int G = H / Hkv, R = G * T;
    const i64 row = blockIdx.x;
    const int kvh = (int)(row / R), r = (int)(row % R), t = r / G, head = kvh * G + r % G;
    const int d = (int)threadIdx.x, lane = d & 31, wid = d >> 5, nw = (int)(blockDim.x >> 5);
    const i64 rows_all = (i64)Hkv * R;
    float mx = neg_inf();
    for (int z = d; z < splits; z += (int)blockDim.x) {
        const i64 zr = z * rows_all + row;
        if (ws_ml[2 * zr + 1] > 0.0f) mx = fmaxf(mx, ws_ml[2 * zr]);
    }
    for (int m = 16; m >= 1; m >>= 1) mx = fmaxf(mx, SS_SHFL_XOR(mx, m));
    if (lane == 0) red[0][wid] = mx;
    __syncthreads();
    float M = red[0][0];
    for (int w = 1; w < nw; ++w) M = fmaxf(M, red[0][w]);
    float lsum = 0.0f;
    for (int z = d; z < splits; z += (int)blockDim.x) {
        const i64 zr = z * rows_all + row;
        const float l = ws_ml[2 * zr + 1];
        const float w = l > 0.0f ? exp2f(ws_ml[2 * zr] - M) : 0.0f;
        wsh[z] = w;
        lsum += w * l;
    }
    for (int m = 16; m >= 1; m >>= 1) lsum += SS_SHFL_XOR(lsum, m);
    if (lane == 0) red[1][wid] = lsum;
    __syncthreads();
    float L = 0.0f;
    for (int w = 0; w < nw; ++w) L += red[1][w];
    const int cols = D / 4, ns = (int)blockDim.x / cols, s = d / cols, c = d % cols;
    CF4 acc[COMB_LOADS];
#pragma unroll
    for (int j = 0; j < COMB_LOADS; ++j) acc[j] = CF4{0.0f, 0.0f, 0.0f, 0.0f};
    {  // (head dims 64 / 128 / 256: every thread is in one of the ns slices)
        const CF4* const src = (const CF4*)ws_o + row * cols + c;
        const i64 zstride = rows_all * cols;
        int z = s;
        for (; z + (COMB_LOADS - 1) * ns < splits; z += COMB_LOADS * ns) {
            CF4 v[COMB_LOADS];
#pragma unroll
            for (int j = 0; j < COMB_LOADS; ++j)  // splits without keys have weight 0 and an O never written
                v[j] = wsh[z + j * ns] != 0.0f ? src[(i64)(z + j * ns) * zstride] : CF4{0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int j = 0; j < COMB_LOADS; ++j) {
                const float w = wsh[z + j * ns];
                acc[j].x += w * v[j].x, acc[j].y += w * v[j].y, acc[j].z += w * v[j].z, acc[j].w += w * v[j].w;
            }
        }
        for (; z < splits; z += ns) {
            const float w = wsh[z];
            if (w != 0.0f) {
                const CF4 v = src[(i64)z * zstride];
                acc[0].x += w * v.x, acc[0].y += w * v.y, acc[0].z += w * v.z, acc[0].w += w * v.w;
            }
        }
#pragma unroll
        for (int j = 1; j < COMB_LOADS; ++j)
            acc[0].x += acc[j].x, acc[0].y += acc[j].y, acc[0].z += acc[j].z, acc[0].w += acc[j].w;
        part4[s * cols + c] = acc[0];
    }
    __syncthreads();
    const bool live = d < D;  // (whole warps: D is a multiple of 32)
    float sum = 0.0f;
    if (live)
        for (int k = 0; k < ns; ++k) sum += part[k * D + d];
    float v = L > 0.0f ? sum / L : 0.0f;
    if constexpr (RG != 0) {
        // TQ3_0 V: the row is a weighted sum of rotated V rows; inverse-rotate it once per RG-value group
        // (x = D1 H D2 y / sqrt(g)), a shared-memory butterfly over the block's first D threads.
        static __shared__ float rot[COMB_THREADS];
        if (live) rot[d] = v * tq3_sign2(d % RG);
        __syncthreads();
        for (int h = 1; h < RG; h *= 2) {
            if (live && !(d & h)) {
                const float a = rot[d], b = rot[d + h];
                rot[d] = a + b;
                rot[d + h] = a - b;
            }
            __syncthreads();
        }
        if (live) v = rot[d] * tq3_sign1(d % RG) * tq3_rscale<RG>();
    }
    if (!live) return;
    if (gate != nullptr) v *= 1.0f / (1.0f + expf(-ld<TG>(gate, (i64)t * g_tok + (i64)head * g_head + d)));
    st<TO>(out, ((i64)t * H + head) * D + d, v);
    if (q16 != nullptr) {  // block-uniform: whole warps shuffle
        u32 word;
        float scale, gsum;
        xq::group16_lanes(h2f(f2h(v)), word, scale, gsum);
        const int k = head * D + d;
        xq::put_group16_lanes(q16, (H * D) >> 8, T, k >> 8, t, (k & 255) >> 4, k & 15, word, scale, gsum);
    }
}

// One decode token's attention layer in one launch (T = 1, a chain; attention.py `decode_attention`): a query head's
// q row and its KV head's new k row normed and rotated (head_norm.cuh: head_norm_kernel's bits), the new k and v rows
// stored into cache row S (store_row), and o = softmax(q K^T / sqrt(D)) V over rows 0..S on CUDA cores in f32 (one
// query row: nothing to fill an m16 tile with), times sigmoid(gate), written as f32 and, with q16, as the output
// projection's int16 staging (the bits attn_combine_kernel writes from the same values).
// Grid (NS, Hkv, G): block (z, kvh, h) serves query head kvh G + h with DEC_WARPS warps. It walks split z of the
// committed rows [0, S) (nse <= NS splits of at least DEC_MIN_TILES tiles; blocks past nse exit) in KT-row tiles
// through cp.async, two in flight (under PDL the first two are requested before the grid wait: no kernel of a step
// writes committed rows); split 0 also takes row S (its blocks all norm and quantize the new k and v; the h = 0 one
// stores them). Warp roles before the walk: 0 the q row, 1 the new k, 2 the new v, 3 the
// gate's sigmoid. Warp w then takes keys DEC_KPW w .. of each tile, lane l values [E l, E l + E) of every row
// (E = D / 32). The warps' (m, l, O) meet in warp 0; with nse > 1 it writes the block's partial to ws and the head's
// last block to arrive (counters[kvh G + h], self-resetting for the next launch) combines all nse in split order,
// whichever block that is. Shared memory (decode_smem_bytes): the tile stages, then the q row, the new k and v
// rows, sigmoid(gate) and the other warps' parked partials.
template <int KK, int KV, int D, int TI>
__global__ __launch_bounds__(128) void attn_decode_kernel(
    const void* __restrict__ q, i64 q_head, const void* __restrict__ gate, i64 g_head, const void* __restrict__ k,
    const void* __restrict__ v, i64 kv_head, const float* __restrict__ q_w, const float* __restrict__ k_w,
    const int* __restrict__ pos, const float* __restrict__ inv_freq, int n_rot, float eps, u8* __restrict__ kc,
    u8* __restrict__ vc, const int* __restrict__ s_len, i64 ctx, float scale_log2, float* __restrict__ ws_o,
    float* __restrict__ ws_ml, unsigned int* __restrict__ counters, float* __restrict__ out,
    uint4* __restrict__ q16) {
    using namespace ssa;
    using L = Layout<KK, KV, D>;
    constexpr int E = D / 32, NW = DEC_WARPS, KPW = KT / NW, PR = D + 2;  // PR: floats of a parked partial
    extern __shared__ uint4 ssa_smem[];
    u8* const stages = (u8*)ssa_smem;
    float* const qf = (float*)((u8*)ssa_smem + 2 * L::STAGE);
    float* const newk = qf + D;   // row S as stored (split 0)
    float* const newv = newk + D;
    float* const gsig = newv + D;  // sigmoid(gate) (1 without a gate)
    float* const park = gsig + D;  // warps 1..NW-1's (O, m, l)

    const int tid = (int)threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int z = (int)blockIdx.x, kvh = (int)blockIdx.y, h = (int)blockIdx.z;
    const int NS = (int)gridDim.x, G = (int)gridDim.z, H = G * (int)gridDim.y, head = kvh * G + h;
    const int S = s_len[0];
    // the splits that get rows: at least DEC_MIN_TILES tiles each (fewer partials to combine at short S)
    const int ntiles = (S + KT - 1) / KT, want = (ntiles + DEC_MIN_TILES - 1) / DEC_MIN_TILES;
    const int nse = want < 1 ? 1 : want < NS ? want : NS;
    if (z >= nse) return;  // (the whole block, before anything)
    const int per = (ntiles + nse - 1) / nse;
    const int tb = z * per, te = tb + per < ntiles ? tb + per : ntiles;
    const u8* kbase = kc + (i64)kvh * ctx * L::RBK;
    const u8* vbase = vc + (i64)kvh * ctx * L::RBV;
    const u32 stages_s = smem_s(stages);
    auto issue = [&](int tile, int stage) {
        u8* dk = stages + stage * L::STAGE;
        const u32 dk_s = stages_s + (u32)(stage * L::STAGE);
        const u8* ksrc = kbase + (i64)tile * L::TK;
        const u8* vsrc = vbase + (i64)tile * L::TV;
        const int nvalid = S - tile * KT;  // rows past S: zeros (row S is this launch's own)
#pragma unroll
        for (int i = 0; i < (L::STAGE / 16 + NW * 32 - 1) / (NW * 32); ++i) {
            const int c = tid + NW * 32 * i;
            if (c >= L::STAGE / 16) break;
            if (16 * c < L::TK)
                cp16(dk + 16 * c, dk_s + 16u * (u32)c, ksrc + 16 * c, 16 * c < nvalid * L::RBK);
            else {
                const int o = 16 * c - L::TK;
                cp16(dk + 16 * c, dk_s + 16u * (u32)c, vsrc + o, o < nvalid * L::RBV);
            }
        }
    };
    if (tb < te) issue(tb, 0);
    cp_commit();
    if (tb + 1 < te) issue(tb + 1, 1);
    cp_commit();
    SS_GRID_LAUNCH_DEPENDENTS();
    SS_GRID_WAIT();

    if (wid == 0 || (z == 0 && wid < 3)) {  // the q row; split 0: the new k and v rows, stored
        float x[E];
        const void* src = wid == 0 ? q : wid == 1 ? k : v;
        const i64 off = wid == 0 ? (i64)head * q_head : (i64)kvh * kv_head;
#pragma unroll
        for (int m = 0; m < E; ++m) x[m] = ld<TI>(src, off + lane + 32 * m);
        float* row = wid == 0 ? qf : wid == 1 ? newk : newv;
        if (wid < 2) {
            hn::rms_weight<D>(x, lane, wid == 0 ? q_w : k_w, eps);
            hn::rope<D>(x, lane, row, n_rot, n_rot > 0 ? (float)pos[0] : 0.0f, inv_freq);
        }
#pragma unroll
        for (int m = 0; m < E; ++m) row[lane + 32 * m] = x[m];
        if (wid > 0) {  // to this lane's E consecutive values, stored; the stored values stay for row S's turn
            __syncwarp();
#pragma unroll
            for (int j = 0; j < E; ++j) x[j] = row[lane * E + j];
            __syncwarp();
            const bool write = h == 0 && S < ctx;
            if (wid == 1)
                store_row<KK, D>(x, kc + ((i64)kvh * ctx + S) * L::RBK, lane, write);
            else
                store_row<KV, D>(x, vc + ((i64)kvh * ctx + S) * L::RBV, lane, write);
#pragma unroll
            for (int j = 0; j < E; ++j) row[lane * E + j] = x[j];
        }
    } else if (wid == 3) {
#pragma unroll
        for (int j = 0; j < E; ++j) {
            const int d = lane * E + j;
            gsig[d] = gate != nullptr ? 1.0f / (1.0f + expf(-ld<TI>(gate, (i64)head * g_head + d))) : 1.0f;
        }
    }
    __syncthreads();

    // this lane's q values, pre-scaled to log2 units (TQ3_0 K: rotated, as the keys are stored)
    float qr[E];
#pragma unroll
    for (int j = 0; j < E; ++j) qr[j] = qf[lane * E + j];
    if constexpr (KK == 2) tq3_rotate_lanes<D % 128 == 0 ? 128 : 64, E>(qr, lane);
#pragma unroll
    for (int j = 0; j < E; ++j) qr[j] *= scale_log2;
    float m_run = neg_inf(), l_run = 0.0f, o[E];
#pragma unroll
    for (int j = 0; j < E; ++j) o[j] = 0.0f;

    for (int t = tb; t < te; ++t) {
        cp_wait_prev();  // tile t has landed (the newest group may be t + 1's)
        __syncthreads();
        const u8* st = stages + ((t - tb) & 1) * L::STAGE;
        const int key0 = wid * KPW, n = S - t * KT - key0;  // this warp's keys of the tile that are rows < S
        if (n > 0) {
            float s[KPW];
#pragma unroll
            for (int i = 0; i < KPW; ++i) {
                float kx[E];
                row_values<KK, D>(st + (key0 + i) * L::RBK, lane, kx);
                float a = 0.0f;
#pragma unroll
                for (int j = 0; j < E; ++j) a += qr[j] * kx[j];
                s[i] = a;
            }
#pragma unroll
            for (int m = 16; m >= 1; m >>= 1) {
#pragma unroll
                for (int i = 0; i < KPW; ++i) s[i] += SS_SHFL_XOR(s[i], m);
            }
            float mx = m_run;
#pragma unroll
            for (int i = 0; i < KPW; ++i)
                if (i < n) mx = fmaxf(mx, s[i]);
            const float c = exp2f(m_run - mx);  // m_run = -inf: 0
            l_run *= c;
#pragma unroll
            for (int j = 0; j < E; ++j) o[j] *= c;
#pragma unroll
            for (int i = 0; i < KPW; ++i) {
                if (i >= n) continue;
                const float pw = exp2f(s[i] - mx);
                float vx[E];
                row_values<KV, D>(st + L::TK + (key0 + i) * L::RBV, lane, vx);
                l_run += pw;
#pragma unroll
                for (int j = 0; j < E; ++j) o[j] += pw * vx[j];
            }
            m_run = mx;
        }
        __syncthreads();  // every warp is done with the stage before it is refilled
        if (t + 2 < te) issue(t + 2, (t - tb) & 1);
        cp_commit();
    }
    if (z == 0 && wid == NW - 1) {  // row S: the values just stored
        float a = 0.0f;
#pragma unroll
        for (int j = 0; j < E; ++j) a += qr[j] * newk[lane * E + j];
#pragma unroll
        for (int m = 16; m >= 1; m >>= 1) a += SS_SHFL_XOR(a, m);
        const float mx = fmaxf(m_run, a), c = exp2f(m_run - mx), pw = exp2f(a - mx);
        l_run = l_run * c + pw;
#pragma unroll
        for (int j = 0; j < E; ++j) o[j] = o[j] * c + pw * newv[lane * E + j];
        m_run = mx;
    }

    // the warps' partials meet in warp 0 (warp order)
    if (wid > 0) {
        float* p = park + (wid - 1) * PR;
#pragma unroll
        for (int j = 0; j < E; ++j) p[lane * E + j] = o[j];
        if (lane == 0) {
            p[D] = m_run;
            p[D + 1] = l_run;
        }
    }
    cp_wait_all();
    __syncthreads();
    if (wid > 0) return;
    for (int w = 1; w < NW; ++w) {
        const float* p = park + (w - 1) * PR;
        const float m2 = p[D], l2 = p[D + 1];
        const float mm = fmaxf(m_run, m2);
        const float mu = mm == neg_inf() ? 0.0f : mm;
        const float a = exp2f(m_run - mu), b = exp2f(m2 - mu);
        l_run = l_run * a + l2 * b;
        m_run = mm;
#pragma unroll
        for (int j = 0; j < E; ++j) o[j] = o[j] * a + p[lane * E + j] * b;
    }
    if (nse > 1) {  // this block's partial to ws; the head's last block combines the nse of them in split order
        const i64 row = (i64)z * H + head;
#pragma unroll
        for (int j = 0; j < E; ++j) ws_o[row * D + lane * E + j] = o[j];
        if (lane == 0) {
            ws_ml[2 * row] = m_run;
            ws_ml[2 * row + 1] = l_run;
        }
        __threadfence();  // the partial is visible device-wide before this block's arrival is counted
        __syncwarp();     // (every lane's part of it)
        int is_last = 0;
        if (lane == 0) {
            const unsigned int ticket = atomicAdd(counters + head, 1u);
            __threadfence();  // (last block) the others' partials are read after their arrivals were seen
            is_last = ticket == (unsigned int)(nse - 1);
            if (is_last) counters[head] = 0u;  // every block has counted: ready for the next launch
        }
        if (!SS_SHFL(is_last, 0)) return;
        float mx = neg_inf();
        for (int zz = 0; zz < nse; ++zz) {
            const i64 r = (i64)zz * H + head;
            if (ld_cg(ws_ml + 2 * r + 1) > 0.0f) mx = fmaxf(mx, ld_cg(ws_ml + 2 * r));
        }
        l_run = 0.0f;
#pragma unroll
        for (int j = 0; j < E; ++j) o[j] = 0.0f;
        for (int zz = 0; zz < nse; ++zz) {
            const i64 r = (i64)zz * H + head;
            const float l = ld_cg(ws_ml + 2 * r + 1);
            if (!(l > 0.0f)) continue;
            const float w = exp2f(ld_cg(ws_ml + 2 * r) - mx);
            l_run += w * l;
#pragma unroll
            for (int j = 0; j < E; ++j) o[j] += w * ld_cg(ws_o + r * D + lane * E + j);
        }
    }
    float y[E];
#pragma unroll
    for (int j = 0; j < E; ++j) y[j] = l_run > 0.0f ? o[j] / l_run : 0.0f;
    if constexpr (KV == 2) {  // a weighted sum of rotated V rows: inverse-rotate it once
        constexpr int GR = D % 128 == 0 ? 128 : 64;
#pragma unroll
        for (int j = 0; j < E; ++j) y[j] *= tq3_sign2((lane * E + j) % GR);
        wht_lanes<GR, E>(y, lane);
#pragma unroll
        for (int j = 0; j < E; ++j) y[j] *= tq3_sign1((lane * E + j) % GR) * tq3_rscale<GR>();
    }
#pragma unroll
    for (int j = 0; j < E; ++j) {
        y[j] *= gsig[lane * E + j];
        out[(i64)head * D + lane * E + j] = y[j];
    }
    if (q16 == nullptr) return;
    if constexpr (E == 8) {  // lane l's 8 values are a unit of the staging, its group partner lane l ^ 1
        float f[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) f[j] = h2f(f2h(y[j]));
        const int k0 = head * D + 8 * lane;
        xq::put_unit8(q16, (H * D) >> 8, 1, k0 >> 8, 0, (k0 & 255) >> 3, f, true);
    } else {  // lane-strided again (a group's 16 values in 16 lanes), through the q row's buffer
#pragma unroll
        for (int j = 0; j < E; ++j) qf[lane * E + j] = y[j];
        __syncwarp();
#pragma unroll
        for (int m = 0; m < E; ++m) {
            u32 word;
            float scale, sum;
            xq::group16_lanes(h2f(f2h(qf[lane + 32 * m])), word, scale, sum);
            const int kk = head * D + lane + 32 * m;
            xq::put_group16_lanes(q16, (H * D) >> 8, 1, kk >> 8, 0, (kk & 255) >> 4, kk & 15, word, scale, sum);
        }
    }
}

// The KV half of a tree step's commit: the accepted path's rows move down to the committed positions in every
// cache buffer of the state in one launch. Entry i (i < count[0], read on the device, so one captured commit
// serves every path of a step's shape) moves row src[i] to row dst[i] of each head. Block (head, buffer):
// bases[buffer] its [heads][ctx][units] 4-byte units (every KV row type is a whole number of them). Rows move
// down the cache: dst rises by one per entry from the first row off the path's prefix and src[i] >= dst[i], so
// src[j] > dst[i] for every i < j: an entry never reads a row an earlier entry wrote. The block reads up to
// MOVE_ROWS entries into shared memory before writing them (an entry may overwrite a later chunk's row only
// after that row was read), so entries run in parallel rather than one dependent load after another.
constexpr int MOVE_ROWS = 32;
constexpr int MOVE_UNITS = 128;  // a 512-byte row: f16 at head_dim 256, the widest row type
__global__ void kv_move_rows_kernel(const u64* bases, const int* units, i64 ctx, const i64* dst, const i64* src,
                                    const int* count) {
    static __shared__ u32 rows[MOVE_ROWS * MOVE_UNITS];
    const int n = count[0], nu = units[blockIdx.y];
    u32* head = (u32*)bases[blockIdx.y] + (i64)blockIdx.x * ctx * nu;
    for (int e0 = 0; e0 < n; e0 += MOVE_ROWS) {
        const int m = n - e0 < MOVE_ROWS ? n - e0 : MOVE_ROWS;
        for (int idx = threadIdx.x; idx < m * nu; idx += blockDim.x)
            rows[idx] = head[src[e0 + idx / nu] * nu + idx % nu];
        __syncthreads();
        for (int idx = threadIdx.x; idx < m * nu; idx += blockDim.x) head[dst[e0 + idx / nu] * nu + idx % nu] = rows[idx];
        __syncthreads();
    }
}
