// Per-row argmax and top-k (k <= 8; 20 with a given token's value, for OpenAI logprobs) with log-softmax over a
// vocabulary of logits, for greedy verification, DDTree drafting and generated tokens' log-probabilities, and the
// exact sampled draw of one token per row. NumPy twins: np.argmax
// (services/engine/sampling.py: lowest id on ties), services/engine/ddtree.py topk_logprobs (best first, lower id
// on ties), and services/engine/sampling.py target_distribution + sample_from for the draw (design at the
// `sxs` namespace below).
//
// argmax / top-k: two passes each, no atomics, no host sync (graph-replayable): the partial kernel splits every
// row into gridDim.x chunks (one block of 256 threads each) and writes one candidate record per chunk; the final
// kernel merges a row's records.
//  * argmax: a record is a u64 key = order-preserving bits of the value << 32 | (2^32 - 1 - index), so
//    the u64 maximum is the largest value with the lowest index (NaN ranks above every number, like
//    np.argmax which returns the first NaN).
//  * top-k: a record is the chunk's max m, sum of exp(z - m) and its k best (z, index), z = logit *
//    inv_temp; the final kernel gives logZ = M + log(sum s * exp(m - M)) and logp = z - logZ.
// Element types: 0 = f32, 1 = f16, 2 = bf16. Includes no header; portable (no inline PTX needed).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;
typedef long long i64;

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__) || defined(__HIPCC_RTC__)
#define SS_HIP 1
#else
#define SS_HIP 0
#endif

#define SS_DEV static __device__ __forceinline__

#if SS_HIP
#define SS_SHFL_XOR(v, m) __shfl_xor((v), (m), 32)
#define SS_SHFL(v, s) __shfl((v), (s), 32)
#else
#define SS_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#define SS_SHFL(v, s) __shfl_sync(0xffffffffu, (v), (s))
#endif

namespace sss {

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;

SS_DEV float bits_f(u32 u) { return __uint_as_float(u); }

SS_DEV float h2f(u32 h) {  // exact binary16 -> binary32 (plain integer code: portable and cheap enough here)
    const u32 sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0) {
        const float v = (float)m * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (e == 31) return bits_f(sign | 0x7F800000u | (m << 13));
    return bits_f(sign | ((e + 112u) << 23) | (m << 13));
}

template <int TY>
SS_DEV float ld(const void* p, i64 i) {
    if constexpr (TY == 0) return ((const float*)p)[i];
    if constexpr (TY == 1) return h2f(((const u16*)p)[i]);
    if constexpr (TY == 2) return bits_f((u32)((const u16*)p)[i] << 16);
    return 0.0f;
}

SS_DEV u64 arg_key(float v, u32 idx) {
    u32 b = __float_as_uint(v);
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)b << 32) | (u64)(0xFFFFFFFFu - idx);
}

SS_DEV float key_value(u64 k) {
    const u32 b = (u32)(k >> 32);
    return bits_f((b & 0x80000000u) ? (b & 0x7FFFFFFFu) : ~b);
}

SS_DEV u64 umax(u64 a, u64 b) { return a > b ? a : b; }

SS_DEV float neg_inf() { return bits_f(0xFF800000u); }

// (v1, i1) ranks before (v2, i2): larger value, then lower index; index -1 (no candidate) ranks last.
SS_DEV bool better(float v1, int i1, float v2, int i2) {
    return v1 > v2 || (v1 == v2 && (u32)i1 < (u32)i2);
}

// Insert (v, i) into a best-first list of K.
template <int K>
SS_DEV void insert(float (&vals)[K], int (&ids)[K], float v, int i) {
    if (!better(v, i, vals[K - 1], ids[K - 1])) return;
    float cv = v;
    int ci = i;
#pragma unroll
    for (int j = 0; j < K; ++j) {
        if (better(cv, ci, vals[j], ids[j])) {
            const float tv = vals[j];
            const int ti = ids[j];
            vals[j] = cv;
            ids[j] = ci;
            cv = tv;
            ci = ti;
        }
    }
}

// Block-wide k best of the per-thread lists (all threads call; results valid in every thread).
template <int K>
SS_DEV void block_topk(float (&vals)[K], int (&ids)[K], float (&out_v)[K], int (&out_i)[K]) {
    static __shared__ float rv[2][WARPS];
    static __shared__ int ri[2][WARPS];
    const int lane = (int)(threadIdx.x & 31u), wid = (int)(threadIdx.x >> 5);
#pragma unroll
    for (int round = 0; round < K; ++round) {
        float v = vals[0];
        int i = ids[0];
        for (int m = 16; m >= 1; m >>= 1) {
            const float ov = SS_SHFL_XOR(v, m);
            const int oi = SS_SHFL_XOR(i, m);
            if (better(ov, oi, v, i)) {
                v = ov;
                i = oi;
            }
        }
        const int p = round & 1;  // double-buffered: one barrier per round
        if (lane == 0) {
            rv[p][wid] = v;
            ri[p][wid] = i;
        }
        __syncthreads();
        v = rv[p][0];
        i = ri[p][0];
        for (int w = 1; w < WARPS; ++w)
            if (better(rv[p][w], ri[p][w], v, i)) {
                v = rv[p][w];
                i = ri[p][w];
            }
        out_v[round] = v;
        out_i[round] = i;
        if (i >= 0 && ids[0] == i) {  // the owner pops its head (indices are unique within a row)
#pragma unroll
            for (int j = 0; j + 1 < K; ++j) {
                vals[j] = vals[j + 1];
                ids[j] = ids[j + 1];
            }
            vals[K - 1] = neg_inf();
            ids[K - 1] = -1;
        }
    }
}

// Block-wide merge of (max, sum of exp(z - max)) pairs.
SS_DEV void ms_merge(float& m, float& s, float m2, float s2) {
    const float mm = fmaxf(m, m2);
    if (mm == neg_inf()) return;
    s = s * expf(m - mm) + s2 * expf(m2 - mm);
    m = mm;
}

