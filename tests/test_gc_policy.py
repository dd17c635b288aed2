"""The serving processes' collector settings (tokstream/gc_policy.py): what start-up built is
frozen out of collections, young cycles are still collected."""

import gc
import subprocess
import sys
import textwrap


def run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, check=True).stdout.strip()


def test_start_up_objects_are_frozen_and_young_cycles_still_collected():
    out = run("""
        import gc
        from tokstream import gc_policy
        built = [[i] for i in range(10_000)]
        gc_policy.settle_after_start()
        print(gc.get_freeze_count() >= 10_000, gc.get_threshold()[0])
        class Node:
            pass
        a, b = Node(), Node()
        a.other, b.other = b, a
        import weakref
        alive = weakref.ref(a)
        del a, b
        gc.collect()
        print(alive() is None)
    """)
    assert out.splitlines() == ["True 50000", "True"]


def test_this_process_is_untouched():
    # the policy is for the serving processes; importing it changes nothing here
    before = gc.get_threshold()
    import tokstream.gc_policy  # noqa: F401
    assert gc.get_threshold() == before


def test_every_serving_process_settles_after_start():
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent / "tokstream"
    for process in ("worker/worker.py", "engine/core_process.py", "server/app.py"):
        assert "gc_policy.settle_after_start()" in (root / process).read_text(), process
