"""Configuration dataclasses, one per concern, validated on construction. No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokstream.errors import UserInputError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


WEIGHT_FORMATS = ("auto", "native", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise UserInputError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder; everything needed to build it and size its cache."""

    name: str
    """Display name (what /v1/models lists)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention when fewer than num_heads)."""
    head_dim: int
    max_position: int
    """Context length the model was trained for."""
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    """True when the LM head reuses the embedding matrix (SmolLM2)."""
    qkv_bias: bool = False
    """Qwen2-style bias on the q/k/v projections."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) < 1:
                raise UserInputError(f"model config: {name} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise UserInputError("model config: num_heads must be a multiple of num_kv_heads")

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        mlp = 3 * h * i
        norms = 2 * h
        per_layer = attention + mlp + norms
        embeddings = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h

    def check_tp(self, tp: int) -> None:
        """Refuse a tensor-parallel size that does not split the heads evenly."""
        if self.num_heads % tp or self.num_kv_heads % tp or self.intermediate_size % tp:
            valid = [n for n in range(1, self.num_kv_heads + 1)
                     if not (self.num_heads % n or self.num_kv_heads % n
                             or self.intermediate_size % n)]
            raise UserInputError(
                f"--tp {tp} does not divide {self.name}'s {self.num_heads} query heads and "
                f"{self.num_kv_heads} KV heads; valid sizes: {', '.join(map(str, valid))}")

    def kv_bytes_per_token(self, dtype: str) -> int:
        """Bytes of K and V cache one token takes across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes(dtype)

    def weight_bytes(self, dtype: str) -> int:
        return self.num_params * dtype_bytes(dtype)


@dataclass
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    """Tokens per block."""
    kv_cache_memory: int | None = None
    """Bytes for the KV pool; None means a fraction of free memory (see memory_fraction)."""
    memory_fraction: float = 0.5
    """Share of free device memory (after weights) given to the pool when no budget is set."""
    num_blocks: int | None = None
    """Exact pool size in blocks; overrides the memory budget (tests use tiny pools)."""
    kv_cache_dtype: str = "auto"
    """The KV cache's dtype: 'auto' (float16 on a CPU computing in float32, where decode
    attention is bound by the cache bytes it reads; else the serving dtype), the serving
    dtype, or 'float16' on CPU (worker/dtype_choice.resolve_kv_cache_dtype)."""
    enable_prefix_caching: bool = True
    """Share full blocks of identical prefixes between requests (read-only, hashed)."""
    preemption_mode: str = "recompute"
    """What a preempted request's KV becomes: 'recompute' (dropped; prompt + output are
    prefilled again on re-admission) or 'swap' (copied to host memory and back)."""
    swap_space: int = 4 * 2**30
    """Bytes of host memory per replica for swapped-out KV blocks (swap mode only); when it is
    full, preemption falls back to recompute."""

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise UserInputError("block_size must be a power of two >= 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise UserInputError("kv_cache_memory must be > 0 bytes")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise UserInputError("memory_fraction must be in (0, 1]")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise UserInputError("num_blocks must be >= 1")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise UserInputError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)},"
                                 f" not {self.kv_cache_dtype!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise UserInputError("preemption_mode must be 'recompute' or 'swap', "
                                 f"not {self.preemption_mode!r}")
        if self.swap_space < 0 or (self.preemption_mode == "swap" and self.swap_space == 0):
            raise UserInputError("swap_space must be > 0 bytes in swap mode (and never < 0)")


