// specserve fused decode/verify pass, CUDA: device helpers (the `header` of the kernel).
//
// See fused_body.cu for the pass itself. Everything here computes one output row's value with
// an arithmetic order that depends only on that row (never on how many rows share the launch,
// nor on which block or warp computes it).

// Global-memory load that bypasses L1: buffers written by other blocks earlier in the same
// launch (the scratch activations) must not be served from a stale L1 line.
__device__ __forceinline__ float4 ss_ldcg4(const float* p) {
  return __ldcg(reinterpret_cast<const float4*>(p));
}

// A grid-wide barrier for a launch whose blocks are all resident (the launcher starts at most
// one block per multiprocessor). Block b publishes its barrier count ("epoch") in bar[32 b]
// (one 128-byte line each, no atomics), then one warp of every block polls all blocks' slots
// until each has reached its own epoch. Every launch gets freshly zeroed slots, so a block
// starts from its own slot (0). Returns false after ~1 s
// of waiting (a block that never arrived), so a bad launch ends with an error flag instead of
// hanging the device. `bar` must live in device memory: MLX-CUDA keeps arrays of at most 8
// bytes in a managed-memory pool the host also touches, where a 2-word atomic barrier cost
// ~1 ms on an H200 (a one-counter atomic barrier in device memory still cost ~9 us).
__device__ __forceinline__ bool ss_grid_sync(unsigned int* bar, unsigned int& epoch) {
  __shared__ int ss_ok;
  __syncthreads();
  ++epoch;
  if (threadIdx.x < 32) {
    if (threadIdx.x == 0) {
      __threadfence();
      *reinterpret_cast<volatile unsigned int*>(bar + blockIdx.x * 32) = epoch;
    }
    __syncwarp();
    const long long t0 = clock64();
    int ok = 1;
    while (true) {
      bool arrived = true;
      for (int b = threadIdx.x; b < static_cast<int>(gridDim.x); b += 32) {
        const unsigned int f = *reinterpret_cast<volatile const unsigned int*>(bar + b * 32);
        arrived = arrived && static_cast<int>(f - epoch) >= 0;
      }
      if (__all_sync(0xffffffffu, arrived)) {
        break;
      }
      if (__any_sync(0xffffffffu, clock64() - t0 > 2000000000LL)) {
        ok = 0;
        break;
      }
    }
    __threadfence();
    if (threadIdx.x == 0) {
      ss_ok = ok;
    }
  }
  __syncthreads();
  return ss_ok != 0;
}

// RoPE (non-traditional, as mlx's nn.RoPE with traditional=False): rotates the pair
// (x[i], x[i + D/2]) by pos * inv_freq[i]. Explicitly rounded operations (no FMA contraction),
// so every call site computes the same bits for the same (pair, position).
__device__ __forceinline__ void ss_rope(float lo, float hi, int pos, float inv_freq, float& out_lo,
                                        float& out_hi) {
  const float ang = __fmul_rn(static_cast<float>(pos), inv_freq);
  float sn, cs;
  sincosf(ang, &sn, &cs);
  out_lo = __fsub_rn(__fmul_rn(lo, cs), __fmul_rn(hi, sn));
  out_hi = __fadd_rn(__fmul_rn(hi, cs), __fmul_rn(lo, sn));
}

