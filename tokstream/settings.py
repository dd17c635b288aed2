"""Serve settings: the flags `tokstream serve` takes and the serving profiles it loads, both
derived from the config dataclasses in tokstream/config.py and tokstream/gateway_config.py
(one profile section a dataclass, one key and one flag a field). Flags win, then the profile, then the dataclass defaults."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from tokstream.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tokstream.errors import UserInputError
from tokstream.gateway_config import AdmissionConfig, ServerConfig
from tokstream.options import Flag, config_flags, is_bytes
from tokstream.toml_file import read_toml

_PACKAGE = Path(__file__).resolve().parent
PROFILE_DIR = (_PACKAGE / "profiles" if (_PACKAGE / "profiles").is_dir()
               else _PACKAGE.parent / "profiles")
"""profiles/: tokstream/profiles in a wheel install, the repository's top folder in a checkout."""

SECTIONS: dict[str, type] = {"engine": EngineConfig, "cache": CacheConfig,
                             "scheduler": SchedulerConfig, "speculative": SpeculativeConfig,
                             "server": ServerConfig, "admission": AdmissionConfig}
"""A serving profile's sections and the config each one fills."""

NESTED = {"cache", "scheduler", "speculative", "admission"}
"""Fields of EngineConfig / ServerConfig that hold another section's config."""

FLAG_NAMES = {"model": ("--model", "-m"), "tenants_file": ("--tenants",),
              "enable_prefix_caching": ("--prefix-caching",),
              "down_retry_s": ("--down-retry-interval",), "method": ("--speculative",)}
"""Flags whose established spelling is not the field's name (options.flag_name)."""

SERVE_FLAGS: list[Flag] = [flag for section, cls in SECTIONS.items()
                           for flag in config_flags(section, cls, skip=NESTED,
                                                    names=FLAG_NAMES,
                                                    hidden={"demux_mutation"})]
"""Every serve flag: one per config field."""


def flags_for(*fields: str) -> list[Flag]:
    """The serve flags of these fields (what another command, such as bench, also takes)."""
    by_field = {flag.field: flag for flag in SERVE_FLAGS}
    return [by_field[name] for name in fields]


def profile_keys(section: str) -> set[str]:
    return {f.name for f in dataclasses.fields(SECTIONS[section])} - NESTED


def load_profile(name_or_path: str) -> dict[str, dict]:
    """A serving profile: {section: {field: value}} for the sections above. NAME looks in
    profiles/ for NAME.toml; anything with a slash or a .toml suffix is a path."""
    path = Path(name_or_path)
    if not (path.suffix == ".toml" or "/" in name_or_path):
        path = PROFILE_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        available = sorted(p.stem for p in PROFILE_DIR.glob("*.toml")
                           if _is_serving_profile(p))
        raise UserInputError(f"profile {name_or_path!r} not found (available: "
                             f"{', '.join(available) or 'none'})")
    data = read_toml(path, "profile")
    unknown = set(data) - set(SECTIONS) - {"description", "kind"}
    if unknown:
        raise UserInputError(f"profile {path}: unknown section(s) {', '.join(sorted(unknown))}")
    return {section: dict(data.get(section, {})) for section in SECTIONS}


def _is_serving_profile(path: Path) -> bool:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8")).get("kind") == "serve"
    except (OSError, tomllib.TOMLDecodeError):
        return False


def section_values(section: str, preset: dict, flags: dict) -> dict:
    """One section's settings: the profile's values, then the flags given (None: not given);
    sizes ("4GiB") become bytes."""
    from tokstream.plan import parse_size

    values = dict(preset)
    unknown = set(values) - profile_keys(section)
    if unknown:
        raise UserInputError(f"profile [{section}]: unknown setting(s) "
                             f"{', '.join(sorted(unknown))}")
    values.update({k: v for k, v in flags.items() if v is not None})
    for f in dataclasses.fields(SECTIONS[section]):
        if is_bytes(f) and values.get(f.name) is not None:
            values[f.name] = parse_size(values[f.name])
    return values


def build_settings(preset: dict[str, dict], flags: dict[str, dict]) -> tuple[EngineConfig,
                                                                                ServerConfig]:
    merged = {section: section_values(section, preset.get(section, {}),
                                      flags.get(section, {})) for section in SECTIONS}
    try:
        engine = EngineConfig(**merged["engine"], cache=CacheConfig(**merged["cache"]),
                              scheduler=SchedulerConfig(**merged["scheduler"]),
                              speculative=SpeculativeConfig(**merged["speculative"]))
        server = ServerConfig(**merged["server"],
                              admission=AdmissionConfig(**merged["admission"]))
    except TypeError as error:
        raise UserInputError(f"bad setting: {error}") from None
    return engine, server
