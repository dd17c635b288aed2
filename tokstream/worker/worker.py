"""The worker process: one rank. Loads its shard, allocates its KV pool, then runs step plans
from the engine core until told to stop or until the core goes away (the pipe closes)."""

from __future__ import annotations

import logging
import os
import pickle
import time

from tokstream import envs, gc_policy
from tokstream.config import EngineConfig
from tokstream.engine.messages.rank import WorkerFailed, WorkerReady
from tokstream.engine.messages.worker import ScoreRequest


def set_threads(config: EngineConfig) -> int:
    import torch

    from tokstream.cpu_budget import usable_cores

    # The pod's CPU limit (cgroup quota), not the node's cores torch would count.
    threads = config.num_threads or max(1, usable_cores() // config.tp)
    torch.set_num_threads(threads)
    return threads


def worker_main(conn, config: EngineConfig, rank: int, rendezvous: str | None = None,
                pool_file: str | None = None) -> None:
    """One rank. Plans arrive pickled once by the core and sent to every rank (send_bytes);
    only rank 0 answers. rendezvous: a file path unique to this rank group (tp > 1);
    pool_file: this rank's KV pool file (engine/recovery/pool_files.py) (CPU; None: a pool of
    its own)."""
    logging.basicConfig(level=envs.LOG.get(),
                        format="%(asctime)s %(name)s: %(message)s")
    try:
        runner, ready = _load(config, rank, rendezvous, pool_file)
    except Exception as exc:  # reported to the core, which turns it into a clean error
        from tokstream.errors import UserInputError
        conn.send(WorkerFailed(rank, f"{type(exc).__name__}: {exc}" if not isinstance(
            exc, UserInputError) else str(exc), isinstance(exc, UserInputError)))
        return
    gc_policy.settle_after_start()
    conn.send(ready)
    while True:
        try:
            plan = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the core is gone: never outlive it
        if plan is None:
            return
        if isinstance(plan, ScoreRequest):
            result = runner.score(plan)
        else:
            result = runner.execute(plan)
        if rank == 0:
            conn.send(result)


def resolve_device(device: str):
    """'auto' is the GPU when torch sees one, else the CPU."""
    import torch

    from tokstream.errors import UserInputError

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserInputError("--device cuda: torch sees no CUDA device here "
                             f"(torch {torch.__version__}); use --device cpu or auto")
    return torch.device(device)


def _init_tensor_parallel(config: EngineConfig, rank: int, rendezvous: str, device_type: str,
                          hidden_size: int):
    """Join this replica's gloo (CPU) or NCCL (CUDA) group; returns (all_reduce, all_gather).
    On the host, the activations' all-reduce goes through shared memory where it can
    (kernels/cpu_shm_allreduce.py), gloo's loopback TCP otherwise."""
    import datetime

    import torch
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank,
                            world_size=config.tp,
                            timeout=datetime.timedelta(seconds=config.collective_timeout_s))
    shm = None
    if device_type == "cpu" and envs.SHM_ALLREDUCE.get() != "0":
        from tokstream.cpu_budget import usable_cores
        from tokstream.kernels import cpu_shm_allreduce
        cores = usable_cores()
        shm = cpu_shm_allreduce.connect(
            rank, config.tp, config.scheduler.max_num_batched_tokens * hidden_size,
            config.collective_timeout_s,
            # More ranks than cores: a spinning rank holds the core the last one needs.
            spins=0 if config.tp > cores else 20000)

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        if shm is not None and shm.fits(x):
            return shm.all_reduce(x)
        dist.all_reduce(x)
        return x

    def all_gather(x: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(config.tp)]
        dist.all_gather(parts, x.contiguous())
        return parts

    return all_reduce, all_gather


