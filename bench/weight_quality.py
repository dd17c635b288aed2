"""How far each weight path and KV cache dtype moves SmolLM2 from float32 (issue 28 item 3),
with vLLM's CPU build at bfloat16 and float32 measured the same way through its logprobs.

The reference is tokstream's dequantised float32 model over a float32 cache (equal to
transformers, tests/test_parity.py). For the 7 reference prompts each config gives:
- greedy tokens (32, up to the reference's end of turn) equal or not; where not, the step
  they part and the reference's gap between its top two logits there (a near-tie below 0.05
  is allowed, written down);
- the first generated token's top-20 logprobs against the reference's for the same tokens
  (what vLLM's API exposes): the largest difference;
- perplexity on a fixed text relative to the reference's (vLLM: from its prompt_logprobs).

tokstream's configs run in this process: native (the GGUF blocks, float32), bfloat16 copies
(every decoder product from one row on through the bfloat16 copies: the worst case, what a
batch of 32 and a prefill take), the bfloat16 copies for a prompt's rows only (a stream's
decodes on the blocks), the bf16dot copies the same way (where the CPU has AVX-512
BF16), the int16 copies from one row on (LM head included: what a
machine whose crossovers give int16 every row count serves), the float16 cache `--kv-cache-dtype auto` picks, both, and
the dequantised bfloat16 model (`--weights bfloat16`). vLLM (built by
scripts/setup_vllm_peer.sh) is served from the same dequantised weights as a Hugging Face
folder (--enforce-eager: the compiled mode gives the same numbers, and starts 3x slower).

    .venv/bin/python bench/weight_quality.py            # JSON: bench/results/weight_quality-<cpu kind>.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "bench")]

import torch  # noqa: E402

from compare_machine import default_threads, host_info, loadavg  # noqa: E402
from compare_peers import (DEFAULT_VENV, PEER_DIR, ensure_hf_folder, gguf_info,  # noqa: E402
                           resolve_gguf)
from compare_servers import Server, free_port  # noqa: E402
from helpers.prefill import decode_greedy, prefill_logits  # noqa: E402
from helpers.reference_text import CHAT_PROMPTS, RAW_PROMPTS, TEXT  # noqa: E402
from tokstream.kernels import cpu_bf16_dot, cpu_build, cpu_int16  # noqa: E402
from tokstream.model.source import resolve_model  # noqa: E402
from tokstream.model.weights import load_native_state_dict, load_state_dict  # noqa: E402
from tokstream.text.tokenizer import load_tokenizer  # noqa: E402
from tokstream.worker import matrix_units  # noqa: E402
from tokstream.worker.model import LlamaModel  # noqa: E402
from tokstream.worker.onednn_linear import BfloatWeight  # noqa: E402

STEPS = 32
TOP = 20
NEAR_TIE = 0.05
"""A greedy difference is allowed only where the reference's top two logits are this close."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-venv", default=DEFAULT_VENV)
    p.add_argument("--hf-folder", default=os.path.join(PEER_DIR, "smollm2-hf"))
    p.add_argument("--no-vllm", action="store_true", help="tokstream's configs only")
    p.add_argument("--json", default=os.path.join(
        ROOT, "bench", "results", f"weight_quality-{cpu_build.cpu_kind()}.json"))
    return p.parse_args()


def load_models(source):
    dense = LlamaModel(source.config, torch.float32)
    dense.load_weights(load_state_dict(source, torch.float32))
    native = LlamaModel(source.config, torch.float32)
    native.load_weights(load_native_state_dict(source))
    bf16 = LlamaModel(source.config, torch.bfloat16)
    bf16.load_weights(load_state_dict(source, torch.bfloat16))
    return dense, native, bf16


def with_bfloat16_copies(native, from_rows: int | None) -> None:
    """Every decoder product of from_rows rows or more through the bfloat16 copies, or none
    (None)."""
    for w in native.decoder_weights():
        if from_rows and w.bfloat16 is None:
            w.bfloat16 = BfloatWeight(w.dequantize())
        w.bfloat16_from = from_rows or 1 << 62


def with_bf16dot_copies(native, on: bool) -> None:
    """Every decoder product of one row or more through the bf16dot copies (on; the AVX-512
    BF16 kernel of the decode stack, where the CPU has it), or none."""
    for w in native.decoder_weights():
        if on and w.bf16dot is None:
            w.bf16dot = cpu_bf16_dot.pack(w.dequantize())
        w.bf16dot_rows = ((1, 1 << 62),) if on and w.bf16dot is not None else ()


