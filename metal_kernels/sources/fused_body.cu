// specserve fused decode/verify pass, CUDA: the body of one mx.fast.cuda_kernel launch that
// runs every decoder layer and the LM head of a Llama-family target for M <= MB rows.
//
// Why: a small target's decode step is bound by kernel launches and host work (about 20 MLX
// ops per layer), not by reading its weights. Here the whole pass is one launch of one
// block per multiprocessor; phases are separated by a grid-wide barrier (fused_cuda.cuh),
// five per layer:
//   A  RMSNorm (every block, into shared memory) + q/k/v projections (rows over all warps)
//   B  RoPE'd new keys and values into kn/vn, then causal attention, one (row, head) per block
//   C  o_proj + residual                      -> hmid
//   D  RMSNorm + gate/up projections + SiLU   -> act
//   E  down_proj + residual                   -> hidden[l] (the next layer's input)
// and after the last layer the final RMSNorm + LM head -> logits.
//
// Exactness: each output row's arithmetic depends on that row alone (fixed lane order,
// butterflies, key chunks; see the helpers), so row i of an M-row pass is bit-identical to
// the 1-row pass at the same position: verify rows equal decode steps whatever the width.
//
// Template constants: NL layers, DM hidden size, NH/NKV query/key-value heads, HD head dim
// (64 or 128), DI intermediate size, MB most rows, W warps per block, BITS (projections) and
// HBITS (LM head) quantization bits, EPS_BITS / SCALE_BITS the float bit patterns of the
// RMSNorm epsilon and the softmax scale; ST the scales/biases type; SKIP a bit mask of phases
// to leave out (A 1, B 2, C 4, D 8, E 16, LM head 32), for profiling only: 0 in service. The launcher prepends the
// per-layer KV-cache pointer tables KC / VC (inputs kc0.., vc0..: the caches' [1, NKV, P, HD]
// arrays, possibly views with rows of HD contiguous; every layer's with the same strides). The
// cached length S is the length of input `pos`, a stride-0 view: a kernel parameter rather
// than device memory the host writes each step.
constexpr int NQKV = (NH + 2 * NKV) * HD;
constexpr int NA = NH * HD;
constexpr int HALF = HD / 2;
constexpr int DL = HD / 32;
constexpr unsigned FULL = 0xffffffffu;
const float NEG_INF = __int_as_float(0xff800000u);
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int NB = gridDim.x;
const int gw = blockIdx.x * W + warp;
const int TW = NB * W;
const int M = x0_shape[0];
const int S = pos_shape[0];
const int64_t KHS = kc0_strides[1];  // elements between KV heads
const int64_t VHS = vc0_strides[1];
const int V = we_shape[0];
const float eps = __int_as_float(EPS_BITS);
const float qscale = __int_as_float(SCALE_BITS) * 1.4426950408889634f;
unsigned int* barp = const_cast<unsigned int*>(reinterpret_cast<const unsigned int*>(bar));
unsigned int epoch = *reinterpret_cast<volatile const unsigned int*>(barp + blockIdx.x * 32);

auto gshift_of = [](int K, int NG) {
  int s = 0;
  while ((NG << s) < K) {
    ++s;
  }
  return s;
};
const int gs_qkv = gshift_of(DM, sqkv_shape[2]);
const int gs_o = gshift_of(NA, so_shape[2]);
const int gs_gu = gshift_of(DM, sgu_shape[2]);
const int gs_d = gshift_of(DI, sd_shape[2]);
const int gs_e = gshift_of(DM, se_shape[1]);
const int ng_qkv = sqkv_shape[2];
const int ng_o = so_shape[2];
const int ng_gu = sgu_shape[2];
const int ng_d = sd_shape[2];
const int ng_e = se_shape[1];
constexpr int PK = 32 / BITS;
constexpr int HPK = 32 / HBITS;

__shared__ __align__(16) float xs[MB * DM];
__shared__ float qs[HD];
__shared__ float wm[W];
__shared__ float wl[W];
__shared__ float wacc[W][HD];

