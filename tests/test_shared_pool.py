"""A CPU KV pool in the engine core's memory file outlives the rank that mapped it: another
mapping of the same path (the rank that replaces it) reads what the first one wrote."""

import os

import torch

from tokstream.engine.recovery.pool_files import PoolFiles
from tokstream.worker.shared_pool import carve, map_pool_file, pool_bytes

SHAPE = (3, 5, 16, 8)


def test_a_second_mapping_reads_what_the_first_wrote():
    files = PoolFiles(tp=2)
    try:
        nbytes = pool_bytes(4, SHAPE, torch.float32)
        first = carve(map_pool_file(files.paths().ranks[1], nbytes), 4, SHAPE, torch.float32)
        assert all(int(t.count_nonzero()) == 0 for t in first)  # zero until written
        first[3][1, 2] = 7.5
        again = carve(map_pool_file(files.paths().ranks[1], nbytes), 4, SHAPE, torch.float32)
        assert torch.equal(again[3], first[3]) and float(again[3][1, 2, 0, 0]) == 7.5
        assert int(again[2].count_nonzero()) == 0  # tensors do not overlap
        other = carve(map_pool_file(files.paths().ranks[0], nbytes), 4, SHAPE, torch.float32)
        assert int(other[3].count_nonzero()) == 0  # each rank position has its own file
    finally:
        files.close()


def test_a_pool_of_another_size_or_a_missing_file_is_refused():
    files = PoolFiles(tp=1)
    try:
        nbytes = pool_bytes(2, SHAPE, torch.float32)
        assert map_pool_file(files.paths().ranks[0], nbytes) is not None
        assert map_pool_file(files.paths().ranks[0], nbytes * 2) is None
    finally:
        files.close()
    assert map_pool_file(f"/proc/{os.getpid()}/fd/999999", 4096) is None
    assert files.paths() is None  # closed: ranks allocate pools of their own


def test_groups_that_map_one_pool_file_do_not_split_the_kv_budget(monkeypatch):
    """The spare group and the spare core map the gateway's pool files: the replica's budget
    is one pool. A pool of every group's own splits it between them."""
    import psutil

    from tokstream.config import EngineConfig
    from tokstream.model.source import resolve_model
    from tokstream.worker.model_runner import kv_pool_blocks

    available = 2**30  # well under the 4 GiB default cap, so the split shows
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("M", (), {"available": available}))
    config = EngineConfig(model="dummy:tiny", spare=True, spare_core=True)
    config.scheduler.max_num_seqs = 10**6  # the sequence cap must not bind either
    model = resolve_model(config.model).config
    cpu = torch.device("cpu")
    own, _ = kv_pool_blocks(config, model, "float32", cpu)
    shared, _ = kv_pool_blocks(config, model, "float32", cpu, shared=True)
    assert abs(shared - 3 * own) <= 3  # a third each, to the block