def with_int16_copies(native, on: bool) -> None:
    """Every product of one row or more, the LM head's too, through the int16 copies (on),
    as a machine whose measured crossovers give int16 every row count takes them; or none."""
    for w in native.quantized_weights():
        if on and w.int16 is None:
            w.int16 = cpu_int16.pack(w.data, w.qtype, w.in_features)
        w.int16_rows = ((1, 1 << 62),) if on and w.int16 is not None else ()


def first_step_logprobs(logits: torch.Tensor) -> dict[int, float]:
    """Top-TOP logprobs of one logits row: {token: logprob}."""
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    values, ids = logprobs.topk(TOP)
    return {int(i): float(v) for i, v in zip(ids, values)}


def compare_prompt(ref_tokens, ref_logits, ref_first: dict, tokens, first: dict, eos) -> dict:
    """One config against the reference on one prompt."""
    end = next((i + 1 for i, t in enumerate(ref_tokens) if t in eos), len(ref_tokens))
    ref_tokens, tokens = ref_tokens[:end], tokens[:end]
    out: dict = {"greedy_equal": tokens == ref_tokens}
    if not out["greedy_equal"]:
        part = next((i for i in range(min(len(tokens), len(ref_tokens)))
                     if tokens[i] != ref_tokens[i]), min(len(tokens), len(ref_tokens)))
        out["parted_at_step"] = part
        if part < len(ref_logits):
            top2 = ref_logits[part].topk(2).values
            out["reference_top2_gap"] = round(float(top2[0] - top2[1]), 5)
            out["near_tie"] = out["reference_top2_gap"] < NEAR_TIE
    ref_all = torch.log_softmax(ref_logits[0].double(), dim=-1)
    out["first_step_max_logprob_diff"] = round(max(abs(lp - float(ref_all[t]))
                                                   for t, lp in first.items()), 5)
    out["first_step_top1_equal"] = max(first, key=first.get) == max(ref_first, key=ref_first.get)
    return out


def tokstream_configs(source, tokenizer, prompts) -> tuple[dict, dict]:
    dense, native, bf16 = load_models(source)
    eos = set(source.config.eos_token_ids)
    ids = tokenizer.encode(TEXT)
    targets = torch.tensor(ids[1:])

    def perplexity(model) -> float:
        logits = prefill_logits(model, ids)[:-1].float()
        return float(torch.nn.functional.cross_entropy(logits, targets).exp())

    reference = []
    for prompt in prompts:
        tokens, logits = decode_greedy(dense, source.config, prompt, torch.float32, STEPS)
        reference.append((tokens, logits, first_step_logprobs(logits[0])))
    ref_ppl = perplexity(dense)
    configs = {"native": (native, False, torch.float32),
               "native+float16_cache": (native, False, torch.float16),
               "int16_copies": (native, "int16", torch.float32),
               "int16_copies+float16_cache": (native, "int16", torch.float16),
               "bfloat16_copies": (native, True, torch.float32),
               **({"bf16dot_copies": (native, "bf16dot", torch.float32),
                   "bf16dot_copies+float16_cache": (native, "bf16dot", torch.float16)}
                  if cpu_bf16_dot.available() else {}),
               "bfloat16_copies+float16_cache": (native, True, torch.float16),
               # What one stream gets where the probe gives the bfloat16 copies a prompt's
               # rows only (the prefill; its decodes on the blocks), as on an AMX Xeon.
               "bfloat16_prefill": (native, "prefill", torch.float32),
               "bfloat16_prefill+float16_cache": (native, "prefill", torch.float16),
               "dequantized_bfloat16": (bf16, False, torch.bfloat16)}
    results = {}
    for name, (model, copies, cache) in configs.items():
        with_bfloat16_copies(native, 1 if copies is True else 2 if copies == "prefill" else None)
        with_int16_copies(native, copies == "int16")
        with_bf16dot_copies(native, copies == "bf16dot")
        rows = []
        for prompt, (ref_tokens, ref_logits, ref_first) in zip(prompts, reference):
            tokens, logits = decode_greedy(model, source.config, prompt, cache, STEPS)
            rows.append(compare_prompt(ref_tokens, ref_logits, ref_first, tokens,
                                       first_step_logprobs(logits[0].float()), eos))
            rows[-1]["first_step_max_logit_diff"] = round(
                float((logits[0].float() - ref_logits[0]).abs().max()), 5)
        results[name] = summarize(rows, perplexity(model) / ref_ppl - 1)
    with_bfloat16_copies(native, None)
    with_int16_copies(native, False)
    with_bf16dot_copies(native, False)
    return results, {"reference": reference, "perplexity": ref_ppl, "ids": ids}


