"""`dummy:` presets: real shapes with random weights, for tests, capacity planning and speed runs."""

from __future__ import annotations

import dataclasses

from tokstream.config import ModelConfig
from tokstream.errors import ModelNotFoundError

# Small enough that a test builds, runs and tears it down in well under a second.
TINY = ModelConfig(
    name="dummy:tiny", vocab_size=512, hidden_size=64, intermediate_size=128,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position=2048,
    rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
)

PRESETS: dict[str, ModelConfig] = {
    "tiny": TINY,
    # tiny's shapes with a 64k context: `tokstream loadtest` runs its full 50k-token mixes for
    # real on a CPU (a 50k prompt is a few seconds of prefill, its KV 25 MB in float32).
    "tiny-64k": dataclasses.replace(TINY, name="dummy:tiny-64k", max_position=65536,
                                    rope_theta=500000.0),
    # SmolLM2-135M's shapes, for speed runs without the weights.
    "smollm2-135m": ModelConfig(
        name="dummy:smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position=8192,
        rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    ),
    # Llama 3.2 1B.
    "llama-1b": ModelConfig(
        name="dummy:llama-1b", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, max_position=131072,
        rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=128000,
        eos_token_ids=(128001, 128009),
    ),
    # Llama 3 8B.
    "llama-8b": ModelConfig(
        name="dummy:llama-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position=8192,
        rope_theta=500000.0, bos_token_id=128000, eos_token_ids=(128001, 128009),
    ),
    # Llama 2 70B (GQA, 8 KV heads): the seed's capacity arithmetic is stated for these shapes.
    "llama-70b": ModelConfig(
        name="dummy:llama-70b", vocab_size=32000, hidden_size=8192, intermediate_size=28672,
        num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, max_position=4096,
        rope_theta=10000.0, bos_token_id=1, eos_token_ids=(2,),
    ),
}


def dummy_config(name: str) -> ModelConfig:
    """Config for 'dummy:NAME' (or bare NAME)."""
    key = name.removeprefix("dummy:")
    if key not in PRESETS:
        raise ModelNotFoundError(
            f"unknown dummy preset {name!r}: choose one of "
            + ", ".join(f"dummy:{k}" for k in PRESETS)
        )
    return PRESETS[key]
