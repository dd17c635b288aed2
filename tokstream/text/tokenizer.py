"""Text <-> token ids, and chat templates. Built from a GGUF's metadata, an HF folder's
tokenizer.json, or made up for `dummy:` presets. No torch here."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from tokstream.errors import CorruptModelError, UserInputError
from tokstream.text import token_bound
from tokstream.text.chat_template import PLAIN_CHAT_TEMPLATE, compile_template

if TYPE_CHECKING:
    from tokstream.model.source import ModelSource

# llama.cpp's GGUF token types.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# tokenizer.ggml.pre names, grouped by how llama.cpp splits text before BPE. The "smollm"
# group first cuts every digit off on its own, as SmolLM2's tokenizer.json does with
# Digits(individual_digits) before the GPT-2 split.
GPT2_PRE = {"gpt2", "default", "mpt", "olmo", "jais"}
DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"}
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
REGEX_SPLIT_PRE = {"llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what serving needs around it: special ids, chat template."""

    def __init__(self, backend: BackendTokenizer, *, bos_token_id: int | None = None,
                 eos_token_ids: tuple[int, ...] = (), chat_template: str | None = None,
                 add_bos_token: bool = False):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self._template: "jinja2.Template | None" = None
        self._plain_backend: BackendTokenizer | None = None
        self._token_bytes: dict[int, bytes] = {}
        """token_bytes by id, each worked out once: 20 top logprobs a token asked it 21 times
        a token, at ~0.1 ms each (the added tokens' table is read every time)."""

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_ids[0] if self.eos_token_ids else None)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE piece may be part of a UTF-8
        character: OpenAI's logprobs report these bytes beside the token's text)."""
        known = self._token_bytes.get(token_id)
        if known is None:
            known = self._token_bytes[token_id] = self._spelled_bytes(token_id)
        return known

    def _spelled_bytes(self, token_id: int) -> bytes:
        spelled = self.backend.id_to_token(token_id)
        if spelled is None:
            return b""
        if spelled in self.special_strings:
            return spelled.encode("utf-8")
        table = _unicode_to_bytes()
        if all(ch in table for ch in spelled):
            return bytes(table[ch] for ch in spelled)
        return spelled.encode("utf-8")

    def id_to_token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        """Raw text to ids; special tokens written in the text are recognised whole. limit:
        refuse_past's."""
        self.refuse_past(len(text), limit)
        ids = _ids(self.backend, text)
        if self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_text(self, text: str) -> list[int]:
        """User-supplied text to ids, special-token strings in it tokenised as plain text (no
        BOS): a user who types `<|im_end|>` gets those characters, not a control token."""
        return _ids(self.prepare_user_text(), text)

    def prepare_user_text(self) -> BackendTokenizer:
        """encode_text's backend, built on the first call: a copy, so threads tokenising on
        the shared backend never see its flag flip. Building it holds the GIL throughout
        (~0.3 s for SmolLM2's), so the gateway calls this before it serves: built by the
        first request with special-token text in a message, it stopped the event loop (and
        /health/live) for that long."""
        if self._plain_backend is None:
            plain = BackendTokenizer.from_str(self.backend.to_str())
            plain.encode_special_tokens = True
            self._plain_backend = plain
        return self._plain_backend

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """token_bound.max_token_bytes of this tokenizer (worked out once)."""
        return token_bound.max_token_bytes(self.backend)

    def refuse_past(self, num_chars: int, limit: int | None) -> None:
        """PromptTooLongError when a text of num_chars characters must encode to limit tokens
        or more (token_bound.py); nothing when limit is None."""
        token_bound.refuse_past(num_chars, limit, self.max_token_bytes)

    @property
    def special_strings(self) -> list[str]:
        """The text of every special (control) token."""
        return [t.content for t in self.backend.get_added_tokens_decoder().values()
                if t.special]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # Ids the vocabulary lacks (a random-weight model emits any id) decode to nothing.
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None,
                            template_kwargs: dict | None = None) -> str:
        """tools: function definitions for a template that renders them (only passed when
        given, so a template that tests `tools is defined` sees none otherwise);
        template_kwargs: the caller's further template variables (`enable_thinking`, ...),
        none of them a name the render sets itself (chat_template.TEMPLATE_NAMES)."""
        import jinja2  # only chat rendering needs it (keeps GPU-box imports small)

        if self._template is None:
            self._template = compile_template(self.chat_template or PLAIN_CHAT_TEMPLATE)
        extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra,
            )
        except (jinja2.TemplateError, TypeError) as error:  # messages it cannot handle
            raise UserInputError(f"chat template failed on these messages: {error}") from error

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, limit: int | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
        """Messages through the chat template to ids: the template's markers are control tokens,
        special-token strings inside message content are plain text. limit: refuse_past's, on
        the rendered text (a template may leave content out); template_kwargs:
        apply_chat_template's."""
        # The template writes any BOS itself, so none is added here (as transformers does).
        specials = self.special_strings
        if not any(isinstance(m.get("content"), str) and any(s in m["content"] for s in specials)
                   for m in messages):
            text = self.apply_chat_template(messages, add_generation_prompt, tools,
                                            template_kwargs)
            self.refuse_past(len(text), limit)
            return _ids(self.backend, text)
        # Render with a placeholder per message, then tokenise the template's text with special
        # tokens and each message's own text without.
        marks = {n: f"\ue000{n}\ue001" for n, m in enumerate(messages)
                 if isinstance(m.get("content"), str)}
        masked = [{**m, "content": marks[n]} if n in marks else m
                  for n, m in enumerate(messages)]
        text = self.apply_chat_template(masked, add_generation_prompt, tools,
                                        template_kwargs)
        # One pass over the text finds every placeholder (a search per message was quadratic:
        # 6,000 such messages held the gateway's GIL for seconds).
        found = [(m.start(), m.end(), int(m[1])) for m in _PLACEHOLDER.finditer(text)
                 if int(m[1]) in marks]
        if len(found) != len(marks) or len({n for _, _, n in found}) != len(marks):
            raise UserInputError("messages: this chat template rewrites message content, "
                                 "so special-token text in a message cannot be kept as text")
        self.refuse_past(len(text) + sum(len(messages[n]["content"]) - len(mark)
                                         for n, mark in marks.items()), limit)
        # Batched, not two calls per message: encode holds the GIL, encode_batch lets the
        # gateway's event loop run (12,001 encode calls held it ~0.26 s for 6,000 messages).
        cuts = [0, *(cut for at, end, _ in found for cut in (at, end)), len(text)]
        template_parts = [text[a:b] for a, b in zip(cuts[0::2], cuts[1::2])]
        template_ids = _batch_ids(self.backend, template_parts)
        content_ids = _batch_ids(self.prepare_user_text(),
                                 [messages[n]["content"] for _, _, n in found])
        ids = template_ids[0]
        for part, content in zip(template_ids[1:], content_ids):
            ids += content
            ids += part
        return ids

    def to_json(self) -> str:
        """The tokenizer.json text."""
        return self.backend.to_str()

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json, as an HF folder holds them."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "tokenizer.json").write_text(self.to_json(), encoding="utf-8")
        (directory / "tokenizer_config.json").write_text(json.dumps(self.config(), indent=2),
                                                          "utf-8")

    def config(self) -> dict:
        """tokenizer_config.json's fields (what `GET /tokenizer_info` serves): the special
        tokens as text, and the chat template the server renders."""
        return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos_token,
                "eos_token": self.eos_token, "pad_token": None, "unk_token": None,
                "add_bos_token": self.add_bos_token, "add_eos_token": False,
                "chat_template": self.chat_template or PLAIN_CHAT_TEMPLATE}