SS_DEV void block_ms(float& m, float& s) {
    static __shared__ float rm[WARPS], rs[WARPS];
    const int lane = (int)(threadIdx.x & 31u), wid = (int)(threadIdx.x >> 5);
    for (int k = 16; k >= 1; k >>= 1) {
        const float m2 = SS_SHFL_XOR(m, k), s2 = SS_SHFL_XOR(s, k);
        ms_merge(m, s, m2, s2);
    }
    if (lane == 0) {
        rm[wid] = m;
        rs[wid] = s;
    }
    __syncthreads();
    m = rm[0];
    s = rs[0];
    for (int w = 1; w < WARPS; ++w) ms_merge(m, s, rm[w], rs[w]);
    __syncthreads();  // rm / rs may be reused by a later call
}

}  // namespace sss

// grid (chunks, rows), block THREADS: part[row * chunks + c] = best key of chunk c of the row.
template <int TI>
__global__ __launch_bounds__(256) void argmax_partial_kernel(const void* __restrict__ x, i64 ld_x, int n, int chunk,
                                                             u64* __restrict__ part) {
    using namespace sss;
    static __shared__ u64 red[WARPS];
    const int row = (int)blockIdx.y, c = (int)blockIdx.x;
    const int lo = c * chunk, hi = lo + chunk < n ? lo + chunk : n;
    const i64 base = (i64)row * ld_x;
    u64 best = 0;
    for (int i = lo + (int)threadIdx.x; i < hi; i += THREADS) best = umax(best, arg_key(ld<TI>(x, base + i), (u32)i));
    for (int m = 16; m >= 1; m >>= 1) best = umax(best, SS_SHFL_XOR(best, m));
    if ((threadIdx.x & 31u) == 0) red[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < WARPS; ++w) best = umax(best, red[w]);
        part[(i64)row * gridDim.x + c] = best;
    }
}

// One warp per row: idx[row] (int32) and val[row] (the max logit, f32). next_tok non-null (a one-token chain step's
// logits): the next such step's values too, so that it runs with no upload (decode_ahead): its token (the last row's
// argmax), its committed length s_len[0] + 1 and position (the same), and the other half of the ping-pong DeltaNet
// state (*swap ^= 1; swap may be null).
__global__ __launch_bounds__(128) void argmax_final_kernel(const u64* __restrict__ part, int chunks, int rows,
                                                           int* __restrict__ idx, float* __restrict__ val,
                                                           int* __restrict__ next_tok, int* __restrict__ next_pos,
                                                           int* __restrict__ s_len, int* __restrict__ swap) {
    using namespace sss;
    const int row = (int)(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)), lane = (int)(threadIdx.x & 31u);
    if (row >= rows) return;
    u64 best = 0;
    for (int c = lane; c < chunks; c += 32) best = umax(best, part[(i64)row * chunks + c]);
    for (int m = 16; m >= 1; m >>= 1) best = umax(best, SS_SHFL_XOR(best, m));
    if (lane == 0) {
        const int id = (int)(0xFFFFFFFFu - (u32)(best & 0xFFFFFFFFull));
        idx[row] = id;
        val[row] = key_value(best);
        if (next_tok && row == rows - 1) {
            const int s = s_len[0] + 1;
            next_tok[0] = id;
            next_pos[0] = s;
            s_len[0] = s;
            if (swap) swap[0] ^= 1;
        }
    }
}

// grid (chunks, rows), block THREADS. Record of chunk c of a row (r = row * chunks + c):
//   ms[2r] = max z, ms[2r + 1] = sum exp(z - max); pv[K r + j], pi[K r + j] = its j-th best (z, index).
template <int TI, int K>
__global__ __launch_bounds__(256) void topk_partial_kernel(const void* __restrict__ x, i64 ld_x, int n, int chunk,
                                                           float inv_temp, float* __restrict__ ms,
                                                           float* __restrict__ pv, int* __restrict__ pi) {
    using namespace sss;
    const int row = (int)blockIdx.y, c = (int)blockIdx.x;
    const int lo = c * chunk, hi = lo + chunk < n ? lo + chunk : n;
    const i64 base = (i64)row * ld_x;
    float vals[K], bv[K];
    int ids[K], bi[K];
#pragma unroll
    for (int j = 0; j < K; ++j) {
        vals[j] = neg_inf();
        ids[j] = -1;
    }
    float m = neg_inf(), s = 0.0f;
    for (int i = lo + (int)threadIdx.x; i < hi; i += THREADS) {
        const float zv = ld<TI>(x, base + i) * inv_temp;
        if (zv > m) {
            s = s * expf(m - zv) + 1.0f;
            m = zv;
        } else {
            s += expf(zv - m);
        }
        insert<K>(vals, ids, zv, i);
    }
    block_ms(m, s);
    block_topk<K>(vals, ids, bv, bi);
    if (threadIdx.x == 0) {
        const i64 r = (i64)row * gridDim.x + c;
        ms[2 * r] = m;
        ms[2 * r + 1] = s;
#pragma unroll
        for (int j = 0; j < K; ++j) {
            pv[K * r + j] = bv[j];
            pi[K * r + j] = bi[j];
        }
    }
}

