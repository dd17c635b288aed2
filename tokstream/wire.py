"""Plain dataclasses to and from JSON-ready data, and their JSON Schema.

`Wire.from_wire` parses what `to_wire` wrote, nested dataclasses, lists, dicts, enums and
optionals included. Keys a class does not declare are kept in its `extra` field (when it has
one) and written back after the declared ones, so a reader of an older or newer peer loses
nothing. A field whose value is ABSENT is left out of the output (a key that is only there
sometimes); a key missing from the input takes the field's default, and an object parsed
from data writes back the keys it was read with, in their order, so passing a peer's part
through changes nothing.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any, Union


class _Absent:
    """The value of a field whose key was not there (and is not written)."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "ABSENT"

    def __bool__(self) -> bool:
        return False


ABSENT: Any = _Absent()


class WireEnum(str, enum.Enum):
    """An enum whose members are their wire strings: equal to them, JSON-encoded and
    formatted as them."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@functools.cache
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_union(hint) -> bool:
    return typing.get_origin(hint) in (Union, types.UnionType)


def _parse(hint, value):
    if value is None or value is ABSENT:
        return value
    if _is_union(hint):
        options = [h for h in typing.get_args(hint) if h not in (type(None), _Absent)]
        for option in options:  # the first that fits (bool before int, classes first)
            if _fits(option, value):
                return _parse(option, value)
        return value
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return [_parse(item, v) for v in value]
    if origin is dict:
        _, item = typing.get_args(hint) or (Any, Any)
        return {k: _parse(item, v) for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, Wire) and isinstance(value, dict):
        return hint.from_wire(value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            return value  # a peer's newer name: kept as its string
    return value


def _fits(hint, value) -> bool:
    origin = typing.get_origin(hint) or hint
    if origin is Any:
        return True
    if isinstance(origin, type) and issubclass(origin, Wire):
        return isinstance(value, dict)
    if origin is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(origin, type) and issubclass(origin, enum.Enum):
        return isinstance(value, str)
    return isinstance(origin, type) and isinstance(value, origin)


def _dump(value):
    if isinstance(value, Wire):
        return value.to_wire()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list):
        return [_dump(v) for v in value]
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    return value


class Wire:
    """Mixin for dataclasses that cross a process boundary as JSON."""

    @classmethod
    def from_wire(cls, data: dict):
        hints = _hints(cls)
        known = {}
        for f in dataclasses.fields(cls):
            if f.name != "extra" and f.name in data:
                known[f.name] = _parse(hints[f.name], data[f.name])
        if any(f.name == "extra" for f in dataclasses.fields(cls)):
            names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
            known["extra"] = {k: v for k, v in data.items() if k not in names}
        parsed = cls(**known)
        parsed._wire_keys = tuple(data)
        return parsed

    def to_wire(self) -> dict:
        """Declared fields in order, then `extra`; an object parsed from data writes the keys
        it was read with, in their order (then any extra key added since)."""
        extra = getattr(self, "extra", {})
        keys = getattr(self, "_wire_keys", None)
        if keys is None:
            keys = [f.name for f in dataclasses.fields(self) if f.name != "extra"]
        out = {}
        for key in keys:
            value = extra[key] if key in extra else getattr(self, key, ABSENT)
            if value is not ABSENT:
                out[key] = _dump(value)
        for key, value in extra.items():
            if key not in out:
                out[key] = _dump(value)
        return out


def json_schema(hint) -> dict:
    """The JSON Schema of a type hint (a Wire dataclass: an object with its fields, described
    by its docstring; only classes with `extra` allow keys they do not name)."""
    if hint is Any:
        return {}
    if _is_union(hint):
        options = [h for h in typing.get_args(hint) if h is not _Absent]
        schemas = [json_schema(h) for h in options]
        return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if hint is type(None):
        return {"type": "null"}
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return {"type": "array", "items": json_schema(item)}
    if origin is dict:
        _, item = typing.get_args(hint) or (Any, Any)
        return {"type": "object", "additionalProperties": json_schema(item)}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return {"type": "string", "enum": [m.value for m in hint]}
    if isinstance(hint, type) and issubclass(hint, Wire):
        hints = _hints(hint)
        fields = [f for f in dataclasses.fields(hint) if f.name != "extra"]
        schema = {"type": "object", "properties": {f.name: json_schema(hints[f.name])
                                                   for f in fields}}
        if hint.__doc__ and not hint.__doc__.startswith(f"{hint.__name__}("):  # not dataclass's
            schema["description"] = " ".join(hint.__doc__.split())
        if len(fields) == len(dataclasses.fields(hint)):
            schema["additionalProperties"] = False
        return schema
    simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
    return {"type": simple[hint]} if hint in simple else {}
