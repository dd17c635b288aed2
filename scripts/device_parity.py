"""Greedy tokens on DEVICE equal the CPU path's (float32), for every way DEVICE can run the model:
the Triton kernels with CUDA graphs, without them (TOKSTREAM_CUDA_GRAPHS=0), and the torch
reference on the device (TOKSTREAM_KERNELS=torch). bfloat16 agreement is reported, not
required (rounding differs between devices; measured on the default path only). Exit 1 on any
float32 mismatch.

    python scripts/device_parity.py cuda [--json FILE]
    python scripts/device_parity.py cpu     # plumbing: the Triton kernels under the interpreter

The model is dummy:tiny with its random weights scaled 10x (saved as a Hugging Face folder):
at the preset's scale the greedy tokens hardly depend on attention, so a broken kernel could
still pass.
"""

import argparse
import json
import os
import sys
import tempfile
from contextlib import contextmanager

from tokstream.config import EngineConfig
from tokstream.engine.llm import LLM
from tokstream.sampling_params import SamplingParams

PROMPTS = [[5, 17, 99, 3], list(range(10, 60)), [7] * 33]


def sharp_tiny_folder(path: str) -> str:
    import torch

    from tokstream.model.source import resolve_model
    from tokstream.model.weights import load_state_dict, save_hf_folder
    from tokstream.text.tokenizer import dummy_tokenizer

    source = resolve_model("dummy:tiny")
    weights = load_state_dict(source, torch.float32, seed=1)
    weights = {k: w if k.endswith("norm.weight") else w * 10 for k, w in weights.items()}
    c = source.config
    tokenizer = dummy_tokenizer(c.vocab_size, c.bos_token_id, c.eos_token_ids)
    return str(save_hf_folder(path, c, weights, tokenizer_json=tokenizer.backend.to_str()))


@contextmanager
def environment(**values):
    """Set variables for the workers spawned inside (they inherit os.environ); afterwards the
    environment is as it was, whole (as rank_start.rank_main takes one on)."""
    before = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


def generate(model: str, device: str, dtype: str, env: dict) -> tuple[list, dict]:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with environment(**env), LLM(EngineConfig(model=model, dtype=dtype, device=device)) as llm:
        ready = llm.core.executor.ready
        tokens = [c.token_ids for c in llm.generate(PROMPTS, params)]
        return tokens, {"kernels": ready.kernels, "graph_batch_sizes": ready.graph_batch_sizes}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("device", nargs="?", default="cuda")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.device == "cpu":
        variants = {"triton (interpreter)": {"TOKSTREAM_KERNELS": "triton",
                                             "TRITON_INTERPRET": "1"}}
    else:
        variants = {"triton + cuda graphs": {}, "triton eager": {"TOKSTREAM_CUDA_GRAPHS": "0"},
                    "torch reference": {"TOKSTREAM_KERNELS": "torch"}}
    report = {"device": args.device, "model": "dummy:tiny x10 weights", "runs": []}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        model = sharp_tiny_folder(os.path.join(tmp, "tiny"))
        # On CPU (the interpreter: plumbing only) float32 alone keeps the run short.
        for dtype in ("float32",) if args.device == "cpu" else ("float32", "bfloat16"):
            expected, _ = generate(model, "cpu", dtype, {})
            # bfloat16 only on the serving path: the check must fit gpu_check.sh's budget.
            for name, env in list(variants.items())[:None if dtype == "float32" else 1]:
                tokens, ready = generate(model, args.device, dtype, env)
                same = sum(a == b for x, y in zip(tokens, expected) for a, b in zip(x, y))
                total = sum(len(x) for x in expected)
                equal = tokens == expected
                if dtype == "float32":
                    ok &= equal
                report["runs"].append({"variant": name, "dtype": dtype, "equal": equal,
                                       "tokens_agreeing": same, "tokens": total, **ready})
                print(f"{dtype} {name} ({ready['kernels']}, graphs "
                      f"{list(ready['graph_batch_sizes']) or 'off'}): cpu == {args.device}: "
                      f"{equal} ({same}/{total} tokens agree)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report, "ok": ok}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":  # workers are spawned: the main module must be importable
    sys.exit(main())