def _load(config: EngineConfig, rank: int, rendezvous: str | None = None,
          pool_file: str | None = None):
    import torch

    from tokstream.model.source import resolve_model
    from tokstream.model.weights import load_native_state_dict, load_state_dict
    from tokstream.worker.backend import choose_backend
    from tokstream.text.tokenizer import load_tokenizer
    from tokstream.worker import matrix_units
    from tokstream.worker.dtype_choice import (bfloat16_copies_wanted, copy_budget,
                                               resolve_kv_cache_dtype, resolve_weights)
    from tokstream.worker.grammar import Grammars
    from tokstream.worker.model import LlamaModel
    from tokstream.worker.model_runner import (TORCH_DTYPES, ModelRunner, allocate_kv_caches,
                                               allocate_swap_space, kv_pool_blocks,
                                               map_shared_pool)
    from tokstream.worker.path_choice import measure_crossovers

    started = time.perf_counter()
    set_threads(config)
    device = resolve_device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    source = resolve_model(config.model)
    # Only rank 0 samples; its grammar tokenizer builds on a thread while the weights load.
    grammars = Grammars(lambda: load_tokenizer(source).backend.to_str(),
                        source.config.vocab_size, source.config.eos_token_ids
                        ) if rank == 0 else None
    all_reduce = all_gather = None
    if config.tp > 1:
        all_reduce, all_gather = _init_tensor_parallel(config, rank, rendezvous, device.type,
                                                       source.config.hidden_size)
    budget = copy_budget(config)
    weights, dtype = resolve_weights(config.weights, config.dtype, source, device.type, budget)
    torch_dtype = TORCH_DTYPES[dtype]
    if weights == "native":
        state_dict = load_native_state_dict(source)
    else:
        state_dict = load_state_dict(source, torch_dtype, seed=config.seed, device=device)
    backend = choose_backend(device)
    with device:  # build the parameters where they will live
        model = LlamaModel(source.config, torch_dtype, tp_rank=rank, tp_size=config.tp,
                           all_reduce=all_reduce, all_gather=all_gather, backend=backend)
    model.load_weights(state_dict)
    del state_dict
    weight_bytes = model.weight_bytes()
    model.pack_weights_for_cpu()
    if model.quantized_weights():
        if device.type == "cpu":
            logging.getLogger("tokstream.worker").info(
                "matrix units: %s", matrix_units.describe())
        measure_crossovers(model.quantized_weights(), budget,
                           model.decoder_weights() if bfloat16_copies_wanted(
                               config, weights, device.type) else [])
        weight_bytes = model.weight_bytes()
    kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype, device.type,
                                      backend.name, explicit_dtype=config.dtype != "auto")
    num_blocks, block_bytes = kv_pool_blocks(config, source.config, kv_dtype, device,
                                             shared=pool_file is not None)
    if config.tp > 1:
        num_blocks = _fewest_blocks(num_blocks, device)
    shared = None
    if device.type == "cpu" and pool_file is not None:
        shared = map_shared_pool(pool_file, source.config, num_blocks, config.cache.block_size,
                                 config.tp, TORCH_DTYPES[kv_dtype])
    kv_caches = allocate_kv_caches(source.config, num_blocks, config.cache.block_size,
                                   config.tp, TORCH_DTYPES[kv_dtype], device, shared)
    swap_caches, num_swap_blocks = None, 0
    if config.cache.preemption_mode == "swap":
        num_swap_blocks = config.cache.swap_space // config.tp // block_bytes
        swap_caches = allocate_swap_space(source.config, num_swap_blocks,
                                          config.cache.block_size, config.tp,
                                          TORCH_DTYPES[kv_dtype], pin=device.type == "cuda")
    graphs = _capture_decode_graphs(config, model, kv_caches, source.config, device)
    runner = ModelRunner(model, kv_caches, config.cache.block_size, device, swap_caches,
                         rank=rank, decode_graphs=graphs, grammars=grammars)
    ready = WorkerReady(rank, os.getpid(), dtype, str(device), num_blocks, block_bytes,
                        weight_bytes, time.perf_counter() - started, num_swap_blocks,
                        backend.name, tuple(graphs.sizes) if graphs else (), weights, kv_dtype,
                        kv_shared=shared is not None)
    return runner, ready


def _fewest_blocks(num_blocks: int, device) -> int:
    """The smallest pool any rank of the group can hold: each sizes its own from the memory
    free as it starts, which differs by a little between them (on a host, between ranks that
    share its memory). Only that many blocks are ever used, and a pool kept in the core's
    memory file must have the same layout for every group that maps it."""
    import torch
    import torch.distributed as dist

    fewest = torch.tensor([num_blocks], dtype=torch.int64, device=device)
    dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
    return int(fewest.item())


def _capture_decode_graphs(config, model, kv_caches, model_config, device):
    """CUDA graphs for decode batch sizes on a GPU with the Triton kernels, unless
    TOKSTREAM_CUDA_GRAPHS=0; None (every step eager) otherwise."""
    import torch

    from tokstream.worker.cuda_graphs import DecodeGraphs, batch_sizes, graphs_enabled

    if device.type != "cuda" or model.backend.name != "triton" or not graphs_enabled():
        return None
    max_blocks = -(-model_config.max_position // config.cache.block_size)
    try:
        with torch.inference_mode():
            return DecodeGraphs(model, kv_caches, max_blocks,
                                batch_sizes(config.scheduler.max_num_seqs), device)
    except torch.cuda.OutOfMemoryError:
        # Graphs are an optimisation: without the memory for them every step runs eagerly.
        logging.getLogger("tokstream.worker").warning(
            "not enough GPU memory to capture decode CUDA graphs; running eagerly")
        torch.cuda.empty_cache()
        return None
