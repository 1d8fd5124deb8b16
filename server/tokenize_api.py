"""``POST /tokenize`` and ``POST /detokenize``: vLLM's token-counting extensions.

Clients count a prompt's tokens against the context window (``max_model_len``) before sending
it. ``/tokenize`` encodes exactly as the generation endpoints do: a ``prompt`` string as
``/v1/completions`` encodes it, ``messages`` (and ``tools``, unless ``tool_choice`` is
``"none"``) through the chat template as ``/v1/chat/completions`` builds its prompt, so
``count`` is that request's ``usage.prompt_tokens``. Tokenizing runs off the event loop (a
multi-megabyte prompt takes seconds) and the response is serialized directly.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request, Response

from .errors import APIError
from .openai_api import chat_prompt, check_model, check_ready, template_tools
from .schemas import DetokenizeRequest, TokenizeRequest

router = APIRouter()


def _json(payload: dict) -> Response:
    return Response(json.dumps(payload, ensure_ascii=False, separators=(",", ":")), media_type="application/json")


@router.post("/tokenize")
async def tokenize(request: Request, body: TokenizeRequest):
    """``{"count", "max_model_len", "tokens", "token_strs"}``: ``token_strs`` is each id's
    vocabulary entry (the tokenizer's own spelling, e.g. ``Ġthe``) with ``return_token_strs``,
    else null, as vLLM's. Raises APIError 400 for a template error or tools the template cannot
    render (as chat completions), 404 for another model, 503 while loading."""
    check_model(request, body.model)
    check_ready(request)
    loaded = request.app.state.engine.loaded
    tokenizer = loaded.tokenizer
    hf = getattr(tokenizer, "_tokenizer", tokenizer)

    def run() -> dict:
        if body.messages is not None:
            _, tools = template_tools(tokenizer, body)
            tokens = chat_prompt(tokenizer, body.messages, tools, body.add_generation_prompt)
        else:
            tokens = list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False))
        return {"count": len(tokens), "max_model_len": loaded.context_length, "tokens": tokens,
                "token_strs": hf.convert_ids_to_tokens(tokens) if body.return_token_strs else None}

    return _json(await asyncio.to_thread(run))


@router.post("/detokenize")
async def detokenize(request: Request, body: DetokenizeRequest):
    """``{"prompt": text}``, special tokens spelled out. Raises APIError 400 (``param:
    tokens.<i>``) for an id outside the tokenizer's vocabulary (which may be smaller than the
    model's padded embedding)."""
    check_model(request, body.model)
    check_ready(request)
    tokenizer = request.app.state.engine.loaded.tokenizer
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    vocab = len(hf)
    for i, t in enumerate(body.tokens):
        if t >= vocab:
            raise APIError(400, f"token id {t} is out of range [0, {vocab}) of the tokenizer's vocabulary",
                           param=f"tokens.{i}")
    return _json({"prompt": await asyncio.to_thread(hf.decode, body.tokens)})
