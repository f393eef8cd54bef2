"""The service's Prometheus metrics, served by GET /metrics (kernel_backend/api/monitoring.py).

Counted as they happen: HTTP requests by route, method and status, with their latency (the request-log middleware);
the tokens each finished job billed, by kind; jobs by request type and outcome (a failed one by whose fault: user or
server); requests refused at admission, by status (402 a budget, 429 a rate limit). Read from the executor when
scraped: workers by state, each worker's queue depth, each engine's adapter cache (resident bytes and adapters, its
spills, drops and restores) and decoder (rows decoding, requests waiting).

Each Service has a registry of its own (a test process may hold several services).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from kernel_backend.metering import Usage
    from kernel_backend.service.core import Service

# Seconds: an HTTP answer is milliseconds (a queued request answers at once with its future), a long poll up to 20 s.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)


class Metrics:
    def __init__(self, svc: Service) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("stepwise_http_requests", "HTTP requests answered, by route, method and status",
                                ["route", "method", "status"], registry=self.registry)
        self.latency = Histogram("stepwise_http_request_duration_seconds", "time to answer an HTTP request, by route",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tokens = Counter("stepwise_tokens", "tokens billed by finished jobs, by kind (prefill, sample, train)",
                              ["kind"], registry=self.registry)
        self.jobs = Counter("stepwise_jobs", "jobs finished, by request type and outcome (done, or failed_user / "
                            "failed_server)", ["request_type", "outcome"], registry=self.registry)
        self.refused = Counter("stepwise_refused_requests", "requests refused at admission, by HTTP status (402: a "
                               "budget, 429: a rate limit)", ["status"], registry=self.registry)
        self.registry.register(_Engines(svc))

    def job_done(self, request_type: str, status: str, usage: Usage | None, category: str | None) -> None:
        """One finished job (Service.on_done): its outcome, and the tokens it billed when it is done."""
        outcome = "done" if status == "done" else f"failed_{category or 'server'}"
        self.jobs.labels(request_type, outcome).inc()
        if usage is not None:
            for kind in ("prefill", "sample", "train"):
                if tokens := getattr(usage, f"{kind}_tokens"):
                    self.tokens.labels(kind).inc(tokens)


class _Engines:
    """What the executor holds now, read at each scrape (never cached: a scrape is the operator's question)."""

    def __init__(self, svc: Service) -> None:
        self.svc = svc

    def describe(self):
        return []  # names are known only at a scrape: no check against the counters' at registration

    def collect(self) -> Iterator:
        executor = self.svc.executor
        report = executor.report()
        workers = GaugeMetricFamily("stepwise_workers", "engine workers by state (live, lost, ...)", labels=["state"])
        states = collections.Counter(str(w.get("state", "unknown")) for w in report.get("workers", []))
        for state, count in sorted(states.items()):
            workers.add_metric([state], count)
        yield workers
        queue = GaugeMetricFamily("stepwise_queue_depth", "jobs queued on each worker", labels=["worker"])
        for worker in report.get("workers", []):
            if worker.get("queue_depth") is not None:
                queue.add_metric([str(worker.get("name"))], float(worker["queue_depth"]))
        yield queue
        resident = GaugeMetricFamily("stepwise_adapter_cache_bytes", "bytes of adapters resident on each engine's "
                                     "device", labels=["worker", "base_model"])
        held = GaugeMetricFamily("stepwise_adapter_cache_adapters", "adapters held by each engine, by where",
                                 labels=["worker", "base_model", "where"])
        events = CounterMetricFamily("stepwise_adapter_cache_events", "adapter cache events since the engine started "
                                     "(spills: moved off the device to make room; drops; restores)",
                                     labels=["worker", "base_model", "event"])
        for worker, models in executor.adapter_cache_stats().items():
            for model, stats in models.items():
                resident.add_metric([worker, model], float(stats.get("resident_bytes", 0)))
                held.add_metric([worker, model, "resident"], float(stats.get("resident", 0)))
                held.add_metric([worker, model, "spilled"], float(stats.get("spilled", 0)))
                for event in ("spills", "drops", "restores"):
                    events.add_metric([worker, model, event], float(stats.get(event, 0)))
        yield resident
        yield held
        yield events
        decoding = GaugeMetricFamily("stepwise_sampler_rows", "each engine's decoder: rows decoding, requests waiting",
                                     labels=["worker", "base_model", "what"])
        for worker, models in executor.sampling_stats().items():
            for model, stats in models.items():
                for what in ("rows", "waiting"):
                    if isinstance(stats.get(what), (int, float)):
                        decoding.add_metric([worker, model, what], float(stats[what]))
        yield decoding