namespace sss {

// A row's merge of its chunks' records (all threads call): the row's K best (z, index) in every thread, and logZ.
template <int K>
SS_DEV float topk_merge(const float* __restrict__ ms, const float* __restrict__ pv, const int* __restrict__ pi,
                        int chunks, i64 r0, float (&bv)[K], int (&bi)[K]) {
    float vals[K];
    int ids[K];
#pragma unroll
    for (int j = 0; j < K; ++j) {
        vals[j] = neg_inf();
        ids[j] = -1;
    }
    float m = neg_inf(), s = 0.0f;
    for (int c = (int)threadIdx.x; c < chunks; c += THREADS) ms_merge(m, s, ms[2 * (r0 + c)], ms[2 * (r0 + c) + 1]);
    for (int e = (int)threadIdx.x; e < chunks * K; e += THREADS) {
        const int id = pi[K * r0 + e];
        if (id >= 0) insert<K>(vals, ids, pv[K * r0 + e], id);
    }
    block_ms(m, s);
    block_topk<K>(vals, ids, bv, bi);
    return m + logf(s);
}

// A row's K best as log-probabilities (thread 0 writes them).
template <int K>
SS_DEV void topk_store(int row, float logz, const float (&bv)[K], const int (&bi)[K], float* __restrict__ out_logp,
                       int* __restrict__ out_ids) {
#pragma unroll
    for (int j = 0; j < K; ++j) {
        out_logp[(i64)row * K + j] = bv[j] - logz;
        out_ids[(i64)row * K + j] = bi[j];
    }
}

}  // namespace sss

// grid rows, block THREADS: out_logp[row, j], out_ids[row, j] for j < K, best first.
template <int K>
__global__ __launch_bounds__(256) void topk_final_kernel(const float* __restrict__ ms, const float* __restrict__ pv,
                                                         const int* __restrict__ pi, int chunks,
                                                         float* __restrict__ out_logp, int* __restrict__ out_ids) {
    using namespace sss;
    const int row = (int)blockIdx.x;
    float bv[K];
    int bi[K];
    const float logz = topk_merge<K>(ms, pv, pi, chunks, (i64)row * chunks, bv, bi);
    if (threadIdx.x == 0) topk_store<K>(row, logz, bv, bi, out_logp, out_ids);
}

// topk_final_kernel and the log-probability of one given token a row (a generated token's OpenAI `logprobs`):
// out_tok[row] = x[row, tok[row]] * inv_temp - logZ, x the f32 rows the partial kernel read.
template <int K>
__global__ __launch_bounds__(256) void topk_token_final_kernel(const float* __restrict__ ms,
                                                               const float* __restrict__ pv,
                                                               const int* __restrict__ pi, int chunks,
                                                               float* __restrict__ out_logp,
                                                               int* __restrict__ out_ids, const float* __restrict__ x,
                                                               i64 ld_x, const int* __restrict__ tok, float inv_temp,
                                                               float* __restrict__ out_tok) {
    using namespace sss;
    const int row = (int)blockIdx.x;
    float bv[K];
    int bi[K];
    const float logz = topk_merge<K>(ms, pv, pi, chunks, (i64)row * chunks, bv, bi);
    if (threadIdx.x == 0) {
        topk_store<K>(row, logz, bv, bi, out_logp, out_ids);
        out_tok[row] = x[(i64)row * ld_x + tok[row]] * inv_temp - logz;
    }
}

// ============================================================================================================
// Exact sampled draw: one token per row from services/engine/sampling.py's target_distribution (penalties,
// temperature, top-k, top-p, min-p), by sample_from's inverse CDF in id order with a uniform u that the host drew
// from the request's generator. Rows of a batch are independent draws (grid.y or grid.x = drawn row).
//
// What is kept: the twin keeps, after the penalties, a prefix of the values ordered by (logit desc, id asc)
// (top-k: the k first; top-p: the shortest prefix whose renormalised mass reaches top_p, within what top-k
// kept; ties at either cut go to the lower ids), then min-p drops each value whose weight exp(z - zmax) is below
// min_p (z = logit / T). So a row's kept set is {key > thr} plus the `ties` lowest ids with key == thr (then
// the min-p test per value), key = order-preserving bits of the float32 logit; the selection finds (thr, ties).
//
// Launches (values in chunks of CHUNK, one 256-thread block each):
//  1. sample_prep_kernel: penalties (the row's window counted per chunk in shared memory; the twin's float64
//     formula, rounded to float32 into a scratch row), each chunk's max key and NaN flag; resets the row state.
//  2. sample_select_kernel<lane>(level), levels 0, 1, 2 of each active lane (top-k = 0, then top-p = 1): an MSD
//     radix select over the 32 key bits in digits of 11, 11 and 10 bits. Every block histograms its chunk's
//     values that match the prefix found so far (count and mass per digit) in shared memory and adds that to the
//     row's global histogram; the row's last block to arrive (ticket counter) scans the histogram from the top
//     for the digit holding the cut: the k-th value (counts), or the value where the mass before it first
//     reaches top_p * the mass (masses). Top-p after top-k histograms only values above the k cut, plus the k
//     cut's kept ties as one virtual entry. The last block leaves the histogram and counter zeroed.
//  3. sample_draw_sum_kernel: per chunk, the kept weight (float64) and the count of cut ties that pass min-p;
//     the row's last block walks the chunks in id order (cut ties kept in id order across chunks), takes
//     u * total and finds the chunk where the cumulative weight first exceeds it.
//  4. sample_draw_scan_kernel (one block per row) scans that chunk in id order: the first id whose cumulative
//     weight exceeds u * total (never one of zero weight; the last kept id if rounding leaves none), -1 for a
//     row the twin rejects (NaN, +inf, or no finite value: "no finite maximum"), -2 if a cut was not found.
// sample_probs_kernel (after 3) writes every value's kept weight: the device's distribution, for tests.
//
// Precision: weights w = exp(x / T - xmax / T) in float64, the twin's own expression (its probabilities are
// w / sum w). Selection masses are sums of w rounded to multiples of 2^-62 (w <= 1) held in 128-bit integers:
// exact whatever order blocks and atomics add them in, so every cut is deterministic. A top-p cut compares the
// float64 value of such a sum with top_p * the float64 total: the twin's decision except where the mass before a
// value is within ~1e-16 (relative) of top_p. The draw sums kept weights in float64 in a fixed order. Penalised
// logits are rounded to float32 (the twin keeps them in float64): a penalised value that rounds onto another
// logit ties with it (lower id first) where the twin orders the two by their float64 values.

