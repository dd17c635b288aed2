"""lm-eval against one server at three settings, side by side: a multiple-choice task through
`local-completions`, one prompt a request (batch_size 1, the default), several prompts a
request (batch_size N), and N requests in flight (num_concurrent N). What a batch of prompts
in one request buys shows as wall-time ratios to batch_size 1; every setting must give the same
accuracy and (within float rounding) the same log-likelihoods, which the JSON records.

    python bench/lm_eval_batch.py --rounds 2 --questions 40 --batch 8

Starts its own server (--model, default smollm2) with prefix caching off, so that every run
computes the same prompts from scratch; lm-eval tokenises through the server's own tokenizer
routes (no tokenizer argument). Runs alternate their order round by round. Writes
bench/results/lm_eval_batch-<cpu kind>.json (under --label) with the CPU, its flags and the
load average before each run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from compare_machine import host_info, loadavg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tokstream.kernels import cpu_build  # noqa: E402
from tokstream.serve_process import ServeProcess  # noqa: E402

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


def questions(count: int, seed: int = 0) -> list[dict]:
    """Arithmetic multiple-choice items (four choices, the right one at a random place)."""
    rng = random.Random(seed)
    items = []
    for _ in range(count):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        wrong = rng.sample([a + b + d for d in (-11, -3, -1, 1, 2, 10) if a + b + d > 0], 3)
        choices = [str(c) for c in wrong]
        answer = rng.randrange(4)
        choices.insert(answer, str(a + b))
        items.append({"question": f"What is {a} + {b}?", "choices": choices, "answer": answer})
    return items


def write_task(folder: Path, items: list[dict]) -> None:
    data = folder / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items))
    (folder / "bench_mc.yaml").write_text(
        "task: bench_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n")


def run(url: str, folder: Path, served_name: str, batch: int, concurrent: int) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    started = time.perf_counter()
    results = simple_evaluate(
        model="local-completions",
        model_args=(f"model={served_name},base_url={url}/v1/completions,batch_size={batch},"
                    f"num_concurrent={concurrent},max_retries=1"),
        tasks=["bench_mc"], task_manager=TaskManager(include_path=str(folder),
                                                     include_defaults=False),
        log_samples=True)
    wall = time.perf_counter() - started
    samples = sorted(results["samples"]["bench_mc"], key=lambda s: s["doc_id"])
    loglikelihoods = [resp[0][0] for sample in samples for resp in sample["resps"]]
    return {"wall_s": round(wall, 3), "requests": len(loglikelihoods),
            "acc": results["results"]["bench_mc"]["acc,none"],
            "loglikelihoods": loglikelihoods}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="serve --model.")
    parser.add_argument("--served-name", default="smollm2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--questions", type=int, default=40, help="Four choices each.")
    parser.add_argument("--batch", type=int, default=8, help="N: prompts a request, and "
                                                             "requests in flight.")
    parser.add_argument("--label", default="latest")
    args = parser.parse_args()
    os.environ.update(OFFLINE)
    settings = {"batch_size_1": (1, 1), f"batch_size_{args.batch}": (args.batch, 1),
                f"num_concurrent_{args.batch}": (1, args.batch)}
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(ServeProcess([
            "--model", args.model, "--served-model-name", args.served_name,
            "--no-prefix-caching", "--port", "0"])).url
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        os.environ["HF_HOME"] = str(folder / "hf")  # the json task's dataset cache
        write_task(folder, questions(args.questions))
        run(url, folder, args.served_name, args.batch, 1)  # warm-up, not counted
        for i in range(args.rounds):
            order = list(settings) if i % 2 == 0 else list(settings)[::-1]
            for name in order:
                load = loadavg()
                result = run(url, folder, args.served_name, *settings[name])
                runs[name].append({**result, "loadavg_before": load})
                print(name, result["wall_s"], result["acc"], file=sys.stderr)
    baseline = runs["batch_size_1"][0]["loglikelihoods"]
    summary = {}
    for name, results in runs.items():
        wall = statistics.median(r["wall_s"] for r in results)
        summary[name] = {
            "wall_s_median": wall, "requests_per_s": round(results[0]["requests"] / wall, 2),
            "acc": sorted({r["acc"] for r in results}),
            "max_abs_loglikelihood_diff_to_batch_1": max(
                abs(a - b) for r in results for a, b in zip(r["loglikelihoods"], baseline))}
    base = summary["batch_size_1"]["wall_s_median"]
    for name in summary:
        summary[name]["speedup_over_batch_1"] = round(base / summary[name]["wall_s_median"], 2)
    for results in runs.values():
        for r in results:
            del r["loglikelihoods"]
    result = {
        "machine": {**host_info(), "cpu_kind": cpu_build.cpu_kind()},
        "command": " ".join(sys.argv), "commit": subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "task": {"questions": args.questions, "choices": 4, "model": args.model},
        "runs": runs, "summary": summary,
    }
    out = ROOT / "bench" / "results" / f"lm_eval_batch-{cpu_build.cpu_kind()}.json"
    saved = json.loads(out.read_text()) if out.exists() else {}
    saved[args.label] = result
    out.write_text(json.dumps(saved, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
