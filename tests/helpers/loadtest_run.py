"""Running `tokstream loadtest` from a test: the mix file it reads (written from plain data),
the keys of the mixes' two tenants, and the command itself as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

KEYS = {"sk-a": "alpha", "sk-b": "beta"}
"""API key -> tenant, as the fake server checks them and a --keys file gives them."""
TENANTS = {tenant: 1 for tenant in KEYS.values()}
"""A mix's [tenants] table: the two tenants above, with equal weights."""
SHORT = {"name": "short", "prompt_tokens": [30, 60], "output_tokens": [3, 6]}
"""The small requests the mixes send most."""


def flood(prompt_tokens: int, burst_every_s: float) -> dict:
    """A class only its bursts send (weight 0): two requests every burst_every_s."""
    return {"name": "flood", "weight": 0, "prompt_tokens": prompt_tokens, "output_tokens": 2,
            "burst_every_s": burst_every_s, "burst_size": 2}


def _toml(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(_toml, value)) + "]"
    return json.dumps(value)  # a number, bool or plain string is spelled alike in TOML


def mix_toml(run: dict, classes: list[dict], tenants: dict | None = None) -> str:
    """A mix file: its [run] table, its [tenants] weights and a [[class]] per class."""
    tables = [("[run]", run), *([("[tenants]", tenants)] if tenants else []),
              *(("[[class]]", c) for c in classes)]
    lines = ['kind = "mix"']
    for header, table in tables:
        lines += [header, *(f"{key} = {_toml(value)}" for key, value in table.items())]
    return "\n".join(lines) + "\n"


def write_mix(folder: Path, run: dict, classes: list[dict],
              tenants: dict | None = None) -> tuple[str, str | None]:
    """(mix.toml, keys.toml or None) written in folder; the keys file only for tenants."""
    (folder / "mix.toml").write_text(mix_toml(run, classes, tenants))
    if not tenants:
        return str(folder / "mix.toml"), None
    (folder / "keys.toml").write_text("".join(f'{t} = "{k}"\n' for k, t in KEYS.items()))
    return str(folder / "mix.toml"), str(folder / "keys.toml")


def loadtest(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`tokstream loadtest ARGS` run to its end, its output captured."""
    return subprocess.run([sys.executable, "-m", "tokstream", "loadtest", *args],
                          capture_output=True, text=True, timeout=timeout)
