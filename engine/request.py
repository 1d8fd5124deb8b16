"""The engine contract's data types: what the server submits and what it gets back."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

SPECULATION_METHODS = ("auto", "prompt_lookup", "dspark", "off")


class EngineError(Exception):
    """Base class for errors the engine reports to the caller as values."""

    status = 500
    type = "server_error"
    code: str | None = None
    param: str | None = None


class InvalidRequestError(EngineError):
    """The request cannot be served as given (maps to HTTP 400)."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class TokenIdOutOfRange(InvalidRequestError):
    """A prompt token id outside ``[0, vocab)`` (HTTP 400). ``index`` is its position in the
    request's ``prompt_tokens``, so the server can name the element (``prompt.3``) as it does
    for a negative id, which the schema refuses."""

    def __init__(self, token: int, index: int, vocab: int, param: str = "prompt"):
        super().__init__(f"token id {token} is out of range [0, {vocab})", param=param)
        self.index = index


class ContextLengthExceeded(InvalidRequestError):
    """prompt + max_tokens exceed the model's context window (HTTP 400)."""

    def __init__(self, prompt_tokens: int, max_tokens: int, context_length: int, param: str = "prompt"):
        super().__init__(
            f"This model's maximum context length is {context_length} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
            param=param,
            code="context_length_exceeded",
        )
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length


class EngineOverloaded(EngineError):
    """The request queue is full (HTTP 429)."""

    status = 429
    type = "rate_limit_error"
    code = "queue_full"


class EngineUnavailable(EngineError):
    """The engine is not running, still loading, or shutting down (HTTP 503; ``code``
    ``shutting_down`` for the last, as the server's drain gate answers)."""

    status = 503
    type = "unavailable_error"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


class RequestTimeout(EngineError):
    """The request ran past the server's time limit and was stopped (HTTP 408).

    Raised for non-streaming responses; a stream gets it as its last (error) event after the
    tokens produced in time.
    """

    status = 408
    type = "timeout_error"
    code = "request_timeout"


class FinishReason(str, Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context window
    CANCELLED = "cancelled"  # the client went away, or the server shut down
    TIMEOUT = "timeout"  # past the request time limit
    ERROR = "error"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` is greedy (argmax of the processed logits).

    Processing order, per logits row: logit_bias, repetition/presence/frequency penalties
    (mlx-lm's processors), temperature, then top-k, top-p and min-p filters.
    Penalties: ``repetition_penalty`` looks at the last ``repetition_context_size`` tokens of
    prompt + output (mlx-lm's rule); presence/frequency look at all generated tokens (OpenAI's).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None

    # Values past float32's reach act as their limits (they would overflow to inf/NaN or round
    # to 0 in the float32 math and sample garbage): a temperature below this is greedy (vLLM's
    # _SAMPLING_EPS), and top_p and repetition_penalty are raised to it (top_p: only the top
    # token survives either way; the penalty stays extreme without dividing by zero).
    EPS = 1e-5

    def __post_init__(self):
        if 0.0 < self.temperature < self.EPS:
            object.__setattr__(self, "temperature", 0.0)
        for name in ("top_p", "repetition_penalty"):
            if 0.0 < getattr(self, name) < self.EPS:
                object.__setattr__(self, name, self.EPS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_processors(self) -> bool:
        return bool(
            self.logit_bias
            or self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
        )


@dataclass(frozen=True)
class SpeculativeParams:
    """Per-request speculation: ``method`` None means the server default.

    ``max_draft_tokens`` caps each draft; ``min_draft_tokens`` (llama.cpp's ``n_min``) makes the
    scheduler keep at least that many proposed tokens even when its cost model would draft less.
    """

    method: str | None = None
    max_draft_tokens: int | None = None
    min_draft_tokens: int = 0


_ids = itertools.count()


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{next(_ids)}"


@dataclass
class GenerationRequest:
    """One sequence to generate. The server expands ``n`` and prompt lists into several."""

    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k: the chosen token plus k alternatives
    prompt_logprobs: bool = False  # echo + logprobs: logprobs of the prompt tokens too
    speculative: SpeculativeParams = field(default_factory=SpeculativeParams)
    # structured output: an llguidance grammar (engine.constraint.json_grammar etc.) the output
    # must match; it ends when the grammar is complete
    grammar: str | None = None
    request_id: str = field(default_factory=new_request_id)
    cache_salt: str | None = None  # prefix-cache namespace: only requests with the same salt share
    # the grammar compiled for this request alone (Engine.validate sets it: the worker never
    # compiles, and llguidance matchers must not share state across requests)
    grammar_matcher: object = field(default=None, repr=False, compare=False)


@dataclass
class TokenLogprob:
    """Log-probability of one token under the target's raw distribution (log_softmax of logits)."""

    token: int
    logprob: float | None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class DrafterCounts:
    """Speculative counters for one drafter (or all of them)."""

    num_drafts: int = 0  # verify steps that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_unused_proposals: int = 0  # drafter forwards paid for but not verified (cut to nothing, or lost)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft:
            self.accepted_per_position += [0] * (num_draft - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per drafted verify step, bonus included: ``1 + accepted / drafts``."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "num_unused_proposals": self.num_unused_proposals,
        }


@dataclass
class SpecStats:
    """Per-request speculative decoding statistics (the response's ``speculative_decoding``)."""

    num_verify_steps: int = 0  # target passes after prefill, with or without drafts
    total: DrafterCounts = field(default_factory=DrafterCounts)
    by_drafter: dict[str, DrafterCounts] = field(default_factory=dict)

    def observe(self, drafter: str | None, num_draft: int, num_accepted: int) -> None:
        self.num_verify_steps += 1
        if drafter is None or num_draft == 0:
            return
        self.total.observe(num_draft, num_accepted)
        self.by_drafter.setdefault(drafter, DrafterCounts()).observe(num_draft, num_accepted)

    def unused_proposal(self, drafter: str) -> None:
        """A ``drafter`` forward ran this cycle but its proposal was not verified."""
        self.total.num_unused_proposals += 1
        self.by_drafter.setdefault(drafter, DrafterCounts()).num_unused_proposals += 1

    def as_dict(self) -> dict:
        return {
            "num_verify_steps": self.num_verify_steps,
            "num_drafts": self.total.num_drafts,
            "num_draft_tokens": self.total.num_draft_tokens,
            "num_accepted_tokens": self.total.num_accepted_tokens,
            "mean_acceptance_length": round(self.total.mean_acceptance_length, 4),
            "by_drafter": {k: v.as_dict() for k, v in self.by_drafter.items()},
        }


@dataclass
class TokenEvent:
    """What the engine emits for a request: new tokens and their text, or the end.

    ``text`` is UTF-8 safe (never half a character) and stop strings are already cut out.
    The last event has ``finish_reason`` set, plus usage, stats and timings.
    """

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache or a twin's prefill
    prompt_logprobs: list[TokenLogprob] | None = None  # first event only, when asked
    stats: SpecStats | None = None
    error: EngineError | None = None
    time_to_first_token: float | None = None  # seconds from submit, on the first event with tokens
    elapsed: float | None = None  # seconds from submit, on the last event (ended in the queue too)
    queue_time: float | None = None  # seconds from submit to admission, on the last event of an admitted request
    # (last token - first token) / (tokens - 1), seconds, on the last event of one with 2+ tokens
    time_per_output_token: float | None = None
