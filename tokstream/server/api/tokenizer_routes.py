"""vLLM's tokenizer routes: POST /tokenize (a prompt, or chat messages through the model's
template), POST /detokenize (ids back to text) and GET /tokenizer_info (tokenizer_config.json's
fields), in vLLM's request and response shapes: with them lm-eval's `local-completions` needs no
copy of the tokenizer (its remote tokenizer backend). Tokenising costs, so a tenant is charged
the tokens counted, as count_tokens is."""

from __future__ import annotations

from starlette.responses import JSONResponse

from tokstream.server.api_errors import OPENAI, api_route, bad_request
from tokstream.server.api.openai_request import chat_prompt
from tokstream.server.server import Server
from tokstream.server.validation import get_bool, parse_off_loop, read_json

MAX_DETOKENIZE_IDS = 1 << 20
"""More ids than any context holds is not a detokenisation request but a cost."""


def _tokenize(server: Server, body: dict) -> list[int]:
    if "messages" in body:
        if "prompt" in body:
            raise bad_request("prompt", "give prompt or messages, not both")
        ids = chat_prompt(body, server)
        if get_bool(body, "add_special_tokens", False):
            ids = _with_bos(server, ids)
        return ids
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("prompt", "required: a string (or give messages)")
    ids = server.tokenizer.encode(prompt)  # as Hugging Face's tokenizer(prompt) does
    if not get_bool(body, "add_special_tokens", True) and server.tokenizer.add_bos_token:
        bos = server.tokenizer.bos_token_id
        ids = ids[1:] if ids[:1] == [bos] else ids
    return ids


def _with_bos(server: Server, ids: list[int]) -> list[int]:
    bos = server.tokenizer.bos_token_id
    return ids if bos is None or ids[:1] == [bos] else [bos, *ids]


@api_route(OPENAI)
async def tokenize(request):
    server: Server = request.app.state.server
    tenant = server.auth.authenticate(request.headers)
    body = await read_json(request, server.config.max_body_bytes, server.config.body_timeout_s)
    if "model" in body:  # optional here, as in vLLM
        server.check_model(body["model"])
    ids = await parse_off_loop(request, _tokenize, server, body)
    if tenant is not None:
        tenant.charge(len(ids))
    return JSONResponse({"count": len(ids), "max_model_len": server.max_model_len,
                         "tokens": ids, "token_strs": None})


@api_route(OPENAI)
async def detokenize(request):
    server: Server = request.app.state.server
    server.auth.authenticate(request.headers)
    body = await read_json(request, server.config.max_body_bytes, server.config.body_timeout_s)
    if "model" in body:
        server.check_model(body["model"])
    ids = body.get("tokens")
    if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int)
                                        for t in ids):
        raise bad_request("tokens", "required: an array of token ids")
    if len(ids) > MAX_DETOKENIZE_IDS:
        raise bad_request("tokens", f"at most {MAX_DETOKENIZE_IDS} ids")
    vocab = server.engine.info.get("vocab_size") or server.tokenizer.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request("tokens", f"token id {bad} is outside the vocabulary [0, {vocab})")
    text = await parse_off_loop(request, lambda: server.tokenizer.decode(
        ids, skip_special_tokens=False))
    return JSONResponse({"prompt": text})


@api_route(OPENAI)
async def tokenizer_info(request):
    """What vLLM serves behind --enable-tokenizer-info-endpoint: the tokenizer's config, with
    the served context as model_max_length."""
    server: Server = request.app.state.server
    server.auth.authenticate(request.headers)
    return JSONResponse({**server.tokenizer.config(), "model_max_length": server.max_model_len})
