"""Side by side in one run: vLLM's CPU build and tokstream, each serving the same model, driven
by the same client (`vllm bench serve`) with the same workload. Writes one JSON with ratios.

    bash scripts/setup_vllm_peer.sh                 # once: vLLM's venv outside the repo
    .venv/bin/python bench/compare_vllm.py          # -> bench/results/compare_vllm.json

The model is tokstream's own dequantised SmolLM2 written as a Hugging Face folder (float32
safetensors + tokenizer, built here when missing); both servers load that folder in bfloat16.
Workload: random prompts, 128 input / 128 output tokens, ignore_eos, 32 prompts at max
concurrency 32, then a single-stream run; a short warm-up (other prompts) before each.

The servers run one after the other, never both at once: on 2 cores two sets of torch threads
spinning against each other make every number meaningless. Each server is started in its own
process group on 127.0.0.1 and a free port, and the whole group is stopped at the end, on
failure too. If `tokstream serve` is missing or does not come up, tokstream's offline
`tokstream bench` is run instead and the JSON says the comparison is offline-vs-online.
"""

from __future__ import annotations

import argparse
import json
import os
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
PEER_DIR = os.environ.get("VLLM_PEER_DIR", "/work/peers")
DEFAULT_VENV = os.environ.get("VLLM_PEER_VENV", os.path.join(PEER_DIR, "vllm-venv"))
MODEL_NAME = "smollm2"

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


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-venv", default=DEFAULT_VENV,
                   help="venv built by scripts/setup_vllm_peer.sh (holds bin/vllm-peer)")
    p.add_argument("--hf-folder", default=os.path.join(PEER_DIR, "smollm2-hf"),
                   help="Hugging Face folder both servers load (built from tokstream's "
                        "dequantised SmolLM2 when missing)")
    p.add_argument("--tokstream", default=os.path.join(ROOT, ".venv", "bin", "tokstream"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--single-prompts", type=int, default=8,
                   help="prompts in the 1-stream run (0 skips it)")
    p.add_argument("--kv-cache-gib", type=int, default=4,
                   help="KV pool of both servers (VLLM_CPU_KVCACHE_SPACE, --kv-cache-memory)")
    p.add_argument("--omp-threads-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument("--no-enforce-eager", action="store_true",
                   help="let vLLM compile (start-up 77-109 s here instead of ~30 s)")
    p.add_argument("--startup-timeout", type=float, default=420.0)
    p.add_argument("--bench-timeout", type=float, default=900.0)
    p.add_argument("--only", choices=("vllm", "tokstream"), default=None)
    p.add_argument("--no-client-shim", action="store_true",
                   help="run the stock vllm bench serve (its stream parser fails on SSE "
                        "events that carry id: lines, as tokstream's do)")
    p.add_argument("--offline", action="store_true",
                   help="force tokstream's offline bench instead of tokstream serve")
    p.add_argument("--note", default=None, help="free text kept in the JSON (e.g. machine load)")
    p.add_argument("--work-dir", default=None,
                   help="logs and raw results (default: a fresh temp folder)")
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "compare_vllm.json"))
    return p.parse_args()


# -- processes -------------------------------------------------------------------------------

class Server:
    """A server in its own process group (start_new_session), stopped group-wide."""

    def __init__(self, name: str, cmd: list[str], env: dict, log_path: str, port: int):
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        self.started = time.perf_counter()
        self.log_file = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log_file,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, cwd=ROOT)
        log(f"{name}: started pid {self.proc.pid} on 127.0.0.1:{port} (log {log_path})")

    def wait_healthy(self, timeout: float) -> float:
        """Seconds from start until /health answered 200; raises on exit or timeout."""
        deadline = self.started + timeout
        url = f"http://127.0.0.1:{self.port}/health"
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} during "
                                   f"start-up; last log lines:\n{tail(self.log_path)}")
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        return time.perf_counter() - self.started
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not healthy after {timeout:.0f} s; last log lines:\n"
                           f"{tail(self.log_path)}")

    def stop(self) -> dict:
        """SIGTERM to the group, SIGKILL after 30 s; reports what it took."""
        info = {"exit_status": self.proc.poll(), "stopped_by": None}
        if info["exit_status"] is None:
            info["stopped_by"] = "SIGTERM"
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                info["stopped_by"] = "SIGKILL"
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            info["exit_status"] = self.proc.returncode
        # Children (vLLM's engine core, tokstream's workers) share the group: sweep it.
        for _ in range(20):
            if not _group_alive(self.proc.pid):
                break
            _signal_group(self.proc.pid, signal.SIGKILL)
            time.sleep(0.5)
        info["group_left_running"] = _group_alive(self.proc.pid)
        self.log_file.close()
        log(f"{self.name}: stopped ({info})")
        return info


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


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


