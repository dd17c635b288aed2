"""compare_vllm.py's report: which runs count, each contender's best per figure, the ratios
tokstream / peer, issue 13's targets and whether the defaults are the fast ones, and the
markdown table for the README. Plain dicts in, plain dicts and text out: no server runs here.
"""

from __future__ import annotations


RATIO_KEYS = ("output_throughput", "total_token_throughput", "median_ttft_ms", "p99_ttft_ms",
              "median_itl_ms", "p99_itl_ms", "median_itl_ms_token_gaps", "p99_itl_ms_token_gaps",
              "median_tpot_ms", "median_e2el_ms")
HIGHER_IS_BETTER = {"output_throughput", "total_token_throughput", "request_throughput"}
RUNS = ("concurrent", "single_stream")

# The headline figures: (id, run, metric, label). ITL over the gaps between token-carrying
# chunks (see summarize_bench), the client's own ITL where those are missing (offline runs).
FIGURES = (
    ("throughput_n", "concurrent", "output_throughput", "{n} streams, output tok/s"),
    ("p99_itl_n", "concurrent", "p99_itl_ms_token_gaps", "{n} streams, p99 ITL"),
    ("median_ttft_n", "concurrent", "median_ttft_ms", "{n} streams, median TTFT"),
    ("median_itl_1", "single_stream", "median_itl_ms_token_gaps", "1 stream, median ITL"),
)

# Issue 13's targets, as ratios tokstream / peer: (id, figure, peer, op, bound, statement).
TARGETS = (
    ("throughput_32_vs_vllm", "throughput_n", "vllm", ">=", 1.25,
     "32 streams: output tokens/s >= 1.25x vLLM's best"),
    ("p99_itl_32_vs_vllm", "p99_itl_n", "vllm", "<=", 1.0,
     "32 streams: p99 ITL no worse than vLLM's best"),
    ("median_ttft_32_vs_vllm", "median_ttft_n", "vllm", "<=", 1.0,
     "32 streams: median TTFT no worse than vLLM's best"),
    ("median_itl_1_vs_vllm", "median_itl_1", "vllm", "<=", 0.5,
     "1 stream: median ITL <= 0.5x vLLM's best"),
    ("median_itl_1_vs_llamacpp", "median_itl_1", "llamacpp", "<=", 1.0,
     "1 stream: median ITL no worse than llama.cpp's server on the same file (issue 28)"),
)


def usable(cfg: dict, run: str) -> bool:
    """A run whose figures may count: every request completed, none failed."""
    r = (cfg or {}).get(run) or {}
    return (not r.get("error") and bool(r.get("completed"))
            and not r.get("failed") and not r.get("num_errors"))


def metric(cfg: dict, run: str, key: str) -> float | None:
    r = (cfg or {}).get(run) or {}
    if r.get(key) is None and key.endswith("_token_gaps"):
        key = key[:-len("_token_gaps")]
    return r.get(key) if usable(cfg, run) else None


def best_of(configs: dict) -> dict:
    """Per run and figure, the best value over the configs (highest throughput, lowest
    latency) and which config gave it."""
    out: dict = {run: {} for run in RUNS}
    out["from"] = {run: {} for run in RUNS}
    for run in RUNS:
        for key in RATIO_KEYS:
            cands = [(v, label) for label, cfg in configs.items()
                     if (v := metric(cfg, run, key)) is not None]
            if not cands:
                continue
            value, label = (max if key in HIGHER_IS_BETTER else min)(cands)
            out[run][key] = value
            out["from"][run][key] = label
    return out


def as_runs(cfg: dict) -> dict:
    """A config (or a best_of) as {run: {key: value}} of usable figures only."""
    if "from" in cfg:
        return {run: cfg.get(run) or {} for run in RUNS}
    return {run: {k: v for k in RATIO_KEYS if (v := metric(cfg, run, k)) is not None}
            for run in RUNS}


def ratios(tok: dict, peer: dict) -> dict:
    a, b = as_runs(tok), as_runs(peer)
    out = {}
    for run in RUNS:
        r = {k: a[run][k] / b[run][k] for k in RATIO_KEYS
             if a[run].get(k) is not None and b[run].get(k)}
        if r:
            out[run] = r
    return out


def figure_value(runs: dict, figure: str) -> float | None:
    _, run, key, _ = next(f for f in FIGURES if f[0] == figure)
    r = runs.get(run) or {}
    if r.get(key) is None and key.endswith("_token_gaps"):
        key = key[:-len("_token_gaps")]
    return r.get(key)


def headline(tok: dict, peers: dict) -> dict:
    """Each figure: tokstream's value, each peer's, and the ratio tokstream / peer."""
    t = as_runs(tok)
    out = {}
    for fid, *_ in FIGURES:
        row = {"tokstream": figure_value(t, fid)}
        for pname, peer in peers.items():
            pv = figure_value(as_runs(peer), fid) if peer else None
            row[pname] = pv
            row[f"ratio_over_{pname}"] = (row["tokstream"] / pv
                                          if row["tokstream"] is not None and pv else None)
        out[fid] = row
    return out


