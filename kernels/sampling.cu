// Per-row argmax and top-k (k <= 8) with log-softmax over a vocabulary of logits, for greedy verification
// and DDTree drafting. NumPy twins: np.argmax (services/engine/sampling.py: lowest id on ties) and
// services/engine/ddtree.py topk_logprobs (best first, lower id on ties).
//
// Two passes each, no atomics, no host sync (graph-replayable): the partial kernel splits every row into
// gridDim.x chunks (one block of 256 threads each) and writes one candidate record per chunk; the final
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
#else
#define SS_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
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

// One warp per row: idx[row] (int32) and val[row] (the max logit, f32).
__global__ __launch_bounds__(128) void argmax_final_kernel(const u64* __restrict__ part, int chunks, int rows,
                                                           int* __restrict__ idx, float* __restrict__ val) {
    using namespace sss;
    const int row = (int)(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)), lane = (int)(threadIdx.x & 31u);
    if (row >= rows) return;
    u64 best = 0;
    for (int c = lane; c < chunks; c += 32) best = umax(best, part[(i64)row * chunks + c]);
    for (int m = 16; m >= 1; m >>= 1) best = umax(best, SS_SHFL_XOR(best, m));
    if (lane == 0) {
        idx[row] = (int)(0xFFFFFFFFu - (u32)(best & 0xFFFFFFFFull));
        val[row] = key_value(best);
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

// grid rows, block THREADS: out_logp[row, j], out_ids[row, j] for j < K, best first.
template <int K>
__global__ __launch_bounds__(256) void topk_final_kernel(const float* __restrict__ ms, const float* __restrict__ pv,
                                                         const int* __restrict__ pi, int chunks,
                                                         float* __restrict__ out_logp, int* __restrict__ out_ids) {
    using namespace sss;
    const int row = (int)blockIdx.x;
    const i64 r0 = (i64)row * chunks;
    float vals[K], bv[K];
    int ids[K], bi[K];
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
    if (threadIdx.x == 0) {
        const float logz = m + logf(s);
#pragma unroll
        for (int j = 0; j < K; ++j) {
            out_logp[(i64)row * K + j] = bv[j] - logz;
            out_ids[(i64)row * K + j] = bi[j];
        }
    }
}
