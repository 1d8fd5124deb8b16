"""Every server option in one typed table.

Each field is a CLI flag (``--max-queue``) and an environment variable (``SPECSERVE_MAX_QUEUE``);
the CLI wins over the environment, which wins over the default. ``python -m server.settings``
prints the Markdown table that docs/configuration.md holds (a test keeps the two in sync).
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from typing import Literal

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "SPECSERVE_"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore")

    # --- network
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, ge=0, le=65535, description="Port to bind (0 picks a free port).")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")

    # --- model
    model: str = Field(
        "default",
        description="`default` (SmolLM2-135M-Instruct Q4_1, fetched on first use), a `.gguf` file, "
        "or an MLX model directory / Hugging Face repo id loadable by mlx-lm.",
    )
    served_model_name: str | None = Field(
        None, description="Model id clients send in `model` (default: derived from the model source)."
    )
    weights: Literal["auto", "quantized", "quantized-bfloat16", "quantized-float16", "float32",
                     "float16", "bfloat16"] = Field(
        "auto",
        description="Weight format: `auto` is float32 on the CPU backend (fast BLAS path) and the "
        "file's quantization on a GPU. `quantized` keeps the file's quantized weights with "
        "float32 activations; `quantized-bfloat16`/`quantized-float16` keep them with "
        "bfloat16/float16 activations (what the GPU kernels run on tensor cores). `float32`, "
        "`float16` and `bfloat16` dequantize every weight to that type (more memory, no quantized "
        "matmul).",
    )
    cache_dir: str | None = Field(
        None, description="Where downloaded models live (default `~/.cache/specserve`)."
    )
    blas: str = Field(
        "auto",
        description="Linux CPU only: `auto` preloads OpenBLAS (system or cmeel-openblas), `off` "
        "keeps MLX's bundled reference BLAS, or a path to a BLAS shared library.",
    )

    kernels: Literal["auto", "off"] = Field(
        "off",
        description="Small-batch quantized matmul kernels (metal_kernels/) for quantized targets on "
        "Metal/CUDA: `auto` patches them in (rows stay bit-identical for 1..16 rows), `off` keeps "
        "MLX's own. Off by default: on the H200 the default model's one-token forward is ~12% slower "
        "with them in float32 (their flat cost needs fp16/bf16 activations; docs/kernels.md).",
    )
    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Compiled target passes: decode and verify run as `mx.compile`d graphs over a "
        "static (preallocated, bucketed) KV cache, one trace per (rows, capacity). `auto` keeps the "
        "eager passes on every backend measured so far: compiled decode of the default model was "
        "0.79x eager on the H200 (device time grew more than graph building shrank) and even on "
        "CPU (docs/benchmarks.md, step profile); `on` forces them. A large model on CUDA with the "
        "small-batch kernels and bf16 activations gains: an 8B-shaped 4-bit stack took 7.0-8.2 ms "
        "per one-token pass compiled against 8.3-9.2 ms eager through MLX's matmul, flat to 16 rows "
        "(docs/benchmarks.md, twentieth session; not yet timed with float32 activations).",
    )

    # --- speculative decoding
    speculation: Literal["off", "prompt_lookup", "dspark", "auto"] = Field(
        "auto",
        description="Server default drafting: `off`, `prompt_lookup`, `dspark`, or `auto` (the "
        "scheduler chooses per request and cycle among the loaded drafters and plain decoding; "
        "requests may override with `speculative.method`).",
    )
    dspark: bool = Field(
        False, description="Load the DSpark drafter (also implied by `speculation=dspark`)."
    )
    dspark_drafter: str | None = Field(
        None,
        description="DSpark drafter directory (DeepSpec layout: config.json + safetensors); default: "
        "the one in models/ shipped for the default model.",
    )
    dspark_draft_vocab: bool = Field(
        True,
        description="Draft from the drafter's draft vocabulary when its checkpoint has one (`d2t`, "
        "EAGLE-3's layout; FR-Spec, arXiv 2502.14856): the LM head and Markov head score only the "
        "target's most frequent tokens (the shipped drafter: 16,384 of 49,152), which cuts the two "
        "vocabulary-wide phases of a draft forward. Drafts only: the target verifies over its whole "
        "vocabulary, so output stays exact. Off: the whole vocabulary.",
    )
    prompt_lookup_min_ngram: int = Field(2, ge=1, le=16, description="Shortest n-gram prompt lookup matches.")
    prompt_lookup_max_ngram: int = Field(5, ge=1, le=32, description="Longest n-gram prompt lookup matches.")
    prompt_lookup_max_draft: int = Field(15, ge=1, le=64, description="Most tokens one prompt-lookup draft may propose.")
    max_verify_rows: int = Field(
        16, ge=1, le=64,
        description="Widest verify pass (anchor + drafts). Start-up calibration lowers it to the "
        "widest pass that is bit-identical to one-token decoding on this machine.",
    )
    exact_verify: Literal["auto", "row", "batched", "kernel"] = Field(
        "auto",
        description="Verify attention: `row` (one attention call per row, the very call a one-token "
        "decode makes: exact at every context length), `batched` (one call for the rows up to the width "
        "calibration finds exact at its probe contexts; faster on some GPUs, but such a width was seen "
        "to break at other context lengths), `kernel` (CUDA: every decode and verify pass attends "
        "through one launch of metal_kernels' row-attention kernel, rows independent by construction; "
        "`row` elsewhere), or `auto` (= `row`).",
    )

    # --- scheduling and limits
    prefill_step: int = Field(
        256, ge=16, le=16384,
        description="Prompt tokens per prefill chunk (other sequences step between chunks). Chunks start "
        "at multiples of it, and the prefix cache stores and reuses whole chunks, so warm and cold "
        "prefills compute the same bits.",
    )
    prefill_slice_ms: float = Field(
        100.0, ge=0, le=60000,
        description="A prompt is prefilled in slices of about this many milliseconds (whole passes of the "
        "fused pass, at the sequence's measured time per row, at least one pass) instead of whole chunks, "
        "so a long prompt holds running streams up, and keeps new requests waiting, by about this much at "
        "a time. Only where a chunk splits without changing a bit of the cache (the CPU fused pass); "
        "0: whole chunks.",
    )
    prefix_cache_bytes: int = Field(
        1 << 30, ge=0,
        description="Byte budget of the prefix cache: prompt KV (and DSpark's tapped hidden states) kept "
        "for reuse by later requests sharing a prefix, least recently stored evicted first (0: off). "
        "Reused tokens are reported as `usage.prompt_tokens_details.cached_tokens`.",
    )
    max_active: int = Field(8, ge=1, le=1024, description="Sequences interleaved by the engine at once.")
    batching: Literal["auto", "off"] = Field(
        "auto",
        description="Continuous batching: decoding sequences share one target pass per cycle, each with "
        "its own drafter and draft length. `auto`: as many rows per pass as start-up calibration finds "
        "bit-identical to each sequence's own pass (none: one sequence per pass); `off`: one sequence "
        "per pass.",
    )
    max_queue: int = Field(
        256, ge=1,
        description="Requests waiting for a free slot (beyond `max_active`) before new ones get HTTP 429 "
        "`rate_limit_error` with `Retry-After`; also the most generations (prompts x `n`) one request may "
        "ask for (HTTP 400 `too_many_generations` above it).",
    )
    max_n: int = Field(16, ge=1, le=128, description="Largest `n` (choices per prompt) accepted.")
    default_max_tokens: int = Field(16, ge=1, description="`max_tokens` for /v1/completions when the request omits it (OpenAI: 16).")
    max_prompt_tokens: int = Field(
        0, ge=0, description="Most tokens one prompt may have; longer ones get 400 `prompt_too_long` (0: the model's context window)."
    )
    max_tokens_limit: int = Field(
        0, ge=0,
        description="Largest `max_tokens` / `max_completion_tokens` a request may ask for: more gets 400 "
        "`max_tokens_too_large` (not clamped); a request that omits it gets at most this (0: no limit "
        "beyond the context window).",
    )
    request_timeout: float = Field(
        600.0, ge=0,
        description="Seconds from arrival (queue wait included) after which a generation is stopped in "
        "the engine: 408 `timeout_error` for non-streaming requests, an error event and `[DONE]` for "
        "streams (0: no limit).",
    )
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024,
        description="Largest request body in bytes: 413 at once when Content-Length says more, and as "
        "soon as a body without one passes the limit while it is read.",
    )

    # --- security and operations
    api_key: SecretStr | None = Field(
        None,
        description="If set, requests need `Authorization: Bearer <key>` (401 `authentication_error` "
        "otherwise) on every path but /health, /ready and (unless `protect_metrics`) /metrics. "
        "Prefer the environment variable: command lines are visible to other local users.",
    )
    protect_metrics: bool = Field(
        False, description="Require the API key on /metrics too (default off: Prometheus scrapes without "
        "credentials, so keep /metrics on a private network)."
    )
    log_requests: bool = Field(
        False,
        description="Log every request's prompt and output text at INFO. Off (default): request log lines "
        "(DEBUG) carry ids, token counts, finish reasons and timings, never text.",
    )
    shutdown_timeout: float = Field(
        20.0, ge=0,
        description="On SIGTERM/SIGINT: new requests get 503 while in-flight ones get this many seconds to "
        "finish; the rest are then ended with a 503 error and the process exits (0 after SIGTERM, 130 after "
        "SIGINT). Keep it below the "
        "orchestrator's kill grace period (Kubernetes: 30 s).",
    )

    @field_validator("draft_kernel_rows", mode="before")
    @classmethod
    def _integer_choice(cls, v):
        # an environment value is a string, which an integer Literal does not coerce
        return int(v) if isinstance(v, str) and v.strip().isdigit() else v

    @field_validator("api_key")
    @classmethod
    def _nonempty_key(cls, v: SecretStr | None):
        # fail closed: an empty key from a missing variable must not silently disable auth
        if v is not None and not v.get_secret_value().strip():
            raise ValueError("api_key is set but empty; unset it to disable authentication")
        return v

    fused: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Fused decode/verify passes: every decode and verify pass (1..16 rows) of a "
        "supported target runs as one call, and its rows stay bit-identical to decode steps for every "
        "width. CUDA: one kernel launch (metal_kernels/fused.py; mlx-lm Llama, quantized weights, "
        "float32 activations, hidden size 256..640, e.g. the default model); H200, default model: "
        "decode 3.07x mlx-lm's modules. CPU: one call into C (metal_kernels/fused_cpu.py, built at "
        "first use with the system C compiler) that streams the file's 4/8-bit weights while prefill "
        "keeps float32 ones; default model on 2 vCPUs: 270 tok/s against 20 (the engine, with "
        "SPECSERVE_CPU_ACTIVATIONS=q16). `auto` and `on` use it "
        "where supported (`on` logs why not elsewhere), `off` keeps mlx-lm's modules. Fused passes "
        "take one sequence each: on CUDA at 16 concurrent streams the aggregate was 0.88x of batched "
        "mlx-lm passes with speculation and 0.70x without (an earlier, slower fused kernel), so set "
        "`off` there for many concurrent streams (docs/benchmarks.md).",
    )
    cpu_activations: Literal["q16", "q8", "float32"] = Field(
        "q16",
        description="How the CPU fused pass multiplies. `q16`: each projection's input rows are "
        "quantized per block of 32 inputs into two 8-bit digits (x ~ d q + d' q', to 1/32000 of the "
        "block's largest input) and multiplied in integers (AVX512-VNNI where the CPU has it, else "
        "AVX2 `vpmaddubsw`); the default model's logits stay within ~1.5e-4 of their scale of "
        "float32's; 2 vCPUs with AVX512-VNNI, default model: 270 tok/s decode (float32: 197), a "
        "16-row verify 27.8 ms (34.8); 2 vCPUs with AVX2 only: ~52-61 tok/s. `q8`: one digit "
        "(llama.cpp's activation scheme for Q4_1/Q8_0 weights): decode about the same, a 16-row "
        "verify 19.1 ms, but logits move by 4-8% of their scale, enough to flip near-tied greedy "
        "choices (the default model then answers 'What is the capital of France?' with "
        "'L'Étoile...'). `float32`: float inputs and FMAs, within ~1e-5 of mlx-lm's modules. "
        "Whichever is chosen, greedy speculative output equals plain decoding. CUDA passes ignore it.",
    )

    draft_kernel_rows: Literal[8, 16] = Field(
        8,
        description="The fused DSpark draft launch's kernel (CUDA, `fused` auto/on). `8`: for blocks of "
        "at most 8 rows (the shipped drafter's 7), 16 warps per block, up to 64 new context rows "
        "projected in the launch in chunks of 8. `16`: built for up to 16 block rows, 8 warps per block, "
        "up to 16 new context rows in the launch (more run as MLX ops first). H100, default model, the "
        "shipped drafter: steady forward 1.14 ms (`8`) against 1.32 ms (`16`), a request's first forward "
        "over a prompt of 17-64 tokens 1.48 against 2.53 ms. Larger blocks always get `16`. Drafts only: "
        "output stays exact either way.",
    )

    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "auto",
        description="MLX-CUDA's CUDA graphs (MLX's `MLX_USE_CUDA_GRAPHS`, read once per process, "
        "before the model loads). Each evaluation's kernels are recorded as a graph, then updated or "
        "instantiated and launched. That pays for passes of many kernels (mlx-lm's modules: an "
        "8B-shaped 4-bit stack verified 8-16 rows in ~18 ms with graphs, ~23 ms without) and costs "
        "0.1-0.25 ms per pass of one kernel (the default model's fused passes on an H200: empty "
        "launch 0.53 -> 0.27 ms, DSpark draft 0.97 -> 0.81 ms, decode +5-8% without graphs). `auto`: "
        "off for the default model with `fused` auto/on, on otherwise; an `MLX_USE_CUDA_GRAPHS` "
        "already in the environment wins over `auto`. Other backends ignore it.",
    )

    def engine_config(self):
        from engine import EngineConfig

        return EngineConfig(
            model=self.model,
            served_model_name=self.served_model_name,
            weights=self.weights,
            speculation=self.speculation,
            kernels=self.kernels,
            compile=self.compile,
            fused=self.fused,
            cpu_activations=self.cpu_activations,
            draft_kernel_rows=self.draft_kernel_rows,
            dspark=self.dspark,
            dspark_drafter=self.dspark_drafter,
            dspark_draft_vocab=self.dspark_draft_vocab,
            prompt_lookup_min_ngram=self.prompt_lookup_min_ngram,
            prompt_lookup_max_ngram=max(self.prompt_lookup_max_ngram, self.prompt_lookup_min_ngram),
            prompt_lookup_max_draft=self.prompt_lookup_max_draft,
            max_verify_rows=self.max_verify_rows,
            exact_verify=self.exact_verify,
            prefill_step=self.prefill_step,
            prefill_slice_ms=self.prefill_slice_ms,
            prefix_cache_bytes=self.prefix_cache_bytes,
            max_active=self.max_active,
            batching=self.batching,
            max_queue=self.max_queue,
            request_timeout=self.request_timeout or None,
        )


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _base_type(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _base_type(args[0])
    return annotation


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve",
        description="OpenAI-compatible MLX server with exact speculative decoding. Every flag has "
        f"an environment twin {ENV_PREFIX}<FLAG> (the flag wins).",
    )
    for name, field in Settings.model_fields.items():
        base = _base_type(field.annotation)
        help_text = f"{field.description} [env {env_name(name)}; default {field.default!r}]"
        kwargs = {"default": None, "help": help_text.replace("%", "%%")}  # (argparse formats help with %)
        if typing.get_origin(base) is Literal:
            kwargs["choices"] = list(typing.get_args(base))
            if all(type(c) is int for c in kwargs["choices"]):
                kwargs["type"] = int  # (argparse compares the string given with the choices)
        elif base is bool:
            kwargs["type"] = _parse_bool
            kwargs["metavar"] = "{true,false}"
        elif base in (int, float):
            kwargs["type"] = base
        parser.add_argument(flag_name(name), dest=name, **kwargs)
    return parser


def load_settings(argv: list[str] | None = None) -> Settings:
    """Settings from CLI flags (``argv``), then ``SPECSERVE_*`` variables, then defaults.

    A value that does not validate exits as a bad flag does (argparse: status 2, usage line),
    naming the flag or the ``SPECSERVE_*`` variable it came from."""
    parser = build_parser()
    args = parser.parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None}
    try:
        return Settings(**given)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else ""
            if name not in Settings.model_fields:
                where = "settings"
            else:
                where = flag_name(name) if name in given else env_name(name)
            problems.append(f"{where}: {err['msg']} (got {err.get('input')!r})")
        parser.error("; ".join(problems))


def markdown_table() -> str:
    lines = [
        "| Environment variable | CLI flag | Default | Description |",
        "|---|---|---|---|",
    ]
    for name, field in Settings.model_fields.items():
        default = "" if field.default is None else f"`{field.default}`"
        lines.append(f"| `{env_name(name)}` | `{flag_name(name)}` | {default} | {field.description} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
