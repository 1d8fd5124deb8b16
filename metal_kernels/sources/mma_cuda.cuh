// specserve small-batch quantized matmul, CUDA tensor-core variant: helpers.
//
// Included as the `header` of mx.fast.cuda_kernel (before MLX's generated
// kernel function). Everything lives in namespace ssk so nothing collides with
// MLX's device headers.
//
// Weight fragments are dequantized to T (fp16 or bf16) in registers and fed as
// the A operand of mma.sync.m16n8k16 (A = 16 weight rows x 16 k, B = 16 k x 8
// activation rows, fp32 accumulators). The order of the k values inside one
// mma is permuted to match the packed words (a dot product does not care which
// k sits in which slot as long as A and B agree); see mma_body.cu.

#ifndef SSK_MMA_CUDA_CUH
#define SSK_MMA_CUDA_CUH

namespace ssk {

template <typename T>
struct Half2;

template <>
struct Half2<__half> {
  using V = __half2;
  // 0x6400 is fp16 1024.0: OR-ing a value q < 1024 into the mantissa gives 1024 + q.
  static constexpr uint32_t kMagic = 0x64006400u;
  static __device__ __forceinline__ V splat(float f) {
    return __float2half2_rn(f);
  }
  static __device__ __forceinline__ V dup(__half h) {
    return __half2half2(h);
  }
  static __device__ __forceinline__ V magic() {
    return __float2half2_rn(1024.0f);
  }
  static __device__ __forceinline__ V pack(float lo, float hi) {
    return __floats2half2_rn(lo, hi);
  }
};

template <>
struct Half2<__nv_bfloat16> {
  using V = __nv_bfloat162;
  // 0x4300 is bf16 128.0: OR-ing q < 128 into the mantissa gives 128 + q.
  static constexpr uint32_t kMagic = 0x43004300u;
  static __device__ __forceinline__ V splat(float f) {
    return __float2bfloat162_rn(f);
  }
  static __device__ __forceinline__ V dup(__nv_bfloat16 h) {
    return __bfloat162bfloat162(h);
  }
  static __device__ __forceinline__ V magic() {
    return __float2bfloat162_rn(128.0f);
  }
  static __device__ __forceinline__ V pack(float lo, float hi) {
    return __floats2bfloat162_rn(lo, hi);
  }
};

template <typename A, typename B>
struct Same {
  static constexpr bool value = false;
};
template <typename A>
struct Same<A, A> {
  static constexpr bool value = true;
};

template <typename V>
__device__ __forceinline__ V bits_to(uint32_t u) {
  return *reinterpret_cast<const V*>(&u);
}

template <typename V>
__device__ __forceinline__ uint32_t to_bits(V v) {
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Dequantization of one packed 32-bit word into pairs of T (one 32-bit
// register each), the pair layout the mma A fragment takes.
//   4 bits: pair j (0..3) = (q[j], q[j + 4]), q[i] = bits [4i, 4i + 4).
//   8 bits: pair j (0..1) = (q[2j], q[2j + 1]), q[i] = byte i.
// Each dequantized value is s * q + b rounded once to T (fp16: one fused
// half2 FMA on exact q; bf16 8-bit: fp32 FMA then round, since bf16 cannot
// hold 128 + q exactly for q >= 128).
template <typename T, int BITS>
struct Deq;

template <typename T>
struct Deq<T, 4> {
  using V = typename Half2<T>::V;
  static constexpr int kPairsPerWord = 4;
  struct Params {
    V s, b;
  };
  // A scale and bias already in T are duplicated into both halves (one PRMT each, the same
  // bits as the round trip through float); other types are rounded to T once.
  template <typename S>
  static __device__ __forceinline__ Params params(S s, S b) {
    if constexpr (Same<S, T>::value) {
      return {Half2<T>::dup(s), Half2<T>::dup(b)};
    } else {
      return {Half2<T>::splat(static_cast<float>(s)), Half2<T>::splat(static_cast<float>(b))};
    }
  }
  static __device__ __forceinline__ uint32_t pair(
      uint32_t w, int j, const Params& p) {
    // (M0 + q[j], M0 + q[j + 4]): ((w >> 4j) & 0x000F000F) | magic in one LOP3 (ptxas
    // emits two for the C expression: the second constant needs the register form).
    uint32_t u;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;"
        : "=r"(u)
        : "r"(w >> (4 * j)), "n"(0x000F000Fu), "n"(Half2<T>::kMagic));
    V q = __hsub2(bits_to<V>(u), Half2<T>::magic());
    return to_bits(__hfma2(q, p.s, p.b));
  }
};

template <>
struct Deq<__half, 8> {
  using V = __half2;
  static constexpr int kPairsPerWord = 2;
  struct Params {
    V s, b;
  };
  static __device__ __forceinline__ Params params(float s, float b) {
    return {Half2<__half>::splat(s), Half2<__half>::splat(b)};
  }
  static __device__ __forceinline__ uint32_t pair(
      uint32_t w, int j, const Params& p) {
    // bytes (2j, 2j+1) into the low bytes of two fp16 1024.0 values.
    uint32_t u = __byte_perm(w, 0x64646464u, j == 0 ? 0x4140u : 0x4342u);
    V q = __hsub2(bits_to<V>(u), Half2<__half>::magic());
    return to_bits(__hfma2(q, p.s, p.b));
  }
};

template <>
struct Deq<__nv_bfloat16, 8> {
  static constexpr int kPairsPerWord = 2;
  struct Params {
    float s, b;
  };
  static __device__ __forceinline__ Params params(float s, float b) {
    return {s, b};
  }
  static __device__ __forceinline__ uint32_t pair(
      uint32_t w, int j, const Params& p) {
    // byte i into the mantissa of fp32 2^23: exact 2^23 + q, minus 2^23.
    float q0 = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u + 2u * j)) -
        8388608.0f;
    float q1 = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7441u + 2u * j)) -
        8388608.0f;
    return to_bits(Half2<__nv_bfloat16>::pack(
        fmaf(q0, p.s, p.b), fmaf(q1, p.s, p.b)));
  }
};

