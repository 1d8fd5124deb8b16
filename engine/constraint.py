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
import time
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from .request import InvalidRequestError

log = logging.getLogger("specserve.constraint")


MAX_MASK_SECONDS = 0.1  # CPU seconds: a mask step slower than this ends the request (400), not every other


class GrammarError(InvalidRequestError):
    """A grammar or schema llguidance cannot compile or enforce: the request's fault (HTTP
    400, ``param`` ``response_format``; the server names the field that asked for it). The
    message is llguidance's, cut to 500 characters."""

    def __init__(self, message: str):
        super().__init__(message if len(message) <= 500 else message[:500] + " ...", param="response_format",
                         code="invalid_output_format")


def _limits():
    from llguidance import LLParserLimits

    return LLParserLimits(verbose_errors=False)  # (verbose errors dump the parser state and the grammar)


def closed_schema(schema):
    """``schema`` with ``additionalProperties: false`` on every object schema that does not
    set it (OpenAI's strict mode: objects hold their listed properties only; JSON Schema's
    default lets a model invent keys until ``max_tokens``). Returns a new schema."""
    if isinstance(schema, list):
        return [closed_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = map_subschemas(schema, closed_schema)
    is_object = schema.get("type") == "object" or (isinstance(schema.get("type"), list) and "object" in schema["type"]) \
        or "properties" in schema
    if is_object and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = {"items", "prefixItems", "additionalItems", "contains", "anyOf", "oneOf", "allOf", "not",
               "if", "then", "else", "additionalProperties", "propertyNames", "unevaluatedProperties",
               "unevaluatedItems"}  # keywords holding a schema or a list of schemas
_SUBSCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}  # name -> schema


def map_subschemas(schema: dict, fn) -> dict:
    """A copy of the JSON Schema ``schema`` with ``fn`` applied to each of its direct
    subschemas (the values of the keywords that hold schemas, lists of them, or maps of names
    to them); other keywords are copied as they are."""
    out = dict(schema)
    for key, value in schema.items():
        if key in _SUBSCHEMAS:
            out[key] = [fn(v) for v in value] if isinstance(value, list) else fn(value)
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: fn(sub) for name, sub in value.items()}
    return out


_EXACT = 2**53  # integers up to this magnitude are exact as 64-bit floats
_I64 = 2**63


def _at_least(value, limit: int) -> bool:
    """``|value| >= limit`` for a JSON number (an int compared exactly: no float overflow)."""
    return abs(value) >= (limit if isinstance(value, int) else float(limit))


def check_schema_numbers(schema) -> None:
    """Refuse (GrammarError) the numbers in a JSON Schema that llguidance cannot enforce.

    llguidance 1.x handles a schema's numbers as 64-bit floats, and an integer schema's bounds
    as 64-bit integers converted from them with saturation (its ``compile_const`` and
    ``normalize_integer_bounds``). So:

    * an integer of magnitude above 2**53 (a bound, or a ``const`` / ``enum`` value at any
      nesting) rounds to a neighbour: ``"minimum": 9007199254740993`` allowed
      9007199254740992, ``"enum": [9007199254740993]`` matched only 9007199254740992;
    * an exclusive bound of magnitude 2**53 or more loses its step of one (``exclusiveMinimum:
      2**53`` allowed 2**53 itself);
    * a lower bound at or above 2**63 saturates to ``i64::MAX``, which the grammar then allows
      against the schema (``"minimum": 1e19`` let 9223372036854775807 through);
    * an upper bound, or a ``const`` / ``enum`` number in an integer schema, at or below -2**63
      makes the set ``{i64::MIN}``, whose grammar crashed the process in llguidance's compiler
      (a stack overflow: a segfault, every request in flight lost). ``const`` / ``enum``
      numbers of magnitude 2**63 or more are refused whatever the type (an ``allOf`` may make it
      an integer one), except floats nested in objects or arrays, which llguidance compiles as
      floats.

    Only schema positions are read: subschemas under the keywords that hold them, ``const`` and
    ``enum``; not ``examples``, ``default`` or unknown keywords, and a property named like a
    keyword is a property. Other large float bounds pass this check: they work, or llguidance
    refuses the range itself ("Failed to generate regex for integer range", a GrammarError too).
    """
    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    def refuse(where: str, value, why: str):
        shown = value if not isinstance(value, int) or abs(value) < 10**30 else f"an integer of {len(str(abs(value)))} digits"
        raise GrammarError(f"{where}: {shown} {why} (llguidance handles a schema's numbers as 64-bit floats "
                           "and integers)")

    def literal(value, where: str, nested: bool) -> None:
        if isinstance(value, dict):
            for v in value.values():
                literal(v, where, True)
        elif isinstance(value, list):
            for v in value:
                literal(v, where, True)
        elif not number(value):
            return
        elif isinstance(value, int) and _at_least(value, _EXACT + 1):
            refuse(where, value, "is an integer beyond 2**53, which cannot be matched exactly")
        elif not nested and _at_least(value, _I64):
            refuse(where, value, "has a magnitude of 2**63 or more, which cannot be matched")

    def bound(key: str, value) -> None:
        if isinstance(value, int) and _at_least(value, _EXACT + 1):
            refuse(f"'{key}'", value, "is an integer beyond 2**53, which cannot be enforced exactly")
        if key.startswith("exclusive") and _at_least(value, _EXACT):
            refuse(f"'{key}'", value, "is an exclusive bound of 2**53 or more, whose step of one cannot be enforced")
        if key == "minimum" and value >= _I64:
            refuse(f"'{key}'", value, "is 2**63 or more, which cannot be enforced")
        if key == "maximum" and value <= -_I64:
            refuse(f"'{key}'", value, "is -2**63 or less, which cannot be enforced")

    def walk(node) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
            return
        if not isinstance(node, dict):
            return
        for key, value in node.items():
            if key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") and number(value):
                bound(key, value)
            elif key == "const":
                literal(value, "'const'", False)
            elif key == "enum" and isinstance(value, list):
                for item in value:
                    literal(item, "'enum'", False)
            elif key in _SUBSCHEMAS:
                walk(value)
            elif key in _SUBSCHEMA_MAPS or key == "dependencies":  # (name -> schema; a list of names there is no schema)
                if isinstance(value, dict):
                    for sub in value.values():
                        walk(sub if isinstance(sub, dict) else None)

    walk(schema)


