// specserve small-batch quantized matmul, CUDA tensor-core variant: body.
//
// y[m, n] = sum_k x[m, k] * (scales[n, k / gs] * q[n, k] + biases[n, k / gs])
// for M <= MB rows of x (MB = 8 or 16), N weight rows, K columns.
//
// Template constants (set by metal_kernels/qmv.py): T activation type (fp16 or
// bf16), S scale/bias type, BITS (4, 8), NT 16-row weight tiles per warp, WK warps per block splitting K, MB padded activation rows,
// VW 32-bit weight words per thread per row per chunk, U chunks in flight; KC, GS, XL, FU,
// LP, XS: the compile-time-shape loop's (mma_const_shape.cu); MR: the row count when fixed at
// compile time (0: read from x's shape).
// The group size (32, 64 or 128) is K / scales_shape[1]; a chunk's per-thread
// k range never straddles a group.
//
// Work split: block b owns weight rows [16 NT b, 16 NT (b + 1)). K is cut into
// chunks of SC = 4 * VALS columns; warp w takes chunks w, w + WK, w + 2 WK, ...
// in increasing order and accumulates them with mma.sync (fp32). The WK
// partial sums are then added in warp order 0, 1, ..., WK - 1 through shared
// memory. The chunking depends only on (K, BITS), never on M, and an mma
// output element depends only on its own weight row and activation row, so
// row m's result is bit-identical whatever M is.
//
// Fragment mapping (PTX ISA, mma.m16n8k16 .f16/.bf16): lane = 4 g + t.
// A regs: {row g, slots 2t,2t+1}, {row g+8, 2t,2t+1}, {row g, 2t+8,2t+9},
// {row g+8, 2t+8,2t+9}. B regs: {slots 2t,2t+1; col g}, {2t+8,2t+9; col g}.
// C: {row g; cols 2t, 2t+1}, {row g+8; cols 2t, 2t+1}.
// Thread (g, t) loads, for rows g and g+8, the VW words holding k in
// [c SC + t VALS, c SC + (t+1) VALS) and the same k range of activation row
// m = g (+ 8 for the second column block); Deq/XPair put matching k values in
// matching slots.
// SSK_STORE(m, n, v) writes output element (m, n): y[m * N + n] by default. Sibling
// projections fused into one launch (metal_kernels/patch.py) concatenate their weights
// along N and get one output per projection: qmv.py then defines SSK_STORE to pick it by
// n against the cut constants S1 (and S2), element by element (a block may straddle a cut).
#ifndef SSK_STORE
#define SSK_STORE(m, n, v) y[(size_t)(m) * N + (n)] = static_cast<T>(v)
#endif
constexpr int VALS = VW * 32 / BITS;
constexpr int SC = 4 * VALS;
constexpr int MBLK = MB / 8;
constexpr int XW = VALS / 2;
constexpr int NREG = NT * MBLK * 4;
static_assert(KC >= 0 && GS >= 0 && (XL == 0 || XL == 1) && (FU == 0 || FU == 1) && LP >= 0 &&
              (XS == 0 || XS == 1), "KC, GS, XL, FU, LP, XS: see mma_const_shape.cu");
static_assert(MR >= 0 && MR <= MB, "MR: a fixed row count within the padded rows");

const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int g = lane >> 2;
const int t = lane & 3;
// x may be (..., K): its leading dimensions are the rows. (A fixed trip count over MLX's
// 10 shape slots: straight-line uniform code instead of a loop ptxas unrolls into branches.)
// MR > 0: the row count is that compile-time constant (qmv.py: one-row launches), so the
// row tests below fold away and the epilogue skips the padding rows' partial sums.
const int K = x_shape[x_ndim - 1];
int M = MR;
if constexpr (MR == 0) {
  M = 1;
#pragma unroll
  for (int i = 0; i < 9; ++i) {
    M *= i + 1 < x_ndim ? x_shape[i] : 1;
  }
}
const int N = w_shape[0];
const int nchunks = K / SC;
const int kw = K * BITS / 32;
const int ng = scales_shape[1];
int gshift = 0;
while ((ng << gshift) < K) {
  ++gshift;
}
const int row0 = blockIdx.x * (16 * NT);

float acc[NT][MBLK][4];
#pragma unroll
for (int j = 0; j < NT; ++j) {
#pragma unroll
  for (int mb = 0; mb < MBLK; ++mb) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      acc[j][mb][r] = 0.0f;
    }
  }
}

// SSK_CONST_SHAPE_LOOP (qmv.py: mma_const_shape.cu where KC > 0)
for (int cbase = warp; cbase < nchunks; cbase += WK * U) {
  uint32_t wr[U][NT][2][VW];
  float sc[U][NT][2];
  float bi[U][NT][2];
  uint32_t xr[U][MBLK][XW];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = cbase + u * WK;
    if (c < nchunks) {
      const int k = c * SC + t * VALS;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = row0 + 16 * j + 8 * h + g;
          ssk::load_words<VW>(
              w + (size_t)row * kw + (k * BITS) / 32, wr[u][j][h]);
          sc[u][j][h] = static_cast<float>(scales[(size_t)row * ng + (k >> gshift)]);
          bi[u][j][h] = static_cast<float>(biases[(size_t)row * ng + (k >> gshift)]);
        }
      }
#pragma unroll
      for (int mb = 0; mb < MBLK; ++mb) {
        const int m = 8 * mb + g;
        ssk::load_x<XW>(x + (size_t)m * K + k, m < M, xr[u][mb]);
      }
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = cbase + u * WK;
    if (c < nchunks) {
      ssk::chunk_products<T, BITS, NT, MBLK, VW, XW>(acc, wr[u], sc[u], bi[u], xr[u]);
    }
  }
}

// Fixed-order sum of the WK partial results, then store rows m < M. Accumulator slot idx holds
// rows 8 mb + 2 t + (r & 1) (t = 0..3); live(idx): some lane's row is below MR (always true
// for MR = 0).
auto live = [](int idx) {
  return MR == 0 || 8 * ((idx >> 2) % MBLK) + (idx & 1) < MR;
};
auto store = [&](int idx, float total) {
  const int r = idx & 3;
  const int mb = (idx >> 2) % MBLK;
  const int j = idx / (4 * MBLK);
  const int n = row0 + 16 * j + g + 8 * (r >> 1);
  const int m = 8 * mb + 2 * t + (r & 1);
  if (m < M) {
    SSK_STORE(m, n, total);
  }
};
if constexpr (WK == 1) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int mb = 0; mb < MBLK; ++mb) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        if (live((j * MBLK + mb) * 4 + r)) {
          store((j * MBLK + mb) * 4 + r, acc[j][mb][r]);
        }
      }
    }
  }
} else {
  __shared__ float red[WK][NREG][32];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int mb = 0; mb < MBLK; ++mb) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        if (live((j * MBLK + mb) * 4 + r)) {
          red[warp][(j * MBLK + mb) * 4 + r][lane] = acc[j][mb][r];
        }
      }
    }
  }
  __syncthreads();
  for (int idx = warp; idx < NREG; idx += WK) {
    if (!live(idx)) {
      continue;
    }
    float total = red[0][idx][lane];
    for (int ww = 1; ww < WK; ++ww) {
      total += red[ww][idx][lane];
    }
    store(idx, total);
  }
}
#undef SSK_STORE
