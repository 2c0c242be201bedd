// CPU simulation core for CUDA kernels on machines without a GPU: a harness (.cpp) includes this, then a
// kernel source compiled as plain C++ (no __CUDA_ARCH__, so kernels take their portable path).
// Thread blocks run one after another, warps one after another, and the 32 lanes of a warp as
// cooperative fibers (ucontext) that meet at every __syncwarp / __shfl_sync, i.e. in lockstep.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ucontext.h>
#include <vector>

struct uint4 { unsigned int x, y, z, w; };
struct uint2 { unsigned int x, y; };
struct sim_dim3 { unsigned int x, y, z; };

namespace sim {
constexpr int LANES = 32;
static sim_dim3 bid, gdim, bdim, tids[LANES];
static int cur = 0;               // lane running now
static ucontext_t sched_ctx, lane_ctx[LANES];
static bool done[LANES], at_barrier[LANES];
static unsigned int slots[LANES];
static int errors = 0;

static inline sim_dim3& tid() { return tids[cur]; }
static void barrier() {
    at_barrier[cur] = true;
    swapcontext(&lane_ctx[cur], &sched_ctx);
}
static unsigned int shfl(unsigned int v, int src) {
    const int me = cur;
    slots[me] = v;
    barrier();
    const unsigned int r = slots[src & 31];
    barrier();
    return r;
}
}  // namespace sim

#define threadIdx (sim::tid())
#define blockIdx (sim::bid)
#define gridDim (sim::gdim)
#define blockDim (sim::bdim)
#define __global__
#define __device__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__
#define __syncwarp() sim::barrier()
#define __shfl_sync(mask, v, src) sim::shfl((v), (src))
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static inline float atomicAdd(float* p, float v) { const float o = *p; *p = o + v; return o; }
// Blocks run one after another (or one fiber at a time), so an atomic is a plain read-modify-write and a memory
// fence has nothing to order; harnesses that test inter-block protocols (last block of a tile to arrive) vary the
// order in which they run the blocks instead.
static inline unsigned int atomicAdd(unsigned int* p, unsigned int v) {
    const unsigned int o = *p;
    *p = o + v;
    return o;
}
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    const unsigned long long o = *p;
    *p = o + v;
    return o;
}
static inline unsigned int atomicMax(unsigned int* p, unsigned int v) {
    const unsigned int o = *p;
    if (v > o) *p = v;
    return o;
}
static inline void __threadfence() {}

namespace sim {
typedef void (*LaneFn)();
static LaneFn lane_fn;
static void lane_entry(int lane) {
    cur = lane;
    lane_fn();
    done[lane] = true;
    // returning resumes uc_link (the scheduler)
}

// Run lane_fn on 32 fibers with threadIdx.x = base + lane, until all finish.
static void run_warp(unsigned int base) {
    static std::vector<char> stacks(LANES * 512 * 1024);
    for (int l = 0; l < LANES; ++l) {
        done[l] = at_barrier[l] = false;
        tids[l] = {base + (unsigned)l, 0, 0};
        getcontext(&lane_ctx[l]);
        lane_ctx[l].uc_stack.ss_sp = stacks.data() + (size_t)l * 512 * 1024;
        lane_ctx[l].uc_stack.ss_size = 512 * 1024;
        lane_ctx[l].uc_link = &sched_ctx;
        makecontext(&lane_ctx[l], (void (*)())lane_entry, 1, l);
    }
    for (;;) {
        int n_done = 0, n_bar = 0;
        for (int l = 0; l < LANES; ++l) {
            if (done[l]) continue;
            at_barrier[l] = false;
            cur = l;
            swapcontext(&sched_ctx, &lane_ctx[l]);
        }
        for (int l = 0; l < LANES; ++l) {
            n_done += done[l];
            n_bar += at_barrier[l];
        }
        if (n_done == LANES) return;
        if (n_done != 0) {  // some lanes exited while others wait at a barrier: divergent warp
            ++errors;
            std::fprintf(stderr, "cuda_sim: divergent warp (done=%d at_barrier=%d)\n", n_done, n_bar);
            return;
        }
    }
}
}  // namespace sim

