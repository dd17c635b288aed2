"""PNG plots of a report: TTFT and ITL CDFs, throughput and latency over time, tenant shares.

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
    asked = [report["tenant"][t]["share_of_requests"] or 0.0 for t in tenants]
    served = [report["tenant"][t]["share_of_tokens"] or 0.0 for t in tenants]
    figure, axis = plt.subplots(figsize=(max(6, 1.2 * len(tenants) + 3), 5))
    positions = range(len(tenants))
    axis.bar([p - 0.2 for p in positions], asked, width=0.4, label="share of requests sent")
    axis.bar([p + 0.2 for p in positions], served, width=0.4, label="share of tokens served")
    axis.set_xticks(list(positions), tenants)
    axis.set_ylabel("share")
    jain = report["summary"]["fairness"]["jain_index"]
    axis.set_title("Per-tenant share" + (f" (Jain's index {jain:.3f})" if jain else ""))
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
