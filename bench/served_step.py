"""Where a served step's time goes: `tokstream serve` under the stock `vllm bench serve` client
(32 streams of 128 -> 128 by default, as bench/compare_vllm.py runs them), with the engine core
writing each step's times (TOKSTREAM_STEP_TIMES, tokstream/engine/step_times.py) and the CPU
seconds each process of the server used during the run.

    .venv/bin/python bench/served_step.py   # -> bench/results/served_step-<cpu kind>.json
    .venv/bin/python bench/served_step.py --label native --serve-arg=--weights --serve-arg=native

Per step: the core's scheduling, the ranks' round trip (pickled plan down the pipes, rank 0's
forward pass and sampling, the result back) with rank 0's own share of it, emitting the deltas,
and the gap before the next step (reading the gateway's messages, sending the deltas). Decode
steps at the full batch are summarised beside bench/step_profile.py's offline step, which
times the runner alone. Needs vLLM's venv for the client (scripts/setup_vllm_peer.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from compare_client import bench_cmd, client_env  # noqa: E402
from compare_machine import host_info, loadavg  # noqa: E402
from compare_peers import DEFAULT_VENV, PEER_DIR  # noqa: E402
from compare_servers import MODEL_NAME, run_bounded  # noqa: E402


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """role -> user + system CPU seconds of that process, all its threads, so far."""
    out = {}
    for role, pid in pids.items():
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        out[role] = times.user + times.system
    return out


def children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's waited-for children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def roles(url: str) -> dict[str, int]:
    """The server's processes by role, as /v1/state names them."""
    state = httpx.get(url + "/v1/state", timeout=30).json()
    found = {"gateway": state["gateway"]["pid"], "engine core": state["engine"]["pid"]}
    found.update({f"rank {r['rank']}": r["pid"] for r in state["ranks"]})
    return found


def ms(values: list[float]) -> dict:
    values = sorted(values)
    if not values:
        return {}
    return {"median_ms": round(statistics.median(values) * 1e3, 2),
            "p90_ms": round(values[int(0.9 * (len(values) - 1))] * 1e3, 2),
            "max_ms": round(values[-1] * 1e3, 2)}


def summarise(steps, concurrency: int) -> dict:
    """Decode steps at the full batch part by part, the prefill steps in all, and the gaps."""
    gaps = {b.step_id: b.start - (a.start + a.schedule_s + a.ranks_s + a.emit_s)
            for a, b in zip(steps, steps[1:])}
    full = [s for s in steps if s.rows == concurrency and s.tokens == s.decodes + s.drafts]
    prefill = [s for s in steps if s.tokens > s.decodes + s.drafts]
    out = {"steps": len(steps), "full_batch_decode_steps": len(full),
           "drafts_verified": sum(s.drafts for s in steps)}
    if full:
        parts = {"schedule": [s.schedule_s for s in full],
                 "ranks_round_trip": [s.ranks_s for s in full],
                 "rank0_compute": [s.rank0_s for s in full],
                 "round_trip_less_rank0": [s.ranks_s - s.rank0_s for s in full],
                 "emit": [s.emit_s for s in full],
                 "gap_before": [gaps[s.step_id] for s in full if s.step_id in gaps],
                 "whole": [s.schedule_s + s.ranks_s + s.emit_s + gaps.get(s.step_id, 0.0)
                           for s in full]}
        out["full_batch_decode"] = {name: ms(v) for name, v in parts.items()}
        whole = statistics.median(parts["whole"])
        out["full_batch_decode"]["rank0_share_of_whole"] = round(
            statistics.median(parts["rank0_compute"]) / whole, 3)
    out["prefill_steps"] = {"count": len(prefill),
                            "tokens": sum(s.tokens - s.decodes - s.drafts for s in prefill),
                            "seconds": round(sum(s.ranks_s for s in prefill), 3),
                            "sizes": [s.tokens for s in prefill]}
    return out


def run(args) -> dict:
    from tokstream.serve_process import ServeProcess

    work = Path(tempfile.mkdtemp(prefix="served_step-"))
    times_path = work / "step_times.jsonl"
    client = argparse.Namespace(no_client_shim=False, vllm_venv=args.vllm_venv,
                                hf_folder=args.hf_folder, input_len=args.input_len)
    vllm_peer = os.path.join(args.vllm_venv, "bin", "vllm-peer")
    serve_args = ["--host", "127.0.0.1", "--port", "0", "--served-model-name", MODEL_NAME,
                  *args.serve_arg]
    with ServeProcess(serve_args, env={"TOKSTREAM_STEP_TIMES": str(times_path)},
                      start_timeout_s=600, reap=True) as server:
        port = int(server.url.rsplit(":", 1)[1].strip("/"))
        warm = bench_cmd(client, vllm_peer, port, 1000, 4, 4, 16, None, None)
        run_bounded(warm, str(work / "warmup.log"), 600, client_env())
        pids = roles(server.url)
        load = loadavg()
        before, started = cpu_seconds(pids), time.monotonic()
        client_before = children_cpu_seconds()
        measured = bench_cmd(client, vllm_peer, port, 0, args.num_prompts, args.concurrency,
                             args.output_len, str(work), "client.json")
        rc = run_bounded(measured, str(work / "client.log"), 900, client_env())
        wall, after = time.monotonic() - started, cpu_seconds(pids)
        # the client shares the machine's cores with the server: what it took is theirs too
        after["client (vllm bench serve)"] = children_cpu_seconds() - client_before
        banner = next((line.strip() for line in server.log if "ready on" in line), "")
    from tokstream.engine.step_times import read

    steps = [s for s in read(str(times_path)) if s.start >= started]
    figures = json.loads((work / "client.json").read_text()) if rc == 0 else {}
    return {
        "serve_args": serve_args, "serves": banner, "load_before": load,
        "client_exit_status": rc,
        "client": {k: figures.get(k) for k in ("completed", "duration", "output_throughput",
                                               "median_ttft_ms", "median_itl_ms",
                                               "p99_itl_ms")},
        "wall_s": round(wall, 2),
        "cpu_s": {role: round(after[role] - before.get(role, 0.0), 2) for role in after},
        "summary": summarise(steps, args.concurrency),
        "step_times": [vars(s) for s in steps]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="passed to tokstream serve (repeatable)")
    p.add_argument("--label", default="defaults")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--vllm-venv", default=DEFAULT_VENV)
    p.add_argument("--hf-folder", default=os.path.join(PEER_DIR, "smollm2-hf"))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not os.path.exists(os.path.join(args.vllm_venv, "bin", "python")):
        raise SystemExit(f"no vLLM venv at {args.vllm_venv} for the client: "
                         "bash scripts/setup_vllm_peer.sh, or --vllm-venv")
    from tokstream.kernels import cpu_build

    path = Path(args.json or ROOT / f"bench/results/served_step-{cpu_build.cpu_kind()}.json")
    machine = {**host_info(), "cpu_kind": cpu_build.cpu_kind()}
    measured = run(args)
    result = {"machine": machine,
              "command": " ".join(["python", "bench/served_step.py", *sys.argv[1:]]),
              "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **measured}
    everything = json.loads(path.read_text()) if path.exists() else {}
    everything[args.label] = result
    path.write_text(json.dumps(everything, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("serves", "client", "wall_s", "cpu_s",
                                              "summary")}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
