"""Grammars that force a reply of tool calls, in the model's own call syntax.

For OpenAI's ``tool_choice`` ``required`` or a named function, as vLLM forces them: the reply
is constrained (engine/constraint.py) to calls of the given functions with arguments valid
under their ``parameters`` schemas, then parsed by the same mlx-lm parser as an unforced reply
(``mlx_lm.tool_parsers``). What the grammar lets through must be read back by that parser as
written; what the syntax cannot carry is refused (GrammarError, HTTP 400) rather than forced
loosely. Four syntaxes (:class:`ToolCallStyle`):

* ``json_block`` (``json_tools``; Hermes, Qwen2.5, Qwen3):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, blocks separated by a newline;
* ``xml_function`` (``qwen3_coder``): ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n
  </parameter>\\n...</function>\\n</tool_call>``; the parser reads a string parameter's value as
  the raw text and other types as JSON, by the parameter's ``type``;
* ``mistral_list`` (``mistral``, older templates): ``[TOOL_CALLS][{"name": ..., "arguments":
  {...}}, ...]``;
* ``mistral_args`` (``mistral``, templates with ``[ARGS]``): ``[TOOL_CALLS]NAME[ARGS]{...}``, one
  per call.

JSON is written without free whitespace (as :func:`engine.constraint.json_grammar`), and
integers in the XML syntax within +-2**53 (its parser reads them through ``float``). Not
guarded: a number too large for a float (``1e999``; llguidance cannot bound floats that wide)
reads as infinity, which is no JSON, so such a call stays text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from enum import Enum

from .constraint import GrammarError, check_schema_numbers, map_subschemas


class ToolCallStyle(str, Enum):
    JSON_BLOCK = "json_block"
    XML_FUNCTION = "xml_function"
    MISTRAL_LIST = "mistral_list"
    MISTRAL_ARGS = "mistral_args"


def parser_module(parser) -> str:
    """The last name of an mlx-lm tool parser's module (``json_tools``, ``mistral``, ...)."""
    return (getattr(parser, "__module__", "") or "").rsplit(".", 1)[-1]


def tool_call_style(parser, chat_template) -> ToolCallStyle | None:
    """The syntax calls can be forced in for an mlx-lm tool parser (``parse_tool_call``) and the
    model's chat template; None for formats with no grammar here."""
    module = parser_module(parser)
    if module == "mistral":  # (templates since v11 write NAME[ARGS]{...}, older ones a JSON list)
        args = isinstance(chat_template, str) and "[ARGS]" in chat_template
        return ToolCallStyle.MISTRAL_ARGS if args else ToolCallStyle.MISTRAL_LIST
    return {"json_tools": ToolCallStyle.JSON_BLOCK, "qwen3_coder": ToolCallStyle.XML_FUNCTION}.get(module)


def tool_call_grammar(tokenizer, ll_tok, style: str, start: str, end: str, functions: Sequence[dict],
                      parallel: bool = True) -> str:
    """The llguidance grammar of a reply that is only calls of ``functions``.

    Args:
        tokenizer: the model's tokenizer (markers that are one special token are matched as
            that token, llguidance's ``<[id]>``, else as text).
        ll_tok: llguidance's view of it.
        style: a :class:`ToolCallStyle` value.
        start, end: the format's markers (``end`` empty for Mistral's, whose calls run to the
            end of the output).
        functions: ``[{"name": str, "parameters": JSON Schema of an object}]``.
        parallel: one call, or one or more.

    Raises:
        GrammarError: an unknown ``style``, or a name or schema the syntax cannot carry (see
            the module docstring and docs/api.md, "Tool calls"), or numbers llguidance cannot
            enforce (:func:`engine.constraint.check_schema_numbers`).
    """
    from llguidance import LLMatcher

    def marker(text: str) -> str:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and ll_tok.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    for f in functions:
        check_schema_numbers(f.get("parameters"))
    try:
        style = ToolCallStyle(style)
    except ValueError:
        raise GrammarError(f"unknown tool-call style {style!r} (one of {', '.join(s.value for s in ToolCallStyle)})") \
            from None
    blocks = 'start: block ("\\n" block)*' if parallel else "start: block"
    if style is ToolCallStyle.JSON_BLOCK:
        lines = [blocks, f'block: {marker(start)} "\\n"? call "\\n"? {marker(end)}',
                 f"call: %json {json.dumps(_compact(_calls_schema(functions)))}"]
    elif style is ToolCallStyle.MISTRAL_LIST:
        array = {"type": "array", "items": _calls_schema(functions), "minItems": 1, **({} if parallel else {"maxItems": 1})}
        lines = [f'start: {marker(start)} " "? %json {json.dumps(_compact(_hoist_defs(array)))}']
    elif style is ToolCallStyle.MISTRAL_ARGS:
        lines = [f"start: call{'+' if parallel else ''}", f"call: {marker(start)} ({_alternatives(functions)})"]
        lines += [f"fn{i}: {json.dumps(_mistral_name(f['name']))} {marker('[ARGS]')} "
                  f"%json {json.dumps(_compact(_arguments_schema(f)))}" for i, f in enumerate(functions)]
    else:
        lines = [blocks, f'block: {marker(start)} "\\n" call "\\n" {marker(end)}', f"call: {_alternatives(functions)}"]
        for i, f in enumerate(functions):
            lines += _xml_function_rules(i, f, end)
    try:
        return LLMatcher.grammar_from_lark("\n".join(lines))
    except (ValueError, TypeError, RuntimeError) as exc:
        raise GrammarError(str(exc)) from None


