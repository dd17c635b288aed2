"""The scheduler as it was before issue 33 item 2 (commit 926035e): scheduler.py, admission.py,
preemption.py, prefill_share.py and step_draft.py as they were, their imports pointed here or
at the modules that only moved (output.py was scheduled.py). tests/test_scheduler_equal_to_old.py
drives it beside tokstream.engine.scheduler and asserts every step is the same. One change
since, made in both: admission marks what it starts as given work (StepDraft.scheduled), so the
same step's preemption never picks it (test_scheduler_admitted_then_preempted.py). Delete this
folder and that test the day the scheduler's behaviour is changed on purpose again."""
