"""The machine a comparison runs on: its CPU and kernel flags, how many cores a server may use,
the load average and the wait for a quiet one, and the read bandwidth behind the weight-read
floors."""

from __future__ import annotations

import json
import os
import sys
import time

from compare_servers import ROOT, run_bounded, tail

# CPU flags that decide which kernels run (bf16 natively or emulated, VNNI int8 dot products).
KERNEL_FLAGS = ("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
                "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8",
                "amx_bf16", "amx_fp16")


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


def loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


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
