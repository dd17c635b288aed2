"""Compiles a kernels/*.c file once per machine with its C compiler and loads it with ctypes.

The library is cached under $XDG_CACHE_HOME/tokstream/kernels, keyed by the source (and the
shared headers beside it), the flags
and the CPU's instruction sets (-march=native output only runs on CPUs that have them).
Without a compiler, or with TOKSTREAM_CPU_KERNELS=0, `build` returns None and callers run
their torch path instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from tokstream import envs

log = logging.getLogger("tokstream.kernels")

# Reassociation lets the compiler vectorise the dot products (sums in a different order,
# still float32); finite-math stays off because softmax relies on -inf.
BASE_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno",
              "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")


def cpu_flags() -> list[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return line.split(":", 1)[1].split()


def cpu_model() -> str:
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()
    return line.split(":", 1)[1].strip()


def cpu_kind(info: str | None = None) -> str:
    """A short name for this kind of CPU, for result files that must not overwrite another
    kind's: vendor, family and model, and its matrix class (amx, bf16 for avx512_bf16
    without AMX, avx512, avx2), e.g. 'amd-f25m17-bf16', 'intel-f6m143-amx'."""
    if info is None:
        try:
            info = Path("/proc/cpuinfo").read_text()
        except OSError:
            info = ""
    fields: dict[str, str] = {}
    for line in info.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    vendor = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}.get(
        fields.get("vendor_id", ""), fields.get("vendor_id", "cpu").lower() or "cpu")
    flags = set(fields.get("flags", "").split())
    matrix = ("amx" if "amx_tile" in flags else "bf16" if "avx512_bf16" in flags
              else "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "base")
    family, model = fields.get("cpu family", "?"), fields.get("model", "?")
    return f"{vendor}-f{family}m{model}-{matrix}"


def cpu_signature() -> str:
    return platform.machine() + " ".join(cpu_flags())


def library_path(source: Path, flags: tuple[str, ...]) -> Path:
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + " ".join(flags).encode()
                         + cpu_signature().encode()).hexdigest()[:16]
    return envs.cache_root() / "tokstream" / "kernels" / f"{source.stem}-{key}.so"


def build(source: Path, flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """The compiled library of `source`, built once per machine; None if unavailable."""
    if envs.CPU_KERNELS.get() == "0":
        return None
    compiler = envs.CC.get() or shutil.which("cc") or shutil.which("gcc")
    path = library_path(source, flags)
    try:
        if not path.exists():
            if compiler is None:
                log.warning("no C compiler: %s is not used", source.name)
                return None
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                built = Path(tmp) / path.name
                subprocess.run([compiler, *flags, str(source), "-o", str(built), "-lm"],
                               check=True, capture_output=True, text=True)
                os.replace(built, path)  # atomic: a concurrent builder never sees half a file
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("CPU kernel %s unavailable (%s); using torch instead", source.name, detail)
        return None


class Library:
    """One kernels/*.c file's library: built on the first load(), its functions' argument
    types set from `signatures` (name -> ctypes argument types for a function returning
    void, or (argument types, result type)). load() is None where no library can be had,
    then and ever after."""

    def __init__(self, source: Path, flags: tuple[str, ...], signatures: dict[str, list]):
        self.source, self.flags, self.signatures = source, flags, signatures
        self._library: ctypes.CDLL | None = None
        self._tried = False

    def load(self) -> ctypes.CDLL | None:
        if not self._tried:
            self._tried = True
            library = build(self.source, self.flags)
            if library is not None:
                for name, signature in self.signatures.items():
                    argtypes, restype = signature if isinstance(signature, tuple) \
                        else (signature, None)
                    function = getattr(library, name)
                    function.restype = restype
                    function.argtypes = argtypes
            self._library = library
        return self._library
