"""Number formatting shared by top's widgets: every missing value prints as '-'."""

from __future__ import annotations

import time


def ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f} ms" if value < 1000 else f"{value / 1000:.1f} s"


def seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 60:
        return f"{value:.1f} s"
    minutes, secs = divmod(int(value), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def size(value: float | None) -> str:
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit in ("B", "KiB") else f"{value:.1f} {unit}"
        value /= 1024
    return "-"


def clock(unix_time: float | None) -> str:
    """UTC wall time of an event, HH:MM:SS (UTC so that two viewers agree)."""
    return "-" if unix_time is None else time.strftime("%H:%M:%S", time.gmtime(unix_time))
