"""Recovery time after a rank is killed mid-decode, with and without a warm spare.

    .venv/bin/python bench/recovery_bench.py --model smollm2 --tp 3 --json bench/results/recovery.json

For each mode: start the engine (--tp N), run S decoding streams, SIGKILL rank K once every
stream has received W tokens, and measure, from the kill, the time until every stream that was
decoding has its next token. Where the time goes: detect (kill -> the core sees the failure),
restart (tear down + spawn and load, or swap in the spare), re-prefill (restart -> next token
on every stream). Streams are checked to continue at the next index with no gap.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run_mode(args, spare: bool) -> dict:
    from tokstream.config import EngineConfig
    from tokstream.engine.llm import LLM
    from tokstream.engine.messages.request import EngineRequest
    from tokstream.sampling_params import SamplingParams

    config = EngineConfig(model=args.model, tp=args.tp, spare=spare)
    started = time.monotonic()
    llm = LLM(config)
    startup_s = time.monotonic() - started
    if spare:  # let the spare finish loading before the fault, as it would in service
        llm.core.executor.spare.wait_ready()
    try:
        params = SamplingParams(max_tokens=args.warmup_tokens + 24, temperature=0.0,
                                ignore_eos=True)
        prompts = [llm.encode(f"Tell me a long story about the number {i}.", chat=True)
                   for i in range(args.streams)]
        requests = [EngineRequest(f"s{i}", p, params) for i, p in enumerate(prompts)]
        counts = {r.request_id: 0 for r in requests}
        next_index = {r.request_id: 0 for r in requests}
        killed_at = None
        resumed_at: dict[str, float] = {}
        for delta in llm.stream(requests):
            now = time.monotonic()
            assert delta.first_index == next_index[delta.request_id], "gap or duplicate"
            next_index[delta.request_id] += len(delta.token_ids)
            counts[delta.request_id] += len(delta.token_ids)
            if killed_at is not None and delta.token_ids:
                resumed_at.setdefault(delta.request_id, now)
            if killed_at is None and min(counts.values()) >= args.warmup_tokens:
                pid = llm.core.executor.pids[args.kill_rank]
                killed_at = time.monotonic()
                os.kill(pid, signal.SIGKILL)
        events = list(llm.core.events)
        failure = next(e for e in events if e["kind"] == "rank_failure")
        restarted = next(e for e in events if e["kind"] == "restarted")
        wall_offset = time.time() - time.monotonic()
        detect_s = failure["time"] - wall_offset - killed_at
        restart_s = restarted["time"] - failure["time"]
        all_resumed = max(resumed_at.values()) - killed_at
        return {
            "spare": spare, "startup_s": startup_s, "streams": args.streams,
            "restarts": llm.core.recovery.restarts,
            "recovery_s": all_resumed,
            "detect_s": detect_s,
            "restart_s": restart_s,
            "reprefill_s": all_resumed - detect_s - restart_s,
            "first_stream_resumed_s": min(resumed_at.values()) - killed_at,
            "tokens_per_stream": counts,
            "events": [{k: v for k, v in e.items() if k != "request_id"} for e in events
                       if e["kind"] in ("rank_failure", "restart_failed", "restarted")],
        }
    finally:
        llm.close()


def recovery_parser(doc: str) -> argparse.ArgumentParser:
    """The flags every recovery benchmark starts with (this one and recovery_timing.py): the
    model and how many ranks it is split over, SmolLM2 on 3 by default (a rank group with a
    middle rank to kill)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tp", type=int, default=3)
    return parser


def main() -> None:
    parser = recovery_parser(__doc__)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--warmup-tokens", type=int, default=8)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--mode", choices=["both", "spare", "no-spare"], default="both")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": args.model, "tp": args.tp,
              "loadavg": os.getloadavg(),
              "target": "every decoding stream has its next token within 5 s of the kill "
                        "(with the spare)"}
    if args.mode in ("both", "spare"):
        report["with_spare"] = run_mode(args, spare=True)
    if args.mode in ("both", "no-spare"):
        report["without_spare"] = run_mode(args, spare=False)
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