namespace sxs {
using namespace sss;

constexpr int CHUNK = 4096;           // values per block of a full-row pass
constexpr int PER = CHUNK / THREADS;  // 16 consecutive values per thread where id order matters
constexpr int NB = 2048;              // digits of a radix level (11 bits; the last level uses 1024)
constexpr int RIN = 5;                // per drawn row: logits row, window part 1 (offset, length), part 2 (same)
constexpr double Q62 = 4611686018427387904.0;  // 2^62: the unit of selection masses (w = 1 is 2^62)
constexpr double TWO64 = 18446744073709551616.0;
constexpr u32 NONE = 0x7FFFFFFFu;

// Per drawn row, between launches (kernels/sampling.py STATE_BYTES >= sizeof).
struct RowState {
    u32 prefix[2];  // key bits fixed so far by the top-k (0) / top-p (1) select
    u32 thr[2];     // each lane's cut: the key of its last kept value ...
    u32 ties[2];    // ... and how many values with that key it keeps (the lowest ids)
    u32 chunk;      // draw: the chunk that holds the token
    u32 last;       // draw: u * total rounded to the very end: the chunk's last kept id
    u32 bad;        // a select found no digit (cannot happen with consistent sums): the host falls back
    u32 pad;
    u64 above;      // top-k: values ranked above the current prefix
    u64 mlo[2], mhi[2];  // mass ranked above the current prefix (128-bit, units of 2^-62; top-p only)
    u64 q_thr;      // top-k: the fixed-point weight of its cut value
    u64 tie_before; // draw: cut ties in the chunks before `chunk`
    double target;  // top-p: top_p * the mass it selects from
    double base;    // draw: cumulative weight before `chunk`
    double uval;    // draw: u * the total kept weight
};

struct Mass {
    u64 lo, hi;
};

SS_DEV void madd(Mass& a, u64 q) {
    a.lo += q;
    a.hi += a.lo < q ? 1ull : 0ull;
}

SS_DEV void madd(Mass& a, Mass b) {
    a.lo += b.lo;
    a.hi += b.hi + (a.lo < b.lo ? 1ull : 0ull);
}

SS_DEV Mass mmul(u64 q, u32 n) {  // q * n for q < 2^63
    const u64 l = (q & 0xFFFFFFFFull) * n, h = (q >> 32) * n;
    Mass m;
    m.lo = l + (h << 32);
    m.hi = (h >> 32) + (m.lo < l ? 1ull : 0ull);
    return m;
}

SS_DEV double mdouble(Mass a) { return (double)a.hi * TWO64 + (double)a.lo; }  // monotone in a

SS_DEV u32 okey(float v) {  // order-preserving: larger float, larger key; -0 is +0 (equal to the twin)
    u32 b = __float_as_uint(v);
    if (b == 0x80000000u) b = 0u;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

SS_DEV float kfloat(u32 k) { return bits_f((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k); }

SS_DEV double weight(float v, double temp, double zmax) { return exp((double)v / temp - zmax); }

SS_DEV u64 quant(double w) {
#if defined(__CUDA_ARCH__)
    return __double2ull_rn(w * Q62);
#else
    return (u64)llrint(w * Q62);
#endif
}

SS_DEV double mul_rn(double a, double b) {  // never fused into an add: the twin rounds the product first
#if defined(__CUDA_ARCH__)
    return __dmul_rn(a, b);
#else
    return a * b;
#endif
}

// A value another block of this launch wrote (before its __threadfence): read at L2, never a stale L1 line.
template <class T>
SS_DEV T ldcg(const T* p) {
#if defined(__CUDA_ARCH__) && !SS_HIP
    return __ldcg(p);
#else
    return *(const volatile T*)p;
#endif
}

// Block-wide max (MAX) or sum of v, the same value in every thread: a butterfly within each warp (every lane ends
// with the same, order-fixed value), then the warps' values combined in warp order, so a float sum is deterministic.
template <bool MAX, typename T>
SS_DEV T block_reduce(T v) {
    static __shared__ T red[WARPS];
    for (int m = 16; m >= 1; m >>= 1) {
        const T o = SS_SHFL_XOR(v, m);
        v = MAX ? (o > v ? o : v) : v + o;
    }
    if ((threadIdx.x & 31u) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = red[0];
    for (int w = 1; w < WARPS; ++w) v = MAX ? (red[w] > v ? red[w] : v) : v + red[w];
    __syncthreads();
    return v;
}

SS_DEV u32 block_max_u32(u32 v) { return block_reduce<true>(v); }
SS_DEV u32 block_sum_u32(u32 v) { return block_reduce<false>(v); }
SS_DEV double block_sum_d(double v) { return block_reduce<false>(v); }

// Exclusive scans in thread order (fixed order of adds); `total`: the block's sum, in every thread.
SS_DEV u32 block_excl_u32(u32 v, u32& total) {
    static __shared__ u32 ws[WARPS];
    const int lane = (int)(threadIdx.x & 31u), wid = (int)(threadIdx.x >> 5);
    u32 x = v;
    for (int d = 1; d < 32; d <<= 1) {
        const u32 y = SS_SHFL(x, lane >= d ? lane - d : lane);
        if (lane >= d) x += y;
    }
    u32 ex = SS_SHFL(x, lane > 0 ? lane - 1 : 0);
    if (lane == 0) ex = 0u;
    if (lane == 31) ws[wid] = x;
    __syncthreads();
    u32 off = 0u, tot = 0u;
    for (int w = 0; w < WARPS; ++w) {
        if (w < wid) off += ws[w];
        tot += ws[w];
    }
    __syncthreads();
    total = tot;
    return off + ex;
}

SS_DEV double block_excl_d(double v, double& total) {
    static __shared__ double ws[WARPS];
    const int lane = (int)(threadIdx.x & 31u), wid = (int)(threadIdx.x >> 5);
    double x = v;
    for (int d = 1; d < 32; d <<= 1) {
        const double y = SS_SHFL(x, lane >= d ? lane - d : lane);
        if (lane >= d) x += y;
    }
    double ex = SS_SHFL(x, lane > 0 ? lane - 1 : 0);
    if (lane == 0) ex = 0.0;
    if (lane == 31) ws[wid] = x;
    __syncthreads();
    double off = 0.0, tot = 0.0;
    for (int w = 0; w < WARPS; ++w) {
        if (w < wid) off += ws[w];
        tot += ws[w];
    }
    __syncthreads();
    total = tot;
    return off + ex;
}

SS_DEV Mass shfl_mass(Mass m, int src) {
    Mass r;
    r.lo = SS_SHFL(m.lo, src);
    r.hi = SS_SHFL(m.hi, src);
    return r;
}

SS_DEV Mass block_excl_mass(Mass v, Mass& total) {
    static __shared__ u64 wlo[WARPS], whi[WARPS];
    const int lane = (int)(threadIdx.x & 31u), wid = (int)(threadIdx.x >> 5);
    Mass x = v;
    for (int d = 1; d < 32; d <<= 1) {
        const Mass y = shfl_mass(x, lane >= d ? lane - d : lane);
        if (lane >= d) madd(x, y);
    }
    Mass ex = shfl_mass(x, lane > 0 ? lane - 1 : 0);
    if (lane == 0) ex.lo = ex.hi = 0ull;
    if (lane == 31) {
        wlo[wid] = x.lo;
        whi[wid] = x.hi;
    }
    __syncthreads();
    Mass off = {0ull, 0ull}, tot = {0ull, 0ull};
    for (int w = 0; w < WARPS; ++w) {
        const Mass mw = {wlo[w], whi[w]};
        if (w < wid) madd(off, mw);
        madd(tot, mw);
    }
    __syncthreads();
    total = tot;
    madd(off, ex);
    return off;
}

// The row's largest value and whether the twin can sample the row at all (no NaN, and a finite maximum also
// after the temperature), from sample_prep_kernel's records `pm` (nch max keys, then nch NaN flags).
SS_DEV bool row_max(const u32* pm, int nch, double temp, double& zmax) {
    u32 m = 0u, nan = 0u;
    for (int c = (int)threadIdx.x; c < nch; c += THREADS) {
        m = pm[c] > m ? pm[c] : m;
        nan |= pm[nch + c];
    }
    m = block_max_u32(m);
    nan = block_max_u32(nan);
    zmax = (double)kfloat(m) / temp;
    return nan == 0u && m != 0u && zmax - zmax == 0.0;
}

// Every block of a row counts itself in; true in the row's last block (which then sees the others' writes).
SS_DEV bool arrive_last(u32* counter, int& flag) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 ticket = atomicAdd(counter, 1u);
        __threadfence();
        flag = ticket == gridDim.x - 1u;
    }
    __syncthreads();
    return flag != 0;
}

// The twin's apply_penalties for a value (its logit bias already added, in float64) seen c times in the window, in
// float64; the caller rounds the result to float32.
SS_DEV double penalize(double v, u32 c, double rp, double fp, double pp) {
    if (rp != 1.0) v = v > 0.0 ? v / rp : mul_rn(v, rp);
    v = v - mul_rn((double)c, fp);
    return v - pp;
}

// Kept weight of the values i0 .. i0 + PER - 1 (this thread's), before the cut's tie quota: w[j] (0 if not kept),
// bit j of the result set for a value equal to the cut (kept only within the quota).
SS_DEV u32 chunk_weights(const float* zr, int i0, int n, bool cut, u32 thr, double temp, double zmax, double min_p,
                         double (&w)[PER]) {
    u32 tie = 0u;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        w[j] = 0.0;
        const int i = i0 + j;
        if (i >= n) continue;
        const float v = zr[i];
        const u32 key = okey(v);
        if (cut && key < thr) continue;
        const double wj = weight(v, temp, zmax);
        if (wj < min_p) continue;
        w[j] = wj;
        if (cut && key == thr) tie |= 1u << j;
    }
    return tie;
}

// Drops the cut ties past the quota: ties before this thread's first value are `rank`, `keep` are kept in all.
SS_DEV void tie_quota(u32 tie, u64 rank, u64 keep, double (&w)[PER]) {
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        if (!(tie & (1u << j))) continue;
        if (rank >= keep) w[j] = 0.0;
        ++rank;
    }
}

