"""Whether this CPU may run bfloat16 matrix products (AVX-512 bf16 dot products, AMX tiles),
asked safely.

The CPU flags are a claim, not a proof: on a VM that advertised AMX, llama.cpp died at its
first tile instruction (invalid opcode). Linux also refuses tile instructions to a process
that has not asked for them (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA): oneDNN asks
before it uses tiles, and a rank asks too, before any bfloat16 product, so the answer is
logged and recorded. Whether a bfloat16 product really runs is tried once per machine in a
child process (a SIGILL there kills the child, never a rank), and the answer cached.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys

from tokstream.kernels import cpu_build
from tokstream.worker import probe_cache

log = logging.getLogger("tokstream.worker")

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
AMX_FLAGS = ("amx_tile", "amx_bf16")
SYS_ARCH_PRCTL = 158
"""x86-64 Linux system call number of arch_prctl."""
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
_PROBE = ("import torch; a = torch.randn(64, 576).bfloat16(); "
          "b = torch.randn(1536, 576).bfloat16(); "
          "torch.nn.functional.linear(a, b).float().sum().item(); print('ok')")
"""A bfloat16 linear at a real shape, what the bfloat16 weight path runs."""


def has_native_bf16(flags: list[str] | None = None) -> bool:
    flags = cpu_build.cpu_flags() if flags is None else flags
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def request_tile_permission(flags: list[str] | None = None, syscall=None) -> str:
    """'granted', 'refused' (the kernel said no: no tiles in this process) or 'absent' (the
    CPU claims no AMX). Asks the kernel; granting is per process and idempotent."""
    flags = cpu_build.cpu_flags() if flags is None else flags
    if not all(flag in flags for flag in AMX_FLAGS):
        return "absent"
    if syscall is None:
        if not sys.platform.startswith("linux") or os.uname().machine != "x86_64":
            return "refused"
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    long = ctypes.c_long  # variadic: every argument a full register
    if syscall(long(SYS_ARCH_PRCTL), long(ARCH_REQ_XCOMP_PERM), long(XFEATURE_XTILEDATA)) != 0:
        return "refused"
    granted = ctypes.c_uint64(0)
    if syscall(long(SYS_ARCH_PRCTL), long(ARCH_GET_XCOMP_PERM), ctypes.byref(granted)) != 0 \
            or not granted.value >> XFEATURE_XTILEDATA & 1:
        return "refused"
    return "granted"


def bfloat16_products_work(run=None) -> bool:
    """Whether a bfloat16 linear completes in a child process on this machine (cached per
    machine); False where the CPU has no native bfloat16 at all."""
    if not has_native_bf16():
        return False
    path = probe_cache.path("bfloat16-runs")
    cached = probe_cache.load(path)
    if cached is not None and isinstance(cached.get("works"), bool):
        return cached["works"]
    works, detail = (run or _run_probe)()
    if not works:
        log.warning("bfloat16 products failed in a probe process (%s): the CPU flags claim "
                    "them; they are not used", detail)
    probe_cache.store(path, {"works": works, "detail": detail}, 0.0)
    return works


def _run_probe(code: str = _PROBE) -> tuple[bool, str]:
    """(whether `code` ran to its 'ok' in a child process, what happened)."""
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    if done.returncode == 0 and done.stdout.strip().endswith("ok"):
        return True, "ok"
    return False, f"exit {done.returncode}: {done.stderr.strip()[-200:]}"


def describe(flags: list[str] | None = None) -> dict:
    """What a benchmark JSON records of the matrix units: flags claimed, tile permission."""
    flags = cpu_build.cpu_flags() if flags is None else flags
    return {"native_bf16": has_native_bf16(flags),
            "amx_flags": [f for f in flags if f.startswith("amx")],
            "tile_permission": request_tile_permission(flags)}
