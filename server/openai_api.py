"""/v1/completions and /v1/chat/completions: requests to engine jobs, events to OpenAI JSON/SSE."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine import (
    ContextLengthExceeded,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    FinishReason,
    GenerationRequest,
    GrammarError,
    SamplingParams,
    SpecStats,
    SpeculativeParams,
    StreamingDetokenizer,
    TokenEvent,
    TokenIdOutOfRange,
    TokenLogprob,
    choice_grammar,
    json_grammar,
    regex_grammar,
)

from .errors import APIError, error_body
from .schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    ToolFields,
)
from .tools import ToolCallSplitter, ToolFormat, split_tool_calls

router = APIRouter()
MAX_PROMPTS = 64
# Request log lines: ids, counts and timings at DEBUG; prompt and output text only with the
# `log_requests` setting (prompts may hold secrets or personal data).
req_log = logging.getLogger("specserve.requests")
log = logging.getLogger(__name__)


@dataclass
class Job:
    """One choice: an engine request plus what the response needs to render it."""

    index: int
    request: GenerationRequest
    prompt_text: str | None = None  # echo text for completions
    typed_specials: dict[int, str] = field(default_factory=dict)  # echo: see LegacyLogprobs
    prompt_starts: list[int] | None = None  # echo: each prompt token's start in prompt_text
    events: list[TokenEvent] = field(default_factory=list)
    prompt_param: str = "prompt"  # the request field errors about the prompt name ("messages" for chat)
    max_tokens_param: str = "max_tokens"
    tool_format: ToolFormat | None = None  # chat with tools: parse tool calls out of the text
    tools: list[dict] | None = None  # the request's tools, as the template and the parser see them
    max_tool_calls: int | None = None  # 1 with parallel_tool_calls false
    grammar_param: str | None = None  # the field that asked for structured output
    prompt_ids_param: str | None = None  # a prompt given as token ids: its field ("prompt.1"), for errors

    def tool_splitter(self) -> ToolCallSplitter | None:
        return ToolCallSplitter(self.tool_format, self.tools, self.max_tool_calls) if self.tool_format else None


# ---- request translation ----------------------------------------------------------------------


def _state(request: Request):
    return request.app.state


def check_model(request: Request, model: str | None) -> str:
    served = _state(request).engine.loaded.name if _state(request).engine.loaded else None
    if model is not None and served is not None and model.lower() != served.lower():
        raise APIError(404, f"The model `{model}` does not exist. This server serves `{served}`.",
                       param="model", code="model_not_found")
    return served or (model or "")


def check_ready(request: Request) -> None:
    """503 until the engine is ready: the prompt is built with the loaded model's tokenizer.

    Raises:
        EngineUnavailable: still loading (or the load failed: its error).
    """
    engine = _state(request).engine
    if not engine.ready:
        _state(request).metrics.request_rejected("EngineUnavailable")
        raise EngineUnavailable(engine.health().get("error") or "the model is still loading")


def sampling_params(body: SamplingFields, seed_offset: int = 0) -> SamplingParams:
    """The engine's sampling settings for choice ``seed_offset`` of ``body``. A seed is taken as
    64 bits (a negative one as its two's complement, so -1 and 2**64 - 1 are one seed), which the
    samplers' keys use whole (engine/sampling.py ``position_key``): distinct 64-bit seeds give
    distinct streams."""
    seed = body.seed
    if seed is not None:
        seed = (seed + seed_offset) % (1 << 64)
    top_k = body.top_k or 0
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(top_k, 0),
        min_p=body.min_p or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=tuple((int(k), float(v)) for k, v in (body.logit_bias or {}).items()),
        seed=seed,
    )


def speculative_params(body: SamplingFields) -> SpeculativeParams:
    if body.speculative is None:
        return SpeculativeParams()
    spec = body.speculative
    return SpeculativeParams(spec.method, spec.max_draft_tokens, spec.min_draft_tokens)


def output_grammar(body: SamplingFields) -> tuple[str | None, str | None]:
    """The llguidance grammar ``response_format`` / ``structured_outputs`` ask for, and the
    field to name in errors about it; ``(None, None)`` for free text."""
    rf, so = body.response_format, body.structured_outputs
    param = None
    try:
        if so is not None:
            if so.json_ is not None:
                param = "structured_outputs.json"
                return json_grammar(so.json_), param
            if so.regex is not None:
                param = "structured_outputs.regex"
                return regex_grammar(so.regex), param
            param = "structured_outputs.choice"
            return choice_grammar(so.choice), param
        if rf is None or rf.type == "text":
            return None, None
        if rf.type == "json_object":
            param = "response_format"
            return json_grammar(None), param
        param = "response_format.json_schema.schema"
        return json_grammar(rf.json_schema.schema_, strict=bool(rf.json_schema.strict)), param
    except (GrammarError, ValueError, RuntimeError) as exc:
        raise APIError(400, f"the output format does not compile: {exc}", param=param,
                       code="invalid_output_format") from None


def _prompts(request: Request, body: CompletionRequest) -> list[tuple[list[int], str | None, str | None]]:
    """``(tokens, text or None, field)`` per prompt; ``field`` names the prompt (``prompt``, or
    ``prompt.<i>`` in a list) for errors about it or one of its ids."""
    tokenizer = _state(request).engine.loaded.tokenizer
    p = body.prompt
    if isinstance(p, str) or isinstance(p[0], int):
        items = [(p, "prompt")]
    else:
        items = [(item, f"prompt.{i}") for i, item in enumerate(p)]
    if len(items) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    out = []
    for item, param in items:
        if isinstance(item, str):
            check_text_length(request, item, param)
            out.append((tokenizer.encode(item), item, param))
        else:
            out.append((list(item), None, param))
    return out


def check_text_length(request: Request, text: str, param: str = "prompt") -> None:
    """Refuse a text prompt that is too long for the server's ``max_prompt_tokens`` or the
    context window by its bytes alone, without tokenizing it (8 MB of text take ~8 s of a core):
    ``TokenTable.min_tokens`` bounds its token count from below where the tokenizer maps text to
    tokens byte for byte (no check otherwise). The checks and their order are the tokenized
    prompt's (:func:`check_prompt_length`, then the engine's context check, which is counted).

    Raises:
        APIError: 400 ``prompt_too_long`` or ``context_length_exceeded`` (``param``: the field).
    """
    loaded = _state(request).engine.loaded
    table = loaded.token_table
    limit = _state(request).settings.max_prompt_tokens
    cap = min(loaded.context_length, limit or loaded.context_length)
    if not table.max_token_bytes or len(text) * 4 <= table.max_token_bytes * cap:
        return  # (UTF-8 takes at most 4 bytes a character: it cannot be too long)
    least = table.min_tokens(text)
    if not (limit and least > limit) and least <= loaded.context_length:
        return
    why = (f"at least {least} tokens ({len(text.encode('utf-8'))} bytes of text, at most "
           f"{table.max_token_bytes} per token)")
    if limit and least > limit:
        raise APIError(400, f"The prompt has {why}; this server accepts at most {limit}.", param=param,
                       code="prompt_too_long")
    _state(request).metrics.request_rejected("ContextLengthExceeded")  # (as the engine's check counts it)
    raise APIError(400, f"This model's maximum context length is {loaded.context_length} tokens. However, "
                   f"the prompt alone has {why}. Please reduce the prompt.", param=param,
                   code="context_length_exceeded")


def echo_offsets(tokenizer, table, text: str, ids: list[int]) -> tuple[dict[int, str], list[int] | None]:
    """Where each of ``ids`` (``text`` tokenized) starts in ``text``, in characters, and the
    positions holding a hidden special token (one of ``table.special_text``) that ``text``
    spells out (``<|im_start|>`` typed in a text prompt) to that spelling: ``(typed, starts)``.
    The starts index the text as given, so characters the tokenizer drops (a byte a byte-level
    vocabulary has no token for, such as SmolLM2's 0x1d) or normalises do not shift the
    offsets after them, as offsets counted along the decoded tokens would; a token holding part
    of a character starts where the character does, and a token spanning nothing there (a
    special token the tokenizer added: a BOS, an appended EOS) starts where the token before it
    ended. ``typed`` comes from the fast tokenizer's character offsets; ``starts`` from the
    tokens' bytes where the table can match them (:meth:`TokenTable.char_starts`: the fast
    tokenizer's offsets are wrong within a pre-token holding a dropped byte), else from those
    offsets. ``({}, None)`` when the tokenizer gives no offsets or other ids, and ``starts``
    None when the offsets are trimmed of whitespace (a ByteLevel post-processor with
    ``trim_offsets`` moves a token's start past its leading spaces): the caller then counts
    along the decoded tokens."""
    try:
        backend = getattr(tokenizer, "_tokenizer", tokenizer)
        enc = backend(text, return_offsets_mapping=True)
    except Exception:  # (a slow tokenizer has no offsets)
        return {}, None
    if list(enc["input_ids"]) != list(ids):
        return {}, None
    spans = [tuple(span) for span in enc["offset_mapping"]]
    typed = {i: text[a:b] for i, (t, (a, b)) in enumerate(zip(ids, spans)) if t in table.special_text and b > a}
    starts = table.char_starts(text, ids, typed)
    if starts is not None or _trims_offsets(backend):
        return typed, starts
    starts, end = [], 0
    for a, b in spans:
        starts.append(a if b > a else end)
        end = max(end, b)
    return typed, starts


def _trims_offsets(hf_tokenizer) -> bool:
    """Whether ``hf_tokenizer``'s post-processor trims whitespace off the offsets it reports."""
    processor = getattr(getattr(hf_tokenizer, "backend_tokenizer", None), "post_processor", None)
    try:
        return processor is not None and '"trim_offsets":true' in processor.__getstate__().decode().replace(" ", "")
    except Exception:  # (no serialisable state: assume it may trim)
        return True


def capped_max_tokens(settings, requested: int | None, default: int, param: str) -> int:
    """``requested``, or ``default`` when omitted, under the server's ``max_tokens_limit``.

    Raises APIError 400 ``max_tokens_too_large`` above the limit (explicit values are not clamped).
    """
    limit = settings.max_tokens_limit
    if requested is None:
        return min(default, limit) if limit else default
    if limit and requested > limit:
        raise APIError(400, f"{param} is {requested}, above this server's limit of {limit}.",
                       param=param, code="max_tokens_too_large")
    return requested


def check_prompt_length(settings, tokens: list[int], param: str) -> None:
    """Raise APIError 400 ``prompt_too_long`` past the server's ``max_prompt_tokens``."""
    limit = settings.max_prompt_tokens
    if limit and len(tokens) > limit:
        raise APIError(400, f"The prompt has {len(tokens)} tokens; this server accepts at most {limit}.",
                       param=param, code="prompt_too_long")


def completion_jobs(request: Request, body: CompletionRequest, rid: str) -> list[Job]:
    settings = _state(request).settings
    if body.n > settings.max_n:
        raise APIError(400, f"n must be at most {settings.max_n}", param="n")
    max_tokens = capped_max_tokens(settings, body.max_tokens, settings.default_max_tokens, "max_tokens")
    if max_tokens == 0 and not (body.echo and body.logprobs is not None):
        raise APIError(400, "max_tokens must be at least 1 (0 is allowed only with echo and logprobs)",
                       param="max_tokens")
    table = _state(request).engine.loaded.token_table
    grammar, grammar_param = output_grammar(body)
    jobs = []
    for p_index, (tokens, text, param) in enumerate(_prompts(request, body)):
        check_prompt_length(settings, tokens, param)
        echo, typed, starts = None, {}, None  # (the echo and its offsets: the same for every choice)
        for i in range(body.n):
            req = GenerationRequest(
                prompt_tokens=tokens,
                max_tokens=max_tokens,
                sampling=sampling_params(body, i),
                stop=tuple(body.stop or ()),
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
                logprobs=body.logprobs,
                prompt_logprobs=body.echo and body.logprobs is not None,
                speculative=speculative_params(body),
                request_id=f"{rid}-{p_index}-{i}",
                cache_salt=body.cache_salt,
                grammar=grammar,
            )
            job = Job(len(jobs), req, echo, typed, starts, prompt_param=param, grammar_param=grammar_param,
                      prompt_ids_param=param if text is None else None)
            if body.echo and echo is None:
                validate(request, job)  # token ids in range before decoding them
                echo = job.prompt_text = text if text is not None else table.decode(tokens)
                if text is not None and body.logprobs is not None:
                    loaded = _state(request).engine.loaded
                    typed, starts = echo_offsets(loaded.tokenizer, table, text, tokens)
                    job.typed_specials, job.prompt_starts = typed, starts
            jobs.append(job)
    return jobs


def require_chat_template(tokenizer) -> None:
    """Raise APIError 400 (``param: messages``) when the model has no chat template."""
    if not getattr(tokenizer, "has_chat_template", False) and not tokenizer.chat_template:
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")


def template_tools(tokenizer, body: ToolFields) -> tuple[ToolFormat | None, list[dict] | None]:
    """The model's tool-call format and the tools its chat template renders (OpenAI dicts):
    ``(None, None)`` unless the request uses tools (some given, ``tool_choice`` not ``"none"``).
    Raises APIError 400 (``param: tools``) when the template has no tool-call format."""
    if not body.uses_tools():
        return None, None
    fmt = ToolFormat.of(tokenizer)
    if fmt is None:
        raise APIError(400, "this model's chat template has no tool-call format, so it cannot call tools "
                       "(send tool_choice 'none' or no tools)", param="tools")
    return fmt, [t.for_template() for t in body.tools]


def chat_prompt(tokenizer, messages: list[ChatMessage], tools: list[dict] | None,
                add_generation_prompt: bool = True, check=None) -> list[int]:
    """The prompt's token ids: ``messages`` (and ``tools``, as OpenAI dicts, or None) through the
    model's chat template. Control tokens spelled inside messages and tools (``<|im_start|>``
    typed in a user's text) are encoded as the text they spell, so only the template writes
    turns and roles (Hugging Face's ``sanitize_control_tokens``, transformers >= 5.20; without
    it a user could open a system turn from inside a message). ``check``, when given, sees the
    rendered text first (:func:`check_text_length`: a render too long for the context is refused
    before it is tokenized; rendering alone takes microseconds).

    Raises APIError 400 (``param: messages``) for a template error, e.g. roles out of order, or
    when the model has no template."""
    require_chat_template(tokenizer)
    extra = {"tools": tools} if tools is not None else {}
    dicts = [m.for_template() for m in messages]
    try:
        if check is not None:
            check(tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt, tokenize=False,
                                                **extra))
        controls = _chat_control_tokens(tokenizer)
        if controls:
            _refuse_control_keys(controls, tools, "tools")
            _refuse_control_keys(controls, [m.get("tool_calls") for m in dicts], "messages")
            extra["sanitize_control_tokens"] = True
        tokens = tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt, tokenize=True,
                                               **extra)
    except APIError:
        raise
    except Exception as exc:  # template errors, e.g. roles out of order
        if "Can't sanitize" in str(exc):  # (a control token the tokenizer also builds from plain text)
            raise APIError(400, f"the messages spell a control token this model cannot take as text: {exc}",
                           param="messages") from exc
        raise APIError(400, f"could not apply the chat template: {exc}", param="messages") from exc
    return list(tokens)


