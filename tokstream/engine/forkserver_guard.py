"""Imported first by the ranks' forkserver (rank_start.RANK_PRELOAD): it becomes a child like
the core and the ranks (child_process), so the kernel kills it when its engine core dies, even
while it is stopped or busy, and it leaves SIGTERM to the core. multiprocessing starts the
forkserver itself; a preloaded module is the one hook into that process, so this acts only
where rank_start set GUARD_ENV for the forkserver's start (any other importer is left alone).
"""

import os

from tokstream.engine.child_process import become_child

GUARD_ENV = "TOKSTREAM_RANK_FORKSERVER"

if os.environ.pop(GUARD_ENV, None) == str(os.getppid()):
    become_child()
