"""Serve settings from a profile plus flags: flags win, then the profile, then the defaults."""

from __future__ import annotations

from tokstream.config import CacheConfig, EngineConfig, SchedulerConfig
from tokstream.errors import UserInputError
from tokstream.server.admission import AdmissionConfig
from tokstream.server.config import ServerConfig, field_names

SECTIONS = {"engine": EngineConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
            "server": ServerConfig, "admission": AdmissionConfig}
ENGINE_FIELDS = {"model", "dtype", "weights", "device", "seed", "num_threads", "tp", "spare",
                 "spare_core", "step_timeout_s", "collective_timeout_s", "max_recovery_attempts",
                 "max_request_failures", "start_timeout_s"}
SERVER_FIELDS = field_names(ServerConfig) - {"admission"}


def build_settings(preset: dict[str, dict], flags: dict[str, dict]) -> tuple[EngineConfig,
                                                                                ServerConfig]:
    merged: dict[str, dict] = {}
    for section, cls in SECTIONS.items():
        allowed = (ENGINE_FIELDS if section == "engine" else
                   SERVER_FIELDS if section == "server" else field_names(cls))
        values = dict(preset.get(section, {}))
        unknown = set(values) - allowed
        if unknown:
            raise UserInputError(f"profile [{section}]: unknown setting(s) "
                                 f"{', '.join(sorted(unknown))}")
        values.update({k: v for k, v in flags.get(section, {}).items() if v is not None})
        merged[section] = values
    cache = merged["cache"]
    from tokstream.plan import parse_size
    for size in ("kv_cache_memory", "swap_space"):
        if size in cache:
            cache[size] = parse_size(cache[size])
    try:
        engine = EngineConfig(**merged["engine"], cache=CacheConfig(**cache),
                              scheduler=SchedulerConfig(**merged["scheduler"]))
        server = ServerConfig(**merged["server"],
                              admission=AdmissionConfig(**merged["admission"]))
    except TypeError as error:
        raise UserInputError(f"bad setting: {error}") from None
    return engine, server