_SPLIT_CALL = r"\b(?:r?split|r?partition)\(\s*"  # (Jinja's str methods that cut content at a marker)


@functools.cache
def _chat_control_tokens(tokenizer) -> tuple[str, ...]:
    """The control-token spellings (the tokenizer's added tokens) to encode as text in chat
    inputs, or () where the chat goes through an mlx-lm template module or a tokenizer class's
    own renderer (which take no ``sanitize_control_tokens``).

    A template may cut content at an added token: Qwen3's ``content.split('</think>')`` drops an
    assistant turn's think block and strips the newlines after it. transformers wraps typed
    control tokens in markers, which would stop that strip, so the tokens a template splits or
    partitions at (in a literal argument) are left out: the tokenizer's ``chat_control_tokens``
    (what transformers sanitizes besides the special tokens; by default the added tokens the
    template spells) is narrowed to the rest, once per tokenizer and for the process. Qwen3's
    ``<think>`` typed in a message then stays a think token, while ``<|im_start|>`` and
    ``<tool_call>`` are text. Where a template splits at a special token (always sanitized), or
    still cuts content at a sanitized token in a probe (:func:`_template_cuts_at`: a split at a
    variable, say), nothing is sanitized, with a warning: the plain path, as before."""
    try:
        hf = tokenizer._tokenizer  # (mlx-lm's TokenizerWrapper around the Hugging Face tokenizer)
        if getattr(tokenizer, "_chat_template", None) is not None:
            return ()
        if "sanitize_control_tokens" not in inspect.signature(hf.apply_chat_template).parameters:
            return ()
        # (whitespace tokens, like Gemma's "\n", are text wherever they appear, as transformers has it)
        added = [t for t in hf.added_tokens_decoder.values() if str(t).strip()]
        named = hf.chat_template if isinstance(hf.chat_template, dict) else {"": hf.chat_template}
        template = "\0".join(t for t in named.values() if isinstance(t, str))
        literals = [literal for _, literal in re.findall(_SPLIT_CALL + r"(['\"])(.*?)\1", template)]
        split_at = {str(t) for t in added if any(str(t) in literal for literal in literals)}
        if any(t.special for t in added if str(t) in split_at) or (split_at and not hasattr(hf, "chat_control_tokens")):
            log.warning("chat control tokens are not sanitized: the chat template splits content at %s",
                        sorted(split_at))
            return ()
        listed = getattr(hf, "chat_control_tokens", None)
        if listed is None:  # (transformers' default: the added tokens the template spells)
            listed = [str(t) for t in added if not t.special and str(t) in template]
        if split_at:
            listed = hf.chat_control_tokens = [t for t in listed if t not in split_at]
        sanitized = [str(t) for t in added if t.special or str(t) in listed]
        cut = _template_cuts_at(hf, [t for t in sanitized if t in template])
        if cut:
            log.warning("chat control tokens are not sanitized: the chat template cuts content at %s", cut)
            return ()
        return tuple(str(t) for t in added if str(t) not in split_at)
    except Exception:  # (anything unexpected: keep the plain path)
        log.warning("chat control tokens are not sanitized", exc_info=True)
        return ()


