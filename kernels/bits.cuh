// Bit helpers shared by the kernels (attention.cu's TQ3_0 centroid lookup, quant_gemv.cu's Q4_K scale decode, the
// IQ4_XS codebook lookup of quant_matmul.cu and quant_gemv.cu): the
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

// IQ4_XS / IQ4_NL: ggml's codebook kvalues_iq4nl (int8 -127..113) as bytes, 4 a word
constexpr unsigned int IQ4_T0 = 0xBFAD9881u, IQ4_T1 = 0xF6EADDCFu, IQ4_T2 = 0x26190D01u, IQ4_T3 = 0x71594535u;

// The codebook values of the 4 indices in sel's low 16 bits (one a nibble), as 4 int8 bytes: each looked up among
// entries 0-7 and among 8-15, then picked by the index's bit 3 (masked off the first two: prmt's default mode reads a
// selector's bit 3 as sign replication; prmt reads only its selector's low 16 bits)
static __device__ __forceinline__ unsigned int iq4_pick(unsigned int sel) {
    const unsigned int s7 = sel & 0x7777u;
    const unsigned int lo = byte_perm(IQ4_T0, IQ4_T1, s7), hi = byte_perm(IQ4_T2, IQ4_T3, s7);
    return byte_perm(lo, hi, 0x3210u | ((sel >> 1) & 0x4444u));
}

// The codebook values of the 4-bit indices in the low nibbles of w's 4 bytes (high nibbles zero), as 4 int8 bytes:
// the indices packed into one 16-bit selector first
static __device__ __forceinline__ unsigned int iq4_lookup(unsigned int w) {
    const unsigned int m = w | (w >> 4);                      // bytes 0 / 2: i0 | i1 << 4, i2 | i3 << 4
    return iq4_pick(byte_perm(m, 0u, 0x4420u));               // nibbles i0, i1, i2, i3
}

// Both nibbles of w's 4 bytes (an IQ4_XS qs word: low nibbles one run of a sub-block's values, high nibbles the
// other's): lo the low nibbles' 4 values, hi the high ones', in byte order. w's low 16 bits already are the selector
// of [l0, h0, l1, h1] and w >> 16's of [l2, h2, l3, h3], so no packing; two permutes sort the runs apart (15
// instructions a word where two iq4_lookup calls and their masks take 22)
static __device__ __forceinline__ void iq4_lookup_runs(unsigned int w, unsigned int& lo, unsigned int& hi) {
    const unsigned int a = iq4_pick(w), b = iq4_pick(w >> 16);
    lo = byte_perm(a, b, 0x6420u);
    hi = byte_perm(a, b, 0x7531u);
}

}  // namespace bits

#endif  // SPECSPLIT_BITS_CUH
