// CPU simulation core for CUDA kernels on machines without a GPU: a harness (.cpp) includes this, then a
// kernel source compiled as plain C++ (no __CUDA_ARCH__, so kernels take their portable path).
// Thread blocks run one after another, warps one after another, and the 32 lanes of a warp as
// cooperative fibers (ucontext; block mode below: a stack switch of its own on x86-64 Linux) that meet at every
// __syncwarp / __shfl_sync, i.e. in lockstep.
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

// Blocks 0 .. n-1 in grid order (seed 0) or a pseudo-random permutation (Fisher-Yates on a 64-bit LCG seeded with it),
// for harnesses that run a launch's blocks in an order the kernel must not depend on.
static std::vector<unsigned> block_order(unsigned n, unsigned long long seed) {
    std::vector<unsigned> order(n);
    for (unsigned b = 0; b < n; ++b) order[b] = b;
    unsigned long long state = seed;
    for (unsigned b = n; seed != 0 && b > 1; --b) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        const unsigned j = (unsigned)((state >> 33) % b), tmp = order[b - 1];
        order[b - 1] = order[j], order[j] = tmp;
    }
    return order;
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
namespace sim {
// Called before every atomic and fence: null (blocks one after another), or simb::run_grid's switch point, where
// another resident block may run before the operation (a block paused mid-protocol).
static void (*preempt)() = nullptr;
static inline void switch_point() {
    if (preempt) preempt();
}
}  // namespace sim
// Fibers run one at a time, so an atomic is a plain read-modify-write and a memory fence has nothing to order (the
// simulation has no caches); harnesses that test inter-block protocols (last block of a tile to arrive) vary the
// order in which blocks run, or interleave resident blocks at these switch points (simb::run_grid).
static inline float atomicAdd(float* p, float v) {
    sim::switch_point();
    const float o = *p;
    *p = o + v;
    return o;
}
static inline unsigned int atomicAdd(unsigned int* p, unsigned int v) {
    sim::switch_point();
    const unsigned int o = *p;
    *p = o + v;
    return o;
}
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    sim::switch_point();
    const unsigned long long o = *p;
    *p = o + v;
    return o;
}
static inline unsigned int atomicMax(unsigned int* p, unsigned int v) {
    sim::switch_point();
    const unsigned int o = *p;
    if (v > o) *p = v;
    return o;
}
static inline void __threadfence() { sim::switch_point(); }

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
// (divergent warps, deadlocks). simb::run_grid runs a launch's blocks several at a time, interleaved (inter-block
// protocols: arrival counters, pieces read back); its harness gives each resident block its own shared memory and
// kernels under it must not use `static __shared__`. Warp mode above is unchanged for harnesses that do not define
// SIM_BLOCK.
#ifdef SIM_BLOCK
#include <sys/mman.h>
#include <type_traits>
namespace simb {
constexpr int MAX_THREADS = 1024;                  // per block
constexpr int MAX_FIBERS = 2048;                   // all resident blocks together (run_grid)
constexpr size_t STACK = 128 * 1024;
enum : unsigned char { RUN = 0, WARP_BAR = 1, BLOCK_BAR = 2, DONE = 3 };
static int n = 0, cur = 0;                         // threads per block, fiber running now
static unsigned char state[MAX_FIBERS];
static sim_dim3 tids[MAX_FIBERS];
static int base[MAX_FIBERS];                       // first fiber of the fiber's block
static unsigned long long slots[MAX_FIBERS];
static void (*fn)() = nullptr;
static void entry(int i);

// Switching fibers: on x86-64 Linux a stack switch of the callee-saved registers, the SSE control word and the x87
// control word (what a call must preserve), so a switch is a few instructions; swapcontext also saves the signal mask
// with a system call a switch, which made that most of a simulation's time. Elsewhere (or with SIM_UCONTEXT) ucontext.
#if defined(__x86_64__) && defined(__linux__) && !defined(SIM_UCONTEXT)
extern "C" __attribute__((visibility("hidden"))) void simb_switch(void** save_sp, void* load_sp);
extern "C" __attribute__((visibility("hidden"))) void simb_fiber_start();
__asm__(R"(
    .text
    .globl simb_switch
    .hidden simb_switch
    .type simb_switch, @function
simb_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size simb_switch, .-simb_switch
    .globl simb_fiber_start
    .hidden simb_fiber_start
    .type simb_fiber_start, @function
simb_fiber_start:
    movq %r12, %rdi
    call simb_fiber_main
    ud2
    .size simb_fiber_start, .-simb_fiber_start
)");
static void* sched_sp = nullptr;
static void* fiber_sp[MAX_FIBERS];
// A new fiber's stack as simb_switch leaves a paused one: the control words, six registers (r12 = the fiber) and the
// start stub as the return address, 16-byte aligned as a call expects once the stub calls on.
static void fiber_init(int i, char* stack, size_t size) {
    unsigned long long* top = (unsigned long long*)(((unsigned long long)(stack + size)) & ~15ull);
    unsigned long long* sp = top - 8;
    sp[0] = 0x1F80ull | (0x037Full << 32);  // mxcsr, x87 control word: the defaults
    sp[1] = sp[2] = sp[3] = 0;              // r15, r14, r13
    sp[4] = (unsigned long long)i;          // r12
    sp[5] = sp[6] = 0;                      // rbx, rbp
    sp[7] = (unsigned long long)&simb_fiber_start;
    fiber_sp[i] = sp;
}
static inline void to_fiber(int i) { simb_switch(&sched_sp, fiber_sp[i]); }
static inline void to_sched() { simb_switch(&fiber_sp[cur], sched_sp); }
}  // namespace simb
extern "C" __attribute__((visibility("hidden"), used)) void simb_fiber_main(long i) {
    simb::entry((int)i);
    simb::simb_switch(&simb::fiber_sp[i], simb::sched_sp);  // never resumed: the fiber is done
}
namespace simb {
#else
static ucontext_t sched, ctx[MAX_FIBERS];
static void fiber_init(int i, char* stack, size_t size) {
    getcontext(&ctx[i]);
    ctx[i].uc_stack.ss_sp = stack;
    ctx[i].uc_stack.ss_size = size;
    ctx[i].uc_link = &sched;
    makecontext(&ctx[i], (void (*)())entry, 1, i);
}
static inline void to_fiber(int i) { swapcontext(&sched, &ctx[i]); }
static inline void to_sched() { swapcontext(&ctx[cur], &sched); }
#endif

static inline sim_dim3& tid() { return tids[cur]; }
static void yield(unsigned char s) {
    state[cur] = s;
    to_sched();
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
    std::memcpy(&r, &slots[idx < base[me] + n ? idx : me], sizeof(T));
    yield(WARP_BAR);
    return r;
}
static void entry(int i) {
    cur = i;
    fn();
    state[i] = DONE;
}
// Stacks for MAX_FIBERS fibers, reserved once, touched (committed) only as deep as the fibers go.
static char* stacks() {
    static char* mem = nullptr;
    if (!mem) {
        void* p = mmap(nullptr, (size_t)MAX_FIBERS * STACK, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        mem = p == MAP_FAILED ? nullptr : (char*)p;
    }
    return mem;
}
// Fibers f0 .. f0 + n - 1 start the block (threadIdx.x = 0..n-1); f0 is a multiple of 32, so a warp's lanes share one
// 32-aligned run of fibers.
static void start_block(int f0) {
    for (int i = f0; i < f0 + n; ++i) {
        state[i] = RUN;
        tids[i] = {(unsigned)(i - f0), 0, 0};
        base[i] = f0;
        fiber_init(i, stacks() + (size_t)i * STACK, STACK);
    }
}
// After every fiber of the block at f0 ran once: releases warps whose live lanes all wait at a warp barrier, then (if
// nothing else can move) a block barrier every live thread reached. Returns 1 when the block is done, 0 when it can go
// on, -1 on a simulation error (divergent warp, deadlock).
static int settle(int f0) {
    bool progress = false, all_done = true, all_block = true;
    for (int w = 0; w * 32 < n; ++w) {
        int at = 0, done = 0, lanes = 0;
        for (int i = f0 + 32 * w; i < f0 + n && i < f0 + 32 * w + 32; ++i, ++lanes) {
            at += state[i] == WARP_BAR;
            done += state[i] == DONE;
        }
        if (at && at + done == lanes) {
            if (done) {
                std::fprintf(stderr, "cuda_sim: divergent warp %d (%d lanes returned, %d wait)\n", w, done, at);
                return -1;
            }
            for (int i = f0 + 32 * w; i < f0 + n && i < f0 + 32 * w + 32; ++i) state[i] = RUN;
            progress = true;
        }
    }
    for (int i = f0; i < f0 + n; ++i) {
        all_done &= state[i] == DONE;
        all_block &= state[i] == DONE || state[i] == BLOCK_BAR;
        progress |= state[i] == RUN;  // paused at a switch point (run_grid)
    }
    if (all_done) return 1;
    if (progress) return 0;
    if (all_block) {
        for (int i = f0; i < f0 + n; ++i)
            if (state[i] == BLOCK_BAR) state[i] = RUN;
        return 0;
    }
    std::fprintf(stderr, "cuda_sim: deadlock (threads wait at different barriers)\n");
    return -1;
}
// Runs fn on n_threads fibers (threadIdx.x = 0..n-1, set sim::bid / gdim / bdim first); returns errors.
static int run_block(int n_threads, void (*f)()) {
    if (n_threads < 1 || n_threads > MAX_THREADS || !stacks()) return 1;
    n = n_threads;
    fn = f;
    start_block(0);
    for (;;) {
        for (int i = 0; i < n; ++i) {
            if (state[i] != RUN) continue;
            cur = i;
            to_fiber(i);
        }
        const int r = settle(0);
        if (r) return r < 0 ? 1 : 0;
    }
}

// Grid mode: the blocks of a launch, `order` (block indices, in the order they start), with up to `resident` blocks in
// flight at once like the blocks of one wave on a GPU. Each round runs every runnable fiber of some resident blocks
// once (each block with probability 1/2, at least one, in a shuffled order; 64-bit LCG seeded with seed), so blocks
// drift apart. Atomics and __threadfence are switch points (sim::preempt): the thread stops there until its block's
// next turn, and half the time the block is then held until the other blocks have had 1..8 events (a turn that
// stopped at a switch point, or the end of a block): another block can store, count itself in, add up, reset, or
// finish in between. (A kernel whose blocks wait for each other would need a switch point in its wait loop; when every
// resident block is held, a random one is let go.) A block that finishes
// frees its place for the next in `order`. enter(slot, block) runs whenever the fibers of another place are about to
// run (sim::bid is set already): the harness points shared memory at the place's own copy there. Returns the
// simulation errors.
static int run_grid(int n_threads, const unsigned* order, int n_blocks, int resident, unsigned long long seed,
                    void (*f)(), void (*enter)(int slot, unsigned block)) {
    const int stride = (n_threads + 31) & ~31;
    if (n_threads < 1 || n_threads > MAX_THREADS || resident < 1 || resident * stride > MAX_FIBERS || !stacks())
        return 1;
    n = n_threads;
    fn = f;
    std::vector<int> block_of(resident, -1), places(resident), runnable(resident);
    std::vector<unsigned> hold(resident, 0u);
    static bool switched;  // a fiber of the block on its turn stopped at a switch point
    int next = 0, loaded = -1, errors = 0;
    unsigned long long rng = seed * 2862933555777941757ull + 3037000493ull;
    auto draw = [&rng](unsigned m) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        return (unsigned)((rng >> 33) % m);
    };
    sim::preempt = [] {
        switched = true;
        yield(RUN);
    };
    for (;;) {
        int live = 0;
        for (int sl = 0; sl < resident; ++sl) {
            if (block_of[sl] < 0 && next < n_blocks) {
                block_of[sl] = (int)order[next++];
                start_block(sl * stride);
                if (loaded == sl) loaded = -1;  // a new block: enter() again
            }
            if (block_of[sl] >= 0) places[live++] = sl;
        }
        if (live == 0) break;
        int n_run = 0;
        for (int k = 0; k < live; ++k)
            if (!hold[places[k]]) runnable[n_run++] = places[k];
        if (n_run == 0) {  // every resident block is held
            runnable[n_run++] = places[draw((unsigned)live)];
            hold[runnable[0]] = 0;
        }
        for (int i = n_run; i > 1; --i) std::swap(runnable[i - 1], runnable[draw((unsigned)i)]);
        const int must = (int)draw((unsigned)n_run);
        for (int k = 0; k < n_run; ++k) {
            const int sl = runnable[k], f0 = sl * stride;
            if (k != must && draw(2u)) continue;  // this block waits a round
            switched = false;
            for (int i = f0; i < f0 + n; ++i) {
                if (state[i] != RUN) continue;
                if (loaded != sl) {
                    loaded = sl;
                    sim::bid = {(unsigned)block_of[sl], 0, 0};
                    if (enter) enter(sl, (unsigned)block_of[sl]);
                }
                cur = i;
                to_fiber(i);
            }
            const int r = settle(f0);
            if (r < 0) {
                ++errors;
                sim::preempt = nullptr;
                return errors;  // the stuck fibers are abandoned (their stacks are reused by the next launch)
            }
            if (r > 0 || switched) {  // an event: the blocks held count it
                for (int o = 0; o < resident; ++o)
                    if (o != sl && hold[o]) --hold[o];
            }
            if (r > 0) {
                block_of[sl] = -1;
                hold[sl] = 0;
            } else if (switched && draw(2u)) {
                hold[sl] = 1u + draw(8u);
            }
        }
    }
    sim::preempt = nullptr;
    return errors;
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
