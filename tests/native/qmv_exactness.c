// Exactness harness for the CPU pass's integer projections (tests/test_fused_cpu.py compiles it
// once per instruction set and compares): for every input size of 1..40 blocks of 32 (each
// count of blocks left over past the whole groups of 16), group sizes 32/64/128, 4- and 8-bit
// codes and one or two activation digits, (a) every row of an M-row projection, M = 1..16,
// equals that row's one-row projection bit for bit (row independence), and (b) a hash of all
// outputs, which must be the same for every build of the source (the vector paths compute the
// generic code's arithmetic), and (c) over a share of the outputs that starts or ends inside a
// block of 16, written or added, the same bits and nothing outside it. Prints "hash <16 hex
// digits> bad <rows that differed>".
#include KERNEL_SOURCE
#include <stdio.h>

static uint64_t state = 0x9E3779B97F4A7C15ULL;
static uint64_t next(void) {  // xorshift64
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}
static float value(void) { return ((int)(next() % 20001) - 10000) / 3000.0f; }

int main(void) {
    uint64_t hash = 1469598103934665603ULL;  // FNV-1a over the outputs' bits
    int bad = 0;
    enum { OUT = 21, ROWS = 16 };
    for (int nb = 1; nb <= 40; nb++)
        for (int gs = 32; gs <= 128; gs *= 2)
            for (int bits = 4; bits <= 8; bits += 4)
                for (int digits = 1; digits <= 2; digits++) {
                    if ((32 * nb) % gs) continue;
                    const int in = 32 * nb, ng = in / gs, groups = (nb + 15) / 16;
                    // (+ PF_AHEAD outputs: the kernel prefetches past the last output)
                    uint8_t *w = malloc((size_t)(OUT + 16) * in * bits / 8);
                    _Float16 *s = malloc(sizeof(_Float16) * (OUT + 16) * ng);
                    _Float16 *b = malloc(sizeof(_Float16) * (OUT + 16) * ng);
                    for (size_t i = 0; i < (size_t)OUT * in * bits / 8; i++) w[i] = (uint8_t)next();
                    for (int i = 0; i < OUT * ng; i++) {
                        s[i] = (_Float16)(value() / 50);
                        b[i] = (_Float16)(value() / 50);
                    }
                    const QMat q = {w, s, b, in, OUT, bits, gs};
                    static float x[ROWS * 40 * 32];
                    for (int i = 0; i < ROWS * in; i++) x[i] = (next() % 7) ? value() : 0.0f;  // (some zero inputs)
                    QAct a = {.sq = 512 * groups, .sd = 16 * groups};
                    for (int k = 0; k < 2; k++) {
                        a.q[k] = calloc(ROWS, a.sq);
                        a.d[k] = calloc((size_t)ROWS * a.sd, sizeof(float));
                    }
                    a.m = calloc((size_t)ROWS * a.sd, sizeof(float));
                    quantize_rows(x, in, ROWS, in, &a, digits);
                    void (*project)(const QMat *, int, int, const QAct *, int, float *, int, int) =
                        digits == 1 ? qmv_q8_1 : qmv_q8_2;
                    float one[ROWS][OUT];
                    for (int r = 0; r < ROWS; r++) {
                        QAct row = a;
                        for (int k = 0; k < 2; k++) {
                            row.q[k] = a.q[k] + (size_t)r * a.sq;
                            row.d[k] = a.d[k] + (size_t)r * a.sd;
                        }
                        row.m = a.m + (size_t)r * a.sd;
                        project(&q, 0, OUT, &row, 1, one[r], OUT, 0);
                    }
                    for (int M = 1; M <= ROWS; M++) {
                        // (c) a thread's share of the outputs may start and end inside a block of
                        // 16: those outputs, and no others, get the full projection's bits,
                        // written (add 0) or added to what y held (add 1)
                        static const int ranges[][2] = {{3, OUT}, {17, 18}, {5, 20}, {0, 16}};
                        for (int ri = 0; ri < 4; ri++)
                            for (int add = 0; add <= 1; add++) {
                                const int lo = ranges[ri][0], hi = ranges[ri][1];
                                float part[ROWS][OUT];
                                for (int r = 0; r < ROWS; r++)
                                    for (int o = 0; o < OUT; o++) part[r][o] = 0.25f * o;
                                project(&q, lo, hi, &a, M, &part[0][0], OUT, add);
                                for (int r = 0; r < ROWS; r++)
                                    for (int o = 0; o < OUT; o++) {
                                        const float want = r >= M || o < lo || o >= hi ? 0.25f * o
                                                           : add ? 0.25f * o + one[r][o] : one[r][o];
                                        if (memcmp(&part[r][o], &want, 4) && bad++ < 5)
                                            printf("row %d of %d, output %d of [%d, %d), add %d differs: %d blocks, "
                                                   "group %d, %d bits, %d digits\n", r, M, o, lo, hi, add, nb, gs,
                                                   bits, digits);
                                    }
                            }
                        float y[ROWS][OUT];
                        project(&q, 0, OUT, &a, M, &y[0][0], OUT, 0);
                        for (int r = 0; r < M; r++) {
                            if (memcmp(y[r], one[r], sizeof one[r])) {
                                if (bad++ < 5)
                                    printf("row %d of %d differs: %d blocks, group %d, %d bits, %d digits\n", r, M,
                                           nb, gs, bits, digits);
                            }
                            for (int o = 0; o < OUT; o++) {
                                uint32_t u;
                                memcpy(&u, &y[r][o], 4);
                                hash = (hash ^ u) * 1099511628211ULL;
                            }
                        }
                    }
                    free(w);
                    free(s);
                    free(b);
                    for (int k = 0; k < 2; k++) {
                        free(a.q[k]);
                        free(a.d[k]);
                    }
                    free(a.m);
                }
    printf("hash %016llx bad %d\n", (unsigned long long)hash, bad);
    return 0;
}
