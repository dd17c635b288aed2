"""Speculative decoding, measured (issue 34 item 6): time per output token at 1 and 8 streams
on a copy-heavy mix (repeat / edit / extract a given text) and a free-form mix (stories,
explanations), each server with speculation off and on: tokstream's settings, vLLM's CPU
build with its n-gram proposer, llama.cpp's llama-server with its n-gram draft.

    .venv/bin/python bench/spec_bench.py            # -> bench/results/spec_bench-<cpu kind>.json
    .venv/bin/python bench/spec_bench.py --quick --only tokstream --tokstream-variants off,ngram

Workload: the chat completions route, streamed, greedy (temperature 0), max_tokens 128, no
ignore_eos by default: past its end-of-answer the model writes text that is no longer the copy
or the answer being timed, so each request is measured per token it actually produced (the
usage chunk's completion_tokens). --ignore-eos sends it; every server's ignore_eos is probed
either way. Per server variant, per mix and per stream count: the median over requests of
(last token time - first token time) / (tokens - 1), output tok/s over the run's wall time,
and the speculation counters of the server's /metrics (vLLM's and tokstream's `vllm:`
names, llama-server's `llamacpp:` ones) before and after.

Derived: the copy/free ratio of time per token at 1 stream per variant (issue 34's target for
tokstream's defaults: <= 0.5), and each speculating variant over its server's `off` on both
mixes at every stream count (target on free-form: throughput within 3%).

Each server runs alone: the script waits for a quiet load average (compare_machine's settle),
records it, starts the server, warms it up, measures, stops its process group. The helpers
(processes, the machine, the model folder, versions) are bench/compare_vllm.py's modules
(compare_servers, compare_machine, compare_peers, compare_probes, compare_contenders).
This file is the run; its parts are spec_workload (the prompts), spec_measure (a timed
stream, a run's figures, the /metrics counters), spec_servers (each server's variants, each
run alone) and spec_figures (the derived figures, the targets, the table).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_machine import NotQuiet, default_threads, host_info, loadavg  # noqa: E402
from compare_peers import (DEFAULT_LLAMA_SERVER, DEFAULT_VENV, PEER_DIR,  # noqa: E402
                           ensure_hf_folder, gguf_info, resolve_gguf, versions)
from compare_servers import ROOT  # noqa: E402
from compare_vllm import stop_servers_on_signals  # noqa: E402
from spec_figures import derive, table, targets  # noqa: E402
from spec_servers import llamacpp_block, log, tokstream_block, vllm_block  # noqa: E402
from spec_workload import MIXES, WARMUP  # noqa: E402
from tokstream.kernels import cpu_build  # noqa: E402

SERVERS = ("tokstream", "vllm", "llamacpp")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(SERVERS), help="comma list of " + ", ".join(SERVERS))
    p.add_argument("--tokstream-variants", default=None,
                   help="comma list of off, ngram, auto or NAME=SERVE_ARGS (default "
                        "off,ngram,auto; a mode serve --help does not list is skipped)")
    p.add_argument("--vllm-variants", default="off,ngram")
    p.add_argument("--llamacpp-variants", default="off,ngram")
    p.add_argument("--num-speculative-tokens", "-k", dest="k", type=int, default=4,
                   help="tokens drafted per step, for every server's ngram variant")
    p.add_argument("--streams", default=None, help="comma list (default 1,8; --quick: 1,4)")
    p.add_argument("--max-tokens", type=int, default=None, help="default 128 (--quick: 32)")
    p.add_argument("--single-prompts", type=int, default=None,
                   help="prompts of each mix at 1 stream (default all 6; --quick: 2)")
    p.add_argument("--requests-per-stream", type=int, default=None,
                   help="requests per stream at N > 1 streams (default 2; --quick: 1)")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (see above)")
    p.add_argument("--tokstream", default=os.path.join(ROOT, ".venv", "bin", "tokstream"))
    p.add_argument("--gguf", default=None, help="default: the embedded SmolLM2 Q4_1")
    p.add_argument("--vllm-venv", default=DEFAULT_VENV)
    p.add_argument("--vllm-dtype", default="float32")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM --enforce-eager")
    p.add_argument("--kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--hf-folder", default=os.path.join(PEER_DIR, "smollm2-hf"))
    p.add_argument("--llama-server", default=DEFAULT_LLAMA_SERVER)
    p.add_argument("--llama-ctx-per-slot", type=int, default=1024)
    p.add_argument("--llamacpp-ngram-size-n", type=int, default=3)
    p.add_argument("--llamacpp-extra-args", default="",
                   help="e.g. --no-repack (needed on the AMX VM, shared/REFERENCE.md)")
    p.add_argument("--threads", type=int, default=default_threads())
    p.add_argument("--startup-timeout", type=float, default=420.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--quiet-load", type=float, default=0.5)
    p.add_argument("--settle-timeout", type=float, default=None, help="default 180 (--quick 15)")
    p.add_argument("--require-quiet", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 and 4 streams, 32 tokens, 2 prompts a mix at 1 stream; "
                        "the JSON goes to the work folder unless --out is given")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--note", default=None)
    args = p.parse_args(argv)
    for name, full, quick in (("streams", "1,8", "1,4"), ("max_tokens", 128, 32),
                              ("single_prompts", 6, 2), ("requests_per_stream", 2, 1),
                              ("settle_timeout", 180.0, 15.0),
                              ("tokstream_variants", "off,ngram,auto", "off,ngram")):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    args.only = split(args.only)
    if bad := [s for s in args.only if s not in SERVERS]:
        p.error(f"--only: unknown {bad}")
    args.streams = sorted({int(n) for n in split(args.streams)})
    if 1 not in args.streams:
        p.error("--streams must include 1 (the copy/free target is at 1 stream)")
    for name in ("tokstream_variants", "vllm_variants", "llamacpp_variants"):
        setattr(args, name, split(getattr(args, name)))
    for name in ("vllm_variants", "llamacpp_variants"):
        if bad := [v for v in getattr(args, name) if v not in ("off", "ngram")]:
            p.error(f"--{name.replace('_', '-')}: unknown {bad} (off, ngram)")
    return args


def workload(args) -> dict:
    return {"route": "/v1/chat/completions, streamed, stream_options.include_usage",
            "temperature": 0, "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos,
            "streams": args.streams, "single_stream_prompts": args.single_prompts,
            "requests_per_stream": args.requests_per_stream,
            "num_speculative_tokens": args.k, "threads": args.threads, "quick": args.quick,
            "warmup": f"{len(WARMUP)} other prompts x 16 tokens, not measured",
            "tpot": "median over requests of (last text chunk - first text chunk) / "
                    "(completion_tokens - 1)",
            "output_tok_per_s": "completion tokens of the run / its wall time",
            "prefix_cache": "the N-stream runs repeat the 1-stream prompts: prefix cache hits "
                            "shorten TTFT there, not the time per token",
            "vllm_dtype": args.vllm_dtype, "vllm_compiled": not args.enforce_eager,
            "order": "tokstream, vLLM, llama.cpp, each variant alone"}


def report_skeleton(args, work: str) -> dict:
    return {"what": __doc__.split("\n\n")[0], "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": shlex.join([".venv/bin/python", "bench/spec_bench.py"] + sys.argv[1:]),
            "cpu_kind": cpu_build.cpu_kind(), "host": host_info(),
            "workload": workload(args), "note": args.note, "work_dir": work,
            "prompts": {mix: [{"name": p.name, "task": p.task, "user": p.user}
                              for p in prompts] for mix, prompts in MIXES.items()},
            "servers": {s: {} for s in args.only}}


def finish(report: dict, args, started: float) -> dict:
    servers = report["servers"]
    report["figures"] = derive(servers, args.streams)
    tok = servers.get("tokstream") or {}
    report["targets"] = targets(report["figures"], tok.get("defaults_variant"), args.streams)
    report["targets"]["per_tokstream_variant"] = {
        name: targets(report["figures"], name, args.streams) for name in tok.get("variants", {})}
    each = {f"{s}/{v}": r for s, b in servers.items()
            for v, r in (b.get("variants") or {}).items()}
    report["loadavg_before_each"] = {k: r["loadavg_before"][0] for k, r in each.items()}
    report["quiet"] = bool(each) and all(r.get("quiet") for r in each.values())
    report["absent"] = {f"{s}/{v}": why for s, b in servers.items()
                        for v, why in (b.get("absent") or {}).items()}
    report["loadavg_at_end"] = loadavg()
    report["wall_s"] = time.time() - started
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    args.hf_folder = os.path.abspath(args.hf_folder)
    work = args.work_dir or tempfile.mkdtemp(prefix="spec_bench-")
    os.makedirs(work, exist_ok=True)
    out_path = args.out or (os.path.join(work, "spec_bench_quick.json") if args.quick else
                            os.path.join(ROOT, "bench", "results",
                                         f"spec_bench-{cpu_build.cpu_kind()}.json"))
    log(f"logs in {work}")
    stop_servers_on_signals()

    started = time.time()
    report = report_skeleton(args, work)
    gguf = resolve_gguf(args)
    report["model"] = gguf_info(gguf)
    report["versions"] = versions(args)
    rc = 0
    try:
        run_servers(args, gguf, work, report)
    except NotQuiet as exc:
        report["aborted"] = f"--require-quiet: {exc}"
        rc = 3
    finally:
        finish(report, args, started)
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        log(f"wrote {out_path}")
    print(table(report))
    return rc


def run_servers(args, gguf: str, work: str, report: dict) -> None:
    """Each server of --only in turn, every variant alone, into report['servers']."""
    servers = report["servers"]
    if "tokstream" in args.only:
        tokstream_block(args, work, servers["tokstream"])
    if "vllm" in args.only:
        report["model"]["hf_folder"] = ensure_hf_folder(args.hf_folder, report["model"], work)
        vllm_block(args, work, servers["vllm"])
    if "llamacpp" in args.only:
        llamacpp_block(args, gguf, work, servers["llamacpp"])


if __name__ == "__main__":
    sys.exit(main())