_MARK = ("\ue0f0", "\ue0f1")  # (private-use characters, like the markers transformers wraps tokens in)


def _template_cuts_at(hf, spellings: list[str]) -> str | None:
    """A control token the chat template cuts content at, or None: each of a few probe chats
    (tokens typed in every message, or each token opening a message; a system turn; the
    assistant's turn last; a tool) is rendered as text with the typed tokens as they are and
    again wrapped in two marker characters, as transformers' sanitizing wraps them. A template
    that splits, strips or tests content at a wrapped token renders the two differently (a
    marker left alone, or other text). Shapes a template refuses are skipped."""
    if not spellings:
        return None
    tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    bodies = [("several", "x" + "".join(f"{t}\n\n" for t in spellings) + "y"),
              *((t, f"{t}\n\nx\n\n") for t in spellings[:32])]
    pattern = re.compile("|".join(map(re.escape, sorted(spellings, key=len, reverse=True))))
    for token, body in bodies:
        marked = pattern.sub(lambda m: _MARK[0] + m.group(0) + _MARK[1], body)
        for roles, generation, tools in ((("user", "assistant", "user"), True, None),
                                         (("system", "user", "assistant"), False, None),
                                         (("user", "assistant", "user"), True, tool)):
            try:
                plain, wrapped = (hf.apply_chat_template([{"role": r, "content": text} for r in roles], tools=tools,
                                                         add_generation_prompt=generation, tokenize=False)
                                  for text in (body, marked))
            except Exception:  # noqa: BLE001 (a shape this template refuses)
                continue
            unwrapped = re.sub(re.escape(_MARK[0]) + f"({pattern.pattern})" + re.escape(_MARK[1]), r"\1", wrapped)
            if unwrapped != plain:
                return token
    return None