def summarize(rows: list[dict], perplexity_change: float) -> dict:
    return {"prompts": rows,
            "greedy_equal": sum(r["greedy_equal"] for r in rows),
            "greedy_differ_not_near_tie": sum(not r["greedy_equal"] and not r.get("near_tie")
                                              for r in rows),
            "first_step_max_logprob_diff": max(r["first_step_max_logprob_diff"] for r in rows),
            "perplexity_change": round(perplexity_change, 6),
            "passes": (all(r["greedy_equal"] or r.get("near_tie") for r in rows)
                       and abs(perplexity_change) < 0.005)}


def vllm_config(args, dtype: str, prompts, ref: dict, eos, work: str) -> dict:
    vllm_peer = os.path.join(args.vllm_venv, "bin", "vllm-peer")
    port = free_port()
    cmd = [vllm_peer, "serve", args.hf_folder, "--dtype", dtype, "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "smollm2", "--enforce-eager",
           "--max-logprobs", str(TOP)]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_KVCACHE_SPACE="2")
    server = Server(f"vllm_{dtype}", cmd, env,
                    os.path.join(work, f"vllm_{dtype}.log"), port)
    import httpx

    try:
        server.wait_healthy(600)
        url = f"http://127.0.0.1:{port}/v1/completions"
        rows = []
        for prompt, (ref_tokens, ref_logits, ref_first) in zip(prompts, ref["reference"]):
            body = {"model": "smollm2", "prompt": prompt, "max_tokens": STEPS + 1,
                    "temperature": 0, "logprobs": TOP, "ignore_eos": True,
                    "return_tokens_as_token_ids": True}
            choice = httpx.post(url, json=body, timeout=300).json()["choices"][0]
            tokens = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
            first = {int(t.split(":")[1]): lp
                     for t, lp in choice["logprobs"]["top_logprobs"][0].items()}
            rows.append(compare_prompt(ref_tokens, ref_logits, ref_first, tokens, first, eos))
        body = {"model": "smollm2", "prompt": ref["ids"], "max_tokens": 1, "temperature": 0,
                "prompt_logprobs": 0}
        scored = httpx.post(url, json=body, timeout=300).json()["choices"][0]["prompt_logprobs"]
        nll = -sum(entry[str(token)]["logprob"]
                   for token, entry in zip(ref["ids"][1:], scored[1:]))
        ppl = float(torch.tensor(nll / (len(ref["ids"]) - 1)).exp())
        return summarize(rows, ppl / ref["perplexity"] - 1)
    finally:
        server.stop()


def main() -> int:
    args = parse_args()
    vllm_peer = os.path.join(args.vllm_venv, "bin", "vllm-peer")
    if not args.no_vllm and not os.access(vllm_peer, os.X_OK):
        # Said before tokstream's configs run, not after their minutes are spent.
        raise SystemExit(f"{vllm_peer} missing: run scripts/setup_vllm_peer.sh first "
                         "(or --no-vllm for tokstream's configs only)")
    torch.set_num_threads(default_threads())
    started = time.time()
    source = resolve_model("smollm2")
    tokenizer = load_tokenizer(source)
    prompts = ([tokenizer.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
               + [tokenizer.encode(p) for p in RAW_PROMPTS])
    out = {"what": __doc__.split("\n\n")[0], "host": host_info(),
           "cpu_kind": cpu_build.cpu_kind(), "matrix_units": matrix_units.describe(),
           "prompts": CHAT_PROMPTS + RAW_PROMPTS, "steps": STEPS, "near_tie": NEAR_TIE,
           "command": " ".join(sys.argv)}
    out["tokstream"], ref = tokstream_configs(source, tokenizer, prompts)
    if not args.no_vllm:
        gguf = gguf_info(resolve_gguf(argparse.Namespace(gguf=None)))
        work = os.path.join(ROOT, "bench", "out", "weight_quality")
        os.makedirs(work, exist_ok=True)
        out["hf_folder"] = ensure_hf_folder(args.hf_folder, gguf, work)
        out["vllm"] = {dtype: vllm_config(args, dtype, prompts, ref,
                                          set(source.config.eos_token_ids), work)
                       for dtype in ("bfloat16", "float32")}
    out["loadavg_at_end"] = loadavg()
    out["took_s"] = round(time.time() - started, 1)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    for side in ("tokstream", "vllm"):
        for name, r in out.get(side, {}).items():
            print(f"{side} {name}: greedy {r['greedy_equal']}/7 "
                  f"(not near-tie {r['greedy_differ_not_near_tie']}), first-step logprob "
                  f"diff {r['first_step_max_logprob_diff']:.4f}, perplexity "
                  f"{r['perplexity_change']:+.4%}, passes {r['passes']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
