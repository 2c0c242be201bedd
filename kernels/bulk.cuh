// Shared-memory addresses, mbarriers and bulk copies (sm_90: cp.async.bulk global -> shared, completing on an
// mbarrier), shared by the v2 / wide product kernels (quant_matmul.cu) and the gemv ring kernel (quant_gemv.cu). The
// includer defines SS_PTX first (1: inline PTX allowed); SS_BULK = 1 where the bulk copies (and thread block
// clusters) exist, else the kernels take their portable paths. kernels/loader.py pastes this file in place of its
// #include.
#ifndef SPECSPLIT_BULK_CUH
#define SPECSPLIT_BULK_CUH

#if SS_PTX && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define SS_BULK 1
#define SS_SIM_BULK 0
#elif defined(SPECSPLIT_SIM_BULK) && !defined(__CUDACC__) && !defined(__HIPCC__) && !defined(__HIPCC_RTC__)
// The CPU simulation of the bulk path (tests/cuda_sim_wide.cpp built with -DSPECSPLIT_SIM_BULK): the functions below
// in plain C++ on the harness's fibers, so the CPU tests run the sm_90 path's protocol (producer warp, mbarrier
// phases and transaction counts, bulk reduce-adds) and not only the portable one. Copies complete when issued.
#define SS_BULK 1
#define SS_SIM_BULK 1
#include <cstring>
#include <vector>
#else
#define SS_BULK 0
#define SS_SIM_BULK 0
#endif

namespace bk {

#if SS_SIM_BULK
// the running block's dynamic shared memory (the harness defines it: each resident block has its own)
char* sim_smem_base();
// set when a simulated mbarrier wait gave up (a protocol that never completes the phase) or a kernel reached what is
// not simulated (clusters): the harness reports it as a simulation error
extern int sim_bulk_error;
#endif

// A shared-memory pointer as the 32-bit address PTX takes (a kernel converts its base pointers once and steps
// through its stages by adding: a generic pointer would be converted again for every use)
static __device__ __forceinline__ unsigned int smem_addr(const void* p) {
#if SS_PTX
    unsigned int s;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }\n" : "=r"(s) : "l"(p));
    return s;
#elif SS_SIM_BULK
    return (unsigned int)((const char*)p - sim_smem_base());  // an offset into the block's shared memory
#else
    return (unsigned int)(unsigned long long)p;
#endif
}

