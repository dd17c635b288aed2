"""Does chat keep its pace while long prompts flood in (issue 29 item 4)? One `tokstream serve`,
then `tokstream loadtest` against it: the chat mix alone (its capacity probe writes
capacity.json), then long-prompt-flood at the same rate (that capacity file, the chat run's
capacity fraction), then shared-prefix and hot-tenant at that rate too (the "no worse"
targets). Writes both classes' TTFT/ITL percentiles, the flood/alone ratios against the
issue's targets, every run's rate, the machine (CPU model, flags, cores, load average before
and after each run) and the command to bench/results/flood_bench-<cpu kind>.json.

    .venv/bin/python bench/flood_bench.py                      # SmolLM2 at serve's defaults
    .venv/bin/python bench/flood_bench.py --baseline bench/results/flood_bench-KIND.json
    .venv/bin/python bench/flood_bench.py --model dummy:tiny --duration 5s --probe-duration 3s \\
        --flood-mix /tmp/flood-2s.toml --mixes chat,long-prompt-flood,hot-tenant \\
        --out /tmp/flood_smoke.json   # a smoke test (bursts every 2 s in that copy of the mix)

Run it on a quiet machine: the figures are latencies. Extra serve flags go after `--`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokstream.serve_process import ServeProcess  # noqa: E402

FLAGS_OF_INTEREST = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                     "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "avx_vnni")
MIXES = ("chat", "long-prompt-flood", "shared-prefix", "hot-tenant")
TARGETS = {"ttft_s": ("p99", 2.0), "itl_s": ("p99", 1.5)}
"""The issue's targets: chat with the flood against chat alone, at the same rate."""
PERCENTILES = ("p50", "p90", "p99")


def machine() -> dict:
    from tokstream.kernels import cpu_build

    flags = cpu_build.cpu_flags()
    return {"cpu_kind": cpu_build.cpu_kind(), "cpu_model": cpu_build.cpu_model(),
            "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "cpu_flags": [f for f in FLAGS_OF_INTEREST if f in flags]}


def commit() -> str | None:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked=no"],
                           capture_output=True, text=True).stdout.strip()
    return (done.stdout.strip() + ("+uncommitted" if dirty else "")) if done.returncode == 0 \
        else None


def loadtest(url: str, mix: str, out: Path, args, capacity: list[str]) -> dict:
    """One `tokstream loadtest` run; its report.json, with the load average around it."""
    command = [sys.executable, "-m", "tokstream", "loadtest", "--url", url, "--mix", mix,
               "--out", str(out), "--seed", str(args.seed), "--drain-timeout",
               str(args.drain_timeout), *capacity]
    if args.duration:
        command += ["--duration", args.duration]
    before = os.getloadavg()
    started = time.time()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    report_path = out / "report.json"
    if not report_path.exists():
        raise RuntimeError(f"loadtest --mix {mix} wrote no report (exit {done.returncode}):\n"
                           f"{done.stdout[-1500:]}\n{done.stderr[-1500:]}")
    report = json.loads(report_path.read_text())
    report["_run"] = {"command": command[2:], "exit": done.returncode,
                      "wall_s": round(time.time() - started, 1),
                      "load_average_before": [round(x, 2) for x in before],
                      "load_average_after": [round(x, 2) for x in os.getloadavg()]}
    return report


def percentiles(stats: dict | None) -> dict:
    stats = stats or {}
    return {q: (round(stats[q] * 1000, 1) if stats.get(q) is not None else None)
            for q in PERCENTILES} | {"n": stats.get("n")}


def summarize(report: dict) -> dict:
    """Per class (and per tenant, where there are several): requests, completed, TTFT and ITL
    percentiles in ms; the run's rate."""
    settings = report["config"]["settings"]
    classes = {}
    for name, row in report["class"].items():
        classes[name] = {"requests": row["requests"], "completed": row["completed"],
                         "failed": row["failed"], "cancelled": row["cancelled"],
                         "ttft_ms": percentiles(row.get("ttft_s")),
                         "itl_ms": percentiles(row.get("itl_s"))}
    overall = report["summary"]
    tenants = {name: {"completed": row["completed"], "ttft_ms": percentiles(row.get("ttft_s")),
                      "itl_ms": percentiles(row.get("itl_s")),
                      "share_of_tokens": row.get("share_of_tokens"),
                      "fair_share": row.get("fair_share")}
               for name, row in report.get("tenant", {}).items()}
    return {"rate_req_s": settings.get("rate"), "capacity": settings.get("capacity"),
            "classes": classes, "tenants": tenants if len(tenants) > 1 else {},
            "overall": {"requests": overall["requests"], "completed": overall["completed"],
                        "ttft_ms": percentiles(overall.get("ttft_s")),
                        "itl_ms": percentiles(overall.get("itl_s")),
                        "output_tokens_per_s": overall.get("output_tokens_per_s")},
            "verdict": report.get("verdict"), "run": report["_run"]}


