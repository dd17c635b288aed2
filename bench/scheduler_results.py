"""The scheduler bench's results: numbers rounded for the JSON file, the file written, and a
figure set against its target."""

from __future__ import annotations

import json
import os


def rounded(value, digits=4):
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v, digits) for v in value]
    return value


def write_json(path: str, result: dict) -> None:
    """The results file, its numbers rounded, its folder made if need be."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rounded(result), f, indent=2)


def target(value, goal: str, met: bool) -> dict:
    return {"value": rounded(value), "target": goal, "met": bool(met)}
