"""OpenAI request schemas (pydantic). All field validation lives here.

Unknown fields are accepted and ignored, as OpenAI-compatible servers commonly do, so clients
that send newer fields keep working. Known fields are strictly typed: ``"3"`` or ``true`` for an
integer, or ``"yes"`` for a boolean, is a 400, not coerced (an integer is fine for a float). Extensions: ``speculative``, ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``cache_salt`` (vLLM's: only
requests with the same salt share prefix-cache entries). Chat takes OpenAI's ``tools``,
``tool_choice`` and ``parallel_tool_calls`` (server/tools.py).
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

SpecMethod = Literal["auto", "prompt_lookup", "dspark", "off"]
_SURROGATE = re.compile("[\ud800-\udfff]")


_NOT_UNICODE = "strings must be valid Unicode (found a lone surrogate escape)"


def invalid_value(value, path: str = "") -> tuple[str, str] | None:
    """Where decoded JSON holds a value that is not JSON text, and what: a string with a lone
    surrogate (JSON allows ``"\\ud800"``; such a string is not Unicode text and cannot be
    tokenized or encoded as UTF-8), or NaN / +-Infinity (Python's JSON parser reads them; inside
    a schema they would turn into ``null``). Returns ``(path, message)`` for the first one, else
    None."""
    if isinstance(value, str):
        return (path, _NOT_UNICODE) if _SURROGATE.search(value) else None
    if isinstance(value, float):
        return None if math.isfinite(value) else (path or "body", f"{value} is not a finite number")
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        if all(type(x) is int for x in value):  # (token ids: a million take 0.04 s, not 0.4)
            return None
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        here = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and _SURROGATE.search(key):
            return path or "body", _NOT_UNICODE
        found = invalid_value(item, here)
        if found is not None:
            return found
    return None


class ParamError(ValueError):
    """A check that spans several fields, naming the field the error response's ``param`` should
    point at (relative to the model that raised it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class _Part(BaseModel):
    """A nested OpenAI object: unknown fields ignored, as at the top level."""

    model_config = ConfigDict(extra="ignore")


class SpeculativeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: SpecMethod | None = None
    max_draft_tokens: Annotated[int, Field(strict=True, ge=0, le=64)] | None = None
    min_draft_tokens: Annotated[int, Field(strict=True, ge=0, le=64)] = 0

    @model_validator(mode="after")
    def _order(self):
        if self.max_draft_tokens is not None and self.min_draft_tokens > self.max_draft_tokens:
            raise ParamError("min_draft_tokens", "min_draft_tokens must not exceed max_draft_tokens")
        return self


class StreamOptions(_Part):
    include_usage: StrictBool = False


class JsonSchemaFormat(_Part):
    name: Annotated[str, Field(min_length=1, max_length=256)] = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Part):
    """OpenAI's ``response_format``: ``text``, ``json_object`` (any JSON object) or
    ``json_schema`` (``{"json_schema": {"name", "schema", "strict"}}``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ParamError("json_schema", "type json_schema needs a json_schema object")
        if self.type == "json_schema" and self.json_schema.schema_ is None:
            raise ParamError("json_schema.schema", "json_schema needs a schema (for any JSON object use "
                             '{"type": "json_object"})')
        return self


class StructuredOutputs(_Part):
    """vLLM's ``structured_outputs`` (extension): exactly one of ``json`` (a JSON schema),
    ``regex`` or ``choice``."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | None = Field(default=None, alias="json")
    regex: Annotated[str, Field(min_length=1, max_length=10_000)] | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1024)] | None = None

    @model_validator(mode="after")
    def _one(self):
        given = [k for k, v in (("json", self.json_), ("regex", self.regex), ("choice", self.choice)) if v is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex or choice")
        return self


class _JsonText(BaseModel):
    """A request body that is JSON text: Unicode strings (no lone surrogate escapes) and finite
    numbers (no NaN or Infinity), anywhere in it (:func:`invalid_value`)."""

    @model_validator(mode="before")
    @classmethod
    def _json_text(cls, data):
        found = invalid_value(data)
        if found is not None:  # (param: the field holding it)
            raise ParamError(*found)
        return data


class SamplingFields(_JsonText):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # (NaN and +-Infinity, which Python's JSON parser reads, fail in _JsonText, before any bound)
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: Annotated[float, Field(strict=True, ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(strict=True, gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(strict=True, ge=-1, le=1_000_000)] | None = None
    min_p: Annotated[float, Field(strict=True, ge=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(strict=True, ge=1)] = 1  # (at most SPECSERVE_MAX_N: one message for it)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    presence_penalty: Annotated[float, Field(strict=True, ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(strict=True, ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(strict=True, gt=0.0, le=10.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(strict=True, ge=-100.0, le=100.0)]] | None = None
    seed: Annotated[int, Field(strict=True, ge=-(2**63), le=2**64 - 1)] | None = None
    user: str | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: list[Annotated[int, Field(strict=True, ge=0)]] | None = None
    speculative: SpeculativeOptions | None = None
    response_format: ResponseFormat | None = None  # (an extension on /v1/completions, as in vLLM)
    structured_outputs: StructuredOutputs | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, str):
            v = [v]
        if v is not None and any(len(s) > 1000 for s in v):
            raise ValueError("each stop string must be at most 1000 characters")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is None:
            return v
        if len(v) > 1024:
            raise ValueError("logit_bias may hold at most 1024 entries")
        seen = {}
        for key in v:  # (int() would also take " 300", "+300", "3_00" and non-ASCII digits)
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids (decimal digits), got {key!r}")
            token = int(key)
            if token in seen:
                raise ValueError(f"logit_bias names token {token} twice ({seen[token]!r} and {key!r})")
            seen[token] = key
        return v

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed when stream is true")
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise ParamError("structured_outputs", "give response_format or structured_outputs, not both")
        return self


TokenList = Annotated[list[Annotated[int, Field(strict=True, ge=0)]], Field(min_length=1)]
PromptType = str | Annotated[list[str], Field(min_length=1)] | TokenList | Annotated[list[TokenList], Field(min_length=1)]


_PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


def _check_prompt(value):
    """One clear message for a malformed ``prompt`` (pydantic's union would list a failure per
    branch), naming the offending element; valid values pass unchanged."""

    def token_list(items, where: str) -> None:
        if not items:
            raise ParamError(where, "a token list must not be empty")
        for i, t in enumerate(items):
            if not isinstance(t, int) or isinstance(t, bool):
                raise ParamError(f"{where}.{i}" if where else str(i),
                                 f"token ids must be integers, got {type(t).__name__} {t!r:.40}")
            if t < 0:
                raise ParamError(f"{where}.{i}" if where else str(i), f"token ids must be non-negative, got {t}")

    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f"prompt must be {_PROMPT_SHAPES}, got {type(value).__name__}")
    if not value:
        raise ValueError("prompt must not be an empty list")
    if all(isinstance(x, str) for x in value):
        return value
    if all(isinstance(x, list) for x in value):
        for i, item in enumerate(value):
            token_list(item, str(i))
        return value
    if isinstance(value[0], (str, list)):
        kind = "strings" if isinstance(value[0], str) else "token-id lists"
        bad = next(i for i, x in enumerate(value) if not isinstance(x, type(value[0])))
        raise ParamError(str(bad), f"prompt mixes {kind} with {type(value[bad]).__name__}: must be {_PROMPT_SHAPES}")
    token_list(value, "")
    return value


class CompletionRequest(SamplingFields):
    prompt: PromptType
    max_tokens: Annotated[int, Field(strict=True, ge=0)] | None = None
    logprobs: Annotated[int, Field(strict=True, ge=0, le=5)] | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(strict=True, ge=1)] | None = None

    _prompt = field_validator("prompt", mode="before")(classmethod(lambda cls, v: _check_prompt(v)))

    @model_validator(mode="after")
    def _unsupported(self):
        if self.suffix:
            raise ParamError("suffix", "suffix (insert mode) is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError("best_of", "best_of other than n is not supported")
        return self


class TextPart(_Part):
    type: Literal["text"]
    text: str


class FunctionCall(_Part):
    name: Annotated[str, Field(min_length=1)]
    # OpenAI's shape is a JSON object serialized as a string; an object is taken too (as
    # Ollama's clients send it), and a string that is no JSON object reaches the template as is
    arguments: str | dict[str, Any] = "{}"

    def arguments_for_template(self) -> dict | str:
        """The arguments as chat templates serialize them: an object where there is one."""
        if isinstance(self.arguments, dict):
            return self.arguments
        try:
            value = json.loads(self.arguments or "{}")
        except (ValueError, RecursionError):
            return self.arguments
        # (an escaped lone surrogate decodes to text no tokenizer takes, and NaN is no JSON: keep the string)
        return value if isinstance(value, dict) and invalid_value(value) is None else self.arguments


class ToolCall(_Part):
    """An assistant message's earlier tool call (as OpenAI returned it)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Part):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this result answers
    refusal: str | None = None  # assistant messages (the openai SDK sends a refusal back as it came)

    @model_validator(mode="after")
    def _content(self):  # (as OpenAI's: only an assistant message's calls or refusal stand in for it)
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.refusal is not None)):
            what = "an assistant message without tool_calls" if self.role == "assistant" else f"a {self.role} message"
            raise ParamError("content", f"{what} needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict:
        """The message as Hugging Face chat templates read it: ``developer`` as ``system``,
        content as text, tool-call arguments as objects (templates serialize them)."""
        out: dict = {"role": self.role if self.role != "developer" else "system", "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments_for_template()}}
                for c in self.tool_calls]
        if self.role == "tool":
            if self.tool_call_id is not None:
                out["tool_call_id"] = self.tool_call_id
            if self.name is not None:
                out["name"] = self.name
        return out


class FunctionDefinition(_Part):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v):  # (as OpenAI's: a call's arguments are a JSON object)
        if v is not None and v.get("type", "object") != "object":
            raise ValueError(f'parameters must be a JSON Schema of type "object", got type {v.get("type")!r}')
        return v


class Tool(_Part):
    type: Literal["function"]
    function: FunctionDefinition

    def for_template(self) -> dict:
        """OpenAI's tool dict, ``parameters`` defaulting to an empty object schema (templates
        and parsers index it)."""
        out = self.model_dump(exclude_none=True)
        out["function"].setdefault("parameters", {"type": "object", "properties": {}})
        return out


class NamedFunction(_Part):
    name: str


class NamedToolChoice(_Part):
    type: Literal["function"]
    function: NamedFunction


class ToolFields(BaseModel):
    """OpenAI's ``tools`` and ``tool_choice``, shared by chat completions and ``/tokenize``."""

    tools: Annotated[list[Tool], Field(max_length=512)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v):  # (one message instead of one per branch of the union)
        if v is None or v in ("none", "auto", "required"):
            return v
        if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict) \
                and isinstance(v["function"].get("name"), str):
            return v
        raise ValueError('tool_choice must be "none", "auto", "required" or '
                         '{"type": "function", "function": {"name": ...}}')

    @model_validator(mode="after")
    def _tool_checks(self):
        forced = self.forced_tools()
        if forced is not None:
            if not self.tools:
                choice = "'required'" if self.tool_choice == "required" else \
                    f"naming function {self.tool_choice.function.name!r}"
                raise ParamError("tool_choice", f"tool_choice {choice} needs tools")
            if not forced:
                raise ParamError("tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, "
                                 "which is not among the tools")
        if self.tools:
            names = [t.function.name for t in self.tools]
            if len(set(names)) != len(names):
                raise ParamError("tools", "tool names must be unique")
        return self

    def forced_tools(self) -> list[Tool] | None:
        """The tools one of which the reply must call (``tool_choice`` ``required``: any; a
        named function: that one), or None when the model may answer in text."""
        if self.tool_choice == "required":
            return list(self.tools or [])
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in self.tools or [] if t.function.name == self.tool_choice.function.name]
        return None

    def uses_tools(self) -> bool:
        """Whether the tools go into the prompt and calls are parsed from the output."""
        return bool(self.tools) and self.tool_choice != "none"


