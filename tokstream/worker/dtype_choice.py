"""What `--dtype auto` and `--weights auto` become on a CPU: chosen by measurement.

oneDNN answers "bfloat16 supported" on CPUs that only emulate it (an Intel Xeon without
avx512_bf16 ran bfloat16 linears at a third of float32's speed), so its answer is not used.
A CPU without native bfloat16 instructions (avx512_bf16, amx_bf16) serves float32. One with
them runs a short timed probe of float32 against bfloat16 at the model's own matmul shapes, at
one row (decode alone) and 32 rows (a batch), and takes bfloat16 only where it is faster in
total. The result is cached per machine (CPU flags, torch version, shapes), so restarts after a
failure do not pay for it again, and logged with the rates.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from tokstream import envs
from tokstream.config import ModelConfig
from tokstream.kernels import cpu_build
from tokstream.worker import probe_cache
from tokstream.worker.matrix_units import NATIVE_BF16_FLAGS, has_native_bf16

log = logging.getLogger("tokstream.worker")

PROBE_ROWS = (1, 32)


def cpu_flags() -> list[str]:
    return cpu_build.cpu_flags()


def measure_linear_rates(model_config: ModelConfig) -> dict[str, dict[int, float]]:
    """Seconds per F.linear at the model's MLP shape (hidden -> intermediate), by dtype and
    rows: the best of a few runs, on random weights of the real size."""
    out_features, in_features = model_config.intermediate_size, model_config.hidden_size
    timings: dict[str, dict[int, float]] = {}
    with torch.inference_mode():
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            weight = torch.randn(out_features, in_features).to(dtype)
            timings[name] = {}
            for rows in PROBE_ROWS:
                x = torch.randn(rows, in_features).to(dtype)
                timings[name][rows] = probe_cache.best_time(lambda: F.linear(x, weight))
    return timings


def choose_cpu_dtype(model_config: ModelConfig) -> str:
    """float32 or bfloat16 for this CPU and model (see the module docstring)."""
    if not has_native_bf16() and envs.DTYPE_PROBE.get() != "always":
        log.info("dtype auto: float32 (this CPU has no native bfloat16: none of %s)",
                 ", ".join(NATIVE_BF16_FLAGS))
        return "float32"
    path = probe_cache.path("dtype", str(model_config.hidden_size),
                            str(model_config.intermediate_size))
    cached = probe_cache.load(path)
    if cached and cached.get("choice") in ("float32", "bfloat16"):
        log.info("dtype auto: %s (measured earlier on this machine: %s)", cached["choice"],
                 cached.get("timings_ms"))
        return cached["choice"]
    load_average = os.getloadavg()[0]
    timings = measure_linear_rates(model_config)
    choice = "bfloat16" if sum(timings["bfloat16"].values()) < sum(
        timings["float32"].values()) else "float32"
    report = {"choice": choice,
              "timings_ms": {d: {str(r): round(t * 1e3, 4) for r, t in rows.items()}
                             for d, rows in timings.items()}}
    log.info("dtype auto: %s (linear %dx%d ms by rows: %s)", choice,
             model_config.intermediate_size, model_config.hidden_size, report["timings_ms"])
    probe_cache.store(path, report, load_average)
    return choice


def _random_q4_1(out_features: int, in_features: int) -> torch.Tensor:
    """Random Q4_1 blocks of a real shape (small float16 scales), for timing only."""
    import numpy as np

    rng = np.random.default_rng(0)
    blocks = out_features * in_features // 32
    raw = np.empty((blocks, 20), dtype=np.uint8)
    raw[:, :4] = rng.uniform(-0.01, 0.01, (blocks, 2)).astype(np.float16).view(np.uint8)
    raw[:, 4:] = rng.integers(0, 256, (blocks, 16), dtype=np.uint8)
    return torch.from_numpy(raw.reshape(out_features, -1))


def native_faster_than(dtype: str, model_config: ModelConfig) -> bool:
    """Whether the fused quantised kernel beats a `dtype` linear at the model's MLP shape,
    summed over one and 32 rows."""
    from tokstream.kernels import cpu_quant

    out_features, in_features = model_config.intermediate_size, model_config.hidden_size
    weight = _random_q4_1(out_features, in_features)
    dense = torch.randn(out_features, in_features).to(getattr(torch, dtype))
    native = other = 0.0
    with torch.inference_mode():
        for rows in PROBE_ROWS:
            x = torch.randn(rows, in_features)
            native += probe_cache.best_time(
                lambda: cpu_quant.matmul(x, weight, 3, in_features))
            xd = x.to(dense.dtype)
            other += probe_cache.best_time(lambda: F.linear(xd, dense))
    log.info("weights auto: native %.3f ms vs %s %.3f ms (rows %s)", native * 1e3, dtype,
             other * 1e3, PROBE_ROWS)
    return native <= other


def resolve_weights(weights: str, dtype: str, source, device_type: str,
                    copy_budget: int = 0) -> tuple[str, str]:
    """(format, serving dtype) for --weights/--dtype: format 'native' (quantised GGUF blocks,
    float32 activations, with the copies `copy_budget` bytes allow for many-row products) or
    'dequantized'. Raises UserInputError where native cannot apply."""
    from tokstream.errors import UserInputError
    from tokstream.kernels import cpu_quant
    from tokstream.model.gguf_file import NATIVE_TYPES, native_weight_types

    if weights not in ("auto", "native"):
        return "dequantized", weights
    serving = resolve_dtype(dtype, device_type, source.config)
    quantized = (source.kind == "gguf"
                 and bool(native_weight_types(source.path) & NATIVE_TYPES.keys()))
    if weights == "native":
        if device_type != "cpu":
            raise UserInputError("--weights native runs on CPU only (GPU serving dequantises)")
        if not quantized:
            raise UserInputError("--weights native needs a GGUF file with Q4_0, Q4_1 or Q8_0"
                                 f" weights; {source.config.name} has none")
        if not cpu_quant.available():
            raise UserInputError("--weights native needs the C kernel, and no C compiler"
                                 " built it here (see the log)")
        return "native", "float32"
    if device_type != "cpu" or not quantized or dtype not in ("auto", "float32") \
            or not cpu_quant.available():
        return "dequantized", serving
    if serving == "float32" or bfloat16_copies_fit(source.config, copy_budget):
        return "native", "float32"  # blocks for few rows, bfloat16 copies for many
    # Too little memory for both forms: the one that serves a mix of 1 and 32 rows best.
    if not native_faster_than(serving, source.config):
        return "dequantized", serving
    return "native", "float32"


def bfloat16_copies_fit(model_config: ModelConfig, copy_budget: int) -> bool:
    """Whether a bfloat16 copy of every weight fits the budget (the upper bound: copies are
    kept only where they measure faster)."""
    return 2 * model_config.num_params <= copy_budget


def copy_budget(config) -> int:
    """Bytes of weight copies one rank may keep (EngineConfig.weight_copies_memory)."""
    if config.weight_copies_memory is not None:
        return config.weight_copies_memory
    import psutil

    return psutil.virtual_memory().available // 4 // config.tp


def bfloat16_copies_wanted(config, weights: str, device_type: str) -> bool:
    """Whether native weights may keep bfloat16 copies: on a CPU with working native
    bfloat16 products, unless float32 was asked for (--dtype float32 means float32)."""
    from tokstream.worker.matrix_units import bfloat16_products_work

    return (weights == "native" and device_type == "cpu" and config.dtype == "auto"
            and bfloat16_products_work())


def resolve_dtype(dtype: str, device_type: str, model_config: ModelConfig) -> str:
    """'auto': bfloat16 on GPUs; on CPUs whatever choose_cpu_dtype measured faster."""
    if dtype != "auto":
        return dtype
    if device_type == "cuda":
        return "bfloat16"
    return choose_cpu_dtype(model_config)


def resolve_kv_cache_dtype(kv_cache_dtype: str, serving: str, device_type: str,
                           backend: str = "torch", explicit_dtype: bool = False) -> str:
    """The KV cache's dtype for --kv-cache-dtype under a resolved serving dtype.

    auto: the serving dtype when the dtype was given explicitly (--dtype float32 means a
    float32 cache too: a float16 one changed greedy answers, "List three prime numbers."
    among them). Under --dtype auto, float16 on a CPU serving float32 whose C kernels are
    built and which converts float16 in hardware (f16c): decode attention reads the whole
    context every step and is bound by those bytes (measured on SmolLM2 at 32 streams,
    bench/results), and float16 keeps 10 mantissa bits (tests/test_native_weights.py
    measures it against a float32 cache on the reference prompts). Elsewhere the serving
    dtype. An explicit float16 under float32 is a CPU option; otherwise the cache is the
    serving dtype. Raises UserInputError for any other pairing (config.KV_CACHE_DTYPES are
    the names)."""
    from tokstream.errors import UserInputError
    from tokstream.kernels import cpu_attention, cpu_small_ops

    # The C kernels read a float16 cache; Triton's (on CPU under its interpreter) do not.
    half_on_cpu = device_type == "cpu" and serving == "float32" and backend == "torch"
    if kv_cache_dtype == "auto":
        fast = (half_on_cpu and not explicit_dtype and "f16c" in cpu_flags()
                and cpu_small_ops.load() is not None and cpu_attention.load() is not None)
        return "float16" if fast else serving
    if kv_cache_dtype == serving or (kv_cache_dtype == "float16" and half_on_cpu):
        return kv_cache_dtype
    raise UserInputError(f"a {kv_cache_dtype} KV cache under {serving} compute on "
                         f"{device_type} is not supported: use auto, {serving}"
                         + (" or float16" if half_on_cpu else ""))
