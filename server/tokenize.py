"""vLLM's utility routes, for clients and gateways written against ``vllm serve``:

- ``POST /tokenize``: a text (``prompt``, special tokens added unless ``add_special_tokens`` is
  false) or a conversation (``messages``, rendered by the model's chat template exactly as
  ``/v1/chat/completions`` renders it) -> ``{"count", "max_model_len", "tokens"}``;
- ``POST /detokenize``: ``tokens`` -> ``{"prompt"}`` (ids outside the vocabulary: a 400 naming
  ``tokens``);
- ``GET /version``: ``{"version"}``, the server's.

As in vLLM they sit outside ``/v1`` and so outside the API key guard (server/middleware.py);
``model``, where sent, must be a served name (404 otherwise, as on every route).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from . import protocol as P
from .convert import chat_prompt, check_model
from .errors import bad
from .openapi import ERROR_RESPONSES


def add_tokenize_routes(
    app: FastAPI, tokenizer, served: list[str], max_model_len: int, vocab_size: int
) -> None:
    """The three routes over ``tokenizer`` for the models ``served``."""

    def check(model: str | None) -> None:
        if model is not None:
            check_model(model, served)

    errors: dict[int | str, dict[str, Any]] = {400: ERROR_RESPONSES[400], 404: ERROR_RESPONSES[404]}

    @app.post("/tokenize", response_model=P.TokenizeResponse, responses=errors)
    async def tokenize(body: P.TokenizeCompletionRequest | P.TokenizeChatRequest):
        check(body.model)
        if isinstance(body, P.TokenizeChatRequest):
            chat = P.ChatCompletionRequest.model_validate(
                {"model": body.model or served[0], "messages": body.messages}
            )
            ids = chat_prompt(chat, tokenizer, generation_prompt=body.add_generation_prompt)
        else:
            ids = list(
                tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
            )
        return P.TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=P.DetokenizeResponse, responses=errors)
    async def detokenize(body: P.DetokenizeRequest):
        check(body.model)
        wrong = next((t for t in body.tokens if not 0 <= t < vocab_size), None)
        if wrong is not None:
            raise bad(f"token id {wrong} is outside the vocabulary (0..{vocab_size - 1})", "tokens")
        return P.DetokenizeResponse(prompt=tokenizer.decode(body.tokens))

    @app.get("/version", response_model=P.VersionResponse)
    async def version():
        return P.VersionResponse(version=app.version)