def evaluate_targets(head: dict) -> list[dict]:
    out = []
    for tid, fid, peer, op, bound, text in TARGETS:
        ratio = head[fid].get(f"ratio_over_{peer}")
        met = None if ratio is None else (ratio >= bound if op == ">=" else ratio <= bound)
        out.append({"id": tid, "target": text, "figure": fid, "peer": peer, "ratio": ratio,
                    "op": op, "bound": bound, "met": met})
    return out


def defaults_are_fast(tok_configs: dict, tolerance: float) -> dict:
    """`make serve` defaults are the fast ones: the default config within `tolerance` of the
    best explicit --weights config on every headline figure (None without such configs)."""
    explicit = {k: v for k, v in tok_configs.items() if k != "default"}
    default = tok_configs.get("default")
    if not explicit or not default:
        return {"met": None, "why": "no --weights configs measured" if not explicit
                else "default config not measured"}
    best = as_runs(best_of(explicit))
    dflt = as_runs(default)
    checks = {}
    for fid, run, key, _ in FIGURES:
        d, b = figure_value(dflt, fid), figure_value(best, fid)
        if d is None or b is None:
            checks[fid] = None
            continue
        higher = key in HIGHER_IS_BETTER
        checks[fid] = d >= b * (1 - tolerance) if higher else d <= b * (1 + tolerance)
    vals = list(checks.values())
    same = sorted(k for k, v in explicit.items()
                  if default.get("serves") and v.get("serves") == default["serves"])
    return {"met": None if None in vals else all(vals), "per_figure": checks,
            "tolerance": tolerance, "best_weights_config": best_of(explicit)["from"],
            "same_configuration_as": same}


def same_configuration_note(dfast: dict) -> str:
    """Where the defaults served exactly what an explicit --weights did (the ready lines say
    so), their measured gap is the run's own spread: said beside the verdict."""
    same = dfast.get("same_configuration_as")
    return (f" (the defaults serve the same configuration as --weights {', '.join(same)})"
            if same else "")


def fmt(v: float | None, key: str = "") -> str:
    if v is None:
        return "—"
    if "ttft" in key:
        return f"{v / 1000:.2f} s"
    if key.endswith("_ms") or "itl" in key:
        return f"{v:,.1f} ms" if v < 100 else f"{v:,.0f} ms"
    return f"{v:,.0f}" if v >= 10 else f"{v:,.1f}"


def fmt_ratio(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}x"


def yes_no(v) -> str:
    return {True: "yes", False: "**no**", None: "—"}[v]


