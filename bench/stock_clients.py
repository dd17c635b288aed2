"""Stock clients against `tokstream serve` at its defaults (no integrity framing asked):
the unmodified `vllm bench serve` (no stream-parser patch) and GuideLLM, each a short bounded
run on 127.0.0.1; records how many requests each completed and failed.

    bash scripts/setup_vllm_peer.sh                      # vLLM's venv (its bench client)
    python3 -m venv /work/peers/guidellm-venv && /work/peers/guidellm-venv/bin/pip install guidellm
    .venv/bin/python bench/stock_clients.py              # -> bench/results/stock_clients.json

A client that is not installed is recorded as such (never as a pass).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokstream.serve_process import ServeProcess  # noqa: E402

PEERS = Path(os.environ.get("VLLM_PEER_DIR", "/work/peers"))
VLLM = PEERS / "vllm-venv" / "bin" / "vllm-peer"
GUIDELLM = PEERS / "guidellm-venv" / "bin" / "guidellm"
TOKENIZER = PEERS / "smollm2-hf"  # written by bench/compare_vllm.py (a Hugging Face folder)
MODEL = "smollm2"


def run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return done.returncode, (done.stdout + done.stderr)[-3000:]


def vllm_bench(url: str, work: Path) -> dict:
    if not VLLM.exists():
        return {"status": f"not installed ({VLLM})"}
    cmd = [str(VLLM), "bench", "serve", "--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", MODEL, "--tokenizer", str(TOKENIZER),
           "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "16",
           "--num-prompts", "8", "--max-concurrency", "4", "--request-rate", "inf",
           "--disable-tqdm", "--save-result", "--result-dir", str(work),
           "--result-filename", "vllm.json"]
    rc, tail = run(cmd, 600, dict(os.environ, OMP_NUM_THREADS="1"))
    result = json.loads((work / "vllm.json").read_text()) if (work / "vllm.json").exists() else {}
    return {"command": " ".join(cmd), "exit_status": rc, "completed": result.get("completed"),
            "failed": result.get("failed"), "output_tokens": result.get("total_output_tokens"),
            "log_tail": tail if rc else None}


def guidellm(url: str, work: Path) -> dict:
    if not GUIDELLM.exists():
        return {"status": f"not installed ({GUIDELLM})"}
    out = work / "guidellm.json"
    cmd = [str(GUIDELLM), "run", "--backend", f"kind=openai_http,target={url},model={MODEL}",
           "--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=8",
           "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16",
           "--tokenizer", f"kind=hf_auto,model={TOKENIZER}",
           "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    rc, tail = run(cmd, 600)
    made = {}
    if out.exists():
        made = json.loads(out.read_text())["benchmarks"][0]["scheduler_metrics"]["requests_made"]
    return {"command": " ".join(cmd), "exit_status": rc, "requests": made,
            "log_tail": tail if rc or not made else None}


def main() -> None:
    with ServeProcess(command=[str(ROOT / ".venv" / "bin" / "tokstream"), "serve", "--host",
                               "127.0.0.1", "--port", "0", "--served-model-name", MODEL],
                      new_session=True, reap=True, stop_timeout_s=60) as server:
        url = server.url
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            result = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                      "server": "tokstream serve at its defaults (no --stream-integrity)",
                      "vllm_bench_serve_unmodified": vllm_bench(url, work),
                      "guidellm": guidellm(url, work)}
    path = ROOT / "bench" / "results" / "stock_clients.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    sys.exit(0)


if __name__ == "__main__":
    main()
