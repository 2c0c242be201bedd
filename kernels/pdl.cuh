// Programmatic dependent launch (sm_90; kernels/loader.py `pdl`, SPECSPLIT_PDL): a kernel launched with it may start
// while the previous kernel of its stream still runs. SS_GRID_WAIT() holds it until that kernel has finished and its
// writes are visible, so code before the wait may only read what no kernel writes (the weights) and write nothing
// another kernel reads; SS_GRID_LAUNCH_DEPENDENTS() lets the next such kernel start (once every block of this one has
// called it or exited: all of this grid is then resident, so waiting blocks of the next never keep it off the SMs).
// SS_PDL_ENTRY(): both, first thing in a kernel with no prologue to overlap. No-ops for a plain launch, off sm_90,
// on HIP and on the portable path. kernels/loader.py pastes this file in place of its #include.
#ifndef SPECSPLIT_PDL_CUH
#define SPECSPLIT_PDL_CUH

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && !defined(__HIP_PLATFORM_AMD__) && !defined(__HIPCC__) && \
    !defined(__HIPCC_RTC__) && !defined(SPECSPLIT_PORTABLE)
#define SS_GRID_WAIT() asm volatile("griddepcontrol.wait;\n" ::: "memory")
#define SS_GRID_LAUNCH_DEPENDENTS() asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory")
#else
#define SS_GRID_WAIT()
#define SS_GRID_LAUNCH_DEPENDENTS()
#endif
#define SS_PDL_ENTRY()                \
    do {                              \
        SS_GRID_LAUNCH_DEPENDENTS();  \
        SS_GRID_WAIT();               \
    } while (0)

#endif  // SPECSPLIT_PDL_CUH