// ---------------------------------------------------------------------------------------------
// Block mode (opt-in: #define SIM_BLOCK before including this header). All threads of one thread block
// run as fibers, so kernels that use __syncthreads across several warps can be simulated:
//   __syncthreads()        waits until every thread of the block that has not returned arrives;
//   __syncwarp / shuffles  wait for the (not returned) lanes of the caller's warp only.
// Shuffles carry any trivially copyable value of up to 8 bytes (float, int, u64); __shfl_xor_sync too.
// `static __shared__` arrays become function statics (one copy: blocks run one after another).
// Run a block with simb::run_block(n_threads, fn); it returns the number of simulation errors
// (divergent warps, deadlocks). Warp mode above is unchanged for harnesses that do not define SIM_BLOCK.
#ifdef SIM_BLOCK
#include <type_traits>
namespace simb {
constexpr int MAX_THREADS = 1024;
constexpr size_t STACK = 128 * 1024;
enum : unsigned char { RUN = 0, WARP_BAR = 1, BLOCK_BAR = 2, DONE = 3 };
static int n = 0, cur = 0;
static ucontext_t sched, ctx[MAX_THREADS];
static unsigned char state[MAX_THREADS];
static sim_dim3 tids[MAX_THREADS];
static unsigned long long slots[MAX_THREADS];
static void (*fn)() = nullptr;

static inline sim_dim3& tid() { return tids[cur]; }
static void yield(unsigned char s) {
    state[cur] = s;
    swapcontext(&ctx[cur], &sched);
}
template <class T>
static T shfl(T v, int src) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a value over 8 bytes");
    const int me = cur;
    unsigned long long raw = 0;
    std::memcpy(&raw, &v, sizeof(T));
    slots[me] = raw;
    yield(WARP_BAR);
    const int idx = (me & ~31) + (src & 31);
    T r;
    std::memcpy(&r, &slots[idx < n ? idx : me], sizeof(T));
    yield(WARP_BAR);
    return r;
}
static void entry(int i) {
    cur = i;
    fn();
    state[i] = DONE;
}
// Runs fn on n_threads fibers (threadIdx.x = 0..n-1, set sim::bid / gdim / bdim first); returns errors.
static int run_block(int n_threads, void (*f)()) {
    static std::vector<char> stacks;
    if (n_threads < 1 || n_threads > MAX_THREADS) return 1;
    if (stacks.size() < (size_t)n_threads * STACK) stacks.resize((size_t)n_threads * STACK);
    n = n_threads;
    fn = f;
    for (int i = 0; i < n; ++i) {
        state[i] = RUN;
        tids[i] = {(unsigned)i, 0, 0};
        getcontext(&ctx[i]);
        ctx[i].uc_stack.ss_sp = stacks.data() + (size_t)i * STACK;
        ctx[i].uc_stack.ss_size = STACK;
        ctx[i].uc_link = &sched;
        makecontext(&ctx[i], (void (*)())entry, 1, i);
    }
    for (;;) {
        for (int i = 0; i < n; ++i) {
            if (state[i] != RUN) continue;
            cur = i;
            swapcontext(&sched, &ctx[i]);
        }
        bool progress = false, all_done = true, all_block = true;
        for (int w = 0; w * 32 < n; ++w) {
            int at = 0, done = 0, lanes = 0;
            for (int i = 32 * w; i < n && i < 32 * w + 32; ++i, ++lanes) {
                at += state[i] == WARP_BAR;
                done += state[i] == DONE;
            }
            if (at && at + done == lanes) {
                if (done) {
                    std::fprintf(stderr, "cuda_sim: divergent warp %d (%d lanes returned, %d wait)\n", w, done, at);
                    return 1;
                }
                for (int i = 32 * w; i < n && i < 32 * w + 32; ++i) state[i] = RUN;
                progress = true;
            }
        }
        for (int i = 0; i < n; ++i) {
            all_done &= state[i] == DONE;
            all_block &= state[i] == DONE || state[i] == BLOCK_BAR;
        }
        if (all_done) return 0;
        if (progress) continue;
        if (all_block) {
            for (int i = 0; i < n; ++i)
                if (state[i] == BLOCK_BAR) state[i] = RUN;
            continue;
        }
        std::fprintf(stderr, "cuda_sim: deadlock (threads wait at different barriers)\n");
        return 1;
    }
}
}  // namespace simb

#undef threadIdx
#undef __syncwarp
#undef __shfl_sync
#define threadIdx (simb::tid())
#define __syncwarp(...) simb::yield(simb::WARP_BAR)
#define __syncthreads() simb::yield(simb::BLOCK_BAR)
#define __shfl_sync(mask, v, src) simb::shfl((v), (src))
#define __shfl_xor_sync(mask, v, m) simb::shfl((v), (int)(simb::tid().x & 31u) ^ (m))
#endif  // SIM_BLOCK