// One warp's partial dot products of a quantized weight row with M <= MB activation rows,
// accumulated into acc. The row's packed words from k_base / PACK on (K more inputs) meet x,
// M rows of K floats in shared memory. Lane l takes words l, l + 32, ... in increasing order,
// dequantizes each (fp32 scale * q + bias) and accumulates x * w with fp32 FMAs; ss_warp_sum
// then adds the 32 lane sums by a fixed xor butterfly. Splitting a row into pieces whose word
// counts are multiples of 32 keeps every lane's words and their order: the same bits.
template <int BITS, int MB, typename S>
__device__ __forceinline__ void ss_qdot_acc(const uint32_t* __restrict__ wrow, const S* __restrict__ srow,
                                            const S* __restrict__ brow, int K, int k_base, int gshift, const float* x,
                                            int M, int lane, float* acc) {
  constexpr int PACK = 32 / BITS;
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  const int KW = K / PACK;
  const uint32_t* wp = wrow + k_base / PACK;
#pragma unroll 4
  for (int i = lane; i < KW; i += 32) {
    const int k0 = i * PACK;
    const int gi = (k_base + k0) >> gshift;
    const uint32_t word = wp[i];
    const float s = static_cast<float>(srow[gi]);
    const float b = static_cast<float>(brow[gi]);
    float wv[PACK];
#pragma unroll
    for (int p = 0; p < PACK; ++p) {
      const float q = __uint_as_float(0x4B000000u | ((word >> (BITS * p)) & MASK)) - 8388608.0f;
      wv[p] = fmaf(q, s, b);
    }
#pragma unroll
    for (int m = 0; m < MB; ++m) {
      if (m < M) {
#pragma unroll
        for (int p4 = 0; p4 < PACK; p4 += 4) {
          const float4 xv = *reinterpret_cast<const float4*>(x + m * K + k0 + p4);
          acc[m] = fmaf(xv.x, wv[p4 + 0], acc[m]);
          acc[m] = fmaf(xv.y, wv[p4 + 1], acc[m]);
          acc[m] = fmaf(xv.z, wv[p4 + 2], acc[m]);
          acc[m] = fmaf(xv.w, wv[p4 + 3], acc[m]);
        }
      }
    }
  }
}

// The whole row (K inputs) against x in shared memory, acc reset first.
template <int BITS, int MB, typename S>
__device__ __forceinline__ void ss_qdot(const uint32_t* __restrict__ wrow, const S* __restrict__ srow,
                                        const S* __restrict__ brow, int K, int gshift, const float* x, int M, int lane,
                                        float* acc) {
#pragma unroll
  for (int m = 0; m < MB; ++m) {
    acc[m] = 0.0f;
  }
  ss_qdot_acc<BITS, MB, S>(wrow, srow, brow, K, 0, gshift, x, M, lane, acc);
}

// Copy M rows of K floats (global, written earlier in this launch) into shared memory, all
// threads of the block (float4 steps; K a multiple of 4). Ends with __syncthreads.
__device__ __forceinline__ void ss_stage(const float* src, int n, float* dst) {
  for (int i = threadIdx.x * 4; i < n; i += blockDim.x * 4) {
    *reinterpret_cast<float4*>(dst + i) = ss_ldcg4(src + i);
  }
  __syncthreads();
}

__device__ __forceinline__ float ss_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;
}

// One head of HD floats at r (global, written earlier in this launch), lane t taking
// r[t DL .. t DL + DL - 1] (DL = HD / 32) into v; returns rsqrt(mean(r^2) + eps), the same bits
// in every lane (Qwen3's per-head q/k RMSNorm: v[dd] * inv * g[t DL + dd]).
template <int HD>
__device__ __forceinline__ float ss_head_rms(const float* r, float eps, int lane, float* v) {
  constexpr int DL = HD / 32;
  float ss = 0.0f;
#pragma unroll
  for (int dd = 0; dd < DL; ++dd) {
    v[dd] = __ldcg(r + lane * DL + dd);
    ss = fmaf(v[dd], v[dd], ss);
  }
  return rsqrtf(ss_warp_sum(ss) / static_cast<float>(HD) + eps);
}

