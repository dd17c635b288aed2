"""PNG plots of a report: TTFT and ITL CDFs, throughput and latency over time, tenant demand,
fair share and throughput; and a sweep's latency and throughput against offered rate.

Drawn from report.json's data alone, so `plot_report(json.load(...), out_dir)` redraws any
saved run.
"""

from __future__ import annotations

from pathlib import Path

PLOTS = ("ttft_cdf.png", "itl_cdf.png", "over_time.png", "tenant_share.png")


def _no_data(axis) -> None:
    axis.text(0.5, 0.5, "no completed request", ha="center", va="center",
              transform=axis.transAxes)


def _cdf(axis, values: list[float], label: str) -> None:
    if not values:
        return
    ordered = sorted(values)
    fractions = [(n + 1) / len(ordered) for n in range(len(ordered))]
    axis.step(ordered, fractions, where="post", label=f"{label} (n={len(ordered)})")


def _cdf_plot(report: dict, title: str, values_of, path: Path) -> None:
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    samples = [s for s in report["samples"] if s["status"] == "ok"]
    for workload in sorted(report["class"]):
        _cdf(axis, [v for s in samples if s["workload"] == workload for v in values_of(s)
                    if v > 0], workload)
    if axis.lines:
        axis.set_xscale("log")
    else:
        _no_data(axis)
    axis.set_xlabel("seconds (log scale)")
    axis.set_ylabel("fraction of samples ≤ x")
    axis.set_ylim(0, 1.02)
    axis.grid(True, which="both", alpha=0.3)
    axis.set_title(title)
    if axis.lines:
        axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _over_time(report: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    samples = report["samples"]
    span = max((s["start_s"] + s["e2e_s"] for s in samples), default=1.0)
    width = max(1.0, span / 60)  # about 60 bins whatever the run's length
    bins = int(span / width) + 1
    tokens = [0.0] * bins
    for s in samples:
        for t, n in zip(s["event_times_s"], s["event_tokens"]):
            tokens[min(bins - 1, int((s["start_s"] + t) / width))] += n
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    top.step([n * width for n in range(bins)], [v / width for v in tokens], where="post")
    top.set_ylabel("output tokens/s")
    top.set_title(f"Throughput and latency over time ({width:.3g} s bins)")
    top.grid(True, alpha=0.3)
    for workload in sorted(report["class"]):
        done = [s for s in samples if s["workload"] == workload and s["status"] == "ok"]
        bottom.scatter([s["start_s"] + s["e2e_s"] for s in done], [s["e2e_s"] for s in done],
                       s=10, marker="o", label=f"{workload} end-to-end")
        bottom.scatter([s["start_s"] + s["ttft_s"] for s in done], [s["ttft_s"] for s in done],
                       s=10, marker="x", label=f"{workload} TTFT")
    for status, marker, color in (("error", "v", "red"), ("cancelled", "s", "grey")):
        ended = [s for s in samples if s["status"] == status]
        if ended:
            label = "failed" if status == "error" else "cancelled at the drain timeout"
            bottom.scatter([s["start_s"] + s["e2e_s"] for s in ended],
                           [s["e2e_s"] for s in ended], s=25, marker=marker, color=color,
                           label=label)
    if any(v > 0 for c in bottom.collections for v in c.get_offsets()[:, 1]):
        bottom.set_yscale("log")
    else:
        _no_data(bottom)
    bottom.set_xlabel("seconds since the start (when the request ended / got its first token)")
    bottom.set_ylabel("seconds (log scale)")
    bottom.grid(True, which="both", alpha=0.3)
    if bottom.collections:
        bottom.legend(fontsize="small", ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _tenant_share(report: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    tenants = sorted(report["tenant"])
    shares = [report["tenant"][t].get("fair_share") or {} for t in tenants]
    figure, axis = plt.subplots(figsize=(max(8, 1.4 * len(tenants) + 3), 5))
    positions = range(len(tenants))
    for offset, key, label in ((-0.27, "demand_tokens_per_s", "demand (tokens/s offered)"),
                               (0.0, "fair_share_tokens_per_s", "max-min fair share"),
                               (0.27, "achieved_tokens_per_s", "achieved (tokens/s served)")):
        axis.bar([p + offset for p in positions], [s.get(key) or 0.0 for s in shares],
                 width=0.27, label=label)
    axis.set_xticks(list(positions), tenants)
    axis.set_ylabel("input + output tokens/s")
    fairness = report["summary"]["fairness"]
    figures = [f"{name} {value:.3f}" for name, value in (
        ("against fair share", fairness.get("jain_index_fair_share")),
        ("over raw tokens/s", fairness.get("jain_index_raw_tokens"))) if value is not None]
    axis.set_title("Per-tenant demand, max-min fair share and throughput (load window)"
                   + (f"\nJain's index {', '.join(figures)}" if figures else ""))
    axis.grid(True, axis="y", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_report(report: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / name for name in PLOTS]
    _cdf_plot(report, "Time to first token (CDF per class)", lambda s: [s["ttft_s"]], paths[0])
    _cdf_plot(report, "Inter-token latency (CDF per class)", lambda s: s["itl_s"], paths[1])
    _over_time(report, paths[2])
    _tenant_share(report, paths[3])
    return paths


SWEEP_PLOT = "sweep.png"
STAGE_MARKERS = {"constant": ("o", "Poisson stages (line)"),
                 "synchronous": ("s", "synchronous stage (1 user)"),
                 "throughput": ("D", "max-throughput stage (closed loop)")}
"""Marker and legend label of each kind of sweep stage (the colour says which figure)."""


def _stage_series(axis, points: list[tuple[str, float, float]], color: str, label: str) -> None:
    """One figure over the stages: a line through the Poisson stages (by offered rate), and
    the closed-loop stages as lone markers of the same colour."""
    for kind, (marker, _) in STAGE_MARKERS.items():
        mine = sorted((x, y) for k, x, y in points if k == kind)
        if not mine:
            continue
        if kind == "constant":
            axis.plot(*zip(*mine), marker=marker, color=color, label=label)
        else:
            axis.plot(*zip(*mine), marker=marker, color=color, linestyle="none", markersize=8)


def _milliseconds(axis) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator

    axis.set_yscale("log")
    axis.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    for setter in (axis.yaxis.set_major_formatter, axis.yaxis.set_minor_formatter):
        setter(FuncFormatter(lambda value, _: f"{value:g}"))


def plot_sweep(report: dict, out_dir: Path) -> Path:
    """sweep.png: TTFT and ITL (p50, p99), achieved requests/s and output tokens/s against
    offered rate, one point a stage. The closed-loop stages offer no rate: they stand at the
    rate they achieved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows = report["sweep"]["stages"]
    placed = [(r["offered_requests_per_s"] if r["offered_requests_per_s"] is not None
               else r["achieved_requests_per_s"], r) for r in rows]
    placed = [(x, r) for x, r in placed if x is not None]
    figure, axes = plt.subplots(2, 2, figsize=(13, 9))
    (ttft, itl), (rate, tokens) = axes
    for axis, key, title in ((ttft, "ttft_s", "Time to first token"),
                             (itl, "itl_s", "Inter-token latency")):
        for q, color in (("p50", "tab:blue"), ("p99", "tab:orange")):
            _stage_series(axis, [(r["kind"], x, r[key][q] * 1000) for x, r in placed
                                 if r[key][q]], color, q)
        if axis.lines:
            _milliseconds(axis)
            axis.legend(loc="upper left")
        else:
            _no_data(axis)
        axis.set_ylabel("milliseconds (log scale)")
        axis.set_title(title)
    _stage_series(rate, [(r["kind"], x, r["achieved_requests_per_s"]) for x, r in placed
                         if r["achieved_requests_per_s"] is not None], "tab:blue", "achieved")
    if rate.lines:
        top = max(max(line.get_xdata()) for line in rate.lines)
        rate.plot([0, top], [0, top], ":", color="grey", label="achieved = offered")
    rate.set_ylabel("requests/s")
    rate.set_title("Requests completed per second")
    _stage_series(tokens, [(r["kind"], x, r["output_tokens_per_s"]) for x, r in placed
                           if r["output_tokens_per_s"] is not None], "tab:green",
                  "output tokens/s")
    tokens.set_ylabel("output tokens/s")
    tokens.set_title("Output tokens per second")
    capacity = (report["sweep"].get("capacity") or {}).get("requests_per_s")
    for axis in axes.flat:
        if capacity:
            axis.axvline(capacity, color="tab:red", alpha=0.35, linestyle="--",
                         label=f"capacity {capacity:.3g} req/s")
        axis.set_xlim(left=0)
        axis.set_xlabel("offered requests/s")
        axis.grid(True, which="both", alpha=0.3)
    for axis in (rate, tokens):
        axis.set_ylim(bottom=0)
        axis.legend(loc="upper left")
    kinds = [Line2D([], [], marker=marker, color="black", linestyle="-" if kind == "constant"
                    else "none", label=label) for kind, (marker, label) in STAGE_MARKERS.items()]
    figure.legend(handles=kinds, loc="lower center", ncol=3, frameon=False,
                  title="closed-loop stages stand at the rate they achieved")
    config = report["config"]
    figure.suptitle(f"Sweep: mix {config['mix_name']}, model {config['model']}, "
                    f"{len(rows)} stages")
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    path = out_dir / SWEEP_PLOT
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