def _alternatives(functions: Sequence[dict]) -> str:
    return " | ".join(f"fn{i}" for i in range(len(functions)))


def _compact(schema: dict) -> dict:
    """``schema`` with JSON written without free whitespace (llguidance reads ``x-guidance`` at
    a schema's top level only)."""
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


_DEFS = ("$defs", "definitions")


def _arguments_schema(function: dict) -> dict:
    """``function``'s parameters as the schema of its arguments: always an object (the
    parameters' own ``type`` is optional in OpenAI's API)."""
    return {**(function.get("parameters") or {}), "type": "object"}


def _calls_schema(functions: Sequence[dict]) -> dict:
    """The schema of one ``{"name", "arguments"}`` object calling one of ``functions``; each
    function's ``$defs`` move to the top (where its ``#/$defs/...`` pointers now lead), and two
    functions defining one name differently are refused."""
    defs: dict[str, dict] = {key: {} for key in _DEFS}
    calls = []
    for f in functions:
        arguments = _arguments_schema(f)
        for key in _DEFS:
            if not isinstance(arguments.get(key), dict):  # (none, or one llguidance will refuse)
                continue
            for name, sub in arguments.pop(key).items():
                if defs[key].setdefault(name, sub) != sub:
                    raise GrammarError(f"tools define {key} {name!r} differently; forced calls need one definition")
        calls.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                      "properties": {"name": {"const": f["name"]}, "arguments": arguments}})
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**schema, **{key: value for key, value in defs.items() if value}}


def _hoist_defs(schema: dict) -> dict:
    """``schema`` (an array of calls) with its items' ``$defs`` at the top."""
    items = dict(schema["items"])
    return {**schema, "items": {k: v for k, v in items.items() if k not in _DEFS},
            **{k: items[k] for k in _DEFS if k in items}}


_XML_INTEGER_LIMIT = 2**53  # (qwen3_coder reads integers through float())


def _bounded_integers(schema, limit: int):
    """``schema`` with every ``integer`` within +-``limit`` (bounds already tighter are kept; a
    bound that is no number is left for llguidance to refuse). Returns a new schema."""
    if not isinstance(schema, dict):
        return schema
    out = map_subschemas(schema, lambda sub: _bounded_integers(sub, limit))
    kinds = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    if "integer" in kinds:
        low, high = out.get("minimum"), out.get("maximum")
        if low is None or _number(low) and low < -limit:
            out["minimum"] = -limit
        if high is None or _number(high) and high > limit:
            out["maximum"] = limit
    return out


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_-]+")  # (within what mlx-lm's mistral parser reads as a name: [\w-]+)


def _mistral_name(name: str) -> str:
    if not _MISTRAL_NAME.fullmatch(name):
        raise GrammarError(f"tool name {name!r} cannot be written in this model's tool-call format "
                           "(ASCII letters, digits, '_' and '-' only)")
    return name


# ---- Qwen3-Coder's XML syntax ------------------------------------------------------------------

_XML_NAME = re.compile(r"[^\s<>]+")  # what mlx-lm's qwen3_coder parser reads as a function or parameter name
_XML_TYPES = ("string", "integer", "number", "boolean", "object", "array", "null")
# keywords that say nothing about a value, or that the rules below enforce
_XML_PARAMETERS_KEYS = {"type", "properties", "required", "additionalProperties", "title", "description",
                        "$defs", "definitions", "$schema", "$id", "$comment", "examples", "default"}
_XML_STRING_KEYS = {"type", "enum", "const", "title", "description", "default", "examples", "$comment",
                    "deprecated", "readOnly", "writeOnly"}
_CLOSE = "\n</parameter>\n"