class ChatCompletionRequest(SamplingFields, ToolFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=20)] | None = None
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="after")
    def _checks(self):
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs to be true")
        return self


class TokenizeRequest(_JsonText, ToolFields):
    """``POST /tokenize`` (vLLM's extension): the token ids the server would run for a completion
    ``prompt`` (a string, as ``/v1/completions`` encodes it) or for chat ``messages`` (with
    ``tools`` unless ``tool_choice`` is ``"none"``) through the model's chat template, as
    ``/v1/chat/completions`` builds its prompt."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: StrictBool = True  # messages: end with the assistant turn's header
    add_special_tokens: StrictBool | None = None  # prompt: the tokenizer's BOS etc. (default true)
    continue_final_message: StrictBool = False
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _one_input(self):
        if self.prompt is None and self.messages is None:
            raise ParamError("prompt", "prompt (a string) or messages is required")
        if self.prompt is not None and self.messages is not None:
            raise ParamError("prompt", "give either prompt or messages, not both")
        if self.messages is None and (self.tools is not None or self.tool_choice is not None):
            raise ParamError("tools" if self.tools is not None else "tool_choice", "tools go with messages")
        if self.messages is not None and self.add_special_tokens:  # (chat prompts are the template's alone)
            raise ParamError("add_special_tokens", "add_special_tokens goes with prompt; chat completions "
                             "add no special tokens beyond the chat template's")
        if self.continue_final_message:
            raise ParamError("continue_final_message", "continue_final_message is not supported (chat "
                             "completions always start a new assistant turn)")
        return self


class DetokenizeRequest(_JsonText):
    """``POST /detokenize`` (vLLM's extension): the text of ``tokens``, special tokens spelled out."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(strict=True, ge=0)]], Field(max_length=1_000_000)]
