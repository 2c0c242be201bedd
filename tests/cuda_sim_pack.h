// pack_x_kernel of kernels/quant_matmul.cu for the CPU simulations that run it as one thread walking every unit
// (tests/cuda_sim.cpp, tests/cuda_sim_wide.cpp; without the gemv staging, so no lane shuffle is needed). Include after
// the kernel source.
#pragma once

extern "C" void sim_pack(int in_f32, const void* x, long long ldx, int T, int K, int tpad, void* xp) {
    sim::gdim = {1, 1, 1};
    sim::bdim = {1, 1, 1};
    sim::bid = {0, 0, 0};
    simb::cur = 0;
    simb::tids[0] = {0, 0, 0};
    if (in_f32)
        pack_x_kernel<1>(x, ldx, T, K, tpad, (uint4*)xp, nullptr);
    else
        pack_x_kernel<0>(x, ldx, T, K, tpad, (uint4*)xp, nullptr);
}

// pack_silu_kernel<1> (f32 gate and up rows, as a wide product writes them) into pack_x_kernel's layout, one thread
extern "C" void sim_pack_silu(const float* g, long long ldg, const float* up, long long ldu, int T, int K, int tpad,
                              void* xp) {
    sim::gdim = {1, 1, 1};
    sim::bdim = {1, 1, 1};
    sim::bid = {0, 0, 0};
    simb::cur = 0;
    simb::tids[0] = {0, 0, 0};
    pack_silu_kernel<1>(g, ldg, up, ldu, T, K, tpad, (uint4*)xp, nullptr);
}
