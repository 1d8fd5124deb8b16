// specserve small-batch quantized matmul, CUDA tensor-core variant: helpers of the launch
// options that only some launches take (qmv.py appends this file to the header for those:
// LP > 0, XS = 1); declared in mma_cuda.cuh.

#ifndef SSK_MMA_EXTRAS_CUH
#define SSK_MMA_EXTRAS_CUH

namespace ssk {

// load_words with an L2 prefetch-size hint of PF bytes (64, 128 or 256): the L2 fetches that
// aligned block from DRAM, so neighbouring warps' words of the same row arrive in one larger
// request.
template <int VW, int PF>
__device__ __forceinline__ void load_words_hinted(const uint32_t* p, uint32_t (&out)[VW]) {
  static_assert(PF == 64 || PF == 128 || PF == 256, "PF: an L2 prefetch size");
#define SSK_LD_PF(SIZE)                                                                         \
  if constexpr (VW == 4) {                                                                      \
    asm("ld.global.cs.L2::" SIZE ".v4.u32 {%0, %1, %2, %3}, [%4];"                              \
        : "=r"(out[0]), "=r"(out[1]), "=r"(out[2]), "=r"(out[3]) : "l"(p));                     \
  } else if constexpr (VW == 2) {                                                               \
    asm("ld.global.cs.L2::" SIZE ".v2.u32 {%0, %1}, [%2];" : "=r"(out[0]), "=r"(out[1]) : "l"(p)); \
  } else {                                                                                      \
    asm("ld.global.cs.L2::" SIZE ".u32 %0, [%1];" : "=r"(out[0]) : "l"(p));                     \
  }
  if constexpr (PF == 64) {
    SSK_LD_PF("64B")
  } else if constexpr (PF == 128) {
    SSK_LD_PF("128B")
  } else {
    SSK_LD_PF("256B")
  }
#undef SSK_LD_PF
}

// One activation row (M = 1): a chunk's B fragments held two registers per lane instead of XW
// per lane of row 0 (the other lanes' activations are padding zeros). Lane h = t * (VW * MMAS)
// + v * MMAS + s holds the (b0, b1) pair that lane t of row 0 (g = 0) takes for word v, mma s
// (XPair's selection, from the same activation words); chunk_products<..., XSH = true> passes
// it over with two shuffles per mma. x0: row 0 at the chunk's first column.
// (xh: an array of at least 2 words, so that the call compiles where it is not taken)
template <int BITS, int VW, int N, typename T>
__device__ __forceinline__ void load_x_held(const T* x0, int lane, uint32_t (&xh)[N]) {
  static_assert(N >= 2, "two held words");
  constexpr int MMAS = BITS == 4 ? 2 : 1;
  constexpr int VALS = VW * 32 / BITS;
  const int t = lane / (VW * MMAS);
  const int v = (lane / MMAS) % VW;
  const int s = lane % MMAS;
  xh[0] = 0u;
  xh[1] = 0u;
  if (lane < 4 * VW * MMAS) {
    const uint32_t* p = reinterpret_cast<const uint32_t*>(x0 + t * VALS);
    if constexpr (BITS == 4) {
      const uint32_t lo = __ldg(p + 4 * v + s);
      const uint32_t hi = __ldg(p + 4 * v + s + 2);
      xh[0] = __byte_perm(lo, hi, 0x5410u);
      xh[1] = __byte_perm(lo, hi, 0x7632u);
    } else {
      xh[0] = __ldg(p + 2 * v);
      xh[1] = __ldg(p + 2 * v + 1);
    }
  }
}

// The (b0, b1) pair of mma s of word v for this lane, from the lane that load_x_held made hold
// it (lanes of rows 1..7 get row 0's pair: their output columns are never stored).
template <int VW, int MMAS, int XW>
__device__ __forceinline__ void x_fragment_held(
    const uint32_t (&xr)[XW], int v, int s, uint32_t& b0, uint32_t& b1) {
  const int src = (threadIdx.x & 3) * (VW * MMAS) + v * MMAS + s;
  b0 = __shfl_sync(0xffffffffu, xr[0], src);
  b1 = __shfl_sync(0xffffffffu, xr[1], src);
}

} // namespace ssk

#endif // SSK_MMA_EXTRAS_CUH