def _refuse_control_keys(controls: tuple[str, ...], value, param: str) -> None:
    """Refuse a dict key holding a control token's spelling in ``value`` (tools, tool-call
    arguments): templates print keys verbatim (``tojson``) and transformers does not sanitize
    them, so such a key would open a turn from inside a tool. Raises APIError 400."""
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and any(c in key for c in controls):
                raise APIError(400, f"a key holds a control token of this model: {key!r}", param=param)
            _refuse_control_keys(controls, item, param)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _refuse_control_keys(controls, item, param)


def chat_jobs(request: Request, body: ChatCompletionRequest, rid: str) -> list[Job]:
    settings = _state(request).settings
    engine = _state(request).engine
    if body.n > settings.max_n:
        raise APIError(400, f"n must be at most {settings.max_n}", param="n")
    tokenizer = engine.loaded.tokenizer
    require_chat_template(tokenizer)
    grammar, grammar_param = output_grammar(body)
    if grammar is not None and body.uses_tools():
        raise APIError(400, "structured output and tools cannot be combined (the format would keep the model "
                       "from calling a tool)", param=grammar_param)
    fmt, tools = template_tools(tokenizer, body)
    if fmt is not None:
        forced = body.forced_tools()
        if forced is not None:  # tool_choice required or a named function: a grammar of calls
            if fmt.style is None:
                choice = "'required'" if body.tool_choice == "required" else "naming a function"
                raise APIError(400, f"tool_choice {choice} cannot be enforced in this model's tool-call format "
                               f"({fmt.start}...{fmt.end}); use 'auto'", param="tool_choice",
                               code="invalid_output_format")
            functions = [t.for_template()["function"] for t in forced]
            try:
                grammar = _state(request).engine.tool_call_grammar(
                    fmt.style, fmt.start, fmt.end, functions, parallel=body.parallel_tool_calls is not False)
            except (GrammarError, ValueError, RuntimeError) as exc:
                raise APIError(400, f"the tools cannot be forced: {exc}", param="tools",
                               code="invalid_output_format") from None
            grammar_param = "tools"
    tokens = chat_prompt(tokenizer, body.messages, tools,
                         check=lambda text: check_text_length(request, text, "messages"))
    check_prompt_length(settings, tokens, "messages")
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = capped_max_tokens(settings, body.max_completion_tokens or body.max_tokens,
                                   max(1, engine.loaded.context_length - len(tokens)), param)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_calls = 1 if body.parallel_tool_calls is False else None
    return [
        Job(i, prompt_param="messages", max_tokens_param=param, tool_format=fmt, tools=tools,
            max_tool_calls=max_calls, grammar_param=grammar_param, request=GenerationRequest(
            prompt_tokens=tokens,
            max_tokens=max_tokens,
            sampling=sampling_params(body, i),
            stop=tuple(body.stop or ()),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            speculative=speculative_params(body),
            request_id=f"{rid}-{i}",
            cache_salt=body.cache_salt,
            grammar=grammar,
        ))
        for i in range(body.n)
    ]


