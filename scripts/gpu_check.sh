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
BENCH_MODEL=${BENCH_MODEL:-dummy:llama-8b}  # a CPU try-run: DEVICE=cpu BENCH_MODEL=dummy:tiny
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
timeout 300 $PY scripts/device_parity.py "$DEVICE" | tee "$RESULTS/parity_tiny.txt" || status=1

for batch in 1 64; do
  step "bench $BENCH_MODEL bfloat16 batch $batch on $DEVICE"
  timeout 400 $PY -m tokstream bench --model "$BENCH_MODEL" --dtype bfloat16 --device "$DEVICE" \
      --num-requests "$batch" --concurrency "$batch" --input-len 512 --output-len 128 \
      --json "$RESULTS/bench_${BENCH_MODEL#dummy:}_bf16_b$batch.json" || status=1
done

echo "results in $RESULTS (exit $status)"
exit $status
