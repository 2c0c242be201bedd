// Bit helpers shared by the kernels (attention.cu's TQ3_0 centroid lookup, quant_gemv.cu's Q4_K scale decode): the
// PTX instruction where inline PTX is allowed, else the same bits in C++. The includer defines SS_PTX first.
// kernels/loader.py pastes this file in place of its #include; the CPU simulations include it as a file.
#ifndef SPECSPLIT_BITS_CUH
#define SPECSPLIT_BITS_CUH

namespace bits {

// __byte_perm: result byte i = byte (nibble i of sel, 0..7) of the pair y:x
static __device__ __forceinline__ unsigned int byte_perm(unsigned int x, unsigned int y, unsigned int sel) {
#if SS_PTX
    return __byte_perm(x, y, sel);
#else
    const unsigned long long v = (unsigned long long)x | ((unsigned long long)y << 32);
    unsigned int r = 0u;
    for (int i = 0; i < 4; ++i) r |= (unsigned int)((v >> (8 * ((sel >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
    return r;
#endif
}

// The 32 bits of the pair hi:lo from bit `shift` (0..31) on: a word of an unaligned stream from two aligned ones
static __device__ __forceinline__ unsigned int funnel_r(unsigned int lo, unsigned int hi, unsigned int shift) {
#if SS_PTX
    return __funnelshift_r(lo, hi, shift);
#else
    return (unsigned int)((((unsigned long long)hi << 32) | (unsigned long long)lo) >> (shift & 31u));
#endif
}

}  // namespace bits

#endif  // SPECSPLIT_BITS_CUH
