"""An OpenAI request body read into a Prompt: the chat messages or the completion prompt as
token ids, and the sampling parameters (POST /v1/chat/completions and /v1/completions)."""

from __future__ import annotations

from tokstream.errors import UserInputError
from tokstream.sampling_params import MAX_LOGPROBS
from tokstream.server.api.api_request import chat_turns
from tokstream.server.api.choices import num_choices
from tokstream.server.api.echo import Echo
from tokstream.server.api_errors import bad_request
from tokstream.server.tool_calls.openai_tools import tool_fields, tool_request
from tokstream.server.api.sampling_options import bounded_options, sampling_extras
from tokstream.server.server import Prompt, Server
from tokstream.server.tool_calls.tool_template import encode_chat
from tokstream.server.tool_calls.tools import ToolRequest, tool_sampling
from tokstream.server.validation import (get_messages, _kind, check_fits, get_bool, get_int,
                                         get_object, get_strings,
                                         reject_unsupported, sampling_params)

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

UNSUPPORTED = {
    "best_of": lambda v: v != 1,
    "suffix": bool,
    "functions": bool,
}
CHAT_UNSUPPORTED = {**UNSUPPORTED, "echo": bool}


def _content(value, path: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for n, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad_request(f"{path}.{n}", "only {'type': 'text', 'text': ...} parts are "
                                                 "supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(path, f"must be a string or an array of text parts, not {_kind(value)}")


def chat_prompt(body: dict, server: Server, tools: ToolRequest | None = None,
                add_generation_prompt: bool = True, limit: int | None = None) -> list[int]:
    """Prompt ids for the messages, with the tools shown to the model (read from the body
    unless given). limit: tool_template.encode_chat's."""
    tools = tools or tool_request(body)
    try:
        return encode_chat(server.tokenizer, chat_messages(body), tools.tools if tools else (),
                           add_generation_prompt, limit)
    except UserInputError as error:
        raise bad_request("messages", str(error)) from None


def chat_messages(body: dict) -> list[dict]:
    chat = []
    for at, message, role in chat_turns(get_messages(body), CHAT_ROLES,
                                        f"one of {', '.join(CHAT_ROLES)}"):
        content = message.get("content")
        calls = tool_fields(message, at)
        if content is None and not calls.get("tool_calls"):
            raise bad_request(f"{at}.content", "required")
        chat.append({"role": "system" if role == "developer" else role,
                     "content": "" if content is None else _content(content, f"{at}.content"),
                     **calls})
    return chat


def completion_prompt(body: dict, server: Server) -> list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("prompt", "required")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        try:
            return server.tokenizer.encode(prompt, limit=server.max_model_len)
        except UserInputError as error:
            raise bad_request("prompt", str(error)) from None
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = server.engine.info.get("vocab_size") or server.tokenizer.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request("prompt", f"token id {bad} is outside the vocabulary [0, {vocab})")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request("prompt", "only one prompt per request is supported")
    raise bad_request("prompt", "must be a string, an array of token ids, or an array holding "
                                "one of those")


def parse(body: dict, server: Server, chat: bool) -> Prompt:
    server.check_model(body.get("model"))
    reject_unsupported(body, CHAT_UNSUPPORTED if chat else UNSUPPORTED)
    echo = not chat and get_bool(body, "echo")
    max_tokens = get_int(body, "max_completion_tokens", None, minimum=1) if chat else None
    max_tokens = get_int(body, "max_tokens", max_tokens, minimum=1 if chat else 0)
    if max_tokens == 0 and not echo:  # vLLM's rule: 0 only to score an echoed prompt
        raise bad_request("max_tokens", "must be >= 1 (0 only with echo: true), got 0")
    options = bounded_options(body, "openai")
    options["top_k"] = max(options["top_k"], 0)  # vLLM's -1 is 0's "no limit"
    stop = get_strings(body, "stop", allow_single=True)
    n = num_choices(body)
    ignore_eos = get_bool(body, "ignore_eos")
    stream = get_bool(body, "stream")
    get_bool(get_object(body, "stream_options") or {}, "include_usage")
    extras = sampling_extras(body, chat, server.tokenizer.vocab_size)
    tools = tool_request(body) if chat else None
    extras.update(tool_sampling(tools, extras["structured"]))
    prompt_logprobs = None if chat else completion_prompt_logprobs(body, echo, stream,
                                                                   extras["logprobs"])
    token_ids = (chat_prompt(body, server, tools, limit=server.max_model_len) if chat
                 else completion_prompt(body, server))
    # max_tokens 0 (echo only): the prompt alone, from a request that samples one token
    # nobody is shown (as vLLM does), so the prompt is scored in its one prefill.
    prompt_only = echo and max_tokens == 0
    max_tokens = check_fits(len(token_ids), 1 if prompt_only else max_tokens,
                            server.max_model_len, "messages" if chat else "prompt")
    params = sampling_params({"structured": "response_format"}, max_tokens=max_tokens,
                             stop=stop, ignore_eos=ignore_eos, prompt_logprobs=prompt_logprobs,
                             **options, **extras)
    shown = Echo(echoed_prompt(body, token_ids, server), prompt_only) if echo else None
    return Prompt(token_ids, params, stream, tools=tools, n=n, echo=shown)


def completion_prompt_logprobs(body: dict, echo: bool, stream: bool,
                               logprobs: int | None) -> int | None:
    """The prompt logprobs a completion asks for: vLLM's `prompt_logprobs`, else, with echo,
    as many alternatives as `logprobs` (the echoed prompt's tokens lead its lists)."""
    wanted = get_int(body, "prompt_logprobs", None, minimum=0, maximum=MAX_LOGPROBS)
    if wanted and stream:
        raise bad_request("prompt_logprobs", "not available when stream is true (as in vLLM)")
    return logprobs if wanted is None and echo else wanted


def echoed_prompt(body: dict, token_ids: list[int], server: Server) -> str:
    """The prompt as echoed: the caller's string, or its token ids decoded."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else server.tokenizer.decode(
        token_ids, skip_special_tokens=False)