# -- the model -------------------------------------------------------------------------------

BUILD_HF = """
import sys, torch
from tokstream.model.source import resolve_model
from tokstream.model.weights import load_state_dict, save_hf_folder
from tokstream.tokenizer import load_tokenizer
source = resolve_model("smollm2")
tokenizer = load_tokenizer(source)
folder = save_hf_folder(sys.argv[1], source.config, load_state_dict(source, torch.float32))
tokenizer.save(folder)
print(folder)
"""


def ensure_hf_folder(folder: str, work: str) -> dict:
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    built = False
    if not all(os.path.isfile(os.path.join(folder, n)) for n in needed):
        if os.path.abspath(folder).startswith(ROOT + os.sep):
            raise SystemExit(f"--hf-folder {folder} is inside the repo; put it outside")
        log(f"building the Hugging Face folder {folder} from tokstream's dequantised SmolLM2")
        python = os.path.join(ROOT, ".venv", "bin", "python")
        rc = run_bounded([python if os.path.exists(python) else sys.executable, "-c", BUILD_HF,
                          folder], os.path.join(work, "build_hf.log"), 600)
        if rc != 0:
            raise SystemExit(f"building {folder} failed:\n{tail(os.path.join(work, 'build_hf.log'))}")
        built = True
    return {"path": folder, "built_this_run": built,
            "source": "tokstream resolve_model('smollm2') (GGUF Q4_1, dequantised), float32 "
                      "safetensors via save_hf_folder + Tokenizer.save"}


# -- the client ------------------------------------------------------------------------------