SS_DEV int popc(u32 v) {
    int c = 0;
    for (; v; v &= v - 1u) ++c;
    return c;
}

}  // namespace sxs

// grid (chunks, rows). rin[RIN r ..]: the row's logits row, then its penalty window as two runs of tok (offset,
// length each). zs (null: neither penalties nor a bias): the penalised row, float32, row r at zs + r * ldz.
// bias_ids / bias_vals: the request's logit bias, n_bias (token id, value) pairs with distinct ids (every row's),
// added in float64 before the penalties, as the twin does. pm[r][0 .. 2 nch): each chunk's max key, then its NaN
// flag.
__global__ __launch_bounds__(256) void sample_prep_kernel(const float* __restrict__ x, i64 ldx,
                                                          const int* __restrict__ rin, int n,
                                                          const int* __restrict__ tok, double rp, double fp,
                                                          double pp, float* __restrict__ zs, i64 ldz,
                                                          u32* __restrict__ pm, sxs::RowState* __restrict__ st,
                                                          const int* __restrict__ bias_ids,
                                                          const double* __restrict__ bias_vals, int n_bias) {
    using namespace sxs;
    static __shared__ u32 cnt[CHUNK];
    static __shared__ unsigned short bix[CHUNK];  // 1 + the bias entry of each value of the chunk (0: none)
    const int r = (int)blockIdx.y, c = (int)blockIdx.x, nch = (int)gridDim.x, t = (int)threadIdx.x;
    const int lo = c * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
    const int* ri = rin + RIN * r;
    const float* xr = x + (i64)ri[0] * ldx;
    const bool pen = zs != nullptr;
    if (pen) {
        for (int j = t; j < CHUNK; j += THREADS) {
            cnt[j] = 0u;
            bix[j] = 0;
        }
        __syncthreads();
        for (int j = t; j < n_bias; j += THREADS) {
            const int id = bias_ids[j];
            if (id >= lo && id < hi) bix[id - lo] = (unsigned short)(j + 1);
        }
        for (int part = 0; part < 2; ++part) {
            const int off = ri[1 + 2 * part], len = ri[2 + 2 * part];
            for (int j = t; j < len; j += THREADS) {
                const int id = tok[off + j];
                if (id >= lo && id < hi) atomicAdd(&cnt[id - lo], 1u);
            }
        }
        __syncthreads();
    }
    u32 m = 0u, nan = 0u;
    for (int i = lo + t; i < hi; i += THREADS) {
        float v = xr[i];
        if (pen) {
            const u32 k = cnt[i - lo];
            const int b = bix[i - lo];
            if (k != 0u || b != 0) {
                double d = (double)v;
                if (b != 0) d += bias_vals[b - 1];
                v = (float)(k != 0u ? penalize(d, k, rp, fp, pp) : d);
            }
            zs[(i64)r * ldz + i] = v;
        }
        if (v != v) {
            nan = 1u;
        } else {
            const u32 key = okey(v);
            m = key > m ? key : m;
        }
    }
    m = block_max_u32(m);
    nan = block_max_u32(nan);
    if (t == 0) {
        pm[(i64)r * 2 * nch + c] = m;
        pm[(i64)r * 2 * nch + nch + c] = nan;
        if (c == 0) {
            const RowState fresh = {};
            st[r] = fresh;
        }
    }
}

