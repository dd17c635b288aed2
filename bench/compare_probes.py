"""Probes run on each server before its workload: the raw stream of one request (which SSE
lines it carries) and whether ignore_eos is accepted and honoured."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from compare_servers import MODEL_NAME

def probe_stream(port: int) -> dict:
    """The raw stream of one request shaped as vllm bench serve sends it: which SSE field
    lines the events carry, and whether ignore_eos was honoured (4 tokens asked)."""
    body = json.dumps({"model": MODEL_NAME, "prompt": "The capital of France is",
                       "repetition_penalty": 1.0, "max_tokens": 4, "logprobs": None,
                       "stream": True, "stream_options": {"include_usage": True},
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode("utf-8", "replace")
            status = r.status
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": e.read().decode("utf-8", "replace")[:500]}
    except (urllib.error.URLError, OSError) as e:
        return {"error": str(e)}
    events = [e for e in text.split("\n\n") if e.strip()]
    fields = sorted({line.split(":", 1)[0] for e in events for line in e.splitlines()
                     if line and not line.startswith(":")})
    chunks, usage = [], None
    for e in events:
        for line in e.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                try:
                    data = json.loads(line[6:])
                except ValueError:
                    continue
                if data.get("choices"):
                    chunks.append(data["choices"][0])
                if data.get("usage"):
                    usage = data["usage"]
    return {"status": status, "sse_fields": fields, "events": len(events),
            "choice_chunks": len(chunks),
            "empty_text_chunks": sum(1 for c in chunks if not c.get("text")),
            "completion_tokens": (usage or {}).get("completion_tokens"),
            "ignore_eos_honoured": (usage or {}).get("completion_tokens") == 4,
            "stock_vllm_bench_parser_ok": fields == ["data"] and ": ping" not in text}


# A prompt SmolLM2-Instruct answers in a few tokens then ends (EOS): with ignore_eos it must
# run on to max_tokens. Greedy, so the two answers are comparable.
EOS_PROMPT = ("<|im_start|>user\nWhat is 2+2? Reply with only the number.<|im_end|>\n"
              "<|im_start|>assistant\n")
EOS_PROBE_TOKENS = 48


def probe_ignore_eos(port: int) -> dict:
    """The same greedy request without and with ignore_eos (as vllm bench serve sends it, in the
    body): accepted, and honoured (the answer that stopped early now runs to max_tokens)."""
    out: dict = {"prompt": EOS_PROMPT, "max_tokens": EOS_PROBE_TOKENS}
    for ignore in (False, True):
        body = json.dumps({"model": MODEL_NAME, "prompt": EOS_PROMPT,
                           "max_tokens": EOS_PROBE_TOKENS, "ignore_eos": ignore,
                           "temperature": 0, "repetition_penalty": 1.0,
                           "logprobs": None}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        key = "with_ignore_eos" if ignore else "without"
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                data = json.loads(r.read())
            choice = (data.get("choices") or [{}])[0]
            out[key] = {"status": r.status,
                        "completion_tokens": (data.get("usage") or {}).get("completion_tokens"),
                        "finish_reason": choice.get("finish_reason"),
                        "text": (choice.get("text") or "")[:80]}
        except urllib.error.HTTPError as e:
            out[key] = {"status": e.code, "body": e.read().decode("utf-8", "replace")[:500]}
        except (urllib.error.URLError, OSError, ValueError) as e:
            out[key] = {"error": str(e)}
    without = (out["without"].get("completion_tokens") or 0)
    with_ = out["with_ignore_eos"].get("completion_tokens")
    out["accepted"] = out["with_ignore_eos"].get("status") == 200
    out["honoured"] = with_ == EOS_PROBE_TOKENS
    out["conclusive"] = 0 < without < EOS_PROBE_TOKENS  # the model did stop early without it
    return out
