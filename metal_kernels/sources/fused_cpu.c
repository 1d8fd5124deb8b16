// CPU twin of the fused decode/verify pass (metal_kernels/fused_cpu.py): one call runs every
// decoder layer and the LM head of a small Llama for M = 1..16 rows, reading each quantized
// weight once for all rows. Built at first use with the system C compiler (-O3 -march=native
// -pthread); portable C with GCC vector extensions, 16 float lanes, plus intrinsics where the
// generic code is slow: the integer dot products (AVX512-VNNI, or AVX2 in 256-bit halves and
// 128-bit quarters, since GCC lowers 64-byte generic vectors through the stack on CPUs without
// AVX-512) and, on AVX2, the lane reductions and the attention loops (TREE_AVX2: the same
// arithmetic, bit for bit).
//
// Row independence: every output of row r is a dot product accumulated in a fixed order (lanes
// over the input dimension, groups in order, a fixed lane reduction) from row r's inputs only,
// so row r of an M-row pass is bit-identical to the one-row pass at its position, for every M.
// The thread that computes an output does not matter either: each output has one owner.
//
// Weights: affine-quantized (w = scale * q + bias per group of GS inputs, GS a multiple of 32),
// repacked by the launcher. 4 bits: per 32 inputs, 16 bytes; byte i holds input i (low nibble)
// and input i + 16 (high nibble). 8 bits: one byte per input. Scales and biases float16.
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));

#define MAX_ROWS 16
#ifdef __AVX512F__
#define TILE 16  // rows per dequantized weight chunk (32 vector registers hold 16 accumulators)
#else
#define TILE 4
#endif

typedef struct {
    const uint8_t *w;          // [out, in * bits / 8] repacked codes
    const _Float16 *s, *b;     // [out, in / gs]
    int32_t in, out, bits, gs;
} QMat;

typedef struct {
    int32_t nl, dm, nh, nkv, hd, di, vocab;
    float eps, scale;
    const float *inv_freq;     // [hd / 2]
    const float *norms;        // [nl, 2, dm]: input_layernorm, post_attention_layernorm
    const float *fnorm;        // [dm]
    const QMat *qkv, *o, *gu, *down;  // [nl] each: q|k|v rows, o_proj, gate|up rows, down_proj
    const QMat *head;          // the LM head (tied embedding or lm_head)
    int32_t digits;            // integer activations of 1 (q8) or 2 (q16) 8-bit digits (see below); 0: float32
} Model;

static inline v16f load16(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, v16f v) { memcpy(p, &v, sizeof v); }
static inline v16f splat(float x) { return (v16f){0} + x; }

// Without AVX-512, GCC lowers the shuffles of 64-byte vectors (hsum, reduce16) lane by lane
// through the stack; the AVX2 versions below add the same pairs in the same tree, in native
// 256-bit halves (lo: lanes 0-7, hi: lanes 8-15), so every build gives the same bits.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)  // (the generic a += b * c fuses only with FMA)
#define TREE_AVX2 1
static inline __m256 half8(const v16f *v, int h) { return _mm256_loadu_ps((const float *)v + 8 * h); }
#else
#define TREE_AVX2 0
#endif

static inline float hsum(v16f v) {  // fixed tree order
#if TREE_AVX2
    const __m256 s = _mm256_add_ps(half8(&v, 0), half8(&v, 1));                          // t[i] += t[i + 8]
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));  // t[i] += t[i + 4]
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                               // t[i] += t[i + 2]
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));                       // t[0] += t[1]
#else
    float t[16];
    memcpy(t, &v, sizeof t);
    for (int w = 8; w; w >>= 1)
        for (int i = 0; i < w; i++) t[i] += t[i + w];
    return t[0];
#endif
}

// 16 bytes -> 16 int32 lanes, zero-extended (GCC lowers __builtin_convertvector of bytes
// lane by lane, so x86 gets the one-instruction widening explicitly).
static inline v16i widen(const uint8_t *p) {
#if defined(__AVX512F__)
    return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    v16i r;
    const __m256i lo = _mm256_cvtepu8_epi32(b), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
#else
    v16b b;
    memcpy(&b, p, 16);
    return __builtin_convertvector(b, v16i);
#endif
}

static inline float hsum_max(v16f v) {
    float t[16];
    memcpy(t, &v, sizeof t);
    float mx = t[0];
    for (int i = 1; i < 16; i++) mx = t[i] > mx ? t[i] : mx;
    return mx;
}

static inline v16f vsel(v16i mask, v16f a, v16f b) { return (v16f)((mask & (v16i)a) | (~mask & (v16i)b)); }

// exp(x) for 16 lanes: Cephes expf (range reduction by ln 2 in two parts, degree-5 polynomial,
// ~1 ulp), the same arithmetic for every lane and call. Inputs are clamped to [-87, 88].
static inline v16f vexp(v16f x) {
    x = vsel(x < splat(-87.0f), splat(-87.0f), x);
    x = vsel(x > splat(88.0f), splat(88.0f), x);
    v16f n = x * 1.44269504088896341f + 12582912.0f;  // round(x / ln 2) by the 1.5 * 2^23 trick
    n -= 12582912.0f;
    v16f r = x - n * 0.693359375f;
    r -= n * -2.12194440e-4f;
    v16f p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
    return p * (v16f)e;
}

typedef int32_t v16m __attribute__((vector_size(64)));

// The 16 lane sums of a[0..15] as one vector (lane t: sum of a[t]'s lanes), by a fixed
// transpose-and-add tree: 15 pairs of shuffles instead of 16 horizontal sums.
static inline v16f reduce16(const v16f *a) {
#if TREE_AVX2
    // the generic tree below, step by step: s[k] = key k's 8 pair sums (lo1 + hi1); t[m] = keys
    // 2m, 2m+1's 4 sums each (lo2 + hi2: the 128-bit halves added); w[m] = keys 4m..4m+3's 2
    // sums each (lo3 + hi3: unpack the 64-bit pairs, add, put the keys back in order); then
    // lo4 + hi4 as horizontal adds of adjacent lanes, keys back in order.
    __m256 s[16], t[8], w[4];
    for (int k = 0; k < 16; k++) s[k] = _mm256_add_ps(half8(a + k, 0), half8(a + k, 1));
    for (int m = 0; m < 8; m++)
        t[m] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * m], s[2 * m + 1], 0x20),
                             _mm256_permute2f128_ps(s[2 * m], s[2 * m + 1], 0x31));
    for (int m = 0; m < 4; m++) {
        const __m256d x = _mm256_castps_pd(t[2 * m]), y = _mm256_castps_pd(t[2 * m + 1]);
        const __m256 u = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                                       _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
        w[m] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(u), 0xD8));
    }
    const __m256 lo = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(w[0], w[1])), 0xD8));
    const __m256 hi = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(w[2], w[3])), 0xD8));
    v16f out;
    memcpy(&out, &lo, 32);
    memcpy((char *)&out + 32, &hi, 32);
    return out;
#else
    const v16m lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16m hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const v16m lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const v16m hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const v16m lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const v16m hi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const v16m lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const v16m hi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16f b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)  // [key 2i: 8 partial sums | key 2i+1: 8]
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo1) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi1);
    for (int i = 0; i < 4; i++)  // [4 | 4 | 4 | 4] for keys 4i..4i+3
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo2) + __builtin_shuffle(b[2 * i], b[2 * i + 1], hi2);
    for (int i = 0; i < 2; i++)  // 2 per key, keys 8i..8i+7
        d[i] = __builtin_shuffle(c[2 * i], c[2 * i + 1], lo3) + __builtin_shuffle(c[2 * i], c[2 * i + 1], hi3);
    return __builtin_shuffle(d[0], d[1], lo4) + __builtin_shuffle(d[0], d[1], hi4);
#endif
}

