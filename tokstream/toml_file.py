"""Reading the TOML files users hand us (profiles, mixes, tenants, keys)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from tokstream.errors import UserInputError


def read_toml(path: str | Path, what: str) -> dict:
    """The file's table. A missing, unreadable or malformed file is one UserInputError line
    that starts with `what` (e.g. "tenants file") and names the file."""
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserInputError(f"{what} {path} not found") from None
    except OSError as error:
        raise UserInputError(f"{what} {path}: {error.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise UserInputError(f"{what} {path}: {error}") from None