#if SS_SIM_BULK
// A simulated mbarrier in its 8 bytes: the low word the transaction count (signed), then 12 bits of pending arrivals,
// 12 bits of the arrival count, the phase bit. A phase completes when no arrival and no byte is pending.
// Bulk copies and reduce-adds are asynchronous: each is performed when issued or (chosen at random, seeded by the
// harness) later: a copy when a thread waits on its mbarrier, a reduce-add when its thread waits for its bulk groups.
// So a kernel that reads a stage before waiting for it, or rewrites a tile before its adds have read it, sees stale
// bytes in some runs, and one that refills a stage too early overwrites bytes another warp still reads.
struct SimPending {
    int kind;  // 0: copy global -> shared (completes on bar), 1: reduce-add shared -> global (thread's group)
    int thread;
    unsigned long long* bar;
    char* dst;
    const char* src;
    unsigned int bytes;
};
static inline std::vector<SimPending>& sim_pending() {
    static std::vector<SimPending> q;
    return q;
}
static inline unsigned long long& sim_rng() {
    static unsigned long long r = 1;
    return r;
}
// the harness: before a launch, drop what an earlier one left and seed the choices (0: every operation at its issue)
static inline void sim_bulk_reset(unsigned long long seed) {
    sim_pending().clear();
    sim_rng() = seed;
}
// the harness, after a block: 1 if it left a bulk operation unperformed (a copy nobody waited for, an add never waited
// on), which is an error; the leftovers are dropped
static inline int sim_bulk_leftover() {
    const bool left = !sim_pending().empty();
    sim_pending().clear();
    return left ? 1 : 0;
}
static inline bool sim_defer() {
    if (sim_rng() == 0) return false;
    sim_rng() = sim_rng() * 6364136223846793005ull + 1442695040888963407ull;
    return (sim_rng() >> 40) & 1u;
}
static inline void sim_bar_update(unsigned long long* bp, int arrivals, int tx) {
    unsigned long long& b = *bp;
    int txc = (int)(unsigned int)(b & 0xFFFFFFFFull) + tx;
    unsigned int hi = (unsigned int)(b >> 32), pending = (hi & 0xFFFu) - (unsigned int)arrivals;
    const unsigned int count = (hi >> 12) & 0xFFFu;
    unsigned int phase = (hi >> 24) & 1u;
    if (pending == 0u && txc == 0) pending = count, phase ^= 1u;
    b = ((unsigned long long)((phase << 24) | (count << 12) | (pending & 0xFFFu)) << 32) | (unsigned int)txc;
}
static inline unsigned long long* sim_bar(unsigned int s) { return (unsigned long long*)(sim_smem_base() + s); }
static inline void sim_perform(const SimPending& p) {
    if (p.kind == 0) {
        std::memcpy(p.dst, p.src, p.bytes);
        sim_bar_update(p.bar, 0, -(int)p.bytes);
    } else {
        for (unsigned int i = 0; i < p.bytes / 4u; ++i) ((float*)p.dst)[i] += ((const float*)p.src)[i];
    }
}
// performs the pending operations of one kind that match (a copy's mbarrier, a reduce-add's thread), in issue order
static inline void sim_complete(int kind, const unsigned long long* bar, int thread) {
    std::vector<SimPending>& q = sim_pending();
    for (size_t i = 0; i < q.size();) {
        if (q[i].kind == kind && (kind == 0 ? q[i].bar == bar : q[i].thread == thread)) {
            const SimPending p = q[i];
            q.erase(q.begin() + (long)i);
            sim_perform(p);
        } else {
            ++i;
        }
    }
}
static inline void mbar_init(unsigned long long* bar, unsigned int count) {
    *bar = (unsigned long long)(((count & 0xFFFu) << 12) | (count & 0xFFFu)) << 32;
}
static inline void mbar_fence_init() {}
static inline void mbar_expect_tx_s(unsigned int bar, unsigned int bytes) {
    sim_bar_update(sim_bar(bar), 1, (int)bytes);
}
static inline void mbar_arrive_s(unsigned int bar) { sim_bar_update(sim_bar(bar), 1, 0); }
// spins (letting the other fibers run, and the copies on this barrier land) until the phase of this parity completed
static inline void mbar_wait_s(unsigned int bar, unsigned int parity) {
    unsigned long long* const b = sim_bar(bar);
    for (long spins = 0;; ++spins) {
        sim_complete(0, b, 0);
        if (((*b >> 56) & 1ull) != parity) return;
        if (spins > 2000000) {  // nothing completes it: give up (wrong results follow; the harness reports it)
            sim_bulk_error = 1;
            return;
        }
        simb::yield(simb::RUN);
    }
}
static inline void bulk_g2s_s(unsigned int dst, const void* src, unsigned int bytes, unsigned int bar) {
    const SimPending p{0, simb::cur, sim_bar(bar), sim_smem_base() + dst, (const char*)src, bytes};
    if (sim_defer())
        sim_pending().push_back(p);
    else
        sim_perform(p);
}
// a copy of bytes a step reads once (below): the L2 hint changes nothing the simulation models
static inline void bulk_g2s_once_s(unsigned int dst, const void* src, unsigned int bytes, unsigned int bar) {
    bulk_g2s_s(dst, src, bytes, bar);
}
static inline void bulk_s2g_add_f32(void* dst, unsigned int src, unsigned int bytes) {
    const SimPending p{1, simb::cur, nullptr, (char*)dst, sim_smem_base() + src, bytes};
    if (sim_defer())
        sim_pending().push_back(p);
    else
        sim_perform(p);
}
// Thread block clusters are not simulated (no CPU test launches a cluster kernel: gemv_ring_pair_kernel): reaching
// one of these is a simulation error.
static inline void cluster_arrive_relaxed() { sim_bulk_error = 1; }
static inline void cluster_arrive() { sim_bulk_error = 1; }
static inline void cluster_wait() { sim_bulk_error = 1; }
static inline unsigned int cluster_map(unsigned int saddr, unsigned int) { return sim_bulk_error = 1, saddr; }
static inline void st_cluster_f32(unsigned int, float) { sim_bulk_error = 1; }
static inline void bulk_commit() {}
static inline void bulk_wait_read() { sim_complete(1, nullptr, simb::cur); }
static inline void bulk_wait() { sim_complete(1, nullptr, simb::cur); }
static inline void fence_async_smem() {}
#elif SS_BULK
static __device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
static __device__ __forceinline__ void mbar_fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
static __device__ __forceinline__ void mbar_expect_tx_s(unsigned int bar, unsigned int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void mbar_wait_s(unsigned int bar, unsigned int parity) {
    asm volatile(
        "{\n"
        ".reg .pred P1;\n"
        "LAB_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
        "@P1 bra DONE;\n"
        "bra LAB_WAIT;\n"
        "DONE:\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
static __device__ __forceinline__ void bulk_g2s_s(unsigned int dst, const void* src, unsigned int bytes,
                                                  unsigned int bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
// A copy of bytes a step reads once: a product's weights, which stream through the L2 cache (16 GB a step through
// 50 MB at the 27B). Built with SPECSPLIT_WEIGHTS_EVICT_FIRST, the copy carries an evict-first L2 policy, so that the
// stream does not push out what the step reads again soon (packed x, partial sums and their counters, the residual
// stream, the KV cache of a short context); else it is bulk_g2s_s.
static __device__ __forceinline__ void bulk_g2s_once_s(unsigned int dst, const void* src, unsigned int bytes,
                                                       unsigned int bar) {
#ifdef SPECSPLIT_WEIGHTS_EVICT_FIRST
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::
            "r"(dst),
        "l"(src), "r"(bytes), "r"(bar), "l"(policy)
        : "memory");
#else
    bulk_g2s_s(dst, src, bytes, bar);
#endif
}
// Thread block clusters (sm_90, a kernel declared __cluster_dims__): the split cluster barrier (every thread of every
// block of the cluster arrives, then waits; relaxed: orders nothing, for "every block has started") and a store into
// another block's shared memory (the address of a local shared variable mapped to block `rank` of the cluster).
static __device__ __forceinline__ void cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
static __device__ __forceinline__ void cluster_arrive() {
    asm volatile("barrier.cluster.arrive.aligned;\n" ::: "memory");
}
static __device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ unsigned int cluster_map(unsigned int saddr, unsigned int rank) {
    unsigned int r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(saddr), "r"(rank));
    return r;
}
static __device__ __forceinline__ void st_cluster_f32(unsigned int addr, float v) {
    asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory");
}
// one arrival (release: this thread's earlier shared-memory reads are done)
static __device__ __forceinline__ void mbar_arrive_s(unsigned int bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Shared -> global the other way: a bulk reduce-add of `bytes` (a multiple of 16, both ends 16-byte aligned) of fp32
// values into global memory (each element dst[i] += src[i], one IEEE add at L2, rounded to nearest: what a thread's
// load-add-store would leave, subnormal results apart, without the warp waiting on the load). Issued by one thread,
// grouped by bulk_commit; bulk_wait_read: its earlier groups are done reading shared memory (the tile may be
// rewritten); bulk_wait: they are done, writes included. fence_async_smem orders this thread's earlier st.shared
// before the bulk copies that read them (the async proxy).
static __device__ __forceinline__ void bulk_s2g_add_f32(void* dst, unsigned int src, unsigned int bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
                 "r"(bytes)
                 : "memory");
}
static __device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
static __device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
static __device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
static __device__ __forceinline__ void fence_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
#endif

#if SS_BULK
// the generic-pointer forms (both the device's and the simulation's)
static __device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned int bytes) {
    mbar_expect_tx_s(smem_addr(bar), bytes);
}
static __device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned int parity) {
    mbar_wait_s(smem_addr(bar), parity);
}
static __device__ __forceinline__ void bulk_g2s(void* dst, const void* src, unsigned int bytes,
                                                unsigned long long* bar) {
    bulk_g2s_s(smem_addr(dst), src, bytes, smem_addr(bar));
}
static __device__ __forceinline__ void mbar_arrive(unsigned long long* bar) { mbar_arrive_s(smem_addr(bar)); }
#endif

}  // namespace bk

#endif  // SPECSPLIT_BULK_CUH