// ---- quantized mat-vec: y[r, o] (=|+=) dot(W[o, :], x[r, :]) for a tile of R rows ----------
// Each dot product first prefetches the codes, scales and biases of the output PF_AHEAD on: with
// many rows' work between its loads the hardware prefetcher fell behind (the LM head streamed at
// 12 GB/s for 8 rows against 35 GB/s for 1; a 16-row pass took 15% longer).
#define PF_AHEAD 8
static inline void prefetch_output(const QMat *q, int o) {
    const size_t stride = (size_t)(q->in * q->bits / 8), ng = (size_t)(q->in / q->gs);
    const uint8_t *w = q->w + (size_t)(o + PF_AHEAD) * stride;
    for (size_t i = 0; i < stride; i += 64) __builtin_prefetch(w + i, 0, 0);
    __builtin_prefetch(q->s + (size_t)(o + PF_AHEAD) * ng, 0, 0);
    __builtin_prefetch(q->b + (size_t)(o + PF_AHEAD) * ng, 0, 0);
}
// A dot product's 16 lane partial sums go to part[r * 16] (row r, this output's column of a
// block of 16 outputs); flush() reduces a block with reduce16, whose tree is hsum's, so each
// output gets the same bits as one hsum of its lanes, at ~1/10 of the cost.
static void flush(const v16f *part, int n, int M, float *y, int ys, int ob, int add) {
    for (int r = 0; r < M; r++) {
        const v16f v = reduce16(part + 16 * r);
        float *dst = y + (size_t)r * ys + ob;
        if (n == 16) store16(dst, add ? load16(dst) + v : v);
        else {
            float t[16];
            memcpy(t, &v, sizeof t);
            for (int i = 0; i < n; i++) dst[i] = add ? dst[i] + t[i] : t[i];
        }
    }
}

static inline __attribute__((always_inline)) void dot_tile(const int R, const int bits, const QMat *q, int o,
                                                           const float *x, int xs, v16f *part) {
    v16f acc[TILE];
    for (int r = 0; r < R; r++) acc[r] = (v16f){0};
    const int in = q->in, gs = q->gs, ng = in / gs;
    const _Float16 *s = q->s + (size_t)o * ng, *b = q->b + (size_t)o * ng;
    const uint8_t *w = q->w + (size_t)o * (size_t)(in * bits / 8);
    prefetch_output(q, o);
    for (int g = 0; g < ng; g++) {
        const v16f sc = splat((float)s[g]), bi = splat((float)b[g]);
        for (int c = g * gs; c < (g + 1) * gs; c += 32) {
            v16f w0, w1;
            if (bits == 4) {
                const v16i v = widen(w + c / 2);
                w0 = __builtin_convertvector(v & 15, v16f) * sc + bi;
                w1 = __builtin_convertvector(v >> 4, v16f) * sc + bi;
            } else {
                w0 = __builtin_convertvector(widen(w + c), v16f) * sc + bi;
                w1 = __builtin_convertvector(widen(w + c + 16), v16f) * sc + bi;
            }
            for (int r = 0; r < R; r++) {
                acc[r] += w0 * load16(x + (size_t)r * xs + c);
                acc[r] += w1 * load16(x + (size_t)r * xs + c + 16);
            }
        }
    }
    for (int r = 0; r < R; r++) part[16 * r] = acc[r];
}

#define TILE_CASE(R)                                                                  \
    case R:                                                                           \
        if (q->bits == 4) dot_tile(R, 4, q, o, x + (size_t)r0 * xs, xs, part + 16 * r0 + (o - ob)); \
        else dot_tile(R, 8, q, o, x + (size_t)r0 * xs, xs, part + 16 * r0 + (o - ob)); \
        break;

#if TILE == 16
#define TILE_CASES(C) C(1) C(2) C(3) C(4) C(5) C(6) C(7) C(8) C(9) C(10) C(11) C(12) C(13) C(14) C(15) C(16)
#else
#define TILE_CASES(C) C(1) C(2) C(3) C(4)
#endif

// Outputs [lo, hi) of a projection (each thread takes one contiguous range), in blocks of 16
// outputs (flush); within a block, tile by tile of T rows (CASE(R): one tile of R rows), each
// tile over the block's 16 outputs, so a tile's activations stay in L1 across the outputs while
// the block's codes (a few KB) are reread from it. Outputs first (every tile per output) made a
// 16-row integer pass read 16 rows x 2 digits of activations per output (32 KB at 576 inputs):
// out of L1, 1.6x the time of two 8-row passes. Each output's arithmetic is the same either way.
#define OUTPUT_LOOP(CASE, T, CASES)                                                               \
    v16f part[MAX_ROWS * 16];                                                                     \
    for (int ob = lo, o; ob < hi; ob += 16) {                                                     \
        if (hi - ob < 16) memset(part, 0, sizeof part);                                           \
        const int oe = hi < ob + 16 ? hi : ob + 16;                                               \
        for (int r0 = 0; r0 < M; r0 += T)                                                         \
            for (o = ob; o < oe; o++)                                                             \
                switch (M - r0 < T ? M - r0 : T) { CASES(CASE) }                                  \
        flush(part, oe - ob, M, y, ys, ob, add);                                                  \
    }

static void qmv(const QMat *q, int lo, int hi, const float *x, int xs, int M, float *y, int ys, int add) {
    OUTPUT_LOOP(TILE_CASE, TILE, TILE_CASES)
}

// ---- integer activations: integer dot products (Model.digits) -------------------------------
// Each row's input to a projection is quantized per block of 32 inputs, as llama.cpp quantizes
// activations for its Q4_1/Q8_0 dot products (ggml's Q8_1): d = max|x| / 127 and q =
// round-half-even(x * (127 / max|x|)) in [-127, 127]. With two digits (q16) the residual
// x - d q (one rounding: an FMA) is quantized the same way into a second digit q', so x ~ d q +
// d' q' to ~1/32000 of the block's largest input (one digit: 1/254, which moves the default
// model's logits by ~2% of their scale). A dot product with affine weights (w = s * c + b per
// group) is then the sum over blocks j and digits of d_j * s_j * sum_i c_i q_i + b_j * (d_j *
// sum_i q_i): exact integer inner sums (AVX512-VNNI vpdpbusd, 64 byte products per
// instruction; on AVX2 vpmaddubsw and vpmaddwd, see Q8_AVX2), then float arithmetic in a fixed
// order. It computes the weights' dot product
// with the quantized activations up to float32 rounding, and row r still depends on row r
// alone. The weights are never converted to floats.
//
// Blocks are taken 16 at a time, one block per vector lane, so each lane's integer sum is one
// block's and the float work (scale, bias) is 3 operations per 16 blocks and row. A lane holds
// 4 bytes, so one vpdpbusd step covers inputs 4t..4t+3 of 16 blocks:
//   activations (QAct), per digit, row and group of 16 blocks: 8 vectors of 64 bytes, vector t
//     lane l = inputs 4t..4t+3 of block 16g + l; per digit and group 16 floats d_j; per group
//     16 floats sum over digits of d_j * sum q (absent blocks of a last partial group are zero);
//   4-bit codes, per output and group of n blocks: 4 segments of 4n bytes, segment t lane l =
//     inputs 4t..4t+3 of the group's block l in the low nibbles and inputs 16+4t..16+4t+3 in
//     the high ones; 8-bit codes: 8 segments, segment t lane l = inputs 4t..4t+3.
// A last partial group of at most 8 blocks runs at half width (256-bit vectors; on AVX2 also a
// 128-bit quarter for at most 4 blocks past a half): the lanes left out would only add exact
// zeros (+0 to an accumulator that is never -0: it starts at +0, and a sum is -0 only if both
// terms are), so the arithmetic is the same at every vector width.
typedef struct {
    int8_t *q[2];   // per digit
    float *d[2], *m;
    int sq, sd;     // per-row strides: bytes of q; floats of d and of m
} QAct;

