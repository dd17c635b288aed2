"""Rates stated as a fraction of measured capacity: the mix key, the flags' precedence, reading a
capacity back, and the rate a run derives from it (given, read from a file, or probed first),
against the fake SSE server of the plumbing tests."""

import json

import pytest

from helpers.loadtest_run import SHORT, flood, loadtest as run_loadtest, write_mix
from test_loadgen_plumbing import FakeServer
from tokstream.errors import UserInputError
from tokstream.loadgen.capacity import (Capacity, capacity_from_summary, rate_from_fraction,
                                        read_capacity, write_capacity)
from tokstream.loadgen.mix import MIX_DIR, load_mix, parse_mix
from tokstream.loadgen.runner import Options, settings_for


def mix_with(run: dict):
    return parse_mix({"kind": "mix", "class": [{"name": "a"}], "run": run}, "m")


@pytest.mark.parametrize("run,message", [
    ({"arrival": "poisson", "rate": 2.0, "capacity_fraction": 0.5}, "not both"),
    ({"arrival": "closed", "capacity_fraction": 0.5}, "open-loop"),
    ({"arrival": "poisson", "capacity_fraction": 0}, "capacity_fraction"),
    ({"arrival": "poisson", "capacity_fraction": "half"}, "capacity_fraction"),
])
def test_bad_capacity_fraction_names_the_field(run, message):
    with pytest.raises(UserInputError, match=message):
        mix_with(run)


def settings(mix, **flags):
    return settings_for(Options(url="http://127.0.0.1:9", mix="x", **flags), mix)


def test_a_fraction_leaves_the_rate_to_measure_and_flags_take_precedence():
    fractional = mix_with({"arrival": "poisson", "capacity_fraction": 0.25})
    s = settings(fractional)
    assert (s["arrival"], s["rate"], s["capacity_fraction"]) == ("poisson", None, 0.25)
    # an absolute --rate wins over the mix's fraction, and a --capacity-fraction over its rate
    s = settings(fractional, rate=3.0)
    assert (s["rate"], s["capacity_fraction"]) == (3.0, None)
    absolute = mix_with({"arrival": "poisson", "rate": 6.0})
    assert (settings(absolute)["rate"], settings(absolute)["capacity_fraction"]) == (6.0, None)
    s = settings(absolute, capacity_fraction=0.9)
    assert (s["rate"], s["capacity_fraction"]) == (None, 0.9)
    # on a closed-loop mix it opens the loop (as --rate does); --arrival closed ignores it
    closed = mix_with({"arrival": "closed", "users": 4})
    assert settings(closed, capacity_fraction=0.5)["arrival"] == "poisson"
    s = settings(fractional, arrival="closed")
    assert (s["arrival"], s["capacity_fraction"]) == ("closed", None)
    with pytest.raises(UserInputError, match="one of them"):
        settings(fractional, rate=1.0, capacity_fraction=0.5)


def test_shipped_open_loop_mixes_state_a_fraction_of_capacity():
    fractions = {name: load_mix(name).run.capacity_fraction for name in
                 ("chat", "shared-prefix", "hot-tenant", "long-prompt-flood")}
    assert fractions == {"chat": 0.5, "shared-prefix": 0.5, "hot-tenant": 0.8,
                         "long-prompt-flood": 0.5}
    for path in MIX_DIR.glob("*.toml"):
        run = load_mix(str(path)).run
        # every open-loop mix is relative to the machine; none overloads it by default
        assert run.arrival == "closed" or 0 < run.capacity_fraction <= 1, path.name


