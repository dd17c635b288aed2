"""Prometheus metrics: vLLM's names where vLLM has one (dashboards and Kubernetes inference
gateways already read them), `tokstream_*` for the rest. One registry per server, so two
servers in one process never collide.

Latency histograms and token counters are updated by the gateway as tokens pass the demux;
engine-side values (running, waiting, KV blocks, preemptions) come from the core's state
snapshot: a scrape asks for a fresh one but waits at most SCRAPE_WAIT_S for a busy core (it
answers between steps), then serves the last one; the refresh lands for the next scrape.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokstream.core_state import CoreSnapshot, Kv, LastStep, Speculation
from tokstream.engine.messages.request import FinishReason
from tokstream.state_snapshot import ReplicaStatus

SCRAPE_WAIT_S = 0.05
"""Longest a /metrics scrape waits for the core's newer snapshot (an idle core answers in about
a millisecond; one in a long step would hold the endpoint picker's 50 ms poll)."""

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0,
                    120.0, 300.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000)


class EngineCollector:
    """Engine-side gauges and counters from the latest core snapshot."""

    def __init__(self, model: str):
        self.model = model
        self.snapshot: dict | None = None
        self.status = "starting"

    def collect(self):
        labels = ["model_name"]
        snap = CoreSnapshot.from_wire(self.snapshot or {})
        kv = snap.kv or Kv()

        def gauge(name, doc, value):
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric([self.model], value)
            return family

        def counter(name, doc, value):
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric([self.model], value)
            return family

        yield gauge("vllm:num_requests_running", "Requests in the running batch.",
                    snap.running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting in the engine.", snap.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", kv.usage)
        yield counter("vllm:num_preemptions", "Preemptions (recompute).", snap.num_preemptions)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries (tokens).",
                      kv.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits (tokens).",
                      kv.prefix_cache_hits)
        yield from self._speculation(snap.speculation or Speculation())
        blocks = GaugeMetricFamily("tokstream_kv_blocks", "KV blocks by state.",
                                   labels=["model_name", "state"])
        for state, count in (("used", kv.used_blocks), ("free", kv.free_blocks),
                             ("cached", kv.cached_blocks)):
            blocks.add_metric([self.model, state], count)
        yield blocks
        if kv.block_size:
            # The endpoint picker's prefix scorer reads the pool's geometry from these labels
            # (the Gateway API inference extension's model-server protocol); value always 1.
            info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration.",
                                     labels=["model_name", "block_size", "num_gpu_blocks"])
            info.add_metric([self.model, str(kv.block_size), str(kv.num_blocks)], 1)
            yield info
        yield gauge("tokstream_kv_blocks_total", "KV blocks in the pool.", kv.num_blocks)
        last = snap.last_step or LastStep()
        yield gauge("tokstream_last_step_seconds", "Duration of the latest engine step.",
                    (last.step_ms or 0.0) / 1000)
        yield counter("tokstream_engine_steps", "Engine steps run.", snap.step_id)
        status = GaugeMetricFamily("tokstream_replica_status", "1 for the replica's status.",
                                   labels=["model_name", "status"])
        for name in ("starting", *(status.value for status in ReplicaStatus)):
            status.add_metric([self.model, name], 1.0 if self.status == name else 0.0)
        yield status


    def _speculation(self, spec: Speculation):
        """vLLM's spec_decode counters (all zero while speculation is off)."""
        for name, doc, value in (
                ("vllm:spec_decode_num_drafts", "Decodes that carried drafted tokens.",
                 spec.num_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Tokens drafted.", spec.num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted.",
                 spec.num_accepted_tokens)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model], value)
            yield family
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Drafted tokens accepted, by draft position (0 first).",
            labels=["model_name", "position"])
        for position, count in enumerate(spec.accepted_per_position):
            per_position.add_metric([self.model, str(position)], count)
        yield per_position


