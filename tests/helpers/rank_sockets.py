"""Run by tests/test_rank_sockets.py inside a network namespace: start a --tp 2 rank group on
dummy:tiny, generate a few tokens (the ranks talk through gloo meanwhile), and print as JSON
every inet socket of every process under this one (the core is in process here: the ranks
and their forkserver), while they still run."""

import json
import sys

import psutil

sys.path.insert(0, sys.argv[1])  # the tests folder

from test_recovery import GREEDY, PROMPTS, config  # noqa: E402
from tokstream.engine.llm import LLM  # noqa: E402
from tokstream.engine.messages.request import EngineRequest


def sockets() -> list[dict]:
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            connections = process.net_connections(kind="inet")
        except psutil.Error:
            continue
        for c in connections:
            found.append({"pid": process.pid, "status": c.status,
                          "local": c.laddr.ip if c.laddr else None,
                          "remote": c.raddr.ip if c.raddr else None})
    return found


def main() -> None:
    with LLM(config(tp=2)) as llm:
        core = llm.core
        core.add_request(EngineRequest("r", PROMPTS[0], GREEDY))
        tokens = 0
        while tokens < 3:
            tokens += sum(len(d.token_ids) for d in core.step())
        print(json.dumps({"ranks": core.executor.pids, "sockets": sockets()}))


if __name__ == "__main__":
    main()
