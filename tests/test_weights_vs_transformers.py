"""The embedded SmolLM2 as we load it (dequantised to float32) against Hugging Face
transformers (the tests are marked slow): transformers' Llama on our weights gives the reference
greedy answer, and transformers' own GGUF reader gives the same config and the same tensors."""

from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch

from tokstream.model.source import embedded_gguf_path, resolve_model
from tokstream.model.weights import load_state_dict

CHAT_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Never touch the user's ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


def transformers_llama(config, state_dict):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_position,
        rope_theta=config.rope_theta, rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings, bos_token_id=config.bos_token_id,
        eos_token_id=list(config.eos_token_ids), attn_implementation="eager")
    with no_init_weights():  # every weight is loaded below (~5 s of random init saved)
        model = LlamaForCausalLM(hf_config).to(torch.float32)
    result = model.load_state_dict(state_dict, strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == ["lm_head.weight"]
    model.tie_weights()
    return model.eval()


@pytest.fixture(scope="module", autouse=True)
def gguf_parsed_once():
    """One gguf.GGUFReader of the file for the module: transformers parses it anew for its
    tokenizer, its config and its tensors (~4 s each here); each reads the same parse.
    tokstream's own loader does not use GGUFReader, so it stays independent."""
    import gguf

    parse = functools.cache(gguf.GGUFReader)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", lambda path, mode="r": parse(os.path.realpath(path), mode))
        yield


@pytest.fixture(scope="module")
def smollm2_state_dict(tmp_path_factory):
    cache = tmp_path_factory.mktemp("xdg-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache))
        source = resolve_model("smollm2")
        yield source, load_state_dict(source, torch.float32)
    shutil.rmtree(cache)  # 538 MB that pytest would otherwise keep for three runs


@pytest.fixture(scope="module")
def transformers_gguf_reference():
    """(config, tensors) from transformers' own GGUF path (~12 s): an independent reader,
    dequantisation and unpermute. The full from_pretrained(gguf_file=...) would run the same
    code but needs `accelerate`, which tokstream does not otherwise use."""
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.split(embedded_gguf_path())
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):  # only its parameter names are used
        skeleton = LlamaForCausalLM(config)
    loaded = load_gguf_checkpoint(embedded_gguf_path(), return_tensors=True,
                                  model_to_load=skeleton)
    return config, loaded["tensors"]


@pytest.mark.slow
def test_smollm2_greedy_answer_matches_reference(smollm2_state_dict):
    from transformers import AutoTokenizer

    source, state_dict = smollm2_state_dict
    model = transformers_llama(source.config, state_dict)
    folder, name = os.path.split(source.path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    prompt_ids = tokenizer(CHAT_PROMPT, add_special_tokens=False, return_tensors="pt").input_ids
    assert prompt_ids.shape == (1, 37)
    with torch.no_grad():
        output = model.generate(prompt_ids, max_new_tokens=12, do_sample=False)
    answer = output[0, prompt_ids.shape[1]:].tolist()
    assert answer[-1] == 2  # <|im_end|>
    assert tokenizer.decode(answer[:-1]) == "The capital of France is Paris."


@pytest.mark.slow
def test_smollm2_equals_transformers_gguf_loader(smollm2_state_dict, transformers_gguf_reference):
    source, ours = smollm2_state_dict
    hf, theirs = transformers_gguf_reference
    c = source.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads,
            c.num_kv_heads, c.head_dim, c.max_position, c.rope_theta, c.tie_word_embeddings,
            c.bos_token_id, c.eos_token_ids) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers,
        hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim,
        hf.max_position_embeddings, hf.rope_parameters["rope_theta"], hf.tie_word_embeddings,
        hf.bos_token_id, (hf.eos_token_id,))
    assert c.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=0, msg=name)
