"""specserve's MLX engine.

Importing this package first sets MLX's process-wide environment defaults (see
:mod:`engine.mlx_env`) and loads an optimised BLAS for MLX's Linux CPU backend (see
:mod:`engine.blas`); import it before anything imports ``mlx.core``.
"""

from .mlx_env import apply_mlx_env_defaults

MLX_ENV = apply_mlx_env_defaults()

from .blas import preload_blas  # noqa: E402

BLAS = preload_blas()

from .constraint import GrammarError, choice_grammar, json_grammar, regex_grammar  # noqa: E402
from .detokenizer import StreamingDetokenizer  # noqa: E402
from .engine import Engine, EngineConfig  # noqa: E402
from .request import (  # noqa: E402
    SPECULATION_METHODS,
    ContextLengthExceeded,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    RequestTimeout,
    SamplingParams,
    SpecStats,
    SpeculativeParams,
    TokenEvent,
    TokenIdOutOfRange,
    TokenLogprob,
)
from .stats import NullSink, StatsSink  # noqa: E402

__all__ = [
    "BLAS",
    "MLX_ENV",
    "SPECULATION_METHODS",
    "ContextLengthExceeded",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineOverloaded",
    "EngineUnavailable",
    "FinishReason",
    "GenerationRequest",
    "GrammarError",
    "InvalidRequestError",
    "NullSink",
    "RequestTimeout",
    "SamplingParams",
    "SpecStats",
    "SpeculativeParams",
    "StatsSink",
    "StreamingDetokenizer",
    "TokenEvent",
    "TokenIdOutOfRange",
    "TokenLogprob",
    "choice_grammar",
    "json_grammar",
    "regex_grammar",
]
