"""Host and device figures for /v1/state: each process's memory and CPU (psutil), the host's
memory, and CUDA devices' memory and utilisation (NVML, when pynvml is installed)."""

from __future__ import annotations

import psutil

from tokstream.process_end import running
from tokstream.state_snapshot import DeviceMemory, HostMemory, Memory, ProcessRow


class ProcessUsage:
    """Memory and CPU of the gateway, engine core and ranks, measured per snapshot."""

    def __init__(self):
        self._processes: dict[int, psutil.Process] = {}
        """pid -> Process, kept between snapshots: CPU percent is measured since the last call."""

    def measure(self, pids: list[int | None]) -> dict:
        """pid -> {"rss_bytes", "cpu_percent"} (None where unknown; CPU percent of one core
        since the previous snapshot, None on a process's first)."""
        self._processes = {pid: process for pid, process in self._processes.items()
                           if pid in pids}
        usage = {}
        for pid in pids:
            usage[pid] = {"rss_bytes": None, "cpu_percent": None}
            if not pid:
                continue
            try:
                process = self._processes.get(pid)
                first = process is None
                if first:
                    process = self._processes[pid] = psutil.Process(pid)
                with process.oneshot():
                    usage[pid] = {"rss_bytes": process.memory_info().rss,
                                  "cpu_percent": None if first else process.cpu_percent()}
                    if first:
                        process.cpu_percent()  # the baseline for the next snapshot
            except psutil.Error:
                self._processes.pop(pid, None)
        return usage


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        return running(psutil.Process(pid))
    except psutil.Error:
        return False


def memory(processes: list[tuple[str, int | None]], usage: dict, device: str) -> Memory:
    """The host's memory, each (role, pid)'s usage (as ProcessUsage.measure gave it), and
    CUDA devices' memory."""
    host = psutil.virtual_memory()
    return Memory(HostMemory(host.total, host.available, psutil.cpu_count()),
                  [ProcessRow(role, pid, **usage[pid]) for role, pid in processes],
                  device_memory() if device == "cuda" else [])


def device_memory() -> list[DeviceMemory]:
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
        out = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            out.append(DeviceMemory(index, info.total, info.used,
                                    pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))
        return out
    except pynvml.NVMLError:
        return []
