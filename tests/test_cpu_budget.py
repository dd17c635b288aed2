"""Rank threads come from the pod's CPU limit (issue 32 item 6): the cgroup quota (v2 cpu.max,
v1 cpu.cfs_quota_us / cpu.cfs_period_us) caps the affinity's core count. Fake cgroup folders
laid out as the kernel does; the process's affinity is set to a 64-core node."""

from __future__ import annotations

import os

import pytest

from tokstream import cpu_budget
from tokstream.config import EngineConfig
from tokstream.cpu_budget import cgroup_cpu_quota, usable_cores

NODE = set(range(64))


@pytest.fixture
def node(monkeypatch, tmp_path):
    """A 64-core node's affinity and an empty cgroup tree; returns (root, /proc/self/cgroup)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: NODE)
    root = tmp_path / "cgroup"
    root.mkdir()
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("0::/\n")
    monkeypatch.setattr(cpu_budget, "CGROUP_ROOT", root)
    monkeypatch.setattr(cpu_budget, "PROC_SELF_CGROUP", proc)
    return root, proc


def write(folder, **files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("__", ".")).write_text(text + "\n")


def test_v2_container_limit(node):
    root, proc = node
    write(root, cpu__max="400000 100000")  # limits.cpu: "4"
    assert cgroup_cpu_quota() == 4.0
    assert usable_cores() == 4


def test_v2_no_limit_is_the_affinity(node):
    root, _ = node
    write(root, cpu__max="max 100000")
    assert cgroup_cpu_quota() is None
    assert usable_cores() == 64


def test_v2_the_tightest_ancestor_counts(node):
    """Outside a cgroup namespace the process's own folder may be unlimited while the pod's
    (its parent) holds the limit."""
    root, proc = node
    proc.write_text("0::/kubepods/pod-1/container-1\n")
    write(root / "kubepods", cpu__max="max 100000")
    write(root / "kubepods" / "pod-1", cpu__max="250000 100000")
    write(root / "kubepods" / "pod-1" / "container-1", cpu__max="max 100000")
    assert cgroup_cpu_quota() == 2.5
    assert usable_cores() == 2  # rounded down: the half core is the gateway's and the core's


def test_v1_cfs_quota(node):
    root, proc = node
    proc.write_text("4:cpu,cpuacct:/\n3:memory:/\n")
    write(root / "cpu,cpuacct", cpu__cfs_quota_us="300000", cpu__cfs_period_us="100000")
    assert usable_cores() == 3


def test_v1_unlimited(node):
    root, proc = node
    proc.write_text("4:cpu,cpuacct:/\n")
    write(root / "cpu,cpuacct", cpu__cfs_quota_us="-1", cpu__cfs_period_us="100000")
    assert usable_cores() == 64


def test_affinity_below_the_quota_wins_and_a_small_quota_is_one_core(node, monkeypatch):
    root, _ = node
    write(root, cpu__max="800000 100000")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert usable_cores() == 2
    write(root, cpu__max="50000 100000")
    assert usable_cores() == 1


def test_unreadable_cgroups_fall_back_to_the_affinity(node):
    _, proc = node
    proc.unlink()
    assert usable_cores() == 64


def test_rank_threads_follow_the_pod_limit(node):
    """What a rank gives torch: the quota's cores split between the tp ranks."""
    torch = pytest.importorskip("torch")
    from tokstream.worker.worker import set_threads

    root, _ = node
    write(root, cpu__max="400000 100000")
    before = torch.get_num_threads()
    try:
        assert set_threads(EngineConfig(tp=2)) == 2
        assert torch.get_num_threads() == 2
        assert set_threads(EngineConfig(tp=1)) == 4
    finally:
        torch.set_num_threads(before)
