"""Faults: real signals to real processes, whose pids come from /v1/state, sent at a logical
moment (stream j has received k tokens; for kill-rank also while a prompt is mid-prefill)."""

from __future__ import annotations

import os
import signal
from urllib.parse import urlparse

import psutil

from tokstream.errors import UserInputError

from tokstream.chaos.api import ServerAPI
from tokstream.chaos.workload import Recorder
from tokstream.state_snapshot import RequestRow, StateSnapshot

TRIGGER_TIMEOUT_S = 300.0
LONG_PROMPT_TRIES = 3
STOPPING = {"stall-rank", "hang-engine"}
"""The faults that stop a process (a hang) rather than kill it."""
ENGINE_FAULTS = {"kill-engine", "hang-engine"}
"""The faults that hit the engine core rather than a rank."""


def victim(state: StateSnapshot, fault: str, rank: int | None, url: str) -> tuple[str, int]:
    """(what, pid) the fault hits, checked to be a process of the server listening on url (a
    descendant of its gateway), so a stale pid, or one a fake server names, is never
    signalled."""
    if fault in ENGINE_FAULTS:
        what, pid = "engine core", state.engine.pid
    else:
        ranks = state.ranks
        if rank is None or not 0 <= rank < len(ranks):
            raise UserInputError(f"rank {rank}: the server has ranks 0..{len(ranks) - 1} "
                                 f"(--tp {len(ranks)})")
        what, pid = f"rank {rank}", ranks[rank].pid
    gateway = check_gateway(url, state.gateway.pid)
    try:
        process = psutil.Process(pid)
        if gateway.pid not in {parent.pid for parent in process.parents()}:
            raise UserInputError(f"{what} pid {pid} is not a child of the server's gateway "
                                 f"(pid {gateway.pid}); refusing to signal it")
    except psutil.NoSuchProcess:
        raise UserInputError(f"{what} pid {pid} from /v1/state is not running on this "
                             "machine; chaos needs a server on this machine") from None
    return what, pid


def check_gateway(url: str, pid: int) -> psutil.Process:
    """The gateway process /v1/state names, once it is proven to be a `tokstream serve` of
    this user that holds the listening socket of url (what /v1/state says is not trusted)."""
    port = urlparse(url).port
    try:
        process = psutil.Process(pid)
        listening = {c.laddr.port for c in process.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN}
        uid = process.uids().real
        cmdline = process.cmdline()
    except psutil.Error:
        raise UserInputError(f"gateway pid {pid} from /v1/state is not a process of this "
                             "user on this machine; refusing to signal anything") from None
    if port not in listening:
        raise UserInputError(f"gateway pid {pid} from /v1/state is not the process listening "
                             f"on {url}; refusing to signal anything")
    if uid != os.getuid():
        raise UserInputError(f"the server on {url} runs as another user; refusing to signal it")
    if not _is_tokstream_serve(cmdline):
        raise UserInputError(f"the process listening on {url} (pid {pid}) is not a tokstream "
                             "server; refusing to signal anything")
    return process


def _is_tokstream_serve(cmdline: list[str]) -> bool:
    names = [os.path.basename(arg) for arg in cmdline]
    return "serve" in cmdline and ("tokstream" in names
                                   or any(a == "-m" and b == "tokstream"
                                          for a, b in zip(cmdline, cmdline[1:])))


def prefilling(state: StateSnapshot, request_id: str | None) -> RequestRow | None:
    """The request's /v1/state row while its prompt is part-way through prefill."""
    for row in state.requests:
        computed = row.computed_tokens or 0
        if row.id == request_id and row.state == "running" and 0 < computed < row.prompt_tokens:
            return row
    return None


def decoding(state: StateSnapshot) -> list[RequestRow]:
    return [r for r in state.requests if r.state == "running" and r.output_tokens > 0]


async def await_trigger(api: ServerAPI, recorder: Recorder, fault: str, j: int, k: int,
                        long_prompt) -> tuple[StateSnapshot | None, str]:
    """Wait for the moment; returns (the /v1/state snapshot taken at it, a description), or
    (None, why not) if the workload never got there. The long prompt (long_prompt(attempt)
    makes one) goes out with the decoding streams, so its prefill overlaps their decoding;
    for kill-rank, if its prefill has ended by the time stream j has k tokens (a fast model),
    another one is sent, a few times, while the others still decode."""
    recorder.start(long_prompt(0))
    long = recorder.histories[-1]
    if not await recorder.until(j, k, TRIGGER_TIMEOUT_S):
        return None, f"stream s{j} ended or stalled before receiving {k} tokens"
    first = f"stream s{j} had received {k} tokens"
    if fault != "kill-rank":
        return await api.state(), first
    for attempt in range(1, LONG_PROMPT_TRIES + 1):
        def mid_batch(state: StateSnapshot) -> bool:
            return (prefilling(state, long.request_id) is not None
                    and len(decoding(state)) >= 2)

        state, _ = await api.state_until(
            lambda s: mid_batch(s) or bool(long.tokens) or long.ended_at is not None,
            TRIGGER_TIMEOUT_S, interval_s=0.01)
        if mid_batch(state):
            row = prefilling(state, long.request_id)
            return state, (f"{first}; the long prompt was mid-prefill "
                           f"({row.computed_tokens}/{row.prompt_tokens} tokens) while "
                           f"{len(decoding(state))} streams were decoding")
        if attempt < LONG_PROMPT_TRIES:
            recorder.start(long_prompt(attempt))
            long = recorder.histories[-1]
    return None, (f"{first}, but in {LONG_PROMPT_TRIES} tries no moment had a long prompt "
                  "mid-prefill and two streams decoding (a server that prefills a long prompt "
                  "in one step needs --max-prefill-chunk)")


def inject(fault: str, pid: int) -> psutil.Process:
    """Send the fault's signal to pid; returns the process (psutil re-checks its identity
    before any later signal, so a reused pid is never hit)."""
    process = psutil.Process(pid)
    try:
        process.send_signal(signal.SIGSTOP if fault in STOPPING else signal.SIGKILL)
    except psutil.AccessDenied:
        raise UserInputError(f"not permitted to signal pid {pid} (the server runs as another "
                             "user)") from None
    return process


def release_stopped(process: psutil.Process) -> str:
    """A stopped process is never left behind: continued if it is still there (the engine
    should have SIGKILLed it). Returns what was found."""
    try:
        if process.status() != psutil.STATUS_ZOMBIE:
            process.send_signal(signal.SIGCONT)
            return "still there: continued (SIGCONT)"
    except psutil.NoSuchProcess:
        pass
    return "gone (the engine killed it)"
