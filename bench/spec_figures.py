"""spec_bench's figures from every measured variant (copy/free at 1 stream, each speculating
variant over its server's `off`), issue 34's targets for tokstream's defaults, and the table
printed at the end."""

from __future__ import annotations

from spec_workload import MIXES

TARGET_COPY_OVER_FREE = 0.5  # issue 34: copy-heavy time per token <= 0.5x free-form's, 1 stream
TARGET_FREE_THROUGHPUT = 0.97  # issue 34: free-form throughput within 3% of speculation off


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def figure(variant: dict, mix: str, streams: int, key: str):
    return ((variant.get("runs") or {}).get(mix) or {}).get(str(streams), {}).get(key)


def derive(servers: dict, streams: list[int]) -> dict:
    """The issue's figures from every measured variant: copy/free at 1 stream, and each
    speculating variant over its server's `off` per mix and stream count."""
    copy_over_free, over_off = {}, {}
    for server, block in servers.items():
        variants = block.get("variants") or {}
        off = variants.get("off")
        for name, variant in variants.items():
            key = f"{server}/{name}"
            copy_over_free[key] = ratio(figure(variant, "copy", 1, "tpot_ms_median"),
                                        figure(variant, "free", 1, "tpot_ms_median"))
            if off is None or name == "off":
                continue
            over_off[key] = {mix: {str(n): {
                "tpot": ratio(figure(variant, mix, n, "tpot_ms_median"),
                              figure(off, mix, n, "tpot_ms_median")),
                "throughput": ratio(figure(variant, mix, n, "output_tok_per_s"),
                                    figure(off, mix, n, "output_tok_per_s"))}
                for n in streams} for mix in MIXES}
    return {"copy_over_free_tpot_1_stream": copy_over_free, "over_off": over_off,
            "note": "tpot: time per output token (median over requests), <1 is faster; "
                    "throughput: output tok/s, >1 is faster"}


def targets(figures: dict, defaults_variant: str | None, streams: list[int]) -> dict:
    """Issue 34's targets for tokstream's defaults (the variant `serve --help` defaults to)."""
    key = f"tokstream/{defaults_variant}"
    copy = figures["copy_over_free_tpot_1_stream"].get(key)
    out = {"evaluated_on": key if defaults_variant else None,
           "copy_over_free_1_stream": {"value": copy, "target": TARGET_COPY_OVER_FREE,
                                       "met": None if copy is None else
                                       copy <= TARGET_COPY_OVER_FREE}}
    free = (figures["over_off"].get(key) or {}).get("free") or {}
    for n in streams:
        value = (free.get(str(n)) or {}).get("throughput")
        out[f"free_throughput_over_off_{n}_streams"] = {
            "value": value, "target": TARGET_FREE_THROUGHPUT,
            "met": None if value is None else value >= TARGET_FREE_THROUGHPUT}
    if defaults_variant == "off":
        out["note"] = "the defaults do not speculate: the over-off targets are not applicable"
    if 32 not in streams:
        out["not_measured"] = "32-stream throughput (add 32 to --streams)"
    return out


def table(report: dict) -> str:
    rows = ["| variant | mix | streams | ms/token | tok/s | accepted/drafted |",
            "| --- | --- | --- | --- | --- | --- |"]
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    for server, block in report["servers"].items():
        for name, v in (block.get("variants") or {}).items():
            for mix, by_n in (v.get("runs") or {}).items():
                for n, r in (by_n.items() if isinstance(by_n, dict) else ()):
                    c = r.get("spec_counters") or {}
                    acc = (f"{c['accepted_tokens']:.0f}/{c['draft_tokens']:.0f}"
                           if c.get("draft_tokens") else "-")
                    rows.append(f"| {server}/{name} | {mix} | {n} | "
                                f"{fmt(r['tpot_ms_median'], '.1f')} | "
                                f"{fmt(r['output_tok_per_s'], '.1f')} | {acc} |")
    ratios = report["figures"]["copy_over_free_tpot_1_stream"]
    rows.append("\ncopy/free ms per token at 1 stream: " + ", ".join(
        f"{k} {fmt(v, '.2f')}" for k, v in ratios.items()))
    return "\n".join(rows)