// RMSNorm of M rows of `src` (global, [M, DM]) into shared `xs`: xs[m, k] = src[m, k] *
// rsqrt(mean_k(src[m, k]^2) + eps) * g[k]. Warp w normalizes rows w, w + W, ...; lane l holds
// the row's float4s at k = 4 l, 4 l + 128, ... (one load each, all in flight together), sums
// their squares in increasing k, then the butterfly.
template <int DM, int W>
__device__ __forceinline__ void ss_rmsnorm(const float* src, const float* __restrict__ g, float eps, int M,
                                           float* xs) {
  constexpr int NV = (DM + 127) / 128;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  for (int m = warp; m < M; m += W) {
    float4 v[NV];
#pragma unroll
    for (int t = 0; t < NV; ++t) {
      const int k = lane * 4 + t * 128;
      v[t] = k < DM ? ss_ldcg4(src + m * DM + k) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    float ss = 0.0f;
#pragma unroll
    for (int t = 0; t < NV; ++t) {
      if (lane * 4 + t * 128 < DM) {
        ss = fmaf(v[t].x, v[t].x, ss);
        ss = fmaf(v[t].y, v[t].y, ss);
        ss = fmaf(v[t].z, v[t].z, ss);
        ss = fmaf(v[t].w, v[t].w, ss);
      }
    }
    ss = ss_warp_sum(ss);
    const float inv = rsqrtf(ss / static_cast<float>(DM) + eps);
#pragma unroll
    for (int t = 0; t < NV; ++t) {
      const int k = lane * 4 + t * 128;
      if (k < DM) {
        xs[m * DM + k + 0] = v[t].x * inv * g[k + 0];
        xs[m * DM + k + 1] = v[t].y * inv * g[k + 1];
        xs[m * DM + k + 2] = v[t].z * inv * g[k + 2];
        xs[m * DM + k + 3] = v[t].w * inv * g[k + 3];
      }
    }
  }
  __syncthreads();
}

// out[m, n] = res[m, n] + sum_k src[m, k] W[n, k] for rows n of a quantized W [N, K] (the o_proj
// and down_proj phases), warp w of the grid taking rows w, w + (all warps), ... src [M, K]
// (global, written earlier in this launch) reaches the warps through shared memory xs (CAP
// floats): whole when M K fits, else in column tiles of KT inputs, KT a multiple of 32 packed
// words (ss_qdot_acc: the same bits as one piece, whatever M). res/out are [M, N]; res may be
// nullptr (no residual: out = src W^T).
template <int BITS, int MB, int W, typename S>
__device__ __forceinline__ void ss_proj_residual(const uint32_t* w, const S* sc, const S* bi, int N, int K, int gshift,
                                                 int NG, const float* src, const float* res, float* out, int M,
                                                 float* xs, int CAP) {
  constexpr int PACK = 32 / BITS;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int TW = gridDim.x * W;
  auto finish = [&](int n, float* acc) {
#pragma unroll
    for (int m = 0; m < MB; ++m) {
      if (m < M) {
        const float v = ss_warp_sum(acc[m]);
        if (lane == 0) {
          out[m * N + n] = res != nullptr ? __ldcg(res + m * N + n) + v : v;
        }
      }
    }
  };
  if (M * K <= CAP) {
    ss_stage(src, M * K, xs);
    for (int n = blockIdx.x * W + warp; n < N; n += TW) {
      float acc[MB];
      ss_qdot<BITS, MB, S>(w + (size_t)n * (K / PACK), sc + (size_t)n * NG, bi + (size_t)n * NG, K, gshift, xs, M,
                           lane, acc);
      finish(n, acc);
    }
    return;
  }
  const int KT = (CAP / M) / (32 * PACK) * (32 * PACK);
  for (int base = blockIdx.x * W; base < N; base += TW) {  // the same trip count for a block's warps
    const int n = base + warp;
    float acc[MB];
#pragma unroll
    for (int m = 0; m < MB; ++m) {
      acc[m] = 0.0f;
    }
    for (int k0 = 0; k0 < K; k0 += KT) {
      const int kt = min(KT, K - k0);
      for (int i = threadIdx.x * 4; i < M * kt; i += blockDim.x * 4) {
        const int m = i / kt;
        *reinterpret_cast<float4*>(xs + i) = ss_ldcg4(src + (size_t)m * K + k0 + (i - m * kt));
      }
      __syncthreads();
      if (n < N) {
        ss_qdot_acc<BITS, MB, S>(w + (size_t)n * (K / PACK), sc + (size_t)n * NG, bi + (size_t)n * NG, kt, k0, gshift,
                                 xs, M, lane, acc);
      }
      __syncthreads();
    }
    if (n < N) {
      finish(n, acc);
    }
  }
}
