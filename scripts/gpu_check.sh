#!/usr/bin/env bash
# GPU checks, for a session that is lent a GPU machine (device tool). Prepared and tried on CPU
# first; run as one script within the device-time budget:
#     bash scripts/gpu_check.sh            # results under $OUT (or bench/results/gpu-DATE/)
# The GPU machine has torch and Triton preinstalled and no network: only the repo travels.
# Needs (import-checked below): torch, typer, rich, safetensors, tokenizers, numpy.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
STAMP=$(date -u +%Y%m%d-%H%M)
RESULTS=${OUT:-bench/results/gpu-$STAMP}
mkdir -p "$RESULTS"
status=0

step() { echo "== $*"; }

step "environment"
$PY - <<'PY' | tee "$RESULTS/env.txt"
import importlib, platform
print("python", platform.python_version())
for name in ("torch", "triton", "typer", "rich", "safetensors", "tokenizers", "numpy", "jinja2"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as exc:
        print(name, "MISSING", exc)
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PY

step "CUDA path against the CPU reference on dummy:tiny (greedy tokens, float32)"
timeout 300 $PY - "$DEVICE" <<'PY' | tee "$RESULTS/parity_tiny.txt" || status=1
import sys
from tokstream.config import EngineConfig
from tokstream.engine.llm import LLM
from tokstream.sampling_params import SamplingParams

device = sys.argv[1]
prompts = [[5, 17, 99, 3], list(range(10, 60)), [7] * 33]
params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
results = {}
for dev in ("cpu", device):
    with LLM(EngineConfig(model="dummy:tiny", dtype="float32", device=dev)) as llm:
        results[dev] = [c.token_ids for c in llm.generate(prompts, params)]
same = results["cpu"] == results[device]
print("cpu == %s: %s" % (device, same))
sys.exit(0 if same else 1)
PY

for batch in 1 64; do
  step "bench dummy:llama-8b bfloat16 batch $batch on $DEVICE"
  timeout 400 $PY -m tokstream bench --model dummy:llama-8b --dtype bfloat16 --device "$DEVICE" \
      --num-requests "$batch" --concurrency "$batch" --input-len 512 --output-len 128 \
      --json "$RESULTS/bench_llama8b_bf16_b$batch.json" || status=1
done

echo "results in $RESULTS (exit $status)"
exit $status
