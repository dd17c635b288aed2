"""bench/spec_bench.py and its spec_* modules without servers: the prompt mixes, a stream read
with a hand-driven clock, the figures and targets from synthetic timings, the JSON's shape."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import spec_bench  # noqa: E402
import spec_figures  # noqa: E402
import spec_measure  # noqa: E402
import spec_servers  # noqa: E402
import spec_workload  # noqa: E402
from spec_measure import RequestTiming  # noqa: E402


def test_copy_prompts_carry_their_source_and_free_prompts_none():
    sources = (spec_workload.HARBOUR, spec_workload.GARDEN, spec_workload.BRIDGE,
               spec_workload.ORDER)
    copy, free = spec_workload.MIXES["copy"], spec_workload.MIXES["free"]
    assert {p.task for p in copy} == {"repeat", "edit", "extract"}
    assert {p.task for p in free} == {"story", "explain"}
    for p in copy:
        assert any(text in p.user for text in sources), p.name
    for p in free:
        assert not any(text[:40] in p.user for text in sources), p.name
    names = [p.name for p in copy + free + spec_workload.WARMUP]
    assert len(names) == len(set(names)) and len(copy) >= 3 and len(free) >= 3
    body = spec_measure.request_body(copy[0], 128, ignore_eos=False)
    assert body["temperature"] == 0 and body["stream"] and "ignore_eos" not in body
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": copy[0].user}]


def sse(*chunks) -> list[str]:
    return [line for c in chunks for line in (f"data: {json.dumps(c)}", "")] + ["data: [DONE]"]


def delta(text, finish=None):
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


def test_a_stream_is_timed_from_its_first_to_its_last_text_chunk_per_usage_token():
    ticks = iter([1.0, 1.1, 1.4])  # the clock at each text chunk
    lines = ["id: 1"] + sse(delta("A"), delta("BC"), delta(""), delta("D"),
                            delta("", "stop"), {"choices": [], "usage": {"completion_tokens": 7}})
    t = spec_measure.read_stream(lines, RequestTiming("p", sent_s=0.5), clock=lambda: next(ticks))
    assert (t.first_s, t.last_s, t.chunks, t.tokens, t.tokens_from) == (1.0, 1.4, 3, 7, "usage")
    assert t.finish_reason == "stop" and t.ttft_s == 0.5
    assert abs(t.tpot_s - 0.4 / 6) < 1e-12
    # llama-server: usage and timings on the last choice chunk; no usage at all -> chunks.
    last = dict(delta("E", "length"), usage={"completion_tokens": 3},
                timings={"draft_n": 8, "draft_n_accepted": 5})
    ticks = iter([2.0, 2.5])
    t = spec_measure.read_stream(sse(delta("x"), last), RequestTiming("p", 1.0),
                                 lambda: next(ticks))
    assert t.tokens == 3 and t.server_draft == {"draft_n": 8, "draft_n_accepted": 5}
    ticks = iter([2.0, 2.5])
    t = spec_measure.read_stream(sse(delta("x"), delta("y")), RequestTiming("p", 1.0),
                                 lambda: next(ticks))
    assert (t.tokens, t.tokens_from, t.tpot_s) == (2, "chunks", 0.5)


def timing(first, last, tokens, error=None) -> RequestTiming:
    return RequestTiming("p", sent_s=0.0, first_s=first, last_s=last, tokens=tokens,
                         chunks=tokens, error=error)


def test_a_run_is_summarised_by_the_median_time_per_token():
    runs = [timing(0.1, 1.1, 11), timing(0.2, 4.2, 21), timing(0.3, 0.9, 4),
            timing(0.1, 0.1, 1), timing(None, None, 0, error="HTTP 500")]
    s = spec_measure.summarize(runs, wall_s=5.0, streams=2)
    assert (s["completed"], s["failed"], s["errors"]) == (4, 1, ["HTTP 500"])
    assert abs(s["tpot_ms_median"] - 200.0) < 1e-9  # of 100, 200, 200 ms; 1 token: none
    assert s["output_tokens"] == 37 and abs(s["output_tok_per_s"] - 7.4) < 1e-9


def test_spec_counters_of_vllm_and_llama_cpp_pages():
    vllm = ('vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0\n'
            'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 30.0\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9.0\n'
            "vllm:spec_decode_num_drafts_total 10\n")
    llama = "# HELP x\nllamacpp:spec_decode_num_draft_tokens_total 4\n" \
            "llamacpp:spec_decode_num_accepted_tokens_total 1\n"
    assert spec_measure.spec_counters(vllm) == {"draft_tokens": 40.0, "accepted_tokens": 30.0,
                                                "drafts": 10.0}
    before = spec_measure.spec_counters(llama)
    after = {"draft_tokens": 24.0, "accepted_tokens": 16.0, "drafts": 5.0}
    d = spec_measure.counter_delta(before, after)
    assert d["draft_tokens"] == 20 and d["acceptance_rate"] == 0.75
    assert spec_measure.spec_counters("tokstream_engine_steps 3\n") == {}
    assert spec_measure.counter_delta({}, after) == {}


def variant(copy_1, free_1, free_8_tps, copy_8_tps=100.0) -> dict:
    def run(tpot, tps):
        return {"tpot_ms_median": tpot, "output_tok_per_s": tps}
    return {"runs": {"copy": {"1": run(copy_1, 1000 / copy_1), "8": run(20.0, copy_8_tps)},
                     "free": {"1": run(free_1, 1000 / free_1), "8": run(25.0, free_8_tps)}}}


def test_figures_and_targets_from_synthetic_variants():
    servers = {"tokstream": {"defaults_variant": "auto", "variants": {
                   "off": variant(10.0, 10.0, 100.0), "ngram": variant(4.0, 10.5, 95.0),
                   "auto": variant(4.5, 10.0, 98.0)}},
               "vllm": {"variants": {"ngram": variant(5.0, 10.0, 90.0)}}}
    figures = spec_figures.derive(servers, [1, 8])
    ratios = figures["copy_over_free_tpot_1_stream"]
    assert ratios["tokstream/off"] == 1.0 and ratios["tokstream/auto"] == 0.45
    assert abs(ratios["tokstream/ngram"] - 4.0 / 10.5) < 1e-12
    assert "vllm/ngram" not in figures["over_off"]  # no vllm/off measured to compare with
    ngram = figures["over_off"]["tokstream/ngram"]
    assert ngram["free"]["1"]["tpot"] == 1.05 and ngram["free"]["8"]["throughput"] == 0.95
    assert ngram["copy"]["1"]["tpot"] == 0.4
    goals = spec_figures.targets(figures, "auto", [1, 8])
    assert goals["evaluated_on"] == "tokstream/auto"
    assert goals["copy_over_free_1_stream"]["met"] is True
    assert goals["free_throughput_over_off_8_streams"]["met"] is True  # 0.98 >= 0.97
    assert "32-stream" in goals["not_measured"]
    goals = spec_figures.targets(figures, "ngram", [1, 8])
    assert goals["copy_over_free_1_stream"]["met"] is True
    assert goals["free_throughput_over_off_8_streams"]["met"] is False  # 0.95
    assert spec_figures.targets(figures, "off", [1, 8])["copy_over_free_1_stream"]["met"] is False


HELP = """\
╭─ speculative options ──────────────────────────────────────────────────────╮
│ --speculative                   <str>  off, or ngram: drafts copied from   │
│                                        the prompt. [default: (off)]        │
│ --num-speculative-tokens        <int>  Most tokens drafted (ngram).        │
╰────────────────────────────────────────────────────────────────────────────╯
"""


def test_speculative_modes_from_serve_help_and_variant_arguments():
    assert spec_servers.speculative_modes(HELP) == (["off", "ngram"], "off")
    with_auto = HELP.replace("off, or ngram:", "off, ngram or auto:").replace("(off)", "(auto)")
    assert spec_servers.speculative_modes(with_auto) == (["off", "ngram", "auto"], "auto")
    assert spec_servers.tokstream_variant_args("ngram", 3) == [
        "--speculative", "ngram", "--num-speculative-tokens", "3"]
    assert spec_servers.tokstream_variant_args("auto", 3)[:2] == ["--speculative", "auto"]
    assert spec_servers.tokstream_variant_args("off", 3) == ["--speculative", "off"]
    assert spec_servers.tokstream_variant_args("k8=--speculative ngram --x 8", 4) == [
        "--speculative", "ngram", "--x", "8"]
    cfg = json.loads(spec_servers.vllm_variant_args("ngram", 4)[1])
    assert cfg["method"] == "ngram" and cfg["num_speculative_tokens"] == 4
    assert spec_servers.vllm_variant_args("off", 4) == []
    assert "--spec-type" in spec_servers.llamacpp_variant_args("ngram", 4, 3)
    assert spec_servers.llamacpp_ngram_absent("--spec-type none,ngram-simple") is None
    assert spec_servers.llamacpp_ngram_absent("--draft-max N") is not None


def test_the_json_has_its_fields_and_serialises(tmp_path):
    args = spec_bench.parse_args(["--quick", "--only", "tokstream"])
    report = spec_bench.report_skeleton(args, str(tmp_path))
    report["servers"]["tokstream"] = {"defaults_variant": "off", "absent": {"auto": "no"},
                                      "variants": {"off": dict(variant(10.0, 10.0, 100.0),
                                                               loadavg_before=[0.2, 0, 0],
                                                               quiet=True)}}
    report = spec_bench.finish(report, args, started=0.0)
    text = json.dumps(report)
    for key in ("cpu_kind", "host", "workload", "prompts", "servers", "figures", "targets",
                "loadavg_before_each", "quiet", "absent", "command"):
        assert key in report, key
    assert report["host"]["kernel_flags"] and report["cpu_kind"] in text
    assert report["loadavg_before_each"] == {"tokstream/off": 0.2} and report["quiet"]
    assert report["absent"] == {"tokstream/auto": "no"}
    assert report["targets"]["per_tokstream_variant"]["off"]["copy_over_free_1_stream"]["met"] \
        is False
    assert report["workload"]["streams"] == [1, 4] and report["workload"]["max_tokens"] == 32
    assert "| tokstream/off | copy | 1 | 10.0 |" in spec_figures.table(report)
