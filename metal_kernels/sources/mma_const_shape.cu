// specserve small-batch quantized matmul, CUDA tensor-core variant: the compile-time-shape
// loop. qmv.kernel_sources splices this file in at the mma body's "SSK_CONST_SHAPE_LOOP" line
// only for launches with KC > 0 (default launches keep the smaller source: MLX builds and
// hashes a custom kernel's whole source on every call); it ends in `} else`, so the body's
// runtime-shape loop becomes its other branch.
if constexpr (KC > 0) {
  // Compile-time shape (qmv.py sets KC = K and GS = the group size, where a chunk holds
  // whole groups): every address is a base pointer plus immediates, advanced by a constant
  // stride per iteration. The chunks, their order and the arithmetic are the runtime-shape
  // loop's below, so the bits are too. XL = 1 loads a chunk's activations just before its
  // products (fewer registers held while U > 1 chunks of weights are in flight).
  static_assert(KC > 0 && GS > 0 && SC % GS == 0 && KC % SC == 0, "whole groups per chunk, chunks per row");
  constexpr int KW = KC * BITS / 32;  // words per weight row
  constexpr int NGR = KC / GS;        // groups per row
  constexpr int NCH = KC / SC;        // chunks per row
  constexpr int CW = SC * BITS / 32;  // words per row per chunk
  constexpr int CG = SC / GS;         // groups per chunk
  const uint32_t* wp = w + (size_t)(row0 + g) * KW + warp * CW + t * VW;
  const size_t sofs = (size_t)(row0 + g) * NGR + warp * CG + (t * VALS) / GS;
  const S* sp = scales + sofs;
  const S* bp = biases + sofs;
  const T* xp = x + (size_t)g * KC + warp * SC + t * VALS;
  // XS (one row, M = 1): the activations of a chunk held two registers per lane, shuffled to the
  // row's lanes by the products (ssk::load_x_held), from row 0 at the chunk's first column
  static_assert(!XS || (MR == 1 && MBLK == 1), "XS: one fixed row in the 8-row bucket");
  const T* x0 = x + warp * SC;
  (void)x0;
  // A warp's chunks warp, warp + WK, ... in ITERS steps of U; WHOLE: every warp takes the
  // same number (warp < WK), so no chunk test. FU = 1 unrolls the steps (straight-line code:
  // ptxas may issue a later step's loads before an earlier step's products).
  constexpr int STEP = WK * U;
  constexpr int ITERS = (NCH + STEP - 1) / STEP;
  constexpr bool WHOLE = NCH % STEP == 0;
#pragma unroll(FU ? ITERS : 1)
  for (int it = 0; it < ITERS; ++it) {
    const int cbase = warp + it * STEP;
    if (!WHOLE && cbase >= NCH) {
      break;
    }
    uint32_t wr[U][NT][2][VW];
    S sc[U][NT][2];
    S bi[U][NT][2];
    uint32_t xr[U][MBLK][XS ? 2 : XW];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (WHOLE || cbase + u * WK < NCH) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int ro = 16 * j + 8 * h;  // rows past this thread's first
            ssk::load_words<VW, LP>(wp + u * WK * CW + ro * KW, wr[u][j][h]);
            sc[u][j][h] = sp[u * WK * CG + ro * NGR];
            bi[u][j][h] = bp[u * WK * CG + ro * NGR];
          }
        }
        if constexpr (XS) {
          ssk::load_x_held_if<XS, BITS, VW>(x0 + u * WK * SC, lane, xr[u][0]);
        } else if constexpr (!XL) {
#pragma unroll
          for (int mb = 0; mb < MBLK; ++mb) {
            ssk::load_x(xp + u * WK * SC + 8 * mb * KC, 8 * mb + g < M, xr[u][mb]);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (WHOLE || cbase + u * WK < NCH) {
        if constexpr (XL && !XS) {
#pragma unroll
          for (int mb = 0; mb < MBLK; ++mb) {
            ssk::load_x(xp + u * WK * SC + 8 * mb * KC, 8 * mb + g < M, xr[u][mb]);
          }
        }
        ssk::chunk_products<T, BITS, NT, MBLK, VW, XS ? 2 : XW, S, XS>(acc, wr[u], sc[u], bi[u], xr[u]);
      }
    }
    wp += STEP * CW;
    sp += STEP * CG;
    bp += STEP * CG;
    xp += STEP * SC;
    x0 += STEP * SC;
  }
} else
