"""The core's Prometheus metrics: what the pipeline counts, and the `/metrics` HTTP server.

Counting stays off the per-token path: the pipeline's Jobs update `RequestMetrics` once per
engine step that gave a request tokens (TTFT or inter-token latency) and once when a request
ends (tokens, finish reason, queue time, end-to-end latency). Everything runs on the event loop
thread, so the counts are plain attributes and the histograms plain lists (`Buckets`), without
the lock prometheus_client's own metric objects take on every update. Gauges (running and
waiting requests, batch size, slot usage, session store, the prefix cache's blocks) and the
prefix cache's counters are read from the engine and the session store when Prometheus
scrapes, so they cost nothing while serving. `CoreCollector` turns both into metric families
for prometheus_client, which renders the exposition format and serves it (`serve_metrics`,
its own HTTP server thread).

Names: every metric is `trellis_core_*`. The three gauges the Kubernetes Gateway API Inference
Extension's endpoint picker reads are also exported under vLLM's names
(`vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`), its
default model-server protocol, so an InferencePool needs no per-engine mapping (docs/metrics.md);
so are the prefix cache's counters (`vllm:prefix_cache_queries_total`,
`vllm:prefix_cache_hits_total`, vllm/v1/metrics/loggers.py), which dashboards built for vLLM
divide for the hit rate.

Histogram bucket edges are vLLM's (vllm/v1/metrics/loggers.py, release 0.10/0.11:
`vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`, and the request latency
buckets of `vllm:e2e_request_latency_seconds` and `vllm:request_queue_time_seconds`).
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from core.engine.base import Engine
from core.lora import lora_of
from core.sessions import SessionStore
from core.tenants import Tenants
from core.types import FinishReason
from envflags.apikeys import ApiKeys

#: vLLM's TTFT bucket edges, in seconds.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
#: vLLM's inter-token latency bucket edges, in seconds.
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
#: vLLM's request latency bucket edges (end-to-end and queue time), in seconds.
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip

#: Label values of `trellis_core_requests_total`: a finish reason, or how a request ended
#: without one (the client went away: "cancelled"; it failed: "error").
FINISH_LABELS = tuple(r.value for r in FinishReason)


class Buckets:
    """A histogram updated from one thread: `observe` is a bisect and two additions.

    Args:
        bounds: upper bucket edges in increasing order (Prometheus `le`, inclusive); +Inf is
            implied.
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one value (seconds)."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, name: str, doc: str, labels: dict[str, str]) -> HistogramMetricFamily:
        """The histogram as a metric family (cumulative buckets, as Prometheus wants them)."""
        family = HistogramMetricFamily(name, doc, labels=list(labels))
        cumulative, total = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            total += count
            cumulative.append((bound, float(total)))
        family.add_metric(list(labels.values()), cumulative, self.sum)
        return family


class RequestMetrics:
    """What the pipeline counts (event loop thread only; see the module docstring).

    Attributes:
        prompt_tokens, generation_tokens: tokens of ended requests (generation: every
            sequence's, best_of candidates included).
        requests: ended requests by finish reason (FINISH_LABELS; the first returned
            sequence's reason for n > 1).
        rejected: requests refused at admission (RESOURCE_EXHAUSTED: the queue is full).
        slow_reader_cancels: requests cancelled because their client read too slowly
            (SLOW_READER, core.multiplex.StreamBounds).
        ttft, itl, queue_time, e2e: histograms, in seconds.
        step_outputs, delta_outputs: engine outputs by the path they took to the consumer:
            a plain decode step as values (`Job._is_plain_step`), or ResponseDeltas.
        adapter_requests, adapter_tokens: per LoRA adapter, ended requests and their
            generated tokens (requests of the base model are not listed).
    """

    __slots__ = (
        "adapter_requests",
        "adapter_tokens",
        "delta_outputs",
        "e2e",
        "generation_tokens",
        "itl",
        "prompt_tokens",
        "queue_time",
        "rejected",
        "requests",
        "slow_reader_cancels",
        "step_outputs",
        "ttft",
    )

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests = dict.fromkeys(FINISH_LABELS, 0)
        self.rejected = 0
        self.slow_reader_cancels = 0
        self.step_outputs = 0
        self.delta_outputs = 0
        self.ttft = Buckets(TTFT_BUCKETS)
        self.itl = Buckets(ITL_BUCKETS)
        self.queue_time = Buckets(REQUEST_LATENCY_BUCKETS)
        self.e2e = Buckets(REQUEST_LATENCY_BUCKETS)
        self.adapter_requests: dict[str, int] = {}
        self.adapter_tokens: dict[str, int] = {}

    def ended(
        self,
        reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        queue_s: float | None,
        e2e_s: float,
        adapter: str = "",
    ) -> None:
        """A request ended (finished, failed or cancelled); `queue_s` None: never scheduled;
        `adapter`: its LoRA adapter ("": the base model)."""
        if adapter:
            self.adapter_requests[adapter] = self.adapter_requests.get(adapter, 0) + 1
            self.adapter_tokens[adapter] = self.adapter_tokens.get(adapter, 0) + generation_tokens
        self.requests[reason] += 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens
        if queue_s is not None:
            self.queue_time.observe(queue_s)
        self.e2e.observe(e2e_s)


