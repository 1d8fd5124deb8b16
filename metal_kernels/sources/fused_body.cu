// specserve fused decode/verify pass, CUDA: the body of one mx.fast.cuda_kernel launch that
// runs every decoder layer and the LM head of a Llama-family target for M <= MB rows.
//
// Why: a small target's decode step is bound by kernel launches and host work (about 20 MLX
// ops per layer), not by reading its weights. Here the whole pass is one launch of one
// block per multiprocessor; phases are separated by a grid-wide barrier (fused_cuda.cuh),
// five per layer:
//   A  RMSNorm (every block, into shared memory) + q/k/v projections (rows over all warps)
//   B  RoPE'd new keys and values appended to the KV cache; causal attention, split by
//      (row, head, segment of 32 W keys)
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
// to leave out (A 1, B 2, C 4, D 8, E 16, LM head 32), for profiling only: 0 in service; PROF
// 1 records per-block cycle counts per phase in `prof` (profiling only). QKN 1: Qwen3's
// per-head q/k RMSNorm (weights `qkn` [NL, 2, HD]) between phases A and B, behind one more grid
// barrier. BIDIR 1: every row attends to all M new rows (a DSpark draft block, which is
// bidirectional), else causally. The target's pass has QKN = BIDIR = 0. MARKOV 1 (a greedy
// DSpark draft, after the LM head): x_k = argmax(logits[k] + W2 W1[x_{k-1}]) left to right from
// x_0 = tok0[0], with the Markov head's MR-rank quantized tables (mw1/ms1/mb1, mw2/ms2/mb2, MBITS
// bits) -> dtok; DV 1: the LM head's rows we/se/bee and W2's are a draft vocabulary's V' rows
// (FR-Spec), and a draft's row index v is the target token dvoc[v] (in dtok, and as the next
// draft's W1 row); CONF 1 / 2: the confidence head sigmoid(cw . [h_k (; W1[x_{k-1}])] + cb) -> dconf
// (h_k the final-normed row). One grid barrier per draft (the argmax over all blocks' candidates
// in `cand`, two sets of 2 NB floats used in turn). ABS 1 (a DSpark draft cache update before
// the block): the A = crow_shape[0] new context rows crow [A, NT DM] (tapped target states of
// positions S - A .. S - 1) become hidden_norm(fc(.)) (wfc/sfc/bfc, hnw), then each draft
// layer's k_norm'd, RoPE'd keys and its values at those positions of the cache buffers; three
// more grid barriers. The launcher prepends
// the per-layer KV-cache pointer tables KC / VC (inputs kc0.., vc0..: the caches' [1, NKV, P,
// HD] buffers, contiguous, every layer's the same shape: FusedPass._writable makes them so).
// The pass reads keys/values 0..S-1 and WRITES its own rows S..S+M-1 into these buffers in
// place (buffers no other array shares, with room for the rows). The cached length S is the
// length of input `pos`, and the attention segments of the last row the length of `pseg`:
// stride-0 views, so kernel parameters rather than device memory the host writes each step.
// `bar` holds the barrier slots (32 words per block) and then one attention counter per
// (layer, row, head); the launcher zeroes it for every launch.
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
unsigned int* cnt = barp + NB * 32;  // per (layer, row, head): attention segments done
const int PSEG = pseg_shape[0];  // attention segments of the last row: `part` holds that many per (row, head)
long long tprof = PROF ? clock64() : 0;
// A grid barrier; with PROF, block b records for slot k the cycles of its own work since the
// previous barrier and of its wait here (prof[b, k] = (work, wait)).
auto sync_ = [&](int slot) -> bool {
  const long long ta = PROF ? clock64() : 0;
  const bool r = ss_grid_sync(barp, epoch);
  if (PROF && threadIdx.x == 0) {
    const long long tb = clock64();
    prof[((size_t)blockIdx.x * (NL * 5 + 2) + slot) * 2] = static_cast<unsigned int>(ta - tprof);
    prof[((size_t)blockIdx.x * (NL * 5 + 2) + slot) * 2 + 1] = static_cast<unsigned int>(tb - ta);
    tprof = tb;
  }
  return r;
};
constexpr int SEG = W * 32;

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
constexpr int GQ = NH / NKV;  // query heads per KV head
__shared__ float qs[GQ * HD];
__shared__ float wm[W * GQ];
__shared__ float wl[W * GQ];