# ---- running jobs ---------------------------------------------------------------------------


def _name_grammar_field(job: Job, exc: EngineError) -> EngineError:
    """The engine calls every structured-output error's field ``response_format``: name the
    one this request used (``structured_outputs.regex``, ``tools``, ...)."""
    if exc.param == "response_format" and job.grammar_param:
        exc.param = job.grammar_param
    return exc


async def prepare_grammars(request: Request, jobs: list[Job]) -> None:
    """Validate the jobs that ask for structured output in a worker thread: the engine's last
    check compiles each one's grammar (milliseconds; seconds for a big schema, which on the event
    loop would stall every stream) after the cheap ones (so a draining server still answers
    503 at once) and keeps it on the request, for the submit that follows."""
    grammar_jobs = [job for job in jobs if job.request.grammar is not None]

    def validate_all():
        for job in grammar_jobs:
            validate(request, job)

    if grammar_jobs:
        await asyncio.to_thread(validate_all)


def validate(request: Request, job: Job) -> None:
    """The engine's checks of ``job``; a rejection is counted (the engine's own count sees only
    submits) and a context overflow names the field to shorten (``messages``/``prompt``, or
    ``max_tokens`` when the prompt alone fits)."""
    try:
        _state(request).engine.validate(job.request)
    except EngineError as exc:
        _state(request).metrics.request_rejected(type(exc).__name__)
        if isinstance(exc, ContextLengthExceeded):
            exc.param = job.prompt_param if exc.prompt_tokens >= exc.context_length else job.max_tokens_param
        elif isinstance(exc, TokenIdOutOfRange) and job.prompt_ids_param:
            exc.param = f"{job.prompt_ids_param}.{exc.index}"
        elif exc.param == "prompt":  # (the engine sees one prompt: name it in the request's list)
            exc.param = job.prompt_param
        raise _name_grammar_field(job, exc) from None


def check_capacity(request: Request, jobs: list[Job], param: str = "n") -> None:
    """Raise unless all of ``jobs`` fit the engine's queue now (see :func:`submit_all`);
    ``param`` names the field that multiplied them."""
    engine = _state(request).engine
    capacity = engine.config.max_queue
    if len(jobs) > capacity:
        raise APIError(400, f"This request asks for {len(jobs)} generations at once (prompts x n); this "
                       f"server queues at most {capacity}.", param=param, code="too_many_generations")
    if engine.queue_depth() + len(jobs) > capacity:
        _state(request).metrics.request_rejected("EngineOverloaded")
        raise EngineOverloaded(f"the request queue is full ({capacity})")


