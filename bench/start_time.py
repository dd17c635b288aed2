"""`tokstream serve` start time, two checkouts side by side: seconds from the command to its
ready line, the two alternating so that drift in the machine's speed falls on both.

    git worktree add /tmp/before <rev>
    python bench/start_time.py --before /tmp/before --runs 20 --profile ci

Writes bench/results/start_time-<cpu kind>.json (under --label), with the CPU, its flags and
the load average before each run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from compare_machine import host_info, loadavg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tokstream.kernels import cpu_build  # noqa: E402


def time_to_ready(tree: Path, serve_args: list[str]) -> float:
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "tokstream", "serve", *serve_args,
                                "--port", "0"], cwd=tree, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stderr:
            if "ready on" in line:
                return time.monotonic() - started
        raise RuntimeError(f"{tree}: the server exited before its ready line")
    finally:
        process.terminate()
        process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="The older checkout.")
    parser.add_argument("--after", type=Path, default=ROOT, help="The newer (this one).")
    parser.add_argument("--runs", type=int, default=20, help="Starts of each.")
    parser.add_argument("--profile", default="ci", help="serve --profile.")
    parser.add_argument("--pause", type=float, default=1.5, help="Seconds between starts.")
    parser.add_argument("--label", default="latest")
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    seconds: dict[str, list[float]] = {"before": [], "after": []}
    loads = []
    for i in range(args.runs):
        order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
        for name in order:
            loads.append(loadavg())
            seconds[name].append(round(time_to_ready(trees[name], ["--profile", args.profile]),
                                       3))
            time.sleep(args.pause)
    result = {
        "machine": {**host_info(), "cpu_kind": cpu_build.cpu_kind()},
        "command": " ".join(sys.argv), "profile": args.profile, "runs": args.runs,
        "trees": {name: {"path": str(tree), "commit": subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True).stdout.strip()}
            for name, tree in trees.items()},
        "seconds_to_ready": seconds,
        "median_s": {name: round(statistics.median(v), 3) for name, v in seconds.items()},
        "loadavg_before_each_run": loads,
    }
    result["after_over_before"] = round(result["median_s"]["after"]
                                        / result["median_s"]["before"], 3)
    out = ROOT / "bench" / "results" / f"start_time-{cpu_build.cpu_kind()}.json"
    saved = json.loads(out.read_text()) if out.exists() else {}
    saved[args.label] = result
    out.write_text(json.dumps(saved, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("median_s", "after_over_before")}))


if __name__ == "__main__":
    main()