// One block of 32 inputs into q (layout above); returns d, sets *sum to sum q and, when res is
// given, res[i] = x[i] - d q[i] (rounded once).
static inline float quantize_block(const float *x, int8_t *q, int *sum, float *res) {
    int8_t v[32];
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 id = _mm512_set1_ps(amax > 1e-30f ? 127.0f / amax : 0.0f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, id)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, id));
    _mm_storeu_si128((__m128i *)v, _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(v + 16), _mm512_cvtsepi32_epi8(qb));
    *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    const float d = amax / 127.0f;
    if (res) {
        const __m512 dv = _mm512_set1_ps(d);
        _mm512_storeu_ps(res, _mm512_fnmadd_ps(dv, _mm512_cvtepi32_ps(qa), a));
        _mm512_storeu_ps(res + 16, _mm512_fnmadd_ps(dv, _mm512_cvtepi32_ps(qb), b));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 xv[4];
    __m256 mx = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; i++) {
        xv[i] = _mm256_loadu_ps(x + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, xv[i]));
    }
    float m8[8];
    _mm256_storeu_ps(m8, mx);
    float amax = 0.0f;
    for (int i = 0; i < 8; i++) amax = m8[i] > amax ? m8[i] : amax;
    const float d = amax / 127.0f;
    const __m256 id = _mm256_set1_ps(amax > 1e-30f ? 127.0f / amax : 0.0f), dv = _mm256_set1_ps(d);
    int32_t qi[32];
    for (int i = 0; i < 4; i++) {
        const __m256i qv = _mm256_cvtps_epi32(_mm256_mul_ps(xv[i], id));  // (round half to even)
        _mm256_storeu_si256((__m256i *)(qi + 8 * i), qv);
        if (res) _mm256_storeu_ps(res + 8 * i, _mm256_fnmadd_ps(dv, _mm256_cvtepi32_ps(qv), xv[i]));
    }
    int s = 0;
    for (int i = 0; i < 32; i++) {  // |q| <= 127 already: the saturation of vpmovsdb never bites
        v[i] = (int8_t)qi[i];
        s += qi[i];
    }
    *sum = s;
#else
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float id = amax > 1e-30f ? 127.0f / amax : 0.0f, d = amax / 127.0f;
    int s = 0;
    for (int i = 0; i < 32; i++) {
        const float t = x[i] * id;
        v[i] = (int8_t)nearbyintf(t);  // (round half to even, as vcvtps2dq)
        s += v[i];
        if (res) res[i] = fmaf(-d, (float)v[i], x[i]);
    }
    *sum = s;
#endif
    for (int t = 0; t < 8; t++) memcpy(q + 64 * t, v + 4 * t, 4);
    return d;
}

// Rows [0, M) of x [M, xs] (their first `in` inputs) into a, in `digits` digits.
static void quantize_rows(const float *x, int xs, int M, int in, const QAct *a, int digits) {
    const int nb = in / 32, last = (nb - 1) / 16;
    for (int r = 0; r < M; r++) {
        float *m = a->m + (size_t)r * a->sd;
        memset(m + 16 * last, 0, sizeof(float) * 16);  // (a partial group's absent blocks stay zero)
        for (int k = 0; k < digits; k++) {
            memset(a->q[k] + (size_t)r * a->sq + (size_t)512 * last, 0, 512);
            memset(a->d[k] + (size_t)r * a->sd + 16 * last, 0, sizeof(float) * 16);
        }
        for (int j = 0; j < nb; j++) {
            const size_t at = (size_t)r * a->sq + 512 * (j / 16) + 4 * (j % 16);
            float res[32];
            int s0, s1;
            const float d0 = quantize_block(x + (size_t)r * xs + 32 * j, a->q[0] + at, &s0, digits > 1 ? res : NULL);
            a->d[0][(size_t)r * a->sd + j] = d0;
            if (digits > 1) {
                const float d1 = quantize_block(res, a->q[1] + at, &s1, NULL);
                a->d[1][(size_t)r * a->sd + j] = d1;
                const float m0 = d0 * (float)s0, m1 = d1 * (float)s1;
                m[j] = m0 + m1;
            } else {
                m[j] = d0 * (float)s0;
            }
        }
    }
}

// lane l: the scale (or bias) of block j0 + l's group, for l < n; else 0
static inline v16f lanes16(const _Float16 *s, int j0, int n, int per) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if (per == 1)  // (a masked load only for a partial group: it is slow on some CPUs)
        return (v16f)_mm512_cvtph_ps(n == 16 ? _mm256_loadu_si256((const __m256i *)(s + j0))
                                             : _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), s + j0));
#endif
    float t[16] = {0};
    for (int l = 0; l < n; l++) t[l] = (float)s[(j0 + l) / per];
    return load16(t);
}

typedef uint32_t v16u __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));

// The integer sums of one group of n blocks for rows r0..r0+R-1 (dot_tile_q8, per instruction
// set): the group's codes (4 or 8 segments of 4n bytes) against each row's QAct.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define Q8_VNNI 1
#define TILE_Q8 8  // (16-row tiles were no faster per row than 8, and 2x the activations in L1)
#define TILE_CASES_Q8(C) C(1) C(2) C(3) C(4) C(5) C(6) C(7) C(8)
static inline __m512i seg512(const uint8_t *w, int n, int t) {
    return n == 16 ? _mm512_loadu_si512(w + 64 * t) : _mm512_maskz_loadu_epi8((1ULL << (4 * n)) - 1, w + 4 * n * t);
}
static inline __m256i seg256(const uint8_t *w, int n, int t) {
    return _mm256_maskz_loadu_epi8((__mmask32)((1ULL << (4 * n)) - 1), w + 4 * n * t);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define Q8_AVX2 1
#define TILE_Q8 8  // rows per read of the codes (see dot_tile_q8)
#define TILE_CASES_Q8(C) C(1) C(2) C(3) C(4) C(5) C(6) C(7) C(8)
// AVX2 without VNNI: vpmaddubsw (u8 x s8, adjacent products summed into s16) and vpmaddwd by
// ones (s16 pairs into the lane's s32) give each lane's 4-product sum, the integers vpdpbusd
// gives. Exact, with no saturation: 4-bit codes are at most 15 and activations within [-127,
// 127], so a pair is at most 3810 and the 8 steps of a group sum to at most 30480 < 2^15 in s16;
// 8-bit codes are split into their two nibbles the same way (c = lo + 16 hi). A 512-bit group
// is two 256-bit halves: lanes (blocks) 0..7, then 8..15.
#else
#define TILE_Q8 TILE
#define TILE_CASES_Q8 TILE_CASES
static inline v16i seg_generic(const uint8_t *w, int n, int t) {
    v16i v = {0};
    memcpy(&v, w + 4 * n * t, 4 * n);
    return v;
}
static inline v16i dot_generic(v16i acc, v16i w, const int8_t *a) {  // (the integers of vpdpbusd)
    v16u av;
    memcpy(&av, a, 64);
    for (int i = 0; i < 4; i++)
        acc += (v16i)(((v16u)w >> (8 * i)) & 0xFF) * ((v16i)(av << (24 - 8 * i)) >> 24);
    return acc;
}
#endif


#ifdef Q8_VNNI
#define LOAD256(p) _mm256_loadu_si256((const __m256i *)(p))
// One group's integer sums at one vector width (256 or 512 bits; `widen` makes a 512-bit vector of
// the result, zero-extending a 256-bit one): the codes unpacked once, then per row and digit 8
// vpdpbusd steps and the float terms (GROUP_FLOATS/GROUP_BIAS, defined in dot_tile_q8).
#define VNNI_GROUP(VEC, seg, and_, srli, set1, zero, dpbusd, load, widen)                            \
    do {                                                                                          \
        VEC W[8];                                                                                 \
        for (int t = 0; t < 4; t++) W[t] = seg(wg, n, t);                                         \
        if (bits == 4)                                                                            \
            for (int t = 0; t < 4; t++) {                                                         \
                W[4 + t] = and_(srli(W[t], 4), set1(15));                                         \
                W[t] = and_(W[t], set1(15));                                                      \
            }                                                                                     \
        else                                                                                      \
            for (int t = 4; t < 8; t++) W[t] = seg(wg, n, t);                                     \
        for (int r = 0; r < R; r++) {                                                             \
            for (int k = 0; k < D; k++) {                                                         \
                const int8_t *aq = a->q[k] + (size_t)(r0 + r) * a->sq + 512 * g;                   \
                VEC v = zero();                                                                   \
                for (int t = 0; t < 8; t++) v = dpbusd(v, W[t], load(aq + 64 * t));               \
                GROUP_FLOATS(r, k, (v16i)widen(v));                                               \
            }                                                                                     \
            GROUP_BIAS(r);                                                                        \
        }                                                                                         \
    } while (0)
#endif

#ifdef Q8_AVX2
// Scales (or biases) of blocks j0 + l0 .. j0 + l0 + 7 as floats (lanes of blocks past n: 0),
// converted by F16C.
static inline __m256 lanes8(const _Float16 *s, int j0, int n, int per, int l0) {
    if (per == 1 && l0 + 8 <= n) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + j0 + l0)));
    uint16_t t[8] = {0};
    for (int l = 0; l < 8 && l0 + l < n; l++) memcpy(t + l, s + (j0 + l0 + l) / per, 2);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
}

