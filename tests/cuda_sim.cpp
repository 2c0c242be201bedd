// CPU simulation of kernels/quant_matmul.cu for machines without a GPU (tests/test_kernels_cpu_sim.py).
//
// The .cu file is compiled as plain C++ (g++ -std=c++17 -DQMM_SOURCE='"path"'): without __CUDA_ARCH__ it
// takes its portable path (software fp16, warp-shuffle mma emulation, synchronous copies), so this checks
// every layout, index and dequantization detail the GPU build shares with it; only the inline-PTX leaf
// operations (cvt, f16x2 arithmetic, mma.sync, cp.async) are left to the GPU test.
// Thread blocks run one after another, warps one after another, and the 32 lanes of a warp as
// cooperative fibers (ucontext) that meet at every __syncwarp / __shfl_sync, i.e. in lockstep.
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

alignas(16) uint4 ss_smem[(232 * 1024) / 16];

#include QMM_SOURCE

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

struct QmmArgs { const u8* W; long long row_bytes; int N, K; const uint4* xp; int T; float* y; };
static QmmArgs qa;

template <int QT, int NT>
static void qmm_lane() { qmm_kernel<QT, NT>(qa.W, qa.row_bytes, qa.N, qa.K, qa.xp, qa.T, qa.y); }

template <int QT>
static sim::LaneFn pick_nt(int nt) {
    switch (nt) {
        case 1: return qmm_lane<QT, 1>;
        case 2: return qmm_lane<QT, 2>;
        case 3: return qmm_lane<QT, 3>;
        case 4: return qmm_lane<QT, 4>;
        case 5: return qmm_lane<QT, 5>;
        case 6: return qmm_lane<QT, 6>;
        case 7: return qmm_lane<QT, 7>;
        case 8: return qmm_lane<QT, 8>;
    }
    return nullptr;
}

extern "C" int sim_qmm(int qt, int nt, const unsigned char* W, long long row_bytes, int N, int K, const void* xp,
                       int T, float* y, int splits) {
    sim::LaneFn fn = nullptr;
    switch (qt) {
        case 1: fn = pick_nt<1>(nt); break;
        case 8: fn = pick_nt<8>(nt); break;
        case 12: fn = pick_nt<12>(nt); break;
        case 14: fn = pick_nt<14>(nt); break;
    }
    if (!fn) return -1;
    qa = {W, row_bytes, N, K, (const uint4*)xp, T, y};
    sim::lane_fn = fn;
    sim::errors = 0;
    const int grid_x = (N + 127) / 128;
    sim::gdim = {(unsigned)grid_x, (unsigned)splits, 1};
    sim::bdim = {128, 1, 1};
    for (int by = 0; by < splits; ++by)
        for (int bx = 0; bx < grid_x; ++bx) {
            sim::bid = {(unsigned)bx, (unsigned)by, 0};
            std::memset(ss_smem, 0xA5, sizeof(ss_smem));
            for (int w = 0; w < 4; ++w) sim::run_warp(32u * w);
        }
    return sim::errors;
}

extern "C" void sim_pack(int in_f32, const void* x, long long ldx, int T, int K, int tpad, void* xp) {
    sim::gdim = {1, 1, 1};
    sim::bdim = {1, 1, 1};
    sim::bid = {0, 0, 0};
    sim::cur = 0;
    sim::tids[0] = {0, 0, 0};
    if (in_f32)
        pack_x_kernel<1>(x, ldx, T, K, tpad, (uint4*)xp);
    else
        pack_x_kernel<0>(x, ldx, T, K, tpad, (uint4*)xp);
}
