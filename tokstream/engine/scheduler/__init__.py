"""The scheduler: what each step computes, pure Python, no torch.

- scheduler.py: Scheduler, the loop's schedule() -> update(); finish, restarts, self-check.
- step_draft.py: the step being built (StepDraft) and its prefill time (PrefillTime).
- prefill_policy.py: whose prefill a step carries and how much (PrefillPolicy: chunk sizes,
  the ITL target, the two latency classes, long prefills in steps of their own).
- admission.py, preemption.py: the waiting pass, and room made in a dry pool.
- waiting_queue.py, fairness.py: the order waiting requests start in (tenants' counters).
- step_cost.py: what a step costs, learned online; output.py: the finished step
  (SchedulerOutput) and the plan the workers receive.

Import from the modules (`from tokstream.engine.scheduler.scheduler import Scheduler`): this
file imports none of them, since each imports its siblings, and through this file it would
import itself (tests/test_import_graph.py).
"""
