"""The engine: one worker thread owns MLX, the model and every KV cache.

Threads and queues::

    event loop (FastAPI)                         engine worker thread
    --------------------                         --------------------
    submit(req) -> validate -> inbox.put(h) ---> admit: waiting -> active (<= max_active)
    async for event in stream:                   loop: a prefill step per prefilling sequence,
        <- asyncio.Queue <- call_soon_threadsafe    then one speculative cycle per decoding one
                                                    (batched: one target pass for up to
                                                    batch_rows rows of several sequences)
    cancel(id) -> cancelled set ---------------> checked before every step
    (deadline, abort_all) ---------------------> checked before every step

Exceptions in a step become an error event for that request only; the worker keeps serving.
Every request ends with exactly one final event (finish_reason set): finished, cancelled (client
gone: cancel(); server shutting down: abort_all() with an error), timed out (the configured
``request_timeout``, counted from submit), or failed. A cancel or deadline takes effect before
the request's next step, so at most the step already running completes after it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import statistics
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from drafters import PromptLookupDrafter

from .constraint import (
    GrammarConstraint,
    GrammarError,
    compile_grammar,
    ll_tokenizer,
)
from .generation import Sequence, prefill_step, speculative_batch_step, speculative_step
from .loader import LoadedModel, load_target
from .prefix_cache import PrefixCache, copy_prefix
from .request import (
    SPECULATION_METHODS,
    ContextLengthExceeded,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    RequestTimeout,
    SpecStats,
    SpeculativeParams,
    TokenEvent,
    TokenIdOutOfRange,
)
from .runner import Calibration, TargetRunner, cost_model
from .scheduler import AcceptanceModel, CostModel, DsparkStats, RequestAcceptance
from .stats import NullSink, StatsSink
from .tool_grammar import tool_call_grammar

log = logging.getLogger("specserve.engine")

# The fused DSpark draft's start-up probe: the largest logit difference from the MLX ops, relative
# to their scale, that keeps the launch. A broken launch is off by ~1 (or drafts other tokens:
# 1.0). The MLX ops' float32 GEMMs run in TF32 on MLX-CUDA unless MLX_ENABLE_TF32=0
# (ml-explore/mlx#3860): a 7-layer drafter's reference was 1.5e-3 off on an H100.
DRAFT_PROBE_TOLERANCE = 1e-2


@dataclass
class EngineConfig:
    """Engine options (the server fills these from its settings table)."""

    model: str = "default"
    served_model_name: str | None = None
    weights: str = "auto"
    speculation: str = "auto"  # off | prompt_lookup | dspark | auto
    kernels: str = "off"  # metal_kernels small-batch quantized matmuls: auto | off
    compile: str = "auto"  # compiled decode/verify over a static KV cache: auto (= off, measured) | on | off
    fused: str = "auto"  # one-call decode/verify passes (metal_kernels.fused / fused_cpu): auto | on | off
    cpu_activations: str = "q16"  # the CPU fused pass's projection inputs: q16 | q8 (integer dot products) | float32
    draft_kernel_rows: int = 8  # the fused DSpark launch's kernel: 8 rows (16 warps, chunked updates) | 16 (8 warps)
    dspark: bool = False  # load the DSpark drafter
    dspark_drafter: str | None = None  # its directory (default: the one shipped for the default model)
    dspark_draft_vocab: bool = True  # draft from the checkpoint's draft vocabulary (d2t) when it has one
    prompt_lookup_min_ngram: int = 2
    prompt_lookup_max_ngram: int = 5
    prompt_lookup_max_draft: int = 15
    max_verify_rows: int = 16
    exact_verify: str = "auto"  # auto (= row) | row | batched | kernel (see TargetRunner.calibrate)
    calibration_contexts: tuple[int, ...] = (48, 1100)
    prefill_step: int = 256  # prompt tokens per chunk; also the prefix cache's block
    prefill_slice_ms: float = 100.0  # prefill slices of about this long, where chunks split exactly; 0: whole chunks
    prefix_cache_bytes: int = 1 << 30  # prefix cache budget (KV + DSpark taps); 0: off
    batching: str = "auto"  # continuous batching of decoding sequences: auto (calibrated exact size) | off
    max_active: int = 8
    max_queue: int = 256
    request_timeout: float | None = None  # seconds from submit to the last event; None: no limit
    warmup: bool = True


class _StoppedWhileLoading(Exception):
    """stop() was called while the worker was still starting up (Engine._stop_point)."""


@dataclass
class _Handle:
    request: GenerationRequest
    emit: Callable[[TokenEvent], None]
    done: bool = False
    deadline: float | None = None  # time.monotonic() past which the request times out
    shared: dict = field(default_factory=dict)  # owner request id -> whole prompt chunks in common
    # whether its sequence starts with DSpark (Engine._handle_dspark: decided once, when first
    # considered for admission; a request deferred meanwhile may start with it after DSpark
    # stopped being able to win, and then drops it on its first cycle)
    dspark: bool | None = None
    submitted_at: float = field(default_factory=time.perf_counter)  # (enqueued: timings count the wait)


class Engine:
    """Serve generation requests from one MLX worker thread.

    Args:
        config: engine options.
        loaded: an already loaded model (tests); otherwise ``config.model`` is loaded by the
            worker thread on :meth:`start`.
        sink: statistics sink (the server's Prometheus exporter).
    """

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 sink: StatsSink | None = None):
        self.config = config or EngineConfig()
        if self.config.speculation not in SPECULATION_METHODS:
            raise ValueError(f"speculation must be one of {SPECULATION_METHODS}, got {self.config.speculation!r}")
        self.loaded = loaded
        self.sink: StatsSink = sink or NullSink()
        self.runner: TargetRunner | None = None
        self.calibration: Calibration | None = None
        self.cost: CostModel | None = None
        self.acceptance = AcceptanceModel()
        self._prefill_row_seconds: float | None = None  # the last prefill step's seconds per row, any sequence
        self.dspark_stats = DsparkStats()
        self.dspark = None  # the shared DSpark network, when loaded
        self.draft_vocab = None  # its draft vocabulary (drafters.dspark.DraftVocab), when used
        self.prefix_cache: PrefixCache | None = None
        self.batch_rows = 0  # rows of a batched pass (0: sequences step one by one)
        self._batch_start = 0  # round-robin start when more sequences decode than fit a batch
        self.target_taps = None
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: deque[_Handle] = deque()
        self._active: list[tuple[_Handle, Sequence]] = []
        self._cancelled: set[str] = set()
        self._abort_errors: dict[str, EngineError] = {}  # cancelled with an error (shutdown)
        self._live: set[str] = set()
        self._closed = False
        self._lock = threading.Lock()
        self._grammar_lock = threading.Lock()  # structured output: the llguidance tokenizer
        self._ll_tokenizer = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopping = False
        self._state = "created"
        self._error: str | None = None
        self._queued = 0
        # prompts scored this step (max_tokens 0, prompt logprobs: finished at their prefill), as
        # (request, final event), for identical scoring requests waiting on them (_answer_scored)
        self._scored: list[tuple[GenerationRequest, TokenEvent]] = []
        # sequences that finished this step while a request waits to copy their prompt's KV (the
        # other choices of an n > 1 request with max_tokens 1: the first ends at its prefill);
        # they keep their caches for the next admission round only (_keeps_kv_for_twins)
        self._donors: list[Sequence] = []

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self, wait: bool = False, timeout: float | None = None) -> Engine:
        """Start the worker thread (it loads, calibrates and warms the model, then serves)."""
        if self._thread is None:
            self._state = "loading"
            self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
            self._thread.start()
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self._ready.wait(timeout):
            raise TimeoutError("engine not ready")
        if self._error:
            raise RuntimeError(self._error)

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop accepting, cancel what is running, and join the worker (up to ``timeout``
        seconds). A worker still loading stops at the next phase boundary of its start-up (load,
        calibration, batch calibration, drafter, warm-up); one phase can take tens of seconds
        and cannot be interrupted. Returns whether the worker has ended."""
        self._stopping = True
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        return not self._worker_alive()

    def close(self) -> None:
        """Refuse new requests from now on (EngineUnavailable, HTTP 503); admitted ones go on."""
        self._closed = True

    def idle(self) -> bool:
        """True when no request is queued or running (every submitted one has had its last event)."""
        with self._lock:
            return not self._live

    def abort_all(self, error: EngineError) -> int:
        """End every queued and running request before its next step with ``error`` as its last
        event (finish_reason ``cancelled``). Returns how many requests were aborted."""
        with self._lock:
            ids = list(self._live)
            for rid in ids:
                self._cancelled.add(rid)
                self._abort_errors.setdefault(rid, error)
        if ids:
            self._inbox.put(())  # wake the worker if it is idle
        return len(ids)

    def drain(self, timeout: float, poll: float = 0.05, cut: threading.Event | None = None) -> bool:
        """Graceful shutdown: refuse new requests, let queued and running ones finish for up to
        ``timeout`` seconds (or until ``cut`` is set: a second signal), then abort the rest
        (EngineUnavailable, HTTP 503, code ``shutting_down``) and wait for their last events.
        Returns True when every request finished on its own. Call from any thread but the
        worker; :meth:`stop` afterwards."""
        self.close()
        deadline = time.monotonic() + max(0.0, timeout)
        while not self.idle() and time.monotonic() < deadline and self._worker_alive() \
                and not (cut is not None and cut.is_set()):
            time.sleep(poll)
        if self.idle():
            return True
        n = self.abort_all(EngineUnavailable("the server shut down before this request finished", "shutting_down"))
        log.warning("%s: aborting %d request(s)", "drain cut short" if cut is not None and cut.is_set()
                    else f"shutdown deadline ({timeout:.1f} s) passed", n)
        end = time.monotonic() + 10.0  # one step of each active sequence
        while not self.idle() and time.monotonic() < end and self._worker_alive():
            time.sleep(poll)
        return False

    def _worker_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._error is None

    def health(self) -> dict:
        """Liveness and readiness: ``state`` is loading | ready | error | stopped."""
        alive = self._thread is not None and self._thread.is_alive()
        state = self._state if (alive or self._state in ("created", "error")) else "stopped"
        info = {"state": state, "alive": alive, "ready": self.ready}
        if self._error:
            info["error"] = self._error
        return info

    def queue_depth(self) -> int:
        with self._lock:
            return self._queued

    def running(self) -> int:
        return len(self._active)

    def info(self) -> dict:
        """Model and calibration facts for /v1/models and logs."""
        out = {}
        if self.loaded is not None:
            out.update(model=self.loaded.name, context_length=self.loaded.context_length,
                       weights=self.loaded.weights, source=self.loaded.source)
        if self.runner is not None:
            out["compiled_passes"] = self.runner.compiled
        if self.calibration is not None:
            out.update(self.calibration.summary())
        return out

    # ---- submitting ----------------------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        """Raise :class:`InvalidRequestError` for a request the engine cannot serve."""
        if self._closed:
            raise EngineUnavailable("the server is shutting down", "shutting_down")
        if not self.ready:
            raise EngineUnavailable("the model is still loading" if not self._error else self._error)
        loaded = self.loaded
        if not request.prompt_tokens:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = loaded.config.get("vocab_size") or len(loaded.tokenizer._tokenizer)
        bad = next((i for i, t in enumerate(request.prompt_tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise TokenIdOutOfRange(request.prompt_tokens[bad], bad, vocab)
        if request.max_tokens < 1 and not (request.max_tokens == 0 and request.prompt_logprobs):
            raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
        if len(request.prompt_tokens) + request.max_tokens > loaded.context_length:
            raise ContextLengthExceeded(len(request.prompt_tokens), request.max_tokens, loaded.context_length)
        method = request.speculative.method
        if method is not None and method not in SPECULATION_METHODS:
            raise InvalidRequestError(f"speculative.method must be one of {SPECULATION_METHODS}",
                                      param="speculative.method")
        if method == "dspark" and self.dspark is None:
            raise InvalidRequestError("the DSpark drafter is not loaded on this server (start it with "
                                      "SPECSERVE_DSPARK=1)", param="speculative.method",
                                      code="drafter_unavailable")
        for token, _ in request.sampling.logit_bias:
            if not 0 <= token < vocab:
                raise InvalidRequestError(f"logit_bias token {token} is out of range [0, {vocab})",
                                          param=f"logit_bias.{token}")
        bad = next((i for i, t in enumerate(request.stop_token_ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"stop token id {request.stop_token_ids[bad]} is out of range [0, {vocab})",
                                      param=f"stop_token_ids.{bad}")
        if request.grammar is not None and request.grammar_matcher is None:  # (last: the costly check)
            request.grammar_matcher = self.prepare_grammar(request.grammar)

    def tool_call_grammar(self, style: str, start: str, end: str, functions: list[dict], parallel: bool = True) -> str:
        """A grammar forcing a reply of tool calls in the model's call syntax
        (engine.tool_grammar.tool_call_grammar: ``style``, the markers, ``functions`` as
        ``[{"name", "parameters"}]``).

        Raises:
            GrammarError: a function the syntax cannot carry, or the model's tokenizer cannot be
                used for grammars.
        """
        return tool_call_grammar(self.loaded.tokenizer, self._grammar_tokenizer(), style, start, end, functions,
                                 parallel)

    def _grammar_tokenizer(self):
        """llguidance's tokenizer for structured output, built at first use (~0.3 s).

        Raises:
            GrammarError: llguidance cannot use this model's tokenizer.
        """
        with self._grammar_lock:
            if self._ll_tokenizer is None:
                loaded = self.loaded
                vocab = loaded.config.get("vocab_size") or len(loaded.tokenizer._tokenizer)
                self._ll_tokenizer = ll_tokenizer(loaded.tokenizer, vocab, loaded.eos_token_ids)
            return self._ll_tokenizer

    def prepare_grammar(self, grammar: str):
        """A freshly compiled llguidance matcher for ``grammar`` (milliseconds; seconds for a
        huge schema). One per request: copies of one matcher share a lexer cache that grows
        with every copy's output until llguidance's limits fail all of them.

        Raises:
            GrammarError (an InvalidRequestError, HTTP 400): the grammar does not compile or
                cannot be enforced, or the model's tokenizer cannot be used for grammars.
        """
        try:
            return compile_grammar(grammar, self._grammar_tokenizer())
        except GrammarError as exc:
            raise GrammarError(f"the output format cannot be used: {exc}") from None

    def _enqueue(self, request: GenerationRequest, emit: Callable[[TokenEvent], None]) -> _Handle:
        try:
            self.validate(request)
        except EngineError as exc:
            self.sink.request_rejected(type(exc).__name__)
            raise
        with self._lock:
            if self._queued >= self.config.max_queue:
                self.sink.request_rejected("EngineOverloaded")
                raise EngineOverloaded(f"the request queue is full ({self.config.max_queue})")
            if request.request_id in self._live:
                raise InvalidRequestError(f"duplicate request id {request.request_id}")
            self._queued += 1
            self._live.add(request.request_id)
        timeout = self.config.request_timeout
        handle = _Handle(request, emit, deadline=time.monotonic() + timeout if timeout else None)
        self._inbox.put(handle)
        return handle

    def submit(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Queue a request; returns an async iterator of its events (call from an event loop).

        Raises (synchronously): InvalidRequestError, ContextLengthExceeded, EngineOverloaded,
        EngineUnavailable. Closing the iterator early cancels the request.
        """
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event: TokenEvent) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is gone; the request is cancelled below
                self.cancel(request.request_id)

        handle = self._enqueue(request, emit)

        async def stream() -> AsyncIterator[TokenEvent]:
            try:
                while True:
                    event = await events.get()
                    yield event
                    if event.finish_reason is not None or event.error is not None:
                        handle.done = True
                        return
            finally:
                if not handle.done:
                    self.cancel(request.request_id)

        return stream()

    def generate(self, request: GenerationRequest, timeout: float | None = None) -> Iterator[TokenEvent]:
        """Blocking twin of :meth:`submit` for scripts, benchmarks and tests."""
        events: queue.Queue = queue.Queue()
        handle = self._enqueue(request, events.put)
        try:
            while True:
                event = events.get(timeout=timeout)
                yield event
                if event.finish_reason is not None or event.error is not None:
                    handle.done = True
                    return
        finally:
            if not handle.done:
                self.cancel(request.request_id)

    def cancel(self, request_id: str) -> None:
        """Stop a request at its next step; its KV cache is freed then. Unknown ids are ignored."""
        with self._lock:
            if request_id not in self._live:
                return
            self._cancelled.add(request_id)
        self._inbox.put(())  # wake the worker if it is idle

    # ---- worker --------------------------------------------------------------------------------

    def _stop_point(self) -> None:
        """A phase boundary of start-up: raise _StoppedWhileLoading once stop() was called."""
        if self._stopping:
            raise _StoppedWhileLoading

    def _load(self) -> None:
        cfg = self.config
        if cfg.batching not in ("auto", "off"):
            raise ValueError(f"batching must be auto or off, got {cfg.batching!r}")
        if self.loaded is None:
            self.loaded = load_target(cfg.model, cfg.weights, cfg.served_model_name)
        self._stop_point()
        from metal_kernels import patch_model

        self.kernels = patch_model(self.loaded.model, mode=cfg.kernels)
        log.info("%s", self.kernels.summary())
        if self.loaded.weights.endswith("float16") and cfg.speculation != "off" and self.kernels.backend != "cpu":
            log.warning("weights=%s with speculation: half-precision activations (with the kernels on) "
                        "once broke greedy identity on an H200 although start-up calibration passed "
                        "(docs/benchmarks.md, 'Engine calibration per activation dtype'); use "
                        "weights=quantized or auto for exact speculative output", self.loaded.weights)
        self._calibrate(resolve_compile(cfg.compile))
        self.cost = cost_model(self.calibration)
        log.info("calibration: %s", self.calibration.summary())
        self._stop_point()
        if cfg.batching == "auto" and cfg.max_active > 1:
            vocab = self.loaded.config.get("vocab_size") or len(self.loaded.tokenizer._tokenizer)
            size = max(self.calibration.max_rows, min(cfg.max_active, 16))
            self.batch_rows = self.runner.calibrate_batch(vocab, size, self.calibration.max_rows)
            self._stop_point()
        if cfg.dspark or cfg.speculation == "dspark":
            self._load_dspark()
            self._stop_point()
        if cfg.warmup:
            warm = GenerationRequest(prompt_tokens=self.loaded.tokenizer.encode("Hello, world"),
                                     max_tokens=4)
            warm.sampling = type(warm.sampling)(temperature=0.0)
            if self.dspark is not None and self.cost.max_rows > 1:
                # DSpark forwards now: the first one compiles the drafter's kernels (~17 s on the
                # H200), which would otherwise count as its draft cost and keep it off; the graphs
                # of every greedy draft length are compiled too (later forwards that compile a new
                # graph, e.g. after the draft cache doubles, are left out of the draft cost)
                self._dspark_step.warm()
                warm.speculative = SpeculativeParams(method="dspark", min_draft_tokens=1)
            seq = self._make_sequence(warm)
            while not seq.finished:
                (prefill_step(seq) if not seq.prefilled else speculative_step(seq, self.cost))
            # (A forced DSpark warm-up's forwards are no evidence: the first ran the drafter's
            # kernels for the first time (no draft cost), and a forced draft on a 4-token raw
            # completion of "Hello, world" says nothing about real requests' acceptance. It used
            # to be kept, and its first observation replaced the priors: a drafter that missed
            # there was gated off before the first request, and budget-limited probes moved the
            # estimate back by 5% each. The stats start afresh below.)
        if self.dspark is not None and self.cost.max_rows > 1:
            try:
                steady = self._time_dspark_forward()
                log.info("DSpark steady forward: %.3f ms (T(1) %.3f ms)", steady * 1e3, self.cost.T(1) * 1e3)
            except Exception:  # (only a first estimate: requests time their own forwards)
                log.warning("DSpark forward not timed at start-up", exc_info=True)
                steady = 0.0
            # (steady: what one DSpark cycle commits, within what the drafter projects steadily)
            rows = min(self.dspark.config.block_size + 1, self._dspark_step.steady_rows)
            self.dspark_stats = DsparkStats(steady_cost=steady, steady_rows=rows)
            self._stop_point()
        if cfg.prefix_cache_bytes > 0:  # after the warm-up, which must not count in its metrics
            if PrefixCache.supports(self.runner.make_cache()):
                self.prefix_cache = PrefixCache(cfg.prefill_step, cfg.prefix_cache_bytes)
                log.info("prefix cache: %d MiB, blocks of %d tokens", cfg.prefix_cache_bytes >> 20, cfg.prefill_step)
            else:
                log.warning("prefix cache off: %s caches are not plain per-layer KV caches",
                            "compiled (static)" if self.runner.compiled else "this model's")

    def _calibrate(self, compiled: bool) -> None:
        """Make the target runner (eager or compiled passes) and run the start-up calibration."""
        cfg = self.config
        self.runner = TargetRunner(self.loaded.model, prefill_step=cfg.prefill_step, compile=compiled,
                                   max_context=self.loaded.context_length, fused=self._make_fused_pass(compiled))
        fused = self.runner.fused
        activations = getattr(fused, "activations", None)
        log.info("target passes: %s", "compiled (static KV cache)" if compiled
                 else "eager" if fused is None
                 else f"fused (one call per pass: {type(fused).__name__}"
                      f"{f', {activations} activations' if activations else ''})")
        self._stop_point()  # (building the fused pass may have compiled it for a minute)
        rows = cfg.max_verify_rows if cfg.speculation != "off" else 1
        vocab = self.loaded.config.get("vocab_size") or len(self.loaded.tokenizer._tokenizer)
        self.calibration = self.runner.calibrate(
            vocab, max_rows=max(1, rows), mode=cfg.exact_verify,
            contexts=cfg.calibration_contexts, max_context=self.loaded.context_length,
        )

    def _make_fused_pass(self, compiled: bool):
        """The fused decode/verify pass for the target, or None (``fused`` off, unsupported, or
        compiled passes asked for)."""
        mode = self.config.fused
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"fused must be auto, on or off, got {mode!r}")
        if mode == "off":
            return None
        from metal_kernels import fused_unsupported_reason, make_fused_pass
        from metal_kernels.fused_cpu import ACTIVATIONS

        if self.config.cpu_activations not in ACTIVATIONS:  # (checked here: `auto` would swallow it below)
            raise ValueError(f"cpu_activations must be one of {sorted(ACTIVATIONS)}, "
                             f"got {self.config.cpu_activations!r}")
        if self.config.draft_kernel_rows not in (8, 16):  # (the same, before any drafter is loaded)
            raise ValueError(f"draft_kernel_rows must be 8 or 16, got {self.config.draft_kernel_rows!r}")

        model, quantized = self.loaded.model, self.loaded.quantized
        reason = ("compiled passes asked for (compile=on)" if compiled
                  else fused_unsupported_reason(model, quantized))
        if reason:
            (log.warning if mode == "on" else log.info)("fused passes off: %s", reason)
            return None
        try:  # build (compile) and run it once, against mlx-lm's modules, before calibrating on it
            fp = make_fused_pass(model, quantized, cpu_activations=self.config.cpu_activations)
            self._probe_fused(fp)
        except Exception:
            if mode == "on":
                raise
            log.warning("fused passes off: the probe pass failed", exc_info=True)
            return None
        return fp

    def _probe_fused(self, fp) -> None:
        """Two fused rows after a prefill of ``2 * fp.segment - 1`` tokens (so their attention
        spans 2 and 3 key segments and goes through the kernel's cross-segment combine), checked
        against mlx-lm's modules: raises unless the logits agree to the pass's ``probe_tolerance``
        of their scale (1e-3 unless it says otherwise; a broken pass is off by ~100%)."""
        from metal_kernels import fused

        model = self.loaded.model
        vocab = model.args.vocab_size
        length = max(3, min(2 * fp.segment - 1, self.loaded.context_length - 2))
        prompt = [3 + (7 * i) % (vocab - 3) for i in range(length)]
        probe = TargetRunner(model)
        cache, reference = probe.make_cache(), probe.make_cache()
        mx.eval(probe.prefill(prompt, cache)[0], probe.prefill(prompt, reference)[0])
        out = fp([4, 5], cache)
        fp.check(out)
        want = probe.verify([4, 5], reference)[0]
        scale = mx.abs(want).max().item()
        err = mx.abs(out.logits - want).max().item()
        if not err <= getattr(fp, "probe_tolerance", 1e-3) * scale:
            raise fused.FusedPassError(f"probe logits differ from mlx-lm's by {err:.3g} (scale {scale:.3g})")

    def _load_dspark(self) -> None:
        from drafters.dspark import DraftStep, DraftVocab, DSparkDrafter, TargetTaps, load_dspark

        from .loader import default_dspark_path

        path = self.config.dspark_drafter or default_dspark_path(self.loaded)
        if path is None:
            raise ValueError("SPECSERVE_DSPARK is on but no drafter was given (SPECSERVE_DSPARK_DRAFTER) "
                             "and none ships for this model")
        from metal_kernels import fused

        # 4-bit matmuls are slow on the CPU backend; on a GPU the layers stay quantized (the
        # one-launch block forward reads them packed)
        self.dspark = load_dspark(path, dtype="float32", dequantize=fused.backend() == "cpu")
        cfg = self.dspark.config
        args = self.loaded.model.args
        why = cfg.target_mismatch(args.vocab_size, args.hidden_size, len(self.loaded.model.layers))
        if why:
            raise ValueError(f"DSpark drafter {path} does not fit the target: {why}")
        self.target_taps = TargetTaps(self.loaded.model, cfg.target_layer_ids)
        self._dspark_drafter = DSparkDrafter
        if self.dspark.draft_vocab is not None and self.config.dspark_draft_vocab:
            self.draft_vocab = DraftVocab.build(self.dspark.draft_vocab, self.target_taps.head_module,
                                                self.target_taps.tied, self.dspark)
        self._dspark_step = DraftStep(self.dspark, self.target_taps.embed, self.target_taps.lm_head,
                                      fused=self._make_draft_fused(), vocab=self.draft_vocab)
        log.info("DSpark drafter loaded from %s: %d layers, block %d, taps %s, draft vocabulary %s", path,
                 cfg.num_hidden_layers, cfg.block_size, cfg.target_layer_ids,
                 self.draft_vocab.size if self.draft_vocab is not None else f"{cfg.vocab_size} (whole)")

    def _time_dspark_forward(self, reps: int = 7) -> float:
        """Seconds of a steady DSpark forward on this machine: the median over ``reps`` timed
        ``propose`` calls of a fresh drafter, each after 3 new context rows (a cycle that
        accepted 2 drafts), greedy, a full block, on random rows after a 96-token context (the
        cost does not depend on the values). Requests rarely time one before DSpark is chosen:
        their first forward projects the prompt, and probes come after 32+ cycles of other
        drafters, often more rows than :attr:`DsparkStats.steady_rows`. Forwards that compiled a
        graph are left out; the first one is a warm-up."""
        from drafters.base import DraftContext

        cfg = self.dspark.config
        drafter = self._dspark_drafter(self.dspark, self.target_taps.embed, self.target_taps.lm_head,
                                       self._dspark_step)
        width = cfg.num_taps * cfg.hidden_size
        key = mx.random.key(0)  # (its own key: the global RNG is left alone)
        # float32, as requests pass them (engine.runner.join_rows)
        rows = mx.random.normal((96 + 3 * (reps + 1), width), dtype=mx.float32, key=key)
        tokens = [int(t) % cfg.vocab_size for t in range(7, 7 + 97)]
        mx.eval(rows)
        drafter.propose(DraftContext(tokens, rows[:96]), cfg.block_size)
        times, start = [], 96
        for i in range(reps + 1):
            tokens += [(11 * i + j) % cfg.vocab_size for j in (3, 5, 8)]
            ctx = DraftContext(tokens, rows[start: start + 3])
            start += 3
            began = time.perf_counter()
            drafter.propose(ctx, cfg.block_size)
            elapsed = time.perf_counter() - began
            if i and not drafter.traced:
                times.append(elapsed)
        return statistics.median(times) if times else 0.0

    def _make_draft_fused(self):
        """The DSpark block forward in one kernel launch (``metal_kernels.fused.DraftFusedPass``,
        CUDA), checked against the MLX ops on random context first; None when ``fused`` is off,
        unsupported here, or the probe fails (``fused=on`` raises then)."""
        mode = self.config.fused
        if mode == "off":
            return None
        from drafters.dspark import DraftStep
        from metal_kernels import fused

        reason = fused.draft_unsupported_reason(self.dspark, self.loaded.model)
        if reason:
            log.info("fused DSpark drafts off: %s", reason)
            return None
        try:
            fp = fused.DraftFusedPass(self.dspark, self.loaded.model, rows=self.config.draft_kernel_rows,
                                      vocab=self.draft_vocab)
            probe = DraftStep(self.dspark, self.target_taps.embed, self.target_taps.lm_head, compiled=False, fused=fp,
                              vocab=self.draft_vocab)
            err = probe.fused_error(fp.segment + 37)  # two key segments: the cross-segment combine runs
            if not err <= DRAFT_PROBE_TOLERANCE:
                raise fused.FusedPassError(f"the fused draft differs from the MLX ops' by {err:.3g} (logits: of "
                                           f"their scale; greedy drafts: a token's gap below their best, of that scale, or in confidence)")
        except Exception:
            if mode == "on":
                raise
            log.warning("fused DSpark drafts off: the probe failed", exc_info=True)
            return None
        log.info("fused DSpark drafts on (one launch per block forward; probe error %.2g)", err)
        return fp

    def _make_sequence(self, request: GenerationRequest, dspark: bool | None = None,
                       submitted_at: float | None = None) -> Sequence:
        """A new sequence for ``request``; ``dspark``: whether it runs DSpark (None: decide now);
        ``submitted_at``: when it was queued (``time.perf_counter()``; None: now)."""
        cfg = self.config
        if dspark is None:
            dspark = self._runs_dspark(request)
        method = request.speculative.method or cfg.speculation
        drafters = {}
        if self.cost.max_rows > 1:
            if method in ("prompt_lookup", "auto"):
                drafters["prompt_lookup"] = PromptLookupDrafter(cfg.prompt_lookup_min_ngram,
                                                                cfg.prompt_lookup_max_ngram)
            if dspark:
                drafters["dspark"] = self._dspark_drafter(self.dspark, self.target_taps.embed,
                                                          self.target_taps.lm_head, self._dspark_step)
        seed = request.sampling.seed
        if seed is None:
            seed = random.SystemRandom().getrandbits(63)
        constraint = None
        if request.grammar is not None:
            matcher = request.grammar_matcher or self.prepare_grammar(request.grammar)
            request.grammar_matcher = None  # (used once; the request may be resubmitted)
            constraint = GrammarConstraint(matcher, self._grammar_tokenizer().vocab_size,
                                           self.loaded.eos_token_ids, ignore_eos=request.ignore_eos)
        seq = Sequence(
            request, self.runner, self.loaded.token_table, self.loaded.eos_token_ids,
            self.loaded.context_length, seed, drafters=drafters, constraint=constraint,
            acceptance=RequestAcceptance(self.acceptance),
            # a request that may run DSpark earns its probe budget, carrying it or not (one that
            # starts with it may run it: _runs_dspark implies _may_run_dspark)
            dspark_stats=self.dspark_stats if self._may_run_dspark(request) else None,
            taps=self.target_taps, max_draft=cfg.prompt_lookup_max_draft,
            speculative=self.cost.max_rows > 1 and method != "off", submitted_at=submitted_at,
        )
        twin = self._prompt_twin(request, dspark)
        if twin is not None and twin.prefilled:  # the same prompt, prefilled: copy it (n > 1 choices)
            seq.reuse_prefix(copy_prefix(twin.cache, seq.prompt_len - 1), None, seq.prompt_len - 1)
            if seq.prompt_logprobs is not None:  # (the same rows' logits: _prompt_twin)
                seq.prompt_logprobs = list(twin.prompt_logprobs)
            return seq
        # Prompt logprobs need every prompt row's logits: such requests prefill from scratch.
        if self.prefix_cache is not None and not request.prompt_logprobs:
            hit = self.prefix_cache.fetch(request.prompt_tokens, seq.taps is not None, request.cache_salt)
            if hit is not None:
                seq.reuse_prefix(hit.cache, hit.hidden, hit.num_tokens)
        return seq

    def _store_prefix(self, seq: Sequence, cache: list | None) -> None:
        """Offer a freshly prefilled prompt's whole chunks (``cache``: ``seq``'s KV cache) to the
        prefix cache, or those prefilled so far of a prompt whose request ended mid-prefill
        (cancelled, timed out): a request waiting for that prefill (:meth:`_awaits_prefill`, a
        prompt twin) then starts from them instead of from nothing. A failure here (say, memory
        for the copy) is logged and costs only the reuse, never the request."""
        if self.prefix_cache is None or cache is None:
            return
        req = seq.request
        try:
            self.prefix_cache.insert(req.prompt_tokens, cache, seq.prompt_hidden(), seq.taps is not None,
                                     req.cache_salt, already=seq.cached_tokens,
                                     prefilled=None if seq.prefilled else seq.num_prefilled)
        except Exception:
            log.exception("prefix cache: could not store the prompt of %s", req.request_id)

    def prefix_cache_info(self) -> dict | None:
        """The prefix cache's size and token counters (:meth:`PrefixCache.info`), None when off."""
        return self.prefix_cache.info() if self.prefix_cache is not None else None

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            # Release this thread's MLX streams; otherwise their worker threads can still be
            # joinable when the interpreter exits, and the C++ runtime aborts the process.
            mx.synchronize()
            mx.clear_streams()

    def _serve(self) -> None:
        try:
            self._load()
            self._state = "ready"
        except _StoppedWhileLoading:
            log.info("engine stopped while loading")
            self._error = "stopped while loading"
            self._state = "stopped"
        except Exception as exc:  # reported through health(); the server stays up, not ready
            log.exception("engine failed to start")
            self._error = f"{type(exc).__name__}: {exc}"
            self._state = "error"
        finally:
            self._ready.set()
        if self._error:
            return
        while True:
            self._admit(block=not self._active and not self._waiting)
            if self._stopping:
                break
            try:
                self._step_all()
            except Exception:  # a bug outside any one request: log it and keep serving
                log.exception("engine step failed")
        for handle, seq in self._active:
            self._finish(handle, seq, FinishReason.CANCELLED, EngineUnavailable("server shutting down", "shutting_down"))
        for handle in self._waiting:
            handle.emit(TokenEvent(handle.request.request_id, [], "",
                                   error=EngineUnavailable("server shutting down", "shutting_down")))

    def _admit(self, block: bool) -> None:
        if block:  # (nothing waits: no copy to keep a finished sequence's KV for)
            self._release_donors()
        try:
            item = self._inbox.get(timeout=None if block else 0)
            while True:
                if item is None:
                    self._stopping = True
                elif isinstance(item, _Handle):
                    self._waiting.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
        deferred = []  # they keep their slots: later requests do not overtake them
        while self._waiting and len(self._active) + len(deferred) < self.config.max_active:
            handle = self._waiting.popleft()
            if self._awaits_prefill(handle):
                deferred.append(handle)
                continue
            with self._lock:
                self._queued -= 1
            try:
                seq = self._make_sequence(handle.request, self._handle_dspark(handle), handle.submitted_at)
                self._active.append((handle, seq))
            except Exception as exc:
                log.exception("could not start request %s", handle.request.request_id)
                self._end(handle, TokenEvent(handle.request.request_id, [], "", finish_reason=FinishReason.ERROR,
                                             error=_as_engine_error(exc),
                                             elapsed=time.perf_counter() - handle.submitted_at))
        self._waiting.extendleft(reversed(deferred))
        self._release_donors()  # (copied by now, or by no one)

    def _release_donors(self) -> None:
        for seq in self._donors:
            seq.cache = None
        self._donors = []

    def _answer_scored(self) -> None:
        """End the waiting prompt-scoring requests (``max_tokens`` 0 with prompt logprobs) whose
        prompt a request scored in the last step, with its answer: the same prompt tokens,
        ``cache_salt`` and ``logprobs`` count, so the same rows of the same prefill chunks, hence
        the same bits (the other ``n - 1`` choices of an echo + logprobs request; they waited for
        the first one's prefill as its prompt twins, :meth:`_prompt_twin`, but a scoring
        request's sequence ends at its prefill and leaves no KV to copy). Runs at the end of the
        step that scored them, so later requests prefill their own; a request cancelled or past
        its deadline meanwhile is left to :meth:`_end_waiting`. Like a twin's copy, the prompt
        counts as cached, and only with the prefix cache on."""
        scored, self._scored = self._scored, []
        with self._lock:
            cancelled = set(self._cancelled)
        now = time.monotonic()
        keep = deque()
        for handle in self._waiting:
            req = handle.request
            source = next((event for other, event in scored if req.max_tokens == 0 and self._serves(req, other)),
                          None)
            if source is None or self._end_reason(handle, cancelled, now) is not None:  # (those: _end_waiting)
                keep.append(handle)
                continue
            with self._lock:
                self._queued -= 1
            self._end(handle, TokenEvent(req.request_id, [], "", finish_reason=source.finish_reason,
                                         prompt_tokens=source.prompt_tokens, cached_tokens=source.prompt_tokens - 1,
                                         prompt_logprobs=list(source.prompt_logprobs), stats=SpecStats(),
                                         elapsed=time.perf_counter() - handle.submitted_at))
        self._waiting = keep

    def _awaits_prefill(self, handle: _Handle) -> bool:
        """Whether a waiting request should wait for a prompt now being prefilled instead of
        starting its own prefill: one that will store whole chunks of this request's prompt in
        the prefix cache that the cache does not hold yet (identical prompts of an ``n > 1``
        request, agents sharing a system prompt). Admitted once that prefill is stored, it reuses
        those chunks instead of computing them a second time, with the same output (warm equals
        cold).

        It waits only when that finishes sooner: prefilling now interleaves step by step with
        the owner's remaining ``R`` rows, so its own ``P`` rows are done after about
        ``P + min(R, P)`` rows of work; waiting costs ``R + P - S`` for ``S`` shared rows not yet
        cached, which is less exactly when ``S > 0`` and ``R < P + S``. Only an owner that stores
        where this request reads (same ``cache_salt``; with DSpark taps if this request has them:
        :meth:`PrefixCache.fetch`) and only what fits the cache's budget count.

        A request whose whole prompt an active sequence is prefilling (:meth:`_prompt_twin`)
        always waits for it: it then copies every position but the anchor, not just whole
        chunks. One whose prompt a sequence has prefilled already never waits: it copies it."""
        request = handle.request
        taps = self._handle_dspark(handle)
        twin = self._prompt_twin(request, taps)
        if twin is not None:  # wait for its remaining rows (never more than ours), or copy them now
            return not twin.prefilled
        if self.prefix_cache is None or request.prompt_logprobs:
            return False
        prompt = request.prompt_tokens
        usable = self.prefix_cache.cacheable(len(prompt))
        block = self.config.prefill_step
        if usable < block:
            return False
        for _, seq in self._active:
            other = seq.request
            if (seq.prefilled or seq.finished or other.prompt_logprobs or other.cache_salt != request.cache_salt
                    or (taps and seq.taps is None) or seq.cache is None):  # stores nothing it could use
                continue
            shared = handle.shared.get(other.request_id)
            if shared is None:  # whole chunks in common, computed once per (waiter, owner)
                limit = min(usable, self.prefix_cache.cacheable(len(other.prompt_tokens)))  # whole chunks
                if prompt[:limit] == other.prompt_tokens[:limit]:  # one C-level comparison
                    shared = limit
                else:
                    shared = 0
                    while prompt[shared:shared + block] == other.prompt_tokens[shared:shared + block]:
                        shared += block
                handle.shared[other.request_id] = shared
            hidden_bytes = 0 if seq.taps is None else seq.taps.row_bytes
            shared = min(shared, self.prefix_cache.storable(len(other.prompt_tokens), seq.cache, hidden_bytes))
            saved = shared - seq.cached_tokens
            remaining = max(0, len(other.prompt_tokens) - 1 - seq.num_prefilled)
            if saved > 0 and remaining < len(prompt) - 1 + saved:
                return True
        return False

    def _prompt_twin(self, request: GenerationRequest, dspark: bool) -> Sequence | None:
        """An active sequence prefilling or having prefilled ``request``'s whole prompt (or one
        that finished in the last step and kept its KV for it, :meth:`_keeps_kv_for_twins`), which
        ``request`` can then copy instead of prefilling it (the ``n`` choices of one request, or
        the same prompt sent at once by several clients): the same prompt tokens and
        ``cache_salt``, plain per-layer KV caches, ``request`` without DSpark taps (the drafter
        takes the prompt's hidden rows, which a copy leaves out; the twin may have them: its KV is
        the same), and only with the prefix cache on (copies follow its sharing rules: off,
        requests share nothing). Its rows before the anchor are the ones this request's own
        prefill would compute: the same chunks of the same tokens at the same positions, whether
        or not their logits were evaluated. So a request with prompt logprobs copies them too,
        from a twin that has them for the same ``logprobs`` count (echo + logprobs with
        ``n > 1``), and one that only scores its prompt (``max_tokens`` 0) takes a scoring
        twin's answer when it ends (:meth:`_answer_scored`; a twin that scores leaves no KV, so
        only requests that score the same way wait for it). ``dspark``: whether ``request`` runs
        DSpark."""
        candidates = [seq for _, seq in self._active if not seq.finished] + self._donors
        twins = [seq for seq in candidates if self._can_copy(request, dspark, seq)]
        # (a prefilled one first: the n - 1 choices copy the first one in one admission round,
        # not each the one admitted before it, a step later)
        return next((seq for seq in twins if seq.prefilled), twins[0] if twins else None)

    def _can_copy(self, request: GenerationRequest, dspark: bool, seq: Sequence) -> bool:
        """Whether ``request`` (running DSpark if ``dspark``) can copy ``seq``'s prompt rows: the
        rules of :meth:`_prompt_twin`."""
        return (self.prefix_cache is not None and len(request.prompt_tokens) >= 2 and not dspark
                and seq.cache is not None and self._serves(request, seq.request) and PrefixCache.supports(seq.cache))

    def _keeps_kv_for_twins(self, seq: Sequence) -> bool:
        """Whether ``seq``, which has just finished, keeps its KV until the next admission round
        because a waiting request would copy its prompt from it (:meth:`_prompt_twin`): the
        other ``n - 1`` choices of a request with ``max_tokens`` 1 wait for the first one's
        prefill, which is also its last step. A scoring sequence (``max_tokens`` 0) keeps none:
        its waiting twins take its answer (:meth:`_answer_scored`)."""
        return seq.request.max_tokens > 0 and seq.prefilled and any(
            self._can_copy(handle.request, self._handle_dspark(handle), seq) for handle in self._waiting)

    @staticmethod
    def _serves(request: GenerationRequest, other: GenerationRequest) -> bool:
        """Whether ``other``'s prefill gives ``request`` what it would compute itself: the same
        prompt tokens and ``cache_salt``, KV rows, and every prompt logprob it asks for (none, or
        the same count). A twin that only scores its prompt (``max_tokens`` 0) keeps no KV, so
        it serves only requests that score the same way."""
        if other.prompt_tokens != request.prompt_tokens or other.cache_salt != request.cache_salt:
            return False
        if other.max_tokens == 0:
            return (request.max_tokens == 0 and request.prompt_logprobs and other.prompt_logprobs
                    and other.logprobs == request.logprobs)
        return not request.prompt_logprobs or (other.prompt_logprobs and other.logprobs == request.logprobs)

    def _handle_dspark(self, handle: _Handle) -> bool:
        """:meth:`_runs_dspark` for a queued request, decided once, so that its wait for a prefix
        owner (:meth:`_awaits_prefill`) and its sequence agree."""
        if handle.dspark is None:
            handle.dspark = self._runs_dspark(handle.request)
        return handle.dspark

    def _may_run_dspark(self, request: GenerationRequest) -> bool:
        """Whether ``request``'s method may run DSpark at all (DSpark loaded, method ``auto`` or
        ``dspark``, verify passes wider than one row, drafts allowed)."""
        method = request.speculative.method or self.config.speculation
        return (self.cost.max_rows > 1 and self.dspark is not None and method in ("dspark", "auto")
                and request.speculative.max_draft_tokens != 0)

    def _runs_dspark(self, request: GenerationRequest) -> bool:
        """Whether ``request``'s sequence will start with DSpark, hence tap hidden rows in its
        prefill and read the taps' prefix namespace. Not once DSpark could not beat plain
        decoding even with every draft accepted (``DsparkStats.can_win``, e.g. on a CPU), unless
        the request forces drafts (``min_draft_tokens``): such a request would tap hidden rows
        for a drafter that never runs. A request that starts with it drops it on a cycle where
        it can neither be chosen nor probed (``DsparkStats.worth_tapping``): usually its first
        one while DSpark loses, or its second after a probe. (Admitting only requests that may
        probe would leave the prefix cache's taps namespace cold: such a request would prefill a
        long agent prompt again to run one probe.)"""
        if not self._may_run_dspark(request):
            return False
        return (request.speculative.min_draft_tokens > 0
                or self.dspark_stats.can_win(self.cost, self.dspark.config.block_size,
                                             len(request.prompt_tokens)))

    def _step_all(self) -> None:
        with self._lock:
            cancelled = set(self._cancelled)
        now = time.monotonic()
        if cancelled or self.config.request_timeout:
            self._end_waiting(cancelled, now)
        decoding = []
        for handle, seq in self._active:
            end = self._end_reason(handle, cancelled, now)
            if end is not None:
                self._finish(handle, seq, *end)
            elif seq.prefilled and self.batch_rows >= 2:
                decoding.append((handle, seq))
            else:
                self._guarded(handle, seq, self._step, handle, seq)
        if len(decoding) == 1:
            self._guarded(*decoding[0], self._step, *decoding[0])
        elif decoding:
            self._step_batch(decoding)
        self._active = [(h, s) for h, s in self._active if not s.finished]
        if self._scored:
            self._answer_scored()

    def _guarded(self, handle: _Handle, seq: Sequence, fn, *args) -> None:
        """Run ``fn(*args)``; an exception ends this request with an error event. The request's
        own fault (an ``InvalidRequestError``: a grammar that fails at a later step, say) is
        logged as a warning without the traceback; anything else is the server's, logged as an
        error with it."""
        try:
            fn(*args)
        except Exception as exc:
            rid = handle.request.request_id
            if isinstance(exc, InvalidRequestError):
                log.warning("request %s failed: %s", rid, exc)
            else:
                log.exception("request %s failed", rid)
            seq.finish_reason = FinishReason.ERROR
            seq.cache = None
            self._end(handle, TokenEvent(rid, [], "", finish_reason=FinishReason.ERROR, error=_as_engine_error(exc),
                                         prompt_tokens=seq.prompt_len, completion_tokens=seq.num_generated,
                                         cached_tokens=seq.cached_tokens,
                                         elapsed=time.perf_counter() - seq.submitted_at, **seq.end_timings()))

    def _step(self, handle: _Handle, seq: Sequence) -> None:
        """Advance one sequence by a prefill step (a chunk or a slice of one) or one speculative
        cycle and emit its event."""
        result = None
        if not seq.prefilled:
            result = prefill_step(seq, self._prefill_slice(seq))
            self._prefill_row_seconds = seq.prefill_row_seconds or self._prefill_row_seconds
            if seq.prefilled:
                self._store_prefix(seq, seq.cache)
        if seq.prefilled and result is None:  # the first cycle may follow the last chunk at once
            result = speculative_step(seq, self.cost)
        if result is not None:
            self._emit(handle, seq, result)

    def _prefill_slice(self, seq: Sequence) -> int | None:
        """Rows of ``seq``'s next prefill step: None (the whole chunk) where the runner cannot
        split chunks exactly or ``prefill_slice_ms`` is 0; else whole fused passes worth about
        ``prefill_slice_ms`` at the sequence's last measured seconds per row (the engine's last
        measurement of any sequence before its own; one pass before any), at least one pass and
        never past the chunk. So a long prompt holds the other sequences' steps up by about that
        much at a time (a 256-token chunk at a few thousand tokens of context takes ~1 s on 2 CPU
        cores), and a request that arrives meanwhile waits about that long to start. Slicing a
        prompt that runs alone costs nothing measurable (the passes are the same)."""
        rows = self.runner.prefill_slice_rows
        budget = self.config.prefill_slice_ms / 1e3
        if rows is None or budget <= 0:
            return None
        per_row = seq.prefill_row_seconds or self._prefill_row_seconds
        if per_row is None:
            return rows
        return max(rows, int(budget / per_row) // rows * rows)

    def _step_batch(self, decoding: list[tuple[_Handle, Sequence]]) -> None:
        """One batched cycle for up to ``batch_rows`` decoding sequences (round-robin when more
        are decoding). A sequence whose drafting or commit fails ends with its error alone; a
        failing batched pass is retried one sequence at a time, so again only the request at
        fault ends with an error."""
        n = len(decoding)
        if n > self.batch_rows:
            start = self._batch_start % n
            decoding = (decoding[start:] + decoding[:start])[: self.batch_rows]
            self._batch_start = start + self.batch_rows
        seqs = [seq for _, seq in decoding]
        lengths = [self.runner.cache_length(seq.cache) for seq in seqs]
        try:
            results = speculative_batch_step(seqs, self.cost, self.batch_rows)
        except Exception:  # the batched pass itself: nothing was committed
            log.exception("batched cycle failed; stepping its %d sequences one by one", len(seqs))
            for (handle, seq), length in zip(decoding, lengths):
                for layer in seq.cache:  # undo any rows the pass appended
                    layer.trim(layer.offset - length)
                self._guarded(handle, seq, self._step, handle, seq)
            return
        done = [r for r in results if not isinstance(r, Exception)]
        self.sink.batch_step(len(done), sum(len(r.token_ids) for r in done))
        for (handle, seq), result in zip(decoding, results):
            if isinstance(result, Exception):
                self._guarded(handle, seq, _reraise, result)
            else:
                self._guarded(handle, seq, self._emit, handle, seq, result)

    def _emit(self, handle: _Handle, seq: Sequence, result) -> None:
        first = seq.num_generated == len(result.token_ids)
        if result.verify_step is not None:
            self.sink.spec_step(*result.verify_step, len(result.token_ids))
        event = seq.event(result, first)
        if seq.finished:
            self._done(handle.request.request_id)
            if self._keeps_kv_for_twins(seq):
                self._donors.append(seq)
            else:
                seq.cache = None
            if seq.request.max_tokens == 0 and event.prompt_logprobs is not None and self.prefix_cache is not None:
                self._scored.append((seq.request, event))  # (a scored prompt; shared as copies are)
        handle.emit(event)
        if seq.finished:
            self.sink.request_finished(event)

    def _end_reason(self, handle: _Handle, cancelled: set[str], now: float):
        """(finish reason, error or None) when the request must end before its next step."""
        rid = handle.request.request_id
        if rid in cancelled:
            with self._lock:
                return FinishReason.CANCELLED, self._abort_errors.get(rid)
        if handle.deadline is not None and now >= handle.deadline:
            return FinishReason.TIMEOUT, RequestTimeout(
                f"the request ran past the server's time limit of {self.config.request_timeout:g} s")
        return None

    def _end_waiting(self, cancelled: set[str], now: float) -> None:
        keep = deque()
        for handle in self._waiting:
            end = self._end_reason(handle, cancelled, now)
            if end is None:
                keep.append(handle)
                continue
            with self._lock:
                self._queued -= 1
            self._end(handle, TokenEvent(handle.request.request_id, [], "", finish_reason=end[0], error=end[1],
                                         elapsed=now - handle.submitted_at))
        self._waiting = keep

    def _end(self, handle: _Handle, event: TokenEvent) -> None:
        """End a request that has no more steps with its last event: it leaves the live set, its
        client gets the event and the stats sink counts the request."""
        self._done(handle.request.request_id)
        handle.emit(event)
        self.sink.request_finished(event)

    def _done(self, request_id: str) -> None:
        with self._lock:
            self._live.discard(request_id)
            self._cancelled.discard(request_id)
            self._abort_errors.pop(request_id, None)

    def _finish(self, handle: _Handle, seq: Sequence, reason: FinishReason,
                error: EngineError | None = None) -> None:
        seq.finish_reason = reason
        cache, seq.cache = seq.cache, None
        self._end(handle, TokenEvent(handle.request.request_id, [], "", finish_reason=reason,
                                     prompt_tokens=seq.prompt_len, completion_tokens=seq.num_generated,
                                     cached_tokens=seq.cached_tokens, stats=seq.stats,
                                     elapsed=time.perf_counter() - seq.submitted_at, error=error,
                                     **seq.end_timings()))
        # Ended mid-prefill: its whole chunks so far (after the event, which the copy would
        # delay), unless the server is shutting down (no request would read them).
        if not seq.prefilled and not self._stopping and not isinstance(error, EngineUnavailable):
            self._store_prefix(seq, cache)


def resolve_compile(mode: str) -> bool:
    """``SPECSERVE_COMPILE``: ``on``/``off``, or ``auto`` = off: no backend measured so far runs the
    compiled passes faster (H200: compiled decode 0.79x eager for the default model; CPU: even;
    docs/benchmarks.md, "Step profile").

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"compile must be auto, on or off, got {mode!r}")
    return mode == "on"


def _reraise(exc: Exception):
    raise exc


def _as_engine_error(exc: Exception) -> EngineError:
    if isinstance(exc, EngineError):
        return exc
    err = EngineError(f"internal error: {type(exc).__name__}: {exc}")
    return err