def markdown(report: dict) -> str:
    host, versions_, wl = report["host"], report["versions"], report["workload"]
    n = wl["concurrent"]["max_concurrency"]
    tok = report["tokstream"]
    cfgs = tok.get("configs") or {}
    default = cfgs.get("default") or {}
    vbest = (report["vllm"] or {}).get("best") or {}
    head = report["headline"]
    flags = host["kernel_flags"]
    flag_txt = ", ".join(f"{f} {'yes' if flags.get(f) else 'no'}"
                         for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16"))
    flag_txt += ", amx " + ("/".join(host["amx_flags"]) if host["amx_flags"] else "no")
    lines = [
        f"Side by side, one run ({report['date']}, tokstream "
        f"{versions_.get('tokstream_commit', '')[:7]}"
        f"{' + local changes' if versions_.get('tokstream_tree_dirty') else ''}; "
        f"`bench/compare_vllm.py`{' --quick' if wl.get('quick') else ''}): "
        f"{wl['concurrent']['num_prompts']} random prompts, {wl['input_len']} in / "
        f"{wl['output_len']} out, ignore_eos, the same `vllm bench serve` client for all; "
        f"quiet machine: {yes_no(report['quiet'])} (1-min load before each server: "
        f"{', '.join(f'{c:.2f}' for c in report['loadavg_before_each'].values()) or 'none ran'}"
        f").",
        "",
        f"CPU: {host['cpu']}, {host['cores']} cores; {flag_txt}.",
    ]
    if not wl.get("vllm_compiled", True):
        lines[0] += " vLLM ran with --enforce-eager, NOT its default compiled mode."
    fl = report.get("floors") or {}
    if fl.get("floor_ms_per_token"):
        f = fl["floor_ms_per_token"]
        lines.append(f"Read bandwidth {fl['read_bandwidth']['read_gbs']:.1f} GB/s; weight-read "
                     f"floor per token at batch 1: " + ", ".join(
                         f"{k} {v:.1f} ms" for k, v in f.items()) + ".")
    lines += ["", f"| | vLLM best (dtype) | llama.cpp | tokstream default | tokstream / vLLM "
                  f"| tokstream / llama.cpp | target | met |",
              "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    targets = {t["figure"] + "/" + t["peer"]: t for t in report["targets"]["results"]}
    for fid, run, key, label in FIGURES:
        row = head.get(fid) or {}
        src = (vbest.get("from") or {}).get(run, {}).get(key) or \
            (vbest.get("from") or {}).get(run, {}).get(key.replace("_token_gaps", ""))
        vtxt = fmt(row.get("vllm"), key) + (f" ({src})" if src else "")
        tg = [targets.get(f"{fid}/{p}") for p in ("vllm", "llamacpp")]
        tg = [t for t in tg if t]
        ttxt = "; ".join(f"{t['op'].replace('>=', '≥').replace('<=', '≤')} {t['bound']}x "
                         f"{'vLLM' if t['peer'] == 'vllm' else 'llama.cpp'}" for t in tg)
        mtxt = "; ".join(yes_no(t["met"]) for t in tg)
        lines.append(f"| {label.format(n=n)} | {vtxt} | {fmt(row.get('llamacpp'), key)} | "
                     f"{fmt(row.get('tokstream'), key)} | {fmt_ratio(row.get('ratio_over_vllm'))} "
                     f"| {fmt_ratio(row.get('ratio_over_llamacpp'))} | {ttxt} | {mtxt} |")
    starts = {"vLLM": {d: c.get("startup_s") for d, c in
                       ((report["vllm"] or {}).get("configs") or {}).items()},
              "llama.cpp": (report["llamacpp"] or {}).get("startup_s"),
              "tokstream": default.get("startup_s")}
    vs = "/".join(f"{v:.0f}" for v in starts["vLLM"].values() if v is not None)
    vs = f"{vs} ({'/'.join(starts['vLLM'])})" if vs else "—"
    lines.append(f"| start-up to /health (s) | {vs} | "
                 f"{fmt(starts['llama.cpp'])} | {fmt(starts['tokstream'])} | | | | |")
    dfast = report["targets"]["defaults_are_fast"]
    wflag = tok.get("weights_flag")
    wtxt = "not checked" if wflag is None else wflag if isinstance(wflag, str) else \
        "available (" + ", ".join(wflag["formats_listed"]) + ")"
    lines += ["", f"`make serve` defaults are the fast ones: {yes_no(dfast.get('met'))}"
                  + (f" ({dfast['why']})" if dfast.get("why") else "")
                  + same_configuration_note(dfast)
                  + f". tokstream --weights: {wtxt}."]
    if report.get("aborted"):
        lines.append(f"**Aborted: {report['aborted']}**")
    if tok.get("configs", {}).get("default", {}).get("mode") == "offline":
        lines.append("**tokstream ran OFFLINE (tokstream bench, no HTTP): not like for like.**")
    if len(cfgs) > 1 or len(((report["vllm"] or {}).get("configs") or {})) > 1:
        lines += ["", "| config | " + " | ".join(lbl.format(n=n) for *_, lbl in FIGURES)
                  + " | start-up (s) |", "| --- |" + " ---: |" * (len(FIGURES) + 1)]
        every = [(f"vLLM {d}", c) for d, c in ((report["vllm"] or {}).get("configs") or {}).items()]
        every += [("llama.cpp", report["llamacpp"])] if report["llamacpp"] else []
        every += [(f"tokstream {w}", c) for w, c in cfgs.items()]
        for name, c in every:
            r = as_runs(c)
            lines.append(f"| {name} | " + " | ".join(fmt(figure_value(r, fid), key)
                                                    for fid, _, key, _ in FIGURES)
                         + f" | {fmt(c.get('startup_s'))} |")
    return "\n".join(lines)


def kinds_table(reports: dict[str, dict]) -> str:
    """One row per kind of CPU measured ({kind: report}): tokstream's defaults against the
    peers' best on each headline figure, so a run on another CPU adds a row."""
    labels = [lbl.format(n="32") for *_, lbl in FIGURES]
    lines = ["| CPU (kind, date) | " + " | ".join(labels) + " | defaults within 5% of the "
             "best --weights |", "| --- |" + " ---: |" * len(FIGURES) + " --- |"]
    for kind, report in sorted(reports.items()):
        head, cells = report["headline"], []
        for fid, _, key, _ in FIGURES:
            row = head.get(fid) or {}
            ratios_ = [f"{fmt_ratio(row.get(f'ratio_over_{p}'))} {name}"
                       for p, name in (("vllm", "vLLM"), ("llamacpp", "llama.cpp"))
                       if row.get(f"ratio_over_{p}") is not None]
            cells.append(f"{fmt(row.get('tokstream'), key)} ({'; '.join(ratios_) or '—'})")
        dfast = report["targets"]["defaults_are_fast"]
        lines.append(f"| {report['host']['cpu']} ({kind}, {report['date'][:10]}) | "
                     + " | ".join(cells) + f" | {yes_no(dfast.get('met'))}"
                     + same_configuration_note(dfast) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    import glob
    import json
    import os

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    found = {os.path.basename(f)[len("compare_vllm-"):-len(".json")]: json.load(open(f))
             for f in glob.glob(os.path.join(here, "compare_vllm-*.json"))}
    print(kinds_table(found))
