"""The one-call decode stack (kernels/cpu_decode_stack.c) against the per-layer path it
replaces: the same hidden states, bit for bit, and the same keys and values written, on a small
model with native GGUF weights; and the steps it must leave to the per-layer path."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from tokstream.config import ModelConfig
from tokstream.kernels import cpu_bf16_dot, cpu_decode_stack, cpu_int16, cpu_quant
from tokstream.model.weights import dummy_state_dict
from tokstream.worker.attention import AttentionMetadata, PrefillSeq
from tokstream.worker.decode_stack import stack_for_step
from tokstream.worker.model import LlamaModel
from tokstream.worker.model_runner import allocate_kv_caches
from tokstream.worker.quant_linear import QuantizedWeight

pytestmark = pytest.mark.skipif(cpu_decode_stack.load() is None, reason="no C compiler here")

CONFIG = ModelConfig(name="tiny-native", vocab_size=96, hidden_size=64, intermediate_size=96,
                     num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, max_position=256,
                     rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                     qkv_bias=False, bos_token_id=1, eos_token_ids=(2,))
BLOCK_SIZE, NUM_BLOCKS = 4, 32  # up to five sequences of six blocks


def native_model(formats=("Q4_1", "Q4_0", "Q8_0")) -> LlamaModel:
    """CONFIG with random weights in GGUF blocks (float32 scales, as the loader keeps them),
    the layers cycling through `formats`; random norms so a skipped norm shows."""
    state = dummy_state_dict(CONFIG, torch.float32, seed=3)
    rng = np.random.default_rng(0)
    for name in sorted(state):
        value = state[name]
        if name.endswith("norm.weight"):
            state[name] = torch.from_numpy(rng.uniform(0.5, 1.5, value.shape).astype(np.float32))
            continue
        layer = int(name.split(".")[2]) if ".layers." in name else len(formats) - 1
        qtype = GGMLQuantizationType[formats[layer % len(formats)]]
        weight = rng.normal(0, 0.1, value.shape).astype(np.float32)
        blocks, widened = cpu_quant.with_float_scales(quantize(weight, qtype), int(qtype))
        state[name] = QuantizedWeight(torch.from_numpy(np.ascontiguousarray(blocks)), widened,
                                      value.shape[1])
    model = LlamaModel(CONFIG, torch.float32)
    model.load_weights(state)
    return model


def give_int16(model: LlamaModel, rows=((1, 2), (4, 1 << 62))) -> None:
    """Every layer product takes the int16 kernel at these row ranges, as a measurement
    giving it those rows would set (by default 1 row and 4 or more, not 2-3: int16 and fused
    can trade places as rows grow)."""
    for layer in model.layers:
        for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            w.int16 = cpu_int16.pack(w.data, w.qtype, w.in_features)
            w.int16_rows = rows
            assert w.int16 is not None


def give_bf16dot(model: LlamaModel, rows=((2, 4),)) -> None:
    """Every layer product takes the bf16dot kernel at these row ranges (the batch of 3 by
    default), int16 at 1 and from 4 rows (give_int16)."""
    give_int16(model)
    for layer in model.layers:
        for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            w.bf16dot, w.bf16dot_rows = cpu_bf16_dot.pack(w.dequantize()), rows
            assert w.bf16dot is not None


def random_caches(seed: int, dtype=torch.float32):
    caches = allocate_kv_caches(CONFIG, NUM_BLOCKS, BLOCK_SIZE, 1, dtype, torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=generator))
        v.copy_(torch.randn(v.shape, generator=generator))
    return caches


def decode_meta(context_lens: list[int]) -> AttentionMetadata:
    """One new token per sequence; sequence i owns blocks i*6 .. i*6+5 (not in order)."""
    max_blocks = -(-max(context_lens) // BLOCK_SIZE)
    tables, slots, bias = [], [], []
    for i, n in enumerate(context_lens):
        own = [i * 6 + (j * 5) % 6 for j in range(6)]
        tables.append(own[:max_blocks] + [0] * (max_blocks - len(own[:max_blocks])))
        slots.append(own[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE)
        row = torch.full((max_blocks * BLOCK_SIZE,), float("-inf"))
        row[:n] = 0
        bias.append(row)
    return AttentionMetadata(slot_mapping=torch.tensor(slots), num_decodes=len(context_lens),
                             decode_block_tables=torch.tensor(tables),
                             decode_key_bias=torch.stack(bias), prefills=[],
                             decode_context_lens=torch.tensor(context_lens))


def run(model, fused: bool, ids, positions, caches, meta):
    model.fused_decode = fused
    with torch.inference_mode():
        return model(ids, positions, caches, meta)


@pytest.mark.parametrize("copies", ["fused", "int16", "bf16dot"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("context_lens", [[5], [1, 7, 24], [9, 2, 13, 20, 3]])
def test_the_stack_computes_what_the_layers_compute(context_lens, cache_dtype, copies):
    if copies == "bf16dot" and not cpu_bf16_dot.available():
        pytest.skip("no AVX-512 BF16 here: the bf16dot path is never chosen")
    model = native_model()
    if copies == "int16":
        give_int16(model)  # the batches of 1 and 5 take it, the batch of 3 not
    if copies == "bf16dot":
        give_bf16dot(model)  # the batch of 3 takes bf16dot, those of 1 and 5 int16
    meta = decode_meta(context_lens)
    ids = torch.tensor([(7 * i + 3) % CONFIG.vocab_size for i in range(len(context_lens))])
    positions = torch.tensor(context_lens) - 1
    assert stack_for_step(model, len(context_lens), random_caches(0, cache_dtype),
                          meta) is not None
    per_layer, fused = random_caches(1, cache_dtype), random_caches(1, cache_dtype)
    expected = run(model, False, ids, positions, per_layer, meta)
    got = run(model, True, ids, positions, fused, meta)
    assert torch.equal(got, expected), (got - expected).abs().max()
    for (k0, v0), (k1, v1) in zip(per_layer, fused):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)  # the same keys and values written


def test_steps_the_stack_leaves_to_the_layers():
    model = native_model()
    caches = random_caches(0)
    meta = decode_meta([3, 4])
    assert stack_for_step(model, 2, caches, meta) is not None
    with_prefill = decode_meta([3, 4])
    with_prefill.prefills = [PrefillSeq(2, 1, 1, torch.tensor([20]))]
    assert stack_for_step(model, 3, caches, with_prefill) is None
    off = decode_meta([3, 4])
    off.use_kernels = False
    assert stack_for_step(model, 2, caches, off) is None
    model.layers[1].down.crossover = 2  # two rows would take the float product there
    assert stack_for_step(model, 2, caches, meta) is None
    assert stack_for_step(model, 1, caches, decode_meta([3])) is not None
    dense = LlamaModel(CONFIG, torch.float32)
    dense.load_weights(dummy_state_dict(CONFIG, torch.float32))
    assert stack_for_step(dense, 2, caches, meta) is None
    model.layers[1].down.crossover = 1 << 62
    assert stack_for_step(model, 2, random_caches(0, torch.bfloat16), meta) is None


def test_new_caches_get_a_new_table():
    model = native_model()
    meta = decode_meta([6])
    first, second = random_caches(2), random_caches(2)
    assert stack_for_step(model, 1, first, meta) is stack_for_step(model, 1, first, meta)
    assert stack_for_step(model, 1, second, meta) is not stack_for_step(model, 1, first, meta)
    ids, positions = torch.tensor([5]), torch.tensor([5])
    run(model, True, ids, positions, second, meta)
    assert not torch.equal(first[0][0], second[0][0])  # written into the caches it was given


@pytest.mark.parametrize("path", ["fused", "int16", "bf16dot"])
def test_the_probes_stack_products_take_the_path_they_are_asked(path):
    """cpu_decode_stack.products, what the crossover probe times, runs each weight by the
    path it names through the stack's own dispatch: the product quantized_linear takes by
    that path."""
    if path == "bf16dot" and not cpu_bf16_dot.available():
        pytest.skip("no AVX-512 BF16 here: the bf16dot path is never chosen")
    model = native_model()
    give_bf16dot(model) if cpu_bf16_dot.available() else give_int16(model)
    weights = [model.layers[0].gate_up, model.layers[1].qkv]
    for rows in (1, 3, 6):
        x, out = cpu_decode_stack.products(weights, rows, path)()
        last = weights[-1]
        expected = {"fused": lambda: cpu_quant.matmul(x, last.data, last.qtype,
                                                      last.in_features),
                    "int16": lambda: cpu_int16.matmul(x, last.int16),
                    "bf16dot": lambda: cpu_bf16_dot.matmul(x, last.bf16dot)}[path]()
        assert torch.equal(out, expected)
