"""GuideLLM's CLI (`guidellm run`, its benchmark command) against a real `tokstream serve` on
dummy:tiny: a bounded run (4 requests, 2 at a time, 30 s at most) of synthetic prompts on the
streamed chat route, which it sends with `stream_options.continuous_usage_stats`,
`max_completion_tokens` and `ignore_eos`. Every request must complete, none error, and the
server's usage must count the asked 8 output tokens. The server runs at its stock framing
(what `tokstream serve` sends unless asked for the integrity framing)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.clients import OFFLINE_ENV
from helpers.serving import module_server
from tokstream.model.source import resolve_model
from tokstream.text.tokenizer import load_tokenizer

pytestmark = [pytest.mark.startup, pytest.mark.timeout(180)]

server = module_server("--profile", "ci", "--no-stream-integrity")

GUIDELLM = Path(sys.executable).parent / "guidellm"
NUM_REQUESTS, OUTPUT_TOKENS = 4, 8


def test_guidellm_benchmark_run(server, tmp_path):
    tokenizer = tmp_path / "tokenizer"  # the served tokenizer as a Hugging Face folder
    load_tokenizer(resolve_model("dummy:tiny")).save(tokenizer)
    out = tmp_path / "guidellm.json"
    command = [
        str(GUIDELLM), "run", "--backend", f"kind=openai_http,target={server.url},model=dummy:tiny",
        "--profile", "kind=concurrent,streams=2",
        "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
        "--constraint", "kind=max_duration,seconds=30",
        "--data", f"kind=synthetic_text,prompt_tokens=16,output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer}",
        "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    env = {**os.environ, **OFFLINE_ENV, "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    (benchmark,) = json.loads(out.read_text())["benchmarks"]
    made = benchmark["scheduler_metrics"]["requests_made"]
    assert made == {"successful": NUM_REQUESTS, "errored": 0, "incomplete": 0,
                    "total": NUM_REQUESTS}, made
    for request in benchmark["requests"]["successful"]:
        body = json.loads(request["request_args"])["body"]
        assert body["stream"] and body["stream_options"]["continuous_usage_stats"]
        assert request["output_metrics"]["text_tokens"] == OUTPUT_TOKENS  # the server's usage
        # streamed in pieces (a lagging reader gets merged deltas, so not always one a token)
        assert 1 < request["info"]["timings"]["token_iterations"] <= OUTPUT_TOKENS
        assert request["input_metrics"]["text_tokens"] > 16 and request["output"]