def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def compare_flood(runs: dict) -> dict:
    """Chat with the flood over chat alone, per percentile, and the issue's targets."""
    alone = runs["chat"]["classes"]["chat"]
    flooded = runs["long-prompt-flood"]["classes"]
    chat = flooded["chat"]
    ratios = {f"{key}_{q}": ratio(chat[key][q], alone[key][q])
              for key in ("ttft_ms", "itl_ms") for q in PERCENTILES}
    targets = {}
    for stat, (q, bound) in TARGETS.items():
        key = stat.replace("_s", "_ms")
        value = ratios[f"{key}_{q}"]
        targets[f"chat_{key}_{q}_ratio"] = {"value": value, "goal": f"<= {bound}x chat alone",
                                           "met": value is not None and value <= bound}
    flood = flooded.get("flood", {})
    targets["every_flood_prompt_completes"] = {
        "value": f"{flood.get('completed')} of {flood.get('requests')}",
        "met": bool(flood.get("requests")) and flood.get("completed") == flood.get("requests"),
        "flood_ttft_ms": flood.get("ttft_ms")}
    same_rate = runs["chat"]["rate_req_s"] == runs["long-prompt-flood"]["rate_req_s"]
    return {"ratios": ratios, "targets": targets, "same_rate": same_rate}


def compare_baseline(runs: dict, baseline: dict) -> dict:
    """Each mix's overall TTFT/ITL p50/p99 now over the baseline file's: the "no worse"
    target for chat, shared-prefix and hot-tenant."""
    out = {}
    for mix, run in runs.items():
        before = baseline.get("runs", {}).get(mix)
        if before is None or "overall" not in before or "overall" not in run:
            continue
        out[mix] = {f"{key}_{q}": ratio(run["overall"][key][q], before["overall"][key][q])
                    for key in ("ttft_ms", "itl_ms") for q in ("p50", "p99")}
        out[mix]["rate_now_vs_then"] = [run["rate_req_s"], before["rate_req_s"]]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="serve --model (default: serve's)")
    parser.add_argument("--duration", default=None,
                        help="each loadtest's --duration (default: each mix's own)")
    parser.add_argument("--probe-duration", default="20s", help="the chat run's capacity probe")
    parser.add_argument("--capacity", default=None,
                        help="an earlier chat run's capacity.json: no probe, every run at that "
                             "rate (variants of one server compared at one rate)")
    parser.add_argument("--drain-timeout", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mixes", default=",".join(MIXES),
                        help="comma-separated, chat first (its capacity sets every rate)")
    parser.add_argument("--flood-mix", default="long-prompt-flood",
                        help="the flood run's --mix (a TOML file for a smoke test: the real "
                             "one's first burst is at 20 s)")
    parser.add_argument("--baseline", default=None,
                        help="an earlier flood_bench JSON to compare every mix with")
    parser.add_argument("--workdir", default=None,
                        help="where the loadtests' reports and plots go (default: a temp dir)")
    parser.add_argument("--out", default=None,
                        help="the JSON (default bench/results/flood_bench-<cpu kind>.json)")
    parser.add_argument("serve_args", nargs="*", help="after --: extra `tokstream serve` flags")
    args = parser.parse_args()
    mixes = args.mixes.split(",")
    if mixes[0] != "chat":
        parser.error("--mixes must start with chat: its capacity file sets every run's rate")
    host = machine()
    out = Path(args.out or ROOT / "bench" / "results" / f"flood_bench-{host['cpu_kind']}.json")
    workdir = Path(args.workdir or f"/tmp/flood_bench-{os.getpid()}")
    workdir.mkdir(parents=True, exist_ok=True)
    serve = ["--port", "0", *(["--model", args.model] if args.model else []), *args.serve_args]
    started = time.time()
    load_at_start = os.getloadavg()
    runs: dict[str, dict] = {}
    with ServeProcess(serve, new_session=True, reap=True, stop_timeout_s=30) as server:
        load_at_ready = os.getloadavg()
        chat_out = workdir / "chat"
        capacity = Path(args.capacity).resolve() if args.capacity else chat_out / "capacity.json"
        if args.capacity:  # the probe would have warmed the server up: a first minute is slow
            loadtest(server.url, "chat", workdir / "warm-up", args,
                     ["--capacity", str(capacity), "--duration", "20s"])
        report = loadtest(server.url, "chat", chat_out, args,
                          ["--capacity", str(capacity)] if args.capacity
                          else ["--probe-duration", args.probe_duration])
        runs["chat"] = summarize(report)
        fraction = report["config"]["settings"]["capacity_fraction"]
        same_rate = ["--capacity", str(capacity), "--capacity-fraction", str(fraction)]
        for mix in mixes[1:]:
            mix_arg = args.flood_mix if mix == "long-prompt-flood" else mix
            try:
                runs[mix] = summarize(loadtest(server.url, mix_arg, workdir / mix, args,
                                               same_rate))
            except RuntimeError as error:  # one mix that cannot run here (a short context)
                runs[mix] = {"error": str(error)[-1500:]}
            print(f"{mix}: {json.dumps(runs[mix].get('overall', runs[mix]))}", file=sys.stderr)
    result = {
        "what": "tokstream loadtest: chat alone, then each mix at the chat run's rate "
                "(its capacity file and fraction), one tokstream serve (issue 29)",
        "command": " ".join([os.path.relpath(sys.executable, ROOT), *sys.argv]),
        "commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "serve": ["tokstream", "serve", *serve],
        "machine": host,
        "load_average": {"at_start": [round(x, 2) for x in load_at_start],
                         "at_server_ready": [round(x, 2) for x in load_at_ready],
                         "at_end": [round(x, 2) for x in os.getloadavg()]},
        "workdir": str(workdir), "wall_s": round(time.time() - started, 1),
        "runs": runs,
    }
    if "classes" in runs.get("long-prompt-flood", {}):
        result["flood_vs_alone"] = compare_flood(runs)
    if args.baseline:
        result["vs_baseline"] = {"file": args.baseline, **compare_baseline(
            runs, json.loads(Path(args.baseline).read_text()))}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result.get("flood_vs_alone", {}), indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