def json_grammar(schema: dict | None = None, strict: bool = False) -> str:
    """The llguidance grammar for JSON values matching ``schema`` (JSON Schema as a dict; None:
    any JSON object, OpenAI's ``json_object`` mode). No whitespace outside strings (separators
    ``,`` and ``:``): a grammar with free whitespace let small models loop on newlines. A
    schema's own ``x-guidance`` options override that. Raises GrammarError for a schema
    llguidance rejects outright or cannot enforce (:func:`check_schema_numbers`); most errors show when the grammar is compiled
    (:func:`compile_grammar`). ``strict``: OpenAI's strict mode (:func:`closed_schema`)."""
    from llguidance import LLMatcher

    if strict and schema is not None:
        schema = closed_schema(schema)
    check_schema_numbers(schema)
    try:
        return LLMatcher.grammar_from_json_schema({"type": "object"} if schema is None else schema,
                                                  defaults={"whitespace_flexible": False})
    except (ValueError, TypeError, RuntimeError) as exc:
        raise GrammarError(str(exc)) from None


def regex_grammar(pattern: str) -> str:
    """The llguidance grammar for text matching the regular expression ``pattern`` (Rust
    regex syntax; ``\\d``, ``\\w`` and ``\\s`` are ASCII classes, as in JSON Schema patterns and
    what clients mean: Unicode ``\\d`` let a model write ``🯸🯸🯸🯸`` for a year)."""
    from llguidance import LLMatcher, regex_to_lark

    if (len(pattern) - len(pattern.rstrip("\\"))) % 2:  # (regex_to_lark would drop it: `a\` matched "a")
        raise GrammarError("the regex ends in an unescaped backslash")
    try:
        return LLMatcher.grammar_from_lark(f"start: /{regex_to_lark(pattern, 'dws')}/")
    except (ValueError, TypeError, RuntimeError) as exc:
        raise GrammarError(str(exc)) from None


