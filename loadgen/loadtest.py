"""`tokstream loadtest`'s body: one run at the mix's (or the given) rate, after a capacity
probe when that rate is a fraction of capacity, or a capacity sweep (--sweep). Above both
tokstream.loadgen.runner (a stage) and tokstream.loadgen.sweep (many stages)."""

from __future__ import annotations

import sys

from tokstream.loadgen.capacity import rate_from_fraction, read_capacity
from tokstream.loadgen.mix import load_mix
from tokstream.loadgen.runner import Options, open_session, run_stage, settings_for
from tokstream.loadgen.sweep import SweepBounds, probe_capacity, run_sweep
from tokstream.loadgen.tables import print_report


def run(options: Options) -> int:
    mix = load_mix(options.mix)
    if options.sweep:
        bounds = SweepBounds.from_options(options, mix)  # bad input stops before any request
        return run_sweep(open_session(options, mix), bounds)
    settings = settings_for(options, mix)
    fraction = settings["capacity_fraction"]
    capacity = None
    if options.capacity is not None:
        if fraction is None:
            print("note: --capacity is not used: this run's rate is absolute or a closed loop",
                  file=sys.stderr)
        else:
            capacity = read_capacity(options.capacity, mix.name)  # before any request
    session = open_session(options, mix)
    if fraction is not None:
        if capacity is None:
            capacity = probe_capacity(session)
        settings["rate"] = rate_from_fraction(settings["capacity_fraction"], capacity)
        settings["capacity"] = capacity.row()
        print(f"rate {settings['rate']:.3g} req/s = {settings['capacity_fraction']:g} x "
              f"capacity {capacity.requests_per_s:.3g} req/s ({capacity.source})",
              file=sys.stderr)
    result = run_stage(session, settings, session.out)
    print_report(result.report, result.reasons)
    out = session.out
    plots = ", ".join(p.name for p in sorted(out.glob("*.png")))
    print(f"report: {out / 'report.json'}; plots: {plots}")
    if result.interrupted:
        return 130
    return 1 if result.reasons else 0