// Lanes (blocks) l0 .. l0 + 7 (seg8) or l0 .. l0 + 3 (seg4) of segment t (4n bytes) of a group
// of n blocks; lanes of blocks past n load as 0.
static inline __m256i seg8(const uint8_t *w, int n, int t, int l0) {
    if (n == 16) return _mm256_loadu_si256((const __m256i *)(w + 64 * t + 4 * l0));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_epi32((const int *)(w + 4 * n * t + 4 * l0), _mm256_cmpgt_epi32(_mm256_set1_epi32(n - l0), lane));
}
static inline __m128i seg4(const uint8_t *w, int n, int t, int l0) {
    const __m128i lane = _mm_setr_epi32(0, 1, 2, 3);
    return _mm_maskload_epi32((const int *)(w + 4 * n * t + 4 * l0), _mm_cmpgt_epi32(_mm_set1_epi32(n - l0), lane));
}

// dot_tile_q8 on AVX2, in native 256-bit halves of a group (blocks 0..7, then 8..15): GCC lowers
// the generic 16-lane vectors through the stack on CPUs without AVX-512. Per lane the same
// operations in the same order as the generic code: the integer sums (exact, so in any order),
// then acc += I d s per digit and acc += b m, fused. Two shapes of the same arithmetic:
// * whole groups, up to 4 rows (decode, short drafts): the accumulators in registers
//   (whole_groups_regs); the 8 unpacked code vectors and 8 accumulators already spill a few;
// * whole groups, 5-8 rows, and every last partial group: the accumulators in `part` (memory),
//   so the 8 code vectors stay in registers across the rows (q8_span): a tile takes 8 rows per
//   read of the codes, and a partial group's blocks past the last whole half run in a 128-bit
//   quarter when they are at most 4 (the absent lanes would only add exact zeros: an
//   accumulator is never -0, so +0 leaves it as it is). 8-bit codes run there as two 4-bit
//   passes, low nibbles then high (c = lo + 16 hi), their integer sums combined before the
//   float terms; in registers, both nibbles in one pass.
static inline __attribute__((always_inline)) void whole_groups_regs(const int R, const int bits, const int D,
                                                                    const QMat *q, int o, const QAct *a, int r0,
                                                                    v16f *part) {
    __m256 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int in = q->in, nb = in / 32, per = q->gs / 32, ng = in / q->gs, full = nb / 16;
    const _Float16 *s = q->s + (size_t)o * ng, *b = q->b + (size_t)o * ng;
    const uint8_t *w = q->w + (size_t)o * (size_t)(in * bits / 8);
    const int segs = bits == 4 ? 4 : 8;
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (int g = 0; g < full; g++) {
        const uint8_t *wg = w + (size_t)16 * g * 4 * segs;
        for (int h = 0; h < 2; h++) {
            const __m256 sv = lanes8(s, 16 * g, 16, per, 8 * h), bv = lanes8(b, 16 * g, 16, per, 8 * h);
            __m256i W[8];
            for (int t = 0; t < 4; t++) W[t] = seg8(wg, 16, t, 8 * h);
            if (bits == 4)
                for (int t = 0; t < 4; t++) {
                    W[4 + t] = _mm256_and_si256(_mm256_srli_epi16(W[t], 4), low4);
                    W[t] = _mm256_and_si256(W[t], low4);
                }
            else
                for (int t = 4; t < 8; t++) W[t] = seg8(wg, 16, t, 8 * h);
            for (int r = 0; r < R; r++) {
                const size_t at = (size_t)(r0 + r) * a->sd + 16 * g + 8 * h;
                for (int k = 0; k < D; k++) {
                    const int8_t *aq = a->q[k] + (size_t)(r0 + r) * a->sq + 512 * g + 32 * h;
                    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
                    for (int t = 0; t < 8; t++) {
                        const __m256i av = _mm256_loadu_si256((const __m256i *)(aq + 64 * t));
                        if (bits == 4) {
                            lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(W[t], av));
                        } else {
                            lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(_mm256_and_si256(W[t], low4), av));
                            hi = _mm256_add_epi16(
                                hi, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(W[t], 4), low4), av));
                        }
                    }
                    __m256i v = _mm256_madd_epi16(lo, ones);
                    if (bits == 8) v = _mm256_add_epi32(v, _mm256_slli_epi32(_mm256_madd_epi16(hi, ones), 4));
                    acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(sv, _mm256_loadu_ps(a->d[k] + at)),
                                                acc[r][h]);
                }
                acc[r][h] = _mm256_fmadd_ps(bv, _mm256_loadu_ps(a->m + at), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps((float *)(part + 16 * r), acc[r][0]);
        _mm256_storeu_ps((float *)(part + 16 * r) + 8, acc[r][1]);
    }
}

// Blocks l0 .. l0 + 7 (or + 3, in 128-bit vectors) of group g (n blocks), for R <= 8 rows,
// accumulating into `part`.
#define Q8_SPAN(VI, VF, LOADI, STOREI, SEG, AND, SRLI, SET1, SET16, MADDUBS, ADD16, MADD, ADD32, SLLI32, CVT,  \
                FMADD, MUL, LOADF, STOREF, LANES)                                                          \
    do {                                                                                                  \
        const VF sv = LANES(s, 16 * g, n, per, l0), bv = LANES(b, 16 * g, n, per, l0);                    \
        int32_t low[8][2][8];  /* (8-bit codes: the low nibbles' sums, per row and digit) */              \
        for (int pass = 0; pass < (bits == 8 ? 2 : 1); pass++) {                                          \
            VI W[8];                                                                                      \
            if (bits == 4)                                                                                \
                for (int t = 0; t < 4; t++) {                                                             \
                    const VI c = SEG(wg, n, t, l0);                                                       \
                    W[t] = AND(c, SET1(15));                                                              \
                    W[4 + t] = AND(SRLI(c, 4), SET1(15));                                                 \
                }                                                                                         \
            else                                                                                          \
                for (int t = 0; t < 8; t++) {                                                             \
                    const VI c = SEG(wg, n, t, l0);                                                       \
                    W[t] = pass ? AND(SRLI(c, 4), SET1(15)) : AND(c, SET1(15));                           \
                }                                                                                         \
            for (int r = 0; r < R; r++) {                                                                 \
                const size_t at = (size_t)(r0 + r) * a->sd + 16 * g + l0;                                \
                float *acc = (float *)(part + 16 * r) + l0;                                               \
                for (int k = 0; k < D; k++) {                                                             \
                    const int8_t *aq = a->q[k] + (size_t)(r0 + r) * a->sq + 512 * g + 4 * l0;             \
                    VI sum = MADDUBS(W[0], LOADI(aq));                                                    \
                    for (int t = 1; t < 8; t++) sum = ADD16(sum, MADDUBS(W[t], LOADI(aq + 64 * t)));      \
                    VI v = MADD(sum, SET16(1));                                                           \
                    if (bits == 8) {                                                                      \
                        if (!pass) {                                                                      \
                            STOREI(low[r][k], v);                                                         \
                            continue;                                                                     \
                        }                                                                                 \
                        v = ADD32(LOADI(low[r][k]), SLLI32(v, 4));                                        \
                    }                                                                                     \
                    STOREF(acc, FMADD(CVT(v), MUL(sv, LOADF(a->d[k] + at)), LOADF(acc)));                 \
                }                                                                                         \
                if (bits == 4 || pass) STOREF(acc, FMADD(bv, LOADF(a->m + at), LOADF(acc)));              \
            }                                                                                             \
        }                                                                                                 \
    } while (0)

static inline __m128 lanes4(const _Float16 *s, int j0, int n, int per, int l0) {
    return _mm256_castps256_ps128(lanes8(s, j0, n, per, l0));
}
#define LOAD256I(p) _mm256_loadu_si256((const __m256i *)(p))
#define STORE256I(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#define LOAD128I(p) _mm_loadu_si128((const __m128i *)(p))
#define STORE128I(p, v) _mm_storeu_si128((__m128i *)(p), v)

