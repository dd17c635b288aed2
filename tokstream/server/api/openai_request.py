"""An OpenAI request body read into a Prompt: the chat messages or the completion prompt as
token ids, and the sampling parameters (POST /v1/chat/completions and /v1/completions)."""

from __future__ import annotations

from tokstream.checker import MAX_RESPONSE_CHOICES
from tokstream.errors import UserInputError
from tokstream.sampling_params import MAX_LOGPROBS
from tokstream.server.api.api_request import chat_turns
from tokstream.server.api.choices import num_choices
from tokstream.server.api.echo import Echo
from tokstream.server.api_errors import bad_request
from tokstream.server.tool_calls.openai_tools import tool_fields, tool_request
from tokstream.server.api.sampling_options import bounded_options, sampling_extras
from tokstream.server.server import Prompt, Server
from tokstream.server.tool_calls.tool_template import encode_chat, encode_continuation
from tokstream.server.tool_calls.tools import ToolRequest, tool_sampling
from tokstream.server.validation import (get_messages, _kind, check_fits, get_bool, get_int,
                                         get_object, get_strings,
                                         reject_unsupported, sampling_params)
from tokstream.text.chat_template import TEMPLATE_NAMES

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
                limit: int | None = None) -> list[int]:
    """Prompt ids for the messages, with the tools shown to the model (read from the body
    unless given), and vLLM's template options: `add_generation_prompt` (default true) and
    `continue_final_message` (a final assistant message left open for the model to go on:
    a prefill). limit: tool_template.encode_chat's."""
    tools = tools or tool_request(body)
    add_generation_prompt = get_bool(body, "add_generation_prompt", True)
    continue_final = get_bool(body, "continue_final_message")
    template_kwargs = chat_template_kwargs(body)
    messages = chat_messages(body)
    if continue_final and add_generation_prompt:
        raise bad_request("continue_final_message", "needs add_generation_prompt: false (the "
                                                    "final message is continued, not answered)")
    if continue_final and messages[-1]["role"] != "assistant":
        raise bad_request("continue_final_message", "the final message must be from the "
                                                    "assistant")
    try:
        if continue_final:
            return encode_continuation(server.tokenizer, messages,
                                       tools.tools if tools else (), limit, template_kwargs)
        return encode_chat(server.tokenizer, messages, tools.tools if tools else (),
                           add_generation_prompt, limit, template_kwargs)
    except UserInputError as error:
        raise bad_request("messages", str(error)) from None


def chat_template_kwargs(body: dict) -> dict:
    """vLLM's `chat_template_kwargs`: further variables for the model's chat template (Qwen3's
    `enable_thinking`, ...); a template that does not read one ignores it. The template
    itself is the model's: a request's own `chat_template` is refused."""
    if body.get("chat_template") is not None:
        raise bad_request("chat_template", "not accepted: the server renders its model's own "
                                           "chat template")
    kwargs = get_object(body, "chat_template_kwargs") or {}
    taken = sorted(TEMPLATE_NAMES & set(kwargs))
    if taken:
        raise bad_request(f"chat_template_kwargs.{taken[0]}", "is set by the server")
    return kwargs


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


def truncate_prompt_tokens(body: dict, max_model_len: int, max_tokens: int | None) -> int | None:
    """vLLM's `truncate_prompt_tokens`: how many of the prompt's last tokens to keep (-1: as
    many as the context holds beside max_tokens), None to keep it whole."""
    keep = get_int(body, "truncate_prompt_tokens", None, minimum=-1)
    if keep == 0:
        raise bad_request("truncate_prompt_tokens", "must be >= 1, or -1 for the context")
    return max(1, max_model_len - (max_tokens or 1)) if keep == -1 else keep


def completion_prompts(body: dict, server: Server,
                       limit: int | None = None) -> list[tuple[object, list[int]]]:
    """(the prompt as given, its token ids) for each prompt of a completion: a string or
    an array of token ids is one; an array of those is a batch, answered as one response
    whose choices run prompt by prompt (at most MAX_RESPONSE_CHOICES with `n`). limit: a
    text that must tokenise past it is refused first (Tokenizer.refuse_past)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("prompt", "required")
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return [(prompt, _prompt_ids(prompt, "prompt", server, limit))]
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("prompt", "must be a string, an array of token ids, or a non-empty "
                                    "array of those")
    if len(prompt) * num_choices(body) > MAX_RESPONSE_CHOICES:
        raise bad_request("prompt", f"{len(prompt)} prompts x n = {num_choices(body)} choices; "
                                    f"a request holds at most {MAX_RESPONSE_CHOICES}")
    return [(one, _prompt_ids(one, f"prompt.{i}", server, limit))
            for i, one in enumerate(prompt)]


def _is_token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompt_ids(prompt, path: str, server: Server, limit: int | None) -> list[int]:
    """One prompt's token ids (a 400 naming path when it is neither text nor ids)."""
    if isinstance(prompt, str):
        try:
            return server.tokenizer.encode(prompt, limit=limit)
        except UserInputError as error:
            raise bad_request(path, str(error)) from None
    if not _is_token_ids(prompt):
        raise bad_request(path, "must be a string or a non-empty array of token ids")
    vocab = server.engine.info.get("vocab_size") or server.tokenizer.vocab_size
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(path, f"token id {bad} is outside the vocabulary [0, {vocab})")
    return list(prompt)


