"""The memory ceiling: what is left after the weights, divided by the KV cost of one token, is
how many tokens (and so how many requests) a replica can hold at once. No torch here."""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING

from tokstream.config import ModelConfig
from tokstream.errors import UserInputError

if TYPE_CHECKING:  # rich is imported when a plan is drawn: `tokstream --help` reads PlanSpec
    from rich.table import Table

SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


@dataclass
class PlanSpec:
    """What `tokstream plan` is asked about besides the model: each field is one of its flags."""

    tp: int = 1
    """Devices of one tensor-parallel replica."""
    device_memory: str = "80GB"
    """Memory per device (decimal: 80GB = 80e9 B)."""
    dtype: str = "float16"
    """dtype of the weights and the KV cache."""
    avg_context: int = 2000
    """Average tokens per request."""
    reserve: str = "0"
    """Memory kept back per device (activations, etc.)."""


def parse_size(text: str | int) -> int:
    """'80GB' -> 80_000_000_000 bytes: decimal units (KB..TB), binary (KiB..TiB), bare bytes."""
    if isinstance(text, int):
        size = text
    else:
        match = _SIZE.fullmatch(str(text))
        unit = match.group(2).lower() if match else None
        if unit not in SIZE_UNITS:
            raise UserInputError(
                f"cannot read size {text!r}: write a number with B, KB, MB, GB, TB, KiB, MiB, "
                "GiB or TiB (e.g. 80GB)")
        size = int(Decimal(match.group(1)) * SIZE_UNITS[unit])
    if size < 0:
        raise UserInputError(f"size {text!r} must not be negative")
    return size


def compute_plan(config: ModelConfig, tp: int, device_memory: int, dtype: str,
                 avg_context: int, reserve: int = 0) -> dict:
    """The ceiling for one tensor-parallel replica of `tp` devices with `device_memory` each."""
    if tp < 1:
        raise UserInputError(f"tp must be >= 1, not {tp}")
    if config.num_heads % tp or config.num_kv_heads % tp:
        raise UserInputError(
            f"tp {tp} must divide both the {config.num_heads} attention heads and the "
            f"{config.num_kv_heads} KV heads of {config.name}")
    if device_memory <= 0:
        raise UserInputError("device memory must be > 0 bytes")
    if avg_context < 1:
        raise UserInputError("avg_context must be >= 1 token")
    if reserve < 0:
        raise UserInputError("reserve must be >= 0 bytes")

    weights = config.weight_bytes(dtype)
    weights_per_device = -(-weights // tp)  # each device holds a 1/tp shard, rounded up
    kv_per_token = config.kv_bytes_per_token(dtype)
    free_per_device = device_memory - reserve - weights_per_device
    kv_cache = tp * max(free_per_device, 0)
    max_cached_tokens = kv_cache // kv_per_token
    note = None
    if free_per_device <= 0:
        note = (f"weights need {format_bytes(weights_per_device)} per device but only "
                f"{format_bytes(device_memory - reserve)} is available: raise --tp or use a "
                "smaller dtype")
    elif max_cached_tokens < avg_context:
        note = (f"only {max_cached_tokens:,} tokens of KV cache fit: not one request of "
                f"{avg_context:,} tokens")
    return {
        "model": config.name,
        "tp": tp,
        "dtype": dtype,
        "device_memory_bytes": device_memory,
        "reserve_bytes": reserve,
        "weights_bytes": weights,
        "weights_bytes_per_device": weights_per_device,
        "kv_bytes_per_token": kv_per_token,
        "kv_cache_bytes": kv_cache,
        "max_cached_tokens": max_cached_tokens,
        "avg_context": avg_context,
        "max_concurrent_requests": max_cached_tokens // avg_context,
        "fits": free_per_device > 0,
        "note": note,
    }


def format_bytes(size: int) -> str:
    """Decimal units, as device memory is sold and as parse_size reads them."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size} B"


def render_plan(plan: dict) -> Table:
    from rich.table import Table

    table = Table(title=f"{plan['model']}  ·  tp {plan['tp']}  ·  {plan['dtype']}",
                  show_header=False)
    table.add_column("quantity", style="bold")
    table.add_column("value", justify="right")
    rows = [
        ("device memory", format_bytes(plan["device_memory_bytes"]) + " each"),
        ("reserved", format_bytes(plan["reserve_bytes"]) + " each"),
        ("weights", format_bytes(plan["weights_bytes"])),
        ("weights per device", format_bytes(plan["weights_bytes_per_device"])),
        ("KV cache per token", f"{plan['kv_bytes_per_token']:,} B"),
        ("KV cache (replica)", format_bytes(plan["kv_cache_bytes"])),
        ("tokens that fit", f"{plan['max_cached_tokens']:,}"),
        (f"requests at {plan['avg_context']:,} tokens", f"{plan['max_concurrent_requests']:,}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    if plan["note"]:
        table.caption = ("[red]" if not plan["fits"] else "[yellow]") + plan["note"]
    return table
