"""What a rank says once, after loading: ready (with what it holds) or failed."""

from __future__ import annotations

from dataclasses import dataclass


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
    kernels: str = "torch"
    """The kernel backend: torch (CPU reference + C decode kernel) or triton."""
    graph_batch_sizes: tuple[int, ...] = ()
    """Decode batch sizes captured as CUDA graphs (none: every step runs eagerly)."""
    weights: str = "dequantized"
    """How the weights are held: 'dequantized' (in dtype) or 'native' (GGUF blocks)."""
    kv_cache_dtype: str = ""
    """The KV cache's dtype ('' from a worker that predates the choice: dtype's)."""
    kv_shared: bool = False
    """The pool lives in this rank's pool file (CPU, engine/recovery/pool_files.py): it outlives the
    rank, and the rank that replaces it maps the same KV."""

    def pool_layout(self) -> tuple:
        """What the pool's bytes mean: a replacement's pool must match it to be read."""
        return (self.rank, self.dtype, self.kv_cache_dtype, self.num_blocks, self.block_bytes,
                self.weights, self.kernels)


@dataclass
class WorkerFailed:
    """Sent instead of WorkerReady when loading fails; message is one line for the user."""

    rank: int
    message: str
    user_error: bool