static inline __attribute__((always_inline)) void q8_span(const int R, const int bits, const int D, const QMat *q,
                                                          int o, const QAct *a, int r0, v16f *part, int g, int n,
                                                          int l0) {
    const int in = q->in, per = q->gs / 32, ng = in / q->gs;
    const _Float16 *s = q->s + (size_t)o * ng, *b = q->b + (size_t)o * ng;
    const uint8_t *wg = q->w + (size_t)o * (size_t)(in * bits / 8) + (size_t)16 * g * 4 * (bits == 4 ? 4 : 8);
    if (n - l0 > 4)
        Q8_SPAN(__m256i, __m256, LOAD256I, STORE256I, seg8, _mm256_and_si256, _mm256_srli_epi16, _mm256_set1_epi8,
                _mm256_set1_epi16, _mm256_maddubs_epi16, _mm256_add_epi16, _mm256_madd_epi16, _mm256_add_epi32,
                _mm256_slli_epi32, _mm256_cvtepi32_ps, _mm256_fmadd_ps, _mm256_mul_ps, _mm256_loadu_ps,
                _mm256_storeu_ps, lanes8);
    else
        Q8_SPAN(__m128i, __m128, LOAD128I, STORE128I, seg4, _mm_and_si128, _mm_srli_epi16, _mm_set1_epi8,
                _mm_set1_epi16, _mm_maddubs_epi16, _mm_add_epi16, _mm_madd_epi16, _mm_add_epi32, _mm_slli_epi32,
                _mm_cvtepi32_ps, _mm_fmadd_ps, _mm_mul_ps, _mm_loadu_ps, _mm_storeu_ps, lanes4);
}

static inline __attribute__((always_inline)) void dot_tile_q8(const int R, const int bits, const int D, const QMat *q,
                                                              int o, const QAct *a, int r0, v16f *part) {
    const int nb = q->in / 32, full = nb / 16, rest = nb % 16;
    prefetch_output(q, o);
    if (R <= 4) {
        whole_groups_regs(R, bits, D, q, o, a, r0, part);
    } else {
        for (int r = 0; r < R; r++) part[16 * r] = (v16f){0};
        for (int g = 0; g < full; g++)
            for (int l0 = 0; l0 < 16; l0 += 8) q8_span(R, bits, D, q, o, a, r0, part, g, 16, l0);
    }
    for (int l0 = 0; l0 < rest; l0 += 8) q8_span(R, bits, D, q, o, a, r0, part, full, rest, l0);
}
#else
static inline __attribute__((always_inline)) void dot_tile_q8(const int R, const int bits, const int D, const QMat *q,
                                                              int o, const QAct *a, int r0, v16f *part) {
    v16f acc[TILE];
    for (int r = 0; r < R; r++) acc[r] = (v16f){0};
    const int in = q->in, nb = in / 32, per = q->gs / 32, ng = in / q->gs, full = nb / 16, rest = nb % 16;
    const _Float16 *s = q->s + (size_t)o * ng, *b = q->b + (size_t)o * ng;
    const uint8_t *w = q->w + (size_t)o * (size_t)(in * bits / 8);
    const int segs = bits == 4 ? 4 : 8;
    prefetch_output(q, o);
    for (int g = 0; g <= full; g++) {  // the whole groups, then a partial one
        const int n = g == full ? rest : 16;
        if (n == 0) continue;
        const uint8_t *wg = w + (size_t)16 * g * 4 * segs;  // (16 blocks of 4 * segs bytes before it)
        const v16f sv = lanes16(s, 16 * g, n, per), bv = lanes16(b, 16 * g, n, per);
// the group's float term of row r and digit k, lanes = blocks: d s I; then the biases: b (d sum q)
#define GROUP_FLOATS(r, k, I)                                                                     \
    acc[r] += __builtin_convertvector(I, v16f) * (sv * load16(a->d[k] + (size_t)(r0 + r) * a->sd + 16 * g))
#define GROUP_BIAS(r) acc[r] += bv * load16(a->m + (size_t)(r0 + r) * a->sd + 16 * g)
#ifdef Q8_VNNI
        if (n <= 8) {  // half width
            VNNI_GROUP(__m256i, seg256, _mm256_and_si256, _mm256_srli_epi16, _mm256_set1_epi8, _mm256_setzero_si256,
                       _mm256_dpbusd_epi32, LOAD256, _mm512_zextsi256_si512);
        } else {
            VNNI_GROUP(__m512i, seg512, _mm512_and_si512, _mm512_srli_epi16, _mm512_set1_epi8, _mm512_setzero_si512,
                       _mm512_dpbusd_epi32, _mm512_loadu_si512, (__m512i));
        }
#else
        v16i W[8];
        for (int t = 0; t < 4; t++) W[t] = seg_generic(wg, n, t);
        if (bits == 4)
            for (int t = 0; t < 4; t++) {
                W[4 + t] = (v16i)((v16u)W[t] >> 4) & 0x0F0F0F0F;
                W[t] = W[t] & 0x0F0F0F0F;
            }
        else
            for (int t = 4; t < 8; t++) W[t] = seg_generic(wg, n, t);
        for (int r = 0; r < R; r++) {
            for (int k = 0; k < D; k++) {
                const int8_t *aq = a->q[k] + (size_t)(r0 + r) * a->sq + 512 * g;
                v16i v = {0};
                for (int t = 0; t < 8; t++) v = dot_generic(v, W[t], aq + 64 * t);
                GROUP_FLOATS(r, k, v);
            }
            GROUP_BIAS(r);
        }
#endif
#undef GROUP_FLOATS
#undef GROUP_BIAS
    }
    for (int r = 0; r < R; r++) part[16 * r] = acc[r];
}
#endif

#define TILE_CASE_Q8(R)                                                                   \
    case R:                                                                               \
        if (q->bits == 4) dot_tile_q8(R, 4, D, q, o, a, r0, part + 16 * r0 + (o - ob));   \
        else dot_tile_q8(R, 8, D, q, o, a, r0, part + 16 * r0 + (o - ob));                \
        break;

static inline __attribute__((always_inline)) void qmv_q8(const int D, const QMat *q, int lo, int hi, const QAct *a,
                                                         int M, float *y, int ys, int add) {
    OUTPUT_LOOP(TILE_CASE_Q8, TILE_Q8, TILE_CASES_Q8)
}

static void qmv_q8_1(const QMat *q, int lo, int hi, const QAct *a, int M, float *y, int ys, int add) {
    qmv_q8(1, q, lo, hi, a, M, y, ys, add);
}
static void qmv_q8_2(const QMat *q, int lo, int hi, const QAct *a, int M, float *y, int ys, int add) {
    qmv_q8(2, q, lo, hi, a, M, y, ys, add);
}

// Outputs [lo, hi) of y = x W^T: float32 inputs x, or (Model.digits) their quantization a.
static void matvec(const Model *m, const QMat *q, int lo, int hi, const float *x, int xs, const QAct *a, int M,
                   float *y, int ys, int add) {
    if (m->digits == 2) qmv_q8_2(q, lo, hi, a, M, y, ys, add);
    else if (m->digits == 1) qmv_q8_1(q, lo, hi, a, M, y, ys, add);
    else qmv(q, lo, hi, x, xs, M, y, ys, add);
}

// ---- row operations --------------------------------------------------------------------------
static void rms_norm(const float *x, const float *w, float *out, int d, float eps) {
    v16f ss = {0};
    for (int c = 0; c < d; c += 16) {
        v16f v = load16(x + c);
        ss += v * v;
    }
    const float inv = 1.0f / sqrtf(hsum(ss) / (float)d + eps);
    for (int c = 0; c < d; c += 16) store16(out + c, load16(x + c) * inv * load16(w + c));
}

// RoPE (non-traditional: dims i and i + hd/2 rotate together) of one head vector, in place.
static void rope(float *v, const float *cs, const float *sn, int hd, float mul) {
    const int h2 = hd / 2;
    for (int i = 0; i < h2; i++) {
        const float a = v[i], b = v[i + h2];
        v[i] = (a * cs[i] - b * sn[i]) * mul;
        v[i + h2] = (a * sn[i] + b * cs[i]) * mul;
    }
}

#define SEG 256       // keys per attention work unit (a multiple of 16)
#define ROW_BLOCK 8   // rows per attention work unit (more units for the threads at short contexts)