// Attention work units (phase B): (row m, KV head g, key segment sg), rows in order, then KV
// heads; a unit serves the GQ query heads of its KV head.
// the last key position row m attends to
auto last_key = [&](int m) { return BIDIR ? S + M - 1 : S + m; };
int units = 0;
for (int m = 0; m < M; ++m) {
  units += NKV * (last_key(m) / SEG + 1);
}
auto unit_of = [&](int u, int& m, int& g, int& sg) {
  m = 0;
  while (u >= NKV * (last_key(m) / SEG + 1)) {
    u -= NKV * (last_key(m) / SEG + 1);
    ++m;
  }
  const int nseg = last_key(m) / SEG + 1;
  g = u / nseg;
  sg = u - g * nseg;
};
bool ok = true;
// ---- Z (ABS): the new context rows into the draft cache, before the block reads it
if (ABS) {
  const int A = crow_shape[0];
  const int S0 = S - A;
  constexpr int NKVD = 2 * NKV * HD;  // a layer's keys and values per row
  // Z1: fc -> cfc [A, DM], in chunks of up to MB rows (A may exceed MB: each chunk is a pass
  // over fc's rows; a row's arithmetic does not depend on its chunk)
  for (int c0 = 0; c0 < A; c0 += MB) {
    if (c0) {
      __syncthreads();  // (the block's warps are done reading xs)
    }
    ss_proj_residual<BITS, MB, W, ST>(wfc, sfc, bfc, DM, NT * DM, gshift_of(NT * DM, sfc_shape[1]), sfc_shape[1],
                                      crow + (size_t)c0 * NT * DM, nullptr, cfc + (size_t)c0 * DM, min(MB, A - c0),
                                      xs, MB * DM);
  }
  ok = ss_grid_sync(barp, epoch);
  // Z2: hidden_norm, then every layer's k/v projections (rows NA.. of its wqkv) -> ckv [NL, A, NKVD],
  // chunk by chunk as Z1
  if (ok) {
    for (int c0 = 0; c0 < A; c0 += MB) {
      const int AC = min(MB, A - c0);
      if (c0) {
        __syncthreads();
      }
      ss_rmsnorm<DM, W>(cfc + (size_t)c0 * DM, hnw, eps, AC, xs);
      for (int t = gw; t < NL * NKVD; t += TW) {
        const int l = t / NKVD;
        const int n = NA + (t - l * NKVD);
        const size_t row = (size_t)l * NQKV + n;
        float acc[MB];
        ss_qdot<BITS, MB, ST>(wqkv + row * (DM / PK), sqkv + row * ng_qkv, bqkv + row * ng_qkv, DM, gs_qkv, xs, AC,
                              lane, acc);
#pragma unroll
        for (int m = 0; m < MB; ++m) {
          if (m < AC) {
            const float v = ss_warp_sum(acc[m]);
            if (lane == 0) {
              ckv[((size_t)l * A + c0 + m) * NKVD + (n - NA)] = v;
            }
          }
        }
      }
    }
    ok = ss_grid_sync(barp, epoch);
  }
  // Z3: k_norm + RoPE at S0 + m into the keys, values as they are; one warp per (layer, row, KV
  // head), lane t holding dims t DL .. t DL + DL - 1 (a RoPE pair's other half sits in lane t ^ 16)
  if (ok) {
    for (int t = gw; t < NL * A * NKV; t += TW) {
      const int l = t / (A * NKV);
      const int m = (t / NKV) % A;
      const int g = t % NKV;
      const float* kr = ckv + ((size_t)l * A + m) * NKVD + g * HD;
      const float* vr = kr + NKV * HD;
      const float* gk = qkn + ((size_t)l * 2 + 1) * HD;
      float kv_[DL];
      const float inv = ss_head_rms<HD>(kr, eps, lane, kv_);
      float* kd = const_cast<float*>(KC[l]) + g * KHS + (int64_t)(S0 + m) * HD;
      float* vd = const_cast<float*>(VC[l]) + g * VHS + (int64_t)(S0 + m) * HD;
#pragma unroll
      for (int dd = 0; dd < DL; ++dd) {
        const int i = lane * DL + dd;
        const float own = kv_[dd] * inv * gk[i];
        const float other = __shfl_xor_sync(FULL, own, 16);
        float lo, hi;
        const bool low = i < HALF;
        ss_rope(low ? own : other, low ? other : own, S0 + m, inv_freq[low ? i : i - HALF], lo, hi);
        kd[i] = low ? lo : hi;
        vd[i] = __ldcg(vr + i);
      }
    }
    ok = ss_grid_sync(barp, epoch);
  }
}
for (int l = 0; l < NL && ok; ++l) {
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
      ss_qdot<BITS, MB, ST>(w + (size_t)n * (DM / PK), sc + (size_t)n * ng_qkv, bi + (size_t)n * ng_qkv, DM,
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
  if (!(ok = sync_(l * 5 + 0))) {
    break;
  }
  // ---- A2 (QKN only): RMSNorm over each q and k head of qkv, in place; one warp per (row, head)
  if (QKN) {
    for (int t = gw; t < M * (NH + NKV); t += TW) {
      const int m = t / (NH + NKV);
      const int hh = t - m * (NH + NKV);
      float* r = qkv + m * NQKV + hh * HD;
      const float* gq = qkn + ((size_t)l * 2 + (hh < NH ? 0 : 1)) * HD;
      float v[DL];
      const float inv = ss_head_rms<HD>(r, eps, lane, v);
#pragma unroll
      for (int dd = 0; dd < DL; ++dd) {
        r[lane * DL + dd] = v[dd] * inv * gq[lane * DL + dd];
      }
    }
    if (!(ok = ss_grid_sync(barp, epoch))) {
      break;
    }
  }

  // ---- B: the pass's keys (RoPE'd) and values appended to the cache at S..S+M-1; attention
  // -> att [M, NA]. A row's keys are split into segments of SEG = 32 W absolute positions, one
  // 32-key chunk per warp; a work unit is (row, KV head, segment), serving that KV head's GQ
  // query heads (each key is read once for all of them). A row with one segment writes its
  // output directly; otherwise each unit writes its heads' partials (max, sum, weighted values)
  // to `part` and the unit that finishes last (a per-(layer, row, KV head) counter) combines
  // the partials in segment order. Segments depend on the row's position only, so the bits do not
  // depend on M or on which block runs a unit. The new keys are read from qkv, never from the
  // cache being written in this phase.
  for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < ((SKIP & 2) ? 0 : M * NKV * HALF);
       idx += NB * blockDim.x) {
    const int i = idx % HALF;
    const int g = (idx / HALF) % NKV;
    const int m = idx / (HALF * NKV);
    const float* kr = qkv + m * NQKV + NA + g * HD;
    const float* vr = kr + NKV * HD;
    float* kd = const_cast<float*>(KC[l]) + g * KHS + (int64_t)(S + m) * HD;
    float* vd = const_cast<float*>(VC[l]) + g * VHS + (int64_t)(S + m) * HD;
    float lo, hi;
    ss_rope(__ldcg(kr + i), __ldcg(kr + i + HALF), S + m, inv_freq[i], lo, hi);
    kd[i] = lo;
    kd[i + HALF] = hi;
    vd[i] = __ldcg(vr + i);
    vd[i + HALF] = __ldcg(vr + i + HALF);
  }
  for (int u = blockIdx.x; u < ((SKIP & 2) ? 0 : units); u += NB) {
    int m, g, sg;
    unit_of(u, m, g, sg);
    const int nseg = last_key(m) / SEG + 1;  // segments of keys 0..last_key(m)
    const int nk = last_key(m) + 1;
    // the GQ query heads of KV head g (h = g GQ + hh), RoPE'd and scaled
    for (int i = threadIdx.x; i < GQ * HALF; i += blockDim.x) {
      const int hh = i / HALF;
      const int ii = i - hh * HALF;
      const float* qr = qkv + m * NQKV + (g * GQ + hh) * HD;
      float lo, hi;
      ss_rope(__ldcg(qr + ii), __ldcg(qr + ii + HALF), S + m, inv_freq[ii], lo, hi);
      qs[hh * HD + ii] = lo * qscale;
      qs[hh * HD + ii + HALF] = hi * qscale;
    }
    // this segment's new keys (positions S..S+m), RoPE'd once into shared memory (xs is free
    // during phase B); the same bits as the cache copy appended above
    const int c_lo = sg * SEG;
    const int n_lo = max(c_lo, S);
    const int n_hi = min(c_lo + SEG, nk);
    for (int idx = threadIdx.x; idx < max(n_hi - n_lo, 0) * HALF; idx += blockDim.x) {
      const int i = idx % HALF;
      const int j = n_lo + idx / HALF;
      const float* kr = qkv + (j - S) * NQKV + NA + g * HD;
      float lo, hi;
      ss_rope(__ldcg(kr + i), __ldcg(kr + i + HALF), j, inv_freq[i], lo, hi);
      xs[(j - S) * HD + i] = lo;
      xs[(j - S) * HD + i + HALF] = hi;
    }
    __syncthreads();
    const float* kc = KC[l] + g * KHS;
    const float* vc = VC[l] + g * VHS;
    const float* vnew = qkv + NA + NKV * HD + g * HD;  // new row r: vnew + r * NQKV
    float mx_[GQ];
    float sum[GQ];
    float acc[GQ][DL];
#pragma unroll
    for (int hh = 0; hh < GQ; ++hh) {
      mx_[hh] = NEG_INF;
      sum[hh] = 0.0f;
#pragma unroll
      for (int dd = 0; dd < DL; ++dd) {
        acc[hh][dd] = 0.0f;
      }
    }
    // Warp w takes the chunk of keys c0 = c_lo + 32 w; lane t scores key c0 + t against each
    // query head with a sequential HD-term dot product (each key read once for the GQ heads),
    // then softmax in base 2 per head.
    const int c0 = c_lo + warp * 32;
    if (c0 < nk) {
      const int j = c0 + lane;
      // Values in two halves of 16 rows (this lane's DL dims; rows past the last key weigh 0,
      // any valid row is read). The first half is loaded before the scores (it does not
      // depend on them), so its loads overlap the keys'.
      float vv[16][DL];
      auto load_values = [&](int t0) {
#pragma unroll
        for (int t = 0; t < 16; ++t) {
          const int jc = min(c0 + t0 + t, nk - 1);
          const float* vr = jc < S ? vc + (int64_t)jc * HD : vnew + (size_t)(jc - S) * NQKV;
#pragma unroll
          for (int dd = 0; dd < DL; ++dd) {
            vv[t][dd] = __ldcg(vr + lane * DL + dd);
          }
        }
      };
      load_values(0);
      float sc[GQ];
#pragma unroll
      for (int hh = 0; hh < GQ; ++hh) {
        sc[hh] = NEG_INF;
      }
      if (j < nk) {
        const float* kr = j < S ? kc + (int64_t)j * HD : xs + (j - S) * HD;
        float dot[GQ];
#pragma unroll
        for (int hh = 0; hh < GQ; ++hh) {
          dot[hh] = 0.0f;
        }
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
          for (int hh = 0; hh < GQ; ++hh) {
#pragma unroll
            for (int t = 0; t < 16; ++t) {
              dot[hh] = fmaf(qs[hh * HD + d0 + t], kk[t], dot[hh]);
            }
          }
        }
#pragma unroll
        for (int hh = 0; hh < GQ; ++hh) {
          sc[hh] = dot[hh];
        }
      }
      float p[GQ];
#pragma unroll
      for (int hh = 0; hh < GQ; ++hh) {
        float cm = sc[hh];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          cm = fmaxf(cm, __shfl_xor_sync(FULL, cm, o));
        }
        p[hh] = j < nk ? exp2f(sc[hh] - cm) : 0.0f;
        float ps = p[hh];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          ps += __shfl_xor_sync(FULL, ps, o);
        }
        sum[hh] = ps;
        mx_[hh] = cm;
      }
      for (int t0 = 0; t0 < min(32, nk - c0); t0 += 16) {
        if (t0 > 0) {
          load_values(t0);
        }
#pragma unroll
        for (int t = 0; t < 16; ++t) {
#pragma unroll
          for (int hh = 0; hh < GQ; ++hh) {
            const float pt = __shfl_sync(FULL, p[hh], t0 + t);
#pragma unroll
            for (int dd = 0; dd < DL; ++dd) {
              acc[hh][dd] = fmaf(pt, vv[t][dd], acc[hh][dd]);
            }
          }
        }
      }
    }
    // per-warp results to shared memory: (max, sum) in wm/wl, values in xs after the new keys
    float* wacc = xs + MB * HD;  // [W][GQ][HD]
    if (lane == 0) {
#pragma unroll
      for (int hh = 0; hh < GQ; ++hh) {
        wm[warp * GQ + hh] = mx_[hh];
        wl[warp * GQ + hh] = sum[hh];
      }
    }
