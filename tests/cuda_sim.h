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
#define __launch_bounds__(x)
#define __restrict__ __restrict
#define __shared__
#define __syncwarp() sim::barrier()
#define __shfl_sync(mask, v, src) sim::shfl((v), (src))
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static inline float atomicAdd(float* p, float v) { const float o = *p; *p = o + v; return o; }

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
