// specserve SIMD-group quantized matmul: Metal definitions for simd_body.inc.
#define SSK_FMA(a, b, c) metal::fma((a), (b), (c))
#define SSK_AS_FLOAT(u) as_type<float>(static_cast<uint32_t>(u))
#define SSK_SHFL_XOR(v, o) simd_shuffle_xor((v), static_cast<ushort>(o))
#define SSK_UNROLL _Pragma("clang loop unroll(full)")