// Causal attention over one segment of SEG keys (keys [j0, j0 + SEG) of one KV head) for the
// rows r0..r1-1 of one sequence (consecutive positions) and the G query heads of the KV head.
// Row r covers keys [j0, min(j0 + SEG, pos[r] + 1)); rows that end before j0 are skipped. Per
// (row, head): scores 16 keys at a time, the segment's max, exp, sum and exp-weighted sum of
// values, unnormalised, into its partial [max, sum, acc[hd]] at parts + unit * G * (hd + 2) + h
// * (hd + 2), unit = unit0[r] + g * segments(r) + sg. The rows share each key block and value
// read; each row's arithmetic, in its order, depends on its position and the segment alone.
// sc: MAX_ROWS * G * SEG floats; acc: MAX_ROWS * G * hd / 16 vectors.
static void attend_segment(const Model *m, const float *qkv, int nqkv, int r0, int r1, const int32_t *pos,
                           const float *K, const float *V, int g, int sg, float *parts, const int32_t *unit0,
                           float *sc, v16f *acc) {
    const int hd = m->hd, nc = hd / 16, G = m->nh / m->nkv, j0 = sg * SEG;
    const v16m lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16f ninf = splat(-INFINITY);
    while (r0 < r1 && pos[r0] < j0) r0++;
    if (r0 == r1) return;
    int n[MAX_ROWS] = {0};
    for (int r = r0; r < r1; r++) n[r - r0] = (pos[r] + 1 < j0 + SEG ? pos[r] + 1 : j0 + SEG) - j0;
    const int nmax = n[r1 - 1 - r0];
    for (int b0 = 0; b0 < nmax; b0 += 16) {
        for (int r = r0; r < r1; r++) {
            if (n[r - r0] <= b0) continue;
            const int nb = n[r - r0] - b0 < 16 ? n[r - r0] - b0 : 16;
            const float *q = qkv + (size_t)r * nqkv + g * G * hd;
            for (int h = 0; h < G; h++) {
                v16f dots[16];
                for (int t = 0; t < 16; t++) {
#if TREE_AVX2  // (the same fused multiply-adds, lanes 0-7 and 8-15 in native registers)
                    __m256 d0 = _mm256_setzero_ps(), d1 = _mm256_setzero_ps();
                    if (t < nb) {
                        const float *k = K + (size_t)(j0 + b0 + t) * hd, *qh = q + h * hd;
                        for (int c = 0; c < nc; c++) {
                            d0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 16 * c), _mm256_loadu_ps(k + 16 * c), d0);
                            d1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 16 * c + 8), _mm256_loadu_ps(k + 16 * c + 8), d1);
                        }
                    }
                    _mm256_storeu_ps((float *)&dots[t], d0);
                    _mm256_storeu_ps((float *)&dots[t] + 8, d1);
#else
                    v16f d = {0};
                    if (t < nb) {
                        const float *k = K + (size_t)(j0 + b0 + t) * hd;
                        for (int c = 0; c < nc; c++) d += load16(q + h * hd + 16 * c) * load16(k + 16 * c);
                    }
                    dots[t] = d;
#endif
                }
                store16(sc + ((size_t)(r - r0) * G + h) * SEG + b0, vsel(lane < nb, reduce16(dots), ninf));
            }
        }
    }
    for (int r = r0; r < r1; r++) {
        const int np = (n[r - r0] + 15) & ~15, segs = (pos[r] + SEG) / SEG;
        float *part = parts + (size_t)(unit0[r] + g * segs + sg) * G * (hd + 2);
        for (int h = 0; h < G; h++) {
            float *sh = sc + ((size_t)(r - r0) * G + h) * SEG, *ph = part + (size_t)h * (hd + 2);
            v16f mv = load16(sh);
            for (int j = 16; j < np; j += 16) {
                const v16f v = load16(sh + j);
                mv = vsel(v > mv, v, mv);
            }
            const float mx = hsum_max(mv);
            v16f sum = {0};
            for (int j = 0; j < np; j += 16) {
                const v16f v = load16(sh + j);
                const v16f e = vsel(v == ninf, (v16f){0}, vexp(v - mx));  // (masked lanes: exactly 0)
                store16(sh + j, e);
                sum += e;
            }
            ph[0] = mx;
            ph[1] = hsum(sum);
        }
    }
#if TREE_AVX2
    // (row, head) by (row, head), up to 64 value lanes in registers over all keys: each lane
    // adds e_j * v_j in key order j = 0, 1, ..., as the loop below does (it keeps acc in memory)
    for (int r = r0; r < r1; r++)
        for (int h = 0; h < G; h++) {
            const float *e = sc + ((size_t)(r - r0) * G + h) * SEG;
            float *a = (float *)(acc + ((size_t)(r - r0) * G + h) * nc);
            for (int c0 = 0; c0 < 2 * nc; c0 += 8) {
                const int w = 2 * nc - c0 < 8 ? 2 * nc - c0 : 8;
                __m256 ra[8];
                for (int i = 0; i < 8; i++) ra[i] = _mm256_setzero_ps();
                for (int j = 0; j < n[r - r0]; j++) {
                    const __m256 ej = _mm256_set1_ps(e[j]);
                    const float *v = V + (size_t)(j0 + j) * hd + 8 * c0;
                    for (int i = 0; i < 8; i++)
                        if (i < w) ra[i] = _mm256_fmadd_ps(ej, _mm256_loadu_ps(v + 8 * i), ra[i]);
                }
                for (int i = 0; i < w; i++) _mm256_storeu_ps(a + 8 * (c0 + i), ra[i]);
            }
        }
#else
    for (int i = 0; i < (r1 - r0) * G * nc; i++) acc[i] = (v16f){0};
    for (int j = 0; j < nmax; j++) {
        const float *v = V + (size_t)(j0 + j) * hd;
        for (int r = r0; r < r1; r++) {
            if (j >= n[r - r0]) continue;
            for (int h = 0; h < G; h++) {
                const v16f e = splat(sc[((size_t)(r - r0) * G + h) * SEG + j]);
                v16f *a = acc + ((size_t)(r - r0) * G + h) * nc;
                for (int c = 0; c < nc; c++) a[c] += e * load16(v + 16 * c);
            }
        }
    }
#endif
    for (int r = r0; r < r1; r++) {
        const int segs = (pos[r] + SEG) / SEG;
        float *part = parts + (size_t)(unit0[r] + g * segs + sg) * G * (hd + 2);
        for (int h = 0; h < G; h++)
            for (int c = 0; c < nc; c++)
                store16(part + (size_t)h * (hd + 2) + 2 + 16 * c, acc[((size_t)(r - r0) * G + h) * nc + c]);
    }
}

// The softmax-weighted values of one (row, KV head) from its S segments' partials, combined in
// segment order (a fixed order: the same for every pass width): out [G, hd].
static void combine_segments(const Model *m, const float *parts, int S, float *out) {
    const int hd = m->hd, nc = hd / 16, G = m->nh / m->nkv, stride = G * (hd + 2);
    for (int h = 0; h < G; h++) {
        float mx = parts[(size_t)h * (hd + 2)];
        for (int s = 1; s < S; s++) {
            const float v = parts[(size_t)s * stride + h * (hd + 2)];
            mx = v > mx ? v : mx;
        }
        float sum = 0.0f;
        v16f acc[16];  // (hd <= 256)
        for (int c = 0; c < nc; c++) acc[c] = (v16f){0};
        for (int s = 0; s < S; s++) {
            const float *ph = parts + (size_t)s * stride + h * (hd + 2);
            const float w = expf(ph[0] - mx);
            sum += ph[1] * w;
            for (int c = 0; c < nc; c++) acc[c] += load16(ph + 2 + 16 * c) * w;
        }
        const float inv = 1.0f / sum;
        for (int c = 0; c < nc; c++) store16(out + h * hd + 16 * c, acc[c] * inv);
    }
}

static inline v16f silu_mul(v16f g, v16f u) { return g / (1.0f + vexp(-g)) * u; }

