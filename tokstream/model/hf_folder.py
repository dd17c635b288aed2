"""Hugging Face folders (config.json + *.safetensors) and the HF Llama tensor layout every
loader produces. No torch import at module level: resolving a model must not need it."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from tokstream.config import ModelConfig
from tokstream.errors import CorruptModelError, UserInputError

if TYPE_CHECKING:
    import torch

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
INDEX_FILE = "model.safetensors.index.json"


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model with this config has, by its Hugging Face name, in load order.
    lm_head.weight is absent for tied models: the head reuses model.embed_tokens.weight."""
    return dict(iter_tensor_shapes(config))


def iter_tensor_shapes(config: ModelConfig):
    """(name, shape) pairs of tensor_shapes, lazily: a corrupt file's layer count can be huge."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    yield "model.embed_tokens.weight", (v, h)
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (q, h)  # (out_features, in_features)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        if config.qkv_bias:
            yield p + "self_attn.q_proj.bias", (q,)
            yield p + "self_attn.k_proj.bias", (kv,)
            yield p + "self_attn.v_proj.bias", (kv,)
        yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate_proj.weight", (i, h)
        yield p + "mlp.up_proj.weight", (i, h)
        yield p + "mlp.down_proj.weight", (h, i)
    yield "model.norm.weight", (h,)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", (v, h)


def check_tensor_shapes(config: ModelConfig, found: dict[str, tuple[int, ...]], where: str) -> None:
    """Raise CorruptModelError unless `found` holds every tensor the config needs, in shape."""
    for name, shape in iter_tensor_shapes(config):
        if name not in found:
            raise CorruptModelError(f"{where}: tensor {name} is missing")
        if tuple(found[name]) != shape:
            raise CorruptModelError(
                f"{where}: tensor {name} has shape {tuple(found[name])}, the config needs {shape}")


def read_hf_config(folder: str | Path) -> ModelConfig:
    """ModelConfig from a Hugging Face folder's config.json (Llama or Qwen2)."""
    folder = Path(folder)
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CorruptModelError(f"{folder / 'config.json'} cannot be read: {e}") from None
    if not isinstance(raw, dict):
        raise CorruptModelError(f"{folder / 'config.json'} is not a JSON object")
    architecture = (raw.get("architectures") or [None])[0]
    family = ARCHITECTURES.get(architecture) or {"llama": "llama", "qwen2": "qwen2"}.get(
        raw.get("model_type"))
    if family is None:
        raise CorruptModelError(
            f"{folder}: unsupported architecture {architecture or raw.get('model_type')!r}"
            f" (tokstream runs {', '.join(ARCHITECTURES)})")
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (None, "default"):
        raise CorruptModelError(f"{folder}: rope scaling {rope_type!r} is not supported")
    if family == "llama" and (raw.get("attention_bias") or raw.get("mlp_bias")):
        raise CorruptModelError(f"{folder}: Llama attention_bias/mlp_bias are not supported")
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return ModelConfig(
            name=folder.resolve().name,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position=int(raw.get("max_position_embeddings", 2048)),
            rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(int(t) for t in eos_ids),
        )
    except KeyError as e:
        raise CorruptModelError(f"{folder / 'config.json'} lacks {e.args[0]!r}") from None
    except UserInputError as e:  # ModelConfig's own validation
        raise CorruptModelError(f"{folder / 'config.json'}: {e}") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise CorruptModelError(f"{folder / 'config.json'} has a bad value: {e}") from None


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files: the shards named by the index, else every *.safetensors."""
    index = folder / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CorruptModelError(f"{index} cannot be read: {e}") from None
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CorruptModelError(f"{folder} has no *.safetensors weights (.bin is not supported)")
    return files


def load_hf_tensors(folder: str | Path, config: ModelConfig, dtype: "torch.dtype",
                    device: str = "cpu") -> dict[str, "torch.Tensor"]:
    """Read the folder's weights as HF-named tensors in `dtype`; extra tensors (e.g. a tied
    lm_head, rotary inv_freq buffers) are dropped."""
    folder = Path(folder)
    files = safetensors_files(folder)
    shapes = {}
    for file in files:  # headers only: check everything before reading any weights
        with _open_safetensors(file, "pt", device) as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    check_tensor_shapes(config, shapes, str(folder))
    wanted = tensor_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with _open_safetensors(file, "pt", device) as f:
            for name in f.keys():
                if name in wanted:
                    tensors[name] = f.get_tensor(name).to(dtype)
    return {name: tensors[name] for name in wanted}


@contextmanager
def _open_safetensors(file: Path, framework: str, device: str):
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework=framework, device=device) as f:
            yield f
    except (OSError, SafetensorError) as e:
        raise CorruptModelError(f"{file} cannot be read: {e}") from None
