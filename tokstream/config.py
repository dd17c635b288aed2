"""Configuration dataclasses, one per concern, validated on construction. No torch here.
This file holds the model's, the engine's (cache, scheduler, speculation) and the bench's;
the gateway's (ServerConfig, AdmissionConfig) are in tokstream/gateway_config.py.

Each option is declared once, here or there: its field, its default and its docstring. `tokstream
serve`'s flags, their help text and the serving profiles' keys (profiles/*.toml, one section a
dataclass) are generated from these fields (tokstream/options.py, tokstream/settings.py).
A field docstring's first paragraph is the flag's help; what follows a blank line (measurements,
reasons) stays in the source. A field whose metadata says BYTES also takes sizes such as "4GiB".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokstream.errors import UserInputError

BYTES = {"unit": "bytes"}
"""Field metadata: a size in bytes, which flags and profiles may also write as "4GiB"."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


WEIGHT_FORMATS = ("auto", "native", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


def at_least_one(config, *names: str, what: str = "") -> None:
    """The check most counts share: each named field of config is >= 1, or a UserInputError
    names the first that is not (`what` leads the message)."""
    for name in names:
        if getattr(config, name) < 1:
            raise UserInputError(f"{what}{name} must be >= 1")


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
        at_least_one(self, "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                      "num_heads", "num_kv_heads", "head_dim", "max_position",
                      what="model config: ")
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
    kv_cache_memory: int | None = field(default=None, metadata=BYTES)
    """KV pool size, e.g. 2GiB (default: a share of free memory, memory_fraction, at most 4 GiB
    on CPU)."""
    memory_fraction: float = 0.5
    """Share of free device memory (after weights) given to the pool when no budget is set."""
    num_blocks: int | None = None
    """Exact KV pool size in blocks; overrides kv_cache_memory (tests use tiny pools)."""
    kv_cache_dtype: str = "auto"
    """The KV cache's dtype: auto (float16 on a CPU computing in float32, where decode
    attention is bound by the cache bytes it reads; else the serving dtype), the serving
    dtype, or float16 on CPU.

    worker/dtype_choice.resolve_kv_cache_dtype decides what auto becomes."""
    enable_prefix_caching: bool = True
    """Share full blocks of identical prefixes between requests (read-only, hashed)."""
    preemption_mode: str = "recompute"
    """What a preempted request's KV becomes: recompute (dropped; prompt + output are
    prefilled again on re-admission) or swap (copied to host memory and back)."""
    swap_space: int = field(default=4 * 2**30, metadata=BYTES)
    """Host memory per replica for swapped-out KV blocks (swap mode only); when it is
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
    """Token budget per step: decode tokens first, then prefill chunks.

    2048: measured with
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
    """Admission order within a priority tier: fair (tenants' virtual token counters) or
    fcfs (arrival only)."""
    long_request_tokens: int = 8192
    """Prompts at least this long count as long requests."""
    max_long_requests_per_tenant: int = 0
    """Most long requests one tenant may have running at once (0 = no limit)."""
    long_prefill_tokens: int = 2048
    """A prefill with more than this many tokens to compute when admitted is long, to its end:
    short prompts' prefill goes before its chunks."""
    long_prefill_share: float = 0.5
    """Long prefills' guaranteed share of the prefill time over the last second: behind it
    they go before short prompts, else short prompts' prefill goes first; and while a
    shorter prompt waits, long prefills take at most this share of a step's token budget
    (1 = first come, first served)."""
    long_prefill_step_ms: float = 60.0
    """Under the ITL target, while streams decode, the gap a long prefill may put between two
    tokens of a stream, held by the measured step cost (0 = itl_target_ms, never past it);
    with nothing decoding a step carrying its chunk is held to itl_target_ms (a short prompt
    arriving waits at most that long).

    60 ms: bench/flood_bench.py on SmolLM2 (2-core AMD Zen 5, chat at 2.1 req/s plus 8k-token
    prompt bursts; bench/results/flood_bench-amd-f26m2-bf16*.json): with the 150 ms target
    chat ITL p50/p99 was 147/169 ms under the flood against 8/40 ms alone; 60 ms gave 58/84
    ms with long_prefill_alone, and every 8k prompt still finished (TTFT p50 117 s)."""
    long_prefill_alone: bool = True
    """While streams decode under the ITL target, a long prefill's chunks run in steps of
    their own (with any short prompts' chunks, no decodes), every other step, instead of
    sharing the decodes' steps; such a step is held so that it and the decode step before it
    stay within long_prefill_step_ms. Decode steps then keep the one-call decode stack.

    Measured against sharing at 60 ms (bench/flood_bench.py, one sitting, chat 2.1 req/s plus
    the flood): chat TTFT p99 96 vs 165 ms, ITL p50/p99 58/84 vs 61/98 ms, the 8k prompts'
    TTFT p50 117 vs 119 s."""
    itl_target_ms: float = 150.0
    """Inter-token latency target while streams decode (0 = off): a step that carries decodes
    gets only the prefill the measured step cost predicts will fit under it; a step with
    nothing decoding gives prefill the whole budget. Needs chunked_prefill.

    150 ms: measured with `vllm bench serve` (32 streams of 128 -> 128 arriving at once, SmolLM2, 2-core Xeon),
    125 / 150 / 200 ms gave p99 ITL 153 / 159 / 214 ms at 207 / 240 / 243 output tok/s;
    vLLM's CPU build had 158 ms there."""
    itl_min_prefill_share: float = 0.25
    """Under an ITL target, the least share of it a step's prefill gets while prompts wait,
    even when decodes alone fill the target, so waiting prompts always progress (at least one
    token a step) and the target is passed by at most this share."""
    arrival_gather_ms: float = 10.0
    """An idle engine that gets a request keeps reading arrivals until none has come for
    this long (for at most core_process.GATHER_LIMIT windows) before its first step, so a burst shares that step
    instead of waiting behind a first request prefilled alone (0 = off). A lone request
    pays this once, on a prefill that takes 20x longer.

    10 ms: 32 requests from `vllm bench serve` (SmolLM2, 2-core Xeon) left the client within
    6.3 ms and reached the core over 67 ms, 0.3-7 ms apart (the gateway parses and tokenises
    each); without gathering the core began a step with the first alone (0.17-0.23 s) while
    the other 31 waited, median TTFT 2.97-3.07 s."""
    background_rows_when_busy: int = 0
    """Background requests (a Message Batch's) that may run in a step beside interactive
    ones. 0: none, so they run only in the steps no interactive request needs. Chat then
    keeps its pace, and batches get the idle time (on a server that is never idle of chat,
    they wait, and expire after 24 hours). Each row added to a decode step costs the
    interactive streams in it: ~1.6 ms a row on SmolLM2, 2 Zen 3 cores
    (bench/batch_cost.py)."""

    def __post_init__(self):
        if self.background_rows_when_busy < 0:
            raise UserInputError("background_rows_when_busy must be >= 0")
        if self.arrival_gather_ms < 0:
            raise UserInputError("arrival_gather_ms must be >= 0 (0 = off)")
        at_least_one(self, "max_num_seqs", "max_num_batched_tokens")
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
        if self.long_prefill_step_ms < 0:
            raise UserInputError("long_prefill_step_ms must be >= 0 (0 = itl_target_ms)")
        if not 0 <= self.itl_min_prefill_share <= 1:
            raise UserInputError("itl_min_prefill_share must be in [0, 1]")
        if self.long_request_tokens < 1 or self.max_long_requests_per_tenant < 0:
            raise UserInputError("long_request_tokens must be >= 1 and "
                                 "max_long_requests_per_tenant >= 0")


SPECULATIVE_METHODS = ("off", "ngram", "auto")


@dataclass
class SpeculativeConfig:
    """Speculative decoding: tokens drafted per request, checked by the model in one pass."""

    method: str = "auto"
    """off; ngram: drafts copied from the request's own prompt and output (prompt lookup),
    verified in one forward pass, as many each step as match; or auto: the same drafts, as
    many each step as the request's recent acceptance says pay for their cost at the step's
    batch size (none when none do). Output is the same as without it.

    auto by default: bench/spec_bench.py measured it (Zen 5, SmolLM2) at 0.36-0.39x the time
    per token on copy-heavy answers and within 3% of off on free-form ones at 1, 8 and 32
    streams."""
    num_speculative_tokens: int = 4
    """Most tokens drafted per request and step (auto chooses up to this many)."""
    prompt_lookup_max: int = 4
    """Longest suffix of a request's tokens looked up earlier in them (ngram, auto)."""
    prompt_lookup_min: int = 2
    """Shortest suffix looked up (ngram, auto); a shorter match drafts nothing."""

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise UserInputError(f"speculative method must be one of "
                                 f"{', '.join(SPECULATIVE_METHODS)}, not {self.method!r}")
        at_least_one(self, "num_speculative_tokens", "prompt_lookup_min")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise UserInputError("prompt_lookup_max must be >= prompt_lookup_min")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


@dataclass
class EngineConfig:
    """Everything one replica needs; passed whole to the core and to every worker."""

    model: str = "smollm2"
    """smollm2 (the embedded GGUF), a .gguf file, a Hugging Face folder, or dummy:NAME."""
    dtype: str = "auto"
    """Serving dtype (activations, KV cache; weights too unless native): float32, bfloat16,
    float16, or auto (bfloat16 where the CPU or GPU has native bfloat16 matmuls, else
    float32; decided by measurement)."""
    weights: str = "auto"
    """Weight format: native (a GGUF's quantised blocks multiplied as stored, CPU, float32
    activations; with copies in faster forms for many-row products where measured to pay),
    float32, bfloat16 or float16 (dequantised to that dtype), or auto (native where the file
    and machine allow it, else dequantised to the serving dtype)."""
    weight_copies_memory: int | None = field(default=None, metadata=BYTES)
    """Most memory per rank for the copies native weights keep for many-row products (int16,
    bfloat16), e.g. 512MiB; 0 keeps none (default: a quarter of the memory available at
    load).

    Copies are kept only for the row counts where they measured faster; a budget too small
    for a model's bfloat16 copies makes --weights auto choose one format for all steps."""
    device: str = "cpu"
    """cpu, cuda, or auto (cuda when there is one)."""
    tp: int = 1
    """Tensor-parallel ranks, one process each (must divide the model's query and KV heads)."""
    seed: int = 0
    """Seed for dummy weights and for requests that bring none."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    num_threads: int | None = None
    """Torch threads per worker (default: the cores divided between the ranks)."""
    step_timeout_s: float = 120.0
    """Seconds a step may take before a rank counts as hung and the group is replaced."""
    collective_timeout_s: float = 300.0
    """torch.distributed timeout inside a rank group (a backstop; the core acts first)."""
    max_recovery_attempts: int = 3
    """Failed restarts in a row (rank group or engine core) before the replica is down."""
    start_timeout_s: float = 300.0
    """An engine core or rank group not ready this long after it was started is hung: its
    processes are killed and the start counts as a failed attempt."""
    max_request_failures: int = 3
    """A request in flight at this many replica failures in a row (rank group or engine
    core) is ended with an error, and the replica goes on without it."""
    grammar_compile_timeout_s: float = 10.0
    """Seconds a structured-output grammar may take to compile on rank 0; a request whose
    grammar takes longer ends alone with an invalid_request_error.

    Other streams decode meanwhile (a request samples only once its grammar is ready), so the
    limit bounds what that request waits, not anyone else's gap. Measured on SmolLM2's
    tokenizer: deep or large schemas compile in 8-25 ms."""
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
        at_least_one(self, "tp")
        if self.weight_copies_memory is not None and self.weight_copies_memory < 0:
            raise UserInputError("weight_copies_memory must be >= 0 bytes (0 = no copies)")
        if self.step_timeout_s <= 0 or self.collective_timeout_s <= 0:
            raise UserInputError("step_timeout_s and collective_timeout_s must be > 0")
        if not self.start_timeout_s > 0:
            raise UserInputError("start_timeout_s must be > 0")
        if not self.grammar_compile_timeout_s > 0:
            raise UserInputError("grammar_compile_timeout_s must be > 0")
        at_least_one(self, "max_recovery_attempts", "max_request_failures")


@dataclass
class BenchSpec:
    """The workload of `tokstream bench`: random prompts, all sent at once up to a concurrency."""

    num_requests: int = 32
    """Requests in the run."""
    input_len: int = 128
    """Prompt tokens per request."""
    output_len: int = 128
    """Output tokens per request (end of sequence ignored)."""
    concurrency: int = 32
    """Most requests in flight at once."""
    seed: int = 0
    """Seed of the random prompts."""

    def __post_init__(self):
        at_least_one(self, "num_requests", "input_len", "output_len", "concurrency")
