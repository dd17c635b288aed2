"""transformers' Llama on tokstream's dequantised weights, float32: the reference that parity,
lm-eval and client tests hold the served model to."""

from __future__ import annotations

import torch

from tokstream.model.weights import hf_config_dict


def hf_llama(source, state_dict):
    """LlamaForCausalLM on state_dict (eager attention, the embedding tied to the head)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    config = LlamaConfig.from_dict(hf_config_dict(source.config))
    config._attn_implementation = "eager"
    with no_init_weights():  # every weight is loaded below (~5 s of random init saved)
        model = LlamaForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model


def hf_greedy(hf_model, prompt: list[int], eos: set[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens for one prompt: a plain loop, no generate() config
    surprises."""
    ids, generated, past = torch.tensor([prompt]), [], None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = hf_model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            generated.append(token)
            if token in eos:
                break
            ids = torch.tensor([[token]])
    return generated