def test_capacity_reads_back_from_a_number_a_probe_file_or_a_sweep_report(tmp_path, capsys):
    assert read_capacity("2.5", "chat") == Capacity(2.5, None, None, None, "given")
    measured = Capacity(4.0, 300.0, 32, "chat", "probe", "http://x", "2025-01-01T00:00:00")
    path = write_capacity(measured, tmp_path)
    again = read_capacity(str(path), "chat")
    assert (again.requests_per_s, again.users, again.mix) == (4.0, 32, "chat")
    assert again.source == f"probe via {path}"
    sweep = tmp_path / "report.json"
    sweep.write_text(json.dumps({"kind": "sweep", "sweep": {"capacity": measured.row()}}))
    assert read_capacity(str(sweep), "hot-tenant").requests_per_s == 4.0
    assert "measured on mix chat" in capsys.readouterr().err  # another mix: a warning
    assert rate_from_fraction(0.8, measured) == pytest.approx(3.2)
    for text, message in (("/no/such/file", "neither a number"), ("0", "positive"),
                          (str(tmp_path / "bad.json"), "no measured capacity")):
        (tmp_path / "bad.json").write_text('{"summary": {}}')
        with pytest.raises(UserInputError, match=message):
            read_capacity(text, "chat")
    with pytest.raises(UserInputError, match="completed no request"):
        capacity_from_summary({"completed": 0, "requests_per_s": 0.0, "failed": 3,
                               "cancelled": 0, "output_tokens_per_s": 0.0}, 8, "chat",
                              "probe", "http://x", "now")


def loadtest(tmp_path, fake, *args):
    mix, _ = write_mix(tmp_path, {"arrival": "poisson", "capacity_fraction": 0.5, "users": 8},
                       [SHORT, flood(100, 0.3)])
    return run_loadtest("--url", fake.url, "--mix", mix, "--requests", "5", "--duration", "20s",
                        *args, timeout=180)


@pytest.mark.startup
def test_a_given_capacity_sets_the_rate_without_a_probe(tmp_path):
    out = tmp_path / "out"
    with FakeServer(context=1024) as fake:
        result = loadtest(tmp_path, fake, "--capacity", "40", "--out", str(out))
        served = len(fake.requests)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "report.json").read_text())
    settings = report["config"]["settings"]
    assert (settings["arrival"], settings["rate"], settings["capacity_fraction"]) == \
        ("poisson", 20.0, 0.5)
    assert settings["capacity"]["source"] == "given"
    assert served == report["summary"]["requests"] == 5  # no probe was sent
    assert not (out / "capacity-probe").exists()
    assert "rate 20 req/s = 0.5 x capacity 40 req/s (given)" in result.stdout


@pytest.mark.startup
def test_without_a_capacity_a_probe_measures_it_first_and_leaves_it_for_the_next_run(tmp_path):
    out = tmp_path / "out"
    with FakeServer(context=1024, token_delay_s=0.01) as fake:
        result = loadtest(tmp_path, fake, "--throughput-users", "2", "--probe-duration", "20s",
                          "--out", str(out))
        probed = len(fake.requests)
        assert result.returncode == 0, result.stdout + result.stderr
        probe = json.loads((out / "capacity-probe" / "report.json").read_text())
        report = json.loads((out / "report.json").read_text())
        capacity = json.loads((out / "capacity.json").read_text())["capacity"]
        # the probe: a closed loop of --throughput-users, 4 requests a user, no bursts
        assert probe["config"]["settings"]["arrival"] == "closed"
        assert probe["config"]["settings"]["users"] == 2
        assert probe["summary"]["requests"] == 8 == probe["summary"]["completed"]
        assert {s["workload"] for s in probe["samples"]} == {"short"}
        assert capacity["requests_per_s"] == probe["summary"]["requests_per_s"]
        assert capacity["source"] == "probe" and capacity["users"] == 2
        # the run: half of what the probe measured, exactly
        settings = report["config"]["settings"]
        assert settings["rate"] == 0.5 * capacity["requests_per_s"]
        assert settings["capacity"] == capacity
        assert probed == 8 + report["summary"]["requests"]
        # the next run reads the capacity back and sends no probe
        again = loadtest(tmp_path, fake, "--capacity", str(out / "capacity.json"),
                         "--out", str(tmp_path / "again"))
        assert again.returncode == 0, again.stdout + again.stderr
        assert len(fake.requests) == probed + 5
    rerun = json.loads((tmp_path / "again" / "report.json").read_text())["config"]["settings"]
    assert rerun["rate"] == settings["rate"]