def _xml_function_rules(i: int, function: dict, end: str) -> list[str]:
    """Lark rules ``fn{i}`` and its parameters' for one function: every property of its
    parameters in schema order (the required ones always, the others optional), each
    ``<parameter=P>\\n`` VALUE ``\\n</parameter>\\n``."""
    name, parameters = function["name"], function.get("parameters") or {}
    if not _XML_NAME.fullmatch(name):
        raise GrammarError(f"tool name {name!r} cannot be written in this model's tool-call format (no spaces, '<' or '>')")
    unsupported = sorted(set(parameters) - _XML_PARAMETERS_KEYS)
    if unsupported:
        raise GrammarError(f"tool {name!r}: parameters keyword {unsupported[0]!r} cannot be enforced in this model's "
                           "tool-call format")
    properties, required = parameters.get("properties") or {}, parameters.get("required") or []
    if not isinstance(properties, dict) or not isinstance(required, list) \
            or not all(isinstance(p, str) for p in required):
        raise GrammarError(f"tool {name!r}: properties must be an object and required a list of names")
    missing = [p for p in required if p not in properties]
    if missing:
        raise GrammarError(f"tool {name!r}: required parameters {missing} are not among its properties")
    defs = {key: parameters[key] for key in _DEFS if isinstance(parameters.get(key), dict)}
    head = json.dumps(f"<function={name}>\n")
    rules, parts = [], []
    for j, (pname, schema) in enumerate(properties.items()):
        where = f"tool {name!r}, parameter {pname!r}"
        if not _XML_NAME.fullmatch(pname):
            raise GrammarError(f"{where}: the name cannot be written in this model's tool-call format "
                               "(no spaces, '<' or '>')")
        if not isinstance(schema, dict):
            raise GrammarError(f"{where}: its schema must be an object with a type")
        rule = f"p{i}_{j}"
        value, terminals = _xml_value(rule, where, schema, defs, end)
        rules += [f"{rule}: {json.dumps(f'<parameter={pname}>')} \"\\n\" {value}", *terminals]
        parts.append(rule if pname in required else f"{rule}?")
    return [f"fn{i}: {head} {' '.join(parts)} \"</function>\"", *rules]


def _xml_value(rule: str, where: str, schema: dict, defs: dict, end: str) -> tuple[str, list[str]]:
    """The Lark expression of one parameter's value and its closing ``\\n</parameter>\\n``, and
    the terminals it defines.

    A string is the raw text: one lexeme that holds neither ``</parameter>`` nor the end marker
    (either would end it early for the parser or the stream's splitter) and is not ``null`` in
    any case (the parser reads that as None). Other types are JSON under the parameter's schema,
    with the parameters' ``$defs`` alongside its own."""
    kind = schema.get("type")
    literals = [schema["const"]] if "const" in schema else schema.get("enum")
    if not isinstance(kind, str) or kind not in _XML_TYPES:
        if kind is None and literals is not None:  # (no type: the parser keeps a string that is no JSON array/object)
            return _xml_literal_choice(where, literals, end, untyped=True), []
        raise GrammarError(f"{where}: a parameter needs one JSON Schema type (one of {', '.join(_XML_TYPES)}) in "
                           f"this model's tool-call format, got {schema.get('type')!r}")
    if kind != "string":
        merged = {**schema, **{key: {**defs[key], **schema.get(key, {})} for key in defs
                               if isinstance(schema.get(key, {}), dict)}}
        value = _compact(_bounded_integers(merged, _XML_INTEGER_LIMIT))
        return f"%json {json.dumps(value)} {json.dumps(_CLOSE)}", []
    unsupported = sorted(set(schema) - _XML_STRING_KEYS)
    if unsupported:
        raise GrammarError(f"{where}: string keyword {unsupported[0]!r} cannot be enforced in this model's "
                           "tool-call format")
    if literals is not None:
        return _xml_literal_choice(where, literals, end, untyped=False), []
    any_char, tag = r"(.|\n)", _regex_literal("</parameter>")
    lexeme = [f"/{any_char}*\\n{tag}/", f"~/{any_char}*{tag}{any_char}+/", f"~/[nN][uU][lL][lL]\\n{tag}/"]
    if end:
        lexeme.append(f"~/{any_char}*{_regex_literal(end)}{any_char}*/")
    token = f"VALUE_{rule.upper()}"
    return f'{token} "\\n"', [f"{token}: {' & '.join(lexeme)}"]


def _xml_literal_choice(where: str, literals, end: str, untyped: bool) -> str:
    """The Lark alternatives of ``enum``/``const`` string values, each with its closing tag;
    GrammarError for values this syntax cannot carry."""
    if not isinstance(literals, list) or not literals or not all(isinstance(v, str) for v in literals):
        raise GrammarError(f"{where}: enum must be a non-empty list of strings (const a string) in this model's "
                           "tool-call format")
    bad = [v for v in literals if "</parameter>" in v or (end and end in v) or v.lower() == "null"
           or (untyped and _json_container(v))]
    if bad:
        raise GrammarError(f"{where}: enum values {bad} cannot be written in this model's tool-call format")
    return "(" + " | ".join(json.dumps(v + _CLOSE) for v in literals) + ")"


def _json_container(text: str) -> bool:
    try:
        return isinstance(json.loads(text), (dict, list))
    except ValueError:
        return False


def _regex_literal(text: str) -> str:
    """``text`` as a regex inside a Lark ``/.../`` literal: every character but ASCII letters
    and digits as a ``\\x{..}`` escape (so no regex or Lark syntax can leak in)."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)