// grid (chunks, rows); LANE 0 = top-k, 1 = top-p; level 0, 1, 2. z: the (penalised) values, row r at
// z + (zsel ? rin[RIN r] : r) * ldz. hcnt / hlo / hhi [rows][NB], counters [rows]: zero before and after.
template <int LANE>
__global__ __launch_bounds__(256) void sample_select_kernel(const float* __restrict__ z, i64 ldz, int zsel,
                                                            const int* __restrict__ rin, int n, int level,
                                                            double temp, int top_k, double top_p,
                                                            const u32* __restrict__ pm, sxs::RowState* st, u32* hcnt,
                                                            u64* hlo, u64* hhi, u32* counters) {
    using namespace sxs;
    static __shared__ u32 s_cnt[NB];
    static __shared__ u64 s_lo[NB];
    static __shared__ u32 s_hi[NB];
    static __shared__ int s_last, f_b;
    static __shared__ u32 f_bc, f_cnt;
    static __shared__ u64 f_lo, f_hi;
    const int r = (int)blockIdx.y, c = (int)blockIdx.x, nch = (int)gridDim.x, t = (int)threadIdx.x;
    const float* zr = z + (i64)(zsel ? rin[RIN * r] : r) * ldz;
    double zmax;
    const bool ok = row_max(pm + (i64)r * 2 * nch, nch, temp, zmax);
    const int shift = level == 0 ? 21 : (level == 1 ? 10 : 0), bits = level == 2 ? 10 : 11;
    const u32 bmask = (1u << bits) - 1u;
    const u32 him = level == 0 ? 0u : ~((1u << (shift + bits)) - 1u);  // the key bits fixed by earlier levels
    RowState* s = st + r;
    const u32 P = s->prefix[LANE];
    const bool after_k = LANE == 1 && top_k > 0;
    const u32 tk = after_k ? s->thr[0] : 0u;
    const bool mass = LANE == 1;  // top-k needs only counts (top-p after it histograms its own masses)
    for (int b = t; b < NB; b += THREADS) {
        s_cnt[b] = 0u;
        s_lo[b] = 0ull;
        s_hi[b] = 0u;
    }
    __syncthreads();
    if (ok) {
        const int lo = c * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
        for (int i = lo + t; i < hi; i += THREADS) {
            const float v = zr[i];
            const u32 key = okey(v);
            if (((key ^ P) & him) != 0u || (after_k && key <= tk)) continue;
            const u32 b = (key >> shift) & bmask;
            atomicAdd(&s_cnt[b], 1u);
            if (mass) {
                const u64 q = quant(weight(v, temp, zmax));
                const u64 old = atomicAdd(&s_lo[b], q);
                if (old + q < old) atomicAdd(&s_hi[b], 1u);
            }
        }
    }
    __syncthreads();
    u32* gc = hcnt + (i64)r * NB;
    u64* gl = hlo + (i64)r * NB;
    u64* gh = hhi + (i64)r * NB;
    for (int b = t; b < NB; b += THREADS) {
        const u32 k = s_cnt[b];
        if (k == 0u) continue;
        atomicAdd(&gc[b], k);
        const u64 q = s_lo[b];
        const u64 old = atomicAdd(&gl[b], q);
        const u64 carry = (u64)s_hi[b] + (old + q < old ? 1ull : 0ull);
        if (carry != 0ull) atomicAdd(&gh[b], carry);
    }
    if (!arrive_last(counters + r, s_last)) return;

    if (ok) {
        // the row's histogram, digits from the top: thread t owns `per` consecutive ones
        const int nb = (int)bmask + 1, per = nb / THREADS;
        const bool virt = after_k && ((tk ^ P) & him) == 0u;  // top-k's kept cut ties: one entry at their digit
        const u32 vb = (tk >> shift) & bmask, vties = after_k ? s->ties[0] : 0u;
        const u64 vq = after_k ? s->q_thr : 0ull;
        u32 cn[8];
        Mass ms[8];
        u32 tc = 0u;
        Mass tm = {0ull, 0ull};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            cn[j] = 0u;
            ms[j].lo = ms[j].hi = 0ull;
            if (j >= per) continue;
            const int b = nb - 1 - (per * t + j);
            cn[j] = ldcg(gc + b);
            ms[j].lo = ldcg(gl + b);
            ms[j].hi = ldcg(gh + b);
            if (virt && (u32)b == vb) {
                cn[j] += vties;
                madd(ms[j], mmul(vq, vties));
            }
            tc += cn[j];
            madd(tm, ms[j]);
        }
        u32 totc;
        Mass totm;
        u32 bc = block_excl_u32(tc, totc);
        Mass bm = block_excl_mass(tm, totm);
        const double target = LANE == 1 ? (level == 0 ? top_p * mdouble(totm) : s->target) : 0.0;
        const u64 krem = LANE == 0 ? (u64)top_k - s->above : 0ull;  // values of the cut's rank still to place
        const Mass above = {s->mlo[LANE], s->mhi[LANE]};
        if (t == 0) f_b = -1;
        __syncthreads();
        for (int j = 0; j < per; ++j) {
            bool hit;
            if (LANE == 0) {
                hit = (u64)bc < krem && krem <= (u64)bc + cn[j];
            } else {
                Mass x = above;
                madd(x, bm);
                Mass y = x;
                madd(y, ms[j]);
                hit = mdouble(x) < target && mdouble(y) >= target;
            }
            if (hit) {
                f_b = nb - 1 - (per * t + j);
                f_bc = bc;
                f_cnt = cn[j];
                f_lo = bm.lo;
                f_hi = bm.hi;
            }
            bc += cn[j];
            madd(bm, ms[j]);
        }
        __syncthreads();
        if (t == 0) {
            if (f_b < 0) {
                s->bad = 1u;
            } else {
                const u32 pre = P | ((u32)f_b << shift);
                Mass a = above;
                const Mass before = {f_lo, f_hi};
                madd(a, before);
                s->prefix[LANE] = pre;
                s->mlo[LANE] = a.lo;
                s->mhi[LANE] = a.hi;
                if (LANE == 0) s->above += f_bc;
                if (LANE == 1 && level == 0) s->target = target;
                if (level == 2) {  // the digit is the whole key: the cut value; count its kept ties
                    const u64 q = quant(weight(kfloat(pre), temp, zmax));
                    s->thr[LANE] = pre;
                    if (LANE == 0) {
                        s->ties[0] = (u32)(krem - f_bc);
                        s->q_thr = q;
                    } else {  // the i-th tie is kept while the mass before it is below the target
                        u32 lo = 1u, hi = f_cnt;
                        while (lo < hi) {
                            const u32 mid = lo + (hi - lo) / 2u;
                            Mass x = a;
                            madd(x, mmul(q, mid));
                            if (mdouble(x) >= target) hi = mid;
                            else lo = mid + 1u;
                        }
                        s->ties[1] = lo;
                    }
                }
            }
        }
        __syncthreads();
    }
    for (int b = t; b < NB; b += THREADS) {
        gc[b] = 0u;
        gl[b] = 0ull;
        gh[b] = 0ull;
    }
    if (t == 0) counters[r] = 0u;
}

