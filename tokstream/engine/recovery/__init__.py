"""The engine core's side of recovery: what it does when its rank group fails, and the KV pool
that outlives the ranks so that a restart need not re-prefill. No torch.

- core_recovery.py: CoreRecovery, the one object the core holds: the replica's status, the
  restart, a request that keeps breaking the ranks, going down and coming back, the
  bookkeeping self-check, and their counters and pending deltas.
- pool_files.py: the memory files the ranks' pools live in (held by the gateway, or the core).
- block_index.py: which pool blocks hold which cached prefix, in a file beside them.
- pool_adoption.py: a core's claim on that index (after another core died).

The gateway's side is tokstream/server/replica/recovery.py. Nothing is imported here: the
executor and the gateway import pool_files alone.
"""
