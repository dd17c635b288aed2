"""How many cores this process may really use: the CPUs it may run on (its affinity), capped by
its cgroup's CPU quota (a Kubernetes pod's `limits.cpu`, docker's `--cpus`). torch and OpenMP
count the node's cores and ignore the quota, so a pod limited to 4 cores on a 64-core node would
start 64 threads per rank and be throttled for most of every period; ranks size their threads
from this instead (see DESIGN: CPU threads are a budget)."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


def usable_cores(root: Path | None = None, proc_cgroup: Path | None = None) -> int:
    """min(the CPUs in this process's affinity, its cgroup CPU quota rounded down), at least 1.
    A fractional quota rounds down: the remainder is what the gateway and engine core use."""
    affinity = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                else os.cpu_count() or 1)
    quota = cgroup_cpu_quota(root, proc_cgroup)
    if quota is None:
        return max(1, affinity)
    return max(1, min(affinity, math.floor(quota)))


def cgroup_cpu_quota(root: Path | None = None, proc_cgroup: Path | None = None) -> float | None:
    """The CPU quota in cores of this process's cgroup (the tightest of it and its ancestors),
    cgroup v2 or v1; None when there is none or nothing can be read. root and proc_cgroup
    default to CGROUP_ROOT and PROC_SELF_CGROUP (read at each call)."""
    root = CGROUP_ROOT if root is None else root
    proc_cgroup = PROC_SELF_CGROUP if proc_cgroup is None else proc_cgroup
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    quotas = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2: "0::/kubepods/.../container"
            quotas += [_v2_quota(folder) for folder in _up_to(root, path)]
        elif "cpu" in controllers.split(","):  # v1: "4:cpu,cpuacct:/docker/abc"
            for mount in (root / controllers, root / "cpu,cpuacct", root / "cpu"):
                if mount.is_dir():
                    quotas += [_v1_quota(folder) for folder in _up_to(mount, path)]
                    break
    if not lines:  # no /proc here (a test, another OS): the folder's own files, if any
        quotas += [_v2_quota(root), _v1_quota(root), _v1_quota(root / "cpu")]
    found = [quota for quota in quotas if quota is not None]
    return min(found) if found else None


def _up_to(mount: Path, path: str) -> list[Path]:
    """The cgroup folder for `path` under `mount` and each parent up to the mount. Inside a
    container's cgroup namespace the path is "/" (the mount is the container's own cgroup);
    a path that does not exist under the mount (not namespaced the way it says) counts as "/"."""
    folder = mount / path.strip("/")
    if not folder.is_dir():
        folder = mount
    chain = [folder]
    while folder != mount and mount in folder.parents:
        folder = folder.parent
        chain.append(folder)
    return chain


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _v2_quota(folder: Path) -> float | None:
    """cpu.max is "QUOTA PERIOD" in microseconds, QUOTA "max" when unlimited."""
    text = _read(folder / "cpu.max")
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max":
        return None
    try:
        return int(quota) / int(period or 100000)
    except (ValueError, ZeroDivisionError):
        return None


def _v1_quota(folder: Path) -> float | None:
    """cpu.cfs_quota_us (-1 when unlimited) over cpu.cfs_period_us."""
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    try:
        quota_us, period_us = int(quota), int(period)
    except (TypeError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None
