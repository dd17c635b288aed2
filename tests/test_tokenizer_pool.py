"""The tokenizers library's pool of threads starts under SCHED_IDLE, and its batch calls run
there (issue 31 item 4: count_tokens on thousands of messages stalled the streams beside
it, its tokenising competing with the ranks' threads on equal terms). Run in a fresh process:
the pool is process-wide and starts on its first batch call."""

import json
import os
import subprocess
import sys


SCRIPT = r"""
import json, threading
from tokstream.model.presets import dummy_config
from tokstream.model.source import ModelSource, embedded_gguf_path
from tokstream.idle_threads import cpu_ticks, policy, thread_ids
from tokstream.text.tokenizer import load_tokenizer
from tokstream.text.tokenizer_pool import start_idle_pool

tokenizer = load_tokenizer(ModelSource("gguf", embedded_gguf_path(),
                                       dummy_config("smollm2-135m")))
main = threading.get_native_id()
workers = start_idle_pool(tokenizer.backend)
before = {tid: cpu_ticks(tid) for tid in thread_ids()}
texts = [f"message {i}: the quick brown fox jumps over the lazy dog. " * 400 for i in range(64)]
tokenizer.backend.encode_batch(texts, add_special_tokens=False)
used = {tid: cpu_ticks(tid) - before.get(tid, 0) for tid in thread_ids()}
print(json.dumps({"main": main, "main_policy": policy(main), "workers": workers,
                  "worker_policies": [policy(tid) for tid in workers], "used": used,
                  "again": start_idle_pool(tokenizer.backend)}))
"""


def run_script() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    env["RAYON_NUM_THREADS"] = "2"  # a pool of two even on a one-core runner
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_pool_runs_under_sched_idle_and_does_the_batch_work():
    seen = run_script()
    assert seen["main_policy"] == os.SCHED_OTHER  # the caller itself is left as it was
    assert len(seen["workers"]) == 2 and seen["worker_policies"] == [os.SCHED_IDLE] * 2
    used = {int(tid): ticks for tid, ticks in seen["used"].items()}
    on_workers = sum(used.get(tid, 0) for tid in seen["workers"])
    elsewhere = sum(ticks for tid, ticks in used.items() if tid not in seen["workers"])
    # The tokenising itself ran on the idle-policy threads; the caller only waited and took the ids.
    assert on_workers >= 10, used
    assert on_workers > 3 * elsewhere, used
    # A second start finds the pool running and says so (nothing left to set).
    assert seen["again"] == []
