"""The contenders, one server config at a time: vLLM at each dtype, llama.cpp's llama-server,
tokstream serve at its defaults and each --weights format (or its offline bench when serve is
not usable)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess

from compare_client import run_workload
from compare_machine import loadavg, settle
from compare_probes import probe_ignore_eos, probe_stream
from compare_servers import MODEL_NAME, ROOT, Server, cmdline, free_port, log, run_bounded, tail

TOKSTREAM_WEIGHTS = ("native", "float32", "bfloat16")  # run when serve --help names none
TOKSTREAM_WEIGHTS_KNOWN = TOKSTREAM_WEIGHTS + ("float16",)  # run when serve --help names them


def run_contender(args, name: str, build_cmd, env_extra: dict, vllm_peer: str, work: str,
                  commands: dict, meta: dict | None = None) -> dict:
    """One server config: wait for a quiet machine, start it, probe it, run the workload, stop
    its whole process group (whatever happened)."""
    port = free_port()
    cmd = build_cmd(port)
    out: dict = dict(meta or {}, mode="online", server_cmd=cmdline(cmd, env_extra))
    commands[f"{name}_server"] = out["server_cmd"]
    out.update(settle(args, name))

    def measure() -> None:
        out["ignore_eos_probe"] = probe_ignore_eos(port)
        out["stream_probe"] = probe_stream(port)
        out.update(run_workload(args, name, vllm_peer, port, work, commands))
    return serve_and_measure(args, name, cmd, env_extra, work, port, out, measure)


def served_configuration(log_path: str) -> str | None:
    """What `tokstream serve` said it serves on its ready line (model, dtype, weights, KV
    blocks), without the address and pids that differ between runs; None for other servers."""
    try:
        text = open(log_path, errors="replace").read()
    except OSError:
        return None
    found = re.search(r"tokstream serve: ready on \S+ \(([^;)]*)", text)
    return found.group(1).strip() if found else None


def serve_and_measure(args, name: str, cmd: list[str], env_extra: dict, work: str, port: int,
                      out: dict, measure, log=log, error_chars: int | None = None,
                      log_chars: int | None = None) -> dict:
    """Start one server config and call measure() (which fills `out`) once /health answers.
    An exception in either ends up in out["error"] (its last error_chars, and its last
    log_chars in the log) instead of propagating; the whole process group is stopped whatever
    happened."""
    server = None
    try:
        server = Server(name, cmd, dict(os.environ, **env_extra),
                        os.path.join(work, f"{name}_server.log"), port)
        out["startup_s"] = server.wait_healthy(args.startup_timeout)
        log(f"{name}: healthy after {out['startup_s']:.1f} s")
        measure()
    except Exception as exc:  # reported in the JSON; the server is stopped below
        message = str(exc)
        out["error"] = message[-error_chars:] if error_chars else message
        log(f"{name}: {message[-log_chars:] if log_chars else message}")
    finally:
        if server is not None:
            out["stop"] = server.stop()
            out["server_log"] = server.log_path
            serves = served_configuration(server.log_path)
            if serves:
                out["serves"] = serves
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