class CoreCollector(Collector):
    """Prometheus collector of one core: the pipeline's counts plus gauges read at scrape time.

    Args:
        counts: the pipeline's RequestMetrics.
        engine: its engine (`stats()`: running and waiting requests, prefix cache counters).
        sessions: the continue-generation store.
        max_batch_size: requests the running batch holds (slot usage = running / this).
        model_name: the `model_name` label of every sample, as vLLM labels its metrics.
        tenants: the per-tenant counts (core.tenants), exported with a `tenant` label.
    """

    def __init__(
        self,
        counts: RequestMetrics,
        engine: Engine,
        sessions: SessionStore,
        max_batch_size: int,
        model_name: str,
        tenants: Tenants | None = None,
    ):
        self.counts = counts
        self.tenants = tenants
        self.engine = engine
        self.sessions = sessions
        self.max_batch_size = max(1, max_batch_size)
        self.labels = {"model_name": model_name}

    def collect(self) -> Iterator[Metric]:
        """The metric families of one scrape."""
        c, labels = self.counts, self.labels
        stats = self.engine.stats()
        usage = min(1.0, stats.active / self.max_batch_size)
        gauges: list[tuple[str, str, float]] = [
            ("trellis_core_num_requests_running", "Requests in the running batch.", stats.active),
            ("trellis_core_num_requests_waiting", "Requests admitted and waiting for a batch slot.", stats.queued),
            ("trellis_core_batch_size", "Requests in the batch of the current engine step.", stats.active),
            ("trellis_core_slot_usage_perc", "Running requests over --max-batch-size, from 0 to 1.", usage),
            ("trellis_core_sessions", "Continue-generation sessions held.", len(self.sessions)),
            ("trellis_core_session_tokens", "Tokens held by continue-generation sessions.", self.sessions.total_tokens),
            ("trellis_core_session_bytes", "Bytes held by continue-generation sessions.", self.sessions.total_bytes),
            ("vllm:num_requests_running", "Requests in the running batch (vLLM's name).", stats.active),
            ("vllm:num_requests_waiting", "Requests waiting for a batch slot (vLLM's name).", stats.queued),
            ("vllm:kv_cache_usage_perc", "Batch slot usage from 0 to 1 (vLLM's name; see docs/metrics.md).", usage),
        ]
        gauges.append(
            (
                "trellis_core_engine_stall_seconds",
                "Seconds the engine has gone without a step while requests are pending (0: stepping or idle).",
                stats.stall_seconds,
            )
        )
        prefix = stats.prefix_cache
        if prefix is not None:
            gauges.append(("trellis_core_prefix_cache_blocks", "Prompt KV blocks in the prefix cache.", prefix.blocks))
        for name, doc, value in gauges:
            yield _gauge(name, doc, labels, value)
        if prefix is not None:
            for name in ("trellis_core_prefix_cache_queries", "vllm:prefix_cache_queries"):
                yield _counter(name, "Prompt tokens looked up in the prefix cache.", labels, prefix.queries)
            for name in ("trellis_core_prefix_cache_hits", "vllm:prefix_cache_hits"):
                yield _counter(name, "Prompt tokens whose KV came from the prefix cache.", labels, prefix.hits)
        yield _counter(
            "trellis_core_engine_restarts", "Times the engine process died and was restarted.", labels, stats.restarts
        )
        yield _counter("trellis_core_prompt_tokens", "Prompt tokens of ended requests.", labels, c.prompt_tokens)
        yield _counter(
            "trellis_core_generation_tokens", "Generated tokens of ended requests.", labels, c.generation_tokens
        )
        requests = CounterMetricFamily(
            "trellis_core_requests", "Ended requests by finish reason.", labels=[*labels, "finish_reason"]
        )
        for reason, count in c.requests.items():
            requests.add_metric([*labels.values(), reason], count)
        yield requests
        yield _counter(
            "trellis_core_admission_rejections", "Requests refused because the queue was full.", labels, c.rejected
        )
        yield _counter(
            "trellis_core_slow_reader_cancels",
            "Requests cancelled because their client read its stream too slowly (SLOW_READER).",
            labels,
            c.slow_reader_cancels,
        )
        paths = CounterMetricFamily(
            "trellis_core_stream_outputs",
            "Engine outputs delivered, by path: 'step' (a plain decode step sent as values) or 'delta' (the rest).",
            labels=[*labels, "path"],
        )
        paths.add_metric([*labels.values(), "step"], c.step_outputs)
        paths.add_metric([*labels.values(), "delta"], c.delta_outputs)
        yield paths
        yield c.ttft.family("trellis_core_time_to_first_token_seconds", "Time to first token.", labels)
        yield c.itl.family("trellis_core_inter_token_latency_seconds", "Time between engine steps' tokens.", labels)
        yield c.queue_time.family("trellis_core_request_queue_time_seconds", "Time waiting to be scheduled.", labels)
        yield c.e2e.family("trellis_core_e2e_request_latency_seconds", "Arrival to end of a request.", labels)
        if self.tenants is not None:
            yield from _tenant_families(self.tenants, labels)
        yield from self._lora_families()

    def _lora_families(self) -> Iterator[Metric]:
        """With an engine serving adapters: vLLM's `vllm:lora_requests_info` (labels
        `running_lora_adapters` and `waiting_lora_adapters`, comma-separated names of the
        adapters with requests running and waiting, and `max_lora`; the value the time of the
        scrape, as vLLM's `set_to_current_time`; vllm/v1/metrics/loggers.py, 0.10/0.11), which the
        Gateway API Inference Extension's LoRA-affinity scorer reads, and per-adapter counters of
        ended requests and their generated tokens."""
        lora = lora_of(self.engine)
        if lora is None:
            return
        labels, c = self.labels, self.counts
        statuses = lora.adapters()
        running = ",".join(s.spec.name for s in statuses if s.running)
        waiting = ",".join(s.spec.name for s in statuses if s.waiting)
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests (vLLM's name; the value is the time of the scrape).",
            labels=[*labels, "max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        info.add_metric([*labels.values(), str(lora.max_loras), waiting, running], time.time())
        yield info
        for name, doc, counts in (
            ("trellis_core_lora_requests", "Ended requests per LoRA adapter.", c.adapter_requests),
            (
                "trellis_core_lora_generation_tokens",
                "Generated tokens of ended requests per LoRA adapter.",
                c.adapter_tokens,
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=[*labels, "adapter"])
            for adapter, count in sorted(counts.items()):
                family.add_metric([*labels.values(), adapter], count)
            yield family


#: Per-tenant metric families: (name, help, kind, TenantCounts attribute).
TENANT_METRICS = (
    ("trellis_core_tenant_requests_waiting", "Requests of the tenant waiting for the batch.", "gauge", "waiting"),
    ("trellis_core_tenant_requests_running", "Requests of the tenant in the running batch.", "gauge", "running"),
    ("trellis_core_tenant_prompt_tokens", "Prompt tokens of the tenant's ended requests.", "counter", "prompt_tokens"),
    (
        "trellis_core_tenant_generation_tokens",
        "Generated tokens of the tenant's ended requests.",
        "counter",
        "generation_tokens",
    ),
    (
        "trellis_core_tenant_refusals",
        "Requests of the tenant refused (its limits or a full queue, or displaced from a full queue).",
        "counter",
        "refusals",
    ),
    (
        "trellis_core_tenant_preemptions",
        "Times a running request of the tenant was preempted for a waiting one (it resumes later).",
        "counter",
        "preemptions",
    ),
)


def _tenant_families(tenants: Tenants, labels: dict[str, str]) -> Iterator[Metric]:
    """The per-tenant families; the `tenant` label is bounded (core.tenants.MAX_TENANT_LABELS)."""
    counts = list(tenants.counts.items())
    names = [*labels, "tenant"]
    for name, doc, kind, attr in TENANT_METRICS:
        family: GaugeMetricFamily | CounterMetricFamily = (
            GaugeMetricFamily(name, doc, labels=names)
            if kind == "gauge"
            else CounterMetricFamily(name, doc, labels=names)
        )
        for label, c in counts:
            family.add_metric([*labels.values(), label], getattr(c, attr))
        yield family


def _gauge(name: str, doc: str, labels: dict[str, str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def _counter(name: str, doc: str, labels: dict[str, str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


class MetricsServer:
    """prometheus_client's HTTP server on its own thread, serving `/metrics` for a registry.

    Attributes:
        port: the bound port.
    """

    def __init__(self, server: WSGIServer, thread: threading.Thread):
        self._server = server
        self._thread = thread
        self.port = int(server.server_port)

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def core_registry(collector: CoreCollector) -> CollectorRegistry:
    """A registry with the core's collector and the process's CPU and memory metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ProcessCollector(registry=registry)
    return registry


def serve_metrics(registry: CollectorRegistry, host: str, port: int, keys: ApiKeys | None = None) -> MetricsServer:
    """Serve `registry` on http://host:port/metrics (port 0 picks a free one); with `keys`, only
    to scrapers that send `Authorization: Bearer <key>` (401 otherwise).

    Raises:
        OSError: the address cannot be listened on.
    """
    if keys is None:
        server, thread = start_http_server(port, addr=host, registry=registry)
        return MetricsServer(server, thread)
    metrics = make_wsgi_app(registry)

    def guarded(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        if keys.check(environ.get("HTTP_AUTHORIZATION")) is None:
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
        return [b"Missing or invalid API key: send 'Authorization: Bearer <key>'.\n"]

    server = make_server(host, port, guarded, ThreadingWSGIServer, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return MetricsServer(server, thread)


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        pass
