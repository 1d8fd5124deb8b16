// specserve verify attention, CUDA: body for mx.fast.cuda_kernel.
//
// out[0, h, i, :] = softmax(scale * q[0, h, i] . k[0, g, j]) over j < nk(i), times v[0, g, j]
// with g = h / (H / HKV) (grouped-query attention) and nk(i) = S + i + 1, S = NK_ALL - L:
// query row i (position S + i) attends causally to every key up to its own position, which
// is exactly what a one-token decode step at that position computes. One block per (row, head).
//
// Template constants: T element type of q/k/v/out (float, __half, __nv_bfloat16), D head
// dimension (a multiple of 32), W warps per block, SCALE_BITS the bit pattern of the float
// softmax scale. Inputs may be strided views (the KV cache's [:, :, :NK_ALL] slice).
//
// Reduction order (what makes rows independent of how many rows share the launch): keys are
// cut into absolute chunks of 32 (chunk c = keys [32c, 32c + 32)); warp w takes chunks w,
// w + W, w + 2W, ... in increasing order. In a chunk, lane t scores key 32c + t (a sequential
// D-term dot product), the chunk max and sum come from fixed xor butterflies, and the value
// rows are accumulated key by key in increasing order (online softmax, base 2, fp32). The W
// warp states are then combined in warp order. Nothing depends on L, on the row's index in the
// launch or on the other rows, so row i of an L-row call equals the 1-row call bit for bit.
constexpr int DL = D / 32;
constexpr unsigned FULL = 0xffffffffu;
const float NEG_INF = __int_as_float(0xff800000u);
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int H = q_shape[1];
const int L = q_shape[2];
const int HKV = k_shape[1];
const int NK_ALL = k_shape[2];
const int row = blockIdx.x / H;
const int h = blockIdx.x - row * H;
const int g = h / (H / HKV);
const int nk = NK_ALL - L + row + 1;
const float qscale = __int_as_float(SCALE_BITS) * 1.4426950408889634f;

__shared__ float qs[D];
__shared__ float wm[W];
__shared__ float wl[W];
__shared__ float wacc[W][D];

const T* qp = q + (int64_t)h * q_strides[1] + (int64_t)row * q_strides[2];
for (int d = threadIdx.x; d < D; d += 32 * W) {
  qs[d] = static_cast<float>(qp[d * q_strides[3]]) * qscale;
}
__syncthreads();

const T* kb = k + (int64_t)g * k_strides[1];
const T* vb = v + (int64_t)g * v_strides[1];
const int64_t ks = k_strides[2];
const int64_t kd = k_strides[3];
const int64_t vs = v_strides[2];
const int64_t vd = v_strides[3];
// Vector loads (same arithmetic, same bits) where rows are contiguous and aligned: a key row
// in 16-byte pieces, a lane's DL value elements in one load.
constexpr int KE = 16 / sizeof(T);
struct alignas(16) KVec { T v[KE]; };
struct alignas(sizeof(T) * DL) VVec { T v[DL]; };
const bool kvec = kd == 1 && ks % KE == 0 && reinterpret_cast<unsigned long long>(kb) % 16 == 0;
const bool vvec = vd == 1 && vs % DL == 0 && reinterpret_cast<unsigned long long>(vb) % sizeof(VVec) == 0;
float m = NEG_INF;
float l = 0.0f;
float acc[DL];
#pragma unroll
for (int dd = 0; dd < DL; ++dd) {
  acc[dd] = 0.0f;
}
for (int c0 = warp * 32; c0 < nk; c0 += W * 32) {
  const int j = c0 + lane;
  float s = NEG_INF;
  if (j < nk) {
    const T* kr = kb + (int64_t)j * ks;
    float dot = 0.0f;
    if (kvec) {  // the same sequential sum, 16-byte loads
#pragma unroll 4
      for (int d0 = 0; d0 < D; d0 += KE) {
        const KVec x = *reinterpret_cast<const KVec*>(kr + d0);
#pragma unroll
        for (int e = 0; e < KE; ++e) {
          dot = fmaf(qs[d0 + e], static_cast<float>(x.v[e]), dot);
        }
      }
    } else {
#pragma unroll 8
      for (int d = 0; d < D; ++d) {
        dot = fmaf(qs[d], static_cast<float>(kr[d * kd]), dot);
      }
    }
    s = dot;
  }
  float cm = s;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    cm = fmaxf(cm, __shfl_xor_sync(FULL, cm, o));
  }
  const float mn = fmaxf(m, cm);
  const float p = j < nk ? exp2f(s - mn) : 0.0f;
  float ps = p;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ps += __shfl_xor_sync(FULL, ps, o);
  }
  const float corr = exp2f(m - mn);
  l = l * corr + ps;
#pragma unroll
  for (int dd = 0; dd < DL; ++dd) {
    acc[dd] *= corr;
  }
  const int jn = min(32, nk - c0);
  if (vvec && jn == 32) {  // the same key-by-key sums, one vector load per key, loads run ahead
    const T* vr = vb + (int64_t)c0 * vs + lane * DL;
#pragma unroll 8
    for (int t = 0; t < 32; ++t) {
      const float pt = __shfl_sync(FULL, p, t);
      const VVec x = *reinterpret_cast<const VVec*>(vr + (int64_t)t * vs);
#pragma unroll
      for (int dd = 0; dd < DL; ++dd) {
        acc[dd] = fmaf(pt, static_cast<float>(x.v[dd]), acc[dd]);
      }
    }
  } else {
    for (int t = 0; t < jn; ++t) {
      const float pt = __shfl_sync(FULL, p, t);
      const T* vr = vb + (int64_t)(c0 + t) * vs;
#pragma unroll
      for (int dd = 0; dd < DL; ++dd) {
        acc[dd] = fmaf(pt, static_cast<float>(vr[(lane * DL + dd) * vd]), acc[dd]);
      }
    }
  }
  m = mn;
}

if (lane == 0) {
  wm[warp] = m;
  wl[warp] = l;
}
#pragma unroll
for (int dd = 0; dd < DL; ++dd) {
  wacc[warp][lane * DL + dd] = acc[dd];
}
__syncthreads();
for (int d = threadIdx.x; d < D; d += 32 * W) {
  float mt = wm[0];
  for (int w = 1; w < W; ++w) {
    mt = fmaxf(mt, wm[w]);
  }
  float lt = 0.0f;
  float ot = 0.0f;
  for (int w = 0; w < W; ++w) {
    const float f = exp2f(wm[w] - mt);
    lt = fmaf(wl[w], f, lt);
    ot = fmaf(wacc[w][d], f, ot);
  }
  out[((int64_t)h * L + row) * D + d] = static_cast<T>(ot / lt);
}
