#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` from source as the third contender of
# bench/compare_vllm.py, OUTSIDE the repo. Idempotent: a binary already built is reused (only
# a changed version or a missing binary rebuilds), the sdist is downloaded once.
#
#     bash scripts/setup_llamacpp_peer.sh
#
# Environment (defaults):
#     LLAMACPP_PEER_DIR=${VLLM_PEER_DIR:-/work/peers}   downloads and the source tree's parent
#     LLAMACPP_SRC=$LLAMACPP_PEER_DIR/llama.cpp          llama.cpp's source (the sdist's vendor/llama.cpp)
#     LLAMACPP_BUILD=$LLAMACPP_SRC/build                 cmake build folder
#     LLAMA_CPP_PYTHON_VERSION=0.3.36                    the llama-cpp-python sdist carrying it
#     LLAMACPP_JOBS=$(nproc)                             ninja -j
#     PYTHON=python3                                     runs `pip download`
# The binary ends at $LLAMACPP_BUILD/bin/llama-server; bench/compare_vllm.py looks there, or at
# $LLAMA_SERVER if set.
#
# The recipe (shared/REFERENCE.md, "Intel Xeon without native bf16"): Debian has no package
# and the machine reaches only package registries, but the llama-cpp-python sdist on PyPI
# carries llama.cpp's source in vendor/llama.cpp:
#   1. pip download --no-deps --no-binary :all: llama-cpp-python==VERSION
#   2. unpack its vendor/llama.cpp
#   3. cmake -G Ninja -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON
#      -DCMAKE_BUILD_TYPE=Release, then ninja only the llama-server target
#      (about 6 minutes on 2 cores). GGML_NATIVE=ON: built for THIS CPU (-march=native), so
#      rebuild on another machine (the stamp file records the CPU flags it was built for).
set -euo pipefail

PEER_DIR=${LLAMACPP_PEER_DIR:-${VLLM_PEER_DIR:-/work/peers}}
SRC=${LLAMACPP_SRC:-$PEER_DIR/llama.cpp}
BUILD=${LLAMACPP_BUILD:-$SRC/build}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${LLAMACPP_JOBS:-$(nproc)}
PYTHON=${PYTHON:-python3}
DOWNLOADS="$PEER_DIR/downloads"
BIN="$BUILD/bin/llama-server"
STAMP="$BUILD/.tokstream-peer-stamp"

REPO=$(cd "$(dirname "$0")/.." && pwd)
for d in "$SRC" "$BUILD"; do
    case "$(realpath -m "$d")/" in
        "$REPO"/*) echo "refusing: $d is inside the repo ($REPO)" >&2; exit 2 ;;
    esac
done

log() { echo "== $*"; }
mkdir -p "$DOWNLOADS"

# What the binary is built from and for: the sdist version and this CPU's kernel flags
# (GGML_NATIVE=ON compiles for the build machine's instruction set).
cpu_flags=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' \
    | grep -E '^(avx|avx2|fma|f16c|avx512.*|amx.*)$' | sort | tr '\n' ' ' || true)
want_stamp="llama-cpp-python==$VERSION native:$cpu_flags"

if [ -x "$BIN" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want_stamp" ]; then
    log "already built: $BIN ($want_stamp)"
    "$BIN" --version 2>&1 | head -3 || true
    log "ready: $BIN"
    exit 0
fi

# -- build tools ---------------------------------------------------------------------------
missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v c++ >/dev/null || missing+=(g++)
if [ ${#missing[@]} -gt 0 ]; then
    log "apt-get install ${missing[*]}"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

# -- the sdist -----------------------------------------------------------------------------
sdist="$DOWNLOADS/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$sdist" ]; then
    log "downloading llama-cpp-python==$VERSION (sdist)"
    "$PYTHON" -m pip --disable-pip-version-check download -q --no-deps \
        --no-binary :all: -d "$DOWNLOADS" "llama-cpp-python==$VERSION"
fi
[ -f "$sdist" ] || { echo "$sdist missing after pip download" >&2; exit 1; }

# -- its vendor/llama.cpp ------------------------------------------------------------------
src_stamp="$SRC/.tokstream-peer-source"
if [ ! -f "$SRC/CMakeLists.txt" ] || [ "$(cat "$src_stamp" 2>/dev/null)" != "$VERSION" ]; then
    log "unpacking vendor/llama.cpp of $(basename "$sdist") into $SRC"
    tmp=$(mktemp -d "$PEER_DIR/unpack.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    tar -xzf "$sdist" -C "$tmp" "llama_cpp_python-$VERSION/vendor/llama.cpp"
    rm -rf "$SRC"
    mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC"
    echo "$VERSION" > "$src_stamp"
fi

# -- configure and build llama-server only -------------------------------------------------
log "cmake configure ($BUILD)"
cmake -S "$SRC" -B "$BUILD" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF \
    -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    > "$PEER_DIR/llamacpp-cmake.log" 2>&1 \
    || { tail -40 "$PEER_DIR/llamacpp-cmake.log" >&2; exit 1; }
log "ninja -j$JOBS llama-server (about 6 minutes on 2 cores; log $PEER_DIR/llamacpp-build.log)"
start=$(date +%s)
ninja -C "$BUILD" -j"$JOBS" llama-server > "$PEER_DIR/llamacpp-build.log" 2>&1 \
    || { tail -40 "$PEER_DIR/llamacpp-build.log" >&2; exit 1; }
log "built in $(( $(date +%s) - start )) s"
[ -x "$BIN" ] || { echo "$BIN not produced" >&2; exit 1; }
echo "$want_stamp" > "$STAMP"

log "check"
"$BIN" --version 2>&1 | head -3 || true
log "ready: $BIN"
