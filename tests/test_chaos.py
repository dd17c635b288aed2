"""`tokstream chaos` end to end on dummy:tiny: each experiment run as a real command that
starts its own server (real processes, real signals, real HTTP), exits 0, and reports what
the fault did; --repeat; the checker proven by mutation through the command (each demux
mutation makes it exit non-zero with the right violation); bad input exits 2; Ctrl-C leaves
nothing behind."""

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest

from helpers.chaos_report import resumed_after_fault
from helpers.serving import ROOT, ServerProcess, interruptible
from tokstream.process_end import wait_ended

pytestmark = [pytest.mark.startup, pytest.mark.timeout(400)]

CHAOS = [sys.executable, "-m", "tokstream", "chaos"]
TINY = ["--model", "dummy:tiny"]
SHORTER = ["--max-tokens", "16"]


def chaos(tmp_path, *args, env=None, timeout=360) -> tuple[int, dict | None, str]:
    """Run the command; returns (exit code, the JSON report if written, output)."""
    path = tmp_path / "report.json"
    path.unlink(missing_ok=True)
    result = subprocess.run([*CHAOS, *args, "--json", str(path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=timeout)
    report = json.loads(path.read_text()) if path.exists() else None
    return result.returncode, report, result.stdout + result.stderr


def assert_clean(code: int, report: dict, output: str) -> None:
    assert code == 0, output[-3000:]
    assert report["ok"] and not any(report["violations"].values()), report["violation_details"]
    # The server chaos started is gone, with everything under it.
    assert not psutil.pid_exists(report["target"]["pid"]) or \
        psutil.Process(report["target"]["pid"]).status() == psutil.STATUS_ZOMBIE


STEP_DEADLINE = ["--step-timeout", "5"]
"""Half the 10 s default, so the stall is caught 5 s sooner: dummy:tiny's steps take
milliseconds (none over 0.2 s measured on a loaded 2-core machine), 25x below it. The same
deadline sets hang-engine's heartbeat watch."""


def test_stall_rank_is_caught_by_the_step_deadline(tmp_path):
    code, report, output = chaos(tmp_path, "stall-rank", "0", *TINY, *SHORTER, *STEP_DEADLINE)
    assert_clean(code, report, output)
    fault, = report["faults"]
    assert fault["signal"] == "SIGSTOP" and fault["target"] == "rank 0"
    assert any(e["kind"] == "rank_failure" and "hung" in e["reason"]
               for e in fault["engine_events"])
    assert fault["stopped_process_after_round"].startswith("gone")
    assert fault["recovery_s"] > 0 and resumed_after_fault(report, fault)
    assert report["content"]["audited"] >= 1
    assert "in flight at the fault" in output and "PASS" in output


def test_kill_engine_resumes_every_stream_on_a_new_core(tmp_path):
    code, report, output = chaos(tmp_path, "kill-engine", *TINY, *SHORTER, "--seed", "3")
    assert_clean(code, report, output)
    fault, = report["faults"]
    assert fault["target"] == "engine core"
    assert [e["kind"] for e in fault["engine_events"]][:2] == ["engine_dead",
                                                               "engine_restarted"]
    assert fault["server_recovery_s"]["core"]
    assert report["classes"] == {"complete": len(report["streams"])}


def test_hang_engine_is_caught_by_the_heartbeat(tmp_path):
    """SIGSTOP the engine core (issue 31): the gateway finds its heartbeat stopped, kills it
    and resumes every stream on a new core; the stopped process is gone afterwards."""
    code, report, output = chaos(tmp_path, "hang-engine", *TINY, *SHORTER, *STEP_DEADLINE)
    assert_clean(code, report, output)
    fault, = report["faults"]
    assert fault["signal"] == "SIGSTOP" and fault["target"] == "engine core"
    dead = next(e for e in fault["engine_events"] if e["kind"] == "engine_dead")
    assert "hung" in dead["reason"], fault["engine_events"]
    assert fault["stopped_process_after_round"].startswith("gone")
    assert resumed_after_fault(report, fault)
    assert report["classes"] == {"complete": len(report["streams"])}


def test_kill_rank_three_times_in_a_row(tmp_path):
    code, report, output = chaos(tmp_path, "kill-rank", "0", *TINY, "--repeat", "3",
                                 "--streams", "3")
    assert_clean(code, report, output)
    assert len(report["faults"]) == 3 and len(report["recovery_s_per_fault"]) == 3
    pids = [f["pid"] for f in report["faults"]]
    assert len(set(pids)) == 3  # each round killed the rank of the group then serving
    for fault in report["faults"]:
        states = [r["state_at_fault"] for r in fault["in_flight"]]
        assert any(s.startswith("prefilling") for s in states), states
        assert sum(s.startswith("decoding") for s in states) >= 2, states
    content = report["content"]
    assert content["audited"] >= 3 and content["within_tolerance"] == content["audited"]


def test_disconnect_storm_frees_what_the_leavers_held(tmp_path):
    code, report, output = chaos(tmp_path, "disconnect-storm", *TINY)
    assert_clean(code, report, output)
    hung = report["faults"][0]["hung_up"]
    assert len(hung) == 4
    classes = {s["name"]: s["class"] for s in report["streams"]}
    assert all(classes[h["stream"]] in ("cut", "complete") for h in hung)
    assert sum(c == "complete" for c in classes.values()) >= 4


def test_cache_exhaustion_preempts_and_changes_no_output(tmp_path):
    code, report, output = chaos(tmp_path, "cache-exhaustion", *TINY, *SHORTER)
    assert_clean(code, report, output)
    fault = report["faults"][0]
    # Preemptions are the proof the pool ran out. demand_tokens counts a prompt only if a
    # /v1/state poll saw its request, so a fast run under-counts it (seen: 188 tokens for a
    # 224-token pool, with 2 preemptions); it is not compared with the pool any more.
    assert fault["preemptions"] > 0 and fault["demand_tokens"] > 0
    assert report["classes"] == {"complete": 8}


def test_slow_clients_are_cancelled_without_stalling_the_others(tmp_path):
    code, report, output = chaos(tmp_path, "slow-client", *TINY, "--streams", "4")
    assert_clean(code, report, output)
    slow = {s["stream"] for s in report["faults"][0]["slow_clients"]}
    assert len(slow) == 2
    for stream in report["streams"]:
        if stream["name"] in slow:
            assert stream["class"] in ("failed", "complete")
            if stream["class"] == "failed":
                assert stream["error"]["type"] == "overloaded_error"
        else:
            assert stream["class"] == "complete"


ADMIN = "sk-admin-chaos-test"
SHORT = ["--max-tokens", "12"]
"""With seed 0 every client that hangs up does so after 6 tokens or more, so the mutated
token (index 2) and the one after it reach their callers."""
MUTATIONS = [("drop", "lost"), ("repeat", "duplicated"), ("swap", "reordered"),
             ("misroute", "foreign")]


def test_each_demux_mutation_makes_chaos_exit_non_zero(tmp_path):
    """One server whose demux corrupts one token per run (drop, then repeat, swap, misroute),
    targeted with --url: each run exits 1 with the matching violation. (The test-only switch
    is refused with a tenants file, so this server is an open one on loopback.)"""
    sequence = ",".join(m for m, _ in MUTATIONS)
    with ServerProcess("--profile", "ci", "--demux-mutation", sequence) as server:
        for mutation, kind in MUTATIONS:
            code, report, output = chaos(tmp_path, "disconnect-storm", "--url", server.url,
                                         *SHORT)
            assert code == 1, (mutation, output[-2000:])
            assert report["violations"][kind] >= 1, (mutation, report["violation_details"])
            assert "FAIL" in output
        # Every mutation has fired: the same run passes now.
        code, report, output = chaos(tmp_path, "disconnect-storm", "--url", server.url,
                                     *SHORT)
        assert code == 0, output[-2000:]


@pytest.mark.parametrize("args, message", [
    (["kill-rank", "2", *TINY], "rank 2: the server has ranks 0..1"),
    (["kill-engine", "--url", "http://10.1.2.3:8000"], "only targets a server on this"),
    (["kill-engine", "--url", "http://127.0.0.1:9"], "/health answered nothing"),
    (["disconnect-storm", *TINY, "--repeat", "0"], "--repeat must be at least 1"),
    (["kill-engine", "--admin-key", "k"], "--admin-key and --api-key go with --url"),
    (["kill-engine", *TINY, "--max-tokens", "2000"], "exceed the model's context of 2048"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    # A refusal that hung would end the run at the timeout (subprocess.TimeoutExpired).
    code, report, output = chaos(tmp_path, *args, timeout=150)
    assert code == 2 and report is None, output
    assert output.strip().startswith("error: ") and message in output, output
    assert len(output.strip().splitlines()) == 1, output


def test_ctrl_c_tears_the_server_down(tmp_path):
    # 1,900 tokens and the streams' ~50-63 prompt tokens fit dummy:tiny's 2,048 context, so
    # the run lasts ~18 s; with 2,000 every stream was refused and the run could end before
    # the interrupt came (exit 1, not 130: seen once in a full run).
    process = subprocess.Popen([*CHAOS, "kill-rank", "1", *TINY, "--max-tokens", "1900"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, preexec_fn=interruptible)
    try:
        chaos_process = psutil.Process(process.pid)
        deadline = time.monotonic() + 180
        # The server is up once it has its engine core and ranks under it.
        while len(chaos_process.children(recursive=True)) < 4:
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.2)
        time.sleep(2)  # into the experiment
        tree = chaos_process.children(recursive=True)
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, output[-2000:]
    assert "interrupted" in output
    alive = wait_ended(tree, 30)
    assert not alive, alive