def choice_grammar(choices: Sequence[str]) -> str:
    """The grammar for exactly one of ``choices`` (vLLM's ``guided_choice``)."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids) -> object:
    """llguidance's view of a Hugging Face fast tokenizer (an mlx-lm ``TokenizerWrapper`` is
    unwrapped); about 0.3 s for 49k tokens, so callers keep it (the engine builds one).
    ``vocab_size``: the width of the model's logits rows, which may exceed the tokenizer's.

    Raises:
        GrammarError: llguidance cannot take this tokenizer (not a fast tokenizer, or a
            vocabulary larger than ``vocab_size``).
    """
    import llguidance.hf
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    hf = tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer
    try:
        return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=sorted(eos_token_ids))
    except (ValueError, TypeError, RuntimeError) as exc:
        raise GrammarError(f"structured output is not available for this model's tokenizer: {exc}") from None


def compile_grammar(grammar: str, tokenizer):
    """A matcher for ``grammar`` at the start of one request's output. Its first mask is
    computed here, so a grammar that fails there (a schema nothing satisfies,
    a ``$ref`` loop, a regex past llguidance's lexer limits) or whose first mask takes longer
    than ``MAX_MASK_SECONDS`` is refused before it runs.

    Raises:
        GrammarError: the grammar does not compile against ``tokenizer``, or cannot be enforced.
    """
    from llguidance import LLMatcher

    matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=_limits())
    if matcher.is_error():  # (a grammar that does not compile: the matcher says why)
        raise GrammarError(matcher.get_error())
    started = time.thread_time()
    matcher.compute_bitmask()
    elapsed = time.thread_time() - started
    if matcher.is_error():
        error = matcher.get_error().replace("<non-verbose/>", "").strip()
        if "NoExtensionBias" in error:  # (llguidance's word for "no token can start it")
            error = "no output satisfies it"
        raise GrammarError(f"the grammar cannot be enforced: {error}")
    if elapsed > MAX_MASK_SECONDS:
        raise GrammarError(f"the grammar is too expensive to enforce: its first step took {elapsed * 1e3:.0f} ms "
                           f"(limit {MAX_MASK_SECONDS * 1e3:.0f} ms)")
    return matcher


class GrammarConstraint:
    """One request's grammar state over its output tokens.

    Args:
        matcher: this request's own llguidance matcher (from :func:`compile_grammar`; never
            shared: copies of one matcher share a lexer cache that grows with every copy).
        vocab_size: width ``V`` of the logits rows.
        eos_token_ids: the ids that end an output (forbidden while the grammar can go on when
            ``ignore_eos`` is set).
        ignore_eos: the request's ``ignore_eos``: end only where the grammar must end.
    """

    def __init__(self, matcher, vocab_size: int, eos_token_ids=(), ignore_eos: bool = False):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.committed: list[int] = []  # the output tokens consumed
        self._eos = np.array(sorted(t for t in eos_token_ids if 0 <= t < vocab_size), dtype=np.int64)
        self._eos_set = {int(t) for t in self._eos}
        self._ignore_eos = ignore_eos and len(self._eos) > 0
        self._shifts = mx.arange(32, dtype=mx.uint32)
        self._ff_seconds = 0.0  # forced_tokens' share of the next step's time
        self.failed_row: int | None = None  # the last masks() call's first failed row (> 0), if any
        self.failure: str | None = None

    @property
    def consumed(self) -> int:
        return len(self.committed)

    def forced_tokens(self, limit: int) -> list[int]:
        """The next tokens the grammar forces, at most ``limit`` (llguidance's fast-forward
        tokens: a key a schema requires next, its quotes and separators). The engine drafts them
        (drafter ``grammar``): the target still verifies each one, so the output is unchanged,
        where "jump-forward" decoding would append them unverified and can tokenize differently
        from the model."""
        if limit <= 0 or self.matcher.is_error():
            return []
        # (this does the expensive part of the next step, which llguidance keeps for the next
        # mask: its time counts against that step's limit in masks())
        started = time.thread_time()
        tokens = list(self.matcher.compute_ff_tokens())[:limit]
        self._ff_seconds += time.thread_time() - started
        return tokens

    def valid_prefix(self, draft: Sequence[int]) -> int:
        """How many leading tokens of ``draft`` the grammar allows after the committed output."""
        return self.matcher.validate_tokens(list(draft)) if draft else 0

    def masks(self, draft: Sequence[int]) -> mx.array:
        """Allowed tokens per verify row: ``[len(draft) + 1, V]`` bool; row ``r`` after
        ``committed + draft[:r]``. Rows after a draft token the grammar forbids (never reached:
        that token is rejected) repeat the last reachable row's mask.

        The drafts are consumed tentatively and rolled back; if that fails (llguidance's
        per-step limits can put a matcher in its error state, which no rollback leaves), the
        matcher is rebuilt from the committed output, so a draft never changes what a later
        row or step sees.

        A step that fails (the error state) or takes over ``MAX_MASK_SECONDS`` of this thread's
        CPU time raises GrammarError at row 0, as a one-token step there would. At a later row
        it is only recorded (``failed_row``, ``failure``) and the rows from it on repeat the
        last good mask: they matter only if the pass accepts the drafts before that row, and
        then the engine emits the drafts before that row and fails the next step, as plain
        decoding does."""
        self.failed_row, self.failure = None, None
        n = self.valid_prefix(draft)
        # an EOS in the draft ends it: llguidance does not count a consumed EOS, so a rollback
        # would undo one token too many (rows after it are never reached: EOS ends the output)
        n = next((i for i, t in enumerate(draft[:n]) if t in self._eos_set), n)
        words = (self.vocab_size + 31) // 32
        packed = np.zeros((len(draft) + 1, words), dtype=np.uint32)
        consumed = good = 0
        try:
            for r in range(n + 1):
                if r:
                    if not self.matcher.consume_token(draft[r - 1]):  # (its commit fails: Sequence.commit)
                        self.failed_row, self.failure = r, self._left_grammar(draft[r - 1])
                        break
                    consumed += 1
                started = time.thread_time()
                row = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint32)[:words]
                elapsed = time.thread_time() - started
                if r == 0:
                    elapsed, self._ff_seconds = elapsed + self._ff_seconds, 0.0
                failure = (f"the grammar failed: {self.matcher.get_error()}" if self.matcher.is_error() else
                           f"the grammar is too expensive to enforce here (a step took {elapsed * 1e3:.0f} ms of "
                           f"CPU time; limit {MAX_MASK_SECONDS * 1e3:.0f} ms)" if elapsed > MAX_MASK_SECONDS else None)
                if failure is not None:
                    if r == 0:
                        raise GrammarError(failure)
                    self.failed_row, self.failure = r, failure
                    break
                packed[r] = row
                self._forbid_early_eos(packed[r])
                good = r + 1
        finally:
            if (consumed and not self.matcher.rollback(consumed)) or self.matcher.is_error():
                self._restore()
        packed[good:] = packed[good - 1]
        return self._unpack(packed)

    def _forbid_early_eos(self, row: np.ndarray) -> None:
        """With ``ignore_eos``, EOS only where nothing else is allowed (the grammar's end)."""
        if not self._ignore_eos:
            return
        cleared = row.copy()
        cleared[self._eos // 32] &= ~(np.uint32(1) << (self._eos % 32).astype(np.uint32))
        if cleared.any():
            row[:] = cleared

    def _unpack(self, packed: np.ndarray, on_device: bool | None = None) -> mx.array:
        """Packed 32-bit words (bit b of word w: token 32 w + b) to ``[R, V]`` bool: on a GPU
        the words go over and expand there (8x less to copy); on the CPU numpy's unpackbits is
        ~8x faster than the same MLX ops (84 against 700 us for 16 rows of 49k)."""
        if not (on_device if on_device is not None else mx.default_device() != mx.cpu):
            bits = np.unpackbits(packed.view(np.uint8), axis=-1, bitorder="little")[:, : self.vocab_size]
            return mx.array(bits.astype(np.bool_))
        words = mx.array(packed)
        bits = (words[:, :, None] >> self._shifts) & 1
        return bits.reshape(packed.shape[0], -1)[:, : self.vocab_size].astype(mx.bool_)

    def _restore(self) -> None:
        log.warning("grammar matcher left in an error state (%s); rebuilt from the committed output",
                    self.matcher.get_error())
        self.matcher.reset()
        if self.committed and not self.matcher.consume_tokens(self.committed):
            raise GrammarError(f"cannot restore the grammar state: {self.matcher.get_error()}")

    def commit(self, token: int) -> None:
        """Consume one committed output token (chosen under this grammar's mask).

        Raises:
            GrammarError: the grammar refused it (an llguidance limit, never a token the mask
                allowed otherwise): the request ends with an error rather than with text the
                grammar did not accept.
        """
        if not self.matcher.consume_token(token):
            raise GrammarError(self._left_grammar(token))
        self.committed.append(token)
        self._ff_seconds = 0.0

    def _left_grammar(self, token: int) -> str:
        return f"the output left its grammar at token {token}: {self.matcher.get_error()}"

    @property
    def done(self) -> bool:
        """The grammar is complete: only EOS could follow, so the output ends here."""
        return self.matcher.is_stopped()

    def apply(self, logits: mx.array, draft: Sequence[int]) -> mx.array:
        """``[R, V]`` logits with the tokens each row's grammar state forbids set to -inf (ids
        past the tokenizer's vocabulary, when the logits are wider, are forbidden too)."""
        mask = self.masks(draft)
        width = logits.shape[-1]
        if mask.shape[-1] < width:
            mask = mx.concatenate([mask, mx.zeros((mask.shape[0], width - mask.shape[-1]), mx.bool_)], axis=-1)
        return mx.where(mask[:, :width], logits, -mx.inf)