@dataclass
class SchedulerConfig:
    """How each step's batch is filled."""

    max_num_seqs: int = 64
    """Most sequences running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget per step: decode tokens first, then prefill chunks. 2048: measured with
    `vllm bench serve` (32 streams of 128 -> 128 arriving at once, SmolLM2 native, 2-core
    Xeon): 1024 gave 378 output tok/s, p99 ITL 406 ms (the burst's prefill took four long
    steps, each a gap for every stream already out), median TTFT 2.39 s; 2048 gave 374 tok/s,
    95 ms, 2.89 s."""
    chunked_prefill: bool = True
    """Split prompts into chunks under the budget, mixed with decodes. Off: a prompt is
    prefilled whole in one step, past the budget if need be (as engines without chunking do),
    and running streams wait for all of it."""
    max_prefill_chunk: int = 0
    """Most prompt tokens of one request per step (0 = whatever the budget has left)."""
    watermark_blocks: int = 1
    """Free blocks kept back when admitting a new request, so running ones can grow."""
    policy: str = "fair"
    """Admission order within a priority tier: 'fair' (tenants' virtual token counters) or
    'fcfs' (arrival only)."""
    long_request_tokens: int = 8192
    """Prompts at least this long count as long requests."""
    max_long_requests_per_tenant: int = 0
    """Most long requests one tenant may have running at once (0 = no limit)."""
    long_prefill_tokens: int = 2048
    """A prefill with more than this many prompt tokens still to compute is a long prefill."""
    long_prefill_share: float = 0.5
    """While a shorter prompt waits, long prefills together take at most this share of a
    step's token budget, so a chat request behind a 50k-token prompt starts at once instead
    of after it (1 = no limit). With nothing short waiting they take the whole budget."""
    itl_target_ms: float = 150.0
    """Inter-token latency target while streams decode (0 = off): a step that carries decodes
    gets only the prefill the measured step cost predicts will fit under it; a step with
    nothing decoding gives prefill the whole budget. Needs chunked_prefill. 150 ms: measured
    with `vllm bench serve` (32 streams of 128 -> 128 arriving at once, SmolLM2, 2-core Xeon),
    125 / 150 / 200 ms gave p99 ITL 153 / 159 / 214 ms at 207 / 240 / 243 output tok/s;
    vLLM's CPU build had 158 ms there."""
    itl_min_prefill_share: float = 0.25
    """Under an ITL target, the least share of it a step's prefill gets while prompts wait,
    even when decodes alone fill the target, so waiting prompts always progress (at least one
    token a step) and the target is passed by at most this share."""

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise UserInputError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise UserInputError("max_num_batched_tokens must be >= 1")
        if self.max_prefill_chunk < 0:
            raise UserInputError("max_prefill_chunk must be >= 0 (0 = the token budget)")
        if self.max_prefill_chunk and not self.chunked_prefill:
            raise UserInputError("max_prefill_chunk needs chunked_prefill: without chunking a "
                                 "prompt is prefilled whole")
        if self.watermark_blocks < 0:
            raise UserInputError("watermark_blocks must be >= 0")
        if self.policy not in ("fair", "fcfs"):
            raise UserInputError(f"policy must be 'fair' or 'fcfs', not {self.policy!r}")
        if self.long_prefill_tokens < 1 or not 0 < self.long_prefill_share <= 1:
            raise UserInputError("long_prefill_tokens must be >= 1 and long_prefill_share "
                                 "in (0, 1]")
        if self.itl_target_ms < 0:
            raise UserInputError("itl_target_ms must be >= 0 (0 = off)")
        if not 0 <= self.itl_min_prefill_share <= 1:
            raise UserInputError("itl_min_prefill_share must be in [0, 1]")
        if self.long_request_tokens < 1 or self.max_long_requests_per_tenant < 0:
            raise UserInputError("long_request_tokens must be >= 1 and "
                                 "max_long_requests_per_tenant >= 0")


@dataclass
class EngineConfig:
    """Everything one replica needs; passed whole to the core and to every worker."""

    model: str = "smollm2"
    """Model: 'smollm2' (the embedded GGUF), a path to a GGUF file or HF folder, or dummy:NAME."""
    dtype: str = "auto"
    """Serving dtype (activations, KV cache; weights too unless native); 'auto' picks per
    device by measurement."""
    weights: str = "auto"
    """Weight format: 'native' (a GGUF's quantised blocks multiplied as stored, CPU, float32
    activations), 'float32' / 'bfloat16' / 'float16' (dequantised to that dtype), or 'auto'
    (native where the file and machine allow it, else dequantised to the serving dtype)."""
    device: str = "cpu"
    tp: int = 1
    seed: int = 0
    """Seed for dummy weights and for requests that bring none."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = None
    """Torch threads per worker; None divides the cores between the ranks."""
    step_timeout_s: float = 120.0
    """A step (or load) that takes longer means a hung rank: the group is torn down."""
    collective_timeout_s: float = 300.0
    """torch.distributed timeout inside a rank group (a backstop; the core acts first)."""
    max_recovery_attempts: int = 3
    """Failed restarts in a row before the replica is declared down."""
    start_timeout_s: float = 300.0
    """An engine core or rank group not ready this long after it was started is hung: its
    processes are killed and the start counts as a failed attempt."""
    max_request_failures: int = 3
    """A request in flight at this many replica failures in a row (rank group or engine
    core) is ended with an error, and the replica goes on without it."""
    spare: bool = False
    """Keep a standby rank group loaded, so a failure swaps groups instead of respawning."""
    spare_core: bool = False
    """Keep a second engine core loaded behind the server's gateway (with its own rank group),
    so an engine-core death swaps cores instead of starting one."""

    def __post_init__(self):
        if self.device not in ("cpu", "cuda", "auto"):
            raise UserInputError(f"device must be cpu, cuda or auto, not {self.device!r}")
        if self.dtype != "auto":
            dtype_bytes(self.dtype)
        if self.weights not in WEIGHT_FORMATS:
            raise UserInputError(f"weights must be one of {', '.join(WEIGHT_FORMATS)},"
                                 f" not {self.weights!r}")
        if self.weights not in ("auto", "native") and self.dtype not in ("auto", self.weights):
            raise UserInputError(f"weights {self.weights} with dtype {self.dtype}: give one"
                                 " (dequantised weights are in the serving dtype)")
        if self.weights == "native" and self.dtype not in ("auto", "float32"):
            raise UserInputError(f"weights native computes in float32, not {self.dtype}")
        if self.tp < 1:
            raise UserInputError("tp must be >= 1")
        if self.step_timeout_s <= 0 or self.collective_timeout_s <= 0:
            raise UserInputError("step_timeout_s and collective_timeout_s must be > 0")
        if not self.start_timeout_s > 0:
            raise UserInputError("start_timeout_s must be > 0")
        if self.max_recovery_attempts < 1:
            raise UserInputError("max_recovery_attempts must be >= 1")
        if self.max_request_failures < 1:
            raise UserInputError("max_request_failures must be >= 1")