GIL_FREE_CHARS = 4096
"""Texts this long are tokenised by encode_batch, which lets other threads run meanwhile:
`Tokenizer.encode` holds the GIL throughout, so a 2 MB prompt parsed on a worker thread still
stopped the gateway's event loop, and every stream it writes, for seconds."""


def _ids(backend: BackendTokenizer, text: str) -> list[int]:
    """text to ids, no special tokens added (the same ids by either call)."""
    if len(text) < GIL_FREE_CHARS:
        return backend.encode(text, add_special_tokens=False).ids
    return backend.encode_batch([text], add_special_tokens=False)[0].ids


def _batch_ids(backend: BackendTokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's ids (_ids's), by encode_batch, which lets go of the GIL while it tokenises
    but holds it to hand back its results: BATCH_TEXTS at a time keeps each hold short."""
    return [e.ids for at in range(0, len(texts), BATCH_TEXTS)
            for e in backend.encode_batch(texts[at:at + BATCH_TEXTS], add_special_tokens=False)]


BATCH_TEXTS = 256


_PLACEHOLDER = re.compile("\ue000([0-9]+)\ue001")
"""A message's content while the template renders (encode_chat): its index between two
private-use characters."""


def load_tokenizer(source: ModelSource) -> Tokenizer:
    if source.kind == "gguf":
        from tokstream.model.gguf_file import read_gguf_header

        # The header reader decodes the token lists in ~0.1 s; gguf.GGUFReader takes ~2.5 s.
        return tokenizer_from_gguf(read_gguf_header(source.path, arrays=True).metadata, source)
    if source.kind == "hf":
        return tokenizer_from_hf(Path(source.path), source)
    if source.kind == "dummy":
        return dummy_tokenizer(source.config.vocab_size, source.config.bos_token_id,
                               source.config.eos_token_ids)
    raise UserInputError(f"unknown model source kind {source.kind!r}")


def tokenizer_from_gguf(metadata: Mapping, source: ModelSource | None = None) -> Tokenizer:
    """From a GGUF's key/value metadata, token and merge lists included."""

    def field(key, default=None):
        return metadata.get(key, default)

    kind = field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UserInputError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    pre = field("tokenizer.ggml.pre", "default")
    tokens = field("tokenizer.ggml.tokens")
    merges = field("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise CorruptModelError("GGUF has no tokenizer.ggml.tokens or tokenizer.ggml.merges")
    token_types = field("tokenizer.ggml.token_type") or [1] * len(tokens)

    byte_spelling = _bytes_to_unicode()
    alphabet = set(byte_spelling.values())
    vocab = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:  # stored as raw text: respell in the byte alphabet
            token = "".join(byte_spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    backend = BackendTokenizer(models.BPE(
        vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges]))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()

    # Control tokens must match whole in text (`<|im_start|>`), never be cut into bytes. One
    # spelled outside the byte alphabet is a llama.cpp mislabel; adding it would grow the vocab.
    specials = [AddedToken(t, special=True, normalized=False)
                for t, token_type in zip(tokens, token_types)
                if token_type == TOKEN_TYPE_CONTROL and set(t) <= alphabet]
    user_defined = [AddedToken(t, special=False, normalized=False)
                    for t, token_type in zip(tokens, token_types)
                    if token_type == TOKEN_TYPE_USER_DEFINED and t in vocab]
    backend.add_special_tokens(specials)
    backend.add_tokens(user_defined)

    eos = [field(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    return Tokenizer(
        backend,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_unique(eos + list(source.config.eos_token_ids if source else ())),
        chat_template=field("tokenizer.chat_template"),
        add_bos_token=bool(field("tokenizer.ggml.add_bos_token", False)),
    )


def _byte_level_pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in GPT2_PRE:
        return byte_level
    if pre in REGEX_SPLIT_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(REGEX_SPLIT_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    supported = sorted(GPT2_PRE | DIGIT_SPLIT_PRE | set(REGEX_SPLIT_PRE))
    raise UserInputError(f"GGUF pre-tokenizer {pre!r} is not supported "
                         f"(supported: {', '.join(supported)})")


def tokenizer_from_hf(folder: Path, source: ModelSource | None = None) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise CorruptModelError(f"{folder} has no tokenizer.json")
    try:
        backend = BackendTokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception on bad JSON
        raise CorruptModelError(f"cannot read {path}: {error}") from error

    config = _read_json(folder / "tokenizer_config.json")
    generation = _read_json(folder / "generation_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default") or next(iter(named.values()), None)
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")

    def token_id(value):
        if isinstance(value, dict):
            value = value.get("content")
        return backend.token_to_id(value) if isinstance(value, str) else None

    eos = generation.get("eos_token_id")
    eos = eos if isinstance(eos, list) else [eos]
    eos += [token_id(config.get("eos_token"))]
    bos = generation.get("bos_token_id", token_id(config.get("bos_token")))
    if source is not None:
        eos += list(source.config.eos_token_ids)
        bos = bos if bos is not None else source.config.bos_token_id
    # A tokenizer.json whose post-processor adds BOS (Llama 3) says so itself.
    adds_bos = bos is not None and bos in backend.encode("", add_special_tokens=True).ids
    return Tokenizer(backend, bos_token_id=bos, eos_token_ids=_unique(eos),
                     chat_template=template, add_bos_token=adds_bos)


def dummy_tokenizer(vocab_size: int, bos_token_id: int | None = None,
                    eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    """A deterministic byte-level tokenizer with exactly `vocab_size` ids.

    Specials sit at the config's ids, the 256 bytes at the lowest free ids, and every id left
    over decodes to a harmless word (" w123") so any id a random-weight model emits is readable.
    """
    specials = {}
    if bos_token_id is not None:
        specials[bos_token_id] = "<|bos|>"
    for n, eos in enumerate(eos_token_ids):
        specials.setdefault(eos, "<|eos|>" if n == 0 else f"<|eos{n}|>")
    if vocab_size < 256 + len(specials) or any(i >= vocab_size for i in specials):
        raise UserInputError(f"dummy tokenizer needs vocab_size >= {256 + len(specials)} "
                             "holding the bos/eos ids")
    free_ids = (i for i in range(vocab_size) if i not in specials)
    vocab = {symbol: next(free_ids) for symbol in _bytes_to_unicode().values()}
    vocab.update({token: i for i, token in specials.items()})
    vocab.update({f"Ġw{i}": i for i in free_ids})
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in specials.values()])
    return Tokenizer(backend, bos_token_id=bos_token_id, eos_token_ids=tuple(eos_token_ids))


def _unicode_to_bytes() -> dict[str, int]:
    """The inverse of _bytes_to_unicode (cached)."""
    global _UNICODE_TO_BYTES
    if _UNICODE_TO_BYTES is None:
        _UNICODE_TO_BYTES = {ch: byte for byte, ch in _bytes_to_unicode().items()}
    return _UNICODE_TO_BYTES


_UNICODE_TO_BYTES: dict[str, int] | None = None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise CorruptModelError(f"cannot parse {path}: {error}") from error


def _unique(ids) -> tuple[int, ...]:
    return tuple(dict.fromkeys(i for i in ids if i is not None))