def parse(body: dict, server: Server, chat: bool) -> list[Prompt]:
    """The request's prompts: chat's one, or a completion's one or batch, each with its own
    params (a default max_tokens fills its own prompt's context)."""
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
    stream_options = get_object(body, "stream_options") or {}
    get_bool(stream_options, "include_usage")
    get_bool(stream_options, "continuous_usage_stats")
    extras = sampling_extras(body, chat, server.tokenizer)
    tools = tool_request(body) if chat else None
    extras.update(tool_sampling(tools, extras["structured"]))
    if extras.get("structured"):
        # A grammar holds the whole output: a prefill would be its start, and min_tokens or
        # allowed ids may leave it nothing it allows (only the end, before min_tokens).
        clashing = {"continue_final_message": chat and get_bool(body, "continue_final_message"),
                    "min_tokens": extras["min_tokens"],
                    "allowed_token_ids": extras["allowed_token_ids"]}
        for name, value in clashing.items():
            if value:
                raise bad_request(name, "cannot be combined with structured output or a "
                                        "forced tool call")
    prompt_logprobs = None if chat else completion_prompt_logprobs(body, echo, stream,
                                                                   extras["logprobs"])
    keep = truncate_prompt_tokens(body, server.max_model_len, max_tokens)
    limit = None if keep else server.max_model_len  # a longer prompt is cut below
    prompts = ([(None, chat_prompt(body, server, tools, limit=limit))] if chat
               else completion_prompts(body, server, limit))
    if keep:  # vLLM's: the prompt's last `keep` tokens (echoed as those tokens)
        prompts = [(given if len(ids) <= keep else None, ids[-keep:]) for given, ids in prompts]
    # max_tokens 0 (echo only): the prompt alone, from a request that samples one token
    # nobody is shown (as vLLM does), so the prompt is scored in its one prefill.
    prompt_only = echo and max_tokens == 0
    salt = request_cache_salt(body)
    parsed = []
    for i, (given, token_ids) in enumerate(prompts):
        field = "messages" if chat else "prompt" if len(prompts) == 1 else f"prompt.{i}"
        fitted = check_fits(len(token_ids), 1 if prompt_only else max_tokens,
                            server.max_model_len, field)
        params = sampling_params({"structured": "response_format"}, max_tokens=fitted,
                                 stop=stop, ignore_eos=ignore_eos,
                                 prompt_logprobs=prompt_logprobs, **options, **extras)
        shown = Echo(echoed_prompt(given, token_ids, server), prompt_only) if echo else None
        parsed.append(Prompt(token_ids, params, stream, tools=tools, n=n, echo=shown,
                             cache_salt=salt))
    return parsed


MAX_CACHE_SALT_CHARS = 256


def request_cache_salt(body: dict) -> str:
    """vLLM's `cache_salt`: a non-empty string ("" when not given)."""
    salt = body.get("cache_salt")
    if salt is None:
        return ""
    if not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise bad_request("cache_salt", f"must be a non-empty string of at most "
                                        f"{MAX_CACHE_SALT_CHARS} characters")
    return salt


def completion_prompt_logprobs(body: dict, echo: bool, stream: bool,
                               logprobs: int | None) -> int | None:
    """The prompt logprobs a completion asks for: vLLM's `prompt_logprobs`, else, with echo,
    as many alternatives as `logprobs` (the echoed prompt's tokens lead its lists)."""
    wanted = get_int(body, "prompt_logprobs", None, minimum=0, maximum=MAX_LOGPROBS)
    if wanted and stream:
        raise bad_request("prompt_logprobs", "not available when stream is true (as in vLLM)")
    return logprobs if wanted is None and echo else wanted


def echoed_prompt(given, token_ids: list[int], server: Server) -> str:
    """The prompt as echoed: the caller's string, or its token ids decoded."""
    return given if isinstance(given, str) else server.tokenizer.decode(
        token_ids, skip_special_tokens=False)
