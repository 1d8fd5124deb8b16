// specserve SIMD-group quantized matmul: CUDA definitions for simd_body.inc.
#define SSK_FMA(a, b, c) fmaf((a), (b), (c))
#define SSK_AS_FLOAT(u) __uint_as_float(u)
#define SSK_SHFL_XOR(v, o) __shfl_xor_sync(0xffffffffu, (v), (o))
#define SSK_UNROLL _Pragma("unroll")
