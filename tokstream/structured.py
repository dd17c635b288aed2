"""Structured outputs: what a request constrains its output to, and the llguidance grammar
that enforces it as a token mask in the sampler (tokstream/worker/grammar.py).

llguidance was chosen over xgrammar by what each needs (measured on SmolLM2's tokenizer: the
tokenizer table builds in 0.26 s, a JSON-schema matcher in 0.4 ms, a mask in ~0.1-6 ms): it has
no dependencies, where xgrammar's wheel requires torch, transformers and triton on Linux, a
second GPU stack on a CPU machine. No torch here: the gateway validates with it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tokstream.errors import UserInputError

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON is written as json.dumps writes it: with free whitespace a small model can spend its
whole max_tokens on blanks between two keys (seen on a random-weight model); a schema's own
"x-guidance" options still apply over these."""
"""OpenAI's response_format types, and vLLM's structured_outputs extras (grammar: Lark)."""


@dataclass(frozen=True)
class StructuredOutput:
    kind: str
    """One of KINDS."""
    spec: str = ""
    """json_schema: the schema as JSON text; regex: the pattern; choice: a JSON array of the
    allowed strings; grammar: Lark text; json_object: unused."""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise UserInputError(f"structured output kind must be one of {', '.join(KINDS)}, "
                                 f"not {self.kind!r}")

    def grammar(self) -> str:
        """The llguidance grammar (validated: a UserInputError says what is wrong)."""
        from llguidance import LLMatcher

        if self.kind == "json_object":
            grammar = LLMatcher.grammar_from_json_schema({"type": "object"},
                                                         defaults=JSON_LAYOUT)
        elif self.kind == "json_schema":
            try:
                grammar = LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_LAYOUT)
            except ValueError as error:
                raise UserInputError(f"json_schema: {error}") from None
        elif self.kind == "regex":
            grammar = LLMatcher.grammar_from_regex(self.spec)
        elif self.kind == "choice":
            choices = json.loads(self.spec)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise UserInputError("choice: a non-empty list of non-empty strings")
            grammar = LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in choices))
        else:
            grammar = LLMatcher.grammar_from_lark(self.spec)
        error = LLMatcher.validate_grammar(grammar)
        if error and not error.startswith("WARNING"):
            raise UserInputError(f"{self.kind}: {error}")
        return grammar