#pragma unroll
    for (int hh = 0; hh < GQ; ++hh) {
#pragma unroll
      for (int dd = 0; dd < DL; ++dd) {
        wacc[(warp * GQ + hh) * HD + lane * DL + dd] = acc[hh][dd];
      }
    }
    __syncthreads();
    // each head's segment (max, sum, values) from its warps in warp order; warps past the
    // last key hold (-inf, 0, 0) and weigh 0
    for (int e = threadIdx.x; e < GQ * HD; e += blockDim.x) {
      const int hh = e / HD;
      const int d = e - hh * HD;
      const int h = g * GQ + hh;
      float mt = wm[hh];
      for (int w2 = 1; w2 < W; ++w2) {
        mt = fmaxf(mt, wm[w2 * GQ + hh]);
      }
      float lt = 0.0f;
      float ot = 0.0f;
      for (int w2 = 0; w2 < W; ++w2) {
        const float f = exp2f(wm[w2 * GQ + hh] - mt);
        lt = fmaf(wl[w2 * GQ + hh], f, lt);
        ot = fmaf(wacc[(w2 * GQ + hh) * HD + d], f, ot);
      }
      if (nseg == 1) {
        att[m * NA + h * HD + d] = ot / lt;
      } else {
        float* pr = part + (((size_t)m * NH + h) * PSEG + sg) * (HD + 2);
        pr[2 + d] = ot;
        if (d == 0) {
          pr[0] = mt;
          pr[1] = lt;
        }
      }
    }
    if (nseg > 1) {
      __shared__ int last;
      __threadfence();
      __syncthreads();
      if (threadIdx.x == 0) {
        last = atomicAdd(cnt + ((size_t)l * M + m) * NKV + g, 1u) == static_cast<unsigned int>(nseg - 1);
      }
      __syncthreads();
      if (last) {
        __threadfence();
        for (int e = threadIdx.x; e < GQ * HD; e += blockDim.x) {
          const int hh = e / HD;
          const int d = e - hh * HD;
          const int h = g * GQ + hh;
          const float* p0 = part + ((size_t)m * NH + h) * PSEG * (HD + 2);
          float mt = __ldcg(p0);
          for (int s2 = 1; s2 < nseg; ++s2) {
            mt = fmaxf(mt, __ldcg(p0 + s2 * (HD + 2)));
          }
          float lt = 0.0f;
          float ot = 0.0f;
          for (int s2 = 0; s2 < nseg; ++s2) {
            const float* q2 = p0 + s2 * (HD + 2);
            const float f = exp2f(__ldcg(q2) - mt);
            lt = fmaf(__ldcg(q2 + 1), f, lt);
            ot = fmaf(__ldcg(q2 + 2 + d), f, ot);
          }
          att[m * NA + h * HD + d] = ot / lt;
        }
      }
    }
    __syncthreads();
  }
  if (!(ok = sync_(l * 5 + 1))) {
    break;
  }

  // ---- C: o_proj + residual -> hmid [M, DM]
  if (!(SKIP & 4)) {
    ss_proj_residual<BITS, MB, W, ST>(wo + (size_t)l * DM * (NA / PK), so + (size_t)l * DM * ng_o,
                                      bo + (size_t)l * DM * ng_o, DM, NA, gs_o, ng_o, att, hin, hmid, M, xs, MB * DM);
  }
  if (!(ok = sync_(l * 5 + 2))) {
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
      ss_qdot<BITS, MB, ST>(w + (size_t)n * (DM / PK), sc + (size_t)n * ng_gu, bi + (size_t)n * ng_gu, DM,
                                 gs_gu, xs, M, lane, ag);
      const size_t nu = (size_t)(DI + n);
      ss_qdot<BITS, MB, ST>(w + nu * (DM / PK), sc + nu * ng_gu, bi + nu * ng_gu, DM, gs_gu, xs, M, lane, au);
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
  if (!(ok = sync_(l * 5 + 3))) {
    break;
  }

  // ---- E: down_proj + residual -> hidden[l]
  if (!(SKIP & 16)) {
    ss_proj_residual<BITS, MB, W, ST>(wd + (size_t)l * DM * (DI / PK), sd + (size_t)l * DM * ng_d,
                                      bd + (size_t)l * DM * ng_d, DM, DI, gs_d, ng_d, act, hmid, hout, M, xs, MB * DM);
  }
  if (!(ok = sync_(l * 5 + 4))) {
    break;
  }
}

