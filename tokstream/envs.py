"""Every environment variable tokstream reads, declared and read here (as vLLM's envs.py does):
its name, its default and what it is for. Options a user sets belong in tokstream/config.py
(or gateway_config.py); these are switches for kernels, diagnostics and test hooks, read when asked (never cached), so
a test may set one and a child process inherits it. No imports beyond os: workers, the
forkserver, `tokstream --help` and the kernels (the bottom layer) all import this."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Switch:
    name: str
    default: str
    help: str

    def get(self) -> str:
        return os.environ.get(self.name, self.default)

    def is_set(self) -> bool:
        """Set to anything but the empty string."""
        return bool(os.environ.get(self.name))


LOG = Switch("TOKSTREAM_LOG", "WARNING",
             "Log level of the engine core and rank processes (`-v` sets INFO).")
KERNELS = Switch("TOKSTREAM_KERNELS", "auto",
                 "auto, torch or triton: which attention and decode kernels a worker runs "
                 "(torch on a GPU is the reference, to bisect a kernel bug).")
CUDA_GRAPHS = Switch("TOKSTREAM_CUDA_GRAPHS", "1", "0 runs every GPU step eagerly (no graphs).")
CPU_KERNELS = Switch("TOKSTREAM_CPU_KERNELS", "1",
                     "0 never builds or loads the C kernels: the torch reference runs.")
SHM_ALLREDUCE = Switch("TOKSTREAM_SHM_ALLREDUCE", "1",
                       "0 sends the CPU ranks' all-reduces through gloo (loopback TCP), not "
                       "through shared memory (kernels/cpu_shm_allreduce.py).")
DTYPE_PROBE = Switch("TOKSTREAM_DTYPE_PROBE", "",
                     "always: measure the bfloat16/float32 choice even on a CPU without native "
                     "bfloat16.")
SELF_CHECK = Switch("TOKSTREAM_SELF_CHECK", "",
                    "Set (as tests do): the engine core runs the block-manager self-check after "
                    "every step as well, not only after every recovery (/v1/state reports it).")
POISON = Switch("TOKSTREAM_POISON", "",
                "Tests and chaos only: rank:TOKEN SIGKILLs rank 0 as a step that prefills a "
                "prompt starting with TOKEN is sent, core:TOKEN the engine core itself: a "
                "request that breaks the replica every time (and only it: a sampled TOKEN "
                "elsewhere does nothing).")
GRAMMAR_GATE = Switch("TOKSTREAM_GRAMMAR_GATE", "",
                      "Tests only: a file path; rank 0 compiles no structured-output grammar "
                      "until that file exists (at most a minute): a grammar slow to compile, "
                      "for as long as a test needs.")
DEMUX_MUTATION = Switch("TOKSTREAM_DEMUX_MUTATION", "",
                        "No longer obeyed, only warned about: a variable left set in a shell "
                        "must not corrupt a real server's streams (serve's hidden "
                        "--demux-mutation flag is the test-only switch).")
STEP_TIMES = Switch("TOKSTREAM_STEP_TIMES", "",
                    "Diagnostics: a file path; the engine core appends one JSON line a step: its "
                    "tokens and rows, and where its time went (scheduling, the ranks' round "
                    "trip, rank 0's own compute, emitting). bench/served_step.py reads it.")
CC = Switch("CC", "", "The C compiler of the CPU kernels (default: cc or gcc on the PATH).")
XDG_CACHE_HOME = Switch("XDG_CACHE_HOME", "",
                        "Root of tokstream's caches (weights, dtype probes, compiled kernels); "
                        "default ~/.cache.")

SWITCHES = (LOG, KERNELS, CUDA_GRAPHS, CPU_KERNELS, SHM_ALLREDUCE, DTYPE_PROBE, SELF_CHECK, POISON,
            GRAMMAR_GATE, DEMUX_MUTATION, STEP_TIMES, CC, XDG_CACHE_HOME)


def cache_root() -> Path:
    """$XDG_CACHE_HOME, or ~/.cache: tokstream's caches live under it."""
    return Path(XDG_CACHE_HOME.get() or Path.home() / ".cache")
