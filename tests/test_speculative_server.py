"""`tokstream serve --speculative ngram` end to end (issue 34 items 4 and 5): the flags reach
the engine, streams whose steps carry several tokens each pass the integrity checker (every
token once, in order, the engine's digest), and /metrics and /v1/state count the drafts."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.serving import ServerProcess, openai_body, record
from tokstream.checker import check_streams

pytestmark = [pytest.mark.startup, pytest.mark.timeout(240)]

COPY = "repeat after me: " + "the cat sat on the mat and the dog sat on the log " * 4


def metric(url: str, sample: str, **labels) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == sample and labels.items() <= s.labels.items())


def test_streams_with_drafts_are_whole_and_the_drafts_are_counted():
    with ServerProcess("--model", "dummy:tiny", "--speculative", "ngram",
                       "--num-speculative-tokens", "3") as server:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            streams = [record(client, "/v1/chat/completions",
                              openai_body(COPY, max_tokens=64, temperature=0,
                                          ignore_eos=True))[1] for _ in range(2)]
            whole = client.post("/v1/chat/completions", json=openai_body(
                COPY, max_tokens=64, stream=False, temperature=0, ignore_eos=True)).json()
        report = check_streams(streams)
        assert report.ok and report.statuses["complete"] == 2, report.summary()
        first, second = report.streams
        assert len(first.token_ids) == 64 and first.token_ids == second.token_ids
        assert whole["choices"][0]["message"]["content"] == first.text
        state = server.wait_idle()
        spec = state["speculation"]
        assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 3
        assert 0 < spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
        assert metric(server.url, "vllm:spec_decode_num_accepted_tokens_total") == \
            spec["num_accepted_tokens"]
        assert metric(server.url, "vllm:spec_decode_num_draft_tokens_total") == \
            spec["num_draft_tokens"]
        assert metric(server.url, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                      position="0") == spec["accepted_per_position"][0] > 0


def test_a_live_request_row_shows_its_drafts():
    with ServerProcess("--model", "dummy:tiny", "--speculative", "ngram") as server:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            body = openai_body(COPY, max_tokens=1700, temperature=0, ignore_eos=True)
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200, response.read()
                lines = response.iter_lines()
                for _ in range(6):  # some tokens out: it has drafted (1,700 to go)
                    next(lines)
                rows = [row for row in server.state()["requests"] if row["state"] == "running"]
            # Leaving the stream cancels the request.
        assert len(rows) == 1 and 0 < rows[0]["accepted_tokens"] <= rows[0]["draft_tokens"]
        server.wait_idle()
    with ServerProcess("--model", "dummy:tiny", "--speculative", "off") as server:
        assert server.state()["speculation"]["method"] == "off"
