"""Prometheus metrics of a serving engine. Their names are defined once, in
:mod:`moefleet.metric_names` (re-exported here), so dashboards, the load generator and
simulator results share them.

Each :class:`ServeMetrics` owns its own registry: two servers in one process (tests) do not
collide. Counters only move forward; gauges are overwritten from the engine's state.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

# The names live in a leaf module (the simulator and the load generator use them without
# prometheus-client); re-exported here, where the metrics are.
from moefleet.metric_names import (
    BILLED_COST,
    CONTROLLER_SETTING,
    E2E,
    EXPERT_RETRIES,
    EXPERT_TOKENS,
    GENERATION_TOKENS,
    ITL,
    KV_CACHE_USAGE,
    MODEL_TOKENS,
    PREEMPTIONS,
    PREFIX,
    PROMPT_TOKENS,
    QUEUE,
    REQUEST_SUCCESS,
    REQUESTS_ABORTED,
    REQUESTS_FAILED,
    REQUESTS_REJECTED,
    RUNNING,
    SLO_PHASES,
    SLO_VIOLATIONS,
    TPOT,
    TTFT,
    WAITING,
)

__all__ = ["BILLED_COST", "CONTROLLER_SETTING", "E2E", "EXPERT_RETRIES", "EXPERT_TOKENS",
           "GENERATION_TOKENS", "ITL", "KV_CACHE_USAGE", "MODEL_TOKENS", "PREEMPTIONS", "PREFIX",
           "PROMPT_TOKENS", "QUEUE", "REQUESTS_ABORTED", "REQUESTS_FAILED", "REQUESTS_REJECTED",
           "REQUEST_SUCCESS", "RUNNING",
           "SLO_VIOLATIONS", "TPOT", "TTFT", "WAITING", "ServeMetrics"]

# The *_created series double the output and no dashboard reads them (vLLM drops them too).
disable_created_metrics()

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServeMetrics:
    """The metric objects of one server, in one registry."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        m = ["model_name"]
        self.model_name = model_name
        self.ttft = Histogram(TTFT, "Time to first token (arrival to first token).", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(ITL, "Gap between consecutive output tokens.", m,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(TPOT, "Mean time per output token after the first.", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(E2E, "Arrival to last token.", m, buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.queue = Histogram(QUEUE, "Arrival to first schedule.", m,
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge(RUNNING, "Requests in the running batch.", m, registry=r)
        self.waiting = Gauge(WAITING, "Requests waiting to be scheduled.", m, registry=r)
        self.kv_usage = Gauge(KV_CACHE_USAGE, "Fraction of KV-cache blocks in use (0..1).", m,
                              registry=r)
        self.prompt_tokens = Counter(PROMPT_TOKENS, "Prompt tokens of admitted requests.", m,
                                     registry=r)
        self.generation_tokens = Counter(GENERATION_TOKENS, "Tokens generated.", m, registry=r)
        self.model_tokens = Counter(MODEL_TOKENS, "Token rows through the model (prefill, "
                                    "decode and recompute after preemption).", m, registry=r)
        self.preemptions = Counter(PREEMPTIONS, "Requests preempted (cache exhausted).", m,
                                   registry=r)
        self.expert_tokens = Counter(EXPERT_TOKENS, "Token slots routed to each expert.",
                                     [*m, "layer", "expert"], registry=r)
        self.billed_cost = Counter(BILLED_COST, "Billed cost in USD (see the basis label).",
                                   [*m, "function", "part", "basis"], registry=r)
        self.slo_violations = Counter(SLO_VIOLATIONS, "Finished requests over an SLO.",
                                      [*m, "phase"], registry=r)
        self.success = Counter(REQUEST_SUCCESS, "Finished requests by finish reason.",
                               [*m, "finished_reason"], registry=r)
        self.aborted = Counter(REQUESTS_ABORTED, "Requests aborted (client went away).", m,
                               registry=r)
        self.rejected = Counter(REQUESTS_REJECTED, "Requests shed with 503 (queue full).", m,
                                registry=r)
        self.failed = Counter(REQUESTS_FAILED, "Requests ended by a failed model step "
                              "(an expert call that failed for good).", m, registry=r)
        self.expert_retries = Counter(EXPERT_RETRIES, "Expert calls retried after a "
                                      "transient failure.", m, registry=r)
        self.controller = Gauge(CONTROLLER_SETTING, "Controller settings of this server.",
                                [*m, "setting"], registry=r)
        # Every series present at 0 from the start, so rate() and tests see it move.
        for phase in SLO_PHASES:
            self.slo_violations.labels(model_name, phase)
        for metric in (self.running, self.waiting, self.kv_usage, self.prompt_tokens,
                       self.generation_tokens, self.model_tokens, self.preemptions,
                       self.aborted, self.rejected, self.failed, self.expert_retries):
            metric.labels(model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)
