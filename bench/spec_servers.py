"""Each server's speculation variants in spec_bench: the serve arguments of off / ngram / auto
for tokstream, vLLM and llama-server, and the run of each variant alone (settle, start, probe,
measure every mix, stop)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict

from compare_contenders import serve_and_measure, tokstream_serve_available
from compare_machine import cpu_range, settle
from compare_probes import probe_ignore_eos
from compare_servers import MODEL_NAME, cmdline, free_port
from spec_measure import counter_delta, run_streams, scrape, summarize
from spec_workload import MIXES, WARMUP


def log(msg: str) -> None:
    print(f"[spec_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- variants ----------------------------------------------------------------------------

def option_text(help_text: str, flag: str) -> str:
    """The help entry of one option (its line and the wrapped ones under it)."""
    lines = help_text.splitlines()
    for i, line in enumerate(lines):
        if re.search(rf"{re.escape(flag)}(?![\w-])", line):
            text = line
            for more in lines[i + 1:i + 6]:
                if re.match(r"^[│|\s]*-", more) or not more.strip("│ "):
                    break
                text += " " + more
            return re.sub(r"[│╭╰─]+", " ", text)
    return ""


def speculative_modes(help_text: str) -> tuple[list[str], str | None]:
    """(the --speculative values `tokstream serve --help` names, its default)."""
    text = option_text(help_text, "--speculative")
    default = re.search(r"\[default:\s*\(?([\w-]+)\)?\]", text)
    modes = [m for m in ("off", "ngram", "auto") if re.search(rf"\b{m}\b", text)]
    return modes, default.group(1) if default else None


def tokstream_variant_args(name: str, k: int) -> list[str]:
    """Serve arguments of a tokstream variant: off, ngram, auto or NAME=ARGS (auto drafts up
    to k a step, as many as pay for themselves)."""
    if "=" in name:
        return shlex.split(name.partition("=")[2])
    if name == "off":
        return ["--speculative", "off"]
    return ["--speculative", name, "--num-speculative-tokens", str(k)]


def vllm_variant_args(name: str, k: int) -> list[str]:
    if name == "off":
        return []
    if name == "ngram":
        # The same drafting rule as tokstream's defaults: the longest suffix of 4 down to 2.
        return ["--speculative-config", json.dumps({
            "method": "ngram", "num_speculative_tokens": k,
            "prompt_lookup_max": 4, "prompt_lookup_min": 2})]
    raise ValueError(f"--vllm-variants: unknown {name!r} (off, ngram)")


def llamacpp_variant_args(name: str, k: int, size_n: int) -> list[str]:
    if name == "off":
        return []
    if name == "ngram":
        # ngram-simple: the last size_n tokens looked up earlier in the sequence, the k after
        # the match drafted (one lookup length, where tokstream and vLLM try 4 down to 2).
        return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(size_n),
                "--spec-ngram-simple-size-m", str(k)]
    raise ValueError(f"--llamacpp-variants: unknown {name!r} (off, ngram)")


def llamacpp_ngram_absent(help_text: str) -> str | None:
    if "--spec-type" not in help_text or "ngram-simple" not in help_text:
        return "this llama-server's --help names no --spec-type ngram-simple"
    return None


# -- one server --------------------------------------------------------------------------

def measure(args, port: int) -> dict:
    """Warm-up, then every mix at every stream count."""
    warm, _ = run_streams(port, WARMUP, max(args.streams), max(args.streams), 16,
                          args.ignore_eos, args.request_timeout)
    runs: dict = {"warmup_failed": sum(1 for t in warm if t.error)}
    for mix, prompts in MIXES.items():
        runs[mix] = {}
        for n in args.streams:
            count = (min(args.single_prompts, len(prompts)) if n == 1
                     else n * args.requests_per_stream)
            before = scrape(port)
            log(f"  {mix}, {n} stream(s), {count} requests")
            timings, wall = run_streams(port, prompts, n, count, args.max_tokens,
                                        args.ignore_eos, args.request_timeout)
            summary = summarize(timings, wall, n)
            summary["spec_counters"] = counter_delta(before, scrape(port))
            summary["requests"] = [dict(asdict(t), tpot_ms=None if t.tpot_s is None else
                                        t.tpot_s * 1000) for t in timings]
            runs[mix][str(n)] = summary
    return runs


def run_variant(args, name: str, cmd: list[str], env_extra: dict, work: str) -> dict:
    """One server config alone: settle, start, probe, measure, stop (whatever happened)."""
    port = free_port()
    full = cmd + ["--port", str(port)]
    out: dict = {"server_cmd": cmdline(full, env_extra)}
    out.update(settle(args, name))

    def probe_and_measure() -> None:
        out["ignore_eos_probe"] = {k: v for k, v in probe_ignore_eos(port).items()
                                   if k in ("accepted", "honoured", "conclusive")}
        out["runs"] = measure(args, port)
    return serve_and_measure(args, name, full, env_extra, work, port, out, probe_and_measure,
                             log=log, error_chars=2000, log_chars=300)


def run_server(args, server: str, variants: list[str], build, work: str, block: dict,
               absent: dict | None = None) -> None:
    """Each variant of one server, into block['variants'] (absent ones with their reason)."""
    block.setdefault("variants", {})
    block.setdefault("absent", {}).update(absent or {})
    for name in variants:
        if name in block["absent"]:
            log(f"{server}/{name}: absent ({block['absent'][name]})")
            continue
        cmd, env = build(name)
        result = run_variant(args, f"{server}_{name.partition('=')[0]}", cmd, env, work)
        if result.get("error") and not result.get("runs"):
            block["absent"][name] = f"failed before measuring: {result['error'][-600:]}"
            block.setdefault("failed_starts", {})[name] = result
        else:
            block["variants"][name.partition("=")[0]] = result


def tokstream_block(args, work: str, block: dict) -> None:
    ok, why, help_text = tokstream_serve_available(args)
    if not ok:
        block["absent"] = {v: why for v in args.tokstream_variants}
        return
    modes, default = speculative_modes(help_text)
    block.update(modes_listed=modes, defaults_variant=default)
    absent = {v: f"`tokstream serve --help` lists no --speculative {v} (it names {modes})"
              for v in args.tokstream_variants if "=" not in v and v not in modes}
    model = ["--model", args.gguf] if args.gguf else []
    run_server(args, "tokstream", args.tokstream_variants, lambda v: (
        [args.tokstream, "serve"] + model + tokstream_variant_args(v, args.k) +
        ["--host", "127.0.0.1", "--served-model-name", MODEL_NAME], {}), work, block, absent)


def vllm_block(args, work: str, block: dict) -> None:
    peer = os.path.join(args.vllm_venv, "bin", "vllm-peer")
    if not os.access(peer, os.X_OK):
        block["absent"] = {v: f"{peer} missing (scripts/setup_vllm_peer.sh)"
                           for v in args.vllm_variants}
        return
    env = {"VLLM_CPU_OMP_THREADS_BIND": cpu_range(args.threads),
           "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
    run_server(args, "vllm", args.vllm_variants, lambda v: (
        [peer, "serve", args.hf_folder, "--dtype", args.vllm_dtype, "--host", "127.0.0.1",
         "--served-model-name", MODEL_NAME] + vllm_variant_args(v, args.k) +
        (["--enforce-eager"] if args.enforce_eager else []), env), work, block)


def llamacpp_block(args, gguf: str, work: str, block: dict) -> None:
    if not os.access(args.llama_server, os.X_OK):
        block["absent"] = {v: f"{args.llama_server} missing (scripts/setup_llamacpp_peer.sh)"
                           for v in args.llamacpp_variants}
        return
    help_text = subprocess.run([args.llama_server, "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    why = llamacpp_ngram_absent(help_text)
    slots = max(args.streams)
    ctx = slots * args.llama_ctx_per_slot
    run_server(args, "llamacpp", args.llamacpp_variants, lambda v: (
        [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "-a", MODEL_NAME,
         "-t", str(args.threads), "-tb", str(args.threads), "-np", str(slots), "-cb",
         "-c", str(ctx), "--metrics"] + shlex.split(args.llamacpp_extra_args) +
        llamacpp_variant_args(v, args.k, args.llamacpp_ngram_size_n), {}), work, block,
        {"ngram": why} if why else None)
