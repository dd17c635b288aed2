"""The CPU KV pool's memory: zeros on every read, writable, and not backed until written."""

import torch

from tokstream.worker.zeroed_memory import lazily_zeroed

MIB = 2**20


def resident_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * 4096


def test_reads_as_zeros_in_every_dtype_and_keeps_writes():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8):
        pool = lazily_zeroed((3, 5, 16, 8), dtype)
        assert pool.shape == (3, 5, 16, 8) and pool.dtype == dtype and pool.is_contiguous()
        assert not pool.any()
        pool[1, 2] = 7
        assert pool[1, 2].eq(7).all() and pool.sum().item() == 7 * 16 * 8


def test_allocating_a_pool_backs_no_memory_until_it_is_written():
    # What a rank group's start saves: torch.zeros would make all 256 MiB resident here.
    before = resident_bytes()
    pool = lazily_zeroed((256 * MIB // 4,), torch.float32)
    assert not pool[::4096].any()  # reading maps the kernel's one zero page, backs nothing
    assert resident_bytes() - before < 32 * MIB
    pool[: 64 * MIB // 4] = 1.0
    assert resident_bytes() - before >= 60 * MIB
    assert pool.sum().item() == 64 * MIB // 4


def test_an_empty_shape_is_an_empty_tensor():
    assert lazily_zeroed((0, 16), torch.float32).numel() == 0
