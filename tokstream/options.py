"""Command-line flags generated from config dataclass fields, so an option is declared once: the
field's name gives the flag, its docstring the help, its default the `[default: …]` shown
(vLLM builds its argument groups from its config classes the same way).

A generated flag defaults to None, "not given": a serving profile's value or the dataclass
default then applies (tokstream/settings.py merges them). A command with nothing between its
flags and the dataclass (chaos) may have each flag hold the field's default instead. Only typer
is imported here, so `tokstream --help` stays instant."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional

import typer

SIZE_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring} for a dataclass whose fields carry a string literal under
    them (the attribute-docstring convention Sphinx and vLLM read)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def field_help(cls: type, name: str) -> str:
    """The first paragraph of the field's docstring, on one line."""
    doc = field_docs(cls).get(name, "")
    return " ".join(doc.split("\n\n")[0].split())


def is_bytes(f: dataclasses.Field) -> bool:
    return f.metadata.get("unit") == "bytes"


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def format_default(f: dataclasses.Field) -> str | None:
    """What `--help` shows as the field's default; None when it has none to show (its help
    says what happens without it)."""
    value = field_default(f)
    if value is None:
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    if is_bytes(f) and isinstance(value, int):
        for unit, size in SIZE_UNITS:
            if value >= size and value % size == 0:
                return f"{value // size}{unit}"
        return str(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(value) if value else "none"
    return str(value)


@dataclass(frozen=True)
class Flag:
    """One command-line flag standing for one config field."""

    section: str
    """The config it sets: a serving profile's section name (engine, cache, scheduler, ...)."""
    cls: type
    field: str
    names: tuple[str, ...]
    """The flag and its aliases, e.g. ("--model", "-m"); a bool field's is "--x/--no-x"."""
    kind: type
    """What the flag parses: int, float, str or bool (sizes and lists are read as text)."""
    help: str
    default: str | None
    """The dataclass default as --help shows it (for a flag holding None)."""
    hidden: bool = False
    value: Any = None
    """What the flag holds when not given: None, "not given", or the field's default itself
    (config_flags' holds_default), which --help then shows as click formats it (10.0, no-x)."""
    envvar: str | None = None
    """An environment variable the flag reads when not given (the field's metadata "envvar")."""
    panel: str | None = None
    """The --help panel it is listed in; None: the command's own Options panel."""

    def option(self):
        show_default = True if self.value is not None else self.default or False
        return typer.Option(self.value, *self.names, help=self.help, show_default=show_default,
                            envvar=self.envvar, hidden=self.hidden, rich_help_panel=self.panel)


def flag_name(field_name: str) -> str:
    """step_timeout_s -> --step-timeout: a seconds suffix is implied by the help."""
    return "--" + field_name.removesuffix("_s").replace("_", "-")


def config_flags(section: str, cls: type, *, skip: set[str] = frozenset(),
                 names: dict[str, tuple[str, ...]] | None = None,
                 hidden: set[str] = frozenset(), holds_default: bool = False,
                 own_panel: bool = True) -> list[Flag]:
    """A flag for every field of cls that is not a nested config and not in skip. `names`
    keeps a flag's established spelling where it differs from flag_name(field).
    holds_default: each flag holds its field's default rather than None, for a command whose
    flags go straight into cls. own_panel: list them in a "SECTION options" panel of --help,
    else in the command's Options panel."""
    names = names or {}
    hints = typing.get_type_hints(cls)
    flags = []
    for f in dataclasses.fields(cls):
        kind = _scalar(hints[f.name])
        if f.name in skip or kind is None:
            continue
        if is_bytes(f) or kind in (list, tuple):
            kind = str
        spelled = names.get(f.name, (flag_name(f.name),))
        if kind is bool:
            long, *short = spelled
            spelled = (f"{long}/--no-{long.removeprefix('--')}", *short)
        flags.append(Flag(section, cls, f.name, spelled, kind, field_help(cls, f.name),
                          format_default(f), f.name in hidden,
                          value=field_default(f) if holds_default else None,
                          envvar=f.metadata.get("envvar"),
                          panel=f"{section} options" if own_panel else None))
    return flags


def _scalar(hint) -> type | None:
    """int/float/str/bool/list for a field's annotation (Optional unwrapped); None for a
    nested config or anything else a flag cannot carry."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else None
    origin = typing.get_origin(hint) or hint
    return origin if origin in (int, float, str, bool, list, tuple) else None


def with_flags(flags: list[Flag]) -> Callable:
    """Decorate a typer command `f(..., flags: dict[str, dict])`: the command gets one option per
    Flag, listed where `flags` stands among f's parameters, and f receives their values as
    {section: {field: value or None}}."""
    by_param = {flag.field: flag for flag in flags}
    if len(by_param) != len(flags):
        raise ValueError("two flags stand for fields of the same name")

    def decorate(func):
        hints = typing.get_type_hints(func)
        # Keyword-only, all of them: typer passes keywords, and an own parameter may then follow
        # the generated ones.
        params = [p.replace(annotation=hints.get(p.name, p.annotation),
                            kind=inspect.Parameter.KEYWORD_ONLY)
                  for p in inspect.signature(func).parameters.values()]
        at = [p.name for p in params].index("flags")
        own = params[:at] + params[at + 1:]
        clash = {p.name for p in own} & set(by_param)
        if clash:
            raise ValueError(f"parameters {clash} clash with generated flags")
        generated = [inspect.Parameter(flag.field, inspect.Parameter.KEYWORD_ONLY,
                                       default=flag.option(), annotation=Optional[flag.kind])
                     for flag in flags]
        signature = params[:at] + generated + params[at + 1:]

        @functools.wraps(func)
        def command(**kwargs):
            given: dict[str, dict] = {}
            for name, flag in by_param.items():
                given.setdefault(flag.section, {})[flag.field] = kwargs.pop(name)
            return func(flags=given, **kwargs)

        command.__signature__ = inspect.Signature(signature)
        command.__annotations__ = {p.name: p.annotation for p in signature}
        del command.__wrapped__  # typer must read the signature above, not func's
        return command

    return decorate
