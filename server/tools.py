"""Tool calls in chat completions: find them in the generated text and render OpenAI's shapes.

The model's tool-call format (its markers and the parser of what lies between them) is mlx-lm's
(``mlx_lm.tool_parsers``, chosen from the chat template by ``engine.loader.tokenizer_wrapper``
as ``mlx_lm.tokenizer_utils.load`` does; e.g. Qwen2.5/Hermes-style
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``). This module splits the text
stream into assistant content and tool-call blocks as tokens arrive, holding back only what
could still be the start of a marker, so a streamed response and a whole one agree: the
content deltas add up to the whole response's ``content`` and the tool calls are the same.
Nothing generated is dropped: a block the parser rejects, or one that ``max_tokens`` cut off
before its end marker, is returned as content, markers included. In a format without an end
marker (Mistral's ``[TOOL_CALLS]``) a block runs to the next start marker or to the end of the
output, so a call that ``max_tokens`` cut short leaves the calls before it intact.
"""

from __future__ import annotations

import json
import logging
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.tool_grammar import ToolCallStyle, parser_module, tool_call_style

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolFormat:
    """A model's tool-call markers and the parser of one block's text (mlx-lm's).

    ``parse(text, tools)`` gets the text between the markers and the request's tools as OpenAI
    dicts, and returns ``{"name": str, "arguments": dict | str, "id"?: str}`` or a list of
    them. It is third-party code fed model output, so any exception it raises means "not a
    call". ``end`` is empty for formats whose block runs to the next start marker or the end
    of the output (Mistral's).
    ``short_ids``: call ids of 9 letters and digits (Mistral's templates refuse others in the
    history), else ``call_`` and 24 hex digits. ``style``: the call syntax a grammar can force
    (``engine.tool_grammar.ToolCallStyle``), None for formats calls cannot be forced in.
    """

    start: str
    end: str
    parse: Callable[[str, Any], Any]
    short_ids: bool = False
    style: ToolCallStyle | None = None

    @classmethod
    def of(cls, tokenizer) -> ToolFormat | None:
        """The format of an mlx-lm ``TokenizerWrapper``, or None when its template has none."""
        if not getattr(tokenizer, "has_tool_calling", False):
            return None
        parser = tokenizer.tool_parser
        return cls(tokenizer.tool_call_start, tokenizer.tool_call_end or "", parser,
                   short_ids=parser_module(parser) == "mistral",
                   style=tool_call_style(parser, getattr(tokenizer, "chat_template", None)))


@dataclass
class ToolCallSplitter:
    """Incremental split of generated text into content and tool calls.

    ``feed(text)`` returns ``(content, calls)``: the content that is now certain (text outside
    tool-call blocks, less a tail that may begin a start marker) and the tool calls whose end
    marker arrived, rendered as OpenAI ``tool_calls`` entries (``id``, ``type``, ``function``
    with ``name`` and ``arguments`` as a JSON string). ``finish()`` returns what is left.

    Whitespace at the end of the content so far waits for what follows: it is released when
    more content comes and at the end when no call was made, and dropped at the end after calls
    (the newlines models put around blocks). ``max_calls`` (1 for ``parallel_tool_calls:
    false``) keeps the first calls and drops later ones.
    """

    fmt: ToolFormat
    tools: list[dict] | None = None
    max_calls: int | None = None
    calls: list[dict] = field(default_factory=list)  # every call rendered so far
    _buffer: str = ""  # outside a block: text not yet released; inside: the block so far
    _inside: bool = False
    _pending: str = ""  # whitespace after the content released so far

    def feed(self, text: str) -> tuple[str, list[dict]]:
        out: list[str] = []
        new_calls: list[dict] = []
        self._buffer += text
        while True:
            if self._inside:
                # a block ends at its end marker (consumed); without one, at the next start marker
                # (kept: it opens the next block) or at finish()
                end = self._buffer.find(self.fmt.end or self.fmt.start)
                if end < 0:
                    break
                block, self._buffer = self._buffer[:end], self._buffer[end + len(self.fmt.end):]
                self._inside = False
                parsed = self._parse(block)
                if parsed is None:  # not a call after all: it stays in the text
                    out.append(self.fmt.start + block + self.fmt.end)
                else:
                    new_calls += parsed
                continue
            start = self._buffer.find(self.fmt.start)
            if start < 0:
                keep = _marker_prefix_len(self._buffer, self.fmt.start)
                out.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            out.append(self._buffer[:start])
            self._buffer = self._buffer[start + len(self.fmt.start):]
            self._inside = True
        return self._content("".join(out)), new_calls

    def finish(self) -> tuple[str, list[dict]]:
        """Release the held-back tail and the calls of a block that ends with the output (a
        format without an end marker); an unterminated block is returned as content."""
        calls: list[dict] = []
        rest = self._buffer
        if self._inside:
            parsed = self._parse(rest) if not self.fmt.end else None
            if parsed is None:
                rest = self.fmt.start + rest
            else:
                calls, rest = parsed, ""
        self._buffer, self._inside = "", False
        content = self._content(rest)
        if not self.calls:
            content += self._pending
        self._pending = ""
        return content, calls

    def _content(self, text: str) -> str:
        """Content to release now: trailing whitespace waits for what follows it."""
        if not text:
            return ""
        text = self._pending + text
        body = text.rstrip()
        self._pending = text[len(body):]
        return body

    def _parse(self, block: str) -> list[dict] | None:
        try:
            parsed = self.fmt.parse(block, self.tools)
            items = parsed if isinstance(parsed, list) else [parsed]
            if not items:
                raise ValueError("no call in the block")
            rendered = [_render(item, self.fmt.short_ids) for item in items]
        except Exception as exc:  # noqa: BLE001 (a parser's failure on model output: the block is text)
            log.warning("tool call not parsed (%s: %.200s); returned as content", type(exc).__name__, exc)
            return None
        kept = rendered
        if self.max_calls is not None:
            kept = rendered[: max(0, self.max_calls - len(self.calls))]
        self.calls += kept
        return kept


_ALNUM = string.ascii_letters + string.digits


def _render(item: Any, short_ids: bool = False) -> dict:
    """One parsed call as an OpenAI ``tool_calls`` entry. Raises ValueError unless it has a
    name and its arguments are a JSON object (``parameters`` is taken for ``arguments``, as
    Llama-style models write it); a parser's own id is kept."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        raise ValueError(f"a tool call needs a name, got {item!r:.80}")
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = json.loads(arguments or "{}")
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call arguments must be a JSON object, got {type(arguments).__name__}")
    call_id = item.get("id")
    if not isinstance(call_id, str) or not call_id:
        call_id = ("".join(secrets.choice(_ALNUM) for _ in range(9)) if short_ids
                   else f"call_{uuid.uuid4().hex[:24]}")
    return {"id": call_id, "type": "function",
            "function": {"name": item["name"], "arguments": json.dumps(arguments, ensure_ascii=False,
                                                                       allow_nan=False)}}


def _marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split_tool_calls(fmt: ToolFormat, text: str, tools: list[dict] | None = None,
                     max_calls: int | None = None) -> tuple[str | None, list[dict]]:
    """A whole response's ``(content, tool_calls)``: content None when calls hold everything."""
    splitter = ToolCallSplitter(fmt, tools, max_calls)
    head, _ = splitter.feed(text)
    tail, _ = splitter.finish()
    content = head + tail
    return (content or None) if splitter.calls else content, splitter.calls
