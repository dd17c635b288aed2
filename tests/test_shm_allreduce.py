"""The CPU ranks' shared-memory all-reduce (kernels/cpu_shm_allreduce.py), in real processes
joined as torch.distributed does for a rank group: every rank gets the sum in rank order, bit
for bit the same on each; what does not fit a slot goes through gloo; a rank that never
arrives makes the others fail within the timeout instead of hanging."""

import multiprocessing as mp
import os

import pytest
import torch

from tokstream.kernels import cpu_shm_allreduce

pytestmark = pytest.mark.skipif(cpu_shm_allreduce.load() is None, reason="no C compiler")

WORLD = 3
SLOT = 64


def parts(call, rank, n):
    return torch.randn(n, generator=torch.Generator().manual_seed(100 * call + rank))


def rank_main(rank, rendezvous, queue, absent):
    import datetime

    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=30))
    shm = cpu_shm_allreduce.connect(rank, WORLD, SLOT, timeout_s=1.0, spins=0)
    results = []
    try:
        for call, n in enumerate([SLOT, 5, SLOT, 1, 17, SLOT, 3]):
            if rank == absent and call == 3:
                queue.put((rank, "left"))
                return
            x = parts(call, rank, n)
            results.append(shm.all_reduce(x).clone())
        queue.put((rank, [r.tolist() for r in results]))
    except RuntimeError as exc:
        queue.put((rank, str(exc)))


def run_group(tmp_path, absent=None):
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=rank_main,
                                 args=(rank, str(tmp_path / "rendezvous"), queue, absent))
                 for rank in range(WORLD)]
    for process in processes:
        process.start()
    answers = dict(queue.get(timeout=60) for _ in processes)
    for process in processes:
        process.join(10)
    return answers


def test_every_rank_gets_the_same_sum_in_rank_order(tmp_path):
    answers = run_group(tmp_path)
    for call, n in enumerate([SLOT, 5, SLOT, 1, 17, SLOT, 3]):
        expected = parts(call, 0, n) + parts(call, 1, n) + parts(call, 2, n)
        for rank in range(WORLD):
            assert torch.equal(torch.tensor(answers[rank][call]), expected), (call, rank)


def test_a_rank_that_never_arrives_fails_the_others_within_the_timeout(tmp_path):
    answers = run_group(tmp_path, absent=2)
    assert answers[2] == "left"
    assert all("did not arrive" in answers[rank] for rank in (0, 1))


def test_only_float32_cpu_tensors_within_a_slot_fit():
    shm = cpu_shm_allreduce.ShmAllReduce.__new__(cpu_shm_allreduce.ShmAllReduce)
    shm.slot_floats = SLOT
    assert shm.fits(torch.zeros(SLOT))
    assert not shm.fits(torch.zeros(SLOT + 1))
    assert not shm.fits(torch.zeros(4, dtype=torch.bfloat16))
    assert not shm.fits(torch.zeros(4, 4).t())
    assert os.path.exists(cpu_shm_allreduce.SOURCE)