# vllm bench serve's stream reader strips each network read (`chunk_bytes.strip()`), so the
# blank line that ends an SSE event is lost, then hands it to StreamedResponseHandler, which
# splits on blank lines and otherwise emits a buffer only when it is `data: ` + valid JSON. An
# event that carries any other line the SSE spec allows, as tokstream's do (`id: 7` before the
# data line, `: ping` keep-alive comments), is never emitted on its own: it is glued to the
# next read, json.loads fails ("Extra data") and the request is marked failed. This launcher
# drops SSE comment lines and id:/event:/retry: lines from each read before that parser sees
# it, and changes nothing else (no timing, no other parsing). It is used for BOTH servers, so
# both face the same client; on vLLM's streams (data lines only) it is a no-op.
# --no-client-shim runs the stock CLI instead.
CLIENT_SHIM = """import re, sys, vllm_peer_version_shim
from vllm.benchmarks.lib import endpoint_request_func as erf
_SKIP = re.compile(rb"^(?::(?: .*)?|(?:id|event|retry):.*)$")
_add_chunk = erf.StreamedResponseHandler.add_chunk
def add_chunk(self, chunk_bytes):
    kept = [l for l in chunk_bytes.split(b"\\n") if not _SKIP.match(l.rstrip(b"\\r"))]
    return _add_chunk(self, b"\\n".join(kept).strip())
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


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks, as numpy.percentile (what the client uses)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# -- contenders ------------------------------------------------------------------------------

def run_vllm(args, vllm_peer: str, work: str, commands: dict) -> dict:
    port = free_port()
    env_extra = {"VLLM_CPU_OMP_THREADS_BIND": args.omp_threads_bind,
                 "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
    cmd = [vllm_peer, "serve", args.hf_folder, "--dtype", args.dtype, "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", MODEL_NAME]
    if not args.no_enforce_eager:
        cmd.append("--enforce-eager")
    commands["vllm_server"] = cmdline(cmd, env_extra)
    out: dict = {"mode": "online", "loadavg_before": loadavg(), "env": env_extra,
                 "enforce_eager": not args.no_enforce_eager}
    server = None
    try:
        server = Server("vllm", cmd, dict(os.environ, **env_extra),
                        os.path.join(work, "vllm_server.log"), port)
        out["startup_s"] = server.wait_healthy(args.startup_timeout)
        log(f"vllm: healthy after {out['startup_s']:.1f} s")
        out["stream_probe"] = probe_stream(port)
        out.update(run_workload(args, "vllm", vllm_peer, port, work, commands))
    except Exception as exc:  # reported in the JSON; the server is stopped below
        out["error"] = str(exc)
        log(f"vllm: {exc}")
    finally:
        if server is not None:
            out["stop"] = server.stop()
    return out


def tokstream_serve_available(args) -> tuple[bool, str]:
    if not os.path.exists(args.tokstream):
        return False, f"{args.tokstream} not found"
    r = subprocess.run([args.tokstream, "serve", "--help"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    if r.returncode != 0:
        return False, f"`tokstream serve --help` exited {r.returncode}: {(r.stderr or r.stdout)[-400:]}"
    return True, ""


def run_tokstream_online(args, vllm_peer: str, work: str, commands: dict) -> dict:
    port = free_port()
    cmd = [args.tokstream, "serve", "--model", args.hf_folder, "--dtype", args.dtype,
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
           "--kv-cache-memory", f"{args.kv_cache_gib}GiB"]
    commands["tokstream_server"] = cmdline(cmd)
    out: dict = {"mode": "online", "loadavg_before": loadavg()}
    server = None
    try:
        server = Server("tokstream", cmd, dict(os.environ),
                        os.path.join(work, "tokstream_server.log"), port)
        out["startup_s"] = server.wait_healthy(args.startup_timeout)
        log(f"tokstream: healthy after {out['startup_s']:.1f} s")
        out["ignore_eos_probe"] = probe_ignore_eos(port)
        out["stream_probe"] = probe_stream(port)
        out.update(run_workload(args, "tokstream", vllm_peer, port, work, commands))
    except Exception as exc:
        out["error"] = str(exc)
        log(f"tokstream: {exc}")
    finally:
        if server is not None:
            out["stop"] = server.stop()
    return out


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
                data = json.loads(line[6:])
                if data.get("choices"):
                    chunks.append(data["choices"][0])
                elif data.get("usage"):
                    usage = data["usage"]
    return {"status": status, "sse_fields": fields, "events": len(events),
            "choice_chunks": len(chunks),
            "empty_text_chunks": sum(1 for c in chunks if not c.get("text")),
            "completion_tokens": (usage or {}).get("completion_tokens"),
            "ignore_eos_honoured": (usage or {}).get("completion_tokens") == 4,
            "stock_vllm_bench_parser_ok": fields == ["data"] and ": ping" not in text}


def probe_ignore_eos(port: int) -> dict:
    """One small request with ignore_eos, as vllm bench serve sends it: accepted or not."""
    body = json.dumps({"model": MODEL_NAME, "prompt": "The capital of France is",
                       "max_tokens": 4, "ignore_eos": True, "temperature": 0,
                       "repetition_penalty": 1.0, "logprobs": None}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            data = json.loads(r.read())
            return {"status": r.status, "accepted": True,
                    "completion_tokens": (data.get("usage") or {}).get("completion_tokens")}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "accepted": False,
                "body": e.read().decode("utf-8", "replace")[:500]}
    except (urllib.error.URLError, OSError) as e:
        return {"accepted": False, "error": str(e)}


def run_tokstream_offline(args, work: str, commands: dict, reason: str) -> dict:
    out: dict = {"mode": "offline", "why_offline": reason, "loadavg_before": loadavg()}
    runs = [("concurrent", args.num_prompts, args.concurrency)]
    if args.single_prompts > 0:
        runs.append(("single_stream", args.single_prompts, 1))
    for label, n, conc in runs:
        path = os.path.join(work, f"tokstream_offline_{label}.json")
        cmd = [args.tokstream, "bench", "--model", args.hf_folder, "--dtype", args.dtype,
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
            "duration": raw["elapsed_s"], "completed": raw["num_requests"],
            "total_output_tokens": raw["output_tokens"],
            "output_throughput": raw["output_tokens_per_s"],
            "total_token_throughput": raw["total_tokens_per_s"],
            "median_ttft_ms": ms(raw["ttft_s"], "p50"), "p99_ttft_ms": ms(raw["ttft_s"], "p99"),
            "median_itl_ms": ms(raw["itl_s"], "p50"), "p99_itl_ms": ms(raw["itl_s"], "p99"),
            "client_exit_status": rc, "raw_result_file": path,
            "note": "engine alone in-process: no HTTP, no tokenisation of text prompts; "
                    "TTFT/ITL measured inside the engine, not by a client",
        }
    return out


# -- the report ------------------------------------------------------------------------------

RATIO_KEYS = ("output_throughput", "total_token_throughput", "median_ttft_ms", "p99_ttft_ms",
              "median_itl_ms", "p99_itl_ms", "median_itl_ms_token_gaps", "p99_itl_ms_token_gaps",
              "median_tpot_ms", "median_e2el_ms")


def ratios(tok: dict, vllm: dict) -> dict:
    out = {}
    for run in ("concurrent", "single_stream"):
        a, b = tok.get(run) or {}, vllm.get(run) or {}
        r = {}
        for k in RATIO_KEYS:
            if a.get(k) is not None and b.get(k):
                r[k] = a[k] / b[k]
        if r:
            out[run] = r
    return out


def versions(vllm_venv: str) -> dict:
    out = {}
    py = os.path.join(vllm_venv, "bin", "python")
    r = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'),"
                        " m.version('torch'))"], capture_output=True, text=True, timeout=60)
    if r.returncode == 0:
        out["vllm_cpu"], out["vllm_venv_torch"] = r.stdout.split()
    r = subprocess.run([os.path.join(ROOT, ".venv", "bin", "python"), "-c",
                        "import importlib.metadata as m; print(m.version('torch'))"],
                       capture_output=True, text=True, timeout=60)
    if r.returncode == 0:
        out["tokstream_venv_torch"] = r.stdout.strip()
    r = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
    out["tokstream_commit"] = r.stdout.strip()
    r = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "tokstream"],
                       capture_output=True, text=True)
    out["tokstream_tree_dirty"] = bool(r.stdout.strip())
    return out


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def main() -> int:
    args = parse_args()
    args.hf_folder = os.path.abspath(args.hf_folder)
    vllm_peer = os.path.join(args.vllm_venv, "bin", "vllm-peer")
    if args.only != "tokstream" or not args.offline:
        if not os.access(vllm_peer, os.X_OK):
            raise SystemExit(f"{vllm_peer} missing: run scripts/setup_vllm_peer.sh first")
    work = args.work_dir or tempfile.mkdtemp(prefix="compare_vllm-")
    os.makedirs(work, exist_ok=True)
    log(f"logs and raw results in {work}")

    # A SIGTERM/SIGINT to this script still runs every finally (servers stopped).
    def _terminate(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, _terminate)

    started = time.time()
    report: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": {"cores": os.cpu_count(), "cpu": cpu_model(), "loadavg_at_start": loadavg()},
        "workload": {"client": "vllm bench serve --backend openai (/v1/completions, streamed)",
                     "dataset": "random", "input_len": args.input_len,
                     "output_len": args.output_len, "ignore_eos": True,
                     "concurrent": {"num_prompts": args.num_prompts,
                                    "max_concurrency": args.concurrency, "seed": 0},
                     "single_stream": {"num_prompts": args.single_prompts,
                                       "max_concurrency": 1, "seed": 1},
                     "warmup": "4 prompts x 16 tokens at concurrency 4, seed 1000, not measured",
                     "client_shim": None if args.no_client_shim else (
                         "vllm bench serve run through CLIENT_SHIM (bench/compare_vllm.py): "
                         "SSE comment and id:/event:/retry: lines dropped before its stream parser, "
                         "for both servers; nothing else changed"),
                     "dtype": args.dtype, "kv_cache_gib": args.kv_cache_gib,
                     "order": "vLLM first, then tokstream; never both at once"},
        "note": args.note,
        "work_dir": work,
        "commands": {},
    }
    commands = report["commands"]
    report["model"] = ensure_hf_folder(args.hf_folder, work)
    report["versions"] = versions(args.vllm_venv)
    vllm: dict = {}
    tok: dict = {}
    try:
        if args.only in (None, "vllm"):
            vllm = run_vllm(args, vllm_peer, work, commands)
        if args.only in (None, "tokstream"):
            ok, why = (False, "--offline given") if args.offline else tokstream_serve_available(args)
            if ok:
                tok = run_tokstream_online(args, vllm_peer, work, commands)
                failed = tok.get("error") or not (tok.get("concurrent") or {}).get("completed")
                if failed:
                    why = ("tokstream serve failed: " + str(tok.get("error")
                           or (tok.get("concurrent") or {}).get("errors")
                           or (tok.get("concurrent") or {}).get("error")))
                    report["tokstream_online_attempt"] = tok
                    ok = False
            if not ok:
                log(f"tokstream online not usable ({why}); running tokstream bench offline")
                tok = run_tokstream_offline(args, work, commands, why)
    finally:
        report["vllm"] = vllm
        report["tokstream"] = tok
        report["comparison"] = (
            "online vs online: the same vllm bench serve client against both servers"
            if tok.get("mode") == "online" else
            "OFFLINE vs ONLINE: tokstream's engine alone (tokstream bench, no HTTP) against "
            "vLLM's server driven by vllm bench serve; not like for like")
        report["ratios_tokstream_over_vllm"] = ratios(tok, vllm)
        report["ratios_note"] = ("throughput: >1 means tokstream is faster; TTFT/ITL: <1 means "
                                 "tokstream's latency is lower")
        report["loadavg_at_end"] = loadavg()
        report["wall_s"] = time.time() - started
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        log(f"wrote {args.json}")
    print(json.dumps({"ratios_tokstream_over_vllm": report["ratios_tokstream_over_vllm"],
                      "comparison": report["comparison"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