def submit_all(request: Request, jobs: list[Job]) -> list[AsyncIterator[TokenEvent]]:
    """Queue every job (one call's prompts x n generations) or none.

    Raises:
        APIError: 400 ``too_many_generations`` for more jobs than the queue can ever hold (a
            429 would have clients retry it for ever).
        EngineOverloaded: 429 when they do not fit the queue now (checked before any is queued,
            so none has to be withdrawn and counted as cancelled).
        EngineError: the engine's checks of any job.
    """
    engine = _state(request).engine
    for job in jobs:  # validate every job before any runs
        validate(request, job)
    check_capacity(request, jobs)  # (again: the queue may have filled while grammars compiled)
    streams = []
    try:
        for job in jobs:
            streams.append(engine.submit(job.request))
    except EngineError:  # e.g. the queue filled up part way: withdraw the jobs already queued
        for job in jobs[: len(streams)]:  # (their streams never started, so closing them is a no-op)
            engine.cancel(job.request.request_id)
        raise
    return streams


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def merged(request: Request, jobs: list[Job], streams) -> AsyncIterator[tuple[Job, TokenEvent]]:
    """Events of all jobs as they come. Closing this generator cancels the unfinished jobs."""
    queue: asyncio.Queue = asyncio.Queue()
    metrics = _state(request).metrics

    async def pump(job: Job, stream):
        try:
            async for event in stream:
                if event.time_to_first_token is not None and event.token_ids:
                    metrics.first_token(event.time_to_first_token)
                await queue.put((job, event))
        finally:
            await queue.put((job, None))

    tasks = [asyncio.ensure_future(pump(j, s)) for j, s in zip(jobs, streams)]
    try:
        remaining = len(jobs)
        while remaining:
            job, event = await queue.get()
            if event is None:
                remaining -= 1
                continue
            yield job, event
    finally:
        # No awaits here: this runs when the client hangs up, inside a cancelled task (anyio
        # cancels every await), and a pump may still be inside its stream (aclose() would raise
        # "already running"). Cancelling the pumps closes their streams; engine.cancel also
        # covers streams a pump never started. Finished requests ignore the cancel.
        for task in tasks:
            task.cancel()
        engine = _state(request).engine
        for job in jobs:
            engine.cancel(job.request.request_id)


async def collect(request: Request, jobs: list[Job], streams) -> None:
    """Run jobs to the end, or to the first failed one (the others are cancelled: the request
    fails with its error); a client disconnect cancels them."""

    async def consume():
        async with contextlib.aclosing(merged(request, jobs, streams)) as events:
            async for job, event in events:
                job.events.append(event)
                if event.error is not None:  # (the request fails with it: leaving cancels the other choices)
                    break

    work = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            try:
                await work
            except asyncio.CancelledError:
                pass
            raise APIError(499, "client disconnected")
    work.result()


# ---- rendering ----------------------------------------------------------------------------


def first_error(jobs: list[Job]) -> EngineError | None:
    for job in jobs:
        for event in job.events:
            if event.error is not None:
                return _name_grammar_field(job, event.error)
    return None


