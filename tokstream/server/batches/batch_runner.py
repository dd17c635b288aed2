"""Runs Message Batches on the server: at most --batch-concurrency of their requests at once,
each exactly as POST /v1/messages would answer it (anthropic_routes.parse and message_body),
submitted in the background tier so that every interactive request goes first. An ended
batch moves to the conversation store (bounded in bytes, the caller's own). With
--batch-dir every batch is on disk too (batch_files.py), and is taken up again at the next
start: what the store evicts or the caller deletes goes from there too."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from tokstream.errors import UserInputError
from tokstream.server.access.tenants import Tenant
from tokstream.server.api.anthropic_routes import message_body, parse
from tokstream.server.api.conversation_store import ConversationStore
from tokstream.server.api_errors import ANTHROPIC, ApiError, ClientGone, bad_request, error_body
from tokstream.server.batches.batch_files import BatchFiles
from tokstream.server.batches.message_batch import BatchItem, MessageBatch
from tokstream.server.server import Server
from tokstream.server.streaming.responses import collect
from tokstream.server.streaming.sse import stream_failure

log = logging.getLogger("tokstream.server")

RETRIED = ("overloaded_error", "rate_limit_error")
"""Refusals a batch request waits out (a full admission queue, a replica down or recovering):
a batch has until it expires, and nobody is waiting on the line."""
MAX_RETRY_WAIT_S = 5.0


class Stopping(Exception):
    """The server is shutting down: a request not yet run is left without a result (on disk,
    the next gateway runs it)."""


def errored(error: ApiError) -> dict:
    return {"type": "errored", "error": error_body(ANTHROPIC, error.error_type, error.message)}


def stored_batch(store: ConversationStore, owner: str, batch_id: str) -> MessageBatch | None:
    record = store.get(owner, batch_id)
    return record.get("message_batch") if record is not None else None


class BatchRunner:
    def __init__(self, server: Server):
        self.server = server
        self.running: dict[str, MessageBatch] = {}
        """Batches not yet ended, by id."""
        self.files = BatchFiles(server.config.batch_dir) if server.config.batch_dir else None
        """Where batches are kept on disk (--batch-dir); None: memory only."""
        self._cancelled: dict[str, asyncio.Event] = {}
        self._slots = asyncio.Semaphore(max(1, server.config.batch_concurrency))
        self._tasks: set[asyncio.Task] = set()
        if self.files is not None:
            server.conversations.on_evict = self._evicted
            self._take_up(self.files.load())

    async def start(self, owner: str, tenant: Tenant | None,
                    items: list[BatchItem]) -> MessageBatch:
        batch = MessageBatch(f"msgbatch_{uuid.uuid4().hex[:24]}", owner, items)
        if self.files is not None:  # written whole before it is answered
            await asyncio.to_thread(self.files.create, batch)
        self._launch(batch, tenant)
        return batch

    def _launch(self, batch: MessageBatch, tenant: Tenant | None) -> None:
        self.running[batch.id] = batch
        self._cancelled[batch.id] = asyncio.Event()
        if batch.cancel_initiated_at is not None:
            self._cancelled[batch.id].set()
        task = asyncio.get_running_loop().create_task(self._run(batch, tenant))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _take_up(self, batches: list[MessageBatch]) -> None:
        """The batches a previous gateway left on disk: ended ones kept, the rest run on."""
        tenants = {t.name: t for t in self.server.tenants.tenants} \
            if self.server.tenants is not None else {}
        for batch in batches:
            if batch.ended_at is not None:
                self._keep(batch)
            else:  # a tenant no longer in the tenants file: its batch runs on as no one's
                self._launch(batch, tenants.get(batch.owner))

    def _keep(self, batch: MessageBatch) -> None:
        """An ended batch into the conversation store; one past its bound is not kept."""
        if not self.server.conversations.put(batch.owner, batch.id, {"message_batch": batch},
                                             batch.size()):
            log.warning("message batch %s: its results (%d bytes) are past "
                        "--conversation-store-bytes and were not kept", batch.id, batch.size())
            if self.files is not None:
                self.files.delete(batch)

    def _evicted(self, owner: str, key: str, record: dict) -> None:
        if "message_batch" in record:
            self.files.delete(record["message_batch"])

    def find(self, owner: str, batch_id: str) -> MessageBatch | None:
        """The caller's batch, running or ended and still kept."""
        batch = self.running.get(batch_id)
        if batch is not None:
            return batch if batch.owner == owner else None
        return stored_batch(self.server.conversations, owner, batch_id)

    def owned(self, owner: str) -> list[MessageBatch]:
        """The caller's batches, newest first."""
        kept = [record["message_batch"] for record in
                self.server.conversations.records(owner) if "message_batch" in record]
        running = [batch for batch in self.running.values() if batch.owner == owner]
        return sorted(running + kept, key=lambda batch: batch.created_at, reverse=True)

    def cancel(self, batch: MessageBatch) -> None:
        """Requests not yet run end as canceled, those running are aborted (canceled too)."""
        if batch.ended_at is None and batch.cancel_initiated_at is None:
            batch.cancel_initiated_at = time.time()
            self._cancelled[batch.id].set()
            if self.files is not None:
                self.files.update(batch)

    def delete(self, batch: MessageBatch) -> None:
        self.server.conversations.delete(batch.owner, batch.id)
        if self.files is not None:
            self.files.delete(batch)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- running ----------------------------------------------------------------------------

    async def _run(self, batch: MessageBatch, tenant: Tenant | None) -> None:
        # Shared: each worker takes the next request without a result (a batch taken up
        # after a restart has some).
        pending = ((i, item) for i, item in enumerate(batch.items) if item.result is None)
        workers = min(len(batch.items), max(1, self.server.config.batch_concurrency))
        await asyncio.gather(*(self._work(batch, tenant, pending) for _ in range(workers)))
        if self.server.draining and batch.request_counts()["processing"]:
            return  # left running: a gateway that has --batch-dir takes it up at its start
        for index, result in batch.settle_the_rest("canceled"):
            if self.files is not None:
                self.files.result(batch, index, result)
        del self._cancelled[batch.id]
        if self.files is not None:
            self.files.update(batch)
        self._keep(batch)
        del self.running[batch.id]

    async def _work(self, batch: MessageBatch, tenant: Tenant | None, pending) -> None:
        for index, item in pending:
            if self._cancelled[batch.id].is_set():  # no slot needed to say so
                self._record(batch, index, {"type": "canceled"})
                continue
            async with self._slots:
                try:
                    result = await self._result(batch, tenant, item.params)
                except Stopping:
                    return
                self._record(batch, index, result)

    def _record(self, batch: MessageBatch, index: int, result: dict) -> None:
        batch.record(batch.items[index], result)
        if self.files is not None:
            self.files.result(batch, index, result)

    async def _result(self, batch: MessageBatch, tenant: Tenant | None, params: dict) -> dict:
        if self._cancelled[batch.id].is_set():
            return {"type": "canceled"}
        if time.time() >= batch.expires_at:
            return {"type": "expired"}
        try:
            return {"type": "succeeded", "message": await self._message(batch, tenant, params)}
        except ClientGone:
            return {"type": "canceled"}
        except Stopping:
            raise
        except ApiError as error:
            return errored(error)
        except UserInputError as error:
            return errored(ApiError("invalid_request_error", str(error)))
        except Exception:  # one request's fault never ends the batch
            log.exception("message batch %s: a request failed", batch.id)
            return errored(ApiError("api_error", "internal server error"))

    async def _message(self, batch: MessageBatch, tenant: Tenant | None, params: dict) -> dict:
        """What POST /v1/messages answers params with; ClientGone if the batch is canceled
        while it runs."""
        if params.get("stream"):
            raise bad_request("stream", "a batch's requests are answered whole, not streamed")
        if "thread" in params:
            raise bad_request("thread", "a server-held thread cannot continue in a batch; send "
                                        "the whole conversation")
        server = self.server
        if server.draining:
            raise Stopping()
        prompt = await asyncio.to_thread(parse, params, server)  # tokenising: off the loop
        cancelled = self._cancelled[batch.id]
        while True:
            if cancelled.is_set():
                raise ClientGone(batch.id)
            try:
                stream = server.submit(f"msg_{uuid.uuid4().hex[:24]}", prompt, tenant,
                                       ANTHROPIC, background=True)
                break
            except ApiError as error:
                if server.draining:
                    raise Stopping() from None
                if error.error_type not in RETRIED or time.time() >= batch.expires_at:
                    raise
                wait = min(MAX_RETRY_WAIT_S, error.retry_after or 1.0)
                try:
                    await asyncio.wait_for(cancelled.wait(), wait)
                except asyncio.TimeoutError:
                    pass

        async def receive() -> dict:  # collect()'s caller: it "leaves" when the batch is canceled
            await cancelled.wait()
            return {"type": "http.disconnect"}

        result = await collect(stream, receive, server.registry)
        failure = stream_failure(stream)
        if failure is not None:
            if server.draining:  # ended by the shutdown: it runs again at the next start
                raise Stopping()
            raise ApiError(*failure)
        return message_body(stream, result, params["model"], server.block_size, prompt.tools)