bool ok = true;
for (int l = 0; l < NL; ++l) {
  const float* hin = l == 0 ? x0 : hidden + (size_t)(l - 1) * M * DM;
  float* hout = hidden + (size_t)l * M * DM;

  // ---- A: RMSNorm + q/k/v projections (pre-RoPE) -> qkv [M, NQKV]
  if (!(SKIP & 1)) {
    ss_rmsnorm<DM, W>(hin, norms + (size_t)l * 2 * DM, eps, M, xs);
    const uint32_t* w = wqkv + (size_t)l * NQKV * (DM / PK);
    const ST* sc = sqkv + (size_t)l * NQKV * ng_qkv;
    const ST* bi = bqkv + (size_t)l * NQKV * ng_qkv;
    for (int n = gw; n < NQKV; n += TW) {
      float acc[MB];
      ss_qdot<BITS, MB, true, ST>(w + (size_t)n * (DM / PK), sc + (size_t)n * ng_qkv, bi + (size_t)n * ng_qkv, DM,
                                 gs_qkv, xs, M, lane, acc);
#pragma unroll
      for (int m = 0; m < MB; ++m) {
        if (m < M) {
          const float v = ss_warp_sum(acc[m]);
          if (lane == 0) {
            qkv[m * NQKV + n] = v;
          }
        }
      }
    }
  }
  if (!(ok = ss_grid_sync(barp, epoch))) {
    break;
  }

  // ---- B: new keys (RoPE'd) and values -> kn/vn [NL, NKV, M, HD]; attention -> att [M, NA]
  for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < ((SKIP & 2) ? 0 : M * NKV * HALF);
       idx += NB * blockDim.x) {
    const int i = idx % HALF;
    const int g = (idx / HALF) % NKV;
    const int m = idx / (HALF * NKV);
    const float* kr = qkv + m * NQKV + NA + g * HD;
    const float* vr = kr + NKV * HD;
    const size_t o = (((size_t)l * NKV + g) * M + m) * HD;
    float lo, hi;
    ss_rope(__ldcg(kr + i), __ldcg(kr + i + HALF), S + m, inv_freq[i], lo, hi);
    kn[o + i] = lo;
    kn[o + i + HALF] = hi;
    vn[o + i] = __ldcg(vr + i);
    vn[o + i + HALF] = __ldcg(vr + i + HALF);
  }
  for (int u = blockIdx.x; u < ((SKIP & 2) ? 0 : M * NH); u += NB) {
    const int m = u / NH;
    const int h = u - m * NH;
    const int g = h / (NH / NKV);
    const int nk = S + m + 1;
    const float* qr = qkv + m * NQKV + h * HD;
    for (int i = threadIdx.x; i < HALF; i += blockDim.x) {
      float lo, hi;
      ss_rope(__ldcg(qr + i), __ldcg(qr + i + HALF), S + m, inv_freq[i], lo, hi);
      qs[i] = lo * qscale;
      qs[i + HALF] = hi * qscale;
    }
    __syncthreads();
    const float* kc = KC[l] + g * KHS;
    const float* vc = VC[l] + g * VHS;
    const float* knew = qkv + NA + g * HD;           // new row r: knew + r * NQKV (pre-RoPE)
    const float* vnew = qkv + NA + NKV * HD + g * HD;  // new row r: vnew + r * NQKV
    float mx_ = NEG_INF;
    float sum = 0.0f;
    float acc[DL];
#pragma unroll
    for (int dd = 0; dd < DL; ++dd) {
      acc[dd] = 0.0f;
    }
    // Keys in absolute chunks of 32; warp w takes chunks w, w + W, ... Lane t scores key
    // c0 + t with a sequential HD-term dot product (cached or new keys alike: new keys are
    // RoPE'd with the same bits kn gets), then online softmax in base 2.
    for (int c0 = warp * 32; c0 < nk; c0 += W * 32) {
      const int j = c0 + lane;
      float s = NEG_INF;
      if (j < nk) {
        float dot = 0.0f;
        if (j < S) {
          const float* kr = kc + (size_t)j * HD;
#pragma unroll
          for (int d0 = 0; d0 < HD; d0 += 16) {
            float kk[16];
#pragma unroll
            for (int t = 0; t < 16; t += 4) {
              const float4 v4 = *reinterpret_cast<const float4*>(kr + d0 + t);
              kk[t] = v4.x;
              kk[t + 1] = v4.y;
              kk[t + 2] = v4.z;
              kk[t + 3] = v4.w;
            }
#pragma unroll
            for (int t = 0; t < 16; ++t) {
              dot = fmaf(qs[d0 + t], kk[t], dot);
            }
          }
        } else {
          const float* kr = knew + (size_t)(j - S) * NQKV;
#pragma unroll
          for (int d0 = 0; d0 < HD; d0 += 16) {
            float kk[16];
#pragma unroll
            for (int t = 0; t < 16; ++t) {
              const int d = d0 + t;
              const int i = d < HALF ? d : d - HALF;
              float lo, hi;
              ss_rope(__ldcg(kr + i), __ldcg(kr + i + HALF), j, inv_freq[i], lo, hi);
              kk[t] = d < HALF ? lo : hi;
            }
#pragma unroll
            for (int t = 0; t < 16; ++t) {
              dot = fmaf(qs[d0 + t], kk[t], dot);
            }
          }
        }
        s = dot;
      }
      float cm = s;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        cm = fmaxf(cm, __shfl_xor_sync(FULL, cm, o));
      }
      const float mn = fmaxf(mx_, cm);
      const float p = j < nk ? exp2f(s - mn) : 0.0f;
      float ps = p;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        ps += __shfl_xor_sync(FULL, ps, o);
      }
      const float corr = exp2f(mx_ - mn);
      sum = sum * corr + ps;