def usage(jobs: list[Job]) -> dict:
    """OpenAI usage; a prompt shared by ``n`` choices counts once, and so does its cached part:
    the least of its choices' (choices that copied another choice's prefill report it as cached,
    but it is no cache hit of the request)."""
    prompts, cached = {}, {}
    completion = 0
    for job in jobs:
        last = job.events[-1] if job.events else None
        if last is None:
            continue
        key = job.request.request_id.rsplit("-", 1)[0]
        prompts[key] = last.prompt_tokens
        cached[key] = min(cached.get(key, last.cached_tokens), last.cached_tokens)
        completion += last.completion_tokens
    prompt = sum(prompts.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


def spec_summary(jobs: list[Job]) -> dict:
    total = SpecStats()
    for job in jobs:
        stats = job.events[-1].stats if job.events else None
        if stats is None:
            continue
        total.num_verify_steps += stats.num_verify_steps
        for name, counts in stats.by_drafter.items():
            for target in (total.total, total.by_drafter.setdefault(name, type(counts)())):
                target.num_drafts += counts.num_drafts
                target.num_draft_tokens += counts.num_draft_tokens
                target.num_accepted_tokens += counts.num_accepted_tokens
                target.num_unused_proposals += counts.num_unused_proposals
                pos = target.accepted_per_position
                for i, v in enumerate(counts.accepted_per_position):
                    if i >= len(pos):
                        pos.append(0)
                    pos[i] += v
    return total.as_dict()


def finish_reason(event: TokenEvent | None) -> str | None:
    if event is None or event.finish_reason is None:
        return None
    if event.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
        return event.finish_reason.value
    return "stop" if event.finish_reason is FinishReason.CANCELLED else "error"


def log_request(request: Request, rid: str, jobs: list[Job]) -> None:
    """One log line per generation request; prompt and output text only with ``log_requests``."""
    content = _state(request).settings.log_requests
    if not req_log.isEnabledFor(logging.INFO if content else logging.DEBUG):
        return
    u = usage(jobs)
    reasons = ",".join(finish_reason(job.events[-1]) or "none" if job.events else "none" for job in jobs)
    started = getattr(request.state, "started", None)
    elapsed = time.perf_counter() - started if started is not None else float("nan")
    line = "%s: %d choice(s), %d prompt tokens, %d completion tokens, finish=%s, %.3f s"
    args = [rid, len(jobs), u["prompt_tokens"], u["completion_tokens"], reasons, elapsed]
    if not content:
        req_log.debug(line, *args)
        return
    table = _state(request).engine.loaded.token_table
    prompts = list(dict.fromkeys(table.decode(job.request.prompt_tokens) for job in jobs))
    outputs = ["".join(e.text for e in job.events) for job in jobs]
    req_log.info(line + " prompts=%r outputs=%r", *args, prompts, outputs)


class LegacyLogprobs:
    """Accumulates the completions API's ``{tokens, token_logprobs, top_logprobs, text_offset}``.

    ``top_logprobs`` holds the ``logprobs`` most likely tokens and always the chosen one (as
    OpenAI's, up to ``logprobs`` + 1 entries). ``text_offset`` is each token's start in the
    choice's text, in characters: the length of what the tokens before it decode to, through
    the same streaming UTF-8 decoder as the text (a token holding part of a character adds
    nothing until the token that completes it; ``tokens`` shows such a token as
    ``bytes:\\x..``, whose length is no position in the text). ``typed``: echoed prompt
    positions whose hidden special token the prompt text spells out (:func:`echo_offsets`):
    those show as that spelling and span it, as the echoed text does; other hidden special
    tokens (a BOS the tokenizer added, an EOS generated) show by their spelling too
    (:meth:`TokenTable.token_text`) but span nothing: the text leaves them out. The first
    ``prompt_items`` items are the echoed prompt's, whose text is ``prompt_length`` characters
    long: their starts are ``prompt_starts`` where given (:func:`echo_offsets`: counting would
    drift where the tokenizer dropped characters of the text), and the generated tokens after
    them start at ``prompt_length``, counted through a fresh decoder as the engine decodes
    them (a prompt ending inside a character does not shift them)."""

    def __init__(self, table, typed: dict[int, str] | None = None, prompt_items: int = 0,
                 prompt_starts: list[int] | None = None, prompt_length: int = 0):
        self.table = table
        self.offset = 0  # the next token's start in the choice's text
        self.typed = typed or {}
        self.prompt_items = prompt_items
        self.prompt_starts = prompt_starts if prompt_starts is not None and len(prompt_starts) == prompt_items else None
        self.prompt_length = prompt_length
        self._index = 0  # items rendered so far (the echoed prompt's come first)
        self._detok = StreamingDetokenizer(table)

    def render(self, items: list[TokenLogprob]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for item in items:
            spelled = self.typed.get(self._index)
            self._index += 1
            text = spelled if spelled is not None else self.table.token_text(item.token)
            out["tokens"].append(text)
            out["token_logprobs"].append(item.logprob)
            top = None
            if item.logprob is not None:
                # (as OpenAI's: the chosen token is always in it, so up to logprobs + 1 entries)
                top = {text if t == item.token else self.table.token_text(t): lp for t, lp in item.top}
                top.setdefault(text, item.logprob)
            out["top_logprobs"].append(top)
            index = self._index - 1
            if index < self.prompt_items and self.prompt_starts is not None:  # (a start known from the text)
                out["text_offset"].append(self.prompt_starts[index])
            else:
                out["text_offset"].append(self.offset)
                self.offset += len(spelled) if spelled is not None else len(self._detok.add(item.token))
            if index == self.prompt_items - 1:
                # the generated text comes after the whole echo, decoded afresh (as the engine does)
                self.offset = self.prompt_length
                self._detok = StreamingDetokenizer(self.table)
        return out


def legacy_logprobs(table, job: Job) -> LegacyLogprobs:
    """The renderer of one completion choice's logprobs (its echo's offsets included)."""
    echoed = job.prompt_text is not None and job.request.prompt_logprobs
    return LegacyLogprobs(table, typed=job.typed_specials, prompt_items=len(job.request.prompt_tokens) if echoed else 0,
                          prompt_starts=job.prompt_starts, prompt_length=len(job.prompt_text or ""))


def chat_logprobs(table, items: list[TokenLogprob]) -> list[dict]:
    """Chat ``logprobs.content``. A hidden special token shows by its spelling with ``bytes``
    null (:meth:`TokenTable.token_raw`), so that joining the entries' bytes still gives the
    message's text."""
    def entry(token, logprob):
        raw = table.token_raw(token)
        return {"token": table.token_text(token), "logprob": logprob, "bytes": None if raw is None else list(raw)}

    return [
        {**entry(item.token, item.logprob), "top_logprobs": [entry(t, lp) for t, lp in item.top]}
        for item in items
    ]


async def _logged(request: Request, rid: str, jobs: list[Job], chunks: AsyncIterator[str]):
    """Pass a stream's chunks through; log the request when it ends (finished or disconnected)."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        await chunks.aclose()
        log_request(request, rid, jobs)


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


# ---- endpoints ------------------------------------------------------------------------------


async def _run(request: Request, body, jobs: list[Job], rid: str, model: str, stream_fn):
    """Submit ``jobs``; stream them (returns the response) or run them to the end (returns None).

    Returns ``(streaming response or None, created, token table)``.
    """
    # (before compiling grammars for a request that cannot run)
    check_capacity(request, jobs, "n" if body.n > 1 else "prompt")
    await prepare_grammars(request, jobs)
    streams = submit_all(request, jobs)
    created = int(time.time())
    table = _state(request).engine.loaded.token_table
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = stream_fn(request, jobs, streams, rid, model, created, table, include_usage)
        return StreamingResponse(
            _logged(request, rid, jobs, chunks),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        ), created, table
    try:
        await collect(request, jobs, streams)
    finally:
        log_request(request, rid, jobs)
    err = first_error(jobs)
    if err is not None:
        raise err
    return None, created, table


@router.post("/v1/completions")
async def completions(request: Request, body: CompletionRequest):
    request.state.started = time.perf_counter()
    model = check_model(request, body.model)
    check_ready(request)
    rid = f"cmpl-{uuid.uuid4().hex}"
    # (tokenizing runs off the event loop: a megabyte of prompt takes a second, which would stall
    # every other connection, /health and running streams included)
    jobs = await asyncio.to_thread(completion_jobs, request, body, rid)
    response, created, table = await _run(request, body, jobs, rid, model, stream_completions)
    if response is not None:
        return response
    choices = []
    for job in jobs:
        text = "".join(e.text for e in job.events)
        lp = None
        if job.request.logprobs is not None:
            items = [x for e in job.events for x in (e.prompt_logprobs or [])]
            items += [x for e in job.events for x in (e.logprobs or [])]
            lp = legacy_logprobs(table, job).render(items)
        if job.prompt_text is not None:
            text = job.prompt_text + text
        choices.append({"index": job.index, "text": text, "logprobs": lp,
                        "finish_reason": finish_reason(job.events[-1] if job.events else None)})
    return JSONResponse({
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "system_fingerprint": _state(request).fingerprint,
        "choices": choices, "usage": usage(jobs), "speculative_decoding": spec_summary(jobs),
    })


async def stream_completions(request, jobs, streams, rid, model, created, table, include_usage):
    base = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": _state(request).fingerprint}
    logs = {job.index: legacy_logprobs(table, job) for job in jobs}
    echoed = set()
    async with contextlib.aclosing(merged(request, jobs, streams)) as events:
        async for job, event in events:
            job.events.append(event)
            if event.error is not None:
                err = _name_grammar_field(job, event.error)
                yield _sse(error_body(str(err), err.type, err.param, err.code))
                break  # (the stream's last event: leaving cancels the other choices)
            text = event.text
            items = list(event.logprobs or [])
            if job.index not in echoed and job.prompt_text is not None:
                echoed.add(job.index)
                text = job.prompt_text + text
                items = list(event.prompt_logprobs or []) + items
            reason = finish_reason(event)
            if not text and not items and reason is None:
                continue
            lp = logs[job.index].render(items) if job.request.logprobs is not None else None
            yield _sse({**base, "choices": [{"index": job.index, "text": text, "logprobs": lp,
                                             "finish_reason": reason}], "usage": None})
    if include_usage and first_error(jobs) is None:
        yield _sse({**base, "choices": [], "usage": usage(jobs), "speculative_decoding": spec_summary(jobs)})
    yield _sse("[DONE]")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest):
    request.state.started = time.perf_counter()
    model = check_model(request, body.model)
    check_ready(request)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    jobs = await asyncio.to_thread(chat_jobs, request, body, rid)  # (the template, off the event loop)
    response, created, table = await _run(request, body, jobs, rid, model, stream_chat)
    if response is not None:
        return response
    choices = []
    for job in jobs:
        lp = None
        if job.request.logprobs is not None:
            lp = {"content": chat_logprobs(table, [x for e in job.events for x in (e.logprobs or [])])}
        message = {"role": "assistant", "content": "".join(e.text for e in job.events)}
        reason = finish_reason(job.events[-1] if job.events else None)
        if job.tool_format is not None:
            message["content"], calls = split_tool_calls(job.tool_format, message["content"], job.tools,
                                                         job.max_tool_calls)
            if calls:
                message["tool_calls"] = calls
                reason = "tool_calls" if reason == "stop" else reason
        choices.append({"index": job.index, "message": message, "logprobs": lp, "finish_reason": reason})
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": _state(request).fingerprint,
        "choices": choices, "usage": usage(jobs), "speculative_decoding": spec_summary(jobs),
    })


async def stream_chat(request, jobs, streams, rid, model, created, table, include_usage):
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": _state(request).fingerprint}
    splitters = {job.index: job.tool_splitter() for job in jobs}
    for job in jobs:
        yield _sse({**base, "choices": [{"index": job.index, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}], "usage": None})
    async with contextlib.aclosing(merged(request, jobs, streams)) as events:
        async for job, event in events:
            job.events.append(event)
            if event.error is not None:
                err = _name_grammar_field(job, event.error)
                yield _sse(error_body(str(err), err.type, err.param, err.code))
                break  # (the stream's last event: leaving cancels the other choices)
            reason = finish_reason(event)
            text, delta = event.text, {}
            splitter = splitters[job.index]
            if splitter is not None:  # content outside tool-call blocks; each call once its block ends
                first = len(splitter.calls)
                text, calls = splitter.feed(text)
                if reason is not None:
                    tail, last_calls = splitter.finish()
                    text, calls = text + tail, calls + last_calls
                    reason = "tool_calls" if reason == "stop" and splitter.calls else reason
                if calls:
                    delta["tool_calls"] = [{"index": first + k, **call} for k, call in enumerate(calls)]
            if not text and not delta and reason is None and not event.logprobs:
                continue
            lp = None
            if job.request.logprobs is not None:
                lp = {"content": chat_logprobs(table, event.logprobs or [])}
            if text:
                delta = {"content": text, **delta}
            yield _sse({**base, "choices": [{"index": job.index, "delta": delta, "logprobs": lp,
                                             "finish_reason": reason}], "usage": None})
    if include_usage and first_error(jobs) is None:
        yield _sse({**base, "choices": [], "usage": usage(jobs), "speculative_decoding": spec_summary(jobs)})
    yield _sse("[DONE]")