// The B fragment (two 32-bit registers) for mma `s` of word `v`, taken from
// the thread's activation words xr (pairs of consecutive T values in k order).
template <int BITS>
struct XPair;

template <>
struct XPair<4> {
  // word v covers x[8v .. 8v+8); pairs must be (x[j], x[j+4]) like the weights.
  template <int XW>
  static __device__ __forceinline__ void get(
      const uint32_t (&xr)[XW], int v, int s, uint32_t& b0, uint32_t& b1) {
    const uint32_t lo = xr[4 * v + s];
    const uint32_t hi = xr[4 * v + s + 2];
    b0 = __byte_perm(lo, hi, 0x5410u);
    b1 = __byte_perm(lo, hi, 0x7632u);
  }
};

template <>
struct XPair<8> {
  // word v covers x[4v .. 4v+4); pairs are consecutive.
  template <int XW>
  static __device__ __forceinline__ void get(
      const uint32_t (&xr)[XW], int v, int s, uint32_t& b0, uint32_t& b1) {
    b0 = xr[2 * v];
    b1 = xr[2 * v + 1];
  }
};

template <typename T>
struct Mma;

template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(
      float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(
      float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// Defined in mma_extras.cuh, which qmv.py adds to the header only for launches that use them
// (an L2 prefetch hint, LP > 0; one row's activations shuffled, XS = 1): MLX builds the whole
// source into every call, so the other launches keep the shorter one. Referenced only from
// templates' discarded `if constexpr` branches, which are not instantiated: NVRTC rejects an
// inline function referenced and not defined (#821) where nvcc only warns, and the kernel body
// is no template (its discarded branches are still compiled), hence load_x_held_if.
template <int VW, int PF>
__device__ __forceinline__ void load_words_hinted(const uint32_t* p, uint32_t (&out)[VW]);
template <int BITS, int VW, int N, typename T>
__device__ __forceinline__ void load_x_held(const T* x0, int lane, uint32_t (&xh)[N]);
template <int VW, int MMAS, int XW>
__device__ __forceinline__ void x_fragment_held(
    const uint32_t (&xr)[XW], int v, int s, uint32_t& b0, uint32_t& b1);

template <bool XS, int BITS, int VW, int N, typename T>
__device__ __forceinline__ void load_x_held_if(const T* x0, int lane, uint32_t (&xh)[N]) {
  if constexpr (XS) {
    load_x_held<BITS, VW>(x0, lane, xh);
  }
}

// One chunk's products: the NT tiles' weight words wr (rows g and g + 8, VW words each)
// dequantized with their scale and bias and multiplied into acc by the tensor cores, against
// the activation words xr of each 8-row block (the k order inside an mma as mma_body.cu says).
// Both of the body's loops (runtime and compile-time shape) call it, so they do the same
// arithmetic in the same order. S: the scale/bias type as held (float or the weights' own).
template <typename T, int BITS, int NT, int MBLK, int VW, int XW, typename S, bool XSH = false>
__device__ __forceinline__ void chunk_products(
    float (&acc)[NT][MBLK][4], const uint32_t (&wr)[NT][2][VW], const S (&sc)[NT][2],
    const S (&bi)[NT][2], const uint32_t (&xr)[MBLK][XW]) {
  using Dq = Deq<T, BITS>;
  constexpr int MMAS = Dq::kPairsPerWord / 2;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const typename Dq::Params p0 = Dq::params(sc[j][0], bi[j][0]);
    const typename Dq::Params p1 = Dq::params(sc[j][1], bi[j][1]);
#pragma unroll
    for (int v = 0; v < VW; ++v) {
#pragma unroll
      for (int s = 0; s < MMAS; ++s) {
        const uint32_t a[4] = {
            Dq::pair(wr[j][0][v], 2 * s, p0), Dq::pair(wr[j][1][v], 2 * s, p1),
            Dq::pair(wr[j][0][v], 2 * s + 1, p0), Dq::pair(wr[j][1][v], 2 * s + 1, p1)};
#pragma unroll
        for (int mb = 0; mb < MBLK; ++mb) {
          uint32_t b0, b1;
          if constexpr (XSH) {
            x_fragment_held<VW, MMAS>(xr[0], v, s, b0, b1);
          } else {
            XPair<BITS>::get(xr[mb], v, s, b0, b1);
          }
          Mma<T>::run(acc[j][mb], a, b0, b1);
        }
      }
    }
  }
}

// VW consecutive 32-bit weight words, streamed (read once: evict first). PF > 0: the same load
// with an L2 prefetch-size hint of PF bytes (load_words_hinted, mma_extras.cuh).
template <int VW, int PF = 0>
__device__ __forceinline__ void load_words(
    const uint32_t* p, uint32_t (&out)[VW]) {
  if constexpr (PF > 0) {
    load_words_hinted<VW, PF>(p, out);
    return;
  }
  if constexpr (VW == 4) {
    uint4 v = __ldcs(reinterpret_cast<const uint4*>(p));
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
  } else if constexpr (VW == 2) {
    uint2 v = __ldcs(reinterpret_cast<const uint2*>(p));
    out[0] = v.x;
    out[1] = v.y;
  } else {
    out[0] = __ldcs(p);
  }
}

// XW 32-bit words of activations (kept in cache: every block reads them), or
// zeros for a padding row.
template <int XW, typename T>
__device__ __forceinline__ void load_x(
    const T* p, bool valid, uint32_t (&out)[XW]) {
  if (!valid) {
#pragma unroll
    for (int i = 0; i < XW; ++i) {
      out[i] = 0u;
    }
    return;
  }
  if constexpr (XW % 4 == 0) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < XW / 4; ++i) {
      uint4 v = __ldg(q + i);
      out[4 * i + 0] = v.x;
      out[4 * i + 1] = v.y;
      out[4 * i + 2] = v.z;
      out[4 * i + 3] = v.w;
    }
  } else {
    const uint2* q = reinterpret_cast<const uint2*>(p);
#pragma unroll
    for (int i = 0; i < XW / 2; ++i) {
      uint2 v = __ldg(q + i);
      out[2 * i + 0] = v.x;
      out[2 * i + 1] = v.y;
    }
  }
}

} // namespace ssk

#endif // SSK_MMA_CUDA_CUH
