"""Model weights as Hugging Face-named torch tensors, from any source. Worker code only:
this is the one model/ file that imports torch."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from tokstream.config import ModelConfig
from tokstream.model.hf_folder import load_hf_tensors, tensor_shapes
from tokstream.model.source import ModelSource
from tokstream.model.weights_cache import load_gguf_cached

log = logging.getLogger("tokstream.model")

DUMMY_STD = 0.02


def load_state_dict(source: ModelSource, dtype: torch.dtype, seed: int = 0,
                    device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """HF-named tensors in `dtype` on `device`, in tensor_shapes(config) order. A tied model
    has no lm_head.weight: the head is model.embed_tokens.weight. `seed` only matters for
    dummy weights."""
    start = time.perf_counter()
    if source.kind == "dummy":
        tensors = dummy_state_dict(source.config, dtype, seed, device)
    elif source.kind == "hf":
        tensors = load_hf_tensors(source.path, source.config, dtype, str(device))
    elif source.kind == "gguf":
        cached = load_gguf_cached(source.path, source.config)  # float32, memory-mapped
        tensors = {name: t.to(device=device, dtype=dtype) for name, t in cached.items()}
    else:
        raise ValueError(f"unknown model source kind {source.kind!r}")
    log.info("weights of %s ready as %s on %s in %.2f s", source.config.name,
             str(dtype).removeprefix("torch."), device, time.perf_counter() - start)
    return tensors


def load_native_state_dict(source: ModelSource) -> dict[str, object]:
    """A GGUF's tensors on CPU with its Q4_0/Q4_1/Q8_0 matrices kept quantised (as
    QuantizedWeight, scales widened to float32), the rest (norms, other formats) float32.
    Read straight from the file: no weight is dequantised, so there is no cache to build."""
    from tokstream.kernels.cpu_quant import with_float_scales
    from tokstream.model.gguf_file import QuantizedArray, load_gguf_native
    from tokstream.worker.quant_linear import QuantizedWeight

    start = time.perf_counter()
    tensors = {}
    for name, value in load_gguf_native(source.path, source.config).items():
        if isinstance(value, QuantizedArray):
            blocks, qtype = with_float_scales(value.data, value.ggml_type)
            tensors[name] = QuantizedWeight(torch.from_numpy(blocks), qtype, value.in_features)
        else:
            tensors[name] = torch.from_numpy(value)
    log.info("native weights of %s read in %.2f s", source.config.name,
             time.perf_counter() - start)
    return tensors


def dummy_state_dict(config: ModelConfig, dtype: torch.dtype, seed: int = 0,
                     device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Random weights with the model's real shapes, as vLLM's dummy load format: normal(0, 0.02)
    matrices and biases, unit norms. The same seed and device give the same weights; they are
    drawn in float32 so every dtype rounds the same values."""
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in tensor_shapes(config).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            weight = torch.empty(shape, dtype=torch.float32, device=device)
            tensors[name] = weight.normal_(0.0, DUMMY_STD, generator=generator).to(dtype)
    return tensors


def hf_config_dict(config: ModelConfig) -> dict:
    """config.json for transformers (LlamaForCausalLM, or Qwen2ForCausalLM for q/k/v bias)."""
    qwen2 = config.qkv_bias  # a Llama attention_bias would add an o_proj bias too
    eos = list(config.eos_token_ids)
    return {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen2 else "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": "float32",
    }


def save_hf_folder(path: str | Path, config: ModelConfig, state_dict: dict[str, torch.Tensor],
                   tokenizer_json: str | None = None) -> Path:
    """Write a Hugging Face folder (config.json, model.safetensors in float32, and
    tokenizer.json when given) that read_hf_config / load_state_dict read back."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config_dict(config), indent=2) + "\n")
    tensors = {name: state_dict[name].detach().to("cpu", torch.float32).contiguous()
               for name in tensor_shapes(config)}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    if tokenizer_json is not None:
        (folder / "tokenizer.json").write_text(tokenizer_json)
    return folder
