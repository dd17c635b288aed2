"""One streamed request, timed token by token and checked for integrity.

Plain httpx, so the same code runs under Locust's gevent (sockets patched) and in tests. It
returns a sample: plain data that goes into report.json as is.
"""

from __future__ import annotations

import json
import time

import httpx

from tokstream.checker import OPT_IN, SSERecorder, check_stream
from tokstream.loadgen.options import ROUTES


def request_body(api: str, model: str, user: str, system: str | None, max_tokens: int,
                 temperature: float, ignore_eos: bool) -> dict:
    if api == "responses":  # a load test leaves nothing stored behind
        return {"model": model, "max_output_tokens": max_tokens, "stream": True,
                "temperature": temperature, "ignore_eos": ignore_eos, "store": False,
                "input": user, **({"instructions": system} if system is not None else {})}
    body = {"model": model, "max_tokens": max_tokens, "stream": True,
            "temperature": temperature, "ignore_eos": ignore_eos}
    messages = [{"role": "user", "content": user}]
    if api == "anthropic":
        if system is not None:
            body["system"] = system
    else:
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        body["stream_options"] = {"include_usage": True}
    body["messages"] = messages
    return body


def auth_headers(api: str, key: str | None) -> dict:
    """The key, and the integrity framing (id: lines) the demux check reads: tokstream frames
    streams as the API it imitates unless a request asks."""
    if key is None:
        return dict(OPT_IN)
    return {**OPT_IN, **({"x-api-key": key} if api == "anthropic"
                         else {"authorization": f"Bearer {key}"})}


def _tokens_of(data: dict) -> int:
    ext = data.get("tokstream")
    return len(ext.get("token_ids") or []) if isinstance(ext, dict) else 0


def _usage(api: str, data: dict, usage: dict) -> None:
    """Fold one event's usage into {"input_tokens", "output_tokens"}."""
    if api == "anthropic":
        found = (data.get("message") or {}).get("usage") if data.get("type") == "message_start" \
            else data.get("usage")
        if isinstance(found, dict):
            if found.get("input_tokens") is not None:  # the Messages API splits the prompt:
                usage["input_tokens"] = found["input_tokens"] + sum(  # uncached + cache
                    found.get(k) or 0 for k in ("cache_read_input_tokens",
                                                "cache_creation_input_tokens"))
            if found.get("output_tokens") is not None:
                usage["output_tokens"] = found["output_tokens"]
    elif api == "responses":
        found = (data.get("response") or {}).get("usage")
        if isinstance(found, dict):  # on the final event only
            usage["input_tokens"] = found.get("input_tokens")
            usage["output_tokens"] = found.get("output_tokens")
    elif isinstance(data.get("usage"), dict):
        usage["input_tokens"] = data["usage"].get("prompt_tokens")
        usage["output_tokens"] = data["usage"].get("completion_tokens")


def _error_type(response_body: bytes, status: int) -> tuple[str, str]:
    try:
        error = json.loads(response_body).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict):
        return str(error.get("type") or f"http_{status}"), str(error.get("message", ""))[:300]
    return f"http_{status}", response_body[:300].decode("utf-8", "replace")


def new_sample(status: str = "error", error_type: str | None = None) -> dict:
    return {"status": status, "error_type": error_type, "error_message": None,
            "http_status": None, "sent_s": time.time(), "event_times_s": [], "event_tokens": [],
            "end_s": None, "input_tokens": None, "output_tokens": None, "tokens_counted": 0,
            "integrity": [], "finish_reason": None, "request_id": None}


def stream_request(client: httpx.Client, base_url: str, api: str, body: dict,
                   headers: dict, timeout_s: float) -> dict:
    """Send one streaming request and read it to its end, timing every token-carrying event.

    Returns the sample fields this layer knows: status (ok|error), error_type, http_status,
    sent_s (wall clock), ttft/itl/tpot/e2e inputs (event_times_s relative to sent),
    event_tokens, usage, tokens_counted, integrity problems, finish reason."""
    sample = new_sample()
    usage: dict = {}
    recorder = SSERecorder()
    start = time.perf_counter()
    deadline = start + timeout_s
    try:
        with client.stream("POST", base_url + ROUTES[api], json=body, headers=headers) as response:
            sample["http_status"] = response.status_code
            if response.status_code != 200:
                sample["error_type"], sample["error_message"] = _error_type(
                    response.read(), response.status_code)
                sample["end_s"] = time.perf_counter() - start
                return sample
            for chunk in response.iter_raw():
                now = time.perf_counter() - start
                for event in recorder.feed(chunk):
                    if event.event == "ping" or event.data.startswith("[DONE]"):
                        continue
                    try:
                        data = json.loads(event.data)
                    except ValueError:
                        continue  # the checker reports it as malformed
                    if not isinstance(data, dict):
                        continue
                    _usage(api, data, usage)
                    tokens = _tokens_of(data)
                    if tokens:
                        sample["event_times_s"].append(now)
                        sample["event_tokens"].append(tokens)
                if now + start > deadline:
                    raise TimeoutError(f"no end after {timeout_s:g} s")
    except (httpx.HTTPError, TimeoutError, OSError) as error:
        sample["error_type"] = "timeout" if isinstance(error, (httpx.TimeoutException,
                                                               TimeoutError)) \
            else "connection_error"
        sample["error_message"] = f"{type(error).__name__}: {error}"[:300]
    sample["end_s"] = time.perf_counter() - start
    _finish(sample, recorder, usage)
    return sample


def _finish(sample: dict, recorder: SSERecorder, usage: dict) -> None:
    """Classify the stream with the integrity checker and compare usage with what we counted."""
    report = check_stream(recorder.stream())
    sample["request_id"] = report.request_id
    sample["finish_reason"] = report.finish_reason
    sample["tokens_counted"] = len(report.received)
    sample["input_tokens"] = usage.get("input_tokens")
    sample["output_tokens"] = usage.get("output_tokens")
    problems = [{"kind": kind, "detail": detail} for kind, detail in report.problems]
    if report.status == "complete":
        if sample["output_tokens"] != len(report.received):
            problems.append({"kind": "usage_mismatch",
                             "detail": f"usage says {sample['output_tokens']} output tokens, "
                                       f"{len(report.received)} received"})
        if sample["error_type"] is None:
            sample["status"] = "ok"
    elif report.status == "failed":
        error = report.error or {}
        sample["error_type"] = sample["error_type"] or str(error.get("type", "stream_error"))
        sample["error_message"] = sample["error_message"] or str(error.get("message", ""))[:300]
    elif sample["error_type"] is None:
        sample["error_type"] = "cut"  # the server closed the stream without ending it
    elif sample["error_type"] == "timeout":
        # We gave up on it: that it never ended is our doing, not the server's.
        problems = [p for p in problems if p["kind"] != "never_ended"]
    sample["integrity"] = problems
