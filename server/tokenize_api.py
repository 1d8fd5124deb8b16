"""``POST /tokenize`` and ``POST /detokenize``: vLLM's token-counting extensions.

Clients count a prompt's tokens against the context window (``max_model_len``) before sending
it. ``/tokenize`` encodes exactly as the generation endpoints do: a ``prompt`` string as
``/v1/completions`` encodes it, ``messages`` (and ``tools``) through the chat template as
``/v1/chat/completions`` builds its prompt, so ``count`` is the prompt's ``usage.prompt_tokens``.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from .errors import APIError
from .openai_api import chat_prompt, check_model, check_ready
from .schemas import DetokenizeRequest, TokenizeRequest

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request, body: TokenizeRequest):
    """``{"count", "max_model_len", "tokens"}``, and with ``return_token_strs`` each token's
    vocabulary entry (``token_strs``, the tokenizer's own spelling, e.g. ``Ġthe``, as vLLM's)."""
    check_model(request, body.model)
    check_ready(request)
    loaded = request.app.state.engine.loaded
    tokenizer = loaded.tokenizer
    if body.messages is not None:
        tools = [t.for_template() for t in body.tools] if body.tools else None
        tokens = chat_prompt(tokenizer, body.messages, tools, body.add_generation_prompt)
    else:
        tokens = list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
    out = {"count": len(tokens), "max_model_len": loaded.context_length, "tokens": tokens}
    if body.return_token_strs:
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        out["token_strs"] = hf.convert_ids_to_tokens(tokens)
    return out


@router.post("/detokenize")
async def detokenize(request: Request, body: DetokenizeRequest):
    """``{"prompt": text}``. Raises APIError 400 (``param: tokens.<i>``) for an id outside the
    vocabulary."""
    check_model(request, body.model)
    check_ready(request)
    loaded = request.app.state.engine.loaded
    hf = getattr(loaded.tokenizer, "_tokenizer", loaded.tokenizer)
    vocab = len(hf)
    for i, t in enumerate(body.tokens):
        if t >= vocab:
            raise APIError(400, f"token id {t} is out of range [0, {vocab})", param=f"tokens.{i}")
    return {"prompt": hf.decode(body.tokens)}
