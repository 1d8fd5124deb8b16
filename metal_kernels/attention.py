"""Row-exact causal attention for decode and verify passes in one launch (CUDA).

``row_attention(queries, keys, values, scale)`` computes, for a pass of ``L`` new rows over a
KV cache of ``S + L`` positions, what ``L`` separate one-row attention calls compute: query
row ``i`` attends to ``keys[:, :, :S + i + 1]``. Each row's arithmetic (key chunks, butterfly
reductions, online-softmax order; see ``sources/attn_cuda.cu``) depends only on that row and
its keys, never on ``L``, so row ``i`` of an ``L``-row call is bit-identical to the one-row
call. The engine uses it for every decode and verify pass when ``SPECSERVE_EXACT_VERIFY=kernel``
(decode rows must go through the same kernel as verify rows), replacing ``L`` attention calls
per layer (engine/exact_attention.py's row-by-row path) with one.

The softmax is computed in base 2 with fp32 accumulation; results agree with
``mx.fast.scaled_dot_product_attention`` to rounding, not bit for bit. CUDA only (no Metal
twin yet): elsewhere :func:`row_attention` returns ``None`` and callers keep their own path.
Algorithm: online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for
softmax"), split over keys as in flash-decoding (Dao et al. 2023), with a fixed split.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from pathlib import Path

import mlx.core as mx

from metal_kernels.qmv import _minify, backend

WARPS = 8
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
_SOURCE = Path(__file__).parent / "sources" / "attn_cuda.cu"


def attention_source() -> str:
    """The kernel body exactly as it is handed to ``mx.fast.cuda_kernel`` (minified)."""
    return _minify(_SOURCE.read_text())


@functools.cache
def _kernel():
    body = attention_source()
    digest = hashlib.sha1(body.encode()).hexdigest()[:10]
    return mx.fast.cuda_kernel(name=f"specserve_row_attention_{digest}", input_names=["q", "k", "v"],
                               output_names=["out"], source=body, ensure_row_contiguous=False)


@functools.lru_cache(maxsize=64)
def _scale_bits(scale: float) -> int:
    return struct.unpack("<i", struct.pack("<f", scale))[0]


def supported(queries: mx.array, keys: mx.array, values: mx.array) -> str:
    """Empty when :func:`row_attention` takes these arrays, else the reason it does not."""
    if backend() != "cuda":
        return f"backend {backend()} (the kernel is CUDA only)"
    if (queries.ndim != 4 or keys.ndim != 4 or values.shape != keys.shape or queries.shape[0] != 1
            or keys.shape[0] != 1 or keys.shape[1] < 1):
        return "shapes (need queries [1, H, L, D], keys/values [1, KV, S + L, D])"
    d = queries.shape[3]
    if d not in SUPPORTED_HEAD_DIMS or keys.shape[3] != d:
        return f"head dim {d}"
    if queries.shape[1] % keys.shape[1] or keys.shape[2] < queries.shape[2]:
        return "heads or key length"
    if queries.dtype not in SUPPORTED_DTYPES or keys.dtype != queries.dtype or values.dtype != queries.dtype:
        return f"dtype {queries.dtype}"
    return ""


def row_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                  warps: int = WARPS) -> mx.array | None:
    """Causal attention of ``L`` new query rows over the cache, one launch, rows independent.

    Args:
        queries: ``[1, H, L, D]`` (after RoPE), float32/float16/bfloat16.
        keys, values: ``[1, KV, S + L, D]``, the cache's contents including the ``L`` new
            positions (strided views are fine), same dtype; ``H % KV == 0``; D 64 or 128.
        scale: the softmax scale (``D ** -0.5`` for Llama-style models).
        warps: warps per block, 1..32. It fixes how keys are split among warps, so it changes the
            bits, not the row independence; the engine always uses ``WARPS``.

    Returns ``[1, H, L, D]`` in the queries' dtype, lazy; or ``None`` when the arrays or the
    backend are not supported (see :func:`supported`), so the caller uses its own path.

    Raises:
        ValueError: ``warps`` outside 1..32.
    """
    if not 1 <= warps <= 32:
        raise ValueError(f"warps must be in 1..32, not {warps}")
    if supported(queries, keys, values):
        return None
    _, h, n, d = queries.shape
    return _kernel()(
        inputs=[queries, keys, values],
        template=[("T", queries.dtype), ("D", d), ("W", warps), ("SCALE_BITS", _scale_bits(float(scale)))],
        grid=(n * h * 32 * warps, 1, 1), threadgroup=(32 * warps, 1, 1),
        output_shapes=[(1, h, n, d)], output_dtypes=[queries.dtype])[0]
