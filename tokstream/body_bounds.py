"""The bounds of a numeric sampling option in a request body, declared once on its
SamplingParams field (`metadata={"body": on_apis(...)}`): the gateway's check on each API, the
OpenAPI schema and SamplingParams' own check all read them. Light: no torch, no server."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

APIS = ("openai", "anthropic")


@dataclass(frozen=True)
class Bound:
    """What one API accepts for a field."""

    minimum: float
    maximum: float | None = None
    """None: no upper bound."""
    exclusive_minimum: bool = False
    integer: bool = False
    description: str = ""
    """Said in the OpenAPI schema (an extension's origin, what a special value means)."""

    def schema(self) -> dict:
        """The field's JSON schema."""
        schema: dict = {"type": "integer" if self.integer else "number"}
        schema["exclusiveMinimum" if self.exclusive_minimum else "minimum"] = self.minimum
        if self.maximum is not None:
            schema["maximum"] = self.maximum
        if self.description:
            schema["description"] = self.description
        return schema

    def holds(self, value: float) -> bool:
        low_ok = value > self.minimum if self.exclusive_minimum else value >= self.minimum
        return low_ok and (self.maximum is None or value <= self.maximum)

    def shown(self) -> str:
        """The range as an error message says it: [0, 2], (0, 1], >= 0."""
        if self.maximum is None:
            return f"{'>' if self.exclusive_minimum else '>='} {self.minimum:g}"
        return (f"in {'(' if self.exclusive_minimum else '['}{self.minimum:g}, "
                f"{self.maximum:g}]")


def on_apis(openai: Bound | None = None, anthropic: Bound | None = None, *,
            both: Bound | None = None) -> dict[str, Bound]:
    """A field's bounds per API (both: the same on each); an API not named does not read it."""
    if both is not None:
        return {api: both for api in APIS}
    return {api: bound for api, bound in (("openai", openai), ("anthropic", anthropic))
            if bound is not None}


def body_bounds(params_type: type, api: str) -> dict[str, tuple[Bound, object]]:
    """name -> (its bound on api, its default) for every field of params_type api reads."""
    out = {}
    for f in fields(params_type):
        bound = f.metadata.get("body", {}).get(api)
        if bound is not None:
            out[f.name] = (bound, f.default)
    return out


def widest(bounds: dict[str, Bound]) -> Bound:
    """What every API together accepts: SamplingParams' own check (a value some API takes is
    a value the engine serves)."""
    chosen = list(bounds.values())
    low = min(chosen, key=lambda b: (b.minimum, not b.exclusive_minimum))
    highs = [b.maximum for b in chosen]
    return Bound(low.minimum, None if None in highs else max(highs), low.exclusive_minimum,
                 low.integer)


def check_bounds(params) -> str | None:
    """The first bounded field of params outside what every API together accepts, as an
    error message (None: all within)."""
    for f in fields(params):
        bounds = f.metadata.get("body")
        value = getattr(params, f.name)
        if not bounds or value is None:
            continue
        bound = widest(bounds)
        kind = "an integer" if bound.integer else "a number"
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or (bound.integer and not isinstance(value, int)):
            return f"{f.name} must be {kind}, got {value!r}"
        if not (math.isfinite(value) and bound.holds(value)):
            return f"{f.name} must be {bound.shown()}, got {value:g}"
    return None