// ---- the thread pool ---------------------------------------------------------------------------
// Workers sleep on a condition variable between passes and meet at a spinning barrier between
// the phases of one (~10 per layer). (OpenMP was measured slower: libgomp stops spinning at its
// barriers once two threads have each run a parallel region, as the engine's worker thread and a
// benchmark's main thread do.)
typedef struct {
    const Model *m;
    int M;
    const int32_t *pos, *seq, *cap;   // per row: position, sequence; per sequence: cache capacity
    float *const *kc, *const *vc;
    float *logits, *hidden, *ws, *trig, *scratch, *parts;
    v16f *acc;
    const QAct *qa;         // [threads]: each thread's quantized rows (Model.digits)
    const int32_t *unit0;   // [M + 1]: row r's attention partials are unit0[r] .. unit0[r + 1] - 1
    const int32_t *units;   // [nunits, 5]: attention units (first row, end row, KV head, segment, thread)
    int nunits;
} Job;

static struct {
    pthread_mutex_t call;              // one pass at a time
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int want;                          // threads asked for (set once)
    int threads;                       // workers + the calling thread (0: not started)
    unsigned long gen;                 // pass counter the workers wait on
    const Job *job;
    atomic_int arrived;
    atomic_uint phase;
    atomic_int sleepers;               // threads asleep at a barrier
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, 0, 0};

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
static void wait_on(atomic_uint *word, unsigned value) {  // until *word != value (or spuriously)
    syscall(SYS_futex, (unsigned *)word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}
static void wake_all(atomic_uint *word) { syscall(SYS_futex, (unsigned *)word, FUTEX_WAKE_PRIVATE, 0x7fffffff, NULL, NULL, 0); }
#else
static void wait_on(atomic_uint *word, unsigned value) {
    (void)word;
    (void)value;
    sched_yield();
}
static void wake_all(atomic_uint *word) { (void)word; }
#endif

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

// Spin for a short while (a peer a few microseconds behind), then sleep on the phase word: on a
// shared or oversubscribed CPU a peer may be descheduled for a whole time slice, and spinning
// through ~300 barriers per pass then costs 20x the pass (measured: 143 ms against 7 ms).
#define SPIN_NS 50000L

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void barrier(void) {
    if (pool.threads == 1) return;
    const unsigned phase = atomic_load(&pool.phase);
    if (atomic_fetch_add(&pool.arrived, 1) == pool.threads - 1) {
        atomic_store(&pool.arrived, 0);
        atomic_fetch_add(&pool.phase, 1);
        if (atomic_load(&pool.sleepers)) wake_all(&pool.phase);
        return;
    }
    const long until = now_ns() + SPIN_NS;
    for (int i = 0; atomic_load(&pool.phase) == phase; i++) {
        if (i < 64 || now_ns() < until) {
            relax();
            continue;
        }
        atomic_fetch_add(&pool.sleepers, 1);
        while (atomic_load(&pool.phase) == phase) wait_on(&pool.phase, phase);
        atomic_fetch_sub(&pool.sleepers, 1);
    }
}

static inline void split(int n, int tid, int *lo, int *hi) {
    *lo = (int)((long)n * tid / pool.threads);
    *hi = (int)((long)n * (tid + 1) / pool.threads);
}

#define FOR_SHARE(var, n) for (int lo_, hi_, var = (split((n), tid, &lo_, &hi_), lo_); var < hi_; var++)

static void project(const Model *m, const QMat *q, int tid, const float *x, int xs, const QAct *a, int M, float *y,
                    int ys, int add) {
    int lo, hi;
    split(q->out, tid, &lo, &hi);
    matvec(m, q, lo, hi, x, xs, a, M, y, ys, add);
    barrier();
}

// Each thread normalises every row into its own buffer (a few microseconds) instead of sharing
// one behind a barrier; gate and up outputs of the same columns go to the same thread, which
// applies SiLU at once. Seven barriers per layer. With integer activations each thread quantizes
// every row of each projection's input into its own buffer (no barrier; ~0.1 us per row).
static void run_pass(const Job *j, int tid) {
    const Model *m = j->m;
    const int M = j->M, dm = m->dm, hd = m->hd, nh = m->nh, nkv = m->nkv, di = m->di;
    const int G = nh / nkv, nqkv = (nh + 2 * nkv) * hd, h2 = hd / 2;
    float *x = j->ws, *qkv = x + M * dm, *att = qkv + M * nqkv, *gu = att + M * nh * hd;
    float *act = gu + 2 * M * di, *xn = act + M * di + (size_t)tid * M * dm;  // (xn: this thread's)
    float *sc = j->scratch + (size_t)tid * MAX_ROWS * G * SEG;
    v16f *acc = j->acc + (size_t)tid * MAX_ROWS * G * (hd / 16);
    const QAct *qa = j->qa + tid;
    int lo, hi;
    for (int l = 0; l < m->nl; l++) {
        const float *nw = m->norms + (size_t)l * 2 * dm;
        if (l) FOR_SHARE(r, M) memcpy(j->hidden + ((size_t)(l - 1) * M + r) * dm, x + r * dm, sizeof(float) * dm);
        for (int r = 0; r < M; r++) rms_norm(x + r * dm, nw, xn + r * dm, dm, m->eps);
        if (m->digits) quantize_rows(xn, dm, M, dm, qa, m->digits);
        project(m, &m->qkv[l], tid, xn, dm, qa, M, qkv, nqkv, 0);
        FOR_SHARE(u, M * (nh + nkv)) {
            const int r = u / (nh + nkv), t = u % (nh + nkv);
            float *v = qkv + (size_t)r * nqkv + t * hd;
            rope(v, j->trig + r * hd, j->trig + r * hd + h2, hd, t < nh ? m->scale : 1.0f);
            if (t >= nh) {
                const int s = j->seq[r];
                const size_t at = ((size_t)(t - nh) * j->cap[s] + j->pos[r]) * hd;
                memcpy(j->kc[s * m->nl + l] + at, v, sizeof(float) * hd);
                memcpy(j->vc[s * m->nl + l] + at, v + nkv * hd, sizeof(float) * hd);
            }
        }
        barrier();
        // attention units: (sequence, KV head, segment of SEG keys) for all the sequence's rows,
        // then one combine per (row, KV head)
        for (int u = 0; u < j->nunits; u++) {
            const int32_t *t = j->units + 5 * u;  // first row, end row, KV head, segment, thread
            if (t[4] != tid) continue;
            const int s = j->seq[t[0]];
            attend_segment(m, qkv, nqkv, t[0], t[1], j->pos, j->kc[s * m->nl + l] + (size_t)t[2] * j->cap[s] * hd,
                           j->vc[s * m->nl + l] + (size_t)t[2] * j->cap[s] * hd, t[2], t[3], j->parts, j->unit0,
                           sc, acc);
        }
        barrier();
        FOR_SHARE(u, M * nkv) {
            const int r = u / nkv, g = u % nkv, segs = (j->pos[r] + SEG) / SEG;
            combine_segments(m, j->parts + (size_t)(j->unit0[r] + g * segs) * G * (hd + 2), segs,
                             att + (size_t)r * nh * hd + g * G * hd);
        }
        barrier();
        if (m->digits) quantize_rows(att, nh * hd, M, nh * hd, qa, m->digits);
        project(m, &m->o[l], tid, att, nh * hd, qa, M, x, dm, 1);
        for (int r = 0; r < M; r++) rms_norm(x + r * dm, nw + dm, xn + r * dm, dm, m->eps);
        if (m->digits) quantize_rows(xn, dm, M, dm, qa, m->digits);
        split(di / 16, tid, &lo, &hi);  // columns [16 lo, 16 hi) of gate and of up, then SiLU
        matvec(m, &m->gu[l], 16 * lo, 16 * hi, xn, dm, qa, M, gu, 2 * di, 0);
        matvec(m, &m->gu[l], di + 16 * lo, di + 16 * hi, xn, dm, qa, M, gu, 2 * di, 0);
        for (int r = 0; r < M; r++)
            for (int c = 16 * lo; c < 16 * hi; c += 16)
                store16(act + (size_t)r * di + c, silu_mul(load16(gu + (size_t)r * 2 * di + c),
                                                           load16(gu + (size_t)r * 2 * di + di + c)));
        barrier();
        if (m->digits) quantize_rows(act, di, M, di, qa, m->digits);
        project(m, &m->down[l], tid, act, di, qa, M, x, dm, 1);
    }
    FOR_SHARE(r, M) memcpy(j->hidden + ((size_t)(m->nl - 1) * M + r) * dm, x + r * dm, sizeof(float) * dm);
    if (!j->logits) {  // (a prefill chunk: keys, values and hidden states only)
        barrier();
        return;
    }
    for (int r = 0; r < M; r++) rms_norm(x + r * dm, m->fnorm, xn + r * dm, dm, m->eps);
    if (m->digits) quantize_rows(xn, dm, M, dm, qa, m->digits);
    project(m, m->head, tid, xn, dm, qa, M, j->logits, m->vocab, 0);
}

static void *worker(void *arg) {
    const int tid = (int)(intptr_t)arg;
    unsigned long seen = 0;
    for (;;) {
        pthread_mutex_lock(&pool.mu);
        while (pool.gen == seen) pthread_cond_wait(&pool.cv, &pool.mu);
        seen = pool.gen;
        const Job *job = pool.job;
        pthread_mutex_unlock(&pool.mu);
        run_pass(job, tid);  // (ends at a barrier: the caller returns after every worker is done)
    }
    return NULL;
}

static void start_locked(void) {  // (with pool.call held) the workers, after the first call or a fork
    pool.threads = 1;
    for (int t = 1; t < pool.want; t++) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&th, &attr, worker, (void *)(intptr_t)t);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.threads++;
    }
}