#pragma unroll
      for (int dd = 0; dd < DL; ++dd) {
        acc[dd] *= corr;
      }
      const int jn = min(32, nk - c0);
      for (int t0 = 0; t0 < jn; t0 += 16) {
        float vv[16][DL];
#pragma unroll
        for (int t = 0; t < 16; ++t) {
          const int jc = min(c0 + t0 + t, nk - 1);  // past the last key: weight 0, any valid row
          const float* vr = jc < S ? vc + (size_t)jc * HD : vnew + (size_t)(jc - S) * NQKV;
#pragma unroll
          for (int dd = 0; dd < DL; ++dd) {
            vv[t][dd] = __ldcg(vr + lane * DL + dd);
          }
        }
#pragma unroll
        for (int t = 0; t < 16; ++t) {
          const float pt = __shfl_sync(FULL, p, t0 + t);
#pragma unroll
          for (int dd = 0; dd < DL; ++dd) {
            acc[dd] = fmaf(pt, vv[t][dd], acc[dd]);
          }
        }
      }
      mx_ = mn;
    }
    if (lane == 0) {
      wm[warp] = mx_;
      wl[warp] = sum;
    }
#pragma unroll
    for (int dd = 0; dd < DL; ++dd) {
      wacc[warp][lane * DL + dd] = acc[dd];
    }
    __syncthreads();
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
      float mt = wm[0];
      for (int w2 = 1; w2 < W; ++w2) {
        mt = fmaxf(mt, wm[w2]);
      }
      float lt = 0.0f;
      float ot = 0.0f;
      for (int w2 = 0; w2 < W; ++w2) {
        const float f = exp2f(wm[w2] - mt);
        lt = fmaf(wl[w2], f, lt);
        ot = fmaf(wacc[w2][d], f, ot);
      }
      att[m * NA + h * HD + d] = ot / lt;
    }
    __syncthreads();
  }
  if (!(ok = ss_grid_sync(barp, epoch))) {
    break;
  }

  // ---- C: o_proj + residual -> hmid [M, DM]
  if (!(SKIP & 4)) {
    const bool staged = M * NA <= MB * DM;
    if (staged) {
      ss_stage(att, M * NA, xs);
    }
    const uint32_t* w = wo + (size_t)l * DM * (NA / PK);
    const ST* sc = so + (size_t)l * DM * ng_o;
    const ST* bi = bo + (size_t)l * DM * ng_o;
    for (int n = gw; n < DM; n += TW) {
      float acc[MB];
      if (staged) {
        ss_qdot<BITS, MB, true, ST>(w + (size_t)n * (NA / PK), sc + (size_t)n * ng_o, bi + (size_t)n * ng_o, NA, gs_o,
                                    xs, M, lane, acc);
      } else {
        ss_qdot<BITS, MB, false, ST>(w + (size_t)n * (NA / PK), sc + (size_t)n * ng_o, bi + (size_t)n * ng_o, NA, gs_o,
                                     att, M, lane, acc);
      }
#pragma unroll
      for (int m = 0; m < MB; ++m) {
        if (m < M) {
          const float v = ss_warp_sum(acc[m]);
          if (lane == 0) {
            hmid[m * DM + n] = __ldcg(hin + m * DM + n) + v;
          }
        }
      }
    }
  }
  if (!(ok = ss_grid_sync(barp, epoch))) {
    break;
  }

  // ---- D: RMSNorm + gate/up projections + SiLU(gate) * up -> act [M, DI]
  if (!(SKIP & 8)) {
    ss_rmsnorm<DM, W>(hmid, norms + (size_t)l * 2 * DM + DM, eps, M, xs);
    const uint32_t* w = wgu + (size_t)l * 2 * DI * (DM / PK);
    const ST* sc = sgu + (size_t)l * 2 * DI * ng_gu;
    const ST* bi = bgu + (size_t)l * 2 * DI * ng_gu;
    for (int n = gw; n < DI; n += TW) {
      float ag[MB];
      float au[MB];
      ss_qdot<BITS, MB, true, ST>(w + (size_t)n * (DM / PK), sc + (size_t)n * ng_gu, bi + (size_t)n * ng_gu, DM,
                                 gs_gu, xs, M, lane, ag);
      const size_t nu = (size_t)(DI + n);
      ss_qdot<BITS, MB, true, ST>(w + nu * (DM / PK), sc + nu * ng_gu, bi + nu * ng_gu, DM, gs_gu, xs, M, lane, au);
#pragma unroll
      for (int m = 0; m < MB; ++m) {
        if (m < M) {
          const float gv = ss_warp_sum(ag[m]);
          const float uv = ss_warp_sum(au[m]);
          if (lane == 0) {
            act[m * DI + n] = gv / (1.0f + expf(-gv)) * uv;
          }
        }
      }
    }
  }
  if (!(ok = ss_grid_sync(barp, epoch))) {
    break;
  }

  // ---- E: down_proj + residual -> hidden[l]
  if (!(SKIP & 16)) {
    const bool staged = M * DI <= MB * DM;
    if (staged) {
      ss_stage(act, M * DI, xs);
    }
    const uint32_t* w = wd + (size_t)l * DM * (DI / PK);
    const ST* sc = sd + (size_t)l * DM * ng_d;
    const ST* bi = bd + (size_t)l * DM * ng_d;
    for (int n = gw; n < DM; n += TW) {
      float acc[MB];
      if (staged) {
        ss_qdot<BITS, MB, true, ST>(w + (size_t)n * (DI / PK), sc + (size_t)n * ng_d, bi + (size_t)n * ng_d, DI, gs_d,
                                    xs, M, lane, acc);
      } else {
        ss_qdot<BITS, MB, false, ST>(w + (size_t)n * (DI / PK), sc + (size_t)n * ng_d, bi + (size_t)n * ng_d, DI, gs_d,
                                     act, M, lane, acc);
      }
#pragma unroll
      for (int m = 0; m < MB; ++m) {
        if (m < M) {
          const float v = ss_warp_sum(acc[m]);
          if (lane == 0) {
            hout[m * DM + n] = __ldcg(hmid + m * DM + n) + v;
          }
        }
      }
    }
  }
  if (!(ok = ss_grid_sync(barp, epoch))) {
    break;
  }
}

// ---- final RMSNorm + LM head -> logits [M, V]
if (ok && !(SKIP & 32)) {
  ss_rmsnorm<DM, W>(hidden + (size_t)(NL - 1) * M * DM, fnorm, eps, M, xs);
  for (int n = gw; n < V; n += TW) {
    float acc[MB];
    ss_qdot<HBITS, MB, true, ST>(we + (size_t)n * (DM / HPK), se + (size_t)n * ng_e, bee + (size_t)n * ng_e, DM, gs_e,
                                xs, M, lane, acc);
#pragma unroll
    for (int m = 0; m < MB; ++m) {
      if (m < M) {
        const float v = ss_warp_sum(acc[m]);
        if (lane == 0) {
          logits[(size_t)m * V + n] = v;
        }
      }
    }
  }
}
if (threadIdx.x == 0) {
  err[blockIdx.x] = ok ? 0 : 1;
}
