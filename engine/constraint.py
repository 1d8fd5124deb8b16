"""Structured output: a grammar (JSON schema, regex, Lark) as a token mask on every verify row.

The grammar engine is llguidance (https://github.com/guidance-ai/llguidance, the one vLLM,
SGLang and llama.cpp use): a matcher over the request's output tokens that computes, for the
next position, the bitmask of tokens the grammar allows (~25 us on a 49k vocabulary), and rolls
back consumed tokens.

Speculative decoding stays exact: row ``r`` of a verify pass predicts the token after
``committed + draft[:r]``, so its mask is the one the matcher gives after consuming
``draft[:r]`` on top of the committed output, which is the mask a one-token decode step at that
position computes. Drafts are consumed tentatively and rolled back after the masks are read;
only committed tokens stay consumed. The output ends (``finish_reason: stop``) with the token
that completes the grammar, as it would with the EOS that is then the only allowed token, so
``ignore_eos`` cannot run a request past its grammar. A draft token the grammar forbids is never accepted (its
row gives it probability 0), so drafters' proposals are cut before the first such token: the
rows after it could not be reached anyway.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

log = logging.getLogger("specserve.constraint")
_TOKENIZERS: dict[int, object] = {}
_LOCK = threading.Lock()


class GrammarError(ValueError):
    """A grammar or schema llguidance cannot compile (the message is llguidance's)."""


def json_grammar(schema: dict | None = None) -> str:
    """The llguidance grammar for JSON values matching ``schema`` (JSON Schema as a dict; None:
    any JSON object, OpenAI's ``json_object`` mode). Separators are llguidance's defaults
    (``", "`` and ``": "``, no other whitespace), which keeps small models from looping on
    newlines. Raises GrammarError for a schema it cannot compile."""
    from llguidance import LLMatcher

    try:
        return LLMatcher.grammar_from_json_schema({"type": "object"} if schema is None else schema,
                                                  defaults={"whitespace_flexible": False})
    except (ValueError, TypeError, RuntimeError) as exc:
        raise GrammarError(str(exc)) from None


def regex_grammar(pattern: str) -> str:
    """The llguidance grammar for text matching the regular expression ``pattern``."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_regex(pattern)


def choice_grammar(choices: Sequence[str]) -> str:
    """The grammar for exactly one of ``choices`` (vLLM's ``guided_choice``)."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def tool_call_grammar(tokenizer, ll_tok, start: str, end: str, call_schemas: Sequence[dict],
                      parallel: bool = True) -> str:
    """The grammar of a reply that is only tool calls in the JSON-block format
    (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, mlx-lm's ``json_tools``):
    one block, or with ``parallel`` one or more separated by newlines, each holding a JSON
    object valid under one of ``call_schemas``. A marker that is one special token is matched
    as that token (llguidance's ``<[id]>``), else as text. For ``tool_choice`` ``required`` or a
    named function (OpenAI), as vLLM forces them."""
    def marker(text: str) -> str:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and ll_tok.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    schema = call_schemas[0] if len(call_schemas) == 1 else {"anyOf": list(call_schemas)}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_lark("\n".join([
        'start: block ("\\n" block)*' if parallel else "start: block",
        f'block: {marker(start)} "\\n"? call "\\n"? {marker(end)}',
        f"call: %json {json.dumps(schema)}",
    ]))


def ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids) -> object:
    """llguidance's view of a Hugging Face fast tokenizer (an mlx-lm wrapper is unwrapped),
    built once per tokenizer (about 0.3 s for 49k tokens). ``vocab_size``: the width of the
    model's logits rows, which may exceed the tokenizer's."""
    import llguidance.hf

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    with _LOCK:
        if id(hf) not in _TOKENIZERS:
            _TOKENIZERS[id(hf)] = (hf, llguidance.hf.from_tokenizer(
                hf, n_vocab=vocab_size, eos_token=sorted(eos_token_ids)))
        return _TOKENIZERS[id(hf)][1]


def check_grammar(grammar: str, tokenizer) -> None:
    """Raise GrammarError when ``grammar`` does not compile against ``tokenizer``."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise GrammarError(error)


class GrammarConstraint:
    """One request's grammar state over its output tokens.

    Args:
        grammar: an llguidance grammar (``json_grammar`` and friends).
        tokenizer: from :func:`ll_tokenizer`.
        vocab_size: width ``V`` of the logits rows.

    Raises:
        GrammarError: the grammar does not compile.
    """

    def __init__(self, grammar: str, tokenizer, vocab_size: int):
        from llguidance import LLMatcher

        self.matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self.vocab_size = vocab_size
        self.consumed = 0  # output tokens consumed (committed)

    def valid_prefix(self, draft: Sequence[int]) -> int:
        """How many leading tokens of ``draft`` the grammar allows after the committed output."""
        return self.matcher.validate_tokens(list(draft)) if draft else 0

    def masks(self, draft: Sequence[int]) -> mx.array:
        """Allowed tokens per verify row: ``[len(draft) + 1, V]`` bool; row ``r`` after
        ``committed + draft[:r]``. Rows after a draft token the grammar forbids (never reached:
        that token is rejected) repeat the last reachable row's mask."""
        n = self.valid_prefix(draft)
        words = (self.vocab_size + 31) // 32
        bits = np.zeros((len(draft) + 1, words * 4), dtype=np.uint8)
        for r in range(n + 1):
            if r:
                self.matcher.consume_token(draft[r - 1])
            bits[r] = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)[: words * 4]
        if n:
            self.matcher.rollback(n)
        bits[n + 1:] = bits[n]
        allowed = np.unpackbits(bits, axis=-1, bitorder="little")[:, : self.vocab_size]
        return mx.array(allowed.astype(np.bool_))

    def commit(self, token: int) -> None:
        """Consume one committed output token (chosen under this grammar's mask)."""
        if not self.matcher.consume_token(token):
            log.warning("grammar rejected committed token %d: %s", token, self.matcher.get_error())
        self.consumed += 1

    @property
    def done(self) -> bool:
        """The grammar is complete (only EOS could follow) or failed: the output ends here."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    def apply(self, logits: mx.array, draft: Sequence[int]) -> mx.array:
        """``[R, V]`` logits with the tokens each row's grammar state forbids set to -inf."""
        return mx.where(self.masks(draft), logits, -mx.inf)