// A forked child has none of the workers: it starts its own at its first pass. (prepare waits
// for a running pass, so the child never inherits the pool mid-pass.)
static void fork_prepare(void) { pthread_mutex_lock(&pool.call); }
static void fork_parent(void) { pthread_mutex_unlock(&pool.call); }
static void fork_child(void) {
    // (a worker may have held pool.mu at fork time; the child has no workers, so re-initialising
    // the mutex and condition variable is the only way to get usable ones back)
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv, NULL);
    pool.threads = 0;
    pool.gen = 0;
    atomic_store(&pool.arrived, 0);
    atomic_store(&pool.sleepers, 0);
    pthread_mutex_unlock(&pool.call);
}

// Set the pool's size once per process (`threads` in all, the caller included; later calls keep
// the first count) and start it. Returns the count.
int specserve_cpu_threads(int threads) {
    pthread_mutex_lock(&pool.call);
    if (!pool.want) {
        pool.want = threads < 1 ? 1 : threads;
        pthread_atfork(fork_prepare, fork_parent, fork_child);
    }
    if (!pool.threads) start_locked();
    const int n = pool.threads;
    pthread_mutex_unlock(&pool.call);
    return n;
}

// One pass over M rows of S sequences: row r is sequence seq[r]'s token at position pos[r]
// (a sequence's rows consecutive and in increasing position). x0 [M, dm] embeddings; kc/vc
// [S * nl]: sequence s's layer-l cache buffers [nkv, cap[s], hd] at index s * nl + l, holding
// the positions before its first row (the pass writes its rows' positions); logits [M, vocab]
// (NULL: the LM head is skipped, as a prefill chunk needs only the cache and hidden states);
// hidden [nl, M, dm] (decoder layer l's output). Returns 0, or -1 when a workspace allocation
// failed (nothing was written) or the pool was not started.
int specserve_cpu_pass(const Model *m, int M, const int32_t *pos, const int32_t *seq, const float *x0,
                       float *const *kc, float *const *vc, const int32_t *cap, float *logits, float *hidden) {
    const int dm = m->dm, hd = m->hd, nh = m->nh, nkv = m->nkv, di = m->di, G = nh / nkv;
    const int nqkv = (nh + 2 * nkv) * hd, h2 = hd / 2;
    pthread_mutex_lock(&pool.call);
    if (pool.want && !pool.threads) start_locked();  // (a forked child)
    const int threads = pool.threads;
    float *ws = malloc(sizeof(float) * (size_t)M * (dm + nqkv + nh * hd + 3 * di + threads * dm));
    float *trig = malloc(sizeof(float) * (size_t)M * hd);
    float *scratch = malloc(sizeof(float) * (size_t)threads * MAX_ROWS * G * SEG);
    int32_t unit0[MAX_ROWS + 1];
    unit0[0] = 0;
    for (int r = 0; r < M && r < MAX_ROWS; r++) unit0[r + 1] = unit0[r] + nkv * ((pos[r] + SEG) / SEG);
    float *parts = malloc(sizeof(float) * (size_t)(M <= MAX_ROWS ? unit0[M] : 1) * G * (hd + 2));
    // attention units: per sequence (rows consecutive), per KV head, per segment of its last row
    int32_t *units = malloc(sizeof(int32_t) * 5 * (size_t)(M <= MAX_ROWS ? unit0[M] : 1));
    int nunits = 0;
    long total = 0;  // (work: keys summed over the unit's rows, plus a fixed cost per unit)
    for (int r0 = 0, r1; r0 < M && M <= MAX_ROWS; r0 = r1) {  // (a sequence's rows, at most ROW_BLOCK)
        for (r1 = r0 + 1; r1 < M && r1 - r0 < ROW_BLOCK && seq[r1] == seq[r0]; r1++) {}
        const int segs = (pos[r1 - 1] + SEG) / SEG;
        for (int g = 0; units && g < nkv; g++)
            for (int sg = 0; sg < segs; sg++, nunits++) {
                int32_t *t = units + 5 * nunits;
                t[0] = r0, t[1] = r1, t[2] = g, t[3] = sg, t[4] = 32;
                for (int r = r0; r < r1; r++) {
                    const int keys = (pos[r] + 1 < (sg + 1) * SEG ? pos[r] + 1 : (sg + 1) * SEG) - sg * SEG;
                    t[4] += keys > 0 ? keys : 0;
                }
                total += t[4];
            }
    }
    // contiguous runs of units of about equal work per thread (a unit per (KV head, segment) of
    // a block of 8 rows and one of a single row cost ~8x apart: an even count split left one
    // thread with all the heavy ones, doubling the phase at 9 rows); which thread computes a
    // unit does not change its result
    for (long u = 0, done = 0; units && u < nunits; u++) {
        const long cost = units[5 * u + 4];
        units[5 * u + 4] = (int32_t)(((2 * done + cost) * threads) / (2 * (total ? total : 1)));
        done += cost;
    }
    v16f *acc = aligned_alloc(64, sizeof(v16f) * (size_t)threads * MAX_ROWS * G * (hd / 16));
    // per thread, its quantized rows of the widest projection input
    const int in_max = dm > nh * hd ? (dm > di ? dm : di) : (nh * hd > di ? nh * hd : di);
    const int groups = (in_max / 32 + 15) / 16, sq = 512 * groups, sd = 16 * groups;
    const size_t per_thread = (size_t)M * 2 * (sq + sizeof(float) * 2 * sd);
    char *qbuf = m->digits ? aligned_alloc(64, ((per_thread * threads + 63) & ~(size_t)63) + 64) : NULL;
    QAct *qa = malloc(sizeof(QAct) * (threads ? threads : 1));
    for (int t = 0; qbuf && qa && t < threads; t++) {
        char *base = qbuf + per_thread * t;
        float *f = (float *)(base + (size_t)2 * M * sq);
        qa[t] = (QAct){{(int8_t *)base, (int8_t *)base + (size_t)M * sq}, {f, f + (size_t)M * sd}, f + (size_t)2 * M * sd,
                       sq, sd};
    }
    int rc = -1;
    if (threads && M >= 1 && M <= MAX_ROWS && ws && trig && scratch && acc && parts && units && qa &&
        (qbuf || !m->digits)) {
        memcpy(ws, x0, sizeof(float) * (size_t)M * dm);
        for (int r = 0; r < M; r++)  // cos | sin per row, from the row's position alone
            for (int i = 0; i < h2; i++) {
                const float theta = (float)pos[r] * m->inv_freq[i];
                trig[r * hd + i] = cosf(theta);
                trig[r * hd + h2 + i] = sinf(theta);
            }
        const Job job = {m, M, pos, seq, cap, kc, vc, logits, hidden, ws, trig, scratch, parts, acc, qa, unit0, units, nunits};
        pthread_mutex_lock(&pool.mu);
        pool.job = &job;
        pool.gen++;
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
        run_pass(&job, 0);
        rc = 0;
    }
    pthread_mutex_unlock(&pool.call);
    free(ws);
    free(trig);
    free(scratch);
    free(parts);
    free(units);
    free(acc);
    free(qbuf);
    free(qa);
    return rc;
}
