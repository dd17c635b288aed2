"""The scheduler: what each step computes (scheduler.py) and its helpers, pure Python, no torch.

Import from the modules (`from tokstream.engine.scheduler.scheduler import Scheduler`): this
file imports none of them, since each imports its siblings and would come back through here.
"""
