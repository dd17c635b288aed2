#!/usr/bin/env bash
# GPU checks, for a session that is lent a GPU machine (device tool); fits in 8 minutes on an
# H200. Prepared and tried on CPU first (DEVICE=cpu BENCH_MODEL=dummy:tiny BENCH_DTYPE=float32:
# plumbing only, the kernels under Triton's interpreter). Run as one script:
#     bash scripts/gpu_check.sh            # results under $OUT (or bench/results/gpu-DATE/)
# Steps: every Triton kernel against its torch reference on the device; the decode-attention
# kernel's bandwidth against a device-to-device copy (target 70%+ at batch 64 x 4k context);
# greedy tokens on the device (kernels with and without CUDA graphs, torch reference) equal to
# the CPU path's; `tokstream bench` on $BENCH_MODEL at batch 1 and 64 (target: batch-1 decode
# step within 1.5x of the weight-read floor); `tokstream chaos kill-rank 0` on a dummy model.
# One GPU cannot test NCCL tensor parallelism (--tp 2 needs two devices).
# summary.json holds the date, the device, every step's outcome and the targets.
# The GPU machine has torch and Triton preinstalled and no network: only the repo travels.
# Needs (import-checked below): torch, triton, typer, rich, safetensors, tokenizers, numpy.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
BENCH_MODEL=${BENCH_MODEL:-dummy:llama-8b}
BENCH_DTYPE=${BENCH_DTYPE:-bfloat16}
STAMP=$(date -u +%Y%m%d-%H%M)
RESULTS=${OUT:-bench/results/gpu-$STAMP}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
# The repo is not installed there: build the package as pyproject's package-dir lays it out
# (kernels/, chaos/, loadgen/ live at the top level but import as tokstream.kernels etc.) and
# run from it, since `python -m` puts the working directory first on sys.path.
PACKAGE_ROOT=$(mktemp -d)
trap 'rm -rf "$PACKAGE_ROOT"' EXIT
mkdir "$PACKAGE_ROOT/tokstream"
for entry in "$REPO"/tokstream/*; do ln -s "$entry" "$PACKAGE_ROOT/tokstream/"; done
for folder in kernels chaos loadgen; do ln -s "$REPO/$folder" "$PACKAGE_ROOT/tokstream/$folder"; done
export PYTHONPATH="$PACKAGE_ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$PACKAGE_ROOT"
# Step time limits fit the GPU budget; a CPU try-run (the interpreter) gets 4x as long.
SLOWDOWN=$([ "$DEVICE" = cpu ] && echo 4 || echo 1)
STEPS="$RESULTS/steps.txt"
: > "$STEPS"
status=0

# run NAME TIMEOUT_S COMMAND...: runs one step, records "NAME rc seconds" and goes on.
run() {
  local name=$1 limit=$2; shift 2
  echo "== $name"
  local started=$SECONDS
  timeout $((limit * SLOWDOWN)) "$@"
  local rc=$?
  echo "$name $rc $((SECONDS - started))" >> "$STEPS"
  [ "$rc" -eq 0 ] || { echo "   $name: exit $rc"; status=1; }
}

echo "== environment"
$PY - <<'PY' | tee "$RESULTS/env.txt"
import importlib, platform
print("python", platform.python_version())
for name in ("torch", "triton", "typer", "rich", "safetensors", "tokenizers", "numpy", "jinja2"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as exc:
        print(name, "MISSING", exc)
import tokstream.kernels
print("tokstream.kernels", tokstream.kernels.__path__[0])
import torch
print("cuda", torch.cuda.is_available())
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
PY

run kernels 150 $PY -m tokstream.kernels.check --device "$DEVICE" --json "$RESULTS/kernels.json"
run bandwidth 120 $PY "$REPO/bench/kernel_bandwidth.py" --device "$DEVICE" --json "$RESULTS/kernel_bandwidth.json"
run parity 180 $PY "$REPO/scripts/device_parity.py" "$DEVICE" --json "$RESULTS/parity_tiny.json"
$PY -m tokstream plan --model "$BENCH_MODEL" --dtype "$BENCH_DTYPE" --json > "$RESULTS/plan.json"
for batch in 1 64; do
  run "bench_b$batch" 150 $PY -m tokstream bench --model "$BENCH_MODEL" --dtype "$BENCH_DTYPE" \
      --device "$DEVICE" --num-requests "$batch" --concurrency "$batch" --input-len 512 \
      --output-len 128 --json "$RESULTS/bench_b$batch.json"
done
# chaos is built in another issue: call it the documented way, tolerate its absence.
if $PY -m tokstream chaos --help 2>/dev/null | grep -q "kill-rank"; then
  run chaos 150 $PY -m tokstream chaos kill-rank 0 --device "$DEVICE" --tp 1 \
      --model dummy:tiny --json "$RESULTS/chaos.json"
else
  echo "== chaos: 'tokstream chaos kill-rank' is not in this checkout yet (issue 6); skipped"
  echo "chaos skipped 0" >> "$STEPS"
fi

DEVICE="$DEVICE" RESULTS="$RESULTS" $PY - <<'PY'
import datetime, json, os
results = os.environ["RESULTS"]

def load(name):
    try:
        with open(os.path.join(results, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None

steps = {}
for line in open(os.path.join(results, "steps.txt")):
    name, rc, seconds = line.split()
    steps[name] = {"exit": rc, "seconds": int(seconds)}
env = dict(line.split(" ", 1) for line in open(os.path.join(results, "env.txt")).read().splitlines())
bandwidth, plan, bench1 = load("kernel_bandwidth.json"), load("plan.json"), load("bench_b1.json")
targets = {}
if bandwidth:
    targets["decode_attention_share_of_copy_b64_4k"] = bandwidth["target"]
if bandwidth and plan and bench1:
    # The floor: every weight byte read once per step at the measured copy bandwidth.
    floor_ms = plan["weights_bytes"] / (bandwidth["copy"]["gb_per_s"] * 1e9) * 1e3
    step_ms = bench1["decode_step_ms_at_max_batch"]["p50"]
    targets["batch1_decode_step_vs_weight_floor"] = {
        "step_ms_p50": step_ms, "floor_ms": floor_ms, "ratio": step_ms / floor_ms,
        "wanted": 1.5, "met": step_ms / floor_ms <= 1.5}
kernels = load("kernels.json")
summary = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "device": env.get("device", "?") if os.environ["DEVICE"] != "cpu" else "cpu (plumbing try-run)",
    "environment": env, "steps": steps, "targets": targets,
    "kernels_ok": kernels and all(r["ok"] for r in kernels["results"]),
    "parity": load("parity_tiny.json"),
    "bench": {b: load(f"bench_b{b}.json") for b in (1, 64)},
    "chaos": load("chaos.json"),
    "not_tested": "NCCL tensor parallelism (one GPU)",
}
with open(os.path.join(results, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
print(json.dumps({"steps": steps, "targets": targets}, indent=2))
PY

echo "results in $RESULTS (exit $status)"
exit $status
