"""Message Batches on disk (--batch-dir), so that they outlive the gateway: a batch that was
running goes on where it stopped (its requests without a result run again: a result is
written only once it is whole), and an ended one keeps its results until it is deleted.

One folder a batch, owner-only: `batch.json` (id, owner, times; rewritten whole by a rename),
`requests.jsonl` (custom_id and params, one line a request, written once) and
`results.jsonl` (index and result, one line each, appended as each comes in: a line torn by a
crash is its request's result lost, and that request runs again)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from tokstream.server.batches.message_batch import BatchItem, MessageBatch

BATCH_ID = re.compile(r"msgbatch_[0-9a-f]{24}")
"""The only folder names read back (what batch_runner names batches)."""


def _write_json(path: Path, value) -> None:
    temporary = path.with_suffix(".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        json.dump(value, file, ensure_ascii=False)
    os.replace(temporary, path)


def _lines(path: Path) -> list[dict]:
    """The file's whole JSON lines (a torn last line is left out)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").split("\n"):
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class BatchFiles:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)

    def create(self, batch: MessageBatch) -> None:
        folder = self.root / batch.id
        folder.mkdir(mode=0o700)
        fd = os.open(folder / "requests.jsonl", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            for item in batch.items:
                file.write(json.dumps({"custom_id": item.custom_id, "params": item.params},
                                      ensure_ascii=False) + "\n")
        self.update(batch)

    def update(self, batch: MessageBatch) -> None:
        """Its times (created, cancel initiated, ended)."""
        _write_json(self.root / batch.id / "batch.json",
                    {"id": batch.id, "owner": batch.owner, "created_at": batch.created_at,
                     "cancel_initiated_at": batch.cancel_initiated_at,
                     "ended_at": batch.ended_at})

    def result(self, batch: MessageBatch, index: int, result: dict) -> None:
        line = json.dumps({"index": index, "result": result}, ensure_ascii=False) + "\n"
        fd = os.open(self.root / batch.id / "results.jsonl",
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, line.encode())  # one write: a crash tears at most this line
        finally:
            os.close(fd)

    def delete(self, batch: MessageBatch) -> None:
        shutil.rmtree(self.root / batch.id, ignore_errors=True)

    def load(self) -> list[MessageBatch]:
        """Every whole batch under the folder, oldest first, with the results it has."""
        batches = []
        for folder in self.root.iterdir():
            head = folder / "batch.json"
            if not (BATCH_ID.fullmatch(folder.name) and head.exists()):
                continue  # not one of ours, or its creation did not finish
            meta = json.loads(head.read_text(encoding="utf-8"))
            items = [BatchItem(line["custom_id"], line["params"])
                     for line in _lines(folder / "requests.jsonl")]
            batch = MessageBatch(meta["id"], meta["owner"], items,
                                 created_at=meta["created_at"],
                                 cancel_initiated_at=meta["cancel_initiated_at"],
                                 ended_at=meta["ended_at"])
            for line in _lines(folder / "results.jsonl"):
                item = items[line["index"]]
                if item.result is None:
                    batch.record(item, line["result"])
            batches.append(batch)
        return sorted(batches, key=lambda batch: batch.created_at)
