"""Tools in the prompt: the model's own chat template when it takes tools, otherwise the
Hermes fallback documented here.

Messages arrive in transformers' chat shape, whatever the API: an assistant message may hold
`tool_calls` ([{"id", "type": "function", "function": {"name", "arguments": dict | str}}],
a str when the arguments are not a JSON object), and a result is {"role": "tool", "content":
str, "tool_call_id": id}. A template that mentions
`tools` is handed them as they are, with `tools=`. Any other template (SmolLM2's among them)
gets plain text turns:

- the system message ends with FALLBACK_PROMPT, which lists each tool's JSON between <tools>
  tags and asks for calls as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
  (the format Hermes-2-Pro and Qwen2.5 were trained on, and what tool_parser.py reads);
- an assistant's calls are written in that format after its text (arguments that are not a
  JSON object, as a model may have written them, go in as the string they are);
- results become a user turn of `<tool_response>\\n...\\n</tool_response>` blocks (one turn for
  consecutive results): a user turn is what every template renders.
"""

from __future__ import annotations

import json

from tokstream.server.tool_calls.tools import CLOSE_TAG, OPEN_TAG, Tool

FALLBACK_PROMPT = """\
You are a function calling AI model. You are provided with function signatures within \
<tools></tools> XML tags. You may call one or more functions to assist with the user query. \
Don't make assumptions about what values to plug into functions. Here are the available tools:
<tools>
{tools}
</tools>
For each function call return a json object with function name and arguments within \
<tool_call></tool_call> XML tags as follows:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def takes_tools(chat_template: str | None) -> bool:
    """Whether a template renders tools itself (transformers hands every template `tools`;
    one that never reads it would drop them)."""
    return chat_template is not None and "tools" in chat_template


def encode_chat(tokenizer, messages: list[dict], tools: tuple[Tool, ...] = (),
                add_generation_prompt: bool = True, limit: int | None = None,
                template_kwargs: dict | None = None) -> list[int]:
    """Prompt ids for messages and the tools the model is shown. limit: the most tokens the
    prompt may have; a rendered prompt that must pass it is refused before it is tokenised
    (Tokenizer.refuse_past); template_kwargs: the caller's template variables."""
    if takes_tools(tokenizer.chat_template):
        own = [{**m, "content": m.get("content") or ""} for m in messages]
        return tokenizer.encode_chat(own, add_generation_prompt,
                                     tools=[t.template_entry() for t in tools] or None,
                                     limit=limit, template_kwargs=template_kwargs)
    return tokenizer.encode_chat(fallback_messages(messages, tools), add_generation_prompt,
                                 limit=limit, template_kwargs=template_kwargs)


def encode_continuation(tokenizer, messages: list[dict], tools: tuple[Tool, ...] = (),
                        limit: int | None = None,
                        template_kwargs: dict | None = None) -> list[int]:
    """Prompt ids that continue the final (assistant) message, a prefill: the turns before it
    as encode_chat renders them with a generation prompt, then its text, left open."""
    prefix = encode_chat(tokenizer, messages[:-1], tools, limit=limit,
                         template_kwargs=template_kwargs)
    return prefix + tokenizer.encode_text(message_text(messages[-1]))


def fallback_messages(messages: list[dict], tools: tuple[Tool, ...]) -> list[dict]:
    """messages as plain {"role", "content": str} turns, the tools in the system turn."""
    out: list[dict] = []
    for message in messages:
        # A results turn gathers its parts and is joined once (adding each to the turn's text
        # copied it whole every time: quadratic in the number of consecutive results).
        if message["role"] == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and "parts" in out[-1]:
                out[-1]["parts"].append(response)
            else:
                out.append({"role": "user", "parts": [response]})
        elif message["role"] == "user" and out and "parts" in out[-1]:
            out[-1]["parts"].append(message["content"])  # results and text: one turn
        else:
            out.append({"role": message["role"], "content": message_text(message)})
    for message in out:
        if "parts" in message:
            message["content"] = "\n".join(message.pop("parts"))
    if tools:
        listed = "\n".join(json.dumps(t.template_entry(), ensure_ascii=False) for t in tools)
        prompt = FALLBACK_PROMPT.format(tools=listed)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] \
                else prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def message_text(message: dict) -> str:
    """A message's text with its calls written out in the Hermes format."""
    parts = [message.get("content") or ""]
    for call in message.get("tool_calls") or ():
        function = call["function"]
        arguments = function["arguments"]
        if not isinstance(arguments, str):  # a string is what the model wrote: kept as it is
            arguments = json.dumps(arguments, ensure_ascii=False)
        body = f'{{"name": {json.dumps(function["name"], ensure_ascii=False)}, ' \
               f'"arguments": {arguments}}}'
        parts.append(f"{OPEN_TAG}\n{body}\n{CLOSE_TAG}")
    return "\n".join(p for p in parts if p)