// ---- final RMSNorm + LM head -> logits [M, V]
if (ok && !(SKIP & 32)) {
  ss_rmsnorm<DM, W>(hidden + (size_t)(NL - 1) * M * DM, fnorm, eps, M, xs);
  for (int n = gw; n < V; n += TW) {
    float acc[MB];
    ss_qdot<HBITS, MB, ST>(we + (size_t)n * (DM / HPK), se + (size_t)n * ng_e, bee + (size_t)n * ng_e, DM, gs_e,
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
// ---- F (MARKOV): greedy drafts, left to right; xs still holds the final-normed rows
if (MARKOV && ok) {
  constexpr int MPK = 32 / MBITS;
  constexpr uint32_t MMASK = (1u << MBITS) - 1u;
  constexpr int MRW = MR > 0 ? MR : 4;
  constexpr int MKW = MR / MPK;  // packed words per row of W2
  __shared__ __align__(16) float w1s[MRW];
  __shared__ float red_v[W];
  __shared__ int red_i[W];
  __shared__ int next_s;
  const int ng1 = ms1_shape[1];
  const int ng2 = ms2_shape[1];
  const int gs1 = gshift_of(MR, ng1);
  const int gs2 = gshift_of(MR, ng2);
  int prev = tok0[0];
  ok = sync_(NL * 5);  // every block's logits written
  for (int k = 0; k < M && ok; ++k) {
    for (int i = threadIdx.x; i < MR; i += blockDim.x) {  // W1[prev], dequantized
      const uint32_t word = mw1[(size_t)prev * (MR / MPK) + i / MPK];
      const float q = static_cast<float>((word >> (MBITS * (i % MPK))) & MMASK);
      const int gi = i >> gs1;
      w1s[i] = fmaf(q, static_cast<float>(ms1[(size_t)prev * ng1 + gi]), static_cast<float>(mb1[(size_t)prev * ng1 + gi]));
    }
    __syncthreads();
    float best = NEG_INF;
    int bi = 0x7fffffff;
    if (MKW <= 16) {
      // A rank of at most 16 packed words: each half-warp scores its own vocabulary row, so a
      // warp takes two rows per step. Lanes past MKW hold 0 and the half-warp butterfly is
      // ss_warp_sum's without its first step (which added those lanes' zeros), so every row's
      // sum has ss_qdot's bits.
      const int half = lane >> 4;
      const int sub = lane & 15;
      for (int v0 = gw; v0 < V; v0 += 2 * TW) {
        const int v = v0 + half * TW;
        float acc = 0.0f;
        if (v < V && sub < MKW) {
          const uint32_t word = mw2[(size_t)v * MKW + sub];
          const int gi = (sub * MPK) >> gs2;
          const float sv = static_cast<float>(ms2[(size_t)v * ng2 + gi]);
          const float bv2 = static_cast<float>(mb2[(size_t)v * ng2 + gi]);
#pragma unroll
          for (int p = 0; p < MPK; ++p) {
            const float q = __uint_as_float(0x4B000000u | ((word >> (MBITS * p)) & MMASK)) - 8388608.0f;
            acc = fmaf(w1s[sub * MPK + p], fmaf(q, sv, bv2), acc);
          }
        }
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) {
          acc += __shfl_xor_sync(0xffffffffu, acc, o);
        }
        // (the two halves' rows in order: v0 < v0 + TW, so the first of equal maxima stays)
        for (int h = 0; h < 2; ++h) {
          const int vh = v0 + h * TW;
          const float sh = __shfl_sync(0xffffffffu, acc, h * 16);
          if (vh < V) {
            const float val = __ldcg(logits + (size_t)k * V + vh) + sh;
            if (val > best) {
              best = val;
              bi = vh;
            }
          }
        }
      }
    } else {
      for (int v = gw; v < V; v += TW) {
        float acc[1];
        ss_qdot<MBITS, 1, ST>(mw2 + (size_t)v * MKW, ms2 + (size_t)v * ng2, mb2 + (size_t)v * ng2, MR, gs2, w1s, 1,
                              lane, acc);
        const float val = __ldcg(logits + (size_t)k * V + v) + ss_warp_sum(acc[0]);
        if (val > best) {  // (v increases: the first of equal maxima stays)
          best = val;
          bi = v;
        }
      }
    }
    if (lane == 0) {
      red_v[warp] = best;
      red_i[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float bv = red_v[0];
      int bix = red_i[0];
      for (int w2 = 1; w2 < W; ++w2) {
        if (red_v[w2] > bv || (red_v[w2] == bv && red_i[w2] < bix)) {
          bv = red_v[w2];
          bix = red_i[w2];
        }
      }
      // (two candidate sets used in turn: a block may write draft k + 1's while a slower one
      // still scans draft k's)
      cand[(k & 1) * 2 * NB + blockIdx.x * 2] = bv;
      cand[(k & 1) * 2 * NB + blockIdx.x * 2 + 1] = __int_as_float(bix);
    }
    if (!(ok = ss_grid_sync(barp, epoch))) {
      break;
    }
    if (warp == 0) {  // every block: the same candidates reduced the same way
      // The largest score, the smallest index among equal ones: an order-free choice (scores
      // are never NaN: a block's best only takes values greater than the one before), so a
      // warp-wide butterfly gives every block the serial scan's token, without its chain of
      // NB dependent L2 reads.
      const float* cs = cand + (k & 1) * 2 * NB;
      float bv = NEG_INF;
      int bix = 0x7fffffff;
      for (int b = lane; b < NB; b += 32) {
        const float cv = __ldcg(cs + b * 2);
        const int ci = __float_as_int(__ldcg(cs + b * 2 + 1));
        if (cv > bv || (cv == bv && ci < bix)) {
          bv = cv;
          bix = ci;
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bix, o);
        if (ov > bv || (ov == bv && oi < bix)) {
          bv = ov;
          bix = oi;
        }
      }
      if (lane == 0) {
        next_s = bix >= 0 && bix < V ? bix : 0;  // (no finite score anywhere: token 0, never out of range)
      }
    }
    __syncthreads();
    if (blockIdx.x == 0 && warp == 0) {
      if (CONF > 0) {  // c_k from h_k and W1[x_{k-1}] (w1s)
        float z = 0.0f;
        for (int i = lane; i < DM; i += 32) {
          z = fmaf(cw[i], xs[k * DM + i], z);
        }
        if (CONF == 2) {
          for (int i = lane; i < MR; i += 32) {
            z = fmaf(cw[DM + i], w1s[i], z);
          }
        }
        z = ss_warp_sum(z) + cb[0];
        if (lane == 0) {
          dconf[k] = 1.0f / (1.0f + expf(-z));
        }
      }
      if (lane == 0) {
        dtok[k] = DV ? dvoc[next_s] : next_s;
      }
    }
    prev = DV ? dvoc[next_s] : next_s;  // (a draft vocabulary's row -> its target id: W1's row)
    __syncthreads();  // (w1s is rewritten next)
  }
}
if (PROF && threadIdx.x == 0) {  // the work after the last barrier: the LM head, or the Markov phase
  prof[((size_t)blockIdx.x * (NL * 5 + 2) + NL * 5 + (MARKOV ? 1 : 0)) * 2] = static_cast<unsigned int>(clock64() - tprof);
}
if (threadIdx.x == 0) {
  err[blockIdx.x] = ok ? 0 : 1;
}