class Metrics:
    def __init__(self, model: str):
        self.model = model
        self.registry = CollectorRegistry()
        r = self.registry

        def per_model(kind, name, doc, **options):
            """A series of this replica's model (model_name label, as vLLM's)."""
            return kind(name, doc, ["model_name"], registry=r, **options).labels(model)

        self.ttft = per_model(Histogram, "vllm:time_to_first_token_seconds",
                              "Time to first token.", buckets=TTFT_BUCKETS)
        self.itl = per_model(Histogram, "vllm:inter_token_latency_seconds",
                             "Gap between output tokens.", buckets=ITL_BUCKETS)
        self.e2e = per_model(Histogram, "vllm:e2e_request_latency_seconds",
                             "Arrival to last token.", buckets=E2E_BUCKETS)
        self.queue = per_model(Histogram, "vllm:request_queue_time_seconds",
                               "Arrival to first scheduling in the engine.", buckets=E2E_BUCKETS)
        self.prompt_tokens = per_model(Counter, "vllm:prompt_tokens",
                                       "Prompt tokens of finished and running requests.")
        self.generation_tokens = per_model(Counter, "vllm:generation_tokens",
                                           "Output tokens delivered.")
        self.success = Counter("vllm:request_success", "Requests finished, by reason.",
                               ["model_name", "finished_reason"], registry=r)
        self.request_prompt_tokens = per_model(Histogram, "vllm:request_prompt_tokens",
                                               "Prompt tokens per finished request.",
                                               buckets=TOKEN_BUCKETS)
        self.request_generation_tokens = per_model(Histogram, "vllm:request_generation_tokens",
                                                   "Output tokens per finished request.",
                                                   buckets=TOKEN_BUCKETS)
        self.prefill_time = per_model(Histogram, "vllm:request_prefill_time_seconds",
                                      "First scheduling to first token.", buckets=E2E_BUCKETS)
        self.decode_time = per_model(Histogram, "vllm:request_decode_time_seconds",
                                     "First token to last token.", buckets=E2E_BUCKETS)
        self.tenant_tokens = Counter("tokstream_tenant_tokens", "Tokens per tenant.",
                                     ["tenant", "kind"], registry=r)
        self.errors = Counter("tokstream_errors", "Error responses and error events, by type.",
                              ["type"], registry=r)
        self.cancels = Counter("tokstream_cancelled_requests",
                               "Requests the gateway cancelled, by reason.", ["reason"],
                               registry=r)
        self.live = Gauge("tokstream_live_streams", "Requests the gateway is serving.",
                          registry=r)
        self.stored = Gauge("tokstream_stored_conversations", "Conversations kept: stored "
                            "Responses API responses and Messages API thread replies.",
                            registry=r)
        self.stored_bytes = Gauge("tokstream_stored_conversation_bytes",
                                  "Bytes they take (--conversation-store-bytes bounds it).",
                                  registry=r)
        self.batches = Gauge("tokstream_message_batches_running",
                             "Message Batches not yet ended.", registry=r)
        self.batch_requests = Gauge("tokstream_message_batch_requests",
                                    "The running Message Batches' requests, by state "
                                    "(processing, succeeded, errored, canceled, expired).",
                                    ["state"], registry=r)
        # kind: rank (the core replaced its rank group) or core (the gateway replaced the
        # engine core process).
        self.restarts = Counter("tokstream_restarts", "Replica restarts, by kind.", ["kind"],
                                registry=r)
        self.resumed = Counter("tokstream_resumed_requests", "Requests resumed (re-prefilled "
                               "from prompt + delivered tokens) after a restart, by kind.",
                               ["kind"], registry=r)
        self.recovery = Histogram("tokstream_recovery_seconds", "From a failure seen to the "
                                  "replica serving again, by kind.", ["kind"],
                                  buckets=RECOVERY_BUCKETS, registry=r)
        for kind in ("rank", "core"):  # both series exist from the start, at zero
            self.restarts.labels(kind)
            self.resumed.labels(kind)
            self.recovery.labels(kind)
        self.engine = EngineCollector(model)
        r.register(self.engine)

    def on_restart(self, kind: str, seconds: float | None, resumed: int) -> None:
        self.restarts.labels(kind).inc()
        self.resumed.labels(kind).inc(resumed)
        if seconds is not None:
            self.recovery.labels(kind).observe(seconds)

    def on_first_token(self, stream, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_token_gap(self, gap_s: float) -> None:
        self.itl.observe(gap_s)

    def on_tokens(self, stream, n: int) -> None:
        self.generation_tokens.inc(n)
        if stream.tenant is not None:
            self.tenant_tokens.labels(stream.tenant, "generation").inc(n)

    def on_admit(self, stream) -> None:
        self.prompt_tokens.inc(stream.num_prompt_tokens)
        if stream.tenant is not None:
            self.tenant_tokens.labels(stream.tenant, "prompt").inc(stream.num_prompt_tokens)

    def on_finish(self, stream, delta, e2e_s: float) -> None:
        if delta.finish_reason == FinishReason.ERROR:
            self.errors.labels("api_error").inc()
            return
        self.success.labels(self.model, delta.finish_reason).inc()
        self.e2e.observe(e2e_s)
        if delta.queue_s is not None:
            self.queue.observe(delta.queue_s)
        self.request_prompt_tokens.observe(stream.num_prompt_tokens)
        self.request_generation_tokens.observe(delta.num_output_tokens)
        if stream.first_token_time is not None:
            ttft_s = stream.first_token_time - stream.arrival
            # queue_s is the engine's clock and TTFT the gateway's: never below zero.
            self.prefill_time.observe(max(ttft_s - (delta.queue_s or 0.0), 0.0))
            self.decode_time.observe(max(e2e_s - ttft_s, 0.0))

    def render(self, tenants: bool = True) -> bytes:
        """The exposition; tenants=False leaves out every sample that names a tenant (what a
        caller without the metrics key may read under --public-load-metrics)."""
        text = generate_latest(self.registry)
        if tenants:
            return text
        return b"".join(line for line in text.splitlines(keepends=True)
                        if b'tenant="' not in line)
