"""The Messages API's threads (beta `message-threads-2026-08-12`): conversation state the
server holds between turns, which the anthropic SDK's tool runner and `messages.thread()` use
by default.

A request with `thread: {"type": "create"}` is answered as any other, and its conversation
(`system`, `tools`, the messages and the reply) is kept under the reply's id. One with
`{"type": "continue", "previous_message_id": id}` sends only the turn's new messages and no
`system` or `tools`: the thread's come first, as if the whole conversation had been sent, and
the new reply is kept under its own id, for the next turn. A reply may be continued more than
once (each continuation is a conversation of its own).

Threads are kept with the Responses API's stored responses (conversation_store.py): in the
gateway's memory, the tenant's own. An id the server does not hold (never kept, evicted, or
kept by a gateway since restarted) is a 404 whose `error.details.error_code` is
`thread_not_found`, on which the SDK sends the whole history again under a new thread; with
nothing kept at all (--conversation-store-bytes 0) a thread is refused as
`thread_unsupported_request`, on which it can go on without one."""

from __future__ import annotations

from tokstream.server.api.conversation_store import ConversationStore, json_size
from tokstream.server.api_errors import ApiError, bad_request
from tokstream.server.validation import _kind, get_messages, shown

CREATE_ONLY = ("system", "tools")
"""Fields a thread holds from its create: a continue takes them from it, never anew."""


def thread_of(body: dict) -> dict | None:
    """The request's `thread`, checked (None: not threaded)."""
    thread = body.get("thread")
    if thread is None:
        return None
    if not isinstance(thread, dict):
        raise bad_request("thread", f"must be an object, not {_kind(thread)}")
    kind = thread.get("type")
    if kind not in ("create", "continue"):
        raise bad_request("thread.type", f"must be create or continue, got {shown(kind)}")
    if kind == "continue" and not isinstance(thread.get("previous_message_id"), str):
        raise bad_request("thread.previous_message_id", "required: the id of the reply the "
                                                        "thread continues from")
    return thread


def with_thread(body: dict, store: ConversationStore, owner: str) -> dict:
    """The body as the model is to see it: a continue's thread (its system, tools and
    messages so far) before the new messages; any other body as it is."""
    thread = thread_of(body)
    if thread is None:
        return body
    if not store.enabled:
        raise ApiError("invalid_request_error", "thread: this server keeps no conversations "
                       "(--conversation-store-bytes 0); send the whole history",
                       param="thread", details={"error_code": "thread_unsupported_request",
                                                "unsupported": ["thread"]})
    if thread["type"] == "create":
        return body
    repeated = [name for name in CREATE_ONLY if body.get(name) is not None]
    if repeated:
        raise bad_request(repeated[0], "a thread keeps the system and tools it was created "
                                       "with: a continue sends neither")
    previous = thread["previous_message_id"]
    kept = store.get(owner, previous)
    if kept is None or kept.get("kind") != "thread":
        raise ApiError("not_found_error", f"thread.previous_message_id: no thread holds "
                       f"{shown(previous)} (threads are kept in the gateway's memory: send the "
                       "whole history under a new thread)", param="thread",
                       details={"error_code": "thread_not_found"})
    return {**body, **{name: kept[name] for name in CREATE_ONLY if kept[name] is not None},
            "messages": kept["messages"] + get_messages(body)}


def conversation_size(body: dict) -> int:
    """Bytes a threaded turn's conversation takes before its reply (body: as with_thread made
    it), measured where the body is parsed, off the event loop."""
    return json_size([body.get(name) for name in (*CREATE_ONLY, "messages")])


def keep_reply(store: ConversationStore, owner: str, body: dict, size: int, reply_id: str,
               content: list[dict]) -> None:
    """Keep a threaded turn's conversation under its reply's id (body: as with_thread made
    it; size: its conversation_size). Nothing for a request without a thread."""
    if thread_of(body) is None:
        return
    reply = {"role": "assistant", "content": content}
    store.put(owner, reply_id, {
        "kind": "thread", **{name: body.get(name) for name in CREATE_ONLY},
        "messages": body["messages"] + [reply]}, size + json_size(reply))