// grid (chunks, rows). lane: the cut the draw applies (0 none, 1 top-k's, 2 top-p's). rmass / rties [rows][nch]:
// per chunk the kept weight besides the cut's ties, and those ties. us [rows]: the uniform of each draw.
__global__ __launch_bounds__(256) void sample_draw_sum_kernel(const float* __restrict__ z, i64 ldz, int zsel,
                                                              const int* __restrict__ rin, int n, double temp,
                                                              int lane, double min_p, const double* __restrict__ us,
                                                              const u32* __restrict__ pm, sxs::RowState* st,
                                                              double* rmass, u32* rties, u32* counters) {
    using namespace sxs;
    static __shared__ int s_last;
    static __shared__ double tile_m[THREADS];
    static __shared__ u32 tile_t[THREADS];
    const int r = (int)blockIdx.y, c = (int)blockIdx.x, nch = (int)gridDim.x, t = (int)threadIdx.x;
    const float* zr = z + (i64)(zsel ? rin[RIN * r] : r) * ldz;
    double zmax;
    const bool ok = row_max(pm + (i64)r * 2 * nch, nch, temp, zmax);
    RowState* s = st + r;
    const bool cut = lane > 0;
    const u32 thr = cut ? s->thr[lane - 1] : 0u;
    double sum = 0.0;
    u32 nt = 0u;
    if (ok) {
        double w[PER];
        const u32 tie = chunk_weights(zr, c * CHUNK + t * PER, n, cut, thr, temp, zmax, min_p, w);
#pragma unroll
        for (int j = 0; j < PER; ++j)
            if (!(tie & (1u << j))) sum += w[j];
        nt = (u32)popc(tie);
    }
    sum = block_sum_d(sum);
    nt = block_sum_u32(nt);
    if (t == 0) {
        rmass[(i64)r * nch + c] = sum;
        rties[(i64)r * nch + c] = nt;
    }
    if (!arrive_last(counters + r, s_last)) return;

    if (ok) {
        // thread 0 walks the chunks in id order (records come in a tile at a time): the total, then the chunk
        const u64 keep = cut ? s->ties[lane - 1] : 0ull;
        const double wt = cut ? weight(kfloat(thr), temp, zmax) : 0.0;
        double cum = 0.0, total = 0.0, uval = 0.0, lbase = 0.0;
        u64 tb = 0ull, lties = 0ull;
        int found = -1, lastc = -1;
        for (int pass = 0; pass < 2; ++pass) {
            cum = 0.0;
            tb = 0ull;
            for (int c0 = 0; c0 < nch; c0 += THREADS) {
                if (c0 + t < nch) {
                    tile_m[t] = ldcg(rmass + (i64)r * nch + c0 + t);
                    tile_t[t] = ldcg(rties + (i64)r * nch + c0 + t);
                }
                __syncthreads();
                if (t == 0) {
                    for (int k = 0; k < THREADS && c0 + k < nch; ++k) {
                        const u64 kept = tb >= keep ? 0ull : (keep - tb < tile_t[k] ? keep - tb : tile_t[k]);
                        const double m = tile_m[k] + mul_rn((double)kept, wt);
                        const double next = cum + m;
                        if (pass == 1 && found < 0) {
                            if (next > uval) {
                                found = c0 + k;
                                lbase = cum;
                                lties = tb;
                            } else if (m > 0.0) {
                                lastc = c0 + k;
                                lbase = cum;
                                lties = tb;
                            }
                        }
                        cum = next;
                        tb += tile_t[k];
                    }
                }
                __syncthreads();
            }
            if (t == 0 && pass == 0) {
                total = cum;
                uval = us[r] * total;
            }
        }
        if (t == 0) {
            s->chunk = (u32)(found >= 0 ? found : lastc);
            s->last = found >= 0 ? 0u : 1u;
            s->base = lbase;
            s->tie_before = lties;
            s->uval = uval;
        }
    }
    if (t == 0) counters[r] = 0u;
}

