"""The chat-template environment: the sandbox transformers renders templates in, the globals
it gives them, the names a render sets itself, and the template for models that ship none."""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING

from tokstream.errors import CorruptModelError, UserInputError

if TYPE_CHECKING:
    import jinja2

# For models that ship no chat template: plain role-labelled turns, no special tokens.
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


TEMPLATE_NAMES = frozenset({"messages", "add_generation_prompt", "tools", "bos_token",
                            "eos_token", "raise_exception", "strftime_now"})
"""Names a chat template render sets itself: a caller's template variable may not replace
them."""


def _raise_exception(message: str):
    raise UserInputError(f"chat template: {message}")


def compile_template(source: str) -> "jinja2.Template":
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # The same environment transformers renders with, so templates behave as their authors saw.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False,
                                                                  indent=indent)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as error:
        raise CorruptModelError(f"chat template does not parse: {error}") from error
