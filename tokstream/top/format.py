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
    """Bytes in binary units: 512 B, 12 KiB, 909.1 MiB, 80.0 GiB."""
    if value is None:
        return "-"
    if value < 1024 ** 2:
        return f"{value:.0f} B" if value < 1024 else f"{value / 1024:.0f} KiB"
    if value < 1024 ** 3:
        return f"{value / 1024 ** 2:.1f} MiB"
    return f"{value / 1024 ** 3:.1f} GiB"


def clock(unix_time: float | None) -> str:
    """UTC wall time of an event, HH:MM:SS (UTC so that two viewers agree)."""
    return "-" if unix_time is None else time.strftime("%H:%M:%S", time.gmtime(unix_time))