// grid (rows): out[r] = the drawn token (see the section's comment for -1 / -2).
__global__ __launch_bounds__(256) void sample_draw_scan_kernel(const float* __restrict__ z, i64 ldz, int zsel,
                                                               const int* __restrict__ rin, int n, double temp,
                                                               int lane, double min_p, const u32* __restrict__ pm,
                                                               const sxs::RowState* __restrict__ st,
                                                               int* __restrict__ out) {
    using namespace sxs;
    const int r = (int)blockIdx.x, t = (int)threadIdx.x, nch = (n + CHUNK - 1) / CHUNK;
    const float* zr = z + (i64)(zsel ? rin[RIN * r] : r) * ldz;
    double zmax;
    const bool ok = row_max(pm + (i64)r * 2 * nch, nch, temp, zmax);
    const RowState* s = st + r;
    if (!ok || s->bad) {
        if (t == 0) out[r] = ok ? -2 : -1;
        return;
    }
    const bool cut = lane > 0;
    const u32 thr = cut ? s->thr[lane - 1] : 0u;
    const int i0 = (int)s->chunk * CHUNK + t * PER;
    double w[PER];
    const u32 tie = chunk_weights(zr, i0, n, cut, thr, temp, zmax, min_p, w);
    u32 ntot;
    const u32 tex = block_excl_u32((u32)popc(tie), ntot);
    tie_quota(tie, s->tie_before + tex, cut ? s->ties[lane - 1] : 0u, w);
    double sum = 0.0;
#pragma unroll
    for (int j = 0; j < PER; ++j) sum += w[j];
    double tot;
    double run = s->base + block_excl_d(sum, tot);
    const double uval = s->uval;
    u32 cand = NONE;
    int lastk = -1;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        if (!(w[j] > 0.0)) continue;
        lastk = i0 + j;
        if (cand == NONE) {
            run += w[j];
            if (run > uval) cand = (u32)(i0 + j);
        }
    }
    cand = ~block_max_u32(~cand);
    lastk = (int)block_max_u32((u32)(lastk + 1)) - 1;
    if (t == 0) out[r] = (s->last || cand == NONE) ? (lastk >= 0 ? lastk : -2) : (int)cand;
}

// grid (chunks, rows), after sample_draw_sum_kernel: out[r * ldo + i] = value i's kept weight (0 when dropped;
// NaN for a row the twin rejects). Divided by the row's sum: the twin's target_distribution.
__global__ __launch_bounds__(256) void sample_probs_kernel(const float* __restrict__ z, i64 ldz, int zsel,
                                                           const int* __restrict__ rin, int n, double temp, int lane,
                                                           double min_p, const u32* __restrict__ pm,
                                                           const sxs::RowState* __restrict__ st,
                                                           const u32* __restrict__ rties, double* __restrict__ out,
                                                           i64 ldo) {
    using namespace sxs;
    const int r = (int)blockIdx.y, c = (int)blockIdx.x, nch = (int)gridDim.x, t = (int)threadIdx.x;
    const float* zr = z + (i64)(zsel ? rin[RIN * r] : r) * ldz;
    double* o = out + (i64)r * ldo;
    double zmax;
    const bool ok = row_max(pm + (i64)r * 2 * nch, nch, temp, zmax);
    const int i0 = c * CHUNK + t * PER;
    if (!ok) {
        for (int j = 0; j < PER; ++j)
            if (i0 + j < n) o[i0 + j] = (double)bits_f(0x7FC00000u);
        return;
    }
    const RowState* s = st + r;
    const bool cut = lane > 0;
    const u32 thr = cut ? s->thr[lane - 1] : 0u;
    u32 before = 0u;
    for (int k = t; k < c; k += THREADS) before += rties[(i64)r * nch + k];
    before = block_sum_u32(before);
    double w[PER];
    const u32 tie = chunk_weights(zr, i0, n, cut, thr, temp, zmax, min_p, w);
    u32 ntot;
    const u32 tex = block_excl_u32((u32)popc(tie), ntot);
    tie_quota(tie, (u64)before + tex, cut ? s->ties[lane - 1] : 0u, w);
    for (int j = 0; j < PER; ++j)
        if (i0 + j < n) o[i0 + j] = w[j];
}
