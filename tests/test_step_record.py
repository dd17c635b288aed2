"""The step record (engine/step_record.py): what the gateway reads of a dead core's step."""

import multiprocessing as mp

from tokstream.engine.step_record import RECORD_BYTES, StepRecord, in_flight, new_record


def test_a_step_between_begin_and_end_is_read_back_and_cleared():
    shared = new_record(mp.get_context("spawn"))
    assert in_flight(shared) == set()  # never written: between steps
    record = StepRecord(shared)
    record.begin(["a", "msg_b", "chatcmpl-c"])
    assert in_flight(shared) == {"a", "msg_b", "chatcmpl-c"}
    record.end()
    assert in_flight(shared) == set()
    record.begin(["d"])
    assert in_flight(shared) == {"d"}


def test_a_record_cut_mid_write_or_too_long_reads_as_unknown():
    shared = new_record(mp.get_context("spawn"))
    record = StepRecord(shared)
    record.begin(["x" * 40] * (RECORD_BYTES // 40))
    assert in_flight(shared) is None
    record.begin(["a"])
    memoryview(shared).cast("B")[0] += 1  # the sequence odd: the core died writing
    assert in_flight(shared) is None
