"""The worker process: one rank. Loads its shard, allocates its KV pool, then runs step plans
from the engine core until told to stop or until the core goes away (the pipe closes)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from tokstream.config import EngineConfig
from tokstream.engine.messages import ScoreRequest


@dataclass
class WorkerReady:
    """Sent once by each rank after loading."""

    rank: int
    pid: int
    dtype: str
    device: str
    num_blocks: int
    block_bytes: int
    """Bytes of one KV block on this rank (all layers, K and V)."""
    weight_bytes: int
    """Bytes of this rank's weights."""
    load_s: float
    num_swap_blocks: int = 0
    """Host-memory blocks for swapped-out KV (swap mode; 0 otherwise)."""


@dataclass
class WorkerFailed:
    """Sent instead of WorkerReady when loading fails; message is one line for the user."""

    rank: int
    message: str
    user_error: bool


def set_threads(config: EngineConfig) -> int:
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = config.num_threads or max(1, cores // config.tp)
    torch.set_num_threads(threads)
    return threads


def worker_main(conn, config: EngineConfig, rank: int) -> None:
    logging.basicConfig(level=os.environ.get("TOKSTREAM_LOG", "WARNING"),
                        format="%(asctime)s %(name)s: %(message)s")
    try:
        runner, ready = _load(config, rank)
    except Exception as exc:  # reported to the core, which turns it into a clean error
        from tokstream.errors import UserInputError
        conn.send(WorkerFailed(rank, f"{type(exc).__name__}: {exc}" if not isinstance(
            exc, UserInputError) else str(exc), isinstance(exc, UserInputError)))
        return
    conn.send(ready)
    while True:
        try:
            plan = conn.recv()
        except (EOFError, OSError):
            return  # the core is gone: never outlive it
        if plan is None:
            return
        if isinstance(plan, ScoreRequest):
            conn.send(runner.score(plan))
            continue
        conn.send(runner.execute(plan))


def _load(config: EngineConfig, rank: int):
    import torch

    from tokstream.model.source import resolve_model
    from tokstream.model.weights import load_state_dict
    from tokstream.worker.model import LlamaModel
    from tokstream.worker.model_runner import (TORCH_DTYPES, ModelRunner, allocate_kv_caches,
                                               allocate_swap_space, kv_pool_blocks,
                                               resolve_dtype)

    started = time.perf_counter()
    set_threads(config)
    device = torch.device("cuda" if config.device == "cuda" else "cpu")
    dtype = resolve_dtype(config.dtype, device.type)
    torch_dtype = TORCH_DTYPES[dtype]
    source = resolve_model(config.model)
    state_dict = load_state_dict(source, torch_dtype, seed=config.seed, device=device)
    with device:  # build the parameters where they will live
        model = LlamaModel(source.config, torch_dtype, tp_rank=rank, tp_size=config.tp)
    model.load_weights(state_dict)
    del state_dict
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.pack_weights_for_cpu()
    num_blocks, block_bytes = kv_pool_blocks(config, source.config, dtype, device)
    kv_caches = allocate_kv_caches(source.config, num_blocks, config.cache.block_size,
                                   config.tp, torch_dtype, device)
    swap_caches, num_swap_blocks = None, 0
    if config.cache.preemption_mode == "swap":
        num_swap_blocks = config.cache.swap_space // config.tp // block_bytes
        swap_caches = allocate_swap_space(source.config, num_swap_blocks,
                                          config.cache.block_size, config.tp, torch_dtype,
                                          pin=device.type == "cuda")
    runner = ModelRunner(model, kv_caches, config.cache.block_size, device, swap_caches)
    ready = WorkerReady(rank, os.getpid(), dtype, str(device), num_blocks, block_bytes,
                        weight_bytes, time.perf_counter() - started, num_swap_blocks)
    return runner, ready
